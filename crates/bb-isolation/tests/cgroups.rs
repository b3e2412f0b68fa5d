//! Root-only: real cgroups on this host (v1 or v2, whatever `CgroupLayout::detect` finds).

mod common;

use std::fs;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use bb_isolation::{Cgroup, CgroupVersion, IsolationError, Limits};
use common::*;
use nix::sys::signal::Signal;
use nix::sys::wait::WaitStatus;

const MIB: u64 = 1 << 20;

#[test]
fn detect_finds_a_usable_layout() {
    let guard = ParentGuard::new();
    let layout = &guard.layout;
    eprintln!("detected cgroup {} with roots {:?}", layout.version(), layout.roots());
    for (controller, root) in layout.roots() {
        assert!(root.join("cgroup.procs").exists(), "{controller}: {} is not a cgroupfs", root.display());
    }
    match layout.version() {
        CgroupVersion::V1 => {
            for c in ["memory", "cpu", "pids", "freezer"] {
                assert!(layout.roots().iter().any(|(n, _)| n == c), "v1 layout lacks {c}");
            }
        }
        CgroupVersion::V2 => {
            let ctrl = fs::read_to_string(layout.roots()[0].1.join("cgroup.controllers")).unwrap();
            for c in ["memory", "cpu", "pids"] {
                assert!(ctrl.split_whitespace().any(|x| x == c), "v2 root lacks {c}");
            }
        }
    }
}

#[test]
fn pids_limit_contains_a_fork_bomb_and_destroy_leaves_nothing() {
    let t = TestGroup::new("bomb", Limits { pids: Some(10), ..Default::default() });
    let result = new_pipe();
    let out = result.write.as_raw_fd();
    let mut child = fork_gated(move || {
        let (mut forked, mut err) = (0i32, 0i32);
        for _ in 0..100 {
            // SAFETY: plain fork in a single-threaded child; grandchildren only pause.
            match unsafe { libc::fork() } {
                0 => loop {
                    // SAFETY: pause has no arguments.
                    unsafe { libc::pause() };
                },
                -1 => {
                    err = errno();
                    break;
                }
                _ => forked += 1,
            }
        }
        let mut msg = [0u8; 8];
        msg[..4].copy_from_slice(&forked.to_ne_bytes());
        msg[4..].copy_from_slice(&err.to_ne_bytes());
        raw_write(out, &msg);
        loop {
            // SAFETY: pause has no arguments.
            unsafe { libc::pause() };
        }
    });
    t.cg.add_pid(child.pid()).unwrap();
    child.release();

    let msg = read_exact_timeout(&result.read, 8, Duration::from_secs(10));
    let forked = i32::from_ne_bytes(msg[..4].try_into().unwrap());
    let err = i32::from_ne_bytes(msg[4..].try_into().unwrap());
    assert_eq!(err, libc::EAGAIN, "fork must fail with EAGAIN once pids.max is reached");
    assert_eq!(forked, 9, "10 tasks allowed: the child plus 9 forks");
    assert_eq!(t.cg.pids().unwrap().len(), 10);
    assert_eq!(t.cg.stats().unwrap().pids_current, 10);

    t.cg.kill_all().unwrap();
    assert_eq!(t.cg.pids().unwrap(), Vec::<i32>::new());
    match child.wait(Duration::from_secs(5)) {
        WaitStatus::Signaled(_, Signal::SIGKILL, _) => {}
        other => panic!("child should have been SIGKILLed, got {other:?}"),
    }

    t.cg.destroy().unwrap();
    for p in t.cg.paths() {
        assert!(!p.exists(), "{} left behind", p.display());
    }
    t.cg.destroy().unwrap(); // idempotent
    assert!(matches!(Cgroup::open(&t.guard.layout, "bomb"), Err(IsolationError::NotFound { .. })));
    t.guard.layout.remove_parent().unwrap();
    for p in t.guard.parent_dirs() {
        assert!(!p.exists(), "{} left behind", p.display());
    }
}

#[test]
fn memory_limit_oom_kills_and_is_counted() {
    let t = TestGroup::new("oom", Limits { memory_bytes: Some(32 * MIB), ..Default::default() });
    assert_eq!(t.cg.stats().unwrap().oom_kills, 0);
    let mut child = fork_gated(|| {
        let len = 200 * MIB as usize;
        // SAFETY: fresh anonymous private mapping, no aliasing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return 3;
        }
        for off in (0..len).step_by(4096) {
            // SAFETY: within the mapping just created; volatile so the touch is not elided.
            unsafe { std::ptr::write_volatile(p.cast::<u8>().add(off), 1) };
        }
        0 // survived: the limit did not work
    });
    t.cg.add_pid(child.pid()).unwrap();
    child.release();
    match child.wait(Duration::from_secs(10)) {
        WaitStatus::Signaled(_, Signal::SIGKILL, _) => {}
        other => {
            panic!("child allocating 200 MiB under a 32 MiB limit was not OOM-killed: {other:?}")
        }
    }
    let stats = t.cg.stats().unwrap();
    assert!(stats.oom_kills >= 1, "{stats:?}");
    assert!(stats.memory_peak_bytes <= 32 * MIB, "peak above the limit: {stats:?}");
    assert!(stats.memory_peak_bytes >= 16 * MIB, "the child never got near the limit: {stats:?}");
}

#[test]
fn freeze_stops_progress_and_thaw_resumes_it() {
    let t = TestGroup::new("freeze", Limits::default());
    let progress = new_pipe();
    let out = progress.write.as_raw_fd();
    let mut child = fork_gated(move || loop {
        if !raw_write(out, b".") {
            return 2;
        }
        let ts = libc::timespec { tv_sec: 0, tv_nsec: 5_000_000 };
        // SAFETY: valid timespec, no remainder wanted.
        unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
    });
    t.cg.add_pid(child.pid()).unwrap();
    child.release();
    read_exact_timeout(&progress.read, 3, Duration::from_secs(5)); // it runs

    let start = Instant::now();
    t.cg.freeze().unwrap();
    eprintln!("freeze took {:?}", start.elapsed());
    drain(&progress.read);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(drain(&progress.read), 0, "a frozen child made progress");

    t.cg.thaw().unwrap();
    read_exact_timeout(&progress.read, 3, Duration::from_secs(2)); // runs again

    // Freeze, then kill_all: must also work on a frozen group.
    t.cg.freeze().unwrap();
    t.cg.kill_all().unwrap();
    assert!(matches!(child.wait(Duration::from_secs(5)), WaitStatus::Signaled(_, Signal::SIGKILL, _)));
}

#[test]
fn kill_all_wins_against_a_forking_swarm() {
    let t = TestGroup::new("swarm", Limits { pids: Some(64), ..Default::default() });
    let mut child = fork_gated(|| loop {
        // Every process keeps forking; children do the same.
        // SAFETY: plain fork in a single-threaded process.
        unsafe { libc::fork() };
    });
    t.cg.add_pid(child.pid()).unwrap();
    child.release();
    let deadline = Instant::now() + Duration::from_secs(5);
    while t.cg.pids().unwrap().len() < 32 {
        assert!(Instant::now() < deadline, "swarm did not grow");
        std::thread::sleep(Duration::from_millis(5));
    }
    let start = Instant::now();
    t.cg.kill_all().unwrap();
    eprintln!("kill_all of the swarm took {:?}", start.elapsed());
    assert!(t.cg.pids().unwrap().is_empty());
    assert!(matches!(child.wait(Duration::from_secs(5)), WaitStatus::Signaled(_, Signal::SIGKILL, _)));
    t.cg.destroy().unwrap();
}

#[test]
fn limits_are_accepted_by_the_kernel_raised_lowered_and_removed() {
    let limits = Limits { memory_bytes: Some(64 * MIB), cpu_millis: Some(500), pids: Some(50) };
    let t = TestGroup::new("limits", limits);
    let dir = |controller: &str| {
        let root = match t.guard.layout.version() {
            CgroupVersion::V1 => t.guard.layout.roots().iter().find(|(c, _)| c == controller).unwrap().1.clone(),
            CgroupVersion::V2 => t.guard.layout.roots()[0].1.clone(),
        };
        root.join(t.guard.layout.parent()).join("limits")
    };
    let read = |controller: &str, file: &str| fs::read_to_string(dir(controller).join(file)).unwrap().trim().to_owned();
    let check = |mem: &str, cpu: &str, pids: &str| match t.guard.layout.version() {
        CgroupVersion::V1 => {
            assert_eq!(read("memory", "memory.limit_in_bytes"), mem);
            if dir("memory").join("memory.memsw.limit_in_bytes").exists() {
                assert_eq!(read("memory", "memory.memsw.limit_in_bytes"), mem);
            }
            assert_eq!(read("cpu", "cpu.cfs_period_us"), "100000");
            assert_eq!(read("cpu", "cpu.cfs_quota_us"), cpu);
            assert_eq!(read("pids", "pids.max"), pids);
            assert!(read("memory", "memory.oom_control").contains("oom_kill_disable 0"));
        }
        CgroupVersion::V2 => {
            assert_eq!(read("memory", "memory.max"), mem);
            assert_eq!(read("cpu", "cpu.max"), format!("{cpu} 100000"));
            assert_eq!(read("pids", "pids.max"), pids);
        }
    };
    let (unlimited_mem, unlimited_cpu) = match t.guard.layout.version() {
        CgroupVersion::V1 => ("9223372036854771712", "-1"),
        CgroupVersion::V2 => ("max", "max"),
    };
    check("67108864", "50000", "50");
    // Lowering then raising exercises the memsw ordering on v1 (the kernel enforces it).
    t.cg.set_limits(&Limits { memory_bytes: Some(16 * MIB), ..limits }).unwrap();
    check("16777216", "50000", "50");
    t.cg.set_limits(&Limits { memory_bytes: Some(128 * MIB), cpu_millis: Some(2000), pids: Some(7) }).unwrap();
    check("134217728", "200000", "7");
    t.cg.set_limits(&Limits::default()).unwrap();
    check(unlimited_mem, unlimited_cpu, "max");
    t.cg.set_limits(&limits).unwrap();
    check("67108864", "50000", "50");
}

#[test]
fn list_open_and_cleanup_of_strays() {
    let guard = ParentGuard::new();
    let layout = &guard.layout;
    assert_eq!(layout.list().unwrap(), Vec::<String>::new(), "fresh parent must be empty");
    let a = Cgroup::create(layout, "a", &Limits::default()).unwrap();
    Cgroup::create(layout, "b", &Limits { pids: Some(5), ..Default::default() }).unwrap();
    assert_eq!(layout.list().unwrap(), vec!["a", "b"]);
    assert!(matches!(Cgroup::create(layout, "a", &Limits::default()), Err(IsolationError::AlreadyExists { .. })));

    // "Daemon restart": re-attach by name, with a live process inside.
    let mut child = fork_gated(|| loop {
        // SAFETY: pause has no arguments.
        unsafe { libc::pause() };
    });
    a.add_pid(child.pid()).unwrap();
    child.release();
    let reopened = Cgroup::open(layout, "a").unwrap();
    assert_eq!(reopened.pids().unwrap(), vec![child.pid()]);
    match (layout.version(), reopened.dir_fd().unwrap()) {
        (CgroupVersion::V1, None) => {}
        (CgroupVersion::V2, Some(fd)) => assert!(fd.as_raw_fd() >= 0),
        (v, fd) => panic!("dir_fd on {v}: {fd:?}"),
    }

    // Stray cleanup as the daemon would do it; destroy kills the live member.
    for name in layout.list().unwrap() {
        Cgroup::open(layout, &name).unwrap().destroy().unwrap();
    }
    assert!(matches!(child.wait(Duration::from_secs(5)), WaitStatus::Signaled(_, Signal::SIGKILL, _)));
    assert_eq!(layout.list().unwrap(), Vec::<String>::new());
    layout.remove_parent().unwrap();
    for p in guard.parent_dirs() {
        assert!(!p.exists(), "{} left behind", p.display());
    }
}
