// SPDX-License-Identifier: Apache-2.0
//! A small HTTPS client of the sheaf API server, configured from a
//! kubeconfig (server URL, CA, bearer token) like kubectl.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;

/// Failures talking to the API server.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The kubeconfig is missing or unusable.
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig {
        /// File.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// Connecting (TCP or TLS) failed.
    #[error(
        "cannot reach the sheaf API server at {url} (is `sheaf cluster up` running?): {message}"
    )]
    Connect {
        /// Server URL.
        url: String,
        /// Why.
        message: String,
    },
    /// The server answered with an error status.
    #[error("{message}")]
    Status {
        /// HTTP status.
        code: u16,
        /// The Kubernetes Status message (or the body).
        message: String,
    },
    /// The answer was not what the API promises.
    #[error("bad answer from the API server: {0}")]
    Protocol(String),
}

/// A reply.
#[derive(Debug)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Body.
    pub body: Bytes,
}

/// API client.
#[derive(Clone)]
pub struct ApiClient {
    /// `https://host:port`.
    pub url: String,
    host: String,
    port: u16,
    token: String,
    tls: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient").field("url", &self.url).finish()
    }
}

fn kc_err(path: &Path, message: impl Into<String>) -> ClientError {
    ClientError::Kubeconfig {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

impl ApiClient {
    /// A client for the current context of the kubeconfig at `path`.
    pub fn from_kubeconfig(path: &Path) -> Result<ApiClient, ClientError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            kc_err(
                path,
                format!("{e} (start a cluster with `sheaf cluster up`, or pass --kubeconfig)"),
            )
        })?;
        let kc: Value = serde_yaml::from_str(&text).map_err(|e| kc_err(path, e.to_string()))?;
        let current = kc["current-context"].as_str().unwrap_or("");
        let find = |list: &str, name: &str| -> Option<Value> {
            kc[list]
                .as_array()?
                .iter()
                .find(|e| e["name"].as_str() == Some(name))
                .cloned()
        };
        let ctx = find("contexts", current)
            .or_else(|| kc["contexts"].get(0).cloned())
            .ok_or_else(|| kc_err(path, "no context"))?;
        let cluster_name = ctx["context"]["cluster"].as_str().unwrap_or("");
        let user_name = ctx["context"]["user"].as_str().unwrap_or("");
        let cluster = find("clusters", cluster_name)
            .ok_or_else(|| kc_err(path, format!("no cluster {cluster_name:?}")))?;
        let user = find("users", user_name)
            .ok_or_else(|| kc_err(path, format!("no user {user_name:?}")))?;
        let url = cluster["cluster"]["server"]
            .as_str()
            .ok_or_else(|| kc_err(path, "cluster has no server"))?
            .trim_end_matches('/')
            .to_string();
        let ca_b64 = cluster["cluster"]["certificate-authority-data"]
            .as_str()
            .ok_or_else(|| kc_err(path, "cluster has no certificate-authority-data"))?;
        let ca = base64::engine::general_purpose::STANDARD
            .decode(ca_b64)
            .map_err(|e| kc_err(path, format!("certificate-authority-data: {e}")))?;
        let token = user["user"]["token"]
            .as_str()
            .ok_or_else(|| kc_err(path, "user has no token"))?
            .to_string();
        Self::new(&url, &ca, token).map_err(|m| kc_err(path, m))
    }

    /// A client of `url` trusting the PEM CA `ca_pem`.
    pub fn new(url: &str, ca_pem: &[u8], token: String) -> Result<ApiClient, String> {
        let rest = url
            .strip_prefix("https://")
            .ok_or_else(|| format!("server {url:?} is not https://"))?;
        let hostport = rest.split('/').next().unwrap_or(rest);
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (
                h.trim_start_matches('[').trim_end_matches(']').to_string(),
                p.parse::<u16>()
                    .map_err(|e| format!("server port {p:?}: {e}"))?,
            ),
            _ => (hostport.to_string(), 443),
        };
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca_pem) {
            let c = c.map_err(|e| format!("CA certificate: {e}"))?;
            roots.add(c).map_err(|e| format!("CA certificate: {e}"))?;
        }
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        Ok(ApiClient {
            url: url.trim_end_matches('/').to_string(),
            host,
            port,
            token,
            tls: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
        })
    }

    fn connect_err(&self, e: impl std::fmt::Display) -> ClientError {
        ClientError::Connect {
            url: self.url.clone(),
            message: e.to_string(),
        }
    }

    async fn open<B>(&self) -> Result<hyper::client::conn::http1::SendRequest<B>, ClientError>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| self.connect_err(e))?;
        let name = ServerName::try_from(self.host.clone()).map_err(|e| self.connect_err(e))?;
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| self.connect_err(e))?;
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| self.connect_err(e))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(send)
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Bytes,
    ) -> Result<hyper::Request<Full<Bytes>>, ClientError> {
        let mut b = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", format!("{}:{}", self.host, self.port))
            .header("authorization", format!("Bearer {}", self.token))
            .header("accept", "application/json");
        if let Some(ct) = content_type {
            b = b.header("content-type", ct);
        }
        b.body(Full::new(body))
            .map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// Sends one request and reads the whole answer (any status).
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Bytes,
    ) -> Result<Reply, ClientError> {
        let mut s = self.open().await?;
        let req = self.request(method, path, content_type, body)?;
        let resp = s.send_request(req).await.map_err(|e| self.connect_err(e))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| self.connect_err(e))?
            .to_bytes();
        Ok(Reply { status, body })
    }

    /// Like [`ApiClient::send`], but a non-2xx answer becomes
    /// [`ClientError::Status`] and the body is parsed as JSON.
    pub async fn json(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &Value)>,
    ) -> Result<Value, ClientError> {
        let (ct, bytes) = match body {
            Some((ct, v)) => (Some(ct), Bytes::from(v.to_string())),
            None => (None, Bytes::new()),
        };
        let r = self.send(method, path, ct, bytes).await?;
        if !(200..300).contains(&r.status) {
            return Err(status_error(r.status, &r.body));
        }
        if r.body.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&r.body).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// Sends a body as is; a non-2xx answer becomes [`ClientError::Status`].
    pub async fn send_checked(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: Bytes,
    ) -> Result<Reply, ClientError> {
        let r = self.send(method, path, Some(content_type), body).await?;
        if !(200..300).contains(&r.status) {
            return Err(status_error(r.status, &r.body));
        }
        Ok(r)
    }

    /// GET as JSON.
    pub async fn get(&self, path: &str) -> Result<Value, ClientError> {
        self.json("GET", path, None).await
    }

    /// GET, streaming the body chunk by chunk into `f` until the server
    /// ends it or `f` returns false.
    pub async fn stream(
        &self,
        path: &str,
        f: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), ClientError> {
        self.stream_request("GET", path, None, Bytes::new(), f)
            .await
    }

    /// Sends a request and streams the answer's body chunk by chunk into
    /// `f` (a non-2xx answer becomes [`ClientError::Status`]).
    pub async fn stream_request(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Bytes,
        f: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), ClientError> {
        let mut s = self.open().await?;
        let req = self.request(method, path, content_type, body)?;
        let resp = s.send_request(req).await.map_err(|e| self.connect_err(e))?;
        self.stream_answer(resp, f).await
    }

    /// Sends a request whose body is read from `file` in 1 MiB chunks
    /// (`sent` is told each chunk's length), and streams the answer's body
    /// into `f` (a non-2xx answer becomes [`ClientError::Status`]).
    pub async fn upload_file(
        &self,
        method: &str,
        path: &str,
        file: tokio::fs::File,
        sent: impl Fn(u64) + Send + Sync + 'static,
        f: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), ClientError> {
        use tokio::io::AsyncReadExt as _;
        let sent = Arc::new(sent);
        let chunks = futures::stream::unfold(Some(file), move |file| {
            let sent = sent.clone();
            async move {
                let mut file = file?;
                let mut buf = vec![0u8; 1 << 20];
                match file.read(&mut buf).await {
                    Ok(0) => None,
                    Ok(n) => {
                        buf.truncate(n);
                        sent(n as u64);
                        Some((Ok(hyper::body::Frame::data(Bytes::from(buf))), Some(file)))
                    }
                    Err(e) => Some((Err(e), None)),
                }
            }
        });
        let body = http_body_util::StreamBody::new(chunks);
        let mut s = self.open().await?;
        let req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", format!("{}:{}", self.host, self.port))
            .header("authorization", format!("Bearer {}", self.token))
            .header("accept", "application/json")
            .header("content-type", "application/octet-stream")
            .body(body)
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        let resp = s.send_request(req).await.map_err(|e| self.connect_err(e))?;
        self.stream_answer(resp, f).await
    }

    async fn stream_answer(
        &self,
        resp: hyper::Response<hyper::body::Incoming>,
        mut f: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), ClientError> {
        let status = resp.status().as_u16();
        let mut body = resp.into_body();
        if !(200..300).contains(&status) {
            let b = body
                .collect()
                .await
                .map_err(|e| self.connect_err(e))?
                .to_bytes();
            return Err(status_error(status, &b));
        }
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| self.connect_err(e))?;
            if let Some(d) = frame.data_ref()
                && !f(d)
            {
                break;
            }
        }
        Ok(())
    }
}

/// The message of a Kubernetes Status body (or the body itself).
pub fn status_error(code: u16, body: &[u8]) -> ClientError {
    let message = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string());
    ClientError::Status { code, message }
}
