// SPDX-License-Identifier: Apache-2.0
//! Runs the sheaf API server on a data directory so kubectl can talk to it.
//!
//! ```text
//! cargo run -p sheaf-orchestrator --example apiserver -- /tmp/sheaf-api 127.0.0.1:6443
//! export KUBECONFIG=/tmp/sheaf-api/admin.kubeconfig
//! kubectl apply -f orchestrator/tests/manifests/vm-cirros.yaml && kubectl get vm
//! ```
//!
//! Arguments: data directory (default `./sheaf-api`), listen address (default
//! `127.0.0.1:6443`), and `--memory` to use the in-memory store instead of
//! `<data>/store.redb`.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use sheaf_orchestrator::api::{ApiServer, ApiServerConfig};
use sheaf_orchestrator::store::{MemoryStore, RedbStore, Store};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let memory = args.iter().any(|a| a == "--memory");
    let pos: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let dir = pos
        .first()
        .map(|s| s.as_str())
        .unwrap_or("sheaf-api")
        .to_string();
    let listen = pos
        .get(1)
        .map(|s| s.as_str())
        .unwrap_or("127.0.0.1:6443")
        .parse()?;
    std::fs::create_dir_all(&dir)?;
    let store: Arc<dyn Store> = if memory {
        Arc::new(MemoryStore::new())
    } else {
        Arc::new(RedbStore::open(format!("{dir}/store.redb"))?)
    };
    let mut config = ApiServerConfig::new(&dir);
    config.listen = listen;
    let server = ApiServer::start(config, store).await?;
    println!("sheaf API server at {}", server.url);
    println!("kubeconfig: {}", server.kubeconfig.display());
    println!(
        "try: KUBECONFIG={} kubectl get vm",
        server.kubeconfig.display()
    );
    tokio::signal::ctrl_c().await?;
    server.shutdown().await;
    Ok(())
}
