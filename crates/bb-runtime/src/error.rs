use thiserror::Error;

/// Every way a runtime action can fail. The API maps each variant to an HTTP status and a stable
/// error code ([`RuntimeError::code`]); messages say what the caller should change.
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
    #[error("{0}")]
    Internal(String),
}

impl RuntimeError {
    pub fn code(&self) -> &'static str {
        match self {
            RuntimeError::NotFound { .. } => "not_found",
            RuntimeError::BadRequest(_) => "bad_request",
            RuntimeError::PathEscape(_) => "path_escape",
            RuntimeError::Conflict(_) => "conflict",
            RuntimeError::TooLarge(_) => "payload_too_large",
            RuntimeError::Unavailable(_) => "unavailable",
            RuntimeError::Internal(_) => "internal",
        }
    }

    pub fn sandbox(id: &str) -> Self {
        RuntimeError::NotFound { kind: "sandbox", id: id.into(), hint: ": list sandboxes with `branchbox sandbox ls`" }
    }

    pub fn internal(what: &str, e: impl std::fmt::Display) -> Self {
        RuntimeError::Internal(format!("{what}: {e}"))
    }
}

impl From<bb_isolation::IsolationError> for RuntimeError {
    fn from(e: bb_isolation::IsolationError) -> Self {
        RuntimeError::Internal(format!("isolation: {e}"))
    }
}

impl From<bb_sys::SysError> for RuntimeError {
    fn from(e: bb_sys::SysError) -> Self {
        RuntimeError::Internal(e.to_string())
    }
}

impl From<bb_proto::ProtoError> for RuntimeError {
    fn from(e: bb_proto::ProtoError) -> Self {
        RuntimeError::Unavailable(format!("sandbox init did not answer: {e}"))
    }
}

impl From<rusqlite::Error> for RuntimeError {
    fn from(e: rusqlite::Error) -> Self {
        RuntimeError::Internal(format!("state database: {e}"))
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
