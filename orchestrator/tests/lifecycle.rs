// SPDX-License-Identifier: Apache-2.0
//! Controllers and agents on a local 3-node cluster with probe guests:
//! run strategies, scheduling failures, cold migration with a replicated
//! volume, and an agent restart that reconnects to its running launcher.
#![allow(clippy::unwrap_used)]

mod cluster_common;

use std::time::Duration;

use cluster_common::*;
use serde_json::Value;
use sheaf_orchestrator::resources::kubevirt::{StateChangeRequest, VmiPhase};
use sheaf_orchestrator::resources::{
    RunStrategy, VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration, Volume,
};
use sheaf_orchestrator::store::{StoreExt, UpdateScope};

const T: Duration = Duration::from_secs(60);

fn phase(o: &Value) -> &str {
    o["status"]["phase"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_strategies_and_scheduling() {
    if !kvm_available() || sheaf_testkit::skip_slow("run_strategies_and_scheduling") {
        return;
    }
    init_tracing();
    let tmp = tempfile::tempdir().unwrap();
    let cluster = start_cluster(tmp.path(), 3).await;
    let store = cluster.store().clone();
    let vmi_k = gk::<VirtualMachineInstance>();
    let vm_k = gk::<VirtualMachine>();

    // Once: the probe passes and exits; the VM is not restarted.
    create(
        &store,
        &probe_vm("once", "Once", "probe.token=once", None, "100m"),
    )
    .await;
    let v = wait_json(&store, &vmi_k, "default", "once", T, |o| {
        phase(o) == "Succeeded"
    })
    .await;
    let uid = v["metadata"]["uid"].clone();
    wait_json(&store, &vm_k, "default", "once", T, |o| {
        o["status"]["printableStatus"] == "Stopped"
    })
    .await;
    let still: VirtualMachineInstance = store.get_typed("default", "once").await.unwrap();
    assert_eq!(
        Value::from(still.metadata.uid.unwrap()),
        uid,
        "Once never restarts"
    );

    // Always with a guest that stays up; Halted stops it.
    create(
        &store,
        &probe_vm("always", "Always", "probe.halt=1", None, "100m"),
    )
    .await;
    let v = wait_json(&store, &vmi_k, "default", "always", T, |o| {
        phase(o) == "Running"
    })
    .await;
    assert!(
        v["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    );
    wait_json(&store, &vm_k, "default", "always", T, |o| {
        o["status"]["printableStatus"] == "Running" && o["status"]["ready"] == true
    })
    .await;
    set_strategy(&store, "always", RunStrategy::Halted).await;
    wait_gone(&store, &vmi_k, "default", "always", T).await;
    wait_json(&store, &vm_k, "default", "always", T, |o| {
        o["status"]["printableStatus"] == "Stopped"
    })
    .await;

    // Manual: nothing runs until a Start request.
    create(
        &store,
        &probe_vm("manual", "Manual", "probe.halt=1", None, "100m"),
    )
    .await;
    wait_json(&store, &vm_k, "default", "manual", T, |o| {
        o["status"]["printableStatus"] == "Stopped"
    })
    .await;
    assert!(
        store
            .get_typed::<VirtualMachineInstance>("default", "manual")
            .await
            .is_err()
    );
    store
        .modify_typed(
            "default",
            "manual",
            UpdateScope::Status,
            |vm: &mut VirtualMachine| {
                vm.status
                    .get_or_insert_with(Default::default)
                    .state_change_requests = Some(vec![StateChangeRequest {
                    action: "Start".into(),
                    data: None,
                    uid: None,
                }]);
            },
        )
        .await
        .unwrap();
    wait_json(&store, &vmi_k, "default", "manual", T, |o| {
        phase(o) == "Running"
    })
    .await;
    store
        .modify_typed(
            "default",
            "manual",
            UpdateScope::Status,
            |vm: &mut VirtualMachine| {
                vm.status
                    .get_or_insert_with(Default::default)
                    .state_change_requests = Some(vec![StateChangeRequest {
                    action: "Stop".into(),
                    data: None,
                    uid: None,
                }]);
            },
        )
        .await
        .unwrap();
    wait_gone(&store, &vmi_k, "default", "manual", T).await;

    // RerunOnFailure: a guest that fails before running (no disk although
    // one is required) is restarted with crash-loop back-off.
    create(
        &store,
        &probe_vm(
            "crashy",
            "RerunOnFailure",
            "probe.need_disk=1",
            None,
            "100m",
        ),
    )
    .await;
    wait_json(&store, &vm_k, "default", "crashy", T, |o| {
        o["status"]["startFailure"]["consecutiveFailCount"]
            .as_u64()
            .unwrap_or(0)
            >= 2
            && o["status"]["printableStatus"] == "CrashLoopBackOff"
    })
    .await;

    // Unschedulable: kube-scheduler's message in the PodScheduled condition.
    create(
        &store,
        &probe_vm("huge", "Always", "probe.halt=1", None, "100"),
    )
    .await;
    let v = wait_json(&store, &vmi_k, "default", "huge", T, |o| {
        o["status"]["conditions"].as_array().is_some_and(|c| {
            c.iter()
                .any(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable")
        })
    })
    .await;
    assert_eq!(phase(&v), "Scheduling");
    let msg = v["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "PodScheduled")
        .unwrap()["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        msg.starts_with("0/3 nodes are available: 3 Insufficient cpu"),
        "{msg}"
    );
    wait_json(&store, &vm_k, "default", "huge", T, |o| {
        o["status"]["printableStatus"] == "ErrorUnschedulable"
    })
    .await;

    // A VM waiting for a volume that does not exist yet.
    create(
        &store,
        &probe_vm("waiter", "Always", "probe.halt=1", Some("later"), "100m"),
    )
    .await;
    let v = wait_json(&store, &vmi_k, "default", "waiter", T, |o| {
        o["status"]["conditions"].as_array().is_some_and(|c| {
            c.iter()
                .any(|c| c["type"] == "VolumesReady" && c["reason"] == "VolumeNotFound")
        })
    })
    .await;
    assert_eq!(phase(&v), "Pending");
    create(&store, &volume("later", "4Mi", 2)).await;
    wait_json(&store, &vmi_k, "default", "waiter", T, |o| {
        phase(o) == "Running"
    })
    .await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cold_migration_and_agent_restart() {
    if !kvm_available() || sheaf_testkit::skip_slow("cold_migration_and_agent_restart") {
        return;
    }
    init_tracing();
    let tmp = tempfile::tempdir().unwrap();
    let mut cluster = start_cluster(tmp.path(), 3).await;
    let store = cluster.store().clone();
    let vmi_k = gk::<VirtualMachineInstance>();
    create(&store, &volume("mdisk", "8Mi", 3)).await;
    let args = "probe.log=30 probe.halt=1";
    create(
        &store,
        &probe_vm("mover", "Always", args, Some("mdisk"), "100m"),
    )
    .await;
    let v = wait_json(&store, &vmi_k, "default", "mover", T, |o| {
        phase(o) == "Running"
    })
    .await;
    let src = v["status"]["nodeName"].as_str().unwrap().to_string();
    let uid = v["metadata"]["uid"].as_str().unwrap().to_string();
    let c1 = wait_console(&console_of(&cluster.node_dir(&src), &uid), T, |c| {
        c.contains("log: done")
    })
    .await;
    assert_eq!(acks(&c1).len(), 30);
    let epoch1 = store
        .get_typed::<Volume>("default", "mdisk")
        .await
        .unwrap()
        .status
        .unwrap()
        .epoch
        .unwrap();

    // Agent restarts: the launcher keeps running and is adopted. Several
    // rounds, each given time for the new agent's first pass, because that
    // pass once raced the adoption and failed the instance as "launcher lost".
    let pid = cluster.agent(&src).unwrap().launchers()[0].pid.unwrap();
    for round in 0..3 {
        cluster.stop_agent(&src).unwrap();
        cluster.restart_node(&src).await.unwrap();
        let adopted = cluster.agent(&src).unwrap().launchers();
        assert_eq!(adopted.len(), 1, "round {round}");
        assert_eq!(adopted[0].pid, Some(pid), "same launcher process");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let v: VirtualMachineInstance = store.get_typed("default", "mover").await.unwrap();
        assert_eq!(
            v.metadata.uid.as_deref(),
            Some(uid.as_str()),
            "round {round}"
        );
        let ph = v.status.as_ref().and_then(|s| s.phase);
        assert_eq!(ph, Some(VmiPhase::Running), "round {round}: {v:?}");
    }

    // Cold migration through the adopted launcher's control socket.
    let mig: VirtualMachineInstanceMigration = decode_yaml(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceMigration\nmetadata: {name: m1, namespace: default, annotations: {sheaf.dev/migration-mode: Cold}}\nspec: {vmiName: mover}\n",
    );
    create(&store, &mig).await;
    let m = wait_json(
        &store,
        &gk::<VirtualMachineInstanceMigration>(),
        "default",
        "m1",
        T,
        |o| phase(o) == "Succeeded" || phase(o) == "Failed",
    )
    .await;
    assert_eq!(phase(&m), "Succeeded", "{m}");
    let v = wait_json(&store, &vmi_k, "default", "mover", T, |o| {
        phase(o) == "Running"
    })
    .await;
    let dst = v["status"]["nodeName"].as_str().unwrap().to_string();
    assert_ne!(dst, src);
    assert_eq!(
        v["metadata"]["uid"].as_str(),
        Some(uid.as_str()),
        "same instance, new node"
    );
    assert_eq!(v["status"]["migrationState"]["completed"], true);
    let c2 = wait_console(&console_of(&cluster.node_dir(&dst), &uid), T, |c| {
        c.contains("log: done")
    })
    .await;
    assert_eq!(
        found(&c2),
        Some(30),
        "the target guest sees every record: {c2}"
    );
    let epoch2 = store
        .get_typed::<Volume>("default", "mdisk")
        .await
        .unwrap()
        .status
        .unwrap()
        .epoch
        .unwrap();
    assert!(epoch2 > epoch1, "re-attach on the target raised the epoch");
    cluster.shutdown().await;
}
