//! A tiny plain-HTTP/1.1 JSON client (hyper-util): the fake runner's, and imp-testkit's for webhooks
//! and its admin client. The simulator only speaks plain HTTP, so no TLS.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A response: status, headers and the whole body.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl HttpResponse {
    /// The body as JSON (`Value::Null` when empty or not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// A cloneable HTTP client.
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl Default for HttpClient {
    fn default() -> Self {
        Self::new(Duration::from_secs(10))
    }
}

impl HttpClient {
    pub fn new(timeout: Duration) -> Self {
        let inner = Client::builder(TokioExecutor::new()).build_http();
        HttpClient { inner, timeout }
    }

    /// Sends one request; `body` is sent as-is with the given headers.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, String)],
        body: Option<Bytes>,
    ) -> anyhow::Result<HttpResponse> {
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, v);
        }
        let req = req.body(Full::new(body.unwrap_or_default()))?;
        let fut = async {
            let resp = self.inner.request(req).await?;
            let (parts, body) = resp.into_parts();
            let body = body.collect().await?.to_bytes();
            anyhow::Ok(HttpResponse {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(self.timeout, fut)
            .await
            .map_err(|_| anyhow::anyhow!("{url}: timed out after {:?}", self.timeout))?
    }

    /// Sends a JSON body (or none) with optional extra headers.
    pub async fn json(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, String)],
        body: Option<&serde_json::Value>,
    ) -> anyhow::Result<HttpResponse> {
        let mut hs: Vec<(&str, String)> = headers.to_vec();
        let body = match body {
            Some(v) => {
                hs.push(("content-type", "application/json".to_string()));
                Some(Bytes::from(serde_json::to_vec(v)?))
            }
            None => None,
        };
        self.send(method, url, &hs, body).await
    }
}
