// SPDX-License-Identifier: Apache-2.0
//! Issue 7 item 5 / RELIABILITY.md test 6: three nodes (agents in process,
//! launchers and replica servers as real processes), a VM whose disk is a
//! 3-replica volume; its guest appends flushed records to a log on the
//! disk. The node running it is killed (kill -9 of its launcher and replica
//! server, its agent stops). The VM must run on another node within 10 s,
//! every record acknowledged before the kill must be on the volume, and the
//! replica stores must show no write of the old epoch after the new one.
#![allow(clippy::unwrap_used)]

mod cluster_common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use cluster_common::*;
use sheaf_orchestrator::audit::{audit_epochs, read_replica};
use sheaf_orchestrator::resources::{VirtualMachine, VirtualMachineInstance, Volume};
use sheaf_orchestrator::store::{StoreExt, UpdateScope};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vm_fails_over_with_every_acknowledged_write() {
    if !kvm_available() || sheaf_testkit::skip_slow("vm_fails_over_with_every_acknowledged_write") {
        return;
    }
    init_tracing();
    let tmp = tempfile::tempdir().unwrap();
    let mut cluster = start_cluster(tmp.path(), 3).await;
    let store = cluster.store().clone();

    create(&store, &volume("disk0", "16Mi", 3)).await;
    let v = wait_json(
        &store,
        &gk::<Volume>(),
        "default",
        "disk0",
        Duration::from_secs(30),
        |o| o["status"]["phase"] == "Available",
    )
    .await;
    let rep_nodes: BTreeSet<String> = v["status"]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["nodeName"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(rep_nodes.len(), 3, "replicas on distinct nodes: {v}");

    // ~20 ms between records: the guest keeps writing through the kill.
    let args = "probe.token=failover probe.log=3000 probe.log_pause=10000 probe.halt=1";
    create(
        &store,
        &probe_vm("logger", "Always", args, Some("disk0"), "100m"),
    )
    .await;
    let vmi = wait_json(
        &store,
        &gk::<VirtualMachineInstance>(),
        "default",
        "logger",
        Duration::from_secs(60),
        |o| o["status"]["phase"] == "Running",
    )
    .await;
    let node1 = vmi["status"]["nodeName"].as_str().unwrap().to_string();
    let uid1 = vmi["metadata"]["uid"].as_str().unwrap().to_string();
    let epoch1 = store
        .get_typed::<Volume>("default", "disk0")
        .await
        .unwrap()
        .status
        .unwrap()
        .epoch
        .unwrap();
    let console1 = console_of(&cluster.node_dir(&node1), &uid1);
    wait_console(&console1, Duration::from_secs(60), |c| acks(c).len() >= 20).await;

    // Kill the node mid-write.
    let t0 = Instant::now();
    cluster.kill_node(&node1).unwrap();
    let vmi2 = wait_json(
        &store,
        &gk::<VirtualMachineInstance>(),
        "default",
        "logger",
        Duration::from_secs(30),
        |o| o["status"]["phase"] == "Running" && o["metadata"]["uid"] != uid1.as_str(),
    )
    .await;
    let failover = t0.elapsed();
    let node2 = vmi2["status"]["nodeName"].as_str().unwrap().to_string();
    let uid2 = vmi2["metadata"]["uid"].as_str().unwrap().to_string();
    eprintln!("failover: {node1} -> {node2} in {failover:?}");
    assert_ne!(node1, node2);
    assert!(
        failover < Duration::from_secs(10),
        "failover took {failover:?}"
    );
    let acked1 = acks(&read_console(&console1));
    let max1 = *acked1.iter().max().unwrap();
    assert_eq!(acked1, (0..=max1).collect::<Vec<_>>(), "acks are in order");

    // The new guest verified the log on boot and found every acknowledged record.
    let console2 = console_of(&cluster.node_dir(&node2), &uid2);
    let c2 = wait_console(&console2, Duration::from_secs(60), |c| acks(c).len() >= 10).await;
    let found2 = found(&c2).unwrap();
    assert!(
        found2 > max1,
        "second guest found {found2} records, {} were acknowledged",
        max1 + 1
    );
    assert!(!c2.contains("CORRUPT"), "{c2}");
    let vol = store.get_typed::<Volume>("default", "disk0").await.unwrap();
    let st = vol.status.clone().unwrap();
    let epoch2 = st.epoch.unwrap();
    assert!(
        epoch2 >= epoch1 + 2,
        "fence + re-attach raise the epoch: {epoch1} -> {epoch2}"
    );
    let failed: Vec<_> = st
        .replicas
        .iter()
        .flatten()
        .filter(|r| r.node_name == node1)
        .collect();
    assert_eq!(
        failed[0].state,
        Some(sheaf_orchestrator::resources::sheaf::ReplicaState::Failed)
    );

    // Stop the VM, then every process, and audit the replica stores.
    store
        .modify_typed(
            "default",
            "logger",
            UpdateScope::Main,
            |vm: &mut VirtualMachine| {
                vm.spec.run_strategy = Some(sheaf_orchestrator::resources::RunStrategy::Halted);
            },
        )
        .await
        .unwrap();
    wait_gone(
        &store,
        &gk::<VirtualMachineInstance>(),
        "default",
        "logger",
        Duration::from_secs(30),
    )
    .await;
    let acked2 = acks(&read_console(&console_of(&cluster.node_dir(&node2), &uid2)));
    let max2 = *acked2.iter().max().unwrap();
    let dirs: Vec<_> = cluster
        .node_names()
        .iter()
        .map(|n| (n.clone(), cluster.node_dir(n)))
        .collect();
    cluster.shutdown().await;

    let lbas = log_block(0)..log_block(max2 + 64);
    let mut views = Vec::new();
    for (n, d) in &dirs {
        let v = read_replica(&replica_store(d, "disk0"), lbas.clone()).unwrap();
        eprintln!(
            "{n}: epoch {} position {:?} clean {} blocks {}",
            v.epoch,
            v.position,
            v.clean,
            v.blocks.len()
        );
        views.push((n.clone(), v));
    }
    // Every acknowledged record (both guests) is intact on both survivors.
    for (n, v) in views.iter().filter(|(n, _)| *n != node1) {
        for k in 0..=max2 {
            let b = v
                .blocks
                .get(&log_block(k))
                .unwrap_or_else(|| panic!("{n}: record {k} missing"));
            assert!(
                b.valid && valid_record(&b.data, k),
                "{n}: record {k} damaged"
            );
        }
    }
    // The killed node's replica holds a valid prefix of the log.
    let (_, dead) = views.iter().find(|(n, _)| *n == node1).unwrap();
    for (lba, b) in &dead.blocks {
        let k = lba - log_block(0);
        assert!(valid_record(&b.data, k), "{node1}: record {k} damaged");
    }
    let all: Vec<_> = views.into_iter().map(|(_, v)| v).collect();
    let audit = audit_epochs(&all);
    eprintln!("epochs: {:?}", audit.epochs);
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
    assert!(
        audit.epochs.len() >= 2,
        "both guests wrote: {:?}",
        audit.epochs
    );
    eprintln!(
        "acknowledged: {} records before the kill, {} in total; failover {:?}",
        max1 + 1,
        max2 + 1,
        failover
    );
}
