//! envd's directory watchers: `WatchDir` (a server stream of events) and the polled
//! `CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher`, on the runtime's host-side watch
//! ([`bb_runtime::sandbox::watch`]).

use crate::connect::{self, Code, RpcError};
use crate::envd::{entry_json, keepalive_of, names_of, sb_path, unary, user_header, who, with_meta, Target};
use crate::E2b;
use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::HeaderMap;
use axum::response::Response;
use bb_runtime::sandbox::files::SbPath;
use bb_runtime::sandbox::watch::{DirWatch, FsEvent, FsEventKind};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Most events a polled watcher keeps between two polls; past it the watcher fails
/// (as an overflowing inotify queue does) rather than grow without bound.
pub const MAX_PENDING_EVENTS: usize = 100_000;
/// Most polled watchers one sandbox may have.
pub const MAX_WATCHERS_PER_SANDBOX: usize = 64;

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WatchReq {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default)]
    include_entry: bool,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WatcherIdReq {
    #[serde(default)]
    watcher_id: String,
}

/// A polled watcher: events gathered by its task until the next `GetWatcherEvents`.
pub struct Watcher {
    sandbox: String,
    pending: Arc<Mutex<Pending>>,
    task: tokio::task::AbortHandle,
}

#[derive(Default)]
struct Pending {
    events: Vec<Value>,
    error: Option<RpcError>,
}

/// Polled watchers by id.
#[derive(Default)]
pub struct Watchers(Mutex<HashMap<String, Arc<Watcher>>>);

impl Watchers {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Watcher>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn kind_name(k: FsEventKind) -> &'static str {
    match k {
        FsEventKind::Create => "EVENT_TYPE_CREATE",
        FsEventKind::Write => "EVENT_TYPE_WRITE",
        FsEventKind::Remove => "EVENT_TYPE_REMOVE",
        FsEventKind::Rename => "EVENT_TYPE_RENAME",
        FsEventKind::Chmod => "EVENT_TYPE_CHMOD",
    }
}

/// What a watch reports its events with.
struct Reporter {
    e: Arc<E2b>,
    target: Target,
    top: SbPath,
    include_entry: bool,
}

impl Reporter {
    /// envd's `FilesystemEvent`s, with entries when asked (an entry gone by then has none).
    async fn events(&self, evs: Vec<FsEvent>) -> Vec<Value> {
        let entries = if self.include_entry {
            let paths: Vec<SbPath> = evs.iter().map(|ev| self.top.join_rel(&ev.name)).collect();
            match self.e.rt.fs(&self.target.id).await {
                Ok(fs) => {
                    let names = names_of(&self.e, &self.target);
                    let stats = tokio::task::spawn_blocking(move || {
                        paths.iter().map(|p| fs.stat(p).ok().map(|en| with_meta(&fs, en))).collect::<Vec<_>>()
                    })
                    .await
                    .unwrap_or_default();
                    stats.into_iter().map(|s| s.map(|(en, meta)| entry_json(&en, &meta, &names))).collect()
                }
                Err(_) => Vec::new(),
            }
        } else {
            Vec::new()
        };
        evs.into_iter()
            .enumerate()
            .map(|(i, ev)| {
                let mut v = json!({"name": ev.name, "type": kind_name(ev.kind)});
                if let Some(Some(en)) = entries.get(i) {
                    v["entry"] = en.clone();
                }
                v
            })
            .collect()
    }
}

async fn open(e: &Arc<E2b>, t: &Target, headers: &HeaderMap, req: &WatchReq) -> Result<(DirWatch, SbPath), RpcError> {
    let who = who(e, t, user_header(headers))?;
    let path = sb_path(&req.path, &who.home)?;
    let w = e.rt.watch_dir(&t.id, &path, req.recursive).await?;
    Ok((w, path))
}

/// `WatchDir`: `start`, then events as they come, keepalives when idle (the oneof of
/// `WatchDirResponse` itself, so no `event` wrapper as process streams have).
pub async fn watch_dir(
    State(e): State<Arc<E2b>>,
    Extension(t): Extension<Target>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req: WatchReq = match connect::single_envelope(&body) {
        Ok(r) => r,
        Err(err) => return err.stream(),
    };
    let (mut w, top) = match open(&e, &t, &headers, &req).await {
        Ok(x) => x,
        Err(err) => return err.stream(),
    };
    let keepalive = keepalive_of(&headers);
    let rep = Reporter { e, target: t, top, include_entry: req.include_entry };
    let (out, body_rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        if out.send(Ok(connect::message(&json!({"start": {}})))).await.is_err() {
            return;
        }
        loop {
            let next = tokio::select! {
                r = w.next() => r,
                _ = tokio::time::sleep(keepalive) => {
                    if out.send(Ok(connect::message(&json!({"keepalive": {}})))).await.is_err() { return; }
                    continue;
                }
                _ = out.closed() => return,
            };
            match next {
                Ok(evs) => {
                    for ev in rep.events(evs).await {
                        if out.send(Ok(connect::message(&json!({"filesystem": ev})))).await.is_err() {
                            return;
                        }
                    }
                }
                Err(err) => {
                    let _ = out.send(Ok(connect::end_stream(Some(&RpcError::from(err))))).await;
                    return;
                }
            }
        }
    });
    let stream = futures::stream::unfold(body_rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    connect::stream_response(Body::from_stream(stream))
}

pub async fn create_watcher(
    State(e): State<Arc<E2b>>,
    Extension(t): Extension<Target>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r = async {
        let req: WatchReq = connect::parse(&body)?;
        {
            // Watchers of sandboxes that went away are dropped here (their tasks have ended).
            let mut all = e.watchers.lock();
            all.retain(|_, w| e.rt.get(&w.sandbox).is_ok_and(|sb| !sb.is_dead()));
            if all.values().filter(|w| w.sandbox == t.id).count() >= MAX_WATCHERS_PER_SANDBOX {
                return Err(RpcError::new(
                    Code::ResourceExhausted,
                    format!("the sandbox has {MAX_WATCHERS_PER_SANDBOX} watchers: stop one (RemoveWatcher) first"),
                ));
            }
        }
        let (mut w, top) = open(&e, &t, &headers, &req).await?;
        let pending = Arc::new(Mutex::new(Pending::default()));
        let rep = Reporter { e: e.clone(), target: t.clone(), top, include_entry: req.include_entry };
        let sink = pending.clone();
        let task = tokio::spawn(async move {
            loop {
                let evs = match w.next().await {
                    Ok(evs) => rep.events(evs).await,
                    Err(err) => {
                        sink.lock().unwrap_or_else(|p| p.into_inner()).error = Some(err.into());
                        return;
                    }
                };
                let mut p = sink.lock().unwrap_or_else(|p| p.into_inner());
                p.events.extend(evs);
                if p.events.len() > MAX_PENDING_EVENTS {
                    p.events.clear();
                    p.error = Some(RpcError::new(
                        Code::ResourceExhausted,
                        format!(
                            "over {MAX_PENDING_EVENTS} events were not collected: call get_new_events() more often"
                        ),
                    ));
                    return;
                }
            }
        });
        let id = format!("w{}", uuid::Uuid::new_v4().simple());
        let watcher = Watcher { sandbox: t.id.clone(), pending, task: task.abort_handle() };
        e.watchers.lock().insert(id.clone(), Arc::new(watcher));
        Ok(json!({"watcherId": id}))
    };
    unary(r.await)
}

fn find(e: &E2b, t: &Target, id: &str) -> Result<Arc<Watcher>, RpcError> {
    e.watchers
        .lock()
        .get(id)
        .filter(|w| w.sandbox == t.id)
        .cloned()
        .ok_or_else(|| RpcError::new(Code::NotFound, format!("watcher with id {id} not found")))
}

/// The events since the last call; a failed watcher answers its error (and keeps it).
pub async fn get_watcher_events(State(e): State<Arc<E2b>>, Extension(t): Extension<Target>, body: Bytes) -> Response {
    let r = (|| {
        let req: WatcherIdReq = connect::parse(&body)?;
        let w = find(&e, &t, &req.watcher_id)?;
        let mut p = w.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(err) = &p.error {
            return Err(err.clone());
        }
        Ok(json!({"events": std::mem::take(&mut p.events)}))
    })();
    unary(r)
}

pub async fn remove_watcher(State(e): State<Arc<E2b>>, Extension(t): Extension<Target>, body: Bytes) -> Response {
    let r = (|| {
        let req: WatcherIdReq = connect::parse(&body)?;
        find(&e, &t, &req.watcher_id)?;
        e.watchers.lock().remove(&req.watcher_id);
        Ok(json!({}))
    })();
    unary(r)
}
