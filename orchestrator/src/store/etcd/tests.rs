// SPDX-License-Identifier: Apache-2.0
//! etcd-only behaviour: two stores (two API servers) on one etcd, watches
//! older than a store's cache, and etcd compaction as `Gone`.

use futures::StreamExt;
use serde_json::json;

use super::server::EtcdServer;
use super::{EtcdConfig, EtcdStore};
use crate::store::{EventType, GroupKind, Store, StoreError, UpdateScope, WatchOptions};

fn kind() -> GroupKind {
    GroupKind::new("kubevirt.io", "VirtualMachine")
}

fn obj(name: &str) -> serde_json::Value {
    json!({"metadata": {"name": name}, "spec": {"n": 0}})
}

fn rv(o: &serde_json::Value) -> u64 {
    o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

async fn server() -> Option<(EtcdServer, tempfile::TempDir)> {
    if !std::path::Path::new("/usr/bin/etcd").exists() {
        eprintln!("SKIP: etcd not installed (run scripts/setup)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let s = EtcdServer::start_single(dir.path()).unwrap();
    Some((s, dir))
}

async fn open(s: &EtcdServer) -> EtcdStore {
    EtcdStore::connect(EtcdConfig::new(vec![s.client_url.clone()]))
        .await
        .unwrap()
}

#[tokio::test]
async fn two_stores_on_one_etcd_see_each_other_and_conflict() {
    let Some((srv, _dir)) = server().await else {
        return;
    };
    let (a, b) = (open(&srv).await, open(&srv).await);
    let x = a.create(&kind(), "default", obj("x")).await.unwrap();
    // B reads what A wrote at once (reads go to etcd).
    let seen = b.get(&kind(), "default", "x").await.unwrap();
    assert_eq!(rv(&seen), rv(&x));
    // B updates from that version; A's copy is now stale.
    let mut by_b = seen.clone();
    by_b["spec"]["n"] = json!(1);
    let by_b = b
        .update(&kind(), "default", by_b, UpdateScope::All)
        .await
        .unwrap();
    assert!(rv(&by_b) > rv(&x));
    let mut stale = x.clone();
    stale["spec"]["n"] = json!(2);
    let err = a
        .update(&kind(), "default", stale.clone(), UpdateScope::All)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "{err}");
    // An unconditional update through A applies on top of B's (A's cache
    // catches up instead of overwriting).
    stale["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    let by_a = a
        .update(&kind(), "default", stale, UpdateScope::All)
        .await
        .unwrap();
    assert_eq!(by_a["spec"]["n"], 2);
    assert_eq!(by_a["metadata"]["generation"], 3, "{by_a}");
    // Create races: the second creator of a name gets AlreadyExists.
    let err = b.create(&kind(), "default", obj("x")).await.unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err}");
    // B's watch sees A's writes.
    let mut w = b
        .watch(
            &kind(),
            Some("default"),
            &WatchOptions {
                resource_version: Some(rv(&by_a)),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    a.create(&kind(), "default", obj("y")).await.unwrap();
    let ev = w.next().await.unwrap().unwrap();
    assert_eq!(ev.type_, EventType::Added);
    assert_eq!(ev.object["metadata"]["name"], "y");
}

#[tokio::test]
async fn watch_older_than_the_cache_reads_etcd_history_then_gone_after_compaction() {
    let Some((srv, _dir)) = server().await else {
        return;
    };
    let a = open(&srv).await;
    let first = a.create(&kind(), "default", obj("p")).await.unwrap();
    a.create(&kind(), "default", obj("q")).await.unwrap();
    a.delete(&kind(), "default", "p", &Default::default())
        .await
        .unwrap();
    // A store opened now has no history before its start...
    let b = open(&srv).await;
    assert!(b.oldest_watchable() > rv(&first));
    // ...so a watch from `first` is served by etcd's own history.
    let mut w = b
        .watch(
            &kind(),
            None,
            &WatchOptions {
                resource_version: Some(rv(&first)),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let e1 = w.next().await.unwrap().unwrap();
    let e2 = w.next().await.unwrap().unwrap();
    assert_eq!(
        (e1.type_, e1.object["metadata"]["name"].as_str().unwrap()),
        (EventType::Added, "q")
    );
    assert_eq!(
        (e2.type_, e2.object["metadata"]["name"].as_str().unwrap()),
        (EventType::Deleted, "p")
    );
    // After etcd compacts, that version is Gone (410).
    let now = a.create(&kind(), "default", obj("r")).await.unwrap();
    let mut c = etcd_client::Client::connect([srv.client_url.as_str()], None)
        .await
        .unwrap();
    c.compact(rv(&now) as i64, None).await.unwrap();
    let mut w = b
        .watch(
            &kind(),
            None,
            &WatchOptions {
                resource_version: Some(rv(&first)),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let err = w.next().await.unwrap().unwrap_err();
    assert!(matches!(err, StoreError::Gone { .. }), "{err}");
}
