//! pressureLifecycle (seed 001, opt-in: chart `pressureLifecycle.enabled`, `--pressure-lifecycle`): on a
//! node whose MemoryPressure condition is True, suspend its resident persistent ImpVMs, largest memory
//! first, one at a time, until the condition clears. Nothing is ever resumed automatically.
//!
//! The operator only sets `spec.desiredState: Suspended` (with [`ANNOTATION_PRESSURE_SUSPENDED_AT`] in the
//! same patch, so a suspend is the lifecycle's and not a user's); the node agent does the suspend and
//! reports Suspending, then Suspended. The next VM on that node is chosen only once the previous one
//! reports Suspended (or [`PressureConfig::suspend_timeout`] passed: a stuck suspend must not keep the
//! node under pressure for good). Each suspended VM gets an Event and the `PressureSuspended` condition
//! saying why and how to resume it (`spec.desiredState: Running`); a VM resumed by someone while the same
//! pressure lasts is not suspended again.
//!
//! Shape: [`decide`] (pure: the views of Nodes and VMs, and the [`Plan`](decide::Plan) of
//! [`Step`](decide::Step)s), [`controller`] (observe the caches into views, execute the steps),
//! [`config`]. Every write carries the resourceVersion it was decided on, so a stale cache costs a 409 and
//! a new pass, never a second VM.

pub mod config;
pub mod controller;
pub mod decide;

pub use config::PressureConfig;
pub use controller::run_pressure_lifecycle;
