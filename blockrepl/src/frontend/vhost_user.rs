// SPDX-License-Identifier: Apache-2.0
//! vhost-user-blk backend: QEMU's `vhost-user-blk-pci` (or any vhost-user
//! frontend) drives a volume through shared guest memory.
//!
//! ```text
//!  QEMU ──vhost-user socket──► VhostUserDaemon (vhost-user-backend crate)
//!          memfd guest RAM          │ one worker thread per queue
//!                                   ▼
//!            VhostUserBlk::handle_event: pop chains, parse_request (bounded)
//!                                   │ one tokio task per request
//!                                   ▼
//!            Disk (volume) ─► write data/status to guest memory ─► used ring + irq
//! ```
//!
//! Requests complete out of order, so a guest at queue depth 32 has 32
//! volume operations in flight. Payload bytes in flight per device are
//! bounded ([`BlkConfig::max_in_flight_bytes`]); past the bound the queue
//! thread waits, which backpressures the guest. A malformed descriptor
//! chain fails that request with `VIRTIO_BLK_S_IOERR` (or is dropped from
//! the ring when even its status byte is unusable); a frontend that breaks
//! the vhost-user protocol loses its connection, and [`VhostUserBlkServer`]
//! waits for the next one.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};
use vhost::vhost_user::Listener;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon, VringRwLock, VringT};
use virtio_queue::QueueT;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{
    Address, Bytes as _, GuestAddress, GuestAddressSpace, GuestMemory, GuestMemoryAtomic,
    GuestMemoryBackend, GuestMemoryMmap,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier,
};

use crate::frontend::disk::Disk;

/// Sector size of virtio-blk.
pub const SECTOR: u64 = 512;
/// Largest data payload of one request (`seg_max * size_max`).
pub const MAX_DATA: u64 = SEG_MAX as u64 * SIZE_MAX as u64;
/// Segments per request advertised (`seg_max`).
pub const SEG_MAX: u32 = 128;
/// Largest segment advertised (`size_max`).
pub const SIZE_MAX: u32 = 64 << 10;
/// Discard / write-zeroes ranges per request.
pub const MAX_RANGES: u32 = 16;
/// Size of a virtio-blk request header.
const HEADER_LEN: u64 = 16;

const VIRTIO_F_VERSION_1: u64 = 32;
const VIRTIO_RING_F_INDIRECT_DESC: u64 = 28;
const VIRTIO_RING_F_EVENT_IDX: u64 = 29;
const VHOST_USER_F_PROTOCOL_FEATURES: u64 = 30;
const BLK_F_SIZE_MAX: u64 = 1;
const BLK_F_SEG_MAX: u64 = 2;
const BLK_F_RO: u64 = 5;
const BLK_F_BLK_SIZE: u64 = 6;
const BLK_F_FLUSH: u64 = 9;
const BLK_F_TOPOLOGY: u64 = 10;
const BLK_F_MQ: u64 = 12;
const BLK_F_DISCARD: u64 = 13;
const BLK_F_WRITE_ZEROES: u64 = 14;

const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;
/// Request succeeded.
pub const S_OK: u8 = 0;
/// Request failed.
pub const S_IOERR: u8 = 1;
/// Request type not supported.
pub const S_UNSUPP: u8 = 2;

/// Errors of the vhost-user frontend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VhostUserError {
    /// Creating the daemon failed.
    #[error("create vhost-user daemon: {0}")]
    Daemon(String),
    /// Binding the socket failed.
    #[error("listen on {path}")]
    Listen {
        /// Socket path.
        path: String,
        /// The error.
        #[source]
        source: vhost::vhost_user::Error,
    },
    /// A connection ended with an error (protocol violation or I/O).
    #[error("vhost-user connection failed: {0}")]
    Connection(String),
    /// Bad configuration.
    #[error("configuration: {0}")]
    Config(String),
}

/// Device settings.
#[derive(Clone, Debug)]
pub struct BlkConfig {
    /// Number of request queues (1..=16).
    pub num_queues: u16,
    /// Maximum queue size.
    pub queue_size: u16,
    /// Serial returned by `VIRTIO_BLK_T_GET_ID` (20 bytes used).
    pub serial: String,
    /// Refuse writes.
    pub read_only: bool,
    /// Payload bytes in flight per device before queue threads wait.
    pub max_in_flight_bytes: usize,
}

impl Default for BlkConfig {
    fn default() -> Self {
        BlkConfig {
            num_queues: 1,
            queue_size: 256,
            serial: "sheaf".into(),
            read_only: false,
            max_in_flight_bytes: 64 << 20,
        }
    }
}

/// Counters of a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlkStats {
    /// Requests completed.
    pub requests: u64,
    /// Requests answered with an error status (or dropped as malformed).
    pub errors: u64,
    /// Bytes read by the guest.
    pub read_bytes: u64,
    /// Bytes written by the guest.
    pub write_bytes: u64,
    /// vhost-user connections served.
    pub connections: u64,
    /// Connections that ended with an error.
    pub connection_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    errors: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    connections: AtomicU64,
    connection_errors: AtomicU64,
}

type Mem = GuestMemoryAtomic<GuestMemoryMmap>;

/// The vhost-user-blk backend of one volume. Cheap to clone.
#[derive(Clone)]
pub struct VhostUserBlk {
    inner: Arc<Inner>,
}

struct Inner {
    disk: Disk,
    rt: tokio::runtime::Handle,
    cfg: BlkConfig,
    mem: RwLock<Option<Mem>>,
    event_idx: AtomicBool,
    budget: Arc<Semaphore>,
    inflight: Mutex<Vec<u32>>,
    idle: Condvar,
    counters: Counters,
}

impl std::fmt::Debug for VhostUserBlk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VhostUserBlk")
            .field("cfg", &self.inner.cfg)
            .finish_non_exhaustive()
    }
}

/// A parsed virtio-blk request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkRequest {
    /// Request type (`VIRTIO_BLK_T_*`).
    pub typ: u32,
    /// First sector.
    pub sector: u64,
    /// Driver-readable data after the header (OUT payload, ranges).
    pub readable: Vec<(GuestAddress, u32)>,
    /// Device-writable data before the status byte (IN buffer, id).
    pub writable: Vec<(GuestAddress, u32)>,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

impl BlkRequest {
    /// Total readable payload length.
    pub fn readable_len(&self) -> u64 {
        self.readable.iter().map(|s| s.1 as u64).sum()
    }
    /// Total writable payload length.
    pub fn writable_len(&self) -> u64 {
        self.writable.iter().map(|s| s.1 as u64).sum()
    }
}

/// Why a chain cannot be served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChainError {
    /// No writable byte for the status.
    #[error("descriptor chain has no writable status byte")]
    NoStatus,
    /// A readable descriptor follows a writable one.
    #[error("readable descriptor after a writable one")]
    Order,
    /// Fewer than 16 readable bytes for the header.
    #[error("request header is short")]
    ShortHeader,
    /// The header or a range list could not be read from guest memory.
    #[error("guest memory at {0:#x} is not mapped")]
    Memory(u64),
    /// Payload larger than the device allows.
    #[error("payload of {0} bytes is larger than the limit")]
    TooLarge(u64),
}

/// Splits a descriptor chain into header, payload and status (no I/O
/// beyond reading the 16-byte header from guest memory).
///
/// The status byte is the last byte of the last writable descriptor. If
/// that cannot be found the chain is unanswerable ([`ChainError::NoStatus`]);
/// any other error still has a status address to report `IOERR` to.
pub fn parse_request<M: GuestMemoryBackend + ?Sized>(
    descs: impl Iterator<Item = Descriptor>,
    mem: &M,
) -> Result<BlkRequest, (ChainError, Option<GuestAddress>)> {
    let mut readable = Vec::new();
    let mut writable: Vec<(GuestAddress, u32)> = Vec::new();
    let mut total: u64 = 0;
    let mut order_error = false;
    for d in descs {
        if d.len() == 0 {
            continue;
        }
        total = total.saturating_add(d.len() as u64);
        if d.is_write_only() {
            writable.push((d.addr(), d.len()));
        } else if !writable.is_empty() {
            order_error = true;
        } else {
            readable.push((d.addr(), d.len()));
        }
    }
    let Some(last) = writable.last_mut() else {
        return Err((ChainError::NoStatus, None));
    };
    let Some(status) = last.0.checked_add(last.1 as u64 - 1) else {
        return Err((ChainError::NoStatus, None));
    };
    if !mem.address_in_range(status) {
        return Err((ChainError::NoStatus, None));
    }
    last.1 -= 1;
    if last.1 == 0 {
        writable.pop();
    }
    let fail = |e| Err((e, Some(status)));
    if order_error {
        return fail(ChainError::Order);
    }
    if total > MAX_DATA + HEADER_LEN + 1 + (MAX_RANGES as u64 * 16) {
        return fail(ChainError::TooLarge(total));
    }
    // The header: the first 16 readable bytes, possibly over several descriptors.
    let mut header = [0u8; HEADER_LEN as usize];
    let mut got = 0usize;
    let mut rest = Vec::with_capacity(readable.len());
    for (addr, len) in readable {
        if got < header.len() {
            let n = (header.len() - got).min(len as usize);
            if mem.read_slice(&mut header[got..got + n], addr).is_err() {
                return fail(ChainError::Memory(addr.0));
            }
            got += n;
            if n < len as usize {
                // n < len, so the addition stays inside the descriptor.
                rest.push((GuestAddress(addr.0 + n as u64), len - n as u32));
            }
        } else {
            rest.push((addr, len));
        }
    }
    if got < header.len() {
        return fail(ChainError::ShortHeader);
    }
    let typ = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let mut s = [0u8; 8];
    s.copy_from_slice(&header[8..16]);
    Ok(BlkRequest {
        typ,
        sector: u64::from_le_bytes(s),
        readable: rest,
        writable,
        status,
    })
}

/// Checks a parsed request against a device of `size` bytes (read-only
/// or not) and gathers what it carries from guest memory: the requested
/// range must lie inside the device, data lengths must be whole sectors
/// and at most [`MAX_DATA`], discard/write-zeroes take 1 to [`MAX_RANGES`]
/// ranges with known flags. Anything else becomes [`BlkWork::Fail`] with
/// the status byte to answer (guest-controlled input never panics).
pub fn plan_request<M: GuestMemory + ?Sized>(
    req: &BlkRequest,
    mem: &M,
    size: u64,
    read_only: bool,
) -> BlkWork {
    let range_ok = |offset: u64, len: u64| offset.checked_add(len).is_some_and(|end| end <= size);
    let offset = req.sector.checked_mul(SECTOR);
    match req.typ {
        T_IN => {
            let len = req.writable_len();
            match offset {
                Some(o) if len <= MAX_DATA && len.is_multiple_of(SECTOR) && range_ok(o, len) => {
                    BlkWork::Read {
                        offset: o,
                        len: len as usize,
                    }
                }
                _ => BlkWork::Fail(S_IOERR),
            }
        }
        T_OUT if read_only => BlkWork::Fail(S_IOERR),
        T_OUT => {
            let len = req.readable_len();
            match offset {
                Some(o) if len <= MAX_DATA && len.is_multiple_of(SECTOR) && range_ok(o, len) => {
                    match gather(mem, &req.readable) {
                        Some(d) => BlkWork::Write {
                            offset: o,
                            data: Bytes::from(d),
                        },
                        None => BlkWork::Fail(S_IOERR),
                    }
                }
                _ => BlkWork::Fail(S_IOERR),
            }
        }
        T_FLUSH => BlkWork::Flush,
        T_GET_ID => BlkWork::Id,
        T_DISCARD | T_WRITE_ZEROES if read_only => BlkWork::Fail(S_IOERR),
        T_DISCARD | T_WRITE_ZEROES => {
            let len = req.readable_len();
            if len == 0 || !len.is_multiple_of(16) || len / 16 > MAX_RANGES as u64 {
                return BlkWork::Fail(S_IOERR);
            }
            let Some(raw) = gather(mem, &req.readable) else {
                return BlkWork::Fail(S_IOERR);
            };
            let mut ranges = Vec::new();
            for r in raw.chunks_exact(16) {
                let mut s = [0u8; 8];
                s.copy_from_slice(&r[0..8]);
                let sector = u64::from_le_bytes(s);
                let n = u32::from_le_bytes([r[8], r[9], r[10], r[11]]) as u64;
                let flags = u32::from_le_bytes([r[12], r[13], r[14], r[15]]);
                if flags & !1 != 0 || (req.typ == T_DISCARD && flags != 0) {
                    return BlkWork::Fail(S_UNSUPP);
                }
                match sector.checked_mul(SECTOR) {
                    Some(o) if range_ok(o, n * SECTOR) => ranges.push((o, n * SECTOR)),
                    _ => return BlkWork::Fail(S_IOERR),
                }
            }
            BlkWork::Ranges {
                zero: req.typ == T_WRITE_ZEROES,
                ranges,
            }
        }
        _ => BlkWork::Fail(S_UNSUPP),
    }
}

fn gather<M: GuestMemory + ?Sized>(mem: &M, segs: &[(GuestAddress, u32)]) -> Option<Vec<u8>> {
    let total: usize = segs.iter().map(|s| s.1 as usize).sum();
    let mut buf = vec![0u8; total];
    let mut at = 0;
    for &(addr, len) in segs {
        mem.read_slice(&mut buf[at..at + len as usize], addr).ok()?;
        at += len as usize;
    }
    Some(buf)
}

fn scatter<M: GuestMemory + ?Sized>(mem: &M, segs: &[(GuestAddress, u32)], data: &[u8]) -> bool {
    let mut at = 0;
    for &(addr, len) in segs {
        if at >= data.len() {
            break;
        }
        let n = (len as usize).min(data.len() - at);
        if mem.write_slice(&data[at..at + n], addr).is_err() {
            return false;
        }
        at += n;
    }
    true
}

/// What a parsed request asks of the volume, after every check against
/// the device ([`plan_request`]): prepared on the queue thread, finished
/// on the runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BlkWork {
    /// Read `len` bytes at byte `offset` into the writable buffers.
    Read {
        /// Byte offset in the volume.
        offset: u64,
        /// Bytes to read.
        len: usize,
    },
    /// Write `data` (gathered from the readable buffers) at byte `offset`.
    Write {
        /// Byte offset in the volume.
        offset: u64,
        /// The data.
        data: Bytes,
    },
    /// Flush the volume.
    Flush,
    /// Answer `VIRTIO_BLK_T_GET_ID`.
    Id,
    /// Discard (`zero == false`) or write zeroes over byte ranges
    /// `(offset, len)`.
    Ranges {
        /// Write zeroes rather than discard.
        zero: bool,
        /// `(offset, len)` in bytes.
        ranges: Vec<(u64, u64)>,
    },
    /// Answer at once with this status byte (`IOERR`, `UNSUPP`).
    Fail(u8),
}

impl VhostUserBlk {
    /// A backend serving `disk`; request I/O runs on the runtime `rt`
    /// (the one the volume was attached on).
    pub fn new(
        disk: Disk,
        rt: tokio::runtime::Handle,
        cfg: BlkConfig,
    ) -> Result<Self, VhostUserError> {
        if cfg.num_queues == 0 || cfg.num_queues > 16 {
            return Err(VhostUserError::Config(format!(
                "num_queues {} not in 1..=16",
                cfg.num_queues
            )));
        }
        if !cfg.queue_size.is_power_of_two() {
            return Err(VhostUserError::Config(
                "queue_size must be a power of two".into(),
            ));
        }
        let budget = cfg.max_in_flight_bytes.max(MAX_DATA as usize);
        Ok(VhostUserBlk {
            inner: Arc::new(Inner {
                disk,
                rt,
                inflight: Mutex::new(vec![0; cfg.num_queues as usize]),
                cfg,
                mem: RwLock::new(None),
                event_idx: AtomicBool::new(false),
                budget: Arc::new(Semaphore::new(budget)),
                idle: Condvar::new(),
                counters: Counters::default(),
            }),
        })
    }

    /// The device's counters.
    pub fn stats(&self) -> BlkStats {
        let c = &self.inner.counters;
        BlkStats {
            requests: c.requests.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
            read_bytes: c.read_bytes.load(Ordering::Relaxed),
            write_bytes: c.write_bytes.load(Ordering::Relaxed),
            connections: c.connections.load(Ordering::Relaxed),
            connection_errors: c.connection_errors.load(Ordering::Relaxed),
        }
    }

    /// The virtio-blk configuration space (60 bytes).
    pub fn config_space(&self) -> Vec<u8> {
        let cfg = &self.inner.cfg;
        let mut c = vec![0u8; 60];
        let sectors = self.inner.disk.size() / SECTOR;
        c[0..8].copy_from_slice(&sectors.to_le_bytes());
        c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        c[20..24].copy_from_slice(&(SECTOR as u32).to_le_bytes());
        c[24] = 3; // physical block = 512 << 3 = 4 KiB
        c[26..28].copy_from_slice(&8u16.to_le_bytes()); // min_io_size (sectors)
        c[28..32].copy_from_slice(&8u32.to_le_bytes()); // opt_io_size (sectors)
        c[34..36].copy_from_slice(&cfg.num_queues.to_le_bytes());
        let max_sectors = (u32::MAX / SECTOR as u32) & !7;
        c[36..40].copy_from_slice(&max_sectors.to_le_bytes()); // max_discard_sectors
        c[40..44].copy_from_slice(&MAX_RANGES.to_le_bytes());
        c[44..48].copy_from_slice(&8u32.to_le_bytes()); // discard_sector_alignment
        c[48..52].copy_from_slice(&max_sectors.to_le_bytes());
        c[52..56].copy_from_slice(&MAX_RANGES.to_le_bytes());
        c[56] = 1; // write_zeroes_may_unmap
        c
    }

    fn memory(&self) -> Option<Mem> {
        self.inner
            .mem
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Pops and starts every available request of queue `q`.
    fn process_queue(&self, q: usize, vring: &VringRwLock) -> io::Result<()> {
        let Some(atomic) = self.memory() else {
            return Ok(());
        };
        loop {
            let mem = atomic.memory();
            let chain = vring
                .get_mut()
                .get_queue_mut()
                .pop_descriptor_chain(mem.clone());
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            let req = match parse_request(chain, &*mem) {
                Ok(r) => r,
                Err((e, status)) => {
                    warn!(queue = q, head, error = %e, "malformed virtio-blk request");
                    self.inner.counters.errors.fetch_add(1, Ordering::Relaxed);
                    if let Some(s) = status {
                        let _ = mem.write_slice(&[S_IOERR], s);
                        self.complete(vring, head, 1)?;
                    } else {
                        // No status byte to report through: return the
                        // descriptors with nothing written.
                        self.complete(vring, head, 0)?;
                    }
                    continue;
                }
            };
            let work = plan_request(
                &req,
                &*mem,
                self.inner.disk.size(),
                self.inner.cfg.read_only,
            );
            let need = match &work {
                BlkWork::Read { len, .. } => *len,
                BlkWork::Write { data, .. } => data.len(),
                _ => 0,
            } as u32;
            // Bound payload in flight: wait here (the queue thread), which
            // holds further requests in the ring.
            let permit = self
                .inner
                .rt
                .block_on(self.inner.budget.clone().acquire_many_owned(need))
                .map_err(|_| io::Error::other("device shut down"))?;
            self.inner
                .inflight
                .lock()
                .unwrap_or_else(|p| p.into_inner())[q] += 1;
            let me = self.clone();
            let vring = vring.clone();
            self.inner.rt.spawn(async move {
                let _permit = permit;
                me.finish(q, &vring, head, req, work).await;
            });
        }
        Ok(())
    }

    async fn finish(
        &self,
        q: usize,
        vring: &VringRwLock,
        head: u16,
        req: BlkRequest,
        work: BlkWork,
    ) {
        let disk = &self.inner.disk;
        let c = &self.inner.counters;
        let mut data: Option<Bytes> = None;
        let status = match work {
            BlkWork::Read { offset, len } => match disk.read(offset, len).await {
                Ok(d) => {
                    c.read_bytes.fetch_add(len as u64, Ordering::Relaxed);
                    data = Some(d);
                    S_OK
                }
                Err(e) => {
                    warn!(offset, len, error = %e, "virtio-blk read failed");
                    S_IOERR
                }
            },
            BlkWork::Write { offset, data: d } => {
                let len = d.len() as u64;
                match disk.write(offset, d).await {
                    Ok(()) => {
                        c.write_bytes.fetch_add(len, Ordering::Relaxed);
                        S_OK
                    }
                    Err(e) => {
                        warn!(offset, len, error = %e, "virtio-blk write failed");
                        S_IOERR
                    }
                }
            }
            BlkWork::Flush => match disk.flush().await {
                Ok(()) => S_OK,
                Err(e) => {
                    warn!(error = %e, "virtio-blk flush failed");
                    S_IOERR
                }
            },
            BlkWork::Id => {
                let mut id = [0u8; 20];
                let s = self.inner.cfg.serial.as_bytes();
                let n = s.len().min(20);
                id[..n].copy_from_slice(&s[..n]);
                data = Some(Bytes::copy_from_slice(&id));
                S_OK
            }
            BlkWork::Ranges { zero, ranges } => {
                let mut st = S_OK;
                for (o, l) in ranges {
                    let r = if zero {
                        disk.write_zeroes(o, l).await
                    } else {
                        disk.trim(o, l).await
                    };
                    if let Err(e) = r {
                        warn!(offset = o, len = l, error = %e, "virtio-blk discard/zeroes failed");
                        st = S_IOERR;
                        break;
                    }
                }
                st
            }
            BlkWork::Fail(s) => s,
        };
        let mut written = 1u32;
        let mut status = status;
        if let Some(atomic) = self.memory() {
            let mem = atomic.memory();
            if let Some(d) = &data {
                let n = (d.len() as u64).min(req.writable_len());
                if scatter(&*mem, &req.writable, &d[..n as usize]) {
                    written += n as u32;
                } else {
                    status = S_IOERR;
                }
            }
            let _ = mem.write_slice(&[status], req.status);
        }
        c.requests.fetch_add(1, Ordering::Relaxed);
        if status != S_OK {
            c.errors.fetch_add(1, Ordering::Relaxed);
        }
        if let Err(e) = self.complete(vring, head, written) {
            debug!(error = %e, "signal used queue");
        }
        let mut inflight = self
            .inner
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        inflight[q] = inflight[q].saturating_sub(1);
        if inflight[q] == 0 {
            self.inner.idle.notify_all();
        }
    }

    fn complete(&self, vring: &VringRwLock, head: u16, len: u32) -> io::Result<()> {
        vring
            .add_used(head, len)
            .map_err(|e| io::Error::other(format!("add used: {e:?}")))?;
        let notify = vring.needs_notification().unwrap_or(true);
        if notify {
            vring.signal_used_queue()?;
        }
        Ok(())
    }
}

impl VhostUserBackend for VhostUserBlk {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        self.inner.cfg.num_queues as usize
    }

    fn max_queue_size(&self) -> usize {
        self.inner.cfg.queue_size as usize
    }

    fn features(&self) -> u64 {
        let mut f = (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VHOST_USER_F_PROTOCOL_FEATURES)
            | (1 << BLK_F_SIZE_MAX)
            | (1 << BLK_F_SEG_MAX)
            | (1 << BLK_F_BLK_SIZE)
            | (1 << BLK_F_FLUSH)
            | (1 << BLK_F_TOPOLOGY)
            | (1 << BLK_F_MQ);
        if self.inner.cfg.read_only {
            f |= 1 << BLK_F_RO;
        } else {
            f |= (1 << BLK_F_DISCARD) | (1 << BLK_F_WRITE_ZEROES);
        }
        f
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ
    }

    fn set_event_idx(&self, enabled: bool) {
        self.inner.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let c = self.config_space();
        let start = (offset as usize).min(c.len());
        let end = start.saturating_add(size as usize).min(c.len());
        let mut v = c[start..end].to_vec();
        v.resize(size as usize, 0);
        v
    }

    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        *self.inner.mem.write().unwrap_or_else(|p| p.into_inner()) = Some(mem);
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.inner.cfg.num_queues).map(|i| 1u64 << i).collect()
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        let q = queue_index as usize;
        let guard = self
            .inner
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (guard, timeout) = self
            .inner
            .idle
            .wait_timeout_while(guard, Duration::from_secs(30), |f| {
                f.get(q).copied().unwrap_or(0) > 0
            })
            .unwrap_or_else(|p| p.into_inner());
        drop(guard);
        if timeout.timed_out() {
            warn!(
                queue = q,
                "requests still in flight after 30 s at GET_VRING_BASE"
            );
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock],
        _thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected event set {evset:?}")));
        }
        let q = device_event as usize;
        let Some(vring) = vrings.get(q) else {
            return Err(io::Error::other(format!("event for unknown queue {q}")));
        };
        if self.inner.event_idx.load(Ordering::Relaxed) {
            // Drain, re-enable notifications, and drain again if the guest
            // added requests in between (no lost wake-up).
            loop {
                vring
                    .disable_notification()
                    .map_err(|e| io::Error::other(format!("{e:?}")))?;
                self.process_queue(q, vring)?;
                if !vring
                    .enable_notification()
                    .map_err(|e| io::Error::other(format!("{e:?}")))?
                {
                    break;
                }
            }
            Ok(())
        } else {
            self.process_queue(q, vring)
        }
    }
}

/// Serves one backend on a vhost-user socket, one frontend at a time.
#[derive(Debug, Clone)]
pub struct VhostUserBlkServer {
    backend: VhostUserBlk,
}

impl VhostUserBlkServer {
    /// Wraps a backend.
    pub fn new(backend: VhostUserBlk) -> Self {
        VhostUserBlkServer { backend }
    }

    /// The backend (for its counters).
    pub fn backend(&self) -> &VhostUserBlk {
        &self.backend
    }

    /// Listens on `socket` (replacing a stale socket file) and serves
    /// frontends one after the other, forever: a frontend that disconnects
    /// or breaks the protocol is dropped and the next one is accepted.
    /// Returns only if the socket cannot be bound or a daemon cannot be
    /// created.
    pub fn serve(&self, socket: &Path) -> Result<(), VhostUserError> {
        let mut listener =
            Listener::new(socket, true).map_err(|source| VhostUserError::Listen {
                path: socket.display().to_string(),
                source,
            })?;
        info!(socket = %socket.display(), "vhost-user-blk listening");
        loop {
            match self.serve_one(&mut listener) {
                Ok(()) => info!("vhost-user frontend disconnected"),
                Err(VhostUserError::Connection(e)) => {
                    warn!(error = %e, "vhost-user connection closed with an error")
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Accepts one frontend on `listener` and serves it until it goes away.
    pub fn serve_one(&self, listener: &mut Listener) -> Result<(), VhostUserError> {
        let mut daemon = VhostUserDaemon::new(
            "sheaf-vhost-user-blk".into(),
            self.backend.clone(),
            GuestMemoryAtomic::new(GuestMemoryMmap::new()),
        )
        .map_err(|e| VhostUserError::Daemon(e.to_string()))?;
        let counters = &self.backend.inner.counters;
        daemon
            .start(listener)
            .map_err(|e| VhostUserError::Connection(e.to_string()))?;
        counters.connections.fetch_add(1, Ordering::Relaxed);
        let r = daemon.wait();
        // Drop the guest's memory map with its connection.
        *self
            .backend
            .inner
            .mem
            .write()
            .unwrap_or_else(|p| p.into_inner()) = None;
        drop(daemon); // stops and joins the queue threads
        match r {
            Ok(()) => Ok(()),
            Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => Ok(()),
            Err(e) => {
                counters.connection_errors.fetch_add(1, Ordering::Relaxed);
                Err(VhostUserError::Connection(e.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use virtio_queue::desc::split::Descriptor;
    use vm_memory::{Bytes as _, GuestAddress, GuestMemoryMmap};

    use super::*;

    const F_NEXT: u16 = 1;
    const F_WRITE: u16 = 2;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    fn header(m: &GuestMemoryMmap, at: u64, typ: u32, sector: u64) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&typ.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        m.write_slice(&h, GuestAddress(at)).unwrap();
    }

    #[test]
    fn plans_check_requests_against_the_device() {
        let m = mem();
        let size = 1 << 20;
        let req = |typ: u32, sector: u64, readable: Vec<(u64, u32)>, writable: Vec<(u64, u32)>| {
            BlkRequest {
                typ,
                sector,
                readable: readable
                    .into_iter()
                    .map(|(a, l)| (GuestAddress(a), l))
                    .collect(),
                writable: writable
                    .into_iter()
                    .map(|(a, l)| (GuestAddress(a), l))
                    .collect(),
                status: GuestAddress(0x9000),
            }
        };
        let plan = |r: &BlkRequest, ro: bool| plan_request(r, &m, size, ro);
        // Reads: whole sectors inside the device.
        let last = size / SECTOR - 8;
        assert_eq!(
            plan(&req(T_IN, last, vec![], vec![(0x2000, 4096)]), true),
            BlkWork::Read {
                offset: last * SECTOR,
                len: 4096
            }
        );
        for r in [
            req(T_IN, last + 1, vec![], vec![(0x2000, 4096)]),
            req(T_IN, u64::MAX / 256, vec![], vec![(0x2000, 512)]),
            req(T_IN, 0, vec![], vec![(0x2000, 100)]),
        ] {
            assert_eq!(plan(&r, false), BlkWork::Fail(S_IOERR), "{r:?}");
        }
        // Writes: gathered from guest memory; refused on a read-only device
        // and when a buffer is not mapped.
        m.write_slice(&[7u8; 1024], GuestAddress(0x3000)).unwrap();
        let w = req(T_OUT, 2, vec![(0x3000, 512), (0x3200, 512)], vec![]);
        assert_eq!(
            plan(&w, false),
            BlkWork::Write {
                offset: 1024,
                data: Bytes::from(vec![7u8; 1024])
            }
        );
        assert_eq!(plan(&w, true), BlkWork::Fail(S_IOERR));
        let unmapped = req(T_OUT, 0, vec![(0xfff_0000, 512)], vec![]);
        assert_eq!(plan(&unmapped, false), BlkWork::Fail(S_IOERR));
        // Discard / write zeroes: 16-byte ranges, known flags, inside.
        let range = |at: u64, sector: u64, n: u32, flags: u32| {
            let mut r = [0u8; 16];
            r[0..8].copy_from_slice(&sector.to_le_bytes());
            r[8..12].copy_from_slice(&n.to_le_bytes());
            r[12..16].copy_from_slice(&flags.to_le_bytes());
            m.write_slice(&r, GuestAddress(at)).unwrap();
        };
        range(0x4000, 8, 16, 1);
        range(0x4010, 0, 8, 0);
        let z = req(T_WRITE_ZEROES, 0, vec![(0x4000, 32)], vec![]);
        assert_eq!(
            plan(&z, false),
            BlkWork::Ranges {
                zero: true,
                ranges: vec![(4096, 8192), (0, 4096)]
            }
        );
        // The unmap flag is only valid for write zeroes.
        let d = req(T_DISCARD, 0, vec![(0x4000, 32)], vec![]);
        assert_eq!(plan(&d, false), BlkWork::Fail(S_UNSUPP));
        range(0x4000, size / SECTOR - 4, 8, 0);
        assert_eq!(
            plan(&d, false),
            BlkWork::Fail(S_IOERR),
            "range past the end"
        );
        for bad_len in [0, 15, 16 * (MAX_RANGES + 1)] {
            let r = req(T_DISCARD, 0, vec![(0x4000, bad_len)], vec![]);
            assert_eq!(plan(&r, false), BlkWork::Fail(S_IOERR), "{bad_len} bytes");
        }
        assert_eq!(plan(&d, true), BlkWork::Fail(S_IOERR), "read-only");
        assert_eq!(plan(&req(T_FLUSH, 0, vec![], vec![]), true), BlkWork::Flush);
        assert_eq!(
            plan(&req(99, 0, vec![], vec![]), false),
            BlkWork::Fail(S_UNSUPP)
        );
    }

    #[test]
    fn parses_split_and_combined_descriptors() {
        let m = mem();
        header(&m, 0x1000, T_IN, 8);
        let r = parse_request(
            vec![
                Descriptor::new(0x1000, 16, F_NEXT, 1),
                Descriptor::new(0x2000, 4096, F_NEXT | F_WRITE, 2),
                Descriptor::new(0x3000, 1, F_WRITE, 0),
            ]
            .into_iter(),
            &m,
        )
        .unwrap();
        assert_eq!((r.typ, r.sector), (T_IN, 8));
        assert_eq!(r.writable, vec![(GuestAddress(0x2000), 4096)]);
        assert_eq!(r.status, GuestAddress(0x3000));
        // Header and payload in one descriptor; status at the end of the data one.
        header(&m, 0x4000, T_OUT, 1);
        let r = parse_request(
            vec![
                Descriptor::new(0x4000, 16 + 512, F_NEXT, 1),
                Descriptor::new(0x5000, 1, F_WRITE, 0),
            ]
            .into_iter(),
            &m,
        )
        .unwrap();
        assert_eq!(r.readable, vec![(GuestAddress(0x4010), 512)]);
        assert_eq!(r.readable_len(), 512);
        // Header split over two descriptors.
        header(&m, 0x6000, T_FLUSH, 0);
        let r = parse_request(
            vec![
                Descriptor::new(0x6000, 7, F_NEXT, 1),
                Descriptor::new(0x6007, 9, F_NEXT, 2),
                Descriptor::new(0x7000, 1, F_WRITE, 0),
            ]
            .into_iter(),
            &m,
        )
        .unwrap();
        assert_eq!(r.typ, T_FLUSH);
    }

    #[test]
    fn rejects_malformed_chains() {
        let m = mem();
        header(&m, 0x1000, T_IN, 0);
        let err = |d: Vec<Descriptor>| parse_request(d.into_iter(), &m).unwrap_err();
        // No writable byte at all, or the status outside guest memory.
        assert_eq!(
            err(vec![Descriptor::new(0x1000, 16, 0, 0)]).0,
            ChainError::NoStatus
        );
        assert_eq!(
            err(vec![
                Descriptor::new(0x1000, 16, F_NEXT, 1),
                Descriptor::new(0xfff_0000, 1, F_WRITE, 0)
            ])
            .0,
            ChainError::NoStatus
        );
        assert_eq!(
            err(vec![
                Descriptor::new(0x1000, 16, F_NEXT, 1),
                Descriptor::new(u64::MAX, 2, F_WRITE, 0)
            ])
            .0,
            ChainError::NoStatus
        );
        // Short header, readable after writable, unmapped header, too large.
        let e = err(vec![
            Descriptor::new(0x1000, 8, F_NEXT, 1),
            Descriptor::new(0x2000, 1, F_WRITE, 0),
        ]);
        assert_eq!(e, (ChainError::ShortHeader, Some(GuestAddress(0x2000))));
        let e = err(vec![
            Descriptor::new(0x2000, 1, F_WRITE | F_NEXT, 1),
            Descriptor::new(0x1000, 16, F_NEXT, 2),
            Descriptor::new(0x3000, 1, F_WRITE, 0),
        ]);
        assert_eq!(e.0, ChainError::Order);
        let e = err(vec![
            Descriptor::new(0xff0_0000, 16, F_NEXT, 1),
            Descriptor::new(0x3000, 1, F_WRITE, 0),
        ]);
        assert!(matches!(e.0, ChainError::Memory(_)));
        let e = err(vec![
            Descriptor::new(0x1000, 16, F_NEXT, 1),
            Descriptor::new(0x2000, u32::MAX, F_WRITE | F_NEXT, 2),
            Descriptor::new(0x3000, 1, F_WRITE, 0),
        ]);
        assert!(matches!(e.0, ChainError::TooLarge(_)));
    }

    #[test]
    fn config_space_layout() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        crate::volume::create_replica(dir.path(), 8 << 20).unwrap();
        let vol = rt
            .block_on(crate::volume::Volume::attach(
                crate::volume::VolumeConfig::local(dir.path()),
            ))
            .unwrap();
        let b =
            VhostUserBlk::new(Disk::new(vol), rt.handle().clone(), BlkConfig::default()).unwrap();
        let c = b.config_space();
        assert_eq!(c.len(), 60);
        assert_eq!(
            u64::from_le_bytes(c[0..8].try_into().unwrap()),
            (8 << 20) / 512
        );
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 512);
        assert_eq!(c[24], 3);
        assert_eq!(b.get_config(56, 8), vec![1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(b.get_config(1000, 4), vec![0; 4]);
        assert_ne!(b.features() & (1 << BLK_F_DISCARD), 0);
        assert!(
            VhostUserBlk::new(
                b.inner.disk.clone(),
                rt.handle().clone(),
                BlkConfig {
                    num_queues: 0,
                    ..BlkConfig::default()
                }
            )
            .is_err()
        );
    }
}
