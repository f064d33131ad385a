// SPDX-License-Identifier: Apache-2.0
//! Orchestrator figures on a local cluster (control plane + 3 node agents in
//! this process; launchers and replica servers as processes; probe guests
//! on /dev/kvm):
//!
//! 1. density burst (KubeVirt's CI density test): create N VMs at once,
//!    report VMs created/s, VMs Running/s, creation-to-Running p50/p99;
//! 2. failover: a VM with a 3-replica volume, kill -9 the node running it
//!    K times (restarting the node in between), report node-death-to-
//!    Running-elsewhere p50/p99.
//!
//! ```text
//! cargo build --release -p sheaf-orchestrator --bin sheaf-launcher --example orch_bench
//! target/release/examples/orch_bench [--vms 100] [--kills 20] [--grace-ms 3000]
//!     [--volumes 0|1|3] [--store memory|redb] [--launcher PATH]
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::StreamExt;
use serde_json::{Value, json};
use sheaf_orchestrator::cluster::{LocalCluster, LocalClusterConfig, StoreKind};
use sheaf_orchestrator::resources::{
    FieldValidation, Node, Resource, VirtualMachine, VirtualMachineInstance, Volume, decode,
};
use sheaf_orchestrator::store::{EventType, GroupKind, Store, StoreExt, WatchOptions};

#[derive(Parser, Debug)]
#[command(about = "Density and failover figures of the sheaf orchestrator")]
struct Args {
    /// VMs in the burst (0 skips it).
    #[arg(long, default_value_t = 100)]
    vms: usize,
    /// Node kills in the failover run (0 skips it).
    #[arg(long, default_value_t = 20)]
    kills: usize,
    /// Node grace period (missed heartbeats before failover), ms.
    #[arg(long, default_value_t = 3000)]
    grace_ms: u64,
    /// Heartbeat interval, ms.
    #[arg(long, default_value_t = 500)]
    heartbeat_ms: u64,
    /// Replicas of a per-VM volume in the burst (0: no volume, like
    /// KubeVirt's containerDisk density test).
    #[arg(long, default_value_t = 0)]
    volumes: u32,
    /// Store backend.
    #[arg(long, default_value = "memory")]
    store: String,
    /// The sheaf-launcher binary (default: next to this example's directory).
    #[arg(long)]
    launcher: Option<PathBuf>,
    /// Data directory (default: a temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn gk<K: Resource>() -> GroupKind {
    GroupKind::of::<K>()
}

fn vm(name: &str, args: &str, volume: Option<&str>) -> Result<VirtualMachine> {
    let mut v = json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"runStrategy": "Always", "template": {"spec": {"domain": {
            "cpu": {"cores": 1}, "memory": {"guest": "32Mi"},
            "resources": {"requests": {"cpu": "100m"}},
            "firmware": {"kernelBoot": {"kernelArgs": format!("console=ttyS0 {args}"),
                                         "container": {"image": "sheaf.dev/probe"}}},
            "devices": {"disks": []}}}}}
    });
    if let Some(vol) = volume {
        v["spec"]["template"]["spec"]["domain"]["devices"]["disks"] =
            json!([{"name": "root", "disk": {}}]);
        v["spec"]["template"]["spec"]["volumes"] =
            json!([{"name": "root", "persistentVolumeClaim": {"claimName": vol}}]);
    }
    Ok(decode::<VirtualMachine>(&v, FieldValidation::Strict)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .0)
}

fn volume(name: &str, size: &str, replicas: u32) -> Result<Volume> {
    let v = json!({"apiVersion": "sheaf.dev/v1", "kind": "Volume",
                   "metadata": {"name": name, "namespace": "default"},
                   "spec": {"size": size, "replicas": replicas}});
    Ok(decode::<Volume>(&v, FieldValidation::Strict)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .0)
}

fn running(o: &Value) -> bool {
    o["status"]["phase"] == "Running"
}

/// Waits through a watch until `pred` holds for object `name`.
async fn wait_for(
    store: &Arc<dyn Store>,
    kind: &GroupKind,
    ns: &str,
    name: &str,
    timeout: Duration,
    pred: impl Fn(&Value) -> bool,
) -> Result<Value> {
    let opts = WatchOptions {
        fields: sheaf_orchestrator::store::FieldSelector::parse(&format!("metadata.name={name}"))?,
        ..Default::default()
    };
    let deadline = Instant::now() + timeout;
    loop {
        let mut w = store
            .watch(kind, (!ns.is_empty()).then_some(ns), &opts)
            .await?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, w.next()).await {
                Ok(Some(Ok(ev))) if ev.type_ != EventType::Deleted && pred(&ev.object) => {
                    return Ok(ev.object);
                }
                Ok(Some(Ok(_))) => {}
                Ok(Some(Err(_))) | Ok(None) => break,
                Err(_) => bail!("timed out waiting for {kind} {ns}/{name}"),
            }
        }
    }
}

async fn density(cluster: &LocalCluster, n: usize, replicas: u32) -> Result<()> {
    let store = cluster.store().clone();
    // Watch every VMI: record when each first reaches Running.
    let mut w = store
        .watch(
            &gk::<VirtualMachineInstance>(),
            Some("default"),
            &WatchOptions::default(),
        )
        .await?;
    if replicas > 0 {
        for i in 0..n {
            store
                .create_typed(&volume(&format!("dv-{i}"), "4Mi", replicas)?)
                .await?;
        }
    }
    let mut created = Vec::with_capacity(n);
    let t0 = Instant::now();
    for i in 0..n {
        let name = format!("burst-{i}");
        let vol = (replicas > 0).then(|| format!("dv-{i}"));
        store
            .create_typed(&vm(&name, "probe.halt=1", vol.as_deref())?)
            .await?;
        created.push((name, Instant::now()));
    }
    let submit = t0.elapsed();
    let mut running_at = std::collections::HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(600);
    while running_at.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, w.next()).await {
            Ok(Some(Ok(ev))) => {
                if running(&ev.object) {
                    let name = ev.object["metadata"]["name"]
                        .as_str()
                        .unwrap_or("")
                        .to_string();
                    running_at.entry(name).or_insert_with(Instant::now);
                }
            }
            Ok(Some(Err(e))) => bail!("watch: {e}"),
            Ok(None) => bail!("watch ended"),
            Err(_) => bail!("only {} of {n} VMs running after 600 s", running_at.len()),
        }
    }
    let all = t0.elapsed();
    let mut lat: Vec<Duration> = created
        .iter()
        .filter_map(|(name, t)| running_at.get(name).map(|r| r.duration_since(*t)))
        .collect();
    lat.sort();
    println!(
        "density burst: {n} VMs (probe guest, {} per VM)",
        if replicas > 0 {
            format!("{replicas}-replica 4 MiB volume")
        } else {
            "no volume".into()
        }
    );
    println!(
        "  VM objects created     {:>8.1} VMs/s ({n} in {:.2} s)",
        n as f64 / submit.as_secs_f64(),
        submit.as_secs_f64()
    );
    println!(
        "  VMs Running            {:>8.1} VMs/s (last Running {:.2} s after the first create)",
        n as f64 / all.as_secs_f64(),
        all.as_secs_f64()
    );
    println!(
        "  creation -> Running    p50 {:.0} ms  p99 {:.0} ms  max {:.0} ms",
        percentile(&lat, 0.5).as_secs_f64() * 1e3,
        percentile(&lat, 0.99).as_secs_f64() * 1e3,
        lat.last().copied().unwrap_or_default().as_secs_f64() * 1e3
    );
    // Clean up: delete the VMs and wait for their instances to go.
    for i in 0..n {
        let _ = store
            .delete_typed::<VirtualMachine>("default", &format!("burst-{i}"))
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let left = store
            .list(
                &gk::<VirtualMachineInstance>(),
                Some("default"),
                &Default::default(),
            )
            .await?
            .items
            .len();
        if left == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!("{left} instances left after deleting the burst");
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), w.next()).await;
    }
    for i in 0..n {
        if replicas > 0 {
            let _ = store
                .delete_typed::<Volume>("default", &format!("dv-{i}"))
                .await;
        }
    }
    Ok(())
}

async fn failover(cluster: &mut LocalCluster, kills: usize) -> Result<()> {
    let store = cluster.store().clone();
    store.create_typed(&volume("fo-disk", "16Mi", 3)?).await?;
    wait_for(
        &store,
        &gk::<Volume>(),
        "default",
        "fo-disk",
        Duration::from_secs(60),
        |o| o["status"]["phase"] == "Available",
    )
    .await?;
    store
        .create_typed(&vm("fo", "probe.log=1 probe.halt=1", Some("fo-disk"))?)
        .await?;
    let mut v = wait_for(
        &store,
        &gk::<VirtualMachineInstance>(),
        "default",
        "fo",
        Duration::from_secs(60),
        running,
    )
    .await?;
    let mut times = Vec::new();
    for round in 0..kills {
        let node = v["status"]["nodeName"].as_str().unwrap_or("").to_string();
        let uid = v["metadata"]["uid"].as_str().unwrap_or("").to_string();
        let t0 = Instant::now();
        cluster.kill_node(&node)?;
        v = wait_for(
            &store,
            &gk::<VirtualMachineInstance>(),
            "default",
            "fo",
            Duration::from_secs(60),
            |o| running(o) && o["metadata"]["uid"] != uid.as_str(),
        )
        .await
        .with_context(|| format!("round {round}"))?;
        let d = t0.elapsed();
        times.push(d);
        println!(
            "  kill {:>2}: {node} -> {}  {:.2} s",
            round + 1,
            v["status"]["nodeName"].as_str().unwrap_or(""),
            d.as_secs_f64()
        );
        // Bring the node back and let its replica catch up before the next kill.
        cluster.restart_node(&node).await?;
        wait_for(
            &store,
            &gk::<Node>(),
            "",
            &node,
            Duration::from_secs(30),
            |o| {
                o["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                }) && o["spec"]["taints"].is_null()
            },
        )
        .await?;
        let healthy = wait_for(
            &store,
            &gk::<Volume>(),
            "default",
            "fo-disk",
            Duration::from_secs(30),
            |o| {
                o["status"]["replicas"]
                    .as_array()
                    .is_some_and(|r| r.iter().all(|r| r["state"] == "Healthy"))
            },
        )
        .await;
        if healthy.is_err() {
            println!("  (replica on {node} not healthy again within 30 s)");
        }
    }
    times.sort();
    println!(
        "failover over {kills} node kills: p50 {:.2} s  p99 {:.2} s  min {:.2} s  max {:.2} s",
        percentile(&times, 0.5).as_secs_f64(),
        percentile(&times, 0.99).as_secs_f64(),
        times.first().copied().unwrap_or_default().as_secs_f64(),
        times.last().copied().unwrap_or_default().as_secs_f64()
    );
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let launcher = match args.launcher {
        Some(p) => p,
        None => std::env::current_exe()?
            .parent()
            .and_then(|p| p.parent())
            .map(|p| p.join("sheaf-launcher"))
            .context("locating sheaf-launcher")?,
    };
    if !launcher.exists() {
        bail!(
            "{} not found: build it with `cargo build -p sheaf-orchestrator --bin sheaf-launcher` (same profile)",
            launcher.display()
        );
    }
    let tmp = tempfile_dir(args.dir)?;
    let mut cfg = LocalClusterConfig::new(&tmp, &launcher);
    cfg.control.node_grace_period = Duration::from_millis(args.grace_ms);
    cfg.heartbeat_interval = Duration::from_millis(args.heartbeat_ms);
    cfg.store = if args.store == "redb" {
        StoreKind::Redb
    } else {
        StoreKind::Memory
    };
    let mut cluster = LocalCluster::start(cfg).await?;
    for n in cluster.node_names() {
        wait_for(
            cluster.store(),
            &gk::<Node>(),
            "",
            &n,
            Duration::from_secs(30),
            |o| {
                o["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
            },
        )
        .await?;
    }
    println!(
        "sheaf orchestrator bench: 3 nodes, store {}, heartbeat {} ms, grace {} ms, {} CPUs",
        args.store,
        args.heartbeat_ms,
        args.grace_ms,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    if args.vms > 0 {
        density(&cluster, args.vms, args.volumes).await?;
    }
    if args.kills > 0 {
        failover(&mut cluster, args.kills).await?;
    }
    cluster.shutdown().await;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(())
}

fn tempfile_dir(dir: Option<PathBuf>) -> Result<PathBuf> {
    let d = match dir {
        Some(d) => d,
        None => std::env::temp_dir().join(format!("sheaf-orch-bench-{}", std::process::id())),
    };
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
