//! imp-runtime: the host-level half of a node (Firecracker processes, TAP/bridge/NAT, rootfs cache,
//! SQLite inventory) behind a Unix-socket HTTP API. Flags and environment are final; the runtime itself is
//! not built yet, so the binary validates its configuration and refuses to start.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use clap::Parser;

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
    /// Byte budget of the rootfs cache.
    #[arg(long, env = "IMP_ROOTFS_CACHE_BYTES", default_value_t = 20 << 30)]
    rootfs_cache_bytes: u64,
    /// TCP address for Prometheus scraping (the socket serves /metrics too).
    #[arg(long, env = "IMP_METRICS_ADDR", default_value = "0.0.0.0:9091")]
    metrics_addr: SocketAddr,
}

fn main() -> ExitCode {
    let args = Args::parse();
    eprintln!(
        "imp-runtime: configuration accepted (socket {}, state dir {}), but the runtime (Firecracker driver, \
         inventory, API) is not built yet; refusing to start",
        args.socket.display(),
        args.state_dir.display()
    );
    ExitCode::FAILURE
}
