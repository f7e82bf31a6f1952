//! The guest's network interface from `imp.net` (Debian's cloud kernel has no `CONFIG_IP_PNP`,
//! so the kernel's `ip=` does nothing there): IPv6 off, MTU, link up, the address, the default
//! route via the gateway, all through rtnetlink. Every step replaces rather than adds, so
//! re-running it (a test, a retried stage) converges instead of failing on EEXIST.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use futures::TryStreamExt;
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
    let err = |step| {
        move |source| NetError::Netlink {
            step,
            interface: interface.to_owned(),
            source,
        }
    };
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
        .map_err(err("set MTU and link up"))?;
    handle
        .address()
        .add(index, IpAddr::V4(net.address), net.prefix)
        .replace()
        .execute()
        .await
        .map_err(err("add address"))?;
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
        .map_err(err("add default route"))
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
