// SPDX-License-Identifier: Apache-2.0
//! Prometheus metrics of a sheaf cluster (text exposition format 0.0.4).
//!
//! Gauges are computed from the store at every scrape (VM and VMI counts per
//! phase, node readiness, volume replica health); counters come from a
//! watch on instances (scheduler decisions), from the cluster process's
//! own block I/O (image imports), whose latency is kept in histograms, and
//! from the launchers: every running instance's launcher keeps guest I/O
//! latency histograms per disk in `io-metrics.json` in its directory
//! (`<data>/nodes/<node>/launchers/<uid>/`), read at every scrape.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;
use sheaf_orchestrator::names;
use sheaf_orchestrator::resources::{Node, VirtualMachine, VirtualMachineInstance, Volume};
use sheaf_orchestrator::store::{GroupKind, ListOptions, Store, WatchOptions};

/// Upper bounds (seconds) of the latency histogram buckets (the launchers' too).
pub use sheaf_orchestrator::launcher::metrics::LATENCY_BUCKETS;
use sheaf_orchestrator::launcher::metrics::{HistogramSnapshot, IoMetrics};

/// A Prometheus histogram.
#[derive(Clone, Debug, Default)]
pub struct Histogram {
    counts: [u64; LATENCY_BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        for (i, b) in LATENCY_BUCKETS.iter().enumerate() {
            if s <= *b {
                self.counts[i] += 1;
            }
        }
        self.count += 1;
        self.sum += s;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        for (i, b) in LATENCY_BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}le=\"{b}\"}} {}",
                self.counts[i]
            );
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {}", self.count);
        let trimmed = labels.trim_end_matches(',');
        let _ = writeln!(out, "{name}_sum{{{trimmed}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{trimmed}}} {}", self.count);
    }
}

#[derive(Debug, Default)]
struct Counters {
    /// (result, node) → decisions.
    sched: BTreeMap<(String, String), u64>,
    /// uids already counted as scheduled / unschedulable.
    scheduled_uids: std::collections::HashSet<String>,
    unsched_uids: std::collections::HashSet<String>,
    /// (volume, op) → latency.
    io: BTreeMap<(String, String), Histogram>,
    /// bytes written by imports.
    import_bytes: u64,
}

/// Metrics registry shared by the cluster process.
#[derive(Debug, Clone)]
pub struct Metrics {
    store: Arc<dyn Store>,
    counters: Arc<Mutex<Counters>>,
    /// `<data>/nodes`: where the launchers' `io-metrics.json` are.
    nodes_dir: Option<PathBuf>,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    /// Metrics over `store`.
    pub fn new(store: Arc<dyn Store>) -> Metrics {
        Metrics {
            store,
            counters: Arc::default(),
            nodes_dir: None,
        }
    }

    /// Also exports the guest I/O of the launchers under `nodes_dir`
    /// (`<nodes_dir>/<node>/launchers/<uid>/io-metrics.json`).
    pub fn with_nodes_dir(mut self, nodes_dir: PathBuf) -> Metrics {
        self.nodes_dir = Some(nodes_dir);
        self
    }

    /// The launchers' guest I/O of every live instance, with its node.
    fn guest_io(&self, vmis: &[Value]) -> Vec<(String, IoMetrics)> {
        let Some(root) = &self.nodes_dir else {
            return Vec::new();
        };
        let mut v = Vec::new();
        for o in vmis {
            let phase = o["status"]["phase"].as_str().unwrap_or("");
            if matches!(phase, "Succeeded" | "Failed") {
                continue;
            }
            let (Some(node), Some(uid)) = (
                o["status"]["nodeName"].as_str(),
                o["metadata"]["uid"].as_str(),
            ) else {
                continue;
            };
            // Names come from the store: keep them inside the data directory.
            let Some(dir) = names::child(root, node)
                .and_then(|n| names::child(&n.join("launchers"), uid))
                .ok()
            else {
                continue;
            };
            if let Some(m) = IoMetrics::load(&dir) {
                v.push((node.to_string(), m));
            }
        }
        v
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a block I/O on `volume` (`op` = read/write/flush).
    pub fn observe_io(&self, volume: &str, op: &str, d: Duration, bytes: u64) {
        let mut c = self.lock();
        c.io.entry((volume.to_string(), op.to_string()))
            .or_default()
            .observe(d);
        if op == "write" {
            c.import_bytes += bytes;
        }
    }

    /// Follows instance changes and counts scheduler decisions: the first
    /// time an instance gets a node (`scheduled`) and the first time it is
    /// reported `Unschedulable`. Runs until the store's watch ends for good.
    pub fn spawn_scheduler_watch(&self) -> tokio::task::JoinHandle<()> {
        let m = self.clone();
        tokio::spawn(async move {
            let gk = GroupKind::of::<VirtualMachineInstance>();
            loop {
                let mut w = match m.store.watch(&gk, None, &WatchOptions::default()).await {
                    Ok(w) => w,
                    Err(e) => {
                        tracing::warn!(error = %e, "metrics watch");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                };
                while let Some(ev) = w.next().await {
                    let Ok(ev) = ev else { break };
                    m.count_decision(&ev.object);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    }

    fn count_decision(&self, o: &Value) {
        let uid = o["metadata"]["uid"].as_str().unwrap_or("").to_string();
        if uid.is_empty() {
            return;
        }
        let mut c = self.lock();
        if let Some(node) = o["status"]["nodeName"].as_str()
            && c.scheduled_uids.insert(uid.clone())
        {
            *c.sched
                .entry(("scheduled".into(), node.to_string()))
                .or_default() += 1;
        }
        if o["status"]["reason"].as_str() == Some("Unschedulable") && c.unsched_uids.insert(uid) {
            *c.sched
                .entry(("unschedulable".into(), String::new()))
                .or_default() += 1;
        }
    }

    async fn list(&self, gk: GroupKind) -> Vec<Value> {
        self.store
            .list(&gk, None, &ListOptions::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
    }

    /// The exposition text.
    pub async fn render(&self) -> String {
        let mut out = String::new();
        let vmis = self.list(GroupKind::of::<VirtualMachineInstance>()).await;
        let vms = self.list(GroupKind::of::<VirtualMachine>()).await;
        let nodes = self.list(GroupKind::of::<Node>()).await;
        let vols = self.list(GroupKind::of::<Volume>()).await;

        let mut phases: BTreeMap<String, u64> = [
            "Pending",
            "Scheduling",
            "Scheduled",
            "Running",
            "Succeeded",
            "Failed",
            "Unknown",
        ]
        .iter()
        .map(|p| (p.to_string(), 0))
        .collect();
        for v in &vmis {
            let p = v["status"]["phase"].as_str().unwrap_or("Pending");
            *phases.entry(p.to_string()).or_default() += 1;
        }
        out.push_str("# HELP sheaf_vmi_phase_count VirtualMachineInstances per phase.\n# TYPE sheaf_vmi_phase_count gauge\n");
        for (p, n) in &phases {
            let _ = writeln!(out, "sheaf_vmi_phase_count{{phase=\"{}\"}} {n}", escape(p));
        }
        let mut printable: BTreeMap<String, u64> = BTreeMap::new();
        for v in &vms {
            let p = v["status"]["printableStatus"].as_str().unwrap_or("Unknown");
            *printable.entry(p.to_string()).or_default() += 1;
        }
        out.push_str("# HELP sheaf_vm_status_count VirtualMachines per printable status.\n# TYPE sheaf_vm_status_count gauge\n");
        for (p, n) in &printable {
            let _ = writeln!(out, "sheaf_vm_status_count{{status=\"{}\"}} {n}", escape(p));
        }

        out.push_str("# HELP sheaf_node_ready Whether a node's agent is Ready (1) or not (0).\n# TYPE sheaf_node_ready gauge\n");
        for n in &nodes {
            let name = n["metadata"]["name"].as_str().unwrap_or("");
            let ready = n["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Ready" && c["status"] == "True")
            });
            let unsched = n["spec"]["unschedulable"].as_bool().unwrap_or(false);
            let _ = writeln!(
                out,
                "sheaf_node_ready{{node=\"{}\",unschedulable=\"{unsched}\"}} {}",
                escape(name),
                u8::from(ready)
            );
        }

        out.push_str("# HELP sheaf_volume_replicas Replicas of a volume per state.\n# TYPE sheaf_volume_replicas gauge\n");
        let mut health = String::new();
        for v in &vols {
            let name = format!(
                "{}/{}",
                v["metadata"]["namespace"].as_str().unwrap_or(""),
                v["metadata"]["name"].as_str().unwrap_or("")
            );
            let mut states: BTreeMap<&str, u64> =
                ["Healthy", "Rebuilding", "Stale", "Failed", "Creating"]
                    .iter()
                    .map(|s| (*s, 0))
                    .collect();
            for r in v["status"]["replicas"].as_array().into_iter().flatten() {
                let s = r["state"].as_str().unwrap_or("Creating");
                *states.entry(s).or_default() += 1;
            }
            for (s, n) in &states {
                let _ = writeln!(
                    out,
                    "sheaf_volume_replicas{{volume=\"{}\",state=\"{s}\"}} {n}",
                    escape(&name)
                );
            }
            let desired = v["spec"]["replicas"].as_u64().unwrap_or(3);
            let healthy = states.get("Healthy").copied().unwrap_or(0);
            let _ = writeln!(
                health,
                "sheaf_volume_healthy_ratio{{volume=\"{}\",phase=\"{}\"}} {}",
                escape(&name),
                escape(v["status"]["phase"].as_str().unwrap_or("Pending")),
                healthy as f64 / desired.max(1) as f64
            );
        }
        out.push_str("# HELP sheaf_volume_healthy_ratio Healthy replicas over desired replicas.\n# TYPE sheaf_volume_healthy_ratio gauge\n");
        out.push_str(&health);

        let c = self.lock();
        out.push_str("# HELP sheaf_scheduler_decisions_total Placement decisions for instances.\n# TYPE sheaf_scheduler_decisions_total counter\n");
        for r in ["scheduled", "unschedulable"] {
            if !c.sched.keys().any(|(res, _)| res == r) {
                let _ = writeln!(
                    out,
                    "sheaf_scheduler_decisions_total{{result=\"{r}\",node=\"\"}} 0"
                );
            }
        }
        for ((res, node), n) in &c.sched {
            let _ = writeln!(
                out,
                "sheaf_scheduler_decisions_total{{result=\"{res}\",node=\"{}\"}} {n}",
                escape(node)
            );
        }
        out.push_str("# HELP sheaf_volume_io_seconds Latency of block I/O issued by the cluster process (image imports).\n# TYPE sheaf_volume_io_seconds histogram\n");
        for ((vol, op), h) in &c.io {
            h.render(
                &mut out,
                "sheaf_volume_io_seconds",
                &format!("volume=\"{}\",op=\"{op}\",", escape(vol)),
            );
        }
        out.push_str("# HELP sheaf_import_bytes_total Bytes written into volumes by image imports.\n# TYPE sheaf_import_bytes_total counter\n");
        let _ = writeln!(out, "sheaf_import_bytes_total {}", c.import_bytes);
        drop(c);

        let guest = self.guest_io(&vmis);
        let ops = |d: &sheaf_orchestrator::launcher::metrics::DiskIoMetrics| {
            [
                ("read", d.read.clone()),
                ("write", d.write.clone()),
                ("flush", d.flush.clone()),
            ]
        };
        out.push_str("# HELP sheaf_guest_io_seconds Latency of the guests' block I/O on their volumes, timed in the launchers (replication included).\n# TYPE sheaf_guest_io_seconds histogram\n");
        let mut bytes = String::new();
        let mut errors = String::new();
        for (node, m) in &guest {
            for d in &m.disks {
                for (op, h) in ops(d) {
                    let labels = format!(
                        "volume=\"{}\",vmi=\"{}\",node=\"{}\",op=\"{op}\",",
                        escape(&d.volume),
                        escape(&m.instance),
                        escape(node)
                    );
                    render_snapshot(&mut out, "sheaf_guest_io_seconds", &labels, &h);
                    let l = labels.trim_end_matches(',');
                    let _ = writeln!(bytes, "sheaf_guest_io_bytes_total{{{l}}} {}", h.bytes);
                    let _ = writeln!(errors, "sheaf_guest_io_errors_total{{{l}}} {}", h.errors);
                }
            }
        }
        out.push_str("# HELP sheaf_guest_io_bytes_total Bytes the guests moved on their volumes.\n# TYPE sheaf_guest_io_bytes_total counter\n");
        out.push_str(&bytes);
        out.push_str("# HELP sheaf_guest_io_errors_total Guest block requests that failed.\n# TYPE sheaf_guest_io_errors_total counter\n");
        out.push_str(&errors);
        out
    }
}

/// A launcher's cumulative histogram in the exposition format.
fn render_snapshot(out: &mut String, name: &str, labels: &str, h: &HistogramSnapshot) {
    for (b, n) in LATENCY_BUCKETS.iter().zip(&h.buckets) {
        let _ = writeln!(out, "{name}_bucket{{{labels}le=\"{b}\"}} {n}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels}le=\"+Inf\"}} {}", h.count);
    let trimmed = labels.trim_end_matches(',');
    let _ = writeln!(out, "{name}_sum{{{trimmed}}} {}", h.sum_seconds);
    let _ = writeln!(out, "{name}_count{{{trimmed}}} {}", h.count);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::default();
        h.observe(Duration::from_micros(50));
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(10));
        let mut s = String::new();
        h.render(&mut s, "x", "op=\"w\",");
        assert!(s.contains("x_bucket{op=\"w\",le=\"0.0001\"} 1"), "{s}");
        assert!(s.contains("x_bucket{op=\"w\",le=\"0.005\"} 2"), "{s}");
        assert!(s.contains("x_bucket{op=\"w\",le=\"+Inf\"} 3"), "{s}");
        assert!(s.contains("x_count{op=\"w\"} 3"), "{s}");
    }

    #[tokio::test]
    async fn counts_phases_and_decisions() {
        let store: Arc<dyn Store> = Arc::new(sheaf_orchestrator::store::MemoryStore::new());
        let m = Metrics::new(store);
        let o = serde_json::json!({"metadata": {"uid": "u1"}, "status": {"nodeName": "node-1"}});
        m.count_decision(&o);
        m.count_decision(&o);
        let text = m.render().await;
        assert!(
            text.contains(
                "sheaf_scheduler_decisions_total{result=\"scheduled\",node=\"node-1\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("sheaf_vmi_phase_count{phase=\"Running\"} 0"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn exports_launcher_guest_io() {
        use sheaf_orchestrator::launcher::metrics::DiskIoStats;
        let tmp = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(sheaf_orchestrator::store::MemoryStore::new());
        let vmi = serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "demo", "namespace": "default"},
            "spec": {"domain": {"devices": {}}},
        });
        let gk = GroupKind::of::<VirtualMachineInstance>();
        let created = store.create(&gk, "default", vmi).await.unwrap();
        let uid = created["metadata"]["uid"].as_str().unwrap().to_string();
        let mut with_status = created.clone();
        with_status["status"] = serde_json::json!({"phase": "Running", "nodeName": "node-1"});
        store
            .update(
                &gk,
                "default",
                with_status,
                sheaf_orchestrator::store::UpdateScope::Status,
            )
            .await
            .unwrap();
        let dir = tmp.path().join("node-1/launchers").join(&uid);
        std::fs::create_dir_all(&dir).unwrap();
        let st = DiskIoStats::default();
        st.write.observe(Duration::from_micros(700), 4096, true);
        st.write.observe(Duration::from_millis(2), 4096, true);
        IoMetrics {
            instance: "default/demo".into(),
            uid,
            timed: true,
            disks: vec![st.snapshot("root", "default/probe-disk")],
        }
        .save(&dir)
        .unwrap();
        let m = Metrics::new(store).with_nodes_dir(tmp.path().to_path_buf());
        let text = m.render().await;
        let l = "volume=\"default/probe-disk\",vmi=\"default/demo\",node=\"node-1\",op=\"write\"";
        assert!(
            text.contains(&format!("sheaf_guest_io_seconds_count{{{l}}} 2")),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "sheaf_guest_io_seconds_bucket{{{l},le=\"0.001\"}} 1"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!("sheaf_guest_io_bytes_total{{{l}}} 8192")),
            "{text}"
        );
    }
}
