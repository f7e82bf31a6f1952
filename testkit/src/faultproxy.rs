//! A fault-injecting proxy in front of the test API server: plain HTTP on 127.0.0.1, forwarding
//! every request through an admin [`kube::Client`] (responses, watches included, are streamed),
//! except the ones a [`Fault`] picks, which get a 500 without reaching the server. A process
//! under test points its kubeconfig at [`FaultProxy::kubeconfig`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http_body_util::BodyExt;

/// Picks requests by path (query excluded) and body.
pub type Matcher = Box<dyn Fn(&str, &[u8]) -> bool + Send + Sync>;

/// Fail the next `times` requests with `method` whose path (query excluded) and body satisfy
/// `matches`.
pub struct Fault {
    pub method: http::Method,
    pub matches: Matcher,
    pub times: u32,
}

struct Shared {
    upstream: kube::Client,
    faults: Mutex<Vec<Fault>>,
    /// (method, path) of every request failed on purpose.
    injected: Mutex<Vec<(String, String)>>,
}

pub struct FaultProxy {
    shared: Arc<Shared>,
    kubeconfig: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Listens on an ephemeral port; writes a kubeconfig for it into `dir`.
    pub async fn start(upstream: kube::Client, dir: &Path) -> std::io::Result<FaultProxy> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            faults: Mutex::new(Vec::new()),
            injected: Mutex::new(Vec::new()),
        });
        let app = axum::Router::new()
            .fallback(forward)
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let kubeconfig = dir.join("faultproxy.kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: proxy\n  cluster:\n    server: http://{addr}\n\
                 users:\n- name: proxy\n  user: {{}}\ncontexts:\n- name: proxy\n  context:\n    cluster: proxy\n    user: proxy\n\
                 current-context: proxy\n"
            ),
        )?;
        Ok(FaultProxy {
            shared,
            kubeconfig,
            task,
        })
    }

    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    pub fn inject(&self, fault: Fault) {
        self.shared.faults.lock().unwrap().push(fault);
    }

    /// The requests failed so far, as (method, path).
    pub fn injected(&self) -> Vec<(String, String)> {
        self.shared.injected.lock().unwrap().clone()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let path = parts.uri.path().to_owned();
    let bytes = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let hit = {
        let mut faults = shared.faults.lock().unwrap();
        let i = faults
            .iter()
            .position(|f| f.times > 0 && f.method == parts.method && (f.matches)(&path, &bytes));
        if let Some(i) = i {
            faults[i].times -= 1;
        }
        i.is_some()
    };
    if hit {
        shared
            .injected
            .lock()
            .unwrap()
            .push((parts.method.to_string(), path));
        let status = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": "injected by the test's fault proxy", "reason": "InternalError", "code": 500});
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(http::header::CONTENT_TYPE, "application/json")],
            status.to_string(),
        )
            .into_response();
    }
    let mut up = http::Request::builder()
        .method(parts.method)
        .uri(parts.uri.path_and_query().map_or("/", |p| p.as_str()));
    for (k, v) in &parts.headers {
        if k != http::header::HOST && k != http::header::AUTHORIZATION {
            up = up.header(k, v);
        }
    }
    let up = match up.body(kube::client::Body::from(bytes)) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    match shared.upstream.send(up).await {
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            Response::from_parts(parts, Body::new(body))
        }
        Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    }
}
