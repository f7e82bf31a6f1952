//! The chaos harness's invariant checker: what must hold after every scenario, once the pool is
//! gone and the system has settled (issue 18).
//!
//! One shape: [`observe`] gathers what exists (Kubernetes objects, the GitHub simulator's
//! registry and jobs, the node's processes, links, nft tables and VM files, the run's logs)
//! into an [`Observed`]; the pure [`check`] turns it into [`Violation`]s. The `imp-chaos-check`
//! binary runs both for the smoke's scenarios.

pub mod observe;

use std::fmt;
use std::path::PathBuf;

/// A process on the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Process {
    pub pid: u32,
    pub cmdline: String,
}

/// A job as the GitHub simulator recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub id: u64,
    /// `queued`, `in_progress` or `completed`.
    pub status: String,
    pub runner_id: Option<u64>,
}

/// An ImpVM as the settled-state invariants need it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Vm {
    pub name: String,
    /// `metadata.uid`: the runtime names the VM's directory (`<state>/vms/<uid>`) by it.
    pub uid: String,
    /// `spec.runnerConfigSecret`.
    pub secret: Option<String>,
    /// The GitHub runner name recorded for it (annotation or status).
    pub runner_name: Option<String>,
    /// `status.runner.handoff`.
    pub handoff: Option<String>,
    /// `spec.nodeName` is set.
    pub bound: bool,
    /// Being deleted: its registration, address, TAP and directory are still its own until the
    /// finalizer goes, so a teardown in flight is no orphan.
    pub deleting: bool,
}

/// Everything the invariants speak about, after a scenario settled.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// ImpVMs left in the namespace.
    pub impvms: Vec<String>,
    /// The same ImpVMs (also those being deleted), with what the settled-state invariants compare.
    pub vms: Vec<Vm>,
    /// JIT config Secrets (label `imp.dev/secret-kind=jitconfig`) left in the namespace.
    pub jit_secrets: Vec<String>,
    /// Runners still registered at GitHub.
    pub registrations: Vec<String>,
    /// `network/address -> vm` entries left in ImpNetwork status.
    pub allocations: Vec<String>,
    /// Processes whose command line names the runtime's state directory (VMMs, guest agents,
    /// vsock devices).
    pub vmm_processes: Vec<Process>,
    /// `imp*` links (bridges, TAPs).
    pub links: Vec<String>,
    /// nft tables named `imp`.
    pub nft_tables: Vec<String>,
    /// VM directories, writable disks and temp work dirs left under the state directory.
    pub vm_files: Vec<PathBuf>,
    /// The jobs the scenario queued.
    pub jobs: Vec<Job>,
    /// Log files that contain a JIT config the scenario minted.
    pub logs_with_jit: Vec<PathBuf>,
}

/// A broken invariant, precise enough to act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    LeakedImpVm(String),
    LeakedSecret(String),
    LeakedRegistration(String),
    LeakedAllocation(String),
    LeakedProcess(Process),
    LeakedLink(String),
    LeakedNftTable(String),
    LeakedVmFile(PathBuf),
    /// A queued job that no runner completed.
    JobNotServed {
        id: u64,
        status: String,
    },
    /// A completed job without a runner (the simulator lost track of who ran it).
    JobWithoutRunner(u64),
    /// One ephemeral runner ran more than one job.
    RunnerServedTwoJobs {
        runner_id: u64,
        jobs: Vec<u64>,
    },
    JitConfigInLog(PathBuf),
    /// Settled, pool present: a registration no live VM owns.
    OrphanRegistration(String),
    /// Settled: a JIT Secret that is no unstarted VM's.
    OrphanSecret(String),
    /// Settled: an IP allocation of no live VM.
    OrphanAllocation(String),
    /// Settled: a VM directory (`<state>/vms/<uid>`) of no live VM.
    OrphanVmDir(PathBuf),
    /// Settled: a VMM or guest process naming the directory of no live VM.
    OrphanProcess(Process),
    /// Settled: more TAPs than bound VMs.
    ExtraTaps {
        taps: Vec<String>,
        bound_vms: usize,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::LeakedImpVm(n) => write!(f, "ImpVM {n} left"),
            Violation::LeakedSecret(n) => write!(f, "JIT Secret {n} left"),
            Violation::LeakedRegistration(n) => write!(f, "runner {n} still registered at GitHub"),
            Violation::LeakedAllocation(a) => write!(f, "IP allocation {a} left"),
            Violation::LeakedProcess(p) => write!(f, "VMM process {} left: {}", p.pid, p.cmdline),
            Violation::LeakedLink(l) => write!(f, "link {l} left"),
            Violation::LeakedNftTable(t) => write!(f, "nft table {t} left"),
            Violation::LeakedVmFile(p) => write!(f, "VM file {} left", p.display()),
            Violation::JobNotServed { id, status } => {
                write!(f, "job {id} not served (status {status})")
            }
            Violation::JobWithoutRunner(id) => write!(f, "job {id} completed without a runner"),
            Violation::RunnerServedTwoJobs { runner_id, jobs } => {
                write!(f, "runner {runner_id} ran {} jobs: {jobs:?}", jobs.len())
            }
            Violation::JitConfigInLog(p) => write!(f, "a JIT config appears in {}", p.display()),
            Violation::OrphanRegistration(n) => {
                write!(f, "runner {n} registered at GitHub for no live VM")
            }
            Violation::OrphanSecret(n) => {
                write!(f, "JIT Secret {n} belongs to no VM awaiting its handoff")
            }
            Violation::OrphanAllocation(a) => write!(f, "IP allocation {a} of no live VM"),
            Violation::OrphanVmDir(p) => write!(f, "VM directory {} of no live VM", p.display()),
            Violation::OrphanProcess(p) => {
                write!(f, "process {} of no live VM: {}", p.pid, p.cmdline)
            }
            Violation::ExtraTaps { taps, bound_vms } => {
                write!(
                    f,
                    "{} TAPs for {bound_vms} bound VM(s): {taps:?}",
                    taps.len()
                )
            }
        }
    }
}

/// The invariants of a settled, torn-down scenario: nothing of it is left anywhere, every job it
/// queued was served, each by its own runner, and no JIT config reached a log.
pub fn check(o: &Observed) -> Vec<Violation> {
    let mut v = Vec::new();
    v.extend(o.impvms.iter().cloned().map(Violation::LeakedImpVm));
    leaks_and_jobs(o, &mut v);
    v
}

/// The invariants of a settled scenario whose pool still runs: whatever exists belongs to a live
/// VM (registrations, JIT Secrets only of VMs before their handoff, IP allocations, at most one
/// TAP per bound VM, VM directories and VMM processes only of live VMs), every job queued so far
/// was served by a runner of its own, no JIT config reached a log.
pub fn check_settled(o: &Observed) -> Vec<Violation> {
    let mut v = Vec::new();
    let runners: Vec<&str> = o
        .vms
        .iter()
        .filter_map(|m| m.runner_name.as_deref())
        .collect();
    v.extend(
        o.registrations
            .iter()
            .filter(|r| !runners.contains(&r.as_str()))
            .cloned()
            .map(Violation::OrphanRegistration),
    );
    let awaiting: Vec<&str> = o
        .vms
        .iter()
        .filter(|m| m.handoff.is_none() || m.handoff.as_deref() == Some("Sent"))
        .filter_map(|m| m.secret.as_deref())
        .collect();
    v.extend(
        o.jit_secrets
            .iter()
            .filter(|s| !awaiting.contains(&s.as_str()))
            .cloned()
            .map(Violation::OrphanSecret),
    );
    let names: Vec<&str> = o.vms.iter().map(|m| m.name.as_str()).collect();
    v.extend(
        o.allocations
            .iter()
            .filter(|a| {
                !a.rsplit(" -> ")
                    .next()
                    .is_some_and(|vm| names.contains(&vm))
            })
            .cloned()
            .map(Violation::OrphanAllocation),
    );
    let taps: Vec<String> = o
        .links
        .iter()
        .filter(|l| !l.starts_with("impbr"))
        .cloned()
        .collect();
    let bound_vms = o.vms.iter().filter(|m| m.bound).count();
    if taps.len() > bound_vms {
        v.push(Violation::ExtraTaps { taps, bound_vms });
    }
    let live = |uid: &str| o.vms.iter().any(|m| m.bound && m.uid == uid);
    v.extend(
        o.vm_files
            .iter()
            .filter(|p| {
                p.parent().and_then(|d| d.file_name()) == Some("vms".as_ref())
                    && !p.file_name().and_then(|n| n.to_str()).is_some_and(live)
            })
            .cloned()
            .map(Violation::OrphanVmDir),
    );
    v.extend(
        o.vmm_processes
            .iter()
            .filter(|p| vm_uid_in(&p.cmdline).is_some_and(|uid| !live(uid)))
            .cloned()
            .map(Violation::OrphanProcess),
    );
    jobs_and_logs(o, &mut v);
    v
}

/// The VM uid a command line names through a path `.../vms/<uid>/...`, if any.
pub fn vm_uid_in(cmdline: &str) -> Option<&str> {
    let (_, rest) = cmdline.split_once("/vms/")?;
    let uid = rest
        .split(|c: char| c == '/' || c.is_whitespace())
        .next()
        .filter(|u| !u.is_empty())?;
    Some(uid)
}

fn leaks_and_jobs(o: &Observed, v: &mut Vec<Violation>) {
    v.extend(o.jit_secrets.iter().cloned().map(Violation::LeakedSecret));
    v.extend(
        o.registrations
            .iter()
            .cloned()
            .map(Violation::LeakedRegistration),
    );
    v.extend(
        o.allocations
            .iter()
            .cloned()
            .map(Violation::LeakedAllocation),
    );
    v.extend(
        o.vmm_processes
            .iter()
            .cloned()
            .map(Violation::LeakedProcess),
    );
    v.extend(o.links.iter().cloned().map(Violation::LeakedLink));
    v.extend(o.nft_tables.iter().cloned().map(Violation::LeakedNftTable));
    v.extend(o.vm_files.iter().cloned().map(Violation::LeakedVmFile));
    jobs_and_logs(o, v);
}

fn jobs_and_logs(o: &Observed, v: &mut Vec<Violation>) {
    let mut by_runner: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
    for j in &o.jobs {
        if j.status != "completed" {
            v.push(Violation::JobNotServed {
                id: j.id,
                status: j.status.clone(),
            });
        }
        match j.runner_id {
            Some(r) => by_runner.entry(r).or_default().push(j.id),
            None if j.status == "completed" => v.push(Violation::JobWithoutRunner(j.id)),
            None => {}
        }
    }
    for (runner_id, jobs) in by_runner {
        if jobs.len() > 1 {
            v.push(Violation::RunnerServedTwoJobs { runner_id, jobs });
        }
    }
    v.extend(
        o.logs_with_jit
            .iter()
            .cloned()
            .map(Violation::JitConfigInLog),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: u64, status: &str, runner: Option<u64>) -> Job {
        Job {
            id,
            status: status.into(),
            runner_id: runner,
        }
    }

    #[test]
    fn a_clean_run_holds_every_invariant() {
        let o = Observed {
            jobs: vec![job(1, "completed", Some(10)), job(2, "completed", Some(11))],
            ..Default::default()
        };
        assert_eq!(check(&o), vec![]);
    }

    #[test]
    fn every_leak_is_named() {
        let o = Observed {
            impvms: vec!["vm-a".into()],
            jit_secrets: vec!["s".into()],
            registrations: vec!["r".into()],
            allocations: vec!["net/192.0.2.2 -> vm-a".into()],
            vmm_processes: vec![Process {
                pid: 7,
                cmdline: "fc --api-sock /s/vms/u/api.sock".into(),
            }],
            links: vec!["impabc".into()],
            nft_tables: vec!["inet imp".into()],
            vm_files: vec!["/s/vms/u".into()],
            ..Default::default()
        };
        let v = check(&o);
        assert_eq!(v.len(), 8);
        let text: Vec<String> = v.iter().map(ToString::to_string).collect();
        assert_eq!(text[0], "ImpVM vm-a left");
        assert_eq!(
            text[4],
            "VMM process 7 left: fc --api-sock /s/vms/u/api.sock"
        );
        assert_eq!(text[7], "VM file /s/vms/u left");
    }

    #[test]
    fn an_unserved_job_breaks_the_run() {
        let o = Observed {
            jobs: vec![job(1, "queued", None), job(2, "in_progress", Some(3))],
            ..Default::default()
        };
        assert_eq!(
            check(&o),
            vec![
                Violation::JobNotServed {
                    id: 1,
                    status: "queued".into()
                },
                Violation::JobNotServed {
                    id: 2,
                    status: "in_progress".into()
                },
            ]
        );
    }

    #[test]
    fn one_runner_two_jobs_is_a_violation() {
        let o = Observed {
            jobs: vec![
                job(1, "completed", Some(5)),
                job(2, "completed", Some(5)),
                job(3, "completed", Some(6)),
            ],
            ..Default::default()
        };
        assert_eq!(
            check(&o),
            vec![Violation::RunnerServedTwoJobs {
                runner_id: 5,
                jobs: vec![1, 2]
            }]
        );
    }

    #[test]
    fn a_completed_job_without_runner_is_a_violation() {
        let o = Observed {
            jobs: vec![job(4, "completed", None)],
            ..Default::default()
        };
        assert_eq!(check(&o), vec![Violation::JobWithoutRunner(4)]);
    }

    fn vm(name: &str, runner: &str, handoff: Option<&str>) -> Vm {
        Vm {
            name: name.into(),
            uid: format!("uid-{name}"),
            secret: Some(format!("{name}-jit")),
            runner_name: Some(runner.into()),
            handoff: handoff.map(Into::into),
            bound: true,
            deleting: false,
        }
    }

    #[test]
    fn a_settled_pool_owns_everything_that_exists() {
        let o = Observed {
            impvms: vec!["a".into(), "b".into()],
            vms: vec![vm("a", "run-a", Some("Started")), vm("b", "run-b", None)],
            registrations: vec!["run-a".into(), "run-b".into()],
            jit_secrets: vec!["b-jit".into()],
            allocations: vec!["net/192.0.2.2 -> a".into(), "net/192.0.2.3 -> b".into()],
            links: vec!["impbr1".into(), "imp1".into(), "imp2".into()],
            vmm_processes: vec![
                Process {
                    pid: 1,
                    cmdline: "fc --api-sock /s/vms/uid-a/api.sock".into(),
                },
                Process {
                    pid: 2,
                    cmdline: "imp-runtime".into(),
                },
            ],
            vm_files: vec!["/s/vms/uid-b".into(), "/s/tmp/build-1".into()],
            jobs: vec![job(1, "completed", Some(9))],
            ..Default::default()
        };
        assert_eq!(check_settled(&o), vec![]);
        // Torn down, the same state is all leaks.
        assert_eq!(check(&o).len(), 2 + 2 + 1 + 2 + 2 + 3 + 2);
    }

    #[test]
    fn settled_orphans_are_named() {
        let o = Observed {
            vms: vec![vm("a", "run-a", Some("Started"))],
            registrations: vec!["run-a".into(), "run-gone".into()],
            jit_secrets: vec!["a-jit".into(), "x-jit".into()],
            allocations: vec!["net/192.0.2.9 -> gone".into()],
            links: vec!["impbr1".into(), "imp1".into(), "imp2".into()],
            ..Default::default()
        };
        assert_eq!(
            check_settled(&o),
            vec![
                Violation::OrphanRegistration("run-gone".into()),
                Violation::OrphanSecret("a-jit".into()),
                Violation::OrphanSecret("x-jit".into()),
                Violation::OrphanAllocation("net/192.0.2.9 -> gone".into()),
                Violation::ExtraTaps {
                    taps: vec!["imp1".into(), "imp2".into()],
                    bound_vms: 1
                },
            ]
        );
    }

    #[test]
    fn settled_vm_dirs_and_processes_of_gone_vms_are_named() {
        let mut unbound = vm("c", "run-c", None);
        unbound.bound = false;
        let gone = Process {
            pid: 7,
            cmdline: "imp-guest agent --listen-unix /s/vms/uid-gone/v.sock.agent".into(),
        };
        let o = Observed {
            vms: vec![vm("a", "run-a", Some("Started")), unbound],
            registrations: vec!["run-a".into(), "run-c".into()],
            jit_secrets: vec!["c-jit".into()],
            vmm_processes: vec![
                Process {
                    pid: 6,
                    cmdline: "fc --api-sock /s/vms/uid-a/api.sock".into(),
                },
                gone.clone(),
            ],
            // An unbound VM has nothing on the node: its uid's directory is a leftover too.
            vm_files: vec!["/s/vms/uid-a".into(), "/s/vms/uid-c".into()],
            ..Default::default()
        };
        assert_eq!(
            check_settled(&o),
            vec![
                Violation::OrphanVmDir("/s/vms/uid-c".into()),
                Violation::OrphanProcess(gone),
            ]
        );
        assert_eq!(
            check_settled(&o)[1].to_string(),
            "process 7 of no live VM: imp-guest agent --listen-unix /s/vms/uid-gone/v.sock.agent"
        );
    }

    #[test]
    fn a_teardown_in_flight_owns_what_it_still_holds() {
        let mut going = vm("b", "run-b", Some("Exited"));
        going.deleting = true;
        let o = Observed {
            vms: vec![vm("a", "run-a", Some("Started")), going],
            registrations: vec!["run-a".into(), "run-b".into()],
            allocations: vec!["net/192.0.2.2 -> a".into(), "net/192.0.2.3 -> b".into()],
            links: vec!["imp1".into(), "imp2".into()],
            vm_files: vec!["/s/vms/uid-a".into(), "/s/vms/uid-b".into()],
            ..Default::default()
        };
        assert_eq!(check_settled(&o), vec![]);
        // Once it is gone, all of it is orphaned.
        let o = Observed {
            vms: vec![o.vms[0].clone()],
            ..o
        };
        assert_eq!(check_settled(&o).len(), 4, "{:?}", check_settled(&o));
    }

    #[test]
    fn the_vm_uid_is_read_from_a_path_in_the_command_line() {
        assert_eq!(vm_uid_in("fc --api-sock /s/vms/u-1/api.sock"), Some("u-1"));
        assert_eq!(vm_uid_in("x /s/vms/u-2 --y"), Some("u-2"));
        assert_eq!(vm_uid_in("x /s/vms/u-3"), Some("u-3"));
        assert_eq!(vm_uid_in("x /s/vms/ y"), None);
        assert_eq!(vm_uid_in("imp-runtime"), None);
    }

    #[test]
    fn a_jit_config_in_a_log_is_named() {
        let o = Observed {
            logs_with_jit: vec!["/w/agent.log".into()],
            ..Default::default()
        };
        assert_eq!(
            check(&o)[0].to_string(),
            "a JIT config appears in /w/agent.log"
        );
    }
}
