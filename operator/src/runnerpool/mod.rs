//! ImpVMRunnerPool: keeps the right number of ephemeral runner VMs, each with a one-time JIT config in a
//! Secret owned by its VM, and cleans up after every job. Pure parts: [`classify`] (what a runner VM is
//! doing), [`plan`] (how many runners), [`decide`] (the whole pass: mint policy, deadlines, the
//! registration reaper, status), [`demand`] (jobs from webhooks and the sweep), [`labels`] (which
//! jobs a pool's runners take), [`slo`] (which job a VM
//! served and how long it waited for each step), [`starts`] (booted or cloned, counted once). I/O: [`controller`]
//! (observe, execute, and the queued-job sweep). The webhook receiver is in [`crate::webhook`]. See
//! docs/runner-pool.md.

pub mod classify;
pub mod config;
pub mod controller;
pub mod decide;
pub mod demand;
pub mod freshness;
pub mod labels;
pub mod metrics;
pub mod plan;
pub mod shared;
pub mod slo;
pub mod starts;

pub use config::{DEFAULT_WEBHOOK_SECRET_KEY, PoolControllerConfig, PoolTiming, SecretKeySelector};
pub use controller::run_runnerpool_controller;
pub use demand::{Demand, DemandLimits, PoolKey};
pub use metrics::{PoolMetrics, STATES};
pub use shared::PoolShared;
