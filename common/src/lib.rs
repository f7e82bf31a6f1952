//! Building blocks every Imp crate shares, so each exists once: the exponential [`backoff`], the
//! [`secret`] string type, and the [`telemetry`] start-up of the binaries (log flags, log format,
//! the shutdown signal).

pub mod backoff;
pub mod secret;
pub mod telemetry;

pub use backoff::Backoff;
pub use secret::{ExposeSecret, SecretString};
