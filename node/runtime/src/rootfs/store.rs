//! The image store: from an image request (base reference, optional runner layer image, pull
//! credentials) to a cached read-only ext4 base image, with a reference per VM.
//!
//! acquire = (`IfNotPresent`: the image these references were built or resolved from, for these
//! credentials, without asking the registry) or resolve both references (manifest digests,
//! layer descriptors) -> content key -> under a per-key lock (concurrent requests for one key
//! build once): hit, or fetch every layer with digest and size verified while applying the
//! verified ones in order into a private work directory, inject the guest agent and the mount
//! points, `mkfs.ext4 -d`, rename into `images/<key>.ext4`, index. prebuild is acquire without
//! a VM reference (docs/rootfs.md, Pre-build).
//! release drops the VM's reference; garbage collection deletes unreferenced images, least
//! recently used first, while the cache is over its byte budget.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use sha2::{Digest, Sha256};

use imp_api::PullPolicy;
use imp_api::names::reason;

use super::auth::{AuthError, RegistryAuth};
use super::cache::{self, CacheEntry, CacheIndex, RECIPE};
use super::ext4::{self, Ext4Error};
use super::flatten::{FlattenError, Flattener, Limits};
use super::pull::{Durability, LayerRef, PullConfig, PullError, Puller, ResolvedImage};
use crate::metrics::{OutcomeLabel, ReasonLabel, RootfsMetrics};

/// Where the guest agent goes in every image (ARCHITECTURE §5: the kernel runs it as init).
pub const GUEST_PATH: &str = "sbin/imp-guest";
/// Mount points imp-guest needs in the root it switches into; images may lack them.
const MOUNT_POINTS: [(&str, u32); 6] = [
    ("proc", 0o555),
    ("sys", 0o555),
    ("dev", 0o755),
    ("run", 0o755),
    ("tmp", 0o1777),
    ("etc", 0o755),
];

pub use imp_runtime_api::image::ImageSpec;

#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("pull credentials for {registry}: {source}")]
    Credentials { registry: String, source: AuthError },
    #[error("image {reference}: {source}")]
    Pull {
        reference: String,
        source: PullError,
    },
    #[error("image {reference}: {source}")]
    Layer {
        reference: String,
        source: FlattenError,
    },
    #[error("image {reference}: {source}")]
    Ext4 {
        reference: String,
        source: Ext4Error,
    },
    #[error("guest agent binary {path}: {source}")]
    Guest {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("guest agent binary {path} changed while an image was being built; retry")]
    GuestChanged { path: PathBuf },
    #[error("rootfs work directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("rootfs cache index: {0}")]
    Index(#[from] sqlx::Error),
    #[error("image build task failed: {0}")]
    Task(String),
}

impl RootfsError {
    /// The registry was unreachable (not a refusal): see `PullError::is_unreachable`.
    pub fn registry_unreachable(&self) -> bool {
        matches!(self, RootfsError::Pull { source, .. } if source.is_unreachable())
    }

    /// `RootfsPullFailed` (registry, network, credentials), `RootfsRejected` (the image broke an
    /// integrity or safety rule) or `RootfsBuildFailed` (this host: disk, mkfs, index).
    pub fn reason(&self) -> &'static str {
        match self {
            RootfsError::Credentials { .. } => reason::ROOTFS_PULL_FAILED,
            RootfsError::Pull { source, .. } => source.reason(),
            // A hostile, oversized or corrupt layer is the image's fault; I/O is this host's.
            RootfsError::Layer { source, .. } if source.is_image_fault() => reason::ROOTFS_REJECTED,
            RootfsError::Layer { .. } => reason::ROOTFS_BUILD_FAILED,
            RootfsError::Ext4 { .. }
            | RootfsError::Guest { .. }
            | RootfsError::GuestChanged { .. }
            | RootfsError::Io { .. }
            | RootfsError::Index(_)
            | RootfsError::Task(_) => reason::ROOTFS_BUILD_FAILED,
        }
    }
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// `images/` (built images) and `tmp/` (builds in progress) live here.
    pub dir: PathBuf,
    /// The static imp-guest injected at /sbin/imp-guest.
    pub guest_bin: PathBuf,
    pub budget_bytes: u64,
    pub limits: Limits,
    pub pull: PullConfig,
    /// Layer downloads in flight per build.
    pub parallel_fetches: usize,
}

/// What `acquire` handed out (or `prebuild` left in the cache).
#[derive(Debug, Clone, PartialEq)]
pub struct Acquired {
    pub key: String,
    pub path: PathBuf,
    /// Served from the cache (no build).
    pub hit: bool,
    /// Served from the cache because the registry could not be reached to resolve the tags.
    pub offline: bool,
    /// The references were resolved at the registry (false: `IfNotPresent` found the image
    /// built from them, or the registry was unreachable).
    pub resolved: bool,
}

/// Who an image is obtained for: a VM (referenced, counted as a VM-start hit or miss) or a
/// pre-build (unreferenced: it stays until garbage collection needs the room).
#[derive(Debug, Clone, Copy)]
enum Holder<'a> {
    Vm(&'a str),
    Prebuild,
}

/// Inode, size and mtime (s, ns): a changed guest binary is rehashed.
type FileIdentity = (u64, u64, i64, i64);

/// One layer to fetch: the image it belongs to (its registry and repository) and its credentials.
struct Fetch<'a> {
    image: &'a ResolvedImage,
    layer: &'a LayerRef,
    auth: &'a RegistryAuth,
}

pub struct RootfsStore {
    cfg: StoreConfig,
    index: CacheIndex,
    puller: Puller,
    metrics: RootfsMetrics,
    /// Single flight: one lock per key; builds, hand-outs and evictions of a key serialise.
    keys: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The guest binary's digest, memoised by its file identity.
    guest: Mutex<Option<(FileIdentity, String)>>,
    /// Keys `cache::credentials_fingerprint` (`<dir>/credentials.key`, random, root only).
    node_key: Vec<u8>,
}

/// The node's key for credential fingerprints: read, or made from the kernel's random source
/// on first use (0600; never leaves the state dir).
fn node_key(dir: &Path) -> Result<Vec<u8>, RootfsError> {
    use std::io::{Read as _, Write as _};
    let path = dir.join("credentials.key");
    match std::fs::read(&path) {
        Ok(k) if k.len() == 32 => return Ok(k),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&path)(e)),
    }
    let mut key = vec![0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .map_err(io_err(Path::new("/dev/urandom")))?;
    let tmp = dir.join("credentials.key.tmp");
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(&key).and_then(|_| f.sync_all()))
        .map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    Ok(key)
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RootfsError {
    let path = path.to_path_buf();
    move |source| RootfsError::Io { path, source }
}

fn sha256_hex(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Set when a build's future is dropped before its blocking step finished, so that step does
/// not put an image nobody indexes into the cache.
#[derive(Default)]
struct Wanted {
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Wanted {
    fn drop(&mut self) {
        self.abandoned
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The blocking half of a build: everything `build_in` hands to a worker thread.
struct ApplyJob {
    reference: String,
    /// In the order applied (a digest may appear twice); each blob path is filled by a verified
    /// download whose digest arrives on `verified`.
    layers: Vec<(String, PathBuf, super::Compression)>,
    verified: std::sync::mpsc::Receiver<String>,
    root: PathBuf,
    limits: Limits,
    guest_copy: PathBuf,
    made: PathBuf,
    dest: PathBuf,
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

/// Apply each layer once its blob is verified, inject the guest and the mount points,
/// `mkfs.ext4 -d`, rename into `images/`. `Ok(None)`: the downloads stopped before every blob
/// arrived (their error is the build's).
fn apply_and_mkfs(job: ApplyJob) -> Result<Option<(PathBuf, u64)>, RootfsError> {
    let reference = &job.reference;
    let layer_err = |source| RootfsError::Layer {
        reference: reference.clone(),
        source,
    };
    std::fs::create_dir(&job.root).map_err(io_err(&job.root))?;
    let mut flat = Flattener::new(&job.root, job.limits).map_err(layer_err)?;
    let mut verified: HashSet<String> = HashSet::new();
    for (i, (digest, blob, compression)) in job.layers.iter().enumerate() {
        while !verified.contains(digest) {
            match job.verified.recv() {
                Ok(d) => {
                    verified.insert(d);
                }
                Err(_) => return Ok(None),
            }
        }
        let file = std::fs::File::open(blob).map_err(io_err(blob))?;
        flat.apply_layer(digest, std::io::BufReader::new(file), *compression)
            .map_err(layer_err)?;
        if !job.layers[i + 1..].iter().any(|(d, _, _)| d == digest) {
            // Applied for the last time: the disk is the tree's and the image's now.
            let _ = std::fs::remove_file(blob);
        }
    }
    for (dir, mode) in MOUNT_POINTS {
        flat.ensure_dir(dir, mode).map_err(layer_err)?;
    }
    flat.inject_file(GUEST_PATH, &job.guest_copy, 0o755)
        .map_err(layer_err)?;
    ext4::build(&job.root, &job.made).map_err(|source| RootfsError::Ext4 {
        reference: reference.clone(),
        source,
    })?;
    if job.abandoned.load(std::sync::atomic::Ordering::SeqCst) {
        return Err(RootfsError::Task("build abandoned by its request".into()));
    }
    let bytes = std::fs::metadata(&job.made)
        .map_err(io_err(&job.made))?
        .len();
    std::fs::rename(&job.made, &job.dest).map_err(io_err(&job.dest))?;
    ext4::sync_dir(&job.dest).map_err(io_err(&job.dest))?;
    Ok(Some((job.dest, bytes)))
}

impl RootfsStore {
    /// Open the store over the runtime's database: interrupted builds are deleted, index rows
    /// whose file is gone are forgotten, image files without a row are deleted.
    pub async fn open(
        cfg: StoreConfig,
        pool: sqlx::sqlite::SqlitePool,
        metrics: RootfsMetrics,
    ) -> Result<Self, RootfsError> {
        let images = cfg.dir.join("images");
        let tmp = cfg.dir.join("tmp");
        std::fs::create_dir_all(&images).map_err(io_err(&images))?;
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
        }
        std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
        // Flattened trees hold setuid files and devices owned by image uids: root only.
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err(&tmp))?;
        let node_key = node_key(&cfg.dir)?;
        let store = Self {
            node_key,
            puller: Puller::new(cfg.pull.clone())
                .with_refusal_metric(metrics.pull_refusals.clone()),
            cfg,
            index: CacheIndex::new(pool),
            metrics,
            keys: Mutex::new(HashMap::new()),
            guest: Mutex::new(None),
        };
        let entries = store.index.list().await?;
        for e in &entries {
            if !e.path.is_file() {
                tracing::warn!(key = %e.key, path = %e.path.display(), "cached image file missing; forgetting it");
                store.index.forget(&e.key).await?;
            }
        }
        let known: HashSet<PathBuf> = entries.into_iter().map(|e| e.path).collect();
        for f in std::fs::read_dir(&images)
            .map_err(io_err(&images))?
            .flatten()
        {
            if !known.contains(&f.path()) {
                tracing::info!(path = %f.path().display(), "removing image file without an index row");
                let _ = std::fs::remove_file(f.path());
            }
        }
        store.refresh_gauges().await?;
        Ok(store)
    }

    pub fn index(&self) -> &CacheIndex {
        &self.index
    }

    fn key_lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.keys
            .lock()
            .expect("key locks")
            .entry(key.to_owned())
            .or_default()
            .clone()
    }

    fn auth_for(
        &self,
        spec: &ImageSpec,
        image_registry: &str,
    ) -> Result<RegistryAuth, RootfsError> {
        match &spec.credentials {
            None => Ok(RegistryAuth::Anonymous),
            Some(c) => c
                .for_registry(image_registry)
                .map_err(|source| RootfsError::Credentials {
                    registry: image_registry.to_owned(),
                    source,
                }),
        }
    }

    /// `pulled_with` of a request: the credentials it presents to each image's registry.
    fn pulled_with(&self, spec: &ImageSpec) -> Result<String, RootfsError> {
        let mut presented = Vec::new();
        for reference in std::iter::once(&spec.base).chain(spec.runner.as_ref()) {
            let registry =
                super::pull::registry_of(reference).map_err(|source| RootfsError::Pull {
                    reference: reference.to_owned(),
                    source,
                })?;
            presented.push(self.auth_for(spec, &registry)?);
        }
        let refs: Vec<&RegistryAuth> = presented.iter().collect();
        Ok(cache::credentials_fingerprint(&self.node_key, &refs))
    }

    async fn resolve(
        &self,
        spec: &ImageSpec,
        reference: &str,
    ) -> Result<(ResolvedImage, RegistryAuth), RootfsError> {
        let pull = |source| RootfsError::Pull {
            reference: reference.to_owned(),
            source,
        };
        let registry = super::pull::registry_of(reference).map_err(pull)?;
        let auth = self.auth_for(spec, &registry)?;
        let image = self.puller.resolve(reference, &auth).await.map_err(pull)?;
        Ok((image, auth))
    }

    /// The guest binary's digest, rehashed only when the file changed.
    fn guest_digest(&self) -> Result<String, RootfsError> {
        let path = &self.cfg.guest_bin;
        let md = std::fs::metadata(path).map_err(|source| RootfsError::Guest {
            path: path.clone(),
            source,
        })?;
        let sig = (md.ino(), md.size(), md.mtime(), md.mtime_nsec());
        let mut memo = self.guest.lock().expect("guest memo");
        if let Some((s, d)) = memo.as_ref()
            && *s == sig
        {
            return Ok(d.clone());
        }
        let bytes = std::fs::read(path).map_err(|source| RootfsError::Guest {
            path: path.clone(),
            source,
        })?;
        let digest = sha256_hex(&bytes);
        *memo = Some((sig, digest.clone()));
        Ok(digest)
    }

    /// The base image for VM `vm_uid` (idempotent per VM): built once per content key.
    pub async fn acquire(&self, vm_uid: &str, spec: &ImageSpec) -> Result<Acquired, RootfsError> {
        self.obtain(Holder::Vm(vm_uid), spec).await
    }

    /// Build the image of `spec` ahead of its first VM (the pool's pull policy applies, so an
    /// `IfNotPresent` image already built is not resolved again). Unreferenced afterwards:
    /// garbage collection may evict it, least recently used first, when the budget needs room
    /// (check `cached` in the answer); the VM that later uses it takes the reference.
    pub async fn prebuild(&self, spec: &ImageSpec) -> Result<Acquired, RootfsError> {
        self.metrics.prebuilds_in_progress.inc();
        let got = self.obtain(Holder::Prebuild, spec).await;
        self.metrics.prebuilds_in_progress.dec();
        let outcome = match &got {
            Ok(a) if a.hit => "cached",
            Ok(_) => "built",
            Err(_) => "failed",
        };
        self.metrics
            .prebuilds
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
        got
    }

    /// Whether the image of `key` is still in the cache (a pre-build may have been evicted).
    pub async fn is_cached(&self, key: &str) -> Result<bool, RootfsError> {
        Ok(self.index.get(key).await?.is_some_and(|e| e.path.is_file()))
    }

    async fn obtain(&self, holder: Holder<'_>, spec: &ImageSpec) -> Result<Acquired, RootfsError> {
        let guest = self.guest_digest()?;
        if spec.effective_pull_policy() == PullPolicy::IfNotPresent
            && let Some(a) = self.built_from_references(holder, spec, &guest).await?
        {
            tracing::debug!(?holder, key = %a.key, base = %spec.base, "image present; not asking the registry (IfNotPresent)");
            return Ok(a);
        }
        let resolved = async {
            let base = self.resolve(spec, &spec.base).await?;
            let runner = match &spec.runner {
                Some(r) => Some(self.resolve(spec, r).await?),
                None => None,
            };
            Ok::<_, RootfsError>((base, runner))
        }
        .await;
        let (base, runner) = match resolved {
            Ok(r) => r,
            Err(e @ RootfsError::Pull { .. }) if e.registry_unreachable() => {
                // The registry is down or unreachable: a VM may still start from an image
                // built earlier from the same references and the same guest agent.
                match self.built_from_references(holder, spec, &guest).await? {
                    Some(a) => {
                        tracing::warn!(?holder, base = %spec.base, error = %e, "registry unreachable; using the cached image built from the same references");
                        return Ok(Acquired { offline: true, ..a });
                    }
                    None => {
                        self.count_failure(&e);
                        return Err(e);
                    }
                }
            }
            Err(e) => {
                self.count_failure(&e);
                return Err(e);
            }
        };
        let mut layers: Vec<&LayerRef> = base.0.layers.iter().collect();
        if let Some((r, _)) = &runner {
            layers.extend(r.layers.iter());
        }
        let digests: Vec<&str> = layers.iter().map(|l| l.digest.as_str()).collect();
        let key = cache::cache_key(&digests, &guest, RECIPE);

        let pulled_with = cache::credentials_fingerprint(
            &self.node_key,
            &std::iter::once(&base.1)
                .chain(runner.as_ref().map(|(_, a)| a))
                .collect::<Vec<_>>(),
        );
        let lock = self.key_lock(&key);
        let _flight = lock.lock().await;
        if let Some(e) = self.index.get(&key).await? {
            if e.path.is_file() {
                self.hand_out(holder, &key, true).await?;
                self.index
                    .record_resolved(&spec.base, spec.runner.as_deref(), &pulled_with, &key)
                    .await?;
                return Ok(Acquired {
                    key,
                    path: e.path,
                    hit: true,
                    offline: false,
                    resolved: true,
                });
            }
            self.index.forget(&key).await?;
        }
        if let Holder::Vm(_) = holder {
            self.metrics.misses.inc();
        }
        let started = Instant::now();
        let mut fetches: Vec<Fetch> = base
            .0
            .layers
            .iter()
            .map(|layer| Fetch {
                image: &base.0,
                layer,
                auth: &base.1,
            })
            .collect();
        if let Some((img, auth)) = &runner {
            fetches.extend(img.layers.iter().map(|layer| Fetch {
                image: img,
                layer,
                auth,
            }));
        }
        let built = self.build(&key, &spec.base, &guest, fetches).await;
        let (path, bytes) = match built {
            Ok(b) => b,
            Err(e) => {
                self.count_failure(&e);
                return Err(e);
            }
        };
        let secs = started.elapsed().as_secs_f64();
        self.metrics.build_duration.observe(secs);
        let now = cache::now();
        self.index
            .insert(&CacheEntry {
                key: key.clone(),
                path: path.clone(),
                bytes,
                base_ref: spec.base.clone(),
                runner_ref: spec.runner.clone(),
                layers: digests.iter().map(|d| d.to_string()).collect(),
                build_seconds: secs,
                created_at: now,
                last_used_at: now,
                refs: 0,
                pulled_with: pulled_with.clone(),
            })
            .await?;
        self.index
            .record_resolved(&spec.base, spec.runner.as_deref(), &pulled_with, &key)
            .await?;
        self.hand_out(holder, &key, false).await?;
        tracing::info!(?holder, key = %key, base = %spec.base, runner = ?spec.runner, bytes, seconds = secs, "built base image");
        drop(_flight);
        self.gc().await?;
        Ok(Acquired {
            key,
            path,
            hit: false,
            offline: false,
            resolved: true,
        })
    }

    /// Under the key's lock: a VM takes its reference (and a hit is counted); a pre-build only
    /// marks the image used now, so LRU order keeps it ahead of older ones.
    async fn hand_out(&self, holder: Holder<'_>, key: &str, hit: bool) -> Result<(), RootfsError> {
        match holder {
            Holder::Vm(vm_uid) => {
                self.index.add_ref(vm_uid, key).await?;
                if hit {
                    self.metrics.hits.inc();
                }
            }
            Holder::Prebuild => self.index.touch(key).await?,
        }
        Ok(())
    }

    /// The newest image built on this node from exactly `spec`'s references, without asking
    /// the registry: for `IfNotPresent`, and when the registry is unreachable. Only the
    /// credentials that built it (or anyone, for an anonymous build) get it: a cached private
    /// image is never handed to a request the registry might refuse; such a request resolves.
    async fn built_from_references(
        &self,
        holder: Holder<'_>,
        spec: &ImageSpec,
        guest: &str,
    ) -> Result<Option<Acquired>, RootfsError> {
        let pulled_with = self.pulled_with(spec)?;
        let Some(e) = self
            .index
            .latest_for(&spec.base, spec.runner.as_deref(), &pulled_with)
            .await?
        else {
            return Ok(None);
        };
        let layers: Vec<&str> = e.layers.iter().map(String::as_str).collect();
        if cache::cache_key(&layers, guest, RECIPE) != e.key {
            // Built with another guest agent or recipe: not what this runtime would build.
            return Ok(None);
        }
        let lock = self.key_lock(&e.key);
        let _flight = lock.lock().await;
        if self.index.get(&e.key).await?.is_none() || !e.path.is_file() {
            return Ok(None);
        }
        self.hand_out(holder, &e.key, true).await?;
        Ok(Some(Acquired {
            key: e.key,
            path: e.path,
            hit: true,
            offline: false,
            resolved: false,
        }))
    }

    fn count_failure(&self, e: &RootfsError) {
        tracing::warn!(reason = e.reason(), error = %e, "base image build failed");
        self.metrics
            .build_failures
            .get_or_create(&ReasonLabel {
                reason: e.reason().into(),
            })
            .inc();
    }

    /// Fetch, flatten, inject, mkfs. Every attempt has a work directory of its own (a build
    /// abandoned by a cancelled request may still be flattening when the next attempt of the
    /// same key starts), removed whatever happens: by this future until the blocking step
    /// starts, by that step from then on (it ends as soon as the fetches stop, also when this
    /// future is dropped). The image is made inside it and renamed into `images/` only by an
    /// attempt that is still wanted.
    async fn build(
        &self,
        key: &str,
        reference: &str,
        guest_digest: &str,
        fetches: Vec<Fetch<'_>>,
    ) -> Result<(PathBuf, u64), RootfsError> {
        let tmp = self.cfg.dir.join("tmp");
        let work = tempfile::Builder::new()
            .prefix(&format!("{key}."))
            .tempdir_in(&tmp)
            .map_err(io_err(&tmp))?;
        let blobs = work.path().join("blobs");
        std::fs::create_dir_all(&blobs).map_err(io_err(&blobs))?;
        let wanted = Wanted::default();
        self.build_in(work, key, reference, guest_digest, fetches, &wanted)
            .await
    }

    /// Pipelined: downloads run (`parallel_fetches` at a time, each streamed to a verified file)
    /// while the blocking step applies, in order, every layer whose blob is already verified on
    /// disk; a layer is applied only once its digest and size have been checked, exactly as
    /// when everything was downloaded first. Memory stays bounded by the download buffers: a
    /// blob goes to disk, never into memory, and is deleted once its last use is applied.
    async fn build_in(
        &self,
        work_dir: tempfile::TempDir,
        key: &str,
        reference: &str,
        guest_digest: &str,
        fetches: Vec<Fetch<'_>>,
        wanted: &Wanted,
    ) -> Result<(PathBuf, u64), RootfsError> {
        let work = work_dir.path().to_path_buf();
        let blobs = work.join("blobs");
        // A layer shared by the base and the runner image is fetched once, applied twice.
        let mut unique: Vec<&Fetch> = Vec::new();
        for f in &fetches {
            if !unique.iter().any(|u| u.layer.digest == f.layer.digest) {
                unique.push(f);
            }
        }
        let blob_path = |digest: &str| blobs.join(digest.replace(':', "-"));

        // The guest copy injected is hashed again: the key must describe these exact bytes.
        let guest_copy = work.join("imp-guest");
        std::fs::copy(&self.cfg.guest_bin, &guest_copy).map_err(|source| RootfsError::Guest {
            path: self.cfg.guest_bin.clone(),
            source,
        })?;
        let copied = std::fs::read(&guest_copy).map_err(io_err(&guest_copy))?;
        if sha256_hex(&copied) != guest_digest {
            return Err(RootfsError::GuestChanged {
                path: self.cfg.guest_bin.clone(),
            });
        }

        let layers: Vec<(String, PathBuf, super::Compression)> = fetches
            .iter()
            .map(|f| {
                (
                    f.layer.digest.clone(),
                    blob_path(&f.layer.digest),
                    f.layer.compression,
                )
            })
            .collect();
        let (verified_tx, verified_rx) = std::sync::mpsc::channel::<String>();
        let root = work.join("root");
        let made = work.join("image.ext4");
        let dest = self.cfg.dir.join("images").join(format!("{key}.ext4"));
        let limits = self.cfg.limits;
        let owned_reference = reference.to_owned();
        let abandoned = wanted.abandoned.clone();
        let step = tokio::task::spawn_blocking(move || {
            // Owned here: removed when this step ends, even if its awaiter is gone.
            let _work_dir = work_dir;
            apply_and_mkfs(ApplyJob {
                reference: owned_reference,
                layers,
                verified: verified_rx,
                root,
                limits,
                guest_copy,
                made,
                dest,
                abandoned,
            })
        });

        // Boxed with an explicit Send bound: an async block in a stream adaptor closure trips
        // the compiler's higher-ranked Send check inside the axum handler.
        let downloads: Vec<futures::future::BoxFuture<'_, Result<String, RootfsError>>> = unique
            .into_iter()
            .map(|f| {
                let dest = blob_path(&f.layer.digest);
                let fut = async move {
                    self.puller
                        .fetch_layer_with(f.image, f.layer, f.auth, &dest, Durability::Scratch)
                        .await
                        .map_err(|source| RootfsError::Pull {
                            reference: f.image.reference.clone(),
                            source,
                        })?;
                    Ok(f.layer.digest.clone())
                };
                Box::pin(fut) as futures::future::BoxFuture<'_, _>
            })
            .collect();
        let fetched = async {
            let mut done =
                futures::stream::iter(downloads).buffer_unordered(self.cfg.parallel_fetches.max(1));
            while let Some(digest) = done.next().await {
                if verified_tx.send(digest?).is_err() {
                    // The step ended early (a refused layer): its error says why.
                    break;
                }
            }
            Ok::<(), RootfsError>(())
        }
        .await;
        // No more blobs: a step still waiting for one ends (and removes the work dir).
        drop(verified_tx);
        let stepped = step.await.map_err(|e| RootfsError::Task(e.to_string()))?;
        match (stepped, fetched) {
            (Err(e), _) => Err(e),
            (Ok(Some(built)), Ok(())) => Ok(built),
            (Ok(_), Err(e)) => Err(e),
            (Ok(None), Ok(())) => Err(RootfsError::Task(
                "layer downloads ended before every layer was fetched".into(),
            )),
        }
    }

    /// Drop VM `vm_uid`'s reference (idempotent), then collect garbage.
    pub async fn release(&self, vm_uid: &str) -> Result<(), RootfsError> {
        if self.index.remove_ref(vm_uid).await?.is_some() {
            self.gc().await?;
        }
        Ok(())
    }

    /// Forget references of VMs the runtime no longer has (after a restart), then collect.
    pub async fn retain_vms(&self, live_vms: &[String]) -> Result<(), RootfsError> {
        let dropped = self.index.retain_refs(live_vms).await?;
        if dropped > 0 {
            tracing::info!(
                dropped,
                "dropped image references of VMs that no longer exist"
            );
        }
        self.gc().await?;
        Ok(())
    }

    /// Delete unreferenced images, least recently used first, until under budget. Keys whose
    /// lock is held (a build or a hand-out in progress) are skipped.
    pub async fn gc(&self) -> Result<Vec<String>, RootfsError> {
        let entries = self.index.list().await?;
        let busy: HashSet<String> = entries
            .iter()
            .filter(|e| self.key_lock(&e.key).try_lock().is_err())
            .map(|e| e.key.clone())
            .collect();
        let mut evicted = Vec::new();
        for key in cache::plan_gc(&entries, self.cfg.budget_bytes, &busy) {
            let lock = self.key_lock(&key);
            let Ok(_held) = lock.try_lock() else {
                continue;
            };
            if !self.index.delete_unreferenced(&key).await? {
                continue;
            }
            let path = self.cfg.dir.join("images").join(format!("{key}.ext4"));
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), error = %e, "could not delete an evicted image");
            }
            tracing::info!(key = %key, "evicted base image");
            self.metrics.evictions.inc();
            evicted.push(key);
        }
        self.refresh_gauges().await?;
        Ok(evicted)
    }

    async fn refresh_gauges(&self) -> Result<(), RootfsError> {
        let entries = self.index.list().await?;
        let bytes: u64 = entries.iter().map(|e| e.bytes).sum();
        self.metrics.cache_bytes.set(bytes as i64);
        self.metrics.cache_images.set(entries.len() as i64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rootfs::auth::PullCredentials;
    use imp_testkit::tarball::TarBuilder;

    fn layer_error(limits: Limits, tar: Vec<u8>) -> RootfsError {
        let d = tempfile::tempdir().unwrap();
        let mut f = Flattener::new(d.path(), limits).unwrap();
        let source = f
            .apply_layer("sha256:abc", &tar[..], super::super::Compression::None)
            .unwrap_err();
        RootfsError::Layer {
            reference: "r/x:1".into(),
            source,
        }
    }

    #[test]
    fn hostile_oversized_and_corrupt_layers_are_the_image_fault() {
        let traversal = layer_error(
            Limits::default(),
            TarBuilder::new().file("../x", b"x", 0o644).into_tar(),
        );
        let bomb = layer_error(
            Limits {
                max_unpacked_bytes: 4096,
                ..Limits::default()
            },
            TarBuilder::new()
                .file("big", &[0u8; 65536], 0o644)
                .into_tar(),
        );
        let corrupt = layer_error(Limits::default(), vec![0x42; 1024]);
        for e in [traversal, bomb, corrupt] {
            assert_eq!(e.reason(), reason::ROOTFS_REJECTED, "{e}");
            assert!(!e.registry_unreachable());
        }
        let host = RootfsError::Io {
            path: "/x".into(),
            source: std::io::Error::other("disk full"),
        };
        assert_eq!(host.reason(), reason::ROOTFS_BUILD_FAILED);
    }

    #[test]
    fn image_spec_debug_never_shows_credentials() {
        let spec = ImageSpec {
            base: "r/x:1".into(),
            runner: None,
            credentials: Some(PullCredentials::Basic {
                username: "u".into(),
                password: imp_common::SecretString::from("hunter2-secret"),
            }),
            pull_policy: None,
        };
        let text = format!("{spec:?}");
        assert!(
            !text.contains("hunter2") && text.contains("redacted"),
            "{text}"
        );
        assert!(spec.without_credentials().credentials.is_none());
    }
}
