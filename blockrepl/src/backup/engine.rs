// SPDX-License-Identifier: Apache-2.0
//! Backup, restore, catalog, delete, garbage collection and retention.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::manifest::FORMAT;
use super::{
    BackupError, BackupTarget, ChunkRef, Manifest, SnapshotRef, backups_prefix, check_volume_name,
    chunk_key, chunks_prefix, manifest_key,
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
struct Throttle {
    rate: Option<u64>,
    start: Instant,
    bytes: u64,
}

impl Throttle {
    fn new(rate: Option<u64>) -> Throttle {
        Throttle {
            rate: rate.filter(|&r| r > 0),
            start: Instant::now(),
            bytes: 0,
        }
    }

    async fn add(&mut self, n: u64) {
        let Some(rate) = self.rate else { return };
        self.bytes += n;
        let want = Duration::from_secs_f64(self.bytes as f64 / rate as f64);
        let elapsed = self.start.elapsed();
        if want > elapsed {
            tokio::time::sleep(want - elapsed).await;
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn now_ms() -> u64 {
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

fn check_id(id: &str) -> Result<(), BackupError> {
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

fn publish(progress: &Option<watch::Sender<BackupProgress>>, p: &BackupProgress) {
    if let Some(tx) = progress {
        tx.send_replace(p.clone());
    }
}

fn join_err(target: &dyn BackupTarget, op: &'static str, e: tokio::task::JoinError) -> BackupError {
    BackupError::Target {
        target: target.describe(),
        op,
        key: String::new(),
        source: Box::new(e),
    }
}

/// Waits for one upload; returns its stored bytes.
async fn next_upload(
    target: &dyn BackupTarget,
    inflight: &mut FuturesUnordered<JoinHandle<Result<u64, BackupError>>>,
) -> Result<u64, BackupError> {
    match inflight.next().await {
        Some(Ok(r)) => r,
        Some(Err(e)) => Err(join_err(target, "put", e)),
        None => Ok(0),
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
/// by the next attempt or removed by [`gc`]. Do not run [`gc`] with a
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
                // A chunk the parent did not cover whole (the volume grew)
                // is read again.
                let grown = (c + 1) * cb > p.size_blocks && size_blocks != p.size_blocks;
                if changed.contains(&c) || grown {
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
    let mut report = BackupReport {
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
    let mut progress = BackupProgress {
        chunks_total: nchunks,
        ..BackupProgress::default()
    };
    let mut throttle = Throttle::new(opts.throttle_bytes_per_sec);
    let mut refs: Vec<ChunkRef> = Vec::new();
    let mut data_bytes = 0u64;
    let mut inflight = FuturesUnordered::new();
    let concurrency = opts.concurrency.max(1);
    let mut buf = vec![0u8; chunk_blocks as usize * BLOCK_SIZE];
    let result: Result<(), BackupError> = async {
        for c in 0..nchunks {
            match plan(c) {
                Plan::Hole => report.holes += 1,
                Plan::Reuse(r) => {
                    report.chunks_reused += 1;
                    data_bytes += u64::from(r.len);
                    refs.push(r.clone());
                }
                Plan::Read => {
                    let lba = c * cb;
                    let n = (size_blocks - lba).min(cb) as u32;
                    let len = n as usize * BLOCK_SIZE;
                    let data = &mut buf[..len];
                    source.read(lba, n, data)?;
                    throttle.add(len as u64).await;
                    report.chunks_read += 1;
                    report.bytes_read += len as u64;
                    progress.bytes_read += len as u64;
                    if data.iter().all(|&b| b == 0) {
                        report.holes += 1;
                    } else {
                        data_bytes += len as u64;
                        let sha = hex(&Sha256::digest(&*data));
                        if let Some(k) = known.get(&sha) {
                            report.chunks_deduped += 1;
                            refs.push(ChunkRef {
                                index: c,
                                ..k.clone()
                            });
                        } else {
                            let stored = lz4_flex::compress_prepend_size(data);
                            let r = ChunkRef {
                                index: c,
                                sha256: sha.clone(),
                                len: len as u32,
                                stored_len: stored.len() as u64,
                                crc32c: crc32c::crc32c(&stored),
                            };
                            known.insert(sha.clone(), r.clone());
                            refs.push(r);
                            if on_target.get(&sha) == Some(&(stored.len() as u64)) {
                                // Uploaded by an earlier attempt or backup.
                                report.chunks_deduped += 1;
                            } else {
                                while inflight.len() >= concurrency {
                                    let n = next_upload(&**target, &mut inflight).await?;
                                    report.bytes_written += n;
                                    progress.bytes_written += n;
                                }
                                let t = Arc::clone(target);
                                let key = chunk_key(volume, &sha);
                                let n = stored.len() as u64;
                                inflight.push(tokio::spawn(async move {
                                    t.put(&key, Bytes::from(stored)).await.map(|()| n)
                                }));
                                report.chunks_written += 1;
                            }
                        }
                    }
                }
            }
            progress.chunks_done = c + 1;
            publish(&opts.progress, &progress);
        }
        while !inflight.is_empty() {
            let n = next_upload(&**target, &mut inflight).await?;
            report.bytes_written += n;
            progress.bytes_written += n;
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        for h in inflight.iter() {
            h.abort();
        }
        warn!(volume, snapshot = %snap.name, error = %e, "backup failed: no manifest written");
        return Err(e);
    }
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

/// Reads and checks the manifest of backup `id` of `volume`.
pub async fn load_manifest(
    target: &dyn BackupTarget,
    volume: &str,
    id: &str,
) -> Result<Manifest, BackupError> {
    check_volume_name(volume)?;
    check_id(id)?;
    let key = manifest_key(volume, id);
    let bytes = target.get(&key).await?;
    let m = Manifest::decode(&key, &bytes)?;
    if m.volume != volume || m.id != id {
        return Err(BackupError::CorruptManifest {
            key,
            reason: format!("names backup {}/{}", m.volume, m.id),
        });
    }
    Ok(m)
}

/// The catalog: every backup of `volume` on the target, oldest first, read
/// from the target alone. A manifest that cannot be read is an error naming
/// it (so [`gc`] never runs on a partial catalog).
pub async fn list(target: &dyn BackupTarget, volume: &str) -> Result<Vec<Manifest>, BackupError> {
    check_volume_name(volume)?;
    let mut ids: Vec<String> = target
        .list(&backups_prefix(volume))
        .await?
        .into_iter()
        .filter_map(|o| {
            let name = o.key.rsplit('/').next()?;
            name.strip_suffix(".json").map(str::to_string)
        })
        .collect();
    ids.sort();
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        out.push(load_manifest(target, volume, &id).await?);
    }
    Ok(out)
}

/// Deletes backup `id` of `volume` (its manifest). Other backups stay
/// complete, also later incrementals of it: every manifest lists all its
/// chunks. Space comes back with [`gc`].
pub async fn delete(target: &dyn BackupTarget, volume: &str, id: &str) -> Result<(), BackupError> {
    check_volume_name(volume)?;
    check_id(id)?;
    let key = manifest_key(volume, id);
    // NotFound if there is no such backup.
    target.get(&key).await?;
    target.delete(&key).await?;
    info!(volume, id, "backup deleted");
    Ok(())
}

/// What [`gc`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Chunks still referenced by a backup.
    pub chunks_kept: u64,
    /// Unreferenced chunks deleted.
    pub chunks_deleted: u64,
    /// Their stored bytes.
    pub bytes_deleted: u64,
    /// Unreferenced chunks younger than the grace period, left in place.
    pub chunks_young: u64,
}

/// Deletes the chunks of `volume` that no backup references and that are
/// older than `grace` (so the chunks of a backup still running survive).
pub async fn gc(
    target: &dyn BackupTarget,
    volume: &str,
    grace: Duration,
) -> Result<GcReport, BackupError> {
    let manifests = list(target, volume).await?;
    let referenced: HashSet<&str> = manifests
        .iter()
        .flat_map(|m| m.chunks.iter().map(|c| c.sha256.as_str()))
        .collect();
    let now = SystemTime::now();
    let mut report = GcReport::default();
    for o in target.list(&chunks_prefix(volume)).await? {
        let sha = o.key.rsplit('/').next().unwrap_or_default();
        if referenced.contains(sha) {
            report.chunks_kept += 1;
        } else if now.duration_since(o.modified).unwrap_or_default() < grace {
            report.chunks_young += 1;
        } else {
            target.delete(&o.key).await?;
            report.chunks_deleted += 1;
            report.bytes_deleted += o.size;
        }
    }
    info!(volume, ?report, "backup gc done");
    Ok(report)
}

/// Keeps the newest `keep` backups of `volume`, deletes the older ones and
/// then runs [`gc`]. Returns the deleted ids and the gc report.
pub async fn retain(
    target: &dyn BackupTarget,
    volume: &str,
    keep: usize,
    grace: Duration,
) -> Result<(Vec<String>, GcReport), BackupError> {
    let manifests = list(target, volume).await?;
    let drop_n = manifests.len().saturating_sub(keep);
    let mut deleted = Vec::with_capacity(drop_n);
    for m in &manifests[..drop_n] {
        target.delete(&manifest_key(volume, &m.id)).await?;
        deleted.push(m.id.clone());
    }
    let report = gc(target, volume, grace).await?;
    Ok((deleted, report))
}

/// Where a restore writes. Writes come in ascending block order.
pub trait RestoreSink {
    /// Writes `data` (whole blocks) at block `lba`.
    fn write(&mut self, lba: u64, data: &[u8]) -> Result<(), BackupError>;
    /// Makes `nblocks` blocks at `lba` read as zeros.
    fn zero(&mut self, lba: u64, nblocks: u64) -> Result<(), BackupError>;
    /// Called once after the last write (sync).
    fn finish(&mut self) -> Result<(), BackupError> {
        Ok(())
    }
}

/// Restores into a fresh [`Store`] (or over an existing head) with ordered
/// writes, tags counting up from a first tag.
#[derive(Debug)]
pub struct StoreSink<'a> {
    store: &'a mut Store,
    next: Tag,
}

impl<'a> StoreSink<'a> {
    /// Writes into `store`'s head, the first write at tag `first` (it must
    /// follow the store's position).
    pub fn new(store: &'a mut Store, first: Tag) -> StoreSink<'a> {
        StoreSink { store, next: first }
    }

    /// The tag the next write would take (the position after the restore
    /// is the one before it).
    pub fn next_tag(&self) -> Tag {
        self.next
    }

    fn tag(&mut self) -> Tag {
        let t = self.next;
        self.next.index += 1;
        t
    }
}

impl RestoreSink for StoreSink<'_> {
    fn write(&mut self, lba: u64, data: &[u8]) -> Result<(), BackupError> {
        let n = (data.len() / BLOCK_SIZE) as u32;
        let tag = self.tag();
        Ok(self.store.write(tag, lba, n, Some(data))?)
    }

    fn zero(&mut self, lba: u64, nblocks: u64) -> Result<(), BackupError> {
        let mut done = 0;
        while done < nblocks {
            let n = (nblocks - done).min(1 << 20) as u32;
            let tag = self.tag();
            self.store.write(tag, lba + done, n, None)?;
            done += u64::from(n);
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<(), BackupError> {
        Ok(self.store.flush()?)
    }
}

/// Restores into a new sparse file (a raw image).
#[derive(Debug)]
pub struct FileSink {
    file: File,
}

impl FileSink {
    /// Creates (or truncates) `path` as a sparse file of `size_blocks`.
    pub fn create(path: &Path, size_blocks: u64) -> Result<FileSink, BackupError> {
        let io = |e: std::io::Error| BackupError::Target {
            target: path.display().to_string(),
            op: "create",
            key: String::new(),
            source: Box::new(e),
        };
        let file = File::create(path).map_err(io)?;
        file.set_len(size_blocks * BLOCK_SIZE as u64).map_err(io)?;
        Ok(FileSink { file })
    }

    fn io(e: std::io::Error) -> BackupError {
        BackupError::Target {
            target: "restore file".into(),
            op: "write",
            key: String::new(),
            source: Box::new(e),
        }
    }
}

impl RestoreSink for FileSink {
    fn write(&mut self, lba: u64, data: &[u8]) -> Result<(), BackupError> {
        self.file
            .write_all_at(data, lba * BLOCK_SIZE as u64)
            .map_err(Self::io)
    }

    fn zero(&mut self, _lba: u64, _nblocks: u64) -> Result<(), BackupError> {
        // A new file reads as zeros.
        Ok(())
    }

    fn finish(&mut self) -> Result<(), BackupError> {
        self.file.sync_all().map_err(Self::io)
    }
}

/// Options of [`restore`].
#[derive(Debug)]
pub struct RestoreOptions {
    /// Chunk downloads in flight at once.
    pub concurrency: usize,
    /// Limit on the bytes fetched from the target per second.
    pub throttle_bytes_per_sec: Option<u64>,
    /// Where progress is published.
    pub progress: Option<watch::Sender<BackupProgress>>,
    /// Call [`RestoreSink::zero`] for holes (off when the sink is new and
    /// already reads as zeros).
    pub zero_holes: bool,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            concurrency: 8,
            throttle_bytes_per_sec: None,
            progress: None,
            zero_holes: false,
        }
    }
}

/// What a restore did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreReport {
    /// The manifest restored.
    pub manifest: Manifest,
    /// Chunks fetched and written.
    pub chunks: u64,
    /// Bytes fetched from the target.
    pub bytes_fetched: u64,
    /// Bytes written to the sink.
    pub bytes_written: u64,
    /// Wall time.
    pub duration: Duration,
}

/// Checks a fetched chunk against its manifest entry and decompresses it.
fn decode_chunk(key: &str, r: &ChunkRef, stored: &[u8]) -> Result<Vec<u8>, BackupError> {
    let corrupt = |reason: String| BackupError::CorruptChunk {
        index: r.index,
        key: key.to_string(),
        reason,
    };
    if stored.len() as u64 != r.stored_len {
        return Err(corrupt(format!(
            "{} bytes stored, manifest says {}",
            stored.len(),
            r.stored_len
        )));
    }
    let crc = crc32c::crc32c(stored);
    if crc != r.crc32c {
        return Err(corrupt(format!(
            "CRC-32C {crc:08x}, manifest says {:08x}",
            r.crc32c
        )));
    }
    let data =
        lz4_flex::decompress_size_prepended(stored).map_err(|e| corrupt(format!("lz4: {e}")))?;
    if data.len() != r.len as usize {
        return Err(corrupt(format!("{} bytes, expected {}", data.len(), r.len)));
    }
    if hex(&Sha256::digest(&data)) != r.sha256 {
        return Err(corrupt("SHA-256 does not match its name".into()));
    }
    Ok(data)
}

/// Restores backup `id` of `volume` from `target` alone into `sink`.
///
/// Every chunk is verified (stored length, CRC-32C, decompressed length and
/// SHA-256) before it is written; the first bad one stops the restore with
/// [`BackupError::CorruptChunk`] naming it. Chunks before it may already be
/// in the sink.
pub async fn restore(
    target: &Arc<dyn BackupTarget>,
    volume: &str,
    id: &str,
    sink: &mut dyn RestoreSink,
    opts: &RestoreOptions,
) -> Result<RestoreReport, BackupError> {
    let t0 = Instant::now();
    let manifest = load_manifest(&**target, volume, id).await?;
    let cb = u64::from(manifest.chunk_blocks);
    let mut progress = BackupProgress {
        chunks_total: manifest.chunk_count(),
        ..BackupProgress::default()
    };
    let mut report = RestoreReport {
        manifest: manifest.clone(),
        chunks: 0,
        bytes_fetched: 0,
        bytes_written: 0,
        duration: Duration::ZERO,
    };
    let mut throttle = Throttle::new(opts.throttle_bytes_per_sec);
    let concurrency = opts.concurrency.max(1);
    type Fetch = JoinHandle<Result<Bytes, BackupError>>;
    let mut window: VecDeque<(&ChunkRef, String, Fetch)> = VecDeque::new();
    let mut pending = manifest.chunks.iter();
    let spawn = |r: &ChunkRef| {
        let key = chunk_key(volume, &r.sha256);
        let t = Arc::clone(target);
        let k = key.clone();
        (key, tokio::spawn(async move { t.get(&k).await }))
    };
    // Next block not yet written or zeroed.
    let mut next_lba = 0u64;
    let result: Result<(), BackupError> = async {
        loop {
            while window.len() < concurrency {
                let Some(r) = pending.next() else { break };
                let (key, h) = spawn(r);
                window.push_back((r, key, h));
            }
            let Some((r, key, h)) = window.pop_front() else {
                break;
            };
            let stored = match h.await {
                Ok(Ok(b)) => b,
                Ok(Err(BackupError::NotFound { key })) => {
                    return Err(BackupError::CorruptChunk {
                        index: r.index,
                        key,
                        reason: "missing on the target".into(),
                    });
                }
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(join_err(&**target, "get", e)),
            };
            throttle.add(stored.len() as u64).await;
            report.bytes_fetched += stored.len() as u64;
            progress.bytes_read += stored.len() as u64;
            let data = decode_chunk(&key, r, &stored)?;
            let lba = r.index * cb;
            if opts.zero_holes && lba > next_lba {
                sink.zero(next_lba, lba - next_lba)?;
            }
            sink.write(lba, &data)?;
            next_lba = lba + (data.len() / BLOCK_SIZE) as u64;
            report.chunks += 1;
            report.bytes_written += data.len() as u64;
            progress.bytes_written += data.len() as u64;
            progress.chunks_done = r.index + 1;
            publish(&opts.progress, &progress);
        }
        if opts.zero_holes && manifest.size_blocks > next_lba {
            sink.zero(next_lba, manifest.size_blocks - next_lba)?;
        }
        sink.finish()
    }
    .await;
    if let Err(e) = result {
        for (_, _, h) in &window {
            h.abort();
        }
        warn!(volume, id, error = %e, "restore failed");
        return Err(e);
    }
    progress.chunks_done = progress.chunks_total;
    progress.done = true;
    publish(&opts.progress, &progress);
    report.duration = t0.elapsed();
    debug!(volume, id, chunks = report.chunks, "restore done");
    Ok(report)
}
