//! The simulator's runner protocol: the runner side lives in the slim `imp-fake-runner` crate (its
//! binary runs inside real guests); this module re-exports it and reads the completed job as the
//! simulator's [`SimJob`], so tests can run a fake runner in-process.

use super::jobs::SimJob;

pub use imp_fake_runner::{
    DEFAULT_RUNNER_VERSION, FakeRunnerOptions, JITCONFIG_ENV, JitConfigPayload, URL_OVERRIDE_ENV,
    VersionDeprecated,
};

/// Runs one fake runner like `actions/runner --jitconfig`: connect, take one matching job, report
/// completion. Returns the job it ran.
pub async fn run_fake_runner(encoded: &str, opts: &FakeRunnerOptions) -> anyhow::Result<SimJob> {
    Ok(serde_json::from_value(
        imp_fake_runner::run(encoded, opts).await?,
    )?)
}
