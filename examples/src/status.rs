// SPDX-License-Identifier: Apache-2.0
//! `sheaf status`: nodes, VMs and volumes (with replica health) at a glance,
//! read through the API server.

use std::fmt::Write as _;

use serde_json::Value;

use crate::client::{ApiClient, ClientError};

/// Objects shown by `sheaf status`.
#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    /// sheaf.dev Nodes.
    pub nodes: Vec<Value>,
    /// VirtualMachines.
    pub vms: Vec<Value>,
    /// VirtualMachineInstances.
    pub vmis: Vec<Value>,
    /// Volumes.
    pub volumes: Vec<Value>,
}

async fn items(c: &ApiClient, path: &str) -> Result<Vec<Value>, ClientError> {
    let v = c.get(path).await?;
    Ok(v["items"].as_array().cloned().unwrap_or_default())
}

impl Snapshot {
    /// Reads every kind (all namespaces).
    pub async fn fetch(c: &ApiClient) -> Result<Snapshot, ClientError> {
        Ok(Snapshot {
            nodes: items(c, "/apis/sheaf.dev/v1/nodes").await?,
            vms: items(c, "/apis/kubevirt.io/v1/virtualmachines").await?,
            vmis: items(c, "/apis/kubevirt.io/v1/virtualmachineinstances").await?,
            volumes: items(c, "/apis/sheaf.dev/v1/volumes").await?,
        })
    }

    /// The instance of VM `ns/name`.
    pub fn vmi(&self, ns: &str, name: &str) -> Option<&Value> {
        self.vmis.iter().find(|v| {
            v["metadata"]["namespace"].as_str() == Some(ns)
                && v["metadata"]["name"].as_str() == Some(name)
        })
    }
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}

fn ready(n: &Value) -> bool {
    n["status"]["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// Renders rows as a left-aligned table.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.chars().count());
            }
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<String>, out: &mut String| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                let _ = write!(l, "{c:<width$}   ", width = w[i]);
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(header.iter().map(|h| h.to_string()).collect(), &mut out);
    for r in rows {
        line(r.clone(), &mut out);
    }
    out
}

/// The `sheaf status` text.
pub fn render(snap: &Snapshot) -> String {
    let mut out = String::new();
    let node_rows: Vec<Vec<String>> = snap
        .nodes
        .iter()
        .map(|n| {
            let name = s(&n["metadata"]["name"]).to_string();
            let vms = snap
                .vmis
                .iter()
                .filter(|v| v["status"]["nodeName"].as_str() == Some(name.as_str()))
                .count();
            let reps = snap
                .volumes
                .iter()
                .flat_map(|v| {
                    v["status"]["replicas"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .filter(|r| r["nodeName"].as_str() == Some(name.as_str()))
                .count();
            let mut st = if ready(n) { "Ready" } else { "NotReady" }.to_string();
            if n["spec"]["unschedulable"].as_bool() == Some(true) {
                st.push_str(",SchedulingDisabled");
            }
            vec![
                name,
                st,
                s(&n["spec"]["zone"]).to_string(),
                vms.to_string(),
                reps.to_string(),
            ]
        })
        .collect();
    out.push_str(&table(
        &["NODE", "STATUS", "ZONE", "VMS", "REPLICAS"],
        &node_rows,
    ));
    out.push('\n');
    let vm_rows: Vec<Vec<String>> = snap
        .vms
        .iter()
        .map(|vm| {
            let ns = s(&vm["metadata"]["namespace"]);
            let name = s(&vm["metadata"]["name"]);
            let vmi = snap.vmi(ns, name);
            let phase = vmi
                .map(|v| s(&v["status"]["phase"]).to_string())
                .unwrap_or_else(|| "-".into());
            let node = vmi
                .and_then(|v| v["status"]["nodeName"].as_str())
                .unwrap_or("-")
                .to_string();
            let strategy = vm["spec"]["runStrategy"]
                .as_str()
                .map(str::to_string)
                .or_else(|| {
                    vm["spec"]["running"]
                        .as_bool()
                        .map(|r| format!("running={r}"))
                })
                .unwrap_or_default();
            vec![
                format!("{ns}/{name}"),
                s(&vm["status"]["printableStatus"]).to_string(),
                strategy,
                phase,
                node,
            ]
        })
        .collect();
    if vm_rows.is_empty() {
        out.push_str("No virtual machines (try: kubectl apply -f examples/vm.yaml)\n");
    } else {
        out.push_str(&table(
            &["VM", "STATUS", "STRATEGY", "VMI", "NODE"],
            &vm_rows,
        ));
    }
    out.push('\n');
    let vol_rows: Vec<Vec<String>> = snap
        .volumes
        .iter()
        .map(|v| {
            let reps = v["status"]["replicas"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let desired = v["spec"]["replicas"].as_u64().unwrap_or(3);
            let healthy = reps.iter().filter(|r| r["state"] == "Healthy").count();
            let detail: Vec<String> = reps
                .iter()
                .map(|r| {
                    format!(
                        "{}:{}",
                        s(&r["nodeName"]),
                        r["state"].as_str().unwrap_or("Creating")
                    )
                })
                .collect();
            vec![
                format!(
                    "{}/{}",
                    s(&v["metadata"]["namespace"]),
                    s(&v["metadata"]["name"])
                ),
                s(&v["spec"]["size"]).to_string(),
                s(&v["status"]["phase"]).to_string(),
                format!("{healthy}/{desired}"),
                v["status"]["attachment"]["nodeName"]
                    .as_str()
                    .unwrap_or("-")
                    .to_string(),
                detail.join(" "),
            ]
        })
        .collect();
    if vol_rows.is_empty() {
        out.push_str("No volumes (try: sheaf image import <file> --name <volume>)\n");
    } else {
        out.push_str(&table(
            &["VOLUME", "SIZE", "PHASE", "HEALTHY", "ATTACHED", "REPLICAS"],
            &vol_rows,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_nodes_vms_and_volumes() {
        let snap = Snapshot {
            nodes: vec![
                json!({"metadata": {"name": "node-0"}, "spec": {"zone": "zone-0"},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
            ],
            vms: vec![json!({"metadata": {"namespace": "default", "name": "demo"},
                "spec": {"runStrategy": "Always"}, "status": {"printableStatus": "Running"}})],
            vmis: vec![json!({"metadata": {"namespace": "default", "name": "demo"},
                "status": {"phase": "Running", "nodeName": "node-0"}})],
            volumes: vec![json!({"metadata": {"namespace": "default", "name": "d"},
                "spec": {"size": "16Mi", "replicas": 3}, "status": {"phase": "Attached",
                "attachment": {"nodeName": "node-0"},
                "replicas": [{"nodeName": "node-0", "state": "Healthy"}, {"nodeName": "node-1", "state": "Failed"}]}})],
        };
        let t = render(&snap);
        assert!(t.contains("node-0   Ready    zone-0   1     1"), "{t}");
        assert!(
            t.contains("default/demo   Running   Always     Running   node-0"),
            "{t}"
        );
        assert!(t.contains("1/3"), "{t}");
        assert!(t.contains("node-1:Failed"), "{t}");
    }
}
