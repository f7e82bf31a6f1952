//! The rootfs store end to end against a real registry (Debian's docker-registry on 127.0.0.1):
//! images the tests build and push, built into ext4 with real mkfs.ext4, read back with debugfs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use imp_api::PullPolicy;
use imp_api::names::reason;
use imp_runtime::inventory::Inventory;
use imp_runtime::metrics::Metrics;
use imp_runtime::rootfs::flatten::Limits;
use imp_runtime::rootfs::pull::PullConfig;
use imp_runtime::rootfs::store::{ImageSpec, RootfsStore, StoreConfig};
use imp_testkit::oci::{LayerBlob, PushAuth, push_gzip_image, push_image};
use imp_testkit::registry::{Registry, RegistryOptions};
use imp_testkit::tarball::TarBuilder;

struct Fixture {
    dir: tempfile::TempDir,
    registry: Registry,
    inventory: Inventory,
    metrics: Metrics,
}

impl Fixture {
    async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("imp-guest"),
            b"\x7fELF pretend static guest v1",
        )
        .unwrap();
        let registry = Registry::start(RegistryOptions::default()).await.unwrap();
        let inventory = Inventory::open(dir.path()).await.unwrap();
        Self {
            dir,
            registry,
            inventory,
            metrics: Metrics::new(),
        }
    }

    fn config(&self, budget_bytes: u64) -> StoreConfig {
        StoreConfig {
            dir: self.dir.path().join("rootfs"),
            guest_bin: self.dir.path().join("imp-guest"),
            budget_bytes,
            limits: Limits::default(),
            pull: PullConfig {
                insecure_registries: vec![self.registry.host()],
                node_local_registries: vec![self.registry.host()],
                ..PullConfig::default()
            },
            parallel_fetches: 3,
        }
    }

    async fn store(&self, budget_bytes: u64) -> RootfsStore {
        RootfsStore::open(
            self.config(budget_bytes),
            self.inventory.pool().clone(),
            self.metrics.rootfs.clone(),
        )
        .await
        .unwrap()
    }

    /// A store that also reaches `host` over plain HTTP.
    async fn store_reaching(&self, host: &str) -> RootfsStore {
        let mut cfg = self.config(1 << 30);
        cfg.pull.insecure_registries.push(host.to_owned());
        cfg.pull.node_local_registries.push(host.to_owned());
        RootfsStore::open(
            cfg,
            self.inventory.pool().clone(),
            self.metrics.rootfs.clone(),
        )
        .await
        .unwrap()
    }

    async fn push(&self, repo_tag: &str, layers: Vec<Vec<u8>>) -> String {
        push_gzip_image(&self.registry.host(), repo_tag, layers).await
    }

    async fn push_blobs(&self, repo_tag: &str, blobs: &[LayerBlob]) -> String {
        push_image(&self.registry.host(), repo_tag, blobs, &PushAuth::Anonymous)
            .await
            .unwrap();
        format!("{}/{repo_tag}", self.registry.host())
    }

    /// `Always`: these tests are about what a resolve at the registry does (moved tags, outages);
    /// the `IfNotPresent` tests say so.
    fn spec(&self, base: &str, runner: Option<&str>) -> ImageSpec {
        ImageSpec {
            base: base.into(),
            runner: runner.map(Into::into),
            credentials: None,
            pull_policy: Some(PullPolicy::Always),
        }
    }

    fn images(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(self.dir.path().join("rootfs/images"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    }
}

/// The ext4 image's tree as `path -> description`, read with debugfs's rdump into a temp dir.
fn tree_of(image: &Path) -> BTreeMap<String, String> {
    let out = tempfile::tempdir().unwrap();
    let status = Command::new("debugfs")
        .arg("-R")
        .arg(format!("rdump / {}", out.path().display()))
        .arg(image)
        .output()
        .unwrap();
    assert!(status.status.success(), "{status:?}");
    let mut tree = BTreeMap::new();
    walk(out.path(), out.path(), &mut tree);
    tree
}

fn walk(root: &Path, dir: &Path, tree: &mut BTreeMap<String, String>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let rel = p.strip_prefix(root).unwrap().display().to_string();
        let md = std::fs::symlink_metadata(&p).unwrap();
        if md.file_type().is_symlink() {
            tree.insert(
                rel,
                format!("-> {}", std::fs::read_link(&p).unwrap().display()),
            );
        } else if md.is_dir() {
            tree.insert(rel, "dir".into());
            walk(root, &p, tree);
        } else {
            tree.insert(
                rel,
                String::from_utf8_lossy(&std::fs::read(&p).unwrap()).into_owned(),
            );
        }
    }
}

fn base_layers() -> Vec<Vec<u8>> {
    vec![
        TarBuilder::new()
            .dir("usr", 0o755)
            .dir("usr/bin", 0o755)
            .file("usr/bin/tool", b"tool v1", 0o755)
            .symlink("bin", "usr/bin")
            .dir("etc", 0o755)
            .file("etc/os-release", b"ID=imp-test", 0o644)
            .dir("opt", 0o755)
            .dir("opt/d", 0o755)
            .file("opt/d/a", b"a", 0o644)
            .dir("opt/d/sub", 0o755)
            .file("opt/d/sub/deep", b"deep", 0o644)
            .file("var-gone", b"gone soon", 0o644)
            .into_gzip(),
        TarBuilder::new()
            // The opaque marker after a same-layer child: the child stays, the lower ones go.
            .file("opt/d/c", b"c from layer 2", 0o644)
            .opaque("opt/d")
            .whiteout("var-gone")
            .file("usr/bin/tool", b"tool v2", 0o755)
            .into_gzip(),
    ]
}

#[tokio::test]
async fn builds_base_and_runner_layers_with_whiteouts_and_the_guest_injected() {
    let f = Fixture::new().await;
    let base = f.push("imp/base:1", base_layers()).await;
    let runner = f
        .push(
            "imp/runner:1",
            vec![
                TarBuilder::new()
                    .dir("opt/actions-runner", 0o755)
                    .file("opt/actions-runner/run.sh", b"#!/bin/sh\necho run\n", 0o755)
                    .into_gzip(),
            ],
        )
        .await;
    let store = f.store(1 << 30).await;
    let got = store
        .acquire("vm-1", &f.spec(&base, Some(&runner)))
        .await
        .unwrap();
    assert!(!got.hit && !got.offline);
    assert_eq!(f.images(), vec![got.path.clone()]);
    imp_testkit::ext4::assert_fsck_clean(&got.path);

    let tree = tree_of(&got.path);
    let want: BTreeMap<String, String> = [
        ("bin", "-> usr/bin"),
        ("dev", "dir"),
        ("etc", "dir"),
        ("etc/os-release", "ID=imp-test"),
        ("lost+found", "dir"),
        ("opt", "dir"),
        ("opt/actions-runner", "dir"),
        ("opt/actions-runner/run.sh", "#!/bin/sh\necho run\n"),
        ("opt/d", "dir"),
        ("opt/d/c", "c from layer 2"),
        ("proc", "dir"),
        ("run", "dir"),
        ("sbin", "dir"),
        ("sbin/imp-guest", "\u{7f}ELF pretend static guest v1"),
        ("sys", "dir"),
        ("tmp", "dir"),
        ("usr", "dir"),
        ("usr/bin", "dir"),
        ("usr/bin/tool", "tool v2"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    assert_eq!(tree, want);

    // Everything the build made besides the image is gone.
    assert_eq!(
        std::fs::read_dir(f.dir.path().join("rootfs/tmp"))
            .unwrap()
            .count(),
        0
    );
    let text = f.metrics.encode();
    assert!(text.contains("imp_rootfs_cache_misses_total 1"), "{text}");
    assert!(
        text.contains("imp_rootfs_build_duration_seconds_count 1"),
        "{text}"
    );
    assert!(text.contains("imp_rootfs_cache_images 1"), "{text}");
}

#[tokio::test]
async fn zstd_runner_layer_over_a_gzip_base_builds_with_its_whiteouts() {
    let f = Fixture::new().await;
    let base = f.push("imp/base:1", base_layers()).await;
    // The runner layer deletes a base file, re-opens a base directory and adds its own files,
    // all through a zstd stream.
    let runner = f
        .push_blobs(
            "imp/runner:zstd",
            &[LayerBlob::zstd_compressed(
                TarBuilder::new()
                    .whiteout("etc/os-release")
                    .opaque("usr/bin")
                    .file("usr/bin/runner-tool", b"from zstd", 0o755)
                    .dir("opt/actions-runner", 0o755)
                    .file("opt/actions-runner/run.sh", b"#!/bin/sh\n", 0o755)
                    .into_zstd(),
            )],
        )
        .await;
    let store = f.store(1 << 30).await;
    let got = store
        .acquire("vm-1", &f.spec(&base, Some(&runner)))
        .await
        .unwrap();

    let tree = tree_of(&got.path);
    assert_eq!(
        tree.get("usr/bin/runner-tool").map(String::as_str),
        Some("from zstd")
    );
    assert_eq!(
        tree.get("opt/actions-runner/run.sh").map(String::as_str),
        Some("#!/bin/sh\n")
    );
    assert!(!tree.contains_key("etc/os-release"), "{tree:?}");
    assert!(
        !tree.contains_key("usr/bin/tool"),
        "opaque usr/bin kept tool: {tree:?}"
    );
    assert_eq!(
        tree.get("opt/d/c").map(String::as_str),
        Some("c from layer 2")
    );
}

#[tokio::test]
async fn concurrent_requests_for_one_image_build_it_once() {
    let f = Fixture::new().await;
    let base = f.push("imp/base:1", base_layers()).await;
    let store = Arc::new(f.store(1 << 30).await);
    let spec = f.spec(&base, None);
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let store = store.clone();
            let spec = spec.clone();
            tokio::spawn(async move { store.acquire(&format!("vm-{i}"), &spec).await.unwrap() })
        })
        .collect();
    let mut got = Vec::new();
    for t in tasks {
        got.push(t.await.unwrap());
    }
    assert_eq!(got.iter().filter(|a| !a.hit).count(), 1, "{got:?}");
    assert!(got.iter().all(|a| a.path == got[0].path));
    assert_eq!(f.images().len(), 1);
    let entry = store.index().get(&got[0].key).await.unwrap().unwrap();
    assert_eq!(entry.refs, 8);
    let text = f.metrics.encode();
    assert!(text.contains("imp_rootfs_cache_misses_total 1"), "{text}");
    assert!(text.contains("imp_rootfs_cache_hits_total 7"), "{text}");
    // A retag of identical content is the same key: a hit, no build.
    let again = f.push("imp/base:retagged", base_layers()).await;
    let a = store.acquire("vm-9", &f.spec(&again, None)).await.unwrap();
    assert!(a.hit && a.key == got[0].key);
}

#[tokio::test]
async fn garbage_collection_evicts_unreferenced_least_recently_used_and_keeps_referenced() {
    let f = Fixture::new().await;
    let mut refs = Vec::new();
    for i in 0..3 {
        refs.push(
            f.push(
                &format!("imp/img{i}:1"),
                vec![
                    TarBuilder::new()
                        .file(&format!("img{i}"), &vec![i as u8; 100_000], 0o644)
                        .into_gzip(),
                ],
            )
            .await,
        );
    }
    // A budget smaller than one image: only references keep images.
    let store = f.store(1).await;
    let a = store
        .acquire("vm-a", &f.spec(&refs[0], None))
        .await
        .unwrap();
    let b = store
        .acquire("vm-b", &f.spec(&refs[1], None))
        .await
        .unwrap();
    assert_eq!(
        f.images().len(),
        2,
        "referenced images are kept over budget"
    );
    store.release("vm-b").await.unwrap();
    assert_eq!(f.images(), vec![a.path.clone()], "b evicted once released");
    assert!(!b.path.exists());
    store.release("vm-b").await.unwrap();

    // Raise the budget to two images: LRU order decides.
    let bytes = std::fs::metadata(&a.path).unwrap().len();
    drop(store);
    let store = f.store(2 * bytes).await;
    let c = store
        .acquire("vm-c", &f.spec(&refs[2], None))
        .await
        .unwrap();
    store.release("vm-c").await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    store.release("vm-a").await.unwrap();
    assert_eq!(f.images().len(), 2);
    let b2 = store
        .acquire("vm-b2", &f.spec(&refs[1], None))
        .await
        .unwrap();
    // Three images, budget two: the least recently used unreferenced one (c, released before a)
    // goes.
    assert!(!c.path.exists() && a.path.exists() && b2.path.exists());
    let text = f.metrics.encode();
    assert!(text.contains("imp_rootfs_cache_evictions_total"), "{text}");
}

#[tokio::test]
async fn a_hostile_layer_is_rejected_naming_layer_and_entry_and_leaves_nothing() {
    let f = Fixture::new().await;
    let victim = f.dir.path().join("victim");
    std::fs::create_dir(&victim).unwrap();
    let hostile = TarBuilder::new()
        .file("ok", b"fine", 0o644)
        .symlink("esc", "../../../../victim")
        .file("esc/pwned", b"owned", 0o644)
        .into_gzip();
    let base = f.push("imp/hostile:1", vec![hostile]).await;
    let store = f.store(1 << 30).await;
    let err = store
        .acquire("vm-h", &f.spec(&base, None))
        .await
        .unwrap_err();
    assert_eq!(err.reason(), reason::ROOTFS_REJECTED, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("esc/pwned") && msg.contains("sha256:"),
        "{msg}"
    );
    assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 0);
    assert!(f.images().is_empty());
    assert_eq!(
        std::fs::read_dir(f.dir.path().join("rootfs/tmp"))
            .unwrap()
            .count(),
        0
    );
    assert!(store.index().list().await.unwrap().is_empty());
    let text = f.metrics.encode();
    assert!(
        text.contains("imp_rootfs_build_failures_total{reason=\"RootfsRejected\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn a_registry_outage_serves_the_image_built_from_the_same_references() {
    let mut f = Fixture::new().await;
    let base = f.push("imp/base:1", base_layers()).await;
    let never_built = format!("{}/imp/other:1", f.registry.host());
    let store = f.store(1 << 30).await;
    let first = store.acquire("vm-1", &f.spec(&base, None)).await.unwrap();
    f.registry.stop();
    let second = store.acquire("vm-2", &f.spec(&base, None)).await.unwrap();
    assert!(second.hit && second.offline && second.path == first.path);
    let err = store
        .acquire("vm-3", &f.spec(&never_built, None))
        .await
        .unwrap_err();
    assert_eq!(err.reason(), reason::ROOTFS_PULL_FAILED, "{err}");
}

#[tokio::test]
async fn a_new_guest_agent_is_a_new_key_and_a_restart_reconciles_the_cache() {
    let f = Fixture::new().await;
    let base = f.push("imp/base:1", base_layers()).await;
    let store = f.store(1 << 30).await;
    let v1 = store.acquire("vm-1", &f.spec(&base, None)).await.unwrap();
    std::fs::write(f.dir.path().join("imp-guest"), b"\x7fELF guest v2").unwrap();
    let v2 = store.acquire("vm-2", &f.spec(&base, None)).await.unwrap();
    assert!(!v2.hit && v2.key != v1.key);
    assert_eq!(tree_of(&v2.path)["sbin/imp-guest"], "\u{7f}ELF guest v2");
    drop(store);

    // A crash left a build directory and a stray image file; the restart removes both, and
    // references of VMs that no longer exist are dropped (then GC applies the budget).
    let tmp = f.dir.path().join("rootfs/tmp/deadbeef.1");
    std::fs::create_dir_all(tmp.join("root")).unwrap();
    let stray = f.dir.path().join("rootfs/images/stray.ext4");
    std::fs::write(&stray, b"half").unwrap();
    let store = f.store(1).await;
    assert!(!tmp.exists() && !stray.exists());
    assert_eq!(f.images().len(), 2);
    store.retain_vms(&["vm-2".to_string()]).await.unwrap();
    assert_eq!(f.images(), vec![v2.path.clone()]);
}

/// `reference` as tenant-a asks for it (`Always`): with that password, or none.
fn tenant_a_spec(reference: &str, password: Option<&str>) -> ImageSpec {
    ImageSpec {
        base: reference.into(),
        runner: None,
        credentials: password.map(|p| imp_runtime::rootfs::auth::PullCredentials::Basic {
            username: "tenant-a".into(),
            password: imp_common::SecretString::from(p),
        }),
        pull_policy: Some(PullPolicy::Always),
    }
}

/// A registry that requires tenant-a's password, holding `a/secret:1`.
async fn private_registry() -> Registry {
    let private = Registry::start(RegistryOptions {
        htpasswd: Some(("tenant-a".into(), "a-password-1".into())),
    })
    .await
    .unwrap();
    let blobs = [LayerBlob::gzipped(
        TarBuilder::new().file("private", b"a's", 0o644).into_gzip(),
    )];
    push_image(
        &private.host(),
        "a/secret:1",
        &blobs,
        &PushAuth::Basic("tenant-a".into(), "a-password-1".into()),
    )
    .await
    .unwrap();
    private
}

#[tokio::test]
async fn a_refused_pull_never_falls_back_to_another_tenants_cached_image() {
    let f = Fixture::new().await;
    let private = private_registry().await;
    let store = f.store_reaching(&private.host()).await;
    let reference = format!("{}/a/secret:1", private.host());
    let with = |password: Option<&str>| tenant_a_spec(&reference, password);
    store
        .acquire("vm-a", &with(Some("a-password-1")))
        .await
        .unwrap();
    for (vm, spec) in [("vm-b", with(None)), ("vm-c", with(Some("guess")))] {
        let err = store.acquire(vm, &spec).await.unwrap_err();
        assert_eq!(err.reason(), reason::ROOTFS_PULL_FAILED, "{err}");
        assert!(err.to_string().contains("refused the credentials"), "{err}");
    }
}

/// A TCP proxy to `upstream` that, once `failing` is set, answers every new connection with
/// HTTP 503 (a registry outage that still answers). Dropped with the returned task.
async fn outage_proxy(
    upstream: String,
) -> (
    String,
    Arc<std::sync::atomic::AtomicBool>,
    tokio::task::JoinHandle<()>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let host = listener.local_addr().unwrap().to_string();
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = failing.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let upstream = upstream.clone();
            let failing = flag.load(std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                if failing {
                    let mut buf = [0u8; 4096];
                    let _ = conn.read(&mut buf).await;
                    let _ = conn
                        .write_all(
                            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\
                              Connection: close\r\n\r\n",
                        )
                        .await;
                    return;
                }
                if let Ok(mut up) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut conn, &mut up).await;
                }
            });
        }
    });
    (host, failing, task)
}

/// The offline fallback hands a cached private image only to the credentials that built it:
/// with the registry answering 5xx, then unreachable, a request without credentials (or with
/// others) is refused with RootfsPullFailed; one with the builder's credentials is served the
/// cached image. The index holds a keyed fingerprint, never the password.
#[tokio::test]
async fn an_outage_serves_a_private_image_only_to_the_credentials_that_built_it() {
    let f = Fixture::new().await;
    let mut private = private_registry().await;
    let public = f.push("imp/base:1", base_layers()).await;
    let (proxy, failing, proxy_task) = outage_proxy(private.host()).await;
    let store = f.store_reaching(&proxy).await;
    let reference = format!("{proxy}/a/secret:1");
    let with = |password: Option<&str>| tenant_a_spec(&reference, password);
    let built = store
        .acquire("vm-a", &with(Some("a-password-1")))
        .await
        .unwrap();
    assert!(!built.hit);
    // An anonymous build serves anyone offline, credentials or not.
    store.acquire("vm-p", &f.spec(&public, None)).await.unwrap();
    let entries = store.index().list().await.unwrap();
    let fingerprints: Vec<&str> = entries.iter().map(|e| e.pulled_with.as_str()).collect();
    assert!(fingerprints.contains(&"anonymous"), "{fingerprints:?}");
    assert!(
        fingerprints.iter().any(|p| p.starts_with("hmac-sha256:")),
        "{fingerprints:?}"
    );
    for file in ["inventory.db", "inventory.db-wal"] {
        let db = std::fs::read(f.dir.path().join(file)).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&db).contains("a-password-1"),
            "the password is in {file}"
        );
    }

    failing.store(true, std::sync::atomic::Ordering::SeqCst);
    for outage in ["5xx", "unreachable"] {
        if outage == "unreachable" {
            // The listener goes with its task: connections are refused from now on.
            proxy_task.abort();
            private.stop();
        }
        for (vm, spec) in [
            (format!("vm-anon-{outage}"), with(None)),
            (format!("vm-guess-{outage}"), with(Some("guess"))),
        ] {
            let err = store.acquire(&vm, &spec).await.unwrap_err();
            assert_eq!(err.reason(), reason::ROOTFS_PULL_FAILED, "{outage}: {err}");
            assert!(err.registry_unreachable(), "{outage}: {err}");
        }
        let served = store
            .acquire(&format!("vm-a-{outage}"), &with(Some("a-password-1")))
            .await
            .unwrap_or_else(|e| panic!("{outage}: {e}"));
        assert!(served.offline && served.path == built.path, "{outage}");
    }
}

/// `reference` with the given policy, anonymous.
fn with_policy(reference: &str, policy: Option<PullPolicy>) -> ImageSpec {
    ImageSpec {
        base: reference.into(),
        runner: None,
        credentials: None,
        pull_policy: policy,
    }
}

/// A digest-pinned reference is served from the cache without one request reaching the
/// registry (counted by a proxy in front of it), whatever the registry does meanwhile; a tag
/// under the default `IfNotPresent` likewise; `Always` asks the registry every time.
#[tokio::test]
async fn digest_pinned_and_if_not_present_hits_send_no_registry_request() {
    let f = Fixture::new().await;
    let blobs: Vec<LayerBlob> = base_layers().into_iter().map(LayerBlob::gzipped).collect();
    let pushed = push_image(
        &f.registry.host(),
        "imp/base:1",
        &blobs,
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();
    let proxy = imp_testkit::proxy::CountingProxy::start(f.registry.host())
        .await
        .unwrap();
    let store = f.store_reaching(&proxy.host()).await;
    let pinned = format!("{}/imp/base@{}", proxy.host(), pushed.digest);
    let tagged = format!("{}/imp/base:1", proxy.host());

    for (reference, label) in [(&pinned, "digest"), (&tagged, "tag")] {
        let cold = store
            .acquire(&format!("vm-cold-{label}"), &with_policy(reference, None))
            .await
            .unwrap();
        assert!(cold.resolved, "{label}: the first request resolves");
        let before = proxy.requests();
        assert!(before > 0, "the proxy counts requests");
        for i in 0..3 {
            let hit = store
                .acquire(&format!("vm-{label}-{i}"), &with_policy(reference, None))
                .await
                .unwrap();
            assert!(hit.hit && !hit.resolved && !hit.offline, "{label}: {hit:?}");
            assert_eq!(hit.path, cold.path);
        }
        assert_eq!(proxy.requests(), before, "{label}: no request on a hit");
    }
    // Always: the registry is asked (a HEAD and a GET of the manifest at least), still a hit.
    let before = proxy.requests();
    let always = store
        .acquire("vm-always", &with_policy(&pinned, Some(PullPolicy::Always)))
        .await
        .unwrap();
    assert!(always.hit && always.resolved, "{always:?}");
    assert!(proxy.requests() > before);
    let text = f.metrics.encode();
    // 3 + 3 IfNotPresent hits, the tag's first (resolved) hit, Always's hit; one build.
    assert!(text.contains("imp_rootfs_cache_hits_total 8"), "{text}");
    assert!(text.contains("imp_rootfs_cache_misses_total 1"), "{text}");
}

/// `IfNotPresent` keeps the image a moved tag was built from; `Always` resolves the tag again
/// and builds what it points at now.
#[tokio::test]
async fn a_moved_tag_is_rebuilt_under_always_only() {
    let f = Fixture::new().await;
    let one = |body: &[u8]| vec![TarBuilder::new().file("v", body, 0o644).into_gzip()];
    let reference = f.push("imp/moving:stable", one(b"first")).await;
    let store = f.store(1 << 30).await;
    let first = store
        .acquire("vm-1", &with_policy(&reference, None))
        .await
        .unwrap();
    f.push("imp/moving:stable", one(b"second")).await;
    let kept = store
        .acquire(
            "vm-2",
            &with_policy(&reference, Some(PullPolicy::IfNotPresent)),
        )
        .await
        .unwrap();
    assert!(
        kept.hit && !kept.resolved && kept.key == first.key,
        "{kept:?}"
    );
    let moved = store
        .acquire("vm-3", &with_policy(&reference, Some(PullPolicy::Always)))
        .await
        .unwrap();
    assert!(!moved.hit && moved.key != first.key, "{moved:?}");
    assert_eq!(tree_of(&moved.path)["v"], "second");
    // `:latest` defaults to Always: the newest build is not trusted to be current.
    let latest = f.push("imp/moving:latest", one(b"third")).await;
    store
        .acquire("vm-4", &with_policy(&latest, None))
        .await
        .unwrap();
    f.push("imp/moving:latest", one(b"fourth")).await;
    let again = store
        .acquire("vm-5", &with_policy(&latest, None))
        .await
        .unwrap();
    assert!(!again.hit && again.resolved, "{again:?}");
}

/// A cached private image is handed out without the registry only to the credentials that
/// built it: a request without them, or with others, resolves and is refused, even for a
/// digest-pinned reference under `IfNotPresent`.
#[tokio::test]
async fn if_not_present_never_hands_a_private_image_to_other_credentials() {
    let f = Fixture::new().await;
    let private = private_registry().await;
    let proxy = imp_testkit::proxy::CountingProxy::start(private.host())
        .await
        .unwrap();
    let store = f.store_reaching(&proxy.host()).await;
    let tagged = format!("{}/a/secret:1", proxy.host());
    let spec = |reference: &str, password: Option<&str>| ImageSpec {
        pull_policy: Some(PullPolicy::IfNotPresent),
        ..tenant_a_spec(reference, password)
    };
    let built = store
        .acquire("vm-a", &spec(&tagged, Some("a-password-1")))
        .await
        .unwrap();
    let digest = store.index().get(&built.key).await.unwrap().unwrap();
    assert!(digest.pulled_with.starts_with("hmac-sha256:"));
    let before = proxy.requests();
    let again = store
        .acquire("vm-a2", &spec(&tagged, Some("a-password-1")))
        .await
        .unwrap();
    assert!(again.hit && !again.resolved);
    assert_eq!(proxy.requests(), before);
    for (vm, password) in [("vm-b", None), ("vm-c", Some("guess"))] {
        let err = store
            .acquire(vm, &spec(&tagged, password))
            .await
            .unwrap_err();
        assert_eq!(err.reason(), reason::ROOTFS_PULL_FAILED, "{err}");
        assert!(err.to_string().contains("refused the credentials"), "{err}");
    }
    assert!(
        proxy.requests() > before,
        "the refused requests asked the registry"
    );
}

/// A pre-build leaves the image cached and unreferenced; the first VM then starts from it with
/// a hit. Pre-builds count in their own metric, not as VM-start hits or misses; one that does
/// not fit the budget is reported as not cached.
#[tokio::test]
async fn a_prebuilt_image_is_the_first_vms_cache_hit() {
    let f = Fixture::new().await;
    let base = f.push("imp/base:1", base_layers()).await;
    let store = f.store(1 << 30).await;
    let pre = store.prebuild(&with_policy(&base, None)).await.unwrap();
    assert!(!pre.hit && store.is_cached(&pre.key).await.unwrap());
    assert_eq!(store.index().get(&pre.key).await.unwrap().unwrap().refs, 0);
    let again = store.prebuild(&with_policy(&base, None)).await.unwrap();
    assert!(again.hit && !again.resolved, "{again:?}");
    let vm = store
        .acquire("vm-1", &with_policy(&base, None))
        .await
        .unwrap();
    assert!(vm.hit && vm.key == pre.key, "{vm:?}");
    let text = f.metrics.encode();
    for want in [
        "imp_rootfs_prebuilds_total{outcome=\"built\"} 1",
        "imp_rootfs_prebuilds_total{outcome=\"cached\"} 1",
        "imp_rootfs_prebuilds_in_progress 0",
        "imp_rootfs_cache_hits_total 1",
    ] {
        assert!(text.contains(want), "{want}\n{text}");
    }
    assert!(!text.contains("imp_rootfs_cache_misses_total 1"), "{text}");

    // A budget smaller than the image: the pre-build is evicted at once, and says so.
    let other = f
        .push(
            "imp/other:1",
            vec![TarBuilder::new().file("o", b"o", 0o644).into_gzip()],
        )
        .await;
    drop(store);
    let tight = f.store(1).await;
    let evicted = tight.prebuild(&with_policy(&other, None)).await.unwrap();
    assert!(!tight.is_cached(&evicted.key).await.unwrap());
    // A failure counts as failed, with its reason in the build failures.
    let missing = format!("{}/imp/missing:1", f.registry.host());
    tight
        .prebuild(&with_policy(&missing, None))
        .await
        .unwrap_err();
    let text = f.metrics.encode();
    assert!(
        text.contains("imp_rootfs_prebuilds_total{outcome=\"failed\"} 1"),
        "{text}"
    );
}
