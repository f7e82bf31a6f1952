//! Every validation rule of the CRD schemas, exercised against the real API server: the valid base object
//! is accepted, and each mutation is rejected with a message naming the offending field. Removing a rule
//! (or a field's bound) from the types makes the matching case fail.

use imp_api::{
    DesiredState, ImpNetwork, ImpVM, ImpVMClass, ImpVMRunnerPool, OnExhaustion, RestartMode,
};
use imp_testkit::{TestEnv, fixtures};
use kube::{
    Api, Resource,
    api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

fn merge(base: &Value, patch: &Value) -> Value {
    let mut out = base.clone();
    json_patch_merge(&mut out, patch);
    out
}

/// RFC 7386 merge patch (null removes).
fn json_patch_merge(target: &mut Value, patch: &Value) {
    if let (Some(t), Some(p)) = (target.as_object_mut(), patch.as_object()) {
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                json_patch_merge(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    } else {
        *target = patch.clone();
    }
}

async fn create<K: Resource<DynamicType = ()>>(env: &TestEnv, obj: &Value) -> Result<(), String> {
    let ar = ApiResource::erase::<K>(&());
    let api: Api<DynamicObject> = if obj["metadata"].get("namespace").is_some() {
        Api::namespaced_with(env.client.clone(), &env.namespace, &ar)
    } else {
        Api::all_with(env.client.clone(), &ar)
    };
    let dynobj: DynamicObject = serde_json::from_value(obj.clone()).unwrap();
    match api.create(&PostParams::default(), &dynobj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) => Err(e.message),
        Err(e) => panic!("unexpected client error: {e}"),
    }
}

/// Runs each case: base+patch must be rejected with a message containing every `needles` entry.
async fn check_cases<K: Resource<DynamicType = ()>>(
    env: &TestEnv,
    base: Value,
    cases: &[(&str, Value, &[&str])],
) {
    let name = |i: usize| format!("v{i}-{}", &env.namespace[env.namespace.len() - 8..]);
    let mut ok = base.clone();
    ok["metadata"]["name"] = json!(name(999));
    create::<K>(env, &ok)
        .await
        .unwrap_or_else(|e| panic!("base object must be accepted: {e}"));
    let mut failures = Vec::new();
    for (i, (what, patch, needles)) in cases.iter().enumerate() {
        let mut obj = merge(&base, patch);
        obj["metadata"]["name"] = json!(name(i));
        match create::<K>(env, &obj).await {
            Ok(()) => failures.push(format!("{what}: accepted")),
            Err(msg) => {
                for n in *needles {
                    if !msg.contains(n) {
                        failures.push(format!("{what}: message lacks {n:?}: {msg}"));
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "validation cases failed:\n{}",
        failures.join("\n")
    );
}

#[tokio::test]
async fn vm_class_rules() {
    let env = TestEnv::new("valcls").await;
    let policy = fixtures::restart()
        .mode(RestartMode::Reschedule)
        .on_exhaustion(OnExhaustion::Fail)
        .max_retries(3)
        .initial_delay("10s")
        .max_delay("5m");
    let base = fixtures::class("base")
        .vcpu(1)
        .memory_mib(512)
        .restart(policy.build())
        .json();
    check_cases::<ImpVMClass>(&env, base, &[
        ("vcpu 0", json!({"spec": {"vcpu": 0}}), &["spec.vcpu", "greater than or equal to 1"]),
        ("memory 64", json!({"spec": {"memoryMiB": 64}}), &["spec.memoryMiB", "greater than or equal to 128"]),
        ("no memory", json!({"spec": {"memoryMiB": null}}), &["spec.memoryMiB", "Required"]),
        ("bad mode", json!({"spec": {"restartPolicy": {"mode": "sideways"}}}), &["spec.restartPolicy.mode", "Unsupported value"]),
        ("bad onExhaustion", json!({"spec": {"restartPolicy": {"onExhaustion": "explode"}}}), &["spec.restartPolicy.onExhaustion", "Unsupported value"]),
        ("cool-down without period", json!({"spec": {"restartPolicy": {"onExhaustion": "cool-down"}}}), &["spec.restartPolicy.coolDownPeriod", "coolDownPeriod is required"]),
        ("initialDelay > maxDelay", json!({"spec": {"restartPolicy": {"backoff": {"initialDelay": "10m"}}}}), &["spec.restartPolicy.backoff.initialDelay", "initialDelay must not exceed maxDelay"]),
        ("zero initialDelay", json!({"spec": {"restartPolicy": {"backoff": {"initialDelay": "0s"}}}}), &["spec.restartPolicy.backoff.initialDelay", "initialDelay must be positive"]),
        ("zero maxDelay", json!({"spec": {"restartPolicy": {"backoff": {"initialDelay": null, "maxDelay": "0s"}}}}), &["spec.restartPolicy.backoff.maxDelay", "maxDelay must be positive"]),
        ("maxRetries 0", json!({"spec": {"restartPolicy": {"backoff": {"maxRetries": 0}}}}), &["spec.restartPolicy.backoff.maxRetries", "greater than or equal to 1"]),
        ("not a duration", json!({"spec": {"restartPolicy": {"backoff": {"initialDelay": "ten seconds"}}}}), &["spec.restartPolicy.backoff.initialDelay", "should match"]),
        ("probe path", json!({"spec": {"probes": {"readinessProbe": {"http": {"path": "readyz", "port": 8080}}}}}), &["spec.probes.readinessProbe.http.path", "path must start with /"]),
    ]).await;
}

#[tokio::test]
async fn network_rules() {
    let env = TestEnv::new("valnet").await;
    let base = fixtures::network("base")
        .namespace(&env.namespace)
        .subnet("10.44.0.0/24", "10.44.0.1")
        .nat()
        .dns(&["1.1.1.1"])
        .json();
    // A valid ingress list is part of the accepted base.
    let mut base = base;
    base["spec"]["ingress"] = json!([
        {"from": "192.0.2.0/24", "ports": [22, 8080]},
        {"from": "0.0.0.0/0", "protocol": "UDP"}
    ]);
    check_cases::<ImpNetwork>(
        &env,
        base,
        &[
            (
                "subnet not a CIDR",
                json!({"spec": {"subnet": "10.44.0.0"}}),
                &["spec.subnet", "subnet must be a CIDR"],
            ),
            (
                "subnet garbage",
                json!({"spec": {"subnet": "ten-dot"}}),
                &["spec.subnet", "subnet must be a CIDR"],
            ),
            (
                "gateway outside",
                json!({"spec": {"gateway": "10.45.0.1"}}),
                &["spec.gateway", "gateway must lie inside subnet"],
            ),
            (
                "gateway not an IP",
                json!({"spec": {"gateway": "gw"}}),
                &["spec.gateway", "gateway must be an IP address"],
            ),
            (
                "gateway other family",
                json!({"spec": {"gateway": "fd00::1"}}),
                &["spec.gateway", "same IP family"],
            ),
            (
                "dns not an IP",
                json!({"spec": {"dns": ["one.one.one.one"]}}),
                &["spec.dns", "every dns entry must be an IP address"],
            ),
            (
                "ingress from not a CIDR",
                json!({"spec": {"ingress": [{"from": "192.0.2.7"}]}}),
                &["spec.ingress[0].from", "ingress.from must be an IPv4 CIDR"],
            ),
            (
                "ingress from IPv6",
                json!({"spec": {"ingress": [{"from": "fd00::/64"}]}}),
                &["spec.ingress[0].from", "IPv4 CIDR"],
            ),
            (
                "ingress without from",
                json!({"spec": {"ingress": [{"ports": [22]}]}}),
                &["spec.ingress[0].from", "Required"],
            ),
            (
                "ingress port 0",
                json!({"spec": {"ingress": [{"from": "192.0.2.0/24", "ports": [0]}]}}),
                &["spec.ingress[0].ports[0]", "greater than or equal to 1"],
            ),
            (
                "ingress port too big",
                json!({"spec": {"ingress": [{"from": "192.0.2.0/24", "ports": [65536]}]}}),
                &["spec.ingress[0].ports[0]"],
            ),
            (
                "ingress bad protocol",
                json!({"spec": {"ingress": [{"from": "192.0.2.0/24", "protocol": "SCTP"}]}}),
                &["spec.ingress[0].protocol", "Unsupported value"],
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn vm_rules() {
    let env = TestEnv::new("valvm").await;
    let base = fixtures::vm("base")
        .namespace(&env.namespace)
        .class("web-small")
        .image("ghcr.io/example/web:1.0")
        .persistent()
        .desired(DesiredState::ScaleToZero)
        .idle_timeout("10s")
        .expire_after("1h")
        .json();
    check_cases::<ImpVM>(&env, base, &[
        ("idleTimeout 5s", json!({"spec": {"idleTimeout": "5s"}}), &["spec.idleTimeout", "idleTimeout must be at least 10s"]),
        ("idleTimeout 9.9s", json!({"spec": {"idleTimeout": "9.9s"}}), &["spec.idleTimeout", "at least 10s"]),
        ("idleTimeout days", json!({"spec": {"idleTimeout": "1d"}}), &["spec.idleTimeout", "should match"]),
        ("expireAfter 0s", json!({"spec": {"expireAfter": "0s"}}), &["spec.expireAfter", "expireAfter must be positive"]),
        ("bad lifecycle", json!({"spec": {"lifecycle": "forever"}}), &["spec.lifecycle", "Unsupported value"]),
        ("no lifecycle", json!({"spec": {"lifecycle": null}}), &["spec.lifecycle", "Required"]),
        ("bad desiredState", json!({"spec": {"desiredState": "Sleeping"}}), &["spec.desiredState", "Unsupported value"]),
        ("no classRef", json!({"spec": {"classRef": null}}), &["spec.classRef", "Required"]),
        ("empty image", json!({"spec": {"image": ""}}), &["spec.image"]),
        ("restart initialDelay > maxDelay", json!({"spec": {"restartPolicy": {"backoff": {"initialDelay": "1h", "maxDelay": "1m"}}}}), &["spec.restartPolicy.backoff.initialDelay", "initialDelay must not exceed maxDelay"]),
    ]).await;
}

#[tokio::test]
async fn runner_pool_rules() {
    let env = TestEnv::new("valpool").await;
    let base = fixtures::pool("base")
        .namespace(&env.namespace)
        .org("acme")
        .app_secret("gh-app")
        .labels(&["self-hosted", "imp"])
        .class("runner")
        .image("ghcr.io/example/runner-base:1")
        .min_idle(1)
        .max_runners(5)
        .scale_up_step(2)
        .json();
    check_cases::<ImpVMRunnerPool>(
        &env,
        base,
        &[
            (
                "org and repo",
                json!({"spec": {"github": {"scope": {"org": "acme", "repo": "acme/app"}}}}),
                &[
                    "spec.github.scope",
                    "exactly one of scope.org or scope.repo",
                ],
            ),
            (
                "neither org nor repo",
                json!({"spec": {"github": {"scope": {"org": null}}}}),
                &[
                    "spec.github.scope",
                    "exactly one of scope.org or scope.repo",
                ],
            ),
            (
                "repo not owner/name",
                json!({"spec": {"github": {"scope": {"org": null, "repo": "app"}}}}),
                &["spec.github.scope.repo", "repo must be owner/name"],
            ),
            (
                "no labels",
                json!({"spec": {"github": {"labels": []}}}),
                &["spec.github.labels"],
            ),
            (
                "maxRunners 0",
                json!({"spec": {"scaling": {"maxRunners": 0, "minIdle": 0}}}),
                &["spec.scaling.maxRunners", "greater than or equal to 1"],
            ),
            (
                "minIdle > maxRunners",
                json!({"spec": {"scaling": {"minIdle": 6}}}),
                &["spec.scaling.minIdle", "minIdle must not exceed maxRunners"],
            ),
            (
                "scaleUpStep 0",
                json!({"spec": {"scaling": {"scaleUpStep": 0}}}),
                &["spec.scaling.scaleUpStep", "greater than or equal to 1"],
            ),
            (
                "no app secret",
                json!({"spec": {"github": {"appSecretRef": null}}}),
                &["spec.github.appSecretRef", "Required"],
            ),
            (
                "template expireAfter 0s",
                json!({"spec": {"template": {"spec": {"expireAfter": "0s"}}}}),
                &[
                    "spec.template.spec.expireAfter",
                    "expireAfter must be positive",
                ],
            ),
        ],
    )
    .await;
}

#[tokio::test]
async fn status_subresource_ignores_spec_and_main_resource_ignores_status() {
    let env = TestEnv::new("status").await;
    let api: Api<ImpVM> = env.api();
    let vm = fixtures::vm("st").class("c").image("img:1").build();
    api.create(&PostParams::default(), &vm).await.unwrap();

    // Through /status: the spec change is dropped, the status lands.
    let patch = json!({"spec": {"image": "evil:2", "nodeName": "n1"}, "status": {"phase": "Running", "ip": "10.0.0.2"}});
    api.patch_status("st", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let got = api.get("st").await.unwrap();
    assert_eq!(got.spec.image, "img:1");
    assert_eq!(got.spec.node_name, None);
    let status = got.status.unwrap();
    assert_eq!(status.phase, Some(imp_api::VmPhase::Running));
    assert_eq!(status.ip.as_deref(), Some("10.0.0.2"));

    // Through the main resource: the status change is dropped, the spec lands.
    let patch = json!({"spec": {"nodeName": "n2"}, "status": {"phase": "Failed"}});
    api.patch("st", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let got = api.get("st").await.unwrap();
    assert_eq!(got.spec.node_name.as_deref(), Some("n2"));
    assert_eq!(got.status.unwrap().phase, Some(imp_api::VmPhase::Running));
}
