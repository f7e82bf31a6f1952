//! ImpVM + ImpVMClass (+ image pull Secrets) -> the runtime's `VmSpec`, pure.

use imp_api::{ImpVM, ImpVMClassSpec};
use k8s_openapi::api::core::v1::Secret;

use imp_common::SecretString;

use crate::api::{NetworkSpec, VmSpec};
use crate::rootfs::auth::PullCredentials;
use crate::rootfs::store::ImageSpec;

/// Key of a `kubernetes.io/dockerconfigjson` Secret.
pub const DOCKERCONFIGJSON_KEY: &str = ".dockerconfigjson";

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("image pull Secret {0} has no {DOCKERCONFIGJSON_KEY} key")]
    NoDockerConfig(String),
    #[error("image pull Secret {0}: {DOCKERCONFIGJSON_KEY} is not UTF-8")]
    NotUtf8(String),
}

/// The spec imp-runtime gets for `vm` of class `class`. `pull_secrets` are the Secrets named by
/// `spec.imagePullSecrets`, in order; the first one is used (one registry credential per VM).
pub fn vm_spec(
    vm: &ImpVM,
    class: &ImpVMClassSpec,
    pull_secrets: &[Secret],
) -> Result<VmSpec, SpecError> {
    Ok(VmSpec {
        vcpu: class.vcpu,
        memory_mib: u64::from(class.memory_mib),
        base_disk: None,
        image: Some(ImageSpec {
            base: vm.spec.image.clone(),
            runner: vm.spec.runner_image.clone(),
            credentials: pull_secrets.first().map(credentials).transpose()?,
        }),
        writable_disk_bytes: Some(u64::from(class.disk_gib()) << 30),
        kernel: None,
        initrd: None,
        extra_boot_args: None,
        network: vm
            .spec
            .network_ref
            .as_ref()
            .map(|_| NetworkSpec { guest_mac: None }),
    })
}

fn credentials(secret: &Secret) -> Result<PullCredentials, SpecError> {
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
    fn disk_defaults_to_the_class_default() {
        let s = vm_spec(&vm(json!({})), &class(None), &[]).unwrap();
        assert_eq!(s.writable_disk_bytes, Some(4 << 30));
        assert!(s.image.unwrap().runner.is_none());
    }

    #[test]
    fn network_ref_asks_for_an_interface() {
        let s = vm_spec(
            &vm(json!({"networkRef": {"name": "runners"}})),
            &class(None),
            &[],
        )
        .unwrap();
        assert_eq!(s.network, Some(NetworkSpec { guest_mac: None }));
    }

    #[test]
    fn pull_secret_becomes_credentials_and_never_shows_in_debug() {
        let cfg = r#"{"auths":{"reg.example":{"auth":"dXNlcjpwYXNzd29yZC1zM2NyM3Q="}}}"#;
        let s = vm_spec(
            &vm(json!({})),
            &class(None),
            &[pull_secret(DOCKERCONFIGJSON_KEY, cfg)],
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
            vm_spec(&vm(json!({})), &class(None), &[pull_secret("other", "x")]).unwrap_err(),
            SpecError::NoDockerConfig("pull".into())
        );
    }
}
