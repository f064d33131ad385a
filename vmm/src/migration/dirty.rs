// SPDX-License-Identifier: Apache-2.0
//! A set of guest pages to send: one bitmap per RAM region, filled from
//! [`crate::Vm::dirty_pages`], which is KVM's dirty log (vCPU writes) ∪
//! vm-memory's dirty bitmap (device writes: virtqueue used rings, block
//! read data, net rx buffers; see [`crate::memory`]).

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::memory::{DirtyRegion, GuestMemory};

use super::wire::PAGE;

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
    use vm_memory::GuestAddress;

    use super::*;

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[
            (GuestAddress(0), 0x10_0000),
            (GuestAddress(0x100_0000), 0x3000),
        ])
        .unwrap()
    }

    #[test]
    fn logs_and_iteration_agree() {
        let m = mem();
        assert_eq!(DirtySet::full(&m).count(), 256 + 3);
        let mut s = DirtySet::empty(&m);
        s.add_log(&[
            DirtyRegion {
                guest_addr: 0,
                bitmap: vec![0b11, 0, 0, 1 << 63],
            },
            // Bits past the region's last page are not pages.
            DirtyRegion {
                guest_addr: 0x100_0000,
                bitmap: vec![u64::MAX],
            },
            // Not a region.
            DirtyRegion {
                guest_addr: 0x50_0000,
                bitmap: vec![1],
            },
        ]);
        assert_eq!(s.count(), 3 + 3);
        assert_eq!(
            s.iter().collect::<Vec<_>>(),
            vec![0, 0x1000, 0xff000, 0x100_0000, 0x100_1000, 0x100_2000]
        );
    }

    #[test]
    fn vmm_writes_show_in_the_bitmaps_and_are_taken_once() {
        use vm_memory::Bytes;
        let m = mem();
        m.write_slice(&[1; 5000], GuestAddress(0x8000)).unwrap();
        m.write_obj(7u16, GuestAddress(0x100_2000)).unwrap();
        let mut s = DirtySet::empty(&m);
        s.add_log(&crate::memory::take_vmm_dirty(&m));
        assert_eq!(
            s.iter().collect::<Vec<_>>(),
            vec![0x8000, 0x9000, 0x100_2000]
        );
        let mut again = DirtySet::empty(&m);
        again.add_log(&crate::memory::take_vmm_dirty(&m));
        assert_eq!(again.count(), 0);
    }
}
