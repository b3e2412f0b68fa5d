//! cgroup management for sandboxes, on cgroup v1 (per-controller hierarchies) and v2 (unified).
//!
//! A sandbox group lives at `<root>/<parent>/<name>` in every hierarchy of the layout: on v2 that
//! is one directory, on v1 one per hierarchy (memory, cpu, pids, freezer; co-mounted controllers
//! share a directory). See the crate documentation for which files are written.

mod cgfs;
mod detect;
#[cfg(test)]
mod fake;

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::error::{IsolationError, Result};

/// The v1 hierarchies a layout needs (`cpuacct` may be co-mounted with `cpu`; it is not used).
pub(crate) const V1_CONTROLLERS: [&str; 4] = ["memory", "cpu", "pids", "freezer"];
/// The v2 controllers that must be available (freezing is built into v2).
pub(crate) const V2_CONTROLLERS: [&str; 3] = ["memory", "cpu", "pids"];
/// CFS period used for CPU limits: `cpu_millis * 100` µs of quota per 100 ms.
pub const CPU_PERIOD_US: u64 = 100_000;
/// Smallest accepted memory limit.
pub const MIN_MEMORY_BYTES: u64 = 1 << 20;
/// Smallest accepted CPU limit (the kernel's minimum quota is 1 ms per period).
pub const MIN_CPU_MILLIS: u32 = 10;

const FREEZE_TIMEOUT: Duration = Duration::from_secs(2);
/// v1: how often the frozen state is written again while the group is still freezing.
const FREEZE_REWRITE: Duration = Duration::from_millis(1);
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
const RMDIR_TIMEOUT: Duration = Duration::from_secs(1);

/// Resource limits of one sandbox. `None` means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// Memory limit in bytes (page cache included). Swap is never available to a sandbox.
    pub memory_bytes: Option<u64>,
    /// CPU bandwidth in thousandths of a CPU: 1000 = one full CPU, 2500 = two and a half.
    pub cpu_millis: Option<u32>,
    /// Maximum number of tasks (processes and threads).
    pub pids: Option<u64>,
}

impl Limits {
    /// Reject values the kernel would refuse or that would leave the sandbox unable to run.
    pub fn validate(&self) -> Result<()> {
        if let Some(m) = self.memory_bytes {
            if m < MIN_MEMORY_BYTES {
                return Err(IsolationError::InvalidLimits(format!(
                    "memory_bytes = {m} is below the minimum of {MIN_MEMORY_BYTES} (1 MiB); \
                     use a larger value or None for unlimited"
                )));
            }
        }
        if let Some(c) = self.cpu_millis {
            if c < MIN_CPU_MILLIS {
                return Err(IsolationError::InvalidLimits(format!(
                    "cpu_millis = {c} is below the minimum of {MIN_CPU_MILLIS} (1% of a CPU, the \
                     kernel's smallest quota of 1 ms per {} ms period); use None for unlimited",
                    CPU_PERIOD_US / 1000
                )));
            }
        }
        if self.pids == Some(0) {
            return Err(IsolationError::InvalidLimits(
                "pids = 0 would stop the sandbox from starting any process; use at least 1, or \
                 None for unlimited"
                    .to_owned(),
            ));
        }
        Ok(())
    }
}

/// Which cgroup API the host offers. Serializes as `"v1"` / `"v2"`, like its `Display`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    /// Legacy: one hierarchy per controller (or group of co-mounted controllers).
    V1,
    /// Unified hierarchy.
    V2,
}

impl std::fmt::Display for CgroupVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        })
    }
}

/// Where the hierarchies are mounted and under which parent group sandboxes live.
#[derive(Debug, Clone)]
pub struct CgroupLayout {
    version: CgroupVersion,
    /// v1: (controller, mount point); v2: ("unified", mount point).
    roots: Vec<(String, PathBuf)>,
    parent: String,
    /// Unit tests only: simulate the kernel populating/depopulating control files in a tempdir.
    #[cfg(test)]
    fake_kernel: bool,
}

impl CgroupLayout {
    /// Detect the layout from /proc/self/mountinfo: v2 if a cgroup2 mount offers the memory, cpu
    /// and pids controllers in its `cgroup.controllers`, otherwise v1 using the memory, cpu, pids
    /// and freezer hierarchies (all four must be mounted). `parent` is the group under which
    /// sandboxes live, e.g. `"branchbox"`.
    pub fn detect(parent: &str) -> Result<CgroupLayout> {
        validate_name(parent)?;
        let source = Path::new("/proc/self/mountinfo");
        let text = cgfs::read(source)?;
        detect::layout_from_mountinfo(&text, source, parent)
    }

    /// Explicit roots, e.g. to point the unit tests at a tempdir. For v1 give one
    /// `(controller, mount point)` pair per controller (memory, cpu, pids, freezer); for v2 one
    /// `("unified", mount point)` pair. Every distinct path is a hierarchy in which groups are
    /// created. Names are validated when the layout is used.
    pub fn with_roots(version: CgroupVersion, roots: Vec<(String, PathBuf)>, parent: &str) -> CgroupLayout {
        CgroupLayout {
            version,
            roots,
            parent: parent.to_owned(),
            #[cfg(test)]
            fake_kernel: false,
        }
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The parent group name given at construction.
    pub fn parent(&self) -> &str {
        &self.parent
    }

    /// The (controller, mount point) pairs of this layout.
    pub fn roots(&self) -> &[(String, PathBuf)] {
        &self.roots
    }

    /// Names of all existing child groups under the parent, sorted (for cleaning up strays after
    /// a crash). A missing parent yields an empty list.
    pub fn list(&self) -> Result<Vec<String>> {
        validate_name(&self.parent)?;
        let mut names = BTreeSet::new();
        for root in self.hierarchies() {
            let dir = root.join(&self.parent);
            let entries = match fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(cgfs::fs_err("list", &dir, e)),
            };
            for entry in entries {
                let entry = entry.map_err(|e| cgfs::fs_err("list", &dir, e))?;
                let is_dir = entry.file_type().map_err(|e| cgfs::fs_err("stat", &entry.path(), e))?.is_dir();
                if is_dir {
                    names.insert(entry.file_name().to_string_lossy().into_owned());
                }
            }
        }
        Ok(names.into_iter().collect())
    }

    /// cgroup v1 only: keep one empty group (`<parent>.freezer-pin`, next to the parent so it is
    /// never taken for a sandbox's) frozen for as long as the host runs. The v1 freezer turns a
    /// kernel static key on when the first group freezes and off when the last one thaws, and
    /// each flip patches kernel text on every CPU (IPIs, dearer still in nested VMs). With the
    /// pin, a freeze and thaw costs far less (BENCHMARKS.md has the figures). Idempotent;
    /// `Ok(false)` on v2 (no static key there).
    pub fn pin_freezer(&self) -> Result<bool> {
        if self.version != CgroupVersion::V1 {
            return Ok(false);
        }
        validate_name(&self.parent)?;
        let dir = self.root_of("freezer", "pin freezer")?.join(format!("{}.freezer-pin", self.parent));
        self.make_dir(&dir)?;
        cgfs::write(&dir.join("freezer.state"), "FROZEN")?;
        Ok(true)
    }

    /// Remove the (empty) parent group from every hierarchy, e.g. on daemon shutdown or at the
    /// end of a test. A parent that is already gone is fine; one that still has child groups is
    /// an error.
    pub fn remove_parent(&self) -> Result<()> {
        validate_name(&self.parent)?;
        for root in self.hierarchies() {
            let dir = root.join(&self.parent);
            match self.remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(cgfs::fs_err("remove directory", &dir, e)),
            }
        }
        Ok(())
    }

    /// Distinct hierarchy roots, in the order given.
    pub(crate) fn hierarchies(&self) -> Vec<&Path> {
        let mut out: Vec<&Path> = Vec::new();
        for (_, p) in &self.roots {
            if !out.contains(&p.as_path()) {
                out.push(p);
            }
        }
        out
    }

    /// Root of the hierarchy that carries `controller` (v2: the unified root).
    fn root_of(&self, controller: &'static str, op: &'static str) -> Result<&Path> {
        let found = match self.version {
            CgroupVersion::V2 => self.roots.first(),
            CgroupVersion::V1 => self.roots.iter().find(|(c, _)| c == controller),
        };
        found.map(|(_, p)| p.as_path()).ok_or(IsolationError::MissingController { controller, op })
    }

    /// Create the parent in every hierarchy; on v2 make memory, cpu and pids available to it and
    /// to its children.
    fn ensure_parent(&self) -> Result<()> {
        if self.version == CgroupVersion::V2 {
            for root in self.hierarchies() {
                enable_v2_controllers(root)?;
            }
        }
        for root in self.hierarchies() {
            let dir = root.join(&self.parent);
            self.make_dir(&dir)?;
            if self.version == CgroupVersion::V2 {
                enable_v2_controllers(&dir)?;
            }
        }
        Ok(())
    }

    /// mkdir; `Ok(false)` if it already existed.
    fn make_dir(&self, path: &Path) -> Result<bool> {
        match fs::create_dir(path) {
            Ok(()) => {
                #[cfg(test)]
                if self.fake_kernel {
                    fake::populate(self.version, path);
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(cgfs::fs_err("create directory", path, e)),
        }
    }

    /// rmdir (cgroupfs removes the control files itself).
    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        #[cfg(test)]
        if self.fake_kernel {
            fake::depopulate(path);
        }
        fs::remove_dir(path)
    }

    /// rmdir, retrying EBUSY (tasks still exiting) until `deadline`; a missing dir is fine.
    fn remove_dir_retry(&self, path: &Path, deadline: Instant) -> Result<()> {
        loop {
            match self.remove_dir(path) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                    sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(cgfs::fs_err("remove directory", path, e)),
            }
        }
    }
}

/// Enable memory, cpu and pids in `dir/cgroup.subtree_control` (only those not yet enabled, so
/// an already-configured host is not written to).
fn enable_v2_controllers(dir: &Path) -> Result<()> {
    let file = dir.join("cgroup.subtree_control");
    let current = cgfs::read(&file)?;
    let enabled: Vec<&str> = current.split_whitespace().map(|t| t.trim_start_matches('+')).collect();
    let missing: Vec<String> =
        V2_CONTROLLERS.iter().filter(|c| !enabled.contains(c)).map(|c| format!("+{c}")).collect();
    if missing.is_empty() {
        return Ok(());
    }
    cgfs::write(&file, &missing.join(" "))
}

/// Group and parent names: one safe directory name.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    let reason = if name.is_empty() {
        Some("empty")
    } else if name.len() > 200 {
        Some("longer than 200 bytes")
    } else if name.starts_with('.') {
        Some("starts with '.'")
    } else if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.@:-".contains(&b)) {
        Some("contains a character other than [A-Za-z0-9_.@:-]")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(IsolationError::InvalidName { name: name.to_owned(), reason }),
        None => Ok(()),
    }
}

/// Usage counters of a group. Counters are cumulative over the group's lifetime (only the v1
/// peak can be reset, by [`Cgroup::set_limits`]); keep a baseline when recycling a group.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CgroupStats {
    /// Current memory charge (v1 memory.usage_in_bytes, v2 memory.current).
    pub memory_bytes: u64,
    /// Peak memory charge (v1 memory.max_usage_in_bytes, v2 memory.peak; kernels without
    /// memory.peak (< 5.19) report the current value).
    pub memory_peak_bytes: u64,
    /// Processes killed by the OOM killer in this group (0 on v1 kernels < 4.13, which do not
    /// report it).
    pub oom_kills: u64,
    /// Current number of tasks (zombies count until reaped).
    pub pids_current: u64,
}

/// One sandbox's cgroup: `<parent>/<name>` in every hierarchy of its layout.
#[derive(Debug, Clone)]
pub struct Cgroup {
    name: String,
    layout: CgroupLayout,
}

impl Cgroup {
    /// Create `<parent>/<name>` in every hierarchy (creating the parent if missing; on v2 also
    /// enabling +memory +cpu +pids in the parent's subtree_control) and apply `limits`.
    /// Fails with [`IsolationError::AlreadyExists`] if the group exists in any hierarchy; on any
    /// failure the directories created so far are removed again.
    pub fn create(layout: &CgroupLayout, name: &str, limits: &Limits) -> Result<Cgroup> {
        validate_name(&layout.parent)?;
        validate_name(name)?;
        limits.validate()?;
        layout.ensure_parent()?;
        let cg = Cgroup { name: name.to_owned(), layout: layout.clone() };

        let mut created = Vec::new();
        let mut result = Ok(());
        for dir in cg.dirs() {
            match layout.make_dir(&dir) {
                Ok(true) => created.push(dir),
                Ok(false) => {
                    result = Err(IsolationError::AlreadyExists { name: name.to_owned(), path: dir });
                    break;
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        let result = result.and_then(|()| cg.apply_limits(limits));
        if let Err(e) = result {
            for dir in created.iter().rev() {
                let _ = layout.remove_dir(dir);
            }
            return Err(e);
        }
        tracing::debug!(cgroup = %name, version = %layout.version, ?limits, "created cgroup");
        Ok(cg)
    }

    /// Open an existing group (re-attach after a daemon restart). [`IsolationError::NotFound`]
    /// if it exists in no hierarchy. A group that exists in only some v1 hierarchies (a crash
    /// during `create`) is opened so that it can be destroyed; operations needing a missing
    /// directory fail naming it.
    pub fn open(layout: &CgroupLayout, name: &str) -> Result<Cgroup> {
        validate_name(&layout.parent)?;
        validate_name(name)?;
        let cg = Cgroup { name: name.to_owned(), layout: layout.clone() };
        let dirs = cg.dirs();
        let missing: Vec<&PathBuf> = dirs.iter().filter(|d| !d.is_dir()).collect();
        if missing.len() == dirs.len() {
            let path = dirs.into_iter().next().unwrap_or_default();
            return Err(IsolationError::NotFound { name: name.to_owned(), path });
        }
        if !missing.is_empty() {
            tracing::warn!(cgroup = %name, ?missing, "cgroup exists only in some hierarchies");
        }
        Ok(cg)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layout this group belongs to.
    pub fn layout(&self) -> &CgroupLayout {
        &self.layout
    }

    /// The group's directory in each hierarchy.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.dirs()
    }

    fn dirs(&self) -> Vec<PathBuf> {
        self.layout.hierarchies().iter().map(|r| r.join(&self.layout.parent).join(&self.name)).collect()
    }

    fn dir_for(&self, controller: &'static str, op: &'static str) -> Result<PathBuf> {
        Ok(self.layout.root_of(controller, op)?.join(&self.layout.parent).join(&self.name))
    }

    /// Move a process (all its threads) into this group in every hierarchy.
    pub fn add_pid(&self, pid: i32) -> Result<()> {
        let value = pid.to_string();
        for dir in self.dirs() {
            cgfs::write(&dir.join("cgroup.procs"), &value)?;
        }
        Ok(())
    }

    /// Move `member` (in the group already) into the group again, in one hierarchy: nothing
    /// moves, but the kernel takes its global migration lock for writing, and the first writer
    /// after a pause waits for an RCU grace period (cgroup v1 without `favordynmods`; the wait is
    /// in BENCHMARKS.md); writers soon after do not. Done ahead of a burst of
    /// [`Cgroup::add_pid`]s (a fork moving its session copies), it takes that wait off their
    /// path.
    pub fn warm_migrations(&self, member: i32) -> Result<()> {
        match self.dirs().first() {
            Some(dir) => cgfs::write(&dir.join("cgroup.procs"), &member.to_string()),
            None => Ok(()),
        }
    }

    /// The group's `cgroup.procs` file in each hierarchy, open for writing: whoever holds them
    /// can move processes in (the kernel checks the opener's credentials, so they can be handed
    /// to a less privileged process, e.g. a sandbox's init starting a nested sandbox).
    pub fn procs_files(&self) -> Result<Vec<fs::File>> {
        self.dirs()
            .into_iter()
            .map(|dir| {
                let path = dir.join("cgroup.procs");
                fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_CLOEXEC)
                    .open(&path)
                    .map_err(|e| cgfs::fs_err("open", &path, e))
            })
            .collect()
    }

    /// v2 only: an `O_DIRECTORY` fd of the group for `clone3(CLONE_INTO_CGROUP)`. `None` on v1,
    /// where the child must be moved with [`Cgroup::add_pid`] instead.
    pub fn dir_fd(&self) -> Result<Option<OwnedFd>> {
        if self.layout.version == CgroupVersion::V1 {
            return Ok(None);
        }
        let dir = self.dir_for("unified", "dir_fd")?;
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(&dir)
            .map_err(|e| cgfs::fs_err("open", &dir, e))?;
        Ok(Some(OwnedFd::from(file)))
    }

    /// All processes in the group (union over the v1 hierarchies), sorted.
    pub fn pids(&self) -> Result<Vec<i32>> {
        let dirs = self.dirs();
        if !dirs.iter().any(|d| d.is_dir()) {
            let path = dirs.into_iter().next().unwrap_or_default();
            return Err(IsolationError::NotFound { name: self.name.clone(), path });
        }
        self.member_pids()
    }

    /// Like `pids`, but a group that is (partly) gone simply has no members there.
    fn member_pids(&self) -> Result<Vec<i32>> {
        let mut all = BTreeSet::new();
        for dir in self.dirs() {
            let file = dir.join("cgroup.procs");
            match fs::read_to_string(&file) {
                Ok(text) => all.extend(cgfs::parse_pids(&file, &text)?),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(cgfs::fs_err("read", &file, e)),
            }
        }
        Ok(all.into_iter().collect())
    }

    /// Freeze every process of the group and wait (up to 2 s) until the kernel reports the group
    /// frozen (v1 `freezer.state` = FROZEN, v2 `cgroup.events` "frozen 1"). On timeout the group
    /// is thawed again and an error returned (usually a task stuck in uninterruptible sleep).
    pub fn freeze(&self) -> Result<()> {
        let (file, frozen) = self.freeze_file(true)?;
        cgfs::write(&file, frozen)?;
        let mut written = Instant::now();
        let done = poll_until(Instant::now() + FREEZE_TIMEOUT, || {
            if self.is_frozen()? {
                return Ok(true);
            }
            if self.layout.version == CgroupVersion::V1 && written.elapsed() >= FREEZE_REWRITE {
                // v1 asks each task to freeze once, when the state is written. A task that
                // went into a sleep that signals do not break after that (a vfork parent
                // waiting for its child, frozen before its exec) is frozen in place only by
                // another write; without it the group stays FREEZING.
                cgfs::write(&file, frozen)?;
                written = Instant::now();
            }
            Ok(false)
        })?;
        if done {
            return Ok(());
        }
        let state = self.freeze_state_text();
        let _ = self.thaw();
        Err(IsolationError::Timeout {
            name: self.name.clone(),
            what: "freeze",
            waited: FREEZE_TIMEOUT,
            detail: format!(
                "state still {state:?}; a process is probably in uninterruptible sleep (D state). \
                 The group was thawed again; retry later"
            ),
        })
    }

    /// Let the group's processes run again.
    pub fn thaw(&self) -> Result<()> {
        let (file, thawed) = self.freeze_file(false)?;
        cgfs::write(&file, thawed)
    }

    /// The group's directory in the hierarchy that freezes it (v1 `freezer`, v2 the unified
    /// one), e.g. for a checkpointer that seizes a group the caller froze.
    pub fn freezer_dir(&self) -> Result<PathBuf> {
        match self.layout.version {
            CgroupVersion::V1 => self.dir_for("freezer", "freezer_dir"),
            CgroupVersion::V2 => self.dir_for("unified", "freezer_dir"),
        }
    }

    /// Ask the kernel to reclaim what it can of the group's memory (page cache, and anonymous
    /// memory where there is swap): v1 `memory.force_empty`, v2 `memory.reclaim`. What cannot be
    /// reclaimed stays (the kernel answers EBUSY or EAGAIN then, not an error here).
    pub fn reclaim(&self) -> Result<()> {
        let mem = self.dir_for("memory", "reclaim")?;
        let (file, value) = match self.layout.version {
            CgroupVersion::V1 => (mem.join("memory.force_empty"), "0".to_string()),
            CgroupVersion::V2 => (mem.join("memory.reclaim"), self.stats()?.memory_bytes.to_string()),
        };
        match cgfs::write(&file, &value) {
            Err(IsolationError::Write { source, .. })
                if matches!(source.raw_os_error(), Some(libc::EBUSY) | Some(libc::EAGAIN)) =>
            {
                Ok(())
            }
            other => other,
        }
    }

    /// Anonymous memory of the group's processes (their heaps and stacks: what only their exit
    /// gives back), without page cache: v1 `total_rss` of memory.stat, v2 `anon`.
    pub fn anon_memory(&self) -> Result<u64> {
        let mem = self.dir_for("memory", "memory stats")?;
        let stat = cgfs::read(&mem.join("memory.stat"))?;
        let key = match self.layout.version {
            CgroupVersion::V1 => "total_rss",
            CgroupVersion::V2 => "anon",
        };
        Ok(cgfs::keyed(&stat, key).unwrap_or(0))
    }

    /// The freeze control file and the value that freezes (`true`) or thaws (`false`).
    fn freeze_file(&self, freeze: bool) -> Result<(PathBuf, &'static str)> {
        Ok(match self.layout.version {
            CgroupVersion::V1 => (
                self.dir_for("freezer", "freeze/thaw")?.join("freezer.state"),
                if freeze { "FROZEN" } else { "THAWED" },
            ),
            CgroupVersion::V2 => {
                (self.dir_for("unified", "freeze/thaw")?.join("cgroup.freeze"), if freeze { "1" } else { "0" })
            }
        })
    }

    fn is_frozen(&self) -> Result<bool> {
        match self.layout.version {
            CgroupVersion::V1 => {
                let file = self.dir_for("freezer", "freeze")?.join("freezer.state");
                Ok(cgfs::read(&file)?.trim() == "FROZEN")
            }
            CgroupVersion::V2 => {
                let file = self.dir_for("unified", "freeze")?.join("cgroup.events");
                Ok(cgfs::keyed(&cgfs::read(&file)?, "frozen") == Some(1))
            }
        }
    }

    fn freeze_state_text(&self) -> String {
        let file = match self.layout.version {
            CgroupVersion::V1 => self.dir_for("freezer", "freeze").map(|d| d.join("freezer.state")),
            CgroupVersion::V2 => self.dir_for("unified", "freeze").map(|d| d.join("cgroup.events")),
        };
        file.and_then(|f| cgfs::read(&f)).map(|s| s.trim().replace('\n', ", ")).unwrap_or_default()
    }

    /// Kill every process in the group and wait (up to 5 s) until it is empty. v2 uses
    /// `cgroup.kill` (Linux >= 5.14); v1 (and older v2) repeat freeze, SIGKILL every member,
    /// thaw, until no member is left, so a fork racing with the kill cannot escape.
    pub fn kill_all(&self) -> Result<()> {
        let deadline = Instant::now() + KILL_TIMEOUT;
        if self.layout.version == CgroupVersion::V2 {
            let dir = self.dir_for("unified", "kill_all")?;
            let kill_file = dir.join("cgroup.kill");
            if kill_file.exists() {
                cgfs::write(&kill_file, "1")?;
                let events = dir.join("cgroup.events");
                let empty = poll_until(deadline, || Ok(cgfs::keyed(&cgfs::read(&events)?, "populated") == Some(0)))?;
                if empty {
                    return Ok(());
                }
                return Err(self.kill_timeout());
            }
        }
        self.kill_loop(deadline)
    }

    fn kill_loop(&self, deadline: Instant) -> Result<()> {
        // Freezing is best effort: without a freezer (a partial group) plain SIGKILL still works,
        // only less reliably against fork races.
        let freezer = self.freeze_file(true).ok().filter(|(f, _)| f.exists());
        let thaw = |freezer: &Option<(PathBuf, &str)>| -> Result<()> {
            match freezer {
                Some(_) => self.thaw(),
                None => Ok(()),
            }
        };
        loop {
            if let Some((file, frozen)) = &freezer {
                let _ = cgfs::write(file, frozen);
            }
            let pids = self.member_pids()?;
            if pids.is_empty() {
                return thaw(&freezer);
            }
            for &pid in &pids {
                match kill(Pid::from_raw(pid), Signal::SIGKILL) {
                    Ok(()) | Err(Errno::ESRCH) => {}
                    Err(source) => {
                        let _ = thaw(&freezer);
                        return Err(IsolationError::Kill { name: self.name.clone(), pid, source });
                    }
                }
            }
            // Frozen tasks only act on the SIGKILL once thawed.
            thaw(&freezer)?;
            if Instant::now() >= deadline {
                return Err(self.kill_timeout());
            }
            sleep(Duration::from_millis(2));
        }
    }

    fn kill_timeout(&self) -> IsolationError {
        let left = self.member_pids().map(|p| format!("{p:?}")).unwrap_or_else(|e| e.to_string());
        IsolationError::Timeout {
            name: self.name.clone(),
            what: "kill_all",
            waited: KILL_TIMEOUT,
            detail: format!(
                "processes still in the group: {left}; a task may be stuck in uninterruptible \
                 sleep (D state, e.g. on a hung NFS or FUSE mount)"
            ),
        }
    }

    /// [`Cgroup::kill_all`], then remove the group from every hierarchy (retrying briefly while
    /// the kernel still reports it busy). A group that is already (partly) gone is fine, so this
    /// is idempotent.
    pub fn destroy(&self) -> Result<()> {
        let existing: Vec<PathBuf> = self.dirs().into_iter().filter(|d| d.is_dir()).collect();
        if existing.is_empty() {
            return Ok(());
        }
        if !self.member_pids()?.is_empty() {
            self.kill_all()?;
        }
        let deadline = Instant::now() + RMDIR_TIMEOUT;
        for dir in existing.iter().rev() {
            self.layout.remove_dir_retry(dir, deadline)?;
        }
        tracing::debug!(cgroup = %self.name, "destroyed cgroup");
        Ok(())
    }

    /// Current usage counters.
    pub fn stats(&self) -> Result<CgroupStats> {
        let mem = self.dir_for("memory", "stats")?;
        let pids = self.dir_for("pids", "stats")?;
        let pids_current = cgfs::read_u64(&pids.join("pids.current"))?;
        Ok(match self.layout.version {
            CgroupVersion::V1 => CgroupStats {
                memory_bytes: cgfs::read_u64(&mem.join("memory.usage_in_bytes"))?,
                memory_peak_bytes: cgfs::read_u64(&mem.join("memory.max_usage_in_bytes"))?,
                oom_kills: cgfs::keyed(&cgfs::read(&mem.join("memory.oom_control"))?, "oom_kill").unwrap_or(0),
                pids_current,
            },
            CgroupVersion::V2 => {
                let current = cgfs::read_u64(&mem.join("memory.current"))?;
                let peak_file = mem.join("memory.peak");
                let peak = if peak_file.exists() { cgfs::read_u64(&peak_file)? } else { current };
                let events = cgfs::read(&mem.join("memory.events"))?;
                CgroupStats {
                    memory_bytes: current,
                    memory_peak_bytes: peak,
                    oom_kills: cgfs::keyed(&events, "oom_kill").unwrap_or(0),
                    pids_current,
                }
            }
        })
    }

    /// Re-apply `limits` (`None` = unlimited) and, on v1, reset the peak and failure counters
    /// (memory.max_usage_in_bytes, memory.failcnt and their memsw twins). Used when a group is
    /// recycled for a new sandbox. v2 offers no global peak reset; oom_kill counters can never be
    /// reset.
    pub fn set_limits(&self, limits: &Limits) -> Result<()> {
        limits.validate()?;
        self.apply_limits(limits)?;
        if self.layout.version == CgroupVersion::V1 {
            let mem = self.dir_for("memory", "set_limits")?;
            for f in [
                "memory.max_usage_in_bytes",
                "memory.failcnt",
                "memory.memsw.max_usage_in_bytes",
                "memory.memsw.failcnt",
            ] {
                let file = mem.join(f);
                if file.exists() {
                    cgfs::write(&file, "0")?;
                }
            }
        }
        Ok(())
    }

    fn apply_limits(&self, limits: &Limits) -> Result<()> {
        let quota = limits.cpu_millis.map(|m| u64::from(m) * (CPU_PERIOD_US / 1000));
        let pids = limits.pids.map_or_else(|| "max".to_owned(), |p| p.to_string());
        match self.layout.version {
            CgroupVersion::V1 => {
                let mem = self.dir_for("memory", "limits")?;
                set_v1_memory(&mem, limits.memory_bytes)?;
                // Keep the OOM killer enabled (the default): with it disabled, tasks hitting the
                // limit would hang instead of being killed.
                cgfs::write(&mem.join("memory.oom_control"), "0")?;

                let cpu = self.dir_for("cpu", "limits")?;
                cgfs::write(&cpu.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                let quota = quota.map_or_else(|| "-1".to_owned(), |q| q.to_string());
                cgfs::write(&cpu.join("cpu.cfs_quota_us"), &quota)?;

                cgfs::write(&self.dir_for("pids", "limits")?.join("pids.max"), &pids)?;
            }
            CgroupVersion::V2 => {
                let dir = self.dir_for("unified", "limits")?;
                let mem = limits.memory_bytes.map_or_else(|| "max".to_owned(), |m| m.to_string());
                cgfs::write(&dir.join("memory.max"), &mem)?;
                let swap = dir.join("memory.swap.max");
                if swap.exists() {
                    cgfs::write(&swap, "0")?;
                }
                let quota = quota.map_or_else(|| "max".to_owned(), |q| q.to_string());
                cgfs::write(&dir.join("cpu.max"), &format!("{quota} {CPU_PERIOD_US}"))?;
                cgfs::write(&dir.join("pids.max"), &pids)?;
            }
        }
        Ok(())
    }
}

/// v1 memory limit. memory.memsw.limit_in_bytes (memory + swap, present when swap accounting is
/// on) is set to the same value so swap cannot be used to exceed the limit. The kernel insists
/// on memsw >= limit at every moment, so raise memsw first and lower it last.
fn set_v1_memory(dir: &Path, bytes: Option<u64>) -> Result<()> {
    let limit = dir.join("memory.limit_in_bytes");
    let memsw = dir.join("memory.memsw.limit_in_bytes");
    let value = bytes.map_or_else(|| "-1".to_owned(), |b| b.to_string());
    if !memsw.exists() {
        return cgfs::write(&limit, &value);
    }
    let current = cgfs::read_u64(&limit)?;
    if memsw_first(current, bytes) {
        cgfs::write(&memsw, &value)?;
        cgfs::write(&limit, &value)
    } else {
        cgfs::write(&limit, &value)?;
        cgfs::write(&memsw, &value)
    }
}

/// Whether memsw must be written before the limit: when the limit goes up (or to unlimited).
fn memsw_first(current_limit: u64, new: Option<u64>) -> bool {
    new.unwrap_or(u64::MAX) >= current_limit
}

/// Poll `done` with a short backoff until it returns true (Ok(true)) or `deadline` passes
/// (Ok(false)).
fn poll_until(deadline: Instant, mut done: impl FnMut() -> Result<bool>) -> Result<bool> {
    // Freezing usually completes within tens of microseconds: poll finely first.
    let mut pause = Duration::from_micros(20);
    loop {
        if done()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests;
