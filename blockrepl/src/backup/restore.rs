// SPDX-License-Identifier: Apache-2.0
//! Restore: fetch, verify and write a backup's chunks into a sink.

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::catalog::load_manifest;
use super::engine::{BackupProgress, Throttle, hex, join_err, publish};
use super::{BackupError, BackupTarget, ChunkRef, Manifest, chunk_key};
use crate::store::Store;
use crate::types::{BLOCK_SIZE, Tag};

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
    // A fetch returns the stored length and the verified data; chunks are
    // fetched and verified in parallel, written in order.
    type Fetch = JoinHandle<Result<(u64, Vec<u8>), BackupError>>;
    let mut window: VecDeque<(&ChunkRef, Fetch)> = VecDeque::new();
    let mut pending = manifest.chunks.iter();
    let spawn = |r: &ChunkRef| {
        let key = chunk_key(volume, &r.sha256);
        let t = Arc::clone(target);
        let r = r.clone();
        tokio::spawn(async move {
            let stored = match t.get(&key).await {
                Ok(b) => b,
                Err(BackupError::NotFound { key }) => {
                    return Err(BackupError::CorruptChunk {
                        index: r.index,
                        key,
                        reason: "missing on the target".into(),
                    });
                }
                Err(e) => return Err(e),
            };
            let desc = t.describe();
            tokio::task::spawn_blocking(move || {
                decode_chunk(&key, &r, &stored).map(|d| (stored.len() as u64, d))
            })
            .await
            .map_err(|e| BackupError::Target {
                target: desc,
                op: "verify",
                key: String::new(),
                source: Box::new(e),
            })?
        })
    };
    // Next block not yet written or zeroed.
    let mut next_lba = 0u64;
    let result: Result<(), BackupError> = async {
        loop {
            while window.len() < concurrency {
                let Some(r) = pending.next() else { break };
                let h = spawn(r);
                window.push_back((r, h));
            }
            let Some((r, h)) = window.pop_front() else {
                break;
            };
            let (stored_len, data) = match h.await {
                Ok(res) => res?,
                Err(e) => return Err(join_err(&**target, "get", e)),
            };
            throttle.add(stored_len).await;
            report.bytes_fetched += stored_len;
            progress.bytes_read += stored_len;
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
        for (_, h) in &window {
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
