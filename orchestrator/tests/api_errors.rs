// SPDX-License-Identifier: Apache-2.0
//! Bad input and authentication over real HTTPS: every refusal is a
//! Kubernetes Status with the right code, and nothing stored is lost.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Client, manifest, recv, start};
use serde_json::{Value, json};

const VMS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachines";

fn vm(name: &str) -> Value {
    let docs: Vec<Value> = serde_yaml::Deserializer::from_str(&manifest("vm-cirros.yaml"))
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let mut v = docs
        .into_iter()
        .find(|d| d["kind"] == "VirtualMachine")
        .unwrap();
    v["metadata"]["name"] = json!(name);
    v
}

fn assert_status(r: &common::Reply, code: u16, reason: &str) -> Value {
    let s = r.json();
    assert_eq!(r.status, code, "{s}");
    assert_eq!(s["kind"], "Status");
    assert_eq!(s["code"], code);
    assert_eq!(s["reason"], reason, "{s}");
    s
}

#[tokio::test]
async fn authentication_and_read_only_role() {
    let ts = start().await;
    let admin = Client::new(&ts);
    assert_eq!(admin.get(VMS).await.status, 200);
    assert_status(
        &Client::new(&ts).with_token(None).get(VMS).await,
        401,
        "Unauthorized",
    );
    assert_status(
        &Client::new(&ts).with_token(Some("nope")).get("/apis").await,
        401,
        "Unauthorized",
    );
    let ro = Client::new(&ts).with_token(Some(&ts.server.tokens.readonly));
    assert_eq!(ro.get(VMS).await.status, 200);
    assert_status(&ro.post_json(VMS, &vm("ro")).await, 403, "Forbidden");
    assert_eq!(
        Client::new(&ts)
            .with_token(None)
            .get("/healthz")
            .await
            .status,
        200
    );
    // The kubeconfig is private and names both users.
    let kc = std::fs::read_to_string(&ts.server.kubeconfig).unwrap();
    assert!(kc.contains(&ts.server.tokens.admin) && kc.contains("sheaf-readonly"));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&ts.server.kubeconfig)
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
}

#[tokio::test]
async fn bad_bodies_get_status_errors() {
    let ts = start().await;
    let c = Client::new(&ts);
    assert_eq!(c.post_json(VMS, &vm("keep")).await.status, 201);

    assert_status(
        &c.req("POST", VMS, Some("application/json"), "{not json")
            .await,
        400,
        "BadRequest",
    );
    assert_status(
        &c.req("POST", VMS, Some("application/yaml"), "a: [").await,
        400,
        "BadRequest",
    );
    assert_status(
        &c.req("POST", VMS, Some("application/json"), "[1,2]").await,
        400,
        "BadRequest",
    );
    assert_status(
        &c.req("POST", VMS, Some("application/json"), "").await,
        400,
        "BadRequest",
    );
    assert_status(
        &c.req(
            "POST",
            VMS,
            Some("application/vnd.kubernetes.protobuf"),
            "x",
        )
        .await,
        415,
        "UnsupportedMediaType",
    );
    assert_status(
        &c.req("PATCH", &format!("{VMS}/keep"), Some("text/plain"), "{}")
            .await,
        415,
        "UnsupportedMediaType",
    );
    assert_status(
        &c.req("POST", VMS, Some("application/json"), vec![b' '; 4 << 20])
            .await,
        413,
        "RequestEntityTooLarge",
    );
    assert_status(
        &c.get("/apis/kubevirt.io/v1/namespaces/default/widgets")
            .await,
        404,
        "NotFound",
    );
    assert_status(&c.get("/apis/nope.io/v1").await, 404, "NotFound");
    assert_status(&c.get(&format!("{VMS}/missing")).await, 404, "NotFound");
    assert_status(
        &c.req("PUT", VMS, Some("application/json"), "{}").await,
        405,
        "MethodNotAllowed",
    );
    assert_status(
        &c.get(&format!("{VMS}?labelSelector=a%20in%20b")).await,
        400,
        "BadRequest",
    );

    // Wrong kind for the URL, and an unknown kind.
    let mut wrong = vm("w");
    wrong["kind"] = json!("VirtualMachineInstance");
    assert_status(&c.post_json(VMS, &wrong).await, 400, "BadRequest");
    let mut gadget = vm("g");
    gadget["kind"] = json!("Gadget");
    assert_status(&c.post_json(VMS, &gadget).await, 400, "BadRequest");

    // Unknown fields: strict by default, names the field path.
    let mut unknown = vm("u");
    unknown["spec"]["template"]["spec"]["domain"]["devices"]["disks"][0]["frobnicate"] =
        json!(true);
    let s = assert_status(&c.post_json(VMS, &unknown).await, 400, "BadRequest");
    assert!(
        s["message"]
            .as_str()
            .unwrap()
            .contains("unknown field \"spec.template.spec.domain.devices.disks[0].frobnicate\""),
        "{s}"
    );
    // ... dropped with a warning when the client asks for Warn.
    let r = c
        .post_json(&format!("{VMS}?fieldValidation=Warn"), &unknown)
        .await;
    assert_eq!(r.status, 201);
    assert!(
        r.headers
            .get("warning")
            .unwrap()
            .to_str()
            .unwrap()
            .contains("frobnicate")
    );
    assert!(
        r.json()["spec"]["template"]["spec"]["domain"]["devices"]["disks"][0]
            .get("frobnicate")
            .is_none()
    );

    // Invalid values: 422 with causes naming the field.
    let mut scsi = vm("s");
    scsi["spec"]["template"]["spec"]["domain"]["devices"]["disks"][0]["disk"]["bus"] =
        json!("scsi");
    let s = assert_status(&c.post_json(VMS, &scsi).await, 422, "Invalid");
    let cause = &s["details"]["causes"][0];
    assert_eq!(
        cause["field"],
        "spec.template.spec.domain.devices.disks[0].disk.bus"
    );
    assert_eq!(cause["reason"], "FieldValueNotSupported");
    assert!(
        s["message"]
            .as_str()
            .unwrap()
            .contains("Unsupported value: \"scsi\"")
    );
    let mut both = vm("b");
    both["spec"]["runStrategy"] = json!("Always");
    both["spec"]["template"]["spec"]["domain"]["resources"]["requests"]["memory"] = json!("lots");
    let s = assert_status(&c.post_json(VMS, &both).await, 422, "Invalid");
    let fields: Vec<&str> = s["details"]["causes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["field"].as_str().unwrap())
        .collect();
    assert!(
        fields.contains(&"spec.running")
            && fields.contains(&"spec.template.spec.domain.resources.requests.memory"),
        "{fields:?}"
    );
    // Networks: an interface without its network, a multicast MAC, two
    // interfaces with one MAC — each a cause naming the field.
    let mut nets = vm("n");
    let t = &mut nets["spec"]["template"]["spec"];
    t["networks"] = json!([{"name": "default", "pod": {}}, {"name": "second", "pod": {}}]);
    t["domain"]["devices"]["interfaces"] = json!([
        {"name": "default", "masquerade": {}, "macAddress": "02:00:00:00:00:01"},
        {"name": "second", "bridge": {}, "macAddress": "02:00:00:00:00:01"},
        {"name": "ghost", "masquerade": {}, "macAddress": "03:00:00:00:00:02"},
    ]);
    let s = assert_status(&c.post_json(VMS, &nets).await, 422, "Invalid");
    let causes: Vec<(String, String)> = s["details"]["causes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["field"].as_str().unwrap().to_string(),
                c["message"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    let ifs = "spec.template.spec.domain.devices.interfaces";
    let has = |f: &str, m: &str| causes.iter().any(|(cf, cm)| cf == f && cm.contains(m));
    assert!(
        has(&format!("{ifs}[1].macAddress"), "Duplicate"),
        "{causes:?}"
    );
    assert!(
        has(&format!("{ifs}[2].name"), "no network of that name"),
        "{causes:?}"
    );
    assert!(
        has(&format!("{ifs}[2].macAddress"), "unicast"),
        "{causes:?}"
    );
    let mut badname = vm("Bad_Name");
    badname["metadata"]["name"] = json!("Bad_Name");
    assert_status(&c.post_json(VMS, &badname).await, 422, "Invalid");
    // Missing namespace.
    assert_status(
        &c.post_json(
            "/apis/kubevirt.io/v1/namespaces/ghost/virtualmachines",
            &vm("x"),
        )
        .await,
        404,
        "NotFound",
    );

    // Conflicts.
    assert_status(&c.post_json(VMS, &vm("keep")).await, 409, "AlreadyExists");
    let cur = c.get(&format!("{VMS}/keep")).await.json();
    let mut stale = cur.clone();
    stale["metadata"]["resourceVersion"] = json!("1");
    stale["spec"]["running"] = json!(true);
    assert_status(
        &c.req(
            "PUT",
            &format!("{VMS}/keep"),
            Some("application/json"),
            serde_json::to_vec(&stale).unwrap(),
        )
        .await,
        409,
        "Conflict",
    );
    let stale_patch = json!({"metadata": {"resourceVersion": "1"}, "spec": {"running": true}});
    assert_status(
        &c.req(
            "PATCH",
            &format!("{VMS}/keep"),
            Some("application/merge-patch+json"),
            serde_json::to_vec(&stale_patch).unwrap(),
        )
        .await,
        409,
        "Conflict",
    );
    // A failed JSON patch test op.
    let failing = r#"[{"op":"test","path":"/spec/running","value":true}]"#;
    assert_status(
        &c.req(
            "PATCH",
            &format!("{VMS}/keep"),
            Some("application/json-patch+json"),
            failing,
        )
        .await,
        422,
        "Invalid",
    );
    // Refused deletes of system namespaces.
    assert_status(
        &c.req("DELETE", "/api/v1/namespaces/default", None, "")
            .await,
        403,
        "Forbidden",
    );

    // After all that, the original object is intact.
    let after = c.get(&format!("{VMS}/keep")).await.json();
    assert_eq!(after, cur);
}

#[tokio::test]
async fn watch_gone_and_bookmarks() {
    use std::sync::Arc;
    let store = Arc::new(sheaf_orchestrator::store::MemoryStore::with_history(10));
    let ts = common::start_with(store, |c| {
        c.bookmark_interval = std::time::Duration::from_millis(200)
    })
    .await;
    let c = Client::new(&ts);
    for i in 0..30 {
        assert_eq!(c.post_json(VMS, &vm(&format!("vm{i}"))).await.status, 201);
    }
    let mut old = c.watch(&format!("{VMS}?watch=1&resourceVersion=2")).await;
    let ev = recv(&mut old).await;
    assert_eq!(ev["type"], "ERROR");
    assert_eq!(ev["object"]["code"], 410);
    assert_eq!(ev["object"]["reason"], "Expired");

    let rv = c.get(VMS).await.json()["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    let mut w = c
        .watch(&format!(
            "{VMS}?watch=1&resourceVersion={rv}&allowWatchBookmarks=true"
        ))
        .await;
    assert_eq!(c.post_json(VMS, &vm("late")).await.status, 201);
    let ev = recv(&mut w).await;
    assert_eq!(
        (
            ev["type"].as_str().unwrap(),
            ev["object"]["metadata"]["name"].as_str().unwrap()
        ),
        ("ADDED", "late")
    );
    // Writes to another kind advance the version; a bookmark reports it.
    let vol = json!({"apiVersion": "sheaf.dev/v1", "kind": "Volume", "metadata": {"name": "v"}, "spec": {"size": "1Gi"}});
    assert_eq!(
        c.post_json("/apis/sheaf.dev/v1/namespaces/default/volumes", &vol)
            .await
            .status,
        201
    );
    let bm = recv(&mut w).await;
    assert_eq!(bm["type"], "BOOKMARK");
    assert_eq!(bm["object"]["kind"], "VirtualMachine");
    let bm_rv: u64 = bm["object"]["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        bm_rv > rv.parse::<u64>().unwrap() + 1,
        "bookmark {bm_rv} covers the volume write"
    );
}

#[tokio::test]
async fn discovery_and_openapi() {
    let ts = start().await;
    let c = Client::new(&ts);
    assert_eq!(c.get("/version").await.json()["major"], "1");
    let groups = c.get("/apis").await.json();
    let names: Vec<&str> = groups["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        vec!["kubevirt.io", "sheaf.dev", "coordination.k8s.io"]
    );
    let index = c.get("/openapi/v3").await.json();
    let url = index["paths"]["apis/kubevirt.io/v1"]["serverRelativeURL"]
        .as_str()
        .unwrap()
        .to_string();
    let doc = c.get(&url).await.json();
    assert!(doc["components"]["schemas"]["io.kubevirt.v1.VirtualMachineInstance"].is_object());
    let table = c.req("GET", VMS, None, "").await;
    assert_eq!(table.status, 200);
    let mut s = c.connect().await;
    let r = Client::send_on(
        &mut s,
        c.build(
            "GET",
            "/apis/sheaf.dev/v1/nodes",
            None,
            "",
            Some("application/json;as=Table;v=v1;g=meta.k8s.io,application/json"),
        ),
    )
    .await;
    let t = r.json();
    assert_eq!(t["kind"], "Table");
    assert_eq!(t["columnDefinitions"][1]["name"], "Status");
}

/// Names reach host paths (a node keeps a volume's replica in
/// `replicas/{ns}_{name}` and removes it with the volume): every route that
/// can create an object refuses a namespace or name that is not a plain
/// DNS-1123 name, percent-encoded or not, and nothing is stored.
#[tokio::test]
async fn names_that_leave_a_directory_are_refused_on_every_route() {
    let ts = start().await;
    let c = Client::new(&ts);
    let vol = |name: &str| {
        json!({"apiVersion": "sheaf.dev/v1", "kind": "Volume",
            "metadata": {"name": name}, "spec": {"size": "16Mi", "replicas": 1}})
    };
    const VOLS: &str = "/apis/sheaf.dev/v1/namespaces/default/volumes";
    for name in ["../../victim", "a/../../b", "..", "."] {
        assert_status(&c.post_json(VOLS, &vol(name)).await, 422, "Invalid");
    }
    // A namespace of `..` or `../x`, percent-encoded in the path.
    for ns in ["..", "..%2F..%2Fvictim", "a%2Fb"] {
        let r = c
            .post_json(
                &format!("/apis/sheaf.dev/v1/namespaces/{ns}/volumes"),
                &vol("v"),
            )
            .await;
        assert!((400..500).contains(&r.status), "{ns}: {}", r.json());
    }
    // Server-side apply and PUT create-or-update with the name in the path.
    let enc = "..%2F..%2Fvictim";
    let mut body = vol("../../victim");
    body["metadata"]["namespace"] = json!("default");
    let r = c
        .req(
            "PATCH",
            &format!("{VOLS}/{enc}?fieldManager=test"),
            Some("application/apply-patch+yaml"),
            body.to_string(),
        )
        .await;
    assert!((400..500).contains(&r.status), "apply: {}", r.json());
    let r = c
        .req(
            "PUT",
            &format!("{VOLS}/{enc}"),
            Some("application/json"),
            body.to_string(),
        )
        .await;
    assert!((400..500).contains(&r.status), "put: {}", r.json());
    // The store itself refuses, whatever route a caller takes.
    let gk = sheaf_orchestrator::store::GroupKind::new("sheaf.dev", "Volume");
    let e = ts
        .store
        .create(&gk, "default", vol("../../victim"))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("metadata.name"), "{e}");
    let e = ts.store.create(&gk, "..", vol("v")).await.unwrap_err();
    assert!(e.to_string().contains("metadata.namespace"), "{e}");
    let all = ts.store.list(&gk, None, &Default::default()).await.unwrap();
    assert!(all.items.is_empty(), "{:?}", all.items);
}

/// Issue 18 item 6: an object nested deeper than can be read back (here
/// 127-deep managedFields) is refused with 422 at write time, not stored.
#[tokio::test]
async fn objects_too_deep_to_read_back_are_refused() {
    let ts = start().await;
    let c = Client::new(&ts);
    let mut leaf = json!("x");
    for _ in 0..120 {
        leaf = json!({ "f:x": leaf });
    }
    let mut v = vm("deep");
    v["metadata"]["managedFields"] =
        json!([{"manager": "m", "operation": "Apply", "fieldsV1": leaf}]);
    let r = c.post_json(VMS, &v).await;
    assert!((400..500).contains(&r.status), "{}", r.json());
    assert_eq!(c.get(&format!("{VMS}/deep")).await.status, 404);
}

/// Issue 18 item 6: a JSON patch of repeated `copy` operations (each one
/// doubling a subtree) is refused with 413 before the object grows, the
/// stored object is unchanged and the server keeps serving; a patch with
/// more operations than Kubernetes allows is refused likewise.
#[tokio::test]
async fn json_patch_amplification_is_refused() {
    let ts = start().await;
    let c = Client::new(&ts);
    let mut v = vm("amp");
    v["metadata"]["annotations"] = json!({"seed": "x".repeat(4096)});
    assert_eq!(c.post_json(VMS, &v).await.status, 201);
    let path = format!("{VMS}/amp");
    let before = c.get(&path).await.json();
    let mut ops =
        vec![json!({"op": "add", "path": "/spec/template/metadata", "value": {"annotations": {}}})];
    let mut prev = "/metadata/annotations/seed".to_string();
    for i in 0..60 {
        let path = format!("/spec/template/metadata/annotations/a{i}");
        ops.push(json!({"op": "copy", "from": prev, "path": path}));
        prev = path;
        // Copy the whole growing map into itself: doubles each time.
        let whole = format!("/spec/template/metadata/annotations/m{i}");
        ops.push(
            json!({"op": "copy", "from": "/spec/template/metadata/annotations", "path": whole}),
        );
    }
    let ct = Some("application/json-patch+json");
    let r = c
        .req("PATCH", &path, ct, serde_json::to_vec(&ops).unwrap())
        .await;
    let st = assert_status(&r, 413, "RequestEntityTooLarge");
    assert!(
        st["message"]
            .as_str()
            .unwrap_or("")
            .contains("larger than the limit"),
        "{st}"
    );
    let got = c.get(&path).await.json();
    assert_eq!(got["spec"], before["spec"]);
    assert_eq!(
        got["metadata"]["resourceVersion"],
        before["metadata"]["resourceVersion"]
    );

    let ops: Vec<Value> = (0..10_001)
        .map(|_| json!({"op": "test", "path": "/metadata/name", "value": "amp"}))
        .collect();
    let r = c
        .req("PATCH", &path, ct, serde_json::to_vec(&ops).unwrap())
        .await;
    assert_status(&r, 413, "RequestEntityTooLarge");
    assert_eq!(c.get(&path).await.status, 200);
}
