//! imp-guest binary. As PID 1 it is the VM's init (see `imp_guest::pid1`); otherwise
//! `imp-guest agent` serves the protocol as an ordinary host process (the Firecracker
//! simulator runs it this way, bridged to a Unix socket).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use imp_guest::agent::identity::IdentityConfig;
use imp_guest::agent::{Agent, AgentConfig, Announce, Listener, announce};
use imp_guest::pid1;
use imp_guest::protocol::{AGENT_VSOCK_PORT, READY_VSOCK_PORT};
use nix::sys::signal::Signal;

#[derive(Parser)]
#[command(name = "imp-guest", version, about = "Imp guest init and vsock agent")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the guest agent without doing any PID 1 work.
    Agent {
        /// Listen on this Unix socket instead of vsock (host-process mode).
        #[arg(long, value_name = "PATH")]
        listen_unix: Option<PathBuf>,
        /// Vsock port to listen on when --listen-unix is not given.
        #[arg(long, value_name = "PORT", default_value_t = AGENT_VSOCK_PORT)]
        listen_vsock: u32,
        /// Announce the agent on this Unix socket once it listens (a simulator's stand-in for
        /// the guest's connection to the host's vsock port); with vsock, the host's port
        /// READY_VSOCK_PORT is always used.
        #[arg(long, value_name = "PATH")]
        announce_unix: Option<PathBuf>,
        /// Seconds to wait for the host to collect a poweroff_on_exit exit before exiting anyway.
        #[arg(long, value_name = "SECONDS", default_value_t = pid1::cmdline::DEFAULT_REPORT_GRACE.as_secs())]
        report_grace_s: u64,
        /// Accept `Reidentify`: write etc/machine-id and etc/resolv.conf under this root, set the
        /// hostname, seed the kernel's random pool. The hostname is the UTS namespace's: run the
        /// agent in one of its own. The wall clock is only checked, never set, in this mode.
        #[arg(long, value_name = "DIR")]
        identity_root: Option<PathBuf>,
        /// The interface a `Reidentify`'s network part reconfigures (with --identity-root; run
        /// the agent in a network namespace of its own).
        #[arg(long, value_name = "NAME", requires = "identity_root")]
        identity_interface: Option<String>,
    },
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
}

fn main() -> std::process::ExitCode {
    init_logging();
    // As PID 1, argv is whatever the kernel passed on: never let it decide the mode.
    if std::process::id() == 1 {
        pid1::run();
    }
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Agent {
            listen_unix,
            listen_vsock,
            announce_unix,
            report_grace_s,
            identity_root,
            identity_interface,
        }) => agent_mode(
            listen_unix,
            listen_vsock,
            announce_unix,
            Duration::from_secs(report_grace_s),
            identity_root.map(|root| IdentityConfig {
                root,
                interface: identity_interface,
                set_clock: false,
            }),
        ),
        None => {
            // PID 1 work (mounts, switch_root, power-off) on a host would be destructive.
            eprintln!(
                "imp-guest: not PID 1; run `imp-guest agent` for the agent alone (see --help)"
            );
            std::process::ExitCode::from(2)
        }
    }
}

fn agent_mode(
    listen_unix: Option<PathBuf>,
    listen_vsock: u32,
    announce_unix: Option<PathBuf>,
    report_grace: Duration,
    identity: Option<IdentityConfig>,
) -> std::process::ExitCode {
    // Orphans of exec'd jobs get reparented to us, as they would to PID 1 in a VM.
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("imp-guest: start async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        // Each agent process is its own "boot": a fresh id tells the host its exec table is new.
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/uuid")
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| format!("pid-{}", std::process::id()));
        let agent = match Agent::start(AgentConfig {
            boot_id: boot_id.clone(),
            report_grace,
            metrics_root: "/".into(),
            identity,
        }) {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(error = %e, "agent failed to start");
                return std::process::ExitCode::FAILURE;
            }
        };
        let listener = match &listen_unix {
            Some(path) => Listener::bind_unix(path),
            None => Listener::bind_vsock(listen_vsock),
        };
        let listener = match listener {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "agent failed to listen");
                return std::process::ExitCode::FAILURE;
            }
        };
        tracing::info!(unix = ?listen_unix, vsock_port = listen_vsock, "agent listening");
        let to = match (&listen_unix, announce_unix) {
            (_, Some(path)) => Some(Announce::Unix(path)),
            (None, None) => Some(Announce::Vsock(READY_VSOCK_PORT)),
            (Some(_), None) => None,
        };
        if let Some(to) = to {
            tokio::spawn(async move {
                if let Err(e) = announce(&to, &boot_id).await {
                    tracing::debug!(error = %e, ?to, "the host did not take the announcement");
                }
            });
        }
        let reason = pid1::serve_until_signal(&agent, listener).await;
        tracing::info!(?reason, "agent stopping");
        let execs = agent.execs();
        execs.signal_all(Signal::SIGTERM);
        let deadline = tokio::time::Instant::now() + pid1::KILL_GRACE;
        while !execs.running_pids().is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        execs.signal_all(Signal::SIGKILL);
        if let Some(path) = listen_unix {
            let _ = std::fs::remove_file(path);
        }
        std::process::ExitCode::SUCCESS
    })
}
