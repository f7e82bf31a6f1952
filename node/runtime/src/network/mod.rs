//! The node's VM data plane (docs/network.md): per ImpNetwork a bridge holding the gateway
//! address, one TAP per VM attached to it as an isolated port, IPv4 forwarding, and the
//! `inet imp` / `bridge imp` nftables tables (masquerade, isolation, anti-spoofing).
//!
//! One reconcile shape: [`observe`](netlink::observe) what exists on the host, decide with the
//! pure [`plan::plan`], then execute the actions one by one. Every action is idempotent and the
//! plan is recomputed from the host on each call, so a retry, or a restarted runtime, converges
//! from whatever an interrupted attempt left behind.

pub mod admit;
pub mod netlink;
pub mod nft;
pub mod plan;
pub mod wake;

pub use admit::Admission;
pub use wake::{sync as wake_sync, wake_packets};

use std::net::Ipv4Addr;

use crate::api::NetworkAttachment;
use crate::tap::{TapError, fnv1a};

pub use imp_runtime_api::network::{NetworkSpecError, VmNetwork};

/// The guest's kernel command-line words for a runtime VM spec's attachment.
pub fn boot_args(a: &NetworkAttachment) -> String {
    VmNetwork::from_attachment(a).boot_args(a.address.addr(), a.mtu, &a.dns)
}

/// The node's whole desired state from its VMs' attachments (TAP, guest MAC, attachment), in
/// the order the VMs were created; one [`Attachment`] per network in first-seen order.
///
/// Each VM carries the ImpNetwork spec of its start. The layout (subnet, gateway) is the
/// oldest VM's: the running guests' addresses and routes are on their kernel command lines and
/// cannot follow a change, so a VM whose address does not fit fails alone. The policy (NAT,
/// egress interface, `spec.egress`, `spec.ingress`) is the newest VM's: node-side rules only,
/// applied to every VM of the network on the node, so a change of them reaches the running VMs
/// with the next VM of that network started there (docs/network.md, "Changes of an
/// ImpNetwork").
pub fn desired<'a>(
    vms: impl IntoIterator<Item = (String, [u8; 6], &'a NetworkAttachment)>,
) -> Vec<Attachment> {
    let mut out: Vec<Attachment> = Vec::new();
    for (tap, mac, a) in vms {
        let port = Port {
            tap,
            mac,
            ip: a.address.addr(),
            dns: a.dns.clone(),
        };
        match out.iter_mut().find(|x| x.network.id == a.network_id) {
            Some(x) => {
                let newest = VmNetwork::from_attachment(a);
                x.network = VmNetwork {
                    subnet: x.network.subnet,
                    gateway: x.network.gateway,
                    ..newest
                };
                x.ports.push(port);
            }
            None => out.push(Attachment {
                network: VmNetwork::from_attachment(a),
                ports: vec![port],
            }),
        }
    }
    out
}

/// Parse a MAC written `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let parts: Vec<u8> = s
        .split(':')
        .map(|p| {
            (p.len() == 2)
                .then(|| u8::from_str_radix(p, 16).ok())
                .flatten()
        })
        .collect::<Option<_>>()?;
    parts.try_into().ok()
}

/// One VM's attachment: its TAP, the MAC the guest uses and the address IPAM gave it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Port {
    pub tap: String,
    pub mac: [u8; 6],
    pub ip: Ipv4Addr,
    /// The guest's resolvers (`spec.dns` of its start): reachable for DNS whatever the default
    /// deny says about their addresses.
    pub dns: Vec<Ipv4Addr>,
}

/// A network and the VMs of this node on it: the whole desired state is a list of these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub network: VmNetwork,
    pub ports: Vec<Port>,
}

/// Bridges are `impbr` + 10 hex digits; TAPs (`imp` + 11 hex digits, tap.rs) can never match
/// that prefix because `r` is no hex digit, so observing "every `impbr*` bridge" finds only ours.
pub const BRIDGE_PREFIX: &str = "impbr";

pub fn bridge_name(network_id: &str) -> String {
    format!(
        "{BRIDGE_PREFIX}{:010x}",
        fnv1a(&[b"bridge", network_id.as_bytes()]) & 0xff_ffff_ffff
    )
}

/// A locally administered unicast MAC from a hash; `first` picks the class (VM or bridge).
fn mac_from(first: u8, parts: &[&[u8]]) -> [u8; 6] {
    let h = fnv1a(parts).to_be_bytes();
    [first, h[3], h[4], h[5], h[6], h[7]]
}

/// The guest's MAC, derived from the VM uid (stable across runtime restarts and reattach).
pub fn vm_mac(vm_uid: &str) -> [u8; 6] {
    mac_from(0x06, &[b"vm", vm_uid.as_bytes()])
}

/// The bridge's own MAC: fixed, so it does not change as ports come and go (a bridge takes
/// its lowest port MAC otherwise, and the guests' ARP entry for the gateway would go stale).
pub fn bridge_mac(network_id: &str) -> [u8; 6] {
    mac_from(0x0a, &[b"bridge", network_id.as_bytes()])
}

pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("open a netlink socket: {0}")]
    Socket(std::io::Error),
    #[error("netlink: {step}: {source}")]
    Netlink {
        step: String,
        source: rtnetlink::Error,
    },
    #[error(
        "network {network}: no egress interface: nat.egressInterface is unset and the node has no IPv4 default route"
    )]
    NoEgress { network: String },
    #[error("network {network}: egress interface {interface} does not exist")]
    EgressMissing { network: String, interface: String },
    #[error("network {network}: gateway {gateway} is not a host address of subnet {subnet}")]
    BadGateway {
        network: String,
        gateway: Ipv4Addr,
        subnet: ipnet::Ipv4Net,
    },
    #[error(
        "network {network}: VM address {ip} is not a host address of subnet {subnet} other than the gateway"
    )]
    BadAddress {
        network: String,
        ip: Ipv4Addr,
        subnet: ipnet::Ipv4Net,
    },
    #[error(
        "network {network}: subnet {subnet} overlaps the node's address {address} on {interface}; \
         choose a subnet the node does not use"
    )]
    SubnetOverlapsNode {
        network: String,
        subnet: ipnet::Ipv4Net,
        interface: String,
        address: ipnet::Ipv4Net,
    },
    #[error(
        "network {network}: subnet {subnet} overlaps the node's route to {route} (via {interface}); \
         choose a subnet the node does not route"
    )]
    SubnetOverlapsRoute {
        network: String,
        subnet: ipnet::Ipv4Net,
        route: ipnet::Ipv4Net,
        interface: String,
    },
    #[error(
        "network {network}: subnet {subnet} overlaps network {other} ({other_subnet}), already on \
         this node"
    )]
    SubnetOverlapsNetwork {
        network: String,
        subnet: ipnet::Ipv4Net,
        other: String,
        other_subnet: ipnet::Ipv4Net,
    },
    #[error(
        "network {network}: subnet {subnet} overlaps {reserved}, reserved by the platform \
         (imp-runtime --network-reserved-cidrs)"
    )]
    SubnetReserved {
        network: String,
        subnet: ipnet::Ipv4Net,
        reserved: ipnet::Ipv4Net,
    },
    #[error(
        "network {network}: nat.egressInterface {interface} is neither the default route's \
         interface nor allowed by the platform (imp-runtime --network-allowed-egress-interfaces)"
    )]
    EgressNotAllowed { network: String, interface: String },
    #[error(
        "network {network}: spec.egress.allow {range} opens {denied}, which guests reach only \
         where the platform allows it (imp-runtime --network-allowable-egress-cidrs)"
    )]
    EgressRangeNotAllowed {
        network: String,
        range: ipnet::Ipv4Net,
        denied: ipnet::Ipv4Net,
    },
    #[error("TAP {tap} is wanted on two networks ({a} and {b})")]
    TapConflict { tap: String, a: String, b: String },
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error("nft {step}: {message}")]
    Nft { step: &'static str, message: String },
}

impl NetworkError {
    /// Stable label of the failing step (the `reason` of `imp_network_setup_failures_total`).
    pub fn kind(&self) -> &'static str {
        match self {
            NetworkError::Socket(_) | NetworkError::Netlink { .. } => "netlink",
            NetworkError::NoEgress { .. } => "no_egress",
            NetworkError::EgressMissing { .. } => "egress_missing",
            NetworkError::BadGateway { .. }
            | NetworkError::BadAddress { .. }
            | NetworkError::TapConflict { .. } => "bad_spec",
            NetworkError::SubnetOverlapsNode { .. }
            | NetworkError::SubnetOverlapsRoute { .. }
            | NetworkError::SubnetOverlapsNetwork { .. } => "subnet_overlap",
            NetworkError::SubnetReserved { .. } => "subnet_reserved",
            NetworkError::EgressNotAllowed { .. } => "egress_not_allowed",
            NetworkError::EgressRangeNotAllowed { .. } => "egress_range_not_allowed",
            NetworkError::Tap(_) => "tap",
            NetworkError::Nft { .. } => "nft",
        }
    }
}

/// What a reconcile did, and which networks (or single VM ports) it could not set up.
#[derive(Debug, Default)]
pub struct Reconciled {
    /// Every action taken; empty when the host already matched (a repeated setup is a no-op).
    pub actions: Vec<plan::Action>,
    pub failed: Vec<plan::Failure>,
}

impl Reconciled {
    /// Take the failure that concerns the VM with `tap` on `network`, if any.
    pub fn take_failure(&mut self, network: &str, tap: &str) -> Option<plan::Failure> {
        let at = self.failed.iter().position(|f| f.concerns(network, tap))?;
        Some(self.failed.remove(at))
    }
}

/// Observe, plan and apply until the host matches `desired`, network by network: a network
/// that cannot be set up (bad spec, refused by the node's `admission`, missing egress, a
/// failing netlink step) is reported in
/// [`Reconciled::failed`] and the others are set up all the same. `Err` only for what is
/// node-wide: netlink unusable, forwarding, the nft tables.
///
/// With no VM desired and no `impbr*` bridge on the host there is nothing of Imp's to remove
/// (the nft tables are created after a bridge and deleted before the last one), so nft is not
/// even asked: a node without networked VMs needs neither `nft` nor the privilege to run it.
pub async fn reconcile(
    desired: &[Attachment],
    admission: &Admission,
) -> Result<Reconciled, NetworkError> {
    let (connection, handle, _) = rtnetlink::new_connection().map_err(NetworkError::Socket)?;
    let conn = tokio::spawn(connection);
    let result = async {
        if desired.iter().all(|a| a.ports.is_empty()) && !netlink::has_bridges(&handle).await? {
            return Ok(Reconciled::default());
        }
        let observed = netlink::observe(&handle).await?;
        // Validated, then admitted by the node, then planned: a refused network gets nothing
        // (and loses its bridge, if an earlier admission had given it one).
        let (valid, mut failed) = plan::validate(desired);
        let (admitted, refused) = admit::admit(valid, &observed, admission);
        let plan = plan::plan(&admitted, &observed, &admission.reserved);
        failed.extend(refused);
        failed.extend(plan.failed);
        let mut done = Reconciled {
            actions: Vec::new(),
            failed,
        };
        for (network, actions) in plan.networks {
            for action in actions {
                if let Err(error) = netlink::execute(&handle, &action).await {
                    // The rest of this network's steps depend on the failed one; the next
                    // reconcile observes again and retries from where this one stopped.
                    done.failed.push(plan::Failure {
                        network,
                        tap: None,
                        error,
                    });
                    break;
                }
                done.actions.push(action);
            }
        }
        for action in plan.node {
            netlink::execute(&handle, &action).await?;
            done.actions.push(action);
        }
        Ok(done)
    }
    .await;
    conn.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_macs_are_stable_distinct_and_valid() {
        let a = bridge_name("3f1c8a2e-0000-4000-8000-000000000001");
        assert_eq!(a.len(), 15, "{a}");
        assert!(a.starts_with(BRIDGE_PREFIX));
        assert_eq!(a, bridge_name("3f1c8a2e-0000-4000-8000-000000000001"));
        assert_ne!(a, bridge_name("3f1c8a2e-0000-4000-8000-000000000002"));
        let m = vm_mac("vm-uid-1");
        assert_eq!(m, vm_mac("vm-uid-1"));
        assert_ne!(m, vm_mac("vm-uid-2"));
        // Locally administered, unicast.
        assert_eq!(m[0] & 0b11, 0b10);
        assert_eq!(bridge_mac("n")[0] & 0b11, 0b10);
        assert_ne!(bridge_mac("n"), vm_mac("n"));
        assert_eq!(format_mac(&[6, 0, 0xa, 0, 0, 0xff]), "06:00:0a:00:00:ff");
    }

    fn attached(network_id: &str, address: &str) -> NetworkAttachment {
        NetworkAttachment {
            network_id: network_id.into(),
            network_name: format!("ns/{network_id}"),
            address: address.parse().unwrap(),
            gateway: "198.51.100.1".parse().unwrap(),
            dns: vec![],
            mtu: None,
            nat: true,
            egress_interface: None,
            egress_allow: vec![],
            egress_deny: vec![],
            ingress: vec![],
        }
    }

    #[test]
    fn desired_groups_vms_by_network_in_first_seen_order() {
        let (a1, b1, a2) = (
            attached("net-a", "198.51.100.10/24"),
            attached("net-b", "198.51.100.20/25"),
            attached("net-a", "198.51.100.11/24"),
        );
        let d = desired([
            ("t1".to_string(), [6, 0, 0, 0, 0, 1], &a1),
            ("t2".to_string(), [6, 0, 0, 0, 0, 2], &b1),
            ("t3".to_string(), [6, 0, 0, 0, 0, 3], &a2),
        ]);
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].network, VmNetwork::from_attachment(&a1));
        assert_eq!(d[0].network.subnet, "198.51.100.0/24".parse().unwrap());
        assert_eq!(
            d[0].ports
                .iter()
                .map(|p| (p.tap.as_str(), p.ip.to_string()))
                .collect::<Vec<_>>(),
            [
                ("t1", "198.51.100.10".to_string()),
                ("t3", "198.51.100.11".to_string())
            ]
        );
        assert_eq!(d[1].network.subnet, "198.51.100.0/25".parse().unwrap());
        assert_eq!(d[1].ports[0].mac, [6, 0, 0, 0, 0, 2]);
        assert!(desired(std::iter::empty()).is_empty());
        assert_eq!(boot_args(&a1), "imp.net=198.51.100.10/24,198.51.100.1");
        assert_eq!(
            parse_mac("06:00:0a:00:00:ff"),
            Some([6, 0, 0xa, 0, 0, 0xff])
        );
        for bad in ["06:00:0a:00:00", "06:00:0a:00:00:fff", "zz:00:0a:00:00:01"] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }

    #[test]
    fn desired_takes_the_layout_from_the_oldest_vm_and_the_policy_from_the_newest() {
        let old = attached("net-a", "198.51.100.10/24");
        let new = NetworkAttachment {
            address: "198.51.100.11/25".parse().unwrap(),
            gateway: "198.51.100.126".parse().unwrap(),
            nat: false,
            egress_interface: Some("up1".into()),
            egress_allow: vec!["192.0.2.0/24".parse().unwrap()],
            egress_deny: vec!["203.0.113.0/24".parse().unwrap()],
            ingress: vec![],
            ..attached("net-a", "198.51.100.11/25")
        };
        let d = desired([
            ("t1".to_string(), [6, 0, 0, 0, 0, 1], &old),
            ("t2".to_string(), [6, 0, 0, 0, 0, 2], &new),
        ]);
        assert_eq!(d.len(), 1);
        assert_eq!(
            d[0].network,
            VmNetwork {
                subnet: "198.51.100.0/24".parse().unwrap(),
                gateway: "198.51.100.1".parse().unwrap(),
                ..VmNetwork::from_attachment(&new)
            }
        );
        assert_eq!(d[0].ports.len(), 2);
    }

    #[test]
    fn from_spec_and_boot_args_round_trip_through_the_guest_parser() {
        let spec: imp_api::ImpNetworkSpec = serde_json::from_value(serde_json::json!({
            "subnet": "10.44.0.0/24", "gateway": "10.44.0.1", "dns": ["10.44.0.1"],
            "nat": {"enabled": true},
            "egress": {"deny": ["10.0.0.0/8"], "allow": ["198.51.100.0/24"]}
        }))
        .unwrap();
        let n = VmNetwork::from_spec("uid-1", &spec).unwrap();
        assert!(n.nat && n.egress_interface.is_none());
        assert_eq!(
            n.egress_deny,
            ["10.0.0.0/8".parse::<ipnet::Ipv4Net>().unwrap()]
        );
        let args = n.boot_args("10.44.0.7".parse().unwrap(), Some(1400), &spec.dns);
        assert_eq!(
            args,
            "imp.net=10.44.0.7/24,10.44.0.1,1400 imp.dns=10.44.0.1"
        );
        let guest = imp_guest::pid1::cmdline::parse(&args).unwrap();
        let net = guest.net.unwrap();
        assert_eq!(
            (net.address, net.prefix, net.gateway, net.mtu),
            ("10.44.0.7".parse().unwrap(), 24, n.gateway, Some(1400))
        );

        let mut bad = spec.clone();
        bad.egress.as_mut().unwrap().allow = vec!["fd00::/8".into()];
        assert!(
            matches!(VmNetwork::from_spec("u", &bad), Err(NetworkSpecError { field, .. }) if field == "spec.egress.allow")
        );
        bad.subnet = "2001:db8::/64".into();
        assert!(
            matches!(VmNetwork::from_spec("u", &bad), Err(NetworkSpecError { field, .. }) if field == "spec.subnet")
        );
    }
}
