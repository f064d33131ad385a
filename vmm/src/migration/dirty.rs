// SPDX-License-Identifier: Apache-2.0
//! A set of guest pages to send: one bitmap per RAM region, filled from
//! KVM's dirty log and from the pages devices write (virtqueue rings and
//! device-writable buffers), which KVM's log does not see.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::devices::virtio::mmio::TransportState;
use crate::memory::{DirtyRegion, GuestMemory};

use super::wire::PAGE;

const VIRTQ_DESC_F_WRITE: u16 = 2;
const VIRTQ_DESC_F_INDIRECT: u16 = 4;
/// Descriptors of one indirect table read at most (the virtio limit of a queue).
const MAX_INDIRECT: u64 = 32768;

#[derive(Debug, Clone)]
struct Region {
    start: u64,
    pages: u64,
    bits: Vec<u64>,
}

/// Pages of guest RAM, by region.
#[derive(Debug, Clone)]
pub struct DirtySet {
    regions: Vec<Region>,
}

impl DirtySet {
    /// No page of `mem`.
    pub fn empty(mem: &GuestMemory) -> Self {
        DirtySet {
            regions: mem
                .iter()
                .map(|r| {
                    let pages = r.len() / PAGE as u64;
                    Region {
                        start: r.start_addr().0,
                        pages,
                        bits: vec![0; pages.div_ceil(64) as usize],
                    }
                })
                .collect(),
        }
    }

    /// Every page of `mem`.
    pub fn full(mem: &GuestMemory) -> Self {
        let mut s = Self::empty(mem);
        for r in &mut s.regions {
            for p in 0..r.pages {
                r.bits[(p / 64) as usize] |= 1 << (p % 64);
            }
        }
        s
    }

    /// Adds the pages of a KVM dirty log.
    pub fn add_log(&mut self, log: &[DirtyRegion]) {
        for d in log {
            let Some(r) = self.regions.iter_mut().find(|r| r.start == d.guest_addr) else {
                continue;
            };
            for (w, bits) in r.bits.iter_mut().zip(&d.bitmap) {
                *w |= bits;
            }
            // Bits past the region's last page are not pages.
            if !r.pages.is_multiple_of(64)
                && let Some(last) = r.bits.last_mut()
            {
                *last &= (1u64 << (r.pages % 64)) - 1;
            }
        }
    }

    /// Adds every page overlapping `[gpa, gpa + len)` that is guest RAM.
    pub fn add_range(&mut self, gpa: u64, len: u64) {
        if len == 0 {
            return;
        }
        let end = gpa.saturating_add(len);
        for r in &mut self.regions {
            let r_end = r.start + r.pages * PAGE as u64;
            let (a, b) = (gpa.max(r.start), end.min(r_end));
            if a >= b {
                continue;
            }
            let first = (a - r.start) / PAGE as u64;
            let last = (b - 1 - r.start) / PAGE as u64;
            for p in first..=last {
                r.bits[(p / 64) as usize] |= 1 << (p % 64);
            }
        }
    }

    /// Adds the pages virtio devices may have written behind KVM's back:
    /// each ready queue's rings and every device-writable buffer its
    /// descriptor table (and indirect tables) names. Guest data is only
    /// read here, bounded, and only used to choose pages to resend.
    pub fn add_device_pages(&mut self, mem: &GuestMemory, devices: &[TransportState]) {
        for q in devices.iter().flat_map(|d| &d.queues) {
            if !q.ready || q.size == 0 {
                continue;
            }
            let n = u64::from(q.size);
            self.add_range(q.desc_table, 16 * n);
            self.add_range(q.avail_ring, 6 + 2 * n);
            self.add_range(q.used_ring, 6 + 8 * n);
            self.add_descriptors(mem, q.desc_table, n, true);
        }
    }

    fn add_descriptors(&mut self, mem: &GuestMemory, table: u64, n: u64, follow_indirect: bool) {
        for i in 0..n {
            let mut d = [0u8; 16];
            let Some(at) = table.checked_add(16 * i) else {
                return;
            };
            if mem.read_slice(&mut d, GuestAddress(at)).is_err() {
                return;
            }
            let addr = u64::from_le_bytes(d[0..8].try_into().unwrap_or_default());
            let len = u32::from_le_bytes(d[8..12].try_into().unwrap_or_default());
            let flags = u16::from_le_bytes(d[12..14].try_into().unwrap_or_default());
            if flags & VIRTQ_DESC_F_INDIRECT != 0 {
                if follow_indirect {
                    let entries = (u64::from(len) / 16).min(MAX_INDIRECT);
                    self.add_descriptors(mem, addr, entries, false);
                }
            } else if flags & VIRTQ_DESC_F_WRITE != 0 {
                self.add_range(addr, u64::from(len));
            }
        }
    }

    /// Pages in the set.
    pub fn count(&self) -> u64 {
        self.regions
            .iter()
            .flat_map(|r| &r.bits)
            .map(|w| u64::from(w.count_ones()))
            .sum()
    }

    /// Guest addresses of the pages, ascending within each region.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.regions.iter().flat_map(|r| {
            r.bits.iter().enumerate().flat_map(move |(wi, &w)| {
                let mut w = w;
                std::iter::from_fn(move || {
                    if w == 0 {
                        return None;
                    }
                    let b = u64::from(w.trailing_zeros());
                    w &= w - 1;
                    Some(r.start + (wi as u64 * 64 + b) * PAGE as u64)
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[
            (GuestAddress(0), 0x10_0000),
            (GuestAddress(0x100_0000), 0x3000),
        ])
        .unwrap()
    }

    #[test]
    fn ranges_logs_and_iteration_agree() {
        let m = mem();
        assert_eq!(DirtySet::full(&m).count(), 256 + 3);
        let mut s = DirtySet::empty(&m);
        s.add_range(0xfff, 2); // two pages
        s.add_range(0x100_2000, 0x10_0000); // clipped to the region's last page
        s.add_range(0x50_0000, 4096); // not RAM
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 0x1000, 0x100_2000]);
        s.add_log(&[DirtyRegion {
            guest_addr: 0x100_0000,
            bitmap: vec![u64::MAX],
        }]);
        assert_eq!(s.count(), 2 + 3);
    }

    #[test]
    fn write_descriptors_are_resent() {
        let m = mem();
        // Descriptor 0: device-writable buffer at 0x8000 (5000 bytes);
        // descriptor 1: read-only at 0x20000.
        let mut d = [0u8; 32];
        d[0..8].copy_from_slice(&0x8000u64.to_le_bytes());
        d[8..12].copy_from_slice(&5000u32.to_le_bytes());
        d[12..14].copy_from_slice(&VIRTQ_DESC_F_WRITE.to_le_bytes());
        d[16..24].copy_from_slice(&0x20000u64.to_le_bytes());
        d[24..28].copy_from_slice(&512u32.to_le_bytes());
        m.write_slice(&d, GuestAddress(0x4000)).unwrap();
        let mut s = DirtySet::empty(&m);
        s.add_descriptors(&m, 0x4000, 2, true);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![0x8000, 0x9000]);
        // A table outside RAM is ignored, not an error.
        s.add_descriptors(&m, 0xffff_ffff_f000, 4, true);
        assert_eq!(s.count(), 2);
    }
}
