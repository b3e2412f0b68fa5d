//! Capabilities and no_new_privs for the sandbox's first process.
//!
//! Both functions run in the child between fork/clone and execve, so they use only prctl(2),
//! capget(2) and capset(2) and never allocate, not even on error: after a raw `clone3` from a
//! multi-threaded daemon, another thread may have held the allocator lock at clone time.

use std::io;

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

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// `struct __user_cap_header_struct` (linux/capability.h).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct` (linux/capability.h); version 3 uses two of them.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
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
        let present =
            unsafe { libc::prctl(libc::PR_CAPBSET_READ, libc::c_ulong::from(cap), 0, 0, 0) };
        if present < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINVAL) {
                break; // beyond /proc/sys/kernel/cap_last_cap: no more capabilities exist
            }
            return Err(IsolationError::CapabilityDrop {
                cap,
                source: err,
                hint: "",
            });
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

    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes two CapData structs (version 3) into `data`, which is exactly that
    // large; `header` is a valid version-3 header for the calling thread (pid 0).
    let ret = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut CapHeader,
            data.as_mut_ptr(),
        )
    };
    if ret != 0 {
        return Err(cap_err("capget", ""));
    }
    let permitted = u64::from(data[0].permitted) | (u64::from(data[1].permitted) << 32);
    let new = permitted & keep;
    let inheritable = new & bounding_kept;
    for (i, d) in data.iter_mut().enumerate() {
        let half = (new >> (32 * i)) as u32;
        *d = CapData {
            effective: half,
            permitted: half,
            inheritable: (inheritable >> (32 * i)) as u32,
        };
    }
    // SAFETY: capset reads the header and two CapData structs, all valid and initialised.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_capset,
            &mut header as *mut CapHeader,
            data.as_ptr(),
        )
    };
    if ret != 0 {
        return Err(cap_err("capset", ""));
    }

    // SAFETY: PR_CAP_AMBIENT_CLEAR_ALL takes no pointers.
    let ret = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
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

fn cap_err(op: &'static str, hint: &'static str) -> IsolationError {
    IsolationError::Capability {
        op,
        source: io::Error::last_os_error(),
        hint,
    }
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

    #[test]
    fn cap_structs_have_kernel_layout() {
        assert_eq!(std::mem::size_of::<CapHeader>(), 8);
        assert_eq!(std::mem::size_of::<CapData>(), 12);
    }
}
