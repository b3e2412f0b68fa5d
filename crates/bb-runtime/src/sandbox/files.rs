//! File access inside a sandbox, from the host side, without ever leaving its root.
//!
//! Every path is first normalised lexically (a `..` that would climb above `/` is refused with
//! `path_escape`), then opened with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` relative to an
//! `O_PATH` fd of the sandbox's merged root: symlinks, absolute or relative, resolve inside the
//! sandbox as they would for a process in it, and /proc magic links are refused. Files and
//! directories the daemon creates are owned by the sandbox's root (the mapped host uid).

use crate::error::{Result, RuntimeError};
use crate::model::EntryInfo;
use bb_sys::mount_api::{openat2, RESOLVE_BENEATH, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS};
use nix::fcntl::AtFlags;
use nix::sys::stat::{fstatat, FileStat, Mode, SFlag};
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

const IN_ROOT: u64 = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
/// Most entries one `list` call returns.
pub const MAX_LIST_ENTRIES: usize = 100_000;
/// Name prefix of the temporary file an upload is written to before it is renamed in place.
pub const UPLOAD_TMP_PREFIX: &str = ".branchbox-upload-";
/// Largest value of an extended attribute read back (larger ones are skipped).
const MAX_XATTR_VALUE: usize = 64 << 10;

/// A normalised absolute path inside the sandbox.
#[derive(Debug, Clone, PartialEq)]
pub struct SbPath {
    parts: Vec<String>,
}

impl SbPath {
    pub fn parse(path: &str) -> Result<SbPath> {
        if path.contains('\0') {
            return Err(RuntimeError::BadRequest("path contains a NUL byte".into()));
        }
        if path.is_empty() {
            return Err(RuntimeError::BadRequest("path is empty: give an absolute path such as /root/file.txt".into()));
        }
        let mut parts: Vec<String> = Vec::new();
        for c in path.split('/') {
            match c {
                "" | "." => {}
                ".." => {
                    if parts.pop().is_none() {
                        return Err(RuntimeError::PathEscape(format!(
                            "path {path:?} climbs above the sandbox root: remove the leading '..' components"
                        )));
                    }
                }
                c => parts.push(c.to_string()),
            }
        }
        Ok(SbPath { parts })
    }

    pub fn is_root(&self) -> bool {
        self.parts.is_empty()
    }

    /// Relative form for openat2 against the root fd ("." for the root).
    pub fn rel(&self) -> String {
        if self.parts.is_empty() {
            ".".into()
        } else {
            self.parts.join("/")
        }
    }

    pub fn display(&self) -> String {
        format!("/{}", self.parts.join("/"))
    }

    pub fn name(&self) -> &str {
        self.parts.last().map(|s| s.as_str()).unwrap_or("/")
    }

    pub fn parent(&self) -> SbPath {
        SbPath { parts: self.parts[..self.parts.len().saturating_sub(1)].to_vec() }
    }

    pub fn join(&self, name: &str) -> SbPath {
        let mut parts = self.parts.clone();
        parts.push(name.to_string());
        SbPath { parts }
    }

    /// This path joined with a relative one of plain names (`a/b`; empty: this path).
    pub fn join_rel(&self, rel: &str) -> SbPath {
        let mut parts = self.parts.clone();
        parts.extend(rel.split('/').filter(|c| !c.is_empty()).map(str::to_string));
        SbPath { parts }
    }
}

pub struct SandboxFs {
    root: OwnedFd,
    uid: u32,
    /// Host gid new files and directories get (the uid's own group unless [`Self::owned_by`]).
    gid: u32,
    /// Host id of the sandbox's root (in-sandbox ids are host ids minus it).
    base: u32,
    /// The mode new directories get (None: 0755 less the daemon's umask).
    dir_mode: Option<u32>,
    /// Held while the handle lives: a checkpoint or rollback (which swaps the root under us)
    /// waits for file operations in flight, and new ones wait for it.
    _gate: Option<tokio::sync::OwnedRwLockReadGuard<()>>,
}

/// A file operation failed for a reason that is not the caller's (those are `NotFound`,
/// `PathEscape`, `BadRequest`, `Conflict` or `TooLarge`).
#[derive(Debug, thiserror::Error)]
#[error("{what} {path}: {source}")]
pub struct FilesError {
    what: String,
    path: String,
    #[source]
    source: nix::Error,
}

fn errno_to_error(what: &str, path: &SbPath, e: nix::Error) -> RuntimeError {
    let p = path.display();
    match e {
        nix::Error::ENOENT => RuntimeError::NotFound { kind: "path", id: p, hint: "" },
        nix::Error::EXDEV | nix::Error::ELOOP => {
            RuntimeError::PathEscape(format!("{what} {p}: the path leaves the sandbox root or loops"))
        }
        nix::Error::ENOTDIR => RuntimeError::BadRequest(format!("{what} {p}: a component is not a directory")),
        nix::Error::EISDIR => RuntimeError::BadRequest(format!("{what} {p}: is a directory")),
        nix::Error::EEXIST => RuntimeError::Conflict(format!("{what} {p}: already exists")),
        nix::Error::ENOTEMPTY => {
            RuntimeError::Conflict(format!("{what} {p}: directory not empty (pass recursive=true)"))
        }
        nix::Error::ENOSPC | nix::Error::EDQUOT => RuntimeError::TooLarge(format!("{what} {p}: no space left")),
        nix::Error::EACCES | nix::Error::EPERM | nix::Error::EROFS => {
            RuntimeError::BadRequest(format!("{what} {p}: permission denied"))
        }
        e => FilesError { what: what.to_string(), path: p, source: e }.into(),
    }
}

/// chmod the inode an `O_PATH` fd names (fchmod refuses such fds; its /proc link reaches the
/// inode itself, never following a symlink further).
fn chmod_fd(fd: &OwnedFd, mode: u32) -> nix::Result<()> {
    let via = format!("/proc/self/fd/{}", fd.as_raw_fd());
    nix::sys::stat::fchmodat(
        None,
        via.as_str(),
        Mode::from_bits_truncate(mode),
        nix::sys::stat::FchmodatFlags::FollowSymlink,
    )
}

fn io_to_nix(e: std::io::Error) -> nix::Error {
    nix::Error::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

fn sys_to_nix(e: bb_sys::SysError) -> nix::Error {
    nix::Error::from_raw(e.errno())
}

/// The in-sandbox id of a host id (`base`: host id of the sandbox's root); ids outside the
/// sandbox's range show as 65534 (nobody).
fn sandbox_id(host: u32, base: u32) -> u32 {
    host.checked_sub(base).filter(|id| *id < 65_536).unwrap_or(65_534)
}

fn entry(path: &SbPath, st: &FileStat, target: Option<String>, base: u32) -> EntryInfo {
    let fmt = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
    let kind = match fmt {
        SFlag::S_IFREG => "file",
        SFlag::S_IFDIR => "dir",
        SFlag::S_IFLNK => "symlink",
        _ => "other",
    };
    EntryInfo {
        name: path.name().to_string(),
        path: path.display(),
        kind: kind.into(),
        size: st.st_size as u64,
        mode: st.st_mode & 0o7777,
        uid: sandbox_id(st.st_uid, base),
        gid: sandbox_id(st.st_gid, base),
        mtime: st.st_mtime as f64 + st.st_mtime_nsec as f64 / 1e9,
        atime: st.st_atime as f64 + st.st_atime_nsec as f64 / 1e9,
        ctime: st.st_ctime as f64 + st.st_ctime_nsec as f64 / 1e9,
        symlink_target: target,
    }
}

impl SandboxFs {
    /// `rootfs`: host path of the sandbox's merged root. `uid`: host uid of the sandbox's root.
    pub fn open(rootfs: &Path, uid: u32) -> Result<SandboxFs> {
        let root = File::options()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
            .open(rootfs)
            .map_err(RuntimeError::io("open sandbox root"))?;
        Ok(SandboxFs { root: root.into(), uid, gid: uid, base: uid, dir_mode: None, _gate: None })
    }

    /// New files and directories are owned by host `uid` and `gid` (a sandbox user's).
    pub fn owned_by(mut self, uid: u32, gid: u32) -> SandboxFs {
        self.uid = uid;
        self.gid = gid;
        self
    }

    /// New files and directories are owned by in-sandbox ids `uid` and `gid` (0-65535).
    pub fn owned_by_ids(self, uid: u32, gid: u32) -> Result<SandboxFs> {
        let (uid, gid) = (self.host_id("uid", uid)?, self.host_id("gid", gid)?);
        Ok(self.owned_by(uid, gid))
    }

    /// New directories get exactly `mode` (the daemon's umask does not apply).
    pub fn with_dir_mode(mut self, mode: u32) -> SandboxFs {
        self.dir_mode = Some(mode & 0o7777);
        self
    }

    /// The host id of in-sandbox id `id` (`what`: uid or gid, for the error).
    fn host_id(&self, what: &str, id: u32) -> Result<u32> {
        if id >= 65_536 {
            return Err(RuntimeError::BadRequest(format!("{what} {id} is outside the sandbox's ids: give 0 to 65535")));
        }
        Ok(self.base + id)
    }

    /// Like [`open`](Self::open), holding `gate` (the sandbox's root-swap lock) while alive.
    pub fn open_gated(rootfs: &Path, uid: u32, gate: tokio::sync::OwnedRwLockReadGuard<()>) -> Result<SandboxFs> {
        let mut fs = SandboxFs::open(rootfs, uid)?;
        fs._gate = Some(gate);
        Ok(fs)
    }

    fn open_at(&self, path: &SbPath, flags: i32, mode: u32) -> Result<OwnedFd> {
        openat2(self.root.as_fd(), path.rel(), flags, mode, IN_ROOT)
            .map_err(|e| errno_to_error("open", path, sys_to_nix(e)))
    }

    /// An `O_PATH` fd of a directory of the sandbox (for watching it).
    pub(crate) fn open_dir(&self, path: &SbPath) -> Result<OwnedFd> {
        self.open_at(path, libc::O_PATH | libc::O_DIRECTORY, 0)
    }

    /// The extended attributes of `path` whose names start with `prefix` (prefix stripped), as
    /// text; symlinks, special files and attributes that are not UTF-8 give none.
    pub fn user_xattrs(&self, path: &SbPath, prefix: &str) -> Result<std::collections::BTreeMap<String, String>> {
        let mut out = std::collections::BTreeMap::new();
        let fd = self.open_at(path, libc::O_PATH | libc::O_NOFOLLOW, 0)?;
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(|e| errno_to_error("stat", path, e))?;
        let fmt = st.st_mode & SFlag::S_IFMT.bits();
        if fmt != SFlag::S_IFREG.bits() && fmt != SFlag::S_IFDIR.bits() {
            return Ok(out);
        }
        // An O_PATH fd takes no f*xattr calls; its /proc/self/fd link reaches the same inode.
        let via = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let names = xattr::list_deref(&via).map_err(|e| errno_to_error("list xattrs of", path, io_to_nix(e)))?;
        for name in names {
            let Some(key) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else { continue };
            let value =
                xattr::get_deref(&via, &name).map_err(|e| errno_to_error("read xattr of", path, io_to_nix(e)))?;
            if let Some(v) = value.filter(|v| v.len() <= MAX_XATTR_VALUE).and_then(|v| String::from_utf8(v).ok()) {
                out.insert(key.to_string(), v);
            }
        }
        Ok(out)
    }

    fn parent_dir(&self, path: &SbPath) -> Result<OwnedFd> {
        self.open_at(&path.parent(), libc::O_PATH | libc::O_DIRECTORY, 0)
    }

    fn stat_in(&self, dir: BorrowedFd<'_>, path: &SbPath) -> Result<EntryInfo> {
        stat_named(dir, std::ffi::OsStr::new(path.name()), path, self.base)
    }

    pub fn stat(&self, path: &SbPath) -> Result<EntryInfo> {
        if path.is_root() {
            let st = nix::sys::stat::fstat(self.root.as_raw_fd()).map_err(|e| errno_to_error("stat", path, e))?;
            return Ok(entry(path, &st, None, self.base));
        }
        let dir = self.parent_dir(path)?;
        self.stat_in(dir.as_fd(), path)
    }

    /// Open a regular file for reading.
    pub fn open_read(&self, path: &SbPath) -> Result<(File, u64)> {
        // O_NONBLOCK: opening a FIFO the sandbox made must not block the daemon.
        let fd = self.open_at(path, libc::O_RDONLY | libc::O_NONBLOCK, 0)?;
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(|e| errno_to_error("stat", path, e))?;
        let fmt = st.st_mode & SFlag::S_IFMT.bits();
        if fmt == SFlag::S_IFDIR.bits() {
            return Err(RuntimeError::BadRequest(format!(
                "{} is a directory: use the list endpoint (files.list) instead",
                path.display()
            )));
        }
        if fmt != SFlag::S_IFREG.bits() {
            return Err(RuntimeError::BadRequest(format!(
                "{} is not a regular file (a FIFO, socket or device): read it from a command instead",
                path.display()
            )));
        }
        nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()))
            .map_err(|e| errno_to_error("open", path, e))?;
        Ok((File::from(fd), st.st_size as u64))
    }

    /// Start writing a file: data goes to a hidden temporary file beside it, which
    /// [`commit`](Self::commit) renames over the target, so a failed or oversized upload never
    /// destroys the previous content. Parents are created. The file belongs to the sandbox's root;
    /// it keeps the previous file's mode unless `mode` is given.
    pub fn begin_write(&self, path: &SbPath, mode: Option<u32>) -> Result<Upload> {
        if path.is_root() {
            return Err(RuntimeError::BadRequest("cannot write to / : give a file path".into()));
        }
        self.mkdir(&path.parent(), true)?;
        let dir = self.open_at(&path.parent(), libc::O_PATH | libc::O_DIRECTORY, 0)?;
        let existing = fstatat(Some(dir.as_raw_fd()), path.name(), AtFlags::AT_SYMLINK_NOFOLLOW).ok();
        if existing.is_some_and(|st| st.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFDIR.bits()) {
            return Err(RuntimeError::BadRequest(format!("{} is a directory: give a file path", path.display())));
        }
        let mode = mode
            .or(existing.filter(|st| st.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFREG.bits()).map(|st| st.st_mode))
            .unwrap_or(0o644)
            & 0o7777;
        let tmp = format!("{UPLOAD_TMP_PREFIX}{}", uuid::Uuid::new_v4().simple());
        let fd = openat2(
            dir.as_fd(),
            &tmp,
            libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
            0o600,
            RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS,
        )
        .map_err(|e| errno_to_error("create", path, sys_to_nix(e)))?;
        let up = Upload { file: Some(File::from(fd)), dir, tmp, dst: path.clone(), committed: false };
        let raw = up.file.as_ref().expect("set").as_raw_fd();
        nix::unistd::fchown(raw, Some(self.uid.into()), Some(self.gid.into()))
            .map_err(|e| errno_to_error("chown", path, e))?;
        nix::sys::stat::fchmod(raw, Mode::from_bits_truncate(mode)).map_err(|e| errno_to_error("chmod", path, e))?;
        Ok(up)
    }

    /// Atomically put an upload in place, its data on disk first.
    pub fn commit(&self, up: Upload) -> Result<EntryInfo> {
        self.commit_with(up, true)
    }

    /// [`SandboxFs::commit`]; `sync: false` leaves the data to the page cache (for a file the
    /// daemon writes again whenever it is needed).
    pub fn commit_with(&self, up: Upload, sync: bool) -> Result<EntryInfo> {
        self.put_in_place(up, sync, nix::fcntl::RenameFlags::empty(), "write")
    }

    /// [`SandboxFs::commit`], refused (`Conflict`) if the target exists by then: the file is
    /// new or nothing changes.
    pub fn commit_new(&self, up: Upload) -> Result<EntryInfo> {
        self.put_in_place(up, true, nix::fcntl::RenameFlags::RENAME_NOREPLACE, "create")
    }

    /// Rename an upload over its target (`flags`: renameat2's), its data on disk first if `sync`.
    fn put_in_place(
        &self,
        mut up: Upload,
        sync: bool,
        flags: nix::fcntl::RenameFlags,
        what: &str,
    ) -> Result<EntryInfo> {
        if let Some(f) = up.file.take().filter(|_| sync) {
            f.sync_data().ok();
        }
        nix::fcntl::renameat2(
            Some(up.dir.as_raw_fd()),
            up.tmp.as_str(),
            Some(up.dir.as_raw_fd()),
            up.dst.name(),
            flags,
        )
        .map_err(|e| errno_to_error(what, &up.dst, e))?;
        up.committed = true;
        self.stat_in(up.dir.as_fd(), &up.dst)
    }

    /// Set the mode of `path` (a symlink's target, inside the root).
    pub fn chmod(&self, path: &SbPath, mode: u32) -> Result<EntryInfo> {
        if mode > 0o7777 {
            return Err(RuntimeError::BadRequest(format!("mode {mode:o} is not a file mode: give at most 0o7777")));
        }
        let fd = self.open_at(path, libc::O_PATH, 0)?;
        chmod_fd(&fd, mode).map_err(|e| errno_to_error("chmod", path, e))?;
        self.stat_fd(&fd, path)
    }

    /// Set the owner and/or group of `path` (in-sandbox ids; a symlink's target, inside the root).
    pub fn chown(&self, path: &SbPath, uid: Option<u32>, gid: Option<u32>) -> Result<EntryInfo> {
        let uid = uid.map(|u| self.host_id("uid", u)).transpose()?;
        let gid = gid.map(|g| self.host_id("gid", g)).transpose()?;
        let fd = self.open_at(path, libc::O_PATH, 0)?;
        nix::unistd::fchownat(
            Some(fd.as_raw_fd()),
            "",
            uid.map(Into::into),
            gid.map(Into::into),
            AtFlags::AT_EMPTY_PATH,
        )
        .map_err(|e| errno_to_error("chown", path, e))?;
        self.stat_fd(&fd, path)
    }

    /// The entry of an fd opened at `path` (its target when `path` is a symlink).
    fn stat_fd(&self, fd: &OwnedFd, path: &SbPath) -> Result<EntryInfo> {
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(|e| errno_to_error("stat", path, e))?;
        Ok(entry(path, &st, None, self.base))
    }

    pub fn mkdir(&self, path: &SbPath, parents: bool) -> Result<EntryInfo> {
        if path.is_root() {
            return self.stat(path);
        }
        let mut cur = SbPath { parts: vec![] };
        let n = path.parts.len();
        for (i, part) in path.parts.iter().enumerate() {
            let parent = self.open_at(&cur, libc::O_PATH | libc::O_DIRECTORY, 0)?;
            cur = cur.join(part);
            let last = i + 1 == n;
            if !last && !parents {
                continue;
            }
            match nix::sys::stat::mkdirat(Some(parent.as_raw_fd()), part.as_str(), Mode::from_bits_truncate(0o755)) {
                Ok(()) => {
                    nix::unistd::fchownat(
                        Some(parent.as_raw_fd()),
                        part.as_str(),
                        Some(self.uid.into()),
                        Some(self.gid.into()),
                        AtFlags::AT_SYMLINK_NOFOLLOW,
                    )
                    .map_err(|e| errno_to_error("chown", &cur, e))?;
                    if let Some(mode) = self.dir_mode {
                        // Through an fd of the new directory itself (a symlink put in its place
                        // meanwhile is not followed).
                        let fd = openat2(
                            parent.as_fd(),
                            part,
                            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW,
                            0,
                            RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS,
                        )
                        .map_err(|e| errno_to_error("chmod", &cur, sys_to_nix(e)))?;
                        chmod_fd(&fd, mode).map_err(|e| errno_to_error("chmod", &cur, e))?;
                    }
                }
                Err(nix::Error::EEXIST) if parents || !last => {
                    // Must be (or lead to) a directory.
                    self.open_at(&cur, libc::O_PATH | libc::O_DIRECTORY, 0)?;
                }
                Err(e) => return Err(errno_to_error("mkdir", &cur, e)),
            }
        }
        self.stat(path)
    }

    pub fn list(&self, path: &SbPath, depth: u32) -> Result<Vec<EntryInfo>> {
        let dir = self.open_at(path, libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
        let mut out = Vec::new();
        self.list_into(dir, path, depth.max(1), &mut out)?;
        Ok(out)
    }

    fn list_into(&self, dir: OwnedFd, path: &SbPath, depth: u32, out: &mut Vec<EntryInfo>) -> Result<()> {
        let raw = dir.as_raw_fd();
        let mut d = nix::dir::Dir::from_fd(std::os::fd::IntoRawFd::into_raw_fd(dir))
            .map_err(|e| errno_to_error("list", path, e))?;
        // Names are bytes: one that is not UTF-8 is listed under a lossy rendering (U+FFFD).
        let mut names: Vec<std::ffi::OsString> = d
            .iter()
            .filter_map(|e| e.ok())
            .map(|e| std::ffi::OsStr::from_bytes(e.file_name().to_bytes()).to_os_string())
            .filter(|n| n != "." && n != "..")
            .collect();
        names.sort();
        // SAFETY: `d` owns `raw` and stays alive for the rest of this function.
        let dirfd = unsafe { BorrowedFd::borrow_raw(raw) };
        for name in names {
            if out.len() >= MAX_LIST_ENTRIES {
                return Err(RuntimeError::TooLarge(format!(
                    "more than {MAX_LIST_ENTRIES} entries under {}: list a smaller directory or a lower depth",
                    path.display()
                )));
            }
            let child = path.join(&name.to_string_lossy());
            let info = match stat_named(dirfd, &name, &child, self.base) {
                Ok(i) => i,
                Err(RuntimeError::NotFound { .. }) => continue, // removed meanwhile
                Err(e) => return Err(e),
            };
            let is_dir = info.kind == "dir";
            out.push(info);
            if is_dir && depth > 1 {
                let sub =
                    openat2(dirfd, &name, libc::O_RDONLY | libc::O_DIRECTORY, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
                        .map_err(|e| errno_to_error("list", &child, sys_to_nix(e)))?;
                self.list_into(sub, &child, depth - 1, out)?;
            }
        }
        drop(d);
        Ok(())
    }

    pub fn remove(&self, path: &SbPath, recursive: bool) -> Result<()> {
        if path.is_root() {
            return Err(RuntimeError::BadRequest("refusing to remove / : give a path below it".into()));
        }
        let parent = self.parent_dir(path)?;
        let info = self.stat_in(parent.as_fd(), path)?;
        if info.kind == "dir" {
            if recursive {
                let dir = openat2(
                    parent.as_fd(),
                    path.name(),
                    libc::O_RDONLY | libc::O_DIRECTORY,
                    0,
                    RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS,
                )
                .map_err(|e| errno_to_error("remove", path, sys_to_nix(e)))?;
                remove_contents(dir, path)?;
            }
            nix::unistd::unlinkat(Some(parent.as_raw_fd()), path.name(), nix::unistd::UnlinkatFlags::RemoveDir)
                .map_err(|e| errno_to_error("remove", path, e))
        } else {
            nix::unistd::unlinkat(Some(parent.as_raw_fd()), path.name(), nix::unistd::UnlinkatFlags::NoRemoveDir)
                .map_err(|e| errno_to_error("remove", path, e))
        }
    }

    pub fn rename(&self, from: &SbPath, to: &SbPath) -> Result<EntryInfo> {
        if from.is_root() || to.is_root() {
            return Err(RuntimeError::BadRequest("cannot rename / or onto /".into()));
        }
        let a = self.parent_dir(from)?;
        self.mkdir(&to.parent(), true)?;
        let b = self.parent_dir(to)?;
        nix::fcntl::renameat(Some(a.as_raw_fd()), from.name(), Some(b.as_raw_fd()), to.name())
            .map_err(|e| errno_to_error("rename", from, e))?;
        self.stat(to)
    }
}

/// A file being written; dropped without [`SandboxFs::commit`], its temporary file is removed.
pub struct Upload {
    file: Option<File>,
    dir: OwnedFd,
    tmp: String,
    dst: SbPath,
    committed: bool,
}

impl Upload {
    pub fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("upload already committed")
    }
    pub fn take_file(&mut self) -> File {
        self.file.take().expect("upload already committed")
    }
    pub fn put_file(&mut self, f: File) {
        self.file = Some(f);
    }
    /// Set an extended attribute on the file before it is committed (so it appears with it).
    pub fn set_xattr(&self, name: &str, value: &[u8]) -> Result<()> {
        use xattr::FileExt;
        let f = self.file.as_ref().expect("upload already committed");
        f.set_xattr(name, value).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOTSUP) => RuntimeError::BadRequest(format!(
                "{}: the sandbox's filesystem keeps no extended attributes: upload without metadata",
                self.dst.display()
            )),
            Some(libc::E2BIG) | Some(libc::ENOSPC) | Some(libc::ERANGE) => RuntimeError::TooLarge(format!(
                "{}: the file's metadata is too large for its filesystem's extended attributes",
                self.dst.display()
            )),
            _ => errno_to_error("set xattr of", &self.dst, io_to_nix(e)),
        })
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        if !self.committed {
            let _ = nix::unistd::unlinkat(
                Some(self.dir.as_raw_fd()),
                self.tmp.as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            );
        }
    }
}

/// Remove everything below an open directory without following symlinks.
/// Stat entry `name` (any bytes) of `dir`; `shown` is its path as the answer names it.
fn stat_named(dir: BorrowedFd<'_>, name: &std::ffi::OsStr, shown: &SbPath, base: u32) -> Result<EntryInfo> {
    let st = fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(|e| errno_to_error("stat", shown, e))?;
    let target = if st.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFLNK.bits() {
        nix::fcntl::readlinkat(Some(dir.as_raw_fd()), name).ok().map(|t| t.to_string_lossy().into_owned())
    } else {
        None
    };
    Ok(entry(shown, &st, target, base))
}

fn remove_contents(dir: OwnedFd, path: &SbPath) -> Result<()> {
    let raw = dir.as_raw_fd();
    let mut d = nix::dir::Dir::from_fd(std::os::fd::IntoRawFd::into_raw_fd(dir))
        .map_err(|e| errno_to_error("remove", path, e))?;
    let entries: Vec<(std::ffi::OsString, bool)> = d
        .iter()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = std::ffi::OsStr::from_bytes(e.file_name().to_bytes()).to_os_string();
            (name != "." && name != "..").then_some((name, e.file_type() == Some(nix::dir::Type::Directory)))
        })
        .collect();
    // SAFETY: `d` owns `raw` and outlives every use below.
    let dirfd = unsafe { BorrowedFd::borrow_raw(raw) };
    for (name, is_dir) in entries {
        let child = path.join(&name.to_string_lossy());
        if is_dir {
            let sub =
                openat2(dirfd, &name, libc::O_RDONLY | libc::O_DIRECTORY, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
                    .map_err(|e| errno_to_error("remove", &child, sys_to_nix(e)))?;
            remove_contents(sub, &child)?;
            nix::unistd::unlinkat(Some(raw), name.as_os_str(), nix::unistd::UnlinkatFlags::RemoveDir)
                .map_err(|e| errno_to_error("remove", &child, e))?;
        } else {
            nix::unistd::unlinkat(Some(raw), name.as_os_str(), nix::unistd::UnlinkatFlags::NoRemoveDir)
                .map_err(|e| errno_to_error("remove", &child, e))?;
        }
    }
    drop(d);
    Ok(())
}

use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;

/// A user of a sandbox, from its /etc/passwd.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// Find `name` in a passwd file's text.
pub fn find_user(passwd: &str, name: &str) -> Option<SandboxUser> {
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() < 7 || f[0] != name {
            return None;
        }
        Some(SandboxUser { name: name.into(), uid: f[2].parse().ok()?, gid: f[3].parse().ok()?, home: f[5].into() })
    })
}

/// Names of the ids of a passwd or group file's text (third field), by id.
pub fn id_names(text: &str) -> std::collections::HashMap<u32, String> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            let id = f.nth(1)?.parse().ok()?;
            Some((id, name.to_string()))
        })
        .collect()
}

/// A text file of the sandbox whose merged root is `rootfs` (at most 4 MiB of it), read through
/// its root.
fn read_small(rootfs: &Path, path: &str) -> Result<String> {
    use std::io::Read;
    let fs = SandboxFs::open(rootfs, 0)?;
    let (file, _) = fs.open_read(&SbPath::parse(path)?)?;
    let mut text = String::new();
    file.take(4 << 20).read_to_string(&mut text).map_err(RuntimeError::io("read a sandbox file"))?;
    Ok(text)
}

/// Whether any of `paths` opens for reading as a regular file in the sandbox whose merged root
/// is `rootfs` (symlinks followed inside it); the root is opened once for all of them.
pub(crate) fn any_readable_file<S: AsRef<str>>(rootfs: &Path, paths: impl IntoIterator<Item = S>) -> bool {
    let Ok(fs) = SandboxFs::open(rootfs, 0) else { return false };
    paths.into_iter().any(|p| SbPath::parse(p.as_ref()).is_ok_and(|p| fs.open_read(&p).is_ok()))
}

/// Look a user up in the sandbox whose merged root is `rootfs` (read through its root, so a
/// symlinked /etc/passwd cannot point outside).
pub fn lookup_user(rootfs: &Path, name: &str) -> Result<SandboxUser> {
    let unknown = || {
        RuntimeError::BadRequest(format!(
            "user {name:?} does not exist in the sandbox: use \"root\" or a user of its /etc/passwd"
        ))
    };
    if name.is_empty() || name.contains(':') {
        return Err(unknown());
    }
    let text = read_small(rootfs, "/etc/passwd").map_err(|_| unknown())?;
    find_user(&text, name).ok_or_else(unknown)
}

impl crate::Runtime {
    pub async fn fs(self: &Arc<Self>, id: &str) -> Result<SandboxFs> {
        self.fs_as(id, None).await
    }

    /// A user of the sandbox (its /etc/passwd).
    pub fn sandbox_user(&self, id: &str, name: &str) -> Result<SandboxUser> {
        lookup_user(&self.get(id)?.rootfs(), name)
    }

    /// The sandbox's user and group names by id (from its /etc/passwd and /etc/group; empty
    /// where it has none).
    pub fn sandbox_id_names(
        &self,
        id: &str,
    ) -> Result<(std::collections::HashMap<u32, String>, std::collections::HashMap<u32, String>)> {
        let root = self.get(id)?.rootfs();
        let names = |f: &str| read_small(&root, f).map(|t| id_names(&t)).unwrap_or_default();
        Ok((names("/etc/passwd"), names("/etc/group")))
    }

    /// The sandbox's files, new ones owned by `user` (root when None).
    pub async fn fs_as(self: &Arc<Self>, id: &str, user: Option<&str>) -> Result<SandboxFs> {
        let sb = self.ready(id).await?;
        let gate = sb.fs_gate.clone().read_owned().await;
        let map = self.cfg.idmap;
        let fs = SandboxFs::open_gated(&sb.rootfs(), map.host_base, gate)?;
        match user {
            None | Some("root") => Ok(fs),
            Some(name) => {
                let u = lookup_user(&sb.rootfs(), name)?;
                match (map.to_host(u.uid), map.to_host(u.gid)) {
                    (Some(uid), Some(gid)) => Ok(fs.owned_by(uid, gid)),
                    _ => Err(RuntimeError::BadRequest(format!(
                        "user {name:?} has ids outside the sandbox's user namespace: use another user"
                    ))),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_and_id_names_come_from_passwd_text() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbad:line\n";
        let u = find_user(passwd, "user").unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (1000, 1000, "/home/user"));
        assert!(find_user(passwd, "nobody").is_none() && find_user(passwd, "bad").is_none());
        let names = id_names(passwd);
        assert_eq!(names.get(&1000).map(String::as_str), Some("user"));
        assert_eq!(names.len(), 2);
        assert_eq!(sandbox_id(1_001_000, 1_000_000), 1000);
        assert_eq!(sandbox_id(5, 1_000_000), 65_534);
    }

    #[test]
    fn lexical_escape_is_refused_and_paths_normalise() {
        assert!(matches!(SbPath::parse("/../etc/shadow"), Err(RuntimeError::PathEscape(_))));
        assert!(matches!(SbPath::parse("a/../../x"), Err(RuntimeError::PathEscape(_))));
        assert_eq!(SbPath::parse("/a/./b/../c//d").unwrap().display(), "/a/c/d");
        assert!(SbPath::parse("/").unwrap().is_root());
        assert!(SbPath::parse("").is_err());
        assert!(SbPath::parse("a\0b").is_err());
    }

    /// Uses the real syscalls on a temp dir standing in for a sandbox root (no root needed).
    #[test]
    fn symlinks_resolve_inside_the_root() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "host").unwrap();
        let root = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), root.path().join("abs")).unwrap();
        std::os::unix::fs::symlink("../../../../../../", root.path().join("up")).unwrap();
        let me = nix::unistd::getuid().as_raw();
        let fs = SandboxFs::open(root.path(), me).unwrap();
        // The absolute symlink is resolved inside the root, where its target does not exist.
        assert!(matches!(fs.open_read(&SbPath::parse("/abs").unwrap()), Err(RuntimeError::NotFound { .. })));
        // Writing through it creates the file inside the root and leaves the host file untouched.
        use std::io::Write;
        let target = outside.path().join("secret");
        let mut up = fs.begin_write(&SbPath::parse("/abs").unwrap(), None).unwrap();
        up.file().write_all(b"sandbox").unwrap();
        fs.commit(up).unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "host");
        // The symlink itself was replaced by the new file, inside the root.
        assert_eq!(std::fs::read_to_string(root.path().join("abs")).unwrap(), "sandbox");
        // Writing below a symlinked directory: dangling inside the root, it fails...
        std::os::unix::fs::symlink(outside.path(), root.path().join("dirlink")).unwrap();
        assert!(fs.begin_write(&SbPath::parse("/dirlink/secret").unwrap(), None).is_err());
        // ...and once its target exists inside the root, the write lands there.
        let in_root = root.path().join(outside.path().strip_prefix("/").unwrap());
        std::fs::create_dir_all(&in_root).unwrap();
        let mut up = fs.begin_write(&SbPath::parse("/dirlink/secret").unwrap(), None).unwrap();
        up.file().write_all(b"x").unwrap();
        fs.commit(up).unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "host");
        assert_eq!(std::fs::read_to_string(in_root.join("secret")).unwrap(), "x");
        // A relative symlink climbing out stays clamped at the root.
        let listed = fs.list(&SbPath::parse("/up").unwrap(), 1).unwrap();
        assert!(listed.iter().any(|e| e.name == "abs"), "listing /up must list the sandbox root");
    }

    #[test]
    fn mkdir_write_list_rename_remove() {
        let root = tempfile::tempdir().unwrap();
        let me = nix::unistd::getuid().as_raw();
        let fs = SandboxFs::open(root.path(), me).unwrap();
        let p = |s: &str| SbPath::parse(s).unwrap();
        fs.mkdir(&p("/a/b/c"), true).unwrap();
        assert!(matches!(fs.mkdir(&p("/a/b/c"), false), Err(RuntimeError::Conflict(_))));
        use std::io::Write;
        let mut up = fs.begin_write(&p("/a/b/f.txt"), Some(0o600)).unwrap();
        up.file().write_all(b"hey").unwrap();
        fs.commit(up).unwrap();
        // An abandoned upload leaves the old content and no temporary file.
        let mut up = fs.begin_write(&p("/a/b/f.txt"), None).unwrap();
        up.file().write_all(b"partial").unwrap();
        drop(up);
        assert_eq!(std::fs::read_to_string(root.path().join("a/b/f.txt")).unwrap(), "hey");
        assert_eq!(std::fs::read_dir(root.path().join("a/b")).unwrap().count(), 2);
        let st = fs.stat(&p("/a/b/f.txt")).unwrap();
        assert_eq!((st.kind.as_str(), st.size, st.mode), ("file", 3, 0o600));
        let all = fs.list(&p("/a"), 3).unwrap();
        let names: Vec<_> = all.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(names, vec!["/a/b", "/a/b/c", "/a/b/f.txt"]);
        fs.rename(&p("/a/b/f.txt"), &p("/z/g.txt")).unwrap();
        assert!(fs.stat(&p("/a/b/f.txt")).is_err());
        assert!(matches!(fs.remove(&p("/a"), false), Err(RuntimeError::Conflict(_))));
        fs.remove(&p("/a"), true).unwrap();
        assert!(matches!(fs.stat(&p("/a")), Err(RuntimeError::NotFound { .. })));
        assert!(fs.remove(&p("/"), true).is_err());
    }

    #[test]
    fn modes_owners_and_new_only_writes() {
        let root = tempfile::tempdir().unwrap();
        let me = nix::unistd::getuid().as_raw();
        let p = |s: &str| SbPath::parse(s).unwrap();
        assert!(matches!(
            SandboxFs::open(root.path(), me).unwrap().owned_by_ids(65_536, 0),
            Err(RuntimeError::BadRequest(_))
        ));
        // In-sandbox id 0 is the host id the handle was opened with (`me`).
        let fs = SandboxFs::open(root.path(), me).unwrap().owned_by_ids(0, 0).unwrap().with_dir_mode(0o777);
        // New directories get the mode asked for, the umask notwithstanding.
        assert_eq!(fs.mkdir(&p("/d/e"), true).unwrap().mode, 0o777);
        assert_eq!(fs.stat(&p("/d")).unwrap().mode, 0o777);
        use std::io::Write;
        let mut up = fs.begin_write(&p("/d/f"), Some(0o666)).unwrap();
        up.file().write_all(b"one").unwrap();
        let en = fs.commit_new(up).unwrap();
        assert_eq!((en.mode, en.uid), (0o666, 0));
        assert!(en.ctime > 0.0 && en.atime > 0.0);
        // A second new-only write of the same path changes nothing and leaves no temporary file.
        let mut up = fs.begin_write(&p("/d/f"), None).unwrap();
        up.file().write_all(b"two").unwrap();
        assert!(matches!(fs.commit_new(up), Err(RuntimeError::Conflict(_))));
        assert_eq!(std::fs::read_to_string(root.path().join("d/f")).unwrap(), "one");
        assert_eq!(std::fs::read_dir(root.path().join("d")).unwrap().count(), 2);
        // chmod and chown reach a symlink's target inside the root.
        std::os::unix::fs::symlink("/d/f", root.path().join("link")).unwrap();
        assert_eq!(fs.chmod(&p("/link"), 0o640).unwrap().mode, 0o640);
        assert_eq!(fs.stat(&p("/d/f")).unwrap().mode, 0o640);
        assert!(matches!(fs.chmod(&p("/d/f"), 0o10000), Err(RuntimeError::BadRequest(_))));
        assert_eq!(fs.chown(&p("/d/f"), Some(0), None).unwrap().uid, 0);
        assert!(matches!(fs.chown(&p("/d/f"), None, Some(70_000)), Err(RuntimeError::BadRequest(_))));
        assert!(matches!(fs.chmod(&p("/nope"), 0o600), Err(RuntimeError::NotFound { .. })));
    }
}
