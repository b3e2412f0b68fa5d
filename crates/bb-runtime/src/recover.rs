//! Crash recovery: what a daemon does with the state a previous daemon left.
//!
//! Every sandbox whose init still runs (same pid and start time) and answers on its socket is
//! re-attached, with its live sessions and session templates (their channels are kept by init),
//! and a pause or resume it was in is finished ([`crate::pause`]).
//! Everything else is reaped: sandboxes that did not survive, husks nothing is nested in,
//! directories, cgroups and mounts with no record, generations of gone sandboxes, and layers
//! nothing uses.

use crate::error::Result;
use crate::sandbox::launch::{self, SandboxDirs};
use crate::sandbox::Sandbox;
use crate::session;
use crate::Runtime;
use bb_isolation::Cgroup;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

impl Runtime {
    /// Re-attach to sandboxes whose init still answers; reap everything else the state dir,
    /// the cgroup tree or the mount table still holds.
    pub fn recover(self: &Arc<Self>) -> Result<()> {
        let rows = self.sandboxes.records().all()?;
        let mut kept = std::collections::HashSet::new();
        for row in rows {
            let dirs = SandboxDirs::new(&self.cfg.state_dir, &row.id);
            let started = bb_sys::process::process_start_time(row.init_pid) == Some(row.init_start);
            if started {
                // A daemon killed inside a frozen window (a checkpoint's root swap, a pause's
                // dumps) left the cgroup frozen, init too: nothing else thaws it.
                if let Ok(cg) = Cgroup::open(&self.cgroups, &row.id) {
                    let _ = cg.thaw();
                }
            }
            let alive = started && ping_blocking(&dirs.sock());
            let cgroup = if alive { Cgroup::open(&self.cgroups, &row.id).ok() } else { None };
            match cgroup {
                Some(cgroup) => {
                    tracing::info!(id = %row.id, "re-attached to sandbox");
                    let gen = self.snapshots.records().generation(&row.id)?;
                    let mut sb = Sandbox::new(
                        row.id.clone(),
                        row.spec,
                        dirs,
                        row.init_pid,
                        row.init_start,
                        row.created_at,
                        row.expires_at,
                        cgroup,
                        gen,
                    );
                    sb.nest_parent = row.nest_parent;
                    let sb = Arc::new(sb);
                    if tokio::runtime::Handle::try_current().is_ok() {
                        self.watch_init(&sb);
                        for (key, t) in reattach_sessions(&sb) {
                            let _ = self.session_templates.insert(key, sb.id.clone(), Arc::new(t));
                        }
                    }
                    let paused = self.sandboxes.records().paused(&row.id);
                    match paused {
                        Ok(Some(paused)) => self.recover_pause(&sb, paused),
                        Ok(None) => {}
                        Err(e) => tracing::warn!(id = %row.id, "unreadable pause record: {e}"),
                    }
                    kept.insert(row.id.clone());
                    self.sandboxes.insert(sb);
                }
                None => {
                    tracing::warn!(id = %row.id, "sandbox did not survive; reaping it");
                    launch::teardown(&self.cfg, &self.cgroups, &row.id, Some((row.init_pid, row.init_start)))?;
                    self.sandboxes.records().delete(&row.id)?;
                }
            }
        }
        // Networks: the rules of the wired sandboxes again (the table is made afresh).
        let live: std::collections::HashMap<String, Arc<crate::sandbox::Sandbox>> =
            self.sandboxes.all().into_iter().map(|s| (s.id.clone(), s)).collect();
        let mut recorded: std::collections::HashMap<String, crate::net::NetState> =
            self.net.recover(&live).into_iter().collect();
        for sb in live.values() {
            self.net_recover(sb, recorded.remove(&sb.id));
        }
        if let Err(e) = self.recover_volume_fs() {
            tracing::error!("the volumes' filesystem is not available (volumes cannot be used until it is): {e}");
        }
        self.recover_volumes()?;
        // Husks: kept while a live sandbox is nested in them (directly or through other husks).
        let husk_rows = self.sandboxes.records().husks()?;
        for h in husk_rows {
            if bb_sys::process::process_start_time(h.init_pid) == Some(h.init_start) {
                kept.insert(h.id.clone());
                self.sandboxes.insert_husk(h);
            } else {
                self.sandboxes.records().delete_husk(&h.id)?;
            }
        }
        for gone in self.collect_husks() {
            kept.remove(&gone);
        }
        // Strays: directories, mounts and cgroups with no record (a crash mid-create or mid-kill).
        if let Ok(rd) = std::fs::read_dir(self.cfg.state_dir.join("sandboxes")) {
            for e in rd.flatten() {
                let id = e.file_name().to_string_lossy().into_owned();
                if !kept.contains(&id) {
                    tracing::warn!(%id, "removing stray sandbox directory");
                    launch::teardown(&self.cfg, &self.cgroups, &id, None)?;
                }
            }
        }
        for name in self.cgroups.list()? {
            if !kept.contains(&name) {
                tracing::warn!(%name, "removing stray cgroup");
                if let Ok(cg) = Cgroup::open(&self.cgroups, &name) {
                    cg.destroy()?;
                }
            }
        }
        // Generations of sandboxes that are gone, then layers nothing uses any more.
        let gens = self.snapshots.records().generations()?;
        for (id, g) in gens {
            if !kept.contains(&id) {
                self.snapshots.records().delete_generation(&id)?;
                self.remove_layer_dir(&g.upper);
            }
        }
        // Nothing is being set up before the runtime serves: every unrecorded layer is garbage.
        if let Err(e) = self.collect_images() {
            tracing::warn!("process image clean-up at start failed: {e}");
        }
        if let Err(e) = self.gc_layers(Duration::ZERO) {
            tracing::warn!("layer clean-up at start failed: {e}");
        }
        crate::statedir::empty_trash(&self.cfg.state_dir);
        Ok(())
    }
}

/// One blocking request to an init control socket, answered within 2 s (used during recovery,
/// before the runtime serves).
fn call_blocking(sock: &Path, req: &bb_proto::Request) -> Option<(bb_proto::Response, Vec<std::os::fd::OwnedFd>)> {
    crate::initconn::call_blocking(sock, req, &[], Duration::from_secs(2)).ok()
}

fn ping_blocking(sock: &Path) -> bool {
    matches!(call_blocking(sock, &bb_proto::Request::Ping), Some((bb_proto::Response::Pong { .. }, _)))
}

/// Take back the channels of a re-attached sandbox's live sessions from its init; returns the
/// sandbox's live templates (forked session copies kept for snapshots) by key.
fn reattach_sessions(sb: &Sandbox) -> Vec<(String, session::Session)> {
    let mut templates = Vec::new();
    let Some((bb_proto::Response::Procs { procs }, _)) = call_blocking(&sb.dirs.sock(), &bb_proto::Request::List)
    else {
        return templates;
    };
    for p in procs.into_iter().filter(|p| p.exit.is_none()) {
        let template = p.tag.strip_prefix(crate::session_templates::TEMPLATE_TAG).and_then(|rest| rest.split_once(':'));
        let (key, kind, default) = match (template, session::parse_session_tag(&p.tag)) {
            (Some((key, kind)), _) => (key.to_string(), kind.to_string(), false),
            (None, Some(parsed)) => parsed,
            (None, None) => continue,
        };
        let fetched = call_blocking(&sb.dirs.sock(), &bb_proto::Request::Fetch { key: key.clone() });
        let Some((bb_proto::Response::Ok, mut fds)) = fetched else { continue };
        let Some(fd) = fds.pop() else { continue };
        let chan = std::os::unix::net::UnixStream::from(fd);
        match session::Session::attach(key.clone(), kind, p.pid, p.started_at, chan) {
            Ok(s) if template.is_some() => templates.push((key, s)),
            Ok(s) => {
                if let (Ok(mut sessions), Ok(mut dflt)) = (sb.sessions.try_lock(), sb.default_session.try_lock()) {
                    sessions.insert(key.clone(), Arc::new(s));
                    if default {
                        *dflt = Some(key);
                    }
                }
            }
            Err(e) => tracing::warn!(sandbox = %sb.id, session = %key, "cannot re-attach session: {e}"),
        }
    }
    templates
}
