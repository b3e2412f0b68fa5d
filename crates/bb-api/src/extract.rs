//! Extractors whose rejections are API errors in our JSON format.

use crate::error::ApiError;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

/// A JSON body; an empty body means `{}` (every request type has defaults).
pub struct JsonBody<T>(pub T);

#[axum::async_trait]
impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = bytes::Bytes::from_request(req, state).await.map_err(|rej| {
            if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    "request body is larger than 16 MiB: send large data as a file upload (PUT /files)",
                )
            } else {
                ApiError::bad_request(format!("cannot read request body: {}", rej.body_text()))
            }
        })?;
        let text: &[u8] = if bytes.iter().all(|b| b.is_ascii_whitespace()) { b"{}" } else { &bytes };
        let mut de = serde_json::Deserializer::from_slice(text);
        serde_path_to_error::deserialize(&mut de).map(JsonBody).map_err(|e| {
            let field = e.path().to_string();
            if field.is_empty() || field == "." {
                ApiError::bad_request(format!("invalid JSON body: {}", e.inner()))
            } else {
                ApiError::bad_request(format!("invalid JSON body: field `{field}`: {}", e.inner()))
            }
        })
    }
}

/// Query parameters.
pub struct Q<T>(pub T);

#[axum::async_trait]
impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Q<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Q(q.0))
            .map_err(|e| ApiError::bad_request(format!("invalid query parameters: {}", e.body_text())))
    }
}

/// Path parameters.
pub struct P<T>(pub T);

#[axum::async_trait]
impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for P<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| P(p.0))
            .map_err(|e| ApiError::bad_request(format!("invalid path: {}", e.body_text())))
    }
}
