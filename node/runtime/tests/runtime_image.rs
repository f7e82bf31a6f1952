//! imp-runtime building VM root filesystems from OCI images: through its socket API, with the
//! Firecracker simulator and a real registry (Debian's docker-registry) that needs credentials.

mod common;

use common::{Harness, simulator};
use http::StatusCode;
use imp_api::names::reason;
use imp_common::SecretString;
use imp_runtime::api::{VmSpec, VmState};
use imp_runtime::rootfs::auth::PullCredentials;
use imp_runtime::rootfs::store::ImageSpec;
use imp_testkit::oci::{LayerBlob, PushAuth, push_image};
use imp_testkit::registry::{Registry, RegistryOptions};
use imp_testkit::tarball::TarBuilder;

const USER: &str = "imp-puller";
const PASSWORD: &str = "pull-secret-6b1f0c93d2";

fn image_spec(h: &Harness, base: &str, password: &str) -> VmSpec {
    VmSpec {
        base_disk: None,
        image: Some(ImageSpec {
            base: base.into(),
            runner: None,
            credentials: Some(PullCredentials::Basic {
                username: USER.into(),
                password: SecretString::from(password),
            }),
            pull_policy: None,
        }),
        ..h.spec(false)
    }
}

fn images(h: &Harness) -> usize {
    std::fs::read_dir(h.state_dir.join("rootfs/images"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Every file under `dir` (recursively) that contains `needle`.
fn files_containing(dir: &std::path::Path, needle: &[u8]) -> Vec<String> {
    let mut hits = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let md = std::fs::symlink_metadata(&p).unwrap();
            if md.is_dir() {
                stack.push(p);
            } else if md.is_file()
                && std::fs::read(&p)
                    .unwrap_or_default()
                    .windows(needle.len())
                    .any(|w| w == needle)
            {
                hits.push(p.display().to_string());
            }
        }
    }
    hits
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vms_start_from_registry_images_share_one_build_and_release_it() {
    let registry = Registry::start(RegistryOptions {
        htpasswd: Some((USER.into(), PASSWORD.into())),
    })
    .await
    .unwrap();
    let host = registry.host();
    let creds = &PushAuth::Basic(USER.into(), PASSWORD.into());
    let layer = |name: &str| {
        LayerBlob::gzipped(
            TarBuilder::new()
                .dir("etc", 0o755)
                .file(&format!("etc/{name}"), name.as_bytes(), 0o644)
                .into_gzip(),
        )
    };
    push_image(&host, "ci/base:1", &[layer("base")], creds)
        .await
        .unwrap();
    let hostile = LayerBlob::gzipped(
        TarBuilder::new()
            .file("../../escaped", b"x", 0o644)
            .into_gzip(),
    );
    push_image(&host, "ci/hostile:1", &[hostile], creds)
        .await
        .unwrap();

    let mut h = Harness::new(simulator());
    h.extra_env = vec![
        ("IMP_INSECURE_REGISTRIES".into(), host.clone()),
        ("IMP_NODE_LOCAL_REGISTRIES".into(), host.clone()),
        // Nothing unreferenced is kept.
        ("IMP_ROOTFS_CACHE_BYTES".into(), "1".into()),
    ];
    h.start_runtime().await;
    let base = format!("{host}/ci/base:1");

    let spec = image_spec(&h, &base, PASSWORD);
    let (code, a) = h
        .client
        .ensure_running("vm-a", &spec)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", h.runtime_log()));
    assert_eq!((code, a.state), (StatusCode::CREATED, VmState::Running));
    let (code, b) = h.client.ensure_running("vm-b", &spec).await.unwrap();
    assert_eq!((code, b.state), (StatusCode::CREATED, VmState::Running));
    assert_eq!(images(&h), 1);
    // Idempotent with the credentials in the request (they are not part of the stored spec).
    let (code, _) = h.client.ensure_running("vm-a", &spec).await.unwrap();
    assert_eq!(code, StatusCode::OK);
    let m = h.metrics().await;
    assert!(m.contains("imp_rootfs_cache_misses_total 1"), "{m}");
    assert!(m.contains("imp_rootfs_cache_hits_total 1"), "{m}");

    // Wrong credentials: the registry refuses, the VM fails with a pull reason.
    let e = h
        .client
        .ensure_running(
            "vm-c",
            &image_spec(&h, &format!("{host}/ci/other:1"), "wrong"),
        )
        .await
        .unwrap_err();
    assert_eq!(e.reason(), Some(reason::ROOTFS_PULL_FAILED), "{e}");
    // A hostile layer: rejected, naming the entry; nothing written outside the work dir.
    let e = h
        .client
        .ensure_running(
            "vm-h",
            &image_spec(&h, &format!("{host}/ci/hostile:1"), PASSWORD),
        )
        .await
        .unwrap_err();
    assert_eq!(e.reason(), Some(reason::ROOTFS_REJECTED), "{e}");
    assert!(e.to_string().contains("../../escaped"), "{e}");
    assert!(!h.state_dir.join("escaped").exists() && !h.state_dir.join("rootfs/escaped").exists());
    let failed = h.client.inspect("vm-h").await.unwrap();
    assert_eq!(failed.state, VmState::Failed);

    // The last holder's delete releases the image; over budget, it is collected.
    h.client.delete("vm-a").await.unwrap();
    assert_eq!(images(&h), 1, "vm-b still holds it");
    // A restart keeps vm-b's reference.
    h.kill9_runtime();
    h.start_runtime().await;
    assert_eq!(images(&h), 1);
    h.client.delete("vm-b").await.unwrap();
    assert_eq!(images(&h), 0);
    let m = h.metrics().await;
    assert!(m.contains("imp_rootfs_cache_evictions_total 1"), "{m}");

    // The pull password never reaches the inventory, logs or any file the runtime wrote.
    let b64 = base64_auth(USER, PASSWORD);
    for needle in [PASSWORD.as_bytes(), b64.as_bytes()] {
        let hits = files_containing(h.dir.path(), needle);
        assert!(hits.is_empty(), "secret found in {hits:?}");
    }
}

fn base64_auth(user: &str, password: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
}

/// `POST /v1/images` through the socket: a pre-build with credentials leaves the image cached
/// (no VM holds it), the next VM of that image is a hit, a bad reference is refused naming the
/// field, and a refused pull answers with the pull reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prebuild_through_the_socket_makes_the_first_vm_a_hit() {
    let registry = Registry::start(RegistryOptions {
        htpasswd: Some((USER.into(), PASSWORD.into())),
    })
    .await
    .unwrap();
    let host = registry.host();
    let layer = LayerBlob::gzipped(
        TarBuilder::new()
            .file("etc-rolled", b"rolled", 0o644)
            .into_gzip(),
    );
    push_image(
        &host,
        "ci/rolled:2",
        &[layer],
        &PushAuth::Basic(USER.into(), PASSWORD.into()),
    )
    .await
    .unwrap();
    let mut h = Harness::new(simulator());
    h.extra_env = vec![
        ("IMP_INSECURE_REGISTRIES".into(), host.clone()),
        ("IMP_NODE_LOCAL_REGISTRIES".into(), host.clone()),
    ];
    h.start_runtime().await;
    let base = format!("{host}/ci/rolled:2");
    let spec = image_spec(&h, &base, PASSWORD);
    let image = spec.image.clone().unwrap();

    let built = h
        .client
        .prebuild(&image)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", h.runtime_log()));
    assert!(!built.hit && built.resolved && built.cached, "{built:?}");
    assert_eq!(images(&h), 1);
    let again = h.client.prebuild(&image).await.unwrap();
    assert!(
        again.hit && !again.resolved && again.key == built.key,
        "{again:?}"
    );
    let (code, vm) = h.client.ensure_running("vm-a", &spec).await.unwrap();
    assert_eq!((code, vm.state), (StatusCode::CREATED, VmState::Running));
    let m = h.metrics().await;
    for want in [
        "imp_rootfs_cache_hits_total 1",
        "imp_rootfs_prebuilds_total{outcome=\"built\"} 1",
        "imp_rootfs_prebuilds_total{outcome=\"cached\"} 1",
    ] {
        assert!(m.contains(want), "{want}\n{m}");
    }
    assert!(!m.contains("imp_rootfs_cache_misses_total 1"), "{m}");

    let bad = ImageSpec {
        base: "UPPER CASE::x".into(),
        ..image.clone()
    };
    let e = h.client.prebuild(&bad).await.unwrap_err();
    assert_eq!(e.reason(), Some(reason::INVALID_SPEC), "{e}");
    assert!(e.to_string().contains("image.base"), "{e}");
    let wrong = image_spec(&h, &format!("{host}/ci/other:1"), "wrong");
    let e = h
        .client
        .prebuild(wrong.image.as_ref().unwrap())
        .await
        .unwrap_err();
    assert_eq!(e.reason(), Some(reason::ROOTFS_PULL_FAILED), "{e}");
    h.client.delete("vm-a").await.unwrap();
}
