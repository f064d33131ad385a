// SPDX-License-Identifier: Apache-2.0
//! Test helpers: start an API server on a temporary directory and talk to it
//! over HTTPS with a minimal hyper client (or spawn real clients).
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use sheaf_orchestrator::api::{ApiServer, ApiServerConfig, RunningApiServer};
use sheaf_orchestrator::store::{MemoryStore, Store};

pub struct TestServer {
    pub server: RunningApiServer,
    pub dir: tempfile::TempDir,
    pub store: Arc<dyn Store>,
}

pub async fn start_with(
    store: Arc<dyn Store>,
    tweak: impl FnOnce(&mut ApiServerConfig),
) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ApiServerConfig::new(dir.path());
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    tweak(&mut cfg);
    let server = ApiServer::start(cfg, store.clone()).await.unwrap();
    TestServer { server, dir, store }
}

pub async fn start() -> TestServer {
    start_with(Arc::new(MemoryStore::new()), |_| {}).await
}

pub struct Client {
    addr: std::net::SocketAddr,
    tls: tokio_rustls::TlsConnector,
    pub token: Option<String>,
}

pub struct Reply {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

impl Client {
    pub fn new(ts: &TestServer) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ts.server.ca_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        Self {
            addr: ts.server.addr,
            tls: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
            token: Some(ts.server.tokens.admin.clone()),
        }
    }

    pub fn with_token(mut self, t: Option<&str>) -> Self {
        self.token = t.map(str::to_string);
        self
    }

    /// A raw TLS stream to the server (for tests that misbehave on purpose).
    pub async fn tls_stream(&self) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
        let tcp = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        self.tls
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap()
    }

    pub async fn connect(&self) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
        let tcp = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let tls = self
            .tls
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await
            .unwrap();
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .unwrap();
        tokio::spawn(async move {
            let _ = conn.await;
        });
        send
    }

    pub fn build(
        &self,
        method: &str,
        path: &str,
        ct: Option<&str>,
        body: impl Into<Bytes>,
        accept: Option<&str>,
    ) -> Request<Full<Bytes>> {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost");
        if let Some(t) = &self.token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        if let Some(ct) = ct {
            b = b.header("content-type", ct);
        }
        if let Some(a) = accept {
            b = b.header("accept", a);
        }
        b.body(Full::new(body.into())).unwrap()
    }

    pub async fn send_on(
        send: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
        req: Request<Full<Bytes>>,
    ) -> Reply {
        send.ready().await.unwrap();
        let resp: Response<Incoming> = send.send_request(req).await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        Reply {
            status,
            headers,
            body,
        }
    }

    pub async fn req(
        &self,
        method: &str,
        path: &str,
        ct: Option<&str>,
        body: impl Into<Bytes>,
    ) -> Reply {
        let mut s = self.connect().await;
        Self::send_on(&mut s, self.build(method, path, ct, body, None)).await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.req("GET", path, None, Bytes::new()).await
    }

    pub async fn post_json(&self, path: &str, v: &Value) -> Reply {
        self.req(
            "POST",
            path,
            Some("application/json"),
            serde_json::to_vec(v).unwrap(),
        )
        .await
    }

    /// Opens a watch; returns a receiver of parsed event lines.
    pub async fn watch(&self, path: &str) -> tokio::sync::mpsc::UnboundedReceiver<Value> {
        let mut s = self.connect().await;
        s.ready().await.unwrap();
        let resp = s
            .send_request(self.build("GET", path, None, Bytes::new(), None))
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let _keep = s;
            let mut body = resp.into_body();
            let mut buf: Vec<u8> = Vec::new();
            while let Some(Ok(frame)) = body.frame().await {
                if let Ok(data) = frame.into_data() {
                    buf.extend_from_slice(&data);
                    while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = buf.drain(..=pos).collect();
                        if let Ok(v) = serde_json::from_slice::<Value>(&line)
                            && tx.send(v).is_err()
                        {
                            return;
                        }
                    }
                }
            }
        });
        rx
    }
}

pub async fn recv(rx: &mut tokio::sync::mpsc::UnboundedReceiver<Value>) -> Value {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("watch event in time")
        .expect("watch open")
}

pub fn manifest(name: &str) -> String {
    std::fs::read_to_string(format!(
        "{}/tests/manifests/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}
