// SPDX-License-Identifier: Apache-2.0
//! A whole cluster in one process: a control plane and N node agents on one
//! store, each node with its own data directory; launchers and replica
//! servers are real processes. Used by the multi-node tests, the
//! orchestrator benchmark, and (as its engine) the `sheaf cluster` binary.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use sheaf_orchestrator::cluster::{LocalCluster, LocalClusterConfig};
//! let mut cfg = LocalClusterConfig::new("/tmp/sheaf-cluster", "target/debug/sheaf-launcher");
//! cfg.nodes = 3;
//! let mut cluster = LocalCluster::start(cfg).await?;
//! // create VMs through cluster.store() (or the API server, cfg.control.api)
//! cluster.kill_node("node-1");           // kill -9 of the node's processes
//! cluster.restart_node("node-1").await?; // same data directory
//! cluster.shutdown().await;
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sheaf_blockrepl::net::Secret;

use crate::agent::{AgentError, NodeAgent, NodeAgentConfig};
use crate::controllers::{ControlPlane, ControlPlaneConfig, ControlPlaneError};
use crate::store::{MemoryStore, RedbStore, Store};

/// Which store backs the cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StoreKind {
    /// In memory (tests, benchmarks).
    #[default]
    Memory,
    /// redb file under the data directory (survives restarts).
    Redb,
}

/// Settings of a local cluster.
#[derive(Clone, Debug)]
pub struct LocalClusterConfig {
    /// Nodes (`node-0` ...).
    pub nodes: usize,
    /// Root data directory (`secret`, `store.redb`, `nodes/<name>/`).
    pub data_dir: PathBuf,
    /// The `sheaf-launcher` binary.
    pub launcher_bin: PathBuf,
    /// Control plane settings (the replication secret is filled in).
    pub control: ControlPlaneConfig,
    /// Agent lease renewal period.
    pub heartbeat_interval: Duration,
    /// Per-node CPU (millicores), memory and replica space.
    pub node_cpu_millis: u64,
    /// Per-node memory.
    pub node_memory_bytes: u64,
    /// Per-node replica space.
    pub node_storage_bytes: u64,
    /// Put each node in its own zone (`zone-0` ...).
    pub zones: bool,
    /// Store backend.
    pub store: StoreKind,
    /// Directories image sources and `kernelBoot` files may come from,
    /// besides `<data_dir>/images` and `<data_dir>/uploads` (always allowed).
    pub image_dirs: Vec<PathBuf>,
}

impl LocalClusterConfig {
    /// Three nodes, one zone each, memory store, 500 ms heartbeats and a
    /// 3 s grace period (fast failover for tests; production uses 40 s).
    pub fn new(data_dir: impl Into<PathBuf>, launcher_bin: impl Into<PathBuf>) -> Self {
        let control = ControlPlaneConfig {
            node_grace_period: Duration::from_secs(3),
            restart_backoff: crate::controllers::queue::Backoff {
                base: Duration::from_secs(1),
                max: Duration::from_secs(30),
            },
            replica_replenish_wait: Duration::from_secs(60),
            fence_timeout: Duration::from_secs(5),
            ..Default::default()
        };
        LocalClusterConfig {
            nodes: 3,
            data_dir: data_dir.into(),
            launcher_bin: launcher_bin.into(),
            control,
            heartbeat_interval: Duration::from_millis(500),
            node_cpu_millis: 16_000,
            node_memory_bytes: 64 << 30,
            node_storage_bytes: 256 << 30,
            zones: true,
            store: StoreKind::Memory,
            image_dirs: Vec::new(),
        }
    }

    /// What image paths an API user may name: `<data_dir>/images`,
    /// `<data_dir>/uploads` and [`LocalClusterConfig::image_dirs`], never
    /// anything else inside the data directory (keys, tokens, replicas).
    pub fn image_policy(&self) -> crate::images::ImagePolicy {
        let mut roots = vec![self.data_dir.join("images"), self.data_dir.join("uploads")];
        roots.extend(self.image_dirs.iter().cloned());
        crate::images::ImagePolicy::new(roots, vec![self.data_dir.clone()])
    }
}

/// Failures starting a local cluster.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Data directory, secret or store.
    #[error("{what}: {message}")]
    Setup {
        /// What failed.
        what: &'static str,
        /// Why.
        message: String,
    },
    /// The control plane.
    #[error(transparent)]
    Control(#[from] ControlPlaneError),
    /// A node agent.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// No such node.
    #[error("no node {0:?}")]
    NoNode(String),
}

/// A running local cluster.
#[derive(Debug)]
pub struct LocalCluster {
    config: LocalClusterConfig,
    store: Arc<dyn Store>,
    control: Option<ControlPlane>,
    nodes: BTreeMap<String, Option<NodeAgent>>,
    secret_file: PathBuf,
}

fn setup(what: &'static str) -> impl FnOnce(String) -> ClusterError {
    move |message| ClusterError::Setup { what, message }
}

/// Creates (once) a random replication secret file: created 0600 (never
/// readable by others, not even for a moment), written and fsynced before
/// it is used. An existing file is kept; one readable by group or others is
/// refused, since its key may already have leaked.
pub fn ensure_secret(path: &Path) -> Result<Secret, ClusterError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let err = |e: std::io::Error| setup("secret")(format!("{}: {e}", path.display()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
    {
        Ok(mut f) => {
            let mut b = [0u8; 32];
            sheaf_blockrepl::net::random_bytes(&mut b)
                .map_err(|e| setup("secret")(e.to_string()))?;
            let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
            let written = f.write_all(hex.as_bytes()).and_then(|_| f.sync_all());
            if let Err(e) = written {
                let _ = std::fs::remove_file(path);
                return Err(err(e));
            }
            if let Some(dir) = path.parent() {
                let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let mode = std::fs::metadata(path).map_err(err)?.permissions().mode();
            if mode & 0o077 != 0 {
                return Err(setup("secret")(format!(
                    "{} is readable by other users (mode {:o}); make it 0600 or remove it",
                    path.display(),
                    mode & 0o777
                )));
            }
        }
        Err(e) => return Err(err(e)),
    }
    Secret::from_file(path).map_err(|e| setup("secret")(e.to_string()))
}

impl LocalCluster {
    /// Starts the control plane and every node.
    pub async fn start(config: LocalClusterConfig) -> Result<LocalCluster, ClusterError> {
        std::fs::create_dir_all(&config.data_dir)
            .map_err(|e| setup("data directory")(e.to_string()))?;
        let store: Arc<dyn Store> = match config.store {
            StoreKind::Memory => Arc::new(MemoryStore::new()),
            StoreKind::Redb => Arc::new(
                RedbStore::open(config.data_dir.join("store.redb"))
                    .map_err(|e| setup("store")(e.to_string()))?,
            ),
        };
        Self::start_with_store(config, store).await
    }

    /// Starts the control plane and every node on a given store (for
    /// example a `KubeStore` talking to a Kubernetes API server);
    /// `config.store` is ignored.
    pub async fn start_with_store(
        config: LocalClusterConfig,
        store: Arc<dyn Store>,
    ) -> Result<LocalCluster, ClusterError> {
        std::fs::create_dir_all(&config.data_dir)
            .map_err(|e| setup("data directory")(e.to_string()))?;
        let secret_file = config.data_dir.join("secret");
        let secret = ensure_secret(&secret_file)?;
        let mut control = config.control.clone();
        control.replication_secret = Some(secret);
        let cp = ControlPlane::start(control, store.clone()).await?;
        let mut c = LocalCluster {
            config,
            store,
            control: Some(cp),
            nodes: BTreeMap::new(),
            secret_file,
        };
        for i in 0..c.config.nodes {
            let name = format!("node-{i}");
            c.nodes.insert(name.clone(), None);
            c.restart_node(&name).await?;
        }
        Ok(c)
    }

    /// The store every component uses.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The control plane.
    pub fn control_plane(&self) -> Option<&ControlPlane> {
        self.control.as_ref()
    }

    /// The replication secret file.
    pub fn secret_file(&self) -> &Path {
        &self.secret_file
    }

    /// Node names.
    pub fn node_names(&self) -> Vec<String> {
        self.nodes.keys().cloned().collect()
    }

    /// A node's agent (`None` while the node is down).
    pub fn agent(&self, name: &str) -> Option<&NodeAgent> {
        self.nodes.get(name).and_then(|a| a.as_ref())
    }

    /// A node's data directory.
    pub fn node_dir(&self, name: &str) -> PathBuf {
        self.config.data_dir.join("nodes").join(name)
    }

    /// The data directory of node `name` when `name` comes from outside
    /// (a request, an object's status): `None` unless it is one of this
    /// cluster's nodes and a plain directory name under `nodes/`.
    pub fn known_node_dir(&self, name: &str) -> Option<PathBuf> {
        if !self.nodes.contains_key(name) {
            return None;
        }
        crate::names::child(&self.config.data_dir.join("nodes"), name).ok()
    }

    /// The agent settings of node `name`.
    pub fn agent_config(&self, name: &str) -> NodeAgentConfig {
        let idx: usize = name
            .rsplit('-')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        let mut a = NodeAgentConfig::new(
            name,
            self.node_dir(name),
            &self.config.launcher_bin,
            &self.secret_file,
        );
        a.heartbeat_interval = self.config.heartbeat_interval;
        a.cpu_millis = self.config.node_cpu_millis;
        a.memory_bytes = self.config.node_memory_bytes;
        a.storage_bytes = self.config.node_storage_bytes;
        a.images = self.config.image_policy();
        if self.config.zones {
            a.zone = Some(format!("zone-{idx}"));
        }
        a
    }

    /// Kills node `name` like `kill -9` of all its processes: launchers and
    /// replica servers get SIGKILL, the agent stops without cleanup.
    pub fn kill_node(&mut self, name: &str) -> Result<(), ClusterError> {
        let slot = self
            .nodes
            .get_mut(name)
            .ok_or_else(|| ClusterError::NoNode(name.into()))?;
        if let Some(a) = slot.take() {
            a.kill();
        }
        Ok(())
    }

    /// (Re)starts node `name`'s agent on its data directory.
    pub async fn restart_node(&mut self, name: &str) -> Result<(), ClusterError> {
        if !self.nodes.contains_key(name) {
            return Err(ClusterError::NoNode(name.into()));
        }
        if let Some(Some(old)) = self.nodes.remove(name) {
            old.shutdown();
        }
        let agent = NodeAgent::start(self.agent_config(name), self.store.clone()).await?;
        self.nodes.insert(name.to_string(), Some(agent));
        Ok(())
    }

    /// Stops only node `name`'s agent (launchers and replicas keep running).
    pub fn stop_agent(&mut self, name: &str) -> Result<(), ClusterError> {
        let slot = self
            .nodes
            .get_mut(name)
            .ok_or_else(|| ClusterError::NoNode(name.into()))?;
        if let Some(a) = slot.take() {
            a.shutdown();
        }
        Ok(())
    }

    /// Stops everything: every node is killed (its VMs end) and the control
    /// plane stops.
    pub async fn shutdown(mut self) {
        let names = self.node_names();
        for n in names {
            let _ = self.kill_node(&n);
        }
        if let Some(cp) = self.control.take() {
            cp.shutdown().await;
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for slot in self.nodes.values_mut() {
            if let Some(a) = slot.take() {
                a.kill();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 18 item 5: the secret is 0600 from creation, kept across
    /// calls, and an existing one that others can read is refused.
    #[test]
    fn secret_file_is_private_from_creation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        ensure_secret(&path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let first = std::fs::read(&path).unwrap();
        assert_eq!(first.len(), 64);
        ensure_secret(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), first, "kept, not replaced");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = ensure_secret(&path).unwrap_err().to_string();
        assert!(e.contains("readable by other users"), "{e}");
    }
}
