//! The simulator at the HTTP level: GitHub's auth rules, status codes, shapes and headers.

use std::time::Duration;

use ::http::{Method, StatusCode};
use serde_json::{Value, json};

use super::http::{HttpClient, HttpResponse};
use super::jwt::sign_jwt;
use super::runner_protocol::JitConfigPayload;
use super::{Fault, FaultRule, GithubSim, SimConfig, test_key};

async fn sim_with(f: impl FnOnce(&mut SimConfig)) -> GithubSim {
    let mut c = SimConfig::default();
    f(&mut c);
    GithubSim::start(c).await.unwrap()
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

pub(super) async fn req(
    sim: &GithubSim,
    method: Method,
    path: &str,
    auth: Option<&str>,
    body: Option<Value>,
) -> HttpResponse {
    let headers: Vec<(&str, String)> = auth
        .map(|a| vec![("authorization", format!("Bearer {a}"))])
        .unwrap_or_default();
    HttpClient::default()
        .json(
            method,
            &format!("{}{path}", sim.base_url()),
            &headers,
            body.as_ref(),
        )
        .await
        .unwrap()
}

fn app_jwt(sim: &GithubSim, iat_offset: i64, exp_offset: i64) -> String {
    sign_jwt(
        &sim.app_key(),
        &json!({"iat": now() + iat_offset, "exp": now() + exp_offset, "iss": sim.app_id()}),
    )
}

pub(super) async fn token(sim: &GithubSim) -> String {
    let path = format!("/app/installations/{}/access_tokens", sim.installation_id());
    let r = req(
        sim,
        Method::POST,
        &path,
        Some(&app_jwt(sim, -60, 540)),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json());
    r.json()["token"].as_str().unwrap().to_string()
}

fn assert_rate_headers(r: &HttpResponse) {
    for h in [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "x-ratelimit-used",
        "x-ratelimit-resource",
    ] {
        assert!(r.headers.contains_key(h), "missing {h} on {}", r.status);
    }
}

#[tokio::test]
async fn token_exchange_enforces_jwt_rules() {
    let sim = sim_with(|_| {}).await;
    let path = format!("/app/installations/{}/access_tokens", sim.installation_id());
    let cases = [
        (app_jwt(&sim, -60, 540), StatusCode::CREATED, None),
        (
            app_jwt(&sim, -60, 1200),
            StatusCode::UNAUTHORIZED,
            Some("too far in the future"),
        ),
        (
            app_jwt(&sim, 300, 500),
            StatusCode::UNAUTHORIZED,
            Some("'Issued at' claim"),
        ),
        (
            app_jwt(&sim, -700, -100),
            StatusCode::UNAUTHORIZED,
            Some("'Expiration time'"),
        ),
        (
            sign_jwt(
                &test_key(1),
                &json!({"iat": now() - 60, "exp": now() + 500, "iss": sim.app_id()}),
            ),
            StatusCode::UNAUTHORIZED,
            Some("could not be decoded"),
        ),
        (
            "not-a-jwt".to_string(),
            StatusCode::UNAUTHORIZED,
            Some("could not be decoded"),
        ),
    ];
    for (jwt, status, msg) in cases {
        let r = req(&sim, Method::POST, &path, Some(&jwt), None).await;
        assert_eq!(r.status, status, "{:?}", r.json());
        assert_rate_headers(&r);
        if let Some(m) = msg {
            assert!(
                r.json()["message"].as_str().unwrap().contains(m),
                "{:?}",
                r.json()
            );
            assert!(r.json()["documentation_url"].is_string());
        } else {
            let body = r.json();
            assert!(body["token"].as_str().unwrap().starts_with("ghs_"));
            let exp =
                chrono::DateTime::parse_from_rfc3339(body["expires_at"].as_str().unwrap()).unwrap();
            assert!((exp.timestamp() - now() - 3600).abs() <= 2);
            assert_eq!(
                body["permissions"]["organization_self_hosted_runners"],
                "write"
            );
        }
    }
    let r = req(
        &sim,
        Method::POST,
        "/app/installations/999/access_tokens",
        Some(&app_jwt(&sim, -60, 540)),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = req(&sim, Method::POST, &path, None, None).await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(sim.stats().token_exchanges, 1);
}

#[tokio::test]
async fn installation_tokens_expire() {
    let sim = sim_with(|c| c.token_ttl = Duration::from_secs(1)).await;
    let t = token(&sim).await;
    let r = req(
        &sim,
        Method::GET,
        "/orgs/octo-org/actions/runners",
        Some(&t),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = req(
        &sim,
        Method::GET,
        "/orgs/octo-org/actions/runners",
        Some(&t),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.json()["message"], "Bad credentials");
    // JWTs are not installation tokens.
    let r = req(
        &sim,
        Method::GET,
        "/orgs/octo-org/actions/runners",
        Some(&app_jwt(&sim, -60, 540)),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let r = req(
        &sim,
        Method::GET,
        "/orgs/octo-org/actions/runners",
        None,
        None,
    )
    .await;
    assert_eq!(r.json()["message"], "Requires authentication");
}

#[tokio::test]
async fn jit_runner_and_pagination_shapes() {
    let sim = sim_with(|_| {}).await;
    let t = token(&sim).await;
    let path = "/orgs/octo-org/actions/runners/generate-jitconfig";
    let body = json!({"name": "r1", "runner_group_id": 1, "labels": ["self-hosted", "imp"], "work_folder": "_work"});
    let r = req(&sim, Method::POST, path, Some(&t), Some(body.clone())).await;
    assert_eq!(r.status, StatusCode::CREATED);
    let v = r.json();
    assert_eq!(v["runner"]["name"], "r1");
    assert_eq!(v["runner"]["status"], "offline");
    assert_eq!(
        v["runner"]["labels"][0],
        json!({"id": 1, "name": "self-hosted", "type": "read-only"})
    );
    // GitHub adds the OS and architecture defaults; the asked-for labels follow, once each.
    let labels: Vec<(&str, &str)> = v["runner"]["labels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["name"].as_str().unwrap(), l["type"].as_str().unwrap()))
        .collect();
    assert_eq!(
        labels,
        [
            ("self-hosted", "read-only"),
            ("Linux", "read-only"),
            ("X64", "read-only"),
            ("imp", "custom")
        ]
    );
    let payload = JitConfigPayload::decode(v["encoded_jit_config"].as_str().unwrap()).unwrap();
    assert_eq!(payload.url, sim.base_url());
    // Same name: 409. Bad bodies: 422. Unknown group: 404. Unknown org: 404.
    assert_eq!(
        req(&sim, Method::POST, path, Some(&t), Some(body))
            .await
            .status,
        StatusCode::CONFLICT
    );
    let r = req(
        &sim,
        Method::POST,
        path,
        Some(&t),
        Some(json!({"name": "x", "runner_group_id": 1})),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    let r = req(
        &sim,
        Method::POST,
        path,
        Some(&t),
        Some(json!({"name": "x", "runner_group_id": 1, "labels": []})),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    let r = req(
        &sim,
        Method::POST,
        path,
        Some(&t),
        Some(json!({"name": "x", "runner_group_id": 77, "labels": ["a"]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    let r = req(
        &sim,
        Method::POST,
        "/orgs/other/actions/runners/generate-jitconfig",
        Some(&t),
        Some(json!({"name": "x", "runner_group_id": 1, "labels": ["a"]})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    for i in 2..=5 {
        let b = json!({"name": format!("r{i}"), "runner_group_id": 1, "labels": ["imp"]});
        assert_eq!(
            req(&sim, Method::POST, path, Some(&t), Some(b))
                .await
                .status,
            StatusCode::CREATED
        );
    }
    let r = req(
        &sim,
        Method::GET,
        "/orgs/octo-org/actions/runners?per_page=2&page=2",
        Some(&t),
        None,
    )
    .await;
    assert_eq!(r.json()["total_count"], 5);
    assert_eq!(r.json()["runners"].as_array().unwrap().len(), 2);
    let link = r.headers.get("link").unwrap().to_str().unwrap();
    assert!(link.contains("per_page=2&page=3>; rel=\"next\""), "{link}");
    assert!(link.contains("page=1>; rel=\"prev\""), "{link}");
    assert_rate_headers(&r);
    let r = req(
        &sim,
        Method::DELETE,
        "/orgs/octo-org/actions/runners/1",
        Some(&t),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let r = req(
        &sim,
        Method::DELETE,
        "/orgs/octo-org/actions/runners/1",
        Some(&t),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn faults_carry_github_shapes_and_rate_headers() {
    let sim = sim_with(|_| {}).await;
    let t = token(&sim).await;
    let path = "/orgs/octo-org/actions/runners";
    sim.inject(FaultRule::next(
        1,
        Fault::RateLimit {
            retry_after_secs: 7,
        },
    ));
    sim.inject(FaultRule::next(
        1,
        Fault::SecondaryRateLimit {
            retry_after_secs: None,
        },
    ));
    sim.inject(FaultRule::next(1, Fault::ServerError { status: 503 }));
    let r = req(&sim, Method::GET, path, Some(&t), None).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.headers["retry-after"], "7");
    assert_rate_headers(&r);
    let r = req(&sim, Method::GET, path, Some(&t), None).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("secondary rate limit")
    );
    assert!(!r.headers.contains_key("retry-after"));
    let r = req(&sim, Method::GET, path, Some(&t), None).await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_rate_headers(&r);
    let r = req(&sim, Method::GET, path, Some(&t), None).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        r.headers["x-ratelimit-remaining"], "4999",
        "faults are not charged"
    );
    assert_eq!(r.headers["x-ratelimit-used"], "1");
    assert_eq!(sim.stats().faults_injected, 3);
}

#[tokio::test]
async fn the_primary_limit_answers_403_with_remaining_zero() {
    let sim = sim_with(|c| c.rate_limit = 2).await;
    let t = token(&sim).await;
    for _ in 0..2 {
        assert_eq!(
            req(
                &sim,
                Method::GET,
                "/orgs/octo-org/actions/runners",
                Some(&t),
                None
            )
            .await
            .status,
            StatusCode::OK
        );
    }
    let r = req(
        &sim,
        Method::GET,
        "/orgs/octo-org/actions/runners",
        Some(&t),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.headers["x-ratelimit-remaining"], "0");
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("API rate limit exceeded for installation ID")
    );
}

#[tokio::test]
async fn jit_configs_advertise_the_runner_url_and_the_runner_can_override_it() {
    use super::JobSpec;
    use super::runner_protocol::{FakeRunnerOptions, run_fake_runner};
    // Nothing listens on the discard port of loopback: a runner following the config fails.
    let sim = sim_with(|c| c.runner_url = Some("http://127.0.0.1:9".into())).await;
    let t = token(&sim).await;
    let body = json!({"name": "r", "runner_group_id": 1, "labels": ["imp"]});
    let r = req(
        &sim,
        Method::POST,
        "/orgs/octo-org/actions/runners/generate-jitconfig",
        Some(&t),
        Some(body),
    )
    .await;
    let encoded = r.json()["encoded_jit_config"].as_str().unwrap().to_string();
    assert_eq!(
        JitConfigPayload::decode(&encoded).unwrap().url,
        "http://127.0.0.1:9"
    );
    let job = sim.queue_job(JobSpec {
        labels: vec!["imp".into()],
        ..Default::default()
    });
    assert!(
        run_fake_runner(&encoded, &FakeRunnerOptions::default())
            .await
            .is_err()
    );
    let opts = FakeRunnerOptions {
        url_override: Some(sim.base_url().to_string()),
        ..Default::default()
    };
    let ran = run_fake_runner(&encoded, &opts).await.unwrap();
    assert_eq!(ran.id, job.id);
}

#[tokio::test]
async fn runs_follow_their_jobs_and_conditional_gets_are_free() {
    let sim = sim_with(|_| {}).await;
    let tok = token(&sim).await;
    let spec = |run_id| super::JobSpec {
        labels: vec!["imp".into()],
        run_id,
        ..Default::default()
    };
    let first = sim.queue_job(spec(None));
    let second = sim.queue_job(spec(Some(first.run_id)));
    sim.queue_job(spec(Some(first.run_id)));
    let runs = |status: &'static str| {
        let (sim, tok) = (&sim, tok.clone());
        async move {
            let path = format!("/repos/octo-org/octo-repo/actions/runs?status={status}");
            let r = req(sim, Method::GET, &path, Some(&tok), None).await;
            assert_eq!(r.status, StatusCode::OK);
            r.json()["workflow_runs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["id"].as_u64().unwrap())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(runs("queued").await, vec![first.run_id]);
    sim.start_job(second.id, "hosted-1").unwrap();
    // One job started: the whole run is in progress, its other jobs still queued.
    assert!(runs("queued").await.is_empty());
    assert_eq!(runs("in_progress").await, vec![first.run_id]);
    let jobs_path = format!(
        "/repos/octo-org/octo-repo/actions/runs/{}/jobs",
        first.run_id
    );
    let r = req(&sim, Method::GET, &jobs_path, Some(&tok), None).await;
    let statuses: Vec<String> = r.json()["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["status"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(statuses, vec!["queued", "in_progress", "queued"]);

    // ETag revalidation: 304 without a body, not charged; a change serves 200 with a new ETag.
    let etag = r.headers["etag"].to_str().unwrap().to_string();
    let conditional = |etag: String| {
        let (sim, tok, path) = (&sim, tok.clone(), jobs_path.clone());
        async move {
            HttpClient::default()
                .send(
                    Method::GET,
                    &format!("{}{path}", sim.base_url()),
                    &[
                        ("authorization", format!("Bearer {tok}")),
                        ("if-none-match", etag),
                    ],
                    None,
                )
                .await
                .unwrap()
        }
    };
    let before = sim.installation_rate_remaining();
    let charged = sim.stats().charged_requests;
    let r = conditional(etag.clone()).await;
    assert_eq!(r.status, StatusCode::NOT_MODIFIED);
    assert!(r.body.is_empty());
    assert_rate_headers(&r);
    assert_eq!(sim.installation_rate_remaining(), before);
    assert_eq!(sim.stats().charged_requests, charged);
    assert_eq!(sim.stats().not_modified, 1);
    sim.complete_job(first.id, "cancelled").unwrap();
    let r = conditional(etag.clone()).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_ne!(r.headers["etag"].to_str().unwrap(), etag);
    assert_eq!(sim.installation_rate_remaining(), before - 1);
    assert_eq!(sim.stats().charged_requests, charged + 1);
}

/// `POST /_admin/runner-faults {"never_online": 1}`: the next runner to connect is refused with 503
/// on every try (it stays offline and its fake runner gives up after its job wait); the one after
/// it connects and runs a job.
#[tokio::test]
async fn a_runner_held_never_online_stays_offline_and_the_next_one_connects() {
    use super::JobSpec;
    use super::runner_protocol::{FakeRunnerOptions, run_fake_runner};
    let sim = sim_with(|_| {}).await;
    let t = token(&sim).await;
    let mut configs = Vec::new();
    for name in ["held", "next"] {
        let body = json!({"name": name, "runner_group_id": 1, "labels": ["imp"]});
        let r = req(
            &sim,
            Method::POST,
            "/orgs/octo-org/actions/runners/generate-jitconfig",
            Some(&t),
            Some(body),
        )
        .await;
        configs.push(r.json()["encoded_jit_config"].as_str().unwrap().to_string());
    }
    let r = req(
        &sim,
        Method::POST,
        "/_admin/runner-faults",
        None,
        Some(json!({"never_online": 1})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NO_CONTENT);
    let job = sim.queue_job(JobSpec {
        labels: vec!["imp".into()],
        ..Default::default()
    });
    let short = FakeRunnerOptions {
        job_wait: Duration::from_secs(2),
        ..Default::default()
    };
    let err = run_fake_runner(&configs[0], &short).await.unwrap_err();
    assert!(err.to_string().contains("503"), "{err:#}");
    let runners = req(&sim, Method::GET, "/_admin/runners", None, None).await;
    let held = runners
        .json()
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "held")
        .cloned();
    assert_eq!(held.unwrap()["status"], "offline");
    let ran = run_fake_runner(&configs[1], &short).await.unwrap();
    assert_eq!(ran.id, job.id);
}
