//! Commands: foreground (buffered or streamed), background (logged to files), wait, kill, list.

use crate::error::{Result, RuntimeError};
use crate::initconn::{init_error, unexpected, InitConn};
use crate::model::{CommandEvent, CommandResult, ProcessInfo, RunCommand};
use crate::sandbox::Sandbox;
use base64::Engine;
pub use bb_proto::ExitStatus;
use bb_proto::{Request, Response, SpawnRequest};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, watch};

/// Largest stdout or stderr kept per command; the rest is read and dropped (`*_truncated`).
pub const MAX_OUTPUT: usize = 16 << 20;
pub const DEFAULT_TIMEOUT: f64 = 60.0;

/// What to run, resolved against the sandbox's defaults.
pub struct Resolved {
    pub argv: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub stdin: Option<Vec<u8>>,
    pub timeout: Option<Duration>,
    pub tag: String,
    /// uid and gid to run as (root when None).
    pub ids: Option<(u32, u32)>,
}

pub fn resolve(sb: &Sandbox, req: &RunCommand) -> Result<Resolved> {
    let (argv, tag) = match (&req.cmd, &req.args) {
        (Some(cmd), None) if cmd.trim().is_empty() => {
            return Err(RuntimeError::BadRequest("cmd is empty: give a shell command line".into()))
        }
        (Some(cmd), None) => (vec!["/bin/sh".into(), "-c".into(), cmd.clone()], cmd.clone()),
        (None, Some(args)) if !args.is_empty() => (args.clone(), args.join(" ")),
        (None, Some(_)) => return Err(RuntimeError::BadRequest("args is empty: give at least the program".into())),
        (Some(_), Some(_)) => return Err(RuntimeError::BadRequest("give either cmd or args, not both".into())),
        (None, None) => {
            return Err(RuntimeError::BadRequest("give cmd (a shell command line) or args (an argv list)".into()))
        }
    };
    let stdin = match (&req.stdin, &req.stdin_b64) {
        (Some(_), Some(_)) => return Err(RuntimeError::BadRequest("give either stdin or stdin_b64, not both".into())),
        (Some(s), None) => Some(s.clone().into_bytes()),
        (None, Some(b)) => Some(
            base64::engine::general_purpose::STANDARD
                .decode(b)
                .map_err(|e| RuntimeError::BadRequest(format!("stdin_b64 is not valid base64: {e}")))?,
        ),
        (None, None) => None,
    };
    let timeout = match req.timeout {
        None => Some(Duration::from_secs_f64(DEFAULT_TIMEOUT)),
        Some(t) if t < 0.0 || !t.is_finite() => {
            return Err(RuntimeError::BadRequest("timeout must be >= 0 seconds (0 = no limit)".into()))
        }
        Some(0.0) => None,
        Some(t) => Some(Duration::from_secs_f64(t)),
    };
    let mut env = req.env.clone();
    let (ids, home) = match req.user.as_deref() {
        None | Some("root") => (None, None),
        Some(name) => {
            let u = crate::sandbox::files::lookup_user(&sb.rootfs(), name)?;
            for (k, v) in [("HOME", u.home.as_str()), ("USER", name), ("LOGNAME", name)] {
                env.entry(k.into()).or_insert_with(|| v.into());
            }
            (Some((u.uid, u.gid)), Some(u.home))
        }
    };
    Ok(Resolved {
        argv,
        env: sb.env_with(&env),
        cwd: req.cwd.clone().or(home).unwrap_or_else(|| sb.spec.cwd.clone()),
        stdin,
        timeout,
        tag,
        ids,
    })
}

/// How a process relates to the request that starts it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Ends with the request (its output is the answer).
    Foreground,
    /// Outlives it, its output in log files.
    Background,
    /// Outlives it, its output read by the daemon for its owner ([`AttachedProcess`]).
    Attached,
}

/// Connect to init and ask it to spawn `r` with these stdio fds (stdin only when given).
async fn send_spawn(
    sb: &Sandbox,
    r: &mut Resolved,
    kind: Kind,
    stdin: Option<RawFd>,
    stdout: RawFd,
    stderr: RawFd,
) -> Result<InitConn> {
    let conn = InitConn::connect(&sb.dirs.sock()).await?;
    let req = SpawnRequest {
        background: kind == Kind::Background,
        attached: kind == Kind::Attached,
        stdin: stdin.is_some(),
        stdout: true,
        stderr: true,
        tag: std::mem::take(&mut r.tag),
        ids: r.ids,
        // Init honours it only for another user (`ids`).
        allow_setuid: sb.spec.sudo,
        ..SpawnRequest::new(std::mem::take(&mut r.argv), std::mem::take(&mut r.env), std::mem::take(&mut r.cwd))
    };
    let fds: Vec<RawFd> = stdin.into_iter().chain([stdout, stderr]).collect();
    conn.send(&Request::Spawn(req), &fds)?;
    Ok(conn)
}

fn pipe_pair() -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| RuntimeError::io("pipe")(e.into()))
}

fn receiver(fd: OwnedFd) -> Result<pipe::Receiver> {
    pipe::Receiver::from_owned_fd(fd).map_err(RuntimeError::io("pipe"))
}

/// Accumulates one output stream, capped, and forwards chunks as events.
struct Collector {
    buf: Vec<u8>,
    truncated: bool,
    carry: Vec<u8>,
    events: Option<mpsc::Sender<CommandEvent>>,
    is_err: bool,
}

impl Collector {
    async fn emit(&self, bytes: &[u8]) {
        if let Some(tx) = &self.events {
            let data = String::from_utf8_lossy(bytes).into_owned();
            let ev = if self.is_err { CommandEvent::Stderr { data } } else { CommandEvent::Stdout { data } };
            let _ = tx.send(ev).await;
        }
    }

    async fn push(&mut self, data: &[u8]) {
        let room = MAX_OUTPUT.saturating_sub(self.buf.len());
        if data.len() > room {
            self.truncated = true;
        }
        self.buf.extend_from_slice(&data[..data.len().min(room)]);
        if self.events.is_some() {
            // Never split a UTF-8 sequence across two events.
            self.carry.extend_from_slice(data);
            let cut = match std::str::from_utf8(&self.carry) {
                Ok(_) => self.carry.len(),
                Err(e) if e.error_len().is_none() => e.valid_up_to(),
                Err(_) => self.carry.len(),
            };
            if cut > 0 {
                let head: Vec<u8> = self.carry.drain(..cut).collect();
                self.emit(&head).await;
            }
        }
    }

    async fn finish(mut self) -> (String, bool) {
        if !self.carry.is_empty() {
            let rest = std::mem::take(&mut self.carry);
            self.emit(&rest).await;
        }
        (String::from_utf8_lossy(&self.buf).into_owned(), self.truncated)
    }
}

/// Where a pipe's bytes go: a collector (buffered and maybe streamed as text), or raw chunks to
/// an attached process's owner.
enum Sink {
    Collect(Collector),
    Raw { tx: mpsc::Sender<Attached>, is_err: bool },
}

impl Sink {
    async fn push(&mut self, data: &[u8]) {
        match self {
            Sink::Collect(c) => c.push(data).await,
            Sink::Raw { tx, is_err } => {
                let chunk = bytes::Bytes::copy_from_slice(data);
                let ev = if *is_err { Attached::Stderr(chunk) } else { Attached::Stdout(chunk) };
                let _ = tx.send(ev).await;
            }
        }
    }
}

/// Read a pipe until EOF, or — once `exited` fires — until it is momentarily empty: what the
/// process wrote before exiting is already in the pipe, and a grandchild that keeps the pipe open
/// must not hold the answer hostage.
async fn collect(rx: pipe::Receiver, col: Collector, exited: watch::Receiver<bool>) -> (String, bool) {
    match drain(rx, Sink::Collect(col), exited).await {
        Sink::Collect(col) => col.finish().await,
        Sink::Raw { .. } => unreachable!("drain hands back the sink it was given"),
    }
}

async fn drain(rx: pipe::Receiver, mut col: Sink, mut exited: watch::Receiver<bool>) -> Sink {
    let mut buf = vec![0u8; 64 * 1024];
    let mut draining = false;
    loop {
        if *exited.borrow() {
            draining = true;
        }
        if draining {
            // A raw read: tokio's try_read answers WouldBlock without reading whenever the reactor
            // has not yet seen the pipe readable, which would drop output still in the pipe.
            match nix::unistd::read(rx.as_raw_fd(), &mut buf) {
                Ok(0) => break,
                Ok(n) => col.push(&buf[..n]).await,
                Err(nix::Error::EINTR) => {}
                Err(_) => break, // EAGAIN: the pipe is empty
            }
            continue;
        }
        tokio::select! {
            r = rx.readable() => {
                if r.is_err() { break; }
                match rx.try_read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => col.push(&buf[..n]).await,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => break,
                }
            }
            _ = exited.changed() => draining = true,
        }
    }
    col
}

/// Run a command in the foreground. With `events`, output is also streamed as it comes.
pub async fn run(sb: &Sandbox, req: &RunCommand, events: Option<mpsc::Sender<CommandEvent>>) -> Result<CommandResult> {
    let mut r = resolve(sb, req)?;
    let started = Instant::now();
    let (out_r, out_w) = pipe_pair()?;
    let (err_r, err_w) = pipe_pair()?;
    let stdin_pipe = match r.stdin {
        Some(_) => Some(pipe_pair()?),
        None => None,
    };
    let oom_before = sb.oom_seen();
    let stdin_rd = stdin_pipe.as_ref().map(|(rd, _)| rd.as_raw_fd());
    let conn = send_spawn(sb, &mut r, Kind::Foreground, stdin_rd, out_w.as_raw_fd(), err_w.as_raw_fd()).await?;
    drop(out_w);
    drop(err_w);
    let stdin_w = stdin_pipe.map(|(rd, wr)| {
        drop(rd);
        wr
    });
    let pid = match conn.recv().await? {
        Response::Started { pid } => pid,
        Response::Error { errno, message } => return Err(init_error(errno, message)),
        other => return Err(unexpected(other)),
    };
    if let Some(tx) = &events {
        let _ = tx.send(CommandEvent::Start { pid }).await;
    }
    if let (Some(w), Some(data)) = (stdin_w, r.stdin) {
        let mut tx = pipe::Sender::from_owned_fd(w).map_err(RuntimeError::io("stdin pipe"))?;
        tokio::spawn(async move {
            let _ = tx.write_all(&data).await;
        });
    }
    let (exited_tx, exited) = watch::channel(false);
    let col =
        |is_err| Collector { buf: Vec::new(), truncated: false, carry: Vec::new(), events: events.clone(), is_err };
    let out_task = tokio::spawn(collect(receiver(out_r)?, col(false), exited.clone()));
    let err_task = tokio::spawn(collect(receiver(err_r)?, col(true), exited.clone()));

    let wait_exit = exit_status(&conn);
    let (status, timed_out) = match r.timeout {
        None => (wait_exit.await?, false),
        Some(t) => {
            tokio::pin!(wait_exit);
            match tokio::time::timeout(t, &mut wait_exit).await {
                Ok(s) => (s?, false),
                Err(_) => {
                    let _ = InitConn::call(&sb.dirs.sock(), &Request::Kill { pid, signal: libc::SIGKILL, group: true })
                        .await;
                    let s = tokio::time::timeout(Duration::from_secs(5), &mut wait_exit)
                        .await
                        .unwrap_or(Ok(ExitStatus { code: None, signal: Some(libc::SIGKILL) }))?;
                    (s, true)
                }
            }
        }
    };
    let _ = exited_tx.send(true);
    let (stdout, stdout_truncated) = out_task.await?;
    let (stderr, stderr_truncated) = err_task.await?;
    // Killed by SIGKILL itself, or a shell reporting a SIGKILLed child (128 + 9): ask the cgroup
    // whether the OOM killer did it.
    let killed = status.signal == Some(libc::SIGKILL) || status.code == Some(128 + libc::SIGKILL);
    let oom_killed = killed && sb.oom_since(oom_before);
    let result = CommandResult {
        pid,
        exit_code: if timed_out { None } else { status.code },
        signal: status.signal,
        stdout,
        stderr,
        timed_out,
        oom_killed,
        duration: started.elapsed().as_secs_f64(),
        stdout_truncated,
        stderr_truncated,
    };
    if let Some(tx) = &events {
        let _ = tx
            .send(CommandEvent::Exit {
                pid,
                exit_code: result.exit_code,
                signal: result.signal,
                timed_out,
                oom_killed,
                duration: result.duration,
            })
            .await;
    }
    Ok(result)
}

fn unknown_process(pid: i32) -> RuntimeError {
    RuntimeError::NotFound {
        kind: "process",
        id: pid.to_string(),
        hint: ": it is not running or was not started through the API (list processes with commands.list)",
    }
}

fn log_paths(sb: &Sandbox, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    (sb.dirs.logs().join(format!("{name}.out")), sb.dirs.logs().join(format!("{name}.err")))
}

/// Start a background process; its output goes to log files kept by the daemon.
pub async fn start_background(sb: &Sandbox, req: &RunCommand) -> Result<i32> {
    let mut r = resolve(sb, req)?;
    let tmp = format!("tmp-{}", uuid::Uuid::new_v4().simple());
    let (out_p, err_p) = log_paths(sb, &tmp);
    // Appending: CRIU then checks no size when it restores the process (after a rollback the
    // log has grown since the checkpoint; a fork child has a log of its own, new).
    let (out, err) = (sb.open_log(&format!("{tmp}.out"), true)?, sb.open_log(&format!("{tmp}.err"), true)?);
    let stdin_pipe = match r.stdin {
        Some(_) => Some(pipe_pair()?),
        None => None,
    };
    let stdin_rd = stdin_pipe.as_ref().map(|(rd, _)| rd.as_raw_fd());
    let conn = send_spawn(sb, &mut r, Kind::Background, stdin_rd, out.as_raw_fd(), err.as_raw_fd()).await?;
    let pid = match conn.recv().await {
        Ok(Response::Started { pid }) => pid,
        Ok(Response::Error { errno, message }) => {
            let _ = std::fs::remove_file(&out_p);
            let _ = std::fs::remove_file(&err_p);
            return Err(init_error(errno, message));
        }
        Ok(other) => return Err(unexpected(other)),
        Err(e) => return Err(e),
    };
    let (out_final, err_final) = log_paths(sb, &pid.to_string());
    let _ = std::fs::rename(&out_p, out_final);
    let _ = std::fs::rename(&err_p, err_final);
    if let (Some((rd, wr)), Some(data)) = (stdin_pipe, r.stdin) {
        drop(rd);
        let mut tx = pipe::Sender::from_owned_fd(wr).map_err(RuntimeError::io("stdin pipe"))?;
        tokio::spawn(async move {
            let _ = tx.write_all(&data).await;
        });
    }
    Ok(pid)
}

/// What an attached process sends its owner: output as it comes, then its exit (or nothing, when
/// the sandbox went away under it: the channel just closes).
#[derive(Debug)]
pub enum Attached {
    Stdout(bytes::Bytes),
    Stderr(bytes::Bytes),
    /// Output of a process on a pseudo-terminal (its stdout and stderr, as the terminal shows them).
    Pty(bytes::Bytes),
    Exit(ExitStatus),
}

/// The master of a pseudo-terminal, registered with the reactor.
type Master = Arc<tokio::io::unix::AsyncFd<OwnedFd>>;

fn master(fd: OwnedFd) -> Result<Master> {
    nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK))
        .map_err(|e| RuntimeError::io("pty")(e.into()))?;
    // SAFETY: `fd` is an fd we own, moved into the AsyncFd, which keeps it open while it lives.
    let fd =
        unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(|e| RuntimeError::io("pty")(e.into_parts().1))?;
    Ok(Arc::new(fd))
}

/// The master of a pseudo-terminal a process was started on, held by the daemon: input goes in,
/// the terminal's size changes here. After a pause and resume, the process's new terminal takes
/// the old one's place here.
#[derive(Clone)]
pub struct Pty {
    fd: Arc<parking_lot::Mutex<Master>>,
}

impl Pty {
    fn current(&self) -> Master {
        self.fd.lock().clone()
    }

    /// Type `data` into the terminal.
    pub async fn write(&self, mut data: &[u8]) -> Result<()> {
        let fd = self.current();
        while !data.is_empty() {
            let mut guard = fd.writable().await.map_err(RuntimeError::io("pty"))?;
            match nix::unistd::write(fd.get_ref(), data) {
                Ok(n) => data = &data[n..],
                Err(nix::Error::EAGAIN) => guard.clear_ready(),
                Err(nix::Error::EINTR) => {}
                Err(e) => return Err(RuntimeError::io("write to the pty")(e.into())),
            }
        }
        Ok(())
    }

    /// Resize the terminal (its foreground process group gets SIGWINCH).
    pub fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        use std::os::fd::AsFd;
        bb_sys::pty::set_window_size(self.current().get_ref().as_fd(), rows, cols)
            .map_err(|e| RuntimeError::io("resize the pty")(e.source))
    }

    /// The terminal's size: (rows, cols).
    fn size(&self) -> Result<(u16, u16)> {
        use std::os::fd::AsFd;
        bb_sys::pty::window_size(self.current().get_ref().as_fd()).map_err(|e| RuntimeError::io("pty size")(e.source))
    }
}

/// Read a pty's output until the terminal closes, or, once the process exited, until nothing is
/// left (processes it left behind may keep the terminal open).
async fn drain_pty(fd: Master, tx: mpsc::Sender<Attached>, mut exited: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 64 * 1024];
    let raw = fd.get_ref().as_raw_fd();
    loop {
        if *exited.borrow() {
            match nix::unistd::read(raw, &mut buf) {
                Ok(n) if n > 0 => {
                    let _ = tx.send(Attached::Pty(bytes::Bytes::copy_from_slice(&buf[..n]))).await;
                    continue;
                }
                Err(nix::Error::EINTR) => continue,
                _ => return, // EAGAIN (empty), EIO (closed)
            }
        }
        tokio::select! {
            ready = fd.readable() => {
                let Ok(mut guard) = ready else { return };
                match nix::unistd::read(raw, &mut buf) {
                    Ok(0) => return,
                    Ok(n) => { let _ = tx.send(Attached::Pty(bytes::Bytes::copy_from_slice(&buf[..n]))).await; }
                    Err(nix::Error::EAGAIN) => guard.clear_ready(),
                    Err(nix::Error::EINTR) => {}
                    Err(_) => return, // EIO: every holder of the terminal closed it
                }
            }
            _ = exited.changed() => {}
        }
    }
}

/// What takes the attached processes restores bring back: (sandbox id, note, the process).
pub type AttachedHook = Arc<dyn Fn(&str, serde_json::Value, AttachedProcess) + Send + Sync>;

/// A process whose owner holds its stdin (or terminal) and reads its output as raw bytes, for as
/// long as it runs (no timeout): it outlives the request that started it, not the daemon. Like a
/// foreground command, it holds an init connection (init kills its process group if that drops).
/// A full pause keeps it: the resume gives it new pipes (or a new terminal), which its owner's
/// `stdin`, `pty` and `events` then use ([`Plugs`]). A checkpoint that keeps processes keeps it
/// too: restored elsewhere (a fork child) or after a rollback, it gets new ends there, held by
/// the daemon, and goes to [`Runtime::on_attached_restored`]'s hook (init, not a connection,
/// owns the restored one).
pub struct AttachedProcess {
    pub pid: i32,
    /// Its stdin, when asked for.
    pub stdin: Option<Stdin>,
    /// Its terminal, when started on one (then `stdin` is None: input goes through the terminal).
    pub pty: Option<Pty>,
    pub events: mpsc::Receiver<Attached>,
}

/// The stdin of an attached process as its owner writes to it: after a pause and resume, the
/// new pipe the process reads takes the old one's place here.
#[derive(Clone)]
pub struct Stdin(Arc<tokio::sync::Mutex<Option<pipe::Sender>>>);

impl Stdin {
    fn new(w: pipe::Sender) -> Stdin {
        Stdin(Arc::new(tokio::sync::Mutex::new(Some(w))))
    }

    /// Write all of `data` (waits while the pipe is full).
    pub async fn write_all(&self, data: &[u8]) -> std::io::Result<()> {
        match self.0.lock().await.as_mut() {
            Some(w) => w.write_all(data).await,
            None => Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "its stdin was closed")),
        }
    }

    /// Close it: the process reads the end of its input (for good: a resume keeps it closed).
    pub async fn close(&self) {
        self.0.lock().await.take();
    }
}

/// Start `req` attached (see [`AttachedProcess`]); `req.stdin` and `req.timeout` are not used.
/// `pty`: on a new pseudo-terminal of this size (rows, cols) instead of pipes. `note`: what its
/// owner says of it, kept with it by checkpoints (see [`KeptAttached`]).
pub async fn start_attached(
    sb: &Sandbox,
    req: &RunCommand,
    stdin: bool,
    pty: Option<(u16, u16)>,
    note: serde_json::Value,
) -> Result<AttachedProcess> {
    if let Some(size) = pty {
        return start_on_pty(sb, req, size, note).await;
    }
    let mut r = resolve(sb, req)?;
    let tag = r.tag.clone();
    let (out_r, out_w) = pipe_pair()?;
    let (err_r, err_w) = pipe_pair()?;
    let stdin_pipe = if stdin { Some(pipe_pair()?) } else { None };
    let stdin_rd = stdin_pipe.as_ref().map(|(rd, _)| rd.as_raw_fd());
    let conn = send_spawn(sb, &mut r, Kind::Attached, stdin_rd, out_w.as_raw_fd(), err_w.as_raw_fd()).await?;
    drop((out_w, err_w));
    let inodes = (pipe_inode(&out_r)?, pipe_inode(&err_r)?);
    let stdin = match stdin_pipe {
        Some((rd, wr)) => {
            drop(rd);
            let ino = pipe_inode(&wr)?;
            Some((ino, Stdin::new(pipe::Sender::from_owned_fd(wr).map_err(RuntimeError::io("stdin pipe"))?)))
        }
        None => None,
    };
    let pid = match conn.recv().await? {
        Response::Started { pid } => pid,
        Response::Error { errno, message } => return Err(init_error(errno, message)),
        other => return Err(unexpected(other)),
    };
    let (tx, events) = mpsc::channel(256);
    let (to, replug) = mpsc::unbounded_channel();
    let wiring = Wiring::Pipes { stdin: stdin.clone(), stdout: inodes.0, stderr: inodes.1, to };
    let pipes = (receiver(out_r)?, receiver(err_r)?);
    sb.plugs.watch(pid, Plugged { wiring, tag, note }, read_pipes(conn, pipes, replug, tx));
    Ok(AttachedProcess { pid, stdin: stdin.map(|(_, s)| s), pty: None, events })
}

/// [`read_attached`] for a process on pipes (stdout, stderr).
async fn read_pipes(
    conn: InitConn,
    pipes: (pipe::Receiver, pipe::Receiver),
    replug: mpsc::UnboundedReceiver<(pipe::Receiver, pipe::Receiver)>,
    tx: mpsc::Sender<Attached>,
) {
    let read = |(out, err): (pipe::Receiver, pipe::Receiver), tx: &mpsc::Sender<Attached>, exited| {
        let (tx, exited_too) = (tx.clone(), watch::Receiver::clone(&exited));
        let out_task = tokio::spawn(drain(out, Sink::Raw { tx: tx.clone(), is_err: false }, exited_too));
        let err_task = tokio::spawn(drain(err, Sink::Raw { tx, is_err: true }, exited));
        async move {
            let _ = out_task.await;
            let _ = err_task.await;
        }
    };
    read_attached(conn, pipes, replug, tx, read).await
}

async fn start_on_pty(
    sb: &Sandbox,
    req: &RunCommand,
    (rows, cols): (u16, u16),
    note: serde_json::Value,
) -> Result<AttachedProcess> {
    if rows == 0 || cols == 0 {
        return Err(RuntimeError::BadRequest(format!("a terminal of {rows}x{cols}: give at least 1 row and 1 column")));
    }
    let mut r = resolve(sb, req)?;
    let tag = r.tag.clone();
    let conn = InitConn::connect(&sb.dirs.sock()).await?;
    let spawn = SpawnRequest {
        tag: std::mem::take(&mut r.tag),
        ids: r.ids,
        allow_setuid: sb.spec.sudo,
        pty: Some((rows, cols)),
        attached: true,
        ..SpawnRequest::new(std::mem::take(&mut r.argv), std::mem::take(&mut r.env), std::mem::take(&mut r.cwd))
    };
    conn.send(&Request::Spawn(spawn), &[])?;
    let (pid, fd) = match conn.recv_fds().await? {
        (Response::Started { pid }, fds) => match fds.into_iter().next() {
            Some(m) => (pid, m),
            None => return Err(unexpected(Response::Started { pid })),
        },
        (Response::Error { errno, message }, _) => return Err(init_error(errno, message)),
        (other, _) => return Err(unexpected(other)),
    };
    Ok(plug_terminal(sb, pid, conn, master(fd)?, r.ids, tag, note))
}

/// Track attached process `pid` on terminal `fd` (whose exit `conn` reports) in `sb.plugs`.
fn plug_terminal(
    sb: &Sandbox,
    pid: i32,
    conn: InitConn,
    fd: Master,
    ids: Option<(u32, u32)>,
    tag: String,
    note: serde_json::Value,
) -> AttachedProcess {
    let pty = Pty { fd: Arc::new(parking_lot::Mutex::new(fd.clone())) };
    let (tx, events) = mpsc::channel(256);
    let (to, replug) = mpsc::unbounded_channel();
    let wiring = Wiring::Terminal { pty: pty.clone(), ids, tty: None, to };
    sb.plugs.watch(pid, Plugged { wiring, tag, note }, async move {
        let read = |fd: Master, tx: &mpsc::Sender<Attached>, exited| drain_pty(fd, tx.clone(), exited);
        read_attached(conn, fd, replug, tx, read).await
    });
    AttachedProcess { pid, stdin: None, pty: Some(pty), events }
}

/// Read an attached process's output (from `ends`, with `read`) into `tx` until it exits, then
/// report its exit. When its ends close before (a pause ended the process), the ends the resume
/// gives it arrive on `replug`.
async fn read_attached<E, R, F>(
    conn: InitConn,
    mut ends: E,
    mut replug: mpsc::UnboundedReceiver<E>,
    tx: mpsc::Sender<Attached>,
    read: F,
) where
    F: Fn(E, &mpsc::Sender<Attached>, watch::Receiver<bool>) -> R,
    R: std::future::Future<Output = ()>,
{
    let exit = async move { exit_status(&conn).await.ok() }; // None: the sandbox went away
    tokio::pin!(exit);
    loop {
        let (exited_tx, exited) = watch::channel(false);
        let readers = read(ends, &tx, exited);
        tokio::pin!(readers);
        let status = tokio::select! {
            status = &mut exit => {
                let _ = exited_tx.send(true);
                readers.await;
                status
            }
            () = &mut readers => tokio::select! {
                status = &mut exit => status,
                Some(new) = replug.recv() => {
                    ends = new;
                    continue;
                }
            },
        };
        if let Some(status) = status {
            let _ = tx.send(Attached::Exit(status)).await;
        }
        return;
    }
}

/// The exit status init reports on `conn`, the spawn's connection (an error: the sandbox, its
/// init, went away).
async fn exit_status(conn: &InitConn) -> Result<ExitStatus> {
    loop {
        if let Response::Exited { status, .. } = conn.recv().await? {
            return Ok(status);
        }
    }
}

/// Inode of the pipe `fd` is an end of (CRIU names the pipe `pipe:[INODE]`).
fn pipe_inode(fd: &impl AsRawFd) -> Result<u64> {
    nix::sys::stat::fstat(fd.as_raw_fd()).map(|st| st.st_ino).map_err(|e| RuntimeError::io("pipe")(e.into()))
}

/// How an attached process is wired to the daemon, for a pause to dump it and the resume to
/// give it new ends: what CRIU calls its ends now, and where the new ones go.
enum Wiring {
    Pipes {
        /// Inode of its stdin pipe, and its owner's writer.
        stdin: Option<(u64, Stdin)>,
        /// Inodes of its stdout and stderr pipes.
        stdout: u64,
        stderr: u64,
        /// New read ends of its stdout and stderr, to [`read_attached`].
        to: mpsc::UnboundedSender<(pipe::Receiver, pipe::Receiver)>,
    },
    Terminal {
        pty: Pty,
        /// Owner of its terminal (sandbox ids; root when None).
        ids: Option<(u32, u32)>,
        /// CRIU's name of its terminal (`tty[RDEV:DEV]`), read from the process as it is dumped.
        tty: Option<String>,
        /// New masters, to [`read_attached`].
        to: mpsc::UnboundedSender<Master>,
    },
}

struct Plug {
    /// Tells this process's plug from that of a later one under the same pid.
    serial: u64,
    wiring: Wiring,
    /// Init's tag of the process (its command line).
    tag: String,
    /// What its owner said of it when it started it.
    note: serde_json::Value,
}

/// What [`Plugs::watch`] tracks of a process.
struct Plugged {
    wiring: Wiring,
    tag: String,
    note: serde_json::Value,
}

/// How an attached process a checkpoint kept was wired: CRIU's names of the ends the daemon
/// held, which a restore replaces with new ones (`--inherit-fd`), and what its owner said of it
/// (`note`, given to [`Runtime::on_attached_restored`]'s hook with the restored process).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct KeptAttached {
    pub wire: Wire,
    pub note: serde_json::Value,
}

/// The daemon's ends of an attached process, as CRIU named them in its image.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Wire {
    /// Inodes of its stdout and stderr pipes, and of its stdin pipe when its owner held one.
    Pipes { stdout: u64, stderr: u64, stdin: Option<u64> },
    /// CRIU's name of its terminal (`tty[RDEV:DEV]`), the terminal's size and owner.
    Terminal { tty: String, rows: u16, cols: u16, ids: Option<(u32, u32)> },
}

/// The attached processes of a sandbox, by pid (see [`crate::pause`]).
#[derive(Clone, Default)]
pub struct Plugs(Arc<parking_lot::Mutex<std::collections::HashMap<i32, Plug>>>);

/// Ends made for the restore of attached processes: the process ends, each with CRIU's name of
/// the end it takes the place of (`--inherit-fd`), and the ends their owners keep once restored.
pub(crate) struct NewEnds {
    pub(crate) inherit: Vec<(OwnedFd, String)>,
    keep: Vec<(i32, Kept)>,
}

pub(crate) enum Kept {
    /// Read ends of stdout and stderr, write end of stdin.
    Pipes(OwnedFd, OwnedFd, Option<OwnedFd>),
    Master(OwnedFd),
}

impl Plugs {
    /// Track attached process `pid`, wired as `plugged` says, while `reader` (which reads its
    /// output until it exits) runs.
    fn watch(&self, pid: i32, plugged: Plugged, reader: impl std::future::Future<Output = ()> + Send + 'static) {
        static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Plugged { wiring, tag, note } = plugged;
        self.0.lock().insert(pid, Plug { serial, wiring, tag, note });
        let plugs = self.clone();
        tokio::spawn(async move {
            reader.await;
            let mut map = plugs.0.lock();
            if map.get(&pid).is_some_and(|p| p.serial == serial) {
                map.remove(&pid);
            }
        });
    }

    /// Whether `pid` is an attached process.
    pub(crate) fn has(&self, pid: i32) -> bool {
        self.0.lock().contains_key(&pid)
    }

    /// For the dump of attached process `pid` (`host_pid` on the host): CRIU's name of its
    /// terminal, whose master the daemon holds (to be marked external), if it is on one: the
    /// slave of that master among its open files.
    pub(crate) fn external_tty(&self, pid: i32, host_pid: i32) -> Option<String> {
        use std::os::fd::AsFd;
        use std::os::unix::fs::MetadataExt;
        /// Major of Unix98 pty slaves (their minor is the pty's index).
        const PTS_MAJOR: u32 = 136;
        let mut map = self.0.lock();
        let Some(Plug { wiring: Wiring::Terminal { pty, tty, .. }, .. }) = map.get_mut(&pid) else { return None };
        let index = bb_sys::pty::pty_index(pty.current().get_ref().as_fd()).ok()?;
        let key = std::fs::read_dir(format!("/proc/{host_pid}/fd"))
            .ok()?
            .flatten()
            .filter_map(|e| std::fs::metadata(e.path()).ok())
            .find(|st| libc::major(st.rdev()) == PTS_MAJOR && libc::minor(st.rdev()) == index)
            .map(|st| format!("tty[{:x}:{:x}]", st.rdev(), st.dev()));
        tty.clone_from(&key);
        key
    }

    /// How attached process `pid` is wired, and its tag, once a dump read its terminal's name
    /// ([`Plugs::external_tty`]); None when it is not attached (or its terminal's name is unknown).
    pub(crate) fn kept(&self, pid: i32) -> Option<(String, KeptAttached)> {
        let map = self.0.lock();
        let plug = map.get(&pid)?;
        let wire = wire_of(&plug.wiring)?;
        Some((plug.tag.clone(), KeptAttached { wire, note: plug.note.clone() }))
    }

    /// New ends for the attached processes among `pids` of `sb` (those the daemon holds the
    /// other ends for; the others are left out); see [`ends_for`].
    pub(crate) async fn new_ends(&self, sb: &Sandbox, pids: impl IntoIterator<Item = i32>) -> Result<NewEnds> {
        let wires: Vec<(i32, Wire)> = {
            let map = self.0.lock();
            pids.into_iter().filter_map(|pid| Some((pid, wire_of(&map.get(&pid)?.wiring)?))).collect()
        };
        let mut ends = NewEnds { inherit: Vec::new(), keep: Vec::new() };
        for (pid, wire) in wires {
            let (inherit, kept) = ends_for(sb, &wire).await?;
            ends.inherit.extend(inherit);
            ends.keep.push((pid, kept));
        }
        Ok(ends)
    }

    /// The processes `ends` were made for are restored: their owners read and write the new ends
    /// from now on (a stdin its owner closed stays closed).
    pub(crate) async fn plug_in(&self, ends: NewEnds) -> Result<()> {
        drop(ends.inherit);
        for (pid, kept) in ends.keep {
            match kept {
                Kept::Pipes(out, err, stdin_w) => {
                    let (out_ino, err_ino) = (pipe_inode(&out)?, pipe_inode(&err)?);
                    let stdin_ino = stdin_w.as_ref().map(pipe_inode).transpose()?;
                    let pipes = (receiver(out)?, receiver(err)?);
                    let stdin = {
                        let mut map = self.0.lock();
                        let Some(Plug { wiring: Wiring::Pipes { stdin, stdout, stderr, to }, .. }) = map.get_mut(&pid)
                        else {
                            continue;
                        };
                        (*stdout, *stderr) = (out_ino, err_ino);
                        let _ = to.send(pipes);
                        if let (Some((ino, _)), Some(new)) = (stdin.as_mut(), stdin_ino) {
                            *ino = new;
                        }
                        stdin.as_ref().map(|(_, s)| s.clone())
                    };
                    if let (Some(stdin), Some(w)) = (stdin, stdin_w) {
                        let mut held = stdin.0.lock().await;
                        if held.is_some() {
                            *held = Some(pipe::Sender::from_owned_fd(w).map_err(RuntimeError::io("stdin pipe"))?);
                        }
                    }
                }
                Kept::Master(fd) => {
                    let fd = master(fd)?;
                    let map = self.0.lock();
                    if let Some(Plug { wiring: Wiring::Terminal { pty, to, .. }, .. }) = map.get(&pid) {
                        *pty.fd.lock() = fd.clone();
                        let _ = to.send(fd);
                    }
                }
            }
        }
        Ok(())
    }
}

/// How `wiring` looks to CRIU (None: a terminal whose name no dump has read yet).
fn wire_of(wiring: &Wiring) -> Option<Wire> {
    match wiring {
        Wiring::Pipes { stdin, stdout, stderr, .. } => {
            Some(Wire::Pipes { stdout: *stdout, stderr: *stderr, stdin: stdin.as_ref().map(|(ino, _)| *ino) })
        }
        Wiring::Terminal { pty, ids, tty: Some(tty), .. } => {
            // (A size that cannot be read is no reason to refuse the restore.)
            let (rows, cols) = pty.size().unwrap_or((24, 80));
            Some(Wire::Terminal { tty: tty.clone(), rows, cols, ids: *ids })
        }
        Wiring::Terminal { tty: None, .. } => None,
    }
}

/// New ends in `sb` for a process restored there that was wired as `wire`: the process's ends,
/// each with CRIU's name of the end it takes the place of, and the ends its owner keeps. Pipes
/// are owned by the sandbox's root (CRIU opens the process's end again through procfs in the
/// sandbox's user namespace); a terminal is a new one of the sandbox's devpts, opened by its
/// init, of the recorded size.
pub(crate) async fn ends_for(sb: &Sandbox, wire: &Wire) -> Result<(Vec<(OwnedFd, String)>, Kept)> {
    match wire {
        Wire::Pipes { stdout, stderr, stdin } => {
            let root = sb.root_id()?;
            let owned_pipe = || -> Result<(OwnedFd, OwnedFd)> {
                let (rd, wr) = pipe_pair()?;
                nix::unistd::fchown(rd.as_raw_fd(), Some(root.into()), Some(root.into()))
                    .map_err(|e| RuntimeError::io("chown a pipe")(e.into()))?;
                Ok((rd, wr))
            };
            let key = |ino: u64| format!("pipe:[{ino}]");
            let ((out_r, out_w), (err_r, err_w)) = (owned_pipe()?, owned_pipe()?);
            let mut inherit = vec![(out_w, key(*stdout)), (err_w, key(*stderr))];
            let stdin = match stdin {
                Some(ino) => {
                    let (rd, wr) = owned_pipe()?;
                    inherit.push((rd, key(*ino)));
                    Some(wr)
                }
                None => None,
            };
            Ok((inherit, Kept::Pipes(out_r, err_r, stdin)))
        }
        Wire::Terminal { tty, rows, cols, ids } => {
            let conn = InitConn::connect(&sb.dirs.sock()).await?;
            conn.send(&Request::OpenPty { rows: *rows, cols: *cols, ids: *ids }, &[])?;
            match conn.recv_fds().await? {
                (Response::Ok, fds) if fds.len() == 2 => {
                    let mut fds = fds.into_iter();
                    let (m, slave) = (fds.next().expect("two fds"), fds.next().expect("two fds"));
                    Ok((vec![(slave, tty.clone())], Kept::Master(m)))
                }
                (Response::Error { errno, message }, _) => Err(init_error(errno, message)),
                (other, _) => Err(unexpected(other)),
            }
        }
    }
}

/// An attached process a checkpoint kept, restored into `sb` under `pid` (with the ends
/// [`ends_for`] made of `kept.wire`): init takes it as its own, and the daemon holds its other
/// ends from now on, as for one [`start_attached`] started (a later pause or checkpoint keeps it
/// the same way). Init's tag: `tag`.
pub(crate) async fn adopt_attached(
    sb: &Sandbox,
    pid: i32,
    tag: String,
    kept: &KeptAttached,
    ends: Kept,
) -> Result<AttachedProcess> {
    adopt_background(sb, pid, tag.clone()).await?;
    let conn = InitConn::connect(&sb.dirs.sock()).await?;
    conn.send(&Request::Wait { pid }, &[])?;
    let note = kept.note.clone();
    match ends {
        Kept::Pipes(out, err, stdin_w) => {
            let (stdout, stderr) = (pipe_inode(&out)?, pipe_inode(&err)?);
            let stdin = match stdin_w {
                Some(w) => {
                    let ino = pipe_inode(&w)?;
                    Some((ino, Stdin::new(pipe::Sender::from_owned_fd(w).map_err(RuntimeError::io("stdin pipe"))?)))
                }
                None => None,
            };
            let (tx, events) = mpsc::channel(256);
            let (to, replug) = mpsc::unbounded_channel();
            let wiring = Wiring::Pipes { stdin: stdin.clone(), stdout, stderr, to };
            let pipes = (receiver(out)?, receiver(err)?);
            sb.plugs.watch(pid, Plugged { wiring, tag, note }, read_pipes(conn, pipes, replug, tx));
            Ok(AttachedProcess { pid, stdin: stdin.map(|(_, s)| s), pty: None, events })
        }
        Kept::Master(fd) => {
            let ids = match &kept.wire {
                Wire::Terminal { ids, .. } => *ids,
                Wire::Pipes { .. } => None,
            };
            Ok(plug_terminal(sb, pid, conn, master(fd)?, ids, tag, note))
        }
    }
}

fn read_log(path: &std::path::Path) -> (String, bool) {
    use std::io::Read;
    let Ok(f) = std::fs::File::open(path) else { return (String::new(), false) };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut buf = Vec::new();
    let _ = f.take(MAX_OUTPUT as u64).read_to_end(&mut buf);
    (String::from_utf8_lossy(&buf).into_owned(), len > MAX_OUTPUT as u64)
}

/// Wait for a background process (up to `timeout`; it keeps running after a timeout).
pub async fn wait(sb: &Sandbox, pid: i32, timeout: Option<f64>) -> Result<CommandResult> {
    let started = Instant::now();
    let conn = InitConn::connect(&sb.dirs.sock()).await?;
    conn.send(&Request::Wait { pid }, &[])?;
    let fut = conn.recv();
    let resp = match timeout {
        Some(t) if t > 0.0 => tokio::time::timeout(Duration::from_secs_f64(t), fut).await.ok(),
        _ => Some(fut.await),
    };
    let (out_p, err_p) = log_paths(sb, &pid.to_string());
    let (stdout, stdout_truncated) = read_log(&out_p);
    let (stderr, stderr_truncated) = read_log(&err_p);
    let mut result = CommandResult {
        pid,
        stdout,
        stderr,
        stdout_truncated,
        stderr_truncated,
        duration: started.elapsed().as_secs_f64(),
        ..Default::default()
    };
    match resp {
        None => result.timed_out = true,
        Some(Ok(Response::Exited { status, .. })) => {
            result.exit_code = status.code;
            result.signal = status.signal;
        }
        Some(Ok(Response::Error { errno: libc::ESRCH, .. })) => return Err(unknown_process(pid)),
        Some(Ok(Response::Error { errno, message })) => return Err(init_error(errno, message)),
        Some(Ok(other)) => return Err(unexpected(other)),
        Some(Err(e)) => return Err(e),
    }
    Ok(result)
}

/// The tag (command) init keeps for each running process it tracks, by pid.
pub(crate) async fn tags(sb: &Sandbox) -> Result<std::collections::HashMap<i32, String>> {
    match InitConn::call(&sb.dirs.sock(), &Request::List).await? {
        Response::Procs { procs } => {
            Ok(procs.into_iter().filter(|p| p.exit.is_none()).map(|p| (p.pid, p.tag)).collect())
        }
        other => Err(unexpected(other)),
    }
}

/// Register a restored process with init as a background process tagged `tag`.
pub(crate) async fn adopt_background(sb: &Sandbox, pid: i32, tag: String) -> Result<()> {
    match InitConn::call(&sb.dirs.sock(), &Request::Adopt { pid, tag, stash: None }).await? {
        Response::Ok => Ok(()),
        Response::Error { errno, message } => Err(init_error(errno, message)),
        other => Err(unexpected(other)),
    }
}

pub async fn list(sb: &Sandbox) -> Result<Vec<ProcessInfo>> {
    match InitConn::call(&sb.dirs.sock(), &Request::List).await? {
        Response::Procs { procs } => Ok(procs
            .into_iter()
            .filter(|p| !p.tag.starts_with(crate::session::SESSION_TAG))
            .map(|p| ProcessInfo {
                pid: p.pid,
                cmd: p.tag,
                running: p.exit.is_none(),
                exit_code: p.exit.and_then(|e| e.code),
                signal: p.exit.and_then(|e| e.signal),
                started_at: p.started_at,
            })
            .collect()),
        other => Err(unexpected(other)),
    }
}

/// Signal a process and its process group (every spawned process leads its own).
pub async fn kill(sb: &Sandbox, pid: i32, signal: i32) -> Result<()> {
    if pid == 1 {
        return Err(RuntimeError::BadRequest(
            "pid 1 is the sandbox's init: kill the sandbox instead (DELETE /v1/sandboxes/{id})".into(),
        ));
    }
    if !(1..=64).contains(&signal) {
        return Err(RuntimeError::BadRequest(format!("signal {signal} is not a valid signal number (1-64)")));
    }
    match InitConn::call(&sb.dirs.sock(), &Request::Kill { pid, signal, group: true }).await? {
        Response::Ok => Ok(()),
        Response::Error { errno: libc::ESRCH, .. } => {
            match InitConn::call(&sb.dirs.sock(), &Request::Kill { pid, signal, group: false }).await? {
                Response::Ok => Ok(()),
                Response::Error { errno: libc::ESRCH, .. } => Err(unknown_process(pid)),
                Response::Error { errno, message } => Err(init_error(errno, message)),
                other => Err(unexpected(other)),
            }
        }
        Response::Error { errno, message } => Err(init_error(errno, message)),
        other => Err(unexpected(other)),
    }
}

impl crate::Runtime {
    pub async fn run_command(self: &Arc<Self>, id: &str, req: RunCommand) -> Result<CommandResult> {
        let sb = self.ready(id).await?;
        let _busy = self.activity.busy();
        run(&sb, &req, None).await
    }

    /// Start a foreground command whose events arrive on the returned channel.
    pub async fn stream_command(self: &Arc<Self>, id: &str, req: RunCommand) -> Result<mpsc::Receiver<CommandEvent>> {
        let sb = self.ready(id).await?;
        resolve(&sb, &req)?; // report bad input as an HTTP error, before the stream starts
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            // A client that goes away cancels the command: dropping `run` drops its init
            // connection, and init kills the process group.
            let res = tokio::select! {
                r = run(&sb, &req, Some(tx.clone())) => r,
                _ = tx.closed() => return,
            };
            if let Err(e) = res {
                let _ = tx
                    .send(CommandEvent::Error {
                        error: crate::model::ErrorBody { code: e.code().into(), message: e.to_string() },
                    })
                    .await;
            }
        });
        Ok(rx)
    }

    pub async fn start_background(self: &Arc<Self>, id: &str, req: RunCommand) -> Result<crate::model::Started> {
        let sb = self.ready(id).await?;
        Ok(crate::model::Started { pid: start_background(&sb, &req).await? })
    }

    pub async fn list_processes(self: &Arc<Self>, id: &str) -> Result<crate::model::ProcessList> {
        let sb = self.ready(id).await?;
        Ok(crate::model::ProcessList { processes: list(&sb).await? })
    }

    pub async fn wait_process(self: &Arc<Self>, id: &str, pid: i32, timeout: Option<f64>) -> Result<CommandResult> {
        let sb = self.ready(id).await?;
        wait(&sb, pid, timeout).await
    }

    /// Start a process attached to its caller (see [`AttachedProcess`]).
    pub async fn start_attached(
        self: &Arc<Self>,
        id: &str,
        req: RunCommand,
        stdin: bool,
        pty: Option<(u16, u16)>,
        note: serde_json::Value,
    ) -> Result<AttachedProcess> {
        let sb = self.ready(id).await?;
        start_attached(&sb, &req, stdin, pty, note).await
    }

    /// Give every attached process a restore brings back (a rollback, a fork child, a sandbox
    /// made from a snapshot that kept it) to `hook`, with its sandbox's id and its note; without
    /// a hook its output is read and dropped. The last hook set wins.
    pub fn on_attached_restored(&self, hook: AttachedHook) {
        *self.attached_hook.write() = Some(hook);
    }

    /// Hand `attached`, restored into sandbox `id`, to the hook (see [`Runtime::on_attached_restored`]).
    pub(crate) fn attached_restored(&self, id: &str, note: serde_json::Value, attached: AttachedProcess) {
        let hook = self.attached_hook.read().clone();
        match hook {
            Some(hook) => hook(id, note, attached),
            None => {
                let mut events = attached.events;
                tokio::spawn(async move { while events.recv().await.is_some() {} });
            }
        }
    }

    pub async fn kill_process(self: &Arc<Self>, id: &str, pid: i32, signal: Option<i32>) -> Result<()> {
        let sb = self.ready(id).await?;
        kill(&sb, pid, signal.unwrap_or(libc::SIGKILL)).await
    }
}

pub(crate) fn timeout_of(t: Option<f64>) -> Result<Option<Duration>> {
    match t {
        None => Ok(Some(Duration::from_secs_f64(DEFAULT_TIMEOUT))),
        Some(t) if !(t >= 0.0 && t.is_finite()) => {
            Err(RuntimeError::BadRequest("timeout must be >= 0 seconds (0 = no limit)".into()))
        }
        Some(0.0) => Ok(None),
        Some(t) => Ok(Some(Duration::from_secs_f64(t))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collector(events: Option<mpsc::Sender<CommandEvent>>) -> Collector {
        Collector { buf: Vec::new(), truncated: false, carry: Vec::new(), events, is_err: false }
    }

    #[tokio::test]
    async fn streamed_chunks_never_split_a_utf8_sequence() {
        let (tx, mut rx) = mpsc::channel(16);
        let mut c = collector(Some(tx));
        let bytes = "aé€😀".as_bytes();
        // Feed one byte at a time: every event must be valid text on its own.
        for b in bytes {
            c.push(std::slice::from_ref(b)).await;
        }
        let (all, truncated) = c.finish().await;
        assert_eq!((all.as_str(), truncated), ("aé€😀", false));
        let mut streamed = String::new();
        while let Ok(ev) = rx.try_recv() {
            match ev {
                CommandEvent::Stdout { data } => {
                    assert!(!data.contains('\u{FFFD}'), "an event split a character: {data:?}");
                    streamed.push_str(&data);
                }
                other => panic!("unexpected event {other:?}"),
            }
        }
        assert_eq!(streamed, "aé€😀");
    }

    #[tokio::test]
    async fn output_beyond_the_cap_is_dropped_and_flagged() {
        let mut c = collector(None);
        c.push(&vec![b'x'; MAX_OUTPUT - 1]).await;
        c.push(b"yz").await;
        let (all, truncated) = c.finish().await;
        assert!(truncated);
        assert_eq!(all.len(), MAX_OUTPUT);
        assert!(all.ends_with('y'));
    }

    /// A listening init socket at a temporary path, a connection to it, and init's end.
    async fn fake_init() -> (tempfile::TempDir, InitConn, OwnedFd) {
        use nix::sys::socket::{accept, bind, listen, socket, AddressFamily, Backlog, SockFlag, SockType, UnixAddr};
        use std::os::fd::FromRawFd;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("init.sock");
        let listener = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).unwrap();
        bind(listener.as_raw_fd(), &UnixAddr::new(&path).unwrap()).unwrap();
        listen(&listener, Backlog::new(4).unwrap()).unwrap();
        let conn = InitConn::connect(&path).await.unwrap();
        // SAFETY: accept returned a fresh fd that nothing else owns.
        let init = unsafe { OwnedFd::from_raw_fd(accept(listener.as_raw_fd()).unwrap()) };
        (dir, conn, init)
    }

    async fn next(events: &mut mpsc::Receiver<Attached>) -> Attached {
        tokio::time::timeout(Duration::from_secs(10), events.recv()).await.expect("an event in time").expect("open")
    }

    /// [`read_pipes`] started on `conn` and new pipes: its task, the pipes' write ends (stdout,
    /// stderr), where new pipes go, and its events.
    #[allow(clippy::type_complexity)]
    fn start_reading(
        conn: InitConn,
    ) -> (
        tokio::task::JoinHandle<()>,
        (OwnedFd, OwnedFd),
        mpsc::UnboundedSender<(pipe::Receiver, pipe::Receiver)>,
        mpsc::Receiver<Attached>,
    ) {
        let (out_r, out_w) = pipe_pair().unwrap();
        let (err_r, err_w) = pipe_pair().unwrap();
        let (replug_tx, replug) = mpsc::unbounded_channel();
        let (tx, events) = mpsc::channel(16);
        let task = tokio::spawn(read_pipes(conn, (receiver(out_r).unwrap(), receiver(err_r).unwrap()), replug, tx));
        (task, (out_w, err_w), replug_tx, events)
    }

    #[tokio::test]
    async fn an_attached_process_is_read_from_new_pipes_after_a_pause_until_it_exits() {
        let (_dir, conn, init) = fake_init().await;
        let (task, (out_w, err_w), replug_tx, mut events) = start_reading(conn);
        nix::unistd::write(&out_w, b"before").unwrap();
        assert!(matches!(next(&mut events).await, Attached::Stdout(b) if &b[..] == b"before"));
        // The pause: the process is killed (its pipe ends close); init holds its exit.
        drop((out_w, err_w));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!task.is_finished(), "the reader waits for the resume or the exit");
        // The resume: new pipes.
        let (out_r, out_w) = pipe_pair().unwrap();
        let (err_r, err_w) = pipe_pair().unwrap();
        replug_tx.send((receiver(out_r).unwrap(), receiver(err_r).unwrap())).unwrap();
        nix::unistd::write(&err_w, b"after").unwrap();
        assert!(matches!(next(&mut events).await, Attached::Stderr(b) if &b[..] == b"after"));
        // Its exit, with output still in the pipe: read first, then the exit.
        nix::unistd::write(&out_w, b"last").unwrap();
        let status = ExitStatus { code: Some(3), signal: None };
        bb_proto::send(init.as_raw_fd(), &Response::Exited { pid: 7, status }, &[]).unwrap();
        drop((out_w, err_w));
        assert!(matches!(next(&mut events).await, Attached::Stdout(b) if &b[..] == b"last"));
        assert!(matches!(next(&mut events).await, Attached::Exit(s) if s.code == Some(3)));
        tokio::time::timeout(Duration::from_secs(10), task).await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn an_attached_process_whose_sandbox_goes_away_while_paused_ends_without_an_exit() {
        let (_dir, conn, init) = fake_init().await;
        let (task, (out_w, err_w), _replug_tx, mut events) = start_reading(conn);
        drop((out_w, err_w, init));
        tokio::time::timeout(Duration::from_secs(10), task).await.unwrap().unwrap();
        assert!(events.recv().await.is_none());
    }
}
