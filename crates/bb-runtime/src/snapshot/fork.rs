//! Fork: `n` new sandboxes from a snapshot (taken on the spot when none is named).
//!
//! *Live* fork, when every session of the snapshot has a live template: the children are
//! nested in the templates' sandbox (its user and pid namespaces), pre-built shells claimed
//! from [`crate::fork_shells`] or started by the parent's init, and each template is forked
//! into them from outside ([`crate::session::fork`]), pipelined: a child's copies start as soon
//! as the child exists. *Cold* fork otherwise (or `isolated`): independent sandboxes on the
//! snapshot's chain whose sessions start fresh. All or none: a failed child kills the others.

use super::ms;
use crate::error::{Result, RuntimeError};
use crate::hugepages::COLLAPSE_MIN_FORK;
use crate::model::*;
use crate::sandbox::Sandbox;
use crate::session::fork as sessionfork;
use crate::session::{self, Session};
use crate::snapshot::store::{SnapSession, SnapshotRow};
use crate::Runtime;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Most children one fork request may ask for.
pub const MAX_FORK: u32 = 64;

/// Deepest chain of nested forks (the kernel allows 32 levels of user and of pid namespaces).
/// Beyond it, children are independent sandboxes whose sessions start fresh.
pub const MAX_NEST_DEPTH: usize = 24;

/// Each session of a snapshot with its live template.
type LiveTemplates = Vec<(SnapSession, Arc<Session>)>;

/// A fork child being made (a claimed shell or a fresh nested sandbox), with its index.
type MakingChild<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = (usize, Result<Arc<Sandbox>>)> + Send + 'a>>;

impl Runtime {
    pub async fn fork(self: &Arc<Self>, id: &str, req: ForkRequest) -> Result<ForkResult> {
        let t0 = Instant::now();
        let _busy = self.activity.busy();
        let n = req.count.unwrap_or(1);
        if !(1..=MAX_FORK).contains(&n) {
            return Err(RuntimeError::BadRequest(format!("count must be in [1, {MAX_FORK}]; got {n}")));
        }
        let timeout = match req.timeout {
            None => Some(300.0),
            Some(t) if t >= 0.0 && t.is_finite() => (t > 0.0).then_some(t),
            Some(_) => return Err(RuntimeError::BadRequest("timeout must be >= 0 seconds (0 = no limit)".into())),
        };
        self.check_capacity(n as usize)?;
        /// What the children are forked from.
        enum Source {
            Named(Box<SnapshotRow>),
            /// A checkpoint of the live parent, taken once the request is checked.
            Live(Arc<Sandbox>),
        }
        let source = match &req.snapshot {
            Some(sid) => {
                let snap = self.snapshot_row(sid)?;
                self.get(id)?; // the sandbox must exist even when forking a named snapshot
                Source::Named(Box::new(snap))
            }
            None => Source::Live(self.live(id)?),
        };
        // The children's network: the snapshot's, or the parent's now (a checkpoint that changed
        // nothing is the previous one, recorded before a later policy change); then the fork's
        // own. Checked before a checkpoint is taken for it.
        let (mut network, mut allow, proxied) = match &source {
            Source::Named(snap) => (snap.spec.network.clone(), snap.spec.allow.clone(), snap.spec.proxy_port.is_some()),
            Source::Live(sb) => {
                let now = self.spec_now(sb);
                (now.network, now.allow, now.proxy_port.is_some())
            }
        };
        if let Some(mode) = req.network {
            if req.allow.is_none() && mode == "none" && !proxied {
                allow.clear();
            }
            network = mode;
        }
        if let Some(a) = req.allow {
            allow = a;
        }
        crate::net::policy::Policy::parse_for(&network, &allow, proxied).map_err(crate::net::NetError::from)?;
        if req.replay_inflight && matches!(source, Source::Named(_)) {
            return Err(RuntimeError::BadRequest(
                "replay_inflight hands on the requests in flight at a checkpoint the fork takes now: leave snapshot out"
                    .into(),
            ));
        }
        if req.processes != Processes::Sessions && matches!(source, Source::Named(_)) {
            return Err(RuntimeError::BadRequest(
                "processes is for a checkpoint the fork takes now (a named snapshot gives the children the processes \
                 it kept): leave snapshot or processes out"
                    .into(),
            ));
        }
        self.check_trees_keepable(req.processes)?;
        if req.replay_inflight && !proxied {
            return Err(RuntimeError::BadRequest(
                "replay_inflight replays the proxy's answers: the sandbox has no proxy (create it with proxy=True)"
                    .into(),
            ));
        }
        let inflight = &self.net.proxy.inflight;
        let (snap, handed) = match source {
            Source::Named(snap) => (*snap, None),
            Source::Live(sb) => {
                let _op = sb.begin_op().await;
                let holding = req.replay_inflight.then(|| inflight.hold(&sb.id));
                let taken = self
                    .checkpoint_locked(&sb, Some("fork".into()), super::checkpoint::Purpose::Keep, req.processes)
                    .await;
                // The children adopt the parent's requests in flight until `handed` drops.
                let handed = holding.map(|h| h.hand_down(taken.as_ref().ok().map(|t| t.0.id.as_str())));
                (taken?.0, handed)
            }
        };
        let spec = SandboxSpec { network, allow, ..snap.spec.clone() };
        let not_restored = TreesNotRestored::default();
        let (children, restart_reason) = if req.isolated {
            let why = (!snap.sessions.is_empty()).then(|| "isolated children start fresh sessions".to_string());
            (self.fork_cold(&snap, &spec, n, timeout, &not_restored).await?, why)
        } else {
            self.fork_snapshot(&snap, &spec, n, timeout, &not_restored).await?
        };
        // Each child gets copy-on-write forks of the volumes that branched with the snapshot.
        if let Err(e) = self.fork_volumes_into(&snap.id, &children).await {
            for c in &children {
                let _ = self.kill_unchecked(&c.id).await;
            }
            return Err(e);
        }
        Ok(ForkResult {
            snapshot: snap.id,
            sandboxes: children.iter().map(|c| c.info()).collect(),
            sessions_restarted: restart_reason.is_some(),
            restart_reason,
            inflight_handed: handed.map_or(0, |h| h.count as u32),
            processes_not_restored: not_restored.take(),
            took_ms: ms(t0),
        })
    }

    /// Start `n` sandboxes on `snap`'s layers with its sessions, all or none. Returns them and,
    /// when their sessions were started fresh (`sessions_restarted`), why.
    ///
    /// When every session of the snapshot has a live template, the children are nested in the
    /// templates' sandbox and get live copies of the sessions ([`Runtime::fork_nested`]);
    /// otherwise (or if that fails) they are independent sandboxes with fresh sessions.
    /// `spec`: what the children are created with (usually the snapshot's). The snapshot's
    /// background processes are restored into each child first ([`Runtime::restore_background_trees`]);
    /// those that are not come in `not_restored`.
    pub(crate) async fn fork_snapshot(
        self: &Arc<Self>,
        snap: &SnapshotRow,
        spec: &SandboxSpec,
        n: u32,
        timeout: Option<f64>,
        not_restored: &TreesNotRestored,
    ) -> Result<(Vec<Arc<Sandbox>>, Option<String>)> {
        if snap.sessions.is_empty() {
            return Ok((self.fork_cold(snap, spec, n, timeout, not_restored).await?, None));
        }
        let why = match self.live_templates(snap).await {
            Ok((parent, templates)) => {
                match self.fork_nested((&parent, templates), snap, spec, n, timeout, not_restored).await {
                    Ok(children) => return Ok((children, None)),
                    Err(e) => {
                        tracing::warn!(snapshot = %snap.id, "live fork failed, forking with fresh sessions: {e}");
                        format!("the live fork failed: {e}")
                    }
                }
            }
            Err(why) => why,
        };
        // What the live attempt's children (killed) did not get does not count.
        not_restored.take();
        let children = self.fork_cold(snap, spec, n, timeout, not_restored).await?;
        Ok((children, Some(why)))
    }

    /// The snapshot's sandbox and a live template for each of its sessions (restored from their
    /// process images where they left memory), if nesting is possible (architecture, depth).
    /// Err: why not (the children then start fresh sessions).
    async fn live_templates(self: &Arc<Self>, snap: &SnapshotRow) -> Result<(Arc<Sandbox>, LiveTemplates), String> {
        if !bb_sys::ptrace::SUPPORTED {
            return Err("live forks are not supported on this architecture".into());
        }
        let parent = self
            .get(&snap.sandbox_id)
            .ok()
            .filter(|p| !p.is_dead())
            .ok_or_else(|| "the snapshot's sandbox is gone (its sessions are forked from there)".to_string())?;
        if self.nest_depth(&parent) + 1 > MAX_NEST_DEPTH {
            tracing::info!(sandbox = %parent.id, "fork chain is {MAX_NEST_DEPTH} deep: children start fresh sessions");
            return Err(format!("the fork chain is {MAX_NEST_DEPTH} deep"));
        }
        let alive = |ss: &SnapSession| ss.template.as_deref().is_some_and(|k| self.session_templates.contains(k));
        // A template restored into the parent is not yet in the pool: no rollback of the parent
        // may sweep it away meanwhile.
        let holder = parent.clone();
        let _op = if snap.sessions.iter().all(alive) { None } else { Some(holder.begin_op().await) };
        let mut templates = Vec::new();
        for ss in &snap.sessions {
            let (t, _) = self
                .ensure_template(&parent, snap, ss, false)
                .await
                .map_err(|why| format!("session {}: {why}", ss.id))?;
            templates.push((ss.clone(), t));
        }
        Ok((parent, templates))
    }

    /// How many sandboxes `sb` is nested in (0 for a sandbox the daemon started itself).
    fn nest_depth(&self, sb: &Sandbox) -> usize {
        let mut depth = 0;
        let mut cur = sb.nest_parent.clone();
        while let Some(id) = cur {
            depth += 1;
            cur = match self.get(&id) {
                Ok(p) => p.nest_parent.clone(),
                Err(_) => self.sandboxes.husk(&id).and_then(|h| h.nest_parent.clone()),
            };
        }
        depth
    }

    /// Fork with live sessions: `n` sandboxes nested in `parent` (pre-built shells claimed, the
    /// rest started by the parent's init), each template forked into them from outside
    /// ([`crate::session::fork`]), each copy registered with its child's init and finished as a
    /// live session. Pipelined: a child's copies start as soon as the child exists, and each
    /// copy is attached as soon as it runs.
    async fn fork_nested(
        self: &Arc<Self>,
        (parent, templates): (&Arc<Sandbox>, LiveTemplates),
        snap: &SnapshotRow,
        spec: &SandboxSpec,
        n: u32,
        timeout: Option<f64>,
        not_restored: &TreesNotRestored,
    ) -> Result<Vec<Arc<Sandbox>>> {
        use futures::stream::{FuturesUnordered, StreamExt};
        let t0 = Instant::now();
        let n = n as usize;
        // The session copies are moved into the children's cgroups: get the kernel's migration
        // lock ready while the shells are claimed.
        {
            let (cg, init) = (parent.cgroup.clone(), parent.init_pid);
            tokio::task::spawn_blocking(move || {
                if let Err(e) = cg.warm_migrations(init) {
                    tracing::debug!("cgroup migration warm-up: {e}");
                }
            });
        }
        // Host pids of the templates (they live in the parent's cgroup).
        let hosts: HashMap<i32, i32> = parent
            .cgroup
            .pids()?
            .into_iter()
            .filter_map(|h| Some((*bb_sys::process::ns_pids(h)?.last()?, h)))
            .collect();
        let hosts = templates
            .iter()
            .map(|(ss, t)| {
                hosts
                    .get(&t.pid)
                    .copied()
                    .ok_or_else(|| RuntimeError::Conflict(format!("template of session {} is gone", ss.id)))
            })
            .collect::<Result<Vec<i32>>>()?;
        // No request may reach a template while it is driven from outside.
        let mut exclusive = Vec::new();
        for (_, t) in &templates {
            exclusive.push(t.exclusive().await);
        }
        // One forking job per template, fed the children as they come.
        let (res_tx, mut res_rx) =
            tokio::sync::mpsc::unbounded_channel::<(usize, usize, Result<sessionfork::SessionCopy>)>();
        let mut feeds = Vec::new();
        let mut jobs = Vec::new();
        for (ti, host) in hosts.iter().copied().enumerate() {
            let (tx, rx) = std::sync::mpsc::channel::<sessionfork::Target>();
            feeds.push(tx);
            let (res_tx, key) = (res_tx.clone(), self.cfg.setns_key);
            jobs.push(tokio::task::spawn_blocking(move || {
                let out = |ci: usize, r: Result<sessionfork::SessionCopy>| {
                    let _ = res_tx.send((ti, ci, r));
                };
                sessionfork::fork_stream(host, n, rx, key, &out)
            }));
        }
        drop(res_tx);
        // Children: claimed shells first, then fresh ones.
        let shells = self.fork_shells.state.lock().take(&parent.id, n);
        let claimed = shells.len();
        let mut making: FuturesUnordered<MakingChild<'_>> = FuturesUnordered::new();
        // Each child gets the snapshot's background processes before its session copies (so
        // their pids are still free).
        for (i, shell) in shells.into_iter().enumerate() {
            let (rt, parent, snap_row, spec) = (self.clone(), parent.clone(), snap.clone(), spec.clone());
            making.push(Box::pin(async move {
                let r = tokio::task::spawn_blocking(move || rt.claim_shell(shell, &parent, &snap_row, &spec, timeout))
                    .await
                    .map_err(RuntimeError::Worker)
                    .and_then(|r| r);
                if let Ok(child) = &r {
                    self.restore_trees_into(child, snap, not_restored).await;
                }
                (i, r)
            }));
        }
        for i in claimed..n {
            let fut = self.create_from(
                spec.clone(),
                snap.layers.clone(),
                Some(snap.id.clone()),
                timeout,
                Some(parent.clone()),
            );
            making.push(Box::pin(async move {
                let r = fut.await;
                if let Ok(child) = &r {
                    self.restore_trees_into(child, snap, not_restored).await;
                }
                (i, r)
            }));
        }
        let mut children: Vec<Option<Arc<Sandbox>>> = vec![None; n];
        let mut first_err: Option<RuntimeError> = None;
        let mut attaching = FuturesUnordered::new();
        let mut copies_left = n * templates.len();
        let mut t_shells = None;
        loop {
            tokio::select! {
                Some((i, r)) = making.next(), if !making.is_empty() => {
                    match r {
                        Ok(child) => {
                            if i < claimed {
                                // A claimed shell (create_from watches the ones it starts).
                                self.watch_init(&child);
                            }
                            for feed in &feeds {
                                let _ = feed.send(sessionfork::Target { index: i, init_pid: child.init_pid, cgroup: child.cgroup.clone() });
                            }
                            children[i] = Some(child);
                        }
                        Err(e) => {
                            first_err.get_or_insert(e);
                            copies_left -= templates.len();
                        }
                    }
                    if making.is_empty() {
                        feeds.clear(); // the forking jobs end once their queue is drained
                        t_shells = Some(t0.elapsed());
                    }
                }
                Some((ti, ci, r)) = res_rx.recv(), if copies_left > 0 => {
                    copies_left -= 1;
                    match (r, children[ci].clone()) {
                        (Ok(copy), Some(child)) => {
                            let ss = templates[ti].0.clone();
                            attaching.push(async move { self.attach_copy(&child, &ss, copy).await });
                        }
                        (Err(e), _) => {
                            first_err.get_or_insert(e);
                        }
                        (Ok(copy), None) => {
                            // A copy whose child is gone.
                            let _ = bb_sys::process::kill(copy.host_pid, libc::SIGKILL);
                        }
                    }
                }
                Some(r) = attaching.next(), if !attaching.is_empty() => {
                    if let Err(e) = r {
                        first_err.get_or_insert(e);
                    }
                }
                else => break,
            }
        }
        for j in jobs {
            match j.await.map_err(RuntimeError::Worker).and_then(|r| r) {
                Ok(()) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        drop(exclusive);
        let children: Vec<Arc<Sandbox>> = children.into_iter().flatten().collect();
        for c in &children {
            c.dirty.store(false, Ordering::SeqCst);
        }
        tracing::debug!(children = n, claimed, ?t_shells, total = ?t0.elapsed(), "live fork");
        if let Some(e) = first_err {
            for c in children {
                let _ = self.kill(&c.id).await;
            }
            return Err(e);
        }
        if children.len() != n {
            let made = children.len();
            for c in children {
                let _ = self.kill(&c.id).await;
            }
            return Err(super::SnapshotError::ChildrenMissing { made, wanted: n }.into());
        }
        // The next fork from this parent finds its shells ready.
        let want = self.fork_shells.targets.lock().get(&parent.id).copied().unwrap_or(0).max(n);
        self.refill_shells(parent.clone(), want);
        if n >= COLLAPSE_MIN_FORK {
            for ((_, t), host) in templates.iter().zip(&hosts) {
                self.collapse_template(&t.id, *host);
            }
        }
        Ok(children)
    }

    /// Make a session copy forked into `child` one of its live sessions: registered with the
    /// child's init (listed, channel stashed) and added under the snapshot session's id; it is
    /// finished in place (`{"op":"restored"}`) before its first request
    /// ([`Session::finish_later`]).
    async fn attach_copy(&self, child: &Arc<Sandbox>, ss: &SnapSession, copy: sessionfork::SessionCopy) -> Result<()> {
        let kill_copy = || {
            // The copy we just made (it is in the child's cgroup).
            let _ = bb_sys::process::kill(copy.host_pid, libc::SIGKILL);
        };
        let Some(ns_pid) = bb_sys::process::ns_pids(copy.host_pid).and_then(|v| v.last().copied()) else {
            return Err(super::SnapshotError::CopyExited { session: ss.id.clone() }.into());
        };
        let keep = copy.chan.try_clone().map_err(RuntimeError::io("socket"))?;
        if let Err(e) = crate::sandbox::sessions::adopt(
            child,
            ns_pid,
            session::session_tag(&ss.id, &ss.kind, ss.default),
            ss.id.clone(),
            &keep,
        )
        .await
        {
            kill_copy();
            return Err(e);
        }
        let runner = copy.runner;
        let s = Session::attach(ss.id.clone(), ss.kind.clone(), ns_pid, ss.copy_created_at(), copy.chan)?;
        let log = child.open_log(&format!("{}.log", ss.id), true)?;
        s.finish_later(log, runner);
        child.sessions.lock().await.insert(ss.id.clone(), Arc::new(s));
        if ss.default {
            *child.default_session.lock().await = Some(ss.id.clone());
        }
        Ok(())
    }

    /// Keep all sandboxes if every launch succeeded; otherwise kill those that did and return
    /// the first error.
    async fn all_or_none(self: &Arc<Self>, results: Vec<Result<Arc<Sandbox>>>) -> Result<Vec<Arc<Sandbox>>> {
        let mut ok = Vec::new();
        let mut first_err = None;
        for r in results {
            match r {
                Ok(c) => ok.push(c),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            for c in ok {
                let _ = self.kill(&c.id).await;
            }
            return Err(e);
        }
        Ok(ok)
    }

    /// Start `n` independent sandboxes on `snap`'s layers with its sessions started fresh.
    async fn fork_cold(
        self: &Arc<Self>,
        snap: &SnapshotRow,
        spec: &SandboxSpec,
        n: u32,
        timeout: Option<f64>,
        not_restored: &TreesNotRestored,
    ) -> Result<Vec<Arc<Sandbox>>> {
        let jobs = (0..n).map(|_| {
            let rt = self.clone();
            let (snap, spec) = (snap.clone(), spec.clone());
            async move {
                let child = rt.create_from(spec, snap.layers.clone(), Some(snap.id.clone()), timeout, None).await?;
                rt.restore_trees_into(&child, &snap, not_restored).await;
                let res: Result<()> = async {
                    let mut map = child.sessions.lock().await;
                    for ss in &snap.sessions {
                        let s = crate::sandbox::sessions::create_as(
                            &child,
                            Some(ss.id.clone()),
                            &ss.kind,
                            ss.default,
                            None,
                            &Default::default(),
                        )
                        .await?;
                        if ss.default {
                            *child.default_session.lock().await = Some(ss.id.clone());
                        }
                        map.insert(ss.id.clone(), Arc::new(s));
                    }
                    Ok(())
                }
                .await;
                // Fresh sessions are not the snapshot's: a checkpoint of the child must not reuse it.
                child.dirty.store(!snap.sessions.is_empty(), Ordering::SeqCst);
                match res {
                    Ok(()) => Ok(child),
                    Err(e) => {
                        let _ = rt.kill(&child.id).await;
                        Err(e)
                    }
                }
            }
        });
        self.all_or_none(futures::future::join_all(jobs).await).await
    }
}

/// Why background processes of a snapshot did not come back in fork children, each naming the
/// child (collected as the children are made).
#[derive(Default)]
pub(crate) struct TreesNotRestored(parking_lot::Mutex<Vec<String>>);

impl TreesNotRestored {
    pub(crate) fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.0.lock())
    }
}

impl Runtime {
    /// Restore `snap`'s background process trees into `child`, a new sandbox on its layers in
    /// which nothing of its own runs yet (their pids are free). Those that do not come back are
    /// added to `not_restored`; the child runs on without them.
    async fn restore_trees_into(
        self: &Arc<Self>,
        child: &Arc<Sandbox>,
        snap: &SnapshotRow,
        not_restored: &TreesNotRestored,
    ) {
        if snap.processes.is_empty() {
            return;
        }
        // Every child restores them in full: a lazy restore serves one at a time.
        let (_, failed) = self.restore_background_trees(child, &snap.processes, true).await;
        if !failed.is_empty() {
            not_restored.0.lock().extend(failed.into_iter().map(|why| format!("sandbox {}: {why}", child.id)));
        }
    }
}

impl Runtime {
    /// `Sandbox.create(snapshot=...)`: a new sandbox with the snapshot's files and sessions. A
    /// snapshot this daemon lacks is pulled from the metadata and object stores first
    /// ([`crate::remote`]).
    ///
    /// When the snapshot's sandbox runs here, this is a fork of one child (live session copies,
    /// the background processes the snapshot kept). Otherwise (a pulled snapshot, or its sandbox
    /// is gone) the new sandbox *adopts* the snapshot: its background processes and then its
    /// session templates are restored from their process images into it and
    /// the snapshot is recorded as its, so later forks of the snapshot are live copies nested in
    /// it and rollbacks in it restore the sessions; each session is forked from its template.
    /// The snapshot's image, limits and cwd are kept; the request's env is added, its metadata
    /// and timeout apply.
    /// `id`: the sandbox's id (a pushed paused sandbox resumed here keeps its own), else a new one.
    pub(crate) async fn create_from_snapshot(
        self: &Arc<Self>,
        sid: &str,
        req: CreateSandbox,
        id: Option<String>,
    ) -> Result<Arc<Sandbox>> {
        if req.image.is_some()
            || req.cpu.is_some()
            || req.memory_mb.is_some()
            || req.pids.is_some()
            || req.cwd.is_some()
        {
            return Err(RuntimeError::BadRequest(
                "a sandbox created from a snapshot keeps the snapshot's image, cpu, memory_mb, pids and cwd: leave them out"
                    .into(),
            ));
        }
        let timeout = match req.timeout {
            None => Some(300.0),
            Some(t) if t >= 0.0 && t.is_finite() => (t > 0.0).then_some(t),
            Some(_) => return Err(RuntimeError::BadRequest("timeout must be >= 0 seconds (0 = no limit)".into())),
        };
        if self.snapshots.records().get(sid)?.is_none() {
            self.pull_snapshot(sid).await?;
        }
        let _adopting = self.pulls.lock().await;
        let snap = self.snapshot_row(sid)?;
        let mut spec = snap.spec.clone();
        spec.env.extend(req.env);
        if !req.metadata.is_empty() {
            spec.metadata = req.metadata;
        }
        spec.timeout = timeout;
        if let Some(l) = req.lifecycle {
            spec.lifecycle = l;
        }
        // The snapshot's network unless the request gives one.
        if let Some(mode) = req.network {
            spec.network = mode;
            spec.allow = req.allow;
        } else if !req.allow.is_empty() {
            spec.allow = req.allow;
        }
        if let Some(on) = req.proxy {
            spec.proxy_port = on.then_some(self.cfg.proxy_port);
        }
        if let Some(on) = req.proxy_record {
            spec.proxy_record = on;
        }
        crate::net::record::check(spec.proxy_record, spec.proxy_port)?;
        if let Some(l) = req.net_limits {
            spec.net_limits = l;
        }
        if let Some(on) = req.sudo {
            spec.sudo = on;
        }
        Self::spec_policy(&spec)?;
        if id.is_none() && self.get(&snap.sandbox_id).is_ok_and(|p| !p.is_dead()) {
            let not_restored = TreesNotRestored::default();
            let (mut children, why) = self.fork_snapshot(&snap, &spec, 1, timeout, &not_restored).await?;
            if let Some(why) = why {
                tracing::info!(snapshot = %sid, "sandbox created from a snapshot with fresh sessions: {why}");
            }
            for why in not_restored.take() {
                tracing::warn!(snapshot = %sid, "a background process was not restored: {why}");
            }
            return Ok(children.remove(0));
        }
        let child = self.create_from_as(id, spec, snap.layers.clone(), Some(snap.id.clone()), timeout, None).await?;
        let res: Result<()> = async {
            self.snapshots.records().set_sandbox(&snap.id, &child.id)?;
            let snap = SnapshotRow { sandbox_id: child.id.clone(), ..snap.clone() };
            let _op = child.begin_op().await;
            // Before the session copies, which would take the next pids, possibly the trees'.
            let (_, not_restored) = self.restore_background_trees(&child, &snap.processes, false).await;
            for why in not_restored {
                tracing::warn!(snapshot = %sid, sandbox = %child.id, "a background process was not restored: {why}");
            }
            let mut sessions = child.sessions.lock().await;
            let mut restarted = false;
            for ss in &snap.sessions {
                let copy = match self.ensure_template(&child, &snap, ss, false).await {
                    Ok((t, _)) => {
                        t.fork_begin("restore").await.map_err(|e| format!("forking its template failed: {e}"))
                    }
                    Err(why) => Err(why),
                };
                let s = match copy {
                    Ok(p) => {
                        let pid = p.pid;
                        let chan = p.channel();
                        let keep = chan.try_clone().map_err(RuntimeError::io("socket"))?;
                        let s = Session::attach(ss.id.clone(), ss.kind.clone(), pid, ss.copy_created_at(), chan)?;
                        let tag = session::session_tag(&ss.id, &ss.kind, ss.default);
                        crate::sandbox::sessions::adopt(&child, pid, tag, ss.id.clone(), &keep).await?;
                        s
                    }
                    Err(why) => {
                        tracing::info!(snapshot = %sid, session = %ss.id, "session starts fresh: {why}");
                        restarted = true;
                        crate::sandbox::sessions::create_as(
                            &child,
                            Some(ss.id.clone()),
                            &ss.kind,
                            ss.default,
                            None,
                            &Default::default(),
                        )
                        .await?
                    }
                };
                if ss.default {
                    *child.default_session.lock().await = Some(ss.id.clone());
                }
                sessions.insert(ss.id.clone(), Arc::new(s));
            }
            drop(sessions);
            child.dirty.store(restarted, Ordering::SeqCst);
            self.make_spares(&child, snap.sessions.iter().filter_map(|ss| ss.template.clone()).collect());
            Ok(())
        }
        .await;
        if let Err(e) = res {
            let _ = self.kill(&child.id).await;
            return Err(e);
        }
        Ok(child)
    }
}
