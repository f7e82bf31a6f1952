//! Shared helpers of the GitHub client integration tests: every test starts its own simulator on
//! 127.0.0.1:0.
#![allow(dead_code)]

use std::time::Duration;

use imp_operator::github::{
    AppCredentials, GithubApp, GithubConfig, JitRequest, RetryPolicy, RunnerScope,
};
use imp_testkit::github::{GithubSim, KeyFormat, SimConfig};

pub async fn sim() -> GithubSim {
    sim_with(|_| {}).await
}

pub async fn sim_with(f: impl FnOnce(&mut SimConfig)) -> GithubSim {
    let mut cfg = SimConfig::default();
    f(&mut cfg);
    GithubSim::start(cfg).await.expect("simulator starts")
}

/// A client config for tests: short backoffs, a generous governor.
pub fn config(sim: &GithubSim) -> GithubConfig {
    GithubConfig {
        api_base_url: sim.base_url().to_string(),
        request_timeout: Duration::from_secs(5),
        retry: RetryPolicy {
            max_attempts: 4,
            base_delay: Duration::from_millis(20),
            max_delay: Duration::from_millis(200),
            max_rate_limit_wait: Duration::from_secs(5),
        },
        jit_mints_per_minute: 1_000_000,
        jit_mint_burst: 100_000,
        ..GithubConfig::default()
    }
}

pub fn creds(sim: &GithubSim, format: KeyFormat) -> AppCredentials {
    AppCredentials::from_string_data(&sim.secret_data(format)).expect("credentials load")
}

pub fn app(sim: &GithubSim) -> GithubApp {
    app_with(sim, config(sim))
}

pub fn app_with(sim: &GithubSim, cfg: GithubConfig) -> GithubApp {
    GithubApp::new(creds(sim, KeyFormat::Pkcs1), cfg).expect("client builds")
}

pub fn org(sim: &GithubSim) -> RunnerScope {
    RunnerScope::org(sim.org())
}

pub fn repo() -> RunnerScope {
    RunnerScope::repo("octo-org", "octo-repo")
}

pub fn jit(scope: RunnerScope, name: &str) -> JitRequest {
    JitRequest {
        scope,
        runner_name: name.to_string(),
        labels: vec!["self-hosted".into(), "imp".into(), "linux".into()],
        runner_group: None,
        work_folder: "_work".into(),
    }
}
