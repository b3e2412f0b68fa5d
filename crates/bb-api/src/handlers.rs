//! One handler per endpoint: parse, call the runtime, render.

use crate::error::{ApiError, ApiResult};
use crate::extract::{JsonBody, P, Q};
use crate::AppState;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bb_runtime::model::*;
use bb_runtime::sandbox::files::SbPath;
use bb_runtime::ImageSource;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use utoipa::{IntoParams, OpenApi, ToSchema};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "branchboxd",
        description = "Sandbox runtime for AI agents. Errors: {\"error\": {\"code\", \"message\"}}."
    ),
    paths(
        health,
        create_sandbox,
        list_sandboxes,
        get_sandbox,
        kill_sandbox,
        set_timeout,
        pause_sandbox,
        resume_sandbox,
        run_command,
        stream_command,
        list_processes,
        wait_process,
        kill_process,
        create_session,
        list_sessions,
        kill_session,
        run_session,
        run_code,
        read_file,
        write_file,
        remove_file,
        list_files,
        stat_file,
        make_dir,
        rename_file,
        list_images,
        build_image,
        import_image,
        remove_image,
        checkpoint,
        rollback,
        fork,
        evaluate,
        sandbox_snapshots,
        list_snapshots,
        get_snapshot,
        delete_snapshot,
        offload_snapshot,
        push_snapshot,
        pull_snapshot,
        list_remote_snapshots,
        delete_remote_snapshot,
        store_gc,
        gc_snapshots,
        get_pool,
        set_pool,
        build_template,
        list_templates,
        get_template,
        remove_template,
        create_volume,
        list_volumes,
        get_volume,
        delete_volume,
        snapshot_volume,
        list_volume_snapshots,
        delete_volume_snapshot,
        open_port,
        list_ports,
        close_port,
        get_network,
        update_network,
        restore_volume,
        fork_volume,
        sync_volume,
        volume_read_file,
        volume_write_file,
        volume_remove_file,
        volume_list_files,
        volume_stat_file,
        volume_make_dir,
        volume_rename_file
    ),
    components(schemas(
        PortInfo,
        PortList,
        NetworkInfo,
        NetworkUpdate,
        CreateSandbox,
        SandboxInfo,
        SandboxList,
        SetTimeout,
        Lifecycle,
        OnTimeout,
        ResumeSandbox,
        PauseResult,
        PauseSandbox,
        RemotePausedInfo,
        ResumeResult,
        OffloadResult,
        PushResult,
        PullResult,
        RemoteSnapshotInfo,
        RemoteSnapshotList,
        StoreGcRequest,
        StoreGcResult,
        RunCommand,
        CommandResult,
        Started,
        ProcessInfo,
        ProcessList,
        WaitRequest,
        KillRequest,
        CreateSession,
        SessionInfo,
        SessionList,
        RunCode,
        SessionResult,
        EntryInfo,
        EntryList,
        MakeDir,
        Rename,
        ImageInfo,
        ImageList,
        BuildImage,
        ImportImage,
        ProgressEvent,
        CommandEvent,
        ErrorBody,
        Health,
        ErrorResponse,
        Done,
        CheckpointRequest,
        RollbackRequest,
        ForkRequest,
        GcRequest,
        SnapshotInfo,
        SnapshotSessionInfo,
        SnapshotList,
        RollbackResult,
        RestartedSession,
        ProcessImageStats,
        ForkResult,
        GcResult,
        PoolStats,
        PoolImageStats,
        SetPool,
        BuildTemplate,
        TemplateInfo,
        TemplateList,
        TemplateEvent,
        Access,
        CreateVolume,
        VolumeMount,
        VolumeInfo,
        VolumeMountInfo,
        VolumeList,
        VolumeSnapshotRequest,
        VolumeSnapshotInfo,
        VolumeSnapshotList,
        RestoreVolume,
        ForkVolume
    ))
)]
pub struct ApiDoc;

/// Error response body.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

/// Acknowledgement of a kill or removal.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct Done {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub killed: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub removed: Option<bool>,
}

fn killed() -> Json<Done> {
    Json(Done { killed: Some(true), removed: None })
}
fn removed() -> Json<Done> {
    Json(Done { killed: None, removed: Some(true) })
}

/// NDJSON streaming response from a channel of serialisable events.
fn ndjson<T: Serialize + Send + 'static>(rx: tokio::sync::mpsc::Receiver<T>) -> Response {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let ev = rx.recv().await?;
        let mut line = serde_json::to_vec(&ev).expect("event serializes");
        line.push(b'\n');
        Some((Ok::<_, std::convert::Infallible>(bytes::Bytes::from(line)), rx))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(stream))
        .expect("valid response")
}

#[utoipa::path(get, path = "/v1/health", responses((status = 200, body = Health)))]
pub async fn health(State(rt): State<AppState>) -> Json<Health> {
    Json(Health {
        ok: true,
        version: env!("CARGO_PKG_VERSION").into(),
        cgroup: rt.cgroups.version().to_string(),
        sandboxes: rt.count(),
        process_images: rt.process_image_stats(),
        store: rt.store_urls().0,
        metadata: rt.store_urls().1,
    })
}

#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandbox,
    responses((status = 201, body = SandboxInfo), (status = 400, body = ErrorResponse), (status = 404, body = ErrorResponse)))]
pub async fn create_sandbox(
    State(rt): State<AppState>,
    JsonBody(req): JsonBody<CreateSandbox>,
) -> ApiResult<(StatusCode, Json<SandboxInfo>)> {
    Ok((StatusCode::CREATED, Json(rt.create(req).await?)))
}

#[utoipa::path(get, path = "/v1/sandboxes",
    params(("metadata.<key>" = Option<String>, Query, description = "only sandboxes whose metadata has this value")),
    responses((status = 200, body = SandboxList)))]
pub async fn list_sandboxes(State(rt): State<AppState>, Q(q): Q<HashMap<String, String>>) -> Json<SandboxList> {
    let filter: Vec<(String, String)> =
        q.into_iter().filter_map(|(k, v)| k.strip_prefix("metadata.").map(|k| (k.to_string(), v))).collect();
    Json(SandboxList { sandboxes: rt.list(&filter) })
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", params(("id" = String, Path, description = "sandbox id")),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorResponse)))]
pub async fn get_sandbox(State(rt): State<AppState>, P(id): P<String>) -> ApiResult<Json<SandboxInfo>> {
    Ok(Json(rt.info(&id)?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", params(("id" = String, Path, description = "sandbox id")),
    responses((status = 200, body = Done), (status = 404, body = ErrorResponse)))]
pub async fn kill_sandbox(State(rt): State<AppState>, P(id): P<String>) -> ApiResult<Json<Done>> {
    rt.kill(&id).await?;
    Ok(killed())
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/timeout", params(("id" = String, Path, description = "sandbox id")), request_body = SetTimeout,
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorResponse)))]
pub async fn set_timeout(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<SetTimeout>,
) -> ApiResult<Json<SandboxInfo>> {
    Ok(Json(rt.set_timeout(&id, req.timeout)?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", params(("id" = String, Path, description = "sandbox id")), request_body = PauseSandbox,
    responses((status = 200, body = PauseResult), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse),
    (status = 503, description = "CRIU is not available", body = ErrorResponse)))]
pub async fn pause_sandbox(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<PauseSandbox>,
) -> ApiResult<Json<PauseResult>> {
    Ok(Json(rt.pause_with(&id, req).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", params(("id" = String, Path, description = "sandbox id")),
    request_body = ResumeSandbox, responses((status = 200, body = ResumeResult), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn resume_sandbox(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<ResumeSandbox>,
) -> ApiResult<Json<ResumeResult>> {
    Ok(Json(rt.resume(&id, req).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands", params(("id" = String, Path, description = "sandbox id")), request_body = RunCommand,
    responses((status = 200, description = "foreground result", body = CommandResult), (status = 201, description = "background process started", body = Started),
    (status = 400, body = ErrorResponse), (status = 404, body = ErrorResponse)))]
pub async fn run_command(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<RunCommand>,
) -> ApiResult<Response> {
    if req.background {
        let started = rt.start_background(&id, req).await?;
        Ok((StatusCode::CREATED, Json(started)).into_response())
    } else {
        Ok(Json(rt.run_command(&id, req).await?).into_response())
    }
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/stream", params(("id" = String, Path, description = "sandbox id")), request_body = RunCommand,
    responses((status = 200, description = "NDJSON stream of CommandEvent", body = CommandEvent, content_type = "application/x-ndjson")))]
pub async fn stream_command(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(mut req): JsonBody<RunCommand>,
) -> ApiResult<Response> {
    req.background = false;
    Ok(ndjson(rt.stream_command(&id, req).await?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/commands", params(("id" = String, Path, description = "sandbox id")),
    responses((status = 200, body = ProcessList)))]
pub async fn list_processes(State(rt): State<AppState>, P(id): P<String>) -> ApiResult<Json<ProcessList>> {
    Ok(Json(rt.list_processes(&id).await?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/network", params(("id" = String, Path, description = "sandbox id")),
    responses((status = 200, body = NetworkInfo), (status = 404, body = ErrorResponse)))]
pub async fn get_network(State(rt): State<AppState>, P(id): P<String>) -> ApiResult<Json<NetworkInfo>> {
    Ok(Json(rt.network(&id)?))
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", params(("id" = String, Path, description = "sandbox id")), request_body = NetworkUpdate,
    responses((status = 200, body = NetworkInfo, description = "the policy now; connections made from now on follow it"), (status = 400, body = ErrorResponse), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse), (status = 503, body = ErrorResponse)))]
pub async fn update_network(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<NetworkUpdate>,
) -> ApiResult<Json<NetworkInfo>> {
    Ok(Json(rt.update_network(&id, req).await?))
}

fn parse_port(port: &str) -> ApiResult<u32> {
    port.parse::<u32>()
        .map_err(|_| ApiError::bad_request(format!("{port:?} is not a port: give a TCP port from 1 to 65535")))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/ports/{port}", params(("id" = String, Path, description = "sandbox id"), ("port" = u16, Path, description = "TCP port a server in the sandbox listens on")),
    responses((status = 200, body = PortInfo, description = "the host address reaching it (opened on first ask)"), (status = 400, body = ErrorResponse), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn open_port(State(rt): State<AppState>, P((id, port)): P<(String, String)>) -> ApiResult<Json<PortInfo>> {
    Ok(Json(rt.open_port(&id, parse_port(&port)?).await?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/ports", params(("id" = String, Path, description = "sandbox id")),
    responses((status = 200, body = PortList), (status = 404, body = ErrorResponse)))]
pub async fn list_ports(State(rt): State<AppState>, P(id): P<String>) -> ApiResult<Json<PortList>> {
    Ok(Json(rt.list_ports(&id)?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/ports/{port}", params(("id" = String, Path, description = "sandbox id"), ("port" = u16, Path, description = "sandbox port")),
    responses((status = 200, body = Done, description = "`removed`: false when the port was not open"), (status = 404, body = ErrorResponse)))]
pub async fn close_port(State(rt): State<AppState>, P((id, port)): P<(String, String)>) -> ApiResult<Json<Done>> {
    let removed = rt.close_port(&id, parse_port(&port)?)?;
    Ok(Json(Done { killed: None, removed: Some(removed) }))
}

fn parse_pid(pid: &str) -> ApiResult<i32> {
    pid.parse::<i32>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request(format!("{pid:?} is not a process id: give a positive integer")))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/{pid}/wait", params(("id" = String, Path, description = "sandbox id"), ("pid" = i32, Path, description = "process id inside the sandbox")),
    request_body = WaitRequest, responses((status = 200, body = CommandResult), (status = 404, body = ErrorResponse)))]
pub async fn wait_process(
    State(rt): State<AppState>,
    P((id, pid)): P<(String, String)>,
    JsonBody(req): JsonBody<WaitRequest>,
) -> ApiResult<Json<CommandResult>> {
    Ok(Json(rt.wait_process(&id, parse_pid(&pid)?, req.timeout).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands/{pid}/kill", params(("id" = String, Path, description = "sandbox id"), ("pid" = i32, Path, description = "process id inside the sandbox")),
    request_body = KillRequest, responses((status = 200, body = Done), (status = 404, body = ErrorResponse)))]
pub async fn kill_process(
    State(rt): State<AppState>,
    P((id, pid)): P<(String, String)>,
    JsonBody(req): JsonBody<KillRequest>,
) -> ApiResult<Json<Done>> {
    rt.kill_process(&id, parse_pid(&pid)?, req.signal).await?;
    Ok(killed())
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions", params(("id" = String, Path, description = "sandbox id")), request_body = CreateSession,
    responses((status = 201, body = SessionInfo), (status = 400, body = ErrorResponse)))]
pub async fn create_session(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<CreateSession>,
) -> ApiResult<(StatusCode, Json<SessionInfo>)> {
    Ok((StatusCode::CREATED, Json(rt.create_session(&id, req).await?)))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/sessions", params(("id" = String, Path, description = "sandbox id")), responses((status = 200, body = SessionList)))]
pub async fn list_sessions(State(rt): State<AppState>, P(id): P<String>) -> ApiResult<Json<SessionList>> {
    Ok(Json(rt.list_sessions(&id).await?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/sessions/{sid}", params(("id" = String, Path, description = "sandbox id"), ("sid" = String, Path, description = "session id")),
    responses((status = 200, body = Done), (status = 404, body = ErrorResponse)))]
pub async fn kill_session(State(rt): State<AppState>, P((id, sid)): P<(String, String)>) -> ApiResult<Json<Done>> {
    rt.kill_session(&id, &sid).await?;
    Ok(killed())
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions/{sid}/run", params(("id" = String, Path, description = "sandbox id"), ("sid" = String, Path, description = "session id")),
    request_body = RunCode, responses((status = 200, body = SessionResult), (status = 409, body = ErrorResponse)))]
pub async fn run_session(
    State(rt): State<AppState>,
    P((id, sid)): P<(String, String)>,
    JsonBody(req): JsonBody<RunCode>,
) -> ApiResult<Json<SessionResult>> {
    Ok(Json(rt.run_session(&id, &sid, req).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/code", params(("id" = String, Path, description = "sandbox id")), request_body = RunCode,
    responses((status = 200, body = SessionResult)))]
pub async fn run_code(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<RunCode>,
) -> ApiResult<Json<SessionResult>> {
    Ok(Json(rt.run_code(&id, req).await?))
}

#[derive(Deserialize, IntoParams)]
pub struct PathQuery {
    /// Path inside the sandbox.
    pub path: String,
}

#[derive(Deserialize, IntoParams)]
pub struct WriteQuery {
    pub path: String,
    /// Octal file mode, e.g. `0644`.
    pub mode: Option<String>,
    /// The sandbox user the file belongs to (default root), e.g. `user`.
    pub user: Option<String>,
}

#[derive(Deserialize, IntoParams)]
pub struct ListQuery {
    pub path: String,
    /// How many levels to descend (default 1).
    pub depth: Option<u32>,
}

#[derive(Deserialize, IntoParams)]
pub struct RemoveQuery {
    pub path: String,
    pub recursive: Option<bool>,
}

/// Whose files a file request reaches: a sandbox's (its root) or a volume's.
enum FsOf {
    Sandbox(String),
    Volume(String),
}

impl FsOf {
    /// `write`: the request changes files.
    async fn open(&self, rt: &AppState, write: bool) -> ApiResult<bb_runtime::sandbox::files::SandboxFs> {
        self.open_as(rt, write, None).await
    }

    /// [`open`](Self::open), new files and directories owned by `user` (a sandbox's user).
    async fn open_as(
        &self,
        rt: &AppState,
        write: bool,
        user: Option<&str>,
    ) -> ApiResult<bb_runtime::sandbox::files::SandboxFs> {
        Ok(match (self, user) {
            (FsOf::Sandbox(id), user) => rt.fs_as(id, user).await?,
            (FsOf::Volume(vid), None) => rt.volume_fs(vid, write).await?,
            (FsOf::Volume(_), Some(_)) => {
                return Err(ApiError::bad_request("user is for sandbox files: volume files belong to root"))
            }
        })
    }
}

/// Run blocking filesystem work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, bb_runtime::RuntimeError> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
        .map_err(ApiError::from)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path, description = "sandbox id"), PathQuery),
    responses((status = 200, description = "file content", content_type = "application/octet-stream", body = Vec<u8>),
    (status = 400, body = ErrorResponse), (status = 404, body = ErrorResponse)))]
pub async fn read_file(State(rt): State<AppState>, P(id): P<String>, Q(q): Q<PathQuery>) -> ApiResult<Response> {
    read_in(rt, FsOf::Sandbox(id), q).await
}

async fn read_in(rt: AppState, of: FsOf, q: PathQuery) -> ApiResult<Response> {
    let path = SbPath::parse(&q.path)?;
    let fs = of.open(&rt, false).await?;
    let (file, size) = blocking(move || fs.open_read(&path)).await?;
    let stream = tokio_util::io::ReaderStream::with_capacity(tokio::fs::File::from_std(file), 256 * 1024);
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, size)
        .body(Body::from_stream(stream))
        .expect("valid response"))
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path, description = "sandbox id"), WriteQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = EntryInfo), (status = 400, body = ErrorResponse), (status = 413, body = ErrorResponse)))]
pub async fn write_file(
    State(rt): State<AppState>,
    P(id): P<String>,
    Q(q): Q<WriteQuery>,
    body: Body,
) -> ApiResult<Json<EntryInfo>> {
    write_in(rt, FsOf::Sandbox(id), q, body).await
}

async fn write_in(rt: AppState, of: FsOf, q: WriteQuery, body: Body) -> ApiResult<Json<EntryInfo>> {
    use tokio::io::AsyncWriteExt;
    let path = SbPath::parse(&q.path)?;
    let mode = match q.mode.as_deref() {
        None => None,
        Some(m) => Some(
            u32::from_str_radix(m.trim_start_matches("0o"), 8)
                .ok()
                .filter(|m| *m <= 0o7777)
                .ok_or_else(|| ApiError::bad_request(format!("mode {m:?} is not an octal file mode such as 0644")))?,
        ),
    };
    let limit = rt.cfg.max_file_bytes;
    // A volume with a quota takes what still fits.
    let room = match &of {
        FsOf::Volume(vid) => rt.volume_room(vid).await?,
        FsOf::Sandbox(_) => None,
    };
    let fs = std::sync::Arc::new(of.open_as(&rt, true, q.user.as_deref()).await?);
    let fs2 = fs.clone();
    let mut upload = blocking(move || fs2.begin_write(&path, mode)).await?;
    let mut file = tokio::fs::File::from_std(upload.take_file());
    let mut stream = body.into_data_stream();
    let mut written: u64 = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("upload interrupted: {e}")))?;
        written += chunk.len() as u64;
        if let Some(room) = room.filter(|r| written > *r) {
            return Err(ApiError::new(
                StatusCode::INSUFFICIENT_STORAGE,
                "quota_exceeded",
                format!("the volume has room for {room} more bytes under its quota (quota_mb): delete files or fork it with a larger quota; the previous content is unchanged"),
            ));
        }
        if written > limit {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                format!("file is larger than the daemon's limit of {limit} bytes (--max-file-bytes); the previous content is unchanged"),
            ));
        }
        file.write_all(&chunk).await.map_err(bb_runtime::RuntimeError::io("write the upload"))?;
    }
    file.flush().await.map_err(bb_runtime::RuntimeError::io("write the upload"))?;
    upload.put_file(file.into_std().await);
    Ok(Json(blocking(move || fs.commit(upload)).await?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path, description = "sandbox id"), RemoveQuery),
    responses((status = 200, body = Done), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn remove_file(State(rt): State<AppState>, P(id): P<String>, Q(q): Q<RemoveQuery>) -> ApiResult<Json<Done>> {
    remove_in(rt, FsOf::Sandbox(id), q).await
}

async fn remove_in(rt: AppState, of: FsOf, q: RemoveQuery) -> ApiResult<Json<Done>> {
    let path = SbPath::parse(&q.path)?;
    let fs = of.open(&rt, true).await?;
    blocking(move || fs.remove(&path, q.recursive.unwrap_or(false))).await?;
    Ok(removed())
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", params(("id" = String, Path, description = "sandbox id"), ListQuery),
    responses((status = 200, body = EntryList), (status = 404, body = ErrorResponse)))]
pub async fn list_files(
    State(rt): State<AppState>,
    P(id): P<String>,
    Q(q): Q<ListQuery>,
) -> ApiResult<Json<EntryList>> {
    list_in(rt, FsOf::Sandbox(id), q).await
}

async fn list_in(rt: AppState, of: FsOf, q: ListQuery) -> ApiResult<Json<EntryList>> {
    let path = SbPath::parse(&q.path)?;
    let fs = of.open(&rt, false).await?;
    let depth = q.depth.unwrap_or(1);
    if depth > 64 {
        return Err(ApiError::bad_request("depth must be at most 64"));
    }
    Ok(Json(EntryList { entries: blocking(move || fs.list(&path, depth)).await? }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", params(("id" = String, Path, description = "sandbox id"), PathQuery),
    responses((status = 200, body = EntryInfo), (status = 404, body = ErrorResponse)))]
pub async fn stat_file(State(rt): State<AppState>, P(id): P<String>, Q(q): Q<PathQuery>) -> ApiResult<Json<EntryInfo>> {
    stat_in(rt, FsOf::Sandbox(id), q).await
}

async fn stat_in(rt: AppState, of: FsOf, q: PathQuery) -> ApiResult<Json<EntryInfo>> {
    let path = SbPath::parse(&q.path)?;
    let fs = of.open(&rt, false).await?;
    Ok(Json(blocking(move || fs.stat(&path)).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", params(("id" = String, Path, description = "sandbox id")), request_body = MakeDir,
    responses((status = 200, body = EntryInfo), (status = 409, body = ErrorResponse)))]
pub async fn make_dir(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<MakeDir>,
) -> ApiResult<Json<EntryInfo>> {
    mkdir_in(rt, FsOf::Sandbox(id), req).await
}

async fn mkdir_in(rt: AppState, of: FsOf, req: MakeDir) -> ApiResult<Json<EntryInfo>> {
    let path = SbPath::parse(&req.path)?;
    let fs = of.open_as(&rt, true, req.user.as_deref()).await?;
    Ok(Json(blocking(move || fs.mkdir(&path, req.parents)).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/rename", params(("id" = String, Path, description = "sandbox id")), request_body = Rename,
    responses((status = 200, body = EntryInfo), (status = 404, body = ErrorResponse)))]
pub async fn rename_file(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<Rename>,
) -> ApiResult<Json<EntryInfo>> {
    rename_in(rt, FsOf::Sandbox(id), req).await
}

async fn rename_in(rt: AppState, of: FsOf, req: Rename) -> ApiResult<Json<EntryInfo>> {
    let (from, to) = (SbPath::parse(&req.from)?, SbPath::parse(&req.to)?);
    let fs = of.open(&rt, true).await?;
    Ok(Json(blocking(move || fs.rename(&from, &to)).await?))
}

#[utoipa::path(get, path = "/v1/images", responses((status = 200, body = ImageList)))]
pub async fn list_images(State(rt): State<AppState>) -> ApiResult<Json<ImageList>> {
    let rt2 = rt.clone();
    Ok(Json(blocking(move || rt2.list_images()).await?))
}

#[utoipa::path(post, path = "/v1/images/build", request_body = BuildImage,
    responses((status = 200, description = "NDJSON stream of ProgressEvent", body = ProgressEvent, content_type = "application/x-ndjson")))]
pub async fn build_image(State(rt): State<AppState>, JsonBody(req): JsonBody<BuildImage>) -> ApiResult<Response> {
    let mut opts = bb_runtime::BaseImageOpts::default();
    if let Some(s) = req.suite {
        opts.suite = s;
    }
    if let Some(p) = req.packages {
        opts.packages = p;
    }
    if let Some(m) = req.mirror {
        opts.mirror = m;
    }
    Ok(ndjson(rt.image_job(req.name.unwrap_or_else(|| "base".into()), ImageSource::Debootstrap(opts))))
}

#[utoipa::path(post, path = "/v1/images/import", request_body = ImportImage,
    responses((status = 200, description = "NDJSON stream of ProgressEvent", body = ProgressEvent, content_type = "application/x-ndjson")))]
pub async fn import_image(State(rt): State<AppState>, JsonBody(req): JsonBody<ImportImage>) -> ApiResult<Response> {
    let path = std::path::PathBuf::from(&req.path);
    if !path.is_absolute() {
        return Err(ApiError::bad_request(format!("path {:?} must be absolute (it is read by the daemon)", req.path)));
    }
    Ok(ndjson(rt.image_job(req.name, ImageSource::Path(path))))
}

#[utoipa::path(delete, path = "/v1/images/{name}", params(("name" = String, Path, description = "image name")),
    responses((status = 200, body = Done), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn remove_image(State(rt): State<AppState>, P(name): P<String>) -> ApiResult<Json<Done>> {
    let rt2 = rt.clone();
    blocking(move || rt2.remove_image(&name)).await?;
    Ok(removed())
}

// ---- snapshots ----

#[utoipa::path(post, path = "/v1/sandboxes/{id}/checkpoint", params(("id" = String, Path, description = "sandbox id")),
    request_body = CheckpointRequest, responses((status = 201, body = SnapshotInfo), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn checkpoint(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<CheckpointRequest>,
) -> ApiResult<(StatusCode, Json<SnapshotInfo>)> {
    Ok((StatusCode::CREATED, Json(rt.checkpoint(&id, req).await?)))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/rollback", params(("id" = String, Path, description = "sandbox id")),
    request_body = RollbackRequest, responses((status = 200, body = RollbackResult), (status = 404, body = ErrorResponse)))]
pub async fn rollback(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<RollbackRequest>,
) -> ApiResult<Json<RollbackResult>> {
    Ok(Json(rt.rollback(&id, req).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", params(("id" = String, Path, description = "sandbox id")),
    request_body = ForkRequest, responses((status = 201, body = ForkResult), (status = 400, body = ErrorResponse), (status = 503, body = ErrorResponse)))]
pub async fn fork(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<ForkRequest>,
) -> ApiResult<(StatusCode, Json<ForkResult>)> {
    Ok((StatusCode::CREATED, Json(rt.fork(&id, req).await?)))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/evaluate", params(("id" = String, Path, description = "sandbox id")),
    request_body = RunCommand, responses((status = 200, body = CommandResult), (status = 400, body = ErrorResponse)))]
pub async fn evaluate(
    State(rt): State<AppState>,
    P(id): P<String>,
    JsonBody(req): JsonBody<RunCommand>,
) -> ApiResult<Json<CommandResult>> {
    Ok(Json(rt.evaluate(&id, req).await?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/snapshots", params(("id" = String, Path, description = "sandbox id")),
    responses((status = 200, body = SnapshotList), (status = 404, body = ErrorResponse)))]
pub async fn sandbox_snapshots(State(rt): State<AppState>, P(id): P<String>) -> ApiResult<Json<SnapshotList>> {
    Ok(Json(rt.list_snapshots(Some(&id))?))
}

#[utoipa::path(get, path = "/v1/snapshots", responses((status = 200, body = SnapshotList)))]
pub async fn list_snapshots(State(rt): State<AppState>) -> ApiResult<Json<SnapshotList>> {
    Ok(Json(rt.list_snapshots(None)?))
}

#[utoipa::path(get, path = "/v1/snapshots/{sid}", params(("sid" = String, Path, description = "snapshot id")),
    responses((status = 200, body = SnapshotInfo), (status = 404, body = ErrorResponse)))]
pub async fn get_snapshot(State(rt): State<AppState>, P(sid): P<String>) -> ApiResult<Json<SnapshotInfo>> {
    Ok(Json(rt.snapshot(&sid)?))
}

#[derive(Deserialize, IntoParams)]
pub struct DeleteSnapshotQuery {
    /// Also delete every descendant.
    pub subtree: Option<bool>,
}

#[utoipa::path(delete, path = "/v1/snapshots/{sid}", params(("sid" = String, Path, description = "snapshot id"), DeleteSnapshotQuery),
    responses((status = 200, body = Done), (status = 404, body = ErrorResponse)))]
pub async fn delete_snapshot(
    State(rt): State<AppState>,
    P(sid): P<String>,
    Q(q): Q<DeleteSnapshotQuery>,
) -> ApiResult<Json<Done>> {
    rt.delete_snapshot(&sid, q.subtree.unwrap_or(false)).await?;
    Ok(removed())
}

#[utoipa::path(post, path = "/v1/snapshots/{sid}/offload", params(("sid" = String, Path, description = "snapshot id")),
    responses((status = 200, body = OffloadResult), (status = 404, body = ErrorResponse),
    (status = 503, description = "CRIU is not available", body = ErrorResponse)))]
pub async fn offload_snapshot(State(rt): State<AppState>, P(sid): P<String>) -> ApiResult<Json<OffloadResult>> {
    Ok(Json(rt.offload_snapshot(&sid).await?))
}

#[utoipa::path(post, path = "/v1/snapshots/{sid}/push", params(("sid" = String, Path, description = "snapshot id")),
    responses((status = 200, description = "durable: in the object store and the metadata store", body = PushResult),
    (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse),
    (status = 503, description = "the object store or metadata store is unreachable (the local snapshot is intact; push again)", body = ErrorResponse)))]
pub async fn push_snapshot(State(rt): State<AppState>, P(sid): P<String>) -> ApiResult<Json<PushResult>> {
    Ok(Json(rt.push_snapshot(&sid).await?))
}

#[utoipa::path(post, path = "/v1/snapshots/{sid}/pull", params(("sid" = String, Path, description = "snapshot id")),
    responses((status = 200, body = PullResult), (status = 404, body = ErrorResponse),
    (status = 503, description = "the object store or metadata store is unreachable", body = ErrorResponse)))]
pub async fn pull_snapshot(State(rt): State<AppState>, P(sid): P<String>) -> ApiResult<Json<PullResult>> {
    Ok(Json(rt.pull_snapshot(&sid).await?))
}

#[utoipa::path(get, path = "/v1/remote/snapshots", responses((status = 200, body = RemoteSnapshotList),
    (status = 503, description = "the metadata store is unreachable", body = ErrorResponse)))]
pub async fn list_remote_snapshots(State(rt): State<AppState>) -> ApiResult<Json<RemoteSnapshotList>> {
    Ok(Json(rt.list_remote().await?))
}

#[utoipa::path(delete, path = "/v1/remote/snapshots/{sid}", params(("sid" = String, Path, description = "snapshot id")),
    responses((status = 200, description = "its record is gone; its objects go with the next `POST /v1/remote/gc`", body = Done),
    (status = 404, body = ErrorResponse), (status = 503, body = ErrorResponse)))]
pub async fn delete_remote_snapshot(State(rt): State<AppState>, P(sid): P<String>) -> ApiResult<Json<Done>> {
    rt.delete_remote(&sid).await?;
    Ok(removed())
}

#[utoipa::path(post, path = "/v1/remote/gc", request_body = StoreGcRequest,
    responses((status = 200, body = StoreGcResult), (status = 409, description = "a push or collection is under way", body = ErrorResponse),
    (status = 503, body = ErrorResponse)))]
pub async fn store_gc(
    State(rt): State<AppState>,
    JsonBody(req): JsonBody<StoreGcRequest>,
) -> ApiResult<Json<StoreGcResult>> {
    Ok(Json(rt.store_gc(req).await?))
}

#[utoipa::path(post, path = "/v1/snapshots/gc", request_body = GcRequest, responses((status = 200, body = GcResult), (status = 404, body = ErrorResponse)))]
pub async fn gc_snapshots(State(rt): State<AppState>, JsonBody(req): JsonBody<GcRequest>) -> ApiResult<Json<GcResult>> {
    Ok(Json(rt.gc(req).await?))
}

#[utoipa::path(get, path = "/v1/pool", responses((status = 200, body = PoolStats)))]
pub async fn get_pool(State(rt): State<AppState>) -> Json<PoolStats> {
    Json(rt.pool_stats())
}

#[utoipa::path(put, path = "/v1/pool/{image}", params(("image" = String, Path, description = "image name")), request_body = SetPool,
    responses((status = 200, body = PoolStats), (status = 400, body = ErrorResponse), (status = 404, body = ErrorResponse)))]
pub async fn set_pool(
    State(rt): State<AppState>,
    P(image): P<String>,
    JsonBody(req): JsonBody<SetPool>,
) -> ApiResult<Json<PoolStats>> {
    let target = bb_runtime::pool::Target { min: req.min, max: req.max.unwrap_or(req.min) };
    Ok(Json(rt.set_pool(&image, target)?))
}

#[utoipa::path(post, path = "/v1/templates", request_body = BuildTemplate,
    responses((status = 200, description = "NDJSON stream of TemplateEvent", body = TemplateEvent, content_type = "application/x-ndjson"),
        (status = 400, description = "invalid recipe (name, settings)", body = ErrorResponse), (status = 404, description = "unknown image", body = ErrorResponse),
        (status = 503, description = "the daemon's sandbox limit is reached", body = ErrorResponse)))]
pub async fn build_template(State(rt): State<AppState>, JsonBody(req): JsonBody<BuildTemplate>) -> ApiResult<Response> {
    Ok(ndjson(rt.build_template(req)?))
}

#[utoipa::path(get, path = "/v1/templates", responses((status = 200, body = TemplateList)))]
pub async fn list_templates(State(rt): State<AppState>) -> ApiResult<Json<TemplateList>> {
    Ok(Json(rt.list_templates()?))
}

#[utoipa::path(get, path = "/v1/templates/{name}", params(("name" = String, Path, description = "template name")),
    responses((status = 200, body = TemplateInfo), (status = 404, body = ErrorResponse)))]
pub async fn get_template(State(rt): State<AppState>, P(name): P<String>) -> ApiResult<Json<TemplateInfo>> {
    Ok(Json(rt.template(&name)?))
}

#[utoipa::path(delete, path = "/v1/templates/{name}", params(("name" = String, Path, description = "template name")),
    responses((status = 200, body = Done), (status = 404, body = ErrorResponse)))]
pub async fn remove_template(State(rt): State<AppState>, P(name): P<String>) -> ApiResult<Json<Done>> {
    rt.remove_template(&name).await?;
    Ok(removed())
}

// --- volumes ---

#[utoipa::path(post, path = "/v1/volumes", request_body = CreateVolume,
    responses((status = 200, body = VolumeInfo), (status = 400, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn create_volume(
    State(rt): State<AppState>,
    JsonBody(req): JsonBody<CreateVolume>,
) -> ApiResult<Json<VolumeInfo>> {
    Ok(Json(rt.create_volume(req).await?))
}

#[utoipa::path(get, path = "/v1/volumes", responses((status = 200, body = VolumeList)))]
pub async fn list_volumes(State(rt): State<AppState>) -> ApiResult<Json<VolumeList>> {
    let rt2 = rt.clone();
    Ok(Json(blocking(move || rt2.list_volumes()).await?))
}

#[utoipa::path(get, path = "/v1/volumes/{vid}", params(("vid" = String, Path, description = "volume id or name")),
    responses((status = 200, body = VolumeInfo), (status = 404, body = ErrorResponse)))]
pub async fn get_volume(State(rt): State<AppState>, P(vid): P<String>) -> ApiResult<Json<VolumeInfo>> {
    Ok(Json(rt.volume_info(&vid).await?))
}

#[utoipa::path(delete, path = "/v1/volumes/{vid}", params(("vid" = String, Path, description = "volume id or name")),
    responses((status = 200, body = Done), (status = 404, body = ErrorResponse),
    (status = 409, description = "a sandbox mounts it", body = ErrorResponse)))]
pub async fn delete_volume(State(rt): State<AppState>, P(vid): P<String>) -> ApiResult<Json<Done>> {
    rt.delete_volume(&vid).await?;
    Ok(removed())
}

#[utoipa::path(post, path = "/v1/volumes/{vid}/snapshots", params(("vid" = String, Path, description = "volume id or name")),
    request_body = VolumeSnapshotRequest,
    responses((status = 200, description = "node-local (sync the volume to make it durable)", body = VolumeSnapshotInfo),
    (status = 404, body = ErrorResponse)))]
pub async fn snapshot_volume(
    State(rt): State<AppState>,
    P(vid): P<String>,
    JsonBody(req): JsonBody<VolumeSnapshotRequest>,
) -> ApiResult<Json<VolumeSnapshotInfo>> {
    Ok(Json(rt.snapshot_volume(&vid, req).await?))
}

#[utoipa::path(get, path = "/v1/volumes/{vid}/snapshots", params(("vid" = String, Path, description = "volume id or name")),
    responses((status = 200, body = VolumeSnapshotList), (status = 404, body = ErrorResponse)))]
pub async fn list_volume_snapshots(
    State(rt): State<AppState>,
    P(vid): P<String>,
) -> ApiResult<Json<VolumeSnapshotList>> {
    Ok(Json(rt.volume_snapshots(&vid).await?))
}

#[utoipa::path(delete, path = "/v1/volumes/{vid}/snapshots/{vsid}",
    params(("vid" = String, Path, description = "volume id or name"), ("vsid" = String, Path, description = "volume snapshot id")),
    responses((status = 200, body = Done), (status = 404, body = ErrorResponse)))]
pub async fn delete_volume_snapshot(
    State(rt): State<AppState>,
    P((vid, vsid)): P<(String, String)>,
) -> ApiResult<Json<Done>> {
    rt.delete_volume_snapshot(&vid, &vsid).await?;
    Ok(removed())
}

#[utoipa::path(post, path = "/v1/volumes/{vid}/restore", params(("vid" = String, Path, description = "volume id or name")),
    request_body = RestoreVolume,
    responses((status = 200, body = VolumeInfo), (status = 404, body = ErrorResponse),
    (status = 409, description = "a sandbox mounts it", body = ErrorResponse)))]
pub async fn restore_volume(
    State(rt): State<AppState>,
    P(vid): P<String>,
    JsonBody(req): JsonBody<RestoreVolume>,
) -> ApiResult<Json<VolumeInfo>> {
    Ok(Json(rt.restore_volume(&vid, req).await?))
}

#[utoipa::path(post, path = "/v1/volumes/{vid}/fork", params(("vid" = String, Path, description = "volume id or name")),
    request_body = ForkVolume,
    responses((status = 200, description = "the new volume", body = VolumeInfo), (status = 404, body = ErrorResponse)))]
pub async fn fork_volume(
    State(rt): State<AppState>,
    P(vid): P<String>,
    JsonBody(req): JsonBody<ForkVolume>,
) -> ApiResult<Json<VolumeInfo>> {
    Ok(Json(rt.fork_volume(&vid, req).await?))
}

#[utoipa::path(post, path = "/v1/volumes/{vid}/sync", params(("vid" = String, Path, description = "volume id or name")),
    responses((status = 200, description = "durable: in the object store, head committed in the metadata store", body = VolumeInfo),
    (status = 404, body = ErrorResponse), (status = 409, description = "another daemon committed the volume", body = ErrorResponse),
    (status = 503, description = "the object store or metadata store is unreachable (nothing is lost: sync again)", body = ErrorResponse)))]
pub async fn sync_volume(State(rt): State<AppState>, P(vid): P<String>) -> ApiResult<Json<VolumeInfo>> {
    Ok(Json(rt.sync_volume(&vid).await?))
}

#[utoipa::path(get, path = "/v1/volumes/{vid}/files", params(("vid" = String, Path, description = "volume id or name"), PathQuery),
    responses((status = 200, description = "file content", content_type = "application/octet-stream", body = Vec<u8>),
    (status = 400, body = ErrorResponse), (status = 404, body = ErrorResponse)))]
pub async fn volume_read_file(
    State(rt): State<AppState>,
    P(vid): P<String>,
    Q(q): Q<PathQuery>,
) -> ApiResult<Response> {
    read_in(rt, FsOf::Volume(vid), q).await
}

#[utoipa::path(put, path = "/v1/volumes/{vid}/files", params(("vid" = String, Path, description = "volume id or name"), WriteQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = EntryInfo), (status = 400, body = ErrorResponse), (status = 409, body = ErrorResponse), (status = 413, body = ErrorResponse)))]
pub async fn volume_write_file(
    State(rt): State<AppState>,
    P(vid): P<String>,
    Q(q): Q<WriteQuery>,
    body: Body,
) -> ApiResult<Json<EntryInfo>> {
    write_in(rt, FsOf::Volume(vid), q, body).await
}

#[utoipa::path(delete, path = "/v1/volumes/{vid}/files", params(("vid" = String, Path, description = "volume id or name"), RemoveQuery),
    responses((status = 200, body = Done), (status = 404, body = ErrorResponse)))]
pub async fn volume_remove_file(
    State(rt): State<AppState>,
    P(vid): P<String>,
    Q(q): Q<RemoveQuery>,
) -> ApiResult<Json<Done>> {
    remove_in(rt, FsOf::Volume(vid), q).await
}

#[utoipa::path(get, path = "/v1/volumes/{vid}/files/list", params(("vid" = String, Path, description = "volume id or name"), ListQuery),
    responses((status = 200, body = EntryList), (status = 404, body = ErrorResponse)))]
pub async fn volume_list_files(
    State(rt): State<AppState>,
    P(vid): P<String>,
    Q(q): Q<ListQuery>,
) -> ApiResult<Json<EntryList>> {
    list_in(rt, FsOf::Volume(vid), q).await
}

#[utoipa::path(get, path = "/v1/volumes/{vid}/files/stat", params(("vid" = String, Path, description = "volume id or name"), PathQuery),
    responses((status = 200, body = EntryInfo), (status = 404, body = ErrorResponse)))]
pub async fn volume_stat_file(
    State(rt): State<AppState>,
    P(vid): P<String>,
    Q(q): Q<PathQuery>,
) -> ApiResult<Json<EntryInfo>> {
    stat_in(rt, FsOf::Volume(vid), q).await
}

#[utoipa::path(post, path = "/v1/volumes/{vid}/files/mkdir", params(("vid" = String, Path, description = "volume id or name")), request_body = MakeDir,
    responses((status = 200, body = EntryInfo), (status = 409, body = ErrorResponse)))]
pub async fn volume_make_dir(
    State(rt): State<AppState>,
    P(vid): P<String>,
    JsonBody(req): JsonBody<MakeDir>,
) -> ApiResult<Json<EntryInfo>> {
    mkdir_in(rt, FsOf::Volume(vid), req).await
}

#[utoipa::path(post, path = "/v1/volumes/{vid}/files/rename", params(("vid" = String, Path, description = "volume id or name")), request_body = Rename,
    responses((status = 200, body = EntryInfo), (status = 404, body = ErrorResponse)))]
pub async fn volume_rename_file(
    State(rt): State<AppState>,
    P(vid): P<String>,
    JsonBody(req): JsonBody<Rename>,
) -> ApiResult<Json<EntryInfo>> {
    rename_in(rt, FsOf::Volume(vid), req).await
}
