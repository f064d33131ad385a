// SPDX-License-Identifier: Apache-2.0
//! The host's Debian cloud kernel: where it is, its modules, and how to get a
//! vmlinux ELF out of its bzImage.
//!
//! `scripts/setup` installs `linux-image-cloud-amd64`; its bzImage is
//! LZ4-compressed and its virtio and KVM drivers are modules.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use tracing::debug;

use crate::error::{Result, TestkitError, io_err};

/// Environment variable that picks a kernel version (e.g. `6.1.0-57-cloud-amd64`)
/// when several are installed. The newest is used otherwise.
pub const KERNEL_VERSION_ENV: &str = "SHEAF_KERNEL_VERSION";

/// A kernel installed on the host: `/boot/vmlinuz-<version>` plus
/// `/lib/modules/<version>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostKernel {
    /// The release string, e.g. `6.1.0-57-cloud-amd64`.
    pub version: String,
    /// The bzImage.
    pub vmlinuz: PathBuf,
    /// `/lib/modules/<version>`.
    pub modules_dir: PathBuf,
}

/// Where a module comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModuleSource {
    /// A module file (`.ko`, `.ko.xz`, `.ko.zst` or `.ko.gz`).
    File(PathBuf),
    /// Compiled into the kernel: nothing to load.
    BuiltIn,
}

/// Module names treat `-` and `_` alike (`kvm-amd` is `kvm_amd`).
pub fn module_name(s: &str) -> String {
    let base = s.rsplit('/').next().unwrap_or(s);
    let base = base
        .strip_suffix(".xz")
        .or_else(|| base.strip_suffix(".zst"))
        .or_else(|| base.strip_suffix(".gz"))
        .unwrap_or(base);
    base.strip_suffix(".ko").unwrap_or(base).replace('-', "_")
}

/// Compares kernel versions by their numeric runs (`6.1.0-57` > `6.1.0-9`).
fn version_key(v: &str) -> Vec<u64> {
    v.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap_or(0))
        .collect()
}

impl HostKernel {
    /// Finds the Debian cloud kernel in `/boot` (the newest, or the one named by
    /// `SHEAF_KERNEL_VERSION`).
    pub fn find() -> Result<Self> {
        Self::find_in(Path::new("/boot"), Path::new("/lib/modules"))
    }

    /// Like [`HostKernel::find`], with other directories (for tests).
    pub fn find_in(boot: &Path, modules_root: &Path) -> Result<Self> {
        let wanted = std::env::var(KERNEL_VERSION_ENV).ok();
        let mut versions = Vec::new();
        let entries = fs::read_dir(boot).map_err(|_| TestkitError::KernelNotFound {
            searched: format!("{}/vmlinuz-*-cloud-amd64", boot.display()),
        })?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(v) = name.strip_prefix("vmlinuz-")
                && v.ends_with("-cloud-amd64")
                && wanted.as_deref().is_none_or(|w| w == v)
            {
                versions.push(v.to_string());
            }
        }
        versions.sort_by_key(|v| version_key(v));
        let version = versions.pop().ok_or_else(|| TestkitError::KernelNotFound {
            searched: match &wanted {
                Some(w) => format!("{}/vmlinuz-{w} ({KERNEL_VERSION_ENV})", boot.display()),
                None => format!("{}/vmlinuz-*-cloud-amd64", boot.display()),
            },
        })?;
        let modules_dir = modules_root.join(&version);
        if !modules_dir.join("modules.dep").is_file() {
            return Err(TestkitError::KernelNotFound {
                searched: format!("{}/modules.dep", modules_dir.display()),
            });
        }
        Ok(Self {
            vmlinuz: boot.join(format!("vmlinuz-{version}")),
            modules_dir,
            version,
        })
    }

    /// Finds a module by name: a file from `modules.dep`, or built in
    /// according to `modules.builtin`.
    pub fn module(&self, name: &str) -> Result<ModuleSource> {
        let want = module_name(name);
        let dep_path = self.modules_dir.join("modules.dep");
        let dep = fs::read_to_string(&dep_path).map_err(io_err("read", &dep_path))?;
        for line in dep.lines() {
            let Some((file, _)) = line.split_once(':') else {
                continue;
            };
            if module_name(file) == want {
                return Ok(ModuleSource::File(self.modules_dir.join(file)));
            }
        }
        let builtin_path = self.modules_dir.join("modules.builtin");
        if let Ok(builtin) = fs::read_to_string(&builtin_path)
            && builtin.lines().any(|l| module_name(l) == want)
        {
            return Ok(ModuleSource::BuiltIn);
        }
        Err(TestkitError::ModuleNotFound {
            module: name.to_string(),
            version: self.version.clone(),
        })
    }

    /// The uncompressed `.ko` bytes of a module, or `None` if it is built in.
    pub fn module_bytes(&self, name: &str) -> Result<Option<Vec<u8>>> {
        match self.module(name)? {
            ModuleSource::BuiltIn => {
                debug!(module = name, "built into the kernel");
                Ok(None)
            }
            ModuleSource::File(path) => read_module(&path).map(Some),
        }
    }
}

/// Reads a module file, decompressing `.ko.gz` in-process and `.ko.xz` /
/// `.ko.zst` with the `xz` / `zstd` tools.
fn read_module(path: &Path) -> Result<Vec<u8>> {
    let raw = fs::read(path).map_err(io_err("read module", path))?;
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        "xz"
    } else if name.ends_with(".zst") {
        "zstd"
    } else if name.ends_with(".gz") {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(io_err("gunzip module", path))?;
        return Ok(out);
    } else {
        return Ok(raw);
    };
    let out = Command::new(tool)
        .arg("-dc")
        .arg(path)
        .output()
        .map_err(|_| TestkitError::ToolMissing {
            tool: tool.to_string(),
            why: "to decompress kernel modules",
        })?;
    if !out.status.success() {
        return Err(TestkitError::Io {
            op: "decompress module",
            path: path.to_path_buf(),
            source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()),
        });
    }
    Ok(out.stdout)
}

/// The smallest ELF facts the harness needs.
pub mod elf {
    fn u16_at(b: &[u8], off: usize) -> Option<u16> {
        Some(u16::from_le_bytes(b.get(off..off + 2)?.try_into().ok()?))
    }
    fn u32_at(b: &[u8], off: usize) -> Option<u32> {
        Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
    }
    fn u64_at(b: &[u8], off: usize) -> Option<u64> {
        Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
    }

    /// Program headers of a little-endian ELF64: `(p_type, p_offset, p_filesz)`.
    fn phdrs(b: &[u8]) -> Option<Vec<(u32, u64, u64)>> {
        if b.get(0..4)? != b"\x7fELF" || *b.get(4)? != 2 || *b.get(5)? != 1 {
            return None;
        }
        let phoff = usize::try_from(u64_at(b, 0x20)?).ok()?;
        let phentsize = usize::from(u16_at(b, 0x36)?);
        let phnum = usize::from(u16_at(b, 0x38)?);
        let mut out = Vec::with_capacity(phnum);
        for i in 0..phnum {
            let off = phoff.checked_add(i.checked_mul(phentsize)?)?;
            out.push((u32_at(b, off)?, u64_at(b, off + 8)?, u64_at(b, off + 32)?));
        }
        Some(out)
    }

    /// Whether `b` is an x86_64 ELF64 executable.
    pub fn is_elf64(b: &[u8]) -> bool {
        phdrs(b).is_some() && u16_at(b, 0x12) == Some(0x3e)
    }

    /// Whether an ELF64 has no `PT_INTERP`, i.e. needs no dynamic loader.
    /// `None` if `b` is not an ELF64.
    pub fn is_static(b: &[u8]) -> Option<bool> {
        const PT_INTERP: u32 = 3;
        Some(!phdrs(b)?.iter().any(|(t, _, _)| *t == PT_INTERP))
    }

    /// The 32-bit PVH entry point (Xen ELF note `XEN_ELFNOTE_PHYS32_ENTRY`)
    /// of a vmlinux, if it has one.
    pub fn pvh_entry(b: &[u8]) -> Option<u32> {
        const PT_NOTE: u32 = 4;
        const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;
        for (t, off, size) in phdrs(b)? {
            if t != PT_NOTE {
                continue;
            }
            let start = usize::try_from(off).ok()?;
            let end = start.checked_add(usize::try_from(size).ok()?)?;
            let notes = b.get(start..end)?;
            let mut p = 0usize;
            while p + 12 <= notes.len() {
                let namesz = usize::try_from(u32_at(notes, p)?).ok()?;
                let descsz = usize::try_from(u32_at(notes, p + 4)?).ok()?;
                let ntype = u32_at(notes, p + 8)?;
                let name_start = p + 12;
                let desc_start = name_start + namesz.div_ceil(4) * 4;
                let name = notes.get(name_start..name_start + namesz)?;
                if ntype == XEN_ELFNOTE_PHYS32_ENTRY && name.starts_with(b"Xen") {
                    return u32_at(notes, desc_start);
                }
                p = desc_start + descsz.div_ceil(4) * 4;
            }
        }
        None
    }
}

fn extract_err(reason: impl Into<String>) -> TestkitError {
    TestkitError::ExtractVmlinux {
        reason: reason.into(),
    }
}

/// Extracts the vmlinux ELF from a bzImage (like Linux's
/// `scripts/extract-vmlinux`, but reading the payload location from the boot
/// header). Supports LZ4 (Debian's choice) and gzip payloads.
pub fn extract_vmlinux(bzimage: &[u8]) -> Result<Vec<u8>> {
    let hdr = |off: usize, len: usize| {
        bzimage
            .get(off..off + len)
            .ok_or_else(|| extract_err("file too short for a boot header"))
    };
    if hdr(0x202, 4)? != b"HdrS" {
        return Err(extract_err("no HdrS boot header signature"));
    }
    let version = u16::from_le_bytes([hdr(0x206, 2)?[0], hdr(0x206, 2)?[1]]);
    if version < 0x208 {
        return Err(extract_err(format!(
            "boot protocol {version:#x} has no payload fields"
        )));
    }
    let setup_sects = match hdr(0x1f1, 1)?[0] {
        0 => 4,
        n => usize::from(n),
    };
    let word = |off| -> Result<usize> {
        let b = hdr(off, 4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let pm_start = (setup_sects + 1) * 512;
    let start = pm_start + word(0x248)?;
    let payload = bzimage
        .get(start..start + word(0x24c)?)
        .ok_or_else(|| extract_err("payload outside the file"))?;
    let elf = if payload.starts_with(&[0x02, 0x21, 0x4c, 0x18]) {
        lz4_legacy(payload)?
    } else if payload.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(payload)
            .read_to_end(&mut out)
            .map_err(|e| extract_err(format!("gzip: {e}")))?;
        out
    } else {
        let magic: Vec<String> = payload.iter().take(4).map(|b| format!("{b:02x}")).collect();
        return Err(extract_err(format!(
            "unsupported payload compression (magic {})",
            magic.join(" ")
        )));
    };
    if !elf::is_elf64(&elf) {
        return Err(extract_err("decompressed payload is not an x86_64 ELF"));
    }
    Ok(elf)
}

/// Decompresses the LZ4 "legacy" frame format `lz4 -l` writes: a magic, then
/// blocks of `[u32 LE compressed size][data]`, each at most 8 MiB
/// uncompressed. The kernel appends the uncompressed size as a trailing u32.
fn lz4_legacy(mut data: &[u8]) -> Result<Vec<u8>> {
    const MAGIC: u32 = 0x184c_2102;
    const BLOCK: usize = 8 << 20;
    let mut out = Vec::new();
    let mut buf = vec![0u8; BLOCK];
    while data.len() >= 4 {
        let n = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        if n == MAGIC {
            data = &data[4..];
            continue;
        }
        let n = n as usize;
        let Some(block) = data.get(4..4 + n) else {
            // The trailing size word (or padding): done.
            break;
        };
        let got = lz4_flex::block::decompress_into(block, &mut buf)
            .map_err(|e| extract_err(format!("lz4: {e}")))?;
        out.extend_from_slice(&buf[..got]);
        data = &data[4 + n..];
    }
    Ok(out)
}

/// Reads a bzImage file and writes its vmlinux to `out` (atomically).
pub fn extract_vmlinux_file(bzimage: &Path, out: &Path) -> Result<()> {
    let data = fs::read(bzimage).map_err(io_err("read bzImage", bzimage))?;
    let elf = extract_vmlinux(&data)?;
    let tmp = out.with_extension(format!("tmp{}", std::process::id()));
    fs::write(&tmp, &elf).map_err(io_err("write vmlinux", &tmp))?;
    fs::rename(&tmp, out).map_err(io_err("rename vmlinux", out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_names() {
        assert_eq!(module_name("kernel/arch/x86/kvm/kvm-amd.ko"), "kvm_amd");
        assert_eq!(
            module_name("kernel/drivers/virtio/virtio_ring.ko.xz"),
            "virtio_ring"
        );
        assert_eq!(module_name("virtio_blk"), "virtio_blk");
    }

    #[test]
    fn version_order() {
        let mut v = [
            "6.1.0-9-cloud-amd64",
            "6.1.0-57-cloud-amd64",
            "6.1.0-10-cloud-amd64",
        ];
        v.sort_by_key(|s| version_key(s));
        assert_eq!(v.last(), Some(&"6.1.0-57-cloud-amd64"));
    }

    #[test]
    fn rejects_garbage() {
        assert!(extract_vmlinux(&[0u8; 100]).is_err());
        assert!(extract_vmlinux(&[0u8; 4096]).is_err());
        assert_eq!(
            elf::is_static(b"not an elf at all, no no no no no no no no no no no"),
            None
        );
    }

    #[test]
    fn lz4_legacy_roundtrip() {
        let plain: Vec<u8> = (0..100_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        let block = lz4_flex::block::compress(&plain);
        let mut framed = 0x184c_2102u32.to_le_bytes().to_vec();
        framed.extend_from_slice(&(block.len() as u32).to_le_bytes());
        framed.extend_from_slice(&block);
        framed.extend_from_slice(&(plain.len() as u32).to_le_bytes());
        assert_eq!(lz4_legacy(&framed).unwrap(), plain);
    }

    /// The installed Debian kernel, when there is one: all the modules the
    /// images need resolve, and the bzImage yields a vmlinux with a PVH note.
    #[test]
    fn host_kernel() {
        let Ok(k) = HostKernel::find() else {
            eprintln!("no cloud kernel installed; skipping (scripts/setup installs it)");
            return;
        };
        for m in ["virtio_ring", "virtio_blk", "kvm", "kvm-amd", "irqbypass"] {
            k.module(m).unwrap();
        }
        assert!(k.module("no_such_module_xyz").is_err());
        let Ok(bz) = fs::read(&k.vmlinuz) else {
            eprintln!("{} unreadable; skipping", k.vmlinuz.display());
            return;
        };
        let elf = extract_vmlinux(&bz).unwrap();
        assert_eq!(elf::is_static(&elf), Some(true));
        assert!(elf::pvh_entry(&elf).is_some(), "no PVH note");
    }
}
