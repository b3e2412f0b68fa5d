//! The code interpreter E2B's `e2b-code-interpreter` SDK reaches on port 49999 of a sandbox
//! (a Jupyter server in their template), served from the host side on branchbox's sessions: a
//! context is a session (python, or bash as a shell session), so a fork or a rollback carries
//! contexts with it. `/execute` answers NDJSON lines (`stdout`, `stderr`, `result`, `error`,
//! `number_of_executions`, `end_of_execution`); a client that goes away interrupts the run
//! (SIGINT: a KeyboardInterrupt in python).

use crate::envd::Target;
use crate::E2b;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use bb_runtime::model::{CreateSession, RunCode, SessionInfo, SessionResult};
use bb_runtime::session::tail::RunOutput;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::mpsc;

/// The port the SDK sends code interpreter requests to.
pub const JUPYTER_PORT: u16 = 49999;

type St = State<Arc<E2b>>;
type Tgt = Extension<Target>;

pub fn router(e: Arc<E2b>) -> Router {
    Router::new()
        .route("/health", get(|| async { "OK" }))
        .route("/execute", post(execute))
        .route("/contexts", post(create_context).get(list_contexts))
        .route("/contexts/:cid", delete(remove_context))
        .route("/contexts/:cid/restart", post(restart_context))
        .fallback(
            |uri: axum::http::Uri| async move { error(StatusCode::NOT_FOUND, format!("no route {}", uri.path())) },
        )
        .with_state(e)
}

/// The code interpreter's errors: a status and a plain message (the SDK shows the body).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct InterpError {
    status: StatusCode,
    message: String,
}

impl IntoResponse for InterpError {
    fn into_response(self) -> Response {
        (self.status, self.message).into_response()
    }
}

impl From<bb_runtime::RuntimeError> for InterpError {
    fn from(err: bb_runtime::RuntimeError) -> Self {
        use bb_runtime::error::ErrorKind;
        let status = match err.kind() {
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::BadRequest | ErrorKind::PathEscape => StatusCode::BAD_REQUEST,
            ErrorKind::Conflict => StatusCode::CONFLICT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        error(status, err.to_string())
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> InterpError {
    InterpError { status, message: message.into() }
}

/// A session kind for an E2B language name.
fn kind_of(language: Option<&str>) -> Result<&'static str, InterpError> {
    match language.map(str::to_ascii_lowercase).as_deref() {
        None | Some("") | Some("python") | Some("python3") => Ok("python"),
        Some("bash") | Some("sh") | Some("shell") => Ok("shell"),
        Some("javascript") | Some("js") | Some("node") => Ok("javascript"),
        Some("typescript") | Some("ts") => Ok("typescript"),
        Some(other) => Err(error(
            StatusCode::BAD_REQUEST,
            format!(
                "language {other:?} is not available here: use \"python\", \"bash\", \"javascript\" or \"typescript\""
            ),
        )),
    }
}

fn language_of(kind: &str) -> &'static str {
    match kind {
        "shell" => "bash",
        "javascript" => "javascript",
        "typescript" => "typescript",
        _ => "python",
    }
}

/// Where contexts start: the default user's home (the sessions themselves run as root).
fn home(e: &E2b, t: &Target) -> String {
    e.rt.sandbox_user(&t.id, crate::envd::DEFAULT_USER).map(|u| u.home).unwrap_or_else(|_| "/root".into())
}

/// Remember where a context (session) of a sandbox started; entries of sandboxes that are gone
/// are dropped on the way.
fn remember_cwd(e: &E2b, t: &Target, session: &str, cwd: String) {
    let mut contexts = e.contexts.lock().expect("contexts lock");
    contexts.retain(|(sandbox, _), _| e.rt.get(sandbox).is_ok_and(|sb| !sb.is_dead()));
    contexts.insert((t.id.clone(), session.to_string()), cwd);
}

/// Where a context started: its own entry, else that of the same session in another sandbox (a
/// fork's children keep their parent's session ids, and its working directory).
fn cwd_of(e: &E2b, t: &Target, session: &str) -> Option<String> {
    let contexts = e.contexts.lock().expect("contexts lock");
    contexts
        .get(&(t.id.clone(), session.to_string()))
        .or_else(|| contexts.iter().find(|((_, s), _)| s == session).map(|(_, cwd)| cwd))
        .cloned()
}

fn context_json(e: &E2b, t: &Target, s: &SessionInfo, fallback_cwd: &str) -> Value {
    let cwd = cwd_of(e, t, &s.id).unwrap_or_else(|| fallback_cwd.into());
    json!({"id": s.id, "language": language_of(&s.kind), "cwd": cwd})
}

#[derive(Deserialize, Default)]
struct NewContext {
    language: Option<String>,
    cwd: Option<String>,
}

async fn create_context(State(e): St, Extension(t): Tgt, body: Bytes) -> Response {
    let req: NewContext = match parse(&body) {
        Ok(r) => r,
        Err(err) => return err.into_response(),
    };
    let kind = match kind_of(req.language.as_deref()) {
        Ok(k) => k,
        Err(err) => return err.into_response(),
    };
    let cwd = req.cwd.filter(|c| !c.is_empty()).unwrap_or_else(|| home(&e, &t));
    let made = e
        .rt
        .create_session(&t.id, CreateSession { kind: Some(kind.into()), cwd: Some(cwd.clone()), env: BTreeMap::new() })
        .await;
    match made {
        Ok(s) => {
            remember_cwd(&e, &t, &s.id, cwd.clone());
            axum::Json(context_json(&e, &t, &s, &cwd)).into_response()
        }
        Err(err) => InterpError::from(err).into_response(),
    }
}

async fn list_contexts(State(e): St, Extension(t): Tgt) -> Response {
    let home = home(&e, &t);
    match e.rt.list_sessions(&t.id).await {
        Ok(list) => {
            let v: Vec<Value> =
                list.sessions.iter().filter(|s| s.alive).map(|s| context_json(&e, &t, s, &home)).collect();
            axum::Json(v).into_response()
        }
        Err(err) => InterpError::from(err).into_response(),
    }
}

async fn remove_context(State(e): St, Extension(t): Tgt, Path(cid): Path<String>) -> Response {
    match e.rt.kill_session(&t.id, &cid).await {
        Ok(()) => {
            e.contexts.lock().expect("contexts lock").remove(&(t.id.clone(), cid));
            StatusCode::NO_CONTENT.into_response()
        }
        Err(err) => InterpError::from(err).into_response(),
    }
}

async fn restart_context(State(e): St, Extension(t): Tgt, Path(cid): Path<String>) -> Response {
    let cwd = cwd_of(&e, &t, &cid).unwrap_or_else(|| home(&e, &t));
    let req = CreateSession { kind: None, cwd: Some(cwd), env: BTreeMap::new() };
    match e.rt.restart_session(&t.id, &cid, req).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => InterpError::from(err).into_response(),
    }
}

fn parse<T: for<'de> Deserialize<'de> + Default>(body: &[u8]) -> Result<T, InterpError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|err| error(StatusCode::BAD_REQUEST, format!("invalid JSON body: {err}")))
}

#[derive(Deserialize, Default)]
struct ExecuteReq {
    #[serde(default)]
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<BTreeMap<String, String>>,
}

/// The session an execution runs in: the context named, or the language's default context
/// (python: the sandbox's default session, the one branchbox's `run_code` uses; bash: its oldest
/// live shell session), made on first use.
async fn session_for(e: &E2b, t: &Target, req: &ExecuteReq) -> Result<SessionInfo, InterpError> {
    if let Some(cid) = &req.context_id {
        let sessions = e.rt.list_sessions(&t.id).await.map_err(InterpError::from)?.sessions;
        return sessions.into_iter().find(|s| &s.id == cid && s.alive).ok_or_else(|| {
            error(StatusCode::NOT_FOUND, format!("context {cid:?} not found: create one with create_code_context()"))
        });
    }
    let kind = kind_of(req.language.as_deref())?;
    if kind == "python" {
        // branchbox's own run_code uses the same session: both SDKs see one python state.
        let s = e.rt.default_session(&t.id, || Some(home(e, t))).await.map_err(InterpError::from)?;
        return Ok(s);
    }
    let sessions = e.rt.list_sessions(&t.id).await.map_err(InterpError::from)?.sessions;
    if let Some(s) = sessions.into_iter().find(|s| s.kind == kind && s.alive) {
        return Ok(s);
    }
    let cwd = home(e, t);
    let s = e
        .rt
        .create_session(&t.id, CreateSession { kind: Some(kind.into()), cwd: Some(cwd.clone()), env: BTreeMap::new() })
        .await
        .map_err(InterpError::from)?;
    remember_cwd(e, t, &s.id, cwd);
    Ok(s)
}

fn now_micros() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

/// Output of a run passed on so far.
#[derive(Default)]
struct Sent {
    stdout: String,
    stderr: String,
}

impl Sent {
    /// The NDJSON line of a piece of output, noted as sent.
    fn line(&mut self, o: RunOutput) -> Value {
        let (kind, text, seen) = match o {
            RunOutput::Stdout(t) => ("stdout", t, &mut self.stdout),
            RunOutput::Stderr(t) => ("stderr", t, &mut self.stderr),
        };
        seen.push_str(&text);
        json!({"type": kind, "text": text, "timestamp": now_micros()})
    }
}

/// What of a run's whole `output` was not passed on yet (`sent`). Should the two disagree
/// (bytes the server decoded otherwise), nothing more: output is never repeated.
fn unsent(output: &str, sent: &str) -> String {
    output.strip_prefix(sent).unwrap_or_default().to_string()
}

fn ndjson(lines: &[Value]) -> Bytes {
    let mut b = Vec::new();
    for line in lines {
        serde_json::to_writer(&mut b, line).expect("JSON values serialize");
        b.push(b'\n');
    }
    Bytes::from(b)
}

/// The NDJSON lines of a finished run.
fn lines(r: &SessionResult) -> Vec<Value> {
    let ts = now_micros();
    let mut out = Vec::new();
    if !r.stdout.is_empty() {
        out.push(json!({"type": "stdout", "text": r.stdout, "timestamp": ts}));
    }
    if !r.stderr.is_empty() {
        out.push(json!({"type": "stderr", "text": r.stderr, "timestamp": ts}));
    }
    let mut main_seen = false;
    for d in &r.displays {
        let mut line = d.clone();
        if let Some(obj) = line.as_object_mut() {
            obj.insert("type".into(), json!("result"));
            let main = obj.get("is_main_result").and_then(Value::as_bool).unwrap_or(false);
            obj.insert("is_main_result".into(), json!(main));
            if main {
                main_seen = true;
                if let Some(text) = &r.result {
                    obj.entry("text").or_insert(json!(text));
                }
            }
        }
        out.push(line);
    }
    if let (false, Some(text)) = (main_seen, &r.result) {
        out.push(json!({"type": "result", "text": text, "is_main_result": true}));
    }
    if let Some(err) = &r.error {
        let get = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
        out.push(json!({"type": "error", "name": get("name"), "value": get("value"), "traceback": get("traceback")}));
    }
    if let Some(n) = r.execution_count {
        out.push(json!({"type": "number_of_executions", "execution_count": n}));
    }
    out.push(json!({"type": "end_of_execution"}));
    out
}

async fn execute(State(e): St, Extension(t): Tgt, body: Bytes) -> Response {
    let req: ExecuteReq = match parse(&body) {
        Ok(r) => r,
        Err(err) => return err.into_response(),
    };
    if req.context_id.is_some() && req.language.is_some() {
        return error(StatusCode::BAD_REQUEST, "give context_id or language, not both").into_response();
    }
    if let Some(env) = &req.env_vars {
        if let Err(err) = bb_runtime::sandbox::sessions::check_run_env(env) {
            return InterpError::from(err).into_response();
        }
    }
    let session = match session_for(&e, &t, &req).await {
        Ok(s) => s,
        Err(err) => return err.into_response(),
    };
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    let (rt, id) = (e.rt.clone(), t.id.clone());
    tokio::spawn(async move {
        let env = req.env_vars.unwrap_or_default();
        let (out_tx, mut out_rx) = mpsc::channel::<RunOutput>(64);
        let code = RunCode { code: req.code, timeout: Some(0.0), language: None, env };
        let run = rt.run_session_tailed(&id, &session.id, code, out_tx);
        tokio::pin!(run);
        let mut sent = Sent::default();
        let result = loop {
            tokio::select! {
                r = &mut run => break r,
                Some(o) = out_rx.recv() => {
                    // Output as it is written, one line per piece.
                    let _ = tx.send(Ok(ndjson(&[sent.line(o)]))).await;
                }
                _ = tx.closed() => {
                    // The client went away: interrupt the code, and let the run end (its answer
                    // must still be read off the session's channel).
                    let _ = rt.kill_process(&id, session.pid, Some(libc::SIGINT)).await;
                    let _ = run.await;
                    return;
                }
            }
        };
        let mut last = Vec::new();
        while let Ok(o) = out_rx.try_recv() {
            last.push(sent.line(o));
        }
        match result {
            Ok(mut r) => {
                // The answer holds all the output: what was not passed on yet goes with it.
                r.stdout = unsent(&r.stdout, &sent.stdout);
                r.stderr = unsent(&r.stderr, &sent.stderr);
                last.extend(lines(&r));
                let _ = tx.send(Ok(ndjson(&last))).await;
            }
            Err(err) => {
                // The sandbox or the session went away mid-run: break the stream.
                if !last.is_empty() {
                    let _ = tx.send(Ok(ndjson(&last))).await;
                }
                let _ = tx.send(Err(std::io::Error::other(err.to_string()))).await;
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(stream))
        .expect("valid response")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_passed_on_during_a_run_is_not_repeated_at_its_end() {
        let mut sent = Sent::default();
        let a = sent.line(RunOutput::Stdout("a\n".into()));
        assert_eq!((a["type"].as_str(), a["text"].as_str()), (Some("stdout"), Some("a\n")));
        sent.line(RunOutput::Stderr("warn\n".into()));
        sent.line(RunOutput::Stdout("b".into()));
        assert_eq!(unsent("a\nb\nc\n", &sent.stdout), "\nc\n");
        assert_eq!(unsent("warn\n", &sent.stderr), "");
        // The whole answer disagrees with what was sent: nothing more, nothing twice.
        assert_eq!(unsent("x\n", &sent.stdout), "");
        assert_eq!(unsent("anything", ""), "anything");
    }

    #[test]
    fn a_run_becomes_the_lines_the_sdk_parses() {
        let r = SessionResult {
            stdout: "hi\n".into(),
            result: Some("2".into()),
            displays: vec![
                json!({"text": "<Figure>", "png": "iVBO"}),
                json!({"html": "<b>2</b>", "is_main_result": true}),
            ],
            error: Some(json!({"name": "ValueError", "value": "bad", "traceback": "Traceback..."})),
            execution_count: Some(3),
            ..Default::default()
        };
        let l = lines(&r);
        let types: Vec<&str> = l.iter().map(|v| v["type"].as_str().unwrap()).collect();
        assert_eq!(types, ["stdout", "result", "result", "error", "number_of_executions", "end_of_execution"]);
        assert_eq!(l[1]["is_main_result"], false);
        assert_eq!(
            (&l[2]["is_main_result"], &l[2]["text"], &l[2]["html"]),
            (&json!(true), &json!("2"), &json!("<b>2</b>"))
        );
        let plain = lines(&SessionResult { result: Some("7".into()), ..Default::default() });
        assert_eq!(
            (&plain[0]["type"], &plain[0]["text"], &plain[0]["is_main_result"]),
            (&json!("result"), &json!("7"), &json!(true))
        );
        assert_eq!(l[3]["name"], "ValueError");
        assert_eq!(l[4]["execution_count"], 3);
        assert!(kind_of(Some("R")).is_err());
        assert_eq!(kind_of(Some("Bash")).ok(), Some("shell"));
        assert_eq!(kind_of(None).ok(), Some("python"));
        assert_eq!(kind_of(Some("ts")).ok(), Some("typescript"));
        assert_eq!(language_of(kind_of(Some("TypeScript")).unwrap()), "typescript");
    }
}
