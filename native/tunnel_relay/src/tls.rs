//! TLS to an `https://` control plane (rustls), trusting what the agent's own HTTP client
//! trusts: the system's roots plus `MODELFORGE_AGENT_CA_CERT_PATH`'s certificates, or nothing
//! checked at all when the operator turned verification off (`tls_verify: false`). The server
//! is named by its DNS name or its IP address (SNI for a DNS name; the certificate's check
//! against its DNS or IP-address names either way).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{self, CryptoProvider};
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

pub struct Tls {
    pub config: Arc<ClientConfig>,
    pub server_name: ServerName<'static>,
}

/// Accepts any certificate: only for `tls_verify: false`, which the agent refuses to combine
/// with a CA path and warns about at its start. The handshake's signatures are still checked
/// (against the certificate it was given), so only the certificate goes unverified.
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

pub fn configure(
    server_name: &str,
    verify: bool,
    ca_cert_path: Option<&str>,
) -> Result<Tls, String> {
    let name = ServerName::try_from(server_name.to_string()).map_err(|_| {
        format!(
            "{:?} is neither a DNS name nor an IP address the relay can check",
            server_name
        )
    })?;
    // aws-lc-rs (rustls' default, with post-quantum key exchange), named here rather than left
    // to the process default: one provider, whatever features other crates turn on.
    let provider = Arc::new(crypto::aws_lc_rs::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|error| format!("no TLS version to offer ({})", error))?;
    let config = if verify {
        let mut roots = RootCertStore::empty();
        // A root the library cannot parse (or a store that cannot be read) is skipped, as
        // OpenSSL skips it.
        roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        if let Some(path) = ca_cert_path {
            let found = CertificateDer::pem_file_iter(path)
                .and_then(|certificates| certificates.collect::<Result<Vec<_>, _>>())
                .map_err(|error| match error {
                    pem::Error::Io(error) => {
                        format!("cannot read the CA file ({:?})", error.kind())
                    }
                    _ => "the CA file is not PEM".to_string(),
                })?;
            if found.is_empty() {
                return Err("the CA file holds no certificate".into());
            }
            for certificate in found {
                roots
                    .add(certificate)
                    .map_err(|_| "a certificate of the CA file cannot be used".to_string())?;
            }
        }
        builder.with_root_certificates(roots).with_no_client_auth()
    } else {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
            .with_no_client_auth()
    };
    Ok(Tls {
        config: Arc::new(config),
        server_name: name,
    })
}
