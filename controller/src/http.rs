//! The operations endpoints: `/metrics`, `/healthz` and `/readyz`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use thiserror::Error;
use tokio::net::TcpListener;

use crate::metrics::{CONTENT_TYPE, Metrics};

/// Whether the watch caches have synced; `/readyz` answers from it.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    /// Marks the caches synced.
    pub fn set_ready(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether the caches have synced.
    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Why the endpoints could not be served.
#[derive(Debug, Error)]
pub enum HttpError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("serving the metrics endpoints failed: {0}")]
    Serve(#[source] std::io::Error),
}

#[derive(Clone)]
struct Endpoints {
    metrics: Arc<Metrics>,
    readiness: Readiness,
}

/// The router of the three endpoints.
pub fn router(metrics: Arc<Metrics>, readiness: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(serve_metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(serve_readiness))
        .with_state(Endpoints { metrics, readiness })
}

/// Binds `addr`; returns the listener so callers learn the port before serving.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, HttpError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| HttpError::Bind { addr, source })
}

/// Serves `router` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), HttpError> {
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(HttpError::Serve)
}

async fn serve_metrics(State(endpoints): State<Endpoints>) -> Response {
    match endpoints.metrics.encode() {
        Ok(text) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics failed: {error}\n"),
        )
            .into_response(),
    }
}

async fn serve_readiness(State(endpoints): State<Endpoints>) -> Response {
    if endpoints.readiness.is_ready() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "watch caches not synced yet\n",
        )
            .into_response()
    }
}
