// SPDX-License-Identifier: Apache-2.0
//! A small blocking client for a sheaf (or any Kubernetes-compatible) API
//! server: bearer token over HTTPS, configured from a URL or a kubeconfig.
//!
//! It speaks HTTP/1.1 through hyper over tokio-rustls (the stack the API
//! server itself uses) on a private current-thread runtime, one connection
//! per request. Enough for scripting (list, get, create, delete); watch
//! streams are out of scope — use kube-rs or the Python `kubernetes`
//! client for controllers.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::Uri;
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde::Serialize;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::runtime::Runtime;

use crate::error::{Error, Result};

/// Largest response body read (lists of many VMs are a few MiB).
const MAX_BODY: usize = 64 << 20;
/// Per-request time limit.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The system CA bundle used for `https` URLs given without a CA.
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// KubeVirt's API group and version.
pub const KUBEVIRT_V1: &str = "kubevirt.io/v1";

/// A connection to an API server. `Send + Sync`; calls may run
/// concurrently from several threads.
pub struct ClusterClient {
    scheme_tls: bool,
    host: String,
    port: u16,
    base_path: String,
    token: Option<String>,
    namespace: String,
    tls: Option<tokio_rustls::TlsConnector>,
    rt: Runtime,
}

impl std::fmt::Debug for ClusterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterClient")
            .field("server", &self.server())
            .field("namespace", &self.namespace)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// The essentials of a `VirtualMachine`, for typed listings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VmSummary {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `spec.runStrategy`, or `Always`/`Halted` from `spec.running`.
    pub run_strategy: String,
    /// `status.printableStatus` (empty until a controller set it).
    pub status: String,
    /// `status.ready`.
    pub ready: bool,
    /// `metadata.creationTimestamp`.
    pub created: String,
}

impl VmSummary {
    /// Extracts the summary from a `VirtualMachine` object.
    pub fn from_object(o: &Value) -> VmSummary {
        let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
        let spec = &o["spec"];
        let run_strategy = match (&spec["runStrategy"], &spec["running"]) {
            (Value::String(rs), _) => rs.clone(),
            (_, Value::Bool(true)) => "Always".into(),
            (_, Value::Bool(false)) => "Halted".into(),
            _ => String::new(),
        };
        VmSummary {
            namespace: s(&o["metadata"]["namespace"]),
            name: s(&o["metadata"]["name"]),
            run_strategy,
            status: s(&o["status"]["printableStatus"]),
            ready: o["status"]["ready"].as_bool().unwrap_or(false),
            created: s(&o["metadata"]["creationTimestamp"]),
        }
    }
}

fn tls_config(ca_pem: &[u8]) -> Result<tokio_rustls::TlsConnector> {
    let mut roots = rustls::RootCertStore::empty();
    let mut n = 0;
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| Error::Tls(format!("CA certificate: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| Error::Tls(format!("CA certificate: {e}")))?;
        n += 1;
    }
    if n == 0 {
        return Err(Error::Tls("no PEM certificate in the CA data".into()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg)))
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// One HTTP exchange's result: status and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl ClusterClient {
    /// Connects to `url` (`https://host:port` or `http://...`) with an
    /// optional bearer `token`. `ca_pem` holds the PEM CA certificates that
    /// sign the server's certificate; for `https` without it the system
    /// bundle is used. No request is made until the first call.
    pub fn connect(url: &str, token: Option<&str>, ca_pem: Option<&[u8]>) -> Result<Self> {
        let uri: Uri = url
            .parse()
            .map_err(|e| Error::InvalidArgument(format!("server URL {url:?}: {e}")))?;
        let tls = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "server URL {url:?} is not http:// or https://"
                )));
            }
        };
        let host = uri
            .host()
            .ok_or_else(|| Error::InvalidArgument(format!("server URL {url:?} has no host")))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let base_path = uri.path().trim_end_matches('/').to_string();
        let connector = if tls {
            Some(match ca_pem {
                Some(pem) => tls_config(pem)?,
                None => {
                    let pem = std::fs::read(SYSTEM_CA_BUNDLE).map_err(|e| {
                        Error::Tls(format!(
                            "no CA given and the system bundle {SYSTEM_CA_BUNDLE} is unreadable: {e}"
                        ))
                    })?;
                    tls_config(&pem)?
                }
            })
        } else {
            None
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(Error::io("start async runtime"))?;
        Ok(ClusterClient {
            scheme_tls: tls,
            host,
            port,
            base_path,
            token: token.filter(|t| !t.is_empty()).map(str::to_string),
            namespace: "default".into(),
            tls: connector,
            rt,
        })
    }

    /// Connects with a kubeconfig: `path` (default `$KUBECONFIG`'s first
    /// entry, then `~/.kube/config`) and `context` (default its
    /// `current-context`). Supports `certificate-authority[-data]`, `token`
    /// and `tokenFile` users, and the context's namespace.
    pub fn from_kubeconfig(path: Option<&Path>, context: Option<&str>) -> Result<Self> {
        let path = match path {
            Some(p) => p.to_path_buf(),
            None => default_kubeconfig()?,
        };
        let bad = |message: String| Error::Kubeconfig {
            path: path.clone(),
            message,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        let doc: serde_yaml::Value =
            serde_yaml::from_str(&text).map_err(|e| bad(format!("not YAML: {e}")))?;
        let ctx_name = match context {
            Some(c) => c.to_string(),
            None => doc["current-context"]
                .as_str()
                .filter(|s| !s.is_empty())
                .ok_or_else(|| bad("no current-context and no context given".into()))?
                .to_string(),
        };
        let find = |list: &str, name: &str| -> Result<serde_yaml::Value> {
            doc[list]
                .as_sequence()
                .and_then(|s| s.iter().find(|e| e["name"].as_str() == Some(name)))
                .cloned()
                .ok_or_else(|| bad(format!("no {list} entry named {name:?}")))
        };
        let ctx = find("contexts", &ctx_name)?;
        let ctx = &ctx["context"];
        let cluster_name = ctx["cluster"]
            .as_str()
            .ok_or_else(|| bad(format!("context {ctx_name:?} names no cluster")))?;
        let cluster = find("clusters", cluster_name)?;
        let cluster = &cluster["cluster"];
        let server = cluster["server"]
            .as_str()
            .ok_or_else(|| bad(format!("cluster {cluster_name:?} has no server")))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let ca: Option<Vec<u8>> = if let Some(data) = cluster["certificate-authority-data"].as_str()
        {
            Some(
                base64::engine::general_purpose::STANDARD
                    .decode(data.trim())
                    .map_err(|e| bad(format!("certificate-authority-data: {e}")))?,
            )
        } else if let Some(file) = cluster["certificate-authority"].as_str() {
            let f = dir.join(file);
            Some(std::fs::read(&f).map_err(|e| bad(format!("{}: {e}", f.display())))?)
        } else {
            None
        };
        if cluster["insecure-skip-tls-verify"].as_bool() == Some(true) {
            return Err(bad("insecure-skip-tls-verify is not supported".into()));
        }
        let token = match ctx["user"].as_str() {
            None => None,
            Some(user_name) => {
                let user = find("users", user_name)?;
                let user = &user["user"];
                if let Some(t) = user["token"].as_str() {
                    Some(t.to_string())
                } else if let Some(f) = user["tokenFile"].as_str() {
                    let f = dir.join(f);
                    Some(
                        std::fs::read_to_string(&f)
                            .map_err(|e| bad(format!("{}: {e}", f.display())))?
                            .trim()
                            .to_string(),
                    )
                } else if !user["client-certificate-data"].is_null()
                    || !user["client-certificate"].is_null()
                    || !user["exec"].is_null()
                {
                    return Err(bad(format!(
                        "user {user_name:?}: only token authentication is supported"
                    )));
                } else {
                    None
                }
            }
        };
        let mut c = ClusterClient::connect(server, token.as_deref(), ca.as_deref())?;
        if let Some(ns) = ctx["namespace"].as_str().filter(|s| !s.is_empty()) {
            c.namespace = ns.to_string();
        }
        Ok(c)
    }

    /// The server URL.
    pub fn server(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!(
            "{}://{}:{}{}",
            if self.scheme_tls { "https" } else { "http" },
            host,
            self.port,
            self.base_path
        )
    }

    /// The default namespace (from the kubeconfig context, else `default`).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Changes the default namespace.
    pub fn set_namespace(&mut self, ns: &str) {
        self.namespace = ns.to_string();
    }

    /// One HTTP request; `path` starts with `/` (e.g. `/version`). Returns
    /// the status and body whatever the status.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, Vec<u8>)>,
    ) -> Result<Response> {
        if !path.starts_with('/') {
            return Err(Error::InvalidArgument(format!(
                "API path {path:?} does not start with /"
            )));
        }
        let method = hyper::Method::from_bytes(method.as_bytes())
            .map_err(|e| Error::InvalidArgument(format!("HTTP method {method:?}: {e}")))?;
        let full_path = format!("{}{}", self.base_path, path);
        let url = format!("{}{}", self.server(), path);
        let http_err = |source: Box<dyn std::error::Error + Send + Sync>| Error::Http {
            method: method.to_string(),
            url: url.clone(),
            source,
        };
        let authority = if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        };
        let mut req = hyper::Request::builder()
            .method(method.clone())
            .uri(&full_path)
            .header(HOST, authority)
            .header(ACCEPT, "application/json");
        if let Some(t) = &self.token {
            req = req.header(AUTHORIZATION, format!("Bearer {t}"));
        }
        let body = match body {
            Some((ct, b)) => {
                req = req.header(CONTENT_TYPE, ct);
                Bytes::from(b)
            }
            None => Bytes::new(),
        };
        let req = req
            .body(Full::new(body))
            .map_err(|e| Error::InvalidArgument(format!("request {full_path:?}: {e}")))?;
        let fut = async {
            let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port)).await?;
            tcp.set_nodelay(true)?;
            let io: Box<dyn Io> = match &self.tls {
                Some(tls) => {
                    let name = ServerName::try_from(self.host.clone())?;
                    Box::new(tls.connect(name, tcp).await?)
                }
                None => Box::new(tcp),
            };
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
            let conn = tokio::spawn(conn);
            let resp = sender.send_request(req).await?;
            let status = resp.status().as_u16();
            let body = Limited::new(resp.into_body(), MAX_BODY)
                .collect()
                .await?
                .to_bytes();
            drop(sender);
            let _ = conn.await;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Response {
                status,
                body: body.to_vec(),
            })
        };
        self.rt.block_on(async {
            match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
                Ok(r) => r.map_err(http_err),
                Err(_) => Err(Error::Timeout {
                    op: "API request",
                    ms: REQUEST_TIMEOUT.as_millis() as u64,
                }),
            }
        })
    }

    /// A request whose success answer is JSON; error statuses become
    /// [`Error::Api`] with the Kubernetes `Status` reason and message.
    pub fn request_json(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, Vec<u8>)>,
    ) -> Result<Value> {
        let r = self.request(method, path, body)?;
        if !(200..300).contains(&r.status) {
            let v: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
            let text = String::from_utf8_lossy(&r.body);
            return Err(Error::Api {
                method: method.to_string(),
                path: path.to_string(),
                status: r.status,
                reason: v["reason"].as_str().unwrap_or_default().to_string(),
                message: v["message"]
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| text.chars().take(200).collect()),
            });
        }
        serde_json::from_slice(&r.body).map_err(|source| Error::Json {
            what: "API response",
            source,
        })
    }

    fn vms_path(&self, namespace: Option<&str>) -> String {
        match namespace {
            Some(ns) => format!("/apis/{KUBEVIRT_V1}/namespaces/{ns}/virtualmachines"),
            None => format!("/apis/{KUBEVIRT_V1}/virtualmachines"),
        }
    }

    /// The server's `/version` document.
    pub fn version(&self) -> Result<Value> {
        self.request_json("GET", "/version", None)
    }

    /// `VirtualMachine` objects in `namespace` (`None`: every namespace).
    pub fn list_vms(&self, namespace: Option<&str>) -> Result<Vec<Value>> {
        let list = self.request_json("GET", &self.vms_path(namespace), None)?;
        match list {
            Value::Object(mut m) => match m.remove("items") {
                Some(Value::Array(items)) => Ok(items),
                Some(Value::Null) | None => Ok(Vec::new()),
                Some(_) => Err(Error::InvalidArgument(
                    "list response has a non-array items".into(),
                )),
            },
            _ => Err(Error::InvalidArgument(
                "list response is not an object".into(),
            )),
        }
    }

    /// One `VirtualMachine` (`namespace` `None`: the default namespace).
    pub fn get_vm(&self, namespace: Option<&str>, name: &str) -> Result<Value> {
        let ns = namespace.unwrap_or(&self.namespace);
        self.request_json("GET", &format!("{}/{name}", self.vms_path(Some(ns))), None)
    }

    /// Creates a `VirtualMachine` from a JSON or YAML manifest; its
    /// namespace is the manifest's, else `namespace`, else the default.
    /// Returns the stored object.
    pub fn create_vm(&self, namespace: Option<&str>, manifest: &str) -> Result<Value> {
        let trimmed = manifest.trim_start();
        let doc: Value = if trimmed.starts_with('{') {
            serde_json::from_str(trimmed).map_err(|source| Error::Json {
                what: "VM manifest",
                source,
            })?
        } else {
            serde_yaml::from_str(trimmed)
                .map_err(|e| Error::InvalidArgument(format!("VM manifest is not YAML: {e}")))?
        };
        let ns = doc["metadata"]["namespace"]
            .as_str()
            .map(str::to_string)
            .or_else(|| namespace.map(str::to_string))
            .unwrap_or_else(|| self.namespace.clone());
        let body = serde_json::to_vec(&doc).map_err(|source| Error::Json {
            what: "VM manifest",
            source,
        })?;
        self.request_json(
            "POST",
            &self.vms_path(Some(&ns)),
            Some(("application/json", body)),
        )
    }

    /// Deletes a `VirtualMachine`.
    pub fn delete_vm(&self, namespace: Option<&str>, name: &str) -> Result<()> {
        let ns = namespace.unwrap_or(&self.namespace);
        self.request_json(
            "DELETE",
            &format!("{}/{name}", self.vms_path(Some(ns))),
            None,
        )
        .map(|_| ())
    }
}

fn default_kubeconfig() -> Result<PathBuf> {
    if let Some(k) = std::env::var_os("KUBECONFIG")
        && let Some(first) = std::env::split_paths(&k).find(|p| !p.as_os_str().is_empty())
    {
        return Ok(first);
    }
    match std::env::var_os("HOME") {
        Some(h) => Ok(PathBuf::from(h).join(".kube/config")),
        None => Err(Error::InvalidArgument(
            "no kubeconfig path, $KUBECONFIG or $HOME".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_summaries() {
        let c = ClusterClient::connect("http://127.0.0.1:8080/prefix/", Some("t"), None)
            .expect("connect");
        assert_eq!(c.server(), "http://127.0.0.1:8080/prefix");
        assert!(format!("{c:?}").contains("<redacted>"));
        assert!(ClusterClient::connect("ftp://x", None, None).is_err());
        assert!(ClusterClient::connect("https://x:1", None, Some(b"junk")).is_err());
        let vm = serde_json::json!({
            "metadata": {"name": "a", "namespace": "ns"},
            "spec": {"running": false},
            "status": {"printableStatus": "Stopped", "ready": false}
        });
        let s = VmSummary::from_object(&vm);
        assert_eq!(s.run_strategy, "Halted");
        assert_eq!(s.status, "Stopped");
    }

    #[test]
    fn kubeconfig_errors_name_the_problem() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("kc");
        std::fs::write(&p, "apiVersion: v1\nkind: Config\ncontexts: []\n").expect("write");
        let e = ClusterClient::from_kubeconfig(Some(&p), None).expect_err("no context");
        assert!(e.to_string().contains("current-context"), "{e}");
        let e = ClusterClient::from_kubeconfig(Some(&p), Some("x")).expect_err("no such");
        assert!(
            e.to_string().contains("no contexts entry named \"x\""),
            "{e}"
        );
    }
}
