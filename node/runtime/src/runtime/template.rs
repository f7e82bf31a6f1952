//! Templates and clones (docs/snapshots.md): a template is a VM of a spec booted once without
//! identity, its guest agent ready, then migrated into `<state>/templates/<key>/mem` with its
//! writable drive at that moment; a `from_template` VM restores it into a fresh VMM with its
//! own drive copy, TAP and vsock path, and is Running only after `Reidentify` gave it an
//! identity of its own. The pure half (key, template spec, decision, GC plan) is `key`; this
//! file observes (entries, files, the VMM), applies `key::decide` and executes.

pub mod key;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use imp_guest::host::{Announcements, IdentityCheck};
use imp_guest::protocol::{AGENT_VSOCK_PORT, NetIdentity, Reidentify, WARM_DEFAULT_FILES, Warm};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::{Runtime, RuntimeError, Vm, vm};
use crate::api::{
    Backend, Failure, TemplateBuild, TemplateDryRun, TemplateState, TemplateStatus, VmSpec,
    WarmReport,
};
use crate::firecracker::CloneOverrides;
use crate::firecracker::api::NetworkOverride;
use crate::firecracker::jailer::{self, Place};
use crate::inventory::VmRecord;
use crate::metrics::{OutcomeLabel, ReasonLabel};
use crate::network;
use crate::qemu::{self, QemuFiles};
use crate::rootfs::writable::{WritableDrives, clone_file};
use crate::tap;
use crate::vmm::VmPlan;
pub use key::reason;
use key::{Content, Decision, KeyInputs, Known, Stamp, VmmFacts};

/// A failed build is retried by the next request after this long.
const RETRY_AFTER: Duration = Duration::from_secs(60);
/// Samples of earlier clones kept per template (a clone's must differ from each).
const MAX_SAMPLES: usize = 4096;
/// How long a clone's guest may take to answer `Reidentify`.
const REIDENTIFY_TIMEOUT: Duration = Duration::from_secs(60);
/// Entropy bytes a clone gets (within the protocol's 32..=512).
const ENTROPY_BYTES: usize = 64;
/// How long a build VM's guest may take to warm its page cache (then it is snapshotted cold).
const WARM_TIMEOUT: Duration = Duration::from_secs(300);
const WARM_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the migration's writer may hold a template's memory file after QEMU is gone.
const WRITER_TIMEOUT: Duration = Duration::from_secs(120);

/// A template's `meta.json`: the inputs it was built from and by, so a restore can say which
/// one no longer matches.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Meta {
    pub key: String,
    pub inputs: KeyInputs,
    pub content: Content,
    pub vmm: VmmFacts,
    /// The kernel command line the template booted with: a clone's QEMU is started with the
    /// same (its own identity comes by `Reidentify`).
    pub boot_args: String,
    pub build_seconds: f64,
    pub built_unix: u64,
    /// What the build read into the guest's page cache (a spec with `warm_paths`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<WarmReport>,
}

/// One template the runtime knows.
struct Entry {
    state: TemplateState,
    /// The template spec (paths resolved), for rebuilds.
    spec: VmSpec,
    meta: Option<Meta>,
    failure: Option<Failure>,
    failed_at: Option<Instant>,
    /// `Identified` random samples of its clones so far.
    samples: Vec<Vec<u8>>,
    clones: u64,
    last_used: u64,
    bytes: u64,
    /// A build of it is queued or running.
    building: bool,
}

impl Entry {
    fn new(spec: VmSpec) -> Self {
        Entry {
            state: TemplateState::Building,
            spec,
            meta: None,
            failure: None,
            failed_at: None,
            samples: Vec::new(),
            clones: 0,
            last_used: 0,
            bytes: 0,
            building: false,
        }
    }

    fn known(&self) -> Known {
        match (self.state, &self.meta) {
            (TemplateState::Building, _) => Known::Building,
            (TemplateState::Failed, _) => Known::Failed {
                retry: self.failed_at.is_none_or(|t| t.elapsed() >= RETRY_AFTER),
            },
            (TemplateState::Ready, Some(m)) => Known::Ready {
                content: Box::new(m.content.clone()),
                vmm: Box::new(m.vmm.clone()),
            },
            (TemplateState::Ready, None) => Known::None,
        }
    }
}

/// The node's templates: their entries and the queue of builds.
pub struct Templates {
    dir: PathBuf,
    entries: Mutex<HashMap<String, Entry>>,
    vmm: VmmFacts,
    builds: mpsc::UnboundedSender<String>,
    queue: Mutex<Option<mpsc::UnboundedReceiver<String>>>,
    /// Bytes the ready templates may hold together; past it, least recently used go.
    budget: u64,
}

/// A ready template a clone restores.
#[derive(Debug, Clone)]
pub(super) struct CloneSource {
    pub key: String,
    pub mem: PathBuf,
    /// Firecracker's device state file (`vmstate`); QEMU's stream has it in `mem`.
    pub vmstate: Option<PathBuf>,
    pub writable: Option<PathBuf>,
    pub boot_args: String,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Allocated bytes of the regular files in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}

/// `path` root's, 0600 (a directory 0700): no VM (another uid) reads a template's memory or
/// drive.
fn private(path: &Path) -> std::io::Result<()> {
    root_owned(path, if path.is_dir() { 0o700 } else { 0o600 })
}

/// A template's snapshot file (Firecracker's `mem` and `vmstate`): root's, 0444. Every clone's
/// jail hard-links this one inode (`jailer::Place::Template`, which makes it so anyway), so
/// each clone's uid reads it and none writes it; outside the jails it lies in the 0700
/// templates directory, which no VM reaches.
fn shared_read_only(path: &Path) -> std::io::Result<()> {
    root_owned(path, 0o444)
}

/// `path` root's with `mode`.
fn root_owned(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::os::unix::fs::chown(path, Some(0), Some(0)).or_else(|e| {
        // Unprivileged runtimes (tests without root) own their files already.
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            Ok(())
        } else {
            Err(e)
        }
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Names of a template's snapshot in a Firecracker clone's jail (beside the kernel, initrd and
/// drives `spawn_jailed` stages under the names the template's jail had).
const JAIL_VMSTATE: &str = "template.vmstate";
const JAIL_MEM: &str = "template.mem";

/// The host's CPU model (`model name` of /proc/cpuinfo): a KVM snapshot loads only on the
/// CPU model that took it.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_default()
}

/// The VMM facts of this runtime's Firecracker: its release (`bin --version`: a snapshot loads
/// only into the release that took it), KVM, the CPU model.
pub fn firecracker_facts(bin: &Path) -> VmmFacts {
    let version = match crate::firecracker::version(bin) {
        Ok(v) => format!("Firecracker v{v}"),
        Err(e) => {
            tracing::warn!(error = %e, "no Firecracker version: its templates match no other");
            "Firecracker (unknown version)".into()
        }
    };
    VmmFacts {
        version,
        accel: "kvm".into(),
        cpu: cpu_model(),
    }
}

/// The VMM facts of this runtime's QEMU: its version line, the accelerator it gets here, the
/// CPU model a KVM guest sees.
pub fn qemu_facts(cfg: &qemu::QemuConfig) -> VmmFacts {
    let version = std::process::Command::new(&cfg.qemu_bin)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_default();
    let accel = qemu::resolve_accel(cfg.accel, crate::vmm::kvm_usable()).to_string();
    let cpu = if accel == "kvm" {
        cpu_model()
    } else {
        "tcg".into()
    };
    VmmFacts {
        version,
        accel,
        cpu,
    }
}

impl Templates {
    /// The templates under `dir` (`<state>/templates`): complete ones (`mem`, `meta.json`) are
    /// Ready, anything else (an interrupted build) is removed. Returns also the keys removed.
    pub fn open(dir: &Path, vmm: VmmFacts, budget: u64) -> std::io::Result<(Self, Vec<String>)> {
        std::fs::create_dir_all(dir)?;
        private(dir)?;
        let mut entries = HashMap::new();
        let mut removed = Vec::new();
        for e in std::fs::read_dir(dir)?.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            let meta: Option<Meta> = std::fs::read(path.join("meta.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let complete = |m: &Meta| {
                path.join("mem").is_file()
                    && (m.inputs.backend != Backend::Firecracker || path.join("vmstate").is_file())
            };
            match meta.filter(|m| complete(m) && key::valid_key(&name) && m.key == name) {
                Some(meta) => {
                    let bytes = dir_bytes(&path);
                    let mut entry = Entry::new(VmSpec {
                        vcpu: meta.inputs.vcpu,
                        memory_mib: meta.inputs.memory_mib,
                        base_disk: None,
                        image: None,
                        writable_disk_bytes: meta.inputs.writable_disk_bytes,
                        kernel: None,
                        initrd: None,
                        extra_boot_args: None,
                        network: None,
                        from_template: false,
                        warm_paths: meta.inputs.warm_paths.clone(),
                    });
                    entry.state = TemplateState::Ready;
                    entry.bytes = bytes;
                    entry.last_used = meta.built_unix;
                    entry.meta = Some(meta);
                    entries.insert(name, entry);
                }
                None => {
                    let _ = std::fs::remove_dir_all(&path);
                    removed.push(name.trim_end_matches(".building").to_string());
                }
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        Ok((
            Templates {
                dir: dir.to_path_buf(),
                entries: Mutex::new(entries),
                vmm,
                builds: tx,
                queue: Mutex::new(Some(rx)),
                budget,
            },
            removed,
        ))
    }

    /// What is known of template `key`, if it is known.
    fn known(&self, key: &str) -> Option<Known> {
        self.entries
            .lock()
            .expect("templates")
            .get(key)
            .map(Entry::known)
    }

    fn dir_of(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }

    /// Keys of the templates that hold a base-image reference (every known one: a build takes
    /// it first).
    pub fn holders(&self) -> Vec<String> {
        self.entries
            .lock()
            .expect("templates")
            .keys()
            .map(|k| holder(k))
            .collect()
    }

    fn status(&self, key: &str, e: &Entry) -> TemplateStatus {
        TemplateStatus {
            key: key.to_string(),
            state: e.state,
            bytes: e.bytes,
            vmm: e.meta.as_ref().map_or_else(
                || self.vmm.version.clone(),
                |m| format!("{} ({}, {})", m.vmm.version, m.vmm.accel, m.vmm.cpu),
            ),
            build_seconds: e.meta.as_ref().map(|m| m.build_seconds),
            clones: e.clones,
            failure: e.failure.clone(),
            warm: e.meta.as_ref().and_then(|m| m.warm.clone()),
        }
    }

    pub fn list(&self) -> Vec<TemplateStatus> {
        let entries = self.entries.lock().expect("templates");
        let mut out: Vec<TemplateStatus> = entries.iter().map(|(k, e)| self.status(k, e)).collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// Start a build of `key` for `spec` unless one runs.
    fn queue_build(&self, key: &str, spec: &VmSpec) {
        let mut entries = self.entries.lock().expect("templates");
        let e = entries
            .entry(key.to_string())
            .or_insert_with(|| Entry::new(spec.clone()));
        if e.building {
            return;
        }
        e.building = true;
        e.spec = spec.clone();
        e.state = TemplateState::Building;
        let _ = self.builds.send(key.to_string());
    }

    /// Builds queued or running, sorted by key: each runs a VM of its spec's size.
    fn builds(&self) -> Vec<TemplateBuild> {
        let entries = self.entries.lock().expect("templates");
        let mut out: Vec<TemplateBuild> = entries
            .iter()
            .filter(|(_, e)| e.building)
            .map(|(k, e)| TemplateBuild {
                key: k.clone(),
                vcpu: e.spec.vcpu,
                memory_mib: e.spec.memory_mib,
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    fn ready_bytes(&self) -> u64 {
        self.entries
            .lock()
            .expect("templates")
            .values()
            .filter(|e| e.state == TemplateState::Ready)
            .map(|e| e.bytes)
            .sum()
    }
}

/// The base-image reference holder (and VM directory name, jailer id) of template `key`'s
/// build: not a valid VM uid (it has a capital), so no VM ever has it, and a valid jailer id
/// (alphanumerics and hyphens).
pub fn holder(key: &str) -> String {
    format!("Tmpl-{key}")
}

/// 64 bytes from the host's `getrandom(2)`: a clone's entropy (never logged).
fn host_entropy() -> Vec<u8> {
    let mut buf = vec![0u8; ENTROPY_BYTES];
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`.
        let n =
            unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n > 0 {
            filled += n as usize;
        }
    }
    buf
}

/// The network identity a cold boot of `spec` as VM `uid` would have: its MAC, and with an
/// attachment its address, gateway, MTU and resolvers.
fn net_identity(uid: &str, spec: &VmSpec) -> Option<NetIdentity> {
    let a = spec.network.as_ref()?.attachment.as_ref()?;
    Some(NetIdentity {
        mac: network::format_mac(&super::plan::guest_mac(uid, spec)),
        address: a.address.addr().to_string(),
        prefix: u32::from(a.address.prefix_len()),
        gateway: a.gateway.to_string(),
        mtu: a.mtu,
        dns: a.dns.iter().map(ToString::to_string).collect(),
        dns_search: Vec::new(),
    })
}

/// Why an unjailed Firecracker keeps no templates.
const UNJAILED: &str = "an unjailed Firecracker keeps no templates: a snapshot records its drives' host paths, which a load cannot override, so clones need jails (--jailer-path)";

impl Runtime {
    /// Whether this runtime's backend keeps templates: QEMU, and Firecracker through its
    /// jailer (a clone's jail gives the template's drive paths the clone's own files).
    fn keeps_templates(&self) -> bool {
        match self.cfg.backend {
            Backend::Qemu => true,
            Backend::Firecracker => self.jailer(Backend::Firecracker).is_some(),
        }
    }

    /// `POST /v1/templates`: the template for `spec` (its paths resolved), building it in the
    /// background when there is none (or it is stale, or its last build failed long enough
    /// ago). Answers at once.
    pub async fn ensure_template(&self, spec: &VmSpec) -> Result<TemplateStatus, RuntimeError> {
        let (key, tspec) = self.requested_template(spec)?;
        let known = self.templates.known(&key);
        if !self.keeps_templates() {
            return Ok(TemplateStatus {
                key,
                state: TemplateState::Failed,
                bytes: 0,
                vmm: self.templates.vmm.version.clone(),
                build_seconds: None,
                clones: 0,
                failure: Some(Failure {
                    reason: reason::TEMPLATE_UNSUPPORTED.into(),
                    message: UNJAILED.into(),
                }),
                warm: None,
            });
        }
        if key::request_builds(known.as_ref().unwrap_or(&Known::None), &self.templates.vmm) {
            self.templates.queue_build(&key, &tspec);
        }
        let entries = self.templates.entries.lock().expect("templates");
        let e = entries.get(&key).expect("entry exists after a request");
        Ok(self.templates.status(&key, e))
    }

    /// `POST /v1/templates/dry-run`: what [`Self::ensure_template`] would find for `spec` and
    /// whether it would start a build; nothing is started (the agent asks first, so a build
    /// takes a VM's room only when the node has it).
    pub async fn template_dry_run(&self, spec: &VmSpec) -> Result<TemplateDryRun, RuntimeError> {
        let (key, _) = self.requested_template(spec)?;
        if !self.keeps_templates() {
            // ensure_template answers Failed TemplateUnsupported and builds nothing.
            return Ok(TemplateDryRun {
                key,
                template: None,
                would_build: false,
            });
        }
        let known = self.templates.known(&key).unwrap_or(Known::None);
        let template = {
            let entries = self.templates.entries.lock().expect("templates");
            entries.get(&key).map(|e| self.templates.status(&key, e))
        };
        Ok(TemplateDryRun {
            would_build: key::request_builds(&known, &self.templates.vmm),
            key,
            template,
        })
    }

    /// What templates take of the node: their budget, the Ready ones' bytes, and the builds
    /// queued or running with their VM's size (`GET /v1/capacity`).
    pub fn template_capacity(&self) -> (u64, u64, Vec<TemplateBuild>) {
        (
            self.templates.budget,
            self.templates.ready_bytes(),
            self.templates.builds(),
        )
    }

    pub fn templates(&self) -> Vec<TemplateStatus> {
        self.templates.list()
    }

    /// `DELETE /v1/templates/{key}`: its files and its base-image reference go (a restore that
    /// opened them keeps reading what it opened). Idempotent.
    pub async fn delete_template(&self, key: &str) -> Result<(), RuntimeError> {
        if !key::valid_key(key) {
            return Err(RuntimeError::InvalidTemplateKey(key.into()));
        }
        let removed = self
            .templates
            .entries
            .lock()
            .expect("templates")
            .remove(key);
        if removed.is_some_and(|e| e.state == TemplateState::Building) {
            // The build notices its entry is gone when it finishes and drops its result.
            tracing::info!(key, "template deleted while building");
        }
        self.remove_template_files(key).await;
        self.refresh_template_gauges();
        Ok(())
    }

    async fn remove_template_files(&self, key: &str) {
        let _ = std::fs::remove_dir_all(self.templates.dir_of(key));
        if let Err(e) = self.rootfs.release(&holder(key)).await {
            tracing::warn!(key, error = %e, "releasing a template's base image failed");
        }
    }

    pub(super) fn refresh_template_gauges(&self) {
        let entries = self.templates.entries.lock().expect("templates");
        let ready: Vec<&Entry> = entries
            .values()
            .filter(|e| e.state == TemplateState::Ready)
            .collect();
        self.metrics
            .template_bytes
            .set(ready.iter().map(|e| e.bytes).sum::<u64>() as i64);
        self.metrics.templates.set(ready.len() as i64);
    }

    /// The key inputs and template spec of a (resolved) spec.
    /// A template request's key and template spec: `spec` validated (400 naming the field) and
    /// its paths resolved, as [`Self::ensure_template`] and its dry run both take it.
    fn requested_template(&self, spec: &VmSpec) -> Result<(String, VmSpec), RuntimeError> {
        super::validate::spec(spec).map_err(RuntimeError::InvalidSpec)?;
        let resolved = self.resolve_paths(spec)?;
        let (inputs, tspec) = self.template_inputs(&resolved);
        Ok((key::key(&inputs), tspec))
    }

    fn template_inputs(&self, spec: &VmSpec) -> (KeyInputs, VmSpec) {
        let (kernel, initrd) = self.boot_files(spec);
        let inputs = key::key_inputs(spec, self.cfg.backend, &kernel, initrd.as_deref());
        let tspec = VmSpec {
            kernel: Some(kernel),
            initrd,
            ..key::template_spec(spec)
        };
        (inputs, tspec)
    }

    /// What the names of a recorded VM's inputs point at now (its base image known).
    fn content_of(&self, r: &VmRecord, spec: &VmSpec) -> Content {
        let (kernel, initrd) = self.boot_files(spec);
        let image = spec.image.is_some();
        Content {
            image_key: image
                .then(|| r.base_disk.file_stem())
                .flatten()
                .map(|s| s.to_string_lossy().into_owned()),
            base_disk: (!image).then(|| Stamp::of(&r.base_disk)).flatten(),
            kernel: Stamp::of(&kernel).unwrap_or(Stamp {
                bytes: 0,
                mtime_ns: 0,
            }),
            initrd: initrd.as_deref().and_then(Stamp::of),
        }
    }

    /// A `from_template` start of row `r` (its base image known): the template to restore,
    /// or why it boots (starting the template's build when that helps the next one).
    pub(super) fn template_for(
        &self,
        r: &VmRecord,
        spec: &VmSpec,
    ) -> (Option<CloneSource>, Option<Failure>) {
        let (inputs, tspec) = self.template_inputs(spec);
        let key = key::key(&inputs);
        let content = self.content_of(r, spec);
        let known = self.templates.known(&key).unwrap_or(Known::None);
        let decision = key::decide(
            r.backend == self.cfg.backend && self.keeps_templates(),
            &known,
            &content,
            &self.templates.vmm,
        );
        let cold = |fallback: &str, message: String| {
            self.metrics
                .restores
                .get_or_create(&OutcomeLabel {
                    outcome: fallback.into(),
                })
                .inc();
            tracing::info!(uid = %r.uid, key, fallback, message, "booting instead of cloning");
            (
                None,
                Some(Failure {
                    reason: fallback.into(),
                    message,
                }),
            )
        };
        match decision {
            Decision::Clone => {
                let dir = self.templates.dir_of(&key);
                let meta = {
                    let mut entries = self.templates.entries.lock().expect("templates");
                    let e = entries.get_mut(&key).expect("a ready template");
                    e.last_used = unix_now();
                    e.meta.clone().expect("a ready template has meta")
                };
                (
                    Some(CloneSource {
                        key,
                        mem: dir.join("mem"),
                        vmstate: (r.backend == Backend::Firecracker).then(|| dir.join("vmstate")),
                        writable: inputs.writable_disk_bytes.map(|_| dir.join("writable.img")),
                        boot_args: meta.boot_args,
                    }),
                    None,
                )
            }
            Decision::Cold { fallback, build } => {
                if build {
                    self.templates.queue_build(&key, &tspec);
                }
                let message = match (&known, fallback) {
                    (Known::Ready { vmm, .. }, reason::TEMPLATE_VMM_MISMATCH) => format!(
                        "template {key} was built with {} ({}, {}); this runtime has {} ({}, {})",
                        vmm.version,
                        vmm.accel,
                        vmm.cpu,
                        self.templates.vmm.version,
                        self.templates.vmm.accel,
                        self.templates.vmm.cpu
                    ),
                    (Known::Ready { content: c, .. }, reason::TEMPLATE_STALE) => {
                        let what = if c.image_key != content.image_key {
                            "the image"
                        } else if c.kernel != content.kernel {
                            "the kernel"
                        } else if c.initrd != content.initrd {
                            "the initrd"
                        } else {
                            "the base disk"
                        };
                        format!("{what} changed since template {key} was built; rebuilding")
                    }
                    (_, reason::TEMPLATE_UNSUPPORTED) => UNJAILED.to_string(),
                    (_, reason::TEMPLATE_FAILED) => {
                        let entries = self.templates.entries.lock().expect("templates");
                        let why = entries
                            .get(&key)
                            .and_then(|e| e.failure.as_ref())
                            .map(|f| format!("{}: {}", f.reason, f.message))
                            .unwrap_or_default();
                        format!("the last build of template {key} failed: {why}")
                    }
                    _ => format!("template {key} is not ready"),
                };
                cold(fallback, message)
            }
        }
    }

    /// A fresh VMM for row `r` restoring template `src`, running, and where its guest's
    /// announcements arrive (if bound). On error, the message and what to kill. The backend's
    /// own steps are behind this match.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn restore_clone(
        &self,
        r: &mut VmRecord,
        spec: &VmSpec,
        plan: &VmPlan,
        cgroups: &[PathBuf],
        jail: Option<&crate::jail::VmJail>,
        src: &CloneSource,
        deadline: Instant,
    ) -> Result<(Vm, Option<Announcements>), (String, Option<Vm>)> {
        match r.backend {
            Backend::Qemu => self
                .restore_qemu_clone(r, plan, cgroups, jail, src, deadline)
                .await
                .map(|vm| (vm, None)),
            Backend::Firecracker => {
                self.restore_firecracker_clone(r, spec, plan, jail, src)
                    .await
            }
        }
    }

    /// A fresh jailed Firecracker for row `r` loading template `src` (the recipe of
    /// firecracker/jailer.rs): its jail holds the template's `vmstate` and `mem` (one
    /// hard-linked, root-owned, read-only inode for all clones), the shared kernel, initrd and
    /// base image, and its own copy of the template's writable drive, each under the name the
    /// template's jail had (a load cannot override drive paths); the load gives it its own TAP
    /// (`network_overrides`) and vsock socket (`vsock_override`) and resumes it.
    async fn restore_firecracker_clone(
        &self,
        r: &mut VmRecord,
        spec: &VmSpec,
        plan: &VmPlan,
        jail: Option<&crate::jail::VmJail>,
        src: &CloneSource,
    ) -> Result<(Vm, Option<Announcements>), (String, Option<Vm>)> {
        let files = vm::files_of(r);
        let (Some(j), Some(root)) = (jail, files.jail.clone()) else {
            return Err((UNJAILED.into(), None));
        };
        let vmstate = src
            .vmstate
            .as_deref()
            .ok_or(("the template has no vmstate file".to_string(), None))?;
        let snapshot = [
            (vmstate, JAIL_VMSTATE, Place::Template),
            (src.mem.as_path(), JAIL_MEM, Place::Template),
        ];
        let (vmm, staged) = self
            .spawn_jailed(r, spec, &files, plan, j.id, &snapshot)
            .await
            .map_err(|e| (e.to_string(), None))?;
        let vm = Vm::Firecracker(vmm.clone());
        let fail = |m: String| (m, Some(vm.clone()));
        self.record_vmm(r, vmm.process)
            .await
            .map_err(|e| fail(e.to_string()))?;
        vmm.wait_api_ready()
            .await
            .map_err(|e| fail(e.to_string()))?;
        let overrides = CloneOverrides {
            network: staged
                .nics
                .iter()
                .map(|n| NetworkOverride {
                    iface_id: n.id.into(),
                    host_dev_name: n.tap.clone(),
                })
                .collect(),
            // Reidentify sets the clock (older releases refuse the field).
            clock_realtime: false,
        };
        // Before the load, as before a boot's InstanceStart: a restored guest whose agent
        // announces itself (the simulator's fresh one does) is found at once; one that does not
        // (a real guest was listening when snapshotted) answers the first connect anyway.
        let heard = crate::vmm::listen_for_announcements(&files.vsock, Some(j.id));
        let loaded = vmm
            .restore_clone(&root.join(JAIL_VMSTATE), &root.join(JAIL_MEM), &overrides)
            .await;
        // Loaded or not, the links go: the state was read, the memory is mapped (the mapping
        // holds the inode), and a cold boot after a failed load must not find them.
        for name in [JAIL_VMSTATE, JAIL_MEM] {
            let _ = std::fs::remove_file(root.join(name));
        }
        loaded.map_err(|e| fail(e.to_string()))?;
        jailer::expose_vsock(&files.vsock, &r.vsock_path, j.id).map_err(|e| fail(e.to_string()))?;
        self.inventory
            .set_state(&r.uid, crate::api::VmState::Booting)
            .await
            .map_err(|e| fail(e.to_string()))?;
        Ok((vm, heard))
    }

    /// A fresh QEMU for row `r` loading template `src` (vsock device first, each process
    /// recorded as it exists), running once the stream is in.
    async fn restore_qemu_clone(
        &self,
        r: &mut VmRecord,
        plan: &VmPlan,
        cgroups: &[PathBuf],
        jail: Option<&crate::jail::VmJail>,
        src: &CloneSource,
        deadline: Instant,
    ) -> Result<Vm, (String, Option<Vm>)> {
        let uid = r.uid.clone();
        let files = QemuFiles::in_dir(&r.dir, &r.api_socket, &r.vsock_path, &r.serial_log);
        let (vhost, helper_only) = self
            .spawn_restore_helper(r, &files, plan.guest_cid, cgroups, jail)
            .await?;
        // The runtime opens the template's memory and hands QEMU the descriptor: a confined
        // QEMU never sees the templates directory.
        let proc = qemu::spawn_qemu_incoming(&self.cfg.qemu, &files, plan, cgroups, jail, &src.mem)
            .await
            .map_err(|e| (e.to_string(), Some(helper_only.clone())))?;
        let q = self.record_restored_qemu(r, &files, proc, vhost).await?;
        let vm = Vm::Qemu(q.clone());
        let fail = |m: String| (m, Some(vm.clone()));
        self.inventory
            .set_state(&uid, crate::api::VmState::Booting)
            .await
            .map_err(|e| fail(e.to_string()))?;
        q.finish_incoming(deadline)
            .await
            .map_err(|e| fail(format!("incoming migration: {e}")))?;
        Ok(vm)
    }

    /// A clone's writable drive: a copy (reflink or sparse) of the template's at snapshot time.
    pub(super) fn clone_writable(src: &CloneSource, dest: &Path) -> Result<(), String> {
        let from = src
            .writable
            .as_ref()
            .ok_or("the template has no writable drive")?;
        let _ = WritableDrives::remove(dest);
        clone_file(from, dest)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Give a restored clone its own identity (docs/guest-protocol.md, "Identity") and check
    /// the evidence: entropy from the host, the hostname and network identity a cold boot of
    /// its spec would have, a machine-id the guest draws after the reseed, the host's clock.
    pub(super) async fn reidentify_clone(
        &self,
        r: &VmRecord,
        spec: &VmSpec,
        key: &str,
        deadline: Instant,
    ) -> Result<(), String> {
        use base64::Engine as _;
        let mut guest = imp_guest::host::connect(&r.vsock_path, AGENT_VSOCK_PORT, deadline)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        // Within the clone's boot deadline: a guest that never answers fails the start in time.
        let left = deadline.saturating_duration_since(Instant::now());
        guest.set_answer_timeout(REIDENTIFY_TIMEOUT.min(left).max(Duration::from_secs(1)));
        let previous_samples = self
            .templates
            .entries
            .lock()
            .expect("templates")
            .get(key)
            .map(|e| e.samples.clone())
            .unwrap_or_default();
        let req = Reidentify {
            entropy_b64: base64::engine::general_purpose::STANDARD.encode(host_entropy()),
            hostname: key::clone_hostname(&r.uid, spec),
            machine_id: None,
            wall_clock_unix_ns: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
            network: net_identity(&r.uid, spec),
        };
        let check = IdentityCheck {
            previous_samples,
            ..IdentityCheck::default()
        };
        let got = guest.reidentify(req, &check).await.map_err(|e| {
            let kind = match &e {
                imp_guest::host::HostError::Evidence(_) => "evidence",
                imp_guest::host::HostError::Guest(_) => "refused",
                imp_guest::host::HostError::NoAnswer { .. } => "timeout",
                _ => "connection",
            };
            self.metrics
                .reidentify_failures
                .get_or_create(&ReasonLabel {
                    reason: kind.into(),
                })
                .inc();
            e.to_string()
        })?;
        let mut entries = self.templates.entries.lock().expect("templates");
        if let Some(e) = entries.get_mut(key) {
            e.clones += 1;
            if let Some(s) = got.random_sample() {
                e.samples.push(s);
                if e.samples.len() > MAX_SAMPLES {
                    e.samples.remove(0);
                }
            }
        }
        Ok(())
    }

    /// Run queued template builds one at a time, for as long as the runtime lives.
    pub(super) async fn build_templates(rt: Weak<Self>) {
        let Some(mut queue) = rt
            .upgrade()
            .and_then(|rt| rt.templates.queue.lock().expect("queue").take())
        else {
            return;
        };
        while let Some(key) = queue.recv().await {
            let Some(rt) = rt.upgrade() else { return };
            let spec = {
                let entries = rt.templates.entries.lock().expect("templates");
                match entries.get(&key) {
                    Some(e) if e.state == TemplateState::Building => e.spec.clone(),
                    _ => continue,
                }
            };
            let started = Instant::now();
            let outcome = rt.build_template(&key, &spec, started).await;
            let secs = started.elapsed().as_secs_f64();
            let label = if outcome.is_ok() { "built" } else { "failed" };
            rt.metrics
                .template_builds
                .get_or_create(&OutcomeLabel {
                    outcome: label.into(),
                })
                .inc();
            let deleted = {
                let mut entries = rt.templates.entries.lock().expect("templates");
                match entries.get_mut(&key) {
                    None => true,
                    Some(e) => {
                        e.building = false;
                        match outcome {
                            Ok(meta) => {
                                tracing::info!(key, seconds = secs, "template ready");
                                e.bytes = dir_bytes(&rt.templates.dir_of(&key));
                                e.state = TemplateState::Ready;
                                e.failure = None;
                                e.last_used = unix_now();
                                e.meta = Some(meta);
                                // Samples of the previous build's clones stay: a repeat is
                                // still a repeat.
                            }
                            Err(failure) => {
                                tracing::warn!(key, reason = %failure.reason, message = %failure.message, "template build failed");
                                e.state = TemplateState::Failed;
                                e.bytes = 0;
                                e.failure = Some(failure);
                                e.failed_at = Some(Instant::now());
                                e.meta = None;
                            }
                        }
                        false
                    }
                }
            };
            if deleted {
                // Deleted while building: drop what was built.
                rt.remove_template_files(&key).await;
                continue;
            }
            rt.gc_templates().await;
            rt.refresh_template_gauges();
        }
    }

    /// Ready templates over the budget go, least recently used first.
    pub(super) async fn gc_templates(&self) {
        if self.templates.ready_bytes() <= self.templates.budget {
            return;
        }
        let all: Vec<(String, u64, u64)> = self
            .templates
            .entries
            .lock()
            .expect("templates")
            .iter()
            .filter(|(_, e)| e.state == TemplateState::Ready)
            .map(|(k, e)| (k.clone(), e.bytes, e.last_used))
            .collect();
        for key in key::plan_gc(&all, self.templates.budget, &[]) {
            tracing::info!(key, "evicting a template over the budget");
            self.templates
                .entries
                .lock()
                .expect("templates")
                .remove(&key);
            self.remove_template_files(&key).await;
            self.metrics
                .template_builds
                .get_or_create(&OutcomeLabel {
                    outcome: "evicted".into(),
                })
                .inc();
        }
    }

    /// Boot a VM of the template spec without identity, wait for its guest agent, warm its
    /// page cache (`warm_template`, a spec with `warm_paths`), migrate it
    /// into `<templates>/<key>.building/mem` with its writable drive, stop it; then the
    /// directory becomes `<templates>/<key>` with `meta.json`. Whatever fails, the build VM's
    /// process, TAP, cgroup and directory go.
    async fn build_template(
        &self,
        key: &str,
        spec: &VmSpec,
        started: Instant,
    ) -> Result<Meta, Failure> {
        let failed = |reason: &str, message: String| Failure {
            reason: reason.into(),
            message,
        };
        if !self.keeps_templates() {
            return Err(failed(reason::TEMPLATE_UNSUPPORTED, UNJAILED.into()));
        }
        let uid = holder(key);
        let mut rec = self.new_record(&uid, spec, "{}".into());
        // A previous interrupted attempt's leftovers.
        let _ = std::fs::remove_dir_all(&rec.dir);
        let building = self.templates.dir.join(format!("{key}.building"));
        let _ = std::fs::remove_dir_all(&building);
        // A rebuild replaces a stale template: nobody restores it while this builds (its entry
        // is Building), and a failed rebuild must not leave it on disk.
        let _ = std::fs::remove_dir_all(self.templates.dir_of(key));
        let out = async {
            std::fs::create_dir_all(&building)
                .map_err(|e| failed(reason::TEMPLATE_FAILED, format!("create dir: {e}")))?;
            private(&building)
                .map_err(|e| failed(reason::TEMPLATE_FAILED, format!("own dir: {e}")))?;
            if let Err((e, vm)) = self.bring_up(&mut rec, spec).await {
                if let Some(vm) = vm {
                    vm.kill().await;
                }
                return Err(failed(e.reason(), e.to_string()));
            }
            let warm = self.warm_template(key, &rec, spec).await?;
            let boot_args = self.plan_of(&rec, spec).boot_args;
            let mem = building.join("mem");
            // The backend's snapshot.
            let mut shared = vec![mem.clone()];
            match vm::of_record(&rec) {
                Some(Vm::Qemu(q)) => {
                    let migrated = q.migrate_to_file(&mem).await;
                    q.kill().await;
                    migrated
                        .map_err(|e| failed(reason::TEMPLATE_FAILED, format!("snapshot: {e}")))?;
                    if !qemu::wait_file_closed(&mem, WRITER_TIMEOUT).await {
                        return Err(failed(
                            reason::TEMPLATE_FAILED,
                            "the migration's writer still holds the memory file".into(),
                        ));
                    }
                    // QEMU's clones read it through a descriptor the runtime opens: 0600.
                    shared.clear();
                }
                Some(Vm::Firecracker(v)) => {
                    // Paused, snapshotted into its jail, killed (never resumed: the drive stays
                    // as the snapshot's guest left it); then the files leave the jail.
                    let Some(root) = v.files.jail.clone() else {
                        v.kill().await;
                        return Err(failed(reason::TEMPLATE_UNSUPPORTED, UNJAILED.into()));
                    };
                    let (snap, in_jail) = (root.join(JAIL_VMSTATE), root.join(JAIL_MEM));
                    let made = match v.pause().await {
                        Ok(()) => v.snapshot_create(&snap, &in_jail).await,
                        Err(e) => Err(e),
                    };
                    v.kill().await;
                    made.map_err(|e| failed(reason::TEMPLATE_FAILED, format!("snapshot: {e}")))?;
                    let vmstate = building.join("vmstate");
                    for (from, to) in [(&snap, &vmstate), (&in_jail, &mem)] {
                        std::fs::rename(from, to).map_err(|e| {
                            failed(
                                reason::TEMPLATE_FAILED,
                                format!("move {} out of the jail: {e}", from.display()),
                            )
                        })?;
                    }
                    shared.push(vmstate);
                }
                None => {
                    return Err(failed(reason::TEMPLATE_FAILED, "no VMM recorded".into()));
                }
            }
            let mut files = if shared.is_empty() {
                vec![mem]
            } else {
                Vec::new()
            };
            for f in &shared {
                shared_read_only(f).map_err(|e| {
                    failed(reason::TEMPLATE_FAILED, format!("own {}: {e}", f.display()))
                })?;
            }
            if let Some(w) = &rec.writable_disk {
                let dest = building.join("writable.img");
                std::fs::rename(w, &dest)
                    .map_err(|e| failed(reason::TEMPLATE_FAILED, format!("move drive: {e}")))?;
                files.push(dest);
            }
            for f in &files {
                private(f).map_err(|e| {
                    failed(reason::TEMPLATE_FAILED, format!("own {}: {e}", f.display()))
                })?;
            }
            let (inputs, _) = self.template_inputs(spec);
            let meta = Meta {
                key: key.to_string(),
                inputs,
                content: self.content_of(&rec, spec),
                vmm: self.templates.vmm.clone(),
                boot_args,
                build_seconds: started.elapsed().as_secs_f64(),
                built_unix: unix_now(),
                warm,
            };
            let meta_path = building.join("meta.json");
            std::fs::write(
                &meta_path,
                serde_json::to_vec_pretty(&meta).expect("meta serialises"),
            )
            .and_then(|()| private(&meta_path))
            .map_err(|e| failed(reason::TEMPLATE_FAILED, format!("write meta: {e}")))?;
            let dest = self.templates.dir_of(key);
            std::fs::rename(&building, &dest)
                .map_err(|e| failed(reason::TEMPLATE_FAILED, format!("rename: {e}")))?;
            Ok(meta)
        }
        .await;
        // The build VM's host resources, except its base-image reference (the template's).
        if let Some(v) = vm::of_record(&rec) {
            v.kill().await;
        }
        if let Some(t) = &rec.tap
            && let Err(e) = tap::delete(t)
        {
            tracing::warn!(key, tap = %t, error = %e, "template TAP delete failed");
        }
        self.remove_cgroup(&uid).await;
        let _ = std::fs::remove_dir_all(&rec.dir);
        // A jailed build VM's jail, `<base>/<exec name>/<uid>` above its root.
        if let Some(dir) = vm::jail_root_of(&rec)
            .as_deref()
            .and_then(Path::parent)
            .filter(|d| d.file_name().is_some_and(|n| n == uid.as_str()))
        {
            let _ = std::fs::remove_dir_all(dir);
        }
        if out.is_err() {
            let _ = std::fs::remove_dir_all(&building);
            if let Err(e) = self.rootfs.release(&uid).await {
                tracing::warn!(key, error = %e, "releasing a failed template's base image failed");
            }
        }
        out
    }

    /// The build VM's `Warm` of the spec's `warm_paths` (none: nothing asked, `None`), judged
    /// by `key::judge_warm`: its report, or the build's failure. The VM is killed by the
    /// caller either way.
    async fn warm_template(
        &self,
        key: &str,
        rec: &VmRecord,
        spec: &VmSpec,
    ) -> Result<Option<WarmReport>, Failure> {
        if spec.warm_paths.is_empty() {
            return Ok(None);
        }
        let req = Warm {
            paths: spec.warm_paths.clone(),
            max_bytes: key::warm_max_bytes(spec.memory_mib),
            max_files: WARM_DEFAULT_FILES,
        };
        // The guest said Hello moments ago: a connect that takes long finds a dead guest.
        let deadline = Instant::now() + WARM_CONNECT_TIMEOUT;
        let answer =
            match imp_guest::host::connect(&rec.vsock_path, AGENT_VSOCK_PORT, deadline).await {
                Ok(mut guest) => {
                    guest.set_answer_timeout(WARM_TIMEOUT);
                    guest.warm(req).await
                }
                Err(e) => Err(e),
            };
        match key::judge_warm(answer) {
            key::WarmVerdict::Snapshot(r) => {
                match &r.error {
                    None => tracing::info!(
                        key,
                        files = r.files,
                        bytes = r.bytes,
                        millis = r.millis,
                        truncated = r.truncated,
                        skipped = r.skipped,
                        "template page cache warmed"
                    ),
                    Some(e) => {
                        tracing::warn!(key, error = %e, "template not warmed; snapshotting it cold")
                    }
                }
                Ok(Some(r))
            }
            key::WarmVerdict::Fail(message) => Err(Failure {
                reason: reason::TEMPLATE_FAILED.into(),
                message,
            }),
        }
    }

    /// A build VM's cgroup, once its processes are gone.
    async fn remove_cgroup(&self, uid: &str) {
        let Some(cg) = &self.cgroups else { return };
        let procs = cg.dir(uid).join("cgroup.procs");
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::fs::read_to_string(&procs).is_ok_and(|p| !p.trim().is_empty())
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Err(e) = cg.remove(uid) {
            tracing::warn!(uid, error = %e, "template build cgroup removal failed");
        }
    }

    /// Startup: TAPs of template builds a restart interrupted (their directories are gone).
    pub(super) fn forget_interrupted_builds(&self, keys: &[String]) {
        for key in keys {
            let t = tap::tap_name(&self.cfg.state_dir, &holder(key));
            if tap::exists(&t).unwrap_or(false) {
                let _ = tap::delete(&t);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use key::{ImageRef, KeyInputs};

    fn meta(key: &str) -> Meta {
        Meta {
            key: key.into(),
            inputs: KeyInputs {
                backend: Backend::Qemu,
                image: Some(ImageRef {
                    base: "reg/base:1".into(),
                    runner: None,
                }),
                base_disk: None,
                kernel: "/k".into(),
                initrd: None,
                vcpu: 1,
                memory_mib: 256,
                writable_disk_bytes: Some(1 << 20),
                nic: true,
                extra_boot_args: None,
                warm_paths: Vec::new(),
            },
            content: Content {
                image_key: Some("abc".into()),
                base_disk: None,
                kernel: Stamp {
                    bytes: 1,
                    mtime_ns: 1,
                },
                initrd: None,
            },
            vmm: VmmFacts {
                version: "QEMU emulator version 7.2.0".into(),
                accel: "tcg".into(),
                cpu: "tcg".into(),
            },
            boot_args: "console=ttyS0".into(),
            build_seconds: 4.0,
            built_unix: 1,
            warm: None,
        }
    }

    #[test]
    fn complete_templates_load_ready_and_interrupted_builds_go() {
        let d = tempfile::tempdir().unwrap();
        let (ready, interrupted, bad) = ("a".repeat(24), "b".repeat(24), "c".repeat(24));
        for (dir, m) in [
            (ready.clone(), Some(meta(&ready))),
            (format!("{interrupted}.building"), None),
            // meta.json of another key: not trusted.
            (bad.clone(), Some(meta(&ready))),
        ] {
            let p = d.path().join(&dir);
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("mem"), vec![1u8; 8192]).unwrap();
            if let Some(m) = m {
                std::fs::write(p.join("meta.json"), serde_json::to_vec(&m).unwrap()).unwrap();
            }
        }
        let vmm = meta(&ready).vmm;
        let (t, removed) = Templates::open(d.path(), vmm, 1 << 30).unwrap();
        let mut removed = removed;
        removed.sort();
        assert_eq!(removed, [interrupted.clone(), bad.clone()]);
        let list = t.list();
        assert_eq!(list.len(), 1, "{list:?}");
        assert_eq!(
            (list[0].key.as_str(), list[0].state),
            (ready.as_str(), TemplateState::Ready)
        );
        assert!(list[0].bytes >= 8192, "{list:?}");
        assert_eq!(t.holders(), [holder(&ready)]);
        assert!(!d.path().join(format!("{interrupted}.building")).exists());
        assert!(!d.path().join(&bad).exists());
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(d.path()).unwrap().permissions().mode();
        assert_eq!(
            mode & 0o777,
            0o700,
            "the templates directory is the runtime's"
        );
    }

    #[test]
    fn a_clone_gets_the_network_identity_of_a_cold_boot() {
        let spec: VmSpec = serde_json::from_value(serde_json::json!({
            "vcpu": 1, "memory_mib": 128,
            "network": {"attachment": {
                "network_id": "n", "network_name": "ci/r", "address": "198.51.100.7/24",
                "gateway": "198.51.100.1", "dns": ["192.0.2.1"], "mtu": 1400
            }}
        }))
        .unwrap();
        let n = net_identity("vm-7", &spec).unwrap();
        assert_eq!(n.mac, network::format_mac(&network::vm_mac("vm-7")));
        assert_eq!(
            (n.address.as_str(), n.prefix, n.gateway.as_str(), n.mtu),
            ("198.51.100.7", 24, "198.51.100.1", Some(1400))
        );
        assert_eq!(n.dns, ["192.0.2.1"]);
        let bare = VmSpec {
            network: None,
            ..spec
        };
        assert!(net_identity("vm-7", &bare).is_none());
        let e = host_entropy();
        assert_eq!(e.len(), ENTROPY_BYTES);
        assert_ne!(e, host_entropy());
    }
}
