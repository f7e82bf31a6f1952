//! imp-firecracker-sim: a stand-in for the `firecracker` binary on hosts without KVM (see
//! imp_testkit::firecracker). Same flags as Firecracker for what Imp uses.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use imp_testkit::firecracker::sim::{self, Knobs, Options};

#[derive(Parser, Debug)]
#[command(
    name = "firecracker",
    about = "Firecracker simulator for Imp's tests",
    disable_version_flag = true
)]
struct Args {
    /// Print `Firecracker v<version>`, as Firecracker does.
    #[arg(long)]
    version: bool,
    /// Set by the jailer (process start time, microseconds of CLOCK_MONOTONIC); accepted.
    #[arg(long)]
    start_time_us: Option<u64>,
    /// Set by the jailer (its CPU time at start); accepted.
    #[arg(long)]
    start_time_cpu_us: Option<u64>,
    /// Set by the jailer (the jailer's own CPU time); accepted.
    #[arg(long)]
    parent_cpu_time_us: Option<u64>,
    /// Path to the API Unix socket.
    #[arg(long)]
    api_sock: Option<PathBuf>,
    /// MicroVM id.
    #[arg(long, default_value = "anonymous-instance")]
    id: String,
    /// Full VM configuration to boot from at startup.
    #[arg(long)]
    config_file: Option<PathBuf>,
    /// Serve no API (requires --config-file).
    #[arg(long)]
    no_api: bool,
    /// imp-guest binary run as the guest agent.
    #[arg(long, env = "IMP_GUEST_BIN")]
    guest_bin: Option<PathBuf>,
    /// Firecracker's own log goes to this (existing) file or named pipe instead of stdout.
    #[arg(long)]
    log_path: Option<PathBuf>,
    /// Log level: Error, Warning, Info, Debug, Trace or Off (case-insensitive).
    #[arg(long)]
    level: Option<String>,
    /// Print the level in every log line.
    #[arg(long)]
    show_level: bool,
    /// Accepted like Firecracker's; the simulator prints no origins.
    #[arg(long)]
    show_log_origin: bool,
    #[arg(long)]
    boot_delay_ms: Option<u64>,
    #[arg(long)]
    crash_at_start: bool,
    #[arg(long)]
    hang: bool,
    #[arg(long)]
    panic_text: Option<String>,
    #[arg(long)]
    ignore_ctrl_alt_del: bool,
    #[arg(long)]
    api_delay_ms: Option<u64>,
    /// How a clone's guest takes `Reidentify`: answer, refuse or hang (see sim::Knobs).
    #[arg(long, env = "IMP_SIM_REIDENTIFY")]
    reidentify: Option<sim::ReidentifyKnob>,
    /// With --keep-guest: the clone guest's identity root.
    #[arg(long, hide = true, requires = "keep_guest")]
    identity_root: Option<PathBuf>,
    /// Run as the guest keeper of the guest agent on this socket (spawned by the simulator
    /// itself; see sim::keep_guest).
    #[arg(long, hide = true)]
    keep_guest: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.version {
        println!("Firecracker v{}", sim::VMM_VERSION);
        return ExitCode::SUCCESS;
    }
    let Some(guest_bin) = args.guest_bin.clone() else {
        eprintln!("Error: --guest-bin (or IMP_GUEST_BIN) is required");
        return ExitCode::FAILURE;
    };
    if let Some(sock) = &args.keep_guest {
        return match sim::keep_guest(&guest_bin, sock, args.identity_root.as_deref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("Error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if args.no_api && args.config_file.is_none() {
        eprintln!("Error: --no-api requires --config-file");
        return ExitCode::FAILURE;
    }
    if !args.no_api && args.api_sock.is_none() {
        eprintln!("Error: --api-sock is required unless --no-api is given");
        return ExitCode::FAILURE;
    }
    // Per-VM knobs from IMP_SIM_BEHAVIOUR, then flags on top.
    let mut knobs = match Knobs::from_env(&args.id) {
        Ok(k) => k.unwrap_or_default(),
        Err(e) => {
            eprintln!("Error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(d) = args.boot_delay_ms {
        knobs.boot_delay_ms = d;
    }
    if let Some(d) = args.api_delay_ms {
        knobs.api_delay_ms = d;
    }
    knobs.crash_at_start |= args.crash_at_start;
    knobs.hang |= args.hang;
    knobs.ignore_ctrl_alt_del |= args.ignore_ctrl_alt_del;
    if args.panic_text.is_some() {
        knobs.panic_text = args.panic_text;
    }
    if let Some(r) = args.reidentify {
        knobs.reidentify = r;
    }
    let opts = Options {
        id: args.id,
        api_sock: (!args.no_api).then_some(args.api_sock).flatten(),
        config_file: args.config_file,
        knobs,
        guest_bin,
        log_path: args.log_path,
        log_level: args.level,
        show_level: args.show_level,
        keeper_bin: std::env::current_exe().ok(),
    };
    // current_thread: the guest agent is spawned from this thread (see sim::spawn_agent).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(sim::run(opts)) {
        Ok(sim::Exit::GuestReset) => ExitCode::SUCCESS,
        Ok(sim::Exit::RestoreFailed) => {
            eprintln!("Error: Loading snapshot failed.");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("Error: {e}");
            ExitCode::FAILURE
        }
    }
}
