//! imp-operator: the cluster-level coordinator. Runs the ImpVM controller (scheduling and lifecycle), the
//! runner-pool controller with its queued-job sweep, and an HTTP server with /metrics, /healthz, /readyz and
//! the GitHub webhook receiver (POST /webhooks/github).

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
use imp_common::telemetry::{LogArgs, ShutdownSignal};
use imp_operator::{
    github::{GithubApps, GithubConfig, GithubMetrics},
    metrics::{VmMetrics, encode},
    runnerpool::{
        PoolControllerConfig, PoolMetrics, PoolShared, SecretKeySelector, run_runnerpool_controller,
    },
    vm::{VmControllerConfig, run_vm_controller},
    webhook::webhook_router,
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
    /// Manage ImpVMs in this namespace only (default: every namespace).
    #[arg(long, env = "IMP_WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
    /// Extra label selector for the nodes Imp may use, ANDed with imp/enabled=true (e.g. `pool=ci`).
    #[arg(long, env = "IMP_NODE_SELECTOR")]
    node_selector: Option<String>,
    /// GitHub REST API base (GitHub Enterprise Server: `https://HOST/api/v3`).
    #[arg(
        long,
        env = "IMP_GITHUB_API_URL",
        default_value = "https://api.github.com"
    )]
    github_api_url: String,
    /// JIT runner configs minted per minute per GitHub App (GitHub's own limits apply above this).
    #[arg(long, env = "IMP_JIT_MINTS_PER_MINUTE", default_value_t = 150, value_parser = clap::value_parser!(u32).range(1..))]
    jit_mints_per_minute: u32,
    #[command(flatten)]
    log: LogArgs,
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
    if let Err(e) = args.log.init() {
        eprintln!("imp-operator: {e}");
        return ExitCode::from(2);
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
            error!(error = format!("{e:#}"), "imp-operator failed");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let shutdown = ShutdownSignal::install()?;
    let client = kube::Client::try_default().await?;
    let vm_metrics = VmMetrics::default();
    let github_metrics = GithubMetrics::default();
    let pool_metrics = PoolMetrics::sharing_reconcile(&vm_metrics);
    let mut registry = Registry::default();
    vm_metrics.register(&mut registry);
    github_metrics.register(&mut registry);
    pool_metrics.register(&mut registry);
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
    let github = GithubConfig {
        api_base_url: args.github_api_url.clone(),
        jit_mints_per_minute: args.jit_mints_per_minute,
        ..GithubConfig::default()
    };
    let shared = PoolShared::new(
        Arc::new(GithubApps::new(github, github_metrics)),
        pool_metrics,
    );
    let mut pool_config = PoolControllerConfig::new();
    pool_config.namespace = config.vm_namespace.clone();
    if !args.webhook_secret_name.is_empty() {
        pool_config.global_webhook_secret = Some(SecretKeySelector {
            namespace: args.namespace.clone(),
            name: args.webhook_secret_name.clone(),
            key: "webhook-secret".into(),
        });
    }
    let app = router(state).merge(webhook_router(shared.clone()));
    let vms = run_vm_controller(client.clone(), config, vm_metrics, ready);
    let pools = run_runnerpool_controller(client, pool_config, shared);
    let server = axum::serve(listener, app).with_graceful_shutdown(shutdown.recv());
    tokio::select! {
        r = server => r?,
        () = vms => anyhow::bail!("the ImpVM controller stopped"),
        () = pools => anyhow::bail!("the runner pool controller stopped"),
    }
    // Dropping the controllers cancels them at an await point; the next start reconciles from
    // what the API server holds.
    info!("imp-operator stopped");
    Ok(())
}
