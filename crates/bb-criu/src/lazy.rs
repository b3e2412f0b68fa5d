//! Lazy restores: the restored tree's memory is filled in after it runs.
//!
//! `criu restore --lazy-pages` builds the tree without reading its pages: each task's private
//! anonymous memory is registered with a userfaultfd, handed to a `criu lazy-pages` server
//! started beforehand on the same image. The server copies a page in when the task touches it
//! and, once the restore is over, copies all the others in the background; it exits when every
//! task has all of its memory (or has exited). A restore then costs the process tree, not its
//! memory. Forks of a lazily restored task (a session template forking a session) are followed
//! by the server (`UFFD_FEATURE_EVENT_FORK`): the child gets the pages its parent had not
//! received yet from the image too.
//!
//! Until the server is done the tree depends on it: it runs outside the daemon's process group
//! (a daemon killed with SIGKILL leaves it finishing its copy), and a dump of the same processes
//! must wait for it ([`LazyPages::wait`]). Tasks restored into the sandbox's user namespace make
//! their userfaultfd through `/dev/userfaultfd`, opened by CRIU as root (our CRIU patch 0004), so
//! the host keeps `vm.unprivileged_userfaultfd = 0`.

use crate::{inherit_fds, log_tail, CriuError, Result};
use parking_lot::{Condvar, Mutex};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Name of the lazy-pages server's log in the image directory.
pub const LAZY_LOG: &str = "lazy-pages.log";
/// How long a lazy-pages server may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether this kernel lets CRIU restore lazily: userfaultfd through `/dev/userfaultfd`.
pub fn supported() -> std::result::Result<(), String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
        .map(drop)
        .map_err(|e| format!("/dev/userfaultfd cannot be opened ({e}; it needs Linux 6.1 or newer)"))
}

#[derive(Debug, Default)]
struct State {
    /// `None` while the server runs; then `Ok` or what went wrong.
    outcome: Option<std::result::Result<(), String>>,
    took: Option<Duration>,
}

/// A running (or finished) `criu lazy-pages` server of one restore.
#[derive(Debug, Clone)]
pub struct LazyPages {
    pid: i32,
    dir: PathBuf,
    state: Arc<(Mutex<State>, Condvar)>,
}

/// A server just started: [`Starting::ready`] says whether it listens for the restore (which
/// may be started meanwhile: it waits for the server's socket, CRIU patch 0004).
pub(crate) struct Starting {
    server: LazyPages,
    ready: std::os::fd::OwnedFd,
}

impl Starting {
    /// Wait until the server listens (up to a few seconds); Err: what its log says instead.
    pub(crate) fn ready(self) -> Result<LazyPages> {
        let mut byte = [0u8; 1];
        let fds = &mut [nix::poll::PollFd::new(self.ready.as_fd(), nix::poll::PollFlags::POLLIN)];
        let timeout = nix::poll::PollTimeout::try_from(START_TIMEOUT).unwrap_or(nix::poll::PollTimeout::MAX);
        let got = match nix::poll::poll(fds, timeout) {
            Ok(n) if n > 0 => nix::unistd::read(self.ready.as_raw_fd(), &mut byte).unwrap_or(0),
            _ => 0,
        };
        if got == 1 {
            return Ok(self.server);
        }
        self.server.kill();
        let _ = self.server.wait(Duration::from_secs(5));
        Err(CriuError::Failed { action: "lazy-pages", status: None, log: log_tail(&self.server.dir.join(LAZY_LOG), 6) })
    }

    /// Stop it (the restore it was for failed). Returns why it had failed itself, if it had.
    pub(crate) fn kill(self) -> Option<String> {
        let failed = self.server.outcome().and_then(|o| o.err());
        self.server.kill();
        failed
    }
}

impl LazyPages {
    /// Start a server for the image in `dir` and wait until it listens.
    #[cfg(test)]
    fn start(bin: &Path, dir: &Path) -> Result<LazyPages> {
        LazyPages::spawn(bin, dir)?.ready()
    }

    /// Start a server for the image in `dir`.
    pub(crate) fn spawn(bin: &Path, dir: &Path) -> Result<Starting> {
        use std::os::unix::process::CommandExt;
        let _ = std::fs::remove_file(dir.join("lazy-pages.socket"));
        let _ = std::fs::remove_file(dir.join(LAZY_LOG));
        let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| CriuError::Io { what: "make a pipe".into(), source: e.into() })?;
        let status_fd = ready_w.as_raw_fd();
        let mut cmd = std::process::Command::new(bin);
        cmd.arg("lazy-pages")
            .arg("--images-dir")
            .arg(dir)
            .args(["--log-file", LAZY_LOG, "-v2", "--status-fd", &status_fd.to_string()])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            // Not in the daemon's group: a daemon killed with SIGKILL must leave it copying.
            .process_group(0);
        inherit_fds(&mut cmd, &[status_fd]);
        let t0 = Instant::now();
        let mut child = cmd.spawn().map_err(CriuError::io(format!("run {} lazy-pages", bin.display())))?;
        drop(ready_w);
        let pid = child.id() as i32;
        let state: Arc<(Mutex<State>, Condvar)> = Arc::default();
        let (st, log) = (state.clone(), dir.join(LAZY_LOG));
        std::thread::Builder::new()
            .name(format!("criu-lazy-{pid}"))
            .spawn(move || {
                let outcome = match child.wait() {
                    Ok(s) if s.success() => Ok(()),
                    Ok(s) => Err(format!("criu lazy-pages exited with {s}: {}", log_tail(&log, 4))),
                    Err(e) => Err(format!("cannot wait for criu lazy-pages: {e}")),
                };
                if let Err(why) = &outcome {
                    // Pages it had not copied read as zeroes in the tree it served.
                    tracing::error!(pid, "a lazily restored process tree may have lost memory: {why}");
                }
                let mut g = st.0.lock();
                g.outcome = Some(outcome);
                g.took = Some(t0.elapsed());
                st.1.notify_all();
            })
            .map_err(CriuError::io("start a thread"))?;
        Ok(Starting { server: LazyPages { pid, dir: dir.to_path_buf(), state }, ready: ready_r })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// `None` while it copies; then whether every page was copied in.
    pub fn outcome(&self) -> Option<std::result::Result<(), String>> {
        self.state.0.lock().outcome.clone()
    }

    /// How long the server ran, once it is done.
    pub fn took(&self) -> Option<Duration> {
        self.state.0.lock().took
    }

    /// Wait up to `timeout` for the server to finish; `None` if it still runs.
    pub fn wait(&self, timeout: Duration) -> Option<std::result::Result<(), String>> {
        let deadline = Instant::now() + timeout;
        let mut g = self.state.0.lock();
        while g.outcome.is_none() {
            if self.state.1.wait_until(&mut g, deadline).timed_out() {
                break;
            }
        }
        g.outcome.clone()
    }

    /// Stop the server (a restore that failed: no tree needs it).
    pub(crate) fn kill(&self) {
        if self.outcome().is_none() {
            let _ = bb_sys::process::kill(self.pid, libc::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in for `criu lazy-pages`: runs `body` with `$FD` the status fd.
    fn fake_criu(dir: &Path, body: &str) -> PathBuf {
        let bin = dir.join("criu");
        let script =
            format!("#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = --status-fd ] && FD=$2; shift; done\n{body}\n");
        std::fs::write(&bin, script).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        bin
    }

    #[test]
    fn a_server_that_never_listens_fails_the_start_with_its_log() {
        let d = tempfile::tempdir().unwrap();
        let bin =
            fake_criu(d.path(), &format!("echo 'Error (uffd.c): no uffd' > {}/{LAZY_LOG}; exit 1", d.path().display()));
        let e = LazyPages::start(&bin, d.path()).unwrap_err().to_string();
        assert!(e.contains("lazy-pages") && e.contains("no uffd"), "{e}");
    }

    #[test]
    fn a_server_is_followed_until_it_exits_and_its_failure_is_kept() {
        let d = tempfile::tempdir().unwrap();
        let ok = LazyPages::start(&fake_criu(d.path(), "printf '\\0' >&$FD; sleep 0.2"), d.path()).unwrap();
        assert!(ok.outcome().is_none(), "it still copies");
        assert_eq!(ok.wait(Duration::from_secs(10)), Some(Ok(())));
        assert!(ok.took().is_some());
        let bad = LazyPages::start(&fake_criu(d.path(), "printf '\\0' >&$FD; exit 3"), d.path()).unwrap();
        let why = bad.wait(Duration::from_secs(10)).unwrap().unwrap_err();
        assert!(why.contains("exit status: 3"), "{why}");
    }
}
