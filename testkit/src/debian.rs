// SPDX-License-Identifier: Apache-2.0
//! A real Debian cloud disk, built from Debian packages (no prebuilt blob):
//! mmdebstrap installs Debian 12 with the cloud kernel, systemd,
//! cloud-init, openssh-server and qemu-guest-agent into a GPT disk with one
//! ext4 root partition; the kernel's initramfs carries virtio_mmio and
//! virtio_blk (MODULES=most). sheaf-vmm boots it with disk boot
//! (`kernel.from_disk`): the kernel and initramfs come from the image.
//!
//! ```text
//! $SHEAF_CACHE/debian/<suite>-<hash>/
//!     disk.raw       sparse raw image (GPT, partition 1 = ext4 root)
//!     disk.qcow2     the same, qcow2
//!     manifest       suite, kernel, root_uuid, sizes, build seconds
//!     packages.txt   every installed package and version
//! ```
//!
//! `<hash>` covers the build script, the suite, mirror, package list and
//! size, so the image is rebuilt only when one of them changes (a new
//! Debian point release alone does not rebuild it; delete the directory,
//! or change [`DebianImageBuilder::packages`], to refresh).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use sha2::{Digest, Sha256};
use tracing::info;

use crate::error::{Result, TestkitError, io_err};
use crate::image::{publish_dir, short_hash};

const SCRIPT: &str = include_str!("scripts/debian-image.sh");

/// Packages on top of `minbase`.
pub const DEFAULT_PACKAGES: &[&str] = &[
    "linux-image-cloud-amd64",
    "initramfs-tools",
    "zstd",
    "systemd-sysv",
    "udev",
    "dbus",
    "cloud-init",
    "openssh-server",
    "qemu-guest-agent",
    "sudo",
    "netbase",
    "iproute2",
    "ifupdown",
    "isc-dhcp-client",
    "iputils-ping",
    "e2fsprogs",
];

/// A built Debian disk in the cache.
#[derive(Debug, Clone)]
pub struct DebianImage {
    /// Cache directory holding the files.
    pub dir: PathBuf,
    /// Sparse raw disk.
    pub raw: PathBuf,
    /// qcow2 disk.
    pub qcow2: PathBuf,
    /// Kernel version inside (e.g. `6.1.0-27-cloud-amd64`).
    pub kernel_version: String,
    /// UUID of the ext4 root file system.
    pub root_uuid: String,
    /// The manifest's `key=value` lines.
    pub manifest: Vec<(String, String)>,
}

impl DebianImage {
    /// Starts a builder with Debian 12 and [`DEFAULT_PACKAGES`].
    pub fn builder() -> DebianImageBuilder {
        DebianImageBuilder {
            suite: "bookworm".into(),
            mirror: "http://deb.debian.org/debian".into(),
            packages: DEFAULT_PACKAGES.iter().map(|s| s.to_string()).collect(),
            size_mib: 2048,
            cache: None,
        }
    }

    /// Builds the default image, or returns the cached one.
    pub fn build() -> Result<Self> {
        Self::builder().build()
    }

    /// A manifest value.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.manifest
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Options for [`DebianImage`].
#[derive(Debug, Clone)]
pub struct DebianImageBuilder {
    suite: String,
    mirror: String,
    packages: Vec<String>,
    size_mib: u64,
    cache: Option<PathBuf>,
}

impl DebianImageBuilder {
    /// Debian suite (default `bookworm`).
    pub fn suite(mut self, suite: &str) -> Self {
        self.suite = suite.into();
        self
    }
    /// apt mirror (default `http://deb.debian.org/debian`).
    pub fn mirror(mut self, mirror: &str) -> Self {
        self.mirror = mirror.into();
        self
    }
    /// Adds a package.
    pub fn package(mut self, name: &str) -> Self {
        self.packages.push(name.into());
        self
    }
    /// Disk size in MiB (default 2048; the raw file is sparse).
    pub fn size_mib(mut self, mib: u64) -> Self {
        self.size_mib = mib;
        self
    }
    /// Uses this cache directory instead of [`crate::cache_dir`].
    pub fn cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache = Some(dir.into());
        self
    }

    /// Builds the image (a few minutes: apt downloads ~150 MB), or returns
    /// the cached one when nothing changed. Needs root (mmdebstrap's root
    /// mode) and the tools scripts/setup installs.
    pub fn build(self) -> Result<DebianImage> {
        for p in &self.packages {
            let ok = !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+-.".contains(&b));
            if !ok {
                return Err(TestkitError::InvalidName {
                    name: p.clone(),
                    why: "not a Debian package name",
                });
            }
        }
        let mut h = Sha256::new();
        for part in [SCRIPT, &self.suite, &self.mirror, &self.packages.join(",")] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        h.update(self.size_mib.to_le_bytes());
        let digest = h.finalize();
        let hash = short_hash(&digest);
        // The root UUID is derived from the inputs: the same inputs give the
        // same image identity.
        let u: String = digest[8..24].iter().map(|b| format!("{b:02x}")).collect();
        let root_uuid = format!(
            "{}-{}-4{}-8{}-{}",
            &u[0..8],
            &u[8..12],
            &u[13..16],
            &u[17..20],
            &u[20..32]
        );
        let cache = self.cache.unwrap_or_else(crate::cache_dir).join("debian");
        let name = format!("{}-{hash}", self.suite);
        let dir = cache.join(&name);
        fs::create_dir_all(&cache).map_err(io_err("create cache dir", &cache))?;
        // One build at a time (tests run in parallel): the others wait here
        // and then find the finished image.
        let lock_path = cache.join(format!(".{name}.lock"));
        let lock = fs::File::create(&lock_path).map_err(io_err("create", &lock_path))?;
        // SAFETY: flock on a descriptor we own; released when `lock` drops.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } != 0 {
            return Err(io_err("lock", &lock_path)(std::io::Error::last_os_error()));
        }
        if !dir.join("manifest").is_file() {
            let started = Instant::now();
            info!(suite = %self.suite, dir = %dir.display(), "building the Debian image (mmdebstrap)");
            publish_dir(&cache, &name, |tmp| {
                run_script(
                    tmp,
                    &[
                        ("SUITE", self.suite.as_str()),
                        ("MIRROR", self.mirror.as_str()),
                        ("PACKAGES", &self.packages.join(",")),
                        ("SIZE_MIB", &self.size_mib.to_string()),
                        ("ROOT_UUID", &root_uuid),
                    ],
                )
            })?;
            info!(elapsed = ?started.elapsed(), "Debian image built");
        }
        let text = fs::read_to_string(dir.join("manifest"))
            .map_err(io_err("read", dir.join("manifest")))?;
        let manifest: Vec<(String, String)> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let get = |k: &str| {
            manifest
                .iter()
                .find(|(m, _)| m == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        Ok(DebianImage {
            raw: dir.join("disk.raw"),
            qcow2: dir.join("disk.qcow2"),
            kernel_version: get("kernel"),
            root_uuid: get("root_uuid"),
            dir,
            manifest,
        })
    }
}

fn run_script(out: &Path, env: &[(&str, &str)]) -> Result<()> {
    let script = out.join("debian-image.sh");
    fs::write(&script, SCRIPT).map_err(io_err("write", &script))?;
    let log_path = out.join("build.log");
    let log = fs::File::create(&log_path).map_err(io_err("create", &log_path))?;
    let log2 = log.try_clone().map_err(io_err("dup", &log_path))?;
    let mut cmd = Command::new("bash");
    cmd.arg(&script).env("OUT", out).stdout(log).stderr(log2);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let status = cmd.status().map_err(|source| TestkitError::Spawn {
        program: "bash debian-image.sh".into(),
        source,
    })?;
    if !status.success() {
        let text = fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(TestkitError::ImageBuild {
            what: "Debian image (mmdebstrap)",
            status: status.to_string(),
            log_tail: tail.join("\n"),
        });
    }
    Ok(())
}

/// Writes a cloud-init NoCloud seed at `seed`: a 2 MiB FAT file system
/// labelled `CIDATA` (made with `mkfs.fat` and `mcopy`, as a user would)
/// holding `files` as `(name, contents)` in its root.
pub fn nocloud_seed(seed: &Path, files: &[(&str, &str)]) -> Result<()> {
    let dir = seed.parent().unwrap_or(Path::new("."));
    let f = fs::File::create(seed).map_err(io_err("create", seed))?;
    f.set_len(2 << 20).map_err(io_err("size", seed))?;
    drop(f);
    let run = |what: &'static str, cmd: &mut Command| -> Result<()> {
        let out = cmd.output().map_err(|source| TestkitError::Spawn {
            program: what.into(),
            source,
        })?;
        if !out.status.success() {
            return Err(TestkitError::ImageBuild {
                what,
                status: out.status.to_string(),
                log_tail: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Ok(())
    };
    run(
        "mkfs.fat",
        Command::new("mkfs.fat").args(["-n", "CIDATA"]).arg(seed),
    )?;
    for (name, contents) in files {
        let tmp = dir.join(format!(".seed-{name}"));
        fs::write(&tmp, contents).map_err(io_err("write", &tmp))?;
        let copied = run(
            "mcopy",
            Command::new("mcopy")
                .arg("-i")
                .arg(seed)
                .arg(&tmp)
                .arg(format!("::{name}")),
        );
        let _ = fs::remove_file(&tmp);
        copied?;
    }
    Ok(())
}
