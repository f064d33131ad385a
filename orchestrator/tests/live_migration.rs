// SPDX-License-Identifier: Apache-2.0
//! Live migration on a local 3-node cluster (real launcher processes,
//! 3-replica volume, probe guest on /dev/kvm): a guest that keeps appending
//! records to its volume moves with a `VirtualMachineInstanceMigration`;
//! it does not reboot, its log goes on from the same record on the target,
//! every acknowledged record is on the volume, and the volume's attachment
//! follows the guest.
#![allow(clippy::unwrap_used)]

mod cluster_common;

use std::time::Duration;

use cluster_common::*;
use serde_json::Value;
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::volume::{Volume as Engine, VolumeConfig};
use sheaf_orchestrator::resources::{
    RunStrategy, VirtualMachineInstance, VirtualMachineInstanceMigration, Volume,
};
use sheaf_orchestrator::store::StoreExt;

const T: Duration = Duration::from_secs(60);

fn phase(o: &Value) -> &str {
    o["status"]["phase"].as_str().unwrap_or("")
}

fn live_migratable(o: &Value) -> bool {
    o["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "LiveMigratable" && c["status"] == "True")
}

fn assert_consecutive(seq: &[u64]) {
    assert!(
        seq.windows(2).all(|w| w[1] == w[0] + 1),
        "acks not consecutive: {seq:?}"
    );
}

/// A running probe guest `name` appending a record every 20 ms to a fresh
/// 3-replica volume `disk`, with 10 (or `min_acks`) acknowledged:
/// (its node, its uid, its console).
async fn writing_guest(
    cluster: &sheaf_orchestrator::cluster::LocalCluster,
    name: &str,
    disk: &str,
    min_acks: usize,
) -> (String, String, std::path::PathBuf) {
    let store = cluster.store();
    create(store, &volume(disk, "8Mi", 3)).await;
    let args = "probe.log=100000 probe.log_pause=20000";
    create(store, &probe_vm(name, "Always", args, Some(disk), "100m")).await;
    let v = wait_json(
        store,
        &gk::<VirtualMachineInstance>(),
        "default",
        name,
        T,
        |o| phase(o) == "Running" && live_migratable(o),
    )
    .await;
    let src = v["status"]["nodeName"].as_str().unwrap().to_string();
    let uid = v["metadata"]["uid"].as_str().unwrap().to_string();
    let console = console_of(&cluster.node_dir(&src), &uid);
    wait_console(&console, T, |c| acks(c).len() >= min_acks).await;
    (src, uid, console)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_writing_guest_moves_live_and_keeps_every_record() {
    if !kvm_available() || sheaf_testkit::skip_slow("a_writing_guest_moves_live") {
        return;
    }
    init_tracing();
    let tmp = tempfile::tempdir().unwrap();
    let cluster = start_cluster(tmp.path(), 3).await;
    let store = cluster.store().clone();
    let vmi_k = gk::<VirtualMachineInstance>();
    let (src, uid, src_console) = writing_guest(&cluster, "walker", "lmdisk", 10).await;

    // The target is chosen with KubeVirt's addedNodeSelector.
    let want = cluster
        .node_names()
        .into_iter()
        .filter(|n| *n != src)
        .max()
        .unwrap();
    let mig: VirtualMachineInstanceMigration = decode_yaml(&format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata: {{name: live1, namespace: default}}\nspec: {{vmiName: walker, addedNodeSelector: {{kubernetes.io/hostname: {want}}}}}\n",
    ));
    create(&store, &mig).await;
    let m = wait_json(
        &store,
        &gk::<VirtualMachineInstanceMigration>(),
        "default",
        "live1",
        T,
        |o| phase(o) == "Succeeded" || phase(o) == "Failed",
    )
    .await;
    assert_eq!(phase(&m), "Succeeded", "{m:#}");

    let v = wait_json(&store, &vmi_k, "default", "walker", T, |o| {
        phase(o) == "Running"
    })
    .await;
    let dst = v["status"]["nodeName"].as_str().unwrap().to_string();
    assert_ne!(dst, src, "{v:#}");
    assert_eq!(dst, want, "addedNodeSelector picks the target: {v:#}");
    assert_eq!(v["metadata"]["uid"].as_str(), Some(uid.as_str()));
    let ms = &v["status"]["migrationState"];
    assert_eq!(ms["mode"], "PreCopy", "{ms:#}");
    assert_eq!(ms["completed"], true, "{ms:#}");
    assert!(ms["failed"].is_null(), "{ms:#}");
    assert_eq!(ms["sourceNode"].as_str(), Some(src.as_str()));
    assert_eq!(ms["targetNode"].as_str(), Some(dst.as_str()));
    assert_eq!(ms["targetNodeDomainDetected"], true, "{ms:#}");
    assert!(ms["targetNodeAddress"].is_string(), "{ms:#}");

    // The guest did not reboot: the target's console goes on with the
    // next records, none lost or repeated across the move.
    let dst_console = console_of(&cluster.node_dir(&dst), &uid);
    let after = wait_console(&dst_console, T, |c| acks(c).len() >= 10).await;
    assert!(
        !after.contains("sheaf-probe: boot") && found(&after).is_none(),
        "the guest rebooted on the target:\n{after}"
    );
    let before = wait_console(&src_console, T, |c| !c.is_empty()).await;
    let mut seq = acks(&before);
    let on_src = seq.len();
    seq.extend(acks(&after));
    assert!(on_src >= 10, "{before}");
    assert_consecutive(&seq);

    // The volume's attachment followed the guest, with the engine's epoch.
    let vol: Volume = store.get_typed("default", "lmdisk").await.unwrap();
    let st = vol.status.clone().unwrap();
    let att = st.attachment.clone().unwrap();
    assert_eq!(att.node_name, dst, "{st:?}");
    assert_eq!(att.instance_uid.as_deref(), Some(uid.as_str()));

    // Stop the guest and read the volume with an engine of our own: every
    // record acknowledged on either node is there.
    set_strategy(&store, "walker", RunStrategy::Halted).await;
    wait_gone(&store, &vmi_k, "default", "walker", T).await;
    let acked = acks(&read_console(&dst_console));
    let last = *acked.last().unwrap_or(&seq[seq.len() - 1]);
    let vol: Volume = store.get_typed("default", "lmdisk").await.unwrap();
    let st = vol.status.unwrap();
    let addrs: Vec<std::net::SocketAddr> = st
        .replicas
        .iter()
        .flatten()
        .filter_map(|r| r.address.as_deref()?.parse().ok())
        .collect();
    assert_eq!(addrs.len(), 3, "{:?}", st.replicas);
    let secret = Secret::from_file(cluster.secret_file()).unwrap();
    let mut cfg = VolumeConfig::remote(&addrs, secret);
    cfg.min_epoch = st.epoch.unwrap_or(0);
    let engine = Engine::attach(cfg).await.unwrap();
    for k in 0..=last {
        let b = engine.read(log_block(k) * 4096, 4096).await.unwrap();
        assert!(
            valid_record(&b, k),
            "acknowledged record {k} of 0..={last} is missing"
        );
    }
    engine.detach().await.unwrap();
    cluster.shutdown().await;
}

/// kill -9 of the target launcher before the switch-over: the migration
/// fails naming the target, the guest never stops on the source and its
/// log goes on there. The source agent is held stopped while the target
/// listens so that the kill lands before any memory moves (its launcher
/// runs on meanwhile and is adopted when the agent comes back).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_target_fails_the_migration_and_the_source_runs_on() {
    if !kvm_available() || sheaf_testkit::skip_slow("a_killed_target_fails_the_migration") {
        return;
    }
    init_tracing();
    let tmp = tempfile::tempdir().unwrap();
    let mut cluster = start_cluster(tmp.path(), 3).await;
    let store = cluster.store().clone();
    let vmi_k = gk::<VirtualMachineInstance>();
    let (src, _uid, src_console) = writing_guest(&cluster, "stayer", "kdisk", 5).await;
    let want = cluster
        .node_names()
        .into_iter()
        .filter(|n| *n != src)
        .min()
        .unwrap();

    cluster.stop_agent(&src).unwrap();
    let mig: VirtualMachineInstanceMigration = decode_yaml(&format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata: {{name: doomed, namespace: default}}\nspec: {{vmiName: stayer, addedNodeSelector: {{kubernetes.io/hostname: {want}}}}}\n",
    ));
    create(&store, &mig).await;
    wait_json(&store, &vmi_k, "default", "stayer", T, |o| {
        o["status"]["migrationState"]["targetNodeAddress"].is_string()
    })
    .await;
    let target = cluster.agent(&want).unwrap().launchers();
    assert_eq!(target.len(), 1, "one incoming launcher on {want}");
    let pid = target[0].pid.unwrap() as i32;
    // SAFETY: kill(2) on a child launcher's pid; no memory is involved.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let m = wait_json(
        &store,
        &gk::<VirtualMachineInstanceMigration>(),
        "default",
        "doomed",
        T,
        |o| phase(o) == "Succeeded" || phase(o) == "Failed",
    )
    .await;
    cluster.restart_node(&src).await.unwrap();
    assert_eq!(phase(&m), "Failed", "{m:#}");
    let v: Value = serde_json::to_value(
        store
            .get_typed::<VirtualMachineInstance>("default", "stayer")
            .await
            .unwrap(),
    )
    .unwrap();
    let ms = &v["status"]["migrationState"];
    assert_eq!(ms["failed"], true, "{ms:#}");
    assert!(
        ms["failureReason"]
            .as_str()
            .unwrap_or("")
            .contains("target"),
        "{ms:#}"
    );
    assert_eq!(v["status"]["nodeName"].as_str(), Some(src.as_str()));
    assert_eq!(phase(&v), "Running", "{v:#}");

    // One guest, never stopped: its log goes on on the source.
    let before = acks(&read_console(&src_console)).len();
    let c = wait_console(&src_console, T, |c| acks(c).len() >= before + 10).await;
    assert_eq!(c.matches("sheaf-probe: boot").count(), 1, "{c}");
    assert_consecutive(&acks(&c));
    assert!(
        cluster.agent(&want).unwrap().launchers().is_empty(),
        "nothing runs on the target"
    );
    cluster.shutdown().await;
}
