//! Moving a running sandbox onto a new layer stack, from the host, in about a millisecond.
//!
//! A checkpoint freezes the sandbox's writable layer (its overlay *upper* dir becomes a read-only
//! snapshot layer) and the sandbox goes on with a fresh upper stacked on it. Two things make that
//! safe while processes keep running:
//!
//! 1. [`swap_root`]: the new overlay is attached inside the sandbox's mount namespace and
//!    `pivot_root` moves every process whose root is the old overlay onto it (the kernel rewrites
//!    the root and cwd of all such processes). /proc, /dev, /sys move across first. The old overlay
//!    is then detached: only stale references keep it alive.
//! 2. [`pin_open_files`]: a file that a sandbox process holds open for writing (or maps shared and
//!    writable) would keep writing into the frozen layer through its fd. Before the swap its inode
//!    is hard-linked into the *new* upper, and the frozen layer gets a copy (a reflink where the
//!    filesystem can) renamed over its old name. Writes through the old fd then land in the live
//!    layer, and the snapshot keeps the content of the checkpoint instant.
//!
//! Everything here is blocking and runs on a worker thread; [`swap_root`] runs its namespace work
//! on a dedicated OS thread because `setns(CLONE_NEWNS)` needs an unshared fs context.

use crate::error::{Result, RuntimeError};
use bb_sys::ns;
use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// Moving a sandbox onto a new root failed at a step.
#[derive(Debug, thiserror::Error)]
pub enum RootSwapError {
    #[error("{what}: {source}")]
    Step {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("the mount namespace worker is gone")]
    WorkerGone,
    #[error("the mount namespace worker panicked")]
    WorkerPanicked,
}

fn err(what: impl Into<String>, e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> RuntimeError {
    RootSwapError::Step { what: what.into(), source: e.into() }.into()
}

/// Replace the sandbox's root overlay with `new_mnt` (a detached overlay mount from
/// [`bb_layers::overlay_fd`]) inside the sandbox (pid `init_pid`'s mount namespace). Returns a
/// second mount of the same overlay for the host side: attach it with [`attach_host_root`] (that
/// can wait until the sandbox is thawed).
pub fn swap_root(init_pid: i32, new_mnt: OwnedFd) -> Result<OwnedFd> {
    let t0 = std::time::Instant::now();
    let mntns =
        fs::File::open(format!("/proc/{init_pid}/ns/mnt")).map_err(|e| err("open sandbox mount namespace", e))?;
    // A second mount of the same overlay instance for the host side.
    let host_clone = ns::open_tree(new_mnt.as_fd(), Path::new(""), ns::OPEN_TREE_CLONE | ns::OPEN_TREE_CLOEXEC)
        .map_err(|e| err("clone new root mount", e))?;
    // Read from the host: inside the sandbox's mount namespace, /proc is the sandbox's.
    let submounts = root_submounts(init_pid).map_err(|e| err("read sandbox mount table", e))?;
    ns_worker().run(mntns.into(), Box::new(move || pivot_inside(&new_mnt, &submounts)))?;
    tracing::debug!(took = ?t0.elapsed(), "swap_root");
    Ok(host_clone)
}

/// Attach `host_clone` (from [`swap_root`]) at `host_rootfs` (an empty dir). The old host-side
/// root is unmounted later, off the critical path (unmounting waits for an RCU grace period).
pub fn attach_host_root(host_rootfs: &Path, host_clone: OwnedFd) -> Result<()> {
    ns::move_mount(Some(host_clone.as_fd()), Path::new(""), None, host_rootfs, ns::MOVE_MOUNT_F_EMPTY_PATH)
        .map_err(|e| err("attach new host-side root", e))
}

/// Attach the detached mount `mnt` at `path` (absolute, an existing directory) inside the
/// sandbox of pid `init_pid`; with `replace`, whatever is mounted at `path` is detached first
/// (the sandbox is frozen then: nothing sees the path in between). Used for volumes.
pub fn mount_in_sandbox(init_pid: i32, mnt: OwnedFd, path: &Path, replace: bool) -> Result<()> {
    let mntns =
        fs::File::open(format!("/proc/{init_pid}/ns/mnt")).map_err(|e| err("open sandbox mount namespace", e))?;
    let path = path.to_path_buf();
    ns_worker().run(
        mntns.into(),
        Box::new(move || {
            if replace {
                ns::umount2(&path, libc::MNT_DETACH).map_err(|e| err(format!("detach {}", path.display()), e))?;
            }
            ns::move_mount(Some(mnt.as_fd()), Path::new(""), None, &path, ns::MOVE_MOUNT_F_EMPTY_PATH)
                .map_err(|e| err(format!("mount at {}", path.display()), e))
        }),
    )
}

type NsJob = Box<dyn FnOnce() -> Result<()> + Send>;

/// Long-lived threads that enter sandbox mount namespaces on request. `setns(CLONE_NEWNS)`
/// needs a thread with its own fs context (`unshare(CLONE_FS)`); keeping such threads saves
/// spawning one per swap. After each job a thread returns to the host's mount namespace.
/// A few of them, so that swaps of different sandboxes (a fork's children) do not queue.
struct NsWorker {
    tx: parking_lot::Mutex<std::sync::mpsc::Sender<NsTask>>,
}

/// A job for an [`NsWorker`]: the mount namespace to enter, the work, where to answer.
type NsTask = (OwnedFd, NsJob, std::sync::mpsc::Sender<Result<()>>);

const NS_WORKERS: usize = 4;

fn ns_worker() -> &'static NsWorker {
    static WORKERS: std::sync::OnceLock<Vec<NsWorker>> = std::sync::OnceLock::new();
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let workers = WORKERS.get_or_init(|| (0..NS_WORKERS).map(|_| spawn_ns_worker()).collect());
    &workers[NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % workers.len()]
}

fn spawn_ns_worker() -> NsWorker {
    {
        let (tx, rx) = std::sync::mpsc::channel::<(OwnedFd, NsJob, std::sync::mpsc::Sender<Result<()>>)>();
        std::thread::Builder::new()
            .name("bb-mntns".into())
            .spawn(move || {
                let setup = ns::unshare(libc::CLONE_FS).map_err(|e| err("unshare fs context", e)).and_then(|()| {
                    fs::File::open("/proc/thread-self/ns/mnt").map_err(|e| err("open host mount namespace", e))
                });
                for (target, job, reply) in rx {
                    let res = match &setup {
                        Err(e) => Err(err("set up the mount namespace worker", e.to_string())),
                        Ok(host) => ns::setns(target.as_fd(), libc::CLONE_NEWNS)
                            .map_err(|e| err("enter sandbox mount namespace", e))
                            .and_then(|()| {
                                let r = job();
                                // Back home; a failure here would leave this thread in a sandbox.
                                ns::setns(host.as_fd(), libc::CLONE_NEWNS).expect("return to the host mount namespace");
                                r
                            }),
                    };
                    let _ = reply.send(res);
                }
            })
            .expect("spawn mount namespace worker");
        NsWorker { tx: parking_lot::Mutex::new(tx) }
    }
}

impl NsWorker {
    fn run(&self, target: OwnedFd, job: NsJob) -> Result<()> {
        let (reply_tx, reply_rx) = std::sync::mpsc::channel();
        self.tx.lock().send((target, job, reply_tx)).map_err(|_| RootSwapError::WorkerGone)?;
        reply_rx.recv().map_err(|_| RootSwapError::WorkerPanicked)?
    }
}

/// Runs on a thread inside the sandbox's mount namespace, whose root and cwd are the sandbox's `/`.
fn pivot_inside(new_mnt: &OwnedFd, submounts: &[PathBuf]) -> Result<()> {
    let t0 = std::time::Instant::now();
    // Stack the new root on `/`: processes keep resolving from the old root until the pivot.
    ns::move_mount(Some(new_mnt.as_fd()), Path::new(""), None, Path::new("/"), ns::MOVE_MOUNT_F_EMPTY_PATH)
        .map_err(|e| err("attach new root in sandbox", e))?;
    let t_attach = t0.elapsed();
    // /proc, /dev, /sys (with everything mounted below them) move onto the new root.
    for m in submounts {
        let rel = m.strip_prefix("/").unwrap_or(m);
        ns::move_mount(None, m, Some(new_mnt.as_fd()), rel, 0)
            .map_err(|e| err(format!("move {} to the new root", m.display()), e))?;
    }
    let t_moved = t0.elapsed();
    ns::fchdir(new_mnt.as_fd()).map_err(|e| err("enter new root", e))?;
    ns::pivot_root_to_cwd().map_err(|e| err("pivot to new root", e))?;
    tracing::debug!(?t_attach, ?t_moved, total = ?t0.elapsed(), "pivot_inside");
    Ok(())
}

/// Mount points directly below `/` in process `pid`'s mount namespace (`/proc`, `/dev`, ...), as
/// seen from its root.
fn root_submounts(pid: i32) -> std::io::Result<Vec<PathBuf>> {
    let info = fs::read_to_string(format!("/proc/{pid}/mountinfo"))?;
    let mut rows: Vec<(u64, u64, String)> = Vec::new();
    for line in info.lines() {
        let mut f = line.split(' ');
        let (Some(id), Some(parent), _, _, Some(point)) = (f.next(), f.next(), f.next(), f.next(), f.next()) else {
            continue;
        };
        let (Ok(id), Ok(parent)) = (id.parse(), parent.parse()) else { continue };
        rows.push((id, parent, unescape_mountinfo(point)));
    }
    // The root is the last mount listed at "/" (the top of any stack there).
    let Some(root_id) = rows.iter().rev().find(|r| r.2 == "/").map(|r| r.0) else {
        return Err(std::io::Error::other("no root mount in mountinfo"));
    };
    Ok(rows
        .into_iter()
        .filter(|r| r.1 == root_id && r.0 != root_id && r.2 != "/")
        .map(|r| PathBuf::from(r.2))
        .collect())
}

fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// What [`pin_open_files`] did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PinStats {
    /// Files moved to the live layer (a copy stays in the snapshot).
    pub files: usize,
    /// Bytes copied for them (0 when reflinked).
    pub bytes_copied: u64,
}

/// A sandbox-relative path of a regular file some process writes to, with the inode it has.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WrittenFile {
    pub path: PathBuf,
    pub ino: u64,
}

/// Files that processes `pids` hold open for writing or map shared-writable, on the overlay
/// whose device is `ovl_dev`. `proc` is a procfs showing them (the host's `/proc` with host
/// pids, or a sandbox's own with its pids).
pub fn written_files(proc: &Path, pids: &[i32], ovl_dev: u64) -> Vec<WrittenFile> {
    let mut out = HashSet::new();
    for pid in pids {
        let Ok(rd) = fs::read_dir(proc.join(pid.to_string()).join("fd")) else { continue };
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(flags) = fdinfo_flags(proc, *pid, &name) else { continue };
            if flags & libc::O_ACCMODE == libc::O_RDONLY {
                continue;
            }
            let Ok(meta) = fs::metadata(e.path()) else { continue };
            if meta.dev() != ovl_dev || !meta.file_type().is_file() {
                continue;
            }
            let Ok(target) = fs::read_link(e.path()) else { continue };
            if let Some(path) = sandbox_path(&target) {
                out.insert(WrittenFile { path, ino: meta.ino() });
            }
        }
        // Shared writable file mappings.
        let Ok(maps) = fs::File::open(proc.join(pid.to_string()).join("maps")) else { continue };
        for (ino, path) in bb_sys::process::shared_writable_file_maps(&maps).unwrap_or_default() {
            if let Some(p) = sandbox_path(&path) {
                out.insert(WrittenFile { path: p, ino });
            }
        }
    }
    let mut v: Vec<WrittenFile> = out.into_iter().collect();
    v.sort_by(|a, b| a.path.cmp(&b.path));
    v
}

/// Processes among `pids` (in procfs `proc`) whose working directory is on the overlay whose
/// device is `ovl_dev` (the root being frozen), with that directory's sandbox path. After a root
/// swap such a directory still belongs to the old root: files created or opened through it
/// would land in the frozen layer, so the caller moves these processes to the same path in the
/// new root.
pub fn stale_cwds(proc: &Path, pids: &[i32], ovl_dev: u64) -> Vec<(i32, PathBuf)> {
    pids.iter()
        .filter_map(|pid| {
            let cwd = proc.join(pid.to_string()).join("cwd");
            let dev = fs::metadata(&cwd).ok()?.dev();
            (dev == ovl_dev).then_some(())?;
            let target = fs::read_link(&cwd).ok()?;
            let path = if target == Path::new("/") {
                PathBuf::from("/")
            } else {
                PathBuf::from("/").join(sandbox_path(&target)?)
            };
            Some((*pid, path))
        })
        .collect()
}

fn fdinfo_flags(proc: &Path, pid: i32, fd: &OsStr) -> Option<i32> {
    let mut p = proc.join(pid.to_string()).join("fdinfo");
    p.push(fd);
    let text = fs::read_to_string(p).ok()?;
    let line = text.lines().find(|l| l.starts_with("flags:"))?;
    i32::from_str_radix(line["flags:".len()..].trim(), 8).ok()
}

/// A path as /proc shows it for a sandbox process's file, made relative to the sandbox root.
/// `None` for deleted files and anything that is not a plain absolute path.
fn sandbox_path(p: &Path) -> Option<PathBuf> {
    let b = p.as_os_str().as_bytes();
    if !b.starts_with(b"/") || b.ends_with(b" (deleted)") {
        return None;
    }
    let rel: PathBuf = p.components().filter(|c| matches!(c, Component::Normal(_))).collect();
    (!rel.as_os_str().is_empty() && p.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_))))
        .then_some(rel)
}

/// For each written file that lives in `old_upper` (the layer being frozen): hard-link its inode
/// into `new_upper` (creating parent dirs with the same owner and mode) and replace the entry in
/// `old_upper` by a copy. Files not in `old_upper` (still in a lower layer, never written) or
/// whose inode no longer matches are left alone: writing them needs a copy-up, which happens in
/// the new upper.
pub fn pin_open_files(files: &[WrittenFile], old_upper: &Path, new_upper: &Path) -> Result<PinStats> {
    let mut stats = PinStats::default();
    for f in files {
        let src = old_upper.join(&f.path);
        let Ok(meta) = fs::symlink_metadata(&src) else { continue };
        if meta.ino() != f.ino || !meta.file_type().is_file() {
            continue;
        }
        make_parents(old_upper, new_upper, &f.path)?;
        let dst = new_upper.join(&f.path);
        match fs::hard_link(&src, &dst) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(err(format!("link {} into the live layer", f.path.display()), e)),
        }
        stats.bytes_copied += copy_over(&src, &meta)?;
        stats.files += 1;
    }
    Ok(stats)
}

/// Undo [`pin_open_files`] after a failed swap: each moved inode goes back to its old place in
/// `old_upper` (over the copy), so the sandbox keeps writing where it reads.
pub fn unpin(files: &[WrittenFile], old_upper: &Path, new_upper: &Path) {
    for f in files {
        let moved = new_upper.join(&f.path);
        if fs::symlink_metadata(&moved).is_ok_and(|m| m.ino() == f.ino) {
            let _ = fs::rename(&moved, old_upper.join(&f.path));
        }
    }
}

/// Create the parent dirs of `rel` in `new_upper`, each with the owner, mode and times of the
/// same dir in `old_upper` (an upper dir's attributes are what the merged view shows).
fn make_parents(old_upper: &Path, new_upper: &Path, rel: &Path) -> Result<()> {
    let mut cur = PathBuf::new();
    let parent = rel.parent().unwrap_or(Path::new(""));
    for c in parent.components() {
        cur.push(c);
        let dst = new_upper.join(&cur);
        if dst.symlink_metadata().is_ok() {
            continue;
        }
        let meta = fs::symlink_metadata(old_upper.join(&cur)).map_err(|e| err("stat frozen dir", e))?;
        fs::create_dir(&dst).map_err(|e| err("create dir in live layer", e))?;
        std::os::unix::fs::lchown(&dst, Some(meta.uid()), Some(meta.gid())).map_err(|e| err("chown dir", e))?;
        fs::set_permissions(&dst, fs::Permissions::from_mode(meta.mode() & 0o7777)).map_err(|e| err("chmod dir", e))?;
    }
    Ok(())
}

/// Replace `path` with a copy of itself (new inode, same content, owner, mode, xattrs, times).
/// Returns bytes copied (0 for a reflink).
fn copy_over(path: &Path, meta: &fs::Metadata) -> Result<u64> {
    let dir = path.parent().expect("file in a dir");
    let name = path.file_name().expect("file name");
    let tmp = dir.join(format!(".bb-pin-{}-{}", std::process::id(), uuid::Uuid::new_v4().simple()));
    let res = (|| -> std::io::Result<u64> {
        let src = fs::File::open(path)?;
        let dst = fs::OpenOptions::new().write(true).create_new(true).mode_opt(0o600).open(&tmp)?;
        let copied = if bb_sys::mount_api::ficlone(dst.as_fd(), src.as_fd()).is_ok() {
            0
        } else {
            let mut s = &src;
            let mut d = &dst;
            std::io::copy(&mut s, &mut d)?
        };
        std::os::unix::fs::fchown(&dst, Some(meta.uid()), Some(meta.gid()))?;
        dst.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o7777))?;
        if let Ok(names) = xattr::list(path) {
            for n in names {
                if let Ok(Some(v)) = xattr::get(path, &n) {
                    let _ = xattr::set(&tmp, &n, &v);
                }
            }
        }
        let times = [
            libc::timespec { tv_sec: meta.atime(), tv_nsec: meta.atime_nsec() },
            libc::timespec { tv_sec: meta.mtime(), tv_nsec: meta.mtime_nsec() },
        ];
        // SAFETY: dst is an open fd and `times` a valid array of two timespecs.
        unsafe { libc::futimens(dst.as_raw_fd(), times.as_ptr()) };
        Ok(copied)
    })();
    match res {
        Ok(n) => {
            fs::rename(&tmp, dir.join(name)).map_err(|e| err("replace frozen file", e))?;
            Ok(n)
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(err(format!("copy {} into the snapshot", path.display()), e))
        }
    }
}

trait ModeOpt {
    fn mode_opt(&mut self, mode: u32) -> &mut Self;
}
impl ModeOpt for fs::OpenOptions {
    fn mode_opt(&mut self, mode: u32) -> &mut Self {
        std::os::unix::fs::OpenOptionsExt::mode(self, mode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_paths() {
        assert_eq!(sandbox_path(Path::new("/root/a.txt")), Some(PathBuf::from("root/a.txt")));
        assert_eq!(sandbox_path(Path::new("/root/a.txt (deleted)")), None);
        assert_eq!(sandbox_path(Path::new("pipe:[123]")), None);
        assert_eq!(sandbox_path(Path::new("/")), None);
        assert_eq!(sandbox_path(Path::new("/a/../b")), None);
    }

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
    }

    #[test]
    fn pin_moves_inode_to_new_layer_and_leaves_a_copy() {
        let d = tempfile::tempdir().unwrap();
        let old = d.path().join("old");
        let new = d.path().join("new");
        fs::create_dir_all(old.join("a/b")).unwrap();
        fs::set_permissions(old.join("a"), fs::Permissions::from_mode(0o750)).unwrap();
        fs::create_dir(&new).unwrap();
        fs::write(old.join("a/b/f"), b"before").unwrap();
        let mut held = fs::OpenOptions::new().append(true).open(old.join("a/b/f")).unwrap();
        let ino = fs::metadata(old.join("a/b/f")).unwrap().ino();
        let files = [
            WrittenFile { path: "a/b/f".into(), ino },
            WrittenFile { path: "a/missing".into(), ino: 1 },
            WrittenFile { path: "a/b/f".into(), ino: ino + 1 },
        ];
        let stats = pin_open_files(&files[..2], &old, &new).unwrap();
        assert_eq!(stats.files, 1);
        use std::io::Write;
        held.write_all(b" after").unwrap();
        assert_eq!(fs::read(old.join("a/b/f")).unwrap(), b"before", "the frozen layer keeps the checkpoint content");
        assert_eq!(
            fs::read(new.join("a/b/f")).unwrap(),
            b"before after",
            "writes through the old fd reach the live layer"
        );
        assert_eq!(fs::metadata(new.join("a")).unwrap().mode() & 0o7777, 0o750);
        // A stale inode number is ignored.
        assert_eq!(pin_open_files(&files[2..], &old, &new).unwrap().files, 0);
    }
}
