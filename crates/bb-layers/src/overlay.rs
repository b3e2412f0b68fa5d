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

use crate::{io_err, IdMap, LayersError};
use bb_sys::mount_api::{
    fs_context_messages, fsconfig_create, fsconfig_set_string, fsmount, fsopen, move_mount_to, FSMOUNT_CLOEXEC,
    FSOPEN_CLOEXEC, MOUNT_ATTR_NOATIME, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY,
};
use bb_sys::SysError;
use nix::unistd::{chown, Gid, Uid};
use std::fs;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The overlay options set on every mount (besides the layer dirs), in order.
pub const OVERLAY_OPTIONS: &[(&str, &str)] = &[
    ("index", "off"),
    ("metacopy", "off"),
    ("xino", "off"),
    ("redirect_dir", "on"),
];

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
        LayersError::Mount {
            step,
            target: self.target.to_path_buf(),
            source,
            detail,
        }
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
/// escaped `lowerdir` string instead. Errors name the failing step and carry the kernel's reason.
pub fn mount_overlay(spec: &OverlaySpec, target: &Path) -> Result<(), LayersError> {
    mount_overlay_with(spec, target, false)
}

/// Build `overlay(spec)` as a *detached* mount (fsmount without move_mount) and return its fd.
/// The caller attaches it wherever it wants (`move_mount`, possibly in another mount namespace)
/// or clones it (`open_tree`). `name` only appears in error messages.
pub fn overlay_fd(spec: &OverlaySpec, name: &Path) -> Result<OwnedFd, LayersError> {
    let ctx = Ctx { target: name };
    let fs = create_context(&ctx, spec.lower, Some((spec.upper, spec.work)), false)?;
    fsmount(fs.as_fd(), FSMOUNT_CLOEXEC, MOUNT_ATTR_NODEV).map_err(|e| ctx.err("fsmount", Some(&fs), e))
}

/// `legacy_lowerdir`: skip `lowerdir+` and pass one escaped `lowerdir` string (what happens
/// automatically on kernels without `lowerdir+`).
fn mount_overlay_with(spec: &OverlaySpec, target: &Path, legacy_lowerdir: bool) -> Result<(), LayersError> {
    let ctx = Ctx { target };
    let fs = create_context(&ctx, spec.lower, Some((spec.upper, spec.work)), legacy_lowerdir)?;
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
    let fs = create_context(&ctx, lower, None, false)?;
    fsmount(
        fs.as_fd(),
        FSMOUNT_CLOEXEC,
        MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NOEXEC | MOUNT_ATTR_NOATIME,
    )
    .map_err(|e| ctx.err("fsmount", Some(&fs), e))
}

/// An overlay filesystem context with `lower` (TOP-most first), optional `(upper, work)` and
/// [`OVERLAY_OPTIONS`], after `FSCONFIG_CMD_CREATE`.
fn create_context(
    ctx: &Ctx,
    lower: &[PathBuf],
    upper_work: Option<(&Path, &Path)>,
    legacy_lowerdir: bool,
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
    for (i, l) in lower.iter().enumerate() {
        let res = if legacy_lowerdir {
            Err(SysError {
                call: "fsconfig",
                source: std::io::Error::from_raw_os_error(libc::EINVAL),
            })
        } else {
            fsconfig_set_string(fs.as_fd(), "lowerdir+", l)
        };
        let Err(e) = res else { continue };
        if i == 0 && e.errno() == libc::EINVAL {
            let msgs = fs_context_messages(fs.as_fd());
            if legacy_lowerdir || msgs.iter().any(|m| m.contains("Unknown parameter")) {
                tracing::debug!("overlay has no lowerdir+ (kernel < 6.8), using one lowerdir string");
                fs = ctx.open()?;
                let joined: Vec<String> = lower.iter().map(|p| escape_lowerdir(p)).collect();
                fsconfig_set_string(fs.as_fd(), "lowerdir", joined.join(":"))
                    .map_err(|e| ctx.err("fsconfig(lowerdir)", Some(&fs), e))?;
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
    if let Some((upper, work)) = upper_work {
        fsconfig_set_string(fs.as_fd(), "upperdir", upper)
            .map_err(|e| ctx.err_for("fsconfig(upperdir)", Some(upper), Some(&fs), e))?;
        fsconfig_set_string(fs.as_fd(), "workdir", work)
            .map_err(|e| ctx.err_for("fsconfig(workdir)", Some(work), Some(&fs), e))?;
    }
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
        Err(e) => Err(LayersError::Unmount {
            target: target.to_path_buf(),
            source: e,
        }),
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
        assert_eq!(
            escape_lowerdir(Path::new("/s/layers/sha256:ab")),
            "/s/layers/sha256\\:ab"
        );
        assert_eq!(escape_lowerdir(Path::new("/x\\y,z")), "/x\\\\y\\,z");
    }

    #[test]
    fn legacy_lowerdir_string_handles_colons() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test mounts an overlay; run the tests as root"
        );
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
        mount_overlay_with(
            &OverlaySpec {
                lower: &[l2, l1],
                upper: &upper,
                work: &work,
            },
            &target,
            true,
        )
        .unwrap();
        let f = fs::read_to_string(target.join("f"));
        let g = fs::read_to_string(target.join("g"));
        unmount(&target).unwrap();
        assert_eq!(f.unwrap(), "2");
        assert_eq!(g.unwrap(), "1");
    }

    #[test]
    fn reflink_false_for_missing_dir() {
        assert!(!supports_reflink(Path::new("/nonexistent/branchbox-reflink-probe")));
    }
}
