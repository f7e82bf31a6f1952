//! The simulator's runner registry writes: a runner registered by `generate-jitconfig` or by a
//! scale set's `generatejitconfig`, with its one-time credential and encoded JIT config.

use super::jobs::random_token;
use super::model::{Model, SimRunner, SimScope};
use super::runner_protocol::JitConfigPayload;

/// GitHub adds the default labels of a self-hosted runner (`self-hosted`, its OS, its architecture)
/// to the custom ones a JIT config asks for; the simulated runners run Linux on x64.
fn with_default_labels(custom: &[String]) -> Vec<String> {
    let mut out: Vec<String> = ["self-hosted", "Linux", "X64"].map(String::from).to_vec();
    for l in custom {
        if !out.iter().any(|o| o.eq_ignore_ascii_case(l)) {
            out.push(l.clone());
        }
    }
    out
}

/// Registers a runner (offline until it connects) and its one-time credential; returns it and its
/// encoded JIT config, or the name when a runner of that name exists in the scope. Used by
/// `generate-jitconfig` and by a scale set's `generatejitconfig`.
pub(super) fn register_runner(
    m: &mut Model,
    runner_url: String,
    scope: SimScope,
    name: &str,
    group_id: u64,
    labels: &[String],
    work_folder: &str,
) -> Result<(SimRunner, String), String> {
    if m.runners
        .values()
        .any(|r| r.scope == scope && r.name.eq_ignore_ascii_case(name))
    {
        return Err(name.to_string());
    }
    let id = m.next_runner_id;
    m.next_runner_id += 1;
    let runner = SimRunner {
        id,
        name: name.to_string(),
        scope,
        labels: with_default_labels(labels),
        runner_group_id: group_id,
        work_folder: work_folder.to_string(),
        status: "offline".into(),
        busy: false,
        job_id: None,
    };
    let credential = random_token(40);
    m.credentials.insert(credential.clone(), id);
    m.runners.insert(id, runner.clone());
    m.stats.jit_configs_issued += 1;
    let encoded = JitConfigPayload {
        url: runner_url,
        runner_id: id,
        runner_name: name.to_string(),
        labels: labels.to_vec(),
        work_folder: work_folder.to_string(),
        credential,
    }
    .encode();
    Ok((runner, encoded))
}
