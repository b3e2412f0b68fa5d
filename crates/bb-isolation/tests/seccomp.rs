//! Root-only: install the default policy in a forked child and probe real syscalls. The same
//! probes run in a child without the filter first, to show that every denied result really
//! comes from the filter.

mod common;

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::time::Duration;

use bb_isolation::SeccompFilter;
use common::*;
use nix::sys::wait::WaitStatus;

/// Probe indices. Each probe stores 0 for success or the errno it failed with.
#[derive(Debug, Clone, Copy)]
#[repr(usize)]
enum P {
    Mount,
    UnshareUser,
    UnshareMount,
    Keyctl,
    Bpf,
    Clone3,
    CloneNewUser,
    PersonalityNoAslr,
    PersonalityQuery,
    OpenTreeAttr,
    MountSetattr,
    IoUringSetup,
    Fork,
    Thread,
    ExecTrue,
    CommandTrue,
    Getpid,
}
const N: usize = P::Getpid as usize + 1;
const OPEN_TREE_ATTR: libc::c_long = 467;

/// Result of a raw syscall: 0 on success, errno on failure.
fn rc(ret: libc::c_long) -> i32 {
    if ret < 0 {
        errno()
    } else {
        0
    }
}

/// Fork; in the grandchild run `f` and _exit with its value; return the grandchild's exit code
/// (or 1000 + signal) or the fork errno as a negative number.
fn in_grandchild(f: impl FnOnce() -> i32) -> i32 {
    // SAFETY: plain fork from the single-threaded probe child.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return -errno();
    }
    if pid == 0 {
        let code = f();
        // SAFETY: leave the grandchild immediately.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child with a valid status pointer.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        1000 + libc::WTERMSIG(status)
    }
}

fn probe() -> [i32; N] {
    let mut r = [0i32; N];
    let target = c"/nonexistent-bbtest-target";
    // SAFETY: for all raw syscalls below, the arguments are valid pointers to NUL-terminated
    // strings, null pointers where the kernel accepts them, or plain integers; failures only set
    // errno.
    unsafe {
        // First: after unshare(CLONE_NEWUSER) our uid is unmapped and nesting would fail.
        let ret = libc::syscall(libc::SYS_clone, (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong, 0, 0, 0, 0);
        if ret == 0 {
            libc::_exit(0); // the clone child (only without the filter)
        }
        if ret > 0 {
            libc::waitpid(ret as libc::pid_t, std::ptr::null_mut(), 0);
        }
        r[P::CloneNewUser as usize] = rc(ret);
        r[P::Mount as usize] =
            rc(libc::mount(c"none".as_ptr(), target.as_ptr(), c"tmpfs".as_ptr(), 0, std::ptr::null()) as _);
        r[P::UnshareUser as usize] = rc(libc::unshare(libc::CLONE_NEWUSER) as _);
        r[P::UnshareMount as usize] = rc(libc::unshare(libc::CLONE_NEWNS) as _);
        // KEYCTL_GET_KEYRING_ID(KEY_SPEC_SESSION_KEYRING, create = 0)
        r[P::Keyctl as usize] = rc(libc::syscall(libc::SYS_keyctl, 0, -3, 0));
        // BPF_MAP_CREATE with a null attr: EFAULT/EINVAL without the filter.
        r[P::Bpf as usize] = rc(libc::syscall(libc::SYS_bpf, 0, 0, 0));
        // clone3(NULL, 0): EINVAL without the filter.
        r[P::Clone3 as usize] = rc(libc::syscall(libc::SYS_clone3, 0, 0));
        r[P::PersonalityNoAslr as usize] = rc(libc::personality(libc::ADDR_NO_RANDOMIZE as _) as _);
        r[P::PersonalityQuery as usize] = rc(libc::personality(0xffff_ffff) as _);
        r[P::OpenTreeAttr as usize] = rc(libc::syscall(OPEN_TREE_ATTR, -1, 0, 0, 0, 0));
        r[P::MountSetattr as usize] = rc(libc::syscall(libc::SYS_mount_setattr, -1, 0, 0, 0, 0));
        r[P::IoUringSetup as usize] = rc(libc::syscall(libc::SYS_io_uring_setup, 1, 0));
        r[P::Getpid as usize] = rc(libc::syscall(libc::SYS_getpid));
    }
    r[P::Fork as usize] = in_grandchild(|| 7) - 7;
    r[P::Thread as usize] = match std::thread::Builder::new().spawn(|| 42).map(|h| h.join()) {
        Ok(Ok(42)) => 0,
        Ok(_) => 201,
        Err(e) => e.raw_os_error().unwrap_or(202),
    };
    r[P::ExecTrue as usize] = in_grandchild(|| {
        let path = CString::new("/bin/true").unwrap();
        let argv = [path.as_ptr(), std::ptr::null()];
        // SAFETY: NUL-terminated path and a null-terminated argv.
        unsafe { libc::execv(path.as_ptr(), argv.as_ptr()) };
        100 + errno()
    });
    r[P::CommandTrue as usize] = match std::process::Command::new("/bin/true").status() {
        Ok(s) if s.success() => 0,
        Ok(s) => 300 + s.code().unwrap_or(99),
        Err(e) => e.raw_os_error().unwrap_or(399),
    };
    r
}

/// How a probe child installs the filter.
#[derive(Clone, Copy)]
enum Apply {
    WithNoNewPrivs,
    KeepingSetuid,
}

/// Run `probe` in a forked child, optionally after applying the default policy.
fn run_probe(filter: Option<(&SeccompFilter, Apply)>) -> ([i32; N], String) {
    let results = new_pipe();
    let out = results.write.as_raw_fd();
    let filter = filter.map(|(f, how)| (f.clone(), how));
    let mut child = fork_gated(move || {
        if let Some((f, how)) = &filter {
            let applied = match how {
                Apply::WithNoNewPrivs => f.apply(),
                Apply::KeepingSetuid => f.apply_keeping_setuid(),
            };
            if applied.is_err() {
                return 10;
            }
        }
        let r = probe();
        let bytes: Vec<u8> = r.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let status = std::fs::read("/proc/self/status").unwrap_or_default();
        let len = (status.len() as u32).to_ne_bytes();
        if raw_write(out, &bytes) && raw_write(out, &len) && raw_write(out, &status) {
            0
        } else {
            11
        }
    });
    child.release();
    let raw = read_exact_timeout(&results.read, N * 4 + 4, Duration::from_secs(10));
    let mut r = [0i32; N];
    for (i, chunk) in raw[..N * 4].chunks(4).enumerate() {
        r[i] = i32::from_ne_bytes(chunk.try_into().unwrap());
    }
    let len = u32::from_ne_bytes(raw[N * 4..].try_into().unwrap()) as usize;
    let status = read_exact_timeout(&results.read, len, Duration::from_secs(5));
    assert_eq!(child.wait(Duration::from_secs(10)), WaitStatus::Exited(child.pid, 0));
    (r, String::from_utf8(status).unwrap())
}

#[test]
fn default_policy_denies_what_it_should_and_allows_fork_threads_exec() {
    require_root();
    let filter = SeccompFilter::default_policy().unwrap();

    let (without, status0) = run_probe(None);
    eprintln!("without filter: {without:?}");
    assert_eq!(status_field(&status0, "Seccomp"), "0");
    // Every denial checked below must differ from the unfiltered behaviour.
    let differs = |p: P, from: i32| {
        assert_ne!(without[p as usize], from, "{p:?} gives {from} even without the filter: probe proves nothing");
    };
    differs(P::Mount, libc::EPERM);
    differs(P::UnshareUser, libc::EPERM);
    differs(P::UnshareMount, libc::EPERM);
    differs(P::Keyctl, libc::EPERM);
    differs(P::Bpf, libc::EPERM);
    differs(P::Clone3, libc::ENOSYS);
    differs(P::CloneNewUser, libc::EPERM);
    differs(P::PersonalityNoAslr, libc::EPERM);
    differs(P::MountSetattr, libc::EPERM);
    differs(P::IoUringSetup, libc::EPERM);
    assert_ne!(without[P::OpenTreeAttr as usize], libc::ENOSYS, "syscall 467 is not open_tree_attr here");
    differs(P::OpenTreeAttr, libc::EPERM);

    for how in [Apply::WithNoNewPrivs, Apply::KeepingSetuid] {
        let (with, status) = run_probe(Some((&filter, how)));
        eprintln!("with filter:    {with:?}");
        expect_filtered(&with);
        // One filter (the policy's two filters are linked into a single program); apply() set
        // no_new_privs, apply_keeping_setuid() did not.
        assert_eq!(status_field(&status, "Seccomp"), "2");
        assert_eq!(status_field(&status, "Seccomp_filters"), "1");
        let nnp = if matches!(how, Apply::WithNoNewPrivs) { "1" } else { "0" };
        assert_eq!(status_field(&status, "NoNewPrivs"), nnp);
    }
}

/// What the default policy answers each probe.
fn expect_filtered(with: &[i32; N]) {
    let expect = |p: P, want: i32| assert_eq!(with[p as usize], want, "{p:?}");
    expect(P::Mount, libc::EPERM);
    expect(P::UnshareUser, libc::EPERM);
    expect(P::UnshareMount, libc::EPERM);
    expect(P::Keyctl, libc::EPERM);
    expect(P::Bpf, libc::EPERM);
    expect(P::Clone3, libc::ENOSYS);
    expect(P::CloneNewUser, libc::EPERM);
    expect(P::PersonalityNoAslr, libc::EPERM);
    expect(P::PersonalityQuery, 0);
    expect(P::OpenTreeAttr, libc::EPERM);
    expect(P::MountSetattr, libc::EPERM);
    expect(P::IoUringSetup, libc::EPERM);
    expect(P::Getpid, 0);
    expect(P::Fork, 0);
    expect(P::Thread, 0);
    expect(P::ExecTrue, 0);
    expect(P::CommandTrue, 0);
}

/// Without CAP_SYS_ADMIN (capabilities dropped to Docker's set, as every sandbox process has
/// them), the kernel refuses a filter without no_new_privs: init must apply it first.
#[test]
fn keeping_setuid_needs_cap_sys_admin() {
    require_root();
    let filter = SeccompFilter::default_policy().unwrap();
    let mut child = fork_gated(move || {
        if bb_isolation::drop_capabilities().is_err() {
            return 10;
        }
        match filter.apply_keeping_setuid() {
            Ok(()) => 11,
            Err(_) if errno() == libc::EACCES => 0,
            Err(_) => 12,
        }
    });
    child.release();
    assert_eq!(child.wait(Duration::from_secs(10)), WaitStatus::Exited(child.pid, 0));
}

#[test]
fn filter_is_inherited_across_exec() {
    require_root();
    let filter = SeccompFilter::default_policy().unwrap();
    let out = new_pipe();
    let w = out.write.as_raw_fd();
    let mut child = fork_gated(move || {
        if filter.apply().is_err() {
            return 10;
        }
        // SAFETY: dup2 of valid fds.
        unsafe { libc::dup2(w, 1) };
        let sh = CString::new("/bin/sh").unwrap();
        let c = CString::new("-c").unwrap();
        // A fresh program after execve still cannot unshare a user namespace, and sees the filter.
        let script = CString::new(
            "grep -E '^Seccomp(_filters)?:' /proc/self/status; \
             unshare -U true 2>&1; echo unshare-exit=$?",
        )
        .unwrap();
        let argv = [sh.as_ptr(), c.as_ptr(), script.as_ptr(), std::ptr::null()];
        // SAFETY: NUL-terminated strings and a null-terminated argv.
        unsafe { libc::execv(sh.as_ptr(), argv.as_ptr()) };
        12
    });
    child.release();
    assert_eq!(child.wait(Duration::from_secs(10)), WaitStatus::Exited(child.pid, 0));
    drop(out.write);
    let mut text = String::new();
    loop {
        let mut buf = [0u8; 512];
        match nix::unistd::read(out.read.as_raw_fd(), &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => text.push_str(std::str::from_utf8(&buf[..n]).unwrap()),
        }
    }
    assert!(text.contains("Seccomp:\t2"), "{text}");
    // util-linux reports the EPERM from unshare(2); "not found" would fail this test.
    assert!(text.contains("Operation not permitted") && text.contains("unshare-exit=1"), "{text}");
}
