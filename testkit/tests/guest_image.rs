// SPDX-License-Identifier: Apache-2.0
//! Boots the guest image under QEMU TCG with a raw virtio-blk disk and checks
//! that the guest read the host's marker and wrote its reply.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use sheaf_testkit::guest::{self, GuestImage};
use sheaf_testkit::qemu::{Machine, Qemu};

fn boot(machine: Machine) {
    let t = Instant::now();
    let image = GuestImage::build().expect("build guest image (scripts/setup installs the kernel)");
    let built = t.elapsed();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.img");
    let marker = format!("{machine:?}-{}", std::process::id());
    guest::create_disk(&disk, 32 << 20, &marker).unwrap();
    let out = Qemu::tcg()
        .machine(machine)
        .kernel(&image.kernel)
        .initrd(&image.initramfs)
        .append(guest::DEFAULT_CMDLINE)
        .disk(&disk)
        .timeout(Duration::from_secs(120))
        .run()
        .expect("qemu run");
    let console = out.console_text();
    let report = guest::parse_console(&console);
    assert_eq!(report.marker.as_deref(), Some(marker.as_str()), "{console}");
    assert!(report.ok, "{console}");
    assert_eq!(report.script_exit, Some(0), "{console}");
    assert_eq!(
        guest::read_reply(&disk).unwrap().as_deref(),
        Some(marker.as_str())
    );
    let ok_at = out.find("SHEAF-GUEST: OK").map(|l| l.at);
    eprintln!(
        "{machine:?}: image ready in {built:?}; guest OK at {ok_at:?}; qemu exited after {:?}",
        out.elapsed
    );
}

#[test]
fn guest_image_boots_on_pc() {
    if sheaf_testkit::skip_slow("guest_image_boots_on_pc") {
        return;
    }
    boot(Machine::Pc);
}

#[test]
fn custom_script_replaces_the_default() {
    if sheaf_testkit::skip_slow("custom_script_replaces_the_default") {
        return;
    }
    let image = GuestImage::builder()
        .script(
            "#!/bin/sh\n. /etc/sheaf/lib.sh\nsheaf_wait_block /dev/vda || exit 3\n\
             echo \"SHEAF-GUEST: marker=custom-$(cat /sys/block/vda/size)\"\nexit 7\n",
        )
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.img");
    guest::create_disk(&disk, 1 << 20, "unused").unwrap();
    let out = Qemu::tcg()
        .kernel(&image.kernel)
        .initrd(&image.initramfs)
        .append(guest::DEFAULT_CMDLINE)
        .disk(&disk)
        .timeout(Duration::from_secs(120))
        .run()
        .unwrap();
    let report = guest::parse_console(&out.console_text());
    assert_eq!(
        report.marker.as_deref(),
        Some("custom-2048"),
        "{}",
        out.console_text()
    );
    assert_eq!(report.script_exit, Some(7));
    assert!(!report.ok);
}

#[test]
fn vmlinux_is_extracted_with_a_pvh_note() {
    let Ok(image) = GuestImage::build() else {
        eprintln!("no guest kernel; skipping (scripts/setup installs it)");
        return;
    };
    let vmlinux = image.vmlinux().unwrap();
    let bytes = std::fs::read(vmlinux).unwrap();
    assert!(sheaf_testkit::kernel::elf::pvh_entry(&bytes).is_some());
}

/// A guest that does not finish in time: QEMU is killed, the error carries
/// the console tail, and no QEMU process is left behind.
#[test]
fn timeout_kills_qemu() {
    if sheaf_testkit::skip_slow("timeout_kills_qemu") {
        return;
    }
    // The guest never finishes on its own: a fast host boots the default
    // script in under two seconds, so the hang must come from the script.
    let image = GuestImage::builder()
        .script("#!/bin/sh\necho \"SHEAF-GUEST: hanging\"\nwhile :; do sleep 1; done\n")
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("timeout-probe.img");
    guest::create_disk(&disk, 1 << 20, "x").unwrap();
    let t = Instant::now();
    let err = Qemu::tcg()
        .kernel(&image.kernel)
        .initrd(&image.initramfs)
        .append(guest::DEFAULT_CMDLINE)
        .disk(&disk)
        .timeout(Duration::from_secs(2))
        .run()
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert!(
        matches!(err, sheaf_testkit::TestkitError::Timeout { .. }),
        "{err:?}"
    );
    let disk_arg = disk.display().to_string();
    let leftover = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .any(|c| String::from_utf8_lossy(&c).contains(&disk_arg));
    assert!(!leftover, "a qemu process with {disk_arg} is still running");
}
