// SPDX-License-Identifier: Apache-2.0
//! `sheaf cluster up`: a control plane (API server over TLS, controllers,
//! redb store) and N nodes (node agent + replica server processes, one
//! launcher process per VM) in one foreground process, until Ctrl-C or
//! SIGTERM. With `--netns` each node is its own process tree (`sheaf
//! agent`) in its own network namespace (see [`crate::netns`]); without it
//! the agents run inside the `up` process on 127.0.0.1.
//!
//! ```text
//!   <data>/store.redb  secret  admin.kubeconfig  pki/  tokens.json
//!   <data>/nodes/<node>/{replicas,launchers}/      per-node state (+ agent.log with --netns)
//!   <data>/sheaf.pid   <data>/cluster.log
//!   <data>/netns.json  agent.kubeconfig            --netns: the node subnet, the agents' kubeconfig
//! ```
//!
//! The data directory survives: `up` again reopens the store, the nodes
//! serve their replicas again and VMs that should run are started again.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sheaf_orchestrator::api::{ApiServer, ApiServerConfig};
use sheaf_orchestrator::cluster::{ClusterError, LocalCluster, LocalClusterConfig, StoreKind};
use sheaf_orchestrator::resources::Node;
use sheaf_orchestrator::store::{ListOptions, Store, StoreExt};
use tokio::sync::Mutex;

use std::io::Write as _;

use crate::client::ApiClient;
use crate::metrics::Metrics;
use crate::netns::{NetnsError, NetnsNodes, Network};
use crate::server::{ClusterState, routes};
use crate::status::{Snapshot, render};

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
    /// The launcher binary (`sheaf` itself serves `vm`, `replica` and `agent`).
    pub launcher_bin: PathBuf,
    /// Extra image directories (`--image-dir`), besides `<data>/images`.
    pub image_dirs: Vec<PathBuf>,
}

/// Failures of `cluster up`.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
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
    Cluster(#[from] ClusterError),
    /// The node network or node processes (`--netns`).
    #[error(transparent)]
    Netns(#[from] NetnsError),
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

/// Node operations that failed.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// No such node.
    #[error("node {name:?} not found (nodes: {nodes})")]
    NoNode {
        /// Asked for.
        name: String,
        /// Known nodes.
        nodes: String,
    },
    /// Kill of a node that is down.
    #[error("node {0} is already down")]
    AlreadyDown(String),
    /// In-process nodes.
    #[error(transparent)]
    Local(#[from] ClusterError),
    /// Node processes.
    #[error(transparent)]
    Netns(#[from] NetnsError),
}

/// The control plane and the nodes: agents in process, or (`--netns`) one
/// process tree per node in its own network namespace.
#[derive(Debug)]
pub struct Cluster {
    local: LocalCluster,
    netns: Option<NetnsNodes>,
}

impl Cluster {
    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        self.local.store()
    }

    /// Node names.
    pub fn node_names(&self) -> Vec<String> {
        match &self.netns {
            Some(n) => n.node_names(),
            None => self.local.node_names(),
        }
    }

    /// A node's data directory (launchers, replicas).
    pub fn node_dir(&self, name: &str) -> PathBuf {
        self.local.node_dir(name)
    }

    /// The data directory of a node named from outside (see
    /// [`LocalCluster::known_node_dir`](sheaf_orchestrator::cluster::LocalCluster::known_node_dir)).
    /// With `--netns` the nodes are processes outside the in-process
    /// cluster, so membership is checked against [`Cluster::node_names`].
    pub fn known_node_dir(&self, name: &str) -> Option<PathBuf> {
        if !self.node_names().iter().any(|n| n == name) {
            return None;
        }
        let dir = self.local.node_dir(name);
        sheaf_orchestrator::names::ensure_child(dir.parent()?, &dir)
            .ok()
            .map(|()| dir)
    }

    /// The replication secret file.
    pub fn secret_file(&self) -> &Path {
        self.local.secret_file()
    }

    /// The node processes (`--netns`).
    pub fn netns(&self) -> Option<&NetnsNodes> {
        self.netns.as_ref()
    }

    /// Whether node `name` runs (was not killed).
    pub fn is_up(&self, name: &str) -> bool {
        match &self.netns {
            Some(n) => n.is_up(name),
            None => self.local.agent(name).is_some(),
        }
    }

    fn check(&self, name: &str) -> Result<(), NodeError> {
        let names = self.node_names();
        if names.iter().any(|n| n == name) {
            Ok(())
        } else {
            Err(NodeError::NoNode {
                name: name.into(),
                nodes: names.join(", "),
            })
        }
    }

    /// Kills node `name` like a power cut (SIGKILL to its processes).
    pub fn kill_node(&mut self, name: &str) -> Result<(), NodeError> {
        self.check(name)?;
        if !self.is_up(name) {
            return Err(NodeError::AlreadyDown(name.into()));
        }
        match &mut self.netns {
            Some(n) => {
                n.kill(name)?;
            }
            None => self.local.kill_node(name)?,
        }
        Ok(())
    }

    /// Starts node `name` again on its data (an agent restart if it runs).
    pub async fn restart_node(&mut self, name: &str) -> Result<(), NodeError> {
        self.check(name)?;
        match &mut self.netns {
            Some(n) => {
                n.start(name).await?;
            }
            None => self.local.restart_node(name).await?,
        }
        Ok(())
    }

    /// Stops every node and the control plane; returns what is left of the
    /// node network (empty: nothing).
    pub async fn shutdown(mut self) -> Vec<String> {
        let left = match &mut self.netns {
            Some(n) => n.shutdown(),
            None => Vec::new(),
        };
        self.local.shutdown().await;
        left
    }
}

/// A started cluster (control plane, nodes, API server with the extra routes).
#[derive(Debug)]
pub struct Running {
    /// The cluster.
    pub cluster: Arc<Mutex<Cluster>>,
    /// API server.
    pub api: sheaf_orchestrator::api::RunningApiServer,
    /// Metrics.
    pub metrics: Metrics,
    pid_file: PathBuf,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Stops the API server and every node (their launchers and replica
    /// processes get SIGKILL, like a power cut; the data stays). Returns
    /// what could not be removed of the node network (`--netns`).
    pub async fn shutdown(self) -> Vec<String> {
        for t in &self.tasks {
            t.abort();
        }
        self.api.shutdown().await;
        let left = match Arc::try_unwrap(self.cluster) {
            Ok(m) => m.into_inner().shutdown().await,
            Err(arc) => {
                let mut g = arc.lock().await;
                for n in g.node_names() {
                    let _ = g.kill_node(&n);
                }
                match &mut g.netns {
                    Some(n) => n.shutdown(),
                    None => Vec::new(),
                }
            }
        };
        let _ = std::fs::remove_file(&self.pid_file);
        left
    }
}

/// Drops `<data>/pki` if its server certificate does not name `ip`, so the
/// API server issues a new CA and certificate that do (`admin.kubeconfig`
/// is rewritten with the new CA at every start; tokens are kept).
fn ensure_cert_names(data_dir: &Path, ip: std::net::Ipv4Addr) -> Result<(), UpError> {
    let pki = data_dir.join("pki");
    let cert = pki.join("server.crt");
    let Ok(pem) = std::fs::read_to_string(&cert) else {
        return Ok(());
    };
    if !crate::netns::cert_names_ip(&pem, ip) {
        tracing::info!(%ip, "the API server certificate does not name the node gateway; issuing a new one");
        std::fs::remove_dir_all(&pki).map_err(io_err(&pki))?;
    }
    Ok(())
}

/// Reaps zombies re-parented to this process (the subreaper) that are not
/// node agents (those are waited for by their supervisors).
fn spawn_reaper(cluster: Arc<Mutex<Cluster>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let me = std::process::id() as i32;
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let agents: Vec<i32> = {
                let g = cluster.lock().await;
                let names = g.node_names();
                g.netns()
                    .map(|n| {
                        names
                            .iter()
                            .filter_map(|x| n.agent_pid(x))
                            .map(|p| p as i32)
                            .collect()
                    })
                    .unwrap_or_default()
            };
            for (pid, state, ppid) in proc_children() {
                if ppid == me && state == "Z" && !agents.contains(&pid) {
                    // SAFETY: reaping an exited child of ours; no memory is touched.
                    unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
                }
            }
        }
    })
}

/// `(pid, state, ppid)` of every process.
pub fn proc_children() -> Vec<(i32, String, i32)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some(rest) = stat.rsplit_once(')').map(|x| x.1) else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let state = f.next().unwrap_or("").to_string();
        let ppid: i32 = f.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        v.push((pid, state, ppid));
    }
    v
}

/// Lease holders of the nodes now (an agent that starts takes a new one).
async fn lease_holders(store: &Arc<dyn Store>) -> BTreeMap<String, String> {
    let nodes: Vec<Node> = store
        .list_typed(None, &ListOptions::default())
        .await
        .unwrap_or_default();
    nodes
        .into_iter()
        .filter_map(|n| {
            let holder = n.status.as_ref()?.lease.as_ref()?.holder_identity.clone();
            Some((n.metadata.name?, holder))
        })
        .collect()
}

/// Starts everything and waits until every node is Ready.
pub async fn start(opts: &UpOptions) -> Result<Running, UpError> {
    std::fs::create_dir_all(&opts.data_dir).map_err(io_err(&opts.data_dir))?;
    let pid_file = take_pid_file(&opts.data_dir)?;
    let net = if opts.netns {
        let prepared = Network::plan(&opts.data_dir, opts.nodes).and_then(|n| {
            n.create()?;
            Ok(n)
        });
        match prepared {
            Ok(n) => Some(n),
            Err(e) => {
                let _ = std::fs::remove_file(&pid_file);
                return Err(e.into());
            }
        }
    } else {
        None
    };
    let res = start_inner(opts, net.clone(), pid_file.clone()).await;
    if res.is_err() {
        if let Some(n) = &net {
            let _ = n.destroy();
        }
        let _ = std::fs::remove_file(&pid_file);
    }
    res
}

async fn start_inner(
    opts: &UpOptions,
    net: Option<Network>,
    pid_file: PathBuf,
) -> Result<Running, UpError> {
    if let Some(n) = &net {
        crate::netns::become_subreaper();
        ensure_cert_names(&opts.data_dir, n.gateway)?;
    }
    let mut cfg = LocalClusterConfig::new(&opts.data_dir, &opts.launcher_bin);
    // With --netns the nodes are separate processes, not in-process agents.
    cfg.nodes = if net.is_some() { 0 } else { opts.nodes };
    cfg.store = StoreKind::Redb;
    cfg.control.node_grace_period = opts.node_grace;
    cfg.image_dirs = opts.image_dirs.clone();
    let images = cfg.image_policy();
    for d in images.roots().iter().take(2) {
        std::fs::create_dir_all(d).map_err(|source| UpError::Io {
            path: d.clone(),
            source,
        })?;
    }
    let local = LocalCluster::start(cfg).await?;
    let store = local.store().clone();
    let metrics = Metrics::new(store.clone()).with_nodes_dir(opts.data_dir.join("nodes"));
    let mut tasks = vec![
        metrics.spawn_scheduler_watch(),
        crate::sources::SourceImporter {
            store: store.clone(),
            secret_file: local.secret_file().to_path_buf(),
            tmp_dir: opts.data_dir.join("tmp"),
            metrics: metrics.clone(),
            images: images.clone(),
            limits: Default::default(),
        }
        .spawn(),
    ];
    let mut api_cfg = ApiServerConfig::new(&opts.data_dir);
    api_cfg.listen = opts.listen;
    if let Some(n) = &net {
        api_cfg.extra_sans = vec![n.gateway.to_string()];
    }
    let cluster = Arc::new(Mutex::new(Cluster { local, netns: None }));
    api_cfg.extra_routes = Some(routes(ClusterState {
        store: store.clone(),
        cluster: cluster.clone(),
        metrics: metrics.clone(),
        data_dir: opts.data_dir.clone(),
        images,
    }));
    let api = match ApiServer::start(api_cfg, store.clone()).await {
        Ok(a) => a,
        Err(e) => {
            for t in &tasks {
                t.abort();
            }
            if let Ok(m) = Arc::try_unwrap(cluster) {
                m.into_inner().shutdown().await;
            }
            return Err(e.into());
        }
    };
    let mut running = Running {
        cluster,
        api,
        metrics,
        pid_file,
        tasks: Vec::new(),
    };
    running.tasks.append(&mut tasks);
    let before = lease_holders(&store).await;
    if let Some(n) = net
        && let Err(e) = start_node_processes(&mut running, opts, n).await
    {
        running.shutdown().await;
        return Err(e);
    }
    // Every node Ready with a lease of its new agent.
    let t0 = Instant::now();
    let limit = Duration::from_secs(60);
    loop {
        let nodes: Vec<Node> = store
            .list_typed(None, &ListOptions::default())
            .await
            .unwrap_or_default();
        let netns = running.cluster.lock().await.netns.is_some();
        let not_ready: Vec<String> = {
            let names = running.cluster.lock().await.node_names();
            names
                .into_iter()
                .filter(|n| {
                    !nodes.iter().any(|x| {
                        let fresh = !netns
                            || x.status
                                .as_ref()
                                .and_then(|s| s.lease.as_ref())
                                .is_some_and(|l| before.get(n) != Some(&l.holder_identity));
                        x.metadata.name.as_deref() == Some(n.as_str())
                            && fresh
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

/// `--netns`: the API server proxy on the bridge, the agents' kubeconfig,
/// one `sheaf agent` process per node in its namespace.
async fn start_node_processes(
    running: &mut Running,
    opts: &UpOptions,
    net: Network,
) -> Result<(), UpError> {
    let api_addr = running.api.addr;
    let port = api_addr.port();
    if !api_addr.ip().is_unspecified() {
        // The agents reach the API server through the bridge address.
        let listen = SocketAddr::from((net.gateway, port));
        let proxy = crate::netns::spawn_proxy(listen, api_addr)
            .await
            .map_err(io_err(Path::new(&listen.to_string())))?;
        running.tasks.push(proxy);
    }
    let kubeconfig = opts.data_dir.join("agent.kubeconfig");
    crate::netns::write_agent_kubeconfig(
        &kubeconfig,
        &format!("https://{}:{port}", net.gateway),
        &running.api.ca_pem,
        &running.api.tokens.admin,
    )?;
    let mut g = running.cluster.lock().await;
    let configs = net
        .nodes
        .iter()
        .map(|n| (n.name.clone(), g.local.agent_config(&n.name)))
        .collect();
    let mut nodes = NetnsNodes::new(net, opts.launcher_bin.clone(), kubeconfig, configs);
    for name in nodes.node_names() {
        nodes.start(&name).await?;
    }
    g.netns = Some(nodes);
    drop(g);
    running.tasks.push(spawn_reaper(running.cluster.clone()));
    Ok(())
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

/// `sheaf cluster up`: starts the cluster, prints where it is and what runs,
/// and stops it on SIGINT/SIGTERM, checking no child process is left.
pub async fn run_foreground(opts: UpOptions) -> anyhow::Result<()> {
    let t0 = Instant::now();
    println!(
        "Starting sheaf: control plane + {} node{} (data in {})",
        opts.nodes,
        if opts.nodes == 1 { "" } else { "s" },
        opts.data_dir.display()
    );
    let running = start(&opts).await?;
    let kubeconfig = running.api.kubeconfig.clone();
    println!(
        "Cluster up in {:.1} s. API server {}",
        t0.elapsed().as_secs_f64(),
        running.api.url
    );
    println!("kubeconfig: {}", kubeconfig.display());
    println!("  export KUBECONFIG={}", kubeconfig.display());
    if let Some(n) = running.cluster.lock().await.netns() {
        let net = n.network();
        let nodes: Vec<String> = net
            .nodes
            .iter()
            .map(|x| format!("{} {} ({})", x.name, x.addr, x.netns))
            .collect();
        println!(
            "Node namespaces on bridge {} {}/24: {}",
            net.bridge,
            net.gateway,
            nodes.join(", ")
        );
    }
    let client = ApiClient::from_kubeconfig(&kubeconfig)?;
    let snap = Snapshot::fetch(&client).await?;
    println!();
    print!("{}", render(&snap));
    println!();
    println!(
        "Logs: {}. Metrics: {}/metrics. Ctrl-C stops the cluster.",
        opts.data_dir.join("cluster.log").display(),
        running.api.url
    );
    let _ = std::io::stdout().flush();
    let sig = wait_for_signal().await?;
    println!("\n{sig}: stopping the cluster...");
    let netns = opts.netns;
    let net_left = running.shutdown().await;
    // Every launcher and replica process got SIGKILL; reap and count.
    let left = wait_children_gone(Duration::from_secs(5));
    if left.is_empty() {
        println!("Stopped; no sheaf process left running.");
    } else {
        println!("Stopped; processes still exiting: {left:?}");
    }
    if netns {
        if net_left.is_empty() {
            println!("Node network namespaces, veth pairs and the bridge removed.");
        } else {
            println!("Could not remove: {}", net_left.join("; "));
        }
    }
    Ok(())
}

/// Child processes of this process that are still alive after `limit`.
fn wait_children_gone(limit: Duration) -> Vec<i32> {
    let me = std::process::id() as i32;
    let t0 = Instant::now();
    loop {
        let mut left = Vec::new();
        for (pid, state, ppid) in proc_children() {
            if ppid != me {
                continue;
            }
            if state == "Z" {
                // SAFETY: reaping our own exited child; no memory is touched.
                unsafe { libc::waitpid(pid, std::ptr::null_mut(), libc::WNOHANG) };
            } else {
                left.push(pid);
            }
        }
        if left.is_empty() || t0.elapsed() > limit {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
