//! Fork and exec one sandbox process, confined (new session, capabilities, no_new_privs unless
//! setuid programs are to work, seccomp).

use bb_proto::SpawnRequest;
use std::ffi::CString;
use std::os::fd::RawFd;

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A request turned into C strings and pointer arrays before cloning: the child shares our
/// memory (vfork semantics) and must not allocate.
pub struct Prepared {
    argv: Vec<CString>,
    /// Owns the strings `envp_ptrs` points into.
    _envp: Vec<CString>,
    cwd: CString,
    candidates: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    envp_ptrs: Vec<*const libc::c_char>,
    /// uid and gid to take before exec (root's otherwise).
    ids: Option<(u32, u32)>,
    /// Stdin is a terminal to make the controlling one.
    tty: bool,
    /// Another user whose setuid programs take effect (no `no_new_privs`).
    allow_setuid: bool,
}

fn cstr(what: &str, s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} contains a NUL byte"))
}

fn ptrs(v: &[CString]) -> Vec<*const libc::c_char> {
    v.iter().map(|c| c.as_ptr()).chain(std::iter::once(std::ptr::null())).collect()
}

impl Prepared {
    pub fn new(req: &SpawnRequest) -> Result<Prepared, String> {
        let prog = req.argv.first().ok_or("argv is empty: give a command to run")?;
        let argv = req.argv.iter().map(|a| cstr("argument", a)).collect::<Result<Vec<_>, _>>()?;
        let envp = req.env.iter().map(|e| cstr("environment entry", e)).collect::<Result<Vec<_>, _>>()?;
        let cwd = cstr("cwd", &req.cwd)?;
        let candidates = if prog.contains('/') {
            vec![cstr("program", prog)?]
        } else {
            let path = req.env.iter().find_map(|e| e.strip_prefix("PATH=")).unwrap_or(DEFAULT_PATH);
            path.split(':')
                .filter(|d| !d.is_empty())
                .map(|d| cstr("PATH entry", &format!("{d}/{prog}")))
                .collect::<Result<_, _>>()?
        };
        let (argv_ptrs, envp_ptrs) = (ptrs(&argv), ptrs(&envp));
        Ok(Prepared {
            argv,
            _envp: envp,
            cwd,
            candidates,
            argv_ptrs,
            envp_ptrs,
            ids: req.ids,
            tty: req.pty.is_some(),
            allow_setuid: req.allow_setuid && req.ids.is_some(),
        })
    }
}

/// Why a child could not start: errno and the stage that failed.
pub struct SpawnFailure {
    pub errno: i32,
    pub message: String,
}

const STAGES: &[&str] =
    &["dup2", "chdir", "setsid", "seccomp", "execve", "capabilities", "set user", "controlling terminal"];

/// Stack of the vforked child until it execs.
const CHILD_STACK: usize = 64 * 1024;

/// Start a child that execs `p` with `stdio` (stdin, stdout, stderr, fd 3; None = /dev/null or
/// closed). Uses clone(CLONE_VM | CLONE_VFORK): no page-table copy, and init resumes once the child
/// has exec'd (or failed, reporting through memory we share).
pub fn fork_exec(
    p: &Prepared,
    stdio: [Option<RawFd>; 4],
    policy: &bb_isolation::SeccompFilter,
) -> Result<i32, SpawnFailure> {
    let mut stack = vec![0u8; CHILD_STACK];
    // (stage, errno) written by the child on failure; read after it exec'd or exited.
    let failure = std::cell::Cell::new((usize::MAX, 0i32));
    let cb = Box::new(|| -> isize {
        let (stage, errno) = child(p, stdio, policy);
        failure.set((stage, errno));
        // SAFETY: leaving the child without running destructors or atexit handlers.
        unsafe { libc::_exit(127) }
    });
    let flags = nix::sched::CloneFlags::CLONE_VM | nix::sched::CloneFlags::CLONE_VFORK;
    // SAFETY: the child runs `child`, which makes only raw syscalls on memory prepared before the
    // clone (no allocation, no locks), on its own stack, and ends in execve or _exit.
    let pid = unsafe { nix::sched::clone(cb, &mut stack, flags, Some(libc::SIGCHLD)) }
        .map_err(|e| SpawnFailure { errno: e as i32, message: format!("clone: {e}") })?;
    let (stage, errno) = failure.get();
    if stage == usize::MAX {
        return Ok(pid.as_raw());
    }
    // The child exits 127; the main loop reaps it.
    let err = std::io::Error::from_raw_os_error(errno);
    let message = match STAGES.get(stage).copied().unwrap_or("spawn") {
        "execve" => format!("cannot execute {:?}: {err}", p.argv[0]),
        "chdir" => format!("working directory {:?}: {err}", p.cwd),
        stage => format!("{stage}: {err}"),
    };
    Err(SpawnFailure { errno, message })
}

/// Runs in the child; returns only on failure (stage index, errno). No allocation allowed.
fn child(p: &Prepared, stdio: [Option<RawFd>; 4], policy: &bb_isolation::SeccompFilter) -> (usize, i32) {
    let errno = || nix::errno::Errno::last_raw();
    // SAFETY: plain syscalls on this process's own state, with pointers prepared before the clone.
    unsafe {
        if libc::setsid() < 0 {
            return (2, errno());
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        for (target, fd) in stdio.iter().enumerate() {
            let src = match (fd, target) {
                (Some(fd), _) => *fd,
                (None, 0..=2) => null,
                (None, _) => continue,
            };
            if libc::dup2(src, target as i32) < 0 {
                return (0, errno());
            }
        }
        if p.tty && bb_sys::pty::set_controlling_terminal(0).is_err() {
            return (7, errno());
        }
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    }
    // Setuid programs to take effect: no no_new_privs, so the filter goes on while this child
    // still has init's CAP_SYS_ADMIN (in the sandbox's user namespace), before the drop below.
    if p.allow_setuid && policy.apply_keeping_setuid().is_err() {
        return (3, errno());
    }
    // Init keeps its capabilities (it starts nested sandboxes); its children get Docker's set.
    // Neither call allocates. `apply` sets no_new_privs first.
    if bb_isolation::drop_capabilities().is_err() {
        return (5, errno());
    }
    // Another user: no supplementary groups, then gid and uid (which clears the capabilities
    // left); the working directory is entered as that user.
    if let Some((uid, gid)) = p.ids {
        // SAFETY: plain syscalls on this process's own credentials.
        unsafe {
            if libc::setgroups(0, std::ptr::null()) < 0 || libc::setgid(gid) < 0 || libc::setuid(uid) < 0 {
                return (6, errno());
            }
        }
    }
    // SAFETY: chdir with a NUL-terminated path prepared before the clone.
    if unsafe { libc::chdir(p.cwd.as_ptr()) } < 0 {
        return (1, errno());
    }
    if !p.allow_setuid && policy.apply().is_err() {
        return (3, errno());
    }
    let mut last = libc::ENOENT;
    for c in &p.candidates {
        // SAFETY: NUL-terminated argv/envp pointer arrays into CStrings that outlive the call.
        unsafe { libc::execve(c.as_ptr(), p.argv_ptrs.as_ptr(), p.envp_ptrs.as_ptr()) };
        let e = errno();
        // Like execvp: remember the most telling error (EACCES beats ENOENT).
        if e != libc::ENOENT && e != libc::ENOTDIR {
            last = e;
        }
    }
    (4, last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn req(argv: &[&str], env: &[&str]) -> SpawnRequest {
        SpawnRequest::new(
            argv.iter().map(|s| s.to_string()).collect(),
            env.iter().map(|s| s.to_string()).collect(),
            "/",
        )
    }

    #[test]
    fn program_is_searched_in_the_requests_path() {
        let p = Prepared::new(&req(&["ls", "-l"], &["PATH=/a::/b"])).unwrap();
        let c: Vec<_> = p.candidates.iter().map(|c| c.to_str().unwrap()).collect();
        assert_eq!(c, ["/a/ls", "/b/ls"]);
        let p = Prepared::new(&req(&["./x"], &[])).unwrap();
        assert_eq!(p.candidates.len(), 1, "a path with a slash is not searched");
        let p = Prepared::new(&req(&["ls"], &[])).unwrap();
        assert_eq!(p.candidates.first().unwrap().to_str().unwrap(), "/usr/local/sbin/ls");
        assert_eq!(*p.argv_ptrs.last().unwrap(), std::ptr::null(), "argv is NULL-terminated");
    }

    #[test]
    fn bad_requests_are_refused_before_cloning() {
        assert!(Prepared::new(&req(&[], &[])).is_err());
        assert!(Prepared::new(&req(&["a\0b"], &[])).is_err());
        assert!(Prepared::new(&req(&["ls"], &["A=\0"])).is_err());
    }

    /// Spawns real children (no namespaces needed): exit status, exec failure, bad cwd.
    #[test]
    fn fork_exec_runs_reports_and_fails_cleanly() {
        let policy = bb_isolation::SeccompFilter::default_policy().unwrap();
        let pid = fork_exec(&Prepared::new(&req(&["/bin/sh", "-c", "exit 7"], &[])).unwrap(), [None; 4], &policy)
            .unwrap_or_else(|f| panic!("{}", f.message));
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(libc::WEXITSTATUS(status), 7);
        let err = fork_exec(&Prepared::new(&req(&["/no/such/program"], &[])).unwrap(), [None; 4], &policy)
            .expect_err("exec must fail");
        assert_eq!(err.errno, libc::ENOENT);
        assert!(err.message.contains("/no/such/program"), "{}", err.message);
        let mut r = req(&["/bin/true"], &[]);
        r.cwd = "/no/such/dir".into();
        let err = fork_exec(&Prepared::new(&r).unwrap(), [None; 4], &policy).expect_err("chdir must fail");
        assert!(err.message.contains("working directory"), "{}", err.message);
        // Reap the failed children.
        // SAFETY: reaping our own children.
        while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
    }

    /// Root only (a child of root has CAP_SYS_ADMIN, as init's children have in a sandbox): a
    /// process of another user started with `allow_setuid` runs filtered without no_new_privs,
    /// one without it (or a root one asking for it) with both.
    #[test]
    fn allow_setuid_leaves_out_no_new_privs_only_for_another_user() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let policy = bb_isolation::SeccompFilter::default_policy().unwrap();
        let status_of = |ids: Option<(u32, u32)>, allow_setuid: bool| -> String {
            let (read, write) = nix::unistd::pipe().unwrap();
            let r = SpawnRequest {
                ids,
                allow_setuid,
                ..req(&["/bin/sh", "-c", "grep -E '^(Uid|NoNewPrivs|Seccomp):' /proc/self/status"], &[])
            };
            let pid = fork_exec(&Prepared::new(&r).unwrap(), [None, Some(write.as_raw_fd()), None, None], &policy)
                .unwrap_or_else(|f| panic!("{}", f.message));
            drop(write);
            let mut out = String::new();
            std::io::Read::read_to_string(&mut std::fs::File::from(read), &mut out).unwrap();
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            assert_eq!(libc::WEXITSTATUS(status), 0, "{out}");
            out.split_whitespace().collect::<Vec<_>>().join(" ")
        };
        let nobody = Some((65534, 65534));
        assert_eq!(status_of(nobody, true), "Uid: 65534 65534 65534 65534 NoNewPrivs: 0 Seccomp: 2");
        assert_eq!(status_of(nobody, false), "Uid: 65534 65534 65534 65534 NoNewPrivs: 1 Seccomp: 2");
        assert_eq!(status_of(None, true), "Uid: 0 0 0 0 NoNewPrivs: 1 Seccomp: 2");
    }
}
