//! Node admission of ImpNetworks, pure: a network may use only address space the node does not
//! route elsewhere, leave only through the interface the platform allows, and open only the
//! denied ranges the platform allows.
//!
//! An ImpNetwork's gateway goes onto a bridge, which adds a connected route for the whole
//! subnet. A subnet overlapping the node's own uplink, one of its routes, a cluster range or
//! another network on the node would divert the node's traffic into the bridge (and IPAM hands
//! the diverted addresses to guests); an egress interface chosen by a namespace user could
//! masquerade guests onto a management or overlay network. So before anything is touched, each
//! network is checked against what the node has outside Imp's own bridges, the platform's
//! reserved ranges and the networks admitted before it (first come, first kept: a running
//! network is never displaced by a new one). Guests are denied the private and reserved ranges
//! by default (`nft::Denied`); a namespace user's `egress.allow` reopens part of them only
//! inside what the platform admin allows (`Admission::allowable_egress`), else the network is
//! refused, so the user learns why rather than finding the range silently closed.

use ipnet::Ipv4Net;

use super::plan::{Failure, Observed};
use super::{Attachment, NetworkError};

/// The platform admin's rules (imp-runtime flags, the chart's `runtime.network` values).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admission {
    /// Interfaces an ImpNetwork's `nat.egressInterface` may name besides the default route's.
    pub allowed_egress_interfaces: Vec<String>,
    /// Ranges no ImpNetwork subnet may overlap (the cluster's pod, service and node CIDRs);
    /// guests are denied them by default, like the private ranges (`nft::Denied`).
    pub reserved: Vec<Ipv4Net>,
    /// Ranges an ImpNetwork's `egress.allow` may open out of the default deny (private and
    /// reserved ranges); an allow entry reaching into a denied range outside them is refused.
    pub allowable_egress: Vec<Ipv4Net>,
}

impl Admission {
    /// The first range an `egress.allow` entry would open that the platform does not allow:
    /// (the entry, the denied range it reaches into).
    fn unallowed_opening(&self, allow: &[Ipv4Net]) -> Option<(Ipv4Net, Ipv4Net)> {
        let denied = super::nft::Denied::new(&self.reserved, []).ranges;
        allow.iter().find_map(|entry| {
            let allowed = self
                .allowable_egress
                .iter()
                .any(|a| a.trunc().contains(&entry.trunc()));
            denied
                .iter()
                .find(|d| !allowed && overlaps(d, entry))
                .map(|d| (entry.trunc(), *d))
        })
    }
}

fn overlaps(a: &Ipv4Net, b: &Ipv4Net) -> bool {
    let (a, b) = (a.trunc(), b.trunc());
    a.contains(&b.network()) || b.contains(&a.network())
}

/// Keeps the networks the node admits, in order; each refused one is a whole-network failure
/// (its VMs fail with the reason, nothing of it is set up).
pub fn admit(
    desired: Vec<Attachment>,
    observed: &Observed,
    rules: &Admission,
) -> (Vec<Attachment>, Vec<Failure>) {
    let imp_bridge = |name: &str| {
        observed
            .links
            .iter()
            .any(|l| l.name == name && l.is_imp_bridge())
    };
    let (mut admitted, mut failed): (Vec<Attachment>, Vec<Failure>) = (Vec::new(), Vec::new());
    for a in desired {
        let n = &a.network;
        let refuse = |error| Failure {
            network: n.id.clone(),
            tap: None,
            error,
        };
        let subnet = n.subnet.trunc();
        let address = observed
            .links
            .iter()
            .filter(|l| !l.is_imp_bridge())
            .find_map(|l| {
                l.ipv4
                    .iter()
                    .find(|addr| overlaps(addr, &subnet))
                    .map(|addr| (l.name.clone(), *addr))
            });
        let route = observed.routes.iter().find(|r| {
            overlaps(&r.destination, &subnet) && !r.interface.as_deref().is_some_and(imp_bridge)
        });
        let reserved = rules.reserved.iter().find(|r| overlaps(r, &subnet));
        let other = admitted
            .iter()
            .find(|o| o.network.id != n.id && overlaps(&o.network.subnet, &subnet));
        let egress = n.egress_interface.as_ref().filter(|i| {
            observed.default_route_interface.as_ref() != Some(*i)
                && !rules.allowed_egress_interfaces.contains(i)
        });
        let error = if let Some((interface, address)) = address {
            NetworkError::SubnetOverlapsNode {
                network: n.id.clone(),
                subnet,
                interface,
                address,
            }
        } else if let Some(r) = route {
            NetworkError::SubnetOverlapsRoute {
                network: n.id.clone(),
                subnet,
                route: r.destination,
                interface: r.interface.clone().unwrap_or_else(|| "none".into()),
            }
        } else if let Some(r) = reserved {
            NetworkError::SubnetReserved {
                network: n.id.clone(),
                subnet,
                reserved: *r,
            }
        } else if let Some(o) = other {
            NetworkError::SubnetOverlapsNetwork {
                network: n.id.clone(),
                subnet,
                other: o.network.id.clone(),
                other_subnet: o.network.subnet,
            }
        } else if let Some(i) = egress {
            NetworkError::EgressNotAllowed {
                network: n.id.clone(),
                interface: i.clone(),
            }
        } else if let Some((range, denied)) = rules.unallowed_opening(&n.egress_allow) {
            NetworkError::EgressRangeNotAllowed {
                network: n.id.clone(),
                range,
                denied,
            }
        } else {
            admitted.push(a);
            continue;
        };
        failed.push(refuse(error));
    }
    (admitted, failed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::plan::{Link, Route};
    use crate::network::{Port, VmNetwork, bridge_name};

    fn net(id: &str, subnet: &str, gateway: &str) -> Attachment {
        Attachment {
            network: VmNetwork {
                id: id.into(),
                subnet: subnet.parse().unwrap(),
                gateway: gateway.parse().unwrap(),
                nat: true,
                egress_interface: None,
                egress_allow: vec![],
                egress_deny: vec![],
                ingress: vec![],
            },
            ports: vec![Port {
                tap: format!("tap-{id}"),
                mac: [6, 0, 0, 0, 0, 1],
                ip: gateway
                    .parse::<std::net::Ipv4Addr>()
                    .map(|g| std::net::Ipv4Addr::from(u32::from(g) + 1))
                    .unwrap(),
                dns: vec![],
            }],
        }
    }

    /// A node with an uplink in 192.0.2.0/24 (default route), a route to 203.0.113.0/25 over
    /// it, and Imp's bridge of network `ours` holding 198.51.100.1/26.
    fn node() -> Observed {
        Observed {
            links: vec![
                Link {
                    name: "uplink0".into(),
                    index: 2,
                    ipv4: vec!["192.0.2.10/24".parse().unwrap()],
                    ..Link::default()
                },
                Link {
                    name: "mgmt0".into(),
                    index: 3,
                    ..Link::default()
                },
                Link {
                    name: bridge_name("ours"),
                    index: 4,
                    kind: Some("bridge".into()),
                    ipv4: vec!["198.51.100.1/26".parse().unwrap()],
                    ..Link::default()
                },
            ],
            routes: vec![
                Route {
                    destination: "192.0.2.0/24".parse().unwrap(),
                    interface: Some("uplink0".into()),
                },
                Route {
                    destination: "203.0.113.0/25".parse().unwrap(),
                    interface: Some("uplink0".into()),
                },
                Route {
                    destination: "198.51.100.0/26".parse().unwrap(),
                    interface: Some(bridge_name("ours")),
                },
            ],
            default_route_interface: Some("uplink0".into()),
            ..Observed::default()
        }
    }

    fn reasons(failed: &[Failure]) -> Vec<(String, &'static str)> {
        failed
            .iter()
            .map(|f| (f.network.clone(), f.error.kind()))
            .collect()
    }

    #[test]
    fn a_subnet_clear_of_the_node_is_admitted_and_imp_s_own_bridge_does_not_count() {
        let (ok, failed) = admit(
            vec![net("ours", "198.51.100.0/26", "198.51.100.1")],
            &node(),
            &Admission::default(),
        );
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(ok.len(), 1);
    }

    #[test]
    fn overlaps_with_the_node_s_addresses_routes_reserved_ranges_and_other_networks_are_refused() {
        let rules = Admission {
            reserved: vec!["198.18.0.0/15".parse().unwrap()],
            ..Admission::default()
        };
        let (ok, failed) = admit(
            vec![
                net("first", "198.51.100.64/26", "198.51.100.65"),
                // The uplink's own subnet, and a narrower one inside it.
                net("uplink", "192.0.2.0/24", "192.0.2.1"),
                net("inside", "192.0.2.128/28", "192.0.2.129"),
                // Wider than a route of the node.
                net("route", "203.0.113.0/24", "203.0.113.1"),
                net("reserved", "198.19.0.0/24", "198.19.0.1"),
                // The same subnet as the first network: the first keeps it.
                net("second", "198.51.100.64/27", "198.51.100.65"),
            ],
            &node(),
            &rules,
        );
        assert_eq!(
            ok.iter().map(|a| a.network.id.as_str()).collect::<Vec<_>>(),
            ["first"]
        );
        assert_eq!(
            reasons(&failed),
            [
                ("uplink".to_string(), "subnet_overlap"),
                ("inside".to_string(), "subnet_overlap"),
                ("route".to_string(), "subnet_overlap"),
                ("reserved".to_string(), "subnet_reserved"),
                ("second".to_string(), "subnet_overlap"),
            ]
        );
        let messages: Vec<String> = failed.iter().map(|f| f.error.to_string()).collect();
        assert!(
            messages[0].contains("uplink0") && messages[0].contains("192.0.2.10/24"),
            "{messages:?}"
        );
        assert!(messages[2].contains("203.0.113.0/25"), "{messages:?}");
        assert!(messages[3].contains("198.18.0.0/15"), "{messages:?}");
        assert!(messages[4].contains("first"), "{messages:?}");
    }

    #[test]
    fn the_egress_interface_is_the_default_route_s_unless_the_admin_allows_another() {
        let mut a = net("n", "198.51.100.128/26", "198.51.100.129");
        a.network.egress_interface = Some("mgmt0".into());
        let (ok, failed) = admit(vec![a.clone()], &node(), &Admission::default());
        assert!(ok.is_empty());
        assert_eq!(reasons(&failed), [("n".to_string(), "egress_not_allowed")]);
        assert!(failed[0].error.to_string().contains("mgmt0"));
        let allowed = Admission {
            allowed_egress_interfaces: vec!["mgmt0".into()],
            ..Admission::default()
        };
        assert_eq!(admit(vec![a.clone()], &node(), &allowed).0.len(), 1);
        a.network.egress_interface = Some("uplink0".into());
        assert_eq!(admit(vec![a], &node(), &Admission::default()).0.len(), 1);
    }

    #[test]
    fn egress_allow_opens_a_denied_range_only_inside_what_the_platform_allows() {
        let with_allow = |id: &str, allow: &[&str]| {
            let mut a = net(id, "198.51.100.0/28", "198.51.100.1");
            a.network.egress_allow = allow.iter().map(|c| c.parse().unwrap()).collect();
            a
        };
        let rules = Admission {
            reserved: vec!["198.18.0.0/15".parse().unwrap()],
            allowable_egress: vec![
                "10.20.0.0/16".parse().unwrap(),
                "198.18.5.0/24".parse().unwrap(),
            ],
            ..Admission::default()
        };
        let cases = [
            // Public ranges are no opening: always admitted.
            (&["203.0.113.0/24"][..], None),
            // Inside an allowable range (private, or reserved).
            (&["10.20.1.0/24"][..], None),
            (&["198.18.5.7/32"][..], None),
            // A private range the admin did not allow; wider than an allowable one.
            (&["10.30.0.0/16"][..], Some(("10.30.0.0/16", "10.0.0.0/8"))),
            (&["10.0.0.0/8"][..], Some(("10.0.0.0/8", "10.0.0.0/8"))),
            // CGNAT, a reserved range, and "anywhere" (which covers all of them).
            (
                &["100.64.1.0/24"][..],
                Some(("100.64.1.0/24", "100.64.0.0/10")),
            ),
            (
                &["198.19.0.0/16"][..],
                Some(("198.19.0.0/16", "198.18.0.0/15")),
            ),
            (
                &["203.0.113.0/24", "0.0.0.0/0"][..],
                Some(("0.0.0.0/0", "10.0.0.0/8")),
            ),
        ];
        for (allow, refused) in cases {
            let (ok, failed) = admit(vec![with_allow("n", allow)], &node(), &rules);
            match refused {
                None => assert!(failed.is_empty() && ok.len() == 1, "{allow:?}: {failed:?}"),
                Some((range, denied)) => {
                    assert!(ok.is_empty(), "{allow:?} admitted");
                    assert_eq!(
                        reasons(&failed),
                        [("n".to_string(), "egress_range_not_allowed")]
                    );
                    let m = failed[0].error.to_string();
                    assert!(
                        m.contains(&format!("spec.egress.allow {range} opens {denied}"))
                            && m.contains("--network-allowable-egress-cidrs"),
                        "{allow:?}: {m}"
                    );
                }
            }
        }
        // Without any allowable range, every opening is refused; the admin's "anywhere" allows
        // every one.
        let none = Admission::default();
        assert_eq!(
            admit(vec![with_allow("n", &["192.168.1.0/24"])], &node(), &none)
                .1
                .len(),
            1
        );
        let anywhere = Admission {
            allowable_egress: vec!["0.0.0.0/0".parse().unwrap()],
            ..Admission::default()
        };
        assert_eq!(
            admit(vec![with_allow("n", &["0.0.0.0/0"])], &node(), &anywhere)
                .0
                .len(),
            1
        );
    }
}
