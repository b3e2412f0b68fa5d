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
//! wait, kill, list, and start nested sandboxes for forks ([`nest`]). Each spawned process gets a
//! new session, Docker's default capability set, no_new_privs and the seccomp policy before it
//! execs. Init itself keeps its capabilities (it makes namespaces for nested sandboxes), stays
//! single-threaded and is non-dumpable from its first instruction, so sandbox processes (which
//! lack CAP_SYS_PTRACE) cannot ptrace it or read its memory.

mod nest;
mod server;
mod setup;
mod spawn;

use std::io::Write;
use std::os::fd::FromRawFd;

fn main() {
    // Before anything else: sandbox processes run as our uid and must never attach to us.
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    let status = status_pipe();
    serve(status, read_config().and_then(|c| setup_and_policy(&c, None)))
}

/// The status pipe the daemon handed us (fd 4).
fn status_pipe() -> std::fs::File {
    // SAFETY: fd 4 is the status pipe; we own it from here on.
    unsafe { std::fs::File::from_raw_fd(bb_proto::INIT_STATUS_FD) }
}

/// Report the set-up's outcome on the status pipe; serve forever, or exit on failure.
fn serve(mut status: std::fs::File, setup: Result<bb_isolation::SeccompFilter, String>) -> ! {
    match setup {
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

fn read_config() -> Result<bb_proto::InitConfig, String> {
    // The config comes in the environment, which (unlike argv) sandbox processes cannot read:
    // init is non-dumpable, so its /proc/1/environ is closed to them. Nothing else is inherited.
    let arg = std::env::var(bb_proto::INIT_CONFIG_ENV).map_err(|_| "missing config in the environment")?;
    let config: bb_proto::InitConfig = serde_json::from_str(&arg).map_err(|e| format!("bad config: {e}"))?;
    for (k, _) in std::env::vars_os() {
        std::env::remove_var(k);
    }
    // Close everything we were not meant to inherit (keep stdio, listener, status pipe).
    bb_sys::process::close_fds_from(5).map_err(|e| e.to_string())?;
    Ok(config)
}

/// Build the sandbox's view (with `proc_mnt` as its /proc if given), then compile the seccomp
/// policy its processes get.
fn setup_and_policy(
    config: &bb_proto::InitConfig,
    proc_mnt: Option<std::os::fd::OwnedFd>,
) -> Result<bb_isolation::SeccompFilter, String> {
    setup::setup(config, proc_mnt).map_err(|e| e.to_string())?;
    // Compiled once; children drop their capabilities and apply it right before execve.
    let policy = if config.setns_key == [0, 0] {
        bb_isolation::SeccompFilter::default_policy()
    } else {
        bb_isolation::SeccompFilter::default_policy_with_setns_key(config.setns_key)
    };
    policy.map_err(|e| e.to_string())
}
