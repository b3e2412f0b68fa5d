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
}

impl SessionTemplates {
    pub fn new(cap: usize) -> Self {
        SessionTemplates(Mutex::new(Lru { cap, map: HashMap::new(), pinned: HashSet::new() }))
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
    pub fn pids_of(&self, sandbox_id: &str) -> HashSet<i32> {
        let lru = self.0.lock();
        let mut pids = HashSet::new();
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
            let _ = self.snapshots.records().drop_template(&t.key);
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
