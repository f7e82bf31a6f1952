//! The thin I/O half: observe the host (rtnetlink dumps, `nft -j list ruleset`) and execute one
//! [`Action`] at a time. No decisions here.
//!
//! Nothing here writes `/proc/sys`: a non-privileged container (the chart's runtime pod) sees it
//! read-only, and with `hostNetwork` the node's sysctls cannot be pod sysctls. Per-link IPv4
//! forwarding and IPv6 address generation are set over rtnetlink instead (`RTM_SETLINK` with
//! `IFLA_AF_SPEC`), which needs only `CAP_NET_ADMIN`.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use futures::TryStreamExt;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{
    AfSpecInet, AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InetDevConf, InfoBridgePort,
    InfoPortData, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage};
use rtnetlink::{Handle, LinkBridge, LinkBridgePort, LinkUnspec, RouteMessageBuilder};

use super::NetworkError;
use super::nft;
use super::plan::{Action, Link, Observed, Route};

fn nl(step: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetworkError {
    let step = step.into();
    move |source| NetworkError::Netlink { step, source }
}

fn link_from(msg: &LinkMessage) -> Link {
    let mut link = Link {
        index: msg.header.index,
        up: msg.header.flags.contains(LinkFlags::Up),
        ..Default::default()
    };
    for attr in &msg.attributes {
        match attr {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::Controller(i) => link.controller = Some(*i),
            LinkAttribute::Address(a) => link.mac = <[u8; 6]>::try_from(a.as_slice()).ok(),
            LinkAttribute::AfSpecUnspec(families) => {
                for family in families {
                    match family {
                        AfSpecUnspec::Inet(inet) => {
                            for a in inet {
                                if let AfSpecInet::DevConf(conf) = a {
                                    link.forwarding = conf.forwarding != 0;
                                }
                            }
                        }
                        AfSpecUnspec::Inet6(inet6) => {
                            link.ipv6_disabled |= inet6.iter().any(|a| {
                                matches!(a, AfSpecInet6::AddrGenMode(In6AddrGenMode::None))
                            });
                        }
                        _ => {}
                    }
                }
            }
            LinkAttribute::LinkInfo(infos) => {
                for info in infos {
                    match info {
                        LinkInfo::Kind(k) => link.kind = Some(k.to_string()),
                        LinkInfo::PortData(InfoPortData::BridgePort(port)) => {
                            link.isolated = Some(
                                port.iter()
                                    .any(|p| matches!(p, InfoBridgePort::Isolated(true))),
                            );
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    link
}

/// Read only: whether IPv6 exists here at all, and links an older runtime turned IPv6 off on.
const IPV6_CONF: &str = "/proc/sys/net/ipv6/conf";

fn ipv6_disabled(link: &str) -> bool {
    if !Path::new(IPV6_CONF).exists() {
        return true; // no IPv6 in this kernel/namespace at all
    }
    std::fs::read_to_string(Path::new(IPV6_CONF).join(link).join("disable_ipv6"))
        .is_ok_and(|v| v.trim() == "1")
}

async fn links(handle: &Handle) -> Result<Vec<Link>, NetworkError> {
    let msgs: Vec<LinkMessage> = handle
        .link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl("dump links"))?;
    Ok(msgs.iter().map(link_from).collect())
}

pub async fn observe(handle: &Handle) -> Result<Observed, NetworkError> {
    let mut links = links(handle).await?;
    let addrs: Vec<_> = handle
        .address()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl("dump addresses"))?;
    for a in addrs
        .iter()
        .filter(|a| a.header.family == AddressFamily::Inet)
    {
        let ip = a.attributes.iter().find_map(|x| match x {
            AddressAttribute::Local(IpAddr::V4(ip)) => Some(*ip),
            _ => None,
        });
        let link = links.iter_mut().find(|l| l.index == a.header.index);
        if let (Some(ip), Some(link)) = (ip, link)
            && let Ok(net) = ipnet::Ipv4Net::new(ip, a.header.prefix_len)
        {
            link.ipv4.push(net);
        }
    }
    for l in &mut links {
        // No address generation (what this runtime sets), or disable_ipv6 (what it used to).
        l.ipv6_disabled = l.ipv6_disabled || ipv6_disabled(&l.name);
    }
    let routes: Vec<_> = handle
        .route()
        .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
        .execute()
        .try_collect()
        .await
        .map_err(nl("dump routes"))?;
    let main = |r: &&RouteMessage| {
        r.attributes
            .iter()
            .find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            })
            .unwrap_or(u32::from(r.header.table))
            == u32::from(RouteHeader::RT_TABLE_MAIN)
    };
    let oif = |r: &RouteMessage| {
        r.attributes.iter().find_map(|a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        })
    };
    let name_of = |i: u32| links.iter().find(|l| l.index == i).map(|l| l.name.clone());
    let default_route_interface = routes
        .iter()
        .filter(main)
        .filter(|r| r.header.destination_prefix_length == 0)
        .find_map(oif)
        .and_then(name_of);
    let other_routes = routes
        .iter()
        .filter(main)
        .filter(|r| r.header.destination_prefix_length > 0)
        .filter_map(|r| {
            let destination = r.attributes.iter().find_map(|a| match a {
                RouteAttribute::Destination(RouteAddress::Inet(ip)) => Some(*ip),
                _ => None,
            })?;
            Some(Route {
                destination: ipnet::Ipv4Net::new(destination, r.header.destination_prefix_length)
                    .ok()?,
                interface: oif(r).and_then(name_of),
            })
        })
        .collect();
    Ok(Observed {
        links,
        default_route_interface,
        routes: other_routes,
        nft: nft::observe().await?,
    })
}

/// Whether any bridge named like Imp's exists (one link dump, no nft).
pub async fn has_bridges(handle: &Handle) -> Result<bool, NetworkError> {
    Ok(links(handle).await?.iter().any(Link::is_imp_bridge))
}

async fn index_of(handle: &Handle, name: &str) -> Result<u32, NetworkError> {
    handle
        .link()
        .get()
        .match_name(name.to_owned())
        .execute()
        .try_next()
        .await
        .map_err(nl(format!("look up {name}")))?
        .map(|l| l.header.index)
        .ok_or_else(|| NetworkError::Netlink {
            step: format!("look up {name}"),
            source: rtnetlink::Error::RequestFailed,
        })
}

pub async fn execute(handle: &Handle, action: &Action) -> Result<(), NetworkError> {
    tracing::debug!(?action, "network action");
    let link = handle.link();
    match action {
        Action::CreateTap { tap } => crate::tap::create(tap)?,
        Action::CreateBridge { bridge, mac } => link
            .add(LinkBridge::new(bridge).address(mac.to_vec()).build())
            .execute()
            .await
            .map_err(nl(format!("create bridge {bridge}")))?,
        Action::SetMac { link: name, mac } => link
            .set(
                LinkUnspec::new_with_name(name)
                    .address(mac.to_vec())
                    .build(),
            )
            .execute()
            .await
            .map_err(nl(format!("set MAC of {name}")))?,
        // Address generation off before the link comes up: no link-local address, so the node
        // sends no router or neighbour solicitation, MLD report or anything else over IPv6 on it
        // (`disable_ipv6` would need a writable /proc/sys); guests' IPv6 is dropped by the bridge
        // table's "IPv4 and ARP only" rule.
        Action::DisableIpv6 { link: name } => {
            if Path::new(IPV6_CONF).exists() {
                link.set(
                    LinkUnspec::new_with_name(name)
                        .append_extra_attribute(LinkAttribute::AfSpecUnspec(vec![
                            AfSpecUnspec::Inet6(vec![AfSpecInet6::AddrGenMode(
                                In6AddrGenMode::None,
                            )]),
                        ]))
                        .build(),
                )
                .execute()
                .await
                .map_err(nl(format!("turn IPv6 address generation off on {name}")))?
            }
        }
        Action::AddAddress { link: name, addr } => {
            let index = index_of(handle, name).await?;
            handle
                .address()
                .add(index, IpAddr::V4(addr.addr()), addr.prefix_len())
                .replace()
                .execute()
                .await
                .map_err(nl(format!("add {addr} to {name}")))?
        }
        Action::DelAddress { link: name, addr } => {
            let index = index_of(handle, name).await?;
            let found: Vec<_> = handle
                .address()
                .get()
                .set_link_index_filter(index)
                .set_address_filter(IpAddr::V4(addr.addr()))
                .execute()
                .try_collect()
                .await
                .map_err(nl(format!("find {addr} on {name}")))?;
            for msg in found {
                handle
                    .address()
                    .del(msg)
                    .execute()
                    .await
                    .map_err(nl(format!("delete {addr} from {name}")))?;
            }
        }
        Action::LinkUp { link: name } => link
            .set(LinkUnspec::new_with_name(name).up().build())
            .execute()
            .await
            .map_err(nl(format!("set {name} up")))?,
        Action::Attach { tap, bridge } => {
            let br = index_of(handle, bridge).await?;
            link.set(LinkUnspec::new_with_name(tap).controller(br).build())
                .execute()
                .await
                .map_err(nl(format!("attach {tap} to {bridge}")))?
        }
        Action::Detach { tap } => link
            .set(LinkUnspec::new_with_name(tap).nocontroller().build())
            .execute()
            .await
            .map_err(nl(format!("detach {tap}")))?,
        Action::Isolate { tap } => {
            let index = index_of(handle, tap).await?;
            link.set_port(LinkBridgePort::new(index).isolated(true).build())
                .execute()
                .await
                .map_err(nl(format!("isolate port {tap}")))?
        }
        // `net.ipv4.conf.<link>.forwarding`: the kernel forwards what a link receives when that
        // link's flag is on (the global `ip_forward` only sets every link's at once).
        Action::EnableForwarding { link: name } => {
            let mut conf = InetDevConf::default();
            conf.forwarding = 1;
            link.set(
                LinkUnspec::new_with_name(name)
                    .append_extra_attribute(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(
                        vec![AfSpecInet::DevConfRequest(conf)],
                    )]))
                    .build(),
            )
            .execute()
            .await
            .map_err(nl(format!("turn IPv4 forwarding on for {name}")))?
        }
        Action::ReplaceNft { rules } => {
            nft::apply(&nft::replace_batch(rules), "replace Imp's tables").await?
        }
        Action::DeleteNft => nft::apply(&nft::delete_batch(), "delete Imp's tables").await?,
        Action::DeleteBridge { bridge } => {
            // Already gone is the goal of the action.
            if let Ok(index) = index_of(handle, bridge).await {
                link.del(index)
                    .execute()
                    .await
                    .map_err(nl(format!("delete bridge {bridge}")))?
            }
        }
    }
    Ok(())
}
