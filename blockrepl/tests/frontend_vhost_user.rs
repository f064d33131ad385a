// SPDX-License-Identifier: Apache-2.0
//! The vhost-user-blk backend driven by QEMU's `vhost-user-blk-pci` with a
//! Linux guest (TCG), and by a scripted vhost-user frontend that breaks the
//! protocol.
#![allow(clippy::unwrap_used)]

mod frontend_common;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use frontend_common::{Cluster, read_replica, runtime};
use sha2::{Digest, Sha256};
use sheaf_blockrepl::frontend::Disk;
use sheaf_blockrepl::frontend::vhost_user::{BlkConfig, VhostUserBlk, VhostUserBlkServer};
use sheaf_blockrepl::volume::Volume;
use sheaf_testkit::guest::{self, GuestImage};
use sheaf_testkit::qemu::{LineAction, Qemu};
use tokio::runtime::Runtime;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;

/// The guest writes `$MB` MiB of random data at 1 MiB in 1 MiB steps
/// (syncing each), prints its SHA-256, drops the page cache, reads it back
/// and compares; plus a discard and the default marker/reply exchange.
const SCRIPT: &str = r#"
. /etc/sheaf/lib.sh
dev=/dev/vda
MB=__MB__
sheaf_wait_block $dev 100 || { echo "SHEAF-GUEST: FAIL no $dev"; exit 1; }
line=$(dd if=$dev bs=512 count=1 2>/dev/null | head -n 1 | tr -d '\000')
case "$line" in
SHEAF-MARKER:*) marker=${line#SHEAF-MARKER:} ;;
*) echo "SHEAF-GUEST: FAIL no marker"; exit 1 ;;
esac
echo "SHEAF-GUEST: marker=$marker"
printf 'SHEAF-REPLY:%s\n' "$marker" | dd of=$dev bs=512 seek=8 conv=fsync 2>/dev/null ||
    { echo "SHEAF-GUEST: FAIL write reply"; exit 1; }
echo "SHEAF-GUEST: size=$(cat /sys/block/vda/size) lbs=$(cat /sys/block/vda/queue/logical_block_size) pbs=$(cat /sys/block/vda/queue/physical_block_size)"
dd if=/dev/urandom of=/tmp/pat bs=1M count=$MB 2>/dev/null
echo "SHEAF-GUEST: sha=$(sha256sum /tmp/pat | cut -d' ' -f1)"
i=0
while [ $i -lt $MB ]; do
    dd if=/tmp/pat of=$dev bs=1M skip=$i seek=$((i + 1)) count=1 conv=fsync,notrunc 2>/dev/null ||
        { echo "SHEAF-GUEST: FAIL write chunk $i"; exit 1; }
    echo "SHEAF-GUEST: wrote $i"
    i=$((i + 1))
done
echo 3 > /proc/sys/vm/drop_caches
dd if=$dev of=/tmp/back bs=1M skip=1 count=$MB 2>/dev/null
cmp /tmp/pat /tmp/back || { echo "SHEAF-GUEST: FAIL read back differs"; exit 1; }
echo "SHEAF-GUEST: OK"
"#;

struct Fixture {
    rt: Runtime,
    disk: Disk,
    cluster: Cluster,
    sock: PathBuf,
    server: VhostUserBlkServer,
    _tmp: tempfile::TempDir,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let rt = runtime();
    let cluster = Cluster::start(tmp.path(), 3, SIZE);
    let vol: Volume = rt.block_on(Volume::attach(cluster.config())).unwrap();
    let disk = Disk::new(vol);
    let mut marker = format!("SHEAF-MARKER:vhost-{}\n", std::process::id()).into_bytes();
    marker.resize(4096, 0);
    rt.block_on(disk.write(0, marker.into())).unwrap();
    let backend = VhostUserBlk::new(
        disk.clone(),
        rt.handle().clone(),
        BlkConfig {
            serial: "sheaf-test".into(),
            ..BlkConfig::default()
        },
    )
    .unwrap();
    let server = VhostUserBlkServer::new(backend);
    let sock = tmp.path().join("vhost.sock");
    let s = server.clone();
    let p = sock.clone();
    std::thread::spawn(move || s.serve(&p));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !sock.exists() {
        assert!(
            Instant::now() < deadline,
            "vhost-user socket never appeared"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    Fixture {
        rt,
        disk,
        cluster,
        sock,
        server,
        _tmp: tmp,
    }
}

fn qemu(image: &GuestImage, sock: &Path) -> Qemu {
    Qemu::tcg()
        .kernel(&image.kernel)
        .initrd(&image.initramfs)
        .append(guest::DEFAULT_CMDLINE)
        .memory_mib(512)
        .arg("-object")
        .arg("memory-backend-memfd,id=mem,size=512M,share=on")
        .arg("-numa")
        .arg("node,memdev=mem")
        .arg("-chardev")
        .arg(format!("socket,id=c,path={}", sock.display()))
        .arg("-device")
        .arg("vhost-user-blk-pci,chardev=c")
        .timeout(Duration::from_secs(300))
}

fn guest_sha(console: &str) -> Vec<u8> {
    let line = console
        .lines()
        .find_map(|l| l.split("SHEAF-GUEST: sha=").nth(1))
        .unwrap_or_else(|| panic!("no sha line in console:\n{console}"));
    (0..32)
        .map(|i| u8::from_str_radix(&line.trim()[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

fn run_guest(kill_at_chunk: Option<u32>) {
    let mb = 12u64;
    let image = GuestImage::builder()
        .script(SCRIPT.replace("__MB__", &mb.to_string()))
        .build()
        .unwrap();
    let f = fixture();
    let cluster = Arc::new(Mutex::new(f.cluster));
    let c2 = cluster.clone();
    let mut killed = false;
    let out = qemu(&image, &f.sock)
        .run_with(&mut |line| {
            if let Some(k) = kill_at_chunk
                && !killed
                && line.text.contains(&format!("SHEAF-GUEST: wrote {k}"))
            {
                eprintln!("killing replica 2 at {:?}", line.at);
                c2.lock().unwrap().kill(2);
                killed = true;
            }
            LineAction::Continue
        })
        .unwrap();
    let console = out.console_text();
    let report = guest::parse_console(&console);
    assert!(report.ok, "guest failed: {:?}\n{console}", report.failures);
    assert_eq!(report.script_exit, Some(0), "{console}");
    assert_eq!(
        report.marker.as_deref(),
        Some(format!("vhost-{}", std::process::id()).as_str())
    );
    assert!(
        console.contains(&format!("size={} lbs=512 pbs=4096", SIZE / 512)),
        "{console}"
    );
    if kill_at_chunk.is_some() {
        assert!(killed, "the guest never reached the kill point:\n{console}");
    }
    // The host reads the guest's data through the volume.
    let want = guest_sha(&console);
    let data =
        f.rt.block_on(f.disk.read(MIB, (mb * MIB) as usize))
            .unwrap();
    assert_eq!(Sha256::digest(&data).to_vec(), want, "volume data differs");
    let reply = f.rt.block_on(f.disk.read(4096, 4096)).unwrap();
    assert!(reply.starts_with(format!("SHEAF-REPLY:vhost-{}\n", std::process::id()).as_bytes()));
    let st = f.server.backend().stats();
    assert!(st.write_bytes >= mb * MIB, "{st:?}");
    assert!(st.read_bytes >= mb * MIB, "{st:?}");
    assert_eq!(st.connections, 1, "{st:?}");
    let status = f.rt.block_on(f.disk.volume().status()).unwrap();
    if kill_at_chunk.is_some() {
        assert_eq!(status.active.len(), 2, "replica 2 still active: {status:?}");
    } else {
        assert_eq!(status.active.len(), 3, "{status:?}");
    }
    // Every surviving replica holds all of it, on its own.
    f.rt.block_on(async {
        f.disk.flush().await.unwrap();
        f.disk.volume().clone().detach().await.unwrap();
    });
    let cluster = cluster.lock().unwrap();
    let alive = if kill_at_chunk.is_some() { 2 } else { 3 };
    for n in &cluster.nodes[..alive] {
        let d = read_replica(&n.dir, MIB, (mb * MIB) as usize);
        assert_eq!(
            Sha256::digest(&d).to_vec(),
            want,
            "replica {}",
            n.dir.display()
        );
    }
    eprintln!(
        "guest run {:?} ({} console lines), stats {st:?}",
        out.elapsed,
        out.console.len()
    );
}

#[test]
fn linux_guest_writes_and_reads_a_3_replica_volume() {
    if sheaf_testkit::skip_slow("linux_guest_writes_and_reads_a_3_replica_volume") {
        return;
    }
    run_guest(None);
}

#[test]
fn replica_killed_mid_run_loses_nothing() {
    if sheaf_testkit::skip_slow("replica_killed_mid_run_loses_nothing") {
        return;
    }
    run_guest(Some(3));
}

/// Speaks raw bytes to the socket: a vhost-user header is
/// `request u32, flags u32, size u32` (little endian), then the payload.
fn raw_message(sock: &Path, req: u32, flags: u32, payload: &[u8]) -> bool {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut m = Vec::new();
    m.extend_from_slice(&req.to_le_bytes());
    m.extend_from_slice(&flags.to_le_bytes());
    m.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    m.extend_from_slice(payload);
    let _ = s.write_all(&m);
    // The backend must close the connection: read sees EOF (or a reset).
    let mut buf = [0u8; 256];
    loop {
        match std::io::Read::read(&mut s, &mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

#[test]
fn protocol_violations_close_the_connection_and_the_server_keeps_serving() {
    use vhost::VhostBackend;
    use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
    use vhost::vhost_user::{Frontend, VhostUserFrontend};
    let f = fixture();
    let before = f.rt.block_on(f.disk.read(0, 8192)).unwrap();
    // Unknown request code; version bits wrong; a payload size over the
    // limit; SET_MEM_TABLE with no file descriptors; a truncated header.
    assert!(raw_message(&f.sock, 0xffff, 1, &[]));
    assert!(raw_message(&f.sock, 1, 0x7, &[]));
    assert!(raw_message(&f.sock, 1, 1, &vec![0u8; 8192]));
    assert!(raw_message(&f.sock, 5, 1, &[1, 0, 0, 0, 0, 0, 0, 0]));
    {
        let mut s = UnixStream::connect(&f.sock).unwrap();
        s.write_all(&[1, 0, 0]).unwrap();
    }
    // A well-behaved frontend still gets served.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut fe = loop {
        match Frontend::connect(&f.sock, 1) {
            Ok(fe) => break fe,
            Err(e) => {
                assert!(Instant::now() < deadline, "cannot connect: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    let features = fe.get_features().unwrap();
    assert_ne!(features & (1 << 32), 0, "VIRTIO_F_VERSION_1");
    fe.set_features(features).unwrap();
    let proto = fe.get_protocol_features().unwrap();
    assert!(proto.contains(VhostUserProtocolFeatures::CONFIG));
    fe.set_protocol_features(VhostUserProtocolFeatures::CONFIG)
        .unwrap();
    let (_, cfg) = fe
        .get_config(0, 60, VhostUserConfigFlags::WRITABLE, &[0u8; 60])
        .unwrap();
    assert_eq!(u64::from_le_bytes(cfg[..8].try_into().unwrap()), SIZE / 512);
    drop(fe);
    // No data was touched.
    assert_eq!(f.rt.block_on(f.disk.read(0, 8192)).unwrap(), before);
    let st = f.server.backend().stats();
    assert!(st.connections >= 6, "{st:?}");
    assert!(st.connection_errors >= 4, "{st:?}");
}
