//! RSA keys for simulated GitHub Apps: generation (aws-lc-rs), PEM encoding in PKCS#8 and PKCS#1,
//! RS256 signing (to craft JWTs in tests) and verification (the simulator's JWT check).

use std::sync::{Arc, OnceLock};

use aws_lc_rs::encoding::AsDer;
use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::rsa::{KeyPair, KeySize};
use aws_lc_rs::signature::{self, KeyPair as _, UnparsedPublicKey};

/// One App's RSA key pair.
pub struct AppKey {
    pair: KeyPair,
    pkcs8_der: Vec<u8>,
    /// RFC 8017 `RSAPublicKey` DER.
    public_der: Vec<u8>,
}

impl std::fmt::Debug for AppKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AppKey([redacted])")
    }
}

impl AppKey {
    /// Generates a fresh 2048-bit key (slow-ish: prefer [`test_key`] in tests).
    pub fn generate() -> Self {
        let pair = KeyPair::generate(KeySize::Rsa2048).expect("RSA key generation");
        let pkcs8_der = pair.as_der().expect("PKCS#8 encoding").as_ref().to_vec();
        let public_der = pair.public_key().as_ref().to_vec();
        AppKey {
            pair,
            pkcs8_der,
            public_der,
        }
    }

    /// The private key as a PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`).
    pub fn pkcs8_pem(&self) -> String {
        pem_encode("PRIVATE KEY", &self.pkcs8_der)
    }

    /// The private key as a PKCS#1 PEM (`-----BEGIN RSA PRIVATE KEY-----`), the format GitHub
    /// hands out when an App key is downloaded.
    pub fn pkcs1_pem(&self) -> String {
        let inner = pkcs8_rsa_inner(&self.pkcs8_der).expect("own PKCS#8 wraps an RSA key");
        pem_encode("RSA PRIVATE KEY", &inner)
    }

    /// RFC 8017 `RSAPublicKey` DER.
    pub fn public_key_der(&self) -> &[u8] {
        &self.public_der
    }

    /// RSASSA-PKCS1-v1_5 SHA-256 signature of `msg`.
    pub fn sign_rs256(&self, msg: &[u8]) -> Vec<u8> {
        let mut sig = vec![0u8; self.pair.public_modulus_len()];
        self.pair
            .sign(
                &signature::RSA_PKCS1_SHA256,
                &SystemRandom::new(),
                msg,
                &mut sig,
            )
            .expect("RSA signing");
        sig
    }
}

/// Verifies an RS256 signature against an RFC 8017 public key.
pub fn verify_rs256(public_der: &[u8], msg: &[u8], sig: &[u8]) -> bool {
    UnparsedPublicKey::new(&signature::RSA_PKCS1_2048_8192_SHA256, public_der)
        .verify(msg, sig)
        .is_ok()
}

/// Process-wide cached test keys (index 0, 1, 2, ...), generated once each so that many parallel
/// tests do not each pay for RSA key generation.
pub fn test_key(index: usize) -> Arc<AppKey> {
    const N: usize = 4;
    static KEYS: [OnceLock<Arc<AppKey>>; N] = [
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
    ];
    assert!(index < N, "only {N} cached test keys");
    KEYS[index]
        .get_or_init(|| Arc::new(AppKey::generate()))
        .clone()
}

/// PEM-encodes DER with 64-column base64 lines and `\n` line ends.
pub fn pem_encode(label: &str, der: &[u8]) -> String {
    let config = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    pem::encode_config(&pem::Pem::new(label, der), config)
}

/// The PKCS#1 `RSAPrivateKey` inside a PKCS#8 `PrivateKeyInfo` for rsaEncryption:
/// `SEQUENCE { version, SEQUENCE { OID rsaEncryption, .. }, OCTET STRING { RSAPrivateKey } }`.
fn pkcs8_rsa_inner(pkcs8: &[u8]) -> Option<Vec<u8>> {
    use simple_asn1::ASN1Block::{Integer, ObjectIdentifier, OctetString, Sequence};
    let blocks = simple_asn1::from_der(pkcs8).ok()?;
    let [Sequence(_, info)] = blocks.as_slice() else {
        return None;
    };
    let [Integer(..), Sequence(_, alg), OctetString(_, key), ..] = info.as_slice() else {
        return None;
    };
    let [ObjectIdentifier(_, oid), ..] = alg.as_slice() else {
        return None;
    };
    (*oid == simple_asn1::oid!(1, 2, 840, 113549, 1, 1, 1)).then(|| key.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    #[test]
    fn sign_verify_and_pem_forms() {
        let key = test_key(0);
        let sig = key.sign_rs256(b"hello");
        assert!(verify_rs256(key.public_key_der(), b"hello", &sig));
        assert!(!verify_rs256(key.public_key_der(), b"hellp", &sig));
        let other = test_key(1);
        assert!(!verify_rs256(other.public_key_der(), b"hello", &sig));
        assert!(key.pkcs8_pem().starts_with("-----BEGIN PRIVATE KEY-----\n"));
        let pkcs1 = key.pkcs1_pem();
        assert!(pkcs1.starts_with("-----BEGIN RSA PRIVATE KEY-----\n"));
        // The PKCS#1 body parses as an RSA key with the same public half.
        let b64: String = pkcs1.lines().filter(|l| !l.starts_with("-----")).collect();
        let der = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        let parsed = KeyPair::from_der(&der).unwrap();
        assert_eq!(parsed.public_key().as_ref(), key.public_key_der());
    }
}
