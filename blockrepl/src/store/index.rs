// SPDX-License-Identifier: Apache-2.0
//! In-memory block index of a layer and the dirty set of a WAL, both sparse
//! two-level tables over chunks of [`CHUNK_BLOCKS`] consecutive blocks.
//!
//! ```text
//!  BlockIndex  BTreeMap<chunk, ([u64; 8], Vec<E>)>      bitmap + packed entries
//!  DirtySet    BTreeMap<(layer, chunk), [u64; 8]>        one bit per block
//! ```
//!
//! Chunks are allocated on the first block written in them and freed when
//! their last block goes, so memory follows the blocks actually held (a
//! 1 TiB volume with 1 GiB written holds 512 chunks), not the volume size.
//! A run of blocks (a 1 MiB write is 256) costs one map lookup per chunk
//! instead of a hash insert per block.

use std::collections::BTreeMap;
use std::fmt;

/// Blocks per chunk.
pub(crate) const CHUNK_BLOCKS: u64 = 512;
const CHUNK: usize = CHUNK_BLOCKS as usize;
const WORDS: usize = CHUNK / 64;

fn split(lba: u64) -> (u64, usize) {
    (lba / CHUNK_BLOCKS, (lba % CHUNK_BLOCKS) as usize)
}

/// Splits `[lba, lba + n)` into `(chunk, first slot, slots)` pieces.
fn pieces(lba: u64, n: u64) -> impl Iterator<Item = (u64, usize, usize)> {
    let end = lba.saturating_add(n);
    let mut at = lba;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let (c, s) = split(at);
        let k = (CHUNK - s).min((end - at) as usize);
        at += k as u64;
        Some((c, s, k))
    })
}

/// The entries of one chunk: a presence bitmap and the present entries,
/// packed in slot order (memory follows the blocks held also when a chunk
/// holds one block: ~100 bytes, not 512 slots).
struct Chunk<E> {
    bits: [u64; WORDS],
    entries: Vec<E>,
}

impl<E: Copy> Chunk<E> {
    fn new() -> Self {
        Chunk {
            bits: [0; WORDS],
            entries: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    fn has(&self, s: usize) -> bool {
        self.bits[s / 64] & (1 << (s % 64)) != 0
    }

    /// Index in `entries` of slot `s` (present or not).
    fn rank(&self, s: usize) -> usize {
        if s >= CHUNK {
            return self.entries.len();
        }
        let w = s / 64;
        let below: u32 = self.bits[..w].iter().map(|b| b.count_ones()).sum();
        let part = self.bits[w] & ((1u64 << (s % 64)) - 1);
        (below + part.count_ones()) as usize
    }

    fn get(&self, s: usize) -> Option<&E> {
        self.has(s).then(|| &self.entries[self.rank(s)])
    }

    fn get_mut(&mut self, s: usize) -> Option<&mut E> {
        if !self.has(s) {
            return None;
        }
        let r = self.rank(s);
        Some(&mut self.entries[r])
    }

    fn put(&mut self, s: usize, e: E) {
        let r = self.rank(s);
        if self.has(s) {
            self.entries[r] = e;
        } else {
            self.entries.insert(r, e);
            self.bits[s / 64] |= 1 << (s % 64);
        }
    }

    /// Sets slots `s..s + k` to `f(slot)` each.
    fn put_run(&mut self, s: usize, k: usize, mut f: impl FnMut(usize) -> E) {
        let r = self.rank(s);
        let held = self.rank(s + k) - r;
        if held == k {
            // Overwrite in place.
            for (i, e) in self.entries[r..r + k].iter_mut().enumerate() {
                *e = f(s + i);
            }
        } else if r == self.len() {
            // Nothing at or past `s` yet: append (sequential writes).
            self.entries.reserve_exact(k);
            self.entries.extend((s..s + k).map(&mut f));
        } else {
            // Merge the run into the packed entries in one pass.
            let mut out = Vec::with_capacity(self.len() + k - held);
            out.extend_from_slice(&self.entries[..r]);
            out.extend((s..s + k).map(&mut f));
            out.extend_from_slice(&self.entries[r + held..]);
            self.entries = out;
        }
        for i in s..s + k {
            self.bits[i / 64] |= 1 << (i % 64);
        }
    }

    fn take(&mut self, s: usize) -> Option<E> {
        if !self.has(s) {
            return None;
        }
        let r = self.rank(s);
        self.bits[s / 64] &= !(1 << (s % 64));
        Some(self.entries.remove(r))
    }

    /// Drops slots `s..`.
    fn truncate(&mut self, s: usize) {
        let r = self.rank(s);
        self.entries.truncate(r);
        for i in s..CHUNK {
            self.bits[i / 64] &= !(1 << (i % 64));
        }
    }

    fn slots(&self) -> impl Iterator<Item = usize> + '_ {
        (0..CHUNK).filter(|&i| self.has(i))
    }
}

/// Sparse map from block address to entry.
pub(crate) struct BlockIndex<E> {
    chunks: BTreeMap<u64, Chunk<E>>,
}

impl<E> Default for BlockIndex<E> {
    fn default() -> Self {
        BlockIndex {
            chunks: BTreeMap::new(),
        }
    }
}

impl<E> fmt::Debug for BlockIndex<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let blocks: usize = self.chunks.values().map(|c| c.entries.len()).sum();
        f.debug_struct("BlockIndex")
            .field("chunks", &self.chunks.len())
            .field("blocks", &blocks)
            .finish()
    }
}

impl<E: Copy> BlockIndex<E> {
    pub(crate) fn get(&self, lba: u64) -> Option<&E> {
        let (c, s) = split(lba);
        self.chunks.get(&c)?.get(s)
    }

    pub(crate) fn get_mut(&mut self, lba: u64) -> Option<&mut E> {
        let (c, s) = split(lba);
        self.chunks.get_mut(&c)?.get_mut(s)
    }

    pub(crate) fn contains_key(&self, lba: u64) -> bool {
        self.get(lba).is_some()
    }

    pub(crate) fn insert(&mut self, lba: u64, e: E) {
        let (c, s) = split(lba);
        self.chunks.entry(c).or_insert_with(Chunk::new).put(s, e);
    }

    /// Sets blocks `lba..lba + n` to `f(lba)` each: one lookup per chunk.
    pub(crate) fn insert_run(&mut self, lba: u64, n: u64, mut f: impl FnMut(u64) -> E) {
        for (c, s, k) in pieces(lba, n) {
            let chunk = self.chunks.entry(c).or_insert_with(Chunk::new);
            chunk.put_run(s, k, |i| f(c * CHUNK_BLOCKS + i as u64));
        }
    }

    pub(crate) fn remove(&mut self, lba: u64) -> Option<E> {
        let (c, s) = split(lba);
        let chunk = self.chunks.get_mut(&c)?;
        let old = chunk.take(s);
        if chunk.len() == 0 {
            self.chunks.remove(&c);
        }
        old
    }

    /// Addresses held, ascending.
    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.chunks
            .iter()
            .flat_map(|(&c, chunk)| chunk.slots().map(move |i| c * CHUNK_BLOCKS + i as u64))
    }

    /// Addresses held in `[start, end)`, ascending.
    pub(crate) fn keys_in(&self, start: u64, end: u64) -> impl Iterator<Item = u64> + '_ {
        self.chunks
            .range(start / CHUNK_BLOCKS..end.div_ceil(CHUNK_BLOCKS))
            .flat_map(|(&c, chunk)| chunk.slots().map(move |i| c * CHUNK_BLOCKS + i as u64))
            .filter(move |&b| b >= start && b < end)
    }

    /// Drops every block at or past `end`.
    pub(crate) fn truncate(&mut self, end: u64) {
        let (c, s) = split(end);
        let _ = self.chunks.split_off(&(c + u64::from(s > 0)));
        if s > 0
            && let Some(chunk) = self.chunks.get_mut(&c)
        {
            chunk.truncate(s);
            if chunk.len() == 0 {
                self.chunks.remove(&c);
            }
        }
    }
}

/// Set of `(layer, lba)`, iterated in that order; runs of blocks are set a
/// chunk at a time.
#[derive(Default)]
pub(crate) struct DirtySet {
    chunks: BTreeMap<(u64, u64), [u64; WORDS]>,
}

impl fmt::Debug for DirtySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DirtySet")
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

impl DirtySet {
    /// Adds blocks `lba..lba + n` of `layer`.
    pub(crate) fn insert_run(&mut self, layer: u64, lba: u64, n: u64) {
        for (c, s, k) in pieces(lba, n) {
            let bits = self.chunks.entry((layer, c)).or_insert([0; WORDS]);
            for i in s..s + k {
                bits[i / 64] |= 1 << (i % 64);
            }
        }
    }

    /// Whether `(layer, lba)` is in the set.
    #[cfg(test)]
    pub(crate) fn contains(&self, layer: u64, lba: u64) -> bool {
        let (c, s) = split(lba);
        self.chunks
            .get(&(layer, c))
            .is_some_and(|b| b[s / 64] & (1 << (s % 64)) != 0)
    }

    /// `(layer, lba)` pairs, ascending.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.chunks.iter().flat_map(|(&(layer, c), bits)| {
            bits.iter().enumerate().flat_map(move |(w, &word)| {
                let mut word = word;
                std::iter::from_fn(move || {
                    if word == 0 {
                        return None;
                    }
                    let b = word.trailing_zeros() as u64;
                    word &= word - 1;
                    Some((layer, c * CHUNK_BLOCKS + w as u64 * 64 + b))
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};

    use super::*;
    use crate::sim::rng::Prng;

    #[test]
    fn index_matches_a_hash_map() {
        let mut rng = Prng::new(7);
        let mut idx = BlockIndex::<u32>::default();
        let mut model = HashMap::new();
        for step in 0..20_000u32 {
            let lba = rng.below(5_000);
            match rng.below(4) {
                0 => {
                    idx.insert(lba, step);
                    model.insert(lba, step);
                }
                1 => {
                    let n = 1 + rng.below(700);
                    idx.insert_run(lba, n, |b| b as u32 ^ step);
                    for b in lba..lba + n {
                        model.insert(b, b as u32 ^ step);
                    }
                }
                2 => assert_eq!(idx.remove(lba), model.remove(&lba)),
                _ => {
                    if let Some(e) = idx.get_mut(lba) {
                        *e += 1;
                    }
                    if let Some(e) = model.get_mut(&lba) {
                        *e += 1;
                    }
                }
            }
            if step % 5_000 == 0 {
                let end = 2_000 + rng.below(3_000);
                idx.truncate(end);
                model.retain(|&b, _| b < end);
            }
        }
        let mut want: Vec<u64> = model.keys().copied().collect();
        want.sort_unstable();
        assert_eq!(idx.keys().collect::<Vec<_>>(), want);
        for b in 0..6_000 {
            assert_eq!(idx.get(b), model.get(&b));
            assert_eq!(idx.contains_key(b), model.contains_key(&b));
        }
        // Emptied chunks are freed.
        for b in want {
            idx.remove(b);
        }
        assert!(idx.chunks.is_empty());
    }

    #[test]
    fn memory_follows_written_blocks_not_volume_size() {
        let mut idx = BlockIndex::<u64>::default();
        // 1 GiB written at the far end of a 1 TiB volume.
        let start = (1u64 << 28) - (1 << 18);
        idx.insert_run(start, 1 << 18, |b| b);
        assert_eq!(idx.chunks.len(), (1 << 18) / CHUNK);
        assert_eq!(idx.get(start + 5), Some(&(start + 5)));
        assert_eq!(idx.get(5), None);
        // One block in each of 1,000 chunks: one packed entry each.
        let mut sparse = BlockIndex::<u64>::default();
        for c in 0..1_000 {
            sparse.insert(c * CHUNK_BLOCKS * 3 + 7, c);
        }
        assert!(sparse.chunks.values().all(|c| c.entries.capacity() <= 4));
    }

    #[test]
    fn runs_overwrite_append_and_merge_in_any_order() {
        let mut idx = BlockIndex::<u64>::default();
        let mut model = HashMap::new();
        let mut put = |idx: &mut BlockIndex<u64>, lba: u64, n: u64, v: u64| {
            idx.insert_run(lba, n, |b| b * 10 + v);
            for b in lba..lba + n {
                model.insert(b, b * 10 + v);
            }
            for b in 0..2_048 {
                assert_eq!(idx.get(b), model.get(&b), "block {b}");
            }
        };
        // Descending runs (merge at the front), a run over all of it
        // (overwrite and merge), ascending (append), single blocks.
        for (i, lba) in [900u64, 700, 500, 100].into_iter().enumerate() {
            put(&mut idx, lba, 150, i as u64);
        }
        put(&mut idx, 0, 2_048, 5);
        put(&mut idx, 3, 509, 6);
        put(&mut idx, 511, 2, 7);
        idx.truncate(1_000);
        assert_eq!(idx.keys().count(), 1_000);
        assert_eq!(idx.get(999), Some(&(999 * 10 + 5)));
        assert_eq!(idx.get(1_000), None);
    }

    #[test]
    fn dirty_set_iterates_in_layer_lba_order() {
        let mut rng = Prng::new(3);
        let mut d = DirtySet::default();
        let mut model = BTreeSet::new();
        for _ in 0..2_000 {
            let layer = 1 + rng.below(3);
            let lba = rng.below(3_000);
            let n = 1 + rng.below(600);
            d.insert_run(layer, lba, n);
            model.extend((lba..lba + n).map(|b| (layer, b)));
        }
        assert_eq!(
            d.iter().collect::<Vec<_>>(),
            model.iter().copied().collect::<Vec<_>>()
        );
        assert!(d.contains(1, model.iter().next().map_or(0, |x| x.1)) || model.is_empty());
    }
}
