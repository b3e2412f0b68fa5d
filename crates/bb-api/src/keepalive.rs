//! `Connection: close` on answers given before the request's body was read to its end.
//!
//! A handler may answer before reading the body (a path that escapes the sandbox, an unknown
//! sandbox, a wrong token). hyper then drains the body if it has already arrived and otherwise
//! closes the connection, but it may already have written the answer without saying so: the
//! client keeps the connection for its next request and that request is lost to the close (a
//! broken pipe, a reset). Saying `Connection: close` makes hyper close after the answer and the
//! client open a new connection for the next request.

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

/// Middleware: answers to requests whose body was not read to its end say `Connection: close`.
pub async fn close_if_body_unread(req: Request, next: Next) -> Response {
    if req.body().is_end_stream() {
        return next.run(req).await;
    }
    let read = Arc::new(AtomicBool::new(false));
    let req = req.map(|body| Body::new(TrackEnd { inner: body, read: read.clone() }));
    let mut resp = next.run(req).await;
    if !read.load(Ordering::Acquire) {
        resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// A body that records when it has been read to its end.
struct TrackEnd {
    inner: Body,
    read: Arc<AtomicBool>,
}

impl HttpBody for TrackEnd {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.read.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::put;
    use axum::Router;
    use tower::ServiceExt;

    async fn answer(uri: &str, body: Body) -> Response {
        let app = Router::new()
            .route("/refuse", put(|| async { "refused" }))
            .route("/read", put(|body: Bytes| async move { format!("{} bytes", body.len()) }))
            .layer(axum::middleware::from_fn(close_if_body_unread));
        app.oneshot(axum::http::Request::put(uri).body(body).unwrap()).await.unwrap()
    }

    fn connection(resp: &Response) -> Option<&str> {
        resp.headers().get(header::CONNECTION).map(|v| v.to_str().unwrap())
    }

    #[tokio::test]
    async fn answer_before_the_body_is_read_closes_the_connection() {
        let streamed = Body::from_stream(futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from("pwned"))]));
        assert_eq!(connection(&answer("/refuse", streamed).await), Some("close"));
        assert_eq!(connection(&answer("/refuse", Body::from("pwned")).await), Some("close"));
    }

    #[tokio::test]
    async fn body_read_to_its_end_or_no_body_keeps_the_connection() {
        let streamed = Body::from_stream(futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from("data"))]));
        assert_eq!(connection(&answer("/read", streamed).await), None);
        assert_eq!(connection(&answer("/read", Body::from("data")).await), None);
        assert_eq!(connection(&answer("/refuse", Body::empty()).await), None);
    }
}
