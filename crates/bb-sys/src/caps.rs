//! `capget(2)` and `capset(2)` (capability ABI version 3: 64-bit sets in two 32-bit halves).
//!
//! Both run in a child between a raw `clone3` and `execve` (`bb_isolation::drop_capabilities`),
//! where another thread of the daemon may have held the allocator's lock at clone time. So they
//! are one syscall each on stack buffers, async-signal-safe, and never allocate, not even on
//! error: a [`SysError`](crate::SysError) is a `&'static str` and an OS error code.

use crate::{check, SysResult};

/// `_LINUX_CAPABILITY_VERSION_3` (linux/capability.h).
const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// `struct __user_cap_header_struct` (linux/capability.h).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct` (linux/capability.h); version 3 uses two of them, the low
/// 32 capabilities first.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// A thread's effective, permitted and inheritable capability sets, bit `n` standing for
/// capability number `n` (the layout of the `Cap*` lines of `/proc/<pid>/status`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CapSets {
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
}

/// `capget(2)`: the capability sets of thread `tid` (0: the calling thread).
pub fn capget(tid: i32) -> SysResult<CapSets> {
    let mut header = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: tid };
    let mut data = [CapData::default(); 2];
    // SAFETY: header is a valid version-3 header; for version 3 the kernel writes exactly two
    // CapData structs, which `data` holds. Both live on this stack frame for the whole call.
    let ret = unsafe { libc::syscall(libc::SYS_capget, &mut header as *mut CapHeader, data.as_mut_ptr()) };
    check("capget", ret)?;
    let join = |f: fn(&CapData) -> u32| u64::from(f(&data[0])) | (u64::from(f(&data[1])) << 32);
    Ok(CapSets {
        effective: join(|d| d.effective),
        permitted: join(|d| d.permitted),
        inheritable: join(|d| d.inheritable),
    })
}

/// `capset(2)` on the calling thread. The kernel refuses (`EPERM`) permitted bits the thread
/// does not have, effective bits outside the new permitted set, and inheritable bits outside
/// the bounding set unless the thread has `CAP_SETPCAP`.
pub fn capset(sets: &CapSets) -> SysResult<()> {
    let mut header = CapHeader { version: LINUX_CAPABILITY_VERSION_3, pid: 0 };
    let half = |v: u64, i: usize| (v >> (32 * i)) as u32;
    let data: [CapData; 2] = std::array::from_fn(|i| CapData {
        effective: half(sets.effective, i),
        permitted: half(sets.permitted, i),
        inheritable: half(sets.inheritable, i),
    });
    // SAFETY: header is a valid version-3 header for the calling thread (pid 0) and `data` the
    // two initialised CapData structs version 3 reads; both outlive the call.
    let ret = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut CapHeader, data.as_ptr()) };
    check("capset", ret).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's `Cap*` line `name` (e.g. `"CapEff"`) of its procfs status.
    fn status_caps(name: &str) -> u64 {
        let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        let v = status.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')).unwrap();
        u64::from_str_radix(v.trim(), 16).unwrap()
    }

    #[test]
    fn structs_have_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<CapHeader>(), 8);
        assert_eq!(std::mem::size_of::<CapData>(), 12);
    }

    #[test]
    fn capget_of_self_matches_proc_status() {
        let sets = capget(0).unwrap();
        assert_eq!(sets.effective, status_caps("CapEff"));
        assert_eq!(sets.permitted, status_caps("CapPrm"));
        assert_eq!(sets.inheritable, status_caps("CapInh"));
        // Asking by our own tid is the same as asking for the calling thread.
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        assert_eq!(capget(tid).unwrap(), sets);
    }

    #[test]
    fn capget_of_a_missing_thread_is_esrch() {
        let e = capget(i32::MAX).unwrap_err();
        assert_eq!((e.call, e.errno()), ("capget", libc::ESRCH), "{e}");
    }

    /// Setting the sets we already have is always allowed, dropping a capability too, taking it
    /// back never is. Runs on a thread of its own: capset changes only the calling thread.
    #[test]
    fn capset_drops_and_cannot_take_back() {
        std::thread::spawn(|| {
            let now = capget(0).unwrap();
            capset(&now).unwrap();
            assert_eq!(capget(0).unwrap(), now);
            let more = match (0..64).find(|b| now.permitted & (1u64 << b) != 0) {
                Some(bit) => {
                    let mask = !(1u64 << bit);
                    let less = CapSets { effective: now.effective & mask, permitted: now.permitted & mask, ..now };
                    capset(&less).unwrap();
                    assert_eq!(capget(0).unwrap(), less);
                    assert_eq!(status_caps("CapPrm"), less.permitted);
                    now
                }
                // No capabilities at all (not root): any permitted bit is more than we have.
                None => CapSets { permitted: 1, ..now },
            };
            let e = capset(&more).unwrap_err();
            assert_eq!((e.call, e.errno()), ("capset", libc::EPERM), "{e}");
        })
        .join()
        .unwrap();
    }
}
