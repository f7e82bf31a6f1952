//! Captures every log line (all levels, all targets, span fields included) while the token, JIT
//! mint, runner and error paths run, and checks that no private key, JWT, installation token or
//! JIT config appears.

mod github_common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use github_common::*;
use imp_common::{ExposeSecret, SecretString};
use imp_operator::github::{AppCredentials, GithubApp, mint_app_jwt, runner_name};
use imp_testkit::github::runner_protocol::{FakeRunnerOptions, run_fake_runner};
use imp_testkit::github::{Fault, FaultRule, JobSpec, KeyFormat, WebhookSink, test_key};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::fmt::format::FmtSpan;

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Capture {
    type Writer = Capture;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_the_logs() {
    let capture = Capture::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(FmtSpan::FULL)
        .with_ansi(false)
        .with_writer(capture.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let sink = WebhookSink::start().await.unwrap();
    let sim = sim().await;
    sim.set_webhook(sink.url(), "s");
    let pem1 = sim.private_key_pem(KeyFormat::Pkcs1);
    let pem8 = sim.private_key_pem(KeyFormat::Pkcs8);
    let creds = creds(&sim, KeyFormat::Pkcs8);
    tracing::debug!(?creds, "loaded credentials");
    let app = GithubApp::new(creds.clone(), config(&sim)).unwrap();
    tracing::debug!(?app, "client");
    let scope = org(&sim);

    let mut secrets: Vec<String> = Vec::new();
    let jwt = mint_app_jwt(&creds, chrono::Utc::now().timestamp()).unwrap();
    // SecretString has no Display: `%jwt` does not compile, so only Debug can be tried.
    tracing::info!(?jwt, "a JWT, redacted");
    secrets.push(jwt.expose_secret().to_string());
    let token = app.installation_token().await.unwrap();
    secrets.push(token.expose_secret().to_string());

    // Mints (with a retried 5xx), a job through the fake runner, get/list/delete.
    sim.inject(
        FaultRule::next(1, Fault::ServerError { status: 502 }).on_path("generate-jitconfig"),
    );
    let mut ids = Vec::new();
    for i in 0..3 {
        let minted = app
            .generate_jit_config(&jit(scope.clone(), &runner_name("logs", &format!("{i}"))))
            .await
            .unwrap();
        tracing::info!(?minted, config = ?minted.encoded_jit_config, "minted");
        secrets.push(minted.encoded_jit_config.expose_secret().to_string());
        ids.push(minted.runner_id);
    }
    sim.queue_job(JobSpec {
        labels: vec!["imp".into()],
        ..Default::default()
    });
    run_fake_runner(&secrets[secrets.len() - 1], &FakeRunnerOptions::default())
        .await
        .unwrap();
    app.get_runner(&scope, ids[0]).await.unwrap();
    app.list_runners(&scope).await.unwrap();
    for id in &ids {
        app.delete_runner(&scope, *id).await.unwrap();
    }
    // 401 re-authentication, then a wrong key and a bad PEM.
    sim.expire_tokens();
    app.list_runners(&scope).await.unwrap();
    let token = app.installation_token().await.unwrap();
    secrets.push(token.expose_secret().to_string());
    let wrong_pem = SecretString::from(test_key(1).pkcs1_pem());
    tracing::debug!(?wrong_pem, "a PEM, redacted");
    let wrong =
        AppCredentials::from_private_key(sim.app_id(), sim.installation_id(), &wrong_pem).unwrap();
    let err = GithubApp::new(wrong, config(&sim))
        .unwrap()
        .installation_token()
        .await
        .unwrap_err();
    tracing::error!(error = %err, ?err, "expected failure");
    let bad = pem1.replace('A', "B");
    if let Err(err) = AppCredentials::from_parts(1, 2, bad.as_bytes()) {
        tracing::error!(error = %err, ?err, "expected failure");
    }
    sink.wait_for(3, std::time::Duration::from_secs(5)).await;

    let logs = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    assert!(
        logs.contains("minted JIT runner config"),
        "the capture works:\n{logs}"
    );
    assert!(logs.contains("exchanged App JWT for an installation token"));
    assert!(logs.contains("retrying GitHub call"));
    assert!(
        logs.contains("generate-jitconfig"),
        "octocrab's request spans are captured too"
    );
    assert!(logs.lines().count() > 30);
    for s in &secrets {
        assert!(!logs.contains(s.as_str()), "a secret leaked into the logs");
    }
    let wrong_text = test_key(1).pkcs1_pem();
    for pem in [&pem1, &pem8, &bad, &wrong_text] {
        for line in pem.lines().filter(|l| !l.starts_with("-----")) {
            assert!(!logs.contains(line), "a private key line leaked");
        }
    }
    for marker in [
        "BEGIN RSA PRIVATE KEY",
        "BEGIN PRIVATE KEY",
        "ghs_",
        "eyJ",
        "RunnerCredential ",
    ] {
        assert!(!logs.contains(marker), "`{marker}` found in logs");
    }
}
