//! Which jobs a pool's runners can take. GitHub gives every self-hosted runner default labels
//! (`self-hosted`, its OS, its architecture; JIT-configured runners too) and hands a job to a runner
//! whose labels include every label of the job, compared case-insensitively. Imp's runners are Linux
//! x86_64 guests, so a pool serves a job whose labels are all among the pool's `spec.github.labels`
//! plus [`DEFAULT_RUNNER_LABELS`]. The smoke's preflight (smoke/cluster.py, `pool_serves`) applies the
//! same rule; a test here runs both on one table so they cannot drift.

/// The labels GitHub adds to every Imp runner: `self-hosted`, the OS and the architecture.
pub const DEFAULT_RUNNER_LABELS: [&str; 3] = ["self-hosted", "linux", "x64"];

/// Does a runner of a pool with `pool` labels take a job asking for `job`: every job label is one of
/// the pool's or a default label. A job without labels is never routed (GitHub always sends some).
pub fn pool_serves(job: &[String], pool: &[String]) -> bool {
    !job.is_empty()
        && job.iter().all(|j| {
            DEFAULT_RUNNER_LABELS
                .iter()
                .any(|d| d.eq_ignore_ascii_case(j))
                || pool.iter().any(|p| p.eq_ignore_ascii_case(j))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    /// (job labels, pool labels, served).
    const CASES: &[(&[&str], &[&str], bool)] = &[
        (&["self-hosted", "linux", "x64", "imp"], &["imp"], true),
        (&["self-hosted", "imp"], &["imp"], true),
        (&["imp"], &["imp"], true),
        (&["Self-Hosted", "Linux", "X64", "IMP"], &["imp"], true),
        (
            &["self-hosted", "IMP"],
            &["self-hosted", "imp", "linux"],
            true,
        ),
        (&["self-hosted", "linux", "arm64", "imp"], &["imp"], false),
        (&["self-hosted", "linux", "ARM64", "imp"], &["imp"], false),
        (&["self-hosted", "windows", "imp"], &["imp"], false),
        (&["imp", "gpu"], &["imp", "linux"], false),
        (&["self-hosted", "linux", "x64"], &["imp"], true),
        (&["imp"], &["gpu"], false),
        (&[], &["imp"], false),
        (&["arm64"], &["arm64"], true),
    ];

    #[test]
    fn a_pool_serves_its_labels_plus_the_defaults_case_insensitively() {
        for (job, pool, served) in CASES {
            assert_eq!(
                pool_serves(&s(job), &s(pool)),
                *served,
                "job {job:?} pool {pool:?}"
            );
        }
    }

    /// smoke/cluster.py's preflight decides the same on every case, with the same defaults.
    #[test]
    fn the_smoke_preflight_agrees() {
        let smoke = concat!(env!("CARGO_MANIFEST_DIR"), "/../smoke");
        let cases: Vec<_> = CASES.iter().map(|(j, p, _)| (j, p)).collect();
        let script = format!(
            "import json, sys; sys.path.insert(0, {smoke:?}); import cluster\n\
             cases = json.loads(sys.stdin.read())\n\
             print(json.dumps({{'defaults': sorted(cluster.DEFAULT_RUNNER_LABELS),\n\
             'served': [cluster.pool_serves(j, p) for j, p in cases]}}))"
        );
        let mut child = std::process::Command::new("python3")
            .args(["-c", &script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 (the smoke needs it) runs");
        serde_json::to_writer(child.stdin.take().unwrap(), &cases).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "python3 failed: {out:?}");
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut defaults = DEFAULT_RUNNER_LABELS.to_vec();
        defaults.sort();
        assert_eq!(got["defaults"], serde_json::json!(defaults));
        let want: Vec<bool> = CASES.iter().map(|c| c.2).collect();
        assert_eq!(got["served"], serde_json::json!(want));
    }
}
