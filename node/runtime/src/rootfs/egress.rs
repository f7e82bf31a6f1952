//! Where an image pull may connect.
//!
//! An image reference names any host a namespace user likes, and imp-runtime pulls from the
//! node's network: without a check, a pool's `image` could make the node fetch from its own
//! loopback services or the cloud's metadata address (blind SSRF). A check of the reference's
//! host before the pull would miss DNS rebinding, the registry's blob redirects and the token
//! realm it names, all of which oci-client follows on its own. So every connection of a pull
//! goes through a proxy that lives for that pull only, on loopback: it resolves the target
//! itself, refuses the node's own, loopback, link-local, unspecified and multicast addresses
//! unless the target is a registry the admin allowed on the node, and connects to the very
//! address it checked.
//!
//! The decision (`refused_class`, `allowed_target`) is pure; `PullProxy` is the I/O.

use std::{
    net::{IpAddr, SocketAddr},
    str::FromStr,
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::{counter::Counter, family::Family};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    task::JoinSet,
};

/// Why an address is not for pulls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
pub enum AddressClass {
    Loopback,
    LinkLocal,
    Unspecified,
    Multicast,
    /// An address of one of the node's own interfaces (its uplink, Imp's bridges, others).
    NodeAddress,
}

impl AddressClass {
    pub fn as_str(self) -> &'static str {
        match self {
            AddressClass::Loopback => "loopback",
            AddressClass::LinkLocal => "link-local",
            AddressClass::Unspecified => "unspecified",
            AddressClass::Multicast => "multicast or broadcast",
            AddressClass::NodeAddress => "one of the node's own addresses",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AddressClassLabel {
    pub class: AddressClass,
}

/// A connection the proxy refused: the first one of a pull is what the pull reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `host:port` as the client asked for it (the reference's registry, a redirect, a realm).
    pub target: String,
    pub address: IpAddr,
    pub class: AddressClass,
}

/// The class that forbids `ip` for pulls, or None when it may be reached. `node` holds the
/// addresses of the node's interfaces at the time of the connection.
pub fn refused_class(ip: IpAddr, node: &[IpAddr]) -> Option<AddressClass> {
    // `::ffff:127.0.0.1` is 127.0.0.1 on the wire.
    let ip = ip.to_canonical();
    let class = match ip {
        IpAddr::V4(v4) if v4.is_loopback() => AddressClass::Loopback,
        IpAddr::V4(v4) if v4.is_link_local() => AddressClass::LinkLocal,
        // 0.0.0.0/8 is "this host on this network": connecting to it reaches the node.
        IpAddr::V4(v4) if v4.octets()[0] == 0 => AddressClass::Unspecified,
        IpAddr::V4(v4) if v4.is_multicast() || v4.is_broadcast() => AddressClass::Multicast,
        IpAddr::V6(v6) if v6.is_loopback() => AddressClass::Loopback,
        IpAddr::V6(v6) if v6.is_unicast_link_local() => AddressClass::LinkLocal,
        IpAddr::V6(v6) if v6.is_unspecified() => AddressClass::Unspecified,
        IpAddr::V6(v6) if v6.is_multicast() => AddressClass::Multicast,
        ip if node.iter().any(|n| n.to_canonical() == ip) => AddressClass::NodeAddress,
        _ => return None,
    };
    Some(class)
}

/// Whether `host:port` is a registry the admin allowed to live on the node's own or link-local
/// addresses. An entry `host:port` allows that port only, an entry `host` every port of it.
/// Names compare case-insensitively; IPv6 literals are written in brackets (`[::1]:5000`).
pub fn allowed_target(allowed: &[String], host: &str, port: u16) -> bool {
    allowed.iter().any(|entry| {
        let (entry_host, entry_port) = split_host_port(entry);
        entry_host.eq_ignore_ascii_case(host) && entry_port.is_none_or(|p| p == port)
    })
}

/// `host[:port]`, `[v6]` or `[v6]:port` -> (host without brackets, port).
fn split_host_port(entry: &str) -> (&str, Option<u16>) {
    if let Some(rest) = entry.strip_prefix('[')
        && let Some((host, after)) = rest.split_once(']')
    {
        return (host, after.strip_prefix(':').and_then(|p| p.parse().ok()));
    }
    match entry.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => match port.parse() {
            Ok(port) => (host, Some(port)),
            Err(_) => (entry, None),
        },
        _ => (entry, None),
    }
}

/// The addresses of the node's interfaces (in imp-runtime's network namespace, which in the
/// chart is the node's).
fn node_addresses() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        // Without the list, the other classes still hold; say so once per connection.
        tracing::warn!("cannot list the node's addresses; pulls are checked without them");
        return Vec::new();
    };
    addrs
        .filter_map(|a| a.address)
        .filter_map(|sa| {
            if let Some(v4) = sa.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                sa.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect()
}

/// The request head: the most a proxy request's line and headers may take.
const MAX_HEAD: usize = 64 << 10;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// Headers about the hop to the proxy, not for the registry.
const HOP_HEADERS: [&str; 4] = [
    "connection",
    "proxy-connection",
    "proxy-authorization",
    "keep-alive",
];

/// One pull's proxy: `http://127.0.0.1:PORT`, handed to oci-client (and the manifest HEAD) as
/// the proxy for both schemes. Dropping it stops the listener and every connection through it.
pub(crate) struct PullProxy {
    url: String,
    refusal: Arc<Mutex<Option<Refusal>>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct Policy {
    allowed: Arc<Vec<String>>,
    refusal: Arc<Mutex<Option<Refusal>>>,
    refusals: Option<Family<AddressClassLabel, Counter>>,
}

impl PullProxy {
    pub(crate) async fn start(
        allowed: Arc<Vec<String>>,
        refusals: Option<Family<AddressClassLabel, Counter>>,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let refusal = Arc::new(Mutex::new(None));
        let policy = Policy {
            allowed,
            refusal: refusal.clone(),
            refusals,
        };
        let task = tokio::spawn(async move {
            // Owned here so aborting the accept loop drops (aborts) every open connection.
            let mut conns = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => {
                            let policy = policy.clone();
                            conns.spawn(async move { policy.serve(stream).await });
                        }
                        Err(e) => tracing::debug!(error = %e, "pull proxy accept failed"),
                    },
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                }
            }
        });
        Ok(Self { url, refusal, task })
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The first connection this pull's proxy refused, if any.
    pub(crate) fn refusal(&self) -> Option<Refusal> {
        self.refusal.lock().expect("refusal lock").clone()
    }
}

impl Drop for PullProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the client asked the proxy for.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    /// `CONNECT host:port`: a tunnel (HTTPS registries).
    Tunnel { host: String, port: u16 },
    /// `GET http://host:port/path`: forwarded in origin form (plain-HTTP registries).
    Forward {
        host: String,
        port: u16,
        /// The head to send upstream, with `Connection: close` so one connection carries one
        /// request (a reused connection could otherwise name a second, unchecked host).
        head: Vec<u8>,
    },
}

#[derive(Debug, PartialEq, Eq)]
enum HeadError {
    Incomplete,
    Malformed(&'static str),
}

/// Parse a proxy request head (everything up to and including the blank line).
fn parse_head(buf: &[u8]) -> Result<(Request, usize), HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Err(HeadError::Incomplete),
        Err(_) => return Err(HeadError::Malformed("not an HTTP request")),
    };
    let method = req.method.ok_or(HeadError::Malformed("no method"))?;
    let target = req.path.ok_or(HeadError::Malformed("no target"))?;
    if method.eq_ignore_ascii_case("CONNECT") {
        let authority = http::uri::Authority::from_str(target)
            .map_err(|_| HeadError::Malformed("CONNECT target is not host:port"))?;
        let port = authority
            .port_u16()
            .ok_or(HeadError::Malformed("CONNECT target has no port"))?;
        let host = unbracket(authority.host()).to_owned();
        return Ok((Request::Tunnel { host, port }, len));
    }
    let uri =
        http::Uri::from_str(target).map_err(|_| HeadError::Malformed("target is not a URI"))?;
    if uri.scheme_str() != Some("http") {
        return Err(HeadError::Malformed("only http:// targets are forwarded"));
    }
    let host = unbracket(
        uri.host()
            .ok_or(HeadError::Malformed("target has no host"))?,
    )
    .to_owned();
    let port = uri.port_u16().unwrap_or(80);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut head = format!("{method} {path} HTTP/1.1\r\n").into_bytes();
    for h in req.headers.iter() {
        if HOP_HEADERS
            .iter()
            .any(|hop| h.name.eq_ignore_ascii_case(hop))
        {
            continue;
        }
        head.extend_from_slice(h.name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(h.value);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok((Request::Forward { host, port, head }, len))
}

fn unbracket(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

const FORBIDDEN: &[u8] =
    b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
const BAD_GATEWAY: &[u8] =
    b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
const BAD_REQUEST: &[u8] =
    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

impl Policy {
    async fn serve(self, mut client: TcpStream) {
        let mut buf = Vec::with_capacity(4096);
        let (request, len) = loop {
            let mut chunk = [0u8; 4096];
            let n = match client.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            buf.extend_from_slice(&chunk[..n]);
            match parse_head(&buf) {
                Ok(parsed) => break parsed,
                Err(HeadError::Incomplete) if buf.len() < MAX_HEAD => continue,
                Err(HeadError::Incomplete) => {
                    let _ = client.write_all(BAD_REQUEST).await;
                    return;
                }
                Err(HeadError::Malformed(why)) => {
                    tracing::debug!(why, "pull proxy refused a malformed request");
                    let _ = client.write_all(BAD_REQUEST).await;
                    return;
                }
            }
        };
        let (host, port) = match &request {
            Request::Tunnel { host, port } | Request::Forward { host, port, .. } => {
                (host.clone(), *port)
            }
        };
        let mut upstream = match self.connect(&host, port).await {
            Ok(upstream) => upstream,
            Err(answer) => {
                let _ = client.write_all(answer).await;
                return;
            }
        };
        let opened = match &request {
            Request::Tunnel { .. } => {
                client
                    .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    .await
            }
            Request::Forward { head, .. } => upstream.write_all(head).await,
        };
        // Bytes read past the head (a TLS ClientHello, a request body) go upstream first.
        let ready = match opened {
            Ok(()) => upstream.write_all(&buf[len..]).await,
            Err(e) => Err(e),
        };
        if ready.is_ok() {
            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        }
    }

    /// Resolve `host`, keep the addresses a pull may reach, connect to the first that answers.
    /// Err is the answer for the client.
    async fn connect(&self, host: &str, port: u16) -> Result<TcpStream, &'static [u8]> {
        let candidates: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => match tokio::net::lookup_host((host, port)).await {
                Ok(addrs) => addrs.collect(),
                Err(e) => {
                    tracing::debug!(host, error = %e, "pull proxy could not resolve");
                    return Err(BAD_GATEWAY);
                }
            },
        };
        let allowed = allowed_target(&self.allowed, host, port);
        let node = if allowed {
            Vec::new()
        } else {
            node_addresses()
        };
        let mut first_refusal = None;
        let mut reachable = Vec::new();
        for addr in candidates {
            match (allowed, refused_class(addr.ip(), &node)) {
                (false, Some(class)) => {
                    first_refusal.get_or_insert((addr.ip(), class));
                }
                _ => reachable.push(addr),
            }
        }
        if reachable.is_empty() {
            if let Some((address, class)) = first_refusal {
                self.refuse(host, port, address, class);
                return Err(FORBIDDEN);
            }
            return Err(BAD_GATEWAY);
        }
        for addr in reachable {
            match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
                Ok(Ok(stream)) => return Ok(stream),
                Ok(Err(e)) => tracing::debug!(%addr, error = %e, "pull proxy connect failed"),
                Err(_) => tracing::debug!(%addr, "pull proxy connect timed out"),
            }
        }
        Err(BAD_GATEWAY)
    }

    fn refuse(&self, host: &str, port: u16, address: IpAddr, class: AddressClass) {
        // The host may come from a registry's redirect: remote text, so bounded.
        let host: String = host.chars().take(253).collect();
        let target = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        tracing::warn!(%target, %address, class = class.as_str(), "image pull connection refused");
        if let Some(refusals) = &self.refusals {
            refusals.get_or_create(&AddressClassLabel { class }).inc();
        }
        self.refusal
            .lock()
            .expect("refusal lock")
            .get_or_insert(Refusal {
                target,
                address,
                class,
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn node_local_and_special_addresses_are_refused() {
        let node = [ip("192.0.2.10"), ip("2001:db8::10")];
        let cases = [
            ("127.0.0.1", Some(AddressClass::Loopback)),
            ("127.8.9.1", Some(AddressClass::Loopback)),
            ("::1", Some(AddressClass::Loopback)),
            ("::ffff:127.0.0.1", Some(AddressClass::Loopback)),
            ("169.254.169.254", Some(AddressClass::LinkLocal)),
            ("fe80::1", Some(AddressClass::LinkLocal)),
            ("0.0.0.0", Some(AddressClass::Unspecified)),
            ("0.1.2.3", Some(AddressClass::Unspecified)),
            ("::", Some(AddressClass::Unspecified)),
            ("224.0.0.1", Some(AddressClass::Multicast)),
            ("255.255.255.255", Some(AddressClass::Multicast)),
            ("ff02::1", Some(AddressClass::Multicast)),
            ("192.0.2.10", Some(AddressClass::NodeAddress)),
            ("::ffff:192.0.2.10", Some(AddressClass::NodeAddress)),
            ("2001:db8::10", Some(AddressClass::NodeAddress)),
            // A neighbour on the node's network, a private mirror, the internet: reachable.
            ("192.0.2.11", None),
            ("10.1.2.3", None),
            ("198.51.100.7", None),
            ("2001:db8::11", None),
        ];
        for (addr, want) in cases {
            assert_eq!(refused_class(ip(addr), &node), want, "{addr}");
        }
    }

    #[test]
    fn allow_list_matches_host_and_port() {
        let allowed = vec![
            "127.0.0.1:5000".to_owned(),
            "Mirror.Local".to_owned(),
            "[::1]:5001".to_owned(),
        ];
        assert!(allowed_target(&allowed, "127.0.0.1", 5000));
        assert!(!allowed_target(&allowed, "127.0.0.1", 5001), "other port");
        assert!(!allowed_target(&allowed, "127.0.0.2", 5000), "other host");
        assert!(allowed_target(&allowed, "mirror.local", 443), "any port");
        assert!(allowed_target(&allowed, "MIRROR.local", 80));
        assert!(!allowed_target(&allowed, "mirror.local.evil", 443));
        assert!(allowed_target(&allowed, "::1", 5001));
        assert!(!allowed_target(&allowed, "::1", 5000));
        assert!(!allowed_target(&[], "127.0.0.1", 5000));
    }

    #[test]
    fn connect_heads_name_a_tunnel() {
        let head =
            b"CONNECT registry.example:443 HTTP/1.1\r\nHost: registry.example:443\r\n\r\n\x16\x03";
        let (req, len) = parse_head(head).unwrap();
        assert_eq!(
            req,
            Request::Tunnel {
                host: "registry.example".into(),
                port: 443
            }
        );
        assert_eq!(
            &head[len..],
            b"\x16\x03",
            "bytes after the head stay for the tunnel"
        );
        let (req, _) = parse_head(b"CONNECT [::1]:5000 HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(
            req,
            Request::Tunnel {
                host: "::1".into(),
                port: 5000
            }
        );
        assert_eq!(
            parse_head(b"CONNECT registry.example HTTP/1.1\r\n\r\n").unwrap_err(),
            HeadError::Malformed("CONNECT target has no port")
        );
    }

    #[test]
    fn forwarded_heads_go_upstream_in_origin_form_one_request_per_connection() {
        let head = b"GET http://127.0.0.1:5000/v2/x/manifests/latest?n=1 HTTP/1.1\r\n\
host: 127.0.0.1:5000\r\nAccept: a/b\r\nConnection: keep-alive\r\nProxy-Authorization: Basic eA==\r\n\r\n";
        let (req, len) = parse_head(head).unwrap();
        assert_eq!(len, head.len());
        let Request::Forward { host, port, head } = req else {
            panic!("not a forward: {req:?}");
        };
        assert_eq!((host.as_str(), port), ("127.0.0.1", 5000));
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "GET /v2/x/manifests/latest?n=1 HTTP/1.1\r\nhost: 127.0.0.1:5000\r\nAccept: a/b\r\n\
Connection: close\r\n\r\n"
        );
        let (req, _) = parse_head(b"GET http://r.example/v2/ HTTP/1.1\r\n\r\n").unwrap();
        assert!(matches!(req, Request::Forward { port: 80, .. }));
    }

    #[test]
    fn other_heads_are_refused_or_awaited() {
        assert_eq!(
            parse_head(b"GET /v2/ HTTP/1.1\r\n\r\n").unwrap_err(),
            HeadError::Malformed("only http:// targets are forwarded"),
        );
        assert_eq!(
            parse_head(b"GET https://r.example/v2/ HTTP/1.1\r\n\r\n").unwrap_err(),
            HeadError::Malformed("only http:// targets are forwarded"),
        );
        assert_eq!(
            parse_head(b"GET http://r.example/v2/ HTTP/1.1\r\nHost: r").unwrap_err(),
            HeadError::Incomplete
        );
        assert!(matches!(
            parse_head(b"\x00\x01garbage\r\n\r\n").unwrap_err(),
            HeadError::Malformed(_)
        ));
    }
}
