//! Key material for a throwaway control plane: a CA, a serving certificate for 127.0.0.1, and the
//! service-account signing key. Generated fresh for every control plane, never written outside its dir.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// PEM-encoded material.
pub struct ControlPlaneCerts {
    pub ca_cert_pem: String,
    pub serving_cert_pem: String,
    pub serving_key_pem: String,
    /// ECDSA P-256 private key (PKCS#8) signing service-account tokens.
    pub service_account_key_pem: String,
    /// Its public key, for verifying them.
    pub service_account_pub_pem: String,
}

impl ControlPlaneCerts {
    pub fn generate() -> Result<Self, rcgen::Error> {
        Self::generate_with_sans(&[])
    }

    /// Like [`Self::generate`], with more names (IP addresses or DNS names) on the serving certificate:
    /// a real node's pods reach the API server at the `kubernetes` Service's address.
    pub fn generate_with_sans(extra_sans: &[String]) -> Result<Self, rcgen::Error> {
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "imp-testenv-ca");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;

        let serving_key = KeyPair::generate()?;
        let mut sans = vec!["127.0.0.1".to_owned(), "localhost".to_owned()];
        sans.extend(extra_sans.iter().cloned());
        let mut serving = CertificateParams::new(sans)?;
        serving
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        serving.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let serving_cert = serving.signed_by(&serving_key, &ca)?;

        let sa_key = KeyPair::generate()?;
        Ok(Self {
            ca_cert_pem: ca.pem(),
            serving_cert_pem: serving_cert.pem(),
            serving_key_pem: serving_key.serialize_pem(),
            service_account_key_pem: sa_key.serialize_pem(),
            service_account_pub_pem: sa_key.public_key_pem(),
        })
    }
}
