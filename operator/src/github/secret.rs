//! Secret-bearing types whose `Debug` and `Display` never print the value. Read the value only
//! with `expose()`, at the one place it is put on the wire.

macro_rules! redacted_string {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq)]
        pub struct $name(String);

        impl $name {
            pub fn new(value: impl Into<String>) -> Self {
                $name(value.into())
            }

            /// The secret value. Never log it.
            pub fn expose(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!(stringify!($name), "([redacted])"))
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("[redacted]")
            }
        }
    };
}

redacted_string!(
    /// An installation access token (`ghs_...`).
    InstallationToken
);
redacted_string!(
    /// A signed App JWT.
    AppJwt
);
redacted_string!(
    /// A private key in PEM form.
    PrivateKeyPem
);
redacted_string!(
    /// A runner's `encoded_jit_config`: one-time runner credentials.
    JitConfig
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_display_never_show_the_value() {
        let values = [
            format!("{:?}", InstallationToken::new("ghs_abcdef")),
            format!("{}", InstallationToken::new("ghs_abcdef")),
            format!("{:?}", AppJwt::new("eyJhbGciOi.x.y")),
            format!("{}", AppJwt::new("eyJhbGciOi.x.y")),
            format!(
                "{:?}",
                PrivateKeyPem::new("-----BEGIN RSA PRIVATE KEY-----")
            ),
            format!("{:#?}", JitConfig::new("eyJ1cmwiOiJodHRw")),
            format!("{}", JitConfig::new("eyJ1cmwiOiJodHRw")),
        ];
        for v in values {
            assert!(v.contains("[redacted]"), "{v}");
            for secret in ["ghs_abcdef", "eyJhbGciOi", "BEGIN RSA", "eyJ1cmwiOiJodHRw"] {
                assert!(!v.contains(secret), "{v} leaks {secret}");
            }
        }
        assert_eq!(JitConfig::new("abc").expose(), "abc");
    }
}
