//! The chart on a real node (issues 20 and 35): a control plane with kube-scheduler and the workload
//! controllers, Debian's containerd + runc and the kubelet from testenv/ in a network namespace this test
//! creates (testkit::node). A release (scripts/release.sh: images and chart) pushed to a local registry
//! and installed from it with no image values: the operator, agent, runtime and KVM-preflight pods
//! become Ready on the release's images; `helm upgrade` from a previous chart version keeps the runtime
//! pod and a running VM (OnDelete); the local smoke's runner lifecycle completes through those pods
//! (lifecycle.rs: GitHub simulator webhook -> operator pod -> VM on the runtime pod -> JIT handoff by
//! the agent pod -> the fake runner completes the job -> VM and Secret gone, pool replenished), first on
//! the Firecracker simulator, then on `runtime.backend: qemu` with a real guest (qemu.rs; with the
//! reference base image, issue 31: a job of Docker steps, `docker build` FROM an image pulled through
//! the VM's NAT from a registry beyond the node's uplink, `docker run`, a service container reached by
//! name; then a job whose step exits 3 fails; both VMs replaced); `kubectl imp
//! console` shows each VM's console through the runtime pod; runbooks/uninstall.md, run as written,
//! leaves no Imp object, CRD, pod, container, link, nftables table, VM cgroup or state behind.
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
    runbook,
};
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, ResourceExt as _, api::ListParams};

#[path = "real_node/lifecycle.rs"]
mod lifecycle;
#[path = "real_node/qemu.rs"]
mod qemu;

const REQUIRE_ENV: &str = "IMP_REQUIRE_REAL_NODE";
/// The state directory under the work dir, short on purpose: a jailed VM's sockets live at
/// `<state>/jailer/imp-firecracker-sim/<vm uid>/root/vsock.sock_<port>`, and a Unix socket path
/// holds at most 107 bytes (with /tmp/imp-rn-XXXXXX/s: 105).
const STATE_SUBDIR: &str = "s";
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
    rt.block_on(scenario(&id, &netns));
    drop(rt);
    drop(entered);
    drop(netns);
}

async fn scenario(id: &str, netns: &node::NodeNetns) {
    let work = tempfile::Builder::new()
        .prefix("imp-rn-")
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
            ("kubectl-imp", "kubectl-imp"),
            // The node's "jailer" beside the simulator (agent.env.jailerPath).
            ("imp-testkit", "jailer-double"),
        ],
        &[
            "api",
            "common",
            "operator",
            "node",
            "testkit/src",
            "fake-runner/src",
            "kubectl-imp/src",
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
    // The release as a user publishes it (scripts/release.sh, `make release`): the three images (the
    // runtime's with QEMU), the chart with their repository and digests as defaults, pushed to the
    // registry. Then the same chart as a previous version, for the upgrade below.
    let t2 = Instant::now();
    let release_repo = format!("{reg}/imp-dev");
    let previous = "0.0.9-prev";
    let current = chart_version();
    let release_dir = work.join("release");
    let out = Command::new(paths::workspace_root().join("scripts/release.sh"))
        .args([
            "--registry",
            &release_repo,
            "--version",
            &current,
            "--plain-http",
        ])
        .arg("--out")
        .arg(&release_dir)
        .arg("--bin-dir")
        .arg(built[0].parent().expect("profile dir"))
        .arg("--guest")
        .arg(&static_guest)
        .output()
        .expect("run scripts/release.sh");
    assert!(
        out.status.success(),
        "scripts/release.sh --version {current}: {}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    let digests = std::fs::read_to_string(release_dir.join("digests")).unwrap_or_default();
    node::run(
        Command::new("tar")
            .arg("-xzf")
            .arg(release_dir.join(format!("imp-{current}.tgz")))
            .arg("-C")
            .arg(&work),
    )
    .expect("unpack the release's chart");
    let charts = work.join("charts");
    helm(
        &cp,
        &[
            "package",
            &work.join("imp").display().to_string(),
            "--version",
            previous,
            "--destination",
            &charts.display().to_string(),
        ],
    )
    .expect("helm package the previous version");
    helm(
        &cp,
        &[
            "push",
            &charts
                .join(format!("imp-{previous}.tgz"))
                .display()
                .to_string(),
            &format!("oci://{release_repo}/charts"),
            "--plain-http",
        ],
    )
    .expect("helm push the previous version");
    println!(
        "real_node: release {current} built and pushed to {release_repo} (and its chart as {previous}) in {:.1}s:\n{digests}",
        t2.elapsed().as_secs_f64(),
    );

    // The GitHub simulator beyond the node's uplink (node::UplinkPeer): the operator pod reaches it
    // through the node's routing, the simulated VMs (processes in the runtime pod, on the host network)
    // by the connected route, a real guest only through its network's NAT, as it would reach GitHub.
    let uplink = netns
        .uplink_peer(&format!("imp-gh-{id}"))
        .expect("the namespace beyond the node's uplink");
    let listener = {
        let _beyond = uplink.enter().expect("enter the uplink peer's namespace");
        std::net::TcpListener::bind((node::UPLINK_PEER_IP, 0)).expect("bind the simulator")
    };
    listener
        .set_nonblocking(true)
        .expect("non-blocking listener");
    let sim = GithubSim::start_listening(
        SimConfig {
            org: "acme".into(),
            repos: vec!["acme/app".into()],
            ..SimConfig::default()
        },
        tokio::net::TcpListener::from_std(listener).expect("tokio listener"),
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
        // Every Firecracker VM through the jailer (required by the chart): testkit's double, which
        // does the jailer's steps for real in the runtime pod (chroot, VM uid, cgroups, PID namespace).
        format!("agent.env.jailerPath={}", built[6].display()),
        // Not privileged: no VMM here opens /dev/kvm (the simulator; QEMU with TCG), and this node has
        // no device plugin for it. The runtime pod keeps only the chart's capability list.
        "kvm.access=none".into(),
        format!(
            "agent.hostPaths.socketDir.path={}",
            work.join("run-imp").display()
        ),
        format!(
            "agent.hostPaths.stateDir.path={}",
            work.join(STATE_SUBDIR).display()
        ),
        format!("runtime.vmCgroupParent={vm_cgroup_parent}"),
        format!("runtime.insecureRegistries[0]={reg}"),
        // The registry listens on the node itself: pulls may reach it only when it is allowed.
        format!("runtime.nodeLocalRegistries[0]={reg}"),
        // The node's namespace has no default route: the pool's network names its uplink, which
        // the platform must allow (node admission of ImpNetworks, docs/network.md).
        "runtime.network.allowedEgressInterfaces[0]=imp-node0".into(),
        // The cluster's pod and Service ranges: refused as VM subnets and denied to guests by default
        // (docs/network.md), as a platform admin sets them.
        format!("runtime.network.reservedCIDRs[0]={}", node::POD_CIDR),
        format!("runtime.network.reservedCIDRs[1]={}", node::SERVICE_CIDR),
        // No Prometheus Operator CRDs in this cluster.
        "metrics.serviceMonitor.enabled=false".into(),
        "metrics.podMonitor.enabled=false".into(),
    ];
    // Installed from oci:// with no image values: the release's chart names its own images.
    let chart_ref = format!("oci://{release_repo}/charts/imp");
    let seed = paths::reference_dir().join("seed-examples/helm-values-seed.yaml");
    let install_args = |version: &str, extra: &str, file: Option<&Path>| -> Vec<String> {
        let mut set = sets.join(",");
        if !extra.is_empty() {
            set = format!("{set},{extra}");
        }
        let mut args: Vec<String> = [
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
            &lifecycle_values.display().to_string(),
            "--set",
            &set,
            "--wait",
            "--timeout",
            "5m",
        ]
        .map(str::to_owned)
        .to_vec();
        if let Some(f) = file {
            args.extend(["-f".to_owned(), f.display().to_string()]);
        }
        args
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let t3 = Instant::now();
    let install = helm(&cp, &as_strs(&install_args(previous, "", None)));
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
    // Each component runs the release's own image, by digest, though no value named it.
    for component in ["operator", "agent", "runtime"] {
        let digest = digests
            .lines()
            .find_map(|l| l.strip_prefix(&format!("imp-{component} ")))
            .unwrap_or_else(|| panic!("no imp-{component} in the release's digests: {digests}"))
            .trim()
            .to_owned();
        let pod = ready_pod_on(&pods, component, &node_name).await;
        let image = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.image.clone())
            .unwrap_or_default();
        assert_eq!(
            image,
            format!("{release_repo}/imp-{component}@{digest}"),
            "the {component} pod does not run the release's image"
        );
    }
    let runtime_before = ready_pod_on(&pods, "runtime", &node_name).await;
    // The runtime runs with the chart's capability list, not privileged (docs/security.md).
    let state_env = format!("IMP_STATE_DIR={}", work.join(STATE_SUBDIR).display());
    let caps = runtime_cap_eff(&state_env).expect("the runtime pod's imp-runtime process");
    assert_eq!(
        caps, RUNTIME_CAPS,
        "CapEff of imp-runtime: {caps:#x}, the chart's list is {RUNTIME_CAPS:#x}"
    );
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
        pod_logs: real_node.dir().join("pod-logs"),
    };
    let (warm, jit_config) = life.warm_runner(&reg).await;

    // `kubectl imp console`: the guest's serial log, read through exec in the runtime pod (API server ->
    // kubelet -> containerd), with its JIT config never shown.
    console_shows(
        &built[5],
        &cp,
        &warm,
        &jit_config.expect("the warm runner's JIT config, read before its handoff"),
        "imp-guest: agent started",
    );

    // The upgrade changes the runtime's pod template; OnDelete keeps the running pod (and so its VMs).
    let t4 = Instant::now();
    if let Err(e) = helm(
        &cp,
        &as_strs(&install_args(
            &current,
            "runtime.serialLogCapBytes=4194304",
            None,
        )),
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
    life.job_through(
        &warm,
        &format!("http://{operator_ip}:8080"),
        lifecycle::JobRun::empty(),
        90,
        120,
    )
    .await;
    life.delete_pool().await;

    // The same release on `runtime.backend: qemu`: the runtime pod boots a real guest (TCG) from the
    // QEMU and vhost-device-vsock of its image; the job runs inside it.
    match imp_testkit::qemu::detect_with(static_guest.clone()) {
        Err(why) => imp_testkit::skip::skip_or_fail(
            "IMP_REQUIRE_QEMU",
            "real_node's qemu phase",
            &format!("this host cannot boot a real guest in the runtime pod: {why}"),
        ),
        Ok(setup) => {
            let t5 = Instant::now();
            let parts = qemu::build(&work, &reg, &target_dir, &setup);
            let qemu_values = work.join("qemu-values.yaml");
            std::fs::write(&qemu_values, qemu::VALUES).expect("write the qemu values");
            // The kernel and initrd as --set too: the test's --set of the placeholder kernel wins
            // over any values file.
            let kernel_sets = format!(
                "runtime.serialLogCapBytes=4194304,agent.env.kernelPath={},agent.env.initrdPath={}",
                parts.kernel.display(),
                parts.initrd.display()
            );
            let args = install_args(&current, &kernel_sets, Some(&qemu_values));
            if let Err(e) = helm(&cp, &as_strs(&args)) {
                panic!(
                    "helm upgrade to runtime.backend qemu: {e}\npods: {}",
                    describe_pods(&pods).await
                );
            }
            // OnDelete: the runtime pod takes the new template once it is deleted (docs/real-node.md).
            let old_runtime = ready_pod_on(&pods, "runtime", &node_name).await;
            pods.delete(&old_runtime.name_any(), &Default::default())
                .await
                .expect("delete the runtime pod");
            let deadline = Instant::now() + Duration::from_secs(180);
            while ready_pod_on(&pods, "runtime", &node_name)
                .await
                .metadata
                .uid
                == old_runtime.metadata.uid
            {
                assert!(
                    Instant::now() < deadline,
                    "no new runtime pod: {}",
                    describe_pods(&pods).await
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            println!(
                "real_node: guest parts built (kernel {}, initrd, busybox base, runner image) and the runtime pod \
                 moved to QEMU in {:.1}s",
                parts.kernel.display(),
                t5.elapsed().as_secs_f64()
            );
            // Issue 31: the guest boots the reference base image (Debian, dockerd started by the
            // runner wrapper) and runs Docker jobs; without its layout, the busybox base and an
            // empty job (SKIPPED said, or a failure under IMP_REQUIRE_BASE_IMAGE=1).
            let reference = qemu::docker::reference_layout();
            let internet_registry = reference.as_ref().map(|_| {
                qemu::docker::InternetRegistry::start(
                    &format!("imp-gh-{id}"),
                    &work.join("base-oci"),
                    "real-node-qemu",
                )
            });
            let (base, size, boot_secs) = match &reference {
                Some(layout) => (
                    qemu::docker::push_reference(layout, &reg),
                    qemu::docker::SIZE,
                    600,
                ),
                None => (parts.base_image.clone(), lifecycle::VmSize::SMALL, 420),
            };
            let t6 = Instant::now();
            let (guest, jit_config) = life
                .warm_runner_on(&base, &parts.runner_image, size, boot_secs)
                .await;
            let warm_secs = t6.elapsed().as_secs_f64();
            console_shows(
                &built[5],
                &cp,
                &guest,
                &jit_config.expect("the guest runner's JIT config, read before its handoff"),
                "Linux version",
            );
            let operator_url = format!("http://{operator_ip}:8080");
            if reference.is_some() {
                let agent_runtime: Vec<Pod> = {
                    let mut v = Vec::new();
                    for component in ["agent", "runtime"] {
                        v.push(ready_pod_on(&pods, component, &node_name).await);
                    }
                    v
                };
                qemu::docker::assert_pods_give_docker_nothing(
                    &agent_runtime,
                    &real_node.pod_pids(),
                    &work.join("run-imp"),
                );
                // The job's own output (the runner's stdout is the guest's console) while it runs:
                // the VM is deleted moments after its runner exits.
                let console = ConsoleTail::start(&built[5], &cp, &guest, &vm_cgroup_parent);
                let t7 = Instant::now();
                let (done, replacement) = life
                    .job_through(&guest, &operator_url, qemu::docker::job(), 600, boot_secs)
                    .await;
                let docker_job_secs = done
                    .completed_at
                    .zip(done.started_at)
                    .map(|(c, s)| (c - s).num_milliseconds() as f64 / 1000.0);
                let (seen, peak) = console.stop();
                qemu::docker::assert_steps(&done, &["success"; 5]);
                println!(
                    "real_node: MEASURE reference-base guest: pool applied -> runner Started {warm_secs:.1}s; \
                     Docker job (queued -> replaced {:.1}s) ran {docker_job_secs:?}s by the simulator's record; \
                     the VM's memory cgroup peaked at {} MiB (class {} MiB); from the guest's console:\n{}",
                    t7.elapsed().as_secs_f64(),
                    peak >> 20,
                    qemu::docker::SIZE.memory_mib,
                    seen.lines()
                        .filter(|l| [
                            "imp-start-dockerd",
                            "docker build:",
                            "docker run:",
                            "service pair:",
                            "IMP-DOCKER-BUILD-MARKER",
                            "dockerd uid 0",
                        ]
                        .iter()
                        .any(|k| l.contains(k)))
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                let t8 = Instant::now();
                let (failed, _) = life
                    .job_through(
                        &replacement,
                        &operator_url,
                        qemu::docker::failing_job(),
                        300,
                        boot_secs,
                    )
                    .await;
                qemu::docker::assert_steps(&failed, &["failure", "skipped"]);
                println!(
                    "real_node: the job whose step exits 3 failed (steps failure, skipped); its VM torn down \
                     and replaced {:.1}s after it was queued",
                    t8.elapsed().as_secs_f64()
                );
            } else {
                life.job_through(
                    &guest,
                    &operator_url,
                    lifecycle::JobRun::empty(),
                    90,
                    boot_secs,
                )
                .await;
            }
            life.delete_pool().await;
            drop(internet_registry);
        }
    }

    // Uninstall as runbooks/uninstall.md says, its blocks run as written: pools and objects first, the
    // chart, then (after the checks below) the CRDs and each node's host state.
    let uninstall = Uninstall {
        cp: &cp,
        node: &node_name,
        work: &work,
        vm_cgroup_parent: &vm_cgroup_parent,
    };
    uninstall.section(1);
    uninstall.section(2);
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
    let taps: Vec<String> = imp_links()
        .into_iter()
        .filter(|n| !n.starts_with("impbr"))
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
    uninstall.section(3);
    let crds = kubectl(&cp, &["get", "crd", "-o", "name"]).expect("list CRDs");
    assert!(
        !crds.contains("imp.dev"),
        "Imp's CRDs left after uninstall.md section 3: {crds}"
    );
    uninstall.section(4);
    let links = imp_links();
    assert!(
        links.is_empty(),
        "Imp links left after uninstall.md: {links:?}"
    );
    let tables = node::run(Command::new("nft").args(["list", "tables"])).expect("nft list tables");
    assert!(
        !tables
            .split_whitespace()
            .any(|w| w == "imp" || w == "imp_wake"),
        "nftables tables left after uninstall.md: {tables}"
    );
    for dir in [STATE_SUBDIR, "run-imp"] {
        assert!(
            !work.join(dir).exists(),
            "the node's {dir} is left after uninstall.md section 4"
        );
    }
    println!(
        "real_node: uninstall.md sections 1-4 as written: no object, CRD, pod, container, link, nftables table, cgroup or state left"
    );
    drop(real_node);
    drop(registry);
    drop(cp);
    drop(sim);
    drop(uplink);
    let _ = std::fs::remove_dir_all(&work);
}

/// Imp's links in the node's namespace: bridges `impbr<hex>` and TAPs `imp<hex>` (the test's own
/// `imp-node0` and `imp-cni0` aside).
fn imp_links() -> Vec<String> {
    node::run(Command::new("ip").args(["-o", "link", "show"]))
        .expect("ip link show")
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .filter(|n| {
            let hex = n.strip_prefix("impbr").or_else(|| n.strip_prefix("imp"));
            hex.is_some_and(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_hexdigit()))
        })
        .collect()
}

/// `kubectl imp console VM`, run every few seconds on a thread of its own until stopped; keeps the
/// last output it got (the VM and its console go away moments after its runner exits), and the
/// VM's memory cgroup's peak (guest memory and QEMU's own: its TCG translation cache, its heap).
struct ConsoleTail {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(String, u64)>,
}

impl ConsoleTail {
    fn start(
        kubectl_imp: &Path,
        cp: &ControlPlane,
        vm: &imp_api::ImpVM,
        vm_cgroup_parent: &str,
    ) -> ConsoleTail {
        // cgroup v2's memory.peak, v1's memory.max_usage_in_bytes (the node runs v1).
        let peak_files: Vec<PathBuf> = node::cgroup_hierarchies()
            .into_iter()
            .flat_map(|h| {
                let dir = h
                    .join(vm_cgroup_parent)
                    .join(vm.metadata.uid.clone().unwrap_or_default());
                [
                    dir.join("memory.peak"),
                    dir.join("memory.max_usage_in_bytes"),
                ]
            })
            .collect();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let mut cmd = Command::new(kubectl_imp);
        cmd.args(["console", &vm.name_any(), "-n", lifecycle::RUNNER_NAMESPACE])
            .args(["--imp-namespace", NAMESPACE])
            .env("KUBECONFIG", cp.kubeconfig_path());
        let thread = std::thread::spawn(move || {
            let mut last = String::new();
            let mut peak = 0u64;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(out) = cmd.output()
                    && out.status.success()
                {
                    last = String::from_utf8_lossy(&out.stdout).into_owned();
                }
                for f in &peak_files {
                    if let Ok(v) = std::fs::read_to_string(f)
                        && let Ok(v) = v.trim().parse::<u64>()
                    {
                        peak = peak.max(v);
                    }
                }
                for _ in 0..20 {
                    if flag.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
            }
            (last, peak)
        });
        ConsoleTail { stop, thread }
    }

    /// The last console output and the cgroup's peak, bytes (0: not readable).
    fn stop(self) -> (String, u64) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// `kubectl imp console VM` prints the VM's console, `expected` among it, and never its JIT config.
fn console_shows(
    kubectl_imp: &Path,
    cp: &ControlPlane,
    vm: &imp_api::ImpVM,
    jit: &str,
    expected: &str,
) {
    let name = vm.name_any();
    let out = Command::new(kubectl_imp)
        .args(["console", &name, "-n", lifecycle::RUNNER_NAMESPACE])
        .args(["--imp-namespace", NAMESPACE])
        .env("KUBECONFIG", cp.kubeconfig_path())
        .output()
        .expect("run kubectl-imp console");
    let shown = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && shown.contains(expected),
        "kubectl imp console {name}: exit {:?}, no {expected:?} in:\n{shown}\n{err}",
        out.status.code(),
    );
    assert!(
        !shown.contains(jit) && !err.contains(jit),
        "kubectl imp console {name} showed the JIT config"
    );
    println!(
        "real_node: kubectl imp console {name}: {} lines of the guest's console through the runtime pod \
         ({expected:?} among them), no JIT config",
        shown.lines().count()
    );
}

/// runbooks/uninstall.md's shell blocks, run section by section against this cluster and node, the
/// host paths of the runbook (`/var/lib/imp`, `/run/imp`, the `imp-vms` cgroup parent) replaced by the
/// test's own; a block that fails fails the test.
struct Uninstall<'a> {
    cp: &'a ControlPlane,
    node: &'a str,
    work: &'a Path,
    vm_cgroup_parent: &'a str,
}

impl Uninstall<'_> {
    fn section(&self, n: u32) {
        let page = "uninstall.md";
        let text = std::fs::read_to_string(paths::workspace_root().join("runbooks").join(page))
            .expect("runbooks/uninstall.md");
        let lines = runbook::section_lines(&text, &format!("{n}. "))
            .unwrap_or_else(|| panic!("runbooks/uninstall.md has no section \"## {n}. \""));
        let script: String = runbook::sh_blocks(page, &text)
            .unwrap_or_else(|e| panic!("runbooks/{e}"))
            .into_iter()
            .filter(|b| lines.contains(&b.line))
            .map(|b| b.script)
            .collect();
        assert!(
            !script.is_empty(),
            "uninstall.md section {n} has no sh block"
        );
        let script = script
            .replace(
                "/var/lib/imp",
                &self.work.join(STATE_SUBDIR).display().to_string(),
            )
            .replace("/run/imp", &self.work.join("run-imp").display().to_string())
            .replace("/imp-vms", &format!("/{}", self.vm_cgroup_parent));
        for host_path in ["/var/lib/imp", "/run/imp", "/imp-vms "] {
            assert!(
                !script.contains(host_path),
                "uninstall.md section {n} still names the host's {host_path} after replacement:\n{script}"
            );
        }
        let path = format!(
            "{}:{}",
            paths::testenv_bin_dir().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = with_cluster(self.cp, "bash")
            .args(["-euo", "pipefail", "-c", &script])
            .env("PATH", path)
            .env("NODE", self.node)
            .output()
            .expect("run bash");
        assert!(
            out.status.success(),
            "uninstall.md section {n} failed:\n{script}\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!(
            "real_node: uninstall.md section {n}:\n{}",
            String::from_utf8_lossy(&out.stdout).trim_end()
        );
    }
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

/// The capabilities of the chart's runtime container (helm/imp/templates/node.yaml): NET_ADMIN 12,
/// SYS_ADMIN 21, SYS_CHROOT 18, MKNOD 27, SETUID 7, SETGID 6, SETPCAP 8, CHOWN 0, FOWNER 3,
/// DAC_OVERRIDE 1, KILL 5, SYS_PTRACE 19.
const RUNTIME_CAPS: u64 = (1 << 12)
    | (1 << 21)
    | (1 << 18)
    | (1 << 27)
    | (1 << 7)
    | (1 << 6)
    | (1 << 8)
    | 1
    | (1 << 3)
    | (1 << 1)
    | (1 << 5)
    | (1 << 19);

/// CapEff of the imp-runtime process whose environment holds `state_env` (this test's runtime pod,
/// not another one on the machine).
fn runtime_cap_eff(state_env: &str) -> Option<u64> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|p| {
        let cmdline = std::fs::read(p.path().join("cmdline")).ok()?;
        let argv0 = cmdline.split(|b| *b == 0).next()?;
        if !argv0.ends_with(b"imp-runtime") {
            return None;
        }
        let environ = std::fs::read(p.path().join("environ")).ok()?;
        if !environ
            .split(|b| *b == 0)
            .any(|e| e == state_env.as_bytes())
        {
            return None;
        }
        let status = std::fs::read_to_string(p.path().join("status")).ok()?;
        let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
        u64::from_str_radix(hex.trim(), 16).ok()
    })
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

/// `program` with the control plane's kubeconfig and helm's directories under it.
fn with_cluster(cp: &ControlPlane, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    cmd.env("KUBECONFIG", cp.kubeconfig_path())
        .env("HELM_CACHE_HOME", cp.dir().join("helm/cache"))
        .env("HELM_CONFIG_HOME", cp.dir().join("helm/config"))
        .env("HELM_DATA_HOME", cp.dir().join("helm/data"));
    cmd
}

fn tool(cp: &ControlPlane, name: &str, args: &[&str]) -> Result<String, String> {
    let out = with_cluster(cp, paths::testenv_bin(name))
        .args(args)
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
