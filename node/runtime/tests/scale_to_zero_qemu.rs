//! ScaleToZero on a real guest (issue 19): the real `imp-agent` against a real kube-apiserver
//! (testkit TestEnv), the real `imp-runtime` with its QEMU backend (TCG, Debian's kernel, Imp's
//! initrd) inside a node namespace this test creates, a client in an "internet" namespace
//! routed through it:
//!
//! ```text
//!  guest 198.51.100.7 ─TAP─ impbr… (198.51.100.1)   node: up0 192.0.2.2 ─veth─ wan0 192.0.2.1
//!  `nc -ll -p 8080` answering            imp-runtime, QEMU, nft              (the client)
//!  each line with `pong <line>`
//! ```
//!
//! The listener is started in the guest over its vsock agent (an ImpVM has no command of its
//! own); ImpNetwork `spec.ingress` admits the client's connections to port 8080. Without
//! IMP_SCALE_TO_ZERO=true the VM stays Running past idleTimeout (its TAP counters still for
//! longer than that) with `ScaleToZeroDisabled`; with it, no traffic for idleTimeout (10 s) ->
//! Suspended (QEMU and vhost-device-vsock gone); a TCP connection from the client namespace
//! wakes it, and that same connection completes against the restored guest: the same boot and
//! the same listener process. Prints a MEASURE line (idle -> Suspended, client SYN -> Running,
//! the waking exchange).
//!
//! Runs when the QEMU path can (imp_testkit::qemu) and with root and nft; otherwise it says
//! what it skipped, or fails under IMP_REQUIRE_QEMU=1 / IMP_REQUIRE_ROOT=1 (guest/vm-test.sh
//! runs it). Everything (namespaces with their links and rules, QEMU, vhost-device-vsock, the
//! agent, the runtime, the registry) is removed on drop, also when an assertion fails.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use base64::Engine;
use common::agent::{
    Agent, cond, events_of, forward_into, idle_suspends_all_woken, pair, phase_of, ping_from, tail,
};
use common::scale_to_zero::{NETWORK, VM_IP, admitting_network, node_state, vm_addr};
use common::{Harness, TestNetwork, busybox_layer, network_tests_can_run};
use imp_api::names::{self, condition, reason};
use imp_api::{DesiredState, ImpNetwork, ImpVM, ImpVMClass, VmPhase};
use imp_common::SecretString;
use imp_guest::host::HostClient;
use imp_guest::protocol::{Exec, GuestToHost};
use imp_runtime::api::{LinkStats, VmState};
use imp_testkit::oci::push_gzip_image;
use imp_testkit::qemu;
use imp_testkit::registry::{Registry, RegistryOptions};
use imp_testkit::{TestEnv, fixtures};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use serde_json::json;

const VM: &str = "sleepy";
/// The ImpVM's idleTimeout (the smallest the API allows).
const IDLE: Duration = Duration::from_secs(10);

/// The guest's base: static busybox and `/bin/pong`, which answers one line.
fn layers() -> Vec<Vec<u8>> {
    vec![
        busybox_layer()
            .file(
                "bin/pong",
                b"#!/bin/sh\nread line\necho \"pong $line\"\n",
                0o755,
            )
            .into_gzip(),
    ]
}

/// The TAP byte counters as the agent reads them, and when they last moved.
struct Counters {
    last: Option<(u64, u64)>,
    moved: Instant,
    /// Movements seen: (when, rx delta, tx delta).
    log: Vec<(Instant, u64, u64)>,
}

impl Counters {
    fn new() -> Counters {
        Counters {
            last: None,
            moved: Instant::now(),
            log: Vec::new(),
        }
    }

    fn observe(&mut self, s: &LinkStats) {
        let now = (s.rx_bytes, s.tx_bytes);
        if let Some(prev) = self.last
            && prev != now
        {
            self.moved = Instant::now();
            self.log.push((self.moved, now.0 - prev.0, now.1 - prev.1));
        }
        self.last = Some(now);
    }

    /// The movements since `t`, for messages: "+4.1s rx+90 tx+0".
    fn since(&self, t: Instant) -> Vec<String> {
        self.log
            .iter()
            .filter(|(at, _, _)| *at >= t)
            .map(|(at, rx, tx)| {
                format!(
                    "+{:.1}s rx+{rx} tx+{tx}",
                    at.duration_since(t).as_secs_f64()
                )
            })
            .collect()
    }
}

struct World {
    env: TestEnv,
    rt: Harness,
}

impl World {
    fn vms(&self) -> Api<ImpVM> {
        self.env.api()
    }

    /// Polls the ImpVM (and the TAP counters into `counters`) every 100 ms until `pred`.
    async fn wait_vm(
        &self,
        what: &str,
        within: Duration,
        agent: &Agent,
        uid: &str,
        counters: &mut Counters,
        pred: impl Fn(&ImpVM) -> bool,
    ) -> ImpVM {
        let started = Instant::now();
        loop {
            let vm = self.vms().get(VM).await.unwrap();
            if pred(&vm) {
                return vm;
            }
            if let Ok(s) = self.rt.client.linkstats(uid).await {
                counters.observe(&s);
            }
            if started.elapsed() > within {
                panic!(
                    "{VM}: not {what} after {within:?}; status: {:#?}\nTAP counter movements in that time: {:?}\nagent log tail:\n{}\nruntime log tail:\n{}",
                    vm.status,
                    counters.since(started),
                    tail(&agent.log(), 60),
                    tail(&self.rt.runtime_log(), 30)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_phase(
        &self,
        phase: VmPhase,
        within: Duration,
        agent: &Agent,
        uid: &str,
        counters: &mut Counters,
    ) -> ImpVM {
        self.wait_vm(&format!("{phase:?}"), within, agent, uid, counters, |vm| {
            phase_of(vm) == Some(phase)
        })
        .await
    }

    /// Waits (30 s: Events are published after the write they report) for an Event on the VM
    /// of `type_` with `reason`; returns its note.
    async fn wait_event(&self, type_: &str, reason: &str) -> String {
        let started = Instant::now();
        loop {
            let seen = events_of(&self.env, VM).await;
            if let Some((_, _, note)) = seen.iter().find(|(t, r, _)| t == type_ && r == reason) {
                return note.clone();
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{VM}: no {type_} {reason} Event: {seen:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Polls the TAP counters until they stood still for `quiet` (within 180 s) while the VM
    /// stays Running; how long they were still.
    async fn wait_quiet(
        &self,
        agent: &Agent,
        uid: &str,
        counters: &mut Counters,
        quiet: Duration,
    ) -> Duration {
        let started = Instant::now();
        loop {
            let s = self.rt.client.linkstats(uid).await.unwrap();
            counters.observe(&s);
            if counters.moved.elapsed() >= quiet {
                return counters.moved.elapsed();
            }
            let vm = self.vms().get(VM).await.unwrap();
            assert_eq!(
                phase_of(&vm),
                Some(VmPhase::Running),
                "{:#?}\nagent log tail:\n{}",
                vm.status,
                tail(&agent.log(), 40)
            );
            assert!(
                started.elapsed() < Duration::from_secs(180),
                "the VM's link never stood still for {quiet:?}: {:?}",
                counters.since(started)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn runtime_state(&self, uid: &str) -> VmState {
        self.rt.client.inspect(uid).await.unwrap().state
    }

    async fn guest(&self, uid: &str) -> HostClient {
        let info = self.rt.client.vsock(uid).await.unwrap();
        // Generous: a TCG guest on a loaded host answers slowly right after a resume.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        let mut c = imp_guest::host::connect(&info.path, info.guest_agent_port, deadline)
            .await
            .unwrap_or_else(|e| panic!("the guest agent of {uid} does not answer: {e}"));
        c.set_answer_timeout(Duration::from_secs(120));
        c
    }
}

/// [`common::exec`] with the guest's busybox on PATH.
fn exec(id: &str, argv: &[&str]) -> Exec {
    Exec {
        env: BTreeMap::from([("PATH".into(), SecretString::from("/bin"))]),
        ..common::exec(id, argv)
    }
}

/// `sh -c script` in the guest to completion: its exit code and stdout+stderr.
async fn sh(g: &mut HostClient, id: &str, script: &str) -> (Option<i32>, String) {
    let mut req = exec(id, &["/bin/sh", "-c", script]);
    req.stream_output = true;
    req.timeout_s = Some(60);
    g.exec(req).await.unwrap();
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(120), g.recv())
            .await
            .unwrap_or_else(|_| panic!("{script}: no Exited"))
            .unwrap();
        match msg {
            GuestToHost::Output(o) if o.id == id => {
                out.extend(
                    base64::engine::general_purpose::STANDARD
                        .decode(&o.data_b64)
                        .unwrap(),
                );
            }
            GuestToHost::Exited(e) if e.id == id => {
                return (e.code, String::from_utf8_lossy(&out).into_owned());
            }
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_to_zero_on_a_real_guest_idles_to_suspended_and_a_client_connection_wakes_it() {
    let Some(s) = qemu::setup_or_skip() else {
        return;
    };
    if !network_tests_can_run() {
        return;
    }
    // The control plane first: testkit's spawner thread starts with it and every process it
    // spawns later (the registry too) inherits that thread's network namespace, the host's.
    let env = TestEnv::new("s2z-qemu").await;
    // Declared before the runtime, dropped after it and its VMMs.
    let tn = TestNetwork::new("impsq");
    let files = tempfile::tempdir().unwrap();
    let initrd = files.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);
    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    push_gzip_image(&registry.host(), "imp/s2z-base:qemu", layers()).await;
    // The runtime pulls through a forwarder on the node namespace's loopback.
    let host = forward_into(&tn, &registry.host());
    let base = format!("{host}/imp/s2z-base:qemu");
    let mut rt = Harness::qemu(&s, &initrd, host);
    rt.netns = Some(tn.node.clone());
    rt.start_runtime().await;
    let w = World { env, rt };
    let node = format!("{}-node", w.env.namespace);
    let class = format!("{}-qemu", w.env.namespace);
    Api::<ImpVMClass>::all(w.env.client.clone())
        .create(
            &PostParams::default(),
            &fixtures::class(&class)
                .vcpu(1)
                .memory_mib(256)
                .disk_gib(1)
                .build(),
        )
        .await
        .unwrap();
    admitting_network(&w.env, &tn).await;

    // First an agent without IMP_SCALE_TO_ZERO: the VM boots, runs and says why it does not
    // sleep. The test plays the operator: binding, finalizer, IPAM annotation, Scheduled.
    let agent = Agent::start(&w.env, &w.rt, &node, 1, &[]);
    let mut vm = fixtures::vm(VM)
        .persistent()
        .network(NETWORK)
        .desired(DesiredState::ScaleToZero)
        .idle_timeout("10s")
        .class(&class)
        .image(&base)
        .bound(&node)
        .finalizer(names::FINALIZER_VM_CLEANUP)
        .build();
    vm.metadata.annotations = Some(BTreeMap::from([(
        names::ANNOTATION_IP_ALLOCATION.to_owned(),
        format!("{VM_IP}/24"),
    )]));
    let vm = w.vms().create(&PostParams::default(), &vm).await.unwrap();
    let uid = vm.uid().unwrap();
    w.vms()
        .patch_status(
            VM,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"phase": VmPhase::Scheduled}})),
        )
        .await
        .unwrap();
    let mut counters = Counters::new();
    let booting = Instant::now();
    // TCG boots take a while; the runtime's boot timeout is 240 s.
    w.wait_phase(
        VmPhase::Running,
        Duration::from_secs(300),
        &agent,
        &uid,
        &mut counters,
    )
    .await;
    let boot_secs = booting.elapsed().as_secs_f64();
    let vm = w
        .wait_vm(
            reason::SCALE_TO_ZERO_DISABLED,
            Duration::from_secs(30),
            &agent,
            &uid,
            &mut counters,
            |vm| cond(vm, condition::SUSPENDED) == pair("False", reason::SCALE_TO_ZERO_DISABLED),
        )
        .await;
    assert_eq!(phase_of(&vm), Some(VmPhase::Running));
    w.wait_event("Warning", reason::SCALE_TO_ZERO_DISABLED)
        .await;

    // The listener, started over the guest's vsock agent (its own connection; imp-agent may
    // hold another). The exec table keeps it by id: the same pid after the resume.
    let mut g = w.guest(&uid).await;
    let boot_id = g.hello().boot_id.clone();
    let listener = g
        .exec(exec(
            "pong-listener",
            &["/bin/busybox", "nc", "-ll", "-p", "8080", "-e", "/bin/pong"],
        ))
        .await
        .unwrap();
    drop(g);
    // The client, routed through the node and admitted by spec.ingress, gets its answer
    // (retried for a while: nc may not listen yet).
    let started = Instant::now();
    let took = loop {
        match ping_from(&tn.inet, vm_addr(), Duration::from_secs(10)) {
            Ok((answer, took)) => {
                assert_eq!(answer, "pong ping\n");
                break took;
            }
            Err(e) if started.elapsed() > Duration::from_secs(60) => panic!(
                "client -> running VM: {e}\n{}\nruntime log tail:\n{}",
                node_state(&tn),
                tail(&w.rt.runtime_log(), 30)
            ),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    };
    println!(
        "client -> running guest: {:.1} ms (boot to phase Running {boot_secs:.1} s)",
        took.as_secs_f64() * 1000.0
    );

    // Without the flag: the TAP counters stand still for longer than idleTimeout, and the VM
    // keeps running, the runtime too.
    let quiet_from = Instant::now();
    let quiet = w
        .wait_quiet(&agent, &uid, &mut counters, IDLE + Duration::from_secs(3))
        .await;
    let vm = w.vms().get(VM).await.unwrap();
    assert_eq!(phase_of(&vm), Some(VmPhase::Running), "{:#?}", vm.status);
    assert_eq!(w.runtime_state(&uid).await, VmState::Running);
    assert!(
        !agent.metrics().contains("imp_agent_vm_suspends_total{"),
        "suspended without IMP_SCALE_TO_ZERO"
    );
    println!(
        "without IMP_SCALE_TO_ZERO: still Running after its link was quiet {:.1} s (idleTimeout 10 s); \
         TAP counter movements after the exchange: {:?}",
        quiet.as_secs_f64(),
        counters.since(quiet_from)
    );
    drop(agent);

    // Now with IMP_SCALE_TO_ZERO=true: the notice goes, the idle clock starts. The last
    // traffic is one more exchange of the client's.
    let agent = Agent::start(&w.env, &w.rt, &node, 2, &[("IMP_SCALE_TO_ZERO", "true")]);
    let (answer, took) = ping_from(&tn.inet, vm_addr(), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("client -> running VM: {e}\n{}", node_state(&tn)));
    assert_eq!(answer, "pong ping\n");
    let last_exchange = Instant::now() - took;
    let vm = w
        .wait_phase(
            VmPhase::Suspended,
            Duration::from_secs(180),
            &agent,
            &uid,
            &mut counters,
        )
        .await;
    let idle = last_exchange.elapsed();
    let after_counters = counters.moved.elapsed();
    assert!(
        idle >= IDLE,
        "suspended {idle:?} after the last exchange (idleTimeout 10s)"
    );
    assert_eq!(
        cond(&vm, condition::SUSPENDED),
        pair("True", reason::IDLE_TIMEOUT)
    );
    assert_eq!(
        cond(&vm, condition::READY),
        pair("False", reason::VM_SUSPENDED)
    );
    assert_eq!(w.runtime_state(&uid).await, VmState::Suspended);
    assert!(
        w.rt.vmm_processes().is_empty(),
        "a suspended VM has no QEMU nor vhost-device-vsock: {:?}",
        w.rt.vmm_processes()
    );
    w.wait_event("Normal", reason::IDLE_TIMEOUT).await;
    let suspended_note = w.wait_event("Normal", reason::VM_SUSPENDED).await;
    let background = counters.since(last_exchange + took);
    // Stays asleep without traffic.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        phase_of(&w.vms().get(VM).await.unwrap()),
        Some(VmPhase::Suspended)
    );
    let stats = w.rt.client.linkstats(&uid).await.unwrap();
    assert_eq!(stats.wake_packets, 0, "{stats:?}");

    // The client connects: its SYN is forwarded towards the VM and counted, the agent resumes
    // the VM, and a retransmitted SYN reaches the restored guest, whose listener answers.
    let client_ns = tn.inet.clone();
    let sent = Instant::now();
    let client =
        std::thread::spawn(move || ping_from(&client_ns, vm_addr(), Duration::from_secs(60)));
    let vm = w
        .wait_phase(
            VmPhase::Running,
            Duration::from_secs(90),
            &agent,
            &uid,
            &mut counters,
        )
        .await;
    let woke_after = sent.elapsed();
    let outcome = client.join().unwrap();
    let (answer, took) = outcome.unwrap_or_else(|e| {
        panic!(
            "client -> suspended VM: {e}\n{}\nagent log tail:\n{}\nruntime log tail:\n{}",
            node_state(&tn),
            tail(&agent.log(), 60),
            tail(&w.rt.runtime_log(), 30)
        )
    });
    assert_eq!(answer, "pong ping\n");
    assert_eq!(
        cond(&vm, condition::SUSPENDED),
        pair("False", reason::WOKEN_BY_TRAFFIC)
    );
    assert_eq!(
        cond(&vm, condition::READY),
        pair("True", reason::GUEST_READY)
    );
    assert_eq!(w.runtime_state(&uid).await, VmState::Running);
    w.wait_event("Normal", reason::WOKEN_BY_TRAFFIC).await;
    let resumed_note = w.wait_event("Normal", reason::VM_RESUMED).await;
    // The same guest: same boot, the exec table knows the listener (same pid), and it runs.
    let mut g = w.guest(&uid).await;
    assert_eq!(g.hello().boot_id, boot_id, "restored, not rebooted");
    let again = g
        .exec(exec(
            "pong-listener",
            &["/bin/busybox", "nc", "-ll", "-p", "8080", "-e", "/bin/pong"],
        ))
        .await
        .unwrap();
    assert_eq!(again.pid, listener.pid, "the exec table survived");
    // Imp's guests are IPv4 only: imp-guest turns IPv6 off on eth0 before the link comes up,
    // so no router solicitation or MLD report ever moved the TAP counters of the idle VM.
    let check = format!(
        "kill -0 {} && busybox cat /proc/sys/net/ipv6/conf/eth0/disable_ipv6 && \
         busybox grep -E 'Icmp6Out(RouterSolicits|MLDv2Reports|NeighborSolicits) ' /proc/net/snmp6",
        listener.pid
    );
    let (code, chatter) = sh(&mut g, "check-listener", &check).await;
    assert_eq!(
        code,
        Some(0),
        "the listener runs after the resume: {chatter}"
    );
    let chatter: Vec<String> = chatter
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(
        chatter.first().map(String::as_str),
        Some("1"),
        "eth0 disable_ipv6: {chatter:?}"
    );
    assert!(
        chatter[1..].iter().all(|l| l.ends_with(" 0")),
        "the guest sent IPv6: {chatter:?}"
    );
    drop(g);
    let m = agent.metrics();
    let wake = idle_suspends_all_woken(&m);
    println!(
        "MEASURE ScaleToZero on a real guest (QEMU TCG, 256 MiB): suspended {:.1} s after the last \
         exchange, {:.1} s after the TAP counters last moved (idleTimeout 10 s; {suspended_note}); \
         client SYN -> phase Running {:.2} s (wake seen -> Running {wake:.2} s; {resumed_note}); \
         first answer from the resumed guest {:.2} s after the client's first SYN",
        idle.as_secs_f64(),
        after_counters.as_secs_f64(),
        woke_after.as_secs_f64(),
        took.as_secs_f64(),
    );
    println!(
        "TAP counter movements between the last exchange and Suspended: {background:?}; the guest's IPv6 counters since boot: {chatter:?}"
    );
    drop(agent);
    let _ = w
        .env
        .api::<ImpNetwork>()
        .delete(NETWORK, &DeleteParams::default())
        .await;
    let _ = Api::<ImpVMClass>::all(w.env.client.clone())
        .delete(&class, &DeleteParams::default())
        .await;
    let _ = w
        .vms()
        .patch(
            VM,
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
        )
        .await;
    drop(w);
    drop(registry);
}
