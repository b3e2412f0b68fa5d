//! E2B's volumes on branchbox volumes: the control plane's `/volumes` (create, list, get,
//! delete; `X-API-KEY`) and the volume content API the SDK's `Volume` reaches at
//! `E2B_VOLUME_API_URL` (`/volumecontent/{volumeID}/...`, `Authorization: Bearer` the volume's
//! token). A volume's `volumeID` is branchbox's id (`vol-...`) and its name branchbox's name, the
//! one a create's `volume_mounts` names; its root is 0777 (owned by 9090:9090), so the
//! sandbox's `user` writes into it. The content API does what E2B's volume service does:
//! new files are 0666 and new directories 0777, owned by 9090:9090 unless `uid`/`gid`/`mode`
//! say otherwise; a write without `force` only creates a new file (409 if it exists, 404 if its
//! directory does not), with `force` it overwrites and creates missing parents.

use crate::error::{E2bError, E2bResult};
use crate::{same, E2b};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bb_runtime::model::{Access, CreateVolume, EntryInfo};
use bb_runtime::sandbox::files::{SandboxFs, SbPath};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

type St = State<Arc<E2b>>;

/// Owner and group of what the content API creates unless told (E2B's volume service's).
pub const DEFAULT_OWNER: u32 = 9090;
/// Modes of new files and directories unless told (E2B's, not reduced by a umask).
pub const DEFAULT_FILE_MODE: u32 = 0o666;
pub const DEFAULT_DIR_MODE: u32 = 0o777;
/// Deepest directory listing (E2B's limit).
pub const MAX_DEPTH: u32 = 10;

/// A volume's content token: derived from the API key and the volume's id, as a sandbox's
/// access token is (any holder of the key can tell it, nobody else can; it survives restarts).
pub fn volume_token(api_key: &str, volume_id: &str) -> String {
    crate::derived_token(b"branchbox-e2b-volume", api_key, volume_id)
}

// ------------------------------------------------------------------ the control plane

#[derive(Deserialize, Default)]
struct NewVolume {
    name: Option<String>,
}

fn with_token(e: &E2b, id: &str, name: Option<&str>) -> Value {
    json!({"volumeID": id, "name": name.unwrap_or(id), "token": volume_token(&e.cfg.api_key, id)})
}

/// `POST /volumes {"name"}`: 201 with the volume and its token.
pub async fn create(State(e): St, bytes: Bytes) -> E2bResult<Response> {
    let req: NewVolume = crate::control::body(&bytes)?;
    let Some(name) = req.name.filter(|n| !n.is_empty()) else {
        return Err(E2bError::bad_request("give the volume a name: {\"name\": \"my-data\"}"));
    };
    // Shared as E2B's are: any number of sandboxes mount it read-write at once (`rwx`).
    let made = e.rt.create_volume(CreateVolume { name: Some(name.clone()), access: Access::Rwx, ..Default::default() });
    let info = match made.await {
        Ok(info) => info,
        // E2B answers a taken name with a 400.
        Err(err) if err.kind() == bb_runtime::error::ErrorKind::Conflict => {
            return Err(E2bError::bad_request(format!("Volume with name '{name}' already exists")))
        }
        Err(err) => return Err(err.into()),
    };
    // The root is writable by everyone (owned by the content API's default owner), so a
    // sandbox's `user` writes into the volume as E2B's do.
    let opened = e.rt.volume_fs(&info.id, true).await;
    let prepared = match opened {
        Ok(fs) => {
            let root = SbPath::parse("/")?;
            blocking(move || {
                fs.chmod(&root, DEFAULT_DIR_MODE)?;
                fs.chown(&root, Some(DEFAULT_OWNER), Some(DEFAULT_OWNER))
            })
            .await
        }
        Err(err) => Err(err.into()),
    };
    if let Err(err) = prepared {
        if let Err(gone) = e.rt.delete_volume(&info.id).await {
            tracing::warn!(volume = %info.id, "removing a volume whose root could not be prepared: {gone}");
        }
        return Err(err);
    }
    Ok((StatusCode::CREATED, Json(with_token(&e, &info.id, info.name.as_deref()))).into_response())
}

/// `GET /volumes`: every volume (E2B does not page them).
pub async fn list(State(e): St) -> E2bResult<Json<Value>> {
    let v: Vec<Value> =
        e.rt.volume_names()?
            .into_iter()
            .map(|(id, name)| json!({"name": name.unwrap_or_else(|| id.clone()), "volumeID": id}))
            .collect();
    Ok(Json(Value::Array(v)))
}

fn unknown(vid: &str) -> E2bError {
    E2bError::not_found(format!("volume {vid:?} not found: create it with Volume.create(name)"))
}

/// Volume `vid`'s id, a 404 in E2B's shape for an unknown one.
async fn id_of(e: &E2b, vid: &str) -> E2bResult<String> {
    e.rt.volume_id(vid).await.map_err(|err| match err.kind() {
        bb_runtime::error::ErrorKind::NotFound => unknown(vid),
        _ => err.into(),
    })
}

/// `GET /volumes/{volumeID}`: the volume and its token.
pub async fn get_one(State(e): St, Path(vid): Path<String>) -> E2bResult<Json<Value>> {
    let info = e.rt.volume_info(&vid).await.map_err(|err| match err.kind() {
        bb_runtime::error::ErrorKind::NotFound => unknown(&vid),
        _ => err.into(),
    })?;
    Ok(Json(with_token(&e, &info.id, info.name.as_deref())))
}

/// `DELETE /volumes/{volumeID}`: 204 (409 while a sandbox mounts it).
pub async fn delete(State(e): St, Path(vid): Path<String>) -> E2bResult<StatusCode> {
    let id = id_of(&e, &vid).await?;
    e.rt.delete_volume(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ------------------------------------------------------------------ the content API

/// The content API's routes (reached without the control plane's `X-API-KEY`: each request
/// carries its volume's token).
pub fn content_router(e: Arc<E2b>) -> Router {
    Router::new()
        .route("/volumecontent/:vid/path", get(stat).patch(update).delete(remove))
        .route("/volumecontent/:vid/dir", get(list_dir).post(make_dir))
        .route("/volumecontent/:vid/file", get(read).put(write))
        .fallback(|uri: Uri| async move {
            E2bError::not_found(format!("no route {} in the volume content API", uri.path()))
        })
        .with_state(e)
}

/// A content request's query (which fields count depends on the call).
#[derive(Deserialize, Default)]
struct ContentQuery {
    #[serde(default)]
    path: String,
    depth: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: Option<bool>,
}

fn query(uri: &Uri) -> E2bResult<(ContentQuery, SbPath)> {
    let q = axum::extract::Query::<ContentQuery>::try_from_uri(uri)
        .map_err(|err| E2bError::bad_request(format!("bad query: {}", err.body_text())))?
        .0;
    if q.path.is_empty() {
        return Err(E2bError::bad_request("give a path in the volume: ?path=/dir/file.txt"));
    }
    if q.mode.is_some_and(|m| m > 0o7777) {
        return Err(E2bError::bad_request("mode is a file mode: at most 0o7777 (4095)"));
    }
    let path = SbPath::parse(&q.path)?;
    Ok((q, path))
}

/// The id of the volume a content request names, once its bearer token is checked.
async fn authorized(e: &E2b, vid: &str, headers: &HeaderMap) -> E2bResult<String> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let id = id_of(e, vid).await?;
    if !same(given, &volume_token(&e.cfg.api_key, &id)) {
        return Err(E2bError::Status(
            StatusCode::UNAUTHORIZED,
            "missing or wrong volume token (Authorization: Bearer): use the token Volume.create or Volume.connect \
             answered"
                .into(),
        ));
    }
    Ok(id)
}

/// The volume's files, checked and opened (`write`: the request changes them).
async fn open(e: &E2b, vid: &str, headers: &HeaderMap, write: bool) -> E2bResult<(String, SandboxFs)> {
    let id = authorized(e, vid, headers).await?;
    let fs = e.rt.volume_fs(&id, write).await?;
    Ok((id, fs))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> bb_runtime::Result<T> + Send + 'static) -> E2bResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|err| E2bError::Status(StatusCode::INTERNAL_SERVER_ERROR, format!("volume file task: {err}")))?
        .map_err(E2bError::from)
}

/// E2B's `VolumeEntryStat` of an entry.
pub fn entry_stat(en: &EntryInfo) -> Value {
    let kind = match en.kind.as_str() {
        "file" => "file",
        "dir" => "directory",
        "symlink" => "symlink",
        _ => "unknown",
    };
    let mut v = json!({
        "name": en.name,
        "type": kind,
        "path": en.path,
        "size": en.size,
        "mode": en.mode & 0o777,
        "uid": en.uid,
        "gid": en.gid,
        "atime": crate::envd::rfc3339(en.atime),
        "mtime": crate::envd::rfc3339(en.mtime),
        "ctime": crate::envd::rfc3339(en.ctime),
    });
    if let Some(t) = &en.symlink_target {
        v["target"] = json!(t);
    }
    v
}

/// `GET /volumecontent/{id}/path?path=`: an entry's stat.
async fn stat(State(e): St, Path(vid): Path<String>, uri: Uri, headers: HeaderMap) -> E2bResult<Json<Value>> {
    let (_, path) = query(&uri)?;
    let (_, fs) = open(&e, &vid, &headers, false).await?;
    Ok(Json(entry_stat(&blocking(move || fs.stat(&path)).await?)))
}

/// `GET /volumecontent/{id}/dir?path=&depth=`: a directory's entries, `depth` levels down (1 to
/// [`MAX_DEPTH`]), sorted by path.
async fn list_dir(State(e): St, Path(vid): Path<String>, uri: Uri, headers: HeaderMap) -> E2bResult<Json<Value>> {
    let (q, path) = query(&uri)?;
    let depth = q.depth.unwrap_or(1).max(1);
    if depth > MAX_DEPTH {
        return Err(E2bError::bad_request(format!("depth must be between 1 and {MAX_DEPTH}")));
    }
    let (_, fs) = open(&e, &vid, &headers, false).await?;
    let entries = blocking(move || fs.list(&path, depth)).await?;
    Ok(Json(Value::Array(entries.iter().map(entry_stat).collect())))
}

/// Whether `path`'s directory exists (a write or make_dir without `force` creates no parents).
fn parent_exists(fs: &SandboxFs, path: &SbPath) -> bb_runtime::Result<()> {
    let parent = fs.stat(&path.parent())?;
    if parent.kind != "dir" {
        return Err(bb_runtime::RuntimeError::BadRequest(format!(
            "{} is not a directory: a component of the path is a file",
            parent.path
        )));
    }
    Ok(())
}

/// `POST /volumecontent/{id}/dir?path=&uid=&gid=&mode=&force=`: 201 with the new directory;
/// `force` creates parents and takes an existing directory as it is.
async fn make_dir(State(e): St, Path(vid): Path<String>, uri: Uri, headers: HeaderMap) -> E2bResult<Response> {
    let (q, path) = query(&uri)?;
    let (_, fs) = open(&e, &vid, &headers, true).await?;
    let fs = fs
        .owned_by_ids(q.uid.unwrap_or(DEFAULT_OWNER), q.gid.unwrap_or(DEFAULT_OWNER))?
        .with_dir_mode(q.mode.unwrap_or(DEFAULT_DIR_MODE));
    let force = q.force.unwrap_or(false);
    let en = blocking(move || {
        match fs.stat(&path) {
            Ok(en) if en.kind != "dir" || !force => {
                return Err(bb_runtime::RuntimeError::Conflict(format!("{} exists", en.path)))
            }
            _ => {}
        }
        fs.mkdir(&path, force)
    })
    .await?;
    Ok((StatusCode::CREATED, Json(entry_stat(&en))).into_response())
}

/// `DELETE /volumecontent/{id}/path?path=`: a file, or a directory with all it holds.
async fn remove(State(e): St, Path(vid): Path<String>, uri: Uri, headers: HeaderMap) -> E2bResult<StatusCode> {
    let (_, path) = query(&uri)?;
    if path.is_root() {
        return Err(E2bError::bad_request("cannot delete the volume's root: remove what it holds instead"));
    }
    let (_, fs) = open(&e, &vid, &headers, true).await?;
    blocking(move || fs.remove(&path, true)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Attrs {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

/// `PATCH /volumecontent/{id}/path?path=` `{"uid", "gid", "mode"}` (each optional): the entry
/// after the change.
async fn update(
    State(e): St,
    Path(vid): Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> E2bResult<Json<Value>> {
    let (_, path) = query(&uri)?;
    let attrs: Attrs = crate::control::body(&body)?;
    let (_, fs) = open(&e, &vid, &headers, true).await?;
    let en = blocking(move || {
        let mut en = fs.stat(&path)?;
        if let Some(mode) = attrs.mode {
            en = fs.chmod(&path, mode)?;
        }
        if attrs.uid.is_some() || attrs.gid.is_some() {
            en = fs.chown(&path, attrs.uid, attrs.gid)?;
        }
        Ok(en)
    })
    .await?;
    Ok(Json(entry_stat(&en)))
}

/// `GET /volumecontent/{id}/file?path=`: the file's bytes.
async fn read(State(e): St, Path(vid): Path<String>, uri: Uri, headers: HeaderMap) -> E2bResult<Response> {
    let (_, path) = query(&uri)?;
    let (_, fs) = open(&e, &vid, &headers, false).await?;
    let (file, size) = blocking(move || fs.open_read(&path)).await?;
    Ok(crate::envd::octet_stream(file, size))
}

/// `PUT /volumecontent/{id}/file?path=&uid=&gid=&mode=&force=` (the bytes as the body): 201
/// with the file. The previous content stays whole until the new one is complete.
async fn write(State(e): St, Path(vid): Path<String>, uri: Uri, headers: HeaderMap, body: Body) -> Response {
    match write_file(&e, &vid, &uri, &headers, body).await {
        Ok(en) => (StatusCode::CREATED, Json(entry_stat(&en))).into_response(),
        Err((err, Some(body))) => {
            // Read what the client sends before answering, so its connection stays usable.
            crate::drain_body(body).await;
            err.into_response()
        }
        Err((err, None)) => err.into_response(),
    }
}

/// The write, or its error with the body if it is still unread.
async fn write_file(
    e: &E2b,
    vid: &str,
    uri: &Uri,
    headers: &HeaderMap,
    body: Body,
) -> Result<EntryInfo, (E2bError, Option<Body>)> {
    use tokio::io::AsyncWriteExt;
    let prepared = async {
        let (q, path) = query(uri)?;
        let (id, fs) = open(e, vid, headers, true).await?;
        let room = e.rt.volume_room(&id).await?;
        let fs = fs
            .owned_by_ids(q.uid.unwrap_or(DEFAULT_OWNER), q.gid.unwrap_or(DEFAULT_OWNER))?
            .with_dir_mode(DEFAULT_DIR_MODE);
        let force = q.force.unwrap_or(false);
        let fs = Arc::new(fs);
        let (fs2, p2) = (fs.clone(), path.clone());
        let mode = q.mode.unwrap_or(DEFAULT_FILE_MODE);
        let upload = blocking(move || {
            if !force {
                parent_exists(&fs2, &p2)?;
                if let Ok(en) = fs2.stat(&p2) {
                    return Err(bb_runtime::RuntimeError::Conflict(format!(
                        "{} exists: pass force=True to overwrite it",
                        en.path
                    )));
                }
            }
            fs2.begin_write(&p2, Some(mode))
        })
        .await?;
        Ok::<_, E2bError>((fs, upload, room, force))
    };
    let (fs, mut upload, room, force) = match prepared.await {
        Ok(x) => x,
        Err(err) => return Err((err, Some(body))),
    };
    let limit = e.rt.cfg.max_file_bytes;
    let mut file = tokio::fs::File::from_std(upload.take_file());
    let mut stream = body.into_data_stream();
    let mut written: u64 = 0;
    let fail = |err: E2bError| Err((err, None));
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(err) => return fail(E2bError::bad_request(format!("upload interrupted: {err}"))),
        };
        written += chunk.len() as u64;
        if let Some(room) = room.filter(|r| written > *r) {
            return fail(E2bError::Status(
                StatusCode::INSUFFICIENT_STORAGE,
                format!("the volume has room for {room} more bytes under its quota; the previous content is unchanged"),
            ));
        }
        if written > limit {
            return fail(E2bError::Status(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the file is larger than the daemon's limit of {limit} bytes (--max-file-bytes); the previous \
                     content is unchanged"
                ),
            ));
        }
        if let Err(err) = file.write_all(&chunk).await {
            return fail(bb_runtime::RuntimeError::io("write the upload")(err).into());
        }
    }
    if let Err(err) = file.flush().await {
        return fail(bb_runtime::RuntimeError::io("write the upload")(err).into());
    }
    upload.put_file(file.into_std().await);
    let done = blocking(move || if force { fs.commit(upload) } else { fs.commit_new(upload) }).await;
    done.map_err(|err| (err, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_tokens_depend_on_key_and_volume_and_differ_from_sandbox_tokens() {
        let t = volume_token("key", "vol-0123");
        assert_eq!(t, volume_token("key", "vol-0123"));
        assert_ne!(t, volume_token("key2", "vol-0123"));
        assert_ne!(t, volume_token("key", "vol-0124"));
        assert_ne!(t, crate::access_token("key", "vol-0123"));
        assert_eq!(t.len(), 40);
        // The formula tokens already handed out were made with (sha256 of purpose, key, id).
        assert_eq!(t, "4673f74f7434d8da08cb8f0e15cfca595bd47f61");
        assert_eq!(crate::access_token("key", "sb0123456789ab"), "3947f756d6f334363ed31ba7b34d2f0a9aa81173");
    }

    #[test]
    fn entries_become_e2b_volume_stats() {
        let en = EntryInfo {
            name: "a".into(),
            path: "/d/a".into(),
            kind: "dir".into(),
            size: 4096,
            mode: 0o1777,
            uid: 9090,
            gid: 1000,
            mtime: 1.5,
            atime: 2.0,
            ctime: 3.25,
            symlink_target: None,
        };
        let v = entry_stat(&en);
        assert_eq!((v["type"].as_str(), v["mode"].as_u64()), (Some("directory"), Some(0o777)));
        assert_eq!((v["uid"].as_u64(), v["gid"].as_u64()), (Some(9090), Some(1000)));
        assert!(v["ctime"].as_str().unwrap().starts_with("1970-01-01T00:00:03.25"));
        assert!(v.get("target").is_none());
        let link = EntryInfo { kind: "symlink".into(), symlink_target: Some("/x".into()), ..en.clone() };
        assert_eq!(
            (entry_stat(&link)["type"].as_str(), entry_stat(&link)["target"].as_str()),
            (Some("symlink"), Some("/x"))
        );
        let fifo = EntryInfo { kind: "other".into(), ..en };
        assert_eq!(entry_stat(&fifo)["type"], "unknown");
    }

    #[test]
    fn content_queries_need_a_path_and_a_file_mode() {
        let q = |s: &str| query(&s.parse::<Uri>().unwrap());
        assert!(q("/volumecontent/v/file?path=/a/b&force=true&mode=420").is_ok());
        assert!(q("/volumecontent/v/file").is_err());
        assert!(q("/volumecontent/v/file?path=/a&mode=99999").is_err());
        assert!(q("/volumecontent/v/file?path=/a&uid=x").is_err());
        assert!(q("/volumecontent/v/file?path=/../../etc").is_err());
    }
}
