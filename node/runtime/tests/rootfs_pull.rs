//! Rootfs pulls against a real registry (Debian's `docker-registry`, CNCF distribution) on
//! 127.0.0.1: images are built and pushed by the tests, then resolved and fetched with
//! `imp_runtime::rootfs::pull`, including registries and manifests that misbehave on purpose.

use std::{
    io::Write,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use base64::Engine;
use imp_api::names::reason;
use imp_common::SecretString;
use imp_runtime::rootfs::{
    Compression,
    auth::{PullCredentials, RegistryAuth},
    pull::{PullConfig, PullError, Puller, ResolvedImage},
};
use imp_testkit::{
    oci::{self, LayerBlob, PushAuth},
    registry::{Registry, RegistryOptions},
};

const USER: &str = "imp-puller";
const PASSWORD: &str = "Pw-7c1f9e2b-not-in-logs";

fn puller(registry: &Registry) -> Puller {
    puller_with(registry, PullConfig::default().max_layer_bytes)
}

fn puller_with(registry: &Registry, max_layer_bytes: u64) -> Puller {
    puller_with_host(&registry.host(), max_layer_bytes)
}

async fn anonymous_registry() -> Registry {
    Registry::start(RegistryOptions::default())
        .await
        .expect("start docker-registry")
}

async fn auth_registry() -> Registry {
    Registry::start(RegistryOptions {
        htpasswd: Some((USER.into(), PASSWORD.into())),
    })
    .await
    .expect("start docker-registry with htpasswd")
}

fn two_layers() -> Vec<LayerBlob> {
    vec![
        LayerBlob::tar_gzip(&[
            ("etc/os-release", b"ID=imp-test\n"),
            ("bin/tool", b"\x7fELF"),
        ]),
        LayerBlob::tar(&[("etc/motd", b"second layer\n")]),
    ]
}

fn push_creds() -> PushAuth {
    PushAuth::Basic(USER.into(), PASSWORD.into())
}

fn basic(password: &str) -> RegistryAuth {
    RegistryAuth::Basic {
        username: USER.into(),
        password: SecretString::from(password),
    }
}

/// Fetches every layer of `image` into `dir`, named by position.
async fn fetch_all(
    puller: &Puller,
    image: &ResolvedImage,
    auth: &RegistryAuth,
    dir: &Path,
) -> Result<Vec<PathBuf>, PullError> {
    let mut paths = Vec::new();
    for (i, layer) in image.layers.iter().enumerate() {
        let dest = dir.join(format!("layer-{i}"));
        puller.fetch_layer(image, layer, auth, &dest).await?;
        paths.push(dest);
    }
    Ok(paths)
}

/// Fetches layer `index` of `image` into an empty directory, expecting a refusal; the directory
/// must stay empty (no partial or temp file survives a failed fetch).
async fn fetch_refused(
    puller: &Puller,
    image: &ResolvedImage,
    index: usize,
    auth: &RegistryAuth,
) -> PullError {
    let dir = tempfile::tempdir().unwrap();
    let err = puller
        .fetch_layer(image, &image.layers[index], auth, &dir.path().join("layer"))
        .await
        .unwrap_err();
    assert!(
        dir_entries(dir.path()).is_empty(),
        "{:?}",
        dir_entries(dir.path())
    );
    err
}

fn dir_entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Resolves and fetches `host/repo` with `auth`, checking every byte against `layers`.
async fn pull_and_compare(
    registry: &Registry,
    repo_tag: &str,
    auth: &RegistryAuth,
    layers: &[LayerBlob],
) -> ResolvedImage {
    let puller = puller(registry);
    let reference = format!("{}/{repo_tag}", registry.host());
    let image = puller.resolve(&reference, auth).await.expect("resolve");
    let dir = tempfile::tempdir().unwrap();
    let paths = fetch_all(&puller, &image, auth, dir.path())
        .await
        .expect("fetch layers");
    assert_eq!(paths.len(), layers.len());
    for ((path, pushed), layer) in paths.iter().zip(layers).zip(&image.layers) {
        assert_eq!(std::fs::read(path).unwrap(), pushed.bytes);
        assert_eq!(layer.digest, pushed.digest());
        assert_eq!(layer.size, pushed.bytes.len() as u64);
        assert_eq!(layer.media_type, pushed.media_type);
    }
    // Nothing but the layers: temp files were renamed away.
    let want: Vec<String> = (0..layers.len()).map(|i| format!("layer-{i}")).collect();
    assert_eq!(dir_entries(dir.path()), want);
    image
}

#[tokio::test]
async fn anonymous_pull_of_a_two_layer_image() {
    let registry = anonymous_registry().await;
    let layers = two_layers();
    let pushed = oci::push_image(
        &registry.host(),
        "imp/base:v1",
        &layers,
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();

    let image = pull_and_compare(&registry, "imp/base:v1", &RegistryAuth::Anonymous, &layers).await;
    assert_eq!(image.reference, format!("{}/imp/base:v1", registry.host()));
    assert_eq!(image.registry, registry.host());
    assert_eq!(image.manifest_digest, pushed.digest);
    assert_eq!(
        image.config_digest,
        oci::sha256_digest(&oci::image_config(&layers))
    );
    assert_eq!(image.layers[0].compression, Compression::Gzip);
    assert_eq!(image.layers[1].compression, Compression::None);

    // By digest too.
    let by_digest = format!("{}/imp/base@{}", registry.host(), pushed.digest);
    let again = puller(&registry)
        .resolve(&by_digest, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    assert_eq!(again.layers, image.layers);
}

#[tokio::test]
async fn zstd_layers_pull_beside_gzip_and_plain_ones() {
    let registry = anonymous_registry().await;
    let mut layers = two_layers();
    layers.push(LayerBlob::tar_zstd(&[("etc/motd", b"zstd layer\n")]));
    oci::push_image(
        &registry.host(),
        "imp/mixed:v1",
        &layers,
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();

    let image =
        pull_and_compare(&registry, "imp/mixed:v1", &RegistryAuth::Anonymous, &layers).await;
    let compression: Vec<Compression> = image.layers.iter().map(|l| l.compression).collect();
    assert_eq!(
        compression,
        [Compression::Gzip, Compression::None, Compression::Zstd]
    );
}

#[tokio::test]
async fn index_resolves_to_the_linux_amd64_entry() {
    let registry = anonymous_registry().await;
    let host = registry.host();
    let amd64_layers = two_layers();
    let arm64_layers = vec![LayerBlob::tar(&[("arch", b"arm64")])];
    let amd64 = oci::push_image(
        &host,
        "imp/multi:amd64",
        &amd64_layers,
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();
    let arm64 = oci::push_image(
        &host,
        "imp/multi:arm64",
        &arm64_layers,
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();
    // arm64 first, so taking the first entry would be wrong.
    oci::push_index(
        &host,
        "imp/multi:v1",
        &[(arm64, "linux/arm64"), (amd64.clone(), "linux/amd64")],
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();

    let image = pull_and_compare(
        &registry,
        "imp/multi:v1",
        &RegistryAuth::Anonymous,
        &amd64_layers,
    )
    .await;
    assert_eq!(image.manifest_digest, amd64.digest);
}

#[tokio::test]
async fn index_without_linux_amd64_names_the_platforms_offered() {
    let registry = anonymous_registry().await;
    let host = registry.host();
    let layers = vec![LayerBlob::tar(&[("x", b"x")])];
    let one = oci::push_image(&host, "imp/arm:a", &layers, &PushAuth::Anonymous)
        .await
        .unwrap();
    oci::push_index(
        &host,
        "imp/arm:v1",
        &[(one.clone(), "linux/arm64"), (one, "windows/amd64")],
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();

    let err = puller(&registry)
        .resolve(&format!("{host}/imp/arm:v1"), &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    match &err {
        PullError::NoLinuxAmd64 { platforms, .. } => {
            assert_eq!(platforms, &["linux/arm64", "windows/amd64"])
        }
        other => panic!("expected NoLinuxAmd64, got {other:?}"),
    }
    assert_eq!(err.reason(), reason::ROOTFS_REJECTED);
}

#[tokio::test]
async fn tampered_blob_is_a_digest_mismatch_and_leaves_no_file() {
    let registry = anonymous_registry().await;
    let layers = two_layers();
    oci::push_image(
        &registry.host(),
        "imp/tamper:v1",
        &layers,
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();
    // Same length, different bytes: only the digest can catch it.
    let stored = registry.blob_path(&layers[1].digest());
    let mut bytes = std::fs::read(&stored).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&stored, &bytes).unwrap();

    let puller = puller(&registry);
    let image = puller
        .resolve(
            &format!("{}/imp/tamper:v1", registry.host()),
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap();
    let err = fetch_refused(&puller, &image, 1, &RegistryAuth::Anonymous).await;
    match &err {
        PullError::DigestMismatch { digest, actual } => {
            assert_eq!(digest, &layers[1].digest());
            assert_eq!(actual, &oci::sha256_digest(&bytes));
        }
        other => panic!("expected DigestMismatch, got {other:?}"),
    }
    assert_eq!(err.reason(), reason::ROOTFS_REJECTED);

    // The untouched layer still fetches.
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("layer");
    puller
        .fetch_layer(&image, &image.layers[0], &RegistryAuth::Anonymous, &dest)
        .await
        .unwrap();
    assert_eq!(std::fs::read(&dest).unwrap(), layers[0].bytes);
}

#[tokio::test]
async fn declared_size_that_differs_from_the_blob_is_a_size_mismatch() {
    let registry = anonymous_registry().await;
    let layers = two_layers();
    let real = layers[0].bytes.len() as u64;
    let puller = puller(&registry);
    for (tag, declared) in [("bigger", real + 1), ("smaller", real - 1)] {
        oci::push_image_with(
            &registry.host(),
            &format!("imp/size:{tag}"),
            &layers,
            &PushAuth::Anonymous,
            |m| m["layers"][0]["size"] = declared.into(),
        )
        .await
        .unwrap();
        let image = puller
            .resolve(
                &format!("{}/imp/size:{tag}", registry.host()),
                &RegistryAuth::Anonymous,
            )
            .await
            .unwrap();
        assert_eq!(image.layers[0].size, declared);
        let err = fetch_refused(&puller, &image, 0, &RegistryAuth::Anonymous).await;
        match err {
            PullError::SizeMismatch {
                digest,
                expected,
                actual,
            } => {
                assert_eq!(digest, layers[0].digest());
                assert_eq!(expected, declared);
                assert_eq!(actual, real, "{tag}");
            }
            other => panic!("{tag}: expected SizeMismatch, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn unknown_layer_media_type_is_refused_naming_the_layer() {
    let registry = anonymous_registry().await;
    let layers = two_layers();
    oci::push_image_with(
        &registry.host(),
        "imp/media:v1",
        &layers,
        &PushAuth::Anonymous,
        |m| m["layers"][1]["mediaType"] = "application/vnd.example.layer.v1.tar+lz4".into(),
    )
    .await
    .unwrap();
    let err = puller(&registry)
        .resolve(
            &format!("{}/imp/media:v1", registry.host()),
            &RegistryAuth::Anonymous,
        )
        .await
        .unwrap_err();
    match err {
        PullError::UnsupportedMediaType {
            what,
            digest,
            media_type,
        } => {
            assert_eq!(what, "layer");
            assert_eq!(digest, layers[1].digest());
            assert_eq!(media_type, "application/vnd.example.layer.v1.tar+lz4");
        }
        other => panic!("expected UnsupportedMediaType, got {other:?}"),
    }
}

#[tokio::test]
async fn layer_over_the_size_cap_is_refused_before_download() {
    let registry = anonymous_registry().await;
    let layers = two_layers();
    oci::push_image(
        &registry.host(),
        "imp/big:v1",
        &layers,
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();
    let reference = format!("{}/imp/big:v1", registry.host());
    let cap = layers[0].bytes.len() as u64 - 1;

    let err = puller_with(&registry, cap)
        .resolve(&reference, &RegistryAuth::Anonymous)
        .await
        .unwrap_err();
    match err {
        PullError::TooLarge {
            what,
            digest,
            size,
            limit,
        } => {
            assert_eq!(what, "layer");
            assert_eq!(digest, layers[0].digest());
            assert_eq!(size, layers[0].bytes.len() as u64);
            assert_eq!(limit, cap);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }

    // fetch_layer holds a resolved image from a laxer puller to the same cap, before any request:
    // with the registry gone, anything else would be a registry error.
    let image = puller(&registry)
        .resolve(&reference, &RegistryAuth::Anonymous)
        .await
        .unwrap();
    drop(registry);
    let err = fetch_refused(
        &puller_with_host(&image.registry, cap),
        &image,
        0,
        &RegistryAuth::Anonymous,
    )
    .await;
    assert!(matches!(err, PullError::TooLarge { .. }), "{err:?}");
}

fn puller_with_host(host: &str, max_layer_bytes: u64) -> Puller {
    Puller::new(PullConfig {
        insecure_registries: vec![host.to_owned()],
        node_local_registries: vec![host.to_owned()],
        max_layer_bytes,
        ..PullConfig::default()
    })
}

#[tokio::test]
async fn missing_tag_is_not_found() {
    let registry = anonymous_registry().await;
    oci::push_image(
        &registry.host(),
        "imp/present:v1",
        &two_layers(),
        &PushAuth::Anonymous,
    )
    .await
    .unwrap();
    for reference in ["imp/present:nope", "imp/absent:v1"] {
        let err = puller(&registry)
            .resolve(
                &format!("{}/{reference}", registry.host()),
                &RegistryAuth::Anonymous,
            )
            .await
            .unwrap_err();
        assert!(
            matches!(err, PullError::NotFound { .. }),
            "{reference}: {err:?}"
        );
        assert_eq!(err.reason(), reason::ROOTFS_PULL_FAILED);
    }
}

#[tokio::test]
async fn basic_auth_right_wrong_and_missing_credentials() {
    let registry = auth_registry().await;
    let layers = two_layers();
    oci::push_image(&registry.host(), "imp/private:v1", &layers, &push_creds())
        .await
        .unwrap();

    pull_and_compare(&registry, "imp/private:v1", &basic(PASSWORD), &layers).await;

    let reference = format!("{}/imp/private:v1", registry.host());
    for auth in [basic("wrong-password"), RegistryAuth::Anonymous] {
        let err = puller(&registry)
            .resolve(&reference, &auth)
            .await
            .unwrap_err();
        match &err {
            PullError::Unauthorized { registry: r } => assert_eq!(r, &registry.host()),
            other => panic!("{auth:?}: expected Unauthorized, got {other:?}"),
        }
    }

    // Blob fetches are authorised on their own, not by a client that resolved earlier.
    let image = puller(&registry)
        .resolve(&reference, &basic(PASSWORD))
        .await
        .unwrap();
    let err = fetch_refused(&puller(&registry), &image, 0, &RegistryAuth::Anonymous).await;
    assert!(matches!(err, PullError::Unauthorized { .. }), "{err:?}");
}

#[tokio::test]
async fn dockerconfigjson_credentials_pull() {
    let registry = auth_registry().await;
    let layers = two_layers();
    oci::push_image(&registry.host(), "imp/dcj:v1", &layers, &push_creds())
        .await
        .unwrap();
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"));
    let config = format!(
        r#"{{"auths": {{"other.example:5000": {{"auth": "Zm9vOmJhcg=="}}, "{}": {{"auth": "{encoded}"}}}}}}"#,
        registry.host()
    );
    // As the agent sends it in PUT /v1/vms.
    let wire = serde_json::json!({ "dockerconfigjson": config }).to_string();
    let creds: PullCredentials = serde_json::from_str(&wire).unwrap();
    let auth = creds.for_registry(&registry.host()).unwrap();
    assert_eq!(auth, basic(PASSWORD));
    pull_and_compare(&registry, "imp/dcj:v1", &auth, &layers).await;
}

/// A `tracing` writer into a shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn authenticated_pull_never_logs_the_password() {
    let registry = auth_registry().await;
    let layers = two_layers();
    oci::push_image(&registry.host(), "imp/logs:v1", &layers, &push_creds())
        .await
        .unwrap();

    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "debug,oci_client=trace,imp_runtime=trace",
        ))
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    // Global, not thread-local: tracing caches callsite interest process-wide, so a callsite
    // first hit by a concurrently running test (with no subscriber) would stay silent under a
    // thread-local default. Only this test installs a subscriber; the other tests' events land in
    // the buffer too, which only widens the check.
    tracing::subscriber::set_global_default(subscriber).expect("the only global subscriber");
    let creds = PullCredentials::Basic {
        username: USER.into(),
        password: SecretString::from(PASSWORD),
    };
    let auth = creds.for_registry(&registry.host()).unwrap();
    tracing::info!(?creds, ?auth, "pulling with");
    pull_and_compare(&registry, "imp/logs:v1", &auth, &layers).await;
    let err = puller(&registry)
        .resolve(
            &format!("{}/imp/logs:v1", registry.host()),
            &basic(&format!("{PASSWORD}-wrong")),
        )
        .await
        .unwrap_err();
    tracing::info!(error = %err, ?err, "expected failure");

    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(
        log.contains("oci_client"),
        "capture saw no oci_client events:\n{log}"
    );
    assert!(
        log.contains("imp_runtime"),
        "capture saw no imp_runtime events:\n{log}"
    );
    let basic_header =
        base64::engine::general_purpose::STANDARD.encode(format!("{USER}:{PASSWORD}"));
    for secret in [PASSWORD, basic_header.as_str()] {
        assert!(
            !log.contains(secret),
            "{secret:?} appears in the log:\n{log}"
        );
    }
}

/// A registry that streams a blob without Content-Length, sends more than the descriptor
/// declares, then holds the connection open: the fetch has to stop on its own count, not wait
/// for the end of the body.
#[tokio::test]
async fn blob_running_over_its_declared_size_stops_the_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let host = listener.local_addr().unwrap().to_string();
    let declared = b"declared layer bytes".to_vec();
    let served = [declared.clone(), vec![b'!'; 4096]].concat();
    let server = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                conn.read_exact(&mut byte).await.unwrap();
                head.push(byte[0]);
            }
            let head = String::from_utf8(head).unwrap();
            if head.starts_with("GET /v2/ ") {
                conn.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
                )
                .await
                .unwrap();
            } else {
                assert!(head.starts_with("GET /v2/imp/x/blobs/sha256:"), "{head}");
                let chunk = format!(
                    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n",
                    served.len()
                );
                conn.write_all(chunk.as_bytes()).await.unwrap();
                conn.write_all(&served).await.unwrap();
                conn.write_all(b"\r\n").await.unwrap();
                // No terminating chunk: the body never ends.
                held.push(conn);
            }
        }
    });

    let digest = oci::sha256_digest(&declared);
    let layer = imp_runtime::rootfs::pull::LayerRef {
        digest: digest.clone(),
        size: declared.len() as u64,
        media_type: oci::LAYER_TAR.into(),
        compression: Compression::None,
    };
    let image = ResolvedImage {
        reference: format!("{host}/imp/x:v1"),
        registry: host.clone(),
        manifest_digest: oci::sha256_digest(b"unused"),
        config_digest: oci::sha256_digest(b"unused"),
        layers: vec![layer.clone()],
    };
    let dir = tempfile::tempdir().unwrap();
    let puller = puller_with_host(&host, 1 << 20);
    let dest = dir.path().join("layer");
    let fetch = puller.fetch_layer(&image, &layer, &RegistryAuth::Anonymous, &dest);
    let err = tokio::time::timeout(std::time::Duration::from_secs(20), fetch)
        .await
        .expect("the fetch stops by itself once the blob runs over")
        .unwrap_err();
    match err {
        PullError::SizeMismatch {
            digest: d,
            expected,
            actual,
        } => {
            assert_eq!(d, digest);
            assert_eq!(expected, declared.len() as u64);
            assert!(actual > expected, "{actual}");
        }
        other => panic!("expected SizeMismatch, got {other:?}"),
    }
    assert!(dir_entries(dir.path()).is_empty());
    server.abort();
}

/// A registry whose manifest declares (HEAD) 1 GiB and whose GET never ends: the pull is refused
/// naming the cap before the body is read, so the GET body sent stays at zero bytes.
#[tokio::test]
async fn an_oversize_manifest_is_refused_from_its_declared_size_before_reading_it() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let host = listener.local_addr().unwrap().to_string();
    let sent = Arc::new(AtomicU64::new(0));
    let counter = sent.clone();
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = conn.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let line = head.lines().next().unwrap_or_default().to_string();
                if line.starts_with("HEAD ") && line.contains("/manifests/") {
                    let _ = conn
                        .write_all(
                            b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\n\
                              Content-Length: 1073741824\r\nConnection: close\r\n\r\n",
                        )
                        .await;
                } else if line.starts_with("GET ") && line.contains("/manifests/") {
                    let _ = conn
                        .write_all(
                            b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\n\
                              Connection: close\r\n\r\n",
                        )
                        .await;
                    let chunk = vec![b' '; 64 << 10];
                    while conn.write_all(&chunk).await.is_ok() {
                        counter.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                    }
                } else {
                    // /v2/ and anything else: an open registry.
                    let _ = conn
                        .write_all(
                            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
                        )
                        .await;
                }
            });
        }
    });
    let cap = 1u64 << 20;
    let puller = Puller::new(PullConfig {
        insecure_registries: vec![host.clone()],
        node_local_registries: vec![host.clone()],
        max_manifest_bytes: cap,
        ..PullConfig::default()
    });
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        puller.resolve(&format!("{host}/imp/endless:1"), &RegistryAuth::Anonymous),
    )
    .await
    .expect("the pull ends without reading the endless body")
    .unwrap_err();
    match &err {
        PullError::TooLarge {
            what, size, limit, ..
        } => {
            assert_eq!((*what, *size, *limit), ("manifest", 1 << 30, cap), "{err}");
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(err.reason(), reason::ROOTFS_REJECTED);
    assert!(err.to_string().contains(&cap.to_string()), "{err}");
    assert_eq!(sent.load(Ordering::SeqCst), 0, "the manifest body was read");
    server.abort();
}
