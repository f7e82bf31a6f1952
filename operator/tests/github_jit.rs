//! JIT runner configs for org and repo scope, runner groups, and the whole job path: mint ->
//! fake runner (in-process and the real `imp-fake-runner` binary) -> signed workflow_job webhooks.

mod github_common;

use std::collections::BTreeSet;
use std::time::Duration;

use github_common::*;
use imp_common::ExposeSecret;
use imp_operator::github::{
    DEFAULT_RUNNER_GROUP_ID, ErrorClass, GithubConfig, GithubError, JitRequest, RunnerScope,
    runner_name,
};
use imp_testkit::github::runner_protocol::{
    FakeRunnerOptions, JITCONFIG_ENV, JitConfigPayload, run_fake_runner,
};
use imp_testkit::github::{
    Fault, FaultRule, JobSpec, JobStatus, WebhookSink, fake_runner_binary, verify_signature,
};

#[tokio::test]
async fn org_jit_config_carries_name_labels_group_and_work_folder() {
    let sim = sim().await;
    let app = app(&sim);
    let name = runner_name("pool-a", "3f2b8c1e-77aa-4c1d-9e0f-0123456789ab");
    let req = JitRequest {
        work_folder: "/work/runner".into(),
        ..jit(org(&sim), &name)
    };
    let minted = app.generate_jit_config(&req).await.unwrap();
    assert_eq!(minted.runner_name, "pool-a-3f2b8c1e77aa");
    assert_eq!(minted.runner_group_id, DEFAULT_RUNNER_GROUP_ID);
    let payload = JitConfigPayload::decode(minted.encoded_jit_config.expose_secret()).unwrap();
    assert_eq!(payload.runner_id, minted.runner_id);
    assert_eq!(payload.work_folder, "/work/runner");
    assert_eq!(payload.labels, req.labels);
    let registered = sim.runners();
    assert_eq!(registered.len(), 1);
    // GitHub adds the defaults (X64 here) to the asked-for labels (self-hosted, imp, linux).
    assert_eq!(registered[0].labels, ["self-hosted", "Linux", "X64", "imp"]);
    assert_eq!(registered[0].status, "offline");
    // GitHub's view of it.
    let r = app
        .get_runner(&org(&sim), minted.runner_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.label_names(), vec!["self-hosted", "Linux", "X64", "imp"]);
    assert!(r.ephemeral && !r.busy);
    // The config is redacted in Debug.
    let dbg = format!("{minted:?}");
    assert!(
        !dbg.contains(minted.encoded_jit_config.expose_secret()),
        "{dbg}"
    );
}

#[tokio::test]
async fn repo_scope_mints_in_the_default_group_and_refuses_named_groups() {
    let sim = sim().await;
    let app = app(&sim);
    let minted = app
        .generate_jit_config(&jit(repo(), "repo-runner"))
        .await
        .unwrap();
    assert_eq!(minted.runner_group_id, DEFAULT_RUNNER_GROUP_ID);
    assert_eq!(app.list_runners(&repo()).await.unwrap().len(), 1);
    assert_eq!(
        app.list_runners(&org(&sim)).await.unwrap().len(),
        0,
        "repo runners are not org runners"
    );
    let req = JitRequest {
        runner_group: Some("builders".into()),
        ..jit(repo(), "x")
    };
    let err = app.generate_jit_config(&req).await.unwrap_err();
    assert!(matches!(err, GithubError::InvalidRequest(_)), "{err:?}");
    // An unknown repository is a 404 with a hint about access and permission.
    let err = app
        .generate_jit_config(&jit(RunnerScope::repo("octo-org", "nope"), "x"))
        .await
        .unwrap_err();
    assert!(matches!(err, GithubError::NotFound { .. }), "{err:?}");
    assert!(err.to_string().contains("administration"), "{err}");
}

#[tokio::test]
async fn enterprise_scope_is_refused_without_calling_github() {
    let sim = sim().await;
    let app = app(&sim);
    let scope = RunnerScope::Enterprise {
        enterprise: "acme".into(),
    };
    let err = app
        .generate_jit_config(&jit(scope.clone(), "x"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, GithubError::EnterpriseScopeUnsupported),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Permanent);
    assert!(err.to_string().contains("organization or repository scope"));
    assert!(matches!(
        app.list_runners(&scope).await,
        Err(GithubError::EnterpriseScopeUnsupported)
    ));
    assert_eq!(sim.stats().api_requests, 0);
}

#[tokio::test]
async fn runner_groups_resolve_by_name_across_pages_and_are_cached() {
    let groups: Vec<String> = (0..230).map(|i| format!("group-{i}")).collect();
    let sim = sim_with(|c| c.runner_groups = groups).await;
    let app = app(&sim);
    let scope = org(&sim);
    assert_eq!(app.list_runner_groups(&scope).await.unwrap().len(), 231);
    let requests = sim.stats().api_requests;
    assert_eq!(
        requests,
        3 + 1,
        "three pages of 100 (plus the token exchange)"
    );
    // group-220 is on the third page; ids are assigned from 2.
    assert_eq!(
        app.runner_group_id(&scope, Some("group-220"))
            .await
            .unwrap(),
        222
    );
    assert_eq!(
        app.runner_group_id(&scope, None).await.unwrap(),
        DEFAULT_RUNNER_GROUP_ID
    );
    let after_lookups = sim.stats().api_requests;
    assert_eq!(
        app.runner_group_id(&scope, Some("group-220"))
            .await
            .unwrap(),
        222
    );
    assert_eq!(sim.stats().api_requests, after_lookups, "served from cache");
    let req = JitRequest {
        runner_group: Some("group-5".into()),
        ..jit(scope.clone(), "grouped")
    };
    let minted = app.generate_jit_config(&req).await.unwrap();
    assert_eq!(minted.runner_group_id, 7);
    assert_eq!(sim.runners()[0].runner_group_id, 7);
    let err = app
        .runner_group_id(&scope, Some("missing"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, GithubError::RunnerGroupNotFound { .. }),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Permanent);
}

#[tokio::test]
async fn missing_app_permission_is_forbidden_with_the_permission_named() {
    let sim = sim().await;
    sim.set_permission("organization_self_hosted_runners", None);
    sim.set_permission("administration", Some("read"));
    let app = app(&sim);
    let err = app
        .generate_jit_config(&jit(org(&sim), "x"))
        .await
        .unwrap_err();
    assert!(matches!(err, GithubError::Forbidden { .. }), "{err:?}");
    assert_eq!(err.class(), ErrorClass::Permanent);
    assert!(
        err.to_string().contains("organization_self_hosted_runners"),
        "{err}"
    );
    let err = app
        .generate_jit_config(&jit(repo(), "x"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("administration=write"), "{err}");
    // Reading still works with read permission.
    app.list_runners(&repo()).await.unwrap();
}

#[tokio::test]
async fn a_stale_registration_with_the_same_name_is_replaced() {
    let sim = sim().await;
    let app = app(&sim);
    let first = app
        .generate_jit_config(&jit(org(&sim), "pool-abc"))
        .await
        .unwrap();
    // The same name again (an earlier attempt whose answer was lost): the offline one is removed.
    let second = app
        .generate_jit_config(&jit(org(&sim), "pool-abc"))
        .await
        .unwrap();
    assert_ne!(first.runner_id, second.runner_id);
    let ids: Vec<u64> = sim.runners().iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![second.runner_id]);
}

#[tokio::test]
async fn a_lost_mint_answer_is_recovered_by_replacing_the_registration() {
    let sim = sim().await;
    let app = app_with(
        &sim,
        GithubConfig {
            request_timeout: Duration::from_millis(800),
            ..config(&sim)
        },
    );
    app.installation_token().await.unwrap();
    // GitHub registers the runner but the answer never arrives in time.
    sim.inject(
        FaultRule::next(1, Fault::DelayAnswer { millis: 2500 }).on_path("generate-jitconfig"),
    );
    let minted = app
        .generate_jit_config(&jit(org(&sim), "lost-answer"))
        .await
        .unwrap();
    let runners = sim.runners();
    assert_eq!(runners.len(), 1, "the orphan was deleted");
    assert_eq!(runners[0].id, minted.runner_id);
    assert_eq!(sim.stats().jit_configs_issued, 2);
    assert_eq!(sim.stats().runners_deleted, 1);
    // The config we hold works.
    let job = sim.queue_job(JobSpec {
        labels: vec!["imp".into()],
        ..Default::default()
    });
    run_fake_runner(
        minted.encoded_jit_config.expose_secret(),
        &FakeRunnerOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(sim.job(job.id).unwrap().status, JobStatus::Completed);
}

#[tokio::test]
async fn a_name_held_by_a_live_runner_is_a_conflict() {
    let sim = sim().await;
    let app = app(&sim);
    let minted = app
        .generate_jit_config(&jit(org(&sim), "busy-one"))
        .await
        .unwrap();
    sim.queue_job(JobSpec {
        labels: vec!["imp".into()],
        ..Default::default()
    });
    let cfg = minted.encoded_jit_config.expose_secret().to_string();
    let opts = FakeRunnerOptions {
        job_duration: Duration::from_secs(2),
        ..Default::default()
    };
    let runner = tokio::spawn(async move { run_fake_runner(&cfg, &opts).await });
    // Wait until the runner holds the job.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !sim.runners().iter().any(|r| r.busy) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "runner never went busy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let err = app
        .generate_jit_config(&jit(org(&sim), "busy-one"))
        .await
        .unwrap_err();
    assert!(matches!(err, GithubError::Conflict { .. }), "{err:?}");
    runner.await.unwrap().unwrap();
}

/// The `workflow_job` keys GitHub's schema requires (reference/github/webhooks/, octokit's schema).
fn workflow_job_keys() -> BTreeSet<String> {
    let path =
        imp_testkit::paths::reference_dir().join("github/webhooks/common.workflow-job.schema.json");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let schema: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let keys: BTreeSet<String> = schema["required"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: no `required` list", path.display()))
        .iter()
        .map(|k| k.as_str().expect("required keys are strings").to_string())
        .collect();
    assert!(keys.contains("runner_name"), "{}: {keys:?}", path.display());
    keys
}

#[tokio::test]
async fn a_job_runs_on_a_minted_runner_with_signed_webhooks() {
    let sink = WebhookSink::start().await.unwrap();
    let secret = "hook-secret";
    let sim = sim().await;
    sim.set_webhook(sink.url(), secret);
    let app = app(&sim);
    let minted = app
        .generate_jit_config(&jit(org(&sim), "pool-job"))
        .await
        .unwrap();
    // A job the runner cannot take (label it lacks) stays queued.
    let other = sim.queue_job(JobSpec {
        labels: vec!["gpu".into()],
        ..Default::default()
    });
    let job = sim.queue_job(JobSpec {
        labels: vec!["self-hosted".into(), "imp".into()],
        ..Default::default()
    });
    let ran = run_fake_runner(
        minted.encoded_jit_config.expose_secret(),
        &FakeRunnerOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(ran.id, job.id);
    let done = sim.job(job.id).unwrap();
    assert_eq!(done.status, JobStatus::Completed);
    assert_eq!(done.conclusion.as_deref(), Some("success"));
    assert_eq!(done.runner_id, Some(minted.runner_id));
    assert_eq!(sim.job(other.id).unwrap().status, JobStatus::Queued);
    assert!(
        sim.runners().is_empty(),
        "ephemeral registration removed after the job"
    );
    // The one-time config cannot be used twice.
    assert!(
        run_fake_runner(
            minted.encoded_jit_config.expose_secret(),
            &FakeRunnerOptions::default()
        )
        .await
        .is_err()
    );

    let hooks = sink.wait_for(4, Duration::from_secs(5)).await;
    let seq: Vec<(u64, String)> = hooks.iter().map(|h| h.job_action()).collect();
    assert_eq!(
        seq,
        vec![
            (other.id, "queued".to_string()),
            (job.id, "queued".to_string()),
            (job.id, "in_progress".to_string()),
            (job.id, "completed".to_string()),
        ]
    );
    let mut delivery_ids = BTreeSet::new();
    let required = workflow_job_keys();
    for h in &hooks {
        assert_eq!(h.header("x-github-event"), Some("workflow_job"));
        assert!(verify_signature(
            secret,
            &h.body,
            h.header("x-hub-signature-256").unwrap()
        ));
        delivery_ids.insert(h.header("x-github-delivery").unwrap().to_string());
        let body = h.json();
        let wj = body["workflow_job"].as_object().unwrap();
        let keys: BTreeSet<String> = wj.keys().cloned().collect();
        assert_eq!(keys, required, "workflow_job keys");
        for k in [
            "action",
            "repository",
            "sender",
            "installation",
            "organization",
        ] {
            assert!(body.get(k).is_some(), "missing {k}");
        }
    }
    assert_eq!(delivery_ids.len(), 4, "each delivery has its own id");
    let completed = hooks[3].json();
    assert_eq!(completed["workflow_job"]["conclusion"], "success");
    assert_eq!(completed["workflow_job"]["runner_name"], "pool-job");
    assert_eq!(completed["workflow_job"]["runner_group_name"], "Default");
    assert_eq!(
        hooks[1].json()["workflow_job"]["runner_id"],
        serde_json::Value::Null
    );
}

#[tokio::test]
async fn the_fake_runner_binary_takes_its_config_from_the_environment() {
    let bin = fake_runner_binary().expect("imp-fake-runner builds");
    let sim = sim().await;
    let app = app(&sim);
    let minted = app
        .generate_jit_config(&jit(repo(), "bin-runner"))
        .await
        .unwrap();
    let job = sim.queue_job(JobSpec {
        labels: vec!["imp".into()],
        ..Default::default()
    });
    let child = tokio::process::Command::new(&bin)
        .env(JITCONFIG_ENV, minted.encoded_jit_config.expose_secret())
        .env("IMP_FAKE_RUNNER_JOB_WAIT_SECS", "20")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The config is not on the command line.
    let pid = child.id().unwrap();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&cmdline).contains(minted.encoded_jit_config.expose_secret()));
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(sim.job(job.id).unwrap().status, JobStatus::Completed);
    assert!(sim.runners().is_empty());

    // Without a config it exits 2; with a used config it fails (1).
    let out = tokio::process::Command::new(&bin)
        .env_remove(JITCONFIG_ENV)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = tokio::process::Command::new(&bin)
        .arg("--jitconfig")
        .arg(minted.encoded_jit_config.expose_secret())
        .env_remove(JITCONFIG_ENV)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "a JIT config is one-time");
}

#[tokio::test]
async fn the_queued_job_sweep_finds_jobs_whose_webhook_was_lost() {
    let sim =
        sim_with(|c| c.repos = vec!["octo-org/octo-repo".into(), "octo-org/other".into()]).await;
    sim.inject_webhook_fault(imp_testkit::github::WebhookFault::Drop, 10);
    let app = app(&sim);
    let a = sim.queue_job(JobSpec {
        labels: vec!["imp".into(), "large".into()],
        ..Default::default()
    });
    let b = sim.queue_job(JobSpec {
        labels: vec!["imp".into(), "gpu".into()],
        repository: Some("octo-org/other".into()),
        ..Default::default()
    });
    let c = sim.queue_job(JobSpec {
        labels: vec!["imp".into()],
        ..Default::default()
    });
    // c is taken by a runner: no longer queued.
    let minted = app
        .generate_jit_config(&jit(org(&sim), "sweeper"))
        .await
        .unwrap();
    let cfg = minted.encoded_jit_config.expose_secret().to_string();
    let opts = FakeRunnerOptions {
        job_duration: Duration::from_secs(3),
        ..Default::default()
    };
    let runner = tokio::spawn(async move { run_fake_runner(&cfg, &opts).await });
    sim.wait_job(c.id, Duration::from_secs(5), |j| {
        j.status == JobStatus::InProgress
    })
    .await
    .unwrap();
    let repos = app.list_installation_repositories().await.unwrap();
    assert_eq!(
        repos,
        vec![
            "octo-org/octo-repo".to_string(),
            "octo-org/other".to_string()
        ]
    );
    let mut found = Vec::new();
    for full in &repos {
        let (owner, repo) = full.split_once('/').unwrap();
        let mut calls = imp_operator::github::CallCount::default();
        found.extend(app.list_active_jobs(owner, repo, &mut calls).await.unwrap());
    }
    // The in-progress job is listed with its runner; the sweep's demand keeps only the queued.
    found.sort_by_key(|j| j.id);
    let ids: Vec<(u64, &str)> = found.iter().map(|j| (j.id, j.status.as_str())).collect();
    assert_eq!(
        ids,
        vec![(a.id, "queued"), (b.id, "queued"), (c.id, "in_progress")]
    );
    assert_eq!(
        found[0].labels,
        vec!["imp".to_string(), "large".to_string()]
    );
    assert_eq!(found[0].status, "queued");
    // Without the actions permission the sweep is forbidden, naming it.
    sim.set_permission("actions", None);
    let err = app
        .list_active_jobs(
            "octo-org",
            "octo-repo",
            &mut imp_operator::github::CallCount::default(),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("actions=read"), "{err}");
    runner.await.unwrap().unwrap();
}
