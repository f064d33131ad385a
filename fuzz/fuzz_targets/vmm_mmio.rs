// SPDX-License-Identifier: Apache-2.0
//! Fuzzes virtio-mmio register accesses: any sequence of reads, writes
//! (any offset, any size) and queue notifications from a hostile driver.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use sheaf_vmm::MemBackend;
use sheaf_vmm::devices::BusDevice;
use sheaf_vmm::devices::virtio::test_utils::Driver;

fuzz_target!(|data: &[u8]| {
    let mut d = Driver::new(Arc::new(MemBackend::new(4096, "fuzz")), 1 << 20);
    for op in data.chunks_exact(7) {
        // Bias offsets toward the register block.
        let off = if op[0] & 0x80 == 0 {
            u64::from(op[1]) & 0xfc
        } else {
            u64::from(u16::from_le_bytes([op[1], op[2]]))
        };
        let len = [1usize, 2, 4, 8][(op[0] & 3) as usize];
        let val = [op[3], op[4], op[5], op[6], 0, 0, 0, 0];
        match (op[0] >> 2) & 3 {
            0 => {
                let mut b = [0u8; 8];
                d.transport.read(off, &mut b[..len]);
            }
            3 => d.transport.notify(usize::from(op[3] & 1)),
            _ => d.transport.write(off, &val[..len]),
        }
    }
});
