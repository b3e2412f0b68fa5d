//! Starting a sandbox: overlay root, cgroup, init cloned into new namespaces; and tearing it down.

use crate::error::{Result, RuntimeError};
use crate::model::SandboxSpec;
use crate::RuntimeConfig;
use bb_isolation::{Cgroup, CgroupLayout, CgroupVersion, Limits};
use bb_proto::InitConfig;
use bb_sys::process::{spawn_paused, NsSpawn};
use nix::sys::socket::{bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The namespaces every sandbox gets.
pub const NAMESPACES: u64 = (libc::CLONE_NEWUSER
    | libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWCGROUP) as u64;

/// Paths of one sandbox's host-side state.
#[derive(Debug, Clone)]
pub struct SandboxDirs {
    pub dir: PathBuf,
}

impl SandboxDirs {
    pub fn new(state_dir: &Path, id: &str) -> Self {
        SandboxDirs { dir: state_dir.join("sandboxes").join(id) }
    }
    /// Host-side mount point of the sandbox's root at launch (generation 0).
    pub fn rootfs(&self) -> PathBuf {
        self.rootfs_gen(0)
    }
    /// Host-side mount point of generation `n`'s root: each root swap mounts the new root at a
    /// new path, so the old one can be unmounted off the critical path.
    pub fn rootfs_gen(&self, n: u64) -> PathBuf {
        if n == 0 {
            self.dir.join("rootfs")
        } else {
            self.dir.join(format!("rootfs-{n}"))
        }
    }
    /// Every host-side root mount point this sandbox may have.
    pub fn rootfs_all(&self) -> Vec<PathBuf> {
        let mut v = vec![self.rootfs()];
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            v.extend(rd.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("rootfs-")).map(|e| e.path()));
        }
        v
    }
    pub fn sock(&self) -> PathBuf {
        self.dir.join("control.sock")
    }
    pub fn logs(&self) -> PathBuf {
        self.dir.join("logs")
    }
    pub fn init_log(&self) -> PathBuf {
        self.dir.join("init.log")
    }
}

/// A new boot id: a random UUID, as the kernel makes one per boot.
pub(crate) fn fresh_boot_id() -> String {
    uuid::Uuid::new_v4().hyphenated().to_string()
}

/// Give the sandbox whose init is `init_pid` (host pid) a new boot id, as a boot would: written
/// in place into the file init holds at [`bb_proto::INIT_BOOT_ID_FD`] (the same length each
/// time, so a reader never sees it empty). An init from before boot ids has no such file: its
/// sandbox keeps showing the host's.
pub(crate) fn new_boot_id(init_pid: i32) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let link = format!("/proc/{init_pid}/fd/{}", bb_proto::INIT_BOOT_ID_FD);
    if std::fs::read_link(&link).ok().as_deref() != Some(Path::new(bb_proto::BOOT_ID_FILE)) {
        tracing::debug!(init_pid, "this sandbox's init keeps no boot id of its own");
        return Ok(());
    }
    let f = std::fs::OpenOptions::new().write(true).open(&link).map_err(|e| io("open boot id", e))?;
    f.write_all_at(format!("{}\n", fresh_boot_id()).as_bytes(), 0).map_err(|e| io("write boot id", e))
}

pub struct Launched {
    /// How init was placed in its cgroup (`clone_into_cgroup` on v2, `migrate` on v1) and how
    /// long that took (ms; for clone_into_cgroup, the whole clone).
    pub placement: (&'static str, f64),
    pub init_pid: i32,
    pub init_start: u64,
    pub cgroup: Cgroup,
    /// Id of the writable layer (a dir under `<state>/snaplayers`).
    pub upper: String,
}

/// Directory of snapshot and writable layers.
pub fn snaplayers_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("snaplayers")
}

/// Path of a layer of a chain: `sl-v*` ids are volume layers, other `sl-*` ids snapshot/writable
/// layers, the rest image layers.
pub fn layer_dir(cfg: &RuntimeConfig, images: &bb_layers::ImageStore, id: &str) -> PathBuf {
    if id.starts_with(crate::volumes::volfs::LAYER_PREFIX) {
        crate::volumes::volfs::layers_dir(&cfg.state_dir).join(id)
    } else if id.starts_with("sl-") {
        snaplayers_dir(&cfg.state_dir).join(id)
    } else {
        images.layer_path(id)
    }
}

/// A fresh writable layer `<state>/snaplayers/sl-<hex>` (owned by the sandbox root, 0755) and the
/// overlay work dir `<sandbox dir>/work-<n>` for it. Returns (layer id, upper, work).
pub fn new_upper(cfg: &RuntimeConfig, dirs: &SandboxDirs, n: u64) -> Result<(String, PathBuf, PathBuf)> {
    use std::os::unix::fs::PermissionsExt;
    let id = format!("sl-{}", uuid::Uuid::new_v4().simple());
    let upper = snaplayers_dir(&cfg.state_dir).join(&id);
    std::fs::create_dir_all(snaplayers_dir(&cfg.state_dir)).map_err(|e| io("create layer dir", e))?;
    std::fs::create_dir(&upper).map_err(|e| io("create writable layer", e))?;
    let base = cfg.idmap.host_base;
    std::os::unix::fs::chown(&upper, Some(base), Some(base)).map_err(|e| io("chown writable layer", e))?;
    std::fs::set_permissions(&upper, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| io("chmod writable layer", e))?;
    let work = dirs.dir.join(format!("work-{n}"));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir(&work).map_err(|e| io("create overlay work dir", e))?;
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o700)).map_err(|e| io("chmod work dir", e))?;
    Ok((id, upper, work))
}

pub fn limits(spec: &SandboxSpec) -> Limits {
    Limits {
        memory_bytes: Some(spec.memory_mb * 1024 * 1024),
        cpu_millis: Some((spec.cpu * 1000.0).round() as u32),
        pids: Some(spec.pids),
    }
}

/// Undo what a failed launch did, in reverse order.
struct Rollback<'a> {
    dirs: &'a SandboxDirs,
    mounted: bool,
    cgroup: Option<Cgroup>,
    pid: Option<i32>,
    upper: Option<PathBuf>,
    armed: bool,
}

impl Drop for Rollback<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(pid) = self.pid {
            // Our own child: reaped once it is gone.
            let _ = bb_sys::process::kill(pid, libc::SIGKILL);
            bb_sys::process::reap_child(pid, std::time::Duration::from_secs(5));
        }
        if let Some(cg) = self.cgroup.take() {
            let _ = cg.destroy();
        }
        if self.mounted {
            let _ = bb_layers::unmount(&self.dirs.rootfs());
        }
        let _ = std::fs::remove_dir_all(&self.dirs.dir);
        if let Some(u) = &self.upper {
            let _ = std::fs::remove_dir_all(u);
        }
    }
}

/// Starting or tearing down a sandbox failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{what}: {source}")]
    Step {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("sandbox init failed: {status}{log}")]
    InitFailed { status: String, log: String },
    #[error("sandbox init did not report ready within {0}s")]
    NotReady(u64),
    #[error("sandbox init exited right after start")]
    InitExited,
    #[error("init binary path contains NUL")]
    BadInitPath,
    #[error("the parent sandbox's init could not start the fork: {0}")]
    NestRefused(String),
    #[error("nested init: no pidfd in the answer")]
    NoPidfd,
}

/// A failed step of a launch or teardown, with its cause.
fn io(what: &'static str, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> RuntimeError {
    LaunchError::Step { what, source: e.into() }.into()
}

/// The sandbox's state dir: logs dir, owned by the sandbox's host uid, mode 0700.
fn prepare_dir(cfg: &RuntimeConfig, dirs: &SandboxDirs) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dirs.logs()).map_err(|e| io("create sandbox dir", e))?;
    let uid = cfg.idmap.host_base;
    std::os::unix::fs::chown(&dirs.dir, Some(uid), Some(uid)).map_err(|e| io("chown sandbox dir", e))?;
    std::fs::set_permissions(&dirs.dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| io("chmod sandbox dir", e))
}

/// Init's listening control socket, bound at `<dir>/control.sock`.
fn control_socket(dirs: &SandboxDirs) -> Result<OwnedFd> {
    let listener = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| io("control socket", e))?;
    let addr = UnixAddr::new(&dirs.sock()).map_err(|e| io("control socket path", e))?;
    bind(listener.as_raw_fd(), &addr).map_err(|e| io("bind control socket", e))?;
    listen(&listener, Backlog::new(256).expect("valid backlog")).map_err(|e| io("listen", e))?;
    Ok(listener)
}

fn init_log(dirs: &SandboxDirs) -> Result<std::fs::File> {
    std::fs::OpenOptions::new().create(true).append(true).open(dirs.init_log()).map_err(|e| io("init log", e))
}

fn init_config(
    cfg: &RuntimeConfig,
    id: &str,
    spec: &SandboxSpec,
    rootfs: &Path,
    nested: bool,
    cgroupns: bool,
) -> InitConfig {
    InitConfig {
        rootfs: rootfs.to_string_lossy().into_owned(),
        hostname: id.to_string(),
        // Init brings up loopback only; egress is wired by the daemon from outside (`crate::net`).
        network: "none".into(),
        shm_bytes: (spec.memory_mb * 1024 * 1024 / 2).max(1 << 20),
        setns_key: cfg.setns_key,
        nested,
        cgroupns,
        // A nested sandbox's /proc comes from its parent: it shares the parent's boot id.
        boot_id: (!nested).then(fresh_boot_id),
    }
}

/// The working directory exists from the start (created like Docker's WORKDIR when missing).
pub(crate) fn make_cwd(cfg: &RuntimeConfig, spec: &SandboxSpec, rootfs: &Path) -> Result<()> {
    let cwd = crate::sandbox::files::SbPath::parse(&spec.cwd)?;
    crate::sandbox::files::SandboxFs::open(rootfs, cfg.idmap.host_base)?.mkdir(&cwd, true).map(drop)
}

/// Wait for init's `ok` on its status pipe; on anything else, the error with the log's tail.
fn wait_ready(status_r: OwnedFd, dirs: &SandboxDirs) -> Result<()> {
    let status = read_status(status_r, Duration::from_secs(20))?;
    if status.trim() == "ok" {
        return Ok(());
    }
    let log = std::fs::read_to_string(dirs.init_log()).unwrap_or_default();
    let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
    Err(LaunchError::InitFailed {
        status: status.trim().to_string(),
        log: if tail.is_empty() { String::new() } else { format!(" (init log: {tail})") },
    }
    .into())
}

pub fn launch(
    cfg: &RuntimeConfig,
    layout: &CgroupLayout,
    id: &str,
    spec: &SandboxSpec,
    layer_paths: &[PathBuf],
) -> Result<Launched> {
    let t0 = std::time::Instant::now();
    let dirs = SandboxDirs::new(&cfg.state_dir, id);
    let mut rb = Rollback { dirs: &dirs, mounted: false, cgroup: None, pid: None, upper: None, armed: true };
    prepare_dir(cfg, &dirs)?;
    let (upper_id, upper, work) = new_upper(cfg, &dirs, 0)?;
    rb.upper = Some(upper.clone());
    let rootfs = dirs.rootfs();
    std::fs::create_dir_all(&rootfs).map_err(|e| io("create rootfs dir", e))?;
    // overlay wants the top-most lower layer first.
    let lower: Vec<PathBuf> = layer_paths.iter().rev().cloned().collect();
    bb_layers::mount_overlay(&bb_layers::OverlaySpec { lower: &lower, upper: &upper, work: &work }, &rootfs)
        .map_err(|e| io("mount root filesystem", e))?;
    rb.mounted = true;
    make_cwd(cfg, spec, &rootfs)?;
    let t_mount = t0.elapsed();

    let cgroup = Cgroup::create(layout, id, &limits(spec))?;
    let cgroup_fd = cgroup.dir_fd()?;
    rb.cgroup = Some(cgroup);
    let t_cgroup = t0.elapsed();

    let listener = control_socket(&dirs)?;
    let (status_r, status_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| io("pipe", e))?;
    let devnull = std::fs::File::open("/dev/null").map_err(|e| io("/dev/null", e))?;
    let log = init_log(&dirs)?;
    // cgroup v1: init is moved into its cgroup after clone and makes its cgroup namespace then.
    let v1 = layout.version() == CgroupVersion::V1;
    let config = init_config(cfg, id, spec, &rootfs, false, v1);
    let program = CString::new(cfg.init_bin.as_os_str().as_encoded_bytes()).map_err(|_| LaunchError::BadInitPath)?;
    let argv = [CString::new("branchbox-init").expect("no NUL")];
    let envp = [CString::new(format!(
        "{}={}",
        bb_proto::INIT_CONFIG_ENV,
        serde_json::to_string(&config).expect("config serializes")
    ))
    .map_err(|_| RuntimeError::BadRequest("sandbox settings contain a NUL byte".into()))?];
    let fds = [
        (devnull.as_raw_fd(), 0),
        (log.as_raw_fd(), 1),
        (log.as_raw_fd(), 2),
        (listener.as_raw_fd(), bb_proto::INIT_LISTEN_FD),
        (status_w.as_raw_fd(), bb_proto::INIT_STATUS_FD),
    ];
    let t_spawn = std::time::Instant::now();
    let child = spawn_paused(&NsSpawn {
        program: &program,
        argv: &argv,
        envp: &envp,
        fds: &fds,
        namespaces: if v1 { NAMESPACES & !(libc::CLONE_NEWCGROUP as u64) } else { NAMESPACES },
        cgroup_fd: cgroup_fd.as_ref().map(|f| f.as_raw_fd()),
        become_root: true,
    })?;
    let pid = child.pid;
    rb.pid = Some(pid);
    drop(status_w);
    drop(listener);

    let map = format!("0 {} {}\n", cfg.idmap.host_base, cfg.idmap.size);
    std::fs::write(format!("/proc/{pid}/uid_map"), &map).map_err(|e| io("write uid_map", e))?;
    std::fs::write(format!("/proc/{pid}/gid_map"), &map).map_err(|e| io("write gid_map", e))?;
    let cgroup = rb.cgroup.as_ref().expect("set above");
    let placement = if layout.version() == CgroupVersion::V1 {
        let t = std::time::Instant::now();
        cgroup.add_pid(pid)?;
        ("migrate", t.elapsed().as_secs_f64() * 1000.0)
    } else {
        ("clone_into_cgroup", t_spawn.elapsed().as_secs_f64() * 1000.0)
    };
    child.release()?;
    let t_clone = t0.elapsed();

    wait_ready(status_r, &dirs)?;
    let init_start = bb_sys::process::process_start_time(pid).ok_or(LaunchError::InitExited)?;
    rb.armed = false;
    tracing::debug!(%id, ?t_mount, ?t_cgroup, ?t_clone, ready = ?t0.elapsed(), "sandbox launched");
    let cgroup = rb.cgroup.take().expect("set above");
    Ok(Launched { placement, init_pid: pid, init_start, cgroup, upper: upper_id })
}

/// Start a sandbox *nested* in the user and pid namespaces of the sandbox whose init listens on
/// `parent_sock`: a fork child, into which the parent's session templates can then be forked
/// (see `crate::session::fork`). The parent's init starts the new init (`Request::Nest`), which
/// makes its own namespaces below the parent's; the root (`layer_paths` + a fresh writable layer)
/// is handed to it as a detached mount, and a second mount of the same overlay is attached at the
/// usual host path for the file API.
pub fn launch_nested(
    cfg: &RuntimeConfig,
    layout: &CgroupLayout,
    id: &str,
    spec: &SandboxSpec,
    layer_paths: &[PathBuf],
    parent_sock: &Path,
) -> Result<Launched> {
    let t0 = std::time::Instant::now();
    let dirs = SandboxDirs::new(&cfg.state_dir, id);
    let mut rb = Rollback { dirs: &dirs, mounted: false, cgroup: None, pid: None, upper: None, armed: true };
    prepare_dir(cfg, &dirs)?;
    let (upper_id, upper, work) = new_upper(cfg, &dirs, 0)?;
    rb.upper = Some(upper.clone());
    let rootfs = dirs.rootfs();
    std::fs::create_dir_all(&rootfs).map_err(|e| io("create rootfs dir", e))?;
    let lower: Vec<PathBuf> = layer_paths.iter().rev().cloned().collect();
    let mnt = bb_layers::overlay_fd(&bb_layers::OverlaySpec { lower: &lower, upper: &upper, work: &work }, &rootfs)
        .map_err(RuntimeError::from)?;
    let host_view =
        bb_sys::ns::open_tree(mnt.as_fd(), Path::new(""), bb_sys::ns::OPEN_TREE_CLONE | bb_sys::ns::OPEN_TREE_CLOEXEC)
            .map_err(|e| io("clone root mount", e))?;
    crate::sandbox::rootswap::attach_host_root(&rootfs, host_view)?;
    rb.mounted = true;
    make_cwd(cfg, spec, &rootfs)?;

    let cgroup = Cgroup::create(layout, id, &limits(spec))?;
    let procs = cgroup.procs_files()?;
    rb.cgroup = Some(cgroup);

    let listener = control_socket(&dirs)?;
    let (status_r, status_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| io("pipe", e))?;
    let log = init_log(&dirs)?;
    let config = init_config(cfg, id, spec, Path::new(""), true, false);
    let mut fds = vec![listener.as_raw_fd(), status_w.as_raw_fd(), mnt.as_raw_fd(), log.as_raw_fd()];
    fds.extend(procs.iter().map(|f| f.as_raw_fd()));
    let t_prepared = t0.elapsed();
    let (resp, mut got) = crate::initconn::call_blocking(
        parent_sock,
        &bb_proto::Request::Nest { config },
        &fds,
        Duration::from_secs(20),
    )?;
    drop((status_w, listener, mnt, procs));
    match resp {
        bb_proto::Response::Nested { .. } => {}
        bb_proto::Response::Error { message, .. } => return Err(LaunchError::NestRefused(message).into()),
        other => return Err(crate::initconn::unexpected(other)),
    }
    let pidfd = got.pop().ok_or(LaunchError::NoPidfd)?;
    let pid = bb_sys::process::pidfd_pid(&pidfd).map_err(|e| io("pid of nested init", e))?;
    rb.pid = Some(pid);
    let t_nested = t0.elapsed();
    wait_ready(status_r, &dirs)?;
    let init_start = bb_sys::process::process_start_time(pid).ok_or(LaunchError::InitExited)?;
    rb.armed = false;
    tracing::debug!(%id, ?t_prepared, ?t_nested, ready = ?t0.elapsed(), "nested sandbox launched");
    let cgroup = rb.cgroup.take().expect("set above");
    Ok(Launched { placement: ("migrate_by_parent_init", 0.0), init_pid: pid, init_start, cgroup, upper: upper_id })
}

fn read_status(fd: OwnedFd, timeout: Duration) -> Result<String> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(LaunchError::NotReady(timeout.as_secs()).into());
        }
        let mut pfd = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        let ms = PollTimeout::try_from(left.as_millis().min(60_000) as i32).unwrap_or(PollTimeout::MAX);
        match poll(&mut pfd, ms) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(io("poll status pipe", e)),
        }
        let mut buf = [0u8; 512];
        match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
            Ok(0) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                if out.ends_with(b"\n") {
                    break;
                }
            }
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(io("read status pipe", e)),
        }
    }
    if out.is_empty() {
        return Ok("error: init exited before reporting".into());
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Tear down every host-side trace of a sandbox: processes (via its cgroup), the root mount, the
/// state directory. Safe to call on a half-built or already-removed sandbox.
pub fn teardown(cfg: &RuntimeConfig, layout: &CgroupLayout, id: &str, init: Option<(i32, u64)>) -> Result<()> {
    let mut killed = false;
    if let Some((pid, start)) = init {
        if bb_sys::process::process_start_time(pid) == Some(start) {
            // The start time matches, so this is still our sandbox's init.
            let _ = bb_sys::process::kill(pid, libc::SIGKILL);
            killed = true;
        }
    }
    match Cgroup::open(layout, id) {
        Ok(cg) => cg.destroy()?,
        Err(bb_isolation::IsolationError::NotFound { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    if let Some((pid, _)) = init {
        // Reap init if it is our child (after a daemon restart it is not: ECHILD). It leaves
        // its cgroup before it becomes a zombie, so an emptied cgroup does not mean it can be
        // reaped yet: wait for the one we killed, do not block on a pid we did not.
        let wait = if killed { std::time::Duration::from_secs(5) } else { std::time::Duration::ZERO };
        bb_sys::process::reap_child(pid, wait);
    }
    remove_host_side(cfg, id)
}

/// Unmount a sandbox's host-side roots and delete its state directory (not its processes or
/// cgroup).
pub fn remove_host_side(cfg: &RuntimeConfig, id: &str) -> Result<()> {
    let dirs = SandboxDirs::new(&cfg.state_dir, id);
    for r in dirs.rootfs_all() {
        bb_layers::unmount(&r).map_err(|e| io("unmount root filesystem", e))?;
    }
    // Move the directory aside first so a slow delete never blocks a new sandbox with the same id.
    let trash = cfg.state_dir.join("trash").join(format!("{id}-{}", uuid::Uuid::new_v4().simple()));
    if dirs.dir.exists() {
        std::fs::create_dir_all(cfg.state_dir.join("trash")).map_err(|e| io("trash dir", e))?;
        std::fs::rename(&dirs.dir, &trash).map_err(|e| io("move sandbox dir", e))?;
        std::fs::remove_dir_all(&trash).map_err(|e| io("remove sandbox dir", e))?;
    }
    Ok(())
}
