// SPDX-License-Identifier: Apache-2.0
//! `sheaf-launcher`: the per-VM process a node agent starts (KubeVirt's
//! virt-launcher), and the per-replica store server.
//!
//! ```text
//! sheaf-launcher vm --spec <dir>/spec.json
//! sheaf-launcher replica --dir D --listen 127.0.0.1:0 --secret-file F [--create-size N [--replacement]]
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use sheaf_orchestrator::launcher::{LaunchSpec, ReplicaArgs, run_replica, run_vm};

#[derive(Parser, Debug)]
#[command(about = "Runs one VM (or one replica store) for a sheaf node agent")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the VM described by a launch spec.
    Vm {
        /// The launch spec (JSON) written by the agent.
        #[arg(long)]
        spec: PathBuf,
    },
    /// Serve one replica store.
    Replica {
        /// Store directory.
        #[arg(long)]
        dir: PathBuf,
        /// Listen address.
        #[arg(long)]
        listen: SocketAddr,
        /// Replication secret file.
        #[arg(long)]
        secret_file: PathBuf,
        /// Create a store of this many bytes if none exists.
        #[arg(long)]
        create_size: Option<u64>,
        /// With --create-size: an empty replacement replica.
        #[arg(long)]
        replacement: bool,
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Args::parse().cmd {
        Cmd::Vm { spec } => {
            let text =
                std::fs::read(&spec).with_context(|| format!("reading {}", spec.display()))?;
            let spec: LaunchSpec = serde_json::from_slice(&text).context("launch spec")?;
            let exit = run_vm(spec)?;
            std::process::exit(if exit.success { 0 } else { 1 });
        }
        Cmd::Replica {
            dir,
            listen,
            secret_file,
            create_size,
            replacement,
        } => run_replica(ReplicaArgs {
            dir,
            listen,
            secret_file,
            create_size,
            replacement,
        })?,
    }
    Ok(())
}
