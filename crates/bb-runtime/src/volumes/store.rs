//! Volume records in the state database: one row per volume (its layer chain and writable
//! layer), one per volume snapshot (a chain), one per mount of a volume in a live sandbox.

use crate::db::{self, json, DbError, DbResult as Result};
use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

/// A volume as this node holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeRow {
    pub id: String,
    pub name: Option<String>,
    pub access: crate::model::Access,
    pub quota_mb: Option<u64>,
    pub created_at: f64,
    /// Frozen layers (`<state>/snaplayers/<id>`), bottom first.
    pub chain: Vec<String>,
    /// The writable layer on top of `chain`.
    pub upper: String,
    /// Mount generation: names the overlay work dir of the current writable layer.
    pub n: u64,
    /// The volume this one was forked from.
    pub source: Option<String>,
    /// The chain last committed to the metadata store, and the head version it got.
    #[serde(default)]
    pub synced: Option<Synced>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Synced {
    pub version: i64,
    pub chain: Vec<String>,
    /// The volume's own snapshots (not a checkpoint's) that head holds, by id, sorted.
    #[serde(default)]
    pub snapshots: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeSnapRow {
    pub id: String,
    pub volume: String,
    pub created_at: f64,
    pub label: Option<String>,
    pub chain: Vec<String>,
    /// Taken by a checkpoint of a sandbox that mounts the volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointOf>,
}

/// The sandbox snapshot a volume snapshot belongs to, and where the volume was mounted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointOf {
    pub snapshot: String,
    pub path: String,
    /// The mount was read-only (forks of it are mounted so too).
    #[serde(default)]
    pub read_only: bool,
    /// An `rox` volume: fork children mount this same volume (read-only), nothing is forked.
    #[serde(default)]
    pub shared: bool,
}

/// A volume mounted in a sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MountRow {
    pub sandbox: String,
    pub volume: String,
    pub path: String,
    pub read_only: bool,
    pub branch: bool,
}

pub struct VolumeStore {
    conn: Connection,
}

fn parse<T: serde::de::DeserializeOwned>(what: &'static str, id: String, body: String) -> Result<T> {
    serde_json::from_str(&body).map_err(|source| DbError::Record { what, id, source })
}

impl VolumeStore {
    pub fn open(path: &std::path::Path) -> Result<VolumeStore> {
        let conn = db::open(path)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS volumes (
                id TEXT PRIMARY KEY,
                name TEXT UNIQUE,
                body TEXT NOT NULL
            );
            CREATE TABLE IF NOT EXISTS volume_snapshots (
                id TEXT PRIMARY KEY,
                volume TEXT NOT NULL,
                body TEXT NOT NULL
            );
            CREATE INDEX IF NOT EXISTS volume_snapshots_by_volume ON volume_snapshots(volume);
            CREATE INDEX IF NOT EXISTS volume_snapshots_by_checkpoint
                ON volume_snapshots(json_extract(body, '$.checkpoint.snapshot'));
            CREATE TABLE IF NOT EXISTS volume_mounts (
                sandbox TEXT NOT NULL,
                volume TEXT NOT NULL,
                path TEXT NOT NULL,
                body TEXT NOT NULL,
                PRIMARY KEY (sandbox, path)
            );",
        )?;
        Ok(VolumeStore { conn })
    }

    pub fn insert(&self, v: &VolumeRow) -> Result<()> {
        self.conn
            .execute("INSERT INTO volumes (id, name, body) VALUES (?1, ?2, ?3)", params![v.id, v.name, json(v)])?;
        Ok(())
    }

    pub fn update(&self, v: &VolumeRow) -> Result<()> {
        self.conn.execute("UPDATE volumes SET body = ?2 WHERE id = ?1", params![v.id, json(v)])?;
        Ok(())
    }

    /// A volume by id or name.
    pub fn get(&self, id_or_name: &str) -> Result<Option<VolumeRow>> {
        let row: Option<(String, String)> = self
            .conn
            .query_row(
                "SELECT id, body FROM volumes WHERE id = ?1 OR name = ?1 ORDER BY id = ?1 DESC LIMIT 1",
                params![id_or_name],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        row.map(|(id, body)| parse("volume", id, body)).transpose()
    }

    pub fn all(&self) -> Result<Vec<VolumeRow>> {
        let mut st = self.conn.prepare("SELECT id, body FROM volumes ORDER BY id")?;
        let rows = st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        rows.map(|r| {
            let (id, body) = r?;
            parse("volume", id, body)
        })
        .collect()
    }

    /// Delete a volume with its snapshots (one transaction).
    pub fn delete(&self, id: &str) -> Result<()> {
        let tx = db::write_tx(&self.conn)?;
        tx.execute("DELETE FROM volume_snapshots WHERE volume = ?1", params![id])?;
        tx.execute("DELETE FROM volumes WHERE id = ?1", params![id])?;
        tx.commit()?;
        Ok(())
    }

    pub fn insert_snapshot(&self, s: &VolumeSnapRow) -> Result<()> {
        self.conn.execute(
            "INSERT INTO volume_snapshots (id, volume, body) VALUES (?1, ?2, ?3)",
            params![s.id, s.volume, json(s)],
        )?;
        Ok(())
    }

    /// Record snapshots `snaps` and drop those named `gone` (one transaction); a snapshot
    /// already recorded stays as it is.
    pub fn merge_snapshots(&self, snaps: &[VolumeSnapRow], gone: &[String]) -> Result<()> {
        let tx = db::write_tx(&self.conn)?;
        for s in snaps {
            tx.execute(
                "INSERT OR IGNORE INTO volume_snapshots (id, volume, body) VALUES (?1, ?2, ?3)",
                params![s.id, s.volume, json(s)],
            )?;
        }
        for id in gone {
            tx.execute("DELETE FROM volume_snapshots WHERE id = ?1", params![id])?;
        }
        tx.commit()?;
        Ok(())
    }

    pub fn snapshot(&self, id: &str) -> Result<Option<VolumeSnapRow>> {
        let body: Option<String> = self
            .conn
            .query_row("SELECT body FROM volume_snapshots WHERE id = ?1", params![id], |r| r.get(0))
            .optional()?;
        body.map(|b| parse("volume snapshot", id.to_string(), b)).transpose()
    }

    /// Snapshots of one volume (or of every volume), oldest first.
    pub fn snapshots(&self, volume: Option<&str>) -> Result<Vec<VolumeSnapRow>> {
        self.snapshots_where("?1 IS NULL OR volume = ?1", volume)
    }

    /// The volume snapshots sandbox snapshot `sid` took, oldest first (indexed: asked at every
    /// create).
    pub fn snapshots_of_checkpoint(&self, sid: &str) -> Result<Vec<VolumeSnapRow>> {
        self.snapshots_where("json_extract(body, '$.checkpoint.snapshot') = ?1", Some(sid))
    }

    /// Volume `volume`'s own snapshots (taken on it, not by a sandbox checkpoint), oldest first:
    /// those its committed head carries.
    pub fn own_snapshots(&self, volume: &str) -> Result<Vec<VolumeSnapRow>> {
        self.snapshots_where("volume = ?1 AND json_extract(body, '$.checkpoint') IS NULL", Some(volume))
    }

    fn snapshots_where(&self, cond: &str, arg: Option<&str>) -> Result<Vec<VolumeSnapRow>> {
        let mut st = self.conn.prepare(&format!("SELECT id, body FROM volume_snapshots WHERE {cond}"))?;
        let rows = st.query_map(params![arg], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        let mut v: Vec<VolumeSnapRow> = rows
            .map(|r| {
                let (id, body) = r?;
                parse("volume snapshot", id, body)
            })
            .collect::<Result<_>>()?;
        v.sort_by(|a, b| a.created_at.total_cmp(&b.created_at).then(a.id.cmp(&b.id)));
        Ok(v)
    }

    pub fn delete_snapshot(&self, id: &str) -> Result<bool> {
        Ok(self.conn.execute("DELETE FROM volume_snapshots WHERE id = ?1", params![id])? > 0)
    }

    pub fn insert_mount(&self, m: &MountRow) -> Result<()> {
        self.conn.execute(
            "INSERT OR REPLACE INTO volume_mounts (sandbox, volume, path, body) VALUES (?1, ?2, ?3, ?4)",
            params![m.sandbox, m.volume, m.path, json(m)],
        )?;
        Ok(())
    }

    pub fn mounts(&self) -> Result<Vec<MountRow>> {
        let mut st = self.conn.prepare("SELECT sandbox, body FROM volume_mounts ORDER BY sandbox, path")?;
        let rows = st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        rows.map(|r| {
            let (id, body) = r?;
            parse("volume mount", id, body)
        })
        .collect()
    }

    pub fn delete_mounts(&self, sandbox: &str) -> Result<()> {
        self.conn.execute("DELETE FROM volume_mounts WHERE sandbox = ?1", params![sandbox])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, name: Option<&str>) -> VolumeRow {
        VolumeRow {
            id: id.into(),
            name: name.map(Into::into),
            access: crate::model::Access::Rwo,
            quota_mb: None,
            created_at: 1.0,
            chain: vec![],
            upper: "sl-1".into(),
            n: 0,
            source: None,
            synced: None,
        }
    }

    #[test]
    fn volumes_by_id_or_name_and_delete_takes_snapshots() {
        let dir = tempfile::tempdir().unwrap();
        let s = VolumeStore::open(&dir.path().join("db")).unwrap();
        s.insert(&row("vol-a", Some("ws"))).unwrap();
        s.insert(&row("vol-b", None)).unwrap();
        assert!(s.insert(&row("vol-c", Some("ws"))).is_err(), "names are unique");
        assert_eq!(s.get("ws").unwrap().unwrap().id, "vol-a");
        assert_eq!(s.get("vol-b").unwrap().unwrap().id, "vol-b");
        assert!(s.get("nope").unwrap().is_none());
        let snap = VolumeSnapRow {
            id: "vs-1".into(),
            volume: "vol-a".into(),
            created_at: 2.0,
            label: None,
            chain: vec!["sl-1".into()],
            checkpoint: None,
        };
        s.insert_snapshot(&snap).unwrap();
        assert_eq!(s.snapshots(Some("vol-a")).unwrap(), vec![snap.clone()]);
        assert_eq!(s.snapshots(None).unwrap().len(), 1);
        s.delete("vol-a").unwrap();
        assert!(s.snapshot("vs-1").unwrap().is_none());
        assert_eq!(s.all().unwrap().len(), 1);
        let m = MountRow {
            sandbox: "sb1".into(),
            volume: "vol-b".into(),
            path: "/w".into(),
            read_only: false,
            branch: true,
        };
        s.insert_mount(&m).unwrap();
        assert_eq!(s.mounts().unwrap(), vec![m]);
        s.delete_mounts("sb1").unwrap();
        assert!(s.mounts().unwrap().is_empty());
    }

    #[test]
    fn snapshots_of_a_checkpoint_are_found_by_its_id_and_own_snapshots_are_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let s = VolumeStore::open(&dir.path().join("db")).unwrap();
        let snap = |id: &str, of: Option<&str>| VolumeSnapRow {
            id: id.into(),
            volume: "vol-a".into(),
            created_at: 1.0,
            label: None,
            chain: vec![],
            checkpoint: of.map(|sid| CheckpointOf {
                snapshot: sid.into(),
                path: format!("/{id}"),
                read_only: false,
                shared: false,
            }),
        };
        for (id, of) in [("vs-1", Some("snap-x")), ("vs-2", None), ("vs-3", Some("snap-y")), ("vs-4", Some("snap-x"))] {
            s.insert_snapshot(&snap(id, of)).unwrap();
        }
        let ids = |sid| s.snapshots_of_checkpoint(sid).unwrap().into_iter().map(|v| v.id).collect::<Vec<_>>();
        assert_eq!(ids("snap-x"), ["vs-1", "vs-4"]);
        assert_eq!(ids("snap-y"), ["vs-3"]);
        assert!(ids("snap-z").is_empty());
        let again = snap("vs-2", Some("snap-z"));
        s.merge_snapshots(&[again, snap("vs-5", None)], &["vs-3".into()]).unwrap();
        assert!(ids("snap-z").is_empty(), "a recorded snapshot stays as it was");
        assert!(ids("snap-y").is_empty(), "a gone one is dropped");
        s.delete_snapshot("vs-5").unwrap();
        let own: Vec<String> = s.own_snapshots("vol-a").unwrap().into_iter().map(|v| v.id).collect();
        assert_eq!(own, ["vs-2"], "a checkpoint's volume snapshots are not the volume's own");
        assert!(s.own_snapshots("vol-b").unwrap().is_empty());
    }
}
