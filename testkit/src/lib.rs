// SPDX-License-Identifier: Apache-2.0
//! Test infrastructure for sheaf: guest images and the nested-KVM box for
//! booting stock Linux guests on machines whose own KVM cannot.
//!
//! The development and CI machines are VMs with software nested
//! virtualization (see `docs/testing.md`): their `/dev/kvm` runs small guests
//! but not a stock Linux kernel. This crate gives tests two tools:
//!
//! - [`guest::GuestImage`]: the host's Debian cloud kernel plus a busybox
//!   initramfs whose `/init` loads the virtio modules and runs a test script
//!   (by default: read a marker from `/dev/vda`, write a reply, power off).
//!   Built once into `$SHEAF_CACHE` and reused while its inputs are unchanged.
//! - [`nested::NestedBox`]: boots the same kernel under QEMU TCG with an
//!   emulated AMD SVM CPU, loads `kvm_amd` there, and runs one of our
//!   statically linked programs (see [`static_build`]) with a real
//!   `/dev/kvm`, returning its exit status, output and the files it wrote.
//!
//! ```no_run
//! use std::time::Duration;
//! use sheaf_testkit::{guest::GuestImage, nested::NestedBox, static_build};
//!
//! # fn main() -> sheaf_testkit::Result<()> {
//! if sheaf_testkit::skip_slow("my_linux_boot_test") {
//!     return Ok(());
//! }
//! let image = GuestImage::build()?;
//! let program = static_build::build_example("sheaf-vmm", "boot_linux")?;
//! let out = NestedBox::new()
//!     .file("bzImage", &image.kernel)
//!     .file("initramfs.cpio.gz", &image.initramfs)
//!     .file("disk.img", "/tmp/disk.img")
//!     .collect("disk.img")
//!     .timeout(Duration::from_secs(240))
//!     .run(&program, ["--kernel", "bzImage"])?;
//! assert_eq!(out.exit_status, 0, "{}", out.output);
//! let disk = out.read_file("disk.img")?;
//! # let _ = disk;
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

use std::path::PathBuf;

pub mod cpio;
pub mod debian;
mod error;
pub mod guest;
mod image;
pub mod kernel;
pub mod nested;
pub mod netns;
pub mod qemu;
pub mod static_build;

pub use error::{Result, TestkitError};

/// Environment variable naming the cache directory for guest images and
/// other large build products.
pub const CACHE_ENV: &str = "SHEAF_CACHE";

/// Environment variable that, set to `1`, makes slow tests skip themselves.
pub const QUICK_ENV: &str = "SHEAF_TEST_QUICK";

/// The cache directory: `$SHEAF_CACHE`, else `~/.cache/sheaf`, else
/// `<tmp>/sheaf-cache`. Never inside the git tree.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(CACHE_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    match std::env::var_os("HOME").filter(|h| !h.is_empty()) {
        Some(home) => PathBuf::from(home).join(".cache").join("sheaf"),
        None => std::env::temp_dir().join("sheaf-cache"),
    }
}

/// Whether slow tests (QEMU boots, the nested-KVM box) should be skipped:
/// true when `SHEAF_TEST_QUICK=1`, after printing a message naming `test`.
///
/// `scripts/test` (and so CI) runs them; set `SHEAF_TEST_QUICK=1` locally to
/// iterate faster.
pub fn skip_slow(test: &str) -> bool {
    let quick = std::env::var(QUICK_ENV).is_ok_and(|v| v == "1");
    if quick {
        eprintln!(
            "skipping {test}: {QUICK_ENV}=1 (slow test: QEMU guest or static build; \
             scripts/test and CI run it)"
        );
    }
    quick
}

/// Finds `tool` on `PATH`.
pub fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(tool))
        .find(|p| p.is_file())
}

/// The last `n` lines of `text`.
pub(crate) fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Sets up a `tracing` subscriber that honours `RUST_LOG` (for binaries,
/// examples and tests; ignores a second call).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_last_lines() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
        assert_eq!(tail("a", 5), "a");
    }

    #[test]
    fn which_finds_sh() {
        assert!(which("sh").is_some());
        assert!(which("no-such-tool-sheaf").is_none());
    }
}
