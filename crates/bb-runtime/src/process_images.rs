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
        let images = ProcessImages { criu, unavailable, dir, limit_bytes, rows: Mutex::new(conn) };
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
        }
    }

    /// Dump the tree at `root` of `sandbox` into a new image (blocking). The tree is gone after
    /// a successful dump unless `leave_running`.
    pub fn dump(
        &self,
        sandbox: &bb_criu::SandboxRef,
        sandbox_id: &str,
        root: bb_criu::Root,
        kind: &str,
        template: Option<(&str, i32)>,
        leave_running: bool,
    ) -> crate::Result<(String, bb_criu::Manifest)> {
        let criu =
            self.criu.as_ref().ok_or_else(|| ImageError::Unavailable(self.unavailable.clone().unwrap_or_default()))?;
        let id = new_image_id();
        let tmp = self.dir.join(format!(".tmp-{id}"));
        let opts = bb_criu::DumpOptions { leave_running, kind: kind.to_string() };
        let manifest = match criu.dump(sandbox, root, &tmp, &opts) {
            Ok(m) => m,
            Err(e) => {
                // The whole log of the last failed dump stays, for whoever looks into it.
                let _ = std::fs::rename(tmp.join("dump.log"), self.dir.join(format!("failed-dump-{sandbox_id}.log")));
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(ImageError::Criu(e).into());
            }
        };
        std::fs::rename(&tmp, self.path(&id)).map_err(crate::RuntimeError::io("keep a process image"))?;
        let now = crate::now();
        self.rows.lock().execute(
            "INSERT INTO process_images (id, kind, sandbox_id, template, channel_fd, bytes, created_at, last_used) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7)",
            params![id, kind, sandbox_id, template.map(|t| t.0), template.map(|t| t.1), manifest.bytes as i64, now],
        )
        .map_err(crate::db::DbError::from)?;
        Ok((id, manifest))
    }

    /// Restore image `id` into `sandbox` (blocking).
    pub fn restore(&self, sandbox: &bb_criu::SandboxRef, id: &str) -> crate::Result<bb_criu::Manifest> {
        let criu =
            self.criu.as_ref().ok_or_else(|| ImageError::Unavailable(self.unavailable.clone().unwrap_or_default()))?;
        let m = criu.restore(sandbox, &self.path(id)).map_err(ImageError::Criu)?;
        let _ = self
            .rows
            .lock()
            .execute("UPDATE process_images SET last_used = ?2 WHERE id = ?1", params![id, crate::now()]);
        Ok(m)
    }

    pub fn get(&self, id: &str) -> DbResult<Option<ImageRow>> {
        Ok(self.all()?.into_iter().find(|r| r.id == id))
    }

    fn forget(&self, id: &str) -> DbResult<()> {
        self.rows.lock().execute("DELETE FROM process_images WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// Delete images (dirs and records).
    pub fn delete(&self, ids: &[String]) {
        for id in ids {
            let _ = std::fs::remove_dir_all(self.path(id));
            if let Err(e) = self.forget(id) {
                tracing::warn!(image = %id, "forgetting a process image: {e}");
            }
        }
    }

    /// Delete least recently used images until they fit the disk bound, sparing `keep`.
    /// Returns the deleted ones.
    pub fn enforce_limit(&self, keep: &HashSet<String>) -> Vec<ImageRow> {
        let Ok(all) = self.all() else { return Vec::new() };
        let mut total: u64 = all.iter().map(|r| r.bytes).sum();
        let mut gone = Vec::new();
        for r in all {
            if total <= self.limit_bytes {
                break;
            }
            if keep.contains(&r.id) {
                continue;
            }
            total -= r.bytes;
            gone.push(r);
        }
        self.delete(&gone.iter().map(|r| r.id.clone()).collect::<Vec<_>>());
        gone
    }

    /// Delete every image no id in `referenced` names. Returns how many bytes went.
    pub fn collect(&self, referenced: &HashSet<String>) -> u64 {
        let Ok(all) = self.all() else { return 0 };
        let unused: Vec<&ImageRow> = all.iter().filter(|r| !referenced.contains(&r.id)).collect();
        let bytes = unused.iter().map(|r| r.bytes).sum();
        self.delete(&unused.iter().map(|r| r.id.clone()).collect::<Vec<_>>());
        bytes
    }
}

impl crate::Runtime {
    /// Whether process images are on, and the disk they use (`GET /v1/health`).
    pub fn process_image_stats(&self) -> ProcessImageStats {
        self.process_images.stats()
    }

    /// Delete the process images no snapshot names any more. Returns the bytes freed.
    pub(crate) fn collect_images(&self) -> crate::Result<u64> {
        let referenced = self.snapshots.records().images()?;
        Ok(self.process_images.collect(&referenced))
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
