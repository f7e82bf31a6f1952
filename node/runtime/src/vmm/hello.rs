//! The boot's last wait, the same for every backend: the guest agent's Hello through the
//! hybrid vsock, with the VM and its console watched so a dead or panicked guest fails at once.

use std::path::Path;
use std::time::Duration;

use imp_guest::protocol::{AGENT_VSOCK_PORT, Hello};
use tokio::time::Instant;

use super::error::DriverError;
use super::serial;

/// How often the boot wait looks at the process and the serial console.
const WATCH: Duration = Duration::from_millis(100);
const PANIC_MARKER: &str = "Kernel panic";

/// Wait for the guest agent's Hello through the hybrid vsock until `deadline`, watching the
/// VM and its serial console so a dead or panicked guest fails at once. The answer after `OK`
/// is opaque (Firecracker names a host port, vhost-device-vsock the guest's).
pub async fn wait_for_hello(
    vsock: &Path,
    serial_log: &Path,
    alive: impl Fn() -> bool,
    deadline: Instant,
) -> Result<Hello, DriverError> {
    let connect = imp_guest::host::connect(vsock, AGENT_VSOCK_PORT, deadline);
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
