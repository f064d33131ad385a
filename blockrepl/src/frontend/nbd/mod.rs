// SPDX-License-Identifier: Apache-2.0
//! NBD server frontend: serves volumes as NBD exports to `qemu-img`,
//! `qemu-io`, `nbdinfo`, `nbd-client`-style userspace clients and fio's
//! `nbd` engine.
//!
//! - Fixed-newstyle negotiation with `NBD_OPT_GO`, `INFO`, `LIST`, `ABORT`,
//!   `EXPORT_NAME`, `STRUCTURED_REPLY`, `LIST/SET_META_CONTEXT`
//!   (`base:allocation`) and `STARTTLS`.
//! - Commands `READ`, `WRITE` (+`FUA`), `FLUSH`, `TRIM`, `WRITE_ZEROES`
//!   (+`NO_HOLE`, `FAST_ZERO`), `CACHE`, `BLOCK_STATUS`, `DISC`.
//! - Unix sockets, TCP, and TLS (rustls) on either.
//! - Bounded: requests and payload bytes in flight per connection, option
//!   count and size, handshake deadline.
//!
//! The protocol itself is sans-I/O in [`proto`]; [`server`] runs it on tokio.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use sheaf_blockrepl::frontend::{Disk, nbd::{Export, NbdConfig, NbdServer}};
//! use sheaf_blockrepl::volume::{Volume, VolumeConfig, create_replica};
//! create_replica("/tmp/vol0", 1 << 30)?;
//! let vol = Volume::attach(VolumeConfig::local("/tmp/vol0")).await?;
//! let server = NbdServer::new(NbdConfig::default());
//! server.add_export("vol0", Export::new(Disk::new(vol)))?;
//! let listener = NbdServer::bind_unix("/tmp/vol0.sock")?;
//! server.serve_unix(listener).await?; // qemu-img info nbd+unix:///vol0?socket=/tmp/vol0.sock
//! # Ok(()) }
//! ```

use std::path::Path;
use std::time::Duration;

pub mod proto;
pub mod server;

pub use server::{Export, NbdConfig, NbdServer, NbdStats, errno_for};

/// Errors of the NBD server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NbdError {
    /// The client broke the protocol; the connection was closed.
    #[error("protocol error: {0}")]
    Protocol(#[from] proto::ProtocolError),
    /// The client did not finish the handshake in time.
    #[error("handshake not finished within {0:?}")]
    HandshakeTimeout(Duration),
    /// The client went away mid-request.
    #[error("client disconnected")]
    Disconnected,
    /// A socket operation failed.
    #[error("{op} failed")]
    Io {
        /// The operation.
        op: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Bad server configuration (names, TLS files).
    #[error("configuration: {0}")]
    Config(String),
}

/// Builds a TLS acceptor from PEM files: a certificate chain and its
/// private key.
pub fn tls_acceptor(
    cert_pem: &Path,
    key_pem: &Path,
) -> Result<tokio_rustls::TlsAcceptor, NbdError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert_pem)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .map_err(|e| NbdError::Config(format!("certificate {}: {e}", cert_pem.display())))?;
    let key = PrivateKeyDer::from_pem_file(key_pem)
        .map_err(|e| NbdError::Config(format!("private key {}: {e}", key_pem.display())))?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| NbdError::Config(format!("TLS versions: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| NbdError::Config(format!("TLS certificate: {e}")))?;
    Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(cfg)))
}
