//! imp-runtime: the host-level half of a node (Firecracker processes, TAP devices, SQLite
//! inventory) behind a Unix-socket HTTP API (docs/runtime.md). Stopping or killing it leaves the
//! VMs running; the next start reattaches to them.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use clap::Parser;
use imp_common::telemetry::{LogArgs, ShutdownSignal};
use imp_node::rootfs::flatten::Limits;
use imp_node::rootfs::pull::PullConfig;
use imp_node::rootfs::store::StoreConfig;
use imp_node::runtime::{Config, Runtime};
use imp_node::server;

#[derive(Parser, Debug)]
#[command(name = "imp-runtime", version, about = "Imp node runtime")]
struct Args {
    /// Unix socket of the node-local API (mode 0660).
    #[arg(
        long,
        env = "IMP_RUNTIME_SOCKET",
        default_value = "/run/imp/runtime.sock"
    )]
    socket: PathBuf,
    /// State directory: SQLite inventory, rootfs cache, per-VM disks and sockets.
    #[arg(long, env = "IMP_STATE_DIR", default_value = "/var/lib/imp")]
    state_dir: PathBuf,
    /// Guest kernel image.
    #[arg(long, env = "IMP_KERNEL")]
    kernel: PathBuf,
    /// Optional initrd (distribution kernels).
    #[arg(long, env = "IMP_INITRD")]
    initrd: Option<PathBuf>,
    /// Firecracker binary.
    #[arg(
        long,
        env = "IMP_FIRECRACKER_BIN",
        default_value = "/usr/local/bin/firecracker"
    )]
    firecracker_bin: PathBuf,
    /// Byte budget of the rootfs cache (unreferenced images are evicted, least recently used
    /// first, above it).
    #[arg(long, env = "IMP_ROOTFS_CACHE_BYTES", default_value_t = 20 << 30)]
    rootfs_cache_bytes: u64,
    /// Cap on the uncompressed size of one image's layers (stops decompression bombs).
    #[arg(long, env = "IMP_ROOTFS_MAX_UNPACKED_BYTES", default_value_t = 16 << 30)]
    rootfs_max_unpacked_bytes: u64,
    /// The static imp-guest injected into every image at /sbin/imp-guest.
    #[arg(
        long,
        env = "IMP_GUEST_BIN",
        default_value = "/usr/local/lib/imp/imp-guest"
    )]
    guest_bin: PathBuf,
    /// Registries (host:port) pulled over plain HTTP instead of HTTPS, comma-separated.
    #[arg(long, env = "IMP_INSECURE_REGISTRIES", value_delimiter = ',')]
    insecure_registries: Vec<String>,
    /// TCP address for Prometheus scraping (the socket serves /metrics too).
    #[arg(long, env = "IMP_METRICS_ADDR", default_value = "0.0.0.0:9091")]
    metrics_addr: SocketAddr,
    /// Spawn to guest-agent Hello budget per VM, e.g. "30s".
    #[arg(long, env = "IMP_BOOT_TIMEOUT", default_value = "30s", value_parser = positive_duration)]
    boot_timeout: Duration,
    /// How long a VM gets to stop after SendCtrlAltDel before SIGKILL, e.g. "10s".
    #[arg(long, env = "IMP_STOP_TIMEOUT", default_value = "10s", value_parser = positive_duration)]
    stop_timeout: Duration,
    #[command(flatten)]
    log: LogArgs,
}

/// A Kubernetes-style duration ("30s", "1m30s") greater than zero.
fn positive_duration(s: &str) -> Result<Duration, String> {
    match imp_api::parse_duration(s) {
        Ok(d) if d.is_zero() => Err("must be greater than zero".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = args.log.init() {
        eprintln!("imp-runtime: {e}");
        return ExitCode::from(2);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "imp-runtime failed");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let shutdown = ShutdownSignal::install().context("install the SIGTERM/SIGINT handlers")?;
    let cfg = Config {
        state_dir: args.state_dir.clone(),
        kernel: args.kernel,
        initrd: args.initrd,
        firecracker_bin: args.firecracker_bin,
        boot_timeout: args.boot_timeout,
        stop_timeout: args.stop_timeout,
        rootfs: StoreConfig {
            dir: args.state_dir.join("rootfs"),
            guest_bin: args.guest_bin,
            budget_bytes: args.rootfs_cache_bytes,
            limits: Limits {
                max_unpacked_bytes: args.rootfs_max_unpacked_bytes,
                ..Limits::default()
            },
            pull: PullConfig {
                insecure_registries: args.insecure_registries,
                ..PullConfig::default()
            },
            parallel_fetches: 3,
        },
    };
    let runtime = Runtime::start(cfg).await.context("start the runtime")?;
    let listener =
        server::bind(&args.socket).with_context(|| format!("bind {}", args.socket.display()))?;
    let metrics_listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .with_context(|| format!("bind metrics address {}", args.metrics_addr))?;
    tracing::info!(
        socket = %args.socket.display(),
        state_dir = %args.state_dir.display(),
        metrics = %metrics_listener.local_addr()?,
        "imp-runtime serving"
    );
    let metrics_app = axum::Router::new()
        .route("/metrics", axum::routing::get(server::metrics))
        .with_state(runtime.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(metrics_listener, metrics_app).await {
            tracing::error!(error = %e, "metrics listener failed");
        }
    });
    axum::serve(listener, server::router(runtime))
        .with_graceful_shutdown(shutdown.recv())
        .await
        .context("serve the API")?;
    // VMs keep running: they are reattached at the next start.
    tracing::info!("imp-runtime stopped; VMs left running");
    Ok(())
}
