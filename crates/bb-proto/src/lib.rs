//! Wire protocol between `branchboxd` and `branchbox-init` (PID 1 of every sandbox).
//!
//! Transport: a `SOCK_SEQPACKET` unix socket. Each packet is one JSON message; file descriptors
//! travel beside it as `SCM_RIGHTS`. One connection carries one request: the daemon connects, sends a
//! [`Request`], and reads [`Response`]s until the one that ends the exchange. A foreground spawn keeps
//! its connection open until the process exits; if the daemon drops the connection first, init kills
//! the process group (so a cancelled request never leaves a command running).
//!
//! Keeping stdio as plain fds passed to init means command output never flows through init: the
//! daemon reads the pipes directly.

use serde::{Deserialize, Serialize};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// fd on which init finds its listening control socket.
pub const INIT_LISTEN_FD: RawFd = 3;
/// fd on which init reports `ok` or `error: <why>` once its set-up is done, then closes it.
pub const INIT_STATUS_FD: RawFd = 4;
/// Init's open file holding the boot id its sandbox sees (see [`InitConfig::boot_id`]): the
/// daemon writes a new one through `/proc/<init>/fd/5`.
pub const INIT_BOOT_ID_FD: RawFd = 5;
/// Where that file is in the sandbox (what `/proc/<init>/fd/5` points to).
pub const BOOT_ID_FILE: &str = "/dev/.bb-boot-id";

/// Environment variable through which init receives its [`InitConfig`] as JSON.
pub const INIT_CONFIG_ENV: &str = "BRANCHBOX_INIT_CONFIG";

/// How init sets up the sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InitConfig {
    /// Host path of the sandbox's merged root filesystem (an overlay mounted by the daemon).
    pub rootfs: String,
    pub hostname: String,
    /// `none`: the sandbox's own network namespace with loopback only.
    pub network: String,
    /// Size limit of /dev/shm in bytes.
    pub shm_bytes: u64,
    /// `setns` passes the seccomp filter of this sandbox's processes only with these values in
    /// its third and fourth arguments (`bb_isolation::SetnsKey`). Never shown to the sandbox.
    #[serde(default)]
    pub setns_key: [u64; 2],
    /// This init was started by another sandbox's init ([`Request::Nest`]): it makes its own
    /// user namespace (nested in the parent's) and the other namespaces, and its root is the
    /// mount handed over with the request (`rootfs` is ignored).
    #[serde(default)]
    pub nested: bool,
    /// Init makes its cgroup namespace itself, first thing, once it is in its cgroup (cgroup v1:
    /// it is moved there after clone, and a namespace made at clone would be rooted in the
    /// daemon's cgroup, so the sandbox would see paths like `/../../branchbox/<id>` and CRIU
    /// could not dump its processes).
    #[serde(default)]
    pub cgroupns: bool,
    /// The sandbox's own boot id: init shows it (read-only) at
    /// `/proc/sys/kernel/random/boot_id` and keeps the file open at [`INIT_BOOT_ID_FD`], where
    /// the daemon rewrites it when the sandbox is cold-booted. None: the host's boot id shows.
    #[serde(default)]
    pub boot_id: Option<String>,
}

/// Largest message either side will send or accept.
pub const MAX_MESSAGE: usize = 256 * 1024;
/// Largest number of fds attached to one message.
pub const MAX_FDS: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("message of {0} bytes exceeds the {MAX_MESSAGE}-byte limit: pass large data through files instead")]
    TooLarge(usize),
    #[error("peer closed the connection")]
    Closed,
    #[error("malformed message: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("socket error: {0}")]
    Io(#[from] nix::Error),
}

/// What a spawned process gets on its stdio: the fds attached to the message, in this order,
/// for each stream marked `true`; streams marked `false` are connected to /dev/null.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SpawnRequest {
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    /// Background processes outlive the connection and are listed by [`Request::List`].
    pub background: bool,
    /// Which of stdin, stdout, stderr, and fd 3 (a channel for sessions) are attached.
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub fd3: bool,
    /// Shown in process listings (usually the command line).
    pub tag: String,
    /// Run as this uid and gid of the sandbox (supplementary groups: none); root when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ids: Option<(u32, u32)>,
    /// Run on a new pseudo-terminal of the sandbox's devpts, this size (rows, cols): it is the
    /// process's stdin, stdout, stderr and controlling terminal, and `Started` carries its master.
    /// The stdio flags are then all false (no fds attached).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<(u16, u16)>,
    /// With `ids`: start without `no_new_privs`, so setuid programs (`sudo`) take effect (they
    /// can make the process root of the sandbox's user namespace, never more); the seccomp
    /// filter is applied before the capabilities are dropped, as the kernel then requires.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_setuid: bool,
    /// A foreground process whose owner keeps it across a pause (its stdio, pipes or a terminal
    /// whose other ends the owner holds, are replaced when the process is restored): `Suspend`
    /// lets it be dumped.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attached: bool,
}

impl SpawnRequest {
    /// A foreground spawn of `argv` with no stdio attached (all /dev/null).
    pub fn new(argv: Vec<String>, env: Vec<String>, cwd: impl Into<String>) -> SpawnRequest {
        SpawnRequest {
            argv,
            env,
            cwd: cwd.into(),
            background: false,
            stdin: false,
            stdout: false,
            stderr: false,
            fd3: false,
            tag: String::new(),
            ids: None,
            pty: None,
            allow_setuid: false,
            attached: false,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Ping,
    Spawn(SpawnRequest),
    /// Answer with `Exited` once `pid` (a process spawned through init) has exited.
    Wait {
        pid: i32,
    },
    /// Signal a process, or its whole process group when `group`.
    Kill {
        pid: i32,
        signal: i32,
        group: bool,
    },
    /// Background processes, running and recently exited.
    List,
    /// Keep the attached fd (the daemon's end of a session channel) until process `pid` exits, so
    /// a restarted daemon can take the channel back with `Fetch`.
    Stash {
        key: String,
        pid: i32,
    },
    /// Answer `Ok` with a duplicate of the fd stashed under `key` attached.
    Fetch {
        key: String,
    },
    /// Track `pid`, a live process of the sandbox that init did not spawn (a session copy made by
    /// fork), as a background process with this tag: it is listed, may own stashed fds, and its
    /// exit is noticed (through a pidfd; its exit status is unknown unless init reaps it itself).
    /// `Error{ESRCH}` if there is no such process, `EINVAL` for pid <= 1. With `stash`, the fd
    /// attached is also stashed under that key, as by `Stash`, in the same round trip.
    Adopt {
        pid: i32,
        tag: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stash: Option<String>,
    },
    /// Start the init of a new sandbox nested in this one's user and pid namespaces (a fork child
    /// that session templates can be forked into): this init starts a copy of itself with
    /// `config` (whose `nested` is true), which makes new user (identity-mapped onto ours), mount,
    /// pid, net, uts, ipc and cgroup namespaces. Fds: the new init's listening socket and status
    /// pipe (as at launch), the detached mount of its root, its log file (stdout and stderr), then
    /// one open `cgroup.procs` file per cgroup hierarchy of the new sandbox, into which it is
    /// moved before it makes its namespaces.
    /// Answer: [`Response::Nested`] with a pidfd of the new init attached.
    Nest {
        config: InitConfig,
    },
    /// Make the sandbox reusable by another tenant (warm pool recycling). The daemon has killed
    /// every other process. Init forgets every process, stash and connection, moves to fresh
    /// network and IPC namespaces (no socket, SysV or POSIX IPC object survives), mounts a fresh
    /// /dev/shm of `shm_bytes`, and takes `hostname`.
    Reset {
        hostname: String,
        shm_bytes: u64,
        /// Also a fresh cgroup namespace (rooted in the cgroup init was moved to just before).
        #[serde(default)]
        cgroupns: bool,
    },
    /// The sandbox is being paused: every process but init is about to be dumped and killed, to
    /// be restored later under the same pids. Until `Resume`, init records no exit of the
    /// processes it tracks (their waiters keep waiting) and refuses `Spawn` and `Adopt`.
    /// `Error{EBUSY}` (nothing changes) while a foreground process runs that is not `attached`
    /// (`SpawnRequest::attached`): its output goes to a daemon connection that a dump cannot keep.
    Suspend,
    /// The sandbox's processes were restored (or the pause was called off): tracked processes
    /// that live are running again; those that do not are recorded as killed (SIGKILL).
    Resume,
    /// Open a new pseudo-terminal of the sandbox's devpts, this size, its slave owned by `ids`
    /// (root when absent), for a process restored from a process image in place of the one it
    /// had. Answer: `Ok` with the master and the slave attached.
    OpenPty {
        rows: u16,
        cols: u16,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ids: Option<(u32, u32)>,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProcEntry {
    pub pid: i32,
    pub tag: String,
    pub background: bool,
    pub started_at: f64,
    pub exit: Option<ExitStatus>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExitStatus {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl ExitStatus {
    /// Decode a wait(2) status.
    pub fn from_wait_status(status: i32) -> ExitStatus {
        if libc::WIFSIGNALED(status) {
            ExitStatus { code: None, signal: Some(libc::WTERMSIG(status)) }
        } else {
            ExitStatus { code: Some(libc::WEXITSTATUS(status)), signal: None }
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Response {
    Pong {
        pid: i32,
        procs: usize,
    },
    Started {
        pid: i32,
    },
    Exited {
        pid: i32,
        status: ExitStatus,
    },
    Procs {
        procs: Vec<ProcEntry>,
    },
    Ok,
    Error {
        errno: i32,
        message: String,
    },
    /// The new init of a [`Request::Nest`]: its pid in this sandbox's pid namespace.
    Nested {
        pid: i32,
    },
}

/// Send one JSON message with optional fds on a SEQPACKET socket.
pub fn send<T: Serialize>(sock: RawFd, msg: &T, fds: &[RawFd]) -> Result<(), ProtoError> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let bytes = serde_json::to_vec(msg)?;
    if bytes.len() > MAX_MESSAGE {
        return Err(ProtoError::TooLarge(bytes.len()));
    }
    let iov = [IoSlice::new(&bytes)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    loop {
        match sendmsg::<()>(sock, &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(_) => return Ok(()),
            Err(nix::Error::EINTR) => continue,
            Err(nix::Error::EPIPE) | Err(nix::Error::ECONNRESET) => return Err(ProtoError::Closed),
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receive one message and its fds. `Err(Closed)` on EOF; `Err(Io(EAGAIN))` on a non-blocking
/// socket with nothing to read.
pub fn recv<T: serde::de::DeserializeOwned>(sock: RawFd) -> Result<(T, Vec<OwnedFd>), ProtoError> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut cmsg_space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let (len, fds) = loop {
        let mut iov = [IoSliceMut::new(&mut buf)];
        match recvmsg::<()>(sock, &mut iov, Some(&mut cmsg_space), MsgFlags::MSG_CMSG_CLOEXEC) {
            Ok(msg) => {
                let mut fds = Vec::new();
                for c in msg.cmsgs().map_err(ProtoError::Io)? {
                    if let ControlMessageOwned::ScmRights(raw) = c {
                        for fd in raw {
                            // SAFETY: the kernel just installed these fds in our table for us.
                            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                        }
                    }
                }
                break (msg.bytes, fds);
            }
            Err(nix::Error::EINTR) => continue,
            Err(nix::Error::ECONNRESET) => return Err(ProtoError::Closed),
            Err(e) => return Err(e.into()),
        }
    };
    if len == 0 {
        return Err(ProtoError::Closed);
    }
    Ok((serde_json::from_slice(&buf[..len])?, fds))
}

/// A connected SEQPACKET socket pair (for tests and in-process use).
pub fn seqpacket_pair() -> Result<(OwnedFd, OwnedFd), ProtoError> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    Ok(socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn request_round_trips_with_fds() {
        let (a, b) = seqpacket_pair().unwrap();
        let (pr, pw) = nix::unistd::pipe().unwrap();
        let req = Request::Spawn(SpawnRequest {
            argv: vec!["echo".into(), "hi".into()],
            env: vec!["A=1".into()],
            cwd: "/".into(),
            background: false,
            stdin: false,
            stdout: true,
            stderr: false,
            fd3: false,
            tag: "echo hi".into(),
            ids: Some((1000, 1000)),
            pty: Some((24, 80)),
            allow_setuid: true,
            attached: true,
        });
        send(a.as_raw_fd(), &req, &[pw.as_raw_fd()]).unwrap();
        drop(pw);
        let (got, fds): (Request, _) = recv(b.as_raw_fd()).unwrap();
        assert_eq!(got, req);
        assert_eq!(fds.len(), 1);
        nix::unistd::write(&fds[0], b"x").unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(nix::unistd::read(pr.as_raw_fd(), &mut buf).unwrap(), 1);
    }

    #[test]
    fn eof_is_closed_and_garbage_is_malformed() {
        let (a, b) = seqpacket_pair().unwrap();
        nix::unistd::write(&a, b"{not json").unwrap();
        assert!(matches!(recv::<Request>(b.as_raw_fd()), Err(ProtoError::Malformed(_))));
        drop(a);
        assert!(matches!(recv::<Request>(b.as_raw_fd()), Err(ProtoError::Closed)));
    }

    #[test]
    fn oversized_message_is_refused_before_sending() {
        let (a, _b) = seqpacket_pair().unwrap();
        let big = Request::Spawn(SpawnRequest::new(vec!["x".repeat(MAX_MESSAGE)], vec![], "/"));
        assert!(matches!(send(a.as_raw_fd(), &big, &[]), Err(ProtoError::TooLarge(_))));
    }

    #[test]
    fn exit_status_decodes_codes_and_signals() {
        assert_eq!(ExitStatus::from_wait_status(3 << 8), ExitStatus { code: Some(3), signal: None });
        assert_eq!(ExitStatus::from_wait_status(9), ExitStatus { code: None, signal: Some(9) });
    }
}
