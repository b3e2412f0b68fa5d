//! Pause and resume: a sandbox's processes dumped to process images and freed, then restored
//! under the same pids, with its files, sessions and env as they were.
//!
//! **Pause.** With the sandbox's operation lock and file gate held: its session templates are
//! evicted (dumped, [`crate::session_templates`]); init is told to hold the exits it sees
//! (`Suspend`: refused while a foreground command runs, not for attached processes); each
//! session's channel moves into its own process (`rechannel`); the pause record is written
//! (`pausing`); the cgroup is frozen and every child of init (each a *tree*: a session, a
//! background command, an attached process, an orphan) is dumped
//! from the frozen cgroup, so the trees are one consistent state; the record is committed
//! (`paused`); every process but init is killed; the cgroup's page cache is reclaimed. What
//! stays: init (which keeps the namespaces, the mounts and the writable layer) and the images.
//! Any failure before the commit calls the pause off: the cgroup is thawed and everything runs
//! on as before.
//!
//! **Files-only pause** (`mode: filesystem`): the same locks, `Suspend` and commit, but nothing is
//! dumped: every process but init is killed and the record keeps no trees. Its resume is a cold
//! boot (as is any resume asked with `reboot`): init takes back no processes, the sessions start
//! afresh on first use, and the sandbox gets a new boot id. No CRIU is needed.
//!
//! **Resume.** Each tree is restored into the sandbox (CRIU joins its namespaces; pids are free
//! since only init runs), an attached process with new pipes or a new terminal in place of the
//! ones whose other ends the daemon holds ([`crate::sandbox::exec::Plugs`]), init takes the
//! processes back (`Resume`), and each session is re-attached through the channel end its
//! process held (`pidfd_getfd`). A tree that cannot be
//! restored kills the ones restored so far: the sandbox stays paused with its images, and the
//! error names the cause.
//!
//! **Crashes** (the daemon killed at any point): at start, a `pausing` record is called off (the
//! processes were never killed), a `paused` one is made whole again (every process but init
//! killed: a resume that was under way starts over). See [`Runtime::recover_pause`].

use crate::error::{Result, RuntimeError};
use crate::initconn::{init_error, unexpected, InitConn};
use crate::model::{PauseMode, PauseResult, ResumeResult, ResumeSandbox};
use crate::sandbox::store::{PauseState, PausedRow, PausedSession, PausedTree};
use crate::sandbox::{PauseStage, Paused, Sandbox};
use crate::session::{session_tag, Session};
use crate::{now, Runtime};
use bb_proto::{Request, Response};
use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Instant;

fn ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1000.0
}

/// Pids (in the sandbox) of the children of its init, and of processes whose parent is outside
/// its pid namespace (session copies forked into a nested sandbox), from its own procfs: the
/// roots of the trees a pause dumps. Read with the cgroup frozen, so the set cannot change.
pub(crate) fn tree_roots(sb: &Sandbox) -> Result<Vec<i32>> {
    let (proc, pids) = crate::sandbox::procs::own_pids(sb, &HashSet::new())
        .map_err(|e| RuntimeError::Conflict(format!("cannot list the processes of sandbox {}: {e}", sb.id)))?;
    let mut roots: Vec<i32> = pids
        .into_iter()
        // Dead ones (a zombie init has not reaped yet, e.g. just killed by a rollback) have
        // nothing to dump.
        .filter(|p| bb_sys::process::live_parent_pid(&proc.join(p.to_string())).is_some_and(|pp| pp <= 1))
        .collect();
    roots.sort_unstable();
    Ok(roots)
}

/// Freeze `sb`'s cgroup for CRIU (`--freeze-cgroup`) at a moment when none of its processes
/// waits in vfork() for its child to exec or exit: CRIU seizes every process of the cgroup and
/// waits for each to stop, and such a parent reports no stop while its seized child cannot run
/// (CRIU then hangs until its own timeout). Such a moment lasts microseconds (a shell's vfork and
/// exec), but on a busy host the child may wait long for a CPU: the group is thawed until every
/// parent seen in vfork has moved on (slept or woken since), then frozen again, for at most
/// [`VFORK_WAIT`].
pub(crate) fn freeze_for_criu(sb: &Sandbox) -> Result<()> {
    let deadline = Instant::now() + VFORK_WAIT;
    loop {
        sb.cgroup.freeze()?;
        let parents: Vec<i32> = sb.cgroup.pids()?.into_iter().filter(|p| in_vfork(*p)).collect();
        if parents.is_empty() || Instant::now() >= deadline {
            return Ok(());
        }
        sb.cgroup.thaw()?;
        let seen: Vec<(i32, Option<u64>)> = parents.iter().map(|p| (*p, switches(*p))).collect();
        // Moved on: gone, out of vfork, or switched since (its next vfork is another moment).
        let moved_on = |(p, n): &(i32, Option<u64>)| !in_vfork(*p) || switches(*p) != *n;
        while !seen.iter().all(moved_on) && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// Whether process `pid` (a host pid) waits in vfork(): a vfork parent sleeps in kernel_clone
/// (no other fork sleeps there).
fn in_vfork(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/wchan")).is_ok_and(|w| w.trim() == "kernel_clone")
}

/// How many times process `pid` has given up the CPU of its own accord (None once it is gone).
fn switches(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("voluntary_ctxt_switches:")).and_then(|v| v.trim().parse().ok())
}

/// Longest [`freeze_for_criu`] waits for a moment without a vfork before it lets CRIU meet one.
const VFORK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Take back the channel of a session process whose other end it holds at `channel_fd`, and
/// register it with init again (tag and stash, as for any session).
async fn reattach(sb: &Sandbox, root: i32, s: &PausedSession) -> Result<Arc<Session>> {
    let host = crate::sandbox::procs::host_pid_of(sb, root)
        .ok_or_else(|| RuntimeError::Conflict(format!("session {} (pid {root}) is gone", s.id)))?;
    let pidfd = bb_sys::process::pidfd_open(host)?;
    let chan = UnixStream::from(bb_sys::process::pidfd_getfd(&pidfd, s.channel_fd)?);
    let keep = chan.try_clone().map_err(RuntimeError::io("session channel"))?;
    let session = Session::attach(s.id.clone(), s.kind.clone(), root, s.created_at, chan)?;
    crate::sandbox::sessions::adopt(sb, root, session_tag(&s.id, &s.kind, s.default), s.id.clone(), &keep).await?;
    Ok(Arc::new(session))
}

/// The operation locks of `live` sessions, or a conflict naming one that is running code.
fn idle_sessions<'a>(sb: &Sandbox, live: &'a [Arc<Session>]) -> Result<Vec<tokio::sync::MutexGuard<'a, ()>>> {
    live.iter()
        .map(|s| {
            s.op_lock.try_lock().map_err(|_| {
                RuntimeError::Conflict(format!(
                    "session {} of sandbox {} is running code: wait for it (or interrupt it), then pause again",
                    s.id, sb.id
                ))
            })
        })
        .collect()
}

/// Kill every process of `sb` but init and wait until init has reaped them (the pids counter
/// counts zombies), so it has seen every exit.
async fn end_processes(sb: &Arc<Sandbox>) -> Result<()> {
    let sbc = sb.clone();
    tokio::task::spawn_blocking(move || -> Result<()> {
        crate::sandbox::procs::kill_members(&sbc, |p| p == sbc.init_pid)?;
        if !crate::sandbox::procs::wait_only_init_left(&sbc, std::time::Duration::from_secs(5))? {
            return Err(RuntimeError::Conflict(format!(
                "the processes of sandbox {} were killed but its init has not reaped them in 5 s: pause again",
                sbc.id
            )));
        }
        Ok(())
    })
    .await?
}

/// Kill every process of a pausing sandbox but init and give back the memory they held.
async fn free_processes(sb: &Arc<Sandbox>) -> Result<()> {
    let sbc = sb.clone();
    tokio::task::spawn_blocking(move || -> Result<()> {
        crate::sandbox::procs::kill_members(&sbc, |p| p == sbc.init_pid)?;
        if let Err(e) = sbc.cgroup.reclaim() {
            tracing::debug!(sandbox = %sbc.id, "reclaiming a paused sandbox's memory: {e}");
        }
        Ok(())
    })
    .await?
}

async fn init_call(sb: &Sandbox, req: Request) -> Result<()> {
    match InitConn::call(&sb.dirs.sock(), &req).await? {
        Response::Ok => Ok(()),
        Response::Error { errno: libc::EBUSY, message } => Err(RuntimeError::Conflict(format!(
            "sandbox {} cannot be paused now: {message}; wait for them or kill them, then pause again",
            sb.id
        ))),
        Response::Error { errno, message } => Err(init_error(errno, message)),
        other => Err(unexpected(other)),
    }
}

/// What a pause has done so far, to call it off.
#[derive(Default)]
struct Undo {
    suspended: bool,
    /// Sessions whose channel moved into their process: (root pid, session).
    rechanneled: Vec<(i32, PausedSession)>,
    frozen: bool,
    images: Vec<String>,
    recorded: bool,
}

impl Runtime {
    /// Sandbox `id` if it runs and may be paused with `mode` (a full pause needs CRIU; the
    /// sandbox holds no named template).
    pub(crate) fn pausable(&self, id: &str, mode: PauseMode) -> Result<Arc<Sandbox>> {
        let sb = self.live(id)?;
        if let (PauseMode::Full, Some(why)) = (mode, self.process_images.unavailable()) {
            return Err(RuntimeError::Unavailable(format!(
                "pausing with its processes needs CRIU, which this daemon cannot use ({why}): pause with mode \
                 \"filesystem\" (files only) instead"
            )));
        }
        if let Some(t) = self.recipe_of(id) {
            return Err(RuntimeError::Conflict(format!(
                "sandbox {id} holds template {t:?}: it cannot be paused (sandboxes made from it can)"
            )));
        }
        Ok(sb)
    }

    /// Pause sandbox `id`, keeping what `mode` says (see the module docs).
    pub async fn pause(self: &Arc<Self>, id: &str, mode: PauseMode) -> Result<PauseResult> {
        let t0 = Instant::now();
        let sb = self.get(id)?;
        if sb.is_paused() {
            return Err(RuntimeError::Conflict(format!("sandbox {id} is already paused")));
        }
        let sb = self.pausable(id, mode)?;
        let _op = sb.begin_op().await;
        let _files = sb.fs_gate.clone().write_owned().await;
        {
            let mut paused = sb.paused.lock();
            if paused.is_some() {
                return Err(RuntimeError::Conflict(format!("sandbox {id} is already paused")));
            }
            *paused = Some(Paused { at: now(), stage: PauseStage::Pausing });
        }
        let mut undo = Undo::default();
        let paused = match mode {
            PauseMode::Full => self.pause_locked(&sb, &mut undo).await,
            PauseMode::Filesystem => self.pause_files_locked(&sb, &mut undo).await,
        };
        match paused {
            Ok((trees, image_bytes, sessions)) => {
                *sb.expires_at.lock() = None;
                if let Err(e) = self.sandboxes.records().set_expiry(id, None) {
                    tracing::warn!(sandbox = %id, "clearing the timeout of a paused sandbox: {e}");
                }
                let took_ms = ms(t0);
                tracing::info!(sandbox = %id, ?mode, trees, sessions, image_bytes, took_ms, "sandbox paused");
                Ok(PauseResult {
                    sandbox: sb.info(),
                    processes: trees,
                    sessions,
                    image_bytes,
                    took_ms,
                    mode,
                    durability: "node-local".into(),
                    snapshot: None,
                })
            }
            Err(e) => {
                self.call_off_pause(&sb, undo).await;
                *sb.paused.lock() = None;
                Err(e)
            }
        }
    }

    /// The pause itself, its locks held. Returns (trees, image bytes, sessions).
    async fn pause_locked(self: &Arc<Self>, sb: &Arc<Sandbox>, undo: &mut Undo) -> Result<(usize, u64, usize)> {
        let paused_at = sb.paused.lock().map(|p| p.at).unwrap_or_else(now);
        let mut sessions = sb.sessions.lock().await;
        let live: Vec<Arc<Session>> = sessions.values().filter(|s| s.is_alive()).cloned().collect();
        let held = idle_sessions(sb, &live)?;
        init_call(sb, Request::Suspend).await?;
        undo.suspended = true;
        // Templates first (each is dumped on its own, as when the pool evicts it): they are
        // frozen copies the trees below must not include.
        self.evict_sandbox_templates(sb).await;
        self.drop_shells(&sb.id);
        let default = sb.default_session.lock().await.clone();
        for s in &live {
            let channel_fd = s.rechannel().await?;
            undo.rechanneled.push((
                s.pid,
                PausedSession {
                    id: s.id.clone(),
                    kind: s.kind.clone(),
                    default: default.as_deref() == Some(s.id.as_str()),
                    created_at: s.created_at,
                    channel_fd,
                },
            ));
        }
        let mut row = PausedRow {
            id: sb.id.clone(),
            state: PauseState::Pausing,
            paused_at,
            mode: PauseMode::Full,
            trees: undo
                .rechanneled
                .iter()
                .map(|(root, s)| PausedTree { root: *root, image: None, session: Some(s.clone()), attached: false })
                .collect(),
        };
        self.sandboxes.records().set_paused(&row)?;
        undo.recorded = true;

        let (rt, sbc) = (self.clone(), sb.clone());
        let mut trees = row.trees.clone();
        undo.frozen = true;
        row.trees = tokio::task::spawn_blocking(move || -> Result<Vec<PausedTree>> {
            // Memory a lazy restore is still copying in: the dumps wait for it, better before
            // the freeze than in it.
            rt.process_images.wait_lazy(&sbc.id);
            freeze_for_criu(&sbc)?;
            let roots = tree_roots(&sbc)?;
            trees.retain(|t| roots.contains(&t.root));
            for root in roots {
                if !trees.iter().any(|t| t.root == root) {
                    trees.push(PausedTree { root, image: None, session: None, attached: sbc.plugs.has(root) });
                }
            }
            Ok(trees)
        })
        .await??;
        self.sandboxes.records().set_paused(&row)?;
        let freezer = sb.cgroup.freezer_dir()?;
        let mounts = sb.mounts.lock().await;
        let mut image_bytes = 0;
        for i in 0..row.trees.len() {
            let root = row.trees[i].root;
            let (rt, sbc, fz) = (self.clone(), sb.clone(), freezer.clone());
            let (image, m) = tokio::task::spawn_blocking(move || {
                let host = crate::sandbox::procs::host_pid_of(&sbc, root)
                    .ok_or_else(|| RuntimeError::Conflict(format!("process {root} is gone")))?;
                let r = bb_criu::Root { host_pid: host, ns_pid: root };
                let opts = bb_criu::DumpOptions {
                    leave_running: true,
                    kind: crate::process_images::PAUSED_TREE_KIND.into(),
                    frozen_cgroup: Some(fz),
                    external: sbc.plugs.external_tty(root, host).into_iter().collect(),
                };
                rt.process_images.dump(&sbc.criu_ref(), &sbc.id, r, None, &opts)
            })
            .await?
            .map_err(|e| {
                RuntimeError::Conflict(format!(
                    "sandbox {} cannot be paused: dumping its process {root} failed ({e}); it runs on as before",
                    sb.id
                ))
            })?;
            undo.images.push(image.clone());
            image_bytes += m.bytes;
            row.trees[i].image = Some(image.clone());
            self.sandboxes.records().set_paused(&row)?;
            self.process_images.settled(&image);
        }
        drop(mounts);
        // The commit: from here on the images are the sandbox's processes.
        row.state = PauseState::Paused;
        self.sandboxes.records().set_paused(&row)?;
        free_processes(sb).await?;
        sb.set_pause_stage(PauseStage::Paused);
        let n_sessions = undo.rechanneled.len();
        sessions.clear();
        drop(held);
        Ok((row.trees.len(), image_bytes, n_sessions))
    }

    /// A files-only pause, its locks held: every process but init ends (commands that stream
    /// to a client and code running in a session too: nothing of them is kept), then init is
    /// suspended as for a full pause, so nothing starts until the resume. Returns (0, 0,
    /// sessions ended).
    async fn pause_files_locked(self: &Arc<Self>, sb: &Arc<Sandbox>, undo: &mut Undo) -> Result<(usize, u64, usize)> {
        let paused_at = sb.paused.lock().map(|p| p.at).unwrap_or_else(now);
        let mut sessions = sb.sessions.lock().await;
        let ended = sessions.values().filter(|s| s.is_alive()).count();
        self.evict_sandbox_templates(sb).await;
        self.drop_shells(&sb.id);
        end_processes(sb).await?;
        // Init refuses to suspend while a command it streams runs: here only one started since.
        init_call(sb, Request::Suspend).await?;
        undo.suspended = true;
        let row = PausedRow {
            id: sb.id.clone(),
            state: PauseState::Paused,
            paused_at,
            trees: vec![],
            mode: PauseMode::Filesystem,
        };
        self.sandboxes.records().set_paused(&row)?;
        undo.recorded = true;
        // What started between the kill and the suspension.
        free_processes(sb).await?;
        sb.set_pause_stage(PauseStage::Paused);
        sessions.clear();
        Ok((0, 0, ended))
    }

    /// Undo what a failed pause did: everything runs on as before.
    async fn call_off_pause(self: &Arc<Self>, sb: &Arc<Sandbox>, undo: Undo) {
        if undo.frozen {
            if let Err(e) = sb.cgroup.thaw() {
                tracing::warn!(sandbox = %sb.id, "thawing after a failed pause: {e}");
            }
        }
        self.process_images.delete(&undo.images);
        if undo.recorded {
            if let Err(e) = self.sandboxes.records().clear_paused(&sb.id) {
                tracing::warn!(sandbox = %sb.id, "clearing the record of a failed pause: {e}");
            }
        }
        if undo.suspended {
            if let Err(e) = init_call(sb, Request::Resume).await {
                tracing::warn!(sandbox = %sb.id, "init did not take its processes back after a failed pause: {e}");
            }
        }
        let mut sessions = sb.sessions.lock().await;
        for (root, s) in &undo.rechanneled {
            match reattach(sb, *root, s).await {
                Ok(session) => {
                    sessions.insert(s.id.clone(), session);
                }
                Err(e) => tracing::warn!(sandbox = %sb.id, session = %s.id, "session lost after a failed pause: {e}"),
            }
        }
    }

    /// Evict every session template of `sb` now (each dumped to a process image unless it has
    /// one), and wait until they are gone.
    async fn evict_sandbox_templates(self: &Arc<Self>, sb: &Arc<Sandbox>) {
        self.evict_templates_now(self.session_templates.take_sandbox(&sb.id)).await
    }

    /// Resume paused sandbox `id` (see the module docs).
    pub async fn resume(self: &Arc<Self>, id: &str, req: ResumeSandbox) -> Result<ResumeResult> {
        let t0 = Instant::now();
        let timeout = crate::sandbox::exec::timeout_of(req.timeout.or(Some(0.0)))?;
        let sb = match self.get(id) {
            Ok(sb) => sb,
            Err(RuntimeError::NotFound { .. }) => return self.resume_pushed(id, req).await,
            Err(e) => return Err(e),
        };
        if sb.is_dead() {
            return Err(RuntimeError::Conflict(format!("sandbox {id} is dead: kill it and create a new one")));
        }
        let _op = sb.begin_op().await;
        let _files = sb.fs_gate.clone().write_owned().await;
        if sb.paused.lock().map(|p| p.stage) != Some(PauseStage::Paused) {
            return Err(RuntimeError::Conflict(format!("sandbox {id} is not paused")));
        }
        let row = self.sandboxes.records().paused(id)?.filter(|r| r.state == PauseState::Paused).ok_or_else(|| {
            RuntimeError::Conflict(format!("sandbox {id} has no committed pause record: kill it and create a new one"))
        })?;
        let reboot = req.reboot || row.mode == PauseMode::Filesystem;
        sb.set_pause_stage(PauseStage::Resuming);
        let (restored, lazy_pages) = if reboot {
            // A cold boot: the machine starts again from its disk.
            if let Err(e) = crate::sandbox::launch::new_boot_id(sb.init_pid) {
                sb.set_pause_stage(PauseStage::Paused);
                return Err(e);
            }
            (0, false)
        } else {
            let mounts = sb.mounts.lock().await;
            let restored = self.restore_trees(&sb, &row).await;
            drop(mounts);
            match restored {
                Ok(r) => r,
                Err(e) => {
                    sb.set_pause_stage(PauseStage::Paused);
                    return Err(e);
                }
            }
        };
        init_call(&sb, Request::Resume).await?;
        let mut sessions = sb.sessions.lock().await;
        let mut n_sessions = 0;
        for tree in row.trees.iter().filter(|_| !reboot) {
            let Some(s) = &tree.session else { continue };
            match reattach(&sb, tree.root, s).await {
                Ok(session) => {
                    sessions.insert(s.id.clone(), session);
                    if s.default {
                        *sb.default_session.lock().await = Some(s.id.clone());
                    }
                    n_sessions += 1;
                }
                Err(e) => {
                    tracing::warn!(sandbox = %id, session = %s.id, "a resumed session could not be re-attached: {e}");
                    let _ = crate::sandbox::sessions::kill_process(&sb, tree.root).await;
                }
            }
        }
        drop(sessions);
        self.sandboxes.records().clear_paused(id)?;
        self.process_images.delete(&row.trees.iter().filter_map(|t| t.image.clone()).collect::<Vec<_>>());
        let timeout = match req.timeout {
            Some(_) => timeout.map(|d| d.as_secs_f64()),
            None => sb.spec.timeout,
        };
        let exp = timeout.map(|t| now() + t);
        *sb.expires_at.lock() = exp;
        self.sandboxes.records().set_expiry(id, exp)?;
        *sb.paused.lock() = None;
        let took_ms = ms(t0);
        tracing::info!(sandbox = %id, trees = restored, sessions = n_sessions, took_ms, lazy_pages, reboot, "sandbox resumed");
        Ok(ResumeResult {
            sandbox: sb.info(),
            processes: restored,
            sessions: n_sessions,
            took_ms,
            lazy_pages,
            rebooted: reboot,
        })
    }

    /// Restore every tree of a paused sandbox; all or none (those restored are killed again
    /// when one fails). An attached process gets new pipes to its owner; one whose owner is gone
    /// (the daemon restarted since the pause) is left out: it ended with its owner, as it would
    /// have had the sandbox run on. Returns how many were restored, and whether any lazily.
    async fn restore_trees(self: &Arc<Self>, sb: &Arc<Sandbox>, row: &PausedRow) -> Result<(usize, bool)> {
        let mut lazy = false;
        let ends = sb.plugs.new_ends(sb, row.trees.iter().filter(|t| t.attached).map(|t| t.root)).await?;
        let inherit: Arc<Vec<(std::os::fd::RawFd, String)>> =
            Arc::new(ends.inherit.iter().map(|(fd, key)| (fd.as_raw_fd(), key.clone())).collect());
        let mut restored = 0;
        for tree in &row.trees {
            if tree.attached && !sb.plugs.has(tree.root) {
                tracing::info!(sandbox = %sb.id, pid = tree.root, "an attached process whose owner is gone is not restored");
                continue;
            }
            let res = match tree.image.clone() {
                Some(image) => {
                    let (rt, sbc, img, inh) = (self.clone(), sb.clone(), image.clone(), inherit.clone());
                    tokio::task::spawn_blocking(move || rt.process_images.restore(&sbc, &img, false, &inh))
                        .await?
                        .map_err(|e| format!("restoring it from image {image} failed ({e})"))
                }
                None => Err("it has no process image".to_string()),
            };
            let why = match res {
                Ok((_, l)) => {
                    lazy |= l;
                    restored += 1;
                    continue;
                }
                Err(why) => why,
            };
            {
                let sbc = sb.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    crate::sandbox::procs::kill_members(&sbc, |p| p == sbc.init_pid)
                })
                .await;
                if let Some(path) = missing_file(&why) {
                    return Err(RuntimeError::Conflict(format!(
                        "sandbox {} cannot be resumed: process {} had file {path} open when it was paused, and that file \
                         is gone (deleted or renamed since, e.g. by another sandbox mounting the same volume); it stays \
                         paused with its files and images: put the file back and resume again, resume with reboot (files \
                         only, a cold boot), or kill it ({why})",
                        sb.id, tree.root
                    )));
                }
                return Err(RuntimeError::Conflict(format!(
                    "sandbox {} cannot be resumed: process {}: {why}; it stays paused with its files and images: fix the \
                     cause and resume again, resume with reboot (files only, a cold boot), or kill it",
                    sb.id, tree.root
                )));
            }
        }
        sb.plugs.plug_in(ends).await?;
        Ok((restored, lazy))
    }

    /// After a daemon restart: finish what a pause or resume of `sb` left (see the module docs).
    /// Blocking; runs before the runtime serves.
    pub(crate) fn recover_pause(&self, sb: &Sandbox, row: PausedRow) {
        let sock = sb.dirs.sock();
        let call = |req: &Request, fds: &[std::os::fd::RawFd]| {
            crate::initconn::call_blocking(&sock, req, fds, std::time::Duration::from_secs(2))
        };
        match row.state {
            PauseState::Pausing => {
                tracing::warn!(sandbox = %sb.id, "a pause was under way when the daemon stopped: calling it off");
                let _ = sb.cgroup.thaw();
                self.process_images.delete(&row.trees.iter().filter_map(|t| t.image.clone()).collect::<Vec<_>>());
                let _ = call(&Request::Resume, &[]);
                if tokio::runtime::Handle::try_current().is_ok() {
                    let mut sessions = sb.sessions.try_lock().ok();
                    for tree in &row.trees {
                        let Some(s) = &tree.session else { continue };
                        let res = (|| -> Result<Session> {
                            let host = crate::sandbox::procs::host_pid_of(sb, tree.root)
                                .ok_or_else(|| RuntimeError::Conflict("gone".into()))?;
                            let pidfd = bb_sys::process::pidfd_open(host)?;
                            let chan = UnixStream::from(bb_sys::process::pidfd_getfd(&pidfd, s.channel_fd)?);
                            let keep = chan.try_clone().map_err(RuntimeError::io("session channel"))?;
                            let adopt = Request::Adopt {
                                pid: tree.root,
                                tag: session_tag(&s.id, &s.kind, s.default),
                                stash: Some(s.id.clone()),
                            };
                            call(&adopt, &[keep.as_raw_fd()])?;
                            Session::attach(s.id.clone(), s.kind.clone(), tree.root, s.created_at, chan)
                        })();
                        match res {
                            Ok(session) => {
                                if let Some(map) = sessions.as_mut() {
                                    map.insert(s.id.clone(), Arc::new(session));
                                }
                            }
                            Err(e) => tracing::warn!(sandbox = %sb.id, session = %s.id, "session lost: {e}"),
                        }
                    }
                }
                let _ = self.sandboxes.records().clear_paused(&sb.id);
            }
            PauseState::Paused => {
                // A resume may have been under way: whatever it restored goes again.
                let _ = call(&Request::Suspend, &[]);
                if let Err(e) = crate::sandbox::procs::kill_members(sb, |p| p == sb.init_pid) {
                    tracing::warn!(sandbox = %sb.id, "killing the processes of a paused sandbox: {e}");
                }
                let _ = sb.cgroup.thaw();
                let _ = crate::sandbox::procs::wait_only_init_left(sb, std::time::Duration::from_secs(2));
                if let Ok(mut s) = sb.sessions.try_lock() {
                    s.clear();
                }
                *sb.paused.lock() = Some(Paused { at: row.paused_at, stage: PauseStage::Paused });
            }
        }
    }

    /// Pause sandboxes whose timeout passed and whose lifecycle says so. A full pause that
    /// fails (refused: a command in the foreground, a busy session; or a dump that failed) is
    /// tried again every minute, for `timeout_pause_grace` at most; one that cannot be made at
    /// all (no CRIU) or still fails after that becomes a files-only pause, which ends the
    /// processes: the timeout holds, the files are kept, the resume is a cold boot.
    pub(crate) async fn pause_expired(self: &Arc<Self>, ids: Vec<String>) {
        let grace = self.cfg.timeout_pause_grace.as_secs_f64();
        for id in ids {
            let Ok(sb) = self.get(&id) else { continue };
            let mode = sb.spec.lifecycle.pause_mode;
            let err = match self.pause(&id, mode).await {
                Ok(r) => {
                    *sb.timeout_pause_failing_since.lock() = None;
                    tracing::info!(%id, took_ms = r.took_ms, "sandbox reached its timeout and was paused");
                    continue;
                }
                Err(e) => e,
            };
            let first = *sb.timeout_pause_failing_since.lock().get_or_insert_with(now);
            let impossible = matches!(err, RuntimeError::Unavailable(_));
            if mode == PauseMode::Full && (impossible || now() - first >= grace) {
                match self.pause(&id, PauseMode::Filesystem).await {
                    Ok(r) => {
                        *sb.timeout_pause_failing_since.lock() = None;
                        tracing::warn!(%id, took_ms = r.took_ms,
                            "sandbox reached its timeout and was paused with its files only (its processes ended): its full pause failed: {err}");
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(%id, "pausing a sandbox at its timeout failed: {err}; with its files only: {e}")
                    }
                }
            }
            let retry = grace.clamp(1.0, 60.0);
            tracing::warn!(%id, "pausing a sandbox at its timeout failed (trying again in {retry} s): {err}");
            *sb.expires_at.lock() = Some(now() + retry);
        }
    }
}

/// The file a failed restore did not find, as the sandbox names it: CRIU logs "Can't open file
/// PATH: No such file or directory" with PATH relative to the sandbox's root.
fn missing_file(why: &str) -> Option<String> {
    const OPEN: &str = "Can't open file ";
    let rest = &why[why.find(OPEN)? + OPEN.len()..];
    let path = &rest[..rest.find(": No such file or directory")?];
    // (Some CRIU versions say "Can't open file PATH on restore: ...".)
    let path = path.strip_suffix(" on restore").unwrap_or(path);
    (!path.is_empty() && !path.contains(" | ")).then(|| format!("/{}", path.trim_start_matches('/')))
}

#[cfg(test)]
mod tests {
    use super::missing_file;

    #[test]
    fn a_restore_that_misses_a_file_names_it() {
        let why = "restoring it from image pi-1 failed (criu restore failed (exit 1): (00.005975)      5: Error \
                   (criu/files-reg.c:2267): Can't open file data/log: No such file or directory | (00.005977)      5: \
                   Error (criu/files.c:1221): Unable to open fd=3 id=0xf)";
        assert_eq!(missing_file(why).as_deref(), Some("/data/log"));
        let why = "criu restore failed (exit 1): (00.004387)      3: Error (criu/files-reg.c:2353): Can't open file \
                   data/log on restore: No such file or directory | (00.004389)      3: Error";
        assert_eq!(missing_file(why).as_deref(), Some("/data/log"));
        assert_eq!(missing_file("criu restore failed: Can't open file x: Permission denied"), None);
        assert_eq!(missing_file("it has no process image"), None);
    }
}
