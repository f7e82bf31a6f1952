//! Why a boot failed, whichever backend ran it.

use std::path::PathBuf;

use imp_api::names::reason;

/// Why a VM did not come up (or could not be driven). `reason()` is the stable label used in
/// the runtime API, inventory and metrics.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("kernel image {0} does not exist")]
    KernelMissing(PathBuf),
    #[error("Firecracker failed to start: {message}; stderr: {stderr}")]
    FirecrackerStartFailed { message: String, stderr: String },
    #[error("guest kernel panicked; serial log tail: {serial_tail}")]
    GuestPanicked { serial_tail: String },
    #[error(
        "Firecracker exited during boot (exit without a panic); serial log tail: {serial_tail}"
    )]
    GuestExited { serial_tail: String },
    #[error("guest agent did not say Hello in time: {detail}; serial log tail: {serial_tail}")]
    GuestAgentTimeout { detail: String, serial_tail: String },
    #[error("guest agent refused the connection: {0}")]
    GuestProtocol(String),
}

impl DriverError {
    pub fn reason(&self) -> &'static str {
        match self {
            DriverError::KernelMissing(_) => reason::KERNEL_MISSING,
            DriverError::FirecrackerStartFailed { .. } => reason::FIRECRACKER_START_FAILED,
            DriverError::GuestPanicked { .. } => reason::GUEST_PANICKED,
            DriverError::GuestExited { .. } => reason::GUEST_EXITED,
            DriverError::GuestAgentTimeout { .. } => reason::GUEST_AGENT_TIMEOUT,
            DriverError::GuestProtocol(_) => reason::GUEST_PROTOCOL_ERROR,
        }
    }
}
