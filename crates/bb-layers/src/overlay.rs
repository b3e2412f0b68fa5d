//! Overlay mounts of a layer stack, with the new mount API.
//!
//! Options: `index=off,metacopy=off,xino=off,redirect_dir=on`, chosen so that a sandbox's upper
//! dir can later be frozen and stacked as a *lower* layer of another overlay (snapshots):
//! * `metacopy=off`: every copy-up carries its data, so an upper never holds metadata-only files
//!   that would need the original lower to be readable.
//! * `index=off`: no inode index tied to this particular mount's upper/work; the upper is a
//!   self-contained directory tree.
//! * `redirect_dir=on`: renaming a merged directory records `trusted.overlay.redirect` in the
//!   upper instead of failing with EXDEV (which makes `mv dir` copy everything). A frozen upper
//!   used as a middle lower layer still resolves the redirect against the layers below it, as
//!   long as the same layers stay below it (tested in `tests/overlay.rs`).
//! * `xino=off`: all layers live on one filesystem, so inode numbers are already unique; no
//!   high-bit inode encoding that would differ between mounts.
//!
//! The mount gets `MOUNT_ATTR_NODEV` (layers never contain device nodes; sandboxes get /dev
//! mounted separately).
//!
//! **Layer names.** overlayfs shows the name each dir was given in the mount's options, and
//! every process that sees the mount reads them in `/proc/self/mountinfo`: a sandbox would learn
//! the host's state-dir paths from its own root. So each dir is given as `.`, with the calling
//! thread's cwd moved into it for that `fsconfig` (the kernel resolves the name right away and
//! keeps it only for display), and the thread's cwd is put back after. That needs a thread with
//! its own cwd: on first use the calling thread unshares its fs context (`unshare(CLONE_FS)`:
//! cwd, root and umask become its own copies; the daemon never changes them after start-up).
//! Alternatives that were tried: an fd given with `FSCONFIG_SET_FD` is shown as the dir's full
//! path as the mounting process sees it; `/proc/thread-self/fd/<n>` names show nothing either
//! but cost an open and a procfs lookup per dir, several times the path lookup `.` replaces.
//! Kernels without `lowerdir+` (< 6.8) get the lower layers as one string of paths (upper and
//! work dirs still `.`), and a thread that cannot unshare names every dir by its path; both are
//! logged once.

use crate::{io_err, IdMap, LayersError};
use bb_sys::mount_api::{
    fs_context_messages, fsconfig_create, fsconfig_set_string, fsmount, fsopen, move_mount_to, FSMOUNT_CLOEXEC,
    FSOPEN_CLOEXEC, MOUNT_ATTR_NOATIME, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY,
};
use bb_sys::SysError;
use nix::unistd::{chown, Gid, Uid};
use std::cell::OnceCell;
use std::ffi::OsStr;
use std::fs;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// The overlay options set on every mount (besides the layer dirs), in order.
pub const OVERLAY_OPTIONS: &[(&str, &str)] =
    &[("index", "off"), ("metacopy", "off"), ("xino", "off"), ("redirect_dir", "on")];

/// Layer dirs of one overlay mount.
#[derive(Debug, Clone, Copy)]
pub struct OverlaySpec<'a> {
    /// Read-only layers, TOP-most first (overlay's lowerdir order; an [`crate::Image`] lists its
    /// layers bottom first, so reverse them).
    pub lower: &'a [PathBuf],
    /// Writable dir, owned by the sandbox root (see [`new_writable`]).
    pub upper: &'a Path,
    /// Overlay's scratch dir; same filesystem as `upper`, empty at first mount.
    pub work: &'a Path,
}

/// Escape a path for overlay's legacy colon-separated `lowerdir` option.
pub(crate) fn escape_lowerdir(p: &Path) -> String {
    let s = p.to_string_lossy();
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c == '\\' || c == ':' || c == ',' {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// How layer dirs are named to the kernel (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LayerNames {
    /// `.`, from inside the dir: nothing of the host in mountinfo.
    Cwd,
    /// The dirs' own paths, shown as they are.
    Paths,
}

thread_local! {
    /// The thread's cwd (`O_PATH`) once it has unshared its fs context, for naming by `.`;
    /// `None` if it could not unshare.
    static HOME: OnceCell<Option<OwnedFd>> = const { OnceCell::new() };
}

impl LayerNames {
    /// [`LayerNames::Cwd`] if the calling thread has (or can get) a cwd of its own.
    fn detect() -> LayerNames {
        static WARNED: AtomicBool = AtomicBool::new(false);
        let own = HOME.with(|home| {
            home.get_or_init(|| {
                let res = bb_sys::ns::unshare(libc::CLONE_FS).map_err(|e| e.to_string()).and_then(|()| {
                    fs::OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
                        .open(".")
                        .map(OwnedFd::from)
                        .map_err(|e| format!("open(\".\"): {e}"))
                });
                res.map_err(|e| {
                    if !WARNED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "{e}: overlay mounts name their layer dirs by host path, which sandboxes can read in \
                             /proc/self/mountinfo (a seccomp policy that refuses unshare(CLONE_FS)?)"
                        );
                    }
                })
                .ok()
            })
            .is_some()
        });
        if own {
            LayerNames::Cwd
        } else {
            LayerNames::Paths
        }
    }
}

/// Names dirs for one filesystem context; with [`LayerNames::Cwd`] it moves the thread's cwd
/// ([`Naming::name`]) and puts it back when dropped.
struct Naming {
    names: LayerNames,
}

impl Naming {
    /// The name to give the kernel for `dir` in the `fsconfig` about to be made (as `step`).
    fn name<'p>(&self, ctx: &Ctx, step: &'static str, dir: &'p Path) -> Result<&'p OsStr, LayersError> {
        match self.names {
            LayerNames::Paths => Ok(dir.as_os_str()),
            LayerNames::Cwd => {
                // A relative dir is relative to the thread's cwd, not to the dir named before.
                if dir.is_relative() {
                    go_home().map_err(|e| ctx.err_for(step, Some(dir), None, e))?;
                }
                std::env::set_current_dir(dir)
                    .map_err(|source| ctx.err_for(step, Some(dir), None, SysError { call: "chdir", source }))?;
                Ok(OsStr::new("."))
            }
        }
    }
}

impl Drop for Naming {
    fn drop(&mut self) {
        if self.names != LayerNames::Cwd {
            return;
        }
        if let Err(e) = go_home() {
            // Only this thread's cwd is affected, and the daemon resolves no relative path.
            tracing::error!("cannot return to the working directory after an overlay mount: {e}");
        }
    }
}

/// Put the calling thread's cwd back to what it was before [`Naming`] moved it.
fn go_home() -> Result<(), SysError> {
    HOME.with(|home| match home.get() {
        Some(Some(home)) => bb_sys::ns::fchdir(home.as_fd()),
        _ => Ok(()),
    })
}

struct Ctx<'a> {
    target: &'a Path,
}

impl Ctx<'_> {
    fn err(&self, step: &'static str, fs: Option<&OwnedFd>, source: SysError) -> LayersError {
        self.err_for(step, None, fs, source)
    }

    /// `value`: the path being configured when the step failed (the kernel often says nothing).
    fn err_for(&self, step: &'static str, value: Option<&Path>, fs: Option<&OwnedFd>, source: SysError) -> LayersError {
        let mut detail = String::new();
        if let Some(v) = value {
            detail.push_str(&format!(" (for {})", v.display()));
        }
        if let Some(fs) = fs {
            let msgs = fs_context_messages(fs.as_fd());
            if !msgs.is_empty() {
                detail.push_str("; kernel says: ");
                detail.push_str(&msgs.join(" | "));
            }
        }
        detail.push_str(match step {
            "fsopen(overlay)" => "; the kernel needs overlayfs (`modprobe overlay`) and the caller CAP_SYS_ADMIN",
            "move_mount" => "; the target must be an existing directory",
            _ => "; every lower, upper and work dir must exist, upper and work on the same filesystem, and that filesystem must support trusted.* xattrs (ext4, xfs, btrfs)",
        });
        LayersError::Mount { step, target: self.target.to_path_buf(), source, detail }
    }

    fn open(&self) -> Result<OwnedFd, LayersError> {
        let fs = fsopen("overlay", FSOPEN_CLOEXEC).map_err(|e| self.err("fsopen(overlay)", None, e))?;
        fsconfig_set_string(fs.as_fd(), "source", "branchbox")
            .map_err(|e| self.err("fsconfig(source)", Some(&fs), e))?;
        Ok(fs)
    }
}

/// Mount `overlay(spec)` on `target` with fsopen/fsconfig/fsmount/move_mount. Layers are passed
/// one by one with `lowerdir+` (no length limit, no escaping); kernels without it (< 6.8) get one
/// escaped `lowerdir` string instead. Dirs are named so that the mount's options show no host
/// path, which gives the calling thread a cwd of its own (see the module doc). Errors name the
/// failing step and carry the kernel's reason.
pub fn mount_overlay(spec: &OverlaySpec, target: &Path) -> Result<(), LayersError> {
    mount_overlay_with(spec, target, false)
}

/// Build `overlay(spec)` as a *detached* mount (fsmount without move_mount) and return its fd.
/// The caller attaches it wherever it wants (`move_mount`, possibly in another mount namespace)
/// or clones it (`open_tree`). `name` only appears in error messages. Named like
/// [`mount_overlay`]'s dirs.
pub fn overlay_fd(spec: &OverlaySpec, name: &Path) -> Result<OwnedFd, LayersError> {
    overlay_fd_named(spec, name, LayerNames::Cwd)
}

fn overlay_fd_named(spec: &OverlaySpec, name: &Path, names: LayerNames) -> Result<OwnedFd, LayersError> {
    let ctx = Ctx { target: name };
    let fs = create_context(&ctx, spec.lower, Some((spec.upper, spec.work)), false, names)?;
    fsmount(fs.as_fd(), FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV).map_err(|e| ctx.err("fsmount", Some(&fs), e))
}

/// `legacy_lowerdir`: skip `lowerdir+` and pass one escaped `lowerdir` string (what happens
/// automatically on kernels without `lowerdir+`).
fn mount_overlay_with(spec: &OverlaySpec, target: &Path, legacy_lowerdir: bool) -> Result<(), LayersError> {
    let ctx = Ctx { target };
    let fs = create_context(&ctx, spec.lower, Some((spec.upper, spec.work)), legacy_lowerdir, LayerNames::Cwd)?;
    let mnt = fsmount(fs.as_fd(), FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV).map_err(|e| ctx.err("fsmount", Some(&fs), e))?;
    move_mount_to(mnt.as_fd(), target).map_err(|e| ctx.err("move_mount", None, e))?;
    Ok(())
}

/// A read-only `overlay(lower)` (no upper/work, same options as [`mount_overlay`]) as a *detached*
/// mount: the returned fd is the mount's root, never attached anywhere, so no other process can
/// see it and it disappears when the fd (and everything opened below it) is closed, even if the
/// process dies. Mount flags: `ro,nodev,nosuid,noexec,noatime`. `what` names it in errors.
pub(crate) fn mount_detached_readonly(lower: &[PathBuf], what: &Path) -> Result<OwnedFd, LayersError> {
    let ctx = Ctx { target: what };
    let fs = create_context(&ctx, lower, None, false, LayerNames::Cwd)?;
    fsmount(
        fs.as_fd(),
        FSMOUNT_CLOEXEC,
        MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC | MOUNT_ATTR_NOATIME,
    )
    .map_err(|e| ctx.err("fsmount", Some(&fs), e))
}

/// Whether overlayfs takes `lowerdir+` (Linux 6.8); cleared by the first mount that finds it
/// missing, which logs it.
static LOWERDIR_PLUS: AtomicBool = AtomicBool::new(true);

/// An overlay filesystem context with `lower` (TOP-most first), optional `(upper, work)` and
/// [`OVERLAY_OPTIONS`], after `FSCONFIG_CMD_CREATE`. Dirs are named as `names` says
/// ([`LayerNames::Cwd`] where the thread can have its own cwd, see [`LayerNames::detect`]).
/// `legacy_lowerdir`: pass the lower dirs as one `lowerdir` string of paths, as on kernels
/// without `lowerdir+`.
fn create_context(
    ctx: &Ctx,
    lower: &[PathBuf],
    upper_work: Option<(&Path, &Path)>,
    legacy_lowerdir: bool,
    names: LayerNames,
) -> Result<OwnedFd, LayersError> {
    if lower.is_empty() {
        return Err(ctx.err(
            "fsconfig(lowerdir+)",
            None,
            SysError {
                call: "fsconfig",
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no lower layers given"),
            },
        ));
    }
    let mut fs = ctx.open()?;
    // Cwd needs the thread's own fs context: detect() makes sure of it.
    let naming = Naming { names: if names == LayerNames::Cwd { LayerNames::detect() } else { names } };
    let mut legacy = legacy_lowerdir || !LOWERDIR_PLUS.load(Ordering::Relaxed);
    if !legacy {
        for (i, l) in lower.iter().enumerate() {
            let name = naming.name(ctx, "fsconfig(lowerdir+)", l)?;
            let Err(e) = fsconfig_set_string(fs.as_fd(), "lowerdir+", name) else { continue };
            if i == 0 && e.errno() == libc::EINVAL {
                let msgs = fs_context_messages(fs.as_fd());
                if msgs.iter().any(|m| m.contains("Unknown parameter")) {
                    if LOWERDIR_PLUS.swap(false, Ordering::Relaxed) {
                        tracing::warn!(
                            "overlayfs has no lowerdir+ (Linux < 6.8): lower layers are given as one lowerdir string \
                             of paths, which sandboxes can read in /proc/self/mountinfo"
                        );
                    }
                    fs = ctx.open()?;
                    legacy = true;
                    break;
                }
                let mut err = ctx.err_for("fsconfig(lowerdir+)", Some(l), None, e);
                if let LayersError::Mount { detail, .. } = &mut err {
                    if !msgs.is_empty() {
                        *detail = format!("; kernel says: {}{detail}", msgs.join(" | "));
                    }
                }
                return Err(err);
            }
            return Err(ctx.err_for("fsconfig(lowerdir+)", Some(l), Some(&fs), e));
        }
    }
    if legacy {
        let joined: Vec<String> = lower.iter().map(|p| escape_lowerdir(p)).collect();
        fsconfig_set_string(fs.as_fd(), "lowerdir", joined.join(":"))
            .map_err(|e| ctx.err("fsconfig(lowerdir)", Some(&fs), e))?;
    }
    if let Some((upper, work)) = upper_work {
        let name = naming.name(ctx, "fsconfig(upperdir)", upper)?;
        fsconfig_set_string(fs.as_fd(), "upperdir", name)
            .map_err(|e| ctx.err_for("fsconfig(upperdir)", Some(upper), Some(&fs), e))?;
        let name = naming.name(ctx, "fsconfig(workdir)", work)?;
        fsconfig_set_string(fs.as_fd(), "workdir", name)
            .map_err(|e| ctx.err_for("fsconfig(workdir)", Some(work), Some(&fs), e))?;
    }
    drop(naming);
    for (k, v) in OVERLAY_OPTIONS {
        fsconfig_set_string(fs.as_fd(), k, v).map_err(|e| ctx.err("fsconfig(options)", Some(&fs), e))?;
    }
    fsconfig_create(fs.as_fd()).map_err(|e| ctx.err("fsconfig(FSCONFIG_CMD_CREATE)", Some(&fs), e))?;
    Ok(fs)
}

/// Lazily unmount `target` (`umount2(MNT_DETACH)`). Ok if nothing is mounted there.
pub fn unmount(target: &Path) -> Result<(), LayersError> {
    match nix::mount::umount2(target, nix::mount::MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => Ok(()),
        Err(e) => Err(LayersError::Unmount { target: target.to_path_buf(), source: e }),
    }
}

/// Create `dir/upper` (owned by the sandbox root, `host_base:host_base`, mode 0755) and `dir/work`
/// (root, 0700) for a new overlay. `dir` is created if missing; an existing non-empty `upper` is
/// an error. Returns `(upper, work)`.
pub fn new_writable(dir: &Path, idmap: &IdMap) -> Result<(PathBuf, PathBuf), LayersError> {
    let upper = dir.join("upper");
    let work = dir.join("work");
    fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    match fs::create_dir(&upper) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let mut rd = fs::read_dir(&upper).map_err(io_err(format!("reading {}", upper.display())))?;
            if rd.next().is_some() {
                return Err(LayersError::NotEmpty { path: upper });
            }
        }
        Err(e) => return Err(LayersError::io(format!("creating {}", upper.display()), e)),
    }
    let base = idmap.host_base;
    chown(&upper, Some(Uid::from_raw(base)), Some(Gid::from_raw(base)))
        .map_err(|e| LayersError::io(format!("chown {}", upper.display()), e.into()))?;
    fs::set_permissions(&upper, fs::Permissions::from_mode(0o755))
        .map_err(io_err(format!("chmod {}", upper.display())))?;
    fs::create_dir_all(&work).map_err(io_err(format!("creating {}", work.display())))?;
    fs::set_permissions(&work, fs::Permissions::from_mode(0o700))
        .map_err(io_err(format!("chmod {}", work.display())))?;
    Ok((upper, work))
}

/// Whether the filesystem holding `dir` can reflink (`FICLONE` between two fresh unnamed files in
/// `dir` succeeds). False on any error, including a missing `dir`.
pub fn supports_reflink(dir: &Path) -> bool {
    let try_clone = || -> std::io::Result<bool> {
        let mut src = tempfile::tempfile_in(dir)?;
        src.write_all(&[0x5a; 4096])?;
        src.flush()?;
        let dst = tempfile::tempfile_in(dir)?;
        Ok(bb_sys::mount_api::ficlone(dst.as_fd(), src.as_fd()).is_ok())
    };
    try_clone().unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowerdir_escaping() {
        assert_eq!(escape_lowerdir(Path::new("/a/b")), "/a/b");
        assert_eq!(escape_lowerdir(Path::new("/s/layers/sha256:ab")), "/s/layers/sha256\\:ab");
        assert_eq!(escape_lowerdir(Path::new("/x\\y,z")), "/x\\\\y\\,z");
    }

    #[test]
    fn legacy_lowerdir_string_handles_colons() {
        assert!(nix::unistd::geteuid().is_root(), "this test mounts an overlay; run the tests as root");
        let d = tempfile::tempdir().unwrap();
        // Layer dirs are named like `sha256:<hex>`: the colon must be escaped in `lowerdir`.
        let l1 = d.path().join("layers/sha256:aa");
        let l2 = d.path().join("layers/sha256:bb,x");
        fs::create_dir_all(&l1).unwrap();
        fs::create_dir_all(&l2).unwrap();
        fs::write(l1.join("f"), "1").unwrap();
        fs::write(l1.join("g"), "1").unwrap();
        fs::write(l2.join("f"), "2").unwrap();
        let (upper, work) = new_writable(&d.path().join("rw"), &IdMap::default()).unwrap();
        let target = d.path().join("merged");
        fs::create_dir(&target).unwrap();
        mount_overlay_with(&OverlaySpec { lower: &[l2, l1], upper: &upper, work: &work }, &target, true).unwrap();
        let f = fs::read_to_string(target.join("f"));
        let g = fs::read_to_string(target.join("g"));
        let opts = super_options(&target);
        unmount(&target).unwrap();
        assert_eq!(f.unwrap(), "2");
        assert_eq!(g.unwrap(), "1");
        // The lower dirs by path (escaped), the upper and work dirs still by `.`.
        assert!(opts.contains(r"sha256\134:aa"), "{opts}");
        assert!(opts.contains(",upperdir=.,workdir=.,"), "{opts}");
    }

    /// The super options of the mountinfo line whose mount point is `target`.
    fn super_options(target: &Path) -> String {
        let mi = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let line = mi.lines().find(|l| l.split(' ').nth(4) == Some(target.to_str().unwrap())).expect("mounted");
        line.split_once(" - ").unwrap().1.splitn(3, ' ').nth(2).unwrap().to_string()
    }

    /// Two layers, an upper and a work dir under `dir`, like a state dir's.
    fn stack(dir: &Path, layers: usize) -> (Vec<PathBuf>, PathBuf, PathBuf) {
        let lower: Vec<PathBuf> = (0..layers).map(|i| dir.join(format!("layers/sha256:{i:064x}"))).collect();
        for (i, l) in lower.iter().enumerate() {
            fs::create_dir_all(l).unwrap();
            fs::write(l.join(format!("f{i}")), "x").unwrap();
        }
        let (upper, work) = new_writable(&dir.join("sandboxes/s"), &IdMap::default()).unwrap();
        (lower, upper, work)
    }

    /// Both ways of naming the dirs mount the same stack; only `.` names hide the paths, and the
    /// thread's cwd is where it was after.
    #[test]
    fn layer_names_cwd_hides_paths_and_paths_show_them() {
        assert!(nix::unistd::geteuid().is_root(), "this test mounts an overlay; run the tests as root");
        assert_eq!(LayerNames::detect(), LayerNames::Cwd, "a test thread can unshare its fs context");
        let cwd = std::env::current_dir().unwrap();
        let d = tempfile::tempdir().unwrap();
        let (lower, upper, work) = stack(d.path(), 2);
        let spec = OverlaySpec { lower: &lower, upper: &upper, work: &work };
        let target = d.path().join("merged");
        fs::create_dir(&target).unwrap();
        for names in [LayerNames::Cwd, LayerNames::Paths] {
            let mnt = overlay_fd_named(&spec, &target, names).unwrap();
            move_mount_to(mnt.as_fd(), &target).unwrap();
            let opts = super_options(&target);
            let seen = fs::read_dir(&target).map(|r| r.count());
            unmount(&target).unwrap();
            assert_eq!(seen.unwrap(), 2);
            let shows_path = opts.contains(d.path().to_str().unwrap());
            assert_eq!(shows_path, names == LayerNames::Paths, "{names:?}: {opts}");
            assert_eq!(std::env::current_dir().unwrap(), cwd, "{names:?} moved the thread's cwd");
        }
    }

    /// Relative dirs mean relative to the thread's cwd, for every dir of the stack.
    #[test]
    fn relative_dirs_resolve_from_the_threads_cwd() {
        assert!(nix::unistd::geteuid().is_root(), "this test mounts an overlay; run the tests as root");
        let d = tempfile::tempdir().unwrap();
        let cwd = std::env::current_dir().unwrap();
        // Deeper than the cwd: from inside one layer, the relative path of the next one leads
        // nowhere (its `..`s do not climb to `/`).
        let deep = d.path().join("a/b/c/d/e/f/g/h/i/j");
        assert!(deep.components().count() > cwd.components().count() + 1);
        let (lower, upper, work) = stack(&deep, 2);
        // `../..` up to `/` from the cwd, then the absolute path without its leading `/`.
        let up: PathBuf = cwd.components().skip(1).map(|_| "..").collect();
        let rel = |p: &Path| up.join(p.strip_prefix("/").unwrap());
        let lower: Vec<PathBuf> = lower.iter().map(|p| rel(p)).collect();
        let (upper, work) = (rel(&upper), rel(&work));
        assert!(lower[0].is_relative() && upper.is_relative());
        let target = d.path().join("merged");
        fs::create_dir(&target).unwrap();
        let mnt = overlay_fd(&OverlaySpec { lower: &lower, upper: &upper, work: &work }, &target).unwrap();
        move_mount_to(mnt.as_fd(), &target).unwrap();
        let seen = fs::read_dir(&target).map(|r| r.count());
        let opts = super_options(&target);
        unmount(&target).unwrap();
        assert_eq!(seen.unwrap(), 2);
        assert!(opts.contains("lowerdir+=.,lowerdir+=.,upperdir=.,workdir=."), "{opts}");
        assert_eq!(std::env::current_dir().unwrap(), cwd);
    }

    /// Cost of overlay_fd with `.` names against paths, same run, alternating (`cargo test -p
    /// bb-layers --lib -- --ignored --nocapture mount_cost`).
    #[test]
    #[ignore = "a measurement, prints numbers"]
    fn mount_cost_cwd_names_against_paths() {
        const ROUNDS: usize = 400;
        // Where a daemon's state dir is, so paths are walked as far as in real use.
        let d = tempfile::tempdir_in("/var/lib").unwrap();
        for layers in [2, 30] {
            let dir = d.path().join(format!("n{layers}"));
            let (lower, _, _) = stack(&dir, layers);
            // A fresh writable layer per mount, as each sandbox has.
            let rw: Vec<(PathBuf, PathBuf)> = (0..ROUNDS)
                .map(|i| new_writable(&dir.join(format!("sandboxes/{i}")), &IdMap::default()).unwrap())
                .collect();
            let mut took: [Vec<std::time::Duration>; 2] = [Vec::new(), Vec::new()];
            for (round, (upper, work)) in rw.iter().enumerate() {
                let spec = OverlaySpec { lower: &lower, upper, work };
                let (i, names) = if round % 2 == 0 { (0, LayerNames::Paths) } else { (1, LayerNames::Cwd) };
                let t = std::time::Instant::now();
                let mnt = overlay_fd_named(&spec, &dir, names).unwrap();
                took[i].push(t.elapsed());
                drop(mnt);
            }
            let [paths, cwd] = took.map(|mut v| {
                v.sort();
                (v[v.len() / 2], v.iter().sum::<std::time::Duration>() / v.len() as u32)
            });
            println!(
                "{layers:2} layers, {} mounts each: paths median {:?} mean {:?}, `.` names median {:?} mean {:?}",
                rw.len() / 2,
                paths.0,
                paths.1,
                cwd.0,
                cwd.1
            );
        }
    }
}
