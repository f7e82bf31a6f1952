//! The VM controller and the built-in IPAM on a real API server, the test playing the node agent:
//! the address is written with the binding, exhaustion keeps a VM Pending until an address frees,
//! and deleted, force-finalized and vanished VMs give their addresses back.

mod vm_common;

use std::{
    net::Ipv4Addr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::StreamExt;
use imp_api::{
    VmPhase,
    names::{condition, reason},
};
use imp_operator::ipam::Ipam;
use imp_testkit::fixtures;
use kube::{
    ResourceExt,
    api::DeleteParams,
    runtime::{WatchStreamExt, watcher},
};
use vm_common::*;

const WAIT: Duration = Duration::from_secs(15);

/// (address, prefix) of the VM's allocation annotation.
fn address(vm: &imp_api::ImpVM) -> (Ipv4Addr, u8) {
    let a = allocation_of(vm).unwrap_or_else(|| panic!("no allocation on {vm:#?}"));
    let (ip, prefix) = a.split_once('/').expect("ADDR/PREFIX");
    (ip.parse().unwrap(), prefix.parse().unwrap())
}

/// Fast timings with the periodic sweep out of the way, so only the release at finalizer removal
/// can free an address.
fn no_sweep() -> imp_operator::vm::Timing {
    imp_operator::vm::Timing {
        ipam_sweep: Duration::from_secs(3600),
        ..fast_timing()
    }
}

/// Waits until the VM is held back for `why`: Pending, unbound, no address, Scheduled=False `why`.
async fn wait_no_address(h: &Harness, name: &str, why: &str) {
    let vm = h
        .wait_vm(name, why, WAIT, |vm| {
            vm.status.as_ref().and_then(|s| s.reason.as_deref()) == Some(why)
        })
        .await;
    assert_eq!(phase_of(&vm), Some(VmPhase::Pending));
    assert_eq!((node_of(&vm), allocation_of(&vm)), (None, None));
    assert_eq!(
        cond(&vm, condition::SCHEDULED),
        Some(("False".into(), why.into()))
    );
}

/// A node, a class, ImpNetwork `net` (203.0.113.0/29) and VM `vm1` on it, Scheduled.
async fn scheduled_on_a_network(
    prefix: &str,
    timing: imp_operator::vm::Timing,
) -> (Harness, String, String, imp_api::ImpVM) {
    let mut h = Harness::start_with(prefix, timing).await;
    let node = h.add_node("n", 8, 8192).await;
    let class = h.add_class("c", 1, 512, None).await;
    h.add_network("net", "203.0.113.0/29", "203.0.113.1").await;
    h.create_vm(fixtures::vm("vm1").class(&class).network("net"))
        .await;
    let vm = h.wait_phase("vm1", VmPhase::Scheduled, WAIT).await;
    (h, node, class, vm)
}

/// Waits until the network's status records no allocation for `uid`.
async fn wait_released(h: &Harness, net: &str, uid: &str, within: Duration) -> Duration {
    let started = Instant::now();
    loop {
        let n = h.networks().get(net).await.unwrap();
        let allocations = n.status.map(|s| s.allocations).unwrap_or_default();
        if !allocations.values().any(|a| a.uid == uid) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < within,
            "{uid} still holds an address after {within:?}: {allocations:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn scheduled_vms_get_distinct_addresses_in_the_binding() {
    let mut h = Harness::start("vmnet").await;
    let node = h.add_node("n", 8, 8192).await;
    let class = h.add_class("c", 1, 512, None).await;
    // Every version of the VMs the operator binds, as a watcher (the agent) sees them: bound
    // implies an address. (bound versions, versions bound without one)
    let tally = Arc::new(Mutex::new((0usize, Vec::<String>::new())));
    let mut versions = watcher(h.vms(), watcher::Config::default())
        .applied_objects()
        .boxed();
    let watching = {
        let tally = tally.clone();
        tokio::spawn(async move {
            while let Some(Ok(vm)) = versions.next().await {
                if node_of(&vm).is_some() && vm.name_any() != "vm3" {
                    let mut t = tally.lock().unwrap();
                    t.0 += 1;
                    if allocation_of(&vm).is_none() {
                        t.1.push(format!("{} rv {:?}", vm.name_any(), vm.resource_version()));
                    }
                }
            }
        })
    };
    // The network does not exist yet: Pending with the reason, then scheduled once it appears.
    h.create_vm(fixtures::vm("vm1").class(&class).network("net"))
        .await;
    wait_no_address(&h, "vm1", reason::NETWORK_NOT_FOUND).await;
    let note = h.wait_event("vm1", reason::NETWORK_NOT_FOUND, WAIT).await;
    assert!(note.contains("\"net\""), "{note}");

    h.add_network("net", "192.0.2.0/24", "192.0.2.1").await;
    h.create_vm(fixtures::vm("vm2").class(&class).network("net"))
        .await;
    let gateway: Ipv4Addr = "192.0.2.1".parse().unwrap();
    let subnet: ipnet::Ipv4Net = "192.0.2.0/24".parse().unwrap();
    let mut seen = Vec::new();
    for name in ["vm1", "vm2"] {
        let vm = h.wait_phase(name, VmPhase::Scheduled, WAIT).await;
        let (ip, prefix) = address(&vm);
        assert_eq!(prefix, 24);
        assert!(
            subnet.contains(&ip)
                && ip != gateway
                && ip != subnet.network()
                && ip != subnet.broadcast(),
            "{ip}"
        );
        seen.push((ip, vm.uid().unwrap()));
    }
    assert_ne!(seen[0].0, seen[1].0, "one address handed out twice");
    // The durable record on the network agrees with the annotations.
    let status = h.networks().get("net").await.unwrap().status.unwrap();
    for (ip, uid) in &seen {
        assert_eq!(&status.allocations[&ip.to_string()].uid, uid);
    }
    assert_eq!((status.allocated, status.capacity), (Some(2), Some(253)));
    let network = format!("{}/net", h.ns);
    h.wait_metric(
        &format!("imp_network_addresses{{network=\"{network}\",state=\"allocated\"}} 2"),
        WAIT,
    )
    .await;
    h.wait_metric(
        &format!("imp_network_addresses{{network=\"{network}\",state=\"free\"}} 251"),
        WAIT,
    )
    .await;
    assert!(
        h.metrics_text()
            .contains("imp_network_allocation_failures_total{reason=\"NetworkNotFound\"} 1"),
        "{}",
        h.metrics_text()
    );
    // The agent's Running (with status.ip) does not disturb the allocation.
    h.agent_run("vm1").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let vm = h.vms().get("vm1").await.unwrap();
    assert_eq!(address(&vm).0, seen[0].0);

    // Bound by the user: the address is recorded first, then the VM is marked Scheduled.
    h.create_vm(
        fixtures::vm("vm3")
            .class(&class)
            .network("net")
            .bound(&node),
    )
    .await;
    let vm = h.wait_phase("vm3", VmPhase::Scheduled, WAIT).await;
    let (ip, _) = address(&vm);
    assert!(!seen.iter().any(|(s, _)| *s == ip), "{ip} handed out twice");

    watching.abort();
    let (bound, without) = tally.lock().unwrap().clone();
    eprintln!("{bound} versions of vm1/vm2 bound, watched");
    assert!(bound >= 2, "the watcher saw no binding");
    assert!(without.is_empty(), "bound without an address: {without:?}");
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn exhausted_network_keeps_the_vm_pending_until_an_address_frees() {
    let mut h = Harness::start_with("vmnetfull", no_sweep()).await;
    h.add_node("n", 8, 8192).await;
    let class = h.add_class("c", 1, 512, None).await;
    // /30 with the gateway: one address, 198.51.100.2.
    h.add_network("tiny", "198.51.100.0/30", "198.51.100.1")
        .await;
    h.create_vm(fixtures::vm("first").class(&class).network("tiny"))
        .await;
    let first = h.wait_phase("first", VmPhase::Scheduled, WAIT).await;
    assert_eq!(allocation_of(&first), Some("198.51.100.2/30"));

    h.create_vm(fixtures::vm("second").class(&class).network("tiny"))
        .await;
    wait_no_address(&h, "second", reason::NETWORK_EXHAUSTED).await;
    let note = h
        .wait_event("second", reason::NETWORK_EXHAUSTED, WAIT)
        .await;
    assert!(
        note.contains("tiny") && note.contains("capacity 1"),
        "{note}"
    );
    h.wait_metric(
        "imp_network_allocation_failures_total{reason=\"NetworkExhausted\"} 1",
        WAIT,
    )
    .await;
    // Retries (every 500 ms here) neither bind it nor repeat the Event or the count.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let vm = h.vms().get("second").await.unwrap();
    assert_eq!(phase_of(&vm), Some(VmPhase::Pending));
    let events = h.events("second").await;
    assert_eq!(
        events
            .iter()
            .filter(|(r, _)| r == reason::NETWORK_EXHAUSTED)
            .count(),
        1,
        "{events:?}"
    );
    assert!(
        h.metrics_text()
            .contains("imp_network_allocation_failures_total{reason=\"NetworkExhausted\"} 1")
    );
    let status = h.networks().get("tiny").await.unwrap().status.unwrap();
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == condition::NETWORK_READY)
        .unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", reason::NETWORK_EXHAUSTED)
    );

    // The first VM goes (the agent tears it down): its address passes to the second.
    h.agent_run("first").await;
    h.delete_and_tear_down("first", WAIT).await;
    h.wait_gone("first", WAIT).await;
    let gone = Instant::now();
    let vm = h.wait_phase("second", VmPhase::Scheduled, WAIT).await;
    eprintln!(
        "freed address reused {:?} after the first VM was gone",
        gone.elapsed()
    );
    assert_eq!(allocation_of(&vm), Some("198.51.100.2/30"));
    assert!(node_of(&vm).is_some());
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn force_finalized_vm_gives_its_address_back() {
    let (mut h, node, class, vm) = scheduled_on_a_network("vmnetforce", no_sweep()).await;
    let (ip, _) = address(&vm);
    let uid = vm.uid().unwrap();
    h.agent_run("vm1").await;

    // The node goes away with the VM on it; deleting the VM forces its finalizer.
    h.nodes()
        .delete(&node, &DeleteParams::default())
        .await
        .unwrap();
    h.wait_phase("vm1", VmPhase::Failed, WAIT).await;
    h.vms()
        .delete("vm1", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("vm1", WAIT).await;
    h.wait_event("vm1", reason::FINALIZER_FORCED, WAIT).await;
    // Released before the finalizer went: already free when the VM is gone.
    let status = h.networks().get("net").await.unwrap().status.unwrap();
    assert!(
        !status.allocations.values().any(|a| a.uid == uid),
        "{:?}",
        status.allocations
    );
    assert_eq!(status.allocated, Some(0));

    // A new VM on a new node gets the lowest free address again: the one vm1 had.
    h.add_node("n2", 8, 8192).await;
    h.create_vm(fixtures::vm("vm2").class(&class).network("net"))
        .await;
    let vm = h.wait_phase("vm2", VmPhase::Scheduled, WAIT).await;
    assert_eq!(address(&vm).0, ip);
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn addresses_of_vms_that_vanished_are_swept() {
    let (h, _, _, vm) = scheduled_on_a_network("vmnetsweep", fast_timing()).await;
    let (ip, _) = address(&vm);

    // An allocation whose VM does not exist (deleted while no operator ran).
    let ipam = Ipam::new(h.client.clone());
    let ghost = ipam
        .allocate(&h.ns, "net", "ghost", "ghost-uid")
        .await
        .unwrap();
    assert_ne!(ghost.ip, ip);
    let took = wait_released(&h, "net", "ghost-uid", WAIT).await;
    eprintln!(
        "swept {} of a VM that does not exist in {took:?} (sweep every 1s)",
        ghost.ip
    );
    // Existing VMs keep theirs through further sweeps.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = h.networks().get("net").await.unwrap().status.unwrap();
    assert_eq!(
        status
            .allocations
            .get(&ip.to_string())
            .map(|a| a.uid.clone()),
        vm.uid()
    );
    assert_eq!(status.allocations.len(), 1, "{:?}", status.allocations);
    h.finish().await;
}
