// SPDX-License-Identifier: Apache-2.0
//! The launcher and the VM runtimes on their own: `sheaf-launcher vm` with
//! sheaf-vmm (probe guest on /dev/kvm) and with QEMU (a Debian kernel under
//! TCG, disk over NBD), each on a 3-replica volume served by
//! `sheaf-launcher replica` processes; and the control socket (status
//! lines, Stop).
#![allow(clippy::unwrap_used)]

mod cluster_common;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cluster_common::{acks, kvm_available, log_block, valid_record};
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::volume::{Volume, VolumeConfig};
use sheaf_orchestrator::cluster::ensure_secret;
use sheaf_orchestrator::launcher::metrics::{IoMetrics, LATENCY_BUCKETS};
use sheaf_orchestrator::launcher::{LaunchDisk, LaunchSpec, LauncherPhase, LauncherStatus};
use sheaf_orchestrator::runtime::VmSpec;

const LAUNCHER: &str = env!("CARGO_BIN_EXE_sheaf-launcher");

struct Replicas {
    children: Vec<Child>,
    addrs: Vec<SocketAddr>,
    secret_file: PathBuf,
    secret: Secret,
}

impl Drop for Replicas {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn replicas(dir: &Path, n: usize, size: u64) -> Replicas {
    let secret_file = dir.join("secret");
    let secret = ensure_secret(&secret_file).unwrap();
    let mut children = Vec::new();
    let mut addrs = Vec::new();
    for i in 0..n {
        let mut c = Command::new(LAUNCHER)
            .args([
                "replica",
                "--listen",
                "127.0.0.1:0",
                "--create-size",
                &size.to_string(),
            ])
            .arg("--dir")
            .arg(dir.join(format!("r{i}")))
            .arg("--secret-file")
            .arg(&secret_file)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(c.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        addrs.push(
            line.trim()
                .strip_prefix("listening on ")
                .unwrap()
                .parse()
                .unwrap(),
        );
        children.push(c);
    }
    Replicas {
        children,
        addrs,
        secret_file,
        secret,
    }
}

fn spec(dir: &Path, r: &Replicas, runtime: &str, vm: VmSpec, epoch: u64) -> LaunchSpec {
    let ldir = dir.join("launcher");
    std::fs::create_dir_all(&ldir).unwrap();
    LaunchSpec {
        instance: "default/test".into(),
        uid: "uid-1".into(),
        runtime: runtime.into(),
        vm,
        disks: vec![LaunchDisk {
            name: "root".into(),
            volume: "default/vol".into(),
            serial: "sheaf-root".into(),
            replicas: r.addrs.clone(),
            epoch,
            min_write_replicas: None,
            read_only: false,
            size_bytes: 0,
        }],
        file_disks: Vec::new(),
        secret_file: Some(r.secret_file.clone()),
        dir: ldir,
        incoming: None,
    }
}

fn launch(spec: &LaunchSpec) -> Child {
    let path = spec.dir.join("spec.json");
    std::fs::write(&path, serde_json::to_vec(spec).unwrap()).unwrap();
    Command::new(LAUNCHER)
        .arg("vm")
        .arg("--spec")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(spec.dir.join("launcher.log")).unwrap())
        .spawn()
        .unwrap()
}

fn wait_exit(c: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "launcher did not exit within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn attach(r: &Replicas, min_epoch: u64) -> Volume {
    let mut cfg = VolumeConfig::remote(&r.addrs, r.secret.clone());
    cfg.min_epoch = min_epoch;
    Volume::attach(cfg).await.unwrap()
}

fn probe_vm(args: &str) -> VmSpec {
    VmSpec {
        name: "probe".into(),
        vcpus: 1,
        memory_mib: 32,
        kernel: sheaf_vmm::probe::elf_path().to_path_buf(),
        initramfs: None,
        cmdline: format!("console=ttyS0 {args}"),
        boot_disk: None,
        nets: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheaf_vmm_launcher_writes_through_the_granted_epoch() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let r = replicas(tmp.path(), 3, 8 << 20);
    let s = spec(
        tmp.path(),
        &r,
        "sheaf-vmm",
        probe_vm("probe.need_disk=1 probe.log=8"),
        7,
    );
    let mut c = launch(&s);
    let st = wait_exit(&mut c, Duration::from_secs(60));
    let console = std::fs::read_to_string(s.dir.join("console.log")).unwrap_or_default();
    assert!(st.success(), "launcher failed: {console}");
    assert!(console.contains("virtio: id sheaf-root"), "{console}");
    assert_eq!(acks(&console), (0..8).collect::<Vec<_>>());
    let status = LauncherStatus::load(&s.dir).unwrap();
    assert_eq!(status.phase, LauncherPhase::Exited);
    assert!(status.exit.as_ref().unwrap().success);
    assert!(
        status.disks[0].epoch >= 7,
        "engine epoch {} below the grant",
        status.disks[0].epoch
    );
    assert!(status.disks[0].active.len() >= 2, "{:?}", status.disks);
    // Guest I/O latency: every acknowledged record was a timed write + flush.
    let io = IoMetrics::load(&s.dir).expect("io-metrics.json");
    assert!(io.timed);
    let d = &io.disks[0];
    assert_eq!(d.volume, s.disks[0].volume);
    assert!(d.write.count >= 8, "{d:?}");
    assert!(d.flush.count >= 8, "{d:?}");
    assert!(d.read.count > 0 && d.write.bytes >= 8 * 512, "{d:?}");
    assert_eq!(d.write.buckets.len(), LATENCY_BUCKETS.len());
    assert!(d.write.sum_seconds > 0.0, "{d:?}");
    // A later engine reads every record from the replicas.
    let v = attach(&r, status.disks[0].epoch).await;
    for k in 0..8 {
        let b = v.read(log_block(k) * 4096, 4096).await.unwrap();
        assert!(valid_record(&b, k), "record {k}");
    }
    v.detach().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_socket_reports_status_and_stops_the_vm() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let r = replicas(tmp.path(), 3, 4 << 20);
    let s = spec(tmp.path(), &r, "sheaf-vmm", probe_vm("probe.halt=1"), 1);
    let mut c = launch(&s);
    let sock = s.dir.join("control.sock");
    let deadline = Instant::now() + Duration::from_secs(30);
    let stream = loop {
        match std::os::unix::net::UnixStream::connect(&sock) {
            Ok(st) => break st,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("no control socket: {e}"),
        }
    };
    let mut w = stream.try_clone().unwrap();
    let mut lines = BufReader::new(stream).lines();
    let mut phases = Vec::new();
    for l in lines.by_ref() {
        let st: LauncherStatus = serde_json::from_str(&l.unwrap()).unwrap();
        phases.push(st.phase);
        if st.phase == LauncherPhase::Running {
            w.write_all(b"\"Stop\"\n").unwrap();
        }
        if st.phase == LauncherPhase::Exited {
            assert!(!st.exit.as_ref().unwrap().success);
            assert!(st.exit.unwrap().reason.starts_with("stopped"));
            break;
        }
    }
    assert!(phases.contains(&LauncherPhase::Running), "{phases:?}");
    assert_eq!(phases.last(), Some(&LauncherPhase::Exited));
    assert!(!wait_exit(&mut c, Duration::from_secs(30)).success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_launcher_boots_linux_on_a_replicated_volume() {
    if sheaf_testkit::skip_slow("qemu_launcher_boots_linux_on_a_replicated_volume") {
        return;
    }
    if sheaf_testkit::which("qemu-system-x86_64").is_none() {
        eprintln!("SKIP: qemu-system-x86_64 not installed (scripts/setup)");
        return;
    }
    let image = match sheaf_testkit::guest::GuestImage::build() {
        Ok(i) => i,
        Err(e) => {
            eprintln!("SKIP: no guest image: {e}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let r = replicas(tmp.path(), 3, 16 << 20);
    // The host writes the marker through the volume first (epoch 1).
    let v = attach(&r, 0).await;
    let mut block = b"SHEAF-MARKER:nbd-qemu\n".to_vec();
    block.resize(4096, 0);
    v.write(0, block.into()).await.unwrap();
    v.detach().await.unwrap();
    let vm = VmSpec {
        name: "linux".into(),
        vcpus: 1,
        memory_mib: 256,
        kernel: image.kernel.clone(),
        initramfs: Some(image.initramfs.clone()),
        cmdline: sheaf_testkit::guest::DEFAULT_CMDLINE.into(),
        boot_disk: None,
        nets: Vec::new(),
    };
    let s = spec(tmp.path(), &r, "qemu", vm, 5);
    let mut c = launch(&s);
    let st = wait_exit(&mut c, Duration::from_secs(240));
    let console = std::fs::read_to_string(s.dir.join("console.log")).unwrap_or_default();
    let report = sheaf_testkit::guest::parse_console(&console);
    assert!(st.success(), "{console}");
    assert!(report.ok, "{console}");
    assert_eq!(report.marker.as_deref(), Some("nbd-qemu"));
    let status = LauncherStatus::load(&s.dir).unwrap();
    assert!(status.disks[0].epoch >= 5);
    // The guest's reply is on the volume.
    let v = attach(&r, status.disks[0].epoch).await;
    let b = v.read(4096, 4096).await.unwrap();
    assert!(b.starts_with(b"SHEAF-REPLY:nbd-qemu\n"), "{:?}", &b[..32]);
    v.detach().await.unwrap();
}

/// The guest side of the seeds: a stock Linux kernel under QEMU finds each
/// by its label in disk order (config drive `vda`, the volume `vdb`, NoCloud
/// `vdc`), mounts them and reads the files cloud-init reads; the seeds are
/// read-only to it, the volume is not.
const SEED_SCRIPT: &str = r#"
. /etc/sheaf/lib.sh
sheaf_wait_block /dev/vdc 100 || { echo "SHEAF-GUEST: FAIL no /dev/vdc"; exit 1; }
echo "SHEAF-GUEST: label-dev=$(findfs LABEL=cidata)"
echo "SHEAF-GUEST: config-2-dev=$(findfs LABEL=config-2)"
mkdir -p /seed
mount -t vfat -o ro /dev/vdc /seed || { echo "SHEAF-GUEST: FAIL mount"; exit 1; }
echo "SHEAF-GUEST: files=$(ls /seed | tr '\n' ' ')"
while IFS= read -r l; do echo "SHEAF-SEED: $l"; done < /seed/user-data
umount /seed
mount -t vfat -o ro /dev/vda /seed || { echo "SHEAF-GUEST: FAIL mount config drive"; exit 1; }
echo "SHEAF-GUEST: config-2-meta=$(cat /seed/openstack/latest/meta_data.json)"
umount /seed
echo "SHEAF-GUEST: ro=$(cat /sys/block/vda/ro)$(cat /sys/block/vdb/ro)$(cat /sys/block/vdc/ro)"
dd if=/dev/zero of=/dev/vdc bs=512 count=1 2>/dev/null && echo "SHEAF-GUEST: FAIL seed written"
echo "SHEAF-GUEST: OK"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_linux_guest_reads_the_cloud_init_seed() {
    use std::collections::BTreeMap;

    use sheaf_orchestrator::cloudinit::{self, Flavor, Instance, Seed};
    use sheaf_orchestrator::launcher::LaunchFileDisk;
    use sheaf_orchestrator::resources::kubevirt::CloudInit;

    if sheaf_testkit::skip_slow("qemu_linux_guest_reads_the_cloud_init_seed") {
        return;
    }
    if sheaf_testkit::which("qemu-system-x86_64").is_none() {
        eprintln!("SKIP: qemu-system-x86_64 not installed (scripts/setup)");
        return;
    }
    let image = match sheaf_testkit::guest::GuestImage::builder()
        .script(SEED_SCRIPT)
        .module("fat")
        .module("vfat")
        .module("nls_cp437")
        .module("nls_ascii")
        .module("nls_utf8")
        .build()
    {
        Ok(i) => i,
        Err(e) => {
            eprintln!("SKIP: no guest image: {e}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let r = replicas(tmp.path(), 1, 8 << 20);
    let vm = VmSpec {
        name: "linux".into(),
        vcpus: 1,
        memory_mib: 256,
        kernel: image.kernel.clone(),
        initramfs: Some(image.initramfs.clone()),
        cmdline: sheaf_testkit::guest::DEFAULT_CMDLINE.into(),
        boot_disk: None,
        nets: Vec::new(),
    };
    let mut s = spec(tmp.path(), &r, "qemu", vm, 1);
    let user_data = "#cloud-config\nruncmd:\n  - [echo, sheaf-marker]\n";
    let ci = CloudInit {
        user_data: Some(user_data.into()),
        ..Default::default()
    };
    let inst = Instance {
        namespace: "default",
        uid: "uid-1",
        hostname: "linux",
    };
    let seed = Seed::new(Flavor::NoCloud, &ci, "v", &inst, &BTreeMap::new()).unwrap();
    let path = cloudinit::write_seed(
        &s.dir,
        &cloudinit::seed_file_name(Flavor::NoCloud, "cloudinitdisk"),
        &seed.image(cloudinit::volume_id(inst.uid)).unwrap(),
    )
    .unwrap();
    s.file_disks.push(LaunchFileDisk {
        name: "cloudinitdisk".into(),
        path,
        serial: "cloudinitdisk".into(),
        read_only: true,
        position: 2,
    });
    let cd = Seed::new(Flavor::ConfigDrive, &ci, "v", &inst, &BTreeMap::new()).unwrap();
    let path = cloudinit::write_seed(
        &s.dir,
        &cloudinit::seed_file_name(Flavor::ConfigDrive, "configdrive"),
        &cd.image(1).unwrap(),
    )
    .unwrap();
    s.file_disks.push(LaunchFileDisk {
        name: "configdrive".into(),
        path,
        serial: "configdrive".into(),
        read_only: true,
        position: 0,
    });
    let mut c = launch(&s);
    let st = wait_exit(&mut c, Duration::from_secs(240));
    let console = std::fs::read_to_string(s.dir.join("console.log")).unwrap_or_default();
    assert!(st.success(), "{console}");
    assert!(console.contains("SHEAF-GUEST: OK"), "{console}");
    assert!(!console.contains("FAIL"), "{console}");
    assert!(
        console.contains("SHEAF-GUEST: label-dev=/dev/vdc"),
        "{console}"
    );
    assert!(
        console.contains("SHEAF-GUEST: config-2-dev=/dev/vda"),
        "{console}"
    );
    assert!(
        console.contains(r#"SHEAF-GUEST: config-2-meta={"hostname":"linux""#),
        "{console}"
    );
    // Seeds read-only, the volume writable.
    assert!(console.contains("SHEAF-GUEST: ro=101"), "{console}");
    assert!(
        console.contains("SHEAF-GUEST: files=meta-data user-data "),
        "{console}"
    );
    let seen: Vec<&str> = console
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("SHEAF-SEED: "))
        .collect();
    assert_eq!(seen, user_data.lines().collect::<Vec<_>>(), "{console}");
}
