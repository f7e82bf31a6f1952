//! The local smoke's runner lifecycle through the chart's pods on the real node: the GitHub simulator
//! beyond the node's uplink (the operator pod calls it, the runner reaches it), a runner pool with one
//! warm runner, a queued job whose `workflow_job` webhook reaches the operator pod, the job run and
//! completed by the warm runner, the VM and its JIT Secret gone, the pool replenished; then the pool
//! deleted and nothing of it left. On the Firecracker simulator (the binary the chart mounts from
//! `agent.env.fcBinPath`) imp-guest and the fake runner run as processes inside the runtime container;
//! on QEMU (qemu.rs) they run in a real guest.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::StreamExt as _;
use imp_api::{HandoffState, ImpVM, RunnerStatus};
use imp_testkit::github::{GithubSim, JobSpec, JobStatus, SimJob, jobs::JobStep};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::{
    Api, Client, ResourceExt as _,
    api::{ListParams, PostParams},
    runtime::watcher,
};

/// Where the pool, its class-less objects, VMs and JIT Secrets live (one of the chart's
/// `runnerNamespaces`).
pub const RUNNER_NAMESPACE: &str = "imp-runners";
pub const POOL: &str = "imp";
pub const WEBHOOK_SECRET_NAME: &str = "imp-webhook";
/// The VMs' network: TEST-NET-3's upper half (the lower half holds the Services' ClusterIPs). NAT out
/// of the node's veth end, which leads nowhere but the node's own namespace.
pub const VM_SUBNET: &str = "203.0.113.128/25";
const VM_GATEWAY: &str = "203.0.113.129";
const VM_DNS: &str = "203.0.113.253";
const LABELS: [&str; 2] = ["self-hosted", "imp"];

/// Every version of every ImpVM the API server sent on a watch of the runner namespace: a VM the pool
/// deletes moments after its runner exits is still on record (its exit code).
#[derive(Clone, Default)]
pub struct VmRecord(Arc<Mutex<BTreeMap<String, Vec<ImpVM>>>>);

impl VmRecord {
    /// Starts recording; the task ends with the runtime.
    pub fn start(client: Client) -> Self {
        let record = VmRecord::default();
        let rec = record.clone();
        tokio::spawn(async move {
            let api: Api<ImpVM> = Api::namespaced(client, RUNNER_NAMESPACE);
            let mut events = watcher(api, watcher::Config::default()).boxed();
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::Apply(vm) | watcher::Event::InitApply(vm)) => {
                        let mut all = rec.0.lock().unwrap_or_else(|e| e.into_inner());
                        all.entry(vm.name_any()).or_default().push(vm);
                    }
                    Ok(_) => {}
                    // The watcher retries at once; without a pause a gone API server (teardown) makes
                    // this a busy loop that never yields and holds the runtime's shutdown.
                    Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
                }
            }
        });
        record
    }

    fn versions(&self, name: &str) -> Vec<ImpVM> {
        let all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.get(name).cloned().unwrap_or_default()
    }

    fn names(&self) -> Vec<String> {
        let all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        all.keys().cloned().collect()
    }

    /// The runner's exit code in any recorded version of `name`.
    fn exit_code(&self, name: &str) -> Option<i32> {
        self.versions(name)
            .iter()
            .find_map(|vm| runner(vm).and_then(|r| r.exit_code))
    }
}

fn runner(vm: &ImpVM) -> Option<&RunnerStatus> {
    vm.status.as_ref().and_then(|s| s.runner.as_ref())
}

fn started(vm: &ImpVM) -> bool {
    vm.metadata.deletion_timestamp.is_none()
        && runner(vm).and_then(|r| r.handoff.as_ref()) == Some(&HandoffState::Started)
}

/// `state` of one VM for failure messages.
fn vm_state(vm: &ImpVM) -> String {
    let s = vm.status.clone().unwrap_or_default();
    format!(
        "{} phase {:?} reason {:?} message {:?} runner {:?}",
        vm.name_any(),
        s.phase,
        s.reason,
        s.message,
        s.runner
    )
}

/// Waits up to `secs` for `check` to give a value; panics with `why()` otherwise.
pub async fn wait_for<T, F, Fut, W, WFut>(secs: u64, what: &str, mut check: F, why: W) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
    W: FnOnce() -> WFut,
    WFut: std::future::Future<Output = String>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() > deadline {
            panic!("{what}: not within {secs} s; {}", why().await);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The namespaces, the GitHub App Secret (pool namespace) and the default webhook Secret (release
/// namespace), created through the API (no key on any command line).
pub async fn create_secrets(client: &Client, sim: &GithubSim, release_ns: &str) {
    for ns in [release_ns, RUNNER_NAMESPACE] {
        let api: Api<Namespace> = Api::all(client.clone());
        let mut n = Namespace::default();
        n.metadata.name = Some(ns.into());
        api.create(&PostParams::default(), &n)
            .await
            .unwrap_or_else(|e| panic!("create namespace {ns}: {e}"));
    }
    let secret = |name: &str, data: BTreeMap<String, String>| {
        let mut s = Secret::default();
        s.metadata.name = Some(name.into());
        s.string_data = Some(data);
        s
    };
    let app = secret(
        "imp-github-app",
        sim.secret_data(imp_testkit::github::KeyFormat::Pkcs1),
    );
    Api::<Secret>::namespaced(client.clone(), RUNNER_NAMESPACE)
        .create(&PostParams::default(), &app)
        .await
        .expect("create the GitHub App Secret");
    let hook = secret(
        WEBHOOK_SECRET_NAME,
        BTreeMap::from([(
            "webhook-secret".to_owned(),
            sim.config().webhook_secret.clone(),
        )]),
    );
    Api::<Secret>::namespaced(client.clone(), release_ns)
        .create(&PostParams::default(), &hook)
        .await
        .expect("create the webhook Secret");
}

/// Chart values for the lifecycle: the simulator as GitHub's API, the pool namespace, the fake runner
/// as the runner command (mounted into the runtime container, where the simulated guest runs it), the
/// static imp-guest of the runtime image for the simulator, short agent intervals.
pub fn chart_values(sim_url: &str, fake_runner: &Path) -> String {
    let runner = fake_runner.display();
    format!(
        "runnerNamespaces: [{RUNNER_NAMESPACE}]\n\
         operator:\n  githubApiUrl: {sim_url}\n  webhookSecretName: {WEBHOOK_SECRET_NAME}\n\
         agent:\n  heartbeatInterval: 2s\n  extraEnv:\n\
         \x20   - {{name: IMP_RUNNER_COMMAND, value: \"{runner}\"}}\n\
         \x20   - {{name: IMP_POLL_INTERVAL, value: 1s}}\n\
         \x20   - {{name: IMP_SWEEP_INTERVAL, value: 2s}}\n\
         runtime:\n  extraEnv:\n\
         \x20   - {{name: IMP_GUEST_BIN, value: /usr/local/lib/imp/imp-guest}}\n\
         \x20   - {{name: IMP_JAILER_DOUBLE_BIND, value: \"/usr,/lib,/lib64,/bin,{runner}\"}}\n\
         \x20   - {{name: IMP_JAILER_DOUBLE_KEEP_ENV, value: IMP_GUEST_BIN}}\n\
         \x20   - {{name: IMP_JAILER_DOUBLE_KEEP_ROOT, value: \"1\"}}\n\
         \x20 extraVolumes:\n\
         \x20   - {{name: fake-runner, hostPath: {{path: \"{runner}\", type: File}}}}\n\
         \x20 extraVolumeMounts:\n\
         \x20   - {{name: fake-runner, mountPath: \"{runner}\", readOnly: true}}\n"
    )
}

/// The runner VMs' class: [`VmSize::SMALL`] for the fake runner alone, more for Docker jobs.
#[derive(Clone, Copy, Debug)]
pub struct VmSize {
    pub memory_mib: u32,
    pub disk_gib: u32,
}

impl VmSize {
    /// The node is this machine: a small VM.
    pub const SMALL: VmSize = VmSize {
        memory_mib: 256,
        disk_gib: 1,
    };
}

/// A job to queue: its steps and the conclusion its runner must report.
pub struct JobRun {
    pub steps: Vec<JobStep>,
    pub conclusion: &'static str,
}

impl JobRun {
    /// A job without steps (the runner reports success).
    pub fn empty() -> JobRun {
        JobRun {
            steps: Vec::new(),
            conclusion: "success",
        }
    }
}

/// The smoke's runner pool manifest with the test's images, network and VM size.
fn pool_manifest(base_image: &str, runner_image: &str, size: VmSize) -> String {
    let manifest = std::fs::read_to_string(
        imp_testkit::paths::workspace_root().join("smoke/manifests/runner-pool.yaml"),
    )
    .expect("smoke/manifests/runner-pool.yaml");
    let replaced = [
        ("ghcr.io/imp-dev/runner-base:ubuntu-24.04", base_image),
        ("ghcr.io/imp-dev/actions-runner:2", runner_image),
        ("subnet: 10.60.0.0/24", &format!("subnet: {VM_SUBNET}")),
        ("gateway: 10.60.0.1", &format!("gateway: {VM_GATEWAY}")),
        ("dns: [1.1.1.1]", &format!("dns: [{VM_DNS}]")),
        (
            "    enabled: true\n",
            "    enabled: true\n    egressInterface: imp-node0\n",
        ),
        ("vcpu: 2", "vcpu: 1"),
        (
            "memoryMiB: 2048",
            &format!("memoryMiB: {}", size.memory_mib),
        ),
        ("diskGiB: 10", &format!("diskGiB: {}", size.disk_gib)),
    ];
    let mut out = manifest.clone();
    for (from, to) in replaced {
        assert_eq!(
            out.matches(from).count(),
            1,
            "smoke/manifests/runner-pool.yaml no longer has exactly one {from:?}"
        );
        out = out.replace(from, to);
    }
    out
}

pub struct Lifecycle<'a> {
    pub client: Client,
    pub sim: &'a GithubSim,
    pub record: VmRecord,
    pub kubectl: &'a dyn Fn(&[&str]) -> Result<String, String>,
    /// imp-runtime's API socket on the host (the chart's socketDir hostPath).
    pub runtime_socket: PathBuf,
    pub work: PathBuf,
    /// The kubelet's pod log directory (`<podLogsDir>/<ns>_<pod>_<uid>/<container>/0.log`): what the
    /// agent and runtime pods said about a VM, for failure messages.
    pub pod_logs: PathBuf,
}

/// The lines of the agent's and runtime's container logs that name `needle`, the last `n` of each.
fn pod_log_lines(pod_logs: &Path, needle: &str, n: usize) -> String {
    let mut out = String::new();
    for pod in std::fs::read_dir(pod_logs).into_iter().flatten().flatten() {
        for container in ["agent", "runtime"] {
            let Ok(text) = std::fs::read_to_string(pod.path().join(container).join("0.log")) else {
                continue;
            };
            let lines: Vec<&str> = text.lines().filter(|l| l.contains(needle)).collect();
            out.push_str(&format!(
                "--- {container} ({} lines naming {needle}):\n",
                lines.len()
            ));
            for l in &lines[lines.len().saturating_sub(n)..] {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    out
}

impl Lifecycle<'_> {
    fn vms(&self) -> Api<ImpVM> {
        Api::namespaced(self.client.clone(), RUNNER_NAMESPACE)
    }

    async fn live_vms(&self) -> Vec<ImpVM> {
        self.vms()
            .list(&ListParams::default().labels(&format!("imp.dev/runner-pool={POOL}")))
            .await
            .map(|l| l.items)
            .unwrap_or_default()
    }

    async fn describe(&self) -> String {
        let vms: Vec<String> = self.live_vms().await.iter().map(vm_state).collect();
        let pool = (self.kubectl)(&[
            "-n",
            RUNNER_NAMESPACE,
            "get",
            "imprp",
            POOL,
            "-o",
            "jsonpath={.status.conditions}",
        ])
        .unwrap_or_else(|e| e);
        format!(
            "VMs {vms:?}; pool conditions {pool}; jobs {:?}",
            self.sim
                .jobs()
                .iter()
                .map(|j| (j.id, j.status, j.runner_name.clone()))
                .collect::<Vec<_>>()
        )
    }

    /// UIDs of the VMs imp-runtime holds (`GET /v1/vms` on its socket).
    pub fn runtime_vms(&self) -> Vec<String> {
        let out = Command::new("curl")
            .args(["-sf", "--unix-socket"])
            .arg(&self.runtime_socket)
            .arg("http://imp/v1/vms")
            .output()
            .expect("run curl");
        assert!(
            out.status.success(),
            "GET /v1/vms on {}: {}",
            self.runtime_socket.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("/v1/vms is JSON");
        v["vms"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|vm| vm["uid"].as_str().map(str::to_owned))
            .collect()
    }

    /// Pushes the pool's images (one-file layers: the Firecracker simulator boots nothing) and
    /// [`Self::warm_runner_on`] them.
    pub async fn warm_runner(&self, registry: &str) -> (ImpVM, Option<String>) {
        let layer = |path: &str, content: &[u8]| {
            [imp_testkit::oci::LayerBlob::tar_gzip(&[(path, content)])]
        };
        let auth = imp_testkit::oci::PushAuth::Anonymous;
        let base = format!("{registry}/imp-dev/runner-base:real-node");
        let runner_image = format!("{registry}/imp-dev/actions-runner:real-node");
        imp_testkit::oci::push_image(
            registry,
            "imp-dev/runner-base:real-node",
            &layer("etc/imp-real-node", b"base"),
            &auth,
        )
        .await
        .expect("push the base image");
        imp_testkit::oci::push_image(
            registry,
            "imp-dev/actions-runner:real-node",
            &layer("opt/runner/VERSION", b"real-node"),
            &auth,
        )
        .await
        .expect("push the runner image");
        self.warm_runner_on(&base, &runner_image, VmSize::SMALL, 120)
            .await
    }

    /// Applies the smoke's pool manifest with these images; returns the warm VM once its runner has
    /// Started within `boot_secs` of its mint (JIT Secret owned by the VM, deleted after the handoff),
    /// and its JIT config when the test read the Secret before the handoff deleted it (to prove no
    /// output carries it).
    pub async fn warm_runner_on(
        &self,
        base: &str,
        runner_image: &str,
        size: VmSize,
        boot_secs: u64,
    ) -> (ImpVM, Option<String>) {
        let manifest = self.work.join("runner-pool.yaml");
        std::fs::write(&manifest, pool_manifest(base, runner_image, size))
            .expect("write the pool manifest");
        (self.kubectl)(&[
            "-n",
            RUNNER_NAMESPACE,
            "apply",
            "-f",
            &manifest.display().to_string(),
        ])
        .expect("apply the runner pool");

        let t = Instant::now();
        let minted = wait_for(
            90,
            "a runner VM with a JIT Secret",
            || async {
                self.live_vms()
                    .await
                    .into_iter()
                    .find(|vm| vm.spec.runner_config_secret.is_some())
            },
            || self.describe(),
        )
        .await;
        let name = minted.name_any();
        let secret_name = minted.spec.runner_config_secret.clone().expect("secret");
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), RUNNER_NAMESPACE);
        let mut jit_config = None;
        if let Ok(s) = secrets.get(&secret_name).await {
            let owner = s.owner_references().first().map(|o| o.uid.clone());
            assert_eq!(
                owner, minted.metadata.uid,
                "JIT Secret {secret_name} is not owned by {name}"
            );
            jit_config = s
                .data
                .as_ref()
                .and_then(|d| d.get("jitconfig"))
                .map(|v| String::from_utf8_lossy(&v.0).into_owned());
        }
        let vm = wait_for(
            boot_secs,
            &format!("runner VM {name}: handoff Started"),
            || async {
                self.vms()
                    .get_opt(&name)
                    .await
                    .ok()
                    .flatten()
                    .filter(started)
            },
            || self.describe(),
        )
        .await;
        println!(
            "real_node: runner VM {name} scheduled onto the node, booted by the runtime pod, handed its JIT \
             config by the agent pod: runner {:?} Started {:.1}s after the pool was applied",
            runner(&vm).and_then(|r| r.runner_name.clone()),
            t.elapsed().as_secs_f64()
        );
        wait_for(
            20,
            &format!("JIT Secret {secret_name} deleted after Started"),
            || async {
                secrets
                    .get_opt(&secret_name)
                    .await
                    .ok()?
                    .is_none()
                    .then_some(())
            },
            || self.describe(),
        )
        .await;
        let uid = vm.metadata.uid.clone().expect("uid");
        assert!(
            self.runtime_vms().contains(&uid),
            "imp-runtime does not hold {name} ({uid}): {:?}",
            self.runtime_vms()
        );
        (vm, jit_config)
    }

    /// A queued job (`run`'s steps) whose webhook reaches the operator pod (`operator_url`), taken and
    /// completed by the warm runner `vm` with `run.conclusion` (each step's conclusion printed); then
    /// the VM is gone from the API and the runtime, and the pool has a new started runner, returned
    /// with the job. `job_secs`: how long the job may run once queued; `boot_secs`: how long the
    /// replacement runner may take to boot and start.
    pub async fn job_through(
        &self,
        vm: &ImpVM,
        operator_url: &str,
        run: JobRun,
        job_secs: u64,
        boot_secs: u64,
    ) -> (SimJob, ImpVM) {
        let name = vm.name_any();
        let uid = vm.metadata.uid.clone().expect("uid");
        self.sim.set_webhook(
            &format!("{operator_url}/webhooks/github"),
            &self.sim.config().webhook_secret.clone(),
        );
        let t = Instant::now();
        let job = self.sim.queue_job(JobSpec {
            labels: LABELS.map(str::to_owned).to_vec(),
            steps: run.steps,
            ..Default::default()
        });
        let delivery = wait_for(
            20,
            &format!(
                "the queued workflow_job webhook of job {} delivered",
                job.id
            ),
            || async {
                self.sim
                    .deliveries()
                    .into_iter()
                    .find(|d| d.job_id == job.id && d.action == "queued" && d.status.is_some())
            },
            || async { format!("deliveries {:?}", self.sim.deliveries()) },
        )
        .await;
        assert!(
            delivery.status.is_some_and(|s| (200..300).contains(&s)),
            "the operator pod answered the signed webhook with {:?} ({})",
            delivery.status,
            delivery.outcome
        );
        let done = wait_for(
            job_secs,
            &format!("job {} completed", job.id),
            || async {
                self.sim
                    .job(job.id)
                    .filter(|j| j.status == JobStatus::Completed)
            },
            || self.describe(),
        )
        .await;
        println!(
            "real_node: job {} queued, webhook answered {:?} by the operator pod, completed by {:?} in {:.1}s",
            job.id,
            delivery.status,
            done.runner_name,
            t.elapsed().as_secs_f64()
        );
        for step in &done.steps {
            println!(
                "real_node: job {} step {:?}: {}",
                job.id,
                step.name,
                step.conclusion.as_deref().unwrap_or("(no conclusion)")
            );
        }
        assert_eq!(
            done.conclusion.as_deref(),
            Some(run.conclusion),
            "job {} steps: {:?}",
            job.id,
            done.steps
        );
        assert_eq!(
            done.runner_name,
            runner(vm).and_then(|r| r.runner_name.clone()),
            "job {} was not run by the warm runner of {name}",
            job.id
        );
        let code = wait_for(
            60,
            &format!("runner of {name} exited"),
            || async { self.record.exit_code(&name) },
            || async {
                // What became of the VM: its recorded versions and its Events.
                let versions: Vec<String> =
                    self.record.versions(&name).iter().map(vm_state).collect();
                let events = (self.kubectl)(&[
                    "-n",
                    RUNNER_NAMESPACE,
                    "get",
                    "events",
                    "--field-selector",
                    &format!("involvedObject.name={name}"),
                ])
                .unwrap_or_else(|e| e);
                let uid_logs = pod_log_lines(&self.pod_logs, &uid, 25);
                let name_logs = pod_log_lines(&self.pod_logs, &name, 25);
                format!(
                    "{}\n{name}'s recorded versions: {versions:#?}\nits Events:\n{events}\n\
                     pod logs:\n{uid_logs}{name_logs}",
                    self.describe().await
                )
            },
        )
        .await;
        assert_eq!(code, 0, "the runner of {name} exited {code}");
        wait_for(
            60,
            &format!("runner VM {name} deleted after its job"),
            || async {
                self.vms()
                    .get_opt(&name)
                    .await
                    .ok()?
                    .is_none()
                    .then_some(())
            },
            || self.describe(),
        )
        .await;
        wait_for(
            30,
            &format!("imp-runtime releases {name}"),
            || async { (!self.runtime_vms().contains(&uid)).then_some(()) },
            || async { format!("runtime holds {:?}", self.runtime_vms()) },
        )
        .await;
        let replacement = wait_for(
            boot_secs,
            "a replacement runner Started (minIdle 1)",
            || async {
                self.live_vms()
                    .await
                    .into_iter()
                    .find(|v| v.name_any() != name && started(v))
            },
            || self.describe(),
        )
        .await;
        println!(
            "real_node: {name} deleted and released by imp-runtime; pool replenished with {} (Started) \
             {:.1}s after the job was queued",
            replacement.name_any(),
            t.elapsed().as_secs_f64()
        );
        (done, replacement)
    }

    /// Deletes the pool, its network and class as an operator would; nothing of them may stay: no
    /// ImpVM, JIT Secret, runtime VM, GitHub registration or IP allocation.
    pub async fn delete_pool(&self) {
        let manifest = self.work.join("runner-pool.yaml");
        (self.kubectl)(&[
            "-n",
            RUNNER_NAMESPACE,
            "delete",
            "imprp",
            POOL,
            "--wait=false",
        ])
        .expect("delete the pool");
        wait_for(
            90,
            "no ImpVM after deleting the pool",
            || async {
                self.vms()
                    .list(&ListParams::default())
                    .await
                    .ok()?
                    .items
                    .is_empty()
                    .then_some(())
            },
            || self.describe(),
        )
        .await;
        wait_for(
            30,
            "the pool gone (finalizer)",
            || async {
                (self.kubectl)(&["-n", RUNNER_NAMESPACE, "get", "imprp", "-o", "name"])
                    .ok()?
                    .trim()
                    .is_empty()
                    .then_some(())
            },
            || self.describe(),
        )
        .await;
        wait_for(
            30,
            "imp-runtime holds no VM",
            || async { self.runtime_vms().is_empty().then_some(()) },
            || async { format!("runtime holds {:?}", self.runtime_vms()) },
        )
        .await;
        let jit = (self.kubectl)(&[
            "-n",
            RUNNER_NAMESPACE,
            "get",
            "secret",
            "-l",
            "imp.dev/secret-kind=jitconfig",
            "-o",
            "name",
        ])
        .expect("list JIT Secrets");
        assert!(jit.trim().is_empty(), "JIT Secrets left: {jit}");
        let runners = self.sim.runners();
        assert!(
            runners.is_empty(),
            "runners still registered at GitHub: {runners:?}"
        );
        let allocations = (self.kubectl)(&[
            "-n",
            RUNNER_NAMESPACE,
            "get",
            "impnetwork",
            "runners",
            "-o",
            "jsonpath={.status.allocations}",
        ])
        .expect("the network's allocations");
        assert!(
            allocations.trim().is_empty() || allocations.trim() == "{}",
            "IP allocations left: {allocations}"
        );
        (self.kubectl)(&[
            "-n",
            RUNNER_NAMESPACE,
            "delete",
            "-f",
            &manifest.display().to_string(),
            "--ignore-not-found",
        ])
        .expect("delete the class and network");
        println!(
            "real_node: pool deleted: no ImpVM, JIT Secret, runtime VM, GitHub registration or IP allocation \
             left ({} VMs recorded: {:?})",
            self.record.names().len(),
            self.record.names()
        );
    }
}
