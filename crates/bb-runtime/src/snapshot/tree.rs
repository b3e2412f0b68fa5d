//! The snapshot tree: list (all, or one sandbox's snapshots with their ancestors), get, delete
//! (one or a subtree), and gc (snapshots no kept one needs). Deleting hands children to the
//! nearest kept ancestor, drops the session templates only the deleted snapshots used, and
//! collects the layers nothing stands on any more ([`crate::layers`]).

use super::store;
use crate::error::{Result, RuntimeError};
use crate::layers::LAYER_GC_MIN_AGE;
use crate::model::*;
use crate::snapshot::store::SnapshotRow;
use crate::Runtime;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

impl Runtime {
    /// Ids of the snapshots labelled `label`, oldest first (read by index).
    pub fn snapshots_labelled(&self, label: &str) -> Result<Vec<String>> {
        Ok(self.snapshots.records().labelled(label)?)
    }

    pub fn list_snapshots(&self, sandbox: Option<&str>) -> Result<SnapshotList> {
        let Some(id) = sandbox else {
            let all = self.snapshots.records().all()?;
            let mut children = store::children_by_parent(&all);
            let snapshots = all
                .iter()
                .map(|s| {
                    let kids = children.remove(s.id.as_str()).unwrap_or_default();
                    self.snapshot_info(s, kids.into_iter().map(str::to_string).collect())
                })
                .collect();
            return Ok(SnapshotList { snapshots });
        };
        // The sandbox's own snapshots and their ancestors (a fork child's tree starts in its
        // parent), read by index: never every snapshot the daemon holds.
        // The generation is read before the store is locked: compaction and snapshot deletion
        // lock a generation, then the store.
        let live = self.get(id).ok();
        let live_base = live.as_ref().and_then(|sb| sb.gen.lock().as_ref().and_then(|g| g.base.clone()));
        let snaps = self.snapshots.records();
        let own = snaps.of_sandbox(id)?;
        if own.is_empty() && live.is_none() {
            return Err(RuntimeError::sandbox(id));
        }
        let mut rows: HashMap<String, SnapshotRow> = HashMap::new();
        let mut todo: Vec<String> = own.iter().filter_map(|s| s.parent.clone()).collect();
        todo.extend(live_base);
        rows.extend(own.into_iter().map(|s| (s.id.clone(), s)));
        while let Some(sid) = todo.pop() {
            if rows.contains_key(&sid) {
                continue;
            }
            if let Some(row) = snaps.get(&sid)? {
                todo.extend(row.parent.clone());
                rows.insert(sid, row);
            }
        }
        let mut rows: Vec<SnapshotRow> = rows.into_values().collect();
        rows.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        let with_children = rows.into_iter().map(|r| Ok((snaps.children(&r.id)?, r))).collect::<Result<Vec<_>>>()?;
        drop(snaps);
        Ok(SnapshotList { snapshots: with_children.into_iter().map(|(c, r)| self.snapshot_info(&r, c)).collect() })
    }

    pub fn snapshot(&self, sid: &str) -> Result<SnapshotInfo> {
        let row = self.snapshot_row(sid)?;
        let children = self.snapshots.records().children(sid)?;
        Ok(self.snapshot_info(&row, children))
    }

    pub async fn delete_snapshot(self: &Arc<Self>, sid: &str, subtree: bool) -> Result<()> {
        self.snapshot_row(sid)?;
        let all = self.snapshots.records().all()?;
        let ids = if subtree { store::subtree(&all, sid) } else { BTreeSet::from([sid.to_string()]) };
        self.delete_snapshots(&ids, &all).await.map(drop)
    }

    pub async fn gc(self: &Arc<Self>, req: GcRequest) -> Result<GcResult> {
        let all = self.snapshots.records().all()?;
        let keep: BTreeSet<String> = req.keep.iter().cloned().collect();
        for k in &keep {
            if !all.iter().any(|s| &s.id == k) {
                return Err(RuntimeError::NotFound {
                    kind: "snapshot",
                    id: k.clone(),
                    hint: ": keep only existing snapshots",
                });
            }
        }
        let scope: BTreeSet<String> = match &req.sandbox {
            Some(id) => all.iter().filter(|s| &s.sandbox_id == id).map(|s| s.id.clone()).collect(),
            None => all.iter().map(|s| s.id.clone()).collect(),
        };
        let ids = store::unreachable(&all, &scope, &keep);
        let freed = self.delete_snapshots(&ids, &all).await?;
        Ok(GcResult { deleted: ids.into_iter().collect(), freed_bytes: freed })
    }

    /// Delete snapshot records, the templates only they used, and the layers nothing needs any more.
    async fn delete_snapshots(self: &Arc<Self>, ids: &BTreeSet<String>, all: &[SnapshotRow]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let used_elsewhere: HashSet<&str> = all
            .iter()
            .filter(|s| !ids.contains(&s.id))
            .flat_map(|s| s.sessions.iter().filter_map(|ss| ss.template.as_deref()))
            .collect();
        let dead_templates: BTreeSet<String> = all
            .iter()
            .filter(|s| ids.contains(&s.id))
            .flat_map(|s| s.sessions.iter().filter_map(|ss| ss.template.clone()))
            .filter(|k| !used_elsewhere.contains(k.as_str()))
            .collect();
        self.snapshots.records().delete(ids)?;
        // The volume snapshots those checkpoints took go with them.
        self.forget_checkpoint_volumes(ids)?;
        for sb in self.sandboxes.all().iter() {
            let mut g = sb.gen.lock();
            if let Some(gen) = g.as_mut().filter(|g| g.base.as_ref().is_some_and(|b| ids.contains(b))) {
                gen.base = None;
                let _ = self.snapshots.records().set_generation(&sb.id, gen);
            }
        }
        let gone = self.session_templates.remove(&dead_templates);
        self.drop_templates(gone).await;
        let rt = self.clone();
        tokio::task::spawn_blocking(move || Ok(rt.gc_layers(LAYER_GC_MIN_AGE)? + rt.collect_images()?))
            .await
            .map_err(RuntimeError::Worker)?
    }
}
