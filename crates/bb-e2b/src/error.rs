//! Control-plane errors: an HTTP status with E2B's body, `{"code": <status>, "message": "..."}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bb_runtime::error::ErrorKind;
use bb_runtime::RuntimeError;

#[derive(Debug, thiserror::Error)]
pub enum E2bError {
    #[error("{1}")]
    Status(StatusCode, String),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

impl E2bError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        E2bError::Status(StatusCode::BAD_REQUEST, message.into())
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        E2bError::Status(StatusCode::NOT_FOUND, message.into())
    }

    pub fn status(&self) -> StatusCode {
        match self {
            E2bError::Status(s, _) => *s,
            E2bError::Runtime(e) => match e.kind() {
                ErrorKind::NotFound => StatusCode::NOT_FOUND,
                ErrorKind::BadRequest | ErrorKind::PathEscape => StatusCode::BAD_REQUEST,
                ErrorKind::Conflict => StatusCode::CONFLICT,
                ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
                ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
                ErrorKind::Corrupt | ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            },
        }
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("e2b endpoint: internal error: {self}");
        }
        let body = serde_json::json!({"code": status.as_u16(), "message": self.to_string()});
        (status, axum::Json(body)).into_response()
    }
}

pub type E2bResult<T> = Result<T, E2bError>;
