//! The HTTP listener's TLS: a certificate chain and private key from PEM files, rustls
//! with the ring provider (the one the PostgreSQL client already uses), HTTP/1.1. The
//! files are read at start and at each reload ([`Certificates`]), so a renewed certificate
//! is served from the reload on, without a restart.

use std::sync::{Arc, RwLock};

use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::HttpError;
use crate::config::TlsFiles;

/// The certificate chain and key the listener presents: each new handshake gets the pair
/// read last, which only ever replaces a pair that was read whole and whose key matches
/// its certificate.
#[derive(Debug)]
pub struct Certificates {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    current: RwLock<Arc<CertifiedKey>>,
}

impl Certificates {
    /// Reads the chain and key the files hold now, or says which file cannot serve and why.
    /// Nothing changes until [`Certificates::present`].
    pub fn read(&self) -> Result<Arc<CertifiedKey>, HttpError> {
        read_pair(&self.files, &self.provider)
    }

    /// Presents `pair` ([`Certificates::read`]) from the next handshake on.
    pub fn present(&self, pair: Arc<CertifiedKey>) {
        match self.current.write() {
            Ok(mut current) => *current = pair,
            // A poisoned lock still holds a whole pair (the swap is one assignment).
            Err(poisoned) => *poisoned.into_inner() = pair,
        }
    }
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(match self.current.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        })
    }
}

/// Largest certificate chain or key file read.
const MAX_PEM_BYTES: u64 = 1024 * 1024;

/// The chain and key `files` hold, checked to belong together.
fn read_pair(files: &TlsFiles, provider: &CryptoProvider) -> Result<Arc<CertifiedKey>, HttpError> {
    let fail =
        |what: &std::path::Path, e: String| HttpError::Tls(format!("{}: {e}", what.display()));
    // Whoever could change either file could serve their own pair to remote agents, and
    // read their bearer tokens; whoever could read the key could be this server.
    // Symbolic links are followed (certbot's `live/` names are links into `archive/`, and
    // a renewal moves them), and the file they lead to is judged.
    let read = |path: &std::path::Path, secret| {
        crate::files::trusted_target(path)
            .and_then(|target| crate::files::read_trusted(&target, MAX_PEM_BYTES, secret))
            .map_err(|e| HttpError::Tls(format!("{}: cannot be trusted: {e}", path.display())))
    };
    let cert_pem = read(&files.cert, false)?;
    let certs = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fail(&files.cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(fail(&files.cert, "no certificate in the file".into()));
    }
    let key_pem = zeroize::Zeroizing::new(read(&files.key, true)?);
    let key =
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| fail(&files.key, e.to_string()))?;
    let pair = CertifiedKey::from_der(certs, key, provider).map_err(|e| {
        fail(
            &files.key,
            format!("{e} (the key must be the certificate's, in a form the listener can use)"),
        )
    })?;
    Ok(Arc::new(pair))
}

/// The acceptor for `files` and the certificates it presents (read again at each reload),
/// or why the files cannot serve.
pub(super) fn acceptor(
    files: &TlsFiles,
) -> Result<(tokio_rustls::TlsAcceptor, Arc<Certificates>), HttpError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certificates = Arc::new(Certificates {
        current: RwLock::new(read_pair(files, &provider)?),
        files: files.clone(),
        provider: provider.clone(),
    });
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| HttpError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(certificates.clone());
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok((
        tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        certificates,
    ))
}
