// SPDX-License-Identifier: Apache-2.0
//! Guest RAM: creation (anonymous or memfd), KVM memslots, dirty-page log.
//!
//! Dirty pages come from two places. KVM logs the pages vCPUs write
//! (`KVM_MEM_LOG_DIRTY_PAGES`); the VMM's own writes into guest RAM (virtio
//! devices: block read data, net rx buffers, used rings) do not go through
//! the MMU KVM watches, so every region also carries a vm-memory
//! [`AtomicBitmap`], one bit per 4 KiB page, which vm-memory sets on every
//! write through its API (`write_slice`, `write_obj`, `store`,
//! `VolatileSlice` writes). A write that bypasses vm-memory (io_uring
//! reading a disk straight into a host address) must mark its range with
//! [`mark_dirty`] once it completed. [`dirty_log`] returns the union and
//! clears both. Without `track_dirty_pages` the bitmaps are empty (zero
//! pages long), so marking costs a bounds check and nothing is recorded.

use std::fs::File;
use std::num::NonZeroUsize;
use std::os::fd::FromRawFd;

use kvm_bindings::{KVM_MEM_LOG_DIRTY_PAGES, kvm_userspace_memory_region};
use kvm_ioctls::VmFd;
use vm_memory::bitmap::{AtomicBitmap, Bitmap};
use vm_memory::mmap::{FromRangesError, MmapRegionBuilder};
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap,
};

use crate::arch::x86_64::layout;
use crate::config::{MemoryBacking, MemoryConfig};

/// Guest memory type used throughout the crate: mmap-backed regions, each
/// with a dirty bitmap of the VMM's own writes (see the module docs).
pub type GuestMemory = GuestMemoryMmap<AtomicBitmap>;

/// Page size of the dirty bitmaps (and of KVM's dirty log).
pub const DIRTY_PAGE_SIZE: usize = 4096;

/// A dirty bitmap for a region of `len` bytes: one bit per page when
/// `track`, else zero pages long (marks are ignored).
fn region_bitmap(len: usize, track: bool) -> AtomicBitmap {
    const PAGE: NonZeroUsize = NonZeroUsize::new(DIRTY_PAGE_SIZE).unwrap();
    AtomicBitmap::new(if track { len } else { 0 }, PAGE)
}

/// Marks `[addr, addr + len)` dirty in the VMM-write bitmaps, for a write
/// into guest RAM that did not go through vm-memory (io_uring, raw host
/// pointers). Call it after the write completed; parts outside RAM are
/// ignored.
pub fn mark_dirty(mem: &GuestMemory, addr: GuestAddress, len: usize) {
    for slice in mem.get_slices(addr, len).flatten() {
        slice.bitmap().mark_dirty(0, slice.len());
    }
}

/// Errors from guest memory setup.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// memfd_create or ftruncate failed.
    #[error("cannot create the memfd backing guest RAM")]
    CreateMemfd(#[source] std::io::Error),
    /// Mapping guest RAM failed.
    #[error("cannot map {size_mib} MiB of guest RAM")]
    Map {
        /// Requested size.
        size_mib: u64,
        /// Cause.
        #[source]
        source: vm_memory::mmap::FromRangesError,
    },
    /// KVM_SET_USER_MEMORY_REGION failed.
    #[error("cannot register memory slot {slot} with KVM")]
    SetMemorySlot {
        /// Slot index.
        slot: u32,
        /// Cause.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// Guest RAM and the file that backs it, if any.
#[derive(Debug)]
pub struct GuestRam {
    /// The mapped memory.
    pub mem: GuestMemory,
    /// The memfd backing RAM (for sharing with vhost-user backends).
    pub memfd: Option<File>,
    /// Whether KVM logs dirty pages for the slots.
    pub dirty_logging: bool,
}

impl GuestRam {
    /// Maps guest RAM according to `cfg`.
    pub fn new(cfg: &MemoryConfig) -> Result<Self, MemoryError> {
        let size = cfg.size_mib << 20;
        let regions = layout::ram_regions(size);
        let memfd = match cfg.backing {
            MemoryBacking::Anonymous => None,
            MemoryBacking::Memfd => Some(create_memfd(size)?),
        };
        let mut offset = 0u64;
        let ranges: Vec<(GuestAddress, usize, Option<FileOffset>)> = regions
            .iter()
            .map(|&(base, len)| {
                let fo = memfd
                    .as_ref()
                    .and_then(|f| f.try_clone().ok().map(|f| FileOffset::new(f, offset)));
                offset += len;
                (GuestAddress(base), len as usize, fo)
            })
            .collect();
        if memfd.is_some() && ranges.iter().any(|r| r.2.is_none()) {
            return Err(MemoryError::CreateMemfd(std::io::Error::last_os_error()));
        }
        let mem = map_ranges(ranges, cfg.track_dirty_pages).map_err(|source| MemoryError::Map {
            size_mib: cfg.size_mib,
            source,
        })?;
        Ok(GuestRam {
            mem,
            memfd,
            dirty_logging: cfg.track_dirty_pages,
        })
    }

    /// Registers every region as a KVM memory slot (slot = region index).
    pub fn register(&self, vm: &VmFd) -> Result<(), MemoryError> {
        for (slot, region) in self.mem.iter().enumerate() {
            let host = self
                .mem
                .get_host_address(region.start_addr())
                .map_err(|_| MemoryError::SetMemorySlot {
                    slot: slot as u32,
                    source: kvm_ioctls::Error::new(libc::EFAULT),
                })?;
            let r = kvm_userspace_memory_region {
                slot: slot as u32,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
                flags: if self.dirty_logging {
                    KVM_MEM_LOG_DIRTY_PAGES
                } else {
                    0
                },
            };
            // SAFETY: the host range [host, host + len) is a live mapping
            // owned by `self.mem`, which outlives the VM (the Vm keeps both
            // and drops the VmFd first), and slots do not overlap.
            unsafe { vm.set_user_memory_region(r) }.map_err(|source| {
                MemoryError::SetMemorySlot {
                    slot: slot as u32,
                    source,
                }
            })?;
        }
        Ok(())
    }

    /// Total RAM in bytes.
    pub fn size(&self) -> u64 {
        self.mem.iter().map(|r| r.len()).sum()
    }
}

/// Maps the ranges as vm-memory's `from_ranges_with_files` does (anonymous:
/// private, file: shared; no reserve), each region with its dirty bitmap.
fn map_ranges(
    ranges: Vec<(GuestAddress, usize, Option<FileOffset>)>,
    track: bool,
) -> Result<GuestMemory, FromRangesError> {
    let regions = ranges
        .into_iter()
        .map(|(addr, len, fo)| {
            let b = MmapRegionBuilder::new_with_bitmap(len, region_bitmap(len, track))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE);
            let b = match fo {
                Some(fo) => b
                    .with_file_offset(fo)
                    .with_mmap_flags(libc::MAP_NORESERVE | libc::MAP_SHARED),
                None => {
                    b.with_mmap_flags(libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_PRIVATE)
                }
            };
            GuestRegionMmap::new(b.build()?, addr).ok_or(FromRangesError::InvalidGuestRegion)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(GuestMemoryMmap::from_regions(regions)?)
}

fn create_memfd(size: u64) -> Result<File, MemoryError> {
    let name = c"sheaf-guest-ram";
    // SAFETY: memfd_create takes a valid NUL-terminated name and flags; the
    // return value is checked before use.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(MemoryError::CreateMemfd(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).map_err(MemoryError::CreateMemfd)?;
    Ok(file)
}

/// Dirty pages of one memory region since the previous call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirtyRegion {
    /// Guest physical start of the region.
    pub guest_addr: u64,
    /// Bitmap, one bit per 4 KiB page, LSB first.
    pub bitmap: Vec<u64>,
}

impl DirtyRegion {
    /// Number of dirty pages.
    pub fn count(&self) -> u64 {
        self.bitmap.iter().map(|w| u64::from(w.count_ones())).sum()
    }
}

/// Reads and clears the VMM-write bitmaps of every region (one word per
/// 64 pages, LSB first, like KVM's log). Each word is swapped out
/// atomically: a concurrent write is either in this result or stays for
/// the next call, never lost. vm-memory marks after the data is written,
/// so a page read after this call holds at least what was marked.
pub fn take_vmm_dirty(mem: &GuestMemory) -> Vec<DirtyRegion> {
    mem.iter()
        .map(|r| DirtyRegion {
            guest_addr: r.start_addr().0,
            bitmap: vm_memory::MmapRegion::bitmap(r).get_and_reset(),
        })
        .collect()
}

/// Reads and clears KVM's dirty log (vCPU writes) and the VMM-write
/// bitmaps (device writes) for every region; returns their union.
pub(crate) fn dirty_log(
    vm: &VmFd,
    mem: &GuestMemory,
) -> Result<Vec<DirtyRegion>, kvm_ioctls::Error> {
    let mut log = mem
        .iter()
        .enumerate()
        .map(|(slot, r)| {
            Ok(DirtyRegion {
                guest_addr: r.start_addr().0,
                bitmap: vm.get_dirty_log(slot as u32, r.len() as usize)?,
            })
        })
        .collect::<Result<Vec<_>, kvm_ioctls::Error>>()?;
    for (d, v) in log.iter_mut().zip(take_vmm_dirty(mem)) {
        if d.bitmap.len() < v.bitmap.len() {
            d.bitmap.resize(v.bitmap.len(), 0);
        }
        for (w, b) in d.bitmap.iter_mut().zip(&v.bitmap) {
            *w |= b;
        }
    }
    Ok(log)
}

#[cfg(test)]
mod tests {
    use vm_memory::Bytes;

    use super::*;

    /// One dirty pass as the migration takes it (KVM log ∪ bitmaps).
    fn pass(vm: &VmFd, ram: &GuestRam) -> Vec<u64> {
        let mut pages = Vec::new();
        for r in dirty_log(vm, &ram.mem).unwrap() {
            for (wi, w) in r.bitmap.iter().enumerate() {
                for b in 0..64 {
                    if w & (1 << b) != 0 {
                        pages.push(r.guest_addr + (wi as u64 * 64 + b) * DIRTY_PAGE_SIZE as u64);
                    }
                }
            }
        }
        pages
    }

    #[test]
    fn vmm_writes_are_in_the_next_dirty_pass() {
        if !std::path::Path::new("/dev/kvm").exists() {
            eprintln!("SKIP: no /dev/kvm");
            return;
        }
        let kvm = kvm_ioctls::Kvm::new().unwrap();
        let vm = kvm.create_vm().unwrap();
        let ram = GuestRam::new(&MemoryConfig {
            size_mib: 4,
            backing: MemoryBacking::Anonymous,
            track_dirty_pages: true,
        })
        .unwrap();
        ram.register(&vm).unwrap();
        assert!(pass(&vm, &ram).is_empty());
        // A device write through vm-memory (what virtio devices and the
        // threads engine do): KVM never sees it, the bitmap does.
        ram.mem
            .write_slice(&[0xab; 4097], GuestAddress(0x3_0000))
            .unwrap();
        ram.mem.write_obj(1u16, GuestAddress(0x5_0002)).unwrap();
        assert_eq!(pass(&vm, &ram), vec![0x3_0000, 0x3_1000, 0x5_0000]);
        assert!(pass(&vm, &ram).is_empty(), "a pass clears the bitmap");
        // A raw host-pointer write (what io_uring does): invisible until
        // marked, then in the next pass.
        let host = ram.mem.get_host_address(GuestAddress(0x7_0000)).unwrap();
        // SAFETY: the address is inside a live 4 MiB mapping of `ram`.
        unsafe { std::ptr::write_bytes(host, 0xcd, 8192) };
        assert!(pass(&vm, &ram).is_empty(), "raw writes bypass every log");
        mark_dirty(&ram.mem, GuestAddress(0x7_0000), 8192);
        assert_eq!(pass(&vm, &ram), vec![0x7_0000, 0x7_1000]);
        // Without tracking, marks are dropped and nothing is recorded.
        let off = GuestRam::new(&MemoryConfig {
            size_mib: 4,
            backing: MemoryBacking::Anonymous,
            track_dirty_pages: false,
        })
        .unwrap();
        off.mem.write_slice(&[1; 64], GuestAddress(0x1000)).unwrap();
        mark_dirty(&off.mem, GuestAddress(0x2000), 4096);
        assert!(take_vmm_dirty(&off.mem).iter().all(|r| r.bitmap.is_empty()));
    }

    #[test]
    fn memfd_backing_is_shared_with_the_file() {
        use std::os::unix::fs::FileExt;
        let ram = GuestRam::new(&MemoryConfig {
            size_mib: 4,
            backing: MemoryBacking::Memfd,
            track_dirty_pages: false,
        })
        .unwrap();
        ram.mem
            .write_obj(0xdead_beef_u32, GuestAddress(0x1000))
            .unwrap();
        let mut buf = [0u8; 4];
        ram.memfd
            .as_ref()
            .unwrap()
            .read_exact_at(&mut buf, 0x1000)
            .unwrap();
        assert_eq!(u32::from_le_bytes(buf), 0xdead_beef);
        assert_eq!(ram.size(), 4 << 20);
    }
}
