//! Unpacking one OCI/docker layer tar into a layer directory.
//!
//! Every entry is created relative to a directory fd obtained with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`, and the final component is
//! operated on with `*at` calls that do not follow symlinks (`O_NOFOLLOW|O_EXCL`,
//! `AT_SYMLINK_NOFOLLOW`), so no entry can be written outside the layer whatever symlinks earlier
//! entries created. Paths are normalized lexically first; absolute or escaping paths are rejected.

use crate::fsutil::caps_for_host;
use crate::{io_err, IdMap, LayersError};
use bb_sys::mount_api::{openat2, RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_NO_XDEV};
use nix::errno::Errno;
use nix::fcntl::AtFlags;
use nix::sys::stat::{fchmod, fchmodat, fstatat, futimens, mkdirat, mknodat, FchmodatFlags, Mode, SFlag};
use nix::sys::time::TimeSpec;
use nix::unistd::{fchown, fchownat, linkat, symlinkat, unlinkat, Gid, Uid, UnlinkatFlags};
use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use xattr::FileExt;

const RESOLVE_STRICT: u64 = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// Lexically normalize a tar entry path: drop `.` and empty components, apply `..`. Returns the
/// path relative to the layer root (empty = the root itself), or why it is unacceptable.
pub(crate) fn normalize_entry_path(p: &Path) -> Result<PathBuf, &'static str> {
    let mut out: Vec<&OsStr> = Vec::new();
    for c in p.components() {
        match c {
            Component::RootDir | Component::Prefix(_) => return Err("is an absolute path"),
            Component::CurDir => {}
            Component::ParentDir => {
                if out.pop().is_none() {
                    return Err("escapes the layer root via `..`");
                }
            }
            Component::Normal(n) => out.push(n),
        }
    }
    Ok(out.iter().collect())
}

/// What a file name means in an OCI layer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Special<'a> {
    /// `.wh..wh..opq`: the parent directory hides the lower layers' contents.
    Opaque,
    /// `.wh.<name>`: `<name>` is deleted from the lower layers.
    Whiteout(&'a OsStr),
    /// Other `.wh..wh.*` names (aufs bookkeeping): ignored.
    Ignored,
    Normal,
}

pub(crate) fn classify(name: &OsStr) -> Special<'_> {
    let b = name.as_bytes();
    if b == OPAQUE_MARKER {
        Special::Opaque
    } else if b.starts_with(b".wh..wh.") {
        Special::Ignored
    } else if let Some(rest) = b.strip_prefix(WHITEOUT_PREFIX) {
        Special::Whiteout(OsStr::from_bytes(rest))
    } else {
        Special::Normal
    }
}

fn is_whiteout_dev(st: &nix::sys::stat::FileStat) -> bool {
    (st.st_mode & libc::S_IFMT) == libc::S_IFCHR && st.st_rdev == 0
}

/// Writes the entries of one layer tar below `root`.
pub(crate) struct LayerWriter {
    root: OwnedFd,
    root_path: PathBuf,
    idmap: IdMap,
    layer: String,
    /// Directories whose mtime to set once all entries are written.
    dir_times: Vec<(PathBuf, i64)>,
    /// Entries not created (device nodes), so hard links to them are skipped too.
    skipped: HashSet<PathBuf>,
    /// Sum of regular-file sizes written.
    pub size: u64,
}

impl LayerWriter {
    /// `root` must be an existing, empty directory; it is chowned to the image root
    /// (`host_base`) with mode 0755 (a `./` entry in the tar may change that).
    pub fn new(root_path: &Path, idmap: IdMap, layer: &str) -> Result<LayerWriter, LayersError> {
        let root = File::open(root_path).map_err(io_err(format!("opening {}", root_path.display())))?;
        let base = idmap.host_base;
        fchown(root.as_raw_fd(), Some(Uid::from_raw(base)), Some(Gid::from_raw(base)))
            .map_err(|e| LayersError::io(format!("chown {}", root_path.display()), e.into()))?;
        fchmod(root.as_raw_fd(), Mode::from_bits_truncate(0o755))
            .map_err(|e| LayersError::io(format!("chmod {}", root_path.display()), e.into()))?;
        Ok(LayerWriter {
            root: root.into(),
            root_path: root_path.to_path_buf(),
            idmap,
            layer: layer.to_string(),
            dir_times: Vec::new(),
            skipped: HashSet::new(),
            size: 0,
        })
    }

    fn unsafe_entry(&self, entry: &Path, reason: impl Into<String>) -> LayersError {
        LayersError::UnsafeEntry {
            layer: self.layer.clone(),
            entry: entry.display().to_string(),
            reason: reason.into(),
        }
    }

    fn sys(&self, what: &str, rel: &Path, e: Errno) -> LayersError {
        LayersError::io(format!("layer {}: {what} /{}", self.layer, rel.display()), e.into())
    }

    /// Set atime and mtime of `name` in `dir` (never following a symlink).
    fn set_mtime_at<P: ?Sized + nix::NixPath>(
        &self,
        dir: RawFd,
        name: &P,
        mtime: i64,
        rel: &Path,
    ) -> Result<(), LayersError> {
        let t = TimeSpec::new(mtime, 0);
        nix::sys::stat::utimensat(Some(dir), name, &t, &t, nix::sys::stat::UtimensatFlags::NoFollowSymlink)
            .map_err(|e| self.sys("setting mtime of", rel, e))
    }

    /// lchown `name` in `dir` to host ids (never following a symlink).
    fn chown_at<P: ?Sized + nix::NixPath>(
        &self,
        dir: RawFd,
        name: &P,
        uid: u32,
        gid: u32,
        rel: &Path,
    ) -> Result<(), LayersError> {
        fchownat(Some(dir), name, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)), AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| self.sys("chown", rel, e))
    }

    /// Unpack every entry of `archive`, then fix directory mtimes.
    pub fn unpack<R: Read>(&mut self, archive: &mut tar::Archive<R>) -> Result<(), LayersError> {
        let entries = archive.entries().map_err(io_err(format!("layer {}: reading tar", self.layer)))?;
        for entry in entries {
            let entry = entry.map_err(io_err(format!("layer {}: reading tar entry", self.layer)))?;
            self.entry(entry)?;
        }
        self.finish_dir_times();
        Ok(())
    }

    /// Open the directory `rel` (relative to the root) as an O_PATH fd, refusing symlinks anywhere.
    /// With `create`, missing components are created as directories owned by the image root.
    fn dir(&self, rel: &Path, create: bool, shown: &Path) -> Result<OwnedFd, LayersError> {
        let flags = libc::O_PATH | libc::O_DIRECTORY;
        let rel_or_dot: &Path = if rel.as_os_str().is_empty() { Path::new(".") } else { rel };
        match openat2(self.root.as_fd(), rel_or_dot, flags, 0, RESOLVE_STRICT) {
            Ok(fd) => return Ok(fd),
            Err(e) if e.errno() == libc::ENOENT && create => {}
            Err(e) => return Err(self.resolve_error(rel, shown, e.errno())),
        }
        // Walk component by component, creating what is missing.
        let mut cur = openat2(self.root.as_fd(), ".", flags, 0, RESOLVE_STRICT)
            .map_err(|e| self.sys("opening layer root", Path::new(""), Errno::from_raw(e.errno())))?;
        let mut so_far = PathBuf::new();
        for comp in rel.iter() {
            so_far.push(comp);
            cur = match openat2(cur.as_fd(), comp, flags, 0, RESOLVE_STRICT) {
                Ok(fd) => fd,
                Err(e) if e.errno() == libc::ENOENT => {
                    mkdirat(Some(cur.as_raw_fd()), comp, Mode::from_bits_truncate(0o755))
                        .map_err(|e| self.sys("mkdir", &so_far, e))?;
                    let base = self.idmap.host_base;
                    self.chown_at(cur.as_raw_fd(), comp, base, base, &so_far)?;
                    openat2(cur.as_fd(), comp, flags, 0, RESOLVE_STRICT)
                        .map_err(|e| self.resolve_error(&so_far, shown, e.errno()))?
                }
                Err(e) => return Err(self.resolve_error(&so_far, shown, e.errno())),
            };
        }
        Ok(cur)
    }

    fn resolve_error(&self, rel: &Path, shown: &Path, errno: i32) -> LayersError {
        match errno {
            libc::ELOOP => {
                self.unsafe_entry(shown, format!("goes through a symlink (at or below `{}`)", rel.display()))
            }
            libc::EXDEV => self.unsafe_entry(shown, "escapes the layer root"),
            libc::ENOTDIR => self.unsafe_entry(
                shown,
                format!("needs `{}` to be a directory, but an earlier entry made it a file", rel.display()),
            ),
            libc::ENOENT => self.unsafe_entry(
                shown,
                format!("refers to `{}`, which no earlier entry of this layer created", rel.display()),
            ),
            e => self.sys("resolving", rel, Errno::from_raw(e)),
        }
    }

    fn lstat_at(&self, dir: BorrowedFd<'_>, name: &OsStr) -> Option<nix::sys::stat::FileStat> {
        fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW).ok()
    }

    /// Remove whatever is at `dir/name` (a directory recursively). `rel` is its root-relative path.
    fn remove_existing(
        &self,
        dir: BorrowedFd<'_>,
        name: &OsStr,
        st: &nix::sys::stat::FileStat,
        rel: &Path,
    ) -> Result<(), LayersError> {
        if (st.st_mode & libc::S_IFMT) == libc::S_IFDIR {
            // `rel` was resolved without crossing a symlink and nobody else writes this private
            // tree, so the path-based removal (which itself never follows symlinks) stays inside.
            let p = self.root_path.join(rel);
            std::fs::remove_dir_all(&p).map_err(io_err(format!(
                "layer {}: replacing directory /{}",
                self.layer,
                rel.display()
            )))
        } else {
            unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir).map_err(|e| self.sys("replacing", rel, e))
        }
    }

    fn host_ids(&self, header: &tar::Header, rel: &Path) -> Result<(u32, u32), LayersError> {
        let uid = header.uid().map_err(io_err(format!("layer {}: uid of /{}", self.layer, rel.display())))?;
        let gid = header.gid().map_err(io_err(format!("layer {}: gid of /{}", self.layer, rel.display())))?;
        let map = |id: u64, what| {
            u32::try_from(id).ok().and_then(|i| self.idmap.to_host(i)).ok_or_else(|| LayersError::IdOutOfRange {
                path: format!("layer {}: /{}", self.layer, rel.display()),
                what,
                id,
                size: self.idmap.size,
            })
        };
        Ok((map(uid, "uid")?, map(gid, "gid")?))
    }

    fn entry<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), LayersError> {
        let raw_path = entry.path().map_err(io_err(format!("layer {}: entry path", self.layer)))?.into_owned();
        let rel = normalize_entry_path(&raw_path).map_err(|r| self.unsafe_entry(&raw_path, r))?;
        let header = entry.header().clone();
        let kind = header.entry_type();
        let mode = header.mode().unwrap_or(0o644) & 0o7777;
        let mtime = header.mtime().unwrap_or(0) as i64;

        // Only user.* and security.capability xattrs are taken from the tar; trusted.* (overlay's
        // own namespace) and security.* labels are never.
        let mut xattrs: Vec<(String, Vec<u8>)> = Vec::new();
        if let Ok(Some(exts)) = entry.pax_extensions() {
            for ext in exts.flatten() {
                if let Ok(key) = ext.key() {
                    if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                        if name.starts_with("user.") {
                            xattrs.push((name.to_string(), ext.value_bytes().to_vec()));
                        } else if name == "security.capability" {
                            if let Some(v) = caps_for_host(ext.value_bytes()) {
                                xattrs.push((name.to_string(), v));
                            }
                        }
                    }
                }
            }
        }

        let Some(name) = rel.file_name().map(OsStr::to_os_string) else {
            // The layer root itself (`./`).
            if kind.is_dir() {
                let (uid, gid) = self.host_ids(&header, &rel)?;
                let fd = openat2(self.root.as_fd(), ".", libc::O_RDONLY | libc::O_DIRECTORY, 0, RESOLVE_STRICT)
                    .map_err(|e| self.sys("opening", &rel, Errno::from_raw(e.errno())))?;
                self.set_meta_fd(&fd, &rel, uid, gid, mode, &xattrs)?;
                self.dir_times.push((rel, mtime));
                return Ok(());
            }
            return Err(self.unsafe_entry(&raw_path, "would replace the layer root with a non-directory"));
        };
        let parent_rel = rel.parent().unwrap_or(Path::new("")).to_path_buf();

        match classify(&name) {
            Special::Opaque => {
                let fd = self.dir(&parent_rel, true, &raw_path)?;
                let dirfd = openat2(fd.as_fd(), ".", libc::O_RDONLY | libc::O_DIRECTORY, 0, RESOLVE_STRICT)
                    .map_err(|e| self.sys("opening", &parent_rel, Errno::from_raw(e.errno())))?;
                File::from(dirfd).set_xattr(OPAQUE_XATTR, b"y").map_err(io_err(format!(
                    "layer {}: marking /{} opaque (setting {OPAQUE_XATTR})",
                    self.layer,
                    parent_rel.display()
                )))?;
                return Ok(());
            }
            Special::Whiteout(target) => {
                if target.is_empty() || target == "." || target == ".." || target.as_bytes().contains(&b'/') {
                    return Err(self.unsafe_entry(&raw_path, "is a whiteout with an invalid name"));
                }
                let dir = self.dir(&parent_rel, true, &raw_path)?;
                let target_rel = parent_rel.join(target);
                // OCI: a whiteout only hides lower layers; an entry of this layer with the same
                // name stays. A non-directory already hides the lower entry; a directory must stop
                // merging with the lower one.
                if let Some(st) = self.lstat_at(dir.as_fd(), target) {
                    if (st.st_mode & libc::S_IFMT) == libc::S_IFDIR {
                        let fd = openat2(
                            dir.as_fd(),
                            target,
                            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                            0,
                            RESOLVE_STRICT,
                        )
                        .map_err(|e| self.resolve_error(&target_rel, &raw_path, e.errno()))?;
                        File::from(fd).set_xattr(OPAQUE_XATTR, b"y").map_err(io_err(format!(
                            "layer {}: marking /{} opaque",
                            self.layer,
                            target_rel.display()
                        )))?;
                    }
                    return Ok(());
                }
                mknodat(Some(dir.as_raw_fd()), target, SFlag::S_IFCHR, Mode::empty(), 0)
                    .map_err(|e| self.sys("creating whiteout", &target_rel, e))?;
                let base = self.idmap.host_base;
                self.chown_at(dir.as_raw_fd(), target, base, base, &target_rel)?;
                return Ok(());
            }
            Special::Ignored => return Ok(()),
            Special::Normal => {}
        }

        if kind.is_character_special() || kind.is_block_special() {
            // Sandboxes get a fresh /dev; device nodes in layers are never created.
            self.skipped.insert(rel);
            return Ok(());
        }
        let is_file = kind.is_file() || kind.is_contiguous() || kind.is_gnu_sparse();
        if !(is_file || kind.is_dir() || kind.is_symlink() || kind.is_hard_link() || kind.is_fifo()) {
            tracing::debug!(layer = %self.layer, path = %rel.display(), kind = ?kind, "skipping tar entry of unsupported type");
            return Ok(());
        }

        let (uid, gid) = self.host_ids(&header, &rel)?;
        let dir = self.dir(&parent_rel, true, &raw_path)?;
        let existing = self.lstat_at(dir.as_fd(), &name);
        self.skipped.remove(&rel);

        if kind.is_dir() {
            let mut opaque = false;
            let need_mkdir = match &existing {
                None => true,
                Some(st) if (st.st_mode & libc::S_IFMT) == libc::S_IFDIR => false,
                Some(st) => {
                    // A whiteout followed by a directory of the same name in one layer means
                    // "replace the lower directory": the new one must not merge with it.
                    opaque = is_whiteout_dev(st);
                    self.remove_existing(dir.as_fd(), &name, st, &rel)?;
                    true
                }
            };
            if need_mkdir {
                mkdirat(Some(dir.as_raw_fd()), name.as_os_str(), Mode::from_bits_truncate(0o700))
                    .map_err(|e| self.sys("mkdir", &rel, e))?;
            }
            let fd =
                openat2(dir.as_fd(), &name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0, RESOLVE_STRICT)
                    .map_err(|e| self.resolve_error(&rel, &raw_path, e.errno()))?;
            if opaque {
                File::from(fd.try_clone().map_err(io_err("dup"))?)
                    .set_xattr(OPAQUE_XATTR, b"y")
                    .map_err(io_err(format!("layer {}: marking /{} opaque", self.layer, rel.display())))?;
            }
            self.set_meta_fd(&fd, &rel, uid, gid, mode, &xattrs)?;
            self.dir_times.push((rel, mtime));
            return Ok(());
        }

        if kind.is_hard_link() {
            let link = entry
                .link_name()
                .map_err(io_err(format!("layer {}: link target of /{}", self.layer, rel.display())))?
                .ok_or_else(|| self.unsafe_entry(&raw_path, "is a hard link without a target"))?
                .into_owned();
            let target = normalize_entry_path(&link).map_err(|r| {
                self.unsafe_entry(&raw_path, format!("is a hard link whose target `{}` {r}", link.display()))
            })?;
            if self.skipped.contains(&target) {
                self.skipped.insert(rel);
                return Ok(());
            }
            let Some(tname) = target.file_name() else {
                return Err(self.unsafe_entry(&raw_path, "is a hard link to the layer root"));
            };
            let tdir = self.dir(target.parent().unwrap_or(Path::new("")), false, &raw_path)?;
            let tst = self.lstat_at(tdir.as_fd(), tname).ok_or_else(|| {
                self.unsafe_entry(
                    &raw_path,
                    format!("is a hard link to `{}`, which no earlier entry of this layer created", link.display()),
                )
            })?;
            if (tst.st_mode & libc::S_IFMT) == libc::S_IFDIR {
                return Err(self.unsafe_entry(&raw_path, "is a hard link to a directory"));
            }
            if let Some(st) = &existing {
                if st.st_dev == tst.st_dev && st.st_ino == tst.st_ino {
                    return Ok(());
                }
                self.remove_existing(dir.as_fd(), &name, st, &rel)?;
            }
            linkat(Some(tdir.as_raw_fd()), tname, Some(dir.as_raw_fd()), name.as_os_str(), AtFlags::empty())
                .map_err(|e| self.sys("hard-linking", &rel, e))?;
            return Ok(());
        }

        if let Some(st) = &existing {
            self.remove_existing(dir.as_fd(), &name, st, &rel)?;
        }

        if kind.is_symlink() {
            let target: OsString = match entry.link_name_bytes() {
                Some(b) if !b.is_empty() => OsStr::from_bytes(&b).to_os_string(),
                _ => return Err(self.unsafe_entry(&raw_path, "is a symlink without a target")),
            };
            symlinkat(target.as_os_str(), Some(dir.as_raw_fd()), name.as_os_str())
                .map_err(|e| self.sys("symlink", &rel, e))?;
            self.chown_at(dir.as_raw_fd(), name.as_os_str(), uid, gid, &rel)?;
            self.set_mtime_at(dir.as_raw_fd(), name.as_os_str(), mtime, &rel)?;
            return Ok(());
        }

        if kind.is_fifo() {
            mknodat(Some(dir.as_raw_fd()), name.as_os_str(), SFlag::S_IFIFO, Mode::from_bits_truncate(0o600), 0)
                .map_err(|e| self.sys("mkfifo", &rel, e))?;
            self.chown_at(dir.as_raw_fd(), name.as_os_str(), uid, gid, &rel)?;
            fchmodat(
                Some(dir.as_raw_fd()),
                name.as_os_str(),
                Mode::from_bits_truncate(mode),
                FchmodatFlags::FollowSymlink,
            )
            .map_err(|e| self.sys("chmod", &rel, e))?;
            self.set_mtime_at(dir.as_raw_fd(), name.as_os_str(), mtime, &rel)?;
            return Ok(());
        }

        // Regular file: O_EXCL|O_NOFOLLOW on a name we just made free.
        let fd = openat2(
            dir.as_fd(),
            &name,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
            0o600,
            RESOLVE_STRICT,
        )
        .map_err(|e| self.sys("creating", &rel, Errno::from_raw(e.errno())))?;
        let mut file = File::from(fd);
        let n = io::copy(&mut entry, &mut file).map_err(io_err(format!(
            "layer {}: writing /{}",
            self.layer,
            rel.display()
        )))?;
        self.size += n;
        let fd: OwnedFd = file.into();
        self.set_meta_fd(&fd, &rel, uid, gid, mode, &xattrs)?;
        let t = TimeSpec::new(mtime, 0);
        futimens(fd.as_raw_fd(), &t, &t).map_err(|e| self.sys("setting mtime of", &rel, e))?;
        Ok(())
    }

    /// chown, then chmod (chown clears setuid/setgid), then xattrs (chown clears file caps).
    fn set_meta_fd(
        &self,
        fd: &OwnedFd,
        rel: &Path,
        uid: u32,
        gid: u32,
        mode: u32,
        xattrs: &[(String, Vec<u8>)],
    ) -> Result<(), LayersError> {
        fchown(fd.as_raw_fd(), Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
            .map_err(|e| self.sys("chown", rel, e))?;
        fchmod(fd.as_raw_fd(), Mode::from_bits_truncate(mode)).map_err(|e| self.sys("chmod", rel, e))?;
        if !xattrs.is_empty() {
            let f = File::from(fd.try_clone().map_err(io_err("dup"))?);
            for (k, v) in xattrs {
                f.set_xattr(k, v).map_err(io_err(format!(
                    "layer {}: setting xattr {k} on /{}",
                    self.layer,
                    rel.display()
                )))?;
            }
        }
        Ok(())
    }

    /// Directory mtimes change while entries are added below them; set them last. Best effort.
    fn finish_dir_times(&mut self) {
        for (rel, mtime) in std::mem::take(&mut self.dir_times).into_iter().rev() {
            let p: &Path = if rel.as_os_str().is_empty() { Path::new(".") } else { &rel };
            if let Ok(fd) =
                openat2(self.root.as_fd(), p, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0, RESOLVE_STRICT)
            {
                let t = TimeSpec::new(mtime, 0);
                let _ = futimens(fd.as_raw_fd(), &t, &t);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_accepts_relative_and_dot_paths() {
        assert_eq!(normalize_entry_path(Path::new("./etc/passwd")).unwrap(), PathBuf::from("etc/passwd"));
        assert_eq!(normalize_entry_path(Path::new("a/./b//c/")).unwrap(), PathBuf::from("a/b/c"));
        assert_eq!(normalize_entry_path(Path::new("a/../b")).unwrap(), PathBuf::from("b"));
        assert_eq!(normalize_entry_path(Path::new("./")).unwrap(), PathBuf::new());
    }

    #[test]
    fn normalize_rejects_absolute_and_escaping_paths() {
        assert_eq!(normalize_entry_path(Path::new("/abs")), Err("is an absolute path"));
        assert_eq!(normalize_entry_path(Path::new("/")), Err("is an absolute path"));
        assert_eq!(normalize_entry_path(Path::new("../x")), Err("escapes the layer root via `..`"));
        assert_eq!(normalize_entry_path(Path::new("a/../../x")), Err("escapes the layer root via `..`"));
        assert_eq!(normalize_entry_path(Path::new("./..")), Err("escapes the layer root via `..`"));
    }

    #[test]
    fn whiteout_names() {
        assert_eq!(classify(OsStr::new(".wh..wh..opq")), Special::Opaque);
        assert_eq!(classify(OsStr::new(".wh.foo")), Special::Whiteout(OsStr::new("foo")));
        assert_eq!(classify(OsStr::new(".wh..hidden")), Special::Whiteout(OsStr::new(".hidden")));
        assert_eq!(classify(OsStr::new(".wh..wh.plnk")), Special::Ignored);
        assert_eq!(classify(OsStr::new("foo.wh.bar")), Special::Normal);
        assert_eq!(classify(OsStr::new(".whfoo")), Special::Normal);
    }

    // ---- root tests: unpack in-memory tars with LayerWriter ----

    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

    const MTIME: u64 = 1_700_000_000;

    fn require_root() {
        assert!(
            nix::unistd::geteuid().is_root(),
            "this test needs root (chown to shifted ids, whiteout mknod, trusted.* xattrs); run the tests as root"
        );
    }

    /// A tar built with raw headers, so malicious names (`../x`, `/abs`) are written verbatim.
    struct RawTar(tar::Builder<Vec<u8>>);

    impl RawTar {
        fn new() -> Self {
            RawTar(tar::Builder::new(Vec::new()))
        }
        fn put(
            &mut self,
            path: &str,
            kind: tar::EntryType,
            mode: u32,
            uid: u64,
            data: &[u8],
            link: Option<&str>,
        ) -> &mut Self {
            let mut h = tar::Header::new_gnu();
            h.as_old_mut().name[..path.len()].copy_from_slice(path.as_bytes());
            if let Some(l) = link {
                h.as_old_mut().linkname[..l.len()].copy_from_slice(l.as_bytes());
            }
            h.set_entry_type(kind);
            h.set_mode(mode);
            h.set_uid(uid);
            h.set_gid(uid);
            h.set_size(data.len() as u64);
            h.set_mtime(MTIME);
            h.set_cksum();
            self.0.append(&h, data).unwrap();
            self
        }
        fn dir(&mut self, p: &str) -> &mut Self {
            self.put(p, tar::EntryType::Directory, 0o755, 0, b"", None)
        }
        fn file(&mut self, p: &str, data: &[u8]) -> &mut Self {
            self.put(p, tar::EntryType::Regular, 0o644, 0, data, None)
        }
        fn symlink(&mut self, p: &str, target: &str) -> &mut Self {
            self.put(p, tar::EntryType::Symlink, 0o777, 0, b"", Some(target))
        }
        fn hardlink(&mut self, p: &str, target: &str) -> &mut Self {
            self.put(p, tar::EntryType::Link, 0o644, 0, b"", Some(target))
        }
        fn finish(&mut self) -> Vec<u8> {
            let b = std::mem::replace(&mut self.0, tar::Builder::new(Vec::new()));
            b.into_inner().unwrap()
        }
    }

    struct Unpacked {
        _dir: tempfile::TempDir,
        /// Sibling of the layer root: escapes would land here.
        outside: PathBuf,
        root: PathBuf,
    }

    fn unpack_with(tar_bytes: &[u8], idmap: IdMap) -> (Unpacked, Result<u64, LayersError>) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("layer");
        let outside = dir.path().to_path_buf();
        std::fs::create_dir(&root).unwrap();
        let res = LayerWriter::new(&root, idmap, "test-layer").and_then(|mut w| {
            w.unpack(&mut tar::Archive::new(tar_bytes))?;
            Ok(w.size)
        });
        (Unpacked { _dir: dir, outside, root }, res)
    }

    fn unpack(tar_bytes: &[u8]) -> (Unpacked, Result<u64, LayersError>) {
        unpack_with(tar_bytes, IdMap::default())
    }

    fn entries_below(p: &Path) -> Vec<String> {
        let mut v: Vec<String> = walkdir::WalkDir::new(p)
            .min_depth(1)
            .into_iter()
            .map(|e| e.unwrap().path().strip_prefix(p).unwrap().display().to_string())
            .collect();
        v.sort();
        v
    }

    fn opaque(p: &Path) -> Option<Vec<u8>> {
        xattr::get(p, OPAQUE_XATTR).unwrap()
    }

    fn assert_whiteout(p: &Path) {
        let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert_eq!(m.mode() & libc::S_IFMT, libc::S_IFCHR, "{} is not a char device", p.display());
        assert_eq!(m.rdev(), 0, "{} is not 0/0", p.display());
        assert_eq!((m.uid(), m.gid()), (1_000_000, 1_000_000));
    }

    #[test]
    fn whiteouts_and_opaque_dirs_become_overlay_markers() {
        require_root();
        let t = RawTar::new()
            .dir("etc/")
            .file("etc/.wh.keep", b"")
            .dir("opq/")
            .file("opq/.wh..wh..opq", b"")
            .file("opq/c", b"c")
            .file(".wh.gone", b"")
            .file(".wh..wh.plnk", b"")
            .file("implicit/.wh..wh..opq", b"")
            // same-layer interplay
            .file("samefile", b"kept")
            .file(".wh.samefile", b"")
            .dir("samedir/")
            .file(".wh.samedir", b"")
            .file(".wh.newdir", b"")
            .dir("newdir/")
            .finish();
        let (u, res) = unpack(&t);
        res.unwrap();
        let r = &u.root;
        assert_whiteout(&r.join("etc/keep"));
        assert_whiteout(&r.join("gone"));
        assert_eq!(opaque(&r.join("opq")), Some(b"y".to_vec()));
        assert_eq!(opaque(&r.join("etc")), None);
        assert_eq!(std::fs::read(r.join("opq/c")).unwrap(), b"c");
        assert_eq!(opaque(&r.join("implicit")), Some(b"y".to_vec()), "opaque marker creates its dir");
        // A whiteout never replaces an entry of its own layer; a directory stops merging instead.
        assert_eq!(std::fs::read(r.join("samefile")).unwrap(), b"kept");
        assert_eq!(opaque(&r.join("samedir")), Some(b"y".to_vec()));
        // Whiteout then directory: a fresh, opaque directory.
        assert!(r.join("newdir").is_dir());
        assert_eq!(opaque(&r.join("newdir")), Some(b"y".to_vec()));
        // No .wh. file survives.
        let names = entries_below(r);
        assert!(names.iter().all(|n| !n.contains(".wh.")), "{names:?}");
    }

    fn assert_unsafe(res: Result<u64, LayersError>, needle: &str) {
        match res {
            Err(LayersError::UnsafeEntry { reason, entry, .. }) => {
                assert!(reason.contains(needle), "reason `{reason}` for `{entry}` lacks `{needle}`")
            }
            other => panic!("expected UnsafeEntry({needle}), got {other:?}"),
        }
    }

    #[test]
    fn escaping_paths_are_rejected() {
        require_root();
        let marker = format!("bb-escape-{}", std::process::id());
        for (path, needle) in [
            (format!("../{marker}"), "escapes"),
            (format!("a/../../{marker}"), "escapes"),
            (format!("/tmp/{marker}"), "absolute"),
        ] {
            let t = RawTar::new().file("ok", b"1").file(&path, b"evil").finish();
            let (u, res) = unpack(&t);
            assert_unsafe(res, needle);
            assert!(!u.outside.join(&marker).exists());
            assert!(!Path::new("/tmp").join(&marker).exists());
            assert!(!u.root.join(&marker).exists(), "{path} must not be written anywhere");
        }
        // Hard link targets are checked the same way.
        let t = RawTar::new().hardlink("h", "../../../etc/passwd").finish();
        assert_unsafe(unpack(&t).1, "escapes");
    }

    #[test]
    fn symlinks_are_never_followed() {
        require_root();
        // Escape targets are a decoy dir (and, for `/etc`, a file name that does not exist), so a
        // regression fails the test without damaging the host.
        let decoy = tempfile::tempdir().unwrap();
        let decoy_passwd = decoy.path().join("passwd");
        std::fs::write(&decoy_passwd, "decoy").unwrap();
        let d = decoy.path().to_str().unwrap();
        let decoy_unchanged = || {
            assert_eq!(std::fs::read_to_string(&decoy_passwd).unwrap(), "decoy");
            assert_eq!(std::fs::read_dir(decoy.path()).unwrap().count(), 1, "nothing created in the symlink target");
        };

        // a -> <dir>, then a/passwd.
        let t = RawTar::new().symlink("a", d).file("a/passwd", b"owned\n").finish();
        let (u, res) = unpack(&t);
        assert_unsafe(res, "symlink");
        decoy_unchanged();
        assert!(std::fs::symlink_metadata(u.root.join("a")).unwrap().file_type().is_symlink());

        // a -> /etc, then a/<name>: never created in the host's /etc.
        let name = format!("bb-layers-symlink-test-{}", std::process::id());
        let t = RawTar::new().symlink("a", "/etc").file(&format!("a/{name}"), b"x").finish();
        let res = unpack(&t).1;
        let leaked = Path::new("/etc").join(&name);
        if leaked.exists() {
            let _ = std::fs::remove_file(&leaked);
            panic!("wrote through a symlink into /etc");
        }
        assert_unsafe(res, "symlink");

        // Relative escape through a symlink to the parent.
        let t = RawTar::new().symlink("up", "..").file("up/x", b"x").finish();
        let (u, res) = unpack(&t);
        assert_unsafe(res, "symlink");
        assert!(!u.outside.join("x").exists());

        // Directory entry through a symlink, and a hard link whose target goes through one.
        let t = RawTar::new().symlink("d", d).dir("d/sub/").finish();
        assert_unsafe(unpack(&t).1, "symlink");
        decoy_unchanged();
        let t = RawTar::new().symlink("e", d).hardlink("h", "e/passwd").finish();
        assert_unsafe(unpack(&t).1, "symlink");
        assert_eq!(std::fs::metadata(&decoy_passwd).unwrap().nlink(), 1, "no hard link to the target");

        // A symlink entry replacing a file, then a file entry replacing the symlink: the file is
        // created in the layer, not through the link.
        let t = RawTar::new().file("f", b"1").symlink("f", decoy_passwd.to_str().unwrap()).file("f", b"2").finish();
        let (u, res) = unpack(&t);
        res.unwrap();
        assert_eq!(std::fs::read(u.root.join("f")).unwrap(), b"2");
        decoy_unchanged();
        // Symlink targets are stored verbatim (resolved later, inside the sandbox).
        let t = RawTar::new().symlink("bin/sh", "/bin/busybox").finish();
        let (u, res) = unpack(&t);
        res.unwrap();
        assert_eq!(std::fs::read_link(u.root.join("bin/sh")).unwrap(), PathBuf::from("/bin/busybox"));
    }

    #[test]
    fn ownership_is_shifted_and_modes_kept() {
        require_root();
        let t = RawTar::new()
            .put("./", tar::EntryType::Directory, 0o755, 0, b"", None)
            .put("home/", tar::EntryType::Directory, 0o755, 0, b"", None)
            .put("home/u/", tar::EntryType::Directory, 0o700, 1000, b"", None)
            .put("home/u/f", tar::EntryType::Regular, 0o640, 1000, b"abc", None)
            .put("bin/su", tar::EntryType::Regular, 0o4755, 0, b"suid", None)
            .hardlink("bin/su2", "bin/su")
            .symlink("bin/sh", "su")
            .put("dev/null", tar::EntryType::Char, 0o666, 0, b"", None)
            .put("dev/sda", tar::EntryType::Block, 0o660, 0, b"", None)
            .hardlink("dev/null2", "dev/null")
            .put("fifo", tar::EntryType::Fifo, 0o600, 0, b"", None)
            .finish();
        let idmap = IdMap { host_base: 2_000_000, size: 65_536 };
        let (u, res) = unpack_with(&t, idmap);
        assert_eq!(res.unwrap(), 3 + 4, "size counts regular files once");
        let r = &u.root;
        let m = |p: &str| std::fs::symlink_metadata(r.join(p)).unwrap();
        assert_eq!((m("").uid(), m("").gid(), m("").mode() & 0o7777), (2_000_000, 2_000_000, 0o755));
        assert_eq!((m("home").uid(), m("home/u").uid(), m("home/u/f").gid()), (2_000_000, 2_001_000, 2_001_000));
        assert_eq!(m("home/u").mode() & 0o7777, 0o700);
        assert_eq!(m("home/u/f").mode() & 0o7777, 0o640);
        assert_eq!(m("bin").uid(), 2_000_000, "implicit parent dirs belong to the image root");
        assert_eq!(m("bin/su").mode() & 0o7777, 0o4755, "setuid survives the chown");
        assert_eq!(m("bin/su").ino(), m("bin/su2").ino(), "hard link resolved within the layer");
        assert_eq!(m("bin/sh").uid(), 2_000_000);
        assert!(m("fifo").file_type().is_fifo() && m("fifo").uid() == 2_000_000);
        assert!(
            !r.join("dev/null").exists() && !r.join("dev/sda").exists() && !r.join("dev/null2").exists(),
            "device nodes are skipped"
        );
        assert_eq!(std::fs::metadata(r.join("home/u/f")).unwrap().mtime(), MTIME as i64);

        let t = RawTar::new().put("big", tar::EntryType::Regular, 0o644, 70_000, b"", None).finish();
        match unpack(&t).1 {
            Err(LayersError::IdOutOfRange { id: 70_000, .. }) => {}
            other => panic!("expected IdOutOfRange, got {other:?}"),
        }
    }

    #[test]
    fn only_safe_xattrs_are_taken_from_pax_headers() {
        require_root();
        let mut b = tar::Builder::new(Vec::new());
        let mut caps = vec![0u8; 20];
        caps[..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
        caps[4] = 0x20; // cap_net_raw
        b.append_pax_extensions([
            ("SCHILY.xattr.user.note", b"hi".as_slice()),
            ("SCHILY.xattr.trusted.overlay.redirect", b"/etc".as_slice()),
            ("SCHILY.xattr.trusted.overlay.opaque", b"y".as_slice()),
            ("SCHILY.xattr.security.capability", caps.as_slice()),
        ])
        .unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_path("ping").unwrap();
        h.set_mode(0o755);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(MTIME);
        h.set_size(1);
        h.set_cksum();
        b.append(&h, b"x".as_slice()).unwrap();
        let (u, res) = unpack(&b.into_inner().unwrap());
        res.unwrap();
        let p = u.root.join("ping");
        assert_eq!(xattr::get(&p, "user.note").unwrap(), Some(b"hi".to_vec()));
        assert_eq!(xattr::get(&p, "trusted.overlay.redirect").unwrap(), None);
        assert_eq!(xattr::get(&p, "trusted.overlay.opaque").unwrap(), None);
        assert_eq!(xattr::get(&p, "security.capability").unwrap(), Some(caps), "caps set after chown");
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777, 0o755);
    }

    #[test]
    fn later_entries_replace_earlier_ones() {
        require_root();
        let t = RawTar::new()
            .dir("x/")
            .file("x/inner", b"1")
            .file("x", b"now a file")
            .file("y", b"file")
            .dir("y/")
            .file("y/z", b"z")
            .file("w", b"old")
            .file("w", b"new")
            .finish();
        let (u, res) = unpack(&t);
        res.unwrap();
        assert_eq!(std::fs::read(u.root.join("x")).unwrap(), b"now a file");
        assert!(u.root.join("y").is_dir());
        assert_eq!(std::fs::read(u.root.join("w")).unwrap(), b"new");
        // A file cannot be a parent.
        let t = RawTar::new().file("p", b"").file("p/q", b"").finish();
        assert_unsafe(unpack(&t).1, "directory");
    }
}
