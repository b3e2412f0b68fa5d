//! envd, the in-sandbox agent of E2B, served by the daemon from the host side: process and
//! filesystem RPCs (Connect protocol, JSON), `/files`, `/health` and `/envs`. Nothing runs in the
//! sandbox for it, so a sandbox stays forkable; processes it starts are attached to the daemon
//! ([`crate::procs`]).

use crate::connect::{self, Code, RpcError};
use crate::procs::Ev;
use crate::E2b;
use axum::body::Body;
use axum::extract::{Extension, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use bb_runtime::model::{EntryInfo, RunCommand};
use bb_runtime::sandbox::files::SbPath;
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The port envd listens on in an E2B sandbox (what the SDK puts in `E2b-Sandbox-Port`).
pub const ENVD_PORT: u16 = 49983;
/// The user commands, code and files run as unless a request names another (E2B's default).
pub const DEFAULT_USER: &str = "user";
/// How long a SIGKILL's answer waits for the process to be gone.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// Keepalive interval when the client asks for none.
const KEEPALIVE: Duration = Duration::from_secs(50);

/// The sandbox a data-plane request is for (its runtime id), set by the dispatcher.
#[derive(Clone)]
pub struct Target {
    pub id: String,
}

type St = State<Arc<E2b>>;
type Tgt = Extension<Target>;

pub fn router(e: Arc<E2b>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/envs", get(envs))
        .route("/files", get(download).post(upload))
        .route("/process.Process/Start", post(start))
        .route("/process.Process/Connect", post(connect_process))
        .route("/process.Process/List", post(list))
        .route("/process.Process/SendInput", post(send_input))
        .route("/process.Process/StreamInput", post(stream_input))
        .route("/process.Process/SendSignal", post(send_signal))
        .route("/process.Process/CloseStdin", post(close_stdin))
        .route("/process.Process/Update", post(update))
        .route("/filesystem.Filesystem/Stat", post(stat))
        .route("/filesystem.Filesystem/ListDir", post(list_dir))
        .route("/filesystem.Filesystem/MakeDir", post(make_dir))
        .route("/filesystem.Filesystem/Move", post(move_entry))
        .route("/filesystem.Filesystem/Remove", post(remove))
        .route("/filesystem.Filesystem/WatchDir", post(crate::watch::watch_dir))
        .route("/filesystem.Filesystem/CreateWatcher", post(crate::watch::create_watcher))
        .route("/filesystem.Filesystem/GetWatcherEvents", post(crate::watch::get_watcher_events))
        .route("/filesystem.Filesystem/RemoveWatcher", post(crate::watch::remove_watcher))
        .fallback(no_route)
        .with_state(e)
}

async fn no_route(uri: axum::http::Uri) -> Response {
    files_error(StatusCode::NOT_FOUND, format!("no envd route {}", uri.path()))
}

async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

async fn envs(State(e): St, Extension(t): Tgt) -> Response {
    match e.rt.info(&t.id) {
        Ok(info) => axum::Json(info.env).into_response(),
        Err(err) => files_error(StatusCode::BAD_GATEWAY, err.to_string()),
    }
}

/// The user a request names (`Authorization: Basic base64(user:)`), if it names one.
pub(crate) fn user_header(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok())?;
    let b = v.strip_prefix("Basic ")?;
    let decoded = B64.decode(b.trim()).ok().and_then(|d| String::from_utf8(d).ok())?;
    Some(decoded.split(':').next().unwrap_or("").to_string()).filter(|u| !u.is_empty())
}

/// Who a request runs as, and the home its relative paths are taken against.
pub(crate) struct Who {
    /// None: root.
    pub user: Option<String>,
    pub home: String,
}

/// The user asked for, or E2B's default `user` when the sandbox has one (root otherwise).
pub(crate) fn who(e: &E2b, t: &Target, asked: Option<String>) -> Result<Who, RpcError> {
    let root = || Who { user: None, home: "/root".into() };
    match asked.as_deref() {
        Some("root") => Ok(root()),
        Some(name) => {
            let u = e.rt.sandbox_user(&t.id, name)?;
            Ok(Who { user: Some(u.name), home: u.home })
        }
        None => match e.rt.sandbox_user(&t.id, DEFAULT_USER) {
            Ok(u) => Ok(Who { user: Some(u.name), home: u.home }),
            Err(_) => Ok(root()),
        },
    }
}

/// A path as envd takes it: absolute, or relative to the user's home (`~` is the home too).
pub(crate) fn sb_path(p: &str, home: &str) -> Result<SbPath, RpcError> {
    let p = p.strip_prefix('~').map(|rest| format!("{home}{rest}")).unwrap_or_else(|| p.to_string());
    let full = if p.starts_with('/') { p } else { format!("{home}/{p}") };
    Ok(SbPath::parse(&full)?)
}

// ---- process ----

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ProcessConfig {
    #[serde(default)]
    cmd: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    envs: BTreeMap<String, String>,
    cwd: Option<String>,
}

#[derive(Deserialize, Default)]
struct StartReq {
    #[serde(default)]
    process: ProcessConfig,
    pty: Option<PtyReq>,
    tag: Option<String>,
    stdin: Option<bool>,
}

/// envd's `PTY`: the terminal's size.
#[derive(Deserialize, Default)]
struct PtyReq {
    #[serde(default)]
    size: PtySize,
}

#[derive(Deserialize, Default)]
struct PtySize {
    #[serde(default)]
    rows: u32,
    #[serde(default)]
    cols: u32,
}

impl PtySize {
    fn checked(&self) -> Result<(u16, u16), RpcError> {
        let fits = |n: u32| u16::try_from(n).ok().filter(|n| *n > 0);
        match (fits(self.rows), fits(self.cols)) {
            (Some(r), Some(c)) => Ok((r, c)),
            _ => Err(RpcError::new(
                Code::InvalidArgument,
                format!("pty size {}x{}: rows and cols are 1 to 65535", self.rows, self.cols),
            )),
        }
    }
}

#[derive(Deserialize, Default)]
struct UpdateReq {
    #[serde(default)]
    process: Selector,
    pty: Option<PtyReq>,
}

#[derive(Deserialize, Default)]
struct Selector {
    pid: Option<u32>,
    tag: Option<String>,
}

#[derive(Deserialize, Default)]
struct SelectorReq {
    #[serde(default)]
    process: Selector,
}

#[derive(Deserialize, Default)]
struct InputReq {
    #[serde(default)]
    process: Selector,
    #[serde(default)]
    input: Input,
}

#[derive(Deserialize, Default)]
struct Input {
    stdin: Option<String>,
    pty: Option<String>,
}

#[derive(Deserialize, Default)]
struct SignalReq {
    #[serde(default)]
    process: Selector,
    #[serde(default)]
    signal: Value,
}

pub(crate) fn keepalive_of(headers: &HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(KEEPALIVE)
}

async fn start(State(e): St, Extension(t): Tgt, headers: HeaderMap, body: Bytes) -> Response {
    match start_process(&e, &t, &headers, &body).await {
        Ok((pid, rx)) => stream_events(pid, rx, keepalive_of(&headers)),
        Err(err) => err.stream(),
    }
}

async fn start_process(
    e: &E2b,
    t: &Target,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(u32, mpsc::Receiver<Ev>), RpcError> {
    let req: StartReq = connect::single_envelope(body)?;
    let who = who(e, t, user_header(headers))?;
    let pty = req.pty.as_ref().map(|p| p.size.checked()).transpose()?;
    if req.process.cmd.is_empty() {
        return Err(RpcError::new(Code::InvalidArgument, "process.cmd is empty: give the program to run"));
    }
    let cwd = match &req.process.cwd {
        Some(c) if !c.is_empty() => sb_path(c, &who.home)?.display(),
        _ => who.home.clone(),
    };
    let config = json!({"cmd": req.process.cmd, "args": req.process.args, "envs": req.process.envs, "cwd": cwd});
    let mut argv = vec![req.process.cmd.clone()];
    argv.extend(req.process.args.iter().cloned());
    let run = RunCommand {
        args: Some(argv),
        cwd: Some(cwd),
        env: req.process.envs.clone(),
        timeout: Some(0.0),
        user: who.user,
        ..Default::default()
    };
    let note = crate::procs::note(&config, req.tag.as_deref());
    let attached = e.rt.start_attached(&t.id, run, req.stdin.unwrap_or(false), pty, note).await?;
    let pid = attached.pid as u32;
    let (_, rx) = e.procs.adopt(&t.id, config, req.tag, attached);
    Ok((pid, rx))
}

fn event(ev: Value) -> Bytes {
    connect::message(&json!({"event": ev}))
}

/// A process's events as a Connect server stream: `start`, output, keepalives when idle, `end`.
/// A sandbox that goes away breaks the stream (an error in the body: the connection, or the
/// HTTP/2 stream, is reset), as a dead envd would.
fn stream_events(pid: u32, mut rx: mpsc::Receiver<Ev>, keepalive: Duration) -> Response {
    let (out, body_rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        if out.send(Ok(event(json!({"start": {"pid": pid}})))).await.is_err() {
            return;
        }
        loop {
            let msg = tokio::select! {
                ev = rx.recv() => ev,
                _ = tokio::time::sleep(keepalive) => {
                    if out.send(Ok(event(json!({"keepalive": {}})))).await.is_err() { return; }
                    continue;
                }
                _ = out.closed() => return,
            };
            let chunk = match msg {
                Some(Ev::Stdout(b)) => event(json!({"data": {"stdout": B64.encode(&b)}})),
                Some(Ev::Stderr(b)) => event(json!({"data": {"stderr": B64.encode(&b)}})),
                Some(Ev::Pty(b)) => event(json!({"data": {"pty": B64.encode(&b)}})),
                Some(Ev::End { code, signal }) => {
                    let _ = out.send(Ok(event(json!({"end": end_event(code, signal)})))).await;
                    let _ = out.send(Ok(connect::end_stream(None))).await;
                    return;
                }
                Some(Ev::Lost) | None => {
                    let _ = out.send(Err(std::io::Error::other("the sandbox went away"))).await;
                    return;
                }
            };
            if out.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
    });
    let stream = futures::stream::unfold(body_rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    connect::stream_response(Body::from_stream(stream))
}

/// envd's `EndEvent`: Go's `ProcessState` as it reports it.
fn end_event(code: Option<i32>, signal: Option<i32>) -> Value {
    match (code, signal) {
        (Some(c), _) => json!({"exitCode": c, "exited": true, "status": format!("exit status {c}")}),
        (None, Some(s)) => {
            let name = match s {
                libc::SIGKILL => "killed".to_string(),
                libc::SIGTERM => "terminated".to_string(),
                libc::SIGINT => "interrupt".to_string(),
                n => format!("signal {n}"),
            };
            json!({"exitCode": -1, "exited": false, "status": format!("signal: {name}")})
        }
        (None, None) => json!({"exitCode": -1, "exited": false, "status": "unknown", "error": "exit status unknown"}),
    }
}

fn select(e: &E2b, t: &Target, s: &Selector) -> Result<Arc<crate::procs::Proc>, RpcError> {
    let found = match (s.pid, &s.tag) {
        (Some(pid), _) => e.procs.get(&t.id, pid),
        (None, Some(tag)) => e.procs.by_tag(&t.id, tag),
        (None, None) => return Err(RpcError::new(Code::InvalidArgument, "process selector is empty: give pid or tag")),
    };
    found.ok_or_else(|| {
        let what =
            s.pid.map(|p| format!("pid {p}")).or(s.tag.as_ref().map(|t| format!("tag {t:?}"))).unwrap_or_default();
        RpcError::new(Code::NotFound, format!("process with {what} not found"))
    })
}

async fn connect_process(State(e): St, Extension(t): Tgt, headers: HeaderMap, body: Bytes) -> Response {
    let proc = connect::single_envelope::<SelectorReq>(&body).and_then(|r| select(&e, &t, &r.process));
    match proc {
        Ok(p) => stream_events(p.pid, p.subscribe(), keepalive_of(&headers)),
        Err(err) => err.stream(),
    }
}

pub(crate) fn unary(r: Result<Value, RpcError>) -> Response {
    match r {
        Ok(v) => connect::unary_response(&v),
        Err(err) => err.unary(),
    }
}

async fn list(State(e): St, Extension(t): Tgt, body: Bytes) -> Response {
    if let Err(err) = connect::parse::<Value>(&body) {
        return err.unary();
    }
    let processes: Vec<Value> = e
        .procs
        .of(&t.id)
        .iter()
        .map(|p| {
            let mut v = json!({"config": p.config, "pid": p.pid});
            if let Some(tag) = &p.tag {
                v["tag"] = json!(tag);
            }
            v
        })
        .collect();
    unary(Ok(json!({ "processes": processes })))
}

/// Input for a process: its stdin, or its terminal's (`pty`) for one started on a terminal.
async fn write_input(p: &crate::procs::Proc, input: &Input) -> Result<(), RpcError> {
    let decode = |b64: &str, what: &str| {
        B64.decode(b64)
            .map_err(|err| RpcError::new(Code::InvalidArgument, format!("input.{what} is not base64: {err}")))
    };
    match (&input.pty, &p.pty) {
        (Some(b64), Some(pty)) => {
            let data = decode(b64, "pty")?;
            pty.write(&data).await.map_err(|err| {
                RpcError::new(Code::FailedPrecondition, format!("writing to the terminal of process {}: {err}", p.pid))
            })
        }
        (Some(_), None) => Err(RpcError::new(
            Code::FailedPrecondition,
            format!("process {} has no terminal: send input.stdin (or start it with pty)", p.pid),
        )),
        (None, _) => write_stdin(p, &decode(input.stdin.as_deref().unwrap_or(""), "stdin")?).await,
    }
}

async fn write_stdin(p: &crate::procs::Proc, data: &[u8]) -> Result<(), RpcError> {
    let Some(w) = p.stdin.as_ref() else {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            format!("process {} has no stdin: start it with stdin=True", p.pid),
        ));
    };
    w.write_all(data).await.map_err(|err| {
        RpcError::new(Code::FailedPrecondition, format!("writing to the stdin of process {}: {err}", p.pid))
    })
}

async fn send_input(State(e): St, Extension(t): Tgt, body: Bytes) -> Response {
    let r = async {
        let req: InputReq = connect::parse(&body)?;
        let p = select(&e, &t, &req.process)?;
        write_input(&p, &req.input).await?;
        Ok(json!({}))
    };
    unary(r.await)
}

#[derive(Deserialize, Default)]
struct StreamInputReq {
    #[serde(default)]
    start: Option<SelectorReq>,
    #[serde(default)]
    data: Option<DataReq>,
}

#[derive(Deserialize, Default)]
struct DataReq {
    #[serde(default)]
    input: Input,
}

/// Client stream: a `start` naming the process, then `data` messages (keepalives ignored).
async fn stream_input(State(e): St, Extension(t): Tgt, body: Bytes) -> Response {
    let r = async {
        let msgs: Vec<StreamInputReq> = connect::split_envelopes(&body)?;
        let mut proc = None;
        for m in msgs {
            if let Some(s) = m.start {
                proc = Some(select(&e, &t, &s.process)?);
            }
            if let Some(d) = m.data {
                let p = proc.as_ref().ok_or_else(|| RpcError::new(Code::InvalidArgument, "data came before start"))?;
                write_input(p, &d.input).await?;
            }
        }
        Ok::<(), RpcError>(())
    };
    match r.await {
        Ok(()) => {
            connect::stream_response(Body::from([connect::message(&json!({})), connect::end_stream(None)].concat()))
        }
        Err(err) => err.stream(),
    }
}

async fn close_stdin(State(e): St, Extension(t): Tgt, body: Bytes) -> Response {
    let r = async {
        let req: SelectorReq = connect::parse(&body)?;
        let p = select(&e, &t, &req.process)?;
        if let Some(stdin) = &p.stdin {
            stdin.close().await;
        }
        Ok(json!({}))
    };
    unary(r.await)
}

async fn send_signal(State(e): St, Extension(t): Tgt, body: Bytes) -> Response {
    let r = async {
        let req: SignalReq = connect::parse(&body)?;
        let p = select(&e, &t, &req.process)?;
        let sig = match &req.signal {
            Value::String(s) if s == "SIGNAL_SIGKILL" => libc::SIGKILL,
            Value::String(s) if s == "SIGNAL_SIGTERM" => libc::SIGTERM,
            Value::Number(n) if n.as_i64() == Some(9) || n.as_i64() == Some(15) => n.as_i64().unwrap_or(9) as i32,
            other => {
                return Err(RpcError::new(
                    Code::InvalidArgument,
                    format!("signal {other} is not SIGNAL_SIGKILL or SIGNAL_SIGTERM"),
                ))
            }
        };
        // Watching before the signal: a SIGKILL is answered once the process is gone (what runs
        // attached holds off a pause, and the SDK's `kill()` then `pause()` must work).
        let mut events = p.subscribe();
        e.rt.kill_process(&t.id, p.pid as i32, Some(sig)).await?;
        if sig == libc::SIGKILL {
            let gone = async {
                while let Some(ev) = events.recv().await {
                    if matches!(ev, Ev::End { .. } | Ev::Lost) {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(KILL_WAIT, gone).await;
        }
        Ok(json!({}))
    };
    unary(r.await)
}

/// `Update`: resize a process's terminal.
async fn update(State(e): St, Extension(t): Tgt, body: Bytes) -> Response {
    let r = async {
        let req: UpdateReq = connect::parse(&body)?;
        let p = select(&e, &t, &req.process)?;
        let Some(size) = &req.pty else { return Ok(json!({})) };
        let (rows, cols) = size.size.checked()?;
        let Some(pty) = &p.pty else {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                format!("process {} has no terminal to resize: start it with pty", p.pid),
            ));
        };
        pty.resize(rows, cols)?;
        Ok(json!({}))
    };
    unary(r.await)
}

// ---- filesystem ----

#[derive(Deserialize, Default)]
struct PathReq {
    #[serde(default)]
    path: String,
    #[serde(default)]
    depth: u32,
}

#[derive(Deserialize, Default)]
struct MoveReq {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

pub(crate) fn rfc3339(secs: f64) -> String {
    let t = std::time::UNIX_EPOCH + Duration::from_secs_f64(secs.max(0.0));
    humantime::format_rfc3339_nanos(t).to_string()
}

fn permissions(kind: &str, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        "dir" => 'd',
        "symlink" => 'L',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// User and group names by id, for entries' `owner` and `group`.
pub(crate) type Names = (std::collections::HashMap<u32, String>, std::collections::HashMap<u32, String>);

pub(crate) fn names_of(e: &E2b, t: &Target) -> Names {
    e.rt.sandbox_id_names(&t.id).unwrap_or_default()
}

/// envd's `EntryInfo`.
pub(crate) fn entry_json(en: &EntryInfo, meta: &Meta, names: &Names) -> Value {
    let name =
        |m: &std::collections::HashMap<u32, String>, id: u32| m.get(&id).cloned().unwrap_or_else(|| id.to_string());
    let kind = match en.kind.as_str() {
        "file" => "FILE_TYPE_FILE",
        "dir" => "FILE_TYPE_DIRECTORY",
        "symlink" => "FILE_TYPE_SYMLINK",
        _ => "FILE_TYPE_UNSPECIFIED",
    };
    let mut v = json!({
        "name": en.name,
        "type": kind,
        "path": en.path,
        "size": en.size,
        "mode": en.mode & 0o7777,
        "permissions": permissions(&en.kind, en.mode),
        "owner": name(&names.0, en.uid),
        "group": name(&names.1, en.gid),
        "modifiedTime": rfc3339(en.mtime),
    });
    if let Some(target) = &en.symlink_target {
        v["symlinkTarget"] = json!(target);
    }
    if !meta.is_empty() {
        v["metadata"] = json!(meta);
    }
    v
}

/// A file's E2B metadata: its `user.e2b.*` extended attributes.
pub(crate) type Meta = BTreeMap<String, String>;
/// Where E2B keeps a file's metadata (envd's `X-Metadata-*` upload headers).
pub(crate) const META_XATTR_PREFIX: &str = "user.e2b.";

/// An entry with its metadata (none when it cannot be read: the entry is still answered).
pub(crate) fn with_meta(fs: &bb_runtime::sandbox::files::SandboxFs, en: EntryInfo) -> (EntryInfo, Meta) {
    let meta = SbPath::parse(&en.path).and_then(|p| fs.user_xattrs(&p, META_XATTR_PREFIX)).unwrap_or_default();
    (en, meta)
}

async fn fs_call<T: Send + 'static>(
    e: &E2b,
    t: &Target,
    who: &Who,
    f: impl FnOnce(&bb_runtime::sandbox::files::SandboxFs) -> bb_runtime::Result<T> + Send + 'static,
) -> Result<T, RpcError> {
    let fs = e.rt.fs_as(&t.id, who.user.as_deref()).await?;
    tokio::task::spawn_blocking(move || f(&fs))
        .await
        .map_err(|err| RpcError::new(Code::Internal, format!("filesystem task: {err}")))?
        .map_err(RpcError::from)
}

async fn stat(State(e): St, Extension(t): Tgt, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        let req: PathReq = connect::parse(&body)?;
        let who = who(&e, &t, user_header(&headers))?;
        let path = sb_path(&req.path, &who.home)?;
        let (en, meta) = fs_call(&e, &t, &who, move |fs| Ok(with_meta(fs, fs.stat(&path)?))).await?;
        Ok(json!({"entry": entry_json(&en, &meta, &names_of(&e, &t))}))
    };
    unary(r.await)
}

async fn list_dir(State(e): St, Extension(t): Tgt, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        let req: PathReq = connect::parse(&body)?;
        let who = who(&e, &t, user_header(&headers))?;
        let path = sb_path(&req.path, &who.home)?;
        let depth = req.depth.max(1);
        let mut entries = fs_call(&e, &t, &who, move |fs| {
            Ok(fs.list(&path, depth)?.into_iter().map(|en| with_meta(fs, en)).collect::<Vec<_>>())
        })
        .await?;
        entries.sort_by(|a, b| a.0.path.cmp(&b.0.path));
        let names = names_of(&e, &t);
        Ok(json!({"entries": entries.iter().map(|(en, meta)| entry_json(en, meta, &names)).collect::<Vec<_>>()}))
    };
    unary(r.await)
}

async fn make_dir(State(e): St, Extension(t): Tgt, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        let req: PathReq = connect::parse(&body)?;
        let who = who(&e, &t, user_header(&headers))?;
        let path = sb_path(&req.path, &who.home)?;
        let shown = path.display();
        let made = fs_call(&e, &t, &who, move |fs| {
            if fs.stat(&path).is_ok() {
                return Ok(None);
            }
            fs.mkdir(&path, true).map(Some)
        })
        .await?;
        match made {
            Some(en) => Ok(json!({"entry": entry_json(&en, &Meta::new(), &names_of(&e, &t))})),
            None => Err(RpcError::new(Code::AlreadyExists, format!("{shown} already exists"))),
        }
    };
    unary(r.await)
}

async fn move_entry(State(e): St, Extension(t): Tgt, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        let req: MoveReq = connect::parse(&body)?;
        let who = who(&e, &t, user_header(&headers))?;
        let (from, to) = (sb_path(&req.source, &who.home)?, sb_path(&req.destination, &who.home)?);
        let (en, meta) = fs_call(&e, &t, &who, move |fs| Ok(with_meta(fs, fs.rename(&from, &to)?))).await?;
        Ok(json!({"entry": entry_json(&en, &meta, &names_of(&e, &t))}))
    };
    unary(r.await)
}

async fn remove(State(e): St, Extension(t): Tgt, headers: HeaderMap, body: Bytes) -> Response {
    let r = async {
        let req: PathReq = connect::parse(&body)?;
        let who = who(&e, &t, user_header(&headers))?;
        let path = sb_path(&req.path, &who.home)?;
        fs_call(&e, &t, &who, move |fs| fs.remove(&path, true)).await?;
        Ok(json!({}))
    };
    unary(r.await)
}

// ---- /files ----

/// `/files` errors as envd answers them: `{"code": <status>, "message"}`.
fn files_error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, axum::Json(json!({"code": status.as_u16(), "message": message.into()}))).into_response()
}

fn files_rpc_error(err: RpcError) -> Response {
    let status = match err.code {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument | Code::FailedPrecondition | Code::AlreadyExists => StatusCode::BAD_REQUEST,
        Code::ResourceExhausted => StatusCode::PAYLOAD_TOO_LARGE,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::Unavailable => StatusCode::BAD_GATEWAY,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    files_error(status, err.message)
}

#[derive(Deserialize, Default)]
struct FilesQuery {
    path: Option<String>,
    username: Option<String>,
}

fn files_query(uri: &axum::http::Uri) -> Result<FilesQuery, RpcError> {
    axum::extract::Query::<FilesQuery>::try_from_uri(uri)
        .map(|q| q.0)
        .map_err(|err| RpcError::new(Code::InvalidArgument, format!("invalid query: {err}")))
}

fn wants_gzip(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|p| p.trim().split(';').next() == Some("gzip")))
}

async fn download(State(e): St, Extension(t): Tgt, headers: HeaderMap, uri: axum::http::Uri) -> Response {
    let r = async {
        let q = files_query(&uri)?;
        let who = who(&e, &t, q.username.filter(|u| !u.is_empty()))?;
        let Some(p) = q.path.filter(|p| !p.is_empty()) else {
            return Err(RpcError::new(Code::InvalidArgument, "give the file's path: ?path=/home/user/file.txt"));
        };
        let path = sb_path(&p, &who.home)?;
        let (file, size) = fs_call(&e, &t, &who, move |fs| fs.open_read(&path)).await?;
        Ok((file, size))
    };
    let (file, size) = match r.await {
        Ok(x) => x,
        Err(err) => return files_rpc_error(err),
    };
    if !wants_gzip(&headers) {
        return octet_stream(file, size);
    }
    let stream = tokio_util::io::ReaderStream::with_capacity(tokio::fs::File::from_std(file), 256 * 1024);
    let mut enc = Some(flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
    let gz = stream.map(Some).chain(futures::stream::once(async { None })).map(
        move |chunk| -> Result<Bytes, std::io::Error> {
            let Some(w) = enc.as_mut() else { return Ok(Bytes::new()) };
            match chunk {
                Some(c) => {
                    w.write_all(&c?)?;
                    Ok(Bytes::from(std::mem::take(w.get_mut())))
                }
                None => Ok(Bytes::from(enc.take().expect("encoder until the end").finish()?)),
            }
        },
    );
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_ENCODING, "gzip")
        .body(Body::from_stream(gz))
        .expect("valid response")
}

/// A whole file as an `application/octet-stream` answer, streamed.
pub(crate) fn octet_stream(file: std::fs::File, size: u64) -> Response {
    let stream = tokio_util::io::ReaderStream::with_capacity(tokio::fs::File::from_std(file), 256 * 1024);
    Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, size)
        .body(Body::from_stream(stream))
        .expect("valid response")
}

/// Where an upload's bytes go: the file, through a gunzip when the body is compressed.
enum UploadSink {
    Plain(std::fs::File),
    Gunzip(Box<flate2::write::GzDecoder<std::fs::File>>),
}

impl UploadSink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<()> {
        match self {
            UploadSink::Plain(f) => f.write_all(b),
            UploadSink::Gunzip(d) => d.write_all(b),
        }
    }
    fn finish(self) -> std::io::Result<(std::fs::File, u64)> {
        let f = match self {
            UploadSink::Plain(f) => f,
            UploadSink::Gunzip(d) => d.finish()?,
        };
        let len = f.metadata()?.len();
        Ok((f, len))
    }
}

/// Write one file from a stream of chunks (at most `limit` bytes, after gunzip), atomically.
async fn write_one<S, E>(
    e: &E2b,
    t: &Target,
    who: &Who,
    path: SbPath,
    gzip: bool,
    meta: &Meta,
    mut chunks: S,
) -> Result<Value, RpcError>
where
    S: futures::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let limit = e.rt.cfg.max_file_bytes;
    let fs = Arc::new(e.rt.fs_as(&t.id, who.user.as_deref()).await?);
    let (fs2, p2) = (fs.clone(), path.clone());
    let mut up = tokio::task::spawn_blocking(move || fs2.begin_write(&p2, None))
        .await
        .map_err(|err| RpcError::new(Code::Internal, format!("upload task: {err}")))??;
    let file = up.take_file();
    let mut sink =
        if gzip { UploadSink::Gunzip(Box::new(flate2::write::GzDecoder::new(file))) } else { UploadSink::Plain(file) };
    let mut seen: u64 = 0;
    let too_large = || {
        RpcError::new(
            Code::ResourceExhausted,
            format!("the file is larger than the daemon's limit of {limit} bytes (--max-file-bytes)"),
        )
    };
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|err| RpcError::new(Code::InvalidArgument, format!("upload interrupted: {err}")))?;
        seen += chunk.len() as u64;
        if seen > limit {
            return Err(too_large());
        }
        tokio::task::block_in_place(|| sink.write(&chunk))
            .map_err(|err| RpcError::new(Code::InvalidArgument, format!("writing {}: {err}", path.display())))?;
    }
    let (file, len) = tokio::task::block_in_place(|| sink.finish())
        .map_err(|err| RpcError::new(Code::InvalidArgument, format!("writing {}: {err}", path.display())))?;
    if len > limit {
        return Err(too_large());
    }
    up.put_file(file);
    for (k, v) in meta {
        up.set_xattr(&format!("{META_XATTR_PREFIX}{k}"), v.as_bytes())?;
    }
    let en = tokio::task::spawn_blocking(move || fs.commit(up))
        .await
        .map_err(|err| RpcError::new(Code::Internal, format!("upload task: {err}")))??;
    let mut v = json!({"name": en.name, "type": "file", "path": en.path});
    if !meta.is_empty() {
        v["metadata"] = json!(meta);
    }
    Ok(v)
}

/// Most metadata entries one upload may carry, and their largest key and value.
const MAX_META_KEYS: usize = 64;
const MAX_META_KEY: usize = 200;
const MAX_META_VALUE: usize = 8 << 10;

/// An upload's `X-Metadata-<key>: <value>` headers (keys lowercased, as envd stores them).
fn upload_meta(headers: &HeaderMap) -> Result<Meta, RpcError> {
    let mut meta = Meta::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else { continue };
        let bad = |why: String| RpcError::new(Code::InvalidArgument, format!("metadata {key:?}: {why}"));
        if key.is_empty() || key.len() > MAX_META_KEY {
            return Err(bad(format!("keys are 1 to {MAX_META_KEY} characters")));
        }
        let v = value.to_str().ok().filter(|v| v.bytes().all(|b| (0x20..0x7f).contains(&b)));
        let Some(v) = v else { return Err(bad("values are printable US-ASCII".into())) };
        if v.len() > MAX_META_VALUE {
            return Err(bad(format!("values are at most {MAX_META_VALUE} bytes")));
        }
        meta.insert(key.to_ascii_lowercase(), v.to_string());
    }
    if meta.len() > MAX_META_KEYS {
        return Err(RpcError::new(
            Code::InvalidArgument,
            format!("at most {MAX_META_KEYS} metadata entries per upload"),
        ));
    }
    Ok(meta)
}

async fn upload(State(e): St, Extension(t): Tgt, headers: HeaderMap, req: Request) -> Response {
    // What can be refused before the body is read is checked first, the body then drained (an
    // answer given over an unread body makes hyper close a connection the client may reuse).
    let checked = files_query(req.uri())
        .and_then(|q| Ok((who(&e, &t, q.username.clone().filter(|u| !u.is_empty()))?, q, upload_meta(&headers)?)));
    let (who, q, meta) = match checked {
        Ok(x) => x,
        Err(err) => {
            crate::drain(req).await;
            return files_rpc_error(err);
        }
    };
    let single = q.path.as_deref().filter(|p| !p.is_empty()).map(|p| sb_path(p, &who.home));
    if let Some(Err(err)) = single {
        crate::drain(req).await;
        return files_rpc_error(err);
    }
    let r = async {
        let ctype = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        let gzip =
            headers.get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()).is_some_and(|v| v.trim() == "gzip");
        if ctype.starts_with("multipart/form-data") {
            let mut mp = <axum::extract::Multipart as axum::extract::FromRequest<()>>::from_request(req, &())
                .await
                .map_err(|err| RpcError::new(Code::InvalidArgument, format!("invalid multipart body: {err}")))?;
            let mut written = Vec::new();
            while let Some(field) = mp
                .next_field()
                .await
                .map_err(|err| RpcError::new(Code::InvalidArgument, format!("invalid multipart body: {err}")))?
            {
                let name = field.file_name().map(str::to_string);
                let target = match (&q.path, written.is_empty(), name) {
                    (Some(p), true, _) if !p.is_empty() => p.clone(),
                    (_, _, Some(n)) if !n.is_empty() => n,
                    _ => {
                        return Err(RpcError::new(
                            Code::InvalidArgument,
                            "a multipart file has no path: give ?path= or a filename",
                        ))
                    }
                };
                let path = sb_path(&target, &who.home)?;
                written.push(write_one(&e, &t, &who, path, false, &meta, Box::pin(field)).await?);
            }
            if written.is_empty() {
                return Err(RpcError::new(Code::InvalidArgument, "the multipart body holds no file"));
            }
            Ok(Value::Array(written))
        } else {
            let Some(Ok(path)) = single else {
                crate::drain(req).await;
                return Err(RpcError::new(Code::InvalidArgument, "give the file's path: ?path=/home/user/file.txt"));
            };
            let stream = req.into_body().into_data_stream();
            Ok(Value::Array(vec![write_one(&e, &t, &who, path, gzip, &meta, stream).await?]))
        }
    };
    match r.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(err) => files_rpc_error(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_taken_against_home_and_may_not_climb_out() {
        assert_eq!(sb_path("a/b.txt", "/home/user").unwrap().display(), "/home/user/a/b.txt");
        assert_eq!(sb_path("/etc/x", "/root").unwrap().display(), "/etc/x");
        assert_eq!(sb_path("~/x", "/root").unwrap().display(), "/root/x");
        assert!(sb_path("/../../etc", "/root").is_err());
        assert!(sb_path("../../../etc", "/home/user").is_err());
        assert_eq!(permissions("dir", 0o755), "drwxr-xr-x");
        assert_eq!(permissions("file", 0o640), "-rw-r-----");
    }

    #[test]
    fn end_events_read_as_envd_reports_them() {
        assert_eq!(end_event(Some(0), None)["status"], "exit status 0");
        assert_eq!(end_event(None, Some(9))["exitCode"], -1);
        assert_eq!(end_event(None, Some(9))["status"], "signal: killed");
    }
}
