// SPDX-License-Identifier: Apache-2.0
//! Helpers for the multi-node tests: a local cluster, watch-based waits,
//! probe-guest VMs and the probe's on-disk log format.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};
use sheaf_orchestrator::cluster::{LocalCluster, LocalClusterConfig};
use sheaf_orchestrator::resources::{FieldValidation, RunStrategy, VirtualMachine, Volume};
use sheaf_orchestrator::resources::{Resource, decode};
use sheaf_orchestrator::store::{
    FieldSelector, GroupKind, Store, StoreExt, UpdateScope, WatchOptions,
};

pub fn kvm_available() -> bool {
    if Path::new("/dev/kvm").exists() {
        return true;
    }
    eprintln!("SKIP: /dev/kvm is absent; the probe guest needs KVM");
    false
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("sheaf_orchestrator=info")),
        )
        .with_test_writer()
        .try_init();
}

pub async fn start_cluster(dir: &Path, nodes: usize) -> LocalCluster {
    let mut cfg = LocalClusterConfig::new(dir, env!("CARGO_BIN_EXE_sheaf-launcher"));
    cfg.nodes = nodes;
    let c = LocalCluster::start(cfg).await.unwrap();
    for n in c.node_names() {
        wait_json(
            c.store(),
            &gk::<sheaf_orchestrator::resources::Node>(),
            "",
            &n,
            Duration::from_secs(20),
            ready,
        )
        .await;
    }
    c
}

pub fn gk<K: Resource>() -> GroupKind {
    GroupKind::of::<K>()
}

pub fn ready(o: &Value) -> bool {
    o.pointer("/status/conditions")
        .and_then(Value::as_array)
        .is_some_and(|c| {
            c.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
}

/// Waits (through a watch, no polling) until object `name` satisfies `pred`;
/// returns it. Panics with the last state seen after `timeout`.
pub async fn wait_json(
    store: &Arc<dyn Store>,
    kind: &GroupKind,
    ns: &str,
    name: &str,
    timeout: Duration,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let opts = WatchOptions {
        fields: FieldSelector::parse(&format!("metadata.name={name}")).unwrap(),
        ..Default::default()
    };
    let ns_opt = (!ns.is_empty()).then_some(ns);
    let mut last = Value::Null;
    let deadline = Instant::now() + timeout;
    loop {
        let mut w = store.watch(kind, ns_opt, &opts).await.unwrap();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, w.next()).await {
                Ok(Some(Ok(ev))) => {
                    if ev.type_ != sheaf_orchestrator::store::EventType::Deleted && pred(&ev.object)
                    {
                        return ev.object;
                    }
                    last = ev.object;
                }
                Ok(Some(Err(_))) | Ok(None) => break,
                Err(_) => panic!(
                    "timed out after {timeout:?} waiting for {kind} {ns}/{name}; last state:\n{}",
                    serde_json::to_string_pretty(&last).unwrap()
                ),
            }
        }
    }
}

/// Waits until object `name` does not exist.
pub async fn wait_gone(
    store: &Arc<dyn Store>,
    kind: &GroupKind,
    ns: &str,
    name: &str,
    timeout: Duration,
) {
    let opts = WatchOptions {
        fields: FieldSelector::parse(&format!("metadata.name={name}")).unwrap(),
        ..Default::default()
    };
    let deadline = Instant::now() + timeout;
    let mut w = store
        .watch(kind, (!ns.is_empty()).then_some(ns), &opts)
        .await
        .unwrap();
    if store.get(kind, ns, name).await.is_err() {
        return;
    }
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, w.next()).await {
            Ok(Some(Ok(ev))) if ev.type_ == sheaf_orchestrator::store::EventType::Deleted => return,
            Ok(Some(_)) => {}
            Ok(None) => panic!("watch ended"),
            Err(_) => panic!("timed out waiting for {kind} {ns}/{name} to go away"),
        }
    }
}

pub fn decode_yaml<K: Resource>(yaml: &str) -> K {
    let v: Value = serde_yaml::from_str(yaml).unwrap();
    decode::<K>(&v, FieldValidation::Strict)
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

pub fn volume(name: &str, size: &str, replicas: u32) -> Volume {
    decode_yaml(&format!(
        "apiVersion: sheaf.dev/v1\nkind: Volume\nmetadata: {{name: {name}, namespace: default}}\nspec: {{size: {size}, replicas: {replicas}}}\n"
    ))
}

/// A VM running the probe guest with `args` on its command line, and an
/// optional sheaf volume as its disk.
pub fn probe_vm(
    name: &str,
    strategy: &str,
    args: &str,
    volume: Option<&str>,
    cpu: &str,
) -> VirtualMachine {
    let mut v = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "runStrategy": strategy,
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "domain": {
                        "cpu": {"cores": 1},
                        "memory": {"guest": "32Mi"},
                        "resources": {"requests": {"cpu": cpu}},
                        "firmware": {"kernelBoot": {
                            "kernelArgs": format!("console=ttyS0 {args}"),
                            "container": {"image": "sheaf.dev/probe"}
                        }},
                        "devices": {"disks": []}
                    }
                }
            }
        }
    });
    if let Some(vol) = volume {
        v["spec"]["template"]["spec"]["domain"]["devices"]["disks"] =
            json!([{"name": "root", "disk": {"bus": "virtio"}, "serial": "sheaf-root"}]);
        v["spec"]["template"]["spec"]["volumes"] =
            json!([{"name": "root", "persistentVolumeClaim": {"claimName": vol}}]);
    }
    decode::<VirtualMachine>(&v, FieldValidation::Strict)
        .unwrap_or_else(|e| panic!("{e}"))
        .0
}

/// Sets VM `name`'s `runStrategy` (clearing `running`).
pub async fn set_strategy(store: &Arc<dyn Store>, name: &str, s: RunStrategy) {
    store
        .modify_typed(
            "default",
            name,
            UpdateScope::Main,
            |vm: &mut VirtualMachine| {
                vm.spec.run_strategy = Some(s);
                vm.spec.running = None;
            },
        )
        .await
        .unwrap();
}

pub async fn create<K: Resource>(store: &Arc<dyn Store>, obj: &K) -> K {
    store.create_typed(obj).await.unwrap()
}

// ---- the probe guest's log (vmm/guest/probe.rs, probe.log=N) ----

/// First sector of the log.
pub const LOG_BASE_SECTOR: u64 = 2048;

/// Volume block of record `k`.
pub fn log_block(k: u64) -> u64 {
    LOG_BASE_SECTOR / 8 + k
}

fn fnv1a(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Whether `block` holds a valid record `k` (magic, index, pattern, checksum).
pub fn valid_record(block: &[u8], k: u64) -> bool {
    if block.len() < 512 || &block[..8] != b"SHEAFLOG" {
        return false;
    }
    let idx = u64::from_le_bytes(block[8..16].try_into().unwrap());
    let sum = u64::from_le_bytes(block[504..512].try_into().unwrap());
    let pattern =
        (48..504).all(|i| block[i] == (k.wrapping_mul(31).wrapping_add(i as u64) & 0xff) as u8);
    idx == k && pattern && sum == fnv1a(&block[..504])
}

/// The record indexes acknowledged on a console (`log: ack k`).
pub fn acks(console: &str) -> Vec<u64> {
    console
        .lines()
        .filter_map(|l| l.trim().strip_prefix("log: ack "))
        .filter_map(|n| n.trim().parse().ok())
        .collect()
}

/// `log: found K records` on a console.
pub fn found(console: &str) -> Option<u64> {
    console.lines().find_map(|l| {
        l.trim()
            .strip_prefix("log: found ")?
            .strip_suffix(" records")?
            .parse()
            .ok()
    })
}

/// Reads a console log (empty while it does not exist yet).
///
/// A live console (`launchers/<uid>/console.log`) is renamed to
/// `launchers/<uid>.console.log` when the agent cleans up an ended
/// launcher, possibly between [`console_of`] and this read; the rename is
/// atomic, so a live path that is gone is read at the kept path instead.
pub fn read_console(path: &Path) -> String {
    let data = std::fs::read(path).or_else(|e| match kept_console(path) {
        Some(kept) if e.kind() == std::io::ErrorKind::NotFound => std::fs::read(kept),
        _ => Err(e),
    });
    String::from_utf8_lossy(&data.unwrap_or_default()).into_owned()
}

/// `launchers/<uid>.console.log` for a live `launchers/<uid>/console.log`.
fn kept_console(live: &Path) -> Option<PathBuf> {
    if live.file_name()? != "console.log" {
        return None;
    }
    let dir = live.parent()?;
    let uid = dir.file_name()?.to_str()?;
    Some(dir.parent()?.join(format!("{uid}.console.log")))
}

/// Waits until the console at `path` satisfies `pred` (the file has no
/// change notification here, so this checks it every 50 ms up to `timeout`).
pub async fn wait_console(path: &Path, timeout: Duration, pred: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let c = read_console(path);
        if pred(&c) {
            return c;
        }
        if Instant::now() > deadline {
            panic!("timed out waiting on console {}:\n{c}", path.display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The replica store directory of `volume` (default namespace) on a node.
pub fn replica_store(node_dir: &Path, volume: &str) -> PathBuf {
    node_dir
        .join("replicas")
        .join(format!("default_{volume}"))
        .join("store")
}

/// Console of instance `uid` on `node_dir`, live or after cleanup.
pub fn console_of(node_dir: &Path, uid: &str) -> PathBuf {
    let live = node_dir.join("launchers").join(uid).join("console.log");
    if live.exists() {
        live
    } else {
        node_dir
            .join("launchers")
            .join(format!("{uid}.console.log"))
    }
}
