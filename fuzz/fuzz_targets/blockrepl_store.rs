// SPDX-License-Identifier: Apache-2.0
//! Fuzzes the replica store's on-disk parsers (superblock slots, per-block
//! metadata, WAL headers) and recovery: a store directory whose files hold
//! arbitrary bytes must open with an error or recover, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sheaf_blockrepl::sim::disk::SimDisk;
use sheaf_blockrepl::store::Store;
use sheaf_blockrepl::store::disk::StoreDir;
use sheaf_blockrepl::store::format::{BlockMeta, Superblock, WalHeader};

fuzz_target!(|data: &[u8]| {
    let _ = Superblock::decode(data);
    let _ = BlockMeta::decode(data);
    let _ = WalHeader::decode(data);
    if data.len() < 3 {
        return;
    }
    // Split the input into superblock, WAL and layer-1 meta/data contents.
    let n = data.len();
    let (a, b) = (n / 4, n / 2);
    let disk = SimDisk::new(1);
    for (name, bytes) in [
        ("superblock", &data[..a]),
        ("wal", &data[a..b]),
        ("layer-1.meta", &data[b..]),
        ("layer-1.data", &data[b..]),
    ] {
        if let Ok(mut f) = disk.open(name, true) {
            let _ = f.write_at(bytes, 0);
        }
    }
    if let Ok(s) = Store::open(Box::new(disk)) {
        let mut buf = vec![0u8; 4096];
        for lba in 0..s.size_blocks().min(16) {
            let _ = s.read(lba, 1, &mut buf);
        }
    }
});
