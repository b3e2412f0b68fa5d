//! E2B's control plane (`api.e2b.app` in their cloud), mapped onto the runtime: sandboxes are
//! created, listed, timed, paused, resumed (by connect), forked and snapshotted by branchbox's own
//! calls. Sandbox ids are shown dashless (`sb0123456789ab`: E2B ids are `[a-z0-9]+`).

use crate::error::{E2bError, E2bResult};
use crate::{access_token, E2b};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bb_runtime::model::{self, CreateSandbox, Lifecycle, OnTimeout, PauseMode, SandboxInfo};
use bb_runtime::sandbox::lifecycle::{canonical_id, dashless_id};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Metadata key holding the template id a sandbox was created from (not shown as metadata).
pub const TEMPLATE_KEY: &str = "branchbox.e2b.template";
/// Metadata key of a sandbox created with `secure: false`: its data plane takes no access token.
pub const INSECURE_KEY: &str = "branchbox.e2b.insecure";
/// What the endpoint answers as `envdVersion`: the envd whose features the data plane serves.
pub const ENVD_VERSION: &str = "0.6.4";
/// Answered as `clientID`.
const CLIENT_ID: &str = "branchbox";
/// Default sandbox lifetime, as E2B's.
const DEFAULT_TIMEOUT: u64 = 300;
/// Largest page of a list.
const MAX_LIMIT: usize = 1000;

type St = State<Arc<E2b>>;

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<u64>,
    auto_pause: Option<bool>,
    /// With `autoPause`: false makes the timeout's pause files-only (a cold boot on resume).
    auto_pause_memory: Option<bool>,
    auto_resume: Option<AutoResume>,
    secure: Option<bool>,
    // The SDK sends this one field in snake case.
    #[serde(alias = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    network: Option<Egress>,
    volume_mounts: Option<Vec<E2bVolumeMount>>,
    mcp: Option<Value>,
    iam: Option<Value>,
}

/// One of create's `volumeMounts`: a volume by name (a branchbox volume's name or id) at a path.
#[derive(Deserialize)]
pub struct E2bVolumeMount {
    name: String,
    path: String,
}

/// E2B's egress settings: `network` of a create, and the body of `PUT /sandboxes/{id}/network`
/// (which sends `allow_internet_access` in it, in snake case).
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct Egress {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    dns_servers: Option<Vec<String>>,
    egress_proxy: Option<Value>,
    rules: Option<BTreeMap<String, Value>>,
    allow_public_traffic: Option<bool>,
    mask_request_host: Option<String>,
    https_ports: Option<Vec<u16>>,
    #[serde(alias = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

/// E2B's name for all of IPv4 (`ALL_TRAFFIC`).
const ALL_TRAFFIC: &str = "0.0.0.0/0";

/// branchbox's network mode and allow entries for E2B's egress settings (`internet`: its
/// `allow_internet_access`). E2B denies nothing unless told; here a sandbox has no network unless
/// `allow_internet_access` is true or `allowOut` names what it may reach. Denying all traffic
/// (`denyOut: [0.0.0.0/0]`, or `allow_internet_access: false`) leaves exactly `allowOut` (E2B's
/// allow entries win over its deny ones): mode `allowlist`, or `none` when it is empty. What
/// cannot be mapped is refused, never dropped: a partial `denyOut`, `egressProxy`, `rules`,
/// `maskRequestHost`, `httpsPorts`, `allowPublicTraffic: false`.
pub fn egress(internet: Option<bool>, n: &Egress) -> E2bResult<(String, Vec<String>)> {
    let unsupported = |what: &str, instead: &str| {
        Err(E2bError::bad_request(format!("network.{what} is not supported by this endpoint: {instead}")))
    };
    if n.egress_proxy.as_ref().is_some_and(|p| !p.is_null()) {
        return unsupported("egressProxy", "leave it out (branchbox's daemon proxy: Sandbox.create(proxy=True))");
    }
    if n.rules.as_ref().is_some_and(|r| !r.is_empty()) {
        return unsupported(
            "rules",
            "leave them out (the daemon's proxy adds credentials to requests: branchboxd --proxy-credentials)",
        );
    }
    if n.mask_request_host.is_some() {
        return unsupported("maskRequestHost", "leave it out");
    }
    if n.https_ports.as_ref().is_some_and(|p| !p.is_empty()) {
        return unsupported("httpsPorts", "leave it out (ports are reached as plain HTTP)");
    }
    if n.allow_public_traffic == Some(false) {
        return unsupported(
            "allowPublicTraffic: false",
            "ports here take no traffic token (whoever reaches the endpoint reaches them): leave it out",
        );
    }
    let deny = n.deny_out.as_deref().unwrap_or_default();
    if let Some(d) = deny.iter().find(|d| d.as_str() != ALL_TRAFFIC) {
        return Err(E2bError::bad_request(format!(
            "network.denyOut {d:?}: only {ALL_TRAFFIC:?} (all traffic) can be denied here; deny all and list \
             what may be reached in allowOut"
        )));
    }
    let deny_all = internet == Some(false) || !deny.is_empty();
    let mut allow: Vec<String> = n.allow_out.clone().unwrap_or_default();
    let everything = allow.iter().any(|a| a == ALL_TRAFFIC);
    allow.retain(|a| a != ALL_TRAFFIC);
    if !allow.is_empty() {
        // E2B lets all traffic to its DNS servers through when allowOut is given.
        allow.extend(n.dns_servers.iter().flatten().cloned());
    }
    let mode = if everything || (!deny_all && internet == Some(true)) {
        "open"
    } else if allow.is_empty() {
        "none"
    } else {
        "allowlist"
    };
    Ok((mode.into(), allow))
}

#[derive(Deserialize, Default)]
pub struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

/// What a template id names, in the order looked up: a snapshot, a branchbox template, an image.
enum Source {
    Snapshot(String),
    Template(String),
    Image(String),
}

/// E2B's base template: the `base` image.
const BASE_TEMPLATE: &str = "base";
/// The code interpreter SDK's default template: the branchbox template of that name once built
/// (templates/code-interpreter-v1.toml), the `base` image until then.
const CODE_INTERPRETER_TEMPLATE: &str = "code-interpreter-v1";

fn resolve_template(e: &E2b, id: &str) -> Source {
    let id = untagged(id);
    if id == BASE_TEMPLATE {
        return Source::Image("base".into()); // the common case, without a lookup
    }
    if id == CODE_INTERPRETER_TEMPLATE {
        return match e.rt.template(id) {
            Ok(_) => Source::Template(id.into()),
            Err(_) => Source::Image("base".into()),
        };
    }
    if e.rt.snapshot(id).is_ok() {
        return Source::Snapshot(id.into());
    }
    // A snapshot's name (`create_snapshot(name=...)`): its newest snapshot, as E2B's newest build.
    if let Some(newest) = e.rt.snapshots_labelled(id).ok().and_then(|ids| ids.last().cloned()) {
        Source::Snapshot(newest)
    } else if e.rt.template(id).is_ok() {
        Source::Template(id.into())
    } else {
        Source::Image(id.into())
    }
}

/// Parse a JSON body (an empty one is `{}`), E2B-shaped errors.
pub(crate) fn body<T: for<'de> Deserialize<'de> + Default>(bytes: &[u8]) -> E2bResult<T> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(bytes).map_err(|err| E2bError::bad_request(format!("invalid JSON body: {err}")))
}

pub async fn create(State(e): St, bytes: axum::body::Bytes) -> E2bResult<Response> {
    let req: NewSandbox = body(&bytes)?;
    let template = req.template_id.clone().unwrap_or_else(|| "base".into());
    if template.is_empty() {
        return Err(E2bError::bad_request("templateID is empty: give a template (e.g. \"base\")"));
    }
    let mut metadata = req.metadata.unwrap_or_default();
    if metadata.keys().any(|k| k.starts_with("branchbox.")) {
        return Err(E2bError::bad_request("metadata keys starting with \"branchbox.\" are reserved: rename them"));
    }
    metadata.insert(TEMPLATE_KEY.into(), template.clone());
    let secure = req.secure.unwrap_or(true);
    if !secure {
        metadata.insert(INSECURE_KEY.into(), "true".into());
    }
    let on_timeout = if req.auto_pause.unwrap_or(false) { OnTimeout::Pause } else { OnTimeout::Kill };
    let auto_resume = req.auto_resume.is_some_and(|a| a.enabled);
    if auto_resume && on_timeout != OnTimeout::Pause {
        return Err(E2bError::bad_request(
            "autoResume needs autoPause: a sandbox only resumes if its timeout paused it",
        ));
    }
    let pause_mode = if req.auto_pause_memory == Some(false) { PauseMode::Filesystem } else { PauseMode::Full };
    if pause_mode == PauseMode::Filesystem && on_timeout != OnTimeout::Pause {
        return Err(E2bError::bad_request("autoPauseMemory only applies with autoPause: true"));
    }
    if pause_mode == PauseMode::Filesystem && auto_resume {
        return Err(E2bError::bad_request(
            "autoResume cannot be combined with a filesystem-only auto-pause (autoPauseMemory: false): resume such \
             a sandbox with connect",
        ));
    }
    if req.mcp.as_ref().is_some_and(|m| !m.is_null()) {
        return Err(E2bError::bad_request("mcp is not supported by this endpoint: leave it out"));
    }
    if req.iam.as_ref().is_some_and(|i| !i.is_null()) {
        return Err(E2bError::bad_request(
            "iam (workload identity tokens) is not supported by this endpoint: leave it out",
        ));
    }
    let (network, allow) = egress(req.allow_internet_access, &req.network.unwrap_or_default())?;
    // E2B volumes by name are branchbox volumes, mounted writable: one made by E2B's
    // `Volume.create` (`rwx`) is shared by every sandbox that mounts it, fork children too; an
    // `rwo` one (`branchbox volume create NAME`) branches with the sandbox (fork children get
    // copy-on-write copies). An `rox` one is mounted read-only (E2B's API has no flag for it).
    let volumes = req
        .volume_mounts
        .unwrap_or_default()
        .into_iter()
        .map(|m| {
            let read_only = e.rt.volume_access(&m.name) == Some(model::Access::Rox);
            model::VolumeMount { volume: m.name, path: m.path, read_only, branch: true }
        })
        .collect();
    let mut spec = CreateSandbox {
        env: req.env_vars.unwrap_or_default(),
        timeout: Some(req.timeout.unwrap_or(DEFAULT_TIMEOUT) as f64),
        network: Some(network),
        allow,
        volumes,
        metadata,
        lifecycle: Some(Lifecycle { on_timeout, auto_resume, pause_mode }),
        // E2B's `user` has passwordless sudo (the image's /etc/sudoers.d/user says so).
        sudo: Some(true),
        ..Default::default()
    };
    match resolve_template(&e, &template) {
        Source::Snapshot(s) => spec.snapshot = Some(s),
        Source::Template(t) => spec.template = Some(t),
        Source::Image(image) => {
            if e.rt.images().get(&image).is_err() {
                return Err(E2bError::not_found(format!(
                    "template {template:?} not found: use \"base\", an image, a branchbox template or a snapshot id"
                )));
            }
            spec.image = Some(image);
        }
    }
    let info = e.rt.create(spec).await?;
    Ok((StatusCode::CREATED, Json(created(&e, &info))).into_response())
}

/// The `Sandbox` record of create, connect and fork (its `envdAccessToken` unless it was created
/// with `secure: false`).
fn created(e: &E2b, info: &SandboxInfo) -> Value {
    let secure = !info.metadata.contains_key(INSECURE_KEY);
    let mut v = json!({
        "templateID": template_of(info),
        "sandboxID": dashless_id(&info.id),
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "domain": e.cfg.domain,
    });
    if secure {
        v["envdAccessToken"] = json!(access_token(&e.cfg.api_key, &info.id));
    }
    v
}

fn template_of(info: &SandboxInfo) -> String {
    info.metadata.get(TEMPLATE_KEY).cloned().unwrap_or_else(|| info.image.clone())
}

/// The user's metadata (keys the runtime or this endpoint keep are left out).
fn user_metadata(info: &SandboxInfo) -> BTreeMap<String, String> {
    info.metadata.iter().filter(|(k, _)| !k.starts_with("branchbox.")).map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn rfc3339(secs: f64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs_f64(secs.max(0.0));
    humantime::format_rfc3339_millis(t).to_string()
}

fn state_of(info: &SandboxInfo) -> &'static str {
    if info.state == "paused" {
        "paused"
    } else {
        "running"
    }
}

/// `ListedSandbox`, and with `detail` the rest of `SandboxDetail`.
fn listed(e: &E2b, info: &SandboxInfo, detail: bool) -> Value {
    let end = info.expires_at.unwrap_or(info.created_at + 100.0 * 365.0 * 86400.0);
    let mut v = json!({
        "templateID": template_of(info),
        "sandboxID": dashless_id(&info.id),
        "clientID": CLIENT_ID,
        "startedAt": rfc3339(info.created_at),
        "endAt": rfc3339(end),
        "cpuCount": info.cpu.ceil().max(1.0) as u64,
        "memoryMB": info.memory_mb,
        "diskSizeMB": 0,
        "state": state_of(info),
        "envdVersion": ENVD_VERSION,
        "metadata": user_metadata(info),
    });
    if detail {
        v["domain"] = json!(e.cfg.domain);
        if !info.metadata.contains_key(INSECURE_KEY) {
            v["envdAccessToken"] = json!(access_token(&e.cfg.api_key, &info.id));
        }
        v["allowInternetAccess"] = json!(info.network != "none");
        v["lifecycle"] = json!({
            "onTimeout": if info.lifecycle.on_timeout == OnTimeout::Pause { "pause" } else { "kill" },
            "autoResume": info.lifecycle.auto_resume,
        });
    }
    v
}

/// A sandbox the E2B endpoint may show: not the pool's, a template's hidden one, or dead.
fn visible(info: &SandboxInfo) -> bool {
    info.state != "dead" && !info.metadata.contains_key(bb_runtime::recipes::TEMPLATE_KEY)
}

fn info_of(e: &E2b, id: &str) -> E2bResult<SandboxInfo> {
    let info = e.rt.info(&canonical_id(id)).map_err(|_| not_found(id))?;
    if !visible(&info) {
        return Err(not_found(id));
    }
    Ok(info)
}

fn not_found(id: &str) -> E2bError {
    E2bError::not_found(format!("sandbox \"{id}\" not found"))
}

pub async fn get_sandbox(State(e): St, Path(id): Path<String>) -> E2bResult<Json<Value>> {
    Ok(Json(listed(&e, &info_of(&e, &id)?, true)))
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    started_after: Option<String>,
    template: Option<String>,
    order: Option<String>,
    next_token: Option<String>,
    limit: Option<usize>,
}

/// `GET /sandboxes` (v1: running sandboxes, all at once).
pub async fn list_v1(State(e): St, Query(q): Query<ListQuery>) -> E2bResult<Json<Value>> {
    let q = ListQuery { state: Some(q.state.unwrap_or_else(|| "running".into())), limit: Some(MAX_LIMIT), ..q };
    let (page, _) = select(&e, &q)?;
    Ok(Json(Value::Array(page)))
}

/// `GET /v2/sandboxes`: newest first by default, filtered, paged with `X-Next-Token`.
pub async fn list_v2(State(e): St, Query(q): Query<ListQuery>) -> E2bResult<Response> {
    let (page, next) = select(&e, &q)?;
    let mut resp = Json(Value::Array(page)).into_response();
    if let Some(next) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        resp.headers_mut().insert("x-next-token", next);
    }
    Ok(resp)
}

/// `k=v&k2=v2`, keys and values percent-encoded twice (the SDK quotes each, then url-encodes the
/// pairs; the query string's own encoding is undone on the way in).
fn parse_metadata_filter(raw: &str) -> E2bResult<Vec<(String, String)>> {
    raw.split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').ok_or_else(|| {
                E2bError::bad_request(format!("metadata filter {pair:?} is not key=value: give k=v pairs joined by &"))
            })?;
            Ok((percent_decode(&percent_decode(k)), percent_decode(&percent_decode(v))))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let byte = (b[i] == b'%')
            .then(|| b.get(i + 1..i + 3))
            .flatten()
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match byte {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn select(e: &E2b, q: &ListQuery) -> E2bResult<(Vec<Value>, Option<String>)> {
    let states: Vec<String> = match &q.state {
        Some(s) => s.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect(),
        None => vec!["running".into(), "paused".into()],
    };
    if let Some(bad) = states.iter().find(|s| *s != "running" && *s != "paused") {
        return Err(E2bError::bad_request(format!("state {bad:?} is not one of running, paused")));
    }
    let wanted = q.metadata.as_deref().map(parse_metadata_filter).transpose()?.unwrap_or_default();
    let after = match &q.started_after {
        Some(t) => Some(
            humantime::parse_rfc3339_weak(t.trim_end_matches('Z').split('+').next().unwrap_or(t))
                .map_err(|err| E2bError::bad_request(format!("startedAfter {t:?} is not an RFC 3339 time: {err}")))?
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
        ),
        None => None,
    };
    let desc = match q.order.as_deref() {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(o) => return Err(E2bError::bad_request(format!("order {o:?} is not asc or desc"))),
    };
    let limit = limit_of(q.limit)?;
    let mut all: Vec<SandboxInfo> =
        e.rt.list(&[])
            .into_iter()
            .filter(visible)
            .filter(|i| states.iter().any(|s| s == state_of(i)))
            .filter(|i| wanted.iter().all(|(k, v)| i.metadata.get(k) == Some(v)))
            .filter(|i| after.is_none_or(|a| i.created_at > a))
            .filter(|i| q.template.as_ref().is_none_or(|t| &template_of(i) == t))
            .collect();
    // Ties broken by id, so a page boundary is stable.
    all.sort_by(|a, b| a.created_at.total_cmp(&b.created_at).then_with(|| a.id.cmp(&b.id)));
    if desc {
        all.reverse();
    }
    let (page, next) = page(&all, q.next_token.as_deref(), limit, |i, tok| i.id == canonical_id(tok))?;
    Ok((page.iter().map(|i| listed(e, i, false)).collect(), next.map(|i| dashless_id(&i.id))))
}

/// A list's page size: `limit` (100 when not given), refused out of range.
fn limit_of(limit: Option<usize>) -> E2bResult<usize> {
    let limit = limit.unwrap_or(100);
    if limit == 0 || limit > MAX_LIMIT {
        return Err(E2bError::bad_request(format!("limit {limit} is out of range: give 1 to {MAX_LIMIT}")));
    }
    Ok(limit)
}

/// The page of `all` that starts at the item `token` names (`is`), the first without one, at
/// most `limit` long; and the item the next page starts at (`X-Next-Token` names it).
fn page<'a, T>(
    all: &'a [T],
    token: Option<&str>,
    limit: usize,
    is: impl Fn(&T, &str) -> bool,
) -> E2bResult<(&'a [T], Option<&'a T>)> {
    let start = match token {
        None => 0,
        Some(tok) => all
            .iter()
            .position(|i| is(i, tok))
            .ok_or_else(|| E2bError::bad_request(format!("nextToken {tok:?} is unknown or expired: list again")))?,
    };
    let end = all.len().min(start.saturating_add(limit));
    Ok((&all[start..end], all.get(end)))
}

pub async fn kill(State(e): St, Path(id): Path<String>) -> E2bResult<StatusCode> {
    info_of(&e, &id)?;
    e.rt.kill(&canonical_id(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
pub struct TimeoutReq {
    timeout: Option<i64>,
}

pub async fn set_timeout(State(e): St, Path(id): Path<String>, bytes: axum::body::Bytes) -> E2bResult<Response> {
    let req: TimeoutReq = body(&bytes)?;
    let Some(t) = req.timeout.filter(|t| *t >= 0) else {
        return Err(E2bError::bad_request("timeout must be a number of seconds >= 0"));
    };
    let info = info_of(&e, &id)?;
    let cid = canonical_id(&id);
    if t == 0 {
        // Now: the sandbox ends as its lifecycle says (paused, or killed).
        if info.lifecycle.on_timeout == OnTimeout::Pause {
            pause_now(&e, &id, info.lifecycle.pause_mode).await?;
        } else {
            e.rt.kill(&cid).await?;
        }
    } else {
        e.rt.set_timeout(&cid, t as f64)?;
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `PUT /sandboxes/{id}/network`: the sandbox's egress replaced as a whole (see [`egress`]), as
/// E2B's `update_network` does (a setting left out is cleared). 204.
pub async fn update_network(State(e): St, Path(id): Path<String>, bytes: axum::body::Bytes) -> E2bResult<Response> {
    let req: Egress = body(&bytes)?;
    info_of(&e, &id)?;
    let (network, allow) = egress(req.allow_internet_access, &req)?;
    let update = model::NetworkUpdate { network: Some(network), allow: Some(allow), limits: None };
    e.rt.update_network(&canonical_id(&id), update).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize, Default)]
pub struct ConnectReq {
    timeout: Option<u64>,
    /// false: a paused sandbox cold-boots (files only) instead of getting its processes back.
    memory: Option<bool>,
}

impl ConnectReq {
    fn resume(&self, timeout: f64) -> model::ResumeSandbox {
        model::ResumeSandbox { timeout: Some(timeout), reboot: self.memory == Some(false) }
    }
}

/// Connect: a running sandbox answers 200, a paused one is resumed (201). The end time only
/// grows: a timeout shorter than what is left is ignored.
pub async fn connect(State(e): St, Path(id): Path<String>, bytes: axum::body::Bytes) -> E2bResult<Response> {
    let req: ConnectReq = body(&bytes)?;
    let info = info_of(&e, &id)?;
    let cid = canonical_id(&id).into_owned();
    let timeout = req.timeout.unwrap_or(DEFAULT_TIMEOUT) as f64;
    let (status, info) = if info.state == "paused" {
        let r = e.rt.resume(&cid, req.resume(timeout)).await?;
        (StatusCode::CREATED, r.sandbox)
    } else {
        (StatusCode::OK, info)
    };
    let left = info.expires_at.map(|x| x - bb_runtime::now());
    let info = if left.is_some_and(|l| l < timeout) { e.rt.set_timeout(&cid, timeout)? } else { info };
    Ok((status, Json(created(&e, &info))).into_response())
}

/// The pause body. Its `requireHealthyGuest` (refuse to pause an unresponsive guest agent) is
/// met by every pause here: envd is served by the daemon, there is no guest agent to hang.
#[derive(Deserialize, Default)]
pub struct PauseReq {
    /// false: files only (`mode="filesystem"`); the resume cold-boots.
    memory: Option<bool>,
}

pub async fn pause(State(e): St, Path(id): Path<String>, bytes: axum::body::Bytes) -> E2bResult<StatusCode> {
    let req: PauseReq = body(&bytes)?;
    let info = info_of(&e, &id)?;
    if info.state == "paused" {
        return Err(E2bError::Status(StatusCode::CONFLICT, format!("sandbox \"{id}\" is already paused")));
    }
    let mode = if req.memory == Some(false) { PauseMode::Filesystem } else { PauseMode::Full };
    pause_now(&e, &id, mode).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Pause sandbox `id` in `mode`. The SDK takes any 409 for "already paused": other reasons a
/// pause is refused (a command of branchbox's own API in the foreground, a busy code context)
/// say so as 400.
async fn pause_now(e: &E2b, id: &str, mode: PauseMode) -> E2bResult<()> {
    match e.rt.pause(&canonical_id(id), mode).await {
        Ok(_) => Ok(()),
        Err(err @ bb_runtime::RuntimeError::Conflict(_)) => Err(E2bError::bad_request(err.to_string())),
        Err(err) => Err(err.into()),
    }
}

/// `POST /sandboxes/{id}/resume` (deprecated in E2B's API, still answered).
pub async fn resume(State(e): St, Path(id): Path<String>, bytes: axum::body::Bytes) -> E2bResult<Response> {
    let req: ConnectReq = body(&bytes)?;
    let info = info_of(&e, &id)?;
    if info.state != "paused" {
        return Err(E2bError::Status(StatusCode::CONFLICT, format!("sandbox \"{id}\" is not paused")));
    }
    let timeout = req.timeout.unwrap_or(DEFAULT_TIMEOUT) as f64;
    let r = e.rt.resume(&canonical_id(&id), req.resume(timeout)).await?;
    Ok((StatusCode::CREATED, Json(created(&e, &r.sandbox))).into_response())
}

/// What E2B's snapshots and forks keep of the processes: as much as the daemon can (E2B's hold
/// the whole VM). Background processes need CRIU; those it cannot keep are left out.
fn keepable(e: &E2b) -> model::Processes {
    if e.rt.can_keep_processes() {
        model::Processes::Keepable
    } else {
        model::Processes::Sessions
    }
}

#[derive(Deserialize, Default)]
pub struct ForkReq {
    timeout: Option<u64>,
    count: Option<u32>,
}

/// Fork: N children of the sandbox as it is now (files, sessions and code contexts), each
/// answered as `{"sandbox": Sandbox}`.
pub async fn fork(State(e): St, Path(id): Path<String>, bytes: axum::body::Bytes) -> E2bResult<Response> {
    let req: ForkReq = body(&bytes)?;
    info_of(&e, &id)?;
    let r =
        e.rt.fork(
            &canonical_id(&id),
            model::ForkRequest {
                count: Some(req.count.unwrap_or(1)),
                timeout: Some(req.timeout.unwrap_or(DEFAULT_TIMEOUT) as f64),
                processes: keepable(&e),
                ..Default::default()
            },
        )
        .await?;
    let children = r.sandboxes.iter().map(|c| json!({"sandbox": created(&e, c)})).collect();
    Ok((StatusCode::CREATED, Json(Value::Array(children))).into_response())
}

#[derive(Deserialize, Default)]
pub struct SnapshotReq {
    name: Option<String>,
    /// false: the files alone (`create_snapshot(mode="filesystem")`): what starts from the
    /// snapshot cold-boots, without processes or code contexts.
    memory: Option<bool>,
}

/// A snapshot of the sandbox (files and process state, branchbox's checkpoint): its id is a
/// template id for `POST /sandboxes`, and a rollback target.
pub async fn snapshot(State(e): St, Path(id): Path<String>, bytes: axum::body::Bytes) -> E2bResult<Response> {
    let req: SnapshotReq = body(&bytes)?;
    if let Some(name) = &req.name {
        check_snapshot_name(name)?;
    }
    info_of(&e, &id)?;
    let processes = if req.memory == Some(false) { model::Processes::None } else { keepable(&e) };
    let snap =
        e.rt.checkpoint(&canonical_id(&id), model::CheckpointRequest { label: req.name.clone(), processes }).await?;
    let names: Vec<String> = req.name.into_iter().collect();
    Ok((StatusCode::CREATED, Json(json!({"snapshotID": snap.id, "names": names}))).into_response())
}

/// A snapshot's name is a template id too (`Sandbox.create(name)`): it must read as one, and not
/// as one of the two templates that are always found first.
fn check_snapshot_name(name: &str) -> E2bResult<()> {
    if [BASE_TEMPLATE, CODE_INTERPRETER_TEMPLATE].contains(&name) {
        return Err(E2bError::bad_request(format!(
            "snapshot name {name:?} is the name of a template (Sandbox.create({name:?}) starts from that): choose another"
        )));
    }
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
        && !name.starts_with(['.', '/']);
    if ok {
        Ok(())
    } else {
        Err(E2bError::bad_request(format!(
            "snapshot name {name:?} is not usable as a template name: give 1 to 128 letters, digits, '-', '_', '.' or '/' (not first)"
        )))
    }
}

/// A template id without its tag (`:default`, `:latest`): E2B's newest build of the template.
fn untagged(name: &str) -> &str {
    name.strip_suffix(":latest").or_else(|| name.strip_suffix(":default")).unwrap_or(name)
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotsQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    /// A snapshot's name (its branchbox label) or id.
    name: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
}

/// `GET /snapshots`: newest first, by sandbox and name, paged with `X-Next-Token`.
pub async fn list_snapshots(State(e): St, Query(q): Query<SnapshotsQuery>) -> E2bResult<Response> {
    let limit = limit_of(q.limit)?;
    let sandbox = q.sandbox_id.map(|s| canonical_id(&s).into_owned());
    let mut all = e.rt.list_snapshots(sandbox.as_deref())?.snapshots;
    if let Some(name) = q.name.as_deref().map(untagged) {
        all.retain(|s| s.id == name || s.label.as_deref() == Some(name));
    }
    // Ties broken by id, so a page boundary is stable.
    all.sort_by(|a, b| b.created_at.total_cmp(&a.created_at).then_with(|| b.id.cmp(&a.id)));
    let (items, next) = page(&all, q.next_token.as_deref(), limit, |s, tok| s.id == tok)?;
    let items: Vec<Value> =
        items.iter().map(|s| json!({"snapshotID": s.id, "names": s.label.iter().collect::<Vec<_>>()})).collect();
    let mut resp = Json(Value::Array(items)).into_response();
    if let Some(next) = next.and_then(|n| HeaderValue::from_str(&n.id).ok()) {
        resp.headers_mut().insert("x-next-token", next);
    }
    Ok(resp)
}

#[derive(Deserialize, Default)]
pub struct RollbackReq {
    #[serde(rename = "snapshotID")]
    snapshot_id: Option<String>,
}

/// branchbox's rollback in E2B's shape: `POST /sandboxes/{id}/rollback {"snapshotID": ...}`.
pub async fn rollback(State(e): St, Path(id): Path<String>, bytes: axum::body::Bytes) -> E2bResult<Json<Value>> {
    let req: RollbackReq = body(&bytes)?;
    let Some(snapshot) = req.snapshot_id else {
        return Err(E2bError::bad_request("give snapshotID: the snapshot to return to"));
    };
    info_of(&e, &id)?;
    let cid = canonical_id(&id);
    e.rt.rollback(&cid, model::RollbackRequest { snapshot, lazy_pages: None }).await?;
    Ok(Json(created(&e, &e.rt.info(&cid)?)))
}

/// `DELETE /templates/{id}`: a snapshot (what E2B's SDK deletes snapshots with).
pub async fn delete_template(State(e): St, Path(id): Path<String>) -> E2bResult<StatusCode> {
    if e.rt.snapshot(&id).is_err() {
        return Err(E2bError::not_found(format!("template \"{id}\" not found (only snapshots are deleted here)")));
    }
    e.rt.delete_snapshot(&id, false).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn alias(State(e): St, Path(alias): Path<String>) -> E2bResult<Json<Value>> {
    let known = match resolve_template(&e, &alias) {
        Source::Image(i) => e.rt.images().get(&i).is_ok(),
        _ => true,
    };
    if !known {
        return Err(E2bError::not_found(format!("template alias \"{alias}\" not found")));
    }
    Ok(Json(json!({"templateID": alias, "public": true})))
}

/// `GET /sandboxes/{id}/metrics`: one sample, now.
pub async fn metrics(State(e): St, Path(id): Path<String>) -> E2bResult<Json<Value>> {
    let info = info_of(&e, &id)?;
    let now = bb_runtime::now();
    Ok(Json(json!([{
        "timestamp": rfc3339(now),
        "timestampUnix": now as i64,
        "cpuCount": info.cpu.ceil().max(1.0) as u64,
        "cpuUsedPct": 0.0,
        "memUsed": info.memory_bytes,
        "memTotal": info.memory_mb << 20,
        "memCache": 0,
        "diskUsed": 0,
        "diskTotal": 0,
    }])))
}

/// Every control-plane request carries the daemon's token as `X-API-KEY`.
pub fn authorized(e: &E2b, headers: &HeaderMap) -> bool {
    let given = headers.get("x-api-key").and_then(|v| v.to_str().ok()).unwrap_or("");
    crate::same(given, &e.cfg.api_key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filters_decode_twice_quoted_pairs() {
        assert_eq!(
            parse_metadata_filter("a=1&user%2520id=x%2526y").unwrap(),
            vec![("a".into(), "1".into()), ("user id".into(), "x&y".into())]
        );
        assert!(parse_metadata_filter("novalue").is_err());
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }

    fn net(json: serde_json::Value) -> Egress {
        serde_json::from_value(json).unwrap()
    }

    fn mapped(internet: Option<bool>, json: serde_json::Value) -> (String, Vec<String>) {
        egress(internet, &net(json)).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn egress_maps_onto_modes_and_allow_entries() {
        let pair = |mode: &str, allow: &[&str]| (mode.to_string(), allow.iter().map(|a| a.to_string()).collect());
        // No network settings: off unless the internet is allowed (this endpoint's default).
        assert_eq!(mapped(None, json!({})), pair("none", &[]));
        assert_eq!(mapped(Some(true), json!({})), pair("open", &[]));
        assert_eq!(mapped(Some(false), json!({})), pair("none", &[]));
        // E2B's "deny all but": the allow entries alone, its DNS servers with them.
        let only =
            json!({"denyOut": [ALL_TRAFFIC], "allowOut": ["1.1.1.1", "*.example.com"], "dnsServers": ["9.9.9.9"]});
        assert_eq!(mapped(Some(true), only.clone()), pair("allowlist", &["1.1.1.1", "*.example.com", "9.9.9.9"]));
        assert_eq!(mapped(None, only), pair("allowlist", &["1.1.1.1", "*.example.com", "9.9.9.9"]));
        assert_eq!(mapped(Some(false), json!({"allowOut": ["10.0.0.0/8"]})), pair("allowlist", &["10.0.0.0/8"]));
        assert_eq!(mapped(None, json!({"denyOut": [ALL_TRAFFIC]})), pair("none", &[]));
        assert_eq!(mapped(None, json!({"denyOut": [ALL_TRAFFIC], "dnsServers": ["9.9.9.9"]})), pair("none", &[]));
        // allowOut without a deny: here, what it names (E2B would open everything).
        assert_eq!(mapped(None, json!({"allowOut": ["example.com"]})), pair("allowlist", &["example.com"]));
        // With the internet on, allow entries let through what `open` refuses (private ranges).
        assert_eq!(mapped(Some(true), json!({"allowOut": ["10.1.2.3"]})), pair("open", &["10.1.2.3"]));
        assert_eq!(mapped(None, json!({"allowOut": [ALL_TRAFFIC]})), pair("open", &[]));
        // What the SDK sends when nothing is set in those fields.
        assert_eq!(
            mapped(None, json!({"allowPublicTraffic": true, "rules": {}, "egressProxy": null})),
            pair("none", &[])
        );
        // The update body's own snake-case field.
        assert_eq!(net(json!({"allow_internet_access": true})).allow_internet_access, Some(true));
    }

    #[test]
    fn egress_refuses_what_it_cannot_map() {
        for (bad, names) in [
            (json!({"denyOut": ["10.0.0.0/8"]}), "denyOut"),
            (json!({"denyOut": [ALL_TRAFFIC, "1.1.1.1"]}), "denyOut"),
            (json!({"egressProxy": {"address": "1.2.3.4:1080"}}), "egressProxy"),
            (json!({"rules": {"api.example.com": [{"transform": {"headers": {"A": "b"}}}]}}), "rules"),
            (json!({"maskRequestHost": "x"}), "maskRequestHost"),
            (json!({"httpsPorts": [8443]}), "httpsPorts"),
            (json!({"allowPublicTraffic": false}), "allowPublicTraffic"),
        ] {
            let err = egress(Some(true), &net(bad)).expect_err(names).to_string();
            assert!(err.contains(names), "{err}");
        }
    }

    #[test]
    fn pages_follow_their_token_and_snapshot_names_read_as_template_ids() {
        let all = [1, 2, 3, 4, 5];
        let is = |i: &i32, tok: &str| i.to_string() == tok;
        let (p, next) = page(&all, None, 2, is).unwrap();
        assert_eq!((p, next), (&[1, 2][..], Some(&3)));
        let (p, next) = page(&all, Some("5"), 2, is).unwrap();
        assert_eq!((p, next), (&[5][..], None));
        let (p, next) = page(&all, Some("3"), usize::MAX, is).unwrap();
        assert_eq!((p, next), (&[3, 4, 5][..], None));
        assert!(page(&all, Some("9"), 2, is).is_err());
        assert!(limit_of(Some(0)).is_err() && limit_of(Some(MAX_LIMIT + 1)).is_err());
        assert_eq!(limit_of(None).unwrap(), 100);
        for good in ["my-snap", "team/my_snap.v2", "a"] {
            assert!(check_snapshot_name(good).is_ok(), "{good}");
        }
        for bad in
            ["", "../up", "/abs", ".hidden", "with space", "tag:v1", &"x".repeat(129), "base", "code-interpreter-v1"]
        {
            assert!(check_snapshot_name(bad).is_err(), "{bad}");
        }
        assert_eq!((untagged("s:latest"), untagged("s:default"), untagged("s:v1")), ("s", "s", "s:v1"));
    }
}
