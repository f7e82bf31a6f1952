//! Image pulls kept off the node's own addresses (rootfs/egress.rs, docs/security.md): the real
//! imp-runtime binary in a node namespace the test creates, a real registry (Debian's
//! docker-registry) reached at the node's loopback, at the node's own uplink address, across
//! the uplink ("the internet"), and a registry across the uplink that redirects to the
//! link-local metadata address. Root only (network namespaces); otherwise it says SKIPPED, or
//! fails under IMP_REQUIRE_ROOT=1.

mod common;

use std::io::{Read, Write};
use std::sync::atomic::Ordering;

use common::{Harness, TestNetwork, forward, in_netns, ip, simulator};
use http::StatusCode;
use imp_api::names::reason;
use imp_runtime::api::{VmSpec, VmState};
use imp_runtime::rootfs::store::ImageSpec;
use imp_testkit::oci::registry_with_base_image;

const METADATA: &str = "169.254.169.254";

fn image_spec(h: &Harness, base: String) -> VmSpec {
    VmSpec {
        base_disk: None,
        image: Some(ImageSpec {
            base,
            runner: None,
            credentials: None,
            pull_policy: None,
        }),
        ..h.spec(false)
    }
}

/// A "registry" in `ns` on `bind` that answers every request with a redirect to the metadata
/// address (as a hostile registry would for a blob). Returns where it listens.
fn redirecting_registry(ns: &str, bind: &str) -> String {
    let listener = in_netns(ns, || std::net::TcpListener::bind(bind).unwrap());
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let _ = conn.write_all(
                format!(
                    "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://{METADATA}/latest/meta-data/\r\n\
                     Content-Length: 0\r\nConnection: close\r\n\r\n"
                )
                .as_bytes(),
            );
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulls_never_reach_node_local_or_link_local_addresses_unless_allowed() {
    if !common::is_root() {
        return imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_ROOT",
            "pulls_never_reach_node_local_or_link_local_addresses_unless_allowed",
            "needs root (network namespaces)",
        );
    }
    // Declared first: dropped after the runtime.
    let net = TestNetwork::new("ipe");
    let registry = registry_with_base_image().await;
    let target = registry.host();
    // The same registry at the node's loopback, at the node's own uplink address, and on the
    // "internet" side of the uplink.
    let loopback = forward(&net.node, "127.0.0.1:0", &target);
    let own = forward(&net.node, "192.0.2.2:0", &target);
    let internet = forward(&net.inet, "192.0.2.1:0", &target);
    // The cloud's metadata address, reached from the node through its default route.
    ip(&[
        "-n",
        &net.inet,
        "addr",
        "add",
        &format!("{METADATA}/32"),
        "dev",
        "lo",
    ]);
    let metadata = forward(&net.inet, &format!("{METADATA}:80"), &target);
    let redirector = redirecting_registry(&net.inet, "192.0.2.1:0");
    let hosts = [&loopback.addr, &own.addr, &internet.addr, &redirector];
    let insecure = hosts.map(|h| h.as_str()).join(",");

    let mut h = Harness::new(simulator());
    h.netns = Some(net.node.clone());
    h.extra_env = vec![("IMP_INSECURE_REGISTRIES".into(), insecure.clone())];
    h.start_runtime().await;

    // Across the uplink: pulled, the VM runs.
    let spec = image_spec(&h, format!("{}/ci/base:1", internet.addr));
    let (code, vm) = h
        .client
        .ensure_running("vm-inet", &spec)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", h.runtime_log()));
    assert_eq!((code, vm.state), (StatusCode::CREATED, VmState::Running));
    assert!(internet.connections.load(Ordering::SeqCst) > 0);

    // The node's loopback and its own address: refused before any connection is made.
    for (uid, fwd, class) in [
        ("vm-lo", &loopback, "loopback"),
        ("vm-own", &own, "one of the node's own addresses"),
    ] {
        let spec = image_spec(&h, format!("{}/ci/base:1", fwd.addr));
        let e = h.client.ensure_running(uid, &spec).await.unwrap_err();
        assert_eq!(e.reason(), Some(reason::ROOTFS_PULL_REFUSED), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(&fwd.addr) && msg.contains(class), "{msg}");
        assert_eq!(
            fwd.connections.load(Ordering::SeqCst),
            0,
            "{uid} reached it"
        );
    }

    // A registry across the uplink that redirects to the metadata address: the redirect is
    // refused; the metadata address saw nothing, though the node can reach it (the control).
    let spec = image_spec(&h, format!("{redirector}/ci/base:1"));
    let e = h
        .client
        .ensure_running("vm-redirect", &spec)
        .await
        .unwrap_err();
    assert_eq!(e.reason(), Some(reason::ROOTFS_PULL_REFUSED), "{e}");
    assert!(e.to_string().contains("link-local"), "{e}");
    assert_eq!(metadata.connections.load(Ordering::SeqCst), 0);
    in_netns(&net.node, || {
        std::net::TcpStream::connect((METADATA, 80)).expect("the node reaches the metadata address")
    });
    common::wait_until(
        "the control connection",
        std::time::Duration::from_secs(5),
        || metadata.connections.load(Ordering::SeqCst) == 1,
    )
    .await;

    let m = h.metrics().await;
    for (class, at_least) in [("Loopback", 1.0), ("NodeAddress", 1.0), ("LinkLocal", 1.0)] {
        let series = format!("imp_rootfs_pull_refused_connections_total{{class=\"{class}\"}}");
        let n = common::agent::sample(&m, &series).unwrap_or_else(|| panic!("no {series}:\n{m}"));
        assert!(n >= at_least, "{series} = {n}");
    }
    assert!(
        m.contains("imp_rootfs_build_failures_total{reason=\"RootfsPullRefused\"} 3"),
        "{m}"
    );

    // The admin allows the registries that live on the node: the same pulls succeed.
    h.signal_runtime("TERM");
    h.extra_env = vec![
        ("IMP_INSECURE_REGISTRIES".into(), insecure),
        (
            "IMP_NODE_LOCAL_REGISTRIES".into(),
            format!("{},{}", loopback.addr, own.addr),
        ),
    ];
    h.start_runtime().await;
    for (uid, fwd) in [("vm-lo-allowed", &loopback), ("vm-own-allowed", &own)] {
        let spec = image_spec(&h, format!("{}/ci/base:1", fwd.addr));
        let (_, vm) = h
            .client
            .ensure_running(uid, &spec)
            .await
            .unwrap_or_else(|e| panic!("{uid}: {e}\n{}", h.runtime_log()));
        assert_eq!(vm.state, VmState::Running, "{uid}");
        assert!(fwd.connections.load(Ordering::SeqCst) > 0, "{uid}");
    }
    // Allowing the node's registries allows nothing else: the redirect is still refused.
    let spec = image_spec(&h, format!("{redirector}/ci/base:1"));
    let e = h
        .client
        .ensure_running("vm-redirect-again", &spec)
        .await
        .unwrap_err();
    assert_eq!(e.reason(), Some(reason::ROOTFS_PULL_REFUSED), "{e}");
    assert_eq!(metadata.connections.load(Ordering::SeqCst), 1);
    for uid in ["vm-inet", "vm-lo-allowed", "vm-own-allowed"] {
        h.client.delete(uid).await.unwrap();
    }
}
