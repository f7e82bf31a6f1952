//! runbooks/: every runnable ` ```sh ` block runs against a real API server; every block, shown ones
//! included, has kubectl and helm command lines the real binaries parse and uses only paths created
//! before (runbook_lint); every reason Imp writes has a section in failures.md. Conventions (markers,
//! variables): runbooks/README.md.

mod runbook_lint;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use imp_api::names::reason;
use imp_testkit::{
    controlplane::{ControlPlane, ControlPlaneOptions},
    paths,
    runbook::{Block, sh_blocks},
};
use sha2::{Digest, Sha256};

/// The pages in the order an operator follows them (Day 2 reuses Day 0's values file).
const PAGES: &[&str] = &[
    "day0-install.md",
    "day1-operations.md",
    "day2-upgrades.md",
    "failures.md",
    "job-queued.md",
    "uninstall.md",
];
fn runbooks_dir() -> PathBuf {
    paths::workspace_root().join("runbooks")
}

fn all_blocks() -> Vec<Block> {
    let mut blocks = Vec::new();
    for page in PAGES {
        let path = runbooks_dir().join(page);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        blocks.extend(sh_blocks(page, &text).unwrap_or_else(|e| panic!("runbooks/{e}")));
    }
    blocks
}

/// The variables of runbooks/README.md's table: the operator sets them, so a path they hold is theirs.
const SUPPLIED: &[&str] = &[
    "CHART",
    "IMP_VERSION",
    "OPERATOR_DIGEST",
    "AGENT_DIGEST",
    "RUNTIME_DIGEST",
    "NODE",
    "APP_ID",
    "INSTALLATION_ID",
    "APP_KEY",
    "WEBHOOK_SECRET",
    "GITHUB_ORG",
    "RUNNER_BASE_IMAGE",
    "RUNNER_IMAGE",
];

/// Every block, run or shown: kubectl and helm parse each command line (unknown flags and commands
/// fail), and each path a command reads or writes into was created before on the pages.
#[test]
fn every_command_line_parses_and_every_path_exists() {
    let bin = paths::testenv_bin_dir();
    // `kubectl imp ...` lines are parsed by the workspace's plugin, as the run blocks use it.
    let plugin = imp_testkit::bins::ensure_built(
        &[("kubectl-imp", "kubectl-imp")],
        &["kubectl-imp/src", "kubectl-imp/Cargo.toml", "api/src"],
    )
    .expect("building kubectl-imp");
    let plugin_dir = plugin[0]
        .parent()
        .expect("a binary's directory")
        .to_path_buf();
    let mut flags = runbook_lint::FlagChecker::new(&bin, &[plugin_dir]);
    // The check is not vacuous: the binaries refuse what the issue found.
    for bad in [
        "kubectl -n imp-system logs -l app=x --field-selector spec.nodeName=n",
        "helm install imp ./c --no-such-flag",
    ] {
        let cmd = &runbook_lint::commands(bad).unwrap()[0];
        assert!(flags.check(cmd).is_err(), "{bad} was accepted");
    }
    let mut tracker = runbook_lint::PathTracker::new(&paths::workspace_root(), SUPPLIED);
    let mut errors = Vec::new();
    let mut checked = 0;
    for b in all_blocks() {
        let cmds = match runbook_lint::commands(&b.script) {
            Ok(c) => c,
            Err(e) => {
                errors.push(format!("runbooks/{}:{}: {e}", b.page, b.line));
                continue;
            }
        };
        for c in cmds {
            let at = format!("runbooks/{}:{}", b.page, b.line + c.line);
            if let Err(e) = flags.check(&c) {
                errors.push(format!("{at}: `{}`: {e}", c.argv.join(" ")));
            }
            if let Err(e) = tracker.apply(&c) {
                errors.push(format!("{at}: {e}"));
            }
            checked += 1;
        }
    }
    assert!(
        errors.is_empty(),
        "runbook commands:\n{}",
        errors.join("\n")
    );
    assert!(checked >= 50, "only {checked} commands found");
    println!("checked {checked} runbook commands");
}

#[test]
fn every_reason_has_a_failure_section() {
    let path = runbooks_dir().join("failures.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let missing: Vec<&str> = reason::ALL
        .iter()
        .map(|r| r.value)
        .filter(|v| !text.lines().any(|l| l == format!("### `{v}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "runbooks/failures.md has no `### `Reason`` section for {missing:?} (imp_api::names::reason::ALL)"
    );
}

#[test]
fn markers_are_checked() {
    let ok = "```sh\nkubectl get ns\n```\n```sh needs-github\ngh api /\n```\n```yaml\na: 1\n```\n";
    let blocks = sh_blocks("p.md", ok).unwrap();
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0].needs, None);
    assert_eq!(blocks[0].script, "kubectl get ns\n");
    assert_eq!(blocks[1].needs.as_deref(), Some("needs-github"));
    let err = sh_blocks("p.md", "text\n```sh needs-cloud\nx\n```\n").unwrap_err();
    assert!(err.starts_with("p.md:2:"), "{err}");
    assert!(sh_blocks("p.md", "```sh\nx\n").is_err());
}

/// The Prometheus Operator's CRDs (kind, plural), reduced to what lets the chart's monitors and
/// PrometheusRule be stored: a cluster with the Prometheus Operator has the full ones.
const PROMETHEUS_OPERATOR_KINDS: &[(&str, &str)] = &[
    ("ServiceMonitor", "servicemonitors"),
    ("PodMonitor", "podmonitors"),
    ("PrometheusRule", "prometheusrules"),
];

/// The fixture objects: those CRDs and the Node the pages call worker-1 (runbooks/README.md).
fn fixture_yaml() -> String {
    let mut out = String::from("apiVersion: v1\nkind: Node\nmetadata: {name: worker-1}\n");
    for (kind, plural) in PROMETHEUS_OPERATOR_KINDS {
        let singular = kind.to_lowercase();
        out.push_str(&format!(
            "---\napiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\n\
             metadata: {{name: {plural}.monitoring.coreos.com}}\nspec:\n  group: monitoring.coreos.com\n  \
             scope: Namespaced\n  names: {{kind: {kind}, listKind: {kind}List, plural: {plural}, singular: {singular}}}\n  \
             versions:\n    - {{name: v1, served: true, storage: true, schema: {{openAPIV3Schema: {{type: object, \
             x-kubernetes-preserve-unknown-fields: true}}}}}}\n"
        ));
    }
    out
}

fn digest_of(s: &str) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(s.as_bytes())))
}

fn chart_version() -> String {
    let chart = std::fs::read_to_string(paths::chart_dir().join("Chart.yaml")).unwrap();
    chart
        .lines()
        .find_map(|l| l.strip_prefix("version:"))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .expect("helm/imp/Chart.yaml has a version")
}

/// bash with the runbooks' variables (runbooks/README.md), testenv/bin and the `kubectl imp` plugin
/// (kubectl-imp, built if stale) first on PATH, in `work`.
fn shell(work: &Path, kubeconfig: &Path) -> Command {
    let mut cmd = Command::new("bash");
    let plugin = imp_testkit::bins::ensure_built(
        &[("kubectl-imp", "kubectl-imp")],
        &["kubectl-imp/src", "kubectl-imp/Cargo.toml", "api/src"],
    )
    .expect("building kubectl-imp");
    let path = format!(
        "{}:{}:{}",
        paths::testenv_bin_dir().display(),
        plugin[0].parent().expect("a binary's directory").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    cmd.current_dir(work)
        .env("PATH", path)
        .env("KUBECONFIG", kubeconfig)
        .env("HELM_CACHE_HOME", work.join(".helm/cache"))
        .env("HELM_CONFIG_HOME", work.join(".helm/config"))
        .env("HELM_DATA_HOME", work.join(".helm/data"))
        .env("CHART", paths::chart_dir())
        .env("IMP_VERSION", chart_version())
        .env("OPERATOR_DIGEST", digest_of("imp-operator"))
        .env("AGENT_DIGEST", digest_of("imp-agent"))
        .env("RUNTIME_DIGEST", digest_of("imp-runtime"))
        .env("NODE", "worker-1")
        .env("APP_ID", "123456")
        .env("INSTALLATION_ID", "7890123")
        .env("APP_KEY", work.join("imp-app.private-key.pem"))
        .env("WEBHOOK_SECRET", uuid::Uuid::new_v4().simple().to_string())
        .env("GITHUB_ORG", "acme")
        .env(
            "RUNNER_BASE_IMAGE",
            format!(
                "registry.example/acme/runner-base@{}",
                digest_of("runner-base")
            ),
        )
        .env(
            "RUNNER_IMAGE",
            format!(
                "registry.example/acme/actions-runner@{}",
                digest_of("actions-runner")
            ),
        );
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn runnable_commands_run_against_the_test_control_plane() {
    let blocks = all_blocks();
    let mut opts = ControlPlaneOptions::in_temp_dir();
    // The chart installs Imp's CRDs (crds/), as on a real cluster.
    opts.install_imp_crds = false;
    let cp = ControlPlane::start(opts)
        .await
        .expect("start the control plane");
    let work = tempfile::tempdir().unwrap();
    // Not a key GitHub issued: the Secret's content is never checked without GitHub.
    std::fs::write(
        work.path().join("imp-app.private-key.pem"),
        "-----BEGIN RSA PRIVATE KEY-----\ntest\n-----END RSA PRIVATE KEY-----\n",
    )
    .unwrap();
    let mut fixture = shell(work.path(), cp.kubeconfig_path());
    let out = fixture
        .args(["-c", "printf '%s' \"$0\" | kubectl apply -f -"])
        .arg(fixture_yaml())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "fixture: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let crds: Vec<String> = PROMETHEUS_OPERATOR_KINDS
        .iter()
        .map(|(_, plural)| format!("crd/{plural}.monitoring.coreos.com"))
        .collect();
    let wait = format!(
        "kubectl wait --for=condition=Established --timeout=60s {}",
        crds.join(" ")
    );
    let out = shell(work.path(), cp.kubeconfig_path())
        .args(["-c", &wait])
        .output()
        .unwrap();
    assert!(out.status.success(), "fixture CRDs: {out:?}");

    let (mut ran, mut shown) = (0, Vec::new());
    for b in &blocks {
        if let Some(needs) = &b.needs {
            shown.push(format!("{}:{} ({needs})", b.page, b.line));
            continue;
        }
        let out = shell(work.path(), cp.kubeconfig_path())
            .args(["-euo", "pipefail", "-c", &b.script])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "runbooks/{}:{}: the block exited {}\n--- block\n{}--- stdout\n{}--- stderr\n{}",
            b.page,
            b.line,
            out.status,
            b.script,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ran += 1;
    }
    println!(
        "ran {ran} runbook blocks; {} need more than the test control plane: {}",
        shown.len(),
        shown.join(", ")
    );
    assert!(ran >= 10, "only {ran} runnable blocks found in {PAGES:?}");
    for page in PAGES.iter().filter(|p| **p != "failures.md") {
        assert!(
            blocks.iter().any(|b| b.page == *page && b.needs.is_none()),
            "runbooks/{page} has no runnable block"
        );
    }
}
