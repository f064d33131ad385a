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

// ---- The asynchronous backend: many requests in flight, reset, a guest. ----

use sheaf_blockrepl::frontend::vmm::AsyncVolumeBackend;
use sheaf_vmm::devices::virtio::test_utils::{DATA, Driver, RawDesc};
use vm_memory::{Bytes, GuestAddress};

const SLOT: u64 = 0x2000;

fn slot(i: u16) -> u64 {
    DATA + u64::from(i) * SLOT
}

/// Request `i`: header at slot, `len` data bytes at slot+0x1000, status at
/// slot+0x100; descriptors 3i..3i+2 (2 without data).
fn post(d: &mut Driver, i: u16, ty: u32, sector: u64, len: u32) {
    let (base, h) = (slot(i), 3 * i);
    d.header(base, ty, sector);
    let status = base + 0x100;
    d.mem.write_obj(0xffu8, GuestAddress(status)).unwrap();
    let mut next = h + 1;
    d.set_desc(
        h,
        RawDesc {
            addr: base,
            len: 16,
            flags: 1,
            next,
        },
    );
    if len > 0 {
        d.set_desc(
            next,
            RawDesc {
                addr: base + 0x1000,
                len,
                flags: 1 | if ty == 0 || ty == 8 { 2 } else { 0 },
                next: next + 1,
            },
        );
        next += 1;
    }
    d.set_desc(
        next,
        RawDesc {
            addr: status,
            len: 1,
            flags: 2,
            next: 0,
        },
    );
    d.kick(h);
}

fn status(d: &Driver, i: u16) -> u8 {
    d.mem.read_obj(GuestAddress(slot(i) + 0x100)).unwrap()
}

/// Plays the device thread until `want` used entries are there.
fn run_until_used(d: &mut Driver, want: u16) {
    let done = d.run_until_used(want, Duration::from_secs(30));
    assert!(done, "only {} of {want} completed", d.used_idx());
}

fn async_backend(cluster: &Cluster, rt: &tokio::runtime::Runtime) -> (Disk, AsyncVolumeBackend) {
    let vol = rt.block_on(Volume::attach(cluster.config())).unwrap();
    let disk = Disk::new(vol);
    let b = VolumeBackend::new(disk.clone(), rt.handle().clone(), "async-vol").into_async();
    (disk, b)
}

#[test]
fn async_backend_serves_many_in_flight_requests_on_a_3_replica_volume() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = runtime();
    let cluster = Cluster::start(tmp.path(), 3, 1 << 20);
    let (disk, b) = async_backend(&cluster, &rt);
    let mut d = Driver::new_async(Arc::new(b), 1 << 20);
    assert!(d.negotiate(0));
    d.setup_queue(128);
    // 32 single-sector writes, eight per 4 KiB block: every one is a
    // read-modify-write racing seven others on the same block.
    const N: u16 = 32;
    for i in 0..N {
        d.mem
            .write_slice(&[i as u8 + 1; 512], GuestAddress(slot(i) + 0x1000))
            .unwrap();
        post(&mut d, i, 1, u64::from(i), 512);
    }
    // A flush right behind them, and a get-id.
    post(&mut d, N, 4, 0, 0);
    post(&mut d, N + 1, 8, 0, 20);
    run_until_used(&mut d, N + 2);
    let order: Vec<u32> = (0..N + 2).map(|k| d.used_elem(k).0).collect();
    let flush_at = order.iter().position(|&h| h == 3 * u32::from(N)).unwrap();
    let writes_before = order[..flush_at]
        .iter()
        .filter(|&&h| h < 3 * u32::from(N))
        .count();
    assert_eq!(
        writes_before,
        usize::from(N),
        "flush after every earlier write: {order:?}"
    );
    for i in 0..N + 2 {
        assert_eq!(status(&d, i), 0, "request {i}");
    }
    let mut id = [0u8; 20];
    d.mem
        .read_slice(&mut id, GuestAddress(slot(N + 1) + 0x1000))
        .unwrap();
    assert_eq!(&id[..9], b"async-vol");
    // Reads back, in flight together, into poisoned buffers.
    for i in 0..N {
        d.mem
            .write_slice(&[0xa5; 512], GuestAddress(slot(i) + 0x1000))
            .unwrap();
        post(&mut d, i, 0, u64::from(i), 512);
    }
    run_until_used(&mut d, 2 * N + 2);
    for i in 0..N {
        assert_eq!(status(&d, i), 0, "read {i}");
        let mut back = [0u8; 512];
        d.mem
            .read_slice(&mut back, GuestAddress(slot(i) + 0x1000))
            .unwrap();
        assert_eq!(back, [i as u8 + 1; 512], "sector {i}");
    }
    // A read past the end is an I/O error; the volume agrees with the guest.
    post(&mut d, 0, 0, (1 << 20) / 512, 512);
    run_until_used(&mut d, 2 * N + 3);
    assert_eq!(status(&d, 0), 1);
    let all = rt.block_on(disk.read(0, 16384)).unwrap();
    for i in 0..usize::from(N) {
        assert!(
            all[i * 512..(i + 1) * 512]
                .iter()
                .all(|&x| x == i as u8 + 1)
        );
    }
}

#[test]
fn async_backend_reset_with_requests_in_flight_leaves_memory_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = runtime();
    let cluster = Cluster::start(tmp.path(), 3, 1 << 20);
    let (_disk, b) = async_backend(&cluster, &rt);
    let mut d = Driver::new_async(Arc::new(b), 1 << 20);
    assert!(d.negotiate(0));
    d.setup_queue(128);
    for i in 0..32u16 {
        post(&mut d, i, u32::from(i % 2), u64::from(i) * 8, 4096);
    }
    d.w(0x70, 0);
    let mut before = vec![0u8; 1 << 20];
    d.mem.read_slice(&mut before, GuestAddress(0)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let mut after = vec![0u8; 1 << 20];
    d.mem.read_slice(&mut after, GuestAddress(0)).unwrap();
    assert!(before == after, "guest memory changed after reset returned");
}

#[test]
fn probe_guest_on_the_async_volume_backend() {
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
    let backend =
        VolumeBackend::new(disk.clone(), rt.handle().clone(), "probe-disk-7").into_async();
    let cfg = VmConfig::builder()
        .name("probe")
        .vcpus(1)
        .memory_mib(32)
        .kernel(probe::elf_path())
        .cmdline("console=ttyS0 probe.token=async probe.need_disk=1")
        .cmdline_virtio_devices(true)
        .build()
        .unwrap();
    let vm = Vm::builder(cfg)
        .async_disk_backend(Arc::new(backend))
        .create()
        .unwrap();
    vm.start().unwrap();
    let reason = vm
        .wait_timeout(Duration::from_secs(120))
        .expect("probe guest timed out");
    let out = String::from_utf8_lossy(&vm.console().contents()).into_owned();
    assert_eq!(reason, ExitReason::DebugExit { code: 0 }, "console:\n{out}");
    assert!(out.contains("probe: PASS"), "{out}");
    assert!(out.contains("virtio: sector0 SHEAF-MARKER"), "{out}");
    drop(vm);
    let got = rt.block_on(disk.read(0, 4096)).unwrap();
    assert_eq!(&got[512..524], b"PROBE-REPLY:");
    assert_eq!(&got[524..556], MARKER);
}
