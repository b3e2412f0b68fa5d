//! HTTP/JSON API of `branchboxd`.
//!
//! Handlers only parse a request into a call on [`bb_runtime::Runtime`] and render the result;
//! every mechanism lives in the runtime. Errors are `{"error": {"code", "message"}}` with a stable
//! code ([`error::ApiError`]). The OpenAPI document is generated from the handlers' annotations
//! ([`ApiDoc`]), checked in as `openapi.json` and served at `/openapi.json`.

pub mod error;
mod extract;
mod handlers;
mod keepalive;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use bb_runtime::Runtime;
use std::sync::Arc;
use utoipa::OpenApi;

pub use handlers::ApiDoc;

/// Largest JSON request body.
pub const MAX_JSON_BODY: usize = 16 << 20;

pub type AppState = Arc<Runtime>;

/// The API router. With `token`, every request must carry `Authorization: Bearer <token>`.
pub fn router(rt: Arc<Runtime>, token: Option<String>) -> Router {
    use handlers::*;
    let files = Router::new()
        .route("/v1/sandboxes/:id/files", get(read_file).put(write_file).delete(remove_file))
        .route("/v1/volumes/:vid/files", get(volume_read_file).put(volume_write_file).delete(volume_remove_file))
        .layer(DefaultBodyLimit::disable());
    let r = Router::new()
        .route("/openapi.json", get(openapi))
        .route("/v1/health", get(health))
        .route("/v1/sandboxes", post(create_sandbox).get(list_sandboxes))
        .route("/v1/sandboxes/:id", get(get_sandbox).delete(kill_sandbox))
        .route("/v1/sandboxes/:id/timeout", post(set_timeout))
        .route("/v1/sandboxes/:id/pause", post(pause_sandbox))
        .route("/v1/sandboxes/:id/resume", post(resume_sandbox))
        .route("/v1/sandboxes/:id/commands", post(run_command).get(list_processes))
        .route("/v1/sandboxes/:id/commands/stream", post(stream_command))
        .route("/v1/sandboxes/:id/commands/:pid/wait", post(wait_process))
        .route("/v1/sandboxes/:id/commands/:pid/kill", post(kill_process))
        .route("/v1/sandboxes/:id/sessions", post(create_session).get(list_sessions))
        .route("/v1/sandboxes/:id/sessions/:sid", axum::routing::delete(kill_session))
        .route("/v1/sandboxes/:id/sessions/:sid/run", post(run_session))
        .route("/v1/sandboxes/:id/code", post(run_code))
        .route("/v1/sandboxes/:id/files/list", get(list_files))
        .route("/v1/sandboxes/:id/files/stat", get(stat_file))
        .route("/v1/sandboxes/:id/files/mkdir", post(make_dir))
        .route("/v1/sandboxes/:id/files/rename", post(rename_file))
        .route("/v1/sandboxes/:id/checkpoint", post(checkpoint))
        .route("/v1/sandboxes/:id/rollback", post(rollback))
        .route("/v1/sandboxes/:id/fork", post(fork))
        .route("/v1/sandboxes/:id/evaluate", post(evaluate))
        .route("/v1/sandboxes/:id/snapshots", get(sandbox_snapshots))
        .route("/v1/sandboxes/:id/network", get(get_network).put(update_network))
        .route("/v1/sandboxes/:id/ports", get(list_ports))
        .route("/v1/sandboxes/:id/ports/:port", get(open_port).delete(close_port))
        .route("/v1/snapshots", get(list_snapshots))
        .route("/v1/snapshots/gc", post(gc_snapshots))
        .route("/v1/snapshots/:sid", get(get_snapshot).delete(delete_snapshot))
        .route("/v1/snapshots/:sid/offload", post(offload_snapshot))
        .route("/v1/snapshots/:sid/push", post(push_snapshot))
        .route("/v1/snapshots/:sid/pull", post(pull_snapshot))
        .route("/v1/remote/snapshots", get(list_remote_snapshots))
        .route("/v1/remote/snapshots/:sid", axum::routing::delete(delete_remote_snapshot))
        .route("/v1/remote/gc", post(store_gc))
        .route("/v1/volumes", post(create_volume).get(list_volumes))
        .route("/v1/volumes/:vid", get(get_volume).delete(delete_volume))
        .route("/v1/volumes/:vid/snapshots", post(snapshot_volume).get(list_volume_snapshots))
        .route("/v1/volumes/:vid/snapshots/:vsid", axum::routing::delete(delete_volume_snapshot))
        .route("/v1/volumes/:vid/restore", post(restore_volume))
        .route("/v1/volumes/:vid/fork", post(fork_volume))
        .route("/v1/volumes/:vid/sync", post(sync_volume))
        .route("/v1/volumes/:vid/files/list", get(volume_list_files))
        .route("/v1/volumes/:vid/files/stat", get(volume_stat_file))
        .route("/v1/volumes/:vid/files/mkdir", post(volume_make_dir))
        .route("/v1/volumes/:vid/files/rename", post(volume_rename_file))
        .route("/v1/templates", post(build_template).get(list_templates))
        .route("/v1/templates/:name", get(get_template).delete(remove_template))
        .route("/v1/pool", get(get_pool))
        .route("/v1/pool/:image", axum::routing::put(set_pool))
        .route("/v1/images", get(list_images))
        .route("/v1/images/build", post(build_image))
        .route("/v1/images/import", post(import_image))
        .route("/v1/images/:name", axum::routing::delete(remove_image))
        .layer(DefaultBodyLimit::max(MAX_JSON_BODY))
        .merge(files)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(rt);
    let r = match token {
        Some(t) => r.layer(axum::middleware::from_fn(move |h: HeaderMap, req, next: Next| {
            let t = t.clone();
            async move { check_token(&t, &h, req, next).await }
        })),
        None => r,
    };
    let r = r.layer(axum::middleware::from_fn(keepalive::close_if_body_unread));
    // Sandbox ids are also taken in their dashless form (the one the E2B endpoint shows): the
    // path is rewritten before routing, so every handler sees the runtime's own id.
    Router::new().fallback_service(tower::ServiceBuilder::new().map_request(canonical_sandbox_path).service(r))
}

/// `/v1/sandboxes/sb0123456789ab/...` → `/v1/sandboxes/sb-0123456789ab/...`.
fn canonical_sandbox_path(mut req: axum::extract::Request) -> axum::extract::Request {
    let uri = req.uri();
    let Some(rest) = uri.path().strip_prefix("/v1/sandboxes/") else { return req };
    let (id, tail) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let canon = bb_runtime::sandbox::lifecycle::canonical_id(id);
    if canon == id {
        return req;
    }
    let query = uri.query().map(|q| format!("?{q}")).unwrap_or_default();
    if let Ok(u) = format!("/v1/sandboxes/{canon}{tail}{query}").parse() {
        *req.uri_mut() = u;
    }
    req
}

/// `r` with the Host-header form of sandbox ports in front of it: a request to
/// `{port}-{sandbox}.{domain}` goes to that port of that sandbox (before any token check).
pub fn with_port_hosts(r: Router, rt: Arc<Runtime>, domain: &str) -> Router {
    let domain: Arc<str> = domain.trim_matches('.').into();
    r.layer(axum::middleware::from_fn(move |req: axum::extract::Request, next: Next| {
        let (rt, domain) = (rt.clone(), domain.clone());
        async move {
            // HTTP/1.1's Host, or HTTP/2's :authority.
            let host = req.headers().get(axum::http::header::HOST).and_then(|v| v.to_str().ok());
            let host = host.or_else(|| req.uri().authority().map(|a| a.as_str()));
            let Some((id, port)) = host.and_then(|h| bb_runtime::net::ports::port_host(h, &domain)) else {
                return next.run(req).await;
            };
            match rt.forward_to_port(&id, port, req).await {
                Ok(resp) => resp.map(axum::body::Body::new),
                Err(e) => axum::response::IntoResponse::into_response(error::ApiError::from(e)),
            }
        }
    }))
}

async fn check_token(token: &str, headers: &HeaderMap, req: axum::extract::Request, next: Next) -> Response {
    let given = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Constant-time comparison: no early exit on the first differing byte.
    let ok = given.is_some_and(|g| {
        g.len() == token.len() && g.bytes().zip(token.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    });
    if ok {
        next.run(req).await
    } else {
        axum::response::IntoResponse::into_response(error::ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token: send `Authorization: Bearer <token>` (set BRANCHBOX_TOKEN)",
        ))
    }
}

async fn not_found(uri: axum::http::Uri) -> error::ApiError {
    error::ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no route {}: see /openapi.json", uri.path()))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> error::ApiError {
    error::ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not allowed on {}: see /openapi.json", uri.path()),
    )
}

async fn openapi() -> axum::Json<utoipa::openapi::OpenApi> {
    axum::Json(ApiDoc::openapi())
}

/// The OpenAPI document as pretty JSON (what is checked in as `openapi.json`).
pub fn openapi_json() -> String {
    ApiDoc::openapi().to_pretty_json().expect("openapi serializes") + "\n"
}

#[cfg(test)]
mod tests {
    #[test]
    fn checked_in_openapi_matches_the_code() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json");
        let checked_in = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            checked_in == super::openapi_json(),
            "crates/bb-api/openapi.json is stale: run `make openapi` and commit it"
        );
    }
}
