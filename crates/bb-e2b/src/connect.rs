//! The Connect protocol as envd's clients speak it, JSON codec only: unary calls are a plain
//! JSON body answered with JSON (errors: an HTTP status and `{"code": "not_found", "message"}`);
//! streaming calls frame each message in an envelope (1 flag byte, 4 length bytes, big endian),
//! the server's last envelope (flag 0x02) carrying `{}` or `{"error": {...}}` with HTTP 200.

use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;

/// Flag of the envelope that ends a server stream.
const END_STREAM: u8 = 0x02;
/// Flag of a compressed envelope (we never agree to compression).
const COMPRESSED: u8 = 0x01;
/// Largest message we take from a client.
pub const MAX_MESSAGE: usize = 16 << 20;

/// A Connect error code (the wire names of <https://connectrpc.com/docs/protocol#error-codes>).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    InvalidArgument,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn name(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status a unary error goes with.
    pub fn status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).expect("valid status"),
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// An RPC's failure, answered in the Connect shape of its call kind.
#[derive(Debug, Clone)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        RpcError { code, message: message.into() }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.name(), "message": self.message})
    }

    /// The error as a unary answer.
    pub fn unary(&self) -> Response {
        (self.code.status(), axum::Json(self.json())).into_response()
    }

    /// The error as a whole streaming answer (HTTP 200, one end-of-stream envelope).
    pub fn stream(&self) -> Response {
        stream_response(Body::from(end_stream(Some(self))))
    }
}

impl From<bb_runtime::RuntimeError> for RpcError {
    fn from(e: bb_runtime::RuntimeError) -> Self {
        use bb_runtime::error::ErrorKind;
        let code = match e.kind() {
            ErrorKind::NotFound => Code::NotFound,
            ErrorKind::BadRequest | ErrorKind::PathEscape => Code::InvalidArgument,
            ErrorKind::Conflict => Code::FailedPrecondition,
            ErrorKind::TooLarge => Code::ResourceExhausted,
            ErrorKind::Unavailable => Code::Unavailable,
            ErrorKind::Corrupt | ErrorKind::Internal => Code::Internal,
        };
        RpcError::new(code, e.to_string())
    }
}

/// One envelope holding `msg`.
pub fn envelope(flags: u8, msg: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + msg.len());
    b.put_u8(flags);
    b.put_u32(msg.len() as u32);
    b.put_slice(msg);
    b.freeze()
}

/// A message envelope of a server stream.
pub fn message(value: &serde_json::Value) -> Bytes {
    envelope(0, &serde_json::to_vec(value).expect("JSON values serialize"))
}

/// The envelope that ends a server stream, with its error if it failed.
pub fn end_stream(err: Option<&RpcError>) -> Bytes {
    let body = match err {
        Some(e) => serde_json::json!({"error": e.json()}),
        None => serde_json::json!({}),
    };
    envelope(END_STREAM, &serde_json::to_vec(&body).expect("JSON values serialize"))
}

pub fn stream_response(body: Body) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/connect+json")
        .body(body)
        .expect("valid response")
}

pub fn unary_response(value: &serde_json::Value) -> Response {
    axum::Json(value).into_response()
}

/// Split a client's streamed body into its messages, each parsed as `T`.
pub fn split_envelopes<T: DeserializeOwned>(mut body: &[u8]) -> Result<Vec<T>, RpcError> {
    let mut out = Vec::new();
    while !body.is_empty() {
        if body.len() < 5 {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("malformed Connect envelope: {} trailing bytes are shorter than its 5-byte header", body.len()),
            ));
        }
        let flags = body[0];
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        if len > MAX_MESSAGE {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("message of {len} bytes is larger than {MAX_MESSAGE}: send less at once"),
            ));
        }
        if flags & COMPRESSED != 0 {
            return Err(RpcError::new(
                Code::Unimplemented,
                "compressed messages are not accepted: send them uncompressed",
            ));
        }
        let rest = &body[5..];
        if rest.len() < len {
            return Err(RpcError::new(
                Code::InvalidArgument,
                format!("malformed Connect envelope: it announces {len} bytes but {} follow", rest.len()),
            ));
        }
        if flags & END_STREAM == 0 {
            out.push(parse(&rest[..len])?);
        }
        body = &rest[len..];
    }
    Ok(out)
}

/// The single message of a server-streaming request.
pub fn single_envelope<T: DeserializeOwned>(body: &[u8]) -> Result<T, RpcError> {
    let mut all = split_envelopes::<T>(body)?;
    match all.len() {
        1 => Ok(all.remove(0)),
        n => Err(RpcError::new(Code::InvalidArgument, format!("expected one request message, got {n}"))),
    }
}

/// A message's JSON, parsed as `T`.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, RpcError> {
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { bytes };
    serde_json::from_slice(text)
        .map_err(|e| RpcError::new(Code::InvalidArgument, format!("invalid request message: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct M {
        a: u32,
    }

    #[test]
    fn envelopes_round_trip_and_bad_ones_are_refused() {
        let mut body = message(&serde_json::json!({"a": 1})).to_vec();
        body.extend_from_slice(&message(&serde_json::json!({"a": 2})));
        body.extend_from_slice(&end_stream(None));
        assert_eq!(split_envelopes::<M>(&body).unwrap(), vec![M { a: 1 }, M { a: 2 }]);
        assert_eq!(single_envelope::<M>(&message(&serde_json::json!({"a": 7}))).unwrap(), M { a: 7 });
        assert!(single_envelope::<M>(&body).is_err());
        // Truncated header, truncated message, compressed, oversized, not JSON.
        assert_eq!(split_envelopes::<M>(&[0, 0, 0]).unwrap_err().code, Code::InvalidArgument);
        assert_eq!(split_envelopes::<M>(&[0, 0, 0, 0, 9, b'{']).unwrap_err().code, Code::InvalidArgument);
        assert_eq!(split_envelopes::<M>(&envelope(COMPRESSED, b"{}")).unwrap_err().code, Code::Unimplemented);
        assert_eq!(split_envelopes::<M>(&[0, 0xff, 0xff, 0xff, 0xff]).unwrap_err().code, Code::ResourceExhausted);
        assert_eq!(split_envelopes::<M>(&envelope(0, b"nope")).unwrap_err().code, Code::InvalidArgument);
        let end = end_stream(Some(&RpcError::new(Code::NotFound, "gone")));
        assert_eq!(end[0], END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&end[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
    }
}
