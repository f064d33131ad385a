// SPDX-License-Identifier: Apache-2.0
//! core/v1 Secrets over real HTTPS (stored as Kubernetes stores them, hidden
//! from the read-only token) and KubeVirt's cloud-init admission checks.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Client, start};
use serde_json::{Value, json};

const SECRETS: &str = "/api/v1/namespaces/default/secrets";
const VMIS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstances";

fn vmi(name: &str, cloud_init: Value) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "domain": {
                "memory": {"guest": "64Mi"},
                "firmware": {"kernelBoot": {"container": {"image": "sheaf.dev/probe"}}},
                "devices": {"disks": [{"name": "cloudinitdisk", "disk": {"bus": "virtio"}}]}
            },
            "volumes": [{"name": "cloudinitdisk", "cloudInitNoCloud": cloud_init}]
        }
    })
}

/// The causes of a 422, as "field: message".
fn causes(r: &common::Reply) -> Vec<String> {
    let s = r.json();
    assert_eq!(r.status, 422, "{s}");
    s["details"]["causes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            format!(
                "{}: {}",
                c["field"].as_str().unwrap(),
                c["message"].as_str().unwrap()
            )
        })
        .collect()
}

#[tokio::test]
async fn secrets_are_stored_as_kubernetes_stores_them() {
    let ts = start().await;
    let admin = Client::new(&ts);
    let r = admin
        .post_json(
            SECRETS,
            &json!({"apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": "ud"},
                    "data": {"other": "eA=="},
                    "stringData": {"userdata": "#cloud-config\n"}}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let got = admin.get(&format!("{SECRETS}/ud")).await.json();
    assert_eq!(got["data"]["userdata"], "I2Nsb3VkLWNvbmZpZwo=", "{got}");
    assert_eq!(got["data"]["other"], "eA==");
    assert!(
        got.get("stringData").is_none(),
        "stringData is write-only: {got}"
    );
    assert_eq!(got["type"], "Opaque");

    // Bad keys and bad base64 are refused, naming the field.
    let r = admin
        .post_json(
            SECRETS,
            &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "bad"},
                    "data": {"../key": "eA=="}}),
        )
        .await;
    assert!(
        causes(&r).iter().any(|c| c.starts_with("data[../key]")),
        "{:?}",
        causes(&r)
    );
    let r = admin
        .post_json(
            SECRETS,
            &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "bad"},
                    "data": {"k": "not base64!"}}),
        )
        .await;
    assert!(r.status == 400 || r.status == 422, "{}", r.status);

    // The read-only token reads VMs but no Secret, by any path.
    let ro = Client::new(&ts).with_token(Some(&ts.server.tokens.readonly));
    assert_eq!(ro.get(VMIS).await.status, 200);
    for p in [
        format!("{SECRETS}/ud"),
        SECRETS.to_string(),
        "/api/v1/secrets".to_string(),
        format!("{SECRETS}?watch=true"),
    ] {
        let r = ro.get(&p).await;
        assert_eq!(r.status, 403, "{p}");
        let msg = r.json()["message"].as_str().unwrap().to_string();
        assert!(msg.contains("may not read Secrets"), "{msg}");
    }
    // An encoded plural reaches no Secret either.
    assert_eq!(
        ro.get("/api/v1/namespaces/default/%73ecrets/ud")
            .await
            .status,
        404
    );
}

#[tokio::test]
async fn cloud_init_is_checked_as_kubevirt_checks_it() {
    let ts = start().await;
    let admin = Client::new(&ts);
    let ok = admin
        .post_json(
            VMIS,
            &vmi(
                "ok",
                json!({"userData": "#cloud-config\n", "networkDataSecretRef": {"name": "net"}}),
            ),
        )
        .await;
    assert_eq!(ok.status, 201, "{}", String::from_utf8_lossy(&ok.body));
    let at_limit = "x".repeat(2048);
    assert_eq!(
        admin
            .post_json(VMIS, &vmi("limit", json!({"userData": at_limit})))
            .await
            .status,
        201
    );

    let p = "spec.volumes[0].cloudInitNoCloud";
    let cases = [
        (
            json!({"userData": "x".repeat(2049)}),
            format!(
                "{p}.userData: Forbidden: user data is 2049 bytes, over the 2048-byte limit for inline data; put it in a Secret and use secretRef"
            ),
        ),
        (
            json!({"userDataBase64": "not base64!"}),
            format!("{p}.userDataBase64: Invalid value: \"<base64>\": not valid base64"),
        ),
        (
            json!({"userData": "a", "secretRef": {"name": "s"}}),
            format!("{p}.secretRef: Forbidden: userData and secretRef are mutually exclusive"),
        ),
        (
            json!({"networkData": "a", "networkDataBase64": "YQ=="}),
            format!(
                "{p}.networkDataBase64: Forbidden: networkData and networkDataBase64 are mutually exclusive"
            ),
        ),
        (json!({}), format!("{p}: Required value: set user data")),
        (
            json!({"secretRef": {"name": "../x"}}),
            format!("{p}.secretRef.name: Invalid value: \"../x\""),
        ),
    ];
    for (i, (ci, want)) in cases.into_iter().enumerate() {
        let r = admin
            .post_json(VMIS, &vmi(&format!("bad{i}"), ci.clone()))
            .await;
        let c = causes(&r);
        assert!(
            c.iter().any(|c| c.starts_with(&want)),
            "{ci}: want {want:?}, got {c:?}"
        );
    }
}
