//! Pool scale-up benchmark: one pool goes from 0 to N runner VMs (default 500) over 10 fake nodes on the
//! real API server (testenv), with the GitHub simulator. The operator (ImpVM controller, pool controller
//! and webhook receiver) runs in a child process so its peak RSS is its own; this process plays the node
//! agents (heartbeat Leases; every bound, minted VM is marked Running with handoff Started). The setup is
//! shared with the pickup bench (benches/common).
//!
//! `cargo bench -p imp-operator --bench pool_bench [--profile dev] -- [N]`
//! Prints the wall time until all N runners are idle (registered and waiting) and the operator's VmHWM.

mod common;

use std::{
    collections::BTreeMap,
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use common::{AgentOptions, Bench, NODES, start_agent};
use imp_api::ImpVMRunnerPool;
use kube::{Api, api::PostParams};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if common::is_operator_child() {
        return rt.block_on(common::operator_child());
    }
    let n: u32 = args
        .iter()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(500);
    rt.block_on(bench(n))
}

async fn bench(n: u32) -> anyhow::Result<()> {
    let mut b = Bench::start("bench").await?;
    let rss_idle = b.operator_hwm_kib();
    // The agents: every bound, minted VM gets Running + handoff Started.
    let agent = start_agent(&b, AgentOptions::default());

    let pools: Api<ImpVMRunnerPool> = Api::namespaced(b.client.clone(), &b.ns);
    let pool = b
        .pool("bench", &["self-hosted", "imp"])
        .min_idle(n)
        .max_runners(n)
        .scale_up_step(100)
        .build();
    let t0 = Instant::now();
    pools.create(&PostParams::default(), &pool).await?;
    let mut peak = 0u64;
    let mut all_minted = None;
    let deadline = Duration::from_secs(900);
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        peak = peak.max(b.operator_hwm_kib());
        b.check_operator()?;
        let s = pools.get_status("bench").await?.status.unwrap_or_default();
        if all_minted.is_none() && b.sim.runners().len() as u32 >= n {
            all_minted = Some(t0.elapsed());
        }
        if s.idle >= n {
            break;
        }
        anyhow::ensure!(
            t0.elapsed() < deadline,
            "not done after {deadline:?}: {s:?}"
        );
    }
    let took = t0.elapsed();
    let vm_list = b.vms().list(&Default::default()).await?.items;
    let per_node = {
        let mut m: BTreeMap<String, u32> = BTreeMap::new();
        for v in &vm_list {
            *m.entry(v.spec.node_name.clone().unwrap_or_default())
                .or_default() += 1;
        }
        m.values().cloned().collect::<Vec<_>>()
    };
    peak = peak.max(b.operator_hwm_kib());
    println!("pool 0 -> {n} runner VMs over {NODES} nodes on the real API server");
    println!(
        "  all {n} JIT configs minted after {:.1?}",
        all_minted.unwrap_or(took)
    );
    println!("  all {n} runners idle (status.idle == {n}) after {took:.1?}");
    println!(
        "  VMs: {} (per node: {per_node:?}), agent Started writes: {}",
        vm_list.len(),
        agent.started.load(Ordering::SeqCst)
    );
    let calls = b.sim.stats().api_requests;
    println!(
        "  GitHub API calls: {calls} ({:.2} per runner)",
        calls as f64 / f64::from(n.max(1))
    );
    println!(
        "  operator peak RSS (VmHWM): {:.1} MiB (at start: {:.1} MiB)",
        peak as f64 / 1024.0,
        rss_idle as f64 / 1024.0
    );
    Ok(())
}
