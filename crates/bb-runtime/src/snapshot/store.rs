//! Snapshot records and the sandbox's layer "generation", in SQLite next to the sandbox rows.
//!
//! A snapshot is a list of frozen layers (bottom first, on top of its image's layers), the spec
//! of the sandbox it was taken in, and its sessions with the key of each session's live template
//! process (if one was kept). Layers are directories `<state>/snaplayers/<layer id>`; a layer is
//! deleted only when no snapshot and no live sandbox lists it.

use crate::db::{self, json, DbResult as Result};
use crate::model::SandboxSpec;
use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashSet};

/// A session as a snapshot holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapSession {
    pub id: String,
    pub kind: String,
    pub default: bool,
    /// Key of the session's template (a frozen fork of it) in the runtime's session templates.
    /// Kept while the template lives or its process image does (it is restored under this key).
    pub template: Option<String>,
    /// The template's process image ([`crate::process_images`]): where its state is when the
    /// template left memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Why the session's state is gone (a rollback starts it fresh and says this).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<String>,
    /// When the session was made (unix seconds; 0 in records from before it was kept): its
    /// copies keep it, so sessions list in the same order in a fork or after a rollback.
    #[serde(default)]
    pub created_at: f64,
}

impl SnapSession {
    /// The creation time a copy of this session gets: the original's.
    pub fn copy_created_at(&self) -> f64 {
        if self.created_at > 0.0 {
            self.created_at
        } else {
            crate::now()
        }
    }
}

/// A background process tree a snapshot keeps (`processes: "all"`): its root's pid in the
/// sandbox, its command (init's tag) and the process image holding it; for a process attached
/// to the daemon (E2B's commands and terminals), how it was wired.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapProcess {
    pub pid: i32,
    pub tag: String,
    pub image: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attached: Option<crate::sandbox::exec::KeptAttached>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotRow {
    pub id: String,
    pub sandbox_id: String,
    pub parent: Option<String>,
    pub created_at: f64,
    pub label: Option<String>,
    /// Frozen layer ids, bottom first (image layers are in `spec.layers`).
    pub layers: Vec<String>,
    /// The layer this snapshot added (None: it shares its parent's state, nothing changed).
    pub own_layer: Option<String>,
    pub spec: SandboxSpec,
    pub sessions: Vec<SnapSession>,
    /// Background process trees kept as process images (`processes: "all"`).
    pub processes: Vec<SnapProcess>,
}

pub use crate::layers::Generation;

pub struct SnapStore {
    conn: Connection,
}

impl SnapStore {
    fn write_tx(&self) -> Result<rusqlite::Transaction<'_>> {
        db::write_tx(&self.conn)
    }

    pub fn open(path: &std::path::Path) -> Result<SnapStore> {
        let conn = db::open(path)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS snapshots (
                id TEXT PRIMARY KEY,
                sandbox_id TEXT NOT NULL,
                parent TEXT,
                created_at REAL NOT NULL,
                label TEXT,
                layers TEXT NOT NULL,
                own_layer TEXT,
                spec TEXT NOT NULL,
                sessions TEXT NOT NULL
            );
            CREATE TABLE IF NOT EXISTS snap_layers (
                id TEXT PRIMARY KEY,
                size_bytes INTEGER
            );
            CREATE TABLE IF NOT EXISTS generations (
                sandbox_id TEXT PRIMARY KEY,
                gen TEXT NOT NULL
            );
            CREATE TABLE IF NOT EXISTS durable_snapshots (
                id TEXT PRIMARY KEY,
                at REAL NOT NULL
            );
            CREATE INDEX IF NOT EXISTS snapshots_by_parent ON snapshots(parent);
            CREATE INDEX IF NOT EXISTS snapshots_by_sandbox ON snapshots(sandbox_id);
            CREATE INDEX IF NOT EXISTS snapshots_by_label ON snapshots(label);",
        )?;
        // Which snapshots name a session template (several do after lightweight checkpoints):
        // dropping one must not read every snapshot. Named `snap_templates` before "template"
        // meant only named templates (recipes); filled from the snapshots of a store made
        // before it existed.
        let table = |name: &str| -> Result<bool> {
            Ok(conn.query_row(
                "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?1",
                [name],
                |r| r.get(0),
            )?)
        };
        if table("snap_templates")? && !table("snapshot_session_templates")? {
            conn.execute_batch(
                "ALTER TABLE snap_templates RENAME TO snapshot_session_templates;
                 DROP INDEX IF EXISTS snap_templates_by_snap;",
            )?;
        }
        let had_refs = table("snapshot_session_templates")?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS snapshot_session_templates (
                key TEXT NOT NULL,
                snap_id TEXT NOT NULL,
                PRIMARY KEY (key, snap_id)
            ) WITHOUT ROWID;
            CREATE INDEX IF NOT EXISTS session_templates_by_snap ON snapshot_session_templates(snap_id);",
        )?;
        let has_processes: bool = conn.query_row(
            "SELECT count(*) > 0 FROM pragma_table_info('snapshots') WHERE name = 'processes'",
            [],
            |r| r.get(0),
        )?;
        if !has_processes {
            conn.execute_batch("ALTER TABLE snapshots ADD COLUMN processes TEXT NOT NULL DEFAULT '[]'")?;
        }
        let store = SnapStore { conn };
        if !had_refs {
            let tx = store.write_tx()?;
            for s in store.all()? {
                store.add_template_refs(&s)?;
            }
            tx.commit()?;
        }
        Ok(store)
    }

    fn add_template_refs(&self, s: &SnapshotRow) -> Result<()> {
        for key in s.sessions.iter().filter_map(|ss| ss.template.as_deref()) {
            self.conn
                .prepare_cached("INSERT OR IGNORE INTO snapshot_session_templates (key, snap_id) VALUES (?1, ?2)")?
                .execute(params![key, s.id])?;
        }
        Ok(())
    }

    pub fn insert(&self, s: &SnapshotRow) -> Result<()> {
        let tx = self.write_tx()?;
        self.insert_row(s)?;
        tx.commit()?;
        Ok(())
    }

    fn insert_row(&self, s: &SnapshotRow) -> Result<()> {
        self.conn.execute(
            "INSERT INTO snapshots (id, sandbox_id, parent, created_at, label, layers, own_layer, spec, sessions, processes)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
            params![
                s.id,
                s.sandbox_id,
                s.parent,
                s.created_at,
                s.label,
                json(&s.layers),
                s.own_layer,
                json(&s.spec),
                json(&s.sessions),
                json(&s.processes)
            ],
        )?;
        if let Some(l) = &s.own_layer {
            self.conn.execute("INSERT OR IGNORE INTO snap_layers (id, size_bytes) VALUES (?1, NULL)", params![l])?;
        }
        self.add_template_refs(s)
    }

    /// [`insert`](Self::insert) the snapshot and [`set_generation`](Self::set_generation) of its
    /// sandbox in one transaction: a crash never leaves one without the other, and it is one
    /// commit instead of three.
    pub fn insert_with_generation(&self, s: &SnapshotRow, sandbox_id: &str, g: &Generation) -> Result<()> {
        let tx = self.write_tx()?;
        self.insert_row(s)?;
        self.set_generation(sandbox_id, g)?;
        tx.commit()?;
        Ok(())
    }

    pub fn get(&self, id: &str) -> Result<Option<SnapshotRow>> {
        Ok(self.select("WHERE id = ?1", params![id])?.pop())
    }

    pub fn all(&self) -> Result<Vec<SnapshotRow>> {
        self.select("ORDER BY created_at, rowid", [])
    }

    /// The snapshots taken in `sandbox_id`, oldest first.
    pub fn of_sandbox(&self, sandbox_id: &str) -> Result<Vec<SnapshotRow>> {
        self.select("WHERE sandbox_id = ?1 ORDER BY created_at, rowid", params![sandbox_id])
    }

    /// Ids of the snapshots labelled `label`, oldest first.
    pub fn labelled(&self, label: &str) -> Result<Vec<String>> {
        let mut stmt =
            self.conn.prepare_cached("SELECT id FROM snapshots WHERE label = ?1 ORDER BY created_at, rowid")?;
        let rows = stmt.query_map(params![label], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Ids of the snapshots whose parent is `id`, oldest first.
    pub fn children(&self, id: &str) -> Result<Vec<String>> {
        let mut stmt =
            self.conn.prepare_cached("SELECT id FROM snapshots WHERE parent = ?1 ORDER BY created_at, rowid")?;
        let rows = stmt.query_map(params![id], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Snapshot records matching `clause` (appended to the SELECT); unreadable ones are skipped.
    fn select(&self, clause: &str, args: impl rusqlite::Params) -> Result<Vec<SnapshotRow>> {
        let mut stmt = self.conn.prepare_cached(&format!(
            "SELECT id, sandbox_id, parent, created_at, label, layers, own_layer, spec, sessions, processes FROM snapshots {clause}"
        ))?;
        let rows = stmt.query_map(args, |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, Option<String>>(2)?,
                r.get::<_, f64>(3)?,
                r.get::<_, Option<String>>(4)?,
                r.get::<_, String>(5)?,
                r.get::<_, Option<String>>(6)?,
                r.get::<_, String>(7)?,
                r.get::<_, String>(8)?,
                r.get::<_, String>(9)?,
            ))
        })?;
        let mut out = Vec::new();
        for row in rows {
            let (id, sandbox_id, parent, created_at, label, layers, own_layer, spec, sessions, processes) = row?;
            match (
                serde_json::from_str(&layers),
                serde_json::from_str(&spec),
                serde_json::from_str(&sessions),
                serde_json::from_str(&processes),
            ) {
                (Ok(layers), Ok(spec), Ok(sessions), Ok(processes)) => out.push(SnapshotRow {
                    id,
                    sandbox_id,
                    parent,
                    created_at,
                    label,
                    layers,
                    own_layer,
                    spec,
                    sessions,
                    processes,
                }),
                _ => tracing::warn!(%id, "unreadable snapshot record; ignored"),
            }
        }
        Ok(out)
    }

    /// Delete snapshot records; children of a deleted snapshot get its parent as theirs.
    pub fn delete(&self, ids: &BTreeSet<String>) -> Result<()> {
        let tx = self.write_tx()?;
        for id in ids {
            // Parents are rewritten as we go: the one read here is the nearest that stays,
            // or one deleted later in this loop (skipped up too).
            let parent_of = |id: &str| -> Result<Option<String>> {
                Ok(tx
                    .query_row("SELECT parent FROM snapshots WHERE id = ?1", params![id], |r| r.get(0))
                    .optional()?
                    .flatten())
            };
            let mut p = parent_of(id)?;
            while let Some(up) = p.as_deref().filter(|up| ids.contains(*up)) {
                p = parent_of(up)?;
            }
            tx.execute("UPDATE snapshots SET parent = ?2 WHERE parent = ?1", params![id, p])?;
            tx.execute("DELETE FROM snapshots WHERE id = ?1", params![id])?;
            tx.execute("DELETE FROM snapshot_session_templates WHERE snap_id = ?1", params![id])?;
            tx.execute("DELETE FROM durable_snapshots WHERE id = ?1", params![id])?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Forget a template key everywhere (its process is gone).
    pub fn drop_template(&self, key: &str) -> Result<()> {
        self.forget_template(key, None)
    }

    /// The template `key` is gone with no process image: the sessions that named it lose their
    /// state, for the reason `lost` says (kept with them, for the rollback's answer).
    pub fn forget_template(&self, key: &str, lost: Option<&str>) -> Result<()> {
        let tx = self.write_tx()?;
        self.update_sessions_of(key, |ss| {
            ss.template = None;
            if ss.image.is_none() {
                ss.lost = lost.map(str::to_string);
            }
        })?;
        self.conn.execute("DELETE FROM snapshot_session_templates WHERE key = ?1", params![key])?;
        tx.commit()?;
        Ok(())
    }

    /// The template `key` left memory and its state is in process image `image`.
    pub fn set_template_image(&self, key: &str, image: &str) -> Result<()> {
        let tx = self.write_tx()?;
        self.update_sessions_of(key, |ss| {
            ss.image = Some(image.to_string());
            ss.lost = None;
        })?;
        tx.commit()?;
        Ok(())
    }

    /// Process image `image` of template `key` was deleted (disk bound): its sessions lose
    /// their state unless the template is alive.
    pub fn drop_image(&self, key: &str, image: &str, lost: &str) -> Result<()> {
        let tx = self.write_tx()?;
        self.update_sessions_of(key, |ss| {
            if ss.image.as_deref() == Some(image) {
                ss.image = None;
                ss.lost = Some(lost.to_string());
            }
        })?;
        tx.commit()?;
        Ok(())
    }

    /// Apply `f` to every session naming template `key` (caller holds a write transaction).
    fn update_sessions_of(&self, key: &str, mut f: impl FnMut(&mut SnapSession)) -> Result<()> {
        let named =
            self.select("WHERE id IN (SELECT snap_id FROM snapshot_session_templates WHERE key = ?1)", params![key])?;
        for mut s in named {
            let before = s.sessions.clone();
            for ss in s.sessions.iter_mut().filter(|ss| ss.template.as_deref() == Some(key)) {
                f(ss);
            }
            if s.sessions != before {
                self.conn
                    .execute("UPDATE snapshots SET sessions = ?2 WHERE id = ?1", params![s.id, json(&s.sessions)])?;
            }
        }
        Ok(())
    }

    /// The process image of template `key`, if one was kept.
    pub fn template_image(&self, key: &str) -> Result<Option<String>> {
        let named =
            self.select("WHERE id IN (SELECT snap_id FROM snapshot_session_templates WHERE key = ?1)", params![key])?;
        Ok(named
            .into_iter()
            .flat_map(|s| s.sessions)
            .find(|ss| ss.template.as_deref() == Some(key) && ss.image.is_some())
            .and_then(|ss| ss.image))
    }

    /// Process images any snapshot names.
    pub fn images(&self) -> Result<HashSet<String>> {
        Ok(self
            .all()?
            .into_iter()
            .flat_map(|s| {
                s.sessions.into_iter().filter_map(|ss| ss.image).chain(s.processes.into_iter().map(|p| p.image))
            })
            .collect())
    }

    /// Replace the bottom `old` of every longer chain by `new` (compaction: `new` shows what
    /// `old` shows), in one transaction. Chains that are exactly `old` keep it (their own layer
    /// is its top). Returns the snapshots rewritten.
    pub fn replace_prefix(&self, old: &[String], new: &[String]) -> Result<usize> {
        // The stored JSON of a longer chain starting with `old` starts with `["a","b",` (serde
        // writes it compactly): only those rows are read, not every snapshot.
        let mut head = json(&old);
        head.pop(); // the closing ']'
        head.push(',');
        let tx = self.write_tx()?;
        let hits: Vec<(String, String)> = {
            let mut stmt =
                tx.prepare_cached("SELECT id, layers FROM snapshots WHERE substr(layers, 1, length(?1)) = ?1")?;
            let rows = stmt.query_map(params![head], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        let mut n = 0;
        for (id, layers) in hits {
            let Ok(layers) = serde_json::from_str::<Vec<String>>(&layers) else {
                tracing::warn!(%id, "unreadable snapshot record; its layers were not rewritten");
                continue;
            };
            if layers.len() > old.len() && layers.starts_with(old) {
                let mut out = new.to_vec();
                out.extend_from_slice(&layers[old.len()..]);
                tx.execute("UPDATE snapshots SET layers = ?2 WHERE id = ?1", params![id, json(&out)])?;
                n += 1;
            }
        }
        tx.commit()?;
        Ok(n)
    }

    /// Snapshot `id` is in the object store and recorded in the metadata store (pushed here, or
    /// pulled): its durability is `durable`.
    pub fn set_durable(&self, id: &str) -> Result<()> {
        self.conn
            .execute("INSERT OR IGNORE INTO durable_snapshots (id, at) VALUES (?1, ?2)", params![id, crate::now()])?;
        Ok(())
    }

    pub fn is_durable(&self, id: &str) -> Result<bool> {
        Ok(self
            .conn
            .query_row("SELECT count(*) > 0 FROM durable_snapshots WHERE id = ?1", params![id], |r| r.get(0))?)
    }

    /// Its record left the metadata store (deleted there): node-local again.
    pub fn clear_durable(&self, id: &str) -> Result<()> {
        self.conn.execute("DELETE FROM durable_snapshots WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// The sandbox whose namespaces hold snapshot `id`'s session templates is now `sandbox_id`
    /// (a pulled snapshot is adopted by the first sandbox made from it here).
    pub fn set_sandbox(&self, id: &str, sandbox_id: &str) -> Result<()> {
        self.conn.execute("UPDATE snapshots SET sandbox_id = ?2 WHERE id = ?1", params![id, sandbox_id])?;
        Ok(())
    }

    pub fn layer_size(&self, id: &str) -> Result<Option<u64>> {
        Ok(self
            .conn
            .query_row("SELECT size_bytes FROM snap_layers WHERE id = ?1", params![id], |r| r.get::<_, Option<i64>>(0))
            .optional()?
            .flatten()
            .map(|v| v as u64))
    }

    pub fn set_layer_size(&self, id: &str, size: u64) -> Result<()> {
        self.conn.execute(
            "INSERT INTO snap_layers (id, size_bytes) VALUES (?1, ?2) ON CONFLICT(id) DO UPDATE SET size_bytes = ?2",
            params![id, size as i64],
        )?;
        Ok(())
    }

    pub fn forget_layer(&self, id: &str) -> Result<()> {
        self.conn.execute("DELETE FROM snap_layers WHERE id = ?1", params![id])?;
        Ok(())
    }

    pub fn set_generation(&self, sandbox_id: &str, g: &Generation) -> Result<()> {
        self.conn.execute(
            "INSERT INTO generations (sandbox_id, gen) VALUES (?1, ?2) ON CONFLICT(sandbox_id) DO UPDATE SET gen = ?2",
            params![sandbox_id, json(g)],
        )?;
        Ok(())
    }

    pub fn generation(&self, sandbox_id: &str) -> Result<Option<Generation>> {
        let g: Option<String> = self
            .conn
            .query_row("SELECT gen FROM generations WHERE sandbox_id = ?1", params![sandbox_id], |r| r.get(0))
            .optional()?;
        Ok(g.and_then(|g| serde_json::from_str(&g).ok()))
    }

    pub fn generations(&self) -> Result<Vec<(String, Generation)>> {
        let mut stmt = self.conn.prepare("SELECT sandbox_id, gen FROM generations")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        let mut out = Vec::new();
        for r in rows {
            let (id, g) = r?;
            if let Ok(g) = serde_json::from_str(&g) {
                out.push((id, g));
            }
        }
        Ok(out)
    }

    pub fn delete_generation(&self, sandbox_id: &str) -> Result<()> {
        self.conn.execute("DELETE FROM generations WHERE sandbox_id = ?1", params![sandbox_id])?;
        Ok(())
    }
}

/// Snapshots to delete for `gc(keep)`: every snapshot in `scope` that is neither kept nor an
/// ancestor of a kept one.
pub fn unreachable(all: &[SnapshotRow], scope: &BTreeSet<String>, keep: &BTreeSet<String>) -> BTreeSet<String> {
    let parent: BTreeMap<&str, Option<&str>> = all.iter().map(|s| (s.id.as_str(), s.parent.as_deref())).collect();
    let mut reachable = BTreeSet::new();
    for k in keep {
        let mut cur = Some(k.as_str());
        while let Some(id) = cur {
            if !reachable.insert(id.to_string()) {
                break;
            }
            cur = parent.get(id).copied().flatten();
        }
    }
    scope.iter().filter(|id| !reachable.contains(*id)).cloned().collect()
}

/// The ids of each snapshot's children in `all` (in `all`'s order), by parent id.
pub fn children_by_parent(all: &[SnapshotRow]) -> std::collections::HashMap<&str, Vec<&str>> {
    let mut children: std::collections::HashMap<&str, Vec<&str>> = Default::default();
    for s in all {
        if let Some(p) = &s.parent {
            children.entry(p.as_str()).or_default().push(&s.id);
        }
    }
    children
}

/// `id` and all its descendants.
pub fn subtree(all: &[SnapshotRow], id: &str) -> BTreeSet<String> {
    let children = children_by_parent(all);
    let mut out = BTreeSet::from([id.to_string()]);
    let mut todo = vec![id];
    while let Some(cur) = todo.pop() {
        for &c in children.get(cur).into_iter().flatten() {
            if out.insert(c.to_string()) {
                todo.push(c);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SandboxSpec {
        SandboxSpec {
            image: "base".into(),
            image_env: vec![],
            layers: vec!["img".into()],
            cpu: 1.0,
            memory_mb: 256,
            pids: 64,
            env: Default::default(),
            cwd: "/root".into(),
            network: "none".into(),
            allow: Vec::new(),
            proxy_port: None,
            proxy_record: false,
            net_limits: Default::default(),
            metadata: Default::default(),
            timeout: None,
            lifecycle: Default::default(),
            sudo: false,
        }
    }

    fn row(id: &str, parent: Option<&str>, layers: &[&str]) -> SnapshotRow {
        SnapshotRow {
            id: id.into(),
            sandbox_id: "sb".into(),
            parent: parent.map(String::from),
            created_at: 1.0,
            label: None,
            layers: layers.iter().map(|s| s.to_string()).collect(),
            own_layer: layers.last().map(|s| s.to_string()),
            spec: spec(),
            processes: Vec::new(),
            sessions: vec![SnapSession {
                image: None,
                lost: None,
                id: "s".into(),
                kind: "python".into(),
                default: true,
                template: Some("t1".into()),
                created_at: 5.0,
            }],
        }
    }

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn tree_operations() {
        // a -> b -> c ; a -> d
        let all = vec![
            row("a", None, &["1"]),
            row("b", Some("a"), &["1", "2"]),
            row("c", Some("b"), &["1", "2", "3"]),
            row("d", Some("a"), &["1", "4"]),
        ];
        let scope = set(&["a", "b", "c", "d"]);
        assert_eq!(unreachable(&all, &scope, &set(&["c"])), set(&["d"]));
        assert_eq!(unreachable(&all, &scope, &set(&[])), scope);
        assert_eq!(unreachable(&all, &scope, &set(&["b", "d"])), set(&["c"]));
        assert_eq!(subtree(&all, "b"), set(&["b", "c"]));
        assert_eq!(subtree(&all, "a"), scope);
    }

    #[test]
    fn kept_processes_round_trip_with_their_wiring_and_old_rows_read_as_unattached() {
        use crate::sandbox::exec::{KeptAttached, Wire};
        let d = tempfile::tempdir().unwrap();
        let st = SnapStore::open(&d.path().join("db")).unwrap();
        let mut r = row("p", None, &["1"]);
        let note = serde_json::json!({"config": {"cmd": "/bin/bash"}, "tag": "srv"});
        r.processes = vec![
            SnapProcess { pid: 7, tag: "sleep 9".into(), image: "i1".into(), attached: None },
            SnapProcess {
                pid: 8,
                tag: "cat".into(),
                image: "i2".into(),
                attached: Some(KeptAttached {
                    wire: Wire::Pipes { stdout: 11, stderr: 12, stdin: Some(13) },
                    note: note.clone(),
                }),
            },
            SnapProcess {
                pid: 9,
                tag: "bash".into(),
                image: "i3".into(),
                attached: Some(KeptAttached {
                    wire: Wire::Terminal { tty: "tty[8802:18]".into(), rows: 30, cols: 100, ids: Some((1000, 1000)) },
                    note,
                }),
            },
        ];
        st.insert(&r).unwrap();
        assert_eq!(st.get("p").unwrap().unwrap(), r);
        let old: Vec<SnapProcess> = serde_json::from_str(r#"[{"pid": 7, "tag": "t", "image": "i"}]"#).unwrap();
        assert_eq!(old[0].attached, None, "rows written before attached processes were kept");
        let unattached = serde_json::to_value(&r.processes[0]).unwrap();
        assert!(unattached.get("attached").is_none(), "{unattached}");
    }

    #[test]
    fn store_round_trip_reparent_and_compaction() {
        let d = tempfile::tempdir().unwrap();
        let st = SnapStore::open(&d.path().join("db")).unwrap();
        for r in [
            row("a", None, &["1"]),
            row("b", Some("a"), &["1", "2"]),
            row("c", Some("b"), &["1", "2", "3"]),
            row("e", Some("a"), &["1", "22", "5"]),
        ] {
            st.insert(&r).unwrap();
        }
        assert_eq!(st.get("b").unwrap().unwrap(), row("b", Some("a"), &["1", "2"]));
        st.delete(&set(&["b"])).unwrap();
        assert_eq!(
            st.get("c").unwrap().unwrap().parent.as_deref(),
            Some("a"),
            "children move up to the deleted one's parent"
        );
        assert_eq!(st.replace_prefix(&["1".into(), "2".into()], &["m".into()]).unwrap(), 1);
        assert_eq!(st.get("c").unwrap().unwrap().layers, vec!["m".to_string(), "3".into()]);
        assert_eq!(
            st.get("a").unwrap().unwrap().layers,
            vec!["1".to_string()],
            "a chain that is only the prefix is unchanged"
        );
        assert_eq!(
            st.get("e").unwrap().unwrap().layers,
            vec!["1".to_string(), "22".into(), "5".into()],
            "a layer id that only starts like one of the prefix's is not part of it"
        );
        st.drop_template("t").unwrap();
        assert!(
            st.all().unwrap().iter().all(|s| s.sessions[0].template.as_deref() == Some("t1")),
            "a key that is a prefix of another drops nothing"
        );
        st.drop_template("t1").unwrap();
        assert!(st.all().unwrap().iter().all(|s| s.sessions[0].template.is_none()));
        let g = Generation {
            upper: "u".into(),
            chain: vec!["1".into()],
            mounted: vec!["1".into()],
            base: Some("a".into()),
            n: 3,
        };
        st.set_generation("sb", &g).unwrap();
        assert_eq!(st.generation("sb").unwrap(), Some(g));
        st.set_layer_size("3", 42).unwrap();
        assert_eq!(st.layer_size("3").unwrap(), Some(42));
    }

    #[test]
    fn deleting_a_run_of_ancestors_hands_children_to_the_nearest_kept_one_and_reads_by_index() {
        let d = tempfile::tempdir().unwrap();
        let st = SnapStore::open(&d.path().join("db")).unwrap();
        // a -> b -> c -> d ; b -> e ; f in another sandbox
        for r in [
            row("a", None, &["1"]),
            row("b", Some("a"), &["2"]),
            row("c", Some("b"), &["3"]),
            row("d", Some("c"), &["4"]),
            row("e", Some("b"), &["5"]),
        ] {
            st.insert(&r).unwrap();
        }
        st.insert(&SnapshotRow { sandbox_id: "other".into(), ..row("f", None, &["6"]) }).unwrap();
        assert_eq!(st.children("b").unwrap(), vec!["c".to_string(), "e".into()]);
        assert_eq!(st.of_sandbox("other").unwrap().len(), 1);
        st.insert(&SnapshotRow { label: Some("ready".into()), ..row("g", None, &["7"]) }).unwrap();
        st.insert(&SnapshotRow { label: Some("ready".into()), created_at: 9.0, ..row("h", Some("g"), &["8"]) })
            .unwrap();
        assert_eq!(st.labelled("ready").unwrap(), vec!["g".to_string(), "h".into()]);
        assert!(st.labelled("Ready").unwrap().is_empty());
        // Deleted in an order where a child comes before its parent.
        st.delete(&set(&["c", "b"])).unwrap();
        assert_eq!(st.get("d").unwrap().unwrap().parent.as_deref(), Some("a"));
        assert_eq!(st.get("e").unwrap().unwrap().parent.as_deref(), Some("a"));
        assert_eq!(st.children("a").unwrap(), vec!["d".to_string(), "e".into()]);
        st.delete(&set(&["a"])).unwrap();
        assert_eq!(st.get("d").unwrap().unwrap().parent, None, "the root's children become roots");
        // The template refs of deleted snapshots went with them.
        st.drop_template("t1").unwrap();
        assert!(st.all().unwrap().iter().all(|s| s.sessions[0].template.is_none()));
    }

    #[test]
    fn a_store_made_before_template_refs_finds_its_templates() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("db");
        {
            let st = SnapStore::open(&db).unwrap();
            st.insert(&row("a", None, &["1"])).unwrap();
            st.conn.execute_batch("DROP TABLE snapshot_session_templates").unwrap();
        }
        let st = SnapStore::open(&db).unwrap();
        st.drop_template("t1").unwrap();
        assert_eq!(st.get("a").unwrap().unwrap().sessions[0].template, None);
    }

    #[test]
    fn a_store_with_the_old_table_name_keeps_its_template_refs() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("db");
        {
            let st = SnapStore::open(&db).unwrap();
            st.insert(&row("a", None, &["1"])).unwrap();
            st.conn
                .execute_batch(
                    "ALTER TABLE snapshot_session_templates RENAME TO snap_templates;
                     DROP INDEX session_templates_by_snap;
                     CREATE INDEX snap_templates_by_snap ON snap_templates(snap_id);",
                )
                .unwrap();
        }
        let st = SnapStore::open(&db).unwrap();
        let old: bool = st
            .conn
            .query_row("SELECT count(*) > 0 FROM sqlite_master WHERE name LIKE 'snap_templates%'", [], |r| r.get(0))
            .unwrap();
        assert!(!old, "the old table and its index are gone");
        st.drop_template("t1").unwrap();
        assert_eq!(st.get("a").unwrap().unwrap().sessions[0].template, None, "found through the renamed table");
    }

    #[test]
    fn a_snapshot_and_its_generation_are_recorded_together_and_a_failed_insert_leaves_the_generation_alone() {
        let d = tempfile::tempdir().unwrap();
        let st = SnapStore::open(&d.path().join("db")).unwrap();
        let g = |n: u64, base: &str| Generation {
            upper: format!("u{n}"),
            chain: vec!["1".into()],
            mounted: vec!["1".into()],
            base: Some(base.into()),
            n,
        };
        st.insert_with_generation(&row("a", None, &["1"]), "sb", &g(1, "a")).unwrap();
        assert_eq!(st.get("a").unwrap().unwrap(), row("a", None, &["1"]));
        assert_eq!(st.generation("sb").unwrap(), Some(g(1, "a")));
        // The same id again fails: the generation stays what it was.
        assert!(st.insert_with_generation(&row("a", None, &["1", "2"]), "sb", &g(2, "a")).is_err());
        assert_eq!(st.generation("sb").unwrap(), Some(g(1, "a")));
        assert_eq!(st.get("a").unwrap().unwrap().layers, vec!["1".to_string()]);
        assert!(st.layer_size("2").unwrap().is_none());
    }
}
