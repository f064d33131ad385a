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

#[test]
fn pause_quiesces_and_resume_continues() {
    if !kvm_available() {
        return;
    }
    let cfg = VmConfig::builder()
        .kernel(probe::elf_path())
        .memory_mib(16)
        .vcpus(2)
        .memory_backing(sheaf_vmm::MemoryBacking::Memfd)
        .track_dirty_pages(true)
        .cmdline("probe.spin=1")
        .build()
        .unwrap();
    let vm = Vm::new(cfg).unwrap();
    assert!(vm.memory_fd().is_some());
    let events = vm.subscribe();
    assert!(vm.pause().is_err(), "cannot pause before start");
    vm.start().unwrap();
    assert!(vm.start().is_err(), "cannot start twice");
    let wait_for = |pred: &dyn Fn(&[u8]) -> bool| {
        for _ in 0..500 {
            if pred(&vm.console().contents()) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!(
            "console never matched: {}",
            String::from_utf8_lossy(&vm.console().contents())
        );
    };
    wait_for(&|c| c.windows(5).any(|w| w == b"PASS\n") && c.ends_with(b".."));
    let dirty: u64 = vm.dirty_pages().unwrap().iter().map(|r| r.count()).sum();
    assert!(dirty > 0, "the running guest dirtied pages");
    vm.pause().unwrap();
    assert_eq!(vm.state(), VmState::Paused);
    let at_pause = vm.console().total();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        vm.console().total(),
        at_pause,
        "no guest progress while paused"
    );
    // Nothing dirtied while paused (the log was cleared above, then again here).
    let _ = vm.dirty_pages().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let paused_dirty: u64 = vm.dirty_pages().unwrap().iter().map(|r| r.count()).sum();
    assert_eq!(paused_dirty, 0);
    vm.resume().unwrap();
    wait_for(&|_| vm.console().total() > at_pause + 3);
    assert_eq!(vm.stop(), ExitReason::Stopped);
    assert_eq!(vm.state(), VmState::Stopped);
    let states: Vec<VmEvent> = events.try_iter().collect();
    assert_eq!(
        states,
        vec![
            VmEvent::StateChanged {
                from: VmState::Created,
                to: VmState::Running
            },
            VmEvent::StateChanged {
                from: VmState::Running,
                to: VmState::Paused
            },
            VmEvent::StateChanged {
                from: VmState::Paused,
                to: VmState::Running
            },
            VmEvent::Exited {
                reason: ExitReason::Stopped
            },
            VmEvent::StateChanged {
                from: VmState::Running,
                to: VmState::Stopped
            },
        ]
    );
}

#[test]
fn stop_while_paused_and_drop_without_start() {
    if !kvm_available() {
        return;
    }
    let cfg = VmConfig::builder()
        .kernel(probe::elf_path())
        .memory_mib(8)
        .cmdline("probe.spin=1")
        .build()
        .unwrap();
    let vm = Vm::new(cfg.clone()).unwrap();
    vm.start().unwrap();
    vm.pause().unwrap();
    assert_eq!(vm.wait_timeout(Duration::from_millis(50)), None);
    assert_eq!(vm.stop(), ExitReason::Stopped);
    // Never started: stop is immediate; dropping a created VM is fine.
    let vm = Vm::new(cfg.clone()).unwrap();
    assert_eq!(vm.stop(), ExitReason::Stopped);
    drop(Vm::new(cfg).unwrap());
}

#[test]
fn bad_kernel_images_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk");
    std::fs::write(&junk, vec![0x42u8; 8192]).unwrap();
    for path in [junk, dir.path().join("missing")] {
        let cfg = VmConfig::builder()
            .kernel(&path)
            .memory_mib(8)
            .build()
            .unwrap();
        match Vm::new(cfg) {
            Err(sheaf_vmm::Error::Boot(_)) => {}
            Err(sheaf_vmm::Error::OpenKvm(_)) if !kvm_available() => {}
            other => panic!(
                "expected a boot error for {}, got {other:?}",
                path.display()
            ),
        }
    }
}

#[test]
fn public_handles_are_thread_safe() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Vm>();
    send_sync::<sheaf_vmm::ConsoleRing>();
    send_sync::<std::sync::Arc<dyn sheaf_vmm::BlockBackend>>();
    send_sync::<VmConfig>();
}

/// `probe.log=N` (used by the orchestrator's failover test): verifies the
/// records already on disk, appends N more (each flushed before its ack is
/// printed), and refuses a corrupt log.
#[test]
fn probe_log_mode_appends_verifies_and_detects_corruption() {
    if !kvm_available() {
        return;
    }
    let disk = Arc::new(MemBackend::new(4 << 20, "log-disk"));
    let run = |args: &str| {
        let cfg = VmConfig::builder()
            .name("probe-log")
            .vcpus(1)
            .memory_mib(32)
            .kernel(probe::elf_path())
            .cmdline(format!("console=ttyS0 probe.token=t1 {args}"))
            .cmdline_virtio_devices(true)
            .build()
            .unwrap();
        let vm = Vm::builder(cfg)
            .disk_backend(disk.clone())
            .create()
            .unwrap();
        vm.start().unwrap();
        let reason = vm.wait_timeout(Duration::from_secs(60)).expect("timed out");
        let out = String::from_utf8_lossy(&vm.console().contents()).into_owned();
        (reason, out)
    };
    let (reason, out) = run("probe.log=5");
    assert_eq!(reason, ExitReason::DebugExit { code: 0 }, "{out}");
    assert!(out.contains("log: found 0 records"), "{out}");
    assert!(
        out.contains("log: ack 4\n") && out.contains("log: done 5"),
        "{out}"
    );
    let (reason, out) = run("probe.log=3");
    assert_eq!(reason, ExitReason::DebugExit { code: 0 }, "{out}");
    assert!(out.contains("log: found 5 records"), "{out}");
    assert!(out.contains("log: ack 7\n"), "{out}");
    // Record k is the first sector of block 256 + k; its index is at byte 8.
    let c = disk.contents();
    let rec = |k: usize| &c[(256 + k) * 4096..(256 + k) * 4096 + 512];
    assert_eq!(&rec(6)[..8], b"SHEAFLOG");
    assert_eq!(rec(6)[8], 6);
    assert_eq!(&rec(6)[16..18], b"t1");
    // Flip a byte of record 2: the next boot refuses the log.
    let mut bad = rec(2).to_vec();
    bad[100] ^= 0xff;
    sheaf_vmm::BlockBackend::write_at(&*disk, 2048 * 512 + 2 * 4096, &bad).unwrap();
    let (reason, out) = run("probe.log=1");
    assert_eq!(reason, ExitReason::DebugExit { code: 0x31 }, "{out}");
    assert!(out.contains("log: CORRUPT 2"), "{out}");
}
