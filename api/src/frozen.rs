//! What a runner VM's one-time JIT config was minted for, and how anyone can check it later.
//!
//! A pool mints a JIT config for one VM built from its template. Whoever can patch ImpVMs could
//! otherwise wait for the mint and then re-point the VM at an image of their own: the agent would
//! boot it and hand it the pool's registration. Two layers hold the boot-relevant fields fixed:
//! - the CRD's CEL rules refuse changes to them once `spec.runnerConfigSecret` is set (the API
//!   server, for everyone but whoever bypasses admission);
//! - the pool writes [`boot_digest`] of the VM it minted for onto the JIT Secret
//!   ([`ANNOTATION_BOOT_DIGEST`](crate::names::ANNOTATION_BOOT_DIGEST)), where a namespace user
//!   without Secret RBAC cannot change it, and the agent compares it with the spec it boots
//!   before it reads the config (node/agent's binding rule).

use k8s_openapi::api::core::v1::LocalObjectReference;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::{ClassRef, ImpVMSpec, NetworkRef, RunnerUser};

/// The spec fields frozen once a runner config is minted, in the order the digest covers them.
/// The CRD's CEL rules on `ImpVMSpec` name the same fields.
pub const FROZEN_FIELDS: [&str; 6] = [
    "image",
    "runnerImage",
    "classRef",
    "networkRef",
    "imagePullSecrets",
    "runnerUser",
];

/// The boot-relevant part of a spec. Serialized with a fixed field order and no optional field
/// skipped, so an unset field and an empty one cannot collide with another layout.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Boot<'a> {
    image: &'a str,
    runner_image: Option<&'a str>,
    class_ref: &'a ClassRef,
    network_ref: Option<&'a NetworkRef>,
    image_pull_secrets: &'a [LocalObjectReference],
    /// Skipped when unset, so the digests of specs without it stay what they were before the
    /// field existed (a JSON key cannot collide with another field's).
    #[serde(skip_serializing_if = "Option::is_none")]
    runner_user: Option<&'a RunnerUser>,
}

/// `sha256:<hex>` over the frozen fields ([`FROZEN_FIELDS`]) of `spec`. Scheduling fields,
/// `runnerConfigSecret` and everything else stay out: they may change after the mint.
pub fn boot_digest(spec: &ImpVMSpec) -> String {
    let boot = Boot {
        image: &spec.image,
        runner_image: spec.runner_image.as_deref(),
        class_ref: &spec.class_ref,
        network_ref: spec.network_ref.as_ref(),
        image_pull_secrets: &spec.image_pull_secrets,
        runner_user: spec.runner_user.as_ref(),
    };
    // Serializing plain strings and references cannot fail.
    let json = serde_json::to_vec(&boot).unwrap_or_default();
    format!("sha256:{}", hex::encode(Sha256::digest(json)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Lifecycle, PullPolicy};

    fn spec() -> ImpVMSpec {
        serde_json::from_value(serde_json::json!({
            "classRef": {"name": "runner"}, "image": "ghcr.io/acme/base:1",
            "runnerImage": "ghcr.io/acme/runner:2", "networkRef": {"name": "ci"},
            "imagePullSecrets": [{"name": "pull"}], "lifecycle": "ephemeral",
        }))
        .unwrap()
    }

    #[test]
    fn the_digest_is_stable_and_names_its_algorithm() {
        let d = boot_digest(&spec());
        assert_eq!(d, boot_digest(&spec()));
        assert!(d.starts_with("sha256:") && d.len() == 7 + 64, "{d}");
    }

    #[test]
    fn each_frozen_field_moves_the_digest() {
        let base = boot_digest(&spec());
        type Change = fn(&mut ImpVMSpec);
        let changes: [(&str, Change); 10] = [
            ("image", |s| s.image = "evil.example/own:1".into()),
            ("runnerImage", |s| s.runner_image = Some("evil:1".into())),
            ("runnerImage unset", |s| s.runner_image = None),
            ("classRef", |s| s.class_ref.name = "big".into()),
            ("networkRef", |s| {
                s.network_ref.as_mut().unwrap().name = "other".into()
            }),
            ("networkRef unset", |s| s.network_ref = None),
            ("imagePullSecrets", |s| {
                s.image_pull_secrets[0].name = "theirs".into()
            }),
            ("imagePullSecrets empty", |s| s.image_pull_secrets.clear()),
            ("runnerUser runAsRoot", |s| {
                s.runner_user = Some(crate::RunnerUser {
                    run_as_root: Some(true),
                    ..Default::default()
                })
            }),
            ("runnerUser uid", |s| {
                s.runner_user = Some(crate::RunnerUser {
                    uid: Some(0),
                    ..Default::default()
                })
            }),
        ];
        for (what, change) in changes {
            let mut s = spec();
            change(&mut s);
            assert_ne!(boot_digest(&s), base, "{what}");
        }
    }

    #[test]
    fn the_crd_freezes_every_field_the_digest_covers() {
        use kube::CustomResourceExt;
        let crd = serde_json::to_value(crate::ImpVM::crd()).unwrap();
        let rules = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
            ["x-kubernetes-validations"];
        for field in FROZEN_FIELDS {
            let rule = rules
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["fieldPath"] == format!(".{field}"))
                .unwrap_or_else(|| panic!("no CEL rule for {field}: {rules}"));
            let text = rule["rule"].as_str().unwrap();
            assert!(
                text.contains("has(oldSelf.runnerConfigSecret)")
                    && text.contains(&format!("self.{field} == oldSelf.{field}")),
                "{field}: {text}"
            );
        }
    }

    #[test]
    fn fields_outside_the_boot_leave_it_alone() {
        let base = boot_digest(&spec());
        let mut s = spec();
        s.node_name = Some("node-a".into());
        s.runner_config_secret = Some("impvm-x-jit".into());
        s.image_pull_policy = Some(PullPolicy::Always);
        s.lifecycle = Lifecycle::Ephemeral;
        s.expire_after = Some("1h".parse().unwrap());
        assert_eq!(boot_digest(&s), base);
    }

    #[test]
    fn an_unset_runner_user_keeps_the_digest_of_specs_from_before_the_field() {
        // The digest of spec() as computed before runnerUser existed: JIT Secrets minted then
        // still bind after an upgrade.
        assert_eq!(
            boot_digest(&spec()),
            "sha256:7f9a6fd7b8409e5aa3f91336fa3a51d76e0386c11c50ebe958b89d77760b3588"
        );
    }

    #[test]
    fn moving_a_value_between_fields_moves_the_digest() {
        // image "a" + runnerImage "b" must not equal image "b" + runnerImage "a".
        let mut a = spec();
        a.image = "x".into();
        a.runner_image = Some("y".into());
        let mut b = spec();
        b.image = "y".into();
        b.runner_image = Some("x".into());
        assert_ne!(boot_digest(&a), boot_digest(&b));
    }
}
