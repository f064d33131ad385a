// SPDX-License-Identifier: Apache-2.0
//! Kernel loading and boot information: ELF (vmlinux, PVH note) and bzImage
//! through linux-loader, the initramfs, the command line, and either Linux
//! `boot_params` (with its e820 map) or a PVH `hvm_start_info`. The kernel
//! and initramfs come from host files or, with disk boot ([`disk`]), from
//! inside the VM's own disk image.

pub mod disk;
pub mod reader;

use std::fs::File;
use std::io::{Cursor, Read, Seek, SeekFrom};
use std::path::Path;

use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::elf::PvhBootCapability;
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::{BzImage, Elf, KernelLoader, KernelLoaderResult};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, ReadVolatile};

use crate::arch::x86_64::{Entry, layout};
use crate::config::{BootProtocol, KernelConfig};
use crate::memory::GuestMemory;

/// Errors from kernel and initramfs loading.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootError {
    /// The kernel file could not be opened or read.
    #[error("cannot read kernel image {path}")]
    OpenKernel {
        /// Image path.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// linux-loader rejected the image.
    #[error("cannot load kernel image {path}")]
    LoadKernel {
        /// Image path.
        path: String,
        /// Cause.
        #[source]
        source: linux_loader::loader::Error,
    },
    /// PVH was requested but the ELF has no PVH note (or is a bzImage).
    #[error("PVH boot requested but {path} has no PVH entry note")]
    NoPvhEntry {
        /// Image path.
        path: String,
    },
    /// The initramfs could not be opened or read.
    #[error("cannot read initramfs {path}")]
    OpenInitramfs {
        /// Image path.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The initramfs does not fit between the kernel and the top of low RAM.
    #[error("initramfs of {size} bytes does not fit in guest memory")]
    InitramfsTooLarge {
        /// Initramfs size.
        size: u64,
    },
    /// The command line is too long.
    #[error("kernel command line of {len} bytes exceeds {max}")]
    CmdlineTooLong {
        /// Length including the NUL terminator.
        len: usize,
        /// Maximum accepted.
        max: usize,
    },
    /// Writing boot structures to guest memory failed.
    #[error("cannot write boot structures to guest memory")]
    WriteGuestMemory(#[source] vm_memory::GuestMemoryError),
    /// Reading the boot disk failed.
    #[error("cannot read boot disk {disk}")]
    DiskRead {
        /// Disk index.
        disk: usize,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The boot disk has neither a GPT nor an MBR partition table.
    #[error("boot disk {disk} has no partition table: {detail}")]
    NoPartitionTable {
        /// Disk index.
        disk: usize,
        /// What was found instead.
        detail: String,
    },
    /// The partition table is corrupt.
    #[error("boot disk {disk}: the {kind} partition table is invalid: {reason}")]
    BadPartitionTable {
        /// Disk index.
        disk: usize,
        /// `GPT` or `MBR`.
        kind: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The configured partition does not exist.
    #[error("boot disk {disk} has no partition {partition} (it has {found})")]
    NoSuchPartition {
        /// Disk index.
        disk: usize,
        /// Requested partition number.
        partition: u32,
        /// Partitions found.
        found: usize,
    },
    /// No partition holds an ext4 file system.
    #[error("boot disk {disk}: none of its {partitions} partition(s) holds an ext4 file system")]
    NoRootFilesystem {
        /// Disk index.
        disk: usize,
        /// Partitions examined.
        partitions: usize,
    },
    /// No ext4 file system holds a kernel.
    #[error(
        "boot disk {disk}: no kernel in the ext4 file system(s) of partition(s) {partitions:?} \
         (looked for /boot/vmlinuz, /vmlinuz and vmlinuz-<version> in /boot or at the root)"
    )]
    KernelNotFound {
        /// Disk index.
        disk: usize,
        /// Partitions searched.
        partitions: Vec<u32>,
    },
    /// The kernel found is not an x86_64 ELF or a 64-bit bzImage.
    #[error("{path} is not an x86_64 kernel: {reason}")]
    NotX86Kernel {
        /// Where it was found.
        path: String,
        /// What it is instead.
        reason: String,
    },
    /// A file on the boot disk could not be read.
    #[error("cannot read {path} from the boot disk: {reason}")]
    DiskFile {
        /// Where.
        path: String,
        /// Cause.
        reason: String,
    },
    /// A file on the boot disk is larger than a kernel or initramfs may be.
    #[error("{path} on the boot disk is {size} bytes, more than the {max} allowed")]
    DiskFileTooLarge {
        /// Where.
        path: String,
        /// Its size.
        size: u64,
        /// The cap.
        max: u64,
    },
}

/// Where the kernel and initramfs come from.
#[derive(Debug, Clone, Copy)]
pub enum BootFiles<'a> {
    /// Host files named by the [`KernelConfig`].
    Host,
    /// Found inside the boot disk.
    Disk(&'a disk::DiskBootFiles),
}

/// The e820 type of usable RAM.
pub const E820_RAM: u32 = 1;
/// The e820 type of reserved memory.
pub const E820_RESERVED: u32 = 2;

/// The guest memory map handed to the kernel.
pub fn e820_map(mem: &GuestMemory) -> Vec<(u64, u64, u32)> {
    let mut map = vec![
        (0, layout::EBDA_START, E820_RAM),
        (
            layout::EBDA_START,
            layout::HIMEM_START - layout::EBDA_START,
            E820_RESERVED,
        ),
    ];
    for r in mem.iter() {
        use vm_memory::GuestMemoryRegion;
        let start = r.start_addr().0.max(layout::HIMEM_START);
        let end = r.start_addr().0 + r.len();
        if end > start {
            map.push((start, end - start, E820_RAM));
        }
    }
    map
}

/// Where things were loaded.
#[derive(Debug, Clone, Copy)]
pub struct Loaded {
    /// How the boot vCPU enters the kernel.
    pub entry: Entry,
    /// Initramfs location and size, if any.
    pub initramfs: Option<(u64, u64)>,
}

/// Loads the kernel and initramfs, writes the command line and boot
/// information, and returns the entry point.
pub fn load(
    mem: &GuestMemory,
    cfg: &KernelConfig,
    files: BootFiles<'_>,
    cmdline: &str,
    rsdp_addr: u64,
) -> Result<Loaded, BootError> {
    match files {
        BootFiles::Host => {
            let path = cfg.path.display().to_string();
            let kernel = File::open(&cfg.path).map_err(|source| BootError::OpenKernel {
                path: path.clone(),
                source,
            })?;
            let initramfs = cfg.initramfs.as_deref().map(Initramfs::Path);
            load_from(mem, cfg, kernel, path, initramfs, cmdline, rsdp_addr)
        }
        BootFiles::Disk(d) => {
            let initramfs = d.initramfs.as_deref().map(Initramfs::Bytes);
            let kernel = Cursor::new(d.kernel.as_slice());
            load_from(
                mem,
                cfg,
                kernel,
                d.kernel_path.clone(),
                initramfs,
                cmdline,
                rsdp_addr,
            )
        }
    }
}

/// An initramfs to load.
enum Initramfs<'a> {
    Path(&'a Path),
    Bytes(&'a [u8]),
}

fn load_from<K: Read + Seek + ReadVolatile>(
    mem: &GuestMemory,
    cfg: &KernelConfig,
    mut kernel: K,
    path: String,
    initramfs: Option<Initramfs<'_>>,
    cmdline: &str,
    rsdp_addr: u64,
) -> Result<Loaded, BootError> {
    let mut magic = [0u8; 4];
    kernel
        .read_exact(&mut magic)
        .and_then(|_| kernel.seek(SeekFrom::Start(0)))
        .map_err(|source| BootError::OpenKernel {
            path: path.clone(),
            source,
        })?;
    let is_elf = magic == *b"\x7fELF";
    let himem = Some(GuestAddress(layout::HIMEM_START));
    let res: KernelLoaderResult = if is_elf {
        Elf::load(mem, None, &mut kernel, himem)
    } else {
        BzImage::load(mem, None, &mut kernel, himem)
    }
    .map_err(|source| BootError::LoadKernel {
        path: path.clone(),
        source,
    })?;

    let entry = match cfg.boot_protocol {
        BootProtocol::Linux64 if is_elf => Entry::Linux64 {
            rip: res.kernel_load.0,
        },
        // The 64-bit entry of a bzImage is 0x200 past its protected-mode start.
        BootProtocol::Linux64 => Entry::Linux64 {
            rip: res.kernel_load.0 + 0x200,
        },
        BootProtocol::Pvh => match res.pvh_boot_cap {
            PvhBootCapability::PvhEntryPresent(addr) if is_elf => Entry::Pvh { rip: addr.0 },
            _ => return Err(BootError::NoPvhEntry { path }),
        },
    };

    // Command line (NUL terminated).
    let max = crate::config::MAX_CMDLINE_LEN;
    if cmdline.len() + 1 > max {
        return Err(BootError::CmdlineTooLong {
            len: cmdline.len() + 1,
            max,
        });
    }
    let mut bytes = cmdline.as_bytes().to_vec();
    bytes.push(0);
    mem.write_slice(&bytes, GuestAddress(layout::CMDLINE_ADDR))
        .map_err(BootError::WriteGuestMemory)?;

    let initrd_max = res
        .setup_header
        .map(|h| u64::from(h.initrd_addr_max))
        .filter(|&m| m != 0)
        .unwrap_or(layout::INITRD_MAX);
    let initramfs = match initramfs {
        Some(Initramfs::Path(p)) => Some(load_initramfs(mem, p, res.kernel_end, initrd_max)?),
        Some(Initramfs::Bytes(b)) => Some(place_initramfs(mem, b, res.kernel_end, initrd_max)?),
        None => None,
    };

    let map = e820_map(mem);
    match entry {
        Entry::Linux64 { .. } => {
            let mut params = boot_params::default();
            if let Some(hdr) = res.setup_header {
                params.hdr = hdr;
            } else {
                params.hdr.kernel_alignment = 0x0100_0000;
            }
            params.hdr.type_of_loader = 0xff;
            params.hdr.boot_flag = 0xaa55;
            params.hdr.header = 0x5372_6448; // "HdrS"
            params.hdr.cmd_line_ptr = layout::CMDLINE_ADDR as u32;
            params.hdr.cmdline_size = cmdline.len() as u32;
            if let Some((addr, size)) = initramfs {
                params.hdr.ramdisk_image = addr as u32;
                params.hdr.ramdisk_size = size as u32;
            }
            params.acpi_rsdp_addr = rsdp_addr;
            for (i, &(addr, size, ty)) in map.iter().enumerate().take(params.e820_table.len()) {
                params.e820_table[i] = boot_e820_entry {
                    addr,
                    size,
                    r#type: ty,
                };
                params.e820_entries = i as u8 + 1;
            }
            mem.write_obj(params, GuestAddress(layout::ZERO_PAGE_ADDR))
                .map_err(BootError::WriteGuestMemory)?;
        }
        Entry::Pvh { .. } => {
            let modlist = layout::PVH_MEMMAP_ADDR + 0x1c0;
            let mut info = hvm_start_info {
                magic: 0x336e_c578,
                version: 1,
                cmdline_paddr: layout::CMDLINE_ADDR,
                rsdp_paddr: rsdp_addr,
                memmap_paddr: layout::PVH_MEMMAP_ADDR,
                memmap_entries: map.len() as u32,
                ..Default::default()
            };
            for (i, &(addr, size, ty)) in map.iter().enumerate() {
                let e = hvm_memmap_table_entry {
                    addr,
                    size,
                    type_: ty,
                    reserved: 0,
                };
                mem.write_obj(e, GuestAddress(layout::PVH_MEMMAP_ADDR + i as u64 * 24))
                    .map_err(BootError::WriteGuestMemory)?;
            }
            if let Some((paddr, size)) = initramfs {
                let m = hvm_modlist_entry {
                    paddr,
                    size,
                    ..Default::default()
                };
                mem.write_obj(m, GuestAddress(modlist))
                    .map_err(BootError::WriteGuestMemory)?;
                info.nr_modules = 1;
                info.modlist_paddr = modlist;
            }
            mem.write_obj(info, GuestAddress(layout::PVH_INFO_ADDR))
                .map_err(BootError::WriteGuestMemory)?;
        }
    }
    Ok(Loaded { entry, initramfs })
}

fn load_initramfs(
    mem: &GuestMemory,
    path: &Path,
    kernel_end: u64,
    initrd_max: u64,
) -> Result<(u64, u64), BootError> {
    let name = path.display().to_string();
    let mut f = File::open(path).map_err(|source| BootError::OpenInitramfs {
        path: name.clone(),
        source,
    })?;
    let size = f
        .metadata()
        .map_err(|source| BootError::OpenInitramfs {
            path: name.clone(),
            source,
        })?
        .len();
    let addr = initramfs_addr(mem, size, kernel_end, initrd_max)?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut f, size as usize)
        .map_err(BootError::WriteGuestMemory)?;
    Ok((addr, size))
}

fn place_initramfs(
    mem: &GuestMemory,
    data: &[u8],
    kernel_end: u64,
    initrd_max: u64,
) -> Result<(u64, u64), BootError> {
    let size = data.len() as u64;
    let addr = initramfs_addr(mem, size, kernel_end, initrd_max)?;
    mem.write_slice(data, GuestAddress(addr))
        .map_err(BootError::WriteGuestMemory)?;
    Ok((addr, size))
}

/// The highest page-aligned address below the end of low RAM (and the
/// kernel's `initrd_addr_max`) where `size` bytes fit above the kernel.
fn initramfs_addr(
    mem: &GuestMemory,
    size: u64,
    kernel_end: u64,
    initrd_max: u64,
) -> Result<u64, BootError> {
    let low_end = mem
        .iter()
        .map(|r| {
            use vm_memory::GuestMemoryRegion;
            r.start_addr().0 + r.len()
        })
        .next()
        .unwrap_or(0)
        .min(initrd_max + 1);
    low_end
        .checked_sub(size)
        .map(|a| a & !0xfff)
        .filter(|&a| a >= kernel_end.max(layout::HIMEM_START))
        .ok_or(BootError::InitramfsTooLarge { size })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e820_has_low_ram_bios_hole_and_high_ram() {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        let m = e820_map(&mem);
        assert_eq!(m[0], (0, 0x9fc00, E820_RAM));
        assert_eq!(m[1], (0x9fc00, 0x100000 - 0x9fc00, E820_RESERVED));
        assert_eq!(m[2], (0x100000, (64 << 20) - 0x100000, E820_RAM));
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn initramfs_goes_to_top_of_low_ram() {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("initrd");
        std::fs::write(&p, vec![0xabu8; 5000]).unwrap();
        let (addr, size) = load_initramfs(&mem, &p, 0x200000, layout::INITRD_MAX).unwrap();
        assert_eq!(size, 5000);
        assert_eq!(addr % 4096, 0);
        assert!(addr + size <= 16 << 20);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(addr + 4999)).unwrap(), 0xab);
        // Too large for the space above the kernel.
        std::fs::write(&p, vec![0u8; 15 << 20]).unwrap();
        assert!(matches!(
            load_initramfs(&mem, &p, 0x200000, layout::INITRD_MAX),
            Err(BootError::InitramfsTooLarge { .. })
        ));
    }
}
