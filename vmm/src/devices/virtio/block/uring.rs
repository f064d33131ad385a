// SPDX-License-Identifier: Apache-2.0
//! An [`AsyncBlockBackend`] over a raw image file with io_uring.
//!
//! Reads and writes go straight between the file and the guest's buffers
//! (`readv`/`writev` on host addresses of guest memory, no copy). The file
//! is also opened with `O_DIRECT` when the file system allows it; an
//! operation uses the direct descriptor only when its offset and every
//! buffer address and length are [`DIRECT_ALIGN`]-aligned, else the
//! buffered one (Linux keeps the page cache coherent with direct I/O on
//! the same inode). Flush is an `fdatasync` marked `IOSQE_IO_DRAIN`, so it
//! starts only after every earlier submission completed. Discard and
//! write-zeroes are `fallocate` (punch hole / zero range; zero range falls
//! back to punch hole where the file system lacks it).
//!
//! The device's wake-up eventfd is registered with the ring, so the kernel
//! signals it on every completion and the device thread reaps without a
//! helper thread. A short transfer is resubmitted for the rest; no
//! progress is an I/O error, never a success. Guest memory stays mapped
//! (the request holds a [`GuestMemory`] clone) until every operation of the
//! request completed, and `drain`/`Drop` wait for every operation. The
//! kernel's writes into guest memory bypass vm-memory's dirty bitmap, so a
//! read marks its buffers dirty when it completes (live migration).

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Mutex;

use io_uring::{IoUring, opcode, squeue, types};
use virtio_bindings::virtio_blk::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};
use vmm_sys_util::eventfd::EventFd;

use super::backend::SECTOR_SIZE;
use super::request::{DiskInfo, Request, RequestType, read_ranges};
use super::seam::{AsyncBlockBackend, Completion};
use crate::memory::GuestMemory;

/// Alignment of offset, buffer address and length for `O_DIRECT` use.
pub const DIRECT_ALIGN: u64 = 4096;
/// Submission queue entries per ring.
pub const RING_ENTRIES: u32 = 256;
/// Most iovecs per operation (Linux `UIO_MAXIOV`).
const MAX_IOV: usize = 1024;

/// Why an io_uring backend could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum UringError {
    /// Opening the image failed.
    #[error("cannot open {path}")]
    Open {
        /// Image path.
        path: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The kernel refused `io_uring_setup` (old kernel, seccomp, sysctl).
    #[error("io_uring is not available")]
    Setup(#[source] io::Error),
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Read,
    Write,
    Fsync,
    Fallocate { mode: i32, off: u64, len: u64 },
}

/// iovecs pointing into guest memory that a [`Pending`] keeps mapped.
struct Iovecs(Vec<libc::iovec>);

// SAFETY: the iovecs are plain addresses into guest memory mappings that
// stay alive (the owning request holds a `GuestMemory` clone) for as long
// as this value; they are only dereferenced by the kernel.
unsafe impl Send for Iovecs {}

struct Op {
    token: u64,
    kind: Kind,
    iov: Iovecs,
    /// First iovec not yet fully transferred.
    first: usize,
    offset: u64,
    remaining: u64,
    /// May use the O_DIRECT descriptor.
    direct: bool,
}

struct Pending {
    status: u8,
    written: u32,
    ops_left: usize,
    mem: GuestMemory,
    /// Guest ranges the kernel writes (a read's buffers): the writes
    /// bypass vm-memory, so they are marked dirty once every operation
    /// completed ([`crate::memory::mark_dirty`]).
    device_writes: Vec<(u64, u32)>,
}

struct State {
    ring: IoUring,
    ops: HashMap<u64, Op>,
    pending: HashMap<u64, Pending>,
    backlog: VecDeque<squeue::Entry>,
    ready: Vec<Completion>,
    next_op: u64,
    waker: Option<EventFd>,
}

/// io_uring over a raw image file.
pub struct IoUringBackend {
    file: File,
    direct: Option<File>,
    size: u64,
    read_only: bool,
    id: String,
    state: Mutex<State>,
}

impl std::fmt::Debug for IoUringBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoUringBackend")
            .field("id", &self.id)
            .field("direct", &self.direct.is_some())
            .finish_non_exhaustive()
    }
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

impl IoUringBackend {
    /// Opens `path` (also with `O_DIRECT` when `try_direct` and the file
    /// system allows it) and sets up a ring; `id` defaults to the file name.
    pub fn open(
        path: &Path,
        read_only: bool,
        id: Option<String>,
        try_direct: bool,
    ) -> Result<Self, UringError> {
        let ring = IoUring::builder()
            .build(RING_ENTRIES)
            .map_err(UringError::Setup)?;
        let open_err = |source| UringError::Open {
            path: path.display().to_string(),
            source,
        };
        let mut opts = OpenOptions::new();
        opts.read(true).write(!read_only);
        let file = opts.open(path).map_err(open_err)?;
        let size = super::backend::file_size(&file).map_err(open_err)?;
        let direct = if try_direct {
            match opts.clone().custom_flags(libc::O_DIRECT).open(path) {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::info!(path = %path.display(), error = %e, "O_DIRECT not available, buffered I/O only");
                    None
                }
            }
        } else {
            None
        };
        let id = id.unwrap_or_else(|| {
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
        Ok(IoUringBackend {
            file,
            direct,
            size,
            read_only,
            id,
            state: Mutex::new(State {
                ring,
                ops: HashMap::new(),
                pending: HashMap::new(),
                backlog: VecDeque::new(),
                ready: Vec::new(),
                next_op: 0,
                waker: None,
            }),
        })
    }

    /// Whether an `O_DIRECT` descriptor is open.
    pub fn uses_direct(&self) -> bool {
        self.direct.is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn entry(&self, op: &Op) -> squeue::Entry {
        let fd = |direct: bool| -> RawFd {
            match (&self.direct, direct) {
                (Some(d), true) => d.as_raw_fd(),
                _ => self.file.as_raw_fd(),
            }
        };
        let iov = &op.iov.0[op.first..];
        match op.kind {
            Kind::Read => opcode::Readv::new(
                types::Fd(fd(op.direct && aligned(op.offset, iov))),
                iov.as_ptr(),
                iov.len() as u32,
            )
            .offset(op.offset)
            .build(),
            Kind::Write => opcode::Writev::new(
                types::Fd(fd(op.direct && aligned(op.offset, iov))),
                iov.as_ptr(),
                iov.len() as u32,
            )
            .offset(op.offset)
            .build(),
            Kind::Fsync => opcode::Fsync::new(types::Fd(fd(false)))
                .flags(types::FsyncFlags::DATASYNC)
                .build()
                .flags(squeue::Flags::IO_DRAIN),
            Kind::Fallocate { mode, off, len } => opcode::Fallocate::new(types::Fd(fd(false)), len)
                .offset(off)
                .mode(mode)
                .build(),
        }
    }

    /// Queues `op` for submission.
    fn start(&self, s: &mut State, op: Op) {
        let id = s.next_op;
        s.next_op = s.next_op.wrapping_add(1);
        let e = self.entry(&op).user_data(id);
        s.ops.insert(id, op);
        s.backlog.push_back(e);
    }

    /// Pushes queued entries into the ring and submits them.
    fn flush(s: &mut State) {
        while let Some(e) = s.backlog.front() {
            // SAFETY: every entry points at iovecs owned by an `Op` in
            // `s.ops` and at guest memory kept mapped by its `Pending`, and
            // at file descriptors owned by the backend; all outlive the
            // operation (drain/Drop wait for every completion).
            let pushed = unsafe { s.ring.submission().push(e) }.is_ok();
            if !pushed {
                if let Err(e) = s.ring.submit() {
                    tracing::debug!(error = %e, "io_uring submit with a full queue");
                }
                // SAFETY: as above.
                if unsafe { s.ring.submission().push(e) }.is_err() {
                    break;
                }
            }
            s.backlog.pop_front();
        }
        if let Err(e) = s.ring.submit()
            && e.raw_os_error() != Some(libc::EINTR)
        {
            tracing::warn!(error = %e, "io_uring submit failed");
        }
    }

    /// Handles every posted completion; returns how many.
    fn complete(&self, s: &mut State) -> usize {
        let cqes: Vec<(u64, i32)> = s
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for &(id, res) in &cqes {
            let Some(mut op) = s.ops.remove(&id) else {
                tracing::warn!(id, "io_uring completion for no operation");
                continue;
            };
            let outcome = match self.advance(&mut op, res) {
                Step::Resubmit => {
                    self.start(s, op);
                    continue;
                }
                Step::Done(r) => r,
            };
            let token = op.token;
            drop(op);
            self.finish_op(s, token, outcome);
        }
        cqes.len()
    }

    fn finish_op(&self, s: &mut State, token: u64, outcome: Result<(), u8>) {
        let Some(p) = s.pending.get_mut(&token) else {
            return;
        };
        if let Err(status) = outcome
            && p.status == VIRTIO_BLK_S_OK as u8
        {
            p.status = status;
        }
        p.ops_left -= 1;
        if p.ops_left == 0
            && let Some(p) = s.pending.remove(&token)
        {
            // Even a failed read may have written part of its buffers.
            for &(addr, len) in &p.device_writes {
                crate::memory::mark_dirty(&p.mem, GuestAddress(addr), len as usize);
            }
            let written = if p.status == VIRTIO_BLK_S_OK as u8 {
                p.written
            } else {
                0
            };
            s.ready.push(Completion {
                token,
                status: p.status,
                written,
            });
        }
    }

    /// Accounts `res` to `op`: resubmit the rest, or done with a status.
    fn advance(&self, op: &mut Op, res: i32) -> Step {
        let ioerr = Err(VIRTIO_BLK_S_IOERR as u8);
        if res < 0 {
            let e = -res;
            match (e, op.kind) {
                (libc::EINTR | libc::EAGAIN, _) => return Step::Resubmit,
                (libc::EINVAL, Kind::Read | Kind::Write) if op.direct => {
                    // The file system wants more alignment than assumed.
                    op.direct = false;
                    return Step::Resubmit;
                }
                (libc::EOPNOTSUPP, Kind::Fallocate { mode, off, len })
                    if mode & libc::FALLOC_FL_ZERO_RANGE != 0 =>
                {
                    op.kind = Kind::Fallocate {
                        mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        off,
                        len,
                    };
                    return Step::Resubmit;
                }
                (libc::EOPNOTSUPP, Kind::Fallocate { .. }) => {
                    return Step::Done(Err(VIRTIO_BLK_S_UNSUPP as u8));
                }
                _ => {
                    tracing::debug!(error = %errno(e), kind = ?op.kind, "io_uring operation failed");
                    return Step::Done(ioerr);
                }
            }
        }
        if !matches!(op.kind, Kind::Read | Kind::Write) {
            return Step::Done(Ok(()));
        }
        let mut n = res as u64;
        if n == 0 && op.remaining > 0 {
            tracing::debug!(offset = op.offset, "io_uring transfer made no progress");
            return Step::Done(ioerr);
        }
        if n > op.remaining {
            return Step::Done(ioerr);
        }
        op.remaining -= n;
        op.offset += n;
        if op.remaining == 0 {
            return Step::Done(Ok(()));
        }
        // Short transfer: skip what was done and go again.
        while n > 0 {
            let v = &mut op.iov.0[op.first];
            let take = n.min(v.iov_len as u64);
            // Moving within the same guest buffer.
            v.iov_base = (v.iov_base as usize + take as usize) as *mut libc::c_void;
            v.iov_len -= take as usize;
            n -= take;
            if v.iov_len == 0 {
                op.first += 1;
            }
        }
        Step::Resubmit
    }

    /// Builds the data operations of a read or write.
    fn rw_ops(&self, token: u64, req: &Request, mem: &GuestMemory) -> Result<Vec<Op>, u8> {
        let kind = if req.ty == RequestType::In {
            Kind::Read
        } else {
            Kind::Write
        };
        let mut ops = Vec::new();
        let mut iov: Vec<libc::iovec> = Vec::new();
        let mut offset = req.sector.wrapping_mul(SECTOR_SIZE);
        let mut start = offset;
        for seg in &req.data {
            for slice in mem.get_slices(GuestAddress(seg.addr), seg.len as usize) {
                let slice = slice.map_err(|_| VIRTIO_BLK_S_IOERR as u8)?;
                if iov.len() == MAX_IOV {
                    ops.push(self.rw_op(token, kind, std::mem::take(&mut iov), start));
                    start = offset;
                }
                iov.push(libc::iovec {
                    iov_base: slice.ptr_guard_mut().as_ptr().cast(),
                    iov_len: slice.len(),
                });
                offset += slice.len() as u64;
            }
        }
        if !iov.is_empty() {
            ops.push(self.rw_op(token, kind, iov, start));
        }
        Ok(ops)
    }

    fn rw_op(&self, token: u64, kind: Kind, iov: Vec<libc::iovec>, offset: u64) -> Op {
        let remaining = iov.iter().map(|v| v.iov_len as u64).sum();
        Op {
            token,
            kind,
            iov: Iovecs(iov),
            first: 0,
            offset,
            remaining,
            direct: self.direct.is_some(),
        }
    }

    fn plain_op(token: u64, kind: Kind) -> Op {
        Op {
            token,
            kind,
            iov: Iovecs(Vec::new()),
            first: 0,
            offset: 0,
            remaining: 0,
            direct: false,
        }
    }

    /// The fallocate operations of a discard or write-zeroes.
    fn range_ops(
        token: u64,
        req: &Request,
        mem: &GuestMemory,
        disk: &DiskInfo,
    ) -> Result<Vec<Op>, u8> {
        let ioerr = VIRTIO_BLK_S_IOERR as u8;
        let mut ops = Vec::new();
        for r in read_ranges(req, mem, disk).map_err(|_| ioerr)? {
            let mode = if req.ty == RequestType::Discard || r.unmap {
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
            } else {
                libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
            };
            ops.push(Self::plain_op(
                token,
                Kind::Fallocate {
                    mode,
                    off: r.offset,
                    len: r.len,
                },
            ));
        }
        Ok(ops)
    }

    fn get_id(&self, req: &Request, mem: &GuestMemory) -> Result<u32, u8> {
        let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        let n = self.id.len().min(id.len());
        id[..n].copy_from_slice(&self.id.as_bytes()[..n]);
        let mut left: &[u8] = &id;
        let mut written = 0;
        for seg in &req.data {
            let n = left.len().min(seg.len as usize);
            mem.write_slice(&left[..n], GuestAddress(seg.addr))
                .map_err(|_| VIRTIO_BLK_S_IOERR as u8)?;
            left = &left[n..];
            written += n as u32;
        }
        Ok(written)
    }
}

enum Step {
    Resubmit,
    Done(Result<(), u8>),
}

fn aligned(offset: u64, iov: &[libc::iovec]) -> bool {
    offset.is_multiple_of(DIRECT_ALIGN)
        && iov.iter().all(|v| {
            (v.iov_base as u64).is_multiple_of(DIRECT_ALIGN)
                && (v.iov_len as u64).is_multiple_of(DIRECT_ALIGN)
        })
}

impl AsyncBlockBackend for IoUringBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn device_id(&self) -> String {
        self.id.clone()
    }
    fn supports_discard(&self) -> bool {
        !self.read_only
    }
    fn supports_write_zeroes(&self) -> bool {
        !self.read_only
    }

    fn set_waker(&self, waker: EventFd) {
        let mut s = self.lock();
        let sub = s.ring.submitter();
        if s.waker.is_some()
            && let Err(e) = sub.unregister_eventfd()
        {
            tracing::warn!(error = %e, "io_uring unregister_eventfd failed");
        }
        match sub.register_eventfd(waker.as_raw_fd()) {
            Ok(()) => s.waker = Some(waker),
            Err(e) => tracing::warn!(error = %e, "io_uring register_eventfd failed"),
        }
    }

    fn submit(&self, token: u64, req: Request, mem: &GuestMemory, disk: DiskInfo) {
        let mut s = self.lock();
        let ops = match req.ty {
            RequestType::In | RequestType::Out => self.rw_ops(token, &req, mem),
            RequestType::Flush => Ok(vec![Self::plain_op(token, Kind::Fsync)]),
            RequestType::Discard | RequestType::WriteZeroes => {
                Self::range_ops(token, &req, mem, &disk)
            }
            RequestType::GetId => {
                let (status, written) = match self.get_id(&req, mem) {
                    Ok(w) => (VIRTIO_BLK_S_OK as u8, w),
                    Err(st) => (st, 0),
                };
                s.ready.push(Completion {
                    token,
                    status,
                    written,
                });
                return;
            }
            RequestType::Unsupported(_) => Err(VIRTIO_BLK_S_UNSUPP as u8),
        };
        let ops = match ops {
            Ok(ops) if !ops.is_empty() => ops,
            Ok(_) => {
                // A zero-length read or write: nothing to transfer.
                s.ready.push(Completion {
                    token,
                    status: VIRTIO_BLK_S_OK as u8,
                    written: 0,
                });
                return;
            }
            Err(status) => {
                s.ready.push(Completion {
                    token,
                    status,
                    written: 0,
                });
                return;
            }
        };
        let written = if req.ty == RequestType::In {
            req.data_len as u32
        } else {
            0
        };
        s.pending.insert(
            token,
            Pending {
                status: VIRTIO_BLK_S_OK as u8,
                written,
                ops_left: ops.len(),
                mem: mem.clone(),
                device_writes: if req.ty == RequestType::In {
                    req.data.iter().map(|s| (s.addr, s.len)).collect()
                } else {
                    Vec::new()
                },
            },
        );
        for op in ops {
            self.start(&mut s, op);
        }
        Self::flush(&mut s);
    }

    fn reap(&self, out: &mut Vec<Completion>) {
        let mut s = self.lock();
        if self.complete(&mut s) > 0 || !s.backlog.is_empty() {
            Self::flush(&mut s);
        }
        out.append(&mut s.ready);
    }

    fn drain(&self, out: &mut Vec<Completion>) {
        let mut s = self.lock();
        loop {
            self.complete(&mut s);
            if s.ops.is_empty() {
                break;
            }
            Self::flush(&mut s);
            if let Err(e) = s.ring.submit_and_wait(1)
                && e.raw_os_error() != Some(libc::EINTR)
            {
                tracing::warn!(error = %e, "io_uring wait failed while draining");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        out.append(&mut s.ready);
    }
}

impl Drop for IoUringBackend {
    fn drop(&mut self) {
        // The kernel may still be writing guest memory: wait for it before
        // the mappings and iovecs go away.
        let mut done = Vec::new();
        self.drain(&mut done);
    }
}
