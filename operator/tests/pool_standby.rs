//! Snapshot standby's handoff rule, end to end on the control plane: a standby pool's runner VM
//! (`startFrom: Template`) whose clone fails to take an identity of its own (imp-runtime answers
//! Failed, `ReidentifyFailed`) is never Running, so the real node agent never begins its runner
//! handoff and never reads its JIT Secret (only the Secret's metadata, for the boot digest), and
//! the pool replaces it. The real agent runs in this process against a fake imp-runtime (a Unix
//! socket answering the runtime API as a node whose clones fail), its Kubernetes client recording
//! every request it makes; the pool controller is the harness's (pool_common); the test binds the
//! VMs, as the scheduler would.

mod pool_common;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use imp_api::names::{ANNOTATION_TEMPLATES_READY, reason};
use imp_api::{StartFrom, StartedFrom, VmPhase};
use imp_runtime_api::api::{
    ErrorBody, Failure, PrebuildStatus, StartKind, StartReport, TemplateList, TemplateState,
    TemplateStatus, VmList, VmSpec, VmState, VmStatus,
};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::{Api, ResourceExt};
use pool_common::*;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);
const TEMPLATE_KEY: &str = "sha256:fake-template";

/// What the fake runtime was asked and holds.
#[derive(Default)]
struct Fake {
    /// Every `PUT /v1/vms/{uid}`: (uid, spec).
    puts: Vec<(String, VmSpec)>,
    /// Every `POST /v1/templates` body's spec.
    templates: Vec<VmSpec>,
    vms: HashMap<String, VmStatus>,
}

type Shared = Arc<Mutex<Fake>>;

fn error(status: StatusCode, reason: &str, message: &str) -> Response {
    let body = ErrorBody {
        error: reason.into(),
        message: message.into(),
        field: None,
    };
    (status, Json(body)).into_response()
}

/// A clone that never took its identity: answered 422 ReidentifyFailed; recorded Failed, started
/// as a Clone.
async fn put_vm(
    State(s): State<Shared>,
    UrlPath(uid): UrlPath<String>,
    Json(spec): Json<VmSpec>,
) -> Response {
    let status = VmStatus {
        uid: uid.clone(),
        state: VmState::Failed,
        pid: None,
        api_socket: "/nonexistent/api.sock".into(),
        vsock_path: "/nonexistent/vsock".into(),
        serial_log: "/nonexistent/serial.log".into(),
        tap: None,
        boot_seconds: None,
        failure: Some(Failure {
            reason: reason::REIDENTIFY_FAILED.into(),
            message: "the clone's guest answered Reidentify with the template's machine-id".into(),
        }),
        start: Some(StartReport {
            from: StartKind::Clone,
            template: Some(TEMPLATE_KEY.into()),
            fallback: None,
            restore_seconds: Some(0.03),
            reidentify_seconds: Some(0.004),
        }),
    };
    let mut f = s.lock().unwrap();
    f.puts.push((uid.clone(), spec));
    f.vms.insert(uid, status);
    // As imp-runtime answers a start that failed: 422 with the reason; the VM's record (GET)
    // is Failed and says how it was started.
    error(
        StatusCode::UNPROCESSABLE_ENTITY,
        reason::REIDENTIFY_FAILED,
        "the clone's guest answered Reidentify with the template's machine-id",
    )
}

async fn get_vm(State(s): State<Shared>, UrlPath(uid): UrlPath<String>) -> Response {
    match s.lock().unwrap().vms.get(&uid) {
        Some(v) => Json(v.clone()).into_response(),
        None => error(StatusCode::NOT_FOUND, reason::NOT_FOUND, "no such VM"),
    }
}

async fn delete_vm(State(s): State<Shared>, UrlPath(uid): UrlPath<String>) -> Response {
    match s.lock().unwrap().vms.remove(&uid) {
        Some(_) => StatusCode::NO_CONTENT.into_response(),
        None => error(StatusCode::NOT_FOUND, reason::NOT_FOUND, "no such VM"),
    }
}

async fn list_vms(State(s): State<Shared>) -> Json<VmList> {
    Json(VmList {
        vms: s.lock().unwrap().vms.values().cloned().collect(),
    })
}

fn template() -> TemplateStatus {
    TemplateStatus {
        key: TEMPLATE_KEY.into(),
        state: TemplateState::Ready,
        bytes: 4096,
        vmm: "fake".into(),
        build_seconds: Some(0.5),
        clones: 0,
        failure: None,
        warm: None,
    }
}

async fn post_template(
    State(s): State<Shared>,
    Json(body): Json<serde_json::Value>,
) -> Json<TemplateStatus> {
    let spec: VmSpec = serde_json::from_value(body["spec"].clone()).expect("a template request");
    s.lock().unwrap().templates.push(spec);
    Json(template())
}

/// Serves the fake runtime on `socket` until the task is aborted.
fn fake_runtime(socket: &Path, state: Shared) -> tokio::task::JoinHandle<()> {
    let listener = tokio::net::UnixListener::bind(socket).expect("the fake runtime's socket");
    let app = axum::Router::new()
        .route("/v1/vms", get(list_vms))
        .route("/v1/vms/{uid}", put(put_vm).get(get_vm).delete(delete_vm))
        .route(
            "/v1/capacity",
            get(|| async {
                // No template fields: as a runtime that predates them answers (and no
                // `POST /v1/templates/dry-run`: the agent asks for templates as before).
                Json(json!({"writable_budget_bytes": 64u64 << 30, "writable_used_bytes": 0}))
            }),
        )
        .route(
            "/v1/images",
            axum::routing::post(|| async {
                Json(PrebuildStatus {
                    key: "sha256:fake-image".into(),
                    hit: true,
                    resolved: false,
                    cached: true,
                })
            }),
        )
        .route(
            "/v1/templates",
            axum::routing::post(post_template).get(|| async {
                Json(TemplateList {
                    templates: vec![template()],
                })
            }),
        )
        .fallback(|| async { error(StatusCode::NOT_FOUND, reason::NO_SUCH_ROUTE, "fake runtime") })
        .with_state(state);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    })
}

/// (method, path, Accept) of every request the agent's client sent.
type Requests = Arc<Mutex<Vec<(String, String, String)>>>;

/// A client of the harness's API server that records each request before sending it.
fn recording_client(upstream: kube::Client, ns: &str) -> (kube::Client, Requests) {
    let log: Requests = Arc::default();
    let seen = log.clone();
    let svc = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let upstream = upstream.clone();
        let accept = req
            .headers()
            .get(http::header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        seen.lock().unwrap().push((
            req.method().to_string(),
            req.uri().path().to_owned(),
            accept,
        ));
        async move { upstream.send(req).await }
    });
    (kube::Client::new(svc, ns), log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_that_fails_reidentify_never_has_its_jit_secret_read_and_is_replaced() {
    let mut h = PoolHarness::start("pool-standby").await;
    let class = h.add_agent_nodes(1).await;
    let node = format!("{}-n0", h.ns);

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("runtime.sock");
    let fake: Shared = Arc::default();
    let runtime = fake_runtime(&socket, fake.clone());
    let (client, requests) = recording_client(h.client.clone(), &h.ns);
    let mut config = imp_agent::AgentConfig::new(&node, &socket);
    config.lease_namespace = h.ns.clone();
    config.heartbeat_interval = Duration::from_secs(1);
    config.poll_interval = Duration::from_secs(1);
    config.sweep_interval = Duration::from_secs(2);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(imp_agent::run(
        client,
        config,
        "127.0.0.1:0".parse().unwrap(),
        imp_agent::AgentMetrics::new(),
        async {
            let _ = stopped.await;
        },
    ));

    let pool = imp_testkit::fixtures::pool("standby")
        .org(h.sim.org())
        .app_secret(APP_SECRET)
        .labels(&LABELS)
        .class(&class)
        .image("ghcr.io/imp/runner:1")
        .webhook_secret("webhook")
        .min_idle(1)
        .max_runners(1)
        .standby(true)
        .build();
    let pool = h.pools().create(&Default::default(), &pool).await.unwrap();
    let pool_uid = pool.uid().unwrap();

    // The node keeps the pool's template and says it is Ready.
    let nodes: Api<Node> = Api::all(h.client.clone());
    h.wait(
        "the node reporting the pool's template Ready",
        WAIT,
        || async {
            let n = nodes.get(&node).await.ok()?;
            (n.annotations().get(ANNOTATION_TEMPLATES_READY) == Some(&pool_uid)).then_some(())
        },
    )
    .await;
    {
        let f = fake.lock().unwrap();
        let t = f.templates.last().expect("a template was asked for");
        assert!(t.network.is_none(), "no networkRef: no NIC in the template");
        assert_eq!(
            t.image.as_ref().map(|i| i.base.as_str()),
            Some("ghcr.io/imp/runner:1")
        );
    }

    // The pool's first VM: a Template VM, bound here (the test plays the scheduler).
    let first = h.wait_minted("standby", 1, WAIT).await.remove(0);
    assert_eq!(first.spec.start_from, Some(StartFrom::Template));
    let first_name = first.name_any();
    let first_uid = first.uid().unwrap();
    let secret = first.spec.runner_config_secret.clone().unwrap();
    let seen = watch_vms(&h);
    bind(&h, &first_name, &node).await;

    // The agent asked for a clone; the runtime's answer fails the VM with its reason and its
    // start report, and the VM never ran.
    // (The pool deletes a Failed VM within milliseconds: its states are read from a watch.)
    let failed = h
        .wait("the clone Failed with ReidentifyFailed", WAIT, || async {
            seen.lock().unwrap().get(&first_name).and_then(|states| {
                states
                    .iter()
                    .find(|vm| vm.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Failed))
                    .cloned()
            })
        })
        .await;
    assert!(
        !seen.lock().unwrap()[&first_name].iter().any(|vm| vm
            .status
            .as_ref()
            .and_then(|s| s.phase)
            == Some(VmPhase::Running)),
        "the clone was never Running"
    );
    let st = failed.status.clone().unwrap();
    assert_eq!(st.reason.as_deref(), Some(reason::REIDENTIFY_FAILED));
    let start = st.start.expect("status.start written with the failure");
    assert_eq!(start.from, StartedFrom::Clone);
    assert_eq!(start.template.as_deref(), Some(TEMPLATE_KEY));
    assert_eq!(start.reidentify_seconds, Some(0.004));
    assert!(st.first_running_time.is_none() && st.runner.is_none());
    assert!(
        fake.lock()
            .unwrap()
            .puts
            .iter()
            .any(|(uid, spec)| *uid == first_uid && spec.from_template),
        "the runtime was asked for a clone"
    );

    // The pool replaces it: a new VM, the failed one gone.
    h.wait("a replacement VM", WAIT, || async {
        let vms = h.runner_vms("standby").await;
        (vms.len() == 1 && vms[0].uid().as_deref() != Some(first_uid.as_str())).then_some(())
    })
    .await;
    h.wait("the failed VM deleted", WAIT, || async {
        h.vms()
            .get_opt(&first_name)
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    h.wait("the start and its failure counted", WAIT, || async {
        (h.metric("imp_runner_vm_starts_total{from=\"clone\",fallback=\"none\"}") == 1.0
            && h.metric(&format!(
                "imp_runner_vm_start_failures_total{{reason=\"{}\"}}",
                reason::REIDENTIFY_FAILED
            )) == 1.0)
            .then_some(())
    })
    .await;

    // The JIT Secret: read for its metadata only (the boot digest check), never whole.
    let path = format!("/api/v1/namespaces/{}/secrets/{secret}", h.ns);
    let reads: Vec<_> = requests
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, p, _)| *p == path)
        .cloned()
        .collect();
    assert!(
        !reads.is_empty(),
        "the boot digest check's metadata read is recorded (the recording works)"
    );
    assert!(
        reads
            .iter()
            .all(|(m, _, accept)| m == "GET" && accept.contains("as=PartialObjectMetadata")),
        "the agent read the failed clone's JIT Secret: {reads:?}"
    );
    let secret_lists: Vec<_> = requests
        .lock()
        .unwrap()
        .iter()
        .filter(|(m, p, _)| m == "GET" && p.ends_with("/secrets"))
        .cloned()
        .collect();
    assert!(secret_lists.is_empty(), "{secret_lists:?}");

    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), agent).await;
    runtime.abort();
}

/// Every version of each ImpVM of the namespace the watch delivers, by name, from now on.
fn watch_vms(h: &PoolHarness) -> Arc<Mutex<HashMap<String, Vec<imp_api::ImpVM>>>> {
    use futures::TryStreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let seen: Arc<Mutex<HashMap<String, Vec<imp_api::ImpVM>>>> = Arc::default();
    let out = seen.clone();
    let stream = watcher(h.vms(), watcher::Config::default())
        .default_backoff()
        .applied_objects();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Ok(Some(vm)) = stream.try_next().await {
            out.lock()
                .unwrap()
                .entry(vm.name_any())
                .or_default()
                .push(vm);
        }
    });
    seen
}

/// Binds `vm` to `node` in phase Scheduled, as the ImpVM scheduler does.
async fn bind(h: &PoolHarness, vm: &str, node: &str) {
    h.vms()
        .patch(
            vm,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"nodeName": node}})),
        )
        .await
        .unwrap();
    h.vms()
        .patch_status(
            vm,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": VmPhase::Scheduled,
                "scheduledTime": Time(Timestamp::now())}})),
        )
        .await
        .unwrap();
}

/// The local registry with the base image; None (having said why) without docker-registry,
/// which IMP_REQUIRE_REGISTRY=1 makes a failure.
async fn registry_or_skip(what: &str) -> Option<imp_testkit::registry::Registry> {
    use imp_testkit::registry::RegistryError;
    match imp_testkit::oci::try_registry_with_base_image().await {
        Ok(r) => Some(r),
        Err(e @ RegistryError::BinaryMissing) => {
            imp_testkit::skip::skip_or_fail(
                "IMP_REQUIRE_REGISTRY",
                what,
                &format!("no local registry ({e})"),
            );
            None
        }
        Err(e) => panic!("the local registry did not start: {e}"),
    }
}

/// A simulated node `node_name` (jailed or not) of `h`'s cluster, pulling from `registry`.
async fn start_node(
    h: &PoolHarness,
    bins: &imp_testkit::simnode::SimNodeBinaries,
    node_name: &str,
    registry: &imp_testkit::registry::Registry,
    jailed: bool,
) -> imp_testkit::simnode::SimNode {
    start_sized_node(h, bins, node_name, registry, jailed, (4, 8192)).await
}

/// [`start_node`] offering `(vcpu, memory_mib)` to VMs.
async fn start_sized_node(
    h: &PoolHarness,
    bins: &imp_testkit::simnode::SimNodeBinaries,
    node_name: &str,
    registry: &imp_testkit::registry::Registry,
    jailed: bool,
    (vcpu, memory_mib): (u32, u64),
) -> imp_testkit::simnode::SimNode {
    imp_testkit::simnode::SimNode::start(
        bins,
        &imp_testkit::simnode::SimNodeOptions {
            node_name: node_name.to_owned(),
            lease_namespace: h.ns.clone(),
            kubeconfig: h.env.kubeconfig_path().to_path_buf(),
            registry: registry.host(),
            capacity_vcpu: vcpu,
            capacity_memory_mib: memory_mib,
            writable_budget_bytes: 16 << 30,
            jailed,
        },
    )
    .await
}

/// The standby pool "standby" of class `class` on the registry's base image (sizes to add).
fn standby_pool(
    h: &PoolHarness,
    class: &str,
    registry: &imp_testkit::registry::Registry,
) -> imp_testkit::fixtures::PoolBuilder {
    imp_testkit::fixtures::pool("standby")
        .org(h.sim.org())
        .app_secret(APP_SECRET)
        .labels(&LABELS)
        .class(class)
        .image(&format!("{}/ci/base:1", registry.host()))
        .webhook_secret("webhook")
}

/// The same pool on a real node (imp-runtime driving the Firecracker simulator, the imp-agent
/// binary; testkit's SimNode): an unjailed Firecracker keeps no templates (a snapshot records
/// host drive paths a load cannot override), so the agent publishes none Ready, and the pool's
/// `startFrom: Template` VM boots cold, Running, with `status.start` saying so and why
/// (`TemplateUnsupported`), counted by the pool. Skipped (with the reason) without
/// docker-registry; IMP_REQUIRE_REGISTRY=1 makes the skip a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_node_without_templates_a_standby_vm_boots_cold_and_says_why() {
    use imp_testkit::simnode::SimNodeBinaries;
    let Some(registry) = registry_or_skip("snapshot standby on a simulated node").await else {
        return;
    };
    let bins = SimNodeBinaries::locate().expect("imp-runtime, imp-agent and the simulators");
    let mut h = PoolHarness::start("pool-standby-node").await;
    let class = h.add_agent_nodes(1).await;
    let node_name = format!("{}-n0", h.ns);
    let node = start_node(&h, &bins, &node_name, &registry, false).await;
    let pool = standby_pool(&h, &class, &registry)
        .min_idle(1)
        .max_runners(1)
        .standby(true)
        .build();
    h.pools().create(&Default::default(), &pool).await.unwrap();
    let vm = h.wait_minted("standby", 1, WAIT).await.remove(0);
    assert_eq!(vm.spec.start_from, Some(StartFrom::Template));
    bind(&h, &vm.name_any(), &node_name).await;
    let running = h
        .wait(
            "the standby VM Running",
            Duration::from_secs(120),
            || async {
                let vm = h.vms().get_opt(&vm.name_any()).await.ok()??;
                let st = vm.status.clone()?;
                assert_ne!(st.phase, Some(VmPhase::Failed), "{st:?}\n{}", node.logs(40));
                (st.phase == Some(VmPhase::Running)).then_some(st)
            },
        )
        .await;
    let start = running.start.expect("status.start written with Running");
    assert_eq!(start.from, StartedFrom::Boot, "{start:?}");
    assert_eq!(
        start.fallback_reason.as_deref(),
        Some(reason::TEMPLATE_UNSUPPORTED),
        "{start:?}"
    );
    h.wait("the cold start counted with its reason", WAIT, || async {
        (h.metric(&format!(
            "imp_runner_vm_starts_total{{from=\"boot\",fallback=\"{}\"}}",
            reason::TEMPLATE_UNSUPPORTED
        )) == 1.0)
            .then_some(())
    })
    .await;
    // The template was asked for and failed: nothing is reported Ready on the Node.
    let nodes: Api<Node> = Api::all(h.client.clone());
    let n = nodes.get(&node_name).await.unwrap();
    assert!(
        !n.annotations().contains_key(ANNOTATION_TEMPLATES_READY),
        "{:?}",
        n.annotations()
    );
    // Scale to zero: the pool's deletion removes the VM; the node releases it.
    h.pools()
        .delete("standby", &Default::default())
        .await
        .unwrap();
    h.wait(
        "the node holding no VM",
        Duration::from_secs(60),
        || async { (node.vm_dirs() == 0).then_some(()) },
    )
    .await;
}

/// Snapshot standby through the whole product on a jailed node (testkit's SimNode, the
/// simulator through the jailer double as the smoke runs it): the agent has imp-runtime build
/// the standby pool's template and publishes it Ready on the Node; then each job queued at the
/// GitHub simulator is run by a runner VM of its own (the test binds it, as the scheduler would)
/// that imp-runtime restored from the template and reidentified: `status.start` says Clone, with
/// the template and its restore and reidentify times; the fake runner runs the job to success;
/// the VM is deleted after; the pool counts each clone start and its restore and reidentify
/// phases. Then the pool is deleted and the node holds no VM, jail or VM process. Skipped (with
/// the reason) without docker-registry (IMP_REQUIRE_REGISTRY=1: a failure) or when not root (the
/// jailer double switches uids, makes device nodes and namespaces; IMP_REQUIRE_ROOT=1: a
/// failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_jailed_node_each_job_runs_on_a_clone_of_the_pools_template() {
    use imp_api::names::ANNOTATION_RUNNER_NAME;
    use imp_testkit::simnode::{SimNode, SimNodeBinaries};
    use std::time::Instant;
    const JOBS: usize = 3;
    const SLOW: Duration = Duration::from_secs(180);
    if !SimNode::can_jail() {
        imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "snapshot standby on a jailed simulated node",
            "not root (the jailer switches uids, makes device nodes and namespaces)",
        );
        return;
    }
    let Some(registry) = registry_or_skip("snapshot standby on a jailed simulated node").await
    else {
        return;
    };
    let bins = SimNodeBinaries::locate().expect("imp-runtime, imp-agent and the simulators");
    let mut h = PoolHarness::start("pool-standby-jail").await;
    let class = h.add_agent_nodes(1).await;
    let node_name = format!("{}-n0", h.ns);
    let node = start_node(&h, &bins, &node_name, &registry, true).await;
    let pool = standby_pool(&h, &class, &registry)
        .min_idle(0)
        .max_runners(2)
        .standby(true)
        .build();
    let started = Instant::now();
    let pool = h.pools().create(&Default::default(), &pool).await.unwrap();
    let pool_uid = pool.uid().unwrap();

    // The agent has the runtime build the pool's template and publishes it Ready.
    let nodes: Api<Node> = Api::all(h.client.clone());
    h.wait(
        "the node reporting the pool's template Ready",
        SLOW,
        || async {
            let n = nodes.get(&node_name).await.ok()?;
            n.annotations()
                .get(ANNOTATION_TEMPLATES_READY)?
                .split(',')
                .any(|u| u == pool_uid)
                .then_some(())
        },
    )
    .await;
    let template_ready = started.elapsed();
    assert!(
        h.runner_vms("standby").await.is_empty(),
        "minIdle 0: no VM before a job"
    );

    let seen = watch_vms(&h);
    let mut vm_uids = Vec::new();
    let mut template_key = None;
    for i in 0..JOBS {
        let queued = Instant::now();
        let job = h.sim.queue_job(job());
        let vm = h
            .wait(&format!("job {i}'s runner VM minted"), WAIT, || async {
                h.runner_vms("standby").await.into_iter().find(|v| {
                    v.spec.runner_config_secret.is_some()
                        && !vm_uids.contains(&v.uid().unwrap_or_default())
                })
            })
            .await;
        assert_eq!(vm.spec.start_from, Some(StartFrom::Template));
        let (vm_name, vm_uid) = (vm.name_any(), vm.uid().unwrap());
        vm_uids.push(vm_uid.clone());
        bind(&h, &vm_name, &node_name).await;
        let done = h
            .wait(&format!("job {i} completed"), SLOW, || async {
                if let Some(vms) = seen.lock().unwrap().get(&vm_name) {
                    let failed = vms
                        .iter()
                        .find(|v| v.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Failed));
                    assert!(
                        failed.is_none(),
                        "{:?}\n{}",
                        failed.unwrap().status,
                        node.logs(40)
                    );
                }
                let j = h.sim.job(job.id)?;
                j.completed_at.is_some().then_some(j)
            })
            .await;
        let job_took = queued.elapsed();
        assert_eq!(done.conclusion.as_deref(), Some("success"), "{done:?}");
        // Its VM: Running as a clone of the pool's template, and its runner ran the job.
        let versions = seen
            .lock()
            .unwrap()
            .get(&vm_name)
            .cloned()
            .unwrap_or_default();
        let running = versions
            .iter()
            .find(|v| v.status.as_ref().and_then(|s| s.phase) == Some(VmPhase::Running))
            .unwrap_or_else(|| panic!("job {i}'s VM never seen Running: {versions:?}"));
        let start = running
            .status
            .as_ref()
            .and_then(|s| s.start.clone())
            .expect("status.start written with Running");
        assert_eq!(
            start.from,
            StartedFrom::Clone,
            "{start:?}\n{}",
            node.logs(40)
        );
        assert_eq!(start.fallback_reason, None, "{start:?}");
        let key = start.template.clone().expect("the clone's template");
        assert_eq!(
            template_key.get_or_insert_with(|| key.clone()),
            &key,
            "each clone of the pool's one template"
        );
        let restore = start.restore_seconds.expect("restoreSeconds");
        let reidentify = start.reidentify_seconds.expect("reidentifySeconds");
        assert!(restore > 0.0 && reidentify > 0.0, "{start:?}");
        let runner = versions
            .iter()
            .find_map(|v| v.annotations().get(ANNOTATION_RUNNER_NAME).cloned());
        assert_eq!(done.runner_name, runner, "the job's runner is the VM's");
        // Spent: the pool deletes it and the node releases it.
        h.wait(&format!("job {i}'s VM deleted"), WAIT, || async {
            h.vms()
                .get_opt(&vm_name)
                .await
                .ok()?
                .is_none()
                .then_some(())
        })
        .await;
        eprintln!(
            "job {i}: VM {vm_uid} cloned from {key}: restore {restore:.3}s, reidentify \
             {reidentify:.3}s; job queued to completed {job_took:.1?}, VM deleted at {:.1?}",
            queued.elapsed()
        );
    }
    h.wait("each clone start counted", WAIT, || async {
        (h.metric("imp_runner_vm_starts_total{from=\"clone\",fallback=\"none\"}") == JOBS as f64)
            .then_some(())
    })
    .await;
    assert_eq!(
        h.metric("imp_runner_vm_starts_total{from=\"boot\""),
        0.0,
        "{}",
        h.metrics_text()
    );
    let phases = |h: &PoolHarness| {
        h.metrics_text()
            .lines()
            .filter(|l| l.starts_with("imp_runner_job_phase_seconds_count"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let observed = Instant::now();
    while !(h.metric("imp_runner_job_phase_seconds_count{phase=\"restore\"}") == JOBS as f64
        && h.metric("imp_runner_job_phase_seconds_count{phase=\"reidentify\"}") == JOBS as f64)
    {
        assert!(
            observed.elapsed() < WAIT,
            "each job's restore and reidentify observed: {:?}\n{}",
            phases(&h),
            captured_logs()
                .lines()
                .filter(|l| l.contains("served job") || l.contains("ERROR") || l.contains("WARN"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The pool deleted: no VM left, and nothing of one on the node.
    h.pools()
        .delete("standby", &Default::default())
        .await
        .unwrap();
    h.wait("the pool gone and the node empty", SLOW, || async {
        let vms = h.vms().list(&Default::default()).await.ok()?.items.len();
        (vms == 0 && node.vm_dirs() == 0 && node.jail_dirs() == 0 && node.vm_processes().is_empty())
            .then_some(())
    })
    .await;
    eprintln!(
        "jailed standby: template Ready at {template_ready:.1?}, {JOBS} jobs on clones, all done \
         at {:.1?}",
        started.elapsed()
    );
}

/// Issue 32: a template build runs a VM of the pool's class, so the agent asks for one only when
/// the node has room for it beside the VMs holding a share. On a jailed node offering exactly one
/// VM of the class, a running VM leaves no room: the standby pool's build is deferred (the
/// runtime builds nothing, the agent says why once); once that VM is gone, the next pass asks
/// for it and the template is built and published Ready. Skipped as the test above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_build_waits_for_room_on_the_node() {
    use imp_testkit::simnode::{SimNode, SimNodeBinaries};
    const SLOW: Duration = Duration::from_secs(180);
    if !SimNode::can_jail() {
        imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "a template build waiting for room on a jailed simulated node",
            "not root (the jailer switches uids, makes device nodes and namespaces)",
        );
        return;
    }
    let Some(registry) = registry_or_skip("a template build waiting for room").await else {
        return;
    };
    let bins = SimNodeBinaries::locate().expect("imp-runtime, imp-agent and the simulators");
    let mut h = PoolHarness::start("pool-standby-room").await;
    // The class is 1 vCPU, 2048 MiB: the node has room for one.
    let class = h.add_agent_nodes(1).await;
    let node_name = format!("{}-n0", h.ns);
    let node = start_sized_node(&h, &bins, &node_name, &registry, true, (1, 2048)).await;
    let image = format!("{}/ci/base:1", registry.host());
    let holder = imp_testkit::fixtures::vm("holder")
        .namespace(&h.ns)
        .class(&class)
        .image(&image)
        .persistent()
        .build();
    h.vms().create(&Default::default(), &holder).await.unwrap();
    bind(&h, "holder", &node_name).await;
    h.wait("the holder VM Running", SLOW, || async {
        let st = h.vms().get_opt("holder").await.ok()??.status?;
        assert_ne!(st.phase, Some(VmPhase::Failed), "{st:?}\n{}", node.logs(40));
        (st.phase == Some(VmPhase::Running)).then_some(())
    })
    .await;

    let pool = standby_pool(&h, &class, &registry)
        .min_idle(0)
        .max_runners(1)
        .standby(true)
        .build();
    let pool = h.pools().create(&Default::default(), &pool).await.unwrap();
    let pool_uid = pool.uid().unwrap();
    let agent_log = || std::fs::read_to_string(node.dir().join("agent.log")).unwrap_or_default();
    let deferred = "the pool's snapshot template waits for room on the node";
    h.wait("the build deferred for want of room", WAIT, || async {
        let this_pool = format!("pool={}/standby ", h.ns);
        agent_log()
            .lines()
            .any(|l| l.contains(deferred) && l.contains(&this_pool))
            .then_some(())
    })
    .await;
    // Passes go on (every 5 s while deferred): none starts a build.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let templates = node.state_dir().join("templates");
    let held: Vec<_> = std::fs::read_dir(&templates)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(held.is_empty(), "a build started without room: {held:?}");
    // (Other tests' pools share the API server and may be servable here: this pool's lines.)
    let this_pool = format!("pool={}/standby ", h.ns);
    let lines: Vec<String> = agent_log()
        .lines()
        .filter(|l| l.contains(deferred) && l.contains(&this_pool))
        .map(str::to_owned)
        .collect();
    assert_eq!(lines.len(), 1, "said once:\n{}", node.logs(40));
    assert!(
        lines[0].contains(
            "the VM's 1 vCPU do not fit: the node publishes 1 (imp.dev/capacity-vcpu), 1 held by \
             1 other VM"
        ),
        "{}",
        node.logs(40)
    );
    let nodes: Api<Node> = Api::all(h.client.clone());
    let n = nodes.get(&node_name).await.unwrap();
    assert!(!n.annotations().contains_key(ANNOTATION_TEMPLATES_READY));

    // The VM goes: room, and the next pass has the template built.
    h.vms().delete("holder", &Default::default()).await.unwrap();
    h.wait(
        "the node reporting the pool's template Ready",
        SLOW,
        || async {
            let n = nodes.get(&node_name).await.ok()?;
            n.annotations()
                .get(ANNOTATION_TEMPLATES_READY)?
                .split(',')
                .any(|u| u == pool_uid)
                .then_some(())
        },
    )
    .await;
    assert!(h.vms().get_opt("holder").await.unwrap().is_none());

    h.pools()
        .delete("standby", &Default::default())
        .await
        .unwrap();
    h.wait("the node empty", SLOW, || async {
        (node.vm_dirs() == 0 && node.jail_dirs() == 0 && node.vm_processes().is_empty())
            .then_some(())
    })
    .await;
}
