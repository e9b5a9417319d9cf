//! The HTTP side (axum): `/metrics` (Prometheus text format), `/healthz` (the process is up),
//! `/readyz` (every store can get its credentials, the cache directory is usable and every
//! dataset's store answers: checked for real, at most every few seconds) and `/status` (JSON: the datasets, the cache, every open
//! stream; `shardd status` prints it as a table).
//!
//! Every request is bounded (tower middleware): at most [`MAX_REQUESTS`] handled at once
//! (more wait their turn), and [`REQUEST_TIMEOUT`] each (then 503), so a stuck scraper or a
//! flood of probes cannot hold the daemon's resources.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::error_handling::HandleErrorLayer;
use tower::ServiceBuilder;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::ops::metrics::Metrics;
use crate::serve::status::Board;

/// Requests handled at once.
pub const MAX_REQUESTS: usize = 32;
/// Longest time a request may take (a readiness check asks the stores: at most 5 s each).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Clone)]
struct Shared {
    metrics: Arc<Metrics>,
    board: Arc<Board>,
    started: Instant,
}

pub fn router(metrics: Arc<Metrics>, board: Arc<Board>) -> Router {
    let router = Router::new()
        .route("/metrics", get(render))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/status", get(status))
        .with_state(Shared {
            metrics,
            board,
            started: Instant::now(),
        });
    bounded(router, REQUEST_TIMEOUT, MAX_REQUESTS)
}

/// Bounds every request of `router` in time and in number.
fn bounded(router: Router, timeout: Duration, at_once: usize) -> Router {
    router.layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(|e: tower::BoxError| async move {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("request not served: {e}\n"),
                )
            }))
            .timeout(timeout)
            .concurrency_limit(at_once),
    )
}

async fn render(State(s): State<Shared>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

async fn ready(State(s): State<Shared>) -> impl IntoResponse {
    match s.board.ready().await {
        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}

async fn status(State(s): State<Shared>) -> impl IntoResponse {
    let body = serde_json::to_string_pretty(&s.board.status(s.started.elapsed()))
        .expect("status serializes");
    ([(header::CONTENT_TYPE, "application/json")], body)
}

pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    board: Arc<Board>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics, board))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::ServiceExt;

    #[tokio::test]
    async fn a_request_that_takes_too_long_is_answered_503() {
        let slow = Router::new().route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                "late"
            }),
        );
        let app = bounded(slow, Duration::from_millis(50), 4);
        let request = axum::http::Request::get("/slow")
            .body(axum::body::Body::empty())
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let body = axum::body::to_bytes(response.into_body(), 1024)
            .await
            .unwrap();
        assert_eq!(&body[..], b"request not served: request timed out\n");
    }
}
