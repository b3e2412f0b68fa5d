//! A sandbox's sessions, as the API sees them: create, list, run code, kill, and the default
//! python session `run_code` uses (created on first use, or again after it died).

use crate::error::{Result, RuntimeError};
use crate::initconn::{init_error, unexpected, InitConn};
use crate::model::*;
use crate::sandbox::Sandbox;
use crate::session::tail::{OutputTail, RunOutput};
use crate::session::{session_tag, Session, SessionError, SERVER_SOURCE, START_TIMEOUT};
use crate::Runtime;
use bb_proto::{Request, Response, SpawnRequest};
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

impl Runtime {
    pub async fn create_session(self: &Arc<Self>, id: &str, req: CreateSession) -> Result<SessionInfo> {
        let sb = self.ready(id).await?;
        let kind = req.kind.unwrap_or_else(|| "python".into());
        let s = Arc::new(create(&sb, &kind, false, req.cwd, &req.env).await?);
        let info = s.info();
        sb.sessions.lock().await.insert(s.id.clone(), s);
        Ok(info)
    }

    pub async fn list_sessions(&self, id: &str) -> Result<SessionList> {
        let sb = self.get(id)?;
        let mut sessions: Vec<SessionInfo> = sb.sessions.lock().await.values().map(|s| s.info()).collect();
        sessions.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        Ok(SessionList { sessions })
    }

    async fn session(&self, sb: &Sandbox, sid: &str) -> Result<Arc<Session>> {
        sb.sessions.lock().await.get(sid).cloned().ok_or_else(|| RuntimeError::NotFound {
            kind: "session",
            id: sid.into(),
            hint: ": list sessions with sbx.sessions.list()",
        })
    }

    pub async fn run_session(self: &Arc<Self>, id: &str, sid: &str, req: RunCode) -> Result<SessionResult> {
        let sb = self.ready(id).await?;
        let s = self.session(&sb, sid).await?;
        let _busy = self.activity.busy();
        run(&sb, &s, &req, crate::sandbox::exec::timeout_of(req.timeout)?).await
    }

    /// [`run_session`](Self::run_session), passing the run's output on to `out` as it is
    /// written (see [`crate::session::tail`]). The answer still holds all of it.
    pub async fn run_session_tailed(
        self: &Arc<Self>,
        id: &str,
        sid: &str,
        req: RunCode,
        out: tokio::sync::mpsc::Sender<RunOutput>,
    ) -> Result<SessionResult> {
        let sb = self.ready(id).await?;
        let s = self.session(&sb, sid).await?;
        let _busy = self.activity.busy();
        run_tailed(&sb, &s, &req, crate::sandbox::exec::timeout_of(req.timeout)?, Some(out)).await
    }

    /// Start a session afresh under the same id (kind and cwd kept; env from `req`).
    pub async fn restart_session(self: &Arc<Self>, id: &str, sid: &str, req: CreateSession) -> Result<SessionInfo> {
        let sb = self.ready(id).await?;
        let old = self.session(&sb, sid).await?;
        let kind = old.info().kind;
        sb.sessions.lock().await.remove(sid);
        kill(&sb, &old).await?;
        let s = Arc::new(create_as(&sb, Some(sid.to_string()), &kind, false, req.cwd, &req.env).await?);
        let info = s.info();
        sb.sessions.lock().await.insert(s.id.clone(), s);
        Ok(info)
    }

    pub async fn kill_session(&self, id: &str, sid: &str) -> Result<()> {
        let sb = self.get(id)?;
        let s = sb.sessions.lock().await.remove(sid).ok_or_else(|| RuntimeError::NotFound {
            kind: "session",
            id: sid.into(),
            hint: ": list sessions with sbx.sessions.list()",
        })?;
        kill(&sb, &s).await
    }

    /// Run python code in the sandbox's default session (created on first use or after it died).
    pub async fn run_code(self: &Arc<Self>, id: &str, req: RunCode) -> Result<SessionResult> {
        if let Some(lang) = req.language.as_deref() {
            if lang != "python" {
                return Err(RuntimeError::BadRequest(format!("language {lang:?} is not supported: use \"python\"")));
            }
        }
        let sb = self.ready(id).await?;
        let _busy = self.activity.busy();
        let s = default_python(&sb, || None).await?;
        run(&sb, &s, &req, crate::sandbox::exec::timeout_of(req.timeout)?).await
    }

    /// The sandbox's default python session (the one `run_code` uses), started in what `cwd`
    /// says (the sandbox's cwd when None) if there is none alive.
    pub async fn default_session(
        self: &Arc<Self>,
        id: &str,
        cwd: impl FnOnce() -> Option<String>,
    ) -> Result<SessionInfo> {
        let sb = self.ready(id).await?;
        Ok(default_python(&sb, cwd).await?.info())
    }
}

async fn default_python(sb: &Sandbox, cwd: impl FnOnce() -> Option<String>) -> Result<Arc<Session>> {
    let mut default = sb.default_session.lock().await;
    let existing = match default.as_ref() {
        Some(sid) => sb.sessions.lock().await.get(sid).filter(|s| s.is_alive()).cloned(),
        None => None,
    };
    match existing {
        Some(s) => Ok(s),
        None => {
            let s = Arc::new(create(sb, "python", true, cwd(), &Default::default()).await?);
            sb.sessions.lock().await.insert(s.id.clone(), s.clone());
            *default = Some(s.id.clone());
            Ok(s)
        }
    }
}

/// Record a process made by fork (not spawned by init) with init, and stash its channel there,
/// so a restarted daemon finds it like any session (`tag`) and takes its channel back (`key`).
pub async fn adopt(
    sb: &Sandbox,
    pid: i32,
    tag: String,
    key: String,
    chan: &std::os::unix::net::UnixStream,
) -> Result<()> {
    let keep = chan.try_clone().map_err(SessionError::Channel)?;
    let conn = InitConn::connect(&sb.dirs.sock()).await?;
    conn.send(&Request::Adopt { pid, tag, stash: Some(key) }, &[keep.as_raw_fd()])?;
    drop(keep);
    match conn.recv().await? {
        Response::Ok => Ok(()),
        Response::Error { errno, message } => Err(init_error(errno, message)),
        other => Err(unexpected(other)),
    }
}

/// [`adopt`] after the answer to the operation that made the process (it only matters after a
/// daemon restart); a sandbox killed meanwhile has nothing to register with.
pub fn adopt_behind_answer(
    sb: Arc<Sandbox>,
    pid: i32,
    tag: String,
    key: String,
    chan: std::os::unix::net::UnixStream,
    what: &'static str,
) {
    tokio::spawn(async move {
        tokio::time::sleep(crate::activity::BEHIND_ANSWER).await;
        if let Err(e) = adopt(&sb, pid, tag, key, &chan).await {
            if !sb.is_dead() {
                tracing::warn!(sandbox = %sb.id, "{what} not registered with init: {e}");
            }
        }
    });
}

pub async fn create(
    sb: &Sandbox,
    kind: &str,
    default: bool,
    cwd: Option<String>,
    env: &BTreeMap<String, String>,
) -> Result<Session> {
    create_as(sb, None, kind, default, cwd, env).await
}

/// [`create`] with a chosen session id (sessions recreated after a rollback keep theirs).
pub async fn create_as(
    sb: &Sandbox,
    id: Option<String>,
    kind: &str,
    default: bool,
    cwd: Option<String>,
    env: &BTreeMap<String, String>,
) -> Result<Session> {
    if !SESSION_KINDS.contains(&kind) {
        return Err(RuntimeError::BadRequest(format!(
            "session kind {kind:?} is unknown: use \"python\", \"shell\", \"javascript\" or \"typescript\""
        )));
    }
    let session_env = sb.env_with(env);
    if NODE_KINDS.contains(&kind) && !has_node(&sb.rootfs(), &session_env) {
        return Err(RuntimeError::BadRequest(format!(
            "image {:?} has no node on the session's PATH: {kind} sessions need it (e.g. a template whose recipe \
             runs `apt-get install -y nodejs`, such as templates/code-interpreter-v1.toml, or PATH in `env` naming \
             node's directory)",
            sb.spec.image
        )));
    }
    let id = id.unwrap_or_else(|| format!("ss-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]));
    sb.dirty.store(true, Ordering::SeqCst);
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(SessionError::Channel)?;
    let log = sb.open_log(&format!("{id}.log"), true)?;
    let conn = InitConn::connect(&sb.dirs.sock()).await?;
    conn.send(
        &Request::Spawn(SpawnRequest {
            argv: vec!["python3".into(), "-c".into(), SERVER_SOURCE.into(), kind.into()],
            env: session_env,
            cwd: cwd.unwrap_or_else(|| sb.spec.cwd.clone()),
            background: true,
            stdin: false,
            stdout: true,
            stderr: true,
            fd3: true,
            tag: session_tag(&id, kind, default),
            ids: None,
            pty: None,
            allow_setuid: false,
            attached: false,
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
    // init keeps a copy of our end, so the session outlives a daemon restart (see `recover`).
    let keep = ours.try_clone().map_err(SessionError::Channel)?;
    let stash = InitConn::connect(&sb.dirs.sock()).await?;
    stash.send(&Request::Stash { key: id.clone(), pid }, &[keep.as_raw_fd()])?;
    drop(keep);
    let stashed = stash.recv().await;
    let session = Session::attach(id, kind.into(), pid, crate::now(), ours)?;
    if !matches!(stashed, Ok(Response::Ok)) {
        let _ = kill_process(sb, pid).await;
        return Err(SessionError::DidNotStart { why: format!("{stashed:?}"), log: String::new() }.into());
    }
    match session.request(&serde_json::json!({"op": "ping"}), Some(START_TIMEOUT)).await {
        Ok(Some(_)) => Ok(session),
        other => {
            let _ = kill_process(sb, pid).await;
            let log = std::fs::read_to_string(sb.dirs.logs().join(format!("{}.log", session.id))).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(3).collect();
            let why = match other {
                Err(e) => e.to_string(),
                _ => "no answer".into(),
            };
            Err(SessionError::DidNotStart { why, log: format!(": {}", tail.join(" | ")) }.into())
        }
    }
}

pub async fn kill_process(sb: &Sandbox, pid: i32) -> Result<()> {
    InitConn::call(&sb.dirs.sock(), &Request::Kill { pid, signal: libc::SIGKILL, group: true }).await?;
    Ok(())
}

/// Run `req.code` (with `req.env` for this run only) in `session`.
pub async fn run(sb: &Sandbox, session: &Session, req: &RunCode, timeout: Option<Duration>) -> Result<SessionResult> {
    run_tailed(sb, session, req, timeout, None).await
}

/// What a session can be: python, a shell, node (`javascript`), or node compiling each run with
/// the `typescript` package (`typescript`).
pub const SESSION_KINDS: [&str; 4] = ["python", "shell", "javascript", "typescript"];
/// The kinds that run node.
const NODE_KINDS: [&str; 2] = ["javascript", "typescript"];

/// The names node goes by, looked up along the session's PATH (as the session server does).
const NODE_NAMES: [&str; 2] = ["node", "nodejs"];
/// The PATH a session server searches when its environment has none.
const DEFAULT_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// The absolute directories of the `PATH` in `env` (`KEY=value` entries; the first `PATH=`, as
/// `getenv` reads it), in order: the places the session server looks for node (relative entries
/// are skipped there too).
fn path_dirs(env: &[String]) -> Vec<&str> {
    let path = env.iter().find_map(|kv| kv.strip_prefix("PATH=")).unwrap_or(DEFAULT_PATH);
    path.split(':').filter(|d| d.starts_with('/')).collect()
}

/// Whether a javascript or typescript session of environment `env` in the sandbox whose root is `rootfs`
/// would find node.
fn has_node(rootfs: &std::path::Path, env: &[String]) -> bool {
    let candidates = path_dirs(env)
        .into_iter()
        .flat_map(|dir| NODE_NAMES.iter().map(move |n| format!("{}/{n}", dir.trim_end_matches('/'))));
    crate::sandbox::files::any_readable_file(rootfs, candidates)
}

/// How often a tailed run's output is looked at.
const TAIL_TICK: Duration = Duration::from_millis(50);

/// [`run`], passing output on to `out` (when given) while the run goes on.
async fn run_tailed(
    sb: &Sandbox,
    session: &Session,
    req: &RunCode,
    timeout: Option<Duration>,
    out: Option<tokio::sync::mpsc::Sender<RunOutput>>,
) -> Result<SessionResult> {
    check_run_env(&req.env)?;
    let _op = session.op_lock.lock().await;
    sb.dirty.store(true, Ordering::SeqCst);
    let mut msg = serde_json::json!({"op": "run", "code": req.code});
    if !req.env.is_empty() {
        msg["env"] = serde_json::json!(req.env);
    }
    let request = session.request(&msg, timeout);
    let resp = match out {
        Some(tx) => {
            tokio::pin!(request);
            // A run shorter than a tick costs nothing more: its output comes with its answer.
            let start = tokio::time::Instant::now() + TAIL_TICK;
            let mut tick = tokio::time::interval_at(start, TAIL_TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut tail = None;
            loop {
                tokio::select! {
                    r = &mut request => break r,
                    _ = tick.tick() => {
                        if tail.is_none() {
                            tail = crate::sandbox::procs::host_pid_of(sb, session.pid).map(OutputTail::new);
                        }
                        for o in tail.as_mut().map(OutputTail::poll).unwrap_or_default() {
                            // A listener that left does not stop the run.
                            let _ = tx.send(o).await;
                        }
                    }
                }
            }
        }
        None => request.await,
    }?;
    let Some(v) = resp else {
        let _ = kill_process(sb, session.pid).await;
        return Ok(SessionResult { timed_out: true, ..Default::default() });
    };
    if let Some(err) = v.get("error").filter(|e| e.get("name").and_then(|n| n.as_str()) == Some("ProtocolError")) {
        return Err(SessionError::Protocol(err.to_string()).into());
    }
    let s = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or_default().to_string();
    Ok(SessionResult {
        stdout: s("stdout"),
        stderr: s("stderr"),
        result: v.get("result").and_then(|x| x.as_str()).map(String::from),
        error: v.get("error").filter(|e| !e.is_null()).cloned(),
        exit_code: v.get("exit_code").and_then(|x| x.as_i64()).map(|c| c as i32),
        timed_out: false,
        displays: v.get("displays").and_then(|d| d.as_array()).cloned().unwrap_or_default(),
        execution_count: v.get("execution_count").and_then(|x| x.as_u64()),
    })
}

/// Names a run's env may set: shell identifiers (a shell session exports them), values without
/// NUL bytes.
pub fn check_run_env(env: &BTreeMap<String, String>) -> Result<()> {
    for (k, v) in env {
        let ident = k.chars().next().is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
            && k.chars().all(|c| c == '_' || c.is_ascii_alphanumeric());
        if !ident || k.starts_with("__bb_") {
            return Err(RuntimeError::BadRequest(format!(
                "env name {k:?} is not usable: letters, digits and _, not starting with a digit (nor with __bb_)"
            )));
        }
        if v.contains('\0') {
            return Err(RuntimeError::BadRequest(format!("the value of env {k:?} contains a NUL byte")));
        }
    }
    Ok(())
}

pub async fn kill(sb: &Sandbox, session: &Session) -> Result<()> {
    sb.dirty.store(true, Ordering::SeqCst);
    session.forget().await;
    match kill_process(sb, session.pid).await {
        Ok(()) | Err(RuntimeError::NotFound { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(kvs: &[&str]) -> Vec<String> {
        kvs.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn path_dirs_are_the_absolute_entries_of_path_or_the_default() {
        assert_eq!(path_dirs(&env(&["HOME=/root"])), vec!["/usr/local/bin", "/usr/bin", "/bin"]);
        assert_eq!(path_dirs(&env(&["PATH=/opt/node/bin:bin::/usr/bin"])), vec!["/opt/node/bin", "/usr/bin"]);
    }

    #[test]
    fn node_is_found_on_a_custom_path_dir_and_only_there() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("opt/node/bin")).unwrap();
        std::fs::write(root.path().join("opt/node/bin/node"), b"").unwrap();
        assert!(!has_node(root.path(), &env(&[])), "not on the default PATH");
        assert!(has_node(root.path(), &env(&["PATH=/usr/bin:/opt/node/bin/"])));
        std::fs::create_dir_all(root.path().join("usr/bin")).unwrap();
        std::fs::write(root.path().join("usr/bin/nodejs"), b"").unwrap();
        assert!(has_node(root.path(), &env(&[])), "nodejs on the default PATH");
        assert!(!has_node(root.path(), &env(&["PATH=/opt"])));
    }
}
