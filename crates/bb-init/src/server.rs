//! The request loop: one poll over the listening socket, SIGCHLD (signalfd) and open connections.

use crate::spawn::{fork_exec, Prepared};
use bb_proto::{ExitStatus, ProcEntry, ProtoError, Request, Response, INIT_LISTEN_FD};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// How many exited processes are remembered for `List`/`Wait`.
const KEEP_EXITED: usize = 1024;

struct Proc {
    tag: String,
    background: bool,
    /// A foreground process a pause may dump (see `SpawnRequest::attached`).
    attached: bool,
    started_at: f64,
    exit: Option<ExitStatus>,
}

struct Conn {
    /// Keeps the connection open; closed when the Conn is dropped.
    _fd: OwnedFd,
    /// The foreground process this connection owns: killed if the connection goes away first.
    owns: Option<i32>,
    /// The process whose exit this connection waits for.
    waits_for: Option<i32>,
}

pub struct Server {
    listener: OwnedFd,
    sigfd: SignalFd,
    conns: HashMap<RawFd, Conn>,
    procs: BTreeMap<i32, Proc>,
    exited_order: std::collections::VecDeque<i32>,
    policy: bb_isolation::SeccompFilter,
    /// Session channels kept for the daemon: key -> (owning pid, fd).
    stash: HashMap<String, (i32, OwnedFd)>,
    /// pidfds of adopted processes (not our children): readable once they exit.
    adopted: BTreeMap<i32, OwnedFd>,
    /// Between `Suspend` and `Resume` (the sandbox's processes are being dumped and killed, to
    /// be restored under the same pids): the exits seen meanwhile, recorded only for processes
    /// that are not back at `Resume`.
    suspended: Option<HashMap<i32, ExitStatus>>,
}

/// A new pseudo-terminal of the sandbox's devpts, this size, its slave owned by `ids`: (master,
/// slave), or the error to answer.
fn open_pty(rows: u16, cols: u16, ids: Option<(u32, u32)>) -> Result<(OwnedFd, OwnedFd), Response> {
    let (master, slave) = bb_sys::pty::open_pty(rows, cols)
        .map_err(|e| Response::Error { errno: e.errno(), message: format!("cannot open a pseudo-terminal: {e}") })?;
    if let Some((uid, gid)) = ids {
        let _ = nix::unistd::fchown(slave.as_raw_fd(), Some(uid.into()), Some(gid.into()));
    }
    Ok((master, slave))
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl Server {
    pub fn new(policy: bb_isolation::SeccompFilter) -> Server {
        // SAFETY: fd 3 is the listening socket the daemon handed us; we own it from here on.
        let listener = unsafe { OwnedFd::from_raw_fd(INIT_LISTEN_FD) };
        // Children must not inherit the listener (dup2 in the daemon cleared CLOEXEC).
        let _ = nix::fcntl::fcntl(listener.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC));
        let mut mask = SigSet::empty();
        mask.add(Signal::SIGCHLD);
        mask.thread_block().expect("block SIGCHLD");
        // SAFETY: ignoring SIGPIPE is always sound; children restore the default before exec.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let sigfd = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK).expect("signalfd");
        Server {
            listener,
            sigfd,
            conns: HashMap::new(),
            procs: BTreeMap::new(),
            exited_order: Default::default(),
            policy,
            stash: HashMap::new(),
            adopted: BTreeMap::new(),
            suspended: None,
        }
    }

    pub fn run(mut self) -> ! {
        loop {
            let conn_fds: Vec<RawFd> = self.conns.keys().copied().collect();
            let adopted: Vec<i32> = self.adopted.keys().copied().collect();
            let mut ready = Vec::new();
            {
                let mut pfds = Vec::with_capacity(conn_fds.len() + adopted.len() + 2);
                pfds.push(PollFd::new(self.listener.as_fd(), PollFlags::POLLIN));
                pfds.push(PollFd::new(self.sigfd.as_fd(), PollFlags::POLLIN));
                for fd in &conn_fds {
                    // SAFETY: fd belongs to a Conn in self.conns, alive for this poll call.
                    pfds.push(PollFd::new(unsafe { BorrowedFd::borrow_raw(*fd) }, PollFlags::POLLIN));
                }
                for pid in &adopted {
                    pfds.push(PollFd::new(self.adopted[pid].as_fd(), PollFlags::POLLIN));
                }
                match poll(&mut pfds, PollTimeout::NONE) {
                    Ok(_) => {}
                    Err(nix::Error::EINTR) => continue,
                    Err(e) => panic!("poll: {e}"),
                }
                for (i, p) in pfds.iter().enumerate() {
                    if p.revents().is_some_and(|r| !r.is_empty()) {
                        ready.push(i);
                    }
                }
            }
            for i in ready {
                match i {
                    0 => self.accept(),
                    1 => self.reap(),
                    i if i < conn_fds.len() + 2 => self.serve(conn_fds[i - 2]),
                    i => {
                        // An adopted process exited; if it became our child, reap() records it.
                        self.reap();
                        let pid = adopted[i - 2 - conn_fds.len()];
                        self.exited(pid, ExitStatus { code: None, signal: None });
                    }
                }
            }
        }
    }

    fn accept(&mut self) {
        use nix::sys::socket::{accept4, SockFlag};
        match accept4(self.listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
            Ok(fd) => {
                // SAFETY: accept4 returned a fresh fd that we own.
                let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                self.conns.insert(fd.as_raw_fd(), Conn { _fd: fd, owns: None, waits_for: None });
            }
            Err(e) => eprintln!("branchbox-init: accept: {e}"),
        }
    }

    fn reply(&mut self, fd: RawFd, resp: &Response) {
        if bb_proto::send(fd, resp, &[]).is_err() {
            self.drop_conn(fd);
        }
    }

    /// Close a connection; a foreground process it owned and that still runs is killed.
    fn drop_conn(&mut self, fd: RawFd) {
        if let Some(conn) = self.conns.remove(&fd) {
            if let Some(pid) = conn.owns {
                if self.procs.get(&pid).is_some_and(|p| p.exit.is_none()) {
                    // A group we created (each spawn is its own session). Best effort: it may
                    // have exited since.
                    let _ = bb_sys::process::kill_group(pid, libc::SIGKILL);
                }
            }
        }
    }

    fn serve(&mut self, fd: RawFd) {
        let (req, fds) = match bb_proto::recv::<Request>(fd) {
            Ok(x) => x,
            Err(ProtoError::Malformed(e)) => {
                let resp = Response::Error { errno: libc::EINVAL, message: format!("malformed request: {e}") };
                return self.reply(fd, &resp);
            }
            Err(ProtoError::Io(nix::Error::EAGAIN)) => return,
            Err(_) => return self.drop_conn(fd),
        };
        match req {
            Request::Ping => {
                let procs = self.procs.values().filter(|p| p.exit.is_none()).count();
                self.reply(fd, &Response::Pong { pid: std::process::id() as i32, procs });
            }
            Request::Spawn(_) | Request::Adopt { .. } if self.suspended.is_some() => {
                self.reply(fd, &Response::Error { errno: libc::EBUSY, message: "the sandbox is being paused".into() })
            }
            Request::Spawn(spawn) => self.spawn(fd, spawn, fds),
            Request::Wait { pid } => match self.procs.get(&pid) {
                None => self.reply(
                    fd,
                    &Response::Error {
                        errno: libc::ESRCH,
                        message: format!("no process {pid} was started in this sandbox"),
                    },
                ),
                Some(Proc { exit: Some(status), .. }) => {
                    let status = *status;
                    self.reply(fd, &Response::Exited { pid, status });
                }
                Some(_) => {
                    if let Some(c) = self.conns.get_mut(&fd) {
                        c.waits_for = Some(pid);
                    }
                }
            },
            Request::Kill { pid, .. } if pid <= 1 => {
                // kill(-1) would signal every process, and pid 1 is init itself.
                let resp =
                    Response::Error { errno: libc::EPERM, message: format!("process {pid} cannot be signalled") };
                self.reply(fd, &resp);
            }
            Request::Kill { pid, .. } if self.procs.get(&pid).is_some_and(|p| p.exit.is_some()) => {
                // It has exited (and was reaped): its pid, and the group id it led, may name
                // other processes by now, or a zombie of its group not reaped yet.
                let resp = Response::Error { errno: libc::ESRCH, message: format!("process {pid} has exited") };
                self.reply(fd, &resp);
            }
            Request::Kill { pid, signal, group } => {
                // The pid namespace confines the target.
                let res =
                    if group { bb_sys::process::kill_group(pid, signal) } else { bb_sys::process::kill(pid, signal) };
                let resp = match res {
                    Ok(()) => Response::Ok,
                    Err(e) => Response::Error { errno: e.errno(), message: format!("kill {pid}: {}", e.source) },
                };
                self.reply(fd, &resp);
            }
            Request::Stash { key, pid } => {
                let resp = match fds.into_iter().next() {
                    Some(f) if self.procs.get(&pid).is_some_and(|p| p.exit.is_none()) => {
                        self.stash.insert(key, (pid, f));
                        Response::Ok
                    }
                    Some(_) => Response::Error { errno: libc::ESRCH, message: format!("process {pid} is not running") },
                    None => Response::Error { errno: libc::EINVAL, message: "stash needs one fd".into() },
                };
                self.reply(fd, &resp);
            }
            Request::Fetch { key } => match self.stash.get(&key) {
                Some((_, f)) => {
                    if bb_proto::send(fd, &Response::Ok, &[f.as_raw_fd()]).is_err() {
                        self.drop_conn(fd);
                    }
                }
                None => self.reply(
                    fd,
                    &Response::Error { errno: libc::ENOENT, message: format!("nothing stashed as {key:?}") },
                ),
            },
            Request::Adopt { pid, .. } if pid <= 1 => self.reply(
                fd,
                &Response::Error { errno: libc::EINVAL, message: format!("process {pid} cannot be adopted") },
            ),
            Request::Adopt { pid, tag, stash } => {
                let resp = match bb_sys::process::pidfd_open(pid) {
                    Ok(pidfd) => {
                        match self.procs.get_mut(&pid).filter(|p| p.exit.is_none()) {
                            Some(p) => p.tag = tag,
                            None => {
                                self.procs.insert(
                                    pid,
                                    Proc { tag, background: true, attached: false, started_at: now(), exit: None },
                                );
                            }
                        }
                        self.adopted.insert(pid, pidfd);
                        match (stash, fds.into_iter().next()) {
                            (Some(key), Some(f)) => {
                                self.stash.insert(key, (pid, f));
                                Response::Ok
                            }
                            (Some(_), None) => {
                                Response::Error { errno: libc::EINVAL, message: "adopt with stash needs one fd".into() }
                            }
                            (None, _) => Response::Ok,
                        }
                    }
                    Err(e) => Response::Error { errno: e.errno(), message: format!("adopt {pid}: {e}") },
                };
                self.reply(fd, &resp);
            }
            Request::Nest { config } => match crate::nest::spawn_nested(&config, fds) {
                Ok(pid) => match bb_sys::process::pidfd_open(pid) {
                    Ok(pidfd) => {
                        if bb_proto::send(fd, &Response::Nested { pid }, &[pidfd.as_raw_fd()]).is_err() {
                            self.drop_conn(fd);
                        }
                    }
                    Err(e) => {
                        self.reply(fd, &Response::Error { errno: e.errno(), message: format!("nested init: {e}") })
                    }
                },
                Err(message) => self.reply(fd, &Response::Error { errno: libc::EIO, message }),
            },
            Request::OpenPty { rows, cols, ids } => match open_pty(rows, cols, ids) {
                Ok((master, slave)) => {
                    if bb_proto::send(fd, &Response::Ok, &[master.as_raw_fd(), slave.as_raw_fd()]).is_err() {
                        self.drop_conn(fd);
                    }
                }
                Err(resp) => self.reply(fd, &resp),
            },
            Request::Reset { hostname, shm_bytes, cgroupns } => {
                // Every other process is dead (the daemon killed them with the cgroup frozen):
                // reap them, forget them and their channels, drop other connections.
                self.reap();
                self.procs.clear();
                self.exited_order.clear();
                self.stash.clear();
                self.adopted.clear();
                self.suspended = None;
                let others: Vec<RawFd> = self.conns.keys().copied().filter(|c| *c != fd).collect();
                for c in others {
                    self.conns.remove(&c);
                }
                let resp = match crate::setup::reset(&hostname, shm_bytes, cgroupns) {
                    Ok(()) => Response::Ok,
                    Err(e) => Response::Error { errno: libc::EIO, message: format!("reset: {e}") },
                };
                self.reply(fd, &resp);
            }
            Request::Suspend => {
                let foreground: Vec<i32> = self
                    .procs
                    .iter()
                    .filter(|(_, p)| !p.background && !p.attached && p.exit.is_none())
                    .map(|(pid, _)| *pid)
                    .collect();
                let resp = if foreground.is_empty() {
                    self.suspended.get_or_insert_with(HashMap::new);
                    Response::Ok
                } else {
                    Response::Error {
                        errno: libc::EBUSY,
                        message: format!("foreground commands are running (pids {foreground:?})"),
                    }
                };
                self.reply(fd, &resp);
            }
            Request::Resume => {
                self.reap();
                let held = self.suspended.take().unwrap_or_default();
                let gone: Vec<i32> = self
                    .procs
                    .iter()
                    .filter(|(pid, p)| p.exit.is_none() && bb_sys::process::kill(**pid, 0).is_err())
                    .map(|(pid, _)| *pid)
                    .collect();
                for pid in gone {
                    let status =
                        held.get(&pid).copied().unwrap_or(ExitStatus { code: None, signal: Some(libc::SIGKILL) });
                    self.exited(pid, status);
                }
                self.reply(fd, &Response::Ok);
            }
            Request::List => {
                let procs = self
                    .procs
                    .iter()
                    .filter(|(_, p)| p.background)
                    .map(|(pid, p)| ProcEntry {
                        pid: *pid,
                        tag: p.tag.clone(),
                        background: true,
                        started_at: p.started_at,
                        exit: p.exit,
                    })
                    .collect();
                self.reply(fd, &Response::Procs { procs });
            }
        }
    }

    fn spawn(&mut self, fd: RawFd, req: bb_proto::SpawnRequest, fds: Vec<OwnedFd>) {
        let wanted = [req.stdin, req.stdout, req.stderr, req.fd3];
        if wanted.iter().filter(|w| **w).count() != fds.len() {
            let resp = Response::Error {
                errno: libc::EINVAL,
                message: format!("spawn wants {} fds, got {}", wanted.iter().filter(|w| **w).count(), fds.len()),
            };
            return self.reply(fd, &resp);
        }
        // A terminal: a new pty of the sandbox's devpts, the slave the process's stdio (owned by
        // the user it runs as), the master handed back with `Started`.
        let pty = match req.pty {
            Some(_) if !fds.is_empty() => {
                let message = "a spawn on a pty takes no stdio fds".to_string();
                return self.reply(fd, &Response::Error { errno: libc::EINVAL, message });
            }
            Some((rows, cols)) => match open_pty(rows, cols, req.ids) {
                Ok(pair) => Some(pair),
                Err(resp) => return self.reply(fd, &resp),
            },
            None => None,
        };
        let stdio: [Option<RawFd>; 4] = match &pty {
            Some((_, slave)) => {
                let s = slave.as_raw_fd();
                [Some(s), Some(s), Some(s), None]
            }
            None => {
                let mut it = fds.iter();
                wanted.map(|w| if w { it.next().map(|f| f.as_raw_fd()) } else { None })
            }
        };
        let prepared = match Prepared::new(&req) {
            Ok(p) => p,
            Err(message) => return self.reply(fd, &Response::Error { errno: libc::EINVAL, message }),
        };
        match fork_exec(&prepared, stdio, &self.policy) {
            Ok(pid) => {
                drop(fds);
                let attached = req.attached && !req.background;
                let p = Proc { tag: req.tag, background: req.background, attached, started_at: now(), exit: None };
                self.procs.insert(pid, p);
                if !req.background {
                    if let Some(c) = self.conns.get_mut(&fd) {
                        c.owns = Some(pid);
                        c.waits_for = Some(pid);
                    }
                }
                let master: Vec<RawFd> = pty.as_ref().map(|(m, _)| m.as_raw_fd()).into_iter().collect();
                if bb_proto::send(fd, &Response::Started { pid }, &master).is_err() {
                    self.drop_conn(fd);
                }
            }
            Err(f) => self.reply(fd, &Response::Error { errno: f.errno, message: f.message }),
        }
    }

    /// Record that `pid` exited (once): drop its stash and pidfd, answer whoever waits for it.
    /// While suspended, only the stash and pidfd go: the process comes back under this pid.
    fn exited(&mut self, pid: i32, status: ExitStatus) {
        self.stash.retain(|_, (owner, _)| *owner != pid);
        self.adopted.remove(&pid);
        if let Some(held) = self.suspended.as_mut() {
            held.insert(pid, status);
            return;
        }
        let Some(p) = self.procs.get_mut(&pid) else { return };
        if p.exit.is_some() {
            return;
        }
        p.exit = Some(status);
        self.exited_order.push_back(pid);
        let waiting: Vec<RawFd> =
            self.conns.iter().filter(|(_, c)| c.waits_for == Some(pid)).map(|(fd, _)| *fd).collect();
        for fd in waiting {
            if let Some(c) = self.conns.get_mut(&fd) {
                c.owns = None;
            }
            self.reply(fd, &Response::Exited { pid, status });
            self.drop_conn(fd);
        }
    }

    fn reap(&mut self) {
        while let Ok(Some(_)) = self.sigfd.read_signal() {}
        loop {
            let (pid, status) = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => (pid.as_raw(), ExitStatus { code: Some(code), signal: None }),
                Ok(WaitStatus::Signaled(pid, sig, _)) => {
                    (pid.as_raw(), ExitStatus { code: None, signal: Some(sig as i32) })
                }
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => continue,
            };
            self.exited(pid, status);
        }
        while self.exited_order.len() > KEEP_EXITED {
            if let Some(old) = self.exited_order.pop_front() {
                self.procs.remove(&old);
            }
        }
    }
}
