//! The GitHub client: App credentials from a Secret, App JWT -> installation token (cached,
//! single-flight), runner groups, JIT runner configs, runners, error classification, the JIT mint
//! governor and metrics. See docs/github.md.
//!
//! ```no_run
//! # async fn demo(secret: k8s_openapi::api::core::v1::Secret) -> Result<(), imp_operator::github::GithubError> {
//! use imp_operator::github::*;
//! let creds = AppCredentials::from_secret(&secret)?;
//! let app = GithubApp::new(creds, GithubConfig::default())?;
//! let scope = RunnerScope::org("octo-org");
//! let minted = app
//!     .generate_jit_config(&JitRequest {
//!         scope: scope.clone(),
//!         runner_name: runner_name("pool-a", "3f2b8c1e-77aa-4c1d-9e0f-0123456789ab"),
//!         labels: vec!["self-hosted".into(), "imp".into()],
//!         runner_group: None,
//!         work_folder: "_work".into(),
//!     })
//!     .await?;
//! app.delete_runner(&scope, minted.runner_id).await?;
//! # Ok(()) }
//! ```

pub mod app_auth;
pub mod apps;
pub mod budget;
pub mod client;
pub mod conditional;
pub mod credentials;
pub mod downloads;
pub mod errors;
pub mod governor;
pub mod jit;
pub mod jobs;
pub mod metrics;
pub mod retry;
pub mod runner_groups;
pub mod runners;
pub mod scope;

pub use app_auth::{AppClaims, mint_app_jwt};
pub use apps::GithubApps;
pub use budget::{IntervalCause, RateState, SweepBudget, next_sweep_interval};
pub use client::{GithubApp, GithubConfig};
pub use conditional::{CallCount, EtagCache};
pub use credentials::{
    AppCredentials, CredentialsError, KEY_APP_ID, KEY_INSTALLATION_ID, KEY_PRIVATE_KEY,
};
pub use downloads::{RunnerDownload, newest_linux_x64};
pub use errors::{ErrorClass, GithubError, Operation, RateLimitKind};
pub use governor::{MintGovernor, TokenBucket};
pub use jit::{JitRequest, JitRunner, runner_name};
pub use jobs::{SweepListing, WorkflowJob};
pub use metrics::GithubMetrics;
pub use retry::RetryPolicy;
pub use runner_groups::{DEFAULT_RUNNER_GROUP_ID, RunnerGroup};
pub use runners::{DeleteOutcome, Runner, RunnerLabel};
pub use scope::RunnerScope;
