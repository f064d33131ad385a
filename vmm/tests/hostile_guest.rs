// SPDX-License-Identifier: Apache-2.0
//! D6 (hostile guest): malformed descriptor chains, out-of-range addresses
//! and bad MMIO accesses give a device error or an error status — never a
//! host panic, hang or unbounded allocation. Drives the real virtio-mmio
//! transport and virtio-blk device through a scripted guest driver.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use proptest::prelude::*;
use sheaf_vmm::MemBackend;
use sheaf_vmm::devices::BusDevice;
use sheaf_vmm::devices::virtio::block::request::{self, DiskInfo, Segment};
use sheaf_vmm::devices::virtio::mmio::status;
use sheaf_vmm::devices::virtio::test_utils::{DATA, Driver, RawDesc};
use vm_memory::{Bytes, GuestAddress};

const NEXT: u16 = 1;
const WRITE: u16 = 2;
const INDIRECT: u16 = 4;
const MEM: usize = 1 << 20;

fn ready_driver() -> (Driver, Arc<MemBackend>) {
    let disk = Arc::new(MemBackend::new(64 * 512, "hostile"));
    let mut d = Driver::new(disk.clone(), MEM);
    assert!(d.negotiate(0));
    d.setup_queue(16);
    assert_eq!(d.status() & status::DRIVER_OK, status::DRIVER_OK);
    (d, disk)
}

/// header at DATA, data at DATA+0x100, status at DATA+0x1000.
fn three(d: &Driver, ty: u32, sector: u64, data: RawDesc) {
    d.header(DATA, ty, sector);
    d.set_desc(
        0,
        RawDesc {
            addr: DATA,
            len: 16,
            flags: NEXT,
            next: 1,
        },
    );
    d.set_desc(
        1,
        RawDesc {
            flags: data.flags | NEXT,
            next: 2,
            ..data
        },
    );
    d.set_desc(
        2,
        RawDesc {
            addr: DATA + 0x1000,
            len: 1,
            flags: WRITE,
            next: 0,
        },
    );
    d.mem
        .write_obj(0xffu8, GuestAddress(DATA + 0x1000))
        .unwrap();
}

fn status_byte(d: &Driver) -> u8 {
    d.mem.read_obj(GuestAddress(DATA + 0x1000)).unwrap()
}

#[test]
fn well_formed_requests_complete_with_interrupts() {
    let (mut d, disk) = ready_driver();
    d.mem
        .write_slice(&[0xab; 512], GuestAddress(DATA + 0x100))
        .unwrap();
    three(
        &d,
        1,
        3,
        RawDesc {
            addr: DATA + 0x100,
            len: 512,
            flags: 0,
            next: 0,
        },
    );
    d.kick(0);
    assert_eq!(d.used_idx(), 1);
    assert_eq!(status_byte(&d), 0);
    assert_eq!(&disk.contents()[3 * 512..4 * 512], &[0xab; 512]);
    assert_eq!(d.irq.read().unwrap(), 1, "interrupt raised");
    assert_eq!(d.r(0x60) & 1, 1);
    d.w(0x64, 1);
    assert_eq!(d.r(0x60), 0);

    three(
        &d,
        0,
        3,
        RawDesc {
            addr: DATA + 0x400,
            len: 512,
            flags: WRITE,
            next: 0,
        },
    );
    d.kick(0);
    assert_eq!(d.used_idx(), 2);
    assert_eq!(d.used_elem(1), (0, 513));
    let mut back = [0u8; 512];
    d.mem
        .read_slice(&mut back, GuestAddress(DATA + 0x400))
        .unwrap();
    assert_eq!(back, [0xab; 512]);
}

#[test]
fn bad_mmio_accesses_are_ignored() {
    let (mut d, _) = ready_driver();
    let before = d.status();
    for off in (0..0x100u64).chain([0xfff, 0x1000, u64::MAX - 3]) {
        for len in [1usize, 2, 3, 8] {
            let mut buf = vec![0x5au8; len];
            d.transport.read(off, &mut buf);
            d.transport.write(off, &buf);
        }
    }
    // Unaligned 4-byte accesses to the status register are dropped.
    d.transport.write(0x71, &[0; 4]);
    // Clearing status bits (other than a full reset) is refused.
    d.w(0x70, status::ACKNOWLEDGE);
    assert_eq!(d.status(), before);
    // The device still works.
    three(
        &d,
        4,
        0,
        RawDesc {
            addr: DATA + 0x100,
            len: 0,
            flags: 0,
            next: 0,
        },
    );
    d.set_desc(
        0,
        RawDesc {
            addr: DATA,
            len: 16,
            flags: NEXT,
            next: 2,
        },
    );
    d.kick(0);
    assert_eq!(status_byte(&d), 0);
}

#[test]
fn feature_negotiation_rejects_legacy_drivers_and_unknown_bits() {
    let disk = Arc::new(MemBackend::new(4096, "x"));
    let mut d = Driver::new(disk, MEM);
    d.w(0x70, status::ACKNOWLEDGE | status::DRIVER);
    d.w(0x24, 0);
    d.w(0x20, 0);
    d.w(
        0x70,
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
    );
    assert_eq!(d.status() & status::FEATURES_OK, 0, "no VERSION_1");
    assert!(!d.negotiate(1 << 30), "bit 30 is not offered");
    assert!(d.negotiate(0));
}

#[test]
fn invalid_queue_setup_sets_needs_reset_and_reset_recovers() {
    let disk = Arc::new(MemBackend::new(4096, "x"));
    let mut d = Driver::new(disk, MEM);
    assert!(d.negotiate(0));
    d.w(0x30, 0);
    d.w(0x38, 7); // not a power of two: ignored
    d.w(0x38, 4096); // above the maximum: ignored
    d.w(0x30, 99); // no such queue
    d.w(0x38, 8);
    assert_eq!(d.r(0x34), 0);
    d.w(0x30, 0);
    d.w(0x80, 0xffff_0000); // descriptor table outside guest memory
    d.w(0x84, 0xffff);
    d.w(0x44, 1);
    let s = d.status();
    d.w(0x70, s | status::DRIVER_OK);
    assert_ne!(d.status() & status::NEEDS_RESET, 0);
    assert_eq!(d.r(0x60) & 2, 2, "configuration interrupt");
    d.w(0x70, 0);
    assert_eq!(d.status(), 0);
    assert!(d.negotiate(0));
    d.setup_queue(8);
    assert_eq!(d.status() & status::NEEDS_RESET, 0);
}

#[test]
fn descriptor_loop_is_bounded() {
    let (mut d, _) = ready_driver();
    d.header(DATA, 0, 0);
    d.set_desc(
        0,
        RawDesc {
            addr: DATA,
            len: 16,
            flags: NEXT,
            next: 1,
        },
    );
    d.set_desc(
        1,
        RawDesc {
            addr: DATA + 0x100,
            len: 512,
            flags: NEXT | WRITE,
            next: 0,
        },
    );
    d.kick(0);
    // The walk stops after a queue's worth of descriptors; the chain is
    // answered (readable after writable: IOERR in the last writable byte).
    assert_eq!(d.used_idx(), 1);
    let st: u8 = d.mem.read_obj(GuestAddress(DATA + 0x100 + 511)).unwrap();
    assert_eq!(st, 1);
    assert_eq!(d.status() & status::NEEDS_RESET, 0);
    // A self-loop without a writable descriptor has no status: device error.
    d.set_desc(
        0,
        RawDesc {
            addr: DATA,
            len: 16,
            flags: NEXT,
            next: 0,
        },
    );
    d.kick(0);
    assert_ne!(d.status() & status::NEEDS_RESET, 0);
    // Further notifications are ignored until reset.
    d.kick(0);
    assert_eq!(d.used_idx(), 1);
}

#[test]
fn out_of_range_buffers_get_ioerr() {
    let (mut d, _) = ready_driver();
    for (addr, len) in [
        (MEM as u64 - 256, 512u32),
        (u64::MAX - 100, 512),
        (DATA, !511u32),
    ] {
        three(
            &d,
            0,
            0,
            RawDesc {
                addr,
                len,
                flags: WRITE,
                next: 0,
            },
        );
        d.kick(0);
        assert_eq!(status_byte(&d), 1, "IOERR for {addr:#x}+{len}");
        assert_eq!(d.status() & status::NEEDS_RESET, 0);
    }
    // Sector past the end, and an overflowing sector number.
    for sector in [64u64, u64::MAX] {
        three(
            &d,
            0,
            sector,
            RawDesc {
                addr: DATA + 0x100,
                len: 512,
                flags: WRITE,
                next: 0,
            },
        );
        d.kick(0);
        assert_eq!(status_byte(&d), 1);
    }
    // Unknown request type: UNSUPP.
    three(
        &d,
        0x4242,
        0,
        RawDesc {
            addr: DATA + 0x100,
            len: 512,
            flags: WRITE,
            next: 0,
        },
    );
    d.kick(0);
    assert_eq!(status_byte(&d), 2);
}

#[test]
fn lying_avail_index_and_bad_heads_fault_the_device() {
    let (mut d, _) = ready_driver();
    d.set_avail_idx(1000);
    d.transport.notify(0);
    assert_ne!(d.status() & status::NEEDS_RESET, 0);

    let (mut d, _) = ready_driver();
    d.kick(500); // head index beyond the queue
    assert_ne!(d.status() & status::NEEDS_RESET, 0);
}

#[test]
fn malformed_indirect_tables_fault_the_device() {
    let (mut d, _) = ready_driver();
    // Indirect table with a length that is not a multiple of 16.
    d.set_desc(
        0,
        RawDesc {
            addr: DATA,
            len: 17,
            flags: INDIRECT,
            next: 0,
        },
    );
    d.kick(0);
    assert_ne!(d.status() & status::NEEDS_RESET, 0);

    // A valid indirect table pointing at a request works.
    let (mut d, _) = ready_driver();
    let table = DATA + 0x2000;
    d.header(DATA, 4, 0);
    for (i, (addr, len, flags, next)) in [(DATA, 16u32, NEXT, 1u16), (DATA + 0x1000, 1, WRITE, 0)]
        .into_iter()
        .enumerate()
    {
        let a = table + i as u64 * 16;
        d.mem.write_obj(addr, GuestAddress(a)).unwrap();
        d.mem.write_obj(len, GuestAddress(a + 8)).unwrap();
        d.mem.write_obj(flags, GuestAddress(a + 12)).unwrap();
        d.mem.write_obj(next, GuestAddress(a + 14)).unwrap();
    }
    d.set_desc(
        0,
        RawDesc {
            addr: table,
            len: 32,
            flags: INDIRECT,
            next: 0,
        },
    );
    d.mem
        .write_obj(0xffu8, GuestAddress(DATA + 0x1000))
        .unwrap();
    d.kick(0);
    assert_eq!(d.status() & status::NEEDS_RESET, 0);
    assert_eq!(status_byte(&d), 0);
}

fn arb_desc() -> impl Strategy<Value = RawDesc> {
    (
        prop_oneof![0u64..(MEM as u64 + 4096), any::<u64>()],
        prop_oneof![0u32..2048, any::<u32>()],
        0u16..8,
        0u16..20,
    )
        .prop_map(|(addr, len, flags, next)| RawDesc {
            addr,
            len,
            flags,
            next,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Arbitrary descriptor tables and avail rings never panic the host, and
    /// every completion's length fits in the chain's writable bytes.
    #[test]
    fn arbitrary_descriptor_tables_never_panic(
        descs in proptest::collection::vec(arb_desc(), 16),
        heads in proptest::collection::vec(0u16..20, 1..6),
        payload in proptest::collection::vec(any::<u8>(), 16..64),
    ) {
        let (mut d, _) = ready_driver();
        d.mem.write_slice(&payload, GuestAddress(DATA)).unwrap();
        for (i, desc) in descs.iter().enumerate() {
            d.set_desc(i as u16, *desc);
        }
        for h in heads {
            d.kick(h);
        }
        let used = d.used_idx();
        prop_assert!(used <= 6);
        for i in 0..used {
            let (id, len) = d.used_elem(i);
            prop_assert!(id < 16);
            prop_assert!(len >= 1);
        }
    }

    /// The request parser accepts only chains whose every byte is in guest
    /// memory, and reports a status address inside memory.
    #[test]
    fn parser_only_accepts_in_range_chains(
        segs in proptest::collection::vec(
            (prop_oneof![0u64..(MEM as u64), any::<u64>()], prop_oneof![0u32..4096, any::<u32>()], any::<bool>()),
            0..8),
        ty in prop_oneof![0u32..16, any::<u32>()],
        sector in prop_oneof![0u64..128, any::<u64>()],
    ) {
        let mem = sheaf_vmm::memory::GuestMemory::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
        let segs: Vec<Segment> = segs.into_iter().map(|(addr, len, writable)| Segment { addr, len, writable }).collect();
        if let Some(first) = segs.first()
            && first.addr < MEM as u64 - 16
        {
            mem.write_obj(ty, GuestAddress(first.addr)).unwrap();
            mem.write_obj(sector, GuestAddress(first.addr + 8)).unwrap();
        }
        let disk = DiskInfo { sectors: 64, read_only: false, discard: true, write_zeroes: true };
        if let Ok(framed) = request::parse(&segs, &mem, &disk) {
            prop_assert!(framed.status_addr < MEM as u64);
            if let Ok(req) = framed.request {
                let total: u64 = req.data.iter().map(|s| u64::from(s.len)).sum();
                prop_assert_eq!(total, req.data_len);
                for s in &req.data {
                    prop_assert!(s.addr.checked_add(u64::from(s.len)).is_some_and(|e| e <= MEM as u64));
                }
                if matches!(req.ty, request::RequestType::In | request::RequestType::Out) {
                    prop_assert!(req.sector + req.data_len / 512 <= 64);
                }
            }
        }
    }
}

#[test]
fn event_idx_publishes_avail_event_and_suppresses_interrupts() {
    let disk = Arc::new(MemBackend::new(64 * 512, "evidx"));
    let mut d = Driver::new(disk, MEM);
    assert!(d.negotiate(1 << 29)); // VIRTIO_RING_F_EVENT_IDX
    d.setup_queue(16);
    // used_event (after the avail ring) = 0: interrupt after the first completion.
    let used_event = sheaf_vmm::devices::virtio::test_utils::AVAIL + 4 + 2 * 16;
    let avail_event = sheaf_vmm::devices::virtio::test_utils::USED + 4 + 8 * 16;
    d.mem.write_obj(0u16, GuestAddress(used_event)).unwrap();
    for i in 1..=3u16 {
        three(
            &d,
            4,
            0,
            RawDesc {
                addr: DATA + 0x100,
                len: 0,
                flags: 0,
                next: 0,
            },
        );
        d.set_desc(
            0,
            RawDesc {
                addr: DATA,
                len: 16,
                flags: NEXT,
                next: 2,
            },
        );
        d.kick(0);
        assert_eq!(d.used_idx(), i);
        // The device tells the driver to kick again for the next buffer.
        let ae: u16 = d.mem.read_obj(GuestAddress(avail_event)).unwrap();
        assert_eq!(ae, i, "avail_event after request {i}");
    }
    // Only the first completion crossed used_event = 0.
    assert_eq!(d.irq.read().unwrap(), 1);
    assert!(d.irq.read().is_err(), "later completions were suppressed");
}
