// SPDX-License-Identifier: Apache-2.0
//! `sheaf-kube`: sheaf's control plane and node agent on a Kubernetes
//! cluster (through kube-rs), and the generator of `deploy/`.
//!
//! ```text
//! sheaf-kube manifests --out deploy [--image IMAGE]
//! sheaf-kube control-plane --secret-file F [--kubeconfig K]
//! sheaf-kube agent --node N --data-dir D --launcher L --secret-file F [--replica-host IP] [--kubeconfig K]
//! ```
//!
//! Without `--kubeconfig` the in-cluster service account is used (or
//! `$KUBECONFIG` / `~/.kube/config`). See docs/kubernetes.md.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::{Parser, Subcommand};
use sheaf_blockrepl::net::Secret;
use sheaf_orchestrator::agent::{NodeAgent, NodeAgentConfig};
use sheaf_orchestrator::controllers::{ControlPlane, ControlPlaneConfig};
use sheaf_orchestrator::kube::KubeStore;
use sheaf_orchestrator::kube::manifests::{self, ManifestConfig};
use sheaf_orchestrator::store::Store;

#[derive(Parser, Debug)]
#[command(about = "sheaf on Kubernetes: control plane, node agent, deploy/ manifests")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Write the CRDs, RBAC, Deployment and DaemonSet manifests.
    Manifests {
        /// Output directory.
        #[arg(long, default_value = "deploy")]
        out: PathBuf,
        /// Container image of the control plane and the agents.
        #[arg(long)]
        image: Option<String>,
    },
    /// Run the controllers against the cluster.
    ControlPlane {
        /// Replication secret (fences volumes of lost nodes).
        #[arg(long)]
        secret_file: PathBuf,
        /// Kubeconfig (default: in-cluster, then $KUBECONFIG, ~/.kube/config).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// Seconds without a heartbeat before a node is NotReady.
        #[arg(long, default_value_t = 40)]
        node_grace_seconds: u64,
    },
    /// Run the node agent of one node.
    Agent {
        /// Node name (the Kubernetes node's name).
        #[arg(long)]
        node: String,
        /// Data directory (replicas, launcher state).
        #[arg(long)]
        data_dir: PathBuf,
        /// The `sheaf-launcher` binary.
        #[arg(long)]
        launcher: PathBuf,
        /// Replication secret.
        #[arg(long)]
        secret_file: PathBuf,
        /// Address replica servers listen on and advertise.
        #[arg(long, default_value = "127.0.0.1")]
        replica_host: IpAddr,
        /// Zone label of the node.
        #[arg(long)]
        zone: Option<String>,
        /// CPU offered to VMs, millicores (default: all host CPUs).
        #[arg(long)]
        cpu_millis: Option<u64>,
        /// Memory offered to VMs, bytes (default: host MemTotal).
        #[arg(long)]
        memory_bytes: Option<u64>,
        /// Space offered to volume replicas, bytes.
        #[arg(long, default_value_t = 64 << 30)]
        storage_bytes: u64,
        /// Kubeconfig (default: in-cluster, then $KUBECONFIG, ~/.kube/config).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
    },
}

/// Host memory from `/proc/meminfo` (`MemTotal`, kB).
fn host_memory_bytes() -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .context("no MemTotal in /proc/meminfo")
}

async fn connect(kubeconfig: Option<&Path>) -> anyhow::Result<Arc<dyn Store>> {
    let store = match kubeconfig {
        Some(p) => KubeStore::from_kubeconfig(p).await?,
        None => KubeStore::infer().await?,
    };
    Ok(Arc::new(store))
}

async fn until_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
        _ = term.recv() => {}
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("sheaf_orchestrator=info")),
        )
        .init();
    match Args::parse().cmd {
        Cmd::Manifests { out, image } => {
            let mut cfg = ManifestConfig::default();
            if let Some(i) = image {
                cfg.image = i;
            }
            manifests::write(&out, &cfg)?;
            println!("wrote {}", out.display());
        }
        Cmd::ControlPlane {
            secret_file,
            kubeconfig,
            node_grace_seconds,
        } => {
            let secret = Secret::from_file(&secret_file)
                .with_context(|| format!("reading {}", secret_file.display()))?;
            let store = connect(kubeconfig.as_deref()).await?;
            let config = ControlPlaneConfig {
                replication_secret: Some(secret),
                node_grace_period: std::time::Duration::from_secs(node_grace_seconds),
                ..Default::default()
            };
            let cp = ControlPlane::start(config, store).await?;
            tracing::info!("control plane running");
            until_signal().await?;
            cp.shutdown().await;
        }
        Cmd::Agent {
            node,
            data_dir,
            launcher,
            secret_file,
            replica_host,
            zone,
            cpu_millis,
            memory_bytes,
            storage_bytes,
            kubeconfig,
        } => {
            let store = connect(kubeconfig.as_deref()).await?;
            let mut cfg = NodeAgentConfig::new(&node, data_dir, launcher, secret_file);
            cfg.replica_host = replica_host;
            cfg.zone = zone;
            cfg.cpu_millis = match cpu_millis {
                Some(m) => m,
                None => {
                    let n = std::thread::available_parallelism().context("counting host CPUs")?;
                    u64::try_from(n.get()).unwrap_or(1) * 1000
                }
            };
            cfg.memory_bytes = match memory_bytes {
                Some(b) => b,
                None => host_memory_bytes()?,
            };
            cfg.storage_bytes = storage_bytes;
            let agent = NodeAgent::start(cfg, store).await?;
            tracing::info!(%node, "node agent running");
            until_signal().await?;
            agent.shutdown();
        }
    }
    Ok(())
}
