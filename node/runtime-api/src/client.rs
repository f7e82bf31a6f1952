//! Client of imp-runtime's socket API (used by imp-agent, the tests and the benchmark).

use std::path::{Path, PathBuf};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;

use crate::api::{
    Capacity, ErrorBody, LinkStats, PrebuildRequest, PrebuildStatus, ResumeInfo, SnapshotInfo,
    SuspendInfo, TemplateDryRun, TemplateList, TemplateRequest, TemplateStatus, VmList, VmSpec,
    VmStatus, VsockInfo,
};
use crate::image::ImageSpec;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connect to imp-runtime at {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("HTTP exchange with imp-runtime: {0}")]
    Http(#[from] hyper::Error),
    #[error("imp-runtime answered {status}: {} ({})", body.error, body.message)]
    Api { status: StatusCode, body: ErrorBody },
    #[error("imp-runtime answered {status} with an undecodable body: {text}")]
    Decode { status: StatusCode, text: String },
}

impl ClientError {
    /// The runtime's reason label, when it answered with an error body.
    pub fn reason(&self) -> Option<&str> {
        match self {
            ClientError::Api { body, .. } => Some(&body.error),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct RuntimeClient {
    socket: PathBuf,
}

impl RuntimeClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Raw exchange: status and body bytes.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), ClientError> {
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|source| ClientError::Connect {
                path: self.socket.clone(),
                source,
            })?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, "imp-runtime");
        if body.is_some() {
            req = req.header(http::header::CONTENT_TYPE, "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .expect("valid request parts");
        let resp = sender.send_request(req).await?;
        let status = resp.status();
        Ok((status, resp.into_body().collect().await?.to_bytes()))
    }

    async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, T), ClientError> {
        let (status, bytes) = self.request(method, path, body).await?;
        if !status.is_success() {
            return Err(match serde_json::from_slice::<ErrorBody>(&bytes) {
                Ok(body) => ClientError::Api { status, body },
                Err(_) => ClientError::Decode {
                    status,
                    text: String::from_utf8_lossy(&bytes).into_owned(),
                },
            });
        }
        serde_json::from_slice(&bytes)
            .map(|v| (status, v))
            .map_err(|_| ClientError::Decode {
                status,
                text: String::from_utf8_lossy(&bytes).into_owned(),
            })
    }

    /// `PUT /v1/vms/{uid}`; the status is 201 when this call created the VM, 200 when it existed.
    pub async fn ensure_running(
        &self,
        uid: &str,
        spec: &VmSpec,
    ) -> Result<(StatusCode, VmStatus), ClientError> {
        let body = serde_json::to_vec(spec).expect("spec serialises");
        self.json(Method::PUT, &format!("/v1/vms/{uid}"), Some(body))
            .await
    }

    pub async fn inspect(&self, uid: &str) -> Result<VmStatus, ClientError> {
        Ok(self
            .json(Method::GET, &format!("/v1/vms/{uid}"), None)
            .await?
            .1)
    }

    pub async fn list(&self) -> Result<Vec<VmStatus>, ClientError> {
        Ok(self
            .json::<VmList>(Method::GET, "/v1/vms", None)
            .await?
            .1
            .vms)
    }

    pub async fn delete(&self, uid: &str) -> Result<(), ClientError> {
        self.delete_path(&format!("/v1/vms/{uid}")).await
    }

    /// A DELETE answered 204, else the runtime's error.
    async fn delete_path(&self, path: &str) -> Result<(), ClientError> {
        let (status, bytes) = self.request(Method::DELETE, path, None).await?;
        if status == StatusCode::NO_CONTENT {
            return Ok(());
        }
        Err(match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(body) => ClientError::Api { status, body },
            Err(_) => ClientError::Decode {
                status,
                text: String::from_utf8_lossy(&bytes).into_owned(),
            },
        })
    }

    pub async fn linkstats(&self, uid: &str) -> Result<LinkStats, ClientError> {
        Ok(self
            .json(Method::GET, &format!("/v1/vms/{uid}/linkstats"), None)
            .await?
            .1)
    }

    pub async fn vsock(&self, uid: &str) -> Result<VsockInfo, ClientError> {
        Ok(self
            .json(Method::GET, &format!("/v1/vms/{uid}/vsock"), None)
            .await?
            .1)
    }

    /// `POST /v1/images`: build `image`'s base image ahead of its first VM; answers once it is
    /// built (or found), which for a cold multi-GiB image takes minutes.
    pub async fn prebuild(&self, image: &ImageSpec) -> Result<PrebuildStatus, ClientError> {
        let body = serde_json::to_vec(&PrebuildRequest {
            image: image.clone(),
        })
        .expect("request serialises");
        Ok(self.json(Method::POST, "/v1/images", Some(body)).await?.1)
    }

    /// `GET /v1/capacity`: the writable-drive budget and its use, the templates' budget and use,
    /// and the template builds in flight.
    pub async fn capacity(&self) -> Result<Capacity, ClientError> {
        Ok(self.json(Method::GET, "/v1/capacity", None).await?.1)
    }

    pub async fn snapshot(&self, uid: &str) -> Result<SnapshotInfo, ClientError> {
        Ok(self
            .json(
                Method::POST,
                &format!("/v1/vms/{uid}/snapshot"),
                Some(b"{}".to_vec()),
            )
            .await?
            .1)
    }

    /// `POST /v1/vms/{uid}/suspend`: snapshot, stop the VMM, keep disks and network (409
    /// `NotRunning` unless Running).
    pub async fn suspend(&self, uid: &str) -> Result<SuspendInfo, ClientError> {
        Ok(self
            .json(Method::POST, &format!("/v1/vms/{uid}/suspend"), None)
            .await?
            .1)
    }

    /// `POST /v1/vms/{uid}/resume`: a fresh VMM from the snapshot, answered once the guest
    /// agent said Hello (409 `NotSuspended` unless Suspended; `ResumeFailed` keeps it
    /// Suspended).
    pub async fn resume(&self, uid: &str) -> Result<ResumeInfo, ClientError> {
        Ok(self
            .json(Method::POST, &format!("/v1/vms/{uid}/resume"), None)
            .await?
            .1)
    }

    /// `POST /v1/templates`: keep a template for VMs of `spec` (answered at once: Building,
    /// Ready or Failed).
    pub async fn ensure_template(&self, spec: &VmSpec) -> Result<TemplateStatus, ClientError> {
        let body = serde_json::to_vec(&TemplateRequest { spec: spec.clone() })
            .expect("request serialises");
        Ok(self
            .json(Method::POST, "/v1/templates", Some(body))
            .await?
            .1)
    }

    /// `POST /v1/templates/dry-run`: what [`Self::ensure_template`] of `spec` would find, and
    /// whether it would start a build; starts nothing. A runtime that predates it answers 404
    /// or 405.
    pub async fn template_dry_run(&self, spec: &VmSpec) -> Result<TemplateDryRun, ClientError> {
        let body = serde_json::to_vec(&TemplateRequest { spec: spec.clone() })
            .expect("request serialises");
        Ok(self
            .json(Method::POST, "/v1/templates/dry-run", Some(body))
            .await?
            .1)
    }

    /// `GET /v1/templates`.
    pub async fn templates(&self) -> Result<Vec<TemplateStatus>, ClientError> {
        Ok(self
            .json::<TemplateList>(Method::GET, "/v1/templates", None)
            .await?
            .1
            .templates)
    }

    /// `DELETE /v1/templates/{key}`: its files go once no clone restore is reading them.
    pub async fn delete_template(&self, key: &str) -> Result<(), ClientError> {
        self.delete_path(&format!("/v1/templates/{key}")).await
    }
}
