//! Checkpoint, rollback, fork and evaluate: the sandbox's files and sessions captured together.
//!
//! * **checkpoint**: each session server forks at a quiescent point (between requests); the child
//!   stays idle as the snapshot's *template*. Then, with the sandbox frozen (cgroup freezer), the
//!   writable layer becomes a frozen snapshot layer and the sandbox is moved onto a fresh writable
//!   layer stacked on it ([`crate::snapshot::rootswap`]). Cost: one fork per session plus a mount and a
//!   pivot, independent of how many files the sandbox holds.
//! * **rollback**: every process but init and the templates is killed, the sandbox is moved onto a
//!   fresh writable layer over the snapshot's chain, and each session is forked again from its
//!   template, or takes the template's spare copy forked ahead ([`Runtime::make_spares`]) (or
//!   is started fresh when the template is gone: `sessions_restarted`).
//! * **fork(n)**: n new sandboxes (own namespaces, cgroup, writable layer) on the snapshot's chain.
//! * Templates live in a bounded LRU pool ([`TemplatePool`]); an evicted template only means the
//!   session restarts fresh on rollback.

pub mod rootswap;
pub mod store;

use crate::error::{Result, RuntimeError};
use crate::sandbox::launch::{layer_dir, new_upper};
use crate::model::*;
use crate::sandbox::Sandbox;
use crate::session::{self, Session};
use crate::session::fork as sessionfork;
use store::{Generation, SnapSession, SnapshotRow};
use crate::{blocking_err, now, Runtime};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Process tag of a template: `branchbox-template:<key>:<kind>`.
pub const TEMPLATE_TAG: &str = "branchbox-template:";
/// Snapshot layers beyond which a chain is compacted in the background (default of
/// `RuntimeConfig::max_chain`).
pub const MAX_CHAIN: usize = 24;
/// Lower layers overlayfs stacks at most (`OVL_MAX_STACK`): a deeper chain cannot be mounted.
pub const OVERLAY_MAX_LOWER: usize = 500;
/// Most children one fork request may ask for.
pub const MAX_FORK: u32 = 64;
/// Children of one fork from which its templates are collapsed into huge pages afterwards.
pub const COLLAPSE_MIN_FORK: usize = 8;
/// Anonymous memory in 4 KiB pages from which a live session is collapsed into huge pages.
pub const SESSION_COLLAPSE_MIN: u64 = 16 << 20;
/// Unrecorded writable layers younger than this are left to the next collection.
const LAYER_GC_MIN_AGE: std::time::Duration = std::time::Duration::from_secs(120);
/// Session processes remembered by [`Runtime::maybe_collapse_session`] before the dead are
/// forgotten.
const SESSION_THP_KEEP: usize = 256;
/// A collapse that lasted this long before the session split it back was worth it.
const SESSION_THP_WORTH: std::time::Duration = std::time::Duration::from_secs(30);

/// What [`Runtime::maybe_collapse_session`] remembers of a live session process. A session that
/// rewrites its whole heap between checkpoints (e.g. walks every object: reference counts are
/// writes) splits every huge page back at once: collapsing it again each time costs ~3 ms of
/// CPU per MiB and saves nothing, so each quick split doubles the checkpoints it waits (up to
/// 15).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SessionThp {
    host: i32,
    /// Bytes still in small pages after the last collapse, and when it ended.
    last: Option<(u64, Instant)>,
    /// Collapses split back soon after, in a row.
    strikes: u32,
    /// Checkpoints to let pass before the next try.
    skip: u32,
    busy: bool,
}

impl SessionThp {
    fn new(host: i32) -> SessionThp {
        SessionThp { host, last: None, strikes: 0, skip: 0, busy: false }
    }

    /// At a checkpoint, with `small` bytes of the session in small pages: collapse now?
    fn due(&mut self, small: u64, now: Instant) -> bool {
        if self.busy {
            return false;
        }
        match self.last {
            None if small < SESSION_COLLAPSE_MIN => return false,
            None => {}
            Some((left, _)) if small < 2 * left + SESSION_COLLAPSE_MIN => return false,
            Some((_, at)) => {
                if now.saturating_duration_since(at) >= SESSION_THP_WORTH {
                    self.strikes = 0;
                    self.skip = 0;
                } else if self.skip > 0 {
                    self.skip -= 1;
                    return false;
                } else {
                    self.strikes = (self.strikes + 1).min(4);
                    self.skip = (1 << self.strikes) - 1;
                }
            }
        }
        self.busy = true;
        true
    }

    fn done(&mut self, left: u64, now: Instant) {
        self.busy = false;
        self.last = Some((left, now));
    }
}
/// Deepest chain of nested forks (the kernel allows 32 levels of user and of pid namespaces).
/// Beyond it, children are independent sandboxes whose sessions start fresh.
pub const MAX_NEST_DEPTH: usize = 24;

/// What the frozen window of a checkpoint looks at: the writable layer being frozen, and which
/// processes (pids in the sandbox's namespace) to spare.
struct Scan<'a> {
    old_upper: &'a Path,
    /// Session templates: frozen copies that never write.
    templates: &'a HashSet<i32>,
    /// Live session servers: they move their working directory themselves.
    sessions: &'a HashSet<i32>,
}

/// How long a checkpoint waits for the processes it moves to a new working directory to stop;
/// the rest are moved after the answer (see [`Stragglers`]).
const REBASE_PATIENCE: std::time::Duration = std::time::Duration::from_millis(200);

/// Processes stopped at the thaw to get a working directory in the new root (see
/// `stale_cwds`), with that directory.
type StaleCwds = Vec<(bb_sys::ptrace::PendingStop, PathBuf)>;

/// Move the processes of `pending` as each stops, polling them together (one may wait for
/// another: a `vfork` parent stops only once its child, stopped too, has gone on to `exec`).
/// Returns those that have not stopped by `until`.
fn rebase_cwds(mut pending: StaleCwds, until: Option<Instant>) -> StaleCwds {
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
struct Stragglers(StaleCwds);

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
fn rebase_cwd(pid: i32, taken: bb_sys::SysResult<bb_sys::ptrace::Tracee>, path: &Path) {
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

/// The next root of a sandbox, built before the frozen window.
struct Prepared {
    lid: String,
    upper: PathBuf,
    mnt: std::os::fd::OwnedFd,
    chain: Vec<String>,
    n: u64,
}

pub struct Template {
    pub key: String,
    pub sandbox_id: String,
    pub session: Arc<Session>,
    last_used: Instant,
    /// A copy of the template forked ahead of a rollback to it (see [`Runtime::make_spares`]);
    /// locked while one is being made, so a rollback waits for it rather than fork a second.
    spare: SpareSlot,
}

type SpareSlot = Arc<tokio::sync::Mutex<Option<session::PendingFork>>>;

/// Most spare copies kept (all sandboxes together). A spare shares every page with its
/// template; it costs a process and its page tables (~0.2% of the template's resident memory).
pub const MAX_SPARES: usize = 32;
/// Spares are made once the sandbox's checkpoints and rollbacks paused this long (a tree
/// search's next step usually comes within ~15 ms), or after `SPARE_MAX_DEFER` at most.
const SPARE_QUIET: std::time::Duration = std::time::Duration::from_millis(25);
const SPARE_MAX_DEFER: std::time::Duration = std::time::Duration::from_secs(2);

/// Live template processes by key, least recently used evicted beyond `cap`. Templates of
/// pinned sandboxes (those backing a named template) are never evicted.
pub struct TemplatePool {
    cap: usize,
    map: HashMap<String, Template>,
    pinned: HashSet<String>,
}

impl TemplatePool {
    pub fn new(cap: usize) -> Self {
        TemplatePool { cap, map: HashMap::new(), pinned: HashSet::new() }
    }

    /// Add a template; returns the ones evicted to stay within the cap.
    pub fn insert(&mut self, key: String, sandbox_id: String, session: Arc<Session>) -> Vec<Template> {
        self.map.insert(key.clone(), Template { key, sandbox_id, session, last_used: Instant::now(), spare: SpareSlot::default() });
        let mut evicted = Vec::new();
        while self.map.values().filter(|t| !self.pinned.contains(&t.sandbox_id)).count() > self.cap {
            let Some(oldest) = self
                .map
                .values()
                .filter(|t| !self.pinned.contains(&t.sandbox_id))
                .min_by_key(|t| t.last_used)
                .map(|t| t.key.clone())
            else {
                break;
            };
            evicted.extend(self.map.remove(&oldest));
        }
        evicted
    }

    /// Never evict the templates of `sandbox_id` (it backs a named template).
    pub fn pin_sandbox(&mut self, sandbox_id: &str) {
        self.pinned.insert(sandbox_id.to_string());
    }

    pub fn unpin_sandbox(&mut self, sandbox_id: &str) {
        self.pinned.remove(sandbox_id);
    }

    /// The template's session if it is alive (marks it used).
    pub fn get(&mut self, key: &str, sandbox_id: &str) -> Option<Arc<Session>> {
        let t = self.map.get_mut(key)?;
        if t.sandbox_id != sandbox_id || !t.session.is_alive() {
            return None;
        }
        t.last_used = Instant::now();
        Some(t.session.clone())
    }

    /// The template's session and its spare slot, without marking it used (for background
    /// work on it). None for a named template's sandbox: it is forked, never rolled back.
    pub(crate) fn for_spare(&self, key: &str, sandbox_id: &str) -> Option<(Arc<Session>, SpareSlot)> {
        if self.pinned.contains(sandbox_id) {
            return None;
        }
        let t = self.map.get(key).filter(|t| t.sandbox_id == sandbox_id && t.session.is_alive())?;
        Some((t.session.clone(), t.spare.clone()))
    }

    /// The spare slot of a template `get` returned.
    pub(crate) fn spare_slot(&self, key: &str) -> Option<SpareSlot> {
        self.map.get(key).map(|t| t.spare.clone())
    }

    /// Spares kept now, and the least recently used template holding one (other than
    /// `except`), whose spare goes first when there are too many.
    pub(crate) fn spares(&self, except: &str) -> (usize, Option<SpareSlot>) {
        let held: Vec<&Template> = self.map.values().filter(|t| t.spare.try_lock().map_or(true, |g| g.is_some())).collect();
        let lru = held.iter().filter(|t| t.key != except).min_by_key(|t| t.last_used).map(|t| t.spare.clone());
        (held.len(), lru)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.map.get(key).is_some_and(|t| t.session.is_alive())
    }

    /// The template sessions of a sandbox.
    pub fn sessions_of(&self, sandbox_id: &str) -> Vec<Arc<Session>> {
        self.map.values().filter(|t| t.sandbox_id == sandbox_id).map(|t| t.session.clone()).collect()
    }

    /// Pids (in the sandbox's pid namespace) of a sandbox's templates and their spares (a
    /// spare being made is not known yet).
    pub fn pids_of(&self, sandbox_id: &str) -> HashSet<i32> {
        let mut pids = HashSet::new();
        for t in self.map.values().filter(|t| t.sandbox_id == sandbox_id) {
            pids.insert(t.session.pid);
            if let Some(p) = t.spare.try_lock().ok().and_then(|g| g.as_ref().map(|p| p.pid)) {
                pids.insert(p);
            }
        }
        pids
    }

    pub fn remove(&mut self, keys: &BTreeSet<String>) -> Vec<Template> {
        keys.iter().filter_map(|k| self.map.remove(k)).collect()
    }

    /// Forget every template of a sandbox (it is being torn down); returns their keys.
    pub fn remove_sandbox(&mut self, sandbox_id: &str) -> Vec<String> {
        let keys: Vec<String> = self.map.values().filter(|t| t.sandbox_id == sandbox_id).map(|t| t.key.clone()).collect();
        for k in &keys {
            self.map.remove(k);
        }
        keys
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Pid of host process `host_pid` in its innermost pid namespace.
fn ns_pid(host_pid: i32) -> Option<i32> {
    bb_sys::process::ns_pids(host_pid)?.last().copied()
}

/// The sandbox's own procfs (mounted in its pid namespace), seen from the host.
fn sandbox_proc(sb: &Sandbox) -> PathBuf {
    PathBuf::from(format!("/proc/{}/root/proc", sb.init_pid))
}

/// The processes of `sb`'s own pid namespace but init and `skip` (pids in the sandbox), from
/// the sandbox's own procfs (returned too): `skip`ped ones (templates: dozens) cost nothing,
/// where the cgroup's host pids each needed a `status` read to learn their pid inside.
/// Processes of nested sandboxes (deeper pid namespaces, visible there too: a fork's pre-built
/// shells) are left out. Err: no procfs of its own to read.
fn own_pids(sb: &Sandbox, skip: &HashSet<i32>) -> std::io::Result<(PathBuf, Vec<i32>)> {
    let proc = sandbox_proc(sb);
    let own_ns = std::fs::read_link(format!("/proc/{}/ns/pid", sb.init_pid))?;
    if std::fs::read_link(proc.join("1/ns/pid"))? != own_ns {
        return Err(std::io::Error::other("the sandbox's /proc is not its own"));
    }
    let pids = std::fs::read_dir(&proc)?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|p| *p != 1 && !skip.contains(p))
        // A nested sandbox's, or gone.
        .filter(|p| std::fs::read_link(proc.join(format!("{p}/ns/pid"))).ok().as_ref() == Some(&own_ns))
        .collect();
    Ok((proc, pids))
}

/// Kill every process of `sb`'s own pid namespace but its init and `keep` (see [`own_pids`]).
/// Err: no procfs to read (the caller falls back to the cgroup).
fn kill_in_sandbox_procfs(sb: &Sandbox, keep: &HashSet<i32>, killed: &mut Vec<i32>) -> std::io::Result<()> {
    let (proc, pids) = own_pids(sb, keep)?;
    for pid in pids {
        if bb_sys::process::signal_proc_dir(&proc.join(pid.to_string()), libc::SIGKILL).is_ok() {
            killed.push(pid);
        }
    }
    Ok(())
}

/// Collapse the private anonymous memory of `host_pid` into transparent huge pages, in aligned
/// 2 MiB chunks at low priority. `gate` runs before each chunk and returns a guard held over
/// it, or `None` to stop. Returns the bytes collapsed.
fn collapse_memory<G>(host_pid: i32, gate: impl FnMut() -> Option<G>) -> std::result::Result<usize, String> {
    let _nice = bb_sys::process::niced_thread(15);
    collapse_chunks(host_pid, gate)
}

fn collapse_chunks<G>(host_pid: i32, mut gate: impl FnMut() -> Option<G>) -> std::result::Result<usize, String> {
    const HUGE: u64 = 2 << 20;
    let regions = bb_sys::process::anon_rw_regions(host_pid, HUGE).map_err(|e| e.to_string())?;
    let pidfd = bb_sys::process::pidfd_open(host_pid).map_err(|e| e.to_string())?;
    let mut done = 0usize;
    for (start, len) in regions {
        let mut a = start.next_multiple_of(HUGE);
        while a + HUGE <= start + len {
            let Some(guard) = gate() else { return Ok(done) };
            // Each chunk is retried a few times: EAGAIN is transient (a page briefly held, e.g.
            // by a fork copying this memory map), and one failing chunk (no huge page free)
            // must not stop the others.
            for attempt in 0..4 {
                match bb_sys::process::process_madvise(&pidfd, &[(a, HUGE)], bb_sys::process::MADV_COLLAPSE) {
                    Ok(n) => {
                        done += n;
                        break;
                    }
                    Err(e) if e.errno() == libc::EAGAIN && attempt < 3 => std::thread::sleep(std::time::Duration::from_millis(5)),
                    Err(e) if e.errno() == libc::ESRCH => return Ok(done),
                    Err(_) => break,
                }
            }
            drop(guard);
            a += HUGE;
        }
    }
    Ok(done)
}

/// Id prefix of layers written by compaction (`sl-m<hex>`: never a plain layer's, whose ids are
/// `sl-<hex>`); they are snapshot layers like any other.
const MERGED_PREFIX: &str = "sl-m";

/// Which part of `chain` (image layers, then snapshot layers `sl-*`, bottom first) a compaction
/// merges, when it holds more than `max_chain` snapshot layers: `Some((from, to))` merges
/// `chain[from..to]` into one layer over the base `chain[..from]`. The newest third of
/// `max_chain` layers is kept as it is (the next checkpoints and rollbacks near the top share
/// them). Layers merged before sit at the bottom as tiers: while there are fewer than that third,
/// a compaction merges only the plain layers above them into one more tier, so its cost is what
/// changed since the last one; then it merges every tier and plain layer into one (the whole
/// diff to the image, once per that many compactions). `None`: nothing to do.
pub(crate) fn compaction_plan(chain: &[String], max_chain: usize) -> Option<(usize, usize)> {
    let image = chain.iter().take_while(|l| !l.starts_with("sl-")).count();
    let snap = chain.len() - image;
    if snap <= max_chain {
        return None;
    }
    let keep = (max_chain / 3).max(1);
    let to = chain.len() - keep;
    let tiers = chain[image..].iter().take_while(|l| l.starts_with(MERGED_PREFIX)).count();
    let from = if tiers < keep { image + tiers } else { image };
    (to >= from + 2).then_some((from, to))
}

fn dir_is_empty(p: &Path) -> bool {
    std::fs::read_dir(p).map(|mut d| d.next().is_none()).unwrap_or(false)
}

/// Bytes allocated by a layer dir (what deleting it frees).
fn du(p: &Path) -> u64 {
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

fn snapshot_id() -> String {
    format!("sn-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

fn legacy(id: &str) -> RuntimeError {
    RuntimeError::Conflict(format!(
        "sandbox {id} was created by a daemon without snapshot support: create a new sandbox to checkpoint it"
    ))
}

impl Runtime {
    fn snapshot_info(&self, row: &SnapshotRow, children: Vec<String>) -> SnapshotInfo {
        let pool = self.templates.lock().expect("lock");
        let size = row
            .own_layer
            .as_ref()
            .and_then(|l| self.snaps.lock().expect("lock").layer_size(l).ok().flatten())
            .unwrap_or(0);
        SnapshotInfo {
            id: row.id.clone(),
            sandbox_id: row.sandbox_id.clone(),
            parent: row.parent.clone(),
            children,
            created_at: row.created_at,
            label: row.label.clone(),
            size_bytes: size,
            depth: row.layers.iter().filter(|l| l.starts_with("sl-")).count(),
            lightweight: row.own_layer.is_none(),
            sessions: row
                .sessions
                .iter()
                .map(|s| SnapshotSessionInfo {
                    id: s.id.clone(),
                    kind: s.kind.clone(),
                    default: s.default,
                    template: s.template.as_deref().is_some_and(|k| pool.contains(k)),
                })
                .collect(),
            took_ms: None,
        }
    }

    pub(crate) fn snapshot_row(&self, sid: &str) -> Result<SnapshotRow> {
        self.snaps.lock().expect("lock").get(sid)?.ok_or_else(|| RuntimeError::NotFound {
            kind: "snapshot",
            id: sid.into(),
            hint: ": list snapshots with `branchbox snapshot ls`",
        })
    }

    pub(crate) fn remove_layer_dir(&self, id: &str) {
        if !id.starts_with("sl-") {
            return;
        }
        let dir = crate::sandbox::launch::snaplayers_dir(&self.cfg.state_dir).join(id);
        let trash = self.cfg.state_dir.join("trash").join(format!("{id}-{}", uuid::Uuid::new_v4().simple()));
        if std::fs::rename(&dir, &trash).is_ok() {
            let _ = std::fs::remove_dir_all(&trash);
        } else {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    /// Fork a spare copy of each of these templates of `sb` (that has none) in the background,
    /// behind the answer: the next rollback to one of them takes its spare instead of forking
    /// the template on its path (~2.5 ms for a 50 MiB session here, most of a rollback). A spare
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
            // checkpoint (measured here: 23% of a tree search's checkpoints overlapped one,
            // p50 2.8 -> 3.0 ms, p90 3.7 -> 5.1 ms for that fork).
            for key in keys {
                sb.ops_activity.wait_for_quiet(SPARE_QUIET, SPARE_MAX_DEFER).await;
                // Made as an operation of the sandbox: a rollback's sweep must not kill a spare
                // whose pid is not known yet (and report it as a background process).
                let Ok(_ops) = sb.ops.try_lock() else { continue };
                let Some((t, slot)) = rt.templates.lock().expect("lock").for_spare(&key, &sb.id) else { continue };
                let mut g = slot.lock().await;
                if g.is_some() || sb.is_dead() || !t.is_alive() {
                    continue;
                }
                let (count, lru) = rt.templates.lock().expect("lock").spares(&key);
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
    /// records. Returns once
    /// their processes are gone (up to ~0.5 s): a layer deleted while a dying process still
    /// holds the overlay over it is freed by that process's exit, in the sandbox's cgroup
    /// (on a filesystem mounted with `discard`, tens of milliseconds a checkpoint's freeze
    /// would wait for).
    async fn drop_templates(&self, gone: Vec<Template>) {
        let mut dying: Vec<(Arc<Sandbox>, i32)> = Vec::new();
        for t in gone {
            t.session.forget().await;
            let spare = t.spare.try_lock().ok().and_then(|mut g| g.take());
            if let Ok(sb) = self.get(&t.sandbox_id) {
                for pid in std::iter::once(t.session.pid).chain(spare.as_ref().map(|p| p.pid)) {
                    if session::kill_process(&sb, pid).await.is_ok() {
                        dying.push((sb.clone(), pid));
                    }
                }
            }
            let _ = self.snaps.lock().expect("lock").drop_template(&t.key);
            self.collapsed.lock().expect("lock").remove(&t.key);
        }
        let deadline = Instant::now() + std::time::Duration::from_millis(500);
        while Instant::now() < deadline {
            // A zombie let go of everything already.
            dying.retain(|(sb, pid)| bb_sys::process::proc_dir_holds_resources(&sandbox_proc(sb).join(pid.to_string())));
            if dying.is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }

    pub async fn checkpoint(self: &Arc<Self>, id: &str, req: CheckpointRequest) -> Result<SnapshotInfo> {
        let t0 = Instant::now();
        if req.label.as_ref().is_some_and(|l| l.len() > 256) {
            return Err(RuntimeError::BadRequest("label is longer than 256 bytes: shorten it".into()));
        }
        let sb = self.live(id)?;
        let _op = sb.begin_op().await;
        let t_locked = t0.elapsed();
        let (row, _) = self.checkpoint_locked(&sb, req.label, true).await?;
        let t_done = t0.elapsed();
        // A new snapshot has no children yet: no need to read the others.
        let mut info = self.snapshot_info(&row, Vec::new());
        info.took_ms = Some(ms(t0));
        tracing::debug!(sandbox = %sb.id, ?t_locked, ?t_done, took = ?t0.elapsed(), "checkpoint request");
        Ok(info)
    }

    /// Take a snapshot of `sb` (caller holds `sb.ops`). `with_sessions = false` captures files
    /// only (evaluate). Returns the snapshot and whether it is new (false: an existing one was
    /// reused because nothing changed).
    async fn checkpoint_locked(self: &Arc<Self>, sb: &Arc<Sandbox>, label: Option<String>, with_sessions: bool) -> Result<(SnapshotRow, bool)> {
        let gen = sb.gen.lock().expect("lock").clone().ok_or_else(|| legacy(&sb.id))?;
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
        let upper_dir = layer_dir(&self.cfg, &self.images, &gen.upper);

        // Nothing changed since the last checkpoint or rollback: share that snapshot.
        if !sb.dirty.load(Ordering::SeqCst) && dir_is_empty(&upper_dir) {
            if let Some(base) = gen.base.as_deref().and_then(|b| self.snaps.lock().expect("lock").get(b).ok().flatten()) {
                let same: Vec<&str> = base.sessions.iter().map(|s| s.id.as_str()).collect();
                let now_ids: Vec<&str> = sessions.iter().map(|s| s.id.as_str()).collect();
                if !with_sessions {
                    return Ok((base, false));
                }
                // Templates are forked in the sandbox that holds them: a fork child's sessions
                // (copies of its parent's templates) need templates of their own.
                if same == now_ids && base.sandbox_id == sb.id {
                    let row = SnapshotRow {
                        id: snapshot_id(),
                        sandbox_id: sb.id.clone(),
                        parent: Some(base.id.clone()),
                        created_at: now(),
                        label,
                        layers: base.layers.clone(),
                        own_layer: None,
                        spec: sb.spec.clone(),
                        sessions: base.sessions.clone(),
                    };
                    self.record_snapshot(sb, &row, Generation { base: Some(row.id.clone()), ..gen })?;
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
                    Err(e) => tracing::warn!(sandbox = %sb.id, session = %s.id, "session did not fork; it will restart fresh on rollback: {e}"),
                }
                snap_sessions.push(SnapSession { id: s.id.clone(), kind: s.kind.clone(), default, template: None });
            }
        }
        let t_forked = t0.elapsed();
        tracing::debug!(sandbox = %sb.id, ?t_sessions_idle, ?t_forked, "checkpoint sessions forked");
        // Templates (never write) and live sessions (they re-resolve their own working
        // directory) are spared by the frozen scan; the new templates are not registered yet.
        let spare = {
            let mut templates = self.templates.lock().expect("lock").pids_of(&sb.id);
            templates.extend(pending.iter().map(|(_, p)| p.pid));
            (templates, sessions.iter().map(|s| s.pid).collect::<HashSet<i32>>())
        };
        // Files: freeze, pin open files, swap the root onto the fresh writable layer.
        // File operations wait until the new root is recorded (they open `sb.rootfs()`).
        let gate = sb.fs_gate.write().await;
        let swapped = match prep.await.map_err(blocking_err).and_then(|p| p) {
            Ok(prep) => {
                let (rt, sbc, old) = (self.clone(), sb.clone(), upper_dir.clone());
                let (tx, rx) = tokio::sync::oneshot::channel();
                tokio::task::spawn_blocking(move || {
                    let scan = Scan { old_upper: &old, templates: &spare.0, sessions: &spare.1 };
                    match rt.swap_prepared(&sbc, prep, Some(&scan), None) {
                        Ok((gen, pinned, stragglers)) => {
                            let _ = tx.send(Ok((gen, pinned)));
                            drop(stragglers); // on this thread, their tracer
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                        }
                    }
                });
                rx.await.map_err(|_| RuntimeError::Internal("root swap worker ended without an answer".into())).and_then(|r| r)
            }
            Err(e) => Err(e),
        };
        let (new_gen, pinned) = match swapped {
            Ok(x) => x,
            Err(e) => {
                for (_, p) in pending {
                    let _ = session::kill_process(sb, p.pid).await;
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
                let keep = chan.try_clone().map_err(|e| RuntimeError::internal("socket", e))?;
                let key = format!("tp-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
                Ok::<_, RuntimeError>((key.clone(), Session::attach(key, snap_sessions[i].kind.clone(), pid, now(), chan)?, keep))
            })();
            match ready {
                Ok((key, t, keep)) => {
                    snap_sessions[i].template = Some(key.clone());
                    new_templates.push((key, Arc::new(t), keep));
                }
                Err(e) => {
                    tracing::warn!(sandbox = %sb.id, session = %snap_sessions[i].id, "template did not start; the session will restart fresh on rollback: {e}");
                    let _ = session::kill_process(sb, pid).await;
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
            spec: sb.spec.clone(),
            sessions: snap_sessions,
        };
        let base = with_sessions.then(|| row.id.clone());
        self.record_snapshot(sb, &row, Generation { base, ..new_gen })?;
        let t_db = t0.elapsed();
        drop(gate);
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
        {
            let mut pool = self.templates.lock().expect("lock");
            for (key, t, keep) in new_templates {
                spares.push(key.clone());
                // Registered with init off the critical path.
                session::adopt_behind_answer(sb.clone(), t.pid, format!("{TEMPLATE_TAG}{key}:{}", t.kind), key.clone(), keep, "template");
                evicted.extend(pool.insert(key, sb.id.clone(), t));
            }
        }
        if !evicted.is_empty() {
            // Out of the pool already (nothing forks them any more): their processes and records
            // go after the answer.
            let rt = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(crate::BEHIND_ANSWER).await;
                rt.drop_templates(evicted).await
            });
        }
        self.after_swap(sb, gen.n, Some(gen.upper.clone()), None);
        self.make_spares(sb, spares);
        tracing::debug!(sandbox = %sb.id, ?t_forked, ?t_swapped, ?t_db, total = ?t0.elapsed(), "checkpoint");
        Ok((row, true))
    }

    /// Record a new snapshot of `sb` and the generation it goes on with, together.
    fn record_snapshot(&self, sb: &Sandbox, row: &SnapshotRow, g: Generation) -> Result<()> {
        self.snaps.lock().expect("lock").insert_with_generation(row, &sb.id, &g)?;
        *sb.gen.lock().expect("lock") = Some(g);
        Ok(())
    }

    fn set_gen(&self, sb: &Sandbox, g: Generation) -> Result<()> {
        self.snaps.lock().expect("lock").set_generation(&sb.id, &g)?;
        *sb.gen.lock().expect("lock") = Some(g);
        Ok(())
    }

    /// Background clean-up after a root swap: the old work dir goes (writes through stale
    /// references to the old root then fail instead of reaching a frozen layer), the frozen
    /// layer's size is measured, a discarded writable layer is deleted, deep chains compacted.
    fn after_swap(self: &Arc<Self>, sb: &Arc<Sandbox>, old_n: u64, measure: Option<String>, discard: Option<String>) {
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
                let _ = rt.snaps.lock().expect("lock").set_layer_size(&l, size);
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

    /// Compaction: when the sandbox's chain holds more than `max_chain` snapshot layers, merge
    /// the oldest of them into one layer that holds only their changes to the image
    /// ([`bb_layers::flatten_onto`]), off the request path at low priority. Then every snapshot
    /// whose chain starts with the merged ones, and every live sandbox's next root, uses the new
    /// layer instead: the same files, fewer layers. Mounted roots keep the old layers until their
    /// next swap (`Generation::mounted`); snapshots whose whole chain was merged keep theirs.
    /// The old layers are deleted by the layer collection once nothing uses them.
    pub(crate) async fn maybe_compact(self: &Arc<Self>, sb: &Arc<Sandbox>) {
        let Some(chain) = sb.gen.lock().expect("lock").as_ref().map(|g| g.chain.clone()) else { return };
        let Some((from, n)) = compaction_plan(&chain, self.cfg.max_chain) else { return };
        let lid = format!("{MERGED_PREFIX}{}", uuid::Uuid::new_v4().simple());
        {
            let mut c = self.compacting.lock().expect("lock");
            if c.contains_key(&sb.id) {
                return; // one at a time per sandbox; the next swap looks again
            }
            c.insert(sb.id.clone(), lid.clone());
        }
        struct Done<'a>(&'a Runtime, &'a str);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.compacting.lock().expect("lock").remove(self.1);
            }
        }
        let _done = Done(self, &sb.id);
        let old: Vec<String> = chain[..n].to_vec();
        let t0 = Instant::now();
        let merged = {
            let (rt, old, lid) = (self.clone(), old.clone(), lid.clone());
            tokio::task::spawn_blocking(move || {
                let _nice = bb_sys::process::niced_thread(10);
                let dir = |l: &String| layer_dir(&rt.cfg, &rt.images, l);
                let top: Vec<PathBuf> = old[from..].iter().rev().map(dir).collect();
                let base: Vec<PathBuf> = old[..from].iter().rev().map(dir).collect();
                let dest = dir(&lid);
                let stats = bb_layers::flatten_onto(&top, &base, &dest).map_err(crate::layers_error)?;
                let t_flat = t0.elapsed();
                let size = du(&dest);
                rt.snaps.lock().expect("lock").set_layer_size(&lid, size)?;
                Ok::<_, RuntimeError>((stats, size, t_flat))
            })
            .await
            .map_err(blocking_err)
            .and_then(|r| r)
        };
        let (stats, size, t_flat) = match merged {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(sandbox = %sb.id, layers = n - from, "compaction of the snapshot chain failed (the chain stays as it is): {e}");
                self.remove_layer_dir(&lid);
                let _ = self.snaps.lock().expect("lock").forget_layer(&lid);
                return;
            }
        };
        // Behind the sandbox's running operation: a checkpoint or rollback records the chain it
        // read at its start, which would undo the switch below.
        let t_merged = t0.elapsed();
        let op = sb.begin_op().await;
        let t_op = t0.elapsed();
        let mut new_prefix = old[..from].to_vec();
        new_prefix.push(lid.clone());
        let replaced = self.snaps.lock().expect("lock").replace_prefix(&old, &new_prefix);
        let rows = match replaced {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(sandbox = %sb.id, "compaction not recorded (the chain stays as it is): {e}");
                drop(op);
                self.remove_layer_dir(&lid);
                let _ = self.snaps.lock().expect("lock").forget_layer(&lid);
                return;
            }
        };
        // Live sandboxes on the same chain (this one, its forks) mount the new one next time.
        let mut gens = 0;
        let live: Vec<Arc<Sandbox>> = self.sandboxes.read().expect("lock").values().cloned().collect();
        for other in live {
            let mut g = other.gen.lock().expect("lock");
            let Some(gen) = g.as_mut().filter(|g| g.chain.len() >= old.len() && g.chain.starts_with(&old)) else { continue };
            let mut chain = new_prefix.clone();
            chain.extend_from_slice(&gen.chain[old.len()..]);
            gen.chain = chain;
            if let Err(e) = self.snaps.lock().expect("lock").set_generation(&other.id, gen) {
                tracing::warn!(sandbox = %other.id, "compacted chain not recorded: {e}");
            }
            gens += 1;
        }
        drop(op);
        if rows == 0 && gens == 0 {
            // Nothing stands on the merged layers any more (deleted or rolled away meanwhile).
            self.remove_layer_dir(&lid);
            let _ = self.snaps.lock().expect("lock").forget_layer(&lid);
            return;
        }
        let depth = chain.iter().filter(|l| l.starts_with("sl-")).count();
        tracing::info!(
            sandbox = %sb.id,
            merged = n - from,
            depth,
            new_depth = depth + 1 - (n - from),
            layer = %lid,
            size,
            files = stats.files,
            whiteouts = stats.whiteouts,
            from_base = stats.from_base,
            snapshots = rows,
            sandboxes = gens,
            flatten_ms = t_flat.as_millis() as u64,
            merged_ms = t_merged.as_millis() as u64,
            op_wait_ms = (t_op - t_merged).as_millis() as u64,
            ms = t0.elapsed().as_millis() as u64,
            "compacted the snapshot chain"
        );
    }

    /// Build the next root ahead of the frozen window: a fresh writable layer and a detached
    /// overlay of it over `chain` (bottom first).
    fn prepare(&self, sb: &Sandbox, n: u64, chain: Vec<String>) -> Result<Prepared> {
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
        let r = bb_layers::overlay_fd(&bb_layers::OverlaySpec { lower: &lower, upper: &upper, work: &work }, &sb.dirs.rootfs_gen(n));
        tracing::debug!(?t_upper, layers = lower.len(), took = ?t0.elapsed(), "prepared");
        match r {
            Ok(mnt) => Ok(Prepared { lid, upper, mnt, chain, n }),
            Err(e) => {
                self.remove_layer_dir(&lid);
                Err(crate::layers_error(e))
            }
        }
    }

    /// With the sandbox frozen: kill every process but init and `kill`'s keep-set (namespace
    /// pids; the killed ones are appended), or move files open for writing out of `pin_from`
    /// (the writable layer being frozen); then swap the root onto `prep`, and thaw.
    fn swap_prepared(
        &self,
        sb: &Sandbox,
        prep: Prepared,
        pin_from: Option<&Scan<'_>>,
        kill: Option<(&HashSet<i32>, &mut Vec<i32>)>,
    ) -> Result<(Generation, rootswap::PinStats, Stragglers)> {
        let t0 = Instant::now();
        sb.cgroup.freeze()?;
        let t_frozen = t0.elapsed();
        let mut stale = Vec::new();
        let res = self.swap_frozen(sb, prep, pin_from, kill, &mut stale);
        let thawed = sb.cgroup.thaw();
        let t_thawed = t0.elapsed();
        // Processes that kept a working directory in the old root stop at the thaw: move them.
        let stragglers = Stragglers(rebase_cwds(stale, Some(Instant::now() + REBASE_PATIENCE)));
        // The host-side mount (file API) is swapped after the thaw; the caller holds the file gate.
        let (gen, pinned, host_clone) = res?;
        let target = sb.dirs.rootfs_gen(gen.n);
        std::fs::create_dir_all(&target).map_err(|e| RuntimeError::internal("create root mount point", e))?;
        rootswap::attach_host_root(&target, host_clone)?;
        tracing::debug!(sandbox = %sb.id, ?t_frozen, ?t_thawed, total = ?t0.elapsed(), "root swapped");
        thawed?;
        Ok((gen, pinned, stragglers))
    }

    fn swap_frozen(
        &self,
        sb: &Sandbox,
        prep: Prepared,
        pin_from: Option<&Scan<'_>>,
        kill: Option<(&HashSet<i32>, &mut Vec<i32>)>,
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
                    // SAFETY: kill(2) on a member of the sandbox's cgroup (frozen: it dies on thaw).
                    if unsafe { libc::kill(*hp, libc::SIGKILL) } == 0 {
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
            let dev = std::fs::metadata(&rootfs).map_err(|e| RuntimeError::internal("stat sandbox root", e))?.dev();
            // Through the sandbox's own procfs: its pids are what the spare sets hold, and
            // templates (frozen copies, they never write) need no look.
            let (proc, nspids) = own_pids(sb, scan.templates).unwrap_or_else(|e| {
                // Sandbox code cannot unmount or cover its /proc (seccomp denies mounts).
                tracing::warn!(sandbox = %sb.id, "no procfs of its own to look for files open for writing: {e}");
                (sandbox_proc(sb), Vec::new())
            });
            let files = rootswap::written_files(&proc, &nspids, dev);
            let others: Vec<i32> = nspids.iter().copied().filter(|p| !scan.sessions.contains(p)).collect();
            let cwds = rootswap::stale_cwds(&proc, &others, dev);
            if !cwds.is_empty() {
                let host: HashMap<i32, i32> = sb.cgroup.pids()?.into_iter().filter_map(|h| Some((ns_pid(h)?, h))).collect();
                for (ns, path) in cwds {
                    match host.get(&ns).map(|h| bb_sys::ptrace::PendingStop::request(*h)) {
                        Some(Ok(p)) => stale.push((p, path)),
                        Some(Err(e)) => tracing::warn!(sandbox = %sb.id, pid = ns, "cannot move its working directory to the new root: {e}"),
                        None => {}
                    }
                }
            }
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
        let Prepared { lid, upper, mnt, chain, n } = prep;
        match rootswap::swap_root(sb.init_pid, mnt) {
            Ok(host_clone) => Ok((Generation { upper: lid, mounted: chain.clone(), chain, base: None, n }, pinned, host_clone)),
            Err(e) => {
                if let Some(old_upper) = pin_from_upper {
                    rootswap::unpin(&pinned_files, old_upper, &upper);
                }
                self.remove_layer_dir(&lid);
                Err(e)
            }
        }
    }

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
        let _op = sb.begin_op().await;
        let gen = sb.gen.lock().expect("lock").clone().ok_or_else(|| legacy(&sb.id))?;
        let mut sessions_map = sb.sessions.lock().await;
        let mut default = sb.default_session.lock().await;
        let old: Vec<Arc<Session>> = sessions_map.values().cloned().collect();
        let mut guards = Vec::new();
        for s in &old {
            guards.push(s.op_lock.lock().await);
        }
        let old_pids: HashSet<i32> = old.iter().map(|s| s.pid).collect();
        let prep = {
            let (rt, sbc, n, chain) = (self.clone(), sb.clone(), gen.n + 1, snap.layers.clone());
            tokio::task::spawn_blocking(move || rt.prepare(&sbc, n, chain))
        };
        // Fork the templates first: the copies re-resolve their cwd and files by path on their
        // first request, after the swap below moved them (with everything else) to the new root.
        // A spare copy made ahead is taken (waiting for one being made), else one is forked.
        let mut restored: Vec<Option<session::PendingFork>> = Vec::new();
        for ss in &snap.sessions {
            let tpl = ss.template.as_deref().and_then(|k| {
                let mut pool = self.templates.lock().expect("lock");
                pool.get(k, &sb.id).zip(pool.spare_slot(k))
            });
            let forked = match tpl {
                Some((t, slot)) => {
                    let spare = slot.lock().await.take();
                    match spare {
                        Some(p) if !p.is_gone() => Ok(p),
                        _ => t.fork_begin("restore").await,
                    }
                }
                None => Err(RuntimeError::Conflict("no live template".into())),
            };
            restored.push(match forked {
                Ok(x) => Some(x),
                Err(e) => {
                    tracing::debug!(sandbox = %sb.id, session = %ss.id, "session starts fresh: {e}");
                    None
                }
            });
        }
        let t_forked = t0.elapsed();
        let mut keep = self.templates.lock().expect("lock").pids_of(&sb.id);
        keep.extend(restored.iter().flatten().map(|p| p.pid));
        let gate = sb.fs_gate.write().await;
        let t_gate = t0.elapsed();
        let prep = prep.await;
        tracing::debug!(?t_gate, t_prep = ?t0.elapsed(), "rollback prep");
        let swapped = match prep.map_err(blocking_err).and_then(|p| p) {
            Ok(prep) => {
                let (rt, sbc) = (self.clone(), sb.clone());
                tokio::task::spawn_blocking(move || {
                    let mut killed = Vec::new();
                    rt.swap_prepared(&sbc, prep, None, Some((&keep, &mut killed))).map(|(g, _, _)| (g, killed))
                })
                .await
                .map_err(blocking_err)
                .and_then(|r| r)
            }
            Err(e) => Err(e),
        };
        let (new_gen, killed) = match swapped {
            Ok(x) => x,
            Err(e) => {
                for p in restored.into_iter().flatten() {
                    let _ = session::kill_process(&sb, p.pid).await;
                }
                return Err(e);
            }
        };
        let t_swapped = t0.elapsed();
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
                let keep = chan.try_clone().map_err(|e| RuntimeError::internal("socket", e))?;
                Ok::<_, RuntimeError>((Session::attach(ss.id.clone(), ss.kind.clone(), pid, now(), chan)?, keep))
            })();
            ready.push(match r {
                Ok(x) => Some(x),
                Err(e) => {
                    tracing::warn!(sandbox = %sb.id, session = %ss.id, "restored session did not start; it starts fresh: {e}");
                    let _ = session::kill_process(&sb, pid).await;
                    None
                }
            });
        }
        self.set_gen(&sb, Generation { base: Some(snap.id.clone()), ..new_gen })?;
        drop(gate);
        for s in &old {
            s.forget().await;
        }
        drop(guards);
        sessions_map.clear();
        *default = None;
        let mut restarted = false;
        for (ss, r) in snap.sessions.iter().zip(ready) {
            let s = match r {
                Some((s, keep)) => {
                    let tag = session::session_tag(&ss.id, &ss.kind, ss.default);
                    session::adopt_behind_answer(sb.clone(), s.pid, tag, ss.id.clone(), keep, "restored session");
                    s
                }
                None => {
                    restarted = true;
                    session::create_as(&sb, Some(ss.id.clone()), &ss.kind, ss.default, None, &Default::default()).await?
                }
            };
            if ss.default {
                *default = Some(ss.id.clone());
            }
            sessions_map.insert(ss.id.clone(), Arc::new(s));
        }
        drop(sessions_map);
        drop(default);
        // Sessions started fresh are not the snapshot's: the next checkpoint must not reuse it.
        sb.dirty.store(restarted, Ordering::SeqCst);
        self.after_swap(&sb, gen.n, None, Some(gen.upper.clone()));
        self.make_spares(&sb, snap.sessions.iter().filter_map(|ss| ss.template.clone()).collect());
        let mut killed: Vec<i32> = killed.into_iter().filter(|p| !old_pids.contains(p)).collect();
        killed.sort_unstable();
        tracing::debug!(sandbox = %sb.id, ?t_forked, ?t_swapped, total = ?t0.elapsed(), "rollback");
        Ok(RollbackResult { snapshot: snap.id, sessions_restarted: restarted, killed, took_ms: ms(t0) })
    }

    pub async fn fork(self: &Arc<Self>, id: &str, req: ForkRequest) -> Result<ForkResult> {
        let t0 = Instant::now();
        let _busy = self.activity.busy();
        let n = req.count.unwrap_or(1);
        if !(1..=MAX_FORK).contains(&n) {
            return Err(RuntimeError::BadRequest(format!("count must be in [1, {MAX_FORK}]; got {n}")));
        }
        let timeout = match req.timeout {
            None => Some(300.0),
            Some(t) if t >= 0.0 && t.is_finite() => (t > 0.0).then_some(t),
            Some(_) => return Err(RuntimeError::BadRequest("timeout must be >= 0 seconds (0 = no limit)".into())),
        };
        self.check_capacity(n as usize)?;
        let snap = match req.snapshot {
            Some(sid) => {
                let snap = self.snapshot_row(&sid)?;
                self.get(id)?; // the sandbox must exist even when forking a named snapshot
                snap
            }
            None => {
                let sb = self.live(id)?;
                let _op = sb.begin_op().await;
                self.checkpoint_locked(&sb, Some("fork".into()), true).await?.0
            }
        };
        let (children, sessions_restarted) = if req.isolated {
            (self.fork_cold(&snap, &snap.spec, n, timeout).await?, !snap.sessions.is_empty())
        } else {
            self.fork_snapshot(&snap, &snap.spec, n, timeout).await?
        };
        Ok(ForkResult {
            snapshot: snap.id,
            sandboxes: children.iter().map(|c| c.info()).collect(),
            sessions_restarted,
            took_ms: ms(t0),
        })
    }

    /// Start `n` sandboxes on `snap`'s layers with its sessions, all or none. Returns them and
    /// whether their sessions were started fresh (`sessions_restarted`).
    ///
    /// When every session of the snapshot has a live template, the children are nested in the
    /// templates' sandbox and get live copies of the sessions ([`Runtime::fork_nested`]);
    /// otherwise (or if that fails) they are independent sandboxes with fresh sessions.
    /// `spec`: what the children are created with (usually the snapshot's).
    pub(crate) async fn fork_snapshot(
        self: &Arc<Self>,
        snap: &SnapshotRow,
        spec: &SandboxSpec,
        n: u32,
        timeout: Option<f64>,
    ) -> Result<(Vec<Arc<Sandbox>>, bool)> {
        if let Some((parent, templates)) = self.live_templates(snap) {
            match self.fork_nested(&parent, snap, spec, n, timeout, templates).await {
                Ok(children) => return Ok((children, false)),
                Err(e) => tracing::warn!(snapshot = %snap.id, "live fork failed, forking with fresh sessions: {e}"),
            }
        }
        let children = self.fork_cold(snap, spec, n, timeout).await?;
        Ok((children, !snap.sessions.is_empty()))
    }

    /// The snapshot's sandbox and a live template for each of its sessions, if it has sessions,
    /// all templates are alive, and nesting is possible (architecture, depth).
    fn live_templates(&self, snap: &SnapshotRow) -> Option<(Arc<Sandbox>, Vec<(SnapSession, Arc<Session>)>)> {
        if snap.sessions.is_empty() || !bb_sys::ptrace::SUPPORTED {
            return None;
        }
        let parent = self.get(&snap.sandbox_id).ok().filter(|p| !p.is_dead())?;
        if self.nest_depth(&parent) + 1 > MAX_NEST_DEPTH {
            tracing::info!(sandbox = %parent.id, "fork chain is {MAX_NEST_DEPTH} deep: children start fresh sessions");
            return None;
        }
        let mut pool = self.templates.lock().expect("lock");
        let templates = snap
            .sessions
            .iter()
            .map(|ss| Some((ss.clone(), pool.get(ss.template.as_deref()?, &parent.id)?)))
            .collect::<Option<Vec<_>>>()?;
        Some((parent, templates))
    }

    /// How many sandboxes `sb` is nested in (0 for a sandbox the daemon started itself).
    fn nest_depth(&self, sb: &Sandbox) -> usize {
        let mut depth = 0;
        let mut cur = sb.nest_parent.clone();
        while let Some(id) = cur {
            depth += 1;
            cur = match self.get(&id) {
                Ok(p) => p.nest_parent.clone(),
                Err(_) => self.husks.lock().expect("lock").get(&id).and_then(|h| h.nest_parent.clone()),
            };
        }
        depth
    }

    /// Fork with live sessions: `n` sandboxes nested in `parent` (pre-built shells claimed, the
    /// rest started by the parent's init), each template forked into them from outside
    /// ([`crate::session::fork`]), each copy registered with its child's init and finished as a
    /// live session. Pipelined: a child's copies start as soon as the child exists, and each
    /// copy is attached as soon as it runs.
    async fn fork_nested(
        self: &Arc<Self>,
        parent: &Arc<Sandbox>,
        snap: &SnapshotRow,
        spec: &SandboxSpec,
        n: u32,
        timeout: Option<f64>,
        templates: Vec<(SnapSession, Arc<Session>)>,
    ) -> Result<Vec<Arc<Sandbox>>> {
        use futures::stream::{FuturesUnordered, StreamExt};
        let t0 = Instant::now();
        let n = n as usize;
        // The session copies are moved into the children's cgroups: get the kernel's migration
        // lock ready while the shells are claimed.
        {
            let (cg, init) = (parent.cgroup.clone(), parent.init_pid);
            tokio::task::spawn_blocking(move || {
                if let Err(e) = cg.warm_migrations(init) {
                    tracing::debug!("cgroup migration warm-up: {e}");
                }
            });
        }
        // Host pids of the templates (they live in the parent's cgroup).
        let hosts: HashMap<i32, i32> = parent
            .cgroup
            .pids()?
            .into_iter()
            .filter_map(|h| Some((*bb_sys::process::ns_pids(h)?.last()?, h)))
            .collect();
        let hosts = templates
            .iter()
            .map(|(ss, t)| hosts.get(&t.pid).copied().ok_or_else(|| RuntimeError::Conflict(format!("template of session {} is gone", ss.id))))
            .collect::<Result<Vec<i32>>>()?;
        // No request may reach a template while it is driven from outside.
        let mut exclusive = Vec::new();
        for (_, t) in &templates {
            exclusive.push(t.exclusive().await);
        }
        // One forking job per template, fed the children as they come.
        let (res_tx, mut res_rx) = tokio::sync::mpsc::unbounded_channel::<(usize, usize, Result<sessionfork::SessionCopy>)>();
        let mut feeds = Vec::new();
        let mut jobs = Vec::new();
        for (ti, host) in hosts.iter().copied().enumerate() {
            let (tx, rx) = std::sync::mpsc::channel::<sessionfork::Target>();
            feeds.push(tx);
            let (res_tx, key) = (res_tx.clone(), self.cfg.setns_key);
            jobs.push(tokio::task::spawn_blocking(move || {
                let out = |ci: usize, r: Result<sessionfork::SessionCopy>| {
                    let _ = res_tx.send((ti, ci, r));
                };
                sessionfork::fork_stream(host, n, rx, key, &out)
            }));
        }
        drop(res_tx);
        // Children: claimed shells first, then fresh ones.
        let shells = self.nest_pool.lock().expect("lock").take(&parent.id, n);
        let claimed = shells.len();
        let mut making: FuturesUnordered<std::pin::Pin<Box<dyn std::future::Future<Output = (usize, Result<Arc<Sandbox>>)> + Send>>> = FuturesUnordered::new();
        for (i, shell) in shells.into_iter().enumerate() {
            let (rt, parent, snap, spec) = (self.clone(), parent.clone(), snap.clone(), spec.clone());
            making.push(Box::pin(async move {
                let r = tokio::task::spawn_blocking(move || rt.claim_shell(shell, &parent, &snap, &spec, timeout)).await.map_err(blocking_err).and_then(|r| r);
                (i, r)
            }));
        }
        for i in claimed..n {
            let fut = self.create_from(spec.clone(), snap.layers.clone(), Some(snap.id.clone()), timeout, Some(parent.clone()));
            making.push(Box::pin(async move { (i, fut.await) }));
        }
        let mut children: Vec<Option<Arc<Sandbox>>> = vec![None; n];
        let mut first_err: Option<RuntimeError> = None;
        let mut attaching = FuturesUnordered::new();
        let mut copies_left = n * templates.len();
        let mut t_shells = None;
        loop {
            tokio::select! {
                Some((i, r)) = making.next(), if !making.is_empty() => {
                    match r {
                        Ok(child) => {
                            if i < claimed {
                                // A claimed shell (create_from watches the ones it starts).
                                self.watch_init(&child);
                            }
                            for feed in &feeds {
                                let _ = feed.send(sessionfork::Target { index: i, init_pid: child.init_pid, cgroup: child.cgroup.clone() });
                            }
                            children[i] = Some(child);
                        }
                        Err(e) => {
                            first_err.get_or_insert(e);
                            copies_left -= templates.len();
                        }
                    }
                    if making.is_empty() {
                        feeds.clear(); // the forking jobs end once their queue is drained
                        t_shells = Some(t0.elapsed());
                    }
                }
                Some((ti, ci, r)) = res_rx.recv(), if copies_left > 0 => {
                    copies_left -= 1;
                    match (r, children[ci].clone()) {
                        (Ok(copy), Some(child)) => {
                            let ss = templates[ti].0.clone();
                            attaching.push(async move { self.attach_copy(&child, &ss, copy).await });
                        }
                        (Err(e), _) => {
                            first_err.get_or_insert(e);
                        }
                        (Ok(copy), None) => {
                            // SAFETY: kill(2) of a copy whose child is gone.
                            unsafe { libc::kill(copy.host_pid, libc::SIGKILL) };
                        }
                    }
                }
                Some(r) = attaching.next(), if !attaching.is_empty() => {
                    if let Err(e) = r {
                        first_err.get_or_insert(e);
                    }
                }
                else => break,
            }
        }
        for j in jobs {
            match j.await.map_err(blocking_err).and_then(|r| r) {
                Ok(()) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        drop(exclusive);
        let children: Vec<Arc<Sandbox>> = children.into_iter().flatten().collect();
        for c in &children {
            c.dirty.store(false, Ordering::SeqCst);
        }
        tracing::debug!(children = n, claimed, ?t_shells, total = ?t0.elapsed(), "live fork");
        if let Some(e) = first_err {
            for c in children {
                let _ = self.kill(&c.id).await;
            }
            return Err(e);
        }
        if children.len() != n {
            for c in children {
                let _ = self.kill(&c.id).await;
            }
            return Err(RuntimeError::Internal("live fork: some children were not made".into()));
        }
        // The next fork from this parent finds its shells ready.
        let want = self.nest_targets.lock().expect("lock").get(&parent.id).copied().unwrap_or(0).max(n);
        self.refill_shells(parent.clone(), want);
        if n >= COLLAPSE_MIN_FORK {
            for ((_, t), host) in templates.iter().zip(&hosts) {
                self.collapse_template(&t.id, *host);
            }
        }
        Ok(children)
    }

    /// Back a template's heap with transparent huge pages, once, in the background (at low
    /// priority): forking it then copies a few hundred page-table entries instead of one per
    /// 4 KiB page (~0.1 ms instead of ~1.2 ms for 50 MiB here). It costs a copy of its memory
    /// (the template no longer shares those pages with the live session) and tens to hundreds of
    /// milliseconds of CPU, so only templates forked into many children get it.
    pub(crate) fn collapse_template(&self, key: &str, host_pid: i32) {
        if self.collapsed.lock().expect("lock").insert(key.to_string(), 0).is_some() {
            return;
        }
        let _ = std::thread::Builder::new().name("bb-thp".into()).spawn(move || {
            let t0 = Instant::now();
            match collapse_memory(host_pid, || Some(())) {
                Ok(bytes) => tracing::debug!(pid = host_pid, mib = bytes >> 20, took = ?t0.elapsed(), "template collapsed into huge pages"),
                Err(e) => tracing::debug!(pid = host_pid, "template not collapsed: {e}"),
            }
        });
    }

    /// After a checkpoint: back a live session's heap with huge pages when much of it is in
    /// 4 KiB pages (at least [`SESSION_COLLAPSE_MIN`]), in the background at low priority and
    /// only while the session is idle (2 MiB at a time under its operation lock, so neither
    /// its code nor a checkpoint waits more than one chunk). Every later checkpoint fork of it
    /// copies page-middle entries instead of page tables (~0.2 ms instead of ~1.1 ms for
    /// 50 MiB here), and its templates and their live-fork copies share those huge pages. Writes
    /// after a fork split huge pages back into small ones in the writer only; a session
    /// collapsed once is collapsed again when its small pages grew to twice what was left and
    /// [`SESSION_COLLAPSE_MIN`] more.
    pub(crate) fn maybe_collapse_session(self: &Arc<Self>, sb: &Arc<Sandbox>, s: &Arc<Session>) {
        let (rt, sb, s) = (self.clone(), sb.clone(), s.clone());
        tokio::task::spawn_blocking(move || {
            std::thread::sleep(crate::BEHIND_ANSWER);
            // Even the look (every process's status, the session's page map) stays behind the
            // requests.
            let _nice = bb_sys::process::niced_thread(15);
            let key = format!("session:{}:{}:{}", sb.id, s.id, s.pid);
            let Some(host) = sb.cgroup.pids().ok().and_then(|p| p.into_iter().find(|h| ns_pid(*h) == Some(s.pid))) else { return };
            let Some(small) = bb_sys::process::small_anon_bytes(host) else { return };
            {
                let mut all = rt.session_thp.lock().expect("lock");
                if all.len() >= SESSION_THP_KEEP {
                    all.retain(|_, st| std::path::Path::new(&format!("/proc/{}", st.host)).exists());
                }
                if !all.entry(key.clone()).or_insert_with(|| SessionThp::new(host)).due(small, Instant::now()) {
                    return;
                }
            }
            let t0 = Instant::now();
            let deadline = t0 + std::time::Duration::from_secs(60);
            let res = collapse_memory(host, || loop {
                if !s.is_alive() || Instant::now() > deadline {
                    return None;
                }
                match s.op_lock.try_lock() {
                    Ok(g) => return Some(g),
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
                }
            });
            let left = bb_sys::process::small_anon_bytes(host).unwrap_or(small);
            if let Some(st) = rt.session_thp.lock().expect("lock").get_mut(&key) {
                st.done(left, Instant::now());
            }
            match res {
                Ok(bytes) => tracing::debug!(sandbox = %sb.id, session = %s.id, mib = bytes >> 20, small_mib_left = left >> 20, took = ?t0.elapsed(), "session collapsed into huge pages"),
                Err(e) => tracing::debug!(sandbox = %sb.id, session = %s.id, "session not collapsed: {e}"),
            }
        });
    }

    /// Make a session copy forked into `child` one of its live sessions: registered with the
    /// child's init (listed, channel stashed) and added under the snapshot session's id; it is
    /// finished in place (`{"op":"restored"}`) before its first request
    /// ([`Session::finish_later`]).
    async fn attach_copy(&self, child: &Arc<Sandbox>, ss: &SnapSession, copy: sessionfork::SessionCopy) -> Result<()> {
        let kill_copy = || {
            // SAFETY: kill(2) of the copy we just made (it is in the child's cgroup).
            unsafe { libc::kill(copy.host_pid, libc::SIGKILL) };
        };
        let Some(ns_pid) = bb_sys::process::ns_pids(copy.host_pid).and_then(|v| v.last().copied()) else {
            return Err(RuntimeError::Internal(format!("copy of session {} exited right away", ss.id)));
        };
        let keep = copy.chan.try_clone().map_err(|e| RuntimeError::internal("socket", e))?;
        if let Err(e) = session::adopt(child, ns_pid, session::session_tag(&ss.id, &ss.kind, ss.default), ss.id.clone(), &keep).await {
            kill_copy();
            return Err(e);
        }
        let runner = copy.runner;
        let s = Session::attach(ss.id.clone(), ss.kind.clone(), ns_pid, now(), copy.chan)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(child.dirs.logs().join(format!("{}.log", ss.id)))
            .map_err(|e| RuntimeError::internal("session log", e))?;
        s.finish_later(log, runner);
        child.sessions.lock().await.insert(ss.id.clone(), Arc::new(s));
        if ss.default {
            *child.default_session.lock().await = Some(ss.id.clone());
        }
        Ok(())
    }

    /// Keep all sandboxes if every launch succeeded; otherwise kill those that did and return
    /// the first error.
    async fn all_or_none(self: &Arc<Self>, results: Vec<Result<Arc<Sandbox>>>) -> Result<Vec<Arc<Sandbox>>> {
        let mut ok = Vec::new();
        let mut first_err = None;
        for r in results {
            match r {
                Ok(c) => ok.push(c),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            for c in ok {
                let _ = self.kill(&c.id).await;
            }
            return Err(e);
        }
        Ok(ok)
    }

    /// Start `n` independent sandboxes on `snap`'s layers with its sessions started fresh.
    async fn fork_cold(self: &Arc<Self>, snap: &SnapshotRow, spec: &SandboxSpec, n: u32, timeout: Option<f64>) -> Result<Vec<Arc<Sandbox>>> {
        let jobs = (0..n).map(|_| {
            let rt = self.clone();
            let (snap, spec) = (snap.clone(), spec.clone());
            async move {
                let child = rt.create_from(spec, snap.layers.clone(), Some(snap.id.clone()), timeout, None).await?;
                let res: Result<()> = async {
                    let mut map = child.sessions.lock().await;
                    for ss in &snap.sessions {
                        let s = session::create_as(&child, Some(ss.id.clone()), &ss.kind, ss.default, None, &Default::default()).await?;
                        if ss.default {
                            *child.default_session.lock().await = Some(ss.id.clone());
                        }
                        map.insert(ss.id.clone(), Arc::new(s));
                    }
                    Ok(())
                }
                .await;
                // Fresh sessions are not the snapshot's: a checkpoint of the child must not reuse it.
                child.dirty.store(!snap.sessions.is_empty(), Ordering::SeqCst);
                match res {
                    Ok(()) => Ok(child),
                    Err(e) => {
                        let _ = rt.kill(&child.id).await;
                        Err(e)
                    }
                }
            }
        });
        self.all_or_none(futures::future::join_all(jobs).await).await
    }

    /// Run a command against the sandbox's current state in a throw-away fork: the sandbox
    /// itself (files, sessions, processes) is left exactly as it was.
    pub async fn evaluate(self: &Arc<Self>, id: &str, req: RunCommand) -> Result<CommandResult> {
        if req.background {
            return Err(RuntimeError::BadRequest("evaluate runs in the foreground: drop \"background\"".into()));
        }
        let sb = self.live(id)?;
        crate::sandbox::exec::resolve(&sb, &req)?;
        self.check_capacity(1)?;
        let (snap, created) = {
            let _op = sb.begin_op().await;
            self.checkpoint_locked(&sb, Some("evaluate".into()), false).await?
        };
        let child = self.create_from(snap.spec.clone(), snap.layers.clone(), None, Some(600.0), None).await;
        if created {
            let _ = self.snaps.lock().expect("lock").delete(&BTreeSet::from([snap.id.clone()]));
        }
        let child = child?;
        let res = crate::sandbox::exec::run(&child, &req, None).await;
        let _ = self.kill(&child.id).await;
        res
    }

    // ---- snapshot tree ----

    pub fn list_snapshots(&self, sandbox: Option<&str>) -> Result<SnapshotList> {
        let Some(id) = sandbox else {
            let all = self.snaps.lock().expect("lock").all()?;
            let mut children = store::children_by_parent(&all);
            let snapshots = all
                .iter()
                .map(|s| {
                    let kids = children.remove(s.id.as_str()).unwrap_or_default();
                    self.snapshot_info(s, kids.into_iter().map(str::to_string).collect())
                })
                .collect();
            return Ok(SnapshotList { snapshots });
        };
        // The sandbox's own snapshots and their ancestors (a fork child's tree starts in its
        // parent), read by index: never every snapshot the daemon holds.
        // The generation is read before the store is locked: compaction and snapshot deletion
        // lock a generation, then the store.
        let live = self.get(id).ok();
        let live_base = live.as_ref().and_then(|sb| sb.gen.lock().expect("lock").as_ref().and_then(|g| g.base.clone()));
        let snaps = self.snaps.lock().expect("lock");
        let own = snaps.of_sandbox(id)?;
        if own.is_empty() && live.is_none() {
            return Err(RuntimeError::sandbox(id));
        }
        let mut rows: HashMap<String, SnapshotRow> = HashMap::new();
        let mut todo: Vec<String> = own.iter().filter_map(|s| s.parent.clone()).collect();
        todo.extend(live_base);
        rows.extend(own.into_iter().map(|s| (s.id.clone(), s)));
        while let Some(sid) = todo.pop() {
            if rows.contains_key(&sid) {
                continue;
            }
            if let Some(row) = snaps.get(&sid)? {
                todo.extend(row.parent.clone());
                rows.insert(sid, row);
            }
        }
        let mut rows: Vec<SnapshotRow> = rows.into_values().collect();
        rows.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        let with_children = rows.into_iter().map(|r| Ok((snaps.children(&r.id)?, r))).collect::<Result<Vec<_>>>()?;
        drop(snaps);
        Ok(SnapshotList { snapshots: with_children.into_iter().map(|(c, r)| self.snapshot_info(&r, c)).collect() })
    }

    pub fn snapshot(&self, sid: &str) -> Result<SnapshotInfo> {
        let row = self.snapshot_row(sid)?;
        let children = self.snaps.lock().expect("lock").children(sid)?;
        Ok(self.snapshot_info(&row, children))
    }

    pub async fn delete_snapshot(self: &Arc<Self>, sid: &str, subtree: bool) -> Result<()> {
        self.snapshot_row(sid)?;
        let all = self.snaps.lock().expect("lock").all()?;
        let ids = if subtree { store::subtree(&all, sid) } else { BTreeSet::from([sid.to_string()]) };
        self.delete_snapshots(&ids, &all).await.map(drop)
    }

    pub async fn gc(self: &Arc<Self>, req: GcRequest) -> Result<GcResult> {
        let all = self.snaps.lock().expect("lock").all()?;
        let keep: BTreeSet<String> = req.keep.iter().cloned().collect();
        for k in &keep {
            if !all.iter().any(|s| &s.id == k) {
                return Err(RuntimeError::NotFound { kind: "snapshot", id: k.clone(), hint: ": keep only existing snapshots" });
            }
        }
        let scope: BTreeSet<String> = match &req.sandbox {
            Some(id) => all.iter().filter(|s| &s.sandbox_id == id).map(|s| s.id.clone()).collect(),
            None => all.iter().map(|s| s.id.clone()).collect(),
        };
        let ids = store::unreachable(&all, &scope, &keep);
        let freed = self.delete_snapshots(&ids, &all).await?;
        Ok(GcResult { deleted: ids.into_iter().collect(), freed_bytes: freed })
    }

    /// Delete snapshot records, the templates only they used, and the layers nothing needs any more.
    async fn delete_snapshots(self: &Arc<Self>, ids: &BTreeSet<String>, all: &[SnapshotRow]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let used_elsewhere: HashSet<&str> = all
            .iter()
            .filter(|s| !ids.contains(&s.id))
            .flat_map(|s| s.sessions.iter().filter_map(|ss| ss.template.as_deref()))
            .collect();
        let dead_templates: BTreeSet<String> = all
            .iter()
            .filter(|s| ids.contains(&s.id))
            .flat_map(|s| s.sessions.iter().filter_map(|ss| ss.template.clone()))
            .filter(|k| !used_elsewhere.contains(k.as_str()))
            .collect();
        self.snaps.lock().expect("lock").delete(ids)?;
        for sb in self.sandboxes.read().expect("lock").values() {
            let mut g = sb.gen.lock().expect("lock");
            if let Some(gen) = g.as_mut().filter(|g| g.base.as_ref().is_some_and(|b| ids.contains(b))) {
                gen.base = None;
                let _ = self.snaps.lock().expect("lock").set_generation(&sb.id, gen);
            }
        }
        let gone = self.templates.lock().expect("lock").remove(&dead_templates);
        self.drop_templates(gone).await;
        let rt = self.clone();
        tokio::task::spawn_blocking(move || rt.gc_layers(LAYER_GC_MIN_AGE)).await.map_err(blocking_err)?
    }

    /// Delete every layer dir under `<state>/snaplayers` that no snapshot and no sandbox uses,
    /// and that changed no later than `min_age` ago: writable layers being set up (a checkpoint's
    /// next layer, a pool or fork shell being built or claimed) are not recorded yet. Returns
    /// the bytes freed.
    pub(crate) fn gc_layers(&self, min_age: std::time::Duration) -> Result<u64> {
        let snaps = self.snaps.lock().expect("lock");
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
        // Writable layers of ready sandboxes in the warm pools (not recorded anywhere), and
        // layers compactions are writing.
        used.extend(self.pooled_uppers());
        used.extend(self.compacting.lock().expect("lock").values().cloned());
        let mut freed = 0;
        let Ok(rd) = std::fs::read_dir(crate::sandbox::launch::snaplayers_dir(&self.cfg.state_dir)) else { return Ok(0) };
        for e in rd.flatten() {
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
            let recorded = self.snaps.lock().expect("lock").layer_size(&name).ok().flatten();
            let changed = e.metadata().ok().and_then(|m| {
                use std::os::unix::fs::MetadataExt;
                std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(m.ctime().max(0) as u64))
            });
            if recorded.is_none() && changed.is_some_and(|t| t.elapsed().map_or(true, |age| age < min_age)) {
                continue;
            }
            let size = recorded.unwrap_or_else(|| du(&e.path()));
            self.remove_layer_dir(&name);
            let _ = self.snaps.lock().expect("lock").forget_layer(&name);
            freed += size;
        }
        Ok(freed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(image: usize, snaps: usize) -> Vec<String> {
        (0..image).map(|i| format!("sha256:{i}")).chain((0..snaps).map(|i| format!("sl-{i}"))).collect()
    }

    #[test]
    fn compaction_merges_new_layers_into_tiers_then_everything_once_there_are_enough() {
        assert_eq!(compaction_plan(&chain(2, 24), 24), None);
        // 25 snapshot layers: the oldest 17 merge over the 2 image layers, the newest 8 stay.
        assert_eq!(compaction_plan(&chain(2, 25), 24), Some((2, 2 + 17)));
        assert_eq!(compaction_plan(&chain(1, 5), 4), Some((1, 1 + 4)));
        // A merged layer (a tier) stays under the next merge while there are fewer than 8.
        let with_tiers = |tiers: usize, plain: usize| {
            let mut c = chain(1, 0);
            c.extend((0..tiers).map(|i| format!("{MERGED_PREFIX}{i}")));
            c.extend(chain(0, plain));
            c
        };
        assert_eq!(compaction_plan(&with_tiers(1, 8), 24), None);
        assert_eq!(compaction_plan(&with_tiers(1, 24), 24), Some((2, 1 + 1 + 16)));
        assert_eq!(compaction_plan(&with_tiers(7, 18), 24), Some((8, 1 + 7 + 10)));
        // 8 tiers: everything but the newest 8 merges into one over the image.
        assert_eq!(compaction_plan(&with_tiers(8, 17), 24), Some((1, 1 + 8 + 9)));
        assert_eq!(compaction_plan(&chain(0, 3), 2), Some((0, 2)));
        assert_eq!(compaction_plan(&chain(3, 0), 2), None);
        // max 2 keeps 1: a tier under one new layer is the whole budget, so tiers merge at once.
        assert_eq!(compaction_plan(&with_tiers(1, 2), 2), Some((1, 3)));
        assert_eq!(compaction_plan(&chain(1, 400), 24), Some((1, 1 + 392)));
    }

    fn session(pid: i32) -> Arc<Session> {
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        // Session::attach registers with tokio's reactor: a runtime must be current.
        Arc::new(Session::attach(format!("tp-{pid}"), "python".into(), pid, 0.0, ours).unwrap())
    }

    #[tokio::test]
    async fn spares_are_kept_from_rollback_kills_and_the_least_recently_used_goes_first() {
        let mut pool = TemplatePool::new(8);
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

    #[test]
    fn sessions_that_split_their_huge_pages_at_once_are_collapsed_less_often() {
        let mib = |n: u64| n << 20;
        let t0 = Instant::now();
        let mut st = SessionThp::new(1);
        assert!(!st.due(mib(8), t0), "too little in small pages");
        assert!(st.due(mib(60), t0));
        assert!(!st.due(mib(60), t0), "in progress");
        st.done(mib(4), t0);
        // Split back at the next checkpoint, every time: collapsed at checkpoints 1, 3, 7, 15.
        let mut collapsed = Vec::new();
        for i in 1..=20 {
            let now = t0 + std::time::Duration::from_millis(100 * i);
            if st.due(mib(60), now) {
                collapsed.push(i);
                st.done(mib(4), now);
            }
        }
        assert_eq!(collapsed, [1, 3, 7, 15]);
        // A collapse that held for a while was worth it: tried again at once, strikes forgotten.
        let later = t0 + SESSION_THP_WORTH + std::time::Duration::from_secs(5);
        assert!(st.due(mib(60), later));
        st.done(mib(4), later);
        assert_eq!((st.strikes, st.skip), (0, 0));
        assert!(!st.due(mib(20), later), "not grown enough since");
    }

    #[test]
    fn ns_pid_of_self() {
        let me = std::process::id() as i32;
        // Outside any pid namespace the innermost pid is the pid itself.
        assert_eq!(ns_pid(me), Some(me));
        assert_eq!(ns_pid(i32::MAX), None);
    }

    #[test]
    fn du_counts_allocated_bytes() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("a")).unwrap();
        std::fs::write(d.path().join("a/f"), vec![1u8; 100_000]).unwrap();
        assert!(du(d.path()) >= 100_000);
        assert!(!dir_is_empty(&d.path().join("a")));
    }
}
