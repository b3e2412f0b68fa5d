//! Mount namespace, /proc, /dev, /sys, pivot_root: everything init does once, before serving.

use bb_proto::InitConfig;
use nix::mount::{mount, MsFlags};
use std::fs;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("{what} ({path}): {source}")]
    Mount { what: &'static str, path: String, source: nix::Error },
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error(transparent)]
    Sys(#[from] bb_sys::SysError),
}

fn m(
    what: &'static str,
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), SetupError> {
    mount(src, target, fstype, flags, data).map_err(|source| SetupError::Mount {
        what,
        path: target.display().to_string(),
        source,
    })
}

fn io<T>(what: impl Into<String>, r: std::io::Result<T>) -> Result<T, SetupError> {
    r.map_err(|source| SetupError::Io { what: what.into(), source })
}

const NOSUID_NODEV_NOEXEC: MsFlags = MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV).union(MsFlags::MS_NOEXEC);

/// Paths of /proc that stay read-only (as in Docker's default).
const PROC_READONLY: &[&str] = &["bus", "fs", "irq", "sys", "sysrq-trigger"];
/// Paths hidden behind /dev/null (files) or an empty read-only tmpfs (directories).
const MASKED: &[&str] = &[
    "proc/acpi",
    "proc/asound",
    "proc/kcore",
    "proc/keys",
    "proc/latency_stats",
    "proc/timer_list",
    "proc/timer_stats",
    "proc/sched_debug",
    "proc/scsi",
    "sys/firmware",
    "sys/fs/cgroup",
    "sys/kernel/debug",
    "sys/kernel/security",
];
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// `proc_mnt`: a procfs mount to use as /proc (a nested sandbox's, made by its parent init)
/// instead of mounting one.
pub fn setup(config: &InitConfig, proc_mnt: Option<std::os::fd::OwnedFd>) -> Result<(), SetupError> {
    if config.cgroupns {
        // In its cgroup by now: the namespace is rooted there.
        bb_sys::ns::unshare(libc::CLONE_NEWCGROUP)?;
    }
    let root = PathBuf::from(&config.rootfs);
    // Nothing we mount may propagate back to the host.
    m("make / private", None, Path::new("/"), None, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None)?;
    // A mount made by the host is locked in our user namespace: bind it to get one we own.
    m("bind root", Some(&root), &root, None, MsFlags::MS_BIND | MsFlags::MS_REC, None)?;

    let proc_dir = root.join("proc");
    io("mkdir /proc", fs::create_dir_all(&proc_dir))?;
    match proc_mnt {
        None => m("mount /proc", Some(Path::new("proc")), &proc_dir, Some("proc"), NOSUID_NODEV_NOEXEC, None)?,
        Some(fd) => bb_sys::ns::move_mount(
            Some(std::os::fd::AsFd::as_fd(&fd)),
            Path::new(""),
            None,
            &proc_dir,
            bb_sys::ns::MOVE_MOUNT_F_EMPTY_PATH,
        )?,
    }
    for p in PROC_READONLY {
        let path = proc_dir.join(p);
        if path.exists() {
            readonly_bind(&path)?;
        }
    }

    setup_dev(&root, config)?;
    if let Some(id) = &config.boot_id {
        boot_id(&root, &proc_dir, id)?;
    }

    let sys_dir = root.join("sys");
    io("mkdir /sys", fs::create_dir_all(&sys_dir))?;
    let sys_flags = NOSUID_NODEV_NOEXEC | MsFlags::MS_RDONLY;
    if mount(Some("sysfs"), &sys_dir, Some("sysfs"), sys_flags, None::<&str>).is_err() {
        m("bind /sys", Some(Path::new("/sys")), &sys_dir, None, MsFlags::MS_BIND | MsFlags::MS_REC, None)?;
        readonly_bind(&sys_dir)?;
    }
    for p in MASKED {
        mask(&root.join(p), &root)?;
    }

    io("chdir new root", std::env::set_current_dir(&root))?;
    bb_sys::process::pivot_root_here()?;
    io("chdir /", std::env::set_current_dir("/"))?;
    nix::unistd::sethostname(&config.hostname).map_err(|source| SetupError::Mount {
        what: "sethostname",
        path: config.hostname.clone(),
        source,
    })?;
    match config.network.as_str() {
        "none" => bb_sys::process::loopback_up()?,
        other => {
            return Err(SetupError::Io {
                what: format!("network mode {other:?}"),
                source: std::io::Error::from(std::io::ErrorKind::Unsupported),
            })
        }
    }
    Ok(())
}

/// A fresh sysfs on /sys (masked as at setup): sysfs shows the network devices of the namespace
/// that mounted it, so after a move to a new network namespace the old one would list the old
/// namespace's devices. Made detached first: if sysfs cannot be mounted (setup then bound the
/// host's), the old /sys stays.
fn remount_sys() -> Result<(), SetupError> {
    use bb_sys::mount_api as api;
    use std::os::fd::AsFd;
    let fresh = api::fsopen("sysfs", api::FSOPEN_CLOEXEC).and_then(|fs| {
        api::fsconfig_create(fs.as_fd())?;
        let attrs = api::MOUNT_ATTR_RDONLY | api::MOUNT_ATTR_NOSUID | api::MOUNT_ATTR_NODEV | api::MOUNT_ATTR_NOEXEC;
        api::fsmount(fs.as_fd(), api::FSMOUNT_CLOEXEC, attrs)
    });
    let Ok(mnt) = fresh else { return Ok(()) };
    let sys = Path::new("/sys");
    nix::mount::umount2(sys, nix::mount::MntFlags::MNT_DETACH).map_err(|source| SetupError::Mount {
        what: "unmount /sys",
        path: "/sys".into(),
        source,
    })?;
    api::move_mount_to(mnt.as_fd(), sys)?;
    for p in MASKED.iter().filter(|p| p.starts_with("sys/")) {
        mask(&Path::new("/").join(p), Path::new("/"))?;
    }
    Ok(())
}

/// The sandbox's own boot id: a file of the sandbox's /dev (a tmpfs of its own), bound
/// read-only over `/proc/sys/kernel/random/boot_id`. Init keeps it open at
/// [`bb_proto::INIT_BOOT_ID_FD`] (close on exec) for the daemon to rewrite. (The file stays in
/// /dev: CRIU refuses to dump processes of a mount namespace holding a bind mount whose
/// filesystem has no mount of its root there.)
fn boot_id(root: &Path, proc_dir: &Path, id: &str) -> Result<(), SetupError> {
    use std::io::Write;
    use std::os::fd::{AsRawFd, IntoRawFd};
    use std::os::unix::fs::OpenOptionsExt;
    let file = root.join(bb_proto::BOOT_ID_FILE.trim_start_matches('/'));
    let mut f = io(
        "create boot id",
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o444)
            .custom_flags(libc::O_CLOEXEC)
            .open(&file),
    )?;
    io("write boot id", f.write_all(format!("{id}\n").as_bytes()))?;
    let target = proc_dir.join("sys/kernel/random/boot_id");
    m("bind boot id", Some(&file), &target, None, MsFlags::MS_BIND, None)?;
    let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC;
    m("remount boot id read-only", None, &target, None, flags, None)?;
    if f.as_raw_fd() == bb_proto::INIT_BOOT_ID_FD {
        // Kept open for init's life.
        let _ = f.into_raw_fd();
    } else {
        bb_sys::process::dup_cloexec_to(f.as_raw_fd(), bb_proto::INIT_BOOT_ID_FD)?;
    }
    Ok(())
}

fn readonly_bind(path: &Path) -> Result<(), SetupError> {
    m("bind read-only", Some(path), path, None, MsFlags::MS_BIND | MsFlags::MS_REC, None)?;
    // Locked flags of the underlying mount must be repeated on remount inside a user namespace.
    let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC;
    m("remount read-only", None, path, None, flags, None)
}

fn mask(path: &Path, root: &Path) -> Result<(), SetupError> {
    let Ok(meta) = fs::symlink_metadata(path) else { return Ok(()) };
    if meta.is_dir() {
        let flags = MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC;
        m("mask dir", Some(Path::new("tmpfs")), path, Some("tmpfs"), flags, Some("size=0,mode=0555"))
    } else {
        m("mask file", Some(&root.join("dev/null")), path, None, MsFlags::MS_BIND, None)
    }
}

fn setup_dev(root: &Path, config: &InitConfig) -> Result<(), SetupError> {
    let dev = root.join("dev");
    io("mkdir /dev", fs::create_dir_all(&dev))?;
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
    m("mount /dev", Some(Path::new("tmpfs")), &dev, Some("tmpfs"), flags, Some("mode=0755,size=1m"))?;
    for name in DEVICES {
        let target = dev.join(name);
        io(format!("create /dev/{name}"), fs::File::create(&target))?;
        let src = Path::new("/dev").join(name);
        m("bind device", Some(&src), &target, None, MsFlags::MS_BIND, None)?;
    }
    let pts = dev.join("pts");
    io("mkdir /dev/pts", fs::create_dir(&pts))?;
    m(
        "mount /dev/pts",
        Some(Path::new("devpts")),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    let shm = dev.join("shm");
    io("mkdir /dev/shm", fs::create_dir(&shm))?;
    let shm_opts = format!("mode=1777,size={}", config.shm_bytes);
    m("mount /dev/shm", Some(Path::new("tmpfs")), &shm, Some("tmpfs"), NOSUID_NODEV_NOEXEC, Some(&shm_opts))?;
    for (link, target) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        io(format!("symlink /dev/{link}"), std::os::unix::fs::symlink(target, dev.join(link)))?;
    }
    Ok(())
}

/// The namespace and mount part of a reset for reuse by another tenant (see
/// `bb_proto::Request::Reset`): fresh network and IPC namespaces for every process started from
/// now on (init's own move with it), loopback up, a fresh /dev/shm, the new hostname; with
/// `cgroupns`, a cgroup namespace rooted in the cgroup init was just moved to.
pub fn reset(hostname: &str, shm_bytes: u64, cgroupns: bool) -> Result<(), SetupError> {
    let cgroup = if cgroupns { libc::CLONE_NEWCGROUP } else { 0 };
    bb_sys::ns::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWIPC | cgroup)?;
    bb_sys::process::loopback_up()?;
    remount_sys()?;
    let shm = Path::new("/dev/shm");
    nix::mount::umount2(shm, nix::mount::MntFlags::MNT_DETACH).map_err(|source| SetupError::Mount {
        what: "unmount /dev/shm",
        path: "/dev/shm".into(),
        source,
    })?;
    let shm_opts = format!("mode=1777,size={shm_bytes}");
    m("mount /dev/shm", Some(Path::new("tmpfs")), shm, Some("tmpfs"), NOSUID_NODEV_NOEXEC, Some(&shm_opts))?;
    nix::unistd::sethostname(hostname).map_err(|source| SetupError::Mount {
        what: "sethostname",
        path: hostname.into(),
        source,
    })
}
