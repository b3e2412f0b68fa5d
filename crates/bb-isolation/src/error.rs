//! The crate's single error type.
//!
//! Every variant names the file, syscall or value that failed and, where there is a usual cause,
//! says what to change. Variants produced on the post-fork path ([`crate::drop_capabilities`],
//! [`crate::set_no_new_privs`], [`crate::SeccompFilter::apply`]) hold no heap data, so building
//! them never allocates.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong in `bb-isolation`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IsolationError {
    /// Neither a usable cgroup v2 hierarchy nor the needed v1 hierarchies were found.
    #[error("cannot use cgroups: {reason}")]
    CgroupsUnavailable { reason: String },

    /// A group or parent name that cannot be used as a single cgroup directory name.
    #[error(
        "invalid cgroup name {name:?}: {reason} (use 1-200 characters from [A-Za-z0-9_.@:-], \
         not starting with '.')"
    )]
    InvalidName { name: String, reason: &'static str },

    /// A [`crate::Limits`] value the kernel would reject or that would make the sandbox unusable.
    #[error("invalid limits: {0}")]
    InvalidLimits(String),

    /// [`crate::Cgroup::open`] on a group that does not exist.
    #[error("cgroup {name:?} does not exist (looked for {path})")]
    NotFound { name: String, path: PathBuf },

    /// [`crate::Cgroup::create`] on a name that is already taken.
    #[error(
        "cgroup {name:?} already exists at {path}; re-attach with Cgroup::open, or remove the \
         stray with Cgroup::open(..)?.destroy() (CgroupLayout::list shows all of them)"
    )]
    AlreadyExists { name: String, path: PathBuf },

    /// The layout lacks a hierarchy that the operation needs (only possible with
    /// [`crate::CgroupLayout::with_roots`]; `detect` always provides all of them).
    #[error("the cgroup layout has no {controller:?} hierarchy, which {op} needs; add it to the roots")]
    MissingController { controller: &'static str, op: &'static str },

    /// A filesystem operation on cgroupfs failed (mkdir, rmdir, read, open, readdir).
    #[error("cannot {op} {path}: {source}{hint}")]
    Fs {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
        hint: &'static str,
    },

    /// Writing a value into a cgroup control file failed.
    #[error("cannot write {value:?} to {path}: {source}{hint}")]
    Write {
        path: PathBuf,
        value: String,
        #[source]
        source: io::Error,
        hint: &'static str,
    },

    /// A control file (or /proc/self/mountinfo) had contents this crate does not understand.
    #[error("unexpected contents in {path}: {detail}")]
    Parse { path: PathBuf, detail: String },

    /// freeze / kill_all did not complete in time.
    #[error("cgroup {name:?}: {what} did not complete within {waited:?}: {detail}")]
    Timeout { name: String, what: &'static str, waited: Duration, detail: String },

    /// kill(2) on a member of the group failed with something other than ESRCH.
    #[error("cannot SIGKILL pid {pid} in cgroup {name:?}: {source}")]
    Kill {
        name: String,
        pid: i32,
        #[source]
        source: nix::errno::Errno,
    },

    /// The seccomp policy JSON is malformed or refers to something unknown.
    #[error("seccomp policy: {0}")]
    SeccompPolicy(String),

    /// seccompiler rejected a filter of the policy.
    #[error("seccomp policy: cannot compile filter {filter:?}: {source}")]
    SeccompCompile {
        filter: String,
        #[source]
        source: seccompiler::BackendError,
    },

    /// Only x86_64 and aarch64 have syscall tables.
    #[error("seccomp: unsupported architecture {0:?}; branchbox supports x86_64 and aarch64")]
    UnsupportedArch(&'static str),

    /// prctl(PR_SET_NO_NEW_PRIVS) or seccomp(SECCOMP_SET_MODE_FILTER) failed.
    #[error(
        "cannot install seccomp filter: {0} (the kernel needs CONFIG_SECCOMP_FILTER; a filter \
         over 4096 instructions or a too-deep filter stack is rejected with EINVAL/ENOMEM)"
    )]
    SeccompApply(#[source] seccompiler::Error),

    /// Removing one capability from the bounding set failed.
    #[error("cannot drop capability {cap} from the bounding set: {source}{hint}")]
    CapabilityDrop {
        cap: u32,
        #[source]
        source: io::Error,
        hint: &'static str,
    },

    /// capget/capset/prctl(PR_CAP_AMBIENT) failed.
    #[error("{op} failed: {source}{hint}")]
    Capability {
        op: &'static str,
        #[source]
        source: io::Error,
        hint: &'static str,
    },

    /// prctl(PR_SET_NO_NEW_PRIVS, 1) failed.
    #[error("prctl(PR_SET_NO_NEW_PRIVS, 1) failed: {0} (needs Linux >= 3.5)")]
    NoNewPrivs(#[source] nix::errno::Errno),
}

/// Hint appended to a failed control-file write, chosen by errno and file name.
pub(crate) fn write_hint(path: &std::path::Path, err: &io::Error) -> &'static str {
    let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
    match err.raw_os_error() {
        Some(libc::ENOENT) => {
            " (the control file does not exist: is the controller mounted, and on cgroup v2 \
             enabled in the parent's cgroup.subtree_control?)"
        }
        Some(libc::EACCES) | Some(libc::EPERM) => {
            " (permission denied: run branchboxd as root or delegate this cgroup subtree to its \
             user)"
        }
        Some(libc::EROFS) => " (the cgroup filesystem is mounted read-only)",
        Some(libc::ESRCH) if file == "cgroup.procs" => " (the process has already exited)",
        Some(libc::EBUSY) if file == "cgroup.subtree_control" => {
            " (cgroup v2 does not let a group that has member processes enable controllers for \
             its children; move those processes into a leaf group first)"
        }
        Some(libc::EBUSY) if file.starts_with("memory.") => {
            " (the group uses more memory than the new limit and the kernel could not reclaim \
             it; kill some processes or choose a higher limit)"
        }
        Some(libc::EINVAL) if file.starts_with("memory.") => {
            " (the kernel rejected the value: v1 needs memory.memsw.limit_in_bytes >= \
             memory.limit_in_bytes)"
        }
        Some(libc::EINVAL) if file.starts_with("cpu.") => {
            " (the kernel rejected the CPU quota: it must be >= 1 ms per period and fit within \
             the parent's quota)"
        }
        Some(libc::EINVAL) if file == "cgroup.subtree_control" => {
            " (a controller is not available here: check the parent's cgroup.controllers)"
        }
        _ => "",
    }
}

/// Hint appended to a failed mkdir/rmdir/read.
pub(crate) fn fs_hint(err: &io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => {
            " (permission denied: run branchboxd as root or delegate this cgroup subtree to its \
             user)"
        }
        Some(libc::EROFS) => " (the cgroup filesystem is mounted read-only)",
        Some(libc::EBUSY) => " (the group still contains processes or child groups)",
        Some(libc::ENOTEMPTY) => " (the directory still contains child groups)",
        _ => "",
    }
}

pub type Result<T, E = IsolationError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_is_send_sync_static() {
        fn assert_bounds<T: Send + Sync + 'static + std::error::Error>() {}
        assert_bounds::<IsolationError>();
    }

    #[test]
    fn write_error_names_file_value_and_hint() {
        let path = PathBuf::from("/sys/fs/cgroup/x/cgroup.subtree_control");
        let source = io::Error::from_raw_os_error(libc::EBUSY);
        let hint = write_hint(&path, &source);
        let e = IsolationError::Write { path, value: "+memory".into(), source, hint };
        let msg = e.to_string();
        assert!(msg.contains("/sys/fs/cgroup/x/cgroup.subtree_control"), "{msg}");
        assert!(msg.contains("\"+memory\""), "{msg}");
        assert!(msg.contains("leaf group"), "{msg}");
    }

    #[test]
    fn hints_depend_on_errno_and_file() {
        let p = std::path::Path::new("/x/memory.limit_in_bytes");
        assert!(write_hint(p, &io::Error::from_raw_os_error(libc::EINVAL)).contains("memsw"));
        assert!(write_hint(p, &io::Error::from_raw_os_error(libc::EBUSY)).contains("higher limit"));
        let procs = std::path::Path::new("/x/cgroup.procs");
        assert!(write_hint(procs, &io::Error::from_raw_os_error(libc::ESRCH)).contains("exited"));
        assert_eq!(write_hint(procs, &io::Error::from_raw_os_error(libc::EIO)), "");
    }
}
