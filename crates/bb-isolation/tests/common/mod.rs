//! Helpers for the root integration tests: forked children with a start gate and a result pipe,
//! and cgroups that are cleaned up even when an assertion fails.
#![allow(dead_code)]

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bb_isolation::{Cgroup, CgroupLayout, Limits};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, pipe, ForkResult, Pid};

/// These tests create cgroups and install seccomp filters: without root they must fail, not skip.
pub fn require_root() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "bb-isolation integration tests need root (they create cgroups, move processes and \
         install seccomp filters); run `cargo test` as root"
    );
}

/// A parent group unique to this test process and call, e.g. "bbtest-4242-3".
pub fn unique_parent() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("bbtest-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst))
}

/// Owns a parent group: on drop, destroys every group under it and removes it.
pub struct ParentGuard {
    pub layout: CgroupLayout,
}

impl ParentGuard {
    pub fn new() -> ParentGuard {
        require_root();
        let layout = CgroupLayout::detect(&unique_parent())
            .unwrap_or_else(|e| panic!("cgroup detection failed (a prerequisite): {e}"));
        ParentGuard { layout }
    }

    /// The parent's directory in every hierarchy.
    pub fn parent_dirs(&self) -> Vec<PathBuf> {
        self.layout.roots().iter().map(|(_, r)| r.join(self.layout.parent())).collect()
    }
}

impl Drop for ParentGuard {
    fn drop(&mut self) {
        for name in self.layout.list().unwrap_or_default() {
            if let Ok(cg) = Cgroup::open(&self.layout, &name) {
                if let Err(e) = cg.destroy() {
                    eprintln!("cleanup: destroying {name} failed: {e}");
                }
            }
        }
        if let Err(e) = self.layout.remove_parent() {
            eprintln!("cleanup: removing parent failed: {e}");
        }
    }
}

/// A parent guard plus one group under it.
pub struct TestGroup {
    pub cg: Cgroup,
    pub guard: ParentGuard,
}

impl TestGroup {
    pub fn new(name: &str, limits: Limits) -> TestGroup {
        let guard = ParentGuard::new();
        let cg = Cgroup::create(&guard.layout, name, &limits).unwrap_or_else(|e| panic!("creating cgroup {name}: {e}"));
        TestGroup { cg, guard }
    }
}

/// A pipe whose read end is non-blocking.
pub struct Pipe {
    pub read: OwnedFd,
    pub write: OwnedFd,
}

pub fn new_pipe() -> Pipe {
    let (read, write) = pipe().expect("pipe");
    nix::fcntl::fcntl(read.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK))
        .expect("O_NONBLOCK");
    Pipe { read, write }
}

/// write(2) all of `buf` (child side: no allocation, no panics).
pub fn raw_write(fd: RawFd, buf: &[u8]) -> bool {
    let mut off = 0;
    while off < buf.len() {
        // SAFETY: writes from a live slice of the stated length.
        let n = unsafe { libc::write(fd, buf[off..].as_ptr().cast(), buf.len() - off) };
        if n <= 0 {
            return false;
        }
        off += n as usize;
    }
    true
}

/// Read exactly `n` bytes from a non-blocking fd, failing the test after `timeout`.
pub fn read_exact_timeout(fd: &OwnedFd, n: usize, timeout: Duration) -> Vec<u8> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::with_capacity(n);
    let mut buf = vec![0u8; n];
    while out.len() < n {
        match nix::unistd::read(fd.as_raw_fd(), &mut buf[..n - out.len()]) {
            Ok(0) => panic!("pipe closed after {} of {n} bytes (child died?)", out.len()),
            Ok(k) => out.extend_from_slice(&buf[..k]),
            Err(nix::errno::Errno::EAGAIN) => {
                assert!(Instant::now() < deadline, "timed out reading {n} bytes, got {}", out.len());
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("read: {e}"),
        }
    }
    out
}

/// Everything currently buffered in a non-blocking pipe.
pub fn drain(fd: &OwnedFd) -> usize {
    let mut buf = [0u8; 4096];
    let mut total = 0;
    loop {
        match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
            Ok(0) | Err(nix::errno::Errno::EAGAIN) => return total,
            Ok(k) => total += k,
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// A forked child that waits for [`Child::release`] before running its body, so the parent can
/// first move it into a cgroup. The body's return value is the exit code.
pub struct Child {
    pub pid: Pid,
    gate: Option<OwnedFd>,
    reaped: bool,
}

pub fn fork_gated(body: impl FnOnce() -> i32) -> Child {
    let (gate_r, gate_w) = pipe().expect("pipe");
    // SAFETY: the child only runs `body` (test code written for a post-fork child: raw
    // syscalls, no locks held by other threads) and then _exit()s; it never returns into the
    // test harness.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            drop(gate_w);
            let mut b = [0u8; 1];
            // SAFETY: one-byte read into a stack buffer.
            let n = unsafe { libc::read(gate_r.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
            let code = if n == 1 {
                // Never unwind back into the (forked copy of the) test harness.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).unwrap_or(101)
            } else {
                120
            };
            // SAFETY: terminate the child without running the parent's atexit handlers.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => {
            drop(gate_r);
            Child { pid: child, gate: Some(gate_w), reaped: false }
        }
    }
}

impl Child {
    pub fn pid(&self) -> i32 {
        self.pid.as_raw()
    }

    pub fn release(&mut self) {
        let gate = self.gate.take().expect("released twice");
        assert!(raw_write(gate.as_raw_fd(), b"g"), "cannot release child");
    }

    /// waitpid with a timeout (the child is SIGKILLed if it does not finish).
    pub fn wait(&mut self, timeout: Duration) -> WaitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            let st = waitpid(self.pid, Some(nix::sys::wait::WaitPidFlag::WNOHANG)).expect("waitpid");
            if st != WaitStatus::StillAlive {
                self.reaped = true;
                return st;
            }
            if Instant::now() >= deadline {
                let _ = nix::sys::signal::kill(self.pid, nix::sys::signal::Signal::SIGKILL);
                let st = waitpid(self.pid, None);
                self.reaped = true;
                panic!("child {} did not finish within {timeout:?} (then: {st:?})", self.pid);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if !self.reaped {
            let _ = nix::sys::signal::kill(self.pid, nix::sys::signal::Signal::SIGKILL);
            let _ = waitpid(self.pid, None);
        }
    }
}

/// errno of the last failed libc call.
pub fn errno() -> i32 {
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// A `Cap*:` or other hex/decimal field of a /proc/<pid>/status text.
pub fn status_field(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(':')))
        .unwrap_or_else(|| panic!("no {key} in status:\n{status}"))
        .trim()
        .to_owned()
}

pub fn status_hex(status: &str, key: &str) -> u64 {
    u64::from_str_radix(&status_field(status, key), 16).unwrap()
}

pub fn own_status() -> String {
    fs::read_to_string("/proc/self/status").unwrap()
}
