//! App auth against the simulator: token exchange, caching, single-flight, re-mint ahead of
//! expiry, 401 re-authentication, bad keys, revoked installations.

mod github_common;

use std::sync::Arc;
use std::time::Duration;

use github_common::*;
use imp_common::ExposeSecret;
use imp_operator::github::{
    AppCredentials, DeleteOutcome, ErrorClass, GithubApp, GithubConfig, GithubError,
    KEY_PRIVATE_KEY, Operation, runner_name,
};
use imp_testkit::github::{KeyFormat, test_key};

#[tokio::test]
async fn pkcs1_and_pkcs8_keys_both_authenticate_and_tokens_are_cached() {
    let sim = sim().await;
    for format in [KeyFormat::Pkcs1, KeyFormat::Pkcs8] {
        let app = GithubApp::new(creds(&sim, format), config(&sim)).unwrap();
        let t1 = app.installation_token().await.unwrap();
        let t2 = app.installation_token().await.unwrap();
        assert_eq!(
            t1.expose_secret(),
            t2.expose_secret(),
            "second call is served from the cache"
        );
        assert!(t1.expose_secret().starts_with("ghs_"));
        app.list_runners(&org(&sim)).await.unwrap();
    }
    assert_eq!(sim.stats().token_exchanges, 2, "one exchange per client");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_mints_make_exactly_one_token_exchange() {
    let sim = sim().await;
    let app = app(&sim);
    let scope = org(&sim);
    let start = std::time::Instant::now();
    let mut tasks = Vec::new();
    for i in 0..200 {
        let app = app.clone();
        let req = jit(scope.clone(), &runner_name("pool", &format!("{i:012x}")));
        tasks.push(tokio::spawn(
            async move { app.generate_jit_config(&req).await },
        ));
    }
    let mut ids = std::collections::BTreeSet::new();
    for t in tasks {
        ids.insert(t.await.unwrap().unwrap().runner_id);
    }
    assert_eq!(ids.len(), 200);
    let stats = sim.stats();
    println!(
        "200 concurrent mints: {} token exchange(s) in {:?}",
        stats.token_exchanges,
        start.elapsed()
    );
    assert_eq!(stats.token_exchanges, 1, "single-flight token exchange");
    assert_eq!(stats.jit_configs_issued, 200);
    assert_eq!(sim.runners().len(), 200);
}

#[tokio::test]
async fn tokens_are_reminted_five_minutes_before_expiry() {
    // Tokens living 4 minutes are always inside the default 5 minute margin: every use re-mints.
    let sim = sim_with(|c| c.token_ttl = Duration::from_secs(240)).await;
    let client = app(&sim);
    for _ in 0..3 {
        client.list_runners(&org(&sim)).await.unwrap();
    }
    assert_eq!(sim.stats().token_exchanges, 3);

    // Tokens living 6 minutes are reused until they come within the margin.
    let sim = sim_with(|c| c.token_ttl = Duration::from_secs(360)).await;
    let client = app(&sim);
    for _ in 0..3 {
        client.list_runners(&org(&sim)).await.unwrap();
    }
    assert_eq!(sim.stats().token_exchanges, 1);

    // With a 1 s margin and 3 s tokens: reused, then re-minted once within a second of expiry.
    let sim = sim_with(|c| c.token_ttl = Duration::from_secs(3)).await;
    let client = app_with(
        &sim,
        GithubConfig {
            token_refresh_margin: Duration::from_secs(1),
            ..config(&sim)
        },
    );
    let first = client.installation_token().await.unwrap();
    assert_eq!(
        client.installation_token().await.unwrap().expose_secret(),
        first.expose_secret()
    );
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let second = client.installation_token().await.unwrap();
    assert_ne!(first.expose_secret(), second.expose_secret());
    assert_eq!(sim.stats().token_exchanges, 2);
}

#[tokio::test]
async fn a_401_invalidates_the_token_and_retries_once() {
    let sim = sim().await;
    let app = app(&sim);
    let scope = org(&sim);
    let minted = app
        .generate_jit_config(&jit(scope.clone(), "r-401"))
        .await
        .unwrap();
    let before = app.installation_token().await.unwrap();
    sim.expire_tokens();
    // The cached token is now refused: the client re-mints once and the call succeeds.
    let runner = app
        .get_runner(&scope, minted.runner_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(runner.name, "r-401");
    assert_ne!(
        app.installation_token().await.unwrap().expose_secret(),
        before.expose_secret()
    );
    assert_eq!(sim.stats().token_exchanges, 2);
    assert_eq!(
        app.delete_runner(&scope, minted.runner_id).await.unwrap(),
        DeleteOutcome::Deleted
    );
}

#[tokio::test]
async fn a_wrong_private_key_is_a_permanent_401_with_a_hint() {
    let sim = sim().await;
    let wrong = AppCredentials::from_parts(
        sim.app_id(),
        sim.installation_id(),
        test_key(1).pkcs1_pem().as_bytes(),
    )
    .unwrap();
    let app = GithubApp::new(wrong, config(&sim)).unwrap();
    let err = app.installation_token().await.unwrap_err();
    assert!(
        matches!(
            err,
            GithubError::Unauthorized {
                operation: Operation::TokenExchange,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.class(), ErrorClass::Permanent);
    assert!(err.to_string().contains(KEY_PRIVATE_KEY), "{err}");
    let stats = sim.stats();
    assert_eq!(
        (stats.token_exchanges, stats.token_exchanges_refused),
        (0, 1),
        "401 is not retried"
    );
    // JIT mints surface the same error.
    let err = app
        .generate_jit_config(&jit(org(&sim), "x"))
        .await
        .unwrap_err();
    assert_eq!(err.metric_label(), "unauthorized");
}

#[tokio::test]
async fn a_wrong_app_id_is_refused() {
    let sim = sim().await;
    let creds = AppCredentials::from_parts(
        sim.app_id() + 1,
        sim.installation_id(),
        test_key(0).pkcs1_pem().as_bytes(),
    )
    .unwrap();
    let err = GithubApp::new(creds, config(&sim))
        .unwrap()
        .installation_token()
        .await
        .unwrap_err();
    assert!(matches!(err, GithubError::Unauthorized { .. }), "{err:?}");
}

#[tokio::test]
async fn revoked_installation_gives_not_found_with_hint_then_recovers() {
    let sim = sim().await;
    let app = app(&sim);
    app.list_runners(&org(&sim)).await.unwrap();
    sim.revoke_installation();
    // The cached token dies (401), the re-exchange answers 404: a permanent error naming the installation.
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
    assert_eq!(err.class(), ErrorClass::Permanent);
    assert!(
        err.to_string()
            .contains(&format!("installation {}", sim.installation_id())),
        "{err}"
    );
    sim.restore_installation();
    tokio::time::sleep(Duration::from_millis(600)).await; // past the shared-failure window
    app.list_runners(&org(&sim)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_callers_share_one_failed_exchange() {
    let sim = sim().await;
    sim.revoke_installation();
    let app = app(&sim);
    let results = futures_join(app.clone(), 50).await;
    assert!(
        results
            .iter()
            .all(|r| matches!(r, Err(GithubError::NotFound { .. })))
    );
    assert_eq!(
        sim.stats().token_exchanges_refused,
        1,
        "queued callers got the first failure"
    );
}

async fn futures_join(
    app: GithubApp,
    n: usize,
) -> Vec<Result<imp_common::SecretString, GithubError>> {
    let app = Arc::new(app);
    let mut tasks = Vec::new();
    for _ in 0..n {
        let app = app.clone();
        tasks.push(tokio::spawn(async move { app.installation_token().await }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn secret_of(
    data: &std::collections::BTreeMap<String, String>,
) -> k8s_openapi::api::core::v1::Secret {
    k8s_openapi::api::core::v1::Secret {
        data: Some(
            data.iter()
                .map(|(k, v)| (k.clone(), k8s_openapi::ByteString(v.clone().into_bytes())))
                .collect(),
        ),
        ..Default::default()
    }
}

#[tokio::test]
async fn pools_sharing_an_app_secret_share_one_client_until_it_rotates() {
    let sim = sim().await;
    let apps = imp_operator::github::GithubApps::new(
        config(&sim),
        imp_operator::github::GithubMetrics::default(),
    );
    let secret = secret_of(&sim.secret_data(KeyFormat::Pkcs1));
    let a = apps.for_secret(&secret).unwrap();
    a.list_runners(&org(&sim)).await.unwrap();
    let b = apps.for_secret(&secret.clone()).unwrap();
    b.list_runners(&org(&sim)).await.unwrap();
    assert_eq!(sim.stats().token_exchanges, 1, "one token cache for both");
    assert_eq!(apps.len(), 1);
    // Rotation (same App, key now PKCS#8): a fresh client replaces the old one.
    let rotated = secret_of(&sim.secret_data(KeyFormat::Pkcs8));
    let c = apps.for_secret(&rotated).unwrap();
    c.list_runners(&org(&sim)).await.unwrap();
    assert_eq!(sim.stats().token_exchanges, 2);
    assert_eq!(apps.len(), 1);
    // A broken Secret is an error naming the key, and caches nothing.
    let mut broken = sim.secret_data(KeyFormat::Pkcs1);
    broken.remove(KEY_PRIVATE_KEY);
    let err = apps.for_secret(&secret_of(&broken)).unwrap_err();
    assert!(err.to_string().contains("private-key"), "{err}");
    assert_eq!(apps.len(), 1);
}
