// SPDX-License-Identifier: Apache-2.0
//! Fuzzes the vhost-user-blk backend's request path on guest-controlled
//! input: a descriptor chain (addresses, lengths, flags) and the guest
//! memory it points at (request header, payload, discard ranges), split by
//! `parse_request` and checked against the device by `plan_request`, the
//! two steps the backend runs before any I/O. Besides "never panics", the
//! plan must stay inside the device and match the chain.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sheaf_blockrepl::frontend::vhost_user::{
    BlkWork, MAX_DATA, MAX_RANGES, SECTOR, parse_request, plan_request,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// Guest memory: one region, with unmapped space below and above it.
const BASE: u64 = 0x1000;
const LEN: usize = 0x10000;
const F_WRITE: u16 = 2;

fuzz_target!(|data: &[u8]| {
    if data.len() < 10 {
        return;
    }
    let size = u64::from_le_bytes(data[..8].try_into().unwrap_or_default()) % (1 << 34);
    let read_only = data[8] & 1 == 1;
    let ndesc = usize::from(data[9] % 12);
    let rest = &data[10..];
    let (descs, contents) = rest.split_at((ndesc * 8).min(rest.len()));
    let Ok(mem) = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(BASE), LEN)]) else {
        return;
    };
    let _ = mem.write_slice(&contents[..contents.len().min(LEN)], GuestAddress(BASE));
    let chain: Vec<Descriptor> = descs
        .chunks_exact(8)
        .map(|c| {
            let raw = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            // Most addresses land in (or just past) guest memory so chains
            // get deep; some go anywhere, up to the top of the address space.
            let addr = if c[7] & 0x80 == 0 {
                BASE + u64::from(raw) % (LEN as u64 + 64)
            } else {
                u64::from(raw) << (c[6] % 33)
            };
            let len = u32::from_le_bytes([c[4], c[5], c[6] & 0x1f, 0]);
            let flags = if c[7] & 1 == 1 { F_WRITE } else { 0 };
            Descriptor::new(addr, len, flags, 0)
        })
        .collect();
    let Ok(req) = parse_request(chain.into_iter(), &mem) else {
        return;
    };
    assert!(mem.address_in_range(req.status), "status byte is mapped");
    let inside = |o: u64, l: u64| o.checked_add(l).is_some_and(|e| e <= size);
    match plan_request(&req, &mem, size, read_only) {
        BlkWork::Read { offset, len } => {
            let len = len as u64;
            assert!(len <= MAX_DATA && len % SECTOR == 0 && inside(offset, len));
            assert_eq!(len, req.writable_len());
        }
        BlkWork::Write { offset, data } => {
            let len = data.len() as u64;
            assert!(!read_only);
            assert!(len <= MAX_DATA && len % SECTOR == 0 && inside(offset, len));
            assert_eq!(len, req.readable_len());
        }
        BlkWork::Ranges { ranges, .. } => {
            assert!(!read_only);
            assert!(!ranges.is_empty() && ranges.len() <= MAX_RANGES as usize);
            for (o, l) in ranges {
                assert!(inside(o, l) && o % SECTOR == 0 && l % SECTOR == 0);
            }
        }
        _ => {}
    }
});
