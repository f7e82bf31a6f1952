//! Restart policy of persistent VMs, set on an ImpVM or inherited from its ImpVMClass.

use std::time::Duration;

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

use crate::{FieldError, KubeDuration};

/// Default first delay before a restart.
pub const DEFAULT_INITIAL_DELAY: Duration = Duration::from_secs(10);
/// Default cap on the delay between restarts.
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(300);
/// Default retry budget before `onExhaustion` applies.
pub const DEFAULT_MAX_RETRIES: u32 = 5;

/// How a persistent VM is restarted after it stops or its node is lost.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("!has(self.onExhaustion) || self.onExhaustion != 'cool-down' || has(self.coolDownPeriod)")
    .message("coolDownPeriod is required when onExhaustion is cool-down").field_path(".coolDownPeriod"))]
pub struct RestartPolicy {
    /// `reschedule` clears the node binding so the scheduler may pick another node; `in-place` keeps the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<RestartMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff: Option<Backoff>,
    /// What happens when the retry budget is spent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_exhaustion: Option<OnExhaustion>,
    /// With `onExhaustion: cool-down`, the retry budget is reset this long after exhaustion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("duration(self) > duration('0s')").message("coolDownPeriod must be positive"))]
    pub cool_down_period: Option<KubeDuration>,
}

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum RestartMode {
    #[default]
    Reschedule,
    InPlace,
}

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum OnExhaustion {
    /// Stay failed (phase RetryExhausted) until the object is changed or deleted.
    #[default]
    Fail,
    /// Reset the retry budget after `coolDownPeriod`.
    CoolDown,
    /// Reset the retry budget when the annotation `imp.dev/reset-restarts` is set.
    ManualReset,
}

/// Exponential backoff: delay n = min(initialDelay * 2^n, maxDelay), at most maxRetries restarts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("!has(self.initialDelay) || !has(self.maxDelay) || duration(self.initialDelay) <= duration(self.maxDelay)")
    .message("initialDelay must not exceed maxDelay").field_path(".initialDelay"))]
pub struct Backoff {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_retries: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("duration(self) > duration('0s')").message("initialDelay must be positive"))]
    pub initial_delay: Option<KubeDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("duration(self) > duration('0s')").message("maxDelay must be positive"))]
    pub max_delay: Option<KubeDuration>,
}

/// A restart policy with every default filled in and every duration parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedRestartPolicy {
    pub mode: RestartMode,
    pub max_retries: u32,
    pub initial_delay: Duration,
    pub max_delay: Duration,
    pub on_exhaustion: OnExhaustion,
    pub cool_down_period: Option<Duration>,
}

impl RestartPolicy {
    /// Fills defaults and parses durations; `field` is the path of this policy for error messages.
    pub fn resolve(&self, field: &str) -> Result<ResolvedRestartPolicy, FieldError> {
        let backoff = self.backoff.clone().unwrap_or_default();
        let dur = |v: &Option<KubeDuration>,
                   name: &str,
                   default: Duration|
         -> Result<Duration, FieldError> {
            match v {
                None => Ok(default),
                Some(d) => d
                    .parse()
                    .map_err(|e| FieldError::duration(format!("{field}.backoff.{name}"), e)),
            }
        };
        let cool_down_period = match &self.cool_down_period {
            None => None,
            Some(d) => Some(
                d.parse()
                    .map_err(|e| FieldError::duration(format!("{field}.coolDownPeriod"), e))?,
            ),
        };
        Ok(ResolvedRestartPolicy {
            mode: self.mode.unwrap_or_default(),
            max_retries: backoff.max_retries.unwrap_or(DEFAULT_MAX_RETRIES),
            initial_delay: dur(
                &backoff.initial_delay,
                "initialDelay",
                DEFAULT_INITIAL_DELAY,
            )?,
            max_delay: dur(&backoff.max_delay, "maxDelay", DEFAULT_MAX_DELAY)?,
            on_exhaustion: self.on_exhaustion.unwrap_or_default(),
            cool_down_period,
        })
    }
}
