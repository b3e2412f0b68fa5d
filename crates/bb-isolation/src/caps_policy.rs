//! Capabilities and no_new_privs for the sandbox's first process.
//!
//! Both functions run in the child between fork/clone and execve, so they use only prctl(2),
//! capget(2) and capset(2) (through `bb_sys::caps`) and never allocate, not even on error: after
//! a raw `clone3` from a multi-threaded daemon, another thread may have held the allocator lock
//! at clone time.

use std::io;

use bb_sys::caps::CapSets;
use caps::Capability;

use crate::error::{IsolationError, Result};

/// Docker's default capability set.
pub const DEFAULT_CAPS: &[Capability] = &[
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FSETID,
    Capability::CAP_FOWNER,
    Capability::CAP_MKNOD,
    Capability::CAP_NET_RAW,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETFCAP,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_KILL,
    Capability::CAP_AUDIT_WRITE,
];

/// Bit mask of a capability list, in the layout of the `Cap*` lines of `/proc/<pid>/status`.
pub fn caps_mask(caps: &[Capability]) -> u64 {
    caps.iter().fold(0, |m, c| m | c.bitmask())
}

/// Reduce the calling thread to [`DEFAULT_CAPS`]:
/// 1. drop every other capability from the bounding set (needs CAP_SETPCAP, so this must run
///    while still privileged; capabilities already absent are skipped),
/// 2. set effective and permitted to `DEFAULT_CAPS ∩ permitted`, and inheritable to that
///    `∩ bounding` (the kernel refuses inheritable capabilities outside the bounding set),
/// 3. clear the ambient set.
///
/// For a root process the bounding set is what matters: execve as uid 0 re-grants permitted =
/// bounding set. Call it in the child before `execve` (and before switching to a non-root uid).
pub fn drop_capabilities() -> Result<()> {
    let keep = caps_mask(DEFAULT_CAPS);
    // Kept capabilities that are in the bounding set: the inheritable set may not exceed it.
    let mut bounding_kept = 0u64;

    for cap in 0..64u32 {
        // SAFETY: PR_CAPBSET_READ takes a capability number and no pointers.
        let present = unsafe { libc::prctl(libc::PR_CAPBSET_READ, libc::c_ulong::from(cap), 0, 0, 0) };
        if present < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINVAL) {
                break; // beyond /proc/sys/kernel/cap_last_cap: no more capabilities exist
            }
            return Err(IsolationError::CapabilityDrop { cap, source: err, hint: "" });
        }
        if present == 0 {
            continue;
        }
        if keep & (1u64 << cap) != 0 {
            bounding_kept |= 1u64 << cap;
            continue;
        }
        // SAFETY: PR_CAPBSET_DROP takes a capability number and no pointers.
        let ret = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0, 0, 0) };
        if ret != 0 {
            let source = io::Error::last_os_error();
            let hint = if source.raw_os_error() == Some(libc::EPERM) {
                " (needs CAP_SETPCAP: call drop_capabilities before switching to a non-root uid)"
            } else {
                ""
            };
            return Err(IsolationError::CapabilityDrop { cap, source, hint });
        }
    }

    let cap_err = |e: bb_sys::SysError| IsolationError::Capability { op: e.call, source: e.source, hint: "" };
    let permitted = bb_sys::caps::capget(0).map_err(cap_err)?.permitted;
    let new = permitted & keep;
    let sets = CapSets { effective: new, permitted: new, inheritable: new & bounding_kept };
    bb_sys::caps::capset(&sets).map_err(cap_err)?;

    // SAFETY: PR_CAP_AMBIENT_CLEAR_ALL takes no pointers.
    let ret = unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0, 0, 0) };
    if ret != 0 {
        let err = io::Error::last_os_error();
        // Kernels before 4.3 have no ambient set, so there is nothing to clear.
        if err.raw_os_error() != Some(libc::EINVAL) {
            return Err(IsolationError::Capability {
                op: "prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)",
                source: err,
                hint: "",
            });
        }
    }
    Ok(())
}

/// `prctl(PR_SET_NO_NEW_PRIVS, 1)`: execve can no longer grant privileges (setuid bits, file
/// capabilities). Inherited by all children, irreversible. [`crate::SeccompFilter::apply`] sets
/// it too.
pub fn set_no_new_privs() -> Result<()> {
    nix::sys::prctl::set_no_new_privs().map_err(IsolationError::NoNewPrivs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_caps_mask_matches_docker() {
        // Docker's default: 0x00000000a80425fb (as printed by `capsh --decode`).
        assert_eq!(caps_mask(DEFAULT_CAPS), 0x0000_0000_a804_25fb);
        assert_eq!(DEFAULT_CAPS.len(), 14);
        assert!(!DEFAULT_CAPS.contains(&Capability::CAP_SYS_ADMIN));
        assert!(!DEFAULT_CAPS.contains(&Capability::CAP_SYS_PTRACE));
        assert!(!DEFAULT_CAPS.contains(&Capability::CAP_NET_ADMIN));
    }
}
