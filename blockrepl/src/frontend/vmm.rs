// SPDX-License-Identifier: Apache-2.0
//! A volume as a sheaf-vmm virtio-blk disk: [`VolumeBackend`] implements
//! [`sheaf_vmm::BlockBackend`] (feature `vmm`), and
//! [`AsyncVolumeBackend`] implements the VMM's asynchronous seam.
//!
//! [`VolumeBackend`] is called synchronously (the VMM runs it on its
//! thread pool); each call runs the async [`Disk`] operation on a tokio
//! runtime and waits for it. [`AsyncVolumeBackend`] instead spawns each
//! request onto the runtime and completes it through the device's waker. Sector-granular requests are served through the disk's
//! read-modify-write, so the guest sees a 512-byte-sector disk while the
//! volume stores 4 KiB blocks.
//!
//! ```no_run
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use sheaf_blockrepl::frontend::vmm::VolumeBackend;
//! use sheaf_blockrepl::volume::{VolumeConfig, create_replica};
//! create_replica("/tmp/vm-disk", 64 << 20)?;
//! let backend = VolumeBackend::attach(VolumeConfig::local("/tmp/vm-disk"), "disk0")?;
//! // sheaf_vmm::Vm::builder(cfg).disk_backend(Arc::new(backend)).create()?;
//! # let _ = Arc::new(backend);
//! # Ok(()) }
//! ```

use std::collections::BTreeSet;
use std::io;
use std::sync::{Arc, Condvar, Mutex};

use bytes::Bytes;
use sheaf_vmm::devices::virtio::block::request::{
    ByteRange, DiskInfo, Request, RequestType, Segment, read_ranges,
};
use sheaf_vmm::devices::virtio::block::{AsyncBlockBackend, Completion};
use sheaf_vmm::memory::GuestMemory;
use sheaf_vmm::{BlockBackend, SECTOR_SIZE};
use tokio::sync::Notify;
use virtio_bindings::virtio_blk::*;
use vm_memory::{Bytes as _, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::error::Error;
use crate::frontend::disk::Disk;
use crate::volume::{Volume, VolumeConfig};

/// A blockrepl volume serving a sheaf-vmm virtio-blk device.
#[derive(Debug)]
pub struct VolumeBackend {
    disk: Disk,
    rt: tokio::runtime::Handle,
    _owned: Option<Arc<tokio::runtime::Runtime>>,
    id: String,
    read_only: bool,
}

impl VolumeBackend {
    /// Attaches the volume on a private runtime (one worker thread).
    pub fn attach(cfg: VolumeConfig, id: &str) -> crate::Result<VolumeBackend> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("sheaf-vmm-volume")
            .enable_all()
            .build()
            .map_err(|source| Error::Net {
                op: "start runtime",
                source,
            })?;
        let vol = rt.block_on(Volume::attach(cfg))?;
        Ok(VolumeBackend {
            disk: Disk::new(vol),
            rt: rt.handle().clone(),
            _owned: Some(Arc::new(rt)),
            id: id.to_string(),
            read_only: false,
        })
    }

    /// Serves an attached disk; operations run on `rt`, which the caller
    /// keeps running. The VMM must not call in from one of `rt`'s threads.
    pub fn new(disk: Disk, rt: tokio::runtime::Handle, id: &str) -> VolumeBackend {
        VolumeBackend {
            disk,
            rt,
            _owned: None,
            id: id.to_string(),
            read_only: false,
        }
    }

    /// Offers the disk read-only to the guest.
    pub fn with_read_only(mut self, ro: bool) -> Self {
        self.read_only = ro;
        self
    }

    /// The disk.
    pub fn disk(&self) -> &Disk {
        &self.disk
    }

    fn ro_check(&self) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "read-only disk",
            ));
        }
        Ok(())
    }
}

/// Maps a volume error to the `io::Error` the VMM reports to the guest.
fn to_io(e: Error) -> io::Error {
    let kind = match &e {
        Error::Unaligned { .. } | Error::OutOfRange { .. } | Error::TooLarge { .. } => {
            io::ErrorKind::InvalidInput
        }
        Error::InvalidArgument(_) => io::ErrorKind::InvalidInput,
        Error::Fenced { .. } => io::ErrorKind::PermissionDenied,
        Error::Detached => io::ErrorKind::NotConnected,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

impl BlockBackend for VolumeBackend {
    fn size(&self) -> u64 {
        self.disk.size()
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn device_id(&self) -> String {
        self.id.clone()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let data = self
            .rt
            .block_on(self.disk.read(offset, buf.len()))
            .map_err(to_io)?;
        buf.copy_from_slice(&data);
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.ro_check()?;
        self.rt
            .block_on(self.disk.write(offset, Bytes::copy_from_slice(buf)))
            .map_err(to_io)
    }
    fn flush(&self) -> io::Result<()> {
        self.rt.block_on(self.disk.flush()).map_err(to_io)
    }
    fn supports_discard(&self) -> bool {
        !self.read_only
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.ro_check()?;
        self.rt.block_on(self.disk.trim(offset, len)).map_err(to_io)
    }
    fn supports_write_zeroes(&self) -> bool {
        !self.read_only
    }
    fn write_zeroes(&self, offset: u64, len: u64, _may_unmap: bool) -> io::Result<()> {
        self.ro_check()?;
        self.rt
            .block_on(self.disk.write_zeroes(offset, len))
            .map_err(to_io)
    }
}

/// Bytes per volume call when moving a large request.
const CHUNK: usize = 1 << 20;

#[derive(Default)]
struct AsyncShared {
    done: Vec<Completion>,
    in_flight: usize,
    /// Submission numbers of reads and writes not yet completed.
    outstanding: BTreeSet<u64>,
    waker: Option<EventFd>,
}

/// A volume as an asynchronous virtio-blk backend: every request runs as a
/// task on the engine's tokio runtime, so the VMM's device thread never
/// waits for the network or the replicas. A task reports its completion
/// and wakes the device through the waker eventfd.
///
/// A flush waits (on the runtime, not the device thread) for every read and
/// write submitted before it, then flushes the volume. `drain` blocks its
/// caller until every task finished; call it from outside the runtime
/// (the VMM calls it from the device thread on reset).
pub struct AsyncVolumeBackend {
    disk: Disk,
    rt: tokio::runtime::Handle,
    _owned: Option<Arc<tokio::runtime::Runtime>>,
    id: String,
    read_only: bool,
    shared: Arc<(Mutex<AsyncShared>, Condvar)>,
    notify: Arc<Notify>,
    next_seq: Mutex<u64>,
}

impl std::fmt::Debug for AsyncVolumeBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncVolumeBackend")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl VolumeBackend {
    /// The same volume as an [`AsyncBlockBackend`] (for
    /// `VmBuilder::async_disk_backend`).
    pub fn into_async(self) -> AsyncVolumeBackend {
        AsyncVolumeBackend {
            disk: self.disk,
            rt: self.rt,
            _owned: self._owned,
            id: self.id,
            read_only: self.read_only,
            shared: Arc::default(),
            notify: Arc::new(Notify::new()),
            next_seq: Mutex::new(0),
        }
    }
}

/// Reports a task's completion exactly once, also when the runtime drops
/// the task before it finished (then as an I/O error).
struct Finish {
    token: u64,
    seq: Option<u64>,
    shared: Arc<(Mutex<AsyncShared>, Condvar)>,
    notify: Arc<Notify>,
    result: Option<(u8, u32)>,
}

impl Finish {
    fn set(&mut self, result: (u8, u32)) {
        self.result = Some(result);
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        let (status, written) = self.result.unwrap_or((VIRTIO_BLK_S_IOERR as u8, 0));
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock().unwrap_or_else(|p| p.into_inner());
        s.done.push(Completion {
            token: self.token,
            status,
            written,
        });
        s.in_flight = s.in_flight.saturating_sub(1);
        if let Some(seq) = self.seq {
            s.outstanding.remove(&seq);
        }
        if let Some(w) = &s.waker
            && let Err(e) = w.write(1)
        {
            tracing::warn!(error = %e, "volume completion wake-up failed");
        }
        cv.notify_all();
        drop(s);
        self.notify.notify_waiters();
    }
}

fn status_of(r: crate::Result<u32>) -> (u8, u32) {
    match r {
        Ok(w) => (VIRTIO_BLK_S_OK as u8, w),
        Err(e) => {
            tracing::debug!(error = %e, "volume request failed");
            (VIRTIO_BLK_S_IOERR as u8, 0)
        }
    }
}

/// Calls `f(request byte offset, guest address, len)` for the pieces of
/// `segs` covering request bytes `[at, at + len)`.
fn pieces(segs: &[Segment], at: u64, len: u64, mut f: impl FnMut(u64, u64, u64) -> bool) -> bool {
    let mut base = 0u64;
    for s in segs {
        let (lo, hi) = (base, base + u64::from(s.len));
        base = hi;
        let (a, b) = (lo.max(at), hi.min(at + len));
        if a < b && !f(a - at, s.addr + (a - lo), b - a) {
            return false;
        }
    }
    true
}

async fn run_rw(disk: &Disk, req: &Request, mem: &GuestMemory) -> crate::Result<u32> {
    let bad_mem = || Error::InvalidArgument("guest buffer outside guest memory".into());
    let start = req.sector.wrapping_mul(SECTOR_SIZE);
    let mut done = 0u64;
    while done < req.data_len {
        let n = (req.data_len - done).min(CHUNK as u64);
        if req.ty == RequestType::In {
            let data = disk.read(start + done, n as usize).await?;
            let ok = pieces(&req.data, done, n, |off, addr, len| {
                let o = off as usize;
                mem.write_slice(&data[o..o + len as usize], GuestAddress(addr))
                    .is_ok()
            });
            if !ok {
                return Err(bad_mem());
            }
        } else {
            let mut buf = vec![0u8; n as usize];
            let ok = pieces(&req.data, done, n, |off, addr, len| {
                let o = off as usize;
                mem.read_slice(&mut buf[o..o + len as usize], GuestAddress(addr))
                    .is_ok()
            });
            if !ok {
                return Err(bad_mem());
            }
            disk.write(start + done, Bytes::from(buf)).await?;
        }
        done += n;
    }
    Ok(if req.ty == RequestType::In {
        req.data_len as u32
    } else {
        0
    })
}

impl AsyncBlockBackend for AsyncVolumeBackend {
    fn size(&self) -> u64 {
        self.disk.size()
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
        self.shared
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waker = Some(waker);
    }

    fn submit(&self, token: u64, req: Request, mem: &GuestMemory, info: DiskInfo) {
        let seq = {
            let mut n = self.next_seq.lock().unwrap_or_else(|p| p.into_inner());
            *n += 1;
            *n
        };
        let is_rw = matches!(req.ty, RequestType::In | RequestType::Out);
        {
            let mut s = self.shared.0.lock().unwrap_or_else(|p| p.into_inner());
            s.in_flight += 1;
            if is_rw {
                s.outstanding.insert(seq);
            }
        }
        let mut fin = Finish {
            token,
            seq: is_rw.then_some(seq),
            shared: self.shared.clone(),
            notify: self.notify.clone(),
            result: None,
        };
        let ioerr = (VIRTIO_BLK_S_IOERR as u8, 0);
        match req.ty {
            RequestType::GetId => {
                let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
                let n = self.id.len().min(id.len());
                id[..n].copy_from_slice(&self.id.as_bytes()[..n]);
                let len = req.data_len.min(id.len() as u64);
                let ok = pieces(&req.data, 0, len, |off, addr, l| {
                    let o = off as usize;
                    mem.write_slice(&id[o..o + l as usize], GuestAddress(addr))
                        .is_ok()
                });
                fin.set(if ok {
                    (VIRTIO_BLK_S_OK as u8, len as u32)
                } else {
                    ioerr
                });
                return;
            }
            RequestType::Unsupported(_) => {
                fin.set((VIRTIO_BLK_S_UNSUPP as u8, 0));
                return;
            }
            _ => {}
        }
        let disk = self.disk.clone();
        let mem = mem.clone();
        match req.ty {
            RequestType::In | RequestType::Out => {
                self.rt.spawn(async move {
                    fin.set(status_of(run_rw(&disk, &req, &mem).await));
                });
            }
            RequestType::Flush => {
                let (shared, notify) = (self.shared.clone(), self.notify.clone());
                self.rt.spawn(async move {
                    loop {
                        let wait = notify.notified();
                        tokio::pin!(wait);
                        wait.as_mut().enable();
                        let earlier = shared
                            .0
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .outstanding
                            .first()
                            .is_some_and(|&s| s < seq);
                        if !earlier {
                            break;
                        }
                        wait.await;
                    }
                    fin.set(status_of(disk.flush().await.map(|()| 0)));
                });
            }
            RequestType::Discard | RequestType::WriteZeroes => {
                let Ok(rs) = read_ranges(&req, &mem, &info) else {
                    fin.set(ioerr);
                    return;
                };
                let zero = req.ty == RequestType::WriteZeroes;
                self.rt.spawn(async move {
                    let mut r = Ok(0);
                    for ByteRange {
                        offset: off, len, ..
                    } in rs
                    {
                        let step = if zero {
                            disk.write_zeroes(off, len).await
                        } else {
                            disk.trim(off, len).await
                        };
                        if let Err(e) = step {
                            r = Err(e);
                            break;
                        }
                    }
                    fin.set(status_of(r));
                });
            }
            RequestType::GetId | RequestType::Unsupported(_) => {}
        }
    }

    fn reap(&self, out: &mut Vec<Completion>) {
        out.append(&mut self.shared.0.lock().unwrap_or_else(|p| p.into_inner()).done);
    }

    fn drain(&self, out: &mut Vec<Completion>) {
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock().unwrap_or_else(|p| p.into_inner());
        while s.in_flight > 0 {
            s = cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        out.append(&mut s.done);
    }
}
