// SPDX-License-Identifier: Apache-2.0
//! Disk boot: find the kernel and initramfs inside a disk image and boot
//! them directly, with no kernel outside the image.
//!
//! ```text
//!  disk ── GPT (gptman) or MBR (mbrman) ── partitions
//!            └─ each ext4 file system (ext4-view, read-only)
//!                 /boot/vmlinuz, /vmlinuz            symlinks (Debian, Ubuntu)
//!                 /boot/vmlinuz-<newest version>     otherwise
//!                 + the matching initrd.img / initramfs
//!  root=UUID=<uuid of the root file system> on the command line
//! ```
//!
//! Everything is read through the disk's [`AsyncBlockBackend`], the same
//! one the guest gets, so a replicated volume boots like a file. The image
//! is untrusted: every size is checked before anything is allocated, and
//! each failure names what is missing.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use ext4_view::Ext4;

use super::BootError;
use super::reader::{BackendReader, PartitionReader, SeekReader};
use crate::devices::virtio::block::AsyncBlockBackend;

/// Largest kernel image read from a disk.
pub const MAX_KERNEL_BYTES: u64 = 256 << 20;
/// Largest initramfs read from a disk.
pub const MAX_INITRAMFS_BYTES: u64 = 1 << 30;
/// Most partitions examined.
const MAX_PARTITIONS: usize = 128;

/// What [`find`] found on the disk.
#[derive(Debug, Clone)]
pub struct DiskBootFiles {
    /// The kernel image bytes.
    pub kernel: Vec<u8>,
    /// Where the kernel was found, e.g. `partition 1:/boot/vmlinuz-6.1.0-27-cloud-amd64`.
    pub kernel_path: String,
    /// The initramfs bytes, if the image has one.
    pub initramfs: Option<Vec<u8>>,
    /// Where the initramfs was found.
    pub initramfs_path: Option<String>,
    /// UUID of the root file system (for `root=UUID=`).
    pub root_uuid: String,
    /// Partition number (1-based) of the root file system.
    pub root_partition: u32,
    /// Bytes read from the disk to find and load all this.
    pub bytes_read: u64,
}

/// One partition: number, byte offset, byte length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Part {
    number: u32,
    start: u64,
    len: u64,
}

/// Reads the partition table of `backend`, finds the root ext4 file system
/// and the kernel and initramfs in it. `partition` restricts the search to
/// one partition (1-based).
pub fn find(
    backend: Arc<dyn AsyncBlockBackend>,
    disk: usize,
    partition: Option<u32>,
) -> Result<DiskBootFiles, BootError> {
    let io = |source| BootError::DiskRead { disk, source };
    let reader = Rc::new(RefCell::new(BackendReader::new(backend).map_err(io)?));
    let parts = partitions(&mut reader.borrow_mut(), disk)?;
    let parts: Vec<Part> = match partition {
        None => parts,
        Some(n) => match parts.iter().find(|p| p.number == n) {
            Some(p) => vec![*p],
            None => {
                return Err(BootError::NoSuchPartition {
                    disk,
                    partition: n,
                    found: parts.len(),
                });
            }
        },
    };
    // Every ext4 file system, in partition order.
    let mut filesystems = Vec::new();
    for p in &parts {
        let r = PartitionReader::new(reader.clone(), p.start, p.len);
        match Ext4::load(Box::new(r)) {
            Ok(fs) => filesystems.push((*p, fs)),
            Err(e) => tracing::debug!(disk, partition = p.number, error = %e, "not ext4"),
        }
    }
    if filesystems.is_empty() {
        return Err(BootError::NoRootFilesystem {
            disk,
            partitions: parts.len(),
        });
    }
    // The kernel: the first file system that has one.
    let mut searched = Vec::new();
    let mut found = None;
    for (p, fs) in &filesystems {
        match kernel_in(fs, p.number) {
            Some(k) => {
                found = Some((*p, fs, k));
                break;
            }
            None => searched.push(p.number),
        }
    }
    let Some((boot_part, boot_fs, (kernel_file, initrd_file))) = found else {
        return Err(BootError::KernelNotFound {
            disk,
            partitions: searched,
        });
    };
    // The root: the boot file system when it is a root (has /etc), else
    // the first ext4 that is (a separate /boot partition).
    let is_root = |fs: &Ext4| fs.exists("/etc").unwrap_or(false);
    let (root_part, root_fs) = if is_root(boot_fs) {
        (boot_part, boot_fs)
    } else {
        filesystems
            .iter()
            .find(|(_, fs)| is_root(fs))
            .map(|(p, fs)| (*p, fs))
            .unwrap_or((boot_part, boot_fs))
    };
    let kernel_path = format!("partition {}:{kernel_file}", boot_part.number);
    let kernel = read_capped(boot_fs, &kernel_file, MAX_KERNEL_BYTES, &kernel_path)?;
    check_x86_kernel(&kernel, &kernel_path)?;
    let (initramfs, initramfs_path) = match initrd_file {
        Some(f) => {
            let path = format!("partition {}:{f}", boot_part.number);
            let data = read_capped(boot_fs, &f, MAX_INITRAMFS_BYTES, &path)?;
            (Some(data), Some(path))
        }
        None => (None, None),
    };
    let root_uuid = root_fs.uuid().to_string();
    let bytes_read = reader.borrow().fetched();
    tracing::info!(
        disk,
        kernel = %kernel_path,
        initramfs = initramfs_path.as_deref().unwrap_or("none"),
        root = %root_uuid,
        bytes_read,
        "found the kernel on the boot disk"
    );
    Ok(DiskBootFiles {
        kernel,
        kernel_path,
        initramfs,
        initramfs_path,
        root_uuid,
        root_partition: root_part.number,
        bytes_read,
    })
}

/// GPT first (its protective MBR would otherwise read as one partition),
/// then MBR; neither is an error naming what the first sectors hold.
fn partitions(r: &mut BackendReader, disk: usize) -> Result<Vec<Part>, BootError> {
    const SECTOR: u64 = 512;
    let size = r.size();
    if size < 2 * SECTOR {
        return Err(BootError::NoPartitionTable {
            disk,
            detail: format!("the disk is only {size} bytes"),
        });
    }
    let mut head = [0u8; 1024 + 512];
    let n = head.len().min(size as usize);
    r.read_at(0, &mut head[..n])
        .map_err(|source| BootError::DiskRead { disk, source })?;
    let mut parts = Vec::new();
    if &head[512..520] == b"EFI PART" {
        let gpt = gptman::GPT::read_from(&mut SeekReader::new(r), SECTOR).map_err(|e| {
            BootError::BadPartitionTable {
                disk,
                kind: "GPT",
                reason: e.to_string(),
            }
        })?;
        for (number, e) in gpt.iter().filter(|(_, e)| e.is_used()) {
            let start = e.starting_lba.saturating_mul(SECTOR);
            let end = e.ending_lba.saturating_add(1).saturating_mul(SECTOR);
            parts.push((number, start, end.saturating_sub(start)));
        }
    } else if head[510..512] == [0x55, 0xaa] && !looks_like_boot_sector_fs(&head) {
        let mbr = mbrman::MBR::read_from(&mut SeekReader::new(r), SECTOR as u32).map_err(|e| {
            BootError::BadPartitionTable {
                disk,
                kind: "MBR",
                reason: e.to_string(),
            }
        })?;
        for (number, e) in mbr.iter().filter(|(_, e)| e.is_used()) {
            // Extended partitions are containers, not file systems.
            if matches!(e.sys, 0x05 | 0x0f | 0x85) {
                continue;
            }
            parts.push((
                number as u32,
                u64::from(e.starting_lba) * SECTOR,
                u64::from(e.sectors) * SECTOR,
            ));
        }
    } else {
        let detail = if size > 1080 && head[1080..1082] == [0x53, 0xef] {
            "the disk holds a bare ext4 file system; disk boot needs a GPT or MBR partition table"
                .to_string()
        } else {
            "no GPT header at sector 1 and no MBR signature at sector 0".to_string()
        };
        return Err(BootError::NoPartitionTable { disk, detail });
    }
    let parts: Vec<Part> = parts
        .into_iter()
        .filter(|&(_, start, len)| len > 0 && start.checked_add(len).is_some_and(|e| e <= size))
        .take(MAX_PARTITIONS)
        .map(|(number, start, len)| Part { number, start, len })
        .collect();
    if parts.is_empty() {
        return Err(BootError::NoPartitionTable {
            disk,
            detail: "the partition table lists no partition inside the disk".into(),
        });
    }
    Ok(parts)
}

/// A FAT or NTFS boot sector also ends in 55 AA; its jump and OEM fields
/// tell it apart from an MBR.
fn looks_like_boot_sector_fs(head: &[u8]) -> bool {
    let fat = head.get(54..59) == Some(b"FAT12") || head.get(54..59) == Some(b"FAT16");
    let fat32 = head.get(82..87) == Some(b"FAT32");
    let ntfs = head.get(3..7) == Some(b"NTFS");
    fat || fat32 || ntfs
}

/// The kernel (and its initramfs) in `fs`: the distribution's symlinks
/// first, then the newest versioned kernel in /boot.
/// Returns the kernel's path and its initramfs's, if any.
fn kernel_in(fs: &Ext4, part: u32) -> Option<(String, Option<String>)> {
    let regular = |p: &str| {
        fs.metadata(p)
            .is_ok_and(|m| m.file_type().is_regular_file())
    };
    for (k, i) in [
        ("/boot/vmlinuz", "/boot/initrd.img"),
        ("/vmlinuz", "/initrd.img"),
    ] {
        if regular(k) {
            let kernel = canonical(fs, k).unwrap_or_else(|| k.to_string());
            let initrd = regular(i).then(|| canonical(fs, i).unwrap_or_else(|| i.to_string()));
            return Some((kernel, initrd));
        }
    }
    // A separate /boot partition has its kernels at its root.
    for dir in ["/boot", "/"] {
        let Ok(entries) = fs.read_dir(dir) else {
            continue;
        };
        let mut versions = Vec::new();
        for e in entries.flatten() {
            let Ok(name) = e.file_name().as_str().map(str::to_string) else {
                continue;
            };
            if let Some(v) = name.strip_prefix("vmlinuz-") {
                versions.push(v.to_string());
            }
        }
        versions.sort_by(|a, b| version_cmp(a, b));
        while let Some(v) = versions.pop() {
            let k = join(dir, &format!("vmlinuz-{v}"));
            if !regular(&k) {
                continue;
            }
            let initrd = [format!("initrd.img-{v}"), format!("initramfs-{v}.img")]
                .into_iter()
                .map(|n| join(dir, &n))
                .find(|p| regular(p));
            tracing::debug!(partition = part, kernel = %k, "newest versioned kernel");
            return Some((k, initrd));
        }
    }
    None
}

fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

fn canonical(fs: &Ext4, p: &str) -> Option<String> {
    let c = fs.canonicalize(p).ok()?;
    c.to_str().ok().map(str::to_string)
}

/// Orders kernel versions like `sort -V`: digit runs compare as numbers.
fn version_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    fn chunks(s: &str) -> Vec<(bool, &str)> {
        let mut out = Vec::new();
        let mut start = 0;
        let b = s.as_bytes();
        for i in 1..=b.len() {
            if i == b.len() || b[i].is_ascii_digit() != b[start].is_ascii_digit() {
                out.push((b[start].is_ascii_digit(), &s[start..i]));
                start = i;
            }
        }
        out
    }
    let (ca, cb) = (chunks(a), chunks(b));
    for (x, y) in ca.iter().zip(cb.iter()) {
        let o = match (x, y) {
            ((true, x), (true, y)) => {
                let (x, y) = (x.trim_start_matches('0'), y.trim_start_matches('0'));
                x.len().cmp(&y.len()).then_with(|| x.cmp(y))
            }
            ((_, x), (_, y)) => x.cmp(y),
        };
        if o.is_ne() {
            return o;
        }
    }
    ca.len().cmp(&cb.len())
}

fn read_capped(fs: &Ext4, file: &str, max: u64, shown: &str) -> Result<Vec<u8>, BootError> {
    let ext4 = |e: ext4_view::Ext4Error| BootError::DiskFile {
        path: shown.to_string(),
        reason: e.to_string(),
    };
    let len = fs.metadata(file).map_err(ext4)?.len();
    if len > max {
        return Err(BootError::DiskFileTooLarge {
            path: shown.to_string(),
            size: len,
            max,
        });
    }
    let data = fs.read(file).map_err(ext4)?;
    if data.len() as u64 != len {
        return Err(BootError::DiskFile {
            path: shown.to_string(),
            reason: format!("read {} bytes of a {len}-byte file", data.len()),
        });
    }
    Ok(data)
}

/// Accepts an x86_64 ELF or a bzImage with a 64-bit entry point.
pub fn check_x86_kernel(k: &[u8], path: &str) -> Result<(), BootError> {
    let bad = |reason: String| BootError::NotX86Kernel {
        path: path.to_string(),
        reason,
    };
    if k.starts_with(b"\x7fELF") {
        if k.len() < 20 {
            return Err(bad("a truncated ELF header".into()));
        }
        if k[4] != 2 {
            return Err(bad("a 32-bit ELF (x86_64 needs ELFCLASS64)".into()));
        }
        let machine = u16::from_le_bytes([k[18], k[19]]);
        if machine != 62 {
            return Err(bad(format!(
                "an ELF for machine {machine}, not x86_64 (62)"
            )));
        }
        return Ok(());
    }
    if k.len() >= 0x240 && k[0x1fe..0x200] == [0x55, 0xaa] && &k[0x202..0x206] == b"HdrS" {
        let version = u16::from_le_bytes([k[0x206], k[0x207]]);
        // xloadflags (boot protocol 2.12+) bit 0: the kernel has a 64-bit entry.
        let xloadflags = u16::from_le_bytes([k[0x236], k[0x237]]);
        if version < 0x020c || xloadflags & 1 == 0 {
            return Err(bad(format!(
                "a bzImage without a 64-bit entry point (boot protocol {}.{}, xloadflags {xloadflags:#x})",
                version >> 8,
                version & 0xff
            )));
        }
        return Ok(());
    }
    let head: Vec<String> = k.iter().take(4).map(|b| format!("{b:02x}")).collect();
    Err(bad(format!(
        "neither an ELF nor a bzImage (starts with {})",
        head.join(" ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_sort_numerically() {
        let mut v = vec![
            "6.1.0-9-amd64",
            "6.1.0-27-amd64",
            "5.10.0-30-amd64",
            "6.10.1",
        ];
        v.sort_by(|a, b| version_cmp(a, b));
        assert_eq!(
            v,
            [
                "5.10.0-30-amd64",
                "6.1.0-9-amd64",
                "6.1.0-27-amd64",
                "6.10.1"
            ]
        );
    }

    #[test]
    fn kernel_format_checks() {
        let mut elf = vec![0u8; 64];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[18] = 62;
        assert!(check_x86_kernel(&elf, "k").is_ok());
        elf[18] = 183; // aarch64
        let e = check_x86_kernel(&elf, "k").unwrap_err().to_string();
        assert!(e.contains("machine 183"), "{e}");
        elf[4] = 1;
        assert!(check_x86_kernel(&elf, "k").is_err());
        let mut bz = vec![0u8; 0x1000];
        bz[0x1fe] = 0x55;
        bz[0x1ff] = 0xaa;
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        bz[0x206] = 0x0f;
        bz[0x207] = 0x02;
        bz[0x236] = 1;
        assert!(check_x86_kernel(&bz, "k").is_ok());
        bz[0x236] = 0;
        let e = check_x86_kernel(&bz, "k").unwrap_err().to_string();
        assert!(e.contains("64-bit entry"), "{e}");
        let e = check_x86_kernel(b"#!/bin/sh\n", "k")
            .unwrap_err()
            .to_string();
        assert!(e.contains("neither an ELF nor a bzImage"), "{e}");
    }
}
