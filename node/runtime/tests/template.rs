//! Templates through imp-runtime's socket API with the unjailed Firecracker simulator
//! (docs/snapshots.md): an unjailed Firecracker keeps no templates (a load cannot override drive
//! paths; the jailed branch is tests/template_fc.rs), so a `from_template` VM boots and says why
//! (`TemplateUnsupported`), a cold boot reports `Boot` with no fallback, `from_template` is no
//! part of a spec conflict, and the template endpoints answer (POST: Failed with the reason,
//! nothing kept; GET: empty; DELETE: idempotent, 400 for a malformed key). The start report
//! survives a runtime restart (it is in the inventory). The QEMU path with real guests is
//! tests/template_qemu.rs.

mod common;

use common::{Harness, simulator};
use http::StatusCode;
use imp_api::names::reason;
use imp_runtime::api::{StartKind, TemplateState, VmState};
use imp_runtime::runtime::template::reason::TEMPLATE_UNSUPPORTED;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn firecracker_boots_from_template_requests_and_says_why() {
    let mut h = Harness::new(simulator());
    h.start_runtime().await;
    let mut spec = h.spec(false);

    let (_, cold) = h.client.ensure_running("plain", &spec).await.unwrap();
    let start = cold.start.expect("every started VM reports how");
    assert_eq!((start.from, start.fallback), (StartKind::Boot, None));

    spec.from_template = true;
    let (code, st) = h
        .client
        .ensure_running("tmpl", &spec)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", h.runtime_log()));
    assert_eq!((code, st.state), (StatusCode::CREATED, VmState::Running));
    let start = st.start.clone().unwrap();
    assert_eq!(start.from, StartKind::Boot);
    assert_eq!(start.template, None);
    let f = start.fallback.expect("a fallback reason");
    assert_eq!(f.reason, TEMPLATE_UNSUPPORTED, "{f:?}");

    // The same VM asked for without from_template: the same VM, not a conflict.
    spec.from_template = false;
    let (code, again) = h.client.ensure_running("tmpl", &spec).await.unwrap();
    assert_eq!((code, again.pid), (StatusCode::OK, st.pid));

    // The templates API: nothing kept on this backend.
    let t = h.client.ensure_template(&spec).await.unwrap();
    assert_eq!(t.state, TemplateState::Failed);
    assert_eq!(
        t.failure.map(|f| f.reason),
        Some(TEMPLATE_UNSUPPORTED.to_string())
    );
    assert_eq!(t.key.len(), 24, "{}", t.key);
    assert!(h.client.templates().await.unwrap().is_empty());
    h.client.delete_template(&t.key).await.unwrap();
    let e = h.client.delete_template("..").await.unwrap_err();
    assert_eq!(e.reason(), Some(reason::INVALID_SPEC), "{e}");

    let m = h.metrics().await;
    assert!(
        m.contains("imp_runtime_template_restores_total{outcome=\"TemplateUnsupported\"} 1"),
        "{m}"
    );
    // Recorded: a restarted runtime reports the same.
    h.kill9_runtime();
    h.start_runtime().await;
    assert_eq!(h.client.inspect("tmpl").await.unwrap().start, st.start);
    for uid in ["plain", "tmpl"] {
        h.client.delete(uid).await.unwrap();
    }
}
