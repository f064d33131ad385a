// SPDX-License-Identifier: Apache-2.0
//! Shared by the guest image and the nested box's L1 image: a busybox
//! initramfs with sheaf's `/init`, a list of kernel modules, and a
//! content-addressed cache directory.
//!
//! ```text
//! $SHEAF_CACHE/kernel/<kernel version>-<hash of bzImage>/
//!     bzImage              copy of /boot/vmlinuz-<version>
//!     vmlinux              extracted on demand (GuestImage::vmlinux)
//! $SHEAF_CACHE/<kind>/<kernel version>-<hash>/          kind: guest, nested
//!     initramfs.cpio.gz    busybox + modules + /init + /etc/sheaf/*
//! ```
//!
//! `<hash>` covers the kernel bytes and the uncompressed cpio (busybox,
//! modules, scripts), so an unchanged input reuses the directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};
use tracing::{debug, info};

use crate::cpio::Initramfs;
use crate::error::{Result, TestkitError, io_err};
use crate::kernel::{HostKernel, elf, module_name};

/// Bumped when the layout or the base init changes incompatibly.
const FORMAT: &str = "sheaf-image-v1";

/// The `/init` every image shares.
pub(crate) const BASE_INIT: &str = include_str!("scripts/init.sh");

/// Environment variable that points at a static busybox (default `/bin/busybox`).
pub const BUSYBOX_ENV: &str = "SHEAF_BUSYBOX";

/// A built image in the cache.
#[derive(Debug, Clone)]
pub(crate) struct BuiltImage {
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
}

/// Reads the static busybox and lists its applets.
fn busybox() -> Result<(Vec<u8>, Vec<String>)> {
    let path = std::env::var_os(BUSYBOX_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/bin/busybox"));
    let bytes = fs::read(&path).map_err(|_| TestkitError::ToolMissing {
        tool: path.display().to_string(),
        why: "static busybox for guest initramfs images",
    })?;
    if elf::is_static(&bytes) != Some(true) {
        return Err(TestkitError::BusyboxNotStatic { path });
    }
    let out = Command::new(&path)
        .arg("--list-full")
        .output()
        .map_err(|source| TestkitError::Spawn {
            program: path.display().to_string(),
            source,
        })?;
    let applets = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.contains(".."))
        .map(str::to_string)
        .collect();
    Ok((bytes, applets))
}

/// Assembles the initramfs: busybox with one symlink per applet,
/// `/dev/console`, the modules (in `/lib/modules/sheaf/<name>.ko`, listed in
/// load order in `/etc/sheaf/modules`), the base `/init`, then `extra` on top.
pub(crate) fn assemble(
    kernel: &HostKernel,
    modules: &[String],
    extra: &Initramfs,
) -> Result<Initramfs> {
    let (busybox, applets) = busybox()?;
    let mut img = extra.clone();
    img.file("bin/busybox", busybox, 0o755);
    for applet in &applets {
        if applet != "bin/busybox" && !img.contains(applet) {
            let depth = applet.matches('/').count();
            let target = format!("{}bin/busybox", "../".repeat(depth));
            img.symlink(applet, &target);
        }
    }
    if !img.contains("bin/sh") {
        img.symlink("bin/sh", "busybox");
    }
    img.char_dev("dev/console", 5, 1, 0o600)
        .char_dev("dev/null", 1, 3, 0o666)
        .dir("proc")
        .dir("sys")
        .dir("tmp")
        .dir("run")
        .dir("root");
    let mut order = Vec::new();
    for m in modules {
        match kernel.module_bytes(m)? {
            Some(bytes) => {
                let name = module_name(m);
                img.file(&format!("lib/modules/sheaf/{name}.ko"), bytes, 0o644);
                order.push(name);
            }
            None => debug!(module = %m, "built in; not packed"),
        }
    }
    let mut list = order.join("\n");
    list.push('\n');
    img.file("etc/sheaf/modules", list.into_bytes(), 0o644);
    img.file(
        "etc/sheaf/kernel-version",
        format!("{}\n", kernel.version).into_bytes(),
        0o644,
    );
    if !img.contains("init") {
        img.file("init", BASE_INIT.as_bytes().to_vec(), 0o755);
    }
    Ok(img)
}

/// Creates `parent/name` atomically: fills a temporary sibling with `fill`,
/// then renames it into place. If another process won the race, its
/// directory is kept and ours is discarded.
pub(crate) fn publish_dir(
    parent: &Path,
    name: &str,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let dir = parent.join(name);
    fs::create_dir_all(parent).map_err(io_err("create cache dir", parent))?;
    let tmp = tempfile::Builder::new()
        .prefix(".build-")
        .tempdir_in(parent)
        .map_err(io_err("create temp dir in", parent))?;
    fill(tmp.path())?;
    let tmp_path = tmp.keep();
    match fs::rename(&tmp_path, &dir) {
        Ok(()) => info!(dir = %dir.display(), "added to the cache"),
        Err(_) if dir.is_dir() => {
            let _ = fs::remove_dir_all(&tmp_path);
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp_path);
            return Err(io_err("rename into", &dir)(e));
        }
    }
    Ok(dir)
}

pub(crate) fn short_hash(digest: &[u8]) -> String {
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Builds (or finds in the cache) an image of `kind` for `kernel`.
pub(crate) fn build_cached(
    cache: &Path,
    kind: &str,
    kernel: &HostKernel,
    initramfs: &Initramfs,
) -> Result<BuiltImage> {
    let bz = fs::read(&kernel.vmlinuz).map_err(|source| TestkitError::Io {
        op: if source.kind() == std::io::ErrorKind::PermissionDenied {
            "read guest kernel (run as root, or chmod a+r it)"
        } else {
            "read guest kernel"
        },
        path: kernel.vmlinuz.clone(),
        source,
    })?;
    let bz_hash = Sha256::digest(&bz);

    // The kernel (and its vmlinux, extracted on demand) is shared by every
    // image built on it.
    let kernel_name = format!("{}-{}", kernel.version, short_hash(&bz_hash));
    let kernel_dir = cache.join("kernel").join(&kernel_name);
    if !kernel_dir.join("bzImage").is_file() {
        publish_dir(&cache.join("kernel"), &kernel_name, |tmp| {
            let p = tmp.join("bzImage");
            fs::write(&p, &bz).map_err(io_err("write", &p))
        })?;
    }

    let cpio = initramfs.to_cpio();
    let mut h = Sha256::new();
    h.update(FORMAT);
    h.update(kind);
    h.update(&kernel.version);
    h.update(bz_hash);
    h.update(Sha256::digest(&cpio));
    let name = format!("{}-{}", kernel.version, short_hash(&h.finalize()));
    let dir = cache.join(kind).join(&name);
    let image = BuiltImage {
        kernel: kernel_dir.join("bzImage"),
        initramfs: dir.join("initramfs.cpio.gz"),
        dir: dir.clone(),
    };
    if image.initramfs.is_file() {
        debug!(dir = %dir.display(), "image cached");
        return Ok(image);
    }
    publish_dir(&cache.join(kind), &name, |tmp| {
        initramfs.write_gz(&tmp.join("initramfs.cpio.gz"))
    })?;
    info!(dir = %dir.display(), "built {kind} image");
    Ok(image)
}
