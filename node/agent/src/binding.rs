//! The binding rule of the runner handoff, pure: a JIT config is handed only to the VM it was
//! minted for (docs/agent.md "Binding rule").
//!
//! `spec.runnerConfigSecret` is only a name, and anyone who can create an ImpVM can write any name
//! there. What cannot be forged without Secret RBAC is the Secret itself: the pool mints it with
//! the VM as its controlling owner and Imp's JIT label. So the agent checks, before it reads the
//! config out of the Secret: the VM is controlled by an ImpVMRunnerPool, the Secret carries the
//! JIT label, and the Secret's controlling owner is this very VM (by uid: a name can be reused).
//!
//! And the VM must still be what the config was minted for: the pool writes the boot digest of
//! the VM's frozen fields onto the Secret (`imp_api::frozen`), and the agent compares it with the
//! spec it boots (before the PUT) and with the spec it hands the config to (after the Secret
//! read). The CRD's CEL rules refuse such changes; this holds where admission was bypassed.

use std::collections::BTreeMap;

use imp_api::names::{ANNOTATION_BOOT_DIGEST, LABEL_SECRET_KIND, SECRET_KIND_JIT, reason};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use imp_api::ImpVM;

/// Why a Secret is not handed to a VM. Each maps to a reason of its own.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unbound {
    #[error("the VM is not controlled by an ImpVMRunnerPool; no runner config is handed to it")]
    VmNotPooled,
    #[error("Secret {secret} does not carry the label {LABEL_SECRET_KIND}={SECRET_KIND_JIT}")]
    NotJit { secret: String },
    #[error("Secret {secret} is not controlled by this VM (uid {vm_uid})")]
    NotOwned { secret: String, vm_uid: String },
    #[error(
        "the VM's frozen fields (image, runnerImage, classRef, networkRef, imagePullSecrets) differ \
         from what Secret {secret}'s runner config was minted for (minted {minted}, now {now})"
    )]
    Changed {
        secret: String,
        minted: String,
        now: String,
    },
}

impl Unbound {
    pub fn reason(&self) -> &'static str {
        match self {
            Unbound::VmNotPooled => reason::RUNNER_VM_NOT_POOLED,
            Unbound::NotJit { .. } => reason::RUNNER_CONFIG_NOT_JIT,
            Unbound::NotOwned { .. } => reason::RUNNER_CONFIG_NOT_OWNED,
            Unbound::Changed { .. } => reason::RUNNER_VM_CHANGED,
        }
    }
}

fn controller(refs: &[OwnerReference]) -> Option<&OwnerReference> {
    refs.iter().find(|o| o.controller == Some(true))
}

/// The VM side of the rule, checked before the Secret is even read.
pub fn check_vm(vm: &ImpVM) -> Result<(), Unbound> {
    let refs = vm.metadata.owner_references.as_deref().unwrap_or_default();
    match controller(refs) {
        Some(o) if o.kind == "ImpVMRunnerPool" && o.api_version.starts_with("imp.dev/") => Ok(()),
        _ => Err(Unbound::VmNotPooled),
    }
}

/// The Secret side: Imp's JIT label and this VM (`vm_uid`) as its controlling owner. Takes the
/// Secret's metadata, so a check before boot needs no read of the config.
pub fn check_secret(secret: &ObjectMeta, vm_uid: &str) -> Result<(), Unbound> {
    let name = secret.name.clone().unwrap_or_default();
    let jit = secret
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_SECRET_KIND))
        .is_some_and(|v| v == SECRET_KIND_JIT);
    if !jit {
        return Err(Unbound::NotJit { secret: name });
    }
    let refs = secret.owner_references.as_deref().unwrap_or_default();
    match controller(refs) {
        Some(o) if o.kind == "ImpVM" && o.uid == vm_uid => Ok(()),
        _ => Err(Unbound::NotOwned {
            secret: name,
            vm_uid: vm_uid.to_owned(),
        }),
    }
}

/// The VM's spec against the boot digest on its Secret (`annotations` of Secret `secret`). A
/// Secret without the digest is refused too: no mint of this version writes one without it.
pub fn check_boot(
    vm: &ImpVM,
    secret: &str,
    annotations: &BTreeMap<String, String>,
) -> Result<(), Unbound> {
    let now = imp_api::frozen::boot_digest(&vm.spec);
    match annotations.get(ANNOTATION_BOOT_DIGEST) {
        Some(minted) if *minted == now => Ok(()),
        minted => Err(Unbound::Changed {
            secret: secret.to_owned(),
            minted: minted.cloned().unwrap_or_else(|| "no digest".to_owned()),
            now,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Secret;

    fn owner(kind: &str, uid: &str, controller: bool) -> OwnerReference {
        OwnerReference {
            api_version: "imp.dev/v1alpha1".into(),
            kind: kind.into(),
            name: "x".into(),
            uid: uid.into(),
            controller: Some(controller),
            block_owner_deletion: None,
        }
    }

    fn vm(owners: Vec<OwnerReference>) -> ImpVM {
        let mut vm: ImpVM = serde_json::from_value(serde_json::json!({
            "apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM", "metadata": {"name": "v", "uid": "vm-1"},
            "spec": {"classRef": {"name": "c"}, "image": "i", "lifecycle": "ephemeral"}}))
        .unwrap();
        vm.metadata.owner_references = Some(owners);
        vm
    }

    fn secret(label: Option<&str>, owners: Vec<OwnerReference>) -> Secret {
        let mut s = Secret::default();
        s.metadata.name = Some("impvm-vm-1-jit".into());
        s.metadata.labels =
            label.map(|v| BTreeMap::from([(LABEL_SECRET_KIND.to_owned(), v.to_owned())]));
        s.metadata.owner_references = Some(owners);
        s
    }

    #[test]
    fn a_pool_vm_with_its_own_jit_secret_is_bound() {
        assert_eq!(
            check_vm(&vm(vec![owner("ImpVMRunnerPool", "p", true)])),
            Ok(())
        );
        let s = secret(Some(SECRET_KIND_JIT), vec![owner("ImpVM", "vm-1", true)]);
        assert_eq!(check_secret(&s.metadata, "vm-1"), Ok(()));
    }

    #[test]
    fn a_vm_without_a_controlling_pool_is_refused() {
        for owners in [
            vec![],
            vec![owner("ImpVMRunnerPool", "p", false)],
            vec![owner("Deployment", "d", true)],
        ] {
            let e = check_vm(&vm(owners.clone())).unwrap_err();
            assert_eq!(e.reason(), reason::RUNNER_VM_NOT_POOLED, "{owners:?}");
        }
    }

    #[test]
    fn another_vms_secret_is_refused_by_uid() {
        // The attack: a VM naming the victim's Secret. Same kind, other uid.
        let s = secret(Some(SECRET_KIND_JIT), vec![owner("ImpVM", "victim", true)]);
        let e = check_secret(&s.metadata, "vm-1").unwrap_err();
        assert_eq!(e.reason(), reason::RUNNER_CONFIG_NOT_OWNED);
        assert!(e.to_string().contains("vm-1"), "{e}");
        // A non-controlling reference to this VM is not enough, nor another kind with its uid.
        for owners in [
            vec![owner("ImpVM", "vm-1", false)],
            vec![owner("ImpVMRunnerPool", "vm-1", true)],
            vec![],
        ] {
            let s = secret(Some(SECRET_KIND_JIT), owners);
            assert_eq!(
                check_secret(&s.metadata, "vm-1").unwrap_err().reason(),
                reason::RUNNER_CONFIG_NOT_OWNED
            );
        }
    }

    #[test]
    fn a_secret_without_the_jit_label_is_refused_first() {
        for label in [None, Some("other")] {
            let s = secret(label, vec![owner("ImpVM", "vm-1", true)]);
            assert_eq!(
                check_secret(&s.metadata, "vm-1").unwrap_err().reason(),
                reason::RUNNER_CONFIG_NOT_JIT
            );
        }
    }

    #[test]
    fn a_vm_changed_after_the_mint_is_refused_and_an_unchanged_one_passes() {
        let minted = vm(vec![owner("ImpVMRunnerPool", "p", true)]);
        let ann = BTreeMap::from([(
            ANNOTATION_BOOT_DIGEST.to_owned(),
            imp_api::frozen::boot_digest(&minted.spec),
        )]);
        assert_eq!(check_boot(&minted, "s", &ann), Ok(()));
        // Scheduling fields may change after the mint.
        let mut moved = minted.clone();
        moved.spec.node_name = Some("n2".into());
        assert_eq!(check_boot(&moved, "s", &ann), Ok(()));
        let mut repointed = minted.clone();
        repointed.spec.image = "evil.example/own:1".into();
        let e = check_boot(&repointed, "s", &ann).unwrap_err();
        assert_eq!(e.reason(), reason::RUNNER_VM_CHANGED);
        assert!(e.to_string().contains("Secret s"), "{e}");
        // No digest at all: refused, never taken as a match.
        let e = check_boot(&minted, "s", &BTreeMap::new()).unwrap_err();
        assert_eq!(e.reason(), reason::RUNNER_VM_CHANGED);
        assert!(e.to_string().contains("no digest"), "{e}");
    }
}
