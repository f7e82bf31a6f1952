//! What the two ScaleToZero tests (suspend_agent.rs on the simulator, scale_to_zero_qemu.rs on a
//! real guest) share: the VM's network inside a [`TestNetwork`], the ImpNetwork admitting the
//! client, the guest's line server and the node's state for failure messages.

use std::net::SocketAddr;

use imp_api::ImpNetwork;
use imp_testkit::TestEnv;
use kube::api::PostParams;
use serde_json::json;

use super::{TestNetwork, ip};

pub const SUBNET: &str = "198.51.100.0/24";
pub const GATEWAY: &str = "198.51.100.1";
pub const VM_IP: &str = "198.51.100.7";
/// The guest's line server: it answers each line with `pong <line>`.
pub const PORT: u16 = 8080;
/// The ImpNetwork the VM is on.
pub const NETWORK: &str = "svc";

pub fn vm_addr() -> SocketAddr {
    SocketAddr::new(VM_IP.parse().unwrap(), PORT)
}

/// Routes the client ("internet" namespace) to the VM subnet through the node, and creates
/// ImpNetwork [`NETWORK`] with NAT whose `spec.ingress` admits the client's connections to
/// [`PORT`] (the default drops every connection into guests).
pub async fn admitting_network(env: &TestEnv, tn: &TestNetwork) {
    ip(&["-n", &tn.inet, "route", "add", SUBNET, "via", "192.0.2.2"]);
    let net: ImpNetwork = serde_json::from_value(json!({
        "apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork", "metadata": {"name": NETWORK},
        "spec": {"subnet": SUBNET, "gateway": GATEWAY, "dns": ["192.0.2.1"],
            "nat": {"enabled": true},
            "ingress": [{"from": "192.0.2.0/24", "ports": [PORT]}]}}))
    .unwrap();
    env.api::<ImpNetwork>()
        .create(&PostParams::default(), &net)
        .await
        .unwrap();
}

/// Output of `argv` run in namespace `ns`, for failure messages.
fn in_ns_output(ns: &str, argv: &[&str]) -> String {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns])
        .args(argv)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The node's rules and neighbours, for failure messages.
pub fn node_state(tn: &TestNetwork) -> String {
    format!(
        "node ruleset:\n{}\nnode neighbours:\n{}",
        in_ns_output(&tn.node, &["nft", "list", "ruleset"]),
        in_ns_output(&tn.node, &["ip", "neigh", "show"])
    )
}
