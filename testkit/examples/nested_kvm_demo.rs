// SPDX-License-Identifier: Apache-2.0
//! The nested-KVM box, end to end (run by `scripts/run`).
//!
//! 1. builds the `kvm_probe` example as a static binary,
//! 2. runs it on this machine's own KVM (software nested virtualization),
//! 3. boots the stock Debian cloud kernel under QEMU TCG with an emulated AMD
//!    SVM CPU, loads `kvm_amd` there and runs the same probe with a real
//!    `/dev/kvm`,
//! 4. prints a summary with timings.
//!
//! Usage: `cargo run --release -p sheaf-testkit --example nested_kvm_demo [-- --exits N]`

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use sheaf_testkit::nested::{BoxEvent, BoxPhase, NestedBox};
use sheaf_testkit::{kernel::HostKernel, qemu, static_build};

fn spinner(msg: &str) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner:.cyan} [{elapsed:>3}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    pb.enable_steady_tick(Duration::from_millis(100));
    pb.set_message(msg.to_string());
    if pb.is_hidden() {
        println!("... {msg}");
    }
    pb
}

fn step(pb: &ProgressBar, msg: String) {
    if pb.is_hidden() {
        println!("... {msg}");
    }
    pb.set_message(msg);
}

/// `exit_us=<x>` from the probe's last line.
fn exit_us(output: &str) -> Option<f64> {
    output
        .split_whitespace()
        .find_map(|w| w.strip_prefix("exit_us="))
        .and_then(|v| v.parse().ok())
}

fn main() -> anyhow::Result<()> {
    sheaf_testkit::init_tracing();
    let exits: u16 = match std::env::args().skip(1).collect::<Vec<_>>().as_slice() {
        [] => 1000,
        [flag, n] if flag == "--exits" => n.parse().context("--exits N (1..=65535)")?,
        _ => anyhow::bail!("usage: nested_kvm_demo [--exits N]"),
    };
    let exits_arg = exits.to_string();

    println!("sheaf nested-KVM box demo");
    println!("=========================");
    let qemu = qemu::qemu_binary().context("the box needs QEMU")?;
    let kernel = HostKernel::find().context("the box boots the Debian cloud kernel")?;
    println!("QEMU:   {}", qemu.display());
    println!("kernel: {} ({})", kernel.version, kernel.vmlinuz.display());
    println!();

    let t = Instant::now();
    let pb = spinner("building kvm_probe as a static binary (first run compiles for a minute)");
    let probe = static_build::build_example("sheaf-testkit", "kvm_probe")?;
    pb.finish_and_clear();
    println!(
        "built {} in {:.1} s",
        probe.display(),
        t.elapsed().as_secs_f64()
    );

    let host_line = if std::path::Path::new("/dev/kvm").exists() {
        let out = Command::new(&probe)
            .args(["--exits", &exits_arg])
            .output()
            .context("run kvm_probe on the host")?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Some(text)
        } else {
            None
        }
    } else {
        None
    };

    let pb = spinner("starting QEMU (TCG, -cpu qemu64,+svm,+npt)");
    let mut on_event = |ev: BoxEvent<'_>| {
        if let BoxEvent::Phase { phase, at } = ev {
            let at = at.as_secs_f64();
            let msg = match phase {
                BoxPhase::Started => "booting the Debian kernel as L1 under TCG".to_string(),
                BoxPhase::L1Init => format!("[{at:5.1} s] L1 is up; waiting for /dev/kvm"),
                BoxPhase::KvmReady => format!("[{at:5.1} s] kvm_amd loaded, /dev/kvm ready"),
                BoxPhase::ProgramStarted => format!("[{at:5.1} s] running kvm_probe inside L1"),
                BoxPhase::ProgramExited(s) => {
                    format!("[{at:5.1} s] kvm_probe exited ({s}); powering off")
                }
                _ => return,
            };
            step(&pb, msg);
        }
    };
    let out = NestedBox::new()
        .memory_mib(1024)
        .timeout(Duration::from_secs(300))
        .run_with_events(&probe, ["--exits", &exits_arg], &mut on_event)?;
    pb.finish_and_clear();

    let tm = out.timings;
    println!();
    println!(
        "kvm_probe inside the box (exit status {}):",
        out.exit_status
    );
    for line in out.output.lines() {
        println!("    {line}");
    }
    println!();
    println!("timings (from QEMU start):");
    let opt =
        |d: Option<Duration>| d.map_or("-".to_string(), |d| format!("{:5.1} s", d.as_secs_f64()));
    println!("    L1 init + modules  {}", opt(tm.l1_init));
    println!("    /dev/kvm ready     {}", opt(tm.kvm_ready));
    println!(
        "    program start      {:5.1} s",
        tm.program_start.as_secs_f64()
    );
    println!(
        "    program ran        {:5.1} s",
        tm.program_runtime().as_secs_f64()
    );
    println!("    QEMU exited        {:5.1} s", tm.total.as_secs_f64());
    println!();
    match (host_line.as_deref().and_then(exit_us), exit_us(&out.output)) {
        (Some(host), Some(nested)) => println!(
            "VM exit cost: {host:.1} µs on this machine's KVM, {nested:.1} µs on the box's \
             (emulated SVM, {:.0}x)",
            nested / host
        ),
        (None, Some(nested)) => println!("VM exit cost in the box: {nested:.1} µs"),
        _ => {}
    }
    anyhow::ensure!(out.success(), "kvm_probe failed in the box");
    println!("OK: a real /dev/kvm works inside the box; stock Linux guests can be tested there.");
    Ok(())
}
