//! Resolve an image reference to its linux/amd64 manifest and fetch its layer blobs, verified.
//!
//! oci-client speaks the distribution protocol (token and basic auth, plain HTTP for listed
//! registries). Everything that decides what Imp trusts is done here regardless of what
//! oci-client checks: manifest and blob digests are recomputed, sizes are held to the
//! descriptor (reading stops the moment a blob runs over), media types are checked against the
//! set Imp unpacks, and declared sizes are capped before anything is downloaded.

mod wire;

use std::{
    path::{Path, PathBuf},
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::StreamExt;
use imp_common::ExposeSecret;
use oci_client::{
    Client, Reference, RegistryOperation,
    client::{ClientConfig, ClientProtocol, linux_amd64_resolver},
    errors::{OciDistributionError, OciErrorCode},
    secrets::RegistryAuth as OciAuth,
};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use super::{
    Compression,
    auth::RegistryAuth,
    egress::{AddressClassLabel, PullProxy, Refusal},
};
use prometheus_client::metrics::{counter::Counter, family::Family};
use wire::Document;

/// The reason for failures to reach or be served by the registry (worth retrying).
pub const REASON_PULL_FAILED: &str = imp_api::names::reason::ROOTFS_PULL_FAILED;
/// The reason for images refused on integrity or policy grounds (retrying will not help).
pub const REASON_REJECTED: &str = imp_api::names::reason::ROOTFS_REJECTED;
/// The reason for pulls that needed a node-local or link-local address (egress policy).
pub const REASON_REFUSED: &str = imp_api::names::reason::ROOTFS_PULL_REFUSED;

#[derive(Debug, Clone)]
pub struct PullConfig {
    /// Registries (`host:port`, e.g. `127.0.0.1:5000`) reached over plain HTTP.
    pub insecure_registries: Vec<String>,
    /// Registries (`host[:port]`) a pull may reach on the node's own, loopback or link-local
    /// addresses (a registry on the node); every other pull is refused those (`egress`).
    pub node_local_registries: Vec<String>,
    /// Cap on each layer's compressed size, as declared; checked before download.
    pub max_layer_bytes: u64,
    /// Cap on a manifest or index document (and the image config descriptor).
    pub max_manifest_bytes: u64,
}

impl Default for PullConfig {
    fn default() -> Self {
        Self {
            insecure_registries: Vec::new(),
            node_local_registries: Vec::new(),
            max_layer_bytes: 8 << 30,
            // The distribution spec suggests registries accept manifests up to 4 MiB.
            max_manifest_bytes: 4 << 20,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedImage {
    /// The reference as given, normalised (`docker.io/library/x:tag`).
    pub reference: String,
    pub registry: String,
    /// Digest of the platform manifest (not of the index it was chosen from).
    pub manifest_digest: String,
    pub config_digest: String,
    pub layers: Vec<LayerRef>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerRef {
    pub digest: String,
    pub size: u64,
    pub media_type: String,
    pub compression: Compression,
}

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("invalid image reference {reference:?}: {message}")]
    InvalidReference { reference: String, message: String },
    #[error("registry {registry} refused the credentials (or required some)")]
    Unauthorized { registry: String },
    #[error("{reference} not found in the registry")]
    NotFound { reference: String },
    #[error("{reference} has no linux/amd64 image; the index offers {platforms:?}")]
    NoLinuxAmd64 {
        reference: String,
        platforms: Vec<String>,
    },
    #[error("{what} {digest} has media type {media_type:?}, which Imp does not accept")]
    UnsupportedMediaType {
        what: &'static str,
        digest: String,
        media_type: String,
    },
    #[error("{what} digest {digest:?} is not a well-formed sha256 digest")]
    InvalidDigest { what: &'static str, digest: String },
    #[error("manifest of {reference} is malformed: {message}")]
    InvalidManifest { reference: String, message: String },
    #[error("blob {digest} does not match its digest: the registry served {actual}")]
    DigestMismatch { digest: String, actual: String },
    #[error("blob {digest} should be {expected} bytes, the registry served {actual}")]
    SizeMismatch {
        digest: String,
        expected: u64,
        actual: u64,
    },
    #[error("{what} {digest} declares {size} bytes, over the limit of {limit}")]
    TooLarge {
        what: &'static str,
        digest: String,
        size: u64,
        limit: u64,
    },
    #[error("registry error for {reference}: {message}")]
    Registry { reference: String, message: String },
    #[error(
        "pulling {reference} needed a connection to {} ({}, {}), which image pulls may not reach; \
         a registry on the node must be listed in the runtime's node-local registries",
        refusal.target, refusal.address, refusal.class.as_str()
    )]
    AddressRefused { reference: String, refusal: Refusal },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl PullError {
    /// The registry could not be reached or failed on its side (network, 5xx, protocol): the
    /// only errors that let a VM start from an image cached earlier. A refusal (credentials,
    /// missing tag) never does: another tenant's cached pull must not stand in for access.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, PullError::Registry { .. })
    }

    /// The ImpVM failure reason: registry and network trouble may pass; integrity and policy
    /// failures will not.
    pub fn reason(&self) -> &'static str {
        match self {
            PullError::Unauthorized { .. }
            | PullError::NotFound { .. }
            | PullError::Registry { .. }
            | PullError::Io { .. } => REASON_PULL_FAILED,
            PullError::InvalidReference { .. }
            | PullError::NoLinuxAmd64 { .. }
            | PullError::UnsupportedMediaType { .. }
            | PullError::InvalidDigest { .. }
            | PullError::InvalidManifest { .. }
            | PullError::DigestMismatch { .. }
            | PullError::SizeMismatch { .. }
            | PullError::TooLarge { .. } => REASON_REJECTED,
            PullError::AddressRefused { .. } => REASON_REFUSED,
        }
    }
}

/// Pulls images. Cheap to clone and share.
///
/// Each operation uses its own oci-client `Client`: a `Client` remembers the first credentials it
/// saw per registry and caches tokens per repository, so one shared `Client` would let a pull
/// with one Secret (or none) ride on credentials another Secret supplied.
#[derive(Clone)]
pub struct Puller {
    cfg: Arc<PullConfig>,
    node_local: Arc<Vec<String>>,
    refusals: Option<Family<AddressClassLabel, Counter>>,
}

/// Whether a fetched blob must survive a crash once `fetch_layer` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    Synced,
    Scratch,
}

/// Suffix counter for temp files, so concurrent fetches to one destination never share one.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl Puller {
    pub fn new(cfg: PullConfig) -> Self {
        Self {
            node_local: Arc::new(cfg.node_local_registries.clone()),
            cfg: Arc::new(cfg),
            refusals: None,
        }
    }

    /// Count refused connections by address class (`imp_rootfs_pull_refused_connections_total`).
    pub fn with_refusal_metric(mut self, refusals: Family<AddressClassLabel, Counter>) -> Self {
        self.refusals = Some(refusals);
        self
    }

    /// A client for one operation, with the proxy every connection of it goes through (keep it
    /// alive until the operation is done; see `egress`).
    async fn client(
        &self,
        reference: &Reference,
        auth: &RegistryAuth,
    ) -> Result<(Client, OciAuth, PullProxy), PullError> {
        let proxy = PullProxy::start(self.node_local.clone(), self.refusals.clone())
            .await
            .map_err(|e| PullError::Registry {
                reference: reference.whole(),
                message: format!("starting the pull's proxy: {e}"),
            })?;
        let client = Client::new(ClientConfig {
            protocol: ClientProtocol::HttpsExcept(self.cfg.insecure_registries.clone()),
            platform_resolver: Some(Box::new(linux_amd64_resolver)),
            connect_timeout: Some(Duration::from_secs(15)),
            read_timeout: Some(Duration::from_secs(60)),
            // Both schemes: reqwest then never falls back to the environment's proxy.
            http_proxy: Some(proxy.url().to_owned()),
            https_proxy: Some(proxy.url().to_owned()),
            no_proxy: None,
            ..Default::default()
        });
        let auth = match auth {
            RegistryAuth::Anonymous => OciAuth::Anonymous,
            RegistryAuth::Basic { username, password } => {
                OciAuth::Basic(username.clone(), password.expose_secret().to_owned())
            }
        };
        Ok((client, auth, proxy))
    }

    /// Image index / manifest list → the linux/amd64 manifest; checks the config media type,
    /// every layer media type, declared sizes against the caps, and that digests are sha256.
    pub async fn resolve(
        &self,
        reference: &str,
        auth: &RegistryAuth,
    ) -> Result<ResolvedImage, PullError> {
        let image = parse_reference(reference)?;
        let (client, oci_auth, proxy) = self.client(&image, auth).await?;
        let result = self.resolve_with(&image, &client, &oci_auth, &proxy).await;
        refused_or(result, &image, &proxy)
    }

    async fn resolve_with(
        &self,
        image: &Reference,
        client: &Client,
        oci_auth: &OciAuth,
        proxy: &PullProxy,
    ) -> Result<ResolvedImage, PullError> {
        let name = image.whole();
        tracing::debug!(reference = %name, "resolving image");

        if let Some(declared) = self
            .declared_manifest_size(client, image, oci_auth, proxy)
            .await
        {
            self.check_manifest_size(&name, &name, declared)?;
        }
        let (body, _) = client
            .pull_manifest_raw(image, oci_auth, wire::ACCEPTED)
            .await
            .map_err(|e| registry_error(e, image))?;
        let digest = sha256_digest(&body);
        if let Some(pinned) = image.digest()
            && pinned != digest
        {
            return Err(PullError::DigestMismatch {
                digest: pinned.to_owned(),
                actual: digest,
            });
        }
        self.check_manifest_size(&name, &digest, body.len())?;
        let top = parse_document(&name, &body)?;

        let (manifest, manifest_digest) = if document_is_index(&top) {
            let entry = choose_linux_amd64(&name, top.manifests.unwrap_or_default())?;
            check_digest("manifest", &entry.digest)?;
            if !wire::is_manifest(&entry.media_type) {
                return Err(PullError::UnsupportedMediaType {
                    what: "manifest",
                    digest: entry.digest,
                    media_type: entry.media_type,
                });
            }
            let declared = declared_size("manifest", &entry.digest, entry.size)?;
            self.check_manifest_size(&name, &entry.digest, declared as usize)?;
            let by_digest = image.clone_with_digest(entry.digest.clone());
            let (body, _) = client
                .pull_manifest_raw(&by_digest, oci_auth, wire::ACCEPTED)
                .await
                .map_err(|e| registry_error(e, &by_digest))?;
            verify_bytes(&entry.digest, declared, &body)?;
            let doc = parse_document(&name, &body)?;
            if document_is_index(&doc) {
                return Err(PullError::UnsupportedMediaType {
                    what: "manifest",
                    digest: entry.digest,
                    media_type: doc.media_type.unwrap_or_else(|| "(nested index)".into()),
                });
            }
            (doc, entry.digest)
        } else {
            (top, digest)
        };
        self.check_image_manifest(&name, image, &manifest_digest, manifest)
    }

    /// The size a registry declares for a manifest (HEAD, Content-Length), so an oversize one is
    /// refused before oci-client reads it: oci-client 0.18 buffers a manifest whole and has no
    /// size-aware manifest call (`fetch_manifest_digest` returns only the digest). None when the
    /// HEAD fails or declares nothing: the GET then reports the error, and the size is checked
    /// after the fact.
    async fn declared_manifest_size(
        &self,
        client: &Client,
        image: &Reference,
        auth: &OciAuth,
        proxy: &PullProxy,
    ) -> Option<usize> {
        let registry = image.resolve_registry();
        let scheme = if self.cfg.insecure_registries.iter().any(|r| r == registry) {
            "http"
        } else {
            "https"
        };
        let reference = image
            .digest()
            .or(image.tag())
            .unwrap_or("latest")
            .to_owned();
        let url = format!(
            "{scheme}://{registry}/v2/{}/manifests/{reference}",
            image.repository()
        );
        // The token oci-client would present (it caches it for the GET that follows).
        let token = client
            .auth(image, auth, RegistryOperation::Pull)
            .await
            .ok()?;
        let http = reqwest::Client::builder()
            .no_proxy()
            .proxy(reqwest::Proxy::all(proxy.url()).ok()?)
            .connect_timeout(Duration::from_secs(15))
            .timeout(Duration::from_secs(60))
            .build()
            .ok()?;
        let mut req = http
            .head(&url)
            .header(reqwest::header::ACCEPT, wire::ACCEPTED.join(", "));
        req = match (token, auth) {
            (Some(t), _) => req.bearer_auth(t),
            (None, OciAuth::Basic(u, p)) => req.basic_auth(u, Some(p)),
            (None, _) => req,
        };
        let res = req.send().await.ok()?;
        if !res.status().is_success() {
            return None;
        }
        res.headers()
            .get(reqwest::header::CONTENT_LENGTH)?
            .to_str()
            .ok()?
            .parse()
            .ok()
    }

    fn check_manifest_size(&self, name: &str, digest: &str, len: usize) -> Result<(), PullError> {
        if len as u64 > self.cfg.max_manifest_bytes {
            tracing::debug!(reference = %name, len, "manifest over the cap");
            return Err(PullError::TooLarge {
                what: "manifest",
                digest: digest.to_owned(),
                size: len as u64,
                limit: self.cfg.max_manifest_bytes,
            });
        }
        Ok(())
    }

    fn check_image_manifest(
        &self,
        name: &str,
        image: &Reference,
        manifest_digest: &str,
        doc: Document,
    ) -> Result<ResolvedImage, PullError> {
        if let Some(media_type) = &doc.media_type
            && !wire::is_manifest(media_type)
        {
            return Err(PullError::UnsupportedMediaType {
                what: "manifest",
                digest: manifest_digest.to_owned(),
                media_type: media_type.clone(),
            });
        }
        let invalid = |message: &str| PullError::InvalidManifest {
            reference: name.to_owned(),
            message: message.to_owned(),
        };
        let config = doc.config.ok_or_else(|| invalid("no config descriptor"))?;
        check_digest("config", &config.digest)?;
        if !wire::is_config(&config.media_type) {
            return Err(PullError::UnsupportedMediaType {
                what: "config",
                digest: config.digest,
                media_type: config.media_type,
            });
        }
        let config_size = declared_size("config", &config.digest, config.size)?;
        if config_size > self.cfg.max_manifest_bytes {
            return Err(PullError::TooLarge {
                what: "config",
                digest: config.digest,
                size: config_size,
                limit: self.cfg.max_manifest_bytes,
            });
        }
        let layers = doc.layers.ok_or_else(|| invalid("no layers array"))?;
        if layers.is_empty() {
            return Err(invalid("no layers"));
        }
        let layers = layers
            .into_iter()
            .map(|layer| self.check_layer(layer))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ResolvedImage {
            reference: name.to_owned(),
            registry: image.registry().to_owned(),
            manifest_digest: manifest_digest.to_owned(),
            config_digest: config.digest,
            layers,
        })
    }

    fn check_layer(&self, layer: wire::Descriptor) -> Result<LayerRef, PullError> {
        check_digest("layer", &layer.digest)?;
        let Some(compression) = Compression::from_media_type(&layer.media_type) else {
            return Err(PullError::UnsupportedMediaType {
                what: "layer",
                digest: layer.digest,
                media_type: layer.media_type,
            });
        };
        let size = declared_size("layer", &layer.digest, layer.size)?;
        self.check_layer_size(&layer.digest, size)?;
        Ok(LayerRef {
            digest: layer.digest,
            size,
            media_type: layer.media_type,
            compression,
        })
    }

    fn check_layer_size(&self, digest: &str, size: u64) -> Result<(), PullError> {
        if size > self.cfg.max_layer_bytes {
            return Err(PullError::TooLarge {
                what: "layer",
                digest: digest.to_owned(),
                size,
                limit: self.cfg.max_layer_bytes,
            });
        }
        Ok(())
    }

    /// Streams one blob to `dest` through a temp file beside it (fsync, rename), hashing as it
    /// goes. Digest and size must match the descriptor, else the temp file is removed.
    pub async fn fetch_layer(
        &self,
        image: &ResolvedImage,
        layer: &LayerRef,
        auth: &RegistryAuth,
        dest: &Path,
    ) -> Result<(), PullError> {
        self.fetch_layer_with(image, layer, auth, dest, Durability::Synced)
            .await
    }

    /// `fetch_layer`, durable or not: a build's scratch blob lives only as long as the build
    /// (a crash deletes its whole directory), so it is not fsynced; every check is the same.
    pub(crate) async fn fetch_layer_with(
        &self,
        image: &ResolvedImage,
        layer: &LayerRef,
        auth: &RegistryAuth,
        dest: &Path,
        durability: Durability,
    ) -> Result<(), PullError> {
        // LayerRef's fields are public, so hold a hand-made one to the same rules as resolve's.
        check_digest("layer", &layer.digest)?;
        self.check_layer_size(&layer.digest, layer.size)?;
        let reference = parse_reference(&image.reference)?;
        let temp = temp_path(dest)?;
        let result = self
            .fetch_to(&reference, layer, auth, &temp, durability)
            .await;
        let result = match result {
            Ok(()) => tokio::fs::rename(&temp, dest)
                .await
                .map_err(|source| PullError::Io {
                    path: dest.to_owned(),
                    source,
                }),
            Err(e) => Err(e),
        };
        match (result, durability) {
            (Ok(()), Durability::Synced) => sync_parent(dest).await,
            (Ok(()), Durability::Scratch) => Ok(()),
            (Err(e), _) => {
                let _ = tokio::fs::remove_file(&temp).await;
                Err(e)
            }
        }
    }

    async fn fetch_to(
        &self,
        image: &Reference,
        layer: &LayerRef,
        auth: &RegistryAuth,
        temp: &Path,
        durability: Durability,
    ) -> Result<(), PullError> {
        let (client, oci_auth, proxy) = self.client(image, auth).await?;
        let result = Self::stream_to(&client, &oci_auth, image, layer, temp, durability).await;
        refused_or(result, image, &proxy)
    }

    async fn stream_to(
        client: &Client,
        oci_auth: &OciAuth,
        image: &Reference,
        layer: &LayerRef,
        temp: &Path,
        durability: Durability,
    ) -> Result<(), PullError> {
        let io = |source| PullError::Io {
            path: temp.to_owned(),
            source,
        };
        client
            .store_auth_if_needed(image.resolve_registry(), oci_auth)
            .await;
        tracing::debug!(digest = %layer.digest, size = layer.size, "fetching layer");
        // The digest alone, not a descriptor with `urls`: Imp never follows foreign URLs.
        let mut stream = client
            .pull_blob_stream(image, layer.digest.as_str())
            .await
            .map_err(|e| registry_error(e, image))?;
        if let Some(length) = stream.content_length
            && length != layer.size
        {
            return Err(PullError::SizeMismatch {
                digest: layer.digest.clone(),
                expected: layer.size,
                actual: length,
            });
        }

        let mut file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(temp)
            .await
            .map_err(io)?;
        let mut hasher = Sha256::new();
        let mut received: u64 = 0;
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(chunk) => chunk,
                Err(e) => {
                    // oci-client's own check fails the stream's last item on a digest mismatch;
                    // report it as ours when our count and hash say the same.
                    let actual = format!("sha256:{}", hex::encode(hasher.clone().finalize()));
                    if received == layer.size && actual != layer.digest {
                        return Err(PullError::DigestMismatch {
                            digest: layer.digest.clone(),
                            actual,
                        });
                    }
                    return Err(PullError::Registry {
                        reference: image.whole(),
                        message: format!("reading blob {}: {e}", layer.digest),
                    });
                }
            };
            received += chunk.len() as u64;
            if received > layer.size {
                return Err(PullError::SizeMismatch {
                    digest: layer.digest.clone(),
                    expected: layer.size,
                    actual: received,
                });
            }
            hasher.update(&chunk);
            file.write_all(&chunk).await.map_err(io)?;
        }
        if received != layer.size {
            return Err(PullError::SizeMismatch {
                digest: layer.digest.clone(),
                expected: layer.size,
                actual: received,
            });
        }
        let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
        if actual != layer.digest {
            return Err(PullError::DigestMismatch {
                digest: layer.digest.clone(),
                actual,
            });
        }
        file.flush().await.map_err(io)?;
        if durability == Durability::Synced {
            file.sync_all().await.map_err(io)?;
        }
        Ok(())
    }
}

/// A failed operation whose proxy refused a connection failed because of the refusal, whatever
/// oci-client made of the proxy's answer (a forwarded 403 reads as "unauthorized").
fn refused_or<T>(
    result: Result<T, PullError>,
    image: &Reference,
    proxy: &PullProxy,
) -> Result<T, PullError> {
    match (result, proxy.refusal()) {
        (Err(_), Some(refusal)) => Err(PullError::AddressRefused {
            reference: image.whole(),
            refusal,
        }),
        (result, _) => result,
    }
}

/// The registry part of `reference` (`docker.io` for Docker Hub names), for choosing
/// credentials before resolving.
pub fn registry_of(reference: &str) -> Result<String, PullError> {
    Ok(parse_reference(reference)?.registry().to_owned())
}

fn parse_reference(reference: &str) -> Result<Reference, PullError> {
    Reference::from_str(reference).map_err(|e| PullError::InvalidReference {
        reference: reference.to_owned(),
        message: e.to_string(),
    })
}

fn parse_document(name: &str, body: &[u8]) -> Result<Document, PullError> {
    let doc: Document = serde_json::from_slice(body).map_err(|e| PullError::InvalidManifest {
        reference: name.to_owned(),
        message: e.to_string(),
    })?;
    if doc.schema_version != 2 {
        return Err(PullError::InvalidManifest {
            reference: name.to_owned(),
            message: format!("schemaVersion {} (only 2 is supported)", doc.schema_version),
        });
    }
    Ok(doc)
}

fn document_is_index(doc: &Document) -> bool {
    match &doc.media_type {
        Some(media_type) => wire::is_index(media_type),
        None => doc.manifests.is_some() && doc.config.is_none(),
    }
}

/// The first linux/amd64 entry (any amd64 variant), or the platforms on offer.
fn choose_linux_amd64(
    name: &str,
    entries: Vec<wire::Descriptor>,
) -> Result<wire::Descriptor, PullError> {
    let mut platforms = Vec::new();
    for entry in entries {
        match &entry.platform {
            Some(p) if p.os == "linux" && p.architecture == "amd64" => return Ok(entry),
            Some(p) => platforms.push(p.display()),
            None => platforms.push("(no platform)".to_owned()),
        }
    }
    Err(PullError::NoLinuxAmd64 {
        reference: name.to_owned(),
        platforms,
    })
}

/// `sha256:` and 64 lowercase hex digits: the only algorithm Imp verifies, and the form that is
/// safe to put in a URL path.
fn check_digest(what: &'static str, digest: &str) -> Result<(), PullError> {
    let ok = digest.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    });
    if ok {
        Ok(())
    } else {
        Err(PullError::InvalidDigest {
            what,
            digest: digest.to_owned(),
        })
    }
}

fn declared_size(what: &'static str, digest: &str, size: i64) -> Result<u64, PullError> {
    u64::try_from(size).map_err(|_| PullError::InvalidManifest {
        reference: format!("{what} {digest}"),
        message: format!("negative size {size}"),
    })
}

fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

fn verify_bytes(digest: &str, size: u64, body: &[u8]) -> Result<(), PullError> {
    if body.len() as u64 != size {
        return Err(PullError::SizeMismatch {
            digest: digest.to_owned(),
            expected: size,
            actual: body.len() as u64,
        });
    }
    let actual = sha256_digest(body);
    if actual != digest {
        return Err(PullError::DigestMismatch {
            digest: digest.to_owned(),
            actual,
        });
    }
    Ok(())
}

fn registry_error(err: OciDistributionError, image: &Reference) -> PullError {
    let unauthorized = || PullError::Unauthorized {
        registry: image.registry().to_owned(),
    };
    let not_found = || PullError::NotFound {
        reference: image.whole(),
    };
    match &err {
        OciDistributionError::UnauthorizedError { .. }
        | OciDistributionError::AuthenticationFailure(_) => return unauthorized(),
        OciDistributionError::ImageManifestNotFoundError(_) => return not_found(),
        OciDistributionError::ServerError {
            code: 401 | 403, ..
        } => return unauthorized(),
        OciDistributionError::ServerError { code: 404, .. } => return not_found(),
        OciDistributionError::RegistryError { envelope, .. } => {
            for e in &envelope.errors {
                match e.code {
                    OciErrorCode::Unauthorized | OciErrorCode::Denied => return unauthorized(),
                    OciErrorCode::ManifestUnknown
                    | OciErrorCode::NameUnknown
                    | OciErrorCode::NotFound
                    | OciErrorCode::BlobUnknown => return not_found(),
                    _ => {}
                }
            }
        }
        OciDistributionError::DigestError(oci_client::errors::DigestError::VerificationError {
            expected,
            actual,
        }) => {
            return PullError::DigestMismatch {
                digest: expected.clone(),
                actual: actual.clone(),
            };
        }
        _ => {}
    }
    PullError::Registry {
        reference: image.whole(),
        message: describe(&err),
    }
}

/// What went wrong, without what the registry said: a registry's error body is remote text
/// (it may echo credentials, or be anything at all) and ends up in VM status and Events.
fn describe(err: &OciDistributionError) -> String {
    match err {
        OciDistributionError::ServerError { code, url, .. } => {
            format!("the registry answered HTTP {code} for {url}")
        }
        OciDistributionError::RegistryError { url, envelope } => {
            let codes: Vec<String> = envelope
                .errors
                .iter()
                .map(|e| format!("{:?}", e.code))
                .collect();
            format!("the registry refused {url} with {}", codes.join(", "))
        }
        OciDistributionError::UnauthorizedError { url } => format!("not authorized for {url}"),
        OciDistributionError::AuthenticationFailure(_) => "authentication failed".into(),
        OciDistributionError::RegistryTokenDecodeError(_) => {
            "the registry's token answer is not a token".into()
        }
        OciDistributionError::ManifestParsingError(_)
        | OciDistributionError::VersionedParsingError(_)
        | OciDistributionError::JsonError(_) => "the registry's answer is not a manifest".into(),
        OciDistributionError::SpecViolationError(_) => {
            "the registry's answer violates the distribution spec".into()
        }
        OciDistributionError::GenericError(_) => "the registry exchange failed".into(),
        // Local or transport errors (I/O, TLS, connection): they quote nothing remote.
        other => other.to_string(),
    }
}

fn temp_path(dest: &Path) -> Result<PathBuf, PullError> {
    let name = dest.file_name().ok_or_else(|| PullError::Io {
        path: dest.to_owned(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name"),
    })?;
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut temp = std::ffi::OsString::from(".");
    temp.push(name);
    temp.push(format!(".part-{}-{n}", std::process::id()));
    Ok(dest.with_file_name(temp))
}

/// The rename is only durable once the directory entry is.
async fn sync_parent(dest: &Path) -> Result<(), PullError> {
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let io = |source| PullError::Io {
        path: parent.clone(),
        source,
    };
    let dir = tokio::fs::File::open(&parent).await.map_err(io)?;
    dir.sync_all().await.map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(os: &str, arch: &str, variant: Option<&str>) -> wire::Descriptor {
        wire::Descriptor {
            media_type: wire::OCI_MANIFEST.into(),
            digest: format!("sha256:{}", "a".repeat(64)),
            size: 10,
            platform: Some(wire::Platform {
                architecture: arch.into(),
                os: os.into(),
                variant: variant.map(Into::into),
            }),
        }
    }

    #[test]
    fn digests_must_be_lowercase_sha256() {
        assert!(check_digest("layer", &format!("sha256:{}", "0f".repeat(32))).is_ok());
        for bad in [
            format!("sha256:{}", "A".repeat(64)),
            format!("sha256:{}", "a".repeat(63)),
            format!("sha512:{}", "a".repeat(128)),
            format!("sha256:{}/../x", "a".repeat(60)),
            String::new(),
        ] {
            assert!(
                matches!(
                    check_digest("layer", &bad),
                    Err(PullError::InvalidDigest { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn platform_choice_lists_what_was_offered() {
        let chosen = choose_linux_amd64(
            "r",
            vec![
                entry("linux", "arm64", Some("v8")),
                entry("linux", "amd64", None),
            ],
        )
        .unwrap();
        assert_eq!(chosen.platform.unwrap().architecture, "amd64");
        match choose_linux_amd64(
            "r",
            vec![
                entry("linux", "arm64", Some("v8")),
                entry("windows", "amd64", None),
            ],
        ) {
            Err(PullError::NoLinuxAmd64 { platforms, .. }) => {
                assert_eq!(platforms, ["linux/arm64/v8", "windows/amd64"])
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn temp_file_sits_beside_dest() {
        let t = temp_path(Path::new("/a/b/layer.tar")).unwrap();
        assert_eq!(t.parent(), Some(Path::new("/a/b")));
        assert!(
            t.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(".layer.tar.part-")
        );
    }

    #[test]
    fn registry_errors_quote_no_remote_body() {
        let image: Reference = "registry.example/ci/base:1".parse().unwrap();
        let secret = "token=ghp_0123456789abcdef";
        let cases = [
            OciDistributionError::ServerError {
                code: 502,
                url: "https://registry.example/v2/ci/base/manifests/1".into(),
                message: secret.into(),
            },
            OciDistributionError::ManifestParsingError(secret.into()),
            OciDistributionError::AuthenticationFailure(secret.into()),
            OciDistributionError::GenericError(Some(secret.into())),
            OciDistributionError::SpecViolationError(secret.into()),
            OciDistributionError::RegistryTokenDecodeError(secret.into()),
        ];
        for err in cases {
            let shown = registry_error(err, &image).to_string();
            assert!(!shown.contains("ghp_"), "{shown}");
            assert!(shown.contains("registry.example"), "{shown}");
        }
    }

    #[test]
    fn reasons_split_transient_from_rejected() {
        let e = PullError::NotFound {
            reference: "x".into(),
        };
        assert_eq!(e.reason(), REASON_PULL_FAILED);
        let e = PullError::DigestMismatch {
            digest: "a".into(),
            actual: "b".into(),
        };
        assert_eq!(e.reason(), REASON_REJECTED);
    }
}
