//! Every YAML example from the design documents (reference/seed-examples) against the real API
//! server: each object file is applied verbatim with kubectl and accepted (or, where its header says so,
//! rejected naming the field), read back into the Rust types without losing a field; each Helm values file
//! installs the chart.

use std::{path::PathBuf, process::Output};

use imp_api::{ImpNetwork, ImpVM, ImpVMClass};
use imp_testkit::{TestEnv, fixtures, paths};
use kube::{Api, api::DeleteParams};
use serde_json::Value;

fn seed_files() -> Vec<PathBuf> {
    let dir = paths::reference_dir().join("seed-examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 8,
        "expected the seed examples in {}",
        dir.display()
    );
    files
}

/// A seed file whose header comment says the API server must reject it.
fn must_be_rejected(text: &str) -> bool {
    text.lines()
        .take_while(|l| l.starts_with('#'))
        .any(|l| l.contains("REJECTED"))
}

fn run(out: std::io::Result<Output>, what: &str) -> Output {
    out.unwrap_or_else(|e| panic!("{what}: cannot run: {e}"))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The object's spec as the server returned it through the Rust type, vs the spec in the file.
async fn assert_round_trip(env: &TestEnv, doc: &Value) {
    let kind = doc["kind"].as_str().unwrap();
    let name = doc["metadata"]["name"].as_str().unwrap();
    let ns = doc["metadata"]["namespace"].as_str().unwrap_or("default");
    let c = env.client.clone();
    let spec = match kind {
        "ImpVMClass" => {
            serde_json::to_value(Api::<ImpVMClass>::all(c).get(name).await.unwrap().spec)
        }
        "ImpNetwork" => serde_json::to_value(
            Api::<ImpNetwork>::namespaced(c, ns)
                .get(name)
                .await
                .unwrap()
                .spec,
        ),
        "ImpVM" => serde_json::to_value(
            Api::<ImpVM>::namespaced(c, ns)
                .get(name)
                .await
                .unwrap()
                .spec,
        ),
        other => panic!("seed example of unexpected kind {other}"),
    }
    .unwrap();
    assert_eq!(
        spec, doc["spec"],
        "{kind}/{name}: the spec read back through the Rust type differs from the seed file"
    );
}

#[tokio::test]
async fn seed_objects_are_accepted_verbatim_and_round_trip() {
    let env = TestEnv::new("seeds").await;
    let objects: Vec<(PathBuf, String)> = seed_files()
        .into_iter()
        .map(|p| {
            let t = std::fs::read_to_string(&p).unwrap();
            (p, t)
        })
        .filter(|(_, t)| t.contains("apiVersion: imp.dev/"))
        .collect();
    assert!(
        objects.len() >= 6,
        "expected imp.dev objects among the seeds"
    );
    // Classes and networks first: apply order must not matter for acceptance, but keep it natural.
    let mut ordered = objects.clone();
    ordered.sort_by_key(|(_, t)| {
        if t.contains("kind: ImpVMClass") {
            0
        } else if t.contains("kind: ImpNetwork") {
            1
        } else {
            2
        }
    });

    let mut rejected_seen = 0;
    for (path, content) in &ordered {
        let out = run(
            env.kubectl()
                .args(["apply", "--namespace", "default", "-f"])
                .arg(path)
                .output(),
            "kubectl apply",
        );
        let doc: Value = serde_yaml::from_str(content).unwrap();
        if must_be_rejected(content) {
            rejected_seen += 1;
            assert!(
                !out.status.success(),
                "{} must be rejected but was accepted",
                path.display()
            );
            let msg = text(&out);
            assert!(
                msg.contains("idleTimeout"),
                "rejection of {} must name idleTimeout: {msg}",
                path.display()
            );
            assert!(
                msg.contains("at least 10s"),
                "rejection of {} must say the bound: {msg}",
                path.display()
            );
        } else {
            assert!(
                out.status.success(),
                "{} rejected: {}",
                path.display(),
                text(&out)
            );
            assert_round_trip(&env, &doc).await;
        }
    }
    assert_eq!(
        rejected_seen, 1,
        "exactly one seed example is marked as must-be-rejected"
    );

    for (path, content) in &ordered {
        if !must_be_rejected(content) {
            let out = run(
                env.kubectl()
                    .args(["delete", "--namespace", "default", "--wait=false", "-f"])
                    .arg(path)
                    .output(),
                "kubectl delete",
            );
            assert!(
                out.status.success(),
                "delete {}: {}",
                path.display(),
                text(&out)
            );
        }
    }
}

#[tokio::test]
async fn seed_helm_values_install_the_chart() {
    let env = TestEnv::new("seedhelm").await;
    let home = tempfile::tempdir().unwrap();
    // The seed values enable ServiceMonitor/PodMonitor: give the API server the Prometheus Operator kinds.
    let monitoring = paths::workspace_root().join("testkit/fixtures/monitoring-crds.yaml");
    let out = run(
        env.kubectl()
            .args(["apply", "-f"])
            .arg(&monitoring)
            .output(),
        "kubectl apply monitoring CRDs",
    );
    assert!(
        out.status.success(),
        "install monitoring CRDs: {}",
        text(&out)
    );

    let values: Vec<PathBuf> = seed_files()
        .into_iter()
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("helm-values")
        })
        .collect();
    assert!(values.len() >= 2, "expected helm values seeds");
    // helm-values-seed.yaml is the seed documents' values merged; the other files are excerpts (e.g. the
    // monitor toggles) that name no fcBinPath, which the chart requires (api/tests/chart.rs checks that a
    // file without it is refused): each installs over the merged seed.
    let merged = paths::reference_dir().join("seed-examples/helm-values-seed.yaml");
    assert!(values.contains(&merged), "expected {}", merged.display());
    for (i, file) in values.iter().enumerate() {
        let release = format!("imp-seed-{i}");
        let out = run(
            env.helm(home.path())
                .args(["install", &release])
                .arg(paths::chart_dir())
                .args(["--skip-crds", "--wait=false", "-f"])
                .arg(&merged)
                .arg("-f")
                .arg(file)
                .output(),
            "helm install",
        );
        assert!(
            out.status.success(),
            "helm install -f {}: {}",
            file.display(),
            text(&out)
        );
        let out = run(
            env.helm(home.path()).args(["uninstall", &release]).output(),
            "helm uninstall",
        );
        assert!(
            out.status.success(),
            "helm uninstall {release}: {}",
            text(&out)
        );
    }
}

#[tokio::test]
async fn kubectl_get_wide_shows_the_printer_columns() {
    let env = TestEnv::new("columns").await;
    let vm = fixtures::vm("cols")
        .namespace(&env.namespace)
        .class("web-small")
        .image("ghcr.io/example/web:1.0")
        .bound("node-a")
        .build();
    let api: Api<ImpVM> = env.api();
    api.create(&Default::default(), &vm).await.unwrap();
    let status = serde_json::json!({"status": {"phase": "Running", "ip": "10.44.0.7", "reason": "Started", "start": {"from": "Clone", "template": "0123abcd", "restoreSeconds": 0.02, "reidentifySeconds": 0.001}}});
    api.patch_status(
        "cols",
        &Default::default(),
        &kube::api::Patch::Merge(&status),
    )
    .await
    .unwrap();

    let out = run(
        env.kubectl().args(["get", "impvm", "-o", "wide"]).output(),
        "kubectl get",
    );
    assert!(out.status.success(), "{}", text(&out));
    let table = String::from_utf8_lossy(&out.stdout);
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME",
            "PHASE",
            "NODE",
            "IP",
            "AGE",
            "CLASS",
            "LIFECYCLE",
            "REASON",
            "START"
        ],
        "{table}"
    );
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        row[..4],
        ["cols", "Running", "node-a", "10.44.0.7"],
        "{table}"
    );
    assert_eq!(
        row[5..],
        ["web-small", "ephemeral", "Started", "Clone"],
        "{table}"
    );

    // Short name and category resolve too.
    for resource in ["impvm", "imp"] {
        let out = run(
            env.kubectl().args(["get", resource, "-o", "name"]).output(),
            "kubectl get",
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("impvm.imp.dev/cols"),
            "kubectl get {resource}: {}",
            text(&out)
        );
    }
    api.delete("cols", &DeleteParams::default()).await.unwrap();
}
