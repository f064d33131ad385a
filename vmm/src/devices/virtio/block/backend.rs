// SPDX-License-Identifier: Apache-2.0
//! The storage port of virtio-blk: [`BlockBackend`], plus a file backend and
//! an in-memory reference backend.
//!
//! ```text
//!  guest ── virtqueue ──► VirtioBlock (parses, validates, bounds) ──► dyn BlockBackend
//!                                                                    ├─ FileBackend (built in)
//!                                                                    ├─ MemBackend  (tests, docs)
//!                                                                    └─ sheaf-blockrepl volume (adapter in blockrepl)
//! ```

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::RwLock;

/// Sector size of the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;

/// A block device as virtio-blk consumes it.
///
/// # Contract
///
/// - **Ranges.** The device validates every request before calling the
///   backend: `offset` and `buf.len()` (or `len`) are multiples of
///   [`SECTOR_SIZE`] and `offset + len <= size()`. Backends may still check.
/// - **Completion.** Calls are synchronous and return when the operation is
///   complete: `read_at` fills all of `buf`, `write_at` wrote all of `buf`.
///   A write is not necessarily durable until a later `flush` returns `Ok`.
/// - **Threads.** Calls come from the VM's device thread (one at a time per
///   device today), but the backend must be `Send + Sync`: it may be shared
///   with other threads (a control plane reading stats, a second VM for
///   migration). A call may block; while it does, that VM's I/O waits.
///   There is no "try again later": retry internally or fail.
/// - **Errors.** Return `io::ErrorKind::Unsupported` for an operation the
///   backend does not implement; the guest sees `VIRTIO_BLK_S_UNSUPP`. Any
///   other error is reported to the guest as `VIRTIO_BLK_S_IOERR`; the VM
///   keeps running.
/// - **Optional operations** (`discard`, `write_zeroes`) default to
///   `Unsupported`; a backend implementing them also returns `true` from
///   the matching `supports_*` method so the feature is offered to the guest.
pub trait BlockBackend: Send + Sync {
    /// Size in bytes (rounded down to whole sectors by the device).
    fn size(&self) -> u64;
    /// Whether the device is read-only (`VIRTIO_BLK_F_RO`).
    fn read_only(&self) -> bool {
        false
    }
    /// Serial/id string returned by `VIRTIO_BLK_T_GET_ID` (at most 20 bytes are used).
    fn device_id(&self) -> String;
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Writes all of `buf` at `offset`.
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Whether [`BlockBackend::discard`] is implemented.
    fn supports_discard(&self) -> bool {
        false
    }
    /// Deallocates `[offset, offset + len)`; later reads return zeroes or old data.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        let _ = (offset, len);
        Err(io::ErrorKind::Unsupported.into())
    }
    /// Whether [`BlockBackend::write_zeroes`] is implemented.
    fn supports_write_zeroes(&self) -> bool {
        false
    }
    /// Makes `[offset, offset + len)` read as zeroes; may deallocate if `may_unmap`.
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()> {
        let _ = (offset, len, may_unmap);
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// A raw image file or host block device.
#[derive(Debug)]
pub struct FileBackend {
    file: File,
    size: u64,
    read_only: bool,
    id: String,
}

/// Size of a regular file or a block device (whose metadata length is 0).
pub(crate) fn file_size(file: &File) -> io::Result<u64> {
    use std::io::Seek;
    let mut f = file;
    f.seek(io::SeekFrom::End(0))
}

impl FileBackend {
    /// Opens `path`; `id` defaults to the file name.
    pub fn open(path: &Path, read_only: bool, id: Option<String>) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(!read_only).open(path)?;
        let size = file_size(&file)?;
        let id = id.unwrap_or_else(|| {
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
        Ok(FileBackend {
            file,
            size,
            read_only,
            id,
        })
    }

    fn fallocate(&self, mode: i32, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: fallocate on a file descriptor we own, with plain integer
        // arguments; the return value is checked.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                mode,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

impl BlockBackend for FileBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn device_id(&self) -> String {
        self.id.clone()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }
    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn supports_discard(&self) -> bool {
        !self.read_only
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        )
    }
    fn supports_write_zeroes(&self) -> bool {
        !self.read_only
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()> {
        let mode = if may_unmap {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        match self.fallocate(mode, offset, len) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                let zeros = vec![0u8; 64 * 1024];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(zeros.len() as u64) as usize;
                    self.file.write_all_at(&zeros[..n], offset + done)?;
                    done += n as u64;
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

/// An in-memory disk: the reference implementation of [`BlockBackend`].
#[derive(Debug)]
pub struct MemBackend {
    data: RwLock<Vec<u8>>,
    id: String,
    read_only: bool,
    flushes: std::sync::atomic::AtomicU64,
}

impl MemBackend {
    /// A zero-filled disk of `size` bytes.
    pub fn new(size: u64, id: &str) -> Self {
        Self::from_bytes(vec![0; size as usize], id)
    }

    /// A disk holding `data`.
    pub fn from_bytes(data: Vec<u8>, id: &str) -> Self {
        MemBackend {
            data: RwLock::new(data),
            id: id.to_string(),
            read_only: false,
            flushes: Default::default(),
        }
    }

    /// Marks the disk read-only.
    pub fn read_only(mut self) -> Self {
        self.read_only = true;
        self
    }

    /// A copy of the contents.
    pub fn contents(&self) -> Vec<u8> {
        self.data.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many flushes completed.
    pub fn flush_count(&self) -> u64 {
        self.flushes.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn range(&self, offset: u64, len: usize) -> io::Result<std::ops::Range<usize>> {
        let size = self.size();
        let end = offset
            .checked_add(len as u64)
            .filter(|&e| e <= size)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "out of range"))?;
        Ok(offset as usize..end as usize)
    }
}

impl BlockBackend for MemBackend {
    fn size(&self) -> u64 {
        self.data.read().unwrap_or_else(|p| p.into_inner()).len() as u64
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn device_id(&self) -> String {
        self.id.clone()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let r = self.range(offset, buf.len())?;
        buf.copy_from_slice(&self.data.read().unwrap_or_else(|p| p.into_inner())[r]);
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let r = self.range(offset, buf.len())?;
        self.data.write().unwrap_or_else(|p| p.into_inner())[r].copy_from_slice(buf);
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.flushes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
    fn supports_discard(&self) -> bool {
        true
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(offset, len, true)
    }
    fn supports_write_zeroes(&self) -> bool {
        true
    }
    fn write_zeroes(&self, offset: u64, len: u64, _may_unmap: bool) -> io::Result<()> {
        let r = self.range(offset, len as usize)?;
        self.data.write().unwrap_or_else(|p| p.into_inner())[r].fill(0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exercise(b: &dyn BlockBackend) {
        b.write_at(512, &[7u8; 1024]).unwrap();
        let mut buf = [0u8; 1024];
        b.read_at(512, &mut buf).unwrap();
        assert_eq!(buf, [7u8; 1024]);
        b.flush().unwrap();
        b.write_zeroes(1024, 512, false).unwrap();
        b.read_at(512, &mut buf).unwrap();
        assert_eq!(&buf[..512], &[7u8; 512]);
        assert_eq!(&buf[512..], &[0u8; 512]);
        b.discard(512, 512).unwrap();
        b.read_at(512, &mut buf[..512]).unwrap();
        assert_eq!(&buf[..512], &[0u8; 512]);
    }

    #[test]
    fn file_and_mem_backends_behave_alike() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(1 << 20).unwrap();
        let fb = FileBackend::open(f.path(), false, Some("disk0".into())).unwrap();
        assert_eq!(fb.size(), 1 << 20);
        assert_eq!(fb.device_id(), "disk0");
        exercise(&fb);
        let mb = MemBackend::new(1 << 20, "m");
        exercise(&mb);
        assert_eq!(mb.flush_count(), 1);
        assert!(mb.read_at((1 << 20) - 512, &mut [0u8; 1024]).is_err());
    }

    struct Minimal;
    impl BlockBackend for Minimal {
        fn size(&self) -> u64 {
            0
        }
        fn device_id(&self) -> String {
            String::new()
        }
        fn read_at(&self, _: u64, _: &mut [u8]) -> io::Result<()> {
            Ok(())
        }
        fn write_at(&self, _: u64, _: &[u8]) -> io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn optional_operations_default_to_unsupported() {
        let b: Box<dyn BlockBackend> = Box::new(Minimal);
        assert!(!b.supports_discard());
        assert_eq!(
            b.discard(0, 512).unwrap_err().kind(),
            io::ErrorKind::Unsupported
        );
        assert_eq!(
            b.write_zeroes(0, 512, true).unwrap_err().kind(),
            io::ErrorKind::Unsupported
        );
    }
}
