//! The chart on a real node (issue 20): a control plane with kube-scheduler and the workload
//! controllers, Debian's containerd + runc and the kubelet from testenv/ in a network namespace this test
//! creates (testkit::node), the component images from images/components/build.sh pushed to a local
//! registry, `helm install`: the operator, agent, runtime and KVM-preflight pods become Ready; `helm
//! upgrade` from the previous chart version keeps the runtime pod and a running VM (OnDelete); the local
//! smoke's runner lifecycle completes through those pods (lifecycle.rs: GitHub simulator webhook ->
//! operator pod -> VM on the runtime pod, Firecracker simulator -> JIT handoff by the agent pod -> the fake
//! runner completes the job -> VM and Secret gone, pool replenished); `helm uninstall` leaves no Imp
//! object, pod, container, VM cgroup or TAP behind.
//!
//! Skips, saying why, where the host cannot run a node (not root, no containerd/runc/CNI plugins, no
//! kubelet in testenv/bin); IMP_REQUIRE_REAL_NODE=1 turns the skip into a failure (CI sets it).
//! One test per binary on purpose: the test thread enters the node's network namespace before any
//! thread or process of testkit exists, so that all of them inherit it.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use imp_testkit::{
    bins,
    controlplane::ControlPlane,
    github::{GithubSim, SimConfig},
    node, paths,
    registry::{Registry, RegistryOptions},
};
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, api::ListParams};

#[path = "real_node/lifecycle.rs"]
mod lifecycle;

const REQUIRE_ENV: &str = "IMP_REQUIRE_REAL_NODE";
const NAMESPACE: &str = "imp-system";

fn skip_or_fail(why: &str) {
    imp_testkit::skip::skip_or_fail(REQUIRE_ENV, "real_node", why);
}

#[test]
fn chart_pods_become_ready_on_a_real_node_and_uninstall_leaves_nothing() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip_or_fail("not root (network namespaces, containerd and the kubelet need it)");
    }
    let mut missing = node::missing_prerequisites(&paths::testenv_bin_dir());
    for (tool, package) in [
        ("docker-registry", "docker-registry"),
        ("skopeo", "skopeo"),
        ("cc", "gcc"),
        ("curl", "curl"),
    ] {
        if Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map_or(true, |o| !o.status.success())
        {
            missing.push(format!("{tool} (Debian package {package})"));
        }
    }
    if !missing.is_empty() {
        return skip_or_fail(&format!("missing {}", missing.join(", ")));
    }

    let id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let netns =
        node::NodeNetns::create(&format!("imp-node-{id}")).expect("create the node's netns");
    let entered = netns.enter().expect("enter the node's netns");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(scenario(&id));
    drop(rt);
    drop(entered);
    drop(netns);
}

async fn scenario(id: &str) {
    let work = tempfile::Builder::new()
        .prefix("imp-real-node-")
        .tempdir()
        .expect("work dir");
    let work = work.path().to_path_buf();

    let t0 = Instant::now();
    let mut cp_opts = node::node_control_plane(work.join("cp"));
    // The chart installs the CRDs, as on a real cluster.
    cp_opts.install_imp_crds = false;
    let cp = ControlPlane::start(cp_opts).await.expect("control plane");
    let registry = Registry::start(RegistryOptions::default())
        .await
        .expect("registry");
    let reg = registry.host();
    let pause = push_pause_image(&work, &reg);
    let cp_secs = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let node_name = format!("imp-node-{id}");
    let real_node = node::RealNode::start(
        &cp,
        node::RealNodeOptions {
            dir: work.join("node"),
            node_name: node_name.clone(),
            labels: vec![("imp/enabled".into(), "true".into())],
            sandbox_image: pause,
            plain_http_registries: vec![reg.clone()],
            bin_dir: paths::testenv_bin_dir(),
        },
    )
    .await
    .expect("real node");
    println!(
        "real_node: control plane + registry {cp_secs:.1}s, node {node_name} Ready {:.1}s after containerd started",
        t1.elapsed().as_secs_f64()
    );

    // Component images from the workspace binaries (debug profile; build.sh strips them).
    let built = bins::ensure_built(
        &[
            ("imp-operator", "imp-operator"),
            ("imp-agent", "imp-agent"),
            ("imp-runtime", "imp-runtime"),
            ("imp-testkit", "imp-firecracker-sim"),
            ("imp-fake-runner", "imp-fake-runner"),
        ],
        &[
            "api",
            "common",
            "operator",
            "node",
            "testkit/src",
            "fake-runner/src",
            "Cargo.lock",
        ],
    )
    .expect("build the component binaries");
    // The runtime image carries the static imp-guest (images/components/build.sh refuses without it).
    let target_dir = bins::profile_dir()
        .expect("profile dir")
        .parent()
        .expect("target dir")
        .to_path_buf();
    let static_guest = target_dir.join("x86_64-unknown-linux-gnu/release/imp-guest");
    if !static_guest.is_file() {
        node::run(
            Command::new(paths::workspace_root().join("guest/check-static.sh"))
                .env("CARGO_TARGET_DIR", &target_dir),
        )
        .expect("guest/check-static.sh (the static imp-guest for the runtime image)");
    }
    let t2 = Instant::now();
    let images = work.join("images");
    let out = Command::new(paths::workspace_root().join("images/components/build.sh"))
        .arg("--bin-dir")
        .arg(built[0].parent().expect("profile dir"))
        .arg("--out")
        .arg(&images)
        .arg("--guest")
        .arg(&static_guest)
        .args(["--push", &format!("{reg}/imp-dev")])
        .output()
        .expect("run images/components/build.sh");
    assert!(
        out.status.success(),
        "images/components/build.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "real_node: component images built and pushed in {:.1}s:\n{}",
        t2.elapsed().as_secs_f64(),
        std::fs::read_to_string(images.join("digests")).unwrap_or_default()
    );

    // The GitHub simulator on the node's IP: the operator pod reaches it over the pod network, the
    // simulated VMs (processes in the runtime pod, on the host network) as the node's own address.
    let sim = GithubSim::start_on(
        SimConfig {
            org: "acme".into(),
            repos: vec!["acme/app".into()],
            ..SimConfig::default()
        },
        &format!("{}:0", node::NODE_IP),
    )
    .await
    .expect("GitHub simulator");
    let client = cp.client().await.expect("client");
    lifecycle::create_secrets(&client, &sim, NAMESPACE).await;
    let lifecycle_values = work.join("lifecycle-values.yaml");
    std::fs::write(
        &lifecycle_values,
        lifecycle::chart_values(sim.base_url(), &built[4]),
    )
    .expect("write the lifecycle values");

    // Node-side paths inside the work dir: the chart's hostPaths, the kernel (the simulator never reads
    // it) and the "Firecracker" binary the runtime pod mounts (the simulator).
    let kernel = work.join("vmlinux");
    std::fs::write(&kernel, b"").expect("write the kernel placeholder file");
    let vm_cgroup_parent = format!("imp-vms-{id}");
    let _vm_cgroups = RemoveCgroupOnDrop(vm_cgroup_parent.clone());
    let sets = [
        format!("agent.env.kernelPath={}", kernel.display()),
        format!("agent.env.fcBinPath={}", built[3].display()),
        format!(
            "agent.hostPaths.socketDir.path={}",
            work.join("run-imp").display()
        ),
        format!(
            "agent.hostPaths.stateDir.path={}",
            work.join("var-lib-imp").display()
        ),
        format!("runtime.vmCgroupParent={vm_cgroup_parent}"),
        format!("runtime.insecureRegistries[0]={reg}"),
        // The node's namespace has no default route: the pool's network names its uplink, which
        // the platform must allow (node admission of ImpNetworks, docs/network.md).
        "runtime.network.allowedEgressInterfaces[0]=imp-node0".into(),
        // No Prometheus Operator CRDs in this cluster.
        "metrics.serviceMonitor.enabled=false".into(),
        "metrics.podMonitor.enabled=false".into(),
    ];
    // Published as seed 001 installs it: `helm package` + `helm push` to the registry, installed from
    // oci://. A previous version first, then the upgrade to this one.
    let charts = work.join("charts");
    let previous = "0.0.9-prev";
    let current = chart_version();
    for version in [previous, current.as_str()] {
        helm(
            &cp,
            &[
                "package",
                &paths::chart_dir().display().to_string(),
                "--version",
                version,
                "--destination",
                &charts.display().to_string(),
            ],
        )
        .expect("helm package");
        helm(
            &cp,
            &[
                "push",
                &charts
                    .join(format!("imp-{version}.tgz"))
                    .display()
                    .to_string(),
                &format!("oci://{reg}/charts"),
                "--plain-http",
            ],
        )
        .expect("helm push");
    }
    let chart_ref = format!("oci://{reg}/charts/imp");
    let seed = paths::reference_dir().join("seed-examples/helm-values-seed.yaml");
    let image_values = images.join("values.yaml");
    let install_args = |version: &str, extra: &str| -> Vec<String> {
        let mut set = sets.join(",");
        if !extra.is_empty() {
            set = format!("{set},{extra}");
        }
        [
            "upgrade",
            "--install",
            "imp",
            &chart_ref,
            "--version",
            version,
            "-n",
            NAMESPACE,
            "--create-namespace",
            "--plain-http",
            "-f",
            &seed.display().to_string(),
            "-f",
            &image_values.display().to_string(),
            "-f",
            &lifecycle_values.display().to_string(),
            "--set",
            &set,
            "--wait",
            "--timeout",
            "5m",
        ]
        .map(str::to_owned)
        .to_vec()
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let t3 = Instant::now();
    let install = helm(&cp, &as_strs(&install_args(previous, "")));
    if let Err(e) = install {
        panic!(
            "helm upgrade --install {chart_ref} --version {previous} --wait: {e}\npods: {}\nkubelet log:\n{}",
            describe_pods(&pods).await,
            real_node.log_tail("kubelet", 40)
        );
    }
    println!(
        "real_node: helm upgrade --install from {chart_ref} --version {previous} --wait: {:.1}s",
        t3.elapsed().as_secs_f64()
    );
    for component in ["operator", "agent", "runtime", "kvm-preflight"] {
        ready_pod_on(&pods, component, &node_name).await;
    }
    let runtime_before = ready_pod_on(&pods, "runtime", &node_name).await;
    // What each component said on a real node (read from the kubelet's pod log directory).
    for component in ["operator", "agent", "runtime"] {
        println!(
            "real_node: imp-{component} log (last lines):\n{}",
            container_log_tail(real_node.dir(), component, 8)
        );
    }

    // A runner pool with one warm runner, booted by the runtime pod and handed its config by the agent.
    let record = lifecycle::VmRecord::start(client.clone());
    let kubectl_fn = |args: &[&str]| kubectl(&cp, args);
    let life = lifecycle::Lifecycle {
        client: client.clone(),
        sim: &sim,
        record,
        kubectl: &kubectl_fn,
        runtime_socket: work.join("run-imp/runtime.sock"),
        work: work.clone(),
    };
    let warm = life.warm_runner(&reg).await;

    // The upgrade changes the runtime's pod template; OnDelete keeps the running pod (and so its VMs).
    let t4 = Instant::now();
    if let Err(e) = helm(
        &cp,
        &as_strs(&install_args(&current, "runtime.serialLogCapBytes=4194304")),
    ) {
        panic!(
            "helm upgrade to {current}: {e}\npods: {}",
            describe_pods(&pods).await
        );
    }
    println!(
        "real_node: helm upgrade {previous} -> {current} --wait: {:.1}s",
        t4.elapsed().as_secs_f64()
    );
    let history = helm(&cp, &["history", "imp", "-n", NAMESPACE, "-o", "json"]).expect("history");
    assert!(
        history.contains(&format!("imp-{current}")) && history.contains(&format!("imp-{previous}")),
        "release history does not show {previous} then {current}: {history}"
    );
    let ds_env = kubectl(
        &cp,
        &[
            "-n", NAMESPACE, "get", "ds", "imp-runtime", "-o",
            "jsonpath={.spec.template.spec.containers[0].env[?(@.name==\"IMP_SERIAL_LOG_CAP_BYTES\")].value}",
        ],
    )
    .expect("runtime DaemonSet");
    assert_eq!(
        ds_env.trim(),
        "4194304",
        "the upgrade did not change the runtime's template"
    );
    let runtime_after = ready_pod_on(&pods, "runtime", &node_name).await;
    assert_eq!(
        runtime_after.metadata.uid, runtime_before.metadata.uid,
        "the upgrade replaced the runtime pod (updateStrategy must be OnDelete)"
    );
    assert_eq!(
        restarts(&runtime_after),
        restarts(&runtime_before),
        "the runtime container restarted during the upgrade"
    );
    assert!(
        !real_node.pod_pids().is_empty(),
        "pods are Ready but no process is in the node's cgroup root"
    );
    let warm_uid = warm.metadata.uid.clone().expect("uid");
    assert!(
        life.runtime_vms().contains(&warm_uid),
        "the upgrade lost the running VM {warm_uid}: the runtime holds {:?}",
        life.runtime_vms()
    );

    // The smoke's lifecycle through the pods: a queued job's webhook to the operator pod, the job run by
    // the warm runner, its VM gone, the pool replenished; then the pool deleted, nothing of it left.
    let operator = ready_pod_on(&pods, "operator", &node_name).await;
    let operator_ip = operator
        .status
        .and_then(|s| s.pod_ip)
        .expect("the operator pod has an IP");
    life.job_through(&warm, &format!("http://{operator_ip}:8080"))
        .await;
    life.delete_pool().await;

    // Uninstall: no pod, no Imp object, no container, no VM cgroup left.
    helm(
        &cp,
        &[
            "uninstall",
            "imp",
            "-n",
            NAMESPACE,
            "--wait",
            "--timeout",
            "3m",
        ],
    )
    .expect("helm uninstall");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = pods.list(&ListParams::default()).await.expect("list pods");
        let running = real_node.ctr(&["tasks", "ls", "-q"]).expect("ctr tasks ls");
        if left.items.is_empty() && running.trim().is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after uninstall: pods {:?}, containerd tasks {running:?}",
            left.items
                .iter()
                .map(|p| p.metadata.name.clone().unwrap_or_default())
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for kind in ["impvms", "impvmrunnerpools", "impnetworks", "impvmclasses"] {
        // The CRDs stay (helm never deletes crds/), their objects must not.
        let out = kubectl(&cp, &["get", kind, "-A", "-o", "name"]).unwrap_or_default();
        assert!(out.trim().is_empty(), "{kind} left after uninstall: {out}");
    }
    let taps: Vec<String> = node::run(Command::new("ip").args(["-o", "link", "show"]))
        .expect("ip link show")
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .filter(|n| {
            n.len() == 14 && n.starts_with("imp") && n[3..].chars().all(|c| c.is_ascii_hexdigit())
        })
        .collect();
    assert!(taps.is_empty(), "VM TAPs left after uninstall: {taps:?}");
    let leftover_cgroups: Vec<PathBuf> = node::cgroup_hierarchies()
        .into_iter()
        .map(|h| h.join(&vm_cgroup_parent))
        .filter(|p| p.join("cgroup.procs").exists() && !cgroup_empty(p))
        .collect();
    assert!(
        leftover_cgroups.is_empty(),
        "VM cgroups with processes after uninstall: {leftover_cgroups:?}"
    );
    drop(real_node);
    drop(registry);
    drop(cp);
    let _ = std::fs::remove_dir_all(&work);
}

/// The chart's own version (Chart.yaml).
fn chart_version() -> String {
    let chart = std::fs::read_to_string(paths::chart_dir().join("Chart.yaml")).expect("Chart.yaml");
    chart
        .lines()
        .find_map(|l| l.strip_prefix("version:"))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .expect("Chart.yaml has a version")
}

fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn restarts(p: &Pod) -> Vec<i32> {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| cs.iter().map(|c| c.restart_count).collect())
        .unwrap_or_default()
}

/// The Ready pod of `component` on `node`, waiting up to 3 minutes (helm's --wait does not cover every
/// DaemonSet: it may count a DaemonSet whose status is not updated yet); panics with every pod's state.
async fn ready_pod_on(pods: &Api<Pod>, component: &str, node: &str) -> Pod {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let list = pods
            .list(
                &ListParams::default().labels(&format!("app.kubernetes.io/component={component}")),
            )
            .await
            .expect("list pods");
        let found = list.items.into_iter().find(|p| {
            pod_ready(p) && p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
        });
        if let Some(p) = found {
            return p;
        }
        if Instant::now() > deadline {
            panic!(
                "no Ready {component} pod on {node}: {}",
                describe_pods(pods).await
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The runtime's VM cgroup parent (created on the host by the runtime pod), removed with anything in it
/// also when the test fails.
struct RemoveCgroupOnDrop(String);

impl Drop for RemoveCgroupOnDrop {
    fn drop(&mut self) {
        node::remove_cgroup_everywhere(&self.0);
    }
}

/// The last lines of the first log file of container `container` under the kubelet's pod log directory
/// (`<podLogsDir>/<ns>_<pod>_<uid>/<container>/0.log`).
fn container_log_tail(node_dir: &Path, container: &str, lines: usize) -> String {
    let pod_logs = node_dir.join("pod-logs");
    std::fs::read_dir(&pod_logs)
        .into_iter()
        .flatten()
        .flatten()
        .map(|pod| pod.path().join(container).join("0.log"))
        .find(|log| log.is_file())
        .map(|log| imp_testkit::process::log_tail(&log, lines))
        .unwrap_or_else(|| {
            format!(
                "(no log of container {container} under {})",
                pod_logs.display()
            )
        })
}

fn cgroup_empty(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.procs")).is_ok_and(|s| s.trim().is_empty())
}

fn pod_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

async fn describe_pods(pods: &Api<Pod>) -> String {
    let Ok(list) = pods.list(&ListParams::default()).await else {
        return "(cannot list pods)".into();
    };
    list.items
        .iter()
        .map(|p| {
            let status = p.status.as_ref();
            let containers: Vec<String> = status
                .and_then(|s| s.container_statuses.clone())
                .unwrap_or_default()
                .into_iter()
                .chain(
                    status
                        .and_then(|s| s.init_container_statuses.clone())
                        .unwrap_or_default(),
                )
                .map(|c| format!("{}: {:?}", c.name, c.state))
                .collect();
            format!(
                "\n  {} phase {:?} conditions {:?} containers {containers:?}",
                p.metadata.name.clone().unwrap_or_default(),
                status.and_then(|s| s.phase.clone()),
                status.and_then(|s| s.conditions.clone())
            )
        })
        .collect()
}

fn helm(cp: &ControlPlane, args: &[&str]) -> Result<String, String> {
    tool(cp, "helm", args)
}

fn kubectl(cp: &ControlPlane, args: &[&str]) -> Result<String, String> {
    tool(cp, "kubectl", args)
}

fn tool(cp: &ControlPlane, name: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(paths::testenv_bin(name))
        .args(args)
        .env("KUBECONFIG", cp.kubeconfig_path())
        .env("HELM_CACHE_HOME", cp.dir().join("helm/cache"))
        .env("HELM_CONFIG_HOME", cp.dir().join("helm/config"))
        .env("HELM_DATA_HOME", cp.dir().join("helm/data"))
        .output()
        .map_err(|e| format!("{name}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{name} {args:?}: {}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        ))
    }
}

/// The sandbox image: the static pause binary in one layer (images/oci-layout.sh), pushed with skopeo.
fn push_pause_image(work: &Path, registry: &str) -> String {
    let dir = work.join("pause");
    let root = dir.join("root");
    std::fs::create_dir_all(&root).expect("pause root");
    let binary = node::build_pause_binary(&dir).expect("pause binary");
    let path = root.join("pause");
    std::fs::write(&path, binary).expect("write /pause");
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod /pause");
    let reference = format!("{registry}/imp-test/pause:1");
    let script = format!(
        ". {lib} && tar -cf {d}/layer.tar --mtime=@0 --owner=0 --group=0 --numeric-owner -C {d}/root pause \
         && oci_write_layout {d}/w {d}/layer.tar '\"Entrypoint\":[\"/pause\"]' 1 {d}/oci \
         && skopeo copy --quiet --dest-tls-verify=false oci:{d}/oci:1 docker://{reference}",
        lib = paths::workspace_root()
            .join("images/oci-layout.sh")
            .display(),
        d = dir.display(),
    );
    std::fs::create_dir_all(dir.join("w")).expect("pause work dir");
    node::run(Command::new("bash").args(["-c", &script])).expect("build and push the pause image");
    reference
}
