//! Root-only: capability dropping and no_new_privs in forked children, checked through
//! /proc/self/status before and after execve.

mod common;

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::time::Duration;

use bb_isolation::{caps_mask, drop_capabilities, set_no_new_privs, DEFAULT_CAPS};
use common::*;
use nix::sys::wait::WaitStatus;

/// Run `body` in a forked child that then sends its /proc/self/status through a pipe.
fn status_after(body: impl FnOnce() -> i32) -> String {
    let pipe = new_pipe();
    let w = pipe.write.as_raw_fd();
    let mut child = fork_gated(move || {
        let code = body();
        if code != 0 {
            return code;
        }
        let status = std::fs::read("/proc/self/status").unwrap_or_default();
        let len = (status.len() as u32).to_ne_bytes();
        if raw_write(w, &len) && raw_write(w, &status) {
            0
        } else {
            11
        }
    });
    child.release();
    let len = read_exact_timeout(&pipe.read, 4, Duration::from_secs(10));
    let len = u32::from_ne_bytes(len.try_into().unwrap()) as usize;
    let status = read_exact_timeout(&pipe.read, len, Duration::from_secs(5));
    assert_eq!(child.wait(Duration::from_secs(10)), WaitStatus::Exited(child.pid, 0));
    String::from_utf8(status).unwrap()
}

#[test]
fn drop_capabilities_leaves_exactly_the_default_set() {
    require_root();
    let default = caps_mask(DEFAULT_CAPS);
    let before = own_status();
    // Preconditions that make the test meaningful: we hold all default caps and more.
    assert_eq!(status_hex(&before, "CapBnd") & default, default, "test process lacks default caps");
    assert_eq!(status_hex(&before, "CapEff") & default, default, "test process lacks default caps");
    assert_ne!(status_hex(&before, "CapBnd") & !default, 0, "nothing to drop: test proves nothing");

    let after = status_after(|| {
        if drop_capabilities().is_err() {
            return 20;
        }
        // Idempotent, also once CAP_SETPCAP-requiring drops are done.
        if drop_capabilities().is_err() {
            return 21;
        }
        0
    });
    for key in ["CapBnd", "CapEff", "CapPrm", "CapInh"] {
        assert_eq!(status_hex(&after, key), default, "{key}: {:#x}", status_hex(&after, key));
    }
    assert_eq!(status_hex(&after, "CapAmb"), 0);
}

#[test]
fn dropped_capabilities_stay_dropped_after_exec_as_root() {
    require_root();
    let pipe = new_pipe();
    let w = pipe.write.as_raw_fd();
    let mut child = fork_gated(move || {
        if drop_capabilities().is_err() {
            return 20;
        }
        // SAFETY: dup2 of valid fds.
        unsafe { libc::dup2(w, 1) };
        let cat = CString::new("/bin/cat").unwrap();
        let file = CString::new("/proc/self/status").unwrap();
        let argv = [cat.as_ptr(), file.as_ptr(), std::ptr::null()];
        // SAFETY: NUL-terminated strings and a null-terminated argv.
        unsafe { libc::execv(cat.as_ptr(), argv.as_ptr()) };
        22
    });
    child.release();
    assert_eq!(child.wait(Duration::from_secs(10)), WaitStatus::Exited(child.pid, 0));
    drop(pipe.write);
    let mut text = Vec::new();
    loop {
        let mut buf = [0u8; 4096];
        match nix::unistd::read(pipe.read.as_raw_fd(), &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => text.extend_from_slice(&buf[..n]),
        }
    }
    let status = String::from_utf8(text).unwrap();
    // uid 0 regains permitted = bounding set at execve; the bounding set is the confinement.
    let default = caps_mask(DEFAULT_CAPS);
    assert_eq!(status_hex(&status, "CapBnd"), default, "{status}");
    assert_eq!(status_hex(&status, "CapEff"), default);
    assert_eq!(status_hex(&status, "CapPrm"), default);
}

#[test]
fn privileged_operation_fails_after_drop() {
    require_root();
    // Lowering our own nice value needs CAP_SYS_NICE, which is not in the default set.
    let attempt = || {
        // SAFETY: setpriority on the calling process with plain integers.
        let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -5) };
        if r == 0 {
            0
        } else {
            errno()
        }
    };
    let control = status_after(move || if attempt() == 0 { 0 } else { 30 });
    assert!(control.contains("CapEff"), "control child must succeed in raising its priority");
    status_after(move || {
        if drop_capabilities().is_err() {
            return 20;
        }
        match attempt() {
            libc::EACCES | libc::EPERM => 0,
            0 => 31, // still privileged
            _ => 32,
        }
    });
}

#[test]
fn no_new_privs_is_set() {
    require_root();
    assert_eq!(status_field(&own_status(), "NoNewPrivs"), "0", "test process already has NNP");
    let status = status_after(|| if set_no_new_privs().is_ok() { 0 } else { 20 });
    assert_eq!(status_field(&status, "NoNewPrivs"), "1");
}
