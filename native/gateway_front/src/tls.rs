//! TLS on the control plane's port (`MODELFORGE_TLS_CERT` and `MODELFORGE_TLS_KEY`): the
//! front terminates it, for the gateway, the agents' tunnels (`wss://`) and the requests it
//! passes to Granian, which listens on loopback in plain HTTP behind it. The certificate and
//! the key are read from their files, named in the configuration line; the key's bytes are
//! never logged. A file that cannot be used is a start-up error naming the file and the fix.

use std::sync::Arc;
use std::time::Duration;

use rustls::crypto;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;

/// The longest a client may take over its TLS handshake before it is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

const FIX: &str = "set MODELFORGE_TLS_CERT to a PEM file holding the server's certificate \
                   (its chain after it) and MODELFORGE_TLS_KEY to the PEM file of its private \
                   key (unencrypted: PKCS#8, PKCS#1 or SEC1)";

fn read_error(what: &str, path: &str, error: pem::Error) -> String {
    match error {
        pem::Error::Io(error) => format!("cannot read {} {}: {}; {}", what, path, error, FIX),
        _ => format!("{} {} is not PEM; {}", what, path, FIX),
    }
}

/// The acceptor for the certificate chain in `cert` and the private key in `key`.
pub fn acceptor(cert: &str, key: &str) -> Result<TlsAcceptor, String> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certificates| certificates.collect::<Result<Vec<_>, _>>())
        .map_err(|error| read_error("MODELFORGE_TLS_CERT", cert, error))?;
    if chain.is_empty() {
        return Err(format!(
            "MODELFORGE_TLS_CERT {} holds no certificate; {}",
            cert, FIX
        ));
    }
    let private = PrivateKeyDer::from_pem_file(key).map_err(|error| match error {
        pem::Error::NoItemsFound => format!(
            "MODELFORGE_TLS_KEY {} holds no private key (an encrypted key is not read); {}",
            key, FIX
        ),
        error => read_error("MODELFORGE_TLS_KEY", key, error),
    })?;
    // aws-lc-rs, as the relay names it: one provider whatever features other crates turn on.
    let provider = Arc::new(crypto::aws_lc_rs::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| format!("no TLS version to offer ({})", error))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|error| {
            format!(
                "MODELFORGE_TLS_KEY {} cannot serve the certificate in MODELFORGE_TLS_CERT {} \
                 ({}): the key must be the certificate's own; {}",
                key, cert, error, FIX
            )
        })?;
    // The front speaks HTTP/1.1 only (the agents' tunnels are its upgrades).
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> String {
        let path = std::env::temp_dir().join(format!(
            "modelforge-front-tls-{}-{}",
            std::process::id(),
            name
        ));
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    }

    fn refusal(cert: &str, key: &str) -> String {
        match acceptor(cert, key) {
            Ok(_) => panic!("accepted"),
            Err(message) => message,
        }
    }

    #[test]
    fn a_missing_certificate_is_named_with_the_fix() {
        let message = refusal("/nonexistent/cert.pem", "/nonexistent/key.pem");
        assert!(message.starts_with("cannot read MODELFORGE_TLS_CERT /nonexistent/cert.pem"));
        assert!(message.contains("set MODELFORGE_TLS_CERT to a PEM file"));
    }

    #[test]
    fn a_certificate_file_without_a_certificate_is_refused() {
        let cert = file("empty-cert.pem", "not a certificate\n");
        let message = refusal(&cert, "/nonexistent/key.pem");
        assert!(message.contains(&format!(
            "MODELFORGE_TLS_CERT {} holds no certificate",
            cert
        )));
    }

    #[test]
    fn a_key_file_without_a_key_is_refused_naming_it() {
        // A syntactically PEM certificate is enough to reach the key (not parsed as X.509 yet).
        let cert = file(
            "cert.pem",
            "-----BEGIN CERTIFICATE-----\nMAA=\n-----END CERTIFICATE-----\n",
        );
        let key = file(
            "no-key.pem",
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMAA=\n-----END ENCRYPTED PRIVATE KEY-----\n",
        );
        let message = refusal(&cert, &key);
        assert!(message.contains(&format!("MODELFORGE_TLS_KEY {} holds no private key", key)));
        assert!(!message.contains("MAA="));
    }
}
