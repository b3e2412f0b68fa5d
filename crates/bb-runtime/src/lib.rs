//! The branchbox sandbox runtime: the one door through which the API acts on sandboxes.
//!
//! A sandbox is: an overlay root (the image's read-only layers + one private writable layer,
//! mounted by the daemon under `<state>/sandboxes/<id>/rootfs`), a cgroup with memory/cpu/pids
//! limits, and `branchbox-init` cloned into fresh user/mount/pid/uts/ipc/net/cgroup namespaces.
//! Init builds the sandbox's view (/proc, /dev, /sys, pivot_root) and then spawns processes on
//! request over a unix socket (`bb_proto`); command output flows through pipes straight to the
//! daemon. Files are accessed from the host side with `openat2(RESOLVE_IN_ROOT)` on the merged
//! root ([`files`]). Sandbox records live in SQLite ([`store`]) so a restarted daemon re-attaches
//! to every live sandbox and reaps the rest ([`Runtime::recover`]).
//!
//! Modules: [`launch`] (start/teardown), [`exec`] (commands), [`session`] (stateful sessions),
//! [`files`], [`store`], [`model`] (API types), [`initconn`] (init protocol client).

pub mod error;
pub mod fork_shells;
pub mod initconn;
pub mod model;
pub mod pool;
pub mod recipes;
pub mod sandbox;
pub mod session;
pub mod snapshot;

pub use error::{Result, RuntimeError};

use bb_isolation::{Cgroup, CgroupLayout};
use bb_layers::{IdMap, ImageStore};
use sandbox::launch::{self, SandboxDirs};
use sandbox::{exec, files, store};
use snapshot::store as snapstore;
use model::*;
use sandbox::Sandbox;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::sync::mpsc;

pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    pub state_dir: PathBuf,
    /// Path of the `branchbox-init` binary.
    pub init_bin: PathBuf,
    pub idmap: IdMap,
    /// cgroup under which every sandbox gets its own group.
    pub cgroup_parent: String,
    pub max_sandboxes: usize,
    /// Upper bounds a create request may ask for.
    pub max_memory_mb: u64,
    pub max_cpu: f64,
    pub max_pids: u64,
    /// Largest file upload, bytes.
    pub max_file_bytes: u64,
    /// Live session templates kept for snapshots (LRU beyond this).
    pub max_templates: usize,
    /// Snapshot layers stacked under a sandbox's writable layer before the oldest are merged
    /// (see [`snapshot::MAX_CHAIN`]).
    pub max_chain: usize,
    /// Lets the daemon's injected `setns` through the sandboxes' seccomp filters (see
    /// `bb_isolation::SetnsKey`). Loaded from `<state>/setns.key` by [`Runtime::open`].
    pub setns_key: [u64; 2],
}

impl RuntimeConfig {
    pub fn new(state_dir: PathBuf, init_bin: PathBuf) -> Self {
        RuntimeConfig {
            state_dir,
            init_bin,
            idmap: IdMap::default(),
            cgroup_parent: "branchbox".into(),
            max_sandboxes: 1000,
            max_memory_mb: 64 * 1024,
            max_cpu: 64.0,
            max_pids: 65536,
            max_file_bytes: 4 << 30,
            max_templates: 64,
            max_chain: snapshot::MAX_CHAIN,
            setns_key: [0, 0],
        }
    }
}

pub struct Runtime {
    pub cfg: RuntimeConfig,
    pub cgroups: CgroupLayout,
    images: Arc<ImageStore>,
    store: Mutex<store::Store>,
    pub(crate) snaps: Mutex<snapstore::SnapStore>,
    pub(crate) templates: Mutex<snapshot::TemplatePool>,
    sandboxes: RwLock<HashMap<String, Arc<Sandbox>>>,
    /// Inits of killed sandboxes that nested sandboxes still need (see `store::HuskRow`).
    husks: Mutex<HashMap<String, store::HuskRow>>,
    /// Pre-built nested shells for live forks, by parent.
    pub(crate) nest_pool: Mutex<fork_shells::NestPool>,
    /// Ready sandboxes per image ([`pool`]), and the wake-up of its refill task.
    pub(crate) pool: Mutex<pool::WarmPool>,
    pub(crate) pool_wake: Arc<tokio::sync::Notify>,
    /// Image layers pool shells stand on (they are not in SQLite); the layer in-use check asks.
    pub(crate) layer_pins: pool::LayerPins,
    /// Nested shells to keep ready per parent beyond the last fork's size (templates).
    pub(crate) nest_targets: Mutex<HashMap<String, usize>>,
    /// Templates collapsed into huge pages (`collapse_template`).
    pub(crate) collapsed: Mutex<HashMap<String, u64>>,
    /// Live session processes collapsed into huge pages, and how that went
    /// (`maybe_collapse_session`).
    pub(crate) session_thp: Mutex<HashMap<String, snapshot::SessionThp>>,
    /// Compactions in progress: sandbox id -> the layer being written (not recorded yet; the
    /// layer collection keeps it).
    pub(crate) compacting: Mutex<HashMap<String, String>>,
    /// Requests that run code in sandboxes, for background work that waits for a pause.
    pub(crate) activity: Activity,
}

/// Operations in flight, and when the last one ended: background work that can wait waits
/// for a pause in them, so that on a small host it does not take the CPUs from the sandboxes'
/// own work. [`Runtime::activity`] counts the requests that run code in sandboxes (commands,
/// session code, forks: a parent's fork-shell refill waits for them, as a fork's children run
/// their first commands right away); each sandbox's `ops_activity` counts its checkpoints,
/// rollbacks, forks and evaluates (spare template copies wait for them).
#[derive(Default)]
pub(crate) struct Activity {
    in_flight: std::sync::atomic::AtomicUsize,
    last_end: Mutex<Option<std::time::Instant>>,
}

/// Marks a request in flight until dropped (see [`Activity`]).
pub(crate) struct Busy<'a>(&'a Activity);

impl Activity {
    pub(crate) fn busy(&self) -> Busy<'_> {
        self.in_flight.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Busy(self)
    }

    /// How long no request has been in flight at `now` (zero while one is; `None`: none ever).
    pub(crate) fn quiet_for(&self, now: std::time::Instant) -> Option<std::time::Duration> {
        if self.in_flight.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            return Some(std::time::Duration::ZERO);
        }
        self.last_end.lock().expect("lock").map(|t| now.saturating_duration_since(t))
    }

    /// Wait until nothing was in flight for `quiet`, or for `max` at most.
    pub(crate) async fn wait_for_quiet(&self, quiet: std::time::Duration, max: std::time::Duration) {
        let t0 = std::time::Instant::now();
        loop {
            let now = std::time::Instant::now();
            let waited = now.saturating_duration_since(t0);
            let q = self.quiet_for(now).unwrap_or(quiet);
            if q >= quiet || waited >= max {
                return;
            }
            tokio::time::sleep((quiet - q).min(max - waited)).await;
        }
    }
}

impl Runtime {
    /// Wait until no request ran code for `quiet` (see [`Activity`]), or for `max` at most.
    pub(crate) async fn wait_for_quiet(&self, quiet: std::time::Duration, max: std::time::Duration) {
        self.activity.wait_for_quiet(quiet, max).await
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        // The end is recorded before the count drops: a reader never sees "none in flight"
        // with an older end.
        *self.0.last_end.lock().expect("lock") = Some(std::time::Instant::now());
        self.0.in_flight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// With `sb`'s cgroup frozen (so nothing forks meanwhile), SIGKILL every member `spare` says
/// no to; repeat until none is left (up to ~1 s). Blocking.
pub(crate) fn kill_members(sb: &Sandbox, spare: impl Fn(i32) -> bool) -> Result<()> {
    for _ in 0..500 {
        sb.cgroup.freeze()?;
        let pids = sb.cgroup.pids();
        if let Ok(pids) = &pids {
            for pid in pids.iter().filter(|p| !spare(**p)) {
                // SAFETY: kill(2) on a member of the frozen cgroup; it dies on thaw.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
        }
        sb.cgroup.thaw()?;
        if pids?.iter().all(|p| spare(*p)) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Err(RuntimeError::Internal(format!("processes of sandbox {} survived SIGKILL", sb.id)))
}

/// A new sandbox id.
pub(crate) fn new_sandbox_id() -> String {
    format!("sb-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

fn blocking_err(e: tokio::task::JoinError) -> RuntimeError {
    RuntimeError::internal("worker task", e)
}

pub fn layers_error(e: bb_layers::LayersError) -> RuntimeError {
    use bb_layers::LayersError as L;
    match e {
        L::NotFound { name } => RuntimeError::NotFound { kind: "image", id: name, hint: ": list images with `branchbox image ls`" },
        e @ (L::InvalidName { .. }
        | L::InvalidOption { .. }
        | L::UnsupportedSource { .. }
        | L::BadImage { .. }
        | L::UnsafeEntry { .. }
        | L::IdOutOfRange { .. }
        | L::DigestMismatch { .. }
        | L::NoMatchingPlatform { .. }) => RuntimeError::BadRequest(e.to_string()),
        e => RuntimeError::Internal(e.to_string()),
    }
}

fn image_info(i: &bb_layers::Image) -> ImageInfo {
    ImageInfo {
        name: i.name.clone(),
        id: i.id.clone(),
        layers: i.layers.clone(),
        size_bytes: i.size_bytes,
        created_at: i.created_at,
        source: i.source.clone(),
    }
}

impl Runtime {
    /// Open the state directory, then re-attach to or reap every sandbox a previous daemon left.
    pub fn open(mut cfg: RuntimeConfig) -> Result<Arc<Runtime>> {
        // `sandboxes/` is traverse-only; each sandbox's own directory is 0700 and owned by the
        // sandbox's host uid (its init must traverse it): host users cannot reach sandbox roots.
        for (sub, mode) in [("sandboxes", 0o711), ("trash", 0o700), ("tmp", 0o700)] {
            let dir = cfg.state_dir.join(sub);
            std::fs::create_dir_all(&dir).map_err(|e| RuntimeError::internal("state dir", e))?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
                .map_err(|e| RuntimeError::internal("state dir permissions", e))?;
        }
        spread_directories(&cfg.state_dir);
        if !cfg.init_bin.is_file() {
            return Err(RuntimeError::Internal(format!(
                "init binary {} not found: build it (`make build`) or pass --init-bin",
                cfg.init_bin.display()
            )));
        }
        cfg.setns_key = load_setns_key(&cfg.state_dir)?;
        let cgroups = CgroupLayout::detect(&cfg.cgroup_parent)?;
        if let Err(e) = cgroups.pin_freezer() {
            tracing::warn!("could not pin the cgroup v1 freezer (every freeze will cost more): {e}");
        }
        let mut images = ImageStore::open(&cfg.state_dir, cfg.idmap).map_err(layers_error)?;
        let store = store::Store::open(&cfg.state_dir.join("branchbox.db"))?;
        check_idmap(&cfg.state_dir, &store, cfg.idmap)?;
        let snaps = snapstore::SnapStore::open(&cfg.state_dir.join("branchbox.db"))?;
        // An image's layers may not be deleted while a sandbox or a pool shell stands on them.
        let layer_pins = pool::LayerPins::default();
        let (db, pins) = (cfg.state_dir.join("branchbox.db"), layer_pins.clone());
        images.set_layer_in_use_check(move |layer| layer_in_use(&db, &pins, layer));
        let cfg_templates = cfg.max_templates;
        let rt = Arc::new(Runtime {
            cfg,
            cgroups,
            images: Arc::new(images),
            store: Mutex::new(store),
            snaps: Mutex::new(snaps),
            templates: Mutex::new(snapshot::TemplatePool::new(cfg_templates)),
            sandboxes: RwLock::new(HashMap::new()),
            husks: Mutex::new(HashMap::new()),
            nest_pool: Mutex::new(Default::default()),
            pool: Mutex::new(Default::default()),
            pool_wake: Arc::new(tokio::sync::Notify::new()),
            layer_pins,
            nest_targets: Mutex::new(HashMap::new()),
            collapsed: Mutex::new(Default::default()),
            activity: Activity::default(),
            session_thp: Mutex::new(Default::default()),
            compacting: Mutex::new(Default::default()),
        });
        rt.recover()?;
        Ok(rt)
    }

    /// Re-attach to sandboxes whose init still answers; reap everything else the state dir,
    /// the cgroup tree or the mount table still holds.
    pub fn recover(self: &Arc<Self>) -> Result<()> {
        let rows = self.store.lock().expect("lock").all()?;
        let mut kept = std::collections::HashSet::new();
        for row in rows {
            let dirs = SandboxDirs::new(&self.cfg.state_dir, &row.id);
            let alive = bb_sys::process::process_start_time(row.init_pid) == Some(row.init_start)
                && ping_blocking(&dirs.sock());
            let cgroup = if alive { Cgroup::open(&self.cgroups, &row.id).ok() } else { None };
            match cgroup {
                Some(cgroup) => {
                    tracing::info!(id = %row.id, "re-attached to sandbox");
                    let gen = self.snaps.lock().expect("lock").generation(&row.id)?;
                    let mut sb = Sandbox::new(
                        row.id.clone(),
                        row.spec,
                        dirs,
                        row.init_pid,
                        row.init_start,
                        row.created_at,
                        row.expires_at,
                        cgroup,
                        gen,
                    );
                    sb.nest_parent = row.nest_parent;
                    let sb = Arc::new(sb);
                    if tokio::runtime::Handle::try_current().is_ok() {
                        self.watch_init(&sb);
                        for (key, t) in reattach_sessions(&sb) {
                            let _ = self.templates.lock().expect("lock").insert(key, sb.id.clone(), Arc::new(t));
                        }
                    }
                    kept.insert(row.id.clone());
                    self.sandboxes.write().expect("lock").insert(row.id, sb);
                }
                None => {
                    tracing::warn!(id = %row.id, "sandbox did not survive; reaping it");
                    launch::teardown(&self.cfg, &self.cgroups, &row.id, Some((row.init_pid, row.init_start)))?;
                    self.store.lock().expect("lock").delete(&row.id)?;
                }
            }
        }
        // Husks: kept while a live sandbox is nested in them (directly or through other husks).
        let husk_rows = self.store.lock().expect("lock").husks()?;
        for h in husk_rows {
            if bb_sys::process::process_start_time(h.init_pid) == Some(h.init_start) {
                kept.insert(h.id.clone());
                self.husks.lock().expect("lock").insert(h.id.clone(), h);
            } else {
                self.store.lock().expect("lock").delete_husk(&h.id)?;
            }
        }
        for gone in self.collect_husks() {
            kept.remove(&gone);
        }
        // Strays: directories, mounts and cgroups with no record (a crash mid-create or mid-kill).
        if let Ok(rd) = std::fs::read_dir(self.cfg.state_dir.join("sandboxes")) {
            for e in rd.flatten() {
                let id = e.file_name().to_string_lossy().into_owned();
                if !kept.contains(&id) {
                    tracing::warn!(%id, "removing stray sandbox directory");
                    launch::teardown(&self.cfg, &self.cgroups, &id, None)?;
                }
            }
        }
        for name in self.cgroups.list()? {
            if !kept.contains(&name) {
                tracing::warn!(%name, "removing stray cgroup");
                if let Ok(cg) = Cgroup::open(&self.cgroups, &name) {
                    cg.destroy()?;
                }
            }
        }
        // Generations of sandboxes that are gone, then layers nothing uses any more.
        let gens = self.snaps.lock().expect("lock").generations()?;
        for (id, g) in gens {
            if !kept.contains(&id) {
                self.snaps.lock().expect("lock").delete_generation(&id)?;
                self.remove_layer_dir(&g.upper);
            }
        }
        // Nothing is being set up before the runtime serves: every unrecorded layer is garbage.
        if let Err(e) = self.gc_layers(Duration::ZERO) {
            tracing::warn!("layer clean-up at start failed: {e}");
        }
        let _ = std::fs::remove_dir_all(self.cfg.state_dir.join("trash"));
        let _ = std::fs::create_dir_all(self.cfg.state_dir.join("trash"));
        Ok(())
    }

    pub fn images(&self) -> Arc<ImageStore> {
        self.images.clone()
    }

    pub fn count(&self) -> usize {
        self.sandboxes.read().expect("lock").len()
    }

    pub fn get(&self, id: &str) -> Result<Arc<Sandbox>> {
        self.sandboxes.read().expect("lock").get(id).cloned().ok_or_else(|| RuntimeError::sandbox(id))
    }

    /// Like [`get`](Self::get) but refuses a sandbox whose init has died.
    fn live(&self, id: &str) -> Result<Arc<Sandbox>> {
        let sb = self.get(id)?;
        if sb.is_dead() {
            let why = if sb.info().oom_killed { " (it ran out of memory)" } else { "" };
            return Err(RuntimeError::Conflict(format!(
                "sandbox {id} is dead{why}: kill it and create a new one, with more memory_mb if needed"
            )));
        }
        Ok(sb)
    }

    fn validate(&self, req: CreateSandbox) -> Result<(SandboxSpec, Option<f64>, Vec<PathBuf>)> {
        let c = &self.cfg;
        let image_name = req.image.unwrap_or_else(|| "base".into());
        let image = self.images.get(&image_name).map_err(layers_error)?;
        let cpu = req.cpu.unwrap_or(1.0);
        if !(0.01..=c.max_cpu).contains(&cpu) {
            return Err(RuntimeError::BadRequest(format!("cpu must be in [0.01, {}]; got {cpu}", c.max_cpu)));
        }
        let memory_mb = req.memory_mb.unwrap_or(512);
        if !(16..=c.max_memory_mb).contains(&memory_mb) {
            return Err(RuntimeError::BadRequest(format!("memory_mb must be in [16, {}]; got {memory_mb}", c.max_memory_mb)));
        }
        let pids = req.pids.unwrap_or(512);
        if !(8..=c.max_pids).contains(&pids) {
            return Err(RuntimeError::BadRequest(format!("pids must be in [8, {}]; got {pids}", c.max_pids)));
        }
        let network = req.network.unwrap_or_else(|| "none".into());
        if network != "none" {
            return Err(RuntimeError::BadRequest(format!(
                "network mode {network:?} is not supported yet: use \"none\" (loopback only)"
            )));
        }
        let timeout = req.timeout.unwrap_or(300.0);
        if !(timeout >= 0.0 && timeout.is_finite()) {
            return Err(RuntimeError::BadRequest("timeout must be >= 0 seconds (0 = no limit)".into()));
        }
        for k in req.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(RuntimeError::BadRequest(format!("env name {k:?} is invalid: no '=' or NUL, not empty")));
            }
        }
        let cwd = req.cwd.or(image.workdir.clone()).filter(|w| !w.is_empty()).unwrap_or_else(|| "/root".into());
        if !cwd.starts_with('/') {
            return Err(RuntimeError::BadRequest(format!("cwd {cwd:?} must be an absolute path")));
        }
        let layer_paths = image.layers.iter().map(|l| self.images.layer_path(l)).collect();
        let spec = SandboxSpec {
            image: image.name.clone(),
            image_env: image.env.clone(),
            layers: image.layers.clone(),
            cpu,
            memory_mb,
            pids,
            env: req.env,
            cwd,
            network,
            metadata: req.metadata,
        };
        Ok((spec, (timeout > 0.0).then_some(timeout), layer_paths))
    }

    pub async fn create(self: &Arc<Self>, req: CreateSandbox) -> Result<SandboxInfo> {
        self.check_capacity(1)?;
        if let Some(name) = req.template.clone() {
            return self.create_from_template(&name, req).await;
        }
        let (spec, timeout, _) = self.validate(req)?;
        // A ready sandbox from the warm pool if there is one; otherwise a cold start.
        let rt = self.clone();
        let s2 = spec.clone();
        let pooled = tokio::task::spawn_blocking(move || rt.claim_pooled(&s2, timeout)).await.map_err(blocking_err)?;
        self.pool_wake.notify_one();
        match pooled {
            Some(Ok(sb)) => {
                self.watch_init(&sb);
                return Ok(sb.info());
            }
            Some(Err(e)) => tracing::warn!("a pooled sandbox could not be claimed ({e}); starting one cold"),
            None => {}
        }
        let chain = spec.layers.clone();
        Ok(self.create_from(spec, chain, None, timeout, None).await?.info())
    }

    fn check_capacity(&self, n: usize) -> Result<()> {
        if self.count() + n > self.cfg.max_sandboxes {
            return Err(RuntimeError::Unavailable(format!(
                "{} sandboxes are running and the daemon's limit (--max-sandboxes) is {}: kill some first",
                self.count(),
                self.cfg.max_sandboxes
            )));
        }
        Ok(())
    }

    /// Launch a sandbox standing on `chain` (layer ids, bottom first; image and snapshot layers).
    /// With `nest_in`, the sandbox is nested in that sandbox's namespaces
    /// ([`launch::launch_nested`]): a fork child its session templates can be forked into.
    pub(crate) async fn create_from(
        self: &Arc<Self>,
        spec: SandboxSpec,
        chain: Vec<String>,
        base: Option<String>,
        timeout: Option<f64>,
        nest_in: Option<Arc<Sandbox>>,
    ) -> Result<Arc<Sandbox>> {
        let t0 = std::time::Instant::now();
        let id = new_sandbox_id();
        let rt = self.clone();
        let sb = tokio::task::spawn_blocking(move || -> Result<Arc<Sandbox>> {
            let layer_paths: Vec<PathBuf> = chain.iter().map(|l| launch::layer_dir(&rt.cfg, &rt.images, l)).collect();
            let launched = match &nest_in {
                Some(p) => launch::launch_nested(&rt.cfg, &rt.cgroups, &id, &spec, &layer_paths, &p.dirs.sock())?,
                None => {
                    let l = launch::launch(&rt.cfg, &rt.cgroups, &id, &spec, &layer_paths)?;
                    rt.note_placement(l.placement);
                    l
                }
            };
            let t_launched = t0.elapsed();
            let gen = snapstore::Generation { upper: launched.upper.clone(), mounted: chain.clone(), chain, base, n: 0 };
            let sb = rt.register(id.clone(), spec, launched, gen, nest_in.map(|p| p.id.clone()), timeout)?;
            tracing::debug!(%id, ?t_launched, recorded = ?t0.elapsed(), "sandbox created");
            Ok(sb)
        })
        .await
        .map_err(blocking_err)??;
        self.watch_init(&sb);
        Ok(sb)
    }

    /// Record a launched sandbox (SQLite row and layer generation) and make it visible; on
    /// failure it is torn down. Blocking.
    pub(crate) fn register(
        &self,
        id: String,
        spec: SandboxSpec,
        launched: launch::Launched,
        gen: snapstore::Generation,
        nest_parent: Option<String>,
        timeout: Option<f64>,
    ) -> Result<Arc<Sandbox>> {
        let created_at = now();
        let expires_at = timeout.map(|t| created_at + t);
        let row = store::SandboxRow {
            id: id.clone(),
            spec: spec.clone(),
            init_pid: launched.init_pid,
            init_start: launched.init_start,
            created_at,
            expires_at,
            nest_parent: nest_parent.clone(),
        };
        let recorded = self
            .snaps
            .lock()
            .expect("lock")
            .set_generation(&id, &gen)
            .and_then(|()| self.store.lock().expect("lock").insert(&row));
        if let Err(e) = recorded {
            let _ = launch::teardown(&self.cfg, &self.cgroups, &id, Some((launched.init_pid, launched.init_start)));
            self.remove_layer_dir(&gen.upper);
            let _ = self.snaps.lock().expect("lock").delete_generation(&id);
            return Err(e);
        }
        let mut sb = Sandbox::new(
            id.clone(),
            spec,
            SandboxDirs::new(&self.cfg.state_dir, &id),
            launched.init_pid,
            launched.init_start,
            created_at,
            expires_at,
            launched.cgroup,
            Some(gen),
        );
        sb.nest_parent = nest_parent;
        let sb = Arc::new(sb);
        self.sandboxes.write().expect("lock").insert(id, sb.clone());
        Ok(sb)
    }

    /// Reap init as soon as it exits (it is our child) so it never lingers as a zombie.
    pub(crate) fn watch_init(&self, sb: &Arc<Sandbox>) {
        let sb = sb.clone();
        tokio::spawn(async move {
            let afd = bb_sys::process::pidfd_open(sb.init_pid).ok().and_then(|pidfd| {
                // SAFETY: the pidfd is open and owned by the AsyncFd for its whole lifetime.
                unsafe { tokio::io::unix::AsyncFd::register(pidfd) }.ok()
            });
            // A pidfd is readable once the process has exited; without one, init is already gone.
            // The watch ends early when the daemon lets go of the sandbox (its init may be
            // recycled into the warm pool).
            if let Some(afd) = afd {
                tokio::select! {
                    _ = afd.readable() => {}
                    _ = sb.released.notified() => return,
                }
            }
            sb.dead.store(true, Ordering::SeqCst);
            // SAFETY: non-blocking reap of a specific pid; ECHILD if it is not our child.
            unsafe { libc::waitpid(sb.init_pid, std::ptr::null_mut(), libc::WNOHANG) };
        });
    }

    pub fn list(&self, filter: &[(String, String)]) -> Vec<SandboxInfo> {
        let mut v: Vec<SandboxInfo> = self
            .sandboxes
            .read()
            .expect("lock")
            .values()
            .filter(|s| filter.iter().all(|(k, v)| s.spec.metadata.get(k) == Some(v)))
            .filter(|s| !s.spec.metadata.contains_key(recipes::TEMPLATE_KEY) || filter.iter().any(|(k, _)| k == recipes::TEMPLATE_KEY))
            .map(|s| s.info())
            .collect();
        v.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        v
    }

    pub fn info(&self, id: &str) -> Result<SandboxInfo> {
        Ok(self.get(id)?.info())
    }

    pub fn set_timeout(&self, id: &str, timeout: f64) -> Result<SandboxInfo> {
        if !(timeout >= 0.0 && timeout.is_finite()) {
            return Err(RuntimeError::BadRequest("timeout must be >= 0 seconds (0 = no limit)".into()));
        }
        let sb = self.get(id)?;
        let exp = (timeout > 0.0).then(|| now() + timeout);
        self.store.lock().expect("lock").set_expiry(id, exp)?;
        *sb.expires_at.lock().expect("lock") = exp;
        Ok(sb.info())
    }

    pub async fn kill(self: &Arc<Self>, id: &str) -> Result<()> {
        if let Some(t) = self.template_of(id) {
            return Err(RuntimeError::Conflict(format!(
                "sandbox {id} holds template {t:?}: remove the template instead (`branchbox template rm {t}`)"
            )));
        }
        self.kill_unchecked(id).await
    }

    /// [`kill`](Self::kill) without the template check (for the template's own removal).
    pub(crate) async fn kill_unchecked(self: &Arc<Self>, id: &str) -> Result<()> {
        let sb = self.sandboxes.write().expect("lock").remove(id).ok_or_else(|| RuntimeError::sandbox(id))?;
        let was_alive = !sb.is_dead();
        sb.dead.store(true, Ordering::SeqCst);
        let rt = self.clone();
        let id = id.to_string();
        let gone_templates = self.templates.lock().expect("lock").remove_sandbox(&id);
        sb.released.notify_one();
        tokio::task::spawn_blocking(move || {
            rt.drop_shells(&id);
            if rt.has_nested(&id) {
                rt.make_husk(&sb)?;
            } else if let Some(slot) = was_alive.then(|| rt.reserve_recycle(&sb)).flatten() {
                if let Err(e) = rt.recycle(&sb, slot) {
                    tracing::warn!(%id, "recycling into the warm pool failed ({e}); tearing down");
                    launch::teardown(&rt.cfg, &rt.cgroups, &id, Some((sb.init_pid, sb.init_start)))?;
                }
            } else {
                launch::teardown(&rt.cfg, &rt.cgroups, &id, Some((sb.init_pid, sb.init_start)))?;
            }
            for key in gone_templates {
                let _ = rt.snaps.lock().expect("lock").drop_template(&key);
            }
            let upper = sb.gen.lock().expect("lock").as_ref().map(|g| g.upper.clone());
            rt.snaps.lock().expect("lock").delete_generation(&id)?;
            if let Some(u) = upper {
                rt.remove_layer_dir(&u);
            }
            rt.store.lock().expect("lock").delete(&id)?;
            rt.collect_husks();
            Ok(())
        })
        .await
        .map_err(blocking_err)?
    }

    /// Whether a live sandbox or a husk is nested directly in `id`.
    fn has_nested(&self, id: &str) -> bool {
        self.sandboxes.read().expect("lock").values().any(|s| s.nest_parent.as_deref() == Some(id))
            || self.husks.lock().expect("lock").values().any(|h| h.nest_parent.as_deref() == Some(id))
    }

    /// Turn a killed sandbox that has nested sandboxes into a husk: every process but its init is
    /// killed (with the cgroup frozen, so nothing forks meanwhile), the host side of its root and
    /// its state dir go; init stays, in its cgroup, until its last nested sandbox is gone.
    fn make_husk(&self, sb: &Sandbox) -> Result<()> {
        kill_members(sb, |p| p == sb.init_pid)?;
        let row = store::HuskRow {
            id: sb.id.clone(),
            init_pid: sb.init_pid,
            init_start: sb.init_start,
            nest_parent: sb.nest_parent.clone(),
        };
        self.store.lock().expect("lock").insert_husk(&row)?;
        self.husks.lock().expect("lock").insert(row.id.clone(), row);
        launch::remove_host_side(&self.cfg, &sb.id)?;
        tracing::info!(id = %sb.id, "sandbox killed; its init stays for the sandboxes nested in it");
        Ok(())
    }

    /// Tear down every husk nothing is nested in any more (repeatedly: a husk's parent may be a
    /// husk that only it kept). Returns their ids.
    fn collect_husks(&self) -> Vec<String> {
        let mut gone = Vec::new();
        loop {
            let husks: Vec<store::HuskRow> = self.husks.lock().expect("lock").values().cloned().collect();
            let idle: Vec<store::HuskRow> = husks.into_iter().filter(|h| !self.has_nested(&h.id)).collect();
            if idle.is_empty() {
                return gone;
            }
            for h in idle {
                if let Err(e) = launch::teardown(&self.cfg, &self.cgroups, &h.id, Some((h.init_pid, h.init_start))) {
                    tracing::warn!(id = %h.id, "tearing down husk failed: {e}");
                }
                let _ = self.store.lock().expect("lock").delete_husk(&h.id);
                self.husks.lock().expect("lock").remove(&h.id);
                gone.push(h.id);
            }
        }
    }

    /// Kill every sandbox whose TTL has passed. Returns their ids.
    pub async fn reap_expired(self: &Arc<Self>) -> Vec<String> {
        let t = now();
        let expired: Vec<String> = self
            .sandboxes
            .read()
            .expect("lock")
            .values()
            .filter(|s| s.expires_at.lock().expect("lock").is_some_and(|e| e <= t))
            .map(|s| s.id.clone())
            .collect();
        for id in &expired {
            match self.kill(id).await {
                Ok(()) => tracing::info!(%id, "sandbox reached its timeout and was killed"),
                Err(e) => tracing::warn!(%id, "reaping expired sandbox failed: {e}"),
            }
        }
        expired
    }

    /// Kill every sandbox (daemon shutdown with --kill-on-exit).
    pub async fn kill_all(self: &Arc<Self>) {
        let ids: Vec<String> = self.sandboxes.read().expect("lock").keys().cloned().collect();
        for id in ids {
            let _ = self.kill_unchecked(&id).await;
        }
    }

    // ---- commands ----

    pub async fn run_command(&self, id: &str, req: RunCommand) -> Result<CommandResult> {
        let sb = self.live(id)?;
        let _busy = self.activity.busy();
        exec::run(&sb, &req, None).await
    }

    /// Start a foreground command whose events arrive on the returned channel.
    pub async fn stream_command(&self, id: &str, req: RunCommand) -> Result<mpsc::Receiver<CommandEvent>> {
        let sb = self.live(id)?;
        exec::resolve(&sb, &req)?; // report bad input as an HTTP error, before the stream starts
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            // A client that goes away cancels the command: dropping `run` drops its init
            // connection, and init kills the process group.
            let res = tokio::select! {
                r = exec::run(&sb, &req, Some(tx.clone())) => r,
                _ = tx.closed() => return,
            };
            if let Err(e) = res {
                let _ = tx.send(CommandEvent::Error { error: ErrorBody { code: e.code().into(), message: e.to_string() } }).await;
            }
        });
        Ok(rx)
    }

    pub async fn start_background(&self, id: &str, req: RunCommand) -> Result<Started> {
        let sb = self.live(id)?;
        Ok(Started { pid: exec::start_background(&sb, &req).await? })
    }

    pub async fn list_processes(&self, id: &str) -> Result<ProcessList> {
        let sb = self.live(id)?;
        Ok(ProcessList { processes: exec::list(&sb).await? })
    }

    pub async fn wait_process(&self, id: &str, pid: i32, timeout: Option<f64>) -> Result<CommandResult> {
        let sb = self.live(id)?;
        exec::wait(&sb, pid, timeout).await
    }

    pub async fn kill_process(&self, id: &str, pid: i32, signal: Option<i32>) -> Result<()> {
        let sb = self.live(id)?;
        exec::kill(&sb, pid, signal.unwrap_or(libc::SIGKILL)).await
    }

    // ---- sessions ----

    pub async fn create_session(&self, id: &str, req: CreateSession) -> Result<SessionInfo> {
        let sb = self.live(id)?;
        let kind = req.kind.unwrap_or_else(|| "python".into());
        let s = Arc::new(session::create(&sb, &kind, false, req.cwd, &req.env).await?);
        let info = s.info();
        sb.sessions.lock().await.insert(s.id.clone(), s);
        Ok(info)
    }

    pub async fn list_sessions(&self, id: &str) -> Result<SessionList> {
        let sb = self.get(id)?;
        let mut sessions: Vec<SessionInfo> = sb.sessions.lock().await.values().map(|s| s.info()).collect();
        sessions.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        Ok(SessionList { sessions })
    }

    async fn session(&self, sb: &Sandbox, sid: &str) -> Result<Arc<session::Session>> {
        sb.sessions.lock().await.get(sid).cloned().ok_or_else(|| RuntimeError::NotFound {
            kind: "session",
            id: sid.into(),
            hint: ": list sessions with sbx.sessions.list()",
        })
    }

    pub async fn run_session(&self, id: &str, sid: &str, req: RunCode) -> Result<SessionResult> {
        let sb = self.live(id)?;
        let s = self.session(&sb, sid).await?;
        let _busy = self.activity.busy();
        session::run(&sb, &s, &req.code, timeout_of(req.timeout)?).await
    }

    pub async fn kill_session(&self, id: &str, sid: &str) -> Result<()> {
        let sb = self.get(id)?;
        let s = sb.sessions.lock().await.remove(sid).ok_or_else(|| RuntimeError::NotFound {
            kind: "session",
            id: sid.into(),
            hint: ": list sessions with sbx.sessions.list()",
        })?;
        session::kill(&sb, &s).await
    }

    /// Run python code in the sandbox's default session (created on first use or after it died).
    pub async fn run_code(&self, id: &str, req: RunCode) -> Result<SessionResult> {
        if let Some(lang) = req.language.as_deref() {
            if lang != "python" {
                return Err(RuntimeError::BadRequest(format!("language {lang:?} is not supported: use \"python\"")));
            }
        }
        let sb = self.live(id)?;
        let _busy = self.activity.busy();
        let s = {
            let mut default = sb.default_session.lock().await;
            let existing = match default.as_ref() {
                Some(sid) => sb.sessions.lock().await.get(sid).filter(|s| s.is_alive()).cloned(),
                None => None,
            };
            match existing {
                Some(s) => s,
                None => {
                    let s = Arc::new(session::create(&sb, "python", true, None, &Default::default()).await?);
                    sb.sessions.lock().await.insert(s.id.clone(), s.clone());
                    *default = Some(s.id.clone());
                    s
                }
            }
        };
        session::run(&sb, &s, &req.code, timeout_of(req.timeout)?).await
    }

    // ---- files ----

    pub async fn fs(&self, id: &str) -> Result<files::SandboxFs> {
        let sb = self.live(id)?;
        let gate = sb.fs_gate.clone().read_owned().await;
        files::SandboxFs::open_gated(&sb.rootfs(), self.cfg.idmap.host_base, gate)
    }

    // ---- images ----

    pub fn list_images(&self) -> Result<ImageList> {
        let images = self.images.list().map_err(layers_error)?;
        Ok(ImageList { images: images.iter().map(image_info).collect() })
    }

    /// Remove an image no sandbox uses. Its warm pool goes with it: the ready shells are torn
    /// down first (their roots stand on the image's layers) and its pool target is forgotten.
    pub fn remove_image(&self, name: &str) -> Result<()> {
        let in_use: Vec<String> = self
            .sandboxes
            .read()
            .expect("lock")
            .values()
            .filter(|s| s.spec.image == name)
            .map(|s| s.id.clone())
            .collect();
        if !in_use.is_empty() {
            return Err(RuntimeError::Conflict(format!(
                "image {name:?} is used by sandbox(es) {}: kill them first",
                in_use.join(", ")
            )));
        }
        self.forget_pool(name)?;
        self.images.remove(name).map_err(layers_error)
    }

    /// Build (`source = None`) or import an image on a worker thread, reporting progress.
    pub fn image_job(&self, name: String, source: ImageSource) -> mpsc::Receiver<ProgressEvent> {
        let (tx, rx) = mpsc::channel(256);
        let images = self.images.clone();
        tokio::task::spawn_blocking(move || {
            let mut report = |p: bb_layers::Progress| {
                let ev = match p {
                    bb_layers::Progress::Stage { stage, message } => {
                        ProgressEvent::Progress { stage, done: None, total: None, message }
                    }
                    bb_layers::Progress::Step { stage, done, total } => {
                        ProgressEvent::Progress { stage, done: Some(done), total: Some(total), message: String::new() }
                    }
                };
                let _ = tx.blocking_send(ev);
            };
            let res = match source {
                ImageSource::Debootstrap(opts) => images.build_base(&name, &opts, &mut report),
                ImageSource::Path(p) => images.import(&name, &p, &mut report),
            };
            let last = match res {
                Ok(img) => ProgressEvent::Done { image: image_info(&img) },
                Err(e) => {
                    let e = layers_error(e);
                    ProgressEvent::Error { error: ErrorBody { code: e.code().into(), message: e.to_string() } }
                }
            };
            let _ = tx.blocking_send(last);
        });
        rx
    }
}

pub use bb_layers::BaseImageOpts;

pub enum ImageSource {
    Debootstrap(bb_layers::BaseImageOpts),
    Path(PathBuf),
}

fn timeout_of(t: Option<f64>) -> Result<Option<Duration>> {
    match t {
        None => Ok(Some(Duration::from_secs_f64(exec::DEFAULT_TIMEOUT))),
        Some(t) if !(t >= 0.0 && t.is_finite()) => {
            Err(RuntimeError::BadRequest("timeout must be >= 0 seconds (0 = no limit)".into()))
        }
        Some(0.0) => Ok(None),
        Some(t) => Ok(Some(Duration::from_secs_f64(t))),
    }
}

/// Whether a sandbox (recorded in SQLite: its rows, snapshots and layer generations) or a pool
/// shell ([`pool::LayerPins`]) stands on image layer `layer`. In doubt (database unreadable), yes.
fn layer_in_use(db: &Path, pins: &pool::LayerPins, layer: &str) -> bool {
    if pins.holds(layer) {
        return true;
    }
    let in_rows = store::Store::open(db)
        .and_then(|s| s.all())
        .map(|rows| {
            rows.iter()
                .any(|r| r.spec.layers.iter().any(|l| l == layer))
        })
        .unwrap_or(true);
    let in_snaps = snapstore::SnapStore::open(db)
        .and_then(|s| Ok((s.all()?, s.generations()?)))
        .map(|(snaps, gens)| {
            snaps.iter().any(|s| s.layers.iter().any(|l| l == layer))
                || gens
                    .iter()
                    .any(|(_, g)| g.chain.iter().chain(&g.mounted).any(|l| l == layer))
        })
        .unwrap_or(true);
    in_rows || in_snaps
}

/// Images (every file of every layer) and sandbox directories are owned by the host ids of the
/// id mapping the state dir was set up with: a daemon with another `--uid-base` would start
/// sandboxes that cannot use any of them. The mapping is recorded on first start and every later
/// start must match it. A state dir from before the record is judged by its layers' owners.
fn check_idmap(state_dir: &Path, store: &store::Store, idmap: IdMap) -> Result<()> {
    let want = format!("{}:{}", idmap.host_base, idmap.size);
    let recorded = match store.setting("idmap")? {
        Some(v) => {
            let parsed = v.split_once(':').and_then(|(b, n)| {
                Some(IdMap {
                    host_base: b.parse().ok()?,
                    size: n.parse().ok()?,
                })
            });
            Some(parsed.ok_or_else(|| {
                RuntimeError::Internal(format!(
                    "state dir {}: unreadable id mapping {v:?} in table settings",
                    state_dir.display()
                ))
            })?)
        }
        None => None,
    };
    let mismatch = |base: u32, what: &str| {
        RuntimeError::Conflict(format!(
            "state dir {} was set up with --uid-base {base} ({what}), but this daemon was started with --uid-base {}: \
             start it with --uid-base {base}, or use another --state-dir",
            state_dir.display(),
            idmap.host_base
        ))
    };
    match recorded {
        Some(r) if r == idmap => Ok(()),
        Some(r) if r.size != idmap.size => Err(RuntimeError::Conflict(format!(
            "state dir {} was set up for {} sandbox ids per user namespace, this daemon maps {}: use the branchboxd it was \
             set up with, or another --state-dir",
            state_dir.display(),
            r.size,
            idmap.size
        ))),
        Some(r) => Err(mismatch(r.host_base, "recorded in its database")),
        None => {
            // Layer roots belong to the image's root user: host_base (or an id above it). Those
            // owned by host root say nothing.
            let owners = std::fs::read_dir(state_dir.join("layers")).into_iter().flatten().flatten().filter_map(|e| {
                use std::os::unix::fs::MetadataExt;
                e.metadata().ok().map(|m| m.uid()).filter(|&u| u != 0)
            });
            if let Some(base) = owners.filter(|&u| u < idmap.host_base || u >= idmap.host_base.saturating_add(idmap.size)).min() {
                return Err(mismatch(base, &format!("its image layers are owned by host uid {base}")));
            }
            store.set_setting("idmap", &want)
        }
    }
}

/// Writable layers (`snaplayers/`) and sandbox directories (`sandboxes/`) are made and deleted
/// by the thousand. On ext4 without a journal, every new inode skips the group's inodes deleted
/// in the last minutes (`recently_deleted`, one buffer lookup each): with all of them packed in
/// the group of their parent, a mkdir there cost 0.17 ms instead of 0.03 and the overlay mounts
/// of a fork of 16 spent ~50 ms of CPU in it. Marked as tops of hierarchies, their
/// subdirectories are spread over the block groups. Elsewhere (XFS, btrfs, tmpfs) a no-op.
fn spread_directories(state_dir: &Path) {
    for sub in ["snaplayers", "sandboxes"] {
        let dir = state_dir.join(sub);
        let set = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::File::open(&dir))
            .map_err(|e| e.to_string())
            .and_then(|f| bb_sys::mount_api::set_topdir(std::os::fd::AsFd::as_fd(&f)).map_err(|e| e.to_string()));
        if let Err(e) = set {
            tracing::debug!(dir = %dir.display(), "cannot mark as top directory: {e}");
        }
    }
}

/// The daemon's setns key: 16 random bytes in `<state>/setns.key` (0600), made on first start.
/// It must outlive restarts: sandboxes started earlier have it compiled into their filters.
fn load_setns_key(state_dir: &Path) -> Result<[u64; 2]> {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let path = state_dir.join("setns.key");
    let mut buf = [0u8; 16];
    match std::fs::File::open(&path) {
        Ok(mut f) => f.read_exact(&mut buf).map_err(|e| RuntimeError::internal("read setns.key (delete it if corrupt)", e))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::File::open("/dev/urandom")
                .and_then(|mut r| r.read_exact(&mut buf))
                .map_err(|e| RuntimeError::internal("random key", e))?;
            let tmp = state_dir.join("setns.key.tmp");
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)
                .map_err(|e| RuntimeError::internal("write setns.key", e))?;
            f.write_all(&buf).and_then(|()| f.sync_all()).map_err(|e| RuntimeError::internal("write setns.key", e))?;
            std::fs::rename(&tmp, &path).map_err(|e| RuntimeError::internal("write setns.key", e))?;
        }
        Err(e) => return Err(RuntimeError::internal("open setns.key", e)),
    }
    let key = [u64::from_ne_bytes(buf[..8].try_into().expect("8 bytes")), u64::from_ne_bytes(buf[8..].try_into().expect("8 bytes"))];
    if key == [0, 0] {
        return Err(RuntimeError::Internal(format!("{} is all zeros: delete it and restart", path.display())));
    }
    Ok(key)
}

/// One blocking request to an init control socket, answered within 2 s (used during recovery,
/// before the runtime serves).
fn call_blocking(sock: &Path, req: &bb_proto::Request) -> Option<(bb_proto::Response, Vec<std::os::fd::OwnedFd>)> {
    initconn::call_blocking(sock, req, &[], Duration::from_secs(2)).ok()
}

fn ping_blocking(sock: &Path) -> bool {
    matches!(call_blocking(sock, &bb_proto::Request::Ping), Some((bb_proto::Response::Pong { .. }, _)))
}

/// Take back the channels of a re-attached sandbox's live sessions from its init; returns the
/// sandbox's live templates (forked session copies kept for snapshots) by key.
fn reattach_sessions(sb: &Sandbox) -> Vec<(String, session::Session)> {
    let mut templates = Vec::new();
    let Some((bb_proto::Response::Procs { procs }, _)) = call_blocking(&sb.dirs.sock(), &bb_proto::Request::List) else {
        return templates;
    };
    for p in procs.into_iter().filter(|p| p.exit.is_none()) {
        let template = p.tag.strip_prefix(snapshot::TEMPLATE_TAG).and_then(|rest| rest.split_once(':'));
        let (key, kind, default) = match (template, session::parse_session_tag(&p.tag)) {
            (Some((key, kind)), _) => (key.to_string(), kind.to_string(), false),
            (None, Some(parsed)) => parsed,
            (None, None) => continue,
        };
        let fetched = call_blocking(&sb.dirs.sock(), &bb_proto::Request::Fetch { key: key.clone() });
        let Some((bb_proto::Response::Ok, mut fds)) = fetched else { continue };
        let Some(fd) = fds.pop() else { continue };
        let chan = std::os::unix::net::UnixStream::from(fd);
        match session::Session::attach(key.clone(), kind, p.pid, p.started_at, chan) {
            Ok(s) if template.is_some() => templates.push((key, s)),
            Ok(s) => {
                if let (Ok(mut sessions), Ok(mut dflt)) = (sb.sessions.try_lock(), sb.default_session.try_lock()) {
                    sessions.insert(key.clone(), Arc::new(s));
                    if default {
                        *dflt = Some(key);
                    }
                }
            }
            Err(e) => tracing::warn!(sandbox = %sb.id, session = %key, "cannot re-attach session: {e}"),
        }
    }
    templates
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activity_is_quiet_only_when_nothing_runs() {
        let a = Activity::default();
        let t0 = std::time::Instant::now();
        assert_eq!(a.quiet_for(t0), None, "nothing ever ran");
        let one = a.busy();
        let two = a.busy();
        assert_eq!(a.quiet_for(t0 + std::time::Duration::from_secs(1)), Some(std::time::Duration::ZERO));
        drop(one);
        assert_eq!(a.quiet_for(std::time::Instant::now() + std::time::Duration::from_secs(1)), Some(std::time::Duration::ZERO), "one still runs");
        drop(two);
        let ended = std::time::Instant::now();
        let q = a.quiet_for(ended + std::time::Duration::from_millis(50)).unwrap();
        assert!(q >= std::time::Duration::from_millis(50) && q < std::time::Duration::from_millis(60), "{q:?}");
    }

    #[test]
    fn a_state_dir_keeps_the_uid_base_it_was_set_up_with() {
        let d = tempfile::tempdir().unwrap();
        let store = store::Store::open(&d.path().join("branchbox.db")).unwrap();
        let default = IdMap::default();
        check_idmap(d.path(), &store, default).unwrap();
        check_idmap(d.path(), &store, default).unwrap();
        let other = IdMap {
            host_base: 3_000_000,
            ..default
        };
        let e = check_idmap(d.path(), &store, other).unwrap_err();
        assert!(matches!(e, RuntimeError::Conflict(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("set up with --uid-base 1000000")
                && msg.contains("start it with --uid-base 1000000"),
            "{msg}"
        );
        assert!(msg.contains("started with --uid-base 3000000"), "{msg}");
        // The record is kept: the right base still works afterwards.
        check_idmap(d.path(), &store, default).unwrap();
    }

    #[test]
    fn a_state_dir_from_before_the_record_is_judged_by_its_layers() {
        let d = tempfile::tempdir().unwrap();
        let layer = d
            .path()
            .join("layers")
            .join(format!("local:{}", "0".repeat(32)));
        std::fs::create_dir_all(&layer).unwrap();
        if nix::unistd::chown(&layer, Some(nix::unistd::Uid::from_raw(1_000_000)), None).is_err() {
            eprintln!("skipped: chown needs root");
            return;
        }
        let store = store::Store::open(&d.path().join("branchbox.db")).unwrap();
        let e = check_idmap(
            d.path(),
            &store,
            IdMap {
                host_base: 3_000_000,
                ..IdMap::default()
            },
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("start it with --uid-base 1000000"),
            "{e}"
        );
        assert_eq!(
            store.setting("idmap").unwrap(),
            None,
            "nothing recorded from a refused start"
        );
        check_idmap(d.path(), &store, IdMap::default()).unwrap();
        assert_eq!(
            store.setting("idmap").unwrap().as_deref(),
            Some("1000000:65536")
        );
    }

    #[test]
    fn layers_of_pool_shells_are_in_use() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("branchbox.db");
        let (_s, _n) = (
            store::Store::open(&db).unwrap(),
            snapstore::SnapStore::open(&db).unwrap(),
        );
        let pins = pool::LayerPins::default();
        let layer = format!("local:{}", "1".repeat(32));
        assert!(!layer_in_use(&db, &pins, &layer), "no sandbox, no shell");
        let pin = pins.pin(std::slice::from_ref(&layer));
        assert!(
            layer_in_use(&db, &pins, &layer),
            "a shell being built or ready stands on it"
        );
        drop(pin);
        assert!(!layer_in_use(&db, &pins, &layer));
    }
}

/// How long background work a request leaves behind (registering a template with init, a
/// huge-page look at a session, dropping evicted templates) waits before it starts: on a small
/// host it otherwise competes for the CPUs with the answer on its way to the client and
/// with the thawed sandbox (measured here, 2 cores: 0.2-0.3 ms off each checkpoint and
/// rollback as the client sees it).
pub(crate) const BEHIND_ANSWER: std::time::Duration = std::time::Duration::from_millis(5);
