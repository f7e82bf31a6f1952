//! The boot's last wait, the same for every backend: the guest agent's Hello through the
//! hybrid vsock, with the VM and its console watched so a dead or panicked guest fails at once.

use std::path::Path;
use std::time::Duration;

use imp_guest::host::Announcements;
use imp_guest::protocol::{AGENT_VSOCK_PORT, Hello};
use tokio::time::Instant;

use super::error::DriverError;
use super::serial;

/// How often the boot wait looks at the process and the serial console.
const WATCH: Duration = Duration::from_millis(100);
const PANIC_MARKER: &str = "Kernel panic";

/// How [`wait_for_hello`] learns that the guest agent listens.
pub enum Detect<'a> {
    /// The guest's announcement (bound before the VM started, see [`listen_for_announcements`])
    /// triggers the connect at once; the backoff stays as the fallback.
    Announced(&'a mut Announcements),
    /// The connect's backoff (20 ms doubling to 500 ms) finds it.
    Backoff,
    /// A guest resumed from a snapshot: its agent listened before the snapshot and answers as
    /// soon as its vsock is back, so the connect is attempted every few milliseconds
    /// (`imp_guest::host::connect_resumed`).
    Resumed,
}

/// Wait for the guest agent's Hello through the hybrid vsock until `deadline`, watching the
/// VM and its serial console so a dead or panicked guest fails at once. The answer after `OK`
/// is opaque (Firecracker names a host port, vhost-device-vsock the guest's).
pub async fn wait_for_hello(
    vsock: &Path,
    serial_log: &Path,
    alive: impl Fn() -> bool,
    deadline: Instant,
    detect: Detect<'_>,
) -> Result<Hello, DriverError> {
    let connect = async {
        match detect {
            Detect::Announced(a) => {
                imp_guest::host::connect_announced(vsock, AGENT_VSOCK_PORT, a, deadline).await
            }
            Detect::Backoff => imp_guest::host::connect(vsock, AGENT_VSOCK_PORT, deadline).await,
            Detect::Resumed => {
                imp_guest::host::connect_resumed(vsock, AGENT_VSOCK_PORT, deadline).await
            }
        }
    };
    let watch = async {
        loop {
            tokio::time::sleep(WATCH).await;
            let console = serial::tail(serial_log);
            if console.contains(PANIC_MARKER) {
                return DriverError::GuestPanicked {
                    serial_tail: console,
                };
            }
            if !alive() {
                return DriverError::GuestExited {
                    serial_tail: console,
                };
            }
        }
    };
    tokio::select! {
        r = connect => match r {
            Ok(client) => Ok(client.hello().clone()),
            Err(imp_guest::host::HostError::Timeout { last, .. }) => Err(DriverError::GuestAgentTimeout {
                detail: last,
                serial_tail: serial::tail(serial_log),
            }),
            Err(e) => Err(DriverError::GuestProtocol(e.to_string())),
        },
        e = watch => Err(e),
    }
}

/// Listen for the guest's announcement of VM `vsock` before the VMM starts. `owner` is the
/// confined VMM's uid: the VMM (not the runtime) connects to the socket for the guest, so it must
/// be the VMM's to write; nobody else's (0600 in the VM's own directory). A failure costs only
/// latency (the connect's backoff finds the guest), so it is logged, not fatal.
pub fn listen_for_announcements(vsock: &Path, owner: Option<u32>) -> Option<Announcements> {
    let bound = Announcements::bind(vsock).and_then(|a| {
        if let Some(uid) = owner {
            std::os::unix::fs::chown(a.path(), Some(uid), Some(uid))?;
        }
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(a.path(), std::fs::Permissions::from_mode(0o600))?;
        Ok(a)
    });
    match bound {
        Ok(a) => Some(a),
        Err(e) => {
            tracing::warn!(vsock = %vsock.display(), error = %e, "cannot listen for the guest's announcement; finding it by polling");
            None
        }
    }
}
