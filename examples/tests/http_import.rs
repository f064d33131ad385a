// SPDX-License-Identifier: Apache-2.0
//! Issue 19 item 4: a stock KubeVirt VirtualMachine with
//! `dataVolumeTemplates` (`source.http`, `source.blank`, `source.pvc`)
//! applied with real kubectl to `sheaf cluster up`; images served by a
//! local HTTP server on 127.0.0.1, made with qemu-img. The imported
//! volume is read back through a replicated engine and compared with the
//! served image; each bad source ends in a clear `Imported=False
//! ImportFailed` condition, the volume stays `Creating` and nothing is
//! left in the data dir's tmp.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::http::{Reply, Server};
use common::kubectl;
use serde_json::Value;
use sha2::Digest;

const MIB: usize = 1 << 20;

fn qemu_img(args: &[&str]) {
    let o = Command::new("qemu-img").args(args).output().unwrap();
    assert!(
        o.status.success(),
        "qemu-img {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn volume(dir: &Path, name: &str) -> Value {
    let (good, text) = kubectl_try(dir, &["get", "volume", name, "-o", "json"]);
    if !good {
        return Value::Null;
    }
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

fn kubectl_try(dir: &Path, args: &[&str]) -> (bool, String) {
    let o = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(dir.join("admin.kubeconfig"))
        .args(args)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
    )
}

fn imported(v: &Value) -> (String, String, String) {
    let c = v["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Imported"))
        .cloned()
        .unwrap_or(Value::Null);
    (
        c["status"].as_str().unwrap_or("").into(),
        c["reason"].as_str().unwrap_or("").into(),
        c["message"].as_str().unwrap_or("").into(),
    )
}

/// Waits until the volume's Imported condition is True or ImportFailed.
fn wait_imported(dir: &Path, name: &str, timeout: Duration) -> Value {
    let t0 = Instant::now();
    loop {
        let v = volume(dir, name);
        let (st, reason, _) = imported(&v);
        if st == "True" || reason == "ImportFailed" {
            return v;
        }
        assert!(
            t0.elapsed() < timeout,
            "{name} never finished importing: {v:#}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Reads `len` bytes of volume `name` through a replicated engine.
fn read_volume(dir: &Path, name: &str, len: usize) -> Vec<u8> {
    let v = volume(dir, name);
    let addrs: Vec<SocketAddr> = v["status"]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["address"].as_str()?.parse().ok())
        .collect();
    let epoch = v["status"]["epoch"].as_u64().unwrap_or(0);
    let secret = sheaf_blockrepl::net::Secret::from_file(&dir.join("secret")).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut cfg = sheaf_blockrepl::volume::VolumeConfig::remote(&addrs, secret);
        cfg.min_epoch = epoch;
        cfg.min_write_replicas = Some(1);
        let e = sheaf_blockrepl::volume::Volume::attach(cfg).await.unwrap();
        let mut out = Vec::with_capacity(len);
        let mut off = 0;
        while off < len {
            let n = (len - off).min(MIB);
            out.extend_from_slice(&e.read(off as u64, n).await.unwrap());
            off += n;
        }
        let _ = e.detach().await;
        out
    })
}

fn tmp_left(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir.join("tmp"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn dv(name: &str, size: &str, source: &str, annotations: &str) -> String {
    format!(
        "  - metadata:\n      name: {name}\n{annotations}    spec:\n      storage:\n        storageClassName: sheaf-2\n        resources:\n          requests:\n            storage: {size}\n      source:\n{source}"
    )
}

fn vm(name: &str, dvs: &[String]) -> String {
    let disks: String = dvs
        .iter()
        .filter_map(|d| d.lines().nth(1))
        .map(|l| l.trim().trim_start_matches("name: ").to_string())
        .map(|n| format!("          - name: {n}\n            disk: {{bus: virtio}}\n"))
        .collect();
    let vols: String = dvs
        .iter()
        .filter_map(|d| d.lines().nth(1))
        .map(|l| l.trim().trim_start_matches("name: ").to_string())
        .map(|n| format!("      - name: {n}\n        dataVolume: {{name: {n}}}\n"))
        .collect();
    format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata:\n  name: {name}\nspec:\n  runStrategy: Halted\n  dataVolumeTemplates:\n{}  template:\n    spec:\n      domain:\n        devices:\n          disks:\n{disks}        resources:\n          requests:\n            memory: 64Mi\n      volumes:\n{vols}",
        dvs.concat()
    )
}

#[test]
fn data_volume_templates_import_over_http() {
    let have = |c: &str, a: &str| {
        Command::new(c)
            .arg(a)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !have("kubectl", "version") && !have("kubectl", "--help") || !have("qemu-img", "--version") {
        eprintln!("SKIP: needs kubectl and qemu-img (scripts/setup)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let _c = common::up(&dir, false);
    let srv = Server::start();

    // An 8 MiB raw disk with data everywhere but a hole, and its qcow2.
    let mut raw = vec![0u8; 8 * MIB];
    for (i, b) in raw.iter_mut().enumerate() {
        if !(2 * MIB..3 * MIB).contains(&i) {
            *b = ((i / 4096) as u8) ^ (i as u8).wrapping_mul(31);
        }
    }
    let raw_p = tmp.path().join("disk.raw");
    std::fs::write(&raw_p, &raw).unwrap();
    let q = tmp.path().join("disk.qcow2");
    qemu_img(&[
        "convert",
        "-f",
        "raw",
        "-O",
        "qcow2",
        raw_p.to_str().unwrap(),
        q.to_str().unwrap(),
    ]);
    let qcow = std::fs::read(&q).unwrap();
    srv.route("/images/disk.qcow2", Reply::ok(qcow.clone()));
    srv.route("/go/disk", Reply::redirect("/images/disk.qcow2"));
    srv.route("/images/disk.raw", Reply::ok(raw.clone()));
    let sha512: String = sha2::Sha512::digest(&qcow)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let sha256: String = sha2::Sha256::digest(&raw)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();

    // Bad images.
    let shadow = tmp.path().join("shadow.qcow2");
    qemu_img(&[
        "create",
        "-f",
        "qcow2",
        "-u",
        "-F",
        "raw",
        "-b",
        "/etc/shadow",
        shadow.to_str().unwrap(),
        "8M",
    ]);
    srv.route(
        "/bad/shadow.qcow2",
        Reply::ok(std::fs::read(&shadow).unwrap()),
    );
    srv.route("/bad/empty.img", Reply::ok(Vec::new()));
    srv.route(
        "/bad/truncated.qcow2",
        Reply::ok(qcow[..qcow.len().min(200_000)].to_vec()),
    );
    let closed = common::free_port();

    let ann = |c: &str| format!("      annotations:\n        sheaf.dev/checksum: {c}\n");
    let good = vm(
        "importer",
        &[
            dv(
                "root",
                "8Mi",
                &format!("        http:\n          url: {}\n", srv.url("/go/disk")),
                &ann(&format!("sha512:{sha512}")),
            ),
            dv(
                "rawdisk",
                "16Mi",
                &format!(
                    "        http:\n          url: {}\n",
                    srv.url("/images/disk.raw")
                ),
                &ann(&format!("sha256:{sha256}")),
            ),
            dv("scratch", "4Mi", "        blank: {}\n", ""),
            dv("copy", "8Mi", "        pvc:\n          name: root\n", ""),
        ],
    );
    let m = tmp.path().join("good.yaml");
    std::fs::write(&m, &good).unwrap();
    let t0 = Instant::now();
    kubectl(&dir, &["apply", "-f", m.to_str().unwrap()]);

    let bad_cases: Vec<(&str, String, String, &str)> = vec![
        (
            "b-404",
            srv.url("/bad/missing.qcow2"),
            String::new(),
            "HTTP 404",
        ),
        (
            "b-unreachable",
            format!("http://127.0.0.1:{closed}/x.img"),
            String::new(),
            "cannot connect",
        ),
        (
            "b-checksum",
            srv.url("/images/disk.raw"),
            ann(&format!("sha256:{}", "0".repeat(64))),
            "checksum mismatch",
        ),
        (
            "b-truncated",
            srv.url("/bad/truncated.qcow2"),
            String::new(),
            "corrupt",
        ),
        (
            "b-empty",
            srv.url("/bad/empty.img"),
            String::new(),
            "empty file",
        ),
        (
            "b-shadow",
            srv.url("/bad/shadow.qcow2"),
            String::new(),
            "backing file",
        ),
    ];
    let bad = vm(
        "broken",
        &bad_cases
            .iter()
            .map(|(n, u, a, _)| dv(n, "8Mi", &format!("        http:\n          url: {u}\n"), a))
            .collect::<Vec<_>>(),
    );
    let m = tmp.path().join("bad.yaml");
    std::fs::write(&m, &bad).unwrap();
    kubectl(&dir, &["apply", "-f", m.to_str().unwrap()]);

    // file:// is refused at admission.
    let fileurl = vm(
        "fileurl",
        &[dv(
            "f",
            "8Mi",
            "        http:\n          url: file:///etc/shadow\n",
            "",
        )],
    );
    let m = tmp.path().join("file.yaml");
    std::fs::write(&m, &fileurl).unwrap();
    let o = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(dir.join("admin.kubeconfig"))
        .args(["apply", "-f", m.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("only http and https"),
        "{err}"
    );

    // The good VM: every volume Ready with the served contents.
    for n in ["root", "rawdisk", "copy"] {
        let v = wait_imported(&dir, n, Duration::from_secs(120));
        let (st, reason, msg) = imported(&v);
        assert_eq!(
            (st.as_str(), reason.as_str()),
            ("True", "Imported"),
            "{n}: {msg}"
        );
        assert_eq!(v["status"]["progress"], "100.0%", "{v:#}");
    }
    let (_, _, msg) = imported(&volume(&dir, "root"));
    assert!(
        msg.contains("qcow2 image") && msg.contains("sha512:") && msg.contains("verified"),
        "{msg}"
    );
    let (_, _, msg) = imported(&volume(&dir, "copy"));
    assert!(msg.contains("cloned from default/root"), "{msg}");
    eprintln!("imports done in {:.1} s", t0.elapsed().as_secs_f64());
    let t = Instant::now();
    loop {
        let ok = ["root", "rawdisk", "copy", "scratch"]
            .iter()
            .all(|n| volume(&dir, n)["status"]["phase"].as_str() == Some("Available"));
        if ok {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{:#}",
            volume(&dir, "copy")
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(
        !volume(&dir, "scratch")["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["type"] == "Imported"),
        "a blank volume has nothing to import"
    );
    assert!(srv.hits.lock().unwrap().iter().any(|h| h == "/go/disk"));
    let table = kubectl(&dir, &["get", "volumes", "root", "rawdisk"]);
    assert!(
        table.contains("PROGRESS") && table.contains("100.0%"),
        "{table}"
    );

    // Contents, read back through a replicated engine.
    assert!(
        read_volume(&dir, "root", 8 * MIB) == raw,
        "root differs from the served image"
    );
    let back = read_volume(&dir, "rawdisk", 16 * MIB);
    assert!(
        back[..8 * MIB] == raw[..] && back[8 * MIB..].iter().all(|b| *b == 0),
        "rawdisk differs"
    );
    assert!(
        read_volume(&dir, "copy", 8 * MIB) == raw,
        "the clone differs from its source"
    );
    assert!(
        read_volume(&dir, "scratch", 4 * MIB)
            .iter()
            .all(|b| *b == 0)
    );

    // Each bad source: a clear condition, the volume not usable, no files left.
    for (n, _, _, want) in &bad_cases {
        let v = wait_imported(&dir, n, Duration::from_secs(120));
        let (st, reason, msg) = imported(&v);
        assert_eq!(
            (st.as_str(), reason.as_str()),
            ("False", "ImportFailed"),
            "{n}: {v:#}"
        );
        assert!(msg.contains(want), "{n}: wanted {want:?} in {msg:?}");
        assert_eq!(
            v["status"]["phase"], "Creating",
            "{n} must not be usable: {v:#}"
        );
        assert!(v["status"]["progress"].is_null(), "{n}: {v:#}");
    }
    let (_, _, msg) = imported(&volume(&dir, "b-shadow"));
    assert!(msg.contains("refused"), "{msg}");
    assert!(
        tmp_left(&dir).is_empty(),
        "left in tmp: {:?}",
        tmp_left(&dir)
    );
}
