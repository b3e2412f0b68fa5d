//! Forking a live session template into other sandboxes' namespaces, from outside.
//!
//! A snapshot's session templates are frozen copies of the sessions, idle in `recvmsg` on their
//! channel (fd 3). A fork child is a sandbox nested in the parent's user and pid namespaces
//! ([`crate::sandbox::launch::launch_nested`]). To give the child a live copy of a session, the daemon
//! drives the template with ptrace ([`bb_sys::ptrace`]), so none of the template's own code runs:
//!
//! 1. the template's SIGCHLD is set to SIG_IGN for the duration (so helpers are reaped at once);
//! 2. per child: the template `clone`s a helper sharing its memory (`CLONE_VM`, no page-table
//!    copy); the daemon opens the child init's `/proc/<pid>/ns/*` files (the helper could not: the
//!    init is non-dumpable) and sends them over a socketpair made in the template, which the
//!    helper inherited; the helper receives them (an injected `recvmsg`) and `setns`es into each,
//!    user namespace first (allowed by the seccomp filter only with the daemon's
//!    [`bb_isolation::SetnsKey`]); it drops its capabilities in the child's user namespace to
//!    Docker's set, is moved into the child's cgroups, and `fork`s: the copy lands in the child
//!    (its memory shared copy-on-write with the template), the helper exits;
//! 3. the copy gets a channel of its own (a socketpair made in it; the daemon takes one end with
//!    `pidfd_getfd`) over fd 3, and resumes the `recvmsg` the template was in;
//! 4. the template's SIGCHLD disposition is restored and it resumes too.
//!
//! The copy then finishes on its own, when the daemon sends it `{"op":"restored"}` (new session,
//! cwd and files re-resolved by path in the child's root, at-fork hooks run): that part is the
//! session's own code, which is fine, as it now runs in the child with the child's privileges.

use crate::error::{Result, RuntimeError};
use bb_isolation::Cgroup;

use bb_sys::ptrace::{Tracee, RUNNER_BYTES, RUNNER_DATA};
use std::os::unix::net::UnixStream;

/// How long a template that is not idle yet (just forked, still on its way back to `recvmsg`)
/// is waited for.
const SEIZE_PATIENCE: std::time::Duration = std::time::Duration::from_millis(500);

/// fd of a session server's channel (see `server.py`).
pub const CHANNEL_FD: u64 = 3;

/// A sandbox's namespaces as `/proc/<pid>/ns` names, the user namespace first (joining it is
/// what grants the rights to join the others).
const NAMESPACES: [&str; 7] = ["user", "mnt", "pid", "net", "uts", "ipc", "cgroup"];

/// Where a copy goes: the host pid of the child sandbox's init and the child's cgroup; `index`
/// is the caller's number for the child (results are reported with it).
pub struct Target {
    pub index: usize,
    pub init_pid: i32,
    pub cgroup: Cgroup,
}

/// A session copy running in a child: its host pid, the daemon's end of its channel, and the
/// batch runner's mapping it inherited (address, length), which it should unmap.
pub struct SessionCopy {
    pub host_pid: i32,
    pub chan: UnixStream,
    pub runner: (u64, u64),
}

/// Forking a session template into another sandbox failed at a step.
#[derive(Debug, thiserror::Error)]
#[error("fork of session template: {what}: {source}")]
pub struct SessionForkError {
    what: String,
    #[source]
    source: Box<dyn std::error::Error + Send + Sync>,
}

fn fail(what: &str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> RuntimeError {
    SessionForkError { what: what.to_string(), source: e.into() }.into()
}

/// `struct kernel_sigaction` as rt_sigaction(2) takes it on x86_64 and aarch64.
fn sigaction_bytes(handler: u64) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&handler.to_ne_bytes());
    b
}

/// capset(2) arguments: a version-3 header and two data words with Docker's capability set in
/// effective, permitted and inheritable.
fn capset_bytes() -> ([u8; 8], [u8; 24]) {
    let mut hdr = [0u8; 8];
    hdr[..4].copy_from_slice(&0x2008_0522u32.to_ne_bytes());
    let caps = bb_isolation::caps_mask(bb_isolation::DEFAULT_CAPS);
    let mut data = [0u8; 24];
    for (i, half) in [caps as u32, (caps >> 32) as u32].into_iter().enumerate() {
        for j in 0..3 {
            data[12 * i + 4 * j..12 * i + 4 * j + 4].copy_from_slice(&half.to_ne_bytes());
        }
    }
    (hdr, data)
}

/// Fork template `template` (host pid) once into every target received on `targets`, until the
/// channel closes, reporting each copy to `out` as soon as it runs. `expected` (how many targets
/// will come) decides whether a second thread, driving a fork of the template, shares the work.
/// Err: the template could not be taken over at all (busy or gone); no target was used.
pub fn fork_stream(
    template: i32,
    expected: usize,
    targets: std::sync::mpsc::Receiver<Target>,
    key: [u64; 2],
    out: &(dyn Fn(usize, Result<SessionCopy>) + Sync),
) -> Result<()> {
    let targets = parking_lot::Mutex::new(targets);
    let next = || targets.lock().recv().ok();
    drive(template, expected, &next, key, out, true)
}

/// Take `template` over and copy it into targets from `next` (see [`fork_stream`]).
fn drive(
    template: i32,
    expected: usize,
    next: &(dyn Fn() -> Option<Target> + Sync),
    key: [u64; 2],
    out: &(dyn Fn(usize, Result<SessionCopy>) + Sync),
    may_split: bool,
) -> Result<()> {
    // A template answers its fork before it is back in `recvmsg`: give it a moment.
    let deadline = std::time::Instant::now() + SEIZE_PATIENCE;
    let mut t = loop {
        match Tracee::seize(template) {
            Ok(t) => break t,
            Err(e) if e.errno() == libc::EBUSY && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_micros(500));
            }
            Err(e) if e.errno() == libc::EBUSY => {
                return Err(RuntimeError::Conflict("the session template is busy".into()))
            }
            Err(e) => return Err(fail("seize template", e)),
        }
    };
    let runner = t.install_runner().map_err(|e| fail("map the batch runner", e))?;
    let prep = Prepared::new(&mut t, runner);
    if let Ok(prep) = &prep {
        // Two threads for many children: the second drives a fork of the template (its own
        // memory map, so the page-table copies of both run in parallel).
        let second =
            if may_split && expected >= PARALLEL_MIN && parallel() { prep.second_template(&mut t).ok() } else { None };
        std::thread::scope(|scope| {
            if let Some(pid) = second {
                scope.spawn(move || drive_second(pid, expected, next, key, out));
            }
            while let Some(tg) = next() {
                out(tg.index, prep.copy_into(&mut t, &tg, key));
            }
        });
    }
    if let Ok(prep) = prep.as_ref().map_err(|e| e.to_string()) {
        prep.finish(&mut t);
    }
    let unmapped = t.syscall(libc::SYS_munmap, [runner, RUNNER_BYTES, 0, 0, 0, 0]).and_then(|r| r.ok("munmap"));
    t.resume().map_err(|e| fail("resume template", e))?;
    unmapped.map_err(|e| fail("unmap the batch runner", e))?;
    match prep {
        Ok(_) => Ok(()),
        Err(e) => {
            // Nothing was copied: report every target as failed so the caller does not wait.
            while let Some(tg) = next() {
                out(tg.index, Err(fail("prepare template", e.to_string())));
            }
            Ok(())
        }
    }
}

/// Children from which a fork is split between two threads.
const PARALLEL_MIN: usize = 6;

fn parallel() -> bool {
    std::thread::available_parallelism().map(|n| n.get() > 1).unwrap_or(false)
}

/// In another thread: copy the second template `pid` (a fork of the first, idle in its syscall)
/// into targets from the shared queue, then kill it (its parent, the first template, ignores
/// SIGCHLD meanwhile, so it is reaped at once). If it cannot be taken over, the first thread
/// does all the work.
fn drive_second(
    pid: i32,
    expected: usize,
    next: &(dyn Fn() -> Option<Target> + Sync),
    key: [u64; 2],
    out: &(dyn Fn(usize, Result<SessionCopy>) + Sync),
) {
    // It was resumed by the other thread: `drive` waits until it is back in its syscall.
    let _ = drive(pid, expected, next, key, out, false);
    // The copy of the template we made for this fork.
    let _ = bb_sys::process::kill(pid, libc::SIGKILL);
}

// Layout of the data area of the runner's mapping (see bb_sys::ptrace::RUNNER_DATA).
const D_ACT: u64 = RUNNER_DATA; // new SIGCHLD sigaction (32 bytes)
const D_OLD_ACT: u64 = RUNNER_DATA + 32; // the template's own (32 bytes)
const D_SV: u64 = RUNNER_DATA + 64; // socketpair result (8 bytes)
const D_CAPS: u64 = RUNNER_DATA + 128; // capset header (8) at +0, data (24) at +16
const D_MSG: u64 = RUNNER_DATA + 256; // msghdr (56), iovec at +64, byte at +80, control at +96
/// fds sent to each helper: its 7 namespaces and the copy's channel.
const SENT_FDS: usize = NAMESPACES.len() + 1;

/// The template, taken over: SIGCHLD ignored (helpers are reaped at once), a socketpair whose
/// one end (`ns_fd`) helpers inherit and whose other end we hold, and the fds it has open (so
/// the numbers fds received by a helper get are known: the lowest free ones).
struct Prepared {
    runner: u64,
    ns_fd: i32,
    ns_sock: UnixStream,
    open_fds: Vec<i32>,
}

impl Prepared {
    fn new(t: &mut Tracee, runner: u64) -> Result<Prepared> {
        let w =
            |t: &Tracee, at: u64, b: &[u8]| t.write_mem(runner + at, b).map_err(|e| fail("write template memory", e));
        w(t, D_ACT, &sigaction_bytes(1 /* SIG_IGN */))?;
        let (hdr, data) = capset_bytes();
        w(t, D_CAPS, &hdr)?;
        w(t, D_CAPS + 16, &data)?;
        let b = t
            .run_batch(
                runner,
                &[
                    (libc::SYS_rt_sigaction, [libc::SIGCHLD as u64, runner + D_ACT, runner + D_OLD_ACT, 8, 0, 0]),
                    (
                        libc::SYS_socketpair,
                        [libc::AF_UNIX as u64, (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64, 0, runner + D_SV, 0, 0],
                    ),
                ],
            )
            .map_err(|e| fail("template set-up", e))?;
        if b.results.len() != 2 || b.results.iter().any(|r| *r < 0) {
            if b.results.first().is_some_and(|r| *r >= 0) {
                restore_sigchld(t, runner);
            }
            return Err(fail("template set-up", format!("results {:?}", b.results)));
        }
        let mut sv = [0u8; 8];
        t.read_mem(runner + D_SV, &mut sv).map_err(|e| fail("read socketpair", e))?;
        let (ns_fd, theirs) =
            (i32::from_ne_bytes(sv[..4].try_into().expect("4")), i32::from_ne_bytes(sv[4..].try_into().expect("4")));
        let taken = bb_sys::process::pidfd_open(t.pid()).and_then(|pidfd| bb_sys::process::pidfd_getfd(&pidfd, theirs));
        let _ = t.run_batch(runner, &[(libc::SYS_close, [theirs as u64, 0, 0, 0, 0, 0])]);
        let prep = |ns_sock| -> Result<Prepared> {
            let open_fds = std::fs::read_dir(format!("/proc/{}/fd", t.pid()))
                .map_err(|e| fail("list template fds", e))?
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect();
            Ok(Prepared { runner, ns_fd, ns_sock, open_fds })
        };
        match taken.map_err(|e| fail("take socket end", e)).and_then(|fd| prep(UnixStream::from(fd))) {
            Ok(p) => Ok(p),
            Err(e) => {
                let _ = t.run_batch(runner, &[(libc::SYS_close, [ns_fd as u64, 0, 0, 0, 0, 0])]);
                restore_sigchld(t, runner);
                Err(e)
            }
        }
    }

    /// Undo what `new` did in the template.
    fn finish(&self, t: &mut Tracee) {
        let _ = t.run_batch(self.runner, &[(libc::SYS_close, [self.ns_fd as u64, 0, 0, 0, 0, 0])]);
        restore_sigchld(t, self.runner);
    }

    /// Fork the template once more (a second template, for a second thread): it gets neither
    /// our runner mapping nor our socket end, and is left idle in the template's syscall.
    fn second_template(&self, t: &mut Tracee) -> Result<i32> {
        let f = t.syscall(libc::SYS_fork, [0; 6]).map_err(|e| fail("fork second template", e))?;
        f.ok("fork").map_err(|e| fail("fork second template", e))?;
        let mut c = t
            .child(f.child.ok_or_else(|| fail("fork second template", "no child"))?)
            .map_err(|e| fail("second template", e))?;
        let cleaned = c
            .run_batch(self.runner, &[(libc::SYS_close, [self.ns_fd as u64, 0, 0, 0, 0, 0])])
            .and_then(|_| c.syscall(libc::SYS_munmap, [self.runner, RUNNER_BYTES, 0, 0, 0, 0]))
            .and_then(|r| r.ok("munmap"));
        if let Err(e) = cleaned {
            c.kill();
            return Err(fail("second template", e));
        }
        let pid = c.pid();
        c.resume().map_err(|e| fail("resume second template", e))?;
        Ok(pid)
    }

    /// The fd numbers the next `SENT_FDS` fds a helper receives will get.
    fn predicted_fds(&self) -> Vec<i32> {
        (0..).filter(|fd| !self.open_fds.contains(fd)).take(SENT_FDS).collect()
    }

    fn copy_into(&self, t: &mut Tracee, target: &Target, key: [u64; 2]) -> Result<SessionCopy> {
        let t0 = std::time::Instant::now();
        let runner = self.runner;
        let helper = t
            .syscall(libc::SYS_clone, [(libc::CLONE_VM | libc::SIGCHLD) as u64, 0, 0, 0, 0, 0])
            .map_err(|e| fail("clone helper", e))?;
        helper.ok("clone").map_err(|e| fail("clone helper", e))?;
        let hpid = helper.child.ok_or_else(|| fail("clone helper", "no child reported"))?;
        let mut h = t.child(hpid).map_err(|e| fail("helper", e))?;
        let t_clone = t0.elapsed();
        let (ours, theirs) = match UnixStream::pair() {
            Ok(p) => p,
            Err(e) => {
                h.kill();
                return Err(fail("socketpair", e));
            }
        };
        let added = target.cgroup.add_pid(h.pid()).map_err(RuntimeError::from);
        let t_cg = t0.elapsed();
        let sent = added.and_then(|()| send_fds(&self.ns_sock, target.init_pid, &theirs));
        drop(theirs);
        if let Err(e) = sent {
            h.kill();
            return Err(e);
        }
        let fds = self.predicted_fds();
        let msg = runner + D_MSG;
        if let Err(e) = write_msghdr(t, msg) {
            h.kill();
            return Err(e);
        }
        let mut calls = vec![(libc::SYS_recvmsg, [self.ns_fd as u64, msg, libc::MSG_CMSG_CLOEXEC as u64, 0, 0, 0])];
        calls.extend(fds[..NAMESPACES.len()].iter().map(|fd| (libc::SYS_setns, [*fd as u64, 0, key[0], key[1], 0, 0])));
        calls.extend(fds[..NAMESPACES.len()].iter().map(|fd| (libc::SYS_close, [*fd as u64, 0, 0, 0, 0, 0])));
        let chan = fds[NAMESPACES.len()] as u64;
        calls.extend([
            (libc::SYS_dup3, [chan, CHANNEL_FD, libc::O_CLOEXEC as u64, 0, 0, 0]),
            (libc::SYS_close, [chan, 0, 0, 0, 0, 0]),
            (libc::SYS_close, [self.ns_fd as u64, 0, 0, 0, 0, 0]),
            (libc::SYS_capset, [runner + D_CAPS, runner + D_CAPS + 16, 0, 0, 0, 0]),
            (libc::SYS_fork, [0; 6]),
            (libc::SYS_exit, [0; 6]),
        ]);
        let t_batch_start = t0.elapsed();
        let b = match h.run_batch(runner, &calls) {
            Ok(b) => b,
            Err(e) => {
                h.kill();
                return Err(fail("helper batch", e));
            }
        };
        if !b.exited {
            // It stopped at an error: name the call.
            let i = b.results.len().saturating_sub(1);
            let what = batch_step(i);
            let errno = b.results.last().copied().unwrap_or(0);
            h.kill();
            for c in b.children {
                let _ = t.child(c).map(|c| c.kill());
            }
            return Err(fail(&format!("helper: {what}"), std::io::Error::from_raw_os_error(-errno as i32)));
        }
        let t_batch = t0.elapsed();
        let copy_pid = b.children.first().copied().ok_or_else(|| fail("helper", "fork made no child"))?;
        let copy = t.child(copy_pid).map_err(|e| fail("copy", e))?;
        // The fds really received must be the ones the batch used.
        if let Err(e) = check_received(t, msg, &fds) {
            copy.kill();
            return Err(e);
        }
        copy.resume().map_err(|e| fail("resume copy", e))?;
        tracing::debug!(?t_clone, ?t_cg, ?t_batch_start, ?t_batch, total = ?t0.elapsed(), "session copy");
        Ok(SessionCopy { host_pid: copy_pid, chan: ours, runner: (runner, RUNNER_BYTES) })
    }
}

/// What the helper batch's call `i` does (for errors).
fn batch_step(i: usize) -> String {
    let n = NAMESPACES.len();
    match i {
        0 => "receive namespaces".into(),
        i if i <= n => format!("join the child's {} namespace", NAMESPACES[i - 1]),
        i if i <= 2 * n => "close namespace fds".into(),
        i if i == 2 * n + 1 || i == 2 * n + 2 => "install channel".into(),
        i if i == 2 * n + 3 => "close socket".into(),
        i if i == 2 * n + 4 => "drop capabilities".into(),
        _ => "fork".into(),
    }
}

fn restore_sigchld(t: &mut Tracee, runner: u64) {
    let _ = t.run_batch(runner, &[(libc::SYS_rt_sigaction, [libc::SIGCHLD as u64, runner + D_OLD_ACT, 0, 8, 0, 0])]);
}

/// recvmsg arguments in the runner's data area: one byte of data, room for `SENT_FDS` fds.
fn write_msghdr(t: &Tracee, at: u64) -> Result<()> {
    let control_len = 16 + (SENT_FDS * 4).div_ceil(8) * 8;
    let mut b = vec![0u8; 96 + control_len];
    b[16..24].copy_from_slice(&(at + 64).to_ne_bytes()); // msg_iov
    b[24..32].copy_from_slice(&1u64.to_ne_bytes()); // msg_iovlen
    b[32..40].copy_from_slice(&(at + 96).to_ne_bytes()); // msg_control
    b[40..48].copy_from_slice(&(control_len as u64).to_ne_bytes()); // msg_controllen
    b[64..72].copy_from_slice(&(at + 80).to_ne_bytes()); // iov_base
    b[72..80].copy_from_slice(&1u64.to_ne_bytes()); // iov_len
    t.write_mem(at, &b).map_err(|e| fail("write msghdr", e))
}

/// Compare the fds in the received control message with `expected`.
fn check_received(t: &Tracee, msg: u64, expected: &[i32]) -> Result<()> {
    let mut ctl = vec![0u8; 16 + expected.len() * 4];
    t.read_mem(msg + 96, &mut ctl).map_err(|e| fail("read control message", e))?;
    let got: Vec<i32> = ctl[16..].chunks_exact(4).map(|c| i32::from_ne_bytes(c.try_into().expect("4"))).collect();
    if got != expected {
        return Err(fail("receive namespaces", format!("fds {got:?}, expected {expected:?}")));
    }
    Ok(())
}

/// Send the namespaces of process `pid` (opened from the host side) and `chan` on `sock`.
fn send_fds(sock: &UnixStream, pid: i32, chan: &UnixStream) -> Result<()> {
    use std::os::fd::AsRawFd;
    let files = NAMESPACES
        .iter()
        .map(|ns| std::fs::File::open(format!("/proc/{pid}/ns/{ns}")).map_err(|e| fail("child init's namespaces", e)))
        .collect::<Result<Vec<_>>>()?;
    let mut fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
    fds.push(chan.as_raw_fd());
    nix::sys::socket::sendmsg::<()>(
        sock.as_raw_fd(),
        &[std::io::IoSlice::new(b"n")],
        &[nix::sys::socket::ControlMessage::ScmRights(&fds)],
        nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(|e| fail("send namespaces", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capset_bytes_carry_docker_caps_in_all_three_sets() {
        let (hdr, data) = capset_bytes();
        assert_eq!(u32::from_ne_bytes(hdr[..4].try_into().unwrap()), 0x2008_0522);
        let caps = bb_isolation::caps_mask(bb_isolation::DEFAULT_CAPS);
        let word = |i: usize| u32::from_ne_bytes(data[4 * i..4 * i + 4].try_into().unwrap());
        assert_eq!((word(0), word(1), word(2)), (caps as u32, caps as u32, caps as u32));
        assert_eq!((word(3), word(4), word(5)), ((caps >> 32) as u32, (caps >> 32) as u32, (caps >> 32) as u32));
        // CAP_SYS_ADMIN (21) and CAP_SYS_PTRACE (19) are not in it.
        assert_eq!(caps & (1 << 21 | 1 << 19), 0);
    }
}
