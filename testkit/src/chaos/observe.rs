//! Gathering an [`Observed`]: each source in its own function, so a scenario that has no
//! node (or no simulator) observes only what it has.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use imp_api::{ImpNetwork, ImpVM, names};
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client, ResourceExt, api::ListParams};

use super::{Job, Observed, Process, Vm};
use crate::github::AdminClient;

/// ImpVMs, JIT Secrets and IP allocations left in `namespace`.
pub async fn kubernetes(client: &Client, namespace: &str, o: &mut Observed) -> anyhow::Result<()> {
    let vms: Api<ImpVM> = Api::namespaced(client.clone(), namespace);
    let vms = vms
        .list(&ListParams::default())
        .await
        .context("listing ImpVMs")?
        .items;
    o.impvms = vms.iter().map(|v| v.name_any()).collect();
    o.vms = vms
        .iter()
        .map(|v| {
            let runner = v.status.as_ref().and_then(|s| s.runner.as_ref());
            Vm {
                name: v.name_any(),
                uid: v.uid().unwrap_or_default(),
                secret: v.spec.runner_config_secret.clone(),
                runner_name: v
                    .annotations()
                    .get(names::ANNOTATION_RUNNER_NAME)
                    .cloned()
                    .or_else(|| runner.and_then(|r| r.runner_name.clone())),
                handoff: runner
                    .and_then(|r| r.handoff)
                    .and_then(|h| serde_json::to_value(h).ok())
                    .and_then(|h| h.as_str().map(str::to_owned)),
                bound: v.spec.node_name.is_some(),
                deleting: v.metadata.deletion_timestamp.is_some(),
            }
        })
        .collect();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let jit = format!("{}={}", names::LABEL_SECRET_KIND, names::SECRET_KIND_JIT);
    o.jit_secrets = secrets
        .list(&ListParams::default().labels(&jit))
        .await
        .context("listing JIT Secrets")?
        .into_iter()
        .map(|s| s.name_any())
        .collect();
    let networks: Api<ImpNetwork> = Api::namespaced(client.clone(), namespace);
    o.allocations = networks
        .list(&ListParams::default())
        .await
        .context("listing ImpNetworks")?
        .into_iter()
        .flat_map(|n| {
            let name = n.name_any();
            n.status
                .map(|s| s.allocations)
                .unwrap_or_default()
                .into_iter()
                .map(move |(ip, a)| format!("{name}/{ip} -> {}", a.vm))
        })
        .collect();
    Ok(())
}

/// Runners still registered, and the simulator's record of the scenario's jobs.
pub async fn github(admin: &AdminClient, job_ids: &[u64], o: &mut Observed) -> anyhow::Result<()> {
    o.registrations = admin
        .runners()
        .await
        .context("listing the simulator's runners")?
        .into_iter()
        .map(|r| r.name)
        .collect();
    o.jobs.clear();
    for &id in job_ids {
        let j = admin.job(id).await.with_context(|| format!("job {id}"))?;
        let status = serde_json::to_value(j.status)?
            .as_str()
            .unwrap_or_default()
            .to_owned();
        o.jobs.push(Job {
            id,
            status,
            runner_id: j.runner_id,
        });
    }
    Ok(())
}

/// The node, as seen from the calling process's network namespace: processes naming
/// `state_dir`, `imp*` links, nft tables named `imp`, and what is left in the VM and temp
/// directories under `state_dir`.
pub fn node(state_dir: &Path, o: &mut Observed) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt as _;
    let needle = state_dir.to_string_lossy().into_owned();
    let me = std::process::id();
    let jails = jail_dirs(state_dir);
    let jail_roots: Vec<(u64, u64)> = jails
        .iter()
        .filter_map(|j| std::fs::metadata(j.join("root")).ok())
        .map(|m| (m.dev(), m.ino()))
        .collect();
    o.vmm_processes = std::fs::read_dir("/proc")
        .context("reading /proc")?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter_map(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
            // A jailed Firecracker names only paths inside its jail: found by its root.
            let jailed = std::fs::metadata(format!("/proc/{pid}/root"))
                .is_ok_and(|m| jail_roots.contains(&(m.dev(), m.ino())));
            (cmdline.contains(&needle) || jailed).then(|| Process {
                pid,
                cmdline: cmdline.trim().to_owned(),
            })
        })
        .collect();
    let links = run("ip", &["-o", "link", "show"])?;
    o.links = links
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .filter(|n| n.starts_with("imp"))
        .collect();
    o.nft_tables = run("nft", &["list", "tables"])?
        .lines()
        .map(|l| l.trim_start_matches("table ").trim().to_owned())
        .filter(|t| t.split_whitespace().nth(1) == Some("imp"))
        .collect();
    o.vm_files = ["vms", "tmp"]
        .iter()
        .filter_map(|d| std::fs::read_dir(state_dir.join(d)).ok())
        .flat_map(|rd| rd.flatten().map(|e| e.path()))
        .chain(jails)
        .collect();
    Ok(())
}

/// Firecracker jails under the runtime's default chroot base: `jailer/<exec name>/<uid>`.
fn jail_dirs(state_dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(state_dir.join("jailer"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| std::fs::read_dir(e.path()).ok())
                .flat_map(|rd| rd.flatten().map(|e| e.path()))
                .collect()
        })
        .unwrap_or_default()
}

/// What counts as a log: the processes' own (`.log`, `.out`, `.err`), the VMs' console and VMM
/// logs (`.log`), and the smoke's watch records (`.jsonl`). Disk images and caches are not read
/// (a sparse 10 GiB writable template would be read whole).
const LOG_SUFFIXES: &[&str] = &[".log", ".out", ".err", ".jsonl"];

/// Logs larger than this are not searched (the runtime caps a console log at 8 MiB).
const MAX_LOG_BYTES: u64 = 64 << 20;

/// Log files under `dirs` (recursively, not descending into `skip`) that contain any of `secrets`.
pub fn files_containing(dirs: &[PathBuf], skip: &[PathBuf], secrets: &[String]) -> Vec<PathBuf> {
    let secrets: Vec<&[u8]> = secrets
        .iter()
        .map(|s| s.as_bytes())
        .filter(|s| !s.is_empty())
        .collect();
    let mut found = Vec::new();
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    while let Some(p) = stack.pop() {
        if skip.iter().any(|s| p.starts_with(s)) {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if meta.is_dir() {
            if let Ok(rd) = std::fs::read_dir(&p) {
                stack.extend(rd.flatten().map(|e| e.path()));
            }
        } else if meta.is_file()
            && meta.len() <= MAX_LOG_BYTES
            && LOG_SUFFIXES
                .iter()
                .any(|s| p.to_string_lossy().ends_with(s))
            && let Ok(bytes) = std::fs::read(&p)
            && secrets
                .iter()
                .any(|s| bytes.windows(s.len()).any(|w| w == *s))
        {
            found.push(p);
        }
    }
    found.sort();
    found
}

fn run(cmd: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("running {cmd}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{cmd} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_secret_in_nested_files_and_skips_what_it_is_told() {
        let d = tempfile::tempdir().unwrap();
        let logs = d.path().join("logs/vm");
        let etcd = d.path().join("cp");
        std::fs::create_dir_all(&logs).unwrap();
        std::fs::create_dir_all(&etcd).unwrap();
        std::fs::write(logs.join("serial.log"), b"boot ... eyJzZWNyZXQ ... done").unwrap();
        std::fs::write(d.path().join("agent.log"), b"nothing here").unwrap();
        std::fs::write(etcd.join("etcd.log"), b"eyJzZWNyZXQ").unwrap();
        std::fs::write(d.path().join("disk.ext4"), b"eyJzZWNyZXQ").unwrap();
        let found = files_containing(
            &[d.path().to_path_buf()],
            std::slice::from_ref(&etcd),
            &["eyJzZWNyZXQ".into()],
        );
        assert_eq!(found, vec![logs.join("serial.log")]);
        assert!(files_containing(&[d.path().to_path_buf()], &[], &["".into()]).is_empty());
    }

    #[test]
    fn names_the_processes_of_the_state_dir_but_not_itself() {
        let d = tempfile::tempdir().unwrap();
        let state = d.path().join("node-state");
        std::fs::create_dir_all(state.join("vms/u1")).unwrap();
        // A stand-in VMM naming its socket in the state dir: the shell waits in the `read` builtin
        // on a pipe, so it never forks (a `sleep` child would share its cmdline until it exec'd,
        // and a scan in that window saw two processes).
        let mut child = Command::new("sh")
            .args(["-c", "read _", "vmm"])
            .arg(state.join("vms/u1/api.sock"))
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Until the child has exec'd, its cmdline is still this test binary's.
        let cmdline = format!("/proc/{}/cmdline", child.id());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !std::fs::read(&cmdline)
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains("api.sock"))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the child never exec'd"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let mut o = Observed::default();
        // Links and nft need iproute2 and nftables: observe only the process and file parts.
        let result = node(&state, &mut o);
        child.kill().unwrap();
        child.wait().unwrap();
        match result {
            Ok(()) => assert_eq!(o.vm_files, vec![state.join("vms/u1")]),
            // Without ip/nft on PATH the process scan still ran before the error.
            Err(e) => assert!(e.to_string().contains("running"), "{e}"),
        }
        assert_eq!(o.vmm_processes.len(), 1, "{:?}", o.vmm_processes);
        assert_eq!(o.vmm_processes[0].pid, child.id());
    }
}
