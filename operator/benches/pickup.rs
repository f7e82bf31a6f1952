//! Pickup latency benchmark: from the GitHub simulator's signed `workflow_job queued` webhook to the job
//! picked up by a runner of the pool (the simulator's job record: in_progress, with the runner's name),
//! for a warm pool (minIdle 20, 200 jobs) and from zero (minIdle 0), p50/p99, with each job's wait split
//! into the phases of `imp_runner_job_phase_seconds` (operator/src/runnerpool/slo.rs).
//!
//! Same setup as pool_bench (benches/common): real API server (testenv), 10 fake nodes, the operator
//! (ImpVM controller, pool controller, webhook receiver; production timings) in a child process, and this
//! process as the node agents: each bound, minted VM gets its JIT config read, a simulated boot
//! (IMP_BENCH_BOOT_MS, default 500), handoff Started, then the simulator's fake runner (which polls for
//! a job every 50 ms) takes one job and the VM is marked Succeeded; deleted VMs get their teardown
//! confirmed. No VMM runs: the boot is a sleep, so the fixed costs (boot, the runner's poll) are
//! known and the rest of the wait is Imp's (webhook, pool decision, VM create, JIT mint, scheduling, the
//! agent's status writes) and the API server's.
//!
//! Step times are the node side's own observations (watch events, sub-millisecond): the API's
//! creationTimestamp and the agent-written status Times are to the second. The operator's own record
//! (`status.job`) is read too and its queued -> picked up compared.
//!
//! The `standby` scenario is `from-zero` (minIdle 0) with `scaling.standby: true`: every node reports
//! the pool's snapshot template Ready (as agents do once it is built; the annotation the scheduler
//! prefers), and the node side starts the pool's `startFrom: Template` VMs as clones: instead of the
//! boot it simulates the restore (IMP_BENCH_RESTORE_MS, default 30: Firecracker's published
//! snapshot restore-to-usable, docs/SNAPSHOTS.md of firecracker-microvm/firecracker) and the guest's
//! `Reidentify` (IMP_BENCH_REIDENTIFY_MS, default 5: one vsock round trip and a few guest syscalls;
//! an estimate, not a measurement), and reports both in `status.start` as the agent does. Its
//! phases split `boot` into the node's own work, `restore` and `reidentify`.
//!
//! The `warm-scaleset` scenario is `warm` with the pool's demand taken from a runner scale set
//! (`spec.github.scaleSet`; the simulator's broker, long poll, acquire, `generatejitconfig`) and every
//! webhook dropped: the same jobs, routed by `runs-on: <scale set>`. Each scenario counts the GitHub
//! calls it made: REST (the simulator's api requests) and the scale-set broker's (polls, acks,
//! acquires, JIT configs, sessions). Last, one idle pool of each intake is left alone for
//! IMP_BENCH_IDLE_SECS (120) and its calls are projected to an hour.
//!
//! `cargo bench -p imp-operator --bench pickup`; IMP_BENCH_JOBS (200), IMP_BENCH_IDLE (20),
//! IMP_BENCH_COLD_JOBS (50, also the standby scenario's), IMP_BENCH_INTERVAL_MS (250, between queued
//! jobs), IMP_BENCH_BOOT_MS (500), IMP_BENCH_RESTORE_MS (30), IMP_BENCH_REIDENTIFY_MS (5),
//! IMP_BENCH_JOB_MS (2000, how long each job runs), IMP_BENCH_IDLE_SECS (120).

mod common;

use std::time::{Duration, Instant};

use common::{Agent, AgentOptions, Bench, start_agent, templates_ready};
use imp_api::{ImpVMRunnerPool, ScaleSetSpec, names::LABEL_RUNNER_POOL};
use imp_operator::runnerpool::slo::{CloneTimes, JOB_PHASES, clone_phases, job_phases};
use imp_testkit::github::{JobSpec, WebhookFault};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::{
    Api,
    api::{ListParams, PostParams},
};

const LABELS: [&str; 2] = ["self-hosted", "imp"];
/// The scale set of the scale-set scenarios (what their jobs' `runs-on` names).
const SET: &str = "imp-bench-set";

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if common::is_operator_child() {
        return rt.block_on(common::operator_child());
    }
    rt.block_on(bench())
}

struct Scenario {
    name: &'static str,
    min_idle: u32,
    max_runners: u32,
    jobs: usize,
    interval: Duration,
    /// Take demand from this runner scale set, webhooks dropped.
    scale_set: Option<&'static str>,
    /// `scaling.standby`: the pool's VMs start as clones of the nodes' templates.
    standby: bool,
}

/// GitHub calls, REST and the scale-set broker's.
#[derive(Clone, Copy, Default)]
struct Calls {
    rest: u64,
    broker: u64,
}

fn calls(b: &Bench) -> Calls {
    let ss = b.sim.scale_set_stats();
    Calls {
        rest: b.sim.stats().api_requests,
        broker: ss.polls
            + ss.messages_deleted
            + ss.acquire_calls
            + ss.jit_configs
            + ss.sessions_created
            + ss.sessions_refreshed
            + ss.admin_connections,
    }
}

fn since(a: Calls, b: Calls) -> Calls {
    Calls {
        rest: b.rest - a.rest,
        broker: b.broker - a.broker,
    }
}

/// One served job.
struct Served {
    /// Queued -> picked up (the simulator's job record).
    wait: Duration,
    /// The wait by phase (`vm_create` .. `pickup`), from the node side's observations.
    phases: Vec<(&'static str, Duration)>,
    /// Queued -> picked up as the operator recorded it on the VM (`status.job`), if it did.
    recorded: Option<Duration>,
    /// Its VM was started as a clone.
    clone: bool,
}

struct Outcome {
    served: Vec<Served>,
    /// Jobs whose VM the agent never saw (their wait counts, their phases do not).
    unattributed: usize,
    took: Duration,
    /// GitHub calls from the pool's creation to its last job picked up.
    calls: Calls,
}

fn micros(t: chrono::DateTime<chrono::Utc>) -> Option<Timestamp> {
    Timestamp::from_microsecond(t.timestamp_micros()).ok()
}

fn span(a: Timestamp, b: Timestamp) -> Duration {
    Duration::try_from(b.duration_since(a)).unwrap_or_default()
}

async fn run(b: &mut Bench, agent: &Agent, s: &Scenario) -> anyhow::Result<Outcome> {
    let pools: Api<ImpVMRunnerPool> = Api::namespaced(b.client.clone(), &b.ns);
    let mut pool = b
        .pool(s.name, &LABELS)
        .min_idle(s.min_idle)
        .max_runners(s.max_runners)
        .scale_up_step(100)
        .standby(s.standby)
        .build();
    if let Some(set) = s.scale_set {
        pool.spec.github.scale_set = Some(ScaleSetSpec {
            name: set.to_string(),
            runner_group: None,
        });
        // Every delivery of this scenario is lost: the scale set is the only intake.
        b.sim
            .inject_webhook_fault(WebhookFault::Drop, 10 * s.jobs as u32 + 1000);
    }
    let before = calls(b);
    let created = pools.create(&PostParams::default(), &pool).await?;
    if s.standby {
        templates_ready(b, agent, &created.uid().unwrap_or_default()).await?;
    }
    let t0 = Instant::now();
    loop {
        let st = pools.get_status(s.name).await?.status.unwrap_or_default();
        if st.observed_generation == Some(1) && st.idle >= s.min_idle {
            break;
        }
        b.check_operator()?;
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(300),
            "{}: pool not ready: {st:?}",
            s.name
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if s.min_idle > 0 {
        println!(
            "  {}: {} idle runners after {:.1?}",
            s.name,
            s.min_idle,
            t0.elapsed()
        );
    }

    let t1 = Instant::now();
    let mut ids = Vec::new();
    let mut tick = tokio::time::interval(s.interval);
    for _ in 0..s.jobs {
        tick.tick().await;
        ids.push(
            b.sim
                .queue_job(JobSpec {
                    labels: match s.scale_set {
                        Some(set) => vec![set.to_string()],
                        None => LABELS.iter().map(|l| l.to_string()).collect(),
                    },
                    ..Default::default()
                })
                .id,
        );
    }
    loop {
        let waiting = ids
            .iter()
            .filter(|id| b.sim.job(**id).is_none_or(|j| j.started_at.is_none()))
            .count();
        if waiting == 0 {
            break;
        }
        b.check_operator()?;
        anyhow::ensure!(
            t1.elapsed() < Duration::from_secs(900),
            "{}: {waiting} of {} jobs not picked up",
            s.name,
            ids.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = t1.elapsed();
    let used = since(before, calls(b));
    // The in_progress webhooks of the last jobs, and their status.job writes.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let mut served = Vec::new();
    let mut unattributed = 0;
    for id in &ids {
        let job = b.sim.job(*id).expect("queued job");
        let (Some(q), Some(p)) = (micros(job.created_at), job.started_at.and_then(micros)) else {
            anyhow::bail!("job {id} without times: {job:?}");
        };
        let wait = span(q, p);
        let vm = job.runner_name.as_deref().and_then(|r| agent.by_runner(r));
        let Some(vm) = vm else {
            unattributed += 1;
            served.push(Served {
                wait,
                phases: Vec::new(),
                recorded: None,
                clone: false,
            });
            continue;
        };
        let steps = [
            Some(q),
            vm.created,
            vm.minted,
            vm.scheduled,
            vm.booted,
            vm.started,
            Some(p),
        ];
        let recorded = vm
            .job
            .as_ref()
            .filter(|r| r.job_id == Some(*id as i64))
            .and_then(|r| {
                Some(span(
                    r.queued_time.as_ref()?.0,
                    r.picked_up_time.as_ref()?.0,
                ))
            });
        let clone = vm.clone.map(|(restore, reidentify)| CloneTimes {
            restore,
            reidentify,
        });
        served.push(Served {
            wait,
            phases: clone_phases(job_phases(&steps), clone),
            recorded,
            clone: clone.is_some(),
        });
    }

    // Back to zero for the next scenario: the pool's deletion removes its VMs and registrations.
    pools.delete(s.name, &Default::default()).await?;
    let vms = b.vms();
    let t2 = Instant::now();
    loop {
        let left = vms
            .list(&ListParams::default().labels(&format!("{LABEL_RUNNER_POOL}={}", s.name)))
            .await?
            .items
            .len();
        let pool_gone = pools.get_opt(s.name).await?.is_none();
        if left == 0 && pool_gone {
            break;
        }
        anyhow::ensure!(
            t2.elapsed() < Duration::from_secs(300),
            "{}: {left} VMs left after the pool's deletion",
            s.name
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(Outcome {
        served,
        unattributed,
        took,
        calls: used,
    })
}

/// GitHub calls per hour of an idle pool of each intake: created, settled, then left alone for
/// `window` (the sweep, the reaper, the scale set's long polls run as in production).
async fn idle_cost(
    b: &mut Bench,
    scale_set: Option<&'static str>,
    window: Duration,
) -> anyhow::Result<Calls> {
    let pools: Api<ImpVMRunnerPool> = Api::namespaced(b.client.clone(), &b.ns);
    let name = if scale_set.is_some() {
        "idle-scaleset"
    } else {
        "idle-webhook"
    };
    let mut pool = b.pool(name, &LABELS).min_idle(0).max_runners(5).build();
    if let Some(set) = scale_set {
        pool.spec.github.scale_set = Some(ScaleSetSpec {
            name: set.to_string(),
            runner_group: None,
        });
    }
    pools.create(&PostParams::default(), &pool).await?;
    // Settled: the first pass, the first sweep, the session (first fetches are one-time costs).
    tokio::time::sleep(Duration::from_secs(20)).await;
    b.check_operator()?;
    let before = calls(b);
    tokio::time::sleep(window).await;
    let used = since(before, calls(b));
    pools.delete(name, &Default::default()).await?;
    while pools.get_opt(name).await?.is_some() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let per_hour = |n: u64| (n as f64 * 3600.0 / window.as_secs_f64()).round() as u64;
    Ok(Calls {
        rest: per_hour(used.rest),
        broker: per_hour(used.broker),
    })
}

/// Nearest-rank percentile of a sorted slice.
fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn mean(v: &[Duration]) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.iter().sum::<Duration>() / v.len() as u32
}

/// Who pays for a phase in this bench.
fn owner(phase: &str) -> &'static str {
    match phase {
        "vm_create" => "Imp: webhook -> pool decision -> ImpVM created",
        "mint" => "Imp + GitHub sim: JIT config minted, Secret, VM spec",
        "schedule" => "Imp: ImpVM controller binds a node",
        "boot" => "fixed: simulated boot (+ agent watch and Secret read; a clone: those alone)",
        "restore" => "fixed: simulated clone restore",
        "reidentify" => "fixed: simulated clone reidentify",
        "runner_start" => "node agent: Started status write",
        "pickup" => "fixed: fake runner connect + 50 ms acquire poll",
        _ => "",
    }
}

fn report(s: &Scenario, o: &Outcome, boot: Duration) {
    let standby = if s.standby { ", standby" } else { "" };
    let mut waits: Vec<Duration> = o.served.iter().map(|j| j.wait).collect();
    waits.sort();
    println!();
    println!(
        "{}: minIdle {}{standby}, maxRunners {}, {} jobs one per {:?}, all picked up {:.1?} after the first was queued",
        s.name,
        s.min_idle,
        s.max_runners,
        o.served.len(),
        s.interval,
        o.took
    );
    let n = o.served.len().max(1) as f64;
    println!(
        "  GitHub calls: REST {} ({:.1} per job), scale-set broker {} ({:.1} per job)",
        o.calls.rest,
        o.calls.rest as f64 / n,
        o.calls.broker,
        o.calls.broker as f64 / n
    );
    println!(
        "  queued -> picked up: p50 {:.0} ms, p99 {:.0} ms, mean {:.0} ms, max {:.0} ms",
        ms(pct(&waits, 0.5)),
        ms(pct(&waits, 0.99)),
        ms(mean(&waits)),
        ms(*waits.last().unwrap_or(&Duration::ZERO))
    );
    let mut rec: Vec<Duration> = o.served.iter().filter_map(|j| j.recorded).collect();
    rec.sort();
    println!(
        "  status.job recorded for {} of {} jobs; its queued -> pickedUp p50 {:.0} ms, p99 {:.0} ms",
        rec.len(),
        o.served.len(),
        ms(pct(&rec, 0.5)),
        ms(pct(&rec, 0.99))
    );
    let clones = o.served.iter().filter(|j| j.clone).count();
    if clones > 0 {
        println!(
            "  {clones} of {} jobs' runner VMs started as clones of a snapshot template",
            o.served.len()
        );
    }
    if o.unattributed > 0 {
        println!(
            "  {} jobs' runner VM not seen by the agent (no phases)",
            o.unattributed
        );
    }
    let total_mean = mean(&waits).as_secs_f64().max(1e-9);
    println!("  | phase | p50 ms | p99 ms | mean ms | share of mean wait | paid by |");
    println!("  |---|---:|---:|---:|---:|---|");
    let mut imp = Duration::ZERO;
    let mut fixed = Duration::ZERO;
    let n = o
        .served
        .iter()
        .filter(|j| !j.phases.is_empty())
        .count()
        .max(1) as u32;
    let clone_phases = ["restore", "reidentify"];
    for phase in JOB_PHASES.iter().filter(|p| **p != "run") {
        if clones == 0 && clone_phases.contains(phase) {
            continue;
        }
        let mut d: Vec<Duration> = o
            .served
            .iter()
            .filter(|j| !j.phases.is_empty())
            .map(|j| {
                j.phases
                    .iter()
                    .filter(|(p, _)| p == phase)
                    .map(|(_, d)| *d)
                    .sum()
            })
            .collect();
        d.sort();
        let m = mean(&d);
        match *phase {
            "boot" => {
                // The sleep is fixed; what the agent did around it is counted with the node side.
                let sleep: Duration = o
                    .served
                    .iter()
                    .filter(|j| !j.phases.is_empty() && !j.clone)
                    .map(|j| {
                        j.phases
                            .iter()
                            .filter(|(p, _)| *p == "boot")
                            .map(|(_, d)| (*d).min(boot))
                            .sum::<Duration>()
                    })
                    .sum::<Duration>()
                    / n;
                fixed += sleep;
                imp += m.saturating_sub(sleep);
            }
            "pickup" | "restore" | "reidentify" => fixed += m,
            _ => imp += m,
        }
        println!(
            "  | {phase} | {:.0} | {:.0} | {:.0} | {:.0}% | {} |",
            ms(pct(&d, 0.5)),
            ms(pct(&d, 0.99)),
            ms(m),
            100.0 * m.as_secs_f64() / total_mean,
            owner(phase)
        );
    }
    println!(
        "  mean wait {:.0} ms = Imp + API server + agent {:.0} ms, fixed (simulated boot or clone, runner poll) {:.0} ms",
        ms(mean(&waits)),
        ms(imp),
        ms(fixed)
    );
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

async fn bench() -> anyhow::Result<()> {
    let jobs = env_u64("IMP_BENCH_JOBS", 200) as usize;
    let idle = env_u64("IMP_BENCH_IDLE", 20) as u32;
    let cold_jobs = env_u64("IMP_BENCH_COLD_JOBS", 50) as usize;
    let interval = Duration::from_millis(env_u64("IMP_BENCH_INTERVAL_MS", 250));
    let boot = Duration::from_millis(env_u64("IMP_BENCH_BOOT_MS", 500));
    let restore = Duration::from_millis(env_u64("IMP_BENCH_RESTORE_MS", 30));
    let reidentify = Duration::from_millis(env_u64("IMP_BENCH_REIDENTIFY_MS", 5));
    let job = Duration::from_millis(env_u64("IMP_BENCH_JOB_MS", 2000));
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "pickup bench: {cpus} CPUs, load average {} at start; simulated boot {boot:?}, clone restore {restore:?} + reidentify {reidentify:?}, jobs run {job:?}",
        loadavg()
    );
    let mut b = Bench::start("pickup").await?;
    let agent = start_agent(
        &b,
        AgentOptions {
            run_jobs: true,
            boot,
            restore,
            reidentify,
            job,
        },
    );
    let scenarios = [
        Scenario {
            name: "from-zero",
            min_idle: 0,
            max_runners: 20,
            jobs: cold_jobs,
            interval,
            scale_set: None,
            standby: false,
        },
        Scenario {
            name: "warm",
            min_idle: idle,
            max_runners: idle * 2,
            jobs,
            interval,
            scale_set: None,
            standby: false,
        },
        Scenario {
            name: "standby",
            min_idle: 0,
            max_runners: 20,
            jobs: cold_jobs,
            interval,
            scale_set: None,
            standby: true,
        },
        // Last: its dropped deliveries must not reach another scenario.
        Scenario {
            name: "warm-scaleset",
            min_idle: idle,
            max_runners: idle * 2,
            jobs,
            interval,
            scale_set: Some(SET),
            standby: false,
        },
    ];
    let mut outcomes = Vec::new();
    for s in &scenarios {
        outcomes.push(run(&mut b, &agent, s).await?);
    }
    for (s, o) in scenarios.iter().zip(&outcomes) {
        report(s, o, boot);
    }
    let window = Duration::from_secs(env_u64("IMP_BENCH_IDLE_SECS", 120));
    let webhook = idle_cost(&mut b, None, window).await?;
    let set = idle_cost(&mut b, Some("imp-bench-idle"), window).await?;
    println!(
        "\nidle pool, GitHub calls per hour (measured over {window:?}): webhook intake REST {} + broker {}; scale-set intake REST {} + broker {}",
        webhook.rest, webhook.broker, set.rest, set.broker
    );
    println!(
        "\noperator peak RSS (VmHWM) {:.1} MiB; GitHub API calls {}; load average {} at the end",
        b.operator_hwm_kib() as f64 / 1024.0,
        b.sim.stats().api_requests,
        loadavg()
    );
    Ok(())
}
