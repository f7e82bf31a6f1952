//! imp-operator: the cluster-level coordinator (ImpVM scheduling and lifecycle, runner pools, the GitHub
//! webhook receiver). Flags and environment are final; the controllers are not built yet, so the binary
//! validates its configuration and then refuses to start instead of pretending to run.

use std::{net::SocketAddr, process::ExitCode};

use clap::Parser;

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
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = tracing_subscriber::EnvFilter::try_new(&args.log) {
        eprintln!(
            "imp-operator: --log / IMP_LOG {:?} is not a valid filter: {e}",
            args.log
        );
        return ExitCode::from(2);
    }
    eprintln!(
        "imp-operator: configuration accepted (http {}, namespace {}), but the ImpVM and runner-pool controllers \
         are not built yet; refusing to start rather than run without them",
        args.http_addr, args.namespace
    );
    ExitCode::FAILURE
}
