// SPDX-License-Identifier: Apache-2.0
//! Boot time of the Debian 12 cloud disk, sheaf-vmm vs QEMU, same box, same
//! run: `cargo run --release -p sheaf-vmm --example debian_boot_bench -- [RUNS]`.
//!
//! Both boot the image built by `scripts/guest-image debian` in the
//! nested-KVM box (this machine's KVM cannot run a stock kernel), 2 vCPUs,
//! 768 MiB, the image as a virtio-blk disk, and the same kernel command
//! line: systemd runs one command from it (prints a marker) and powers
//! off. sheaf-vmm finds the kernel inside the disk (disk boot); QEMU
//! (`-M pc -accel kvm`, SeaBIOS, direct kernel boot) gets the same kernel
//! and initramfs, extracted from the image by sheaf's disk-boot reader, and
//! the same `root=UUID=`. Printed per VMM: L1 seconds from process start to
//! the systemd marker and to process exit. These are nested-KVM-on-TCG
//! figures: compare the two columns, not the absolute values.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use sheaf_testkit::debian::DebianImage;
use sheaf_testkit::nested::NestedBox;
use sheaf_testkit::static_build;
use sheaf_vmm::FileBackend;
use sheaf_vmm::boot::disk;
use sheaf_vmm::devices::virtio::block::{AsyncBlockBackend, SyncAdapter};

const SCRIPT: &str = r#"
cmd="$(cat cmdline.txt)"
up() { cut -d' ' -f1 /proc/uptime; }
stamp() {
  # $1 = label; reads the VMM's output, prints when the marker shows up.
  while IFS= read -r l; do
    case "$l" in SHEAF-DEBIAN-UP*) echo "BENCH $1 marker $(up)";; esac
  done
}
for i in $(seq 1 "$RUNS"); do
  t=$(up); echo "BENCH sheaf start $t"
  MEM_MIB=768 VCPUS=2 ./run_vm --from-disk - "$cmd" /dev/vdc 2>&1 | stamp sheaf
  echo "BENCH sheaf exit $(up)"
  t=$(up); echo "BENCH qemu start $t"
  ./qemu/qemu-system-x86_64 -accel kvm -cpu host -M pc -m 768 -smp 2 -nodefaults \
    -no-user-config -display none -serial stdio -no-reboot -nic none \
    -kernel kernel -initrd initrd -append "root=UUID=$(cat uuid.txt) rw $cmd" \
    -drive file=/dev/vdc,format=raw,if=none,id=d0,cache=none -device virtio-blk-pci,drive=d0 \
    2>&1 | stamp qemu
  echo "BENCH qemu exit $(up)"
done
"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let runs: u32 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2);
    let image = DebianImage::build()?;
    let backend: Arc<dyn AsyncBlockBackend> = Arc::new(SyncAdapter::new(Arc::new(
        FileBackend::open(&image.raw, true, None)?,
    )));
    let files = disk::find(backend, 0, None)?;
    let dir = tempfile::tempdir()?;
    let kernel = dir.path().join("kernel");
    let initrd = dir.path().join("initrd");
    std::fs::write(&kernel, &files.kernel)?;
    std::fs::write(&initrd, files.initramfs.as_deref().unwrap_or_default())?;
    let vmm = static_build::build_example("sheaf-vmm", "run_vm")?;
    let cmdline = "console=ttyS0 panic=-1 quiet systemd.run=\"/bin/sh -c 'echo SHEAF-DEBIAN-UP >/dev/console'\" \
        systemd.run_success_action=poweroff systemd.run_failure_action=poweroff";
    eprintln!(
        "booting {} ({}) {runs} time(s) on each VMM in the nested-KVM box...",
        image.kernel_version, files.kernel_path
    );
    let out = NestedBox::new()
        .host_qemu()
        .memory_mib(3072)
        .disk(&image.raw)
        .file("run_vm", &vmm)
        .file("kernel", &kernel)
        .file("initrd", &initrd)
        .file_bytes("cmdline.txt", cmdline, 0o644)
        .file_bytes("uuid.txt", files.root_uuid.clone(), 0o644)
        .file_bytes("bench.sh", SCRIPT, 0o755)
        .env("RUNS", &runs.to_string())
        .timeout(Duration::from_secs(600 + 600 * u64::from(runs)))
        .run("/bin/busybox", ["sh", "bench.sh"])?;
    if out.exit_status != 0 {
        return Err(format!("bench script failed:\n{}", out.output).into());
    }
    // (vmm, run) -> (start, marker, exit) in L1 seconds.
    let mut rows: Vec<(String, [Option<f64>; 3])> = Vec::new();
    for l in out.output.lines().filter_map(|l| l.strip_prefix("BENCH ")) {
        let w: Vec<&str> = l.split_whitespace().collect();
        let [vmm, what, t] = w[..] else { continue };
        let t: f64 = t.parse()?;
        if what == "start" {
            rows.push((vmm.to_string(), [Some(t), None, None]));
        } else if let Some((_, r)) = rows.iter_mut().rev().find(|(v, _)| v == vmm) {
            r[if what == "marker" { 1 } else { 2 }] = Some(t);
        }
    }
    println!("| VMM | run | start → systemd ran the command (s) | start → exit (s) |");
    println!("|---|---|---|---|");
    let mut n = std::collections::HashMap::<String, u32>::new();
    for (vmm, [s, m, e]) in &rows {
        let i = n.entry(vmm.clone()).or_default();
        *i += 1;
        let d = |x: &Option<f64>| match (s, x) {
            (Some(s), Some(x)) => format!("{:.1}", x - s),
            _ => "—".into(),
        };
        println!("| {vmm} | {i} | {} | {} |", d(m), d(e));
    }
    Ok(())
}
