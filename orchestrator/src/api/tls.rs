// SPDX-License-Identifier: Apache-2.0
//! TLS material (a CA and a server certificate, generated at first start),
//! bearer tokens, and the admin kubeconfig, all kept in the data directory.
//!
//! ```text
//!   <data>/pki/ca.crt  ca.key  server.crt  server.key   (keys 0600)
//!   <data>/tokens.json                                   (0600)
//!   <data>/admin.kubeconfig                              (0600)
//! ```

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

use super::ApiError;

/// Failures preparing TLS, tokens or the kubeconfig.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Certificate generation failed.
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// A stored certificate or key is unusable.
    #[error("TLS configuration: {0}")]
    Rustls(String),
    /// A stored file does not parse.
    #[error("{path}: {message}")]
    Parse {
        /// File.
        path: PathBuf,
        /// Why.
        message: String,
    },
}

impl From<TlsSetupError> for ApiError {
    fn from(e: TlsSetupError) -> Self {
        ApiError::internal(e.to_string())
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TlsSetupError + '_ {
    move |source| TlsSetupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes a file readable by the owner only.
pub fn write_private(path: &Path, data: &[u8]) -> Result<(), TlsSetupError> {
    let tmp = path.with_extension("tmp");
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    f.write_all(data).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600)).map_err(io_err(&tmp))?;
    fs::rename(&tmp, path).map_err(io_err(path))
}

/// The CA and server certificate.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    /// CA certificate (PEM), for clients.
    pub ca_pem: String,
    /// Server certificate chain (PEM).
    pub cert_pem: String,
    /// Server key (PEM).
    pub key_pem: String,
}

impl TlsMaterial {
    /// Loads `<dir>/pki`, or generates a CA and a server certificate valid
    /// for `sans` (plus `localhost`, `127.0.0.1`, `::1`) at first start.
    pub fn load_or_create(dir: &Path, sans: &[String]) -> Result<Self, TlsSetupError> {
        let pki = dir.join("pki");
        let (ca, cert, key) = (
            pki.join("ca.crt"),
            pki.join("server.crt"),
            pki.join("server.key"),
        );
        if ca.exists() && cert.exists() && key.exists() {
            let read = |p: &Path| fs::read_to_string(p).map_err(io_err(p));
            return Ok(Self {
                ca_pem: read(&ca)?,
                cert_pem: read(&cert)?,
                key_pem: read(&key)?,
            });
        }
        fs::create_dir_all(&pki).map_err(io_err(&pki))?;
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "sheaf-ca");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);

        let mut names: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
        for s in sans {
            if !names.contains(s) {
                names.push(s.clone());
            }
        }
        let server_key = KeyPair::generate()?;
        let mut params = CertificateParams::new(names)?;
        params
            .distinguished_name
            .push(DnType::CommonName, "sheaf-apiserver");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let server_cert = params.signed_by(&server_key, &issuer)?;

        let me = Self {
            ca_pem: ca_cert.pem(),
            cert_pem: server_cert.pem(),
            key_pem: server_key.serialize_pem(),
        };
        write_private(&pki.join("ca.key"), issuer.key().serialize_pem().as_bytes())?;
        write_private(&key, me.key_pem.as_bytes())?;
        fs::write(&cert, &me.cert_pem).map_err(io_err(&cert))?;
        fs::write(&ca, &me.ca_pem).map_err(io_err(&ca))?;
        tracing::info!(dir = %pki.display(), "generated CA and server certificate");
        Ok(me)
    }

    /// A rustls server configuration offering HTTP/2 and HTTP/1.1.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsSetupError> {
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|e| TlsSetupError::Rustls(format!("server certificate: {e}")))?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .map_err(|e| TlsSetupError::Rustls(format!("server key: {e}")))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsSetupError::Rustls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsSetupError::Rustls(e.to_string()))?;
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }
}

/// Bearer tokens: an admin token and a read-only token.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Tokens {
    /// Full access.
    pub admin: String,
    /// GET/list/watch only; writes get 403.
    pub readonly: String,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tokens { .. }")
    }
}

fn random_token() -> String {
    let a = uuid::Uuid::new_v4().simple().to_string();
    let b = uuid::Uuid::new_v4().simple().to_string();
    format!("{a}{b}")
}

impl Tokens {
    /// Loads `<dir>/tokens.json` or creates it with fresh random tokens.
    pub fn load_or_create(dir: &Path) -> Result<Self, TlsSetupError> {
        let path = dir.join("tokens.json");
        if path.exists() {
            let text = fs::read_to_string(&path).map_err(io_err(&path))?;
            return serde_json::from_str(&text).map_err(|e| TlsSetupError::Parse {
                path,
                message: e.to_string(),
            });
        }
        let t = Self {
            admin: random_token(),
            readonly: random_token(),
        };
        let text = serde_json::to_vec_pretty(&t).map_err(|e| TlsSetupError::Parse {
            path: path.clone(),
            message: e.to_string(),
        })?;
        write_private(&path, &text)?;
        Ok(t)
    }
}

/// Writes `<dir>/admin.kubeconfig` with contexts `sheaf` (admin, current) and
/// `sheaf-readonly`, pointing at `server` (e.g. `https://127.0.0.1:6443`).
pub fn write_kubeconfig(
    dir: &Path,
    server: &str,
    ca_pem: &str,
    tokens: &Tokens,
) -> Result<PathBuf, TlsSetupError> {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes());
    let cfg = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "sheaf", "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [
            {"name": "sheaf-admin", "user": {"token": tokens.admin}},
            {"name": "sheaf-readonly", "user": {"token": tokens.readonly}},
        ],
        "contexts": [
            {"name": "sheaf", "context": {"cluster": "sheaf", "user": "sheaf-admin", "namespace": "default"}},
            {"name": "sheaf-readonly", "context": {"cluster": "sheaf", "user": "sheaf-readonly", "namespace": "default"}},
        ],
        "current-context": "sheaf",
        "preferences": {},
    });
    let text = serde_yaml::to_string(&cfg).map_err(|e| TlsSetupError::Parse {
        path: dir.into(),
        message: e.to_string(),
    })?;
    let path = dir.join("admin.kubeconfig");
    write_private(&path, text.as_bytes())?;
    Ok(path)
}
