//! Session templates: frozen forks of session processes that snapshots restore from.
//!
//! At a checkpoint each session server forks; the child idles between requests as that
//! snapshot's *session template* (tag [`TEMPLATE_TAG`], registered with the sandbox's init so
//! it survives a daemon restart). A rollback forks the template again into a live session; a
//! live fork forks it into other sandboxes. Templates are kept in a bounded LRU
//! ([`SessionTemplates`], `--max-templates`); those of a sandbox backing a named template are
//! pinned. An evicted template is killed and its key forgotten in the snapshot records: a
//! rollback to that snapshot then starts the session fresh.
//!
//! *Spares*: behind a checkpoint or rollback, each template of the sandbox gets one copy forked
//! ahead ([`Runtime::make_spares`]), in a pause between the sandbox's operations, so the next
//! rollback to it takes the copy instead of forking on its path. At most [`MAX_SPARES`] exist;
//! the least recently used template's goes first.

use crate::sandbox::procs::sandbox_proc;
use crate::sandbox::Sandbox;
use crate::session::{self, Session};
use crate::Runtime;
use parking_lot::Mutex;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// Process tag of a template: `branchbox-template:<key>:<kind>`.
pub const TEMPLATE_TAG: &str = "branchbox-template:";

/// What happens to the snapshot records of templates that are dropped.
#[derive(Clone, Copy)]
enum Records<'a> {
    /// Their snapshots are deleted: forget the keys.
    Forget,
    /// A process image holds their state: the records keep the keys.
    Keep,
    /// Their state is lost, for this reason.
    Lost(&'a str),
}

/// One session template: a frozen fork of a session of sandbox `sandbox_id`.
pub struct SessionTemplate {
    pub key: String,
    pub sandbox_id: String,
    pub session: Arc<Session>,
    last_used: Instant,
    /// A copy of the template forked ahead of a rollback to it (see [`Runtime::make_spares`]);
    /// locked while one is being made, so a rollback waits for it rather than fork a second.
    spare: SpareSlot,
}

pub(crate) type SpareSlot = Arc<tokio::sync::Mutex<Option<session::PendingFork>>>;

/// Most spare copies kept (all sandboxes together). A spare shares every page with its
/// template; it costs a process and its page tables (a small fraction of the template's
/// resident memory).
pub const MAX_SPARES: usize = 32;

/// Share of a sandbox's memory limit its processes' anonymous memory may reach before its
/// templates leave the pool (see [`Runtime::relieve_memory`]).
const TEMPLATE_MEMORY_WATERMARK: f64 = 0.5;
/// Dumps of a sandbox's templates under way for that relief, at most.
const MAX_RELIEF_DUMPS: usize = 2;

/// Spares are made once the sandbox's checkpoints and rollbacks paused this long (a tree
/// search's next step usually comes sooner), or after `SPARE_MAX_DEFER` at most.
const SPARE_QUIET: std::time::Duration = std::time::Duration::from_millis(25);
const SPARE_MAX_DEFER: std::time::Duration = std::time::Duration::from_secs(2);

/// The live session templates by key, least recently used evicted beyond `cap`. Templates of
/// pinned sandboxes (those backing a named template) are never evicted.
pub struct SessionTemplates(Mutex<Lru>);

struct Lru {
    cap: usize,
    map: HashMap<String, SessionTemplate>,
    pinned: HashSet<String>,
    /// Templates out of the pool whose process is being dumped: (sandbox, pid), and a receiver
    /// that changes once the dump is over.
    evicting: HashMap<String, (String, i32, tokio::sync::watch::Receiver<bool>)>,
}

/// A template being dumped (see [`SessionTemplates::begin_evicting`]); dropping it ends that.
pub(crate) struct Evicting {
    rt: Arc<Runtime>,
    key: String,
    done: tokio::sync::watch::Sender<bool>,
}

impl Evicting {
    /// Someone waits for this dump to end ([`SessionTemplates::wait_evicted`]).
    fn has_waiters(&self) -> bool {
        // One receiver is the registry's own.
        self.done.receiver_count() > 1
    }
}

impl Drop for Evicting {
    fn drop(&mut self) {
        self.rt.session_templates.0.lock().evicting.remove(&self.key);
        let _ = self.done.send(true);
    }
}

impl SessionTemplates {
    pub fn new(cap: usize) -> Self {
        SessionTemplates(Mutex::new(Lru { cap, map: HashMap::new(), pinned: HashSet::new(), evicting: HashMap::new() }))
    }

    /// Add a template; returns the ones evicted to stay within the cap.
    pub fn insert(&self, key: String, sandbox_id: String, session: Arc<Session>) -> Vec<SessionTemplate> {
        let mut lru = self.0.lock();
        let t = SessionTemplate {
            key: key.clone(),
            sandbox_id,
            session,
            last_used: Instant::now(),
            spare: SpareSlot::default(),
        };
        lru.map.insert(key, t);
        let mut evicted = Vec::new();
        while lru.map.values().filter(|t| !lru.pinned.contains(&t.sandbox_id)).count() > lru.cap {
            let Some(oldest) = lru
                .map
                .values()
                .filter(|t| !lru.pinned.contains(&t.sandbox_id))
                .min_by_key(|t| t.last_used)
                .map(|t| t.key.clone())
            else {
                break;
            };
            evicted.extend(lru.map.remove(&oldest));
        }
        evicted
    }

    /// Keys of `sandbox_id`'s templates being dumped.
    pub fn evicting_keys(&self, sandbox_id: &str) -> Vec<String> {
        self.0.lock().evicting.iter().filter(|(_, (sb, _, _))| sb == sandbox_id).map(|(k, _)| k.clone()).collect()
    }

    /// Pids of `sandbox_id`'s templates being dumped.
    pub fn evicting_pids(&self, sandbox_id: &str) -> Vec<i32> {
        self.0.lock().evicting.values().filter(|(sb, _, _)| sb == sandbox_id).map(|(_, pid, _)| *pid).collect()
    }

    /// Keys of `sandbox_id`'s templates in the pool, least recently used first.
    pub fn keys_by_age(&self, sandbox_id: &str) -> Vec<String> {
        let lru = self.0.lock();
        let mut ts: Vec<&SessionTemplate> = lru.map.values().filter(|t| t.sandbox_id == sandbox_id).collect();
        ts.sort_by_key(|t| t.last_used);
        ts.into_iter().map(|t| t.key.clone()).collect()
    }

    /// Never evict the templates of `sandbox_id` (it backs a named template).
    pub fn pin_sandbox(&self, sandbox_id: &str) {
        self.0.lock().pinned.insert(sandbox_id.to_string());
    }

    pub fn unpin_sandbox(&self, sandbox_id: &str) {
        self.0.lock().pinned.remove(sandbox_id);
    }

    /// The template's session if it is alive (marks it used).
    pub fn get(&self, key: &str, sandbox_id: &str) -> Option<Arc<Session>> {
        self.get_with_spare(key, sandbox_id).map(|(s, _)| s)
    }

    /// [`get`](Self::get), with the template's spare slot.
    pub(crate) fn get_with_spare(&self, key: &str, sandbox_id: &str) -> Option<(Arc<Session>, SpareSlot)> {
        let mut lru = self.0.lock();
        let t = lru.map.get_mut(key)?;
        if t.sandbox_id != sandbox_id || !t.session.is_alive() {
            return None;
        }
        t.last_used = Instant::now();
        Some((t.session.clone(), t.spare.clone()))
    }

    /// The template's session and its spare slot, without marking it used (for background
    /// work on it). None for a named template's sandbox: it is forked, never rolled back.
    pub(crate) fn for_spare(&self, key: &str, sandbox_id: &str) -> Option<(Arc<Session>, SpareSlot)> {
        let lru = self.0.lock();
        if lru.pinned.contains(sandbox_id) {
            return None;
        }
        let t = lru.map.get(key).filter(|t| t.sandbox_id == sandbox_id && t.session.is_alive())?;
        Some((t.session.clone(), t.spare.clone()))
    }

    /// The spare slot of a template `get` returned.
    #[cfg(test)]
    fn spare_slot(&self, key: &str) -> Option<SpareSlot> {
        self.0.lock().map.get(key).map(|t| t.spare.clone())
    }

    /// Spares kept now, and the least recently used template holding one (other than
    /// `except`), whose spare goes first when there are too many.
    pub(crate) fn spares(&self, except: &str) -> (usize, Option<SpareSlot>) {
        let lru = self.0.lock();
        let held: Vec<&SessionTemplate> =
            lru.map.values().filter(|t| t.spare.try_lock().map_or(true, |g| g.is_some())).collect();
        let oldest = held.iter().filter(|t| t.key != except).min_by_key(|t| t.last_used).map(|t| t.spare.clone());
        (held.len(), oldest)
    }

    /// The template sessions of a sandbox.
    pub fn sessions_of(&self, sandbox_id: &str) -> Vec<Arc<Session>> {
        self.0.lock().map.values().filter(|t| t.sandbox_id == sandbox_id).map(|t| t.session.clone()).collect()
    }

    pub fn contains(&self, key: &str) -> bool {
        self.0.lock().map.get(key).is_some_and(|t| t.session.is_alive())
    }

    /// Pids (in the sandbox's pid namespace) of a sandbox's templates and their spares (a
    /// spare being made is not known yet).
    /// The template `key` (process `pid` of `sandbox_id`) left the pool and is being dumped:
    /// its pid stays spared by kill sweeps and rollbacks wait for the dump, until the guard
    /// goes. Called before anything awaits after it left the pool: a rollback in between would
    /// kill it.
    pub(crate) fn begin_evicting(rt: &Arc<Runtime>, key: &str, sandbox_id: &str, pid: i32) -> Evicting {
        let (done, rx) = tokio::sync::watch::channel(false);
        rt.session_templates.0.lock().evicting.insert(key.to_string(), (sandbox_id.to_string(), pid, rx));
        Evicting { rt: rt.clone(), key: key.to_string(), done }
    }

    /// Wait until a dump of template `key` in progress is over (at most `max`).
    pub(crate) async fn wait_evicted(&self, key: &str, max: std::time::Duration) {
        let rx = self.0.lock().evicting.get(key).map(|e| e.2.clone());
        if let Some(mut rx) = rx {
            let _ = tokio::time::timeout(max, rx.wait_for(|done| *done)).await;
        }
    }

    pub fn pids_of(&self, sandbox_id: &str) -> HashSet<i32> {
        let lru = self.0.lock();
        let mut pids: HashSet<i32> =
            lru.evicting.values().filter(|(sb, _, _)| sb == sandbox_id).map(|(_, pid, _)| *pid).collect();
        for t in lru.map.values().filter(|t| t.sandbox_id == sandbox_id) {
            pids.insert(t.session.pid);
            if let Some(p) = t.spare.try_lock().ok().and_then(|g| g.as_ref().map(|p| p.pid)) {
                pids.insert(p);
            }
        }
        pids
    }

    pub fn remove(&self, keys: &BTreeSet<String>) -> Vec<SessionTemplate> {
        let mut lru = self.0.lock();
        keys.iter().filter_map(|k| lru.map.remove(k)).collect()
    }

    /// Take every template of a sandbox out of the pool (it is being paused).
    pub fn take_sandbox(&self, sandbox_id: &str) -> Vec<SessionTemplate> {
        let mut lru = self.0.lock();
        let keys: Vec<String> =
            lru.map.values().filter(|t| t.sandbox_id == sandbox_id).map(|t| t.key.clone()).collect();
        keys.iter().filter_map(|k| lru.map.remove(k)).collect()
    }

    /// Forget every template of a sandbox (it is being torn down); returns their keys.
    pub fn remove_sandbox(&self, sandbox_id: &str) -> Vec<String> {
        let mut lru = self.0.lock();
        let keys: Vec<String> =
            lru.map.values().filter(|t| t.sandbox_id == sandbox_id).map(|t| t.key.clone()).collect();
        for k in &keys {
            lru.map.remove(k);
        }
        keys
    }

    pub fn len(&self) -> usize {
        self.0.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Runtime {
    /// Fork a spare copy of each of these templates of `sb` (that has none) in the background,
    /// behind the answer: the next rollback to one of them takes its spare instead of forking
    /// the template on its path (most of a rollback's time for a large session). A spare
    /// is exactly what that fork would make (a template never changes): a session that ran
    /// its at-fork hooks and re-resolves its cwd and files by path before its first request.
    /// It idles in `recvmsg`; dropping it (template dropped, too many spares) closes its
    /// channel and it exits. Not registered with init: after a daemon restart it is gone.
    pub(crate) fn make_spares(self: &Arc<Self>, sb: &Arc<Sandbox>, keys: Vec<String>) {
        if keys.is_empty() {
            return;
        }
        let (rt, sb) = (self.clone(), sb.clone());
        tokio::spawn(async move {
            // Made while the sandbox's checkpoints and rollbacks pause: the spare's fork (the
            // template's page tables) would otherwise slow the session's fork of the next
            // checkpoint.
            for key in keys {
                if rt.process_images.lazy_serving_in(&sb.id) {
                    // A template restored lazily: a spare forked now would get its own copy of
                    // every page not copied in yet, where one forked after shares them.
                    let (rt, id) = (rt.clone(), sb.id.clone());
                    let _ = tokio::task::spawn_blocking(move || rt.process_images.wait_lazy(&id)).await;
                }
                sb.ops_activity.wait_for_quiet(SPARE_QUIET, SPARE_MAX_DEFER).await;
                // Made as an operation of the sandbox: a rollback's sweep must not kill a spare
                // whose pid is not known yet (and report it as a background process).
                let Ok(_ops) = sb.ops.try_lock() else { continue };
                let Some((t, slot)) = rt.session_templates.for_spare(&key, &sb.id) else { continue };
                let mut g = slot.lock().await;
                if g.is_some() || sb.is_dead() || !t.is_alive() {
                    continue;
                }
                let (count, lru) = rt.session_templates.spares(&key);
                if count > MAX_SPARES {
                    // Ours counts (it is being made): make room by the least recently used one.
                    match lru.and_then(|l| l.try_lock().ok().and_then(|mut g| g.take())) {
                        Some(dropped) => drop(dropped),
                        None => continue,
                    }
                }
                let t0 = Instant::now();
                match t.fork_begin("restore").await {
                    Ok(p) => {
                        *g = Some(p);
                        tracing::debug!(sandbox = %sb.id, template = %key, took = ?t0.elapsed(), "spare made");
                    }
                    Err(e) => tracing::debug!(sandbox = %sb.id, template = %key, "no spare copy: {e}"),
                }
            }
        });
    }

    /// Kill templates that left the pool (and their spares) and forget their keys in snapshot
    /// records. Returns once their processes are gone (up to ~0.5 s): a layer deleted while a dying process still
    /// holds the overlay over it is freed by that process's exit, in the sandbox's cgroup
    /// (on a filesystem mounted with `discard`, tens of milliseconds a checkpoint's freeze
    /// would wait for).
    pub(crate) async fn drop_templates(&self, gone: Vec<SessionTemplate>) {
        self.kill_templates(gone, Records::Forget).await
    }

    /// Kill templates whose state is in a process image; their snapshot records keep naming
    /// them (a rollback restores them from the image).
    async fn drop_templates_keeping_images(&self, gone: Vec<SessionTemplate>) {
        self.kill_templates(gone, Records::Keep).await
    }

    /// Kill templates whose state is lost, recording why in their snapshots.
    async fn drop_templates_lost(&self, gone: Vec<SessionTemplate>, reason: &str) {
        self.kill_templates(gone, Records::Lost(reason)).await
    }

    async fn kill_templates(&self, gone: Vec<SessionTemplate>, records: Records<'_>) {
        let mut dying: Vec<(Arc<Sandbox>, i32)> = Vec::new();
        for t in gone {
            t.session.forget().await;
            let spare = t.spare.try_lock().ok().and_then(|mut g| g.take());
            if let Ok(sb) = self.get(&t.sandbox_id) {
                for pid in std::iter::once(t.session.pid).chain(spare.as_ref().map(|p| p.pid)) {
                    if crate::sandbox::sessions::kill_process(&sb, pid).await.is_ok() {
                        dying.push((sb.clone(), pid));
                    }
                }
            }
            let recorded = match records {
                Records::Forget => self.snapshots.records().drop_template(&t.key),
                Records::Lost(why) => self.snapshots.records().forget_template(&t.key, Some(why)),
                Records::Keep => Ok(()),
            };
            if let Err(e) = recorded {
                tracing::warn!(template = %t.key, "updating the snapshots of a dropped template: {e}");
            }
            self.hugepages.forget_template(&t.key);
        }
        let deadline = Instant::now() + std::time::Duration::from_millis(500);
        while Instant::now() < deadline {
            // A zombie let go of everything already.
            dying
                .retain(|(sb, pid)| bb_sys::process::proc_dir_holds_resources(&sandbox_proc(sb).join(pid.to_string())));
            if dying.is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }

    /// Templates the pool evicted: each is dumped to a process image (once: a template never
    /// changes, so an image made before serves again) and then gone, in the background at low
    /// priority; its snapshots keep its key and gain the image. Without CRIU, or if the dump
    /// fails, it is killed and its sessions' state is lost, with the reason recorded.
    /// Call it right where they left the pool, before awaiting anything: the dumps are
    /// registered at once (see [`SessionTemplates::begin_evicting`]), the rest happens in the
    /// background.
    pub(crate) fn evict_templates(self: &Arc<Self>, gone: Vec<SessionTemplate>) {
        if gone.is_empty() {
            return;
        }
        let work = self.begin_evictions(gone);
        let rt = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(crate::activity::BEHIND_ANSWER).await;
            rt.finish_evictions(work, false).await
        });
    }

    /// [`evict_templates`](Self::evict_templates), done before returning (a pause).
    pub(crate) async fn evict_templates_now(self: &Arc<Self>, gone: Vec<SessionTemplate>) {
        let work = self.begin_evictions(gone);
        self.finish_evictions(work, true).await
    }

    /// Register the dumps of templates that left the pool (see [`SessionTemplates::begin_evicting`]).
    fn begin_evictions(self: &Arc<Self>, gone: Vec<SessionTemplate>) -> Vec<(SessionTemplate, Option<Evicting>)> {
        let mut work = Vec::new();
        for t in gone {
            let dump = self.process_images.criu().is_some()
                && self.get(&t.sandbox_id).is_ok_and(|sb| !sb.is_dead())
                && self.snapshots.records().template_image(&t.key).ok().flatten().is_none();
            let evicting = dump.then(|| SessionTemplates::begin_evicting(self, &t.key, &t.sandbox_id, t.session.pid));
            work.push((t, evicting));
        }
        work
    }

    /// Dump (in the background, or before returning when `wait`) or drop templates whose
    /// evictions [`begin_evictions`](Self::begin_evictions) registered.
    async fn finish_evictions(self: &Arc<Self>, work: Vec<(SessionTemplate, Option<Evicting>)>, wait: bool) {
        let mut lost = Vec::new();
        let mut gone = Vec::new();
        for (t, evicting) in work {
            match evicting {
                Some(ev) => {
                    if let Some(spare) = t.spare.try_lock().ok().and_then(|mut g| g.take()) {
                        drop(spare);
                    }
                    if let Ok(sb) = self.get(&t.sandbox_id) {
                        let rt = self.clone();
                        if wait {
                            rt.dump_template(sb, t, ev).await;
                        } else {
                            tokio::spawn(async move { rt.dump_template(sb, t, ev).await });
                        }
                    } else {
                        lost.push((t, "its sandbox is gone".to_string()));
                    }
                }
                None => gone.push(t),
            }
        }
        for t in gone {
            let has_image = self.snapshots.records().template_image(&t.key).ok().flatten().is_some();
            if has_image {
                self.drop_templates_keeping_images(vec![t]).await;
            } else {
                let why = match self.process_images.unavailable() {
                    Some(why) => why.to_string(),
                    None => "its sandbox is gone".to_string(),
                };
                lost.push((t, why));
            }
        }
        for (t, why) in lost {
            let reason = format!("its template left memory and no process image was kept ({why})");
            self.drop_templates_lost(vec![t], &reason).await;
        }
    }

    /// Dump an evicted template into a process image (see [`Runtime::evict_templates`]).
    async fn dump_template(self: Arc<Self>, sb: Arc<Sandbox>, t: SessionTemplate, evicting: Evicting) {
        let t0 = Instant::now();
        let res: crate::Result<(String, u64)> = async {
            let channel_fd = t.session.rechannel().await?;
            // Once the sandbox's checkpoints and rollbacks pause (or one of them waits for this
            // dump), so that their root swaps, which wait for a dump, seldom have to.
            let t0 = Instant::now();
            while !evicting.has_waiters()
                && sb.ops_activity.quiet_for(Instant::now()).is_some_and(|q| q < SPARE_QUIET)
                && t0.elapsed() < SPARE_MAX_DEFER
            {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            let _mounts = sb.mounts.lock().await;
            let (rt, sbc, key, pid) = (self.clone(), sb.clone(), t.key.clone(), t.session.pid);
            let (id, m) = tokio::task::spawn_blocking(move || {
                let _nice = bb_sys::process::niced_thread(10);
                let host = crate::sandbox::procs::host_pid_of(&sbc, pid)
                    .ok_or_else(|| crate::RuntimeError::Conflict(format!("template process {pid} is gone")))?;
                let root = bb_criu::Root { host_pid: host, ns_pid: pid };
                let opts = bb_criu::DumpOptions {
                    leave_running: false,
                    kind: crate::process_images::TEMPLATE_KIND.into(),
                    frozen_cgroup: None,
                    ..Default::default()
                };
                rt.process_images.dump(&sbc.criu_ref(), &sbc.id, root, Some((&key, channel_fd)), &opts)
            })
            .await??;
            Ok((id, m.bytes))
        }
        .await;
        match res {
            Ok((image, bytes)) => {
                tracing::debug!(sandbox = %sb.id, template = %t.key, %image, bytes, took = ?t0.elapsed(), "template kept as a process image");
                if let Err(e) = self.snapshots.records().set_template_image(&t.key, &image) {
                    tracing::warn!(template = %t.key, "recording the process image: {e}");
                }
                self.process_images.settled(&image);
                self.hugepages.forget_template(&t.key);
                self.enforce_image_limit(&image);
            }
            Err(e) => {
                if !sb.is_dead() {
                    tracing::warn!(sandbox = %sb.id, template = %t.key, pid = t.session.pid, "dumping an evicted template failed (its sessions restart fresh on rollback): {e}");
                }
                let reason = format!("its template left memory and dumping it failed: {e}");
                self.drop_templates_lost(vec![t], &reason).await;
            }
        }
    }

    /// Delete the least recently used process images beyond the disk bound (never `keep`);
    /// their snapshots' sessions lose their state, with the reason.
    fn enforce_image_limit(&self, keep: &str) {
        let gone = self.process_images.enforce_limit(&HashSet::from([keep.to_string()]));
        for img in gone {
            tracing::info!(image = %img.id, bytes = img.bytes, "process image deleted: --max-image-bytes reached");
            if let Some(key) = &img.template {
                let why = "its process image was deleted to stay within --max-image-bytes";
                if let Err(e) = self.snapshots.records().drop_image(key, &img.id, why) {
                    tracing::warn!(image = %img.id, "forgetting a deleted process image: {e}");
                }
            }
        }
    }

    /// The live template (and its spare slot) that holds session `ss` of snapshot `snap_id`
    /// for sandbox `sb`: the pool's, or one restored from its process image (waiting for a dump
    /// in progress first; `eager` as for [`Self::restore_template`]). Err: why there is none
    /// (the session then starts fresh).
    pub(crate) async fn ensure_template(
        self: &Arc<Self>,
        sb: &Arc<Sandbox>,
        snap: &crate::snapshot::store::SnapshotRow,
        ss: &crate::snapshot::store::SnapSession,
        eager: bool,
    ) -> Result<(Arc<Session>, SpareSlot), String> {
        let Some(key) = ss.template.as_deref() else {
            return Err(ss.lost.clone().unwrap_or_else(|| "the session was not forked at the checkpoint".into()));
        };
        if let Some(t) = self.session_templates.get_with_spare(key, &sb.id) {
            return Ok(t);
        }
        if snap.sandbox_id != sb.id {
            return Err("the snapshot was taken in another sandbox: fork it to keep its sessions".into());
        }
        if sb.is_paused() {
            return Err(format!("sandbox {} it was taken in is paused: resume it to keep its sessions", sb.id));
        }
        self.session_templates.wait_evicted(key, std::time::Duration::from_secs(60)).await;
        // Read again: an eviction finished meanwhile records the image.
        let fresh = self.snapshots.records().get(&snap.id).ok().flatten();
        let ss = fresh.as_ref().and_then(|s| s.sessions.iter().find(|x| x.id == ss.id)).unwrap_or(ss);
        if let Some(t) = self.session_templates.get_with_spare(key, &sb.id) {
            return Ok(t);
        }
        let Some(image) = ss.image.clone() else {
            return Err(ss.lost.clone().unwrap_or_else(|| "its template is gone and no process image was kept".into()));
        };
        match self.restore_template(sb, key, &ss.kind, &image, eager).await {
            Ok(()) => self
                .session_templates
                .get_with_spare(key, &sb.id)
                .ok_or_else(|| "the restored template died at once".into()),
            Err(e) => Err(format!("restoring its process image {image} failed: {e}")),
        }
    }

    /// Restore template `key` from process image `image` into `sb` (`eager`: its memory read in
    /// full first, else lazily), register it with init and put it back in the pool.
    async fn restore_template(
        self: &Arc<Self>,
        sb: &Arc<Sandbox>,
        key: &str,
        kind: &str,
        image: &str,
        eager: bool,
    ) -> crate::Result<()> {
        let t0 = Instant::now();
        let row = self.process_images.get(image)?.ok_or_else(|| crate::RuntimeError::NotFound {
            kind: "process image",
            id: image.to_string(),
            hint: "",
        })?;
        let channel_fd = row
            .channel_fd
            .ok_or_else(|| crate::RuntimeError::Conflict(format!("process image {image} holds no session")))?;
        let (rt, sbc, id) = (self.clone(), sb.clone(), image.to_string());
        let mounts = sb.mounts.lock().await;
        let (ns_pid, chan) =
            tokio::task::spawn_blocking(move || -> crate::Result<(i32, std::os::unix::net::UnixStream)> {
                let (m, _) = rt.process_images.restore(&sbc, &id, eager, &[])?;
                let host = crate::sandbox::procs::host_pid_of(&sbc, m.root_ns_pid)
                    .ok_or_else(|| crate::RuntimeError::Conflict("the restored template exited at once".into()))?;
                let pidfd = bb_sys::process::pidfd_open(host)?;
                let fd = bb_sys::process::pidfd_getfd(&pidfd, channel_fd)?;
                Ok((m.root_ns_pid, std::os::unix::net::UnixStream::from(fd)))
            })
            .await??;
        drop(mounts);
        let t_restore = t0.elapsed();
        let keep = chan.try_clone().map_err(crate::RuntimeError::io("template channel"))?;
        let session = Session::attach(key.to_string(), kind.to_string(), ns_pid, crate::now(), chan)?;
        crate::sandbox::sessions::adopt(sb, ns_pid, format!("{TEMPLATE_TAG}{key}:{kind}"), key.to_string(), &keep)
            .await?;
        let evicted = self.session_templates.insert(key.to_string(), sb.id.clone(), Arc::new(session));
        tracing::debug!(sandbox = %sb.id, template = %key, %image, ?t_restore, took = ?t0.elapsed(), "template restored from its process image");
        self.evict_templates(evicted);
        // Off the rollback's path (killing a large template takes milliseconds), once it is over:
        // it may still fork other templates of the sandbox.
        let (rt, sbc, key) = (self.clone(), sb.clone(), key.to_string());
        tokio::spawn(async move {
            let _ops = sbc.ops.lock().await;
            rt.relieve_memory(&sbc, Some(&key)).await
        });
        Ok(())
    }

    /// Move the session templates of snapshot `snap_id` out of memory into process images now
    /// (an agent that will not come back to a branch soon gives its memory back); a rollback or
    /// fork to it restores them. Returns once the dumps are done.
    pub async fn offload_snapshot(self: &Arc<Self>, snap_id: &str) -> crate::Result<crate::model::OffloadResult> {
        let t0 = Instant::now();
        let snap = self.snapshots.records().get(snap_id)?.ok_or_else(|| crate::RuntimeError::NotFound {
            kind: "snapshot",
            id: snap_id.to_string(),
            hint: ": list snapshots with `branchbox snapshot ls`",
        })?;
        if let Some(why) = self.process_images.unavailable() {
            return Err(crate::RuntimeError::Unavailable(format!(
                "offloading needs CRIU, which this daemon cannot use ({why})"
            )));
        }
        let keys: BTreeSet<String> = snap.sessions.iter().filter_map(|s| s.template.clone()).collect();
        let gone = self.session_templates.remove(&keys);
        let offloaded = gone.len();
        self.evict_templates_now(gone).await;
        for key in &keys {
            // One being dumped in the background already.
            self.session_templates.wait_evicted(key, bb_criu::DEFAULT_TIMEOUT).await;
        }
        let snap = self.snapshots.records().get(snap_id)?.unwrap_or(snap);
        let (mut images, mut image_bytes, mut lost) = (0, 0, Vec::new());
        for ss in &snap.sessions {
            let image = match ss.template.as_deref() {
                Some(key) => self.snapshots.records().template_image(key)?,
                None => None,
            };
            match image.and_then(|i| self.process_images.get(&i).ok().flatten()) {
                Some(row) => {
                    images += 1;
                    image_bytes += row.bytes;
                }
                None => lost.push(format!(
                    "{}: {}",
                    ss.id,
                    ss.lost.clone().unwrap_or_else(|| "no process image holds it".to_string())
                )),
            }
        }
        Ok(crate::model::OffloadResult {
            snapshot: snap_id.to_string(),
            offloaded,
            images,
            image_bytes,
            lost,
            took_ms: t0.elapsed().as_secs_f64() * 1000.0,
        })
    }

    /// Before a checkpoint (which adds templates) of a sandbox whose templates could not all be
    /// let go at the last look ([`Runtime::relieve_memory`]): wait for its templates' dumps under
    /// way, which give their memory back, and look again. Checkpoints then keep pace with the
    /// dumps instead of driving the sandbox into its OOM killer.
    pub(crate) async fn memory_backpressure(self: &Arc<Self>, sb: &Arc<Sandbox>) {
        if !sb.memory_tight.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let t0 = Instant::now();
        for key in self.session_templates.evicting_keys(&sb.id) {
            self.session_templates.wait_evicted(&key, bb_criu::DEFAULT_TIMEOUT).await;
        }
        self.relieve_memory(sb, None).await;
        tracing::debug!(sandbox = %sb.id, waited = ?t0.elapsed(), "checkpoint waited for template dumps: the sandbox's memory is near its limit");
    }

    /// Templates are charged to their sandbox's memory: each one's private pages (a forked
    /// template shares its pages with its source until either writes, which Python's reference
    /// counting soon does; a restored one shares none). Left alone, the pool could drive the
    /// sandbox into its OOM killer, which picks the largest process — maybe the user's. While
    /// the sandbox's anonymous memory, less what templates being dumped will give back, is above
    /// [`TEMPLATE_MEMORY_WATERMARK`] of its limit, its least recently used templates (all but
    /// `keep`) leave the pool: at once when a process image holds them, after a dump otherwise.
    /// Nothing is lost: a rollback to them restores them. The caller holds the sandbox's
    /// operation lock (an operation may be forking any template of it).
    pub(crate) async fn relieve_memory(self: &Arc<Self>, sb: &Arc<Sandbox>, keep: Option<&str>) {
        let limit = ((sb.spec.memory_mb << 20) as f64 * TEMPLATE_MEMORY_WATERMARK) as i64;
        let Ok(anon) = sb.cgroup.anon_memory() else { return };
        let proc = sandbox_proc(sb);
        let private = |pid: i32| -> i64 {
            // statm: size resident shared text lib data dt, in pages.
            let text = std::fs::read_to_string(proc.join(pid.to_string()).join("statm")).unwrap_or_default();
            let f: Vec<i64> = text.split_whitespace().filter_map(|v| v.parse().ok()).collect();
            f.get(1).zip(f.get(2)).map(|(r, sh)| (r - sh).max(0) * 4096).unwrap_or(0)
        };
        let mut excess = anon as i64 - limit;
        if excess <= 0 {
            sb.memory_tight.store(false, std::sync::atomic::Ordering::SeqCst);
            return;
        }
        // Dumps give memory back only once done (they queue on the sandbox's mount table): a
        // few at a time, the rest of the relief comes from templates an image already holds.
        let mut dumps_left = MAX_RELIEF_DUMPS.saturating_sub(self.session_templates.evicting_pids(&sb.id).len());
        let (mut dropped, mut dumped) = (Vec::new(), Vec::new());
        for key in self.session_templates.keys_by_age(&sb.id) {
            if excess <= 0 {
                break;
            }
            if keep == Some(key.as_str()) {
                continue;
            }
            let imaged = self.snapshots.records().template_image(&key).ok().flatten().is_some();
            if !imaged && dumps_left == 0 {
                continue;
            }
            let Some(t) = self.session_templates.remove(&BTreeSet::from([key.clone()])).pop() else { continue };
            excess -= private(t.session.pid);
            if imaged {
                dropped.push(t);
            } else {
                dumps_left -= 1;
                dumped.push(t);
            }
        }
        sb.memory_tight.store(excess > 0, std::sync::atomic::Ordering::SeqCst);
        tracing::debug!(sandbox = %sb.id, anon, dropped = dropped.len(), dumped = dumped.len(), "templates leave the pool: the sandbox's memory is near its limit");
        self.evict_templates(dumped);
        self.drop_templates_keeping_images(dropped).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(pid: i32) -> Arc<Session> {
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        // Session::attach registers with tokio's reactor: a runtime must be current.
        Arc::new(Session::attach(format!("tp-{pid}"), "python".into(), pid, 0.0, ours).unwrap())
    }

    #[tokio::test]
    async fn spares_are_kept_from_rollback_kills_and_the_least_recently_used_goes_first() {
        let pool = SessionTemplates::new(8);
        for (key, pid) in [("a", 10), ("b", 20), ("c", 30)] {
            assert!(pool.insert(key.into(), "sb-1".into(), session(pid)).is_empty());
        }
        assert_eq!(pool.spares("a").0, 0);
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        for (key, pid) in [("a", 11), ("b", 21)] {
            let (_, slot) = pool.for_spare(key, "sb-1").unwrap();
            *slot.try_lock().unwrap() = Some(session::PendingFork::for_test(pid, ours.try_clone().unwrap()));
        }
        assert_eq!(pool.pids_of("sb-1"), HashSet::from([10, 11, 20, 21, 30]));
        assert!(pool.pids_of("sb-2").is_empty());
        // "a" was used last: "b"'s spare is the one to drop for another.
        pool.get("b", "sb-1").unwrap();
        pool.get("a", "sb-1").unwrap();
        let (count, lru) = pool.spares("c");
        assert_eq!(count, 2);
        let lru = lru.unwrap();
        assert_eq!(lru.try_lock().unwrap().as_ref().map(|p| p.pid), Some(21));
        // A spare being made counts, its pid is not known yet.
        let (_, slot) = pool.for_spare("c", "sb-1").unwrap();
        let making = slot.try_lock().unwrap();
        assert_eq!(pool.spares("c").0, 3);
        assert_eq!(pool.pids_of("sb-1"), HashSet::from([10, 11, 20, 21, 30]));
        drop(making);
        // Another sandbox's template is no spare source, nor a named template's (pinned); a
        // taken spare is gone from the set.
        assert!(pool.for_spare("a", "sb-2").is_none());
        pool.pin_sandbox("sb-1");
        assert!(pool.for_spare("a", "sb-1").is_none());
        pool.unpin_sandbox("sb-1");
        let taken = pool.spare_slot("a").unwrap().try_lock().unwrap().take().unwrap();
        assert_eq!(taken.pid, 11);
        assert!(!taken.is_gone());
        assert_eq!(pool.pids_of("sb-1"), HashSet::from([10, 20, 21, 30]));
        drop(theirs);
        assert!(taken.is_gone(), "its other end closed: the copy is gone");
    }
}
