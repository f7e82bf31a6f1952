//! The guest's network interface from `imp.net` (Debian's cloud kernel has no `CONFIG_IP_PNP`,
//! so the kernel's `ip=` does nothing there): IPv6 off, MTU, link up, the address, the default
//! route via the gateway, all through rtnetlink. Every step replaces rather than adds, so
//! re-running it (a test, a retried stage) converges instead of failing on EEXIST.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use futures::TryStreamExt;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::LinkAttribute;
use rtnetlink::packet_route::neighbour::NeighbourState;
use rtnetlink::{LinkUnspec, RouteMessageBuilder};

use super::cmdline::NetConfig;

/// The interface the kernel names the first virtio-net device (no udev renames it in the guest).
pub const GUEST_INTERFACE: &str = "eth0";

/// How long to wait for the interface: virtio-net may be a module loaded moments before.
pub const LINK_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("open a netlink socket: {0}")]
    Socket(std::io::Error),
    #[error("interface {0} did not appear within {1:?} (is the virtio-net driver loaded?)")]
    NoInterface(String, Duration),
    #[error("write {path}: {source}")]
    Sysctl {
        path: String,
        source: std::io::Error,
    },
    #[error("{step} on {interface}: {source}")]
    Netlink {
        step: &'static str,
        interface: String,
        source: rtnetlink::Error,
    },
}

/// Wait up to `wait` for `interface`, then configure it as `net` says.
pub async fn configure(interface: &str, net: &NetConfig, wait: Duration) -> Result<(), NetError> {
    let (connection, handle, _) = rtnetlink::new_connection().map_err(NetError::Socket)?;
    let conn = tokio::spawn(connection);
    let result = apply(&handle, interface, net, wait).await;
    conn.abort();
    result
}

async fn apply(
    handle: &rtnetlink::Handle,
    interface: &str,
    net: &NetConfig,
    wait: Duration,
) -> Result<(), NetError> {
    let index = wait_for_link(handle, interface, wait).await?;
    disable_ipv6(interface)?;
    let mut link = LinkUnspec::new_with_index(index).up();
    if let Some(mtu) = net.mtu {
        link = link.mtu(mtu);
    }
    handle
        .link()
        .set(link.build())
        .execute()
        .await
        .map_err(netlink("set MTU and link up", interface))?;
    handle
        .address()
        .add(index, IpAddr::V4(net.address), net.prefix)
        .replace()
        .execute()
        .await
        .map_err(netlink("add address", interface))?;
    let route = RouteMessageBuilder::<Ipv4Addr>::new()
        .destination_prefix(Ipv4Addr::UNSPECIFIED, 0)
        .output_interface(index)
        .gateway(net.gateway)
        .build();
    handle
        .route()
        .add(route)
        .replace()
        .execute()
        .await
        .map_err(netlink("add default route", interface))
}

/// A netlink step's error on `interface`, for `map_err`.
fn netlink<'a>(
    step: &'static str,
    interface: &'a str,
) -> impl FnOnce(rtnetlink::Error) -> NetError + 'a {
    move |source| NetError::Netlink {
        step,
        interface: interface.to_owned(),
        source,
    }
}

/// What [`reconfigure`] left on the interface, read back after applying.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconfigured {
    pub mac: [u8; 6],
    /// Every IPv4 address on the interface with its prefix.
    pub addresses: Vec<(Ipv4Addr, u8)>,
    /// Learnt neighbour entries the interface had before (the snapshot's); none are left.
    pub neighbours_flushed: u32,
}

/// A clone's new network identity (`Reidentify`): the MAC (link down, address, up: a live
/// change is not offered by every driver), every other IPv4 address removed, then what
/// [`configure`] does (MTU, address, default route; bringing the link down dropped the
/// routes), and the neighbour cache of the interface flushed (the snapshot's entries point at
/// whatever the snapshot's network had). The kernel drops every entry of the interface,
/// permanent ones included, when its MAC changes or it goes down; what is left after is
/// removed here too. The gratuitous ARP is the caller's ([`crate::agent::identity`]).
pub async fn reconfigure(
    interface: &str,
    mac: [u8; 6],
    net: &NetConfig,
    wait: Duration,
) -> Result<Reconfigured, NetError> {
    let (connection, handle, _) = rtnetlink::new_connection().map_err(NetError::Socket)?;
    let conn = tokio::spawn(connection);
    let result = reconfigure_with(&handle, interface, mac, net, wait).await;
    conn.abort();
    result
}

async fn reconfigure_with(
    handle: &rtnetlink::Handle,
    interface: &str,
    mac: [u8; 6],
    net: &NetConfig,
    wait: Duration,
) -> Result<Reconfigured, NetError> {
    let index = wait_for_link(handle, interface, wait).await?;
    // Taking the link down drops the learnt entries by itself; count them first, and remove
    // whatever is left afterwards (a driver might keep them).
    let learnt = learnt_neighbours(handle, index)
        .await
        .map_err(netlink("list neighbours", interface))?
        .len() as u32;
    handle
        .link()
        .set(LinkUnspec::new_with_index(index).down().build())
        .execute()
        .await
        .map_err(netlink("set link down", interface))?;
    handle
        .link()
        .set(
            LinkUnspec::new_with_index(index)
                .address(mac.to_vec())
                .build(),
        )
        .execute()
        .await
        .map_err(netlink("set MAC", interface))?;
    // Old addresses go first: removing a subnet's primary address removes its secondaries,
    // and a new address in the old one's subnet would be one.
    let wanted = (net.address, net.prefix);
    for (msg, addr) in ipv4_addresses(handle, index)
        .await
        .map_err(netlink("list addresses", interface))?
    {
        if addr != wanted {
            handle
                .address()
                .del(msg)
                .execute()
                .await
                .map_err(netlink("remove an old address", interface))?;
        }
    }
    apply(handle, interface, net, wait).await?;
    let left = learnt_neighbours(handle, index)
        .await
        .map_err(netlink("list neighbours", interface))?;
    for n in left {
        match handle.neighbours().del(n).execute().await {
            // Gone by itself (garbage-collected) between the dump and the delete.
            Ok(()) => {}
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENOENT => {}
            Err(e) => return Err(netlink("flush neighbours", interface)(e)),
        }
    }
    let link = handle
        .link()
        .get()
        .match_index(index)
        .execute()
        .try_next()
        .await
        .map_err(netlink("read back the link", interface))?;
    let mac = link
        .and_then(|l| {
            l.attributes.into_iter().find_map(|a| match a {
                LinkAttribute::Address(a) => <[u8; 6]>::try_from(a).ok(),
                _ => None,
            })
        })
        .unwrap_or_default();
    let addresses = ipv4_addresses(handle, index)
        .await
        .map_err(netlink("read back addresses", interface))?
        .into_iter()
        .map(|(_, a)| a)
        .collect();
    Ok(Reconfigured {
        mac,
        addresses,
        neighbours_flushed: learnt,
    })
}

/// The interface's learnt IPv4 neighbour entries.
async fn learnt_neighbours(
    handle: &rtnetlink::Handle,
    index: u32,
) -> Result<Vec<rtnetlink::packet_route::neighbour::NeighbourMessage>, rtnetlink::Error> {
    let mut out = Vec::new();
    let mut dump = handle
        .neighbours()
        .get()
        .set_address_family(AddressFamily::Inet)
        .execute();
    while let Some(n) = dump.try_next().await? {
        if n.header.ifindex == index && flushable(n.header.state) {
            out.push(n);
        }
    }
    Ok(out)
}

/// Whether a neighbour entry is cache (learnt, flushed on a new identity) rather than
/// configuration.
pub fn flushable(state: NeighbourState) -> bool {
    !matches!(state, NeighbourState::Permanent | NeighbourState::Noarp)
}

async fn ipv4_addresses(
    handle: &rtnetlink::Handle,
    index: u32,
) -> Result<
    Vec<(
        rtnetlink::packet_route::address::AddressMessage,
        (Ipv4Addr, u8),
    )>,
    rtnetlink::Error,
> {
    let mut out = Vec::new();
    let mut stream = handle
        .address()
        .get()
        .set_link_index_filter(index)
        .execute();
    while let Some(msg) = stream.try_next().await? {
        if msg.header.family != AddressFamily::Inet {
            continue;
        }
        let local = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(IpAddr::V4(ip)) | AddressAttribute::Address(IpAddr::V4(ip)) => {
                Some(*ip)
            }
            _ => None,
        });
        if let Some(ip) = local {
            let prefix = msg.header.prefix_len;
            out.push((msg, (ip, prefix)));
        }
    }
    Ok(out)
}

/// Imp's networks are IPv4 only (the node drops a guest's IPv6 frames, docs/network.md). With
/// IPv6 on, the link's router solicitations and MLD reports would still cross the TAP every few
/// seconds after link-up (backing off to hourly), and move the byte counters ScaleToZero's idle
/// detection watches. Off before the link comes up, so not even the first one is sent. Loopback
/// keeps `::1`. A kernel without IPv6 has no such file: nothing to do.
fn disable_ipv6(interface: &str) -> Result<(), NetError> {
    let path = format!("/proc/sys/net/ipv6/conf/{interface}/disable_ipv6");
    match std::fs::write(&path, b"1") {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(NetError::Sysctl { path, source: e })
        }
        _ => Ok(()),
    }
}

async fn wait_for_link(
    handle: &rtnetlink::Handle,
    interface: &str,
    limit: Duration,
) -> Result<u32, NetError> {
    let start = tokio::time::Instant::now();
    loop {
        let found = handle
            .link()
            .get()
            .match_name(interface.to_owned())
            .execute()
            .try_next()
            .await;
        match found {
            Ok(Some(link)) => return Ok(link.header.index),
            // ENODEV for a name that does not exist (yet): keep waiting.
            Ok(None) | Err(rtnetlink::Error::NetlinkError(_)) => {}
            Err(source) => {
                return Err(NetError::Netlink {
                    step: "look up",
                    interface: interface.to_owned(),
                    source,
                });
            }
        }
        if start.elapsed() >= limit {
            return Err(NetError::NoInterface(interface.to_owned(), limit));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_learnt_neighbours_are_flushed() {
        for s in [
            NeighbourState::Reachable,
            NeighbourState::Stale,
            NeighbourState::Delay,
            NeighbourState::Probe,
            NeighbourState::Failed,
            NeighbourState::Incomplete,
        ] {
            assert!(flushable(s), "{s:?}");
        }
        assert!(!flushable(NeighbourState::Permanent));
        assert!(!flushable(NeighbourState::Noarp));
    }
}
