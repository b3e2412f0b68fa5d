//! Watching a sandbox's directories from the host side: inotify on the sandbox's merged root, so
//! nothing runs in the sandbox for it (it stays forkable). Processes in the sandbox write through
//! the same overlay, so their changes are seen as the daemon's own are.
//!
//! Directories are opened through the sandbox's root (`openat2(RESOLVE_IN_ROOT)`, as every file
//! operation is) and watched through their `/proc/self/fd` link, so a symlink cannot make the
//! daemon watch a host directory. A checkpoint or rollback mounts the root anew: the watch notices
//! (within [`REARM_CHECK`]) and re-arms on the new root; changes made in between are not reported.
//! The daemon's uploads (a temporary file renamed over the target) show as the target's create
//! and write, the temporary name never.

use crate::error::{Result, RuntimeError};
use crate::sandbox::files::{SandboxFs, SbPath, UPLOAD_TMP_PREFIX};
use crate::sandbox::Sandbox;
use nix::sys::inotify::{AddWatchFlags as F, InitFlags, Inotify, WatchDescriptor};
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::unix::AsyncFd;

/// Most directories one recursive watch covers.
pub const MAX_WATCHED_DIRS: usize = 8192;
/// How often a waiting watch checks that its sandbox lives and its root was not swapped.
pub const REARM_CHECK: Duration = Duration::from_millis(500);

/// What happened to an entry (one per inotify event, as fsnotify reports them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsEventKind {
    Create,
    Write,
    Remove,
    Rename,
    Chmod,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FsEvent {
    /// Path relative to the watched directory (`.` for the directory itself).
    pub name: String,
    pub kind: FsEventKind,
}

/// An inotify instance as tokio polls it.
struct Ino(Inotify);

impl AsRawFd for Ino {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

fn mask() -> F {
    F::IN_CREATE
        | F::IN_MODIFY
        | F::IN_ATTRIB
        | F::IN_DELETE
        | F::IN_DELETE_SELF
        | F::IN_MOVED_FROM
        | F::IN_MOVED_TO
        | F::IN_MOVE_SELF
        | F::IN_ONLYDIR
}

/// A directory watch; [`DirWatch::next`] waits for the next batch of events.
pub struct DirWatch {
    sb: Arc<Sandbox>,
    base: u32,
    top: SbPath,
    recursive: bool,
    ino: AsyncFd<Ino>,
    /// The root the watches are on.
    armed: PathBuf,
    /// Watched directories by descriptor: their paths relative to `top` ("" for `top`).
    dirs: HashMap<WatchDescriptor, String>,
    /// Rename cookies of upload temporaries moved away (their arrival is the target's write).
    uploads: HashSet<u32>,
}

fn inotify_error(e: nix::Error) -> RuntimeError {
    match e {
        nix::Error::ENOSPC | nix::Error::EMFILE => RuntimeError::TooLarge(
            "the host's inotify limits are reached (fs.inotify.max_user_watches/max_user_instances): \
             stop other watches or watch fewer directories"
                .into(),
        ),
        e => RuntimeError::Unavailable(format!("inotify: {e}")),
    }
}

impl DirWatch {
    pub(crate) fn new(sb: Arc<Sandbox>, base: u32, top: SbPath, recursive: bool) -> Result<DirWatch> {
        let ino = new_ino()?;
        let armed = sb.rootfs();
        let mut w = DirWatch { sb, base, top, recursive, ino, armed, dirs: HashMap::new(), uploads: HashSet::new() };
        w.arm()?;
        Ok(w)
    }

    /// Watch `top` (and, recursively, its directories) on the sandbox's current root.
    fn arm(&mut self) -> Result<()> {
        self.ino = new_ino()?;
        self.dirs.clear();
        self.uploads.clear();
        self.armed = self.sb.rootfs();
        let fs = SandboxFs::open(&self.armed, self.base)?;
        let en = fs.stat(&self.top)?;
        if en.kind != "dir" {
            return Err(RuntimeError::BadRequest(format!(
                "{} is not a directory: watch a directory",
                self.top.display()
            )));
        }
        self.add(&fs, "")?;
        Ok(())
    }

    /// Watch the directory at `rel` (under `top`) and, when recursive, every directory below it.
    fn add(&mut self, fs: &SandboxFs, rel: &str) -> Result<()> {
        let path = self.top.join_rel(rel);
        self.add_one(fs, &path, rel)?;
        if !self.recursive {
            return Ok(());
        }
        let entries = match fs.list(&path, u32::MAX) {
            Ok(en) => en,
            // Gone already: its removal is (or will be) reported by its parent.
            Err(RuntimeError::NotFound { .. }) if !rel.is_empty() => return Ok(()),
            Err(e) => return Err(e),
        };
        let prefix = self.top.display();
        for en in entries.iter().filter(|en| en.kind == "dir") {
            let sub = en.path.strip_prefix(&prefix).unwrap_or(&en.path).trim_start_matches('/').to_string();
            let p = self.top.join_rel(&sub);
            self.add_one(fs, &p, &sub)?;
        }
        Ok(())
    }

    fn add_one(&mut self, fs: &SandboxFs, path: &SbPath, rel: &str) -> Result<()> {
        if self.dirs.len() >= MAX_WATCHED_DIRS {
            return Err(RuntimeError::TooLarge(format!(
                "{} holds more than {MAX_WATCHED_DIRS} directories: watch a smaller tree or without recursive",
                self.top.display()
            )));
        }
        let fd = match fs.open_dir(path) {
            Ok(fd) => fd,
            Err(RuntimeError::NotFound { .. }) if !rel.is_empty() => return Ok(()),
            Err(e) => return Err(e),
        };
        let via = format!("/proc/self/fd/{}", fd.as_raw_fd());
        match self.ino.get_ref().0.add_watch(via.as_str(), mask()) {
            Ok(wd) => {
                self.dirs.insert(wd, rel.to_string());
                Ok(())
            }
            // Replaced by a file, or gone, since it was listed.
            Err(nix::Error::ENOTDIR | nix::Error::ENOENT) if !rel.is_empty() => Ok(()),
            Err(e) => Err(inotify_error(e)),
        }
    }

    /// The next events (at least one). Errors: the sandbox went away (`Unavailable`), the
    /// watched directory was removed (`NotFound`), or events came faster than they were read
    /// (`TooLarge`: the kernel's queue overflowed).
    pub async fn next(&mut self) -> Result<Vec<FsEvent>> {
        loop {
            if self.sb.is_dead() {
                return Err(RuntimeError::Unavailable(format!("sandbox {} is gone", self.sb.id)));
            }
            if self.sb.rootfs() != self.armed {
                // Listing a tree to watch it again is blocking work.
                tokio::task::block_in_place(|| self.arm())?;
            }
            let ready = tokio::time::timeout(REARM_CHECK, self.ino.readable()).await;
            let Ok(ready) = ready else { continue };
            let mut guard = ready.map_err(|e| RuntimeError::Unavailable(format!("inotify: {e}")))?;
            let raw = match guard.get_inner().0.read_events() {
                Ok(evs) => evs,
                Err(nix::Error::EAGAIN) => {
                    guard.clear_ready();
                    continue;
                }
                Err(e) => return Err(inotify_error(e)),
            };
            drop(guard);
            // New directories of a recursive watch are listed and watched here: blocking work.
            let out = tokio::task::block_in_place(|| self.translate(raw))?;
            if !out.is_empty() {
                return Ok(out);
            }
        }
    }

    fn translate(&mut self, raw: Vec<nix::sys::inotify::InotifyEvent>) -> Result<Vec<FsEvent>> {
        let raw: Vec<RawEvent<WatchDescriptor>> = raw
            .into_iter()
            .map(|ev| RawEvent {
                wd: ev.wd,
                mask: ev.mask,
                cookie: ev.cookie,
                name: ev.name.map(|n| n.to_string_lossy().into_owned()),
            })
            .collect();
        let t = translate_batch(raw, &mut self.dirs, &mut self.uploads, self.recursive);
        if t.overflow {
            return Err(RuntimeError::TooLarge(format!(
                "events under {} came faster than they were read and some were lost: watch a smaller tree",
                self.top.display()
            )));
        }
        // The watched directory went away, and not because the root was swapped under it.
        if t.lost_top && self.sb.rootfs() == self.armed && !self.sb.is_dead() {
            return Err(RuntimeError::NotFound {
                kind: "watched directory",
                id: self.top.display(),
                hint: " (it was removed or moved away)",
            });
        }
        if !t.new_dirs.is_empty() {
            let fs = SandboxFs::open(&self.armed, self.base)?;
            for rel in t.new_dirs {
                self.add(&fs, &rel)?;
            }
        }
        Ok(t.events)
    }
}

/// One inotify event, its watch descriptor of any type (the unit tests use integers).
struct RawEvent<K> {
    wd: K,
    mask: F,
    cookie: u32,
    name: Option<String>,
}

/// What a batch of inotify events means for a watch.
#[derive(Debug, Default, PartialEq)]
struct Translation {
    events: Vec<FsEvent>,
    /// Directories (relative to the watched one) made or moved in, to watch (recursive watches).
    new_dirs: Vec<String>,
    /// The kernel's queue overflowed: events were lost.
    overflow: bool,
    /// The watched directory's own watch ended (removed, moved away, or unmounted).
    lost_top: bool,
}

/// Map inotify events to envd's, as fsnotify reports them: `dirs` are the watched directories
/// by descriptor (relative paths, "" for the watched one), `uploads` the rename cookies of the
/// daemon's upload temporaries moved away (their arrival is the target's create and write).
fn translate_batch<K: std::hash::Hash + Eq>(
    raw: Vec<RawEvent<K>>,
    dirs: &mut HashMap<K, String>,
    uploads: &mut HashSet<u32>,
    recursive: bool,
) -> Translation {
    let mut t = Translation::default();
    for ev in raw {
        let m = ev.mask;
        if m.contains(F::IN_Q_OVERFLOW) {
            t.overflow = true;
            return t;
        }
        let Some(dir) = dirs.get(&ev.wd).cloned() else { continue };
        if m.contains(F::IN_IGNORED) {
            dirs.remove(&ev.wd);
            t.lost_top |= dir.is_empty();
            continue;
        }
        let Some(name) = ev.name else {
            // The directory itself: reported for the watched one only (a subdirectory's removal
            // or move is reported by its parent).
            if dir.is_empty() {
                if m.contains(F::IN_DELETE_SELF) {
                    t.events.push(FsEvent { name: ".".into(), kind: FsEventKind::Remove });
                } else if m.contains(F::IN_MOVE_SELF) {
                    t.events.push(FsEvent { name: ".".into(), kind: FsEventKind::Rename });
                }
            }
            continue;
        };
        if name.starts_with(UPLOAD_TMP_PREFIX) {
            if m.contains(F::IN_MOVED_FROM) {
                uploads.insert(ev.cookie);
            }
            continue;
        }
        let rel = if dir.is_empty() { name } else { format!("{dir}/{name}") };
        let mut push = |kind| t.events.push(FsEvent { name: rel.clone(), kind });
        if m.contains(F::IN_CREATE) {
            push(FsEventKind::Create);
        }
        if m.contains(F::IN_MOVED_TO) {
            push(FsEventKind::Create);
            if uploads.remove(&ev.cookie) {
                push(FsEventKind::Write);
            }
        }
        if m.contains(F::IN_MOVED_FROM) {
            push(FsEventKind::Rename);
        }
        if m.contains(F::IN_ATTRIB) {
            push(FsEventKind::Chmod);
        }
        if m.contains(F::IN_MODIFY) {
            push(FsEventKind::Write);
        }
        if m.contains(F::IN_DELETE) {
            push(FsEventKind::Remove);
        }
        if recursive && m.contains(F::IN_ISDIR) && (m.contains(F::IN_CREATE) || m.contains(F::IN_MOVED_TO)) {
            t.new_dirs.push(rel);
        }
    }
    // Bounded: a temporary renamed out of the tree never gets its pair.
    if uploads.len() > 1024 {
        uploads.clear();
    }
    t
}

fn new_ino() -> Result<AsyncFd<Ino>> {
    let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).map_err(inotify_error)?;
    // SAFETY: `Ino` owns the inotify fd and keeps it open (never replaced) for as long as the
    // `AsyncFd` it is moved into lives.
    unsafe { AsyncFd::register(Ino(ino)) }
        .map_err(|e| RuntimeError::Unavailable(format!("inotify: {}", e.into_parts().1)))
}

impl crate::Runtime {
    /// Watch a directory of a sandbox (and every directory below it when `recursive`).
    pub async fn watch_dir(self: &Arc<Self>, id: &str, path: &SbPath, recursive: bool) -> Result<DirWatch> {
        let sb = self.ready(id).await?;
        let base = self.cfg.idmap.host_base;
        let path = path.clone();
        // Listing a tree to watch it is blocking work.
        tokio::task::block_in_place(move || DirWatch::new(sb, base, path, recursive))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(wd: i32, mask: F, cookie: u32, name: Option<&str>) -> RawEvent<i32> {
        RawEvent { wd, mask, cookie, name: name.map(str::to_string) }
    }

    fn names(t: &Translation) -> Vec<(String, FsEventKind)> {
        t.events.iter().map(|e| (e.name.clone(), e.kind)).collect()
    }

    fn watching() -> HashMap<i32, String> {
        HashMap::from([(1, String::new()), (2, "sub".to_string())])
    }

    #[test]
    fn events_map_as_fsnotify_reports_them_with_paths_under_the_watched_directory() {
        use FsEventKind::*;
        let (mut dirs, mut uploads) = (watching(), HashSet::new());
        let t = translate_batch(
            vec![
                ev(1, F::IN_CREATE, 0, Some("a")),
                ev(1, F::IN_MODIFY, 0, Some("a")),
                ev(2, F::IN_ATTRIB, 0, Some("b")),
                ev(1, F::IN_MOVED_FROM, 7, Some("a")),
                ev(1, F::IN_MOVED_TO, 7, Some("c")),
                ev(2, F::IN_DELETE, 0, Some("b")),
                ev(9, F::IN_CREATE, 0, Some("unwatched")),
            ],
            &mut dirs,
            &mut uploads,
            false,
        );
        let want = [("a", Create), ("a", Write), ("sub/b", Chmod), ("a", Rename), ("c", Create), ("sub/b", Remove)];
        assert_eq!(names(&t), want.map(|(n, k)| (n.to_string(), k)).to_vec());
        assert!(!t.overflow && !t.lost_top && t.new_dirs.is_empty());
    }

    #[test]
    fn an_upload_shows_as_its_targets_create_and_write_never_its_temporary() {
        use FsEventKind::*;
        let (mut dirs, mut uploads) = (watching(), HashSet::new());
        let tmp = format!("{UPLOAD_TMP_PREFIX}0123");
        let t = translate_batch(
            vec![
                ev(1, F::IN_CREATE, 0, Some(&tmp)),
                ev(1, F::IN_ATTRIB, 0, Some(&tmp)),
                ev(1, F::IN_MODIFY, 0, Some(&tmp)),
                ev(1, F::IN_MOVED_FROM, 42, Some(&tmp)),
                ev(1, F::IN_MOVED_TO, 42, Some("file.txt")),
            ],
            &mut dirs,
            &mut uploads,
            false,
        );
        assert_eq!(names(&t), vec![("file.txt".to_string(), Create), ("file.txt".to_string(), Write)]);
        assert!(uploads.is_empty(), "the cookie is used once");
    }

    #[test]
    fn new_directories_are_watched_only_when_recursive_and_the_top_can_go_away() {
        let mk = |recursive| {
            let (mut dirs, mut uploads) = (watching(), HashSet::new());
            let dir_made = F::IN_CREATE | F::IN_ISDIR;
            translate_batch(vec![ev(2, dir_made, 0, Some("d"))], &mut dirs, &mut uploads, recursive)
        };
        assert_eq!(mk(true).new_dirs, vec!["sub/d".to_string()]);
        assert!(mk(false).new_dirs.is_empty());
        let (mut dirs, mut uploads) = (watching(), HashSet::new());
        let t = translate_batch(
            vec![ev(2, F::IN_IGNORED, 0, None), ev(1, F::IN_DELETE_SELF, 0, None), ev(1, F::IN_IGNORED, 0, None)],
            &mut dirs,
            &mut uploads,
            false,
        );
        assert_eq!(names(&t), vec![(".".to_string(), FsEventKind::Remove)]);
        assert!(t.lost_top && dirs.is_empty());
        let t = translate_batch(vec![ev(-1, F::IN_Q_OVERFLOW, 0, None)], &mut watching(), &mut uploads, false);
        assert!(t.overflow);
    }
}
