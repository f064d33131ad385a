// SPDX-License-Identifier: Apache-2.0
//! Multi-queue virtio-blk: a driver using two queues at once gets every
//! completion on the queue its request came from.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use sheaf_vmm::MemBackend;
use sheaf_vmm::devices::virtio::block::{ThreadPoolBackend, VirtioBlock};
use sheaf_vmm::devices::virtio::test_utils::{DATA, Driver, RawDesc};
use vm_memory::{Bytes, GuestAddress};

const MEM: usize = 4 << 20;
const DESC1: u64 = 0x30_0000;
const AVAIL1: u64 = 0x31_0000;
const USED1: u64 = 0x32_0000;
const Q1: u16 = 64;
const MQ: u32 = 1 << 12;

fn slot(q: usize, i: u16) -> u64 {
    DATA + (q as u64 * 32 + u64::from(i)) * 0x1000
}

/// Writes request `i` of queue `q` (descriptors 3i..3i+2 of that queue's
/// table): a 512-byte write of `(q, i)`-specific bytes to `sector`.
fn post(d: &mut Driver, q: usize, i: u16, sector: u64, avail1: &mut u16) {
    let base = slot(q, i);
    d.header(base + 0x900, 1, sector);
    d.mem
        .write_slice(&[(q * 64) as u8 + i as u8 + 1; 512], GuestAddress(base))
        .unwrap();
    d.mem.write_obj(0xffu8, GuestAddress(base + 0x800)).unwrap();
    let h = 3 * i;
    let descs = [
        RawDesc {
            addr: base + 0x900,
            len: 16,
            flags: 1,
            next: h + 1,
        },
        RawDesc {
            addr: base,
            len: 512,
            flags: 1,
            next: h + 2,
        },
        RawDesc {
            addr: base + 0x800,
            len: 1,
            flags: 2,
            next: 0,
        },
    ];
    if q == 0 {
        for (k, desc) in descs.into_iter().enumerate() {
            d.set_desc(h + k as u16, desc);
        }
        d.kick(h);
        return;
    }
    for (k, desc) in descs.into_iter().enumerate() {
        let a = DESC1 + u64::from(h + k as u16) * 16;
        d.mem.write_obj(desc.addr, GuestAddress(a)).unwrap();
        d.mem.write_obj(desc.len, GuestAddress(a + 8)).unwrap();
        d.mem.write_obj(desc.flags, GuestAddress(a + 12)).unwrap();
        d.mem.write_obj(desc.next, GuestAddress(a + 14)).unwrap();
    }
    let at = AVAIL1 + 4 + 2 * u64::from(*avail1 % Q1);
    d.mem.write_obj(h, GuestAddress(at)).unwrap();
    *avail1 = avail1.wrapping_add(1);
    d.mem.write_obj(*avail1, GuestAddress(AVAIL1 + 2)).unwrap();
    d.transport.notify(1);
}

fn used1(d: &Driver) -> u16 {
    d.mem.read_obj(GuestAddress(USED1 + 2)).unwrap()
}

fn used1_elem(d: &Driver, k: u16) -> u32 {
    d.mem
        .read_obj(GuestAddress(USED1 + 4 + 8 * u64::from(k % Q1)))
        .unwrap()
}

#[test]
fn two_queues_complete_each_request_on_its_own_queue() {
    let disk = Arc::new(MemBackend::new(64 * 512, "mq"));
    let pool = ThreadPoolBackend::new(disk.clone(), 4).unwrap();
    let mut d = Driver::with_device(VirtioBlock::new_multiqueue(Arc::new(pool), 2), MEM);
    // Offered: MQ, and num_queues = 2 at config offset 34.
    d.w(0x14, 0);
    assert_ne!(d.r(0x10) & MQ, 0, "VIRTIO_BLK_F_MQ offered");
    assert_eq!(d.r(0x100 + 32) >> 16, 2, "num_queues");
    assert!(d.negotiate(MQ));
    // Queue 1 first (queues cannot change after DRIVER_OK).
    d.w(0x30, 1);
    assert_eq!(d.r(0x34), 256, "queue 1 exists");
    d.w(0x38, u32::from(Q1));
    for (off, addr) in [(0x80, DESC1), (0x90, AVAIL1), (0xa0, USED1)] {
        d.w(off, addr as u32);
        d.w(off + 4, 0);
    }
    d.w(0x44, 1);
    d.setup_queue(128);
    d.w(0x30, 2);
    assert_eq!(d.r(0x34), 0, "no queue 2");

    const N: u16 = 16;
    let mut avail1 = 0u16;
    for i in 0..N {
        post(&mut d, 0, i, u64::from(i), &mut avail1);
        post(&mut d, 1, i, 32 + u64::from(i), &mut avail1);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.used_idx() != N || used1(&d) != N {
        assert!(
            Instant::now() < deadline,
            "queue 0: {}, queue 1: {} of {N}",
            d.used_idx(),
            used1(&d)
        );
        let mut any = false;
        for q in 0..2 {
            if d.transport.queue_evts()[q].read().is_ok() {
                d.transport.notify(q);
                any = true;
            }
        }
        if !any {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let want: Vec<u32> = (0..N).map(|i| 3 * u32::from(i)).collect();
    for (q, mut heads) in [
        (0, (0..N).map(|k| d.used_elem(k).0).collect::<Vec<_>>()),
        (1, (0..N).map(|k| used1_elem(&d, k)).collect()),
    ] {
        heads.sort_unstable();
        assert_eq!(heads, want, "queue {q} got exactly its own requests");
    }
    let c = disk.contents();
    for q in 0..2usize {
        for i in 0..N {
            let st: u8 = d.mem.read_obj(GuestAddress(slot(q, i) + 0x800)).unwrap();
            assert_eq!(st, 0, "queue {q} request {i}");
            let s = (q * 32 + usize::from(i)) * 512;
            assert!(
                c[s..s + 512]
                    .iter()
                    .all(|&b| b == (q * 64) as u8 + i as u8 + 1),
                "sector of queue {q} request {i}"
            );
        }
    }
}

#[test]
fn one_queue_devices_do_not_offer_mq() {
    let pool = ThreadPoolBackend::new(Arc::new(MemBackend::new(4096, "sq")), 1).unwrap();
    let mut d = Driver::new_async(Arc::new(pool), 1 << 20);
    d.w(0x14, 0);
    assert_eq!(d.r(0x10) & MQ, 0);
    d.w(0x30, 1);
    assert_eq!(d.r(0x34), 0, "no queue 1");
}
