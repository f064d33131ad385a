// SPDX-License-Identifier: Apache-2.0
//! Builds the probe guest (`guest/probe.rs` and its modules) into a freestanding ELF with
//! the host's x86_64-unknown-linux-gnu target: no std, no libc, static,
//! linked at 2 MiB by `guest/probe.ld`. Its path is exported to the crate
//! as `SHEAF_PROBE_ELF`.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let src = manifest.join("guest/probe.rs");
    let ld = manifest.join("guest/probe.ld");
    println!("cargo:rerun-if-changed={}", src.display());
    println!(
        "cargo:rerun-if-changed={}",
        manifest.join("guest/net.rs").display()
    );
    println!("cargo:rerun-if-changed={}", ld.display());
    let elf = out.join("sheaf-probe.elf");
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let status = Command::new(rustc)
        // Do not inherit flags meant for the host crates (coverage, sanitizers).
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        .args([
            "--edition",
            "2024",
            "--crate-type",
            "bin",
            "--crate-name",
            "sheaf_probe",
        ])
        .args(["--target", "x86_64-unknown-linux-gnu"])
        .args([
            "-C",
            "panic=abort",
            "-C",
            "opt-level=s",
            "-C",
            "debuginfo=0",
        ])
        .args(["-C", "relocation-model=static", "-C", "code-model=small"])
        .args(["-C", "target-cpu=x86-64", "-C", "force-frame-pointers=no"])
        // The host KVM here cannot emulate SSE on MMIO/PIO paths, and the
        // probe needs no floating point: keep the code integer-only.
        .args(["-C", "target-feature=-sse,-sse2,-mmx,-avx"])
        .args([
            "-C",
            "link-arg=-nostdlib",
            "-C",
            "link-arg=-static",
            "-C",
            "link-arg=-nostartfiles",
        ])
        .args([
            "-C",
            "link-arg=-no-pie",
            "-C",
            "link-arg=-Wl,--build-id=none",
        ])
        .arg("-C")
        .arg(format!("link-arg=-Wl,-T,{}", ld.display()))
        .arg("-o")
        .arg(&elf)
        .arg(&src)
        .status()
        .expect("cannot run rustc for the probe guest");
    assert!(status.success(), "building the probe guest failed");
    println!("cargo:rustc-env=SHEAF_PROBE_ELF={}", elf.display());
}
