//! Rollback: put a sandbox back at one of its snapshots, files and sessions.
//!
//! The snapshot's session templates are forked first (or their spare copies taken, made ahead
//! by [`crate::session_templates`]); then, in the frozen window, every process but init, the
//! templates and the new copies is killed and the sandbox pivots onto a fresh writable layer
//! over the snapshot's chain. A session whose template is gone starts fresh, and the answer
//! says so (`sessions_restarted`).

use super::{legacy, ms};
use crate::error::{Result, RuntimeError};
use crate::layers::Generation;
use crate::model::*;
use crate::sandbox::procs::taken_pid;
use crate::session::{self, Session};
use crate::Runtime;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

impl Runtime {
    pub async fn rollback(self: &Arc<Self>, id: &str, req: RollbackRequest) -> Result<RollbackResult> {
        let t0 = Instant::now();
        let sb = self.live(id)?;
        let snap = self.snapshot_row(&req.snapshot)?;
        if snap.spec.image != sb.spec.image {
            return Err(RuntimeError::BadRequest(format!(
                "snapshot {} was taken in a sandbox of image {:?} and this one runs {:?}: fork the snapshot instead",
                snap.id, snap.spec.image, sb.spec.image
            )));
        }
        let eager = req.lazy_pages == Some(false);
        let _op = sb.begin_op().await;
        let gen = sb.gen.lock().clone().ok_or_else(|| legacy(&sb.id))?;
        let mut sessions_map = sb.sessions.lock().await;
        let mut default = sb.default_session.lock().await;
        let old: Vec<Arc<Session>> = sessions_map.values().cloned().collect();
        let mut guards = Vec::new();
        for s in &old {
            guards.push(s.op_lock.lock().await);
        }
        let old_pids: HashSet<i32> = old.iter().map(|s| s.pid).collect();
        // Volumes that branch with the sandbox go back to the snapshot's state in the same window.
        let vmounts = self.branch_mounts(&sb);
        let _vlocks = self.lock_branch_volumes(&vmounts).await;
        let prep = {
            let (rt, sbc, n, chain) = (self.clone(), sb.clone(), gen.n + 1, snap.layers.clone());
            tokio::task::spawn_blocking(move || rt.prepare(&sbc, n, chain))
        };
        // Fork the templates first: the copies re-resolve their cwd and files by path on their
        // first request, after the swap below moved them (with everything else) to the new root.
        // A spare copy made ahead is taken (waiting for one being made), else one is forked. A
        // template that left memory is restored from its process image first.
        let mut restored: Vec<Option<session::PendingFork>> = Vec::new();
        let mut reasons: Vec<Option<String>> = Vec::new();
        for ss in &snap.sessions {
            let forked = match self.ensure_template(&sb, &snap, ss, eager).await {
                Ok((t, slot)) => {
                    let spare = slot.lock().await.take();
                    match spare {
                        Some(p) if !p.is_gone() => Ok(p),
                        _ => t.fork_begin("restore").await.map_err(|e| format!("forking its template failed: {e}")),
                    }
                }
                Err(why) => Err(why),
            };
            match forked {
                Ok(x) => {
                    restored.push(Some(x));
                    reasons.push(None);
                }
                Err(why) => {
                    tracing::debug!(sandbox = %sb.id, session = %ss.id, "session starts fresh: {why}");
                    restored.push(None);
                    reasons.push(Some(why));
                }
            }
        }
        let t_forked = t0.elapsed();
        let mut keep = self.session_templates.pids_of(&sb.id);
        keep.extend(restored.iter().flatten().map(|p| p.pid));
        tracing::debug!(sandbox = %sb.id, ?keep, "rollback keeps");
        let t_mounts = Instant::now();
        let mounts = sb.mounts.lock().await;
        let mounts_wait = t_mounts.elapsed();
        let gate = sb.fs_gate.write().await;
        let vgates = self.gate_branch_volumes(&vmounts).await;
        let t_gate = t0.elapsed();
        let prep = prep.await;
        tracing::debug!(?t_forked, ?mounts_wait, ?t_gate, t_prep = ?t0.elapsed(), "rollback prep");
        let swapped = match prep.map_err(RuntimeError::Worker).and_then(|p| p) {
            Ok(mut prep) => {
                let (rt, sbc, sid) = (self.clone(), sb.clone(), snap.id.clone());
                tokio::task::spawn_blocking(move || {
                    match rt.prepare_volume_rollback(&sbc, &sid) {
                        Ok(v) => prep.volumes = v,
                        Err(e) => {
                            rt.discard_prepared(prep);
                            return Err(e);
                        }
                    }
                    let mut killed = Vec::new();
                    rt.swap_prepared(&sbc, prep, None, Some((&keep, &mut killed))).map(|sw| (sw.gen, killed))
                })
                .await
                .map_err(RuntimeError::Worker)
                .and_then(|r| r)
            }
            Err(e) => Err(e),
        };
        let (new_gen, killed) = match swapped {
            Ok(x) => x,
            Err(e) => {
                for p in restored.into_iter().flatten() {
                    let _ = crate::sandbox::sessions::kill_process(&sb, p.pid).await;
                }
                return Err(e);
            }
        };
        let t_swapped = t0.elapsed();
        // The proxy's record too: what is asked from here on was answered after the snapshot.
        self.net.proxy.recorder.rewind(&sb.id, &snap.id);
        // The copies exist (their own start-up overlaps the answer).
        let mut ready: Vec<Option<(Session, std::os::unix::net::UnixStream)>> = Vec::new();
        for (ss, p) in snap.sessions.iter().zip(restored) {
            let Some(p) = p else {
                ready.push(None);
                continue;
            };
            let pid = p.pid;
            let r = (|| {
                let chan = p.channel();
                let keep = chan.try_clone().map_err(RuntimeError::io("socket"))?;
                Ok::<_, RuntimeError>((
                    Session::attach(ss.id.clone(), ss.kind.clone(), pid, ss.copy_created_at(), chan)?,
                    keep,
                ))
            })();
            ready.push(match r {
                Ok(x) => Some(x),
                Err(e) => {
                    tracing::warn!(sandbox = %sb.id, session = %ss.id, "restored session did not start; it starts fresh: {e}");
                    let _ = crate::sandbox::sessions::kill_process(&sb, pid).await;
                    None
                }
            });
        }
        self.set_gen(&sb, Generation { base: Some(snap.id.clone()), ..new_gen })?;
        // The network stays the sandbox's; a snapshot from before it was wired has no resolver.
        if sb.net.lock().wired.is_some() {
            self.ensure_resolver(&sb.id, &sb.rootfs());
        }
        drop(vgates);
        drop(gate);
        drop(mounts);
        for s in &old {
            s.forget().await;
        }
        drop(guards);
        sessions_map.clear();
        *default = None;
        let mut restarted = Vec::new();
        for ((ss, r), why) in snap.sessions.iter().zip(ready).zip(reasons) {
            let s = match r {
                Some((s, keep)) => {
                    let tag = session::session_tag(&ss.id, &ss.kind, ss.default);
                    crate::sandbox::sessions::adopt_behind_answer(
                        sb.clone(),
                        s.pid,
                        tag,
                        ss.id.clone(),
                        keep,
                        "restored session",
                    );
                    s
                }
                None => {
                    let reason = why.unwrap_or_else(|| "its restored copy did not start".into());
                    restarted.push(RestartedSession { session: ss.id.clone(), reason });
                    crate::sandbox::sessions::create_as(
                        &sb,
                        Some(ss.id.clone()),
                        &ss.kind,
                        ss.default,
                        None,
                        &Default::default(),
                    )
                    .await?
                }
            };
            if ss.default {
                *default = Some(ss.id.clone());
            }
            sessions_map.insert(ss.id.clone(), Arc::new(s));
        }
        drop(sessions_map);
        drop(default);
        let (restored_processes, processes_not_restored) = self.restore_snapshot_processes(&sb, &snap, eager).await;
        // Sessions started fresh are not the snapshot's: the next checkpoint must not reuse it.
        sb.dirty.store(!restarted.is_empty(), Ordering::SeqCst);
        self.after_swap(&sb, gen.n, None, Some(gen.upper.clone()));
        self.make_spares(&sb, snap.sessions.iter().filter_map(|ss| ss.template.clone()).collect());
        let mut killed: Vec<i32> =
            killed.into_iter().filter(|p| !old_pids.contains(p) && !restored_processes.contains(p)).collect();
        killed.sort_unstable();
        tracing::debug!(sandbox = %sb.id, ?t_forked, ?t_swapped, total = ?t0.elapsed(), "rollback");
        Ok(RollbackResult {
            snapshot: snap.id,
            sessions_restarted: !restarted.is_empty(),
            restarted,
            killed,
            restored_processes,
            processes_not_restored,
            took_ms: ms(t0),
        })
    }

    /// Restore the background process trees `snap` keeps (`processes: "all"`) into `sb`, after
    /// its root swap (the processes the rollback killed are gone first: the trees come back
    /// under the same pids), and register them with init under their commands. Returns the
    /// restored roots, and why the others were not. `eager`: their memory is read in full first.
    pub(crate) async fn restore_snapshot_processes(
        self: &Arc<Self>,
        sb: &Arc<crate::sandbox::Sandbox>,
        snap: &super::store::SnapshotRow,
        eager: bool,
    ) -> (Vec<i32>, Vec<String>) {
        if snap.sandbox_id != sb.id {
            let failed = snap
                .processes
                .iter()
                .map(|p| {
                    format!(
                        "{} ({}): the snapshot was taken in sandbox {}; a rollback brings background processes back \
                         only there (fork the snapshot instead)",
                        p.pid, p.tag, snap.sandbox_id
                    )
                })
                .collect();
            return (Vec::new(), failed);
        }
        self.restore_background_trees(sb, &snap.processes, eager).await
    }

    /// Restore the background process trees `processes` (a snapshot's) into `sb` under their
    /// pids, and register them with init under their commands. Returns the restored roots, and
    /// why the others were not (each is killed). `eager`: their memory is read in full first.
    pub(crate) async fn restore_background_trees(
        self: &Arc<Self>,
        sb: &Arc<crate::sandbox::Sandbox>,
        processes: &[super::store::SnapProcess],
        eager: bool,
    ) -> (Vec<i32>, Vec<String>) {
        let (mut restored, mut failed) = (Vec::new(), Vec::new());
        let _mounts = sb.mounts.lock().await;
        let proc = crate::sandbox::procs::sandbox_proc(sb);
        for p in processes {
            // Killed at the swap, they die at the thaw and init reaps them, with the members of
            // their groups and sessions (which hold the leaders' pids).
            let tasks = self.process_images.manifest(&p.image).map(|m| m.tasks).unwrap_or_else(|| vec![p.pid]);
            let t_wait = Instant::now();
            let (first, mut last) = (taken_pid(&proc, &tasks), None);
            let mut taken = first;
            while taken.is_some() && t_wait.elapsed() < PIDS_FREE_PATIENCE {
                last = taken;
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                taken = taken_pid(&proc, &tasks);
            }
            if first.is_some() {
                tracing::debug!(sandbox = %sb.id, ?first, ?last, waited = ?t_wait.elapsed(), "pids to restore were taken");
            }
            if let Some(t) = taken {
                let holder = std::fs::read_to_string(proc.join(format!("{}/stat", t.by))).unwrap_or_default();
                tracing::warn!(sandbox = %sb.id, pid = t.pid, holder = %holder.trim(), "a pid to restore is still taken after {PIDS_FREE_PATIENCE:?}");
            }
            let res = match &p.attached {
                None => match self.restore_tree(sb, &p.image, eager, Vec::new()).await {
                    Ok(()) => crate::sandbox::exec::adopt_background(sb, p.pid, p.tag.clone()).await,
                    Err(e) => Err(e),
                },
                Some(kept) => self.restore_attached(sb, p, kept, eager).await,
            };
            match res {
                Ok(()) => restored.push(p.pid),
                Err(e) => {
                    tracing::warn!(sandbox = %sb.id, pid = p.pid, image = %p.image, "a background process of the snapshot was not restored: {e}");
                    let _ = crate::sandbox::sessions::kill_process(sb, p.pid).await;
                    failed.push(format!("{} ({}): {e}", p.pid, p.tag));
                }
            }
        }
        (restored, failed)
    }
}

impl Runtime {
    /// Restore process image `image` into `sb`, handing in `inherit` (fds, each with CRIU's name
    /// of the file it takes the place of); the fds are closed once it is done.
    async fn restore_tree(
        self: &Arc<Self>,
        sb: &Arc<crate::sandbox::Sandbox>,
        image: &str,
        eager: bool,
        inherit: Vec<(std::os::fd::OwnedFd, String)>,
    ) -> Result<()> {
        use std::os::fd::AsRawFd;
        let (rt, sbc, img) = (self.clone(), sb.clone(), image.to_string());
        tokio::task::spawn_blocking(move || {
            let raw: Vec<(std::os::fd::RawFd, String)> =
                inherit.iter().map(|(fd, k)| (fd.as_raw_fd(), k.clone())).collect();
            rt.process_images.restore(&sbc, &img, eager, &raw).map(|_| ())
        })
        .await
        .map_err(RuntimeError::Worker)
        .and_then(|r| r)
    }

    /// Restore attached process `p` (wired as `kept` says) into `sb` with new ends there, and
    /// hand it to whoever takes restored attached processes ([`Runtime::on_attached_restored`]).
    async fn restore_attached(
        self: &Arc<Self>,
        sb: &Arc<crate::sandbox::Sandbox>,
        p: &super::store::SnapProcess,
        kept: &crate::sandbox::exec::KeptAttached,
        eager: bool,
    ) -> Result<()> {
        let (inherit, ends) = crate::sandbox::exec::ends_for(sb, &kept.wire).await?;
        self.restore_tree(sb, &p.image, eager, inherit).await?;
        let attached = crate::sandbox::exec::adopt_attached(sb, p.pid, p.tag.clone(), kept, ends).await?;
        self.attached_restored(&sb.id, kept.note.clone(), attached);
        Ok(())
    }
}

/// How long a rollback waits for the processes it killed to be gone before it restores the
/// snapshot's background processes under their pids.
const PIDS_FREE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);
