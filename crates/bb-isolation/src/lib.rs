//! Sandbox isolation for branchbox: resource limits (cgroups), a syscall filter (seccomp) and
//! privilege reduction (capabilities, no_new_privs). Namespaces and the root filesystem are set
//! up elsewhere; this crate confines what the sandbox's processes may consume and call.
//!
//! **cgroups** ([`CgroupLayout`], [`Cgroup`]). [`CgroupLayout::detect`] reads
//! /proc/self/mountinfo and picks v2 if a cgroup2 mount offers memory+cpu+pids, else v1 with the
//! memory, cpu, pids and freezer hierarchies. A sandbox is `<root>/<parent>/<name>` in each
//! hierarchy. Limits: v1 `memory.limit_in_bytes` and `memory.memsw.limit_in_bytes` (same value,
//! so swap is no escape), `memory.oom_control`=0 (OOM killer on), `cpu.cfs_period_us`=100000 with
//! `cpu.cfs_quota_us`=millis*100, `pids.max`; v2 `memory.max`, `memory.swap.max`=0, `cpu.max`,
//! `pids.max`. Freezing uses v1 `freezer.state` / v2 `cgroup.freeze`; killing uses v2
//! `cgroup.kill`, or on v1 a freeze–SIGKILL–thaw loop so forks cannot race the kill.
//!
//! **seccomp** ([`SeccompFilter`]). The policy is data, `seccomp/default.json` in seccompiler's
//! JSON format, compiled at runtime for x86_64 or aarch64 into one BPF program (see
//! [`SeccompFilter`] for how the policy's filters are linked). Default action: allow.
//! Denied with EPERM: kernel code and boot (kexec_*, *_module, reboot), kernel attack surface
//! (bpf, perf_event_open, userfaultfd, io_uring_*), non-namespaced kernel state (keyctl,
//! add_key, request_key, syslog, acct, swapon/off, quotactl*, clock/time setters, iopl/ioperm),
//! mounts (mount, umount2, pivot_root and the whole new mount API) and namespace changes
//! (setns; unshare with any CLONE_NEW* flag; clone with any CLONE_NEW* flag, one masked_eq rule
//! per flag so plain fork and pthread_create still work), escape helpers (open_by_handle_at,
//! name_to_handle_at, kcmp, process_vm_writev) and personality other than Docker's allowed
//! values (no ASLR-off). clone3 returns ENOSYS: its flags are in memory where seccomp cannot
//! look, and glibc then falls back to clone. ptrace stays allowed: the pid namespace confines
//! it and CAP_SYS_PTRACE is dropped. Foreign ABIs are refused: i386 and arm32 syscalls kill
//! the process, x32 syscalls get ENOSYS.
//!
//! **Capabilities** ([`drop_capabilities`], [`DEFAULT_CAPS`]): Docker's default 14, applied to
//! the bounding, permitted, effective and inheritable sets; ambient cleared.
//!
//! **Order in the child** (single-threaded, between fork/clone and execve): join the cgroup
//! (v2: `clone3(CLONE_INTO_CGROUP, dir_fd)`, v1: the parent calls [`Cgroup::add_pid`] before
//! releasing the child), set up namespaces/mounts/pivot_root, [`drop_capabilities`], then
//! setgroups/setgid/setuid, [`set_no_new_privs`], [`SeccompFilter::apply`] last (it denies
//! mount/unshare/setns that the setup needs), then execve. The three child-side calls do not
//! allocate. A root process regains permitted = bounding set at execve, which is why the
//! bounding set is what confines uid 0.

mod caps_policy;
mod cgroup;
mod error;
mod seccomp;

pub use caps_policy::{caps_mask, drop_capabilities, set_no_new_privs, DEFAULT_CAPS};
pub use cgroup::{
    Cgroup, CgroupLayout, CgroupStats, CgroupVersion, Limits, CPU_PERIOD_US, MIN_CPU_MILLIS, MIN_MEMORY_BYTES,
};
pub use error::IsolationError;
pub use seccomp::{SeccompFilter, SetnsKey, DEFAULT_POLICY_JSON};

#[cfg(test)]
mod tests {
    #[test]
    fn public_types_can_be_shared_between_threads() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<crate::CgroupLayout>();
        assert_send_sync::<crate::Cgroup>();
        assert_send_sync::<crate::SeccompFilter>();
        assert_send_sync::<crate::IsolationError>();
    }

    #[test]
    fn version_serializes_like_the_api_expects() {
        assert_eq!(serde_json::to_string(&crate::CgroupVersion::V1).unwrap(), "\"v1\"");
        assert_eq!(crate::CgroupVersion::V2.to_string(), "v2");
        let limits: crate::Limits =
            serde_json::from_str(r#"{"memory_bytes": 1048576, "cpu_millis": 500, "pids": null}"#).unwrap();
        assert_eq!(limits.cpu_millis, Some(500));
    }
}
