//! Pure decision: desired attachments vs what the host has -> the actions that close the gap.
//! No I/O here; netlink.rs observes and executes.

use std::collections::{BTreeMap, BTreeSet};

use super::nft::{self, Resolved};
use super::{Attachment, NetworkError, bridge_mac, bridge_name};

/// One link as observed (netlink link + address dump, sysctl).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Link {
    pub name: String,
    pub index: u32,
    /// IFLA_INFO_KIND: "bridge", "tun", "veth", ...
    pub kind: Option<String>,
    /// Index of the bridge this link is a port of.
    pub controller: Option<u32>,
    pub up: bool,
    pub mac: Option<[u8; 6]>,
    /// Bridge-port `isolated` flag (ports only).
    pub isolated: Option<bool>,
    pub ipv4: Vec<ipnet::Ipv4Net>,
    /// No IPv6 address on it: address generation off (`IFLA_INET6_ADDR_GEN_MODE` none),
    /// `net.ipv6.conf.<link>.disable_ipv6` 1, or no IPv6 in the kernel at all.
    pub ipv6_disabled: bool,
    /// `net.ipv4.conf.<link>.forwarding`: packets received on it may be forwarded.
    pub forwarding: bool,
}

impl Link {
    /// A bridge named like Imp's (`impbr*`): Imp's to keep or delete.
    pub fn is_imp_bridge(&self) -> bool {
        self.name.starts_with(super::BRIDGE_PREFIX) && self.kind.as_deref() == Some("bridge")
    }
}

/// One IPv4 route of the node's main table (default routes left out: every subnet is in 0/0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub destination: ipnet::Ipv4Net,
    /// The route's output interface, when it has one.
    pub interface: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Observed {
    pub links: Vec<Link>,
    /// Interface of the main table's IPv4 default route.
    pub default_route_interface: Option<String>,
    /// The main table's other IPv4 routes (admission: no network may overlap them).
    pub routes: Vec<Route>,
    pub nft: nft::Observed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    CreateTap {
        tap: String,
    },
    CreateBridge {
        bridge: String,
        mac: [u8; 6],
    },
    SetMac {
        link: String,
        mac: [u8; 6],
    },
    DisableIpv6 {
        link: String,
    },
    AddAddress {
        link: String,
        addr: ipnet::Ipv4Net,
    },
    DelAddress {
        link: String,
        addr: ipnet::Ipv4Net,
    },
    LinkUp {
        link: String,
    },
    Attach {
        tap: String,
        bridge: String,
    },
    Detach {
        tap: String,
    },
    Isolate {
        tap: String,
    },
    /// IPv4 forwarding of what `link` receives: a bridge (guests out) and an egress interface
    /// (replies and published ports in). Per link, not the global `ip_forward` (a sysctl file).
    EnableForwarding {
        link: String,
    },
    /// Replace both of Imp's nft tables with exactly these rules.
    ReplaceNft {
        rules: Vec<nft::Rule>,
    },
    DeleteNft,
    DeleteBridge {
        bridge: String,
    },
}

/// A network, or one VM's port on it, that cannot be set up this round, and why. Every other
/// network (and every other port of this one) is still set up: one broken ImpNetwork, or one
/// VM with a bad address, never blocks the rest of the node.
#[derive(Debug)]
pub struct Failure {
    pub network: String,
    /// The one port at fault (its VM fails, the network's other VMs keep theirs); `None`: the
    /// whole network.
    pub tap: Option<String>,
    pub error: NetworkError,
}

impl Failure {
    /// Whether this failure is (also) the one of the VM with `tap` on `network`.
    pub fn concerns(&self, network: &str, tap: &str) -> bool {
        self.network == network && self.tap.as_deref().is_none_or(|t| t == tap)
    }
}

/// What to do, per network (executed network by network, so a failing step of one does not
/// stop the others), then node-wide; plus what cannot be done.
#[derive(Debug, Default)]
pub struct Plan {
    /// (network id, its link actions), in desired order.
    pub networks: Vec<(String, Vec<Action>)>,
    /// After every network: forwarding, the nft tables, bridges no network wants.
    pub node: Vec<Action>,
    pub failed: Vec<Failure>,
}

impl Plan {
    /// Every action in execution order.
    pub fn actions(&self) -> Vec<Action> {
        self.networks
            .iter()
            .flat_map(|(_, a)| a)
            .chain(&self.node)
            .cloned()
            .collect()
    }
}

/// Split desired state into what can be set up and what is inconsistent, before anything is
/// touched: a network with a bad gateway is left out whole (its bridge, if any, goes: no
/// guest keeps a port without rules); a port with a bad or duplicate address, or a TAP wanted
/// by two networks (the later loses it), is left out alone.
pub fn validate(desired: &[Attachment]) -> (Vec<Attachment>, Vec<Failure>) {
    let mut taps: BTreeMap<&str, &str> = BTreeMap::new();
    let (mut valid, mut failed) = (Vec::new(), Vec::new());
    for a in desired {
        let n = &a.network;
        let subnet = n.subnet.trunc();
        let host = |ip: &std::net::Ipv4Addr| {
            subnet.contains(ip) && *ip != subnet.network() && *ip != subnet.broadcast()
        };
        if !host(&n.gateway) || subnet.prefix_len() > 30 {
            failed.push(Failure {
                network: n.id.clone(),
                tap: None,
                error: NetworkError::BadGateway {
                    network: n.id.clone(),
                    gateway: n.gateway,
                    subnet: n.subnet,
                },
            });
            continue;
        }
        let mut ips = BTreeSet::new();
        let mut ports = Vec::new();
        for p in &a.ports {
            let port_failure = |error| Failure {
                network: n.id.clone(),
                tap: Some(p.tap.clone()),
                error,
            };
            if !host(&p.ip) || p.ip == n.gateway || !ips.insert(p.ip) {
                failed.push(port_failure(NetworkError::BadAddress {
                    network: n.id.clone(),
                    ip: p.ip,
                    subnet: n.subnet,
                }));
                continue;
            }
            if let Some(other) = taps.get(p.tap.as_str()) {
                failed.push(port_failure(NetworkError::TapConflict {
                    tap: p.tap.clone(),
                    a: (*other).to_owned(),
                    b: n.id.clone(),
                }));
                continue;
            }
            taps.insert(&p.tap, &n.id);
            ports.push(p.clone());
        }
        valid.push(Attachment {
            network: n.clone(),
            ports,
        });
    }
    (valid, failed)
}

/// The actions that make the host match `desired` (validated first), in execution order; no
/// actions if it does. Networks without ports on this node are not set up (and torn down if
/// present). A network whose egress interface cannot be resolved still gets its bridge, ports
/// and isolation rules, without a way out, and is reported failed.
///
/// `reserved` (the platform's ranges) join the private ranges every guest is denied by default
/// (`nft::Denied`), as do the node's own addresses.
pub fn plan(desired: &[Attachment], observed: &Observed, reserved: &[ipnet::Ipv4Net]) -> Plan {
    let (desired, mut failed) = validate(desired);
    let by_name: BTreeMap<&str, &Link> = observed
        .links
        .iter()
        .map(|l| (l.name.as_str(), l))
        .collect();
    let mut networks = Vec::new();
    let mut resolved = Vec::new();
    let mut wanted_bridges = BTreeSet::new();
    let mut forwarding_planned = BTreeSet::new();

    for a in desired.iter().filter(|a| !a.ports.is_empty()) {
        let n = &a.network;
        let mut actions = Vec::new();
        let bridge = bridge_name(&n.id);
        wanted_bridges.insert(bridge.clone());
        let egress = match &n.egress_interface {
            Some(i) if by_name.contains_key(i.as_str()) => Ok(i.clone()),
            Some(i) => Err(NetworkError::EgressMissing {
                network: n.id.clone(),
                interface: i.clone(),
            }),
            None => {
                observed
                    .default_route_interface
                    .clone()
                    .ok_or_else(|| NetworkError::NoEgress {
                        network: n.id.clone(),
                    })
            }
        };
        let egress = egress
            .map_err(|error| {
                failed.push(Failure {
                    network: n.id.clone(),
                    tap: None,
                    error,
                })
            })
            .ok();
        let mac = bridge_mac(&n.id);
        let br = by_name.get(bridge.as_str()).copied();
        let gw = ipnet::Ipv4Net::new(n.gateway, n.subnet.prefix_len()).expect("prefix <= 32");
        match br {
            None => {
                actions.push(Action::CreateBridge {
                    bridge: bridge.clone(),
                    mac,
                });
                actions.push(Action::DisableIpv6 {
                    link: bridge.clone(),
                });
                actions.push(Action::AddAddress {
                    link: bridge.clone(),
                    addr: gw,
                });
                actions.push(Action::LinkUp {
                    link: bridge.clone(),
                });
            }
            Some(l) => {
                if l.mac != Some(mac) {
                    actions.push(Action::SetMac {
                        link: bridge.clone(),
                        mac,
                    });
                }
                if !l.ipv6_disabled {
                    actions.push(Action::DisableIpv6 {
                        link: bridge.clone(),
                    });
                }
                for stale in l.ipv4.iter().filter(|x| **x != gw) {
                    actions.push(Action::DelAddress {
                        link: bridge.clone(),
                        addr: *stale,
                    });
                }
                if !l.ipv4.contains(&gw) {
                    actions.push(Action::AddAddress {
                        link: bridge.clone(),
                        addr: gw,
                    });
                }
                if !l.up {
                    actions.push(Action::LinkUp {
                        link: bridge.clone(),
                    });
                }
            }
        }

        // A new bridge starts with the namespace's default (on where the node forwards already).
        if !br.is_some_and(|l| l.forwarding) {
            actions.push(Action::EnableForwarding {
                link: bridge.clone(),
            });
        }
        if let Some(e) = &egress
            && !by_name.get(e.as_str()).is_some_and(|l| l.forwarding)
            && forwarding_planned.insert(e.clone())
        {
            actions.push(Action::EnableForwarding { link: e.clone() });
        }

        let wanted_taps: BTreeSet<&str> = a.ports.iter().map(|p| p.tap.as_str()).collect();
        for p in &a.ports {
            let tap = by_name.get(p.tap.as_str()).copied();
            let attached = match (tap, br) {
                (Some(t), Some(b)) => t.controller == Some(b.index),
                _ => false,
            };
            if tap.is_none() {
                actions.push(Action::CreateTap { tap: p.tap.clone() });
            }
            if !tap.is_some_and(|t| t.ipv6_disabled) {
                actions.push(Action::DisableIpv6 {
                    link: p.tap.clone(),
                });
            }
            if !attached {
                actions.push(Action::Attach {
                    tap: p.tap.clone(),
                    bridge: bridge.clone(),
                });
            }
            // A port re-attached starts not isolated.
            if !attached || tap.is_some_and(|t| t.isolated != Some(true)) {
                actions.push(Action::Isolate { tap: p.tap.clone() });
            }
            if !tap.is_some_and(|t| t.up) {
                actions.push(Action::LinkUp {
                    link: p.tap.clone(),
                });
            }
        }
        // A TAP of a VM that left, still on the bridge (its runtime deletes it; until then it
        // must not carry traffic it has no rules for).
        if let Some(b) = br {
            for l in &observed.links {
                if l.controller == Some(b.index) && !wanted_taps.contains(l.name.as_str()) {
                    actions.push(Action::Detach {
                        tap: l.name.clone(),
                    });
                }
            }
        }
        resolved.push(Resolved {
            bridge,
            egress,
            attachment: a,
        });
        networks.push((n.id.clone(), actions));
    }

    let mut actions = Vec::new();
    let node_addresses = observed
        .links
        .iter()
        .filter(|l| !l.is_imp_bridge())
        .flat_map(|l| l.ipv4.iter().map(|a| a.addr()));
    let rules = nft::rules(&resolved, &nft::Denied::new(reserved, node_addresses));
    if rules.is_empty() {
        if observed.nft.present {
            actions.push(Action::DeleteNft);
        }
    } else if !observed.nft.present || observed.nft.keys != nft::keys(&rules) {
        actions.push(Action::ReplaceNft { rules });
    }
    for l in &observed.links {
        if l.is_imp_bridge() && !wanted_bridges.contains(&l.name) {
            actions.push(Action::DeleteBridge {
                bridge: l.name.clone(),
            });
        }
    }
    Plan {
        networks,
        node: actions,
        failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::{Port, VmNetwork};

    fn net(id: &str, subnet: &str, gw: &str) -> VmNetwork {
        VmNetwork {
            id: id.into(),
            subnet: subnet.parse().unwrap(),
            gateway: gw.parse().unwrap(),
            nat: true,
            egress_interface: None,
            egress_allow: vec![],
            egress_deny: vec![],
            ingress: vec![],
        }
    }

    fn port(tap: &str, ip: &str) -> Port {
        Port {
            tap: tap.into(),
            mac: crate::network::vm_mac(tap),
            ip: ip.parse().unwrap(),
            dns: vec![],
        }
    }

    fn one(ports: Vec<Port>) -> Vec<Attachment> {
        vec![Attachment {
            network: net("n1", "192.0.2.0/24", "192.0.2.1"),
            ports,
        }]
    }

    fn uplink() -> Link {
        Link {
            name: "eth0".into(),
            index: 2,
            kind: Some("veth".into()),
            up: true,
            ..Default::default()
        }
    }

    fn fresh() -> Observed {
        Observed {
            links: vec![uplink()],
            default_route_interface: Some("eth0".into()),
            routes: vec![],
            nft: nft::Observed::default(),
        }
    }

    /// The host after `actions` ran (what a perfect executor leaves), for convergence tests.
    fn simulate(desired: &[Attachment], mut obs: Observed, actions: &[Action]) -> Observed {
        let mut next = 100;
        for a in actions {
            let find = |obs: &Observed, name: &str| {
                obs.links.iter().position(|l| l.name == name).expect(name)
            };
            match a {
                Action::CreateTap { tap } => {
                    next += 1;
                    obs.links.push(Link {
                        name: tap.clone(),
                        index: next,
                        kind: Some("tun".into()),
                        ..Default::default()
                    });
                }
                Action::CreateBridge { bridge, mac } => {
                    next += 1;
                    obs.links.push(Link {
                        name: bridge.clone(),
                        index: next,
                        kind: Some("bridge".into()),
                        mac: Some(*mac),
                        ..Default::default()
                    });
                }
                Action::SetMac { link, mac } => {
                    let i = find(&obs, link);
                    obs.links[i].mac = Some(*mac);
                }
                Action::DisableIpv6 { link } => {
                    let i = find(&obs, link);
                    obs.links[i].ipv6_disabled = true;
                }
                Action::AddAddress { link, addr } => {
                    let i = find(&obs, link);
                    obs.links[i].ipv4.push(*addr);
                }
                Action::DelAddress { link, addr } => {
                    let i = find(&obs, link);
                    obs.links[i].ipv4.retain(|x| x != addr);
                }
                Action::LinkUp { link } => {
                    let i = find(&obs, link);
                    obs.links[i].up = true;
                }
                Action::Attach { tap, bridge } => {
                    let b = obs.links[find(&obs, bridge)].index;
                    let i = find(&obs, tap);
                    obs.links[i].controller = Some(b);
                    obs.links[i].isolated = Some(false);
                }
                Action::Detach { tap } => {
                    let i = find(&obs, tap);
                    obs.links[i].controller = None;
                    obs.links[i].isolated = None;
                }
                Action::Isolate { tap } => {
                    let i = find(&obs, tap);
                    obs.links[i].isolated = Some(true);
                }
                Action::EnableForwarding { link } => {
                    let i = find(&obs, link);
                    obs.links[i].forwarding = true;
                }
                Action::ReplaceNft { rules } => {
                    obs.nft = nft::Observed {
                        present: true,
                        keys: nft::keys(rules),
                    }
                }
                Action::DeleteNft => obs.nft = nft::Observed::default(),
                Action::DeleteBridge { bridge } => {
                    let b = obs.links[find(&obs, bridge)].index;
                    obs.links.retain(|l| l.name != *bridge);
                    for l in &mut obs.links {
                        if l.controller == Some(b) {
                            l.controller = None;
                        }
                    }
                }
            }
        }
        let _ = desired;
        obs
    }

    fn converge(desired: &[Attachment], obs: Observed) -> (Vec<Action>, Observed) {
        let p = plan(desired, &obs, &[]);
        assert!(p.failed.is_empty(), "{:?}", p.failed);
        let actions = p.actions();
        let after = simulate(desired, obs, &actions);
        assert_eq!(
            plan(desired, &after, &[]).actions(),
            [],
            "a second plan must be empty after {actions:?}"
        );
        (actions, after)
    }

    #[test]
    fn fresh_host_gets_bridge_taps_forwarding_and_rules_in_order() {
        let d = one(vec![port("imptap1", "192.0.2.10")]);
        let (actions, after) = converge(&d, fresh());
        let br = bridge_name("n1");
        let pos = |pred: &dyn Fn(&Action) -> bool| actions.iter().position(pred).unwrap();
        let create = pos(&|a| matches!(a, Action::CreateBridge { .. }));
        let v6 = pos(&|a| matches!(a, Action::DisableIpv6 { link } if *link == br));
        let up = pos(&|a| matches!(a, Action::LinkUp { link } if *link == br));
        assert!(
            create < v6 && v6 < up,
            "IPv6 off before the link is up: {actions:?}"
        );
        let attach = pos(&|a| matches!(a, Action::Attach { .. }));
        let iso = pos(&|a| matches!(a, Action::Isolate { .. }));
        assert!(attach < iso);
        let fwd = pos(&|a| matches!(a, Action::EnableForwarding { link } if *link == br));
        assert!(create < fwd, "{actions:?}");
        assert!(actions.contains(&Action::EnableForwarding {
            link: "eth0".into()
        }));
        assert!(
            actions
                .iter()
                .any(|a| matches!(a, Action::ReplaceNft { .. }))
        );
        let b = after.links.iter().find(|l| l.name == br).unwrap();
        assert_eq!(b.ipv4, ["192.0.2.1/24".parse().unwrap()]);
        assert_eq!(b.mac, Some(bridge_mac("n1")));
    }

    #[test]
    fn matching_host_is_a_no_op_and_drift_is_repaired_precisely() {
        let d = one(vec![port("imptap1", "192.0.2.10")]);
        let (_, good) = converge(&d, fresh());
        assert_eq!(plan(&d, &good, &[]).actions(), []);
        let br = bridge_name("n1");
        let mut drift = good.clone();
        let b = drift.links.iter_mut().find(|l| l.name == br).unwrap();
        b.ipv4 = vec!["192.0.2.254/24".parse().unwrap()];
        b.up = false;
        let t = drift
            .links
            .iter_mut()
            .find(|l| l.name == "imptap1")
            .unwrap();
        t.isolated = Some(false);
        drift.nft.keys.insert("stray".into());
        let (actions, _) = converge(&d, drift);
        assert_eq!(
            actions,
            [
                Action::DelAddress {
                    link: br.clone(),
                    addr: "192.0.2.254/24".parse().unwrap()
                },
                Action::AddAddress {
                    link: br.clone(),
                    addr: "192.0.2.1/24".parse().unwrap()
                },
                Action::LinkUp { link: br.clone() },
                Action::Isolate {
                    tap: "imptap1".into()
                },
                Action::ReplaceNft {
                    rules: match &plan(&d, &fresh(), &[]).actions().last() {
                        Some(Action::ReplaceNft { rules }) => rules.clone(),
                        other => panic!("{other:?}"),
                    }
                },
            ]
        );
    }

    #[test]
    fn last_vm_leaving_removes_bridge_and_rules_but_keeps_forwarding() {
        let d = one(vec![port("imptap1", "192.0.2.10")]);
        let (_, up) = converge(&d, fresh());
        let br = bridge_name("n1");
        let (actions, after) = converge(&one(vec![]), up.clone());
        assert_eq!(
            actions,
            [
                Action::DeleteNft,
                Action::DeleteBridge { bridge: br.clone() }
            ]
        );
        assert!(
            after
                .links
                .iter()
                .find(|l| l.name == "eth0")
                .unwrap()
                .forwarding,
            "other things on the node may rely on the uplink's forwarding"
        );
        assert!(!after.links.iter().any(|l| l.name == br));
        // The same with no desired state at all (a runtime restarted with no VMs).
        let (actions, _) = converge(&[], up);
        assert_eq!(
            actions,
            [Action::DeleteNft, Action::DeleteBridge { bridge: br }]
        );
    }

    #[test]
    fn one_vm_leaving_detaches_its_tap_and_rewrites_rules() {
        let d = one(vec![
            port("imptap1", "192.0.2.10"),
            port("imptap2", "192.0.2.11"),
        ]);
        let (_, up) = converge(&d, fresh());
        let (actions, _) = converge(&one(vec![port("imptap1", "192.0.2.10")]), up);
        assert!(
            matches!(&actions[..], [Action::Detach { tap }, Action::ReplaceNft { .. }] if tap == "imptap2"),
            "{actions:?}"
        );
    }

    #[test]
    fn foreign_links_are_never_touched() {
        let mut obs = fresh();
        // Not a bridge, or not our prefix: never deleted.
        obs.links.push(Link {
            name: "impbr-not-a-br".into(),
            index: 50,
            kind: Some("veth".into()),
            ..Default::default()
        });
        obs.links.push(Link {
            name: "docker0".into(),
            index: 51,
            kind: Some("bridge".into()),
            ..Default::default()
        });
        obs.links.push(Link {
            name: "impbr00000000ff".into(),
            index: 52,
            kind: Some("bridge".into()),
            ..Default::default()
        });
        assert_eq!(
            plan(&[], &obs, &[]).actions(),
            [Action::DeleteBridge {
                bridge: "impbr00000000ff".into()
            }]
        );
    }

    #[test]
    fn two_networks_get_two_bridges_and_one_rule_set() {
        let d = vec![
            Attachment {
                network: net("n1", "192.0.2.0/25", "192.0.2.1"),
                ports: vec![port("imptap1", "192.0.2.10")],
            },
            Attachment {
                network: net("n2", "192.0.2.128/25", "192.0.2.129"),
                ports: vec![port("imptap2", "192.0.2.130")],
            },
        ];
        let (actions, after) = converge(&d, fresh());
        let bridges = actions
            .iter()
            .filter(|a| matches!(a, Action::CreateBridge { .. }))
            .count();
        assert_eq!(bridges, 2);
        assert_eq!(
            actions
                .iter()
                .filter(|a| matches!(a, Action::ReplaceNft { .. }))
                .count(),
            1
        );
        // Removing one network keeps the other's bridge.
        let (actions, _) = converge(&d[..1], after);
        assert!(actions.contains(&Action::DeleteBridge {
            bridge: bridge_name("n2")
        }));
        assert!(!actions.contains(&Action::DeleteBridge {
            bridge: bridge_name("n1")
        }));
    }

    #[test]
    fn the_node_s_addresses_and_reserved_ranges_reach_the_default_deny() {
        let d = one(vec![port("imptap1", "192.0.2.10")]);
        let with_uplink = |addr: &str| {
            let mut obs = fresh();
            obs.links[0].ipv4 = vec![addr.parse().unwrap()];
            obs
        };
        // The rules a fresh node gets, as text per reason.
        let rules =
            |obs: &Observed, reserved: &[ipnet::Ipv4Net], why: &str| match plan(&d, obs, reserved)
                .actions()
                .last()
            {
                Some(Action::ReplaceNft { rules }) => serde_json::to_string(
                    &rules
                        .iter()
                        .filter(|r| r.why == why)
                        .map(|r| &r.expr)
                        .collect::<Vec<_>>(),
                )
                .unwrap(),
                other => panic!("{other:?}"),
            };
        let deny = "private and reserved ranges (default deny; egress.allow opens)";
        let reserved = ["198.18.0.0/15".parse().unwrap()];
        let t = rules(&fresh(), &reserved, deny);
        assert!(t.contains("198.18.0.0") && t.contains("10.0.0.0"), "{t}");
        assert!(!rules(&fresh(), &[], deny).contains("198.18.0.0"));
        let node = rules(
            &with_uplink("203.0.113.7/24"),
            &[],
            "no address of the node",
        );
        assert!(node.contains(r#""addr":"203.0.113.7","len":32"#), "{node}");
        // The gateway on Imp's bridge is no node address here (the input chain keeps guests
        // off it); the uplink's address changing rewrites the rules and touches nothing else.
        let (_, mut up) = converge(&d, with_uplink("203.0.113.7/24"));
        up.links[0].ipv4 = vec!["203.0.113.8/24".parse().unwrap()];
        let p = plan(&d, &up, &[]);
        match &p.actions()[..] {
            [Action::ReplaceNft { rules }] => {
                let t = serde_json::to_string(&rules.iter().map(|r| &r.expr).collect::<Vec<_>>())
                    .unwrap();
                assert!(
                    t.contains("203.0.113.8") && !t.contains("203.0.113.7"),
                    "{t}"
                );
                assert!(!t.contains(r#""addr":"192.0.2.1","len":32"#), "{t}");
            }
            other => panic!("{other:?}"),
        }
    }

    fn whys(actions: &[Action]) -> Vec<&'static str> {
        actions
            .iter()
            .find_map(|a| match a {
                Action::ReplaceNft { rules } => Some(rules.iter().map(|r| r.why).collect()),
                _ => None,
            })
            .unwrap_or_default()
    }

    #[test]
    fn egress_resolution_and_its_failures() {
        let mut d = one(vec![port("imptap1", "192.0.2.10")]);
        let mut obs = fresh();
        obs.default_route_interface = None;
        let p = plan(&d, &obs, &[]);
        assert!(
            matches!(&p.failed[..], [Failure { network, tap: None, error: NetworkError::NoEgress { .. } }] if network == "n1"),
            "{:?}",
            p.failed
        );
        // Still set up, isolated, with no way out: its running guests keep their rules.
        let actions = p.actions();
        assert!(actions.contains(&Action::CreateBridge {
            bridge: bridge_name("n1"),
            mac: bridge_mac("n1")
        }));
        let w = whys(&actions);
        assert!(w.contains(&"guests reach no address of the node"), "{w:?}");
        assert!(w.contains(&"guest IPv4 source only"), "{w:?}");
        assert!(!w.contains(&"guests out the egress interface"), "{w:?}");
        assert!(!w.contains(&"outbound NAT"), "{w:?}");
        d[0].network.egress_interface = Some("eth7".into());
        assert!(matches!(
            &plan(&d, &obs, &[]).failed[..],
            [Failure { error: NetworkError::EgressMissing { interface, .. }, .. }] if interface == "eth7"
        ));
        d[0].network.egress_interface = Some("eth0".into());
        let p = plan(&d, &obs, &[]);
        assert!(p.failed.is_empty());
        assert!(whys(&p.actions()).contains(&"outbound NAT"));
        // A network without VMs here needs no egress at all.
        let p = plan(&one(vec![]), &obs, &[]);
        assert!(p.actions().is_empty() && p.failed.is_empty());
    }

    #[test]
    fn one_broken_network_does_not_block_another() {
        let mut broken = net("n1", "192.0.2.0/25", "192.0.2.1");
        broken.egress_interface = Some("eth7".into());
        let d = vec![
            Attachment {
                network: broken,
                ports: vec![port("imptap1", "192.0.2.10")],
            },
            Attachment {
                network: net("n2", "192.0.2.128/25", "192.0.2.129"),
                ports: vec![port("imptap2", "192.0.2.130")],
            },
            // A bad gateway: left out whole, its bridge goes.
            Attachment {
                network: net("n3", "198.51.100.0/24", "198.51.100.0"),
                ports: vec![port("imptap3", "198.51.100.10")],
            },
        ];
        let mut obs = fresh();
        obs.links.push(Link {
            name: bridge_name("n3"),
            index: 50,
            kind: Some("bridge".into()),
            ..Default::default()
        });
        let p = plan(&d, &obs, &[]);
        let failed: Vec<_> = p
            .failed
            .iter()
            .map(|f| (f.network.as_str(), f.tap.is_none()))
            .collect();
        assert_eq!(failed, [("n3", true), ("n1", true)]);
        assert!(p.failed[0].concerns("n3", "imptap3") && !p.failed[0].concerns("n2", "imptap2"));
        let ids: Vec<_> = p.networks.iter().map(|(id, _)| id.as_str()).collect();
        assert_eq!(ids, ["n1", "n2"]);
        let actions = p.actions();
        assert!(actions.contains(&Action::Attach {
            tap: "imptap2".into(),
            bridge: bridge_name("n2")
        }));
        assert!(actions.contains(&Action::DeleteBridge {
            bridge: bridge_name("n3")
        }));
        assert!(
            !actions
                .iter()
                .any(|a| matches!(a, Action::CreateTap { tap } if tap == "imptap3"))
        );
        // n2's way out is there, n1's is not.
        let rules = match actions
            .iter()
            .find(|a| matches!(a, Action::ReplaceNft { .. }))
        {
            Some(Action::ReplaceNft { rules }) => rules.clone(),
            other => panic!("{other:?}"),
        };
        let out_of = |b: &str| {
            rules.iter().any(|r| {
                r.why == "guests out the egress interface" && r.expr[0].to_string().contains(b)
            })
        };
        assert!(out_of(&bridge_name("n2")) && !out_of(&bridge_name("n1")));
    }

    #[test]
    fn validate_leaves_out_bad_networks_and_bad_ports_alone() {
        let bad_gw = vec![Attachment {
            network: net("n1", "192.0.2.0/24", "192.0.2.0"),
            ports: vec![],
        }];
        let (valid, failed) = validate(&bad_gw);
        assert!(valid.is_empty());
        assert!(matches!(
            &failed[..],
            [Failure {
                tap: None,
                error: NetworkError::BadGateway { .. },
                ..
            }]
        ));
        for ip in ["192.0.2.1", "192.0.2.255", "198.51.100.5"] {
            let d = one(vec![port("imptap1", ip), port("imptap2", "192.0.2.20")]);
            let (valid, failed) = validate(&d);
            assert_eq!(valid[0].ports, [port("imptap2", "192.0.2.20")], "{ip}");
            assert!(
                matches!(&failed[..], [Failure { tap: Some(t), error: NetworkError::BadAddress { .. }, .. }] if t == "imptap1"),
                "{ip}: {failed:?}"
            );
        }
        let dup = one(vec![
            port("imptap1", "192.0.2.10"),
            port("imptap2", "192.0.2.10"),
        ]);
        let (valid, failed) = validate(&dup);
        assert_eq!(valid[0].ports, [port("imptap1", "192.0.2.10")]);
        assert!(matches!(
            &failed[..],
            [Failure { tap: Some(t), error: NetworkError::BadAddress { .. }, .. }] if t == "imptap2"
        ));
        let mut two = one(vec![port("imptap1", "192.0.2.10")]);
        two.push(Attachment {
            network: net("n2", "198.51.100.0/24", "198.51.100.1"),
            ports: vec![port("imptap1", "198.51.100.10")],
        });
        let (valid, failed) = validate(&two);
        assert_eq!((valid[0].ports.len(), valid[1].ports.len()), (1, 0));
        assert!(matches!(
            &failed[..],
            [Failure { network, error: NetworkError::TapConflict { .. }, .. }] if network == "n2"
        ));
        let ok = one(vec![port("imptap1", "192.0.2.10")]);
        assert_eq!(validate(&ok).0, ok);
        assert!(validate(&ok).1.is_empty());
    }
}
