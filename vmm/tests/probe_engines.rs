// SPDX-License-Identifier: Apache-2.0
//! Boots the probe guest with a file-backed disk on every `io_engine`: the
//! guest reads the marker, writes its reply and flushes, through the VM's
//! real device thread (ioeventfd, irqfd, completion wake-ups).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use sheaf_vmm::{DiskConfig, ExitReason, IoEngine, Vm, VmConfig, probe};

fn boot_with(engine: IoEngine, io_threads: Option<u16>, queues: Option<u16>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("probe.img");
    let mut data = vec![0u8; 1 << 20];
    data[..32].copy_from_slice(b"SHEAF-MARKER-0123456789abcdefghi");
    std::fs::write(&path, &data).unwrap();
    let cfg = VmConfig::builder()
        .name("probe-engine")
        .vcpus(1)
        .memory_mib(32)
        .kernel(probe::elf_path())
        .cmdline("console=ttyS0 probe.token=eng probe.need_disk=1")
        .cmdline_virtio_devices(true)
        .disk_config(DiskConfig {
            path: path.clone(),
            read_only: false,
            id: Some("probe-disk-7".into()),
            io_engine: engine,
            io_threads,
            queues,
        })
        .build()
        .unwrap();
    let vm = Vm::new(cfg).unwrap();
    vm.start().unwrap();
    let reason = vm
        .wait_timeout(Duration::from_secs(60))
        .expect("probe guest timed out");
    let out = String::from_utf8_lossy(&vm.console().contents()).into_owned();
    assert_eq!(
        reason,
        ExitReason::DebugExit { code: 0 },
        "{engine:?} console:\n{out}"
    );
    for line in [
        "virtio: id probe-disk-7",
        "virtio: sector0 SHEAF-MARKER-0123456789abcdefghi",
        "probe: PASS",
    ] {
        assert!(
            out.contains(line),
            "{engine:?}: missing {line:?} in:\n{out}"
        );
    }
    let c = std::fs::read(&path).unwrap();
    assert_eq!(&c[512..524], b"PROBE-REPLY:", "{engine:?}");
    assert_eq!(&c[524..556], b"SHEAF-MARKER-0123456789abcdefghi");
    let m = vm.metrics();
    assert!(m.block_requests >= 6, "{engine:?}: {m:?}");
    assert_eq!(
        m.block_errors, 1,
        "{engine:?}: only the deliberate bad read: {m:?}"
    );
}

#[test]
fn probe_guest_drives_a_file_disk_on_every_io_engine() {
    if !std::path::Path::new("/dev/kvm").exists() {
        eprintln!("SKIP: /dev/kvm is absent; probe guest tests need KVM");
        return;
    }
    boot_with(IoEngine::Auto, None, None);
    boot_with(IoEngine::IoUring, None, Some(4));
    boot_with(IoEngine::Threads, Some(2), Some(2));
    boot_with(IoEngine::Sync, None, None);
}
