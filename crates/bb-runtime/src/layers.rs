//! Writable and snapshot layer directories under `<state>/snaplayers`, and their collection.
//!
//! A sandbox's writable layer becomes a frozen snapshot layer at a checkpoint (its size then
//! recorded). A layer is deleted by moving it to `<state>/trash` first (so a half-deleted layer
//! is never seen under its name). [`Runtime::gc_layers`] deletes every layer no snapshot, no
//! sandbox generation, no pooled shell and no running compaction uses; unrecorded writable
//! layers younger than [`LAYER_GC_MIN_AGE`] are being set up and are left alone (all are
//! collected at start, before anything is set up).

use crate::error::Result;
use crate::Runtime;
use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Where a live sandbox's root stands: the frozen chain under it and its writable layer.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Generation {
    /// Writable layer id (a dir under `<state>/snaplayers`).
    pub upper: String,
    /// Frozen layers under it, bottom first (what the next mount uses).
    pub chain: Vec<String>,
    /// Layers the overlay mounted now uses (differs from `chain` after a compaction).
    pub mounted: Vec<String>,
    /// The snapshot the sandbox's state equals while nothing changed since (checkpoint or rollback).
    pub base: Option<String>,
    /// Bumped by every root swap; names the overlay work dir (`work-<n>`).
    pub n: u64,
}

/// Unrecorded writable layers younger than this are left to the next collection.
pub(crate) const LAYER_GC_MIN_AGE: std::time::Duration = std::time::Duration::from_secs(120);

pub(crate) fn dir_is_empty(p: &Path) -> bool {
    std::fs::read_dir(p).map(|mut d| d.next().is_none()).unwrap_or(false)
}

/// Bytes allocated by a layer dir (what deleting it frees).
pub(crate) fn du(p: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![p.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let Ok(m) = e.path().symlink_metadata() else { continue };
            total += m.blocks() * 512;
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    total
}

impl Runtime {
    pub(crate) fn remove_layer_dir(&self, id: &str) {
        if let Some(trash) = self.take_layer_dir(id) {
            let _ = std::fs::remove_dir_all(&trash);
        }
    }

    /// Rename layer dir `id` away (the same filesystem: it is gone at once, even if removing
    /// it takes long or stops half-way) and return where it went, to be removed.
    pub(crate) fn take_layer_dir(&self, id: &str) -> Option<PathBuf> {
        if !id.starts_with("sl-") {
            return None;
        }
        let dir = self.layer_path(id);
        let trash = if id.starts_with(crate::volumes::volfs::LAYER_PREFIX) {
            crate::volumes::volfs::tmp_dir(&self.cfg.state_dir)
        } else {
            self.cfg.state_dir.join("trash")
        };
        let trash = trash.join(format!("{id}-{}", uuid::Uuid::new_v4().simple()));
        if std::fs::rename(&dir, &trash).is_ok() {
            Some(trash)
        } else {
            let _ = std::fs::remove_dir_all(&dir);
            None
        }
    }

    /// Delete every layer dir under `<state>/snaplayers` (and the volumes' layers dir) that no
    /// snapshot, no volume and no sandbox uses, and that changed no later than `min_age` ago:
    /// writable layers being set up (a checkpoint's next layer, a pool or fork shell being
    /// built or claimed) are not recorded yet. Returns the bytes freed.
    pub(crate) fn gc_layers(&self, min_age: std::time::Duration) -> Result<u64> {
        let snaps = self.snapshots.records();
        let mut used: HashSet<String> = HashSet::new();
        for s in snaps.all()? {
            used.extend(s.layers);
        }
        for (_, g) in snaps.generations()? {
            used.extend(g.chain);
            used.extend(g.mounted);
            used.insert(g.upper);
        }
        drop(snaps);
        used.extend(self.volumes.layers_in_use()?);
        // Writable layers of ready sandboxes in the warm pools (not recorded anywhere), and
        // layers compactions are writing.
        used.extend(self.pooled_uppers());
        used.extend(self.compaction.layers_in_progress());
        let mut freed = 0;
        let mut dirs = vec![crate::sandbox::launch::snaplayers_dir(&self.cfg.state_dir)];
        // The volumes' layers, once their filesystem is mounted and unlocked.
        if self.volume_fs_encrypted().is_some() {
            dirs.push(crate::volumes::volfs::layers_dir(&self.cfg.state_dir));
        }
        for e in dirs.iter().filter_map(|d| std::fs::read_dir(d).ok()).flat_map(|rd| rd.flatten()) {
            let name = e.file_name().to_string_lossy().into_owned();
            if used.contains(&name) {
                continue;
            }
            if name.starts_with(".sl-") {
                // A compaction's temp dir (`bb_layers::flatten_onto`): only one left by a crash,
                // at start, is garbage.
                if min_age.is_zero() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
                continue;
            }
            // A frozen snapshot layer has its size recorded; a writable layer never had.
            let recorded = self.snapshots.records().layer_size(&name).ok().flatten();
            let changed = e.metadata().ok().and_then(|m| {
                use std::os::unix::fs::MetadataExt;
                std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(m.ctime().max(0) as u64))
            });
            if recorded.is_none() && changed.is_some_and(|t| t.elapsed().map_or(true, |age| age < min_age)) {
                continue;
            }
            let size = recorded.unwrap_or_else(|| du(&e.path()));
            self.remove_layer_dir(&name);
            let _ = self.snapshots.records().forget_layer(&name);
            freed += size;
        }
        Ok(freed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn du_counts_allocated_bytes() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("a")).unwrap();
        std::fs::write(d.path().join("a/f"), vec![1u8; 100_000]).unwrap();
        assert!(du(d.path()) >= 100_000);
        assert!(!dir_is_empty(&d.path().join("a")));
    }
}
