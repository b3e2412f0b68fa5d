//! Unit tests only: a "kernel" for a cgroupfs lookalike in a tempdir. cgroupfs fills a new group
//! directory with control files and removes them on rmdir; these two functions do the same, with
//! the kernel's default contents, so the production file-writing code can run unchanged.

use std::fs;
use std::path::Path;

use super::CgroupVersion;

const V1_FILES: &[(&str, &str)] = &[
    ("cgroup.procs", ""),
    ("memory.limit_in_bytes", "9223372036854771712\n"),
    ("memory.memsw.limit_in_bytes", "9223372036854771712\n"),
    ("memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n"),
    ("memory.usage_in_bytes", "0\n"),
    ("memory.max_usage_in_bytes", "0\n"),
    ("memory.failcnt", "0\n"),
    ("memory.memsw.max_usage_in_bytes", "0\n"),
    ("memory.memsw.failcnt", "0\n"),
    ("cpu.cfs_period_us", "100000\n"),
    ("cpu.cfs_quota_us", "-1\n"),
    ("pids.max", "max\n"),
    ("pids.current", "0\n"),
    ("freezer.state", "THAWED\n"),
];

const V2_FILES: &[(&str, &str)] = &[
    ("cgroup.procs", ""),
    ("cgroup.controllers", "cpu memory pids\n"),
    ("cgroup.subtree_control", ""),
    ("cgroup.events", "populated 0\nfrozen 0\n"),
    ("cgroup.freeze", "0\n"),
    ("cgroup.kill", ""),
    ("memory.max", "max\n"),
    ("memory.swap.max", "max\n"),
    ("memory.current", "0\n"),
    ("memory.peak", "0\n"),
    ("memory.events", "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n"),
    ("cpu.max", "max 100000\n"),
    ("pids.max", "max\n"),
    ("pids.current", "0\n"),
];

pub(crate) fn populate(version: CgroupVersion, dir: &Path) {
    let files = match version {
        CgroupVersion::V1 => V1_FILES,
        CgroupVersion::V2 => V2_FILES,
    };
    for (name, contents) in files {
        fs::write(dir.join(name), contents).unwrap();
    }
}

pub(crate) fn depopulate(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_file()).unwrap_or(false) {
                fs::remove_file(e.path()).unwrap();
            }
        }
    }
}
