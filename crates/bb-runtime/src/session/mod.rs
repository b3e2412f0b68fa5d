//! Stateful sessions: a python interpreter or a shell whose state persists between runs.
//!
//! A session is one process running `session/server.py` (embedded in the daemon), talking
//! newline-delimited JSON over fd 3, a unix stream socket whose other end the daemon keeps. The
//! server is single-threaded and idle between requests, so it can be forked at a quiescent point
//! (checkpoints), and its channel can be replaced after a fork (`{"op":"fork"}` + SCM_RIGHTS).

pub mod fork;
pub mod tail;

use crate::error::{Result, RuntimeError};
use crate::model::SessionInfo;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// The in-sandbox session server.
pub const SERVER_SOURCE: &str = include_str!("server.py");
/// Process-list tag prefix of session processes (hidden from `commands.list`).
pub const SESSION_TAG: &str = "branchbox-session:";
/// Largest response line accepted from a session.
const MAX_LINE: usize = 64 << 20;
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A session process failed (its own bugs or death; the caller's mistakes are `BadRequest`).
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("session channel: {0}")]
    Channel(#[from] std::io::Error),
    #[error("session {id} did not answer a fork request")]
    NoForkAnswer { id: String },
    #[error("session {id} refused to fork: {answer}")]
    ForkRefused { id: String, answer: String },
    #[error("session {id} of this fork child did not start ({why}): create a new session")]
    CopyDidNotStart { id: String, why: String },
    #[error("session sent malformed JSON: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("session did not start ({why}){log}")]
    DidNotStart { why: String, log: String },
    #[error("session protocol error: {0}")]
    Protocol(String),
}

pub struct Session {
    pub id: String,
    pub kind: String,
    pub pid: i32,
    pub created_at: f64,
    alive: AtomicBool,
    chan: tokio::sync::Mutex<Option<BufReader<UnixStream>>>,
    /// Held for a whole user-visible operation (a run); a checkpoint holds every session's.
    pub op_lock: tokio::sync::Mutex<()>,
    /// A copy forked from outside that is still to be finished (see [`Session::finish_later`]).
    unfinished: parking_lot::Mutex<Option<Unfinished>>,
}

/// What a session copy's `{"op":"restored"}` carries: its stdout/stderr and a mapping it
/// inherited from the daemon's work in the template (address, length), which it removes.
struct Unfinished {
    log: std::fs::File,
    unmap: (u64, u64),
}

/// Process tag of a session: `branchbox-session:<id>:<kind>[:default]`.
pub fn session_tag(id: &str, kind: &str, default: bool) -> String {
    format!("{SESSION_TAG}{id}:{kind}{}", if default { ":default" } else { "" })
}

/// (id, kind, default) from a process tag made by [`session_tag`].
pub fn parse_session_tag(tag: &str) -> Option<(String, String, bool)> {
    let mut parts = tag.strip_prefix(SESSION_TAG)?.split(':');
    let id = parts.next()?.to_string();
    let kind = parts.next()?.to_string();
    Some((id, kind, parts.next() == Some("default")))
}

impl Session {
    /// A session whose process runs already, on a channel taken back from init (daemon restart).
    pub fn attach(
        id: String,
        kind: String,
        pid: i32,
        created_at: f64,
        chan: std::os::unix::net::UnixStream,
    ) -> Result<Session> {
        chan.set_nonblocking(true).map_err(SessionError::Channel)?;
        let stream = UnixStream::from_std(chan).map_err(SessionError::Channel)?;
        Ok(Session {
            id,
            kind,
            pid,
            created_at,
            alive: AtomicBool::new(true),
            chan: tokio::sync::Mutex::new(Some(BufReader::new(stream))),
            op_lock: Default::default(),
            unfinished: Default::default(),
        })
    }

    pub fn info(&self) -> SessionInfo {
        SessionInfo {
            id: self.id.clone(),
            kind: self.kind.clone(),
            pid: self.pid,
            created_at: self.created_at,
            alive: self.alive.load(Ordering::SeqCst),
        }
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Mark the session dead without killing anything (its process is already gone).
    pub(crate) async fn forget(&self) {
        self.chan.lock().await.take();
        self.alive.store(false, Ordering::SeqCst);
    }

    /// Fork the session server (`{"op":"fork","role":role}` with a new channel) and return
    /// once this process answered (the child exists), without waiting for the child.
    ///
    /// `role = "template"`: the child is a frozen copy (the snapshot's template), this process goes
    /// on. `role = "restore"` (sent to a template): the child is a new live session. The server
    /// takes everything a template needs (cwd, open files) before it forks, so the caller may
    /// move the sandbox's root right away.
    pub async fn fork_begin(&self, role: &str) -> Result<PendingFork> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(SessionError::Channel)?;
        let resp = self
            .request_fd(&serde_json::json!({"op": "fork", "role": role}), Some(theirs.as_raw_fd()), Some(FORK_TIMEOUT))
            .await?
            .ok_or_else(|| SessionError::NoForkAnswer { id: self.id.clone() })?;
        drop(theirs);
        let Some(child) = resp.get("child").and_then(|c| c.as_i64()) else {
            return Err(SessionError::ForkRefused { id: self.id.clone(), answer: resp.to_string() }.into());
        };
        Ok(PendingFork { pid: child as i32, chan: ours })
    }

    /// Before a process dump: the channel becomes an internal socket pair of the session
    /// process (see the server's `rechannel`). Returns the fd at which the process holds the
    /// pair's other end, for the daemon to take back after a restore (`pidfd_getfd`). This
    /// session object is done with: its channel is gone.
    pub async fn rechannel(&self) -> Result<i32> {
        let resp = self
            .request(&serde_json::json!({"op": "rechannel"}), Some(FORK_TIMEOUT))
            .await?
            .ok_or_else(|| SessionError::Protocol(format!("session {} did not answer a rechannel request", self.id)))?;
        let fd = resp.get("peer_fd").and_then(|f| f.as_i64()).filter(|f| (0..=i32::MAX as i64).contains(f));
        let old = self.chan.lock().await.take();
        self.alive.store(false, Ordering::SeqCst);
        let fd = fd
            .map(|f| f as i32)
            .ok_or_else(|| SessionError::Protocol(format!("session {} refused to rechannel: {resp}", self.id)))?;
        // The session switches channels right after its answer, closing the old one: until
        // then its process still holds our socket, which a dump cannot take.
        if let Some(mut old) = old {
            use tokio::io::AsyncReadExt;
            let mut buf = [0u8; 512];
            let closed = tokio::time::timeout(FORK_TIMEOUT, async {
                while matches!(old.read(&mut buf).await, Ok(n) if n > 0) {}
            })
            .await;
            if closed.is_err() {
                return Err(SessionError::Protocol(format!("session {} did not switch channels", self.id)).into());
            }
        }
        Ok(fd)
    }

    /// Hold the channel: no request reaches the session until the guard is dropped (the daemon
    /// drives the process from outside meanwhile, e.g. to fork a template).
    pub(crate) async fn exclusive(&self) -> tokio::sync::MutexGuard<'_, Option<BufReader<UnixStream>>> {
        self.chan.lock().await
    }

    /// Mark this session as a copy of a template forked into another sandbox from outside
    /// (`crate::session::fork`) that is still to be finished: before its first request it gets
    /// `{"op":"restored"}` and becomes a live session there, with `log` as stdout/stderr and
    /// whatever it shared with the template's sandbox (open sockets, pipes, files elsewhere)
    /// closed; `unmap` is a mapping it inherited from the daemon's work in the template
    /// (address, length), which it removes. Until then it idles in `recvmsg` and runs no code,
    /// so a fork answers without the copies' post-fork Python work (mostly copy-on-write
    /// faults), which each copy does on its first use instead.
    pub(crate) fn finish_later(&self, log: std::fs::File, unmap: (u64, u64)) {
        *self.unfinished.lock() = Some(Unfinished { log, unmap });
    }

    /// Send one request line and read one response line.
    pub(crate) async fn request(
        &self,
        req: &serde_json::Value,
        timeout: Option<Duration>,
    ) -> Result<Option<serde_json::Value>> {
        self.request_fd(req, None, timeout).await
    }

    /// [`request`](Self::request), with `fd` attached to the request line (SCM_RIGHTS).
    async fn request_fd(
        &self,
        req: &serde_json::Value,
        fd: Option<std::os::fd::RawFd>,
        timeout: Option<Duration>,
    ) -> Result<Option<serde_json::Value>> {
        let mut guard = self.chan.lock().await;
        let unfinished = self.unfinished.lock().take();
        if let Some(Unfinished { log, unmap }) = unfinished {
            let finish = serde_json::json!({"op": "restored", "strict": true, "unmap": [unmap.0, unmap.1]});
            let resp = self.exchange(&mut guard, &finish, Some(log.as_raw_fd()), Some(FORK_TIMEOUT)).await?;
            if resp.as_ref().and_then(|r| r.get("ok")).and_then(|o| o.as_bool()) != Some(true) {
                // Closing the channel ends the copy (its server exits at end of file).
                *guard = None;
                self.alive.store(false, Ordering::SeqCst);
                let why = resp.map_or_else(|| "no answer".to_string(), |r| r.to_string());
                return Err(SessionError::CopyDidNotStart { id: self.id.clone(), why }.into());
            }
        }
        self.exchange(&mut guard, req, fd, timeout).await
    }

    /// One request line out, its answer in, on the channel `guard` holds.
    async fn exchange(
        &self,
        guard: &mut tokio::sync::MutexGuard<'_, Option<BufReader<UnixStream>>>,
        req: &serde_json::Value,
        fd: Option<std::os::fd::RawFd>,
        timeout: Option<Duration>,
    ) -> Result<Option<serde_json::Value>> {
        let chan = guard.as_mut().ok_or_else(|| self.dead_error())?;
        let id = request_id();
        let mut req = req.clone();
        req["id"] = serde_json::Value::String(id.clone());
        let mut line = serde_json::to_vec(&req).expect("json");
        line.push(b'\n');
        let io = async {
            match fd {
                None => chan.get_mut().write_all(&line).await?,
                Some(fd) => send_with_fd(chan.get_mut(), &line, fd).await?,
            }
            loop {
                let mut resp = Vec::new();
                let n = tokio::io::AsyncReadExt::take(&mut *chan, MAX_LINE as u64).read_until(b'\n', &mut resp).await?;
                // Skip answers to requests of a previous daemon (same channel, taken over).
                let stale = n > 0
                    && serde_json::from_slice::<serde_json::Value>(&resp)
                        .is_ok_and(|v| v.get("id").is_some_and(|got| got.as_str() != Some(id.as_str())));
                if !stale {
                    return Ok::<_, std::io::Error>((n, resp));
                }
            }
        };
        let res = match timeout {
            Some(t) => tokio::time::timeout(t, io).await.ok(),
            None => Some(io.await),
        };
        match res {
            None => {
                // Timed out: the session's state is unknown, so it is killed.
                **guard = None;
                self.alive.store(false, Ordering::SeqCst);
                Ok(None)
            }
            Some(Ok((n, resp))) if n > 0 && resp.ends_with(b"\n") => {
                serde_json::from_slice(&resp).map(Some).map_err(|e| SessionError::Malformed(e).into())
            }
            Some(_) => {
                **guard = None;
                self.alive.store(false, Ordering::SeqCst);
                Err(self.dead_error())
            }
        }
    }

    fn dead_error(&self) -> RuntimeError {
        RuntimeError::Conflict(format!(
            "session {} has exited (killed, timed out or out of memory): create a new session",
            self.id
        ))
    }
}

/// A forked session server's child (see [`Session::fork_begin`]).
pub struct PendingFork {
    /// The child's pid in the sandbox.
    pub pid: i32,
    chan: std::os::unix::net::UnixStream,
}

impl PendingFork {
    #[cfg(test)]
    pub(crate) fn for_test(pid: i32, chan: std::os::unix::net::UnixStream) -> PendingFork {
        PendingFork { pid, chan }
    }

    /// Whether the child is gone: its end of the channel is closed (it died, or exited at end
    /// of file). A child that answered and idles is not.
    pub fn is_gone(&self) -> bool {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use std::os::fd::AsFd;
        // POLLHUP and POLLERR are reported whatever is asked for.
        let mut fds = [PollFd::new(self.chan.as_fd(), PollFlags::empty())];
        match poll(&mut fds, PollTimeout::ZERO) {
            Ok(0) => false,
            Ok(_) => fds[0].revents().is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR)),
            Err(_) => true,
        }
    }

    /// The daemon's end of the child's channel, at once. The child's first line (its "ready",
    /// answered to the fork request's id) is skipped by its first request like any stale
    /// answer: the child exists already, and a child that died shows as a dead session then.
    pub fn channel(self) -> std::os::unix::net::UnixStream {
        self.chan
    }
}

/// Request ids: every answer is matched to its request, so an answer nobody waits for (a fork
/// child's "ready", or one in flight on a channel a restarted daemon took over) is skipped.
/// Unique across sessions and daemon runs: a fork child's first line carries its parent's
/// request id on what becomes another session's channel.
fn request_id() -> String {
    static RUN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let run = RUN.get_or_init(|| uuid::Uuid::new_v4().simple().to_string()[..8].to_string());
    format!("{run}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Send `line` with `fd` attached in one sendmsg; the rest (if the socket took only part) plainly.
async fn send_with_fd(stream: &mut UnixStream, line: &[u8], fd: std::os::fd::RawFd) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let fds = [fd];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let sent = loop {
        stream.writable().await?;
        let iov = [std::io::IoSlice::new(line)];
        match sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => break n,
            Err(nix::Error::EAGAIN) | Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    stream.write_all(&line[sent..]).await
}

const FORK_TIMEOUT: Duration = Duration::from_secs(20);

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, Write};
    use std::os::unix::net::UnixStream as StdStream;

    /// A fake session server on the other end of `chan`: answers each request line with
    /// `answer(op)` (plus the request's id), reporting each op and whether an fd came with it.
    fn fake_server(
        chan: StdStream,
        answer: fn(&str) -> serde_json::Value,
    ) -> std::thread::JoinHandle<Vec<(String, bool)>> {
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            let mut out = chan.try_clone().unwrap();
            let mut reader = std::io::BufReader::new(chan);
            loop {
                // The fd (if any) comes with the first bytes of the line: peek for it first.
                let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
                let mut byte = [0u8; 1];
                let mut iov = [std::io::IoSliceMut::new(&mut byte)];
                let msg = nix::sys::socket::recvmsg::<()>(
                    reader.get_ref().as_raw_fd(),
                    &mut iov,
                    Some(&mut space),
                    nix::sys::socket::MsgFlags::MSG_PEEK,
                )
                .unwrap();
                if msg.bytes == 0 {
                    return seen;
                }
                let with_fd =
                    msg.cmsgs().unwrap().any(|c| matches!(c, nix::sys::socket::ControlMessageOwned::ScmRights(_)));
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap() == 0 {
                    return seen;
                }
                let req: serde_json::Value = serde_json::from_str(&line).unwrap();
                let op = req["op"].as_str().unwrap().to_string();
                let mut resp = answer(&op);
                resp["id"] = req["id"].clone();
                seen.push((op, with_fd));
                writeln!(out, "{resp}").unwrap();
            }
        })
    }

    fn log_file() -> std::fs::File {
        tempfile::tempfile().unwrap()
    }

    #[tokio::test]
    async fn an_unfinished_copy_is_finished_before_its_first_request_only() {
        let (ours, theirs) = StdStream::pair().unwrap();
        let server = fake_server(theirs, |op| match op {
            "restored" => serde_json::json!({"ok": true, "role": "restore"}),
            _ => serde_json::json!({"ok": true, "pid": 7}),
        });
        let s = Session::attach("ss-1".into(), "python".into(), 7, 0.0, ours).unwrap();
        s.finish_later(log_file(), (0x1000, 0x2000));
        let r = s.request(&serde_json::json!({"op": "ping"}), Some(Duration::from_secs(5))).await.unwrap().unwrap();
        assert_eq!(r["pid"], 7);
        s.request(&serde_json::json!({"op": "ping"}), Some(Duration::from_secs(5))).await.unwrap().unwrap();
        s.forget().await;
        let seen = server.join().unwrap();
        let expect: Vec<(String, bool)> =
            vec![("restored".into(), true), ("ping".into(), false), ("ping".into(), false)];
        assert_eq!(seen, expect);
        assert!(!s.is_alive());
    }

    #[tokio::test]
    async fn a_copy_that_fails_to_finish_is_dead_and_says_so() {
        let (ours, theirs) = StdStream::pair().unwrap();
        let server = fake_server(theirs, |op| match op {
            "restored" => serde_json::json!({"error": {"name": "ProtocolError", "value": "not a template"}}),
            _ => serde_json::json!({"ok": true}),
        });
        let s = Session::attach("ss-2".into(), "python".into(), 7, 0.0, ours).unwrap();
        s.finish_later(log_file(), (0, 0));
        let err = s.request(&serde_json::json!({"op": "run", "code": "1"}), None).await.unwrap_err().to_string();
        assert!(
            err.contains("ss-2") && err.contains("not a template") && err.contains("create a new session"),
            "{err}"
        );
        assert!(!s.is_alive());
        // The channel was closed: the copy's server sees the end of file and exits.
        assert_eq!(server.join().unwrap(), vec![("restored".to_string(), true)]);
        let again = s.request(&serde_json::json!({"op": "ping"}), None).await.unwrap_err().to_string();
        assert!(again.contains("has exited"), "{again}");
    }
}
