//! The pure half of templates (docs/snapshots.md): what a template is keyed by, the spec a
//! template VM boots (the VM's spec without anything of its identity), the identity a clone
//! is given instead, and the decision of a `from_template` start (clone, or boot cold and why).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use imp_guest::host::HostError;
use imp_guest::protocol::{ErrorCode, Warmed};

use crate::api::{Backend, NetworkSpec, VmSpec, WarmReport};
use crate::rootfs::store::ImageSpec;

/// Reasons of a `from_template` VM that booted cold (`StartReport.fallback`), and of a clone
/// that failed (docs/reasons.md, docs/snapshots.md).
pub mod reason {
    pub use imp_api::names::reason::{
        REIDENTIFY_FAILED, RESTORE_FAILED, TEMPLATE_BUILDING, TEMPLATE_FAILED, TEMPLATE_MISSING,
        TEMPLATE_STALE, TEMPLATE_UNSUPPORTED, TEMPLATE_VMM_MISMATCH,
    };
    /// Every fallback reason, in the order of docs/snapshots.md.
    pub const FALLBACKS: [&str; 7] = [
        TEMPLATE_MISSING,
        TEMPLATE_BUILDING,
        TEMPLATE_STALE,
        TEMPLATE_VMM_MISMATCH,
        TEMPLATE_FAILED,
        TEMPLATE_UNSUPPORTED,
        RESTORE_FAILED,
    ];
}

/// What names a template: everything of a request that changes the guest, as asked (so `POST
/// /v1/templates` answers its key at once, before any image is resolved). Content behind the
/// names (the image a reference resolves to, the bytes of a kernel file) is in [`Content`] and
/// checked at each restore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyInputs {
    pub backend: Backend,
    /// The image as asked (references, without credentials), or none for a `base_disk`.
    pub image: Option<ImageRef>,
    pub base_disk: Option<PathBuf>,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub vcpu: u32,
    pub memory_mib: u64,
    pub writable_disk_bytes: Option<u64>,
    /// The template has a NIC (a clone gets its address and MAC by `Reidentify`).
    pub nic: bool,
    /// The template's own kernel command line (the spec's words minus its identity).
    pub extra_boot_args: Option<String>,
    /// Read into the page cache before the snapshot: what the snapshot holds. Left out when
    /// empty, so the keys of specs without it are what they were before it existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warm_paths: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRef {
    pub base: String,
    pub runner: Option<String>,
}

/// What the names of [`KeyInputs`] pointed at when the template was built.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Content {
    /// The rootfs cache key of the image (content-addressed), for image specs.
    pub image_key: Option<String>,
    pub base_disk: Option<Stamp>,
    pub kernel: Stamp,
    pub initrd: Option<Stamp>,
}

/// A file by size and modification time: a kernel replaced in place is noticed without
/// reading it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    pub bytes: u64,
    pub mtime_ns: i128,
}

impl Stamp {
    pub fn of(path: &Path) -> Option<Stamp> {
        use std::os::unix::fs::MetadataExt as _;
        let m = std::fs::metadata(path).ok()?;
        Some(Stamp {
            bytes: m.size(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        })
    }
}

/// The VMM a snapshot was taken with: a restore needs the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmmFacts {
    /// First line of the VMM's `--version`.
    pub version: String,
    /// `kvm` or `tcg`.
    pub accel: String,
    /// The host CPU model (`model name` of /proc/cpuinfo) under KVM; `tcg` emulates its own.
    pub cpu: String,
}

/// Length of a template key: hex digits of the SHA-256 of its [`KeyInputs`].
pub const KEY_HEX: usize = 24;

/// The template key of `inputs`.
pub fn key(inputs: &KeyInputs) -> String {
    let json = serde_json::to_vec(inputs).expect("key inputs serialise");
    let digest = Sha256::digest(&json);
    hex::encode(digest)[..KEY_HEX].to_string()
}

/// A template key as the API names it (`DELETE /v1/templates/{key}`).
pub fn valid_key(key: &str) -> bool {
    key.len() == KEY_HEX && key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The kernel command-line words that are a VM's identity: a template boots without them, a
/// clone gets them by `Reidentify`.
const IDENTITY_WORDS: [&str; 1] = ["imp.hostname="];

/// The extra boot args without identity words (none left: `None`).
pub fn template_boot_args(extra: Option<&str>) -> Option<String> {
    let kept: Vec<&str> = extra
        .unwrap_or_default()
        .split_whitespace()
        .filter(|w| !IDENTITY_WORDS.iter().any(|p| w.starts_with(p)))
        .collect();
    (!kept.is_empty()).then(|| kept.join(" "))
}

/// The spec a template VM of `spec` boots: no address, MAC or hostname (no network identity
/// in a template), not itself `from_template`.
pub fn template_spec(spec: &VmSpec) -> VmSpec {
    VmSpec {
        image: spec.image.as_ref().map(ImageSpec::without_credentials),
        extra_boot_args: template_boot_args(spec.extra_boot_args.as_deref()),
        network: spec.network.as_ref().map(|_| NetworkSpec {
            guest_mac: None,
            attachment: None,
        }),
        from_template: false,
        ..spec.clone()
    }
}

/// The key inputs of `spec` (its paths resolved; `kernel`/`initrd` the files it boots).
pub fn key_inputs(
    spec: &VmSpec,
    backend: Backend,
    kernel: &Path,
    initrd: Option<&Path>,
) -> KeyInputs {
    let t = template_spec(spec);
    KeyInputs {
        backend,
        image: t.image.as_ref().map(|i| ImageRef {
            base: i.base.clone(),
            runner: i.runner.clone(),
        }),
        base_disk: if t.image.is_some() {
            None
        } else {
            t.base_disk.clone()
        },
        kernel: kernel.to_path_buf(),
        initrd: initrd.map(Path::to_path_buf),
        vcpu: t.vcpu,
        memory_mib: t.memory_mib,
        writable_disk_bytes: t.writable_disk_bytes,
        nic: t.network.is_some(),
        extra_boot_args: t.extra_boot_args,
        warm_paths: t.warm_paths,
    }
}

/// Bytes a template build of a `memory_mib` guest warms at most: half its memory, so the page
/// cache it fills (and the snapshot carries) leaves the runner room.
pub fn warm_max_bytes(memory_mib: u64) -> u64 {
    (memory_mib << 20) / 2
}

/// What a build does with the guest's answer to `Warm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WarmVerdict {
    /// Snapshot; the answer (or why there is none) goes into the template's record.
    Snapshot(WarmReport),
    /// The guest refused a field: the spec is wrong, the template Failed with this message.
    Fail(String),
}

/// Warming is an optimisation: a guest that does not know `warm` (an older image's agent) or
/// does not answer in time still makes a template, cold. A refused field is a spec bug and a
/// lost connection a guest unfit to snapshot: both fail the build.
pub fn judge_warm(answer: Result<Warmed, HostError>) -> WarmVerdict {
    let cold = |why: String| {
        WarmVerdict::Snapshot(WarmReport {
            files: 0,
            bytes: 0,
            millis: 0,
            truncated: false,
            skipped: 0,
            error: Some(why),
        })
    };
    match answer {
        Ok(w) => WarmVerdict::Snapshot(WarmReport {
            files: w.files,
            bytes: w.bytes,
            millis: w.millis,
            truncated: w.truncated,
            skipped: w.skipped,
            error: None,
        }),
        Err(HostError::Guest(e)) if e.code == ErrorCode::UnknownType => {
            cold(format!("the guest agent does not know warm: {}", e.message))
        }
        Err(e @ HostError::NoAnswer { .. }) => cold(e.to_string()),
        Err(e) => WarmVerdict::Fail(format!("warm: {e}")),
    }
}

/// The hostname a clone of `uid` gets: what a cold boot of its spec sets (`imp.hostname=`),
/// else the VM's uid (a valid hostname by the uid rules; a cold boot without `imp.hostname`
/// keeps the image's, which every clone of a template would share).
pub fn clone_hostname(uid: &str, spec: &VmSpec) -> String {
    spec.extra_boot_args
        .as_deref()
        .unwrap_or_default()
        .split_whitespace()
        .find_map(|w| w.strip_prefix("imp.hostname="))
        .map_or_else(|| uid.to_string(), str::to_string)
}

/// What the runtime knows of a template when a `from_template` VM starts.
#[derive(Debug, Clone, PartialEq)]
pub enum Known {
    None,
    Building,
    /// The last build failed; `retry` once its backoff has passed.
    Failed {
        retry: bool,
    },
    Ready {
        content: Box<Content>,
        vmm: Box<VmmFacts>,
    },
}

/// What a `from_template` start does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Restore the ready template.
    Clone,
    /// Boot cold, reporting `fallback`; `build`: (re)build the template now, so the next VM
    /// restores.
    Cold { fallback: &'static str, build: bool },
}

/// Clone when the backend keeps templates, one is ready, and what it was built from and by
/// is what this start would boot and restore with; else boot cold with the reason.
pub fn decide(supported: bool, known: &Known, content: &Content, vmm: &VmmFacts) -> Decision {
    use reason::*;
    let cold = |fallback, build| Decision::Cold { fallback, build };
    if !supported {
        return cold(TEMPLATE_UNSUPPORTED, false);
    }
    match known {
        Known::None => cold(TEMPLATE_MISSING, true),
        Known::Building => cold(TEMPLATE_BUILDING, false),
        Known::Failed { retry } => cold(TEMPLATE_FAILED, *retry),
        Known::Ready { content: c, .. } if **c != *content => cold(TEMPLATE_STALE, true),
        Known::Ready { vmm: v, .. } if **v != *vmm => cold(TEMPLATE_VMM_MISMATCH, true),
        Known::Ready { .. } => Decision::Clone,
    }
}

/// Whether a `POST /v1/templates` finding `known` starts a build: none known, a failed one past
/// its backoff, or a ready one another VMM built (its content is checked at each clone).
pub fn request_builds(known: &Known, vmm: &VmmFacts) -> bool {
    match known {
        Known::None => true,
        Known::Failed { retry } => *retry,
        Known::Ready { vmm: v, .. } => **v != *vmm,
        Known::Building => false,
    }
}

/// Templates to delete, least recently used first, until the ready ones fit `budget` bytes:
/// `(key, bytes, last_used)`; templates a restore reads now are in `busy` and kept.
pub fn plan_gc(templates: &[(String, u64, u64)], budget: u64, busy: &[String]) -> Vec<String> {
    let mut total: u64 = templates.iter().map(|t| t.1).sum();
    let mut by_age: Vec<&(String, u64, u64)> = templates.iter().collect();
    by_age.sort_by_key(|t| (t.2, t.0.clone()));
    let mut out = Vec::new();
    for (key, bytes, _) in by_age {
        if total <= budget {
            break;
        }
        if busy.contains(key) {
            continue;
        }
        total -= bytes;
        out.push(key.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::NetworkAttachment;

    fn spec() -> VmSpec {
        VmSpec {
            vcpu: 1,
            memory_mib: 256,
            base_disk: None,
            image: Some(ImageSpec {
                base: "reg/base:1".into(),
                runner: Some("reg/runner:2".into()),
                credentials: None,
                pull_policy: None,
            }),
            writable_disk_bytes: Some(64 << 20),
            kernel: None,
            initrd: None,
            extra_boot_args: Some("imp.report_grace_s=60 imp.hostname=runner-a".into()),
            network: Some(NetworkSpec {
                guest_mac: Some("06:00:00:00:00:01".into()),
                attachment: Some(NetworkAttachment {
                    network_id: "n1".into(),
                    network_name: "ci/runners".into(),
                    address: "198.51.100.10/24".parse().unwrap(),
                    gateway: "198.51.100.1".parse().unwrap(),
                    dns: vec![],
                    mtu: None,
                    nat: true,
                    egress_interface: None,
                    egress_allow: vec![],
                    egress_deny: vec![],
                    ingress: vec![],
                }),
            }),
            from_template: true,
            warm_paths: vec!["/opt/actions-runner".into()],
        }
    }

    fn key_of(s: &VmSpec) -> String {
        key(&key_inputs(
            s,
            Backend::Qemu,
            Path::new("/k/vmlinuz"),
            Some(Path::new("/k/initrd")),
        ))
    }

    #[test]
    fn identity_is_not_in_the_key_everything_that_changes_the_guest_is() {
        let a = spec();
        let k = key_of(&a);
        assert!(valid_key(&k), "{k}");
        // Another VM of the same class: other address, MAC, hostname, credentials.
        let mut b = spec();
        b.extra_boot_args = Some("imp.hostname=runner-b imp.report_grace_s=60".into());
        let n = b.network.as_mut().unwrap();
        n.guest_mac = None;
        n.attachment.as_mut().unwrap().address = "198.51.100.11/24".parse().unwrap();
        b.from_template = false;
        assert_eq!(key_of(&b), k, "identity and from_template are not inputs");
        type Change = Box<dyn Fn(&mut VmSpec)>;
        let changed: Vec<Change> = vec![
            Box::new(|s| s.vcpu = 2),
            Box::new(|s| s.memory_mib = 512),
            Box::new(|s| s.writable_disk_bytes = None),
            Box::new(|s| s.network = None),
            Box::new(|s| s.extra_boot_args = Some("imp.report_grace_s=30".into())),
            Box::new(|s| s.image.as_mut().unwrap().runner = None),
            Box::new(|s| s.image.as_mut().unwrap().base = "reg/base:2".into()),
            Box::new(|s| s.warm_paths.push("/usr/local/bin/imp-runner".into())),
            Box::new(|s| s.warm_paths.clear()),
        ];
        for (i, change) in changed.iter().enumerate() {
            let mut s = spec();
            change(&mut s);
            assert_ne!(key_of(&s), k, "change {i} keeps the key");
        }
        let other_kernel = key(&key_inputs(
            &a,
            Backend::Qemu,
            Path::new("/k/vmlinuz-2"),
            Some(Path::new("/k/initrd")),
        ));
        assert_ne!(other_kernel, k);
        let fc = key(&key_inputs(
            &a,
            Backend::Firecracker,
            Path::new("/k/vmlinuz"),
            Some(Path::new("/k/initrd")),
        ));
        assert_ne!(fc, k);
    }

    #[test]
    fn a_spec_without_warm_paths_keeps_the_key_it_had_before_them() {
        let mut s = spec();
        s.warm_paths.clear();
        let inputs = key_inputs(&s, Backend::Qemu, Path::new("/k/vmlinuz"), None);
        let json = serde_json::to_value(&inputs).unwrap();
        assert!(json.get("warm_paths").is_none(), "{json}");
        let back: KeyInputs = serde_json::from_value(json).unwrap();
        assert_eq!(back, inputs);
        assert_eq!(template_spec(&spec()).warm_paths, ["/opt/actions-runner"]);
    }

    #[test]
    fn warming_bounds_and_verdicts() {
        assert_eq!(warm_max_bytes(256), 128 << 20);
        let warmed = Warmed {
            files: 3,
            bytes: 10,
            millis: 2,
            truncated: true,
            skipped: 1,
        };
        assert_eq!(
            judge_warm(Ok(warmed)),
            WarmVerdict::Snapshot(WarmReport {
                files: 3,
                bytes: 10,
                millis: 2,
                truncated: true,
                skipped: 1,
                error: None
            })
        );
        let guest = |code, message: &str| {
            Err(HostError::Guest(imp_guest::protocol::ErrorMsg {
                code,
                message: message.into(),
                id: None,
            }))
        };
        let WarmVerdict::Snapshot(r) = judge_warm(guest(ErrorCode::UnknownType, "warm")) else {
            panic!("an older guest still makes a template")
        };
        assert!(r.error.unwrap().contains("does not know warm"));
        let WarmVerdict::Snapshot(r) = judge_warm(Err(HostError::NoAnswer {
            request: "the Warm",
            after: std::time::Duration::from_secs(1),
        })) else {
            panic!("a slow warm still makes a template")
        };
        assert_eq!((r.files, r.error.is_some()), (0, true));
        assert_eq!(
            judge_warm(guest(ErrorCode::InvalidRequest, "warm: paths: [0]: bad")),
            WarmVerdict::Fail(
                "warm: guest answered with error InvalidRequest: warm: paths: [0]: bad".into()
            )
        );
        assert!(matches!(
            judge_warm(Err(HostError::Closed)),
            WarmVerdict::Fail(_)
        ));
    }

    #[test]
    fn a_template_boots_without_identity_and_a_clone_gets_the_cold_boot_hostname() {
        let t = template_spec(&spec());
        assert_eq!(t.extra_boot_args.as_deref(), Some("imp.report_grace_s=60"));
        let n = t.network.unwrap();
        assert_eq!((n.guest_mac, n.attachment), (None, None));
        assert!(!t.from_template);
        assert_eq!(template_boot_args(Some("imp.hostname=x")), None);
        assert_eq!(clone_hostname("vm-1", &spec()), "runner-a");
        let mut s = spec();
        s.extra_boot_args = None;
        assert_eq!(clone_hostname("vm-1", &s), "vm-1");
        assert!(!valid_key("../etc"));
    }

    fn content() -> Content {
        Content {
            image_key: Some("abc".into()),
            base_disk: None,
            kernel: Stamp {
                bytes: 10,
                mtime_ns: 1,
            },
            initrd: None,
        }
    }

    fn vmm() -> VmmFacts {
        VmmFacts {
            version: "QEMU emulator version 7.2.0".into(),
            accel: "tcg".into(),
            cpu: "tcg".into(),
        }
    }

    #[test]
    fn decide_clones_only_a_matching_ready_template() {
        use reason::*;
        let ready = Known::Ready {
            content: Box::new(content()),
            vmm: Box::new(vmm()),
        };
        assert_eq!(decide(true, &ready, &content(), &vmm()), Decision::Clone);
        let cold = |fallback, build| Decision::Cold { fallback, build };
        assert_eq!(
            decide(false, &ready, &content(), &vmm()),
            cold(TEMPLATE_UNSUPPORTED, false)
        );
        assert_eq!(
            decide(true, &Known::None, &content(), &vmm()),
            cold(TEMPLATE_MISSING, true)
        );
        assert_eq!(
            decide(true, &Known::Building, &content(), &vmm()),
            cold(TEMPLATE_BUILDING, false)
        );
        for retry in [false, true] {
            assert_eq!(
                decide(true, &Known::Failed { retry }, &content(), &vmm()),
                cold(TEMPLATE_FAILED, retry)
            );
        }
        let mut newer_image = content();
        newer_image.image_key = Some("def".into());
        assert_eq!(
            decide(true, &ready, &newer_image, &vmm()),
            cold(TEMPLATE_STALE, true)
        );
        let mut kernel_replaced = content();
        kernel_replaced.kernel.mtime_ns = 2;
        assert_eq!(
            decide(true, &ready, &kernel_replaced, &vmm()),
            cold(TEMPLATE_STALE, true)
        );
        let mut other_qemu = vmm();
        other_qemu.version = "QEMU emulator version 8.2.2".into();
        assert_eq!(
            decide(true, &ready, &content(), &other_qemu),
            cold(TEMPLATE_VMM_MISMATCH, true)
        );
        let mut other_cpu = vmm();
        other_cpu.cpu = "AMD EPYC".into();
        assert_eq!(
            decide(true, &ready, &content(), &other_cpu),
            cold(TEMPLATE_VMM_MISMATCH, true)
        );
    }

    #[test]
    fn a_request_builds_only_what_is_missing_due_or_built_by_another_vmm() {
        let ready = |v: VmmFacts| Known::Ready {
            content: Box::new(content()),
            vmm: Box::new(v),
        };
        assert!(request_builds(&Known::None, &vmm()));
        assert!(!request_builds(&Known::Building, &vmm()));
        assert!(!request_builds(&Known::Failed { retry: false }, &vmm()));
        assert!(request_builds(&Known::Failed { retry: true }, &vmm()));
        assert!(!request_builds(&ready(vmm()), &vmm()));
        let mut other = vmm();
        other.accel = "kvm".into();
        assert!(request_builds(&ready(other), &vmm()));
    }

    #[test]
    fn gc_drops_the_least_recently_used_until_under_budget_sparing_busy_ones() {
        let t = |k: &str, b, used| (k.to_string(), b, used);
        let all = [t("a", 100, 3), t("b", 100, 1), t("c", 100, 2)];
        assert!(plan_gc(&all, 300, &[]).is_empty());
        assert_eq!(plan_gc(&all, 200, &[]), ["b"]);
        assert_eq!(plan_gc(&all, 100, &[]), ["b", "c"]);
        assert_eq!(plan_gc(&all, 100, &["b".into()]), ["c", "a"]);
        assert_eq!(plan_gc(&all, 0, &[]), ["b", "c", "a"]);
    }
}
