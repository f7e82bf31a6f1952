//! The one error type of the operator's controllers. Variants say what failed; `metric_label` gives each a
//! stable label for `imp_operator_reconcile_errors_total`.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// A request to the Kubernetes API failed (other than a write conflict); `what` names the request.
    #[error("Kubernetes API request failed ({what}): {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },

    /// A write raced with another writer (resourceVersion precondition failed); the newer object is re-read.
    #[error("write conflict on {0}: the object changed since it was read")]
    Conflict(String),

    /// An object lacks a field the API server always sets (name, namespace, uid, creationTimestamp).
    #[error("object is missing {0}")]
    MissingObjectKey(&'static str),

    /// Built-in IPAM: every address of the network is allocated.
    #[error("ImpNetwork {network} has no free address (capacity {capacity})")]
    NetworkExhausted { network: String, capacity: u32 },

    /// Built-in IPAM: the ImpNetwork a VM names does not exist.
    #[error("ImpNetwork {network} does not exist")]
    NetworkNotFound { network: String },

    /// Built-in IPAM: the network's subnet/gateway cannot be used (the message names the field).
    #[error("ImpNetwork {network}: {message}")]
    NetworkInvalid { network: String, message: String },

    /// Runner pool: GitHub refused or failed a JIT config mint for the VM.
    #[error("minting a JIT config for VM {vm} failed: {source}")]
    Mint {
        vm: String,
        #[source]
        source: crate::github::GithubError,
    },

    /// Runner pool: the pool's scale set refused or failed a JIT config mint for the VM.
    #[error("minting a JIT config for VM {vm} through the scale set failed: {source}")]
    ScaleSetMint {
        vm: String,
        #[source]
        source: crate::scaleset::ScaleSetError,
    },

    /// Runner pool: the VM's JIT Secret name is taken by a Secret the VM does not own.
    #[error("Secret {secret} exists and is not owned by VM {vm}")]
    JitSecretConflict { secret: String, vm: String },

    /// Runner pool: the VM was minted before but its JIT Secret is gone (a VM is never minted twice).
    #[error("VM {vm} was minted but its JIT Secret is gone")]
    JitConfigLost { vm: String },

    /// Runner pool: a VM claims the pool (label, owner reference) but its spec is not the pool's template.
    #[error("VM {vm} claims this pool but its spec is not the pool's template")]
    ForeignRunnerVm { vm: String },

    /// Leader election: this process stopped holding the leader Lease (renewals failed past the renew
    /// deadline, or another candidate took it). The operator exits so its in-memory demand and backoff
    /// do not outlive its term.
    #[error("lost the leader Lease")]
    LeadershipLost,

    /// Leader election: the elector stopped (shutdown) before or while this process led.
    #[error("the leader elector stopped")]
    ElectorStopped,

    /// A controller's loop ended while leading (its watches ended); a leader's work never ends on its own.
    #[error("a controller stopped while leading")]
    ControllerStopped,
}

impl Error {
    /// A short, stable label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube { .. } => "kube_api",
            Error::Conflict(_) => "conflict",
            Error::MissingObjectKey(_) => "missing_object_key",
            Error::NetworkExhausted { .. } => "network_exhausted",
            Error::NetworkInvalid { .. } => "network_invalid",
            Error::NetworkNotFound { .. } => "network_not_found",
            Error::Mint { .. } => "jit_mint",
            Error::ScaleSetMint { .. } => "scale_set_mint",
            Error::JitSecretConflict { .. } => "jit_secret_conflict",
            Error::JitConfigLost { .. } => "jit_config_lost",
            Error::ForeignRunnerVm { .. } => "foreign_runner_vm",
            Error::LeadershipLost => "leadership_lost",
            Error::ElectorStopped => "elector_stopped",
            Error::ControllerStopped => "controller_stopped",
        }
    }

    /// The ImpVM reason for an address allocation failure that leaves the VM Pending; None for
    /// errors that are not about the network (retried as reconcile errors).
    pub fn network_reason(&self) -> Option<&'static str> {
        use imp_api::names::reason;
        match self {
            Error::NetworkExhausted { .. } => Some(reason::NETWORK_EXHAUSTED),
            Error::NetworkNotFound { .. } => Some(reason::NETWORK_NOT_FOUND),
            Error::NetworkInvalid { .. } => Some(reason::NETWORK_INVALID),
            Error::Kube { .. }
            | Error::Conflict(_)
            | Error::MissingObjectKey(_)
            | Error::Mint { .. }
            | Error::ScaleSetMint { .. }
            | Error::JitSecretConflict { .. }
            | Error::JitConfigLost { .. }
            | Error::ForeignRunnerVm { .. }
            | Error::LeadershipLost
            | Error::ElectorStopped
            | Error::ControllerStopped => None,
        }
    }

    /// `from_kube` as a closure for `map_err`.
    pub fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let what = what.into();
        move |e| Self::from_kube(&what, e)
    }

    /// Maps a kube error, singling out 409 Conflict (an expected race, retried at once).
    pub fn from_kube(what: &str, e: kube::Error) -> Self {
        match &e {
            kube::Error::Api(s) if s.code == 409 => Error::Conflict(what.to_owned()),
            _ => Error::Kube {
                what: what.to_owned(),
                source: e,
            },
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflicts_are_told_apart_from_other_api_errors() {
        let status = |code| {
            kube::Error::Api(
                kube::core::Status::failure("x", "y")
                    .with_code(code)
                    .boxed(),
            )
        };
        assert_eq!(
            Error::from_kube("impvm a/b", status(409)).metric_label(),
            "conflict"
        );
        assert_eq!(
            Error::from_kube("impvm a/b", status(500)).metric_label(),
            "kube_api"
        );
        assert_eq!(
            Error::MissingObjectKey(".metadata.uid").metric_label(),
            "missing_object_key"
        );
        assert_eq!(Error::Conflict("x".into()).network_reason(), None);
        assert_eq!(Error::LeadershipLost.metric_label(), "leadership_lost");
        assert_eq!(Error::ElectorStopped.metric_label(), "elector_stopped");
        assert_eq!(
            Error::ControllerStopped.metric_label(),
            "controller_stopped"
        );
        assert_eq!(Error::LeadershipLost.network_reason(), None);
        assert_eq!(
            Error::NetworkExhausted {
                network: "ns/n".into(),
                capacity: 1
            }
            .network_reason(),
            Some(imp_api::names::reason::NETWORK_EXHAUSTED)
        );
    }
}
