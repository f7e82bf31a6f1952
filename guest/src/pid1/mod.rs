//! PID 1 mode: prepare the VM, serve the agent on vsock, power off at the end.
//!
//! Every stage prints a marker line on the serial console (`IMP-GUEST stage=<name> ok|FAILED`)
//! so a boot failure is diagnosable from the VM's console log alone. A failed stage powers the
//! VM off: PID 1 must never exit (the kernel would panic), and a VM that cannot serve the agent
//! is useless; the host sees the VM stop without a Hello.

pub mod cgroup;
pub mod cmdline;
pub mod modules;
pub mod mounts;
pub mod net;
pub mod root;
pub mod system;

use std::fmt::Display;
use std::path::Path;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::agent::exec::ExecTable;
use crate::agent::{Agent, AgentConfig, AgentError, Announce, Listener, ShutdownReason, announce};
use crate::protocol::READY_VSOCK_PORT;
use cmdline::{BootConfig, CmdlineError, HaltAction};

/// Time between SIGTERM and SIGKILL for everything left at shutdown.
pub const KILL_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum Pid1Error {
    #[error(transparent)]
    Mount(#[from] mounts::MountError),
    #[error("read /proc/cmdline: {0}")]
    ReadCmdline(std::io::Error),
    #[error("kernel command line: {0}")]
    Cmdline(#[from] CmdlineError),
    #[error(transparent)]
    Modules(#[from] modules::ModuleError),
    #[error("{0} did not appear within {1:?} (is its driver loaded?)")]
    NoDevice(std::path::PathBuf, Duration),
    #[error(transparent)]
    Root(#[from] root::RootError),
    #[error(transparent)]
    System(#[from] system::SystemError),
    #[error("cgroup2: {0}")]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("imp.net: {0}")]
    Net(#[from] net::NetError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("start the async runtime: {0}")]
    Runtime(std::io::Error),
}

/// One console marker line. Never pass anything derived from Exec env here.
pub fn marker(stage: &str, detail: impl Display) {
    use std::io::Write;
    // Not println!: it panics when stdout is closed, and a panicking PID 1 panics the kernel.
    let _ = writeln!(std::io::stdout(), "IMP-GUEST stage={stage} {detail}");
}

/// The kernel opens /dev/console as PID 1's stdio only if the node exists in the initial root;
/// a minimal base image may lack it. Once devtmpfs is mounted, attach whatever is missing.
fn ensure_console() {
    use std::os::fd::AsRawFd;
    // SAFETY: F_GETFD on small integer fds only queries them.
    let missing: Vec<i32> = (0..=2)
        .filter(|fd| unsafe { libc::fcntl(*fd, libc::F_GETFD) } < 0)
        .collect();
    if missing.is_empty() {
        return;
    }
    let Ok(console) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    else {
        return;
    };
    for fd in missing {
        // SAFETY: dup2 onto a closed standard fd; `console` stays open until the end of scope.
        unsafe { libc::dup2(console.as_raw_fd(), fd) };
    }
}

fn stage<T, E>(name: &str, f: impl FnOnce() -> Result<T, E>) -> Result<T, Pid1Error>
where
    E: Into<Pid1Error>,
{
    match f().map_err(Into::into) {
        Ok(v) => {
            marker(name, "ok");
            Ok(v)
        }
        Err(e) => {
            marker(name, format_args!("FAILED: {e}"));
            Err(e)
        }
    }
}

/// Run as PID 1. Never returns: ends in power-off (or reboot, see `imp.halt`).
pub fn run() -> ! {
    marker(
        "start",
        format_args!("imp-guest {}", env!("CARGO_PKG_VERSION")),
    );
    // A panic in PID 1 ends in a kernel panic; leave the reason on the console first.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        marker("panic", info);
        default_hook(info);
    }));
    let mut halt = HaltAction::PowerOff;
    match boot_and_serve(&mut halt) {
        Ok(reason) => marker("shutdown", format_args!("reason={reason:?}")),
        Err(e) => marker("boot", format_args!("FAILED, powering off: {e}")),
    }
    power_off(&halt)
}

fn boot_and_serve(halt: &mut HaltAction) -> Result<ShutdownReason, Pid1Error> {
    let root = Path::new("/");
    let early = mounts::mount_all(root, mounts::EARLY);
    ensure_console();
    stage("mount-early", || early)?;
    let text = std::fs::read_to_string("/proc/cmdline").map_err(|e| {
        marker("cmdline", format_args!("FAILED: {e}"));
        Pid1Error::ReadCmdline(e)
    })?;
    // Only with an initrd from images/initrd/build.sh; a no-op (and no marker) otherwise.
    match modules::load_listed(root, &text) {
        Ok(None) => {}
        Ok(Some(done)) => marker(
            "modules",
            format_args!(
                "ok loaded={} already-present={}",
                done.loaded.join(","),
                done.present.join(",")
            ),
        ),
        Err(e) => {
            marker("modules", format_args!("FAILED: {e}"));
            return Err(e.into());
        }
    }
    let cfg: BootConfig = stage("cmdline", || cmdline::parse(&text))?;
    *halt = cfg.halt.clone();
    for key in &cfg.unknown_keys {
        marker("cmdline", format_args!("ignoring unknown key {key}"));
    }
    if let Some(ov) = &cfg.overlay {
        stage("overlay-root", || -> Result<(), Pid1Error> {
            for dev in ov.lower.iter().chain([&ov.upper]) {
                wait_for_device(dev, DEVICE_WAIT)?;
            }
            let upper = root::Upper {
                source: ov.upper.clone(),
                fstype: ov.upper_fstype.clone(),
            };
            let newroot =
                root::assemble(Path::new("/run/imp"), &root::Lower::from_config(ov), &upper)?;
            root::switch_root(&newroot, &["/proc", "/sys", "/dev"])?;
            Ok(())
        })?;
    }
    stage("mount-late", || mounts::mount_all(root, mounts::LATE))?;
    // For the job's container engine; fatal like the other mounts: a guest that says it is
    // ready must be able to run dockerd.
    match cgroup::setup(root) {
        Ok(d) => marker(
            "cgroup",
            format_args!("ok delegated={}", d.enabled.join(",")),
        ),
        Err(e) => {
            marker("cgroup", format_args!("FAILED: {e}"));
            return Err(e.into());
        }
    }
    check_clock();
    stage("loopback", system::loopback_up)?;
    if let Some(netcfg) = &cfg.net {
        stage("network", || -> Result<(), Pid1Error> {
            // Before the agent's runtime exists; a throwaway one keeps the stages in order.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(Pid1Error::Runtime)?;
            rt.block_on(net::configure(net::GUEST_INTERFACE, netcfg, net::LINK_WAIT))?;
            Ok(())
        })?;
    }
    if let Some(name) = &cfg.hostname {
        stage("hostname", || system::set_hostname(name))?;
    }
    if !cfg.dns.is_empty() {
        stage("resolv-conf", || {
            system::write_resolv_conf(root, &cfg.dns, &cfg.dns_search)
        })?;
    }
    // Ctrl-Alt-Del (Firecracker's SendCtrlAltDel) becomes SIGINT to PID 1 instead of an
    // immediate reboot, so it goes through the orderly shutdown below.
    let _ = nix::sys::reboot::set_cad_enabled(false);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(Pid1Error::Runtime)?;
    runtime.block_on(async {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "unknown".into());
        let agent = Agent::start(AgentConfig {
            boot_id: boot_id.clone(),
            report_grace: cfg.report_grace,
            metrics_root: root.to_owned(),
            identity: Some(crate::agent::identity::IdentityConfig::guest()),
        })?;
        let listener = stage("agent-listen", || Listener::bind_vsock(cfg.vsock_port))?;
        marker(
            "ready",
            format_args!("agent on vsock port {}", cfg.vsock_port),
        );
        // The host learns it now rather than at its next connect attempt.
        tokio::spawn(async move {
            let to = Announce::Vsock(READY_VSOCK_PORT);
            match announce(&to, &boot_id).await {
                Ok(()) => marker("announce", format_args!("ok host port {READY_VSOCK_PORT}")),
                Err(e) => marker(
                    "announce",
                    format_args!("not heard on host port {READY_VSOCK_PORT}: {e}"),
                ),
            }
        });
        let reason = serve_until_signal(&agent, listener).await;
        terminate_everything(agent.execs()).await;
        Ok(reason)
    })
}

/// Say what time the guest thinks it is (and where the kernel got it); a clock before
/// [`system::CLOCK_FLOOR_UNIX`] is a warning, not fatal: jobs without TLS still run.
fn check_clock() {
    let unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let source = system::clocksource();
    match system::check_clock(unix) {
        system::Clock::Plausible { unix } => marker(
            "clock",
            format_args!("ok now={} clocksource={source}", system::rfc3339(unix)),
        ),
        system::Clock::BeforeFloor { unix } => marker(
            "clock",
            format_args!(
                "WARNING: now={} is before {}: TLS certificate checks in jobs will fail (clocksource={source})",
                system::rfc3339(unix),
                system::rfc3339(system::CLOCK_FLOOR_UNIX)
            ),
        ),
    }
}

/// How long the overlay stage waits for its drives to show up in devtmpfs.
const DEVICE_WAIT: Duration = Duration::from_secs(10);

/// Drivers loaded as modules may register their disks a moment after loading; wait for a
/// /dev node rather than fail at once. Anything outside /dev (e.g. "tmpfs") is not waited for.
fn wait_for_device(path: &Path, limit: Duration) -> Result<(), Pid1Error> {
    if !path.starts_with("/dev") {
        return Ok(());
    }
    let start = std::time::Instant::now();
    while !path.exists() {
        if start.elapsed() >= limit {
            return Err(Pid1Error::NoDevice(path.to_owned(), limit));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Serve until the agent asks to stop or SIGTERM/SIGINT arrives.
pub async fn serve_until_signal(
    agent: &std::sync::Arc<Agent>,
    listener: Listener,
) -> ShutdownReason {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install SIGTERM/SIGINT handlers; serving without them");
        return agent.serve(listener).await;
    };
    tokio::select! {
        reason = agent.serve(listener) => reason,
        _ = term.recv() => ShutdownReason::Signal(libc::SIGTERM),
        _ = int.recv() => ShutdownReason::Signal(libc::SIGINT),
    }
}

/// As PID 1: SIGTERM everything, give it [`KILL_GRACE`], SIGKILL the rest, reap, sync.
async fn terminate_everything(execs: &ExecTable) {
    // kill(-1) from PID 1 reaches every process but itself.
    let _ = kill(Pid::from_raw(-1), Signal::SIGTERM);
    let deadline = tokio::time::Instant::now() + KILL_GRACE;
    while execs.reap() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while execs.reap() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    nix::unistd::sync();
}

fn power_off(halt: &HaltAction) -> ! {
    use nix::sys::reboot::{RebootMode, reboot};
    nix::unistd::sync();
    let mode = match halt {
        HaltAction::PowerOff => RebootMode::RB_POWER_OFF,
        HaltAction::Reboot => RebootMode::RB_AUTOBOOT,
    };
    marker("poweroff", format_args!("{mode:?}"));
    let Err(e) = reboot(mode);
    marker("poweroff", format_args!("FAILED: {e}"));
    // PID 1 must not exit; park forever if the kernel refused.
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}
