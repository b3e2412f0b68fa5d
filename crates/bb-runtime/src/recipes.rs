//! Named templates (the API's `templates`), built from recipes: sandboxes created from a
//! snapshot with live sessions.
//!
//! A named template is built from a recipe: an image, commands run in a sandbox of it, and python
//! code run in its default session (typically heavy imports: numpy, pandas, a framework's
//! start-up). The sandbox is then checkpointed, and everything in it but its init and the
//! session templates is killed: what remains is inert and owned by the daemon (hidden from
//! `sandbox ls`, no time-out, refused by `kill`). `create(template=name)` is a live fork of that
//! snapshot (`Runtime::fork_snapshot`): the new sandbox is nested in the template sandbox and
//! its session is a copy-on-write copy of the frozen one, so the imports cost nothing and their
//! pages are shared by every sandbox of the template. Nested shells are kept ready for each
//! template (`shells`), so a create only claims one.
//!
//! Records live in SQLite (table `templates`); the template sandbox and its session templates
//! survive daemon restarts like any sandbox. Removing a template kills its sandbox (a husk stays
//! while sandboxes created from it run).

use crate::db::{self, DbResult};
use crate::error::{Result, RuntimeError};
use crate::model::*;
use crate::{now, Runtime};
use rusqlite::{params, Connection};
use std::sync::Arc;
use tokio::sync::mpsc;

/// Metadata key marking a template's own sandbox.
pub const TEMPLATE_KEY: &str = "branchbox.template";
/// Nested shells kept ready per template unless the recipe says otherwise.
pub const DEFAULT_SHELLS: usize = 4;

/// A named template's record (table `templates`).
#[derive(Debug, Clone, PartialEq)]
pub struct RecipeRow {
    pub name: String,
    pub sandbox_id: String,
    pub snapshot: String,
    pub image: String,
    pub shells: usize,
    pub created_at: f64,
}

pub struct RecipeStore {
    conn: Connection,
}

impl RecipeStore {
    pub fn open(path: &std::path::Path) -> DbResult<RecipeStore> {
        let conn = db::open(path)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS templates (
                name TEXT PRIMARY KEY,
                sandbox_id TEXT NOT NULL,
                snapshot TEXT NOT NULL,
                image TEXT NOT NULL,
                shells INTEGER NOT NULL,
                created_at REAL NOT NULL
            );",
        )?;
        Ok(RecipeStore { conn })
    }

    /// Insert or replace; returns the record it replaced.
    pub fn put(&self, row: &RecipeRow) -> DbResult<Option<RecipeRow>> {
        let old = self.get(&row.name)?;
        self.conn.execute(
            "INSERT OR REPLACE INTO templates (name, sandbox_id, snapshot, image, shells, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![row.name, row.sandbox_id, row.snapshot, row.image, row.shells as i64, row.created_at],
        )?;
        Ok(old)
    }

    pub fn get(&self, name: &str) -> DbResult<Option<RecipeRow>> {
        Ok(self.all()?.into_iter().find(|t| t.name == name))
    }

    pub fn delete(&self, name: &str) -> DbResult<()> {
        self.conn.execute("DELETE FROM templates WHERE name = ?1", params![name])?;
        Ok(())
    }

    pub fn all(&self) -> DbResult<Vec<RecipeRow>> {
        let mut stmt = self
            .conn
            .prepare("SELECT name, sandbox_id, snapshot, image, shells, created_at FROM templates ORDER BY name")?;
        let rows = stmt.query_map([], |r| {
            Ok(RecipeRow {
                name: r.get(0)?,
                sandbox_id: r.get(1)?,
                snapshot: r.get(2)?,
                image: r.get(3)?,
                shells: r.get::<_, i64>(4)? as usize,
                created_at: r.get(5)?,
            })
        })?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }
}

/// Template names: like image names (letters, digits, `._-`, 1-64 bytes, not starting with `.`).
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// How a recipe command (run with `timeout` seconds) ended, in words: "exited with status 1",
/// "was killed by signal 9", ...
fn how_it_ended(r: &CommandResult, timeout: f64) -> String {
    if r.timed_out {
        format!("did not finish within {timeout} s (raise the recipe's timeout if it needs longer)")
    } else if r.oom_killed {
        "ran out of memory (raise memory_mb)".to_string()
    } else if let Some(sig) = r.signal {
        format!("was killed by signal {sig}")
    } else if let Some(code) = r.exit_code {
        format!("exited with status {code}")
    } else {
        "ended without an exit status".to_string()
    }
}

fn progress(tx: &mpsc::Sender<TemplateEvent>, stage: &str, message: String, done: Option<u64>, total: Option<u64>) {
    let _ = tx.try_send(TemplateEvent::Progress { stage: stage.into(), message, done, total });
}

impl Runtime {
    fn recipe_store(&self) -> Result<RecipeStore> {
        Ok(RecipeStore::open(&self.cfg.state_dir.join("branchbox.db"))?)
    }

    fn template_info(&self, t: &RecipeRow) -> TemplateInfo {
        let sb = self.get(&t.sandbox_id).ok();
        let snap = self.snapshot(&t.snapshot).ok();
        TemplateInfo {
            name: t.name.clone(),
            image: t.image.clone(),
            snapshot: t.snapshot.clone(),
            sandbox_id: t.sandbox_id.clone(),
            created_at: t.created_at,
            shells: t.shells,
            ready_shells: self.fork_shells.state.lock().len_of(&t.sandbox_id),
            alive: sb.as_ref().is_some_and(|s| !s.is_dead())
                && snap.as_ref().is_some_and(|s| s.sessions.iter().all(|x| x.template)),
            memory_bytes: sb.as_ref().map(|s| s.info().memory_bytes).unwrap_or(0),
            volumes: sb.map(|s| s.volumes.lock().clone()).unwrap_or_default(),
        }
    }

    pub fn list_templates(&self) -> Result<TemplateList> {
        Ok(TemplateList { templates: self.recipe_store()?.all()?.iter().map(|t| self.template_info(t)).collect() })
    }

    pub fn template(&self, name: &str) -> Result<TemplateInfo> {
        let row = self.template_row(name)?;
        Ok(self.template_info(&row))
    }

    pub(crate) fn template_row(&self, name: &str) -> Result<RecipeRow> {
        self.recipe_store()?.get(name)?.ok_or_else(|| RuntimeError::NotFound {
            kind: "template",
            id: name.into(),
            hint: ": list templates with `branchbox template ls`, build one with `branchbox template build`",
        })
    }

    /// The template a sandbox backs, if any.
    pub(crate) fn recipe_of(&self, sandbox_id: &str) -> Option<String> {
        self.get(sandbox_id).ok()?.spec.metadata.get(TEMPLATE_KEY).cloned()
    }

    pub async fn remove_template(self: &Arc<Self>, name: &str) -> Result<()> {
        let row = self.template_row(name)?;
        self.recipe_store()?.delete(name)?;
        self.release_template_sandbox(&row).await;
        Ok(())
    }

    /// Let go of a template's sandbox and its snapshot (sandboxes created from it keep the
    /// layers they stand on, and its init as a husk).
    async fn release_template_sandbox(self: &Arc<Self>, row: &RecipeRow) {
        self.fork_shells.targets.lock().remove(&row.sandbox_id);
        self.session_templates.unpin_sandbox(&row.sandbox_id);
        if let Err(e) = self.kill_unchecked(&row.sandbox_id).await {
            tracing::warn!(template = %row.name, "killing the template's sandbox: {e}");
        }
        match self.delete_snapshot(&row.snapshot, false).await {
            Ok(()) | Err(RuntimeError::NotFound { .. }) => {}
            Err(e) => {
                tracing::warn!(template = %row.name, snapshot = %row.snapshot, "deleting the template's snapshot: {e}")
            }
        }
    }

    /// Check a recipe before anything is started (so a bad one is an error answer, not a
    /// stream that fails): its name, its shell count, its image and the sandbox settings.
    fn check_recipe(&self, req: &BuildTemplate) -> Result<()> {
        if !valid_name(&req.name) {
            return Err(RuntimeError::BadRequest(format!(
                "template name {:?} is invalid: use 1-64 letters, digits, '.', '_' or '-', not starting with '.'",
                req.name
            )));
        }
        let shells = req.shells.unwrap_or(DEFAULT_SHELLS);
        if shells > crate::fork_shells::MAX_PER_PARENT {
            return Err(RuntimeError::BadRequest(format!(
                "shells must be at most {}",
                crate::fork_shells::MAX_PER_PARENT
            )));
        }
        crate::sandbox::exec::timeout_of(req.timeout)?;
        self.validate(self.recipe_sandbox(req))?;
        self.check_capacity(1)
    }

    /// The sandbox a recipe runs in.
    fn recipe_sandbox(&self, req: &BuildTemplate) -> CreateSandbox {
        let mut metadata = req.metadata.clone();
        metadata.insert(TEMPLATE_KEY.into(), req.name.clone());
        CreateSandbox {
            image: req.image.clone(),
            cpu: req.cpu,
            memory_mb: req.memory_mb,
            pids: req.pids,
            env: req.env.clone(),
            cwd: req.cwd.clone(),
            timeout: Some(0.0),
            network: req.network.clone(),
            allow: req.allow.clone(),
            proxy: req.proxy,
            proxy_record: None,
            net_limits: None,
            metadata,
            template: None,
            snapshot: None,
            lifecycle: None,
            volumes: req.volumes.clone(),
            sudo: None,
        }
    }

    /// Build a template in the background; progress, then `Done` or `Error`, on the channel.
    /// A recipe that cannot work (bad name, unknown image, bad settings) is refused here.
    pub fn build_template(self: &Arc<Self>, req: BuildTemplate) -> Result<mpsc::Receiver<TemplateEvent>> {
        self.check_recipe(&req)?;
        let (tx, rx) = mpsc::channel(256);
        let rt = self.clone();
        tokio::spawn(async move {
            let ev = match rt.build_template_inner(req, &tx).await {
                Ok(info) => TemplateEvent::Done { template: info },
                Err(e) => TemplateEvent::Error { error: ErrorBody { code: e.code().into(), message: e.to_string() } },
            };
            let _ = tx.send(ev).await;
        });
        Ok(rx)
    }

    async fn build_template_inner(
        self: &Arc<Self>,
        req: BuildTemplate,
        tx: &mpsc::Sender<TemplateEvent>,
    ) -> Result<TemplateInfo> {
        let shells = req.shells.unwrap_or(DEFAULT_SHELLS);
        let steps = req.run.len() as u64 + 3;
        let mut step = 0;
        let mut next = |tx: &mpsc::Sender<TemplateEvent>, stage: &str, msg: String| {
            step += 1;
            progress(tx, stage, msg, Some(step), Some(steps));
        };
        next(tx, "create", format!("starting a sandbox of image {}", req.image.as_deref().unwrap_or("base")));
        let info = self.create(self.recipe_sandbox(&req)).await?;
        let sid = info.id.clone();
        let built: Result<RecipeRow> = async {
            for cmd in &req.run {
                next(tx, "run", cmd.clone());
                let timeout = req.timeout.unwrap_or(600.0);
                let r = self
                    .run_command(
                        &sid,
                        RunCommand { cmd: Some(cmd.clone()), timeout: Some(timeout), ..Default::default() },
                    )
                    .await?;
                if r.exit_code != Some(0) {
                    let tail: String = format!("{}{}", r.stdout, r.stderr)
                        .lines()
                        .rev()
                        .take(8)
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect::<Vec<_>>()
                        .join("\n");
                    let output = if tail.trim().is_empty() {
                        " It printed nothing.".to_string()
                    } else {
                        format!(" Last output:\n{tail}")
                    };
                    return Err(RuntimeError::BadRequest(format!(
                        "recipe command {cmd:?} {}; fix the recipe.{output}",
                        how_it_ended(&r, timeout)
                    )));
                }
            }
            next(tx, "code", "running the session code".into());
            let code = req.code.clone().unwrap_or_default();
            let r = self
                .run_code(&sid, RunCode { code, timeout: Some(req.timeout.unwrap_or(600.0)), ..Default::default() })
                .await?;
            if let Some(err) = r.error {
                return Err(RuntimeError::BadRequest(format!(
                    "the template's session code failed: {err}; fix the recipe"
                )));
            }
            next(tx, "snapshot", "checkpointing the live session".into());
            let snap = self
                .checkpoint(
                    &sid,
                    CheckpointRequest { label: Some(format!("template {}", req.name)), ..Default::default() },
                )
                .await?;
            // Nothing but the frozen templates (and init) stays in the template's sandbox.
            let sb = self.get(&sid)?;
            self.session_templates.pin_sandbox(&sid);
            let keep = self.session_templates.pids_of(&sid);
            for (_, s) in sb.sessions.lock().await.drain() {
                let _ = crate::sandbox::sessions::kill(&sb, &s).await;
            }
            *sb.default_session.lock().await = None;
            let sbc = sb.clone();
            tokio::task::spawn_blocking(move || {
                crate::sandbox::procs::kill_members(&sbc, |host| {
                    host == sbc.init_pid
                        || bb_sys::process::ns_pids(host)
                            .and_then(|v| v.last().copied())
                            .is_some_and(|p| keep.contains(&p))
                })
            })
            .await
            .map_err(RuntimeError::Worker)??;
            Ok(RecipeRow {
                name: req.name.clone(),
                sandbox_id: sid.clone(),
                snapshot: snap.id,
                image: info.image.clone(),
                shells,
                created_at: now(),
            })
        }
        .await;
        let row = match built {
            Ok(row) => row,
            Err(e) => {
                self.session_templates.unpin_sandbox(&sid);
                let _ = self.kill_unchecked(&sid).await;
                return Err(e);
            }
        };
        if let Some(old) = self.recipe_store()?.put(&row)? {
            self.release_template_sandbox(&old).await;
        }
        self.fork_shells.targets.lock().insert(sid.clone(), shells);
        // Sandboxes of a template are forks of its sessions: make those forks cheap.
        if let Ok(sb) = self.get(&sid) {
            let keys: Vec<(String, i32)> =
                self.session_templates.sessions_of(&sid).into_iter().map(|s| (s.id.clone(), s.pid)).collect();
            for (key, ns_pid) in keys {
                if let Some(host) = sb.cgroup.pids().ok().and_then(|pids| {
                    pids.into_iter()
                        .find(|h| bb_sys::process::ns_pids(*h).and_then(|v| v.last().copied()) == Some(ns_pid))
                }) {
                    self.collapse_template(&key, host);
                }
            }
        }
        if shells > 0 {
            progress(tx, "shells", format!("preparing {shells} sandboxes to hand out"), None, None);
            if let Ok(sb) = self.get(&sid) {
                self.refill_shells(sb, shells);
            }
        }
        Ok(self.template_info(&row))
    }

    /// `create(template=name)`: a live fork of the template's snapshot, with the request's
    /// limits, environment, working directory, metadata and time-out.
    pub(crate) async fn create_from_template(self: &Arc<Self>, name: &str, req: CreateSandbox) -> Result<SandboxInfo> {
        let row = self.template_row(name)?;
        let snap = self.snapshot_row(&row.snapshot)?;
        if let Some(image) = req.image.as_deref() {
            if image != row.image {
                return Err(RuntimeError::BadRequest(format!(
                    "template {name:?} is built on image {:?}, not {image:?}: leave image out",
                    row.image
                )));
            }
        }
        // The template's network unless the request gives one (allow entries alone keep its mode).
        let network = req.network.clone().or_else(|| Some(snap.spec.network.clone()));
        let allow =
            if req.network.is_none() && req.allow.is_empty() { snap.spec.allow.clone() } else { req.allow.clone() };
        let proxy = req.proxy.or(Some(snap.spec.proxy_port.is_some()));
        let proxy_record = req.proxy_record.or(Some(snap.spec.proxy_record));
        let net_limits = req.net_limits.or(Some(snap.spec.net_limits));
        let sudo = req.sudo.or(Some(snap.spec.sudo));
        let (mut spec, timeout, _) = self.validate(CreateSandbox {
            image: Some(row.image.clone()),
            network,
            allow,
            proxy,
            proxy_record,
            net_limits,
            sudo,
            ..req.clone()
        })?;
        // The template's own settings, unless the request sets them.
        spec.layers = snap.spec.layers.clone();
        spec.image_env = snap.spec.image_env.clone();
        if req.env.is_empty() {
            spec.env = snap.spec.env.clone();
        }
        if req.cwd.is_none() {
            spec.cwd = snap.spec.cwd.clone();
        }
        spec.metadata.remove(TEMPLATE_KEY);
        spec.metadata.insert("branchbox.from_template".into(), name.into());
        let not_restored = crate::snapshot::fork::TreesNotRestored::default();
        let (children, _) = self.fork_snapshot(&snap, &spec, 1, timeout, &not_restored).await?;
        for why in not_restored.take() {
            tracing::warn!(template = %name, "a background process was not restored: {why}");
        }
        Ok(children[0].info())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("py-numpy") && valid_name("a.b_c") && valid_name("x"));
        assert!(!valid_name("") && !valid_name(".hidden") && !valid_name("a/b") && !valid_name(&"a".repeat(65)));
    }

    #[test]
    fn recipe_failures_are_described_in_words() {
        let r = |exit_code, signal, timed_out, oom_killed| CommandResult {
            pid: 2,
            exit_code,
            signal,
            stdout: String::new(),
            stderr: String::new(),
            timed_out,
            oom_killed,
            duration: 600.0,
            stdout_truncated: false,
            stderr_truncated: false,
        };
        assert_eq!(how_it_ended(&r(Some(1), None, false, false), 600.0), "exited with status 1");
        assert_eq!(how_it_ended(&r(None, Some(9), false, false), 600.0), "was killed by signal 9");
        assert!(how_it_ended(&r(None, Some(9), true, false), 2.5).starts_with("did not finish within 2.5 s"));
        assert!(how_it_ended(&r(Some(137), None, false, true), 600.0).contains("memory_mb"));
        assert_eq!(how_it_ended(&r(None, None, false, false), 600.0), "ended without an exit status");
    }

    #[test]
    fn records_round_trip_and_replace() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("b.db");
        let st = RecipeStore::open(&db).unwrap();
        let row = RecipeRow {
            name: "t".into(),
            sandbox_id: "sb-1".into(),
            snapshot: "sn-1".into(),
            image: "base".into(),
            shells: 4,
            created_at: 1.0,
        };
        assert_eq!(st.put(&row).unwrap(), None);
        let newer = RecipeRow { sandbox_id: "sb-2".into(), ..row.clone() };
        assert_eq!(st.put(&newer).unwrap(), Some(row));
        assert_eq!(RecipeStore::open(&db).unwrap().all().unwrap(), vec![newer]);
        st.delete("t").unwrap();
        assert_eq!(st.get("t").unwrap(), None);
    }
}
