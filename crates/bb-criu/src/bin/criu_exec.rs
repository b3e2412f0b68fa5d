//! `branchbox-criu-exec INIT_PID [--cgroup-procs FILE]... [--pids-above PID] -- CRIU ARGS...`: run
//! CRIU as host root inside a sandbox's pid, net, uts, ipc and cgroup namespaces.
//!
//! CRIU then sees the sandbox's processes in its own namespaces (it dumps none of those, and
//! pids are the sandbox's), while keeping the host's user namespace (init-namespace
//! capabilities: it must read and restore seccomp filters) and the host's files (a private copy
//! of the host's mount namespace, with a procfs of the sandbox's pid namespace on /proc). Its
//! user and mount namespaces are joined by CRIU itself on restore (`--join-ns`), see
//! `bb_criu`. Restored tasks are children of CRIU inside the sandbox's pid namespace, so when it
//! exits they are re-parented to the sandbox's init. With `--cgroup-procs`, CRIU first moves
//! itself into the sandbox's cgroups, so restored tasks (and the memory they touch) are charged
//! there.
//!
//! Single-threaded: forks after joining the pid namespace; the parent waits and exits with the
//! child's status. The child (CRIU) leads a session of its own in the sandbox's pid namespace,
//! and dies with the parent.
//!
//! `--pids-above PID`: CRIU (and its threads) take pids above PID in the sandbox, leaving those
//! of the tasks it restores free. A new sandbox has handed out few pids, and CRIU would take the
//! next one (2, 3, ...), likely one of a restored tree's: a first child moves the namespace's
//! last pid up to PID (`ns_last_pid`, written from inside; it applies to the writer's own pid
//! namespace) and exits, then CRIU is forked.

use nix::mount::{mount, MsFlags};
use std::ffi::CString;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

fn fail(what: &str, e: impl std::fmt::Display) -> ! {
    eprintln!("branchbox-criu-exec: {what}: {e}");
    std::process::exit(126)
}

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let Some(sep) = args.iter().position(|a| a == "--") else {
        fail("usage", "INIT_PID [--cgroup-procs FILE]... -- CRIU ARGS")
    };
    let (ours, criu) = (&args[..sep], &args[sep + 1..]);
    let Some(init) = ours.first().and_then(|a| a.to_str()).and_then(|a| a.parse::<i32>().ok()) else {
        fail("usage", "the first argument is the sandbox init's host pid")
    };
    let mut cgroup_procs = Vec::new();
    let mut pids_above = None;
    let mut it = ours[1..].iter();
    while let Some(a) = it.next() {
        match (a.to_str(), it.next()) {
            (Some("--cgroup-procs"), Some(f)) => cgroup_procs.push(f.clone()),
            (Some("--pids-above"), Some(p)) => match p.to_str().and_then(|p| p.parse::<i32>().ok()) {
                Some(p) if p > 0 => pids_above = Some(p),
                _ => fail("usage", format!("--pids-above takes a pid, not {p:?}")),
            },
            _ => fail("usage", format!("unknown argument {a:?}")),
        }
    }
    if criu.is_empty() {
        fail("usage", "no CRIU command given after --");
    }
    let ns: Vec<(libc::c_int, OwnedFd)> = [
        ("pid", libc::CLONE_NEWPID),
        ("net", libc::CLONE_NEWNET),
        ("uts", libc::CLONE_NEWUTS),
        ("ipc", libc::CLONE_NEWIPC),
        ("cgroup", libc::CLONE_NEWCGROUP),
    ]
    .into_iter()
    .map(|(name, flag)| match std::fs::File::open(format!("/proc/{init}/ns/{name}")) {
        Ok(f) => (flag, OwnedFd::from(f)),
        Err(e) => fail(&format!("open the sandbox's {name} namespace"), e),
    })
    .collect();
    if let Err(e) = bb_sys::ns::unshare(libc::CLONE_NEWNS) {
        fail("unshare the mount namespace", e);
    }
    if let Err(e) = mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>) {
        fail("make the mount namespace private", e);
    }
    for f in &cgroup_procs {
        if let Err(e) = std::fs::write(f, b"0") {
            fail(&format!("join the sandbox's cgroup ({})", std::path::Path::new(f).display()), e);
        }
    }
    for (flag, fd) in &ns {
        if let Err(e) = bb_sys::ns::setns(fd.as_fd(), *flag) {
            fail("join the sandbox's namespaces", e);
        }
    }
    drop(ns);
    if let Some(pid) = pids_above {
        raise_last_pid(pid);
    }
    // SAFETY: single-threaded program: the child may do anything before exec.
    match unsafe { nix::unistd::fork() } {
        Err(e) => fail("fork", e),
        Ok(nix::unistd::ForkResult::Child) => {
            // A session of its own inside the sandbox's pid namespace: a restored task whose
            // session leader is not in the image (the orphan of a command that ended, `nohup CMD
            // &`) joins CRIU's session (`--shell-job`), and one led from outside the namespace
            // reads as session 0, which the next dump of that task refuses. Leaving the helper's
            // process group, it dies with the helper instead (whose group a timeout kills).
            if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL) {
                fail("set the parent-death signal", e);
            }
            // The helper is outside the namespace: its pid reads as 0 here (1 once it is gone).
            if nix::unistd::getppid().as_raw() != 0 {
                fail("start CRIU", "the helper is gone");
            }
            if let Err(e) = nix::unistd::setsid() {
                fail("start a session", e);
            }
            // Now in the sandbox's pid namespace: a procfs of it, on this private /proc.
            if let Err(e) = mount(Some("proc"), "/proc", Some("proc"), MsFlags::empty(), None::<&str>) {
                fail("mount the sandbox's procfs", e);
            }
            let argv: Vec<CString> = criu
                .iter()
                .map(|a| CString::new(a.as_bytes()).unwrap_or_else(|_| fail("argument", "NUL byte")))
                .collect();
            let e = nix::unistd::execv(&argv[0], &argv).unwrap_err();
            fail(&format!("exec {:?}", argv[0]), e)
        }
        Ok(nix::unistd::ForkResult::Parent { child }) => std::process::exit(wait_exit(child, "CRIU")),
    }
}

/// Wait for `child` to end; its exit code (128 + the signal that killed it).
fn wait_exit(child: nix::unistd::Pid, what: &str) -> i32 {
    loop {
        match nix::sys::wait::waitpid(child, None) {
            Ok(nix::sys::wait::WaitStatus::Exited(_, code)) => return code,
            Ok(nix::sys::wait::WaitStatus::Signaled(_, sig, _)) => return 128 + sig as i32,
            Ok(_) | Err(nix::Error::EINTR) => continue,
            Err(e) => fail(&format!("wait for {what}"), e),
        }
    }
}

/// Move the last pid handed out in the pid namespace joined for children up to `pid` (never
/// down), from a child inside it.
fn raise_last_pid(pid: i32) {
    const LAST_PID: &str = "/proc/sys/kernel/ns_last_pid";
    // SAFETY: single-threaded program: the child may do anything.
    match unsafe { nix::unistd::fork() } {
        Err(e) => fail("fork", e),
        Ok(nix::unistd::ForkResult::Child) => {
            let now = std::fs::read_to_string(LAST_PID).ok().and_then(|t| t.trim().parse::<i32>().ok());
            let code = match now {
                Some(now) if now >= pid => 0,
                _ => match std::fs::write(LAST_PID, pid.to_string()) {
                    Ok(()) => 0,
                    Err(e) => {
                        eprintln!("branchbox-criu-exec: raise the sandbox's last pid to {pid}: {e}");
                        126
                    }
                },
            };
            std::process::exit(code)
        }
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            let code = wait_exit(child, "the child raising the last pid");
            if code != 0 {
                std::process::exit(code);
            }
        }
    }
}
