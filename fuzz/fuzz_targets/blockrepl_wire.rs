// SPDX-License-Identifier: Apache-2.0
//! Fuzzes the replication wire codec: any frame payload must decode to a
//! message or a `DecodeError`, never panic; decoded messages re-encode to
//! bytes that decode to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sheaf_blockrepl::proto::msg::{ReqFrame, RespFrame};

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = ReqFrame::decode(data) {
        let again = ReqFrame::decode(&f.encode()).expect("re-encoded request decodes");
        assert_eq!(again, f);
    }
    if let Ok(f) = RespFrame::decode(data) {
        let again = RespFrame::decode(&f.encode()).expect("re-encoded response decodes");
        assert_eq!(again, f);
    }
});
