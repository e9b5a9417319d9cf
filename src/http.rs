//! The HTTP side (axum): `/metrics` (Prometheus text format), `/healthz` (the process is up),
//! `/readyz` (the cache directory is usable and every dataset's store answers: checked for
//! real, at most every few seconds) and `/status` (JSON: the datasets, the cache, every open
//! stream; `shardd status` prints it as a table).

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::status::Board;

#[derive(Clone)]
struct Shared {
    metrics: Arc<Metrics>,
    board: Arc<Board>,
    started: Instant,
}

pub fn router(metrics: Arc<Metrics>, board: Arc<Board>) -> Router {
    Router::new()
        .route("/metrics", get(render))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/status", get(status))
        .with_state(Shared {
            metrics,
            board,
            started: Instant::now(),
        })
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
