//! docs/rbac.md's tables against the real API server: the chart is installed (once with
//! `runnerNamespaces` set, once empty: the release namespace alone), and every row is asked as a
//! SubjectAccessReview impersonating that component's ServiceAccount. A rule widened or missing in helm/imp/templates/rbac.yaml fails its row (the widening
//! test proves it: a rule added to the installed operator ClusterRole makes the rows it breaks fail).

use std::{path::Path, process::Output};

use imp_api::ImpVM;
use imp_testkit::{TestEnv, fixtures, paths};
use k8s_openapi::api::{
    authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec},
    authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec},
    coordination::v1::Lease,
    core::v1::{Node, ServiceAccount},
    rbac::v1::{ClusterRole, PolicyRule},
};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;

/// One row of a docs/rbac.md table.
#[derive(Debug)]
struct Row {
    component: String,
    verb: String,
    group: String,
    resource: String,
    subresource: Option<String>,
    /// `release`, `runner`, `other` or `cluster`.
    namespace: String,
    name: Option<String>,
    allowed: bool,
}

/// The rows of the table under the heading `## {heading}` in docs/rbac.md.
fn table(heading: &str) -> Vec<Row> {
    let path = paths::workspace_root().join("docs/rbac.md");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let start = text
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("{}: no heading `## {heading}`", path.display()));
    let rows: Vec<Row> = text[start..]
        .lines()
        .skip(2)
        .take_while(|l| !l.starts_with("## "))
        .filter(|l| l.starts_with('|'))
        .skip(2) // header and separator
        .map(|l| parse_row(l, &path))
        .collect();
    assert!(
        rows.len() >= 5,
        "{}: the table under `## {heading}` has only {} rows",
        path.display(),
        rows.len()
    );
    rows
}

fn parse_row(line: &str, path: &Path) -> Row {
    let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
    let [component, verb, resource, namespace, name, decision] = cells[..] else {
        panic!("{}: row `{line}` has not 6 cells", path.display());
    };
    // `group/resource[/subresource]`; the core group has no prefix.
    let mut parts: Vec<&str> = resource.split('/').collect();
    if !parts[0].contains('.') {
        parts.insert(0, "");
    }
    let allowed = match decision {
        "allowed" => true,
        "denied" => false,
        other => panic!(
            "{}: row `{line}`: decision `{other}` is neither allowed nor denied",
            path.display()
        ),
    };
    assert!(
        ["release", "runner", "other", "cluster"].contains(&namespace),
        "{}: row `{line}`: unknown namespace `{namespace}`",
        path.display()
    );
    Row {
        component: component.to_owned(),
        verb: verb.to_owned(),
        group: parts[0].to_owned(),
        resource: parts[1].to_owned(),
        subresource: parts.get(2).map(|s| (*s).to_owned()),
        namespace: namespace.to_owned(),
        name: (!name.is_empty()).then(|| name.to_owned()),
        allowed,
    }
}

fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A chart release in `env`'s namespace, uninstalled on drop (its ClusterRoles are cluster-scoped).
struct Release<'a> {
    env: &'a TestEnv,
    home: tempfile::TempDir,
    name: String,
}

impl<'a> Release<'a> {
    fn install(env: &'a TestEnv, name: &str, runner_namespaces: &[&str]) -> Self {
        let home = tempfile::tempdir().unwrap();
        let mut cmd = env.helm(home.path());
        cmd.args(["install", name])
            .arg(paths::chart_dir())
            .args(["--skip-crds", "--wait=false"])
            .args(["--set", "agent.env.kernelPath=/var/lib/imp/vmlinux"])
            .args(["--set", "agent.env.fcBinPath=/usr/local/bin/firecracker"])
            .args(["--set", "agent.env.jailerPath=/usr/local/bin/jailer"])
            .args(["--set", "operator.webhookSecretName=imp-webhook"])
            .args(["--set", "metrics.serviceMonitor.enabled=false"])
            .args(["--set", "metrics.podMonitor.enabled=false"]);
        if !runner_namespaces.is_empty() {
            cmd.args([
                "--set",
                &format!("runnerNamespaces={{{}}}", runner_namespaces.join(",")),
            ]);
        }
        let out = cmd.output().expect("run helm");
        assert!(
            out.status.success(),
            "helm install {name}: {}",
            output_text(&out)
        );
        Self {
            env,
            home,
            name: name.to_owned(),
        }
    }

    fn service_account(&self, component: &str) -> String {
        // The release names below never contain the chart's name: fullname is `<release>-imp`.
        format!(
            "system:serviceaccount:{}:{}-imp-{component}",
            self.env.namespace, self.name
        )
    }
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        let _ = self
            .env
            .helm(self.home.path())
            .args(["uninstall", &self.name])
            .output();
    }
}

/// Asks every row as its component's ServiceAccount; all mismatches are reported together.
async fn check(release: &Release<'_>, rows: &[Row], runner: &str, other: &str) {
    let wrong = wrong_rows(release, rows, runner, other).await;
    assert!(
        wrong.is_empty(),
        "{} of {} docs/rbac.md rows do not hold:\n{}",
        wrong.len(),
        rows.len(),
        wrong
            .iter()
            .map(|(_, w)| w.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The rows (index, what the API server said) whose decision differs from the table's.
async fn wrong_rows(
    release: &Release<'_>,
    rows: &[Row],
    runner: &str,
    other: &str,
) -> Vec<(usize, String)> {
    let api: Api<SubjectAccessReview> = Api::all(release.env.client.clone());
    let mut wrong = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let namespace = match row.namespace.as_str() {
            "release" => Some(release.env.namespace.clone()),
            "runner" => Some(runner.to_owned()),
            "other" => Some(other.to_owned()),
            _ => None,
        };
        let sa_namespace = release.env.namespace.clone();
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(release.service_account(&row.component)),
                // The groups a ServiceAccount token carries.
                groups: Some(vec![
                    "system:serviceaccounts".into(),
                    format!("system:serviceaccounts:{sa_namespace}"),
                    "system:authenticated".into(),
                ]),
                resource_attributes: Some(ResourceAttributes {
                    group: Some(row.group.clone()),
                    resource: Some(row.resource.clone()),
                    subresource: row.subresource.clone(),
                    verb: Some(row.verb.clone()),
                    namespace,
                    name: row.name.clone(),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let answer = api
            .create(&PostParams::default(), &review)
            .await
            .unwrap_or_else(|e| panic!("SubjectAccessReview for {row:?}: {e}"));
        let status = answer.status.expect("SubjectAccessReview status");
        if status.allowed != row.allowed {
            wrong.push((
                i,
                format!(
                    "{row:?}: the API server says allowed={} ({})",
                    status.allowed,
                    status.reason.unwrap_or_default()
                ),
            ));
        }
    }
    wrong
}

#[tokio::test]
async fn rbac_table_holds_with_runner_namespaces() {
    let env = TestEnv::new("rbac").await;
    let runner = TestEnv::new("rbacrun").await;
    let other = TestEnv::new("rbacother").await;
    let suffix = &env.namespace[env.namespace.len() - 8..];
    let release = Release::install(&env, &format!("rbac-{suffix}"), &[&runner.namespace]);
    check(
        &release,
        &table("With runnerNamespaces set"),
        &runner.namespace,
        &other.namespace,
    )
    .await;
}

#[tokio::test]
async fn rbac_table_holds_with_runner_namespaces_empty() {
    // Empty means the release namespace alone: no Secret access anywhere else (issue 30).
    let env = TestEnv::new("rbacwide").await;
    let other = TestEnv::new("rbacother").await;
    let suffix = &env.namespace[env.namespace.len() - 8..];
    let release = Release::install(&env, &format!("rbacwide-{suffix}"), &[]);
    check(
        &release,
        &table("With runnerNamespaces empty (the release namespace)"),
        &env.namespace,
        &other.namespace,
    )
    .await;
}

/// The table is a real check: the installed chart passes it, and the operator's ClusterRole widened by
/// one rule (list and watch on every Secret, what the chart once granted) fails exactly the rows that
/// rule breaks.
#[tokio::test]
async fn rbac_table_fails_when_a_rule_is_widened() {
    let env = TestEnv::new("rbacwiden").await;
    let runner = TestEnv::new("rbacwrun").await;
    let other = TestEnv::new("rbacwother").await;
    let suffix = &env.namespace[env.namespace.len() - 8..];
    let release = Release::install(&env, &format!("rbacwiden-{suffix}"), &[&runner.namespace]);
    let rows = table("With runnerNamespaces set");
    let before = wrong_rows(&release, &rows, &runner.namespace, &other.namespace).await;
    assert!(
        before.is_empty(),
        "the table fails before widening: {before:?}"
    );

    let roles: Api<ClusterRole> = Api::all(env.client.clone());
    let name = format!("{}-imp-operator", release.name);
    let mut role = roles.get(&name).await.expect("the operator ClusterRole");
    role.rules.get_or_insert_with(Vec::new).push(PolicyRule {
        api_groups: Some(vec![String::new()]),
        resources: Some(vec!["secrets".into()]),
        verbs: vec!["list".into(), "watch".into()],
        ..PolicyRule::default()
    });
    roles
        .replace(&name, &PostParams::default(), &role)
        .await
        .expect("widen the operator ClusterRole");
    let broken = |r: &Row| {
        r.component == "operator"
            && r.resource == "secrets"
            && (r.verb == "list" || r.verb == "watch")
            && !r.allowed
    };
    let expected: Vec<usize> = (0..rows.len()).filter(|&i| broken(&rows[i])).collect();
    assert!(
        expected.len() >= 4,
        "docs/rbac.md lost its operator list/watch Secret rows: {expected:?}"
    );
    // The authorizer sees RBAC changes through its informers: give it a few seconds.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let wrong = wrong_rows(&release, &rows, &runner.namespace, &other.namespace).await;
        let failing: Vec<usize> = wrong.iter().map(|(i, _)| *i).collect();
        if failing == expected {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "after widening, failing rows {failing:?} are not the operator's list/watch Secret rows \
             {expected:?}: {wrong:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// Cluster-scoped Nodes a test made, deleted also when it fails.
struct Nodes {
    kubeconfig: std::path::PathBuf,
    names: Vec<String>,
}

impl Drop for Nodes {
    fn drop(&mut self) {
        let names = self.names.clone();
        imp_testkit::cluster::with_fresh_client(&self.kubeconfig, move |client| async move {
            for n in names {
                let _ = Api::<Node>::all(client.clone())
                    .delete(&n, &Default::default())
                    .await;
            }
        });
    }
}

/// A client authenticated as the agent's ServiceAccount with a token from the TokenRequest API,
/// bound to `node` (the node name then rides in the user's extra, as in a pod-bound token).
async fn agent_client(release: &Release<'_>, node: Option<&Node>) -> kube::Client {
    let env = release.env;
    let sa = format!("{}-imp-agent", release.name);
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: None,
            expiration_seconds: Some(600),
            bound_object_ref: node.map(|n| BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: n.metadata.name.clone(),
                uid: n.metadata.uid.clone(),
            }),
        }),
        ..TokenRequest::default()
    };
    let token = Api::<ServiceAccount>::namespaced(env.client.clone(), &env.namespace)
        .create_token_request(&sa, &PostParams::default(), &request)
        .await
        .expect("TokenRequest for the agent's ServiceAccount")
        .status
        .and_then(|s| s.token)
        .expect("TokenRequest status with a token");
    let kubeconfig = kube::config::Kubeconfig::read_from(env.kubeconfig_path()).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.into()),
        ..Default::default()
    };
    kube::Client::try_from(config).unwrap()
}

/// `Ok` or the API server's (code, message).
fn outcome<T>(r: kube::Result<T>) -> Result<(), (u16, String)> {
    match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) => Err((e.code, e.message)),
        Err(e) => panic!("unexpected client error: {e}"),
    }
}

/// The agent's node restriction (helm/imp/templates/agent-node-restriction.yaml, issue 30) through
/// the real API server, with real tokens of the agent's ServiceAccount: bound to node A it may write
/// Node A, the status of a VM bound to A and Lease imp-node-A; Node B, a VM bound to B or to no
/// node, and B's Lease are refused; a token bound to no node writes nothing. RBAC allows all of it
/// (the cluster-wide rules the tables show): the policy is what refuses.
#[tokio::test]
async fn an_agent_token_bound_to_node_a_writes_only_node_a() {
    let env = TestEnv::new("noderestr").await;
    let suffix = env.namespace[env.namespace.len() - 8..].to_owned();
    let release = Release::install(&env, &format!("nr-{suffix}"), &[&env.namespace]);
    let nodes_api: Api<Node> = Api::all(env.client.clone());
    let (a, b) = (format!("nr-a-{suffix}"), format!("nr-b-{suffix}"));
    let _cleanup = Nodes {
        kubeconfig: env.kubeconfig_path().to_path_buf(),
        names: vec![a.clone(), b.clone()],
    };
    let mut made = Vec::new();
    for n in [&a, &b] {
        let mut node = Node::default();
        node.metadata.name = Some(n.clone());
        made.push(
            nodes_api
                .create(&PostParams::default(), &node)
                .await
                .unwrap(),
        );
    }
    let vms: Api<ImpVM> = env.api();
    for (vm, node) in [("on-a", Some(&a)), ("on-b", Some(&b)), ("unbound", None)] {
        let mut b = fixtures::vm(vm)
            .namespace(&env.namespace)
            .class("c")
            .image("i:1");
        if let Some(n) = node {
            b = b.bound(n);
        }
        vms.create(&PostParams::default(), &b.build())
            .await
            .unwrap();
    }

    let as_a = agent_client(&release, Some(&made[0])).await;
    let nodes: Api<Node> = Api::all(as_a.clone());
    let vms: Api<ImpVM> = Api::namespaced(as_a.clone(), &env.namespace);
    let leases: Api<Lease> = Api::namespaced(as_a.clone(), &env.namespace);
    let annotate = json!({"metadata": {"annotations": {"imp.dev/capacity-vcpu": "4"}}});
    let patch_node = |n: String| {
        let nodes = nodes.clone();
        let annotate = annotate.clone();
        async move {
            outcome(
                nodes
                    .patch(&n, &PatchParams::default(), &Patch::Merge(&annotate))
                    .await,
            )
        }
    };
    // The policy reaches the API server's admission through an informer: wait for it to refuse.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let refused = loop {
        match patch_node(b.clone()).await {
            Err(e) => break e,
            Ok(()) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await
            }
            Ok(()) => panic!("node A's agent patched Node {b} for 30s: the policy is not in force"),
        }
    };
    assert_eq!(refused.0, 403, "{refused:?}");
    assert!(
        refused
            .1
            .contains(&format!("imp-agent of node {a} may not write Node {b}")),
        "{refused:?}"
    );
    patch_node(a.clone())
        .await
        .unwrap_or_else(|e| panic!("node A's agent patching Node A: {e:?}"));

    let write_status = |name: &'static str| {
        let vms = vms.clone();
        async move {
            let mut vm = vms.get(name).await.unwrap();
            vm.status = Some(imp_api::ImpVMStatus {
                reason: Some("Probe".into()),
                ..Default::default()
            });
            outcome(vms.replace_status(name, &PostParams::default(), &vm).await)
        }
    };
    write_status("on-a")
        .await
        .unwrap_or_else(|e| panic!("status of the VM bound to A: {e:?}"));
    for vm in ["on-b", "unbound"] {
        let (code, msg) = write_status(vm).await.unwrap_err();
        assert!(
            code == 403 && msg.contains(&format!("may not write ImpVM {vm}")),
            "{vm}: {code} {msg}"
        );
    }

    let lease = |node: &str| {
        let mut l = Lease::default();
        l.metadata.name = Some(imp_api::names::lease_name(node));
        l
    };
    outcome(leases.create(&PostParams::default(), &lease(&a)).await)
        .unwrap_or_else(|e| panic!("Lease of A: {e:?}"));
    let (code, msg) = outcome(leases.create(&PostParams::default(), &lease(&b)).await).unwrap_err();
    assert!(
        code == 403 && msg.contains("may write only Lease"),
        "{code} {msg}"
    );

    // A token of the same ServiceAccount bound to no node: refused everywhere, Node A included.
    let unbound = agent_client(&release, None).await;
    let (code, msg) = outcome(
        Api::<Node>::all(unbound)
            .patch(&a, &PatchParams::default(), &Patch::Merge(&annotate))
            .await,
    )
    .unwrap_err();
    assert!(
        code == 403 && msg.contains("bound to no node"),
        "{code} {msg}"
    );
}
