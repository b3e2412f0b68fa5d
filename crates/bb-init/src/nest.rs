//! Nested sandboxes: the init of a fork child, started from inside its parent sandbox.
//!
//! A forked sandbox's live sessions are copies of the parent's session templates made by
//! `fork(2)`, and a forked process keeps its parent's user and pid namespaces unless it can
//! `setns` into others, which takes capabilities over their user namespace. So a fork child's
//! namespaces are created *below* the parent's: the parent's init (which keeps its capabilities)
//! starts a copy of this binary ([`spawn_nested`]), which makes a user namespace nested in the
//! parent's (identity-mapped, so files keep their owners) and, owning it, new mount, pid, net,
//! uts, ipc and cgroup namespaces ([`enter_namespaces`]). The daemon then joins session copies to
//! them (see `bb_sys::ptrace`).
//!
//! Two details matter for isolation. The copy is a fork of the parent's init made *before* it
//! leaves the parent's user namespace, so its memory belongs to the user namespace the first
//! init of the family was exec'd in (`mm->user_ns` is inherited by fork), where every sandbox
//! process lacks CAP_SYS_PTRACE: the parent sandbox cannot read or alter the child's init even
//! though it owns the child's user namespace. (That is also why the parent init can write the
//! child's uid_map: /proc files of a non-dumpable process belong to root of that namespace.)
//! And the copy is moved into the child's cgroups before it makes its namespaces.

use bb_proto::InitConfig;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// In the nested init (a fork of its parent init, no exec), the new sandbox's root: a detached
/// mount (`fsmount`/`open_tree`) made by the daemon.
const NEST_ROOT_FD: RawFd = 5;
/// In the nested init, the socket to its parent init while they set it up (both directions;
/// fds travel over it too).
const NEST_SYNC_FD: RawFd = 6;

/// How long the parent waits for each step of a nested init.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// Namespaces a nested init makes once it owns its user namespace.
const NESTED_NAMESPACES: libc::c_int = libc::CLONE_NEWNS
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWPID;

fn errno_msg(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

/// Receive one message (a JSON string) and its fds from the sync socket within
/// [`STEP_TIMEOUT`]. A message starting with "error: " is the other side's failure.
fn recv_msg(fd: &impl AsFd) -> Result<(String, Vec<OwnedFd>), String> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let deadline = std::time::Instant::now() + STEP_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err("nested init did not answer in time".into());
        }
        let mut pfd = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut pfd, PollTimeout::try_from(left.as_millis() as i32).unwrap_or(PollTimeout::MAX)) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => break,
            Err(e) => return Err(format!("poll: {e}")),
        }
    }
    match bb_proto::recv::<String>(fd.as_fd().as_raw_fd()) {
        Ok((m, _)) if m.starts_with("error: ") => Err(format!("nested init: {}", &m[7..])),
        Ok(x) => Ok(x),
        Err(bb_proto::ProtoError::Closed) => Err("nested init exited early".into()),
        Err(e) => Err(format!("nested init: {e}")),
    }
}

/// How many ids our own user namespace maps (the nested one maps the same range onto itself).
fn mapped_ids(file: &str) -> Result<u64, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
    let total: u64 = text.lines().filter_map(|l| l.split_whitespace().nth(2)?.parse::<u64>().ok()).sum();
    if total == 0 {
        return Err(format!("{file} maps no ids"));
    }
    Ok(total)
}

/// Parent side, in the parent sandbox's init: start the nested init and return its pid (in our
/// pid namespace) once it has made its namespaces. `fds` = [listener, status pipe, root mount,
/// log file (its stdout and stderr), cgroup.procs files...] as in `Request::Nest`.
///
/// The nested init is a `fork` of this process, not a new exec: the sandbox's root need not
/// contain anything (an exec would resolve the binary's ELF interpreter in it), the copy is
/// non-dumpable from the start, and its memory belongs to the same user namespace as ours.
pub fn spawn_nested(config: &InitConfig, fds: Vec<OwnedFd>) -> Result<i32, String> {
    if fds.len() < 4 {
        return Err(format!("nest needs at least 4 fds (listener, status, root, log), got {}", fds.len()));
    }
    if !config.nested {
        return Err("nest config must have \"nested\": true".into());
    }
    let mut fds = fds.into_iter();
    let (listener, status, root, log) =
        (fds.next().unwrap(), fds.next().unwrap(), fds.next().unwrap(), fds.next().unwrap());
    let cgroup_procs: Vec<OwnedFd> = fds.collect();
    let (sync, theirs) = bb_proto::seqpacket_pair().map_err(|e| format!("socketpair: {e}"))?;
    // (source, target) in the child.
    let plan: [(RawFd, RawFd); 6] = [
        (log.as_raw_fd(), 1),
        (log.as_raw_fd(), 2),
        (listener.as_raw_fd(), bb_proto::INIT_LISTEN_FD),
        (status.as_raw_fd(), bb_proto::INIT_STATUS_FD),
        (root.as_raw_fd(), NEST_ROOT_FD),
        (theirs.as_raw_fd(), NEST_SYNC_FD),
    ];
    // SAFETY: init is single-threaded, so the child may do anything the parent could.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(errno_msg("fork"));
    }
    if pid == 0 {
        nested_child(config.clone(), &plan);
    }
    drop((listener, status, root, log, theirs));
    let kill = |why: String| -> String {
        let mut status = 0;
        // Our own child, not yet reaped: the pid cannot name another process.
        let _ = bb_sys::process::kill(pid, libc::SIGKILL);
        // SAFETY: reaping our own child into a local status word.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        if libc::WIFEXITED(status) {
            format!("{why} (exit status {})", libc::WEXITSTATUS(status))
        } else {
            why
        }
    };
    for mut f in cgroup_procs.into_iter().map(std::fs::File::from) {
        if let Err(e) = f.write_all(pid.to_string().as_bytes()) {
            return Err(kill(format!("move nested init into its cgroup: {e}")));
        }
    }
    match recv_msg(&sync) {
        Ok((m, _)) if m == "u" => {}
        Ok((m, _)) => return Err(kill(format!("nested init said {m:?}"))),
        Err(e) => return Err(kill(e)),
    }
    let maps = (|| -> Result<(), String> {
        for (ours, theirs) in [("/proc/self/uid_map", "uid_map"), ("/proc/self/gid_map", "gid_map")] {
            let n = mapped_ids(ours)?;
            std::fs::write(format!("/proc/{pid}/{theirs}"), format!("0 0 {n}\n"))
                .map_err(|e| format!("write {theirs}: {e}"))?;
        }
        Ok(())
    })();
    if let Err(e) = maps {
        return Err(kill(e));
    }
    if let Err(e) = bb_proto::send(sync.as_raw_fd(), &"g", &[]) {
        return Err(kill(format!("release nested init: {e}")));
    }
    // "p <pid>", with an fd of the new pid namespace: opening /proc/<pid>/ns/pid ourselves needs
    // ptrace access to the (non-dumpable) new init, which a nested init does not have.
    let (inner, pidns) = match recv_msg(&sync) {
        Ok((m, mut fds)) => match (m.strip_prefix("p ").and_then(|p| p.parse::<i32>().ok()), fds.pop()) {
            (Some(p), Some(ns)) => (p, ns),
            _ => return Err(kill(format!("nested init said {m:?}"))),
        },
        Err(e) => return Err(kill(e)),
    };
    // The copy that made the namespaces exits right after reporting; the nested init is its child
    // (now ours: we are the reaper of this pid namespace).
    // SAFETY: reaping our own child.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
    // Its /proc: the kernel refuses it a procfs of its own (our masks are locked in its copy of
    // our mounts), but we may make one for its pid namespace.
    let sent = bb_sys::mount_api::procfs_for_pidns(pidns.as_fd())
        .map_err(|e| format!("procfs for nested init: {e}"))
        .and_then(|m| {
            bb_proto::send(sync.as_raw_fd(), &"proc", &[m.as_raw_fd()])
                .map_err(|e| format!("hand /proc to nested init: {e}"))
        });
    if let Err(e) = sent {
        // The nested init we started (it waits for its /proc); best effort, we report `e`.
        let _ = bb_sys::process::kill(inner, libc::SIGKILL);
        return Err(e);
    }
    Ok(inner)
}

/// In the forked copy: put the fds in place, close everything else of the parent init (its
/// listener, connections, session channels), make the namespaces and serve as the new init.
fn nested_child(mut config: InitConfig, plan: &[(RawFd, RawFd)]) -> ! {
    // SAFETY: fcntl/dup2 on fds we hold; sources are first moved above every target so that no
    // dup2 overwrites a source still to be used.
    let moved = unsafe {
        let high: Vec<RawFd> = plan.iter().map(|(src, _)| libc::fcntl(*src, libc::F_DUPFD_CLOEXEC, 64)).collect();
        !high.contains(&-1) && plan.iter().zip(&high).all(|((_, target), h)| libc::dup2(*h, *target) >= 0)
    };
    if !moved || bb_sys::process::close_fds_from(NEST_SYNC_FD as u32 + 1).is_err() {
        // SAFETY: leaving the forked copy without running the parent's destructors.
        unsafe { libc::_exit(101) };
    }
    enter_namespaces();
    // From here on we are the new sandbox's init (pid 1 of its pid namespace).
    let status = crate::status_pipe();
    let setup = receive_proc().and_then(|proc_mnt| {
        // SAFETY: closing the sync socket, which nothing uses any more.
        unsafe { libc::close(NEST_SYNC_FD) };
        attach_root()?;
        config.rootfs = NEST_MOUNTPOINT.into();
        crate::setup_and_policy(&config, Some(proc_mnt))
    });
    crate::serve(status, setup)
}

/// The procfs mount our parent init makes for our pid namespace (see [`spawn_nested`]).
fn receive_proc() -> Result<OwnedFd, String> {
    let (what, mut fds): (String, Vec<OwnedFd>) =
        bb_proto::recv(NEST_SYNC_FD).map_err(|e| format!("waiting for /proc from the parent init: {e}"))?;
    match fds.pop() {
        Some(fd) if what == "proc" => Ok(fd),
        _ => Err(format!("parent init sent {what:?} instead of /proc")),
    }
}

/// Report a failure to the parent init (best effort) and exit.
fn fail(msg: String) -> ! {
    let _ = bb_proto::send(NEST_SYNC_FD, &format!("error: {msg}"), &[]);
    std::process::exit(1)
}

/// Child side: make a user namespace, let the parent init map it, make the other namespaces,
/// and fork the real init (pid 1 of the new pid namespace). Returns in that process only.
fn enter_namespaces() {
    if let Err(e) = bb_sys::ns::unshare(libc::CLONE_NEWUSER) {
        fail(e.to_string());
    }
    if bb_proto::send(NEST_SYNC_FD, &"u", &[]).is_err() {
        std::process::exit(1);
    }
    // SAFETY: fd 6 is the socket to the parent init; borrowed.
    match recv_msg(&unsafe { std::os::fd::BorrowedFd::borrow_raw(NEST_SYNC_FD) }) {
        Ok((m, _)) if m == "g" => {}
        _ => std::process::exit(1),
    }
    if let Err(e) = bb_sys::ns::unshare(NESTED_NAMESPACES) {
        fail(e.to_string());
    }
    // SAFETY: single-threaded; the child goes on as init, the parent reports and exits.
    let child = unsafe { libc::fork() };
    if child < 0 {
        fail(errno_msg("fork"));
    }
    if child > 0 {
        match std::fs::File::open("/proc/self/ns/pid_for_children") {
            Ok(ns) => {
                let _ = bb_proto::send(NEST_SYNC_FD, &format!("p {child}"), &[ns.as_raw_fd()]);
            }
            Err(e) => fail(format!("own pid namespace: {e}")),
        }
        // SAFETY: leaving without running destructors (the child owns the fds now).
        unsafe { libc::_exit(0) };
    }
}

/// Where a nested init attaches its new root before the usual set-up: an existing directory of
/// the parent's tree (which this mount namespace copied). It is only a stage: after pivot_root
/// the parent's tree, this mount point included, is detached.
pub const NEST_MOUNTPOINT: &str = "/proc";

/// Attach the root mount handed over at [`NEST_ROOT_FD`] on [`NEST_MOUNTPOINT`].
fn attach_root() -> Result<(), String> {
    use nix::mount::{mount, MsFlags};
    mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
        .map_err(|e| format!("make / private: {e}"))?;
    // SAFETY: fd 5 is the detached mount the parent handed us; we own it from here on.
    let root = unsafe { OwnedFd::from_raw_fd(NEST_ROOT_FD) };
    bb_sys::ns::move_mount(
        Some(std::os::fd::AsFd::as_fd(&root)),
        std::path::Path::new(""),
        None,
        std::path::Path::new(NEST_MOUNTPOINT),
        bb_sys::ns::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(|e| format!("attach root: {e}"))
}
