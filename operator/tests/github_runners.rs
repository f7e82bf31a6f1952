//! Runners: get, paginated list, idempotent delete, busy runners, and the rate-limit gauge.

mod github_common;

use std::time::Duration;

use github_common::*;
use imp_common::ExposeSecret;
use imp_operator::github::{DeleteOutcome, ErrorClass, GithubError, GithubMetrics, runner_name};
use imp_testkit::github::JobSpec;
use imp_testkit::github::runner_protocol::{FakeRunnerOptions, run_fake_runner};
use prometheus_client::registry::Registry;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_follows_pages_get_and_delete_are_idempotent() {
    let sim = sim().await;
    let app = app(&sim);
    let scope = org(&sim);
    let mut ids = Vec::new();
    for i in 0..230 {
        ids.push(
            app.generate_jit_config(&jit(scope.clone(), &runner_name("p", &format!("{i:04}"))))
                .await
                .unwrap()
                .runner_id,
        );
    }
    let before = sim.stats().api_requests;
    let listed = app.list_runners(&scope).await.unwrap();
    assert_eq!(sim.stats().api_requests - before, 3, "pages of 100");
    let mut listed_ids: Vec<u64> = listed.iter().map(|r| r.id).collect();
    listed_ids.sort();
    assert_eq!(listed_ids, ids);

    let some = app.get_runner(&scope, ids[17]).await.unwrap().unwrap();
    assert_eq!(some.name, "p-0017");
    assert_eq!(app.get_runner(&scope, 999_999).await.unwrap(), None);
    assert_eq!(
        app.delete_runner(&scope, ids[17]).await.unwrap(),
        DeleteOutcome::Deleted
    );
    assert_eq!(
        app.delete_runner(&scope, ids[17]).await.unwrap(),
        DeleteOutcome::AlreadyGone
    );
    assert_eq!(app.get_runner(&scope, ids[17]).await.unwrap(), None);
    assert_eq!(app.list_runners(&scope).await.unwrap().len(), 229);
    assert_eq!(sim.stats().runners_deleted, 1);
}

#[tokio::test]
async fn deleting_a_busy_runner_says_try_later() {
    let sim = sim().await;
    let app = app(&sim);
    let scope = org(&sim);
    let minted = app
        .generate_jit_config(&jit(scope.clone(), "busy"))
        .await
        .unwrap();
    let job = sim.queue_job(JobSpec {
        labels: vec!["imp".into()],
        ..Default::default()
    });
    let cfg = minted.encoded_jit_config.expose_secret().to_string();
    let opts = FakeRunnerOptions {
        job_duration: Duration::from_millis(1500),
        ..Default::default()
    };
    let runner = tokio::spawn(async move { run_fake_runner(&cfg, &opts).await });
    sim.wait_job(job.id, Duration::from_secs(5), |j| j.runner_id.is_some())
        .await
        .unwrap();
    let err = app
        .delete_runner(&scope, minted.runner_id)
        .await
        .unwrap_err();
    assert!(
        matches!(err, GithubError::RunnerBusy { runner_id } if runner_id == minted.runner_id),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Busy);
    assert_eq!(err.metric_label(), "runner_busy");
    let r = app
        .get_runner(&scope, minted.runner_id)
        .await
        .unwrap()
        .unwrap();
    assert!(r.busy);
    assert_eq!(r.status, "online");
    runner.await.unwrap().unwrap();
    // Finished ephemeral runners deregister themselves: a later delete is a no-op success.
    assert_eq!(
        app.delete_runner(&scope, minted.runner_id).await.unwrap(),
        DeleteOutcome::AlreadyGone
    );
}

#[tokio::test]
async fn metrics_export_rate_limit_remaining_per_app_and_errors() {
    let sim = sim().await;
    let metrics = GithubMetrics::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let app = imp_operator::github::GithubApp::with_metrics(
        creds(&sim, imp_testkit::github::KeyFormat::Pkcs8),
        config(&sim),
        metrics,
    )
    .unwrap();
    let scope = org(&sim);
    app.list_runners(&scope).await.unwrap();
    app.list_runners(&scope).await.unwrap();
    let _ = app.generate_jit_config(&jit(repo(), "")).await;
    sim.set_permission("organization_self_hosted_runners", None);
    let _ = app.list_runners(&scope).await.unwrap_err();
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let remaining = sim.installation_rate_remaining();
    // The second listing revalidated its ETag: a 304, which GitHub does not charge.
    assert_eq!(remaining, 5000 - 2);
    assert!(
        text.contains("imp_github_not_modified_total{operation=\"list_runners\"} 1"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "imp_github_rate_limit_remaining{{app_id=\"{}\"}} {remaining}",
            sim.app_id()
        )),
        "{text}"
    );
    assert!(
        text.contains("imp_github_installation_token_exchanges_total{app_id=\"4242\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("imp_github_errors_total{operation=\"list_runners\",error=\"forbidden\"} 1"),
        "{text}"
    );
    for status in ["2xx", "3xx"] {
        assert!(
            text.contains(&format!(
                "imp_github_requests_total{{operation=\"list_runners\",status=\"{status}\"}} 1"
            )),
            "{text}"
        );
    }
}
