//! The one secret string type: [`SecretString`] from the `secrecy` crate (installation tokens, App
//! JWTs, private keys, JIT runner configs, registry passwords, guest Exec env values). Its `Debug`
//! prints `[REDACTED]`, it has no `Display`, it is wiped from memory on drop, and reading it takes
//! an explicit `expose_secret()`, so every call site that reads one is easy to find and audit.
//!
//! It deliberately has no `Serialize`: a struct holding one cannot be dumped to JSON by accident.
//! The few fields that must cross a wire in the clear (the guest protocol's Exec env, the runtime
//! API's registry credentials) opt in with `#[serde(serialize_with = ...)]` and the helpers below.

use std::collections::BTreeMap;

pub use secrecy::{ExposeSecret, SecretString};
use serde::{Serialize, Serializer, ser::SerializeMap};

/// `#[serde(serialize_with = "imp_common::secret::serialize")]`: the secret as a plain JSON
/// string, for a field that has to reach the other side of a process boundary.
pub fn serialize<S: Serializer>(secret: &SecretString, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(secret.expose_secret())
}

/// `#[serde(serialize_with = "imp_common::secret::serialize_values")]`: a map whose values are
/// secrets (an environment), as a plain JSON object of strings.
pub fn serialize_values<K: Serialize, S: Serializer>(
    map: &BTreeMap<K, SecretString>,
    s: S,
) -> Result<S::Ok, S::Error> {
    let mut out = s.serialize_map(Some(map.len()))?;
    for (k, v) in map {
        out.serialize_entry(k, v.expose_secret())?;
    }
    out.end()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize)]
    struct Wire {
        name: String,
        #[serde(serialize_with = "serialize")]
        token: SecretString,
        #[serde(default, serialize_with = "serialize_values")]
        env: BTreeMap<String, SecretString>,
    }

    fn wire() -> Wire {
        Wire {
            name: "n".into(),
            token: SecretString::from("ghs_s3cr3t"),
            env: BTreeMap::from([("JIT".to_owned(), SecretString::from("eyJqaXQi"))]),
        }
    }

    #[test]
    fn debug_of_a_struct_holding_secrets_does_not_leak() {
        let w = wire();
        for text in [format!("{w:?}"), format!("{w:#?}")] {
            assert!(!text.contains("ghs_s3cr3t"), "{text}");
            assert!(!text.contains("eyJqaXQi"), "{text}");
            assert!(text.contains("[REDACTED]"), "{text}");
            assert!(
                text.contains("\"n\""),
                "non-secret fields still print: {text}"
            );
        }
    }

    #[test]
    fn the_wire_form_is_plain_strings_and_round_trips() {
        let json = serde_json::to_string(&wire()).unwrap();
        assert_eq!(
            json,
            r#"{"name":"n","token":"ghs_s3cr3t","env":{"JIT":"eyJqaXQi"}}"#
        );
        let back: Wire = serde_json::from_str(&json).unwrap();
        assert_eq!(back.token.expose_secret(), "ghs_s3cr3t");
        assert_eq!(back.env["JIT"].expose_secret(), "eyJqaXQi");
        let defaulted: Wire = serde_json::from_str(r#"{"name":"m","token":"t"}"#).unwrap();
        assert!(defaulted.env.is_empty());
    }

    #[test]
    fn a_wrong_type_is_rejected() {
        let err = serde_json::from_str::<Wire>(r#"{"name":"n","token":7}"#).unwrap_err();
        assert!(err.to_string().contains("expected a string"), "{err}");
    }
}
