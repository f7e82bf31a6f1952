//! Test objects: builders for the typed imp_api objects (and their JSON, for tests that mutate raw
//! objects), so a test says only what differs from a plain object.
//!
//! ```
//! use imp_testkit::fixtures::{class, vm};
//! let small = class("small").vcpu(2).memory_mib(1024).build();
//! let svc = vm("svc").class("small").persistent().bound("n1").build();
//! assert_eq!(svc.spec.node_name.as_deref(), Some("n1"));
//! # let _ = small;
//! ```

use std::collections::BTreeMap;

use imp_api::names::{
    ANNOTATION_BOOT_DIGEST, ANNOTATION_RUNNER_ID, ANNOTATION_RUNNER_NAME, LABEL_RUNNER_POOL,
    LABEL_SECRET_KIND, SECRET_KEY_JITCONFIG, SECRET_KIND_JIT,
};
use imp_api::{
    Backoff, ClassRef, DesiredState, GithubRunnerSpec, GithubScope, HttpGetProbe, ImpNetwork,
    ImpNetworkSpec, ImpVM, ImpVMClass, ImpVMClassSpec, ImpVMRunnerPool, ImpVMRunnerPoolSpec,
    ImpVMSpec, KubeDuration, Lifecycle, Nat, NetworkRef, OnExhaustion, Probe, Probes, RestartMode,
    RestartPolicy, RunnerVmTemplate, RunnerVmTemplateSpec, Scaling, SecretKeyRef,
};
use k8s_openapi::api::core::v1::{LocalObjectReference, Secret, Toleration};
use kube::Resource;
use serde_json::Value;

/// Image of a [`vm`] and a [`pool`]'s template unless set.
pub const IMAGE: &str = "ghcr.io/imp/runner:1";
/// Class of a [`vm`] and a [`pool`]'s template unless set.
pub const CLASS: &str = "small";

/// A duration string the test wrote; panics naming it if it does not parse.
pub fn duration(d: &str) -> KubeDuration {
    KubeDuration::new(d).unwrap_or_else(|e| panic!("fixture duration {d:?}: {e}"))
}

fn json_of<T: serde::Serialize>(obj: &T) -> Value {
    serde_json::to_value(obj).expect("imp_api objects serialize")
}

/// An ephemeral ImpVM of class [`CLASS`] with image [`IMAGE`], not bound to a node.
pub fn vm(name: &str) -> VmBuilder {
    VmBuilder(ImpVM::new(
        name,
        ImpVMSpec {
            class_ref: ClassRef { name: CLASS.into() },
            image: IMAGE.into(),
            runner_image: None,
            image_pull_secrets: Vec::new(),
            image_pull_policy: None,
            network_ref: None,
            lifecycle: Lifecycle::Ephemeral,
            node_name: None,
            node_selector: None,
            tolerations: None,
            restart_policy: None,
            desired_state: None,
            idle_timeout: None,
            expire_after: None,
            runner_config_secret: None,
            runner_user: None,
            start_from: None,
        },
    ))
}

/// See [`vm`].
#[derive(Debug, Clone)]
pub struct VmBuilder(ImpVM);

impl VmBuilder {
    pub fn namespace(mut self, ns: &str) -> Self {
        self.0.metadata.namespace = Some(ns.into());
        self
    }
    pub fn class(mut self, class: &str) -> Self {
        self.0.spec.class_ref = ClassRef { name: class.into() };
        self
    }
    pub fn image(mut self, image: &str) -> Self {
        self.0.spec.image = image.into();
        self
    }
    pub fn runner_image(mut self, image: &str) -> Self {
        self.0.spec.runner_image = Some(image.into());
        self
    }
    pub fn ephemeral(mut self) -> Self {
        self.0.spec.lifecycle = Lifecycle::Ephemeral;
        self
    }
    pub fn persistent(mut self) -> Self {
        self.0.spec.lifecycle = Lifecycle::Persistent;
        self
    }
    /// `spec.nodeName`: bound to `node`, as the scheduler (or a user) leaves it.
    pub fn bound(mut self, node: &str) -> Self {
        self.0.spec.node_name = Some(node.into());
        self
    }
    pub fn network(mut self, network: &str) -> Self {
        self.0.spec.network_ref = Some(NetworkRef {
            name: network.into(),
        });
        self
    }
    pub fn restart(mut self, policy: RestartPolicy) -> Self {
        self.0.spec.restart_policy = Some(policy);
        self
    }
    pub fn desired(mut self, state: DesiredState) -> Self {
        self.0.spec.desired_state = Some(state);
        self
    }
    pub fn idle_timeout(mut self, d: &str) -> Self {
        self.0.spec.idle_timeout = Some(duration(d));
        self
    }
    pub fn expire_after(mut self, d: &str) -> Self {
        self.0.spec.expire_after = Some(duration(d));
        self
    }
    pub fn tolerate(mut self, t: Toleration) -> Self {
        self.0.spec.tolerations.get_or_insert_with(Vec::new).push(t);
        self
    }
    /// `spec.runnerConfigSecret`: the Secret holding the VM's JIT config (see [`jit_secret`]).
    pub fn runner_config(mut self, secret: &str) -> Self {
        self.0.spec.runner_config_secret = Some(secret.into());
        self
    }
    pub fn finalizer(mut self, f: &str) -> Self {
        self.0
            .metadata
            .finalizers
            .get_or_insert_with(Vec::new)
            .push(f.into());
        self
    }
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.0
            .metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(key.into(), value.into());
        self
    }
    /// A runner VM of `pool` as the pool controller makes one: its label, the pool as controlling
    /// owner, the pool's namespace. `pool` must have been read back from the API server (it needs a uid).
    pub fn runner_of(mut self, pool: &ImpVMRunnerPool) -> Self {
        let owner = pool
            .controller_owner_ref(&())
            .expect("runner_of: the pool has no uid (use the object the API server returned)");
        let pool_name = owner.name.clone();
        self.0.metadata.namespace = pool.meta().namespace.clone();
        self.0
            .metadata
            .owner_references
            .get_or_insert_with(Vec::new)
            .push(owner);
        self.label(LABEL_RUNNER_POOL, &pool_name)
    }
    pub fn build(self) -> ImpVM {
        self.0
    }
    /// The object as JSON (apiVersion, kind, metadata, spec).
    pub fn json(&self) -> Value {
        json_of(&self.0)
    }
}

impl From<VmBuilder> for ImpVM {
    fn from(b: VmBuilder) -> Self {
        b.build()
    }
}

/// An ImpVMClass with 1 vCPU and 128 MiB (the smallest the schema accepts).
pub fn class(name: &str) -> ClassBuilder {
    ClassBuilder(ImpVMClass::new(
        name,
        ImpVMClassSpec {
            vcpu: 1,
            memory_mib: 128,
            disk_gib: None,
            probes: None,
            restart_policy: None,
        },
    ))
}

/// See [`class`].
#[derive(Debug, Clone)]
pub struct ClassBuilder(ImpVMClass);

impl ClassBuilder {
    pub fn vcpu(mut self, n: u32) -> Self {
        self.0.spec.vcpu = n;
        self
    }
    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.0.spec.memory_mib = mib;
        self
    }
    pub fn disk_gib(mut self, gib: u32) -> Self {
        self.0.spec.disk_gib = Some(gib);
        self
    }
    pub fn restart(mut self, policy: RestartPolicy) -> Self {
        self.0.spec.restart_policy = Some(policy);
        self
    }
    /// A readiness probe: HTTP GET `path` on `port` inside the guest, default timings.
    pub fn readiness_http(mut self, path: &str, port: u16) -> Self {
        self.0.spec.probes = Some(Probes {
            readiness_probe: Some(Probe {
                http: HttpGetProbe {
                    path: path.into(),
                    port,
                },
                period_seconds: None,
                failure_threshold: None,
                timeout_seconds: None,
            }),
        });
        self
    }
    pub fn build(self) -> ImpVMClass {
        self.0
    }
    pub fn json(&self) -> Value {
        json_of(&self.0)
    }
}

impl From<ClassBuilder> for ImpVMClass {
    fn from(b: ClassBuilder) -> Self {
        b.build()
    }
}

/// A restart policy with nothing set (every field inherited or defaulted).
pub fn restart() -> RestartBuilder {
    RestartBuilder(RestartPolicy::default())
}

/// See [`restart`].
#[derive(Debug, Clone)]
pub struct RestartBuilder(RestartPolicy);

impl RestartBuilder {
    pub fn mode(mut self, mode: RestartMode) -> Self {
        self.0.mode = Some(mode);
        self
    }
    pub fn in_place(self) -> Self {
        self.mode(RestartMode::InPlace)
    }
    fn backoff_mut(&mut self) -> &mut Backoff {
        self.0.backoff.get_or_insert_with(Backoff::default)
    }
    pub fn initial_delay(mut self, d: &str) -> Self {
        self.backoff_mut().initial_delay = Some(duration(d));
        self
    }
    pub fn max_delay(mut self, d: &str) -> Self {
        self.backoff_mut().max_delay = Some(duration(d));
        self
    }
    pub fn max_retries(mut self, n: u32) -> Self {
        self.backoff_mut().max_retries = Some(n);
        self
    }
    pub fn on_exhaustion(mut self, what: OnExhaustion) -> Self {
        self.0.on_exhaustion = Some(what);
        self
    }
    /// `onExhaustion: cool-down` with this `coolDownPeriod`.
    pub fn cool_down(mut self, period: &str) -> Self {
        self.0.cool_down_period = Some(duration(period));
        self.on_exhaustion(OnExhaustion::CoolDown)
    }
    pub fn build(self) -> RestartPolicy {
        self.0
    }
}

impl From<RestartBuilder> for RestartPolicy {
    fn from(b: RestartBuilder) -> Self {
        b.build()
    }
}

/// An ImpNetwork on 192.0.2.0/24 (TEST-NET-1), gateway 192.0.2.1, no NAT, no DNS.
pub fn network(name: &str) -> NetworkBuilder {
    NetworkBuilder(ImpNetwork::new(
        name,
        ImpNetworkSpec {
            subnet: "192.0.2.0/24".into(),
            gateway: "192.0.2.1".into(),
            nat: None,
            dns: Vec::new(),
            ipam: None,
            egress: None,
            ingress: vec![],
        },
    ))
}

/// See [`network`].
#[derive(Debug, Clone)]
pub struct NetworkBuilder(ImpNetwork);

impl NetworkBuilder {
    pub fn namespace(mut self, ns: &str) -> Self {
        self.0.metadata.namespace = Some(ns.into());
        self
    }
    pub fn subnet(mut self, subnet: &str, gateway: &str) -> Self {
        self.0.spec.subnet = subnet.into();
        self.0.spec.gateway = gateway.into();
        self
    }
    pub fn nat(mut self) -> Self {
        self.0.spec.nat = Some(Nat {
            enabled: true,
            egress_interface: None,
        });
        self
    }
    pub fn dns(mut self, resolvers: &[&str]) -> Self {
        self.0.spec.dns = resolvers.iter().map(|s| s.to_string()).collect();
        self
    }
    pub fn build(self) -> ImpNetwork {
        self.0
    }
    pub fn json(&self) -> Value {
        json_of(&self.0)
    }
}

impl From<NetworkBuilder> for ImpNetwork {
    fn from(b: NetworkBuilder) -> Self {
        b.build()
    }
}

/// An ImpVMRunnerPool for org `acme` with App Secret `gh-app`, labels `self-hosted, imp`, template
/// class [`CLASS`] and image [`IMAGE`], at most one runner.
pub fn pool(name: &str) -> PoolBuilder {
    PoolBuilder(ImpVMRunnerPool::new(
        name,
        ImpVMRunnerPoolSpec {
            github: GithubRunnerSpec {
                scope: GithubScope {
                    org: Some("acme".into()),
                    repo: None,
                },
                app_secret_ref: LocalObjectReference {
                    name: "gh-app".into(),
                },
                runner_group: None,
                labels: vec!["self-hosted".into(), "imp".into()],
                work_folder: None,
                scale_set: None,
                runner_version: None,
            },
            template: RunnerVmTemplate {
                metadata: None,
                spec: RunnerVmTemplateSpec {
                    class_ref: ClassRef { name: CLASS.into() },
                    image: IMAGE.into(),
                    runner_image: None,
                    image_pull_secrets: Vec::new(),
                    image_pull_policy: None,
                    network_ref: None,
                    node_selector: None,
                    tolerations: None,
                    expire_after: None,
                    runner_user: None,
                },
            },
            scaling: Scaling {
                min_idle: None,
                max_runners: 1,
                scale_up_step: None,
                standby: None,
            },
            webhook_secret_ref: None,
        },
    ))
}

/// See [`pool`].
#[derive(Debug, Clone)]
pub struct PoolBuilder(ImpVMRunnerPool);

impl PoolBuilder {
    pub fn namespace(mut self, ns: &str) -> Self {
        self.0.metadata.namespace = Some(ns.into());
        self
    }
    pub fn org(mut self, org: &str) -> Self {
        self.0.spec.github.scope = GithubScope {
            org: Some(org.into()),
            repo: None,
        };
        self
    }
    /// Repository scope, `owner/name`.
    pub fn repo(mut self, repo: &str) -> Self {
        self.0.spec.github.scope = GithubScope {
            org: None,
            repo: Some(repo.into()),
        };
        self
    }
    /// The Secret with the GitHub App credentials.
    pub fn app_secret(mut self, name: &str) -> Self {
        self.0.spec.github.app_secret_ref = LocalObjectReference { name: name.into() };
        self
    }
    pub fn labels(mut self, labels: &[&str]) -> Self {
        self.0.spec.github.labels = labels.iter().map(|s| s.to_string()).collect();
        self
    }
    /// The template's class.
    pub fn class(mut self, class: &str) -> Self {
        self.0.spec.template.spec.class_ref = ClassRef { name: class.into() };
        self
    }
    /// The template's image.
    pub fn image(mut self, image: &str) -> Self {
        self.0.spec.template.spec.image = image.into();
        self
    }
    pub fn scaling(mut self, scaling: Scaling) -> Self {
        self.0.spec.scaling = scaling;
        self
    }
    pub fn min_idle(mut self, n: u32) -> Self {
        self.0.spec.scaling.min_idle = Some(n);
        self
    }
    pub fn max_runners(mut self, n: u32) -> Self {
        self.0.spec.scaling.max_runners = n;
        self
    }
    pub fn scale_up_step(mut self, n: u32) -> Self {
        self.0.spec.scaling.scale_up_step = Some(n);
        self
    }
    /// `scaling.standby`: runner VMs start from the nodes' snapshot templates.
    pub fn standby(mut self, on: bool) -> Self {
        self.0.spec.scaling.standby = Some(on);
        self
    }
    /// The Secret (default key) with the HMAC secret of webhooks routed to this pool.
    pub fn webhook_secret(mut self, name: &str) -> Self {
        self.0.spec.webhook_secret_ref = Some(SecretKeyRef {
            name: name.into(),
            key: None,
        });
        self
    }
    pub fn build(self) -> ImpVMRunnerPool {
        self.0
    }
    pub fn json(&self) -> Value {
        json_of(&self.0)
    }
}

impl From<PoolBuilder> for ImpVMRunnerPool {
    fn from(b: PoolBuilder) -> Self {
        b.build()
    }
}

/// A JIT-config Secret shaped like the pool controller's: the secret-kind label, the runner's id
/// and name as annotations, the config under [`SECRET_KEY_JITCONFIG`].
pub fn jit_secret(name: &str, jitconfig: &str, runner_id: i64, runner_name: &str) -> Secret {
    let mut s = Secret::default();
    s.metadata.name = Some(name.into());
    s.metadata.labels = Some(BTreeMap::from([(
        LABEL_SECRET_KIND.to_owned(),
        SECRET_KIND_JIT.to_owned(),
    )]));
    s.metadata.annotations = Some(BTreeMap::from([
        (ANNOTATION_RUNNER_ID.to_owned(), runner_id.to_string()),
        (ANNOTATION_RUNNER_NAME.to_owned(), runner_name.to_owned()),
    ]));
    s.string_data = Some(BTreeMap::from([(
        SECRET_KEY_JITCONFIG.to_owned(),
        jitconfig.to_owned(),
    )]));
    s
}

/// [`jit_secret`] as the pool mints it for `vm`: controlled by the VM, and carrying the boot
/// digest of the VM's spec (the agent refuses a config whose digest differs from the VM's).
pub fn jit_secret_for(
    vm: &ImpVM,
    name: &str,
    jitconfig: &str,
    runner_id: i64,
    runner_name: &str,
) -> Secret {
    let mut s = jit_secret(name, jitconfig, runner_id, runner_name);
    s.metadata.owner_references = vm.controller_owner_ref(&()).map(|o| vec![o]);
    s.metadata.annotations.get_or_insert_default().insert(
        ANNOTATION_BOOT_DIGEST.to_owned(),
        imp_api::frozen::boot_digest(&vm.spec),
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_plain_vm_is_ephemeral_with_the_default_class_and_image() {
        assert_eq!(
            vm("x").json(),
            json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM", "metadata": {"name": "x"},
                   "spec": {"classRef": {"name": "small"}, "image": "ghcr.io/imp/runner:1",
                            "lifecycle": "ephemeral"}})
        );
    }

    #[test]
    fn vm_builders_set_the_fields_they_name() {
        let v = vm("svc")
            .namespace("ns")
            .class("big")
            .image("img:2")
            .persistent()
            .bound("n1")
            .network("net")
            .restart(restart().in_place().max_retries(3).build())
            .desired(DesiredState::ScaleToZero)
            .idle_timeout("10s")
            .expire_after("1h")
            .runner_config("jit")
            .finalizer("imp.dev/vm-cleanup")
            .json();
        assert_eq!(
            v,
            json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVM",
                   "metadata": {"name": "svc", "namespace": "ns", "finalizers": ["imp.dev/vm-cleanup"]},
                   "spec": {"classRef": {"name": "big"}, "image": "img:2", "lifecycle": "persistent",
                            "nodeName": "n1", "networkRef": {"name": "net"},
                            "restartPolicy": {"mode": "in-place", "backoff": {"maxRetries": 3}},
                            "desiredState": "ScaleToZero", "idleTimeout": "10s", "expireAfter": "1h",
                            "runnerConfigSecret": "jit"}})
        );
    }

    #[test]
    fn a_runner_vm_carries_the_pool_label_and_controller() {
        let mut p = pool("p").namespace("ns").build();
        p.metadata.uid = Some("u-1".into());
        let v = vm("p-abc").runner_of(&p).build();
        assert_eq!(v.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(
            v.metadata.labels.unwrap()[LABEL_RUNNER_POOL],
            "p",
            "the pool label"
        );
        let owner = &v.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("ImpVMRunnerPool", "p", "u-1")
        );
        assert_eq!(owner.controller, Some(true));
    }

    #[test]
    #[should_panic(expected = "no uid")]
    fn a_runner_vm_of_a_pool_never_created_is_refused() {
        let _ = vm("p-abc").runner_of(&pool("p").build());
    }

    #[test]
    fn class_network_and_pool_defaults_serialize_as_the_api_expects() {
        assert_eq!(
            class("c")
                .vcpu(2)
                .memory_mib(512)
                .restart(restart().cool_down("2s").build())
                .json(),
            json!({"apiVersion": "imp.dev/v1alpha1", "kind": "ImpVMClass", "metadata": {"name": "c"},
                   "spec": {"vcpu": 2, "memoryMiB": 512,
                            "restartPolicy": {"onExhaustion": "cool-down", "coolDownPeriod": "2s"}}})
        );
        assert_eq!(
            network("n").nat().dns(&["192.0.2.53"]).json()["spec"],
            json!({"subnet": "192.0.2.0/24", "gateway": "192.0.2.1", "nat": {"enabled": true},
                   "dns": ["192.0.2.53"]})
        );
        assert_eq!(
            pool("p")
                .min_idle(1)
                .max_runners(5)
                .webhook_secret("wh")
                .json()["spec"],
            json!({"github": {"scope": {"org": "acme"}, "appSecretRef": {"name": "gh-app"},
                              "labels": ["self-hosted", "imp"]},
                   "template": {"spec": {"classRef": {"name": "small"}, "image": "ghcr.io/imp/runner:1"}},
                   "scaling": {"minIdle": 1, "maxRunners": 5},
                   "webhookSecretRef": {"name": "wh"}})
        );
    }

    #[test]
    fn a_jit_secret_is_labelled_and_annotated_like_the_pool_controllers() {
        let s = jit_secret("vm-jit", "c2VjcmV0", 42, "imp-test-runner");
        assert_eq!(
            serde_json::to_value(&s).unwrap(),
            json!({"apiVersion": "v1", "kind": "Secret",
                   "metadata": {"name": "vm-jit", "labels": {"imp.dev/secret-kind": "jitconfig"},
                                "annotations": {"imp.dev/github-runner-id": "42",
                                                "imp.dev/github-runner-name": "imp-test-runner"}},
                   "stringData": {"jitconfig": "c2VjcmV0"}})
        );
    }

    #[test]
    #[should_panic(expected = "fixture duration \"ten\"")]
    fn a_bad_duration_names_itself() {
        let _ = vm("x").expire_after("ten");
    }
}
