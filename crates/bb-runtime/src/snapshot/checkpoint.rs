//! Checkpoint: take a snapshot of a live sandbox.
//!
//! With every session idle (their operation locks held), each session server forks: the child
//! is the snapshot's session template, frozen between requests. Meanwhile the next root is
//! prepared ([`Runtime::prepare`]); then, in the frozen window ([`Runtime::swap_prepared`]),
//! files open for writing are moved to the new writable layer, processes with a working
//! directory in the old root are marked to move, and the sandbox pivots onto the fresh layer
//! stacked on the frozen one. The snapshot row and the sandbox's next generation are recorded
//! in one transaction. Templates are registered with init, spare copies made and huge pages
//! collapsed behind the answer.
//!
//! Nothing changed since the last checkpoint or rollback (no dirty session, empty writable
//! layer): the new snapshot shares that one's layers (`lightweight`).

use super::swap::Scan;
use super::{legacy, ms, snapshot_id};
use crate::error::{Result, RuntimeError};
use crate::layers::dir_is_empty;
use crate::model::*;
use crate::sandbox::launch::layer_dir;
use crate::sandbox::Sandbox;
use crate::session::{self, Session};
use crate::session_templates::TEMPLATE_TAG;
use crate::snapshot::store::{Generation, SnapSession, SnapshotRow};
use crate::{now, Runtime};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// What a checkpoint is taken for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// A snapshot to keep (checkpoint, fork): the sessions as its `processes` ask, and the
    /// sandbox's new base (its successors' parent).
    Keep,
    /// Evaluate's, deleted after: the files alone, any snapshot of the same files will do, and
    /// the sandbox does not stand on it.
    Evaluate,
}

impl Runtime {
    pub async fn checkpoint(self: &Arc<Self>, id: &str, req: CheckpointRequest) -> Result<SnapshotInfo> {
        let t0 = Instant::now();
        if req.label.as_ref().is_some_and(|l| l.len() > 256) {
            return Err(RuntimeError::BadRequest("label is longer than 256 bytes: shorten it".into()));
        }
        let sb = self.live(id)?;
        let _op = sb.begin_op().await;
        self.memory_backpressure(&sb).await;
        let t_locked = t0.elapsed();
        self.check_trees_keepable(req.processes)?;
        let (row, _) = self.checkpoint_locked(&sb, req.label, Purpose::Keep, req.processes).await?;
        let t_done = t0.elapsed();
        // A new snapshot has no children yet: no need to read the others.
        let mut info = self.snapshot_info(&row, Vec::new());
        info.took_ms = Some(ms(t0));
        tracing::debug!(sandbox = %sb.id, ?t_locked, ?t_done, took = ?t0.elapsed(), "checkpoint request");
        Ok(info)
    }

    /// Refuse `processes` that keep background processes when this daemon cannot use CRIU.
    pub(crate) fn check_trees_keepable(&self, processes: Processes) -> Result<()> {
        match self.process_images.unavailable() {
            Some(why) if processes.trees() => Err(RuntimeError::Unavailable(format!(
                "processes \"all\" and \"keepable\" need CRIU, which this daemon cannot use ({why}): use processes \"sessions\""
            ))),
            _ => Ok(()),
        }
    }

    /// Take a snapshot of `sb` (caller holds `sb.ops`) for `purpose`. `processes` `none`: files
    /// only, in a snapshot of its own; `all`/`keepable`: background process trees too, as process
    /// images dumped in the frozen window of the root swap (one consistent state with the
    /// files). Returns the snapshot and whether it is new (false: an existing one was reused
    /// because nothing changed).
    pub(crate) async fn checkpoint_locked(
        self: &Arc<Self>,
        sb: &Arc<Sandbox>,
        label: Option<String>,
        purpose: Purpose,
        processes: Processes,
    ) -> Result<(SnapshotRow, bool)> {
        let all_processes = processes.trees();
        let files_only = !processes.sessions();
        let with_sessions = purpose == Purpose::Keep && !files_only;
        let gen = sb.gen.lock().clone().ok_or_else(|| legacy(&sb.id))?;
        let sessions_map = sb.sessions.lock().await;
        let default_id = sb.default_session.lock().await.clone();
        let mut sessions: Vec<Arc<Session>> = sessions_map.values().filter(|s| s.is_alive()).cloned().collect();
        sessions.sort_by(|a, b| a.id.cmp(&b.id));
        let t_enter = Instant::now();
        let mut guards = Vec::with_capacity(sessions.len());
        for s in &sessions {
            guards.push(s.op_lock.lock().await);
        }
        let t_sessions_idle = t_enter.elapsed();
        // Volumes that branch with the sandbox are snapshotted in the same frozen window.
        let vmounts = self.branch_mounts(sb);
        let _vlocks = self.lock_branch_volumes(&vmounts).await;
        let upper_dir = layer_dir(&self.cfg, &self.images, &gen.upper);

        // Nothing changed since the last checkpoint or rollback: share that snapshot.
        // (Background processes do not mark the sandbox dirty: with them, always a new one.)
        if !all_processes
            && !sb.dirty.load(Ordering::SeqCst)
            && dir_is_empty(&upper_dir)
            && self.branch_volumes_unchanged(sb)
        {
            if let Some(base) = gen.base.as_deref().and_then(|b| self.snapshots.records().get(b).ok().flatten()) {
                let same: Vec<&str> = base.sessions.iter().map(|s| s.id.as_str()).collect();
                let now_ids: Vec<&str> = sessions.iter().map(|s| s.id.as_str()).collect();
                if purpose == Purpose::Evaluate {
                    return Ok((base, false));
                }
                // Templates are forked in the sandbox that holds them: a fork child's sessions
                // (copies of its parent's templates) need templates of their own.
                if files_only || (same == now_ids && base.sandbox_id == sb.id) {
                    let row = SnapshotRow {
                        id: snapshot_id(),
                        sandbox_id: sb.id.clone(),
                        parent: Some(base.id.clone()),
                        created_at: now(),
                        label,
                        layers: base.layers.clone(),
                        own_layer: None,
                        spec: self.spec_now(sb),
                        sessions: if files_only { Vec::new() } else { base.sessions.clone() },
                        processes: Vec::new(),
                    };
                    self.record_snapshot(sb, &row, Generation { base: Some(row.id.clone()), ..gen })?;
                    self.record_checkpoint_volumes(sb, &row.id, &self.volume_states(&vmounts)?)?;
                    return Ok((row, true));
                }
            }
        }

        // The next root is built while the sessions fork (they are idle: we hold their locks).
        let t0 = Instant::now();
        let mut chain = gen.chain.clone();
        chain.push(gen.upper.clone());
        let prep = {
            let (rt, sbc, n) = (self.clone(), sb.clone(), gen.n + 1);
            tokio::task::spawn_blocking(move || rt.prepare(&sbc, n, chain))
        };
        // Each session forks its template; the templates' own "ready" is awaited after the
        // swap (they took their record of cwd and files before the fork).
        let mut snap_sessions = Vec::new();
        let mut pending: Vec<(usize, session::PendingFork)> = Vec::new();
        if with_sessions {
            for s in &sessions {
                let default = default_id.as_deref() == Some(s.id.as_str());
                match s.fork_begin("template").await {
                    Ok(p) => pending.push((snap_sessions.len(), p)),
                    Err(e) => {
                        tracing::warn!(sandbox = %sb.id, session = %s.id, "session did not fork; it will restart fresh on rollback: {e}")
                    }
                }
                snap_sessions.push(SnapSession {
                    id: s.id.clone(),
                    kind: s.kind.clone(),
                    default,
                    template: None,
                    image: None,
                    lost: None,
                    created_at: s.created_at,
                });
            }
        }
        let t_forked = t0.elapsed();
        tracing::debug!(sandbox = %sb.id, ?t_sessions_idle, ?t_forked, "checkpoint sessions forked");
        // Templates (never write) and live sessions (they re-resolve their own working
        // directory) are spared by the frozen scan; the new templates are not registered yet.
        let spare = {
            let mut templates = self.session_templates.pids_of(&sb.id);
            templates.extend(pending.iter().map(|(_, p)| p.pid));
            (templates, sessions.iter().map(|s| s.pid).collect::<HashSet<i32>>())
        };
        // Files: freeze, pin open files, swap the root onto the fresh writable layer.
        // File operations wait until the new root is recorded (they open `sb.rootfs()`).
        // Background processes' commands, asked of init before it is frozen with the rest.
        let tags = if all_processes { crate::sandbox::exec::tags(sb).await? } else { HashMap::new() };
        if all_processes && self.process_images.lazy_serving_in(&sb.id) {
            // Memory a lazy restore is still copying in: the dumps below wait for it, better
            // before the freeze than in it.
            let (rt, id) = (self.clone(), sb.id.clone());
            tokio::task::spawn_blocking(move || rt.process_images.wait_lazy(&id))
                .await
                .map_err(RuntimeError::Worker)?;
        }
        let mounts = sb.mounts.lock().await;
        let gate = sb.fs_gate.write().await;
        let vgates = self.gate_branch_volumes(&vmounts).await;
        let swapped = match prep.await.map_err(RuntimeError::Worker).and_then(|p| p) {
            Ok(mut prep) => {
                let (rt, sbc, old) = (self.clone(), sb.clone(), upper_dir.clone());
                let vm = vmounts.clone();
                let (tx, rx) = tokio::sync::oneshot::channel();
                tokio::task::spawn_blocking(move || {
                    match rt.prepare_volume_checkpoint(&vm) {
                        Ok(v) => prep.volumes = v,
                        Err(e) => {
                            rt.discard_prepared(prep);
                            let _ = tx.send(Err(e));
                            return;
                        }
                    }
                    let kept = if all_processes {
                        let mut skip = spare.0.clone();
                        skip.extend(&spare.1);
                        let strict = processes == Processes::All;
                        match rt.dump_background_frozen(&sbc, &skip, &tags, strict) {
                            Ok(k) => k,
                            Err(e) => {
                                rt.discard_prepared(prep);
                                let _ = tx.send(Err(e));
                                return;
                            }
                        }
                    } else {
                        Vec::new()
                    };
                    let scan = Scan { old_upper: &old, templates: &spare.0, sessions: &spare.1 };
                    match rt.swap_prepared(&sbc, prep, Some(&scan), None) {
                        Ok(sw) => {
                            let _ = tx.send(Ok((sw.gen, sw.pinned, kept, sw.volumes)));
                            drop(sw.stragglers); // on this thread, their tracer
                        }
                        Err(e) => {
                            rt.process_images.delete(&kept.iter().map(|k| k.image.clone()).collect::<Vec<_>>());
                            let _ = tx.send(Err(e));
                        }
                    }
                });
                rx.await.map_err(|_| super::SnapshotError::SwapWorkerGone.into()).and_then(|r| r)
            }
            Err(e) => Err(e),
        };
        let (new_gen, pinned, kept, volume_states) = match swapped {
            Ok(x) => x,
            Err(e) => {
                for (_, p) in pending {
                    let _ = crate::sandbox::sessions::kill_process(sb, p.pid).await;
                }
                return Err(e);
            }
        };
        let t_swapped = t0.elapsed();
        let mut new_templates: Vec<(String, Arc<Session>, std::os::unix::net::UnixStream)> = Vec::new();
        for (i, p) in pending {
            let pid = p.pid;
            let ready = (|| {
                let chan = p.channel();
                let keep = chan.try_clone().map_err(RuntimeError::io("socket"))?;
                let key = format!("tp-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
                Ok::<_, RuntimeError>((
                    key.clone(),
                    Session::attach(key, snap_sessions[i].kind.clone(), pid, now(), chan)?,
                    keep,
                ))
            })();
            match ready {
                Ok((key, t, keep)) => {
                    snap_sessions[i].template = Some(key.clone());
                    new_templates.push((key, Arc::new(t), keep));
                }
                Err(e) => {
                    tracing::warn!(sandbox = %sb.id, session = %snap_sessions[i].id, "template did not start; the session will restart fresh on rollback: {e}");
                    let _ = crate::sandbox::sessions::kill_process(sb, pid).await;
                }
            }
        }
        if pinned.files > 0 {
            tracing::debug!(sandbox = %sb.id, files = pinned.files, bytes = pinned.bytes_copied, "open files moved to the live layer");
        }
        let row = SnapshotRow {
            id: snapshot_id(),
            sandbox_id: sb.id.clone(),
            parent: gen.base.clone(),
            created_at: now(),
            label,
            layers: new_gen.chain.clone(),
            own_layer: Some(gen.upper.clone()),
            spec: self.spec_now(sb),
            sessions: snap_sessions,
            processes: kept,
        };
        // Evaluate's snapshot is deleted after: the sandbox does not stand on it.
        let base = (purpose == Purpose::Keep).then(|| row.id.clone());
        self.record_snapshot(sb, &row, Generation { base, ..new_gen })?;
        self.record_checkpoint_volumes(sb, &row.id, &volume_states)?;
        // Frozen volume layers are the last layer of each chain a swap moved: measured later.
        let frozen: Vec<String> = volume_states.iter().filter_map(|(_, chain)| chain.last().cloned()).collect();
        self.measure_layers_later(frozen);
        for p in &row.processes {
            self.process_images.settled(&p.image);
        }
        let t_db = t0.elapsed();
        drop(vgates);
        drop(gate);
        drop(mounts);
        sb.dirty.store(false, Ordering::SeqCst);
        drop(guards);
        drop(sessions_map);
        if with_sessions {
            for s in &sessions {
                self.maybe_collapse_session(sb, s);
            }
        }
        let mut evicted = Vec::new();
        let mut spares = Vec::new();
        for (key, t, keep) in new_templates {
            spares.push(key.clone());
            // Registered with init off the critical path.
            crate::sandbox::sessions::adopt_behind_answer(
                sb.clone(),
                t.pid,
                format!("{TEMPLATE_TAG}{key}:{}", t.kind),
                key.clone(),
                keep,
                "template",
            );
            evicted.extend(self.session_templates.insert(key, sb.id.clone(), t));
        }
        // Out of the pool already (nothing forks them any more): dumped or dropped after the
        // answer.
        self.evict_templates(evicted);
        self.after_swap(sb, gen.n, Some(gen.upper.clone()), None);
        self.make_spares(sb, spares);
        let (rt, sbc) = (self.clone(), sb.clone());
        // Between the sandbox's operations: a rollback may be forking any of its templates.
        tokio::spawn(async move {
            let _ops = sbc.ops.lock().await;
            rt.relieve_memory(&sbc, None).await
        });
        tracing::debug!(sandbox = %sb.id, ?t_forked, ?t_swapped, ?t_db, total = ?t0.elapsed(), "checkpoint");
        Ok((row, true))
    }
}
