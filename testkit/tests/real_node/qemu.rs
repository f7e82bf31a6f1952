//! The runtime pod on `runtime.backend: qemu`: the release's runtime image carries QEMU and
//! vhost-device-vsock, the node only the guest kernel (the host's, as testkit's QEMU tests find it)
//! and Imp's initrd. The pool's images are the smoke's real-guest ones: a static busybox base
//! (images/busybox-base) and the runner image images/runner/build.sh makes around the static
//! imp-fake-runner, which reaches the GitHub simulator only through its network's NAT.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use imp_testkit::{node, paths, qemu::Setup};

/// What a real guest on the node needs, built and pushed.
pub struct GuestParts {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub base_image: String,
    pub runner_image: String,
}

/// Builds the static imp-fake-runner (as the smoke does) and Imp's initrd for the host's kernel
/// (testkit's, as every real-guest test), and pushes the two images to `registry`.
pub fn build(work: &Path, registry: &str, target_dir: &Path, setup: &Setup) -> GuestParts {
    let root = paths::workspace_root();
    node::run(
        Command::new("cargo")
            .args(["build", "-q", "--release", "--locked"])
            .args([
                "--target",
                "x86_64-unknown-linux-gnu",
                "-p",
                "imp-fake-runner",
            ])
            .current_dir(&root)
            .env("CARGO_TARGET_DIR", target_dir)
            .env("RUSTFLAGS", "-C target-feature=+crt-static")
            .env("CARGO_PROFILE_RELEASE_STRIP", "symbols"),
    )
    .expect("the static imp-fake-runner");
    let fake_runner = target_dir.join("x86_64-unknown-linux-gnu/release/imp-fake-runner");
    let initrd = work.join("initrd.gz");
    imp_testkit::qemu::scripted_initrd(setup, &initrd);
    let base_image = format!("{registry}/imp-dev/runner-base:real-node-qemu");
    node::run(
        Command::new(root.join("images/busybox-base/build.sh"))
            .arg("--out")
            .arg(work.join("base-oci"))
            .args(["--tag", "real-node-qemu", "--push", &base_image]),
    )
    .expect("images/busybox-base/build.sh");
    let runner_image = format!("{registry}/imp-dev/actions-runner:real-node-qemu");
    node::run(
        Command::new(root.join("images/runner/build.sh"))
            .arg("--fake-runner")
            .arg(&fake_runner)
            .arg("--out")
            .arg(work.join("runner-oci"))
            .args(["--tag", "real-node-qemu", "--push", &runner_image]),
    )
    .expect("images/runner/build.sh");
    GuestParts {
        kernel: setup.kernel.clone(),
        initrd,
        base_image,
        runner_image,
    }
}

/// Chart values that move the node to QEMU (TCG: a nested /dev/kvm may open and still boot nothing),
/// with room in each VM's memory cgroup for what TCG's QEMU holds beside the guest's memory (its
/// 64 MiB translation cache, imp-runtime's tb-size, softmmu TLBs, heap) in a Debian guest running
/// Docker (the peak is printed):
/// the runner command back to the runner image's wrapper inside the guest (the Firecracker phase ran
/// a host binary), a boot timeout for a TCG guest on a busy host. The kernel and initrd paths are
/// the caller's `--set`s.
pub const VALUES: &str = "agent:\n  extraEnv:\n\
     \x20   - {name: IMP_POLL_INTERVAL, value: 1s}\n\
     \x20   - {name: IMP_SWEEP_INTERVAL, value: 2s}\n\
     runtime:\n  backend: qemu\n  qemuAccel: tcg\n  vmMemoryOverheadMib: 256\n  extraEnv:\n\
     \x20   - {name: IMP_GUEST_BIN, value: /usr/local/lib/imp/imp-guest}\n\
     \x20   - {name: IMP_BOOT_TIMEOUT, value: 240s}\n";

/// The reference base image's phase (issue 31): the job's Docker steps in a real guest booted by the
/// runtime pod from images/base/ (the layout `make unit` builds, IMP_BASE_IMAGE_LAYOUT), the image
/// they build FROM pulled from a registry beyond the node's uplink, through the VM's NAT only.
pub mod docker {
    use std::{
        path::{Path, PathBuf},
        process::Command,
        time::{Duration, Instant},
    };

    use imp_testkit::{github::jobs::JobStep, node, process::ManagedProcess};

    use super::super::lifecycle::{JobRun, VmSize};

    /// A Debian guest running dockerd, `docker build` and three containers under TCG.
    pub const SIZE: VmSize = VmSize {
        memory_mib: 768,
        disk_gib: 2,
    };
    const PORT: u16 = 5000;
    /// The image the job builds FROM, in the "internet" registry.
    const FROM_REPO: &str = "imp-test/busybox:1";
    const MARKER: &str = "IMP-DOCKER-BUILD-MARKER";

    /// The layout of images/base/build.sh, from IMP_BASE_IMAGE_LAYOUT (`make unit` sets it, empty
    /// when it built none); `None` after saying SKIPPED, or a failure under IMP_REQUIRE_BASE_IMAGE=1.
    pub fn reference_layout() -> Option<PathBuf> {
        let layout = std::env::var_os("IMP_BASE_IMAGE_LAYOUT")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        match layout {
            Some(l) if l.join("index.json").is_file() => Some(l),
            other => {
                imp_testkit::skip::skip_or_fail(
                    "IMP_REQUIRE_BASE_IMAGE",
                    "real_node's Docker jobs in a reference-base-image guest (the qemu phase runs \
                     the fake runner's empty job on the busybox base instead)",
                    &match other {
                        None => "IMP_BASE_IMAGE_LAYOUT is not set (an OCI layout from \
                                 images/base/build.sh --out DIR; `make unit` builds one under \
                                 IMP_REQUIRE_BASE_IMAGE=1)"
                            .to_owned(),
                        Some(l) => {
                            format!("IMP_BASE_IMAGE_LAYOUT={} holds no index.json", l.display())
                        }
                    },
                );
                None
            }
        }
    }

    /// Copies the reference layout (its one ref) into the node's registry as `<registry>/imp-dev/runner-base:reference`.
    pub fn push_reference(layout: &Path, registry: &str) -> String {
        let index =
            std::fs::read_to_string(layout.join("index.json")).expect("the layout's index.json");
        let index: serde_json::Value = serde_json::from_str(&index).expect("index.json is JSON");
        let tag = index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"]
            .as_str()
            .expect("the layout's ref name")
            .to_owned();
        let image = format!("{registry}/imp-dev/runner-base:reference");
        let t = Instant::now();
        node::run(
            Command::new("skopeo")
                .args(["copy", "--quiet", "--dest-tls-verify=false"])
                .arg(format!("oci:{}:{tag}", layout.display()))
                .arg(format!("docker://{image}")),
        )
        .expect("skopeo copy the reference base image to the node's registry");
        println!(
            "real_node: reference base image {} ({} bytes of blobs) pushed as {image} in {:.1}s",
            layout.display(),
            dir_bytes(&layout.join("blobs")),
            t.elapsed().as_secs_f64()
        );
        image
    }

    fn dir_bytes(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| match e.metadata() {
                Ok(m) if m.is_dir() => dir_bytes(&e.path()),
                Ok(m) => m.len(),
                Err(_) => 0,
            })
            .sum()
    }

    /// docker-registry in the namespace beyond the node's uplink, on [`node::UPLINK_PEER_IP`]: the
    /// guest reaches it only through its network's NAT, as it would reach Docker Hub. Stopped on drop.
    pub struct InternetRegistry {
        _process: ManagedProcess,
        _dir: tempfile::TempDir,
    }

    impl InternetRegistry {
        /// Starts it in the namespace `peer_netns` and pushes the busybox base's layout (`oci_dir`,
        /// ref `tag`: images/busybox-base, a static busybox with its applets) as the image the job
        /// builds FROM.
        pub fn start(peer_netns: &str, oci_dir: &Path, tag: &str) -> InternetRegistry {
            let dir = tempfile::Builder::new()
                .prefix("imp-internet-registry-")
                .tempdir()
                .expect("registry dir");
            let config = dir.path().join("config.yml");
            std::fs::write(
                &config,
                format!(
                    "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n\
                     storage:\n  filesystem:\n    rootdirectory: {}\n\
                     http:\n  addr: {}:{PORT}\n",
                    dir.path().join("storage").display(),
                    node::UPLINK_PEER_IP
                ),
            )
            .expect("write the registry config");
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", peer_netns, "docker-registry", "serve"])
                .arg(&config);
            let process =
                ManagedProcess::spawn("internet-registry", cmd, &dir.path().join("registry.log"))
                    .expect("spawn docker-registry beyond the uplink");
            // The node reaches the peer by its connected route: wait until it answers there.
            let deadline = Instant::now() + Duration::from_secs(20);
            while std::net::TcpStream::connect((node::UPLINK_PEER_IP, PORT)).is_err() {
                assert!(
                    Instant::now() < deadline,
                    "docker-registry beyond the uplink did not listen on {}:{PORT}: {}",
                    node::UPLINK_PEER_IP,
                    process.log_tail(20)
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            node::run(
                Command::new("skopeo")
                    .args(["copy", "--quiet", "--dest-tls-verify=false"])
                    .arg(format!("oci:{}:{tag}", oci_dir.display()))
                    .arg(format!("docker://{}", from_image())),
            )
            .expect("skopeo copy the busybox image to the registry beyond the uplink");
            InternetRegistry {
                _process: process,
                _dir: dir,
            }
        }
    }

    fn from_image() -> String {
        format!("{}:{PORT}/{FROM_REPO}", node::UPLINK_PEER_IP)
    }

    fn step(name: &str, run: &str) -> JobStep {
        JobStep {
            name: name.to_owned(),
            run: Some(run.to_owned()),
            uses: None,
            shell: None,
            conclusion: None,
        }
    }

    /// The Docker job: who runs it (the runner uid 1001, dockerd root, both inside the guest), the
    /// registry beyond the uplink made an insecure registry of this guest's dockerd by the job itself
    /// (daemon.json plus SIGHUP: the image's defaults stay HTTPS-only), `docker build` FROM its image
    /// with a RUN step, `docker run` of the result printing the marker, and a `services:`-style pair:
    /// a container started detached on a user-defined network and reached by its name from a second.
    pub fn job() -> JobRun {
        let registry = format!("{}:{PORT}", node::UPLINK_PEER_IP);
        let from = from_image();
        JobRun {
            steps: vec![
                step(
                    "who runs the job",
                    "set -x\n\
                     # The step's parent is the runner process itself.\n\
                     test \"$(stat -c %u /proc/$PPID)\" = 1001\n\
                     test \"$(id -u):$(id -g)\" = 1001:1001\n\
                     sudo -n true\n\
                     # dockerd (started by the runner wrapper before the runner) runs as root, in the guest.\n\
                     test \"$(stat -c %u /proc/$(pgrep -x dockerd))\" = 0\n\
                     echo \"runner $(cat /proc/$PPID/comm) uid $(stat -c %u /proc/$PPID), dockerd uid 0, \
                     up $(cut -d' ' -f1 /proc/uptime) s\"",
                ),
                step(
                    "the registry beyond the uplink, for this guest's dockerd",
                    &format!(
                        "sudo sh -ec 'jq \". + {{\\\"insecure-registries\\\": [\\\"{registry}\\\"]}}\" \
                         /etc/docker/daemon.json >/etc/docker/daemon.json.new; \
                         mv /etc/docker/daemon.json.new /etc/docker/daemon.json; \
                         kill -HUP $(pgrep -x dockerd)'\n\
                         for i in $(seq 60); do docker info 2>/dev/null | grep -q '{registry}' && exit 0; sleep 1; done\n\
                         docker info; exit 1"
                    ),
                ),
                step(
                    "docker build",
                    &format!(
                        "mkdir ctx\n\
                         printf 'FROM {from}\\nRUN echo {MARKER} from a RUN step > /marker\\nCMD [\"cat\", \"/marker\"]\\n' >ctx/Dockerfile\n\
                         start=$(date +%s)\n\
                         docker build -t imp-accept:1 ctx\n\
                         echo \"docker build: $(($(date +%s) - start)) s\""
                    ),
                ),
                step(
                    "docker run",
                    &format!(
                        "start=$(date +%s)\n\
                         out=\"$(docker run --rm imp-accept:1)\"\n\
                         echo \"$out\"\n\
                         test \"$out\" = '{MARKER} from a RUN step'\n\
                         echo \"docker run: $(($(date +%s) - start)) s\""
                    ),
                ),
                step(
                    "a service container reached by name",
                    &format!(
                        "start=$(date +%s)\n\
                         docker network create imp-accept\n\
                         docker run -d --name svc --network imp-accept {from} \
                         sh -c 'mkdir -p /www && echo service-answer >/www/index.html && exec httpd -f -p 8080 -h /www'\n\
                         out=\"$(docker run --rm --network imp-accept {from} \
                         sh -c 'for i in $(seq 30); do wget -qO- http://svc:8080/ && exit 0; sleep 1; done; exit 1')\"\n\
                         test \"$out\" = service-answer\n\
                         docker rm -f svc\n\
                         echo \"service pair: $(($(date +%s) - start)) s\""
                    ),
                ),
            ],
            conclusion: "success",
        }
    }

    /// A job whose step exits 3: the job fails, the step after it is skipped.
    pub fn failing_job() -> JobRun {
        JobRun {
            steps: vec![
                step("exits 3", "echo about to exit 3\nexit 3"),
                step("never runs", "echo this step must be skipped"),
            ],
            conclusion: "failure",
        }
    }

    /// The step conclusions `run` ended with must be these.
    pub fn assert_steps(job: &imp_testkit::github::SimJob, expected: &[&str]) {
        let got: Vec<&str> = job
            .steps
            .iter()
            .map(|s| s.conclusion.as_deref().unwrap_or("none"))
            .collect();
        assert_eq!(
            got, expected,
            "job {} step conclusions: {:?}",
            job.id, job.steps
        );
    }

    /// The runtime and agent pods stay unprivileged with respect to the job: no path of a container
    /// engine on the host (its socket, state or binaries) is given to them, the agent keeps no
    /// capability and is not privileged, and no process of theirs on the host is dockerd (it runs as
    /// root inside the guest only, asserted there by [`job`]). What the runtime holds for its VMMs
    /// (docs/security.md) is the same for every job.
    pub fn assert_pods_give_docker_nothing(
        pods: &[k8s_openapi::api::core::v1::Pod],
        pod_pids: &[i32],
        socket_dir: &Path,
    ) {
        for pod in pods {
            let name = pod.metadata.name.clone().unwrap_or_default();
            let spec = pod.spec.as_ref().expect("pod spec");
            for v in spec.volumes.iter().flatten() {
                let Some(hp) = &v.host_path else { continue };
                let engine = ["docker", "containerd", "podman", "crio", "buildkit"]
                    .iter()
                    .any(|e| hp.path.contains(e));
                let socket =
                    hp.path.ends_with(".sock") && !Path::new(&hp.path).starts_with(socket_dir);
                assert!(
                    !engine && !socket,
                    "pod {name} is given the host's {} (volume {})",
                    hp.path,
                    v.name
                );
            }
            if name.contains("agent") {
                for c in &spec.containers {
                    let sc = c.security_context.clone().unwrap_or_default();
                    let added = sc
                        .capabilities
                        .and_then(|caps| caps.add)
                        .unwrap_or_default();
                    assert!(
                        added.is_empty() && sc.privileged != Some(true),
                        "the agent pod {name} ({}) adds capabilities {added:?} or is privileged",
                        c.name
                    );
                }
            }
        }
        for pid in pod_pids {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            assert_ne!(
                comm.trim(),
                "dockerd",
                "pod process {pid} on the host is dockerd"
            );
        }
    }
}
