//! The registry of sandboxes: the live ones in memory by id, the husks (killed sandboxes whose
//! init stays for the sandboxes nested in it), and their records in the state database
//! ([`SandboxStore`]). The maps are read far more often than written: one lock each, never held
//! across anything slow.

use super::store::{HuskRow, SandboxStore};
use super::Sandbox;
use crate::db::DbResult;
use parking_lot::{Mutex, MutexGuard, RwLock};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

pub struct Sandboxes {
    live: RwLock<HashMap<String, Arc<Sandbox>>>,
    husks: Mutex<HashMap<String, HuskRow>>,
    records: Mutex<SandboxStore>,
}

impl Sandboxes {
    pub fn open(db: &Path) -> DbResult<Sandboxes> {
        Ok(Sandboxes {
            live: Default::default(),
            husks: Default::default(),
            records: Mutex::new(SandboxStore::open(db)?),
        })
    }

    /// The records in the state database.
    pub fn records(&self) -> MutexGuard<'_, SandboxStore> {
        self.records.lock()
    }

    pub fn get(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.live.read().get(id).cloned()
    }

    pub fn count(&self) -> usize {
        self.live.read().len()
    }

    /// Every live sandbox (a copy: the registry is not locked while the caller works).
    pub fn all(&self) -> Vec<Arc<Sandbox>> {
        self.live.read().values().cloned().collect()
    }

    pub fn insert(&self, sb: Arc<Sandbox>) {
        self.live.write().insert(sb.id.clone(), sb);
    }

    pub fn remove(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.live.write().remove(id)
    }

    /// Whether a live sandbox or a husk is nested directly in `id`.
    pub fn has_nested(&self, id: &str) -> bool {
        self.live.read().values().any(|s| s.nest_parent.as_deref() == Some(id))
            || self.husks.lock().values().any(|h| h.nest_parent.as_deref() == Some(id))
    }

    pub fn husk(&self, id: &str) -> Option<HuskRow> {
        self.husks.lock().get(id).cloned()
    }

    pub fn husks(&self) -> Vec<HuskRow> {
        self.husks.lock().values().cloned().collect()
    }

    pub fn insert_husk(&self, row: HuskRow) {
        self.husks.lock().insert(row.id.clone(), row);
    }

    pub fn remove_husk(&self, id: &str) {
        self.husks.lock().remove(id);
    }
}
