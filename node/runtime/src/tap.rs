//! The VM's TAP device: created with iproute2 before Firecracker opens it, deleted on teardown,
//! and its cumulative byte counters (Runtime.LinkStats), all through iproute2 (netlink) in the
//! runtime's own network namespace.

use std::process::Command;

/// Linux interface names are at most 15 bytes (IFNAMSIZ - 1).
const IFNAME_MAX: usize = 15;

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("TAP name {0:?} is not a valid interface name")]
    BadName(String),
    #[error("`ip {args}` failed: {message}")]
    Ip { args: String, message: String },
    #[error("attach to TAP {tap}: {source}")]
    Open { tap: String, source: std::io::Error },
    #[error("link {0} does not exist")]
    NoSuchLink(String),
    #[error("`ip -j -s link show dev {link}` has no counter {counter}")]
    Stats { link: String, counter: String },
}

pub use imp_runtime_api::api::LinkStats;

/// A stable, host-unique TAP name for a VM: several runtimes (or test runs) may share a host, so
/// the name hashes the state dir and uid (FNV-1a, 44 bits) rather than counting.
pub fn tap_name(state_dir: &std::path::Path, uid: &str) -> String {
    let h = fnv1a(&[
        state_dir.as_os_str().as_encoded_bytes(),
        &[0],
        uid.as_bytes(),
    ]);
    format!("imp{:011x}", h & 0xfff_ffff_ffff)
}

/// 64-bit FNV-1a over the concatenated parts: stable names and MACs (here and in network/).
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parts.iter().flat_map(|p| p.iter()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn check(name: &str) -> Result<(), TapError> {
    let ok = !name.is_empty()
        && name.len() <= IFNAME_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(TapError::BadName(name.into()))
    }
}

fn ip_output(args: &[&str]) -> Result<std::process::Output, TapError> {
    Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| TapError::Ip {
            args: args.join(" "),
            message: e.to_string(),
        })
}

fn ip_failed(args: &[&str], out: &std::process::Output) -> TapError {
    TapError::Ip {
        args: args.join(" "),
        message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    }
}

fn ip(args: &[&str]) -> Result<(), TapError> {
    let out = ip_output(args)?;
    if out.status.success() {
        Ok(())
    } else {
        Err(ip_failed(args, &out))
    }
}

/// The link as iproute2 reports it over netlink in this process's network namespace (`None`: no
/// such link). Not sysfs: a process moved into a namespace with `nsenter --net` keeps the sysfs of
/// the namespace it came from, and would then see (or miss) the wrong links.
fn show(name: &str) -> Result<Option<serde_json::Value>, TapError> {
    let args = ["-j", "-s", "link", "show", "dev", name];
    let out = ip_output(&args)?;
    if !out.status.success() {
        if String::from_utf8_lossy(&out.stderr).contains("does not exist") {
            return Ok(None);
        }
        return Err(ip_failed(&args, &out));
    }
    let links: Vec<serde_json::Value> =
        serde_json::from_slice(&out.stdout).map_err(|e| TapError::Ip {
            args: args.join(" "),
            message: format!("unreadable JSON: {e}"),
        })?;
    Ok(links.into_iter().next())
}

pub fn exists(name: &str) -> Result<bool, TapError> {
    check(name)?;
    Ok(show(name)?.is_some())
}

/// Create the TAP (idempotent: an existing one from an interrupted attempt is reused) and set it up.
pub fn create(name: &str) -> Result<(), TapError> {
    if !exists(name)? {
        ip(&["tuntap", "add", "dev", name, "mode", "tap"])?;
    }
    ip(&["link", "set", "dev", name, "up"])
}

/// Delete the TAP; absent is fine.
pub fn delete(name: &str) -> Result<(), TapError> {
    if !exists(name)? {
        return Ok(());
    }
    ip(&["link", "del", "dev", name])
}

/// Attach to the TAP as a VMM would (`TUNSETIFF`: no packet info, virtio-net headers), for a
/// confined VMM that cannot open it itself: it gets the descriptor (`-netdev tap,fd=N`).
pub fn open(name: &str) -> Result<std::os::fd::OwnedFd, TapError> {
    use std::os::fd::AsRawFd as _;
    check(name)?;
    let failed = |e: std::io::Error| TapError::Open {
        tap: name.into(),
        source: e,
    };
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(failed)?;
    // SAFETY: an all-zero ifreq is valid; the name fits (check: at most IFNAMSIZ - 1 bytes).
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    req.ifr_ifru.ifru_flags =
        (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    // SAFETY: TUNSETIFF reads an ifreq, which lives across the call.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &req) } < 0 {
        return Err(failed(std::io::Error::last_os_error()));
    }
    Ok(tun.into())
}

/// Let uid/gid `id` attach to the (persistent) TAP without a capability: a jailed Firecracker
/// opens it by name as the VM's uid (`TUNSETOWNER`, `TUNSETGROUP`).
pub fn set_owner(name: &str, id: u32) -> Result<(), TapError> {
    use std::os::fd::AsRawFd as _;
    let fd = open(name)?;
    let failed = |e: std::io::Error| TapError::Open {
        tap: name.into(),
        source: e,
    };
    // SAFETY: both ioctls take an integer argument on a descriptor we own.
    unsafe {
        if libc::ioctl(fd.as_raw_fd(), libc::TUNSETOWNER, id as libc::c_ulong) < 0
            || libc::ioctl(fd.as_raw_fd(), libc::TUNSETGROUP, id as libc::c_ulong) < 0
        {
            return Err(failed(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

pub fn stats(name: &str) -> Result<LinkStats, TapError> {
    check(name)?;
    let link = show(name)?.ok_or_else(|| TapError::NoSuchLink(name.into()))?;
    let counter = |dir: &str| {
        link.pointer(&format!("/stats64/{dir}/bytes"))
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| TapError::Stats {
                link: name.into(),
                counter: format!("stats64.{dir}.bytes"),
            })
    };
    Ok(LinkStats {
        rx_bytes: counter("rx")?,
        tx_bytes: counter("tx")?,
        wake_packets: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_fit_ifnamsiz_and_differ_by_state_dir() {
        let a = tap_name(
            "/var/lib/imp".as_ref(),
            "0b7c2f7e-8d7e-4a57-9e6f-2f8e8c1a9b10",
        );
        let b = tap_name("/tmp/x".as_ref(), "0b7c2f7e-8d7e-4a57-9e6f-2f8e8c1a9b10");
        assert!(a.len() <= IFNAME_MAX && a.starts_with("imp"), "{a}");
        assert_eq!(
            a,
            tap_name(
                "/var/lib/imp".as_ref(),
                "0b7c2f7e-8d7e-4a57-9e6f-2f8e8c1a9b10"
            )
        );
        assert_ne!(a, b);
        assert!(check(&a).is_ok());
        assert!(check("a/b").is_err());
        assert!(check("much-too-long-name").is_err());
    }
}
