//! VM networking with real guests: imp-runtime's QEMU backend (TCG) boots two VMs from an
//! image on one ImpNetwork, the runtime running inside a node namespace this test creates:
//!
//! ```text
//!  guest a (198.51.100.10) ─TAP─┐                          ┌────────── "internet" ──────────┐
//!  guest b (198.51.100.11) ─TAP─┴─ impbr… (198.51.100.1)    │ 192.0.2.1 dnsmasq: web.test -> │
//!        node: up0 192.0.2.2 ─veth─ wan0, httpd :9100 (also  │ 192.0.2.80, httpd :8080 (peer, │
//!        on 198.51.100.1 and 169.254.169.254)               │ 20 MiB)                        │
//!                                                           └────────────────────────────────┘
//! ```
//!
//! Guest a gets its address and resolv.conf from the kernel command line, resolves `web.test`
//! through dnsmasq, fetches a page whose server sees the node's uplink address (NAT); it cannot
//! reach the node's addresses, 169.254.169.254 or guest b, nor (the default deny) a host on the
//! node's private uplink network, a pod in a reserved range or a service IP DNATed to that pod
//! (a stand-in for kube-proxy), while the "internet" stays reachable; a spoofed source gets
//! nowhere, and
//! it has no IPv6 route to the host. `kill -9` and restart of the runtime changes nothing and
//! keeps a's connectivity; a repeated setup is a no-op; DELETE of both leaves no link, address,
//! route or nft table of Imp's. Prints the guest's and the node's throughput and latency to
//! the "internet" and the setup time per VM (MEASURE lines). The guests' commands are
//! Debian's static busybox, from the image.
//!
//! Runs when the QEMU path can (imp_testkit::qemu) and with root, nft and dnsmasq; otherwise it
//! says what it skipped, or fails under IMP_REQUIRE_QEMU=1 (guest/vm-test.sh runs it).
//! Everything (namespaces, and with them every link and rule; processes) is removed on drop,
//! also when an assertion fails.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    Children, Harness, TestNetwork, busybox_layer, dnsmasq_argv, nat_attachment,
    network_tests_can_run, output, peer_cgi,
};
use imp_guest::host::HostClient;
use imp_runtime::api::{NetworkAttachment, NetworkSpec, VmSpec, VmState};
use imp_runtime::network::{self, bridge_mac, bridge_name, vm_mac};
use imp_runtime::rootfs::store::ImageSpec;
use imp_testkit::qemu;

const BIG: usize = 20 << 20;
const GATEWAY: &str = "198.51.100.1";
const WEB: &str = "192.0.2.80";

/// A document root for busybox httpd: `index.html` ("up"), `big` (BIG bytes) and
/// `cgi-bin/peer` (answers `peer=<the client address it sees>`).
fn web_root(dir: &Path) {
    peer_cgi(dir);
    std::fs::write(dir.join("index.html"), "up\n").unwrap();
    std::fs::write(dir.join("big"), vec![0u8; BIG]).unwrap();
}

/// The guests' base: Debian's static busybox as /bin/sh and every command the checks use.
fn layers() -> Vec<Vec<u8>> {
    vec![busybox_layer().dir("tmp", 0o1777).into_gzip()]
}

/// One guest's agent connection and a counter for unique exec ids.
struct Guest {
    client: HostClient,
    /// Exec ids are the agent's across connections (a known id re-queries that process).
    session: &'static str,
    execs: u32,
}

impl Guest {
    async fn connect(h: &Harness, uid: &str, session: &'static str) -> Guest {
        let info = h.client.vsock(uid).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let client = imp_guest::host::connect(&info.path, info.guest_agent_port, deadline)
            .await
            .unwrap_or_else(|e| panic!("connect to {uid}: {e}"));
        Guest {
            client,
            session,
            execs: 0,
        }
    }

    /// `sh -c script` to completion: its exit code and stdout+stderr.
    async fn sh(&mut self, script: &str) -> (Option<i32>, String) {
        self.execs += 1;
        let id = format!("{}-{}", self.session, self.execs);
        common::sh(&mut self.client, &id, script, &[]).await
    }

    /// `sh -c script`, which must succeed: its output.
    async fn ok(&mut self, script: &str) -> String {
        let (code, out) = self.sh(script).await;
        assert_eq!(code, Some(0), "{script}:\n{out}");
        out
    }

    /// Whether an HTTP GET of `url` gets an answer within 5 s.
    async fn reaches(&mut self, url: &str) -> bool {
        let (code, _) = self
            .sh(&format!(
                "busybox timeout 5 busybox wget -q -O /dev/null {url}"
            ))
            .await;
        code == Some(0)
    }
}

/// From the node namespace, with the same client as the guests.
fn node_reaches(node: &str, url: &str) -> bool {
    Command::new("ip")
        .args(["netns", "exec", node, "busybox", "timeout", "5"])
        .args(["busybox", "wget", "-q", "-O", "/dev/null", url])
        .status()
        .unwrap()
        .success()
}

/// Everything of Imp's in the node namespace: links, the gateway address, routes, nft tables.
fn imp_leftovers(node: &str, taps: &[&str]) -> Vec<String> {
    let mut left = Vec::new();
    let links = output("ip", &["-n", node, "-o", "link", "show"]);
    for l in links.lines() {
        if l.contains(network::BRIDGE_PREFIX) || taps.iter().any(|t| l.contains(t)) {
            left.push(l.to_owned());
        }
    }
    let addrs = output("ip", &["-n", node, "-o", "addr"]);
    if addrs.contains(&format!("{GATEWAY}/")) {
        left.push("the gateway address".into());
    }
    let routes = output("ip", &["-n", node, "route", "show", "table", "all"]);
    if routes.contains("198.51.100.") {
        left.push(format!("a route to the VM subnet: {routes}"));
    }
    let nft = output("ip", &["netns", "exec", node, "nft", "list", "tables"]);
    if nft.contains(" imp") {
        left.push(format!("nft tables: {nft}"));
    }
    left
}

/// `seconds=` of every "network reconciled" line of a runtime log.
fn reconcile_seconds(log: &str) -> Vec<f64> {
    log.lines()
        .filter(|l| l.contains("network reconciled"))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("seconds="))?
                .parse()
                .ok()
        })
        .collect()
}

fn dnsmasq_or_skip() -> bool {
    let found = Command::new("sh")
        .args(["-c", "command -v dnsmasq"])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        let why = "needs dnsmasq (Debian: dnsmasq-base)";
        assert!(
            !imp_testkit::skip::required("IMP_REQUIRE_ROOT"),
            "IMP_REQUIRE_ROOT=1 but this test {why}"
        );
        imp_testkit::skip::skip_or_fail("IMP_REQUIRE_QEMU", "the real-guest network test", why);
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_guests_get_nat_dns_and_isolation_through_a_restart() {
    let Some(s) = qemu::setup_or_skip() else {
        return;
    };
    if !network_tests_can_run() || !dnsmasq_or_skip() {
        return;
    }
    let id = std::process::id();
    // Declared first, dropped last: after the harness stopped the runtime and its VMMs.
    let tn = TestNetwork::new("impnq");
    let node = tn.node.clone();
    let mut children = Children::default();
    let files = tempfile::tempdir().unwrap();
    let initrd = files.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);

    // The registry runs in the node namespace: the runtime pulls from its loopback there.
    let (registry, base) = tn.registry_in_node("imp/net-base:qemu", layers());

    // The "internet": DNS and a web server on a second address.
    let inet = tn.inet.as_str();
    output(
        "ip",
        &[
            "-n",
            inet,
            "addr",
            "add",
            &format!("{WEB}/32"),
            "dev",
            "wan0",
        ],
    );
    let www = files.path().join("www");
    web_root(&www);
    let dns = dnsmasq_argv("192.0.2.1", "web.test", WEB);
    children.spawn(inet, &dns.iter().map(String::as_str).collect::<Vec<_>>());
    let www_s = www.display().to_string();
    children.spawn(
        inet,
        &["busybox", "httpd", "-f", "-p", "0.0.0.0:8080", "-h", &www_s],
    );
    // Listeners on the node no guest may reach: all its addresses (the uplink, the gateway on
    // the bridge) and a cloud-metadata look-alike.
    output(
        "ip",
        &[
            "-n",
            &node,
            "addr",
            "add",
            "169.254.169.254/32",
            "dev",
            "lo",
        ],
    );
    children.spawn(
        &node,
        &["busybox", "httpd", "-f", "-p", "0.0.0.0:9100", "-h", &www_s],
    );

    // The node's private network on its uplink (10.77.0.0/24, as a cloud VPC is), a "pod" in
    // a reserved range routed out the uplink, and kube-proxy's DNAT of a "service" IP to it
    // (prerouting, before the forward hook): the default deny keeps guests from all three.
    for (ns, args) in [
        (&node, vec!["addr", "add", "10.77.0.2/24", "dev", "up0"]),
        (
            &node,
            vec!["route", "add", "198.18.0.0/16", "via", "192.0.2.1"],
        ),
        (&tn.inet, vec!["addr", "add", "10.77.0.1/24", "dev", "wan0"]),
        (&tn.inet, vec!["addr", "add", "198.18.0.5/32", "dev", "lo"]),
    ] {
        let mut all = vec!["-n", ns.as_str()];
        all.extend(args);
        output("ip", &all);
    }
    let kube_proxy = "table ip kubeproxy { chain pre { type nat hook prerouting priority dstnat; \
                      ip daddr 198.19.0.10 tcp dport 80 dnat to 198.18.0.5:8080; }; }";
    output("ip", &["netns", "exec", &node, "nft", kube_proxy]);

    let mut h = Harness::qemu(&s, &initrd, registry.host());
    h.netns = Some(node.clone());
    // The cluster's pod and service ranges, reserved by the platform.
    const RESERVED: &str = "198.18.0.0/15";
    h.extra_env
        .push(("IMP_NETWORK_RESERVED_CIDRS".into(), RESERVED.into()));
    h.start_runtime().await;

    let net_id = format!("net-uid-{id}");
    let bridge = bridge_name(&net_id);
    let spec = |address: &str| VmSpec {
        vcpu: 1,
        memory_mib: 256,
        base_disk: None,
        image: Some(ImageSpec {
            base: base.clone(),
            runner: None,
            credentials: None,
            pull_policy: None,
        }),
        writable_disk_bytes: Some(64 << 20),
        kernel: None,
        initrd: None,
        extra_boot_args: Some("imp.report_grace_s=60".into()),
        network: Some(NetworkSpec {
            guest_mac: None,
            attachment: Some(nat_attachment(&net_id, address, GATEWAY)),
        }),
        from_template: false,
        warm_paths: Vec::new(),
    };
    let vms = [("neta", "198.51.100.10"), ("netb", "198.51.100.11")];
    let mut put_seconds = Vec::new();
    for (uid, ip) in vms {
        let started = Instant::now();
        let (_, st) = h
            .client
            .ensure_running(uid, &spec(&format!("{ip}/24")))
            .await
            .unwrap_or_else(|e| panic!("PUT {uid}: {e}\n{}", h.runtime_log()));
        assert_eq!(st.state, VmState::Running);
        put_seconds.push((started.elapsed().as_secs_f64(), st.boot_seconds.unwrap()));
    }
    let setup_seconds = reconcile_seconds(&h.runtime_log());
    let mut a = Guest::connect(&h, "neta", "first").await;
    let mut b = Guest::connect(&h, "netb", "first").await;

    // Its address, its route, its resolver: from the kernel command line.
    let addr = a
        .ok("busybox ip -4 addr show dev eth0; busybox ip -4 route")
        .await;
    assert!(addr.contains("inet 198.51.100.10/24"), "{addr}");
    assert!(addr.contains(&format!("default via {GATEWAY}")), "{addr}");
    assert!(
        a.ok("busybox cat /etc/resolv.conf")
            .await
            .contains("nameserver 192.0.2.1"),
        "resolv.conf from imp.dns"
    );
    // A name through dnsmasq in the "internet", then a page whose server sees the node (NAT).
    let resolved = a
        .ok("busybox nslookup web.test | busybox awk '/^Name:/{n=1} n && /^Address/{print $2; exit}'")
        .await;
    assert_eq!(resolved.trim(), WEB, "web.test through dnsmasq");
    let page = a
        .ok(&format!(
            "busybox wget -q -O - http://{WEB}:8080/cgi-bin/peer"
        ))
        .await;
    assert_eq!(
        page, "peer=192.0.2.2",
        "the server sees the node's uplink address"
    );

    // Isolation: guest b listens, the node listens everywhere; guest a reaches none of them,
    // while the node reaches all (the listeners are there: only the guests are kept out).
    b.ok("busybox mkdir -p /tmp/www && echo b > /tmp/www/index.html && busybox httpd -p 7000 -h /tmp/www")
        .await;
    for (what, url) in [
        ("the node's uplink address", "http://192.0.2.2:9100/"),
        ("the gateway address", "http://198.51.100.1:9100/"),
        ("the metadata address", "http://169.254.169.254:9100/"),
        ("the other guest", "http://198.51.100.11:7000/"),
    ] {
        assert!(!a.reaches(url).await, "guest a reached {what}");
        assert!(node_reaches(&node, url), "the node cannot reach {what}");
    }
    // Egress denied by default (issue 30): out of the egress interface like the "internet",
    // yet not reachable; the service IP's DNAT target is the node-reachable pod.
    for (what, url, node_url) in [
        (
            "a host on the node's private uplink network",
            "http://10.77.0.1:8080/",
            "http://10.77.0.1:8080/",
        ),
        (
            "a pod (reserved range)",
            "http://198.18.0.5:8080/",
            "http://198.18.0.5:8080/",
        ),
        (
            "a service IP (DNAT to the pod)",
            "http://198.19.0.10/",
            "http://198.18.0.5:8080/",
        ),
    ] {
        assert!(!a.reaches(url).await, "guest a reached {what}");
        assert!(
            node_reaches(&node, node_url),
            "the node cannot reach {what}"
        );
    }
    assert!(
        a.reaches(&format!("http://{WEB}:8080/")).await,
        "guest a lost the internet"
    );

    // A spoofed source: the same fetch from an address a does not own gets nowhere.
    let spoof = "busybox ip addr add 198.51.100.50/32 dev eth0 && \
                 busybox ip route replace default via 198.51.100.1 src 198.51.100.50";
    a.ok(spoof).await;
    let via_spoof = a.reaches(&format!("http://{WEB}:8080/")).await;
    a.ok(
        "busybox ip route replace default via 198.51.100.1 src 198.51.100.10 && \
          busybox ip addr del 198.51.100.50/32 dev eth0",
    )
    .await;
    assert!(!via_spoof, "a spoofed source address got through");
    assert!(
        a.reaches(&format!("http://{WEB}:8080/")).await,
        "the genuine one does"
    );

    // No IPv6 to the host: no address on the bridge or the TAPs, no route in the guest, and
    // the bridge's would-be link-local address does not answer.
    for link in [bridge.clone(), h.tap_for("neta"), h.tap_for("netb")] {
        let v6 = output("ip", &["-n", &node, "-6", "addr", "show", "dev", &link]);
        assert!(!v6.contains("inet6"), "{link} has IPv6: {v6}");
    }
    let routes6 = a.ok("busybox ip -6 route show; echo end").await;
    assert!(!routes6.contains("default"), "guest IPv6 routes: {routes6}");
    let m = bridge_mac(&net_id);
    let link_local = format!(
        "fe80::{:02x}{:02x}:{:02x}ff:fe{:02x}:{:02x}{:02x}",
        m[0] ^ 2,
        m[1],
        m[2],
        m[3],
        m[4],
        m[5]
    );
    let (code, ping) = a
        .sh(&format!("busybox ping6 -c 1 -W 2 {link_local}%eth0"))
        .await;
    assert_ne!(code, Some(0), "the host answered over IPv6: {ping}");

    // kill -9 and restart of the runtime: the VMs are reattached, nothing of the network is
    // touched, guest a keeps its way out, and a repeated setup is a no-op.
    drop((a, b));
    h.kill9_runtime();
    h.start_runtime().await;
    for (uid, _) in vms {
        assert_eq!(h.client.inspect(uid).await.unwrap().state, VmState::Running);
    }
    assert!(
        !h.runtime_log().contains("network reconciled"),
        "the restarted runtime changed the network:\n{}",
        h.runtime_log()
    );
    let mut a = Guest::connect(&h, "neta", "restarted").await;
    let page = a
        .ok(&format!(
            "busybox wget -q -O - http://{WEB}:8080/cgi-bin/peer"
        ))
        .await;
    assert_eq!(page, "peer=192.0.2.2", "connectivity after the restart");
    let attachments: Vec<_> = vms
        .iter()
        .map(|(_, ip)| nat_attachment(&net_id, &format!("{ip}/24"), GATEWAY))
        .collect();
    let desired = network::desired(
        vms.iter()
            .zip(&attachments)
            .map(|((uid, _), at)| (h.tap_for(uid), vm_mac(uid), at)),
    );
    // With the runtime's own flags: the reserved ranges are part of the rules.
    let admission = network::Admission {
        reserved: vec![RESERVED.parse().unwrap()],
        ..network::Admission::default()
    };
    let again = tn.reconcile_admitting(&desired, &admission);
    assert!(
        again.actions.is_empty() && again.failed.is_empty(),
        "a repeated setup must be a no-op: {again:?}"
    );

    // The node's private network opened by `egress.allow`, inside what the platform allows
    // (--network-allowable-egress-cidrs): reachable from the real guest, and only it; then the
    // rules go back to the runtime's and the range is closed again.
    let private_net: ipnet::Ipv4Net = "10.77.0.0/24".parse().unwrap();
    let opened: Vec<NetworkAttachment> = attachments
        .iter()
        .map(|at| NetworkAttachment {
            egress_allow: vec![private_net],
            ..at.clone()
        })
        .collect();
    let desired_open = network::desired(
        vms.iter()
            .zip(&opened)
            .map(|((uid, _), at)| (h.tap_for(uid), vm_mac(uid), at)),
    );
    let allowing = network::Admission {
        allowable_egress: vec![private_net],
        ..admission.clone()
    };
    let open = tn.reconcile_admitting(&desired_open, &allowing);
    assert!(open.failed.is_empty(), "opening {private_net}: {open:?}");
    assert!(
        a.reaches("http://10.77.0.1:8080/").await,
        "an allowed range stayed closed to the real guest"
    );
    assert!(
        !a.reaches("http://198.18.0.5:8080/").await,
        "opening {private_net} opened the pod range too"
    );
    let closed = tn.reconcile_admitting(&desired, &admission);
    assert!(
        closed.failed.is_empty(),
        "closing {private_net}: {closed:?}"
    );
    assert!(
        !a.reaches("http://10.77.0.1:8080/").await,
        "the range stayed open after the rules went back"
    );

    // Throughput and latency to the "internet", guest vs node, with the same client.
    let big = format!("busybox wget -q -O /dev/null http://{WEB}:8080/big");
    let small = format!(
        "for i in 1 2 3 4 5 6 7 8 9 10; do busybox wget -q -O /dev/null http://{WEB}:8080/; done"
    );
    let started = Instant::now();
    a.ok(&big).await;
    let guest_big = started.elapsed().as_secs_f64();
    let started = Instant::now();
    a.ok(&small).await;
    let guest_small = started.elapsed().as_secs_f64() / 10.0;
    let on_node = |script: &str| {
        let started = Instant::now();
        output("ip", &["netns", "exec", &node, "sh", "-c", script]);
        started.elapsed().as_secs_f64()
    };
    let node_big = on_node(&big);
    let node_small = on_node(&small) / 10.0;
    let mbps = |secs: f64| BIG as f64 * 8.0 / secs / 1e6;
    println!(
        "MEASURE NAT throughput, 20 MiB HTTP download (busybox wget): guest {:.0} Mbit/s ({guest_big:.2} s), node {:.0} Mbit/s ({node_big:.2} s)",
        mbps(guest_big),
        mbps(node_big)
    );
    println!(
        "MEASURE NAT latency, one HTTP GET incl. starting wget: guest {:.1} ms, node {:.1} ms",
        guest_small * 1e3,
        node_small * 1e3
    );
    println!(
        "MEASURE setup per VM: network reconcile {setup_seconds:?} s; PUT to Running (with boot) {:?} s",
        put_seconds
            .iter()
            .map(|(put, boot)| format!("{put:.2} (boot {boot:.2})"))
            .collect::<Vec<_>>()
    );

    // Teardown: nothing of Imp's is left.
    drop(a);
    for (uid, _) in vms {
        h.client.delete(uid).await.unwrap();
    }
    let taps: Vec<String> = vms.iter().map(|(uid, _)| h.tap_for(uid)).collect();
    let taps: Vec<&str> = taps.iter().map(String::as_str).collect();
    assert_eq!(imp_leftovers(&node, &taps), Vec::<String>::new());
    drop(registry);
}
