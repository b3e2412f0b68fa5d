//! The runtime's error: the caller's mistakes and the states that refuse a request, in words that
//! say what to change; and each mechanism's own failure, kept typed (with its cause as `source`)
//! so the API's message and the daemon's log keep what went wrong underneath.
//!
//! ```text
//! RuntimeError
//! ├── NotFound / BadRequest / PathEscape / Conflict / TooLarge / Unavailable   (the caller's side)
//! ├── StateDir(statedir::StateDirError)        Db(db::DbError)
//! ├── Launch(sandbox::launch::LaunchError)     Init(initconn::InitError)
//! ├── Session(session::SessionError)           SessionFork(session::fork::SessionForkError)
//! ├── RootSwap(sandbox::rootswap::RootSwapError)   Snapshot(snapshot::SnapshotError)
//! ├── Pool(pool::PoolError)                    Files(sandbox::files::FilesError)
//! ├── Image(process_images::ImageError)       Remote(remote::RemoteError)
//! ├── Survivors(sandbox::procs::SurvivorsError)  Layers(bb_layers::LayersError)
//! ├── Net(net::NetError)
//! ├── Isolation(bb_isolation::IsolationError)  Sys(bb_sys::SysError)
//! └── Io { what, source }                      Worker(tokio::task::JoinError)
//! ```

use thiserror::Error;

/// How the API reports an error ([`RuntimeError::kind`]): one HTTP status and code per kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    NotFound,
    BadRequest,
    PathEscape,
    Conflict,
    TooLarge,
    Unavailable,
    /// Data read back from the object store failed authentication (changed, cut short, or
    /// sealed with another key): never served.
    Corrupt,
    Internal,
}

impl ErrorKind {
    /// The stable error code of the API's error body.
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::PathEscape => "path_escape",
            ErrorKind::Conflict => "conflict",
            ErrorKind::TooLarge => "payload_too_large",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Internal => "internal",
        }
    }
}

/// Every way a runtime action can fail.
#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error("{kind} {id:?} not found{hint}")]
    NotFound { kind: &'static str, id: String, hint: &'static str },
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    PathEscape(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    StateDir(#[from] crate::statedir::StateDirError),
    #[error(transparent)]
    Db(#[from] crate::db::DbError),
    #[error(transparent)]
    Launch(#[from] crate::sandbox::launch::LaunchError),
    #[error(transparent)]
    Init(#[from] crate::initconn::InitError),
    #[error(transparent)]
    Session(#[from] crate::session::SessionError),
    #[error(transparent)]
    SessionFork(#[from] crate::session::fork::SessionForkError),
    #[error(transparent)]
    RootSwap(#[from] crate::sandbox::rootswap::RootSwapError),
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error(transparent)]
    Pool(#[from] crate::pool::PoolError),
    #[error(transparent)]
    Files(#[from] crate::sandbox::files::FilesError),
    #[error(transparent)]
    Image(#[from] crate::process_images::ImageError),
    #[error(transparent)]
    Survivors(#[from] crate::sandbox::procs::SurvivorsError),
    #[error(transparent)]
    Remote(#[from] crate::remote::RemoteError),
    #[error(transparent)]
    Net(#[from] crate::net::NetError),
    #[error(transparent)]
    VolumeFs(#[from] crate::volumes::volfs::VolumeFsError),
    /// Failures of the layer store itself; bad input to it is a `BadRequest` or `NotFound`.
    #[error("layers: {0}")]
    Layers(bb_layers::LayersError),
    #[error("isolation: {0}")]
    Isolation(#[from] bb_isolation::IsolationError),
    #[error(transparent)]
    Sys(#[from] bb_sys::SysError),
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("a worker task failed: {0}")]
    Worker(#[from] tokio::task::JoinError),
}

impl RuntimeError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            RuntimeError::NotFound { .. } => ErrorKind::NotFound,
            RuntimeError::BadRequest(_) => ErrorKind::BadRequest,
            RuntimeError::PathEscape(_) => ErrorKind::PathEscape,
            RuntimeError::Conflict(_) => ErrorKind::Conflict,
            RuntimeError::TooLarge(_) => ErrorKind::TooLarge,
            RuntimeError::Unavailable(_) => ErrorKind::Unavailable,
            RuntimeError::Init(e) => e.kind(),
            RuntimeError::Net(e) => e.kind(),
            RuntimeError::Remote(e) if e.unavailable() => ErrorKind::Unavailable,
            RuntimeError::Remote(e) if e.corrupt() => ErrorKind::Corrupt,
            _ => ErrorKind::Internal,
        }
    }

    pub fn code(&self) -> &'static str {
        self.kind().code()
    }

    pub fn sandbox(id: &str) -> Self {
        RuntimeError::NotFound { kind: "sandbox", id: id.into(), hint: ": list sandboxes with `branchbox sandbox ls`" }
    }

    /// An I/O failure of `what` (a step the runtime took, e.g. "create root mount point").
    pub fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> RuntimeError {
        move |source| RuntimeError::Io { what, source }
    }
}

impl From<bb_layers::LayersError> for RuntimeError {
    /// The caller's mistakes (a bad name, an unknown image, an image that cannot be used) keep
    /// their message as a `BadRequest` or `NotFound`; the rest stays a layer-store failure.
    fn from(e: bb_layers::LayersError) -> Self {
        use bb_layers::LayersError as L;
        match e {
            L::NotFound { name } => {
                RuntimeError::NotFound { kind: "image", id: name, hint: ": list images with `branchbox image ls`" }
            }
            e @ (L::InvalidName { .. }
            | L::InvalidOption { .. }
            | L::UnsupportedSource { .. }
            | L::BadImage { .. }
            | L::UnsafeEntry { .. }
            | L::IdOutOfRange { .. }
            | L::DigestMismatch { .. }
            | L::NoMatchingPlatform { .. }) => RuntimeError::BadRequest(e.to_string()),
            e => RuntimeError::Layers(e),
        }
    }
}

impl From<bb_proto::ProtoError> for RuntimeError {
    fn from(e: bb_proto::ProtoError) -> Self {
        RuntimeError::Init(crate::initconn::InitError::Proto(e))
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mechanism_error_keeps_its_cause() {
        let e: RuntimeError = std::fs::read("/nonexistent/x").map_err(RuntimeError::io("read a layer")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Internal);
        assert!(e.to_string().starts_with("read a layer: "), "{e}");
        let source = std::error::Error::source(&e).expect("the io error is the source");
        assert_eq!(source.downcast_ref::<std::io::Error>().map(|e| e.kind()), Some(std::io::ErrorKind::NotFound));
    }

    #[test]
    fn bad_layer_input_is_the_callers_mistake() {
        let e: RuntimeError = bb_layers::LayersError::NotFound { name: "nope".into() }.into();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert!(e.to_string().contains("branchbox image ls"), "{e}");
    }
}
