//! Unit tests against a fake cgroupfs in a tempdir (no root needed).

use std::fs;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::*;

const MIB: u64 = 1 << 20;

/// A tempdir laid out like /sys/fs/cgroup with the v1 hierarchies this crate uses.
fn v1_fixture(parent: &str) -> (tempfile::TempDir, CgroupLayout) {
    let tmp = tempfile::tempdir().unwrap();
    let roots: Vec<(String, PathBuf)> = V1_CONTROLLERS
        .iter()
        .map(|c| {
            let p = tmp.path().join(c);
            fs::create_dir(&p).unwrap();
            fs::write(p.join("cgroup.procs"), "1\n").unwrap();
            (c.to_string(), p)
        })
        .collect();
    let mut layout = CgroupLayout::with_roots(CgroupVersion::V1, roots, parent);
    layout.fake_kernel = true;
    (tmp, layout)
}

/// A tempdir laid out like a v2 /sys/fs/cgroup whose root has not enabled any controllers yet.
fn v2_fixture(parent: &str, root_subtree: &str) -> (tempfile::TempDir, CgroupLayout) {
    let tmp = tempfile::tempdir().unwrap();
    fs::write(tmp.path().join("cgroup.controllers"), "cpuset cpu io memory pids\n").unwrap();
    fs::write(tmp.path().join("cgroup.subtree_control"), root_subtree).unwrap();
    let mut layout =
        CgroupLayout::with_roots(CgroupVersion::V2, vec![("unified".into(), tmp.path().to_owned())], parent);
    layout.fake_kernel = true;
    (tmp, layout)
}

fn read(p: &Path) -> String {
    fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn limits() -> Limits {
    Limits { memory_bytes: Some(64 * MIB), cpu_millis: Some(1500), pids: Some(100) }
}

#[test]
fn v1_create_writes_every_limit_file() {
    let (tmp, layout) = v1_fixture("bb");
    let cg = Cgroup::create(&layout, "sb1", &limits()).unwrap();
    assert_eq!(cg.name(), "sb1");
    let g = |c: &str| tmp.path().join(c).join("bb/sb1");
    assert_eq!(read(&g("memory").join("memory.limit_in_bytes")), "67108864");
    assert_eq!(read(&g("memory").join("memory.memsw.limit_in_bytes")), "67108864");
    assert_eq!(read(&g("memory").join("memory.oom_control")), "0");
    assert_eq!(read(&g("cpu").join("cpu.cfs_period_us")), "100000");
    assert_eq!(read(&g("cpu").join("cpu.cfs_quota_us")), "150000");
    assert_eq!(read(&g("pids").join("pids.max")), "100");
    assert!(g("freezer").is_dir(), "freezer group must exist too");
    assert_eq!(cg.paths(), V1_CONTROLLERS.iter().map(|c| g(c)).collect::<Vec<_>>());
    assert!(cg.dir_fd().unwrap().is_none(), "no CLONE_INTO_CGROUP on v1");
}

#[test]
fn v1_unlimited_and_counter_reset() {
    let (tmp, layout) = v1_fixture("bb");
    let cg = Cgroup::create(&layout, "sb1", &limits()).unwrap();
    let mem = tmp.path().join("memory/bb/sb1");
    fs::write(mem.join("memory.max_usage_in_bytes"), "123456\n").unwrap();
    fs::write(mem.join("memory.failcnt"), "7\n").unwrap();
    cg.set_limits(&Limits::default()).unwrap();
    assert_eq!(read(&mem.join("memory.limit_in_bytes")), "-1");
    assert_eq!(read(&mem.join("memory.memsw.limit_in_bytes")), "-1");
    assert_eq!(read(&tmp.path().join("cpu/bb/sb1/cpu.cfs_quota_us")), "-1");
    assert_eq!(read(&tmp.path().join("pids/bb/sb1/pids.max")), "max");
    assert_eq!(read(&mem.join("memory.max_usage_in_bytes")), "0");
    assert_eq!(read(&mem.join("memory.failcnt")), "0");
}

#[test]
fn v1_memory_without_memsw_file() {
    let (tmp, layout) = v1_fixture("bb");
    let cg = Cgroup::create(&layout, "sb1", &Limits::default()).unwrap();
    let mem = tmp.path().join("memory/bb/sb1");
    fs::remove_file(mem.join("memory.memsw.limit_in_bytes")).unwrap();
    cg.set_limits(&Limits { memory_bytes: Some(32 * MIB), ..Default::default() }).unwrap();
    assert_eq!(read(&mem.join("memory.limit_in_bytes")), "33554432");
    assert!(!mem.join("memory.memsw.limit_in_bytes").exists(), "must not create memsw");
}

#[test]
fn memsw_ordering() {
    // Raising (or removing) the limit: memsw first; lowering: the limit first.
    assert!(memsw_first(32 * MIB, Some(64 * MIB)));
    assert!(memsw_first(32 * MIB, Some(32 * MIB)));
    assert!(memsw_first(32 * MIB, None));
    assert!(!memsw_first(64 * MIB, Some(32 * MIB)));
    assert!(!memsw_first(u64::MAX / 2, Some(32 * MIB)));
}

#[test]
fn create_twice_is_already_exists_and_keeps_the_group() {
    let (tmp, layout) = v1_fixture("bb");
    Cgroup::create(&layout, "sb1", &limits()).unwrap();
    let err = Cgroup::create(&layout, "sb1", &limits()).unwrap_err();
    assert!(matches!(err, IsolationError::AlreadyExists { .. }), "{err}");
    assert!(err.to_string().contains("Cgroup::open"), "{err}");
    for c in V1_CONTROLLERS {
        assert!(tmp.path().join(c).join("bb/sb1").is_dir());
    }
}

#[test]
fn partial_existing_group_is_rolled_back_not_reused() {
    let (tmp, layout) = v1_fixture("bb");
    // A stray left in the pids hierarchy only: create must fail and remove what it made.
    fs::create_dir_all(tmp.path().join("pids/bb/sb1")).unwrap();
    let err = Cgroup::create(&layout, "sb1", &limits()).unwrap_err();
    assert!(err.to_string().contains("pids/bb/sb1"), "{err}");
    assert!(!tmp.path().join("memory/bb/sb1").exists());
    assert!(!tmp.path().join("cpu/bb/sb1").exists());
    assert!(tmp.path().join("pids/bb/sb1").exists(), "the stray is not ours to delete");
    // open() still finds it, so it can be destroyed.
    let cg = Cgroup::open(&layout, "sb1").unwrap();
    cg.destroy().unwrap();
    assert!(!tmp.path().join("pids/bb/sb1").exists());
}

#[test]
fn failed_limit_write_rolls_back_and_names_the_file() {
    let (tmp, mut layout) = v1_fixture("bb");
    layout.fake_kernel = false; // mkdir makes empty dirs: every control file is "missing"
    let err = Cgroup::create(&layout, "sb1", &limits()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("memory/bb/sb1/memory.limit_in_bytes"), "{msg}");
    assert!(msg.contains("\"67108864\""), "{msg}");
    for c in V1_CONTROLLERS {
        assert!(!tmp.path().join(c).join("bb/sb1").exists(), "{c} not rolled back");
        assert!(tmp.path().join(c).join("bb").is_dir(), "parent stays");
    }
}

#[test]
fn invalid_input_creates_nothing() {
    let (tmp, layout) = v1_fixture("bb");
    for bad in ["", "..", ".hidden", "a/b", "a b", "x\n"] {
        let err = Cgroup::create(&layout, bad, &limits()).unwrap_err();
        assert!(matches!(err, IsolationError::InvalidName { .. }), "{bad:?}: {err}");
    }
    let err = Cgroup::create(&layout, "ok", &Limits { pids: Some(0), ..Default::default() }).unwrap_err();
    assert!(matches!(err, IsolationError::InvalidLimits(_)), "{err}");
    assert!(!tmp.path().join("memory/bb").exists(), "nothing may be created for invalid input");
    let bad_parent = CgroupLayout::with_roots(CgroupVersion::V1, layout.roots().to_vec(), "../x");
    assert!(matches!(bad_parent.list(), Err(IsolationError::InvalidName { .. })));
}

#[test]
fn limits_validation() {
    assert!(Limits::default().validate().is_ok());
    assert!(limits().validate().is_ok());
    let e = Limits { memory_bytes: Some(4096), ..Default::default() }.validate().unwrap_err();
    assert!(e.to_string().contains("1 MiB"), "{e}");
    let e = Limits { cpu_millis: Some(5), ..Default::default() }.validate().unwrap_err();
    assert!(e.to_string().contains("cpu_millis = 5"), "{e}");
    assert!(Limits { cpu_millis: Some(10), ..Default::default() }.validate().is_ok());
}

#[test]
fn names() {
    for ok in ["branchbox", "bbtest-123-4", "sb_1.a@b:c", "0f8fad5b-d9cb-469f-a165-70867728950e"] {
        validate_name(ok).unwrap();
    }
    assert!(validate_name(&"a".repeat(201)).is_err());
}

#[test]
fn add_pid_pids_list_open_destroy() {
    let (tmp, layout) = v1_fixture("bb");
    let cg = Cgroup::create(&layout, "sb1", &limits()).unwrap();
    Cgroup::create(&layout, "sb2", &limits()).unwrap();
    assert_eq!(layout.list().unwrap(), vec!["sb1", "sb2"]);

    cg.add_pid(4242).unwrap();
    for c in V1_CONTROLLERS {
        assert_eq!(read(&tmp.path().join(c).join("bb/sb1/cgroup.procs")), "4242");
    }
    // Union over hierarchies, sorted and deduplicated.
    fs::write(tmp.path().join("pids/bb/sb1/cgroup.procs"), "4242\n17\n").unwrap();
    assert_eq!(cg.pids().unwrap(), vec![17, 4242]);

    let reopened = Cgroup::open(&layout, "sb1").unwrap();
    assert_eq!(reopened.paths(), cg.paths());

    // The fake has no processes to kill: clear the member lists, then destroy twice.
    for c in V1_CONTROLLERS {
        fs::write(tmp.path().join(c).join("bb/sb1/cgroup.procs"), "").unwrap();
    }
    cg.destroy().unwrap();
    cg.destroy().unwrap();
    for p in cg.paths() {
        assert!(!p.exists(), "{} left behind", p.display());
    }
    assert!(matches!(Cgroup::open(&layout, "sb1"), Err(IsolationError::NotFound { .. })));
    assert!(matches!(cg.pids(), Err(IsolationError::NotFound { .. })));
    assert_eq!(layout.list().unwrap(), vec!["sb2"]);

    // The parent cannot go while sb2 lives; afterwards it can, and twice.
    assert!(layout.remove_parent().is_err());
    Cgroup::open(&layout, "sb2").unwrap().destroy().unwrap();
    layout.remove_parent().unwrap();
    layout.remove_parent().unwrap();
    assert!(!tmp.path().join("memory/bb").exists());
    assert_eq!(layout.list().unwrap(), Vec::<String>::new());
}

#[test]
fn v1_freeze_and_thaw_write_freezer_state() {
    let (tmp, layout) = v1_fixture("bb");
    let cg = Cgroup::create(&layout, "sb1", &limits()).unwrap();
    let state = tmp.path().join("freezer/bb/sb1/freezer.state");
    cg.freeze().unwrap();
    assert_eq!(read(&state), "FROZEN");
    cg.thaw().unwrap();
    assert_eq!(read(&state), "THAWED");
}

#[test]
fn v1_stats_parse_the_right_files() {
    let (tmp, layout) = v1_fixture("bb");
    let cg = Cgroup::create(&layout, "sb1", &limits()).unwrap();
    let mem = tmp.path().join("memory/bb/sb1");
    fs::write(mem.join("memory.usage_in_bytes"), "1000\n").unwrap();
    fs::write(mem.join("memory.max_usage_in_bytes"), "5000\n").unwrap();
    fs::write(mem.join("memory.oom_control"), "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n").unwrap();
    fs::write(tmp.path().join("pids/bb/sb1/pids.current"), "3\n").unwrap();
    let s = cg.stats().unwrap();
    assert_eq!(s, CgroupStats { memory_bytes: 1000, memory_peak_bytes: 5000, oom_kills: 2, pids_current: 3 });
    // Pre-4.13 kernels have no oom_kill line.
    fs::write(mem.join("memory.oom_control"), "oom_kill_disable 0\nunder_oom 0\n").unwrap();
    assert_eq!(cg.stats().unwrap().oom_kills, 0);
}

#[test]
fn missing_hierarchy_is_reported_by_name() {
    let (_tmp, full) = v1_fixture("bb");
    let roots: Vec<_> = full.roots().iter().filter(|(c, _)| c != "freezer").cloned().collect();
    let mut layout = CgroupLayout::with_roots(CgroupVersion::V1, roots, "bb");
    layout.fake_kernel = true;
    let cg = Cgroup::create(&layout, "sb1", &limits()).unwrap();
    let err = cg.freeze().unwrap_err();
    assert!(matches!(err, IsolationError::MissingController { controller: "freezer", .. }), "{err}");
}

#[test]
fn v2_create_enables_controllers_and_writes_limits() {
    let (tmp, layout) = v2_fixture("bb", "");
    let cg = Cgroup::create(&layout, "sb1", &limits()).unwrap();
    assert_eq!(read(&tmp.path().join("cgroup.subtree_control")), "+memory +cpu +pids");
    assert_eq!(read(&tmp.path().join("bb/cgroup.subtree_control")), "+memory +cpu +pids");
    let g = tmp.path().join("bb/sb1");
    assert_eq!(read(&g.join("memory.max")), "67108864");
    assert_eq!(read(&g.join("memory.swap.max")), "0");
    assert_eq!(read(&g.join("cpu.max")), "150000 100000");
    assert_eq!(read(&g.join("pids.max")), "100");

    cg.set_limits(&Limits::default()).unwrap();
    assert_eq!(read(&g.join("memory.max")), "max");
    assert_eq!(read(&g.join("memory.swap.max")), "0", "swap stays off");
    assert_eq!(read(&g.join("cpu.max")), "max 100000");
    assert_eq!(read(&g.join("pids.max")), "max");

    let fd = cg.dir_fd().unwrap().expect("v2 has a dir fd");
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).unwrap();
    assert_eq!(st.st_mode & libc::S_IFMT, libc::S_IFDIR);
    let flags = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFD).unwrap();
    assert_ne!(flags & libc::FD_CLOEXEC, 0, "fd must be close-on-exec");
}

#[test]
fn v2_only_enables_missing_controllers() {
    let (tmp, layout) = v2_fixture("bb", "cpu memory pids\n");
    Cgroup::create(&layout, "sb1", &limits()).unwrap();
    assert_eq!(read(&tmp.path().join("cgroup.subtree_control")), "cpu memory pids\n", "untouched");
    let (tmp, layout) = v2_fixture("bb", "memory io\n");
    Cgroup::create(&layout, "sb1", &limits()).unwrap();
    assert_eq!(read(&tmp.path().join("cgroup.subtree_control")), "+cpu +pids");
}

#[test]
fn v2_freeze_waits_for_events_and_times_out() {
    let (tmp, layout) = v2_fixture("bb", "");
    let cg = Cgroup::create(&layout, "sb1", &limits()).unwrap();
    let g = tmp.path().join("bb/sb1");

    fs::write(g.join("cgroup.events"), "populated 1\nfrozen 1\n").unwrap();
    cg.freeze().unwrap();
    assert_eq!(read(&g.join("cgroup.freeze")), "1");
    cg.thaw().unwrap();
    assert_eq!(read(&g.join("cgroup.freeze")), "0");

    // The "kernel" never reports frozen: bounded wait, then thaw and a clear error.
    fs::write(g.join("cgroup.events"), "populated 1\nfrozen 0\n").unwrap();
    let start = Instant::now();
    let err = cg.freeze().unwrap_err();
    assert!(start.elapsed() >= FREEZE_TIMEOUT && start.elapsed() < FREEZE_TIMEOUT * 2);
    assert!(matches!(err, IsolationError::Timeout { what: "freeze", .. }), "{err}");
    assert!(err.to_string().contains("frozen 0"), "{err}");
    assert_eq!(read(&g.join("cgroup.freeze")), "0", "must be thawed after a failed freeze");
}

#[test]
fn v2_kill_all_uses_cgroup_kill_and_stats() {
    let (tmp, layout) = v2_fixture("bb", "");
    let cg = Cgroup::create(&layout, "sb1", &limits()).unwrap();
    let g = tmp.path().join("bb/sb1");
    cg.kill_all().unwrap();
    assert_eq!(read(&g.join("cgroup.kill")), "1");

    fs::write(g.join("memory.current"), "100\n").unwrap();
    fs::write(g.join("memory.peak"), "900\n").unwrap();
    fs::write(g.join("memory.events"), "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n").unwrap();
    fs::write(g.join("pids.current"), "2\n").unwrap();
    let s = cg.stats().unwrap();
    assert_eq!(s, CgroupStats { memory_bytes: 100, memory_peak_bytes: 900, oom_kills: 1, pids_current: 2 });
    fs::remove_file(g.join("memory.peak")).unwrap(); // kernels < 5.19
    assert_eq!(cg.stats().unwrap().memory_peak_bytes, 100);

    cg.destroy().unwrap();
    assert!(!g.exists());
    layout.remove_parent().unwrap();
}

#[test]
fn v1_freezer_pin_is_a_frozen_sibling_of_the_parent_and_not_listed() {
    let (tmp, layout) = v1_fixture("bb");
    assert!(layout.pin_freezer().unwrap());
    assert!(layout.pin_freezer().unwrap(), "pinning twice is fine");
    assert_eq!(read(&tmp.path().join("freezer/bb.freezer-pin/freezer.state")), "FROZEN");
    Cgroup::create(&layout, "sb1", &limits()).unwrap();
    assert_eq!(layout.list().unwrap(), vec!["sb1".to_string()]);
    assert!(!tmp.path().join("memory/bb.freezer-pin").exists(), "only the freezer hierarchy has it");
}

#[test]
fn v2_has_no_freezer_pin() {
    let (tmp, layout) = v2_fixture("bb", "");
    assert!(!layout.pin_freezer().unwrap());
    assert!(!tmp.path().join("bb.freezer-pin").exists());
}
