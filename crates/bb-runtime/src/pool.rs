//! The warm pool: sandboxes ready before anyone asks, and safely recycled.
//!
//! A *shell* is a started sandbox nobody owns yet: init running in its namespaces (user, mount,
//! pid, net, uts, ipc, cgroup), its cgroup, the overlay root of its image with an empty writable
//! layer, the host-side mounts and the control socket. [`Runtime::create`] claims one for the
//! requested image when there is one (set the limits, record it: no namespace, mount or process
//! is made on the request's path) and falls back to a cold start otherwise. A background task
//! keeps each configured image at its `min` ready shells, one shell at a time at low CPU
//! priority, taking the images short of their `min` in turn; a failure is recorded
//! (`last_error`), logged, and that image is retried after a growing pause while the others are
//! served: creates never wait for the pool, and one broken image does not starve the others.
//! Removing an image tears its ready shells down (their roots stand on its layers) and forgets
//! its pool; a pool can always be drained (`min = max = 0`), even when its image is gone.
//!
//! A killed sandbox is *recycled* into the pool when its image's pool is below `max`:
//! 1. its cgroup is frozen and every process but init killed;
//! 2. init moves to a brand-new cgroup (counters and limits start from zero), the old one goes;
//! 3. init forgets every process and channel, moves to fresh network, IPC and cgroup namespaces
//!    (no socket, SysV or POSIX IPC object survives; the cgroup namespace is rooted in the new
//!    cgroup), remounts /dev/shm and takes a new hostname (`bb_proto::Request::Reset`);
//! 4. its root is swapped onto the image with a new empty writable layer (the rollback pivot),
//!    the old writable layer, logs and host-side mounts are deleted, and it gets a new id.
//!
//! Only then does the shell enter the pool, so a claim can never see a half-cleaned one.
//!
//! **Network.** A shell built or recycled is wired for egress ahead of its claim
//! ([`crate::net::Net::prewire`]: veth, address, a chain that lets nothing through) while fewer
//! ready shells are wired than the share of the image's recent claims that had egress
//! ([`PoolState::wants_wired`]). A claim takes a shell of its kind first; a claim in mode `none`
//! given a wired shell has it unwired before the sandbox is handed out.
//!
//! **Limits.** A shell being built or recycled holds a [`Slot`] in its image's pool, reserved
//! under the pool lock when the work is decided: slots count like ready shells against `min`
//! (refill) and `max` (recycling), so concurrent kills cannot all pass the check, and a slot
//! whose shell comes back when the pool no longer wants it (its `max` lowered, its image removed,
//! the daemon shutting down) has the shell torn down instead of pooled. Lowering `max` tears
//! the ready shells beyond it down at once.
//!
//! **Layers.** Shells stand on their image's layers but are not in SQLite: while one is built,
//! ready, recycled or claimed it holds a [`LayerPin`], which the image store's in-use check
//! consults, so removing or replacing the image never deletes a layer under it (such layers are
//! collected when the last pin goes).
//!
//! **Lifetime.** Shells are nobody's: a clean shutdown tears them down ([`Runtime::shutdown_pools`],
//! nested fork shells too); after a crash they are strays, reaped at the next start. The pool is
//! rebuilt from its configuration, which is persisted.

use crate::error::{Result, RuntimeError};
use crate::layers::Generation;
use crate::model::{PoolImageStats, PoolStats, SandboxSpec};
use crate::sandbox::launch::{self, layer_dir, new_upper, Launched, SandboxDirs};
use crate::sandbox::rootswap;
use crate::sandbox::Sandbox;
use crate::Runtime;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Limits a shell is started with (a claim sets the request's).
fn shell_spec(image: &bb_layers::Image) -> SandboxSpec {
    SandboxSpec {
        image: image.name.clone(),
        image_env: image.env.clone(),
        layers: image.layers.clone(),
        cpu: 1.0,
        memory_mb: 512,
        pids: 512,
        env: Default::default(),
        cwd: "/".into(),
        network: "none".into(),
        allow: Vec::new(),
        proxy_port: None,
        proxy_record: false,
        net_limits: Default::default(),
        metadata: Default::default(),
        timeout: None,
        lifecycle: Default::default(),
        sudo: false,
    }
}

/// How many ready shells to keep for an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Target {
    /// Kept ready by the background refill.
    pub min: usize,
    /// Killed sandboxes are recycled while fewer are ready.
    pub max: usize,
}

pub struct PoolShell {
    pub id: String,
    /// The image's id when the shell was made: an image rebuilt under the same name since does
    /// not get it.
    pub image_id: String,
    pub launched: Launched,
    /// Keeps the image's layers on disk until the shell is torn down or recorded as a sandbox.
    pub pin: LayerPin,
    /// Wired ahead for a claim with egress ([`crate::net::Net::prewire`]).
    pub wired: bool,
}

/// Image layers that unrecorded sandboxes (pool shells being built, ready, recycled or claimed)
/// stand on. The layer in-use check of the image store ([`crate::Runtime::open`]) asks it besides
/// SQLite. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct LayerPins(Arc<Mutex<PinState>>);

#[derive(Default)]
struct PinState {
    count: HashMap<String, usize>,
    /// Pinned layers whose deletion the image store put off: collect them once unpinned.
    kept: HashSet<String>,
    /// A kept layer lost its last pin since [`LayerPins::take_collect`] was last asked.
    collect: bool,
}

/// Pins on a set of layers, released on drop.
pub struct LayerPin {
    pins: LayerPins,
    layers: Vec<String>,
}

impl LayerPins {
    pub fn pin(&self, layers: &[String]) -> LayerPin {
        let mut st = self.0.lock();
        for l in layers {
            *st.count.entry(l.clone()).or_default() += 1;
        }
        LayerPin { pins: self.clone(), layers: layers.to_vec() }
    }

    /// For the image store's in-use check: whether `layer` is pinned (then the store keeps it,
    /// and it is collected once unpinned).
    pub fn holds(&self, layer: &str) -> bool {
        let mut st = self.0.lock();
        let held = st.count.contains_key(layer);
        if held {
            st.kept.insert(layer.to_string());
        }
        held
    }

    /// Whether a layer the image store kept for a pin has been unpinned since the last call:
    /// then run the store's garbage collection.
    pub fn take_collect(&self) -> bool {
        std::mem::take(&mut self.0.lock().collect)
    }
}

impl Drop for LayerPin {
    fn drop(&mut self) {
        let mut st = self.pins.0.lock();
        for l in &self.layers {
            let Some(n) = st.count.get_mut(l) else { continue };
            *n -= 1;
            if *n == 0 {
                st.count.remove(l);
                if st.kept.remove(l) {
                    st.collect = true;
                }
            }
        }
    }
}

/// An image whose last refill failed: not tried again before `retry_at`.
struct Failing {
    error: String,
    at: Instant,
    retry_at: Instant,
    /// The pause after the next failure (doubles up to [`BACKOFF_MAX`]).
    next_pause: Duration,
}

/// Recycling a killed sandbox into the pool failed (it is torn down instead).
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("recycling: the sandbox's init refused to reset: {0}")]
    ResetRefused(String),
}

/// The pool's bookkeeping, under [`WarmPool`]'s lock.
#[derive(Default)]
pub struct PoolState {
    ready: HashMap<String, VecDeque<PoolShell>>,
    /// Shells being built or recycled, per image (their [`Slot`]s): they count like ready ones.
    in_flight: HashMap<String, usize>,
    /// Set by [`Runtime::shutdown_pools`]: nothing is reserved or pooled any more.
    closed: bool,
    targets: BTreeMap<String, Target>,
    hits: u64,
    misses: u64,
    recycled: u64,
    created: u64,
    failures: u64,
    /// Images whose refill is failing (`last_error` is the newest of their errors).
    failing: HashMap<String, Failing>,
    /// The image refilled last: the next refill starts after it (round-robin).
    last_refilled: Option<String>,
    /// Recent shell build times (ms), newest last.
    build_ms: VecDeque<f64>,
    /// How inits are placed in their cgroups, and recent times (ms).
    placement_mode: Option<&'static str>,
    placement_ms: VecDeque<f64>,
    /// When a shell was last claimed, and since when the refill has been waiting for creates to
    /// pause ([`PoolState::quiet_wait`]).
    last_take: Option<Instant>,
    deferred_since: Option<Instant>,
    /// Per image, whether each of its last [`DEMAND_KEPT`] claims asked for egress: how many of
    /// its shells are wired ahead ([`PoolState::wants_wired`]).
    demand: HashMap<String, VecDeque<bool>>,
}

/// The warm pool mechanism: its bookkeeping under one lock, the wake-up of its refill task, the
/// layer pins of its shells, and its persisted targets.
pub struct WarmPool {
    pub(crate) state: Mutex<PoolState>,
    pub(crate) wake: Arc<tokio::sync::Notify>,
    /// Image layers pool shells stand on (they are not in the database); the image store's
    /// in-use check asks.
    pub(crate) pins: LayerPins,
    pub(crate) targets: PoolTargets,
}

impl WarmPool {
    pub fn open(db: &std::path::Path) -> crate::db::DbResult<WarmPool> {
        Ok(WarmPool {
            state: Default::default(),
            wake: Arc::new(tokio::sync::Notify::new()),
            pins: LayerPins::default(),
            targets: PoolTargets::open(db)?,
        })
    }

    /// The pins the image store's in-use check consults.
    pub fn pins(&self) -> LayerPins {
        self.pins.clone()
    }
}

/// Pool targets in the state database (table `pool_targets`): the pools are rebuilt from them
/// after a restart.
pub struct PoolTargets(Mutex<rusqlite::Connection>);

impl PoolTargets {
    fn open(db: &std::path::Path) -> crate::db::DbResult<PoolTargets> {
        let conn = crate::db::open(db)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS pool_targets (
                image TEXT PRIMARY KEY,
                min INTEGER NOT NULL,
                max INTEGER NOT NULL
            );",
        )?;
        Ok(PoolTargets(Mutex::new(conn)))
    }

    /// Warm pool size for an image (max 0: none).
    pub fn set_pool_target(&self, image: &str, min: usize, max: usize) -> crate::db::DbResult<()> {
        let conn = self.0.lock();
        if max == 0 {
            conn.execute("DELETE FROM pool_targets WHERE image = ?1", rusqlite::params![image])?;
        } else {
            conn.execute(
                "INSERT INTO pool_targets (image, min, max) VALUES (?1, ?2, ?3) ON CONFLICT(image) DO UPDATE SET min = ?2, max = ?3",
                rusqlite::params![image, min as i64, max as i64],
            )?;
        }
        Ok(())
    }

    pub fn pool_targets(&self) -> crate::db::DbResult<Vec<(String, usize, usize)>> {
        let conn = self.0.lock();
        let mut stmt = conn.prepare("SELECT image, min, max FROM pool_targets ORDER BY image")?;
        let rows =
            stmt.query_map([], |r| Ok((r.get(0)?, r.get::<_, i64>(1)? as usize, r.get::<_, i64>(2)? as usize)))?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }
}

const KEEP_TIMES: usize = 64;
/// Claims per image whose network decides how many of its shells are wired ahead.
const DEMAND_KEPT: usize = 16;
/// Most shells a pool may hold, over all images.
pub const MAX_SHELLS: usize = 512;
/// Pause before retrying an image whose refill failed; it doubles with each failure in a row.
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// Longest wait of the refill task between two looks at the pool.
const IDLE_WAIT: Duration = Duration::from_secs(2);
/// A refill waits until no shell was claimed for this long (a burst of creates keeps the CPU),
/// while the image still has ready shells, and never longer than `REFILL_MAX_DEFER` in a row.
const REFILL_QUIET: Duration = Duration::from_millis(30);
const REFILL_MAX_DEFER: Duration = Duration::from_millis(250);

impl PoolState {
    /// Shells ready or on their way, over all images.
    fn total(&self) -> usize {
        self.ready.values().map(VecDeque::len).sum::<usize>() + self.in_flight.values().sum::<usize>()
    }

    /// A ready shell of `image` (made from image id `image_id`), if any: one wired ahead if the
    /// claim asks for `egress`, an unwired one otherwise, the other kind when there is none of
    /// that (wired or unwired on the claim's path). Counts a hit or miss and the claim's kind.
    fn take(&mut self, image: &str, image_id: &str, egress: bool) -> Option<PoolShell> {
        if self.targets.contains_key(image) {
            let d = self.demand.entry(image.to_string()).or_default();
            d.push_back(egress);
            if d.len() > DEMAND_KEPT {
                d.pop_front();
            }
        }
        let q = self.ready.get_mut(image);
        let shell = q.and_then(|q| {
            // Shells of a replaced image are useless; they are torn down by the refill task.
            let fits = |s: &PoolShell| s.image_id == image_id;
            let i = q.iter().position(|s| fits(s) && s.wired == egress).or_else(|| q.iter().position(fits))?;
            q.remove(i)
        });
        if shell.is_some() {
            self.hits += 1;
            self.last_take = Some(Instant::now());
        } else {
            self.misses += 1;
        }
        shell
    }

    /// Whether the next shell of `image` should be wired ahead: fewer of its ready shells are
    /// than the share of its last [`DEMAND_KEPT`] claims that had egress, of its ready shells
    /// with this one; at least one if any of those claims had egress.
    fn wants_wired(&self, image: &str) -> bool {
        let Some(d) = self.demand.get(image) else { return false };
        let egress = d.iter().filter(|&&e| e).count();
        if egress == 0 {
            return false;
        }
        let q = self.ready.get(image);
        let (n, wired) = q.map_or((0, 0), |q| (q.len(), q.iter().filter(|s| s.wired).count()));
        let want = (((n + 1) * egress) as f64 / d.len() as f64).round().max(1.0) as usize;
        wired < want
    }

    /// How long the refill of `image` should still wait for claims to pause: None when the
    /// last claim is `REFILL_QUIET` old, the image has no ready shell left (creates would start
    /// cold) or the refill has been put off for `REFILL_MAX_DEFER` already.
    fn quiet_wait(&mut self, image: &str, now: Instant) -> Option<Duration> {
        let since = now.saturating_duration_since(self.last_take?);
        let ready = self.ready.get(image).map_or(0, VecDeque::len);
        let first = *self.deferred_since.get_or_insert(now);
        if since >= REFILL_QUIET || ready == 0 || now.saturating_duration_since(first) >= REFILL_MAX_DEFER {
            self.deferred_since = None;
            return None;
        }
        Some(REFILL_QUIET - since)
    }

    /// Whether `image` needs another shell: fewer than `min` (refill) or `max` (recycling) ready
    /// or on their way.
    fn wants(&self, image: &str, for_recycling: bool) -> bool {
        let have = self.ready.get(image).map_or(0, VecDeque::len) + self.in_flight.get(image).copied().unwrap_or(0);
        let Some(t) = self.targets.get(image) else { return false };
        !self.closed && self.total() < MAX_SHELLS && if for_recycling { have < t.max } else { have < t.min }
    }

    /// Take a slot for a shell of `image` if it [`wants`](Self::wants) one. The check and the
    /// reservation are one step under the pool lock: racing callers cannot all pass.
    fn reserve(&mut self, image: &str, for_recycling: bool) -> bool {
        let ok = self.wants(image, for_recycling);
        if ok {
            *self.in_flight.entry(image.to_string()).or_default() += 1;
        }
        ok
    }

    fn release(&mut self, image: &str) {
        if let Some(n) = self.in_flight.get_mut(image) {
            *n -= 1;
            if *n == 0 {
                self.in_flight.remove(image);
            }
        }
    }

    /// Pool the shell a slot of `image` was reserved for, if the pool still has room for it (its
    /// `max` may have been lowered, its pool drained or the daemon be shutting down meanwhile);
    /// otherwise it is handed back (Some) to be torn down. The slot itself stays reserved.
    fn admit(&mut self, image: &str, shell: PoolShell) -> Option<PoolShell> {
        let have = self.ready.get(image).map_or(0, VecDeque::len);
        match self.targets.get(image) {
            Some(t) if !self.closed && have < t.max => {
                self.push(image, shell);
                None
            }
            _ => Some(shell),
        }
    }

    /// Set `image`'s target; returns the ready shells beyond its `max` (oldest first), for the
    /// caller to tear down outside the lock.
    fn set_target(&mut self, image: &str, target: Target) -> Vec<PoolShell> {
        self.targets.insert(image.to_string(), target);
        // A new setting is a new chance: retry a failing image now.
        self.failing.remove(image);
        match self.ready.get_mut(image) {
            Some(q) => {
                let n = q.len().saturating_sub(target.max);
                q.drain(..n).collect()
            }
            None => Vec::new(),
        }
    }

    /// Daemon shutdown: refuse every reservation and admission from now on; returns every ready
    /// shell, to tear down.
    fn close(&mut self) -> Vec<PoolShell> {
        self.closed = true;
        self.ready.drain().flat_map(|(_, q)| q).collect()
    }

    fn push(&mut self, image: &str, shell: PoolShell) {
        self.ready.entry(image.to_string()).or_default().push_back(shell);
    }

    /// The image to build a shell for next: among those short of their `min` and not waiting
    /// out a failure, the first after the one refilled last (in name order, wrapping around),
    /// so every image gets its turn whatever the others do.
    fn next_to_refill(&mut self, now: Instant) -> Option<String> {
        let due =
            |name: &String| self.wants(name, false) && !matches!(self.failing.get(name), Some(f) if f.retry_at > now);
        let after = self.last_refilled.as_ref().and_then(|last| {
            self.targets
                .range::<String, _>((std::ops::Bound::Excluded(last), std::ops::Bound::Unbounded))
                .map(|(n, _)| n)
                .find(|n| due(n))
        });
        let pick = after.or_else(|| self.targets.keys().find(|n| due(n))).cloned()?;
        self.last_refilled = Some(pick.clone());
        Some(pick)
    }

    /// How long until an image waiting out a failure may be tried again (None: none waits).
    fn next_retry(&self, now: Instant) -> Option<Duration> {
        self.failing
            .iter()
            .filter(|(name, _)| self.wants(name, false))
            .map(|(_, f)| f.retry_at.saturating_duration_since(now))
            .min()
    }

    /// A refill of `image` failed: count it and pause that image (not the others).
    fn failed(&mut self, image: &str, error: String, now: Instant) {
        if !self.targets.contains_key(image) {
            return; // drained (or its image removed) meanwhile: nothing to retry
        }
        self.failures += 1;
        let pause = self.failing.get(image).map_or(BACKOFF_FIRST, |f| f.next_pause);
        let f = Failing { error, at: now, retry_at: now + pause, next_pause: (pause * 2).min(BACKOFF_MAX) };
        self.failing.insert(image.to_string(), f);
    }

    /// The newest error among the images whose refill is failing.
    fn last_error(&self) -> Option<String> {
        self.failing.values().max_by_key(|f| f.at).map(|f| f.error.clone())
    }

    /// Drop `image`'s pool: its target, its failure record, and its ready shells (returned:
    /// the caller tears them down, outside the lock).
    fn forget(&mut self, image: &str) -> Vec<PoolShell> {
        self.targets.remove(image);
        self.failing.remove(image);
        self.demand.remove(image);
        self.ready.remove(image).map(Vec::from).unwrap_or_default()
    }

    fn stats(&self) -> PoolStats {
        let pct_of = |v: &VecDeque<f64>, p: f64| {
            let mut t: Vec<f64> = v.iter().copied().collect();
            t.sort_by(f64::total_cmp);
            (!t.is_empty()).then(|| t[((t.len() - 1) as f64 * p).round() as usize])
        };
        let pct = |p: f64| pct_of(&self.build_ms, p);
        let mut images: BTreeMap<String, PoolImageStats> = BTreeMap::new();
        for (name, t) in &self.targets {
            images.insert(name.clone(), PoolImageStats { min: t.min, max: t.max, ready: 0, wired: 0 });
        }
        // Shells of an image with no target are only listed while some are still there.
        for (name, q) in self.ready.iter().filter(|(_, q)| !q.is_empty()) {
            let e = images.entry(name.clone()).or_insert(PoolImageStats { min: 0, max: 0, ready: 0, wired: 0 });
            e.ready = q.len();
            e.wired = q.iter().filter(|s| s.wired).count();
        }
        PoolStats {
            images,
            hits: self.hits,
            misses: self.misses,
            recycled: self.recycled,
            created: self.created,
            failures: self.failures,
            last_error: self.last_error(),
            refill_ms_p50: pct(0.5),
            refill_ms_p99: pct(0.99),
            cgroup_placement: self.placement_mode.map(String::from),
            cgroup_placement_ms_p50: pct_of(&self.placement_ms, 0.5),
        }
    }
}

/// A place reserved in an image's pool for a shell being built or recycled
/// ([`Runtime::reserve_slot`]). Dropping it (the work failed) gives the place back.
pub(crate) struct Slot<'a> {
    rt: &'a Runtime,
    image: String,
}

impl Slot<'_> {
    /// Pool `shell`, or tear it down when the pool no longer has room for it. Blocking. Returns
    /// whether it was pooled; the slot is given back either way.
    fn fill(self, shell: PoolShell) -> bool {
        let refused = self.rt.pool.state.lock().admit(&self.image, shell);
        match refused {
            None => true,
            Some(shell) => {
                self.rt.discard_shells(vec![shell]);
                false
            }
        }
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.rt.pool.state.lock().release(&self.image);
    }
}

impl Runtime {
    /// Reserve a slot for one more shell of `image` if its pool wants one (below `min`, or below
    /// `max` when recycling; shells on their way count).
    pub(crate) fn reserve_slot(&self, image: &str, for_recycling: bool) -> Option<Slot<'_>> {
        let reserved = self.pool.state.lock().reserve(image, for_recycling);
        reserved.then(|| Slot { rt: self, image: image.to_string() })
    }

    /// Pin `image`'s layers for a shell, then check it is still the image of that name: a
    /// removal or replacement that came first may be deleting its layers.
    fn pin_image(&self, image: &bb_layers::Image) -> Result<LayerPin> {
        let pin = self.pool.pins.pin(&image.layers);
        match self.images.get(&image.name) {
            Ok(now) if now.id == image.id => Ok(pin),
            Ok(_) | Err(bb_layers::LayersError::NotFound { .. }) => {
                Err(RuntimeError::Conflict(format!("image {:?} was removed or replaced meanwhile", image.name)))
            }
            Err(e) => Err(RuntimeError::from(e)),
        }
    }

    /// Daemon shutdown: tear down every shell that belongs to nobody (not in SQLite, so a restart
    /// would only find strays): the ready shells of the warm pool and the nested fork shells.
    /// Nothing is pooled afterwards; shells still being built or recycled are torn down when they
    /// are done, waited for up to `wait`. User sandboxes are left alone.
    pub async fn shutdown_pools(self: &Arc<Self>, wait: Duration) {
        let ready = self.pool.state.lock().close();
        let nested = self.fork_shells.state.lock().close();
        let n = ready.len() + nested.len();
        let rt = self.clone();
        let torn = tokio::task::spawn_blocking(move || {
            rt.discard_shells(ready);
            rt.discard_nested_shells(nested);
        })
        .await;
        if let Err(e) = torn {
            tracing::warn!("tearing down pooled sandboxes failed: {e}");
        }
        let deadline = Instant::now() + wait;
        loop {
            let busy =
                self.pool.state.lock().in_flight.values().sum::<usize>() + self.fork_shells.state.lock().refills();
            if busy == 0 {
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(busy, "pooled sandboxes still being built at shutdown; the next start reaps them");
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tracing::info!(shells = n, "pooled sandboxes torn down");
    }

    /// Record how a sandbox's init was placed in its cgroup (every top-level launch).
    pub(crate) fn note_placement(&self, placement: (&'static str, f64)) {
        let mut pool = self.pool.state.lock();
        pool.placement_mode = Some(placement.0);
        pool.placement_ms.push_back(placement.1);
        if pool.placement_ms.len() > KEEP_TIMES {
            pool.placement_ms.pop_front();
        }
    }

    /// Writable layers of the shells waiting in both pools (layer GC must keep them).
    pub(crate) fn pooled_uppers(&self) -> Vec<String> {
        let mut v: Vec<String> =
            self.pool.state.lock().ready.values().flatten().map(|s| s.launched.upper.clone()).collect();
        v.extend(self.fork_shells.state.lock().uppers());
        v
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.state.lock().stats()
    }

    /// Keep `target.min` (up to `target.max`) ready shells of `image`; `min = max = 0` drains it
    /// and forgets it (it works for any name, so the pool of a removed image can be cleared).
    /// Persisted: the pool is rebuilt after a restart.
    pub fn set_pool(self: &Arc<Self>, image: &str, target: Target) -> Result<PoolStats> {
        if target.min > target.max {
            return Err(RuntimeError::BadRequest(format!("min ({}) must not exceed max ({})", target.min, target.max)));
        }
        if target.max > MAX_SHELLS {
            return Err(RuntimeError::BadRequest(format!("max must be at most {MAX_SHELLS}")));
        }
        if target.max == 0 {
            self.forget_pool(image)?;
            return Ok(self.pool_stats());
        }
        self.images.get(image).map_err(RuntimeError::from)?;
        self.pool.targets.set_pool_target(image, target.min, target.max)?;
        let extra = self.pool.state.lock().set_target(image, target);
        self.discard_shells(extra);
        self.pool.wake.notify_one();
        Ok(self.pool_stats())
    }

    /// Drain `image`'s pool and forget its target (also persisted). Blocking: its ready shells
    /// are torn down before this returns, so the image's layers can go next.
    pub(crate) fn forget_pool(&self, image: &str) -> Result<()> {
        self.pool.targets.set_pool_target(image, 0, 0)?;
        let shells = self.pool.state.lock().forget(image);
        self.discard_shells(shells);
        Ok(())
    }

    /// Load the persisted targets and start the refill task (call once, in a tokio runtime).
    pub fn start_pool(self: &Arc<Self>, default: Option<(String, Target)>) -> Result<()> {
        let mut targets: BTreeMap<String, Target> = BTreeMap::new();
        let persisted = self.pool.targets.pool_targets()?;
        for (image, min, max) in persisted {
            // Left by a daemon that kept the pools of removed images.
            if matches!(self.images.get(&image), Err(bb_layers::LayersError::NotFound { .. })) {
                tracing::warn!(%image, "forgetting the warm pool of an image that no longer exists");
                self.pool.targets.set_pool_target(&image, 0, 0)?;
                continue;
            }
            targets.insert(image, Target { min, max });
        }
        if let Some((image, t)) = default {
            targets.entry(image).or_insert(t);
        }
        self.pool.state.lock().targets = targets;
        let rt = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(rt) = rt.upgrade() else { return };
                if let Some(wait) = rt.refill_once().await {
                    let wake = rt.pool.wake.clone();
                    drop(rt);
                    let _ = tokio::time::timeout(wait, wake.notified()).await;
                }
            }
        });
        Ok(())
    }

    /// Build one shell for the next image short of its `min` ([`PoolState::next_to_refill`]); a
    /// failure is recorded against that image. None: go on at once; Some(wait): nothing to do
    /// now, look again after `wait` or a wake-up.
    async fn refill_once(self: &Arc<Self>) -> Option<Duration> {
        let (image, stale) = {
            let mut pool = self.pool.state.lock();
            // Drop shells of images that were replaced or removed.
            let mut stale = Vec::new();
            for (name, q) in pool.ready.iter_mut() {
                let current = self.images.get(name).ok().map(|i| i.id);
                let (keep, gone): (VecDeque<PoolShell>, VecDeque<PoolShell>) =
                    q.drain(..).partition(|s| Some(&s.image_id) == current.as_ref());
                *q = keep;
                stale.extend(gone);
            }
            pool.ready.retain(|_, q| !q.is_empty());
            let image = pool.next_to_refill(Instant::now());
            (image, stale)
        };
        self.discard_shells(stale);
        let idle = || {
            let pool = self.pool.state.lock();
            Some(pool.next_retry(Instant::now()).map_or(IDLE_WAIT, |d| d.min(IDLE_WAIT)))
        };
        if self.pool.pins.take_collect() {
            // Layers of a removed or replaced image that pool shells held until now.
            let images = self.images.clone();
            tokio::task::spawn_blocking(move || {
                if let Err(e) = images.gc() {
                    tracing::warn!("deleting the layers of a removed image failed: {e}");
                }
            });
        }
        let Some(image) = image else { return idle() };
        if let Some(wait) = self.pool.state.lock().quiet_wait(&image, Instant::now()) {
            return Some(wait);
        }
        if self.count() + self.pool.state.lock().total() >= self.cfg.max_sandboxes {
            return idle();
        }
        match self.refill_image(&image).await {
            Ok(()) => {
                self.pool.state.lock().failing.remove(&image);
            }
            Err(e) => {
                tracing::warn!(%image, "warm pool could not make a sandbox ({e}); creates of it start cold until it can");
                let msg = format!("refilling the pool of image {image:?}: {e}");
                self.pool.state.lock().failed(&image, msg, Instant::now());
            }
        }
        None
    }

    /// Build one shell of `image` at low CPU priority and pool it (unless its pool stopped
    /// wanting it meanwhile: then it is torn down).
    async fn refill_image(self: &Arc<Self>, image: &str) -> Result<()> {
        let image = image.to_string();
        let rt = self.clone();
        tokio::task::spawn_blocking(move || {
            // Reserved here, not when the image was picked: a recycle may have filled it since.
            let Some(slot) = rt.reserve_slot(&image, false) else { return Ok(()) };
            let t0 = Instant::now();
            // Background work: leave the CPU to requests.
            let shell = {
                let _nice = bb_sys::process::niced_thread(10);
                let shell = rt.build_shell(&image)?;
                rt.wire_if_wanted(&image, shell)
            };
            {
                let mut pool = rt.pool.state.lock();
                pool.created += 1;
                pool.build_ms.push_back(t0.elapsed().as_secs_f64() * 1000.0);
                if pool.build_ms.len() > KEEP_TIMES {
                    pool.build_ms.pop_front();
                }
            }
            slot.fill(shell);
            Ok(())
        })
        .await
        .map_err(RuntimeError::Worker)?
    }

    fn build_shell(&self, image_name: &str) -> Result<PoolShell> {
        let image = self.images.get(image_name).map_err(RuntimeError::from)?;
        let pin = self.pin_image(&image)?;
        let spec = shell_spec(&image);
        let id = crate::sandbox::lifecycle::new_sandbox_id();
        let layers: Vec<PathBuf> = image.layers.iter().map(|l| layer_dir(&self.cfg, &self.images, l)).collect();
        let launched = launch::launch(&self.cfg, &self.cgroups, &id, &spec, &layers)?;
        self.note_placement(launched.placement);
        Ok(PoolShell { id, image_id: image.id, launched, pin, wired: false })
    }

    /// `shell` of `image`, wired ahead if its pool wants one more wired shell
    /// ([`PoolState::wants_wired`]); unwired if wiring it fails (logged).
    fn wire_if_wanted(&self, image: &str, mut shell: PoolShell) -> PoolShell {
        if !self.pool.state.lock().wants_wired(image) {
            return shell;
        }
        match self.net.prewire(&shell.id, shell.launched.init_pid) {
            Ok(_) => {
                self.ensure_resolver(&shell.id, &SandboxDirs::new(&self.cfg.state_dir, &shell.id).rootfs());
                shell.wired = true;
            }
            Err(e) => tracing::warn!(shell = %shell.id, "wiring a pooled sandbox ahead failed ({e}); it stays unwired"),
        }
        shell
    }

    fn discard_shells(&self, shells: Vec<PoolShell>) {
        for s in shells {
            if s.wired {
                self.net.detach(&s.id);
            }
            let _ =
                launch::teardown(&self.cfg, &self.cgroups, &s.id, Some((s.launched.init_pid, s.launched.init_start)));
            self.remove_layer_dir(&s.launched.upper);
        }
    }

    /// A ready shell for `spec`'s image made into the sandbox `spec` asks for, or None (then
    /// the caller starts one cold). Blocking.
    pub(crate) fn claim_pooled(&self, spec: &SandboxSpec, timeout: Option<f64>) -> Option<Result<Arc<Sandbox>>> {
        let image = self.images.get(&spec.image).ok()?;
        let egress = Self::spec_policy(spec).is_ok_and(|p| p.mode != crate::net::policy::Mode::None);
        let shell = self.pool.state.lock().take(&spec.image, &image.id, egress)?;
        let res = (|| -> Result<()> {
            shell.launched.cgroup.set_limits(&launch::limits(spec))?;
            launch::make_cwd(&self.cfg, spec, &SandboxDirs::new(&self.cfg.state_dir, &shell.id).rootfs())
        })();
        if let Err(e) = res {
            self.discard_shells(vec![shell]);
            return Some(Err(e));
        }
        let gen = Generation {
            upper: shell.launched.upper.clone(),
            mounted: spec.layers.clone(),
            chain: spec.layers.clone(),
            base: None,
            n: 0,
        };
        let PoolShell { id, launched, pin, .. } = shell;
        let registered = self.register(id, spec.clone(), launched, gen, None, timeout);
        drop(pin); // recorded now (or torn down): the in-use check sees its row
        Some(registered)
    }

    /// A slot in the pool for a killed sandbox (that was alive) if it should be recycled rather
    /// than torn down: [`recycle`](Self::recycle) fills it.
    pub(crate) fn reserve_recycle(&self, sb: &Sandbox) -> Option<Slot<'_>> {
        let eligible = sb.nest_parent.is_none()
            && bb_sys::process::process_start_time(sb.init_pid) == Some(sb.init_start)
            && sb.gen.lock().is_some();
        if eligible {
            self.reserve_slot(&sb.spec.image, true)
        } else {
            None
        }
    }

    /// Clean a killed sandbox for the next tenant and put it in `slot` (see the module
    /// documentation). Blocking. On failure the slot is given back and the caller tears the
    /// sandbox down.
    pub(crate) fn recycle(&self, sb: &Sandbox, slot: Slot<'_>) -> Result<()> {
        let image = self.images.get(&sb.spec.image).map_err(RuntimeError::from)?;
        let pin = self.pin_image(&image)?;
        let spec = shell_spec(&image);
        // 1. Nothing but init survives.
        crate::sandbox::procs::kill_members(sb, |p| p == sb.init_pid)?;
        // 2. A new cgroup.
        let new_id = crate::sandbox::lifecycle::new_sandbox_id();
        let cgroup = bb_isolation::Cgroup::create(&self.cgroups, &new_id, &launch::limits(&spec))?;
        let moved = cgroup.add_pid(sb.init_pid).and_then(|()| sb.cgroup.destroy());
        if let Err(e) = moved {
            let _ = cgroup.destroy();
            return Err(e.into());
        }
        // 3. Init: fresh net, IPC and cgroup namespaces (rooted in the new cgroup), /dev/shm,
        // hostname; it forgets everything.
        let shm = (spec.memory_mb * 1024 * 1024 / 2).max(1 << 20);
        match crate::initconn::call_blocking(
            &sb.dirs.sock(),
            &bb_proto::Request::Reset { hostname: new_id.clone(), shm_bytes: shm, cgroupns: true },
            &[],
            Duration::from_secs(10),
        )? {
            (bb_proto::Response::Ok, _) => {}
            (bb_proto::Response::Error { message, .. }, _) => return Err(PoolError::ResetRefused(message).into()),
            (other, _) => return Err(crate::initconn::unexpected(other)),
        }
        // 4. A fresh root under the new id's directory.
        let old = SandboxDirs::new(&self.cfg.state_dir, &sb.id);
        let dirs = SandboxDirs::new(&self.cfg.state_dir, &new_id);
        for r in old.rootfs_all() {
            bb_layers::unmount(&r)?;
        }
        std::fs::rename(&old.dir, &dirs.dir).map_err(RuntimeError::io("rename sandbox dir"))?;
        for e in std::fs::read_dir(&dirs.dir).map_err(RuntimeError::io("sandbox dir"))?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("work-") || name.starts_with("rootfs") || name == "logs" {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        std::fs::create_dir_all(dirs.logs()).map_err(RuntimeError::io("logs dir"))?;
        // The next tenant boots a new machine, as far as it can tell.
        launch::new_boot_id(sb.init_pid)?;
        let (lid, upper, work) = new_upper(&self.cfg, &dirs, 0)?;
        let lower: Vec<PathBuf> = image.layers.iter().rev().map(|l| layer_dir(&self.cfg, &self.images, l)).collect();
        let swapped = bb_layers::overlay_fd(
            &bb_layers::OverlaySpec { lower: &lower, upper: &upper, work: &work },
            &dirs.rootfs(),
        )
        .map_err(RuntimeError::from)
        .and_then(|mnt| rootswap::swap_root(sb.init_pid, mnt))
        .and_then(|view| {
            std::fs::create_dir_all(dirs.rootfs()).map_err(RuntimeError::io("create root mount point"))?;
            rootswap::attach_host_root(&dirs.rootfs(), view)
        });
        if let Err(e) = swapped {
            self.remove_layer_dir(&lid);
            let _ = launch::teardown(&self.cfg, &self.cgroups, &new_id, Some((sb.init_pid, sb.init_start)));
            return Err(e);
        }
        let launched = Launched {
            placement: ("recycled", 0.0),
            init_pid: sb.init_pid,
            init_start: sb.init_start,
            cgroup,
            upper: lid,
        };
        let shell = self
            .wire_if_wanted(&sb.spec.image, PoolShell { id: new_id, image_id: image.id, launched, pin, wired: false });
        if slot.fill(shell) {
            self.pool.state.lock().recycled += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_survive_reopen_and_max_zero_forgets() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("b.db");
        let targets = PoolTargets::open(&db).unwrap();
        targets.set_pool_target("base", 2, 8).unwrap();
        targets.set_pool_target("py", 0, 4).unwrap();
        targets.set_pool_target("base", 3, 8).unwrap();
        assert_eq!(
            PoolTargets::open(&db).unwrap().pool_targets().unwrap(),
            vec![("base".into(), 3, 8), ("py".into(), 0, 4)]
        );
        targets.set_pool_target("py", 0, 0).unwrap();
        assert_eq!(targets.pool_targets().unwrap().len(), 1);
    }

    fn shell(root: &std::path::Path, id: &str, image_id: &str) -> PoolShell {
        std::fs::create_dir_all(root.join("t").join(id)).unwrap();
        let layout = bb_isolation::CgroupLayout::with_roots(
            bb_isolation::CgroupVersion::V2,
            vec![("unified".into(), root.into())],
            "t",
        );
        PoolShell {
            id: id.into(),
            image_id: image_id.into(),
            launched: Launched {
                placement: ("test", 0.0),
                init_pid: 1,
                init_start: 1,
                cgroup: bb_isolation::Cgroup::open(&layout, id).unwrap(),
                upper: format!("sl-{id}"),
            },
            pin: LayerPins::default().pin(&[]),
            wired: false,
        }
    }

    #[test]
    fn claims_take_their_kind_first_and_their_share_decides_what_is_wired() {
        let d = tempfile::tempdir().unwrap();
        let mut p = PoolState::default();
        p.targets.insert("base".into(), Target { min: 2, max: 4 });
        assert!(!p.wants_wired("base"), "no claim with egress yet: nothing is wired ahead");
        p.push("base", shell(d.path(), "plain", "img"));
        p.push("base", PoolShell { wired: true, ..shell(d.path(), "wired", "img") });
        assert_eq!(p.stats().images["base"].wired, 1);
        assert_eq!(p.take("base", "img", true).map(|s| s.id), Some("wired".into()), "egress takes the wired one");
        p.push("base", PoolShell { wired: true, ..shell(d.path(), "wired2", "img") });
        assert_eq!(p.take("base", "img", false).map(|s| s.id), Some("plain".into()), "none takes the unwired one");
        assert_eq!(p.take("base", "img", false).map(|s| s.id), Some("wired2".into()), "else the other kind");
        // Claims so far: egress, none, none: a third of the shells, at least one, wired ahead.
        assert!(p.wants_wired("base"));
        p.push("base", PoolShell { wired: true, ..shell(d.path(), "w3", "img") });
        assert!(!p.wants_wired("base"));
        for _ in 0..DEMAND_KEPT {
            p.take("base", "none-of-these", true);
        }
        assert!(p.wants_wired("base"), "every recent claim had egress: every shell");
        for _ in 0..DEMAND_KEPT {
            p.take("base", "none-of-these", false);
        }
        assert!(!p.wants_wired("base"), "the claims with egress aged out");
        assert!(!p.wants_wired("other"), "no target: no demand is kept");
        p.take("other", "x", true);
        assert!(!p.wants_wired("other"));
    }

    #[test]
    fn take_counts_hits_and_misses_and_skips_replaced_images() {
        let d = tempfile::tempdir().unwrap();
        let mut p = PoolState::default();
        p.targets.insert("base".into(), Target { min: 2, max: 4 });
        assert!(p.wants("base", false) && p.wants("base", true));
        assert!(!p.wants("other", true), "no target, no pooling");
        p.push("base", shell(d.path(), "a", "img-old"));
        p.push("base", shell(d.path(), "b", "img-new"));
        assert!(!p.wants("base", false), "min reached");
        assert!(p.wants("base", true), "below max: recycle");
        assert_eq!(p.take("base", "img-new", false).map(|s| s.id), Some("b".into()));
        assert!(p.take("base", "img-new", false).is_none(), "a shell of the old image is not handed out");
        assert!(p.take("nope", "x", false).is_none());
        let s = p.stats();
        assert_eq!((s.hits, s.misses), (1, 2));
        assert_eq!(s.images["base"].ready, 1);
        assert_eq!((s.images["base"].min, s.images["base"].max), (2, 4));
    }

    #[test]
    fn refill_takes_images_in_turn_and_skips_a_failing_one() {
        let mut p = PoolState::default();
        for name in ["aaa-broken", "base", "py"] {
            p.targets.insert(name.into(), Target { min: 3, max: 3 });
        }
        let t0 = Instant::now();
        // Every image short of its min gets its turn, whatever the order of names.
        let order: Vec<String> = (0..4).map(|_| p.next_to_refill(t0).unwrap()).collect();
        assert_eq!(order, ["aaa-broken", "base", "py", "aaa-broken"]);
        // A failing image waits out its pause; the others are served meanwhile.
        p.failed("aaa-broken", "refilling the pool of image \"aaa-broken\": gone".into(), t0);
        assert_eq!(
            (p.failures, p.last_error().as_deref()),
            (1, Some("refilling the pool of image \"aaa-broken\": gone"))
        );
        let order: Vec<String> = (0..4).map(|_| p.next_to_refill(t0).unwrap()).collect();
        assert_eq!(order, ["base", "py", "base", "py"]);
        assert_eq!(p.next_retry(t0), Some(BACKOFF_FIRST));
        // After the pause it is tried again; failing again doubles the pause.
        let later = t0 + BACKOFF_FIRST;
        p.last_refilled = Some("py".into());
        assert_eq!(p.next_to_refill(later).as_deref(), Some("aaa-broken"));
        p.failed("aaa-broken", "still gone".into(), later);
        assert_eq!(p.next_retry(later), Some(BACKOFF_FIRST * 2));
        // Only failing images left short of min: nothing to do until the pause ends.
        p.targets.remove("base");
        p.targets.remove("py");
        assert_eq!(p.next_to_refill(later), None);
        // An image with no target (drained meanwhile) is neither counted nor retried.
        p.failed("py", "x".into(), later);
        assert_eq!(p.failures, 2);
    }

    #[test]
    fn forgetting_an_image_drops_its_shells_target_and_error() {
        let d = tempfile::tempdir().unwrap();
        let mut p = PoolState::default();
        p.targets.insert("gone".into(), Target { min: 1, max: 2 });
        p.targets.insert("base".into(), Target { min: 1, max: 1 });
        p.push("gone", shell(d.path(), "a", "img"));
        p.push("gone", shell(d.path(), "b", "img"));
        p.failed("gone", "image \"gone\" not found".into(), Instant::now());
        let shells = p.forget("gone");
        assert_eq!(shells.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        let s = p.stats();
        assert!(!s.images.contains_key("gone"), "{:?}", s.images);
        assert_eq!(s.last_error, None, "a forgotten pool's error is not the pool's error any more");
        assert!(p.forget("never-set").is_empty(), "forgetting is idempotent");
    }

    #[test]
    fn a_drained_image_is_not_listed() {
        let d = tempfile::tempdir().unwrap();
        let mut p = PoolState::default();
        p.targets.insert("base".into(), Target { min: 0, max: 1 });
        p.push("base", shell(d.path(), "a", "img"));
        assert!(p.take("base", "img", false).is_some());
        p.targets.remove("base");
        assert!(p.stats().images.is_empty(), "no target, nothing ready: not listed ({:?})", p.stats().images);
        // Shells still there (being torn down) keep it listed until they are gone.
        p.push("py", shell(d.path(), "b", "img"));
        assert_eq!(p.stats().images["py"], PoolImageStats { min: 0, max: 0, ready: 1, wired: 0 });
    }

    #[test]
    fn racing_recycles_and_refills_never_exceed_max() {
        let d = tempfile::tempdir().unwrap();
        let mut p = PoolState::default();
        p.targets.insert("base".into(), Target { min: 2, max: 4 });
        // 16 kills decide at once: 4 get a slot, the others are torn down.
        let granted = (0..16).filter(|_| p.reserve("base", true)).count();
        assert_eq!(granted, 4);
        // Shells on their way count for the refill too: min is covered.
        assert!(!p.wants("base", false) && !p.reserve("base", false));
        // A failed recycle gives its slot back: another kill may take it.
        p.release("base");
        assert!(p.reserve("base", true));
        for i in 0..4 {
            assert!(p.admit("base", shell(d.path(), &format!("r{i}"), "img")).is_none());
            p.release("base");
        }
        assert_eq!(p.stats().images["base"].ready, 4);
        assert!(!p.reserve("base", true), "full");
        assert_eq!(p.total(), 4);
    }

    #[test]
    fn lowering_max_tears_down_ready_and_refuses_shells_on_their_way() {
        let d = tempfile::tempdir().unwrap();
        let mut p = PoolState::default();
        p.targets.insert("base".into(), Target { min: 0, max: 4 });
        for i in 0..2 {
            p.push("base", shell(d.path(), &format!("a{i}"), "img"));
        }
        assert!(p.reserve("base", true) && p.reserve("base", true));
        let extra = p.set_target("base", Target { min: 0, max: 1 });
        assert_eq!(extra.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["a0"], "the oldest goes");
        // The two recycles in flight finish: the pool is full, they are handed back.
        for i in 0..2 {
            assert!(p.admit("base", shell(d.path(), &format!("b{i}"), "img")).is_some());
            p.release("base");
        }
        assert_eq!(p.stats().images["base"].ready, 1);
        // A pool drained meanwhile takes nothing either.
        assert!(!p.reserve("py", true), "no target, no slot");
        p.targets.insert("py".into(), Target { min: 1, max: 1 });
        assert!(p.reserve("py", false));
        p.forget("py");
        assert!(p.admit("py", shell(d.path(), "c", "img")).is_some());
    }

    #[test]
    fn a_closed_pool_hands_out_its_shells_and_takes_no_more() {
        let d = tempfile::tempdir().unwrap();
        let mut p = PoolState::default();
        p.targets.insert("base".into(), Target { min: 2, max: 4 });
        p.push("base", shell(d.path(), "a", "img"));
        assert!(p.reserve("base", false));
        let ready = p.close();
        assert_eq!(ready.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["a"]);
        assert!(!p.reserve("base", false) && !p.reserve("base", true), "no new work after shutdown");
        assert!(p.admit("base", shell(d.path(), "b", "img")).is_some(), "work in flight is torn down, not pooled");
        p.release("base");
        assert_eq!((p.total(), p.stats().images["base"].ready), (0, 0));
    }

    #[test]
    fn pinned_layers_are_kept_and_collected_once_unpinned() {
        let pins = LayerPins::default();
        let a = pins.pin(&["l1".into(), "l2".into()]);
        let b = pins.pin(&["l2".into()]);
        assert!(pins.holds("l1") && pins.holds("l2") && !pins.holds("l3"));
        assert!(!pins.take_collect());
        drop(a);
        assert!(!pins.holds("l1"), "unpinned");
        assert!(pins.take_collect(), "l1 was kept for a pin: collect it now");
        assert!(!pins.take_collect(), "once");
        drop(b);
        assert!(pins.take_collect(), "l2 too");
        // A layer nobody asked about needs no collection when unpinned.
        drop(pins.pin(&["l4".into()]));
        assert!(!pins.take_collect());
    }

    #[test]
    fn refills_wait_for_a_burst_of_claims_to_pause() {
        let d = tempfile::tempdir().unwrap();
        let mut p = PoolState::default();
        let t0 = Instant::now();
        assert_eq!(p.quiet_wait("base", t0), None, "nothing claimed yet");
        p.targets.insert("base".into(), Target { min: 3, max: 3 });
        for i in 0..3 {
            p.push("base", shell(d.path(), &format!("s{i}"), "img"));
        }
        assert!(p.take("base", "img", false).is_some());
        let now = Instant::now();
        let w = p.quiet_wait("base", now).expect("a claim just now: wait");
        assert!(w <= REFILL_QUIET);
        assert_eq!(p.quiet_wait("base", now + REFILL_QUIET), None, "claims paused");
        // Claims that keep coming put it off, but not for ever.
        p.last_take = Some(now + REFILL_MAX_DEFER);
        assert!(p.quiet_wait("base", now + REFILL_MAX_DEFER).is_some());
        p.last_take = Some(now + 2 * REFILL_MAX_DEFER);
        assert!(
            p.quiet_wait("base", now + 2 * REFILL_MAX_DEFER - Duration::from_millis(1)).is_some(),
            "a new claim: still waiting"
        );
        assert_eq!(p.quiet_wait("base", now + 2 * REFILL_MAX_DEFER), None, "deferred long enough");
        // No ready shell left: creates would start cold, refill at once.
        assert!(p.take("base", "img", false).is_some() && p.take("base", "img", false).is_some());
        assert_eq!(p.quiet_wait("base", Instant::now()), None);
    }

    #[test]
    fn refill_times_are_summarised() {
        let mut p = PoolState::default();
        assert_eq!(p.stats().refill_ms_p50, None);
        p.build_ms.extend([5.0, 1.0, 3.0]);
        let s = p.stats();
        assert_eq!(s.refill_ms_p50, Some(3.0));
        assert_eq!(s.refill_ms_p99, Some(5.0));
    }
}
