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

impl Store {
    /// Creates an empty store of `size_blocks` blocks in `dir`, replacing any
    /// store there. The new replica is `Rebuilding` at position 0:0 until an
    /// engine either adopts it as the first copy of a new volume (see
    /// [`Store::mark_clean`]) or rebuilds it. Blocks are checksummed with
    /// [`BlockChecksum::NEW`].
    pub fn create(dir: Box<dyn StoreDir>, size_blocks: u64, state: ReplicaState) -> Result<Store> {
        Self::create_with_checksum(dir, size_blocks, state, BlockChecksum::NEW)
    }

    /// [`Store::create`] with a given block checksum algorithm (tests, and
    /// stores that older versions must be able to open: [`BlockChecksum::Sha256`]).
    pub fn create_with_checksum(
        dir: Box<dyn StoreDir>,
        size_blocks: u64,
        state: ReplicaState,
        checksum: BlockChecksum,
    ) -> Result<Store> {
        for name in dir.list().map_err(Error::store("list"))? {
            if name == SB_NAME || WAL_NAMES.contains(&name.as_str()) || name.starts_with("layer-") {
                dir.remove(&name).map_err(Error::store("remove"))?;
            }
        }
        let head = LayerInfo {
            id: 1,
            name: String::new(),
            created: Tag::default(),
        };
        let wgen = gen_step(&*dir);
        let sb = Superblock {
            generation: 0,
            size_blocks,
            epoch: 0,
            engine: 0,
            state,
            position: Tag::default(),
            wal_gen: wgen,
            layers: vec![head.clone()],
            boot_id: dir.boot_id(),
            open: false,
            recovered: false,
            checksum,
            two_wal: false,
            // New stores write records checksummed over the block
            // checksums from the start.
            wal_sums: true,
            extents: false,
        };
        let sb_file = dir.open(SB_NAME, true).map_err(Error::store("create"))?;
        sb_file
            .set_len(2 * SB_SLOT as u64)
            .map_err(Error::store("create"))?;
        let wals = Self::open_wals(&*dir, "create")?;
        let layer = Self::open_layer(&*dir, head, true)?;
        dir.sync_dir().map_err(Error::store("create"))?;
        let background = dir.background_checkpoints();
        let mut s = Store {
            dir,
            sb_file,
            sb,
            wals,
            cur: 0,
            wgen,
            wal_len: 0,
            wal_unordered: false,
            layers: vec![layer],
            position: Tag::default(),
            dirty: DirtySet::default(),
            sealed: None,
            punch_job: None,
            background,
            checkpoint_bytes: CHECKPOINT_BYTES,
            extent_min_blocks: EXTENT_MIN_BLOCKS,
            ext_bytes: 0,
            ext_pending: Vec::new(),
            ext_pool_blocks: None,
        };
        s.write_sb()?;
        s.write_sb()?; // both slots valid
        Ok(s)
    }

    /// Opens an existing store, recovering from a crash: picks the newest
    /// valid superblock, loads layer metadata, replays the valid prefix of
    /// the WAL and checkpoints.
    pub fn open(dir: Box<dyn StoreDir>) -> Result<Store> {
        let sb_file = dir.open(SB_NAME, false).map_err(Error::store("open"))?;
        // The intact slot with the highest generation wins, also when this
        // version cannot use it (never fall back to an older state then).
        let mut best: Option<(u64, std::result::Result<Superblock, SbError>)> = None;
        for slot in 0..2u64 {
            let mut buf = vec![0u8; SB_SLOT];
            if sb_file.read_at(&mut buf, slot * SB_SLOT as u64).is_err() {
                continue;
            }
            let res = Superblock::decode(&buf);
            let generation = match &res {
                Ok(sb) => sb.generation,
                Err(e) => match e.generation() {
                    Some(g) => g,
                    None => continue,
                },
            };
            if best.as_ref().is_none_or(|(g, _)| generation > *g) {
                best = Some((generation, res));
            }
        }
        let mut sb = match best {
            None => return Err(Error::Corrupt("no valid superblock slot".into())),
            Some((_, Err(e))) => return Err(Error::Corrupt(e.to_string())),
            Some((_, Ok(sb))) => sb,
        };
        debug!(checksum = sb.checksum.name(), "store opened");
        let boot = dir.boot_id();
        if sb.boot_id != boot {
            if sb.open && sb.state == ReplicaState::Clean && !sb.recovered {
                // Writes acknowledged since the last sync may be gone: the
                // position below is only what survived. Persisted by the
                // checkpoint at the end of open.
                warn!("node restarted while attached: replica may lack acknowledged writes");
                sb.recovered = true;
            }
            sb.boot_id = boot;
        }
        // Remove files of layers that are not in the chain (crash during
        // snapshot create/delete/revert).
        let keep: Vec<(String, String)> = sb.layers.iter().map(|l| layer_names(l.id)).collect();
        let keep_ext: Vec<String> = sb.layers.iter().map(|l| ext_name(l.id)).collect();
        for name in dir.list().map_err(Error::store("list"))? {
            if name.starts_with("layer-")
                && !keep.iter().any(|(d, m)| *d == name || *m == name)
                && !keep_ext.contains(&name)
            {
                dir.remove(&name).map_err(Error::store("remove"))?;
            }
        }
        let mut layers = Vec::new();
        for info in &sb.layers {
            let mut layer = Self::open_layer(&*dir, info.clone(), false)?;
            if sb.extents {
                let ext = dir
                    .open(&ext_name(info.id), true)
                    .map_err(Error::store("open layer"))?;
                let len = ext.len().map_err(Error::store("open layer"))?;
                layer.ext_end = u32::try_from(len.div_ceil(BLOCK_SIZE_U64)).unwrap_or(u32::MAX);
                layer.ext = Some(Arc::from(ext));
            }
            Self::load_meta(&mut layer, sb.size_blocks)?;
            layers.push(layer);
        }
        // The second WAL may be new (a store of an older version): its
        // directory entry must be durable before records in it count.
        let wals = Self::open_wals(&*dir, "open")?;
        dir.sync_dir().map_err(Error::store("open"))?;
        let position = sb.position;
        let wgen = sb.wal_gen;
        let background = dir.background_checkpoints();
        let mut s = Store {
            dir,
            sb_file,
            sb,
            wals,
            cur: 0,
            wgen,
            wal_len: 0,
            wal_unordered: false,
            layers,
            position,
            dirty: DirtySet::default(),
            sealed: None,
            punch_job: None,
            background,
            checkpoint_bytes: CHECKPOINT_BYTES,
            extent_min_blocks: EXTENT_MIN_BLOCKS,
            ext_bytes: 0,
            ext_pending: Vec::new(),
            ext_pool_blocks: None,
        };
        // Generation wal_gen is in whichever file starts with it; if a
        // WAL was sealed (flag set), generation wal_gen + 1 continues in
        // the other file. The position check of ordered records stops the
        // second file at once if the first lost its tail.
        let first = (0..2).find(|&f| s.replay_file(f, wgen) > 0);
        if let Some(f) = first
            && s.sb.two_wal
        {
            s.replay_file(1 - f, wgen + 1);
        }
        // Replay's frees are not to be trusted: if a job wrote metadata
        // entries but its superblock write was lost, replay applies
        // records over entries that already have them, so a record "frees"
        // the extent blocks it wrote itself (or a later record of its
        // generation wrote). The free runs come from the index after the
        // checkpoint below (`rebuild_ext_free`), and nothing may be
        // released (or punched) before.
        s.ext_pending.clear();
        // Both files are checkpointed and truncated: the new generation
        // must differ from every one they may still hold.
        s.wgen = wgen + 1;
        let unclean = s.sb.open;
        s.checkpoint()?;
        // The index is now exactly the durable metadata and no record is
        // replayable: every extent block it does not reference is free.
        s.rebuild_ext_free();
        // Free extent blocks a crash or a lost punch left allocated.
        s.reclaim_ext_now();
        if unclean {
            // The data-file punches of seals before the crash may not have
            // run: every block not kept in a data file is a candidate, for
            // idle calls to give back.
            s.mark_all_data_stale();
        }
        Ok(s)
    }

    fn open_wals(dir: &dyn StoreDir, what: &'static str) -> Result<[Arc<dyn StoreFile>; 2]> {
        let a = dir.open(WAL_NAMES[0], true).map_err(Error::store(what))?;
        let b = dir.open(WAL_NAMES[1], true).map_err(Error::store(what))?;
        Ok([Arc::from(a), Arc::from(b)])
    }

    fn open_layer(dir: &dyn StoreDir, info: LayerInfo, create: bool) -> Result<Layer> {
        let (d, m) = layer_names(info.id);
        let data = dir.open(&d, create).map_err(Error::store("open layer"))?;
        let meta = dir.open(&m, create).map_err(Error::store("open layer"))?;
        Ok(Layer {
            info,
            data: Arc::from(data),
            meta: Arc::from(meta),
            blocks: BlockIndex::default(),
            ext: None,
            ext_end: 0,
            ext_free: BTreeMap::new(),
            ext_holes: BTreeMap::new(),
            ext_punching: Vec::new(),
            data_stale: BTreeMap::new(),
            ext_unsynced: false,
        })
    }

    /// Recomputes every layer's free extent runs from its index (at open,
    /// right after a checkpoint, when the index is the durable metadata).
    fn rebuild_ext_free(&mut self) {
        self.ext_pending.clear();
        for l in &mut self.layers {
            l.ext_free.clear();
            l.ext_holes.clear();
            l.ext_punching.clear();
            if l.ext.is_none() {
                continue;
            }
            let mut used: Vec<u32> = l
                .blocks
                .keys()
                .filter_map(|b| match l.blocks.get(b).map(|e| e.loc) {
                    Some(Loc::Ext(x)) => Some(x),
                    _ => None,
                })
                .collect();
            used.sort_unstable();
            used.dedup();
            let mut next = 0u32;
            for u in used {
                if u >= l.ext_end {
                    l.ext_end = u.saturating_add(1);
                }
                if u > next {
                    l.ext_free.insert(next, u - next);
                }
                next = u.saturating_add(1);
            }
            if l.ext_end > next {
                l.ext_free.insert(next, l.ext_end - next);
            }
        }
    }

    /// Layer `li`'s extent file, opened (and created) if it is not open yet.
    fn ensure_ext(&mut self, li: usize) -> Result<Arc<dyn StoreFile>> {
        if let Some(f) = &self.layers[li].ext {
            return Ok(f.clone());
        }
        let f = self
            .dir
            .open(&ext_name(self.layers[li].info.id), true)
            .map_err(Error::store("create extent file"))?;
        // Its directory entry must be durable before records point into it.
        self.dir
            .sync_dir()
            .map_err(Error::store("create extent file"))?;
        let len = f.len().map_err(Error::store("create extent file"))?;
        let l = &mut self.layers[li];
        l.ext_end = l
            .ext_end
            .max(u32::try_from(len.div_ceil(BLOCK_SIZE_U64)).unwrap_or(u32::MAX));
        let f: Arc<dyn StoreFile> = Arc::from(f);
        l.ext = Some(f.clone());
        Ok(f)
    }

    /// Syncs the extent files with unsynced writes (before a WAL sync that
    /// makes records pointing into them durable).
    fn sync_exts(&mut self) -> Result<()> {
        for l in &mut self.layers {
            if l.ext_unsynced
                && let Some(f) = &l.ext
            {
                f.sync().map_err(Error::store("sync extent file"))?;
                l.ext_unsynced = false;
            }
        }
        Ok(())
    }

    /// Makes extent blocks freed by checkpointed records reusable.
    fn release_ext(&mut self) {
        let done = self.sb.wal_gen;
        let pending = std::mem::take(&mut self.ext_pending);
        for (g, layer, b) in pending {
            if g >= done {
                self.ext_pending.push((g, layer, b));
            } else if let Some(li) = self.layer_index(layer) {
                self.layers[li].ext_release(b);
            }
        }
    }

    /// Marks every block of every layer's data file as possibly stale,
    /// except those an entry keeps there.
    fn mark_all_data_stale(&mut self) {
        let size = self.sb.size_blocks;
        for l in &mut self.layers {
            let mut next = 0;
            for b in l.blocks.keys() {
                if l.blocks.get(b).is_some_and(Entry::keeps_data_copy) {
                    if b > next {
                        l.data_stale.insert(next, b - next);
                    }
                    next = b + 1;
                }
            }
            if size > next {
                l.data_stale.insert(next, size - next);
            }
        }
    }

    /// Takes stale data-file runs ([`Layer::data_stale`]; at most
    /// `max_runs` of them, each whole) and returns punches for their
    /// blocks that no entry keeps in the data file: absent, trimmed or in
    /// the extent file. Only when the index is the durable metadata (no
    /// sealed WAL, no record since the last checkpoint, or right after a
    /// synchronous one), so no durable entry refers to those copies.
    fn plan_data_punches(&mut self, max_runs: usize) -> Vec<JobOp> {
        let mut ops = Vec::new();
        let mut taken = 0;
        for l in &mut self.layers {
            while taken < max_runs {
                let Some((start, len)) = l.data_stale.pop_first() else {
                    break;
                };
                taken += 1;
                // The blocks without an entry that keeps them in the data
                // file, between those that have one.
                let end = start.saturating_add(len);
                let mut next = start;
                for b in l.blocks.keys_in(start, end) {
                    if l.blocks.get(b).is_some_and(Entry::keeps_data_copy) {
                        push_data_punch(&mut ops, &l.data, (b > next).then(|| (next, b - next)));
                        next = b + 1;
                    }
                }
                let run = (end > next).then(|| (next, end - next));
                push_data_punch(&mut ops, &l.data, run);
            }
        }
        ops
    }

    /// Takes every layer's free extent runs beyond its pool (the head
    /// layer keeps [`Store::set_extent_pool`] blocks allocated for reuse,
    /// the others none: only the head takes new large writes) out of the
    /// allocator, as punches for a [`PunchJob`]. Free runs are reusable
    /// (see [`Store::release_ext`]): no durable metadata entry and no
    /// replayable WAL record refers to them, so they may be punched at any
    /// point; held back until the punches have finished, they cannot be
    /// reallocated under the punch.
    fn plan_ext_punches(&mut self, pool: u32, max_runs: usize) -> Vec<JobOp> {
        let head = self.layers.len().saturating_sub(1);
        let mut ops = Vec::new();
        for (li, l) in self.layers.iter_mut().enumerate() {
            let Some(file) = l.ext.clone() else {
                continue;
            };
            let keep = if li == head { pool } else { 0 };
            for (start, len) in l.ext_take_for_punch(keep, max_runs) {
                ops.push(JobOp::PunchExt {
                    file: file.clone(),
                    off: u64::from(start) * BLOCK_SIZE_U64,
                    len: u64::from(len) * BLOCK_SIZE_U64,
                });
            }
        }
        ops
    }

    /// Punches free extent runs beyond the pools now and cuts punched runs
    /// at the end of each extent file off its length (synchronous
    /// checkpoints and open: no job in flight). Failures only leak space.
    fn reclaim_ext_now(&mut self) {
        debug_assert!(self.sealed.is_none() && self.punch_job.is_none());
        run_punches(&self.plan_data_punches(usize::MAX));
        run_punches(&self.plan_ext_punches(self.extent_pool(), usize::MAX));
        for l in &mut self.layers {
            l.ext_punch_done(true);
            if let Err(e) = l.ext_trim_tail() {
                warn!(layer = l.info.id, error = %e, "extent file truncate failed");
            }
        }
    }

    /// Sets how many free extent blocks the head layer keeps allocated for
    /// the next large writes (default: see [`Store::extent_pool`]); free
    /// blocks beyond it are punched once the checkpoint that freed them
    /// has finished.
    pub fn set_extent_pool(&mut self, blocks: u32) {
        self.ext_pool_blocks = Some(blocks);
    }

    /// Free extent blocks the head layer keeps allocated for reuse. The
    /// default is what one checkpoint can free under a stream of large
    /// overwrites, the WAL limit (extent bytes count towards it: 128 MiB),
    /// and at most a quarter of the volume: a smaller pool has the stream
    /// punch and re-allocate blocks at every checkpoint (measured: 1 MiB
    /// sequential overwrites lost 35-45 % with a 32 or 64 MiB pool on a
    /// 512 MiB volume).
    pub fn extent_pool(&self) -> u32 {
        self.ext_pool_blocks.unwrap_or_else(|| {
            let window = self.wal_limit() / BLOCK_SIZE_U64;
            u32::try_from(window.min(self.sb.size_blocks / 4)).unwrap_or(u32::MAX)
        })
    }

    /// Sets the smallest ordered write (in blocks) redirected to an
    /// extent file (tests and the simulator use small values).
    pub fn set_extent_threshold(&mut self, blocks: u32) {
        self.extent_min_blocks = blocks.max(1);
    }

    /// Extent blocks allocated in the head layer's extent file and how
    /// many of them are free (tests).
    pub fn extent_usage(&self) -> (u32, u32) {
        let l = &self.layers[self.layers.len() - 1];
        let holes: u32 = l.ext_holes.values().sum();
        let punching: u32 = l.ext_punching.iter().map(|r| r.1).sum();
        (l.ext_end, l.ext_pool() + holes + punching)
    }

    /// Removes the files of a dropped layer.
    fn remove_layer_files(&mut self, l: Layer) -> Result<()> {
        // Its pending frees must not land in a later layer with its id.
        self.ext_pending.retain(|p| p.1 != l.info.id);
        let (d, m) = layer_names(l.info.id);
        let x = ext_name(l.info.id);
        let has_ext = l.ext.is_some();
        drop(l);
        self.dir.remove(&d).map_err(Error::store("remove layer"))?;
        self.dir.remove(&m).map_err(Error::store("remove layer"))?;
        if has_ext || self.sb.extents {
            self.dir.remove(&x).map_err(Error::store("remove layer"))?;
        }
        Ok(())
    }

    fn load_meta(layer: &mut Layer, size_blocks: u64) -> Result<()> {
        let len = layer.meta.len().map_err(Error::store("read meta"))?;
        let n = (len / META_SIZE as u64).min(size_blocks);
        const CHUNK: u64 = 4096;
        let mut buf = vec![0u8; (CHUNK as usize) * META_SIZE];
        let mut lba = 0;
        while lba < n {
            let cnt = (n - lba).min(CHUNK);
            let bytes = &mut buf[..cnt as usize * META_SIZE];
            if let Err(e) = layer.meta.read_at(bytes, lba * META_SIZE as u64) {
                // Unreadable metadata: treat every entry in the chunk as damaged.
                warn!(layer = layer.info.id, lba, error = %e, "metadata unreadable");
                for i in 0..cnt {
                    layer.blocks.insert(lba + i, Self::damaged());
                }
                lba += cnt;
                continue;
            }
            for i in 0..cnt as usize {
                let raw = &bytes[i * META_SIZE..(i + 1) * META_SIZE];
                match BlockMeta::decode(raw) {
                    Ok(None) => {}
                    Ok(Some(meta)) => {
                        // A known bad copy keeps its tag: a peer's copy of
                        // the same write can repair it.
                        let mut meta = meta;
                        let loc = if meta.is_damaged() {
                            Loc::Damaged
                        } else if meta.flags & META_EXTENT != 0 {
                            meta.flags &= !META_EXTENT;
                            match (&layer.ext, BlockMeta::extent_block(raw)) {
                                (Some(_), Some(x)) => Loc::Ext(x),
                                _ => Loc::Damaged,
                            }
                        } else {
                            Loc::Layer
                        };
                        layer.blocks.insert(lba + i as u64, Entry { meta, loc });
                    }
                    Err(()) => {
                        layer.blocks.insert(lba + i as u64, Self::damaged());
                    }
                }
            }
            lba += cnt;
        }
        Ok(())
    }

    fn damaged() -> Entry {
        Entry {
            meta: BlockMeta {
                tag: Tag::default(),
                crc: 0,
                flags: META_PRESENT,
            },
            loc: Loc::Damaged,
        }
    }

    /// Replays the valid prefix of generation `gen` records at the start of
    /// WAL file `f`; returns how many records it applied.
    fn replay_file(&mut self, f: usize, wgen: u64) -> u64 {
        let wal = self.wals[f].clone();
        let Ok(len) = wal.len() else {
            return 0;
        };
        let mut off = 0u64;
        let mut hdr = [0u8; WAL_HDR];
        let mut replayed = 0u64;
        while off + WAL_HDR as u64 <= len {
            if wal.read_at(&mut hdr, off).is_err() {
                break;
            }
            let Some(h) = WalHeader::decode(&hdr) else {
                break;
            };
            if h.wal_gen != wgen {
                break;
            }
            let mut data = vec![0u8; h.data_len()];
            if wal.read_at(&mut data, off + WAL_HDR as u64).is_err() {
                break;
            }
            let ext_blk = WalHeader::extent_block(&hdr);
            let sums = if h.kind == WalKind::ExtWrite {
                // The data is in the extent file; torn or missing extent
                // data fails the record CRC like a torn WAL record.
                let ext = self
                    .layer_index(h.layer)
                    .and_then(|li| self.layers[li].ext.clone());
                let Some(ext) = ext.filter(|_| self.sb.wal_sums && self.sb.extents) else {
                    break;
                };
                let mut edata = vec![0u8; h.nblocks as usize * BLOCK_SIZE];
                if ext.read_at(&mut edata, ext_blk * BLOCK_SIZE_U64).is_err() {
                    break;
                }
                edata
                    .chunks_exact(BLOCK_SIZE)
                    .zip(h.lba..)
                    .map(|(b, lba)| self.sb.checksum.block(lba, b))
                    .collect()
            } else {
                // Recomputed from the data read: a torn or damaged record
                // fails the record CRC also when it covers only these.
                self.block_sums(&h, &data)
            };
            let ok = if self.sb.wal_sums {
                WalHeader::check_sums(&hdr, &sums)
            } else {
                WalHeader::check(&hdr, &data)
            };
            if !ok {
                break;
            }
            if h.kind.ordered() && h.tag.index != self.position.index + 1 {
                break;
            }
            if self.apply_record(&h, &sums, f, off, ext_blk).is_err() {
                break;
            }
            off += (WAL_HDR + data.len()) as u64;
            replayed += 1;
        }
        if replayed > 0 {
            debug!(
                file = f,
                wgen,
                records = replayed,
                bytes = off,
                "wal replayed"
            );
        }
        replayed
    }

    /// The store's checksum of each block of a record's data (empty for
    /// kinds without data).
    fn block_sums(&self, h: &WalHeader, data: &[u8]) -> Vec<u32> {
        data.chunks_exact(BLOCK_SIZE)
            .zip(h.lba..)
            .map(|(b, lba)| self.sb.checksum.block(lba, b))
            .collect()
    }

    /// Updates the in-memory index for a record whose data is at `off + WAL_HDR`
    /// of WAL file `f`; `sums` are its blocks' checksums.
    /// `ext_blk`: the first extent block of an [`WalKind::ExtWrite`].
    fn apply_record(
        &mut self,
        h: &WalHeader,
        sums: &[u32],
        f: usize,
        off: u64,
        ext_blk: u64,
    ) -> Result<()> {
        if h.lba.saturating_add(h.nblocks as u64) > self.sb.size_blocks {
            return Err(Error::Corrupt("wal record past end of volume".into()));
        }
        let li = self
            .layer_index(h.layer)
            .ok_or_else(|| Error::Corrupt(format!("wal record for unknown layer {}", h.layer)))?;
        let n = u64::from(h.nblocks);
        if h.kind == WalKind::ExtWrite
            && (sums.len() as u64 != n
                || ext_blk.saturating_add(n) > u64::from(u32::MAX)
                || self.layers[li].ext.is_none())
        {
            return Err(Error::Corrupt("bad extent wal record".into()));
        }
        // Extent blocks the record replaces become free once its
        // checkpoint is durable.
        if self.layers[li].ext.is_some() {
            for lba in h.lba..h.lba + n {
                if let Some(Entry {
                    loc: Loc::Ext(x), ..
                }) = self.layers[li].blocks.get(lba)
                {
                    self.ext_pending.push((h.wal_gen, h.layer, *x));
                }
            }
        }
        let layer = &mut self.layers[li];
        match h.kind {
            WalKind::ExtWrite | WalKind::Write | WalKind::SetData => {
                if sums.len() as u64 != n {
                    return Err(Error::Corrupt("wal record checksum count".into()));
                }
                // Block i's data: extent block `ext_blk + i` of the layer,
                // or in this WAL right after the header.
                let ext = (h.kind == WalKind::ExtWrite).then_some(ext_blk as u32);
                if let Some(base) = ext {
                    layer.ext_end = layer.ext_end.max(base + h.nblocks);
                }
                let base = off + WAL_HDR as u64;
                layer.blocks.insert_run(h.lba, n, |lba| {
                    let i = (lba - h.lba) as usize;
                    Entry {
                        meta: BlockMeta {
                            tag: h.tag,
                            crc: sums[i],
                            flags: META_PRESENT,
                        },
                        loc: match ext {
                            Some(x) => Loc::Ext(x + i as u32),
                            None => Loc::Wal(f as u8, base + i as u64 * BLOCK_SIZE_U64),
                        },
                    }
                });
            }
            WalKind::Zero | WalKind::SetZero => {
                let e = Entry {
                    meta: BlockMeta {
                        tag: h.tag,
                        crc: 0,
                        flags: META_PRESENT | META_ZERO,
                    },
                    loc: Loc::Layer,
                };
                layer.blocks.insert_run(h.lba, n, |_| e);
            }
            WalKind::SetAbsent => {
                for lba in h.lba..h.lba + n {
                    layer.blocks.remove(lba);
                }
            }
        }
        self.dirty.insert_run(h.layer, h.lba, n);
        if h.kind.ordered() {
            self.position = h.tag;
        }
        Ok(())
    }

    fn append(&mut self, mut h: WalHeader, data: &[u8]) -> Result<()> {
        self.reap()?;
        let rec = (WAL_HDR + data.len()) as u64;
        if self.wal_len > 0 && self.wal_len + rec > self.wal_limit() {
            // Nobody flushed for a long time: seal this WAL and checkpoint
            // it off the write path (only makes unflushed writes durable
            // earlier, which every caller allows). Every record so far is
            // fully applied, so this is a consistent point.
            debug!(wal_bytes = self.wal_len, "wal limit reached, sealing");
            self.seal()?;
        }
        h.wal_gen = self.wgen;
        if !h.kind.ordered() {
            // Replay of the next WAL has no position check for this
            // record: the sealed one must not lose a tail under it.
            self.sync_sealed()?;
            self.wal_unordered = true;
        }
        // Each block's checksum is needed for the index anyway; with the
        // `wal_sums` flag the record CRC covers them instead of the data.
        let sums = self.block_sums(&h, data);
        let hdr = if self.sb.wal_sums {
            h.encode_sums(&sums)
        } else {
            h.encode(data)
        };
        let off = self.wal_len;
        self.wals[self.cur]
            .write2_at(&hdr, data, off)
            .map_err(Error::store("append wal"))?;
        self.wal_len += (WAL_HDR + data.len()) as u64;
        self.apply_record(&h, &sums, self.cur, off, 0)
    }

    /// Appends an ordered write redirected to the head layer's extent
    /// file: the data once there, a header-only [`WalKind::ExtWrite`]
    /// record in the WAL.
    fn append_extent(&mut self, mut h: WalHeader, data: &[u8]) -> Result<()> {
        self.reap()?;
        let rec = WAL_HDR as u64 + self.ext_bytes + data.len() as u64;
        if self.wal_len > 0 && self.wal_len + rec > self.wal_limit() {
            debug!(wal_bytes = self.wal_len, "wal limit reached, sealing");
            self.seal()?;
        }
        if !self.sb.extents {
            // Older versions must refuse the store before the first
            // extent record or entry exists.
            self.sb.extents = true;
            self.write_sb()?;
        }
        let li = self.layers.len() - 1;
        let ext = self.ensure_ext(li)?;
        h.kind = WalKind::ExtWrite;
        h.wal_gen = self.wgen;
        let sums = self.block_sums(&h, data);
        let l = &mut self.layers[li];
        let blk = l
            .ext_alloc(h.nblocks)
            .ok_or_else(|| Error::InvalidArgument("extent file full".into()))?;
        l.ext_unsynced = true;
        if let Err(e) = ext.write_at(data, u64::from(blk) * BLOCK_SIZE_U64) {
            for i in 0..h.nblocks {
                self.layers[li].ext_release(blk + i);
            }
            return Err(Error::store("append extent")(e));
        }
        let hdr = h.encode_extent(u64::from(blk), &sums);
        let off = self.wal_len;
        if let Err(e) = self.wals[self.cur].write_at(&hdr, off) {
            for i in 0..h.nblocks {
                self.layers[li].ext_release(blk + i);
            }
            return Err(Error::store("append wal")(e));
        }
        self.wal_len += WAL_HDR as u64;
        self.ext_bytes += data.len() as u64;
        EXTENT_WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.apply_record(&h, &sums, self.cur, off, u64::from(blk))
    }

    /// Syncs the sealed WAL unless known durable.
    fn sync_sealed(&mut self) -> Result<()> {
        if self.sealed.as_ref().is_some_and(|s| !s.synced) {
            self.sync_exts()?;
        }
        if let Some(s) = self.sealed.as_mut()
            && !s.synced
        {
            self.wals[s.file]
                .sync()
                .map_err(Error::store("sync sealed wal"))?;
            s.synced = true;
        }
        Ok(())
    }

    /// Seals the current WAL: later records go to the other file as the
    /// next generation, and a checkpoint job for the sealed one starts (on
    /// a thread, or deferred). Waits for a job still in flight first.
    fn seal(&mut self) -> Result<()> {
        self.settle()?;
        if self.wal_len == 0 {
            return Ok(());
        }
        if !self.sb.two_wal {
            // Versions that replay only `wal` must refuse the store from
            // before the first record lands in the other file.
            self.sb.two_wal = true;
            self.write_sb()?;
        }
        let synced = self.wal_unordered;
        if synced {
            self.sync_exts()?;
            self.wals[self.cur]
                .sync()
                .map_err(Error::store("sync wal"))?;
        }
        // Its copies go to data files: punches of them started by an idle
        // call must be over (they normally are long before the next seal).
        self.finish_punch_job();
        let dirty = std::mem::take(&mut self.dirty);
        let sync_wals = if synced { vec![] } else { vec![self.cur] };
        let job = Arc::new(self.build_job(&dirty, sync_wals, false));
        let running = if self.background {
            let j = job.clone();
            let spawned = std::thread::Builder::new()
                .name("store-checkpoint".into())
                .spawn(move || j.run());
            match spawned {
                Ok(h) => Some(h),
                Err(e) => {
                    warn!(error = %e, "no checkpoint thread, checkpointing inline");
                    None
                }
            }
        } else {
            None
        };
        self.sealed = Some(Sealed {
            file: self.cur,
            position: self.position,
            dirty,
            job,
            running,
            synced,
        });
        self.cur = 1 - self.cur;
        self.wgen += 1;
        self.wal_len = 0;
        self.ext_bytes = 0;
        self.wal_unordered = false;
        Ok(())
    }

    /// Finishes a background checkpoint job that has completed (cheap
    /// otherwise); deferred jobs are left alone.
    fn reap(&mut self) -> Result<()> {
        let punch_done = |p: &Option<PunchJob>| {
            p.as_ref()
                .is_none_or(|p| p.running.as_ref().is_some_and(JoinHandle::is_finished))
        };
        if self.punch_job.is_some() && punch_done(&self.punch_job) {
            self.finish_punch_job();
        }
        if self
            .sealed
            .as_ref()
            .is_some_and(|s| s.running.as_ref().is_some_and(JoinHandle::is_finished))
        {
            self.settle()?;
        }
        Ok(())
    }

    /// Starts punching every free extent run, the pools' too (on a
    /// thread, or deferred like checkpoint jobs).
    fn start_punch_job(&mut self) {
        debug_assert!(self.punch_job.is_none());
        let mut ops = self.plan_data_punches(PUNCH_MAX_RUNS);
        ops.extend(self.plan_ext_punches(0, PUNCH_MAX_RUNS));
        if ops.is_empty() {
            return;
        }
        let ops = Arc::new(ops);
        let running = if self.background {
            let o = ops.clone();
            let spawned = std::thread::Builder::new()
                .name("store-punch".into())
                .spawn(move || run_punches(&o));
            match spawned {
                Ok(h) => Some(h),
                Err(e) => {
                    warn!(error = %e, "no punch thread, punching inline");
                    run_punches(&ops);
                    None
                }
            }
        } else {
            None
        };
        self.punch_job = Some(PunchJob { ops, running });
    }

    /// Waits for (or runs) the extent punches in flight; their runs are
    /// allocatable again (as holes).
    fn finish_punch_job(&mut self) {
        let Some(mut p) = self.punch_job.take() else {
            return;
        };
        match p.running.take() {
            Some(h) => {
                if h.join().is_err() {
                    warn!("punch thread panicked");
                }
            }
            None => run_punches(&p.ops),
        }
        self.layers.iter_mut().for_each(|l| l.ext_punch_done(true));
    }

    /// [`Store::settle`], then finishes the punches it started (operations
    /// that change the layer chain or checkpoint synchronously).
    fn settle_all(&mut self) -> Result<()> {
        self.settle()?;
        self.finish_punch_job();
        Ok(())
    }

    /// Finishes the checkpoint of a sealed WAL if it can without waiting:
    /// a completed background job, or a deferred job (run now, inline).
    /// The simulator calls it at seeded moments.
    pub fn poll_checkpoint(&mut self) -> Result<()> {
        if self
            .punch_job
            .as_ref()
            .is_some_and(|p| p.running.as_ref().is_none_or(JoinHandle::is_finished))
        {
            self.finish_punch_job();
        }
        match &self.sealed {
            Some(s) if s.running.as_ref().is_some_and(|h| !h.is_finished()) => Ok(()),
            Some(_) => self.settle(),
            None => Ok(()),
        }
    }

    /// The volume is idle (its caller saw no request for a while; call it
    /// again while that lasts, e.g. every second). Gives the space of
    /// overwritten and trimmed blocks back without waiting for the next
    /// WAL limit: the first call seals the WAL if it holds records (its
    /// checkpoint runs off the store thread, like at the limit), later
    /// calls finish that checkpoint, and once nothing is outstanding and
    /// nothing was written since, punch (on a thread, up to
    /// [`PUNCH_MAX_RUNS`] runs of each kind per call) the stale data-file
    /// copies and the free extent blocks that checkpoints under a stream
    /// of writes leave alone. Never waits for I/O in flight; safe at any
    /// time (it only does what the write path does at its limit).
    pub fn idle(&mut self) -> Result<()> {
        self.poll_checkpoint()?;
        if self.sealed.is_some() || self.punch_job.is_some() {
            return Ok(());
        }
        if self.wal_len > 0 {
            return self.seal();
        }
        if self
            .layers
            .iter()
            .any(|l| l.ext_pool() > 0 || !l.data_stale.is_empty())
        {
            // Up to PUNCH_MAX_RUNS runs per call.
            self.start_punch_job();
        }
        Ok(())
    }

    /// Whether a sealed WAL's checkpoint is outstanding (tests).
    pub fn checkpoint_pending(&self) -> bool {
        self.sealed.is_some()
    }

    /// Runs a deferred checkpoint job without finishing it (tests: a crash
    /// between the job and the superblock write).
    #[cfg(test)]
    fn run_job_only(&mut self) -> io::Result<()> {
        match &self.sealed {
            Some(s) if s.running.is_none() => s.job.run(),
            _ => Ok(()),
        }
    }

    /// Waits for (or runs) the checkpoint job of a sealed WAL and finishes
    /// it. On an error the sealed WAL stays, with the index still pointing
    /// into it, and the job is run again by the next call.
    fn settle(&mut self) -> Result<()> {
        let Some(mut s) = self.sealed.take() else {
            return Ok(());
        };
        let res = match s.running.take() {
            Some(h) => h
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("checkpoint thread panicked"))),
            None => s.job.run(),
        };
        if let Err(e) = res {
            self.sealed = Some(s);
            return Err(Error::store("checkpoint")(e));
        }
        // The sealed WAL's content is in the layer files: the superblock
        // moves past its generation, then its space is reused.
        let (pos, wgen) = (self.sb.position, self.sb.wal_gen);
        self.sb.position = s.position;
        self.sb.wal_gen = self.wgen;
        if let Err(e) = self.write_sb() {
            self.sb.position = pos;
            self.sb.wal_gen = wgen;
            self.sealed = Some(s);
            return Err(e);
        }
        self.point_to_layers(&s.dirty, Some(s.file));
        // The data-file copies it replaced are punched when the volume is
        // idle, like the extent blocks: punching them here, under the
        // write stream, stalled the next seal behind `fallocate` calls of
        // up to half a second on fragmented data files (3 replicas: 1 MiB
        // writes after random 4 KiB writes at a third of the throughput).
        for op in &s.job.punches {
            if let JobOp::Punch { li, off, len } = op
                && let Some(l) = self.layers.get_mut(*li)
            {
                run_add(
                    &mut l.data_stale,
                    off / BLOCK_SIZE_U64,
                    len / BLOCK_SIZE_U64,
                );
            }
        }
        // The extent blocks it freed stay allocated, for the next large
        // writes: punching them here, under a stream of writes, made those
        // writes land in fresh holes (file system allocation on the write
        // path, and `fallocate` holding the extent file's inode lock) and
        // cost a third of 1 MiB write throughput after random 4 KiB writes.
        // They are punched when the volume goes idle ([`Store::idle`]), at
        // synchronous checkpoints and at open. The data-file copies this
        // checkpoint replaced were punched by its job.
        self.release_ext();
        // The sealed file keeps its length and blocks: the generation after
        // next overwrites it from offset 0 (pages still cached and
        // allocated, no truncate, no zeroing of new pages). What stays past
        // its live end is of older generations, which replay never takes
        // for the current one (see `replay_file`).
        Ok(())
    }

    fn layer_index(&self, id: u64) -> Option<usize> {
        self.layers.iter().position(|l| l.info.id == id)
    }

    fn head_id(&self) -> u64 {
        self.layers.last().map_or(0, |l| l.info.id)
    }

    fn check_range(&self, lba: u64, n: u64) -> Result<()> {
        if n == 0 || lba.checked_add(n).is_none_or(|e| e > self.sb.size_blocks) {
            return Err(Error::OutOfRange {
                offset: lba.saturating_mul(BLOCK_SIZE_U64),
                len: n.saturating_mul(BLOCK_SIZE_U64),
                size: self.sb.size_blocks * BLOCK_SIZE_U64,
            });
        }
        Ok(())
    }

    /// What the replica reports about itself.
    pub fn info(&self) -> ReplicaInfo {
        ReplicaInfo {
            epoch: self.sb.epoch,
            engine: self.sb.engine,
            state: self.sb.state,
            position: self.position,
            size_blocks: self.sb.size_blocks,
            layers: self.sb.layers.clone(),
            recovered: self.sb.recovered && self.sb.state == ReplicaState::Clean,
        }
    }

    /// The store's per-block checksum algorithm.
    pub fn checksum(&self) -> BlockChecksum {
        self.sb.checksum
    }

    /// Live position: tag of the last ordered operation applied.
    pub fn position(&self) -> Tag {
        self.position
    }

    /// Volume size in blocks.
    pub fn size_blocks(&self) -> u64 {
        self.sb.size_blocks
    }

    /// Persists a new epoch and its engine (synced before returning).
    /// The replica is open for writes from then on (see [`Store::close`]).
    pub fn set_epoch(&mut self, epoch: u64, engine: u64) -> Result<()> {
        self.settle_for_attach()?;
        self.sb.epoch = epoch;
        self.sb.engine = engine;
        self.sb.open = true;
        self.write_sb()
    }

    /// Before an attach: finishes a sealed WAL's checkpoint and, if a clean
    /// [`Store::close`] left the store in the old WAL record format,
    /// checkpoints to move to the new one (the format only changes with
    /// the WAL generation, see [`Store::checkpoint`]).
    fn settle_for_attach(&mut self) -> Result<()> {
        if self.sb.wal_sums {
            self.settle()
        } else {
            self.checkpoint()
        }
    }

    /// Persists that an engine is attached (writes may follow that are not
    /// synced before they are acknowledged).
    pub fn mark_open(&mut self) -> Result<()> {
        if self.sb.open {
            return Ok(());
        }
        self.settle_for_attach()?;
        self.sb.open = true;
        self.write_sb()
    }

    /// Whether the superblock records an attached engine: true from an
    /// attach until a clean [`Store::close`] (an engine's detach), so a
    /// store opened with it false was shut down cleanly.
    pub fn is_marked_open(&self) -> bool {
        self.sb.open
    }

    /// Clean detach: checkpoints and records that nothing acknowledged is
    /// unsynced, so a later power loss does not mark the replica recovered.
    pub fn close(&mut self) -> Result<()> {
        // Both WALs end up empty: the store may go back to old-style
        // records, so versions before `wal_sums` open it again.
        self.checkpoint_as(false)?;
        self.sb.open = false;
        self.write_sb()
    }

    /// Whether the replica may lack writes it acknowledged before a power
    /// loss (see [`ReplicaInfo::recovered`]).
    pub fn recovered(&self) -> bool {
        self.sb.recovered && self.sb.state == ReplicaState::Clean
    }

    /// An engine adopted this replica's content as in sync: clears the
    /// recovered mark.
    pub fn adopt(&mut self) -> Result<()> {
        if !self.sb.recovered {
            return Ok(());
        }
        self.settle()?;
        self.sb.recovered = false;
        self.write_sb()
    }

    /// Applies an ordered write (`data` = `None` writes zeros) at `tag`.
    /// The caller checks that `tag` follows the position.
    pub fn write(&mut self, tag: Tag, lba: u64, nblocks: u32, data: Option<&[u8]>) -> Result<()> {
        self.check_range(lba, nblocks as u64)?;
        let (kind, payload) = match data {
            Some(d) => {
                if d.len() != nblocks as usize * BLOCK_SIZE {
                    return Err(Error::InvalidArgument("data length mismatch".into()));
                }
                (WalKind::Write, d)
            }
            None => (WalKind::Zero, &[][..]),
        };
        let h = WalHeader {
            kind,
            wal_gen: self.wgen,
            layer: self.head_id(),
            tag,
            lba,
            nblocks,
        };
        if kind == WalKind::Write && nblocks >= self.extent_min_blocks && self.sb.wal_sums {
            return self.append_extent(h, payload);
        }
        self.append(h, payload)
    }

    /// Sets one block of a layer (rebuild copy or repair). Does not move the
    /// position.
    pub fn set_block(&mut self, layer: u64, lba: u64, what: SetBlock<'_>) -> Result<()> {
        self.check_range(lba, 1)?;
        if self.layer_index(layer).is_none() {
            return Err(Error::InvalidArgument(format!("no layer {layer}")));
        }
        let (kind, tag, data) = match what {
            SetBlock::Data(tag, d) => {
                if d.len() != BLOCK_SIZE {
                    return Err(Error::InvalidArgument("data length mismatch".into()));
                }
                (WalKind::SetData, tag, d)
            }
            SetBlock::Zero(tag) => (WalKind::SetZero, tag, &[][..]),
            SetBlock::Absent => (WalKind::SetAbsent, Tag::default(), &[][..]),
        };
        let h = WalHeader {
            kind,
            wal_gen: self.wgen,
            layer,
            tag,
            lba,
            nblocks: 1,
        };
        self.append(h, data)
    }

    /// Sets `data.len() / 4096` consecutive blocks of a layer, all copies of
    /// the write `tag`, as one WAL record (rebuild copy of a run of blocks
    /// one write left). Same effect as [`Store::set_block`] per block; one
    /// header, one WAL write and one contiguous checkpoint copy for the run.
    pub fn set_blocks_data(&mut self, layer: u64, lba: u64, tag: Tag, data: &[u8]) -> Result<()> {
        let n = data.len() / BLOCK_SIZE;
        if n == 0 || !data.len().is_multiple_of(BLOCK_SIZE) || n > crate::proto::msg::MAX_IO_BLOCKS
        {
            return Err(Error::InvalidArgument("data length mismatch".into()));
        }
        self.check_range(lba, n as u64)?;
        if self.layer_index(layer).is_none() {
            return Err(Error::InvalidArgument(format!("no layer {layer}")));
        }
        let h = WalHeader {
            kind: WalKind::SetData,
            wal_gen: self.wgen,
            layer,
            tag,
            lba,
            nblocks: n as u32,
        };
        self.append(h, data)
    }

    /// Records the copy of `lba` in `layer` as a known bad copy of the write
    /// `tag` (rebuild of a block that has no good copy anywhere): reads of
    /// it fail, its tag is kept so a copy of the same write can repair it.
    /// Rare, so it checkpoints first and writes the sealed metadata entry
    /// directly (no WAL record kind a store version without
    /// [`META_DAMAGED`] would stop at).
    pub fn mark_damaged(&mut self, layer: u64, lba: u64, tag: Tag) -> Result<()> {
        self.check_range(lba, 1)?;
        let li = self
            .layer_index(layer)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
        self.checkpoint()?;
        let meta = BlockMeta {
            tag,
            crc: 0,
            flags: META_PRESENT | META_DAMAGED,
        };
        let l = &mut self.layers[li];
        l.meta
            .write_at(&meta.encode(), lba * META_SIZE as u64)
            .map_err(Error::store("mark damaged"))?;
        l.meta.sync().map_err(Error::store("mark damaged"))?;
        l.blocks.insert(
            lba,
            Entry {
                meta,
                loc: Loc::Damaged,
            },
        );
        Ok(())
    }

    /// A block's entry in a layer: `(tag, zero, valid)`; `valid` means its
    /// data was read back and its checksum verified.
    pub fn entry(&self, layer: u64, lba: u64) -> Option<(Tag, bool, bool)> {
        let li = self.layer_index(layer)?;
        let e = self.layers[li].blocks.get(lba)?;
        let mut buf = vec![0u8; BLOCK_SIZE];
        let valid = self.read_entry(li, lba, e, &mut buf);
        Some((e.meta.tag, e.meta.is_zero(), valid))
    }

    fn read_entry(&self, li: usize, lba: u64, e: &Entry, out: &mut [u8]) -> bool {
        if e.meta.is_zero() {
            out.fill(0);
            return !matches!(e.loc, Loc::Damaged);
        }
        let res = match e.loc {
            Loc::Damaged => return false,
            Loc::Layer => self.layers[li].data.read_at(out, lba * BLOCK_SIZE_U64),
            Loc::Wal(f, off) => self.wals[usize::from(f)].read_at(out, off),
            Loc::Ext(x) => match &self.layers[li].ext {
                Some(f) => f.read_at(out, u64::from(x) * BLOCK_SIZE_U64),
                None => return false,
            },
        };
        res.is_ok() && self.sb.checksum.block(lba, out) == e.meta.crc
    }

    /// Reads `nblocks` blocks at `lba` through the layer chain into `out`.
    /// Returns the blocks that failed verification as `(lba, layer)`; their
    /// bytes in `out` are zeroed. A corrupt copy is never returned as data.
    pub fn read(&self, lba: u64, nblocks: u32, out: &mut [u8]) -> Result<Vec<(u64, u64)>> {
        self.check_range(lba, nblocks as u64)?;
        if out.len() != nblocks as usize * BLOCK_SIZE {
            return Err(Error::InvalidArgument("buffer length mismatch".into()));
        }
        let mut bad = Vec::new();
        // Blocks stored contiguously in one file (a layer's data file or the
        // WAL) are read with one call, then verified block by block.
        let mut run: Option<ReadRun> = None;
        for i in 0..nblocks as usize {
            let b = lba + i as u64;
            let mut found = false;
            for li in (0..self.layers.len()).rev() {
                if let Some(e) = self.layers[li].blocks.get(b) {
                    found = true;
                    let file = match e.loc {
                        _ if e.meta.is_zero() => None,
                        Loc::Layer => Some((li, Src::Layer, b * BLOCK_SIZE_U64)),
                        Loc::Wal(f, off) => Some((li, Src::Wal(usize::from(f)), off)),
                        Loc::Ext(x) if self.layers[li].ext.is_some() => {
                            Some((li, Src::Ext, u64::from(x) * BLOCK_SIZE_U64))
                        }
                        Loc::Ext(_) | Loc::Damaged => None,
                    };
                    match file {
                        Some((li, src, off)) => {
                            if let Some(r) = run.as_mut()
                                && r.li == li
                                && r.src == src
                                && r.blocks.last().is_some_and(|&(j, _)| j + 1 == i)
                                && r.off + (r.blocks.len() * BLOCK_SIZE) as u64 == off
                                && r.blocks.len() < MAX_RUN as usize
                            {
                                r.blocks.push((i, e.meta.crc));
                            } else {
                                if let Some(r) = run.take() {
                                    self.read_run(lba, &r, out, &mut bad);
                                }
                                run = Some(ReadRun {
                                    li,
                                    src,
                                    off,
                                    blocks: vec![(i, e.meta.crc)],
                                });
                            }
                        }
                        None => {
                            let buf = &mut out[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
                            if !self.read_entry(li, b, e, buf) {
                                buf.fill(0);
                                bad.push((b, self.layers[li].info.id));
                            }
                        }
                    }
                    break;
                }
            }
            if !found {
                out[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].fill(0);
            }
        }
        if let Some(r) = run.take() {
            self.read_run(lba, &r, out, &mut bad);
        }
        bad.sort_unstable();
        Ok(bad)
    }

    /// Reads a run of blocks found contiguous in one file into their places
    /// in `out` (`out` starts at block `lba`) and verifies each; a failed
    /// run read falls back to block reads so only unreadable blocks are bad.
    fn read_run(&self, lba: u64, run: &ReadRun, out: &mut [u8], bad: &mut Vec<(u64, u64)>) {
        let file: &dyn StoreFile = match run.src {
            Src::Wal(f) => &*self.wals[f],
            Src::Layer => &*self.layers[run.li].data,
            Src::Ext => match &self.layers[run.li].ext {
                Some(f) => &**f,
                None => &*self.layers[run.li].data,
            },
        };
        let layer_id = self.layers[run.li].info.id;
        let (first, _) = run.blocks[0];
        let span = &mut out[first * BLOCK_SIZE..(first + run.blocks.len()) * BLOCK_SIZE];
        let whole = file.read_at(span, run.off).is_ok();
        for (k, &(i, crc)) in run.blocks.iter().enumerate() {
            let b = lba + i as u64;
            let buf = &mut out[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
            let ok = (whole || file.read_at(buf, run.off + (k * BLOCK_SIZE) as u64).is_ok())
                && self.sb.checksum.block(b, buf) == crc;
            if !ok {
                buf.fill(0);
                bad.push((b, layer_id));
            }
        }
    }

    /// Reads one layer's copy of `nblocks` blocks (for rebuild, scrub and
    /// repair): per block its tag state and, for valid data blocks, the data.
    pub fn read_layer(
        &self,
        layer: u64,
        lba: u64,
        nblocks: u32,
        with_data: bool,
    ) -> Result<Vec<(BlockTag, Option<Vec<u8>>)>> {
        self.check_range(lba, nblocks as u64)?;
        let li = self
            .layer_index(layer)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
        let mut out = Vec::with_capacity(nblocks as usize);
        for i in 0..nblocks as u64 {
            let b = lba + i;
            match self.layers[li].blocks.get(b) {
                None => out.push((BlockTag::Absent, None)),
                Some(e) => {
                    let mut buf = vec![0u8; BLOCK_SIZE];
                    let valid = self.read_entry(li, b, e, &mut buf);
                    let zero = e.meta.is_zero();
                    let tag = BlockTag::Present {
                        tag: e.meta.tag,
                        zero,
                        valid,
                    };
                    let data = (with_data && valid && !zero).then_some(buf);
                    out.push((tag, data));
                }
            }
        }
        Ok(out)
    }

    /// Makes every applied write durable (syncs the WAL); checkpoints when
    /// the WAL has grown large.
    pub fn flush(&mut self) -> Result<()> {
        self.reap()?;
        // Sealed first: the next WAL's records only count after it.
        self.sync_sealed()?;
        // Extent data before the records that point into it.
        self.sync_exts()?;
        self.wals[self.cur]
            .sync()
            .map_err(Error::store("sync wal"))?;
        if self.wal_len + self.ext_bytes > self.checkpoint_bytes {
            // Waits for a job still in flight (backpressure).
            self.seal()?;
            if let Some(s) = self.sealed.as_mut() {
                s.synced = true;
            }
        }
        Ok(())
    }

    /// Sets the WAL size that triggers a checkpoint on flush (tests use small
    /// values to exercise checkpoints). The hard WAL bound, checkpointed in
    /// the write path, is [`WAL_LIMIT_FACTOR`] times this.
    pub fn set_checkpoint_bytes(&mut self, bytes: u64) {
        self.checkpoint_bytes = bytes;
    }

    /// WAL size an append may not exceed without checkpointing first (a
    /// single record larger than it is still appended to an empty WAL).
    fn wal_limit(&self) -> u64 {
        self.checkpoint_bytes.saturating_mul(WAL_LIMIT_FACTOR)
    }

    /// Live length of the current WAL file in bytes (tests; the file
    /// itself may be longer, see [`WAL_NAMES`]).
    pub fn wal_bytes(&self) -> u64 {
        self.wal_len
    }

    /// Copies WAL-resident blocks into the layer files, syncs them, and starts
    /// a new WAL generation (finishing a sealed WAL's checkpoint first).
    pub fn checkpoint(&mut self) -> Result<()> {
        self.checkpoint_as(true)
    }

    /// [`Store::checkpoint`], with later records checksummed over the block
    /// checksums (`wal_sums`) or over the data (the format before it).
    fn checkpoint_as(&mut self, wal_sums: bool) -> Result<()> {
        self.settle_all()?;
        let dirty = std::mem::take(&mut self.dirty);
        let job = self.build_job(&dirty, vec![0, 1], true);
        if let Err(e) = job.run() {
            self.dirty = dirty;
            return Err(Error::store("checkpoint")(e));
        }
        let before = (
            self.sb.position,
            self.sb.wal_gen,
            self.sb.two_wal,
            self.sb.wal_sums,
        );
        self.sb.position = self.position;
        // An unpredictable step (see `gen_step`); the seals until the next
        // checkpoint add 1 each.
        self.sb.wal_gen = self.wgen.saturating_add(gen_step(&*self.dir));
        // Both files are emptied below and the new generation is in `wal`:
        // older versions may open the store again.
        self.sb.two_wal = false;
        // The record format may change only here, where the generation
        // does: every record of one generation has the same format, and
        // the flag is durable before the first record that needs it.
        self.sb.wal_sums = wal_sums;
        if let Err(e) = self.write_sb() {
            (
                self.sb.position,
                self.sb.wal_gen,
                self.sb.two_wal,
                self.sb.wal_sums,
            ) = before;
            self.dirty = dirty;
            return Err(e);
        }
        self.point_to_layers(&dirty, None);
        self.release_ext();
        // Off the write path: give back what this checkpoint freed now.
        self.reclaim_ext_now();
        self.cur = 0;
        self.wgen = self.sb.wal_gen;
        self.wal_len = 0;
        self.ext_bytes = 0;
        self.wal_unordered = false;
        // Unlike a seal's checkpoint, this one (open, clean close, snapshot
        // operations, rebuild: rare) shrinks both files to nothing, so a
        // cleanly closed store has empty WALs. Not needed for safety: if a
        // truncate fails or is lost at a power loss, the files hold older
        // generations only, as after a seal's checkpoint.
        for w in &self.wals {
            w.set_len(0).map_err(Error::store("truncate wal"))?;
        }
        Ok(())
    }

    /// The I/O that moves the changes of `dirty` (as the index has them
    /// now) into the layer files, after syncing WAL files `sync_wals`.
    /// Contiguous blocks are copied and their metadata written in runs.
    /// After a checkpoint of `dirty`: index entries still in a WAL (`file`,
    /// or either) now read from their layer files.
    fn point_to_layers(&mut self, dirty: &DirtySet, file: Option<usize>) {
        for (layer, lba) in dirty.iter() {
            if let Some(li) = self.layer_index(layer)
                && let Some(e) = self.layers[li].blocks.get_mut(lba)
                && matches!(e.loc, Loc::Wal(f, _) if file.is_none_or(|w| w == usize::from(f)))
            {
                e.loc = Loc::Layer;
            }
        }
    }

    ///
    /// Hole punches in the data files (`punches`, run after the metadata
    /// sync): a block trimmed (zero or absent) or moved to the extent file
    /// leaves an older copy in its layer's data file. Once this job's
    /// metadata entry for it is durable, no durable entry refers to that
    /// copy, and WAL records never do (they carry their data or point into
    /// an extent file). A later job (the only other writer of data files
    /// while the store runs) copies a newer write of the block after this
    /// punch.
    fn build_job(&self, dirty: &DirtySet, sync_wals: Vec<usize>, punch_now: bool) -> CheckpointJob {
        let mut ops = Vec::new();
        let mut punches = Vec::new();
        // Layer index, first block and blocks of the data-file punch run.
        let mut punch_run: (usize, u64, u64) = (0, 0, 0);
        let flush_punch = |run: &(usize, u64, u64), punches: &mut Vec<JobOp>| {
            if run.2 > 0 {
                punches.push(JobOp::Punch {
                    li: run.0,
                    off: run.1 * BLOCK_SIZE_U64,
                    len: run.2 * BLOCK_SIZE_U64,
                });
            }
        };
        let mut touched = BTreeSet::new();
        let mut data_run = CopyRun::default();
        let mut meta_run = MetaRun::default();
        let flush_copy = |run: &CopyRun, ops: &mut Vec<JobOp>| {
            if run.blocks > 0 {
                ops.push(JobOp::Copy {
                    src: run.file,
                    li: run.li,
                    src_off: run.wal_off,
                    dst_off: run.lba * BLOCK_SIZE_U64,
                    len: run.blocks as usize * BLOCK_SIZE,
                });
            }
        };
        let flush_meta = |run: &mut MetaRun, ops: &mut Vec<JobOp>| {
            if !run.bytes.is_empty() {
                ops.push(JobOp::Meta {
                    li: run.li,
                    off: run.lba * META_SIZE as u64,
                    bytes: std::mem::take(&mut run.bytes),
                });
            }
        };
        for (layer, lba) in dirty.iter() {
            let Some(li) = self.layer_index(layer) else {
                continue;
            };
            touched.insert(li);
            let entry = self.layers[li].blocks.get(lba);
            let punch = match entry {
                None
                | Some(Entry {
                    loc: Loc::Ext(_), ..
                }) => true,
                Some(e) => e.meta.is_zero(),
            };
            if punch {
                if punch_run.2 > 0 && punch_run.0 == li && punch_run.1 + punch_run.2 == lba {
                    punch_run.2 += 1;
                } else {
                    flush_punch(&punch_run, &mut punches);
                    punch_run = (li, lba, 1);
                }
            }
            let meta_bytes = match entry {
                None => [0u8; META_SIZE],
                Some(&Entry {
                    meta,
                    loc: Loc::Ext(x),
                }) => meta.encode_extent(x),
                Some(e) => {
                    if !e.meta.is_zero()
                        && let Loc::Wal(f, off) = e.loc
                        && !data_run.extends(usize::from(f), li, lba, off)
                    {
                        flush_copy(&data_run, &mut ops);
                        data_run = CopyRun {
                            file: usize::from(f),
                            li,
                            lba,
                            wal_off: off,
                            blocks: 1,
                        };
                    }
                    e.meta.encode()
                }
            };
            if !meta_run.extends(li, lba) {
                flush_meta(&mut meta_run, &mut ops);
                meta_run.li = li;
                meta_run.lba = lba;
            }
            meta_run.bytes.extend_from_slice(&meta_bytes);
        }
        flush_copy(&data_run, &mut ops);
        flush_meta(&mut meta_run, &mut ops);
        flush_punch(&punch_run, &mut punches);
        CheckpointJob {
            wals: self.wals.clone(),
            sync_wals,
            exts: touched
                .iter()
                .filter_map(|&li| self.layers[li].ext.clone())
                .collect(),
            layers: self
                .layers
                .iter()
                .map(|l| (l.data.clone(), l.meta.clone()))
                .collect(),
            touched,
            ops,
            punches,
            punch_now,
        }
    }

    fn write_sb(&mut self) -> Result<()> {
        self.sb.generation += 1;
        let buf = self
            .sb
            .encode()
            .ok_or_else(|| Error::InvalidArgument("superblock does not fit".into()))?;
        let slot = self.sb.generation % 2;
        self.sb_file
            .write_at(&buf, slot * SB_SLOT as u64)
            .map_err(Error::store("write superblock"))?;
        self.sb_file
            .sync()
            .map_err(Error::store("write superblock"))?;
        Ok(())
    }

    /// Starts a rebuild: makes the layer chain match `layers` (keeping local
    /// layers with the same ids, whose blocks the rebuild then compares),
    /// sets the size and position, and persists the `Rebuilding` state.
    pub fn begin_rebuild(
        &mut self,
        layers: &[LayerInfo],
        size_blocks: u64,
        start: Tag,
    ) -> Result<()> {
        if layers.is_empty() || layers.len() > MAX_LAYERS {
            return Err(Error::InvalidArgument("bad layer list".into()));
        }
        self.checkpoint()?;
        self.merge_dropped_layers(layers)?;
        // Its appends may have sealed a WAL: finish that job (and the
        // punches it starts) before layers are replaced or removed.
        self.settle_all()?;
        let mut old: Vec<Layer> = std::mem::take(&mut self.layers);
        let mut new = Vec::new();
        for info in layers {
            if info.name.len() > MAX_NAME_LEN {
                return Err(Error::InvalidArgument("snapshot name too long".into()));
            }
            if let Some(pos) = old.iter().position(|l| l.info.id == info.id) {
                let mut l = old.remove(pos);
                l.info = info.clone();
                new.push(l);
            } else {
                new.push(Self::open_layer(&*self.dir, info.clone(), true)?);
            }
        }
        self.dir.sync_dir().map_err(Error::store("begin rebuild"))?;
        self.layers = new;
        self.sb.layers = layers.to_vec();
        self.sb.state = ReplicaState::Rebuilding;
        self.sb.recovered = false;
        if size_blocks > self.sb.size_blocks {
            self.grow(size_blocks)?;
        }
        self.sb.size_blocks = size_blocks;
        self.layers
            .iter_mut()
            .for_each(|l| l.blocks.truncate(size_blocks));
        self.position = start;
        self.sb.position = start;
        self.write_sb()?;
        for l in old {
            self.remove_layer_files(l)?;
        }
        Ok(())
    }

    /// Before a rebuild adopts `layers`: a local layer the new chain lacks
    /// but that sits below a layer it keeps is a snapshot deleted while
    /// this replica was away. Its good copies the kept layer lacks are
    /// merged into it, as DeleteSnapshot would have done, so a good copy of
    /// a write that is bad on every other replica survives the rebuild
    /// (its tag comparison corrects everything else; bad copies are left
    /// to it). Layers above every kept one (dropped by a revert) are not
    /// merged.
    fn merge_dropped_layers(&mut self, layers: &[LayerInfo]) -> Result<()> {
        let keep = |id: u64| layers.iter().any(|l| l.id == id);
        let mut buf = vec![0u8; BLOCK_SIZE];
        for i in (0..self.layers.len()).rev() {
            if keep(self.layers[i].info.id) {
                continue;
            }
            let Some(k) = (i + 1..self.layers.len()).find(|&k| keep(self.layers[k].info.id)) else {
                continue;
            };
            let kid = self.layers[k].info.id;
            let mut moved: Vec<u64> = self.layers[i]
                .blocks
                .keys()
                .filter(|b| !self.layers[k].blocks.contains_key(*b))
                .collect();
            moved.sort_unstable();
            for b in moved {
                let Some(e) = self.layers[i].blocks.get(b).copied() else {
                    continue;
                };
                if !self.read_entry(i, b, &e, &mut buf) {
                    continue;
                }
                let what = if e.meta.is_zero() {
                    SetBlock::Zero(e.meta.tag)
                } else {
                    SetBlock::Data(e.meta.tag, &buf)
                };
                let (kind, tag, data) = match what {
                    SetBlock::Data(t, d) => (WalKind::SetData, t, d),
                    SetBlock::Zero(t) => (WalKind::SetZero, t, &[][..]),
                    SetBlock::Absent => continue,
                };
                let h = WalHeader {
                    kind,
                    wal_gen: self.wgen,
                    layer: kid,
                    tag,
                    lba: b,
                    nblocks: 1,
                };
                let data = data.to_vec();
                self.append(h, &data)?;
            }
        }
        Ok(())
    }

    /// Writes the completion marker: syncs everything, then persists `Clean`
    /// at the given position (the engine checks it equals the live position).
    pub fn mark_clean(&mut self) -> Result<()> {
        self.checkpoint()?;
        self.sb.state = ReplicaState::Clean;
        self.sb.recovered = false;
        self.write_sb()
    }

    /// Persists the `Rebuilding` state without other changes.
    pub fn mark_rebuilding(&mut self) -> Result<()> {
        self.settle()?;
        self.sb.state = ReplicaState::Rebuilding;
        self.write_sb()
    }

    fn grow(&mut self, size_blocks: u64) -> Result<()> {
        for l in &mut self.layers {
            l.data
                .set_len(size_blocks * BLOCK_SIZE_U64)
                .map_err(Error::store("resize"))?;
        }
        Ok(())
    }

    /// Ordered: freezes the head as snapshot `name` and starts a new empty
    /// head `new_head`.
    pub fn snapshot(&mut self, tag: Tag, name: &str, new_head: u64) -> Result<()> {
        if name.is_empty() || name.len() > MAX_NAME_LEN {
            return Err(Error::InvalidArgument(format!(
                "bad snapshot name {name:?}"
            )));
        }
        if self.layers.len() >= MAX_LAYERS {
            return Err(Error::InvalidArgument("too many snapshots".into()));
        }
        if self.layer_index(new_head).is_some() || self.sb.layers.iter().any(|l| l.name == name) {
            return Err(Error::InvalidArgument(format!("snapshot {name:?} exists")));
        }
        self.checkpoint()?;
        let info = LayerInfo {
            id: new_head,
            name: String::new(),
            created: tag,
        };
        let layer = Self::open_layer(&*self.dir, info.clone(), true)?;
        self.dir.sync_dir().map_err(Error::store("snapshot"))?;
        if let Some(h) = self.layers.last_mut() {
            h.info.name = name.to_string();
            h.info.created = tag;
        }
        self.layers.push(layer);
        self.sb.layers = self.layers.iter().map(|l| l.info.clone()).collect();
        self.position = tag;
        self.sb.position = tag;
        self.write_sb()?;
        // The frozen layer takes no more large writes: its pool goes back.
        self.reclaim_ext_now();
        Ok(())
    }

    /// Ordered: deletes snapshot layer `layer`, merging the blocks it holds
    /// that its child does not into the child first.
    pub fn delete_snapshot(&mut self, tag: Tag, layer: u64) -> Result<()> {
        let li = self
            .layer_index(layer)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
        if li + 1 == self.layers.len() {
            return Err(Error::InvalidArgument("cannot delete the head".into()));
        }
        self.checkpoint()?;
        let mut moved: Vec<u64> = self.layers[li]
            .blocks
            .keys()
            .filter(|b| !self.layers[li + 1].blocks.contains_key(*b))
            .collect();
        moved.sort_unstable();
        let mut buf = vec![0u8; BLOCK_SIZE];
        for b in moved {
            let Some(e) = self.layers[li].blocks.get(b).copied() else {
                continue;
            };
            let mut e2 = e;
            if !self.read_entry(li, b, &e, &mut buf) {
                // Keep the damage visible in the child instead of copying
                // garbage, with the tag of the write it lost: a peer's copy
                // of that write (in any state) can still repair it, also
                // after a restart (seed 5683: an all-ones marker lost the
                // tag and left a block no peer could prove).
                e2.loc = Loc::Damaged;
                e2.meta.flags |= META_DAMAGED;
            } else {
                if !e.meta.is_zero() {
                    self.layers[li + 1]
                        .data
                        .write_at(&buf, b * BLOCK_SIZE_U64)
                        .map_err(Error::store("merge snapshot"))?;
                }
                e2.loc = Loc::Layer;
            }
            let mb = e2.meta.encode();
            self.layers[li + 1]
                .meta
                .write_at(&mb, b * META_SIZE as u64)
                .map_err(Error::store("merge snapshot"))?;
            self.layers[li + 1].blocks.insert(b, e2);
        }
        self.layers[li + 1]
            .data
            .sync()
            .map_err(Error::store("merge snapshot"))?;
        self.layers[li + 1]
            .meta
            .sync()
            .map_err(Error::store("merge snapshot"))?;
        let removed = self.layers.remove(li);
        self.sb.layers = self.layers.iter().map(|l| l.info.clone()).collect();
        self.position = tag;
        self.sb.position = tag;
        self.write_sb()?;
        self.remove_layer_files(removed)
    }

    /// Ordered: reverts to snapshot `layer`: drops every layer above it and
    /// starts a new empty head `new_head` on top of it.
    pub fn revert(&mut self, tag: Tag, layer: u64, new_head: u64) -> Result<()> {
        let li = self
            .layer_index(layer)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
        if li + 1 == self.layers.len() {
            return Err(Error::InvalidArgument("cannot revert to the head".into()));
        }
        if self.layer_index(new_head).is_some() {
            return Err(Error::InvalidArgument("new head id in use".into()));
        }
        self.checkpoint()?;
        let info = LayerInfo {
            id: new_head,
            name: String::new(),
            created: tag,
        };
        let head = Self::open_layer(&*self.dir, info, true)?;
        self.dir.sync_dir().map_err(Error::store("revert"))?;
        let dropped: Vec<Layer> = self.layers.drain(li + 1..).collect();
        self.layers.push(head);
        self.sb.layers = self.layers.iter().map(|l| l.info.clone()).collect();
        self.position = tag;
        self.sb.position = tag;
        self.write_sb()?;
        for l in dropped {
            self.remove_layer_files(l)?;
        }
        Ok(())
    }

    /// Ordered: grows the volume to `size_blocks` (shrinking is refused).
    pub fn resize(&mut self, tag: Tag, size_blocks: u64) -> Result<()> {
        if size_blocks < self.sb.size_blocks {
            return Err(Error::InvalidArgument(format!(
                "cannot shrink from {} to {} blocks",
                self.sb.size_blocks, size_blocks
            )));
        }
        self.checkpoint()?;
        self.grow(size_blocks)?;
        self.sb.size_blocks = size_blocks;
        self.position = tag;
        self.sb.position = tag;
        self.write_sb()
    }

    /// Ordered no-op that only advances the position (used for operations
    /// that change nothing on this replica).
    pub fn advance(&mut self, tag: Tag) -> Result<()> {
        self.checkpoint()?;
        self.position = tag;
        self.sb.position = tag;
        self.write_sb()
    }

    /// Whether the copies a crash would fall back to verify: for every block
    /// whose current copy is still only in the WAL, the copy in its layer
    /// files (metadata entry and data) that recovery would expose if the
    /// WAL record were lost. For the simulator's fault model (damage to a
    /// shadowed copy is invisible to reads until a power loss un-shadows
    /// it); reads the files, so not for the data path.
    pub fn fallback_copies_ok(&self) -> bool {
        let mut buf = vec![0u8; BLOCK_SIZE];
        let sealed = self.sealed.iter().flat_map(|s| s.dirty.iter());
        self.dirty.iter().chain(sealed).all(|(layer, lba)| {
            let Some(li) = self.layer_index(layer) else {
                return true;
            };
            let l = &self.layers[li];
            let mut raw = [0u8; META_SIZE];
            if l.meta.read_at(&mut raw, lba * META_SIZE as u64).is_err() {
                // Past the end of the meta file: no older copy.
                return l.meta.len().is_ok_and(|n| n <= lba * META_SIZE as u64);
            }
            match BlockMeta::decode(&raw) {
                Ok(None) => true,
                Ok(Some(m)) if m.is_damaged() => false,
                Ok(Some(m)) if m.is_zero() => true,
                Ok(Some(m)) if m.flags & META_EXTENT != 0 => {
                    let x = BlockMeta::extent_block(&raw).unwrap_or(0);
                    l.ext.as_ref().is_some_and(|f| {
                        f.read_at(&mut buf, u64::from(x) * BLOCK_SIZE_U64).is_ok()
                            && self.sb.checksum.block(lba, &buf) == m.crc
                    })
                }
                Ok(Some(m)) => {
                    l.data.read_at(&mut buf, lba * BLOCK_SIZE_U64).is_ok()
                        && self.sb.checksum.block(lba, &buf) == m.crc
                }
                Err(()) => false,
            }
        })
    }

    /// Debug description of a block's entry in a layer (for diagnostics).
    pub fn describe_block(&self, layer: u64, lba: u64) -> String {
        let Some(li) = self.layer_index(layer) else {
            return "no layer".into();
        };
        let e = self.layers[li].blocks.get(lba);
        let mut buf = vec![0u8; BLOCK_SIZE];
        let actual = e.map(|e| match e.loc {
            Loc::Layer => self.layers[li]
                .data
                .read_at(&mut buf, lba * BLOCK_SIZE_U64)
                .map(|_| self.sb.checksum.block(lba, &buf))
                .ok(),
            Loc::Wal(f, off) => self.wals[usize::from(f)]
                .read_at(&mut buf, off)
                .map(|_| self.sb.checksum.block(lba, &buf))
                .ok(),
            Loc::Ext(x) => self.layers[li].ext.as_ref().and_then(|f| {
                f.read_at(&mut buf, u64::from(x) * BLOCK_SIZE_U64)
                    .map(|_| self.sb.checksum.block(lba, &buf))
                    .ok()
            }),
            Loc::Damaged => None,
        });
        let rl = self
            .read_layer(layer, lba, 1, true)
            .ok()
            .and_then(|mut v| v.pop())
            .and_then(|(_, d)| d);
        let same = rl.as_deref() == Some(&buf[..]);
        format!(
            "{e:?} actual crc {actual:?} head {:?} read_layer same {same}",
            &buf[..16]
        )
    }

    /// Ids of the layers, bottom first.
    pub fn layer_ids(&self) -> Vec<u64> {
        self.layers.iter().map(|l| l.info.id).collect()
    }
}

#[cfg(test)]
mod tests;
