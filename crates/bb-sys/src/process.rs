//! Starting a process in new namespaces with clone3, paused until the parent has set it up.
//!
//! The daemon is multi-threaded, so the child may only make async-signal-safe calls between clone
//! and execve: everything it needs (paths, argv, envp, fd plan) is prepared before the clone, and the
//! child does nothing but wait on the sync pipe, dup2, reset signal dispositions and execve.

use crate::{check, SysError, SysResult};
use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// `struct clone_args` from linux/sched.h (version 2, 88 bytes).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

pub const CLONE_INTO_CGROUP: u64 = 0x200000000;

/// What to start and how.
pub struct NsSpawn<'a> {
    /// Absolute path of the program to execute in the child.
    pub program: &'a CStr,
    pub argv: &'a [CString],
    pub envp: &'a [CString],
    /// (source fd in the parent, fd number in the child). Every other fd must be O_CLOEXEC.
    pub fds: &'a [(RawFd, RawFd)],
    /// CLONE_NEW* flags.
    pub namespaces: u64,
    /// cgroup v2 directory fd for CLONE_INTO_CGROUP; None on cgroup v1.
    pub cgroup_fd: Option<RawFd>,
    /// After release, switch to uid/gid 0 of the (new) user namespace before exec, so the program
    /// runs as that namespace's root with its full capability set. The parent must have written
    /// uid_map/gid_map by then.
    pub become_root: bool,
}

/// A child that is waiting for [`PausedChild::release`] before it executes its program.
pub struct PausedChild {
    pub pid: i32,
    release: Option<OwnedFd>,
}

impl PausedChild {
    /// Let the child execute its program.
    pub fn release(mut self) -> SysResult<()> {
        let fd = self.release.take().expect("released once");
        // SAFETY: writes one byte from a valid stack buffer to an fd we own.
        let ret = unsafe { libc::write(fd.as_raw_fd(), b"g".as_ptr().cast(), 1) };
        check("write(sync pipe)", ret as libc::c_long)?;
        Ok(())
    }
}

impl Drop for PausedChild {
    fn drop(&mut self) {
        // Dropping without release closes the pipe: the child reads EOF and exits 1.
        self.release.take();
    }
}

fn cloexec_pipe() -> SysResult<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds is a valid 2-element array for pipe2 to fill.
    let ret = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    check("pipe2", ret as libc::c_long)?;
    // SAFETY: pipe2 succeeded, so both fds are open and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Duplicate `fd` to a number >= `min` with O_CLOEXEC.
pub fn dup_high(fd: RawFd, min: RawFd) -> SysResult<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC only reads the fd table.
    let ret = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, min) };
    check("fcntl(F_DUPFD_CLOEXEC)", ret as libc::c_long)?;
    // SAFETY: fcntl returned a fresh fd that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(ret) })
}

/// Duplicate `fd` onto the number `target` (closed first if open), close-on-exec; the duplicate
/// stays open for the life of the process (it is not owned by anything).
pub fn dup_cloexec_to(fd: RawFd, target: RawFd) -> SysResult<()> {
    // SAFETY: dup3 only changes this process's fd table; `target` is the caller's to claim.
    let ret = unsafe { libc::dup3(fd, target, libc::O_CLOEXEC) };
    check("dup3", ret as libc::c_long)?;
    Ok(())
}

/// clone3 a child into new namespaces; it blocks until [`PausedChild::release`] and then execs.
pub fn spawn_paused(spec: &NsSpawn<'_>) -> SysResult<PausedChild> {
    let (sync_r, sync_w) = cloexec_pipe()?;
    // Move every source fd above the highest target so dup2 in the child never clobbers a source.
    let high: Vec<(OwnedFd, RawFd)> =
        spec.fds.iter().map(|&(src, dst)| dup_high(src, 256).map(|fd| (fd, dst))).collect::<SysResult<_>>()?;
    let plan: Vec<(RawFd, RawFd)> = high.iter().map(|(fd, dst)| (fd.as_raw_fd(), *dst)).collect();

    let mut argv: Vec<*const libc::c_char> = spec.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = spec.envp.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());

    let mut args = CloneArgs { flags: spec.namespaces, exit_signal: libc::SIGCHLD as u64, ..Default::default() };
    if let Some(cg) = spec.cgroup_fd {
        args.flags |= CLONE_INTO_CGROUP;
        args.cgroup = cg as u64;
    }
    // SAFETY: args is a valid clone_args of the size we pass; without CLONE_VM this behaves like fork.
    let pid = unsafe { libc::syscall(libc::SYS_clone3, &mut args as *mut CloneArgs, std::mem::size_of::<CloneArgs>()) };
    if pid < 0 {
        return Err(SysError::last("clone3"));
    }
    if pid == 0 {
        // Child: async-signal-safe calls only.
        // SAFETY: every pointer was prepared before the clone and stays valid (copied address space).
        unsafe {
            child_after_clone(
                sync_r.as_raw_fd(),
                sync_w.as_raw_fd(),
                &plan,
                spec.become_root,
                spec.program.as_ptr(),
                &argv,
                &envp,
            )
        }
    }
    drop(sync_r);
    drop(high);
    Ok(PausedChild { pid: pid as i32, release: Some(sync_w) })
}

/// # Safety
/// Only to be called in the child right after clone; pointers must stay valid.
unsafe fn child_after_clone(
    sync_r: RawFd,
    sync_w: RawFd,
    plan: &[(RawFd, RawFd)],
    become_root: bool,
    program: *const libc::c_char,
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
) -> ! {
    // Our copy of the write end would keep the pipe from ever reaching EOF.
    libc::close(sync_w);
    let mut b = 0u8;
    // Wait for the parent: EOF means it gave up on us.
    if libc::read(sync_r, (&mut b as *mut u8).cast(), 1) != 1 {
        libc::_exit(1);
    }
    if become_root {
        // Raw syscalls: glibc's set*id wrappers would try to signal the parent's other threads,
        // which do not exist in this child.
        if libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) < 0
            || libc::syscall(libc::SYS_setresgid, 0, 0, 0) < 0
            || libc::syscall(libc::SYS_setresuid, 0, 0, 0) < 0
        {
            libc::_exit(125);
        }
    }
    for &(src, dst) in plan {
        if libc::dup2(src, dst) < 0 {
            libc::_exit(126);
        }
    }
    // Rust ignores SIGPIPE; ignored dispositions survive execve, so restore the default.
    libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    let mut empty: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut empty);
    libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    libc::execve(program, argv.as_ptr(), envp.as_ptr());
    libc::_exit(127);
}

/// The fields of `<proc_dir>/stat` after the command name, from field 3 (state) on: comm may
/// contain spaces and parens, so they start after the last ')'.
fn stat_fields(proc_dir: &std::path::Path) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(proc_dir.join("stat")).ok()?;
    Some(stat[stat.rfind(')')? + 1..].split_whitespace().map(String::from).collect())
}

/// Field 22 of /proc/<pid>/stat: start time in clock ticks since boot. With the pid it identifies a
/// process across pid reuse.
pub fn process_start_time(pid: i32) -> Option<u64> {
    stat_fields(std::path::Path::new(&format!("/proc/{pid}")))?.get(19)?.parse().ok()
}

/// The parent pid of the process whose procfs directory is `proc_dir` (pids as that procfs
/// sees them), or None when it is gone or dead (a zombie waiting to be reaped).
pub fn live_parent_pid(proc_dir: &std::path::Path) -> Option<i32> {
    live_parent_in(&std::fs::read_to_string(proc_dir.join("stat")).ok()?)
}

/// [`live_parent_pid`] of a `stat` line (state and parent follow the last ')').
fn live_parent_in(stat: &str) -> Option<i32> {
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    match fields.next()? {
        "Z" | "X" => None,
        _ => fields.next()?.parse().ok(),
    }
}

/// The process group and session of the process whose procfs directory is `proc_dir` (ids as
/// that procfs sees them; 0: outside its pid namespace), or None when it is gone. A zombie has
/// them too until it is reaped.
pub fn group_and_session(proc_dir: &std::path::Path) -> Option<(i32, i32)> {
    group_and_session_in(&std::fs::read_to_string(proc_dir.join("stat")).ok()?)
}

/// [`group_and_session`] of a `stat` line (state, parent, group and session follow the last ')').
fn group_and_session_in(stat: &str) -> Option<(i32, i32)> {
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace().skip(2);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

/// Whether the process whose procfs directory is `proc_dir` still holds what it owns (memory,
/// files, mounts): it exists and is not a zombie (or dead) waiting to be reaped.
pub fn proc_dir_holds_resources(proc_dir: &std::path::Path) -> bool {
    stat_fields(proc_dir).is_some_and(|f| !matches!(f.first().map(String::as_str), Some("Z" | "X") | None))
}

/// pivot_root(2) onto the current directory and detach the old root (the `pivot_root(".", ".")` idiom).
pub fn pivot_root_here() -> SysResult<()> {
    let dot = c".";
    // SAFETY: both arguments are valid NUL-terminated strings.
    let ret = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) };
    check("pivot_root", ret)?;
    // SAFETY: valid NUL-terminated path.
    let ret = unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) };
    check("umount2(old root)", ret as libc::c_long)?;
    Ok(())
}

/// Bring the loopback interface of the current network namespace up.
pub fn loopback_up() -> SysResult<()> {
    // SAFETY: plain socket creation.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    check("socket(AF_INET)", sock as libc::c_long)?;
    // SAFETY: socket() returned a fresh fd we own.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    // SAFETY: ifreq is plain old data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (i, b) in b"lo".iter().enumerate() {
        req.ifr_name[i] = *b as libc::c_char;
    }
    // SAFETY: req is a valid ifreq for SIOCGIFFLAGS.
    let ret = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) };
    check("ioctl(SIOCGIFFLAGS)", ret as libc::c_long)?;
    // SAFETY: ifru_flags is the active union member after SIOCGIFFLAGS.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    // SAFETY: req is a valid ifreq for SIOCSIFFLAGS.
    let ret = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) };
    check("ioctl(SIOCSIFFLAGS)", ret as libc::c_long)?;
    Ok(())
}

/// Set the calling thread's nice value (Linux: priorities are per thread). Background work
/// runs at 10-19 so requests come first; a worker thread taken from a shared pool must be put
/// back to 0. Best effort.
pub fn set_thread_nice(nice: i32) {
    // SAFETY: setpriority on this thread (its tid) with plain integers.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) };
}

/// This thread at niceness `nice` until the guard is dropped, then back to 0: background work
/// on a pooled thread (tokio's blocking pool) must not leave it slow for the requests it runs
/// next.
pub fn niced_thread(nice: i32) -> NicedThread {
    set_thread_nice(nice);
    NicedThread(())
}

/// See [`niced_thread`].
pub struct NicedThread(());

impl Drop for NicedThread {
    fn drop(&mut self) {
        set_thread_nice(0);
    }
}

/// pidfd_open(2): an fd that becomes readable when `pid` exits.
pub fn pidfd_open(pid: i32) -> SysResult<OwnedFd> {
    // SAFETY: pidfd_open takes plain integers.
    let ret = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = check("pidfd_open", ret)?;
    // SAFETY: the kernel returned a fresh fd that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Wait at most `timeout` for the process of `pidfd` to exit (its pidfd becomes readable).
/// Returns whether it has; it is not reaped.
pub fn pidfd_wait_exit(pidfd: &OwnedFd, timeout: std::time::Duration) -> SysResult<bool> {
    let mut pfd = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        let ret = unsafe { libc::poll(&mut pfd, 1, ms) };
        if ret > 0 {
            return Ok(true);
        }
        if ret == 0 {
            return Ok(false);
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(SysError { call: "poll(pidfd)", source: err });
        }
    }
}

/// pidfd_send_signal(2): send `sig` to the process of `pidfd` (never another that took its pid).
pub fn pidfd_send_signal(pidfd: &OwnedFd, sig: i32) -> SysResult<()> {
    // SAFETY: pidfd_send_signal with a pidfd we hold for the call, no siginfo, no flags.
    let ret = unsafe {
        libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), sig, std::ptr::null::<libc::siginfo_t>(), 0)
    };
    check("pidfd_send_signal", ret).map(drop)
}

/// Send `sig` to the process whose procfs directory is `proc_dir` (`/proc/<pid>` of any
/// procfs instance, e.g. one mounted in a sandbox's pid namespace): pidfd_send_signal(2) takes
/// such a directory fd, so no pid is translated between namespaces.
pub fn signal_proc_dir(proc_dir: &std::path::Path, sig: i32) -> SysResult<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(proc_dir)
        .map_err(|source| SysError { call: "open(/proc/<pid>)", source })?;
    // SAFETY: pidfd_send_signal with a directory fd we hold for the call, no siginfo, no flags.
    let ret = unsafe {
        libc::syscall(libc::SYS_pidfd_send_signal, dir.as_raw_fd(), sig, std::ptr::null::<libc::siginfo_t>(), 0)
    };
    check("pidfd_send_signal", ret).map(drop)
}

/// `kill(pid, sig)`: signal the one process `pid` (`sig` 0 only checks that it exists and may be
/// signalled). `pid` must be positive: kill(2)'s broadcast forms (0: our process group, -1:
/// every process we may signal, -N: group N) are refused with `EINVAL` instead of being reached
/// by a pid that was never set; use [`kill_group`] for a group. Async-signal-safe, never
/// allocates (also usable between fork and exec).
pub fn kill(pid: i32, sig: i32) -> SysResult<()> {
    if pid <= 0 {
        return Err(SysError { call: "kill", source: std::io::Error::from_raw_os_error(libc::EINVAL) });
    }
    // SAFETY: kill(2) with plain integers; pid > 0 names a single process.
    let ret = unsafe { libc::kill(pid, sig) };
    check("kill", ret as libc::c_long).map(drop)
}

/// `kill(-pgid, sig)`: signal every process of process group `pgid` (a session leader's
/// group id is its pid). `pgid` must be above 1: `kill(-1)` would signal every process we
/// may signal and `kill(0)` our own group, so those are refused with `EINVAL`.
/// Async-signal-safe, never allocates.
pub fn kill_group(pgid: i32, sig: i32) -> SysResult<()> {
    if pgid <= 1 {
        return Err(SysError { call: "kill(-pgid)", source: std::io::Error::from_raw_os_error(libc::EINVAL) });
    }
    // SAFETY: kill(2) with plain integers; -pgid < -1 names exactly one process group.
    let ret = unsafe { libc::kill(-pgid, sig) };
    check("kill(-pgid)", ret as libc::c_long).map(drop)
}

/// Reap child `pid` once it has exited, waiting at most `timeout` for it to (a killed process
/// may still be on its way out). Returns whether it was reaped; false also when it is not our
/// child (ECHILD).
pub fn reap_child(pid: i32, timeout: std::time::Duration) -> bool {
    if let Ok(fd) = pidfd_open(pid) {
        let _ = pidfd_wait_exit(&fd, timeout);
    }
    // SAFETY: non-blocking waitpid on a specific pid, no status wanted.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) == pid }
}

/// The pid (in our pid namespace) of the process a pidfd refers to, from `/proc/self/fdinfo`.
/// `ESRCH` if it has exited (fdinfo then says -1).
pub fn pidfd_pid(pidfd: &OwnedFd) -> SysResult<i32> {
    let path = format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd());
    let text = std::fs::read_to_string(&path).map_err(|source| SysError { call: "read fdinfo", source })?;
    let pid =
        text.lines().find_map(|l| l.strip_prefix("Pid:")).and_then(|v| v.trim().parse::<i32>().ok()).ok_or_else(
            || SysError { call: "pidfd fdinfo", source: std::io::Error::from_raw_os_error(libc::EINVAL) },
        )?;
    if pid <= 0 {
        return Err(SysError { call: "pidfd fdinfo", source: std::io::Error::from_raw_os_error(libc::ESRCH) });
    }
    Ok(pid)
}

/// `pidfd_getfd(pidfd, fd)`: a duplicate of another process's fd (needs ptrace access to it).
pub fn pidfd_getfd(pidfd: &OwnedFd, fd: RawFd) -> SysResult<OwnedFd> {
    // SAFETY: plain integer arguments.
    let ret = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    let fd = check("pidfd_getfd", ret)?;
    // SAFETY: the kernel returned a fresh fd that we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `MADV_COLLAPSE` (Linux 6.1): back a range with transparent huge pages now.
pub const MADV_COLLAPSE: i32 = 25;

/// `process_madvise(pidfd, ranges, advice)` on another process's memory. Returns the bytes
/// advised (the kernel stops at the first failing range).
pub fn process_madvise(pidfd: &OwnedFd, ranges: &[(u64, u64)], advice: i32) -> SysResult<usize> {
    let iov: Vec<libc::iovec> =
        ranges.iter().map(|(a, l)| libc::iovec { iov_base: *a as *mut _, iov_len: *l as usize }).collect();
    // SAFETY: iov is a valid array of iovecs for the duration of the call; the kernel reads the
    // ranges of the target process, not ours.
    let ret =
        unsafe { libc::syscall(libc::SYS_process_madvise, pidfd.as_raw_fd(), iov.as_ptr(), iov.len(), advice, 0) };
    check("process_madvise", ret).map(|n| n as usize)
}

/// Anonymous private writable mappings of `pid` of at least `min` bytes, as (start, length),
/// from `/proc/<pid>/maps` (heap and anonymous mmaps; not stacks or files).
pub fn anon_rw_regions(pid: i32, min: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mut out = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(_), Some(_), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let name = f.next().unwrap_or("");
        if !perms.starts_with("rw") || !perms.ends_with('p') || inode != "0" || !(name.is_empty() || name == "[heap]") {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else { continue };
        if b - a >= min {
            out.push((a, b - a));
        }
    }
    Ok(out)
}

/// Anonymous memory of `pid` resident in 4 KiB pages (`Anonymous` minus `AnonHugePages` of
/// `/proc/<pid>/smaps_rollup`), in bytes.
pub fn small_anon_bytes(pid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find_map(|l| l.strip_prefix(name))?;
        line.trim().strip_suffix("kB")?.trim().parse::<u64>().ok().map(|k| k * 1024)
    };
    Some(field("Anonymous:")?.saturating_sub(field("AnonHugePages:").unwrap_or(0)))
}

/// A process's pid in each pid namespace it is visible in, outermost (ours) first: the `NSpid`
/// line of `/proc/<pid>/status`.
pub fn ns_pids(pid: i32) -> Option<Vec<i32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    line.split_whitespace().map(|p| p.parse().ok()).collect()
}

/// close_range(first, ~0, 0): close every fd >= first.
pub fn close_fds_from(first: u32) -> SysResult<()> {
    // SAFETY: close_range only affects this process's fd table.
    let ret = unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, 0u32) };
    check("close_range", ret)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_live_parent_is_read_past_any_command_name_and_not_of_a_zombie() {
        assert_eq!(super::live_parent_in("12 (python3) S 1 12 12 0"), Some(1));
        assert_eq!(super::live_parent_in("7 (a) b) c) R 5 7 7 0"), Some(5));
        assert_eq!(super::live_parent_in("garbage"), None);
        assert_eq!(super::live_parent_in("12 (sh) Z 1 12 12 0"), None);
        assert_eq!(super::live_parent_in("12 (sh) X 1 12 12 0"), None);
    }

    #[test]
    fn group_and_session_of_a_stat_line() {
        assert_eq!(super::group_and_session_in("12 (python3) S 1 10 9 0"), Some((10, 9)));
        assert_eq!(super::group_and_session_in("7 (a) b) c) Z 5 2 2 0"), Some((2, 2)));
        assert_eq!(super::group_and_session_in("7 (a) R 5 2"), None);
        assert_eq!(super::group_and_session_in("garbage"), None);
    }

    use super::*;

    #[test]
    fn start_time_of_self_is_readable_and_stable() {
        let me = std::process::id() as i32;
        let a = process_start_time(me).expect("own start time");
        assert_eq!(Some(a), process_start_time(me));
        assert_eq!(process_start_time(i32::MAX), None);
    }

    /// A child of ours that sleeps until signalled, in a process group of its own.
    fn sleeper() -> std::process::Child {
        use std::os::unix::process::CommandExt;
        std::process::Command::new("/bin/sleep").arg("60").process_group(0).spawn().unwrap()
    }

    fn signal_of(mut child: std::process::Child) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        child.wait().unwrap().signal()
    }

    #[test]
    fn kill_signals_a_child_and_probes_with_signal_0() {
        let child = sleeper();
        let pid = child.id() as i32;
        kill(pid, 0).unwrap();
        kill(pid, libc::SIGTERM).unwrap();
        assert_eq!(signal_of(child), Some(libc::SIGTERM));
        // Reaped: the pid names nothing now (pids are not reused this quickly).
        let e = kill(pid, 0).unwrap_err();
        assert_eq!((e.call, e.errno()), ("kill", libc::ESRCH), "{e}");
    }

    #[test]
    fn kill_of_a_nonexistent_pid_is_esrch() {
        // Above the kernel's pid_max limit (4M): no process can have it.
        let e = kill(i32::MAX, libc::SIGKILL).unwrap_err();
        assert_eq!(e.errno(), libc::ESRCH, "{e}");
        let e = kill_group(i32::MAX, libc::SIGKILL).unwrap_err();
        assert_eq!((e.call, e.errno()), ("kill(-pgid)", libc::ESRCH), "{e}");
    }

    #[test]
    fn kill_refuses_the_broadcast_forms() {
        for pid in [0, -1, -2, i32::MIN] {
            let e = kill(pid, 0).unwrap_err();
            assert_eq!(e.errno(), libc::EINVAL, "kill({pid}): {e}");
        }
        for pgid in [1, 0, -1, -5] {
            let e = kill_group(pgid, 0).unwrap_err();
            assert_eq!(e.errno(), libc::EINVAL, "kill_group({pgid}): {e}");
        }
    }

    #[test]
    fn kill_group_reaches_every_member() {
        use std::os::unix::process::CommandExt;
        let leader = sleeper();
        let pgid = leader.id() as i32;
        let member = std::process::Command::new("/bin/sleep").arg("60").process_group(pgid).spawn().unwrap();
        let outsider = sleeper();
        kill_group(pgid, libc::SIGKILL).unwrap();
        assert_eq!(signal_of(leader), Some(libc::SIGKILL));
        assert_eq!(signal_of(member), Some(libc::SIGKILL));
        // Another group is left alone.
        kill(outsider.id() as i32, 0).unwrap();
        kill(outsider.id() as i32, libc::SIGTERM).unwrap();
        assert_eq!(signal_of(outsider), Some(libc::SIGTERM));
    }

    #[test]
    fn spawn_paused_runs_program_only_after_release() {
        let (r, w) = cloexec_pipe().unwrap();
        let prog = CString::new("/bin/sh").unwrap();
        let argv = [prog.clone(), CString::new("-c").unwrap(), CString::new("echo ran >&5").unwrap()];
        let child = spawn_paused(&NsSpawn {
            program: &prog,
            argv: &argv,
            envp: &[],
            fds: &[(w.as_raw_fd(), 5)],
            namespaces: 0,
            cgroup_fd: None,
            become_root: false,
        })
        .unwrap();
        drop(w);
        // Not released yet: nothing written (poll for a moment).
        let mut pfd = libc::pollfd { fd: r.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, 100) };
        assert_eq!(n, 0, "child ran before release");
        let pid = child.pid;
        child.release().unwrap();
        let mut out = String::new();
        use std::io::Read;
        std::fs::File::from(r).read_to_string(&mut out).unwrap();
        assert_eq!(out, "ran\n");
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    }

    #[test]
    fn dropping_unreleased_child_makes_it_exit() {
        let prog = CString::new("/bin/true").unwrap();
        let child = spawn_paused(&NsSpawn {
            program: &prog,
            argv: std::slice::from_ref(&prog),
            envp: &[],
            fds: &[],
            namespaces: 0,
            cgroup_fd: None,
            become_root: false,
        })
        .unwrap();
        let pid = child.pid;
        drop(child);
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(libc::WEXITSTATUS(status), 1);
    }
}

/// `struct procmap_query` (linux/fs.h, Linux 6.11).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `PROCMAP_QUERY` = `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong =
    (3 << 30) | ((std::mem::size_of::<ProcmapQuery>() as libc::c_ulong) << 16) | ((b'f' as libc::c_ulong) << 8) | 17;
const PROCMAP_QUERY_VMA_WRITABLE: u64 = 0x02;
const PROCMAP_QUERY_VMA_SHARED: u64 = 0x08;
const PROCMAP_QUERY_COVERING_OR_NEXT_VMA: u64 = 0x10;
const PROCMAP_QUERY_FILE_BACKED_VMA: u64 = 0x20;

/// Shared writable file mappings of a process (the ones that write to their file), as (inode,
/// path as the caller's root sees it), from its `maps` file (`/proc/<pid>/maps`, opened by
/// the caller). Asks the kernel for just those mappings (`PROCMAP_QUERY`, Linux 6.11): no text
/// of the process's hundreds of other mappings is made (that text is most of the cost for a
/// Python process that imported a framework). Older kernels: the text is parsed.
pub fn shared_writable_file_maps(maps: &std::fs::File) -> std::io::Result<Vec<(u64, std::path::PathBuf)>> {
    match query_shared_writable_maps(maps)? {
        Some(v) => Ok(v),
        None => shared_writable_file_maps_text(maps),
    }
}

/// The `PROCMAP_QUERY` part of [`shared_writable_file_maps`]; `None`: the kernel lacks it.
fn query_shared_writable_maps(maps: &std::fs::File) -> std::io::Result<Option<Vec<(u64, std::path::PathBuf)>>> {
    use std::os::unix::ffi::OsStrExt;
    let mut out = Vec::new();
    let mut addr = 0u64;
    let mut name = vec![0u8; libc::PATH_MAX as usize];
    loop {
        let mut q = ProcmapQuery {
            size: std::mem::size_of::<ProcmapQuery>() as u64,
            query_flags: PROCMAP_QUERY_COVERING_OR_NEXT_VMA
                | PROCMAP_QUERY_FILE_BACKED_VMA
                | PROCMAP_QUERY_VMA_WRITABLE
                | PROCMAP_QUERY_VMA_SHARED,
            query_addr: addr,
            vma_name_size: name.len() as u32,
            vma_name_addr: name.as_mut_ptr() as u64,
            ..Default::default()
        };
        // SAFETY: q is a valid procmap_query of the size it declares; vma_name_addr points to
        // `name`, writable for vma_name_size bytes, alive for the call; build_id_size is 0.
        let ret = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY, &mut q as *mut ProcmapQuery) };
        if ret < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOENT) => Ok(Some(out)),
                Some(libc::ENOTTY) | Some(libc::EINVAL) => Ok(None),
                _ => Err(e),
            };
        }
        // vma_name_size counts the terminating NUL.
        let len = (q.vma_name_size as usize).saturating_sub(1).min(name.len());
        out.push((q.inode, std::path::PathBuf::from(std::ffi::OsStr::from_bytes(&name[..len]))));
        if q.vma_end <= addr {
            return Ok(Some(out));
        }
        addr = q.vma_end;
    }
}

/// [`shared_writable_file_maps`] from the text of `maps` ("addr perms offset dev inode path").
fn shared_writable_file_maps_text(maps: &std::fs::File) -> std::io::Result<Vec<(u64, std::path::PathBuf)>> {
    use std::io::Read;
    let mut text = String::new();
    (&*maps).read_to_string(&mut text)?;
    Ok(parse_shared_writable_maps(&text))
}

fn parse_shared_writable_maps(text: &str) -> Vec<(u64, std::path::PathBuf)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut f = line.splitn(6, ' ');
        let (Some(_), Some(perms), Some(_), Some(_), Some(ino)) = (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let pb = perms.as_bytes();
        if pb.len() < 4 || pb[1] != b'w' || pb[3] != b's' {
            continue;
        }
        let path = f.next().unwrap_or("").trim_start();
        match ino.parse::<u64>() {
            Ok(ino) if ino != 0 && path.starts_with('/') => out.push((ino, std::path::PathBuf::from(path))),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod maps_tests {
    use super::*;

    #[test]
    fn only_shared_writable_file_mappings_are_listed() {
        let text = "\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000001000 rw-s 00000000 00:2a 1234                       /work/data.bin
7f0000001000-7f0000002000 r--s 00000000 00:2a 1235                       /work/ro.bin
7f0000002000-7f0000003000 rw-p 00000000 00:2a 1236                       /work/private.bin
7f0000003000-7f0000004000 rw-s 00000000 00:01 77                         /dev/zero (deleted)
7f0000004000-7f0000005000 rw-s 00000000 00:2a 1237                       /work/with space.bin
";
        let got = parse_shared_writable_maps(text);
        assert_eq!(
            got,
            vec![
                (1234, std::path::PathBuf::from("/work/data.bin")),
                (77, std::path::PathBuf::from("/dev/zero (deleted)")),
                (1237, std::path::PathBuf::from("/work/with space.bin")),
            ]
        );
    }

    #[test]
    fn the_kernel_query_finds_a_shared_writable_mapping_of_our_own() {
        let dir = std::env::temp_dir().join(format!("bb-maps-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("shared.bin");
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        f.set_len(4096).unwrap();
        // SAFETY: a fresh shared mapping of a file we own, unmapped below; nothing else uses it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let maps = std::fs::File::open("/proc/self/maps").unwrap();
        let got = shared_writable_file_maps(&maps).unwrap();
        // Kernels since 6.11 answer the query (this machine's do): same answer as the text.
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut v = release.trim().split(['.', '-']).map(|x| x.parse::<u32>().unwrap_or(0));
        let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
        let queried = query_shared_writable_maps(&maps).unwrap();
        if (major, minor) >= (6, 11) {
            assert_eq!(queried.as_ref(), Some(&got));
        }
        assert_eq!(shared_writable_file_maps_text(&std::fs::File::open("/proc/self/maps").unwrap()).unwrap(), got);
        let ino = std::os::unix::fs::MetadataExt::ino(&f.metadata().unwrap());
        // SAFETY: the mapping made above, not used after this.
        unsafe { libc::munmap(p, 4096) };
        let _ = std::fs::remove_dir_all(&dir);
        assert!(got.iter().any(|(i, p)| *i == ino && p == &path), "{got:?} lacks {ino} {}", path.display());
        // Libraries and the heap are not shared writable mappings.
        assert!(got.iter().all(|(_, p)| !p.to_string_lossy().contains(".so")), "{got:?}");
    }
}
