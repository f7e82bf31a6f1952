//! The Helm chart against seeds 000 and 001: `helm template` with the seed values files and the negative
//! cases (required kernelPath/fcBinPath/jailerPath, digest pins, monitors on by default and off with their toggles,
//! the KVM preflight and its nodeSelector, the webhook Service/Ingress), and `helm install` of the
//! digest-pinned production values into the test API server.

use std::{
    path::PathBuf,
    process::{Command, Output},
};

use imp_testkit::{TestEnv, paths};
use serde::Deserialize;
use serde_json::Value;

const RELEASE: &str = "imp";
const NAMESPACE: &str = "imp-system";
const OPERATOR_DIGEST: &str =
    "sha256:1111111111111111111111111111111111111111111111111111111111111111";
const AGENT_DIGEST: &str =
    "sha256:2222222222222222222222222222222222222222222222222222222222222222";
const RUNTIME_DIGEST: &str =
    "sha256:3333333333333333333333333333333333333333333333333333333333333333";

/// Seed 001's values-production.yaml: the seed's images pinned by digest (runtime added: every image).
fn production_values() -> String {
    format!(
        "agent:\n  env:\n    kernelPath: /var/lib/imp/vmlinux\n    fcBinPath: /usr/local/bin/firecracker\n    jailerPath: /usr/local/bin/jailer\n  image:\n    digest: {AGENT_DIGEST}\noperator:\n  image:\n    digest: {OPERATOR_DIGEST}\nruntime:\n  image:\n    digest: {RUNTIME_DIGEST}\n"
    )
}

fn seed_values(name: &str) -> PathBuf {
    let p = paths::reference_dir().join("seed-examples").join(name);
    assert!(p.is_file(), "seed values file {} is missing", p.display());
    p
}

/// A values file written from `text`; the directory lives as long as the returned guard.
fn values_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("values.yaml");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs `cmd`, which must succeed; its output.
fn run_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(out.status.success(), "{what}: {}", output_text(&out));
    out
}

/// `helm template` with the values files in order: the rendered objects, or helm's error output.
fn render(files: &[&PathBuf], sets: &[&str]) -> Result<Vec<Value>, String> {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(paths::testenv_bin("helm"));
    cmd.env("HELM_CACHE_HOME", home.path().join("cache"))
        .env("HELM_CONFIG_HOME", home.path().join("config"))
        .env("HELM_DATA_HOME", home.path().join("data"))
        .args(["template", RELEASE])
        .arg(paths::chart_dir())
        .args(["--namespace", NAMESPACE]);
    for f in files {
        cmd.arg("-f").arg(f);
    }
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", paths::testenv_bin("helm").display()));
    if !out.status.success() {
        return Err(output_text(&out));
    }
    let text = String::from_utf8(out.stdout).unwrap();
    let mut objects = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v = Value::deserialize(doc).unwrap();
        if !v.is_null() {
            objects.push(v);
        }
    }
    Ok(objects)
}

fn render_ok(files: &[&PathBuf], sets: &[&str]) -> Vec<Value> {
    render(files, sets).unwrap_or_else(|e| panic!("helm template {files:?} {sets:?}: {e}"))
}

/// The merged seed with `sets` must be refused, and helm's error must name `field`.
fn assert_seed_rejected_naming(sets: &[&str], field: &str) {
    let err = render(&[&seed_values("helm-values-seed.yaml")], sets)
        .expect_err(&format!("the seed values with {sets:?} must be refused"));
    assert!(err.contains(field), "error names {field}: {err}");
}

/// The image of container `c` in the pod template's `list` of workload `kind`/`name`.
fn image_of(objects: &[Value], kind: &str, name: &str, list: &str, c: &str) -> String {
    container(get(objects, kind, name), list, c)["image"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
}

fn get<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    find(objects, kind, name).unwrap_or_else(|| {
        let have: Vec<String> = objects
            .iter()
            .map(|o| format!("{}/{}", o["kind"], o["metadata"]["name"]))
            .collect();
        panic!("no {kind}/{name} rendered; have {have:?}")
    })
}

fn kinds(objects: &[Value], kind: &str) -> Vec<String> {
    objects
        .iter()
        .filter(|o| o["kind"] == kind)
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_owned())
        .collect()
}

/// The pod template's container (or init container) `name` of a workload.
fn container<'a>(workload: &'a Value, list: &str, name: &str) -> &'a Value {
    workload["spec"]["template"]["spec"][list]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no {list} {name} in {}", workload["metadata"]["name"]))
}

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
}

#[test]
fn seed_values_render_every_seed_point() {
    let objects = render_ok(&[&seed_values("helm-values-seed.yaml")], &[]);

    // Monitors: the seed enables them with interval 30s.
    let sm = get(&objects, "ServiceMonitor", "imp-operator");
    assert_eq!(sm["spec"]["endpoints"][0]["interval"], "30s");
    assert_eq!(
        sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
        "operator"
    );
    for component in ["agent", "runtime"] {
        let pm = get(&objects, "PodMonitor", &format!("imp-{component}"));
        assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["interval"], "30s");
        assert_eq!(
            pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
            component
        );
    }

    // Agent: nodeSelector, extraEnv, the socket directory.
    let agent = get(&objects, "DaemonSet", "imp-agent");
    assert_eq!(
        agent["spec"]["template"]["spec"]["nodeSelector"]["imp/enabled"],
        "true"
    );
    let agent_c = container(agent, "containers", "agent");
    assert_eq!(env_value(agent_c, "IMP_SCALE_TO_ZERO"), Some("true"));
    assert_eq!(
        env_value(agent_c, "IMP_RUNTIME_SOCKET"),
        Some("/run/imp/runtime.sock")
    );
    assert!(
        agent_c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["mountPath"] == "/run/imp"),
        "agent mounts the socket dir: {agent_c}"
    );

    // pressureLifecycle.enabled reaches the operator.
    let operator = get(&objects, "Deployment", "imp-operator");
    assert_eq!(
        env_value(
            container(operator, "containers", "operator"),
            "IMP_PRESSURE_LIFECYCLE"
        ),
        Some("true")
    );

    // Runtime: OnDelete, the kernel and the Firecracker binary from the values, the binary mounted.
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    assert_eq!(runtime["spec"]["updateStrategy"]["type"], "OnDelete");
    let runtime_c = container(runtime, "containers", "runtime");
    assert_eq!(
        env_value(runtime_c, "IMP_FIRECRACKER_BIN"),
        Some("/usr/local/bin/firecracker")
    );
    assert_eq!(
        env_value(runtime_c, "IMP_KERNEL"),
        Some("/var/lib/imp/vmlinux")
    );
    let fc_mount = runtime_c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/usr/local/bin/firecracker")
        .unwrap_or_else(|| panic!("runtime mounts the Firecracker binary: {runtime_c}"));
    assert_eq!(fc_mount["readOnly"], true);
    let fc_volume = runtime["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == fc_mount["name"])
        .unwrap();
    assert_eq!(
        fc_volume["hostPath"],
        serde_json::json!({"path": "/usr/local/bin/firecracker", "type": "File"})
    );

    // The webhook receiver has its own Service; no Ingress unless asked.
    let svc = get(&objects, "Service", "imp-webhook");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "http");
    assert!(kinds(&objects, "Ingress").is_empty());
}

/// The runtime DaemonSet gives VMs a life of their own: host PID namespace, the host's cgroup
/// tree mounted for per-VM cgroups under the configured parent, OnDelete rolls, and the VMM
/// backend from the values (an unknown one refused by the schema).
#[test]
fn runtime_daemonset_lets_vms_outlive_its_pod() {
    let seed = seed_values("helm-values-seed.yaml");
    let objects = render_ok(&[&seed], &[]);
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    assert_eq!(runtime["spec"]["updateStrategy"]["type"], "OnDelete");
    let pod = &runtime["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], true, "{pod}");
    let c = container(runtime, "containers", "runtime");
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/host/sys/fs/cgroup")
        .unwrap_or_else(|| panic!("the runtime mounts the host cgroup tree: {c}"));
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(
        volume["hostPath"],
        serde_json::json!({"path": "/sys/fs/cgroup", "type": "Directory"})
    );
    assert_eq!(
        env_value(c, "IMP_VM_CGROUP_ROOT"),
        Some("/host/sys/fs/cgroup")
    );
    assert_eq!(env_value(c, "IMP_VM_CGROUP_PARENT"), Some("imp-vms"));
    assert_eq!(env_value(c, "IMP_VMM_BACKEND"), Some("firecracker"));

    let objects = render_ok(
        &[&seed],
        &[
            "runtime.backend=qemu",
            "runtime.vmCgroupParent=kubepods.slice/imp",
            "runtime.serialLogCapBytes=65536",
        ],
    );
    let c = container(
        get(&objects, "DaemonSet", "imp-runtime"),
        "containers",
        "runtime",
    );
    assert_eq!(env_value(c, "IMP_VMM_BACKEND"), Some("qemu"));
    assert_eq!(
        env_value(c, "IMP_VM_CGROUP_PARENT"),
        Some("kubepods.slice/imp")
    );
    assert_eq!(env_value(c, "IMP_SERIAL_LOG_CAP_BYTES"), Some("65536"));
    assert_seed_rejected_naming(&["runtime.backend=cloud-hypervisor"], "backend");
    assert_seed_rejected_naming(&["runtime.vmCgroupParent=/abs"], "vmCgroupParent");
    assert_seed_rejected_naming(&["runtime.serialLogCapBytes=100"], "serialLogCapBytes");
}

/// The VMM opens the guest kernel (and initrd) inside the runtime container: both are mounted read-only
/// from the node when they are outside the state directory (mounted already; the seed's kernel is there,
/// and a File hostPath would hold the pod until the kernel exists). runtime.extraEnv, extraVolumes and extraVolumeMounts reach the
/// runtime container and its pod (the real-node test mounts the fake runner this way).
#[test]
fn runtime_mounts_the_kernel_and_takes_extra_env_and_volumes() {
    let seed = seed_values("helm-values-seed.yaml");
    let (_dir, extra) = values_file(
        "agent:\n  env:\n    kernelPath: /opt/imp/vmlinux\n    initrdPath: /opt/imp/initrd.img\n\
         runtime:\n  extraEnv:\n    - {name: IMP_BOOT_TIMEOUT, value: 60s}\n\
         \x20 extraVolumes:\n    - {name: tools, hostPath: {path: /opt/tools, type: Directory}}\n\
         \x20 extraVolumeMounts:\n    - {name: tools, mountPath: /opt/tools, readOnly: true}\n",
    );
    let objects = render_ok(&[&seed, &extra], &[]);
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    let c = container(runtime, "containers", "runtime");
    let volumes = runtime["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap();
    for (path, kind) in [
        ("/opt/imp/vmlinux", "File"),
        ("/opt/imp/initrd.img", "File"),
        ("/opt/tools", "Directory"),
    ] {
        let mount = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"] == path)
            .unwrap_or_else(|| panic!("the runtime container mounts {path}: {c}"));
        assert_eq!(mount["readOnly"], true, "{mount}");
        let volume = volumes
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap_or_else(|| panic!("no volume {} in {volumes:?}", mount["name"]));
        assert_eq!(
            volume["hostPath"],
            serde_json::json!({"path": path, "type": kind})
        );
    }
    assert_eq!(env_value(c, "IMP_BOOT_TIMEOUT"), Some("60s"));
    assert_eq!(env_value(c, "IMP_KERNEL"), Some("/opt/imp/vmlinux"));
    assert_seed_rejected_naming(&["runtime.extraVolumeMounts[0].name=x"], "mountPath");
    let objects = render_ok(&[&seed], &[]);
    // The agent connects to root's sockets (the runtime's, the VMs' vsock): uid 0, no capability.
    let agent = container(
        get(&objects, "DaemonSet", "imp-agent"),
        "containers",
        "agent",
    );
    assert_eq!(agent["securityContext"]["runAsUser"], 0, "{agent}");
    assert_eq!(
        agent["securityContext"]["capabilities"]["drop"],
        serde_json::json!(["ALL"])
    );
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    let volumes = runtime["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap();
    assert!(
        !volumes.iter().any(|v| v["name"] == "kernel"),
        "the seed's kernel is in the state directory, mounted already: {volumes:?}"
    );
}

#[test]
fn kvm_preflight_is_rendered_with_its_node_selector() {
    let objects = render_ok(&[&seed_values("helm-values-seed.yaml")], &[]);
    let ds = get(&objects, "DaemonSet", "imp-kvm-preflight");
    let spec = &ds["spec"]["template"]["spec"];
    assert_eq!(
        spec["nodeSelector"],
        serde_json::json!({"imp/enabled": "true"})
    );
    let check = container(ds, "initContainers", "check-kvm");
    let script = check["command"][2].as_str().unwrap();
    assert!(
        script.contains("/dev/kvm") && script.contains("exit 1"),
        "the check fails naming /dev/kvm: {script}"
    );
    assert_eq!(
        check["image"],
        format!("ghcr.io/imp-dev/imp-runtime:{}", chart_app_version())
    );

    // Its own selector, apart from the agent's; and it can be switched off.
    let objects = render_ok(
        &[&seed_values("helm-values-seed.yaml")],
        &["kvm.preflight.nodeSelector.kvm=yes"],
    );
    assert_eq!(
        get(&objects, "DaemonSet", "imp-kvm-preflight")["spec"]["template"]["spec"]["nodeSelector"],
        serde_json::json!({"imp/enabled": "true", "kvm": "yes"})
    );
    assert_eq!(
        get(&objects, "DaemonSet", "imp-agent")["spec"]["template"]["spec"]["nodeSelector"],
        serde_json::json!({"imp/enabled": "true"})
    );
    let objects = render_ok(
        &[&seed_values("helm-values-seed.yaml")],
        &["kvm.preflight.enabled=false"],
    );
    assert!(find(&objects, "DaemonSet", "imp-kvm-preflight").is_none());
}

fn chart_app_version() -> String {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Chart {
        app_version: String,
    }
    let text = std::fs::read_to_string(paths::chart_dir().join("Chart.yaml")).unwrap();
    serde_yaml::from_str::<Chart>(&text).unwrap().app_version
}

#[test]
fn kernel_path_and_fc_bin_path_are_required() {
    // Seed 000's no-monitors file alone names no fcBinPath: rejected, naming it.
    let err = render(&[&seed_values("helm-values-no-monitors.yaml")], &[])
        .expect_err("a values file without agent.env.fcBinPath must be rejected");
    assert!(err.contains("fcBinPath"), "error names fcBinPath: {err}");
    assert!(!err.contains("kernelPath"), "kernelPath was given: {err}");

    let (_d, only_fc) = values_file("agent:\n  env:\n    fcBinPath: /usr/local/bin/firecracker\n");
    let err = render(&[&only_fc], &[])
        .expect_err("a values file without agent.env.kernelPath must be rejected");
    assert!(err.contains("kernelPath"), "error names kernelPath: {err}");
    assert!(!err.contains("fcBinPath"), "fcBinPath was given: {err}");

    let (_d, neither) = values_file("agent:\n  nodeSelector: {imp/enabled: \"true\"}\n");
    let err = render(&[&neither], &[]).expect_err("no kernelPath, no fcBinPath");
    assert!(
        err.contains("kernelPath") && err.contains("fcBinPath"),
        "error names both: {err}"
    );

    // An empty path is no path.
    assert_seed_rejected_naming(&["agent.env.kernelPath="], "kernelPath");
    assert_seed_rejected_naming(&["agent.env.fcBinPath="], "fcBinPath");
    // The jailer is required beside Firecracker: no unjailed Firecracker from the chart.
    assert_seed_rejected_naming(&["agent.env.jailerPath="], "jailerPath");
    let (_d, no_jailer) = values_file(
        "agent:\n  env:\n    kernelPath: /var/lib/imp/vmlinux\n    fcBinPath: /usr/local/bin/firecracker\n",
    );
    let err = render(&[&no_jailer], &[]).expect_err("Firecracker without its jailer");
    assert!(err.contains("jailerPath"), "error names jailerPath: {err}");
}

/// fcBinPath is the Firecracker backend's: with `backend: qemu` it is not required, and the runtime pod
/// neither mounts nor names a Firecracker binary (QEMU and vhost-device-vsock come with its image).
#[test]
fn the_qemu_backend_needs_no_firecracker_binary() {
    let (_d, qemu) = values_file(
        "agent:\n  env:\n    kernelPath: /var/lib/imp/vmlinux\nruntime:\n  backend: qemu\n",
    );
    let objects = render_ok(&[&qemu], &[]);
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    let c = container(runtime, "containers", "runtime");
    assert_eq!(env_value(c, "IMP_VMM_BACKEND"), Some("qemu"));
    assert_eq!(env_value(c, "IMP_FIRECRACKER_BIN"), None);
    let text = serde_json::to_string(runtime).unwrap();
    assert!(
        !text.contains("firecracker"),
        "no Firecracker volume or mount: {text}"
    );

    assert!(!text.contains("jailer"), "no jailer either: {text}");

    let (_d, fc) = values_file("agent:\n  env:\n    kernelPath: /var/lib/imp/vmlinux\n");
    let err = render(&[&fc], &[]).expect_err("the default backend, firecracker, needs fcBinPath");
    assert!(
        err.contains("fcBinPath") && err.contains("jailerPath"),
        "error names fcBinPath and jailerPath: {err}"
    );
}

/// The runtime container is not privileged (kvm.access deviceResource, the default): every
/// capability dropped but the listed ones (docs/security.md, "What imp-runtime keeps"), one unit of the device plugin's KVM resource and no /dev/kvm hostPath; the
/// preflight asks for the same resource and runs without capabilities. kvm.access privileged is the
/// named exception; none drops /dev/kvm altogether.
#[test]
fn the_runtime_keeps_only_its_listed_capabilities() {
    let objects = render_ok(&[&seed_values("helm-values-seed.yaml")], &[]);
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    let c = container(runtime, "containers", "runtime");
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], false, "{sc}");
    // pivot_root (every jail) is outside the container runtime's default profile.
    assert_eq!(sc["seccompProfile"]["type"], "Unconfined", "{sc}");
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    let mut added: Vec<&str> = sc["capabilities"]["add"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    added.sort_unstable();
    assert_eq!(
        added,
        [
            "CHOWN",
            "DAC_OVERRIDE",
            "FOWNER",
            "KILL",
            "MKNOD",
            "NET_ADMIN",
            "SETGID",
            "SETPCAP",
            "SETUID",
            "SYS_ADMIN",
            "SYS_CHROOT",
            "SYS_PTRACE"
        ]
    );
    // Each one is documented, with its reason.
    let security =
        std::fs::read_to_string(paths::workspace_root().join("docs/security.md")).unwrap();
    for cap in &added {
        assert!(
            security.contains(&format!("`CAP_{cap}`")),
            "docs/security.md explains CAP_{cap}"
        );
    }
    assert_eq!(
        c["resources"]["limits"]["devices.kubevirt.io/kvm"], 1,
        "{c}"
    );
    let text = serde_json::to_string(runtime).unwrap();
    assert!(
        !text.contains("\"/dev/kvm\""),
        "no /dev/kvm hostPath: {text}"
    );
    let preflight = get(&objects, "DaemonSet", "imp-kvm-preflight");
    let check = container(preflight, "initContainers", "check-kvm");
    assert_eq!(
        check["securityContext"]["capabilities"]["drop"],
        serde_json::json!(["ALL"])
    );
    assert_eq!(
        check["resources"]["limits"]["devices.kubevirt.io/kvm"], 1,
        "{check}"
    );
    assert!(
        !serde_json::to_string(preflight)
            .unwrap()
            .contains("privileged")
    );

    let objects = render_ok(
        &[&seed_values("helm-values-seed.yaml")],
        &["kvm.access=privileged"],
    );
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    let c = container(runtime, "containers", "runtime");
    assert_eq!(c["securityContext"]["privileged"], true);
    assert!(
        c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["mountPath"] == "/dev/kvm")
    );
    let check = container(
        get(&objects, "DaemonSet", "imp-kvm-preflight"),
        "initContainers",
        "check-kvm",
    );
    assert_eq!(check["securityContext"]["privileged"], true);

    let objects = render_ok(
        &[&seed_values("helm-values-seed.yaml")],
        &["kvm.access=none"],
    );
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    let c = container(runtime, "containers", "runtime");
    assert_eq!(c["securityContext"]["privileged"], false);
    let text = serde_json::to_string(runtime).unwrap();
    assert!(!text.contains("kvm"), "no /dev/kvm in any form: {text}");
}

#[test]
fn digests_pin_every_image() {
    let (_d, production) = values_file(&production_values());
    let objects = render_ok(&[&production], &[]);
    let image =
        |kind: &str, name: &str, list: &str, c: &str| image_of(&objects, kind, name, list, c);
    assert_eq!(
        image("Deployment", "imp-operator", "containers", "operator"),
        format!("ghcr.io/imp-dev/imp-operator@{OPERATOR_DIGEST}")
    );
    assert_eq!(
        image("DaemonSet", "imp-agent", "containers", "agent"),
        format!("ghcr.io/imp-dev/imp-agent@{AGENT_DIGEST}")
    );
    assert_eq!(
        image("DaemonSet", "imp-runtime", "containers", "runtime"),
        format!("ghcr.io/imp-dev/imp-runtime@{RUNTIME_DIGEST}")
    );
    // The preflight runs the runtime image, pinned the same way.
    for (list, c) in [("initContainers", "check-kvm"), ("containers", "ready")] {
        assert_eq!(
            image("DaemonSet", "imp-kvm-preflight", list, c),
            format!("ghcr.io/imp-dev/imp-runtime@{RUNTIME_DIGEST}")
        );
    }

    // Without a digest: repository:tag, each part overridable per component.
    let objects = render_ok(
        &[&seed_values("helm-values-seed.yaml")],
        &[
            "image.tag=9.9.9",
            "agent.image.repository=registry.example/imp/agent",
            "runtime.image.tag=1.2.3",
        ],
    );
    let image = |kind: &str, name: &str, c: &str| image_of(&objects, kind, name, "containers", c);
    assert_eq!(
        image("Deployment", "imp-operator", "operator"),
        "ghcr.io/imp-dev/imp-operator:9.9.9"
    );
    assert_eq!(
        image("DaemonSet", "imp-agent", "agent"),
        "registry.example/imp/agent:9.9.9"
    );
    assert_eq!(
        image("DaemonSet", "imp-runtime", "runtime"),
        "ghcr.io/imp-dev/imp-runtime:1.2.3"
    );

    // A digest that is no sha256 digest.
    assert_seed_rejected_naming(&["operator.image.digest=latest"], "/operator/image/digest");
}

#[test]
fn monitors_are_on_by_default_and_off_with_their_toggles() {
    let (_d, required) = values_file(
        "agent:\n  env:\n    kernelPath: /var/lib/imp/vmlinux\n    fcBinPath: /usr/local/bin/firecracker\n    jailerPath: /usr/local/bin/jailer\n",
    );
    let objects = render_ok(&[&required], &[]);
    assert_eq!(kinds(&objects, "ServiceMonitor"), ["imp-operator"]);
    assert_eq!(kinds(&objects, "PodMonitor"), ["imp-agent", "imp-runtime"]);

    // Seed 000's no-monitors file over the required values: neither kind.
    let objects = render_ok(
        &[&required, &seed_values("helm-values-no-monitors.yaml")],
        &[],
    );
    assert!(kinds(&objects, "ServiceMonitor").is_empty());
    assert!(kinds(&objects, "PodMonitor").is_empty());

    // Each toggle alone, and the interval.
    let objects = render_ok(
        &[&required],
        &[
            "metrics.serviceMonitor.enabled=false",
            "metrics.podMonitor.interval=15s",
        ],
    );
    assert!(kinds(&objects, "ServiceMonitor").is_empty());
    assert_eq!(
        get(&objects, "PodMonitor", "imp-runtime")["spec"]["podMetricsEndpoints"][0]["interval"],
        "15s"
    );
    let objects = render_ok(&[&required], &["metrics.podMonitor.enabled=false"]);
    assert_eq!(kinds(&objects, "ServiceMonitor"), ["imp-operator"]);
    assert!(kinds(&objects, "PodMonitor").is_empty());
}

#[test]
fn webhook_ingress_routes_only_the_receiver() {
    let objects = render_ok(
        &[&seed_values("helm-values-seed.yaml")],
        &[
            "webhook.ingress.enabled=true",
            "webhook.ingress.host=imp-webhooks.example.com",
            "webhook.ingress.className=nginx",
        ],
    );
    let ing = get(&objects, "Ingress", "imp-webhook");
    assert_eq!(ing["spec"]["ingressClassName"], "nginx");
    let rule = &ing["spec"]["rules"][0];
    assert_eq!(rule["host"], "imp-webhooks.example.com");
    let paths = rule["http"]["paths"].as_array().unwrap();
    assert_eq!(paths.len(), 1);
    assert_eq!(paths[0]["path"], "/webhooks/github");
    assert_eq!(paths[0]["backend"]["service"]["name"], "imp-webhook");
}

/// Seed 001's production values (every image pinned) with the Ingress on install into the API server, and
/// the objects there carry the pins.
#[tokio::test]
async fn production_values_install_into_the_api_server() {
    let env = TestEnv::new("chartprod").await;
    let home = tempfile::tempdir().unwrap();
    let monitoring = paths::workspace_root().join("testkit/fixtures/monitoring-crds.yaml");
    run_ok(
        env.kubectl().args(["apply", "-f"]).arg(&monitoring),
        "install the monitoring CRDs",
    );
    let (_d, production) = values_file(&production_values());
    let release = "imp-prod";
    let out = run_ok(
        env.helm(home.path())
            .args(["install", release])
            .arg(paths::chart_dir())
            .args(["--skip-crds", "--wait=false", "-f"])
            .arg(&production)
            .args(["--set", "webhook.ingress.enabled=true"]),
        "helm install -f production values",
    );
    let notes = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        notes.contains("appSecretRef") && notes.contains("imp/enabled=true"),
        "NOTES.txt gives the next steps: {notes}"
    );
    let out = run_ok(
        env.kubectl().args([
            "get",
            "deployment,daemonset",
            "-o",
            "jsonpath={range .items[*]}{.metadata.name}={.spec.template.spec.containers[0].image}{\"\\n\"}{end}",
        ]),
        "kubectl get the workloads",
    );
    let listed = output_text(&out);
    for line in [
        format!("imp-prod-operator=ghcr.io/imp-dev/imp-operator@{OPERATOR_DIGEST}"),
        format!("imp-prod-agent=ghcr.io/imp-dev/imp-agent@{AGENT_DIGEST}"),
        format!("imp-prod-runtime=ghcr.io/imp-dev/imp-runtime@{RUNTIME_DIGEST}"),
    ] {
        assert!(listed.lines().any(|l| l == line), "{line} in {listed}");
    }
    let out = run_ok(
        env.kubectl()
            .args(["get", "ingress,servicemonitor,podmonitor", "-o", "name"]),
        "kubectl get the Ingress and monitors",
    );
    let listed = output_text(&out);
    for name in [
        "ingress.networking.k8s.io/imp-prod-webhook",
        "servicemonitor.monitoring.coreos.com/imp-prod-operator",
        "podmonitor.monitoring.coreos.com/imp-prod-agent",
        "podmonitor.monitoring.coreos.com/imp-prod-runtime",
    ] {
        assert!(listed.lines().any(|l| l == name), "{name} in {listed}");
    }
    run_ok(
        env.helm(home.path()).args(["uninstall", release]),
        "helm uninstall",
    );
}

/// With agent.env.jailerPath the runtime runs Firecracker through that jailer (mounted read-only);
/// the runtime's metrics listen on the pod IP unless runtime.metrics.bindAll; the agent mounts only
/// the VMs' directories (read-only) of the state directory.
#[test]
fn the_jailer_path_the_metrics_address_and_the_agent_s_mounts() {
    let (_d, v) = values_file(
        "agent:\n  env:\n    kernelPath: /var/lib/imp/vmlinux\n    fcBinPath: /usr/local/bin/firecracker\n    jailerPath: /usr/local/bin/jailer\n",
    );
    let objects = render_ok(&[&v], &[]);
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    let c = container(runtime, "containers", "runtime");
    assert_eq!(
        env_value(c, "IMP_JAILER_PATH"),
        Some("/usr/local/bin/jailer")
    );
    assert!(
        c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["mountPath"] == "/usr/local/bin/jailer" && m["readOnly"] == true),
        "{c}"
    );
    assert_eq!(env_value(c, "IMP_METRICS_ADDR"), Some("$(POD_IP):9091"));
    let agent = get(&objects, "DaemonSet", "imp-agent");
    let a = container(agent, "containers", "agent");
    let mounts: Vec<(&str, bool)> = a["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["mountPath"].as_str().unwrap(), m["readOnly"] == true))
        .collect();
    assert_eq!(mounts, [("/run/imp", false), ("/var/lib/imp/vms", true)]);

    let objects = render_ok(&[&v], &["runtime.metrics.bindAll=true"]);
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    let c = container(runtime, "containers", "runtime");
    assert_eq!(env_value(c, "IMP_METRICS_ADDR"), Some("0.0.0.0:9091"));

    let objects = render_ok(&[&seed_values("helm-values-seed.yaml")], &[]);
    let runtime = get(&objects, "DaemonSet", "imp-runtime");
    let c = container(runtime, "containers", "runtime");
    assert_eq!(
        env_value(c, "IMP_JAILER_PATH"),
        Some("/usr/local/bin/jailer"),
        "the seed names its jailer"
    );
}
