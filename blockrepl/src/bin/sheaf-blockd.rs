// SPDX-License-Identifier: Apache-2.0
//! `sheaf-blockd`: serves sheaf volumes to existing programs.
//!
//! ```text
//! sheaf-blockd create --dir /var/lib/sheaf/vol0 --size 1G
//! sheaf-blockd nbd --unix /run/sheaf/nbd.sock [--tcp 127.0.0.1:10809] \
//!     --export vol0=/var/lib/sheaf/vol0 \
//!     --export vol1=127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003 --secret-file /etc/sheaf/secret
//! sheaf-blockd vhost-user-blk --socket /run/sheaf/vhost.sock --volume /var/lib/sheaf/vol0
//! ```
//!
//! A volume spec is a comma-separated list of replicas: a path (or
//! `local:PATH`) for a store served in this process, `HOST:PORT` (or
//! `remote:HOST:PORT`) for a `sheaf-replica` server.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use sheaf_blockrepl::frontend::Disk;
use sheaf_blockrepl::frontend::nbd::{self, Export, NbdConfig, NbdServer};
use sheaf_blockrepl::net::{LinkProtection, Secret};
use sheaf_blockrepl::volume::{ReplicaTarget, Volume, VolumeConfig, create_replica};

#[derive(Parser, Debug)]
#[command(about = "Serve sheaf volumes over NBD or vhost-user-blk")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Create an empty replica store (one per replica of a new volume).
    Create {
        /// Store directory.
        #[arg(long)]
        dir: PathBuf,
        /// Size, e.g. 1073741824, 512M or 10G (a multiple of 4 KiB).
        #[arg(long, value_parser = parse_size)]
        size: u64,
    },
    /// Serve volumes as NBD exports.
    Nbd(NbdArgs),
    /// Serve one volume to a vhost-user-blk frontend (QEMU vhost-user-blk-pci).
    #[cfg(feature = "vhost-user")]
    VhostUserBlk(VhostArgs),
}

#[derive(Args, Debug)]
struct VolumeArgs {
    /// File with the replication secret (needed for remote replicas).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Replicas that must hold a write before it is acknowledged.
    #[arg(long)]
    min_write_replicas: Option<usize>,
    /// Busy-poll window (µs) of the volume engine while remote replicas
    /// owe answers: the runtime polls its sockets instead of sleeping for
    /// up to this long after the last answer (fewer wake-ups per request,
    /// costs CPU). 0 turns it off.
    #[arg(long, default_value_t = sheaf_blockrepl::volume::DEFAULT_POLL_US)]
    poll_us: u64,
    /// How replication frames are protected after the handshake: `auto`
    /// (checksummed on loopback, encrypted to other hosts), `encrypted`
    /// or `checksummed` (no encryption; trusted networks only).
    #[arg(long, default_value = "auto")]
    link_protection: LinkProtection,
}

#[derive(Args, Debug)]
struct NbdArgs {
    /// Unix socket to listen on (repeatable).
    #[arg(long)]
    unix: Vec<PathBuf>,
    /// TCP address to listen on (repeatable).
    #[arg(long)]
    tcp: Vec<SocketAddr>,
    /// NAME=VOLUME-SPEC (repeatable).
    #[arg(long, required = true)]
    export: Vec<String>,
    /// Export names to offer read-only.
    #[arg(long)]
    read_only: Vec<String>,
    /// Export served for the empty name (default: the only export).
    #[arg(long)]
    default_export: Option<String>,
    /// Requests in flight per connection.
    #[arg(long, default_value_t = 128)]
    max_in_flight: usize,
    /// Runtime worker threads; 0 runs every connection and volume engine
    /// on one thread (fewest wake-ups and context switches: the fastest
    /// choice on small machines).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// TLS certificate chain (PEM); enables NBD_OPT_STARTTLS.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Refuse clients that do not upgrade to TLS.
    #[arg(long, requires = "tls_cert")]
    tls_required: bool,
    #[command(flatten)]
    volume: VolumeArgs,
}

#[cfg(feature = "vhost-user")]
#[derive(Args, Debug)]
struct VhostArgs {
    /// vhost-user socket path (the backend listens; QEMU connects).
    #[arg(long)]
    socket: PathBuf,
    /// VOLUME-SPEC of the volume to serve.
    #[arg(long)]
    volume: String,
    /// Number of request queues.
    #[arg(long, default_value_t = 1)]
    num_queues: u16,
    /// Serial number reported to the guest.
    #[arg(long, default_value = "sheaf")]
    serial: String,
    /// Offer the disk read-only.
    #[arg(long)]
    read_only: bool,
    #[command(flatten)]
    volume_args: VolumeArgs,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mult) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1 << 20),
        Some(b'G' | b'g') => (&s[..s.len() - 1], 1 << 30),
        Some(b'T' | b't') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("bad size {s:?}"))
}

fn parse_spec(spec: &str) -> anyhow::Result<Vec<ReplicaTarget>> {
    let mut out = Vec::new();
    for item in spec.split(',').filter(|s| !s.is_empty()) {
        if let Some(p) = item.strip_prefix("local:") {
            out.push(ReplicaTarget::Local(p.into()));
        } else if let Some(a) = item.strip_prefix("remote:") {
            out.push(ReplicaTarget::Remote(
                a.parse().with_context(|| format!("address {a:?}"))?,
            ));
        } else if let Ok(a) = item.parse::<SocketAddr>() {
            out.push(ReplicaTarget::Remote(a));
        } else {
            out.push(ReplicaTarget::Local(item.into()));
        }
    }
    if out.is_empty() {
        bail!("volume spec {spec:?} names no replica");
    }
    Ok(out)
}

async fn attach(spec: &str, args: &VolumeArgs) -> anyhow::Result<Volume> {
    let replicas = parse_spec(spec)?;
    let secret = match &args.secret_file {
        Some(f) => Some(
            Secret::from_file(f)
                .context("secret file")?
                .with_protection(args.link_protection),
        ),
        None => None,
    };
    let mut cfg = VolumeConfig::new(replicas, secret);
    cfg.min_write_replicas = args.min_write_replicas;
    cfg.poll = std::time::Duration::from_micros(args.poll_us);
    Volume::attach(cfg)
        .await
        .with_context(|| format!("attach volume {spec}"))
}

async fn run_nbd(a: NbdArgs) -> anyhow::Result<()> {
    if a.unix.is_empty() && a.tcp.is_empty() {
        bail!("give at least one --unix or --tcp listener");
    }
    let mut cfg = NbdConfig {
        max_in_flight: a.max_in_flight,
        default_export: a.default_export.clone(),
        ..NbdConfig::default()
    };
    if let (Some(cert), Some(key)) = (&a.tls_cert, &a.tls_key) {
        let mode = if a.tls_required {
            nbd::proto::TlsMode::Required
        } else {
            nbd::proto::TlsMode::Optional
        };
        cfg.tls = Some((nbd::tls_acceptor(cert, key)?, mode));
    }
    let server = NbdServer::new(cfg);
    for e in &a.export {
        let Some((name, spec)) = e.split_once('=') else {
            bail!("--export wants NAME=VOLUME-SPEC, got {e:?}");
        };
        let vol = attach(spec, &a.volume).await?;
        let export = Export::new(Disk::new(vol))
            .description(format!("sheaf volume {spec}"))
            .read_only(a.read_only.iter().any(|r| r == name));
        server.add_export(name, export)?;
    }
    let mut tasks = tokio::task::JoinSet::new();
    for p in &a.unix {
        let l = NbdServer::bind_unix(p)?;
        eprintln!("sheaf-blockd: nbd listening on unix:{}", p.display());
        let s = server.clone();
        tasks.spawn(async move { s.serve_unix(l).await });
    }
    for addr in &a.tcp {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listen on {addr}"))?;
        eprintln!("sheaf-blockd: nbd listening on tcp:{}", l.local_addr()?);
        let s = server.clone();
        tasks.spawn(async move { s.serve_tcp(l).await });
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("SIGTERM handler")?;
    tokio::select! {
        r = tasks.join_next() => {
            if let Some(r) = r { r??; }
        }
        _ = tokio::signal::ctrl_c() => eprintln!("sheaf-blockd: interrupted"),
        _ = term.recv() => eprintln!("sheaf-blockd: terminated"),
    }
    // Detach every volume: its replicas checkpoint and close their
    // stores, so the next attach replays nothing.
    tasks.abort_all();
    for name in server.export_names() {
        if let Some(e) = server.remove_export(&name) {
            let vol = e.disk.volume().clone();
            drop(e);
            if let Err(err) = vol.detach().await {
                eprintln!("sheaf-blockd: detaching export {name}: {err}");
            }
        }
    }
    Ok(())
}

#[cfg(feature = "vhost-user")]
fn run_vhost(rt: tokio::runtime::Runtime, a: VhostArgs) -> anyhow::Result<()> {
    use sheaf_blockrepl::frontend::vhost_user::{BlkConfig, VhostUserBlk, VhostUserBlkServer};
    let vol = rt.block_on(attach(&a.volume, &a.volume_args))?;
    let cfg = BlkConfig {
        num_queues: a.num_queues,
        serial: a.serial.clone(),
        read_only: a.read_only,
        ..BlkConfig::default()
    };
    let backend = VhostUserBlk::new(Disk::new(vol), rt.handle().clone(), cfg)?;
    eprintln!(
        "sheaf-blockd: vhost-user-blk listening on {}",
        a.socket.display()
    );
    VhostUserBlkServer::new(backend).serve(&a.socket)?;
    Ok(())
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
    let cli = Cli::parse();
    let multi = |threads: usize| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("sheaf-blockd")
            .enable_all()
            .build()
    };
    match cli.cmd {
        Cmd::Create { dir, size } => {
            create_replica(&dir, size).with_context(|| format!("create {}", dir.display()))?;
            eprintln!("sheaf-blockd: created {} ({size} bytes)", dir.display());
            Ok(())
        }
        Cmd::Nbd(a) => {
            // A single-threaded runtime: a request's hops between the
            // connection, the volume engine and the replica links are task
            // switches on one thread instead of cross-thread wake-ups.
            let rt = if a.threads == 0 {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
            } else {
                multi(a.threads)?
            };
            rt.block_on(run_nbd(a))
        }
        // The vhost-user server thread drives requests through the
        // runtime's handle: that needs worker threads.
        #[cfg(feature = "vhost-user")]
        Cmd::VhostUserBlk(a) => run_vhost(multi(2)?, a),
    }
}
