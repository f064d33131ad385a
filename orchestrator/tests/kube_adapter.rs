// SPDX-License-Identifier: Apache-2.0
//! The kube-rs adapter against sheaf's own API server (in process, TLS,
//! admin kubeconfig): `KubeStore` keeps the `Store` semantics over the
//! Kubernetes API (versions, conflicts, status subresource, selectors,
//! paging, watch resume, bookmarks, 410 Gone, finalizers), typed
//! `kube::Api<VirtualMachine>` works, and the unchanged controllers and node
//! agents run a probe-guest VM to Running through it.
//!
//! Run: `cargo test -p sheaf-orchestrator --features kube --test kube_adapter`
#![allow(clippy::unwrap_used)]

mod cluster_common;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use sheaf_orchestrator::api::{ApiServer, ApiServerConfig, RunningApiServer};
use sheaf_orchestrator::cluster::{LocalCluster, LocalClusterConfig};
use sheaf_orchestrator::kube::KubeStore;
use sheaf_orchestrator::resources::{Node, RunStrategy, VirtualMachine, VirtualMachineInstance};
use sheaf_orchestrator::store::{
    DeleteOptions, EventType, GroupKind, LabelSelector, ListOptions, MemoryStore, Store,
    StoreError, StoreExt, UpdateScope, WatchEvent, WatchOptions, WatchStream,
};

const NEXT: Duration = Duration::from_secs(10);

async fn serve(history: usize, dir: &std::path::Path) -> RunningApiServer {
    let mut cfg = ApiServerConfig::new(dir);
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    cfg.bookmark_interval = Duration::from_millis(200);
    ApiServer::start(cfg, Arc::new(MemoryStore::with_history(history)))
        .await
        .unwrap()
}

fn vm_kind() -> GroupKind {
    GroupKind::new("kubevirt.io", "VirtualMachine")
}

fn vm(name: &str, app: &str) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": app}},
        "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"memory": {"guest": "32Mi"}, "devices": {}}}}}
    })
}

fn rv(o: &Value) -> u64 {
    o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

async fn next(w: &mut WatchStream) -> WatchEvent {
    tokio::time::timeout(NEXT, w.next())
        .await
        .expect("no watch event within 10 s")
        .expect("watch ended")
        .expect("watch error")
}

/// Next event that is not a bookmark.
async fn next_change(w: &mut WatchStream) -> WatchEvent {
    loop {
        let ev = next(w).await;
        if ev.type_ != EventType::Bookmark {
            return ev;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_semantics_through_kube_rs() {
    cluster_common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let server = serve(64, dir.path()).await;
    let s = KubeStore::from_kubeconfig(&server.kubeconfig)
        .await
        .unwrap();
    let k = vm_kind();

    // Create, read, duplicate, optimistic concurrency.
    let a = s.create(&k, "default", vm("a", "web")).await.unwrap();
    assert_eq!(s.get(&k, "default", "a").await.unwrap(), a);
    assert!(matches!(
        s.create(&k, "default", vm("a", "web")).await,
        Err(StoreError::AlreadyExists { .. })
    ));
    let mut changed = a.clone();
    changed["spec"]["runStrategy"] = json!("Always");
    let b = s
        .update(&k, "default", changed.clone(), UpdateScope::Main)
        .await
        .unwrap();
    assert!(rv(&b) > rv(&a));
    assert_eq!(b["metadata"]["generation"], 2);
    assert!(matches!(
        s.update(&k, "default", changed, UpdateScope::Main).await,
        Err(StoreError::Conflict { .. })
    ));
    assert!(matches!(
        s.get(&k, "default", "missing").await,
        Err(StoreError::NotFound { .. })
    ));
    assert_eq!(s.resource_version(), rv(&b));

    // Status subresource: Main keeps it, Status changes only it, All both.
    let mut st = b.clone();
    st["status"] = json!({"printableStatus": "Stopped"});
    st["spec"]["runStrategy"] = json!("Manual");
    let c = s
        .update(&k, "default", st.clone(), UpdateScope::Status)
        .await
        .unwrap();
    assert_eq!(c["status"]["printableStatus"], "Stopped");
    assert_eq!(
        c["spec"]["runStrategy"], "Always",
        "status scope kept the spec"
    );
    let mut both = c.clone();
    both["spec"]["runStrategy"] = json!("Manual");
    both["status"]["printableStatus"] = json!("Running");
    let d = s
        .update(&k, "default", both, UpdateScope::All)
        .await
        .unwrap();
    assert_eq!(d["spec"]["runStrategy"], "Manual");
    assert_eq!(d["status"]["printableStatus"], "Running");
    // A create carrying a status keeps it (create + status update).
    let mut with_status = vm("s", "db");
    with_status["status"] = json!({"printableStatus": "Provisioning"});
    let e = s.create(&k, "default", with_status).await.unwrap();
    assert_eq!(e["status"]["printableStatus"], "Provisioning");

    // Lists: selectors and pages.
    for n in ["p1", "p2", "p3"] {
        s.create(&k, "default", vm(n, "web")).await.unwrap();
    }
    let web = ListOptions {
        labels: LabelSelector::parse("app=web").unwrap(),
        limit: 2,
        ..Default::default()
    };
    let page1 = s.list(&k, Some("default"), &web).await.unwrap();
    assert_eq!(page1.items.len(), 2);
    let token = page1.continue_token.clone().expect("a continue token");
    let page2 = s
        .list(
            &k,
            Some("default"),
            &ListOptions {
                continue_token: Some(token),
                ..web.clone()
            },
        )
        .await
        .unwrap();
    let mut names: Vec<String> = page1
        .items
        .iter()
        .chain(&page2.items)
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["a", "p1", "p2", "p3"]);
    assert!(page2.continue_token.is_none());
    let all = s.list(&k, None, &ListOptions::default()).await.unwrap();
    assert_eq!(all.items.len(), 5);

    // Watch from "now": the current objects first, then changes.
    let db = WatchOptions {
        labels: LabelSelector::parse("app=db").unwrap(),
        ..Default::default()
    };
    let mut w = s.watch(&k, Some("default"), &db).await.unwrap();
    let first = next_change(&mut w).await;
    assert_eq!(
        (first.type_, first.object["metadata"]["name"].as_str()),
        (EventType::Added, Some("s"))
    );
    let mark = s.resource_version();
    let mut f = s.get(&k, "default", "s").await.unwrap();
    f["metadata"]["annotations"] = json!({"touched": "1"});
    let f = s.update(&k, "default", f, UpdateScope::Main).await.unwrap();
    let ev = next_change(&mut w).await;
    assert_eq!(ev.type_, EventType::Modified);
    assert_eq!(ev.resource_version, rv(&f));
    drop(w);

    // Resume from a version: exactly the changes after it, in order.
    let mut w = s
        .watch(
            &k,
            Some("default"),
            &WatchOptions {
                resource_version: Some(mark),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let ev = next_change(&mut w).await;
    assert_eq!(
        (ev.type_, ev.resource_version),
        (EventType::Modified, rv(&f))
    );
    s.delete(&k, "default", "p3", &DeleteOptions::default())
        .await
        .unwrap();
    let ev = next_change(&mut w).await;
    assert_eq!(ev.type_, EventType::Deleted);
    assert_eq!(ev.object["metadata"]["name"], "p3");
    drop(w);

    // Bookmarks when asked for progress.
    let mut w = s
        .watch(
            &k,
            None,
            &WatchOptions {
                resource_version: Some(s.resource_version()),
                progress: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    // A write to another kind moves the server's progress: a bookmark (no
    // VirtualMachine event) carries the new version.
    let other = s
        .create(
            &GroupKind::new("sheaf.dev", "Node"),
            "",
            json!({"apiVersion": "sheaf.dev/v1", "kind": "Node", "metadata": {"name": "n0"}, "spec": {}}),
        )
        .await
        .unwrap();
    let ev = next(&mut w).await;
    assert_eq!(ev.type_, EventType::Bookmark);
    assert!(ev.resource_version >= rv(&other));
    drop(w);

    // Finalizers: delete only marks; removing the finalizer removes it.
    let mut fin = vm("fin", "x");
    fin["metadata"]["finalizers"] = json!(["sheaf.dev/test"]);
    s.create(&k, "default", fin).await.unwrap();
    let (obj, gone) = s
        .delete(&k, "default", "fin", &DeleteOptions::default())
        .await
        .unwrap();
    assert!(!gone);
    assert!(obj["metadata"]["deletionTimestamp"].is_string());
    let mut obj = s.get(&k, "default", "fin").await.unwrap();
    obj["metadata"]["finalizers"] = json!([]);
    s.update(&k, "default", obj, UpdateScope::Main)
        .await
        .unwrap();
    assert!(matches!(
        s.get(&k, "default", "fin").await,
        Err(StoreError::NotFound { .. })
    ));
    // Preconditions: a wrong uid is a conflict and deletes nothing.
    let wrong_uid = DeleteOptions {
        uid: Some("not-the-uid".into()),
        ..Default::default()
    };
    assert!(matches!(
        s.delete(&k, "default", "p2", &wrong_uid).await,
        Err(StoreError::Conflict { .. })
    ));
    assert!(s.get(&k, "default", "p2").await.is_ok());

    // Cluster-scoped kinds and typed helpers.
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "sheaf.dev/v1", "kind": "Node", "metadata": {"name": "n1"},
        "spec": {}
    }))
    .unwrap();
    s.create_typed(&node).await.unwrap();
    let n: Node = s.get_typed("", "n1").await.unwrap();
    assert_eq!(n.metadata.name.as_deref(), Some("n1"));

    // Typed kube-rs API over the same server (kube::Resource impls).
    let typed: kube::Api<VirtualMachine> = kube::Api::namespaced(s.client().clone(), "default");
    let listed = typed.list(&Default::default()).await.unwrap();
    assert_eq!(listed.items.len(), 4);
    assert!(
        listed
            .items
            .iter()
            .any(|v| v.spec.run_strategy == Some(RunStrategy::Manual))
    );

    // 410 Gone: push the start version out of the retained history.
    let old = rv(&a);
    for i in 0..70 {
        let mut o = s.get(&k, "default", "p1").await.unwrap();
        o["metadata"]["annotations"] = json!({"n": i.to_string()});
        s.update(&k, "default", o, UpdateScope::Main).await.unwrap();
    }
    let from_old = WatchOptions {
        resource_version: Some(old),
        ..Default::default()
    };
    match s.watch(&k, None, &from_old).await {
        Err(StoreError::Gone { .. }) => {}
        Ok(mut w) => {
            let r = tokio::time::timeout(NEXT, w.next()).await.unwrap();
            assert!(
                matches!(r, Some(Err(StoreError::Gone { .. }))),
                "expected 410 Gone, got {r:?}"
            );
        }
        Err(e) => panic!("expected 410 Gone, got {e}"),
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn controllers_and_agents_run_a_vm_through_kube_rs() {
    if !cluster_common::kvm_available() {
        return;
    }
    cluster_common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let server = serve(10_000, &dir.path().join("api")).await;
    let store: Arc<dyn Store> = Arc::new(
        KubeStore::from_kubeconfig(&server.kubeconfig)
            .await
            .unwrap(),
    );
    let mut cfg = LocalClusterConfig::new(
        dir.path().join("cluster"),
        env!("CARGO_BIN_EXE_sheaf-launcher"),
    );
    cfg.nodes = 2;
    let cluster = LocalCluster::start_with_store(cfg, store.clone())
        .await
        .unwrap();
    for n in cluster.node_names() {
        cluster_common::wait_json(
            &store,
            &GroupKind::of::<Node>(),
            "",
            &n,
            Duration::from_secs(30),
            cluster_common::ready,
        )
        .await;
    }
    let t = Duration::from_secs(60);
    cluster_common::create(
        &store,
        &cluster_common::probe_vm("kvm1", "Always", "probe.halt=1", None, "100m"),
    )
    .await;
    let vmi = cluster_common::wait_json(
        &store,
        &GroupKind::of::<VirtualMachineInstance>(),
        "default",
        "kvm1",
        t,
        |o| o["status"]["phase"] == "Running",
    )
    .await;
    let node = vmi["status"]["nodeName"].as_str().unwrap().to_string();
    assert!(cluster.node_names().contains(&node), "bound to {node}");
    cluster_common::wait_json(
        &store,
        &GroupKind::of::<VirtualMachine>(),
        "default",
        "kvm1",
        t,
        |o| o["status"]["printableStatus"] == "Running",
    )
    .await;
    // Halted stops it: the instance goes away through the same adapter.
    store
        .modify_typed(
            "default",
            "kvm1",
            UpdateScope::Main,
            |vm: &mut VirtualMachine| {
                vm.spec.run_strategy = Some(RunStrategy::Halted);
                vm.spec.running = None;
            },
        )
        .await
        .unwrap();
    cluster_common::wait_gone(
        &store,
        &GroupKind::of::<VirtualMachineInstance>(),
        "default",
        "kvm1",
        t,
    )
    .await;
    cluster.shutdown().await;
    server.shutdown().await;
}
