//! Sandbox lifecycle: create (a pooled shell claimed, or a cold start), the registry of live
//! sandboxes, timeouts, and kill.
//!
//! Kill recycles a healthy sandbox into the warm pool when its image's pool wants one
//! ([`crate::pool`]), and otherwise tears it down. A killed sandbox that others are nested in
//! (live-fork children stand in its user and pid namespaces) becomes a *husk*: every process
//! but its init is killed and its host side removed, and init stays until the last nested
//! sandbox is gone.

use crate::error::{Result, RuntimeError};
use crate::layers::Generation;
use crate::model::*;
use crate::sandbox::launch::{self, SandboxDirs};
use crate::sandbox::{store, Sandbox};
use crate::{now, Runtime};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A new sandbox id.
pub(crate) fn new_sandbox_id() -> String {
    format!("sb-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

/// A sandbox id as the runtime keeps it: `sb` followed by 12 hex digits (its dashless form, the
/// one the E2B endpoint shows, as E2B ids are `[a-z0-9]+`) gets its dash back; anything else is
/// unchanged.
pub fn canonical_id(id: &str) -> std::borrow::Cow<'_, str> {
    match id.strip_prefix("sb") {
        Some(hex) if hex.len() == 12 && hex.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()) => {
            format!("sb-{hex}").into()
        }
        _ => id.into(),
    }
}

/// The dashless form of a sandbox id (see [`canonical_id`]).
pub fn dashless_id(id: &str) -> String {
    id.replace('-', "")
}

impl Runtime {
    pub fn count(&self) -> usize {
        self.sandboxes.count()
    }

    pub fn get(&self, id: &str) -> Result<Arc<Sandbox>> {
        self.sandboxes.get(id).ok_or_else(|| RuntimeError::sandbox(id))
    }

    /// Ids of the sandboxes whose init lives (running or paused).
    pub fn live_ids(&self) -> Vec<String> {
        self.sandboxes.all().iter().filter(|s| !s.is_dead()).map(|s| s.id.clone()).collect()
    }

    /// Like [`get`](Self::get) but refuses a sandbox whose init has died, or that is paused.
    pub(crate) fn live(&self, id: &str) -> Result<Arc<Sandbox>> {
        let sb = self.get(id)?;
        if sb.is_dead() {
            let why = if sb.info().oom_killed { " (it ran out of memory)" } else { "" };
            return Err(RuntimeError::Conflict(format!(
                "sandbox {id} is dead{why}: kill it and create a new one, with more memory_mb if needed"
            )));
        }
        if sb.is_paused() {
            return Err(RuntimeError::Conflict(format!(
                "sandbox {id} is paused: resume it first (sbx.resume(), Sandbox.connect(id), or POST /v1/sandboxes/{id}/resume)"
            )));
        }
        Ok(sb)
    }

    /// [`live`](Self::live), resuming a paused sandbox first when its lifecycle says so
    /// (`auto_resume`). For the requests that use a sandbox: commands, code, files, sessions.
    pub(crate) async fn ready(self: &Arc<Self>, id: &str) -> Result<Arc<Sandbox>> {
        let sb = self.get(id)?;
        if sb.spec.lifecycle.auto_resume && sb.is_paused() && !sb.is_dead() {
            // A resume waits for a pause under way. Conflict: resumed by a request that came at
            // the same time, or it cannot be (`live` says how it stands).
            match self.resume(id, crate::model::ResumeSandbox::default()).await {
                Ok(_) | Err(RuntimeError::Conflict(_)) => {}
                Err(e) => return Err(e),
            }
        }
        self.live(id)
    }

    pub(crate) fn validate(&self, req: CreateSandbox) -> Result<(SandboxSpec, Option<f64>, Vec<PathBuf>)> {
        let c = &self.cfg;
        let image_name = req.image.unwrap_or_else(|| "base".into());
        let image = self.images.get(&image_name).map_err(RuntimeError::from)?;
        let cpu = req.cpu.unwrap_or(1.0);
        if !(0.01..=c.max_cpu).contains(&cpu) {
            return Err(RuntimeError::BadRequest(format!("cpu must be in [0.01, {}]; got {cpu}", c.max_cpu)));
        }
        let memory_mb = req.memory_mb.unwrap_or(512);
        if !(16..=c.max_memory_mb).contains(&memory_mb) {
            return Err(RuntimeError::BadRequest(format!(
                "memory_mb must be in [16, {}]; got {memory_mb}",
                c.max_memory_mb
            )));
        }
        let pids = req.pids.unwrap_or(512);
        if !(8..=c.max_pids).contains(&pids) {
            return Err(RuntimeError::BadRequest(format!("pids must be in [8, {}]; got {pids}", c.max_pids)));
        }
        let network = req.network.unwrap_or_else(|| "none".into());
        let proxy_port = req.proxy.unwrap_or(false).then_some(c.proxy_port);
        let proxy_record = req.proxy_record.unwrap_or(false);
        crate::net::record::check(proxy_record, proxy_port)?;
        let net_limits = req.net_limits.unwrap_or_default();
        crate::net::policy::Policy::parse_for(&network, &req.allow, proxy_port.is_some())
            .and_then(|p| p.with_limits(net_limits))
            .map_err(crate::net::NetError::from)?;
        let timeout = req.timeout.unwrap_or(300.0);
        if !(timeout >= 0.0 && timeout.is_finite()) {
            return Err(RuntimeError::BadRequest("timeout must be >= 0 seconds (0 = no limit)".into()));
        }
        for k in req.env.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(RuntimeError::BadRequest(format!("env name {k:?} is invalid: no '=' or NUL, not empty")));
            }
        }
        let cwd = req.cwd.or(image.workdir.clone()).filter(|w| !w.is_empty()).unwrap_or_else(|| "/root".into());
        if !cwd.starts_with('/') {
            return Err(RuntimeError::BadRequest(format!("cwd {cwd:?} must be an absolute path")));
        }
        let lifecycle = req.lifecycle.unwrap_or_default();
        if lifecycle.auto_resume && lifecycle.on_timeout != OnTimeout::Pause {
            return Err(RuntimeError::BadRequest(
                "lifecycle.auto_resume needs lifecycle.on_timeout \"pause\" (a killed sandbox cannot resume)".into(),
            ));
        }
        if lifecycle.pause_mode == PauseMode::Filesystem {
            if lifecycle.on_timeout != OnTimeout::Pause {
                return Err(RuntimeError::BadRequest(
                    "lifecycle.pause_mode only applies with lifecycle.on_timeout \"pause\"".into(),
                ));
            }
            if lifecycle.auto_resume {
                return Err(RuntimeError::BadRequest(
                    "lifecycle.auto_resume cannot be combined with pause_mode \"filesystem\": a cold boot loses the \
                     processes a request would expect; resume such a sandbox explicitly"
                        .into(),
                ));
            }
        }
        if lifecycle.on_timeout == OnTimeout::Pause && lifecycle.pause_mode == PauseMode::Full {
            if let Some(why) = self.process_images.unavailable() {
                return Err(RuntimeError::Unavailable(format!(
                    "lifecycle.on_timeout \"pause\" needs CRIU, which this daemon cannot use ({why}); \
                     lifecycle.pause_mode \"filesystem\" does not"
                )));
            }
        }
        let layer_paths = image.layers.iter().map(|l| self.images.layer_path(l)).collect();
        let spec = SandboxSpec {
            image: image.name.clone(),
            image_env: image.env.clone(),
            layers: image.layers.clone(),
            cpu,
            memory_mb,
            pids,
            env: req.env,
            cwd,
            network,
            allow: req.allow,
            proxy_port,
            proxy_record,
            net_limits,
            metadata: req.metadata,
            timeout: (timeout > 0.0).then_some(timeout),
            lifecycle,
            sudo: req.sudo.unwrap_or(false),
        };
        Ok((spec, (timeout > 0.0).then_some(timeout), layer_paths))
    }

    pub async fn create(self: &Arc<Self>, mut req: CreateSandbox) -> Result<SandboxInfo> {
        self.check_capacity(1)?;
        // The snapshot the sandbox starts from (its own, or its template's): the sandbox gets
        // copy-on-write forks of the volumes that branched with it, after the request's own.
        let from = match (&req.snapshot, &req.template) {
            (Some(sid), _) => Some(sid.clone()),
            (None, Some(name)) => self.template_row(name).ok().map(|t| t.snapshot),
            (None, None) => None,
        };
        let mut mounts = std::mem::take(&mut req.volumes);
        for m in &mut mounts {
            m.volume = self.open_volume(&m.volume).await?;
        }
        let claims = self.claim_volumes(&mounts)?;
        for m in mounts.iter().filter(|m| !m.read_only) {
            self.hold_for_mount(&m.volume).await?;
        }
        let info = self.create_unmounted(req).await?;
        let sb = self.get(&info.id)?;
        let rt = self.clone();
        let sbc = sb.clone();
        let mut attached = if claims.is_empty() {
            drop(claims);
            Ok(())
        } else {
            tokio::task::spawn_blocking(move || rt.attach_volumes(&sbc, claims))
                .await
                .map_err(RuntimeError::Worker)
                .and_then(|r| r)
        };
        if let (Ok(()), Some(sid)) = (&attached, from) {
            attached = self.fork_volumes_into(&sid, std::slice::from_ref(&sb)).await;
        }
        if let Err(e) = attached {
            let _ = self.kill_unchecked(&sb.id).await;
            return Err(e);
        }
        Ok(sb.info())
    }

    async fn create_unmounted(self: &Arc<Self>, req: CreateSandbox) -> Result<SandboxInfo> {
        if let Some(sid) = req.snapshot.clone() {
            if req.template.is_some() {
                return Err(RuntimeError::BadRequest("give a template or a snapshot to create from, not both".into()));
            }
            return Ok(self.create_from_snapshot(&sid, req, None).await?.info());
        }
        if let Some(name) = req.template.clone() {
            return self.create_from_template(&name, req).await;
        }
        let (spec, timeout, _) = self.validate(req)?;
        // A ready sandbox from the warm pool if there is one; otherwise a cold start.
        let rt = self.clone();
        let s2 = spec.clone();
        let pooled =
            tokio::task::spawn_blocking(move || rt.claim_pooled(&s2, timeout)).await.map_err(RuntimeError::Worker)?;
        self.pool.wake.notify_one();
        match pooled {
            Some(Ok(sb)) => {
                self.watch_init(&sb);
                return Ok(sb.info());
            }
            Some(Err(e)) => tracing::warn!("a pooled sandbox could not be claimed ({e}); starting one cold"),
            None => {}
        }
        let chain = spec.layers.clone();
        Ok(self.create_from(spec, chain, None, timeout, None).await?.info())
    }

    pub(crate) fn check_capacity(&self, n: usize) -> Result<()> {
        if self.count() + n > self.cfg.max_sandboxes {
            return Err(RuntimeError::Unavailable(format!(
                "{} sandboxes are running and the daemon's limit (--max-sandboxes) is {}: kill some first",
                self.count(),
                self.cfg.max_sandboxes
            )));
        }
        Ok(())
    }

    /// Launch a sandbox standing on `chain` (layer ids, bottom first; image and snapshot layers).
    /// With `nest_in`, the sandbox is nested in that sandbox's namespaces
    /// ([`launch::launch_nested`]): a fork child its session templates can be forked into.
    pub(crate) async fn create_from(
        self: &Arc<Self>,
        spec: SandboxSpec,
        chain: Vec<String>,
        base: Option<String>,
        timeout: Option<f64>,
        nest_in: Option<Arc<Sandbox>>,
    ) -> Result<Arc<Sandbox>> {
        self.create_from_as(None, spec, chain, base, timeout, nest_in).await
    }

    /// [`Runtime::create_from`] under id `id` (a pushed paused sandbox resumed here keeps its
    /// id) or a new one.
    pub(crate) async fn create_from_as(
        self: &Arc<Self>,
        id: Option<String>,
        spec: SandboxSpec,
        chain: Vec<String>,
        base: Option<String>,
        timeout: Option<f64>,
        nest_in: Option<Arc<Sandbox>>,
    ) -> Result<Arc<Sandbox>> {
        let t0 = std::time::Instant::now();
        let id = id.unwrap_or_else(new_sandbox_id);
        let rt = self.clone();
        let sb = tokio::task::spawn_blocking(move || -> Result<Arc<Sandbox>> {
            let layer_paths: Vec<PathBuf> = chain.iter().map(|l| launch::layer_dir(&rt.cfg, &rt.images, l)).collect();
            let launched = match &nest_in {
                Some(p) => launch::launch_nested(&rt.cfg, &rt.cgroups, &id, &spec, &layer_paths, &p.dirs.sock())?,
                None => {
                    let l = launch::launch(&rt.cfg, &rt.cgroups, &id, &spec, &layer_paths)?;
                    rt.note_placement(l.placement);
                    l
                }
            };
            let t_launched = t0.elapsed();
            let gen = Generation { upper: launched.upper.clone(), mounted: chain.clone(), chain, base, n: 0 };
            let sb = rt.register(id.clone(), spec, launched, gen, nest_in.map(|p| p.id.clone()), timeout)?;
            tracing::debug!(%id, ?t_launched, recorded = ?t0.elapsed(), "sandbox created");
            Ok(sb)
        })
        .await
        .map_err(RuntimeError::Worker)??;
        self.watch_init(&sb);
        Ok(sb)
    }

    /// Record a launched sandbox (SQLite row and layer generation) and make it visible; on
    /// failure it is torn down. Blocking.
    pub(crate) fn register(
        &self,
        id: String,
        spec: SandboxSpec,
        launched: launch::Launched,
        gen: Generation,
        nest_parent: Option<String>,
        timeout: Option<f64>,
    ) -> Result<Arc<Sandbox>> {
        let rootfs = SandboxDirs::new(&self.cfg.state_dir, &id).rootfs_gen(gen.n);
        let wiring = match self.net_wire(&id, launched.init_pid, &rootfs, &spec) {
            Ok(w) => w,
            Err(e) => {
                let _ = launch::teardown(&self.cfg, &self.cgroups, &id, Some((launched.init_pid, launched.init_start)));
                self.remove_layer_dir(&gen.upper);
                return Err(e);
            }
        };
        let created_at = now();
        let expires_at = timeout.map(|t| created_at + t);
        let row = store::SandboxRow {
            id: id.clone(),
            spec: spec.clone(),
            init_pid: launched.init_pid,
            init_start: launched.init_start,
            created_at,
            expires_at,
            nest_parent: nest_parent.clone(),
        };
        let recorded =
            self.snapshots.records().set_generation(&id, &gen).and_then(|()| self.sandboxes.records().insert(&row));
        if let Err(e) = recorded {
            self.net.detach(&id);
            let _ = launch::teardown(&self.cfg, &self.cgroups, &id, Some((launched.init_pid, launched.init_start)));
            self.remove_layer_dir(&gen.upper);
            let _ = self.snapshots.records().delete_generation(&id);
            return Err(e.into());
        }
        // A recording sandbox made from a snapshot replays what was answered after it.
        let record_from = spec.proxy_record.then(|| gen.base.clone());
        // A fork child made for `replay_inflight` takes on its parent's proxied requests in flight.
        let handed_from = gen.base.clone().filter(|_| spec.proxy_port.is_some());
        let mut sb = Sandbox::new(
            id.clone(),
            spec,
            SandboxDirs::new(&self.cfg.state_dir, &id),
            launched.init_pid,
            launched.init_start,
            created_at,
            expires_at,
            launched.cgroup,
            Some(gen),
        );
        sb.nest_parent = nest_parent;
        let sb = Arc::new(sb);
        if let Some(base) = handed_from {
            self.net.proxy.inflight.adopt(&sb.id, &base);
        }
        self.net_start(&sb, wiring);
        if let Some(from) = record_from {
            self.net.proxy.recorder.start(&sb.id, from.as_deref());
        }
        self.sandboxes.insert(sb.clone());
        Ok(sb)
    }

    /// Reap init as soon as it exits (it is our child) so it never lingers as a zombie.
    pub(crate) fn watch_init(&self, sb: &Arc<Sandbox>) {
        let sb = sb.clone();
        tokio::spawn(async move {
            let afd = bb_sys::process::pidfd_open(sb.init_pid).ok().and_then(|pidfd| {
                // SAFETY: the pidfd is open and owned by the AsyncFd for its whole lifetime.
                unsafe { tokio::io::unix::AsyncFd::register(pidfd) }.ok()
            });
            // A pidfd is readable once the process has exited; without one, init is already gone.
            // The watch ends early when the daemon lets go of the sandbox (its init may be
            // recycled into the warm pool).
            if let Some(afd) = afd {
                tokio::select! {
                    _ = afd.readable() => {}
                    _ = sb.released.notified() => return,
                }
            }
            sb.dead.store(true, Ordering::SeqCst);
            // It has exited (or is gone): reap it if it is our child.
            bb_sys::process::reap_child(sb.init_pid, std::time::Duration::ZERO);
        });
    }

    pub fn list(&self, filter: &[(String, String)]) -> Vec<SandboxInfo> {
        let mut v: Vec<SandboxInfo> = self
            .sandboxes
            .all()
            .iter()
            .filter(|s| filter.iter().all(|(k, v)| s.spec.metadata.get(k) == Some(v)))
            .filter(|s| {
                !s.spec.metadata.contains_key(crate::recipes::TEMPLATE_KEY)
                    || filter.iter().any(|(k, _)| k == crate::recipes::TEMPLATE_KEY)
            })
            .map(|s| s.info())
            .collect();
        v.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        v
    }

    pub fn info(&self, id: &str) -> Result<SandboxInfo> {
        Ok(self.get(id)?.info())
    }

    pub fn set_timeout(&self, id: &str, timeout: f64) -> Result<SandboxInfo> {
        if !(timeout >= 0.0 && timeout.is_finite()) {
            return Err(RuntimeError::BadRequest("timeout must be >= 0 seconds (0 = no limit)".into()));
        }
        let sb = self.get(id)?;
        let exp = (timeout > 0.0).then(|| now() + timeout);
        self.sandboxes.records().set_expiry(id, exp)?;
        *sb.expires_at.lock() = exp;
        *sb.timeout_pause_failing_since.lock() = None;
        Ok(sb.info())
    }

    pub async fn kill(self: &Arc<Self>, id: &str) -> Result<()> {
        if let Some(t) = self.recipe_of(id) {
            return Err(RuntimeError::Conflict(format!(
                "sandbox {id} holds template {t:?}: remove the template instead (`branchbox template rm {t}`)"
            )));
        }
        self.kill_unchecked(id).await
    }

    /// [`kill`](Self::kill) without the template check (for the template's own removal).
    pub(crate) async fn kill_unchecked(self: &Arc<Self>, id: &str) -> Result<()> {
        let sb = self.sandboxes.remove(id).ok_or_else(|| RuntimeError::sandbox(id))?;
        let was_alive = !sb.is_dead();
        sb.dead.store(true, Ordering::SeqCst);
        self.ports.close_all(id);
        self.net.proxy.close(id);
        let rt = self.clone();
        let id = id.to_string();
        let gone_templates = self.session_templates.remove_sandbox(&id);
        sb.released.notify_one();
        let paused = self.sandboxes.records().paused(&id);
        let pause_images: Vec<String> = match paused {
            Ok(Some(row)) => row.trees.into_iter().filter_map(|t| t.image).collect(),
            _ => Vec::new(),
        };
        tokio::task::spawn_blocking(move || {
            // Unwired first: a shell recycled into the pool has only loopback again.
            rt.net.detach(&id);
            sb.net.lock().wired = None;
            rt.drop_shells(&id);
            if rt.sandboxes.has_nested(&id) {
                rt.make_husk(&sb)?;
            } else if let Some(slot) =
                (was_alive && sb.volumes.lock().is_empty()).then(|| rt.reserve_recycle(&sb)).flatten()
            {
                if let Err(e) = rt.recycle(&sb, slot) {
                    tracing::warn!(%id, "recycling into the warm pool failed ({e}); tearing down");
                    launch::teardown(&rt.cfg, &rt.cgroups, &id, Some((sb.init_pid, sb.init_start)))?;
                }
            } else {
                launch::teardown(&rt.cfg, &rt.cgroups, &id, Some((sb.init_pid, sb.init_start)))?;
            }
            for key in gone_templates {
                let _ = rt.snapshots.records().drop_template(&key);
            }
            let upper = sb.gen.lock().as_ref().map(|g| g.upper.clone());
            rt.snapshots.records().delete_generation(&id)?;
            if let Some(u) = upper {
                rt.remove_layer_dir(&u);
            }
            rt.sandboxes.records().delete(&id)?;
            rt.release_volumes(&sb)?;
            rt.process_images.delete(&pause_images);
            rt.collect_husks();
            Ok(())
        })
        .await
        .map_err(RuntimeError::Worker)?
    }

    /// Turn a killed sandbox that has nested sandboxes into a husk: every process but its init is
    /// killed (with the cgroup frozen, so nothing forks meanwhile), the host side of its root and
    /// its state dir go; init stays, in its cgroup, until its last nested sandbox is gone.
    pub(crate) fn make_husk(&self, sb: &Sandbox) -> Result<()> {
        crate::sandbox::procs::kill_members(sb, |p| p == sb.init_pid)?;
        let row = store::HuskRow {
            id: sb.id.clone(),
            init_pid: sb.init_pid,
            init_start: sb.init_start,
            nest_parent: sb.nest_parent.clone(),
        };
        self.sandboxes.records().insert_husk(&row)?;
        self.sandboxes.insert_husk(row);
        launch::remove_host_side(&self.cfg, &sb.id)?;
        tracing::info!(id = %sb.id, "sandbox killed; its init stays for the sandboxes nested in it");
        Ok(())
    }

    /// Tear down every husk nothing is nested in any more (repeatedly: a husk's parent may be a
    /// husk that only it kept). Returns their ids.
    pub(crate) fn collect_husks(&self) -> Vec<String> {
        let mut gone = Vec::new();
        loop {
            let husks: Vec<store::HuskRow> = self.sandboxes.husks();
            let idle: Vec<store::HuskRow> = husks.into_iter().filter(|h| !self.sandboxes.has_nested(&h.id)).collect();
            if idle.is_empty() {
                return gone;
            }
            for h in idle {
                if let Err(e) = launch::teardown(&self.cfg, &self.cgroups, &h.id, Some((h.init_pid, h.init_start))) {
                    tracing::warn!(id = %h.id, "tearing down husk failed: {e}");
                }
                let _ = self.sandboxes.records().delete_husk(&h.id);
                self.sandboxes.remove_husk(&h.id);
                gone.push(h.id);
            }
        }
    }

    /// Kill every sandbox whose TTL has passed, or pause it when its lifecycle says so. Returns
    /// the ids of those killed.
    pub async fn reap_expired(self: &Arc<Self>) -> Vec<String> {
        let t = now();
        let (to_pause, expired): (Vec<Arc<Sandbox>>, Vec<Arc<Sandbox>>) = self
            .sandboxes
            .all()
            .into_iter()
            .filter(|s| !s.is_paused() && s.expires_at.lock().is_some_and(|e| e <= t))
            .partition(|s| s.spec.lifecycle.on_timeout == OnTimeout::Pause && !s.is_dead());
        let expired: Vec<String> = expired.into_iter().map(|s| s.id.clone()).collect();
        for id in &expired {
            match self.kill(id).await {
                Ok(()) => tracing::info!(%id, "sandbox reached its timeout and was killed"),
                Err(e) => tracing::warn!(%id, "reaping expired sandbox failed: {e}"),
            }
        }
        if !to_pause.is_empty() {
            // Pauses take a while: they must not hold up the kills of the next round.
            let rt = self.clone();
            for sb in &to_pause {
                // Not again while this one is under way.
                *sb.expires_at.lock() = None;
            }
            tokio::spawn(async move { rt.pause_expired(to_pause.into_iter().map(|s| s.id.clone()).collect()).await });
        }
        expired
    }

    /// Kill every sandbox (daemon shutdown with --kill-on-exit).
    pub async fn kill_all(self: &Arc<Self>) {
        let ids: Vec<String> = self.sandboxes.all().iter().map(|s| s.id.clone()).collect();
        for id in ids {
            let _ = self.kill_unchecked(&id).await;
        }
    }
}
