// SPDX-License-Identifier: Apache-2.0
//! The web dashboard (`/ui/`) in a real browser: headless Debian Chromium
//! driven over WebDriver (chromedriver + fantoccini) against an API server
//! started in-process on an in-memory store.
//!
//! Chromium and chromedriver come from `scripts/setup`. Without them the
//! browser test fails (it does not skip), unless `SHEAF_TEST_QUICK=1`.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Client, TestServer, manifest, start};
use fantoccini::{ClientBuilder, Locator};
use serde_json::{Value, json};
use sheaf_orchestrator::api::ui::CONTENT_SECURITY_POLICY;
use sheaf_orchestrator::store::GroupKind;

const VMS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachines";
const VMIS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstances";
const VOLUMES: &str = "/apis/sheaf.dev/v1/namespaces/default/volumes";
const NODES: &str = "/apis/sheaf.dev/v1/nodes";
const MERGE: &str = "application/merge-patch+json";

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

async fn patch(c: &Client, path: &str, body: Value) {
    let r = c
        .req(
            "PATCH",
            path,
            Some(MERGE),
            serde_json::to_vec(&body).unwrap(),
        )
        .await;
    assert_eq!(
        r.status,
        200,
        "PATCH {path}: {}",
        String::from_utf8_lossy(&r.body)
    );
}

async fn post(c: &Client, path: &str, body: &Value) {
    let r = c.post_json(path, body).await;
    assert_eq!(
        r.status,
        201,
        "POST {path}: {}",
        String::from_utf8_lossy(&r.body)
    );
}

/// A node, a volume, a VM with a running instance (phase, node, IP), all
/// through the HTTP API.
async fn seed(ts: &TestServer) {
    let c = Client::new(ts);
    post(&c, NODES, &json!({"apiVersion": "sheaf.dev/v1", "kind": "Node", "metadata": {"name": "node-a"}, "spec": {"zone": "zone-1"}})).await;
    patch(
        &c,
        &format!("{NODES}/node-a/status"),
        json!({"status": {
        "capacity": {"cpu": "8", "memory": "16Gi"}, "allocatable": {"cpu": "7", "memory": "15Gi"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "AgentHeartbeat"}]}}),
    )
    .await;
    post(
        &c,
        VOLUMES,
        &json!({"apiVersion": "sheaf.dev/v1", "kind": "Volume",
        "metadata": {"name": "cirros-disk"}, "spec": {"size": "1Gi", "replicas": 3}}),
    )
    .await;
    patch(
        &c,
        &format!("{VOLUMES}/cirros-disk/status"),
        json!({"status": {"phase": "Degraded",
        "replicas": [{"nodeName": "node-a", "state": "Healthy", "epoch": 2},
                     {"nodeName": "node-b", "state": "Rebuilding", "epoch": 2}]}}),
    )
    .await;
    let mut web = vm("web-1");
    web["spec"]["running"] = json!(true);
    // Hostile data: it must reach the page as text, never as markup.
    web["metadata"]["annotations"] = json!({"note": "<img id=\"pwned\" src=x>"});
    post(&c, VMS, &web).await;
    post(
        &c,
        VMIS,
        &json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "web-1"}, "spec": web["spec"]["template"]["spec"]}),
    )
    .await;
    patch(
        &c,
        &format!("{VMIS}/web-1/status"),
        json!({"status": {"phase": "Running",
        "nodeName": "node-a", "interfaces": [{"name": "default", "ipAddress": "10.0.2.15"}]}}),
    )
    .await;
}

#[tokio::test]
async fn assets_are_public_with_a_strict_policy_and_data_is_not() {
    let ts = start().await;
    let anon = Client::new(&ts).with_token(None);
    for (path, ct) in [
        ("/ui/", "text/html; charset=utf-8"),
        ("/ui/style.css", "text/css; charset=utf-8"),
        ("/ui/js/app.js", "text/javascript; charset=utf-8"),
        ("/ui/js/live.js", "text/javascript; charset=utf-8"),
    ] {
        let r = anon.get(path).await;
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.headers["content-type"], ct, "{path}");
        assert_eq!(
            r.headers["content-security-policy"],
            CONTENT_SECURITY_POLICY
        );
        assert_eq!(r.headers["x-content-type-options"], "nosniff");
        assert!(r.headers.get("set-cookie").is_none());
    }
    let r = anon.get("/ui").await;
    assert_eq!(r.status, 308);
    assert_eq!(r.headers["location"], "/ui/");
    assert_eq!(anon.get("/ui/js/../../api/v1").await.status, 404);
    assert_eq!(anon.get("/ui/nope.js").await.status, 404);
    // The data the page shows needs the token, as for kubectl.
    assert_eq!(anon.get(VMS).await.status, 401);
    assert_eq!(anon.get("/uix").await.status, 401);
}

/// chromedriver on a free port, killed on drop.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn driver() -> Driver {
    for tool in ["chromium", "chromedriver"] {
        assert!(
            sheaf_testkit::which(tool).is_some(),
            "{tool} is not installed: the dashboard's browser test needs Debian's \
             chromium and chromium-driver (run scripts/setup as root; \
             SHEAF_TEST_QUICK=1 skips this test)"
        );
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new("chromedriver")
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let d = Driver {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "chromedriver did not listen");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    d
}

async fn browser(d: &Driver, profile: &std::path::Path) -> fantoccini::Client {
    let mut caps = serde_json::Map::new();
    caps.insert("acceptInsecureCerts".into(), json!(true));
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": sheaf_testkit::which("chromium").unwrap(),
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--ignore-certificate-errors", "--window-size=1280,900",
                     format!("--user-data-dir={}", profile.display())],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&d.url)
        .await
        .unwrap()
}

/// Polls `f` until it yields `Some` (10 s), else fails naming `what`.
async fn until<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn text_of(b: &fantoccini::Client, css: &str) -> Option<String> {
    b.find(Locator::Css(css)).await.ok()?.text().await.ok()
}

async fn wait_text(b: &fantoccini::Client, css: &str, want: &str) -> String {
    until(&format!("{css} to contain {want:?}"), || async {
        text_of(b, css).await.filter(|t| t.contains(want))
    })
    .await
}

async fn click(b: &fantoccini::Client, css: &str) {
    let el = until(&format!("{css} to exist"), || async {
        b.find(Locator::Css(css)).await.ok()
    })
    .await;
    el.click().await.unwrap();
}

async fn fill(b: &fantoccini::Client, css: &str, value: &str) {
    let el = b.find(Locator::Css(css)).await.unwrap();
    el.clear().await.unwrap();
    el.send_keys(value).await.unwrap();
}

async fn login(b: &fantoccini::Client, token: &str) {
    until("the login form", || async {
        b.find(Locator::Css("#login:not([hidden]) #token"))
            .await
            .ok()
    })
    .await;
    fill(b, "#token", token).await;
    click(b, "#login-button").await;
}

async fn stored(ts: &TestServer, group: &str, kind: &str, name: &str) -> Option<Value> {
    ts.store
        .get(&GroupKind::new(group, kind), "default", name)
        .await
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_a_real_browser() {
    if sheaf_testkit::skip_slow("dashboard_in_a_real_browser") {
        return;
    }
    let ts = start().await;
    seed(&ts).await;
    let d = driver().await;
    let profile = tempfile::tempdir().unwrap();
    let b = browser(&d, profile.path()).await;
    let ui = format!("{}/ui/", ts.server.url);

    // A wrong token: an error, and no data on the page.
    b.goto(&ui).await.unwrap();
    login(&b, "not-a-token").await;
    wait_text(&b, "#login-error", "401").await;
    assert!(
        b.find(Locator::Css("#nav"))
            .await
            .unwrap()
            .attr("hidden")
            .await
            .unwrap()
            .is_some()
    );
    let src = b.source().await.unwrap();
    assert!(
        !src.contains("web-1") && !src.contains("node-a"),
        "data shown without a token"
    );

    // The admin token: the overview, then the VM list with the phase.
    login(&b, &ts.server.tokens.admin).await;
    wait_text(&b, "#overview-nodes", "node-a").await;
    wait_text(&b, "#tally-vms", "Running").await;
    wait_text(&b, "#tally-volumes", "Degraded").await;
    b.goto(&format!("{ui}#/vms")).await.unwrap();
    let row = wait_text(&b, "#vm-table tr[data-vm='default/web-1']", "Running").await;
    assert!(row.contains("node-a") && row.contains("10.0.2.15"), "{row}");

    // Live: a VM created through the API appears without a reload.
    post(&Client::new(&ts), VMS, &vm("late-1")).await;
    wait_text(&b, "#vm-table tr[data-vm='default/late-1']", "Stopped").await;

    // Detail: hostile annotation is text, not an element.
    click(&b, "#vm-table tr[data-vm='default/web-1'] a").await;
    wait_text(&b, "#vm-yaml", "<img id=").await;
    assert!(
        b.find(Locator::Css("#pwned")).await.is_err(),
        "markup from the API was parsed"
    );
    wait_text(&b, "#vm-phase", "Running").await;
    wait_text(&b, "#vm-ips", "10.0.2.15").await;

    // Stop: the spec changes in the store (running: false, as the VM said
    // `running`), and the page follows.
    click(&b, "#action-stop").await;
    until("web-1 stopped in the store", || async {
        let v = stored(&ts, "kubevirt.io", "VirtualMachine", "web-1").await?;
        (v["spec"]["running"] == json!(false)).then_some(())
    })
    .await;
    wait_text(&b, "#vm-strategy", "Halted").await;

    // Create from the form: preview YAML, then apply; the objects are stored.
    b.goto(&format!("{ui}#/create")).await.unwrap();
    until("the create form", || async {
        b.find(Locator::Css("#create-name")).await.ok()
    })
    .await;
    fill(&b, "#create-name", "from-form").await;
    fill(&b, "#create-image", "/var/lib/sheaf/images/cirros.img").await;
    fill(&b, "#create-cpu", "2").await;
    fill(&b, "#create-memory", "256").await;
    fill(&b, "#create-disk", "4").await;
    fill(&b, "#create-ssh", "ssh-ed25519 AAAAC3Nza test@dashboard").await;
    click(&b, "#create-preview-button").await;
    wait_text(&b, "#create-preview", "kind: VirtualMachine").await;
    // The exact text (WebDriver's text() trims the final newline).
    let yaml = b
        .find(Locator::Css("#create-preview"))
        .await
        .unwrap()
        .prop("textContent")
        .await
        .unwrap()
        .unwrap();
    let docs: Vec<Value> = serde_yaml::Deserializer::from_str(&yaml)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    assert_eq!(docs.len(), 2, "{yaml}");
    click(&b, "#create-apply").await;
    let made = until("from-form in the store", || async {
        stored(&ts, "kubevirt.io", "VirtualMachine", "from-form").await
    })
    .await;
    let dom = &made["spec"]["template"]["spec"];
    assert_eq!(dom["domain"]["cpu"]["cores"], 2);
    assert_eq!(dom["domain"]["resources"]["requests"]["memory"], "256Mi");
    assert_eq!(
        dom["volumes"][0]["persistentVolumeClaim"]["claimName"],
        "from-form-disk"
    );
    let ud = dom["volumes"][1]["cloudInitNoCloud"]["userData"]
        .as_str()
        .unwrap();
    assert!(
        ud.starts_with("#cloud-config") && ud.contains("ssh-ed25519 AAAAC3Nza test@dashboard"),
        "{ud}"
    );
    assert_eq!(made["spec"]["runStrategy"], "Halted");
    assert_eq!(
        made["spec"], docs[1]["spec"],
        "applied what the preview showed"
    );
    let disk = stored(&ts, "sheaf.dev", "Volume", "from-form-disk")
        .await
        .unwrap();
    assert_eq!(disk["spec"]["size"], "4Gi");
    assert_eq!(
        disk["spec"]["source"]["image"],
        "/var/lib/sheaf/images/cirros.img"
    );
    wait_text(&b, "#vm-detail h1", "from-form").await;

    // Volumes: replicas with their nodes and states.
    b.goto(&format!("{ui}#/volumes")).await.unwrap();
    let row = wait_text(
        &b,
        "#volume-table tr[data-volume='default/cirros-disk']",
        "Rebuilding",
    )
    .await;
    assert!(row.contains("node-b") && row.contains("1/3"), "{row}");

    // Nodes: cordon changes the spec.
    b.goto(&format!("{ui}#/nodes")).await.unwrap();
    click(
        &b,
        "#node-table tr[data-node='node-a'] button[data-action='cordon']",
    )
    .await;
    until("node-a cordoned in the store", || async {
        let n = ts
            .store
            .get(&GroupKind::new("sheaf.dev", "Node"), "", "node-a")
            .await
            .ok()?;
        (n["spec"]["unschedulable"] == json!(true)).then_some(())
    })
    .await;
    wait_text(
        &b,
        "#node-table tr[data-node='node-a'] .schedulable",
        "cordoned",
    )
    .await;

    // Delete (two clicks) removes the VM.
    b.goto(&format!("{ui}#/vms/default/late-1")).await.unwrap();
    click(&b, "#action-delete").await;
    click(&b, "#action-delete").await;
    until("late-1 deleted", || async {
        stored(&ts, "kubevirt.io", "VirtualMachine", "late-1")
            .await
            .is_none()
            .then_some(())
    })
    .await;

    // The read-only token: data, but no action buttons.
    click(&b, "#logout").await;
    login(&b, &ts.server.tokens.readonly).await;
    wait_text(&b, "#who", "read-only").await;
    b.goto(&format!("{ui}#/vms/default/web-1")).await.unwrap();
    wait_text(&b, "#vm-phase", "Running").await;
    assert!(
        b.find(Locator::Css("#action-stop")).await.is_err(),
        "read-only sees actions"
    );

    b.close().await.unwrap();
    ts.server.shutdown().await;
}
