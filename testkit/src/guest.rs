// SPDX-License-Identifier: Apache-2.0
//! The guest image: the host's Debian cloud kernel plus a busybox initramfs
//! that loads the virtio modules and runs a test script.
//!
//! `/init` mounts proc, sysfs and devtmpfs, loads [`GUEST_MODULES`] in order
//! (skipping any built into the kernel), runs `/etc/sheaf/test.sh`, prints
//! `SHEAF-GUEST: script-exit=<n>` and powers off (`poweroff -f`; add
//! `sheaf.exit=reboot` to the command line to reboot instead).
//!
//! The [default script](DEFAULT_SCRIPT) reads `SHEAF-MARKER:<text>` at
//! offset [`MARKER_OFFSET`] of `/dev/vda`, writes `SHEAF-REPLY:<text>` at
//! [`REPLY_OFFSET`], syncs and prints `SHEAF-GUEST: marker=<text>` and
//! `SHEAF-GUEST: OK`. Replace it with [`GuestImageBuilder::script`]; scripts
//! can source `/etc/sheaf/lib.sh` for `sheaf_wait_block DEV` and
//! `sheaf_uptime`.
//!
//! ```no_run
//! use sheaf_testkit::guest::{self, GuestImage};
//!
//! # fn main() -> sheaf_testkit::Result<()> {
//! let image = GuestImage::build()?;               // cached after the first call
//! guest::create_disk("/tmp/disk.img", 64 << 20, "hello")?;
//! // ... boot image.kernel + image.initramfs with /tmp/disk.img as virtio-blk ...
//! assert_eq!(guest::read_reply("/tmp/disk.img")?.as_deref(), Some("hello"));
//! # Ok(())
//! # }
//! ```

use std::fs::{self, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::cpio::Initramfs;
use crate::error::{Result, io_err};
use crate::image::{assemble, build_cached};
use crate::kernel::{HostKernel, extract_vmlinux_file};

pub use crate::image::BUSYBOX_ENV;

/// Modules `/init` loads, in this order.
pub const GUEST_MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "virtio_mmio",
    "virtio_blk",
];

/// The default test script (`/etc/sheaf/test.sh`).
pub const DEFAULT_SCRIPT: &str = include_str!("scripts/guest-test.sh");

/// Helpers scripts can source: `. /etc/sheaf/lib.sh`.
pub const SCRIPT_LIB: &str = include_str!("scripts/lib.sh");

const GUEST_MAIN: &str = include_str!("scripts/guest-main.sh");

/// Prefix of every line the guest's harness prints.
pub const CONSOLE_PREFIX: &str = "SHEAF-GUEST:";

/// Offset of the host's marker on `/dev/vda`.
pub const MARKER_OFFSET: u64 = 0;

/// Offset of the guest's reply on `/dev/vda`.
pub const REPLY_OFFSET: u64 = 4096;

/// A kernel command line that suits the image on QEMU or sheaf-vmm.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 quiet panic=-1";

/// A built guest image in the cache.
#[derive(Debug, Clone)]
pub struct GuestImage {
    /// The cache directory holding this image's initramfs.
    pub dir: PathBuf,
    /// The kernel (bzImage), copied into the cache (`$SHEAF_CACHE/kernel/…`).
    pub kernel: PathBuf,
    /// The gzip-compressed cpio initramfs.
    pub initramfs: PathBuf,
    /// The kernel release, e.g. `6.1.0-57-cloud-amd64`.
    pub kernel_version: String,
}

impl GuestImage {
    /// A builder for an image with a custom script, modules or files.
    pub fn builder() -> GuestImageBuilder {
        GuestImageBuilder::default()
    }

    /// Builds (or reuses) the default image.
    pub fn build() -> Result<Self> {
        Self::builder().build()
    }

    /// The vmlinux ELF extracted from the bzImage (for ELF/PVH boot),
    /// extracted on first use and cached next to the cached bzImage.
    pub fn vmlinux(&self) -> Result<PathBuf> {
        let path = self
            .kernel
            .parent()
            .map_or_else(|| self.dir.join("vmlinux"), |d| d.join("vmlinux"));
        if !path.is_file() {
            extract_vmlinux_file(&self.kernel, &path)?;
        }
        Ok(path)
    }
}

/// Builder for [`GuestImage`].
#[derive(Debug, Clone, Default)]
pub struct GuestImageBuilder {
    script: Option<Vec<u8>>,
    extra_modules: Vec<String>,
    files: Initramfs,
    kernel: Option<HostKernel>,
    cache: Option<PathBuf>,
}

impl GuestImageBuilder {
    /// Replaces the test script (run with busybox `sh`).
    pub fn script(mut self, script: impl Into<Vec<u8>>) -> Self {
        self.script = Some(script.into());
        self
    }

    /// Replaces the test script with the contents of a file.
    pub fn script_file(self, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let script = fs::read(path).map_err(io_err("read script", path))?;
        Ok(self.script(script))
    }

    /// Loads one more module after [`GUEST_MODULES`] (e.g. `virtio_net`).
    pub fn module(mut self, name: &str) -> Self {
        self.extra_modules.push(name.into());
        self
    }

    /// Adds a file to the initramfs (`path` relative to `/`).
    pub fn file(mut self, path: &str, data: impl Into<Vec<u8>>, mode: u32) -> Self {
        self.files.file(path, data.into(), mode);
        self
    }

    /// Uses this kernel instead of [`HostKernel::find`].
    pub fn kernel(mut self, kernel: HostKernel) -> Self {
        self.kernel = Some(kernel);
        self
    }

    /// Uses this cache directory instead of [`crate::cache_dir`].
    pub fn cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache = Some(dir.into());
        self
    }

    /// Builds the image, or returns the cached one when nothing changed.
    pub fn build(self) -> Result<GuestImage> {
        let kernel = match self.kernel {
            Some(k) => k,
            None => HostKernel::find()?,
        };
        let mut extra = self.files;
        extra
            .file("etc/sheaf/main", GUEST_MAIN.as_bytes().to_vec(), 0o644)
            .file("etc/sheaf/lib.sh", SCRIPT_LIB.as_bytes().to_vec(), 0o644)
            .file(
                "etc/sheaf/test.sh",
                self.script
                    .unwrap_or_else(|| DEFAULT_SCRIPT.as_bytes().to_vec()),
                0o755,
            );
        let modules: Vec<String> = GUEST_MODULES
            .iter()
            .map(|m| m.to_string())
            .chain(self.extra_modules)
            .collect();
        let fs = assemble(&kernel, &modules, &extra)?;
        let cache = self.cache.unwrap_or_else(crate::cache_dir);
        let built = build_cached(&cache, "guest", &kernel, &fs)?;
        Ok(GuestImage {
            dir: built.dir,
            kernel: built.kernel,
            initramfs: built.initramfs,
            kernel_version: kernel.version,
        })
    }
}

/// Creates (or truncates) a sparse raw disk of `size` bytes with the marker
/// `SHEAF-MARKER:<marker>\n` at [`MARKER_OFFSET`].
pub fn create_disk(path: impl AsRef<Path>, size: u64, marker: &str) -> Result<()> {
    let path = path.as_ref();
    let f = fs::File::create(path).map_err(io_err("create disk", path))?;
    f.set_len(size).map_err(io_err("size disk", path))?;
    drop(f);
    write_marker(path, marker)
}

/// Writes `SHEAF-MARKER:<marker>\n` at [`MARKER_OFFSET`] of an existing disk.
pub fn write_marker(path: impl AsRef<Path>, marker: &str) -> Result<()> {
    let path = path.as_ref();
    let mut f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(io_err("open disk", path))?;
    f.seek(SeekFrom::Start(MARKER_OFFSET))
        .and_then(|_| f.write_all(format!("SHEAF-MARKER:{marker}\n").as_bytes()))
        .and_then(|_| f.sync_all())
        .map_err(io_err("write marker to", path))
}

/// Reads the guest's reply at [`REPLY_OFFSET`]: `Some(text)` if the guest
/// wrote `SHEAF-REPLY:<text>\n`.
pub fn read_reply(path: impl AsRef<Path>) -> Result<Option<String>> {
    let path = path.as_ref();
    let mut f = fs::File::open(path).map_err(io_err("open disk", path))?;
    let mut buf = vec![0u8; 512];
    f.seek(SeekFrom::Start(REPLY_OFFSET))
        .map_err(io_err("seek disk", path))?;
    let n = f.read(&mut buf).map_err(io_err("read disk", path))?;
    let text = String::from_utf8_lossy(&buf[..n]);
    Ok(text
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("SHEAF-REPLY:"))
        .map(str::to_string))
}

/// What the guest's harness printed on the console.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GuestReport {
    /// The marker the default script read.
    pub marker: Option<String>,
    /// Whether the script printed `SHEAF-GUEST: OK`.
    pub ok: bool,
    /// The test script's exit status.
    pub script_exit: Option<i32>,
    /// Lines with `SHEAF-GUEST: FAIL`.
    pub failures: Vec<String>,
}

/// Parses the `SHEAF-GUEST:` lines of a console log.
pub fn parse_console(console: &str) -> GuestReport {
    let mut r = GuestReport::default();
    for line in console.lines() {
        let Some(i) = line.find(CONSOLE_PREFIX) else {
            continue;
        };
        let rest = line[i + CONSOLE_PREFIX.len()..].trim();
        if let Some(m) = rest.strip_prefix("marker=") {
            r.marker = Some(m.to_string());
        } else if rest == "OK" {
            r.ok = true;
        } else if let Some(code) = rest.strip_prefix("script-exit=") {
            r.script_exit = code.split_whitespace().next().and_then(|c| c.parse().ok());
        } else if rest.starts_with("FAIL") {
            r.failures.push(rest.to_string());
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_parsing() {
        let r = parse_console(
            "noise\nSHEAF-GUEST: marker=abc 1\n[x] SHEAF-GUEST: OK\nSHEAF-GUEST: script-exit=0 uptime=1.2\n",
        );
        assert_eq!(r.marker.as_deref(), Some("abc 1"));
        assert!(r.ok);
        assert_eq!(r.script_exit, Some(0));
        assert!(r.failures.is_empty());
    }

    #[test]
    fn marker_and_reply_roundtrip() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("d.img");
        create_disk(&disk, 1 << 20, "m1").unwrap();
        assert_eq!(read_reply(&disk).unwrap(), None);
        let mut f = OpenOptions::new().write(true).open(&disk).unwrap();
        f.seek(SeekFrom::Start(REPLY_OFFSET)).unwrap();
        f.write_all(b"SHEAF-REPLY:m1\n").unwrap();
        assert_eq!(read_reply(&disk).unwrap().as_deref(), Some("m1"));
        assert_eq!(fs::metadata(&disk).unwrap().len(), 1 << 20);
    }

    /// Content-addressed cache: same inputs reuse the directory, a new
    /// script gets a new one, and the kernel copy is shared.
    #[test]
    fn cache_reuse_and_invalidation() {
        let Ok(kernel) = HostKernel::find() else {
            eprintln!("no cloud kernel installed; skipping (scripts/setup installs it)");
            return;
        };
        if fs::File::open(&kernel.vmlinuz).is_err() {
            eprintln!("{} unreadable; skipping", kernel.vmlinuz.display());
            return;
        }
        let cache = tempfile::tempdir().unwrap();
        let build = |script: &str| {
            GuestImage::builder()
                .kernel(kernel.clone())
                .cache_dir(cache.path())
                .script(script)
                .build()
                .unwrap()
        };
        let a = build("echo a\n");
        let mtime = fs::metadata(&a.initramfs).unwrap().modified().unwrap();
        let a2 = build("echo a\n");
        assert_eq!(a.initramfs, a2.initramfs);
        assert_eq!(
            fs::metadata(&a2.initramfs).unwrap().modified().unwrap(),
            mtime
        );
        let b = build("echo b\n");
        assert_ne!(a.dir, b.dir);
        assert_eq!(a.kernel, b.kernel);
        assert!(a.kernel.starts_with(cache.path().join("kernel")));
        // The initramfs holds the script, the modules in order, and busybox.
        let mut gz = flate2::read::GzDecoder::new(fs::File::open(&b.initramfs).unwrap());
        let mut cpio = Vec::new();
        gz.read_to_end(&mut cpio).unwrap();
        let text = String::from_utf8_lossy(&cpio);
        assert!(text.contains("echo b\n"));
        assert!(text.contains("lib/modules/sheaf/virtio_blk.ko"));
        assert!(text.contains(&GUEST_MODULES.join("\n")));
        assert!(text.contains("bin/busybox"));
    }
}
