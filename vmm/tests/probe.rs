// SPDX-License-Identifier: Apache-2.0
//! Boots the probe guest on the host's /dev/kvm through the public API.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use sheaf_vmm::{BootProtocol, ExitReason, MemBackend, Vm, VmConfig, VmEvent, VmState, probe};

fn kvm_available() -> bool {
    if std::path::Path::new("/dev/kvm").exists() {
        return true;
    }
    eprintln!("SKIP: /dev/kvm is absent; probe guest tests need KVM");
    false
}

fn probe_config(protocol: BootProtocol, vcpus: u8, token: &str) -> VmConfig {
    VmConfig::builder()
        .name("probe")
        .vcpus(vcpus)
        .memory_mib(32)
        .kernel(probe::elf_path())
        .cmdline(format!(
            "console=ttyS0 probe.token={token} probe.need_disk=1"
        ))
        .cmdline_virtio_devices(true)
        .boot_protocol(protocol)
        .build()
        .unwrap()
}

fn marker_disk() -> Arc<MemBackend> {
    let mut data = vec![0u8; 1 << 20];
    data[..32].copy_from_slice(b"SHEAF-MARKER-0123456789abcdefghi");
    Arc::new(MemBackend::from_bytes(data, "probe-disk-7"))
}

fn run_probe(protocol: BootProtocol, vcpus: u8) {
    let disk = marker_disk();
    let token = format!("tok{}", std::process::id());
    let vm = Vm::builder(probe_config(protocol, vcpus, &token))
        .disk_backend(disk.clone())
        .create()
        .unwrap();
    let events = vm.subscribe();
    assert_eq!(vm.state(), VmState::Created);
    vm.start().unwrap();
    let reason = vm
        .wait_timeout(Duration::from_secs(60))
        .expect("probe guest timed out");
    let out = String::from_utf8_lossy(&vm.console().contents()).into_owned();
    assert_eq!(reason, ExitReason::DebugExit { code: 0 }, "console:\n{out}");
    let want = if protocol == BootProtocol::Pvh {
        "boot=pvh"
    } else {
        "boot=linux64"
    };
    for line in [
        want,
        &format!("token: {token}"),
        "acpi: rsdp ok",
        "virtio: id probe-disk-7",
        "virtio: sector0 SHEAF-MARKER-0123456789abcdefghi",
        "probe: PASS",
    ] {
        assert!(out.contains(line), "missing {line:?} in console:\n{out}");
    }
    // The guest's write reached the backend and was flushed.
    let c = disk.contents();
    assert_eq!(&c[512..524], b"PROBE-REPLY:");
    assert_eq!(&c[524..556], b"SHEAF-MARKER-0123456789abcdefghi");
    assert!(disk.flush_count() >= 1);
    let m = vm.metrics();
    assert!(m.block_requests >= 6, "{m:?}");
    assert_eq!(
        m.block_errors, 1,
        "only the deliberate out-of-range read fails: {m:?}"
    );
    assert!(m.create_to_first_exit.is_some());
    let evs: Vec<VmEvent> = events.try_iter().collect();
    assert_eq!(
        evs,
        vec![
            VmEvent::StateChanged {
                from: VmState::Created,
                to: VmState::Running
            },
            VmEvent::Exited {
                reason: ExitReason::DebugExit { code: 0 }
            },
            VmEvent::StateChanged {
                from: VmState::Running,
                to: VmState::Stopped
            },
        ]
    );
    assert_eq!(vm.state(), VmState::Stopped);
}

#[test]
fn probe_boots_linux64_and_drives_virtio_blk() {
    if kvm_available() {
        run_probe(BootProtocol::Linux64, 1);
    }
}

#[test]
fn probe_boots_pvh() {
    if kvm_available() {
        run_probe(BootProtocol::Pvh, 1);
    }
}

#[test]
fn probe_with_idle_application_processors() {
    // APs wait for INIT/SIPI inside KVM_RUN; stop must still kick them out.
    if kvm_available() {
        run_probe(BootProtocol::Linux64, 4);
    }
}
