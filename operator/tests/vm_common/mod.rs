//! Shared harness of the ImpVM controller tests: a controller scoped to the test's namespace and to Nodes
//! labelled for this test, Node/Lease/ImpVMClass fixtures, and helpers that play the node agent by writing
//! ImpVM status exactly as the agent does (read-modify-write with the resourceVersion as precondition).

#![allow(dead_code)] // each test binary uses a different subset

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use imp_api::{
    ImpNetwork, ImpNetworkSpec, ImpVM, ImpVMClass, ImpVMStatus, RestartPolicy, VmPhase,
    conditions::{self, ConditionStatus},
    names::{ANNOTATION_IP_ALLOCATION, LABEL_NODE_ENABLED, condition, lease_name, reason},
};
use imp_operator::{
    index::{Index, IndexConfig},
    metrics::{VmMetrics, encode},
    vm::{Timing, VmControllerConfig, run_vm_controller},
};
pub use imp_testkit::waits::phase_of;
use imp_testkit::{TestEnv, cluster::with_fresh_client, fixtures, waits};
use k8s_openapi::{
    api::{
        coordination::v1::{Lease, LeaseSpec},
        core::v1::Node,
        events::v1::Event,
    },
    apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use tokio::task::JoinHandle;

/// Label on the Nodes of one test; its controller only sees those.
pub const TEST_NODE_LABEL: &str = "imp.dev/test-node";

/// Short timings so every timed transition happens within a few seconds.
pub fn fast_timing() -> Timing {
    Timing {
        node_not_ready_grace: Duration::from_secs(2),
        heartbeat_stale_after: Duration::from_secs(2),
        finalizer_timeout: Duration::from_secs(2),
        unschedulable_retry: Duration::from_millis(500),
        resync: Duration::from_secs(5),
        gauge_refresh: Duration::from_millis(200),
        ipam_sweep: Duration::from_secs(1),
    }
}

pub struct Harness {
    pub env: TestEnv,
    pub client: Client,
    pub ns: String,
    pub metrics: VmMetrics,
    registry: Registry,
    controller: Option<JoinHandle<()>>,
    heartbeats: Vec<(String, JoinHandle<()>)>,
    classes: Vec<String>,
}

impl Harness {
    pub async fn start(prefix: &str) -> Self {
        Self::start_with(prefix, fast_timing()).await
    }

    pub async fn start_with(prefix: &str, timing: Timing) -> Self {
        // IMP_LOG=imp_operator=debug shows the controller's decisions in test output.
        if let Ok(filter) = std::env::var("IMP_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_test_writer()
                .try_init();
        }
        let env = TestEnv::new(prefix).await;
        let client = env.client.clone();
        let ns = env.namespace.clone();
        let index = Index::start(
            client.clone(),
            IndexConfig {
                namespace: Some(ns.clone()),
                node_selector: Some(format!("{TEST_NODE_LABEL}={ns}")),
                lease_namespace: ns.clone(),
            },
        );
        let config = VmControllerConfig {
            timing,
            ..VmControllerConfig::new()
        };
        let metrics = VmMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let ready = Arc::new(AtomicBool::new(false));
        let controller = tokio::spawn(run_vm_controller(
            client.clone(),
            index,
            config,
            metrics.clone(),
            ready.clone(),
        ));
        let started = Instant::now();
        while !ready.load(Ordering::SeqCst) {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "controller caches never filled"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Harness {
            controller: Some(controller),
            env,
            client,
            ns,
            metrics,
            registry,
            heartbeats: vec![],
            classes: vec![],
        }
    }

    /// Fixtures without an in-process controller (a test that runs the operator binary instead).
    pub async fn without_controller(prefix: &str) -> Self {
        let env = TestEnv::new(prefix).await;
        let metrics = VmMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        Harness {
            controller: None,
            client: env.client.clone(),
            ns: env.namespace.clone(),
            env,
            metrics,
            registry,
            heartbeats: vec![],
            classes: vec![],
        }
    }

    pub fn vms(&self) -> Api<ImpVM> {
        self.env.api()
    }

    pub fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    pub fn leases(&self) -> Api<Lease> {
        self.env.api()
    }

    pub fn metrics_text(&self) -> String {
        encode(&self.registry).unwrap()
    }

    /// A cluster-wide unique name for this test's cluster-scoped objects.
    pub fn unique(&self, suffix: &str) -> String {
        format!("{}-{suffix}", self.ns)
    }

    /// A Ready node with `vcpu` CPUs and `memory_mib` allocatable, labelled for this test, with a heartbeat.
    pub async fn add_node(&mut self, suffix: &str, vcpu: u32, memory_mib: u64) -> String {
        self.add_node_with(suffix, vcpu, memory_mib, json!({}), json!({}))
            .await
    }

    /// Like [`add_node`], with extra labels and spec fields (taints, unschedulable).
    pub async fn add_node_with(
        &mut self,
        suffix: &str,
        vcpu: u32,
        memory_mib: u64,
        labels: Value,
        spec: Value,
    ) -> String {
        let name = self.unique(suffix);
        let mut all_labels = json!({LABEL_NODE_ENABLED: "true", TEST_NODE_LABEL: self.ns});
        all_labels
            .as_object_mut()
            .unwrap()
            .extend(labels.as_object().unwrap().clone());
        let node: Node = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": all_labels},
            "spec": spec,
        }))
        .unwrap();
        let created = self
            .nodes()
            .create(&PostParams::default(), &node)
            .await
            .unwrap();
        // The API server taints new nodes not-ready; the node lifecycle controller (absent here) lifts the
        // taint once the node reports Ready, so the test does that.
        let taints: Vec<Value> = created
            .spec
            .and_then(|s| s.taints)
            .unwrap_or_default()
            .into_iter()
            .filter(|t| t.key != "node.kubernetes.io/not-ready")
            .map(|t| serde_json::to_value(t).unwrap())
            .collect();
        let patch = json!({"spec": {"taints": taints}});
        self.nodes()
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        let status = json!({"status": {
            "allocatable": {"cpu": vcpu.to_string(), "memory": format!("{memory_mib}Mi")},
            "capacity": {"cpu": vcpu.to_string(), "memory": format!("{memory_mib}Mi")},
            "conditions": [
                node_condition("Ready", "True"),
                node_condition("MemoryPressure", "False"),
                node_condition("DiskPressure", "False"),
                node_condition("PIDPressure", "False"),
            ],
        }});
        self.nodes()
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
        self.start_heartbeat(&name).await;
        name
    }

    /// Sets one node condition (Ready, MemoryPressure, ...), transition time now.
    pub async fn set_node_condition(&self, node: &str, type_: &str, status: &str) {
        let mut current = self.nodes().get_status(node).await.unwrap();
        let conditions = current
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap();
        conditions.retain(|c| c.type_ != type_);
        conditions.push(serde_json::from_value(node_condition(type_, status)).unwrap());
        self.nodes()
            .replace_status(node, &PostParams::default(), &current)
            .await
            .unwrap();
    }

    /// Creates the agent's heartbeat Lease and renews it every 300 ms (the agent's job) until stopped.
    pub async fn start_heartbeat(&mut self, node: &str) {
        let lease: Lease = Lease {
            metadata: kube::api::ObjectMeta {
                name: Some(lease_name(node)),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(node.to_owned()),
                lease_duration_seconds: Some(2),
                renew_time: Some(MicroTime(Timestamp::now())),
                ..Default::default()
            }),
        };
        let leases = self.leases();
        match leases.create(&PostParams::default(), &lease).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("create lease: {e}"),
        }
        let name = lease_name(node);
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let patch = json!({"spec": {"renewTime": MicroTime(Timestamp::now())}});
                let _ = leases
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await;
            }
        });
        self.heartbeats.push((node.to_owned(), task));
    }

    /// The agent on `node` stops renewing its Lease.
    pub fn stop_heartbeat(&mut self, node: &str) {
        for (n, task) in &self.heartbeats {
            if n == node {
                task.abort();
            }
        }
        self.heartbeats.retain(|(n, _)| n != node);
    }

    /// A cluster-scoped ImpVMClass unique to this test; returns its name.
    pub async fn add_class(
        &mut self,
        suffix: &str,
        vcpu: u32,
        memory_mib: u32,
        restart_policy: Option<RestartPolicy>,
    ) -> String {
        let name = self.unique(suffix);
        let mut class = fixtures::class(&name).vcpu(vcpu).memory_mib(memory_mib);
        if let Some(p) = restart_policy {
            class = class.restart(p);
        }
        Api::<ImpVMClass>::all(self.client.clone())
            .create(&PostParams::default(), &class.build())
            .await
            .unwrap();
        self.classes.push(name.clone());
        name
    }

    pub fn networks(&self) -> Api<ImpNetwork> {
        self.env.api()
    }

    /// An ImpNetwork in the test's namespace (gone with it).
    pub async fn add_network(&self, name: &str, subnet: &str, gateway: &str) -> ImpNetwork {
        create_network(&self.env, name, subnet, gateway).await
    }

    /// Creates `vm` (see imp_testkit::fixtures::vm) in the test namespace.
    pub async fn create_vm(&self, vm: impl Into<ImpVM>) -> ImpVM {
        self.vms()
            .create(&PostParams::default(), &vm.into())
            .await
            .unwrap()
    }

    /// Polls until `pred` holds for the VM; panics with the last seen status after `within`.
    pub async fn wait_vm(
        &self,
        name: &str,
        what: &str,
        within: Duration,
        pred: impl Fn(&ImpVM) -> bool,
    ) -> ImpVM {
        waits::wait_vm(&self.vms(), name, what, within, pred, String::new).await
    }

    pub async fn wait_phase(&self, name: &str, phase: VmPhase, within: Duration) -> ImpVM {
        self.wait_vm(name, &format!("{phase:?}"), within, |vm| {
            phase_of(vm) == Some(phase)
        })
        .await
    }

    pub async fn wait_gone(&self, name: &str, within: Duration) -> Duration {
        let started = Instant::now();
        loop {
            match self.vms().get_opt(name).await.unwrap() {
                None => return started.elapsed(),
                Some(vm) if started.elapsed() > within => {
                    panic!("{name} still present after {within:?}: {:#?}", vm.status)
                }
                Some(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Plays the agent: read-modify-write of the status, retried on conflict like the agent does.
    pub async fn agent_status(&self, name: &str, f: impl Fn(&mut ImpVMStatus)) -> ImpVM {
        for _ in 0..50 {
            let mut vm = self.vms().get(name).await.unwrap();
            let status = vm.status.get_or_insert_with(Default::default);
            f(status);
            match self
                .vms()
                .replace_status(name, &PostParams::default(), &vm)
                .await
            {
                Ok(vm) => return vm,
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                Err(e) => panic!("agent status write: {e}"),
            }
        }
        panic!("agent status write kept conflicting");
    }

    /// The agent boots the VM: Starting, then Running with firstRunningTime and Ready.
    pub async fn agent_run(&self, name: &str) -> ImpVM {
        self.agent_status(name, |s| {
            s.phase = Some(VmPhase::Starting);
            s.boot_start_time = Some(Time(Timestamp::now()));
        })
        .await;
        self.agent_status(name, |s| {
            let now = Timestamp::now();
            s.phase = Some(VmPhase::Running);
            s.boot_complete_time = Some(Time(now));
            s.first_running_time.get_or_insert(Time(now));
            s.ip = Some("10.64.0.2".into());
            set_agent_condition(
                s,
                condition::READY,
                ConditionStatus::True,
                reason::GUEST_READY,
            );
        })
        .await
    }

    /// The VM process exits: the agent reports the phase with a reason.
    pub async fn agent_stop(&self, name: &str, phase: VmPhase, reason: &str) -> ImpVM {
        self.agent_status(name, |s| {
            s.phase = Some(phase);
            s.reason = Some(reason.to_owned());
            s.message = Some("runner exited with code 1".into());
            set_agent_condition(
                s,
                condition::READY,
                ConditionStatus::False,
                reason::VM_STOPPED,
            );
        })
        .await
    }

    /// The agent finished teardown (process, TAP, IP, disk released).
    pub async fn agent_torn_down(&self, name: &str) -> ImpVM {
        self.agent_status(name, |s| {
            set_agent_condition(
                s,
                condition::TORN_DOWN,
                ConditionStatus::True,
                reason::TEARDOWN_COMPLETE,
            )
        })
        .await
    }

    /// Deletes the VM and, once the operator has it Terminating, acts as its agent finishing the
    /// teardown (what frees its node's capacity and its address).
    pub async fn delete_and_tear_down(&self, name: &str, within: Duration) {
        self.vms()
            .delete(name, &kube::api::DeleteParams::default())
            .await
            .unwrap();
        self.wait_phase(name, VmPhase::Terminating, within).await;
        self.agent_torn_down(name).await;
    }

    /// (reason, note) of the Events about one VM, oldest first.
    pub async fn events(&self, vm: &str) -> Vec<(String, String)> {
        let events: Api<Event> = self.env.api();
        let mut list: Vec<Event> = events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(vm))
            .collect();
        list.sort_by_key(|e| e.event_time.as_ref().map(|t| t.0));
        list.into_iter()
            .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
            .collect()
    }

    /// Waits until an Event with `reason` about `vm` exists; returns its note.
    pub async fn wait_event(&self, vm: &str, reason: &str, within: Duration) -> String {
        let started = Instant::now();
        loop {
            let events = self.events(vm).await;
            if let Some((_, note)) = events.iter().find(|(r, _)| r == reason) {
                return note.clone();
            }
            if started.elapsed() > within {
                panic!("no {reason} Event for {vm} after {within:?}; events: {events:#?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the controller's metrics contain `line`.
    pub async fn wait_metric(&self, line: &str, within: Duration) {
        let started = Instant::now();
        loop {
            let text = self.metrics_text();
            if text.lines().any(|l| l == line) {
                return;
            }
            if started.elapsed() > within {
                panic!("{line:?} not in metrics after {within:?}:\n{text}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Histogram (count, sum) of the scheduling latency this test's controller recorded.
    pub fn scheduling_latency(&self) -> (u64, f64) {
        let text = self.metrics_text();
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
                .map(|v| v.trim().parse::<f64>().unwrap())
                .unwrap_or(0.0)
        };
        (
            value("imp_vm_scheduling_latency_seconds_count") as u64,
            value("imp_vm_scheduling_latency_seconds_sum"),
        )
    }

    /// Stops the controller and removes what the test created outside its namespace.
    pub async fn finish(mut self) {
        if let Some(c) = &self.controller {
            c.abort();
        }
        for (_, task) in self.heartbeats.drain(..) {
            task.abort();
        }
        cleanup(&self.client, &self.ns, &self.classes).await;
        self.classes.clear();
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // Reached without finish() when a test panicked: still clean up cluster-scoped objects.
        if let Some(c) = &self.controller {
            c.abort();
        }
        for (_, task) in self.heartbeats.drain(..) {
            task.abort();
        }
        let (kubeconfig, ns, classes) = (
            self.env.kubeconfig_path().to_path_buf(),
            self.ns.clone(),
            std::mem::take(&mut self.classes),
        );
        with_fresh_client(&kubeconfig, move |client| async move {
            cleanup(&client, &ns, &classes).await;
        });
    }
}

async fn cleanup(client: &Client, ns: &str, classes: &[String]) {
    let nodes: Api<Node> = Api::all(client.clone());
    let _ = nodes
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(&format!("{TEST_NODE_LABEL}={ns}")),
        )
        .await;
    let class_api: Api<ImpVMClass> = Api::all(client.clone());
    for c in classes {
        let _ = class_api.delete(c, &DeleteParams::default()).await;
    }
    // With the controller gone nobody would release the finalizers, and the namespace could never go.
    let vms: Api<ImpVM> = Api::namespaced(client.clone(), ns);
    if let Ok(list) = vms.list(&ListParams::default()).await {
        for vm in list {
            let patch = json!({"metadata": {"finalizers": null}});
            let _ = vms
                .patch(
                    &vm.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&patch),
                )
                .await;
        }
    }
}

/// Creates an ImpNetwork without NAT, DNS or egress rules in the test's namespace (gone with it).
pub async fn create_network(env: &TestEnv, name: &str, subnet: &str, gateway: &str) -> ImpNetwork {
    let net = ImpNetwork::new(
        name,
        ImpNetworkSpec {
            subnet: subnet.into(),
            gateway: gateway.into(),
            nat: None,
            dns: vec![],
            ipam: None,
            egress: None,
            ingress: vec![],
        },
    );
    env.api::<ImpNetwork>()
        .create(&PostParams::default(), &net)
        .await
        .unwrap()
}

fn node_condition(type_: &str, status: &str) -> Value {
    let now = Timestamp::now().to_string();
    json!({"type": type_, "status": status, "reason": "Test", "message": "set by test",
           "lastHeartbeatTime": now, "lastTransitionTime": now})
}

pub fn condition<'a>(vm: &'a ImpVM, type_: &str) -> Option<&'a Condition> {
    vm.status
        .as_ref()
        .and_then(|s| conditions::find(&s.conditions, type_))
}

/// (status, reason) of a condition, for compact asserts.
pub fn cond(vm: &ImpVM, type_: &str) -> Option<(String, String)> {
    condition(vm, type_).map(|c| (c.status.clone(), c.reason.clone()))
}

/// Sets an ImpVM condition as the agent does (no message, no generation, now).
fn set_agent_condition(s: &mut ImpVMStatus, type_: &str, status: ConditionStatus, reason: &str) {
    conditions::set(
        &mut s.conditions,
        type_,
        status,
        reason,
        "",
        None,
        Timestamp::now(),
    );
}

/// The VM's IPAM address annotation (`ADDR/PREFIX`).
pub fn allocation_of(vm: &ImpVM) -> Option<&str> {
    vm.annotations()
        .get(ANNOTATION_IP_ALLOCATION)
        .map(String::as_str)
}

pub fn node_of(vm: &ImpVM) -> Option<&str> {
    vm.spec.node_name.as_deref()
}

/// A port free on 127.0.0.1 now (for a binary under test to listen on).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
