//! GitHub App credentials from a Kubernetes Secret.
//!
//! Keys (docs/github.md): `app-id` (decimal App id), `installation-id` (decimal installation id),
//! `private-key` (the App's RSA private key, PEM, PKCS#1 `BEGIN RSA PRIVATE KEY` as GitHub
//! downloads it, or PKCS#8 `BEGIN PRIVATE KEY`). Errors name the key, never its value.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use octocrab::jsonwebtoken::{self, Algorithm, EncodingKey, Header};

use imp_common::{ExposeSecret, SecretString};

/// Secret key holding the App id.
pub const KEY_APP_ID: &str = "app-id";
/// Secret key holding the installation id.
pub const KEY_INSTALLATION_ID: &str = "installation-id";
/// Secret key holding the PEM private key.
pub const KEY_PRIVATE_KEY: &str = "private-key";

/// Why credentials could not be loaded. Never contains a key's value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CredentialsError {
    #[error("GitHub App Secret is missing key `{key}`")]
    MissingKey { key: &'static str },
    #[error("GitHub App Secret key `{key}` is invalid: {reason}")]
    InvalidKey {
        key: &'static str,
        reason: &'static str,
    },
}

/// A GitHub App's identity: App id, installation id and signing key.
#[derive(Clone)]
pub struct AppCredentials {
    app_id: u64,
    installation_id: u64,
    key: Arc<EncodingKey>,
}

impl std::fmt::Debug for AppCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppCredentials")
            .field("app_id", &self.app_id)
            .field("installation_id", &self.installation_id)
            .field("private_key", &"[redacted]")
            .finish()
    }
}

impl AppCredentials {
    /// From a Secret object (`data`, and `stringData` if present).
    pub fn from_secret(secret: &Secret) -> Result<Self, CredentialsError> {
        let mut data: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for (k, v) in secret.data.iter().flatten() {
            data.insert(k.clone(), v.0.clone());
        }
        for (k, v) in secret.string_data.iter().flatten() {
            data.insert(k.clone(), v.as_bytes().to_vec());
        }
        Self::from_bytes_map(&data)
    }

    /// From a Secret's `data`.
    pub fn from_secret_data(data: &BTreeMap<String, ByteString>) -> Result<Self, CredentialsError> {
        let data: BTreeMap<String, Vec<u8>> =
            data.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect();
        Self::from_bytes_map(&data)
    }

    /// From string values (a Secret's `stringData`, or test fixtures).
    pub fn from_string_data(data: &BTreeMap<String, String>) -> Result<Self, CredentialsError> {
        let data: BTreeMap<String, Vec<u8>> = data
            .iter()
            .map(|(k, v)| (k.clone(), v.as_bytes().to_vec()))
            .collect();
        Self::from_bytes_map(&data)
    }

    fn from_bytes_map(data: &BTreeMap<String, Vec<u8>>) -> Result<Self, CredentialsError> {
        let get = |key: &'static str| {
            data.get(key)
                .filter(|v| !v.iter().all(u8::is_ascii_whitespace))
                .ok_or(CredentialsError::MissingKey { key })
        };
        let app_id = parse_id(KEY_APP_ID, get(KEY_APP_ID)?)?;
        let installation_id = parse_id(KEY_INSTALLATION_ID, get(KEY_INSTALLATION_ID)?)?;
        Self::from_parts(app_id, installation_id, get(KEY_PRIVATE_KEY)?)
    }

    /// From already-parsed ids and the PEM bytes of the private key.
    pub fn from_parts(
        app_id: u64,
        installation_id: u64,
        pem: &[u8],
    ) -> Result<Self, CredentialsError> {
        let invalid = |reason| CredentialsError::InvalidKey {
            key: KEY_PRIVATE_KEY,
            reason,
        };
        let key = rsa_encoding_key(pem).map_err(invalid)?;
        // Prove the key signs now, rather than on the first mint.
        jsonwebtoken::encode(
            &Header::new(Algorithm::RS256),
            &serde_json::json!({ "probe": true }),
            &key,
        )
        .map_err(|_| invalid("not a usable RSA private key"))?;
        Ok(AppCredentials {
            app_id,
            installation_id,
            key: Arc::new(key),
        })
    }

    /// From ids and a PEM held in its redacted wrapper.
    pub fn from_private_key(
        app_id: u64,
        installation_id: u64,
        pem: &SecretString,
    ) -> Result<Self, CredentialsError> {
        Self::from_parts(app_id, installation_id, pem.expose_secret().as_bytes())
    }

    pub fn app_id(&self) -> u64 {
        self.app_id
    }

    pub fn installation_id(&self) -> u64 {
        self.installation_id
    }

    pub(crate) fn encoding_key(&self) -> &EncodingKey {
        &self.key
    }
}

fn parse_id(key: &'static str, raw: &[u8]) -> Result<u64, CredentialsError> {
    std::str::from_utf8(raw)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|id| *id > 0)
        .ok_or(CredentialsError::InvalidKey {
            key,
            reason: "not a positive decimal integer",
        })
}

/// The signing key from a PKCS#1 or PKCS#8 RSA PEM. jsonwebtoken reads both forms; the PEM label
/// only picks the reason when it cannot.
fn rsa_encoding_key(pem: &[u8]) -> Result<EncodingKey, &'static str> {
    const NOT_PEM: &str = "not a PEM private key";
    let label = pem::parse(pem).map_err(|_| NOT_PEM)?.tag().to_owned();
    EncodingKey::from_rsa_pem(pem).map_err(|_| match label.as_str() {
        "RSA PRIVATE KEY" => "not a usable RSA private key",
        "PRIVATE KEY" => "PKCS#8 key is not an RSA key",
        "ENCRYPTED PRIVATE KEY" => "encrypted keys are not supported",
        _ => "not an RSA private key (expected PKCS#1 or PKCS#8 PEM)",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_testkit::github::test_key;

    fn data(app: &str, inst: &str, pem: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (KEY_APP_ID.into(), app.into()),
            (KEY_INSTALLATION_ID.into(), inst.into()),
            (KEY_PRIVATE_KEY.into(), pem.into()),
        ])
    }

    #[test]
    fn loads_pkcs1_and_pkcs8() {
        let key = test_key(0);
        for pem in [key.pkcs1_pem(), key.pkcs8_pem()] {
            let c = AppCredentials::from_string_data(&data("12\n", " 34 ", &pem)).unwrap();
            assert_eq!((c.app_id(), c.installation_id()), (12, 34));
            let dbg = format!("{c:?}");
            assert!(
                dbg.contains("[redacted]") && !dbg.contains("BEGIN"),
                "{dbg}"
            );
        }
    }

    #[test]
    fn loads_from_secret_object_data() {
        let key = test_key(0);
        let mut d = BTreeMap::new();
        d.insert(KEY_APP_ID.to_string(), ByteString(b"1".to_vec()));
        d.insert(KEY_INSTALLATION_ID.to_string(), ByteString(b"2".to_vec()));
        d.insert(
            KEY_PRIVATE_KEY.to_string(),
            ByteString(key.pkcs1_pem().into_bytes()),
        );
        let secret = Secret {
            data: Some(d.clone()),
            ..Default::default()
        };
        assert_eq!(AppCredentials::from_secret(&secret).unwrap().app_id(), 1);
        assert_eq!(
            AppCredentials::from_secret_data(&d)
                .unwrap()
                .installation_id(),
            2
        );
    }

    #[test]
    fn errors_name_the_key_never_the_value() {
        let key = test_key(0);
        let pem = key.pkcs1_pem();
        let mut missing = data("1", "2", &pem);
        missing.remove(KEY_PRIVATE_KEY);
        assert_eq!(
            AppCredentials::from_string_data(&missing).unwrap_err(),
            CredentialsError::MissingKey {
                key: KEY_PRIVATE_KEY
            }
        );
        let mut empty = data("1", "2", &pem);
        empty.insert(KEY_INSTALLATION_ID.into(), "  ".into());
        assert_eq!(
            AppCredentials::from_string_data(&empty).unwrap_err(),
            CredentialsError::MissingKey {
                key: KEY_INSTALLATION_ID
            }
        );
        let err = AppCredentials::from_string_data(&data("secret-app-x", "2", &pem)).unwrap_err();
        assert!(matches!(
            err,
            CredentialsError::InvalidKey {
                key: KEY_APP_ID,
                ..
            }
        ));
        assert!(!err.to_string().contains("secret-app-x"));

        // Corrupt PEM bodies: garbage, truncated, wrong type, a public key.
        let b64_body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        let truncated = format!(
            "-----BEGIN RSA PRIVATE KEY-----\n{}\n-----END RSA PRIVATE KEY-----\n",
            &b64_body[..200]
        );
        let cases = [
            "hello".to_string(),
            truncated,
            "-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n".to_string(),
            "-----BEGIN PRIVATE KEY-----\nMAA=\n-----END PRIVATE KEY-----\n".to_string(),
        ];
        for bad in cases {
            let err = AppCredentials::from_string_data(&data("1", "2", &bad)).unwrap_err();
            assert!(
                matches!(
                    err,
                    CredentialsError::InvalidKey {
                        key: KEY_PRIVATE_KEY,
                        ..
                    }
                ),
                "{err:?}"
            );
            let msg = err.to_string();
            assert!(msg.contains("private-key"), "{msg}");
            assert!(
                !msg.contains("BEGIN") && !msg.contains(&b64_body[..40]),
                "{msg}"
            );
        }
    }
}
