//! Forking a live session template into other sandboxes' namespaces, from outside.
//!
//! A snapshot's session templates are frozen copies of the sessions, idle in `recvmsg` on their
//! channel (fd 3). A fork child is a sandbox nested in the parent's user and pid namespaces
//! ([`crate::launch::launch_nested`]). To give the child a live copy of a session, the daemon
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
use bb_sys::ptrace::Tracee;
use std::os::unix::net::UnixStream;

/// fd of a session server's channel (see `_session_server.py`).
pub const CHANNEL_FD: u64 = 3;

/// A sandbox's namespaces as `/proc/<pid>/ns` names, the user namespace first (joining it is
/// what grants the rights to join the others).
const NAMESPACES: [&str; 7] = ["user", "mnt", "pid", "net", "uts", "ipc", "cgroup"];

/// Where a copy goes: the host pid of the child sandbox's init and the child's cgroup.
pub struct Target<'a> {
    pub init_pid: i32,
    pub cgroup: &'a Cgroup,
}

/// A session copy running in a child: its host pid and the daemon's end of its channel.
pub struct SessionCopy {
    pub host_pid: i32,
    pub chan: UnixStream,
}

fn fail(what: &str, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Internal(format!("fork of session template: {what}: {e}"))
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

/// Fork template `template` (host pid) once into each of `targets`. The outer error means the
/// template could not be taken over at all (busy or gone); per-target errors are in the list.
pub fn fork_into(template: i32, targets: &[Target<'_>], key: [u64; 2]) -> Result<Vec<Result<SessionCopy>>> {
    let mut t = Tracee::seize(template).map_err(|e| {
        if e.errno() == libc::EBUSY {
            RuntimeError::Conflict("the session template is busy".into())
        } else {
            fail("seize template", e)
        }
    })?;
    let act = t.scratch(64);
    t.write_mem(act, &sigaction_bytes(1 /* SIG_IGN */)).map_err(|e| fail("write sigaction", e))?;
    t.syscall(libc::SYS_rt_sigaction, [libc::SIGCHLD as u64, act, act + 32, 8, 0, 0])
        .and_then(|r| r.ok("rt_sigaction"))
        .map_err(|e| fail("ignore SIGCHLD", e))?;
    let out = match socketpair_in(&mut t) {
        Ok((fd, ns_sock)) => {
            let out = targets.iter().map(|tg| copy_into(&mut t, fd, &ns_sock, tg, key)).collect();
            let _ = t.syscall(libc::SYS_close, [fd as u64, 0, 0, 0, 0, 0]);
            out
        }
        Err(e) => targets.iter().map(|_| Err(fail("socketpair", &e))).collect(),
    };
    // Back to the template's own SIGCHLD disposition (saved at act + 32).
    let restored = t
        .syscall(libc::SYS_rt_sigaction, [libc::SIGCHLD as u64, act + 32, 0, 8, 0, 0])
        .and_then(|r| r.ok("rt_sigaction"));
    t.resume().map_err(|e| fail("resume template", e))?;
    restored.map_err(|e| fail("restore SIGCHLD", e))?;
    Ok(out)
}

/// A socketpair made in the tracee: its end's fd number there, and the other end (taken with
/// `pidfd_getfd`, then closed in the tracee).
fn socketpair_in(t: &mut Tracee) -> Result<(i32, UnixStream)> {
    let sv = t.scratch(8);
    t.syscall(libc::SYS_socketpair, [libc::AF_UNIX as u64, (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64, 0, sv, 0, 0])
        .and_then(|r| r.ok("socketpair"))
        .map_err(|e| fail("socketpair", e))?;
    let mut b = [0u8; 8];
    t.read_mem(sv, &mut b).map_err(|e| fail("read socketpair", e))?;
    let (a, theirs) = (i32::from_ne_bytes(b[..4].try_into().expect("4")), i32::from_ne_bytes(b[4..].try_into().expect("4")));
    let taken = bb_sys::process::pidfd_open(t.pid())
        .and_then(|pidfd| bb_sys::process::pidfd_getfd(&pidfd, theirs))
        .map_err(|e| fail("take socket end", e));
    let _ = t.syscall(libc::SYS_close, [theirs as u64, 0, 0, 0, 0, 0]);
    match taken {
        Ok(fd) => Ok((a, UnixStream::from(fd))),
        Err(e) => {
            let _ = t.syscall(libc::SYS_close, [a as u64, 0, 0, 0, 0, 0]);
            Err(e)
        }
    }
}

/// Send the namespaces of process `pid` (opened from the host side) on `sock`.
fn send_namespaces(sock: &UnixStream, pid: i32) -> Result<()> {
    use std::os::fd::AsRawFd;
    let files = NAMESPACES
        .iter()
        .map(|ns| std::fs::File::open(format!("/proc/{pid}/ns/{ns}")).map_err(|e| fail("child init's namespaces", e)))
        .collect::<Result<Vec<_>>>()?;
    let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
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

fn copy_into(t: &mut Tracee, ns_fd: i32, ns_sock: &UnixStream, target: &Target<'_>, key: [u64; 2]) -> Result<SessionCopy> {
    let helper = t
        .syscall(libc::SYS_clone, [(libc::CLONE_VM | libc::SIGCHLD) as u64, 0, 0, 0, 0, 0])
        .map_err(|e| fail("clone helper", e))?;
    helper.ok("clone").map_err(|e| fail("clone helper", e))?;
    let hpid = helper.child.ok_or_else(|| fail("clone helper", "no child reported"))?;
    let mut h = t.child(hpid).map_err(|e| fail("helper", e))?;
    match helper_steps(&mut h, ns_fd, ns_sock, target, key) {
        Ok(copy_pid) => {
            let _ = h.exit(0);
            let mut c = t.child(copy_pid).map_err(|e| fail("copy", e))?;
            match give_channel(&mut c) {
                Ok(chan) => {
                    let host_pid = c.pid();
                    c.resume().map_err(|e| fail("resume copy", e))?;
                    Ok(SessionCopy { host_pid, chan })
                }
                Err(e) => {
                    c.kill();
                    Err(e)
                }
            }
        }
        Err(e) => {
            h.kill();
            Err(e)
        }
    }
}

/// In the helper: join the child's namespaces, drop capabilities, move to its cgroup, fork.
/// Returns the copy's host pid.
fn helper_steps(h: &mut Tracee, ns_fd: i32, ns_sock: &UnixStream, target: &Target<'_>, key: [u64; 2]) -> Result<i32> {
    let call = |h: &mut Tracee, what: &'static str, nr: i64, args: [u64; 6]| -> Result<i64> {
        h.syscall(nr, args).and_then(|r| r.ok(what)).map_err(|e| fail(what, e))
    };
    send_namespaces(ns_sock, target.init_pid)?;
    let fds = h.recv_fds(ns_fd, NAMESPACES.len()).map_err(|e| fail("receive namespaces", e))?;
    let mut joined = Ok(0);
    for (fd, name) in fds.iter().zip(NAMESPACES) {
        joined = joined.and_then(|_| {
            h.syscall(libc::SYS_setns, [*fd as u64, 0, key[0], key[1], 0, 0])
                .and_then(|r| r.ok("setns"))
                .map_err(|e| fail(&format!("join the child's {name} namespace"), e))
        });
    }
    for fd in &fds {
        let _ = h.syscall(libc::SYS_close, [*fd as u64, 0, 0, 0, 0, 0]);
    }
    if fds.len() != NAMESPACES.len() {
        return Err(fail("receive namespaces", format!("{} of {} arrived", fds.len(), NAMESPACES.len())));
    }
    joined?;
    let (hdr, data) = capset_bytes();
    let at = h.scratch(64);
    h.write_mem(at, &hdr).and_then(|()| h.write_mem(at + 16, &data)).map_err(|e| fail("write caps", e))?;
    call(h, "capset", libc::SYS_capset, [at, at + 16, 0, 0, 0, 0])?;
    target.cgroup.add_pid(h.pid())?;
    let forked = h.syscall(libc::SYS_fork, [0; 6]).map_err(|e| fail("fork", e))?;
    forked.ok("fork").map_err(|e| fail("fork", e))?;
    forked.child.ok_or_else(|| fail("fork", "no child reported"))
}

/// In the copy: a new socketpair, one end over fd 3, the other end taken by us.
fn give_channel(c: &mut Tracee) -> Result<UnixStream> {
    let sv = c.scratch(8);
    c.syscall(libc::SYS_socketpair, [libc::AF_UNIX as u64, (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64, 0, sv, 0, 0])
        .and_then(|r| r.ok("socketpair"))
        .map_err(|e| fail("socketpair", e))?;
    let mut b = [0u8; 8];
    c.read_mem(sv, &mut b).map_err(|e| fail("read socketpair", e))?;
    let (a, theirs) = (i32::from_ne_bytes(b[..4].try_into().expect("4")), i32::from_ne_bytes(b[4..].try_into().expect("4")));
    let pidfd = bb_sys::process::pidfd_open(c.pid()).map_err(|e| fail("pidfd of copy", e))?;
    let ours = bb_sys::process::pidfd_getfd(&pidfd, theirs).map_err(|e| fail("take channel end", e))?;
    c.syscall(libc::SYS_dup3, [a as u64, CHANNEL_FD, libc::O_CLOEXEC as u64, 0, 0, 0])
        .and_then(|r| r.ok("dup3"))
        .map_err(|e| fail("dup3 channel", e))?;
    for fd in [a, theirs] {
        let _ = c.syscall(libc::SYS_close, [fd as u64, 0, 0, 0, 0, 0]);
    }
    Ok(UnixStream::from(ours))
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
