//! One live sandbox as the daemon holds it in memory.

pub mod exec;
pub mod files;
pub mod launch;
pub mod lifecycle;
pub mod procs;
pub mod registry;
pub mod rootswap;
pub mod sessions;
pub mod store;
pub mod watch;

use crate::model::{SandboxInfo, SandboxSpec};
use crate::sandbox::launch::SandboxDirs;
use crate::session::Session;
use bb_isolation::Cgroup;
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

pub struct Sandbox {
    pub id: String,
    pub spec: SandboxSpec,
    pub dirs: SandboxDirs,
    pub init_pid: i32,
    pub init_start: u64,
    pub created_at: f64,
    pub expires_at: Mutex<Option<f64>>,
    pub cgroup: Cgroup,
    pub dead: AtomicBool,
    pub oom_seen: AtomicU64,
    pub sessions: tokio::sync::Mutex<HashMap<String, Arc<Session>>>,
    /// Serialises creation of the default python session used by `/code`.
    pub default_session: tokio::sync::Mutex<Option<String>>,
    /// The layer stack the sandbox stands on (None: created by a daemon without snapshots).
    pub gen: Mutex<Option<crate::layers::Generation>>,
    /// Serialises checkpoint / rollback / fork / evaluate of this sandbox.
    pub ops: tokio::sync::Mutex<()>,
    /// Those operations in flight and when the last one ended (spare copies of templates are
    /// made in a pause between them: [`crate::Runtime::make_spares`]). See [`Sandbox::begin_op`].
    pub(crate) ops_activity: crate::activity::Activity,
    /// File operations hold it shared; a root swap holds it exclusively.
    pub fs_gate: Arc<tokio::sync::RwLock<()>>,
    /// A session ran, was created or was killed since the last checkpoint or rollback.
    pub dirty: AtomicBool,
    /// The sandbox whose user and pid namespaces this one is nested in (see `store::SandboxRow`).
    pub nest_parent: Option<String>,
    /// Set while the sandbox is paused, being paused or being resumed (see [`crate::pause`]).
    pub paused: Mutex<Option<Paused>>,
    /// Notified when the daemon lets go of the sandbox (killed or recycled): stops the watcher
    /// of its init, which may live on in the warm pool.
    pub released: tokio::sync::Notify,
    /// Held by whatever changes the sandbox's mount table (a root swap) or needs it to hold
    /// still (CRIU, which reads it, opens mount points and mounts scratch directories in it
    /// while it dumps or restores): the two never overlap.
    pub(crate) mounts: tokio::sync::Mutex<()>,
    /// Its templates hold more memory than the pool could let go at once (see
    /// [`crate::Runtime::relieve_memory`]): its next checkpoint waits for the dumps under way.
    pub(crate) memory_tight: AtomicBool,
    /// Volumes mounted in it (`crate::volumes`).
    pub(crate) volumes: Mutex<Vec<crate::model::VolumeMount>>,
    /// Its network policy now, and its wiring to the bridge in a mode with egress.
    pub(crate) net: Mutex<crate::net::NetState>,
    /// When a pause at its timeout first failed (refused or not made; see
    /// [`crate::Runtime::pause_expired`]).
    pub(crate) timeout_pause_failing_since: Mutex<Option<f64>>,
    /// Its attached processes, on pipes or a terminal (see [`crate::sandbox::exec::Plugs`]).
    pub(crate) plugs: crate::sandbox::exec::Plugs,
}

/// Where a paused sandbox is (see [`crate::pause`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Paused {
    /// When the pause started.
    pub at: f64,
    pub stage: PauseStage,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseStage {
    /// Its processes are being dumped.
    Pausing,
    /// Only its init runs; its processes are in process images.
    Paused,
    /// Its processes are being restored.
    Resuming,
}

impl PauseStage {
    /// The sandbox's `state` in the API.
    pub fn state(self) -> &'static str {
        match self {
            PauseStage::Pausing => "pausing",
            PauseStage::Paused => "paused",
            PauseStage::Resuming => "resuming",
        }
    }
}

/// Environment every command starts with, before the image's and the caller's.
const BASE_ENV: &[(&str, &str)] = &[
    ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
    ("HOME", "/root"),
    ("LANG", "C.UTF-8"),
    ("TERM", "xterm"),
];

/// One checkpoint, rollback, fork or evaluate of a sandbox in progress (see
/// [`Sandbox::begin_op`]): holds its operation lock and counts in its `ops_activity`.
pub(crate) struct OpGuard<'a> {
    // Fields drop in order: the end is recorded before the lock is let go.
    _busy: crate::activity::Busy<'a>,
    _ops: tokio::sync::MutexGuard<'a, ()>,
}

impl Sandbox {
    /// Start a checkpoint, rollback, fork or evaluate: wait for the sandbox's operation lock
    /// and count the operation as in flight until the guard is dropped.
    pub(crate) async fn begin_op(&self) -> OpGuard<'_> {
        let ops = self.ops.lock().await;
        OpGuard { _busy: self.ops_activity.busy(), _ops: ops }
    }

    /// A sandbox record as the runtime keeps it in memory.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: String,
        spec: SandboxSpec,
        dirs: SandboxDirs,
        init_pid: i32,
        init_start: u64,
        created_at: f64,
        expires_at: Option<f64>,
        cgroup: Cgroup,
        gen: Option<crate::layers::Generation>,
    ) -> Sandbox {
        Sandbox {
            id,
            spec,
            dirs,
            init_pid,
            init_start,
            created_at,
            expires_at: Mutex::new(expires_at),
            cgroup,
            dead: Default::default(),
            oom_seen: Default::default(),
            sessions: Default::default(),
            default_session: Default::default(),
            gen: Mutex::new(gen),
            ops: Default::default(),
            ops_activity: Default::default(),
            fs_gate: Default::default(),
            dirty: AtomicBool::new(true),
            nest_parent: None,
            paused: Mutex::new(None),
            released: tokio::sync::Notify::new(),
            mounts: Default::default(),
            memory_tight: AtomicBool::new(false),
            volumes: Default::default(),
            net: Default::default(),
            timeout_pause_failing_since: Mutex::new(None),
            plugs: Default::default(),
        }
    }

    /// Base env, then the image's, then the proxy's (when it has one), then the sandbox's, then
    /// `extra`; later entries win.
    pub fn env_with(&self, extra: &BTreeMap<String, String>) -> Vec<String> {
        let mut merged: Vec<(String, String)> = Vec::new();
        let mut set = |k: &str, v: &str| {
            if let Some(e) = merged.iter_mut().find(|(key, _)| key == k) {
                e.1 = v.to_string();
            } else {
                merged.push((k.to_string(), v.to_string()));
            }
        };
        for (k, v) in BASE_ENV {
            set(k, v);
        }
        set("HOSTNAME", &self.id);
        for kv in &self.spec.image_env {
            if let Some((k, v)) = kv.split_once('=') {
                set(k, v);
            }
        }
        if let Some(port) = self.spec.proxy_port {
            let url = crate::net::proxy::Proxy::url(port);
            for k in ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"] {
                set(k, &url);
            }
            for k in ["NO_PROXY", "no_proxy"] {
                set(k, "localhost,127.0.0.1,::1");
            }
        }
        for (k, v) in self.spec.env.iter().chain(extra.iter()) {
            set(k, v);
        }
        merged.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
    }

    /// What CRIU needs to dump and restore this sandbox's processes ([`bb_criu::SandboxRef`]).
    pub fn criu_ref(&self) -> bb_criu::SandboxRef {
        bb_criu::SandboxRef {
            init_pid: self.init_pid,
            cgroup_procs: self.cgroup.paths().into_iter().map(|p| p.join("cgroup.procs")).collect(),
            host_dir: Some(self.dirs.dir.clone()),
        }
    }

    /// Open (create) log file `name` of the sandbox's processes, appended to or truncated. It
    /// belongs to the sandbox's root user, like the sandbox dir: a process restored from a
    /// process image reopens its stdout and stderr through /proc as that user.
    pub fn open_log(&self, name: &str, append: bool) -> crate::Result<std::fs::File> {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(self.dirs.logs().join(name))
            .map_err(crate::RuntimeError::io("open a log file"))?;
        let root = self.root_id()?;
        std::os::unix::fs::fchown(&f, Some(root), Some(root)).map_err(crate::RuntimeError::io("chown a log file"))?;
        Ok(f)
    }

    /// Host uid of the sandbox's root user (the owner of the sandbox dir), and its gid: uids
    /// and gids are mapped alike.
    pub(crate) fn root_id(&self) -> crate::Result<u32> {
        use std::os::unix::fs::MetadataExt;
        Ok(std::fs::metadata(&self.dirs.dir).map_err(crate::RuntimeError::io("sandbox dir"))?.uid())
    }

    /// Host-side path of the sandbox's current root (the file API works there).
    pub fn rootfs(&self) -> std::path::PathBuf {
        let n = self.gen.lock().as_ref().map(|g| g.n).unwrap_or(0);
        self.dirs.rootfs_gen(n)
    }

    /// OOM kills seen so far (refreshed whenever the cgroup's counters are read).
    pub fn oom_seen(&self) -> u64 {
        self.oom_seen.load(Ordering::SeqCst)
    }

    /// Read the cgroup's OOM-kill counter; true when it grew beyond `before`.
    pub fn oom_since(&self, before: u64) -> bool {
        let now = self.cgroup.stats().map(|s| s.oom_kills).unwrap_or(0);
        self.oom_seen.fetch_max(now, Ordering::SeqCst);
        now > before
    }

    /// Init has exited (set by the pidfd watcher the runtime starts for every sandbox).
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Paused, or being paused or resumed.
    pub fn is_paused(&self) -> bool {
        self.paused.lock().is_some()
    }

    /// Move a paused sandbox to `stage` (no-op when it is not paused).
    pub(crate) fn set_pause_stage(&self, stage: PauseStage) {
        if let Some(p) = self.paused.lock().as_mut() {
            p.stage = stage;
        }
    }

    pub fn info(&self) -> SandboxInfo {
        let stats = self.cgroup.stats().ok();
        if let Some(s) = &stats {
            self.oom_seen.fetch_max(s.oom_kills, Ordering::SeqCst);
        }
        let dead = self.is_dead();
        let net = self.net.lock().clone();
        let (rx, tx) = net.wired.as_ref().map(crate::net::Wired::counters).unwrap_or((0, 0));
        let paused = *self.paused.lock();
        let paused_at = paused.map(|p| p.at);
        let state = match (dead, paused) {
            (true, _) => "dead",
            (false, Some(p)) => p.stage.state(),
            (false, None) => "running",
        };
        SandboxInfo {
            id: self.id.clone(),
            image: self.spec.image.clone(),
            state: state.into(),
            created_at: self.created_at,
            expires_at: *self.expires_at.lock(),
            cpu: self.spec.cpu,
            memory_mb: self.spec.memory_mb,
            pids: self.spec.pids,
            network: net.policy.mode.as_str().to_string(),
            allow: net.policy.allow,
            address: net.wired.as_ref().map(|w| w.address.to_string()),
            proxy: self.spec.proxy_port.map(crate::net::proxy::Proxy::url),
            net_rx_bytes: rx,
            net_tx_bytes: tx,
            env: self.spec.env.clone(),
            cwd: self.spec.cwd.clone(),
            metadata: self.spec.metadata.clone(),
            init_pid: self.init_pid,
            oom_killed: stats.as_ref().is_some_and(|s| s.oom_kills > 0),
            memory_bytes: stats.as_ref().map(|s| s.memory_bytes).unwrap_or(0),
            pids_current: stats.as_ref().map(|s| s.pids_current).unwrap_or(0),
            nested_in: self.nest_parent.clone(),
            volumes: self.volumes.lock().clone(),
            lifecycle: self.spec.lifecycle,
            paused_at,
            sudo: self.spec.sudo,
        }
    }
}
