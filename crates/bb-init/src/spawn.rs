//! Fork and exec one sandbox process, confined (new session, capabilities, no_new_privs, seccomp).

use bb_proto::SpawnRequest;
use std::ffi::CString;
use std::os::fd::{AsRawFd, RawFd};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A request turned into C strings before forking.
pub struct Prepared {
    argv: Vec<CString>,
    envp: Vec<CString>,
    cwd: CString,
    candidates: Vec<CString>,
}

fn cstr(what: &str, s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} contains a NUL byte"))
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
            let path = req
                .env
                .iter()
                .find_map(|e| e.strip_prefix("PATH="))
                .unwrap_or(DEFAULT_PATH);
            path.split(':')
                .filter(|d| !d.is_empty())
                .map(|d| cstr("PATH entry", &format!("{d}/{prog}")))
                .collect::<Result<_, _>>()?
        };
        Ok(Prepared { argv, envp, cwd, candidates })
    }
}

/// Why a child could not start: errno and the stage that failed.
pub struct SpawnFailure {
    pub errno: i32,
    pub message: String,
}

const STAGES: &[&str] = &["dup2", "chdir", "setsid", "no_new_privs", "capabilities", "seccomp", "execve"];

/// Fork a child that execs `p` with `stdio` (stdin, stdout, stderr, fd 3; None = /dev/null or closed).
pub fn fork_exec(
    p: &Prepared,
    stdio: [Option<RawFd>; 4],
    policy: &bb_isolation::SeccompFilter,
) -> Result<i32, SpawnFailure> {
    let (err_r, err_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| SpawnFailure { errno: e as i32, message: format!("pipe2: {e}") })?;
    // SAFETY: init is single-threaded, so the child may run arbitrary code after fork.
    match unsafe { nix::unistd::fork() } {
        Err(e) => Err(SpawnFailure { errno: e as i32, message: format!("fork: {e}") }),
        Ok(nix::unistd::ForkResult::Child) => {
            let (stage, errno) = child(p, stdio, policy);
            let mut buf = [0u8; 5];
            buf[..4].copy_from_slice(&errno.to_ne_bytes());
            buf[4] = stage as u8;
            let _ = nix::unistd::write(&err_w, &buf);
            // SAFETY: leaving the forked child without running destructors or atexit handlers.
            unsafe { libc::_exit(127) }
        }
        Ok(nix::unistd::ForkResult::Parent { child: pid }) => {
            drop(err_w);
            let mut buf = [0u8; 5];
            let n = loop {
                match nix::unistd::read(err_r.as_raw_fd(), &mut buf) {
                    Err(nix::Error::EINTR) => continue,
                    other => break other.unwrap_or(0),
                }
            };
            if n == 0 {
                return Ok(pid.as_raw());
            }
            // The child failed before exec and exits 127; the main loop reaps it.
            let errno = i32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]);
            let stage = STAGES.get(buf[4] as usize).copied().unwrap_or("spawn");
            let err = std::io::Error::from_raw_os_error(errno);
            let message = match stage {
                "execve" => format!("cannot execute {:?}: {err}", p.argv[0]),
                "chdir" => format!("working directory {:?}: {err}", p.cwd),
                _ => format!("{stage}: {err}"),
            };
            Err(SpawnFailure { errno, message })
        }
    }
}

/// Runs in the forked child; returns only on failure (stage index, errno).
fn child(p: &Prepared, stdio: [Option<RawFd>; 4], policy: &bb_isolation::SeccompFilter) -> (usize, i32) {
    let errno = || nix::errno::Errno::last_raw();
    // SAFETY: plain syscalls on our own process state in a single-threaded child.
    unsafe {
        if libc::setsid() < 0 {
            return (2, errno());
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        for (target, fd) in stdio.iter().enumerate() {
            match (fd, target) {
                (Some(fd), _) => {
                    if libc::dup2(*fd, target as i32) < 0 {
                        return (0, errno());
                    }
                }
                (None, 0..=2) => {
                    if libc::dup2(null, target as i32) < 0 {
                        return (0, errno());
                    }
                }
                (None, _) => {}
            }
        }
        if libc::chdir(p.cwd.as_ptr()) < 0 {
            return (1, errno());
        }
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    }
    if bb_isolation::set_no_new_privs().is_err() {
        return (3, errno());
    }
    if bb_isolation::drop_capabilities().is_err() {
        return (4, errno());
    }
    if policy.apply().is_err() {
        return (5, errno());
    }
    let mut argv: Vec<*const libc::c_char> = p.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = p.envp.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());
    let mut last = libc::ENOENT;
    for c in &p.candidates {
        // SAFETY: NUL-terminated argv/envp arrays of valid C strings that outlive the call.
        unsafe { libc::execve(c.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
        let e = errno();
        // Like execvp: remember the most telling error (EACCES beats ENOENT).
        if e != libc::ENOENT && e != libc::ENOTDIR {
            last = e;
        }
    }
    (6, last)
}
