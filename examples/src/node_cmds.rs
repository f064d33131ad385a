// SPDX-License-Identifier: Apache-2.0
//! `sheaf node ...`: cordon and drain (a migration request for every
//! running VMI), uncordon, and the kill/restart demo verbs.

use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::json;

use crate::client::ApiClient;
use crate::commands::wait_moved;

fn node_path(n: &str) -> String {
    format!("/apis/sheaf.dev/v1/nodes/{n}")
}

/// Cordons `node`, asks a migration for each of its running VMIs and waits
/// (up to `timeout` seconds) until none is left on it.
pub async fn node_drain(c: &ApiClient, node: &str, timeout: u64) -> anyhow::Result<()> {
    c.json(
        "PATCH",
        &node_path(node),
        Some((
            "application/merge-patch+json",
            &json!({"spec": {"unschedulable": true}}),
        )),
    )
    .await?;
    println!("node/{node} cordoned");
    let on_node = |c: ApiClient, node: String| async move {
        let l = c
            .get(&format!(
                "/apis/kubevirt.io/v1/virtualmachineinstances?fieldSelector=status.nodeName%3D{node}"
            ))
            .await?;
        Ok::<_, anyhow::Error>(l["items"].as_array().cloned().unwrap_or_default())
    };
    let vmis = on_node(c.clone(), node.to_string()).await?;
    for v in &vmis {
        let ns = v["metadata"]["namespace"].as_str().unwrap_or("default");
        let name = v["metadata"]["name"].as_str().unwrap_or("");
        if v["status"]["phase"] != "Running" {
            continue;
        }
        let m = json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
            "metadata": {"generateName": format!("{name}-drain-"), "namespace": ns},
            "spec": {"vmiName": name},
        });
        c.json(
            "POST",
            &format!("/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstancemigrations"),
            Some(("application/json", &m)),
        )
        .await?;
        println!("evicting vmi/{ns}/{name} (migration)");
    }
    let t0 = Instant::now();
    loop {
        let left = on_node(c.clone(), node.to_string()).await?;
        let running: Vec<String> = left
            .iter()
            .filter(|v| !matches!(v["status"]["phase"].as_str(), Some("Succeeded" | "Failed")))
            .map(|v| {
                format!(
                    "{}/{}",
                    v["metadata"]["namespace"].as_str().unwrap_or(""),
                    v["metadata"]["name"].as_str().unwrap_or("")
                )
            })
            .collect();
        if running.is_empty() {
            break;
        }
        if t0.elapsed() > Duration::from_secs(timeout) {
            bail!("node/{node}: still running after {timeout} s: {running:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for v in &vmis {
        let ns = v["metadata"]["namespace"].as_str().unwrap_or("default");
        let name = v["metadata"]["name"].as_str().unwrap_or("");
        if let Ok(to) = wait_moved(c, ns, name, Some(node), Duration::from_secs(timeout)).await {
            println!("vmi/{ns}/{name} running on {to}");
        }
    }
    println!("node/{node} drained");
    Ok(())
}

/// Makes `node` schedulable again.
pub async fn node_uncordon(c: &ApiClient, node: &str) -> anyhow::Result<()> {
    c.json(
        "PATCH",
        &node_path(node),
        Some((
            "application/merge-patch+json",
            &json!({"spec": {"unschedulable": false}}),
        )),
    )
    .await?;
    println!("node/{node} uncordoned");
    Ok(())
}

/// Kills `node` like a power cut; with `wait`, waits until its VMs run elsewhere.
pub async fn node_kill(c: &ApiClient, node: &str, wait: bool) -> anyhow::Result<()> {
    let l = c
        .get(&format!(
            "/apis/kubevirt.io/v1/virtualmachineinstances?fieldSelector=status.nodeName%3D{node}"
        ))
        .await?;
    let victims: Vec<(String, String)> = l["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|v| {
            (
                v["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                v["metadata"]["name"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    c.json(
        "POST",
        &format!("/apis/subresources.sheaf.dev/v1/nodes/{node}/kill"),
        Some(("application/json", &json!({}))),
    )
    .await?;
    println!(
        "node/{node} killed ({} VM{} were on it)",
        victims.len(),
        if victims.len() == 1 { "" } else { "s" }
    );
    if wait {
        let t0 = Instant::now();
        for (ns, name) in &victims {
            let to = wait_moved(c, ns, name, Some(node), Duration::from_secs(120)).await?;
            println!(
                "vmi/{ns}/{name} running on {to} ({:.1} s after the kill)",
                t0.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

/// Starts a killed node again.
pub async fn node_restart(c: &ApiClient, node: &str) -> anyhow::Result<()> {
    c.json(
        "POST",
        &format!("/apis/subresources.sheaf.dev/v1/nodes/{node}/restart"),
        Some(("application/json", &json!({}))),
    )
    .await?;
    println!("node/{node} restarted");
    Ok(())
}
