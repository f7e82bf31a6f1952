//! Hostname, resolv.conf and the loopback interface (probes target 127.0.0.1, and nothing
//! else in a minimal guest brings `lo` up).

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
    let mut out = String::from("# written by imp-guest from the kernel command line\n");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_rendering() {
        let dns: Vec<IpAddr> = vec!["10.0.0.1".parse().unwrap(), "::1".parse().unwrap()];
        assert_eq!(
            render_resolv_conf(&dns, &["a.example".into(), "b.example".into()]),
            "# written by imp-guest from the kernel command line\nsearch a.example b.example\nnameserver 10.0.0.1\nnameserver ::1\n"
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
