//! Every injected fault: 5xx, 429 + Retry-After, 403 secondary limit (with and without
//! Retry-After), the primary limit, delays/timeouts, faults on the token exchange, and the admin
//! HTTP API that injects them.

mod github_common;

use std::time::{Duration, Instant};

use github_common::*;
use imp_operator::github::{
    ErrorClass, GithubConfig, GithubError, Operation, RateLimitKind, RetryPolicy,
};
use imp_testkit::github::{Fault, FaultRule};

#[tokio::test]
async fn server_errors_are_retried_with_backoff() {
    let sim = sim().await;
    let app = app(&sim);
    sim.inject(
        FaultRule::next(2, Fault::ServerError { status: 502 }).on_path("generate-jitconfig"),
    );
    let minted = app
        .generate_jit_config(&jit(org(&sim), "after-502"))
        .await
        .unwrap();
    assert_eq!(sim.stats().faults_injected, 2);
    assert_eq!(sim.runners()[0].id, minted.runner_id);
}

#[tokio::test]
async fn persistent_server_errors_give_a_transient_error_after_the_attempts() {
    let sim = sim().await;
    let app = app(&sim);
    sim.inject(FaultRule::next(10, Fault::ServerError { status: 503 }).on_path("/runners"));
    let err = app.list_runners(&org(&sim)).await.unwrap_err();
    assert!(
        matches!(
            err,
            GithubError::Server {
                status: 503,
                operation: Operation::ListRunners
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Transient);
    assert_eq!(sim.stats().faults_injected, 4, "max_attempts = 4");
}

#[tokio::test]
async fn too_many_requests_honours_retry_after() {
    let sim = sim().await;
    let app = app(&sim);
    app.installation_token().await.unwrap();
    sim.inject(FaultRule::next(
        1,
        Fault::RateLimit {
            retry_after_secs: 1,
        },
    ));
    let t = Instant::now();
    app.generate_jit_config(&jit(org(&sim), "after-429"))
        .await
        .unwrap();
    let waited = t.elapsed();
    assert!(waited >= Duration::from_secs(1), "waited {waited:?}");
    assert!(waited < Duration::from_secs(5), "waited {waited:?}");
}

#[tokio::test]
async fn secondary_rate_limit_with_retry_after_is_waited_out() {
    let sim = sim().await;
    let app = app(&sim);
    app.installation_token().await.unwrap();
    sim.inject(FaultRule::next(
        1,
        Fault::SecondaryRateLimit {
            retry_after_secs: Some(1),
        },
    ));
    let t = Instant::now();
    app.list_runners(&org(&sim)).await.unwrap();
    assert!(t.elapsed() >= Duration::from_secs(1));
}

#[tokio::test]
async fn secondary_rate_limit_without_retry_after_is_returned_when_too_long_to_wait() {
    let sim = sim().await;
    let app = app(&sim);
    app.installation_token().await.unwrap();
    sim.inject(FaultRule::next(
        1,
        Fault::SecondaryRateLimit {
            retry_after_secs: None,
        },
    ));
    let t = Instant::now();
    let err = app
        .generate_jit_config(&jit(org(&sim), "x"))
        .await
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(1), "not waited in place");
    match err {
        GithubError::RateLimited {
            kind, retry_after, ..
        } => {
            assert_eq!(kind, RateLimitKind::Secondary);
            assert_eq!(
                retry_after,
                Duration::from_secs(60),
                "GitHub's advice: wait at least a minute"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(sim.runners().is_empty());
}

#[tokio::test]
async fn primary_rate_limit_waits_for_the_reset() {
    let sim = sim_with(|c| {
        c.rate_limit = 3;
        c.rate_limit_window = Duration::from_secs(2);
    })
    .await;
    let client = app(&sim);
    let scope = org(&sim);
    let t = Instant::now();
    // A plain GET (listings are revalidated with ETags, and GitHub does not charge 304s).
    for _ in 0..5 {
        client.get_runner(&scope, 1).await.unwrap();
    }
    // 3 calls fit the first window; the 4th waited for x-ratelimit-reset.
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    // With a reset further away than the client will wait, the error is returned.
    let sim = sim_with(|c| {
        c.rate_limit = 1;
        c.rate_limit_window = Duration::from_secs(600);
    })
    .await;
    let second = app(&sim);
    second.list_runners(&org(&sim)).await.unwrap();
    let err = second.list_runners(&org(&sim)).await.unwrap_err();
    assert!(
        matches!(
            err,
            GithubError::RateLimited {
                kind: RateLimitKind::Primary,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::RateLimited);
}

#[tokio::test]
async fn a_slow_answer_times_out_and_is_retried() {
    let sim = sim().await;
    let app = app_with(
        &sim,
        GithubConfig {
            request_timeout: Duration::from_millis(800),
            ..config(&sim)
        },
    );
    app.installation_token().await.unwrap();
    sim.inject(FaultRule::next(1, Fault::Delay { millis: 2500 }).on_path("/runners"));
    let t = Instant::now();
    app.list_runners(&org(&sim)).await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(800));
    // Every attempt slow: a transient timeout error.
    sim.inject(FaultRule::next(4, Fault::Delay { millis: 1500 }).on_path("/runners"));
    let err = app.list_runners(&org(&sim)).await.unwrap_err();
    assert!(matches!(err, GithubError::Timeout { .. }), "{err:?}");
    assert_eq!(err.class(), ErrorClass::Transient);
}

#[tokio::test]
async fn faults_on_the_token_exchange_are_retried() {
    let sim = sim().await;
    let app = app(&sim);
    sim.inject(FaultRule::next(2, Fault::ServerError { status: 500 }).on_path("access_tokens"));
    sim.inject(
        FaultRule::next(
            1,
            Fault::RateLimit {
                retry_after_secs: 0,
            },
        )
        .on_path("access_tokens"),
    );
    app.installation_token().await.unwrap();
    let stats = sim.stats();
    assert_eq!((stats.token_exchanges, stats.faults_injected), (1, 3));
}

#[tokio::test]
async fn no_retries_when_the_policy_says_one_attempt() {
    let sim = sim().await;
    let cfg = GithubConfig {
        retry: RetryPolicy {
            max_attempts: 1,
            ..config(&sim).retry
        },
        ..config(&sim)
    };
    let app = app_with(&sim, cfg);
    app.installation_token().await.unwrap();
    sim.inject(FaultRule::next(1, Fault::ServerError { status: 500 }));
    assert!(matches!(
        app.list_runners(&org(&sim)).await,
        Err(GithubError::Server { status: 500, .. })
    ));
}

#[tokio::test]
async fn the_admin_http_api_injects_faults_and_revocations() {
    let sim = sim().await;
    let admin = sim.admin();
    let app = app(&sim);
    app.installation_token().await.unwrap();
    admin
        .inject(&FaultRule::next(1, Fault::ServerError { status: 504 }))
        .await
        .unwrap();
    app.list_runners(&org(&sim)).await.unwrap();
    assert_eq!(admin.stats().await.unwrap().faults_injected, 1);
    admin
        .inject(&FaultRule::next(5, Fault::ServerError { status: 500 }))
        .await
        .unwrap();
    admin.clear_faults().await.unwrap();
    app.list_runners(&org(&sim)).await.unwrap();
    admin.expire_tokens().await.unwrap();
    app.list_runners(&org(&sim)).await.unwrap();
    assert_eq!(admin.stats().await.unwrap().token_exchanges, 2);
    admin.revoke_installation().await.unwrap();
    let err = app.list_runners(&org(&sim)).await.unwrap_err();
    assert!(
        matches!(
            err,
            GithubError::NotFound {
                operation: Operation::TokenExchange,
                ..
            }
        ),
        "{err:?}"
    );
    admin.restore_installation().await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    app.list_runners(&org(&sim)).await.unwrap();
}
