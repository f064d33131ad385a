// SPDX-License-Identifier: Apache-2.0
//! HTTP(S) image downloads for Volume sources (`dataVolumeTemplates[].spec.
//! source.http`, `spec.source.image: https://...`).
//!
//! ```text
//!   check_url (http/https only) ─► TCP connect (timeout) ─► TLS (system roots, https)
//!     ─► GET ─► 3xx: Location checked with the same rule, at most 5 hops
//!            ─► 2xx: body streamed to DATA/tmp/download-<ns>-<name>-<id>.part,
//!                    hashed (sha256/sha512) on the way, size capped, idle timeout
//!            ─► anything else: an error naming the status
//! ```
//!
//! The file is removed when the returned [`TempDownload`] is dropped, and
//! on every error, so a failed download leaves nothing behind.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::{Request, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use sha2::Digest;
use sheaf_orchestrator::images::{ImageSourceError, check_url};
use sheaf_orchestrator::names;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::image::ImportProgress;

/// Bounds of one download.
#[derive(Debug, Clone)]
pub struct DownloadLimits {
    /// Largest body accepted.
    pub max_bytes: u64,
    /// TCP connect (and TLS handshake) timeout.
    pub connect_timeout: Duration,
    /// Longest wait for response headers or the next body bytes.
    pub idle_timeout: Duration,
    /// Redirects followed.
    pub max_redirects: u32,
}

impl Default for DownloadLimits {
    fn default() -> Self {
        DownloadLimits {
            max_bytes: 64 << 30,
            connect_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            max_redirects: 5,
        }
    }
}

/// Download failures.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    /// The URL (or a redirect target) is not allowed.
    #[error(transparent)]
    Url(#[from] ImageSourceError),
    /// The server cannot be reached.
    #[error("{url}: cannot connect: {message}")]
    Connect {
        /// URL.
        url: String,
        /// Why.
        message: String,
    },
    /// The server answered with a non-success status.
    #[error("{url}: HTTP {code}")]
    Status {
        /// URL.
        url: String,
        /// Status line, e.g. `404 Not Found`.
        code: String,
    },
    /// Redirect problems (too many, no Location).
    #[error("{url}: {message}")]
    Redirect {
        /// URL.
        url: String,
        /// Why.
        message: String,
    },
    /// The body exceeds the limit.
    #[error("{url}: larger than the limit of {limit} bytes")]
    TooLarge {
        /// URL.
        url: String,
        /// Limit.
        limit: u64,
    },
    /// No progress within the idle timeout.
    #[error("{url}: no data for {secs} s ({what})")]
    Timeout {
        /// URL.
        url: String,
        /// Which wait.
        what: &'static str,
        /// Timeout.
        secs: u64,
    },
    /// The connection broke or the server spoke bad HTTP.
    #[error("{url}: {message}")]
    Protocol {
        /// URL.
        url: String,
        /// Why.
        message: String,
    },
    /// The body is empty.
    #[error("{url}: the server sent an empty file")]
    Empty {
        /// URL.
        url: String,
    },
    /// The digest differs from the one asked for.
    #[error("{url}: {alg} checksum mismatch: expected {want}, got {got}")]
    Checksum {
        /// URL.
        url: String,
        /// `sha256` or `sha512`.
        alg: &'static str,
        /// Expected hex digest.
        want: String,
        /// Actual hex digest.
        got: String,
    },
    /// The checksum given is malformed.
    #[error("checksum {0}")]
    BadChecksum(String),
    /// Local file I/O.
    #[error("{path}: {message}")]
    Io {
        /// File.
        path: PathBuf,
        /// Why.
        message: String,
    },
}

/// A downloaded file, removed when dropped.
#[derive(Debug)]
pub struct TempDownload {
    /// Where it is.
    pub path: PathBuf,
    /// Bytes received.
    pub bytes: u64,
    /// `alg:hex` digest when a checksum was asked for (and matched).
    pub digest: Option<String>,
}

impl Drop for TempDownload {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Removes a partial file unless disarmed.
struct Partial(Option<PathBuf>);

impl Drop for Partial {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

enum Hasher {
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

impl Hasher {
    fn new(alg: &str) -> Hasher {
        if alg == "sha512" {
            Hasher::Sha512(sha2::Sha512::new())
        } else {
            Hasher::Sha256(sha2::Sha256::new())
        }
    }
    fn update(&mut self, b: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(b),
            Hasher::Sha512(h) => h.update(b),
        }
    }
    fn hex(self) -> String {
        let d: Vec<u8> = match self {
            Hasher::Sha256(h) => h.finalize().to_vec(),
            Hasher::Sha512(h) => h.finalize().to_vec(),
        };
        d.iter().map(|b| format!("{b:02x}")).collect()
    }
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

fn tls_connector() -> Result<tokio_rustls::TlsConnector, String> {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for c in found.certs {
        let _ = roots.add(c);
    }
    if roots.is_empty() {
        return Err("no trusted CA certificates found on this host".into());
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg)))
}

/// Resolves a redirect's `Location` against `base`.
pub fn resolve_location(base: &Uri, loc: &str) -> String {
    let scheme = base.scheme_str().unwrap_or("http");
    let auth = base.authority().map(|a| a.as_str()).unwrap_or("");
    if loc.contains("://") {
        loc.to_string()
    } else if let Some(rest) = loc.strip_prefix("//") {
        format!("{scheme}://{rest}")
    } else if loc.starts_with('/') {
        format!("{scheme}://{auth}{loc}")
    } else {
        let path = base.path();
        let dir = &path[..path.rfind('/').map_or(0, |i| i + 1)];
        let dir = if dir.is_empty() { "/" } else { dir };
        format!("{scheme}://{auth}{dir}{loc}")
    }
}

async fn connect(
    uri: &Uri,
    url: &str,
    limits: &DownloadLimits,
) -> Result<Box<dyn Io>, DownloadError> {
    let cerr = |m: String| DownloadError::Connect {
        url: url.to_string(),
        message: m,
    };
    let https = uri
        .scheme_str()
        .is_some_and(|s| s.eq_ignore_ascii_case("https"));
    let host = uri
        .host()
        .ok_or_else(|| cerr("no host".into()))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    let tcp = tokio::time::timeout(
        limits.connect_timeout,
        tokio::net::TcpStream::connect((host.as_str(), port)),
    )
    .await
    .map_err(|_| cerr(format!("timed out after {:?}", limits.connect_timeout)))?
    .map_err(|e| cerr(e.to_string()))?;
    let _ = tcp.set_nodelay(true);
    if !https {
        return Ok(Box::new(tcp));
    }
    let tls = tls_connector().map_err(cerr)?;
    let name = rustls::pki_types::ServerName::try_from(host.clone())
        .map_err(|e| cerr(format!("server name {host:?}: {e}")))?;
    let s = tokio::time::timeout(limits.connect_timeout, tls.connect(name, tcp))
        .await
        .map_err(|_| cerr("TLS handshake timed out".into()))?
        .map_err(|e| cerr(format!("TLS: {e}")))?;
    Ok(Box::new(s))
}

/// Downloads `url` into a new file under `dir` named after `label`,
/// checking `checksum` (`sha256:<hex>` / `sha512:<hex>`) when given and
/// sending `downloading` progress lines to `tx`.
pub async fn download(
    url: &str,
    dir: &Path,
    label: &str,
    checksum: Option<&str>,
    limits: &DownloadLimits,
    tx: &mpsc::Sender<ImportProgress>,
) -> Result<TempDownload, DownloadError> {
    check_url(url)?;
    let want = checksum
        .map(sheaf_orchestrator::resources::sheaf::parse_checksum)
        .transpose()
        .map_err(DownloadError::BadChecksum)?;
    let mut current = url.to_string();
    let mut hops = 0;
    let resp = loop {
        let uri: Uri = current.parse().map_err(|e| DownloadError::Protocol {
            url: current.clone(),
            message: format!("unparsable URL: {e}"),
        })?;
        let io = connect(&uri, &current, limits).await?;
        let perr = |m: String| DownloadError::Protocol {
            url: current.clone(),
            message: m,
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| perr(e.to_string()))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let pq = uri.path_and_query().map_or("/", |p| p.as_str());
        let authority = uri.authority().map(|a| a.as_str()).unwrap_or("");
        let req = Request::get(pq)
            .header(hyper::header::HOST, authority)
            .header(hyper::header::USER_AGENT, "sheaf-importer")
            .header(hyper::header::ACCEPT, "*/*")
            .body(Empty::<Bytes>::new())
            .map_err(|e| perr(e.to_string()))?;
        let resp = tokio::time::timeout(limits.idle_timeout, sender.send_request(req))
            .await
            .map_err(|_| DownloadError::Timeout {
                url: current.clone(),
                what: "waiting for the response headers",
                secs: limits.idle_timeout.as_secs(),
            })?
            .map_err(|e| perr(e.to_string()))?;
        let st = resp.status();
        if st.is_redirection() && st != StatusCode::NOT_MODIFIED {
            hops += 1;
            if hops > limits.max_redirects {
                return Err(DownloadError::Redirect {
                    url: url.to_string(),
                    message: format!("more than {} redirects", limits.max_redirects),
                });
            }
            let loc = resp
                .headers()
                .get(hyper::header::LOCATION)
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| DownloadError::Redirect {
                    url: current.clone(),
                    message: format!("HTTP {st} without a usable Location"),
                })?;
            let next = resolve_location(&uri, loc);
            check_url(&next)?;
            tracing::debug!(from = %current, to = %next, "following redirect");
            current = next;
            continue;
        }
        if !st.is_success() {
            return Err(DownloadError::Status {
                url: current,
                code: st.to_string(),
            });
        }
        break resp;
    };
    let total = resp
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(t) = total
        && t > limits.max_bytes
    {
        return Err(DownloadError::TooLarge {
            url: current,
            limit: limits.max_bytes,
        });
    }

    std::fs::create_dir_all(dir).map_err(|e| DownloadError::Io {
        path: dir.to_path_buf(),
        message: e.to_string(),
    })?;
    let fname = format!("download-{label}-{}.part", uuid::Uuid::new_v4().simple());
    let path = names::child(dir, &fname).map_err(|e| DownloadError::Io {
        path: dir.to_path_buf(),
        message: e.to_string(),
    })?;
    let ioerr = |e: std::io::Error| DownloadError::Io {
        path: path.clone(),
        message: e.to_string(),
    };
    let mut partial = Partial(Some(path.clone()));
    let mut file = tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .await
        .map_err(ioerr)?;
    let mut hasher = want.as_ref().map(|(alg, _)| Hasher::new(alg));
    let mut body = resp.into_body();
    let mut done = 0u64;
    let mut last = tokio::time::Instant::now();
    let _ = tx
        .send(ImportProgress::new(
            "downloading",
            0,
            total.unwrap_or(0),
            "",
        ))
        .await;
    loop {
        let frame = tokio::time::timeout(limits.idle_timeout, body.frame())
            .await
            .map_err(|_| DownloadError::Timeout {
                url: current.clone(),
                what: "reading the body",
                secs: limits.idle_timeout.as_secs(),
            })?;
        let Some(frame) = frame else { break };
        let frame = frame.map_err(|e| DownloadError::Protocol {
            url: current.clone(),
            message: format!("after {done} bytes: {e}"),
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        done += data.len() as u64;
        if done > limits.max_bytes {
            return Err(DownloadError::TooLarge {
                url: current,
                limit: limits.max_bytes,
            });
        }
        if let Some(h) = hasher.as_mut() {
            h.update(&data);
        }
        file.write_all(&data).await.map_err(ioerr)?;
        if last.elapsed() > Duration::from_millis(200) {
            last = tokio::time::Instant::now();
            let _ = tx
                .send(ImportProgress::new(
                    "downloading",
                    done,
                    total.unwrap_or(0),
                    "",
                ))
                .await;
        }
    }
    if let Some(t) = total
        && done != t
    {
        return Err(DownloadError::Protocol {
            url: current,
            message: format!("truncated: {done} of {t} bytes"),
        });
    }
    if done == 0 {
        return Err(DownloadError::Empty { url: current });
    }
    file.sync_all().await.map_err(ioerr)?;
    drop(file);
    let digest = match (want, hasher) {
        (Some((alg, want)), Some(h)) => {
            let got = h.hex();
            if got != want {
                return Err(DownloadError::Checksum {
                    url: url.to_string(),
                    alg,
                    want,
                    got,
                });
            }
            Some(format!("{alg}:{got}"))
        }
        _ => None,
    };
    let _ = tx
        .send(ImportProgress::new("downloading", done, done, ""))
        .await;
    partial.0 = None;
    Ok(TempDownload {
        path,
        bytes: done,
        digest,
    })
}

#[cfg(test)]
#[path = "download_tests.rs"]
mod tests;
