//! An E2B-compatible endpoint: the official `e2b` and `e2b-code-interpreter` SDKs run against
//! branchboxd unchanged. One TCP listener serves both of E2B's planes: the control plane (E2B's
//! REST API, [`control`], `X-API-KEY` = the daemon's token) and each sandbox's data plane (what
//! envd answers inside an E2B sandbox, [`envd`], served from the host side). A request is for a
//! sandbox when it carries `E2b-Sandbox-Id` (and `E2b-Sandbox-Port`, default envd's 49983) or a
//! Host of the form `{port}-{sandboxID}.{domain}`; another port than envd's reaches that port of
//! the sandbox (as `GET /v1/sandboxes/{id}/ports/{port}` does).

pub mod connect;
pub mod control;
pub mod envd;
pub mod error;
pub mod interp;
pub mod procs;
pub mod volumes;
pub mod watch;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::Router;
use bb_runtime::sandbox::lifecycle::canonical_id;
use bb_runtime::Runtime;
use sha2::Digest;
use std::sync::Arc;
use tower::ServiceExt;

pub struct E2bConfig {
    /// What clients send as `X-API-KEY` (the daemon's token).
    pub api_key: String,
    /// Answered as each sandbox's `domain`: hosts `{port}-{sandboxID}.{domain}` reach its ports.
    pub domain: String,
}

/// The endpoint's state.
pub struct E2b {
    pub rt: Arc<Runtime>,
    pub cfg: E2bConfig,
    pub procs: Arc<procs::Procs>,
    /// Working directories of code contexts (sessions), by sandbox and session id.
    pub contexts: std::sync::Mutex<std::collections::HashMap<(String, String), String>>,
    /// Polled directory watchers (`CreateWatcher`).
    pub watchers: watch::Watchers,
}

/// A sandbox's `envdAccessToken`: derived from the API key and its id, so any holder of the key
/// can tell it, nobody else can, and it outlives a daemon restart.
pub fn access_token(api_key: &str, id: &str) -> String {
    derived_token(b"branchbox-e2b-envd", api_key, &canonical_id(id))
}

/// A token for `purpose` and the object `id`: sha256 of both and the API key (hex, 160 bits).
pub(crate) fn derived_token(purpose: &[u8], api_key: &str, id: &str) -> String {
    let mut h = sha2::Sha256::new();
    h.update(purpose);
    h.update(b"\0");
    h.update(api_key.as_bytes());
    h.update(b"\0");
    h.update(id.as_bytes());
    hex::encode(&h.finalize()[..20])
}

/// Whether `key` has the form some E2B SDKs require of an API key (`e2b_` and hex digits).
pub fn key_looks_like_e2bs(key: &str) -> bool {
    key.strip_prefix("e2b_")
        .is_some_and(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

/// Constant-time equality (no early exit on the first differing byte).
pub(crate) fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn control_router(e: Arc<E2b>) -> Router {
    use control::{
        alias, connect, create, delete_template, fork, get_sandbox, kill, list_snapshots, list_v1, list_v2, metrics,
        pause, resume, rollback, set_timeout, snapshot, update_network,
    };
    Router::new()
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/:id", get(get_sandbox).delete(kill))
        .route("/sandboxes/:id/timeout", post(set_timeout))
        .route("/sandboxes/:id/network", put(update_network))
        .route("/sandboxes/:id/connect", post(connect))
        .route("/v2/sandboxes/:id/connect", post(connect))
        .route("/sandboxes/:id/pause", post(pause))
        .route("/sandboxes/:id/resume", post(resume))
        .route("/sandboxes/:id/fork", post(fork))
        .route("/sandboxes/:id/rollback", post(rollback))
        .route("/sandboxes/:id/snapshots", post(snapshot))
        .route("/sandboxes/:id/metrics", get(metrics))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/:id", delete(delete_template))
        .route("/templates/aliases/:alias", get(alias))
        .route("/volumes", post(volumes::create).get(volumes::list))
        .route("/volumes/:vid", get(volumes::get_one).delete(volumes::delete))
        .fallback(|uri: axum::http::Uri| async move {
            error::E2bError::not_found(format!("no route {} on branchbox's E2B endpoint", uri.path()))
        })
        .with_state(e)
}

/// The endpoint: one router for both planes.
pub fn router(rt: Arc<Runtime>, cfg: E2bConfig) -> Router {
    let procs = Arc::new(procs::Procs::default());
    // Commands started here that a checkpoint kept come back with its restores.
    let adopter = procs.clone();
    rt.on_attached_restored(Arc::new(move |sandbox, note, attached| adopter.adopt_restored(sandbox, note, attached)));
    let e = Arc::new(E2b { rt, cfg, procs, contexts: Default::default(), watchers: Default::default() });
    let planes = Planes {
        control: control_router(e.clone()),
        volumes: volumes::content_router(e.clone()),
        envd: envd::router(e.clone()),
        interp: interp::router(e.clone()),
    };
    Router::new().fallback(move |req: Request| {
        let (e, planes) = (e.clone(), planes.clone());
        async move { dispatch(e, planes, req).await }
    })
}

/// The sandbox and port a request is for, if it is for one.
fn target_of(e: &E2b, req: &Request) -> Option<(String, u16)> {
    let h = req.headers();
    if let Some(id) = h.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) {
        let port = h.get("e2b-sandbox-port").and_then(|v| v.to_str().ok()).and_then(|p| p.parse().ok());
        return Some((id.to_string(), port.unwrap_or(envd::ENVD_PORT)));
    }
    let host = h.get(axum::http::header::HOST).and_then(|v| v.to_str().ok());
    let host = host.or_else(|| req.uri().authority().map(|a| a.as_str()))?;
    bb_runtime::net::ports::port_host(host, &e.cfg.domain)
}

/// What E2B's edge answers for a sandbox it cannot reach (the SDK reads "was not found").
fn sandbox_gone(id: &str) -> Response {
    let body = serde_json::json!({
        "sandboxId": id,
        "message": format!("The sandbox {id} was not found"),
        "code": 502,
    });
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}

/// Largest control-plane request body.
const MAX_CONTROL_BODY: usize = 1 << 20;
/// What is read of a request's body before an early answer (so the connection stays usable).
const DRAIN_LIMIT: usize = 1 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// Read (and drop) what a client sends before answering it early: an answer given while the body
/// is unread makes hyper close the connection under a client that may reuse it.
pub(crate) async fn drain(req: Request) {
    drain_body(req.into_body()).await
}

/// [`drain`] a request's body.
pub(crate) async fn drain_body(body: Body) {
    let body = http_body_util::Limited::new(body, DRAIN_LIMIT);
    let _ = tokio::time::timeout(DRAIN_TIME, http_body_util::BodyExt::collect(body)).await;
}

/// The routers a request may go to.
#[derive(Clone)]
struct Planes {
    control: Router,
    /// E2B's volume content API (a bearer token per volume; bodies streamed).
    volumes: Router,
    envd: Router,
    interp: Router,
}

async fn dispatch(e: Arc<E2b>, planes: Planes, mut req: Request) -> Response {
    // A signed `/files` URL may come without the sandbox's header (`E2B_SANDBOX_URL`): the
    // signature names the sandbox (it is made with that sandbox's access token).
    let target = target_of(&e, &req).or_else(|| {
        let q = signed_query(&req)?;
        let id = e.rt.live_ids().into_iter().find(|id| signature_matches(&e, id, &req, &q))?;
        Some((id, envd::ENVD_PORT))
    });
    let Some((id, port)) = target else {
        if signed_query(&req).is_some() {
            drain(req).await;
            return signature_refused(
                "the signature matches no sandbox: ask the SDK for a new download_url/upload_url",
            );
        }
        if req.uri().path().starts_with("/volumecontent/") {
            return into_response(planes.volumes.oneshot(req).await);
        }
        // Control-plane bodies are small JSON: read whole first, so every answer (errors too)
        // comes after the body.
        let (parts, body) = req.into_parts();
        let body = match http_body_util::BodyExt::collect(http_body_util::Limited::new(body, MAX_CONTROL_BODY)).await {
            Ok(b) => b.to_bytes(),
            Err(err) => {
                return error::E2bError::bad_request(format!(
                    "request body unreadable or over {MAX_CONTROL_BODY} bytes: {err}"
                ))
                .into_response()
            }
        };
        if !control::authorized(&e, &parts.headers) {
            return error::E2bError::Status(
                StatusCode::UNAUTHORIZED,
                "missing or wrong X-API-KEY: set E2B_API_KEY to the daemon's token".into(),
            )
            .into_response();
        }
        return into_response(planes.control.oneshot(Request::from_parts(parts, Body::from(body))).await);
    };
    let cid = canonical_id(&id).into_owned();
    // Unknown, dead, and paused sandboxes (unless they wake on use) answer as E2B's edge does.
    // (A state check, not `info()`: that reads the cgroup's counters, on every request.)
    let insecure = match e.rt.get(&cid) {
        Ok(sb) if !sb.is_dead() && (!sb.is_paused() || sb.spec.lifecycle.auto_resume) => {
            sb.spec.metadata.contains_key(control::INSECURE_KEY)
        }
        _ => {
            drain(req).await;
            return sandbox_gone(&id);
        }
    };
    if port == interp::JUPYTER_PORT {
        // The SDK sends the access token with code to run, not with context requests.
        if req.uri().path() == "/execute" && !insecure && !token_ok(&e, &cid, &req) {
            drain(req).await;
            return (StatusCode::UNAUTHORIZED, "missing or wrong X-Access-Token").into_response();
        }
        req.extensions_mut().insert(envd::Target { id: cid });
        return into_response(planes.interp.oneshot(req).await);
    }
    if port != envd::ENVD_PORT {
        return match e.rt.forward_to_port(&cid, port, req).await {
            Ok(resp) => resp.map(Body::new),
            Err(err) => {
                let body = serde_json::json!({"sandboxId": id, "message": format!("The sandbox is running but port is not open: {err}"), "code": 502, "port": port});
                (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
            }
        };
    }
    // The access token lets anything in; a signed URL (no token) its signature and expiry; a
    // sandbox created with `secure: false` needs neither.
    if !insecure && !token_ok(&e, &cid, &req) && req.uri().path() != "/health" {
        let refused = match signed_query(&req) {
            Some(q) if !signature_matches(&e, &cid, &req, &q) => {
                Some(signature_refused("invalid signature: ask the SDK for a new download_url/upload_url"))
            }
            Some(q) if q.signature_expiration.is_some_and(|t| t < now_secs()) => {
                Some(signature_refused("the signature has expired: ask the SDK for a new download_url/upload_url"))
            }
            Some(_) => None,
            None => Some(envd_unauthorized(&req)),
        };
        if let Some(answer) = refused {
            drain(req).await;
            return answer;
        }
    }
    req.extensions_mut().insert(envd::Target { id: cid });
    into_response(planes.envd.oneshot(req).await)
}

fn into_response(r: Result<Response, std::convert::Infallible>) -> Response {
    match r {
        Ok(resp) => resp,
        Err(never) => match never {},
    }
}

fn token_ok(e: &E2b, id: &str, req: &Request) -> bool {
    let given = req.headers().get("x-access-token").and_then(|v| v.to_str().ok()).unwrap_or("");
    same(given, &access_token(&e.cfg.api_key, id))
}

/// The query of a signed `/files` URL.
#[derive(serde::Deserialize)]
struct SignedQuery {
    #[serde(default)]
    path: String,
    #[serde(default)]
    username: String,
    signature: String,
    signature_expiration: Option<i64>,
}

fn signed_query(req: &Request) -> Option<SignedQuery> {
    if req.uri().path() != "/files" {
        return None;
    }
    axum::extract::Query::<SignedQuery>::try_from_uri(req.uri()).ok().map(|q| q.0)
}

/// The SDK's signature of a `/files` URL (`get_signature`): `v1_` and the unpadded base64 of
/// sha256(`path:operation:username:token[:expiration]`), `operation` being read or write.
pub fn file_signature(path: &str, write: bool, username: &str, token: &str, expiration: Option<i64>) -> String {
    use base64::Engine;
    let op = if write { "write" } else { "read" };
    let raw = match expiration {
        Some(t) => format!("{path}:{op}:{username}:{token}:{t}"),
        None => format!("{path}:{op}:{username}:{token}"),
    };
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!("v1_{}", base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest))
}

fn signature_matches(e: &E2b, id: &str, req: &Request, q: &SignedQuery) -> bool {
    let write = req.method() == axum::http::Method::POST;
    let token = access_token(&e.cfg.api_key, id);
    same(&q.signature, &file_signature(&q.path, write, &q.username, &token, q.signature_expiration))
}

fn now_secs() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

fn signature_refused(why: &str) -> Response {
    (StatusCode::UNAUTHORIZED, axum::Json(serde_json::json!({"code": 401, "message": why}))).into_response()
}

fn envd_unauthorized(req: &Request) -> Response {
    let msg = "missing or wrong X-Access-Token: use the envdAccessToken the sandbox was created or connected with";
    if req.uri().path().starts_with("/process.") || req.uri().path().starts_with("/filesystem.") {
        let err = connect::RpcError::new(connect::Code::Unauthenticated, msg);
        let streaming = req
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|c| c.starts_with("application/connect+"));
        return if streaming { err.stream() } else { err.unary() };
    }
    (StatusCode::UNAUTHORIZED, axum::Json(serde_json::json!({"code": 401, "message": msg}))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_tokens_depend_on_key_and_sandbox_in_either_id_form() {
        let t = access_token("key", "sb-0123456789ab");
        assert_eq!(t, access_token("key", "sb0123456789ab"));
        assert_ne!(t, access_token("key2", "sb-0123456789ab"));
        assert_ne!(t, access_token("key", "sb-0123456789ac"));
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "ab"));
        assert!(
            key_looks_like_e2bs("e2b_0123abcdef") && !key_looks_like_e2bs("e2b_") && !key_looks_like_e2bs("e2b_XYZ")
        );
        assert!(!key_looks_like_e2bs("bbtest-01"));
    }

    #[test]
    fn file_signatures_are_the_sdks() {
        // Python: "v1_" + base64(sha256(b"/home/user/a.txt:read::tok")).rstrip("=")
        let s = file_signature("/home/user/a.txt", false, "", "tok", None);
        assert_eq!(s, "v1_Zkbb3914oLJLvMBzCAHQhm2ydBLxbSx2eQUR/kLdvIY");
        assert_ne!(s, file_signature("/home/user/a.txt", true, "", "tok", None));
        assert_ne!(s, file_signature("/home/user/a.txt", false, "", "tok", Some(1)));
    }
}
