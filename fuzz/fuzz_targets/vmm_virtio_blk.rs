// SPDX-License-Identifier: Apache-2.0
//! Fuzzes the virtio-blk request path end to end: a guest-controlled
//! descriptor table, avail ring and buffer contents, processed by the real
//! virtio-mmio transport and virtio-blk device over an in-memory disk,
//! inline or on a thread pool (requests in flight, completed out of
//! order), with an optional queue re-setup and device reset while requests
//! are still in flight.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use sheaf_vmm::MemBackend;
use sheaf_vmm::devices::virtio::block::ThreadPoolBackend;
use sheaf_vmm::devices::virtio::test_utils::{DATA, Driver, RawDesc};
use vm_memory::{Bytes, GuestAddress};

const MEM: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    // 16 descriptors x 16 bytes, then up to 8 heads, then buffer bytes.
    if data.len() < 16 * 16 + 1 {
        return;
    }
    let (descs, rest) = data.split_at(16 * 16);
    let mode = rest[0] >> 3;
    let nheads = (rest[0] % 8) as usize + 1;
    let rest = &rest[1..];
    let (heads, payload) = rest.split_at(nheads.min(rest.len()));
    let disk = Arc::new(MemBackend::new(64 * 512, "fuzz"));
    let mut d = if mode & 1 == 0 {
        Driver::new(disk, MEM)
    } else {
        let Ok(pool) = ThreadPoolBackend::new(disk, 3) else {
            return;
        };
        Driver::new_async(Arc::new(pool), MEM)
    };
    if !d.negotiate(1 << 29) {
        return;
    }
    d.setup_queue(16);
    let _ = d
        .mem
        .write_slice(&payload[..payload.len().min(8192)], GuestAddress(DATA));
    for (i, c) in descs.chunks_exact(16).enumerate() {
        let mut addr = u64::from_le_bytes(c[0..8].try_into().unwrap_or_default());
        // Keep most addresses near the buffers so requests get deep.
        if c[15] & 0x80 == 0 {
            addr = DATA + (addr % 0x4000);
        }
        d.set_desc(
            i as u16,
            RawDesc {
                addr,
                len: u32::from_le_bytes(c[8..12].try_into().unwrap_or_default()) % 0x10000,
                flags: u16::from_le_bytes([c[12], c[13]]) & 7,
                next: u16::from(c[14]) % 20,
            },
        );
    }
    for &h in heads {
        d.kick(u16::from(h) % 20);
    }
    if mode & 2 != 0 {
        // The guest reprograms the live queue while requests run.
        d.setup_queue(8);
        d.kick(0);
    }
    if mode & 4 != 0 {
        // Reset with requests in flight: must wait for the backend, then
        // leave guest memory alone.
        d.w(0x70, 0);
        let mut before = vec![0u8; 0x8000];
        let _ = d.mem.read_slice(&mut before, GuestAddress(DATA));
        let _ = d.transport.queue_evts()[0].read();
        d.transport.notify(0);
        let mut after = vec![0u8; 0x8000];
        let _ = d.mem.read_slice(&mut after, GuestAddress(DATA));
        assert!(before == after, "guest memory written after reset");
    } else {
        // Let the pool finish: process completions a few times.
        for _ in 0..4 {
            let _ = d.transport.queue_evts()[0].read();
            d.transport.notify(0);
        }
    }
    let _ = d.used_idx();
});
