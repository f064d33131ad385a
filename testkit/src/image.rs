// SPDX-License-Identifier: Apache-2.0
//! Shared by the guest image and the nested box's L1 image: a busybox
//! initramfs with sheaf's `/init`, a list of kernel modules, and a
//! content-addressed cache directory.
//!
//! ```text
//! $SHEAF_CACHE/<kind>/<kernel version>-<hash>/
//!     bzImage              copy of /boot/vmlinuz-<version>
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

/// Builds (or finds in the cache) an image of `kind` for `kernel`.
pub(crate) fn build_cached(
    cache: &Path,
    kind: &str,
    kernel: &HostKernel,
    initramfs: &Initramfs,
) -> Result<BuiltImage> {
    let cpio = initramfs.to_cpio();
    let bz = fs::read(&kernel.vmlinuz).map_err(|source| {
        if source.kind() == std::io::ErrorKind::PermissionDenied {
            TestkitError::Io {
                op: "read guest kernel (run as root, or chmod a+r it)",
                path: kernel.vmlinuz.clone(),
                source,
            }
        } else {
            TestkitError::Io {
                op: "read guest kernel",
                path: kernel.vmlinuz.clone(),
                source,
            }
        }
    })?;
    let mut h = Sha256::new();
    h.update(FORMAT);
    h.update(kind);
    h.update(&kernel.version);
    h.update(Sha256::digest(&bz));
    h.update(Sha256::digest(&cpio));
    let digest = h.finalize();
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();

    let parent = cache.join(kind);
    let dir = parent.join(format!("{}-{hex}", kernel.version));
    let image = BuiltImage {
        kernel: dir.join("bzImage"),
        initramfs: dir.join("initramfs.cpio.gz"),
        dir: dir.clone(),
    };
    if image.kernel.is_file() && image.initramfs.is_file() {
        debug!(dir = %dir.display(), "image cached");
        return Ok(image);
    }
    fs::create_dir_all(&parent).map_err(io_err("create cache dir", &parent))?;
    let tmp = tempfile::Builder::new()
        .prefix(".build-")
        .tempdir_in(&parent)
        .map_err(io_err("create temp dir in", &parent))?;
    let tmp_kernel = tmp.path().join("bzImage");
    fs::write(&tmp_kernel, &bz).map_err(io_err("write", &tmp_kernel))?;
    initramfs.write_gz(&tmp.path().join("initramfs.cpio.gz"))?;
    let tmp_path = tmp.keep();
    match fs::rename(&tmp_path, &dir) {
        Ok(()) => info!(dir = %dir.display(), "built {kind} image"),
        Err(_) if image.initramfs.is_file() => {
            // Another process built the same image first.
            let _ = fs::remove_dir_all(&tmp_path);
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp_path);
            return Err(io_err("rename into", &dir)(e));
        }
    }
    Ok(image)
}
