//! The scale-set protocol at the HTTP level: registration -> admin connection -> scale set ->
//! session (409 on a second) -> long poll -> acquire -> generatejitconfig -> a fake runner runs the
//! job -> JobStarted/JobCompleted arrive; redelivery until deleted.

use std::time::Duration;

use ::http::{Method, StatusCode};
use serde_json::{Value, json};

use super::http::{HttpClient, HttpResponse};
use super::runner_protocol::{FakeRunnerOptions, run_fake_runner};
use super::sim_tests::{req, token};
use super::{GithubSim, JobSpec, SimConfig};

async fn call(method: Method, url: &str, auth: &str, body: Option<Value>) -> HttpResponse {
    let headers = vec![
        ("authorization", auth.to_string()),
        (super::scaleset::HEADER_MAX_CAPACITY, "3".to_string()),
    ];
    HttpClient::default()
        .json(method, url, &headers, body.as_ref())
        .await
        .unwrap()
}

/// Registration token -> `(actions service url, admin token)`.
async fn admin(sim: &GithubSim) -> (String, String) {
    let t = token(sim).await;
    let r = req(
        sim,
        Method::POST,
        "/orgs/octo-org/actions/runners/registration-token",
        Some(&t),
        None,
    )
    .await;
    assert_eq!(r.status, StatusCode::CREATED, "{:?}", r.json());
    let reg = r.json()["token"].as_str().unwrap().to_string();
    let url = format!("{}/actions/runner-registration", sim.base_url());
    let body = json!({"url": "https://github.com/octo-org", "runner_event": "register"});
    let wrong = call(Method::POST, &url, "RemoteAuth nope", Some(body.clone())).await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    let r = call(Method::POST, &url, &format!("RemoteAuth {reg}"), Some(body)).await;
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.json());
    let v = r.json();
    (
        v["url"].as_str().unwrap().to_string(),
        v["token"].as_str().unwrap().to_string(),
    )
}

#[tokio::test]
async fn one_job_through_the_whole_protocol() {
    let sim = GithubSim::start(SimConfig::default()).await.unwrap();
    sim.set_scale_set_timing(Duration::from_secs(30), Duration::from_millis(300));
    let (svc, admin_token) = admin(&sim).await;
    let bearer = format!("Bearer {admin_token}");
    let api = |p: &str| format!("{svc}_apis/runtime/{p}?api-version=6.0-preview");

    let groups = call(
        Method::GET,
        &format!("{}&groupName=Default", api("runnergroups/")),
        &bearer,
        None,
    )
    .await;
    assert_eq!(groups.json()["value"][0]["id"], 1);
    let none = call(
        Method::GET,
        &format!("{}&name=imp-set", api("runnerscalesets")),
        &bearer,
        None,
    )
    .await;
    assert_eq!(none.json()["count"], 0);
    let body = json!({"name": "imp-set", "runnerGroupId": 1, "labels": [{"name": "imp-set", "type": "System"}]});
    let created = call(
        Method::POST,
        &api("runnerscalesets"),
        &bearer,
        Some(body.clone()),
    )
    .await;
    assert_eq!(created.status, StatusCode::OK, "{:?}", created.json());
    let id = created.json()["id"].as_u64().unwrap();
    let again = call(Method::POST, &api("runnerscalesets"), &bearer, Some(body)).await;
    assert_eq!(again.status, StatusCode::CONFLICT);

    let sessions = api(&format!("runnerscalesets/{id}/sessions"));
    let s = call(
        Method::POST,
        &sessions,
        &bearer,
        Some(json!({"ownerName": "op-a"})),
    )
    .await;
    assert_eq!(s.status, StatusCode::OK, "{:?}", s.json());
    let s = s.json();
    let second = call(
        Method::POST,
        &sessions,
        &bearer,
        Some(json!({"ownerName": "op-b"})),
    )
    .await;
    assert_eq!(second.status, StatusCode::CONFLICT);
    assert!(
        second.json()["message"]
            .as_str()
            .unwrap()
            .contains("already has an active session for owner op-a"),
        "{:?}",
        second.json()
    );
    let queue = s["messageQueueUrl"].as_str().unwrap().to_string();
    let qauth = format!("Bearer {}", s["messageQueueAccessToken"].as_str().unwrap());

    // Nothing queued: 202 after the poll timeout.
    let empty = call(
        Method::GET,
        &format!("{queue}?lastMessageId=0"),
        &qauth,
        None,
    )
    .await;
    assert_eq!(empty.status, StatusCode::ACCEPTED);

    let job = sim.queue_job(JobSpec {
        labels: vec!["imp-set".into()],
        ..Default::default()
    });
    let m = call(
        Method::GET,
        &format!("{queue}?lastMessageId=0"),
        &qauth,
        None,
    )
    .await;
    assert_eq!(m.status, StatusCode::OK);
    let m = m.json();
    assert_eq!(m["messageType"], "RunnerScaleSetJobMessages");
    let jobs: Vec<Value> = serde_json::from_str(m["body"].as_str().unwrap()).unwrap();
    assert_eq!(jobs[0]["messageType"], "JobAvailable");
    assert_eq!(jobs[0]["jobId"], job.id.to_string());
    let rid = jobs[0]["runnerRequestId"].as_i64().unwrap();
    assert_eq!(sim.scale_sets()[0].last_max_capacity, Some(3));
    let mid = m["messageId"].as_u64().unwrap();
    // Not deleted yet: delivered again.
    let re = call(
        Method::GET,
        &format!("{queue}?lastMessageId=0"),
        &qauth,
        None,
    )
    .await;
    assert_eq!(re.json()["messageId"].as_u64(), Some(mid));
    let del = call(Method::DELETE, &format!("{queue}/{mid}"), &qauth, None).await;
    assert_eq!(del.status, StatusCode::NO_CONTENT);

    let acq = call(
        Method::POST,
        &api(&format!("runnerscalesets/{id}/acquirejobs")),
        &qauth,
        Some(json!([rid])),
    )
    .await;
    assert_eq!(acq.json()["value"], json!([rid]));
    let jit = call(
        Method::POST,
        &api(&format!("runnerscalesets/{id}/generatejitconfig")),
        &bearer,
        Some(json!({"name": "imp-set-r1", "workFolder": "_work"})),
    )
    .await;
    assert_eq!(jit.status, StatusCode::OK, "{:?}", jit.json());
    let encoded = jit.json()["encodedJITConfig"].as_str().unwrap().to_string();
    let ran = run_fake_runner(
        &encoded,
        &FakeRunnerOptions {
            job_wait: Duration::from_secs(10),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(ran.id, job.id);

    let mut seen = Vec::new();
    let mut last = mid;
    while seen.len() < 3 {
        let m = call(
            Method::GET,
            &format!("{queue}?lastMessageId={last}"),
            &qauth,
            None,
        )
        .await;
        assert_eq!(m.status, StatusCode::OK, "messages so far: {seen:?}");
        let m = m.json();
        last = m["messageId"].as_u64().unwrap();
        let body: Vec<Value> = serde_json::from_str(m["body"].as_str().unwrap()).unwrap();
        seen.extend(
            body.iter()
                .map(|j| j["messageType"].as_str().unwrap().to_string()),
        );
        call(Method::DELETE, &format!("{queue}/{last}"), &qauth, None).await;
    }
    assert_eq!(seen, ["JobAssigned", "JobStarted", "JobCompleted"]);
    let del = call(
        Method::DELETE,
        &api(&format!(
            "runnerscalesets/{id}/sessions/{}",
            s["sessionId"].as_str().unwrap()
        )),
        &bearer,
        None,
    )
    .await;
    assert_eq!(del.status, StatusCode::NO_CONTENT);
    let stats = sim.scale_set_stats();
    assert_eq!(
        (
            stats.sessions_created,
            stats.session_conflicts,
            stats.sessions_deleted
        ),
        (1, 1, 1)
    );
    assert_eq!(stats.jobs_acquired, 1);
}
