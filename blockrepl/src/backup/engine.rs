// SPDX-License-Identifier: Apache-2.0
//! Backup: planning (which chunks to read, reuse or skip), reading,
//! hashing and compressing, uploading, and the manifest written last.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::catalog::{list, load_manifest};
use super::manifest::FORMAT;
use super::{
    BackupError, BackupTarget, ChunkRef, Manifest, SnapshotRef, check_volume_name, chunk_key,
    chunks_prefix, manifest_key,
};
use crate::store::Store;
use crate::types::{BLOCK_SIZE, LayerInfo, Tag};

/// Default chunk size in blocks (1 MiB).
pub const DEFAULT_CHUNK_BLOCKS: u32 = 256;
/// Largest chunk size in blocks (16 MiB).
pub const MAX_CHUNK_BLOCKS: u32 = 4096;

/// What a backup reads: one frozen snapshot of a volume.
///
/// [`StoreSnapshot`] is the implementation over a replica [`Store`]; the
/// engine only needs reads and the store's knowledge of which blocks were
/// written.
pub trait SnapshotSource {
    /// Volume size in blocks.
    fn size_blocks(&self) -> u64;
    /// Which snapshot this is (recorded in the manifest).
    fn snapshot(&self) -> SnapshotRef;
    /// The blocks that may hold data in this snapshot, ascending, or `None`
    /// if unknown (then every chunk is read). Blocks not listed read as
    /// zeros.
    fn present_blocks(&self) -> Option<Vec<u64>>;
    /// The blocks that may differ between snapshot `since` (an older
    /// snapshot of the same volume) and this one, or `None` if the source
    /// cannot tell (`since` is gone or is not below this snapshot): then
    /// the backup reads every present block and relies on dedup.
    fn changed_since(&self, since: &SnapshotRef) -> Option<Vec<u64>>;
    /// Reads `nblocks` blocks at `lba` into `out` (`nblocks * 4096` bytes).
    /// A block that fails verification is an error, never zeros.
    fn read(&self, lba: u64, nblocks: u32, out: &mut [u8]) -> Result<(), BackupError>;
}

/// A named snapshot of a [`Store`] as a [`SnapshotSource`].
#[derive(Debug)]
pub struct StoreSnapshot<'a> {
    store: &'a Store,
    layers: Vec<LayerInfo>,
    /// Index of the snapshot in `layers` (bottom first).
    li: usize,
}

impl<'a> StoreSnapshot<'a> {
    /// The snapshot named `name` of `store` (not the head: it still changes).
    pub fn new(store: &'a Store, name: &str) -> Result<StoreSnapshot<'a>, BackupError> {
        let layers = store.info().layers;
        let li = layers
            .iter()
            .position(|l| !name.is_empty() && l.name == name)
            .ok_or_else(|| BackupError::InvalidArgument(format!("no snapshot {name:?}")))?;
        Ok(StoreSnapshot { store, layers, li })
    }

    fn union_blocks(&self, from: usize) -> Vec<u64> {
        let mut set = BTreeSet::new();
        for l in &self.layers[from..=self.li] {
            set.extend(self.store.layer_blocks(l.id).unwrap_or_default());
        }
        set.into_iter().collect()
    }
}

impl SnapshotSource for StoreSnapshot<'_> {
    fn size_blocks(&self) -> u64 {
        self.store.size_blocks()
    }

    fn snapshot(&self) -> SnapshotRef {
        let l = &self.layers[self.li];
        SnapshotRef {
            name: l.name.clone(),
            layer: l.id,
            created_epoch: l.created.epoch,
            created_index: l.created.index,
        }
    }

    fn present_blocks(&self) -> Option<Vec<u64>> {
        Some(self.union_blocks(0))
    }

    fn changed_since(&self, since: &SnapshotRef) -> Option<Vec<u64>> {
        let pi = self.layers.iter().position(|l| {
            l.id == since.layer
                && l.name == since.name
                && l.created == Tag::new(since.created_epoch, since.created_index)
        })?;
        if pi > self.li {
            return None;
        }
        if pi == self.li {
            return Some(Vec::new());
        }
        Some(self.union_blocks(pi + 1))
    }

    fn read(&self, lba: u64, nblocks: u32, out: &mut [u8]) -> Result<(), BackupError> {
        let layer = self.layers[self.li].id;
        let bad = self.store.read_snapshot(layer, lba, nblocks, out)?;
        match bad.first() {
            Some(&(lba, layer)) => Err(BackupError::SourceDamaged { lba, layer }),
            None => Ok(()),
        }
    }
}

/// Which backup an incremental backup starts from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Parent {
    /// The volume's newest backup on the target, if any (default).
    #[default]
    Latest,
    /// None: a full backup (chunks already on the target are still not
    /// uploaded again).
    Full,
    /// This backup id.
    Id(String),
}

/// Progress of a backup or restore, published after every chunk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackupProgress {
    /// Chunks handled so far (read, reused or holes).
    pub chunks_done: u64,
    /// Chunks in the volume.
    pub chunks_total: u64,
    /// Bytes read from the source (backup) or the target (restore).
    pub bytes_read: u64,
    /// Bytes written to the target (backup) or the sink (restore).
    pub bytes_written: u64,
    /// Set when the operation finished successfully.
    pub done: bool,
}

/// Options of [`backup`].
#[derive(Debug)]
pub struct BackupOptions {
    /// The backup to be incremental from.
    pub parent: Parent,
    /// Blocks per chunk for a full backup (an incremental one keeps its
    /// parent's chunk size).
    pub chunk_blocks: u32,
    /// Uploads in flight at once.
    pub concurrency: usize,
    /// Limit on the bytes read from the source per second.
    pub throttle_bytes_per_sec: Option<u64>,
    /// Where progress is published.
    pub progress: Option<watch::Sender<BackupProgress>>,
}

impl Default for BackupOptions {
    fn default() -> Self {
        BackupOptions {
            parent: Parent::Latest,
            chunk_blocks: DEFAULT_CHUNK_BLOCKS,
            concurrency: 8,
            throttle_bytes_per_sec: None,
            progress: None,
        }
    }
}

/// What a backup did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupReport {
    /// The new backup's id.
    pub id: String,
    /// The backup it was incremental from.
    pub parent: Option<String>,
    /// Chunks in the volume.
    pub chunks_total: u64,
    /// Chunks read from the source.
    pub chunks_read: u64,
    /// Chunks uploaded.
    pub chunks_written: u64,
    /// Chunks read whose content was already on the target (not uploaded).
    pub chunks_deduped: u64,
    /// Chunks taken from the parent backup without reading them.
    pub chunks_reused: u64,
    /// All-zero chunks (no object).
    pub holes: u64,
    /// Bytes read from the source.
    pub bytes_read: u64,
    /// Bytes uploaded (compressed chunks and the manifest).
    pub bytes_written: u64,
    /// Wall time.
    pub duration: Duration,
}

/// Sleeps so that the bytes counted stay under a rate.
pub(super) struct Throttle {
    rate: Option<u64>,
    start: Instant,
    bytes: u64,
}

impl Throttle {
    pub(super) fn new(rate: Option<u64>) -> Throttle {
        Throttle {
            rate: rate.filter(|&r| r > 0),
            start: Instant::now(),
            bytes: 0,
        }
    }

    pub(super) async fn add(&mut self, n: u64) {
        let Some(rate) = self.rate else { return };
        self.bytes += n;
        let want = Duration::from_secs_f64(self.bytes as f64 / rate as f64);
        let elapsed = self.start.elapsed();
        if want > elapsed {
            tokio::time::sleep(want - elapsed).await;
        }
    }
}

pub(super) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn new_backup_id(volume: &str, snapshot: &str, ms: u64) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let mut h = Sha256::new();
    h.update(format!("{volume}\0{snapshot}\0{ms}\0{}\0{seq}", std::process::id()).as_bytes());
    let tail = hex(&h.finalize()[..4]);
    format!("{ms:013}-{tail}")
}

pub(super) fn check_id(id: &str) -> Result<(), BackupError> {
    if !id.is_empty()
        && id.len() <= 64
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
    {
        Ok(())
    } else {
        Err(BackupError::InvalidArgument(format!(
            "bad backup id {id:?}"
        )))
    }
}

pub(super) fn publish(progress: &Option<watch::Sender<BackupProgress>>, p: &BackupProgress) {
    if let Some(tx) = progress {
        tx.send_replace(p.clone());
    }
}

pub(super) fn join_err(
    target: &dyn BackupTarget,
    op: &'static str,
    e: tokio::task::JoinError,
) -> BackupError {
    BackupError::Target {
        target: target.describe(),
        op,
        key: String::new(),
        source: Box::new(e),
    }
}

/// A chunk read, hashed and compressed.
struct Hashed {
    index: u64,
    len: u32,
    /// `None` for an all-zero chunk.
    sha: Option<String>,
    stored: Vec<u8>,
}

fn hash_chunk(index: u64, data: Vec<u8>) -> Hashed {
    let len = data.len() as u32;
    if data.iter().all(|&b| b == 0) {
        return Hashed {
            index,
            len,
            sha: None,
            stored: Vec::new(),
        };
    }
    Hashed {
        index,
        len,
        sha: Some(hex(&Sha256::digest(&data))),
        stored: lz4_flex::compress_prepend_size(&data),
    }
}

/// The state of a running backup after planning.
struct Run<'a> {
    target: &'a Arc<dyn BackupTarget>,
    volume: &'a str,
    /// Chunk contents with a known stored form: hash -> ref.
    known: HashMap<String, ChunkRef>,
    /// Chunk objects on the target when the backup started: hash -> size.
    on_target: HashMap<String, u64>,
    refs: Vec<ChunkRef>,
    report: BackupReport,
    progress: BackupProgress,
    data_bytes: u64,
    inflight: FuturesUnordered<JoinHandle<Result<u64, BackupError>>>,
    concurrency: usize,
}

impl Run<'_> {
    /// Waits for one upload.
    async fn next_upload(&mut self) -> Result<(), BackupError> {
        match self.inflight.next().await {
            Some(done) => self.uploaded(done),
            None => Ok(()),
        }
    }

    /// Accounts for a finished upload.
    fn uploaded(
        &mut self,
        done: Result<Result<u64, BackupError>, tokio::task::JoinError>,
    ) -> Result<(), BackupError> {
        let n = done.map_err(|e| join_err(&**self.target, "put", e))??;
        self.report.bytes_written += n;
        self.progress.bytes_written += n;
        Ok(())
    }

    /// Takes a hashed chunk: a hole, a known content, or an upload.
    async fn hashed(&mut self, h: JoinHandle<Hashed>) -> Result<(), BackupError> {
        let h = h.await.map_err(|e| join_err(&**self.target, "hash", e))?;
        let Some(sha) = h.sha else {
            self.report.holes += 1;
            return Ok(());
        };
        self.data_bytes += u64::from(h.len);
        if let Some(k) = self.known.get(&sha) {
            self.report.chunks_deduped += 1;
            self.refs.push(ChunkRef {
                index: h.index,
                ..k.clone()
            });
            return Ok(());
        }
        let stored_len = h.stored.len() as u64;
        let r = ChunkRef {
            index: h.index,
            sha256: sha.clone(),
            len: h.len,
            stored_len,
            crc32c: crc32c::crc32c(&h.stored),
        };
        self.known.insert(sha.clone(), r.clone());
        self.refs.push(r);
        if self.on_target.get(&sha) == Some(&stored_len) {
            // Uploaded by an earlier attempt or backup.
            self.report.chunks_deduped += 1;
            return Ok(());
        }
        // Take finished uploads first, so a failing target stops the
        // backup at once instead of when the window fills.
        while let Some(Some(done)) = self.inflight.next().now_or_never() {
            self.uploaded(done)?;
        }
        while self.inflight.len() >= self.concurrency {
            self.next_upload().await?;
        }
        let t = Arc::clone(self.target);
        let key = chunk_key(self.volume, &sha);
        let stored = Bytes::from(h.stored);
        self.inflight.push(tokio::spawn(async move {
            t.put(&key, stored).await.map(|()| stored_len)
        }));
        self.report.chunks_written += 1;
        Ok(())
    }
}

/// What a backup does with one chunk.
enum Plan<'m> {
    Hole,
    Reuse(&'m ChunkRef),
    Read,
}

/// Backs up snapshot `source` of `volume` to `target`.
///
/// Reads the chunks that hold blocks written since the parent backup's
/// snapshot (all present chunks for a full backup), skips all-zero ones,
/// uploads those whose content is not on the target yet, and writes the
/// manifest last. On any error the backup stops, in-flight uploads are
/// aborted and no manifest is written: the chunks it did upload are reused
/// by the next attempt or removed by [`gc`](super::gc). Do not run `gc` with a
/// `grace` shorter than a backup takes while a backup of the volume runs.
///
/// Runs on a tokio runtime (uploads are spawned tasks); reads of the
/// source happen on the calling task.
pub async fn backup(
    source: &dyn SnapshotSource,
    target: &Arc<dyn BackupTarget>,
    volume: &str,
    opts: &BackupOptions,
) -> Result<BackupReport, BackupError> {
    check_volume_name(volume)?;
    let t0 = Instant::now();
    let snap = source.snapshot();
    let size_blocks = source.size_blocks();
    // What the target already holds: chunks (dedup and resume) and the parent.
    let mut on_target: HashMap<String, u64> = HashMap::new();
    for o in target.list(&chunks_prefix(volume)).await? {
        if let Some(sha) = o.key.rsplit('/').next() {
            on_target.insert(sha.to_string(), o.size);
        }
    }
    let parent = match &opts.parent {
        Parent::Full => None,
        Parent::Id(id) => Some(load_manifest(&**target, volume, id).await?),
        Parent::Latest => list(&**target, volume).await?.pop(),
    };
    let chunk_blocks = parent
        .as_ref()
        .map_or(opts.chunk_blocks, |p| p.chunk_blocks);
    if chunk_blocks == 0 || chunk_blocks > MAX_CHUNK_BLOCKS {
        return Err(BackupError::InvalidArgument(format!(
            "chunk size {chunk_blocks} blocks (1..={MAX_CHUNK_BLOCKS})"
        )));
    }
    let cb = u64::from(chunk_blocks);
    let to_chunks = |blocks: Vec<u64>| blocks.into_iter().map(|b| b / cb).collect::<BTreeSet<_>>();
    let changed = parent
        .as_ref()
        .and_then(|p| source.changed_since(&p.snapshot))
        .map(to_chunks);
    let present = source.present_blocks().map(to_chunks);
    // Known chunk contents: hash -> ref (stored length and CRC).
    let mut known: HashMap<String, ChunkRef> = HashMap::new();
    let mut parent_refs: HashMap<u64, &ChunkRef> = HashMap::new();
    if let Some(p) = &parent {
        for c in &p.chunks {
            known.entry(c.sha256.clone()).or_insert_with(|| c.clone());
            parent_refs.insert(c.index, c);
        }
    }
    let nchunks = size_blocks.div_ceil(cb);
    let plan = |c: u64| {
        match (&parent, &changed) {
            (Some(p), Some(changed)) => {
                // If the size changed, a chunk that is not whole in both
                // (the parent's partial last chunk, new chunks) is read.
                let resized =
                    size_blocks != p.size_blocks && (c + 1) * cb > p.size_blocks.min(size_blocks);
                if changed.contains(&c) || resized {
                    Plan::Read
                } else {
                    parent_refs.get(&c).map_or(Plan::Hole, |r| Plan::Reuse(r))
                }
            }
            _ => match &present {
                Some(present) if !present.contains(&c) => Plan::Hole,
                _ => Plan::Read,
            },
        }
    };
    info!(
        volume,
        snapshot = %snap.name,
        parent = parent.as_ref().map(|p| p.id.as_str()),
        incremental = changed.is_some(),
        chunks = nchunks,
        target = %target.describe(),
        "backup starting"
    );
    let report = BackupReport {
        id: String::new(),
        parent: parent.as_ref().map(|p| p.id.clone()),
        chunks_total: nchunks,
        chunks_read: 0,
        chunks_written: 0,
        chunks_deduped: 0,
        chunks_reused: 0,
        holes: 0,
        bytes_read: 0,
        bytes_written: 0,
        duration: Duration::ZERO,
    };
    let progress = BackupProgress {
        chunks_total: nchunks,
        ..BackupProgress::default()
    };
    let mut throttle = Throttle::new(opts.throttle_bytes_per_sec);
    let mut run = Run {
        target,
        volume,
        known,
        on_target,
        refs: Vec::new(),
        report,
        progress,
        data_bytes: 0,
        inflight: FuturesUnordered::new(),
        concurrency: opts.concurrency.max(1),
    };
    // Chunks read and being hashed and compressed on the blocking pool,
    // in chunk order.
    let mut hashing: VecDeque<JoinHandle<Hashed>> = VecDeque::new();
    let result: Result<(), BackupError> = async {
        for c in 0..nchunks {
            match plan(c) {
                Plan::Hole => run.report.holes += 1,
                Plan::Reuse(r) => {
                    run.report.chunks_reused += 1;
                    run.data_bytes += u64::from(r.len);
                    run.refs.push(r.clone());
                }
                Plan::Read => {
                    let lba = c * cb;
                    let n = (size_blocks - lba).min(cb) as u32;
                    let len = n as usize * BLOCK_SIZE;
                    let mut data = vec![0u8; len];
                    source.read(lba, n, &mut data)?;
                    throttle.add(len as u64).await;
                    run.report.chunks_read += 1;
                    run.report.bytes_read += len as u64;
                    run.progress.bytes_read += len as u64;
                    hashing.push_back(tokio::task::spawn_blocking(move || hash_chunk(c, data)));
                    while hashing.len() > run.concurrency {
                        if let Some(h) = hashing.pop_front() {
                            run.hashed(h).await?;
                        }
                    }
                }
            }
            run.progress.chunks_done = c + 1;
            publish(&opts.progress, &run.progress);
        }
        while let Some(h) = hashing.pop_front() {
            run.hashed(h).await?;
        }
        while !run.inflight.is_empty() {
            run.next_upload().await?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        for h in run.inflight.iter() {
            h.abort();
        }
        warn!(volume, snapshot = %snap.name, error = %e, "backup failed: no manifest written");
        return Err(e);
    }
    let Run {
        mut refs,
        mut report,
        mut progress,
        data_bytes,
        ..
    } = run;
    refs.sort_unstable_by_key(|r| r.index);
    let created = now_ms();
    let id = new_backup_id(volume, &snap.name, created);
    let manifest = Manifest {
        format: FORMAT,
        id: id.clone(),
        volume: volume.to_string(),
        size_blocks,
        block_size: BLOCK_SIZE as u32,
        chunk_blocks,
        snapshot: snap,
        created_unix_ms: created,
        parent: report.parent.clone(),
        data_bytes,
        chunks: refs,
    };
    let body = manifest.encode();
    report.bytes_written += body.len() as u64;
    target
        .put(&manifest_key(volume, &id), Bytes::from(body))
        .await?;
    report.id = id;
    report.duration = t0.elapsed();
    progress.bytes_written = report.bytes_written;
    progress.done = true;
    publish(&opts.progress, &progress);
    info!(
        volume,
        id = %report.id,
        read = report.chunks_read,
        written = report.chunks_written,
        reused = report.chunks_reused,
        deduped = report.chunks_deduped,
        secs = report.duration.as_secs_f64(),
        "backup done"
    );
    Ok(report)
}
