//! ImpVM + ImpVMClass (+ image pull Secrets, + ImpNetwork) -> the runtime's `VmSpec`, pure.

use imp_api::names::ANNOTATION_IP_ALLOCATION;
use imp_api::{ImpNetwork, ImpVM, ImpVMClassSpec, PullPolicy, RunnerVmTemplateSpec, StartFrom};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;

use imp_common::SecretString;

use imp_runtime_api::api::{NetworkAttachment, NetworkSpec, VmSpec};
use imp_runtime_api::auth::PullCredentials;
use imp_runtime_api::image::ImageSpec;
use imp_runtime_api::network::VmNetwork;

/// Key of a `kubernetes.io/dockerconfigjson` Secret.
pub const DOCKERCONFIGJSON_KEY: &str = ".dockerconfigjson";

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("image pull Secret {0} has no {DOCKERCONFIGJSON_KEY} key")]
    NoDockerConfig(String),
    #[error("image pull Secret {0}: {DOCKERCONFIGJSON_KEY} is not UTF-8")]
    NotUtf8(String),
    #[error("annotation {ANNOTATION_IP_ALLOCATION}={0:?} is not an IPv4 ADDR/PREFIX")]
    BadAllocation(String),
    #[error(
        "annotation {ANNOTATION_IP_ALLOCATION}={allocation} does not lie in ImpNetwork {network}'s subnet {subnet}"
    )]
    AllocationOutsideSubnet {
        allocation: String,
        network: String,
        subnet: String,
    },
    #[error("ImpNetwork {network}: {message}")]
    BadNetwork { network: String, message: String },
}

/// Where a VM with a `spec.networkRef` stands with its address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allocation {
    /// No networkRef: no interface.
    NoNetwork,
    /// The operator's IPAM has not written the annotation yet: no runtime PUT until it has.
    Pending,
    /// The VM's address with the subnet's prefix.
    Allocated(ipnet::Ipv4Net),
}

/// The VM's allocation annotation, read.
pub fn allocation(vm: &ImpVM) -> Result<Allocation, SpecError> {
    if vm.spec.network_ref.is_none() {
        return Ok(Allocation::NoNetwork);
    }
    match vm.annotations().get(ANNOTATION_IP_ALLOCATION) {
        None => Ok(Allocation::Pending),
        Some(v) => v
            .parse()
            .map(Allocation::Allocated)
            .map_err(|_| SpecError::BadAllocation(v.clone())),
    }
}

/// The data plane input for a VM with `address` on `net` (its ImpNetwork, as read now).
pub fn attachment(
    net: &ImpNetwork,
    address: ipnet::Ipv4Net,
) -> Result<NetworkAttachment, SpecError> {
    let name = format!("{}/{}", net.namespace().unwrap_or_default(), net.name_any());
    let bad = |message: String| SpecError::BadNetwork {
        network: name.clone(),
        message,
    };
    let uid = net.uid().ok_or_else(|| bad("has no metadata.uid".into()))?;
    let n = VmNetwork::from_spec(&uid, &net.spec).map_err(|e| bad(e.to_string()))?;
    if address.trunc() != n.subnet {
        return Err(SpecError::AllocationOutsideSubnet {
            allocation: address.to_string(),
            network: name,
            subnet: n.subnet.to_string(),
        });
    }
    let dns = net
        .spec
        .dns
        .iter()
        .map(|d| {
            d.parse()
                .map_err(|_| bad(format!("spec.dns {d:?} is not an IPv4 address")))
        })
        .collect::<Result<_, _>>()?;
    Ok(NetworkAttachment {
        network_id: uid,
        network_name: name,
        address,
        gateway: n.gateway,
        dns,
        // ImpNetwork has no MTU field: the guest keeps its default (1500).
        mtu: None,
        nat: n.nat,
        egress_interface: n.egress_interface,
        egress_allow: n.egress_allow,
        egress_deny: n.egress_deny,
        ingress: n.ingress,
    })
}

/// The spec imp-runtime gets for `vm` of class `class`. `pull_secrets` are the Secrets named by
/// `spec.imagePullSecrets`, in order; the first one is used (one registry credential per VM).
/// `network`: the VM's [`attachment`] when it has a networkRef.
/// `from_template` follows `spec.startFrom` (a standby pool's VMs: `Template`); such a VM also
/// carries `warm_paths` (the agent's `--template-warm-path`s), which key its template.
pub fn vm_spec(
    vm: &ImpVM,
    class: &ImpVMClassSpec,
    pull_secrets: &[Secret],
    network: Option<NetworkAttachment>,
    warm_paths: &[String],
) -> Result<VmSpec, SpecError> {
    let image = Image {
        base: &vm.spec.image,
        runner: vm.spec.runner_image.as_deref(),
        pull_policy: vm.spec.image_pull_policy,
    };
    let mut spec = spec_of(image, class, pull_secrets)?;
    spec.network = network.map(|a| NetworkSpec {
        guest_mac: None,
        attachment: Some(a),
    });
    spec.from_template = vm.spec.start_from() == StartFrom::Template;
    if spec.from_template {
        spec.warm_paths = warm_paths.to_vec();
    }
    Ok(spec)
}

/// The spec of the snapshot template a standby pool's clones start from on this node: what
/// [`vm_spec`] gives each of the pool's VMs, less what makes one VM itself. A NIC when the pool's
/// VMs have a network, but no attachment (address, MAC) and no hostname: the template is shared
/// by every clone, which takes its own identity when restored (docs/runner-pool.md). Its
/// `warm_paths` are read into the template's page cache before its snapshot.
pub fn template_spec(
    t: &RunnerVmTemplateSpec,
    class: &ImpVMClassSpec,
    pull_secrets: &[Secret],
    warm_paths: &[String],
) -> Result<VmSpec, SpecError> {
    let image = Image {
        base: &t.image,
        runner: t.runner_image.as_deref(),
        pull_policy: t.image_pull_policy,
    };
    let mut spec = spec_of(image, class, pull_secrets)?;
    spec.network = t.network_ref.as_ref().map(|_| NetworkSpec {
        guest_mac: None,
        attachment: None,
    });
    spec.from_template = true;
    spec.warm_paths = warm_paths.to_vec();
    Ok(spec)
}

/// The images of a VM.
struct Image<'a> {
    base: &'a str,
    runner: Option<&'a str>,
    pull_policy: Option<PullPolicy>,
}

/// Size, images and disk: what a VM and its pool's template share. No network.
fn spec_of(
    image: Image<'_>,
    class: &ImpVMClassSpec,
    pull_secrets: &[Secret],
) -> Result<VmSpec, SpecError> {
    Ok(VmSpec {
        vcpu: class.vcpu,
        memory_mib: u64::from(class.memory_mib),
        base_disk: None,
        image: Some(ImageSpec {
            base: image.base.to_owned(),
            runner: image.runner.map(str::to_owned),
            credentials: pull_secrets.first().map(credentials).transpose()?,
            pull_policy: image.pull_policy,
        }),
        writable_disk_bytes: Some(u64::from(class.disk_gib()) << 30),
        kernel: None,
        initrd: None,
        extra_boot_args: None,
        network: None,
        from_template: false,
        warm_paths: Vec::new(),
    })
}

pub fn credentials(secret: &Secret) -> Result<PullCredentials, SpecError> {
    let name = secret.metadata.name.clone().unwrap_or_default();
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(DOCKERCONFIGJSON_KEY))
        .map(|b| b.0.clone())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(DOCKERCONFIGJSON_KEY))
                .map(|s| s.clone().into_bytes())
        })
        .ok_or_else(|| SpecError::NoDockerConfig(name.clone()))?;
    let json = String::from_utf8(bytes).map_err(|_| SpecError::NotUtf8(name))?;
    Ok(PullCredentials::Dockerconfigjson(SecretString::from(json)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_common::ExposeSecret;
    use k8s_openapi::ByteString;
    use serde_json::json;

    fn vm(extra: serde_json::Value) -> ImpVM {
        let mut spec = json!({"classRef": {"name": "c"}, "image": "reg.example/base:1", "lifecycle": "ephemeral"});
        spec.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value(json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
            "metadata": {"name": "v", "namespace": "n"}, "spec": spec}))
        .unwrap()
    }

    fn class(disk: Option<u32>) -> ImpVMClassSpec {
        ImpVMClassSpec {
            vcpu: 2,
            memory_mib: 2048,
            disk_gib: disk,
            probes: None,
            restart_policy: None,
        }
    }

    fn pull_secret(key: &str, value: &str) -> Secret {
        Secret {
            metadata: kube::api::ObjectMeta {
                name: Some("pull".into()),
                ..Default::default()
            },
            data: Some([(key.to_owned(), ByteString(value.as_bytes().to_vec()))].into()),
            ..Default::default()
        }
    }

    #[test]
    fn sizes_and_images_come_from_class_and_vm() {
        let s = vm_spec(
            &vm(json!({"runnerImage": "reg.example/runner:2"})),
            &class(Some(10)),
            &[],
            None,
            &[],
        )
        .unwrap();
        assert_eq!(s.vcpu, 2);
        assert_eq!(s.memory_mib, 2048);
        assert_eq!(s.writable_disk_bytes, Some(10 << 30));
        let image = s.image.unwrap();
        assert_eq!(image.base, "reg.example/base:1");
        assert_eq!(image.runner.as_deref(), Some("reg.example/runner:2"));
        assert!(image.credentials.is_none());
        assert!(s.base_disk.is_none());
        assert!(s.network.is_none());
    }

    #[test]
    fn start_from_template_asks_the_runtime_for_a_clone() {
        let boot = vm_spec(&vm(json!({})), &class(None), &[], None, &[]).unwrap();
        assert!(!boot.from_template);
        let explicit = vm_spec(
            &vm(json!({"startFrom": "Boot"})),
            &class(None),
            &[],
            None,
            &[],
        );
        assert!(!explicit.unwrap().from_template);
        let clone = vm_spec(
            &vm(json!({"startFrom": "Template"})),
            &class(None),
            &[],
            None,
            &[],
        );
        assert!(clone.unwrap().from_template);
    }

    #[test]
    fn a_pool_s_template_spec_is_its_vms_spec_without_their_identity() {
        let t: RunnerVmTemplateSpec = serde_json::from_value(json!({
            "classRef": {"name": "c"}, "image": "reg.example/base:1",
            "runnerImage": "reg.example/runner:2", "imagePullPolicy": "Always",
            "networkRef": {"name": "runners"}}))
        .unwrap();
        let cfg = r#"{"auths":{}}"#;
        let pull = [pull_secret(DOCKERCONFIGJSON_KEY, cfg)];
        let warm = ["/opt/actions-runner".to_string()];
        let template = template_spec(&t, &class(Some(10)), &pull, &warm).unwrap();
        // One of the pool's VMs, with its address.
        let net = network(json!({"subnet": "198.51.100.0/24", "gateway": "198.51.100.1"}));
        let a = attachment(&net, "198.51.100.7/24".parse().unwrap()).unwrap();
        let mut one = annotated(Some("198.51.100.7/24"));
        one.spec.runner_image = t.runner_image.clone();
        one.spec.image_pull_policy = t.image_pull_policy;
        one.spec.start_from = Some(StartFrom::Template);
        let vm = vm_spec(&one, &class(Some(10)), &pull, Some(a), &warm).unwrap();
        assert_eq!(
            template.network,
            Some(NetworkSpec {
                guest_mac: None,
                attachment: None
            }),
            "a NIC, no address, no MAC"
        );
        let mut vm_less_identity = vm.clone();
        vm_less_identity.network.as_mut().unwrap().attachment = None;
        // The same spec, warm paths included: the same template key at the runtime.
        assert_eq!(template, vm_less_identity);
        assert!(template.from_template);
        assert_eq!(template.warm_paths, warm);
        // A VM that boots warms nothing (the paths would only make its spec differ).
        one.spec.start_from = None;
        let boot = vm_spec(&one, &class(Some(10)), &pull, None, &warm).unwrap();
        assert!(boot.warm_paths.is_empty());
        // Without a networkRef, no NIC.
        let mut bare = t.clone();
        bare.network_ref = None;
        assert!(
            template_spec(&bare, &class(None), &[], &[])
                .unwrap()
                .network
                .is_none()
        );
    }

    #[test]
    fn disk_defaults_to_the_class_default() {
        let s = vm_spec(&vm(json!({})), &class(None), &[], None, &[]).unwrap();
        assert_eq!(s.writable_disk_bytes, Some(4 << 30));
        assert!(s.image.unwrap().runner.is_none());
    }

    fn network(spec: serde_json::Value) -> ImpNetwork {
        serde_json::from_value(
            json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpNetwork",
            "metadata": {"name": "runners", "namespace": "n", "uid": "net-uid-1"}, "spec": spec}),
        )
        .unwrap()
    }

    fn annotated(value: Option<&str>) -> ImpVM {
        let mut v = vm(json!({"networkRef": {"name": "runners"}}));
        if let Some(value) = value {
            v.annotations_mut()
                .insert(ANNOTATION_IP_ALLOCATION.into(), value.into());
        }
        v
    }

    #[test]
    fn a_network_ref_waits_for_its_allocation_annotation() {
        assert_eq!(allocation(&vm(json!({}))), Ok(Allocation::NoNetwork));
        assert_eq!(allocation(&annotated(None)), Ok(Allocation::Pending));
        assert_eq!(
            allocation(&annotated(Some("198.51.100.7/24"))),
            Ok(Allocation::Allocated("198.51.100.7/24".parse().unwrap()))
        );
        for bad in ["198.51.100.7", "2001:db8::7/64", "x"] {
            assert_eq!(
                allocation(&annotated(Some(bad))),
                Err(SpecError::BadAllocation(bad.into()))
            );
        }
    }

    #[test]
    fn attachment_carries_the_network_and_the_allocated_address() {
        let net = network(
            json!({"subnet": "198.51.100.0/24", "gateway": "198.51.100.1",
            "dns": ["198.51.100.1"], "nat": {"enabled": true, "egressInterface": "up0"},
            "egress": {"deny": ["10.0.0.0/8"]}}),
        );
        let a = attachment(&net, "198.51.100.7/24".parse().unwrap()).unwrap();
        assert_eq!(
            a,
            NetworkAttachment {
                network_id: "net-uid-1".into(),
                network_name: "n/runners".into(),
                address: "198.51.100.7/24".parse().unwrap(),
                gateway: "198.51.100.1".parse().unwrap(),
                dns: vec!["198.51.100.1".parse().unwrap()],
                mtu: None,
                nat: true,
                egress_interface: Some("up0".into()),
                egress_allow: vec![],
                egress_deny: vec!["10.0.0.0/8".parse().unwrap()],
                ingress: vec![],
            }
        );
        let s = vm_spec(&annotated(None), &class(None), &[], Some(a.clone()), &[]).unwrap();
        assert_eq!(
            s.network,
            Some(NetworkSpec {
                guest_mac: None,
                attachment: Some(a)
            })
        );
    }

    #[test]
    fn attachment_refuses_an_address_outside_the_subnet_and_a_bad_network() {
        let net = network(json!({"subnet": "198.51.100.0/24", "gateway": "198.51.100.1"}));
        let e = attachment(&net, "192.0.2.7/24".parse().unwrap()).unwrap_err();
        assert!(
            matches!(&e, SpecError::AllocationOutsideSubnet { subnet, .. } if subnet == "198.51.100.0/24"),
            "{e}"
        );
        let v6dns = network(
            json!({"subnet": "198.51.100.0/24", "gateway": "198.51.100.1",
            "dns": ["2001:db8::53"]}),
        );
        let e = attachment(&v6dns, "198.51.100.7/24".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("spec.dns"), "{e}");
        let v6 = network(json!({"subnet": "2001:db8::/64", "gateway": "2001:db8::1"}));
        let e = attachment(&v6, "198.51.100.7/24".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("spec.subnet"), "{e}");
    }

    #[test]
    fn pull_secret_becomes_credentials_and_never_shows_in_debug() {
        let cfg = r#"{"auths":{"reg.example":{"auth":"dXNlcjpwYXNzd29yZC1zM2NyM3Q="}}}"#;
        let s = vm_spec(
            &vm(json!({})),
            &class(None),
            &[pull_secret(DOCKERCONFIGJSON_KEY, cfg)],
            None,
            &[],
        )
        .unwrap();
        let creds = s.image.as_ref().unwrap().credentials.as_ref().unwrap();
        match creds {
            PullCredentials::Dockerconfigjson(j) => assert_eq!(j.expose_secret(), cfg),
            other => panic!("{other:?}"),
        }
        assert!(!format!("{s:?}").contains("dXNlcjpw"));
    }

    #[test]
    fn pull_secret_without_the_key_is_an_error() {
        assert_eq!(
            vm_spec(
                &vm(json!({})),
                &class(None),
                &[pull_secret("other", "x")],
                None,
                &[]
            )
            .unwrap_err(),
            SpecError::NoDockerConfig("pull".into())
        );
    }
}
