//! Flattening (compaction) of a layer chain: merge several read-only layers into one equivalent
//! layer.
//!
//! Sandboxes stack snapshot layers (frozen overlay upper dirs) on top of their image, so a chain
//! grows with every checkpoint. [`flatten`] replaces the bottom `k` layers of a chain by one:
//!
//! 1. `overlay(lower = layers)` is mounted read-only (same options as [`crate::mount_overlay`],
//!    no upper/work) as a *detached* mount (`fsmount` without `move_mount`): it is visible in no
//!    mount namespace, nothing else can use or pin it, and it vanishes when its fd is closed, also
//!    when the process dies, so there is never a stale mount to clean up.
//! 2. The merged tree is copied into a temp sibling of `dest` (`.<name>.flatten-<hex>`), all
//!    operations relative to directory fds (`openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` and
//!    `*at` calls that never follow symlinks), then `syncfs` and an atomic `rename` to `dest`.
//!
//! The merged view contains no overlay markers (whiteouts, opaque dirs and redirects are resolved
//! by the kernel), and it has the same paths as the chain, so layers stacked above still resolve
//! their own whiteouts, opaque dirs and (absolute or relative) redirects the same way against
//! `dest` as against the original layers.
//!
//! Preserved per entry: type (regular, dir, symlink, fifo, char/block device; sockets are skipped),
//! mode including setuid/setgid/sticky, uid/gid, atime and mtime (ns), every xattr except
//! `trusted.overlay.*` (e.g. `user.*`, `security.capability`, ACLs), and hard-link groups (names
//! of one merged inode become links of one new inode).
//!
//! Regular-file data: the merged view's files are overlay inodes, which cannot be reflinked (and
//! `copy_file_range` refuses them across filesystems). So each file is matched to the real file in
//! the layer that provides it, by replaying overlay's lookup (per-dir layer stack, whiteouts,
//! opaque dirs, redirects), and the match is only used when its inode number, size and mtime
//! equal the merged file's (overlay reports the real inode number when all layers share one
//! filesystem). That real file is cloned with `FICLONE` where the filesystem can (btrfs, XFS with
//! reflink), otherwise copied with `std::io::copy`, which uses `copy_file_range` (in-kernel
//! copy), then `sendfile`, then read/write. Files without a match are copied from the merged view.

use crate::fsutil::{random_hex, remove_tree};
use crate::overlay::mount_detached_readonly;
use crate::{io_err, LayersError};
use bb_sys::mount_api::{
    ficlone, openat2, RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_NO_XDEV,
};
use nix::errno::Errno;
use nix::fcntl::{readlinkat, AtFlags};
use nix::sys::stat::{
    fchmod, fchmodat, fstat, fstatat, futimens, mkdirat, mknodat, utimensat, FchmodatFlags, FileStat, Mode, SFlag,
    UtimensatFlags,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{fchown, fchownat, linkat, symlinkat, Gid, Uid};
use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::os::fd::{AsFd, AsRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use xattr::FileExt;

const RESOLVE_STRICT: u64 = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
const OVERLAY_XATTR_PREFIX: &[u8] = b"trusted.overlay.";
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
const REDIRECT_XATTR: &str = "trusted.overlay.redirect";

/// What [`flatten`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlattenStats {
    /// Non-directory names written: regular files, symlinks, fifos, devices, hard links included.
    pub files: u64,
    /// Directories, the root included.
    pub dirs: u64,
    /// Regular-file data, each inode once.
    pub bytes: u64,
    /// Every non-empty regular file shares its extents with the source layers (`FICLONE`), and
    /// there was at least one.
    pub reflinked: bool,
    /// Non-empty regular files cloned with `FICLONE`.
    pub reflinked_files: u64,
    /// Non-empty regular files whose data was copied (`copy_file_range` or read/write).
    pub copied_files: u64,
    /// Names linked to an inode already written (counted in `files` too).
    pub hardlinks: u64,
    /// Sockets in the merged view (not copied: they are meaningless without their process).
    pub skipped_sockets: u64,
    /// [`flatten_onto`]: names left to the base (not written: the base shows the same).
    pub from_base: u64,
    /// [`flatten_onto`]: whiteouts written (names of the base the merged view does not show).
    pub whiteouts: u64,
    /// [`flatten_onto`]: directories marked opaque (they hide the base's entry at their path).
    pub opaque_dirs: u64,
    pub duration: Duration,
}

/// Merge `layers` (TOP-most first, like [`crate::OverlaySpec::lower`]) into one new layer `dest`,
/// such that `overlay(lower = [dest])` shows exactly what `overlay(lower = layers)` shows, and
/// layers stacked above `layers` read the same when stacked above `dest` instead.
///
/// `dest` must not exist or be an empty directory; its parent must exist and should be on the
/// same filesystem as the layers (for reflinks; copying works anywhere). The layers are only read.
/// Nothing appears at `dest` until the whole tree is written and synced (`syncfs`); on error the
/// temp dir is removed. Ownership is copied verbatim (layers already hold host ids), so no
/// [`crate::IdMap`] is needed. Needs root (mount, chown, mknod, `trusted.*` xattrs).
pub fn flatten(layers: &[PathBuf], dest: &Path) -> Result<FlattenStats, LayersError> {
    flatten_onto(layers, &[], dest)
}

/// Merge `layers` (TOP-most first) into one new layer `dest` that holds only what `layers` change
/// on top of `base` (TOP-most first, e.g. an image's layers): `overlay(lower = [dest] + base)`
/// shows exactly what `overlay(lower = layers + base)` shows, and layers stacked above read the
/// same over either. This is compaction of a snapshot chain without copying its image.
///
/// Walks the merged view like [`flatten`], but:
/// * a directory whose lower stack is made of base layers only, at its own path, is not written
///   (the base shows the same), nor a non-directory that a base layer provides at its own path;
/// * a name the base shows in a written directory and the merged view does not gets a whiteout;
/// * a written directory that does not merge with the base's directory at its path (opaque or
///   renamed in `layers`, or new over a base non-directory) is marked opaque and written whole,
///   with everything below it.
///
/// Only what can be shown to come from the base is left out: when in doubt an entry is written,
/// which is always correct. One approximation: a base file with several hard links of which
/// some names are written (e.g. below a directory renamed from the base) and others left to the
/// base becomes two inodes with the same content. With an empty `base` this is [`flatten`].
pub fn flatten_onto(layers: &[PathBuf], base: &[PathBuf], dest: &Path) -> Result<FlattenStats, LayersError> {
    let start = Instant::now();
    if layers.is_empty() {
        return Err(LayersError::InvalidOption {
            field: "flatten layers",
            value: "[]".into(),
            hint: "pass at least one layer directory (top-most first)",
        });
    }
    check_dest(dest)?;
    let name = dest.file_name().ok_or_else(|| LayersError::InvalidOption {
        field: "flatten destination",
        value: dest.display().to_string(),
        hint: "pass a path ending in a directory name, e.g. <state>/layers/local:<hex>",
    })?;
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent_real =
        fs::canonicalize(parent).map_err(io_err(format!("flatten: resolving the parent of {}", dest.display())))?;
    for l in layers.iter().chain(base) {
        let real = fs::canonicalize(l).map_err(io_err(format!("flatten: layer {}", l.display())))?;
        if parent_real.starts_with(&real) {
            return Err(LayersError::InvalidOption {
                field: "flatten destination",
                value: dest.display().to_string(),
                hint: "the destination must not be inside one of the layers being flattened",
            });
        }
    }

    let mut tmp_name = OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".flatten-{}", random_hex(6)?));
    let tmp_path = parent.join(&tmp_name);
    let mut tmp = TempTree(vec![tmp_path.clone()]);
    fs::create_dir(&tmp_path).map_err(io_err(format!("flatten: creating {}", tmp_path.display())))?;

    // Overlay needs two lower layers when there is no upper: an empty one at the bottom changes
    // nothing in the merged view.
    let mut empty = None;
    let mut view = |lower: Vec<PathBuf>, what: &str| -> Result<OwnedFd, LayersError> {
        let mut lower = lower;
        if lower.len() == 1 {
            if empty.is_none() {
                let mut n = tmp_name.clone();
                n.push("-empty");
                let e = parent.join(n);
                tmp.0.push(e.clone());
                fs::create_dir(&e).map_err(io_err(format!("flatten: creating {}", e.display())))?;
                empty = Some(e);
            }
            lower.extend(empty.clone());
        }
        let what = PathBuf::from(format!("<private read-only overlay of {} {what}>", lower.len()));
        mount_detached_readonly(&lower, &what)
    };
    let mnt = view(layers.iter().chain(base).cloned().collect(), "layers")?;
    let base_mnt = if base.is_empty() { None } else { Some(view(base.to_vec(), "base layers")?) };
    let mut stats = {
        let mut c = Copier::new(mnt, base_mnt, layers, base, &tmp_path)?;
        c.run()?;
        // Sync while the fds are open: data and metadata are durable before the name appears.
        nix::unistd::syncfs(c.dst_root.as_raw_fd())
            .map_err(|e| LayersError::io(format!("flatten: syncfs on {}", tmp_path.display()), e.into()))?;
        c.stats
        // The Copier (and with it the last reference to the detached mount) is dropped here.
    };

    fs::rename(&tmp_path, dest).map_err(|e| {
        let ctx = if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::EEXIST)) {
            format!("flatten: {} became non-empty while flattening; pass a fresh destination", dest.display())
        } else {
            format!("flatten: renaming {} to {}", tmp_path.display(), dest.display())
        };
        LayersError::io(ctx, e)
    })?;
    tmp.0.retain(|p| p != &tmp_path);
    drop(tmp); // removes the empty bottom layer, if any
    if let Ok(d) = File::open(parent) {
        let _ = d.sync_all();
    }
    stats.reflinked = stats.reflinked_files > 0 && stats.copied_files == 0;
    stats.duration = start.elapsed();
    tracing::info!(
        layers = layers.len(),
        dest = %dest.display(),
        files = stats.files,
        dirs = stats.dirs,
        bytes = stats.bytes,
        base = base.len(),
        from_base = stats.from_base,
        whiteouts = stats.whiteouts,
        reflinked = stats.reflinked,
        ms = stats.duration.as_millis() as u64,
        "flattened layers"
    );
    Ok(stats)
}

/// `dest` must be missing or an empty directory.
fn check_dest(dest: &Path) -> Result<(), LayersError> {
    match fs::symlink_metadata(dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(LayersError::io(format!("flatten: inspecting {}", dest.display()), e)),
        Ok(m) if !m.is_dir() => Err(LayersError::InvalidOption {
            field: "flatten destination",
            value: dest.display().to_string(),
            hint: "it exists and is not a directory; pass a path that does not exist yet (or an empty directory)",
        }),
        Ok(_) => {
            let mut rd = fs::read_dir(dest).map_err(io_err(format!("flatten: reading {}", dest.display())))?;
            if rd.next().is_some() {
                Err(LayersError::InvalidOption {
                    field: "flatten destination",
                    value: dest.display().to_string(),
                    hint: "it already exists and is not empty; pass a path that does not exist yet (or an empty directory)",
                })
            } else {
                Ok(())
            }
        }
    }
}

/// Temp dirs removed (with their contents) on drop.
struct TempTree(Vec<PathBuf>);

impl Drop for TempTree {
    fn drop(&mut self) {
        for p in &self.0 {
            if let Err(e) = remove_tree(p) {
                tracing::warn!(path = %p.display(), error = %e, "could not remove flatten temp dir");
            }
        }
    }
}

/// A directory of one layer that takes part in a merged directory: `path` relative to the root of
/// layer `layer` (index into the TOP-first layer list).
#[derive(Debug, Clone)]
struct Lower {
    layer: usize,
    path: PathBuf,
}

/// A merged directory still to copy (it already exists, empty, in the destination).
struct DirJob {
    rel: PathBuf,
    /// Overlay's lower stack for this directory, top first: where its files' data may come from.
    lowers: Vec<Lower>,
    /// [`flatten_onto`]: the directory merges with the base's directory at the same path, so
    /// only the differences are written. Otherwise it is written whole.
    over_base: bool,
}

struct Copier {
    /// Keeps the detached mount alive (`src_root` would too; explicit for clarity).
    _mnt: OwnedFd,
    src_root: OwnedFd,
    /// Root of the base's own merged view ([`flatten_onto`]), kept alive by this fd.
    base_root: Option<OwnedFd>,
    /// Layers `0..n_top` of `layer_roots` are being merged; the rest are the base.
    n_top: usize,
    dst_root: OwnedFd,
    dst_path: PathBuf,
    /// O_PATH fds of the layer roots, TOP first.
    layer_roots: Vec<OwnedFd>,
    /// Merged (dev, ino) of multiply-linked non-directories -> dest path of the first name.
    links: HashMap<(u64, u64), PathBuf>,
    /// Cleared after the first FICLONE the filesystem refuses.
    try_reflink: bool,
    stats: FlattenStats,
}

/// `openat2(dir, rel, flags, RESOLVE_STRICT)`, `rel` empty = `dir` itself.
fn open_beneath(dir: &OwnedFd, rel: &Path, flags: i32) -> Result<OwnedFd, Errno> {
    let p: &Path = if rel.as_os_str().is_empty() { Path::new(".") } else { rel };
    openat2(dir.as_fd(), p, flags, 0, RESOLVE_STRICT).map_err(|e| Errno::from_raw(e.errno()))
}

/// `/proc/self/fd/<dir>/<name>`: a path for the l*xattr calls on an entry that cannot be opened
/// for I/O (symlinks, fifos, devices), resolved through the directory fd, never a symlink.
fn proc_path(dir: RawFd, name: &OsStr) -> PathBuf {
    let mut p = PathBuf::from(format!("/proc/self/fd/{dir}"));
    p.push(name);
    p
}

fn is_overlay_xattr(name: &OsStr) -> bool {
    name.as_bytes().starts_with(OVERLAY_XATTR_PREFIX)
}

fn kind(st: &FileStat) -> libc::mode_t {
    st.st_mode & libc::S_IFMT
}

fn times(st: &FileStat) -> (TimeSpec, TimeSpec) {
    (TimeSpec::new(st.st_atime, st.st_atime_nsec), TimeSpec::new(st.st_mtime, st.st_mtime_nsec))
}

impl Copier {
    fn new(
        mnt: OwnedFd,
        base_mnt: Option<OwnedFd>,
        layers: &[PathBuf],
        base: &[PathBuf],
        dst: &Path,
    ) -> Result<Copier, LayersError> {
        let src_root = open_beneath(&mnt, Path::new(""), libc::O_RDONLY | libc::O_DIRECTORY)
            .map_err(|e| LayersError::io("flatten: opening the root of the merged view", e.into()))?;
        let base_root = match base_mnt {
            Some(m) => Some(
                open_beneath(&m, Path::new(""), libc::O_RDONLY | libc::O_DIRECTORY)
                    .map_err(|e| LayersError::io("flatten: opening the root of the base view", e.into()))?,
            ),
            None => None,
        };
        let dst_root = File::open(dst).map_err(io_err(format!("flatten: opening {}", dst.display())))?.into();
        let mut layer_roots = Vec::with_capacity(layers.len());
        for l in layers.iter().chain(base) {
            let f = File::open(l).map_err(io_err(format!("flatten: opening layer {}", l.display())))?;
            layer_roots.push(f.into());
        }
        Ok(Copier {
            _mnt: mnt,
            src_root,
            base_root,
            n_top: layers.len(),
            dst_root,
            dst_path: dst.to_path_buf(),
            layer_roots,
            links: HashMap::new(),
            try_reflink: true,
            stats: FlattenStats::default(),
        })
    }

    fn err(&self, what: &str, rel: &Path, e: Errno) -> LayersError {
        LayersError::io(format!("flatten into {}: {what} /{}", self.dst_path.display(), rel.display()), e.into())
    }

    fn ioerr(&self, what: &str, rel: &Path, e: std::io::Error) -> LayersError {
        LayersError::io(format!("flatten into {}: {what} /{}", self.dst_path.display(), rel.display()), e)
    }

    /// Copy the whole merged tree, depth first. Each directory is finished (entries created,
    /// then its own metadata and times set) before its subdirectories are filled, which never
    /// touches it again.
    fn run(&mut self) -> Result<(), LayersError> {
        let mut stack = vec![DirJob {
            rel: PathBuf::new(),
            lowers: (0..self.layer_roots.len()).map(|layer| Lower { layer, path: PathBuf::new() }).collect(),
            over_base: self.base_root.is_some(),
        }];
        while let Some(job) = stack.pop() {
            self.copy_dir(job, &mut stack)?;
        }
        Ok(())
    }

    fn copy_dir(&mut self, job: DirJob, stack: &mut Vec<DirJob>) -> Result<(), LayersError> {
        let rel = &job.rel;
        let dflags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
        let src = open_beneath(&self.src_root, rel, dflags).map_err(|e| self.err("opening", rel, e))?;
        let dst = open_beneath(&self.dst_root, rel, dflags).map_err(|e| self.err("opening (dest)", rel, e))?;
        // This directory's lower stack, as far as it can be opened (a gap only costs reflinks).
        let mut lower_fds: Vec<(usize, OwnedFd)> = Vec::with_capacity(job.lowers.len());
        for l in &job.lowers {
            match open_beneath(&self.layer_roots[l.layer], &l.path, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
            {
                Ok(fd) => lower_fds.push((l.layer, fd)),
                Err(_) => break,
            }
        }
        // Every layer of the stack opened: only then can an entry be known to come from the base.
        let stack_complete = lower_fds.len() == job.lowers.len();
        self.stats.dirs += 1;
        // The base's directory at this path (flatten_onto, when this one merges with it).
        let base_dir = match (&self.base_root, job.over_base) {
            (Some(b), true) => Some(open_beneath(b, rel, dflags).map_err(|e| self.err("opening (base)", rel, e))?),
            _ => None,
        };
        // Before listing it: reading a directory may update its atime.
        let dir_st = fstat(src.as_raw_fd()).map_err(|e| self.err("stat", rel, e))?;

        let names = read_names(&src).map_err(|e| self.err("listing", rel, e))?;
        for name in &names {
            let name = name.clone();
            let crel = rel.join(&name);
            let st = match fstatat(Some(src.as_raw_fd()), name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                // Overlay lists the whiteouts of a directory that only one layer has (nothing to
                // merge), but looking them up fails: they are not part of the view.
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(self.err("stat", &crel, e)),
            };
            let k = kind(&st);
            // What the base shows at this name (flatten_onto): its file type.
            let in_base = base_dir.as_ref().and_then(|b| {
                fstatat(Some(b.as_raw_fd()), name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW).ok().map(|s| kind(&s))
            });
            if k == libc::S_IFDIR {
                let lowers = self.child_lowers(&job.lowers, &name);
                let base_at_path = |l: &Lower| l.layer >= self.n_top && l.path == crel;
                if base_dir.is_some() && !lowers.is_empty() && lowers.iter().all(base_at_path) {
                    self.stats.from_base += 1; // no merged layer has it: the base shows the same
                    continue;
                }
                let over_base = in_base == Some(libc::S_IFDIR) && lowers.iter().any(base_at_path);
                mkdirat(Some(dst.as_raw_fd()), name.as_os_str(), Mode::from_bits_truncate(0o700))
                    .map_err(|e| self.err("mkdir", &crel, e))?;
                if in_base.is_some() && !over_base {
                    // Written whole: the base's entry at this path must not show through.
                    xattr::set(proc_path(dst.as_raw_fd(), &name), OPAQUE_XATTR, b"y")
                        .map_err(|e| self.ioerr("marking opaque", &crel, e))?;
                    self.stats.opaque_dirs += 1;
                }
                stack.push(DirJob { rel: crel, lowers, over_base });
                continue;
            }
            if k == libc::S_IFSOCK {
                tracing::debug!(path = %crel.display(), "flatten: skipping socket");
                self.stats.skipped_sockets += 1;
                continue;
            }
            if base_dir.is_some() && stack_complete && self.base_provides(&lower_fds, &name) {
                self.stats.from_base += 1;
                continue;
            }
            let key = (st.st_dev, st.st_ino);
            if st.st_nlink > 1 {
                if let Some(first) = self.links.get(&key) {
                    linkat(
                        Some(self.dst_root.as_raw_fd()),
                        first.as_path(),
                        Some(dst.as_raw_fd()),
                        Path::new(&name),
                        AtFlags::empty(),
                    )
                    .map_err(|e| self.err("hard-linking", &crel, e))?;
                    self.stats.files += 1;
                    self.stats.hardlinks += 1;
                    continue;
                }
            }
            match k {
                libc::S_IFREG => self.copy_file(&src, &dst, &name, &st, &crel, &lower_fds)?,
                libc::S_IFLNK => {
                    let target = readlinkat(Some(src.as_raw_fd()), name.as_os_str())
                        .map_err(|e| self.err("readlink", &crel, e))?;
                    symlinkat(target.as_os_str(), Some(dst.as_raw_fd()), name.as_os_str())
                        .map_err(|e| self.err("symlink", &crel, e))?;
                    self.set_meta_at(&src, &dst, &name, &st, &crel)?;
                }
                libc::S_IFIFO | libc::S_IFCHR | libc::S_IFBLK => {
                    let sflag = SFlag::from_bits_truncate(k);
                    mknodat(
                        Some(dst.as_raw_fd()),
                        name.as_os_str(),
                        sflag,
                        Mode::from_bits_truncate(0o600),
                        st.st_rdev,
                    )
                    .map_err(|e| self.err("mknod", &crel, e))?;
                    self.set_meta_at(&src, &dst, &name, &st, &crel)?;
                }
                _ => {
                    return Err(self.err("unknown file type of", &crel, Errno::EINVAL));
                }
            }
            self.stats.files += 1;
            if st.st_nlink > 1 {
                self.links.insert(key, crel);
            }
        }

        // Names the base shows here and the merged view does not: whiteouts hide them.
        if let Some(b) = &base_dir {
            let shown: std::collections::HashSet<&OsString> = names.iter().collect();
            for name in read_names(b).map_err(|e| self.err("listing (base)", rel, e))? {
                if shown.contains(&name)
                    || fstatat(Some(b.as_raw_fd()), name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW).is_err()
                {
                    continue; // in the view, or a whiteout the base lists but does not show
                }
                let crel = rel.join(&name);
                mknodat(Some(dst.as_raw_fd()), name.as_os_str(), SFlag::S_IFCHR, Mode::empty(), 0)
                    .map_err(|e| self.err("creating a whiteout for", &crel, e))?;
                self.stats.whiteouts += 1;
            }
        }

        // Entries are all in place: now the directory's own metadata and times.
        let xattrs = {
            let f = File::from(src.try_clone().map_err(|e| self.ioerr("dup", rel, e))?);
            self.read_xattrs_fd(&f, rel)?
        };
        self.set_meta_fd(&dst, &dir_st, &xattrs, rel)
    }

    /// Overlay's lookup of directory `name` below a merged directory with lower stack `parent`
    /// (`ovl_lookup` with `redirect_dir=on`): top to bottom, a whiteout or a non-directory ends the
    /// stack, an opaque directory is the last one taken, `trusted.overlay.redirect` renames the
    /// lookup (relative: the last path element; absolute: a path from the root of every layer
    /// below). Only used to find the real files behind the merged view for reflinks; a wrong guess
    /// is caught by the inode check in [`Copier::real_file`].
    fn child_lowers(&self, parent: &[Lower], name: &OsStr) -> Vec<Lower> {
        let mut out = Vec::new();
        // `rel_name`: name to look up in each parent lower dir; `abs`: path from the layer roots
        // once an absolute redirect was found (then every layer below is searched).
        let mut rel_name: OsString = name.to_os_string();
        let mut abs: Option<(PathBuf, usize)> = None;
        let mut i = 0;
        loop {
            let (layer, path) = match &mut abs {
                Some((p, next)) => {
                    if *next >= self.layer_roots.len() {
                        break;
                    }
                    *next += 1;
                    (*next - 1, p.clone())
                }
                None => {
                    let Some(l) = parent.get(i) else { break };
                    i += 1;
                    (l.layer, l.path.join(&rel_name))
                }
            };
            let fd = match open_beneath(&self.layer_roots[layer], &path, libc::O_PATH | libc::O_NOFOLLOW) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) => continue,
                Err(_) => break,
            };
            let Ok(st) = fstat(fd.as_raw_fd()) else { break };
            if kind(&st) != libc::S_IFDIR {
                break; // a whiteout or any non-directory hides the layers below
            }
            out.push(Lower { layer, path: path.clone() });
            let pp = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
            if xattr::get_deref(&pp, OPAQUE_XATTR).ok().flatten().as_deref() == Some(b"y") {
                break;
            }
            if let Ok(Some(r)) = xattr::get_deref(&pp, REDIRECT_XATTR) {
                let r = OsStr::from_bytes(&r);
                if let Some(stripped) = r.as_bytes().strip_prefix(b"/") {
                    abs = Some((PathBuf::from(OsStr::from_bytes(stripped)), layer + 1));
                } else if let Some((p, _)) = &mut abs {
                    *p = p.parent().unwrap_or(Path::new("")).join(r);
                } else {
                    rel_name = r.to_os_string();
                }
            }
        }
        out
    }

    /// Whether the non-directory `name` of a merged directory (whose whole lower stack is
    /// `lower_fds`) comes from a base layer: the first layer of the stack that has the name is a
    /// base layer. Any doubt (an error) says no, and the entry is written.
    fn base_provides(&self, lower_fds: &[(usize, OwnedFd)], name: &OsStr) -> bool {
        for (layer, dir) in lower_fds {
            match fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(_) => return *layer >= self.n_top,
                Err(Errno::ENOENT) => continue,
                Err(_) => return false,
            }
        }
        false
    }

    /// The file in the layers that the merged regular file `name` (stat `st`) shows: the first
    /// entry named `name` in the directory's lower stack, if it is a regular file with the same
    /// inode number, size and mtime.
    fn real_file(&self, lower_fds: &[(usize, OwnedFd)], name: &OsStr, st: &FileStat) -> Option<File> {
        for (_, dir) in lower_fds {
            let rst = match fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(s) => s,
                Err(Errno::ENOENT) => continue,
                Err(_) => return None,
            };
            let same = |a: &FileStat| {
                kind(a) == libc::S_IFREG
                    && a.st_ino == st.st_ino
                    && a.st_size == st.st_size
                    && (a.st_mtime, a.st_mtime_nsec) == (st.st_mtime, st.st_mtime_nsec)
            };
            if !same(&rst) {
                return None;
            }
            // O_NOATIME: reading must not change the layers (root may use it on any file).
            let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NOCTTY | libc::O_NOATIME;
            let f: File = open_beneath(dir, Path::new(name), flags).ok()?.into();
            return match fstat(f.as_raw_fd()) {
                Ok(s) if same(&s) => Some(f),
                _ => None,
            };
        }
        None
    }

    fn copy_file(
        &mut self,
        src_dir: &OwnedFd,
        dst_dir: &OwnedFd,
        name: &OsStr,
        st: &FileStat,
        rel: &Path,
        lower_fds: &[(usize, OwnedFd)],
    ) -> Result<(), LayersError> {
        let src: File = open_beneath(src_dir, Path::new(name), libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NOCTTY)
            .map_err(|e| self.err("opening", rel, e))?
            .into();
        let mut dst: File = openat2(
            dst_dir.as_fd(),
            Path::new(name),
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
            0o600,
            RESOLVE_STRICT,
        )
        .map_err(|e| self.err("creating", rel, Errno::from_raw(e.errno())))?
        .into();
        if st.st_size > 0 {
            let real = self.real_file(lower_fds, name, st);
            let mut cloned = false;
            if let (Some(r), true) = (&real, self.try_reflink) {
                match ficlone(dst.as_fd(), r.as_fd()) {
                    Ok(()) => cloned = true,
                    Err(e)
                        if matches!(
                            e.errno(),
                            libc::EOPNOTSUPP | libc::EINVAL | libc::ENOTTY | libc::EXDEV | libc::ENOSYS | libc::EPERM
                        ) =>
                    {
                        tracing::debug!(error = %e, "flatten: no reflinks on this filesystem, copying data");
                        self.try_reflink = false;
                    }
                    Err(e) => return Err(self.ioerr("cloning (FICLONE) data of", rel, e.source)),
                }
            }
            if cloned {
                self.stats.reflinked_files += 1;
            } else {
                // std's File-to-File copy: copy_file_range, then sendfile, then read/write.
                let n = match real {
                    Some(mut r) => std::io::copy(&mut r, &mut dst),
                    None => std::io::copy(&mut &src, &mut dst),
                }
                .map_err(|e| self.ioerr("copying data of", rel, e))?;
                if n != st.st_size as u64 {
                    return Err(self.ioerr(
                        "copying data of",
                        rel,
                        std::io::Error::other(format!("copied {n} bytes, expected {}", st.st_size)),
                    ));
                }
                self.stats.copied_files += 1;
            }
            self.stats.bytes += st.st_size as u64;
        }
        let xattrs = self.read_xattrs_fd(&src, rel)?;
        self.set_meta_fd(&dst.into(), st, &xattrs, rel)
    }

    fn read_xattrs_fd(&self, f: &File, rel: &Path) -> Result<Vec<(OsString, Vec<u8>)>, LayersError> {
        let mut out = Vec::new();
        let names = match f.list_xattr() {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(out),
            Err(e) => return Err(self.ioerr("listing xattrs of", rel, e)),
        };
        for n in names {
            if is_overlay_xattr(&n) {
                continue;
            }
            if let Some(v) = f.get_xattr(&n).map_err(|e| self.ioerr("reading xattrs of", rel, e))? {
                out.push((n, v));
            }
        }
        Ok(out)
    }

    fn read_xattrs_path(&self, p: &Path, rel: &Path) -> Result<Vec<(OsString, Vec<u8>)>, LayersError> {
        let mut out = Vec::new();
        let names = match xattr::list(p) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(out),
            Err(e) => return Err(self.ioerr("listing xattrs of", rel, e)),
        };
        for n in names {
            if is_overlay_xattr(&n) {
                continue;
            }
            if let Some(v) = xattr::get(p, &n).map_err(|e| self.ioerr("reading xattrs of", rel, e))? {
                out.push((n, v));
            }
        }
        Ok(out)
    }

    /// Owner, then xattrs (chown clears file capabilities; an ACL may rewrite the group bits),
    /// then mode (after chown, which clears setuid/setgid), then atime/mtime.
    fn set_meta_fd(
        &self,
        fd: &OwnedFd,
        st: &FileStat,
        xattrs: &[(OsString, Vec<u8>)],
        rel: &Path,
    ) -> Result<(), LayersError> {
        fchown(fd.as_raw_fd(), Some(Uid::from_raw(st.st_uid)), Some(Gid::from_raw(st.st_gid)))
            .map_err(|e| self.err("chown", rel, e))?;
        if !xattrs.is_empty() {
            let f = File::from(fd.try_clone().map_err(|e| self.ioerr("dup", rel, e))?);
            for (k, v) in xattrs {
                f.set_xattr(k, v)
                    .map_err(|e| self.ioerr(&format!("setting xattr {} on", k.to_string_lossy()), rel, e))?;
            }
        }
        fchmod(fd.as_raw_fd(), Mode::from_bits_truncate(st.st_mode & 0o7777)).map_err(|e| self.err("chmod", rel, e))?;
        let (a, m) = times(st);
        futimens(fd.as_raw_fd(), &a, &m).map_err(|e| self.err("setting times of", rel, e))
    }

    /// [`Copier::set_meta_fd`] for entries that cannot be opened (symlinks, fifos, devices).
    fn set_meta_at(
        &self,
        src_dir: &OwnedFd,
        dst_dir: &OwnedFd,
        name: &OsStr,
        st: &FileStat,
        rel: &Path,
    ) -> Result<(), LayersError> {
        let d = dst_dir.as_raw_fd();
        fchownat(
            Some(d),
            name,
            Some(Uid::from_raw(st.st_uid)),
            Some(Gid::from_raw(st.st_gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.err("chown", rel, e))?;
        let xattrs = self.read_xattrs_path(&proc_path(src_dir.as_raw_fd(), name), rel)?;
        let dp = proc_path(d, name);
        for (k, v) in &xattrs {
            xattr::set(&dp, k, v)
                .map_err(|e| self.ioerr(&format!("setting xattr {} on", k.to_string_lossy()), rel, e))?;
        }
        if kind(st) != libc::S_IFLNK {
            fchmodat(
                Some(d),
                name,
                Mode::from_bits_truncate(st.st_mode & 0o7777),
                FchmodatFlags::FollowSymlink, // not a symlink: nothing to follow
            )
            .map_err(|e| self.err("chmod", rel, e))?;
        }
        let (a, m) = times(st);
        utimensat(Some(d), name, &a, &m, UtimensatFlags::NoFollowSymlink)
            .map_err(|e| self.err("setting times of", rel, e))
    }
}

/// Names in a directory (without `.` and `..`), sorted.
fn read_names(dir: &OwnedFd) -> Result<Vec<OsString>, Errno> {
    let dup = dir.try_clone().map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
    let mut d = nix::dir::Dir::from_fd(dup.into_raw_fd())?;
    let mut names = Vec::new();
    for ent in d.iter() {
        let ent = ent?;
        let n = ent.file_name().to_bytes();
        if n == b"." || n == b".." {
            continue;
        }
        names.push(OsStr::from_bytes(n).to_os_string());
    }
    names.sort();
    Ok(names)
}
