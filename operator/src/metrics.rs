//! Prometheus metrics of the operator's ImpVM controller (prometheus-client). Every metric is listed in
//! docs/metrics.md. Clones share the underlying series.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `scheduled` or `unschedulable`.
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    /// `reschedule` or `in-place`.
    pub mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub controller: String,
    /// [`crate::error::Error::metric_label`].
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabels {
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// VmPhase, or `Unknown` before the first status write.
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NetworkAddressLabels {
    /// `namespace/name` of the ImpNetwork.
    pub network: String,
    /// `allocated` or `free`.
    pub state: String,
}

/// Metrics of the ImpVM controller.
#[derive(Clone)]
pub struct VmMetrics {
    /// `imp_vm_scheduling_latency_seconds`: ImpVM creation -> first binding to a node.
    pub scheduling_latency: Histogram,
    /// `imp_vm_scheduling_attempts_total{result}`.
    pub scheduling_attempts: Family<ResultLabels, Counter>,
    /// `imp_vm_node_lost_total{reason}`: VMs failed or rescheduled because their node was lost.
    pub node_lost: Family<ReasonLabels, Counter>,
    /// `imp_vm_restarts_total{mode}`: restarts of persistent VMs.
    pub restarts: Family<ModeLabels, Counter>,
    /// `imp_vm_retry_exhausted_total`.
    pub retry_exhausted: Counter,
    /// `imp_vm_restart_budget_resets_total{reason}`: `CoolDownElapsed` or `ManualReset`.
    pub budget_resets: Family<ReasonLabels, Counter>,
    /// `imp_vm_expired_total`: VMs deleted because expireAfter elapsed.
    pub expired: Counter,
    /// `imp_vm_finalizer_forced_total`: finalizers removed without a teardown record (node gone).
    pub finalizer_forced: Counter,
    /// `imp_vm_spec_invalid_total`: VMs failed with SpecInvalid.
    pub spec_invalid: Counter,
    /// `imp_node_agent_heartbeat_timestamp_seconds{node}`: last renewTime of the node agent's Lease.
    pub agent_heartbeat: Family<NodeLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// `imp_vms{phase}`: ImpVMs by phase (refreshed from the watch cache).
    pub vms_by_phase: Family<PhaseLabels, Gauge>,
    /// `imp_node_vm_backlog{node}`: VMs bound to the node but not yet Running (Scheduled or Starting).
    pub node_backlog: Family<NodeLabels, Gauge>,
    /// `imp_operator_reconcile_duration_seconds{controller}`.
    pub reconcile_duration: Family<ControllerLabels, Histogram>,
    /// `imp_operator_reconcile_errors_total{controller,error}`.
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    /// `imp_network_allocation_failures_total{reason}`: VMs whose address allocation failed.
    pub network_allocation_failures: Family<ReasonLabels, Counter>,
    /// `imp_network_addresses{network,state}`: built-in IPAM addresses allocated and free.
    pub network_addresses: Family<NetworkAddressLabels, Gauge>,
}

impl Default for VmMetrics {
    fn default() -> Self {
        VmMetrics {
            // 50 ms .. ~27 min: a busy cluster may keep VMs Pending for minutes.
            scheduling_latency: Histogram::new(exponential_buckets(0.05, 2.0, 16)),
            scheduling_attempts: Family::default(),
            node_lost: Family::default(),
            restarts: Family::default(),
            retry_exhausted: Counter::default(),
            budget_resets: Family::default(),
            expired: Counter::default(),
            finalizer_forced: Counter::default(),
            spec_invalid: Counter::default(),
            agent_heartbeat: Family::default(),
            vms_by_phase: Family::default(),
            node_backlog: Family::default(),
            reconcile_duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 14))
            }),
            reconcile_errors: Family::default(),
            network_allocation_failures: Family::default(),
            network_addresses: Family::default(),
        }
    }
}

impl VmMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "imp_vm_scheduling_latency_seconds",
            "Time from ImpVM creation to its first binding to a node",
            self.scheduling_latency.clone(),
        );
        registry.register(
            "imp_vm_scheduling_attempts",
            "Scheduling attempts by result",
            self.scheduling_attempts.clone(),
        );
        registry.register(
            "imp_vm_node_lost",
            "VMs failed or rescheduled because their node was lost",
            self.node_lost.clone(),
        );
        registry.register(
            "imp_vm_restarts",
            "Restarts of persistent VMs by mode",
            self.restarts.clone(),
        );
        registry.register(
            "imp_vm_retry_exhausted",
            "Persistent VMs whose restart budget ran out",
            self.retry_exhausted.clone(),
        );
        registry.register(
            "imp_vm_restart_budget_resets",
            "Restart budgets reset, by reason",
            self.budget_resets.clone(),
        );
        registry.register(
            "imp_vm_expired",
            "VMs deleted because expireAfter elapsed",
            self.expired.clone(),
        );
        registry.register(
            "imp_vm_finalizer_forced",
            "VM finalizers removed without a teardown record because the node was gone",
            self.finalizer_forced.clone(),
        );
        registry.register(
            "imp_vm_spec_invalid",
            "VMs failed with SpecInvalid",
            self.spec_invalid.clone(),
        );
        registry.register(
            "imp_node_agent_heartbeat_timestamp_seconds",
            "Unix time of the last renewal of each node agent's heartbeat Lease",
            self.agent_heartbeat.clone(),
        );
        registry.register("imp_vms", "ImpVMs by phase", self.vms_by_phase.clone());
        registry.register(
            "imp_node_vm_backlog",
            "ImpVMs bound to the node but not yet Running (Scheduled or Starting)",
            self.node_backlog.clone(),
        );
        registry.register(
            "imp_operator_reconcile_duration_seconds",
            "Duration of one reconcile pass",
            self.reconcile_duration.clone(),
        );
        registry.register(
            "imp_operator_reconcile_errors",
            "Reconcile passes that failed, by error",
            self.reconcile_errors.clone(),
        );
        registry.register(
            "imp_network_allocation_failures",
            "ImpVMs whose address could not be allocated, by reason",
            self.network_allocation_failures.clone(),
        );
        registry.register(
            "imp_network_addresses",
            "Built-in IPAM addresses of each ImpNetwork, allocated and free",
            self.network_addresses.clone(),
        );
    }

    pub fn reconcile_failed(&self, controller: &str, error: &crate::error::Error) {
        count_reconcile_error(&self.reconcile_errors, controller, error);
    }
}

/// Metrics of the memory-pressure lifecycle ([`crate::pressure`]), exported only when it is enabled.
#[derive(Clone, Default)]
pub struct PressureMetrics {
    /// `imp_pressure_suspensions_total{node}`: VMs the lifecycle set to desiredState Suspended.
    pub suspensions: Family<NodeLabels, Counter>,
    /// `imp_pressure_suspend_stalls_total`: suspends not reported Suspended within the timeout.
    pub stalls: Counter,
    /// `imp_pressure_lifts_total`: lifecycle suspends lifted by someone setting another desiredState.
    pub lifts: Counter,
    /// `imp_pressure_nodes`: watched nodes whose MemoryPressure condition is True.
    pub nodes: Gauge,
    /// `imp_pressure_nodes_exhausted`: of those, nodes with nothing left the lifecycle may suspend.
    pub nodes_exhausted: Gauge,
    /// `imp_pressure_suspended_vms`: VMs the lifecycle holds at desiredState Suspended.
    pub held: Gauge,
    /// Failed writes, under `imp_operator_reconcile_errors_total{controller="pressure"}` when shared
    /// with the ImpVM controller's metrics ([`PressureMetrics::sharing_reconcile`]).
    pub errors: Family<ErrorLabels, Counter>,
}

impl PressureMetrics {
    /// Failed writes counted in the ImpVM controller's `imp_operator_reconcile_errors_total`.
    pub fn sharing_reconcile(vm: &VmMetrics) -> Self {
        PressureMetrics {
            errors: vm.reconcile_errors.clone(),
            ..Default::default()
        }
    }

    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "imp_pressure_suspensions",
            "ImpVMs the memory-pressure lifecycle suspended, by node",
            self.suspensions.clone(),
        );
        registry.register(
            "imp_pressure_suspend_stalls",
            "Memory-pressure suspends not reported Suspended within the timeout",
            self.stalls.clone(),
        );
        registry.register(
            "imp_pressure_lifts",
            "Memory-pressure suspends lifted by a new desiredState",
            self.lifts.clone(),
        );
        registry.register(
            "imp_pressure_nodes",
            "Watched nodes whose MemoryPressure condition is True",
            self.nodes.clone(),
        );
        registry.register(
            "imp_pressure_nodes_exhausted",
            "Nodes under MemoryPressure with nothing left the lifecycle may suspend",
            self.nodes_exhausted.clone(),
        );
        registry.register(
            "imp_pressure_suspended_vms",
            "ImpVMs the memory-pressure lifecycle holds at desiredState Suspended",
            self.held.clone(),
        );
    }
}

/// Counts a failed reconcile pass of `controller` under the error's [`crate::error::Error::metric_label`].
pub fn count_reconcile_error(
    errors: &Family<ErrorLabels, Counter>,
    controller: &str,
    error: &crate::error::Error,
) {
    errors
        .get_or_create(&ErrorLabels {
            controller: controller.to_owned(),
            error: error.metric_label().to_owned(),
        })
        .inc();
}

/// Renders a registry in the Prometheus text format.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_exported_under_its_documented_name() {
        let metrics = VmMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        metrics.scheduling_latency.observe(0.3);
        metrics
            .scheduling_attempts
            .get_or_create(&ResultLabels {
                result: "scheduled".into(),
            })
            .inc();
        metrics
            .agent_heartbeat
            .get_or_create(&NodeLabels { node: "n1".into() })
            .set(1.5e9);
        metrics.reconcile_failed(
            "impvm",
            &crate::error::Error::MissingObjectKey(".metadata.name"),
        );
        // Families without a series are not encoded: give every family one so none escapes the check.
        let reason = ReasonLabels { reason: "r".into() };
        metrics.node_lost.get_or_create(&reason).inc();
        metrics.budget_resets.get_or_create(&reason).inc();
        metrics
            .network_allocation_failures
            .get_or_create(&reason)
            .inc();
        metrics
            .network_addresses
            .get_or_create(&NetworkAddressLabels {
                network: "ns/net".into(),
                state: "free".into(),
            })
            .set(3);
        metrics
            .restarts
            .get_or_create(&ModeLabels {
                mode: "in-place".into(),
            })
            .inc();
        metrics
            .vms_by_phase
            .get_or_create(&PhaseLabels {
                phase: "Running".into(),
            })
            .set(1);
        metrics
            .node_backlog
            .get_or_create(&NodeLabels { node: "n1".into() })
            .set(1);
        let controller = ControllerLabels {
            controller: "impvm".into(),
        };
        metrics
            .reconcile_duration
            .get_or_create(&controller)
            .observe(0.01);
        let text = encode(&registry).unwrap();
        let families = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
        assert_eq!(
            families, 16,
            "a family was added: give it a series above\n{text}"
        );
        for name in [
            "imp_vm_scheduling_latency_seconds_count 1",
            "imp_vm_scheduling_attempts_total{result=\"scheduled\"} 1",
            "imp_node_agent_heartbeat_timestamp_seconds{node=\"n1\"} 1500000000",
            "imp_operator_reconcile_errors_total{controller=\"impvm\",error=\"missing_object_key\"} 1",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
        imp_testkit::metrics::assert_every_family_documented(&text);
    }

    #[test]
    fn pressure_metrics_are_documented_and_share_the_reconcile_errors() {
        let vm = VmMetrics::default();
        let metrics = PressureMetrics::sharing_reconcile(&vm);
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        metrics
            .suspensions
            .get_or_create(&NodeLabels { node: "n1".into() })
            .inc();
        metrics.stalls.inc();
        metrics.lifts.inc();
        metrics.nodes.set(2);
        metrics.nodes_exhausted.set(1);
        metrics.held.set(3);
        count_reconcile_error(
            &metrics.errors,
            "pressure",
            &crate::error::Error::Conflict("x".into()),
        );
        let text = encode(&registry).unwrap();
        assert_eq!(text.lines().filter(|l| l.starts_with("# TYPE ")).count(), 6);
        for line in [
            "imp_pressure_suspensions_total{node=\"n1\"} 1",
            "imp_pressure_suspend_stalls_total 1",
            "imp_pressure_suspended_vms 3",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
        let mut vm_registry = Registry::default();
        vm.register(&mut vm_registry);
        assert!(encode(&vm_registry).unwrap().contains(
            "imp_operator_reconcile_errors_total{controller=\"pressure\",error=\"conflict\"} 1"
        ));
        imp_testkit::metrics::assert_every_family_documented(&text);
    }
}
