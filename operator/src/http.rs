//! The operator's own HTTP endpoints: Prometheus scraping, liveness, and readiness (Ready only as the
//! leader, once the watch caches are filled and every pool's webhook secret has been read, so the
//! webhook Service routes deliveries to a leader that can judge them).

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::metrics::encode;
use crate::runnerpool::PoolShared;

/// What the handlers read: the metrics registry, readiness, leadership and the pools' routes.
#[derive(Clone)]
pub struct HttpState {
    pub registry: Arc<Registry>,
    pub ready: Arc<AtomicBool>,
    pub leading: watch::Receiver<bool>,
    pub pools: Arc<PoolShared>,
}

async fn metrics(State(s): State<HttpState>) -> impl IntoResponse {
    match encode(&s.registry) {
        Ok(body) => (
            StatusCode::OK,
            [(
                "content-type",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics failed: {e}"),
        )
            .into_response(),
    }
}

async fn readyz(State(s): State<HttpState>) -> impl IntoResponse {
    if !*s.leading.borrow() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "standby: not the leader".to_owned(),
        )
    } else if !s.ready.load(Ordering::SeqCst) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "watch caches not filled yet".to_owned(),
        )
    } else if !s.pools.routes_loaded() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "pool webhook secrets not read yet".to_owned(),
        )
    } else if let Some((pool, silent)) = s.pools.scale_sets.deaf().first() {
        // Running but deaf: the scale set's session hears nothing, so its jobs wait unseen.
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "scale-set session of pool {pool} heard nothing for {}s (bound {}s)",
                silent.as_secs(),
                s.pools.scale_sets.deaf_after().as_secs()
            ),
        )
    } else {
        (StatusCode::OK, "ready".to_owned())
    }
}

/// `/metrics`, `/healthz` and `/readyz` (the webhook receiver is [`crate::webhook::webhook_router`]).
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}
