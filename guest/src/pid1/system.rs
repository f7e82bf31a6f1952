//! Hostname, resolv.conf, the loopback interface (probes target 127.0.0.1, and nothing
//! else in a minimal guest brings `lo` up) and the wall clock's sanity check.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum SystemError {
    #[error("sethostname({name}): {source}")]
    Hostname { name: String, source: nix::Error },
    #[error("write {path}: {source}")]
    ResolvConf {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("bring up lo: {step}: {source}")]
    Loopback {
        step: &'static str,
        source: std::io::Error,
    },
}

pub fn set_hostname(name: &str) -> Result<(), SystemError> {
    nix::unistd::sethostname(name).map_err(|source| SystemError::Hostname {
        name: name.to_owned(),
        source,
    })
}

/// resolv.conf contents for the given nameservers and search domains.
pub fn render_resolv_conf(dns: &[IpAddr], search: &[String]) -> String {
    let mut out =
        String::from("# written by imp-guest (kernel command line, or the host's reidentify)\n");
    if !search.is_empty() {
        out.push_str(&format!("search {}\n", search.join(" ")));
    }
    for ip in dns {
        out.push_str(&format!("nameserver {ip}\n"));
    }
    out
}

/// Write `<root>/etc/resolv.conf`, replacing a symlink (images often point it at
/// systemd-resolved, which does not run here) rather than writing through it.
pub fn write_resolv_conf(
    root: &Path,
    dns: &[IpAddr],
    search: &[String],
) -> Result<(), SystemError> {
    let path = root.join("etc/resolv.conf");
    let err = |source| SystemError::ResolvConf {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(root.join("etc")).map_err(err)?;
    if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
        std::fs::remove_file(&path).map_err(err)?;
    }
    std::fs::write(&path, render_resolv_conf(dns, search)).map_err(err)
}

/// `ip link set lo up`, via SIOCSIFFLAGS.
pub fn loopback_up() -> Result<(), SystemError> {
    let err = |step| move |source| SystemError::Loopback { step, source };
    // SAFETY: plain socket(2); the fd is owned and closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(err("socket")(std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just returned by socket(2) and is not owned elsewhere.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    // SAFETY: ifreq is plain data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write an ifreq we own.
    if unsafe { libc::ioctl(raw, libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(err("SIOCGIFFLAGS")(std::io::Error::last_os_error()));
    }
    // SAFETY: ifru_flags is the union member SIOCGIFFLAGS filled in.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    if unsafe { libc::ioctl(raw, libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(err("SIOCSIFFLAGS")(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// 2026-01-01T00:00:00Z. A wall clock before this is wrong (this build is newer): TLS
/// certificate checks (git, curl, docker pull) would fail with "certificate is not yet valid".
pub const CLOCK_FLOOR_UNIX: u64 = 1_767_225_600;

/// The wall clock at boot. The kernel sets it before PID 1 runs: from the CMOS RTC under QEMU
/// (`-rtc base=utc`, the default: the host's time), from kvm-clock's wall clock under
/// Firecracker/KVM. PID 1 only checks it; it has no better source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Clock {
    Plausible { unix: u64 },
    BeforeFloor { unix: u64 },
}

pub fn check_clock(unix: u64) -> Clock {
    if unix < CLOCK_FLOOR_UNIX {
        Clock::BeforeFloor { unix }
    } else {
        Clock::Plausible { unix }
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` for seconds since the epoch (UTC; Howard Hinnant's civil_from_days).
pub fn rfc3339(unix: u64) -> String {
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// The kernel's clocksource (kvm-clock, tsc, hpet...), for the console marker.
pub fn clocksource() -> String {
    std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_floor_and_rendering() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(CLOCK_FLOOR_UNIX), "2026-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_342_399), "2026-12-03T23:59:59Z");
        assert_eq!(check_clock(0), Clock::BeforeFloor { unix: 0 });
        assert_eq!(
            check_clock(CLOCK_FLOOR_UNIX - 1),
            Clock::BeforeFloor {
                unix: CLOCK_FLOOR_UNIX - 1
            }
        );
        assert_eq!(
            check_clock(CLOCK_FLOOR_UNIX),
            Clock::Plausible {
                unix: CLOCK_FLOOR_UNIX
            }
        );
    }

    #[test]
    fn resolv_conf_rendering() {
        let dns: Vec<IpAddr> = vec!["10.0.0.1".parse().unwrap(), "::1".parse().unwrap()];
        assert_eq!(
            render_resolv_conf(&dns, &["a.example".into(), "b.example".into()]),
            "# written by imp-guest (kernel command line, or the host's reidentify)\nsearch a.example b.example\nnameserver 10.0.0.1\nnameserver ::1\n"
        );
    }

    #[test]
    fn resolv_conf_replaces_symlink_not_target() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        let target = dir.path().join("stub-resolv.conf");
        std::fs::write(&target, "nameserver 127.0.0.53\n").unwrap();
        std::os::unix::fs::symlink(&target, dir.path().join("etc/resolv.conf")).unwrap();
        write_resolv_conf(dir.path(), &["192.0.2.53".parse().unwrap()], &[]).unwrap();
        let written = std::fs::read_to_string(dir.path().join("etc/resolv.conf")).unwrap();
        assert!(written.contains("nameserver 192.0.2.53"));
        assert!(
            !std::fs::symlink_metadata(dir.path().join("etc/resolv.conf"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(
            std::fs::read_to_string(&target).unwrap(),
            "nameserver 127.0.0.53\n"
        );
    }
}
