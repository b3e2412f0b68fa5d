//! Sandbox records in SQLite (`<state>/branchbox.db`, table `sandboxes`).
//!
//! A row is written once the sandbox's init reported ready and deleted once it is fully torn down,
//! so after a crash every row names a sandbox to re-attach to or to reap.

use crate::error::Result;
use crate::model::SandboxSpec;
use rusqlite::{params, Connection};
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRow {
    pub id: String,
    pub spec: SandboxSpec,
    pub init_pid: i32,
    pub init_start: u64,
    pub created_at: f64,
    pub expires_at: Option<f64>,
}

pub struct Store {
    conn: Connection,
}

impl Store {
    pub fn open(path: &Path) -> Result<Store> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS sandboxes (
                id TEXT PRIMARY KEY,
                spec TEXT NOT NULL,
                init_pid INTEGER NOT NULL,
                init_start INTEGER NOT NULL,
                created_at REAL NOT NULL,
                expires_at REAL
            );",
        )?;
        Ok(Store { conn })
    }

    pub fn insert(&self, row: &SandboxRow) -> Result<()> {
        let spec = serde_json::to_string(&row.spec).expect("spec serializes");
        self.conn.execute(
            "INSERT INTO sandboxes (id, spec, init_pid, init_start, created_at, expires_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![row.id, spec, row.init_pid, row.init_start as i64, row.created_at, row.expires_at],
        )?;
        Ok(())
    }

    pub fn set_expiry(&self, id: &str, expires_at: Option<f64>) -> Result<()> {
        self.conn.execute("UPDATE sandboxes SET expires_at = ?2 WHERE id = ?1", params![id, expires_at])?;
        Ok(())
    }

    pub fn delete(&self, id: &str) -> Result<()> {
        self.conn.execute("DELETE FROM sandboxes WHERE id = ?1", params![id])?;
        Ok(())
    }

    pub fn all(&self) -> Result<Vec<SandboxRow>> {
        let mut stmt = self
            .conn
            .prepare("SELECT id, spec, init_pid, init_start, created_at, expires_at FROM sandboxes ORDER BY created_at")?;
        let rows = stmt.query_map([], |r| {
            let spec: String = r.get(1)?;
            Ok((r.get::<_, String>(0)?, spec, r.get(2)?, r.get::<_, i64>(3)?, r.get(4)?, r.get(5)?))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, spec, init_pid, init_start, created_at, expires_at) = row?;
            match serde_json::from_str(&spec) {
                Ok(spec) => out.push(SandboxRow { id, spec, init_pid, init_start: init_start as u64, created_at, expires_at }),
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
            metadata: [("k".to_string(), "v".to_string())].into(),
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
        };
        Store::open(&db).unwrap().insert(&row).unwrap();
        let store = Store::open(&db).unwrap();
        assert_eq!(store.all().unwrap(), vec![row.clone()]);
        store.set_expiry("sb-1", None).unwrap();
        assert_eq!(store.all().unwrap()[0].expires_at, None);
        assert!(store.insert(&row).is_err(), "duplicate ids must be refused");
        store.delete("sb-1").unwrap();
        assert!(store.all().unwrap().is_empty());
    }
}
