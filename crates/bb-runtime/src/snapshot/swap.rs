//! The root swap of checkpoint and rollback: move a running sandbox onto a new overlay root
//! without stopping it for longer than a pivot. (Pool recycling and fork-shell claims pivot
//! with [`crate::sandbox::rootswap::swap_root`] directly: nothing runs in those sandboxes.)
//!
//! 1. [`Runtime::prepare`], outside the frozen window: a fresh writable layer and a detached
//!    overlay mount of it over the new chain.
//! 2. [`Runtime::swap_prepared`]: freeze the cgroup; kill what a rollback kills, or (checkpoint)
//!    move files open for writing into the new writable layer and ask processes whose working
//!    directory is in the old root to stop; pivot inside the sandbox ([`crate::sandbox::rootswap`]);
//!    thaw; move the stopped processes' working directories ([`Stragglers`]); attach the new
//!    root on the host side (the file API's view).
//! 3. [`Runtime::after_swap`], behind the answer: unmount the old root, measure a frozen layer,
//!    delete a discarded one, and compact a deep chain.

use crate::error::{Result, RuntimeError};
use crate::layers::du;
use crate::layers::Generation;
use crate::sandbox::launch::{layer_dir, new_upper};
use crate::sandbox::procs::{kill_in_sandbox_procfs, ns_pid, own_pids_or_none};
use crate::sandbox::rootswap;
use crate::sandbox::Sandbox;
use crate::Runtime;
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Lower layers overlayfs stacks at most (`OVL_MAX_STACK`): a deeper chain cannot be mounted.
pub const OVERLAY_MAX_LOWER: usize = 500;

/// What the frozen window of a checkpoint looks at: the writable layer being frozen, and which
/// processes (pids in the sandbox's namespace) to spare.
pub(crate) struct Scan<'a> {
    pub(crate) old_upper: &'a Path,
    /// Session templates: frozen copies that never write.
    pub(crate) templates: &'a HashSet<i32>,
    /// Live session servers: they move their working directory themselves.
    pub(crate) sessions: &'a HashSet<i32>,
}

/// How long a checkpoint waits for the processes it moves to a new working directory to stop;
/// the rest are moved after the answer (see [`Stragglers`]).
pub(crate) const REBASE_PATIENCE: std::time::Duration = std::time::Duration::from_millis(200);

/// Processes stopped at the thaw to get a working directory in the new root (see
/// `stale_cwds`), with that directory.
pub(crate) type StaleCwds = Vec<(bb_sys::ptrace::PendingStop, PathBuf)>;

/// Move the processes of `pending` as each stops, polling them together (one may wait for
/// another: a `vfork` parent stops only once its child, stopped too, has gone on to `exec`).
/// Returns those that have not stopped by `until`.
pub(crate) fn rebase_cwds(mut pending: StaleCwds, until: Option<Instant>) -> StaleCwds {
    let mut pause = std::time::Duration::from_micros(20);
    loop {
        let mut left = Vec::new();
        for (p, path) in pending {
            let pid = p.pid();
            match p.try_wait() {
                Ok(taken) => rebase_cwd(pid, taken, &path),
                Err(p) => left.push((p, path)),
            }
        }
        pending = left;
        if pending.is_empty() || until.is_some_and(|u| Instant::now() >= u) {
            return pending;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(5));
    }
}

/// Processes a checkpoint asked to stop that had not stopped when it answered. ptrace ties
/// them to the thread that asked: dropping this waits for them and moves them, so drop it on
/// that thread, after the answer.
pub(crate) struct Stragglers(pub(crate) StaleCwds);

impl Drop for Stragglers {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            tracing::debug!(processes = self.0.len(), "moving working directories after the answer");
            rebase_cwds(std::mem::take(&mut self.0), None);
        }
    }
}

/// Move a process stopped at the thaw (see `stale_cwds`) to the same working directory in the
/// new root: an injected `chdir(path)` (or `/` if the path is gone). Best effort.
pub(crate) fn rebase_cwd(pid: i32, taken: bb_sys::SysResult<bb_sys::ptrace::Tracee>, path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let res = taken.and_then(|mut t| {
        let mut bytes = path.as_os_str().as_bytes().to_vec();
        bytes.push(0);
        let at = t.scratch(bytes.len() + 8);
        t.write_mem(at, &bytes)?;
        let r = t.syscall(libc::SYS_chdir, [at, 0, 0, 0, 0, 0])?;
        if r.ret < 0 {
            t.write_mem(at, b"/\0")?;
            t.syscall(libc::SYS_chdir, [at, 0, 0, 0, 0, 0])?;
        }
        t.resume()
    });
    if let Err(e) = res {
        tracing::warn!(pid, "moving a working directory to the new root failed: {e}");
    }
}

/// Ask each process of `cwds` (pids in the sandbox, with their working directory) to stop at
/// the thaw, to be moved by [`rebase_cwds`]. The sandbox is frozen.
pub(crate) fn request_rebase(sb: &Sandbox, cwds: Vec<(i32, PathBuf)>, stale: &mut StaleCwds) -> Result<()> {
    if cwds.is_empty() {
        return Ok(());
    }
    let host: HashMap<i32, i32> = sb.cgroup.pids()?.into_iter().filter_map(|h| Some((ns_pid(h)?, h))).collect();
    for (ns, path) in cwds {
        match host.get(&ns).map(|h| bb_sys::ptrace::PendingStop::request(*h)) {
            Some(Ok(p)) => stale.push((p, path)),
            Some(Err(e)) => {
                tracing::warn!(sandbox = %sb.id, pid = ns, "cannot move its working directory to the new root: {e}")
            }
            None => {}
        }
    }
    Ok(())
}

/// The next root of a sandbox, built before the frozen window.
pub(crate) struct Prepared {
    lid: String,
    upper: PathBuf,
    mnt: std::os::fd::OwnedFd,
    chain: Vec<String>,
    n: u64,
    /// Volumes mounted in the sandbox that branch with it, swapped in the same frozen window.
    pub(crate) volumes: Vec<crate::volumes::PreparedVolume>,
}

/// What a root swap did.
pub(crate) struct Swapped {
    pub(crate) gen: Generation,
    pub(crate) pinned: rootswap::PinStats,
    pub(crate) stragglers: Stragglers,
    /// Each branching volume's mount and the chain it stands on after the swap.
    pub(crate) volumes: Vec<(crate::model::VolumeMount, Vec<String>)>,
}

impl Runtime {
    /// Build the next root ahead of the frozen window: a fresh writable layer and a detached
    /// overlay of it over `chain` (bottom first).
    pub(crate) fn prepare(&self, sb: &Sandbox, n: u64, chain: Vec<String>) -> Result<Prepared> {
        let t0 = Instant::now();
        if chain.len() > OVERLAY_MAX_LOWER {
            return Err(RuntimeError::Conflict(format!(
                "the root of sandbox {} would stack {} layers and overlayfs allows {OVERLAY_MAX_LOWER}: compaction \
                 did not keep up (see the daemon log); fork a snapshot into a new sandbox, or delete snapshots with \
                 `branchbox snapshot gc`",
                sb.id,
                chain.len()
            )));
        }
        let (lid, upper, work) = new_upper(&self.cfg, &sb.dirs, n)?;
        let t_upper = t0.elapsed();
        let lower: Vec<PathBuf> = chain.iter().rev().map(|l| layer_dir(&self.cfg, &self.images, l)).collect();
        let r = bb_layers::overlay_fd(
            &bb_layers::OverlaySpec { lower: &lower, upper: &upper, work: &work },
            &sb.dirs.rootfs_gen(n),
        );
        tracing::debug!(?t_upper, layers = lower.len(), took = ?t0.elapsed(), "prepared");
        match r {
            Ok(mnt) => Ok(Prepared { lid, upper, mnt, chain, n, volumes: Vec::new() }),
            Err(e) => {
                self.remove_layer_dir(&lid);
                Err(RuntimeError::from(e))
            }
        }
    }

    /// Undo [`Runtime::prepare`] when the swap will not happen.
    pub(crate) fn discard_prepared(&self, prep: Prepared) {
        let Prepared { lid, mnt, volumes, .. } = prep;
        drop(mnt);
        self.remove_layer_dir(&lid);
        self.discard_prepared_volumes(volumes);
    }

    /// Freeze `sb` and dump each of its background process trees (children of init, but those
    /// in `skip`: sessions, templates, spares) into a process image, leaving them running and the
    /// sandbox frozen for the root swap that follows (one consistent state with the files). On
    /// failure the sandbox is thawed and the images made are deleted; unless `strict`, a tree
    /// that cannot be dumped is left out instead (the sandbox frozen again for the next).
    pub(crate) fn dump_background_frozen(
        &self,
        sb: &Sandbox,
        skip: &HashSet<i32>,
        tags: &HashMap<i32, String>,
        strict: bool,
    ) -> Result<Vec<crate::snapshot::store::SnapProcess>> {
        crate::pause::freeze_for_criu(sb)?;
        let mut kept: Vec<crate::snapshot::store::SnapProcess> = Vec::new();
        let res = (|| -> Result<()> {
            let freezer = sb.cgroup.freezer_dir()?;
            for root in crate::pause::tree_roots(sb)?.into_iter().filter(|p| !skip.contains(p)) {
                let tag = tags.get(&root).cloned().unwrap_or_default();
                let fail = |why: String| {
                    RuntimeError::Conflict(format!(
                        "process {root} ({tag}) cannot be kept by the checkpoint: {why}; checkpoint with processes \"sessions\" (a rollback then kills it), or stop it first"
                    ))
                };
                // Gone since the listing (it died): nothing to keep.
                let Some(host) = crate::sandbox::procs::host_pid_of(sb, root) else { continue };
                let opts = bb_criu::DumpOptions {
                    leave_running: true,
                    kind: crate::process_images::SNAPSHOT_TREE_KIND.into(),
                    frozen_cgroup: Some(freezer.clone()),
                    // The terminal of an attached process: its master is the daemon's.
                    external: sb.plugs.external_tty(root, host).into_iter().collect(),
                };
                let root_ref = bb_criu::Root { host_pid: host, ns_pid: root };
                match self.process_images.dump(&sb.criu_ref(), &sb.id, root_ref, None, &opts) {
                    Ok((image, _)) => {
                        let (tag, attached) = match sb.plugs.kept(root) {
                            Some((tag, a)) => (tag, Some(a)),
                            None => (tag, None),
                        };
                        kept.push(crate::snapshot::store::SnapProcess { pid: root, tag, image, attached })
                    }
                    Err(e) if strict => return Err(fail(e.to_string())),
                    Err(e) => {
                        tracing::info!(sandbox = %sb.id, pid = root, %tag, "a background process is left out of the checkpoint: {e}");
                        sb.cgroup.freeze()?;
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = res {
            let _ = sb.cgroup.thaw();
            self.process_images.delete(&kept.iter().map(|k| k.image.clone()).collect::<Vec<_>>());
            return Err(e);
        }
        Ok(kept)
    }

    /// With the sandbox frozen: kill every process but init and `kill`'s keep-set (namespace
    /// pids; the killed ones are appended), or move files open for writing out of `pin_from`
    /// (the writable layer being frozen); then swap the root onto `prep`, and thaw.
    pub(crate) fn swap_prepared(
        &self,
        sb: &Sandbox,
        prep: Prepared,
        pin_from: Option<&Scan<'_>>,
        kill: Option<(&HashSet<i32>, &mut Vec<i32>)>,
    ) -> Result<Swapped> {
        let t0 = Instant::now();
        let kill_mode = kill.is_some();
        let mut prep = prep;
        let mut volumes = std::mem::take(&mut prep.volumes);
        if let Err(e) = sb.cgroup.freeze() {
            self.discard_prepared(prep);
            self.discard_prepared_volumes(volumes);
            return Err(e.into());
        }
        let t_frozen = t0.elapsed();
        let mut stale = Vec::new();
        let res = self.swap_frozen(sb, prep, pin_from, kill, &mut volumes, &mut stale);
        let thawed = sb.cgroup.thaw();
        let t_thawed = t0.elapsed();
        // Processes that kept a working directory in the old root stop at the thaw: move them.
        let stragglers = Stragglers(rebase_cwds(stale, Some(Instant::now() + REBASE_PATIENCE)));
        // Volume mounts swapped in the window get their host-side views; the others are undone.
        let volumes = self.finish_volume_swaps(volumes, kill_mode);
        // The host-side mount (file API) is swapped after the thaw; the caller holds the file gate.
        let (gen, pinned, host_clone) = res?;
        let target = sb.dirs.rootfs_gen(gen.n);
        std::fs::create_dir_all(&target).map_err(RuntimeError::io("create root mount point"))?;
        rootswap::attach_host_root(&target, host_clone)?;
        self.mount_volumes_in_host_view(sb, &target);
        tracing::debug!(sandbox = %sb.id, ?t_frozen, ?t_thawed, total = ?t0.elapsed(), "root swapped");
        thawed?;
        Ok(Swapped { gen, pinned, stragglers, volumes })
    }

    pub(crate) fn swap_frozen(
        &self,
        sb: &Sandbox,
        prep: Prepared,
        pin_from: Option<&Scan<'_>>,
        kill: Option<(&HashSet<i32>, &mut Vec<i32>)>,
        volumes: &mut [crate::volumes::PreparedVolume],
        stale: &mut Vec<(bb_sys::ptrace::PendingStop, PathBuf)>,
    ) -> Result<(Generation, rootswap::PinStats, std::os::fd::OwnedFd)> {
        let tq = Instant::now();
        let rootfs = sb.rootfs();
        if let Some((keep, killed)) = kill {
            if kill_in_sandbox_procfs(sb, keep, killed).is_err() {
                // No procfs of its own to read: ask each member for its pid in the sandbox.
                for hp in &sb.cgroup.pids()? {
                    if *hp == sb.init_pid {
                        continue;
                    }
                    let ns = ns_pid(*hp);
                    if ns.is_some_and(|p| keep.contains(&p)) {
                        continue;
                    }
                    // A member of the sandbox's cgroup (frozen: it dies on thaw).
                    if bb_sys::process::kill(*hp, libc::SIGKILL).is_ok() {
                        killed.extend(ns);
                    }
                }
            }
        }
        let mut pinned = rootswap::PinStats::default();
        let mut pinned_files = Vec::new();
        let pin_from_upper = pin_from.map(|s| s.old_upper);
        if let Some(scan) = pin_from {
            let old_upper = scan.old_upper;
            let dev = std::fs::metadata(&rootfs).map_err(RuntimeError::io("stat sandbox root"))?.dev();
            // Through the sandbox's own procfs: its pids are what the spare sets hold, and
            // templates (frozen copies, they never write) need no look.
            let (proc, nspids) = own_pids_or_none(sb, scan.templates);
            let files = rootswap::written_files(&proc, &nspids, dev);
            let others: Vec<i32> = nspids.iter().copied().filter(|p| !scan.sessions.contains(p)).collect();
            request_rebase(sb, rootswap::stale_cwds(&proc, &others, dev), stale)?;
            tracing::debug!(sandbox = %sb.id, processes = nspids.len(), took = ?tq.elapsed(), "frozen scan");
            match rootswap::pin_open_files(&files, old_upper, &prep.upper) {
                Ok(p) => {
                    pinned = p;
                    pinned_files = files;
                }
                Err(e) => {
                    rootswap::unpin(&files, old_upper, &prep.upper);
                    self.remove_layer_dir(&prep.lid);
                    return Err(e);
                }
            }
        }
        let Prepared { lid, upper, mnt, chain, n, .. } = prep;
        // Volumes first: the root's pivot moves their new mounts along.
        let templates = pin_from.map(|s| s.templates.clone()).unwrap_or_default();
        let swapped = self
            .swap_volumes_frozen(sb, volumes, &templates, stale)
            .and_then(|()| rootswap::swap_root(sb.init_pid, mnt));
        match swapped {
            Ok(host_clone) => {
                Ok((Generation { upper: lid, mounted: chain.clone(), chain, base: None, n }, pinned, host_clone))
            }
            Err(e) => {
                if let Some(old_upper) = pin_from_upper {
                    rootswap::unpin(&pinned_files, old_upper, &upper);
                }
                self.remove_layer_dir(&lid);
                Err(e)
            }
        }
    }

    /// Background clean-up after a root swap: the old work dir goes (writes through stale
    /// references to the old root then fail instead of reaching a frozen layer), the frozen
    /// layer's size is measured, a discarded writable layer is deleted, deep chains compacted.
    pub(crate) fn after_swap(
        self: &Arc<Self>,
        sb: &Arc<Sandbox>,
        old_n: u64,
        measure: Option<String>,
        discard: Option<String>,
    ) {
        let rt = self.clone();
        let dir = sb.dirs.dir.clone();
        let old_root = sb.dirs.rootfs_gen(old_n);
        let cleanup = tokio::task::spawn_blocking(move || {
            // Not put off by BEHIND_ANSWER: until the old root is unmounted its layers count as
            // in use, and a snapshot deleted meanwhile would leave its layer behind.
            // Behind the requests that follow.
            let _nice = bb_sys::process::niced_thread(10);
            if bb_layers::unmount(&old_root).is_ok() {
                let _ = std::fs::remove_dir(&old_root);
            }
            let _ = std::fs::remove_dir_all(dir.join(format!("work-{old_n}")));
            if let Some(l) = measure {
                let size = du(&layer_dir(&rt.cfg, &rt.images, &l));
                let _ = rt.snapshots.records().set_layer_size(&l, size);
            }
            if let Some(l) = discard {
                rt.remove_layer_dir(&l);
            }
        });
        let (rt, sb) = (self.clone(), sb.clone());
        tokio::spawn(async move {
            let _ = cleanup.await;
            rt.maybe_compact(&sb).await;
        });
    }
}
