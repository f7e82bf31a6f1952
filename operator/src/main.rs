//! imp-operator: the cluster-level coordinator. Runs the ImpVM controller (scheduling and lifecycle) and an
//! HTTP server with /metrics, /healthz and /readyz. The runner-pool controller and the GitHub webhook
//! receiver are added by their own modules.

use std::{
    net::SocketAddr,
    process::ExitCode,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use clap::Parser;
use imp_operator::{
    metrics::{VmMetrics, encode},
    vm::{VmControllerConfig, run_vm_controller},
};
use prometheus_client::registry::Registry;
use tracing::{error, info};

#[derive(Parser, Debug)]
#[command(name = "imp-operator", version, about = "Imp cluster operator")]
struct Args {
    /// Address of the HTTP server: /metrics, /healthz, /readyz, POST /webhooks/github.
    #[arg(long, env = "IMP_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Namespace the operator runs in (global webhook secret, heartbeat Leases).
    #[arg(long, env = "IMP_NAMESPACE", default_value = "imp-system")]
    namespace: String,
    /// Secret (key `webhook-secret`) verifying deliveries for pools without a secret of their own.
    #[arg(long, env = "IMP_WEBHOOK_SECRET_NAME", default_value = "")]
    webhook_secret_name: String,
    /// Log filter (tracing env-filter syntax).
    #[arg(long, env = "IMP_LOG", default_value = "info")]
    log: String,
    /// Manage ImpVMs in this namespace only (default: every namespace).
    #[arg(long, env = "IMP_WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
    /// Extra label selector for the nodes Imp may use, ANDed with imp/enabled=true (e.g. `pool=ci`).
    #[arg(long, env = "IMP_NODE_SELECTOR")]
    node_selector: Option<String>,
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, env = "IMP_LOG_JSON", default_value_t = false)]
    log_json: bool,
}

#[derive(Clone)]
struct HttpState {
    registry: Arc<Registry>,
    ready: Arc<AtomicBool>,
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
    if s.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ready")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "watch caches not filled yet",
        )
    }
}

fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = match tracing_subscriber::EnvFilter::try_new(&args.log) {
        Ok(f) => f,
        Err(e) => {
            eprintln!(
                "imp-operator: --log / IMP_LOG {:?} is not a valid filter: {e}",
                args.log
            );
            return ExitCode::from(2);
        }
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    if args.log_json {
        builder.json().init();
    } else {
        builder.init();
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "starting the async runtime failed");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = format!("{e:#}"), "imp-operator stopped");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let client = kube::Client::try_default().await?;
    let vm_metrics = VmMetrics::default();
    let mut registry = Registry::default();
    vm_metrics.register(&mut registry);
    let ready = Arc::new(AtomicBool::new(false));
    let state = HttpState {
        registry: Arc::new(registry),
        ready: ready.clone(),
    };

    let listener = tokio::net::TcpListener::bind(args.http_addr).await?;
    info!(addr = %args.http_addr, namespace = %args.namespace, "imp-operator starting");
    let mut config = VmControllerConfig::new(args.namespace.clone());
    config.vm_namespace = args.watch_namespace.clone().filter(|n| !n.is_empty());
    config.node_selector = args.node_selector.clone().filter(|s| !s.is_empty());
    let controller = run_vm_controller(client, config, vm_metrics, ready);
    let server = axum::serve(listener, router(state)).with_graceful_shutdown(shutdown_signal());
    tokio::select! {
        r = server => r?,
        () = controller => anyhow::bail!("the ImpVM controller stopped"),
    }
    info!("imp-operator shut down");
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! { () = ctrl_c => {}, () = term => {} }
    info!("shutdown signal received");
}
