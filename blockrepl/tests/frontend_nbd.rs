// SPDX-License-Identifier: Apache-2.0
//! The NBD frontend driven by real Debian clients: nbdinfo, qemu-img,
//! qemu-io and fio's nbd engine, over unix sockets and TCP, on one-replica
//! and three-replica volumes.
#![allow(clippy::unwrap_used)]

mod frontend_common;

use std::process::Command;

use frontend_common::{NbdFixture, have, read_replica, run};

const MIB: u64 = 1 << 20;

#[test]
fn nbdinfo_reports_exports_sizes_and_block_sizes() {
    if !have("nbdinfo") {
        return;
    }
    let f = NbdFixture::new(16 * MIB, 1);
    let json = run(Command::new("nbdinfo").arg("--json").arg(f.uri()));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let e = &v["exports"][0];
    assert_eq!(e["export-name"], "vol0", "{json}");
    assert_eq!(e["export-size"], 16 * MIB, "{json}");
    assert_eq!(e["description"], "test volume", "{json}");
    assert_eq!(e["block_size_minimum"], 1, "{json}");
    assert_eq!(e["block_size_preferred"], 4096, "{json}");
    assert_eq!(e["block_size_maximum"], 32 * MIB, "{json}");
    assert_eq!(e["is_read_only"], false, "{json}");
    for cap in [
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_multi_conn",
    ] {
        assert_eq!(e[cap], true, "{cap} in {json}");
    }
    assert_eq!(v["protocol"], "newstyle-fixed", "{json}");
    // --list goes through NBD_OPT_LIST then NBD_OPT_INFO per export.
    let list = run(Command::new("nbdinfo").arg("--list").arg(f.uri()));
    assert!(list.contains("export=\"vol0\""), "{list}");
    // The default export "" is the only export.
    let dflt = run(Command::new("nbdinfo")
        .arg("--size")
        .arg(format!("nbd+unix:///?socket={}", f.sock.display())));
    assert_eq!(dflt.trim(), (16 * MIB).to_string());
    // --map uses base:allocation over structured replies.
    let map = run(Command::new("nbdinfo").arg("--map").arg(f.uri()));
    assert!(map.contains("data"), "{map}");
    assert_eq!(f.server.stats().protocol_errors, 0);
}

#[test]
fn qemu_img_imports_a_qcow2_image_into_a_3_replica_volume() {
    if !have("qemu-img") || !have("qemu-io") {
        return;
    }
    let f = NbdFixture::new(16 * MIB, 3);
    let src = f.tmp.path().join("src.qcow2");
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&src)
        .arg("16M"));
    run(Command::new("qemu-io")
        .args(["-f", "qcow2"])
        .arg(&src)
        .args([
            "-c",
            "write -P 0xab 0 1M",
            "-c",
            "write -P 0xcd 5M 512k",
            "-c",
            "write -P 0x5e 15M 4k",
            "-c",
            "write -P 0x17 8193 3000",
        ]));
    let info = run(Command::new("qemu-img")
        .args(["info", "-f", "raw"])
        .arg(f.uri()));
    assert!(info.contains("virtual size: 16 MiB"), "{info}");
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "qcow2", "-O", "raw"])
        .arg(&src)
        .arg(f.uri()));
    // Identical through NBD ...
    let cmp = run(Command::new("qemu-img")
        .args(["compare", "-f", "qcow2", "-F", "raw"])
        .arg(&src)
        .arg(f.uri()));
    assert!(cmp.contains("Images are identical"), "{cmp}");
    // ... read back with convert, byte for byte ...
    let back = f.tmp.path().join("back.raw");
    let reference = f.tmp.path().join("ref.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(f.uri())
        .arg(&back));
    run(Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&src)
        .arg(&reference));
    let want = std::fs::read(&reference).unwrap();
    assert_eq!(std::fs::read(&back).unwrap(), want);
    // ... through the volume handle, and on every replica alone.
    assert_eq!(f.read(0, 16 * MIB as usize), want);
    f.detach();
    let cluster = f.cluster.as_ref().unwrap();
    for n in &cluster.nodes {
        assert_eq!(
            read_replica(&n.dir, 0, 16 * MIB as usize),
            want,
            "replica {}",
            n.dir.display()
        );
    }
}

#[test]
fn qemu_io_patterns_fua_zeroes_discard_and_unaligned_io() {
    if !have("qemu-io") {
        return;
    }
    let f = NbdFixture::new(8 * MIB, 1);
    let out = run(Command::new("qemu-io")
        .args(["-f", "raw"])
        .arg(f.uri())
        .args([
            "-c",
            "write -P 0x5a 0 64k",
            "-c",
            "read -P 0x5a 0 64k",
            "-c",
            "write -f -P 0x6b 64k 64k",
            "-c",
            "read -P 0x6b 64k 64k",
            "-c",
            "write -z 32k 8k",
            "-c",
            "read -P 0 32k 8k",
            "-c",
            "write -P 0x11 1000 3000",
            "-c",
            "read -P 0x11 1000 3000",
            "-c",
            "read -P 0x5a 4000 96",
            "-c",
            "write -z 200000 5000",
            "-c",
            "read -P 0 200000 5000",
            "-c",
            "flush",
            "-c",
            "discard 1M 1M",
            "-c",
            "write -P 0x7e 8388096 512",
            "-c",
            "read -P 0x7e 8388096 512",
        ]));
    assert!(!out.contains("verification failed"), "{out}");
    assert!(!out.contains("error"), "{out}");
    // The host sees the same bytes through the volume.
    let d = f.read(0, 256 << 10);
    assert!(d[..1000].iter().all(|&b| b == 0x5a));
    assert!(d[1000..4000].iter().all(|&b| b == 0x11));
    assert!(d[4000..32768].iter().all(|&b| b == 0x5a));
    assert!(d[32768..40960].iter().all(|&b| b == 0));
    assert!(d[40960..65536].iter().all(|&b| b == 0x5a));
    assert!(d[65536..131072].iter().all(|&b| b == 0x6b));
    assert!(d[200000..205000].iter().all(|&b| b == 0));
    assert!(
        f.read(8 * MIB - 4096, 4096)[3584..]
            .iter()
            .all(|&b| b == 0x7e)
    );
    // Errors are reported, not fatal: a read past the end fails cleanly.
    let out = frontend_common::output(
        Command::new("qemu-io")
            .args(["-f", "raw"])
            .arg(f.uri())
            .args(["-c", "read 8M 4k", "-c", "read -P 0x5a 0 4k"]),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("read failed")
            || text.contains("Input/output error")
            || text.contains("Invalid argument"),
        "{text}"
    );
    assert!(text.contains("read 4096/4096 bytes at offset 0"), "{text}");
}

fn fio(uri: &str, extra: &[&str]) -> serde_json::Value {
    let out = run(Command::new("fio")
        .args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--output-format=json",
            "--verify_state_save=0",
        ])
        .args(extra));
    // fio prints notes before the JSON on some versions.
    let start = out.find('{').unwrap();
    serde_json::from_str(&out[start..]).unwrap()
}

#[test]
fn fio_verify_crc32c_on_a_3_replica_volume() {
    if !have("fio") {
        return;
    }
    let f = NbdFixture::new(32 * MIB, 3);
    let v = fio(
        &f.uri(),
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--size=16M",
            "--iodepth=16",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_backlog=256",
        ],
    );
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "{v:#}");
    assert!(
        job["write"]["io_bytes"].as_u64().unwrap() >= 16 * MIB,
        "{v:#}"
    );
    assert!(
        job["read"]["io_bytes"].as_u64().unwrap() > 0,
        "fio verified nothing: {v:#}"
    );
    // Mixed sizes, sequential, larger blocks.
    let v = fio(
        &f.uri(),
        &[
            "--rw=write",
            "--bsrange=4k-256k",
            "--size=16M",
            "--offset=16M",
            "--iodepth=8",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
        ],
    );
    assert_eq!(v["jobs"][0]["error"], 0, "{v:#}");
    let st = f.server.stats();
    assert_eq!(st.protocol_errors, 0, "{st:?}");
    assert_eq!(st.request_errors, 0, "{st:?}");
}

#[test]
fn tcp_listener_and_concurrent_clients() {
    if !have("qemu-io") {
        return;
    }
    let f = NbdFixture::new(8 * MIB, 1);
    let listener =
        f.rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
    let port = listener.local_addr().unwrap().port();
    let s = f.server.clone();
    f.rt.spawn(async move { s.serve_tcp(listener).await });
    let url = format!("nbd://127.0.0.1:{port}/vol0");
    // Four clients at once on disjoint ranges (multi-conn), TCP and unix.
    let handles: Vec<_> = (0..4u64)
        .map(|i| {
            let target = if i % 2 == 0 { url.clone() } else { f.uri() };
            std::thread::spawn(move || {
                let off = i * MIB;
                run(Command::new("qemu-io").args(["-f", "raw", &target]).args([
                    "-c",
                    &format!("write -P {} {off} 1M", 0x20 + i),
                    "-c",
                    &format!("read -P {} {off} 1M", 0x20 + i),
                ]))
            })
        })
        .collect();
    for h in handles {
        let out = h.join().unwrap();
        assert!(!out.contains("verification failed"), "{out}");
    }
    for i in 0..4u64 {
        let d = f.read(i * MIB, MIB as usize);
        assert!(d.iter().all(|&b| b == 0x20 + i as u8), "range {i}");
    }
    assert!(f.server.stats().sessions >= 4);
}

/// Writes a CA and a server certificate for `localhost` into `dir`
/// (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`: the layout QEMU and
/// libnbd expect).
fn make_certs(dir: &std::path::Path) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, "sheaf test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "localhost");
    let cert = params.signed_by(&key, &issuer).unwrap();
    std::fs::write(dir.join("ca-cert.pem"), ca_cert.pem()).unwrap();
    std::fs::write(dir.join("server-cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("server-key.pem"), key.serialize_pem()).unwrap();
}

#[test]
fn tls_required_with_nbdinfo_and_qemu_io() {
    use sheaf_blockrepl::frontend::nbd::proto::TlsMode;
    use sheaf_blockrepl::frontend::nbd::{NbdConfig, tls_acceptor};
    if !have("nbdinfo") || !have("qemu-io") {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    let acceptor = tls_acceptor(
        &certs.path().join("server-cert.pem"),
        &certs.path().join("server-key.pem"),
    )
    .unwrap();
    let f = NbdFixture::with_config(
        8 * MIB,
        1,
        NbdConfig {
            tls: Some((acceptor, TlsMode::Required)),
            ..NbdConfig::default()
        },
    );
    let listener =
        f.rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
    let port = listener.local_addr().unwrap().port();
    let s = f.server.clone();
    f.rt.spawn(async move { s.serve_tcp(listener).await });
    let dir = certs.path().display().to_string();
    let size = run(Command::new("nbdinfo").arg("--size").arg(format!(
        "nbds://localhost:{port}/vol0?tls-certificates={dir}"
    )));
    assert_eq!(size.trim(), (8 * MIB).to_string());
    let out = run(Command::new("qemu-io")
        .arg("--object")
        .arg(format!("tls-creds-x509,id=tls0,dir={dir},endpoint=client"))
        .arg("--image-opts")
        .arg(format!(
            "driver=nbd,host=localhost,port={port},export=vol0,tls-creds=tls0"
        ))
        .args(["-c", "write -P 0x33 0 64k", "-c", "read -P 0x33 0 64k"]));
    assert!(!out.contains("verification failed"), "{out}");
    assert!(f.read(0, 65536).iter().all(|&b| b == 0x33));
    // Plain-text clients are refused.
    let plain = frontend_common::output(
        Command::new("nbdinfo").arg(format!("nbd://localhost:{port}/vol0")),
    );
    assert!(!plain.status.success(), "plain client got in");
    assert!(f.server.stats().sessions >= 2);
}
