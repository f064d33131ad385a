// SPDX-License-Identifier: Apache-2.0
//! A Kubernetes-compatible HTTPS API over a [`Store`], so `kubectl`, client-go,
//! kube-rs and the Python client work against sheaf.
//!
//! ```text
//!   TCP ─► rustls (h2 / http1.1) ─► hyper ─► axum Router
//!            ├─ /healthz /livez /readyz                 (no auth)
//!            ├─ /ui/ dashboard assets (ui/)            (no auth; its data calls need a token)
//!            └─ auth (bearer token → admin | read-only) ─► handlers::dispatch
//!                 ├─ discovery: /api /apis /apis/<g>/<v> /version /openapi/v3
//!                 └─ resources: list/watch/get/create/update/patch/delete(+collection), /status
//! ```
//!
//! [`ApiServer::start`] generates (first start) or loads the CA, server
//! certificate and tokens in the data directory and writes `admin.kubeconfig`.
//! See `docs/api.md` for what is served and how it differs from Kubernetes.

mod auth;
pub mod discovery;
mod handlers;
pub mod patch;
pub mod ratelimit;
mod status;
pub mod table;
pub mod tls;
pub mod ui;
mod watch;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::watch as tokio_watch;
use tokio::task::JoinSet;

pub use auth::{Role, role_of};
pub use handlers::{SYSTEM_NAMESPACES, decode_request, patch_and_validate};
pub use status::ApiError;
pub use tls::{TlsMaterial, TlsSetupError, Tokens};

use crate::resources::Registry;
use crate::store::{GroupKind, Store, StoreError};

/// Default request body limit (Kubernetes uses 3 MiB).
pub const DEFAULT_MAX_BODY: usize = 3 << 20;

/// Configuration of the API server.
#[derive(Debug, Clone)]
pub struct ApiServerConfig {
    /// Directory for TLS material, tokens and the kubeconfig.
    pub data_dir: PathBuf,
    /// Listen address (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Extra certificate names (DNS names or IPs) besides localhost.
    pub extra_sans: Vec<String>,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// How often watches with `allowWatchBookmarks` get a bookmark.
    pub bookmark_interval: Duration,
    /// Watch length when the client gives no `timeoutSeconds`.
    pub watch_timeout: Duration,
    /// Accept the read-only token.
    pub readonly_token: bool,
    /// More routes served next to the Kubernetes API, behind the same
    /// authentication (e.g. `/metrics` and subresources of the cluster binary).
    pub extra_routes: Option<Router>,
    /// Time a client has to complete the TLS handshake and then each
    /// request's headers (also how long an idle keep-alive connection
    /// stays open): a slowloris client is dropped after it.
    pub header_read_timeout: Duration,
    /// Open connections at most; beyond it new ones are closed at once
    /// (and logged), so a flood cannot exhaust the server's descriptors.
    pub max_connections: usize,
    /// Per-client (per IP address) request rate and failed-authentication
    /// limits; see [`ratelimit::RateLimits`].
    pub rate_limits: ratelimit::RateLimits,
}

impl ApiServerConfig {
    /// Defaults for a data directory: `127.0.0.1:6443`, 3 MiB bodies,
    /// 10 s bookmarks, 30 min watches, read-only token on.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 6443)),
            extra_sans: Vec::new(),
            max_body_bytes: DEFAULT_MAX_BODY,
            bookmark_interval: Duration::from_secs(10),
            watch_timeout: Duration::from_secs(1800),
            readonly_token: true,
            extra_routes: None,
            header_read_timeout: Duration::from_secs(10),
            max_connections: 4096,
            rate_limits: ratelimit::RateLimits::default(),
        }
    }
}

/// Failures starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    /// TLS, tokens or kubeconfig.
    #[error(transparent)]
    Setup(#[from] TlsSetupError),
    /// Binding the listen address.
    #[error("binding {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
    /// Creating the data directory.
    #[error("data directory {path}: {source}")]
    DataDir {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Creating the system namespaces.
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

/// Shared state of the handlers.
#[derive(Clone, Debug)]
pub struct ApiState {
    /// The store served.
    pub store: Arc<dyn Store>,
    /// The kinds served.
    pub registry: Arc<Registry>,
    openapi: Arc<discovery::OpenApiDocs>,
    tokens: Arc<Tokens>,
    readonly_enabled: bool,
    max_body: usize,
    bookmark_interval: Duration,
    watch_timeout: Duration,
    limiter: Arc<ratelimit::ClientLimiter>,
}

impl ApiState {
    /// State for `store` with the default registry.
    pub fn new(store: Arc<dyn Store>, tokens: Tokens, config: &ApiServerConfig) -> Self {
        let registry = Arc::new(Registry::default());
        Self {
            openapi: Arc::new(discovery::OpenApiDocs::build(&registry)),
            registry,
            store,
            tokens: Arc::new(tokens),
            readonly_enabled: config.readonly_token,
            max_body: config.max_body_bytes,
            bookmark_interval: config.bookmark_interval,
            watch_timeout: config.watch_timeout,
            limiter: Arc::new(ratelimit::ClientLimiter::new(config.rate_limits)),
        }
    }
}

/// The HTTP application (without TLS): useful for in-process tests and fuzzing.
pub fn router(state: ApiState) -> Router {
    router_with(state, Router::new())
}

/// [`router`] plus `extra` routes (they take precedence over the Kubernetes
/// API paths and share its authentication).
pub fn router_with(state: ApiState, extra: Router) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }))
        .fallback(handlers::dispatch)
        .with_state(state.clone())
        .merge(ui::routes())
        .merge(extra)
        .layer(axum::middleware::from_fn_with_state(
            state,
            auth::authenticate,
        ))
}

/// Creates the system namespaces if missing.
pub async fn ensure_system_namespaces(store: &dyn Store) -> Result<(), StoreError> {
    let gk = GroupKind::new("", "Namespace");
    for ns in SYSTEM_NAMESPACES {
        let obj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}, "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}});
        match store.create(&gk, "", obj).await {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The API server.
#[derive(Debug)]
pub struct ApiServer;

/// A running server; dropping it does not stop it, call [`RunningApiServer::shutdown`].
#[derive(Debug)]
pub struct RunningApiServer {
    /// Bound address.
    pub addr: SocketAddr,
    /// `https://...` URL.
    pub url: String,
    /// Path of the admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// Tokens in use.
    pub tokens: Tokens,
    /// CA certificate (PEM) clients must trust.
    pub ca_pem: String,
    stop: tokio_watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl RunningApiServer {
    /// Stops accepting, closes open connections and waits for the accept loop.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

impl ApiServer {
    /// Prepares TLS, tokens, the kubeconfig and the system namespaces, then
    /// serves `store` on `config.listen` until [`RunningApiServer::shutdown`].
    pub async fn start(
        config: ApiServerConfig,
        store: Arc<dyn Store>,
    ) -> Result<RunningApiServer, ApiServerError> {
        let dir = config.data_dir.clone();
        std::fs::create_dir_all(&dir).map_err(|source| ApiServerError::DataDir {
            path: dir.clone(),
            source,
        })?;
        let tls = TlsMaterial::load_or_create(&dir, &config.extra_sans)?;
        let tokens = Tokens::load_or_create(&dir)?;
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| ApiServerError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ApiServerError::Bind {
                addr: config.listen,
                source,
            })?;
        let host = if addr.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else if addr.is_ipv6() {
            format!("[{}]", addr.ip())
        } else {
            addr.ip().to_string()
        };
        let url = format!("https://{host}:{}", addr.port());
        let kubeconfig = tls::write_kubeconfig(&dir, &url, &tls.ca_pem, &tokens)?;
        ensure_system_namespaces(store.as_ref()).await?;
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config()?);
        let extra = config.extra_routes.clone().unwrap_or_default();
        let header_read_timeout = config.header_read_timeout;
        let max_connections = config.max_connections;
        let app = router_with(ApiState::new(store, tokens.clone(), &config), extra);
        let (stop, mut stopped) = tokio_watch::channel(false);
        let task = tokio::spawn(async move {
            let mut conns = JoinSet::new();
            let mut backoff = sheaf_blockrepl::net::accept::AcceptBackoff::new();
            let slots = Arc::new(tokio::sync::Semaphore::new(max_connections.max(1)));
            let mut refused: u64 = 0;
            loop {
                tokio::select! {
                    _ = stopped.changed() => break,
                    accepted = listener.accept() => {
                        let (tcp, peer) = match accepted {
                            Ok(x) => {
                                backoff.reset();
                                x
                            }
                            Err(e) => {
                                if backoff.handle("api", &e).await {
                                    continue;
                                }
                                break;
                            }
                        };
                        let Ok(slot) = slots.clone().try_acquire_owned() else {
                            // Full: close it now (RST-free close; the client retries).
                            refused += 1;
                            if refused.is_power_of_two() {
                                tracing::warn!(%peer, refused, max_connections, "connection limit reached; refusing connections");
                            }
                            drop(tcp);
                            continue;
                        };
                        let acceptor = acceptor.clone();
                        let app = app.clone();
                        conns.spawn(async move {
                            let _slot = slot;
                            let _ = tcp.set_nodelay(true);
                            let tls = match tokio::time::timeout(header_read_timeout, acceptor.accept(tcp)).await {
                                Ok(Ok(s)) => s,
                                Ok(Err(e)) => {
                                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                    return;
                                }
                                Err(_) => return,
                            };
                            let client = ratelimit::ClientAddr(peer.ip());
                            let svc = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                                req.extensions_mut().insert(client);
                                tower::ServiceExt::oneshot(app.clone(), req)
                            });
                            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                            builder
                                .http1()
                                .timer(TokioTimer::new())
                                .header_read_timeout(header_read_timeout);
                            if let Err(e) = builder.serve_connection(TokioIo::new(tls), svc).await {
                                tracing::debug!(%peer, error = %e, "connection ended with an error");
                            }
                        });
                        while conns.try_join_next().is_some() {}
                    }
                }
            }
            conns.shutdown().await;
        });
        tracing::info!(%url, kubeconfig = %kubeconfig.display(), "API server listening");
        Ok(RunningApiServer {
            addr,
            url,
            kubeconfig,
            tokens,
            ca_pem: tls.ca_pem,
            stop,
            task,
        })
    }
}

/// Path of the admin kubeconfig inside a data directory.
pub fn kubeconfig_path(data_dir: &Path) -> PathBuf {
    data_dir.join("admin.kubeconfig")
}
