// SPDX-License-Identifier: Apache-2.0
//! A 3-replica volume as the sheaf-vmm probe guest's virtio-blk disk, on
//! the host's /dev/kvm (feature `vmm`).
#![allow(clippy::unwrap_used)]

mod frontend_common;

use std::sync::Arc;
use std::time::Duration;

use frontend_common::{Cluster, read_replica, runtime};
use sheaf_blockrepl::frontend::Disk;
use sheaf_blockrepl::frontend::vmm::VolumeBackend;
use sheaf_blockrepl::volume::{Volume, VolumeConfig, create_replica};
use sheaf_vmm::{BlockBackend, BootProtocol, ExitReason, Vm, VmConfig, probe};

const MARKER: &[u8; 32] = b"SHEAF-MARKER-0123456789abcdefghi";

fn kvm_available() -> bool {
    if std::path::Path::new("/dev/kvm").exists() {
        return true;
    }
    eprintln!("SKIP: /dev/kvm is absent; the probe guest needs KVM");
    false
}

#[test]
fn probe_guest_writes_to_a_3_replica_volume() {
    if !kvm_available() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let rt = runtime();
    let cluster = Cluster::start(tmp.path(), 3, 1 << 20);
    let vol = rt.block_on(Volume::attach(cluster.config())).unwrap();
    let disk = Disk::new(vol);
    let mut block0 = MARKER.to_vec();
    block0.resize(4096, 0);
    rt.block_on(disk.write(0, block0.into())).unwrap();
    let backend = Arc::new(VolumeBackend::new(
        disk.clone(),
        rt.handle().clone(),
        "probe-disk-7",
    ));
    let token = format!("tok{}", std::process::id());
    let cfg = VmConfig::builder()
        .name("probe")
        .vcpus(1)
        .memory_mib(32)
        .kernel(probe::elf_path())
        .cmdline(format!(
            "console=ttyS0 probe.token={token} probe.need_disk=1"
        ))
        .cmdline_virtio_devices(true)
        .boot_protocol(BootProtocol::Linux64)
        .build()
        .unwrap();
    let vm = Vm::builder(cfg)
        .disk_backend(backend.clone())
        .create()
        .unwrap();
    vm.start().unwrap();
    let reason = vm
        .wait_timeout(Duration::from_secs(120))
        .expect("probe guest timed out");
    let out = String::from_utf8_lossy(&vm.console().contents()).into_owned();
    assert_eq!(reason, ExitReason::DebugExit { code: 0 }, "console:\n{out}");
    for line in [
        "virtio: id probe-disk-7",
        "virtio: sector0 SHEAF-MARKER-0123456789abcdefghi",
        "probe: PASS",
    ] {
        assert!(out.contains(line), "missing {line:?} in console:\n{out}");
    }
    let m = vm.metrics();
    assert!(m.block_requests >= 6, "{m:?}");
    // The guest wrote sector 1 (a sub-block write: read-modify-write).
    let mut want = vec![0u8; 4096];
    want[..32].copy_from_slice(MARKER);
    want[512..524].copy_from_slice(b"PROBE-REPLY:");
    want[524..556].copy_from_slice(MARKER);
    let mut got = vec![0u8; 4096];
    backend.read_at(0, &mut got).unwrap();
    assert_eq!(&got[..600], &want[..600]);
    drop(vm);
    rt.block_on(async {
        disk.flush().await.unwrap();
        disk.volume().clone().detach().await.unwrap();
    });
    // The guest's write is on every replica, each read alone.
    for n in &cluster.nodes {
        let d = read_replica(&n.dir, 0, 4096);
        assert_eq!(&d[..600], &want[..600], "replica {}", n.dir.display());
    }
}

#[test]
fn backend_contract_on_a_local_volume() {
    let tmp = tempfile::tempdir().unwrap();
    create_replica(tmp.path(), 1 << 20).unwrap();
    let b = VolumeBackend::attach(VolumeConfig::local(tmp.path()), "d0").unwrap();
    assert_eq!(b.size(), 1 << 20);
    assert_eq!(b.device_id(), "d0");
    assert!(b.supports_discard() && b.supports_write_zeroes());
    b.write_at(512, &[7u8; 1024]).unwrap();
    let mut buf = [0u8; 1536];
    b.read_at(0, &mut buf).unwrap();
    assert_eq!(&buf[..512], &[0u8; 512]);
    assert_eq!(&buf[512..], &[7u8; 1024]);
    b.write_zeroes(1024, 512, false).unwrap();
    b.read_at(512, &mut buf[..1024]).unwrap();
    assert_eq!(&buf[..512], &[7u8; 512]);
    assert_eq!(&buf[512..1024], &[0u8; 512]);
    b.flush().unwrap();
    b.discard(0, 1 << 20).unwrap();
    let err = b.read_at(1 << 20, &mut buf[..512]).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    let ro = b.with_read_only(true);
    assert!(BlockBackend::read_only(&ro));
    assert_eq!(
        ro.write_at(0, &[1u8; 512]).unwrap_err().kind(),
        std::io::ErrorKind::PermissionDenied
    );
}
