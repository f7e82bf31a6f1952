//! The node data plane (imp_runtime::network) on real kernel networking, only inside network
//! namespaces this test creates:
//!
//! ```text
//!  guest g1 (198.51.100.10) ─veth─┐                      ┌──────────── "internet" ─────────────┐
//!  guest g2 (198.51.100.11) ─veth─┼─ impbr… (198.51.100.1) │ 192.0.2.1: dnsmasq, HTTP, UDP sink │
//!  real TAP (198.51.100.12) ──────┘   node: up0 192.0.2.2 ─veth─ wan0                         │
//!                                                        └─────────────────────────────────────┘
//! ```
//!
//! A guest here is a namespace on a veth (the kernel path is the same as for a TAP; one real
//! TAP is attached too). Needs root, `nft` and `dnsmasq`; skips with a message otherwise, and
//! fails instead under IMP_REQUIRE_ROOT=1. Every namespace, process and listener is removed on
//! drop, also when an assertion fails.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::output;
use imp_runtime::network::{self, Attachment, Port, VmNetwork, bridge_name, vm_mac};

const UNREACHABLE_WAIT: Duration = Duration::from_millis(700);

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn available(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Run `f` on a thread that has entered network namespace `ns`: its sockets, netlink
/// connections, /proc/sys/net writes and child processes all belong to that namespace.
fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter(ns);
            f()
        })
        .join()
        .unwrap()
    })
}

fn enter(ns: &str) {
    let fd = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
    nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
}

/// Namespaces, background processes and listener threads, removed in reverse on drop.
#[derive(Default)]
struct World {
    netns: Vec<String>,
    children: Vec<Child>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl World {
    fn netns(&mut self, name: &str) -> String {
        run("ip", &["netns", "add", name]);
        self.netns.push(name.to_owned());
        run("ip", &["-n", name, "link", "set", "lo", "up"]);
        name.to_owned()
    }

    /// A TCP server in `ns` on `addr`: answers every request with `peer=<ip>` (what NAT made of
    /// the client), or with `len` bytes for `GET /big`.
    fn http_server(&mut self, ns: &str, addr: SocketAddr, big: usize) {
        let ready = self.listener(ns, addr, move |mut conn: TcpStream| {
            let peer = conn.peer_addr().unwrap().ip();
            let mut req = [0u8; 1024];
            let n = conn.read(&mut req).unwrap_or(0);
            let req = String::from_utf8_lossy(&req[..n]);
            if req.starts_with("GET /big") {
                let _ = write!(conn, "HTTP/1.0 200 OK\r\nContent-Length: {big}\r\n\r\n");
                let chunk = vec![0u8; 1 << 16];
                let mut left = big;
                while left > 0 {
                    let k = left.min(chunk.len());
                    if conn.write_all(&chunk[..k]).is_err() {
                        return;
                    }
                    left -= k;
                }
            } else {
                let body = format!("peer={peer}");
                let _ = write!(
                    conn,
                    "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        ready.recv().unwrap();
    }

    fn listener(
        &mut self,
        ns: &str,
        addr: SocketAddr,
        handle: impl Fn(TcpStream) + Send + 'static,
    ) -> std::sync::mpsc::Receiver<()> {
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = self.stop.clone();
        let ns = ns.to_owned();
        self.threads.push(std::thread::spawn(move || {
            enter(&ns);
            let l = TcpListener::bind(addr).unwrap();
            l.set_nonblocking(true).unwrap();
            tx.send(()).unwrap();
            while !stop.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((c, _)) => {
                        c.set_nonblocking(false).unwrap();
                        handle(c)
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        }));
        rx
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in self.netns.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A network with NAT out of the default route and no egress lists or ingress rules.
fn nat_network(id: &str, subnet: &str, gateway: &str) -> VmNetwork {
    VmNetwork {
        id: id.to_owned(),
        subnet: subnet.parse().unwrap(),
        gateway: gateway.parse().unwrap(),
        nat: true,
        egress_interface: None,
        egress_allow: vec![],
        egress_deny: vec![],
        ingress: vec![],
    }
}

/// `ip -n ns ARGS...` for each (ns, args), in order.
fn ip_all(steps: &[(&str, Vec<&str>)]) {
    for (ns, args) in steps {
        let mut all = vec!["-n", ns];
        all.extend(args);
        run("ip", &all);
    }
}

/// A node namespace and its "internet" on the uplink: node up0 192.0.2.2/24 <-> wan0 192.0.2.1/24,
/// the node's default route.
fn node_with_uplink(w: &mut World, node: &str, inet: &str) -> (String, String) {
    let (node, inet) = (w.netns(node), w.netns(inet));
    ip_all(&[
        (
            &node,
            vec![
                "link", "add", "up0", "type", "veth", "peer", "name", "wan0", "netns", &inet,
            ],
        ),
        (&node, vec!["addr", "add", "192.0.2.2/24", "dev", "up0"]),
        (&node, vec!["link", "set", "up0", "up"]),
        (&node, vec!["route", "add", "default", "via", "192.0.2.1"]),
        (&inet, vec!["addr", "add", "192.0.2.1/24", "dev", "wan0"]),
        (&inet, vec!["link", "set", "wan0", "up"]),
    ]);
    (node, inet)
}

fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<Vec<u8>> {
    let mut c = TcpStream::connect_timeout(&addr, UNREACHABLE_WAIT)?;
    c.set_read_timeout(Some(Duration::from_secs(10)))?;
    // One write: the server reads the request with one read.
    c.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())?;
    let mut out = Vec::new();
    c.read_to_end(&mut out)?;
    let at = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(0);
    Ok(out.split_off(at + 4))
}

/// A minimal DNS A query (RFC 1035) from a socket bound in the caller's namespace.
fn resolve(server: SocketAddr, name: &str) -> Option<Ipv4Addr> {
    let s = UdpSocket::bind("0.0.0.0:0").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut q = vec![0x13, 0x37, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in name.split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    s.send_to(&q, server).ok()?;
    let mut buf = [0u8; 512];
    let n = s.recv(&mut buf).ok()?;
    // The answer's last four bytes are the A record's address (one answer, no extra records).
    (n >= q.len() + 16 && buf[7] == 1)
        .then(|| Ipv4Addr::new(buf[n - 4], buf[n - 3], buf[n - 2], buf[n - 1]))
}

fn set_mac(ns: &str, mac: &str) {
    run("ip", &["-n", ns, "link", "set", "eth0", "address", mac]);
}

fn reachable(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, UNREACHABLE_WAIT).is_ok()
}

fn reconcile(node: &str, desired: &[Attachment]) -> (Vec<network::plan::Action>, Duration) {
    let start = Instant::now();
    let done = reconcile_admitting(node, desired, &network::Admission::default());
    assert!(done.failed.is_empty(), "{:?}", done.failed);
    (done.actions, start.elapsed())
}

fn reconcile_admitting(
    node: &str,
    desired: &[Attachment],
    admission: &network::Admission,
) -> network::Reconciled {
    in_netns(node, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(network::reconcile(desired, admission)).unwrap()
    })
}

/// Everything of Imp's in the node namespace: links, the gateway address, routes, nft tables.
fn imp_leftovers(node: &str, bridge: &str, taps: &[&str]) -> Vec<String> {
    let mut left = Vec::new();
    let links = output("ip", &["-n", node, "-o", "link", "show"]);
    if links.contains(bridge) {
        left.push(format!("bridge {bridge}"));
    }
    for t in taps {
        if output("ip", &["-n", node, "-o", "link", "show", "dev", t]).contains("master") {
            left.push(format!("{t} still on a bridge"));
        }
    }
    if output("ip", &["-n", node, "-o", "addr"]).contains("198.51.100.1/") {
        left.push("gateway address".into());
    }
    if output("ip", &["-n", node, "route", "show", "table", "all"]).contains("198.51.100.") {
        left.push("route to the VM subnet".into());
    }
    let nft = output("ip", &["netns", "exec", node, "nft", "list", "tables"]);
    if nft.contains(" imp") {
        left.push(format!("nft tables: {nft}"));
    }
    left
}

#[test]
fn bridge_nat_dns_isolation_and_teardown_in_namespaces() {
    if !nix::unistd::geteuid().is_root() || !available("nft") || !available("dnsmasq") {
        let why = "needs root, nft (nftables) and dnsmasq";
        return imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "bridge_nat_dns_isolation",
            why,
        );
    }
    let id = std::process::id();
    let mut w = World::default();
    // The uplink: node 192.0.2.2 <-> "internet" 192.0.2.1, the node's default route.
    let (node, inet) = node_with_uplink(
        &mut w,
        &format!("impt-node-{id}"),
        &format!("impt-inet-{id}"),
    );
    let g1 = w.netns(&format!("impt-g1-{id}"));
    let g2 = w.netns(&format!("impt-g2-{id}"));
    // Cloud metadata look-alike on the node.
    run(
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

    let uid = |n: u32| format!("vm-{id}-{n}");
    let mut ports = Vec::new();
    for (n, (guest, ip)) in [(&g1, "198.51.100.10"), (&g2, "198.51.100.11")]
        .into_iter()
        .enumerate()
    {
        let host_end = format!("impt{id:x}{n}");
        let mac = vm_mac(&uid(n as u32));
        let mac_s = network::format_mac(&mac);
        run(
            "ip",
            &[
                "-n", &node, "link", "add", &host_end, "type", "veth", "peer", "name", "eth0",
                "netns", guest,
            ],
        );
        run(
            "ip",
            &["-n", guest, "link", "set", "eth0", "address", &mac_s, "up"],
        );
        run(
            "ip",
            &[
                "-n",
                guest,
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                "eth0",
            ],
        );
        run(
            "ip",
            &[
                "-n",
                guest,
                "route",
                "add",
                "default",
                "via",
                "198.51.100.1",
            ],
        );
        ports.push(Port {
            tap: host_end,
            mac,
            ip: ip.parse().unwrap(),
            dns: vec![],
        });
    }
    // And one real TAP (no VM behind it): the plan creates it.
    let tap = format!("impt{id:x}t");
    ports.push(Port {
        tap: tap.clone(),
        mac: vm_mac(&uid(9)),
        ip: "198.51.100.12".parse().unwrap(),
        dns: vec![],
    });

    // The "internet": DNS, HTTP and a UDP sink that reports the sources it saw.
    let mut dns = Command::new("ip");
    dns.args(["netns", "exec", &inet])
        .args(common::dnsmasq_argv("192.0.2.1", "web.test", "192.0.2.1"));
    w.children.push(
        dns.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    const BIG: usize = 64 << 20;
    w.http_server(&inet, "192.0.2.1:8080".parse().unwrap(), BIG);
    // Listeners the guests must never reach: every address of the node, the metadata address,
    // and the other guest.
    w.listener(&node, "0.0.0.0:9100".parse().unwrap(), |_| {})
        .recv()
        .unwrap();
    w.listener(&g2, "0.0.0.0:7000".parse().unwrap(), |_| {})
        .recv()
        .unwrap();
    let udp_sink = in_netns(&inet, || UdpSocket::bind("192.0.2.1:5353").unwrap());
    udp_sink.set_read_timeout(Some(UNREACHABLE_WAIT)).unwrap();

    let desired = vec![Attachment {
        network: VmNetwork {
            id: format!("net-{id}"),
            subnet: "198.51.100.0/24".parse().unwrap(),
            gateway: "198.51.100.1".parse().unwrap(),
            nat: true,
            egress_interface: None,
            egress_allow: vec![],
            egress_deny: vec![],
            ingress: vec![],
        },
        ports: ports.clone(),
    }];
    let bridge = bridge_name(&desired[0].network.id);

    // Set up: one guest first (the per-VM cost of a new network), then the rest.
    let first = vec![Attachment {
        network: desired[0].network.clone(),
        ports: ports[..1].to_vec(),
    }];
    let (actions, took_first) = reconcile(&node, &first);
    assert!(!actions.is_empty());
    let (_, took_more) = reconcile(&node, &desired);
    let (again, took_noop) = reconcile(&node, &desired);
    assert_eq!(again, [], "a repeated setup must be a no-op");
    println!(
        "setup: first VM (bridge + rules) {took_first:?}, two more VMs {took_more:?}, no-op {took_noop:?}"
    );

    let tap_link = output("ip", &["-n", &node, "-d", "link", "show", "dev", &tap]);
    assert!(
        tap_link.contains(&format!("master {bridge}")) && tap_link.contains("isolated on"),
        "{tap_link}"
    );
    // No IPv6 on the bridge or its ports: nothing for a guest to reach the host over.
    for link in [bridge.as_str(), &ports[0].tap, &tap] {
        let v6 = output("ip", &["-n", &node, "-6", "addr", "show", "dev", link]);
        assert!(!v6.contains("inet6"), "{link} has IPv6: {v6}");
    }
    // Forwarding per link over netlink (a non-privileged runtime pod cannot write /proc/sys): on
    // for the bridge and the uplink, while the namespace's global ip_forward stays 0, so the NAT
    // below works through the links' flags alone.
    let sysctl = |key: &str| {
        output("ip", &["netns", "exec", &node, "sysctl", "-n", key])
            .trim()
            .to_owned()
    };
    assert_eq!(
        sysctl("net.ipv4.ip_forward"),
        "0",
        "the global flag untouched"
    );
    for link in [bridge.as_str(), "up0"] {
        assert_eq!(
            sysctl(&format!("net.ipv4.conf.{link}.forwarding")),
            "1",
            "{link} forwards"
        );
    }

    let server: SocketAddr = "192.0.2.1:8080".parse().unwrap();
    in_netns(&g1, || {
        // dnsmasq may still be starting.
        let deadline = Instant::now() + Duration::from_secs(10);
        while resolve("192.0.2.1:53".parse().unwrap(), "web.test").is_none()
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(
            resolve("192.0.2.1:53".parse().unwrap(), "web.test"),
            Some("192.0.2.1".parse().unwrap()),
            "DNS through NAT"
        );
        let body = http_get(server, "/").expect("HTTP through NAT");
        assert_eq!(
            String::from_utf8_lossy(&body),
            "peer=192.0.2.2",
            "the server sees the node's uplink address"
        );
        for (what, addr) in [
            ("the node's uplink address", "192.0.2.2:9100"),
            ("the gateway address", "198.51.100.1:9100"),
            ("the metadata address", "169.254.169.254:9100"),
            ("the other guest", "198.51.100.11:7000"),
        ] {
            assert!(!reachable(addr.parse().unwrap()), "guest reached {what}");
        }
        assert!(http_get("192.0.2.1:8080".parse().unwrap(), "/").is_ok());
    });
    // Positive controls: the listeners are there, only the guests are kept out.
    in_netns(&node, || {
        assert!(reachable("192.0.2.2:9100".parse().unwrap()));
        assert!(reachable("169.254.169.254:9100".parse().unwrap()));
        assert!(
            reachable("198.51.100.11:7000".parse().unwrap()),
            "node to guest 2"
        );
    });

    // Spoofing: the same datagram from the guest's own address arrives (NATed), from an
    // address it does not own it is dropped on the bridge.
    run(
        "ip",
        &["-n", &g1, "addr", "add", "198.51.100.50/24", "dev", "eth0"],
    );
    let send_from = |src: &str| {
        let src = src.to_owned();
        in_netns(&g1, move || {
            let s = UdpSocket::bind(format!("{src}:0")).unwrap();
            s.send_to(b"x", "192.0.2.1:5353").unwrap();
        })
    };
    let mut buf = [0u8; 8];
    send_from("198.51.100.10");
    let (_, from) = udp_sink.recv_from(&mut buf).expect("the genuine datagram");
    assert_eq!(from.ip().to_string(), "192.0.2.2");
    send_from("198.51.100.50");
    assert!(
        udp_sink.recv_from(&mut buf).is_err(),
        "a spoofed source got through"
    );
    // A spoofed MAC is dropped as well.
    set_mac(&g1, "06:66:66:66:66:66");
    run("ip", &["-n", &g1, "neigh", "flush", "all"]);
    send_from("198.51.100.10");
    assert!(
        udp_sink.recv_from(&mut buf).is_err(),
        "a spoofed MAC got through"
    );
    set_mac(&g1, &network::format_mac(&ports[0].mac));

    // Throughput and latency through the bridge and NAT, guest vs the node itself.
    let measure = |ns: &str| {
        in_netns(ns, || {
            let start = Instant::now();
            let got = http_get(server, "/big").unwrap().len();
            assert_eq!(got, BIG);
            let mbps = BIG as f64 * 8.0 / start.elapsed().as_secs_f64() / 1e6;
            let start = Instant::now();
            for _ in 0..50 {
                http_get(server, "/").unwrap();
            }
            (mbps, start.elapsed() / 50)
        })
    };
    let (guest_mbps, guest_rtt) = measure(&g1);
    let (node_mbps, node_rtt) = measure(&node);
    println!(
        "throughput 64 MiB HTTP: guest via NAT {guest_mbps:.0} Mbit/s, node {node_mbps:.0} Mbit/s; \
         request latency (connect+GET): guest {guest_rtt:?}, node {node_rtt:?}"
    );

    // Ingress: a connection from outside reaches a guest only where spec.ingress admits it,
    // and its replies pass even where the egress lists stop the guest's own connections.
    run(
        "ip",
        &[
            "-n",
            &inet,
            "route",
            "add",
            "198.51.100.0/24",
            "via",
            "192.0.2.2",
        ],
    );
    w.listener(&g2, "0.0.0.0:7001".parse().unwrap(), |_| {})
        .recv()
        .unwrap();
    let from_inet = |port: u16| {
        in_netns(&inet, || {
            reachable(SocketAddr::from(([198, 51, 100, 11], port)))
        })
    };
    assert!(!from_inet(7000), "a connection got in without spec.ingress");
    let tcp = |from: &str| imp_runtime::api::Ingress {
        from: from.parse().unwrap(),
        protocol: imp_api::IngressProtocol::Tcp,
        ports: vec![7000],
    };
    let mut admitted = desired.clone();
    // The second rule names the subnet itself: guest-to-guest traffic stays dropped anyway.
    admitted[0].network.ingress = vec![tcp("192.0.2.0/24"), tcp("198.51.100.0/24")];
    admitted[0].network.egress_allow = vec!["203.0.113.0/24".parse().unwrap()];
    assert_ne!(reconcile(&node, &admitted).0, []);
    assert!(
        from_inet(7000),
        "spec.ingress admits 192.0.2.0/24 to port 7000"
    );
    assert!(
        !from_inet(7001),
        "reached a port spec.ingress does not list"
    );
    in_netns(&g1, || {
        assert!(
            !reachable("198.51.100.11:7000".parse().unwrap()),
            "guest reached the other guest through an ingress rule"
        );
        assert!(!reachable(server), "egress.allow no longer held");
    });
    assert_ne!(reconcile(&node, &desired).0, []);
    assert!(!from_inet(7000), "admitted after spec.ingress was emptied");

    // Teardown: the last VM leaves, then nothing of Imp's is left; a repeat does nothing.
    let empty = vec![Attachment {
        network: desired[0].network.clone(),
        ports: vec![],
    }];
    let (actions, _) = reconcile(&node, &empty);
    assert!(!actions.is_empty());
    let taps: Vec<&str> = ports.iter().map(|p| p.tap.as_str()).collect();
    // TAPs are the runtime's to delete (tap.rs, with the VM); here the test does it.
    run("ip", &["-n", &node, "link", "del", &tap]);
    assert_eq!(
        imp_leftovers(&node, &bridge, &taps[..2]),
        Vec::<String>::new()
    );
    assert_eq!(reconcile(&node, &[]).0, []);
}

/// Issue 30, step 2: ImpNetworks that would steer the node's routing are refused before anything
/// is touched: a subnet overlapping the node's uplink, one of its routes, a reserved range or a
/// network already on the node, and an egress interface the platform did not allow. The node's
/// routes (and where its traffic goes) are the same before and after; the admitted network is
/// set up beside them.
#[test]
fn networks_that_would_steer_the_node_are_refused_and_its_routing_is_unchanged() {
    if !nix::unistd::geteuid().is_root() || !available("nft") {
        return imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "networks_that_would_steer_the_node",
            "needs root and nft (nftables)",
        );
    }
    let id = std::process::id();
    let mut w = World::default();
    let (node, _inet) = node_with_uplink(
        &mut w,
        &format!("impt-adm-{id}"),
        &format!("impt-admi-{id}"),
    );
    ip_all(&[
        (
            &node,
            vec!["route", "add", "203.0.113.0/25", "via", "192.0.2.1"],
        ),
        // A second interface of the node, not its default route's (a management NIC).
        (
            &node,
            vec![
                "link", "add", "mgmt0", "type", "veth", "peer", "name", "mgmt1",
            ],
        ),
    ]);
    let routes = |ns: &str| -> Vec<String> {
        output("ip", &["-n", ns, "route", "show", "table", "all"])
            .lines()
            .filter(|l| !l.contains("impbr"))
            .map(str::to_owned)
            .collect()
    };
    let route_to = |ns: &str, dst: &str| output("ip", &["-n", ns, "route", "get", dst]);
    let before = routes(&node);
    let before_get: Vec<String> = ["192.0.2.1", "192.0.2.77", "203.0.113.5", "198.18.0.9"]
        .iter()
        .map(|d| route_to(&node, d))
        .collect();

    let tap = format!("impa{id:x}");
    let network = |n: &str, subnet: &str, gateway: &str, ip: &str| Attachment {
        network: nat_network(&format!("net-{n}-{id}"), subnet, gateway),
        ports: vec![Port {
            tap: if n == "ok" {
                tap.clone()
            } else {
                format!("impa{id:x}{}", &n[..2])
            },
            mac: vm_mac(n),
            ip: ip.parse().unwrap(),
            dns: vec![],
        }],
    };
    let mut mgmt = network(
        "mgmt",
        "198.51.100.128/26",
        "198.51.100.129",
        "198.51.100.130",
    );
    mgmt.network.egress_interface = Some("mgmt0".into());
    let desired = [
        network("ok", "198.51.100.0/26", "198.51.100.1", "198.51.100.2"),
        network("uplink", "192.0.2.0/25", "192.0.2.1", "192.0.2.3"),
        network("route", "203.0.113.0/24", "203.0.113.1", "203.0.113.2"),
        network("reserved", "198.18.0.0/24", "198.18.0.1", "198.18.0.2"),
        network("twin", "198.51.100.0/27", "198.51.100.1", "198.51.100.3"),
        mgmt,
    ];
    let admission = network::Admission {
        reserved: vec!["198.18.0.0/15".parse().unwrap()],
        ..network::Admission::default()
    };
    let done = reconcile_admitting(&node, &desired, &admission);
    let mut refused: Vec<(String, &str)> = done
        .failed
        .iter()
        .map(|f| (f.network.clone(), f.error.kind()))
        .collect();
    refused.sort();
    let mut want = vec![
        (format!("net-mgmt-{id}"), "egress_not_allowed"),
        (format!("net-reserved-{id}"), "subnet_reserved"),
        (format!("net-route-{id}"), "subnet_overlap"),
        (format!("net-twin-{id}"), "subnet_overlap"),
        (format!("net-uplink-{id}"), "subnet_overlap"),
    ];
    want.sort();
    assert_eq!(refused, want, "{:#?}", done.failed);
    // Only the admitted network's bridge exists; the refused ones left nothing behind.
    let links = output("ip", &["-n", &node, "-o", "link", "show"]);
    assert!(
        links.contains(&bridge_name(&desired[0].network.id)),
        "{links}"
    );
    for refused in &desired[1..] {
        assert!(
            !links.contains(&bridge_name(&refused.network.id)),
            "{links}"
        );
    }
    assert_eq!(routes(&node), before, "the node's routes changed");
    let after_get: Vec<String> = ["192.0.2.1", "192.0.2.77", "203.0.113.5", "198.18.0.9"]
        .iter()
        .map(|d| route_to(&node, d))
        .collect();
    assert_eq!(
        after_get, before_get,
        "the node's traffic goes elsewhere now"
    );

    // The refused networks' VMs gone, the admitted one's too: nothing of Imp's is left.
    let done = reconcile_admitting(&node, &[], &admission);
    assert!(done.failed.is_empty(), "{:?}", done.failed);
    let left = imp_leftovers(&node, &bridge_name(&desired[0].network.id), &[&tap]);
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(routes(&node), before);
}

/// In `node`, a guest namespace on a veth whose node end is `host_end`: address `ip/prefix`,
/// default route via `gateway`, the MAC Imp expects for `uid`. Returns its port.
fn guest(node: &str, ns: &str, host_end: &str, uid: &str, addr: &str, gateway: &str) -> Port {
    let mac = vm_mac(uid);
    run(
        "ip",
        &[
            "-n", node, "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns",
            ns,
        ],
    );
    let mac_s = network::format_mac(&mac);
    run(
        "ip",
        &["-n", ns, "link", "set", "eth0", "address", &mac_s, "up"],
    );
    run("ip", &["-n", ns, "addr", "add", addr, "dev", "eth0"]);
    run("ip", &["-n", ns, "route", "add", "default", "via", gateway]);
    Port {
        tap: host_end.to_owned(),
        mac,
        ip: addr.split('/').next().unwrap().parse().unwrap(),
        dns: vec![],
    }
}

/// Issue 30, step 3: guests open no connection to the node's private networks by default.
///
/// ```text
///  g1 (net A, 198.51.100.10)  ─┐                ┌─ "internet" + private uplink network ──┐
///  g2 (net B, 198.51.100.130) ─┼─ node ─ up0 ────┤ 192.0.2.1: HTTP        (public)       │
///  g3 (net C, 203.0.113.10)   ─┘  192.0.2.2      │ 10.77.0.1: host, DNS   (private)      │
///                                  10.77.0.2     │ 198.18.0.5: a "pod"    (reserved)     │
///   kube-proxy stand-in on the node: DNAT 198.19.0.10:80 (a "service") -> 198.18.0.5:7200 │
/// ```
///
/// Every destination is out of the egress interface, so only the default deny keeps guests
/// from the private host, the pod and the service: A's guest reaches the internet and its
/// private resolver (DNS only), nothing else of them; C's `egress.allow`, inside what the
/// platform allows, opens them; an allow beyond that is refused; A's and B's ingress rules
/// (from anywhere) admit the outside but never the other network's guest.
#[test]
fn egress_is_denied_by_default_and_networks_do_not_decide_for_each_other() {
    if !nix::unistd::geteuid().is_root() || !available("nft") || !available("dnsmasq") {
        return imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "egress_is_denied_by_default",
            "needs root, nft (nftables) and dnsmasq",
        );
    }
    let id = std::process::id();
    let mut w = World::default();
    let (node, inet) =
        node_with_uplink(&mut w, &format!("impt-egn-{id}"), &format!("impt-egi-{id}"));
    let (g1, g2, g3) = (
        w.netns(&format!("impt-eg1-{id}")),
        w.netns(&format!("impt-eg2-{id}")),
        w.netns(&format!("impt-eg3-{id}")),
    );
    ip_all(&[
        // The node's private network, on its uplink (as a cloud VPC is).
        (&node, vec!["addr", "add", "10.77.0.2/24", "dev", "up0"]),
        (
            &node,
            vec!["route", "add", "198.18.0.0/16", "via", "192.0.2.1"],
        ),
        (&inet, vec!["addr", "add", "10.77.0.1/24", "dev", "wan0"]),
        (&inet, vec!["addr", "add", "198.18.0.5/32", "dev", "lo"]),
        (
            &inet,
            vec!["route", "add", "198.51.100.0/24", "via", "192.0.2.2"],
        ),
    ]);
    // kube-proxy's part: service IPs rewritten in prerouting at dstnat, before the forward hook.
    let kube_proxy = "table ip kubeproxy { chain pre { type nat hook prerouting priority dstnat; \
                      ip daddr 198.19.0.10 tcp dport 80 dnat to 198.18.0.5:7200; }; }";
    run("ip", &["netns", "exec", &node, "nft", kube_proxy]);

    let mut dns = Command::new("ip");
    dns.args(["netns", "exec", &inet])
        .args(common::dnsmasq_argv("10.77.0.1", "web.test", "192.0.2.1"));
    w.children.push(
        dns.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    for addr in ["192.0.2.1:8080", "10.77.0.1:7100", "0.0.0.0:7200"] {
        w.listener(&inet, addr.parse().unwrap(), |_| {})
            .recv()
            .unwrap();
    }
    for g in [&g1, &g2] {
        w.listener(g, "0.0.0.0:7000".parse().unwrap(), |_| {})
            .recv()
            .unwrap();
    }

    let mut p1 = guest(
        &node,
        &g1,
        &format!("impe{id:x}1"),
        "eg-1",
        "198.51.100.10/25",
        "198.51.100.1",
    );
    p1.dns = vec!["10.77.0.1".parse().unwrap()];
    let p2 = guest(
        &node,
        &g2,
        &format!("impe{id:x}2"),
        "eg-2",
        "198.51.100.130/25",
        "198.51.100.129",
    );
    let p3 = guest(
        &node,
        &g3,
        &format!("impe{id:x}3"),
        "eg-3",
        "203.0.113.10/26",
        "203.0.113.1",
    );
    let everyone = vec![imp_runtime::api::Ingress {
        from: "0.0.0.0/0".parse().unwrap(),
        protocol: imp_api::IngressProtocol::Tcp,
        ports: vec![7000],
    }];
    let net = |n: &str, subnet: &str, gateway: &str, port: &Port| Attachment {
        network: VmNetwork {
            ingress: everyone.clone(),
            ..nat_network(&format!("net-{n}-{id}"), subnet, gateway)
        },
        ports: vec![port.clone()],
    };
    let cidrs = |l: &[&str]| l.iter().map(|c| c.parse().unwrap()).collect::<Vec<_>>();
    // B first: in one shared chain, B's "from anywhere" came before A's catch-all drop.
    let b = net("b", "198.51.100.128/25", "198.51.100.129", &p2);
    let a = net("a", "198.51.100.0/25", "198.51.100.1", &p1);
    let mut c = net("c", "203.0.113.0/26", "203.0.113.1", &p3);
    c.network.egress_allow = cidrs(&["192.0.2.0/24", "10.77.0.0/24", "198.18.0.0/15"]);
    // Asks for all of 10/8, the platform allows 10.77.0.0/24 only.
    let mut greedy = net(
        "greedy",
        "203.0.113.64/26",
        "203.0.113.65",
        &Port {
            tap: format!("impe{id:x}4"),
            mac: vm_mac("eg-4"),
            ip: "203.0.113.66".parse().unwrap(),
            dns: vec![],
        },
    );
    greedy.network.egress_allow = cidrs(&["10.0.0.0/8"]);
    let admission = network::Admission {
        reserved: cidrs(&["198.18.0.0/15"]),
        allowable_egress: cidrs(&["10.77.0.0/24", "198.18.0.0/15"]),
        ..network::Admission::default()
    };
    let desired = vec![b, a, c.clone(), greedy];
    let done = reconcile_admitting(&node, &desired, &admission);
    let refused: Vec<_> = done
        .failed
        .iter()
        .map(|f| (f.network.clone(), f.error.kind()))
        .collect();
    assert_eq!(
        refused,
        [(format!("net-greedy-{id}"), "egress_range_not_allowed")],
        "{:#?}",
        done.failed
    );
    assert!(done.failed[0].error.to_string().contains("10.0.0.0/8"));

    // Positive controls: from the node, every listener is there.
    in_netns(&node, || {
        for addr in ["192.0.2.1:8080", "10.77.0.1:7100", "198.18.0.5:7200"] {
            assert!(reachable(addr.parse().unwrap()), "node to {addr}");
        }
    });
    let can = |ns: &str, addr: &str| {
        let addr: SocketAddr = addr.parse().unwrap();
        in_netns(ns, move || reachable(addr))
    };
    // A (no egress.allow): the internet, not the private host, the pod or the service.
    assert!(can(&g1, "192.0.2.1:8080"), "A's guest lost the internet");
    for (what, addr) in [
        (
            "the host on the node's private uplink network",
            "10.77.0.1:7100",
        ),
        ("a pod (reserved range)", "198.18.0.5:7200"),
        ("a service IP (DNAT to a pod)", "198.19.0.10:80"),
    ] {
        assert!(!can(&g1, addr), "A's guest reached {what}");
        assert!(!can(&g2, addr), "B's guest reached {what}");
    }
    // Its resolver stays reachable although private, for DNS only.
    let resolved = in_netns(&g1, || {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let got = resolve("10.77.0.1:53".parse().unwrap(), "web.test");
            if got.is_some() || Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    assert_eq!(resolved, Some("192.0.2.1".parse().unwrap()), "A's resolver");
    assert_eq!(
        in_netns(&g2, || resolve("10.77.0.1:53".parse().unwrap(), "web.test")),
        None,
        "B's guest used a private resolver it was not given"
    );
    // C: what its egress.allow opens (inside the platform's ranges), via the service IP too.
    for addr in [
        "192.0.2.1:8080",
        "10.77.0.1:7100",
        "198.18.0.5:7200",
        "198.19.0.10:80",
    ] {
        assert!(can(&g3, addr), "C's guest did not reach {addr}");
    }
    // Opening the pods but not the services: the service IP stays closed although its DNAT
    // target is open; the match on the original destination decides.
    let mut pods_only = desired[..3].to_vec();
    pods_only[2].network.egress_allow = cidrs(&["192.0.2.0/24", "198.18.0.0/16"]);
    let done = reconcile_admitting(&node, &pods_only, &admission);
    assert!(done.failed.is_empty(), "{:?}", done.failed);
    assert!(can(&g3, "198.18.0.5:7200"), "C's guest lost the pod");
    assert!(
        !can(&g3, "198.19.0.10:80"),
        "C's guest reached an unopened service IP"
    );
    assert!(
        !can(&g3, "10.77.0.1:7100"),
        "C's guest kept a range no longer allowed"
    );

    // Ingress from anywhere on A and on B: the outside gets in, the other network's guest not.
    assert!(can(&inet, "198.51.100.130:7000"), "B's ingress rule");
    assert!(can(&inet, "198.51.100.10:7000"), "A's ingress rule");
    assert!(
        !can(&g1, "198.51.100.130:7000"),
        "B's ingress admitted A's guest"
    );
    assert!(
        !can(&g2, "198.51.100.10:7000"),
        "A's ingress admitted B's guest"
    );

    let done = reconcile_admitting(&node, &[], &admission);
    assert!(done.failed.is_empty(), "{:?}", done.failed);
    let nft = output("ip", &["netns", "exec", &node, "nft", "list", "tables"]);
    assert!(!nft.contains(" imp"), "{nft}");
}
