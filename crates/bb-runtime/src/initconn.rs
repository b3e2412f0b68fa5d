//! Client side of the init protocol (see `bb_proto`): one connection per request to a
//! sandbox's `branchbox-init`, async or blocking.

use crate::error::{ErrorKind, Result, RuntimeError};
use bb_proto::{ProtoError, Request, Response};
use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use tokio::io::unix::AsyncFd;

/// Talking to a sandbox's init failed.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// The socket could not be made or polled (the daemon's side).
    #[error("init socket: {0}")]
    Socket(#[from] nix::Error),
    #[error("init socket: {0}")]
    Poll(#[from] std::io::Error),
    /// The exchange broke: init is gone or stuck.
    #[error("sandbox init did not answer: {0}")]
    Proto(#[from] ProtoError),
    /// An answer that does not fit the request: a protocol bug, never the caller's mistake.
    #[error("unexpected init answer {0}")]
    Unexpected(String),
    /// Init could not do what it was asked for a reason of its own.
    #[error("sandbox init: {0}")]
    Failed(String),
}

impl InitError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            InitError::Proto(_) => ErrorKind::Unavailable,
            _ => ErrorKind::Internal,
        }
    }
}

/// One connection to a sandbox's init: one request, then its responses.
pub struct InitConn {
    fd: AsyncFd<OwnedFd>,
}

impl InitConn {
    pub async fn connect(sock: &Path) -> Result<InitConn> {
        let fd =
            socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None)
                .map_err(InitError::Socket)?;
        let addr = UnixAddr::new(sock).map_err(InitError::Socket)?;
        let mut tries = 0;
        loop {
            match connect(fd.as_raw_fd(), &addr) {
                Ok(()) => break,
                // Backlog full: init is busy; back off briefly.
                Err(nix::Error::EAGAIN) if tries < 200 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
                Err(e) => {
                    return Err(RuntimeError::Unavailable(format!(
                        "cannot reach the sandbox's init ({e}): the sandbox has probably died; kill it and create a new one"
                    )))
                }
            }
        }
        // SAFETY: `fd` is an open socket we own and hand over to the AsyncFd, which keeps it open
        // for its whole lifetime.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|e| InitError::Poll(e.into_parts().1))?;
        Ok(InitConn { fd })
    }

    pub fn send(&self, req: &Request, fds: &[RawFd]) -> Result<()> {
        // A fresh connection's send buffer is empty, so a non-blocking send of one message succeeds.
        bb_proto::send(self.fd.get_ref().as_raw_fd(), req, fds).map_err(InitError::Proto)?;
        Ok(())
    }

    pub async fn recv(&self) -> Result<Response> {
        Ok(self.recv_fds().await?.0)
    }

    /// Read one response and the fds attached to it.
    pub async fn recv_fds(&self) -> Result<(Response, Vec<OwnedFd>)> {
        loop {
            let mut guard = self.fd.readable().await.map_err(InitError::Poll)?;
            match bb_proto::recv::<Response>(self.fd.get_ref().as_raw_fd()) {
                Ok(x) => return Ok(x),
                Err(ProtoError::Io(nix::Error::EAGAIN)) => guard.clear_ready(),
                Err(e) => return Err(InitError::Proto(e).into()),
            }
        }
    }

    /// Send one request and read one response.
    pub async fn call(sock: &Path, req: &Request) -> Result<Response> {
        let conn = InitConn::connect(sock).await?;
        conn.send(req, &[])?;
        conn.recv().await
    }
}

/// Blocking one-shot exchange with an init (for callers on blocking threads): connect, send
/// `req` with `fds`, read one answer and the fds attached to it, within `timeout`.
pub fn call_blocking(
    sock: &Path,
    req: &Request,
    fds: &[RawFd],
    timeout: std::time::Duration,
) -> Result<(Response, Vec<OwnedFd>)> {
    let fd =
        socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).map_err(InitError::Socket)?;
    let addr = UnixAddr::new(sock).map_err(InitError::Socket)?;
    connect(fd.as_raw_fd(), &addr).map_err(|e| {
        RuntimeError::Unavailable(format!("cannot reach the sandbox's init ({e}): the sandbox has probably died"))
    })?;
    let tv = nix::sys::time::TimeVal::new(timeout.as_secs() as i64, timeout.subsec_micros() as i64);
    let _ = nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::ReceiveTimeout, &tv);
    bb_proto::send(fd.as_raw_fd(), req, fds).map_err(InitError::Proto)?;
    match bb_proto::recv::<Response>(fd.as_raw_fd()) {
        Ok(x) => Ok(x),
        Err(ProtoError::Io(nix::Error::EAGAIN)) => {
            Err(RuntimeError::Unavailable(format!("the sandbox's init did not answer within {timeout:?}")))
        }
        Err(e) => Err(InitError::Proto(e).into()),
    }
}

/// An init answer that does not fit the request (a protocol bug, never user error).
pub fn unexpected(resp: Response) -> RuntimeError {
    InitError::Unexpected(format!("{resp:?}")).into()
}

/// Turn an init `Error` response into a runtime error.
pub fn init_error(errno: i32, message: String) -> RuntimeError {
    match errno {
        libc::ENOENT | libc::EACCES | libc::ENOTDIR | libc::EINVAL | libc::ENOEXEC | libc::E2BIG => {
            RuntimeError::BadRequest(message)
        }
        libc::ESRCH => RuntimeError::NotFound { kind: "process", id: message, hint: "" },
        libc::EAGAIN | libc::ENOMEM => RuntimeError::Conflict(format!(
            "{message}: the sandbox is at its process or memory limit; wait for processes to exit, \
             or create the sandbox with larger `pids` / `memory_mb`"
        )),
        _ => InitError::Failed(message).into(),
    }
}
