//! `branchbox-init`: PID 1 of every sandbox.
//!
//! The daemon clones this process into new user, mount, pid, uts, ipc, net and cgroup namespaces
//! (uid 0 inside maps to an unprivileged host uid) and execs it with:
//! - env `BRANCHBOX_INIT_CONFIG`: an [`bb_proto::InitConfig`] as JSON,
//! - fd 3: a listening `SOCK_SEQPACKET` socket (bound by the daemon on a host path),
//! - fd 4: a status pipe on which init writes `ok` or `error: <why>` once set up.
//!
//! Set-up ([`setup`]): private mounts, bind of the overlay root, fresh /proc (with Docker's read-only
//! and masked paths), a minimal /dev, read-only /sys, pivot_root, hostname, loopback up.
//! Then init serves requests ([`server`]): spawn a process (stdio fds arrive with the request),
//! wait, kill, list. Each spawned process gets a new session, Docker's default capability set,
//! no_new_privs and the seccomp policy before it execs. Init itself stays single-threaded and
//! non-dumpable, so sandbox processes (which lose CAP_SYS_PTRACE) cannot ptrace it.

mod server;
mod setup;
mod spawn;

use std::io::Write;
use std::os::fd::FromRawFd;

fn main() {
    // SAFETY: fd 4 is the status pipe the daemon handed us; we own it from here on.
    let mut status = unsafe { std::fs::File::from_raw_fd(bb_proto::INIT_STATUS_FD) };
    let result = run_setup();
    match result {
        Ok(policy) => {
            let _ = status.write_all(b"ok\n");
            drop(status);
            server::Server::new(policy).run();
        }
        Err(e) => {
            let _ = writeln!(status, "error: {e}");
            eprintln!("branchbox-init: set-up failed: {e}");
            std::process::exit(1);
        }
    }
}

fn run_setup() -> Result<bb_isolation::SeccompFilter, String> {
    // The config comes in the environment, which (unlike argv) sandbox processes cannot read:
    // init is non-dumpable, so its /proc/1/environ is closed to them. Nothing else is inherited.
    let arg = std::env::var(bb_proto::INIT_CONFIG_ENV).map_err(|_| "missing config in the environment")?;
    let config: bb_proto::InitConfig =
        serde_json::from_str(&arg).map_err(|e| format!("bad config: {e}"))?;
    for (k, _) in std::env::vars_os() {
        std::env::remove_var(k);
    }
    // Close everything we were not meant to inherit (keep stdio, listener, status pipe).
    bb_sys::process::close_fds_from(5).map_err(|e| e.to_string())?;
    setup::setup(&config).map_err(|e| e.to_string())?;
    // Init needs no privilege once the sandbox is built: reduce it (and so every process it
    // spawns, which inherits the bounding set and no_new_privs) to Docker's default capabilities.
    bb_isolation::drop_capabilities().map_err(|e| e.to_string())?;
    bb_isolation::set_no_new_privs().map_err(|e| e.to_string())?;
    // Compile the policy once; children apply it right before execve.
    bb_isolation::SeccompFilter::default_policy().map_err(|e| e.to_string())
}
