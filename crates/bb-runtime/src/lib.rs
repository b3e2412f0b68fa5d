//! The branchbox sandbox runtime: the one door through which the API acts on sandboxes.
//!
//! A sandbox is an overlay root (image layers, snapshot layers, one private writable layer), a
//! cgroup with memory/cpu/pids limits, and `branchbox-init` cloned into fresh user, mount, pid,
//! uts, ipc, net and cgroup namespaces, which spawns processes on request over a unix socket
//! (`bb_proto`). [`Runtime`] holds one value per mechanism, each owning its state and locks;
//! the public methods (the API's actions) live in the file of the mechanism they belong to.
//!
//! | mechanism | where |
//! |---|---|
//! | sandbox lifecycle, registry, husks | [`sandbox`] ([`sandbox::lifecycle`], [`sandbox::launch`], [`sandbox::registry`]) |
//! | commands, files, sessions of a sandbox | [`sandbox::exec`], [`sandbox::files`], [`sandbox::sessions`] |
//! | session processes and their protocol; forking one into another sandbox | [`session`], [`session::fork`] |
//! | checkpoint, rollback, fork, evaluate, the snapshot tree | [`snapshot`] |
//! | session templates (frozen session processes) and their spares | [`session_templates`] |
//! | process images (CRIU) of evicted session templates | [`process_images`], crate `bb_criu` |
//! | pause and resume of a whole sandbox | [`pause`] |
//! | persistent volumes: records, mounts in sandboxes, snapshots, forks, sync | [`volumes`] |
//! | layer directories and their collection | [`layers`] |
//! | compaction of deep snapshot chains | [`compaction`] |
//! | huge pages for session memory | [`hugepages`] |
//! | warm pool of ready sandboxes | [`pool`] |
//! | pre-built shells for live forks | [`fork_shells`] |
//! | named templates (recipes) | [`recipes`] |
//! | images | [`images`] |
//! | state directory checks; crash recovery | [`statedir`], [`recover`] |
//! | requests in flight, for background work | [`activity`] |
//!
//! Storage that outlives a node (object store, metadata store) comes as crates of their own
//! (`bb_store`, `bb_meta`) that [`remote`] and [`volumes`] use.

pub mod activity;
pub mod compaction;
pub mod config;
pub mod db;
pub mod error;
pub mod fork_shells;
pub mod hugepages;
pub mod images;
pub mod initconn;
pub mod layers;
pub mod model;
pub mod net;
pub mod pause;
pub mod pool;
pub mod process_images;
pub mod recipes;
pub mod recover;
pub mod remote;
pub mod sandbox;
pub mod session;
pub mod session_templates;
pub mod snapshot;
pub mod statedir;
pub mod volumes;

pub use config::RuntimeConfig;
pub use error::{Result, RuntimeError};
pub use images::{BaseImageOpts, ImageSource};

use bb_isolation::CgroupLayout;
use bb_layers::ImageStore;
use std::sync::Arc;

/// Seconds since the epoch, as the API reports times.
pub fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// The daemon's sandboxes and everything they stand on: one value per mechanism.
pub struct Runtime {
    pub cfg: RuntimeConfig,
    pub cgroups: CgroupLayout,
    images: Arc<ImageStore>,
    /// Live sandboxes, husks, and their records.
    sandboxes: sandbox::registry::Sandboxes,
    /// Snapshot records and the layer generations of live sandboxes.
    snapshots: snapshot::Snapshots,
    session_templates: session_templates::SessionTemplates,
    process_images: process_images::ProcessImages,
    fork_shells: fork_shells::ForkShells,
    pool: pool::WarmPool,
    hugepages: hugepages::HugePages,
    compaction: compaction::Compaction,
    /// Requests that run code in sandboxes, for background work that waits for a pause.
    activity: activity::Activity,
    /// The object store and metadata store of durable snapshots.
    remote: remote::Remote,
    /// Persistent volumes mounted into sandboxes.
    volumes: volumes::Volumes,
    /// One pull at a time (two pulls of one snapshot would download it twice).
    pulls: tokio::sync::Mutex<()>,
    /// Sandbox ports reached from the host.
    ports: net::ports::Ports,
    /// Sandboxes' egress: the bridge, their slots and policies.
    net: Arc<net::Net>,
    /// One change of a sandbox's network policy at a time.
    net_changes: parking_lot::Mutex<()>,
    /// Who takes attached processes restores bring back ([`Runtime::on_attached_restored`]).
    attached_hook: parking_lot::RwLock<Option<sandbox::exec::AttachedHook>>,
}

impl Runtime {
    /// Open the state directory, then re-attach to or reap every sandbox a previous daemon left.
    pub fn open(mut cfg: RuntimeConfig) -> Result<Arc<Runtime>> {
        let db = statedir::prepare(&cfg.state_dir)?;
        if !cfg.init_bin.is_file() {
            return Err(statedir::StateDirError::InitBinary(cfg.init_bin.clone()).into());
        }
        cfg.setns_key =
            statedir::load_setns_key(&cfg.setns_key_file.clone().unwrap_or_else(|| cfg.state_dir.join("setns.key")))?;
        let cgroups = CgroupLayout::detect(&cfg.cgroup_parent)?;
        if let Err(e) = cgroups.pin_freezer() {
            tracing::warn!("could not pin the cgroup v1 freezer (every freeze will cost more): {e}");
        }
        let mut images = ImageStore::open(&cfg.state_dir, cfg.idmap)?;
        let sandboxes = sandbox::registry::Sandboxes::open(&db)?;
        statedir::check_idmap(&cfg.state_dir, &statedir::Settings::open(&db)?, cfg.idmap)?;
        let snapshots = snapshot::Snapshots::open(&db)?;
        let process_images = process_images::ProcessImages::open(
            &cfg.state_dir,
            &db,
            &cfg.criu_bin,
            &cfg.criu_exec_bin,
            cfg.max_image_bytes,
            cfg.lazy_pages,
        )?;
        let pool = pool::WarmPool::open(&db)?;
        let remote = remote::Remote::new(&cfg, &db)?;
        let volumes = volumes::Volumes::open(&db)?;
        let net = Arc::new(net::Net::open(&cfg, &db)?);
        // An image's layers may not be deleted while a sandbox or a pool shell stands on them.
        let pins = pool.pins();
        images.set_layer_in_use_check(move |layer| images::layer_in_use(&db, &pins, layer));
        let rt = Arc::new(Runtime {
            session_templates: session_templates::SessionTemplates::new(cfg.max_templates),
            cfg,
            cgroups,
            images: Arc::new(images),
            sandboxes,
            snapshots,
            process_images,
            fork_shells: Default::default(),
            pool,
            hugepages: Default::default(),
            compaction: Default::default(),
            activity: Default::default(),
            remote,
            volumes,
            pulls: Default::default(),
            ports: Default::default(),
            net,
            net_changes: Default::default(),
            attached_hook: Default::default(),
        });
        rt.recover()?;
        Ok(rt)
    }
}
