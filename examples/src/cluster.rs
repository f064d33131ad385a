// SPDX-License-Identifier: Apache-2.0
//! `sheaf cluster up`: a control plane (API server over TLS, controllers,
//! redb store) and N nodes (node agent + replica server processes, one
//! launcher process per VM) in one foreground process, until Ctrl-C or
//! SIGTERM.
//!
//! ```text
//!   <data>/store.redb  secret  admin.kubeconfig  pki/  tokens.json
//!   <data>/nodes/<node>/{replicas,launchers}/      per-node state
//!   <data>/sheaf.pid   <data>/cluster.log
//! ```
//!
//! The data directory survives: `up` again reopens the store, the nodes
//! serve their replicas again and VMs that should run are started again.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sheaf_orchestrator::api::{ApiServer, ApiServerConfig};
use sheaf_orchestrator::cluster::{LocalCluster, LocalClusterConfig, StoreKind};
use sheaf_orchestrator::resources::Node;
use sheaf_orchestrator::store::{ListOptions, StoreExt};
use tokio::sync::Mutex;

use crate::metrics::Metrics;
use crate::server::{ClusterState, routes};

/// Options of `sheaf cluster up`.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// Nodes.
    pub nodes: usize,
    /// Data directory.
    pub data_dir: PathBuf,
    /// API server address.
    pub listen: SocketAddr,
    /// Put every node in its own network namespace.
    pub netns: bool,
    /// How long a silent node stays Ready.
    pub node_grace: Duration,
    /// The launcher binary (`sheaf` itself serves `vm` and `replica`).
    pub launcher_bin: PathBuf,
}

/// Failures of `cluster up`.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    /// `--netns` cannot work in this build.
    #[error(
        "--netns is not available: node agents run inside the `sheaf cluster up` process \
         (LocalCluster), and a network namespace is per process, so the nodes cannot be \
         given their own namespaces; run without --netns (every node listens on 127.0.0.1)"
    )]
    NetnsUnsupported,
    /// Another `cluster up` uses the data directory.
    #[error(
        "a cluster (pid {pid}) is already running on {dir}; stop it first (Ctrl-C in its terminal or `kill {pid}`)"
    )]
    AlreadyRunning {
        /// Its pid.
        pid: i32,
        /// Data directory.
        dir: PathBuf,
    },
    /// File system.
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The cluster.
    #[error(transparent)]
    Cluster(#[from] sheaf_orchestrator::cluster::ClusterError),
    /// The API server.
    #[error("API server: {0}")]
    Api(#[from] sheaf_orchestrator::api::ApiServerError),
    /// Nodes did not become Ready.
    #[error("nodes not Ready after {0:?}: {1}")]
    NotReady(Duration, String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> UpError + '_ {
    move |source| UpError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Whether `pid` is a live process.
fn alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    pid > 0 && unsafe { libc::kill(pid, 0) } == 0
}

/// Takes the data directory's pid file (refuses if a live process holds it).
fn take_pid_file(dir: &Path) -> Result<PathBuf, UpError> {
    let pidf = dir.join("sheaf.pid");
    if let Ok(text) = std::fs::read_to_string(&pidf)
        && let Ok(pid) = text.trim().parse::<i32>()
        && pid != std::process::id() as i32
        && alive(pid)
    {
        return Err(UpError::AlreadyRunning {
            pid,
            dir: dir.to_path_buf(),
        });
    }
    std::fs::write(&pidf, std::process::id().to_string()).map_err(io_err(&pidf))?;
    Ok(pidf)
}

/// A started cluster (control plane, nodes, API server with the extra routes).
#[derive(Debug)]
pub struct Running {
    /// The cluster.
    pub cluster: Arc<Mutex<LocalCluster>>,
    /// API server.
    pub api: sheaf_orchestrator::api::RunningApiServer,
    /// Metrics.
    pub metrics: Metrics,
    pid_file: PathBuf,
    watch: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops the API server and every node (their launchers and replica
    /// processes get SIGKILL, like a power cut; the data stays).
    pub async fn shutdown(self) {
        self.watch.abort();
        self.api.shutdown().await;
        let c = Arc::try_unwrap(self.cluster);
        match c {
            Ok(m) => m.into_inner().shutdown().await,
            Err(arc) => {
                let mut g = arc.lock().await;
                for n in g.node_names() {
                    let _ = g.kill_node(&n);
                }
            }
        }
        let _ = std::fs::remove_file(&self.pid_file);
    }
}

/// Starts everything and waits until every node is Ready.
pub async fn start(opts: &UpOptions) -> Result<Running, UpError> {
    if opts.netns {
        return Err(UpError::NetnsUnsupported);
    }
    std::fs::create_dir_all(&opts.data_dir).map_err(io_err(&opts.data_dir))?;
    let pid_file = take_pid_file(&opts.data_dir)?;
    let mut cfg = LocalClusterConfig::new(&opts.data_dir, &opts.launcher_bin);
    cfg.nodes = opts.nodes;
    cfg.store = StoreKind::Redb;
    cfg.control.node_grace_period = opts.node_grace;
    let cluster = match LocalCluster::start(cfg).await {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_file(&pid_file);
            return Err(e.into());
        }
    };
    let store = cluster.store().clone();
    let metrics = Metrics::new(store.clone());
    let watch = metrics.spawn_scheduler_watch();
    let cluster = Arc::new(Mutex::new(cluster));
    let mut api_cfg = ApiServerConfig::new(&opts.data_dir);
    api_cfg.listen = opts.listen;
    api_cfg.extra_routes = Some(routes(ClusterState {
        store: store.clone(),
        cluster: cluster.clone(),
        metrics: metrics.clone(),
        data_dir: opts.data_dir.clone(),
    }));
    let api = match ApiServer::start(api_cfg, store.clone()).await {
        Ok(a) => a,
        Err(e) => {
            watch.abort();
            if let Ok(m) = Arc::try_unwrap(cluster) {
                m.into_inner().shutdown().await;
            }
            let _ = std::fs::remove_file(&pid_file);
            return Err(e.into());
        }
    };
    let running = Running {
        cluster,
        api,
        metrics,
        pid_file,
        watch,
    };
    // Every node Ready (fresh heartbeats).
    let t0 = Instant::now();
    let limit = Duration::from_secs(30);
    loop {
        let nodes: Vec<Node> = store
            .list_typed(None, &ListOptions::default())
            .await
            .unwrap_or_default();
        let not_ready: Vec<String> = {
            let names = running.cluster.lock().await.node_names();
            names
                .into_iter()
                .filter(|n| {
                    !nodes.iter().any(|x| {
                        x.metadata.name.as_deref() == Some(n.as_str())
                            && x.status
                                .as_ref()
                                .and_then(|s| s.conditions.as_ref())
                                .is_some_and(|c| {
                                    c.iter().any(|c| {
                                        c.type_ == "Ready"
                                            && c.status
                                                == sheaf_orchestrator::resources::ConditionStatus::True
                                    })
                                })
                    })
                })
                .collect()
        };
        if not_ready.is_empty() {
            break;
        }
        if t0.elapsed() > limit {
            let msg = not_ready.join(", ");
            running.shutdown().await;
            return Err(UpError::NotReady(limit, msg));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(running)
}

/// Waits for Ctrl-C (SIGINT) or SIGTERM.
pub async fn wait_for_signal() -> std::io::Result<&'static str> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    Ok(tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
        _ = hup.recv() => "SIGHUP",
    })
}
