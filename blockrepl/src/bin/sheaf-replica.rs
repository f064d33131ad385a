// SPDX-License-Identifier: Apache-2.0
//! `sheaf-replica`: serves one replica store to authenticated engines.
//!
//! ```text
//! sheaf-replica --dir /var/lib/sheaf/vol0 --listen 127.0.0.1:7001 \
//!     --secret-file /etc/sheaf/secret [--create-size 1073741824 [--replacement]] \
//!     [--max-lease-ms 2000]
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use sheaf_blockrepl::net::server::serve;
use sheaf_blockrepl::net::{LinkProtection, Secret};
use sheaf_blockrepl::volume::{
    create_replacement_replica, create_replica, lock_replica_dir, open_replica,
};

#[derive(Parser, Debug)]
#[command(about = "Serve a sheaf replica store over authenticated TCP")]
struct Args {
    /// Store directory.
    #[arg(long)]
    dir: PathBuf,
    /// Address to listen on.
    #[arg(long)]
    listen: SocketAddr,
    /// File holding the shared replication secret (>= 16 bytes).
    #[arg(long)]
    secret_file: PathBuf,
    /// Create a new store of this many bytes if the directory holds none.
    #[arg(long)]
    create_size: Option<u64>,
    /// With --create-size: create an empty replacement replica (rebuilt on attach).
    #[arg(long)]
    replacement: bool,
    /// Runtime worker threads; 0 (default) serves every connection on one
    /// thread, which on small machines saves a cross-thread wake-up per
    /// request (requests of one connection run in order either way).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Longest read lease granted to an engine (ms; 0 grants none, and
    /// every read of a replicated volume then costs a ping round). After
    /// a start the replica refuses newer engines for this long (it may
    /// have granted a lease before a crash): keep it at least the
    /// volumes' `read_lease`, and small, as failover can wait for it.
    #[arg(long, default_value_t = 2000)]
    max_lease_ms: u64,
    /// How frames are protected after the handshake: `auto` (checksummed
    /// on loopback, encrypted to other hosts), `encrypted` (always
    /// AES-256-GCM) or `checksummed` (XXH3, no encryption; trusted
    /// networks only). A link is checksummed only if both ends allow it.
    #[arg(long, default_value = "auto")]
    link_protection: LinkProtection,
}

fn main() -> anyhow::Result<()> {
    sheaf_blockrepl::tune_allocator();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // One server per directory, for the life of this process.
    let _dir_lock = lock_replica_dir(&args.dir, std::time::Duration::from_secs(5))
        .context("lock the replica directory")?;
    let secret = Secret::from_file(&args.secret_file)
        .context("secret")?
        .with_protection(args.link_protection);
    if let Some(size) = args.create_size
        && !args.dir.join("superblock").exists()
    {
        if args.replacement {
            create_replacement_replica(&args.dir, size)?;
        } else {
            create_replica(&args.dir, size)?;
        }
    }
    let replica = open_replica(&args.dir, args.max_lease_ms.saturating_mul(1000), true)
        .context("open store")?;
    let rt = if args.threads == 0 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.threads)
            .enable_all()
            .build()?
    };
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("listen on {}", args.listen))?;
        eprintln!("sheaf-replica listening on {}", listener.local_addr()?);
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("SIGTERM handler")?;
        tokio::select! {
            r = serve(listener, secret, replica.clone()) => r?,
            _ = tokio::signal::ctrl_c() => eprintln!("sheaf-replica: interrupted"),
            _ = term.recv() => eprintln!("sheaf-replica: terminated"),
        }
        // Checkpoint and close the store (later requests are refused), so
        // the next start is not a crash recovery.
        replica.shutdown().context("closing the store")?;
        Ok(())
    })
}
