//! Client of one Firecracker process's REST API on its Unix socket (HTTP/1.1, one connection per
//! request: Firecracker serves a handful of calls per VM, so pooling buys nothing).

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::UnixStream;

use super::api::{
    ActionType, ApiError, BootSource, Drive, InstanceActionInfo, InstanceInfo,
    MachineConfiguration, NetworkInterface, SnapshotCreateParams, SnapshotLoadParams, Vm, VmState,
    Vsock,
};

/// Longest any single API call may take; Firecracker answers in milliseconds.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum ApiClientError {
    #[error("connect to the Firecracker API socket {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("HTTP exchange with Firecracker ({method} {path}): {source}")]
    Http {
        method: Method,
        path: String,
        source: hyper::Error,
    },
    #[error("Firecracker rejected {method} {path} with {status}: {fault_message}")]
    Fault {
        method: Method,
        path: String,
        status: StatusCode,
        fault_message: String,
    },
    #[error("Firecracker answer to {method} {path} is not the documented body: {source}")]
    Decode {
        method: Method,
        path: String,
        source: serde_json::Error,
    },
    #[error("Firecracker did not answer {method} {path} within {CALL_TIMEOUT:?}")]
    Timeout { method: Method, path: String },
}

#[derive(Debug, Clone)]
pub struct FirecrackerClient {
    socket: PathBuf,
}

impl FirecrackerClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub async fn describe_instance(&self) -> Result<InstanceInfo, ApiClientError> {
        let body = self.call(Method::GET, "/", None).await?;
        serde_json::from_slice(&body).map_err(|source| ApiClientError::Decode {
            method: Method::GET,
            path: "/".into(),
            source,
        })
    }

    pub async fn put_machine_config(&self, c: &MachineConfiguration) -> Result<(), ApiClientError> {
        self.put("/machine-config", c).await
    }

    pub async fn put_boot_source(&self, b: &BootSource) -> Result<(), ApiClientError> {
        self.put("/boot-source", b).await
    }

    pub async fn put_drive(&self, d: &Drive) -> Result<(), ApiClientError> {
        self.put(&format!("/drives/{}", d.drive_id), d).await
    }

    pub async fn put_network_interface(&self, n: &NetworkInterface) -> Result<(), ApiClientError> {
        self.put(&format!("/network-interfaces/{}", n.iface_id), n)
            .await
    }

    pub async fn put_vsock(&self, v: &Vsock) -> Result<(), ApiClientError> {
        self.put("/vsock", v).await
    }

    pub async fn action(&self, action_type: ActionType) -> Result<(), ApiClientError> {
        self.put("/actions", &InstanceActionInfo { action_type })
            .await
    }

    pub async fn set_vm_state(&self, state: VmState) -> Result<(), ApiClientError> {
        self.send_json(Method::PATCH, "/vm", &Vm { state }).await
    }

    pub async fn create_snapshot(&self, p: &SnapshotCreateParams) -> Result<(), ApiClientError> {
        self.put("/snapshot/create", p).await
    }

    pub async fn load_snapshot(&self, p: &SnapshotLoadParams) -> Result<(), ApiClientError> {
        self.put("/snapshot/load", p).await
    }

    async fn put<T: Serialize>(&self, path: &str, body: &T) -> Result<(), ApiClientError> {
        self.send_json(Method::PUT, path, body).await
    }

    async fn send_json<T: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: &T,
    ) -> Result<(), ApiClientError> {
        let bytes = serde_json::to_vec(body).expect("API bodies always serialise");
        self.call(method, path, Some(bytes)).await.map(|_| ())
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Bytes, ApiClientError> {
        let fut = self.call_inner(method.clone(), path, body);
        match tokio::time::timeout(CALL_TIMEOUT, fut).await {
            Ok(r) => r,
            Err(_) => Err(ApiClientError::Timeout {
                method,
                path: path.into(),
            }),
        }
    }

    async fn call_inner(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Bytes, ApiClientError> {
        let http_err = |source| ApiClientError::Http {
            method: method.clone(),
            path: path.into(),
            source,
        };
        let stream =
            UnixStream::connect(&self.socket)
                .await
                .map_err(|source| ApiClientError::Connect {
                    path: self.socket.clone(),
                    source,
                })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(http_err)?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method.clone())
            .uri(path)
            .header(http::header::HOST, "localhost")
            .header(http::header::ACCEPT, "application/json");
        if body.is_some() {
            req = req.header(http::header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .expect("static request parts are valid");
        let resp = sender.send_request(req).await.map_err(http_err)?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(http_err)?
            .to_bytes();
        if status.is_success() {
            return Ok(bytes);
        }
        let fault_message = serde_json::from_slice::<ApiError>(&bytes)
            .map(|e| e.fault_message)
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
        Err(ApiClientError::Fault {
            method,
            path: path.into(),
            status,
            fault_message,
        })
    }
}
