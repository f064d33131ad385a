// SPDX-License-Identifier: Apache-2.0
//! Snapshot and restore of the probe guest on the host's /dev/kvm: a guest
//! appending log records to its disk is paused, saved, dropped, restored
//! into a new VM and continues (no reboot, records stay consecutive).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use sheaf_vmm::{Error, MemBackend, SnapshotError, Vm, VmConfig, probe};

fn kvm_available() -> bool {
    if std::path::Path::new("/dev/kvm").exists() {
        return true;
    }
    eprintln!("SKIP: /dev/kvm is absent; snapshot tests need KVM");
    false
}

fn config(vcpus: u8) -> VmConfig {
    VmConfig::builder()
        .name("snap")
        .vcpus(vcpus)
        .memory_mib(32)
        .kernel(probe::elf_path())
        .cmdline("console=ttyS0 probe.need_disk=1 probe.log=1000000 probe.log_pause=20000")
        .cmdline_virtio_devices(true)
        .build()
        .unwrap()
}

/// Acknowledged record indices in console output, in order.
fn acks(out: &str) -> Vec<u64> {
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("log: ack "))
        .filter_map(|n| n.trim().parse().ok())
        .collect()
}

fn wait_acks(vm: &Vm, n: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = String::from_utf8_lossy(&vm.console().contents()).into_owned();
        if acks(&out).len() >= n {
            return out;
        }
        assert!(Instant::now() < deadline, "no {n} acks; console:\n{out}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn paused_guest_continues_after_restore_twice() {
    if !kvm_available() {
        return;
    }
    let disk = Arc::new(MemBackend::new(4 << 20, "snap-disk"));
    let dir = tempfile::tempdir().unwrap();
    let vm = Vm::builder(config(2))
        .disk_backend(disk.clone())
        .create()
        .unwrap();
    vm.start().unwrap();
    wait_acks(&vm, 10);
    vm.pause().unwrap();
    let mut all = String::from_utf8_lossy(&vm.console().contents()).into_owned();
    vm.save_to_dir(dir.path()).unwrap();
    drop(vm);
    for f in [sheaf_vmm::STATE_FILE, sheaf_vmm::MEMORY_FILE] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(f))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{f}");
    }
    let saved = acks(&all).len();
    for round in 0..2 {
        let vm = Vm::builder(config(2))
            .disk_backend(disk.clone())
            .restore_from_dir(dir.path())
            .unwrap();
        vm.start().unwrap();
        let out = wait_acks(&vm, 10);
        assert!(
            !out.contains("sheaf-probe: boot"),
            "the guest rebooted:\n{out}"
        );
        vm.pause().unwrap();
        let out = String::from_utf8_lossy(&vm.console().contents()).into_owned();
        if round == 0 {
            vm.save_to_dir(dir.path()).unwrap();
        }
        all.push_str(&out);
        drop(vm);
    }
    let seq = acks(&all);
    assert!(seq.len() >= saved + 20, "{seq:?}");
    for (i, k) in seq.iter().enumerate() {
        assert_eq!(
            *k, i as u64,
            "acks not consecutive across restores: {seq:?}"
        );
    }
    // Every acknowledged record is on the disk (the guest verifies them at
    // boot too; here the host checks the magic and index).
    let c = disk.contents();
    for &k in &seq {
        let off = (2048 + 8 * k as usize) * 512;
        assert_eq!(&c[off..off + 8], b"SHEAFLOG", "record {k}");
        assert_eq!(
            u64::from_le_bytes(c[off + 8..off + 16].try_into().unwrap()),
            k
        );
    }
}

#[test]
fn restore_refuses_mismatched_config_and_bad_images() {
    if !kvm_available() {
        return;
    }
    let disk = Arc::new(MemBackend::new(4 << 20, "snap-disk"));
    let vm = Vm::builder(config(1))
        .disk_backend(disk.clone())
        .create()
        .unwrap();
    vm.start().unwrap();
    wait_acks(&vm, 2);
    vm.pause().unwrap();
    let snap = vm.snapshot_state().unwrap();
    let mut image = Vec::new();
    vm.save_memory(&mut image).unwrap();
    drop(vm);
    let mismatch = |e: Error| match e {
        Error::Snapshot(s) => s.to_string(),
        other => panic!("not a snapshot error: {other:?}"),
    };
    let e = Vm::builder(config(2))
        .disk_backend(disk.clone())
        .restore(&snap, &mut image.as_slice())
        .unwrap_err();
    assert!(mismatch(e).contains("vCPU count 1 but the config has 2"));
    let e = Vm::restore(config(1), &snap, &mut image.as_slice()).unwrap_err();
    assert!(mismatch(e).contains("devices [virtio-blk0]"));
    let e = Vm::builder(config(1))
        .disk_backend(Arc::new(MemBackend::new(8 << 20, "other")))
        .restore(&snap, &mut image.as_slice())
        .unwrap_err();
    let Error::Snapshot(SnapshotError::Device { device, reason }) = e else {
        panic!("{e:?}")
    };
    assert_eq!(device, "virtio-blk0");
    assert!(reason.contains("sectors"), "{reason}");
    let e = Vm::builder(config(1))
        .disk_backend(disk.clone())
        .restore(&snap, &mut &image[..image.len() - 4096])
        .unwrap_err();
    assert!(
        matches!(e, Error::Snapshot(SnapshotError::MemoryTruncated { .. })),
        "{e:?}"
    );
    let mut json = snap.to_json().unwrap();
    let text = String::from_utf8(json.clone()).unwrap();
    json = text
        .replacen("\"version\":1", "\"version\":99", 1)
        .into_bytes();
    let e = sheaf_vmm::VmSnapshot::from_json(&json).unwrap_err();
    assert!(
        matches!(
            e,
            SnapshotError::UnsupportedVersion {
                found: 99,
                supported: 1
            }
        ),
        "{e:?}"
    );
    // The untouched snapshot still restores and runs.
    let vm = Vm::builder(config(1))
        .disk_backend(disk)
        .restore(&snap, &mut image.as_slice())
        .unwrap();
    vm.start().unwrap();
    wait_acks(&vm, 2);
}
