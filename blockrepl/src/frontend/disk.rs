// SPDX-License-Identifier: Apache-2.0
//! [`Disk`]: a [`Volume`] with byte granularity, shared by every frontend.
//!
//! A volume reads and writes whole 4 KiB blocks. Clients do not always
//! (virtio-blk works in 512-byte sectors, NBD clients may use any offset),
//! so a write that does not cover whole blocks reads the partial edge
//! blocks, merges and writes whole blocks back (read-modify-write).
//!
//! Two concurrent writes touching the same block would lose one update if
//! both ran read-modify-write at once, and an aligned write racing a
//! read-modify-write of its block could be overwritten with stale bytes.
//! So every write takes a *range lock* on the blocks it covers; writes to
//! disjoint blocks run concurrently, overlapping writes run one after the
//! other. Reads take no lock: a read that races a write returns either
//! version of each block, which is what a disk does.

use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::types::BLOCK_SIZE_U64;
use crate::volume::Volume;

/// Largest single request accepted (64 MiB).
pub const MAX_REQUEST: u64 = 64 << 20;

/// A volume addressed in bytes. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Disk {
    vol: Volume,
    locks: Arc<RangeLock>,
}

impl Disk {
    /// Wraps an attached volume.
    pub fn new(vol: Volume) -> Disk {
        Disk {
            vol,
            locks: Arc::new(RangeLock::default()),
        }
    }

    /// The volume.
    pub fn volume(&self) -> &Volume {
        &self.vol
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.vol.size()
    }

    /// Checks that `[offset, offset + len)` lies inside the disk.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::OutOfRange { offset, len, size }),
        }
    }

    /// Like [`Disk::check_range`], and the length is at most [`MAX_REQUEST`]
    /// (reads and writes hold their data in memory).
    pub fn check_io(&self, offset: u64, len: u64) -> Result<()> {
        if len > MAX_REQUEST {
            return Err(Error::TooLarge {
                len,
                max: MAX_REQUEST,
            });
        }
        self.check_range(offset, len)
    }

    /// Reads `len` bytes at `offset`.
    pub async fn read(&self, offset: u64, len: usize) -> Result<Bytes> {
        self.check_io(offset, len as u64)?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        let (start, end) = cover(offset, len as u64);
        let data = self.vol.read(start, (end - start) as usize).await?;
        if start == offset && end - start == len as u64 {
            return Ok(data);
        }
        let at = (offset - start) as usize;
        Ok(data.slice(at..at + len))
    }

    /// Writes `data` at `offset`.
    pub async fn write(&self, offset: u64, data: Bytes) -> Result<()> {
        let len = data.len() as u64;
        self.check_io(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (start, end) = cover(offset, len);
        let _g = self.locks.lock(start, end).await;
        if start == offset && end == offset + len {
            return self.vol.write(offset, data).await;
        }
        let merged = self.merge(offset, &data, start, end).await?;
        self.vol.write(start, merged).await
    }

    /// Reads the partial edge blocks of `[start, end)` and overlays `data`
    /// at `offset`. Caller holds the range lock.
    async fn merge(&self, offset: u64, data: &[u8], start: u64, end: u64) -> Result<Bytes> {
        let mut buf = BytesMut::zeroed((end - start) as usize);
        let head_partial = offset != start;
        let tail_partial = offset + data.len() as u64 != end;
        let last = end - BLOCK_SIZE_U64;
        if head_partial || (tail_partial && last == start) {
            let b = self.vol.read(start, BLOCK_SIZE_U64 as usize).await?;
            buf[..b.len()].copy_from_slice(&b);
        }
        if tail_partial && last != start {
            let b = self.vol.read(last, BLOCK_SIZE_U64 as usize).await?;
            let at = (last - start) as usize;
            buf[at..at + b.len()].copy_from_slice(&b);
        }
        let at = (offset - start) as usize;
        buf[at..at + data.len()].copy_from_slice(data);
        Ok(buf.freeze())
    }

    /// Makes `[offset, offset + len)` read as zeros.
    pub async fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (start, end) = cover(offset, len);
        let _g = self.locks.lock(start, end).await;
        let (inner_start, inner_end) = inner(offset, len);
        if inner_start < inner_end {
            self.vol
                .write_zeroes(inner_start, inner_end - inner_start)
                .await?;
        }
        // Partial edge blocks: read-modify-write with zeros. Without a whole
        // block inside, the range is shorter than two blocks.
        let zero = vec![0u8; 2 * BLOCK_SIZE_U64 as usize];
        let mut edges = Vec::new();
        if inner_start >= inner_end {
            edges.push((offset, len));
        } else {
            if offset < inner_start {
                edges.push((offset, inner_start - offset));
            }
            if inner_end < offset + len {
                edges.push((inner_end, offset + len - inner_end));
            }
        }
        for (o, l) in edges {
            let (s, e) = cover(o, l);
            let merged = self.merge(o, &zero[..l as usize], s, e).await?;
            self.vol.write(s, merged).await?;
        }
        Ok(())
    }

    /// Discards the whole blocks inside `[offset, offset + len)`; partial
    /// blocks at the edges keep their data (a discard is a hint).
    pub async fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.check_range(offset, len)?;
        let (s, e) = inner(offset, len);
        if s >= e {
            return Ok(());
        }
        let _g = self.locks.lock(s, e).await;
        self.vol.trim(s, e - s).await
    }

    /// Makes every completed write durable.
    pub async fn flush(&self) -> Result<()> {
        self.vol.flush().await
    }
}

/// The block-aligned range covering `[offset, offset + len)`; `len > 0`.
fn cover(offset: u64, len: u64) -> (u64, u64) {
    let start = offset - offset % BLOCK_SIZE_U64;
    let end = (offset + len).div_ceil(BLOCK_SIZE_U64) * BLOCK_SIZE_U64;
    (start, end)
}

/// The whole blocks inside `[offset, offset + len)` (empty if start >= end).
fn inner(offset: u64, len: u64) -> (u64, u64) {
    let start = offset.div_ceil(BLOCK_SIZE_U64) * BLOCK_SIZE_U64;
    let end = (offset + len) / BLOCK_SIZE_U64 * BLOCK_SIZE_U64;
    (start, end)
}

/// Byte ranges currently being written; overlapping writers wait.
#[derive(Debug, Default)]
struct RangeLock {
    held: Mutex<Vec<(u64, u64)>>,
    released: Notify,
}

struct RangeGuard<'a> {
    lock: &'a RangeLock,
    range: (u64, u64),
}

impl RangeLock {
    async fn lock(&self, start: u64, end: u64) -> RangeGuard<'_> {
        loop {
            let notified = self.released.notified();
            tokio::pin!(notified);
            // Register for wake-ups before checking, so a release between
            // the check and the await is not missed.
            notified.as_mut().enable();
            {
                let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
                if !held.iter().any(|&(s, e)| s < end && start < e) {
                    held.push((start, end));
                    return RangeGuard {
                        lock: self,
                        range: (start, end),
                    };
                }
            }
            notified.await;
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut held = self.lock.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = held.iter().position(|r| *r == self.range) {
            held.swap_remove(i);
        }
        drop(held);
        self.lock.released.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::volume::{VolumeConfig, create_replica};

    #[test]
    fn cover_and_inner() {
        assert_eq!(cover(0, 4096), (0, 4096));
        assert_eq!(cover(512, 512), (0, 4096));
        assert_eq!(cover(4000, 200), (0, 8192));
        assert_eq!(inner(512, 8192), (4096, 8192));
        assert_eq!(inner(512, 512), (4096, 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unaligned_io_matches_a_byte_model() {
        let dir = tempfile::tempdir().unwrap();
        let size = 64 * 4096;
        create_replica(dir.path(), size).unwrap();
        let disk = Disk::new(
            Volume::attach(VolumeConfig::local(dir.path()))
                .await
                .unwrap(),
        );
        let mut model = vec![0u8; size as usize];
        let mut seed = 0x1234_5678_u64;
        let mut rnd = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for i in 0..300u32 {
            let off = rnd(size - 1);
            let len = 1 + rnd((size - off).min(3 * 4096));
            match i % 4 {
                0 | 1 => {
                    let v = (i % 251) as u8 + 1;
                    disk.write(off, Bytes::from(vec![v; len as usize]))
                        .await
                        .unwrap();
                    model[off as usize..(off + len) as usize].fill(v);
                }
                2 => {
                    disk.write_zeroes(off, len).await.unwrap();
                    model[off as usize..(off + len) as usize].fill(0);
                }
                _ => {
                    let got = disk.read(off, len as usize).await.unwrap();
                    assert_eq!(
                        &got[..],
                        &model[off as usize..(off + len) as usize],
                        "i={i}"
                    );
                }
            }
        }
        let all = disk.read(0, size as usize).await.unwrap();
        assert_eq!(&all[..], &model[..]);
        assert!(matches!(
            disk.read(size, 1).await,
            Err(Error::OutOfRange { .. })
        ));
        assert!(matches!(
            disk.write(u64::MAX, Bytes::from_static(b"x")).await,
            Err(Error::OutOfRange { .. })
        ));
    }

    /// Many concurrent sub-block writes to the same blocks: no update lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_partial_writes_lose_nothing() {
        let dir = tempfile::tempdir().unwrap();
        create_replica(dir.path(), 4 * 4096).unwrap();
        let disk = Disk::new(
            Volume::attach(VolumeConfig::local(dir.path()))
                .await
                .unwrap(),
        );
        let mut tasks = Vec::new();
        for i in 0..32u64 {
            let d = disk.clone();
            tasks.push(tokio::spawn(async move {
                d.write(i * 512, Bytes::from(vec![i as u8 + 1; 512])).await
            }));
        }
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        let all = disk.read(0, 4 * 4096).await.unwrap();
        for i in 0..32usize {
            assert!(
                all[i * 512..(i + 1) * 512]
                    .iter()
                    .all(|&b| b == i as u8 + 1),
                "sector {i}"
            );
        }
    }
}
