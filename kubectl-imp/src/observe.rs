//! The plugin's reads from the API server (and its few writes, for `drain`), one function per question.

use imp_api::{ImpVM, ImpVMRunnerPool};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client};

use crate::{Error, api};

/// Where to look: one namespace, or every one (`-A`).
#[derive(Debug, Clone)]
pub enum Scope {
    Namespace(String),
    All,
}

impl Scope {
    fn api<K>(&self, client: &Client) -> Api<K>
    where
        K: kube::Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        match self {
            Scope::Namespace(ns) => Api::namespaced(client.clone(), ns),
            Scope::All => Api::all(client.clone()),
        }
    }
}

fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// ImpVM `name` of `namespace`.
pub async fn vm(client: &Client, namespace: &str, name: &str) -> Result<ImpVM, Error> {
    match Api::<ImpVM>::namespaced(client.clone(), namespace)
        .get(name)
        .await
    {
        Ok(vm) => Ok(vm),
        Err(e) if not_found(&e) => Err(Error::NotFound {
            kind: "ImpVM",
            name: name.to_owned(),
            namespace: namespace.to_owned(),
        }),
        Err(e) => Err(api(format!("reading ImpVM {namespace}/{name}"))(e)),
    }
}

/// The ImpVM named `target`, or, when `target` is a number no VM is named, the VM whose
/// `status.job.jobId` it is.
pub async fn vm_or_job(client: &Client, namespace: &str, target: &str) -> Result<ImpVM, Error> {
    match (vm(client, namespace, target).await, target.parse::<i64>()) {
        (Err(Error::NotFound { .. }), Ok(job)) => vms(client, &Scope::Namespace(namespace.into()))
            .await?
            .into_iter()
            .find(|v| {
                v.status
                    .as_ref()
                    .and_then(|s| s.job.as_ref())
                    .and_then(|j| j.job_id)
                    == Some(job)
            })
            .ok_or(Error::JobNotFound {
                job,
                namespace: namespace.to_owned(),
            }),
        (r, _) => r,
    }
}

pub async fn vms(client: &Client, scope: &Scope) -> Result<Vec<ImpVM>, Error> {
    Ok(scope
        .api::<ImpVM>(client)
        .list(&ListParams::default())
        .await
        .map_err(api("listing ImpVMs"))?
        .items)
}

pub async fn pools(client: &Client, scope: &Scope) -> Result<Vec<ImpVMRunnerPool>, Error> {
    Ok(scope
        .api::<ImpVMRunnerPool>(client)
        .list(&ListParams::default())
        .await
        .map_err(api("listing ImpVMRunnerPools"))?
        .items)
}

/// The pool's conditions (none when it is gone).
pub async fn pool_conditions(
    client: &Client,
    namespace: &str,
    pool: &str,
) -> Result<Vec<k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition>, Error> {
    match Api::<ImpVMRunnerPool>::namespaced(client.clone(), namespace)
        .get_opt(pool)
        .await
    {
        Ok(p) => Ok(p
            .and_then(|p| p.status)
            .map(|s| s.conditions)
            .unwrap_or_default()),
        Err(e) => Err(api(format!("reading ImpVMRunnerPool {namespace}/{pool}"))(
            e,
        )),
    }
}

/// Nodes labelled for Imp (`imp/enabled=true`).
pub async fn nodes(client: &Client) -> Result<Vec<Node>, Error> {
    let lp = ListParams::default().labels(&format!("{}=true", imp_api::names::LABEL_NODE_ENABLED));
    Ok(Api::<Node>::all(client.clone())
        .list(&lp)
        .await
        .map_err(api("listing Imp's nodes"))?
        .items)
}

pub async fn node(client: &Client, name: &str) -> Result<Node, Error> {
    match Api::<Node>::all(client.clone()).get(name).await {
        Ok(n) => Ok(n),
        Err(e) if not_found(&e) => Err(Error::NotFound {
            kind: "Node",
            name: name.to_owned(),
            namespace: "(cluster)".to_owned(),
        }),
        Err(e) => Err(api(format!("reading Node {name}"))(e)),
    }
}

/// The agents' heartbeat Leases in Imp's namespace.
pub async fn leases(client: &Client, imp_namespace: &str) -> Result<Vec<Lease>, Error> {
    Ok(Api::<Lease>::namespaced(client.clone(), imp_namespace)
        .list(&ListParams::default())
        .await
        .map_err(api(format!("listing Leases in {imp_namespace}")))?
        .items)
}

/// The imp-runtime pods (the chart's DaemonSet) in Imp's namespace.
pub async fn runtime_pods(client: &Client, imp_namespace: &str) -> Result<Vec<Pod>, Error> {
    let lp = ListParams::default().labels("app.kubernetes.io/component=runtime");
    Ok(Api::<Pod>::namespaced(client.clone(), imp_namespace)
        .list(&lp)
        .await
        .map_err(api(format!("listing imp-runtime pods in {imp_namespace}")))?
        .items)
}

/// events.k8s.io/v1 Events, as JSON objects.
pub async fn events(client: &Client, scope: &Scope) -> Result<Vec<serde_json::Value>, Error> {
    let list = scope
        .api::<Event>(client)
        .list(&ListParams::default())
        .await
        .map_err(api("listing Events"))?;
    list.items
        .into_iter()
        .map(|e| serde_json::to_value(e).map_err(Error::Json))
        .collect()
}

/// Marks the node unschedulable (`kubectl cordon`), which Imp's scheduler honours.
pub async fn cordon(client: &Client, node: &str) -> Result<(), Error> {
    let patch = serde_json::json!({"spec": {"unschedulable": true}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(api(format!("cordoning node {node}")))?;
    Ok(())
}

pub async fn delete_vm(client: &Client, namespace: &str, name: &str) -> Result<(), Error> {
    match Api::<ImpVM>::namespaced(client.clone(), namespace)
        .delete(name, &Default::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(e) if not_found(&e) => Ok(()),
        Err(e) => Err(api(format!("deleting ImpVM {namespace}/{name}"))(e)),
    }
}
