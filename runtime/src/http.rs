//! The operations endpoints: `/metrics`, `/healthz` and `/readyz`, for the
//! controller and (through [`Exposition`] and [`ReadinessCheck`]) the node
//! agent alike.

use std::borrow::Cow;
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

/// The content type `/metrics` answers with.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What `/metrics` serves: a registry in the OpenMetrics text format.
pub trait Exposition: Send + Sync + 'static {
    fn encode_text(&self) -> Result<String, std::fmt::Error>;
}

/// What `/readyz` answers from.
pub trait ReadinessCheck: Clone + Send + Sync + 'static {
    /// `None` when ready; else what is missing, in words.
    fn not_ready_because(&self) -> Option<Cow<'static, str>>;
}

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

impl ReadinessCheck for Readiness {
    fn not_ready_because(&self) -> Option<Cow<'static, str>> {
        (!self.is_ready()).then_some(Cow::Borrowed("watch caches not synced yet"))
    }
}

/// Why the endpoints could not be served.
#[derive(Debug, Error)]
pub enum HttpError {
    #[error("cannot listen on {addr} for the metrics endpoints: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("serving the metrics endpoints failed: {0}")]
    Serve(#[source] std::io::Error),
}

struct Endpoints<M, R> {
    metrics: Arc<M>,
    readiness: R,
}

impl<M, R: Clone> Clone for Endpoints<M, R> {
    fn clone(&self) -> Self {
        Self {
            metrics: self.metrics.clone(),
            readiness: self.readiness.clone(),
        }
    }
}

/// The router of the three endpoints.
pub fn router<M: Exposition, R: ReadinessCheck>(metrics: Arc<M>, readiness: R) -> Router {
    Router::new()
        .route("/metrics", get(serve_metrics::<M, R>))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(serve_readiness::<M, R>))
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

async fn serve_metrics<M: Exposition, R>(State(endpoints): State<Endpoints<M, R>>) -> Response {
    match endpoints.metrics.encode_text() {
        Ok(text) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics failed: {error}\n"),
        )
            .into_response(),
    }
}

async fn serve_readiness<M, R: ReadinessCheck>(
    State(endpoints): State<Endpoints<M, R>>,
) -> Response {
    match endpoints.readiness.not_ready_because() {
        None => (StatusCode::OK, "ok\n").into_response(),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response(),
    }
}
