// SPDX-License-Identifier: Apache-2.0
//! Issue 9 end to end, through the real binaries only: `sheaf cluster up`
//! with 3 nodes; `sheaf image demo` + `sheaf image import` (raw, and qcow2
//! through qemu-img); real `kubectl apply -f examples/vm.yaml`; the VMI runs
//! and its serial console shows the imported records; `sheaf node drain`
//! moves it; `sheaf node kill` fails it over and the new guest finds every
//! record the old one acknowledged; `/metrics` and `sheaf status` report it;
//! SIGTERM stops the cluster with no process left, and `up` again on the
//! same data brings the VM back with its disk. `sheaf pause`/`unpause`
//! stop and resume the guest (condition `Paused`).
#![allow(clippy::unwrap_used)]

mod common;

use common::{Cluster, acks, kubectl, last_found, ok, sheaf, vmi_node, wait_console};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

fn found(c: &str) -> Option<u64> {
    c.lines().find_map(|l| {
        l.trim()
            .strip_prefix("log: found ")?
            .strip_suffix(" records")?
            .parse()
            .ok()
    })
}

fn stop(mut c: Cluster) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(c.child.id() as i32, libc::SIGTERM) };
    let st = c.child.wait().unwrap();
    assert!(st.success());
    std::thread::sleep(Duration::from_millis(200));
    let out = c.out.lock().unwrap().clone();
    assert!(out.contains("no sheaf process left running"), "{out}");
    assert!(!c.dir.join("sheaf.pid").exists());
}

/// Acks on complete console lines (a paused guest may leave half a line).
fn done_acks(c: &str) -> usize {
    acks(&c[..c.rfind('\n').map_or(0, |i| i + 1)]).len()
}

fn paused_condition(dir: &Path) -> String {
    kubectl(
        dir,
        &[
            "get",
            "vmi",
            "demo",
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Paused\")].status}",
        ],
    )
    .trim()
    .to_string()
}

fn wait_paused_condition(dir: &Path, want: &str) {
    let t0 = Instant::now();
    while paused_condition(dir) != want {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "Paused condition never became {want:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `sheaf pause` stops the guest (no new records, condition Paused=True),
/// `sheaf unpause` lets it go on; the wrong-state and unknown-VM errors;
/// bytes typed into the console reach the launcher.
fn pause_unpause(dir: &Path) {
    let out = ok(dir, &["pause", "demo"]);
    assert!(out.contains("was paused"), "{out}");
    wait_paused_condition(dir, "True");
    let before = done_acks(&ok(dir, &["console", "demo", "--no-follow"]));
    let (good, out) = sheaf(dir, &["pause", "demo"]);
    assert!(!good && out.contains("already paused"), "{out}");
    std::thread::sleep(Duration::from_millis(2500));
    let after = done_acks(&ok(dir, &["console", "demo", "--no-follow"]));
    assert_eq!(before, after, "a paused guest made progress");
    let out = ok(dir, &["unpause", "demo"]);
    assert!(out.contains("was unpaused"), "{out}");
    wait_paused_condition(dir, "");
    wait_console(dir, "acks after unpause", |c| done_acks(c) > after);
    let (good, out) = sheaf(dir, &["unpause", "demo"]);
    assert!(!good && out.contains("not paused"), "{out}");
    let (good, out) = sheaf(dir, &["pause", "nosuch"]);
    assert!(!good && out.contains("not found"), "{out}");
    // Serial input: the launcher takes the bytes (the probe guest ignores them).
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client =
        sheaf_examples::client::ApiClient::from_kubeconfig(&dir.join("admin.kubeconfig")).unwrap();
    let r = rt
        .block_on(client.send_checked(
            "POST",
            "/apis/subresources.kubevirt.io/v1/namespaces/default/virtualmachineinstances/demo/console",
            "application/octet-stream",
            bytes::Bytes::from_static(b"hi\r"),
        ))
        .unwrap();
    assert!(String::from_utf8_lossy(&r.body).contains("\"bytes\":3"));
}

/// The launcher's guest I/O histograms reach /metrics: the probe guest's
/// writes on its volume are counted (the launcher writes them every second).
fn guest_io_reaches_metrics(dir: &Path, node: &str) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client =
        sheaf_examples::client::ApiClient::from_kubeconfig(&dir.join("admin.kubeconfig")).unwrap();
    let key = format!(
        "sheaf_guest_io_seconds_count{{volume=\"default/probe-disk\",vmi=\"default/demo\",node=\"{node}\",op=\"write\"}} "
    );
    let t0 = Instant::now();
    loop {
        let m = rt
            .block_on(client.send("GET", "/metrics", None, bytes::Bytes::new()))
            .unwrap();
        let text = String::from_utf8_lossy(&m.body).into_owned();
        let writes: Option<u64> = text
            .lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|n| n.trim().parse().ok());
        if writes.is_some_and(|n| n > 0) {
            assert!(
                text.contains("# TYPE sheaf_guest_io_seconds histogram"),
                "{text}"
            );
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no guest writes in /metrics:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// `kubectl apply` of a VM with a Volume whose `spec.source.image` names a
/// disk image: the cluster imports it (condition `Imported`), then the VM
/// boots from it; a missing image gives `ImportFailed` with the path.
fn image_source(dir: &Path, tmp: &Path) {
    let img = tmp.join("source-disk.img");
    ok(
        dir,
        &["image", "demo", img.to_str().unwrap(), "--records", "5"],
    );
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("vm-image-source.yaml"))
            .unwrap()
            .replace(
                "/var/lib/sheaf/images/source-disk.img",
                img.to_str().unwrap(),
            );
    let m = tmp.join("vm-image-source.yaml");
    std::fs::write(&m, manifest).unwrap();
    kubectl(dir, &["apply", "-f", m.to_str().unwrap()]);
    kubectl(
        dir,
        &[
            "wait",
            "--for=jsonpath={.status.phase}=Running",
            "vmi/sourced",
            "--timeout=60s",
        ],
    );
    let cond = kubectl(
        dir,
        &[
            "get",
            "volume",
            "source-disk",
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Imported\")].status} {.status.conditions[?(@.type==\"Imported\")].message}",
        ],
    );
    assert!(cond.starts_with("True raw image, 16777216 bytes"), "{cond}");
    let t0 = Instant::now();
    loop {
        let (good, c) = sheaf(dir, &["console", "sourced", "--no-follow"]);
        if good && found(&c).is_some() {
            assert_eq!(found(&c), Some(5), "{c}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{c}");
        std::thread::sleep(Duration::from_millis(200));
    }
    kubectl(dir, &["delete", "vm", "sourced", "--wait=true"]);
    // A missing image: the volume says why and stays Creating.
    let bad = tmp.join("bad-source.yaml");
    std::fs::write(
        &bad,
        "apiVersion: sheaf.dev/v1\nkind: Volume\nmetadata:\n  name: bad-source\nspec:\n  size: 4Mi\n  replicas: 2\n  source:\n    image: /nonexistent/disk.qcow2\n",
    )
    .unwrap();
    kubectl(dir, &["apply", "-f", bad.to_str().unwrap()]);
    let t0 = Instant::now();
    loop {
        let c = kubectl(
            dir,
            &[
                "get",
                "volume",
                "bad-source",
                "-o",
                "jsonpath={.status.phase} {.status.conditions[?(@.type==\"Imported\")].reason} {.status.conditions[?(@.type==\"Imported\")].message}",
            ],
        );
        if c.contains("ImportFailed") {
            assert!(
                c.starts_with("Creating ImportFailed") || c.starts_with("Pending ImportFailed"),
                "{c}"
            );
            assert!(c.contains("/nonexistent/disk.qcow2"), "{c}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{c}");
        std::thread::sleep(Duration::from_millis(200));
    }
    kubectl(dir, &["delete", "volume", "bad-source"]);
}

/// Issue 18 item 1: the import subresource took a percent-decoded name
/// unchecked, and every node then made (and later removed) the directory
/// `replicas/{ns}_{name}`. The exact requests, through the HTTP API with
/// real curl: each is refused with 422, no volume is stored, and nothing
/// outside the data directory changes (a victim directory beside it keeps
/// its one file).
fn hostile_import_names(dir: &Path, tmp: &Path, image: &Path) {
    let victim = tmp.join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("keep"), b"precious").unwrap();
    let before = common::tree(tmp, dir);
    let body = format!(
        "{{\"image\": {:?}, \"replicas\": 3}}",
        image.to_str().unwrap()
    );
    // From nodes/node-N/replicas, `default_..` then five `..` reach `tmp`.
    let up = "..%2F".repeat(6);
    for path in [
        format!("/apis/subresources.sheaf.dev/v1/namespaces/default/volumes/{up}victim/import"),
        format!("/apis/subresources.sheaf.dev/v1/namespaces/{up}victim/volumes/v/import"),
        "/apis/subresources.sheaf.dev/v1/namespaces/default/volumes/..%2F/import".to_string(),
        "/apis/subresources.sheaf.dev/v1/namespaces/default/volumes/%2E%2E/import".to_string(),
    ] {
        let (code, out) = common::curl_api(dir, "POST", &path, &body);
        assert_eq!(code, 422, "{path}: {out}");
        assert!(out.contains("Invalid value"), "{path}: {out}");
    }
    // Issue 18 item 2: a host file outside the image directories, or the
    // cluster's own key inside the data dir (under the allowed temp dir),
    // is refused before anything reads it; so is a protocol name.
    let key = dir.join("pki/ca.key");
    for image in [
        key.to_str().unwrap(),
        "/etc/shadow",
        "json:{\"file.filename\":\"/etc/shadow\"}",
    ] {
        let body = format!("{{\"image\": {image:?}}}");
        let (code, out) = common::curl_api(
            dir,
            "POST",
            "/apis/subresources.sheaf.dev/v1/namespaces/default/volumes/stolen/import",
            &body,
        );
        assert_eq!(code, 403, "{image}: {out}");
        assert!(
            out.contains("image directory") || out.contains("protocol"),
            "{image}: {out}"
        );
    }
    // The same through `spec.source.image`: the volume says why.
    let m = dir.join("stolen.yaml");
    std::fs::write(
        &m,
        format!(
            "apiVersion: sheaf.dev/v1\nkind: Volume\nmetadata:\n  name: stolen\nspec:\n  size: 4Mi\n  replicas: 1\n  source:\n    image: {}\n",
            key.display()
        ),
    )
    .unwrap();
    kubectl(dir, &["apply", "-f", m.to_str().unwrap()]);
    let t0 = Instant::now();
    loop {
        let c = kubectl(
            dir,
            &[
                "get",
                "volume",
                "stolen",
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Imported\")].message}",
            ],
        );
        if c.contains("not inside an image directory") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{c}");
        std::thread::sleep(Duration::from_millis(200));
    }
    kubectl(dir, &["delete", "volume", "stolen"]);
    // The agents would act within a second or two: give them longer.
    std::thread::sleep(Duration::from_secs(3));
    let vols = kubectl(dir, &["get", "volumes", "-A", "-o", "name"]);
    assert!(
        !vols.contains("victim") && !vols.contains("..") && !vols.contains("stolen"),
        "{vols}"
    );
    assert_eq!(
        common::tree(tmp, dir),
        before,
        "something outside the data dir changed"
    );
    assert_eq!(std::fs::read(victim.join("keep")).unwrap(), b"precious");
}

#[test]
fn cluster_end_to_end() {
    if !Path::new("/dev/kvm").exists() {
        eprintln!("SKIP: /dev/kvm is absent; the probe guest needs KVM");
        return;
    }
    if Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output()
        .is_err()
    {
        eprintln!("SKIP: kubectl is not installed (scripts/setup)");
        return;
    }
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let c = common::up(&dir, false);
    let banner = c.out.lock().unwrap().clone();
    assert!(banner.contains("admin.kubeconfig"), "{banner}");
    assert_eq!(banner.matches("   Ready").count(), 3, "{banner}");

    // Images: a raw probe disk (8 log records) and the same as qcow2.
    let raw = tmp.path().join("probe-disk.img");
    ok(&dir, &["image", "demo", raw.to_str().unwrap()]);
    let out = ok(
        &dir,
        &[
            "image",
            "import",
            raw.to_str().unwrap(),
            "--name",
            "probe-disk",
        ],
    );
    assert!(out.contains("raw image, 16777216 bytes"), "{out}");
    let qcow = tmp.path().join("probe-disk.qcow2");
    let have_qemu_img = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow)
        .status()
        .is_ok_and(|s| s.success());
    if have_qemu_img {
        let out = ok(&dir, &["image", "import", qcow.to_str().unwrap()]);
        assert!(out.contains("qcow2 image, 16777216 bytes"), "{out}");
    }
    let (good, out) = sheaf(&dir, &["image", "import", "/nonexistent.img"]);
    assert!(!good && out.contains("/nonexistent.img"), "{out}");
    image_source(&dir, tmp.path());
    hostile_import_names(&dir, tmp.path(), &raw);

    // kubectl applies the example; the VMI runs where sched put it.
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("vm.yaml");
    kubectl(&dir, &["apply", "-f", manifest.to_str().unwrap()]);
    kubectl(
        &dir,
        &[
            "wait",
            "--for=jsonpath={.status.phase}=Running",
            "vmi/demo",
            "--timeout=60s",
        ],
    );
    let node1 = vmi_node(&dir);
    let c1 = wait_console(&dir, "two acks", |c| acks(c).len() >= 2);
    assert_eq!(found(&c1), Some(8), "the imported records are seen:\n{c1}");
    guest_io_reaches_metrics(&dir, &node1);
    let (good, out) = sheaf(&dir, &["start", "demo"]);
    assert!(!good && out.contains("already running"), "{out}");
    let (good, out) = sheaf(&dir, &["stop", "nosuch"]);
    assert!(!good && out.contains("not found"), "{out}");
    pause_unpause(&dir);
    // Malformed MigrateOptions are refused, naming the field.
    let (code, out) = common::curl_api(
        &dir,
        "PUT",
        "/apis/subresources.kubevirt.io/v1/namespaces/default/virtualmachines/demo/migrate",
        r#"{"addedNodeSelector": {"kubernetes.io/hostname": 7}}"#,
    );
    assert_eq!(code, 400, "{out}");
    assert!(out.contains("addedNodeSelector"), "{out}");

    // Drain: the VM moves live (sheaf-vmm guests do), its log goes on
    // from where it was on the source: no reboot, no record lost.
    let c_src = wait_console(&dir, "acks before the drain", |c| acks(c).len() >= 3);
    let out = ok(&dir, &["node", "drain", &node1]);
    assert!(out.contains("drained"), "{out}");
    let node2 = vmi_node(&dir);
    assert_ne!(node1, node2);
    let mode = kubectl(
        &dir,
        &[
            "get",
            "vmi",
            "demo",
            "-o",
            "jsonpath={.status.migrationState.mode}",
        ],
    );
    assert_eq!(mode.trim(), "PreCopy", "the drain migrated live");
    let c2 = wait_console(&dir, "acks after the drain", |c| acks(c).len() >= 3);
    assert!(
        found(&c2).is_none() && !c2.contains("sheaf-probe"),
        "the guest rebooted on the target:\n{c2}"
    );
    let (seen_src, seen_dst) = (acks(&c_src), acks(&c2));
    assert!(
        seen_dst[0] > *seen_src.last().unwrap(),
        "the target's log continues the source's: {seen_src:?} then {seen_dst:?}"
    );
    assert!(
        seen_dst.windows(2).all(|w| w[1] == w[0] + 1),
        "{seen_dst:?}"
    );
    let before = *seen_dst.iter().max().unwrap();

    // Kill the node it runs on: failover to the last node, every acked record kept.
    let out = ok(&dir, &["node", "kill", &node2, "--wait"]);
    assert!(out.contains("running on"), "{out}");
    let node3 = vmi_node(&dir);
    assert!(node3 != node1 && node3 != node2, "{node1} {node2} {node3}");
    let c3 = wait_console(&dir, "the new guest's log scan", |c| found(c).is_some());
    assert!(
        found(&c3).unwrap() > before,
        "new guest found {:?} records, {} were acknowledged:\n{c3}",
        found(&c3),
        before + 1
    );
    assert!(!c3.contains("CORRUPT"), "{c3}");

    let status = ok(&dir, &["status"]);
    assert!(status.contains("NotReady"), "{status}");
    assert!(status.contains(&format!("{node2}:Failed")), "{status}");
    assert!(status.contains("SchedulingDisabled"), "{status}");

    // Metrics.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client =
        sheaf_examples::client::ApiClient::from_kubeconfig(&dir.join("admin.kubeconfig")).unwrap();
    let m = rt
        .block_on(client.send("GET", "/metrics", None, bytes::Bytes::new()))
        .unwrap();
    let text = String::from_utf8_lossy(&m.body).into_owned();
    assert!(
        text.contains("sheaf_vmi_phase_count{phase=\"Running\"} 1"),
        "{text}"
    );
    assert!(text.contains("sheaf_volume_io_seconds_bucket"), "{text}");
    assert!(
        text.contains(&format!(
            "sheaf_node_ready{{node=\"{node2}\",unschedulable=\"false\"}} 0"
        )),
        "{text}"
    );

    // SIGTERM: everything stops.
    let acked = *acks(&ok(&dir, &["console", "demo", "--no-follow"]))
        .iter()
        .max()
        .unwrap();
    stop(c);

    // `up` again on the same data: the VM comes back with its disk.
    let c = common::up(&dir, false);
    let c4 = wait_console(&dir, "the restarted guest's log scan", |c| {
        last_found(c).is_some_and(|f| f > acked)
    });
    assert!(!c4.contains("CORRUPT"), "{c4}");
    stop(c);
    eprintln!("cluster end to end: {:.1} s", t0.elapsed().as_secs_f64());
}
