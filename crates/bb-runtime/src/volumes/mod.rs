//! Persistent volumes: named, mutable file trees that outlive sandboxes, mounted into them at
//! local-disk speed, with metadata-only snapshots, restores and copy-on-write forks.
//!
//! A volume is what a sandbox root is: a chain of frozen layers (`sl-v*` on the daemon's
//! encrypted volume filesystem, [`volfs`], shared with forks and snapshots) under one writable
//! layer, as one overlay instance. The daemon keeps that instance mounted at
//! `<state>/volumes/<id>/root` (the file API's view) and attaches clones of it in sandboxes
//! (`rootswap::mount_in_sandbox`): a sandbox writes to node-local disk through the kernel's
//! overlayfs, with nothing in between, and an fsync in the sandbox is an fsync of the node's disk.
//!
//! - **freeze** (`freeze`): the writable layer becomes a frozen layer and a fresh one goes on
//!   top; a sandbox that mounts the volume is frozen for the mount replacement, its files open
//!   for writing are pinned into the new layer and its processes with a working directory in
//!   the volume moved, as a root swap does ([`crate::snapshot::swap`]). Its cost does not depend
//!   on the volume's size.
//! - **snapshot** = freeze + a record of the chain; **restore** = the chain of a snapshot under a
//!   fresh writable layer (refused while a sandbox mounts it); **fork** = a new volume on the same
//!   chain (frozen first) with an empty writable layer.
//! - **sync** = freeze, push each layer not yet in the object store as a tree (`remote.rs`), then
//!   move the volume's head in the metadata store by compare-and-swap: two daemons never both
//!   commit on one head.
//! - **access**: `rwo` volumes are mounted by one sandbox at a time; `rox` volumes by any number,
//!   read-only, and written through the file API only while none mounts them.

mod branch;
pub mod cache;
mod durable;
pub mod store;
pub mod volfs;

pub(crate) use branch::PreparedVolume;

use crate::error::{Result, RuntimeError};
use crate::layers::{dir_is_empty, du};
use crate::model::{
    Access, CreateVolume, ForkVolume, RestoreVolume, VolumeInfo, VolumeList, VolumeMount, VolumeMountInfo,
    VolumeSnapshotInfo, VolumeSnapshotList, VolumeSnapshotRequest,
};
use crate::sandbox::files::{SandboxFs, SbPath};
use crate::sandbox::rootswap;
use crate::sandbox::Sandbox;
use crate::snapshot::swap::{rebase_cwds, Stragglers, REBASE_PATIENCE};
use crate::{now, Runtime};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use store::{MountRow, VolumeRow, VolumeSnapRow, VolumeStore};

/// Most volumes one sandbox mounts.
pub const MAX_MOUNTS: usize = 16;
/// How often a node renews the leases of the volumes it writes (they last
/// [`crate::remote::VOLUME_LEASE`]).
pub const LEASE_RENEW: std::time::Duration = std::time::Duration::from_secs(10);

/// Volume bookkeeping of the runtime: records, and per volume an operation lock and the gate of
/// its file API (shared by file operations, exclusive while its mount is replaced).
pub struct Volumes {
    records: Mutex<VolumeStore>,
    ops: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    gates: Mutex<HashMap<String, Arc<tokio::sync::RwLock<()>>>>,
    /// Volumes claimed by sandboxes being created (not in any sandbox's list yet).
    pending: Mutex<HashMap<String, usize>>,
    /// Serialises mounting of the host-side views.
    mounting: Mutex<()>,
    /// Per volume, devices of its replaced instances that processes may still reach through
    /// old fds (newest last): their writes are pinned at the next freeze too.
    stale_devs: Mutex<HashMap<String, Vec<u64>>>,
    /// The volumes' filesystem is set up (`Some(encrypted)`), see [`volfs`].
    fs_ready: Mutex<Option<bool>>,
    /// When each volume was last mounted or used through the file API ([`cache`]).
    used: Mutex<HashMap<String, std::time::Instant>>,
}

impl Volumes {
    pub(crate) fn open(db: &Path) -> Result<Volumes> {
        Ok(Volumes {
            records: Mutex::new(VolumeStore::open(db)?),
            ops: Default::default(),
            gates: Default::default(),
            pending: Default::default(),
            mounting: Default::default(),
            fs_ready: Default::default(),
            used: Default::default(),
            stale_devs: Default::default(),
        })
    }

    pub(crate) fn records(&self) -> parking_lot::MutexGuard<'_, VolumeStore> {
        self.records.lock()
    }

    fn op(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.ops.lock().entry(id.to_string()).or_default().clone()
    }

    fn gate(&self, id: &str) -> Arc<tokio::sync::RwLock<()>> {
        self.gates.lock().entry(id.to_string()).or_default().clone()
    }

    /// Every layer a volume or a volume snapshot stands on (kept by layer collection).
    pub(crate) fn layers_in_use(&self) -> Result<HashSet<String>> {
        let r = self.records();
        let mut used = HashSet::new();
        for v in r.all()? {
            used.extend(v.chain);
            used.insert(v.upper);
        }
        for s in r.snapshots(None)? {
            used.extend(s.chain);
        }
        Ok(used)
    }
}

/// Volumes claimed for a sandbox being created: released on drop unless attached.
pub(crate) struct Claims {
    rt: Arc<Runtime>,
    mounts: Vec<(VolumeRow, VolumeMount)>,
}

impl Claims {
    pub(crate) fn is_empty(&self) -> bool {
        self.mounts.is_empty()
    }
}

impl Drop for Claims {
    fn drop(&mut self) {
        let mut p = self.rt.volumes.pending.lock();
        for (row, _) in &self.mounts {
            if let Some(n) = p.get_mut(&row.id) {
                *n -= 1;
                if *n == 0 {
                    p.remove(&row.id);
                }
            }
        }
    }
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{}", &uuid::Uuid::new_v4().simple().to_string()[..16])
}

fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && !name.starts_with("vol-")
}

/// The normalised mount path of `m`, or why it cannot be one.
fn mount_path(m: &VolumeMount) -> Result<String> {
    if !m.path.starts_with('/') {
        return Err(RuntimeError::BadRequest(format!(
            "volume mount path {:?} is not absolute: give a path such as /workspace",
            m.path
        )));
    }
    let p = SbPath::parse(&m.path)?;
    let shown = p.display();
    let top = shown.split('/').nth(1).unwrap_or("");
    if p.is_root() || matches!(top, "proc" | "dev" | "sys") {
        return Err(RuntimeError::BadRequest(format!(
            "a volume cannot be mounted at {shown}: choose a path outside /, /proc, /dev and /sys, such as /workspace"
        )));
    }
    Ok(shown)
}

fn nested(a: &str, b: &str) -> bool {
    a == b || b.starts_with(&format!("{a}/")) || a.starts_with(&format!("{b}/"))
}

/// Let go of `f`, the last reference to an old volume instance, on a background thread: the
/// kernel tears the instance down (every cached inode of it) when its last reference goes,
/// which takes a while for a big tree and must not be on the path of an answer.
pub(crate) fn release_later(f: std::fs::File) {
    let spawned = std::thread::Builder::new().name("bb-vol-release".into()).spawn(move || {
        let _nice = bb_sys::process::niced_thread(19);
        drop(f);
    });
    if let Err(e) = spawned {
        tracing::warn!("releasing an old volume instance in the foreground: {e}");
    }
}

/// Refuse a freeze that would stack more layers than overlayfs mounts (volume chains are not
/// compacted yet).
fn check_depth(row: &VolumeRow) -> Result<()> {
    let max = crate::snapshot::swap::OVERLAY_MAX_LOWER - 1;
    if row.chain.len() >= max {
        return Err(RuntimeError::Conflict(format!(
            "volume {} stands on {} layers and overlayfs stacks at most {max} under a writable one: copy its \
             files into a new volume (volume chains are not compacted yet)",
            row.id,
            row.chain.len()
        )));
    }
    Ok(())
}

fn is_mountpoint(p: &Path) -> bool {
    match (std::fs::metadata(p), p.parent().map(std::fs::metadata)) {
        (Ok(m), Some(Ok(parent))) => m.dev() != parent.dev(),
        _ => false,
    }
}

impl Runtime {
    fn volumes_dir(&self) -> PathBuf {
        self.cfg.state_dir.join("volumes")
    }

    fn volume_dir(&self, id: &str) -> PathBuf {
        self.volumes_dir().join(id)
    }

    fn volume_root(&self, id: &str) -> PathBuf {
        self.volume_dir(id).join("root")
    }

    pub(crate) fn volume_row(&self, id_or_name: &str) -> Result<VolumeRow> {
        self.volumes.records().get(id_or_name)?.ok_or_else(|| RuntimeError::NotFound {
            kind: "volume",
            id: id_or_name.into(),
            hint: ": list volumes with `branchbox volume ls`",
        })
    }

    /// A fresh, empty writable layer for a volume on `chain` (owned by the sandbox root, like a
    /// sandbox's) and the work dir of mount generation `n`. On the volumes' encrypted filesystem
    /// ([`volfs`]) unless the chain has layers made before it was used: an overlay instance keeps
    /// all its layers on one filesystem (pinning open files at a freeze matches inode numbers).
    fn volume_upper(&self, id: &str, n: u64, chain: &[String]) -> Result<String> {
        let lid = if chain.iter().all(|l| l.starts_with(volfs::LAYER_PREFIX)) {
            self.volume_fs_ready()?;
            format!("{}{}", volfs::LAYER_PREFIX, uuid::Uuid::new_v4().simple())
        } else {
            let layers = crate::sandbox::launch::snaplayers_dir(&self.cfg.state_dir);
            std::fs::create_dir_all(&layers).map_err(RuntimeError::io("create the layers dir"))?;
            format!("sl-{}", uuid::Uuid::new_v4().simple())
        };
        let upper = self.layer_path(&lid);
        std::fs::create_dir(&upper).map_err(RuntimeError::io("create a volume's writable layer"))?;
        let base = self.cfg.idmap.host_base;
        std::os::unix::fs::chown(&upper, Some(base), Some(base)).map_err(RuntimeError::io("chown a writable layer"))?;
        std::fs::set_permissions(&upper, std::fs::Permissions::from_mode(0o755))
            .map_err(RuntimeError::io("chmod a writable layer"))?;
        let work = self.volume_work(id, n, &lid);
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).map_err(RuntimeError::io("create a volume's work dir"))?;
        std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o700))
            .map_err(RuntimeError::io("chmod a work dir"))?;
        Ok(lid)
    }

    /// The overlay work dir of volume `id`'s mount generation `n`, on the filesystem of its
    /// writable layer `upper`.
    fn volume_work(&self, id: &str, n: u64, upper: &str) -> PathBuf {
        if upper.starts_with(volfs::LAYER_PREFIX) {
            volfs::work_dir(&self.cfg.state_dir, id).join(n.to_string())
        } else {
            self.volume_dir(id).join(format!("work-{n}"))
        }
    }

    /// Remove the overlay work dir of volume `id`'s mount generation `n` (wherever it is).
    fn remove_volume_work(&self, id: &str, n: u64) {
        let _ = std::fs::remove_dir_all(volfs::work_dir(&self.cfg.state_dir, id).join(n.to_string()));
        let _ = std::fs::remove_dir_all(self.volume_dir(id).join(format!("work-{n}")));
    }

    /// Remove what volume `id` kept on this node besides its layers.
    fn remove_volume_dirs(&self, id: &str) {
        let _ = std::fs::remove_dir_all(self.volume_dir(id));
        let _ = std::fs::remove_dir_all(volfs::work_dir(&self.cfg.state_dir, id));
    }

    /// A new overlay instance of `row` (detached).
    fn volume_instance(&self, row: &VolumeRow) -> Result<OwnedFd> {
        self.volume_fs_ready()?;
        let mut lower: Vec<PathBuf> = row.chain.iter().rev().map(|l| self.layer_path(l)).collect();
        if lower.is_empty() {
            // On the layers' filesystem: an overlay whose layers share one filesystem shows its
            // files' real inode numbers, which pinning open files at a freeze matches.
            let empty = if row.upper.starts_with(volfs::LAYER_PREFIX) {
                volfs::empty_dir(&self.cfg.state_dir)
            } else {
                self.volumes_dir().join(".empty")
            };
            std::fs::create_dir_all(&empty).map_err(RuntimeError::io("create the empty layer"))?;
            lower.push(empty);
        }
        let upper = self.layer_path(&row.upper);
        let work = self.volume_work(&row.id, row.n, &row.upper);
        std::fs::create_dir_all(&work).map_err(RuntimeError::io("create a volume's work dir"))?;
        Ok(bb_layers::overlay_fd(
            &bb_layers::OverlaySpec { lower: &lower, upper: &upper, work: &work },
            &self.volume_root(&row.id),
        )?)
    }

    /// Mount the host-side view of `row` unless it is (a daemon killed earlier leaves it
    /// mounted: the same instance its sandboxes still use).
    /// Layers the node let go ([`cache`]) are pulled back first.
    fn ensure_volume_mounted(&self, row: &VolumeRow) -> Result<PathBuf> {
        self.volumes.touch(&row.id);
        for _ in 0..3 {
            {
                let _m = self.volumes.mounting.lock();
                let root = self.volume_root(&row.id);
                if is_mountpoint(&root) {
                    return Ok(root);
                }
                if self.chain_local(&row.chain) {
                    std::fs::create_dir_all(&root).map_err(RuntimeError::io("create a volume's mount point"))?;
                    let fd = self.volume_instance(row)?;
                    bb_sys::mount_api::move_mount_to(fd.as_fd(), &root).map_err(RuntimeError::from)?;
                    return Ok(root);
                }
            }
            self.pull_missing_layers_blocking(row)?;
        }
        Err(RuntimeError::Conflict(format!(
            "volume {}'s layers keep leaving the node's cache while it is mounted: raise --volume-cache-mb",
            row.id
        )))
    }

    fn unmount_volume_view(&self, id: &str) {
        let _m = self.volumes.mounting.lock();
        self.unmount_view_locked(id);
    }

    /// [`Self::unmount_volume_view`] with the mounting lock held.
    fn unmount_view_locked(&self, id: &str) {
        let root = self.volume_root(id);
        let held = std::fs::File::open(&root).ok();
        while is_mountpoint(&root) {
            if bb_layers::unmount(&root).is_err() {
                break;
            }
        }
        if let Some(f) = held {
            release_later(f);
        }
    }

    /// The sandbox that mounts volume `id`, and where (an `rwo` volume has at most one).
    fn volume_holders(&self, id: &str) -> Vec<(Arc<Sandbox>, VolumeMount)> {
        let mut out = Vec::new();
        for sb in self.sandboxes.all() {
            for m in sb.volumes.lock().iter() {
                if m.volume == id {
                    out.push((sb.clone(), m.clone()));
                }
            }
        }
        out
    }

    /// Bytes of frozen volume layer `l`: its recorded size, or, for a layer frozen so recently
    /// that `measure_layers_later` has not recorded it yet, measured now (not recorded here:
    /// a layer dir met outside a volume's row may still be a writable layer being set up).
    fn frozen_layer_size(&self, l: &str) -> Result<u64> {
        Ok(match self.snapshots.records().layer_size(l)? {
            Some(b) => b,
            None => du(&self.layer_path(l)),
        })
    }

    /// Bytes of layer `l` of a volume's chain: [`frozen_layer_size`](Self::frozen_layer_size),
    /// recorded when measured here (a layer in a chain is frozen: it never changes), so only the
    /// first status after a freeze walks it, not each one until the background measurement lands.
    fn chain_layer_size(&self, l: &str) -> Result<u64> {
        if let Some(b) = self.snapshots.records().layer_size(l)? {
            return Ok(b);
        }
        // (The records are not held during the walk.)
        let b = du(&self.layer_path(l));
        if let Err(e) = self.snapshots.records().set_layer_size(l, b) {
            tracing::debug!(layer = %l, "recording a frozen layer's size: {e}");
        }
        Ok(b)
    }

    /// Ids of volume `id`'s own snapshots, sorted: what its committed head should carry.
    fn own_snapshot_ids(&self, id: &str) -> Result<Vec<String>> {
        let mut ids: Vec<String> = self.volumes.records().own_snapshots(id)?.into_iter().map(|s| s.id).collect();
        ids.sort();
        Ok(ids)
    }

    /// Volume `row`'s committed head holds its frozen chain and its own snapshots as they are
    /// (what was written since the last freeze aside).
    pub(crate) fn head_holds(&self, row: &VolumeRow) -> Result<bool> {
        let Some(synced) = &row.synced else { return Ok(false) };
        Ok(synced.chain == row.chain && synced.snapshots == self.own_snapshot_ids(&row.id)?)
    }

    fn volume_info_of(&self, row: &VolumeRow) -> Result<VolumeInfo> {
        let snaps = self.volumes.records().snapshots(Some(&row.id))?.len();
        let upper_dir = self.layer_path(&row.upper);
        let upper_bytes = du(&upper_dir);
        let mut size = upper_bytes;
        let mut backlog = upper_bytes;
        let synced: HashSet<&String> = row.synced.iter().flat_map(|s| s.chain.iter()).collect();
        for l in &row.chain {
            let b = self.chain_layer_size(l)?;
            size += b;
            if !synced.contains(l) {
                backlog += b;
            }
        }
        let durable = self.head_holds(row)? && dir_is_empty(&upper_dir);
        Ok(VolumeInfo {
            id: row.id.clone(),
            name: row.name.clone(),
            access: row.access,
            quota_mb: row.quota_mb,
            created_at: row.created_at,
            size_bytes: size,
            layers: row.chain.len(),
            snapshots: snaps,
            mounts: self
                .volume_holders(&row.id)
                .into_iter()
                .map(|(sb, m)| VolumeMountInfo {
                    sandbox: sb.id.clone(),
                    path: m.path,
                    read_only: m.read_only,
                    branch: m.branch,
                })
                .collect(),
            version: row.synced.as_ref().map_or(0, |s| s.version),
            durability: if durable { "durable" } else { "node-local" }.into(),
            backlog_bytes: if durable { 0 } else { backlog },
            source: row.source.clone(),
            encrypted_at_rest: self.volume_fs_encrypted() == Some(true)
                && row.chain.iter().chain([&row.upper]).all(|l| l.starts_with(volfs::LAYER_PREFIX)),
            cached: self.chain_local(&row.chain),
        })
    }

    pub async fn create_volume(self: &Arc<Self>, req: CreateVolume) -> Result<VolumeInfo> {
        if let Some(n) = &req.name {
            if !valid_name(n) {
                return Err(RuntimeError::BadRequest(format!(
                    "volume name {n:?}: use 1-63 letters, digits, '-', '_' or '.', starting with a letter or digit, not 'vol-'"
                )));
            }
        }
        if req.quota_mb == Some(0) {
            return Err(RuntimeError::BadRequest("quota_mb must be at least 1 (leave it out for no quota)".into()));
        }
        let rt = self.clone();
        tokio::task::spawn_blocking(move || {
            if let Some(n) = &req.name {
                if rt.volumes.records().get(n)?.is_some() {
                    return Err(RuntimeError::Conflict(format!("a volume named {n:?} exists: choose another name")));
                }
            }
            let named = req.name.clone();
            let row = rt
                .insert_new_volume(VolumeRow {
                    id: new_id("vol"),
                    name: req.name,
                    access: req.access,
                    quota_mb: req.quota_mb,
                    created_at: now(),
                    chain: Vec::new(),
                    upper: String::new(),
                    n: 0,
                    source: None,
                    synced: None,
                })
                .map_err(|e| match named {
                    Some(n) if e.to_string().contains("UNIQUE") => {
                        RuntimeError::Conflict(format!("a volume named {n:?} exists: choose another name"))
                    }
                    _ => e,
                })?;
            tracing::info!(volume = %row.id, name = ?row.name, "volume created");
            rt.volume_info_of(&row)
        })
        .await
        .map_err(RuntimeError::Worker)?
    }

    /// Every volume of this node as (id, name), from its records alone: nothing measured (a
    /// listing of names that [`list_volumes`](Self::list_volumes) would make walk every
    /// writable layer).
    pub fn volume_names(&self) -> Result<Vec<(String, Option<String>)>> {
        Ok(self.volumes.records().all()?.into_iter().map(|r| (r.id, r.name)).collect())
    }

    /// How volume `vid` (an id or a name) may be mounted, if this node knows it.
    pub fn volume_access(&self, vid: &str) -> Option<Access> {
        self.volumes.records().get(vid).ok().flatten().map(|r| r.access)
    }

    pub fn list_volumes(&self) -> Result<VolumeList> {
        let rows = self.volumes.records().all()?;
        Ok(VolumeList { volumes: rows.iter().map(|r| self.volume_info_of(r)).collect::<Result<_>>()? })
    }

    /// The id of volume `vid` (an id or a name; opened from the metadata store if only it
    /// knows the volume), without measuring it as [`volume_info`](Self::volume_info) does.
    pub async fn volume_id(self: &Arc<Self>, vid: &str) -> Result<String> {
        self.open_volume(vid).await
    }

    /// Volume `vid` (opened from the metadata store if only it knows the volume).
    pub async fn volume_info(self: &Arc<Self>, vid: &str) -> Result<VolumeInfo> {
        let id = self.open_volume(vid).await?;
        let rt = self.clone();
        tokio::task::spawn_blocking(move || rt.volume_info_of(&rt.volume_row(&id)?))
            .await
            .map_err(RuntimeError::Worker)?
    }

    /// Delete a volume and its snapshots (refused while a sandbox mounts it), here and, once
    /// synced, its head in the metadata store. Its layers go unless a fork or another volume's
    /// snapshot stands on them; its objects with the next `store gc`.
    pub async fn delete_volume(self: &Arc<Self>, vid: &str) -> Result<()> {
        let row = self.volume_row(vid)?;
        let op = self.volumes.op(&row.id);
        let _op = op.lock().await;
        self.refuse_mounted(&row, "delete it")?;
        // A synced volume leaves the metadata store too (by the node that may write it).
        if let Some(synced) = &row.synced {
            // Only the node that may write it deletes the committed head; a node that lost the
            // volume to another one (its lease, or a newer commit) deletes its own copy only.
            let ours = match row.access {
                Access::Rox => true,
                Access::Rwo | Access::Rwx => match self.hold_volume(&row.id).await {
                    Ok(()) => true,
                    Err(RuntimeError::Conflict(why)) => {
                        tracing::info!(volume = %row.id, "deleting this node's copy only: {why}");
                        false
                    }
                    Err(e) => return Err(e),
                },
            };
            if ours {
                let deleted = self.delete_volume_head(&row.id, synced.version).await;
                self.release_volume(&row.id).await;
                if !deleted? {
                    tracing::info!(volume = %row.id, "committed elsewhere since this node synced it: deleting this node's copy only");
                }
            }
        }
        let gate = self.volumes.gate(&row.id);
        let _gate = gate.write().await;
        let rt = self.clone();
        tokio::task::spawn_blocking(move || {
            rt.unmount_volume_view(&row.id);
            let mut own: Vec<String> = row.chain.clone();
            for vs in rt.volumes.records().snapshots(Some(&row.id))? {
                own.extend(vs.chain);
            }
            own.sort();
            own.dedup();
            rt.volumes.records().delete(&row.id)?;
            rt.remove_layer_dir(&row.upper);
            rt.remove_volume_dirs(&row.id);
            let used = rt.volumes.layers_in_use()?;
            let snaps = rt.snapshots.records().all()?;
            let in_snapshots: HashSet<&String> = snaps.iter().flat_map(|s| s.layers.iter()).collect();
            for l in own.iter().filter(|l| !used.contains(*l) && !in_snapshots.contains(l)) {
                rt.remove_layer_dir(l);
                let _ = rt.snapshots.records().forget_layer(l);
            }
            tracing::info!(volume = %row.id, "volume deleted");
            Ok(())
        })
        .await
        .map_err(RuntimeError::Worker)?
    }

    fn refuse_mounted(&self, row: &VolumeRow, what: &str) -> Result<()> {
        let holders = self.volume_holders(&row.id);
        let pending = self.volumes.pending.lock().get(&row.id).copied().unwrap_or(0);
        if let Some((sb, m)) = holders.first() {
            return Err(RuntimeError::Conflict(format!(
                "volume {} is mounted in sandbox {} at {}: kill that sandbox first, then {what}",
                row.id, sb.id, m.path
            )));
        }
        if pending > 0 {
            return Err(RuntimeError::Conflict(format!(
                "volume {} is being mounted in a sandbox that is starting: kill it first, then {what}",
                row.id
            )));
        }
        Ok(())
    }

    /// Freeze volume `id`'s writable layer into its chain (see the module docs); returns the
    /// row after it. Holds the volume's operation lock and its file gate; mounts of the
    /// sandboxes that mount it are held still.
    async fn freeze_volume(self: &Arc<Self>, id: &str) -> Result<VolumeRow> {
        let row = self.volume_row(id)?;
        let gate = self.volumes.gate(&row.id);
        loop {
            let holders = self.live_holders(&row.id);
            // Each holder's mounts lock, in one order (a shared volume has several holders),
            // then the volume's gate.
            let mut mounts = Vec::with_capacity(holders.len());
            for (sb, _) in &holders {
                mounts.push(sb.mounts.lock().await);
            }
            let _gate = gate.write().await;
            // A sandbox attaches a volume holding its gate: one that attached it since the
            // holders were listed would keep the old instance. List them again then.
            let same = |now: &[(Arc<Sandbox>, VolumeMount)]| {
                now.len() == holders.len() && now.iter().zip(&holders).all(|(a, b)| a.0.id == b.0.id)
            };
            if !same(&self.live_holders(&row.id)) {
                continue;
            }
            let (rt, id, holders) = (self.clone(), row.id.clone(), holders.clone());
            let (before, after) = tokio::task::spawn_blocking(move || {
                let row = rt.volume_row(&id)?;
                Ok::<_, RuntimeError>((row.upper.clone(), rt.freeze_blocking(row, holders)?))
            })
            .await
            .map_err(RuntimeError::Worker)??;
            drop(mounts);
            if after.upper != before {
                self.measure_layers_later(vec![before]);
            }
            return Ok(after);
        }
    }

    /// The live sandboxes that mount volume `id`, by sandbox id.
    fn live_holders(&self, id: &str) -> Vec<(Arc<Sandbox>, VolumeMount)> {
        let mut holders: Vec<(Arc<Sandbox>, VolumeMount)> =
            self.volume_holders(id).into_iter().filter(|(sb, _)| !sb.is_dead()).collect();
        holders.sort_by(|a, b| a.0.id.cmp(&b.0.id));
        holders
    }

    /// Record the sizes of frozen layers in the background (a walk of every file: not on the
    /// path of the answer).
    pub(crate) fn measure_layers_later(self: &Arc<Self>, layers: Vec<String>) {
        if layers.is_empty() {
            return;
        }
        let rt = self.clone();
        tokio::task::spawn_blocking(move || {
            let _nice = bb_sys::process::niced_thread(10);
            for l in layers {
                if rt.snapshots.records().layer_size(&l).ok().flatten().is_some() {
                    continue;
                }
                let size = du(&rt.layer_path(&l));
                let _ = rt.snapshots.records().set_layer_size(&l, size);
            }
        });
    }

    /// Freeze volume `row` (see the module doc); `holders`: the sandboxes that mount it, where.
    /// A mounted volume goes through the steps a checkpoint takes it through ([`branch`]),
    /// in a freeze of its own, with every sandbox that mounts it frozen.
    fn freeze_blocking(&self, row: VolumeRow, holders: Vec<(Arc<Sandbox>, VolumeMount)>) -> Result<VolumeRow> {
        let t0 = std::time::Instant::now();
        // (A sandbox killed since it was listed is left out.)
        let holders: Vec<(Arc<Sandbox>, VolumeMount)> = holders.into_iter().filter(|(sb, _)| !sb.is_dead()).collect();
        let Some((_, first)) = holders.first() else {
            if dir_is_empty(&self.layer_path(&row.upper)) {
                return Ok(row);
            }
            check_depth(&row)?;
            let mut next = row.clone();
            next.chain.push(row.upper.clone());
            next.n = row.n + 1;
            next.upper = self.volume_upper(&row.id, next.n, &next.chain)?;
            self.unmount_volume_view(&row.id);
            if let Err(e) = self.volumes.records().update(&next) {
                self.remove_layer_dir(&next.upper);
                return Err(e.into());
            }
            self.remove_volume_work(&row.id, row.n);
            return Ok(next);
        };
        let mut prepared = self.prepare_volume_checkpoint(std::slice::from_ref(first))?;
        let next = prepared[0].next.clone();
        if prepared[0].swap.is_none() {
            return Ok(next);
        }
        let mut frozen: Vec<&Sandbox> = Vec::with_capacity(holders.len());
        let mut stale = Vec::new();
        let mut swapped = Ok(());
        for (sb, _) in &holders {
            if let Err(e) = sb.cgroup.freeze() {
                swapped = Err(e.into());
                break;
            }
            frozen.push(sb);
        }
        if swapped.is_ok() {
            swapped = self.swap_mounts_frozen(&holders, &mut prepared[0], &mut stale);
        }
        let mut thawed = Ok(());
        for sb in frozen {
            if let Err(e) = sb.cgroup.thaw() {
                thawed = Err(e);
            }
        }
        drop(Stragglers(rebase_cwds(stale, Some(std::time::Instant::now() + REBASE_PATIENCE))));
        self.finish_volume_swaps(prepared, false);
        swapped?;
        thawed?;
        // The freeze happened: a sandbox whose file API view could not follow is told, not failed.
        for (sb, m) in &holders {
            if let Err(e) = self.mount_in_host_view(&sb.rootfs(), m) {
                tracing::warn!(sandbox = %sb.id, path = %m.path, "the file API does not see the volume at this path: {e}");
            }
        }
        tracing::debug!(volume = %row.id, layers = next.chain.len(), holders = holders.len(), took = ?t0.elapsed(), "volume frozen");
        Ok(next)
    }

    pub async fn snapshot_volume(
        self: &Arc<Self>,
        vid: &str,
        req: VolumeSnapshotRequest,
    ) -> Result<VolumeSnapshotInfo> {
        let id = self.open_volume(vid).await?;
        let op = self.volumes.op(&id);
        let _op = op.lock().await;
        let row = self.freeze_volume(&id).await?;
        let snap = VolumeSnapRow {
            id: new_id("vs"),
            volume: id,
            created_at: now(),
            label: req.label,
            chain: row.chain,
            checkpoint: None,
        };
        self.volumes.records().insert_snapshot(&snap)?;
        Ok(snap_info(&snap, row.synced.as_ref()))
    }

    /// Volume `vid`'s snapshots, oldest first (a volume synced by another node is opened here:
    /// its own snapshots come with it).
    pub async fn volume_snapshots(self: &Arc<Self>, vid: &str) -> Result<VolumeSnapshotList> {
        let row = self.volume_row(&self.open_volume(vid).await?)?;
        let snaps = self.volumes.records().snapshots(Some(&row.id))?;
        Ok(VolumeSnapshotList { snapshots: snaps.iter().map(|s| snap_info(s, row.synced.as_ref())).collect() })
    }

    fn volume_snapshot_of(&self, volume: &str, vsid: &str) -> Result<VolumeSnapRow> {
        match self.volumes.records().snapshot(vsid)? {
            Some(s) if s.volume == volume => Ok(s),
            _ => Err(RuntimeError::NotFound {
                kind: "volume snapshot",
                id: vsid.into(),
                hint: ": list the volume's snapshots with `branchbox volume snapshots VOLUME`",
            }),
        }
    }

    /// Delete snapshot `vsid` of volume `vid`. On a synced volume, the next sync (or the
    /// background uploader) drops it from the committed head too.
    pub async fn delete_volume_snapshot(self: &Arc<Self>, vid: &str, vsid: &str) -> Result<()> {
        let id = self.open_volume(vid).await?;
        let op = self.volumes.op(&id);
        let _op = op.lock().await;
        self.volume_snapshot_of(&id, vsid)?;
        self.volumes.records().delete_snapshot(vsid)?;
        Ok(())
    }

    /// Put volume `vid` back to snapshot `req.snapshot`: what was written since is discarded.
    /// Refused while a sandbox mounts it (roll the sandbox back instead).
    pub async fn restore_volume(self: &Arc<Self>, vid: &str, req: RestoreVolume) -> Result<VolumeInfo> {
        let id = self.open_volume(vid).await?;
        let op = self.volumes.op(&id);
        let _op = op.lock().await;
        let row = self.volume_row(&id)?;
        let snap = self.volume_snapshot_of(&id, &req.snapshot)?;
        self.refuse_mounted(&row, "restore it (or roll that sandbox back to a checkpoint)")?;
        // A snapshot opened from the metadata store: its layers come to the node first.
        if !self.chain_local(&snap.chain) {
            self.volume_fs_ready_async().await?;
            self.pull_missing_layers(&id, &snap.chain).await?;
        }
        let gate = self.volumes.gate(&id);
        let _gate = gate.write().await;
        let rt = self.clone();
        tokio::task::spawn_blocking(move || {
            let n = row.n + 1;
            let upper = rt.volume_upper(&row.id, n, &snap.chain)?;
            rt.unmount_volume_view(&row.id);
            let next = VolumeRow { chain: snap.chain.clone(), upper, n, ..row.clone() };
            if let Err(e) = rt.volumes.records().update(&next) {
                rt.remove_layer_dir(&next.upper);
                return Err(e.into());
            }
            rt.remove_layer_dir(&row.upper);
            rt.remove_volume_work(&row.id, row.n);
            tracing::info!(volume = %row.id, snapshot = %snap.id, "volume restored");
            rt.volume_info_of(&next)
        })
        .await
        .map_err(RuntimeError::Worker)?
    }

    /// A new volume sharing `vid`'s layers (its current state, frozen first, or a snapshot's):
    /// no data is copied.
    pub async fn fork_volume(self: &Arc<Self>, vid: &str, req: ForkVolume) -> Result<VolumeInfo> {
        if let Some(n) = &req.name {
            if !valid_name(n) {
                return Err(RuntimeError::BadRequest(format!(
                    "volume name {n:?}: use 1-63 letters, digits, '-', '_' or '.', starting with a letter or digit, not 'vol-'"
                )));
            }
            if self.volumes.records().get(n)?.is_some() {
                return Err(RuntimeError::Conflict(format!("a volume named {n:?} exists: choose another name")));
            }
        }
        // This node's copy as it is (also one that diverged from the committed head).
        let local = self.volumes.records().get(vid)?;
        let source = match local {
            Some(row) => row,
            None => self.volume_row(&self.open_volume(vid).await?)?,
        };
        // Held until the fork stands on the chain: the node's cache keeps its layers from then on.
        let op = self.volumes.op(&source.id);
        let _op = op.lock().await;
        let chain = match &req.snapshot {
            Some(s) => self.volume_snapshot_of(&source.id, s)?.chain,
            None => self.freeze_volume(&source.id).await?.chain,
        };
        // A fork is not durable: the layers it stands on come back to the node first.
        if !self.chain_local(&chain) {
            self.volume_fs_ready_async().await?;
            self.pull_missing_layers(&source.id, &chain).await?;
        }
        self.new_volume_on(&source, chain, req.name).await
    }

    /// Record new volume `row` with an empty writable layer on its chain (its `upper` and `n` are
    /// set here). What it made goes again if the record fails. Blocking.
    pub(crate) fn insert_new_volume(&self, mut row: VolumeRow) -> Result<VolumeRow> {
        row.n = 0;
        row.upper = self.volume_upper(&row.id, 0, &row.chain)?;
        if let Err(e) = self.volumes.records().insert(&row) {
            self.remove_layer_dir(&row.upper);
            self.remove_volume_dirs(&row.id);
            return Err(e.into());
        }
        Ok(row)
    }

    /// A new volume on `chain` with `source`'s settings and an empty writable layer.
    async fn new_volume_on(
        self: &Arc<Self>,
        source: &VolumeRow,
        chain: Vec<String>,
        name: Option<String>,
    ) -> Result<VolumeInfo> {
        let rt = self.clone();
        let source = source.clone();
        tokio::task::spawn_blocking(move || {
            let row = rt.insert_new_volume(VolumeRow {
                id: new_id("vol"),
                name,
                access: source.access,
                quota_mb: source.quota_mb,
                created_at: now(),
                chain,
                upper: String::new(),
                n: 0,
                source: Some(source.id.clone()),
                synced: None,
            })?;
            tracing::info!(volume = %row.id, source = %source.id, layers = row.chain.len(), "volume forked");
            rt.volume_info_of(&row)
        })
        .await
        .map_err(RuntimeError::Worker)?
    }

    /// Make volume `vid` durable: freeze, push its layers to the object store, commit its head.
    pub async fn sync_volume(self: &Arc<Self>, vid: &str) -> Result<VolumeInfo> {
        let id = self.open_volume(vid).await?;
        let op = self.volumes.op(&id);
        let _op = op.lock().await;
        let row = self.freeze_volume(&id).await?;
        if self.head_holds(&row)? {
            return self.volume_info_of(&row);
        }
        let snaps = self.volumes.records().own_snapshots(&id)?;
        let expected = row.synced.as_ref().map(|s| s.version);
        // One node commits a writable volume: the one holding its lease.
        if row.access.writable() {
            self.hold_volume(&id).await?;
        }
        let committed = self.commit_volume(&row, &snaps, expected).await;
        let mounted_rw = self.volume_holders(&id).iter().any(|(_, m)| !m.read_only);
        if row.access.writable() && !mounted_rw {
            self.release_volume(&id).await;
        }
        let version = committed?;
        let mut snapshots: Vec<String> = snaps.into_iter().map(|s| s.id).collect();
        snapshots.sort();
        let next = VolumeRow { synced: Some(store::Synced { version, chain: row.chain.clone(), snapshots }), ..row };
        self.volumes.records().update(&next)?;
        self.volume_info_of(&next)
    }

    /// Bytes volume `vid` may still take under its quota (None: no quota). What it holds on
    /// this node counts: its frozen layers and its writable layer.
    pub async fn volume_room(self: &Arc<Self>, vid: &str) -> Result<Option<u64>> {
        let row = self.volume_row(&self.open_volume(vid).await?)?;
        let Some(q) = row.quota_mb else { return Ok(None) };
        let rt = self.clone();
        let used = tokio::task::spawn_blocking(move || rt.volume_info_of(&row).map(|i| i.size_bytes))
            .await
            .map_err(RuntimeError::Worker)??;
        Ok(Some((q << 20).saturating_sub(used)))
    }

    /// The file API of volume `vid`: its host-side view, gated. `write`: the caller changes
    /// files (refused on a `rox` volume while sandboxes mount it).
    pub async fn volume_fs(self: &Arc<Self>, vid: &str, write: bool) -> Result<SandboxFs> {
        let row = self.volume_row(&self.open_volume(vid).await?)?;
        if write && row.access == Access::Rox {
            if let Some((sb, _)) = self.volume_holders(&row.id).first() {
                return Err(RuntimeError::Conflict(format!(
                    "volume {} is rox and mounted read-only in sandbox {}: change it while no sandbox mounts it",
                    row.id, sb.id
                )));
            }
        }
        let gate = self.volumes.gate(&row.id).read_owned().await;
        // The row may have changed while the gate was held by a freeze.
        let row = self.volume_row(&row.id)?;
        let rt = self.clone();
        tokio::task::spawn_blocking(move || {
            let root = rt.ensure_volume_mounted(&row)?;
            SandboxFs::open_gated(&root, rt.cfg.idmap.host_base, gate)
        })
        .await
        .map_err(RuntimeError::Worker)?
    }

    /// Check the volumes a sandbox asks for and claim them until it is created.
    pub(crate) fn claim_volumes(self: &Arc<Self>, mounts: &[VolumeMount]) -> Result<Claims> {
        if mounts.len() > MAX_MOUNTS {
            return Err(RuntimeError::BadRequest(format!("a sandbox mounts at most {MAX_MOUNTS} volumes")));
        }
        let mut claims = Claims { rt: self.clone(), mounts: Vec::new() };
        let mut paths: Vec<String> = Vec::new();
        for m in mounts {
            let path = mount_path(m)?;
            if let Some(p) = paths.iter().find(|p| nested(p, &path)) {
                return Err(RuntimeError::BadRequest(format!(
                    "volume mounts {p} and {path} overlap: give each volume its own, separate path"
                )));
            }
            paths.push(path.clone());
            let row = self.volume_row(&m.volume)?;
            if claims.mounts.iter().any(|(r, _)| r.id == row.id) {
                return Err(RuntimeError::BadRequest(format!("volume {} is listed twice: mount it once", row.id)));
            }
            if row.access == Access::Rox && !m.read_only {
                return Err(RuntimeError::BadRequest(format!(
                    "volume {} is rox (read-only for many): mount it with read_only",
                    row.id
                )));
            }
            let mut pending = self.volumes.pending.lock();
            if row.access == Access::Rwo {
                let holder = self.volume_holders(&row.id).into_iter().next().map(|(sb, _)| sb.id.clone());
                if holder.is_some() || pending.contains_key(&row.id) {
                    return Err(RuntimeError::Conflict(format!(
                        "volume {} is rwo and already mounted in sandbox {}: kill that sandbox, or fork the volume (`branchbox volume fork`)",
                        row.id,
                        holder.unwrap_or_else(|| "being created".into())
                    )));
                }
            }
            *pending.entry(row.id.clone()).or_default() += 1;
            drop(pending);
            // Shared data does not branch: every sandbox sees the one volume.
            let branch = m.branch && !row.access.shared();
            claims.mounts.push((row, VolumeMount { path, branch, ..m.clone() }));
        }
        Ok(claims)
    }

    /// Mount claimed volumes in the new sandbox `sb` (blocking: on a blocking thread). Each
    /// with its gate held, so a freeze of a shared volume sees every sandbox that mounts it.
    pub(crate) fn attach_volumes(&self, sb: &Sandbox, claims: Claims) -> Result<()> {
        for (row, m) in &claims.mounts {
            let gate = self.volumes.gate(&row.id);
            let _gate = gate.blocking_read();
            let row = self.volume_row(&row.id)?;
            let root = self.ensure_volume_mounted(&row)?;
            let path = SbPath::parse(&m.path)?;
            SandboxFs::open(&sb.rootfs(), self.cfg.idmap.host_base)?.mkdir(&path, true)?;
            let dir = std::fs::File::open(&root).map_err(RuntimeError::io("open a volume's view"))?;
            let fd = clone_instance(dir.as_fd(), m.read_only)?;
            rootswap::mount_in_sandbox(sb.init_pid, fd, Path::new(&m.path), false)?;
            self.mount_in_host_view(&sb.rootfs(), &VolumeMount { volume: row.id.clone(), ..m.clone() })?;
            self.volumes.records().insert_mount(&MountRow {
                sandbox: sb.id.clone(),
                volume: row.id.clone(),
                path: m.path.clone(),
                read_only: m.read_only,
                branch: m.branch,
            })?;
            sb.volumes.lock().push(VolumeMount { volume: row.id.clone(), ..m.clone() });
            tracing::debug!(sandbox = %sb.id, volume = %row.id, path = %m.path, "volume mounted");
        }
        Ok(())
    }

    /// Mount volume mount `m` in a sandbox's host-side root view `view` too (what the sandbox
    /// file API reads), replacing an older instance there. The mount point is opened inside the
    /// view (`RESOLVE_IN_ROOT`: a symlink made by sandbox code cannot send the mount elsewhere
    /// on the host).
    pub(crate) fn mount_in_host_view(&self, view: &Path, m: &VolumeMount) -> Result<()> {
        use bb_sys::mount_api::{openat2, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS};
        use std::os::fd::AsRawFd;
        let view = std::fs::File::open(view).map_err(RuntimeError::io("open a sandbox's root view"))?;
        let open_target = || {
            let rel = m.path.trim_start_matches('/');
            openat2(view.as_fd(), rel, libc::O_PATH | libc::O_DIRECTORY, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        };
        let mut target = open_target()?;
        let dev = |fd: i32| nix::sys::stat::fstat(fd).map(|st| st.st_dev).ok();
        if dev(target.as_raw_fd()) != dev(view.as_raw_fd()) {
            // An older instance is mounted there: detached through the fd, then the dir below.
            let _ = bb_sys::ns::umount2(Path::new(&format!("/proc/self/fd/{}", target.as_raw_fd())), libc::MNT_DETACH);
            target = open_target()?;
        }
        let root =
            std::fs::File::open(self.volume_root(&m.volume)).map_err(RuntimeError::io("open a volume's view"))?;
        let fd = clone_instance(root.as_fd(), m.read_only)?;
        bb_sys::ns::move_mount(
            Some(fd.as_fd()),
            Path::new(""),
            Some(target.as_fd()),
            Path::new(""),
            bb_sys::ns::MOVE_MOUNT_F_EMPTY_PATH | bb_sys::ns::MOVE_MOUNT_T_EMPTY_PATH,
        )?;
        Ok(())
    }

    /// After a root swap: the new host-side root view `view` gets the sandbox's volumes.
    pub(crate) fn mount_volumes_in_host_view(&self, sb: &Sandbox, view: &Path) {
        for m in sb.volumes.lock().clone() {
            if let Err(e) = self.mount_in_host_view(view, &m) {
                tracing::warn!(sandbox = %sb.id, path = %m.path, "the file API does not see the volume at this path: {e}");
            }
        }
    }

    /// A sandbox is gone: its volumes are free.
    pub(crate) fn release_volumes(self: &Arc<Self>, sb: &Sandbox) -> Result<()> {
        let gone = std::mem::take(&mut *sb.volumes.lock());
        self.volumes.records().delete_mounts(&sb.id)?;
        // Leases of synced volumes it wrote: free for another node at once.
        let held = self.held_volumes();
        let release: Vec<String> = gone
            .into_iter()
            .filter(|m| !m.read_only && !held.contains(&m.volume))
            .filter(|m| self.volume_row(&m.volume).is_ok_and(|r| r.access.writable() && r.synced.is_some()))
            .map(|m| m.volume)
            .collect();
        if let (false, Ok(handle)) = (release.is_empty(), tokio::runtime::Handle::try_current()) {
            let rt = self.clone();
            handle.spawn(async move {
                for id in release {
                    rt.release_volume(&id).await;
                }
            });
        }
        Ok(())
    }

    /// At start: sandboxes that survived keep their volumes; mounts of those that did not go.
    pub(crate) fn recover_volumes(&self) -> Result<()> {
        let rows = self.volumes.records().mounts()?;
        let mut gone = HashSet::new();
        for m in rows {
            match self.sandboxes.get(&m.sandbox) {
                Some(sb) => sb.volumes.lock().push(VolumeMount {
                    volume: m.volume.clone(),
                    path: m.path,
                    read_only: m.read_only,
                    branch: m.branch,
                }),
                None => {
                    gone.insert(m.sandbox);
                }
            }
        }
        for id in gone {
            self.volumes.records().delete_mounts(&id)?;
        }
        Ok(())
    }
}

/// A detached mount of the volume instance `at` is the root of (a clone: one instance, so
/// every mount of it sees the same files), read-only if asked.
fn clone_instance(at: std::os::fd::BorrowedFd<'_>, read_only: bool) -> Result<OwnedFd> {
    let fd = bb_sys::ns::open_tree(at, Path::new(""), bb_sys::ns::OPEN_TREE_CLONE | bb_sys::ns::OPEN_TREE_CLOEXEC)?;
    if read_only {
        bb_sys::mount_api::mount_setattr(fd.as_fd(), bb_sys::mount_api::MOUNT_ATTR_RDONLY)?;
    }
    Ok(fd)
}

/// Snapshot `s` of a volume whose committed head is `synced`.
fn snap_info(s: &VolumeSnapRow, synced: Option<&store::Synced>) -> VolumeSnapshotInfo {
    VolumeSnapshotInfo {
        id: s.id.clone(),
        volume: s.volume.clone(),
        created_at: s.created_at,
        label: s.label.clone(),
        layers: s.chain.len(),
        durable: synced.is_some_and(|x| x.snapshots.contains(&s.id)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_mount_paths_are_checked() {
        assert!(valid_name("ws") && valid_name("a.b-c_d") && valid_name(&"x".repeat(63)));
        assert!(!valid_name("") && !valid_name("-x") && !valid_name("a/b") && !valid_name(&"x".repeat(64)));
        assert!(!valid_name("vol-1234"), "ids and names never look alike");
        let m = |p: &str| VolumeMount { volume: "v".into(), path: p.into(), read_only: false, branch: true };
        assert_eq!(mount_path(&m("/workspace/")).unwrap(), "/workspace");
        assert_eq!(mount_path(&m("/a/../b")).unwrap(), "/b");
        for bad in ["workspace", "/", "/proc/x", "/dev", "/sys/fs", "/..", "/a/../.."] {
            assert!(mount_path(&m(bad)).is_err(), "{bad}");
        }
        assert!(nested("/a", "/a/b") && nested("/a/b", "/a") && nested("/a", "/a"));
        assert!(!nested("/a", "/ab"));
    }
}
