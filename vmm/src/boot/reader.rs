// SPDX-License-Identifier: Apache-2.0
//! Synchronous, positional reads from an [`AsyncBlockBackend`], for the
//! VMM's own use before the guest runs (disk boot).
//!
//! Reads go through the backend's ordinary `submit`/`reap` path with a
//! private bounce buffer standing in for guest memory, so a replicated
//! volume, an io_uring file or an embedder's backend are read exactly as the
//! guest will later read them. Requests are whole sectors; the last chunk
//! read is cached, so the many small reads of a partition-table or ext4
//! parser cost one request per chunk.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::virtio::block::request::{DiskInfo, Request, RequestType, Segment};
use crate::devices::virtio::block::{AsyncBlockBackend, Completion};
use crate::memory::GuestMemory;

/// Bytes fetched per request.
const CHUNK: u64 = 1 << 20;
/// Sector size of block requests.
const SECTOR: u64 = 512;
/// How long one request may take before the read fails.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Reads a block backend at byte offsets.
pub struct BackendReader {
    backend: Arc<dyn AsyncBlockBackend>,
    bounce: GuestMemory,
    waker: EventFd,
    size: u64,
    next_token: u64,
    /// Offset and bytes of the last chunk read.
    cache: Option<(u64, Vec<u8>)>,
    done: Vec<Completion>,
    /// Bytes fetched from the backend so far.
    fetched: u64,
}

impl std::fmt::Debug for BackendReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendReader")
            .field("size", &self.size)
            .field("fetched", &self.fetched)
            .finish_non_exhaustive()
    }
}

impl BackendReader {
    /// Prepares to read `backend`. Sets the backend's waker to a private
    /// eventfd: the virtio-blk device installs its own when the guest
    /// activates it.
    pub fn new(backend: Arc<dyn AsyncBlockBackend>) -> io::Result<Self> {
        let bounce = GuestMemory::from_ranges(&[(GuestAddress(0), CHUNK as usize)])
            .map_err(io::Error::other)?;
        let waker = EventFd::new(libc::EFD_NONBLOCK)?;
        backend.set_waker(waker.try_clone()?);
        let size = backend.size() / SECTOR * SECTOR;
        Ok(BackendReader {
            backend,
            bounce,
            waker,
            size,
            next_token: 0,
            cache: None,
            done: Vec::new(),
            fetched: 0,
        })
    }

    /// Readable size in bytes (whole sectors).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes fetched from the backend so far (for tests and logs).
    pub fn fetched(&self) -> u64 {
        self.fetched
    }

    /// Fills `dst` from byte `offset`; an error if any of it lies past the end.
    pub fn read_at(&mut self, mut offset: u64, mut dst: &mut [u8]) -> io::Result<()> {
        let end = offset
            .checked_add(dst.len() as u64)
            .filter(|&e| e <= self.size)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "read of {} bytes at {offset} is past the end of the {}-byte disk",
                        dst.len(),
                        self.size
                    ),
                )
            })?;
        while offset < end {
            let chunk_start = offset / CHUNK * CHUNK;
            let cached = matches!(&self.cache, Some((s, _)) if *s == chunk_start);
            if !cached {
                let len = CHUNK.min(self.size - chunk_start);
                let data = self.fetch(chunk_start, len)?;
                self.cache = Some((chunk_start, data));
            }
            let Some((_, data)) = &self.cache else {
                return Err(io::Error::other("disk read cache is empty"));
            };
            let from = (offset - chunk_start) as usize;
            let n = dst.len().min(data.len() - from);
            dst[..n].copy_from_slice(&data[from..from + n]);
            dst = &mut dst[n..];
            offset += n as u64;
        }
        Ok(())
    }

    /// One read request of `len` bytes (whole sectors) at `start`.
    fn fetch(&mut self, start: u64, len: u64) -> io::Result<Vec<u8>> {
        let token = self.next_token;
        self.next_token += 1;
        let req = Request {
            ty: RequestType::In,
            sector: start / SECTOR,
            data: vec![Segment {
                addr: 0,
                len: len as u32,
                writable: true,
            }],
            data_len: len,
        };
        let disk = DiskInfo {
            sectors: self.size / SECTOR,
            read_only: true,
            discard: false,
            write_zeroes: false,
        };
        self.backend.submit(token, req, &self.bounce, disk);
        let c = self.wait(token)?;
        if c.status != 0 {
            return Err(io::Error::other(format!(
                "the disk failed a read of {len} bytes at {start} (virtio-blk status {})",
                c.status
            )));
        }
        let mut data = vec![0u8; len as usize];
        self.bounce
            .read_slice(&mut data, GuestAddress(0))
            .map_err(io::Error::other)?;
        self.fetched += len;
        Ok(data)
    }

    fn wait(&mut self, token: u64) -> io::Result<Completion> {
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        loop {
            self.backend.reap(&mut self.done);
            if let Some(i) = self.done.iter().position(|c| c.token == token) {
                return Ok(self.done.swap_remove(i));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // Do not leave a request writing into the bounce buffer.
                self.backend.drain(&mut self.done);
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the disk did not answer a read within {REQUEST_TIMEOUT:?}"),
                ));
            }
            let mut pfd = libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&self.waker),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().min(100) as libc::c_int;
            // SAFETY: `pfd` is one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut pfd, 1, ms) };
            // Clear the counter; a spurious or missed wake-up only costs a
            // reap, the loop checks for the completion again.
            let _ = self.waker.read();
        }
    }
}

impl Drop for BackendReader {
    fn drop(&mut self) {
        // Nothing may still be writing into the bounce buffer.
        self.backend.drain(&mut self.done);
    }
}

/// A window of a [`BackendReader`] (a partition) for `ext4-view`.
#[derive(Debug)]
pub struct PartitionReader {
    disk: std::rc::Rc<std::cell::RefCell<BackendReader>>,
    start: u64,
    len: u64,
}

impl PartitionReader {
    /// Bytes `start..start + len` of `disk`.
    pub fn new(disk: std::rc::Rc<std::cell::RefCell<BackendReader>>, start: u64, len: u64) -> Self {
        PartitionReader { disk, start, len }
    }
}

impl ext4_view::Ext4Read for PartitionReader {
    fn read(
        &mut self,
        start_byte: u64,
        dst: &mut [u8],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync + 'static>> {
        let in_range = start_byte
            .checked_add(dst.len() as u64)
            .is_some_and(|e| e <= self.len);
        if !in_range {
            return Err(format!(
                "read of {} bytes at {start_byte} is past the end of the {}-byte partition",
                dst.len(),
                self.len
            )
            .into());
        }
        Ok(self
            .disk
            .borrow_mut()
            .read_at(self.start + start_byte, dst)?)
    }
}

/// `Read + Seek` over a [`BackendReader`], for the partition-table crates.
#[derive(Debug)]
pub struct SeekReader<'a> {
    disk: &'a mut BackendReader,
    pos: u64,
}

impl<'a> SeekReader<'a> {
    /// Starts at offset 0.
    pub fn new(disk: &'a mut BackendReader) -> Self {
        SeekReader { disk, pos: 0 }
    }
}

impl io::Read for SeekReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = (buf.len() as u64).min(self.disk.size().saturating_sub(self.pos)) as usize;
        self.disk.read_at(self.pos, &mut buf[..n])?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl io::Seek for SeekReader<'_> {
    fn seek(&mut self, pos: io::SeekFrom) -> io::Result<u64> {
        let size = self.disk.size();
        let new = match pos {
            io::SeekFrom::Start(p) => Some(p),
            io::SeekFrom::End(d) => size.checked_add_signed(d),
            io::SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        }
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "seek before the start"))?;
        self.pos = new;
        Ok(new)
    }
}
