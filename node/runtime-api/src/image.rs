//! The `image` part of a VM spec: the OCI references the rootfs cache builds from and the pull
//! credentials for this request only.

use imp_api::PullPolicy;
use serde::{Deserialize, Serialize};

use crate::auth::PullCredentials;

/// The `image` part of imp-runtime's `PUT /v1/vms/{uid}` body.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageSpec {
    /// The base OCI image, e.g. `registry.example.com/ci/ubuntu:24.04` or a digest reference.
    pub base: String,
    /// An image whose layers go on top of the base (the pool template's `runnerImage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runner: Option<String>,
    /// From the pool's image pull Secret. Used for this request only: never stored in the
    /// inventory or the cache index, never logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<PullCredentials>,
    /// The ImpVM's `imagePullPolicy`; unset: Kubernetes' default for the references
    /// ([`PullPolicy::effective`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_policy: Option<PullPolicy>,
}

impl std::fmt::Debug for ImageSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageSpec")
            .field("base", &self.base)
            .field("runner", &self.runner)
            .field("pull_policy", &self.pull_policy)
            .field(
                "credentials",
                &self.credentials.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl ImageSpec {
    /// The spec without credentials: what the inventory stores and compares.
    pub fn without_credentials(&self) -> ImageSpec {
        ImageSpec {
            credentials: None,
            ..self.clone()
        }
    }

    /// The policy in force: the field, or Kubernetes' default over both references.
    pub fn effective_pull_policy(&self) -> PullPolicy {
        PullPolicy::effective(
            self.pull_policy,
            std::iter::once(self.base.as_str()).chain(self.runner.as_deref()),
        )
    }
}
