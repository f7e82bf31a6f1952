//! The registry's manifest documents, field for field as the OCI image spec (image-manifest.md,
//! image-index.md, descriptor.md) and Docker's v2 schema 2 define them, so the two can be read
//! side by side. Only the fields Imp acts on; unknown fields are ignored, as the spec requires.

use serde::Deserialize;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";

/// What the registry is asked for, in the `Accept` header.
pub const ACCEPTED: &[&str] = &[
    OCI_MANIFEST,
    DOCKER_MANIFEST,
    OCI_INDEX,
    DOCKER_MANIFEST_LIST,
];

pub fn is_manifest(media_type: &str) -> bool {
    media_type == OCI_MANIFEST || media_type == DOCKER_MANIFEST
}

pub fn is_index(media_type: &str) -> bool {
    media_type == OCI_INDEX || media_type == DOCKER_MANIFEST_LIST
}

pub fn is_config(media_type: &str) -> bool {
    media_type == OCI_CONFIG || media_type == DOCKER_CONFIG
}

/// Either document: OCI lets `mediaType` be absent, so the kind is told by `mediaType` when
/// present, else by which of `manifests` / `config` the document has.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Document {
    pub schema_version: u32,
    pub media_type: Option<String>,
    pub config: Option<Descriptor>,
    pub layers: Option<Vec<Descriptor>>,
    pub manifests: Option<Vec<Descriptor>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: String,
    /// Signed in the spec's Go types (int64); a negative size is refused by the caller.
    pub size: i64,
    pub platform: Option<Platform>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    pub variant: Option<String>,
}

impl Platform {
    /// `os/arch[/variant]`, as `docker manifest inspect` and error messages show it.
    pub fn display(&self) -> String {
        match &self.variant {
            Some(v) => format!("{}/{}/{v}", self.os, self.architecture),
            None => format!("{}/{}", self.os, self.architecture),
        }
    }
}
