//! A minted runner VM is frozen (issue 30): once `spec.runnerConfigSecret` is set, the API server
//! refuses changes to the fields the JIT config was minted for (imp_api::frozen::FROZEN_FIELDS),
//! naming the field; scheduling and metadata stay writable, and a VM without a runner config can
//! still be changed.

use imp_api::{ImpVM, frozen::FROZEN_FIELDS};
use imp_testkit::{TestEnv, fixtures};
use kube::api::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};

async fn patch(env: &TestEnv, name: &str, p: &Value) -> Result<(), (u16, String)> {
    match env
        .api::<ImpVM>()
        .patch(name, &PatchParams::default(), &Patch::Merge(p))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) => Err((e.code, e.message)),
        Err(e) => panic!("unexpected client error: {e}"),
    }
}

fn runner_vm(env: &TestEnv, name: &str, secret: Option<&str>) -> ImpVM {
    let mut b = fixtures::vm(name)
        .namespace(&env.namespace)
        .class("runner")
        .image("ghcr.io/acme/base:1")
        .runner_image("ghcr.io/acme/runner:2")
        .network("ci");
    if let Some(s) = secret {
        b = b.runner_config(s);
    }
    let mut vm = b.build();
    vm.spec.image_pull_secrets = vec![k8s_openapi::api::core::v1::LocalObjectReference {
        name: "pull".into(),
    }];
    vm
}

/// One change per frozen field, and the unset/remove variants of the optional ones.
fn changes() -> Vec<(&'static str, Value)> {
    vec![
        ("image", json!({"spec": {"image": "evil.example/own:1"}})),
        (
            "runnerImage",
            json!({"spec": {"runnerImage": "evil.example/runner:1"}}),
        ),
        ("runnerImage", json!({"spec": {"runnerImage": null}})),
        ("classRef", json!({"spec": {"classRef": {"name": "big"}}})),
        (
            "networkRef",
            json!({"spec": {"networkRef": {"name": "other"}}}),
        ),
        ("networkRef", json!({"spec": {"networkRef": null}})),
        (
            "imagePullSecrets",
            json!({"spec": {"imagePullSecrets": [{"name": "theirs"}]}}),
        ),
        (
            "imagePullSecrets",
            json!({"spec": {"imagePullSecrets": null}}),
        ),
        // The minted VM has none: adding one (a root runner) is a change too.
        (
            "runnerUser",
            json!({"spec": {"runnerUser": {"uid": 0, "runAsRoot": true}}}),
        ),
        // How it starts is fixed with the mint too (not in the boot digest: a clone runs the
        // same spec), so a standby VM cannot be switched to a boot or back once minted.
        ("startFrom", json!({"spec": {"startFrom": "Template"}})),
    ]
}

#[tokio::test]
async fn the_api_server_refuses_repointing_a_minted_runner_vm() {
    let env = TestEnv::new("frozen").await;
    let api = env.api::<ImpVM>();
    api.create(
        &PostParams::default(),
        &runner_vm(&env, "minted", Some("impvm-x-jit")),
    )
    .await
    .unwrap();

    let mut failures = Vec::new();
    let cases = changes();
    for field in FROZEN_FIELDS {
        assert!(
            cases.iter().any(|(f, _)| *f == field),
            "no case for {field}"
        );
    }
    for (field, p) in &cases {
        match patch(&env, "minted", p).await {
            Ok(()) => failures.push(format!("{field} {p}: accepted")),
            Err((code, msg)) => {
                let want = format!("{field} cannot change once runnerConfigSecret is set");
                if code != 422 || !msg.contains(&format!("spec.{field}")) || !msg.contains(&want) {
                    failures.push(format!("{field} {p}: {code} {msg}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let got = api.get("minted").await.unwrap();
    assert_eq!(
        got.spec,
        runner_vm(&env, "minted", Some("impvm-x-jit")).spec
    );

    // What may change after the mint: the binding, scheduling hints, metadata.
    patch(
        &env,
        "minted",
        &json!({"metadata": {"annotations": {"x": "y"}}, "spec": {"nodeName": "node-a",
            "nodeSelector": {"zone": "a"}}}),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn a_vm_without_a_runner_config_stays_editable() {
    let env = TestEnv::new("unfrozen").await;
    let api = env.api::<ImpVM>();
    api.create(&PostParams::default(), &runner_vm(&env, "free", None))
        .await
        .unwrap();
    for (field, p) in changes() {
        patch(&env, "free", &p)
            .await
            .unwrap_or_else(|e| panic!("{field} {p}: {e:?}"));
    }
    // The mint itself: setting runnerConfigSecret together with the spec as it is.
    patch(
        &env,
        "free",
        &json!({"spec": {"runnerConfigSecret": "impvm-y-jit"}}),
    )
    .await
    .unwrap();
    let e = patch(&env, "free", &json!({"spec": {"image": "other:1"}}))
        .await
        .unwrap_err();
    assert!(e.1.contains("spec.image"), "{e:?}");
}
