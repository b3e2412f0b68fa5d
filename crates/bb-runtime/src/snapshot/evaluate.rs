//! Evaluate: run a command against a sandbox's current files in a throw-away sandbox, leaving
//! the sandbox itself (files, sessions, processes) exactly as it was. A files-only checkpoint
//! (deleted again if it was made for this) gives the chain the throw-away sandbox stands on.

use crate::error::{Result, RuntimeError};
use crate::model::*;
use crate::Runtime;
use std::collections::BTreeSet;
use std::sync::Arc;

impl Runtime {
    /// Run a command against the sandbox's current state in a throw-away fork: the sandbox
    /// itself (files, sessions, processes) is left exactly as it was.
    pub async fn evaluate(self: &Arc<Self>, id: &str, req: RunCommand) -> Result<CommandResult> {
        if req.background {
            return Err(RuntimeError::BadRequest("evaluate runs in the foreground: drop \"background\"".into()));
        }
        let sb = self.live(id)?;
        crate::sandbox::exec::resolve(&sb, &req)?;
        self.check_capacity(1)?;
        let (snap, created) = {
            let _op = sb.begin_op().await;
            self.checkpoint_locked(&sb, Some("evaluate".into()), false, false).await?
        };
        let child = self.create_from(snap.spec.clone(), snap.layers.clone(), None, Some(600.0), None).await;
        if created {
            let _ = self.snapshots.records().delete(&BTreeSet::from([snap.id.clone()]));
        }
        let child = child?;
        let res = crate::sandbox::exec::run(&child, &req, None).await;
        let _ = self.kill(&child.id).await;
        res
    }
}
