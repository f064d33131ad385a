// SPDX-License-Identifier: Apache-2.0
//! Fuzzes virtio-blk request framing, validation and execution directly:
//! arbitrary segments over guest memory holding arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sheaf_vmm::MemBackend;
use sheaf_vmm::devices::virtio::block::request::{self, DiskInfo, Segment};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const MEM: usize = 64 * 1024;

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let nseg = (data[0] % 10) as usize;
    let flags = data[1];
    let need = 2 + nseg * 13;
    if data.len() < need {
        return;
    }
    let mem = sheaf_vmm::memory::GuestMemory::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
    let _ = mem.write_slice(&data[need..data.len().min(need + MEM)], GuestAddress(0));
    let segs: Vec<Segment> = data[2..need]
        .chunks_exact(13)
        .map(|c| Segment {
            addr: u64::from_le_bytes(c[0..8].try_into().unwrap_or_default()) % (MEM as u64 + 4096),
            len: u32::from_le_bytes(c[8..12].try_into().unwrap_or_default()) % (MEM as u32 * 2),
            writable: c[12] & 1 == 1,
        })
        .collect();
    let disk = DiskInfo {
        sectors: 64,
        read_only: flags & 1 == 1,
        discard: flags & 2 == 2,
        write_zeroes: flags & 4 == 4,
    };
    let backend = MemBackend::new(64 * 512, "fuzz");
    let mut bounce = Vec::new();
    if let Ok(framed) = request::parse(&segs, &mem, &disk) {
        assert!(framed.status_addr < MEM as u64);
        if let Ok(req) = framed.request {
            let (status, written) = request::execute(&req, &mem, &backend, &disk, &mut bounce);
            assert!(status <= 2);
            assert!(u64::from(written) <= req.data_len);
        }
    }
});
