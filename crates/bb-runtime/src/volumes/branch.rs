//! Volumes branch with the sandbox that mounts them: a checkpoint freezes each branching
//! volume in the root swap's frozen window (its mount is replaced before the root pivots, so
//! the new mount moves along), a rollback puts it back to the chain the snapshot recorded, and
//! a fork gives each child a copy-on-write fork of it ([`crate::snapshot`] calls these).

use super::new_id;
use super::store::{self, VolumeRow, VolumeSnapRow};
use crate::error::{Result, RuntimeError};
use crate::layers::dir_is_empty;
use crate::model::VolumeMount;
use crate::sandbox::rootswap;
use crate::sandbox::Sandbox;
use crate::snapshot::swap::request_rebase;
use crate::{now, Runtime};
use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

/// A mounted volume's part in a sandbox checkpoint or rollback, built before the frozen window
/// ([`Runtime::prepare_volume_checkpoint`], [`Runtime::prepare_volume_rollback`]).
/// Replaced instances of a volume whose old fds a freeze still looks for.
const MAX_STALE_DEVS: usize = 32;

/// One volume mount being replaced: where, the old instance's device, its writable layer and
/// the new one, and whether open files are pinned (a checkpoint) or not (a rollback kills the
/// writers first).
pub(crate) struct MountSwap<'a> {
    pub(crate) path: &'a str,
    pub(crate) dev: u64,
    pub(crate) old_upper: &'a Path,
    pub(crate) new_upper: &'a Path,
    pub(crate) pin: bool,
}

pub(crate) struct PreparedVolume {
    pub(crate) mount: VolumeMount,
    /// The volume's record after the operation (`chain` is what a checkpoint snapshots).
    pub(super) next: VolumeRow,
    /// The writable layer it had (frozen by a checkpoint, discarded by a rollback).
    old_upper: String,
    /// None: nothing to swap (a checkpoint of a volume nothing wrote since its last freeze).
    pub(super) swap: Option<VolumeSwap>,
}

pub(super) struct VolumeSwap {
    /// The new instance, for the sandbox (taken by the swap) and for the host-side view.
    sandbox_mnt: Option<OwnedFd>,
    host_mnt: OwnedFd,
    /// Device of the old instance: files and working directories on it are moved.
    dev: u64,
    /// Checkpoint: files open for writing keep writing into the new layer (a rollback kills
    /// every writer first).
    pin: bool,
    done: bool,
}

/// Held by a sandbox operation that branches its volumes: their operation locks, then their
/// file gates ([`Runtime::lock_branch_volumes`], [`Runtime::gate_branch_volumes`]).
pub(crate) struct BranchLocks {
    _ops: Vec<tokio::sync::OwnedMutexGuard<()>>,
}

pub(crate) struct BranchGates {
    _gates: Vec<tokio::sync::OwnedRwLockWriteGuard<()>>,
}

impl Runtime {
    /// The volumes of `sb` that branch with it (by volume id, the order locks are taken in).
    pub(crate) fn branch_mounts(&self, sb: &Sandbox) -> Vec<VolumeMount> {
        let mut v: Vec<VolumeMount> = sb.volumes.lock().iter().filter(|m| m.branch).cloned().collect();
        v.sort_by(|a, b| a.volume.cmp(&b.volume));
        v
    }

    pub(crate) async fn lock_branch_volumes(&self, mounts: &[VolumeMount]) -> BranchLocks {
        let mut ops = Vec::with_capacity(mounts.len());
        for m in mounts {
            ops.push(self.volumes.op(&m.volume).lock_owned().await);
        }
        BranchLocks { _ops: ops }
    }

    pub(crate) async fn gate_branch_volumes(&self, mounts: &[VolumeMount]) -> BranchGates {
        let mut gates = Vec::with_capacity(mounts.len());
        for m in mounts {
            gates.push(self.volumes.gate(&m.volume).write_owned().await);
        }
        BranchGates { _gates: gates }
    }

    /// True if a checkpoint would snapshot each branching volume of `sb` as it was at the last
    /// one (nothing written since).
    pub(crate) fn branch_volumes_unchanged(&self, sb: &Sandbox) -> bool {
        self.branch_mounts(sb).iter().all(|m| {
            self.volumes
                .records()
                .get(&m.volume)
                .ok()
                .flatten()
                .is_none_or(|r| dir_is_empty(&self.layer_path(&r.upper)))
        })
    }

    fn prepare_swap(&self, row: &VolumeRow, next: &VolumeRow, m: &VolumeMount, pin: bool) -> Result<VolumeSwap> {
        let root = self.ensure_volume_mounted(row)?;
        let dev = std::fs::metadata(&root).map_err(RuntimeError::io("stat a volume"))?.dev();
        let fd = self.volume_instance(next)?;
        let host_mnt = super::clone_instance(fd.as_fd(), false)?;
        if m.read_only {
            bb_sys::mount_api::mount_setattr(fd.as_fd(), bb_sys::mount_api::MOUNT_ATTR_RDONLY)?;
        }
        Ok(VolumeSwap { sandbox_mnt: Some(fd), host_mnt, dev, pin, done: false })
    }

    /// Checkpoint: each branching volume's writable layer is frozen (if anything was written).
    pub(crate) fn prepare_volume_checkpoint(&self, mounts: &[VolumeMount]) -> Result<Vec<PreparedVolume>> {
        let mut out = Vec::new();
        let res = (|| -> Result<()> {
            for m in mounts {
                let row = self.volume_row(&m.volume)?;
                if dir_is_empty(&self.layer_path(&row.upper)) {
                    out.push(PreparedVolume { mount: m.clone(), old_upper: row.upper.clone(), next: row, swap: None });
                    continue;
                }
                super::check_depth(&row)?;
                let n = row.n + 1;
                let mut next = row.clone();
                next.chain.push(row.upper.clone());
                next.upper = self.volume_upper(&row.id, n, &next.chain)?;
                next.n = n;
                // Listed before the swap is built: a failure discards its new layer too.
                out.push(PreparedVolume {
                    mount: m.clone(),
                    old_upper: row.upper.clone(),
                    next: next.clone(),
                    swap: None,
                });
                out.last_mut().expect("pushed").swap = Some(self.prepare_swap(&row, &next, m, true)?);
            }
            Ok(())
        })();
        if let Err(e) = res {
            self.discard_prepared_volumes(out);
            return Err(e);
        }
        Ok(out)
    }

    /// Rollback to sandbox snapshot `sid`: each branching volume of `sb` that the snapshot
    /// recorded (matched by mount path) goes back to that chain under a fresh writable layer.
    pub(crate) fn prepare_volume_rollback(&self, sb: &Sandbox, sid: &str) -> Result<Vec<PreparedVolume>> {
        let snaps = self.volumes.records().snapshots(None)?;
        let mut out = Vec::new();
        let res = (|| -> Result<()> {
            for m in self.branch_mounts(sb) {
                let Some(vs) = snaps.iter().find(|s| {
                    s.checkpoint.as_ref().is_some_and(|c| c.snapshot == sid && c.path == m.path && !c.shared)
                }) else {
                    continue;
                };
                let row = self.volume_row(&m.volume)?;
                if row.chain == vs.chain && dir_is_empty(&self.layer_path(&row.upper)) {
                    continue;
                }
                let n = row.n + 1;
                let lid = self.volume_upper(&row.id, n, &vs.chain)?;
                let next = VolumeRow { chain: vs.chain.clone(), upper: lid, n, ..row.clone() };
                out.push(PreparedVolume {
                    mount: m.clone(),
                    old_upper: row.upper.clone(),
                    next: next.clone(),
                    swap: None,
                });
                out.last_mut().expect("pushed").swap = Some(self.prepare_swap(&row, &next, &m, false)?);
            }
            Ok(())
        })();
        if let Err(e) = res {
            self.discard_prepared_volumes(out);
            return Err(e);
        }
        Ok(out)
    }

    /// Undo a preparation whose swap did not happen.
    pub(crate) fn discard_prepared_volumes(&self, prepared: Vec<PreparedVolume>) {
        for p in prepared {
            if p.next.upper != p.old_upper {
                self.remove_layer_dir(&p.next.upper);
                self.remove_volume_work(&p.next.id, p.next.n);
            }
        }
    }

    /// In the frozen window of a root swap (before the root moves, so the new volume mounts move
    /// with it): replace each prepared volume's mount in `sb`. Checkpoint (`pin`): files open for
    /// writing in the old instance are pinned into the new writable layer and processes but
    /// `templates` with a working directory in it are moved after the thaw (into `stale`).
    pub(crate) fn swap_volumes_frozen(
        &self,
        sb: &Sandbox,
        prepared: &mut [PreparedVolume],
        templates: &HashSet<i32>,
        stale: &mut crate::snapshot::swap::StaleCwds,
    ) -> Result<()> {
        if prepared.iter().all(|p| p.swap.is_none()) {
            return Ok(());
        }
        let scan = crate::sandbox::procs::own_pids_or_none(sb, templates);
        for p in prepared.iter_mut() {
            let Some(s) = p.swap.as_mut() else { continue };
            let (old_upper, new_upper) = (self.layer_path(&p.old_upper), self.layer_path(&p.next.upper));
            let swap =
                MountSwap { path: &p.mount.path, dev: s.dev, old_upper: &old_upper, new_upper: &new_upper, pin: s.pin };
            let mnt = s.sandbox_mnt.take().expect("a prepared volume swaps once");
            self.swap_volume_mount(sb, &p.next.id, &swap, mnt, &scan, stale)?;
            s.done = true;
        }
        Ok(())
    }

    /// With `sb` frozen: replace the mount of volume `vid` at `swap.path` by `mnt`. With
    /// `swap.pin`, files its processes write in the volume's instances (the current one and
    /// older ones that old fds still reach) are pinned into the new writable layer, and those
    /// with a working directory in them are asked to stop to be moved (`stale`). `scan`: the
    /// sandbox's procfs and its pids to look at.
    pub(crate) fn swap_volume_mount(
        &self,
        sb: &Sandbox,
        vid: &str,
        swap: &MountSwap<'_>,
        mnt: OwnedFd,
        scan: &(std::path::PathBuf, Vec<i32>),
        stale: &mut crate::snapshot::swap::StaleCwds,
    ) -> Result<()> {
        let files = if swap.pin { self.written_in_volume(sb, vid, swap, scan, stale)? } else { Vec::new() };
        if let Err(e) = rootswap::pin_open_files(&files, swap.old_upper, swap.new_upper) {
            rootswap::unpin(&files, swap.old_upper, swap.new_upper);
            return Err(e);
        }
        if let Err(e) = rootswap::mount_in_sandbox(sb.init_pid, mnt, Path::new(swap.path), true) {
            rootswap::unpin(&files, swap.old_upper, swap.new_upper);
            return Err(e);
        }
        self.note_stale_dev(vid, swap.dev);
        Ok(())
    }

    /// With `sb` frozen: the files its processes write in volume `vid` (mounted at `swap.path`)
    /// through the instance being replaced or an older one old fds still reach, by path in the
    /// volume; its processes with a working directory there are asked to stop to be moved
    /// (`stale`).
    fn written_in_volume(
        &self,
        sb: &Sandbox,
        vid: &str,
        swap: &MountSwap<'_>,
        scan: &(std::path::PathBuf, Vec<i32>),
        stale: &mut crate::snapshot::swap::StaleCwds,
    ) -> Result<Vec<rootswap::WrittenFile>> {
        let (proc, nspids) = (&scan.0, &scan.1);
        // Paths as the sandbox sees them through the current mount, relative to the volume
        // root; through a replaced (detached) instance they are relative to it already.
        let at = Path::new(swap.path.trim_start_matches('/'));
        let mut files: Vec<rootswap::WrittenFile> = rootswap::written_files(proc, nspids, swap.dev)
            .into_iter()
            .filter_map(|f| {
                let path = f.path.strip_prefix(at).ok()?.to_path_buf();
                (!path.as_os_str().is_empty()).then_some(rootswap::WrittenFile { path, ino: f.ino })
            })
            .collect();
        let mut cwds = rootswap::stale_cwds(proc, nspids, swap.dev);
        for old in self.volumes.stale_devs.lock().get(vid).cloned().unwrap_or_default() {
            files.extend(rootswap::written_files(proc, nspids, old));
            for (pid, p) in rootswap::stale_cwds(proc, nspids, old) {
                cwds.push((pid, Path::new(swap.path).join(p.strip_prefix("/").unwrap_or(&p))));
            }
        }
        request_rebase(sb, cwds, stale)?;
        Ok(files)
    }

    /// Instance `dev` of volume `vid` was replaced: old fds may still reach it.
    fn note_stale_dev(&self, vid: &str, dev: u64) {
        let mut devs = self.volumes.stale_devs.lock();
        let v = devs.entry(vid.to_string()).or_default();
        v.retain(|d| *d != dev);
        v.push(dev);
        if v.len() > MAX_STALE_DEVS {
            v.remove(0);
        }
    }

    /// A freeze of a volume that `holders` mount (a shared, `rwx`, volume may have several),
    /// with all of them frozen: the one new instance of prepared volume `p` replaces the mount
    /// in each (a mount of its own per sandbox, read-only where theirs was), files any of them
    /// writes are pinned into the new writable layer once. All or nothing: when a mount cannot
    /// be replaced, those replaced go back to the old instance and nothing stays pinned.
    pub(super) fn swap_mounts_frozen(
        &self,
        holders: &[(Arc<Sandbox>, VolumeMount)],
        p: &mut PreparedVolume,
        stale: &mut crate::snapshot::swap::StaleCwds,
    ) -> Result<()> {
        let Some(s) = p.swap.as_mut() else { return Ok(()) };
        let (old_upper, new_upper) = (self.layer_path(&p.old_upper), self.layer_path(&p.next.upper));
        let vid = p.next.id.as_str();
        let mut mnts = vec![s.sandbox_mnt.take().expect("a prepared volume swaps once")];
        for (_, m) in holders.iter().skip(1) {
            mnts.push(super::clone_instance(s.host_mnt.as_fd(), m.read_only)?);
        }
        let mut files = Vec::new();
        for (sb, m) in holders {
            let templates = self.session_templates.pids_of(&sb.id);
            let scan = crate::sandbox::procs::own_pids_or_none(sb, &templates);
            let swap = MountSwap { path: &m.path, dev: s.dev, old_upper: &old_upper, new_upper: &new_upper, pin: true };
            files.extend(self.written_in_volume(sb, vid, &swap, &scan, stale)?);
        }
        if let Err(e) = rootswap::pin_open_files(&files, &old_upper, &new_upper) {
            rootswap::unpin(&files, &old_upper, &new_upper);
            return Err(e);
        }
        for (i, ((sb, m), mnt)) in holders.iter().zip(mnts).enumerate() {
            if let Err(e) = rootswap::mount_in_sandbox(sb.init_pid, mnt, Path::new(&m.path), true) {
                // The old instance is still the host's view of the volume.
                for (sb, m) in &holders[..i] {
                    let back = std::fs::File::open(self.volume_root(vid))
                        .map_err(RuntimeError::io("open a volume's view"))
                        .and_then(|root| super::clone_instance(root.as_fd(), m.read_only))
                        .and_then(|fd| rootswap::mount_in_sandbox(sb.init_pid, fd, Path::new(&m.path), true));
                    if let Err(e) = back {
                        tracing::error!(sandbox = %sb.id, volume = %vid, path = %m.path, "a failed freeze could not give the volume's old instance back: {e}");
                    }
                }
                rootswap::unpin(&files, &old_upper, &new_upper);
                return Err(e);
            }
        }
        self.note_stale_dev(vid, s.dev);
        s.done = true;
        Ok(())
    }

    /// After the thaw: the host-side views follow, the volumes' records are updated, and what
    /// each branching volume stands on now is returned (mount, chain). Swaps that did not
    /// happen (the root swap failed) are undone instead. Returns the states.
    pub(crate) fn finish_volume_swaps(
        &self,
        prepared: Vec<PreparedVolume>,
        rollback: bool,
    ) -> Vec<(VolumeMount, Vec<String>)> {
        let mut out = Vec::new();
        for p in prepared {
            let Some(s) = p.swap else {
                out.push((p.mount, p.next.chain));
                continue;
            };
            if !s.done {
                self.discard_prepared_volumes(vec![PreparedVolume { swap: None, ..p }]);
                continue;
            }
            let root = self.volume_root(&p.next.id);
            {
                let _m = self.volumes.mounting.lock();
                let held = std::fs::File::open(&root).ok();
                let _ = bb_layers::unmount(&root);
                if let Err(e) = bb_sys::mount_api::move_mount_to(s.host_mnt.as_fd(), &root) {
                    tracing::warn!(volume = %p.next.id, "the file API's view of the volume is remounted on next use: {e}");
                }
                if let Some(h) = held {
                    super::release_later(h);
                }
            }
            if let Err(e) = self.volumes.records().update(&p.next) {
                tracing::error!(volume = %p.next.id, "recording the volume's new layers failed: {e}");
            }
            self.remove_volume_work(&p.next.id, p.next.n - 1);
            if rollback {
                self.remove_layer_dir(&p.old_upper);
            }
            out.push((p.mount, p.next.chain));
        }
        out
    }

    /// Record the volumes' states a sandbox checkpoint (snapshot `sid`) of `sb` took, and the
    /// shared (`rox`, `rwx`) volumes it mounts (its fork children mount the same ones).
    pub(crate) fn record_checkpoint_volumes(
        &self,
        sb: &Sandbox,
        sid: &str,
        states: &[(VolumeMount, Vec<String>)],
    ) -> Result<()> {
        let shared: Vec<(VolumeMount, Vec<String>)> = sb
            .volumes
            .lock()
            .iter()
            .filter_map(|m| {
                let r = self.volume_row(&m.volume).ok().filter(|r| r.access.shared())?;
                Some((m.clone(), r.chain))
            })
            .collect();
        for (m, chain) in states.iter().chain(&shared) {
            let shared = !m.branch;
            self.volumes.records().insert_snapshot(&VolumeSnapRow {
                id: new_id("vs"),
                volume: m.volume.clone(),
                created_at: now(),
                label: Some(format!("checkpoint {sid}")),
                chain: chain.clone(),
                checkpoint: Some(store::CheckpointOf {
                    snapshot: sid.to_string(),
                    path: m.path.clone(),
                    read_only: m.read_only,
                    shared,
                }),
            })?;
        }
        Ok(())
    }

    /// Give each fork child a copy-on-write fork of the volumes sandbox snapshot `sid` recorded,
    /// mounted where they were. All or nothing per child. A path the child mounts a volume at
    /// already (the create request's own) keeps it; one inside or above such a path is refused.
    pub(crate) async fn fork_volumes_into(self: &Arc<Self>, sid: &str, children: &[Arc<Sandbox>]) -> Result<()> {
        let snaps: Vec<VolumeSnapRow> = self.volumes.records().snapshots_of_checkpoint(sid)?;
        if snaps.is_empty() {
            return Ok(());
        }
        for child in children {
            let mut mounts = Vec::new();
            let mut shared = Vec::new();
            let own: Vec<String> = child.volumes.lock().iter().map(|m| m.path.clone()).collect();
            let res = async {
                for vs in &snaps {
                    let c = vs.checkpoint.as_ref().expect("filtered");
                    if own.contains(&c.path) {
                        continue;
                    }
                    if let Some(p) = own.iter().find(|p| super::nested(p, &c.path)) {
                        return Err(RuntimeError::BadRequest(format!(
                            "the volume mounted at {p} overlaps the one the sandbox's snapshot or template \
                             mounts at {}: mount yours at {} to replace it, or at a separate path",
                            c.path, c.path
                        )));
                    }
                    if c.shared {
                        // Still there and still shared: mounted as it is (as the parent did, and
                        // read-only if it became rox since); otherwise left out.
                        if let Some(r) = self.volume_row(&vs.volume).ok().filter(|r| r.access.shared()) {
                            shared.push(VolumeMount {
                                volume: vs.volume.clone(),
                                path: c.path.clone(),
                                read_only: c.read_only || r.access == crate::model::Access::Rox,
                                branch: false,
                            });
                        }
                        continue;
                    }
                    let source = self.volume_row(&vs.volume)?;
                    let info = self.new_volume_on(&source, vs.chain.clone(), None).await?;
                    mounts.push(VolumeMount {
                        volume: info.id,
                        path: c.path.clone(),
                        read_only: c.read_only,
                        branch: true,
                    });
                }
                let all: Vec<VolumeMount> = mounts.iter().chain(&shared).cloned().collect();
                let claims = self.claim_volumes(&all)?;
                let (rt, c) = (self.clone(), child.clone());
                tokio::task::spawn_blocking(move || rt.attach_volumes(&c, claims))
                    .await
                    .map_err(RuntimeError::Worker)?
            }
            .await;
            if let Err(e) = res {
                // Forks made for this child that it does not mount go again.
                let attached: Vec<String> = child.volumes.lock().iter().map(|m| m.volume.clone()).collect();
                for m in mounts.iter().filter(|m| !attached.contains(&m.volume)) {
                    let _ = self.delete_volume(&m.volume).await;
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

impl Runtime {
    /// Each mount's volume chain as it stands (volumes nothing wrote since their last freeze).
    pub(crate) fn volume_states(&self, mounts: &[VolumeMount]) -> Result<Vec<(VolumeMount, Vec<String>)>> {
        mounts.iter().map(|m| Ok((m.clone(), self.volume_row(&m.volume)?.chain))).collect()
    }

    /// Delete the volume snapshots that checkpoints `sids` (being deleted) took.
    pub(crate) fn forget_checkpoint_volumes(&self, sids: &std::collections::BTreeSet<String>) -> Result<()> {
        let records = self.volumes.records();
        for vs in records.snapshots(None)? {
            if vs.checkpoint.as_ref().is_some_and(|c| sids.contains(&c.snapshot)) {
                records.delete_snapshot(&vs.id)?;
            }
        }
        Ok(())
    }
}
