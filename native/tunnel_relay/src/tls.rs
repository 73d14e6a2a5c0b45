//! TLS to an `https://` control plane (rustls), trusting what the agent's own HTTP client
//! trusts: the system's roots plus `MODELFORGE_AGENT_CA_CERT_PATH`'s certificates, or nothing
//! checked at all when the operator turned verification off (`tls_verify: false`). The server
//! is named by its DNS name (SNI and the certificate's check); an IP address is not supported
//! by this rustls, so the agent keeps its Python end for those.

use std::fs::File;
use std::io::BufReader;
use std::sync::Arc;
use std::time::SystemTime;

use rustls::client::{ServerCertVerified, ServerCertVerifier};
use rustls::{Certificate, ClientConfig, RootCertStore, ServerName};

pub struct Tls {
    pub config: Arc<ClientConfig>,
    pub server_name: ServerName,
}

/// Accepts any certificate: only for `tls_verify: false`, which the agent refuses to combine
/// with a CA path and warns about at its start.
struct Unverified;

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &Certificate,
        _intermediates: &[Certificate],
        _server_name: &ServerName,
        _scts: &mut dyn Iterator<Item = &[u8]>,
        _ocsp_response: &[u8],
        _now: SystemTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
}

pub fn configure(
    server_name: &str,
    verify: bool,
    ca_cert_path: Option<&str>,
) -> Result<Tls, String> {
    let name = ServerName::try_from(server_name)
        .map_err(|_| format!("{:?} is not a DNS name the relay can check", server_name))?;
    if let ServerName::IpAddress(_) = name {
        return Err("an IP address cannot be checked by the relay's TLS".into());
    }
    let builder = ClientConfig::builder().with_safe_defaults();
    let config = if verify {
        let mut roots = RootCertStore::empty();
        // A root the library cannot parse is skipped, as OpenSSL skips it.
        if let Ok(native) = rustls_native_certs::load_native_certs() {
            for root in native {
                let _ = roots.add(&Certificate(root.0));
            }
        }
        if let Some(path) = ca_cert_path {
            let file = File::open(path)
                .map_err(|error| format!("cannot read the CA file ({:?})", error.kind()))?;
            let found = rustls_pemfile::certs(&mut BufReader::new(file))
                .map_err(|_| "the CA file is not PEM".to_string())?;
            if found.is_empty() {
                return Err("the CA file holds no certificate".into());
            }
            for certificate in found {
                roots
                    .add(&Certificate(certificate))
                    .map_err(|_| "a certificate of the CA file cannot be used".to_string())?;
            }
        }
        builder.with_root_certificates(roots).with_no_client_auth()
    } else {
        builder
            .with_custom_certificate_verifier(Arc::new(Unverified))
            .with_no_client_auth()
    };
    Ok(Tls {
        config: Arc::new(config),
        server_name: name,
    })
}
