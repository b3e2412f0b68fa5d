//! The node's volume layers as a bounded cache of the object store: once a volume is durable
//! (its chain committed, nothing written since) and idle (no sandbox mounts it, no operation or
//! file API call on it), its frozen layers are copies of trees in the object store. When the
//! frozen volume layers on the node take more than `--volume-cache-mb`, the background tick
//! lets such layers go, least recently used volume first; the next mount or file API call on
//! the volume pulls them back (authenticated as they are read). A layer stays while anything
//! else stands on it: a volume with changes of its own, a volume snapshot (a sandbox rollback
//! or a template never waits on a pull), a sandbox snapshot.

use super::store::VolumeRow;
use super::{volfs, Volumes};
use crate::error::{Result, RuntimeError};
use crate::layers::dir_is_empty;
use crate::Runtime;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

impl Volumes {
    /// Volume `id` was used now (its layers are the last to go).
    pub(crate) fn touch(&self, id: &str) {
        self.used.lock().insert(id.to_string(), Instant::now());
    }
}

impl Runtime {
    /// Every layer of `chain` is on this node.
    pub(crate) fn chain_local(&self, chain: &[String]) -> bool {
        chain.iter().all(|l| self.layer_path(l).exists())
    }

    /// Pull the layers of `row`'s chain this node let go (blocking: on a worker thread of the
    /// daemon's async runtime).
    pub(crate) fn pull_missing_layers_blocking(&self, row: &VolumeRow) -> Result<usize> {
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            RuntimeError::Conflict(format!("volume {} has layers to pull and no runtime to pull them on", row.id))
        })?;
        handle.block_on(self.pull_missing_layers(&row.id, &row.chain))
    }

    /// Let layers of durable, idle volumes go until the frozen volume layers on this node take
    /// at most `--volume-cache-mb` (see the module docs). Returns the bytes let go.
    pub async fn trim_volume_cache(self: &Arc<Self>) -> Result<u64> {
        let Some(bound) = self.cfg.volume_cache_bytes else { return Ok(0) };
        let rt = self.clone();
        tokio::task::spawn_blocking(move || rt.trim_volume_cache_blocking(bound)).await.map_err(RuntimeError::Worker)?
    }

    fn trim_volume_cache_blocking(&self, bound: u64) -> Result<u64> {
        if self.volume_fs_encrypted().is_none() {
            return Ok(0);
        }
        let rows = self.volumes.records().all()?;
        let uppers: HashSet<&String> = rows.iter().map(|r| &r.upper).collect();
        let local: Vec<String> = match std::fs::read_dir(volfs::layers_dir(&self.cfg.state_dir)) {
            Ok(dir) => dir
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|l| l.starts_with(volfs::LAYER_PREFIX) && !uppers.contains(l))
                .collect(),
            Err(_) => return Ok(0),
        };
        let mut sizes = HashMap::new();
        for l in &local {
            sizes.insert(l.clone(), self.frozen_layer_size(l)?);
        }
        let mut total: u64 = sizes.values().sum();
        if total <= bound {
            return Ok(0);
        }
        // Layers something other than a durable, idle volume stands on.
        let mut kept: HashSet<String> = HashSet::new();
        for s in self.volumes.records().snapshots(None)? {
            kept.extend(s.chain);
        }
        for s in self.snapshots.records().all()? {
            kept.extend(s.layers);
        }
        let idle = |r: &VolumeRow| {
            r.synced.as_ref().is_some_and(|s| s.chain == r.chain)
                && dir_is_empty(&self.layer_path(&r.upper))
                && self.volume_holders(&r.id).is_empty()
                && !self.volumes.pending.lock().contains_key(&r.id)
        };
        let mut holders: HashMap<&String, Vec<&VolumeRow>> = HashMap::new();
        for r in &rows {
            if !idle(r) {
                kept.extend(r.chain.iter().cloned());
            }
            for l in &r.chain {
                holders.entry(l).or_default().push(r);
            }
        }
        let mut order: Vec<&VolumeRow> = rows.iter().filter(|r| !r.chain.iter().all(|l| kept.contains(l))).collect();
        {
            let used = self.volumes.used.lock();
            order.sort_by_key(|r| (used.get(&r.id).copied(), r.created_at.to_bits()));
        }
        let mut freed = 0;
        for row in order {
            if total <= bound {
                break;
            }
            let layers: Vec<&String> =
                row.chain.iter().filter(|l| sizes.contains_key(*l) && !kept.contains(*l)).collect();
            if layers.is_empty() {
                continue;
            }
            // Every volume on these layers, held still while they go.
            let mut on: Vec<&VolumeRow> = layers.iter().flat_map(|l| holders[l].iter().copied()).collect();
            on.sort_by(|a, b| a.id.cmp(&b.id));
            on.dedup_by(|a, b| a.id == b.id);
            let ops: Vec<_> = on.iter().map(|r| self.volumes.op(&r.id)).collect();
            let gates: Vec<_> = on.iter().map(|r| self.volumes.gate(&r.id)).collect();
            let (Some(_ops), Some(_gates)) = (
                ops.iter().map(|o| o.try_lock().ok()).collect::<Option<Vec<_>>>(),
                gates.iter().map(|g| g.try_write().ok()).collect::<Option<Vec<_>>>(),
            ) else {
                continue;
            };
            // Still as they were: nothing mounted, claimed or written since (checked with the
            // mounting lock held: a sandbox claiming one now mounts it after the layers went,
            // and pulls them back).
            let mounting = self.volumes.mounting.lock();
            let now: Vec<VolumeRow> =
                on.iter().filter_map(|r| self.volumes.records().get(&r.id).ok().flatten()).collect();
            if now.len() != on.len() || now.iter().zip(&on).any(|(a, b)| a != *b || !idle(a)) {
                continue;
            }
            for r in &on {
                self.unmount_view_locked(&r.id);
            }
            let mut trash = Vec::new();
            for l in layers {
                trash.extend(self.take_layer_dir(l));
                let b = sizes[l];
                total = total.saturating_sub(b);
                freed += b;
                kept.insert(l.clone());
            }
            drop(mounting);
            for t in trash {
                let _ = std::fs::remove_dir_all(t);
            }
            tracing::info!(volume = %row.id, freed, total, bound, "volume layers let go from the node's cache");
        }
        Ok(freed)
    }
}
