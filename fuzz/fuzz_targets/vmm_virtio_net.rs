// SPDX-License-Identifier: Apache-2.0
//! Fuzzes the virtio-net device end to end: guest-controlled descriptor
//! tables, buffer offers on both queues, frames arriving from a real
//! datagram-socket backend, host wake-ups and resets, through the real
//! virtio-mmio transport (the case itself is
//! `sheaf_vmm::devices::virtio::test_utils::net_fuzz_case`, also run by a
//! property test in the crate).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    sheaf_vmm::devices::virtio::test_utils::net_fuzz_case(data);
});
