//! imp-runtime: the host-level half of a node (Firecracker processes, TAP devices, SQLite
//! inventory) behind a Unix-socket HTTP API (docs/runtime.md). Stopping or killing it leaves the
//! VMs running; the next start reattaches to them.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use clap::Parser;
use imp_api::parse_positive_duration;
use imp_common::telemetry::{LogArgs, ShutdownSignal};
use imp_runtime::api::Backend;
use imp_runtime::cgroup::CgroupConfig;
use imp_runtime::firecracker::jailer::JailerConfig;
use imp_runtime::jail::JailConfig;
use imp_runtime::network::Admission;
use imp_runtime::qemu::{Accel, QemuConfig};
use imp_runtime::rootfs::flatten::Limits;
use imp_runtime::rootfs::pull::PullConfig;
use imp_runtime::rootfs::store::StoreConfig;
use imp_runtime::runtime::{Config, Runtime};
use imp_runtime::server;

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
    /// Directories a request's `kernel`, `initrd` and `base_disk` may name files under
    /// (comma-separated); default: the directories of --kernel and --initrd.
    #[arg(long, env = "IMP_IMAGE_DIRS", value_delimiter = ',')]
    image_dirs: Vec<PathBuf>,
    /// Total bytes of writable drives this node hands out (PUT refuses past it); default: the
    /// size of the state directory's filesystem.
    #[arg(long, env = "IMP_WRITABLE_BUDGET_BYTES")]
    writable_budget_bytes: Option<u64>,
    /// Bytes the node's VM templates (memory snapshots and writable drives of template VMs,
    /// docs/snapshots.md) may hold together; past it the least recently used go.
    #[arg(long, env = "IMP_TEMPLATE_BUDGET_BYTES", default_value_t = 8 << 30)]
    template_budget_bytes: u64,
    /// Bytes of guest console kept per VM (the newest; older output is dropped).
    #[arg(long, env = "IMP_SERIAL_LOG_CAP_BYTES", default_value_t = 8 << 20)]
    serial_log_cap_bytes: u64,
    /// Parent of the per-VM cgroups (memory, cpu, pids), relative to each hierarchy's root
    /// (e.g. `imp-vms`); unset: VMs stay in the runtime's cgroup.
    #[arg(long, env = "IMP_VM_CGROUP_PARENT")]
    vm_cgroup_parent: Option<PathBuf>,
    /// Where the host's cgroup filesystem is mounted.
    #[arg(long, env = "IMP_VM_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    vm_cgroup_root: PathBuf,
    /// MiB added to a VM's memory for its cgroup limit (the VMM's own memory).
    #[arg(long, env = "IMP_VM_MEMORY_OVERHEAD_MIB", default_value_t = 128)]
    vm_memory_overhead_mib: u64,
    /// Tasks (processes and threads) one VM's cgroup may hold (`pids.max`).
    #[arg(long, env = "IMP_VM_PIDS_MAX", default_value_t = imp_runtime::cgroup::DEFAULT_PIDS_MAX)]
    vm_pids_max: u64,
    /// The VMM this node runs: `firecracker` or `qemu` (KVM when usable, TCG otherwise).
    #[arg(long, env = "IMP_VMM_BACKEND", default_value = "firecracker")]
    backend: Backend,
    /// QEMU binary (backend `qemu`).
    #[arg(
        long,
        env = "IMP_QEMU_BIN",
        default_value = "/usr/bin/qemu-system-x86_64"
    )]
    qemu_bin: PathBuf,
    /// vhost-device-vsock binary (backend `qemu`: one per VM).
    #[arg(
        long,
        env = "IMP_VHOST_VSOCK_BIN",
        default_value = "/usr/local/bin/vhost-device-vsock"
    )]
    vhost_vsock_bin: PathBuf,
    /// QEMU accelerator: `auto` (KVM when /dev/kvm opens, else TCG), `kvm` or `tcg`.
    #[arg(long, env = "IMP_QEMU_ACCEL", default_value = "auto", value_parser = parse_accel)]
    qemu_accel: Accel,
    /// Firecracker binary.
    #[arg(
        long,
        env = "IMP_FIRECRACKER_BIN",
        default_value = "/usr/local/bin/firecracker"
    )]
    firecracker_bin: PathBuf,
    /// Firecracker's jailer (the same release as --firecracker-bin): every Firecracker VM runs
    /// through it, chrooted, as its own uid, in its own cgroups and PID namespace
    /// (docs/security.md). Required with `--backend firecracker`, unless
    /// --unjailed-firecracker or --no-confine.
    #[arg(long, env = "IMP_JAILER_PATH")]
    jailer_path: Option<PathBuf>,
    /// Run Firecracker without its jailer (as root, the host's filesystem): for Firecracker
    /// simulators in tests and for debugging only; the chart never sets it.
    #[arg(long, env = "IMP_UNJAILED_FIRECRACKER", value_parser = clap::builder::BoolishValueParser::new())]
    unjailed_firecracker: bool,
    /// The jailer's `--chroot-base-dir`; on the state disk (drives are hard-linked into each
    /// jail). Default: `<state-dir>/jailer`.
    #[arg(long, env = "IMP_JAILER_CHROOT_BASE_DIR")]
    jailer_chroot_base_dir: Option<PathBuf>,
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
    /// Registries (host[:port], comma-separated) that live on the node: pulls from them may reach
    /// the node's own, loopback and link-local addresses, which every other pull is refused.
    #[arg(long, env = "IMP_NODE_LOCAL_REGISTRIES", value_delimiter = ',')]
    node_local_registries: Vec<String>,
    /// TCP address for Prometheus scraping (the socket serves /metrics too). Loopback unless
    /// asked: the chart sets the pod IP (or 0.0.0.0 when `runtime.metrics.bindAll`).
    #[arg(long, env = "IMP_METRICS_ADDR", default_value = "127.0.0.1:9091")]
    metrics_addr: SocketAddr,
    /// Spawn to guest-agent Hello budget per VM, e.g. "30s".
    #[arg(long, env = "IMP_BOOT_TIMEOUT", default_value = "30s", value_parser = parse_positive_duration)]
    boot_timeout: Duration,
    /// How long a VM gets to stop after SendCtrlAltDel before SIGKILL, e.g. "10s".
    #[arg(long, env = "IMP_STOP_TIMEOUT", default_value = "10s", value_parser = parse_positive_duration)]
    stop_timeout: Duration,
    /// First uid (and gid) of the range confined VMs run as: each live VM gets its own, held
    /// while its directory exists (docs/security.md).
    #[arg(long, env = "IMP_JAIL_UID_BASE", default_value_t = 900_000)]
    jail_uid_base: u32,
    /// Size of that range: at most this many VMs (live, suspended or failed) on the node.
    #[arg(long, env = "IMP_JAIL_UID_COUNT", default_value_t = 4096)]
    jail_uid_count: u32,
    /// Run VMM processes as the runtime (root, every capability, the host's filesystem):
    /// for debugging only.
    #[arg(long, env = "IMP_NO_CONFINE", value_parser = clap::builder::BoolishValueParser::new())]
    no_confine: bool,
    /// Interfaces an ImpNetwork's `nat.egressInterface` may name besides the default route's
    /// (comma-separated); any other is refused.
    #[arg(
        long,
        env = "IMP_NETWORK_ALLOWED_EGRESS_INTERFACES",
        value_delimiter = ','
    )]
    network_allowed_egress_interfaces: Vec<String>,
    /// IPv4 ranges no ImpNetwork subnet may overlap, e.g. the cluster's pod, service and node
    /// CIDRs (comma-separated). The node's own addresses and routes are refused anyway.
    /// Guests open no connection to them by default, like the private ranges.
    #[arg(long, env = "IMP_NETWORK_RESERVED_CIDRS", value_delimiter = ',')]
    network_reserved_cidrs: Vec<ipnet::Ipv4Net>,
    /// IPv4 ranges an ImpNetwork's `egress.allow` may open out of the guests' default deny
    /// (private and reserved ranges; comma-separated). An allow entry reaching into a denied
    /// range outside them refuses the network.
    #[arg(
        long,
        env = "IMP_NETWORK_ALLOWABLE_EGRESS_CIDRS",
        value_delimiter = ','
    )]
    network_allowable_egress_cidrs: Vec<ipnet::Ipv4Net>,
    #[command(flatten)]
    log: LogArgs,
}

fn parse_accel(s: &str) -> Result<Accel, String> {
    match s {
        "auto" => Ok(Accel::Auto),
        "kvm" => Ok(Accel::Kvm),
        "tcg" => Ok(Accel::Tcg),
        other => Err(format!("{other:?} is not auto, kvm or tcg")),
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

/// Firecracker would run without its jailer, and nobody asked for that.
fn jailer_missing(args: &Args) -> bool {
    args.backend == Backend::Firecracker
        && args.jailer_path.is_none()
        && !args.unjailed_firecracker
        && !args.no_confine
}

async fn run(args: Args) -> anyhow::Result<()> {
    use anyhow::Context as _;
    anyhow::ensure!(
        !jailer_missing(&args),
        "--jailer-path (IMP_JAILER_PATH) is required with --backend firecracker: Firecracker's \
         jailer of the same release as --firecracker-bin, which confines every VM \
         (docs/security.md); --unjailed-firecracker runs Firecracker unconfined, for tests only"
    );
    let shutdown = ShutdownSignal::install().context("install the SIGTERM/SIGINT handlers")?;
    let image_dirs = if args.image_dirs.is_empty() {
        [Some(&args.kernel), args.initrd.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|p| p.parent().map(PathBuf::from))
            .collect()
    } else {
        args.image_dirs
    };
    anyhow::ensure!(
        args.no_confine || (args.jail_uid_base > 0 && args.jail_uid_count > 0),
        "--jail-uid-base must be above 0 (root) and --jail-uid-count at least 1"
    );
    std::fs::create_dir_all(&args.state_dir)
        .with_context(|| format!("create {}", args.state_dir.display()))?;
    let writable_budget_bytes = match args.writable_budget_bytes {
        Some(b) => b,
        None => {
            let fs = nix::sys::statvfs::statvfs(&args.state_dir)
                .with_context(|| format!("statvfs {}", args.state_dir.display()))?;
            fs.blocks() * fs.fragment_size()
        }
    };
    let cfg = Config {
        state_dir: args.state_dir.clone(),
        kernel: args.kernel,
        initrd: args.initrd,
        image_dirs,
        writable_budget_bytes,
        template_budget_bytes: args.template_budget_bytes,
        serial_log_cap_bytes: args.serial_log_cap_bytes,
        vm_cgroups: args.vm_cgroup_parent.map(|parent| CgroupConfig {
            root: args.vm_cgroup_root,
            parent,
            overhead_mib: args.vm_memory_overhead_mib,
            pids_max: args.vm_pids_max,
        }),
        backend: args.backend,
        jailer: args.jailer_path.map(|bin| JailerConfig {
            bin,
            chroot_base: args
                .jailer_chroot_base_dir
                .unwrap_or_else(|| args.state_dir.join("jailer")),
        }),
        firecracker_bin: args.firecracker_bin,
        qemu: QemuConfig {
            qemu_bin: args.qemu_bin,
            vhost_vsock_bin: args.vhost_vsock_bin,
            accel: args.qemu_accel,
        },
        boot_timeout: args.boot_timeout,
        stop_timeout: args.stop_timeout,
        jail: (!args.no_confine).then_some(JailConfig {
            uid_base: args.jail_uid_base,
            uid_count: args.jail_uid_count,
        }),
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
                node_local_registries: args.node_local_registries,
                ..PullConfig::default()
            },
            parallel_fetches: 3,
        },
        network: Admission {
            allowed_egress_interfaces: args.network_allowed_egress_interfaces,
            reserved: args.network_reserved_cidrs,
            allowable_egress: args.network_allowable_egress_cidrs,
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
