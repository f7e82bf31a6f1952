//! What the confinement tests (confine_qemu.rs, escape_qemu.rs) share: a runtime on the QEMU
//! backend (confined, the default) and the spec of a small busybox guest from a local registry.

use imp_runtime::api::VmSpec;
use imp_testkit::oci::push_gzip_image;
use imp_testkit::qemu;
use imp_testkit::registry::{Registry, RegistryOptions};

use super::{Harness, is_root};

/// A started runtime and what it needs alive (registry, initrd).
pub struct Guests {
    pub h: Harness,
    pub spec: VmSpec,
    _registry: Registry,
    _images: tempfile::TempDir,
}

/// None (having said why) when the QEMU path cannot run or this is not root (a uid switch
/// needs it); IMP_REQUIRE_QEMU=1 / IMP_REQUIRE_ROOT=1 turn those skips into failures.
pub async fn guests(tag: &str, network: bool) -> Option<Guests> {
    let s = qemu::setup_or_skip()?;
    if !is_root() {
        assert!(
            std::env::var_os("IMP_REQUIRE_ROOT").is_none(),
            "IMP_REQUIRE_ROOT is set but this test is not root"
        );
        eprintln!("SKIP: confinement switches uids and joins namespaces: needs root");
        return None;
    }
    let images = tempfile::tempdir().unwrap();
    let initrd = images.path().join("initrd.gz");
    qemu::scripted_initrd(&s, &initrd);
    let registry = Registry::start(RegistryOptions::default()).await.unwrap();
    let base = push_gzip_image(
        &registry.host(),
        &format!("imp/runner-base:{tag}"),
        vec![super::busybox_layer().into_gzip()],
    )
    .await;
    let mut h = Harness::qemu(&s, &initrd, registry.host());
    h.start_runtime().await;
    let spec = super::image_vm(base, 256, 64 << 20, network);
    Some(Guests {
        h,
        spec,
        _registry: registry,
        _images: images,
    })
}

/// Start each of `uids` with `spec`; panics (with the runtime's log) unless each is Running.
pub async fn start_all(h: &Harness, spec: &VmSpec, uids: &[&str]) {
    for uid in uids {
        let (_, st) = h
            .client
            .ensure_running(uid, spec)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", h.runtime_log()));
        assert_eq!(st.state, imp_runtime::api::VmState::Running, "{uid}");
    }
}
