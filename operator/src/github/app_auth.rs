//! App authentication: the RS256 App JWT (through octocrab's jsonwebtoken) and the per-installation
//! token cache (re-mint ahead of expiry, single-flight, invalidation on 401).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex as StdMutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use octocrab::jsonwebtoken::{self, Algorithm, Header};
use serde::{Deserialize, Serialize};

use super::credentials::AppCredentials;
use super::errors::{GithubError, Operation};
use imp_common::{ExposeSecret, SecretString};

/// Seconds `iat` is backdated, against clock drift (GitHub's recommendation).
pub const JWT_BACKDATE_SECS: i64 = 60;
/// JWT lifetime ahead of now; GitHub refuses more than 10 minutes.
pub const JWT_LIFETIME_SECS: i64 = 9 * 60;

/// The claims of an App JWT.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppClaims {
    pub iat: i64,
    pub exp: i64,
    /// The App id.
    pub iss: String,
}

impl AppClaims {
    pub fn new(app_id: u64, now_unix: i64) -> Self {
        AppClaims {
            iat: now_unix - JWT_BACKDATE_SECS,
            exp: now_unix + JWT_LIFETIME_SECS,
            iss: app_id.to_string(),
        }
    }
}

/// Signs an App JWT for `now_unix`.
pub fn mint_app_jwt(creds: &AppCredentials, now_unix: i64) -> Result<SecretString, GithubError> {
    let claims = AppClaims::new(creds.app_id(), now_unix);
    jsonwebtoken::encode(
        &Header::new(Algorithm::RS256),
        &claims,
        creds.encoding_key(),
    )
    .map(SecretString::from)
    .map_err(|_| {
        GithubError::Credentials(super::credentials::CredentialsError::InvalidKey {
            key: super::credentials::KEY_PRIVATE_KEY,
            reason: "signing the App JWT failed",
        })
    })
}

/// An installation token with its expiry.
#[derive(Debug, Clone)]
pub struct CachedToken {
    pub token: SecretString,
    pub expires_at: DateTime<Utc>,
}

#[derive(Default)]
struct Slot {
    token: Option<CachedToken>,
    /// A failed exchange, shared briefly with the callers that queued behind it.
    last_failure: Option<(Instant, GithubError)>,
}

/// How long a failed exchange answers queued callers before another exchange is tried.
const FAILURE_SHARE: Duration = Duration::from_millis(500);

/// Installation tokens per installation. Each installation has one async lock: a caller that
/// finds no usable token exchanges while the others wait, then they all use its result.
#[derive(Default)]
pub(crate) struct TokenCache {
    slots: StdMutex<HashMap<u64, Arc<tokio::sync::Mutex<Slot>>>>,
}

impl TokenCache {
    fn slot(&self, installation_id: u64) -> Arc<tokio::sync::Mutex<Slot>> {
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(installation_id)
            .or_default()
            .clone()
    }

    /// A token valid for more than `margin`, exchanging through `exchange` when needed.
    pub async fn get<F, Fut>(
        &self,
        installation_id: u64,
        margin: Duration,
        exchange: F,
    ) -> Result<SecretString, GithubError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<CachedToken, GithubError>>,
    {
        let slot = self.slot(installation_id);
        let mut guard = slot.lock().await;
        let margin = chrono::Duration::from_std(margin).unwrap_or(chrono::Duration::MAX);
        if let Some(t) = &guard.token
            && t.expires_at - Utc::now() > margin
        {
            return Ok(t.token.clone());
        }
        if let Some((at, err)) = &guard.last_failure
            && at.elapsed() < FAILURE_SHARE
        {
            return Err(err.clone());
        }
        match exchange().await {
            Ok(t) => {
                let token = t.token.clone();
                guard.token = Some(t);
                guard.last_failure = None;
                Ok(token)
            }
            Err(e) => {
                guard.token = None;
                guard.last_failure = Some((Instant::now(), e.clone()));
                Err(e)
            }
        }
    }

    /// Drops `token` if it is still the cached one (a 401 proved it dead).
    pub async fn invalidate(&self, installation_id: u64, token: &SecretString) {
        let slot = self.slot(installation_id);
        let mut guard = slot.lock().await;
        if guard
            .token
            .as_ref()
            .is_some_and(|t| t.token.expose_secret() == token.expose_secret())
        {
            guard.token = None;
        }
    }
}

/// The 201 body of `POST /app/installations/{id}/access_tokens`.
#[derive(Deserialize)]
pub(crate) struct AccessTokenResponse {
    pub token: String,
    pub expires_at: DateTime<Utc>,
}

impl AccessTokenResponse {
    pub fn parse(body: &[u8]) -> Result<CachedToken, GithubError> {
        let r: AccessTokenResponse =
            serde_json::from_slice(body).map_err(|e| GithubError::Decode {
                operation: Operation::TokenExchange,
                // serde errors quote at most a type and position here, never the token value
                message: format!("access token response: {}", e.classify_name()),
            })?;
        Ok(CachedToken {
            token: SecretString::from(r.token),
            expires_at: r.expires_at,
        })
    }
}

trait ClassifyName {
    fn classify_name(&self) -> &'static str;
}

impl ClassifyName for serde_json::Error {
    fn classify_name(&self) -> &'static str {
        match self.classify() {
            serde_json::error::Category::Io => "io error",
            serde_json::error::Category::Syntax => "invalid JSON",
            serde_json::error::Category::Data => "unexpected shape",
            serde_json::error::Category::Eof => "truncated",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use imp_testkit::github::keys::verify_rs256;
    use imp_testkit::github::test_key;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn claims_follow_githubs_rules() {
        let now = 1_800_000_000;
        let c = AppClaims::new(42, now);
        assert_eq!(c.iat, now - 60);
        assert!(
            c.exp > now && c.exp - now <= 600,
            "exp at most 10 minutes ahead"
        );
        assert!(c.exp - c.iat <= 660);
        assert_eq!(c.iss, "42");
    }

    #[test]
    fn jwt_is_rs256_signed_by_the_app_key() {
        let key = test_key(0);
        let creds = AppCredentials::from_parts(42, 7, key.pkcs1_pem().as_bytes()).unwrap();
        let now = Utc::now().timestamp();
        let jwt = mint_app_jwt(&creds, now).unwrap();
        let parts: Vec<&str> = jwt.expose_secret().split('.').collect();
        assert_eq!(parts.len(), 3);
        let header: serde_json::Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[0]).unwrap()).unwrap();
        assert_eq!(header["alg"], "RS256");
        let claims: AppClaims =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[1]).unwrap()).unwrap();
        assert_eq!(claims, AppClaims::new(42, now));
        let sig = URL_SAFE_NO_PAD.decode(parts[2]).unwrap();
        let signed = format!("{}.{}", parts[0], parts[1]);
        assert!(verify_rs256(key.public_key_der(), signed.as_bytes(), &sig));
        assert!(!verify_rs256(
            test_key(1).public_key_der(),
            signed.as_bytes(),
            &sig
        ));
        assert_eq!(format!("{jwt:?}"), "SecretBox<str>([REDACTED])");
    }

    fn token(s: &str, ttl_secs: i64) -> CachedToken {
        CachedToken {
            token: SecretString::from(s),
            expires_at: Utc::now() + chrono::Duration::seconds(ttl_secs),
        }
    }

    #[tokio::test]
    async fn cache_reuses_remints_near_expiry_and_invalidates() {
        let cache = TokenCache::default();
        let calls = AtomicU32::new(0);
        let margin = Duration::from_secs(300);
        let ex = |ttl| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move { Ok(token(&format!("t{n}"), ttl)) }
        };
        let t = cache.get(1, margin, || ex(3600)).await.unwrap();
        assert_eq!(t.expose_secret(), "t0");
        assert_eq!(
            cache
                .get(1, margin, || ex(3600))
                .await
                .unwrap()
                .expose_secret(),
            "t0"
        );
        // Another installation has its own token.
        assert_eq!(
            cache
                .get(2, margin, || ex(3600))
                .await
                .unwrap()
                .expose_secret(),
            "t1"
        );
        cache.invalidate(1, &SecretString::from("stale")).await;
        assert_eq!(
            cache
                .get(1, margin, || ex(3600))
                .await
                .unwrap()
                .expose_secret(),
            "t0",
            "other token: no-op"
        );
        cache.invalidate(1, &t).await;
        // 4 minutes left is inside the 5 minute margin: re-minted on every call.
        assert_eq!(
            cache
                .get(1, margin, || ex(240))
                .await
                .unwrap()
                .expose_secret(),
            "t2"
        );
        assert_eq!(
            cache
                .get(1, margin, || ex(3600))
                .await
                .unwrap()
                .expose_secret(),
            "t3"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    }
}
