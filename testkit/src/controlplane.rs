//! A real Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver and kube-controller-manager
//! (garbage collection and namespace deletion) built by testenv/, on random free ports, with fresh
//! certificates and service-account keys, and a kubeconfig for an admin token.

use std::{
    net::TcpListener,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{
    Api, Client, Config,
    api::{Patch, PatchParams},
    config::{KubeConfigOptions, Kubeconfig},
};

use crate::{
    certs::ControlPlaneCerts,
    paths,
    process::{ManagedProcess, remove_at_exit},
};

/// What can go wrong bringing up a control plane.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error(
        "{name} not found at {path}: build the test control plane with `make testenv` (runs testenv/build.sh)"
    )]
    BinaryMissing { name: String, path: PathBuf },
    #[error("cannot start {name}: {source}")]
    Spawn {
        name: String,
        source: std::io::Error,
    },
    #[error("{name} exited during start-up ({status}); last log lines:\n{log_tail}")]
    Exited {
        name: String,
        status: String,
        log_tail: String,
    },
    #[error("{name} not ready after {after:?}; last log lines:\n{log_tail}")]
    NotReady {
        name: String,
        after: Duration,
        log_tail: String,
    },
    #[error("cannot generate certificates: {0}")]
    Certs(#[from] rcgen::Error),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    #[error("cannot build a client: {0}")]
    Client(kube::Error),
    #[error("installing CRD {name}: {source}")]
    CrdInstall { name: String, source: kube::Error },
    #[error("CRD {name} not established after {after:?}")]
    CrdNotEstablished { name: String, after: Duration },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ControlPlaneError {
    let context = context.into();
    move |source| ControlPlaneError::Io { context, source }
}

/// Options for [`ControlPlane::start`].
#[derive(Clone, Debug)]
pub struct ControlPlaneOptions {
    /// Work directory (certs, etcd data, logs, kubeconfig). Created; removed on drop when `cleanup`.
    pub dir: PathBuf,
    /// Remove `dir` when the control plane stops.
    pub cleanup: bool,
    /// Run kube-controller-manager (garbage collector and namespace controllers).
    pub controller_manager: bool,
    /// Install Imp's CRDs (from the Rust types) before the controller manager starts, so the garbage
    /// collector watches them from its first discovery.
    pub install_imp_crds: bool,
    /// Where etcd, kube-apiserver and kube-controller-manager are (default: [`paths::testenv_bin_dir`]).
    pub bin_dir: PathBuf,
    /// The controllers kube-controller-manager runs (`--controllers`).
    pub controllers: Vec<String>,
    /// Run kube-scheduler (testenv/bin/kube-scheduler): Deployments' and DaemonSets' pods get nodes.
    pub scheduler: bool,
    /// For pods on a real node ([`crate::node`]): the API server listens on every address of its network
    /// namespace, advertises this one and is served under the `kubernetes` Service.
    pub pod_access: Option<PodAccess>,
}

/// How pods on a real node reach the API server. There is no kube-proxy: the `kubernetes` Service's
/// ClusterIP (the first address of `service_cidr`) is an address of the node's own network namespace, and
/// the API server listens on port 443 there, so in-cluster clients connect to it directly.
#[derive(Clone, Debug)]
pub struct PodAccess {
    /// `--advertise-address` (the node's IP): the `kubernetes` Endpoints.
    pub advertise_address: std::net::Ipv4Addr,
    /// `--service-cluster-ip-range`.
    pub service_cidr: String,
    /// The `kubernetes` Service's ClusterIP (on the serving certificate).
    pub service_ip: std::net::Ipv4Addr,
}

impl ControlPlaneOptions {
    /// A fresh directory under the system temp dir.
    pub fn in_temp_dir() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "imp-testenv-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        Self {
            dir,
            cleanup: true,
            controller_manager: true,
            install_imp_crds: true,
            bin_dir: paths::testenv_bin_dir(),
            controllers: vec!["garbagecollector".to_owned(), "namespace".to_owned()],
            scheduler: false,
            pod_access: None,
        }
    }
}

/// A running control plane. Dropping it stops the processes it started (and only those).
pub struct ControlPlane {
    dir: PathBuf,
    cleanup: bool,
    kubeconfig_path: PathBuf,
    server: String,
    // Stopped in reverse start order by Drop.
    processes: Vec<ManagedProcess>,
}

/// How long one component may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(90);

impl ControlPlane {
    /// Starts etcd, kube-apiserver and (optionally) kube-controller-manager; returns once the API server
    /// answers /readyz and the CRDs are established.
    pub async fn start(opts: ControlPlaneOptions) -> Result<Self, ControlPlaneError> {
        let bin = |name: &str| opts.bin_dir.join(name);
        let scheduler = opts.scheduler.then_some("kube-scheduler");
        for name in ["etcd", "kube-apiserver", "kube-controller-manager"]
            .into_iter()
            .chain(scheduler)
        {
            let path = bin(name);
            if !path.is_file() {
                return Err(ControlPlaneError::BinaryMissing {
                    name: name.to_owned(),
                    path,
                });
            }
        }
        std::fs::create_dir_all(&opts.dir)
            .map_err(io_err(format!("create {}", opts.dir.display())))?;
        if opts.cleanup {
            remove_at_exit(&opts.dir);
        }
        let dir = opts.dir.clone();
        let mut cp = ControlPlane {
            dir: dir.clone(),
            cleanup: opts.cleanup,
            kubeconfig_path: dir.join("kubeconfig"),
            server: String::new(),
            processes: Vec::new(),
        };

        let [
            etcd_client,
            etcd_peer,
            free_apiserver_port,
            kcm_port,
            scheduler_port,
        ] = free_ports::<5>().map_err(io_err("choose free ports on 127.0.0.1"))?;
        let (bind, advertise, apiserver_port, service_cidr, extra_sans) = match &opts.pod_access {
            None => (
                "127.0.0.1".to_owned(),
                "127.0.0.1".to_owned(),
                free_apiserver_port,
                "10.96.0.0/24".to_owned(),
                Vec::new(),
            ),
            Some(access) => (
                "0.0.0.0".to_owned(),
                access.advertise_address.to_string(),
                443,
                access.service_cidr.clone(),
                vec![
                    access.advertise_address.to_string(),
                    access.service_ip.to_string(),
                    "kubernetes.default.svc".to_owned(),
                ],
            ),
        };
        let certs = ControlPlaneCerts::generate_with_sans(&extra_sans)?;
        let token = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let write = |name: &str, content: &str| -> Result<PathBuf, ControlPlaneError> {
            let path = dir.join(name);
            std::fs::write(&path, content).map_err(io_err(format!("write {}", path.display())))?;
            Ok(path)
        };
        let ca = write("ca.crt", &certs.ca_cert_pem)?;
        let serving_cert = write("apiserver.crt", &certs.serving_cert_pem)?;
        let serving_key = write("apiserver.key", &certs.serving_key_pem)?;
        let sa_key = write("sa.key", &certs.service_account_key_pem)?;
        let sa_pub = write("sa.pub", &certs.service_account_pub_pem)?;
        let tokens = write(
            "tokens.csv",
            &format!("{token},imp-admin,imp-admin,\"system:masters\"\n"),
        )?;
        cp.server = format!("https://127.0.0.1:{apiserver_port}");
        write(
            "kubeconfig",
            &kubeconfig_yaml(&cp.server, &certs.ca_cert_pem, &token),
        )?;

        // etcd: fsync off, it is throwaway state.
        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        let mut etcd = Command::new(bin("etcd"));
        etcd.args(["--name", "imp-testenv", "--data-dir"])
            .arg(dir.join("etcd"))
            .args([
                "--listen-client-urls",
                &etcd_url,
                "--advertise-client-urls",
                &etcd_url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("imp-testenv={peer_url}")])
            .args(["--unsafe-no-fsync", "--log-level", "warn"]);
        cp.spawn("etcd", etcd)?;
        cp.wait_tcp("etcd", etcd_client).await?;

        let mut apiserver = Command::new(bin("kube-apiserver"));
        apiserver
            .args(["--etcd-servers", &etcd_url])
            .args(["--bind-address", &bind, "--advertise-address", &advertise])
            .args(["--secure-port", &apiserver_port.to_string()])
            .arg(format!("--tls-cert-file={}", serving_cert.display()))
            .arg(format!("--tls-private-key-file={}", serving_key.display()))
            .arg(format!("--client-ca-file={}", ca.display()))
            .arg(format!("--token-auth-file={}", tokens.display()))
            .arg(format!("--service-account-key-file={}", sa_pub.display()))
            .arg(format!(
                "--service-account-signing-key-file={}",
                sa_key.display()
            ))
            .args(["--service-account-issuer", "https://imp-testenv.invalid"])
            .args(["--service-cluster-ip-range", &service_cidr])
            // Logs and exec reach a kubelet at its node IP: there is no DNS for node names.
            .arg("--kubelet-preferred-address-types=InternalIP")
            .args(["--authorization-mode", "RBAC"])
            // As on real clusters: the runtime DaemonSet is privileged.
            .arg("--allow-privileged=true")
            .args([
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "--v=1",
            ]);
        cp.spawn("kube-apiserver", apiserver)?;
        cp.wait_ready().await?;

        if opts.install_imp_crds {
            let client = cp.client().await?;
            install_crds(
                &client,
                imp_api::crds().into_iter().map(|(_, crd)| crd).collect(),
            )
            .await?;
        }

        if opts.controller_manager {
            let kubeconfig = cp.kubeconfig_path.display().to_string();
            let mut kcm = Command::new(bin("kube-controller-manager"));
            kcm.arg(format!("--kubeconfig={kubeconfig}"))
                .arg(format!("--authentication-kubeconfig={kubeconfig}"))
                .arg(format!("--authorization-kubeconfig={kubeconfig}"))
                .args(["--controllers", &opts.controllers.join(",")])
                // The token and root-CA controllers (when listed) sign with and publish these.
                .arg(format!(
                    "--service-account-private-key-file={}",
                    sa_key.display()
                ))
                .arg(format!("--root-ca-file={}", ca.display()))
                .args(["--leader-elect=false", "--bind-address", "127.0.0.1"])
                .args(["--secure-port", &kcm_port.to_string()])
                .arg(format!("--cert-dir={}", dir.join("kcm-certs").display()))
                .args(["--profiling=false", "--v=1"]);
            cp.spawn("kube-controller-manager", kcm)?;
            cp.wait_tcp("kube-controller-manager", kcm_port).await?;
        }
        if opts.scheduler {
            let kubeconfig = cp.kubeconfig_path.display().to_string();
            let mut scheduler = Command::new(bin("kube-scheduler"));
            scheduler
                .arg(format!("--kubeconfig={kubeconfig}"))
                .arg(format!("--authentication-kubeconfig={kubeconfig}"))
                .arg(format!("--authorization-kubeconfig={kubeconfig}"))
                .args(["--leader-elect=false", "--bind-address", "127.0.0.1"])
                .args(["--secure-port", &scheduler_port.to_string()])
                .arg(format!(
                    "--cert-dir={}",
                    dir.join("scheduler-certs").display()
                ))
                .args(["--profiling=false", "--v=1"]);
            cp.spawn("kube-scheduler", scheduler)?;
            cp.wait_tcp("kube-scheduler", scheduler_port).await?;
        }
        Ok(cp)
    }

    /// Path of the admin kubeconfig.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig_path
    }

    /// `https://127.0.0.1:<port>` of the API server.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The work directory (logs are `<component>.log` here).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Pids of the processes this control plane started.
    pub fn pids(&self) -> Vec<u32> {
        self.processes.iter().map(ManagedProcess::pid).collect()
    }

    /// Client configuration for the admin user.
    pub async fn config(&self) -> Result<Config, ControlPlaneError> {
        config_from_kubeconfig(&self.kubeconfig_path).await
    }

    /// A client bound to the calling tokio runtime.
    pub async fn client(&self) -> Result<Client, ControlPlaneError> {
        let config = self.config().await?;
        Client::try_from(config).map_err(ControlPlaneError::Client)
    }

    fn spawn(&mut self, name: &str, cmd: Command) -> Result<(), ControlPlaneError> {
        let log = self.dir.join(format!("{name}.log"));
        let process =
            ManagedProcess::spawn(name, cmd, &log).map_err(|source| ControlPlaneError::Spawn {
                name: name.to_owned(),
                source,
            })?;
        self.processes.push(process);
        Ok(())
    }

    fn check_alive(&mut self, name: &str) -> Result<(), ControlPlaneError> {
        let process = self
            .processes
            .iter_mut()
            .find(|p| p.name == name)
            .expect("process was spawned");
        if let Ok(Some(status)) = process.try_exit_status() {
            return Err(ControlPlaneError::Exited {
                name: name.to_owned(),
                status: status.to_string(),
                log_tail: process.log_tail(30),
            });
        }
        Ok(())
    }

    fn not_ready(&self, name: &str) -> ControlPlaneError {
        let tail = self
            .processes
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.log_tail(30))
            .unwrap_or_default();
        ControlPlaneError::NotReady {
            name: name.to_owned(),
            after: READY_TIMEOUT,
            log_tail: tail,
        }
    }

    async fn wait_tcp(&mut self, name: &str, port: u16) -> Result<(), ControlPlaneError> {
        let start = Instant::now();
        loop {
            self.check_alive(name)?;
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(self.not_ready(name));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_ready(&mut self) -> Result<(), ControlPlaneError> {
        let client = self.client().await?;
        let start = Instant::now();
        loop {
            self.check_alive("kube-apiserver")?;
            let req = http::Request::get("/readyz")
                .body(Vec::new())
                .expect("static request");
            if let Ok(body) = client.request_text(req).await
                && body.trim() == "ok"
            {
                return Ok(());
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(self.not_ready("kube-apiserver"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        while let Some(mut p) = self.processes.pop() {
            p.stop(Duration::from_secs(5));
        }
        if self.cleanup {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Loads a kubeconfig file into a client configuration.
pub async fn config_from_kubeconfig(path: &Path) -> Result<Config, ControlPlaneError> {
    let kubeconfig = Kubeconfig::read_from(path)?;
    Ok(Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?)
}

/// Server-side applies CRDs and waits until each is Established.
pub async fn install_crds(
    client: &Client,
    crds: Vec<CustomResourceDefinition>,
) -> Result<(), ControlPlaneError> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let params = PatchParams::apply("imp-testkit").force();
    for crd in &crds {
        let name = crd.metadata.name.clone().unwrap_or_default();
        api.patch(&name, &params, &Patch::Apply(crd))
            .await
            .map_err(|source| ControlPlaneError::CrdInstall {
                name: name.clone(),
                source,
            })?;
    }
    let timeout = Duration::from_secs(30);
    for crd in &crds {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let start = Instant::now();
        loop {
            let current = api
                .get(&name)
                .await
                .map_err(|source| ControlPlaneError::CrdInstall {
                    name: name.clone(),
                    source,
                })?;
            let established = current
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                break;
            }
            if start.elapsed() > timeout {
                return Err(ControlPlaneError::CrdNotEstablished {
                    name,
                    after: timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}

/// `N` distinct free TCP ports on 127.0.0.1 (held together while choosing so they differ).
pub(crate) fn free_ports<const N: usize>() -> std::io::Result<[u16; N]> {
    let listeners: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()?;
    let mut ports = [0u16; N];
    for (port, l) in ports.iter_mut().zip(&listeners) {
        *port = l.local_addr()?.port();
    }
    Ok(ports)
}

fn kubeconfig_yaml(server: &str, ca_pem: &str, token: &str) -> String {
    use base64::Engine as _;
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: imp-testenv\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\n\
         users:\n- name: imp-admin\n  user:\n    token: {token}\ncontexts:\n- name: imp-testenv\n  context:\n    cluster: imp-testenv\n    user: imp-admin\n\
         current-context: imp-testenv\n"
    )
}
