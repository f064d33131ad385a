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

/// The box the Debian tests boot in: the cached image as L1's `/dev/vdc`
/// (never written), a 768 MiB 2-vCPU guest for `run_vm`.
fn debian_box(image: &sheaf_testkit::debian::DebianImage) -> NestedBox {
    NestedBox::new()
        .memory_mib(2048)
        .disk(&image.raw)
        .env("MEM_MIB", "768")
        .env("VCPUS", "2")
        .env("WAIT_S", "1200")
        .env("PROGRESS_S", "60")
        .timeout(Duration::from_secs(1500))
}

/// The Debian 12 cloud disk (built from packages by `scripts/guest-image
/// debian`) boots from its own disk on sheaf-vmm: disk boot reads the
/// kernel and initramfs out of the image's ext4 root, the initramfs finds
/// the root by the UUID sheaf-vmm put on the command line, systemd comes
/// up and runs one command from the kernel command line, which prints what
/// is mounted at / and powers the VM off.
#[test]
fn debian_cloud_image_boots_from_its_own_disk_to_systemd() {
    if sheaf_testkit::skip_slow("debian_boot") {
        return;
    }
    sheaf_testkit::init_tracing();
    let image = sheaf_testkit::debian::DebianImage::build().unwrap();
    let vmm = static_build::build_example("sheaf-vmm", "run_vm").unwrap();
    // systemd-run-generator: run one command once the system is up, then
    // power off (the kernel keeps the double-quoted value in one piece).
    let cmdline = "console=ttyS0 panic=-1 systemd.show_status=1 \
        systemd.run=\"/bin/sh -c 'echo SHEAF-DEBIAN-UP >/dev/console; \
        findmnt -no SOURCE,FSTYPE / >/dev/console; readlink /proc/1/exe >/dev/console'\" \
        systemd.run_success_action=poweroff systemd.run_failure_action=poweroff";
    let started = std::time::Instant::now();
    let out = debian_box(&image)
        .run(&vmm, ["--from-disk", "-", cmdline, "/dev/vdc"])
        .unwrap();
    eprintln!("---- program output ----\n{}\n---- end ----", out.output);
    assert!(
        out.output.contains("found the kernel on the boot disk")
            || out.output.contains(&image.kernel_version),
        "{}",
        out.output
    );
    // No `$` in the command: systemd would expand it as a variable.
    // The marker on a line of its own (the kernel also prints it inside its
    // command line), then what the command printed.
    let all: Vec<&str> = out.output.lines().map(str::trim).collect();
    let at = all
        .iter()
        .position(|l| *l == "SHEAF-DEBIAN-UP")
        .unwrap_or_else(|| panic!("systemd never ran the command:\n{}", out.output));
    let lines = &all[at + 1..(at + 6).min(all.len())];
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("/dev/vda1") && l.ends_with("ext4")),
        "root is not the image's ext4 on /dev/vda1: {lines:?}"
    );
    assert!(
        lines.contains(&"/usr/lib/systemd/systemd"),
        "PID 1 is not systemd: {lines:?}"
    );
    assert!(
        out.output.contains("sheaf-vmm: guest exited: Shutdown"),
        "sheaf-vmm did not report a clean shutdown:\n{}",
        out.output
    );
    assert_eq!(out.exit_status, 0, "{}", out.output);
    eprintln!(
        "debian_boot: {} booted and powered off; program ran {:?} in the box (box total {:?}, test {:?})",
        image.kernel_version,
        out.timings.program_runtime(),
        out.timings.total,
        started.elapsed()
    );
}

/// The Harvester user's first action, on sheaf-vmm: the Debian cloud disk
/// boots with a NoCloud seed (a FAT disk labelled `cidata`, made with
/// `mkfs.fat` + `mcopy` as KubeVirt's `cloudInitNoCloud` would), cloud-init
/// creates the user with the SSH key from user-data, sets the hostname from
/// meta-data, generates the SSH host keys, runs `runcmd` and powers off.
#[test]
fn debian_cloud_image_runs_cloud_init_from_a_nocloud_seed() {
    if sheaf_testkit::skip_slow("debian_cloud_init") {
        return;
    }
    sheaf_testkit::init_tracing();
    let image = sheaf_testkit::debian::DebianImage::build().unwrap();
    let vmm = static_build::build_example("sheaf-vmm", "run_vm").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGJ4c2hlYWZ0ZXN0a2V5MDEyMzQ1Njc4OWFiY2RlZg sheaf@test";
    let user = format!(
        "#cloud-config\n\
         users:\n  - name: sheaf\n    shell: /bin/bash\n    sudo: ALL=(ALL) NOPASSWD:ALL\n    ssh_authorized_keys:\n      - {key}\n\
         runcmd:\n  - [sh, -c, 'echo SHEAF-CI-BEGIN > /dev/console; hostname > /dev/console; \
         cat /home/sheaf/.ssh/authorized_keys > /dev/console; ls /etc/ssh/ssh_host_ed25519_key.pub > /dev/console; \
         echo SHEAF-CI-END > /dev/console']\n\
         power_state:\n  mode: poweroff\n  condition: true\n"
    );
    let seed = dir.path().join("cidata.img");
    sheaf_testkit::debian::nocloud_seed(
        &seed,
        &[
            (
                "meta-data",
                "instance-id: iid-sheaf-ci-1\nlocal-hostname: sheaf-guest\n",
            ),
            ("user-data", &user),
        ],
    )
    .unwrap();
    let out = debian_box(&image)
        .file("cidata.img", &seed)
        .run(
            &vmm,
            [
                "--from-disk",
                "-",
                "console=ttyS0 panic=-1",
                "/dev/vdc",
                "cidata.img",
            ],
        )
        .unwrap();
    eprintln!("---- program output ----\n{}\n---- end ----", out.output);
    let all: Vec<&str> = out.output.lines().map(str::trim).collect();
    let begin = all
        .iter()
        .position(|l| *l == "SHEAF-CI-BEGIN")
        .unwrap_or_else(|| panic!("cloud-init never ran runcmd:\n{}", out.output));
    let end = all[begin..]
        .iter()
        .position(|l| *l == "SHEAF-CI-END")
        .map(|e| begin + e)
        .unwrap_or_else(|| panic!("runcmd did not finish:\n{}", out.output));
    let lines = &all[begin + 1..end];
    assert!(lines.contains(&"sheaf-guest"), "hostname: {lines:?}");
    assert!(lines.contains(&key), "authorized_keys: {lines:?}");
    assert!(
        lines.contains(&"/etc/ssh/ssh_host_ed25519_key.pub"),
        "host keys: {lines:?}"
    );
    assert!(
        out.output.contains("sheaf-vmm: guest exited: Shutdown"),
        "cloud-init's power_state did not power off cleanly:\n{}",
        out.output
    );
    assert_eq!(out.exit_status, 0, "{}", out.output);
    eprintln!(
        "debian_cloud_init: program ran {:?} in the box (box total {:?})",
        out.timings.program_runtime(),
        out.timings.total
    );
}
