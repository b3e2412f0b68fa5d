//! Policy tests without installing anything: a small classic-BPF interpreter runs the compiled
//! program against synthetic `struct seccomp_data`, for both architectures.

use super::*;

const EPERM: u32 = SECCOMP_RET_ERRNO | libc::EPERM as u32;
const ENOSYS: u32 = SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
const ALLOW: u32 = SECCOMP_RET_ALLOW;
const KILL: u32 = SECCOMP_RET_KILL_PROCESS;
const AUDIT_ARCH_AARCH64: u32 = 0xC000_00B7;

const CLONE_NEWTIME: u64 = 0x80;
const CLONE_NEWNS: u64 = 0x0002_0000;
const CLONE_NEWCGROUP: u64 = 0x0200_0000;
const CLONE_NEWUTS: u64 = 0x0400_0000;
const CLONE_NEWIPC: u64 = 0x0800_0000;
const CLONE_NEWUSER: u64 = 0x1000_0000;
const CLONE_NEWPID: u64 = 0x2000_0000;
const CLONE_NEWNET: u64 = 0x4000_0000;
const NS_FLAGS: [u64; 7] =
    [CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET];
const SIGCHLD: u64 = 17;
/// What glibc's pthread_create passes to clone.
const PTHREAD_FLAGS: u64 = (libc::CLONE_VM
    | libc::CLONE_FS
    | libc::CLONE_FILES
    | libc::CLONE_SIGHAND
    | libc::CLONE_THREAD
    | libc::CLONE_SYSVSEM
    | libc::CLONE_SETTLS
    | libc::CLONE_PARENT_SETTID
    | libc::CLONE_CHILD_CLEARTID) as u64;

/// Run a seccomp program on (arch, nr, args) the way the kernel does.
fn eval(prog: &[sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
    let mut data = [0u8; 64];
    data[0..4].copy_from_slice(&nr.to_ne_bytes());
    data[4..8].copy_from_slice(&arch.to_ne_bytes());
    for (i, a) in args.iter().enumerate() {
        data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_ne_bytes());
    }
    let (mut acc, mut pc) = (0u32, 0usize);
    loop {
        let ins = prog.get(pc).unwrap_or_else(|| panic!("fell off the program at {pc}"));
        pc += 1;
        let k = ins.k;
        let cond = |taken: bool| {
            if taken {
                ins.jt as usize
            } else {
                ins.jf as usize
            }
        };
        match ins.code {
            0x20 => {
                let o = k as usize;
                acc = u32::from_ne_bytes(data[o..o + 4].try_into().unwrap());
            }
            0x54 => acc &= k,         // ALU AND K
            0x05 => pc += k as usize, // JA
            0x15 => pc += cond(acc == k),
            0x25 => pc += cond(acc > k),
            0x35 => pc += cond(acc >= k),
            0x45 => pc += cond(acc & k != 0),
            0x06 => return k,
            other => panic!("unsupported BPF opcode {other:#x} at {}", pc - 1),
        }
    }
}

struct Target {
    arch: TargetArch,
    audit: u32,
    prog: BpfProgram,
}

impl Target {
    fn new(arch: TargetArch) -> Target {
        let audit = match arch {
            TargetArch::x86_64 => AUDIT_ARCH_X86_64,
            TargetArch::aarch64 => AUDIT_ARCH_AARCH64,
        };
        Target { arch, audit, prog: compile(DEFAULT_POLICY_JSON, arch).unwrap() }
    }
    fn nr(&self, name: &str) -> u32 {
        resolve(name, self.arch).unwrap().unwrap_or_else(|| panic!("{name} missing")) as u32
    }
    fn call(&self, name: &str, arg0: u64) -> u32 {
        eval(&self.prog, self.audit, self.nr(name), [arg0, 0, 0, 0, 0, 0])
    }
}

fn both() -> [Target; 2] {
    [Target::new(TargetArch::x86_64), Target::new(TargetArch::aarch64)]
}

const DENIED: &[&str] = &[
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "mount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "open_tree_attr",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "swapon",
    "swapoff",
    "reboot",
    "syslog",
    "acct",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "lookup_dcookie",
    "quotactl",
    "quotactl_fd",
    "nfsservctl",
    "vhangup",
    "open_by_handle_at",
    "name_to_handle_at",
    "setns",
    "userfaultfd",
    "kcmp",
    "process_vm_writev",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
];
const DENIED_X86_ONLY: &[&str] =
    &["create_module", "get_kernel_syms", "query_module", "iopl", "ioperm", "uselib", "_sysctl"];
const ALLOWED: &[&str] = &[
    "read",
    "write",
    "openat",
    "close",
    "mmap",
    "execve",
    "exit_group",
    "wait4",
    "ptrace",
    "process_vm_readv",
    "chroot",
    "setuid",
    "capset",
    "prctl",
    "seccomp",
    "kill",
];

#[test]
fn default_policy_compiles_for_both_architectures() {
    for t in both() {
        assert!(t.prog.len() > 100 && t.prog.len() < BPF_MAXINSNS, "{:?}: {}", t.arch, t.prog.len());
    }
    let native = SeccompFilter::default_policy().unwrap();
    assert_eq!(native.program(), &compile(DEFAULT_POLICY_JSON, native_arch().unwrap()).unwrap()[..]);
}

#[test]
fn denied_syscalls_get_eperm() {
    for t in both() {
        for name in DENIED {
            assert_eq!(t.call(name, 0), EPERM, "{name} on {:?}", t.arch);
        }
    }
    let x86 = Target::new(TargetArch::x86_64);
    for name in DENIED_X86_ONLY {
        assert_eq!(x86.call(name, 0), EPERM, "{name}");
        assert_eq!(resolve(name, TargetArch::aarch64).unwrap(), None, "{name} has no aarch64 nr");
    }
}

#[test]
fn ordinary_syscalls_are_allowed() {
    for t in both() {
        for name in ALLOWED {
            let nr = seccompiler_syscall_nr(name, t.arch).unwrap();
            assert_eq!(eval(&t.prog, t.audit, nr as u32, [0; 6]), ALLOW, "{name} on {:?}", t.arch);
        }
    }
}

#[test]
fn clone_is_filtered_by_namespace_flags_only() {
    for t in both() {
        assert_eq!(t.call("clone", SIGCHLD), ALLOW, "fork");
        assert_eq!(t.call("clone", PTHREAD_FLAGS), ALLOW, "pthread_create");
        assert_eq!(t.call("clone", PTHREAD_FLAGS | libc::CLONE_VFORK as u64), ALLOW, "vfork-like");
        for flag in NS_FLAGS {
            assert_eq!(t.call("clone", flag | SIGCHLD), EPERM, "{flag:#x} on {:?}", t.arch);
            assert_eq!(t.call("clone", flag | PTHREAD_FLAGS), EPERM, "{flag:#x} with thread flags");
            // Bits above 31 do not hide the flag (the kernel ignores them for clone).
            assert_eq!(t.call("clone", flag | 0xffff_0000_0000_0000), EPERM);
        }
        assert_eq!(t.call("clone", NS_FLAGS.iter().fold(SIGCHLD, |a, f| a | f)), EPERM);
        // Legacy clone cannot create a time namespace (0x80 is part of the exit signal byte).
        assert_eq!(t.call("clone", CLONE_NEWTIME | SIGCHLD), ALLOW);
    }
}

#[test]
fn unshare_is_filtered_by_namespace_flags_only() {
    for t in both() {
        for flag in NS_FLAGS.iter().copied().chain([CLONE_NEWTIME]) {
            assert_eq!(t.call("unshare", flag), EPERM, "{flag:#x} on {:?}", t.arch);
            assert_eq!(t.call("unshare", flag | libc::CLONE_FILES as u64), EPERM);
        }
        assert_eq!(t.call("unshare", libc::CLONE_FILES as u64), ALLOW);
        assert_eq!(t.call("unshare", (libc::CLONE_FS | libc::CLONE_SYSVSEM) as u64), ALLOW);
    }
}

#[test]
fn clone3_is_enosys() {
    for t in both() {
        assert_eq!(t.call("clone3", 0), ENOSYS);
    }
}

#[test]
fn personality_only_docker_values() {
    for t in both() {
        for ok in [0u64, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff] {
            assert_eq!(t.call("personality", ok), ALLOW, "{ok:#x}");
        }
        for bad in [0x0004_0000u64 /* ADDR_NO_RANDOMIZE */, 0x1, 0x0040_0000 /* READ_IMPLIES_EXEC */] {
            assert_eq!(t.call("personality", bad), EPERM, "{bad:#x}");
        }
    }
}

#[test]
fn foreign_abis_are_refused() {
    let x86 = Target::new(TargetArch::x86_64);
    // i386 (int 0x80) and arm32 compat have their own audit arch: killed.
    assert_eq!(eval(&x86.prog, 0x4000_0003 /* AUDIT_ARCH_I386 */, 20, [0; 6]), KILL);
    let arm = Target::new(TargetArch::aarch64);
    assert_eq!(eval(&arm.prog, 0x4000_0028 /* AUDIT_ARCH_ARM */, 20, [0; 6]), KILL);
    // x32 shares the x86_64 audit arch: every x32 number gets ENOSYS, also for "allowed" calls.
    for name in ["mount", "unshare", "getpid"] {
        let nr = seccompiler_syscall_nr(name, TargetArch::x86_64).unwrap() as u32;
        assert_eq!(eval(&x86.prog, AUDIT_ARCH_X86_64, nr | X32_SYSCALL_BIT, [0; 6]), ENOSYS);
    }
}

#[test]
fn table_matches_seccompiler_and_libc() {
    let mut checked = 0;
    for &(name, x86, arm) in syscalls::SYSCALLS {
        for (arch, ours) in [(TargetArch::x86_64, x86), (TargetArch::aarch64, arm)] {
            if let Some(theirs) = seccompiler_syscall_nr(name, arch) {
                assert_eq!(ours.map(i64::from), Some(theirs), "{name} on {arch:?}");
                checked += 1;
            }
        }
    }
    assert!(checked > 90, "only {checked} numbers cross-checked");
    // The ones seccompiler does not know, against libc for the build architecture.
    let native = native_arch().unwrap();
    assert_eq!(resolve("mount_setattr", native).unwrap(), Some(libc::SYS_mount_setattr));
    assert_eq!(resolve("quotactl_fd", native).unwrap(), Some(libc::SYS_quotactl_fd));
    assert_eq!(resolve("clone3", native).unwrap(), Some(libc::SYS_clone3));
    // Names not in our table come from seccompiler's.
    assert_eq!(resolve("getpid", native).unwrap(), Some(libc::SYS_getpid));
}

#[test]
fn every_policy_name_resolves() {
    let policy: Policy = serde_json::from_str(DEFAULT_POLICY_JSON).unwrap();
    for filter in policy.0.values() {
        for rule in &filter.rules {
            for arch in [TargetArch::x86_64, TargetArch::aarch64] {
                resolve(&rule.syscall, arch).unwrap();
            }
        }
    }
}

/// Our reader must produce exactly what seccompiler's own JSON frontend produces, for every
/// rule seccompiler can express (it lacks mount_setattr, quotactl_fd and open_tree_attr).
#[test]
fn same_output_as_seccompiler_frontend() {
    let mut policy: serde_json::Value = serde_json::from_str(DEFAULT_POLICY_JSON).unwrap();
    for filter in policy.as_object_mut().unwrap().values_mut() {
        let rules = filter["filter"].as_array_mut().unwrap();
        rules.retain(|r| !["mount_setattr", "quotactl_fd", "open_tree_attr"].contains(&r["syscall"].as_str().unwrap()));
    }
    let json = policy.to_string();
    let ours = compile_filters(&json, TargetArch::x86_64).unwrap();
    let theirs = seccompiler::compile_from_json(json.as_bytes(), TargetArch::x86_64).unwrap();
    assert_eq!(ours.len(), theirs.len());
    for (name, prog) in ours {
        assert_eq!(&prog, &theirs[&name], "filter {name}");
    }
}

#[test]
fn first_non_allow_verdict_wins() {
    let json = r#"{
        "b": {"mismatch_action": "allow", "match_action": {"errno": 2}, "filter": [
            {"syscall": "getpid"}, {"syscall": "getuid"}]},
        "a": {"mismatch_action": "allow", "match_action": {"errno": 1}, "filter": [
            {"syscall": "getpid"}]},
        "c": {"mismatch_action": {"errno": 3}, "match_action": "allow", "filter": [
            {"syscall": "getuid"}, {"syscall": "getpid"}]}
    }"#;
    let arch = native_arch().unwrap();
    let audit = if arch == TargetArch::x86_64 { AUDIT_ARCH_X86_64 } else { AUDIT_ARCH_AARCH64 };
    let prog = compile(json, arch).unwrap();
    let run = |nr: i64| eval(&prog, audit, nr as u32, [0; 6]);
    assert_eq!(run(libc::SYS_getpid), SECCOMP_RET_ERRNO | 1, "a before b");
    assert_eq!(run(libc::SYS_getuid), SECCOMP_RET_ERRNO | 2, "b");
    assert_eq!(run(libc::SYS_getgid), SECCOMP_RET_ERRNO | 3, "allow-list c");
}

#[test]
fn policy_errors_are_explicit() {
    let err = |json: &str| SeccompFilter::from_json(json).unwrap_err().to_string();
    let e =
        err(r#"{"f": {"mismatch_action": "allow", "match_action": {"errno": 1}, "filter": [{"syscall": "mount2"}]}}"#);
    assert!(e.contains("unknown syscall \"mount2\"") && e.contains("syscalls.rs"), "{e}");
    let e = err(r#"{"f": {"mismatch_action": "allow", "match_action": "allow", "filter": []}}"#);
    assert!(e.contains("\"f\""), "{e}");
    let e = err(r#"{"f": {"mismatch_action": "allow", "match_action": "trap", "filter": [], "x": 1}}"#);
    assert!(e.contains("unknown field"), "{e}");
    let e = err(r#"{"f": {"mismatch_action": "allow", "match_action": "trap", "filter": []},
                   "f": {"mismatch_action": "allow", "match_action": "trap", "filter": []}}"#);
    assert!(e.contains("duplicate filter name"), "{e}");
    let e = err(r#"{"f": {"mismatch_action": "allow", "match_action": "trap", "filter": [
        {"syscall": "mount"},
        {"syscall": "mount", "args": [{"index": 0, "type": "dword", "op": "eq", "val": 1}]}]}}"#);
    assert!(e.contains("both with and without"), "{e}");
    let e = err(r#"{"f": {"mismatch_action": "allow", "match_action": "trap", "filter": [
        {"syscall": "mount", "args": [{"index": 6, "type": "dword", "op": "eq", "val": 1}]}]}}"#);
    assert!(e.contains("cannot compile filter \"f\""), "{e}");
    assert!(err("{}").contains("no filters"));
}

#[test]
fn setns_passes_only_with_the_key() {
    let key = [0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210];
    for arch in [TargetArch::x86_64, TargetArch::aarch64] {
        let t = Target::new(arch);
        let keyed = compile_keyed(DEFAULT_POLICY_JSON, arch, Some(key)).unwrap();
        let nr = t.nr("setns");
        let call = |a2, a3| eval(&keyed, t.audit, nr, [3, 0, a2, a3, 0, 0]);
        assert_eq!(call(key[0], key[1]), ALLOW, "{arch:?}");
        assert_eq!(call(0, 0), EPERM);
        assert_eq!(call(key[0], 0), EPERM, "half the key is not enough");
        assert_eq!(call(0, key[1]), EPERM);
        assert_eq!(call(key[0], key[1] ^ (1 << 63)), EPERM, "all 64 bits count");
        assert_eq!(call(key[0] ^ 1, key[1]), EPERM);
        // Without a key setns stays denied whatever the arguments, and the rest is unchanged.
        assert_eq!(eval(&t.prog, t.audit, nr, [3, 0, key[0], key[1], 0, 0]), EPERM);
        for name in DENIED.iter().filter(|n| **n != "setns") {
            assert_eq!(eval(&keyed, t.audit, t.nr(name), [0; 6]), EPERM, "{name}");
        }
    }
}
