//! CRIU for branchbox: process trees of a running sandbox dumped into a directory of image files
//! and restored into the same sandbox's namespaces.
//!
//! A *process image* is a plain directory: CRIU's image files, the logs of the dump and restore,
//! and `manifest.json` ([`Manifest`]): which tree it holds (pids as the sandbox sees them), which
//! files it needs from outside (below), the CRIU version, its size. Nothing in it depends on the
//! host it was made on but the layer stack the sandbox stands on, so it can be copied elsewhere
//! as it is.
//!
//! **Namespaces.** CRIU runs as host root in the sandbox's pid, net, uts, ipc and cgroup
//! namespaces (`branchbox-criu-exec`), so it dumps none of those: they stay with the sandbox's
//! init, which is never dumped. It keeps the host's user namespace (reading and restoring seccomp
//! filters takes init-namespace capabilities) and the host's files. The tree's user and mount
//! namespaces differ from CRIU's, so the dump records them; [`inventory`] then marks them as
//! CRIU's own in the image, and the restore joins the sandbox's (`--join-ns user`, `mnt`) instead
//! of making new ones. The result: restored processes are in the sandbox's namespaces and cgroup,
//! children of its init, with their pids, creds and seccomp filters.
//!
//! **Files from outside** ([`External`]). After a root swap (checkpoint, rollback), processes
//! that existed before it still map files (their binary, libraries) and may hold a cwd or open
//! files on the *old* root, a detached mount CRIU cannot find. Log files the daemon opened are on
//! the host. Each such file is marked external at dump (`--external file[mnt:ino]`) and, at
//! restore, opened again by path — in the sandbox's current root, or on the host — and handed to
//! CRIU (`--inherit-fd`). Layers never change, so the same path is the same file; a file that
//! changed since is refused by CRIU's size and build-id checks, with the cause in the error.
//!
//! **Sockets.** A unix socket created outside the sandbox (a session's channel to the daemon)
//! cannot be dumped; callers make such channels internal socket pairs of the dumped process
//! first and take their end back after the restore (`pidfd_getfd`).

mod externals;
pub mod inventory;
pub mod lazy;

pub use externals::{External, Place};
pub use lazy::LazyPages;

use serde::{Deserialize, Serialize};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Oldest CRIU that works here (older ones fail on recent kernels' vDSO).
pub const MIN_VERSION: (u32, u32) = (4, 1);
/// Version of [`Manifest`]'s format.
pub const MANIFEST_FORMAT: u32 = 1;
/// Name of the manifest in an image directory.
pub const MANIFEST: &str = "manifest.json";

#[derive(Debug, Error)]
pub enum CriuError {
    #[error("CRIU not found at {0}: run `make install` (scripts/install-criu.sh builds CRIU {min}.{min2}), or pass --criu", min = MIN_VERSION.0, min2 = MIN_VERSION.1)]
    NotInstalled(PathBuf),
    #[error("CRIU at {path} is version {found}; branchbox needs {min}.{min2} or newer (scripts/install-criu.sh builds one)", min = MIN_VERSION.0, min2 = MIN_VERSION.1)]
    TooOld { path: PathBuf, found: String },
    #[error("helper {0} not found: build it (`make build`)")]
    NoHelper(PathBuf),
    #[error("criu {action} failed{}: {log}", status.map(|s| format!(" (exit {s})")).unwrap_or_default())]
    Failed { action: &'static str, status: Option<i32>, log: String },
    #[error("criu {action} did not finish within {after:?} and was killed")]
    TimedOut { action: String, after: Duration },
    #[error("process image {dir}: {problem}")]
    Image { dir: PathBuf, problem: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl CriuError {
    fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> CriuError {
        let what = what.into();
        move |source| CriuError::Io { what, source }
    }
}

pub type Result<T, E = CriuError> = std::result::Result<T, E>;

/// An installed CRIU and the helper that runs it in a sandbox's namespaces.
#[derive(Debug, Clone)]
pub struct Criu {
    bin: PathBuf,
    exec_helper: PathBuf,
    version: String,
    /// A CRIU run that takes longer is killed and fails ([`CriuError::TimedOut`]).
    timeout: Duration,
}

/// Where CRIU caches what it probed of the kernel (`criu.kdat`; scripts/install-criu.sh builds
/// CRIU with it as its run dir). Without the cache every run probes again (~20 ms here: it makes
/// a veth pair in a new network namespace, among others). CRIU keeps it only on a tmpfs, so the
/// cache goes with a reboot (a new kernel): [`Criu::find`] mounts one there when `/run` is not.
pub const KDAT_DIR: &str = "/run/branchbox-criu";
/// Cache of the runs with `--unprivileged` (restores), which CRIU keeps in `$XDG_RUNTIME_DIR`.
const KDAT_UNPRIVILEGED: &str = "/run/branchbox-criu/unprivileged";

/// Make [`KDAT_DIR`] a tmpfs directory (see there).
fn prepare_kdat_dir() -> std::result::Result<(), String> {
    use nix::sys::statfs::{statfs, TMPFS_MAGIC};
    let dir = Path::new(KDAT_DIR);
    std::fs::create_dir_all(dir).map_err(|e| format!("create {KDAT_DIR}: {e}"))?;
    let fs = statfs(dir).map_err(|e| format!("statfs {KDAT_DIR}: {e}"))?;
    if fs.filesystem_type() != TMPFS_MAGIC {
        nix::mount::mount(
            Some("tmpfs"),
            dir,
            Some("tmpfs"),
            nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV | nix::mount::MsFlags::MS_NOEXEC,
            Some("size=4m,mode=0700"),
        )
        .map_err(|e| format!("mount a tmpfs on {KDAT_DIR}: {e}"))?;
    }
    std::fs::create_dir_all(KDAT_UNPRIVILEGED).map_err(|e| format!("create {KDAT_UNPRIVILEGED}: {e}"))
}

/// Let the program `cmd` runs inherit `fds` (their close-on-exec flag cleared in the child).
fn inherit_fds(cmd: &mut std::process::Command, fds: &[RawFd]) {
    use std::os::unix::process::CommandExt;
    let fds = fds.to_vec();
    // SAFETY: the closure only calls fcntl(2), which is async-signal-safe, on fds it borrows.
    unsafe {
        cmd.pre_exec(move || {
            for fd in &fds {
                if libc::fcntl(*fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Default for how long one CRIU run may take ([`Criu::with_timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The sandbox a tree belongs to.
#[derive(Debug, Clone)]
pub struct SandboxRef {
    /// Host pid of the sandbox's init.
    pub init_pid: i32,
    /// `cgroup.procs` files of the sandbox's cgroup (one per v1 hierarchy, or the v2 one):
    /// restored tasks are placed there.
    pub cgroup_procs: Vec<PathBuf>,
    /// The sandbox's own directory on the host (its logs): files the daemon opened there for a
    /// tree of another sandbox are opened again here when it is restored into this one.
    pub host_dir: Option<PathBuf>,
}

/// The root of a tree to dump.
#[derive(Debug, Clone, Copy)]
pub struct Root {
    pub host_pid: i32,
    /// Its pid in the sandbox.
    pub ns_pid: i32,
}

#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    /// Leave the tree running (a consistent copy); otherwise CRIU kills it once dumped.
    pub leave_running: bool,
    /// What the image holds, for the manifest (e.g. "session-template", "sandbox-tree").
    pub kind: String,
    /// The caller froze the tree in this freezer cgroup (its directory), with the sandbox's
    /// other processes: CRIU seizes the tree there and leaves the cgroup frozen, so several
    /// trees dumped one after the other are one consistent state.
    pub frozen_cgroup: Option<PathBuf>,
    /// More files of the tree to mark external by CRIU's name for them (e.g. `tty[RDEV:DEV]`: a
    /// terminal whose master is outside the tree); the restore must hand each in (`inherit`).
    pub external: Vec<String>,
}

/// A restored tree: its image's manifest and, when restored lazily, the server filling its
/// memory.
#[derive(Debug)]
pub struct Restored {
    pub manifest: Manifest,
    pub lazy: Option<LazyPages>,
}

/// What an image directory holds (`manifest.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub kind: String,
    /// `criu --version` of the dump.
    pub criu: String,
    /// Pid of the tree's root in the sandbox; `tasks`: every process of the tree.
    pub root_ns_pid: i32,
    pub tasks: Vec<i32>,
    pub externals: Vec<External>,
    /// Bytes of the image files.
    pub bytes: u64,
    /// Every image file (name in the directory) and its length: [`Manifest::verify`] refuses an
    /// image whose files were lost or changed since the dump.
    #[serde(default)]
    pub files: std::collections::BTreeMap<String, u64>,
    pub dump_ms: f64,
    pub created_at: f64,
    /// The dumped sandbox's directory on the host ([`SandboxRef::host_dir`]).
    #[serde(default)]
    pub host_dir: Option<PathBuf>,
}

impl Manifest {
    pub fn read(dir: &Path) -> Result<Manifest> {
        let text = std::fs::read_to_string(dir.join(MANIFEST)).map_err(|e| CriuError::Image {
            dir: dir.to_path_buf(),
            problem: format!("no readable {MANIFEST} ({e}): a dump that did not finish"),
        })?;
        let m: Manifest = serde_json::from_str(&text)
            .map_err(|e| CriuError::Image { dir: dir.to_path_buf(), problem: format!("{MANIFEST}: {e}") })?;
        if m.format != MANIFEST_FORMAT {
            return Err(CriuError::Image {
                dir: dir.to_path_buf(),
                problem: format!("format {} (this daemon reads {MANIFEST_FORMAT})", m.format),
            });
        }
        Ok(m)
    }

    /// Check that `dir` still holds every file of this image at its length.
    pub fn verify(&self, dir: &Path) -> Result<()> {
        for (name, len) in &self.files {
            let problem = match std::fs::metadata(dir.join(name)) {
                Ok(m) if m.len() == *len => continue,
                Ok(m) => format!("{name} is {} bytes, the dump wrote {len}: the image is damaged", m.len()),
                Err(e) => format!("{name} cannot be read ({e}): the image is incomplete"),
            };
            return Err(CriuError::Image { dir: dir.to_path_buf(), problem });
        }
        Ok(())
    }

    fn write(&self, dir: &Path) -> Result<()> {
        let tmp = dir.join(format!("{MANIFEST}.tmp"));
        let text = serde_json::to_vec_pretty(self).expect("manifest serializes");
        std::fs::write(&tmp, text).map_err(CriuError::io("write the manifest"))?;
        std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(CriuError::io("sync the manifest"))?;
        std::fs::rename(&tmp, dir.join(MANIFEST)).map_err(CriuError::io("write the manifest"))
    }
}

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// `(major, minor)` from `criu --version` output ("Version: 4.1.1").
fn parse_version(text: &str) -> Option<(u32, u32, String)> {
    let v = text.lines().find_map(|l| l.strip_prefix("Version:"))?.trim().to_string();
    let mut parts = v.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().unwrap_or("0").parse().ok()?;
    Some((major, minor, v))
}

/// What a CRIU log says went wrong, in at most `n` lines: its first error line (the cause: the
/// errors after it are mostly its consequences in the other tasks, in whatever order they ran)
/// and the last ones; the log's last lines when it has no error line.
fn log_tail(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    // "Can't setup RLIMIT_NOFILE" is CRIU's own harmless complaint in a user namespace.
    let errors: Vec<&str> = text.lines().filter(|l| l.contains("Error") && !l.contains("RLIMIT_NOFILE")).collect();
    let lines: Vec<&str> = if errors.is_empty() {
        text.lines().rev().take(n).collect::<Vec<_>>().into_iter().rev().collect()
    } else if errors.len() > n && n > 1 {
        std::iter::once(errors[0]).chain(errors[errors.len() - (n - 1)..].iter().copied()).collect()
    } else {
        errors[errors.len().saturating_sub(n)..].to_vec()
    };
    lines.join(" | ")
}

/// The image files CRIU wrote in `dir` (`*.img`) and their lengths.
fn image_files(dir: &Path) -> Result<std::collections::BTreeMap<String, u64>> {
    let mut files = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(dir).map_err(CriuError::io(format!("list {}", dir.display())))? {
        let e = e.map_err(CriuError::io(format!("list {}", dir.display())))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".img") {
            let len = e.metadata().map_err(CriuError::io(format!("stat {name}")))?.len();
            files.insert(name, len);
        }
    }
    Ok(files)
}

fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

impl Criu {
    /// The CRIU at `bin` (>= [`MIN_VERSION`]) and the helper at `exec_helper`.
    pub fn find(bin: &Path, exec_helper: &Path) -> Result<Criu> {
        if !bin.is_file() {
            return Err(CriuError::NotInstalled(bin.to_path_buf()));
        }
        if !exec_helper.is_file() {
            return Err(CriuError::NoHelper(exec_helper.to_path_buf()));
        }
        let out = std::process::Command::new(bin)
            .arg("--version")
            .output()
            .map_err(CriuError::io(format!("run {} --version", bin.display())))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let (major, minor, version) = parse_version(&text)
            .ok_or_else(|| CriuError::TooOld { path: bin.to_path_buf(), found: text.trim().to_string() })?;
        if (major, minor) < MIN_VERSION {
            return Err(CriuError::TooOld { path: bin.to_path_buf(), found: version });
        }
        if let Err(e) = prepare_kdat_dir() {
            tracing::warn!("CRIU will probe the kernel on every run (slower): {e}");
        }
        Ok(Criu { bin: bin.to_path_buf(), exec_helper: exec_helper.to_path_buf(), version, timeout: DEFAULT_TIMEOUT })
    }

    /// The same CRIU, with runs killed after `timeout` instead of [`DEFAULT_TIMEOUT`].
    pub fn with_timeout(self, timeout: Duration) -> Criu {
        Criu { timeout, ..self }
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// Run CRIU with `args` in `sandbox`'s namespaces, `keep` fds inherited. Returns its exit
    /// status. `restoring`: the pids of the tasks a restore makes, which CRIU must not take.
    fn run(
        &self,
        sandbox: &SandboxRef,
        join_cgroup: bool,
        args: &[String],
        keep: &[RawFd],
        restoring: &[i32],
    ) -> Result<Option<i32>> {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new(&self.exec_helper);
        cmd.arg(sandbox.init_pid.to_string());
        if join_cgroup {
            for f in &sandbox.cgroup_procs {
                cmd.arg("--cgroup-procs").arg(f);
            }
        }
        if let Some(top) = restoring.iter().max() {
            cmd.arg("--pids-above").arg(top.to_string());
        }
        cmd.arg("--").arg(&self.bin).args(args);
        cmd.env("XDG_RUNTIME_DIR", KDAT_UNPRIVILEGED);
        cmd.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped());
        inherit_fds(&mut cmd, keep);
        // Its own process group, so a CRIU that hangs is killed with the helper that started it.
        cmd.process_group(0);
        let mut child = cmd.spawn().map_err(CriuError::io(format!("run {}", self.exec_helper.display())))?;
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
            text
        });
        let pid = child.id() as i32;
        // A wait that cannot be set up counts as a timeout: the run is killed, never left behind.
        let exited = bb_sys::process::pidfd_open(pid)
            .and_then(|fd| bb_sys::process::pidfd_wait_exit(&fd, self.timeout))
            .unwrap_or_else(|e| {
                tracing::warn!("cannot wait for criu (pid {pid}): {e}");
                false
            });
        if !exited {
            let _ = bb_sys::process::kill_group(pid, libc::SIGKILL);
        }
        let status = child.wait().map_err(CriuError::io("wait for criu"))?;
        let stderr = reader.join().unwrap_or_default();
        if !status.success() && !stderr.is_empty() {
            tracing::debug!("criu: {}", stderr.trim());
        }
        if !exited {
            return Err(CriuError::TimedOut { action: args.first().cloned().unwrap_or_default(), after: self.timeout });
        }
        Ok(status.code())
    }

    /// Dump the tree rooted at `root` of `sandbox` into `dir` (made here; it must not exist).
    /// Unless `opts.leave_running`, the tree is gone afterwards (CRIU kills it once dumped).
    pub fn dump(&self, sandbox: &SandboxRef, root: Root, dir: &Path, opts: &DumpOptions) -> Result<Manifest> {
        let t0 = Instant::now();
        let found = externals::collect(root.host_pid)?;
        std::fs::create_dir(dir).map_err(CriuError::io(format!("create {}", dir.display())))?;
        let mut args: Vec<String> = [
            "dump",
            "--tree",
            &root.ns_pid.to_string(),
            "--images-dir",
            &dir.to_string_lossy(),
            "--log-file",
            "dump.log",
            "-v4",
            "--shell-job",
            "--manage-cgroups=ignore",
            "--external",
            "mnt[]:sm",
            "--tcp-established",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if opts.leave_running {
            args.push("--leave-running".into());
        }
        if let Some(cg) = &opts.frozen_cgroup {
            args.push("--freeze-cgroup".into());
            args.push(cg.to_string_lossy().into_owned());
        }
        for key in found.externals.iter().map(|e| &e.key).chain(&opts.external) {
            args.push("--external".into());
            args.push(key.clone());
        }
        let status = self.run(sandbox, false, &args, &[], &[])?;
        if status != Some(0) {
            return Err(CriuError::Failed { action: "dump", status, log: log_tail(&dir.join("dump.log"), 6) });
        }
        inventory::adopt_namespaces(dir, root.ns_pid)?;
        let manifest = Manifest {
            format: MANIFEST_FORMAT,
            kind: opts.kind.clone(),
            criu: self.version.clone(),
            root_ns_pid: root.ns_pid,
            tasks: found.ns_pids,
            externals: found.externals,
            bytes: dir_bytes(dir),
            files: image_files(dir)?,
            dump_ms: t0.elapsed().as_secs_f64() * 1000.0,
            created_at: now(),
            host_dir: sandbox.host_dir.clone(),
        };
        manifest.write(dir)?;
        Ok(manifest)
    }

    /// Restore the tree imaged in `dir` into `sandbox` (its namespaces and cgroup; its init
    /// becomes the tree root's parent). Files the image needs from outside are opened again by
    /// path ([`External`]). The pids of the tree must be free in the sandbox. With `lazy`, the
    /// tree runs before its memory is copied in ([`lazy`]): the returned server fills it.
    /// `inherit`: fds that take the place of files of the tree by CRIU's name for them (e.g.
    /// `pipe:[INODE]`: a pipe whose other end was outside the tree). `work`: where CRIU writes
    /// its log (`restore.log`) and stats, so that several eager restores of one image can run at
    /// once; `dir` when None. A lazy restore always works in `dir` (its server's socket is there).
    pub fn restore(
        &self,
        sandbox: &SandboxRef,
        dir: &Path,
        lazy: bool,
        inherit: &[(RawFd, String)],
        work: Option<&Path>,
    ) -> Result<Restored> {
        let work = if lazy { dir } else { work.unwrap_or(dir) };
        let manifest = Manifest::read(dir)?;
        manifest.verify(dir)?;
        let mut held: Vec<OwnedFd> = Vec::new();
        let mut args: Vec<String> = [
            "restore",
            "--images-dir",
            &dir.to_string_lossy(),
            "--work-dir",
            &work.to_string_lossy(),
            "--log-file",
            "restore.log",
            "-v4",
            "--restore-detached",
            "--shell-job",
            "--manage-cgroups=ignore",
            "--tcp-established",
            // As root, but in a user namespace: socket buffer sizes without SO_*BUFFORCE.
            "--unprivileged",
            "--join-ns",
            "user:1,0,0",
            "--join-ns",
            "mnt:1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // A tree of another sandbox (a pulled image, a fork's restore): what the daemon opened
        // in that sandbox's dir is opened again in this one's.
        let moved = match (&manifest.host_dir, &sandbox.host_dir) {
            (Some(from), Some(to)) if from != to => Some((from.as_path(), to.as_path())),
            _ => None,
        };
        for e in &manifest.externals {
            let fd = e.open_moved(sandbox.init_pid, moved).map_err(|source| CriuError::Image {
                dir: dir.to_path_buf(),
                problem: format!("{} ({}) cannot be opened again: {source}", e.path.display(), e.place.describe()),
            })?;
            args.push("--inherit-fd".into());
            args.push(format!("fd[{}]:{}", fd.as_raw_fd(), e.key));
            held.push(fd);
        }
        let _ = std::fs::remove_file(work.join("restore.log"));
        let t0 = Instant::now();
        // Started together: the restore waits for the server's socket.
        let server = if lazy {
            args.push("--lazy-pages".into());
            Some(LazyPages::spawn(&self.bin, dir)?)
        } else {
            None
        };
        for (fd, key) in inherit {
            args.push("--inherit-fd".into());
            args.push(format!("fd[{fd}]:{key}"));
        }
        let keep: Vec<RawFd> = held.iter().map(|f| f.as_raw_fd()).chain(inherit.iter().map(|(fd, _)| *fd)).collect();
        let status = self.run(sandbox, true, &args, &keep, &manifest.tasks);
        tracing::debug!(took = ?t0.elapsed(), lazy, "criu restore");
        let restored = match status {
            Ok(Some(0)) => None,
            Ok(status) => {
                Some(CriuError::Failed { action: "restore", status, log: log_tail(&work.join("restore.log"), 6) })
            }
            Err(e) => Some(e),
        };
        match (server, restored) {
            (None, None) => Ok(Restored { manifest, lazy: None }),
            (None, Some(e)) => Err(e),
            (Some(s), None) => Ok(Restored { manifest, lazy: Some(s.ready()?) }),
            // What the server said, if it failed too (the cause, or a consequence).
            (Some(s), Some(e)) => match (s.kill(), e) {
                (Some(why), CriuError::Failed { action, status, log }) => {
                    Err(CriuError::Failed { action, status, log: format!("{log} | lazy-pages server: {why}") })
                }
                (_, e) => Err(e),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_criu_output() {
        assert_eq!(parse_version("Version: 4.1.1\n"), Some((4, 1, "4.1.1".into())));
        assert_eq!(parse_version("Version: 3.17\nGitID: x\n"), Some((3, 17, "3.17".into())));
        assert_eq!(parse_version("nonsense"), None);
    }

    #[test]
    fn a_missing_criu_says_how_to_get_one() {
        let e = Criu::find(Path::new("/nonexistent/criu"), Path::new("/bin/true")).unwrap_err();
        assert!(e.to_string().contains("install-criu.sh"), "{e}");
    }

    #[test]
    fn the_log_tail_keeps_errors_but_not_the_rlimit_noise() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("x.log");
        std::fs::write(&log, "(0.1) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE\n(0.2) fine\n(0.3) Error (criu/files-reg.c:1): Can't open x\n").unwrap();
        assert_eq!(log_tail(&log, 6), "(0.3) Error (criu/files-reg.c:1): Can't open x");
    }

    #[test]
    fn the_log_tail_keeps_the_first_error_when_more_follow() {
        // A restore that missed a file: the other tasks' errors came after the cause.
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("x.log");
        let errors: Vec<String> = (0..8).map(|i| format!("({i}) Error (criu/x.c:{i}): e{i}")).collect();
        std::fs::write(&log, format!("(start) fine\n{}\n(end) fine\n", errors.join("\n"))).unwrap();
        let tail = log_tail(&log, 4);
        assert_eq!(tail, [&errors[0], &errors[5], &errors[6], &errors[7]].map(|s| s.as_str()).join(" | "));
        assert_eq!(log_tail(&log, 8), errors.join(" | "));
        std::fs::write(&log, "a\nb\nc\n").unwrap();
        assert_eq!(log_tail(&log, 2), "b | c");
    }

    #[test]
    fn a_manifest_round_trips_and_an_unfinished_image_is_refused() {
        let d = tempfile::tempdir().unwrap();
        assert!(Manifest::read(d.path()).unwrap_err().to_string().contains("did not finish"));
        let m = Manifest {
            format: MANIFEST_FORMAT,
            kind: "session-template".into(),
            criu: "4.1.1".into(),
            root_ns_pid: 3,
            tasks: vec![3],
            externals: vec![],
            bytes: 10,
            files: [("pages-1.img".to_string(), 4096)].into_iter().collect(),
            dump_ms: 1.5,
            created_at: 2.0,
            host_dir: None,
        };
        m.write(d.path()).unwrap();
        assert_eq!(Manifest::read(d.path()).unwrap(), m);
    }

    #[test]
    fn a_damaged_or_incomplete_image_is_refused_before_criu_runs() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("pages-1.img"), vec![0u8; 4096]).unwrap();
        std::fs::write(d.path().join("core-3.img"), b"core").unwrap();
        let files = image_files(d.path()).unwrap();
        assert_eq!(files.len(), 2);
        let m = Manifest {
            format: MANIFEST_FORMAT,
            kind: "sandbox-tree".into(),
            criu: "4.1.1".into(),
            root_ns_pid: 3,
            tasks: vec![3],
            externals: vec![],
            bytes: 0,
            files,
            dump_ms: 0.0,
            created_at: 0.0,
            host_dir: None,
        };
        m.verify(d.path()).unwrap();
        std::fs::write(d.path().join("pages-1.img"), vec![0u8; 100]).unwrap();
        let e = m.verify(d.path()).unwrap_err().to_string();
        assert!(e.contains("pages-1.img is 100 bytes, the dump wrote 4096"), "{e}");
        std::fs::write(d.path().join("pages-1.img"), vec![0u8; 4096]).unwrap();
        std::fs::remove_file(d.path().join("core-3.img")).unwrap();
        let e = m.verify(d.path()).unwrap_err().to_string();
        assert!(e.contains("core-3.img cannot be read") && e.contains("incomplete"), "{e}");
    }
}
