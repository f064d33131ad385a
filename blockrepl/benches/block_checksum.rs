// SPDX-License-Identifier: Apache-2.0
//! Per-block checksum candidates of the replica store, 4 KiB blocks, one
//! core: what a 1 MiB read, write or rebuild run pays per block.
//!
//! ```text
//! cargo bench -p sheaf-blockrepl --bench block_checksum
//! ```
#![allow(clippy::unwrap_used)]

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sheaf_blockrepl::types::BlockChecksum;
use std::hint::black_box;

const BLOCK: usize = 4096;
const BLOCKS: usize = 256; // 1 MiB

/// A checksum of block `lba` holding `data`.
type Alg = fn(u64, &[u8]) -> u32;

/// The store's algorithms (`BlockChecksum::Sha256`, `BlockChecksum::Xxh3`).
fn sha256(lba: u64, data: &[u8]) -> u32 {
    BlockChecksum::Sha256.block(lba, data)
}

fn xxh3_seeded(lba: u64, data: &[u8]) -> u32 {
    BlockChecksum::Xxh3.block(lba, data)
}

/// A variant: the address hashed as a prefix instead of as the seed.
fn xxh3_prefixed(lba: u64, data: &[u8]) -> u32 {
    let mut h = xxhash_rust::xxh3::Xxh3Default::new();
    h.update(&lba.to_le_bytes());
    h.update(data);
    let h = h.digest();
    (h ^ (h >> 32)) as u32
}

/// CRC32C for reference only: affine, unusable (see `BlockChecksum`).
fn crc32c_ref(lba: u64, data: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&lba.to_le_bytes()), data)
}

fn bench(c: &mut Criterion) {
    let data: Vec<u8> = (0..BLOCK * BLOCKS)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8)
        .collect();
    let mut g = c.benchmark_group("block_checksum_1MiB");
    g.throughput(Throughput::Bytes(data.len() as u64));
    let algs: [(&str, Alg); 4] = [
        ("sha256", sha256),
        ("xxh3_seeded", xxh3_seeded),
        ("xxh3_prefixed", xxh3_prefixed),
        ("crc32c_reference_only", crc32c_ref),
    ];
    for (name, f) in algs {
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut acc = 0u32;
                for (i, blk) in data.chunks_exact(BLOCK).enumerate() {
                    acc ^= f(black_box(1000 + i as u64), black_box(blk));
                }
                acc
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
