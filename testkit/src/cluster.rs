//! Per-test access to one control plane shared by all tests of a test binary.
//!
//! The first test to ask starts the control plane (or uses `IMP_TESTENV_KUBECONFIG`, e.g. one started by
//! `imp-testenv up`); each test then gets its own client and a fresh namespace that is deleted afterwards.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, Client, Resource,
    api::{DeleteParams, PostParams},
};
use serde::de::DeserializeOwned;

use crate::{
    controlplane::{ControlPlane, ControlPlaneOptions, config_from_kubeconfig, install_crds},
    paths,
};

/// Label put on every namespace a test creates.
pub const TEST_NAMESPACE_LABEL: &str = "imp.dev/test";

struct Shared {
    kubeconfig: PathBuf,
    // Kept alive for the life of the test binary; the atexit hook in `process` stops it.
    _control_plane: Option<ControlPlane>,
}

static SHARED: OnceLock<Result<Shared, String>> = OnceLock::new();

fn shared() -> &'static Shared {
    let result = SHARED.get_or_init(|| {
        // Start-up runs on its own thread and runtime: callers are inside tokio runtimes of their own.
        std::thread::spawn(|| {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                if let Some(path) = std::env::var_os("IMP_TESTENV_KUBECONFIG") {
                    let kubeconfig = PathBuf::from(path);
                    let config = config_from_kubeconfig(&kubeconfig)
                        .await
                        .map_err(|e| e.to_string())?;
                    let client = Client::try_from(config).map_err(|e| e.to_string())?;
                    install_crds(
                        &client,
                        imp_api::crds().into_iter().map(|(_, c)| c).collect(),
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                    return Ok(Shared {
                        kubeconfig,
                        _control_plane: None,
                    });
                }
                let opts = ControlPlaneOptions::in_temp_dir();
                let cp = ControlPlane::start(opts).await.map_err(|e| e.to_string())?;
                Ok(Shared {
                    kubeconfig: cp.kubeconfig_path().to_path_buf(),
                    _control_plane: Some(cp),
                })
            })
        })
        .join()
        .unwrap_or_else(|_| Err("control plane start-up panicked".to_owned()))
    });
    match result {
        Ok(shared) => shared,
        Err(e) => panic!("test control plane unavailable: {e}"),
    }
}

/// Kubeconfig of the shared control plane (starting it if needed).
pub fn shared_kubeconfig() -> &'static Path {
    &shared().kubeconfig
}

/// A fresh namespace on the shared control plane, with a client; the namespace is deleted on drop.
pub struct TestEnv {
    pub client: Client,
    pub namespace: String,
    kubeconfig: PathBuf,
}

impl TestEnv {
    /// Creates namespace `imp-<prefix>-<random>`.
    pub async fn new(prefix: &str) -> Self {
        let kubeconfig = shared_kubeconfig().to_path_buf();
        let config = config_from_kubeconfig(&kubeconfig)
            .await
            .expect("load test kubeconfig");
        let client = Client::try_from(config).expect("build test client");
        let namespace = format!(
            "imp-{}-{}",
            prefix,
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let mut ns = Namespace::default();
        ns.metadata.name = Some(namespace.clone());
        ns.metadata.labels = Some([(TEST_NAMESPACE_LABEL.to_owned(), "true".to_owned())].into());
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .expect("create test namespace");
        Self {
            client,
            namespace,
            kubeconfig,
        }
    }

    /// A namespaced API in this test's namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + DeserializeOwned
            + std::fmt::Debug,
    {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    /// Path of the admin kubeconfig.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// `kubectl` from testenv, pointed at the test control plane and namespace.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(paths::testenv_bin("kubectl"));
        cmd.env("KUBECONFIG", &self.kubeconfig)
            .arg("--namespace")
            .arg(&self.namespace);
        cmd
    }

    /// `helm` from testenv, pointed at the test control plane and namespace, with its state in `home`.
    pub fn helm(&self, home: &Path) -> Command {
        let mut cmd = Command::new(paths::testenv_bin("helm"));
        cmd.env("KUBECONFIG", &self.kubeconfig)
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"))
            .arg("--namespace")
            .arg(&self.namespace);
        cmd
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        let namespace = self.namespace.clone();
        with_fresh_client(&self.kubeconfig, move |client| async move {
            let _ = Api::<Namespace>::all(client)
                .delete(&namespace, &DeleteParams::background())
                .await;
        });
    }
}

/// Runs `f` with a new client on a thread and runtime of its own and waits for it. For cleanup in
/// `Drop`: the test's runtime may already be shutting down, and a client is bound to its runtime.
pub fn with_fresh_client<F, Fut>(kubeconfig: &Path, f: F)
where
    F: FnOnce(Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let kubeconfig = kubeconfig.to_path_buf();
    let done = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            let Ok(config) = config_from_kubeconfig(&kubeconfig).await else {
                return;
            };
            let Ok(client) = Client::try_from(config) else {
                return;
            };
            f(client).await;
        });
    });
    let _ = done.join();
}
