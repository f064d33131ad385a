// SPDX-License-Identifier: Apache-2.0
//! Boots the stock Debian cloud kernel + the testkit's busybox initramfs on
//! sheaf-vmm, inside the nested-KVM box (this machine's own KVM cannot run a
//! stock Linux guest; see docs/testing.md).
//!
//! The host writes a marker to a raw disk; the guest finds `/dev/vda`
//! (virtio-mmio, discovered through our ACPI DSDT), reads the marker, writes
//! a reply, and powers off; sheaf-vmm must report a clean ACPI shutdown and
//! the host checks the reply on the disk that comes back out of the box.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use sheaf_testkit::guest::{self, GuestImage};
use sheaf_testkit::nested::NestedBox;
use sheaf_testkit::static_build;

/// The image's default command line without `quiet`, so a failure shows the
/// whole boot log.
const CMDLINE: &str = "console=ttyS0 panic=-1";

#[test]
fn stock_linux_boots_reads_marker_writes_reply_and_powers_off() {
    if sheaf_testkit::skip_slow("linux_boot") {
        return;
    }
    sheaf_testkit::init_tracing();
    let image = GuestImage::build().unwrap();
    let vmm = static_build::build_example("sheaf-vmm", "run_vm").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.img");
    let marker = format!("linux-boot-{}", std::process::id());
    guest::create_disk(&disk, 16 << 20, &marker).unwrap();

    let out = NestedBox::new()
        .memory_mib(1024)
        .file("bzImage", &image.kernel)
        .file("initramfs.cpio.gz", &image.initramfs)
        .file("disk.img", &disk)
        .collect("disk.img")
        .env("MEM_MIB", "256")
        .env("VCPUS", "2")
        .env("WAIT_S", "360")
        .env("PROGRESS_S", "30")
        .timeout(Duration::from_secs(480))
        .run(&vmm, ["bzImage", "initramfs.cpio.gz", CMDLINE, "disk.img"])
        .unwrap();
    eprintln!("---- program output ----\n{}\n---- end ----", out.output);
    let report = guest::parse_console(&out.output);
    assert!(
        out.output.contains("sheaf-vmm: guest exited: Shutdown"),
        "sheaf-vmm did not report a clean shutdown:\n{}",
        out.output
    );
    assert_eq!(out.exit_status, 0, "{}", out.output);
    assert_eq!(
        report.marker.as_deref(),
        Some(marker.as_str()),
        "{}",
        out.output
    );
    assert!(report.ok, "{}", out.output);
    let back = dir.path().join("back.img");
    std::fs::write(&back, out.read_file("disk.img").unwrap()).unwrap();
    assert_eq!(
        guest::read_reply(&back).unwrap().as_deref(),
        Some(marker.as_str())
    );
    eprintln!(
        "linux_boot: program ran {:?} in the box (box total {:?})",
        out.timings.program_runtime(),
        out.timings.total
    );
}
