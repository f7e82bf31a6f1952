//! Pushing images that tests build themselves to a test [`Registry`](crate::registry::Registry),
//! with oci-client over plain HTTP: well-formed images and indexes, plus an escape hatch
//! ([`push_image_with`]) that lets a test edit the manifest before it is pushed, so pull failures
//! (a descriptor that lies about digest, size or media type) can be provoked.

use std::io::Read;

use oci_client::{
    Client, Reference,
    client::{ClientConfig, ClientProtocol},
    errors::OciDistributionError,
};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

pub use oci_client::secrets::RegistryAuth as PushAuth;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const LAYER_TAR_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const LAYER_TAR_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";

/// One layer as pushed: the blob bytes and the media type its descriptor will carry.
#[derive(Debug, Clone)]
pub struct LayerBlob {
    pub bytes: Vec<u8>,
    pub media_type: String,
}

impl LayerBlob {
    /// An uncompressed tar of regular files.
    pub fn tar(files: &[(&str, &[u8])]) -> Self {
        LayerBlob {
            bytes: tar_of(files),
            media_type: LAYER_TAR.into(),
        }
    }

    /// A gzip-compressed tar of regular files.
    pub fn tar_gzip(files: &[(&str, &[u8])]) -> Self {
        Self::gzipped(gzip(&tar_of(files)))
    }

    /// A zstd-compressed tar of regular files.
    pub fn tar_zstd(files: &[(&str, &[u8])]) -> Self {
        Self::zstd_compressed(crate::tarball::zstd(&tar_of(files)))
    }

    /// A layer from a gzip stream made elsewhere (e.g. `TarBuilder::into_gzip`).
    pub fn gzipped(bytes: Vec<u8>) -> Self {
        LayerBlob {
            bytes,
            media_type: LAYER_TAR_GZIP.into(),
        }
    }

    /// A layer from a zstd stream made elsewhere (e.g. `TarBuilder::into_zstd`).
    pub fn zstd_compressed(bytes: Vec<u8>) -> Self {
        LayerBlob {
            bytes,
            media_type: LAYER_TAR_ZSTD.into(),
        }
    }

    pub fn digest(&self) -> String {
        sha256_digest(&self.bytes)
    }

    /// The image config's `diff_id`: digest of the uncompressed tar (gzip and zstd are undone;
    /// anything else is taken as it is).
    pub fn diff_id(&self) -> String {
        if self.media_type.ends_with("zstd") {
            sha256_digest(&crate::tarball::unzstd(&self.bytes))
        } else if self.media_type.ends_with("gzip") {
            let mut tar = Vec::new();
            flate2::read::GzDecoder::new(&self.bytes[..])
                .read_to_end(&mut tar)
                .expect("layer gzip decodes");
            sha256_digest(&tar)
        } else {
            self.digest()
        }
    }
}

/// A manifest as pushed: what an index entry needs to point at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushedManifest {
    pub digest: String,
    pub size: u64,
}

/// Pushes `layers`, a minimal linux/amd64 config and an OCI manifest as `host/repo:tag`.
pub async fn push_image(
    host: &str,
    repo_tag: &str,
    layers: &[LayerBlob],
    auth: &PushAuth,
) -> Result<PushedManifest, OciDistributionError> {
    push_image_with(host, repo_tag, layers, auth, |_| {}).await
}

/// Pushes `layers` (gzip streams, base first) anonymously as `repo_tag` and returns the full
/// reference, `host/repo:tag`.
pub async fn push_gzip_image(host: &str, repo_tag: &str, layers: Vec<Vec<u8>>) -> String {
    let blobs: Vec<LayerBlob> = layers.into_iter().map(LayerBlob::gzipped).collect();
    push_image(host, repo_tag, &blobs, &PushAuth::Anonymous)
        .await
        .unwrap_or_else(|e| panic!("push {host}/{repo_tag}: {e}"));
    format!("{host}/{repo_tag}")
}

/// A fresh registry holding `ci/base:1`: one layer with `/etc/os-release` (`ID=imp-test`), the
/// image the simulator tests boot their VMs from.
pub async fn registry_with_base_image() -> crate::registry::Registry {
    try_registry_with_base_image().await.unwrap()
}

/// [`registry_with_base_image`], answering why the registry did not start (a test may skip when
/// its binary is missing: [`crate::registry::RegistryError::BinaryMissing`]).
pub async fn try_registry_with_base_image()
-> Result<crate::registry::Registry, crate::registry::RegistryError> {
    let registry =
        crate::registry::Registry::start(crate::registry::RegistryOptions::default()).await?;
    let layer = LayerBlob::gzipped(
        crate::tarball::TarBuilder::new()
            .dir("etc", 0o755)
            .file("etc/os-release", b"ID=imp-test\n", 0o644)
            .into_gzip(),
    );
    push_image(
        &registry.host(),
        "ci/base:1",
        &[layer],
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();
    Ok(registry)
}

/// As [`push_image`], but `edit` may change the manifest JSON (every blob is already pushed)
/// before it is pushed: point a layer at another blob's digest, misstate a size or media type.
pub async fn push_image_with(
    host: &str,
    repo_tag: &str,
    layers: &[LayerBlob],
    auth: &PushAuth,
    edit: impl FnOnce(&mut Value),
) -> Result<PushedManifest, OciDistributionError> {
    let (client, reference) = session(host, repo_tag, auth).await?;
    let mut layer_descriptors = Vec::new();
    for layer in layers {
        let digest = push_blob_with(&client, &reference, &layer.bytes).await?;
        layer_descriptors.push(json!({
            "mediaType": layer.media_type,
            "digest": digest,
            "size": layer.bytes.len(),
        }));
    }
    let config = image_config(layers);
    let config_digest = push_blob_with(&client, &reference, &config).await?;
    let mut manifest = json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config.len()},
        "layers": layer_descriptors,
    });
    edit(&mut manifest);
    push_manifest_bytes(
        &client,
        &reference,
        OCI_MANIFEST,
        serde_json::to_vec(&manifest).expect("manifest serialises"),
    )
    .await
}

/// Pushes an OCI image index as `host/repo:tag` whose entries are `(manifest, "os/arch")`.
pub async fn push_index(
    host: &str,
    repo_tag: &str,
    entries: &[(PushedManifest, &str)],
    auth: &PushAuth,
) -> Result<PushedManifest, OciDistributionError> {
    let (client, reference) = session(host, repo_tag, auth).await?;
    let manifests: Vec<Value> = entries
        .iter()
        .map(|(manifest, platform)| {
            let (os, arch) = platform.split_once('/').expect("platform is os/arch");
            json!({
                "mediaType": OCI_MANIFEST,
                "digest": manifest.digest,
                "size": manifest.size,
                "platform": {"os": os, "architecture": arch},
            })
        })
        .collect();
    let index = json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests});
    push_manifest_bytes(
        &client,
        &reference,
        OCI_INDEX,
        serde_json::to_vec(&index).expect("index serialises"),
    )
    .await
}

/// Pushes one blob to `host/repo` and returns its digest.
pub async fn push_blob(
    host: &str,
    repo: &str,
    bytes: &[u8],
    auth: &PushAuth,
) -> Result<String, OciDistributionError> {
    let (client, reference) = session(host, &format!("{repo}:unused"), auth).await?;
    push_blob_with(&client, &reference, bytes).await
}

/// The minimal image config: linux/amd64, one diff_id per layer.
pub fn image_config(layers: &[LayerBlob]) -> Vec<u8> {
    let diff_ids: Vec<String> = layers.iter().map(LayerBlob::diff_id).collect();
    serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .expect("config serialises")
}

/// A tar of regular files (mode 0644), in the order given.
pub fn tar_of(files: &[(&str, &[u8])]) -> Vec<u8> {
    files
        .iter()
        .fold(crate::tarball::TarBuilder::new(), |t, (path, bytes)| {
            t.file(path, bytes, 0o644)
        })
        .into_tar()
}

pub use crate::tarball::{gzip, zstd};

pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

async fn session(
    host: &str,
    repo_tag: &str,
    auth: &PushAuth,
) -> Result<(Client, Reference), OciDistributionError> {
    let reference: Reference = format!("{host}/{repo_tag}")
        .parse()
        .map_err(|e| OciDistributionError::GenericError(Some(format!("reference: {e}"))))?;
    let client = Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..Default::default()
    });
    client
        .store_auth_if_needed(reference.resolve_registry(), auth)
        .await;
    Ok((client, reference))
}

async fn push_blob_with(
    client: &Client,
    reference: &Reference,
    bytes: &[u8],
) -> Result<String, OciDistributionError> {
    let digest = sha256_digest(bytes);
    client.push_blob(reference, bytes.to_vec(), &digest).await?;
    Ok(digest)
}

async fn push_manifest_bytes(
    client: &Client,
    reference: &Reference,
    media_type: &str,
    body: Vec<u8>,
) -> Result<PushedManifest, OciDistributionError> {
    let pushed = PushedManifest {
        digest: sha256_digest(&body),
        size: body.len() as u64,
    };
    client
        .push_manifest_raw(
            reference,
            body,
            media_type.parse().expect("media type is a header value"),
        )
        .await?;
    Ok(pushed)
}
