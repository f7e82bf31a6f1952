//! `Reidentify` end to end: the real imp-guest agent (host-process mode) driven through the host
//! client over its Unix socket.
//!
//! The network, hostname and machine-id parts run for real, against namespaces this test
//! creates: the agent runs in a network namespace of its own (`ip netns exec`) whose `eth0` is
//! one end of a veth, with a UTS namespace of its own (`unshare --uts`) and `--identity-root` on
//! a temporary directory; the veth's other end sits in a second namespace and plays the
//! clone's gateway. The host's hostname, clock and network are never touched. The entropy part
//! mixes the test's random bytes into the host kernel's pool and reseeds it, which changes
//! nothing anyone relies on. The clock is only checked in host-process mode (the agent does not
//! own it); stepping it, and the entropy ioctls in a guest kernel, run in guest/tests/qemu.rs.
//!
//! Needs root for the namespaces: it says SKIPPED otherwise, and fails under IMP_REQUIRE_ROOT=1.
//! The refusals need nothing.

mod common;

use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use common::AgentProc;
use imp_guest::frame::encode;
use imp_guest::host::{EvidenceError, HostError, IdentityCheck, check_identified};
use imp_guest::protocol::{ErrorCode, GuestToHost, NetIdentity, Reidentify};

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

fn random_b64(n: usize) -> String {
    let mut bytes = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .unwrap();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn request(hostname: &str, network: Option<NetIdentity>) -> Reidentify {
    Reidentify {
        entropy_b64: random_b64(32),
        hostname: hostname.into(),
        machine_id: None,
        wall_clock_unix_ns: now_ns(),
        network,
    }
}

fn guest_error(r: Result<impl std::fmt::Debug, HostError>) -> imp_guest::protocol::ErrorMsg {
    match r {
        Err(HostError::Guest(e)) => e,
        other => panic!("expected an error answer, got {other:?}"),
    }
}

/// Refusals every agent gives, root or not: no identity to manage, and an Exec came first.
#[tokio::test]
async fn reidentify_is_refused_without_an_identity_and_after_an_exec() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let e = guest_error(
        client
            .reidentify(request("clone", None), &IdentityCheck::default())
            .await,
    );
    assert_eq!(e.code, ErrorCode::IdentityFailed);
    assert!(e.message.starts_with("reidentify: identity: "), "{e:?}");

    let (_, _, exited) = common::run(&mut client, common::exec("first", &["true"])).await;
    assert_eq!(exited.code, Some(0));
    // On this connection and on any other: the guest may hold a secret now.
    for mut c in [client, agent.connect().await] {
        let e = guest_error(
            c.reidentify(request("clone", None), &IdentityCheck::default())
                .await,
        );
        assert_eq!(e.code, ErrorCode::IdentityLocked, "{e:?}");
        assert!(e.message.contains("before any secret"), "{e:?}");
    }
}

/// An Exec the guest could not even decode still brought its bytes (perhaps a JIT config).
#[tokio::test]
async fn a_malformed_exec_also_makes_the_identity_final() {
    let agent = AgentProc::start();
    let mut client = agent.connect().await;
    let bad = serde_json::json!({"type": "exec", "id": "x", "argv": "not-a-list"});
    client.send_raw(&encode(&bad).unwrap()).await.unwrap();
    match client.recv().await.unwrap() {
        GuestToHost::Error(e) => assert_eq!(e.code, ErrorCode::InvalidMessage),
        other => panic!("{other:?}"),
    }
    let e = guest_error(
        client
            .reidentify(request("clone", None), &IdentityCheck::default())
            .await,
    );
    assert_eq!(e.code, ErrorCode::IdentityLocked, "{e:?}");
}

/// A network namespace removed on drop (with the veth end inside it).
struct Netns(String);

impl Netns {
    fn add(name: String) -> Netns {
        // A namespace left by an earlier run that was killed.
        let _ = Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        sh(&["ip", "netns", "add", &name]);
        Netns(name)
    }

    fn ip(&self, args: &[&str]) {
        let mut argv = vec!["ip", "-n", &self.0];
        argv.extend_from_slice(args);
        sh(&argv);
    }

    fn ip_json(&self, args: &[&str]) -> serde_json::Value {
        let out = Command::new("ip")
            .args(["-j", "-n", &self.0])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "ip {args:?}: {out:?}");
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
    }

    fn exec(&self, argv: &[&str]) -> std::process::Output {
        Command::new("ip")
            .args(["netns", "exec", &self.0])
            .args(argv)
            .output()
            .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn sh(argv: &[&str]) {
    let st = Command::new(argv[0]).args(&argv[1..]).status().unwrap();
    assert!(st.success(), "{argv:?}");
}

const SNAPSHOT_MAC: &str = "02:00:0a:4d:00:05";

fn new_network(address: &str, mac: &str) -> NetIdentity {
    NetIdentity {
        mac: mac.into(),
        address: address.into(),
        prefix: 24,
        gateway: "10.78.0.1".into(),
        mtu: Some(1400),
        dns: vec!["10.78.0.1".into()],
        dns_search: vec!["clones.test".into()],
    }
}

fn v4_addresses(ns: &Netns) -> Vec<String> {
    ns.ip_json(&["-4", "addr", "show", "dev", "eth0"])[0]["addr_info"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap(), a["prefixlen"]))
        .collect()
}

fn neighbour(ns: &Netns, dev: &str, ip: &str) -> Option<String> {
    ns.ip_json(&["neigh", "show", "dev", dev, "to", ip])
        .as_array()
        .and_then(|a| a.first().cloned())
        .and_then(|n| n["lladdr"].as_str().map(str::to_owned))
}

#[tokio::test]
async fn reidentify_applies_every_part_in_namespaces_and_answers_with_evidence() {
    if !common::is_root() {
        imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "Reidentify in network namespaces",
            "needs root for network and UTS namespaces",
        );
        return;
    }
    let tag = std::process::id();
    let guest = Netns::add(format!("imp-reid-g-{tag}"));
    let gateway = Netns::add(format!("imp-reid-p-{tag}"));
    let (a, b) = (format!("impr{tag}a"), format!("impr{tag}b"));
    sh(&["ip", "link", "add", &a, "type", "veth", "peer", "name", &b]);
    sh(&["ip", "link", "set", &a, "netns", &guest.0]);
    sh(&["ip", "link", "set", &b, "netns", &gateway.0]);
    // The snapshot's network: its MAC, address and route, a learnt neighbour entry.
    guest.ip(&["link", "set", &a, "name", "eth0"]);
    guest.ip(&["link", "set", "eth0", "address", SNAPSHOT_MAC]);
    guest.ip(&["addr", "add", "10.77.0.5/24", "dev", "eth0"]);
    guest.ip(&["link", "set", "eth0", "up"]);
    guest.ip(&["link", "set", "lo", "up"]);
    guest.ip(&["route", "add", "default", "via", "10.77.0.1"]);
    guest.ip(&[
        "neigh",
        "add",
        "10.77.0.1",
        "lladdr",
        "02:00:00:00:00:01",
        "dev",
        "eth0",
        "nud",
        "stale",
    ]);
    // The clone's gateway, which learns addresses from gratuitous ARP.
    gateway.ip(&["addr", "add", "10.78.0.1/24", "dev", &b]);
    gateway.ip(&["link", "set", &b, "up"]);
    let accept = format!("net.ipv4.conf.{b}.arp_accept=1");
    assert!(gateway.exec(&["sysctl", "-qw", &accept]).status.success());

    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("etc")).unwrap();
    std::fs::write(
        root.path().join("etc/machine-id"),
        "5ab0000000000000000000000000cafe\n",
    )
    .unwrap();
    let root_arg = root.path().to_str().unwrap().to_owned();
    let agent = AgentProc::start_wrapped(
        &["ip", "netns", "exec", &guest.0, "unshare", "--uts"],
        &["--identity-root", &root_arg, "--identity-interface", "eth0"],
    );
    let hostname_now = || {
        let out = Command::new("nsenter")
            .args(["-t", &agent.pid().to_string(), "-u", "hostname"])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    };
    let mut client = agent.connect().await;
    let host_hostname = nix::unistd::gethostname().unwrap();

    // Bad input: each named, nothing applied, the generation untouched.
    let mut bad = request(
        "clone-1",
        Some(new_network("10.78.0.9", "02:00:0a:4e:00:09")),
    );
    bad.entropy_b64 = random_b64(16);
    let e = guest_error(client.reidentify(bad, &IdentityCheck::default()).await);
    assert_eq!(e.code, ErrorCode::InvalidRequest);
    assert!(
        e.message.starts_with("reidentify: entropy_b64: 16 bytes"),
        "{e:?}"
    );
    let bad = request(
        "clone-1",
        Some(new_network("10.78.0.9", "01:00:5e:00:00:01")),
    );
    let e = guest_error(client.reidentify(bad, &IdentityCheck::default()).await);
    assert!(e.message.starts_with("reidentify: network.mac: "), "{e:?}");
    let mut bad = request(
        "clone-1",
        Some(new_network("10.78.0.9", "02:00:0a:4e:00:09")),
    );
    bad.network.as_mut().unwrap().gateway = "10.79.0.1".into();
    let e = guest_error(client.reidentify(bad, &IdentityCheck::default()).await);
    assert_eq!(
        e.message,
        "reidentify: network: gateway is outside the address's subnet"
    );
    let mut bad = request("clone-1", None);
    bad.machine_id = Some("NOT-HEX".into());
    let e = guest_error(client.reidentify(bad, &IdentityCheck::default()).await);
    assert!(e.message.starts_with("reidentify: machine_id: "), "{e:?}");
    // A frame of the wrong shape: an invalid message, its values not quoted.
    client
        .send_raw(
            &encode(&serde_json::json!({"type": "reidentify", "hostname": 5, "entropy_b64": 7}))
                .unwrap(),
        )
        .await
        .unwrap();
    match client.recv().await.unwrap() {
        GuestToHost::Error(e) => {
            assert_eq!(e.code, ErrorCode::InvalidMessage);
            assert!(e.message.contains("details withheld"), "{e:?}");
        }
        other => panic!("{other:?}"),
    }
    // A part that fails: this agent does not own the clock, and the host's time is an hour off.
    let mut skewed = request("clone-1", None);
    skewed.wall_clock_unix_ns -= 3_600_000_000_000;
    let e = guest_error(client.reidentify(skewed, &IdentityCheck::default()).await);
    assert_eq!(e.code, ErrorCode::IdentityFailed);
    assert!(e.message.starts_with("reidentify: clock: "), "{e:?}");
    assert_eq!(
        hostname_now(),
        host_hostname.to_str().unwrap(),
        "applied past the failure"
    );
    assert_eq!(v4_addresses(&guest), ["10.77.0.5/24"]);
    assert_eq!(neighbour(&gateway, &b, "10.78.0.9"), None);

    // The first identity.
    let mut first = request(
        "clone-1",
        Some(new_network("10.78.0.9", "02:00:0A:4E:00:09")),
    );
    first.machine_id = Some("0123456789abcdef0123456789abcdef".into());
    let started = Instant::now();
    let one = client
        .reidentify(first.clone(), &IdentityCheck::default())
        .await
        .unwrap();
    let first_ms = started.elapsed().as_secs_f64() * 1e3;
    assert_eq!(one.generation, 1);
    assert_eq!(one.hostname, "clone-1");
    assert_eq!(one.machine_id, "0123456789abcdef0123456789abcdef");
    assert_eq!(
        one.clock_step_ns, 0,
        "host-process mode never steps the clock"
    );
    let net = one.network.as_ref().unwrap();
    assert_eq!(net.mac, "02:00:0a:4e:00:09");
    assert_eq!(net.addresses, ["10.78.0.9/24"]);
    assert_eq!((net.neighbours_flushed, net.gratuitous_arps), (1, 1));
    // What the evidence says is what the namespaces show.
    assert_eq!(hostname_now(), "clone-1");
    assert_eq!(nix::unistd::gethostname().unwrap(), host_hostname);
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/machine-id")).unwrap(),
        "0123456789abcdef0123456789abcdef\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/resolv.conf")).unwrap(),
        "# written by imp-guest (kernel command line, or the host's reidentify)\nsearch clones.test\nnameserver 10.78.0.1\n"
    );
    let link = &guest.ip_json(&["link", "show", "dev", "eth0"])[0];
    assert_eq!(link["address"], "02:00:0a:4e:00:09");
    assert_eq!(link["mtu"], 1400);
    assert_eq!(v4_addresses(&guest), ["10.78.0.9/24"]);
    let routes = guest.ip_json(&["-4", "route", "show", "default"]);
    assert_eq!(routes[0]["gateway"], "10.78.0.1", "{routes}");
    assert_eq!(routes.as_array().unwrap().len(), 1, "{routes}");
    assert_eq!(
        neighbour(&guest, "eth0", "10.77.0.1"),
        None,
        "stale entry kept"
    );
    // The gateway learnt the clone's MAC from the gratuitous ARP, before any traffic.
    assert_eq!(
        neighbour(&gateway, &b, "10.78.0.9").as_deref(),
        Some("02:00:0a:4e:00:09")
    );
    let ping = gateway.exec(&["busybox", "ping", "-c", "1", "-W", "2", "10.78.0.9"]);
    assert!(ping.status.success(), "{ping:?}");

    // A second identity on another connection, as a second clone would get: new entropy, a
    // machine-id the guest makes, another address.
    let first_sample = one.random_sample().unwrap();
    let mut second = request(
        "clone-2",
        Some(new_network("10.78.0.10", "02:00:0a:4e:00:0a")),
    );
    second.entropy_b64 = random_b64(64);
    assert_ne!(second.entropy_b64, first.entropy_b64);
    let mut other = agent.connect().await;
    let check = IdentityCheck {
        previous_samples: vec![first_sample.clone()],
        after_generation: Some(one.generation),
        ..IdentityCheck::default()
    };
    let started = Instant::now();
    let two = other.reidentify(second.clone(), &check).await.unwrap();
    let second_ms = started.elapsed().as_secs_f64() * 1e3;
    assert_eq!(two.generation, 2);
    assert_ne!(two.random_sample().unwrap(), first_sample);
    assert_ne!(two.machine_id, one.machine_id);
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/machine-id")).unwrap(),
        format!("{}\n", two.machine_id)
    );
    assert_eq!(v4_addresses(&guest), ["10.78.0.10/24"]);
    assert_eq!(hostname_now(), "clone-2");
    // Presented as another clone's answer, the first sample is caught.
    let replay = check_identified(&second, &one, &check, 1, Duration::from_millis(5));
    assert!(
        matches!(
            replay,
            Err(EvidenceError::GenerationNotAdvanced { .. } | EvidenceError::RepeatedSample)
        ),
        "{replay:?}"
    );
    println!(
        "MEASURE reidentify round trip (host-process agent, network namespaces): first {first_ms:.1} ms, second {second_ms:.1} ms"
    );
    println!(
        "evidence: sample 1 {} | sample 2 {} | generations {} -> {} | machine-ids {} -> {}",
        one.random_sample_b64,
        two.random_sample_b64,
        one.generation,
        two.generation,
        one.machine_id,
        two.machine_id
    );

    // Once an Exec arrived, the identity is final, on every connection.
    let (_, _, exited) = common::run(&mut other, common::exec("runner", &["true"])).await;
    assert_eq!(exited.code, Some(0));
    let e = guest_error(
        client
            .reidentify(request("clone-3", None), &IdentityCheck::default())
            .await,
    );
    assert_eq!(e.code, ErrorCode::IdentityLocked);
    assert_eq!(hostname_now(), "clone-2");

    drop((client, other));
    let mut agent = agent;
    let log = agent.stop();
    for entropy in [&first.entropy_b64, &second.entropy_b64] {
        assert!(
            !log.contains(entropy.as_str()),
            "entropy in the agent's log"
        );
    }
    assert!(log.contains("identity applied"), "{log}");
}
