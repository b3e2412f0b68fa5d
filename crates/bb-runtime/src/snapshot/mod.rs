//! Snapshots: a sandbox's files and live sessions captured together, and what is done with them.
//!
//! A snapshot is a record ([`store::SnapshotRow`]): the chain of layers the sandbox's root stood
//! on (image layers, then frozen snapshot layers `sl-*`, bottom first), the sandbox's spec, and
//! its sessions, each with the key of its *session template* (a frozen fork of the session
//! process, [`crate::session_templates`]). Snapshots form a tree by `parent`.
//!
//! | verb | file | what it does |
//! |---|---|---|
//! | checkpoint | [`checkpoint`] | each session forks its template; the writable layer is frozen into a snapshot layer and the sandbox moves onto a fresh one ([`swap`]) |
//! | rollback | [`rollback`] | every process but init and the templates is killed, the sandbox moves onto a fresh layer over the snapshot's chain, sessions are forked again from their templates |
//! | fork(n) | [`fork`] | n sandboxes on the snapshot's chain; nested in the parent with live session copies when every template is alive, independent with fresh sessions otherwise |
//! | evaluate | [`evaluate`] | a command run in a throw-away sandbox on the current state |
//! | list, delete, gc | [`tree`] | the snapshot tree and its collection |
//!
//! The root swap that checkpoint and rollback share (prepare the next root, freeze, scan,
//! pivot, thaw) is [`swap`], its in-namespace mechanics [`crate::sandbox::rootswap`]. Records live in SQLite
//! ([`store`]); layer directories in [`crate::layers`]; deep chains are merged by
//! [`crate::compaction`]. Every operation on one sandbox holds its operation lock
//! ([`Sandbox::begin_op`]).
//!
//! Cost: a checkpoint is one fork per session plus a mount and a pivot, independent of how many
//! files the sandbox holds; a rollback the same plus the kill sweep. An evicted template only
//! means the session restarts fresh on rollback (`sessions_restarted`).

mod checkpoint;
mod evaluate;
pub mod fork;
mod rollback;
pub mod store;
pub(crate) mod swap;
mod tree;

use crate::error::{Result, RuntimeError};
use crate::model::*;
use crate::sandbox::Sandbox;
use crate::snapshot::store::{Generation, SnapshotRow};
use crate::Runtime;
use parking_lot::{Mutex, MutexGuard};
use std::time::Instant;

/// The snapshot records (and live sandboxes' generations) in the state database.
pub struct Snapshots {
    records: Mutex<store::SnapStore>,
}

impl Snapshots {
    pub fn open(db: &std::path::Path) -> crate::db::DbResult<Snapshots> {
        Ok(Snapshots { records: Mutex::new(store::SnapStore::open(db)?) })
    }

    pub fn records(&self) -> MutexGuard<'_, store::SnapStore> {
        self.records.lock()
    }
}

/// Failures of the snapshot mechanisms themselves (the caller's mistakes are `BadRequest`,
/// `NotFound` or `Conflict`).
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("the root swap worker ended without an answer")]
    SwapWorkerGone,
    #[error("live fork: {made} of {wanted} children were made")]
    ChildrenMissing { made: usize, wanted: usize },
    #[error("the copy of session {session} exited right away")]
    CopyExited { session: String },
}

pub(crate) fn snapshot_id() -> String {
    format!("sn-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

pub(crate) fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

pub(crate) fn legacy(id: &str) -> RuntimeError {
    RuntimeError::Conflict(format!(
        "sandbox {id} was created by a daemon without snapshot support: create a new sandbox to checkpoint it"
    ))
}

impl Runtime {
    pub(crate) fn snapshot_info(&self, row: &SnapshotRow, children: Vec<String>) -> SnapshotInfo {
        let size =
            row.own_layer.as_ref().and_then(|l| self.snapshots.records().layer_size(l).ok().flatten()).unwrap_or(0);
        SnapshotInfo {
            id: row.id.clone(),
            sandbox_id: row.sandbox_id.clone(),
            parent: row.parent.clone(),
            children,
            created_at: row.created_at,
            label: row.label.clone(),
            size_bytes: size,
            depth: row.layers.iter().filter(|l| l.starts_with("sl-")).count(),
            lightweight: row.own_layer.is_none(),
            sessions: row
                .sessions
                .iter()
                .map(|s| {
                    let template = s.template.as_deref().is_some_and(|k| self.session_templates.contains(k));
                    SnapshotSessionInfo {
                        id: s.id.clone(),
                        kind: s.kind.clone(),
                        default: s.default,
                        template,
                        image: s.image.is_some(),
                        lost: (!template && s.image.is_none()).then(|| s.lost.clone()).flatten(),
                    }
                })
                .collect(),
            processes: row
                .processes
                .iter()
                .map(|p| crate::model::SnapshotProcessInfo { pid: p.pid, cmd: p.tag.clone() })
                .collect(),
            durability: if self.snapshots.records().is_durable(&row.id).unwrap_or(false) {
                "durable".into()
            } else {
                "node-local".into()
            },
            took_ms: None,
        }
    }

    pub(crate) fn snapshot_row(&self, sid: &str) -> Result<SnapshotRow> {
        self.snapshots.records().get(sid)?.ok_or_else(|| RuntimeError::NotFound {
            kind: "snapshot",
            id: sid.into(),
            hint: ": list snapshots with `branchbox snapshot ls`",
        })
    }

    /// Record a new snapshot of `sb` and the generation it goes on with, together.
    pub(crate) fn record_snapshot(&self, sb: &Sandbox, row: &SnapshotRow, g: Generation) -> Result<()> {
        self.snapshots.records().insert_with_generation(row, &sb.id, &g)?;
        *sb.gen.lock() = Some(g);
        self.net.proxy.recorder.mark(&sb.id, &row.id);
        Ok(())
    }

    pub(crate) fn set_gen(&self, sb: &Sandbox, g: Generation) -> Result<()> {
        self.snapshots.records().set_generation(&sb.id, &g)?;
        *sb.gen.lock() = Some(g);
        Ok(())
    }
}
