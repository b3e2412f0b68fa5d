//! Sandbox records in the state database (tables `sandboxes` and `husks`).
//!
//! A row is written once the sandbox's init reported ready and deleted once it is fully torn down,
//! so after a crash every row names a sandbox to re-attach to or to reap.
//!
//! A paused sandbox also has a row in `paused` ([`PausedRow`]): the process images its processes
//! were dumped to, written before the dump starts (state `pausing`) and committed once every
//! tree is dumped (state `paused`).
//!
//! A *husk* is what is left of a killed sandbox whose init must live on because sandboxes forked
//! from it are nested in its pid namespace (killing that init would kill them): only the init, in
//! its cgroup; everything else is gone. It is torn down with its last nested sandbox.

use crate::db::{self, DbResult};
use crate::model::{PauseMode, SandboxSpec};
use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    pub id: String,
    pub spec: SandboxSpec,
    pub init_pid: i32,
    pub init_start: u64,
    pub created_at: f64,
    pub expires_at: Option<f64>,
    /// The sandbox whose user and pid namespaces this one is nested in (a fork child with live
    /// sessions), if any.
    pub nest_parent: Option<String>,
}

/// A killed sandbox's init kept alive for the sandboxes nested in it.
#[derive(Debug, Clone, PartialEq)]
pub struct HuskRow {
    pub id: String,
    pub init_pid: i32,
    pub init_start: u64,
    pub nest_parent: Option<String>,
}

/// Where a pause of a sandbox is: `Pausing` until every process tree is dumped (a crash then
/// calls the pause off: the processes still run), `Paused` once committed (a crash then leaves
/// the sandbox paused: its processes are killed and restored from the images on resume).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseState {
    Pausing,
    Paused,
}

/// One process tree of a paused sandbox (a child of its init and everything below it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PausedTree {
    /// Pid of the tree's root in the sandbox (restored under the same pid).
    pub root: i32,
    /// Its process image, once dumped.
    pub image: Option<String>,
    /// The session whose server is the root, if it is one.
    pub session: Option<PausedSession>,
    /// Its root is an attached process (`sandbox::exec::Plugs`): restored only while the daemon
    /// that paused it still runs (it holds the other ends of its pipes or its terminal).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attached: bool,
}

/// A session of a paused sandbox: what the daemon needs to take it back after a restore.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PausedSession {
    pub id: String,
    pub kind: String,
    pub default: bool,
    pub created_at: f64,
    /// The fd at which the session process holds the other end of its channel (see the
    /// session server's `rechannel`).
    pub channel_fd: i32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PausedRow {
    pub id: String,
    pub state: PauseState,
    pub paused_at: f64,
    pub trees: Vec<PausedTree>,
    /// `filesystem`: no trees were kept, the resume cold-boots.
    pub mode: PauseMode,
}

pub struct SandboxStore {
    conn: Connection,
}

impl SandboxStore {
    pub fn open(path: &Path) -> DbResult<SandboxStore> {
        let conn = db::open(path)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS sandboxes (
                id TEXT PRIMARY KEY,
                spec TEXT NOT NULL,
                init_pid INTEGER NOT NULL,
                init_start INTEGER NOT NULL,
                created_at REAL NOT NULL,
                expires_at REAL
            );
            CREATE TABLE IF NOT EXISTS husks (
                id TEXT PRIMARY KEY,
                init_pid INTEGER NOT NULL,
                init_start INTEGER NOT NULL,
                nest_parent TEXT
            );
            CREATE TABLE IF NOT EXISTS paused (
                id TEXT PRIMARY KEY,
                state TEXT NOT NULL,
                paused_at REAL NOT NULL,
                trees TEXT NOT NULL
            );",
        )?;
        // Added with nested forks; older databases get the column (NULL: not nested).
        let has_nest: bool =
            conn.prepare("SELECT 1 FROM pragma_table_info('sandboxes') WHERE name = 'nest_parent'")?.exists([])?;
        if !has_nest {
            conn.execute_batch("ALTER TABLE sandboxes ADD COLUMN nest_parent TEXT;")?;
        }
        // Added with files-only pauses; older records were full pauses.
        let has_mode: bool =
            conn.prepare("SELECT 1 FROM pragma_table_info('paused') WHERE name = 'mode'")?.exists([])?;
        if !has_mode {
            conn.execute_batch("ALTER TABLE paused ADD COLUMN mode TEXT NOT NULL DEFAULT '\"full\"';")?;
        }
        Ok(SandboxStore { conn })
    }

    /// Write (or replace) the pause record of a sandbox.
    pub fn set_paused(&self, row: &PausedRow) -> DbResult<()> {
        self.conn.execute(
            "INSERT OR REPLACE INTO paused (id, state, paused_at, trees, mode) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![row.id, db::json(&row.state), row.paused_at, db::json(&row.trees), db::json(&row.mode)],
        )?;
        Ok(())
    }

    pub fn paused(&self, id: &str) -> DbResult<Option<PausedRow>> {
        let row = self
            .conn
            .query_row("SELECT id, state, paused_at, trees, mode FROM paused WHERE id = ?1", params![id], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, f64>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, String>(4)?,
                ))
            })
            .optional()?;
        let Some((id, state, paused_at, trees, mode)) = row else { return Ok(None) };
        let parsed = serde_json::from_str(&state)
            .and_then(|s| Ok((s, serde_json::from_str(&trees)?, serde_json::from_str(&mode)?)));
        match parsed {
            Ok((state, trees, mode)) => Ok(Some(PausedRow { id, state, paused_at, trees, mode })),
            Err(source) => Err(db::DbError::Record { what: "pause", id, source }),
        }
    }

    /// The process images every pause record names.
    pub fn paused_images(&self) -> DbResult<Vec<String>> {
        let mut stmt = self.conn.prepare("SELECT id, trees FROM paused")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        let mut out = Vec::new();
        for row in rows {
            let (id, trees) = row?;
            let trees: Vec<PausedTree> =
                serde_json::from_str(&trees).map_err(|source| db::DbError::Record { what: "pause", id, source })?;
            out.extend(trees.into_iter().filter_map(|t| t.image));
        }
        Ok(out)
    }

    pub fn clear_paused(&self, id: &str) -> DbResult<()> {
        self.conn.execute("DELETE FROM paused WHERE id = ?1", params![id])?;
        Ok(())
    }

    pub fn insert_husk(&self, row: &HuskRow) -> DbResult<()> {
        self.conn.execute(
            "INSERT OR REPLACE INTO husks (id, init_pid, init_start, nest_parent) VALUES (?1, ?2, ?3, ?4)",
            params![row.id, row.init_pid, row.init_start as i64, row.nest_parent],
        )?;
        Ok(())
    }

    pub fn delete_husk(&self, id: &str) -> DbResult<()> {
        self.conn.execute("DELETE FROM husks WHERE id = ?1", params![id])?;
        Ok(())
    }

    pub fn husks(&self) -> DbResult<Vec<HuskRow>> {
        let mut stmt = self.conn.prepare("SELECT id, init_pid, init_start, nest_parent FROM husks")?;
        let rows = stmt.query_map([], |r| {
            Ok(HuskRow {
                id: r.get(0)?,
                init_pid: r.get(1)?,
                init_start: r.get::<_, i64>(2)? as u64,
                nest_parent: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }

    pub fn insert(&self, row: &SandboxRow) -> DbResult<()> {
        let spec = db::json(&row.spec);
        self.conn.execute(
            "INSERT INTO sandboxes (id, spec, init_pid, init_start, created_at, expires_at, nest_parent) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![row.id, spec, row.init_pid, row.init_start as i64, row.created_at, row.expires_at, row.nest_parent],
        )?;
        Ok(())
    }

    pub fn set_expiry(&self, id: &str, expires_at: Option<f64>) -> DbResult<()> {
        self.conn.execute("UPDATE sandboxes SET expires_at = ?2 WHERE id = ?1", params![id, expires_at])?;
        Ok(())
    }

    pub fn delete(&self, id: &str) -> DbResult<()> {
        self.conn.execute("DELETE FROM sandboxes WHERE id = ?1", params![id])?;
        self.conn.execute("DELETE FROM paused WHERE id = ?1", params![id])?;
        Ok(())
    }

    pub fn all(&self) -> DbResult<Vec<SandboxRow>> {
        let mut stmt = self
            .conn
            .prepare("SELECT id, spec, init_pid, init_start, created_at, expires_at, nest_parent FROM sandboxes ORDER BY created_at")?;
        let rows = stmt.query_map([], |r| {
            let spec: String = r.get(1)?;
            Ok((r.get::<_, String>(0)?, spec, r.get(2)?, r.get::<_, i64>(3)?, r.get(4)?, r.get(5)?, r.get(6)?))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, spec, init_pid, init_start, created_at, expires_at, nest_parent) = row?;
            match serde_json::from_str(&spec) {
                Ok(spec) => out.push(SandboxRow {
                    id,
                    spec,
                    init_pid,
                    init_start: init_start as u64,
                    created_at,
                    expires_at,
                    nest_parent,
                }),
                Err(e) => tracing::warn!(%id, "unreadable sandbox record ({e}); it will be reaped"),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SandboxSpec {
        SandboxSpec {
            image: "base".into(),
            image_env: vec!["PATH=/bin".into()],
            layers: vec!["l1".into()],
            cpu: 1.0,
            memory_mb: 512,
            pids: 64,
            env: Default::default(),
            cwd: "/root".into(),
            network: "none".into(),
            allow: Vec::new(),
            proxy_port: Some(3128),
            proxy_record: false,
            net_limits: crate::net::policy::Limits { max_connections: Some(8), bandwidth_mbps: None },
            metadata: [("k".to_string(), "v".to_string())].into(),
            timeout: None,
            lifecycle: Default::default(),
            sudo: false,
        }
    }

    #[test]
    fn rows_survive_reopen_and_delete() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("b.db");
        let row = SandboxRow {
            id: "sb-1".into(),
            spec: spec(),
            init_pid: 42,
            init_start: 7,
            created_at: 1.5,
            expires_at: Some(9.0),
            nest_parent: Some("sb-0".into()),
        };
        SandboxStore::open(&db).unwrap().insert(&row).unwrap();
        let store = SandboxStore::open(&db).unwrap();
        assert_eq!(store.all().unwrap(), vec![row.clone()]);
        store.set_expiry("sb-1", None).unwrap();
        assert_eq!(store.all().unwrap()[0].expires_at, None);
        assert!(store.insert(&row).is_err(), "duplicate ids must be refused");
        store.delete("sb-1").unwrap();
        assert!(store.all().unwrap().is_empty());
        let husk = HuskRow { id: "sb-0".into(), init_pid: 9, init_start: 3, nest_parent: None };
        store.insert_husk(&husk).unwrap();
        assert_eq!(SandboxStore::open(&db).unwrap().husks().unwrap(), vec![husk]);
        store.delete_husk("sb-0").unwrap();
        assert!(store.husks().unwrap().is_empty());
    }

    #[test]
    fn pause_records_round_trip_and_go_with_their_sandbox() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("b.db");
        let store = SandboxStore::open(&db).unwrap();
        assert_eq!(store.paused("sb-1").unwrap(), None);
        let session =
            PausedSession { id: "ss-1".into(), kind: "python".into(), default: true, created_at: 2.0, channel_fd: 5 };
        let mut row = PausedRow {
            id: "sb-1".into(),
            state: PauseState::Pausing,
            paused_at: 3.0,
            trees: vec![
                PausedTree { root: 2, image: None, session: None, attached: true },
                PausedTree { root: 4, image: None, session: Some(session), attached: false },
            ],
            mode: PauseMode::Full,
        };
        store.set_paused(&row).unwrap();
        row.state = PauseState::Paused;
        row.trees[0].image = Some("pi-1".into());
        store.set_paused(&row).unwrap();
        assert_eq!(SandboxStore::open(&db).unwrap().paused("sb-1").unwrap(), Some(row));
        assert_eq!(store.paused_images().unwrap(), vec!["pi-1".to_string()]);
        store.delete("sb-1").unwrap();
        assert_eq!(store.paused("sb-1").unwrap(), None, "a deleted sandbox's pause record goes with it");
        let cold = PausedRow {
            id: "sb-2".into(),
            state: PauseState::Paused,
            paused_at: 4.0,
            trees: vec![],
            mode: PauseMode::Filesystem,
        };
        store.set_paused(&cold).unwrap();
        assert_eq!(store.paused("sb-2").unwrap(), Some(cold));
    }

    #[test]
    fn pause_records_of_an_older_database_read_as_full_pauses() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("b.db");
        {
            let conn = Connection::open(&db).unwrap();
            conn.execute_batch(
                "CREATE TABLE paused (id TEXT PRIMARY KEY, state TEXT NOT NULL, paused_at REAL NOT NULL, trees TEXT NOT NULL);
                 INSERT INTO paused VALUES ('sb-9', '\"paused\"', 1.0, '[]');",
            )
            .unwrap();
        }
        let row = SandboxStore::open(&db).unwrap().paused("sb-9").unwrap().unwrap();
        assert_eq!((row.state, row.mode), (PauseState::Paused, PauseMode::Full));
    }

    #[test]
    fn old_databases_get_the_nest_column() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("b.db");
        Connection::open(&db)
            .unwrap()
            .execute_batch(
                "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, spec TEXT NOT NULL, init_pid INTEGER NOT NULL,
                 init_start INTEGER NOT NULL, created_at REAL NOT NULL, expires_at REAL);",
            )
            .unwrap();
        let row = SandboxRow {
            id: "sb-2".into(),
            spec: spec(),
            init_pid: 1,
            init_start: 1,
            created_at: 1.0,
            expires_at: None,
            nest_parent: None,
        };
        let store = SandboxStore::open(&db).unwrap();
        store.insert(&row).unwrap();
        assert_eq!(store.all().unwrap(), vec![row]);
    }
}
