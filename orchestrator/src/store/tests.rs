// SPDX-License-Identifier: Apache-2.0
//! Store semantics, run against both implementations.

use futures::StreamExt;
use serde_json::{Value, json};

use super::*;

fn vm_kind() -> GroupKind {
    GroupKind::new("kubevirt.io", "VirtualMachine")
}

fn vmi_kind() -> GroupKind {
    GroupKind::new("kubevirt.io", "VirtualMachineInstance")
}

fn obj(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name, "labels": labels}, "spec": {"running": false}})
}

fn rv(o: &Value) -> u64 {
    o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap()
}

type Guard = Option<Box<dyn std::any::Any + Send>>;

/// Every store kind the conformance tests run against: memory, redb and
/// (when the etcd binary is installed) etcd, each a fresh server.
async fn stores() -> Vec<(Box<dyn Store>, Guard)> {
    let dir = tempfile::tempdir().unwrap();
    let redb = RedbStore::open(dir.path().join("db.redb")).unwrap();
    let mut out: Vec<(Box<dyn Store>, Guard)> = vec![
        (Box::new(MemoryStore::new()), None),
        (Box::new(redb), Some(Box::new(dir))),
    ];
    if let Some((s, g)) = etcd_store().await {
        out.push((Box::new(s), Some(g)));
    }
    out
}

/// A store on a fresh one-member etcd, or `None` (printing SKIP) without etcd.
pub(crate) async fn etcd_store() -> Option<(super::EtcdStore, Box<dyn std::any::Any + Send>)> {
    if !std::path::Path::new("/usr/bin/etcd").exists() {
        eprintln!("SKIP etcd store: etcd not installed (run scripts/setup)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let server = super::etcd::server::EtcdServer::start_single(dir.path()).unwrap();
    let store = super::EtcdStore::connect(super::EtcdConfig::new(vec![server.client_url.clone()]))
        .await
        .unwrap();
    Some((store, Box::new((server, dir))))
}

#[tokio::test]
async fn crud_with_versions_and_conflicts() {
    for (s, _dir) in stores().await {
        let base = s.resource_version();
        let a = s
            .create(&vm_kind(), "default", obj("a", json!({})))
            .await
            .unwrap();
        assert_eq!(rv(&a) - base, 1);
        assert_eq!(a["metadata"]["generation"], 1);
        assert!(a["metadata"]["uid"].as_str().unwrap().len() > 10);
        let err = s
            .create(&vm_kind(), "default", obj("a", json!({})))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::AlreadyExists { .. }));

        let mut changed = a.clone();
        changed["spec"]["running"] = json!(true);
        let b = s
            .update(&vm_kind(), "default", changed.clone(), UpdateScope::All)
            .await
            .unwrap();
        assert_eq!(rv(&b) - base, 2);
        assert_eq!(b["metadata"]["generation"], 2);
        // Same stale version again: conflict.
        let err = s
            .update(&vm_kind(), "default", changed, UpdateScope::All)
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Conflict { .. }), "{err}");
        // No-op update keeps the version.
        let c = s
            .update(&vm_kind(), "default", b.clone(), UpdateScope::All)
            .await
            .unwrap();
        assert_eq!(rv(&c) - base, 2);
        assert_eq!(s.resource_version() - base, 2);
        // Unconditional update (no resourceVersion) works.
        let mut unc = b.clone();
        unc["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("resourceVersion");
        unc["metadata"]["labels"] = json!({"x": "y"});
        let d = s
            .update(&vm_kind(), "default", unc, UpdateScope::All)
            .await
            .unwrap();
        assert_eq!(rv(&d) - base, 3);
        assert_eq!(
            d["metadata"]["generation"], 2,
            "label change does not bump generation"
        );

        assert!(matches!(
            s.get(&vm_kind(), "default", "zz").await,
            Err(StoreError::NotFound { .. })
        ));
        let (gone, removed) = s
            .delete(&vm_kind(), "default", "a", &DeleteOptions::default())
            .await
            .unwrap();
        assert!(removed);
        assert_eq!(rv(&gone) - base, 4);
        assert!(matches!(
            s.get(&vm_kind(), "default", "a").await,
            Err(StoreError::NotFound { .. })
        ));
    }
}

#[tokio::test]
async fn status_scope_is_separate() {
    for (s, _dir) in stores().await {
        let a = s
            .create(&vm_kind(), "ns", obj("a", json!({})))
            .await
            .unwrap();
        let mut st = a.clone();
        st["status"] = json!({"printableStatus": "Running"});
        st["spec"]["running"] = json!(true);
        let b = s
            .update(&vm_kind(), "ns", st, UpdateScope::Status)
            .await
            .unwrap();
        assert_eq!(b["status"]["printableStatus"], "Running");
        assert_eq!(b["spec"]["running"], false, "status update ignores spec");
        let mut main = b.clone();
        main["status"] = json!({"printableStatus": "Hacked"});
        main["spec"]["running"] = json!(true);
        let c = s
            .update(&vm_kind(), "ns", main, UpdateScope::Main)
            .await
            .unwrap();
        assert_eq!(
            c["status"]["printableStatus"], "Running",
            "main update keeps status"
        );
        assert_eq!(c["spec"]["running"], true);
    }
}

#[tokio::test]
async fn list_with_selectors_and_pages() {
    for (s, _dir) in stores().await {
        let base = s.resource_version();
        for i in 0..10 {
            let tier = if i % 2 == 0 { "even" } else { "odd" };
            s.create(
                &vm_kind(),
                if i < 5 { "a" } else { "b" },
                obj(&format!("vm{i}"), json!({"tier": tier})),
            )
            .await
            .unwrap();
        }
        let all = s
            .list(&vm_kind(), None, &ListOptions::default())
            .await
            .unwrap();
        assert_eq!(all.items.len(), 10);
        assert_eq!(all.resource_version - base, 10);
        let ns_a = s
            .list(&vm_kind(), Some("a"), &ListOptions::default())
            .await
            .unwrap();
        assert_eq!(ns_a.items.len(), 5);
        let even = ListOptions {
            labels: LabelSelector::parse("tier=even").unwrap(),
            ..Default::default()
        };
        assert_eq!(
            s.list(&vm_kind(), None, &even).await.unwrap().items.len(),
            5
        );
        let named = ListOptions {
            fields: FieldSelector::parse("metadata.name=vm3").unwrap(),
            ..Default::default()
        };
        assert_eq!(
            s.list(&vm_kind(), None, &named).await.unwrap().items.len(),
            1
        );
        // Pages of 3.
        let mut names = Vec::new();
        let mut token = None;
        loop {
            let page = s
                .list(
                    &vm_kind(),
                    None,
                    &ListOptions {
                        limit: 3,
                        continue_token: token.clone(),
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            names.extend(
                page.items
                    .iter()
                    .map(|o| o["metadata"]["name"].as_str().unwrap().to_string()),
            );
            match page.continue_token {
                Some(t) => {
                    assert!(page.remaining.unwrap() > 0);
                    token = Some(t)
                }
                None => break,
            }
        }
        assert_eq!(names.len(), 10);
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 10);
        // Other kinds are not listed.
        assert!(
            s.list(&vmi_kind(), None, &ListOptions::default())
                .await
                .unwrap()
                .items
                .is_empty()
        );
    }
}

#[tokio::test]
async fn watch_from_version_and_selector_transitions() {
    for (s, _dir) in stores().await {
        let base = s.resource_version();
        s.create(&vm_kind(), "default", obj("a", json!({"app": "x"})))
            .await
            .unwrap();
        let mut w0 = s
            .watch(&vm_kind(), Some("default"), &WatchOptions::default())
            .await
            .unwrap();
        let first = w0.next().await.unwrap().unwrap();
        assert_eq!(first.type_, EventType::Added);
        let mut w = s
            .watch(
                &vm_kind(),
                Some("default"),
                &WatchOptions {
                    resource_version: Some(base + 1),
                    labels: LabelSelector::parse("app=x").unwrap(),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let b = s
            .create(&vm_kind(), "default", obj("b", json!({"app": "x"})))
            .await
            .unwrap();
        let mut nb = b.clone();
        nb["metadata"]["labels"] = json!({"app": "y"});
        s.update(&vm_kind(), "default", nb, UpdateScope::All)
            .await
            .unwrap();
        s.create(&vm_kind(), "other", obj("c", json!({"app": "x"})))
            .await
            .unwrap();
        s.delete(&vm_kind(), "default", "a", &DeleteOptions::default())
            .await
            .unwrap();
        let evs: Vec<(EventType, String, u64)> = (0..3)
            .map(|_| futures::executor::block_on(w.next()).unwrap().unwrap())
            .map(|e| {
                (
                    e.type_,
                    e.object["metadata"]["name"].as_str().unwrap().to_string(),
                    e.resource_version - base,
                )
            })
            .collect();
        assert_eq!(
            evs,
            vec![
                (EventType::Added, "b".into(), 2),
                (EventType::Deleted, "b".into(), 3), // stopped matching app=x
                (EventType::Deleted, "a".into(), 5),
            ]
        );
    }
}

#[tokio::test]
async fn watch_gone_after_compaction() {
    let s = MemoryStore::with_history(5);
    for i in 0..20 {
        s.create(&vm_kind(), "default", obj(&format!("v{i}"), json!({})))
            .await
            .unwrap();
    }
    assert_eq!(s.oldest_watchable(), 15);
    let err = s
        .watch(
            &vm_kind(),
            None,
            &WatchOptions {
                resource_version: Some(3),
                ..Default::default()
            },
        )
        .await
        .err()
        .unwrap();
    assert!(matches!(
        err,
        StoreError::Gone {
            requested: 3,
            oldest: 15
        }
    ));
    let mut ok = s
        .watch(
            &vm_kind(),
            None,
            &WatchOptions {
                resource_version: Some(15),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    for want in 16..=20 {
        assert_eq!(ok.next().await.unwrap().unwrap().resource_version, want);
    }
    // A watcher that falls behind the history gets Gone, then the stream ends.
    let mut slow = s
        .watch(
            &vm_kind(),
            None,
            &WatchOptions {
                resource_version: Some(20),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    for i in 20..40 {
        s.create(&vm_kind(), "default", obj(&format!("v{i}"), json!({})))
            .await
            .unwrap();
    }
    assert!(matches!(
        slow.next().await.unwrap(),
        Err(StoreError::Gone { .. })
    ));
    assert!(slow.next().await.is_none());
}

#[tokio::test]
async fn finalizers_delay_removal() {
    for (s, _dir) in stores().await {
        let mut o = obj("f", json!({}));
        o["metadata"]["finalizers"] = json!(["sheaf.dev/protect"]);
        s.create(&vm_kind(), "default", o).await.unwrap();
        let (marked, removed) = s
            .delete(&vm_kind(), "default", "f", &DeleteOptions::default())
            .await
            .unwrap();
        assert!(!removed);
        assert!(marked["metadata"]["deletionTimestamp"].is_string());
        // Adding a finalizer while deleting is refused.
        let mut more = marked.clone();
        more["metadata"]["finalizers"] = json!(["sheaf.dev/protect", "new"]);
        assert!(matches!(
            s.update(&vm_kind(), "default", more, UpdateScope::All)
                .await,
            Err(StoreError::Invalid { .. })
        ));
        // Removing the last finalizer removes the object.
        let mut fin = marked.clone();
        fin["metadata"]["finalizers"] = json!([]);
        s.update(&vm_kind(), "default", fin, UpdateScope::All)
            .await
            .unwrap();
        assert!(matches!(
            s.get(&vm_kind(), "default", "f").await,
            Err(StoreError::NotFound { .. })
        ));
    }
}

fn owned(name: &str, owner: &Value) -> Value {
    let mut o = obj(name, json!({}));
    o["kind"] = json!("VirtualMachineInstance");
    o["metadata"]["ownerReferences"] = json!([{
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"], "controller": true,
    }]);
    o
}

#[tokio::test]
async fn garbage_collection_policies() {
    for (s, _dir) in stores().await {
        // Background: dependents follow the owner.
        let vm = s
            .create(&vm_kind(), "default", obj("bg", json!({})))
            .await
            .unwrap();
        s.create(&vmi_kind(), "default", owned("bg", &vm))
            .await
            .unwrap();
        s.delete(&vm_kind(), "default", "bg", &DeleteOptions::default())
            .await
            .unwrap();
        assert!(matches!(
            s.get(&vmi_kind(), "default", "bg").await,
            Err(StoreError::NotFound { .. })
        ));

        // Orphan: dependents stay, without the reference.
        let vm = s
            .create(&vm_kind(), "default", obj("or", json!({})))
            .await
            .unwrap();
        s.create(&vmi_kind(), "default", owned("or", &vm))
            .await
            .unwrap();
        let opts = DeleteOptions {
            propagation: Propagation::Orphan,
            ..Default::default()
        };
        s.delete(&vm_kind(), "default", "or", &opts).await.unwrap();
        let left = s.get(&vmi_kind(), "default", "or").await.unwrap();
        assert!(left["metadata"].get("ownerReferences").is_none());

        // Foreground: owner waits for a dependent that has its own finalizer.
        let vm = s
            .create(&vm_kind(), "default", obj("fg", json!({})))
            .await
            .unwrap();
        let mut dep = owned("fg", &vm);
        dep["metadata"]["finalizers"] = json!(["agent"]);
        s.create(&vmi_kind(), "default", dep).await.unwrap();
        let opts = DeleteOptions {
            propagation: Propagation::Foreground,
            ..Default::default()
        };
        let (owner, removed) = s.delete(&vm_kind(), "default", "fg", &opts).await.unwrap();
        assert!(!removed);
        assert_eq!(
            owner["metadata"]["finalizers"],
            json!(["foregroundDeletion"])
        );
        let d = s.get(&vmi_kind(), "default", "fg").await.unwrap();
        assert!(d["metadata"]["deletionTimestamp"].is_string());
        let mut d2 = d.clone();
        d2["metadata"]["finalizers"] = json!([]);
        s.update(&vmi_kind(), "default", d2, UpdateScope::All)
            .await
            .unwrap();
        assert!(matches!(
            s.get(&vmi_kind(), "default", "fg").await,
            Err(StoreError::NotFound { .. })
        ));
        assert!(
            matches!(
                s.get(&vm_kind(), "default", "fg").await,
                Err(StoreError::NotFound { .. })
            ),
            "owner finished"
        );
    }
}

#[tokio::test]
async fn redb_survives_reopen_with_same_versions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    let before: Vec<Value>;
    {
        let s = RedbStore::open(&path).unwrap();
        for i in 0..50 {
            s.create(
                &vm_kind(),
                "default",
                obj(&format!("vm{i}"), json!({"i": i.to_string()})),
            )
            .await
            .unwrap();
        }
        let v = s.get(&vm_kind(), "default", "vm7").await.unwrap();
        let mut v2 = v.clone();
        v2["spec"]["running"] = json!(true);
        s.update(&vm_kind(), "default", v2, UpdateScope::All)
            .await
            .unwrap();
        s.delete(&vm_kind(), "default", "vm8", &DeleteOptions::default())
            .await
            .unwrap();
        before = s
            .list(&vm_kind(), None, &ListOptions::default())
            .await
            .unwrap()
            .items;
        assert_eq!(s.resource_version(), 52);
    }
    let s = RedbStore::open(&path).unwrap();
    assert_eq!(s.resource_version(), 52);
    let after = s
        .list(&vm_kind(), None, &ListOptions::default())
        .await
        .unwrap()
        .items;
    assert_eq!(
        before, after,
        "every object back with the same resourceVersion"
    );
    // The history survives too: a watch from before the restart replays it.
    let mut w = s
        .watch(
            &vm_kind(),
            None,
            &WatchOptions {
                resource_version: Some(50),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let e = w.next().await.unwrap().unwrap();
    assert_eq!((e.type_, e.resource_version), (EventType::Modified, 51));
    let e = w.next().await.unwrap().unwrap();
    assert_eq!((e.type_, e.resource_version), (EventType::Deleted, 52));
    // New writes continue the sequence.
    let n = s
        .create(&vm_kind(), "default", obj("new", json!({})))
        .await
        .unwrap();
    assert_eq!(rv(&n), 53);
}

#[tokio::test]
async fn typed_helpers_round_trip() {
    use crate::resources::{VirtualMachine, VirtualMachineSpec};
    let s = MemoryStore::new();
    let vm = VirtualMachine::new(
        "t",
        VirtualMachineSpec {
            running: Some(true),
            ..Default::default()
        },
    )
    .in_namespace("default");
    let created = s.create_typed(&vm).await.unwrap();
    assert_eq!(created.metadata.resource_version.as_deref(), Some("1"));
    let got: VirtualMachine = s.get_typed("default", "t").await.unwrap();
    assert_eq!(got.spec.running, Some(true));
    let updated: VirtualMachine = s
        .modify_typed(
            "default",
            "t",
            UpdateScope::All,
            |v: &mut VirtualMachine| v.spec.running = Some(false),
        )
        .await
        .unwrap();
    assert_eq!(updated.spec.running, Some(false));
    assert_eq!(
        s.list_typed::<VirtualMachine>(Some("default"), &ListOptions::default())
            .await
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test]
async fn generate_name_and_namespace_cascade() {
    let s = MemoryStore::new();
    let ns = GroupKind::new("", "Namespace");
    s.create(
        &ns,
        "",
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}}),
    )
    .await
    .unwrap();
    let mut g = obj("", json!({}));
    g["metadata"] = json!({"generateName": "vm-"});
    let made = s.create(&vm_kind(), "team", g).await.unwrap();
    let name = made["metadata"]["name"].as_str().unwrap();
    assert!(name.starts_with("vm-") && name.len() == 8, "{name}");
    s.delete(&ns, "", "team", &DeleteOptions::default())
        .await
        .unwrap();
    assert!(
        s.list(&vm_kind(), Some("team"), &ListOptions::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
}

fn nested(depth: usize) -> Value {
    let mut v = json!("leaf");
    for _ in 0..depth {
        v = json!({ "f:x": v });
    }
    v
}

/// Issue 18 item 6: an object too deep to be read back is refused at write
/// time (create and update), and a store holding an unreadable record (a
/// 200-deep one written behind the store's back) still opens, serves every
/// other object and reports the bad one.
#[tokio::test]
async fn unreadable_objects_are_refused_and_survived() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    {
        let s = RedbStore::open(&path).unwrap();
        let mut deep = obj("deep", json!({}));
        deep["metadata"]["managedFields"] = json!([nested(127)]);
        let e = s.create(&vm_kind(), "default", deep).await.unwrap_err();
        assert!(e.to_string().contains("levels deep"), "{e}");
        s.create(&vm_kind(), "default", obj("ok", json!({})))
            .await
            .unwrap();
        let mut v = s.get(&vm_kind(), "default", "ok").await.unwrap();
        v["spec"]["deep"] = nested(150);
        let e = s
            .update(&vm_kind(), "default", v, UpdateScope::All)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("levels deep"), "{e}");
        assert!(s.unreadable().is_empty());
    }
    {
        // Behind the store's back: a record serde_json cannot read (too deep).
        let db = ::redb::Database::create(&path).unwrap();
        let w = db.begin_write().unwrap();
        {
            let mut t = w.open_table(super::redb::OBJECTS_TABLE).unwrap();
            let bad = "[".repeat(200) + &"]".repeat(200);
            t.insert("kubevirt.io/VirtualMachine/default/bad", bad.as_bytes())
                .unwrap();
        }
        w.commit().unwrap();
    }
    let s = RedbStore::open(&path).unwrap();
    let bad = s.unreadable();
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].contains("default/bad"), "{bad:?}");
    let got = s.get(&vm_kind(), "default", "ok").await.unwrap();
    assert_eq!(got["metadata"]["name"], "ok");
}

/// Issue 18 item 6: an object whose encoding passes `MAX_OBJECT_BYTES` is
/// refused on create and on update, and the stored version is kept.
#[tokio::test]
async fn oversized_objects_are_refused() {
    let s = MemoryStore::new();
    let mut big = obj("big", json!({}));
    big["spec"]["blob"] = json!("x".repeat(super::MAX_OBJECT_BYTES));
    let e = s.create(&vm_kind(), "default", big).await.unwrap_err();
    assert!(e.to_string().contains("larger than the limit"), "{e}");
    s.create(&vm_kind(), "default", obj("ok", json!({"a": "1"})))
        .await
        .unwrap();
    let mut v = s.get(&vm_kind(), "default", "ok").await.unwrap();
    v["spec"]["blob"] = json!("x".repeat(super::MAX_OBJECT_BYTES));
    let e = s
        .update(&vm_kind(), "default", v, UpdateScope::All)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("larger than the limit"), "{e}");
    let got = s.get(&vm_kind(), "default", "ok").await.unwrap();
    assert_eq!(got["metadata"]["labels"]["a"], "1");
    assert!(got["spec"]["blob"].is_null());
}

/// Issue 18 item 5: the store file is 0600 from creation, and a second
/// opener of the same store directory is refused while the first holds it
/// (and gets it once the first is closed).
#[tokio::test]
async fn store_file_is_private_and_the_directory_is_locked() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.redb");
    let s = RedbStore::open(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let e = RedbStore::open(dir.path().join("other.redb")).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("already open in another process"), "{msg}");
    assert!(msg.contains(&std::process::id().to_string()), "{msg}");
    drop(s);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let _s = RedbStore::open(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "an existing store file is made private");
}
