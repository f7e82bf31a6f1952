//! The node's network from the inventory: the reconcile of bridges, ports and nft rules, the
//! wake counters of Suspended VMs, and a VM's link stats.

use tokio::time::Instant;

use super::{Runtime, RuntimeError, plan};
use crate::api::{LinkStats, NetworkAttachment, VmSpec, VmState};
use crate::inventory::VmRecord;
use crate::metrics::ReasonLabel;
use crate::network;
use crate::tap;

/// The row's ImpNetwork attachment, if its spec has one.
pub(super) fn attachment_of(r: &VmRecord) -> Option<NetworkAttachment> {
    serde_json::from_str::<VmSpec>(&r.spec_json)
        .ok()
        .and_then(|s| s.network)
        .and_then(|n| n.attachment)
}

/// The rows whose VM is on a network bridge: every one being brought up or running. Failed rows
/// released theirs; an Exited VM has nothing on its TAP any more (its row stays until DELETE,
/// the TAP is detached meanwhile).
fn network_ports(rows: &[VmRecord]) -> Vec<(String, [u8; 6], NetworkAttachment)> {
    rows.iter()
        .filter(|r| {
            // A suspended VM keeps its port and address (the network identity a resume and
            // the wake counter need).
            matches!(
                r.state,
                VmState::Creating
                    | VmState::Booting
                    | VmState::Running
                    | VmState::Suspending
                    | VmState::Suspended
                    | VmState::Resuming
            )
        })
        .filter_map(|r| {
            let spec: VmSpec = serde_json::from_str(&r.spec_json).ok()?;
            let a = spec.network.as_ref()?.attachment.clone()?;
            Some((r.tap.clone()?, plan::guest_mac(&r.uid, &spec), a))
        })
        .collect()
}

pub(super) fn rows_have_network(rows: &[VmRecord]) -> bool {
    rows.iter().any(|r| attachment_of(r).is_some())
}

impl Runtime {
    /// Make the node's bridges, TAP ports and nft rules match every networked VM of the
    /// inventory (docs/network.md). The caller holds `net_lock` across this and the inventory
    /// change it follows, so no other reconcile sees a half-made change (e.g. re-creates the
    /// TAP of a VM whose removal deleted it a moment ago).
    /// `uid` is the VM the reconcile is for: it fails only for a node-wide failure or one of
    /// that VM's network or port; failures of other networks are logged (their own VMs' starts
    /// report them) and never block this one.
    pub(super) async fn reconcile_network(
        &self,
        _held: &tokio::sync::MutexGuard<'_, ()>,
        uid: &str,
    ) -> Result<(), RuntimeError> {
        let rows = self.inventory.list().await?;
        let ports = network_ports(&rows);
        let desired = network::desired(ports.iter().map(|(t, m, a)| (t.clone(), *m, a)));
        let started = Instant::now();
        let fail = |e: network::NetworkError| {
            self.metrics
                .network_setup_failures
                .get_or_create(&ReasonLabel {
                    reason: e.kind().into(),
                })
                .inc();
            RuntimeError::NetworkSetupFailed {
                uid: uid.into(),
                source: e,
            }
        };
        let mut done = network::reconcile(&desired, &self.config().network)
            .await
            .map_err(fail)?;
        if !done.actions.is_empty() {
            tracing::info!(
                networks = desired.len(),
                vms = ports.len(),
                actions = done.actions.len(),
                seconds = started.elapsed().as_secs_f64(),
                "network reconciled"
            );
        }
        let mine = rows
            .iter()
            .find(|r| r.uid == uid)
            .and_then(|r| Some((r.tap.clone()?, attachment_of(r)?.network_id)))
            .and_then(|(tap, network)| done.take_failure(&network, &tap));
        for f in &done.failed {
            tracing::warn!(network = %f.network, tap = ?f.tap, error = %f.error, "network not set up; other networks were");
        }
        mine.map_or(Ok(()), |f| Err(fail(f.error)))
    }

    /// A reconcile after a VM left (DELETE, failed start, restart clean-up): failures are
    /// logged, not returned, since the VM is gone either way and the next reconcile retries.
    pub(super) async fn reconcile_network_after_release(
        &self,
        held: &tokio::sync::MutexGuard<'_, ()>,
        uid: &str,
    ) {
        if let Err(e) = self.reconcile_network(held, uid).await {
            tracing::warn!(uid, error = %e, "network reconcile after a VM left failed; the next one retries");
        }
    }

    /// One wake counter per Suspended VM with an address, none for anything else. Failures
    /// are logged: the counter is a hint, and the next suspend, resume or delete retries.
    pub(super) async fn sync_wake_counters(&self) {
        let Ok(rows) = self.inventory.list().await else {
            return;
        };
        let addrs: Vec<std::net::Ipv4Addr> = rows
            .iter()
            .filter(|r| r.state == VmState::Suspended)
            .filter_map(attachment_of)
            .map(|a| a.address.addr())
            .collect();
        if let Err(e) = network::wake_sync(&addrs).await {
            tracing::warn!(error = %e, "wake counters not updated");
        }
    }

    /// The TAP's counters, for a Running VM and a Suspended one (whose TAP stays; its
    /// `wake_packets` counts what was routed towards its address meanwhile).
    pub async fn linkstats(&self, uid: &str) -> Result<LinkStats, RuntimeError> {
        let r = match self.running(uid, "linkstats").await {
            Err(RuntimeError::NotRunning {
                state: VmState::Suspended,
                ..
            }) => self
                .inventory
                .get(uid)
                .await?
                .ok_or_else(|| RuntimeError::NotFound(uid.into()))?,
            other => other?,
        };
        let t = r
            .tap
            .clone()
            .ok_or_else(|| RuntimeError::NoNetwork(uid.into()))?;
        let mut stats = tap::stats(&t).map_err(|source| RuntimeError::LinkStats {
            uid: uid.into(),
            source,
        })?;
        if r.state == VmState::Suspended
            && let Some(a) = attachment_of(&r)
        {
            stats.wake_packets = network::wake_packets(a.address.addr()).await;
        }
        Ok(stats)
    }
}
