//! The one place where branchbox makes raw syscalls.
//!
//! Everything libc or nix lacks (clone3, pivot_root, openat2, the new mount API, capget/capset)
//! and kill by pid are wrapped here and return `Result<_, SysError>`; callers never touch
//! `libc::syscall` or `libc::kill` themselves. [`signaller::Signaller`] is the seam that lets
//! code which kills processes be tested with a recording double.

pub mod caps;
pub mod fscrypt;
pub mod mount_api;
pub mod ns;
pub mod process;
pub mod ptrace;
pub mod pty;
pub mod secret;
pub mod signaller;

use std::io;

/// A failed syscall: which call, and the errno it returned.
#[derive(Debug, thiserror::Error)]
#[error("{call} failed: {source}")]
pub struct SysError {
    pub call: &'static str,
    #[source]
    pub source: io::Error,
}

impl SysError {
    pub fn last(call: &'static str) -> Self {
        SysError { call, source: io::Error::last_os_error() }
    }
    pub fn errno(&self) -> i32 {
        self.source.raw_os_error().unwrap_or(0)
    }
}

pub type SysResult<T> = Result<T, SysError>;

/// Turn a `-1`-on-error return value into a `SysResult`.
pub fn check(call: &'static str, ret: libc::c_long) -> SysResult<libc::c_long> {
    if ret < 0 {
        Err(SysError::last(call))
    } else {
        Ok(ret)
    }
}
