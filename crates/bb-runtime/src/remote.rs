//! Durable snapshots: a snapshot pushed to the object store ([`bb_store`]) and recorded in the
//! metadata store ([`bb_meta`]), so any daemon sharing both can pull it, create sandboxes from it
//! and fork them, after the node that took it is gone (../shared/STORAGE.md).
//!
//! **Push.** The snapshot's session templates that are still in memory are dumped to process
//! images first (as `offload` does). Then each layer of its chain and each process image is
//! written as a *tree* (a manifest plus content-defined chunks, [`bb_store::Store::put_tree`]),
//! unless the metadata store already names a tree for it (`layer/<id>`, `image/<id>`: layers
//! and images never change, so a layer pushed once is never read again, and a child snapshot
//! uploads only its new layer and the chunks of its images that changed). The snapshot's record
//! (its local record, the trees, the images' metadata) is written last: no record ever names a
//! tree that is not all there, and a push stopped anywhere is resumed by pushing again (the
//! trees written are kept; chunks the store has are skipped).
//!
//! **Pull.** Layers and images the daemon lacks are downloaded into temp dirs and renamed into
//! place, then the snapshot's record is inserted here: from then on it is a local snapshot
//! (`Sandbox.create(snapshot=...)`, `fork`, `rollback`). Its sessions come back from their
//! process images ([`crate::session_templates`]); the first sandbox made from it here holds
//! its templates (see [`Runtime::create_from_snapshot`]).
//!
//! **Collection.** [`Runtime::store_gc`] deletes the objects no record reaches, older than a
//! grace period. It excludes pushes through the metadata store ([`bb_meta::Meta::begin_gc`]):
//! while any daemon pushes, no collection runs, and the other way round, so a push that skips
//! a chunk because the store has it never loses that chunk to a collection.
//!
//! Keys and credentials stay in the daemon: the store key file is in the state dir (0600), S3
//! credentials come from the daemon's environment, the metadata URL from its arguments; none
//! is passed to a sandbox (their env is the request's).

use crate::error::{Result, RuntimeError};
use crate::model::*;
use crate::process_images::ImageRow;
use crate::snapshot::store::SnapshotRow;
use crate::{now, Runtime};
use bb_store::TreeRef;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Failures of the object store or the metadata store.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error(transparent)]
    Store(#[from] bb_store::StoreError),
    #[error(transparent)]
    Meta(#[from] bb_meta::MetaError),
    #[error("the record of snapshot {id} in the metadata store is unreadable ({why}): delete it with `branchbox snapshot rm --remote {id}` and push it again")]
    BadRecord { id: String, why: String },
    #[error(
        "head {name} in the metadata store is unreadable ({why}): nothing is collected until it is mended or deleted"
    )]
    BadHead { name: String, why: String },
}

impl RemoteError {
    /// What the API answers: an unreachable store is 503 (retry), an object that failed
    /// authentication 502 ([`Self::corrupt`]), the rest 500.
    pub fn unavailable(&self) -> bool {
        match self {
            RemoteError::Store(e) => matches!(e, bb_store::StoreError::Backend { .. }),
            RemoteError::Meta(e) => matches!(e, bb_meta::MetaError::Unreachable { .. }),
            RemoteError::BadRecord { .. } | RemoteError::BadHead { .. } => false,
        }
    }

    /// An object read back from the store failed authentication (the store gave back what was
    /// not written, or with another key).
    pub fn corrupt(&self) -> bool {
        matches!(self, RemoteError::Store(bb_store::StoreError::Tampered { .. }))
    }
}

/// How long a push holds its intent before renewing it; a daemon killed mid-push frees the
/// store for collection after this.
const PUSH_TTL: Duration = Duration::from_secs(300);
/// How long a push waits for a collection under way before giving up.
const GC_WAIT: Duration = Duration::from_secs(60);
/// `kind` of snapshot records.
const SNAPSHOT_RECORD: &str = "snapshot";
/// `kind` of the records of sandboxes paused with `push` (id: the sandbox's).
const PAUSED_RECORD: &str = "paused";
/// The head a collection that deleted objects moves (its version counts them): a daemon whose
/// store remembers packs from before forgets them on its next push.
const GC_HEAD: &str = "store/collections";
/// How long a daemon resuming a pushed paused sandbox holds it (a second daemon's resume is
/// refused meanwhile; after a crash, another daemon may take it once this passed).
const RESUME_LEASE: Duration = Duration::from_secs(120);
/// How long a node holds an `rwo` volume it writes without renewing (renewed every
/// [`crate::volumes::LEASE_RENEW`] while mounted): another node takes it over after this.
pub(crate) const VOLUME_LEASE: Duration = Duration::from_secs(30);

/// The body of a pushed paused sandbox's record.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PushedPause {
    snapshot: String,
    image: String,
    paused_at: f64,
}

/// A process image as a record holds it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PushedImage {
    tree: TreeRef,
    kind: String,
    template: Option<String>,
    channel_fd: Option<i32>,
    bytes: u64,
}

/// A snapshot record's body in the metadata store.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct PushedSnapshot {
    row: SnapshotRow,
    /// A tree for every layer of `row.layers`.
    layers: BTreeMap<String, TreeRef>,
    /// Snapshot layers' sizes on the pushing node (shown as `size_bytes`).
    #[serde(default)]
    layer_sizes: BTreeMap<String, u64>,
    images: BTreeMap<String, PushedImage>,
    pushed_at: f64,
}

impl PushedSnapshot {
    fn trees(&self) -> impl Iterator<Item = &TreeRef> {
        self.layers.values().chain(self.images.values().map(|i| &i.tree))
    }
}

/// Heads of volumes in the metadata store are named this plus the volume id.
pub(crate) const VOLUME_HEAD_PREFIX: &str = "volume/";

/// A volume's committed state: its layers as trees, bottom first, and its own snapshots.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct VolumeHead {
    pub name: Option<String>,
    pub access: Access,
    pub quota_mb: Option<u64>,
    pub layers: Vec<VolumeHeadLayer>,
    /// The volume's own snapshots (not those of sandbox checkpoints), oldest first.
    #[serde(default)]
    pub snapshots: Vec<VolumeHeadSnapshot>,
}

impl VolumeHead {
    /// Every tree the head stands on (its chain's and its snapshots').
    fn trees(&self) -> impl Iterator<Item = &VolumeHeadLayer> {
        self.layers.iter().chain(self.snapshots.iter().flat_map(|s| &s.layers))
    }

    /// Refuse a head naming a layer that is not a volume layer id (it names a local path).
    pub(crate) fn check(&self, id: &str) -> Result<()> {
        let ids = self.trees().map(|l| &l.layer).chain(self.snapshots.iter().map(|s| &s.id));
        for l in ids {
            if !(l.starts_with("sl-") || l.starts_with("vs-")) || l.contains('/') || l.contains("..") {
                return Err(RemoteError::BadHead {
                    name: format!("{VOLUME_HEAD_PREFIX}{id}"),
                    why: format!("id {l:?}"),
                }
                .into());
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct VolumeHeadSnapshot {
    pub id: String,
    pub label: Option<String>,
    pub created_at: f64,
    pub layers: Vec<VolumeHeadLayer>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct VolumeHeadLayer {
    pub layer: String,
    pub tree: TreeRef,
}

struct Opened {
    store: bb_store::Store,
    meta: Arc<bb_meta::Meta>,
}

/// The daemon's object store and metadata store, opened on first use (a metadata store that is
/// down at start does not keep the daemon from serving local work).
pub struct Remote {
    store_url: bb_store::StoreUrl,
    meta_url: bb_meta::MetaUrl,
    key_file: PathBuf,
    credentials: Option<(String, String)>,
    node: String,
    /// What this daemon's holds (push intents, collections) are named with: its node name and
    /// its state dir, so a restart lets go of what the killed run held, and only that.
    holder_prefix: String,
    grace: Duration,
    opened: tokio::sync::OnceCell<Arc<Opened>>,
    /// [`GC_HEAD`]'s version when this daemon's store last knew its packs.
    collections_seen: std::sync::atomic::AtomicI64,
}

impl Remote {
    pub(crate) fn new(cfg: &crate::RuntimeConfig, db: &Path) -> Result<Remote> {
        let bad = |what: &str, e: String| RuntimeError::BadRequest(format!("{what}: {e}"));
        let store_url = match &cfg.store_url {
            Some(u) => u.parse().map_err(|e: bb_store::StoreError| bad("--store-url", e.to_string()))?,
            None => bb_store::StoreUrl::Local(cfg.state_dir.join("store")),
        };
        let meta_url = match &cfg.metadata_url {
            Some(u) => u.parse().map_err(|e: bb_meta::MetaError| bad("--metadata-url", e.to_string()))?,
            None => bb_meta::MetaUrl::Sqlite(db.to_path_buf()),
        };
        // Pulls a killed daemon left half-done (nothing names them).
        if let Ok(rd) = std::fs::read_dir(cfg.state_dir.join("tmp")) {
            for e in rd.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("pull-")) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let node = cfg.node_name.clone().unwrap_or_else(|| {
            nix::unistd::gethostname().ok().and_then(|h| h.into_string().ok()).unwrap_or_else(|| "node".into())
        });
        let dir_hash = blake3::hash(cfg.state_dir.as_os_str().as_encoded_bytes()).to_hex();
        let holder_prefix = format!("{node}@{}:", &dir_hash[..8]);
        Ok(Remote {
            holder_prefix,
            store_url,
            meta_url,
            key_file: cfg.store_key_file.clone().unwrap_or_else(|| cfg.state_dir.join("store.key")),
            credentials: cfg.store_credentials.clone(),
            node,
            grace: cfg.store_gc_grace,
            opened: tokio::sync::OnceCell::new(),
            collections_seen: std::sync::atomic::AtomicI64::new(-1),
        })
    }

    /// The store and metadata URLs (credentials left out).
    pub fn describe(&self) -> (String, String) {
        (self.store_url.to_string(), self.meta_url.to_string())
    }

    async fn open(&self) -> Result<Arc<Opened>> {
        let opened = self
            .opened
            .get_or_try_init(|| async {
                let (store_url, meta_url, key_file) =
                    (self.store_url.clone(), self.meta_url.clone(), self.key_file.clone());
                let credentials = self.credentials.clone();
                let prefix = self.holder_prefix.clone();
                tokio::task::spawn_blocking(move || -> Result<Arc<Opened>, RemoteError> {
                    let keys = bb_store::Keys::load_or_create(&key_file)?;
                    let creds = credentials.as_ref().map(|(i, s)| (i.as_str(), s.as_str()));
                    let store = bb_store::Store::open_with(&store_url, keys, creds)?;
                    let meta = Arc::new(bb_meta::Meta::open(&meta_url)?);
                    // A push or collection of this daemon's previous run (killed) holds nothing now.
                    meta.release_holders(&prefix)?;
                    Ok(Arc::new(Opened { store, meta }))
                })
                .await
                .map_err(RuntimeError::Worker)?
                .map_err(RuntimeError::from)
            })
            .await?;
        Ok(opened.clone())
    }
}

/// Run a metadata-store call off the async threads. (`f` takes the `Arc`, not a reference: a
/// closure over a borrowed argument would make the caller's future not provably `Send`.)
async fn meta<T: Send + 'static>(
    m: &Arc<bb_meta::Meta>,
    f: impl FnOnce(Arc<bb_meta::Meta>) -> bb_meta::Result<T> + Send + 'static,
) -> Result<T> {
    let m = m.clone();
    Ok(tokio::task::spawn_blocking(move || f(m)).await.map_err(RuntimeError::Worker)?.map_err(RemoteError::from)?)
}

fn ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1000.0
}

fn parse_record(r: &bb_meta::Record) -> Result<PushedSnapshot> {
    serde_json::from_str(&r.body).map_err(|e| RemoteError::BadRecord { id: r.id.clone(), why: e.to_string() }.into())
}

/// Holds a push intent in the metadata store (collection waits while it lives): ended by
/// [`PushIntent::end`] when the push is done (a collection right after it is not refused), or
/// on drop, in the background, when the push failed.
struct PushIntent {
    meta: Arc<bb_meta::Meta>,
    holder: String,
    ended: bool,
}

impl PushIntent {
    /// Keep the intent alive (between the trees of a long push). A push whose intent expired
    /// stops: a collection may have run meanwhile and deleted what it counted on.
    async fn renew(&self) -> Result<()> {
        let h = self.holder.clone();
        if meta(&self.meta, move |m| m.begin_push(&h, PUSH_TTL)).await? {
            Ok(())
        } else {
            Err(RuntimeError::Conflict(
                "the push took longer than its hold on the object store and a collection started: push again".into(),
            ))
        }
    }
}

impl PushIntent {
    async fn end(mut self) {
        self.ended = true;
        let h = self.holder.clone();
        if let Err(e) = meta(&self.meta, move |m| m.end_push(&h)).await {
            tracing::warn!(holder = %self.holder, "ending a push in the metadata store (it expires by itself): {e}");
        }
    }
}

impl Drop for PushIntent {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let (m, h) = (self.meta.clone(), self.holder.clone());
        std::thread::spawn(move || {
            if let Err(e) = m.end_push(&h) {
                tracing::warn!(holder = %h, "ending a push in the metadata store (it expires by itself): {e}");
            }
        });
    }
}

impl Runtime {
    /// The object store's and the metadata store's URLs (credentials left out).
    pub fn store_urls(&self) -> (String, String) {
        self.remote.describe()
    }

    pub(crate) fn layer_path(&self, id: &str) -> PathBuf {
        crate::sandbox::launch::layer_dir(&self.cfg, &self.images, id)
    }

    /// Wait until no collection runs, then record this push's intent.
    async fn begin_push(&self, o: &Opened) -> Result<PushIntent> {
        let holder = format!("{}{}", self.remote.holder_prefix, uuid::Uuid::new_v4().simple());
        let t0 = Instant::now();
        loop {
            let h = holder.clone();
            if meta(&o.meta, move |m| m.begin_push(&h, PUSH_TTL)).await? {
                let intent = PushIntent { meta: o.meta.clone(), holder, ended: false };
                // No collection runs while the intent lives: packs known now stay.
                let seen = meta(&o.meta, |m| m.head(GC_HEAD)).await?.map_or(0, |h| h.version);
                let before = self.remote.collections_seen.swap(seen, std::sync::atomic::Ordering::SeqCst);
                if before != seen {
                    o.store.forget_packed();
                }
                return Ok(intent);
            }
            if t0.elapsed() > GC_WAIT {
                return Err(RuntimeError::Unavailable(format!(
                    "the object store is being collected (`branchbox store gc`) for over {GC_WAIT:?}: push again once it is done"
                )));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Push snapshot `sid` (see the module docs). Pushing it again costs one lookup.
    pub async fn push_snapshot(self: &Arc<Self>, sid: &str) -> Result<PushResult> {
        let t0 = Instant::now();
        let mut snap = self.snapshot_row(sid)?;
        let o = self.remote.open().await?;
        let id = sid.to_string();
        if meta(&o.meta, move |m| m.get_record(&id)).await?.is_some() {
            self.snapshots.records().set_durable(sid)?;
            return Ok(PushResult {
                snapshot: sid.into(),
                durability: "durable".into(),
                already: true,
                layers_pushed: 0,
                images_pushed: 0,
                uploaded_bytes: 0,
                read_bytes: 0,
                lost: Vec::new(),
                took_ms: ms(t0),
            });
        }
        let mut lost = Vec::new();
        if snap.sessions.iter().any(|s| s.template.is_some() && s.image.is_none()) {
            let off = self.offload_snapshot(sid).await?;
            lost = off.lost;
            snap = self.snapshot_row(sid)?;
        } else {
            for s in snap.sessions.iter().filter(|s| s.image.is_none()) {
                lost.push(format!(
                    "{}: {}",
                    s.id,
                    s.lost.clone().unwrap_or_else(|| "no process image holds it".into())
                ));
            }
        }
        let intent = self.begin_push(&o).await?;
        let before = o.store.stats();
        let (mut layers, mut layer_sizes, mut images) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        let (mut layers_pushed, mut images_pushed, mut read_bytes) = (0, 0, 0);
        for l in &snap.layers {
            intent.renew().await?;
            let (tree, pushed) = self.push_tree(&o, &format!("layer/{l}"), &self.layer_path(l)).await?;
            if pushed {
                layers_pushed += 1;
                read_bytes += tree.bytes;
            }
            if let Some(size) = self.snapshots.records().layer_size(l)? {
                layer_sizes.insert(l.clone(), size);
            }
            layers.insert(l.clone(), tree);
        }
        let image_ids: BTreeSet<String> = snap
            .sessions
            .iter()
            .filter_map(|s| s.image.clone())
            .chain(snap.processes.iter().map(|p| p.image.clone()))
            .collect();
        for img in image_ids {
            let row = self.process_images.get(&img)?.ok_or_else(|| {
                RuntimeError::Conflict(format!("process image {img} of snapshot {sid} is gone: take a new snapshot"))
            })?;
            intent.renew().await?;
            let (tree, pushed) = self.push_tree(&o, &format!("image/{img}"), &self.process_images.path(&img)).await?;
            if pushed {
                images_pushed += 1;
                read_bytes += tree.bytes;
            }
            images.insert(
                img,
                PushedImage {
                    tree,
                    kind: row.kind,
                    template: row.template,
                    channel_fd: row.channel_fd,
                    bytes: row.bytes,
                },
            );
        }
        let body = PushedSnapshot { row: snap.clone(), layers, layer_sizes, images, pushed_at: now() };
        let record = bb_meta::Record {
            id: sid.to_string(),
            kind: SNAPSHOT_RECORD.into(),
            node: self.remote.node.clone(),
            created_at: snap.created_at,
            body: serde_json::to_string(&body).expect("a snapshot record serializes"),
        };
        match meta(&o.meta, move |m| m.put_record(&record)).await {
            Ok(()) => {}
            // Another push of the same snapshot (here or on a daemon that pulled it) recorded
            // it first: it is durable all the same.
            Err(RuntimeError::Remote(RemoteError::Meta(bb_meta::MetaError::Conflict { .. }))) => {}
            Err(e) => return Err(e),
        }
        intent.end().await;
        self.snapshots.records().set_durable(sid)?;
        let after = o.store.stats();
        let res = PushResult {
            snapshot: sid.into(),
            durability: "durable".into(),
            already: false,
            layers_pushed,
            images_pushed,
            uploaded_bytes: after.put_bytes - before.put_bytes,
            read_bytes,
            lost,
            took_ms: ms(t0),
        };
        tracing::info!(snapshot = %sid, layers_pushed, images_pushed, uploaded = res.uploaded_bytes, took_ms = res.took_ms, "snapshot pushed");
        Ok(res)
    }

    /// Push the layers of volume `row` and of its own snapshots `snaps` that are not in the
    /// object store yet and move its head (`volume/<id>`) from version `expected` (None: no head
    /// yet) to them by compare-and-swap. Returns the new version.
    pub(crate) async fn commit_volume(
        &self,
        row: &crate::volumes::store::VolumeRow,
        snaps: &[crate::volumes::store::VolumeSnapRow],
        expected: Option<i64>,
    ) -> Result<i64> {
        let t0 = Instant::now();
        let o = self.remote.open().await?;
        let intent = self.begin_push(&o).await?;
        let mut trees: BTreeMap<String, TreeRef> = BTreeMap::new();
        let mut pushed_layers = 0;
        for l in row.chain.iter().chain(snaps.iter().flat_map(|s| &s.chain)) {
            if trees.contains_key(l) {
                continue;
            }
            intent.renew().await?;
            let (tree, pushed) = self.push_tree(&o, &format!("layer/{l}"), &self.layer_path(l)).await?;
            pushed_layers += usize::from(pushed);
            trees.insert(l.clone(), tree);
        }
        let head_layers = |chain: &[String]| {
            chain.iter().map(|l| VolumeHeadLayer { layer: l.clone(), tree: trees[l].clone() }).collect()
        };
        let head = VolumeHead {
            name: row.name.clone(),
            access: row.access,
            quota_mb: row.quota_mb,
            layers: head_layers(&row.chain),
            snapshots: snaps
                .iter()
                .map(|s| VolumeHeadSnapshot {
                    id: s.id.clone(),
                    label: s.label.clone(),
                    created_at: s.created_at,
                    layers: head_layers(&s.chain),
                })
                .collect(),
        };
        let (name, value) =
            (format!("{VOLUME_HEAD_PREFIX}{}", row.id), serde_json::to_string(&head).expect("a head serializes"));
        let committed = meta(&o.meta, move |m| m.cas_head(&name, expected, &value)).await;
        intent.end().await;
        let version = match committed {
            Ok(h) => h.version,
            Err(RuntimeError::Remote(RemoteError::Meta(bb_meta::MetaError::HeadMoved { found, .. }))) => {
                return Err(RuntimeError::Conflict(format!(
                    "volume {} was committed elsewhere since this node last synced it (head at version {}, this node \
                     expected {}): another daemon writes it; fork it here to keep this node's changes",
                    row.id,
                    found.map_or("deleted".into(), |v| v.to_string()),
                    expected.unwrap_or(0)
                )))
            }
            Err(e) => return Err(e),
        };
        tracing::info!(volume = %row.id, version, pushed_layers, took_ms = ms(t0), "volume synced");
        Ok(version)
    }

    /// Volume `id_or_name`'s committed head in the metadata store: (id, version, state), its
    /// layer and snapshot ids checked.
    pub(crate) async fn volume_head(&self, id_or_name: &str) -> Result<Option<(String, i64, VolumeHead)>> {
        let o = self.remote.open().await?;
        let heads = if id_or_name.starts_with("vol-") {
            let name = format!("{VOLUME_HEAD_PREFIX}{id_or_name}");
            meta(&o.meta, move |m| m.head(&name)).await?.into_iter().collect()
        } else {
            meta(&o.meta, |m| m.list_heads(VOLUME_HEAD_PREFIX)).await?
        };
        for h in heads {
            let head: VolumeHead = serde_json::from_str(&h.value)
                .map_err(|e| RemoteError::BadHead { name: h.name.clone(), why: e.to_string() })?;
            let id = h.name[VOLUME_HEAD_PREFIX.len()..].to_string();
            if id == id_or_name || head.name.as_deref() == Some(id_or_name) {
                head.check(&id)?;
                return Ok(Some((id, h.version, head)));
            }
        }
        Ok(None)
    }

    /// Bring the layers of a committed volume head that this node lacks (authenticated as read).
    pub(crate) async fn pull_volume_layers(&self, head: &VolumeHead) -> Result<usize> {
        let o = self.remote.open().await?;
        let mut pulled = 0;
        for l in &head.layers {
            if self.layer_path(&l.layer).exists() {
                continue;
            }
            self.pull_layer(&o, &l.layer, &l.tree).await?;
            let size = crate::layers::du(&self.layer_path(&l.layer));
            self.snapshots.records().set_layer_size(&l.layer, size)?;
            pulled += 1;
        }
        Ok(pulled)
    }

    /// Pull the layers of volume chain `chain` that this node let go (see
    /// [`crate::volumes::cache`]): each was pushed as tree `layer/<id>`. Returns how many.
    pub(crate) async fn pull_missing_layers(&self, volume: &str, chain: &[String]) -> Result<usize> {
        let missing: Vec<&String> = chain.iter().filter(|l| !self.layer_path(l).exists()).collect();
        if missing.is_empty() {
            return Ok(0);
        }
        let o = self.remote.open().await?;
        for l in &missing {
            let name = format!("layer/{l}");
            let n = name.clone();
            let tree = meta(&o.meta, move |m| m.get_object(&n)).await?.ok_or_else(|| {
                RuntimeError::Conflict(format!(
                    "volume {volume} stands on layer {l}, which is neither on this node nor in the object store \
                     ({name} is not in the metadata store): restore the volume to one of its snapshots or delete it"
                ))
            })?;
            let tree: TreeRef = serde_json::from_str(&tree)
                .map_err(|e| RemoteError::BadHead { name: name.clone(), why: e.to_string() })?;
            self.pull_layer(&o, l, &tree).await?;
        }
        tracing::info!(volume, layers = missing.len(), "volume layers pulled back into the node's cache");
        Ok(missing.len())
    }

    /// Take or renew the writer lease of volume `id` (one node writes an `rwo` volume that has a
    /// committed head); a conflict names the node holding it and until when.
    pub(crate) async fn hold_volume(&self, id: &str) -> Result<()> {
        let o = self.remote.open().await?;
        let (name, holder) = (format!("{VOLUME_HEAD_PREFIX}{id}"), self.volume_holder());
        let (n, h) = (name.clone(), holder.clone());
        if meta(&o.meta, move |m| m.acquire_lease(&n, &h, VOLUME_LEASE)).await? {
            return Ok(());
        }
        let who = meta(&o.meta, move |m| m.lease_holder(&name)).await?;
        // Holders are `{node}@{state dir hash}:volumes`: the node is what a user knows.
        let (node, left) = who.map_or(("another node".to_string(), 0.0), |(h, left)| {
            (format!("node {:?}", h.split('@').next().unwrap_or(&h)), left)
        });
        Err(RuntimeError::Conflict(format!(
            "volume {id} is written on {node} (its lease runs {left:.0} s more, renewed while a sandbox there mounts \
             it): kill that sandbox, or wait until that node is gone, or fork the volume"
        )))
    }

    /// Delete volume `id`'s committed head if it is still at `expected` (its trees are then
    /// collected by the next `store gc`). False: another node committed it since (it stays).
    pub(crate) async fn delete_volume_head(&self, id: &str, expected: i64) -> Result<bool> {
        let o = self.remote.open().await?;
        let name = format!("{VOLUME_HEAD_PREFIX}{id}");
        match meta(&o.meta, move |m| m.delete_head(&name, expected)).await {
            Ok(())
            | Err(RuntimeError::Remote(RemoteError::Meta(bb_meta::MetaError::HeadMoved { found: None, .. }))) => {
                Ok(true)
            }
            Err(RuntimeError::Remote(RemoteError::Meta(bb_meta::MetaError::HeadMoved { found: Some(_), .. }))) => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Let go of volume `id`'s writer lease (best effort: it expires by itself).
    pub(crate) async fn release_volume(&self, id: &str) {
        let Ok(o) = self.remote.open().await else { return };
        let (name, holder) = (format!("{VOLUME_HEAD_PREFIX}{id}"), self.volume_holder());
        if let Err(e) = meta(&o.meta, move |m| m.release_lease(&name, &holder)).await {
            tracing::warn!(volume = %id, "releasing the volume's lease (it expires by itself): {e}");
        }
    }

    /// This daemon's name as a volume lease holder (a restarted daemon is the same holder).
    fn volume_holder(&self) -> String {
        format!("{}volumes", self.remote.holder_prefix)
    }

    /// The tree named `name` in the metadata store, or `dir` written as one and named so.
    /// Returns it and whether it was written now.
    async fn push_tree(&self, o: &Opened, name: &str, dir: &Path) -> Result<(TreeRef, bool)> {
        let n = name.to_string();
        if let Some(v) = meta(&o.meta, move |m| m.get_object(&n)).await? {
            if let Ok(t) = serde_json::from_str::<TreeRef>(&v) {
                return Ok((t, false));
            }
        }
        if !dir.is_dir() {
            return Err(RuntimeError::Conflict(format!(
                "{name} is missing on this node ({}): take a new snapshot",
                dir.display()
            )));
        }
        let tree = o.store.put_tree(dir).await.map_err(RemoteError::from)?;
        let (n, v) = (name.to_string(), serde_json::to_string(&tree).expect("a tree ref serializes"));
        meta(&o.meta, move |m| m.put_object(&n, &v)).await?;
        Ok((tree, true))
    }

    /// Write layer `l` from `tree` into this node's layers (a temp dir renamed into place: a
    /// crash leaves no half layer under its name). The tree is authenticated as it is read.
    async fn pull_layer(&self, o: &Opened, l: &str, tree: &TreeRef) -> Result<()> {
        let target = self.layer_path(l);
        let staging = if l.starts_with(crate::volumes::volfs::LAYER_PREFIX) {
            // Made by the callers, off the async threads (a no-op check here).
            self.volume_fs_ready()?;
            crate::volumes::volfs::tmp_dir(&self.cfg.state_dir)
        } else {
            self.cfg.state_dir.join("tmp")
        };
        std::fs::create_dir_all(&staging).map_err(RuntimeError::io("make the pull staging dir"))?;
        let tmp = staging.join(format!("pull-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&tmp).map_err(RuntimeError::io("make a pull dir"))?;
        let t = Instant::now();
        let got = o.store.get_tree(tree, &tmp).await;
        tracing::debug!(layer = %l, files = tree.files, bytes = tree.bytes, took = ?t.elapsed(), "layer pulled");
        if let Err(e) = got {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(RemoteError::from(e).into());
        }
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(RuntimeError::io("make the layers dir"))?;
        }
        if let Err(e) = std::fs::rename(&tmp, &target) {
            let _ = std::fs::remove_dir_all(&tmp);
            if !target.exists() {
                return Err(RuntimeError::io("keep a pulled layer")(e));
            }
        }
        Ok(())
    }

    /// Bring pushed snapshot `sid` into this daemon (see the module docs).
    pub async fn pull_snapshot(self: &Arc<Self>, sid: &str) -> Result<PullResult> {
        let t0 = Instant::now();
        let _pull = self.pulls.lock().await;
        if self.snapshots.records().get(sid)?.is_some() {
            return Ok(PullResult {
                snapshot: sid.into(),
                already: true,
                layers_pulled: 0,
                images_pulled: 0,
                downloaded_bytes: 0,
                took_ms: ms(t0),
            });
        }
        let o = self.remote.open().await?;
        let id = sid.to_string();
        let record = meta(&o.meta, move |m| m.get_record(&id)).await?.ok_or_else(|| RuntimeError::NotFound {
            kind: "snapshot",
            id: sid.into(),
            hint: " here or in the metadata store: list pushed snapshots with `branchbox snapshot ls --remote`",
        })?;
        let body = parse_record(&record)?;
        let before = o.store.stats();
        let staging = self.cfg.state_dir.join("tmp");
        std::fs::create_dir_all(&staging).map_err(RuntimeError::io("make the pull staging dir"))?;
        let mut layers_pulled = 0;
        for l in &body.row.layers {
            let valid = l.starts_with("sl-") || bb_layers::valid_layer_id(l);
            if !valid || l.contains('/') {
                return Err(RemoteError::BadRecord { id: sid.into(), why: format!("layer id {l:?}") }.into());
            }
            if self.layer_path(l).exists() {
                continue;
            }
            let tree = body
                .layers
                .get(l)
                .ok_or_else(|| RemoteError::BadRecord { id: sid.into(), why: format!("no tree for layer {l}") })?;
            self.pull_layer(&o, l, tree).await?;
            if let Some(size) = body.layer_sizes.get(l) {
                self.snapshots.records().set_layer_size(l, *size)?;
            }
            layers_pulled += 1;
        }
        let mut adopted = Vec::new();
        for (img, p) in &body.images {
            if !crate::process_images::valid_image_id(img) {
                return Err(RemoteError::BadRecord { id: sid.into(), why: format!("image id {img:?}") }.into());
            }
            if self.process_images.get(img)?.is_some() {
                continue;
            }
            let tmp = self.process_images.staging(img);
            let _ = std::fs::remove_dir_all(&tmp);
            std::fs::create_dir_all(&tmp).map_err(RuntimeError::io("make a pull dir"))?;
            let t = Instant::now();
            if let Err(e) = o.store.get_tree(&p.tree, &tmp).await {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(RemoteError::from(e).into());
            }
            tracing::debug!(snapshot = %sid, image = %img, bytes = p.tree.bytes, took = ?t.elapsed(), "process image pulled");
            self.process_images.adopt(&ImageRow {
                id: img.clone(),
                kind: p.kind.clone(),
                sandbox_id: body.row.sandbox_id.clone(),
                template: p.template.clone(),
                channel_fd: p.channel_fd,
                bytes: p.bytes,
                created_at: now(),
                last_used: now(),
            })?;
            adopted.push(img.clone());
        }
        let inserted = {
            let records = self.snapshots.records();
            records.insert(&body.row).and_then(|()| records.set_durable(sid))
        };
        for img in &adopted {
            self.process_images.settled(img);
        }
        if let Err(e) = inserted {
            self.process_images.delete(&adopted);
            return Err(e.into());
        }
        let res = PullResult {
            snapshot: sid.into(),
            already: false,
            layers_pulled,
            images_pulled: adopted.len(),
            downloaded_bytes: o.store.stats().get_bytes - before.get_bytes,
            took_ms: ms(t0),
        };
        tracing::info!(snapshot = %sid, layers_pulled, images = res.images_pulled, downloaded = res.downloaded_bytes, took_ms = res.took_ms, "snapshot pulled");
        Ok(res)
    }

    /// Pause sandbox `id` as `req` says: locally, or (`push`) into the object store: its state
    /// is checkpointed (`processes: "all"`: files, sessions, background processes) and pushed,
    /// a paused record names that snapshot, and the sandbox leaves this daemon. Any daemon
    /// sharing the stores resumes it under its id ([`Runtime::resume`]).
    pub async fn pause_with(self: &Arc<Self>, id: &str, req: PauseSandbox) -> Result<PauseResult> {
        if !req.push {
            return self.pause(id, req.mode).await;
        }
        if req.mode == PauseMode::Filesystem {
            return Err(RuntimeError::BadRequest(
                "push keeps a sandbox's sessions and processes: pause with push and mode \"full\", or pause here with \
                 mode \"filesystem\""
                    .into(),
            ));
        }
        let t0 = Instant::now();
        let sb = self.pausable(id, PauseMode::Full)?;
        if !sb.volumes.lock().is_empty() {
            return Err(RuntimeError::Conflict(format!(
                "sandbox {id} mounts volumes, which a sandbox paused into the store does not carry yet: pause it \
                 here (without push), or sync its volumes and start a new sandbox with them where it should run"
            )));
        }
        let o = self.remote.open().await?;
        let snap =
            self.checkpoint(id, CheckpointRequest { label: Some("paused".into()), processes: Processes::All }).await?;
        let pushed = self.push_snapshot(&snap.id).await?;
        let record = bb_meta::Record {
            id: id.to_string(),
            kind: PAUSED_RECORD.into(),
            node: self.remote.node.clone(),
            created_at: now(),
            body: serde_json::to_string(&PushedPause {
                snapshot: snap.id.clone(),
                image: sb.spec.image.clone(),
                paused_at: now(),
            })
            .expect("a paused record serializes"),
        };
        meta(&o.meta, move |m| m.put_record(&record)).await?;
        let mut info = sb.info();
        self.kill(id).await?;
        info.state = "paused".into();
        let res = PauseResult {
            sandbox: info,
            processes: snap.processes.len() + snap.sessions.len(),
            sessions: snap.sessions.len(),
            image_bytes: pushed.read_bytes,
            took_ms: ms(t0),
            mode: PauseMode::Full,
            durability: "durable".into(),
            snapshot: Some(snap.id),
        };
        tracing::info!(sandbox = %id, snapshot = ?res.snapshot, took_ms = res.took_ms, "sandbox paused into the object store");
        Ok(res)
    }

    /// Resume a sandbox paused with `push` (on any daemon) here, under its id: the daemon
    /// takes a lease on it (a second resume elsewhere is refused), creates it from its
    /// snapshot, then deletes the paused record. A failure keeps the record: resume again.
    pub(crate) async fn resume_pushed(self: &Arc<Self>, id: &str, req: ResumeSandbox) -> Result<ResumeResult> {
        let t0 = Instant::now();
        if req.reboot {
            return Err(RuntimeError::BadRequest(format!(
                "sandbox {id} was paused into the object store, which resumes it with its processes: resume it \
                 without reboot"
            )));
        }
        let o = self.remote.open().await.map_err(|e| {
            tracing::debug!(sandbox = %id, "no metadata store to look for a pushed sandbox in: {e}");
            RuntimeError::sandbox(id)
        })?;
        let rid = id.to_string();
        let record = meta(&o.meta, move |m| m.get_record(&rid))
            .await?
            .filter(|r| r.kind == PAUSED_RECORD)
            .ok_or_else(|| RuntimeError::sandbox(id))?;
        let body: PushedPause = serde_json::from_str(&record.body)
            .map_err(|e| RemoteError::BadRecord { id: id.into(), why: e.to_string() })?;
        let (lease, holder) =
            (format!("sandbox/{id}"), format!("{}:{}", self.remote.node, uuid::Uuid::new_v4().simple()));
        let (l, h) = (lease.clone(), holder.clone());
        if !meta(&o.meta, move |m| m.acquire_lease(&l, &h, RESUME_LEASE)).await? {
            return Err(RuntimeError::Conflict(format!("sandbox {id} is being resumed by another daemon")));
        }
        let create =
            CreateSandbox { timeout: req.timeout, snapshot: Some(body.snapshot.clone()), ..Default::default() };
        let res = self.create_from_snapshot(&body.snapshot, create, Some(id.to_string())).await;
        let (l, h) = (lease.clone(), holder.clone());
        let released = move |m: Arc<bb_meta::Meta>| m.release_lease(&l, &h);
        let sb = match res {
            Ok(sb) => sb,
            Err(e) => {
                let _ = meta(&o.meta, released).await;
                return Err(e);
            }
        };
        let rid = id.to_string();
        meta(&o.meta, move |m| m.delete_record(&rid)).await?;
        let _ = meta(&o.meta, released).await;
        let sessions = sb.sessions.lock().await.len();
        let snap = self.snapshot_row(&body.snapshot)?;
        let res = ResumeResult {
            sandbox: sb.info(),
            processes: snap.processes.len() + sessions,
            sessions,
            took_ms: ms(t0),
            lazy_pages: false,
            rebooted: false,
        };
        tracing::info!(sandbox = %id, snapshot = %body.snapshot, from = %record.node, took_ms = res.took_ms, "pushed sandbox resumed");
        Ok(res)
    }

    /// The snapshot records in the metadata store, and the sandboxes paused into it.
    pub async fn list_remote(self: &Arc<Self>) -> Result<RemoteSnapshotList> {
        let o = self.remote.open().await?;
        let paused = meta(&o.meta, |m| m.list_records(Some(PAUSED_RECORD)))
            .await?
            .into_iter()
            .filter_map(|r| {
                let b: PushedPause = serde_json::from_str(&r.body).ok()?;
                Some(RemotePausedInfo {
                    id: r.id,
                    snapshot: b.snapshot,
                    image: b.image,
                    paused_at: b.paused_at,
                    node: r.node,
                })
            })
            .collect();
        let records = meta(&o.meta, |m| m.list_records(Some(SNAPSHOT_RECORD))).await?;
        let mut snapshots = Vec::new();
        for r in records {
            let b = match parse_record(&r) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(record = %r.id, "skipping an unreadable record: {e}");
                    continue;
                }
            };
            snapshots.push(RemoteSnapshotInfo {
                local: self.snapshots.records().get(&r.id)?.is_some(),
                id: r.id,
                sandbox_id: b.row.sandbox_id.clone(),
                parent: b.row.parent.clone(),
                label: b.row.label.clone(),
                created_at: b.row.created_at,
                pushed_at: b.pushed_at,
                node: r.node,
                image: b.row.spec.image.clone(),
                sessions: b.row.sessions.iter().map(|s| s.id.clone()).collect(),
                bytes: b.trees().map(|t| t.bytes).sum(),
            });
        }
        let (store, metadata) = self.remote.describe();
        Ok(RemoteSnapshotList { snapshots, paused, store, metadata })
    }

    /// Delete snapshot `sid`'s record from the metadata store (its objects go with the next
    /// collection); a local copy stays, node-local again.
    pub async fn delete_remote(self: &Arc<Self>, sid: &str) -> Result<()> {
        let o = self.remote.open().await?;
        let paused = meta(&o.meta, |m| m.list_records(Some(PAUSED_RECORD))).await?;
        if let Some(p) =
            paused.iter().find(|r| serde_json::from_str::<PushedPause>(&r.body).is_ok_and(|b| b.snapshot == sid))
        {
            return Err(RuntimeError::Conflict(format!(
                "snapshot {sid} holds sandbox {} paused into the store: resume (or kill) it first",
                p.id
            )));
        }
        let id = sid.to_string();
        if !meta(&o.meta, move |m| m.delete_record(&id)).await? {
            return Err(RuntimeError::NotFound {
                kind: "pushed snapshot",
                id: sid.into(),
                hint: ": list them with `branchbox snapshot ls --remote`",
            });
        }
        self.snapshots.records().clear_durable(sid)?;
        Ok(())
    }

    /// Collect the store's objects no snapshot record reaches (see the module docs).
    pub async fn store_gc(self: &Arc<Self>, req: StoreGcRequest) -> Result<StoreGcResult> {
        let t0 = Instant::now();
        let grace = match req.grace_seconds {
            None => self.remote.grace,
            Some(g) if g >= 0.0 && g.is_finite() => Duration::from_secs_f64(g),
            Some(_) => return Err(RuntimeError::BadRequest("grace_seconds must be >= 0".into())),
        };
        let o = self.remote.open().await?;
        let holder = format!("{}gc-{}", self.remote.holder_prefix, uuid::Uuid::new_v4().simple());
        let h = holder.clone();
        if !meta(&o.meta, move |m| m.begin_gc(&h, PUSH_TTL)).await? {
            return Err(RuntimeError::Conflict(
                "a push or another collection is under way on some daemon: collect again once it is done".into(),
            ));
        }
        let res = self.store_gc_locked(&o, grace).await;
        let h = holder.clone();
        if let Err(e) = meta(&o.meta, move |m| m.end_gc(&h)).await {
            tracing::warn!("ending a collection in the metadata store (it expires by itself): {e}");
        }
        let mut res = res?;
        res.took_ms = ms(t0);
        tracing::info!(deleted = res.deleted, bytes = res.deleted_bytes, young = res.young, "object store collected");
        Ok(res)
    }

    async fn store_gc_locked(&self, o: &Opened, grace: Duration) -> Result<StoreGcResult> {
        let records = meta(&o.meta, |m| m.list_records(Some(SNAPSHOT_RECORD))).await?;
        let mut trees: BTreeMap<String, TreeRef> = BTreeMap::new();
        for r in &records {
            // An unreadable record keeps the whole store: nothing is collected.
            for t in parse_record(r)?.trees() {
                trees.insert(t.id.clone(), t.clone());
            }
        }
        for h in meta(&o.meta, |m| m.list_heads(VOLUME_HEAD_PREFIX)).await? {
            let head: VolumeHead = serde_json::from_str(&h.value)
                .map_err(|e| RemoteError::BadHead { name: h.name.clone(), why: e.to_string() })?;
            for l in head.trees() {
                trees.insert(l.tree.id.clone(), l.tree.clone());
            }
        }
        // Names of trees no record reaches go first: a later push must not skip writing one.
        let names = meta(&o.meta, |m| Ok((m.list_objects("layer/")?, m.list_objects("image/")?))).await?;
        for (name, v) in names.0.into_iter().chain(names.1) {
            let reached = serde_json::from_str::<TreeRef>(&v).is_ok_and(|t| trees.contains_key(&t.id));
            if !reached {
                meta(&o.meta, move |m| m.delete_object(&name)).await?;
            }
        }
        let mut reachable = BTreeSet::new();
        for t in trees.values() {
            reachable.extend(o.store.tree_objects(t).await.map_err(RemoteError::from)?);
        }
        let all = o.store.list_objects().await.map_err(RemoteError::from)?;
        let cutoff = std::time::SystemTime::now() - grace;
        let (mut doomed, mut doomed_bytes, mut young) = (Vec::new(), 0, 0);
        for (key, modified, size) in &all {
            if reachable.contains(key) {
                continue;
            }
            if *modified > cutoff {
                young += 1;
                continue;
            }
            doomed.push(key.clone());
            doomed_bytes += size;
        }
        if !doomed.is_empty() {
            // Before deleting: a daemon that pushes next learns its remembered packs may be gone.
            let cur = meta(&o.meta, |m| m.head(GC_HEAD)).await?.map(|h| h.version);
            meta(&o.meta, move |m| m.cas_head(GC_HEAD, cur, "")).await?;
        }
        let deleted = o.store.delete_objects(&doomed).await.map_err(RemoteError::from)? as usize;
        Ok(StoreGcResult {
            objects: all.len(),
            reachable: reachable.len(),
            deleted,
            deleted_bytes: doomed_bytes,
            young,
            took_ms: 0.0,
        })
    }
}
/// The push, pull and collection futures must be `Send` (the API spawns them): a stream over
/// borrowed items in the store made them not provably so once. Compiling this is the check.
#[cfg(test)]
#[allow(dead_code)]
fn futures_are_send(rt: Arc<Runtime>) {
    fn is_send<T: Send>(_: T) {}
    let r = rt.clone();
    is_send(async move { r.push_snapshot("x").await });
    let r = rt.clone();
    is_send(async move { r.pull_snapshot("x").await });
    let r = rt.clone();
    is_send(async move { r.store_gc(Default::default()).await });
    is_send(async move { rt.list_remote().await });
}
