//! Request checks before anything is written: the uid, the spec's numbers and names, the host
//! paths a request may name (only files under the runtime's image directories), and the
//! writable-drive budget.

use std::path::{Path, PathBuf};

use crate::api::{NetworkAttachment, VmSpec};

const MAX_UID_LEN: usize = 63;
/// Firecracker's ceiling, kept for every backend so a spec means the same everywhere.
const MAX_VCPU: u32 = 32;
const MIN_MEMORY_MIB: u64 = 16;
/// A kernel command line is at most 2048 bytes on x86; leave room for the runtime's own.
const MAX_EXTRA_BOOT_ARGS: usize = 1024;

/// A refused request: the field at fault and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    pub field: &'static str,
    pub message: String,
}

fn invalid(field: &'static str, message: String) -> Invalid {
    Invalid { field, message }
}

/// The image references of a VM spec or a pre-build request parse (`image.base`,
/// `image.runner`).
pub fn image(image: &crate::rootfs::store::ImageSpec) -> Result<(), Invalid> {
    for (field, reference) in [
        ("image.base", Some(&image.base)),
        ("image.runner", image.runner.as_ref()),
    ] {
        if let Some(r) = reference
            && let Err(e) = r.parse::<oci_client::Reference>()
        {
            return Err(invalid(
                field,
                format!("{r:?} is not an image reference: {e}"),
            ));
        }
    }
    Ok(())
}

pub fn valid_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= MAX_UID_LEN
        && uid.as_bytes()[0].is_ascii_alphanumeric()
        && uid
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// The spec's own consistency (no host access).
pub fn spec(spec: &VmSpec) -> Result<(), Invalid> {
    if spec.vcpu == 0 || spec.vcpu > MAX_VCPU || (spec.vcpu > 1 && spec.vcpu % 2 == 1) {
        return Err(invalid(
            "vcpu",
            format!("{} must be 1 or an even number up to {MAX_VCPU}", spec.vcpu),
        ));
    }
    if spec.memory_mib < MIN_MEMORY_MIB {
        return Err(invalid(
            "memory_mib",
            format!("{} is below {MIN_MEMORY_MIB}", spec.memory_mib),
        ));
    }
    match (&spec.base_disk, &spec.image) {
        (Some(_), None) => {}
        (None, Some(image)) => self::image(image)?,
        _ => {
            return Err(invalid(
                "base_disk",
                "exactly one of base_disk and image is required".into(),
            ));
        }
    }
    if spec.writable_disk_bytes == Some(0) {
        return Err(invalid("writable_disk_bytes", "must be positive".into()));
    }
    if let Some(extra) = &spec.extra_boot_args
        && (extra.len() > MAX_EXTRA_BOOT_ARGS || extra.chars().any(|c| c.is_control()))
    {
        return Err(invalid(
            "extra_boot_args",
            format!("at most {MAX_EXTRA_BOOT_ARGS} bytes without control characters"),
        ));
    }
    if let Some(mac) = spec.network.as_ref().and_then(|n| n.guest_mac.as_ref()) {
        let parts: Vec<&str> = mac.split(':').collect();
        if parts.len() != 6
            || !parts
                .iter()
                .all(|p| p.len() == 2 && u8::from_str_radix(p, 16).is_ok())
        {
            return Err(invalid(
                "network.guest_mac",
                format!("{mac:?} is not a MAC address"),
            ));
        }
    }
    if let Some(a) = spec.network.as_ref().and_then(|n| n.attachment.as_ref()) {
        attachment(a)?;
    }
    warm_paths(&spec.warm_paths)
}

/// The guest's own rules for a `Warm` (imp_guest::protocol), so a template build never sends
/// one the guest refuses.
fn warm_paths(paths: &[String]) -> Result<(), Invalid> {
    use imp_guest::protocol::{WARM_MAX_PATHS, check_warm_path};
    if paths.len() > WARM_MAX_PATHS {
        return Err(invalid(
            "warm_paths",
            format!("at most {WARM_MAX_PATHS} paths"),
        ));
    }
    for (i, p) in paths.iter().enumerate() {
        check_warm_path(p).map_err(|why| invalid("warm_paths", format!("[{i}]: {why}")))?;
    }
    Ok(())
}

/// The guest's parser accepts MTUs in this range (guest/src/pid1/cmdline.rs).
const MTU_RANGE: std::ops::RangeInclusive<u32> = 68..=65535;
const MAX_DNS: usize = 8;
/// The CRD's limits on `spec.ingress` (api/src/network.rs).
const MAX_INGRESS: usize = 16;
const MAX_INGRESS_PORTS: usize = 32;

fn attachment(a: &NetworkAttachment) -> Result<(), Invalid> {
    if a.network_id.is_empty() || a.network_id.len() > 253 {
        return Err(invalid(
            "network.attachment.network_id",
            "1-253 characters (the ImpNetwork's uid)".into(),
        ));
    }
    let subnet = a.address.trunc();
    let host = |ip: &std::net::Ipv4Addr| {
        subnet.contains(ip) && *ip != subnet.network() && *ip != subnet.broadcast()
    };
    if a.address.prefix_len() > 30 {
        return Err(invalid(
            "network.attachment.address",
            format!("{}: the prefix must be at most 30", a.address),
        ));
    }
    if !host(&a.gateway) {
        return Err(invalid(
            "network.attachment.gateway",
            format!("{} is not a host address of {subnet}", a.gateway),
        ));
    }
    if !host(&a.address.addr()) || a.address.addr() == a.gateway {
        return Err(invalid(
            "network.attachment.address",
            format!(
                "{} is not a host address of {subnet} other than the gateway",
                a.address.addr()
            ),
        ));
    }
    if a.dns.len() > MAX_DNS {
        return Err(invalid(
            "network.attachment.dns",
            format!("at most {MAX_DNS} resolvers"),
        ));
    }
    if let Some(mtu) = a.mtu
        && !MTU_RANGE.contains(&mtu)
    {
        return Err(invalid(
            "network.attachment.mtu",
            format!(
                "{mtu} is outside {}..={}",
                MTU_RANGE.start(),
                MTU_RANGE.end()
            ),
        ));
    }
    if let Some(i) = &a.egress_interface
        && (i.is_empty()
            || i.len() > 15
            || !i
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)))
    {
        return Err(invalid(
            "network.attachment.egress_interface",
            format!("{i:?} is not an interface name"),
        ));
    }
    if a.ingress.len() > MAX_INGRESS {
        return Err(invalid(
            "network.attachment.ingress",
            format!("at most {MAX_INGRESS} rules"),
        ));
    }
    for (i, r) in a.ingress.iter().enumerate() {
        if r.ports.len() > MAX_INGRESS_PORTS || r.ports.contains(&0) {
            return Err(invalid(
                "network.attachment.ingress.ports",
                format!("rule {i}: at most {MAX_INGRESS_PORTS} ports, each 1-65535"),
            ));
        }
    }
    Ok(())
}

/// `path` (a request's kernel, initrd or base disk) resolved, symlinks and `..` included, to a
/// regular file under one of `dirs`; the resolved path is what the VMM is given.
pub fn allowed_file(
    field: &'static str,
    path: &Path,
    dirs: &[PathBuf],
) -> Result<PathBuf, Invalid> {
    let refuse = |why: &str| {
        invalid(
            field,
            format!(
                "{} {why}; files must lie under {}",
                path.display(),
                if dirs.is_empty() {
                    "a configured image directory (none is configured)".to_string()
                } else {
                    dirs.iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ),
        )
    };
    if !path.is_absolute() {
        return Err(refuse("is not an absolute path"));
    }
    let real = path.canonicalize().map_err(|_| refuse("does not exist"))?;
    if !real.is_file() {
        return Err(refuse("is not a regular file"));
    }
    let inside = dirs
        .iter()
        .filter_map(|d| d.canonicalize().ok())
        .any(|d| real.starts_with(d));
    if !inside {
        return Err(refuse("is outside the allowed directories"));
    }
    Ok(real)
}

/// Writable-drive bytes a new VM may add: `asked` fits when `used + asked <= budget`.
pub fn disk_budget(used: u64, asked: u64, budget: u64) -> Result<(), Invalid> {
    if used.checked_add(asked).is_some_and(|total| total <= budget) {
        return Ok(());
    }
    Err(invalid(
        "writable_disk_bytes",
        format!(
            "{asked} bytes do not fit the node's writable-drive budget: {used} of {budget} bytes are in use"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::NetworkSpec;

    fn ok_spec() -> VmSpec {
        VmSpec {
            vcpu: 2,
            memory_mib: 512,
            base_disk: Some("/images/base.ext4".into()),
            image: None,
            writable_disk_bytes: Some(1 << 30),
            kernel: None,
            initrd: None,
            extra_boot_args: None,
            network: None,
            from_template: false,
            warm_paths: Vec::new(),
        }
    }

    fn field_of(s: VmSpec) -> &'static str {
        spec(&s).unwrap_err().field
    }

    #[test]
    fn uids_are_dns_labels() {
        assert!(valid_uid("a"));
        assert!(valid_uid("0a-b"));
        assert!(valid_uid(&"a".repeat(63)));
        for bad in ["", "-a", "A", "a_b", "a/b", "..", "a.b", &"a".repeat(64)] {
            assert!(!valid_uid(bad), "{bad:?}");
        }
    }

    #[test]
    fn each_bad_spec_names_its_field() {
        assert_eq!(spec(&ok_spec()), Ok(()));
        assert_eq!(
            field_of(VmSpec {
                vcpu: 0,
                ..ok_spec()
            }),
            "vcpu"
        );
        assert_eq!(
            field_of(VmSpec {
                vcpu: 3,
                ..ok_spec()
            }),
            "vcpu"
        );
        assert_eq!(
            field_of(VmSpec {
                vcpu: 34,
                ..ok_spec()
            }),
            "vcpu"
        );
        assert_eq!(
            field_of(VmSpec {
                memory_mib: 8,
                ..ok_spec()
            }),
            "memory_mib"
        );
        assert_eq!(
            field_of(VmSpec {
                base_disk: None,
                ..ok_spec()
            }),
            "base_disk"
        );
        assert_eq!(
            field_of(VmSpec {
                writable_disk_bytes: Some(0),
                ..ok_spec()
            }),
            "writable_disk_bytes"
        );
        assert_eq!(
            field_of(VmSpec {
                extra_boot_args: Some("a\nb".into()),
                ..ok_spec()
            }),
            "extra_boot_args"
        );
        assert_eq!(
            field_of(VmSpec {
                network: Some(NetworkSpec {
                    guest_mac: Some("06:00:0a:00:00".into()),
                    attachment: None,
                }),
                ..ok_spec()
            }),
            "network.guest_mac"
        );
        let warm = |paths: Vec<String>| {
            spec(&VmSpec {
                warm_paths: paths,
                ..ok_spec()
            })
        };
        assert_eq!(warm(vec!["/opt/actions-runner".into()]), Ok(()));
        for bad in [
            vec!["opt/actions-runner".into()],
            vec!["/opt".into(), "/opt/../etc".into()],
            vec![String::new()],
            vec!["/a".into(); imp_guest::protocol::WARM_MAX_PATHS + 1],
        ] {
            let e = warm(bad.clone()).unwrap_err();
            assert_eq!(e.field, "warm_paths", "{bad:?}: {e}");
        }
        assert!(
            warm(vec!["/ok".into(), "rel".into()])
                .unwrap_err()
                .message
                .starts_with("[1]: "),
        );
    }

    fn attached(edit: impl FnOnce(&mut NetworkAttachment)) -> Result<(), Invalid> {
        let mut a = NetworkAttachment {
            network_id: "uid-1".into(),
            network_name: "ci/runners".into(),
            address: "198.51.100.7/24".parse().unwrap(),
            gateway: "198.51.100.1".parse().unwrap(),
            dns: vec!["198.51.100.1".parse().unwrap()],
            mtu: Some(1500),
            nat: true,
            egress_interface: Some("eth0".into()),
            egress_allow: vec![],
            egress_deny: vec![],
            ingress: vec![],
        };
        edit(&mut a);
        spec(&VmSpec {
            network: Some(NetworkSpec {
                guest_mac: None,
                attachment: Some(a),
            }),
            ..ok_spec()
        })
    }

    #[test]
    fn each_bad_attachment_names_its_field() {
        assert_eq!(attached(|_| {}), Ok(()));
        let field = |edit: fn(&mut NetworkAttachment)| attached(edit).unwrap_err().field;
        assert_eq!(
            field(|a| a.network_id.clear()),
            "network.attachment.network_id"
        );
        assert_eq!(
            field(|a| a.gateway = "192.0.2.1".parse().unwrap()),
            "network.attachment.gateway"
        );
        assert_eq!(
            field(|a| a.gateway = "198.51.100.255".parse().unwrap()),
            "network.attachment.gateway"
        );
        for bad in ["198.51.100.1/24", "198.51.100.0/24", "198.51.100.255/24"] {
            let e = attached(|a| a.address = bad.parse().unwrap()).unwrap_err();
            assert_eq!(e.field, "network.attachment.address", "{bad}");
        }
        assert_eq!(
            field(|a| a.address = "198.51.100.1/31".parse().unwrap()),
            "network.attachment.address"
        );
        assert_eq!(field(|a| a.mtu = Some(67)), "network.attachment.mtu");
        assert_eq!(
            field(|a| a.dns = vec!["192.0.2.1".parse().unwrap(); 9]),
            "network.attachment.dns"
        );
        assert_eq!(
            field(|a| a.egress_interface = Some("much-too-long-name".into())),
            "network.attachment.egress_interface"
        );
        assert_eq!(
            field(|a| a.egress_interface = Some("a/b".into())),
            "network.attachment.egress_interface"
        );
        let rule = |ports: Vec<u16>| crate::api::Ingress {
            from: "192.0.2.0/24".parse().unwrap(),
            protocol: imp_api::IngressProtocol::Tcp,
            ports,
        };
        assert_eq!(attached(|a| a.ingress = vec![rule(vec![22, 8080])]), Ok(()));
        assert_eq!(
            attached(|a| a.ingress = vec![rule(vec![]), rule(vec![0])])
                .unwrap_err()
                .field,
            "network.attachment.ingress.ports"
        );
        assert_eq!(
            attached(|a| a.ingress = vec![rule(vec![]); 17])
                .unwrap_err()
                .field,
            "network.attachment.ingress"
        );
    }

    #[test]
    fn image_references_are_parsed() {
        let image: crate::rootfs::store::ImageSpec =
            serde_json::from_str(r#"{"base":"UPPER CASE::x"}"#).unwrap();
        let s = VmSpec {
            base_disk: None,
            image: Some(image),
            ..ok_spec()
        };
        assert_eq!(spec(&s).unwrap_err().field, "image.base");
    }

    #[test]
    fn host_paths_must_resolve_under_an_allowed_dir() {
        let root = tempfile::tempdir().unwrap();
        let images = root.path().join("images");
        std::fs::create_dir(&images).unwrap();
        let kernel = images.join("vmlinux");
        std::fs::write(&kernel, b"k").unwrap();
        let outside = root.path().join("secret");
        std::fs::write(&outside, b"s").unwrap();
        std::os::unix::fs::symlink(&outside, images.join("link")).unwrap();
        let dirs = [images.clone()];

        assert_eq!(
            allowed_file("kernel", &kernel, &dirs).unwrap(),
            kernel.canonicalize().unwrap()
        );
        for (path, why) in [
            (outside.clone(), "outside"),
            (images.join("../secret"), "outside"),
            (images.join("link"), "outside"),
            (images.join("missing"), "does not exist"),
            (images.clone(), "not a regular file"),
            (PathBuf::from("images/vmlinux"), "not an absolute path"),
        ] {
            let e = allowed_file("kernel", &path, &dirs).unwrap_err();
            assert_eq!(e.field, "kernel");
            assert!(e.message.contains(why), "{path:?}: {e}");
        }
        let none = allowed_file("base_disk", &kernel, &[]).unwrap_err();
        assert!(none.message.contains("none is configured"), "{none}");
    }

    #[test]
    fn disk_budget_counts_what_is_in_use() {
        assert_eq!(disk_budget(0, 10, 10), Ok(()));
        assert_eq!(disk_budget(4, 6, 10), Ok(()));
        let e = disk_budget(5, 6, 10).unwrap_err();
        assert_eq!(e.field, "writable_disk_bytes");
        assert!(e.message.contains("5 of 10"), "{e}");
        assert!(disk_budget(u64::MAX, 1, u64::MAX).is_err());
    }
}
