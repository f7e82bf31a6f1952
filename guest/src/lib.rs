//! imp-guest: the host<->guest protocol (shared with imp-node and the testkit simulator) and,
//! behind the binary, the guest's PID 1 and vsock agent.

#[cfg(feature = "guest")]
pub mod agent;
pub mod frame;
pub mod host;
pub mod hybrid;
#[cfg(feature = "guest")]
pub mod pid1;
pub mod protocol;
