// SPDX-License-Identifier: Apache-2.0
//! `sheaf control-plane up`: one control plane of a highly available
//! cluster on an etcd cluster. Every control plane serves the Kubernetes
//! API; the one holding the `kube-system/sheaf-controller-manager` Lease
//! runs the controllers and the volume source importer.
//!
//! ```text
//!   DATA/                      shared by the control planes of one machine
//!   ├─ pki/ tokens.json secret   created once (under DATA/.credentials.lock)
//!   └─ control-planes/<name>/    this control plane: its copy of pki/ and
//!                                tokens.json, admin.kubeconfig (its URL)
//! ```
//!
//! Control planes on other hosts need the same `pki/`, `tokens.json` and
//! `secret`: copy them into their data directories before the first start
//! (the server certificate names `localhost`, the loopback addresses and
//! every `--san`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sheaf_orchestrator::api::{ApiServerConfig, TlsMaterial, Tokens};
use sheaf_orchestrator::cluster::ensure_secret;
use sheaf_orchestrator::controllers::{
    ControlPlane, ControlPlaneConfig, ControlPlaneError, LeaderElectionConfig,
};
use sheaf_orchestrator::images::ImagePolicy;
use sheaf_orchestrator::names;
use sheaf_orchestrator::store::{EtcdConfig, EtcdStore, Store};

use crate::metrics::Metrics;
use crate::sources::SourceImporter;

/// Options of `sheaf control-plane up`.
#[derive(Debug, Clone)]
pub struct ControlPlaneOptions {
    /// This control plane's name (a DNS label; also its election identity
    /// prefix and its directory under `control-planes/`).
    pub name: String,
    /// Data directory holding the shared credentials.
    pub data_dir: PathBuf,
    /// etcd client URLs.
    pub etcd: Vec<String>,
    /// Key prefix in etcd (several clusters can share one etcd).
    pub etcd_prefix: String,
    /// API server address.
    pub listen: SocketAddr,
    /// Extra names in the server certificate (first start only).
    pub sans: Vec<String>,
    /// How long a silent node stays Ready.
    pub node_grace: Duration,
    /// Leader election timings.
    pub lease_duration: Duration,
    /// See [`LeaderElectionConfig::renew_deadline`].
    pub renew_deadline: Duration,
    /// See [`LeaderElectionConfig::retry_period`].
    pub retry_period: Duration,
    /// Extra image directories, besides `<data>/images` and `<data>/uploads`.
    pub image_dirs: Vec<PathBuf>,
}

impl ControlPlaneOptions {
    /// Defaults: kube-controller-manager's election timings (15 s / 10 s /
    /// 2 s), a 40 s node grace period, `/sheaf/` in etcd.
    pub fn new(name: &str, data_dir: &Path, etcd: Vec<String>, listen: SocketAddr) -> Self {
        ControlPlaneOptions {
            name: name.to_string(),
            data_dir: data_dir.to_path_buf(),
            etcd,
            etcd_prefix: "/sheaf/".into(),
            listen,
            sans: Vec::new(),
            node_grace: Duration::from_secs(40),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            image_dirs: Vec::new(),
        }
    }
}

/// Failures of `control-plane up`.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneUpError {
    /// Bad options.
    #[error("{0}")]
    Invalid(String),
    /// Files of the data directory.
    #[error("{path}: {message}")]
    Files {
        /// File.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// etcd.
    #[error("etcd {endpoints}: {message}")]
    Etcd {
        /// The endpoints tried.
        endpoints: String,
        /// Why.
        message: String,
    },
    /// The control plane.
    #[error(transparent)]
    Control(#[from] ControlPlaneError),
}

/// A running control plane.
#[derive(Debug)]
pub struct RunningControlPlane {
    /// API server, controllers and election.
    pub control: ControlPlane,
    /// This control plane's kubeconfig.
    pub kubeconfig: PathBuf,
    /// Its API URL.
    pub url: String,
    importer: tokio::task::JoinHandle<()>,
}

impl RunningControlPlane {
    /// Stops serving; a leader stops its controllers and releases the Lease.
    pub async fn shutdown(self) {
        self.importer.abort();
        self.control.shutdown().await;
    }
}

fn files(path: &Path) -> impl FnOnce(String) -> ControlPlaneUpError + '_ {
    move |message| ControlPlaneUpError::Files {
        path: path.to_path_buf(),
        message,
    }
}

/// Creates the shared CA, server certificate, tokens and replication secret
/// once, under an exclusive lock so control planes starting together agree;
/// returns the replication secret.
fn ensure_credentials(
    data_dir: &Path,
    sans: &[String],
) -> Result<sheaf_blockrepl::net::Secret, ControlPlaneUpError> {
    use std::os::fd::AsRawFd;
    let lock_path = data_dir.join(".credentials.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| files(&lock_path)(e.to_string()))?;
    // SAFETY: flock on a descriptor this function owns; released on close.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(files(&lock_path)(
            std::io::Error::last_os_error().to_string(),
        ));
    }
    TlsMaterial::load_or_create(data_dir, sans).map_err(|e| files(data_dir)(e.to_string()))?;
    Tokens::load_or_create(data_dir).map_err(|e| files(data_dir)(e.to_string()))?;
    let secret =
        ensure_secret(&data_dir.join("secret")).map_err(|e| files(data_dir)(e.to_string()))?;
    drop(lock);
    Ok(secret)
}

/// Copies the shared credentials into this control plane's directory
/// (0600 for keys and tokens) unless it has them already.
fn copy_credentials(shared: &Path, own: &Path) -> Result<(), ControlPlaneUpError> {
    for rel in [
        "pki/ca.crt",
        "pki/server.crt",
        "pki/server.key",
        "tokens.json",
    ] {
        let (src, dst) = (shared.join(rel), own.join(rel));
        if dst.exists() {
            continue;
        }
        let data = std::fs::read(&src).map_err(|e| files(&src)(e.to_string()))?;
        if let Some(p) = dst.parent() {
            std::fs::create_dir_all(p).map_err(|e| files(p)(e.to_string()))?;
        }
        sheaf_orchestrator::api::tls::write_private(&dst, &data)
            .map_err(|e| files(&dst)(e.to_string()))?;
    }
    Ok(())
}

fn metrics_routes(metrics: Metrics) -> Router {
    async fn render(State(m): State<Metrics>) -> Response {
        (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            m.render().await,
        )
            .into_response()
    }
    Router::new()
        .route("/metrics", get(render))
        .with_state(metrics)
}

/// Connects to etcd, then starts the API server and campaigns for the
/// controller Lease.
pub async fn start(opts: &ControlPlaneOptions) -> Result<RunningControlPlane, ControlPlaneUpError> {
    if !names::is_dns_label(&opts.name) {
        return Err(ControlPlaneUpError::Invalid(format!(
            "control plane name {:?} must be a lowercase RFC 1123 label",
            opts.name
        )));
    }
    if opts.etcd.is_empty() {
        return Err(ControlPlaneUpError::Invalid(
            "--etcd needs at least one endpoint".into(),
        ));
    }
    let le = LeaderElectionConfig {
        identity: format!(
            "{}_{}",
            opts.name,
            sheaf_orchestrator::controllers::leader::default_identity()
        ),
        lease_duration: opts.lease_duration,
        renew_deadline: opts.renew_deadline,
        retry_period: opts.retry_period,
        ..LeaderElectionConfig::new()
    };
    le.validate().map_err(ControlPlaneUpError::Invalid)?;
    let dd = &opts.data_dir;
    std::fs::create_dir_all(dd).map_err(|e| files(dd)(e.to_string()))?;
    let secret = ensure_credentials(dd, &opts.sans)?;
    let own = names::child(&dd.join("control-planes"), &opts.name)
        .map_err(|e| ControlPlaneUpError::Invalid(e.to_string()))?;
    copy_credentials(dd, &own)?;

    let mut ecfg = EtcdConfig::new(opts.etcd.clone());
    ecfg.prefix = opts.etcd_prefix.clone();
    let store: Arc<dyn Store> =
        Arc::new(
            EtcdStore::connect(ecfg)
                .await
                .map_err(|e| ControlPlaneUpError::Etcd {
                    endpoints: opts.etcd.join(","),
                    message: e.to_string(),
                })?,
        );
    let metrics = Metrics::new(store.clone());
    let mut api = ApiServerConfig::new(&own);
    api.listen = opts.listen;
    api.extra_sans = opts.sans.clone();
    api.extra_routes = Some(metrics_routes(metrics.clone()));
    let control = ControlPlaneConfig {
        node_grace_period: opts.node_grace,
        replication_secret: Some(secret),
        api: Some(api),
        leader_election: Some(le),
        ..Default::default()
    };
    let control = ControlPlane::start(control, store.clone()).await?;
    let (url, kubeconfig) = match control.api() {
        Some(a) => (a.url.clone(), a.kubeconfig.clone()),
        None => (String::new(), PathBuf::new()),
    };
    // The importer fills Volumes from their sources: leader only.
    let mut roots = vec![dd.join("images"), dd.join("uploads")];
    roots.extend(opts.image_dirs.iter().cloned());
    let images = ImagePolicy::new(roots, vec![dd.clone()]);
    let importer = SourceImporter {
        store: store.clone(),
        secret_file: dd.join("secret"),
        tmp_dir: own.join("tmp"),
        metrics,
        images,
        limits: Default::default(),
    };
    let mut leading = control
        .election()
        .map(|e| e.subscribe())
        .ok_or_else(|| ControlPlaneUpError::Invalid("no leader election".into()))?;
    let importer = tokio::spawn(async move {
        let mut running: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            let lead = leading.borrow_and_update().leading;
            match (lead, running.is_some()) {
                (true, false) => running = Some(importer.clone().spawn()),
                (false, true) => {
                    if let Some(t) = running.take() {
                        t.abort();
                    }
                }
                _ => {}
            }
            if leading.changed().await.is_err() {
                break;
            }
        }
        if let Some(t) = running {
            t.abort();
        }
    });
    Ok(RunningControlPlane {
        control,
        kubeconfig,
        url,
        importer,
    })
}

/// `sheaf control-plane up` in the foreground: starts, prints where the API
/// is, prints every change of the Lease holder, and on SIGTERM/SIGINT stops
/// (a leader releases the Lease so another takes over at once).
pub async fn run_foreground(opts: ControlPlaneOptions) -> anyhow::Result<()> {
    let cp = start(&opts).await?;
    println!("control plane {} serving {}", opts.name, cp.url);
    println!("  kubeconfig: {}", cp.kubeconfig.display());
    println!(
        "  etcd: {} (prefix {})",
        opts.etcd.join(","),
        opts.etcd_prefix
    );
    if let Some(e) = cp.control.election() {
        println!("  identity: {}", e.identity());
    }
    println!("SIGTERM or Ctrl-C stops this control plane");
    let mut status = cp
        .control
        .election()
        .map(|e| e.subscribe())
        .ok_or_else(|| anyhow::anyhow!("no leader election"))?;
    let follow = tokio::spawn(async move {
        let mut last: Option<(bool, String)> = None;
        loop {
            let s = status.borrow_and_update().clone();
            let now = (s.leading, s.holder.clone());
            if last.as_ref() != Some(&now) {
                if s.leading {
                    println!("leading: this control plane runs the controllers");
                } else if s.holder.is_empty() {
                    println!("following: no leader yet");
                } else {
                    println!("following: leader is {}", s.holder);
                }
                last = Some(now);
            }
            if status.changed().await.is_err() {
                break;
            }
        }
    });
    let why = crate::cluster::wait_for_signal().await?;
    println!("{why}: stopping control plane {}", opts.name);
    follow.abort();
    cp.shutdown().await;
    println!("control plane {} stopped", opts.name);
    Ok(())
}
