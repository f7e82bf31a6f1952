//! Suspend and ScaleToZero admission on the real API server (kube-apiserver 1.36):
//! - the chart's ValidatingAdmissionPolicy (helm/imp/templates/scale-to-zero-warning.yaml, rendered with
//!   `helm template` and applied as rendered) returns seed 000's warning when an ImpVM starts asking for
//!   ScaleToZero, on create and on the update that sets it, and only then;
//! - the CRD's CEL rule refuses Suspended and ScaleToZero on ephemeral and runner VMs, and accepts them on
//!   persistent ones.

use std::{
    path::PathBuf,
    process::{Command, Output},
    time::{Duration, Instant},
};

use imp_api::{DesiredState, ImpVM};
use imp_testkit::{TestEnv, cluster::with_fresh_client, fixtures, paths};
use kube::api::{DeleteParams, PostParams};

/// The seed's wording, as the warning must carry it.
const SEED_WARNING: [&str; 2] = [
    "wake-on-traffic has not been hardware-validated",
    "TAP byte-idle can also suspend a VM with an idle-but-open connection",
];

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The policy and its binding as the chart renders them for release `release`.
fn rendered_policy(release: &str) -> String {
    let home = tempfile::tempdir().unwrap();
    let values = home.path().join("values.yaml");
    // The chart's required values (seed 000); nothing of the policy depends on them.
    std::fs::write(
        &values,
        "agent:\n  env:\n    kernelPath: /var/lib/imp/vmlinux\n    fcBinPath: /usr/local/bin/firecracker\n    jailerPath: /usr/local/bin/jailer\n",
    )
    .unwrap();
    let out = Command::new(paths::testenv_bin("helm"))
        .env("HELM_CACHE_HOME", home.path().join("cache"))
        .env("HELM_CONFIG_HOME", home.path().join("config"))
        .env("HELM_DATA_HOME", home.path().join("data"))
        .args(["template", release])
        .arg(paths::chart_dir())
        .arg("-f")
        .arg(&values)
        .args(["--show-only", "templates/scale-to-zero-warning.yaml"])
        .output()
        .expect("run helm");
    assert!(out.status.success(), "helm template: {}", text(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// Deletes the cluster-scoped policy and binding, also when the test fails.
struct PolicyGuard {
    kubeconfig: PathBuf,
    name: String,
}

impl Drop for PolicyGuard {
    fn drop(&mut self) {
        let name = self.name.clone();
        with_fresh_client(&self.kubeconfig, move |client| async move {
            use k8s_openapi::api::admissionregistration::v1::{
                ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
            };
            let dp = DeleteParams::default();
            let _ = kube::Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
                .delete(&name, &dp)
                .await;
            let _ = kube::Api::<ValidatingAdmissionPolicy>::all(client)
                .delete(&name, &dp)
                .await;
        });
    }
}

/// `kubectl apply` of one object from stdin; (success, stdout+stderr).
fn kubectl_apply(env: &TestEnv, yaml: &str, extra: &[&str]) -> (bool, String) {
    use std::io::Write;
    let mut child = env
        .kubectl()
        .args(["apply", "-f", "-"])
        .args(extra)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run kubectl");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (out.status.success(), text(&out))
}

fn vm_yaml(env: &TestEnv, name: &str, desired: Option<DesiredState>, labels: &str) -> String {
    let mut vm = fixtures::vm(name)
        .namespace(&env.namespace)
        .class("web-small")
        .image("ghcr.io/example/web:1.0")
        .persistent();
    if let Some(d) = desired {
        vm = vm.desired(d);
    }
    let mut json = vm.json();
    if !labels.is_empty() {
        json["metadata"]["labels"] = serde_json::json!({"team": labels});
    }
    serde_yaml::to_string(&json).unwrap()
}

fn warned(out: &str) -> bool {
    out.contains("Warning:") && SEED_WARNING.iter().all(|w| out.contains(w))
}

#[tokio::test]
async fn the_api_server_warns_when_a_vm_asks_for_scale_to_zero() {
    let env = TestEnv::new("s2zwarn").await;
    // A release name of this test's own: the policy is cluster-scoped.
    let release = format!("imp-{}", &env.namespace[env.namespace.len() - 8..]);
    let policy = rendered_policy(&release);
    let name = format!("{release}-scale-to-zero-warning");
    assert!(policy.contains(&format!("name: {name}")), "{policy}");
    assert!(policy.contains("validationActions: [Warn]"), "{policy}");
    let _guard = PolicyGuard {
        kubeconfig: env.kubeconfig_path().to_path_buf(),
        name: name.clone(),
    };
    let (ok, out) = kubectl_apply(&env, &policy, &[]);
    assert!(ok, "applying the rendered policy: {out}");

    // The policy takes effect once the API server has compiled it: probe with server-side dry runs.
    let s2z = vm_yaml(&env, "web", Some(DesiredState::ScaleToZero), "");
    let started = Instant::now();
    loop {
        let (ok, out) = kubectl_apply(&env, &s2z, &["--dry-run=server"]);
        assert!(ok, "dry run: {out}");
        if warned(&out) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no ScaleToZero warning within 30s; last output: {out}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!("policy effective after {:?}", started.elapsed());

    // Create: warned, and still admitted.
    let (ok, out) = kubectl_apply(&env, &s2z, &[]);
    assert!(ok && warned(&out), "create: {out}");
    assert!(out.contains(&name), "the warning names the policy: {out}");
    assert!(out.contains("IMP_SCALE_TO_ZERO=true"), "{out}");
    // A later write to a VM that already asks: no warning.
    let (ok, out) = kubectl_apply(
        &env,
        &vm_yaml(&env, "web", Some(DesiredState::ScaleToZero), "a"),
        &[],
    );
    assert!(
        ok && !out.contains("Warning:"),
        "update keeping ScaleToZero: {out}"
    );

    // A VM that runs: no warning; switching it to ScaleToZero: warned.
    let (ok, out) = kubectl_apply(&env, &vm_yaml(&env, "svc", None, ""), &[]);
    assert!(ok && !out.contains("Warning:"), "create Running: {out}");
    let (ok, out) = kubectl_apply(
        &env,
        &vm_yaml(&env, "svc", Some(DesiredState::Suspended), ""),
        &[],
    );
    assert!(
        ok && !out.contains("Warning:"),
        "Suspended is not ScaleToZero: {out}"
    );
    let (ok, out) = kubectl_apply(
        &env,
        &vm_yaml(&env, "svc", Some(DesiredState::ScaleToZero), ""),
        &[],
    );
    assert!(ok && warned(&out), "update to ScaleToZero: {out}");
}

#[tokio::test]
async fn cel_refuses_suspending_ephemeral_and_runner_vms() {
    let env = TestEnv::new("suspcel").await;
    let api = env.api::<ImpVM>();
    let base = || {
        fixtures::vm("x")
            .namespace(&env.namespace)
            .class("runner")
            .image("ghcr.io/example/runner:1")
    };
    let cases = [
        (
            "ephemeral-suspended",
            base().desired(DesiredState::Suspended),
        ),
        ("ephemeral-s2z", base().desired(DesiredState::ScaleToZero)),
        (
            "runner-suspended",
            base()
                .persistent()
                .runner_config("jit")
                .desired(DesiredState::Suspended),
        ),
        (
            "runner-s2z",
            base()
                .persistent()
                .runner_config("jit")
                .desired(DesiredState::ScaleToZero),
        ),
    ];
    for (name, vm) in cases {
        let mut vm: ImpVM = vm.into();
        vm.metadata.name = Some(name.into());
        match api.create(&PostParams::default(), &vm).await {
            Err(kube::Error::Api(e)) => {
                assert_eq!(e.code, 422, "{name}: {e:?}");
                assert!(
                    e.message.contains("spec.desiredState")
                        && e.message
                            .contains("only persistent VMs without a runnerConfigSecret"),
                    "{name}: {}",
                    e.message
                );
            }
            other => panic!("{name}: accepted or unexpected: {other:?}"),
        }
    }

    // Allowed: an ephemeral VM that runs, a persistent VM suspended or scaled to zero.
    for (name, vm) in [
        ("ephemeral-running", base().desired(DesiredState::Running)),
        ("ephemeral-default", base()),
        (
            "svc-suspended",
            base().persistent().desired(DesiredState::Suspended),
        ),
        (
            "svc-s2z",
            base().persistent().desired(DesiredState::ScaleToZero),
        ),
    ] {
        let mut vm: ImpVM = vm.into();
        vm.metadata.name = Some(name.into());
        api.create(&PostParams::default(), &vm)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }

    // An update cannot get around it: an ephemeral VM asked to suspend later is refused too.
    let mut vm = api.get("ephemeral-running").await.unwrap();
    vm.spec.desired_state = Some(DesiredState::Suspended);
    match api
        .replace("ephemeral-running", &PostParams::default(), &vm)
        .await
    {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 422, "{e:?}"),
        other => panic!("update accepted: {other:?}"),
    }
}
