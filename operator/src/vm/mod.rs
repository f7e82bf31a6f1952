//! The ImpVM lifecycle: pure health and decision code ([`health`], [`decide`]), configuration, and the
//! controller that executes decisions against the API server. See docs/vm-lifecycle.md.

pub mod config;
pub mod controller;
pub mod decide;
pub mod health;

pub use config::{Timing, VmControllerConfig};
pub use controller::run_vm_controller;
