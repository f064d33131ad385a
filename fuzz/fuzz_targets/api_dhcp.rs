// SPDX-License-Identifier: Apache-2.0
//! Runs `sheaf_orchestrator::fuzzing::dhcp_case` (the node's DHCP server on
//! a hostile guest packet; a property test in the crate runs the same case
//! in the normal test suite).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    sheaf_orchestrator::fuzzing::dhcp_case(data);
});
