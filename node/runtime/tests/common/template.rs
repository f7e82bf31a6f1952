//! What the template tests (template_fc.rs, template_qemu.rs) share: a VM created and waited for
//! Running, and a template waited for until it is built.

use std::time::{Duration, Instant};

use imp_runtime::api::{TemplateState, TemplateStatus, VmSpec, VmState, VmStatus};

use super::Harness;

/// PUT and wait: the status and the seconds from create to Running.
pub async fn put(h: &Harness, uid: &str, spec: &VmSpec) -> (VmStatus, f64) {
    let t = Instant::now();
    let (_, st) = h
        .client
        .ensure_running(uid, spec)
        .await
        .unwrap_or_else(|e| panic!("PUT {uid}: {e}\n{}", h.runtime_log()));
    assert_eq!(st.state, VmState::Running, "{st:?}");
    (st, t.elapsed().as_secs_f64())
}

/// The template `key` once it is no longer Building, asked every `poll`; fails after `within`.
pub async fn wait_built(
    h: &Harness,
    key: &str,
    within: Duration,
    poll: Duration,
) -> TemplateStatus {
    let deadline = Instant::now() + within;
    loop {
        let all = h.client.templates().await.unwrap();
        if let Some(t) = all.iter().find(|t| t.key == key)
            && t.state != TemplateState::Building
        {
            return t.clone();
        }
        assert!(
            Instant::now() < deadline,
            "template {key} not built: {all:?}\n{}",
            h.runtime_log()
        );
        tokio::time::sleep(poll).await;
    }
}
