// SPDX-License-Identifier: Apache-2.0
//! The nested-KVM box: a static KVM program runs inside L1 with a real
//! `/dev/kvm`, and files travel in and out.

#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use sheaf_testkit::nested::NestedBox;
use sheaf_testkit::static_build;

/// The probe on the host's own KVM (no box, but a static build).
#[test]
fn kvm_probe_on_host_kvm() {
    if sheaf_testkit::skip_slow("kvm_probe_on_host_kvm") {
        return;
    }
    if !std::path::Path::new("/dev/kvm").exists() {
        eprintln!("no /dev/kvm on this host; skipping");
        return;
    }
    let probe = static_build::build_example("sheaf-testkit", "kvm_probe").unwrap();
    let out = Command::new(&probe)
        .args(["--exits", "100"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("KVM_PROBE: OK exits=104"), "{stdout}");
}

#[test]
fn kvm_probe_runs_in_the_nested_box() {
    if sheaf_testkit::skip_slow("kvm_probe_runs_in_the_nested_box") {
        return;
    }
    let probe = static_build::build_example("sheaf-testkit", "kvm_probe").unwrap();
    let out = NestedBox::new()
        .memory_mib(1024)
        .timeout(Duration::from_secs(240))
        .run(&probe, ["--exits", "200"])
        .unwrap();
    assert!(out.success(), "status {}: {}", out.exit_status, out.output);
    assert!(
        out.output.contains("KVM_PROBE: serial=\"K\\n\""),
        "{}",
        out.output
    );
    assert!(
        out.output.contains("KVM_PROBE: OK exits=204"),
        "{}",
        out.output
    );
    let t = out.timings;
    eprintln!(
        "nested box: L1 init {:?}, /dev/kvm {:?}, program start {:?} (L1 uptime {:?} s), \
         program ran {:?}, total {:?}",
        t.l1_init,
        t.kvm_ready,
        t.program_start,
        t.l1_uptime_at_start,
        t.program_runtime(),
        t.total
    );
    eprintln!("{}", out.output.trim_end());
    assert!(t.kvm_ready.is_some());
    assert!(t.program_start >= t.kvm_ready.unwrap_or_default());
}

/// Files in, files out, environment and exit status, with busybox (static)
/// as the program.
#[test]
fn files_travel_in_and_out_of_the_box() {
    if sheaf_testkit::skip_slow("files_travel_in_and_out_of_the_box") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let script = "set -e\n\
        test -c /dev/kvm\n\
        cat input/hello.txt > $SHEAF_OUT/copy.txt\n\
        echo \"$GREETING\" >> $SHEAF_OUT/copy.txt\n\
        printf 'written-in-L1' | dd of=disk.img bs=1 seek=4096 conv=notrunc 2>/dev/null\n\
        echo to-stdout; echo to-stderr >&2\n\
        exit 3\n";
    let out = NestedBox::new()
        .memory_mib(512)
        .timeout(Duration::from_secs(240))
        .file("disk.img", &disk)
        .file_bytes("input/hello.txt", "hello from the host\n", 0o644)
        .file_bytes("script.sh", script, 0o755)
        .collect("disk.img")
        .collect("not-there")
        .env("GREETING", "it's me")
        .require_kvm(true)
        .run("/bin/busybox", ["sh", "script.sh"])
        .unwrap();
    assert_eq!(out.exit_status, 3, "{}\n{}", out.output, out.console);
    assert!(out.output.contains("to-stdout\n"), "{}", out.output);
    assert!(out.output.contains("to-stderr\n"), "{}", out.output);
    assert_eq!(
        String::from_utf8(out.read_file("out/copy.txt").unwrap()).unwrap(),
        "hello from the host\nit's me\n"
    );
    let disk_out = out.read_file("disk.img").unwrap();
    assert_eq!(disk_out.len(), 1 << 20);
    assert_eq!(&disk_out[4096..4096 + 13], b"written-in-L1");
    assert!(out.file("not-there").is_none());
    eprintln!("box total {:?}", out.timings.total);
}

/// The reference path: the host's QEMU with `-accel kvm` boots the stock
/// guest image as L2 inside the box, and the L2 guest's disk write comes back.
#[test]
fn host_qemu_boots_the_guest_image_with_kvm_in_the_box() {
    if sheaf_testkit::skip_slow("host_qemu_boots_the_guest_image_with_kvm_in_the_box") {
        return;
    }
    let image = sheaf_testkit::guest::GuestImage::build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk.img");
    let marker = format!("l2-{}", std::process::id());
    sheaf_testkit::guest::create_disk(&disk, 8 << 20, &marker).unwrap();
    let script = format!(
        "start=$(cut -d' ' -f1 /proc/uptime)\n\
         ./qemu/qemu-system-x86_64 -accel kvm -cpu host -M pc -m 256 -nodefaults \
         -no-user-config -display none -serial stdio -no-reboot -nic none \
         -kernel bzImage -initrd initramfs.cpio.gz -append '{}' \
         -drive file=disk.img,format=raw,if=none,id=d0 -device virtio-blk-pci,drive=d0 || exit $?\n\
         echo \"L2 run: $start -> $(cut -d' ' -f1 /proc/uptime)\"\n",
        sheaf_testkit::guest::DEFAULT_CMDLINE
    );
    let out = NestedBox::new()
        .host_qemu()
        .file("bzImage", &image.kernel)
        .file("initramfs.cpio.gz", &image.initramfs)
        .file("disk.img", &disk)
        .file_bytes("l2.sh", script, 0o755)
        .collect("disk.img")
        .timeout(Duration::from_secs(480))
        .run("/bin/busybox", ["sh", "l2.sh"])
        .unwrap();
    assert_eq!(out.exit_status, 0, "{}", out.output);
    let report = sheaf_testkit::guest::parse_console(&out.output);
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
        sheaf_testkit::guest::read_reply(&back).unwrap().as_deref(),
        Some(marker.as_str())
    );
    let l2 = out
        .output
        .lines()
        .find(|l| l.starts_with("L2 run:"))
        .unwrap_or("");
    eprintln!(
        "QEMU -accel kvm in the box: {l2} (L1 uptime, s); program started {:?} after QEMU, ran {:?}",
        out.timings.program_start,
        out.timings.program_runtime()
    );
}
