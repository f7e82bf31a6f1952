//! The agent's settings (flags and environment of the binary, docs/agent.md "Configuration").

use std::path::PathBuf;
use std::time::Duration;

use super::capacity;

/// Where the runner image keeps the GitHub runner (images/runner/build.sh).
pub const DEFAULT_RUNNER_DIR: &str = "/opt/actions-runner";

/// Default runner program inside the guest (the runner image's entry point).
pub const DEFAULT_RUNNER_COMMAND: &str = "/usr/local/bin/imp-runner";

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node_name: String,
    /// Namespace of the heartbeat Lease (the operator's).
    pub lease_namespace: String,
    pub runtime_socket: PathBuf,
    pub heartbeat_interval: Duration,
    /// The node's capacity for VMs as published on its Node (flags; the rest from the host).
    pub capacity: capacity::CapacityConfig,
    /// Program started in the guest for runner VMs (argv[0]; the config goes in the environment).
    pub runner_command: String,
    /// Upper bound between two reconciles of a bound VM (runtime state is polled).
    pub poll_interval: Duration,
    /// How often runtime VMs no longer bound here are looked for.
    pub sweep_interval: Duration,
    /// How long one request to a guest (an Exec, a probe, a metrics query) may go unanswered
    /// before the guest counts as unresponsive.
    pub guest_answer_timeout: Duration,
    /// How often a Running VM's guest is asked for its memory and disk use.
    pub guest_metrics_interval: Duration,
    /// Guest paths a standby pool's template reads into its page cache before its snapshot
    /// (the runtime spec's `warm_paths`, [`template_warm_paths`]); also in its Template VMs'
    /// specs, so both key the same template.
    pub template_warm_paths: Vec<String>,
    /// `desiredState: ScaleToZero` is honoured (IMP_SCALE_TO_ZERO=true; experimental, not
    /// hardware-validated). Otherwise such a VM keeps running and its condition says why.
    pub scale_to_zero: bool,
}

impl AgentConfig {
    pub fn new(node_name: impl Into<String>, runtime_socket: impl Into<PathBuf>) -> Self {
        Self {
            node_name: node_name.into(),
            lease_namespace: "imp-system".into(),
            runtime_socket: runtime_socket.into(),
            heartbeat_interval: Duration::from_secs(10),
            capacity: capacity::CapacityConfig::default(),
            runner_command: DEFAULT_RUNNER_COMMAND.into(),
            template_warm_paths: template_warm_paths(true, &[], DEFAULT_RUNNER_COMMAND)
                .expect("the defaults are valid"),
            poll_interval: Duration::from_secs(5),
            sweep_interval: Duration::from_secs(15),
            guest_answer_timeout: imp_guest::host::DEFAULT_ANSWER_TIMEOUT,
            guest_metrics_interval: Duration::from_secs(30),
            scale_to_zero: false,
        }
    }
}

/// The paths templates warm: `given` (`--template-warm-path`), else the runner's directory and
/// the runner command (when it is a path: a bare name is looked up in the guest's PATH); none
/// when warming is off. Each must pass the guest's rule (absolute, no `..`), else the error
/// names it.
pub fn template_warm_paths(
    warm: bool,
    given: &[String],
    runner_command: &str,
) -> Result<Vec<String>, String> {
    if !warm {
        return Ok(Vec::new());
    }
    let paths: Vec<String> = if given.is_empty() {
        std::iter::once(DEFAULT_RUNNER_DIR)
            .chain(Some(runner_command).filter(|c| c.starts_with('/')))
            .map(str::to_owned)
            .collect()
    } else {
        given.to_vec()
    };
    if paths.len() > imp_guest::protocol::WARM_MAX_PATHS {
        return Err(format!(
            "--template-warm-path: at most {} paths",
            imp_guest::protocol::WARM_MAX_PATHS
        ));
    }
    for p in &paths {
        imp_guest::protocol::check_warm_path(p)
            .map_err(|why| format!("--template-warm-path {p:?}: {why}"))?;
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warm_paths_default_to_the_runner_and_are_checked() {
        assert_eq!(
            template_warm_paths(true, &[], DEFAULT_RUNNER_COMMAND).unwrap(),
            ["/opt/actions-runner", "/usr/local/bin/imp-runner"]
        );
        // A bare command is found through the guest's PATH: not a path to warm.
        assert_eq!(
            template_warm_paths(true, &[], "run.sh").unwrap(),
            ["/opt/actions-runner"]
        );
        let given = ["/srv/runner".to_string()];
        assert_eq!(
            template_warm_paths(true, &given, DEFAULT_RUNNER_COMMAND).unwrap(),
            given
        );
        assert!(template_warm_paths(false, &given, "x").unwrap().is_empty());
        let e = template_warm_paths(true, &["srv/../x".into()], "x").unwrap_err();
        assert!(e.starts_with("--template-warm-path \"srv/../x\": "), "{e}");
    }
}
