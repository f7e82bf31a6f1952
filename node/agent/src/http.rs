//! `/metrics` (Prometheus text) and `/healthz` on `--http-addr`.

use axum::{Router, extract::State, http::header, response::IntoResponse, routing::get};

use super::metrics::AgentMetrics;

pub fn router(metrics: AgentMetrics) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics_text))
        .with_state(metrics)
}

async fn metrics_text(State(m): State<AgentMetrics>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        m.encode(),
    )
}

pub async fn serve(listener: tokio::net::TcpListener, metrics: AgentMetrics) -> anyhow::Result<()> {
    axum::serve(listener, router(metrics)).await?;
    Ok(())
}
