//! The test control plane itself: garbage collection and namespace deletion really happen (so controller
//! tests can rely on them), teardown stops exactly what it started, and a missing binary says how to build it.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use imp_api::ImpVM;
use imp_testkit::{
    TestEnv,
    controlplane::{ControlPlane, ControlPlaneError, ControlPlaneOptions},
    fixtures,
};
use k8s_openapi::{
    api::core::v1::{Namespace, Secret},
    apimachinery::pkg::apis::meta::v1::OwnerReference,
};
use kube::{
    Api, Resource,
    api::{DeleteParams, PostParams},
};

async fn wait_gone<K>(api: &Api<K>, name: &str, within: Duration) -> Duration
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let start = Instant::now();
    loop {
        match api.get_opt(name).await.unwrap() {
            None => return start.elapsed(),
            Some(_) if start.elapsed() > within => panic!("{name} still present after {within:?}"),
            Some(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

fn vm(name: &str) -> ImpVM {
    fixtures::vm(name).class("c").image("img:1").build()
}

#[tokio::test]
async fn garbage_collector_deletes_a_secret_owned_by_a_deleted_vm() {
    let env = TestEnv::new("gc").await;
    let vms: Api<ImpVM> = env.api();
    let secrets: Api<Secret> = env.api();
    let created = vms
        .create(&PostParams::default(), &vm("owner"))
        .await
        .unwrap();
    let uid = created.metadata.uid.clone().unwrap();

    let mut secret = Secret::default();
    secret.metadata.name = Some(imp_api::names::jit_secret_name(&uid));
    secret.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "imp.dev/v1alpha1".into(),
        kind: "ImpVM".into(),
        name: "owner".into(),
        uid,
        controller: Some(true),
        block_owner_deletion: Some(true),
    }]);
    secret.string_data = Some([("jitconfig".to_owned(), "not-a-real-config".to_owned())].into());
    let secret = secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let secret_name = secret.metadata.name.unwrap();

    vms.delete("owner", &DeleteParams::background())
        .await
        .unwrap();
    let took = wait_gone(&secrets, &secret_name, Duration::from_secs(60)).await;
    eprintln!("garbage collector removed the owned Secret {took:?} after the VM was deleted");
}

#[tokio::test]
async fn namespace_deletion_completes() {
    let env = TestEnv::new("nsdel").await;
    // A throwaway namespace with an Imp object in it: the namespace controller must empty and remove it.
    let name = format!("{}-x", env.namespace);
    let namespaces: Api<Namespace> = Api::all(env.client.clone());
    let mut ns = Namespace::default();
    ns.metadata.name = Some(name.clone());
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    Api::<ImpVM>::namespaced(env.client.clone(), &name)
        .create(&PostParams::default(), &vm("inside"))
        .await
        .unwrap();
    namespaces
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    let took = wait_gone(&namespaces, &name, Duration::from_secs(60)).await;
    eprintln!("namespace deleted in {took:?}");
}

fn alive(pid: u32) -> bool {
    // Zombies count as dead: the harness reaps its own children.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.split_whitespace().nth(2) != Some("Z"))
}

#[tokio::test]
async fn teardown_stops_exactly_what_it_started() {
    let mut bystander = Command::new("sleep").arg("120").spawn().unwrap();
    let mut opts = ControlPlaneOptions::in_temp_dir();
    opts.controller_manager = false;
    let dir = opts.dir.clone();
    let cp = ControlPlane::start(opts).await.unwrap();
    let pids = cp.pids();
    assert_eq!(pids.len(), 2, "etcd and kube-apiserver");
    assert!(pids.iter().all(|p| alive(*p)));
    assert!(cp.kubeconfig_path().is_file());
    // The API server answers through the kubeconfig it wrote.
    let client = cp.client().await.unwrap();
    let version = client.apiserver_version().await.unwrap();
    assert_eq!(version.git_version, "v1.36.3");

    drop(client);
    drop(cp);
    for pid in pids {
        assert!(!alive(pid), "pid {pid} survived teardown");
    }
    assert!(!dir.exists(), "work dir {} left behind", dir.display());
    assert!(
        bystander.try_wait().unwrap().is_none(),
        "teardown touched a process it did not start"
    );
    bystander.kill().unwrap();
    bystander.wait().unwrap();
}

#[tokio::test]
async fn missing_binary_names_it_and_says_how_to_build() {
    let mut opts = ControlPlaneOptions::in_temp_dir();
    opts.bin_dir = opts.dir.join("no-such-bin");
    let err = ControlPlane::start(opts)
        .await
        .err()
        .expect("must fail without binaries");
    assert!(
        matches!(err, ControlPlaneError::BinaryMissing { ref name, .. } if name == "etcd"),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("no-such-bin/etcd") && msg.contains("make testenv"),
        "{msg}"
    );
}
