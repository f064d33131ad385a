// SPDX-License-Identifier: Apache-2.0
//! Helpers of the backup tests: deterministic block content and a local
//! store volume with tagged writes and snapshots.
#![allow(dead_code, clippy::unwrap_used)]

use sheaf_blockrepl::store::Store;
use sheaf_blockrepl::store::disk::StdDir;
use sheaf_blockrepl::types::ReplicaState;
use sheaf_blockrepl::{BLOCK_SIZE, Tag};

/// Deterministic block content: half compressible text, half noise.
pub fn block(seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK_SIZE];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for (i, b) in v.iter_mut().enumerate() {
        if i < BLOCK_SIZE / 2 {
            *b = b"sheaf backup "[i % 13];
        } else {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
    }
    v[..8].copy_from_slice(&seed.to_le_bytes());
    v
}

/// A store in a temporary directory.
pub struct Vol {
    _dir: tempfile::TempDir,
    pub store: Store,
    tag: u64,
    next_layer: u64,
}

impl Vol {
    pub fn new(blocks: u64) -> Vol {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::create(
            Box::new(StdDir::new(dir.path()).unwrap()),
            blocks,
            ReplicaState::Clean,
        )
        .unwrap();
        Vol {
            _dir: dir,
            store,
            tag: 0,
            next_layer: 2,
        }
    }

    /// The next write tag.
    pub fn tag(&mut self) -> Tag {
        self.tag += 1;
        Tag::new(1, self.tag)
    }

    /// Writes blocks `[lba, lba + n)` with content seeded by `generation`,
    /// in pieces of at most 1024 blocks.
    pub fn write(&mut self, lba: u64, n: u64, generation: u64) {
        let mut at = lba;
        while at < lba + n {
            let k = (lba + n - at).min(1024);
            let mut data = Vec::with_capacity(k as usize * BLOCK_SIZE);
            for b in at..at + k {
                data.extend_from_slice(&block(b * 1000 + generation));
            }
            let t = self.tag();
            self.store.write(t, at, k as u32, Some(&data)).unwrap();
            at += k;
        }
    }

    pub fn snapshot(&mut self, name: &str) {
        let t = self.tag();
        let id = self.next_layer;
        self.next_layer += 1;
        self.store.snapshot(t, name, id).unwrap();
    }

    /// Every byte of snapshot `name`.
    pub fn snapshot_bytes(&self, name: &str) -> Vec<u8> {
        let layers = self.store.info().layers;
        let layer = layers.iter().find(|l| l.name == name).unwrap().id;
        let n = self.store.size_blocks();
        let mut out = vec![0u8; n as usize * BLOCK_SIZE];
        assert!(
            self.store
                .read_snapshot(layer, 0, n as u32, &mut out)
                .unwrap()
                .is_empty()
        );
        out
    }
}
