// SPDX-License-Identifier: Apache-2.0
//! `sheaf`: a Harvester-like cluster on one machine, and a virtctl-like CLI.
//!
//! ```text
//! sheaf cluster up [--nodes 3] [--listen 127.0.0.1:6443]   # foreground; Ctrl-C stops it
//! export KUBECONFIG=~/.local/share/sheaf/admin.kubeconfig
//! sheaf image demo /tmp/probe-disk.img && sheaf image import /tmp/probe-disk.img --name probe-disk
//! kubectl apply -f examples/vm.yaml
//! sheaf status | sheaf console demo | sheaf node drain node-1 | sheaf node kill node-0
//! ```
//!
//! The binary is also the launcher its nodes start (`sheaf vm --spec F`,
//! `sheaf replica ...`, the same interface as `sheaf-launcher`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use serde_json::json;
use sheaf_examples::client::ApiClient;
use sheaf_examples::cluster::{UpOptions, run_foreground, wait_for_signal};
use sheaf_examples::commands::{
    console, image_import, kv, vm_verb, vmi_node, vmi_verb, wait_moved,
};
use sheaf_examples::control_plane::{self, ControlPlaneOptions};
use sheaf_examples::image::write_probe_disk;
use sheaf_examples::node_cmds::{node_drain, node_kill, node_restart, node_uncordon};
use sheaf_examples::status::{Snapshot, render};
use sheaf_orchestrator::agent::{NodeAgent, NodeAgentConfig};
use sheaf_orchestrator::kube::KubeStore;
use sheaf_orchestrator::launcher::{LaunchSpec, ReplicaArgs, run_replica, run_vm};

#[derive(Parser, Debug)]
#[command(
    name = "sheaf",
    version,
    about = "A Harvester-like VM cluster on one machine, and a virtctl-like CLI for it"
)]
struct Cli {
    /// Cluster data directory [env SHEAF_DATA_DIR; default ~/.local/share/sheaf].
    #[arg(long, global = true)]
    data_dir: Option<PathBuf>,
    /// Kubeconfig of the cluster [default <data-dir>/admin.kubeconfig].
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// Namespace of VMs and volumes.
    #[arg(short, long, global = true, default_value = "default")]
    namespace: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run a cluster.
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
    /// Run one control plane of a highly available cluster on etcd.
    ControlPlane {
        #[command(subcommand)]
        cmd: ControlPlaneCmd,
    },
    /// Nodes, VMs, volumes and replica health at a glance.
    Status,
    /// The serial console of a VM (Ctrl-] exits).
    Console {
        /// VM name.
        vm: String,
        /// Print what the console holds and exit instead of following it.
        #[arg(long)]
        no_follow: bool,
    },
    /// Start a VM.
    Start {
        /// VM name.
        vm: String,
    },
    /// Stop a VM.
    Stop {
        /// VM name.
        vm: String,
    },
    /// Restart a VM (a new instance).
    Restart {
        /// VM name.
        vm: String,
    },
    /// Pause a VM's vCPUs.
    Pause {
        /// VM name.
        vm: String,
    },
    /// Resume a paused VM.
    Unpause {
        /// VM name.
        vm: String,
    },
    /// Move a running VM to another node (live for sheaf-vmm guests, cold
    /// for QEMU ones).
    Migrate {
        /// VM name.
        vm: String,
        /// The node to move to (default: the scheduler picks).
        #[arg(long)]
        node: Option<String>,
        /// Wait until it runs on the new node.
        #[arg(long)]
        wait: bool,
    },
    /// Disk images.
    Image {
        #[command(subcommand)]
        cmd: ImageCmd,
    },
    /// Node operations.
    Node {
        #[command(subcommand)]
        cmd: NodeCmd,
    },
    /// (launcher) Run the VM of a launch spec.
    #[command(hide = true)]
    Vm {
        #[arg(long)]
        spec: PathBuf,
    },
    /// (node) Run one node's agent against the cluster's API server
    /// (what `cluster up --netns` starts in each node namespace; the data
    /// directory is the node's, `--kubeconfig` the agents' kubeconfig).
    #[command(hide = true)]
    Agent {
        /// Node name.
        #[arg(long)]
        node: String,
        /// Replication secret file.
        #[arg(long)]
        secret_file: PathBuf,
        /// Address replica servers listen on and advertise.
        #[arg(long)]
        replica_host: std::net::IpAddr,
        /// Zone label.
        #[arg(long)]
        zone: Option<String>,
        /// CPU offered to VMs, millicores.
        #[arg(long, default_value_t = 16_000)]
        cpu_millis: u64,
        /// Memory offered to VMs, bytes.
        #[arg(long, default_value_t = 64 << 30)]
        memory_bytes: u64,
        /// Space offered to replicas, bytes.
        #[arg(long, default_value_t = 256 << 30)]
        storage_bytes: u64,
        /// Lease renewal period, milliseconds.
        #[arg(long, default_value_t = 500)]
        heartbeat_ms: u64,
        /// A directory `kernelBoot.container` images may be in (repeatable).
        #[arg(long)]
        image_dir: Vec<PathBuf>,
        /// A directory no image may come from, unless an --image-dir lies
        /// inside it (repeatable; the cluster passes its data directory).
        #[arg(long)]
        protect_dir: Vec<PathBuf>,
        /// The node's pod network (`A.B.C.D/N`): a bridge with the first
        /// address, NAT and DHCP for the VMs' pod interfaces.
        #[arg(long)]
        pod_cidr: Option<String>,
    },
    /// (launcher) Serve one replica store.
    #[command(hide = true)]
    Replica {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        secret_file: PathBuf,
        #[arg(long)]
        create_size: Option<u64>,
        #[arg(long)]
        replacement: bool,
    },
}

#[derive(Subcommand, Debug)]
enum ClusterCmd {
    /// Start a control plane and N nodes in the foreground (Ctrl-C stops them).
    Up {
        /// Nodes.
        #[arg(long, default_value_t = 3)]
        nodes: usize,
        /// API server address.
        #[arg(long, default_value = "127.0.0.1:6443")]
        listen: SocketAddr,
        /// Put each node in its own network namespace.
        #[arg(long)]
        netns: bool,
        /// Seconds a silent node stays Ready before its VMs fail over.
        #[arg(long, default_value_t = 3.0)]
        node_grace: f64,
        /// A host directory images may be named from (`spec.source.image`,
        /// `kernelBoot.container.image`), besides DATA/images and
        /// DATA/uploads (repeatable). Nothing else on the host can be named.
        #[arg(long, default_value = "/var/lib/sheaf/images")]
        image_dir: Vec<PathBuf>,
    },
    /// Stop the cluster running on the data directory (SIGTERM to it).
    Down,
}

#[derive(Subcommand, Debug)]
enum ControlPlaneCmd {
    /// Serve the API on an etcd cluster and run the controllers while this
    /// control plane holds the `kube-system/sheaf-controller-manager`
    /// Lease (foreground; SIGTERM or Ctrl-C stops it and hands the Lease
    /// over). Control planes on one machine share the data directory.
    Up {
        /// etcd client URLs (comma separated or repeated).
        #[arg(long, required = true, value_delimiter = ',')]
        etcd: Vec<String>,
        /// This control plane's name (its directory under
        /// DATA/control-planes/ and the prefix of its Lease identity).
        #[arg(long, default_value = "cp-0")]
        name: String,
        /// API server address.
        #[arg(long, default_value = "127.0.0.1:6443")]
        listen: SocketAddr,
        /// Extra names and addresses for the server certificate (repeatable).
        #[arg(long)]
        san: Vec<String>,
        /// Key prefix of the cluster in etcd.
        #[arg(long, default_value = "/sheaf/")]
        etcd_prefix: String,
        /// Seconds a silent node stays Ready before its VMs fail over.
        #[arg(long, default_value_t = 40.0)]
        node_grace: f64,
        /// Seconds a leader's Lease lasts without renewal (kube-controller-manager's flag).
        #[arg(long, default_value_t = 15.0)]
        leader_elect_lease_duration: f64,
        /// Seconds a leader keeps trying to renew before it stops its controllers.
        #[arg(long, default_value_t = 10.0)]
        leader_elect_renew_deadline: f64,
        /// Seconds between attempts to acquire or renew the Lease.
        #[arg(long, default_value_t = 2.0)]
        leader_elect_retry_period: f64,
        /// A host directory images may be named from, besides DATA/images
        /// and DATA/uploads (repeatable).
        #[arg(long)]
        image_dir: Vec<PathBuf>,
        /// Log to stderr instead of DATA/control-planes/<name>.log.
        #[arg(long)]
        log_stderr: bool,
    },
}

#[derive(Subcommand, Debug)]
enum ImageCmd {
    /// Import a raw or qcow2 image into a replicated volume.
    Import {
        /// Image file on this machine.
        file: PathBuf,
        /// Volume name [default: the file name without extension].
        #[arg(long)]
        name: Option<String>,
        /// Volume size in bytes [default: the image size rounded up to 1 MiB].
        #[arg(long)]
        size: Option<u64>,
        /// Replicas of a new volume.
        #[arg(long, default_value_t = 3)]
        replicas: u32,
    },
    /// Write a demo disk for the probe guest (valid records of its on-disk log).
    Demo {
        /// Output file (raw).
        file: PathBuf,
        /// Size in MiB.
        #[arg(long, default_value_t = 16)]
        size_mib: u64,
        /// Log records to put on it.
        #[arg(long, default_value_t = 8)]
        records: u64,
    },
    /// Prepare a Linux guest for QEMU (examples/vm-linux.yaml): the host's
    /// Debian cloud kernel and a busybox initramfs as DIR/vmlinuz and
    /// DIR/initrd.img, plus DIR/disk.img carrying a marker the guest answers.
    Linux {
        /// Directory the manifest's `kernelBoot.container.image` names.
        #[arg(default_value = "/var/lib/sheaf/images/linux-guest")]
        dir: PathBuf,
        /// Marker written on the disk.
        #[arg(long, default_value = "hello-from-sheaf")]
        marker: String,
    },
}

#[derive(Subcommand, Debug)]
enum NodeCmd {
    /// Cordon a node and migrate its VMs away.
    Drain {
        /// Node name.
        node: String,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 120)]
        timeout: u64,
    },
    /// Make a node schedulable again.
    Uncordon {
        /// Node name.
        node: String,
    },
    /// Kill a node like a power cut (kill -9 of its processes), for failover demos.
    Kill {
        /// Node name.
        node: String,
        /// Wait until its VMs run on other nodes.
        #[arg(long)]
        wait: bool,
    },
    /// Start a killed node again (same data).
    Restart {
        /// Node name.
        node: String,
    },
}

fn default_data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SHEAF_DATA_DIR") {
        return d.into();
    }
    if let Some(d) = std::env::var_os("XDG_DATA_HOME") {
        return PathBuf::from(d).join("sheaf");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".local/share/sheaf"),
        None => PathBuf::from("sheaf-data"),
    }
}

fn init_logs(to: Option<&Path>) -> anyhow::Result<()> {
    init_logs_at(to, if to.is_some() { "info" } else { "warn" })
}

fn init_logs_at(to: Option<&Path>, default: &str) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let b = tracing_subscriber::fmt().with_env_filter(filter);
    match to {
        Some(p) => {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("log file {}", p.display()))?;
            b.with_ansi(false)
                .with_writer(std::sync::Mutex::new(f))
                .init();
        }
        None => b
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .init(),
    }
    Ok(())
}

fn main() {
    // Node agents serve replicas and NBD exports in this process.
    sheaf_blockrepl::tune_allocator();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let data_dir = cli.data_dir.clone().unwrap_or_else(default_data_dir);
    match cli.cmd {
        // Launcher modes: what the node agents start.
        Cmd::Vm { spec } => {
            init_logs(None)?;
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
        } => {
            init_logs(None)?;
            run_replica(ReplicaArgs {
                dir,
                listen,
                secret_file,
                create_size,
                replacement,
            })?;
            Ok(())
        }
        Cmd::Agent {
            node,
            secret_file,
            replica_host,
            zone,
            cpu_millis,
            memory_bytes,
            storage_bytes,
            heartbeat_ms,
            image_dir,
            protect_dir,
            pod_cidr,
        } => {
            // stderr is the node's agent.log.
            init_logs_at(None, "info")?;
            let kc = cli
                .kubeconfig
                .clone()
                .context("`sheaf agent` needs --kubeconfig (the cluster's agent.kubeconfig)")?;
            let exe = std::env::current_exe().context("locating the sheaf binary")?;
            let mut cfg = NodeAgentConfig::new(&node, &data_dir, exe, secret_file);
            cfg.replica_host = replica_host;
            cfg.zone = zone;
            cfg.cpu_millis = cpu_millis;
            cfg.memory_bytes = memory_bytes;
            cfg.storage_bytes = storage_bytes;
            cfg.heartbeat_interval = Duration::from_millis(heartbeat_ms.clamp(50, 60_000));
            cfg.images = sheaf_orchestrator::images::ImagePolicy::new(image_dir, protect_dir);
            if let Some(c) = pod_cidr {
                let (network, prefix) =
                    sheaf_orchestrator::network::PodNetworkConfig::parse_cidr(&c)?;
                cfg.pod_network = Some(sheaf_orchestrator::network::PodNetworkConfig {
                    network,
                    prefix,
                    ..Default::default()
                });
            }
            tokio::runtime::Runtime::new()?.block_on(run_agent(cfg, &kc))
        }
        Cmd::Cluster {
            cmd:
                ClusterCmd::Up {
                    nodes,
                    listen,
                    netns,
                    node_grace,
                    image_dir,
                },
        } => {
            std::fs::create_dir_all(&data_dir)
                .with_context(|| format!("data directory {}", data_dir.display()))?;
            init_logs(Some(&data_dir.join("cluster.log")))?;
            if nodes == 0 || nodes > 64 {
                bail!("--nodes must be between 1 and 64");
            }
            if !(0.5..=3600.0).contains(&node_grace) {
                bail!("--node-grace must be between 0.5 and 3600 seconds");
            }
            let opts = UpOptions {
                nodes,
                data_dir: data_dir.clone(),
                listen,
                netns,
                node_grace: Duration::from_secs_f64(node_grace),
                launcher_bin: std::env::current_exe().context("locating the sheaf binary")?,
                image_dirs: image_dir,
            };
            tokio::runtime::Runtime::new()?.block_on(run_foreground(opts))
        }
        Cmd::ControlPlane {
            cmd:
                ControlPlaneCmd::Up {
                    etcd,
                    name,
                    listen,
                    san,
                    etcd_prefix,
                    node_grace,
                    leader_elect_lease_duration,
                    leader_elect_renew_deadline,
                    leader_elect_retry_period,
                    image_dir,
                    log_stderr,
                },
        } => {
            let secs = |flag: &str, v: f64| -> anyhow::Result<Duration> {
                if !(0.01..=3600.0).contains(&v) {
                    bail!("--{flag} must be between 0.01 and 3600 seconds");
                }
                Ok(Duration::from_secs_f64(v))
            };
            let mut opts = ControlPlaneOptions::new(&name, &data_dir, etcd, listen);
            opts.sans = san;
            opts.etcd_prefix = etcd_prefix;
            opts.node_grace = secs("node-grace", node_grace)?;
            opts.lease_duration = secs("leader-elect-lease-duration", leader_elect_lease_duration)?;
            opts.renew_deadline = secs("leader-elect-renew-deadline", leader_elect_renew_deadline)?;
            opts.retry_period = secs("leader-elect-retry-period", leader_elect_retry_period)?;
            opts.image_dirs = image_dir;
            if log_stderr {
                init_logs_at(None, "info")?;
            } else {
                let logs = data_dir.join("control-planes");
                std::fs::create_dir_all(&logs)
                    .with_context(|| format!("data directory {}", logs.display()))?;
                let log = sheaf_orchestrator::names::child(&logs, &format!("{name}.log"))
                    .map_err(|e| anyhow::anyhow!("--name: {e}"))?;
                init_logs(Some(&log))?;
            }
            tokio::runtime::Runtime::new()?.block_on(control_plane::run_foreground(opts))
        }
        cmd => {
            init_logs(None)?;
            let kc = cli
                .kubeconfig
                .clone()
                .unwrap_or_else(|| data_dir.join("admin.kubeconfig"));
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(client_cmd(cmd, &kc, &data_dir, &cli.namespace))
        }
    }
}

/// `sheaf agent`: one node's agent on a remote store (the cluster's API
/// server through kube-rs) until SIGTERM/SIGINT; its launchers and replica
/// servers keep running (a new agent adopts them).
async fn run_agent(cfg: NodeAgentConfig, kubeconfig: &Path) -> anyhow::Result<()> {
    let node = cfg.node_name.clone();
    // The API server may still be starting: retry for a while.
    let t0 = Instant::now();
    let store = loop {
        match KubeStore::from_kubeconfig(kubeconfig).await {
            Ok(s) => break s,
            Err(e) if t0.elapsed() < Duration::from_secs(30) => {
                tracing::warn!(error = %e, "connecting to the API server; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => {
                return Err(e).with_context(|| format!("connecting with {}", kubeconfig.display()));
            }
        }
    };
    let store: std::sync::Arc<dyn sheaf_orchestrator::store::Store> = std::sync::Arc::new(store);
    let agent = loop {
        match NodeAgent::start(cfg.clone(), store.clone()).await {
            Ok(a) => break a,
            Err(e) if t0.elapsed() < Duration::from_secs(30) => {
                tracing::warn!(error = %e, "starting the node agent; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e).context("starting the node agent"),
        }
    };
    tracing::info!(%node, "node agent running");
    let sig = wait_for_signal().await?;
    tracing::info!(%node, %sig, "node agent stopping");
    agent.shutdown();
    Ok(())
}

async fn client_cmd(cmd: Cmd, kc: &Path, data_dir: &Path, ns: &str) -> anyhow::Result<()> {
    if let Cmd::Image {
        cmd: ImageCmd::Demo {
            file,
            size_mib,
            records,
        },
    } = &cmd
    {
        if *size_mib < 2 || (2048 + 8 * records) * 512 > size_mib << 20 {
            bail!("{records} records do not fit in {size_mib} MiB (the log starts at 1 MiB)");
        }
        if let Some(parent) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        write_probe_disk(file, size_mib << 20, *records, "imported")
            .with_context(|| format!("writing {}", file.display()))?;
        println!(
            "Wrote {} ({size_mib} MiB raw, {records} probe log records)",
            file.display()
        );
        return Ok(());
    }
    if let Cmd::Image {
        cmd: ImageCmd::Linux { dir, marker },
    } = &cmd
    {
        std::fs::create_dir_all(dir).with_context(|| format!("{}", dir.display()))?;
        let img = sheaf_testkit::guest::GuestImage::build().context(
            "building the Linux guest image (scripts/setup installs the kernel and busybox)",
        )?;
        for (src, name) in [(&img.kernel, "vmlinuz"), (&img.initramfs, "initrd.img")] {
            let dst = dir.join(name);
            let _ = std::fs::remove_file(&dst);
            std::fs::copy(src, &dst)
                .with_context(|| format!("{} -> {}", src.display(), dst.display()))?;
        }
        let disk = dir.join("disk.img");
        sheaf_testkit::guest::create_disk(&disk, 16 << 20, marker)
            .with_context(|| format!("{}", disk.display()))?;
        println!(
            "Linux guest {} in {}: vmlinuz, initrd.img, disk.img (marker {marker:?})",
            img.kernel_version,
            dir.display()
        );
        return Ok(());
    }
    if let Cmd::Cluster {
        cmd: ClusterCmd::Down,
    } = &cmd
    {
        let pidf = data_dir.join("sheaf.pid");
        let pid: i32 = std::fs::read_to_string(&pidf)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .with_context(|| {
                format!(
                    "no cluster running on {} ({} missing)",
                    data_dir.display(),
                    pidf.display()
                )
            })?;
        // SAFETY: sending SIGTERM to the pid recorded by `cluster up`.
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            bail!(
                "no cluster running on {} (pid {pid} is gone)",
                data_dir.display()
            );
        }
        let t0 = Instant::now();
        // SAFETY: signal 0 only probes for the process.
        while unsafe { libc::kill(pid, 0) } == 0 {
            if t0.elapsed() > Duration::from_secs(30) {
                bail!("cluster (pid {pid}) did not stop within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!("Cluster on {} stopped.", data_dir.display());
        return Ok(());
    }
    let c = ApiClient::from_kubeconfig(kc)?;
    match cmd {
        Cmd::Status => {
            let snap = Snapshot::fetch(&c).await?;
            print!("{}", render(&snap));
        }
        Cmd::Start { vm } => vm_verb(&c, ns, &vm, "start").await?,
        Cmd::Stop { vm } => vm_verb(&c, ns, &vm, "stop").await?,
        Cmd::Restart { vm } => vm_verb(&c, ns, &vm, "restart").await?,
        Cmd::Pause { vm } => vmi_verb(&c, ns, &vm, "pause").await?,
        Cmd::Unpause { vm } => vmi_verb(&c, ns, &vm, "unpause").await?,
        Cmd::Migrate { vm, node, wait } => {
            let from = vmi_node(&c, ns, &vm).await?;
            let opts = match &node {
                Some(n) => json!({"addedNodeSelector": {"kubernetes.io/hostname": n}}),
                None => json!({}),
            };
            let r = c
                .json(
                    "PUT",
                    &format!("{}/virtualmachines/{vm}/migrate", kv(ns)),
                    Some(("application/json", &opts)),
                )
                .await?;
            println!(
                "VM {ns}/{vm}: migration {} created (from {})",
                r["migration"].as_str().unwrap_or("?"),
                from.as_deref().unwrap_or("?")
            );
            if wait {
                let to = wait_moved(&c, ns, &vm, from.as_deref(), Duration::from_secs(120)).await?;
                println!("VM {ns}/{vm} is Running on {to}");
            }
        }
        Cmd::Console { vm, no_follow } => console(&c, ns, &vm, !no_follow).await?,
        Cmd::Image {
            cmd:
                ImageCmd::Import {
                    file,
                    name,
                    size,
                    replicas,
                },
        } => image_import(&c, ns, &file, name, size, replicas).await?,
        Cmd::Node { cmd } => node_cmd(&c, cmd).await?,
        Cmd::Image { .. }
        | Cmd::Cluster { .. }
        | Cmd::Vm { .. }
        | Cmd::Replica { .. }
        | Cmd::Agent { .. }
        | Cmd::ControlPlane { .. } => {}
    }
    Ok(())
}

async fn node_cmd(c: &ApiClient, cmd: NodeCmd) -> anyhow::Result<()> {
    match cmd {
        NodeCmd::Drain { node, timeout } => node_drain(c, &node, timeout).await,
        NodeCmd::Uncordon { node } => node_uncordon(c, &node).await,
        NodeCmd::Kill { node, wait } => node_kill(c, &node, wait).await,
        NodeCmd::Restart { node } => node_restart(c, &node).await,
    }
}
