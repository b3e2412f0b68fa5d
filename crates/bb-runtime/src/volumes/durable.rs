//! Volumes across nodes: a volume synced once has a committed head in the metadata store
//! (`remote.rs`); any daemon sharing the stores can open it (its layers pulled, authenticated
//! as they are read), and a node writing an `rwo` one holds its lease, renewed while a sandbox
//! mounts it, so that two nodes never both commit on its head. Synced volumes are kept durable
//! by the background uploader ([`Runtime::volume_tick`]).

use super::store::{Synced, VolumeRow, VolumeSnapRow};
use crate::error::{Result, RuntimeError};
use crate::layers::dir_is_empty;
use crate::{now, Runtime};
use std::collections::HashSet;
use std::sync::Arc;

impl Runtime {
    /// The id of volume `vid` (id or name) on this node: a volume only the metadata store knows
    /// (synced by another daemon) is opened here; a synced one this node holds is brought up to
    /// its head when nothing was written here since (a diverged one is refused).
    pub(crate) async fn open_volume(self: &Arc<Self>, vid: &str) -> Result<String> {
        let local = self.volumes.records().get(vid)?;
        let res = match local {
            None => self.adopt_volume(vid).await,
            Some(row) if row.synced.is_some() && self.volume_holders(&row.id).is_empty() => {
                self.fast_forward_volume(row).await
            }
            Some(row) => return Ok(row.id),
        };
        match res {
            Err(RuntimeError::Remote(e)) if e.unavailable() => match self.volumes.records().get(vid)? {
                // The stores are down: this node's state serves (it is what it wrote last).
                Some(row) => {
                    tracing::warn!(volume = %row.id, "the metadata store is unreachable: using this node's state: {e}");
                    Ok(row.id)
                }
                None => Err(RuntimeError::Remote(e)),
            },
            r => r,
        }
    }

    async fn adopt_volume(self: &Arc<Self>, vid: &str) -> Result<String> {
        let Some((id, version, head)) = self.volume_head(vid).await? else {
            return Err(RuntimeError::NotFound {
                kind: "volume",
                id: vid.into(),
                hint: " here or in the metadata store: list volumes with `branchbox volume ls`",
            });
        };
        let op = self.volumes.op(&id);
        let _op = op.lock().await;
        if self.volumes.records().get(&id)?.is_some() {
            return Ok(id);
        }
        self.volume_fs_ready_async().await?;
        let pulled = self.pull_volume_layers(&head).await?;
        let rt = self.clone();
        let chain: Vec<String> = head.layers.iter().map(|l| l.layer.clone()).collect();
        let name = head.name.clone();
        let id2 = id.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            // Its snapshots first (their layers are pulled when one is restored or forked): a
            // volume recorded without them would drop them from its head at its next sync.
            let (snaps, snapshots) = head_snapshots(&id2, &head);
            rt.volumes.records().merge_snapshots(&snaps, &[])?;
            // A local volume may hold the name: the opened one then goes by its id only.
            let name = name.filter(|n| rt.volumes.records().get(n).ok().flatten().is_none());
            rt.insert_new_volume(VolumeRow {
                id: id2.clone(),
                name,
                access: head.access,
                quota_mb: head.quota_mb,
                created_at: now(),
                chain: chain.clone(),
                upper: String::new(),
                n: 0,
                source: None,
                synced: Some(Synced { version, chain, snapshots }),
            })
            .map(drop)
        })
        .await
        .map_err(RuntimeError::Worker)??;
        tracing::info!(volume = %id, version, pulled, "volume opened from the metadata store");
        Ok(id)
    }

    /// Bring a synced volume nothing mounts here up to its committed head.
    async fn fast_forward_volume(self: &Arc<Self>, row: VolumeRow) -> Result<String> {
        let synced = row.synced.clone().expect("a synced volume");
        let Some((_, version, head)) = self.volume_head(&row.id).await? else { return Ok(row.id) };
        if version == synced.version {
            return Ok(row.id);
        }
        let op = self.volumes.op(&row.id);
        let _op = op.lock().await;
        let row = self.volume_row(&row.id)?;
        let local_changes =
            row.synced.as_ref().is_none_or(|s| s.chain != row.chain) || !dir_is_empty(&self.layer_path(&row.upper));
        if local_changes {
            return Err(RuntimeError::Conflict(format!(
                "volume {} was committed elsewhere (version {version}) and changed here since version {}: the \
                 two diverged; fork it here to keep this node's changes, or delete it here to open the committed one",
                row.id, synced.version
            )));
        }
        self.volume_fs_ready_async().await?;
        self.pull_volume_layers(&head).await?;
        let gate = self.volumes.gate(&row.id);
        let _gate = gate.write().await;
        let chain: Vec<String> = head.layers.iter().map(|l| l.layer.clone()).collect();
        // Snapshots: those taken elsewhere since come, those deleted elsewhere go; those taken
        // or deleted here since stay so (the next sync commits them).
        let (snaps, snapshots) = head_snapshots(&row.id, &head);
        let base: HashSet<&String> = synced.snapshots.iter().collect();
        let here: HashSet<String> = self.volumes.records().own_snapshots(&row.id)?.into_iter().map(|s| s.id).collect();
        let came: Vec<VolumeSnapRow> =
            snaps.into_iter().filter(|s| !here.contains(&s.id) && !base.contains(&s.id)).collect();
        let gone: Vec<String> =
            here.iter().filter(|id| base.contains(id) && !snapshots.contains(id)).cloned().collect();
        self.volumes.records().merge_snapshots(&came, &gone)?;
        let next = VolumeRow { chain: chain.clone(), synced: Some(Synced { version, chain, snapshots }), ..row };
        self.unmount_volume_view(&next.id);
        self.volumes.records().update(&next)?;
        tracing::info!(volume = %next.id, from = synced.version, to = version, "volume brought up to its committed head");
        Ok(next.id)
    }

    /// Synced writable (`rwo`, `rwx`) volumes mounted writable here, whose leases this node renews.
    pub(crate) fn held_volumes(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .sandboxes
            .all()
            .iter()
            .flat_map(|sb| {
                sb.volumes.lock().iter().filter(|m| !m.read_only).map(|m| m.volume.clone()).collect::<Vec<_>>()
            })
            .filter(|id| {
                self.volumes.records().get(id).ok().flatten().is_some_and(|r| r.access.writable() && r.synced.is_some())
            })
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Take the lease of a synced writable volume about to be mounted writable here (a store that
    /// is down lets the mount go on with a warning: this node's state serves).
    pub(crate) async fn hold_for_mount(self: &Arc<Self>, id: &str) -> Result<()> {
        let row = self.volume_row(id)?;
        if !row.access.writable() || row.synced.is_none() {
            return Ok(());
        }
        match self.hold_volume(id).await {
            Err(RuntimeError::Remote(e)) if e.unavailable() => {
                tracing::warn!(volume = %id, "the metadata store is unreachable: mounting without its lease: {e}");
                Ok(())
            }
            r => r,
        }
    }

    /// Every [`super::LEASE_RENEW`]: renew the leases of volumes mounted writable here; every
    /// `--volume-sync-interval`, sync each synced volume with a backlog (the background
    /// uploader); then bound the node's cache of volume layers ([`super::cache`]). Failures are
    /// logged; a backlog stays and shows in the volume's status.
    pub async fn volume_tick(self: &Arc<Self>, upload: bool) {
        for id in self.held_volumes() {
            if let Err(e) = self.hold_volume(&id).await {
                tracing::warn!(volume = %id, "renewing the volume's lease failed: {e}");
            }
        }
        if upload {
            self.upload_volumes().await;
        }
        if let Err(e) = self.trim_volume_cache().await {
            tracing::warn!("bounding the node's volume cache: {e}");
        }
    }

    /// Sync each synced volume with a backlog.
    async fn upload_volumes(self: &Arc<Self>) {
        let rows = match self.volumes.records().all() {
            Ok(r) => r,
            Err(e) => return tracing::warn!("background volume upload: {e}"),
        };
        for row in rows.into_iter().filter(|r| r.synced.is_some()) {
            let backlog = !self.head_holds(&row).unwrap_or(false) || !dir_is_empty(&self.layer_path(&row.upper));
            if !backlog {
                continue;
            }
            match self.sync_volume(&row.id).await {
                Ok(v) => tracing::debug!(volume = %row.id, version = v.version, "volume uploaded in the background"),
                Err(e) => tracing::warn!(volume = %row.id, "background upload failed (the backlog stays): {e}"),
            }
        }
    }
}

/// The own snapshots committed head `head` of volume `id` carries, as rows of this node, and
/// their ids sorted.
fn head_snapshots(id: &str, head: &crate::remote::VolumeHead) -> (Vec<VolumeSnapRow>, Vec<String>) {
    let rows: Vec<VolumeSnapRow> = head
        .snapshots
        .iter()
        .map(|s| VolumeSnapRow {
            id: s.id.clone(),
            volume: id.to_string(),
            created_at: s.created_at,
            label: s.label.clone(),
            chain: s.layers.iter().map(|l| l.layer.clone()).collect(),
            checkpoint: None,
        })
        .collect();
    let mut ids: Vec<String> = rows.iter().map(|s| s.id.clone()).collect();
    ids.sort();
    (rows, ids)
}
