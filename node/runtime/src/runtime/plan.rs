//! The pure half of a VM start: what the VMM is told (kernel command line, drives in order,
//! NICs with their MACs, vsock), computed from the spec and the host facts the runtime has
//! gathered. Backends translate a [`VmPlan`] into their own configuration calls or arguments.

use std::path::PathBuf;

use crate::api::{Backend, VmSpec};
use crate::network;
use crate::vmm::plan::{DrivePlan, NicPlan, VmPlan};

/// Guest CID of every VM: each VM has its own vsock device, so CIDs need not differ.
pub const GUEST_CID: u32 = 3;
/// Firecracker appends `root=/dev/vda ro` for the read-only root drive itself; imp-guest is
/// PID 1 and halts by rebooting, which ends the VMM process. No PCI: virtio-mmio devices.
pub const DEFAULT_BOOT_ARGS: &str =
    "console=ttyS0 reboot=k panic=1 pci=off init=/sbin/imp-guest imp.halt=reboot";
/// QEMU's devices are virtio-pci; the QEMU backend adds the root (`root=` or `imp.lower=`).
pub const QEMU_BOOT_ARGS: &str =
    "console=ttyS0 reboot=k panic=1 init=/sbin/imp-guest imp.halt=reboot";

/// The kernel command line every VM of `backend` starts from.
pub fn default_boot_args(backend: Backend) -> &'static str {
    match backend {
        Backend::Firecracker => DEFAULT_BOOT_ARGS,
        Backend::Qemu => QEMU_BOOT_ARGS,
    }
}
/// Where the guest finds its writable drive (the second virtio drive).
const OVERLAY_ARG: &str = "imp.overlay=/dev/vdb";

/// Host facts of one VM start, known once disks and the TAP exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFacts {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub base_disk: PathBuf,
    pub writable_disk: Option<PathBuf>,
    pub tap: Option<String>,
    pub vsock: PathBuf,
}

pub fn vm_plan(uid: &str, spec: &VmSpec, host: &HostFacts, backend: Backend) -> VmPlan {
    let mut boot_args = default_boot_args(backend).to_string();
    if host.writable_disk.is_some() {
        boot_args.push(' ');
        boot_args.push_str(OVERLAY_ARG);
    }
    if let Some(a) = spec.network.as_ref().and_then(|n| n.attachment.as_ref()) {
        boot_args.push(' ');
        boot_args.push_str(&network::boot_args(a));
    }
    if let Some(extra) = &spec.extra_boot_args {
        boot_args.push(' ');
        boot_args.push_str(extra);
    }
    let mut drives = vec![DrivePlan {
        id: "rootfs",
        path: host.base_disk.clone(),
        read_only: true,
        root: true,
    }];
    if let Some(w) = &host.writable_disk {
        drives.push(DrivePlan {
            id: "writable",
            path: w.clone(),
            read_only: false,
            root: false,
        });
    }
    let nics = host
        .tap
        .iter()
        .map(|t| NicPlan {
            id: "eth0",
            tap: t.clone(),
            mac: network::format_mac(&guest_mac(uid, spec)),
        })
        .collect();
    VmPlan {
        vcpu: spec.vcpu,
        memory_mib: spec.memory_mib,
        kernel: host.kernel.clone(),
        initrd: host.initrd.clone(),
        boot_args,
        drives,
        nics,
        guest_cid: GUEST_CID,
        vsock: host.vsock.clone(),
    }
}

/// The guest NIC's MAC: the spec's (checked by `validate`), else one derived from the VM uid,
/// the same one the bridge's anti-spoofing rules expect (docs/network.md).
pub fn guest_mac(uid: &str, spec: &VmSpec) -> [u8; 6] {
    spec.network
        .as_ref()
        .and_then(|n| n.guest_mac.as_deref())
        .and_then(network::parse_mac)
        .unwrap_or_else(|| network::vm_mac(uid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::NetworkSpec;

    fn spec() -> VmSpec {
        VmSpec {
            vcpu: 2,
            memory_mib: 512,
            base_disk: Some("/images/base.ext4".into()),
            image: None,
            writable_disk_bytes: None,
            kernel: None,
            initrd: None,
            extra_boot_args: None,
            network: None,
            from_template: false,
            warm_paths: Vec::new(),
        }
    }

    fn host() -> HostFacts {
        HostFacts {
            kernel: "/images/vmlinux".into(),
            initrd: None,
            base_disk: "/cache/abc.ext4".into(),
            writable_disk: None,
            tap: None,
            vsock: "/vms/a/vsock.sock".into(),
        }
    }

    #[test]
    fn bare_vm_boots_the_default_command_line_from_one_read_only_root() {
        let p = vm_plan("a", &spec(), &host(), Backend::Firecracker);
        assert_eq!(p.boot_args, DEFAULT_BOOT_ARGS);
        assert_eq!(
            p.drives,
            vec![DrivePlan {
                id: "rootfs",
                path: "/cache/abc.ext4".into(),
                read_only: true,
                root: true
            }]
        );
        assert!(p.nics.is_empty());
        assert_eq!((p.vcpu, p.memory_mib, p.guest_cid), (2, 512, GUEST_CID));
        assert_eq!(p.vsock, PathBuf::from("/vms/a/vsock.sock"));
    }

    #[test]
    fn writable_drive_is_vdb_and_named_on_the_command_line_before_extra_args() {
        let mut s = spec();
        s.extra_boot_args = Some("imp.hostname=runner-1".into());
        let h = HostFacts {
            writable_disk: Some("/vms/a/writable.img".into()),
            ..host()
        };
        let p = vm_plan("a", &s, &h, Backend::Firecracker);
        assert_eq!(
            p.boot_args,
            format!("{DEFAULT_BOOT_ARGS} imp.overlay=/dev/vdb imp.hostname=runner-1")
        );
        assert_eq!(p.drives.len(), 2);
        assert_eq!(p.drives[1].id, "writable");
        assert!(!p.drives[1].read_only && !p.drives[1].root);
    }

    #[test]
    fn nic_takes_the_spec_mac_or_the_one_derived_from_the_vm_uid() {
        let mut s = spec();
        s.network = Some(NetworkSpec {
            guest_mac: None,
            attachment: None,
        });
        let h = HostFacts {
            tap: Some("imp0012abcdef".into()),
            ..host()
        };
        let p = vm_plan("vm-1", &s, &h, Backend::Firecracker);
        assert_eq!(p.nics[0].mac, network::format_mac(&network::vm_mac("vm-1")));
        assert_eq!(p.boot_args, DEFAULT_BOOT_ARGS, "a bare TAP adds no words");
        s.network.as_mut().unwrap().guest_mac = Some("06:00:0a:00:00:02".into());
        let p = vm_plan("vm-1", &s, &h, Backend::Firecracker);
        assert_eq!(
            p.nics,
            vec![NicPlan {
                id: "eth0",
                tap: "imp0012abcdef".into(),
                mac: "06:00:0a:00:00:02".into()
            }]
        );
        assert_eq!(guest_mac("vm-1", &s), [6, 0, 0xa, 0, 0, 2]);
    }

    #[test]
    fn attached_vm_gets_imp_net_and_imp_dns_after_the_overlay_and_before_extra_args() {
        let mut s = spec();
        s.extra_boot_args = Some("imp.hostname=r".into());
        s.network = Some(NetworkSpec {
            guest_mac: None,
            attachment: Some(crate::api::NetworkAttachment {
                network_id: "net-uid".into(),
                network_name: "ci/runners".into(),
                address: "198.51.100.7/24".parse().unwrap(),
                gateway: "198.51.100.1".parse().unwrap(),
                dns: vec![
                    "198.51.100.1".parse().unwrap(),
                    "192.0.2.53".parse().unwrap(),
                ],
                mtu: Some(1400),
                nat: true,
                egress_interface: None,
                egress_allow: vec![],
                egress_deny: vec![],
                ingress: vec![],
            }),
        });
        let h = HostFacts {
            writable_disk: Some("/vms/a/writable.img".into()),
            tap: Some("imp0012abcdef".into()),
            ..host()
        };
        let p = vm_plan("a", &s, &h, Backend::Qemu);
        assert_eq!(
            p.boot_args,
            format!(
                "{QEMU_BOOT_ARGS} imp.overlay=/dev/vdb imp.net=198.51.100.7/24,198.51.100.1,1400 \
                 imp.dns=198.51.100.1,192.0.2.53 imp.hostname=r"
            )
        );
        // What the guest's own parser makes of it.
        let guest = imp_guest::pid1::cmdline::parse(&p.boot_args).unwrap();
        let net = guest.net.unwrap();
        assert_eq!(
            net.address,
            "198.51.100.7".parse::<std::net::Ipv4Addr>().unwrap()
        );
        assert_eq!((net.prefix, net.mtu), (24, Some(1400)));
    }

    #[test]
    fn qemu_vms_boot_with_pci_and_the_same_guest_arguments() {
        let p = vm_plan("a", &spec(), &host(), Backend::Qemu);
        assert!(!p.boot_args.contains("pci=off"), "{}", p.boot_args);
        assert!(p.boot_args.contains("init=/sbin/imp-guest imp.halt=reboot"));
        assert_eq!(
            p.drives,
            vm_plan("a", &spec(), &host(), Backend::Firecracker).drives
        );
    }
}
