// SPDX-License-Identifier: Apache-2.0
//! `sheaf-guest-image`: builds the guest kernel + initramfs into the cache
//! and prints their paths (called by `scripts/guest-image`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use sheaf_testkit::guest::{self, GuestImage};
use sheaf_testkit::qemu::{Machine, Qemu};

/// Build the sheaf guest image (Debian cloud kernel + busybox initramfs that
/// loads the virtio modules and runs a test script) into $SHEAF_CACHE/guest/.
#[derive(Debug, Parser)]
#[command(name = "sheaf-guest-image")]
struct Args {
    /// Test script to run in the guest instead of the default marker/reply test.
    #[arg(long, value_name = "FILE")]
    script: Option<PathBuf>,
    /// Extra kernel module to load after the virtio ones (repeatable).
    #[arg(long, value_name = "NAME")]
    module: Vec<String>,
    /// Also extract a vmlinux ELF (for PVH/ELF boot) next to the bzImage.
    #[arg(long)]
    vmlinux: bool,
    /// Boot the image under QEMU TCG with a scratch disk and check the reply
    /// (default script only).
    #[arg(long)]
    check: bool,
    /// Build the Debian 12 cloud disk instead (mmdebstrap: GPT + ext4 root
    /// with its own kernel, cloud-init, openssh-server; raw and qcow2).
    #[arg(long)]
    debian: bool,
    /// Cache directory (default: $SHEAF_CACHE or ~/.cache/sheaf).
    #[arg(long, value_name = "DIR")]
    cache: Option<PathBuf>,
}

fn main() -> ExitCode {
    sheaf_testkit::init_tracing();
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("guest-image: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    if args.debian {
        return debian(&args);
    }
    let mut b = GuestImage::builder();
    if let Some(s) = &args.script {
        b = b.script_file(s)?;
    }
    for m in &args.module {
        b = b.module(m);
    }
    if let Some(c) = &args.cache {
        b = b.cache_dir(c);
    }
    let image = b.build()?;
    println!("kernel={}", image.kernel.display());
    println!("initramfs={}", image.initramfs.display());
    println!("kernel_version={}", image.kernel_version);
    if args.vmlinux {
        println!("vmlinux={}", image.vmlinux()?.display());
    }
    println!("cmdline={}", guest::DEFAULT_CMDLINE);
    if args.check {
        anyhow::ensure!(args.script.is_none(), "--check needs the default script");
        let dir = tempfile::tempdir()?;
        let disk = dir.path().join("disk.img");
        let marker = format!("check-{}", std::process::id());
        guest::create_disk(&disk, 16 << 20, &marker)?;
        let out = Qemu::tcg()
            .machine(Machine::Pc)
            .kernel(&image.kernel)
            .initrd(&image.initramfs)
            .append(guest::DEFAULT_CMDLINE)
            .disk(&disk)
            .timeout(Duration::from_secs(120))
            .run()?;
        let report = guest::parse_console(&out.console_text());
        let reply = guest::read_reply(&disk)?;
        anyhow::ensure!(
            report.ok && reply.as_deref() == Some(marker.as_str()),
            "guest check failed: {report:?}, reply {reply:?}\n{}",
            out.console_text()
        );
        println!(
            "check=ok ({:.1} s under QEMU TCG)",
            out.elapsed.as_secs_f64()
        );
    }
    Ok(())
}

fn debian(args: &Args) -> anyhow::Result<()> {
    use sheaf_testkit::debian::DebianImage;
    anyhow::ensure!(
        args.script.is_none() && args.module.is_empty() && !args.vmlinux && !args.check,
        "--debian takes only --cache"
    );
    let mut b = DebianImage::builder();
    if let Some(c) = &args.cache {
        b = b.cache_dir(c);
    }
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_message("building the Debian image (mmdebstrap, a few minutes the first time)");
    bar.enable_steady_tick(Duration::from_millis(200));
    let image = b.build();
    bar.finish_and_clear();
    let image = image?;
    println!("raw={}", image.raw.display());
    println!("qcow2={}", image.qcow2.display());
    for (k, v) in &image.manifest {
        println!("{k}={v}");
    }
    Ok(())
}
