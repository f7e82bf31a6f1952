//! The simulator's App JWT check, following GitHub's rules: RS256 signature by the App's key,
//! `iss` = App id (number or string), `iat` not in the future, `exp` in the future and at most
//! 10 minutes ahead.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde_json::Value;

use super::keys::{AppKey, verify_rs256};

/// Clock drift the simulator tolerates on `iat` and `exp` (GitHub tolerates a little too).
pub const CLOCK_SKEW_SECS: i64 = 30;
/// GitHub's maximum JWT lifetime ahead of now.
pub const MAX_EXP_AHEAD_SECS: i64 = 600;

/// Why a JWT was refused (all are 401 at GitHub).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwtRejection {
    Malformed,
    UnsupportedAlgorithm,
    UnknownIssuer,
    BadSignature,
    IssuedInFuture,
    Expired,
    ExpiresTooFarAhead,
}

impl JwtRejection {
    /// The message GitHub answers with.
    pub fn message(&self) -> &'static str {
        match self {
            JwtRejection::Malformed | JwtRejection::UnsupportedAlgorithm => {
                "A JSON web token could not be decoded"
            }
            JwtRejection::UnknownIssuer => "Integration not found",
            JwtRejection::BadSignature => "A JSON web token could not be decoded",
            JwtRejection::IssuedInFuture => {
                "'Issued at' claim ('iat') must be an Integer representing a time in the past"
            }
            JwtRejection::Expired => {
                "'Expiration time' claim ('exp') must be a numeric value representing the future time at which the assertion expires"
            }
            JwtRejection::ExpiresTooFarAhead => {
                "'Expiration time' claim ('exp') is too far in the future"
            }
        }
    }
}

/// Verifies `token`; `public_key_of(app_id)` returns the App's RFC 8017 public key DER.
/// Returns the App id.
pub fn verify_app_jwt(
    token: &str,
    public_key_of: impl Fn(u64) -> Option<Vec<u8>>,
    now: i64,
) -> Result<u64, JwtRejection> {
    let mut parts = token.split('.');
    let (Some(h), Some(p), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(JwtRejection::Malformed);
    };
    let header: Value = decode_json(h)?;
    if header.get("alg").and_then(Value::as_str) != Some("RS256") {
        return Err(JwtRejection::UnsupportedAlgorithm);
    }
    let claims: Value = decode_json(p)?;
    let sig = URL_SAFE_NO_PAD
        .decode(s)
        .map_err(|_| JwtRejection::Malformed)?;
    let app_id = match claims.get("iss") {
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(s)) => s.parse().ok(),
        _ => None,
    }
    .ok_or(JwtRejection::UnknownIssuer)?;
    let public = public_key_of(app_id).ok_or(JwtRejection::UnknownIssuer)?;
    let signed = &token[..h.len() + 1 + p.len()];
    if !verify_rs256(&public, signed.as_bytes(), &sig) {
        return Err(JwtRejection::BadSignature);
    }
    let iat = claims
        .get("iat")
        .and_then(Value::as_i64)
        .ok_or(JwtRejection::IssuedInFuture)?;
    let exp = claims
        .get("exp")
        .and_then(Value::as_i64)
        .ok_or(JwtRejection::Expired)?;
    if iat > now + CLOCK_SKEW_SECS {
        return Err(JwtRejection::IssuedInFuture);
    }
    if exp <= now - CLOCK_SKEW_SECS || exp <= iat {
        return Err(JwtRejection::Expired);
    }
    if exp > now + MAX_EXP_AHEAD_SECS + CLOCK_SKEW_SECS {
        return Err(JwtRejection::ExpiresTooFarAhead);
    }
    Ok(app_id)
}

fn decode_json(part: &str) -> Result<Value, JwtRejection> {
    let bytes = URL_SAFE_NO_PAD
        .decode(part)
        .map_err(|_| JwtRejection::Malformed)?;
    serde_json::from_slice(&bytes).map_err(|_| JwtRejection::Malformed)
}

/// Signs arbitrary claims as an RS256 JWT (tests use it to craft good and bad App JWTs).
pub fn sign_jwt(key: &AppKey, claims: &Value) -> String {
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"RS256","typ":"JWT"}"#);
    let payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(claims).expect("claims serialize"));
    let signing_input = format!("{header}.{payload}");
    let sig = URL_SAFE_NO_PAD.encode(key.sign_rs256(signing_input.as_bytes()));
    format!("{signing_input}.{sig}")
}

#[cfg(test)]
mod tests {
    use super::super::keys::test_key;
    use super::*;
    use serde_json::json;

    const NOW: i64 = 1_800_000_000;

    fn check(claims: Value) -> Result<u64, JwtRejection> {
        let key = test_key(0);
        let token = sign_jwt(&key, &claims);
        verify_app_jwt(
            &token,
            |id| (id == 7).then(|| key.public_key_der().to_vec()),
            NOW,
        )
    }

    #[test]
    fn accepts_github_shaped_claims_with_numeric_or_string_iss() {
        assert_eq!(
            check(json!({"iat": NOW - 60, "exp": NOW + 540, "iss": 7})),
            Ok(7)
        );
        assert_eq!(
            check(json!({"iat": NOW - 60, "exp": NOW + 600, "iss": "7"})),
            Ok(7)
        );
    }

    #[test]
    fn rejects_bad_claims() {
        assert_eq!(
            check(json!({"iat": NOW - 60, "exp": NOW + 1200, "iss": 7})),
            Err(JwtRejection::ExpiresTooFarAhead)
        );
        assert_eq!(
            check(json!({"iat": NOW + 300, "exp": NOW + 500, "iss": 7})),
            Err(JwtRejection::IssuedInFuture)
        );
        assert_eq!(
            check(json!({"iat": NOW - 700, "exp": NOW - 100, "iss": 7})),
            Err(JwtRejection::Expired)
        );
        assert_eq!(
            check(json!({"iat": NOW - 60, "exp": NOW + 500, "iss": 8})),
            Err(JwtRejection::UnknownIssuer)
        );
        assert_eq!(
            check(json!({"iat": NOW - 60, "exp": NOW + 500})),
            Err(JwtRejection::UnknownIssuer)
        );
    }

    #[test]
    fn rejects_wrong_key_and_tampering() {
        let other = test_key(1);
        let token = sign_jwt(
            &other,
            &json!({"iat": NOW - 60, "exp": NOW + 500, "iss": 7}),
        );
        let key = test_key(0);
        let lookup = |_| Some(key.public_key_der().to_vec());
        assert_eq!(
            verify_app_jwt(&token, lookup, NOW),
            Err(JwtRejection::BadSignature)
        );
        let good = sign_jwt(&key, &json!({"iat": NOW - 60, "exp": NOW + 500, "iss": 7}));
        let mut parts: Vec<&str> = good.split('.').collect();
        let forged = URL_SAFE_NO_PAD.encode(br#"{"iat":1,"exp":99999999999,"iss":7}"#);
        parts[1] = &forged;
        assert_eq!(
            verify_app_jwt(&parts.join("."), lookup, NOW),
            Err(JwtRejection::BadSignature)
        );
        assert_eq!(
            verify_app_jwt("abc", lookup, NOW),
            Err(JwtRejection::Malformed)
        );
    }
}
