//! Process images: process trees of sandboxes kept on disk as CRIU images ([`bb_criu`]), under
//! `<state>/images/<id>/` (CRIU's files and a `manifest.json`), recorded in the table
//! `process_images`.
//!
//! Session templates that leave the in-memory pool are dumped here
//! ([`crate::session_templates`]), so a rollback or fork to their snapshots restores the
//! sessions instead of starting them fresh. A template never changes, so it is dumped at most
//! once: its image serves every later eviction.
//!
//! **Crash safety.** A dump writes into `.tmp-<id>` and is renamed to `<id>` only once CRIU
//! finished and the manifest is written; the record follows. At start, temp dirs and dirs
//! without a record are deleted, and records without a dir forgotten: no half-written image is
//! ever used.
//!
//! **Disk bound.** Past `--max-image-bytes` the least recently used images are deleted (their
//! sessions then restart fresh on rollback, and say why). Images no snapshot refers to are
//! deleted with the snapshots and by `gc`.
//!
//! Without CRIU (not installed, too old) the daemon runs as before: evicted templates are
//! lost, and `health` says why.

use crate::db::{self, DbResult};
pub use crate::model::ProcessImageStats;
use parking_lot::Mutex;
use rusqlite::{params, Connection};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An image record.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageRow {
    pub id: String,
    pub kind: String,
    pub sandbox_id: String,
    /// The session template it holds (for session-template images), and the fd of the
    /// process that holds its channel's other end (see the session server's `rechannel`).
    pub template: Option<String>,
    pub channel_fd: Option<i32>,
    pub bytes: u64,
    pub created_at: f64,
    pub last_used: f64,
}

/// Process images on disk, and what CRIU is there to make them.
pub struct ProcessImages {
    criu: Option<bb_criu::Criu>,
    /// Why there is no CRIU (shown in `health` and in restart reasons).
    unavailable: Option<String>,
    dir: PathBuf,
    limit_bytes: u64,
    rows: Mutex<Connection>,
    /// Images made but not yet named by the record that will keep them (a snapshot, a pause):
    /// collection spares them until [`ProcessImages::settled`].
    unsettled: Mutex<HashSet<String>>,
    /// Why restores read all memory up front (null: they are lazy, [`bb_criu::lazy`]).
    lazy_unavailable: Option<String>,
    /// Lazy-pages servers still filling restored trees: (sandbox, image, server).
    serving: Mutex<Vec<(String, String, bb_criu::LazyPages)>>,
    /// One lazy restore per image at a time (its server's socket, CRIU's log and stats are in
    /// the image's dir): the lock of each image being restored lazily. Eager restores each have
    /// a work dir of their own and run at once (a fork's children).
    restoring: Mutex<std::collections::HashMap<String, Arc<Mutex<()>>>>,
}

/// The log of the newest eager restore of an image, in its dir (a lazy one's is `restore.log`).
pub const EAGER_RESTORE_LOG: &str = "eager-restore.log";

/// `kind` of an image of a session template.
pub const TEMPLATE_KIND: &str = "session-template";
/// `kind` of an image of a background process tree a snapshot keeps (`processes: "all"`).
pub const SNAPSHOT_TREE_KIND: &str = "snapshot-tree";
/// `kind` of an image of one process tree of a paused sandbox.
pub const PAUSED_TREE_KIND: &str = "sandbox-tree";
/// How much of a failed CRIU run's log is kept (its end: where it failed), and how many such logs.
const FAILURE_LOG_BYTES: u64 = 1 << 20;
const FAILURE_LOGS: usize = 16;

/// CRIU processes a previous daemon of this state dir left (killed during a dump or a restore):
/// running one of `bins` on an image under `images` (other daemons' are theirs). Each is let
/// finish, up to `patience` in all: a CRIU killed mid-dump would leave its parasite code in the
/// process it was dumping (which a later dump then trips over). What is still running after
/// that is killed; its mount namespaces go with it.
fn settle_strays(bins: &[&Path], images: &Path, patience: std::time::Duration) {
    let bins: Vec<PathBuf> = bins.iter().filter_map(|b| std::fs::canonicalize(b).ok()).collect();
    let images = images.to_string_lossy().into_owned();
    let deadline = std::time::Instant::now() + patience;
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(exe) = std::fs::read_link(e.path().join("exe")) else { continue };
        let exe = exe.to_string_lossy();
        let exe = Path::new(exe.strip_suffix(" (deleted)").unwrap_or(&exe));
        if !bins.iter().any(|b| b == exe) {
            continue;
        }
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if !cmdline.split(|b| *b == 0).any(|arg| String::from_utf8_lossy(arg).starts_with(&images)) {
            continue;
        }
        let Ok(pidfd) = bb_sys::process::pidfd_open(pid) else { continue };
        tracing::warn!(pid, exe = %exe.display(), "a CRIU process a previous daemon left is still running: letting it finish");
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if !bb_sys::process::pidfd_wait_exit(&pidfd, left).unwrap_or(false) {
            tracing::warn!(pid, "killing a CRIU process a previous daemon left: it did not finish in {patience:?}");
            let _ = bb_sys::process::pidfd_send_signal(&pidfd, libc::SIGKILL);
        }
    }
}

/// `pi-` and 12 lowercase hex digits (what [`new_image_id`] makes): no path can hide in one.
pub fn valid_image_id(id: &str) -> bool {
    id.strip_prefix("pi-").is_some_and(|h| h.len() == 12 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

fn new_image_id() -> String {
    format!("pi-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

impl ProcessImages {
    /// Open `<state>/images` and its records, clean what a crash left, and look for CRIU.
    pub fn open(
        state_dir: &Path,
        db_path: &Path,
        criu_bin: &Path,
        criu_exec: &Path,
        limit_bytes: u64,
        lazy_pages: bool,
    ) -> DbResult<ProcessImages> {
        let conn = db::open(db_path)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS process_images (
                id TEXT PRIMARY KEY,
                kind TEXT NOT NULL,
                sandbox_id TEXT NOT NULL,
                template TEXT,
                channel_fd INTEGER,
                bytes INTEGER NOT NULL,
                created_at REAL NOT NULL,
                last_used REAL NOT NULL
            );
            CREATE INDEX IF NOT EXISTS process_images_by_template ON process_images(template);",
        )?;
        let (criu, unavailable) = match bb_criu::Criu::find(criu_bin, criu_exec) {
            Ok(c) => {
                tracing::info!(
                    version = c.version(),
                    "CRIU found: evicted session templates are kept as process images"
                );
                (Some(c), None)
            }
            Err(e) => {
                tracing::warn!("process images are off (sessions of evicted templates restart fresh): {e}");
                (None, Some(e.to_string()))
            }
        };
        let dir = state_dir.join("images");
        let _ = std::fs::create_dir_all(&dir);
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
        }
        let lazy_unavailable = if !lazy_pages {
            Some("turned off (--no-lazy-pages)".to_string())
        } else if criu.is_none() {
            Some("no CRIU".to_string())
        } else {
            bb_criu::lazy::supported().err()
        };
        if let (Some(_), Some(why)) = (&criu, &lazy_unavailable) {
            tracing::info!("process images are restored with all their memory up front: lazy pages {why}");
        }
        let images = ProcessImages {
            criu,
            unavailable,
            dir,
            limit_bytes,
            rows: Mutex::new(conn),
            unsettled: Default::default(),
            lazy_unavailable,
            serving: Default::default(),
            restoring: Default::default(),
        };
        settle_strays(&[criu_bin, criu_exec], &images.dir, bb_criu::DEFAULT_TIMEOUT);
        images.recover()?;
        Ok(images)
    }

    /// Delete temp dirs and dirs without a record; forget records without a dir.
    fn recover(&self) -> DbResult<()> {
        let recorded: HashSet<String> = self.all()?.into_iter().map(|r| r.id).collect();
        let mut present = HashSet::new();
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".log") {
                continue;
            }
            if name.starts_with(".tmp-") || !recorded.contains(&name) {
                tracing::warn!(image = %name, "removing a process image a crash left unfinished");
                let _ = std::fs::remove_dir_all(e.path());
            } else {
                present.insert(name);
            }
        }
        for id in recorded.difference(&present) {
            self.forget(id)?;
        }
        Ok(())
    }

    pub fn criu(&self) -> Option<&bb_criu::Criu> {
        self.criu.as_ref()
    }

    /// Why evicted templates cannot be kept, when they cannot.
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    pub fn path(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    pub fn all(&self) -> DbResult<Vec<ImageRow>> {
        let conn = self.rows.lock();
        let mut stmt = conn.prepare(
            "SELECT id, kind, sandbox_id, template, channel_fd, bytes, created_at, last_used FROM process_images ORDER BY last_used",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok(ImageRow {
                id: r.get(0)?,
                kind: r.get(1)?,
                sandbox_id: r.get(2)?,
                template: r.get(3)?,
                channel_fd: r.get(4)?,
                bytes: r.get::<_, i64>(5)? as u64,
                created_at: r.get(6)?,
                last_used: r.get(7)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    pub fn stats(&self) -> ProcessImageStats {
        let all = self.all().unwrap_or_default();
        ProcessImageStats {
            criu: self.criu.as_ref().map(|c| c.version().to_string()),
            unavailable: self.unavailable.clone(),
            images: all.len() as u64,
            bytes: all.iter().map(|r| r.bytes).sum(),
            limit_bytes: self.limit_bytes,
            lazy_pages: self.lazy_unavailable.is_none(),
            lazy_unavailable: self.lazy_unavailable.clone(),
            lazy_serving: self.lazy_serving() as u64,
        }
    }

    /// Dump the tree at `root` of `sandbox` into a new image (blocking), as `opts` say (the tree
    /// is gone after a successful dump unless `opts.leave_running`); `template`: the session
    /// template it holds and that session's channel fd. The image is spared by collection until
    /// the caller recorded it somewhere and said so ([`ProcessImages::settled`]).
    pub fn dump(
        &self,
        sandbox: &bb_criu::SandboxRef,
        sandbox_id: &str,
        root: bb_criu::Root,
        template: Option<(&str, i32)>,
        opts: &bb_criu::DumpOptions,
    ) -> crate::Result<(String, bb_criu::Manifest)> {
        let criu =
            self.criu.as_ref().ok_or_else(|| ImageError::Unavailable(self.unavailable.clone().unwrap_or_default()))?;
        // Memory a lazy restore has not copied in yet would be read through its server, slowly.
        self.settle_lazy(|sb, _| sb == sandbox_id);
        let id = new_image_id();
        let tmp = self.dir.join(format!(".tmp-{id}"));
        let kind = opts.kind.as_str();
        let manifest = match criu.dump(sandbox, root, &tmp, opts) {
            Ok(m) => m,
            Err(e) => {
                self.keep_failure_log(&tmp.join("dump.log"), &format!("failed-dump-{sandbox_id}.log"));
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(ImageError::Criu(e).into());
            }
        };
        std::fs::rename(&tmp, self.path(&id)).map_err(crate::RuntimeError::io("keep a process image"))?;
        self.unsettled.lock().insert(id.clone());
        let now = crate::now();
        self.rows.lock().execute(
            "INSERT INTO process_images (id, kind, sandbox_id, template, channel_fd, bytes, created_at, last_used) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
            params![id, kind, sandbox_id, template.map(|t| t.0), template.map(|t| t.1), manifest.bytes as i64, now],
        )
        .map_err(crate::db::DbError::from)?;
        Ok((id, manifest))
    }

    /// Restore image `id` into sandbox `sb` (blocking): lazily (its memory copied in after it
    /// runs) unless `eager`, lazy pages are unavailable or the sandbox lacks the room below.
    /// Returns the image's manifest and whether the restore was lazy.
    ///
    /// Room: a process that forks before its memory is all copied in makes a child whose
    /// missing pages are copied in separately (the kernel cannot share what neither has yet),
    /// where an eager restore's child would share them. A restore is lazy only when the sandbox
    /// can hold the image's memory twice below its limit, so that copy cannot drive it into its
    /// OOM killer where an eager restore would not have.
    pub fn restore(
        &self,
        sb: &crate::sandbox::Sandbox,
        id: &str,
        eager: bool,
        inherit: &[(std::os::fd::RawFd, String)],
    ) -> crate::Result<(bb_criu::Manifest, bool)> {
        let room = sb.cgroup.anon_memory().map(|used| (sb.spec.memory_mb << 20).saturating_sub(used)).unwrap_or(0);
        let bytes = self.manifest(id).map(|m| m.bytes).unwrap_or(u64::MAX);
        let lazy = !eager && self.lazy_unavailable.is_none() && bytes.saturating_mul(2) <= room;
        tracing::debug!(sandbox = %sb.id, image = %id, bytes, room, eager, lazy, "restoring a process image");
        if !lazy {
            return self.restore_in(sb, id, false, inherit);
        }
        let lock = self.restoring.lock().entry(id.to_string()).or_default().clone();
        let restored = {
            let _restoring = lock.lock();
            self.restore_in(sb, id, true, inherit)
        };
        // Forgotten once nobody else holds or waits for it.
        let mut restoring = self.restoring.lock();
        if Arc::strong_count(&lock) == 2 {
            restoring.remove(id);
        }
        restored
    }

    /// [`ProcessImages::restore`], decided: lazily with no other lazy restore of image `id`
    /// under way, or eagerly with CRIU's log and stats in a work dir of its own.
    fn restore_in(
        &self,
        sb: &crate::sandbox::Sandbox,
        id: &str,
        lazy: bool,
        inherit: &[(std::os::fd::RawFd, String)],
    ) -> crate::Result<(bb_criu::Manifest, bool)> {
        static WORK_DIRS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let criu =
            self.criu.as_ref().ok_or_else(|| ImageError::Unavailable(self.unavailable.clone().unwrap_or_default()))?;
        // One server per image directory at a time (its socket is there). An eager restore
        // only reads the image (its log goes to a work dir), beside a server or not.
        // (The work dir is a temp dir: a crash leaves it to `recover`.)
        let work = if lazy {
            self.settle_lazy(|_, image| image == id);
            None
        } else {
            let n = WORK_DIRS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let w = self.dir.join(format!(".tmp-restore-{id}-{n}"));
            std::fs::create_dir(&w).map_err(crate::RuntimeError::io("make a work dir for CRIU"))?;
            Some(w)
        };
        let restored = criu.restore(&sb.criu_ref(), &self.path(id), lazy, inherit, work.as_deref());
        if restored.is_err() {
            let log = work.as_deref().map(Path::to_path_buf).unwrap_or_else(|| self.path(id)).join("restore.log");
            self.keep_failure_log(&log, &format!("failed-restore-{id}.log"));
        }
        if let Some(w) = &work {
            // The newest eager restore's log is kept beside the image (under a name of its own:
            // a lazy restore of the image may be writing `restore.log` there).
            let _ = std::fs::rename(w.join("restore.log"), self.path(id).join(EAGER_RESTORE_LOG));
            let _ = std::fs::remove_dir_all(w);
        }
        let restored = restored.map_err(ImageError::Criu)?;
        if let Some(server) = restored.lazy {
            let mut serving = self.serving.lock();
            serving.retain(|(_, _, s)| s.outcome().is_none());
            serving.push((sb.id.clone(), id.to_string(), server));
        }
        let m = restored.manifest;
        let _ = self
            .rows
            .lock()
            .execute("UPDATE process_images SET last_used = ?2 WHERE id = ?1", params![id, crate::now()]);
        Ok((m, lazy))
    }

    /// Keep the end of a failed CRIU run's log beside the images (the image may go with its
    /// sandbox or snapshot), for whoever looks into it: at most [`FAILURE_LOG_BYTES`] of it, and
    /// the newest [`FAILURE_LOGS`] such logs.
    fn keep_failure_log(&self, log: &Path, name: &str) {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(mut f) = std::fs::File::open(log) else { return };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(FAILURE_LOG_BYTES)));
        let mut tail = Vec::new();
        let _ = f.take(FAILURE_LOG_BYTES).read_to_end(&mut tail);
        let _ = std::fs::write(self.dir.join(name), tail);
        let mut logs: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("failed-"))
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        logs.sort();
        for (_, old) in logs.iter().rev().skip(FAILURE_LOGS) {
            let _ = std::fs::remove_file(old);
        }
    }

    /// The manifest of image `id`, if it is readable.
    pub fn manifest(&self, id: &str) -> Option<bb_criu::Manifest> {
        bb_criu::Manifest::read(&self.path(id)).ok()
    }

    /// Where an image pulled from the object store is written before [`ProcessImages::adopt`]
    /// takes it in (a temp dir: a crash leaves nothing that looks like an image).
    pub fn staging(&self, id: &str) -> PathBuf {
        self.dir.join(format!(".tmp-{id}"))
    }

    /// Take in an image written to [`ProcessImages::staging`] under `row.id`, with its record.
    /// Spared by collection until [`ProcessImages::settled`], like a fresh dump.
    pub fn adopt(&self, row: &ImageRow) -> crate::Result<()> {
        if !valid_image_id(&row.id) {
            return Err(crate::RuntimeError::BadRequest(format!("{:?} is not a process image id", row.id)));
        }
        std::fs::rename(self.staging(&row.id), self.path(&row.id))
            .map_err(crate::RuntimeError::io("keep a pulled process image"))?;
        self.unsettled.lock().insert(row.id.clone());
        self.rows
            .lock()
            .execute(
                "INSERT OR IGNORE INTO process_images (id, kind, sandbox_id, template, channel_fd, bytes, created_at, last_used)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
                params![row.id, row.kind, row.sandbox_id, row.template, row.channel_fd, row.bytes as i64, crate::now()],
            )
            .map_err(crate::db::DbError::from)?;
        Ok(())
    }

    /// Image `id` is named by the record that keeps it (or deleted): collection may judge it.
    pub fn settled(&self, id: &str) {
        self.unsettled.lock().remove(id);
    }

    pub fn get(&self, id: &str) -> DbResult<Option<ImageRow>> {
        Ok(self.all()?.into_iter().find(|r| r.id == id))
    }

    fn forget(&self, id: &str) -> DbResult<()> {
        self.rows.lock().execute("DELETE FROM process_images WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// Wait for the lazy-pages servers `which(sandbox, image)` picks to fill their trees (at
    /// most CRIU's timeout each; one still running after it is left to finish and logged).
    fn settle_lazy(&self, which: impl Fn(&str, &str) -> bool) {
        let picked: Vec<(String, bb_criu::LazyPages)> = self
            .serving
            .lock()
            .iter()
            .filter(|(sb, image, s)| which(sb, image) && s.outcome().is_none())
            .map(|(sb, _, s)| (sb.clone(), s.clone()))
            .collect();
        for (sb, server) in picked {
            if server.wait(bb_criu::DEFAULT_TIMEOUT).is_none() {
                tracing::warn!(sandbox = %sb, pid = server.pid(), "a lazy-pages server is still copying memory after {:?}", bb_criu::DEFAULT_TIMEOUT);
            }
        }
    }

    /// Wait for the lazy-pages servers filling processes of sandbox `sandbox_id` (blocking).
    pub fn wait_lazy(&self, sandbox_id: &str) {
        self.settle_lazy(|sb, _| sb == sandbox_id);
    }

    /// Whether a lazy-pages server still fills processes of sandbox `sandbox_id`.
    pub fn lazy_serving_in(&self, sandbox_id: &str) -> bool {
        self.serving.lock().iter().any(|(sb, _, s)| sb == sandbox_id && s.outcome().is_none())
    }

    /// Lazy-pages servers still copying memory in.
    pub fn lazy_serving(&self) -> usize {
        self.serving.lock().iter().filter(|(_, _, s)| s.outcome().is_none()).count()
    }

    /// Delete images (records now; dirs once no lazy-pages server reads them any more, off the
    /// caller's path: a resume deletes the images it restored from).
    pub fn delete(&self, ids: &[String]) {
        for id in ids {
            self.settled(id);
            if let Err(e) = self.forget(id) {
                tracing::warn!(image = %id, "forgetting a process image: {e}");
            }
            let dir = self.path(id);
            let reader = self
                .serving
                .lock()
                .iter()
                .find(|(_, image, s)| image == id && s.outcome().is_none())
                .map(|(_, _, s)| s.clone());
            let Some(server) = reader else {
                let _ = std::fs::remove_dir_all(&dir);
                continue;
            };
            let spawned = std::thread::Builder::new().name("image-delete".into()).spawn(move || {
                if server.wait(bb_criu::DEFAULT_TIMEOUT).is_some() {
                    let _ = std::fs::remove_dir_all(&dir);
                } else {
                    // The next start deletes it (a dir without a record), after its server.
                    tracing::warn!(dir = %dir.display(), "a lazy-pages server still reads a deleted image");
                }
            });
            if let Err(e) = spawned {
                tracing::warn!(image = %id, "cannot delete a process image in the background: {e}");
            }
        }
    }

    /// Delete least recently used images of session templates until all images fit the disk
    /// bound, sparing `keep`. Images of paused sandboxes count but are never deleted (they are
    /// those sandboxes' processes). Returns the deleted ones.
    pub fn enforce_limit(&self, keep: &HashSet<String>) -> Vec<ImageRow> {
        let Ok(all) = self.all() else { return Vec::new() };
        let mut total: u64 = all.iter().map(|r| r.bytes).sum();
        let mut gone = Vec::new();
        for r in all {
            if total <= self.limit_bytes {
                break;
            }
            if keep.contains(&r.id) || r.kind != TEMPLATE_KIND {
                continue;
            }
            total -= r.bytes;
            gone.push(r);
        }
        self.delete(&gone.iter().map(|r| r.id.clone()).collect::<Vec<_>>());
        gone
    }

    /// Delete every image nothing names: `referenced` reads the ids the records name (snapshots,
    /// pauses). Returns how many bytes went.
    ///
    /// The images and the unsettled ones are read first, the records last: an image settles
    /// only once the record naming it is written, so one that was unsettled when listed is
    /// either still unsettled below or named by a record `referenced` reads. (Read the other way
    /// round, an image whose record was written, and which settled, between the two reads was
    /// deleted under its snapshot or pause.)
    pub fn collect(&self, referenced: impl FnOnce() -> crate::Result<HashSet<String>>) -> crate::Result<u64> {
        let all = self.all()?;
        let unsettled = self.unsettled.lock().clone();
        let referenced = referenced()?;
        let unused: Vec<&ImageRow> =
            all.iter().filter(|r| !referenced.contains(&r.id) && !unsettled.contains(&r.id)).collect();
        let bytes = unused.iter().map(|r| r.bytes).sum();
        self.delete(&unused.iter().map(|r| r.id.clone()).collect::<Vec<_>>());
        Ok(bytes)
    }
}

impl crate::Runtime {
    /// Whether checkpoints and forks can keep background processes (`processes: "all"`): the
    /// daemon has a CRIU it can use.
    pub fn can_keep_processes(&self) -> bool {
        self.process_images.unavailable().is_none()
    }

    /// Whether process images are on, and the disk they use (`GET /v1/health`).
    pub fn process_image_stats(&self) -> ProcessImageStats {
        self.process_images.stats()
    }

    /// Delete the process images no snapshot and no paused sandbox names any more. Returns the
    /// bytes freed.
    pub(crate) fn collect_images(&self) -> crate::Result<u64> {
        self.process_images.collect(|| {
            let mut referenced = self.snapshots.records().images()?;
            referenced.extend(self.sandboxes.records().paused_images()?);
            Ok(referenced)
        })
    }
}

/// Making or using a process image failed.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("process images are off: {0}")]
    Unavailable(String),
    #[error(transparent)]
    Criu(#[from] bb_criu::CriuError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(images: &ProcessImages, id: &str) -> ImageRow {
        std::fs::create_dir_all(images.staging(id)).unwrap();
        let row = ImageRow {
            id: id.into(),
            kind: PAUSED_TREE_KIND.into(),
            sandbox_id: "sb-1".into(),
            template: None,
            channel_fd: None,
            bytes: 10,
            created_at: 1.0,
            last_used: 1.0,
        };
        images.adopt(&row).unwrap();
        row
    }

    #[test]
    fn collection_keeps_an_image_whose_record_lands_while_it_reads_the_records() {
        let d = tempfile::tempdir().unwrap();
        let none = d.path().join("no-criu");
        let images = ProcessImages::open(d.path(), &d.path().join("db"), &none, &none, u64::MAX, false).unwrap();
        let (kept, named, unnamed, fresh) =
            ("pi-00000000000a", "pi-00000000000b", "pi-00000000000c", "pi-00000000000d");
        for id in [kept, named, unnamed, fresh] {
            stage(&images, id);
        }
        for id in [named, unnamed] {
            images.settled(id);
        }
        // `kept`'s snapshot is recorded, and the image settles, after the records were read:
        // it was unsettled when the images were listed, so it stays. `fresh` is still unsettled.
        let freed = images
            .collect(|| {
                images.settled(kept);
                Ok(HashSet::from([named.to_string()]))
            })
            .unwrap();
        assert_eq!(freed, 10);
        let left: HashSet<String> = images.all().unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(left, HashSet::from([kept.to_string(), named.to_string(), fresh.to_string()]));
        assert!(!images.path(unnamed).exists() && images.path(kept).exists());
        // Next time round, a settled image nothing names goes.
        images.settled(fresh);
        assert_eq!(images.collect(|| Ok(HashSet::from([kept.to_string()]))).unwrap(), 20);
        let left: Vec<String> = images.all().unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(left, vec![kept.to_string()]);
    }
}
