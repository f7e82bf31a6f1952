//! Built-in IPAM on the real API server: two allocators with two clients (two operator
//! processes, as far as the API server can tell) race for one network's addresses.

mod vm_common;

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Instant;

use imp_api::ImpNetwork;
use imp_api::ImpNetworkStatus;
use imp_api::names::{condition, reason};
use imp_operator::error::Error;
use imp_operator::ipam::Ipam;
use imp_testkit::TestEnv;
use imp_testkit::cluster::shared_kubeconfig;
use imp_testkit::controlplane::config_from_kubeconfig;
use kube::{Api, Client};
use vm_common::create_network;

/// The network's Ready condition as (status, reason).
fn ready(status: &ImpNetworkStatus) -> (&str, &str) {
    let c = status
        .conditions
        .iter()
        .find(|c| c.type_ == condition::NETWORK_READY)
        .expect("a Ready condition");
    (c.status.as_str(), c.reason.as_str())
}

async fn second_client() -> Client {
    let config = config_from_kubeconfig(shared_kubeconfig()).await.unwrap();
    Client::try_from(config).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_allocations_from_two_clients_never_collide() {
    let env = TestEnv::new("ipam").await;
    let ns = env.namespace.clone();
    create_network(&env, "net", "192.0.2.0/24", "192.0.2.1").await;
    let a = Arc::new(Ipam::new(env.client.clone()));
    let b = Arc::new(Ipam::new(second_client().await));

    let start = Instant::now();
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let ipam = if i % 2 == 0 { a.clone() } else { b.clone() };
            let ns = ns.clone();
            tokio::spawn(async move {
                let uid = format!("uid-{i}");
                let lease = ipam.allocate(&ns, "net", &format!("vm-{i}"), &uid).await;
                (uid, lease.unwrap())
            })
        })
        .collect();
    let mut leases = Vec::new();
    for t in tasks {
        leases.push(t.await.unwrap());
    }
    println!("200 allocations from two clients: {:?}", start.elapsed());

    let ips: BTreeSet<Ipv4Addr> = leases.iter().map(|(_, l)| l.ip).collect();
    assert_eq!(ips.len(), 200, "an address was handed out twice");
    let forbidden: [Ipv4Addr; 3] = [
        "192.0.2.0".parse().unwrap(),
        "192.0.2.1".parse().unwrap(),
        "192.0.2.255".parse().unwrap(),
    ];
    for (_, l) in &leases {
        assert!(!forbidden.contains(&l.ip), "{l:?}");
        assert_eq!((l.prefix_len, l.gateway), (24, forbidden[1]));
    }

    // The durable record agrees with what the callers got.
    let net = env.api::<ImpNetwork>().get("net").await.unwrap();
    let status = net.status.unwrap();
    assert_eq!((status.allocated, status.capacity), (Some(200), Some(253)));
    for (uid, l) in &leases {
        assert_eq!(&status.allocations[&l.ip.to_string()].uid, uid);
    }
    assert_eq!(ready(&status), ("True", reason::ADDRESSES_AVAILABLE));

    // A retry (either replica) returns the same address and writes nothing.
    let rv = net.metadata.resource_version.clone();
    let again = b.allocate(&ns, "net", "vm-0", "uid-0").await.unwrap();
    assert_eq!(again, leases[0].1);
    let net = env.api::<ImpNetwork>().get("net").await.unwrap();
    assert_eq!(net.metadata.resource_version, rv);
}

#[tokio::test]
async fn exhaustion_is_reported_and_freed_addresses_are_reused() {
    let env = TestEnv::new("ipam-full").await;
    let ns = env.namespace.clone();
    // /29 with the gateway: five addresses.
    create_network(&env, "small", "198.51.100.0/29", "198.51.100.1").await;
    let ipam = Ipam::new(env.client.clone());
    let mut held = Vec::new();
    for i in 0..5 {
        held.push(
            ipam.allocate(&ns, "small", &format!("vm-{i}"), &format!("u{i}"))
                .await
                .unwrap()
                .ip,
        );
    }
    match ipam.allocate(&ns, "small", "vm-5", "u5").await {
        Err(Error::NetworkExhausted { network, capacity }) => {
            assert_eq!(network, format!("{ns}/small"));
            assert_eq!(capacity, 5);
        }
        other => panic!("expected NetworkExhausted, got {other:?}"),
    }
    let api: Api<ImpNetwork> = env.api();
    let status = api.get("small").await.unwrap().status.unwrap();
    assert_eq!(ready(&status), ("False", reason::NETWORK_EXHAUSTED));
    assert_eq!(status.allocated, Some(5));

    // u1 deleted normally (released), u3 force-finalized (gone from the live set).
    assert!(ipam.release(&ns, "small", "u1").await.unwrap());
    assert!(
        !ipam.release(&ns, "small", "u1").await.unwrap(),
        "a second release is a no-op"
    );
    let live: BTreeSet<String> = ["u0", "u2", "u4"].map(String::from).into();
    assert_eq!(
        ipam.release_missing(&ns, "small", &live).await.unwrap(),
        [held[3].to_string()]
    );
    let x = ipam.allocate(&ns, "small", "vm-x", "ux").await.unwrap().ip;
    let y = ipam.allocate(&ns, "small", "vm-y", "uy").await.unwrap().ip;
    assert_eq!([x, y], [held[1], held[3]]);
    let status = api.get("small").await.unwrap().status.unwrap();
    assert_eq!(status.allocated, Some(5));
}

#[tokio::test]
async fn unusable_network_names_the_field() {
    let env = TestEnv::new("ipam-bad").await;
    // IPv6 passes the CRD's validation but not the built-in (IPv4) IPAM.
    create_network(&env, "v6", "2001:db8::/64", "2001:db8::1").await;
    let ipam = Ipam::new(env.client.clone());
    match ipam.allocate(&env.namespace, "v6", "vm", "u").await {
        Err(Error::NetworkInvalid { message, .. }) => {
            assert!(message.starts_with("spec.subnet"), "{message}")
        }
        other => panic!("expected NetworkInvalid, got {other:?}"),
    }
    // A deletion is never held up by an unusable network: release still answers.
    assert!(!ipam.release(&env.namespace, "v6", "u").await.unwrap());
    match ipam.allocate(&env.namespace, "absent", "vm", "u").await {
        Err(Error::NetworkNotFound { network }) => {
            assert_eq!(network, format!("{}/absent", env.namespace))
        }
        other => panic!("expected NetworkNotFound, got {other:?}"),
    }
}

/// Two allocators race past the end of a /25: exactly its capacity is handed out, once each,
/// the rest is NetworkExhausted; addresses freed by both in parallel are what a second
/// parallel round gets, again without a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_exhaustion_and_reuse_from_two_clients() {
    let env = TestEnv::new("ipam-race").await;
    let ns = env.namespace.clone();
    // 126 host addresses minus the gateway.
    create_network(&env, "half", "203.0.113.0/25", "203.0.113.1").await;
    let a = Arc::new(Ipam::new(env.client.clone()));
    let b = Arc::new(Ipam::new(second_client().await));
    let pick = |i: usize| {
        if i.is_multiple_of(2) {
            a.clone()
        } else {
            b.clone()
        }
    };

    let round = |range: std::ops::Range<usize>| {
        let tasks: Vec<_> = range
            .map(|i| {
                let (ipam, ns) = (pick(i), ns.clone());
                tokio::spawn(async move {
                    let uid = format!("uid-{i}");
                    let got = ipam.allocate(&ns, "half", &format!("vm-{i}"), &uid).await;
                    (uid, got)
                })
            })
            .collect();
        async move {
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.unwrap());
            }
            out
        }
    };
    let (mut held, mut exhausted) = (Vec::new(), 0);
    for (uid, got) in round(0..200).await {
        match got {
            Ok(lease) => held.push((uid, lease.ip)),
            Err(Error::NetworkExhausted { capacity, .. }) => {
                assert_eq!(capacity, 125);
                exhausted += 1;
            }
            Err(e) => panic!("{uid}: {e}"),
        }
    }
    let ips: BTreeSet<Ipv4Addr> = held.iter().map(|(_, ip)| *ip).collect();
    assert_eq!((held.len(), ips.len(), exhausted), (125, 125, 75));
    let api: Api<ImpNetwork> = env.api();
    let status = api.get("half").await.unwrap().status.unwrap();
    assert_eq!(status.allocated, Some(125));
    assert_eq!(ready(&status), ("False", reason::NETWORK_EXHAUSTED));

    // 50 released in parallel by both allocators, then 50 new VMs in parallel.
    let freed: Vec<(String, Ipv4Addr)> = held.drain(..50).collect();
    let releases: Vec<_> = freed
        .iter()
        .enumerate()
        .map(|(i, (uid, _))| {
            let (ipam, ns, uid) = (pick(i), ns.clone(), uid.clone());
            tokio::spawn(async move { ipam.release(&ns, "half", &uid).await.unwrap() })
        })
        .collect();
    for r in releases {
        assert!(r.await.unwrap(), "a held address was released");
    }
    let mut reused = BTreeSet::new();
    for (uid, got) in round(1000..1050).await {
        assert!(reused.insert(got.unwrap_or_else(|e| panic!("{uid}: {e}")).ip));
    }
    let freed_ips: BTreeSet<Ipv4Addr> = freed.iter().map(|(_, ip)| *ip).collect();
    assert_eq!(reused, freed_ips, "the freed addresses, each once");
    let status = api.get("half").await.unwrap().status.unwrap();
    assert_eq!(status.allocated, Some(125));
    let uids: BTreeSet<&str> = status
        .allocations
        .values()
        .map(|a| a.uid.as_str())
        .collect();
    assert_eq!(uids.len(), 125, "one address per VM");
}
