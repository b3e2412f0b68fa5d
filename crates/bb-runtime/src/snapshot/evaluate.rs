//! Evaluate: run a command against a sandbox's current files in a throw-away sandbox, leaving
//! the sandbox itself (files, sessions, processes) exactly as it was. A files-only checkpoint
//! (deleted again if it was made for this) gives the chain the throw-away sandbox stands on;
//! volumes that branch with the sandbox are mounted in it as copy-on-write forks, deleted after.

use super::checkpoint::Purpose;
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
            self.checkpoint_locked(&sb, Some("evaluate".into()), Purpose::Evaluate, Processes::Sessions).await?
        };
        let child = self.create_from(snap.spec.clone(), snap.layers.clone(), None, Some(600.0), None).await;
        // The volumes that branch with the sandbox, as copy-on-write forks (deleted after).
        let child = match child {
            Ok(c) => match self.fork_volumes_into(&snap.id, std::slice::from_ref(&c)).await {
                Ok(()) => Ok(c),
                Err(e) => {
                    let _ = self.kill(&c.id).await;
                    Err(e)
                }
            },
            Err(e) => Err(e),
        };
        if created {
            let ids = BTreeSet::from([snap.id.clone()]);
            let _ = self.snapshots.records().delete(&ids);
            let _ = self.forget_checkpoint_volumes(&ids);
        }
        let child = child?;
        let res = crate::sandbox::exec::run(&child, &req, None).await;
        let forks: Vec<String> = child.volumes.lock().iter().map(|m| m.volume.clone()).collect();
        let _ = self.kill(&child.id).await;
        for v in forks {
            let _ = self.delete_volume(&v).await;
        }
        res
    }
}
