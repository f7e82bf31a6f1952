//! imp-operator: the cluster-level coordinator. Runs the ImpVM controller (scheduling and lifecycle), the
//! runner-pool controller with its queued-job sweep, and an HTTP server with /metrics, /healthz, /readyz and
//! the GitHub webhook receiver (POST /webhooks/github).
//!
//! Only the leader (a coordination.k8s.io Lease, [`imp_operator::leader`]) runs the controllers, so only it
//! schedules, creates VMs and mints. Only the leader is Ready (the webhook Service routes to it alone) and a
//! standby answers deliveries 503, so every delivery answered 2xx went into the leader's demand; a new
//! leader's first sweep rebuilds demand at once. A leader that stops leading exits: its in-memory demand and
//! backoff must not outlive its term. On SIGTERM the controllers stop first, then the Lease is released so
//! the successor takes over within one retry period.

use std::{
    net::SocketAddr,
    process::ExitCode,
    sync::{Arc, atomic::AtomicBool},
    time::Duration,
};

use axum::middleware;
use clap::Parser;
use imp_api::parse_positive_duration;
use imp_common::telemetry::{LogArgs, ShutdownSignal};
use imp_operator::{
    github::{GithubApps, GithubConfig, GithubMetrics},
    http::{HttpState, router},
    index::{Index, IndexConfig},
    leader::{ElectionConfig, leader_only, run_elector, while_leading},
    metrics::{PressureMetrics, VmMetrics},
    pressure::{PressureConfig, run_pressure_lifecycle},
    runnerpool::{
        PoolControllerConfig, PoolMetrics, PoolShared, PoolTiming, SecretKeySelector,
        run_runnerpool_controller,
    },
    vm::{VmControllerConfig, run_vm_controller},
    webhook::{WebhookLimits, webhook_router_with},
};
use prometheus_client::registry::Registry;
use tokio::sync::{oneshot, watch};
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
    /// Webhook deliveries read and signature-checked at once (each holds up to 1 MiB of body and
    /// costs an HMAC over it); beyond this, a delivery waits `--webhook-check-wait`, then 503.
    #[arg(long, env = "IMP_WEBHOOK_CONCURRENT_CHECKS", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..))]
    webhook_concurrent_checks: u16,
    /// How long a delivery waits for a signature-check slot before it answers 503 `busy`.
    #[arg(long, env = "IMP_WEBHOOK_CHECK_WAIT", default_value = "2s", value_parser = parse_positive_duration)]
    webhook_check_wait: Duration,
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
    /// The leader-election Lease, in `--namespace` (docs/rbac.md grants exactly this name).
    #[arg(long, env = "IMP_LEADER_LEASE", default_value = "imp-operator-leader")]
    leader_lease: String,
    /// This candidate's identity in the Lease (the pod name; the chart sets it).
    #[arg(long, env = "IMP_POD_NAME")]
    pod_name: Option<String>,
    /// How often each pool's runners are listed at GitHub and registrations without a VM deleted.
    #[arg(long, env = "IMP_REAP_INTERVAL", default_value = "2m", value_parser = parse_positive_duration)]
    reap_interval: Duration,
    /// A minted runner VM whose runner has not started this long after scheduling is replaced
    /// (`BootDeadlineExceeded`).
    #[arg(long, env = "IMP_BOOT_DEADLINE", default_value = "10m", value_parser = parse_positive_duration)]
    boot_deadline: Duration,
    /// A runner Started this long ago that GitHub never listed online is replaced (`RunnerNeverOnline`).
    #[arg(long, env = "IMP_RUNNER_ONLINE_DEADLINE", default_value = "5m", value_parser = parse_positive_duration)]
    runner_online_deadline: Duration,
    /// How long a scale-set long poll waits for GitHub (GitHub answers within about 50 s). A
    /// session that hears nothing for this plus 15 s makes the operator not Ready (running but deaf).
    #[arg(long, env = "IMP_SCALE_SET_POLL_TIMEOUT", default_value = "50s", value_parser = parse_positive_duration)]
    scale_set_poll_timeout: Duration,
    /// Under node MemoryPressure, suspend resident persistent VMs, largest memory first, until it clears;
    /// never resume them (chart `pressureLifecycle.enabled`; docs/architecture.md). Off by default.
    #[arg(long, env = "IMP_PRESSURE_LIFECYCLE", action = clap::ArgAction::Set, num_args = 0..=1,
          default_value_t = false, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new())]
    pressure_lifecycle: bool,
    /// pressureLifecycle: a VM it suspended that has not reported Suspended this long no longer holds
    /// back the next one on its node (`PressureSuspendStalled`).
    #[arg(long, env = "IMP_PRESSURE_SUSPEND_TIMEOUT", default_value = "5m", value_parser = parse_positive_duration)]
    pressure_suspend_timeout: Duration,
    #[command(flatten)]
    log: LogArgs,
}

impl Args {
    /// The pool controller's timing: production defaults with the flags applied.
    fn pool_timing(&self) -> PoolTiming {
        PoolTiming {
            reap_interval: self.reap_interval,
            boot_deadline: self.boot_deadline,
            runner_online_deadline: self.runner_online_deadline,
            ..PoolTiming::default()
        }
    }
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
    let pressure_metrics = PressureMetrics::sharing_reconcile(&vm_metrics);
    if args.pressure_lifecycle {
        pressure_metrics.register(&mut registry);
    }
    let ready = Arc::new(AtomicBool::new(false));
    let (leading_tx, leading) = watch::channel(false);

    let listener = tokio::net::TcpListener::bind(args.http_addr).await?;
    info!(addr = %args.http_addr, namespace = %args.namespace, "imp-operator starting");
    let watched = IndexConfig {
        namespace: args.watch_namespace.clone().filter(|n| !n.is_empty()),
        node_selector: args.node_selector.clone().filter(|s| !s.is_empty()),
        lease_namespace: args.namespace.clone(),
    };
    let github = GithubConfig {
        api_base_url: args.github_api_url.clone(),
        jit_mints_per_minute: args.jit_mints_per_minute,
        ..GithubConfig::default()
    };
    let shared = PoolShared::new(
        Arc::new(GithubApps::new(github, github_metrics)),
        pool_metrics,
    );
    shared
        .scale_sets
        .set_poll_timeout(args.scale_set_poll_timeout);
    let state = HttpState {
        registry: Arc::new(registry),
        ready: ready.clone(),
        leading: leading.clone(),
        pools: shared.clone(),
    };
    let mut pool_config = PoolControllerConfig::new();
    pool_config.namespace = watched.namespace.clone();
    pool_config.timing = args.pool_timing();
    if !args.webhook_secret_name.is_empty() {
        pool_config.global_webhook_secret = Some(SecretKeySelector {
            namespace: args.namespace.clone(),
            name: args.webhook_secret_name.clone(),
            key: "webhook-secret".into(),
        });
    }
    let limits = WebhookLimits {
        concurrent_checks: args.webhook_concurrent_checks.into(),
        queue_wait: args.webhook_check_wait,
    };
    let webhooks = webhook_router_with(shared.clone(), limits)
        .layer(middleware::from_fn_with_state(leading.clone(), leader_only));
    let app = router(state).merge(webhooks);

    // Without a pod name (outside the chart), a random identity keeps two processes apart.
    let identity = args
        .pod_name
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| format!("imp-operator-{:016x}", rand::random::<u64>()));
    let election = ElectionConfig::new(&args.namespace, &args.leader_lease, &identity);
    info!(lease = %args.leader_lease, identity = %identity, "campaigning for leadership");
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let pools = shared.clone();
    let elector = tokio::spawn(run_elector(client.clone(), election, leading_tx, async {
        let _ = release_rx.await;
    }));

    let pressure_config = PressureConfig {
        suspend_timeout: args.pressure_suspend_timeout,
        ..PressureConfig::new()
    };
    let pressure_on = args.pressure_lifecycle;
    let lead = while_leading(leading, async move {
        // One index per term: every controller reads the same caches, each kind watched once.
        let index = Index::start(client.clone(), watched);
        let pressure = async {
            if pressure_on {
                info!(suspend_timeout = ?pressure_config.suspend_timeout, "pressureLifecycle enabled");
                run_pressure_lifecycle(
                    client.clone(),
                    index.clone(),
                    pressure_config,
                    pressure_metrics,
                )
                .await;
            } else {
                info!("pressureLifecycle disabled (IMP_PRESSURE_LIFECYCLE)");
                std::future::pending::<()>().await;
            }
        };
        let vms = run_vm_controller(
            client.clone(),
            index.clone(),
            VmControllerConfig::new(),
            vm_metrics,
            ready,
        );
        let pools = run_runnerpool_controller(client.clone(), index.clone(), pool_config, pools);
        tokio::select! {
            () = vms => error!("the ImpVM controller stopped"),
            () = pools => error!("the runner pool controller stopped"),
            () = pressure => error!("the pressureLifecycle stopped"),
        }
    });
    let server = axum::serve(listener, app).with_graceful_shutdown(shutdown.recv());
    let result = tokio::select! {
        r = server => r.map_err(anyhow::Error::from),
        r = lead => r.map_err(anyhow::Error::from),
    };
    // The controllers are dropped (cancelled at an await point) before the Lease is released, so the
    // successor never overlaps them; it reconciles from what the API server holds. The scale-set
    // sessions are deleted so the successor need not wait for them to expire.
    shared.scale_sets.close_sessions().await;
    let _ = release_tx.send(());
    let _ = elector.await;
    info!("imp-operator stopped");
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_deadlines_and_the_reap_interval_come_from_flags() {
        let args = Args::try_parse_from([
            "imp-operator",
            "--reap-interval",
            "30s",
            "--boot-deadline",
            "4m",
            "--runner-online-deadline",
            "90s",
        ])
        .unwrap();
        let t = args.pool_timing();
        assert_eq!(t.reap_interval, Duration::from_secs(30));
        assert_eq!(t.boot_deadline, Duration::from_secs(240));
        assert_eq!(t.runner_online_deadline, Duration::from_secs(90));
        assert_eq!(t.sweep_interval, PoolTiming::default().sweep_interval);
    }

    #[test]
    fn the_defaults_are_the_pool_controllers_own() {
        let t = Args::try_parse_from(["imp-operator"])
            .unwrap()
            .pool_timing();
        let d = PoolTiming::default();
        assert_eq!(
            (t.reap_interval, t.boot_deadline, t.runner_online_deadline),
            (d.reap_interval, d.boot_deadline, d.runner_online_deadline)
        );
    }

    #[test]
    fn the_pressure_lifecycle_is_off_unless_asked_for() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["imp-operator"];
            argv.extend_from_slice(extra);
            Args::try_parse_from(argv).map(|a| a.pressure_lifecycle)
        };
        assert!(!parse(&[]).unwrap());
        assert!(parse(&["--pressure-lifecycle"]).unwrap());
        // The chart passes the value's string: IMP_PRESSURE_LIFECYCLE="false" or "true".
        assert!(!parse(&["--pressure-lifecycle=false"]).unwrap());
        assert!(parse(&["--pressure-lifecycle=true"]).unwrap());
        assert!(parse(&["--pressure-lifecycle=maybe"]).is_err());
        let args = Args::try_parse_from(["imp-operator"]).unwrap();
        assert_eq!(args.pressure_suspend_timeout, Duration::from_secs(300));
    }

    #[test]
    fn a_zero_or_unparsable_deadline_is_refused_naming_the_flag() {
        for bad in ["0s", "soon"] {
            let e = Args::try_parse_from(["imp-operator", "--boot-deadline", bad]).unwrap_err();
            assert!(e.to_string().contains("--boot-deadline"), "{e}");
        }
    }
}
