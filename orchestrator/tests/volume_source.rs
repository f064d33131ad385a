// SPDX-License-Identifier: Apache-2.0
//! A Volume with `spec.source.image` stays `Creating` once its replicas are
//! served, until something sets its `Imported` condition (the cluster
//! binary's importer); an instance on it waits meanwhile, and runs after.
#![allow(clippy::unwrap_used)]

mod cluster_common;

use std::time::Duration;

use cluster_common::*;
use sheaf_orchestrator::controllers::util::set_condition;
use sheaf_orchestrator::controllers::volume::SOURCE_IMPORTED;
use sheaf_orchestrator::resources::sheaf::VolumeSource;
use sheaf_orchestrator::resources::{ConditionStatus, VirtualMachineInstance, Volume};
use sheaf_orchestrator::store::{StoreExt, UpdateScope};

const T: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn image_source_holds_the_volume_until_imported() {
    init_tracing();
    let tmp = tempfile::tempdir().unwrap();
    let cluster = start_cluster(tmp.path(), 2).await;
    let store = cluster.store().clone();
    let mut v = volume("src", "4Mi", 2);
    v.spec.source = Some(VolumeSource {
        image: Some("/var/tmp/src.img".into()),
        volume: None,
        checksum: None,
    });
    create(&store, &v).await;
    // Every replica served and healthy, yet still Creating.
    wait_json(&store, &gk::<Volume>(), "default", "src", T, |o| {
        o["status"]["replicas"].as_array().is_some_and(|r| {
            r.len() == 2
                && r.iter()
                    .all(|r| r["address"].is_string() && r["state"] == "Healthy")
        })
    })
    .await;
    let kvm = kvm_available();
    if kvm {
        create(
            &store,
            &probe_vm("onsrc", "Always", "probe.halt=1", Some("src"), "100m"),
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let got: Volume = store.get_typed("default", "src").await.unwrap();
    assert_eq!(
        got.status.as_ref().and_then(|s| s.phase),
        Some(sheaf_orchestrator::resources::sheaf::VolumePhase::Creating),
        "{got:?}"
    );
    if kvm {
        let vmi: VirtualMachineInstance = store.get_typed("default", "onsrc").await.unwrap();
        let st = vmi.status.unwrap_or_default();
        assert!(
            st.node_name.is_none(),
            "scheduled before the import: {st:?}"
        );
    }
    // The importer reports success: the volume becomes usable.
    store
        .modify_typed("default", "src", UpdateScope::Status, |v: &mut Volume| {
            let st = v.status.get_or_insert_with(Default::default);
            set_condition(
                &mut st.conditions,
                SOURCE_IMPORTED,
                ConditionStatus::True,
                "Imported",
                "test",
            );
        })
        .await
        .unwrap();
    wait_json(&store, &gk::<Volume>(), "default", "src", T, |o| {
        matches!(
            o["status"]["phase"].as_str(),
            Some("Available" | "Attached")
        )
    })
    .await;
    if kvm {
        wait_json(
            &store,
            &gk::<VirtualMachineInstance>(),
            "default",
            "onsrc",
            T,
            |o| o["status"]["phase"] == "Running",
        )
        .await;
    }
    cluster.shutdown().await;
}
