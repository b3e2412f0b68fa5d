//! The processes of one sandbox, seen from the host: listed and killed through the sandbox's
//! own procfs (its pid namespace's view: pids as the sandbox knows them, one `/proc/<pid>`
//! directory fd to signal each, without a `status` read per process), with the cgroup as the
//! fallback when that procfs cannot be trusted.

use crate::error::Result;
use crate::sandbox::Sandbox;
use std::collections::HashSet;
use std::path::PathBuf;

/// Pid of host process `host_pid` in its innermost pid namespace.
pub(crate) fn ns_pid(host_pid: i32) -> Option<i32> {
    bb_sys::process::ns_pids(host_pid)?.last().copied()
}

/// The sandbox's own procfs (mounted in its pid namespace), seen from the host.
pub(crate) fn sandbox_proc(sb: &Sandbox) -> PathBuf {
    PathBuf::from(format!("/proc/{}/root/proc", sb.init_pid))
}

/// [`own_pids`], or, when the sandbox has no procfs of its own (sandbox code cannot unmount or
/// cover its /proc: seccomp denies mounts), its procfs as reached from the host and no pids
/// (logged).
pub(crate) fn own_pids_or_none(sb: &Sandbox, skip: &HashSet<i32>) -> (PathBuf, Vec<i32>) {
    own_pids(sb, skip).unwrap_or_else(|e| {
        tracing::warn!(sandbox = %sb.id, "no procfs of its own to look for files open for writing: {e}");
        (sandbox_proc(sb), Vec::new())
    })
}

/// The processes of `sb`'s own pid namespace but init and `skip` (pids in the sandbox), from
/// the sandbox's own procfs (returned too): `skip`ped ones (templates: dozens) cost nothing,
/// where the cgroup's host pids each needed a `status` read to learn their pid inside.
/// Processes of nested sandboxes (deeper pid namespaces, visible there too: a fork's pre-built
/// shells) are left out, and so are the daemon's helpers working in the sandbox's pid
/// namespace (CRIU dumping or restoring its processes: the host's user namespace). Err: no
/// procfs of its own to read.
pub(crate) fn own_pids(sb: &Sandbox, skip: &HashSet<i32>) -> std::io::Result<(PathBuf, Vec<i32>)> {
    let proc = sandbox_proc(sb);
    let own_ns = std::fs::read_link(format!("/proc/{}/ns/pid", sb.init_pid))?;
    let own_user = std::fs::read_link(format!("/proc/{}/ns/user", sb.init_pid))?;
    if std::fs::read_link(proc.join("1/ns/pid"))? != own_ns {
        return Err(std::io::Error::other("the sandbox's /proc is not its own"));
    }
    let pids = std::fs::read_dir(&proc)?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|p| *p != 1 && !skip.contains(p))
        // A nested sandbox's, or gone.
        .filter(|p| std::fs::read_link(proc.join(format!("{p}/ns/pid"))).ok().as_ref() == Some(&own_ns))
        // A helper of the daemon's, or gone.
        .filter(|p| std::fs::read_link(proc.join(format!("{p}/ns/user"))).ok().as_ref() == Some(&own_user))
        .collect();
    Ok((proc, pids))
}

/// Kill every process of `sb`'s own pid namespace but its init and `keep` (see [`own_pids`]).
/// Err: no procfs to read (the caller falls back to the cgroup).
pub(crate) fn kill_in_sandbox_procfs(sb: &Sandbox, keep: &HashSet<i32>, killed: &mut Vec<i32>) -> std::io::Result<()> {
    let (proc, pids) = own_pids(sb, keep)?;
    for pid in pids {
        if bb_sys::process::signal_proc_dir(&proc.join(pid.to_string()), libc::SIGKILL).is_ok() {
            killed.push(pid);
        }
    }
    Ok(())
}

/// One of the pids a restore wants that is still taken, and by which process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TakenPid {
    pub pid: i32,
    /// The process holding it: `pid` itself (a process or a thread), or a process (a zombie
    /// too) whose process group or session it is.
    pub by: i32,
}

/// Which of `pids` is still taken in the pid namespace whose procfs is `proc`, if any. The
/// kernel hands a pid out again only once nothing uses it: a group or session leader's pid
/// stays taken until the last member of its group or session is reaped, though no
/// `/proc/<pid>` is left (the leader's children that outlive it for a moment).
pub(crate) fn taken_pid(proc: &std::path::Path, pids: &[i32]) -> Option<TakenPid> {
    if let Some(&pid) = pids.iter().find(|p| proc.join(p.to_string()).exists()) {
        return Some(TakenPid { pid, by: pid });
    }
    for e in std::fs::read_dir(proc).ok()?.flatten() {
        let Some(by) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if let Some((group, session)) = bb_sys::process::group_and_session(&e.path()) {
            if let Some(&pid) = pids.iter().find(|p| **p == group || **p == session) {
                return Some(TakenPid { pid, by });
            }
        }
    }
    None
}

/// The host pid of the process that is `ns_pid` in `sb`'s pid namespace (a member of its
/// cgroup), if it lives.
pub(crate) fn host_pid_of(sb: &Sandbox, pid: i32) -> Option<i32> {
    sb.cgroup.pids().ok()?.into_iter().find(|h| ns_pid(*h) == Some(pid))
}

/// Processes of a sandbox survived every round of [`kill_members`].
#[derive(Debug, thiserror::Error)]
#[error("processes {pids:?} of sandbox {sandbox} survived SIGKILL")]
pub struct SurvivorsError {
    sandbox: String,
    pids: Vec<i32>,
}

/// What [`kill_members`] needs of a sandbox's cgroup and of the kernel: a seam, so the loop is
/// unit-tested with a fake that forks and refuses to die on cue.
pub(crate) trait Members {
    fn freeze(&self) -> Result<()>;
    fn thaw(&self) -> Result<()>;
    /// Host pids of the members.
    fn pids(&self) -> Result<Vec<i32>>;
    fn kill(&self, pid: i32);
}

impl Members for bb_isolation::Cgroup {
    fn freeze(&self) -> Result<()> {
        Ok(bb_isolation::Cgroup::freeze(self)?)
    }
    fn thaw(&self) -> Result<()> {
        Ok(bb_isolation::Cgroup::thaw(self)?)
    }
    fn pids(&self) -> Result<Vec<i32>> {
        Ok(bb_isolation::Cgroup::pids(self)?)
    }
    fn kill(&self, pid: i32) {
        // A member of the frozen cgroup: it dies on thaw. Gone already: nothing to do.
        let _ = bb_sys::process::kill(pid, libc::SIGKILL);
    }
}

/// With `sb`'s cgroup frozen (so nothing forks meanwhile), SIGKILL every member `spare` says
/// no to; repeat until none is left (up to ~1 s). Blocking.
pub(crate) fn kill_members(sb: &Sandbox, spare: impl Fn(i32) -> bool) -> Result<()> {
    kill_all_but(&sb.cgroup, &sb.id, spare, KILL_ROUNDS)
}

/// Wait (up to `within`) until init has reaped every other process of `sb` (the pids counter
/// counts zombies, so 1 means init has seen every exit); whether that happened. Blocking.
pub(crate) fn wait_only_init_left(sb: &Sandbox, within: std::time::Duration) -> Result<bool> {
    let deadline = std::time::Instant::now() + within;
    loop {
        if sb.cgroup.stats()?.pids_current <= 1 {
            return Ok(true);
        }
        if std::time::Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Rounds of [`kill_members`], 2 ms apart.
const KILL_ROUNDS: usize = 500;

fn kill_all_but(members: &impl Members, sandbox: &str, spare: impl Fn(i32) -> bool, rounds: usize) -> Result<()> {
    let mut left = Vec::new();
    for round in 0..rounds {
        if round > 0 {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        members.freeze()?;
        let pids = members.pids();
        if let Ok(pids) = &pids {
            for pid in pids.iter().filter(|p| !spare(**p)) {
                members.kill(*pid);
            }
        }
        members.thaw()?;
        left = pids?.into_iter().filter(|p| !spare(*p)).collect();
        if left.is_empty() {
            return Ok(());
        }
    }
    Err(SurvivorsError { sandbox: sandbox.to_string(), pids: left }.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A cgroup of fake processes: `stubborn` ones survive that many kills; a kill of
    /// `forker` makes `child` appear (it forked before the freeze took).
    #[derive(Default)]
    struct FakeMembers {
        alive: RefCell<Vec<i32>>,
        stubborn: RefCell<std::collections::HashMap<i32, usize>>,
        forks: Option<(i32, i32)>,
        frozen: RefCell<bool>,
        log: RefCell<Vec<String>>,
    }

    impl Members for FakeMembers {
        fn freeze(&self) -> Result<()> {
            *self.frozen.borrow_mut() = true;
            self.log.borrow_mut().push("freeze".into());
            Ok(())
        }
        fn thaw(&self) -> Result<()> {
            *self.frozen.borrow_mut() = false;
            self.log.borrow_mut().push("thaw".into());
            Ok(())
        }
        fn pids(&self) -> Result<Vec<i32>> {
            Ok(self.alive.borrow().clone())
        }
        fn kill(&self, pid: i32) {
            assert!(*self.frozen.borrow(), "kills happen with the cgroup frozen");
            self.log.borrow_mut().push(format!("kill {pid}"));
            let mut stubborn = self.stubborn.borrow_mut();
            match stubborn.get_mut(&pid) {
                Some(n) if *n > 0 => *n -= 1,
                _ => self.alive.borrow_mut().retain(|p| *p != pid),
            }
            if let Some((parent, child)) = self.forks {
                if pid == parent
                    && !self.alive.borrow().contains(&child)
                    && !self.log.borrow().iter().any(|l| l == &format!("kill {child}"))
                {
                    self.alive.borrow_mut().push(child);
                }
            }
        }
    }

    #[test]
    fn every_member_but_the_spared_is_killed_frozen_and_forks_are_caught_next_round() {
        let m = FakeMembers { alive: RefCell::new(vec![1, 10, 11]), forks: Some((10, 12)), ..Default::default() };
        kill_all_but(&m, "sb-x", |p| p == 1, 5).unwrap();
        assert_eq!(*m.alive.borrow(), vec![1], "init (spared) is all that is left");
        let log = m.log.borrow();
        assert!(!log.iter().any(|l| l == "kill 1"), "the spared pid is never signalled: {log:?}");
        assert!(log.iter().any(|l| l == "kill 12"), "the child forked meanwhile is killed in a later round: {log:?}");
        assert_eq!(log.last().map(String::as_str), Some("thaw"), "the cgroup is never left frozen");
    }

    #[test]
    fn a_member_that_survives_every_round_is_reported_by_pid() {
        let m = FakeMembers { alive: RefCell::new(vec![1, 20]), ..Default::default() };
        m.stubborn.borrow_mut().insert(20, usize::MAX);
        let e = kill_all_but(&m, "sb-x", |p| p == 1, 3).unwrap_err();
        assert!(e.to_string().contains("[20]") && e.to_string().contains("sb-x"), "{e}");
        assert_eq!(m.log.borrow().iter().filter(|l| *l == "kill 20").count(), 3, "one kill per round");
        // One that dies on its second kill is fine.
        let m = FakeMembers { alive: RefCell::new(vec![1, 21]), ..Default::default() };
        m.stubborn.borrow_mut().insert(21, 1);
        kill_all_but(&m, "sb-x", |p| p == 1, 3).unwrap();
    }

    /// A procfs-like directory: `(pid, stat line)` each.
    fn fake_proc(procs: &[(i32, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (pid, stat) in procs {
            std::fs::create_dir(dir.path().join(pid.to_string())).unwrap();
            std::fs::write(dir.path().join(format!("{pid}/stat")), stat).unwrap();
        }
        std::fs::create_dir(dir.path().join("self")).unwrap();
        dir
    }

    #[test]
    fn a_pid_is_taken_by_its_process_or_while_a_group_or_session_it_leads_has_members() {
        let proc = fake_proc(&[(1, "1 (init) S 0 1 1 0"), (2, "2 (bash) S 1 2 2 0"), (9, "9 (sleep) Z 1 2 2 0")]);
        assert_eq!(taken_pid(proc.path(), &[3, 2]), Some(TakenPid { pid: 2, by: 2 }));
        // The leader is reaped; a member of its group (a zombie) still holds its pid.
        std::fs::remove_dir_all(proc.path().join("2")).unwrap();
        assert_eq!(taken_pid(proc.path(), &[2, 3]), Some(TakenPid { pid: 2, by: 9 }));
        std::fs::write(proc.path().join("9/stat"), "9 (sleep) S 1 4 2 0").unwrap();
        assert_eq!(taken_pid(proc.path(), &[2]), Some(TakenPid { pid: 2, by: 9 }), "its session");
        std::fs::remove_dir_all(proc.path().join("9")).unwrap();
        assert_eq!(taken_pid(proc.path(), &[2, 3]), None);
    }

    #[test]
    fn ns_pid_of_self() {
        let me = std::process::id() as i32;
        // Outside any pid namespace the innermost pid is the pid itself.
        assert_eq!(ns_pid(me), Some(me));
        assert_eq!(ns_pid(i32::MAX), None);
    }
}
