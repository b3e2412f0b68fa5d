//! Stateful sessions: a python interpreter or a shell whose state persists between runs.
//!
//! A session is one process running `branchbox/_session_server.py` (embedded in the daemon), talking
//! newline-delimited JSON over fd 3, a unix stream socket whose other end the daemon keeps. The
//! server is single-threaded and idle between requests, so it can be forked at a quiescent point
//! (checkpoints), and its channel can be replaced after a fork (`{"op":"fork"}` + SCM_RIGHTS).

use crate::error::{Result, RuntimeError};
use crate::initconn::{init_error, unexpected, InitConn};
use crate::model::{SessionInfo, SessionResult};
use crate::sandbox::Sandbox;
use bb_proto::{Request, Response, SpawnRequest};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

/// The in-sandbox session server.
pub const SERVER_SOURCE: &str = include_str!("../../../python/branchbox/_session_server.py");
/// Process-list tag prefix of session processes (hidden from `commands.list`).
pub const SESSION_TAG: &str = "branchbox-session:";
/// Largest response line accepted from a session.
const MAX_LINE: usize = 64 << 20;
const START_TIMEOUT: Duration = Duration::from_secs(20);

pub struct Session {
    pub id: String,
    pub kind: String,
    pub pid: i32,
    pub created_at: f64,
    alive: AtomicBool,
    chan: tokio::sync::Mutex<Option<BufReader<UnixStream>>>,
}

impl Session {
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

    /// Send one request line and read one response line.
    async fn request(&self, req: &serde_json::Value, timeout: Option<Duration>) -> Result<Option<serde_json::Value>> {
        let mut guard = self.chan.lock().await;
        let chan = guard.as_mut().ok_or_else(|| self.dead_error())?;
        let mut line = serde_json::to_vec(req).expect("json");
        line.push(b'\n');
        let io = async {
            chan.get_mut().write_all(&line).await?;
            let mut resp = Vec::new();
            let n = tokio::io::AsyncReadExt::take(&mut *chan, MAX_LINE as u64).read_until(b'\n', &mut resp).await?;
            Ok::<_, std::io::Error>((n, resp))
        };
        let res = match timeout {
            Some(t) => tokio::time::timeout(t, io).await.ok(),
            None => Some(io.await),
        };
        match res {
            None => {
                // Timed out: the session's state is unknown, so it is killed.
                *guard = None;
                self.alive.store(false, Ordering::SeqCst);
                Ok(None)
            }
            Some(Ok((n, resp))) if n > 0 && resp.ends_with(b"\n") => serde_json::from_slice(&resp)
                .map(Some)
                .map_err(|e| RuntimeError::Internal(format!("session sent malformed JSON: {e}"))),
            Some(_) => {
                *guard = None;
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

pub async fn create(sb: &Sandbox, kind: &str, cwd: Option<String>, env: &std::collections::BTreeMap<String, String>) -> Result<Session> {
    if kind != "python" && kind != "shell" {
        return Err(RuntimeError::BadRequest(format!("session kind {kind:?} is unknown: use \"python\" or \"shell\"")));
    }
    let id = format!("ss-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(|e| RuntimeError::internal("socketpair", e))?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(sb.dirs.logs().join(format!("{id}.log")))
        .map_err(|e| RuntimeError::internal("session log", e))?;
    let conn = InitConn::connect(&sb.dirs.sock()).await?;
    conn.send(
        &Request::Spawn(SpawnRequest {
            argv: vec!["python3".into(), "-c".into(), SERVER_SOURCE.into(), kind.into()],
            env: sb.env_with(env),
            cwd: cwd.unwrap_or_else(|| sb.spec.cwd.clone()),
            background: true,
            stdin: false,
            stdout: true,
            stderr: true,
            fd3: true,
            tag: format!("{SESSION_TAG}{id}"),
        }),
        &[log.as_raw_fd(), log.as_raw_fd(), theirs.as_raw_fd()],
    )?;
    drop(theirs);
    let pid = match conn.recv().await? {
        Response::Started { pid } => pid,
        Response::Error { errno: libc::ENOENT, .. } => {
            return Err(RuntimeError::BadRequest(format!(
                "image {:?} has no python3: sessions need python3 in the image",
                sb.spec.image
            )))
        }
        Response::Error { errno, message } => return Err(init_error(errno, message)),
        other => return Err(unexpected(other)),
    };
    ours.set_nonblocking(true).map_err(|e| RuntimeError::internal("socket", e))?;
    let stream = UnixStream::from_std(ours).map_err(|e| RuntimeError::internal("socket", e))?;
    let session = Session {
        id,
        kind: kind.into(),
        pid,
        created_at: crate::now(),
        alive: AtomicBool::new(true),
        chan: tokio::sync::Mutex::new(Some(BufReader::new(stream))),
    };
    match session.request(&serde_json::json!({"op": "ping"}), Some(START_TIMEOUT)).await {
        Ok(Some(_)) => Ok(session),
        other => {
            let _ = kill_process(sb, pid).await;
            let log = std::fs::read_to_string(sb.dirs.logs().join(format!("{}.log", session.id))).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(3).collect();
            Err(RuntimeError::Internal(format!(
                "session did not start ({}): {}",
                match other {
                    Err(e) => e.to_string(),
                    _ => "no answer".into(),
                },
                tail.join(" | ")
            )))
        }
    }
}

async fn kill_process(sb: &Sandbox, pid: i32) -> Result<()> {
    InitConn::call(&sb.dirs.sock(), &Request::Kill { pid, signal: libc::SIGKILL, group: true }).await?;
    Ok(())
}

pub async fn run(sb: &Sandbox, session: &Session, code: &str, timeout: Option<Duration>) -> Result<SessionResult> {
    let resp = session.request(&serde_json::json!({"op": "run", "code": code}), timeout).await?;
    let Some(v) = resp else {
        let _ = kill_process(sb, session.pid).await;
        return Ok(SessionResult { timed_out: true, ..Default::default() });
    };
    if let Some(err) = v.get("error").filter(|e| e.get("name").and_then(|n| n.as_str()) == Some("ProtocolError")) {
        return Err(RuntimeError::Internal(format!("session protocol error: {err}")));
    }
    let s = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or_default().to_string();
    Ok(SessionResult {
        stdout: s("stdout"),
        stderr: s("stderr"),
        result: v.get("result").and_then(|x| x.as_str()).map(String::from),
        error: v.get("error").filter(|e| !e.is_null()).cloned(),
        exit_code: v.get("exit_code").and_then(|x| x.as_i64()).map(|c| c as i32),
        timed_out: false,
    })
}

pub async fn kill(sb: &Sandbox, session: &Session) -> Result<()> {
    session.chan.lock().await.take();
    session.alive.store(false, Ordering::SeqCst);
    match kill_process(sb, session.pid).await {
        Ok(()) | Err(RuntimeError::NotFound { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}
