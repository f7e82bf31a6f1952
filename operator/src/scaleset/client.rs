//! The scale-set boundary: GitHub's runner-registration exchange, the Actions service's scale-set,
//! session, acquire and JIT endpoints, and the message queue. Types mirror the wire shapes
//! (docs/github.md, the scale-set intake); every failure is a [`ScaleSetError`] variant. Tokens are
//! [`SecretString`]s: never logged, never in an error message.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, StatusCode};
use http_body_util::BodyExt;
use octocrab::Octocrab;
use octocrab::service::middleware::retry::RetryConfig;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::{Call, ScaleSetError};
use crate::github::{GithubApp, RunnerScope};
use imp_common::{ExposeSecret, SecretString};

/// The Actions service's API version.
const API_VERSION: &str = "6.0-preview";
/// The header a listener reports its capacity in.
pub const HEADER_MAX_CAPACITY: &str = "X-ScaleSetMaxCapacity";

/// The Actions service endpoint and its admin token.
#[derive(Clone)]
pub struct AdminConnection {
    /// Ends with `/`.
    pub url: String,
    pub token: SecretString,
}

/// A runner scale set as the Actions service reports it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScaleSet {
    pub id: u64,
    pub name: String,
    #[serde(default)]
    pub runner_group_id: u64,
    #[serde(default)]
    pub labels: Vec<ScaleSetLabel>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ScaleSetLabel {
    pub name: String,
}

/// GitHub's statistics block of a poll or session.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Statistics {
    pub total_available_jobs: u32,
    pub total_acquired_jobs: u32,
    pub total_assigned_jobs: u32,
    pub total_running_jobs: u32,
    pub total_registered_runners: u32,
    pub total_busy_runners: u32,
    pub total_idle_runners: u32,
}

/// An open message session.
#[derive(Clone)]
pub struct Session {
    pub id: String,
    pub owner: String,
    pub queue_url: String,
    pub queue_token: SecretString,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

/// The fields every job message carries.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobBase {
    pub runner_request_id: i64,
    #[serde(default)]
    pub repository_name: String,
    #[serde(default)]
    pub owner_name: String,
    #[serde(default)]
    pub job_id: String,
    #[serde(default)]
    pub workflow_run_id: Option<i64>,
    #[serde(default)]
    pub request_labels: Vec<String>,
    #[serde(default)]
    pub queue_time: Option<String>,
    #[serde(default)]
    pub runner_assign_time: Option<String>,
    #[serde(default)]
    pub finish_time: Option<String>,
}

/// One job message of a queue message.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "messageType")]
pub enum JobMessage {
    JobAvailable {
        #[serde(flatten)]
        base: JobBase,
    },
    JobAssigned {
        #[serde(flatten)]
        base: JobBase,
    },
    JobStarted {
        #[serde(flatten)]
        base: JobBase,
        #[serde(rename = "runnerName", default)]
        runner_name: String,
    },
    JobCompleted {
        #[serde(flatten)]
        base: JobBase,
        #[serde(default)]
        result: String,
        #[serde(rename = "runnerName", default)]
        runner_name: String,
    },
}

impl JobMessage {
    pub fn base(&self) -> &JobBase {
        match self {
            JobMessage::JobAvailable { base }
            | JobMessage::JobAssigned { base }
            | JobMessage::JobStarted { base, .. }
            | JobMessage::JobCompleted { base, .. } => base,
        }
    }
}

/// A queue message: job messages to act on, then delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub id: u64,
    pub statistics: Statistics,
    pub jobs: Vec<JobMessage>,
}

/// A JIT runner minted through the scale set.
#[derive(Clone)]
pub struct ScaleSetJit {
    pub runner_id: u64,
    pub runner_name: String,
    pub encoded_jit_config: SecretString,
}

/// The client of one scope's scale sets. HTTP goes through octocrab's stack (TLS, timeouts) with
/// no credentials of its own: each call carries the token it needs.
pub struct ScaleSetClient {
    app: GithubApp,
    scope: RunnerScope,
    /// The GitHub REST API base (`https://api.github.com`, GHES `https://HOST/api/v3`).
    api_base: String,
    request_timeout: Duration,
    /// How long a long poll may take before we give up on it (GitHub answers within ~50 s).
    poll_timeout: Duration,
    /// One HTTP client per scheme+authority (the Actions service and the queue live on other hosts).
    clients: Mutex<HashMap<String, Octocrab>>,
}

/// The web URL of a scope (the registration body's `url`): `https://github.com/<org>` for
/// github.com, `https://HOST/<org>` for GHES, the API base itself elsewhere (the simulator).
pub fn config_url(api_base: &str, scope: &RunnerScope) -> Result<String, ScaleSetError> {
    let base = api_base.trim_end_matches('/');
    let web = if base == "https://api.github.com" {
        "https://github.com".to_string()
    } else if let Some(host) = base.strip_suffix("/api/v3") {
        host.to_string()
    } else {
        base.to_string()
    };
    match scope {
        RunnerScope::Organization { org } => Ok(format!("{web}/{org}")),
        RunnerScope::Repository { owner, repo } => Ok(format!("{web}/{owner}/{repo}")),
        RunnerScope::Enterprise { .. } => Err(ScaleSetError::InvalidRequest(
            "enterprise scope is not supported".into(),
        )),
    }
}

fn split_url(url: &str) -> Result<(String, String), ScaleSetError> {
    let uri: http::Uri = url
        .parse()
        .map_err(|_| ScaleSetError::InvalidRequest(format!("not a URL: `{url}`")))?;
    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return Err(ScaleSetError::InvalidRequest(format!(
            "not an absolute URL: `{url}`"
        )));
    };
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    Ok((format!("{scheme}://{authority}"), path.to_string()))
}

/// GitHub's error text of an answer (`message`, else the body start).
fn message_of(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned())
}

fn exception_of(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["typeName"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The error of an unexpected answer to `call`.
pub fn classify(call: Call, status: StatusCode, body: &[u8]) -> ScaleSetError {
    let message = message_of(body);
    let exception = exception_of(body);
    match status.as_u16() {
        401 => ScaleSetError::Unauthorized { call },
        403 if message.contains("is deprecated") => {
            ScaleSetError::RunnerVersionDeprecated { call, message }
        }
        404 => ScaleSetError::NotFound { call, message },
        409 if exception.contains("SessionConflict") || message.contains("active session") => {
            ScaleSetError::SessionConflict { message }
        }
        409 if exception.contains("AgentExists") => ScaleSetError::RunnerExists { message },
        409 => ScaleSetError::Conflict { call, message },
        s @ 500..=599 => ScaleSetError::Server { call, status: s },
        s => ScaleSetError::UnexpectedStatus {
            call,
            status: s,
            message,
        },
    }
}

fn decode<T: serde::de::DeserializeOwned>(call: Call, body: &[u8]) -> Result<T, ScaleSetError> {
    serde_json::from_slice(body).map_err(|e| ScaleSetError::Decode {
        call,
        message: e.to_string(),
    })
}

#[derive(Deserialize)]
struct ListAnswer<T> {
    #[serde(default = "Vec::new")]
    value: Vec<T>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct GroupAnswer {
    id: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SessionAnswer {
    session_id: String,
    #[serde(default)]
    owner_name: String,
    message_queue_url: String,
    message_queue_access_token: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MessageAnswer {
    message_id: u64,
    #[serde(default)]
    message_type: String,
    #[serde(default)]
    body: String,
    #[serde(default)]
    statistics: Option<Statistics>,
}

#[derive(Deserialize)]
struct AcquireAnswer {
    #[serde(default)]
    value: Vec<i64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct JitAnswer {
    runner: JitRunnerRef,
    #[serde(rename = "encodedJITConfig")]
    encoded_jit_config: String,
}

#[derive(Deserialize)]
struct JitRunnerRef {
    id: u64,
    name: String,
}

impl ScaleSetClient {
    pub fn new(
        app: GithubApp,
        scope: RunnerScope,
        api_base: String,
        request_timeout: Duration,
        poll_timeout: Duration,
    ) -> Self {
        ScaleSetClient {
            app,
            scope,
            api_base: api_base.trim_end_matches('/').to_string(),
            request_timeout,
            poll_timeout,
            clients: Mutex::new(HashMap::new()),
        }
    }

    pub fn scope(&self) -> &RunnerScope {
        &self.scope
    }

    fn http(&self, base: &str) -> Result<Octocrab, ScaleSetError> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = clients.get(base) {
            return Ok(c.clone());
        }
        // The read timeout covers a long poll; each call also has its own deadline.
        let read = self.poll_timeout.max(self.request_timeout) + Duration::from_secs(10);
        let c = Octocrab::builder()
            .base_uri(base)
            .map_err(|_| ScaleSetError::InvalidRequest(format!("invalid base URL `{base}`")))?
            .add_retry_config(RetryConfig::None)
            .set_connect_timeout(Some(self.request_timeout))
            .set_read_timeout(Some(read))
            .build()
            .map_err(|e| ScaleSetError::InvalidRequest(format!("building the HTTP client: {e}")))?;
        clients.insert(base.to_string(), c.clone());
        Ok(c)
    }

    /// One exchange; `auth` is the whole Authorization value.
    async fn send(
        &self,
        call: Call,
        method: Method,
        url: &str,
        auth: &str,
        extra: Option<(&str, String)>,
        body: Option<&Value>,
    ) -> Result<(StatusCode, Bytes), ScaleSetError> {
        // A long poll may take GitHub's whole poll window.
        let deadline = match call {
            Call::GetMessage => self.poll_timeout + self.request_timeout,
            _ => self.request_timeout,
        };
        let (base, path) = split_url(url)?;
        let http = self.http(&base)?;
        let mut authz = HeaderValue::from_str(auth)
            .map_err(|_| ScaleSetError::InvalidRequest("token is not a header value".into()))?;
        authz.set_sensitive(true);
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::AUTHORIZATION, authz)
            .header(
                http::header::ACCEPT,
                format!("application/json; api-version={API_VERSION}"),
            )
            .header(http::header::USER_AGENT, "imp-operator");
        if let Some((k, v)) = extra {
            req = req.header(k, v);
        }
        let body = match body {
            Some(v) => {
                req = req.header(http::header::CONTENT_TYPE, "application/json");
                v.to_string()
            }
            None => String::new(),
        };
        let req = req
            .body(body)
            .map_err(|e| ScaleSetError::InvalidRequest(format!("{call}: {e}")))?;
        let exchange = async {
            let resp = http
                .execute(req)
                .await
                .map_err(|e| ScaleSetError::Transport {
                    call,
                    message: e.to_string(),
                })?;
            let (parts, body) = resp.into_parts();
            let body = body.collect().await.map_err(|e| ScaleSetError::Transport {
                call,
                message: e.to_string(),
            })?;
            Ok((parts.status, body.to_bytes()))
        };
        tokio::time::timeout(deadline, exchange)
            .await
            .unwrap_or(Err(ScaleSetError::Timeout {
                call,
                after: deadline,
            }))
    }

    fn service_url(conn: &AdminConnection, path: &str) -> String {
        let sep = if path.contains('?') { '&' } else { '?' };
        format!("{}{path}{sep}api-version={API_VERSION}", conn.url)
    }

    async fn admin_call(
        &self,
        conn: &AdminConnection,
        call: Call,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(StatusCode, Bytes), ScaleSetError> {
        let auth = format!("Bearer {}", conn.token.expose_secret());
        let url = Self::service_url(conn, path);
        self.send(call, method, &url, &auth, None, body).await
    }

    /// Registration token (installation token) -> the Actions service URL and an admin token.
    pub async fn connect(&self) -> Result<AdminConnection, ScaleSetError> {
        let path = format!(
            "{}/runners/registration-token",
            self.scope.actions_path().map_err(ScaleSetError::Github)?
        );
        let token = self
            .app
            .installation_token()
            .await
            .map_err(ScaleSetError::Github)?;
        let (status, body) = self
            .send(
                Call::RegistrationToken,
                Method::POST,
                &format!("{}{path}", self.api_base),
                &format!("Bearer {}", token.expose_secret()),
                None,
                None,
            )
            .await?;
        if !status.is_success() {
            return Err(classify(Call::RegistrationToken, status, &body));
        }
        let reg: Value = decode(Call::RegistrationToken, &body)?;
        let reg = reg["token"]
            .as_str()
            .ok_or_else(|| ScaleSetError::Decode {
                call: Call::RegistrationToken,
                message: "no token in the answer".into(),
            })?
            .to_string();
        let body = json!({
            "url": config_url(&self.api_base, &self.scope)?,
            "runner_event": "register",
        });
        let url = format!("{}/actions/runner-registration", self.api_base);
        let (status, body) = self
            .send(
                Call::AdminConnection,
                Method::POST,
                &url,
                &format!("RemoteAuth {reg}"),
                None,
                Some(&body),
            )
            .await?;
        if !status.is_success() {
            return Err(classify(Call::AdminConnection, status, &body));
        }
        let v: Value = decode(Call::AdminConnection, &body)?;
        let (Some(url), Some(token)) = (v["url"].as_str(), v["token"].as_str()) else {
            return Err(ScaleSetError::Decode {
                call: Call::AdminConnection,
                message: "the answer lacks url or token".into(),
            });
        };
        let url = if url.ends_with('/') {
            url.to_string()
        } else {
            format!("{url}/")
        };
        Ok(AdminConnection {
            url,
            token: SecretString::from(token.to_string()),
        })
    }

    /// The id of a runner group by name (`None`: the default group).
    pub async fn runner_group_id(
        &self,
        conn: &AdminConnection,
        name: Option<&str>,
    ) -> Result<u64, ScaleSetError> {
        let Some(name) = name else {
            return Ok(crate::github::DEFAULT_RUNNER_GROUP_ID);
        };
        let path = format!("_apis/runtime/runnergroups/?groupName={}", encode(name));
        let (status, body) = self
            .admin_call(conn, Call::RunnerGroup, Method::GET, &path, None)
            .await?;
        if !status.is_success() {
            return Err(classify(Call::RunnerGroup, status, &body));
        }
        let list: ListAnswer<GroupAnswer> = decode(Call::RunnerGroup, &body)?;
        list.value
            .first()
            .map(|g| g.id)
            .ok_or_else(|| ScaleSetError::NotFound {
                call: Call::RunnerGroup,
                message: format!("runner group `{name}` does not exist"),
            })
    }

    /// The scale set named `name`, if it exists.
    pub async fn get_scale_set(
        &self,
        conn: &AdminConnection,
        name: &str,
        group_id: u64,
    ) -> Result<Option<ScaleSet>, ScaleSetError> {
        let path = format!(
            "_apis/runtime/runnerscalesets?runnerGroupId={group_id}&name={}",
            encode(name)
        );
        let (status, body) = self
            .admin_call(conn, Call::GetScaleSet, Method::GET, &path, None)
            .await?;
        if !status.is_success() {
            return Err(classify(Call::GetScaleSet, status, &body));
        }
        let list: ListAnswer<ScaleSet> = decode(Call::GetScaleSet, &body)?;
        Ok(list
            .value
            .into_iter()
            .find(|s| s.name.eq_ignore_ascii_case(name)))
    }

    pub async fn create_scale_set(
        &self,
        conn: &AdminConnection,
        name: &str,
        group_id: u64,
        labels: &[String],
    ) -> Result<ScaleSet, ScaleSetError> {
        let labels: Vec<Value> = labels
            .iter()
            .map(|l| json!({"name": l, "type": "System"}))
            .collect();
        let body = json!({
            "name": name,
            "runnerGroupId": group_id,
            "labels": labels,
            "RunnerSetting": { "disableUpdate": true },
        });
        let (status, body) = self
            .admin_call(
                conn,
                Call::CreateScaleSet,
                Method::POST,
                "_apis/runtime/runnerscalesets",
                Some(&body),
            )
            .await?;
        if !status.is_success() {
            return Err(classify(Call::CreateScaleSet, status, &body));
        }
        decode(Call::CreateScaleSet, &body)
    }

    /// Opens the scale set's message session; [`ScaleSetError::SessionConflict`] while another
    /// owner's session is live.
    pub async fn create_session(
        &self,
        conn: &AdminConnection,
        set_id: u64,
        owner: &str,
    ) -> Result<Session, ScaleSetError> {
        let path = format!("_apis/runtime/runnerscalesets/{set_id}/sessions");
        let body = json!({ "ownerName": owner });
        let (status, body) = self
            .admin_call(conn, Call::CreateSession, Method::POST, &path, Some(&body))
            .await?;
        if !status.is_success() {
            return Err(classify(Call::CreateSession, status, &body));
        }
        let s: SessionAnswer = decode(Call::CreateSession, &body)?;
        Ok(Session {
            id: s.session_id,
            owner: if s.owner_name.is_empty() {
                owner.to_string()
            } else {
                s.owner_name
            },
            queue_url: s.message_queue_url,
            queue_token: SecretString::from(s.message_queue_access_token),
        })
    }

    /// Refreshes the session after a 401 on the queue (`PATCH .../sessions/{id}`): the same
    /// session with a new queue token. [`ScaleSetError::NotFound`] when it is gone (open a new one);
    /// [`ScaleSetError::Unauthorized`] when the admin token is refused too (reconnect first).
    pub async fn refresh_session(
        &self,
        conn: &AdminConnection,
        set_id: u64,
        session: &Session,
    ) -> Result<Session, ScaleSetError> {
        let path = format!(
            "_apis/runtime/runnerscalesets/{set_id}/sessions/{}",
            session.id
        );
        let (status, body) = self
            .admin_call(conn, Call::RefreshSession, Method::PATCH, &path, None)
            .await?;
        if !status.is_success() {
            return Err(classify(Call::RefreshSession, status, &body));
        }
        let s: SessionAnswer = decode(Call::RefreshSession, &body)?;
        Ok(Session {
            id: s.session_id,
            owner: if s.owner_name.is_empty() {
                session.owner.clone()
            } else {
                s.owner_name
            },
            queue_url: s.message_queue_url,
            queue_token: SecretString::from(s.message_queue_access_token),
        })
    }

    pub async fn delete_session(
        &self,
        conn: &AdminConnection,
        set_id: u64,
        session: &Session,
    ) -> Result<(), ScaleSetError> {
        let path = format!(
            "_apis/runtime/runnerscalesets/{set_id}/sessions/{}",
            session.id
        );
        let (status, body) = self
            .admin_call(conn, Call::DeleteSession, Method::DELETE, &path, None)
            .await?;
        if status.is_success() || status == StatusCode::NOT_FOUND {
            Ok(())
        } else {
            Err(classify(Call::DeleteSession, status, &body))
        }
    }

    /// One long poll: `None` when nothing arrived (202).
    pub async fn get_message(
        &self,
        session: &Session,
        last_message_id: u64,
        max_capacity: u32,
    ) -> Result<Option<Message>, ScaleSetError> {
        let sep = if session.queue_url.contains('?') {
            '&'
        } else {
            '?'
        };
        let url = format!("{}{sep}lastMessageId={last_message_id}", session.queue_url);
        let auth = format!("Bearer {}", session.queue_token.expose_secret());
        let (status, body) = self
            .send(
                Call::GetMessage,
                Method::GET,
                &url,
                &auth,
                Some((HEADER_MAX_CAPACITY, max_capacity.to_string())),
                None,
            )
            .await?;
        match status {
            StatusCode::ACCEPTED | StatusCode::NO_CONTENT => Ok(None),
            s if s.is_success() => parse_message(&body).map(Some),
            s => Err(classify(Call::GetMessage, s, &body)),
        }
    }

    /// Deletes (acknowledges) a message.
    pub async fn delete_message(
        &self,
        session: &Session,
        message_id: u64,
    ) -> Result<(), ScaleSetError> {
        let (base, query) = match session.queue_url.split_once('?') {
            Some((b, q)) => (b.to_string(), format!("?{q}")),
            None => (session.queue_url.clone(), String::new()),
        };
        let url = format!("{}/{message_id}{query}", base.trim_end_matches('/'));
        let auth = format!("Bearer {}", session.queue_token.expose_secret());
        let (status, body) = self
            .send(Call::DeleteMessage, Method::DELETE, &url, &auth, None, None)
            .await?;
        if status.is_success() {
            Ok(())
        } else {
            Err(classify(Call::DeleteMessage, status, &body))
        }
    }

    /// Acquires jobs by runner request id; answers the ids acquired.
    pub async fn acquire_jobs(
        &self,
        conn: &AdminConnection,
        session: &Session,
        set_id: u64,
        ids: &[i64],
    ) -> Result<Vec<i64>, ScaleSetError> {
        let path = format!("_apis/runtime/runnerscalesets/{set_id}/acquirejobs");
        let url = Self::service_url(conn, &path);
        let auth = format!("Bearer {}", session.queue_token.expose_secret());
        let (status, body) = self
            .send(
                Call::AcquireJobs,
                Method::POST,
                &url,
                &auth,
                None,
                Some(&json!(ids)),
            )
            .await?;
        if !status.is_success() {
            return Err(classify(Call::AcquireJobs, status, &body));
        }
        Ok(decode::<AcquireAnswer>(Call::AcquireJobs, &body)?.value)
    }

    /// Mints a JIT runner bound to the scale set.
    pub async fn generate_jit_config(
        &self,
        conn: &AdminConnection,
        set_id: u64,
        runner_name: &str,
        work_folder: &str,
    ) -> Result<ScaleSetJit, ScaleSetError> {
        let path = format!("_apis/runtime/runnerscalesets/{set_id}/generatejitconfig");
        let body = json!({ "name": runner_name, "workFolder": work_folder });
        let (status, body) = self
            .admin_call(
                conn,
                Call::GenerateJitConfig,
                Method::POST,
                &path,
                Some(&body),
            )
            .await?;
        if !status.is_success() {
            return Err(classify(Call::GenerateJitConfig, status, &body));
        }
        let a: JitAnswer = decode(Call::GenerateJitConfig, &body)?;
        Ok(ScaleSetJit {
            runner_id: a.runner.id,
            runner_name: a.runner.name,
            encoded_jit_config: SecretString::from(a.encoded_jit_config),
        })
    }
}

/// A 200 poll answer: the body is a JSON string holding the array of job messages.
pub fn parse_message(body: &[u8]) -> Result<Message, ScaleSetError> {
    let m: MessageAnswer = decode(Call::GetMessage, body)?;
    let jobs = if m.message_type == "RunnerScaleSetJobMessages" && !m.body.is_empty() {
        // Unknown message types inside are skipped, not fatal: GitHub may add some.
        let raw: Vec<Value> = serde_json::from_str(&m.body).map_err(|e| ScaleSetError::Decode {
            call: Call::GetMessage,
            message: format!("message {} body: {e}", m.message_id),
        })?;
        raw.into_iter()
            .filter_map(|v| serde_json::from_value::<JobMessage>(v).ok())
            .collect()
    } else {
        Vec::new()
    };
    Ok(Message {
        id: m.message_id,
        statistics: m.statistics.unwrap_or_default(),
        jobs,
    })
}

/// Percent-encodes a query value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poll_body_parses_into_typed_job_messages_and_skips_unknown_ones() {
        let jobs = json!([
            {"messageType": "JobAvailable", "runnerRequestId": 7, "jobId": "11",
             "repositoryName": "r", "ownerName": "o", "requestLabels": ["s"],
             "acquireJobUrl": "x"},
            {"messageType": "JobStarted", "runnerRequestId": 7, "runnerName": "r-1",
             "runnerId": 3},
            {"messageType": "SomethingNew", "runnerRequestId": 8},
            {"messageType": "JobCompleted", "runnerRequestId": 7, "result": "succeeded",
             "runnerName": "r-1"},
        ]);
        let body = json!({"messageId": 4, "messageType": "RunnerScaleSetJobMessages",
                          "body": jobs.to_string(),
                          "statistics": {"totalAssignedJobs": 2}});
        let m = parse_message(body.to_string().as_bytes()).unwrap();
        assert_eq!(m.id, 4);
        assert_eq!(m.statistics.total_assigned_jobs, 2);
        assert_eq!(m.jobs.len(), 3);
        assert_eq!(m.jobs[0].base().job_id, "11");
        assert!(
            matches!(&m.jobs[1], JobMessage::JobStarted { runner_name, .. } if runner_name == "r-1")
        );
        assert!(
            matches!(&m.jobs[2], JobMessage::JobCompleted { result, .. } if result == "succeeded")
        );
    }

    #[test]
    fn answers_map_to_precise_errors() {
        let conflict = json!({"typeName": "RunnerScaleSetSessionConflictException",
            "message": "The runner scale set 1 already has an active session for owner a."});
        assert!(matches!(
            classify(Call::CreateSession, StatusCode::CONFLICT, conflict.to_string().as_bytes()),
            ScaleSetError::SessionConflict { message } if message.contains("owner a")
        ));
        let exists = json!({"typeName": "AgentExistsException", "message": "exists"});
        assert!(matches!(
            classify(
                Call::GenerateJitConfig,
                StatusCode::CONFLICT,
                exists.to_string().as_bytes()
            ),
            ScaleSetError::RunnerExists { .. }
        ));
        assert!(matches!(
            classify(Call::GetMessage, StatusCode::UNAUTHORIZED, b""),
            ScaleSetError::Unauthorized {
                call: Call::GetMessage
            }
        ));
        let deprecated = json!({"message": "Runner version v2.300.0 is deprecated and cannot receive messages."});
        assert!(matches!(
            classify(
                Call::GetMessage,
                StatusCode::FORBIDDEN,
                deprecated.to_string().as_bytes()
            ),
            ScaleSetError::RunnerVersionDeprecated { .. }
        ));
        assert!(matches!(
            classify(Call::AcquireJobs, StatusCode::BAD_GATEWAY, b"oops"),
            ScaleSetError::Server { status: 502, .. }
        ));
    }

    #[test]
    fn the_config_url_is_the_web_url_of_the_scope() {
        let org = RunnerScope::org("acme");
        assert_eq!(
            config_url("https://api.github.com", &org).unwrap(),
            "https://github.com/acme"
        );
        assert_eq!(
            config_url("https://ghe.example/api/v3/", &RunnerScope::repo("a", "b")).unwrap(),
            "https://ghe.example/a/b"
        );
        assert_eq!(
            config_url("http://127.0.0.1:9", &org).unwrap(),
            "http://127.0.0.1:9/acme"
        );
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(encode("my group/1"), "my%20group%2F1");
    }
}
