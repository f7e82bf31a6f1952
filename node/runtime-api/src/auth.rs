//! Registry credentials for rootfs pulls: the wire form the agent sends imp-runtime (copied from
//! the pull Secret), Docker's `.dockerconfigjson` lookup, and the resolved per-registry auth.
//!
//! Secrets are held in [`SecretString`] (imp_common::secret): its `Debug` prints `[REDACTED]`, and
//! no error here ever carries a credential: errors name the JSON field that was wrong, never its
//! value.

use base64::Engine;
use imp_common::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Registry credentials for one registry; `Debug` never shows the password.
#[derive(Clone, Debug)]
pub enum RegistryAuth {
    Anonymous,
    Basic {
        username: String,
        password: SecretString,
    },
}

/// Equal when the same credentials would be presented (compares the passwords, prints neither).
impl PartialEq for RegistryAuth {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (RegistryAuth::Anonymous, RegistryAuth::Anonymous) => true,
            (
                RegistryAuth::Basic { username, password },
                RegistryAuth::Basic {
                    username: u,
                    password: p,
                },
            ) => username == u && password.expose_secret() == p.expose_secret(),
            _ => false,
        }
    }
}

impl Eq for RegistryAuth {}

/// How imp-runtime's `PUT /v1/vms` body carries pull credentials (the agent copies them from the
/// pull Secret). Externally tagged:
/// `{"basic": {"username": "...", "password": "..."}}` or
/// `{"dockerconfigjson": "<the Secret's .dockerconfigjson text>"}`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum PullCredentials {
    Basic {
        username: String,
        #[serde(serialize_with = "imp_common::secret::serialize")]
        password: SecretString,
    },
    Dockerconfigjson(#[serde(serialize_with = "imp_common::secret::serialize")] SecretString),
}

/// Equal when they carry the same credentials (a VM spec compares equal to its repeat request).
impl PartialEq for PullCredentials {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (
                PullCredentials::Basic { username, password },
                PullCredentials::Basic {
                    username: u,
                    password: p,
                },
            ) => username == u && password.expose_secret() == p.expose_secret(),
            (PullCredentials::Dockerconfigjson(a), PullCredentials::Dockerconfigjson(b)) => {
                a.expose_secret() == b.expose_secret()
            }
            _ => false,
        }
    }
}

impl PullCredentials {
    /// The credentials to present to `registry` (`host[:port]`, as in the image reference).
    /// Basic credentials apply to whichever registry the image names, as the Secret's owner chose.
    pub fn for_registry(&self, registry: &str) -> Result<RegistryAuth, AuthError> {
        match self {
            PullCredentials::Basic { username, password } => Ok(RegistryAuth::Basic {
                username: username.clone(),
                password: password.clone(),
            }),
            PullCredentials::Dockerconfigjson(json) => {
                from_dockerconfigjson(json.expose_secret(), registry)
            }
        }
    }
}

/// Why pull credentials could not be read. Names the field, never the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// serde_json's own message can quote the offending text, so only the position is kept.
    #[error("dockerconfigjson is not valid JSON (line {line}, column {column})")]
    InvalidJson { line: usize, column: usize },
    #[error("dockerconfigjson field {field} must be {expected}")]
    WrongType {
        field: String,
        expected: &'static str,
    },
    #[error("dockerconfigjson field {field} is not valid base64")]
    InvalidBase64 { field: String },
    #[error("dockerconfigjson field {field} is not UTF-8 once decoded")]
    InvalidUtf8 { field: String },
    #[error("dockerconfigjson field {field} has no ':' between username and password")]
    MissingColon { field: String },
    #[error(
        "dockerconfigjson entry {field} has neither \"auth\" nor \"username\" and \"password\""
    )]
    MissingCredentials { field: String },
    #[error(
        "dockerconfigjson entry {field} carries only an identity token, which Imp cannot exchange; \
         use a username and password (or access token as password)"
    )]
    IdentityTokenUnsupported { field: String },
}

/// The credentials in a `.dockerconfigjson` for `registry`, matching keys the way Docker does:
/// exact `host[:port]`, URL-style keys (`https://host/v1/`) by their host part, and
/// `index.docker.io` / `registry-1.docker.io` as `docker.io`. No matching entry → `Anonymous`.
pub fn from_dockerconfigjson(json: &str, registry: &str) -> Result<RegistryAuth, AuthError> {
    let root: Value = serde_json::from_str(json).map_err(|e| AuthError::InvalidJson {
        line: e.line(),
        column: e.column(),
    })?;
    let root = root.as_object().ok_or_else(|| AuthError::WrongType {
        field: "(top level)".into(),
        expected: "an object",
    })?;
    let Some(auths) = root.get("auths") else {
        return Ok(RegistryAuth::Anonymous);
    };
    let auths = auths.as_object().ok_or_else(|| AuthError::WrongType {
        field: "auths".into(),
        expected: "an object",
    })?;

    let wanted = canonical_registry(registry);
    // An exact key wins over a normalised one, as in Docker's ResolveAuthConfig.
    let entry = auths.get_key_value(registry).or_else(|| {
        auths
            .iter()
            .find(|(key, _)| canonical_registry(&key_host(key)) == wanted)
    });
    match entry {
        None => Ok(RegistryAuth::Anonymous),
        Some((key, value)) => entry_auth(key, value),
    }
}

fn entry_auth(key: &str, value: &Value) -> Result<RegistryAuth, AuthError> {
    let field = |name: Option<&str>| match name {
        None => format!("auths[{key:?}]"),
        Some(name) => format!("auths[{key:?}].{name}"),
    };
    let entry = value.as_object().ok_or_else(|| AuthError::WrongType {
        field: field(None),
        expected: "an object",
    })?;
    let string_field = |name: &str| -> Result<Option<&str>, AuthError> {
        match entry.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.is_empty() => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(_) => Err(AuthError::WrongType {
                field: field(Some(name)),
                expected: "a string",
            }),
        }
    };

    if let Some(encoded) = string_field("auth")? {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .map_err(|_| AuthError::InvalidBase64 {
                field: field(Some("auth")),
            })?;
        let decoded = String::from_utf8(decoded).map_err(|_| AuthError::InvalidUtf8 {
            field: field(Some("auth")),
        })?;
        let (username, password) =
            decoded
                .split_once(':')
                .ok_or_else(|| AuthError::MissingColon {
                    field: field(Some("auth")),
                })?;
        return Ok(RegistryAuth::Basic {
            username: username.to_owned(),
            password: SecretString::from(password),
        });
    }
    match (string_field("username")?, string_field("password")?) {
        (Some(username), Some(password)) => Ok(RegistryAuth::Basic {
            username: username.to_owned(),
            password: SecretString::from(password),
        }),
        _ if string_field("identitytoken")?.is_some() => {
            Err(AuthError::IdentityTokenUnsupported { field: field(None) })
        }
        _ => Err(AuthError::MissingCredentials { field: field(None) }),
    }
}

/// The host part of a config key: Docker's `ConvertToHostname` (drop the scheme and any path).
fn key_host(key: &str) -> String {
    let rest = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    rest.split('/').next().unwrap_or(rest).to_owned()
}

/// Docker Hub's several names as one; every other registry is compared as written (lower-cased,
/// since host names are case-insensitive).
fn canonical_registry(host: &str) -> String {
    let host = host.to_ascii_lowercase();
    match host.as_str() {
        "index.docker.io" | "registry-1.docker.io" => "docker.io".to_owned(),
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWORD: &str = "s3cr3t-Pa55";

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    fn basic(user: &str, pass: &str) -> RegistryAuth {
        RegistryAuth::Basic {
            username: user.into(),
            password: SecretString::from(pass),
        }
    }

    #[test]
    fn auth_field_exact_host_port() {
        let json = format!(
            r#"{{"auths": {{"127.0.0.1:5000": {{"auth": "{}"}}, "other:5000": {{"auth": "{}"}}}}}}"#,
            b64(&format!("alice:{PASSWORD}")),
            b64("bob:nope"),
        );
        assert_eq!(
            from_dockerconfigjson(&json, "127.0.0.1:5000").unwrap(),
            basic("alice", PASSWORD)
        );
        assert_eq!(
            from_dockerconfigjson(&json, "other:5000").unwrap(),
            basic("bob", "nope")
        );
    }

    #[test]
    fn password_may_contain_colons() {
        let json = format!(
            r#"{{"auths": {{"r.io": {{"auth": "{}"}}}}}}"#,
            b64("u:a:b:c")
        );
        assert_eq!(
            from_dockerconfigjson(&json, "r.io").unwrap(),
            basic("u", "a:b:c")
        );
    }

    #[test]
    fn username_and_password_fields() {
        let json = format!(
            r#"{{"auths": {{"ghcr.io": {{"username": "alice", "password": "{PASSWORD}", "email": "a@b"}}}}}}"#
        );
        assert_eq!(
            from_dockerconfigjson(&json, "ghcr.io").unwrap(),
            basic("alice", PASSWORD)
        );
    }

    #[test]
    fn url_style_keys_and_docker_hub_aliases() {
        let json = format!(
            r#"{{"auths": {{"https://index.docker.io/v1/": {{"auth": "{}"}}, "http://quay.io/v2/": {{"auth": "{}"}}}}}}"#,
            b64("hub:p1"),
            b64("quay:p2"),
        );
        for name in ["docker.io", "index.docker.io", "registry-1.docker.io"] {
            assert_eq!(
                from_dockerconfigjson(&json, name).unwrap(),
                basic("hub", "p1"),
                "{name}"
            );
        }
        assert_eq!(
            from_dockerconfigjson(&json, "quay.io").unwrap(),
            basic("quay", "p2")
        );
        let plain = format!(
            r#"{{"auths": {{"docker.io": {{"auth": "{}"}}}}}}"#,
            b64("d:p")
        );
        assert_eq!(
            from_dockerconfigjson(&plain, "index.docker.io").unwrap(),
            basic("d", "p")
        );
    }

    #[test]
    fn exact_key_wins_over_normalised_one() {
        let json = format!(
            r#"{{"auths": {{"https://r.io/v1/": {{"auth": "{}"}}, "r.io": {{"auth": "{}"}}}}}}"#,
            b64("url:1"),
            b64("exact:2"),
        );
        assert_eq!(
            from_dockerconfigjson(&json, "r.io").unwrap(),
            basic("exact", "2")
        );
    }

    #[test]
    fn no_match_is_anonymous_and_port_matters() {
        let json = format!(
            r#"{{"auths": {{"r.io:5000": {{"auth": "{}"}}}}}}"#,
            b64("u:p")
        );
        assert_eq!(
            from_dockerconfigjson(&json, "r.io").unwrap(),
            RegistryAuth::Anonymous
        );
        assert_eq!(
            from_dockerconfigjson(&json, "r.io:5001").unwrap(),
            RegistryAuth::Anonymous
        );
        assert_eq!(
            from_dockerconfigjson("{}", "r.io").unwrap(),
            RegistryAuth::Anonymous
        );
    }

    /// Every malformed input, each with the password somewhere in it: the error names the field
    /// and never carries the value.
    #[test]
    fn malformed_inputs_name_the_field_not_the_value() {
        let key = "127.0.0.1:5000";
        let cases: Vec<(String, AuthError)> = vec![
            (
                format!(r#"{{"auths": {{"{key}": {{"auth": "{PASSWORD}!!"#),
                AuthError::InvalidJson { line: 0, column: 0 },
            ),
            (
                format!(r#"{{"auths": ["{PASSWORD}"]}}"#),
                AuthError::WrongType {
                    field: "auths".into(),
                    expected: "an object",
                },
            ),
            (
                format!(r#"{{"auths": {{"{key}": {{"auth": "{PASSWORD}%%"}}}}}}"#),
                AuthError::InvalidBase64 {
                    field: format!("auths[{key:?}].auth"),
                },
            ),
            (
                format!(
                    r#"{{"auths": {{"{key}": {{"auth": "{}"}}}}}}"#,
                    b64(PASSWORD)
                ),
                AuthError::MissingColon {
                    field: format!("auths[{key:?}].auth"),
                },
            ),
            (
                format!(r#"{{"auths": {{"{key}": {{"username": "u"}}}}}}"#),
                AuthError::MissingCredentials {
                    field: format!("auths[{key:?}]"),
                },
            ),
            (
                format!(
                    r#"{{"auths": {{"{key}": {{"username": "u", "password": ["{PASSWORD}"]}}}}}}"#
                ),
                AuthError::WrongType {
                    field: format!("auths[{key:?}].password"),
                    expected: "a string",
                },
            ),
            (
                format!(r#"{{"auths": {{"{key}": {{"identitytoken": "{PASSWORD}"}}}}}}"#),
                AuthError::IdentityTokenUnsupported {
                    field: format!("auths[{key:?}]"),
                },
            ),
        ];
        for (json, expected) in cases {
            let err = from_dockerconfigjson(&json, key).unwrap_err();
            match (&err, &expected) {
                (AuthError::InvalidJson { .. }, AuthError::InvalidJson { .. }) => {}
                _ => assert_eq!(err, expected, "{json}"),
            }
            for shown in [err.to_string(), format!("{err:?}")] {
                assert!(!shown.contains(PASSWORD), "{shown}");
                assert!(!shown.contains(&b64(PASSWORD)), "{shown}");
            }
        }
    }

    #[test]
    fn wire_form_round_trips_and_is_strict() {
        let creds: PullCredentials = serde_json::from_str(&format!(
            r#"{{"basic": {{"username": "alice", "password": "{PASSWORD}"}}}}"#
        ))
        .unwrap();
        assert_eq!(
            creds.for_registry("anything:1").unwrap(),
            RegistryAuth::Basic {
                username: "alice".into(),
                password: SecretString::from(PASSWORD)
            }
        );
        let config = format!(
            r#"{{"auths": {{"r.io": {{"auth": "{}"}}}}}}"#,
            b64(&format!("bob:{PASSWORD}"))
        );
        let dcj: PullCredentials =
            serde_json::from_value(serde_json::json!({ "dockerconfigjson": config })).unwrap();
        assert_eq!(dcj.for_registry("r.io").unwrap(), basic("bob", PASSWORD));
        assert_eq!(
            dcj.for_registry("elsewhere.io").unwrap(),
            RegistryAuth::Anonymous
        );
        // The wire form is the plain JSON the agent has always sent.
        let wire = serde_json::to_string(&creds).unwrap();
        assert_eq!(
            wire,
            format!(r#"{{"basic":{{"username":"alice","password":"{PASSWORD}"}}}}"#)
        );
        assert_eq!(
            serde_json::to_value(&dcj).unwrap(),
            serde_json::json!({ "dockerconfigjson": config })
        );
        let back: PullCredentials = serde_json::from_str(&wire).unwrap();
        assert_eq!(back, creds);

        for refused in [
            r#"{"basic": {"username": "a", "password": "b", "extra": 1}}"#,
            r#"{"bearer": "t"}"#,
            r#"{"basic": {"username": "a"}}"#,
        ] {
            assert!(
                serde_json::from_str::<PullCredentials>(refused).is_err(),
                "{refused}"
            );
        }
    }

    #[test]
    fn debug_never_shows_secrets() {
        let config = format!(
            r#"{{"auths": {{"r.io": {{"auth": "{}"}}}}}}"#,
            b64(&format!("bob:{PASSWORD}"))
        );
        let shown = [
            format!(
                "{:?}",
                PullCredentials::Basic {
                    username: "alice".into(),
                    password: SecretString::from(PASSWORD)
                }
            ),
            format!(
                "{:?}",
                PullCredentials::Dockerconfigjson(SecretString::from(config.as_str()))
            ),
            format!("{:?}", basic("alice", PASSWORD)),
            format!("{:?}", SecretString::from(PASSWORD)),
        ];
        for s in shown {
            assert!(!s.contains(PASSWORD), "{s}");
            assert!(!s.contains(&b64(&format!("bob:{PASSWORD}"))), "{s}");
        }
        assert!(format!("{:?}", basic("alice", PASSWORD)).contains("alice"));
    }
}
