//! Kernel command-line parameters for the guest (pure parsing, no I/O).
//!
//! imp-runtime puts these on the Firecracker boot_args. Keys contain a dot, so the kernel keeps
//! them out of init's argv/env; PID 1 reads them from /proc/cmdline.
//!
//! | key | meaning | default |
//! |---|---|---|
//! | `imp.hostname=NAME` | hostname | unchanged |
//! | `imp.net=ADDR/PREFIX,GATEWAY[,MTU]` | IPv4 address of `eth0`, default route, MTU | `eth0` left down |
//! | `imp.dns=IP[,IP]` (repeatable) | nameservers for /etc/resolv.conf | none: resolv.conf untouched |
//! | `imp.dns_search=DOMAIN[,DOMAIN]` | resolv.conf search list | none |
//! | `imp.overlay=DEV` | per-VM writable drive: assemble the root as overlay(lower, DEV) | no overlay |
//! | `imp.overlay_fstype=FS` | filesystem on the writable drive | ext4 |
//! | `imp.lower=DEV` | read-only base drive, when the kernel's root is an initramfs | the current root |
//! | `imp.lower_fstype=FS` | filesystem on the base drive | ext4 |
//! | `imp.vsock_port=N` | agent port | 10000 |
//! | `imp.report_grace_s=N` | power off this long after the workload exit even if unreported | 600 |
//! | `imp.halt=poweroff\|reboot` | how to end the VM (Firecracker on x86_64 exits only on `reboot`) | poweroff |

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use crate::protocol::AGENT_VSOCK_PORT;

pub const DEFAULT_REPORT_GRACE: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HaltAction {
    /// reboot(RB_POWER_OFF)
    PowerOff,
    /// reboot(RB_AUTOBOOT): Firecracker on x86_64 has no ACPI power-off and exits on reset.
    Reboot,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayConfig {
    /// Base image device; `None` = the root the kernel already mounted (read-only).
    pub lower: Option<PathBuf>,
    pub lower_fstype: String,
    pub upper: PathBuf,
    pub upper_fstype: String,
}

/// `imp.net`: the guest's one interface. IPv4 only: Imp's bridge and NAT are IPv4 only, and
/// the guest deliberately gets no IPv6 (docs/network.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    pub address: Ipv4Addr,
    pub prefix: u8,
    pub gateway: Ipv4Addr,
    /// `None`: the driver's default (1500 for virtio-net).
    pub mtu: Option<u32>,
}

/// Smallest MTU IPv4 allows (RFC 791) and the largest a Linux link takes.
const MTU_RANGE: std::ops::RangeInclusive<u32> = 68..=65535;

impl NetConfig {
    /// Parse `ADDR/PREFIX,GATEWAY[,MTU]`, e.g. `10.44.0.5/24,10.44.0.1,1500`.
    pub fn parse(value: &str) -> Result<Self, &'static str> {
        let mut parts = value.split(',');
        let cidr = parts.next().unwrap_or_default();
        let (addr, prefix) = cidr
            .split_once('/')
            .ok_or("expected ADDR/PREFIX,GATEWAY[,MTU]")?;
        let address: Ipv4Addr = addr.parse().map_err(|_| "address is not an IPv4 address")?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| (1..=30).contains(p))
            .ok_or("prefix must be 1..30")?;
        let gateway: Ipv4Addr = parts
            .next()
            .ok_or("expected ADDR/PREFIX,GATEWAY[,MTU]")?
            .parse()
            .map_err(|_| "gateway is not an IPv4 address")?;
        let mtu = match parts.next() {
            None => None,
            Some(m) => Some(
                m.parse()
                    .ok()
                    .filter(|m| MTU_RANGE.contains(m))
                    .ok_or("MTU must be 68..65535")?,
            ),
        };
        if parts.next().is_some() {
            return Err("too many fields: expected ADDR/PREFIX,GATEWAY[,MTU]");
        }
        let mask = u32::MAX << (32 - prefix);
        let net = u32::from(address) & mask;
        if u32::from(gateway) & mask != net {
            return Err("gateway is outside the address's subnet");
        }
        if gateway == address {
            return Err("address and gateway are the same");
        }
        let host = u32::from(address) & !mask;
        if host == 0 || host == !mask {
            return Err("address is the subnet's network or broadcast address");
        }
        Ok(Self {
            address,
            prefix,
            gateway,
            mtu,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootConfig {
    pub hostname: Option<String>,
    pub net: Option<NetConfig>,
    pub dns: Vec<IpAddr>,
    pub dns_search: Vec<String>,
    pub overlay: Option<OverlayConfig>,
    pub vsock_port: u32,
    pub report_grace: Duration,
    pub halt: HaltAction,
    /// `imp.*` keys this build does not know (logged, not fatal: a newer host may add keys).
    pub unknown_keys: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmdlineError {
    #[error("{key}={value:?}: {reason}")]
    InvalidValue {
        key: String,
        value: String,
        reason: &'static str,
    },
    #[error("{key} needs a value ({key}=...)")]
    MissingValue { key: String },
    #[error("unterminated quote in the kernel command line")]
    UnterminatedQuote,
}

/// Split like the kernel does: whitespace-separated, double quotes group (and are removed).
pub fn split(cmdline: &str) -> Result<Vec<String>, CmdlineError> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_quotes = false;
    let mut has_word = false;
    for c in cmdline.chars() {
        match c {
            '"' => {
                in_quotes = !in_quotes;
                has_word = true;
            }
            c if c.is_whitespace() && !in_quotes => {
                if has_word {
                    words.push(std::mem::take(&mut cur));
                    has_word = false;
                }
            }
            c => {
                cur.push(c);
                has_word = true;
            }
        }
    }
    if in_quotes {
        return Err(CmdlineError::UnterminatedQuote);
    }
    if has_word {
        words.push(cur);
    }
    Ok(words)
}

pub fn parse(cmdline: &str) -> Result<BootConfig, CmdlineError> {
    let mut cfg = BootConfig {
        hostname: None,
        net: None,
        dns: Vec::new(),
        dns_search: Vec::new(),
        overlay: None,
        vsock_port: AGENT_VSOCK_PORT,
        report_grace: DEFAULT_REPORT_GRACE,
        halt: HaltAction::PowerOff,
        unknown_keys: Vec::new(),
    };
    let mut overlay_dev = None;
    let mut overlay_fstype = "ext4".to_owned();
    let mut lower_dev = None;
    let mut lower_fstype = "ext4".to_owned();

    for word in split(cmdline)? {
        let Some(key) = word.split('=').next().filter(|k| k.starts_with("imp.")) else {
            continue;
        };
        let key = key.to_owned();
        let value = match word.split_once('=') {
            Some((_, v)) => v.to_owned(),
            None => return Err(CmdlineError::MissingValue { key }),
        };
        let invalid = |reason| CmdlineError::InvalidValue {
            key: key.clone(),
            value: value.clone(),
            reason,
        };
        match key.as_str() {
            "imp.hostname" => {
                if !valid_hostname(&value) {
                    return Err(invalid(
                        "not a valid hostname (1-64 of a-z, A-Z, 0-9, '-', '.')",
                    ));
                }
                cfg.hostname = Some(value.clone());
            }
            "imp.net" => cfg.net = Some(NetConfig::parse(&value).map_err(invalid)?),
            "imp.dns" => {
                for part in value.split(',').filter(|p| !p.is_empty()) {
                    cfg.dns.push(
                        part.parse()
                            .map_err(|_| invalid("not an IP address list"))?,
                    );
                }
            }
            "imp.dns_search" => {
                for part in value.split(',').filter(|p| !p.is_empty()) {
                    if !valid_hostname(part) {
                        return Err(invalid("not a valid domain list"));
                    }
                    cfg.dns_search.push(part.to_owned());
                }
            }
            "imp.overlay" => {
                overlay_dev =
                    Some(device(&value).ok_or_else(|| invalid("must be an absolute device path"))?)
            }
            "imp.overlay_fstype" => {
                overlay_fstype = fstype(&value).ok_or_else(|| invalid("not a filesystem type"))?
            }
            "imp.lower" => {
                lower_dev =
                    Some(device(&value).ok_or_else(|| invalid("must be an absolute device path"))?)
            }
            "imp.lower_fstype" => {
                lower_fstype = fstype(&value).ok_or_else(|| invalid("not a filesystem type"))?
            }
            "imp.vsock_port" => {
                cfg.vsock_port = value
                    .parse()
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| invalid("not a port number"))?
            }
            "imp.report_grace_s" => {
                cfg.report_grace = Duration::from_secs(
                    value
                        .parse()
                        .map_err(|_| invalid("not a number of seconds"))?,
                )
            }
            "imp.halt" => {
                cfg.halt = match value.as_str() {
                    "poweroff" => HaltAction::PowerOff,
                    "reboot" => HaltAction::Reboot,
                    _ => return Err(invalid("must be poweroff or reboot")),
                }
            }
            _ => cfg.unknown_keys.push(key),
        }
    }
    if lower_dev.is_some() && overlay_dev.is_none() {
        return Err(CmdlineError::MissingValue {
            key: "imp.overlay".into(),
        });
    }
    cfg.overlay = overlay_dev.map(|upper| OverlayConfig {
        lower: lower_dev,
        lower_fstype,
        upper,
        upper_fstype: overlay_fstype,
    });
    Ok(cfg)
}

pub fn valid_hostname(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && !s.starts_with(['-', '.'])
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

fn device(s: &str) -> Option<PathBuf> {
    (s.starts_with('/') && !s.contains("..") && s.len() > 1).then(|| PathBuf::from(s))
}

fn fstype(s: &str) -> Option<String> {
    (!s.is_empty() && s.len() <= 32 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .then(|| s.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typical_firecracker_cmdline() {
        let c = parse(
            "console=ttyS0 reboot=k panic=1 pci=off root=/dev/vda ro init=/sbin/imp-guest \
             ip=10.0.0.2::10.0.0.1:255.255.255.0::eth0:off imp.hostname=runner-abc \
             imp.dns=10.0.0.1,1.1.1.1 imp.dns=2606:4700:4700::1111 imp.dns_search=ci.local \
             imp.overlay=/dev/vdb imp.halt=reboot imp.report_grace_s=30",
        )
        .unwrap();
        assert_eq!(c.hostname.as_deref(), Some("runner-abc"));
        let dns: Vec<String> = c.dns.iter().map(ToString::to_string).collect();
        assert_eq!(dns, ["10.0.0.1", "1.1.1.1", "2606:4700:4700::1111"]);
        assert_eq!(c.dns_search, ["ci.local"]);
        assert_eq!(
            c.overlay,
            Some(OverlayConfig {
                lower: None,
                lower_fstype: "ext4".into(),
                upper: "/dev/vdb".into(),
                upper_fstype: "ext4".into()
            })
        );
        assert_eq!(c.halt, HaltAction::Reboot);
        assert_eq!(c.report_grace, Duration::from_secs(30));
        assert_eq!(c.vsock_port, AGENT_VSOCK_PORT);
        assert!(c.unknown_keys.is_empty());
    }

    #[test]
    fn defaults_when_nothing_given() {
        let c = parse("console=ttyS0\n").unwrap();
        assert_eq!(c.hostname, None);
        assert!(c.dns.is_empty() && c.overlay.is_none());
        assert_eq!(c.halt, HaltAction::PowerOff);
        assert_eq!(c.report_grace, DEFAULT_REPORT_GRACE);
    }

    #[test]
    fn quotes_and_initramfs_lower() {
        let c = parse(
            r#"imp.lower="/dev/vda" imp.overlay=/dev/vdb imp.overlay_fstype=xfs imp.future=1"#,
        )
        .unwrap();
        let o = c.overlay.unwrap();
        assert_eq!(o.lower, Some(PathBuf::from("/dev/vda")));
        assert_eq!(o.upper_fstype, "xfs");
        assert_eq!(c.unknown_keys, ["imp.future"]);
        assert_eq!(split(r#"a "b c" d"#).unwrap(), ["a", "b c", "d"]);
        assert_eq!(split(r#"x="" y"#).unwrap(), ["x=", "y"]);
        assert_eq!(split(r#"x="open"#), Err(CmdlineError::UnterminatedQuote));
    }

    #[test]
    fn invalid_values_are_precise() {
        let err = |s: &str| parse(s).unwrap_err();
        assert!(
            matches!(err("imp.dns=8.8.8.8,nope"), CmdlineError::InvalidValue { key, .. } if key == "imp.dns")
        );
        assert!(matches!(
            err("imp.hostname=bad_name"),
            CmdlineError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("imp.hostname=-x"),
            CmdlineError::InvalidValue { .. }
        ));
        assert!(matches!(
            err(&format!("imp.hostname={}", "a".repeat(65))),
            CmdlineError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("imp.overlay=vdb"),
            CmdlineError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("imp.vsock_port=0"),
            CmdlineError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("imp.halt=explode"),
            CmdlineError::InvalidValue { .. }
        ));
        assert!(matches!(
            err("imp.hostname"),
            CmdlineError::MissingValue { .. }
        ));
        assert!(
            matches!(err("imp.lower=/dev/vda"), CmdlineError::MissingValue { key } if key == "imp.overlay")
        );
    }

    #[test]
    fn net_parameter() {
        let c = parse("imp.net=10.44.0.5/24,10.44.0.1,1400 imp.dns=10.44.0.1").unwrap();
        assert_eq!(
            c.net,
            Some(NetConfig {
                address: Ipv4Addr::new(10, 44, 0, 5),
                prefix: 24,
                gateway: Ipv4Addr::new(10, 44, 0, 1),
                mtu: Some(1400),
            })
        );
        let c = parse("imp.net=192.0.2.130/25,192.0.2.129").unwrap();
        assert_eq!(c.net.unwrap().mtu, None);
        assert_eq!(parse("console=ttyS0").unwrap().net, None);
    }

    #[test]
    fn malformed_net_names_the_parameter_and_the_fault() {
        let reason = |v: &str| match parse(&format!("imp.net={v}")).unwrap_err() {
            CmdlineError::InvalidValue { key, value, reason } => {
                assert_eq!(key, "imp.net");
                assert_eq!(value, v);
                reason
            }
            other => panic!("{v}: {other:?}"),
        };
        assert_eq!(
            reason("10.44.0.5,10.44.0.1"),
            "expected ADDR/PREFIX,GATEWAY[,MTU]"
        );
        assert_eq!(reason("10.44.0.5/24"), "expected ADDR/PREFIX,GATEWAY[,MTU]");
        assert_eq!(
            reason("10.44.0/24,10.44.0.1"),
            "address is not an IPv4 address"
        );
        assert_eq!(
            reason("fd00::5/64,fd00::1"),
            "address is not an IPv4 address"
        );
        assert_eq!(reason("10.44.0.5/31,10.44.0.4"), "prefix must be 1..30");
        assert_eq!(reason("10.44.0.5/0,10.44.0.1"), "prefix must be 1..30");
        assert_eq!(reason("10.44.0.5/x,10.44.0.1"), "prefix must be 1..30");
        assert_eq!(reason("10.44.0.5/24,gw"), "gateway is not an IPv4 address");
        assert_eq!(
            reason("10.44.0.5/24,10.45.0.1"),
            "gateway is outside the address's subnet"
        );
        assert_eq!(
            reason("10.44.0.5/24,10.44.0.5"),
            "address and gateway are the same"
        );
        assert_eq!(
            reason("10.44.0.0/24,10.44.0.1"),
            "address is the subnet's network or broadcast address"
        );
        assert_eq!(
            reason("10.44.0.255/24,10.44.0.1"),
            "address is the subnet's network or broadcast address"
        );
        assert_eq!(reason("10.44.0.5/24,10.44.0.1,67"), "MTU must be 68..65535");
        assert_eq!(
            reason("10.44.0.5/24,10.44.0.1,65536"),
            "MTU must be 68..65535"
        );
        assert_eq!(
            reason("10.44.0.5/24,10.44.0.1,1500,x"),
            "too many fields: expected ADDR/PREFIX,GATEWAY[,MTU]"
        );
        // The whole boot error names the parameter, so the console line says what to fix.
        let msg = parse("imp.net=10.44.0.5/24").unwrap_err().to_string();
        assert!(msg.starts_with("imp.net=\"10.44.0.5/24\": "), "{msg}");
    }
}
