//! `Reidentify`: a guest restored from a memory snapshot takes an identity of its own before any
//! secret reaches it (docs/guest-protocol.md, "Identity").
//!
//! Every clone of one snapshot wakes with the snapshot's kernel random state, hostname,
//! machine-id, MAC, address, neighbour cache and wall clock. The policy: the host sends all of
//! them in one message; the guest refuses it once it has received any `Exec` (an Exec carries
//! the runner's JIT config); it applies the parts in a fixed order (entropy first, so a
//! machine-id the guest makes comes from the reseeded generator) and answers only after the
//! last one, with evidence read back from the system; a part that fails ends the request with
//! an error naming it, and the host fails the clone.
//!
//! The pure half ([`plan`], [`clock_action`], the byte layouts) is tested here; [`apply`] is the
//! I/O, tested through the agent in guest/tests/reidentify.rs (network namespaces) and
//! guest/tests/qemu.rs (a real guest: the entropy ioctls and the clock).

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;

use crate::pid1::cmdline::{NetConfig, valid_hostname};
use crate::pid1::{net, system};
use crate::protocol::{
    CLOCK_STEP_THRESHOLD_NS, Identified, NetEvidence, NetIdentity, REIDENTIFY_ENTROPY_MAX,
    REIDENTIFY_ENTROPY_MIN, Reidentify,
};

/// Bytes of `getrandom(2)` the evidence carries.
pub const SAMPLE_BYTES: usize = 32;

/// resolv.conf holds at most this many nameservers (glibc's MAXNS) and search domains.
const MAX_DNS: usize = 3;
const MAX_DNS_SEARCH: usize = 6;

/// A guest that does not own its clock accepts a host time this far from its own (the same
/// clock, seen across a Unix socket).
pub const UNMANAGED_CLOCK_TOLERANCE_NS: u64 = 1_000_000_000;

/// How long the network part waits for the interface (it exists long before a snapshot).
const LINK_WAIT: Duration = Duration::from_secs(2);

/// `_IOW('R', 0x03, int[2])` and `_IO('R', 0x07)` of linux/random.h.
const RNDADDENTROPY: u64 = 0x4008_5203;
const RNDRESEEDCRNG: u64 = 0x5207;

/// Where and how far this agent applies an identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityConfig {
    /// Root of the filesystem whose `etc/machine-id` and `etc/resolv.conf` are the guest's.
    pub root: PathBuf,
    /// The interface a network part applies to; `None`: a network part fails, naming it.
    pub interface: Option<String>,
    /// This agent owns the wall clock (PID 1 in a VM) and steps it; otherwise it only checks
    /// that the clock agrees with the host's ([`UNMANAGED_CLOCK_TOLERANCE_NS`]).
    pub set_clock: bool,
}

impl IdentityConfig {
    /// PID 1 in a VM: the whole machine.
    pub fn guest() -> Self {
        IdentityConfig {
            root: PathBuf::from("/"),
            interface: Some(net::GUEST_INTERFACE.to_owned()),
            set_clock: true,
        }
    }
}

/// A field of a `Reidentify` the guest refuses, before anything was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("reidentify: {field}: {reason}")]
pub struct InvalidField {
    pub field: &'static str,
    pub reason: String,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> InvalidField {
    InvalidField {
        field,
        reason: reason.into(),
    }
}

/// The parts, in the order they are applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// This agent was not started to manage an identity.
    Identity,
    Entropy,
    Clock,
    Hostname,
    MachineId,
    Network,
    Dns,
    /// Reading back what the answer reports.
    Evidence,
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Part::Identity => "identity",
            Part::Entropy => "entropy",
            Part::Clock => "clock",
            Part::Hostname => "hostname",
            Part::MachineId => "machine_id",
            Part::Network => "network",
            Part::Dns => "dns",
            Part::Evidence => "evidence",
        })
    }
}

/// A part that could not be applied; the parts before it were.
#[derive(Debug, thiserror::Error)]
#[error("reidentify: {part}: {reason}")]
pub struct PartFailed {
    pub part: Part,
    pub reason: String,
}

fn failed(part: Part) -> impl Fn(String) -> PartFailed {
    move |reason| PartFailed { part, reason }
}

/// A checked `Reidentify`: what [`apply`] does.
#[derive(Clone, PartialEq, Eq)]
pub struct Plan {
    pub entropy: Vec<u8>,
    pub hostname: String,
    /// `None`: made from the generator after the reseed.
    pub machine_id: Option<String>,
    pub host_clock_ns: u64,
    pub network: Option<NetPlan>,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("entropy", &format_args!("[{} bytes]", self.entropy.len()))
            .field("hostname", &self.hostname)
            .field("machine_id", &self.machine_id)
            .field("host_clock_ns", &self.host_clock_ns)
            .field("network", &self.network)
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetPlan {
    pub mac: [u8; 6],
    /// Address, prefix, gateway and MTU under the rules of `imp.net`.
    pub net: NetConfig,
    pub dns: Vec<IpAddr>,
    pub dns_search: Vec<String>,
}

/// Check every field of `req`; the first bad one is named.
pub fn plan(req: &Reidentify) -> Result<Plan, InvalidField> {
    let entropy = base64::engine::general_purpose::STANDARD
        .decode(&req.entropy_b64)
        .map_err(|_| invalid("entropy_b64", "not standard base64"))?;
    if !(REIDENTIFY_ENTROPY_MIN..=REIDENTIFY_ENTROPY_MAX).contains(&entropy.len()) {
        return Err(invalid(
            "entropy_b64",
            format!(
                "{} bytes; expected {REIDENTIFY_ENTROPY_MIN}..={REIDENTIFY_ENTROPY_MAX}",
                entropy.len()
            ),
        ));
    }
    if entropy.iter().all(|b| *b == entropy[0]) {
        return Err(invalid(
            "entropy_b64",
            "every byte is the same: not random bytes",
        ));
    }
    if !valid_hostname(&req.hostname) {
        return Err(invalid(
            "hostname",
            "not a valid hostname (1-64 of a-z, A-Z, 0-9, '-', '.')",
        ));
    }
    if let Some(id) = &req.machine_id {
        check_machine_id(id).map_err(|r| invalid("machine_id", r))?;
    }
    let floor = system::CLOCK_FLOOR_UNIX * 1_000_000_000;
    if req.wall_clock_unix_ns < floor {
        return Err(invalid(
            "wall_clock_unix_ns",
            format!(
                "{} is before {}: the host's clock is wrong",
                req.wall_clock_unix_ns,
                system::rfc3339(system::CLOCK_FLOOR_UNIX)
            ),
        ));
    }
    let network = req.network.as_ref().map(net_plan).transpose()?;
    Ok(Plan {
        entropy,
        hostname: req.hostname.clone(),
        machine_id: req.machine_id.clone(),
        host_clock_ns: req.wall_clock_unix_ns,
        network,
    })
}

fn net_plan(n: &NetIdentity) -> Result<NetPlan, InvalidField> {
    let mac = parse_mac(&n.mac).map_err(|r| invalid("network.mac", r))?;
    let address: Ipv4Addr = n
        .address
        .parse()
        .map_err(|_| invalid("network.address", "not an IPv4 address"))?;
    let gateway: Ipv4Addr = n
        .gateway
        .parse()
        .map_err(|_| invalid("network.gateway", "not an IPv4 address"))?;
    // The rest under exactly the rules of `imp.net` at boot.
    let mut spec = format!("{address}/{},{gateway}", n.prefix);
    if let Some(mtu) = n.mtu {
        spec.push_str(&format!(",{mtu}"));
    }
    let net = NetConfig::parse(&spec).map_err(|r| invalid("network", r))?;
    if n.dns.len() > MAX_DNS {
        return Err(invalid(
            "network.dns",
            format!(
                "{} nameservers; resolv.conf takes at most {MAX_DNS}",
                n.dns.len()
            ),
        ));
    }
    let dns = n
        .dns
        .iter()
        .map(|d| d.parse::<IpAddr>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| invalid("network.dns", "not a list of IP addresses"))?;
    if n.dns_search.len() > MAX_DNS_SEARCH || !n.dns_search.iter().all(|d| valid_hostname(d)) {
        return Err(invalid(
            "network.dns_search",
            format!("not a list of at most {MAX_DNS_SEARCH} domains"),
        ));
    }
    Ok(NetPlan {
        mac,
        net,
        dns,
        dns_search: n.dns_search.clone(),
    })
}

/// `aa:bb:cc:dd:ee:ff` (either case) as bytes; a unicast, non-zero address.
pub fn parse_mac(s: &str) -> Result<[u8; 6], &'static str> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for byte in &mut mac {
        let part = parts
            .next()
            .ok_or("expected six hex bytes aa:bb:cc:dd:ee:ff")?;
        if part.len() != 2 {
            return Err("expected six hex bytes aa:bb:cc:dd:ee:ff");
        }
        *byte =
            u8::from_str_radix(part, 16).map_err(|_| "expected six hex bytes aa:bb:cc:dd:ee:ff")?;
    }
    if parts.next().is_some() {
        return Err("expected six hex bytes aa:bb:cc:dd:ee:ff");
    }
    if mac[0] & 1 == 1 {
        return Err("a multicast address cannot be an interface's");
    }
    if mac == [0; 6] {
        return Err("the zero address cannot be an interface's");
    }
    Ok(mac)
}

pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// machine-id(5): 32 lowercase hex digits, not all zero.
pub fn check_machine_id(id: &str) -> Result<(), &'static str> {
    if id.len() != 32 || !id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err("expected 32 lowercase hex digits");
    }
    if id.bytes().all(|b| b == b'0') {
        return Err("the all-zero id is not a machine id");
    }
    Ok(())
}

/// A machine-id from 16 random bytes, shaped as a version 4 UUID like systemd's.
pub fn machine_id_from(mut bytes: [u8; 16]) -> String {
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What to do with the wall clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockAction {
    /// Within [`CLOCK_STEP_THRESHOLD_NS`] (or, unmanaged, the tolerance): leave it.
    Keep,
    /// Set it to `to_ns`; `by_ns` = host - guest.
    Step { to_ns: u64, by_ns: i64 },
    /// Off by `by_ns` and this agent may not set it.
    Refuse { by_ns: i64 },
}

/// The clock part: `guest_ns` is the guest's clock when the request is applied.
pub fn clock_action(guest_ns: u64, host_ns: u64, may_set: bool) -> ClockAction {
    let by_ns = i64::try_from(i128::from(host_ns) - i128::from(guest_ns)).unwrap_or(i64::MAX);
    let off = by_ns.unsigned_abs();
    match (may_set, off) {
        (true, off) if off > CLOCK_STEP_THRESHOLD_NS => ClockAction::Step {
            to_ns: host_ns,
            by_ns,
        },
        (false, off) if off > UNMANAGED_CLOCK_TOLERANCE_NS => ClockAction::Refuse { by_ns },
        _ => ClockAction::Keep,
    }
}

/// The `struct rand_pool_info` RNDADDENTROPY takes: entropy credited in bits (all of it), the
/// buffer's length, the bytes; in u32 words for the struct's alignment.
pub fn rand_pool_info(entropy: &[u8]) -> Vec<u32> {
    let mut words = vec![0u32; 2 + entropy.len().div_ceil(4)];
    words[0] = (entropy.len() * 8) as u32;
    words[1] = entropy.len() as u32;
    for (i, b) in entropy.iter().enumerate() {
        let w = &mut words[2 + i / 4];
        let mut bytes = w.to_ne_bytes();
        bytes[i % 4] = *b;
        *w = u32::from_ne_bytes(bytes);
    }
    words
}

/// An ARP announcement (RFC 5227 §2.3: a request whose sender and target address are both
/// `ip`) from `mac`, broadcast: switches and the gateway learn the clone's MAC for `ip` at once
/// instead of at their cache's expiry.
pub fn gratuitous_arp(mac: [u8; 6], ip: Ipv4Addr) -> [u8; 42] {
    let mut f = [0u8; 42];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    f[14..16].copy_from_slice(&1u16.to_be_bytes()); // Ethernet
    f[16..18].copy_from_slice(&0x0800u16.to_be_bytes()); // IPv4
    f[18] = 6;
    f[19] = 4;
    f[20..22].copy_from_slice(&1u16.to_be_bytes()); // request
    f[22..28].copy_from_slice(&mac);
    f[28..32].copy_from_slice(&ip.octets());
    // Target hardware address stays zero.
    f[38..42].copy_from_slice(&ip.octets());
    f
}

/// Apply `plan` as `cfg` allows, in order, and read back the evidence; `generation` is the
/// count this success makes.
pub async fn apply(
    plan: &Plan,
    cfg: &IdentityConfig,
    generation: u64,
) -> Result<Identified, PartFailed> {
    seed_entropy(&plan.entropy).map_err(failed(Part::Entropy))?;

    let before = wall_clock_ns().map_err(failed(Part::Clock))?;
    let clock_step_ns = match clock_action(before, plan.host_clock_ns, cfg.set_clock) {
        ClockAction::Keep => 0,
        ClockAction::Step { to_ns, by_ns } => {
            set_wall_clock_ns(to_ns).map_err(failed(Part::Clock))?;
            by_ns
        }
        ClockAction::Refuse { by_ns } => {
            return Err(PartFailed {
                part: Part::Clock,
                reason: format!(
                    "the guest's clock is {:.3} s off the host's and this agent does not own it",
                    by_ns as f64 / 1e9
                ),
            });
        }
    };

    nix::unistd::sethostname(&plan.hostname)
        .map_err(|e| failed(Part::Hostname)(format!("sethostname: {e}")))?;

    let machine_id = match &plan.machine_id {
        Some(id) => id.clone(),
        None => {
            let mut bytes = [0u8; 16];
            getrandom(&mut bytes).map_err(failed(Part::MachineId))?;
            machine_id_from(bytes)
        }
    };
    write_machine_id(&cfg.root, &machine_id).map_err(failed(Part::MachineId))?;

    let network = match &plan.network {
        None => None,
        Some(n) => {
            let interface = cfg.interface.as_deref().ok_or_else(|| {
                failed(Part::Network)(
                    "this agent manages no interface (host-process mode without \
                     --identity-interface)"
                        .into(),
                )
            })?;
            let done = net::reconfigure(interface, n.mac, &n.net, LINK_WAIT)
                .await
                .map_err(|e| failed(Part::Network)(e.to_string()))?;
            send_gratuitous_arp(interface, n.mac, n.net.address)
                .map_err(|e| failed(Part::Network)(format!("gratuitous ARP: {e}")))?;
            if !n.dns.is_empty() {
                system::write_resolv_conf(&cfg.root, &n.dns, &n.dns_search)
                    .map_err(|e| failed(Part::Dns)(e.to_string()))?;
            }
            Some(NetEvidence {
                mac: format_mac(&done.mac),
                addresses: done
                    .addresses
                    .iter()
                    .map(|(a, p)| format!("{a}/{p}"))
                    .collect(),
                neighbours_flushed: done.neighbours_flushed,
                gratuitous_arps: 1,
            })
        }
    };

    let mut sample = [0u8; SAMPLE_BYTES];
    getrandom(&mut sample).map_err(failed(Part::Evidence))?;
    let hostname = nix::unistd::gethostname()
        .map_err(|e| failed(Part::Evidence)(format!("gethostname: {e}")))?
        .to_string_lossy()
        .into_owned();
    let machine_id_now = std::fs::read_to_string(machine_id_path(&cfg.root))
        .map_err(|e| failed(Part::Evidence)(format!("read machine-id: {e}")))?
        .trim()
        .to_owned();
    Ok(Identified {
        generation,
        vmgenid_device: vmgenid_device(Path::new("/sys/bus/acpi/drivers/vmgenid")),
        random_sample_b64: base64::engine::general_purpose::STANDARD.encode(sample),
        hostname,
        machine_id: machine_id_now,
        wall_clock_unix_ns: wall_clock_ns().map_err(failed(Part::Evidence))?,
        clock_step_ns,
        network,
    })
}

/// Mix `entropy` into the kernel's pool, credited, then reseed the generator: after a restore
/// the pool's new bytes would otherwise reach `getrandom` only at the next scheduled reseed
/// (up to a minute), and until then every clone draws the snapshot's stream.
fn seed_entropy(entropy: &[u8]) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let dev = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| format!("open /dev/urandom: {e}"))?;
    let info = rand_pool_info(entropy);
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of the length its header states from the
    // buffer we own for the duration of the call.
    if unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } < 0 {
        return Err(format!(
            "RNDADDENTROPY: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(dev.as_raw_fd(), RNDRESEEDCRNG as _) } < 0 {
        return Err(format!(
            "RNDRESEEDCRNG: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn getrandom(buf: &mut [u8]) -> Result<(), String> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: writes at most rest.len() bytes into rest.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(format!("getrandom: {e}"));
        }
        filled += n as usize;
    }
    Ok(())
}

fn wall_clock_ns() -> Result<u64, String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "the wall clock is before 1970".to_owned())?;
    u64::try_from(now.as_nanos()).map_err(|_| "the wall clock is past 2554".to_owned())
}

fn set_wall_clock_ns(ns: u64) -> Result<(), String> {
    let ts = libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as _,
    };
    // SAFETY: clock_settime reads the timespec we pass.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } < 0 {
        return Err(format!(
            "clock_settime: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

fn machine_id_path(root: &Path) -> PathBuf {
    root.join("etc/machine-id")
}

/// Replace `<root>/etc/machine-id` atomically (a reader sees the old id or the new one).
fn write_machine_id(root: &Path, id: &str) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let path = machine_id_path(root);
    let tmp = root.join("etc/.machine-id.imp-new");
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(root.join("etc"))?;
        std::fs::write(&tmp, format!("{id}\n"))?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o444))?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("write {}: {e}", path.display())
    })
}

/// Send one ARP announcement for `ip` from `mac` on `interface` (AF_PACKET).
fn send_gratuitous_arp(interface: &str, mac: [u8; 6], ip: Ipv4Addr) -> std::io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let name = std::ffi::CString::new(interface)
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: if_nametoindex reads the NUL-terminated name we own.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Protocol 0: this socket only sends, it receives nothing.
    // SAFETY: plain socket(2); the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just returned by socket(2) and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let frame = gratuitous_arp(mac, ip);
    // SAFETY: sockaddr_ll is plain data; zeroed is a valid value.
    let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    to.sll_family = libc::AF_PACKET as u16;
    to.sll_protocol = (libc::ETH_P_ARP as u16).to_be();
    to.sll_ifindex = index as i32;
    to.sll_halen = 6;
    to.sll_addr[..6].copy_from_slice(&[0xff; 6]);
    // SAFETY: sendto reads frame.len() bytes of `frame` and a sockaddr_ll of the size we pass.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            frame.as_ptr().cast(),
            frame.len(),
            0,
            (&to as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The ACPI device bound to the vmgenid driver, if any (`QEMUVGID:00`, `VMGENCTR:00`).
fn vmgenid_device(driver: &Path) -> Option<String> {
    std::fs::read_dir(driver)
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.contains(':'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW_NS: u64 = 1_796_342_399_000_000_000;

    fn entropy(n: usize) -> String {
        let bytes: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    fn request() -> Reidentify {
        Reidentify {
            entropy_b64: entropy(32),
            hostname: "clone-7".into(),
            machine_id: Some("0123456789abcdef0123456789abcdef".into()),
            wall_clock_unix_ns: NOW_NS,
            network: Some(NetIdentity {
                mac: "02:00:0A:2c:00:05".into(),
                address: "10.44.0.5".into(),
                prefix: 24,
                gateway: "10.44.0.1".into(),
                mtu: Some(1400),
                dns: vec!["10.44.0.1".into()],
                dns_search: vec!["example.test".into()],
            }),
        }
    }

    #[test]
    fn a_good_request_plans_every_part() {
        let p = plan(&request()).unwrap();
        assert_eq!(p.entropy.len(), 32);
        assert_eq!(p.hostname, "clone-7");
        assert_eq!(p.host_clock_ns, NOW_NS);
        let n = p.network.unwrap();
        assert_eq!(n.mac, [0x02, 0, 0x0a, 0x2c, 0, 5]);
        assert_eq!(
            n.net,
            NetConfig {
                address: Ipv4Addr::new(10, 44, 0, 5),
                prefix: 24,
                gateway: Ipv4Addr::new(10, 44, 0, 1),
                mtu: Some(1400),
            }
        );
        assert_eq!(n.dns, [IpAddr::V4(Ipv4Addr::new(10, 44, 0, 1))]);
        // The Debug of a plan never shows the entropy.
        let dbg = format!("{:?}", plan(&request()).unwrap());
        assert!(dbg.contains("[32 bytes]"), "{dbg}");
        let mut r = request();
        r.network = None;
        r.machine_id = None;
        let p = plan(&r).unwrap();
        assert_eq!((p.network, p.machine_id), (None, None));
    }

    #[test]
    fn every_bad_field_is_named() {
        type Edit = fn(&mut Reidentify);
        let cases: Vec<(&str, Edit)> = vec![
            ("entropy_b64", |r| r.entropy_b64 = "***".into()),
            ("entropy_b64", |r| r.entropy_b64 = entropy(31)),
            ("entropy_b64", |r| r.entropy_b64 = entropy(513)),
            ("entropy_b64", |r| {
                r.entropy_b64 = base64::engine::general_purpose::STANDARD.encode([0u8; 64])
            }),
            ("entropy_b64", |r| r.entropy_b64 = String::new()),
            ("hostname", |r| r.hostname = String::new()),
            ("hostname", |r| r.hostname = "a b".into()),
            ("hostname", |r| r.hostname = "x".repeat(65)),
            ("machine_id", |r| r.machine_id = Some("0123".into())),
            ("machine_id", |r| {
                r.machine_id = Some("0123456789ABCDEF0123456789ABCDEF".into())
            }),
            ("machine_id", |r| r.machine_id = Some("0".repeat(32))),
            ("wall_clock_unix_ns", |r| r.wall_clock_unix_ns = 0),
            ("network.mac", |r| {
                r.network.as_mut().unwrap().mac = "02:00:0a:2c:00".into()
            }),
            ("network.mac", |r| {
                r.network.as_mut().unwrap().mac = "01:00:5e:00:00:01".into()
            }),
            ("network.mac", |r| {
                r.network.as_mut().unwrap().mac = "00:00:00:00:00:00".into()
            }),
            ("network.address", |r| {
                r.network.as_mut().unwrap().address = "10.44.0.5/24".into()
            }),
            ("network.gateway", |r| {
                r.network.as_mut().unwrap().gateway = "gw".into()
            }),
            ("network", |r| r.network.as_mut().unwrap().prefix = 31),
            ("network", |r| {
                r.network.as_mut().unwrap().gateway = "10.45.0.1".into()
            }),
            ("network", |r| r.network.as_mut().unwrap().mtu = Some(20)),
            ("network.dns", |r| {
                r.network.as_mut().unwrap().dns = vec!["resolver".into()]
            }),
            ("network.dns", |r| {
                r.network.as_mut().unwrap().dns = vec!["10.0.0.1".into(); 4]
            }),
            ("network.dns_search", |r| {
                r.network.as_mut().unwrap().dns_search = vec!["-bad".into()]
            }),
        ];
        for (field, edit) in cases {
            let mut r = request();
            edit(&mut r);
            let err = plan(&r).unwrap_err();
            assert_eq!(err.field, field, "{err}");
            let msg = err.to_string();
            assert!(msg.starts_with(&format!("reidentify: {field}: ")), "{msg}");
            // The entropy is never quoted back.
            assert!(
                !msg.contains(&r.entropy_b64) || r.entropy_b64.len() < 4,
                "{msg}"
            );
        }
        let mut r = request();
        r.network.as_mut().unwrap().gateway = "10.45.0.1".into();
        assert_eq!(
            plan(&r).unwrap_err().reason,
            "gateway is outside the address's subnet"
        );
    }

    #[test]
    fn macs_and_machine_ids() {
        assert_eq!(parse_mac("02:aB:00:00:00:ff"), Ok([2, 0xab, 0, 0, 0, 0xff]));
        assert!(parse_mac("02:ab:00:00:00:ff:00").is_err());
        assert!(parse_mac("02-ab-00-00-00-ff").is_err());
        assert!(parse_mac("2:ab:00:00:00:ff").is_err());
        assert_eq!(format_mac(&[2, 0xab, 0, 0, 0, 0xff]), "02:ab:00:00:00:ff");
        let id = machine_id_from([0xff; 16]);
        assert_eq!(id, "ffffffffffff4fffbfffffffffffffff");
        assert_eq!(check_machine_id(&id), Ok(()));
        assert_eq!(
            check_machine_id(&machine_id_from([0; 16])),
            Ok(()),
            "the version bits make even zero bytes a valid id"
        );
    }

    #[test]
    fn the_clock_is_stepped_only_when_off_and_owned() {
        let s = 1_000_000_000u64;
        // A clone wakes at the snapshot's time, an hour behind.
        assert_eq!(
            clock_action(NOW_NS - 3600 * s, NOW_NS, true),
            ClockAction::Step {
                to_ns: NOW_NS,
                by_ns: 3600 * s as i64
            }
        );
        assert_eq!(
            clock_action(NOW_NS + 2 * s, NOW_NS, true),
            ClockAction::Step {
                to_ns: NOW_NS,
                by_ns: -2 * s as i64
            }
        );
        // The message's transit time is no reason to move the clock backwards.
        assert_eq!(
            clock_action(NOW_NS + CLOCK_STEP_THRESHOLD_NS, NOW_NS, true),
            ClockAction::Keep
        );
        // Not owned: agreeing is fine, disagreeing is a failure, never a step.
        assert_eq!(
            clock_action(NOW_NS + s / 2, NOW_NS, false),
            ClockAction::Keep
        );
        assert_eq!(
            clock_action(NOW_NS - 3600 * s, NOW_NS, false),
            ClockAction::Refuse {
                by_ns: 3600 * s as i64
            }
        );
    }

    #[test]
    fn rand_pool_info_layout() {
        let bytes: Vec<u8> = (1..=33).collect();
        let info = rand_pool_info(&bytes);
        assert_eq!(info.len(), 2 + 9);
        assert_eq!((info[0], info[1]), (33 * 8, 33));
        let raw: Vec<u8> = info[2..].iter().flat_map(|w| w.to_ne_bytes()).collect();
        assert_eq!(&raw[..33], &bytes[..]);
        assert!(raw[33..].iter().all(|b| *b == 0));
    }

    #[test]
    fn gratuitous_arp_frame() {
        let mac = [2, 0, 0x0a, 0x2c, 0, 5];
        let ip = Ipv4Addr::new(10, 44, 0, 5);
        let f = gratuitous_arp(mac, ip);
        assert_eq!(&f[0..6], &[0xff; 6], "broadcast");
        assert_eq!(&f[6..12], &mac);
        assert_eq!(&f[12..14], &[0x08, 0x06], "ARP ethertype");
        assert_eq!(
            &f[14..22],
            &[0, 1, 0x08, 0, 6, 4, 0, 1],
            "Ethernet/IPv4 request"
        );
        assert_eq!(&f[22..28], &mac, "sender MAC");
        assert_eq!(&f[28..32], &ip.octets(), "sender IP");
        assert_eq!(&f[32..38], &[0; 6], "target MAC");
        assert_eq!(&f[38..42], &ip.octets(), "target IP = sender IP");
    }

    #[test]
    fn vmgenid_device_is_the_bound_acpi_device() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(vmgenid_device(&dir.path().join("absent")), None);
        for name in ["bind", "uevent", "unbind"] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        assert_eq!(vmgenid_device(dir.path()), None);
        std::fs::create_dir(dir.path().join("QEMUVGID:00")).unwrap();
        assert_eq!(vmgenid_device(dir.path()).as_deref(), Some("QEMUVGID:00"));
    }

    #[test]
    fn machine_id_is_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        write_machine_id(dir.path(), "0123456789abcdef0123456789abcdef").unwrap();
        write_machine_id(dir.path(), "fedcba9876543210fedcba9876543210").unwrap();
        let path = dir.path().join("etc/machine-id");
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "fedcba9876543210fedcba9876543210\n"
        );
        let names: Vec<_> = std::fs::read_dir(dir.path().join("etc"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["machine-id"], "no temporary file left");
    }
}
