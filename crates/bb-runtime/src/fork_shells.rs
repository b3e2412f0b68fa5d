//! Pre-built nested shells for live forks.
//!
//! A live fork's children are sandboxes nested in the parent's namespaces
//! ([`crate::sandbox::launch::launch_nested`]); making one costs a few milliseconds of the parent init's
//! and the host's time (namespaces, cgroup, mounts), queued behind each other on a small host.
//! After a fork of `n` children, the daemon tops that parent's shells up to `n` (a named
//! template's `shells` at least; at most [`MAX_PER_PARENT`] per parent and [`MAX_TOTAL`] in all)
//! in the background (one at a time, at low priority), so the next fork from it only has to *claim*
//! them: its root is swapped onto the snapshot's layers (the same pivot as a rollback), its
//! limits set, and it is registered as a sandbox.
//!
//! A shell is an idle nested init with a root of the parent's image layers and an empty
//! writable layer. Shells are not recorded in SQLite: a clean daemon shutdown tears them down
//! ([`Runtime::shutdown_pools`]), after a crash they are strays reaped at the next start. They die
//! with their parent (its pid namespace) and are torn down when it is killed. A parent with
//! egress has its shells wired ahead, as the warm pool's ([`crate::net::Net::prewire`]): its
//! children then only get their rules.

use crate::error::{Result, RuntimeError};
use crate::model::SandboxSpec;
use crate::sandbox::launch::{self, layer_dir, new_upper, SandboxDirs};
use crate::sandbox::rootswap;
use crate::sandbox::Sandbox;
use crate::snapshot::store::{Generation, SnapshotRow};
use crate::Runtime;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Most shells kept for one parent, and for all parents together.
pub const MAX_PER_PARENT: usize = 64;
pub const MAX_TOTAL: usize = 128;

/// A refill starts once no command or session code ran for `REFILL_QUIET` (a fork's children
/// run theirs right away), or after `REFILL_MAX_DEFER` at most.
const REFILL_QUIET: std::time::Duration = std::time::Duration::from_millis(20);
const REFILL_MAX_DEFER: std::time::Duration = std::time::Duration::from_millis(250);

/// How long the first root of a claimed shell is left mounted before it is removed.
const CLEANUP_DELAY: std::time::Duration = std::time::Duration::from_millis(300);

/// An idle nested sandbox, not yet handed out.
pub struct ForkShell {
    pub id: String,
    pub launched: launch::Launched,
    /// The writable layer and work dir its claim mounts (made with the shell, off the request's
    /// path: on a busy filesystem each new directory costs), as [`new_upper`] returns them.
    pub spare: Option<(String, PathBuf, PathBuf)>,
    /// Wired ahead ([`crate::net::Net::prewire`]): its parent had egress when it was built.
    pub wired: bool,
}

/// Pre-built shells of every parent, and how many to keep ready for each.
#[derive(Default)]
pub struct ForkShells {
    pub(crate) state: Mutex<ShellsState>,
    /// Shells to keep ready per parent beyond its last fork's size (a named template's
    /// `shells`).
    pub(crate) targets: Mutex<HashMap<String, usize>>,
}

/// The shells waiting, by parent, under [`ForkShells`]'s lock.
#[derive(Default)]
pub struct ShellsState {
    shells: HashMap<String, Vec<ForkShell>>,
    /// Parents whose pool is being refilled (one refill task each).
    refilling: std::collections::HashSet<String>,
    /// Set at daemon shutdown: no shell is built or kept any more.
    closed: bool,
}

impl ShellsState {
    pub fn total(&self) -> usize {
        self.shells.values().map(Vec::len).sum()
    }

    /// Up to `n` shells of `parent`.
    pub fn take(&mut self, parent: &str, n: usize) -> Vec<ForkShell> {
        let Some(v) = self.shells.get_mut(parent) else { return Vec::new() };
        let keep = v.len().saturating_sub(n);
        v.split_off(keep)
    }

    /// All shells of `parent` (it is going away).
    pub fn drain(&mut self, parent: &str) -> Vec<ForkShell> {
        self.shells.remove(parent).unwrap_or_default()
    }

    /// Writable layers of every shell in the pool.
    pub fn uppers(&self) -> Vec<String> {
        let spares = self.shells.values().flatten().filter_map(|s| s.spare.as_ref().map(|(lid, _, _)| lid.clone()));
        self.shells.values().flatten().map(|s| s.launched.upper.clone()).chain(spares).collect()
    }

    pub fn len_of(&self, parent: &str) -> usize {
        self.shells.get(parent).map_or(0, Vec::len)
    }

    /// Refill tasks still running.
    pub fn refills(&self) -> usize {
        self.refilling.len()
    }

    /// Daemon shutdown: no shell is kept from now on; returns every shell, to tear down.
    pub fn close(&mut self) -> Vec<ForkShell> {
        self.closed = true;
        self.shells.drain().flat_map(|(_, v)| v).collect()
    }
}

impl Runtime {
    /// Turn a shell of `parent` into a child standing on `snap`: its root swapped onto the
    /// snapshot's layers plus a fresh writable layer, its limits set, recorded as a sandbox.
    /// Blocking. On failure the shell is torn down.
    pub(crate) fn claim_shell(
        &self,
        shell: ForkShell,
        parent: &Sandbox,
        snap: &SnapshotRow,
        spec: &SandboxSpec,
        timeout: Option<f64>,
    ) -> Result<Arc<Sandbox>> {
        let ForkShell { id, launched, spare, wired } = shell;
        let dirs = SandboxDirs::new(&self.cfg.state_dir, &id);
        let t0 = std::time::Instant::now();
        let res = (|| -> Result<Generation> {
            let (lid, upper, work) = match spare {
                Some(spare) => spare,
                None => new_upper(&self.cfg, &dirs, 1)?,
            };
            let t_upper = t0.elapsed();
            let lower: Vec<PathBuf> = snap.layers.iter().rev().map(|l| layer_dir(&self.cfg, &self.images, l)).collect();
            let mnt = bb_layers::overlay_fd(
                &bb_layers::OverlaySpec { lower: &lower, upper: &upper, work: &work },
                &dirs.rootfs_gen(1),
            )
            .map_err(RuntimeError::from);
            let t_mnt = t0.elapsed();
            let swapped = mnt.and_then(|mnt| rootswap::swap_root(launched.init_pid, mnt)).and_then(|host_view| {
                tracing::debug!(?t_upper, ?t_mnt, swapped = ?t0.elapsed(), "claim");
                let target = dirs.rootfs_gen(1);
                std::fs::create_dir_all(&target).map_err(RuntimeError::io("create root mount point"))?;
                rootswap::attach_host_root(&target, host_view)
            });
            if let Err(e) = swapped {
                self.remove_layer_dir(&lid);
                return Err(e);
            }
            // The shell's first root goes off the request's path (unmounting waits for RCU).
            let (old_root, old_work, old_upper) = (dirs.rootfs(), dirs.dir.join("work-0"), launched.upper.clone());
            let snaplayers = crate::sandbox::launch::snaplayers_dir(&self.cfg.state_dir);
            let trash = self.cfg.state_dir.join("trash");
            let _ = std::thread::Builder::new().name("bb-cleanup".into()).spawn(move || {
                bb_sys::process::set_thread_nice(19);
                // After the burst a fork is (the children's first commands follow it): this
                // work holds mount and inode locks those need.
                std::thread::sleep(CLEANUP_DELAY);
                let _ = bb_layers::unmount(&old_root);
                let _ = std::fs::remove_dir_all(&old_work);
                let dead = trash.join(format!("{old_upper}-{}", uuid::Uuid::new_v4().simple()));
                if std::fs::rename(snaplayers.join(&old_upper), &dead).is_ok() {
                    let _ = std::fs::remove_dir_all(&dead);
                }
            });
            launched.cgroup.set_limits(&launch::limits(spec))?;
            tracing::debug!(done = ?t0.elapsed(), "claim");
            Ok(Generation {
                upper: lid,
                mounted: snap.layers.clone(),
                chain: snap.layers.clone(),
                base: Some(snap.id.clone()),
                n: 1,
            })
        })();
        match res {
            Ok(gen) => {
                let launched = launch::Launched { upper: gen.upper.clone(), ..launched };
                self.register(id, spec.clone(), launched, gen, Some(parent.id.clone()), timeout)
            }
            Err(e) => {
                if wired {
                    self.net.detach(&id);
                }
                let _ = launch::teardown(&self.cfg, &self.cgroups, &id, Some((launched.init_pid, launched.init_start)));
                self.remove_layer_dir(&launched.upper);
                Err(e)
            }
        }
    }

    /// Tear down every pooled shell of `parent`. Blocking.
    pub(crate) fn drop_shells(&self, parent: &str) {
        let shells = self.fork_shells.state.lock().drain(parent);
        self.discard_nested_shells(shells);
    }

    /// Tear down shells taken out of the pool. Blocking.
    pub(crate) fn discard_nested_shells(&self, shells: Vec<ForkShell>) {
        for s in shells {
            if s.wired {
                self.net.detach(&s.id);
            }
            let _ =
                launch::teardown(&self.cfg, &self.cgroups, &s.id, Some((s.launched.init_pid, s.launched.init_start)));
            self.remove_layer_dir(&s.launched.upper);
            if let Some((lid, _, _)) = &s.spare {
                self.remove_layer_dir(lid);
            }
        }
    }

    /// Build shells for `parent` in the background until it has `want` (within the caps).
    pub(crate) fn refill_shells(self: &Arc<Self>, parent: Arc<Sandbox>, want: usize) {
        let want = want.min(MAX_PER_PARENT);
        {
            let mut pool = self.fork_shells.state.lock();
            if pool.closed || pool.len_of(&parent.id) >= want || !pool.refilling.insert(parent.id.clone()) {
                return;
            }
        }
        let rt = self.clone();
        tokio::spawn(async move {
            rt.activity.wait_for_quiet(REFILL_QUIET, REFILL_MAX_DEFER).await;
            loop {
                let short = {
                    let pool = rt.fork_shells.state.lock();
                    !pool.closed && pool.len_of(&parent.id) < want && pool.total() < MAX_TOTAL
                };
                if !short || parent.is_dead() || rt.get(&parent.id).is_err() {
                    break;
                }
                let (rt2, p) = (rt.clone(), parent.clone());
                let built = tokio::task::spawn_blocking(move || {
                    // Background work: leave the CPU to foreground requests.
                    let _nice = bb_sys::process::niced_thread(10);
                    let id = format!("sb-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
                    let layers: Vec<PathBuf> =
                        p.spec.layers.iter().map(|l| layer_dir(&rt2.cfg, &rt2.images, l)).collect();
                    launch::launch_nested(&rt2.cfg, &rt2.cgroups, &id, &p.spec, &layers, &p.dirs.sock()).map(
                        |launched| {
                            // Without a spare, the claim makes the layer itself.
                            let spare = new_upper(&rt2.cfg, &SandboxDirs::new(&rt2.cfg.state_dir, &id), 1).ok();
                            // Children get the parent's policy unless the fork says otherwise.
                            let egress = p.net.lock().wired.is_some();
                            let wired = egress
                                && rt2
                                    .net
                                    .prewire(&id, launched.init_pid)
                                    .inspect_err(|e| {
                                        tracing::warn!(parent = %p.id, "wiring a fork shell ahead failed ({e}); it stays unwired")
                                    })
                                    .is_ok();
                            ForkShell { id, launched, spare, wired }
                        },
                    )
                })
                .await
                .map_err(RuntimeError::Worker)
                .and_then(|r| r);
                match built {
                    Ok(shell) => {
                        let alive = !parent.is_dead() && rt.get(&parent.id).is_ok();
                        // Kept under the lock that shutdown closes the pool with.
                        let unwanted = {
                            let mut pool = rt.fork_shells.state.lock();
                            if alive && !pool.closed {
                                pool.shells.entry(parent.id.clone()).or_default().push(shell);
                                None
                            } else {
                                Some(shell)
                            }
                        };
                        if let Some(shell) = unwanted {
                            rt.discard_nested_shells(vec![shell]);
                        }
                    }
                    Err(e) => {
                        if !parent.is_dead() && rt.get(&parent.id).is_ok() {
                            tracing::warn!(parent = %parent.id, "building a fork shell failed: {e}");
                        } // else killed meanwhile: its init is gone, and the failure with it
                        break;
                    }
                }
            }
            rt.fork_shells.state.lock().refilling.remove(&parent.id);
            // The parent may have gone while we worked.
            if parent.is_dead() || rt.get(&parent.id).is_err() {
                let rt2 = rt.clone();
                let _ = tokio::task::spawn_blocking(move || rt2.drop_shells(&parent.id)).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(root: &std::path::Path, id: &str) -> ForkShell {
        std::fs::create_dir_all(root.join("t").join(id)).unwrap();
        let layout = bb_isolation::CgroupLayout::with_roots(
            bb_isolation::CgroupVersion::V2,
            vec![("unified".into(), root.into())],
            "t",
        );
        ForkShell {
            id: id.into(),
            launched: launch::Launched {
                placement: ("test", 0.0),
                init_pid: 1,
                init_start: 1,
                cgroup: bb_isolation::Cgroup::open(&layout, id).unwrap(),
                upper: format!("sl-{id}"),
            },
            spare: None,
            wired: false,
        }
    }

    #[test]
    fn take_and_drain() {
        let d = tempfile::tempdir().unwrap();
        let shell = |id: &str| shell(d.path(), id);
        let mut p = ShellsState::default();
        p.shells.insert("a".into(), vec![shell("1"), shell("2"), shell("3")]);
        assert_eq!(p.total(), 3);
        assert_eq!(p.take("a", 2).len(), 2);
        assert_eq!(p.len_of("a"), 1);
        assert_eq!(p.take("a", 5).len(), 1, "never more than there are");
        assert!(p.take("b", 1).is_empty());
        p.shells.insert("a".into(), vec![shell("4")]);
        assert_eq!(p.drain("a").len(), 1);
        assert_eq!(p.total(), 0);
    }
}
