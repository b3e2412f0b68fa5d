//! The state directory: its layout and permissions, and the facts a daemon must agree with to use
//! it (the id mapping its files are owned by, the setns key sandboxes' seccomp filters carry).
//!
//! ```text
//! <state>/                  0711: traversable (sandbox inits reach their own dirs), not listable
//! <state>/branchbox.db      0600  the state database (crate::db): sandboxes' env vars, specs
//! <state>/layers/           0700  image layers (bb_layers::ImageStore), layers.lock beside it
//! <state>/snaplayers/       0700  writable and snapshot layers (crate::layers)
//! <state>/sandboxes/<id>/   0711 / 0700 (owned by the sandbox's host uid): root mount points,
//!                           overlay work dirs, logs, the control socket
//! <state>/trash/            0700  layers and dirs being deleted (emptied at start)
//! <state>/tmp/, cache/      0700  scratch space and the .deb cache of image builds
//! <state>/setns.key         0600  the key sandboxes' seccomp filters let the daemon's setns through with
//! <state>/daemon.lock       one daemon per state dir
//! ```
//!
//! Overlay mounts reach their layers with the daemon's credentials, so no sandbox needs to read
//! a layer directory by path; host users other than root can read nothing here.

use crate::db::{self, DbResult};
use crate::error::{Result, RuntimeError};
use bb_layers::IdMap;
use parking_lot::Mutex;
use rusqlite::{params, Connection, OptionalExtension};
use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StateDirError {
    #[error("state dir {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("init binary {0} not found: build it (`make build`) or pass --init-bin")]
    InitBinary(PathBuf),
    #[error("{path}: {problem}: delete it and restart (sandboxes started with the old key must be killed)")]
    SetnsKey { path: PathBuf, problem: String },
    #[error("state dir {state_dir}: unreadable id mapping {value:?} in table settings")]
    IdMapUnreadable { state_dir: PathBuf, value: String },
}

fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> StateDirError + '_ {
    move |source| StateDirError::Io { path: path.to_path_buf(), source }
}

/// Make the state dir's directories with their permissions (also those of a state dir made by
/// an older daemon, which left it and its database readable by every host user); returns the
/// database's path. `sandboxes/` is traverse-only; each sandbox's own directory is 0700 and
/// owned by the sandbox's host uid (its init must traverse it): host users cannot reach
/// sandbox roots.
pub fn prepare(state_dir: &Path) -> Result<PathBuf, StateDirError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mode = |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).map_err(io_at(p));
    std::fs::create_dir_all(state_dir).map_err(io_at(state_dir))?;
    mode(state_dir, 0o711)?;
    for (sub, m) in [("sandboxes", 0o711), ("snaplayers", 0o700), ("trash", 0o700), ("tmp", 0o700)] {
        let dir = state_dir.join(sub);
        std::fs::create_dir_all(&dir).map_err(io_at(&dir))?;
        mode(&dir, m)?;
    }
    spread_directories(state_dir);
    let db = state_dir.join("branchbox.db");
    // Made 0600 before SQLite opens it (its -wal and -shm files take the database's mode).
    std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(&db).map_err(io_at(&db))?;
    for name in ["branchbox.db", "branchbox.db-wal", "branchbox.db-shm"] {
        let p = state_dir.join(name);
        if p.exists() {
            mode(&p, 0o600)?;
        }
    }
    Ok(db)
}

/// Delete everything in `<state>/trash` (left by a crash mid-delete), keeping the dir.
pub fn empty_trash(state_dir: &Path) {
    if let Ok(rd) = std::fs::read_dir(state_dir.join("trash")) {
        for e in rd.flatten() {
            let _ = std::fs::remove_dir_all(e.path()).or_else(|_| std::fs::remove_file(e.path()));
        }
    }
}

/// Facts about the state dir itself in the state database (table `settings`).
pub struct Settings(Mutex<Connection>);

impl Settings {
    pub fn open(db: &Path) -> DbResult<Settings> {
        let conn = db::open(db)?;
        conn.execute_batch("CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);")?;
        Ok(Settings(Mutex::new(conn)))
    }

    pub fn get(&self, key: &str) -> DbResult<Option<String>> {
        Ok(self
            .0
            .lock()
            .query_row("SELECT value FROM settings WHERE key = ?1", params![key], |r| r.get(0))
            .optional()?)
    }

    pub fn set(&self, key: &str, value: &str) -> DbResult<()> {
        self.0.lock().execute(
            "INSERT INTO settings (key, value) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET value = ?2",
            params![key, value],
        )?;
        Ok(())
    }
}

/// Images (every file of every layer) and sandbox directories are owned by the host ids of the
/// id mapping the state dir was set up with: a daemon with another `--uid-base` would start
/// sandboxes that cannot use any of them. The mapping is recorded on first start and every later
/// start must match it. A state dir from before the record is judged by its layers' owners.
pub fn check_idmap(state_dir: &Path, settings: &Settings, idmap: IdMap) -> Result<()> {
    let want = format!("{}:{}", idmap.host_base, idmap.size);
    let recorded = match settings.get("idmap")? {
        Some(v) => {
            let parsed =
                v.split_once(':').and_then(|(b, n)| Some(IdMap { host_base: b.parse().ok()?, size: n.parse().ok()? }));
            Some(parsed.ok_or_else(|| StateDirError::IdMapUnreadable {
                state_dir: state_dir.to_path_buf(),
                value: v.clone(),
            })?)
        }
        None => None,
    };
    let mismatch = |base: u32, what: &str| {
        RuntimeError::Conflict(format!(
            "state dir {} was set up with --uid-base {base} ({what}), but this daemon was started with --uid-base {}: \
             start it with --uid-base {base}, or use another --state-dir",
            state_dir.display(),
            idmap.host_base
        ))
    };
    match recorded {
        Some(r) if r == idmap => Ok(()),
        Some(r) if r.size != idmap.size => Err(RuntimeError::Conflict(format!(
            "state dir {} was set up for {} sandbox ids per user namespace, this daemon maps {}: use the branchboxd it was \
             set up with, or another --state-dir",
            state_dir.display(),
            r.size,
            idmap.size
        ))),
        Some(r) => Err(mismatch(r.host_base, "recorded in its database")),
        None => {
            // Layer roots belong to the image's root user: host_base (or an id above it). Those
            // owned by host root say nothing.
            let owners = std::fs::read_dir(state_dir.join("layers")).into_iter().flatten().flatten().filter_map(|e| {
                use std::os::unix::fs::MetadataExt;
                e.metadata().ok().map(|m| m.uid()).filter(|&u| u != 0)
            });
            if let Some(base) = owners.filter(|&u| u < idmap.host_base || u >= idmap.host_base.saturating_add(idmap.size)).min() {
                return Err(mismatch(base, &format!("its image layers are owned by host uid {base}")));
            }
            Ok(settings.set("idmap", &want)?)
        }
    }
}

/// Writable layers (`snaplayers/`) and sandbox directories (`sandboxes/`) are made and deleted
/// by the thousand. On ext4 without a journal, every new inode skips the group's inodes deleted
/// in the last minutes (`recently_deleted`, one buffer lookup each): with all of them packed in
/// the group of their parent, mkdir there gets several times dearer (BENCHMARKS.md has the
/// numbers). Marked as tops of hierarchies, their
/// subdirectories are spread over the block groups. Elsewhere (XFS, btrfs, tmpfs) a no-op.
fn spread_directories(state_dir: &Path) {
    for sub in ["snaplayers", "sandboxes"] {
        let dir = state_dir.join(sub);
        let set = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::File::open(&dir))
            .map_err(|e| e.to_string())
            .and_then(|f| bb_sys::mount_api::set_topdir(std::os::fd::AsFd::as_fd(&f)).map_err(|e| e.to_string()));
        if let Err(e) = set {
            tracing::debug!(dir = %dir.display(), "cannot mark as top directory: {e}");
        }
    }
}

/// The daemon's setns key: 16 random bytes in `path` (default `<state>/setns.key`, 0600), made
/// on first start. It must outlive restarts: sandboxes started earlier have it compiled into
/// their filters, and so do processes restored from their images, on any daemon: daemons that
/// share an object store share this file too (`--setns-key-file`).
pub fn load_setns_key(path: &Path) -> Result<[u64; 2], StateDirError> {
    let path = path.to_path_buf();
    let buf = bb_sys::secret::load_or_create(&path, 16)
        .map_err(|e| StateDirError::SetnsKey { path: path.clone(), problem: e.to_string() })?;
    let key = [
        u64::from_ne_bytes(buf[..8].try_into().expect("8 bytes")),
        u64::from_ne_bytes(buf[8..].try_into().expect("8 bytes")),
    ];
    if key == [0, 0] {
        return Err(StateDirError::SetnsKey { path, problem: "all zeros".into() });
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_dir_and_its_database_are_not_readable_by_other_users() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("state");
        // As an older daemon left it: everything world-readable.
        std::fs::create_dir_all(state.join("snaplayers")).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(state.join("branchbox.db-wal"), b"").unwrap();
        std::fs::set_permissions(state.join("branchbox.db-wal"), std::fs::Permissions::from_mode(0o644)).unwrap();
        let db = prepare(&state).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&state), 0o711);
        assert_eq!(mode(&db), 0o600);
        assert_eq!(mode(&state.join("branchbox.db-wal")), 0o600);
        assert_eq!(mode(&state.join("snaplayers")), 0o700);
        assert_eq!(mode(&state.join("sandboxes")), 0o711);
        std::fs::write(state.join("trash/x"), b"").unwrap();
        std::fs::create_dir(state.join("trash/y")).unwrap();
        empty_trash(&state);
        assert_eq!(std::fs::read_dir(state.join("trash")).unwrap().count(), 0);
    }

    #[test]
    fn a_state_dir_keeps_the_uid_base_it_was_set_up_with() {
        let d = tempfile::tempdir().unwrap();
        let store = Settings::open(&d.path().join("branchbox.db")).unwrap();
        let default = IdMap::default();
        check_idmap(d.path(), &store, default).unwrap();
        check_idmap(d.path(), &store, default).unwrap();
        let other = IdMap { host_base: 3_000_000, ..default };
        let e = check_idmap(d.path(), &store, other).unwrap_err();
        assert!(matches!(e, RuntimeError::Conflict(_)), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("set up with --uid-base 1000000") && msg.contains("start it with --uid-base 1000000"),
            "{msg}"
        );
        assert!(msg.contains("started with --uid-base 3000000"), "{msg}");
        // The record is kept: the right base still works afterwards.
        check_idmap(d.path(), &store, default).unwrap();
    }

    #[test]
    fn a_state_dir_from_before_the_record_is_judged_by_its_layers() {
        let d = tempfile::tempdir().unwrap();
        let layer = d.path().join("layers").join(format!("local:{}", "0".repeat(32)));
        std::fs::create_dir_all(&layer).unwrap();
        if nix::unistd::chown(&layer, Some(nix::unistd::Uid::from_raw(1_000_000)), None).is_err() {
            eprintln!("skipped: chown needs root");
            return;
        }
        let store = Settings::open(&d.path().join("branchbox.db")).unwrap();
        let e = check_idmap(d.path(), &store, IdMap { host_base: 3_000_000, ..IdMap::default() }).unwrap_err();
        assert!(e.to_string().contains("start it with --uid-base 1000000"), "{e}");
        assert_eq!(store.get("idmap").unwrap(), None, "nothing recorded from a refused start");
        check_idmap(d.path(), &store, IdMap::default()).unwrap();
        assert_eq!(store.get("idmap").unwrap().as_deref(), Some("1000000:65536"));
    }
}
