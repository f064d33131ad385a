// SPDX-License-Identifier: Apache-2.0
//! Fuzzes the replica store's on-disk parsers (superblock slots, per-block
//! metadata, WAL headers) and crash recovery.
//!
//! Random bytes almost never pass the superblock's CRC, so besides decoding
//! the raw input, the target builds a real store (a checkpointed layer,
//! then WAL records that are synced, then some that are not), lets the
//! input corrupt its files (overwrites at chosen offsets, a power loss that
//! keeps, drops or tears unsynced writes, truncation), and opens it again.
//! Recovery must succeed or fail with an error, never panic. (Whether a
//! block returned as good holds data written to it is not asserted: an
//! input can forge a WAL record with a matching CRC; the simulator checks
//! that property under non-malicious faults.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use sheaf_blockrepl::sim::disk::SimDisk;
use sheaf_blockrepl::sim::rng::Prng;
use sheaf_blockrepl::store::Store;
use sheaf_blockrepl::store::disk::StoreDir;
use sheaf_blockrepl::store::format::{BlockMeta, Superblock, WalHeader};
use sheaf_blockrepl::types::{ReplicaState, Tag};

const BLOCKS: u64 = 16;
const FILES: [&str; 5] = ["superblock", "wal", "wal.1", "layer-1.meta", "layer-1.data"];

/// Content of block `lba` written by write number `n`.
fn value(lba: u64, n: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8..16].copy_from_slice(&n.to_le_bytes());
    b[16..].fill(n as u8 ^ 0x5a);
    b
}

fuzz_target!(|data: &[u8]| {
    let _ = Superblock::decode(data);
    let _ = BlockMeta::decode(data);
    let _ = WalHeader::decode(data);
    if data.len() < 2 {
        return;
    }
    let disk = SimDisk::new(u64::from(data[0]));
    let Ok(mut store) = Store::create(Box::new(disk.clone()), BLOCKS, ReplicaState::Clean) else {
        return;
    };
    // Writes 1..=6 checkpointed, 7..=12 in the WAL and synced, 13..=16 unsynced.
    let mut n = 0u64;
    for phase in 0..3 {
        for _ in 0..[6, 6, 4][phase] {
            n += 1;
            let lba = (n * 7) % BLOCKS;
            if store
                .write(Tag::new(1, n), lba, 1, Some(&value(lba, n)))
                .is_err()
            {
                return;
            }
        }
        let r = match phase {
            0 => store.checkpoint(),
            1 => store.flush(),
            _ => Ok(()),
        };
        if r.is_err() {
            return;
        }
    }
    drop(store);
    // Mutations: [op, file, offset lo, offset hi, len, bytes...].
    let mut rest = &data[1..];
    while rest.len() >= 5 {
        let (op, file) = (rest[0], FILES[rest[1] as usize % FILES.len()]);
        let off = u64::from(u16::from_le_bytes([rest[2], rest[3]]));
        let len = (rest[4] as usize).min(rest.len() - 5);
        let bytes = &rest[5..5 + len];
        rest = &rest[5 + len..];
        let Ok(f) = disk.open(file, false) else {
            continue;
        };
        match op % 4 {
            0 => {
                let _ = f.write_at(bytes, off);
            }
            1 => {
                let _ = f.set_len(off);
            }
            2 => disk.power_loss(&mut Prng::new(off)),
            _ => {
                let _ = f.write_at(bytes, off);
                let _ = f.sync();
            }
        }
    }
    let Ok(s) = Store::open(Box::new(disk)) else {
        return;
    };
    // Every block reads back as data or as a reported bad block.
    let mut buf = vec![0u8; 4096];
    for lba in 0..s.size_blocks().min(BLOCKS) {
        let _ = s.read(lba, 1, &mut buf);
    }
    let _ = s.read_layer(1, 0, BLOCKS as u32, true);
});
