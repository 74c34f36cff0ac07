//! The HTTP listener's TLS: a certificate chain and private key from PEM files, rustls
//! with the ring provider (the one the PostgreSQL client already uses), HTTP/1.1.

use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::HttpError;
use crate::config::TlsFiles;

/// The acceptor for `files`, or why the files cannot serve.
pub(super) fn acceptor(files: &TlsFiles) -> Result<tokio_rustls::TlsAcceptor, HttpError> {
    let fail =
        |what: &std::path::Path, e: String| HttpError::Tls(format!("{}: {e}", what.display()));
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| fail(&files.cert, e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fail(&files.cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(fail(&files.cert, "no certificate in the file".into()));
    }
    let key =
        PrivateKeyDer::from_pem_file(&files.key).map_err(|e| fail(&files.key, e.to_string()))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| HttpError::Tls(e.to_string()))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| fail(&files.key, e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}
