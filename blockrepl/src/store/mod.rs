// SPDX-License-Identifier: Apache-2.0
//! The replica store: one volume's copy on local files.
//!
//! ```text
//!  superblock   two 4 KiB slots, written alternately (generation + CRC)
//!  wal          write-ahead log: every mutation is appended here first
//!  wal.1        the second WAL: appended to while the other one is sealed
//!               and checkpointed off the write path (see `Store::seal`)
//!  layer-N.data sparse data file of layer N (block b at b * 4096)
//!  layer-N.meta per-block metadata of layer N (tag, CRC covering the address)
//! ```
//!
//! Layers form a copy-on-write chain: snapshots at the bottom, the head on
//! top; reads take each block from the topmost layer that holds it.
//!
//! Every write is appended to the WAL (header + data, one CRC over the header
//! and the blocks' checksums, or over the data in stores without the
//! superblock's `wal_sums` flag) and is durable
//! once [`Store::flush`] has synced the WAL. A *checkpoint* copies the WAL's
//! blocks into the layer files, syncs them, then writes a superblock with the
//! new position and a new WAL generation; only then may WAL space be reused.
//! Layer files are therefore only written with data that is already durable
//! in the WAL, so a torn or lost layer write is repaired by replaying the WAL
//! on open, and a torn WAL tail is simply an unflushed write that never
//! happened. Recovery replays the longest valid prefix of the WAL and then
//! checkpoints, so stale records are never replayed twice.

pub mod disk;
pub mod format;
mod index;

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;

use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::types::{
    BLOCK_SIZE, BLOCK_SIZE_U64, BlockChecksum, BlockTag, LayerInfo, MAX_LAYERS, MAX_NAME_LEN,
    ReplicaInfo, ReplicaState, Tag,
};
use disk::{StoreDir, StoreFile};
use format::{
    BlockMeta, META_DAMAGED, META_EXTENT, META_PRESENT, META_SIZE, META_ZERO, SB_SLOT, SbError,
    Superblock, WAL_HDR, WalHeader, WalKind,
};
use index::{BlockIndex, DirtySet};

const SB_NAME: &str = "superblock";
/// The two WAL files: the store appends to one while the other, sealed,
/// is checkpointed (file 1 only holds live records while the superblock
/// has its `two_wal` flag). A seal's checkpoint does not truncate the
/// sealed file: it is overwritten from offset 0 by the generation after
/// next, and records of older generations may follow its live end.
const WAL_NAMES: [&str; 2] = ["wal", "wal.1"];
/// WAL size above which a flush also checkpoints.
const CHECKPOINT_BYTES: u64 = 64 << 20;
/// Hard WAL bound, as a multiple of the flush checkpoint size: an append
/// that would grow the WAL past it checkpoints first, so a client that never
/// flushes cannot grow the WAL (and the in-memory dirty set) without bound.
const WAL_LIMIT_FACTOR: u64 = 2;
/// Ordered writes of at least this many blocks (64 KiB) are redirected:
/// their data goes once to the head layer's extent file and the WAL gets
/// only an [`WalKind::ExtWrite`] header (see [`Store::set_extent_threshold`]).
pub const EXTENT_MIN_BLOCKS: u32 = 16;

/// Longest single hole punch (8 MiB): `fallocate` holds the file's inode
/// lock, which the extent writes of the write path need too.
const MAX_PUNCH: u64 = 8 << 20;

/// Redirected writes appended by every store of this process.
static EXTENT_WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many writes stores of this process redirected to extent files
/// (the simulator reports it).
pub fn extent_writes() -> u64 {
    EXTENT_WRITES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Free extent blocks punched by every store of this process.
static EXTENT_PUNCHED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many free extent blocks stores of this process punched (tests and
/// the simulator).
pub fn extent_blocks_punched() -> u64 {
    EXTENT_PUNCHED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Data-file blocks punched by idle stores of this process.
static DATA_PUNCHED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many stale data-file blocks idle stores of this process punched
/// (tests and the simulator; synchronous checkpoints are not counted).
pub fn data_blocks_punched() -> u64 {
    DATA_PUNCHED.load(std::sync::atomic::Ordering::Relaxed)
}

#[derive(Clone, Copy, Debug)]
enum Loc {
    /// In the layer's data file (or nowhere, for zero blocks).
    Layer,
    /// In WAL file `.0` (index into [`WAL_NAMES`]), data at offset `.1`
    /// (a `u8` keeps [`Entry`] at 40 bytes).
    Wal(u8, u64),
    /// The metadata entry itself is damaged.
    Damaged,
    /// In the layer's extent file at this extent block.
    Ext(u32),
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    meta: BlockMeta,
    loc: Loc,
}

impl Entry {
    /// Whether its layer's data-file copy of the block may be needed: not
    /// for an extent or trimmed entry; for a damaged one or one whose WAL
    /// record is not checkpointed yet, kept to be safe.
    fn keeps_data_copy(&self) -> bool {
        match self.loc {
            Loc::Ext(_) => false,
            Loc::Layer => !self.meta.is_zero(),
            Loc::Wal(..) | Loc::Damaged => true,
        }
    }
}

#[derive(Debug)]
struct Layer {
    info: LayerInfo,
    data: Arc<dyn StoreFile>,
    meta: Arc<dyn StoreFile>,
    blocks: BlockIndex<Entry>,
    /// The extent file (`layer-N.ext`), once opened or created.
    ext: Option<Arc<dyn StoreFile>>,
    /// Extent blocks in use or allocated so far: new ones start here.
    ext_end: u32,
    /// Free extent block runs below `ext_end` (start -> length) that are
    /// still allocated in the file (the reuse pool, see
    /// [`Store::set_extent_pool`]). Reusable at once.
    ext_free: BTreeMap<u32, u32>,
    /// Free extent block runs whose blocks were punched (holes).
    ext_holes: BTreeMap<u32, u32>,
    /// Free runs taken out of the allocator for a punch that has not
    /// finished (a [`PunchJob`], or the inline punches of a synchronous
    /// checkpoint): never handed out before it has, so a punch cannot land
    /// in a block allocated meanwhile. One set at a time.
    ext_punching: Vec<(u32, u32)>,
    /// The extent file has writes no sync covered yet.
    ext_unsynced: bool,
    /// Data-file block runs (start -> length) that may hold a copy no
    /// durable metadata entry refers to any more (the block was trimmed or
    /// moved to the extent file), to punch once the volume is idle. A
    /// hint: each block is checked against the index before its punch.
    data_stale: BTreeMap<u64, u64>,
}

/// Adds `[start, start + len)` to `runs` (start -> length), merging the
/// runs it overlaps or touches.
fn run_add(runs: &mut BTreeMap<u64, u64>, start: u64, len: u64) {
    if len == 0 {
        return;
    }
    let (mut lo, mut hi) = (start, start.saturating_add(len));
    if let Some((&s, &l)) = runs.range(..=start).next_back()
        && s + l >= start
    {
        runs.remove(&s);
        lo = s;
        hi = hi.max(s + l);
    }
    while let Some((&s, &l)) = runs.range(lo..=hi).next() {
        runs.remove(&s);
        hi = hi.max(s + l);
    }
    runs.insert(lo, hi - lo);
}

/// Adds run `[start, start + len)` to `runs` (start -> length), merging it
/// with its neighbours.
fn run_insert(runs: &mut BTreeMap<u32, u32>, start: u32, len: u32) {
    if len == 0 {
        return;
    }
    let (mut start, mut len) = (start, len);
    if let Some((&s, &l)) = runs.range(..start).next_back()
        && s + l == start
    {
        runs.remove(&s);
        start = s;
        len += l;
    }
    if let Some(l) = runs.remove(&(start + len)) {
        len += l;
    }
    runs.insert(start, len);
}

/// Takes `n` blocks from the first run of `runs` that holds them.
fn run_take_first_fit(runs: &mut BTreeMap<u32, u32>, n: u32) -> Option<u32> {
    let (start, len) = runs
        .iter()
        .find(|&(_, &len)| len >= n)
        .map(|(&s, &len)| (s, len))?;
    runs.remove(&start);
    if len > n {
        runs.insert(start + n, len - n);
    }
    Some(start)
}

/// Removes `[start, start + len)` from `runs` (splitting runs it cuts).
fn run_remove(runs: &mut BTreeMap<u32, u32>, start: u32, len: u32) {
    let end = start + len;
    let cut: Vec<(u32, u32)> = runs
        .range(..end)
        .rev()
        .take_while(|&(&s, &l)| s + l > start)
        .map(|(&s, &l)| (s, l))
        .collect();
    for (s, l) in cut {
        runs.remove(&s);
        if s < start {
            runs.insert(s, start - s);
        }
        if s + l > end {
            runs.insert(end, s + l - end);
        }
    }
}

/// First block of the first run of `n` free blocks in the union of two
/// disjoint run maps (runs of both that touch count as one).
fn runs_first_fit_union(a: &BTreeMap<u32, u32>, b: &BTreeMap<u32, u32>, n: u32) -> Option<u32> {
    // Both maps in block order, merged without allocating.
    let (mut a, mut b) = (a.iter().peekable(), b.iter().peekable());
    let (mut start, mut len) = (0u32, 0u32);
    loop {
        let next = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) if x.0 <= y.0 => a.next(),
            (Some(_), Some(_)) => b.next(),
            (Some(_), None) => a.next(),
            (None, _) => b.next(),
        };
        let (&s, &l) = next?;
        if len > 0 && start + len == s {
            len += l;
        } else {
            (start, len) = (s, l);
        }
        if len >= n {
            return Some(start);
        }
    }
}

impl Layer {
    /// Allocates `n` consecutive extent blocks: first fit in the free runs
    /// still allocated in the file (no file system allocation), else in
    /// all free runs (allocated and punched ones together), else at the
    /// end of the file.
    fn ext_alloc(&mut self, n: u32) -> Option<u32> {
        if let Some(b) = run_take_first_fit(&mut self.ext_free, n) {
            return Some(b);
        }
        if let Some(b) = runs_first_fit_union(&self.ext_free, &self.ext_holes, n) {
            run_remove(&mut self.ext_free, b, n);
            run_remove(&mut self.ext_holes, b, n);
            return Some(b);
        }
        let start = self.ext_end;
        self.ext_end = start.checked_add(n)?;
        Some(start)
    }

    /// Returns extent block `b` to the free runs (merging neighbours).
    fn ext_release(&mut self, b: u32) {
        run_insert(&mut self.ext_free, b, 1);
    }

    /// Free extent blocks still allocated in the file.
    fn ext_pool(&self) -> u32 {
        self.ext_free.values().sum()
    }

    /// Takes the free runs beyond the first `keep` free blocks out of the
    /// allocator for a punch (the highest ones, so the allocator's first
    /// fit keeps using the lowest and the file's tail can be cut). At most
    /// `max_runs` runs are taken (see [`PUNCH_MAX_RUNS`]). Returns them as
    /// `(first block, blocks)`.
    fn ext_take_for_punch(&mut self, keep: u32, max_runs: usize) -> Vec<(u32, u32)> {
        let mut total = self.ext_pool();
        let mut out = Vec::new();
        let mut below = u32::MAX;
        while total > keep && out.len() < max_runs {
            let Some((&s, &l)) = self.ext_free.range(..below).next_back() else {
                break;
            };
            below = s;
            let cut = l.min(total - keep);
            self.ext_free.remove(&s);
            if cut < l {
                self.ext_free.insert(s, l - cut);
            }
            out.push((s + l - cut, cut));
            self.ext_punching.push((s + l - cut, cut));
            total -= cut;
        }
        out
    }

    /// A punch of the runs taken by [`Layer::ext_take_for_punch`] is over
    /// (done, or abandoned with `punched` false): they are allocatable again.
    fn ext_punch_done(&mut self, punched: bool) {
        for (s, l) in std::mem::take(&mut self.ext_punching) {
            if punched {
                run_insert(&mut self.ext_holes, s, l);
            } else {
                run_insert(&mut self.ext_free, s, l);
            }
        }
    }

    /// Cuts free (punched) runs at the end of the extent file off its
    /// length (store thread only, with no checkpoint job in flight: an
    /// allocation at the end must not race the truncate).
    fn ext_trim_tail(&mut self) -> io::Result<()> {
        let Some(f) = self.ext.clone() else {
            return Ok(());
        };
        let mut end = self.ext_end;
        while let Some((&s, &l)) = self.ext_holes.iter().next_back()
            && s + l == end
        {
            self.ext_holes.remove(&s);
            end = s;
        }
        self.ext_end = end;
        let len = u64::from(end) * BLOCK_SIZE_U64;
        if f.len()? > len {
            f.set_len(len)?;
        }
        Ok(())
    }
}

/// What to put into a block of a layer during rebuild or repair.
#[derive(Clone, Copy, Debug)]
pub enum SetBlock<'a> {
    /// Block data written by `tag`.
    Data(Tag, &'a [u8]),
    /// A zero block written by `tag`.
    Zero(Tag),
    /// No copy in this layer.
    Absent,
}

/// A replica's store. All methods are synchronous; callers run them on a
/// thread that may block (or in the simulator, on simulated files).
#[derive(Debug)]
pub struct Store {
    dir: Box<dyn StoreDir>,
    sb_file: Box<dyn StoreFile>,
    sb: Superblock,
    /// Both WAL files ([`WAL_NAMES`]).
    wals: [Arc<dyn StoreFile>; 2],
    /// The WAL file appended to.
    cur: usize,
    /// Generation of the records appended to `wals[cur]` (the superblock's
    /// `wal_gen` while nothing is sealed, one more while a WAL is sealed).
    wgen: u64,
    /// Length of `wals[cur]`.
    wal_len: u64,
    /// `wals[cur]` holds a record that is not ordered (set_block): it is
    /// synced when sealed (see [`Store::seal`]).
    wal_unordered: bool,
    layers: Vec<Layer>,
    position: Tag,
    /// (layer id, lba) with changes in `wals[cur]` not yet checkpointed.
    dirty: DirtySet,
    /// The sealed WAL and its checkpoint job, until finished.
    sealed: Option<Sealed>,
    /// Extent punches started by the last finished checkpoint.
    punch_job: Option<PunchJob>,
    /// Run checkpoint jobs on a thread (else inline, deferred).
    background: bool,
    checkpoint_bytes: u64,
    /// Ordered writes of at least this many blocks go to extent files.
    extent_min_blocks: u32,
    /// Extent bytes written since the last seal (count towards the
    /// checkpoint size like WAL bytes: their frees wait for a checkpoint).
    ext_bytes: u64,
    /// Extent blocks no longer referenced by the index: `(WAL generation
    /// of the record that replaced them, layer id, block)`. Reusable once
    /// the superblock's `wal_gen` is past that generation (the checkpoint
    /// of the replacing record is durable, so neither metadata nor a
    /// replayable record can still point at them).
    ext_pending: Vec<(u64, u64, u32)>,
    /// Free extent blocks the head layer keeps allocated for reuse (set by
    /// [`Store::set_extent_pool`], else [`Store::extent_pool`]'s default);
    /// free blocks beyond them (and every free block of other layers) are
    /// punched.
    ext_pool_blocks: Option<u32>,
}

impl Drop for Store {
    /// Waits for a checkpoint thread still writing this store's layer
    /// files: a store reopened on the same directory (after a fault) must
    /// not have an old job write older copies over its own checkpoint.
    fn drop(&mut self) {
        if let Some(h) = self.sealed.as_mut().and_then(|s| s.running.take()) {
            let _ = h.join();
        }
        // Its punches must not land in blocks a reopened store allocated.
        if let Some(h) = self.punch_job.as_mut().and_then(|p| p.running.take()) {
            let _ = h.join();
        }
    }
}

/// A sealed WAL whose checkpoint has not finished.
#[derive(Debug)]
struct Sealed {
    /// Index of the sealed WAL file.
    file: usize,
    /// Live position when it was sealed (the superblock's after finish).
    position: Tag,
    /// Blocks whose changes it holds.
    dirty: DirtySet,
    /// The checkpoint I/O (re-run inline after a failure).
    job: Arc<CheckpointJob>,
    /// The thread running `job`, if one does.
    running: Option<JoinHandle<io::Result<()>>>,
    /// The sealed file is known durable (synced by a flush or at seal).
    synced: bool,
}

/// One step of a checkpoint's I/O.
#[derive(Debug)]
enum JobOp {
    /// Copy `len` bytes at `src_off` of WAL file `src` to layer `li`'s data.
    Copy {
        src: usize,
        li: usize,
        src_off: u64,
        dst_off: u64,
        len: usize,
    },
    /// Punch a hole in layer `li`'s data (after the metadata sync).
    Punch { li: usize, off: u64, len: u64 },
    /// Punch a hole in a layer's data file, in a [`PunchJob`] (blocks
    /// whose durable entries point elsewhere; no checkpoint job writes
    /// data files while it runs).
    PunchData {
        file: Arc<dyn StoreFile>,
        off: u64,
        len: u64,
    },
    /// Punch a hole in an extent file (free blocks the allocator holds
    /// back until the [`PunchJob`] has finished).
    PunchExt {
        file: Arc<dyn StoreFile>,
        off: u64,
        len: u64,
    },
    /// Write metadata entries to layer `li`'s meta file.
    Meta { li: usize, off: u64, bytes: Vec<u8> },
}

/// The I/O of one checkpoint, computed on the store thread so it can run
/// anywhere: sync the WAL files it copies from, copy, sync the layer files.
#[derive(Debug)]
struct CheckpointJob {
    wals: [Arc<dyn StoreFile>; 2],
    sync_wals: Vec<usize>,
    /// Extent files, synced before metadata entries point into them.
    exts: Vec<Arc<dyn StoreFile>>,
    /// (data, meta) of every layer, by index at build time.
    layers: Vec<(Arc<dyn StoreFile>, Arc<dyn StoreFile>)>,
    touched: BTreeSet<usize>,
    /// Copies and metadata writes.
    ops: Vec<JobOp>,
    /// Hole punches, run once the metadata writes are durable: ranges no
    /// durable metadata entry and no replayable WAL record refers to any
    /// more (see [`Store::build_job`]).
    punches: Vec<JobOp>,
    /// Run `punches` (synchronous checkpoints); a seal's job leaves them
    /// to [`Store::idle`] instead (see [`Layer::data_stale`]).
    punch_now: bool,
}

impl CheckpointJob {
    fn run(&self) -> io::Result<()> {
        // Layer files are only written with data already durable in a WAL.
        for f in &self.exts {
            f.sync()?;
        }
        for &f in &self.sync_wals {
            self.wals[f].sync()?;
        }
        let mut buf = Vec::new();
        for op in &self.ops {
            match op {
                JobOp::Copy {
                    src,
                    li,
                    src_off,
                    dst_off,
                    len,
                } => {
                    buf.resize(*len, 0);
                    self.wals[*src].read_at(&mut buf, *src_off)?;
                    self.layers[*li].0.write_at(&buf, *dst_off)?;
                }
                JobOp::Meta { li, off, bytes } => self.layers[*li].1.write_at(bytes, *off)?,
                JobOp::Punch { .. } | JobOp::PunchExt { .. } | JobOp::PunchData { .. } => {}
            }
        }
        for &li in &self.touched {
            self.layers[li].0.sync()?;
            self.layers[li].1.sync()?;
        }
        // Only space depends on the punches: a failed one leaves a range
        // allocated that nothing reads (the next open punches free extent
        // blocks again). Not synced here: the next job's syncs of these
        // files (or the journal) make them durable; one lost at a power
        // loss only leaks space.
        for op in self.punches.iter().filter(|_| self.punch_now) {
            let (file, off, len) = match op {
                JobOp::Punch { li, off, len } => (&self.layers[*li].0, *off, *len),
                JobOp::PunchExt { .. }
                | JobOp::PunchData { .. }
                | JobOp::Copy { .. }
                | JobOp::Meta { .. } => continue,
            };
            if let Err(e) = file.punch_hole(off, len) {
                warn!(error = %e, off, len, "checkpoint hole punch failed");
            }
        }
        Ok(())
    }
}

/// Most runs one background [`PunchJob`] punches (the rest wait for the
/// next [`Store::idle`] call): bounds the time a write that arrives after
/// the volume went idle can wait behind punches (`fallocate` holds the
/// extent file's inode lock; 152 µs per call measured on this project's
/// machine).
pub const PUNCH_MAX_RUNS: usize = 1024;

/// Punches of the free extent runs beyond the pools, started when a
/// checkpoint has finished (so the blocks it freed go back within that
/// checkpoint) and run off the write path like checkpoint jobs. Its runs
/// are held back from the allocator until it has finished.
#[derive(Debug)]
struct PunchJob {
    ops: Arc<Vec<JobOp>>,
    /// The thread running it, if one does (else deferred, run inline).
    running: Option<JoinHandle<()>>,
}

/// Adds a [`JobOp::PunchData`] for blocks `run` (start, count) of `file`.
fn push_data_punch(ops: &mut Vec<JobOp>, file: &Arc<dyn StoreFile>, run: Option<(u64, u64)>) {
    if let Some((start, n)) = run {
        ops.push(JobOp::PunchData {
            file: file.clone(),
            off: start * BLOCK_SIZE_U64,
            len: n * BLOCK_SIZE_U64,
        });
    }
}

/// Runs [`JobOp::PunchExt`] and [`JobOp::PunchData`] ops; failures only
/// leak space.
fn run_punches(ops: &[JobOp]) {
    for op in ops {
        let (file, off, len, counter) = match op {
            JobOp::PunchExt { file, off, len } => (file, *off, *len, &EXTENT_PUNCHED),
            JobOp::PunchData { file, off, len } => (file, *off, *len, &DATA_PUNCHED),
            JobOp::Punch { .. } | JobOp::Copy { .. } | JobOp::Meta { .. } => continue,
        };
        // In pieces: each holds the file's inode lock only briefly.
        let mut at = off;
        while at < off + len {
            let n = MAX_PUNCH.min(off + len - at);
            match file.punch_hole(at, n) {
                Ok(()) => {
                    counter.fetch_add(n / BLOCK_SIZE_U64, std::sync::atomic::Ordering::Relaxed);
                }
                Err(e) => warn!(error = %e, off = at, len = n, "hole punch failed"),
            }
            at += n;
        }
    }
}

/// Longest checkpoint copy run (blocks).
const MAX_RUN: u64 = 256;

/// Consecutive blocks of one layer whose data sits consecutively in the WAL.
#[derive(Default)]
struct CopyRun {
    file: usize,
    li: usize,
    lba: u64,
    wal_off: u64,
    blocks: u64,
}

impl CopyRun {
    /// Appends block `lba` at WAL offset `off` if it continues the run.
    fn extends(&mut self, file: usize, li: usize, lba: u64, off: u64) -> bool {
        let ok = self.blocks > 0
            && self.blocks < MAX_RUN
            && self.file == file
            && self.li == li
            && self.lba + self.blocks == lba
            && self.wal_off + self.blocks * BLOCK_SIZE_U64 == off;
        if ok {
            self.blocks += 1;
        }
        ok
    }
}

/// Blocks of one read that sit consecutively in one file: `(index in the
/// read, expected checksum)` each.
struct ReadRun {
    li: usize,
    src: Src,
    off: u64,
    blocks: Vec<(usize, u32)>,
}

/// The file a [`ReadRun`] reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Src {
    /// The layer's data file.
    Layer,
    /// A WAL file.
    Wal(usize),
    /// The layer's extent file.
    Ext,
}

/// Consecutive metadata entries of one layer.
#[derive(Default)]
struct MetaRun {
    li: usize,
    lba: u64,
    bytes: Vec<u8>,
}

impl MetaRun {
    fn extends(&self, li: usize, lba: u64) -> bool {
        let n = (self.bytes.len() / META_SIZE) as u64;
        n > 0 && n < MAX_RUN && self.li == li && self.lba + n == lba
    }
}

/// How far a checkpoint moves the WAL generation: at least 1, else
/// unpredictable (up to 2^32). WAL files are reused without truncation, so
/// past a file's live end lie records of older generations and possibly
/// guest data at record-header offsets; a guest that could predict the
/// generation could forge a header (with a valid CRC) there that replay
/// would take as the current generation's next record after a crash.
fn gen_step(dir: &dyn StoreDir) -> u64 {
    1 + (dir.random() >> 32)
}

fn layer_names(id: u64) -> (String, String) {
    (format!("layer-{id}.data"), format!("layer-{id}.meta"))
}

fn ext_name(id: u64) -> String {
    format!("layer-{id}.ext")
}

// `impl Store` is split by concern over these files.
mod blocks;
mod checkpoint;
mod layers;
mod open;
mod wal;

#[cfg(test)]
mod tests;
