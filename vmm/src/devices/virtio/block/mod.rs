// SPDX-License-Identifier: Apache-2.0
//! virtio-blk over an [`AsyncBlockBackend`] (any [`BlockBackend`] through
//! [`SyncAdapter`] or [`ThreadPoolBackend`]), with up to a queue's worth of
//! requests in flight, completed in any order.

pub mod backend;
pub mod engine;
pub mod request;
pub mod seam;
pub mod uring;

use std::collections::HashMap;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use virtio_bindings::virtio_blk::*;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use self::backend::{BlockBackend, SECTOR_SIZE};
use self::request::{DiskInfo, MAX_DISCARD_SEG, MAX_SEGMENTS, RequestType, Segment};
pub use self::seam::{AsyncBlockBackend, Completion, SyncAdapter, ThreadPoolBackend};
pub use self::uring::IoUringBackend;
use super::{DeviceFault, DeviceState, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX, VirtioDevice};
use crate::memory::GuestMemory;
use vmm_sys_util::eventfd::EventFd;

/// Queue size offered.
pub const QUEUE_SIZE: u16 = 256;
/// virtio device id of a block device.
pub const DEVICE_TYPE_BLOCK: u32 = 2;
/// `seg_max` advertised (Linux keeps two descriptors for header and status).
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// `size_max` advertised.
pub const SIZE_MAX: u32 = 1 << 20;
/// Most request queues one device offers (`VIRTIO_BLK_F_MQ`).
pub const MAX_QUEUES: u16 = 16;

/// Per-device counters, readable while the VM runs.
#[derive(Debug, Default)]
pub struct BlockStats {
    /// Completed requests.
    pub requests: std::sync::atomic::AtomicU64,
    /// Requests answered with an error status.
    pub errors: std::sync::atomic::AtomicU64,
    /// Bytes read by the guest.
    pub read_bytes: std::sync::atomic::AtomicU64,
    /// Bytes written by the guest.
    pub write_bytes: std::sync::atomic::AtomicU64,
}

/// A request handed to the backend and not yet completed.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    queue: usize,
    head: u16,
    status_addr: u64,
    ty: RequestType,
    data_len: u64,
}

/// A virtio-blk device.
pub struct VirtioBlock {
    backend: Arc<dyn AsyncBlockBackend>,
    disk: DiskInfo,
    features: u64,
    config: [u8; 60],
    stats: Arc<BlockStats>,
    in_flight: HashMap<u64, InFlight>,
    next_token: u64,
    reaped: Vec<Completion>,
    queue_sizes: Vec<u16>,
    /// Per queue: requests in flight, completions reaped while serving
    /// another queue, and the queue's notify eventfd.
    per_queue: Vec<PerQueue>,
}

#[derive(Default)]
struct PerQueue {
    in_flight: usize,
    stash: Vec<Completion>,
    waker: Option<EventFd>,
}

impl std::fmt::Debug for VirtioBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioBlock")
            .field("id", &self.backend.device_id())
            .field("sectors", &self.disk.sectors)
            .finish_non_exhaustive()
    }
}

impl VirtioBlock {
    /// A device serving a synchronous `backend` inline on the device thread.
    pub fn new(backend: Arc<dyn BlockBackend>) -> Self {
        Self::new_async(Arc::new(SyncAdapter::new(backend)))
    }

    /// A device serving an asynchronous `backend`.
    pub fn new_async(backend: Arc<dyn AsyncBlockBackend>) -> Self {
        Self::new_multiqueue(backend, 1)
    }

    /// A device with `queues` request queues (clamped to 1..=[`MAX_QUEUES`];
    /// more than one offers `VIRTIO_BLK_F_MQ`) over one `backend`.
    /// Completions are put on the queue their request came from.
    pub fn new_multiqueue(backend: Arc<dyn AsyncBlockBackend>, queues: u16) -> Self {
        let queues = queues.clamp(1, MAX_QUEUES);
        let sectors = backend.size() / SECTOR_SIZE;
        let disk = DiskInfo {
            sectors,
            read_only: backend.read_only(),
            discard: backend.supports_discard() && !backend.read_only(),
            write_zeroes: backend.supports_write_zeroes() && !backend.read_only(),
        };
        let mut features = (1u64 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_BLK_F_BLK_SIZE)
            | (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_SIZE_MAX);
        if disk.read_only {
            features |= 1 << VIRTIO_BLK_F_RO;
        }
        if disk.discard {
            features |= 1 << VIRTIO_BLK_F_DISCARD;
        }
        if disk.write_zeroes {
            features |= 1 << VIRTIO_BLK_F_WRITE_ZEROES;
        }
        if queues > 1 {
            features |= 1 << VIRTIO_BLK_F_MQ;
        }
        let mut config = [0u8; 60];
        let mut put =
            |off: usize, bytes: &[u8]| config[off..off + bytes.len()].copy_from_slice(bytes);
        put(0, &sectors.to_le_bytes());
        put(8, &SIZE_MAX.to_le_bytes());
        put(12, &SEG_MAX.to_le_bytes());
        put(20, &(SECTOR_SIZE as u32).to_le_bytes());
        put(34, &queues.to_le_bytes());
        let max_sectors = u32::MAX / SECTOR_SIZE as u32;
        put(36, &max_sectors.to_le_bytes());
        put(40, &MAX_DISCARD_SEG.to_le_bytes());
        put(44, &1u32.to_le_bytes());
        put(48, &max_sectors.to_le_bytes());
        put(52, &MAX_DISCARD_SEG.to_le_bytes());
        put(56, &[1]);
        VirtioBlock {
            backend,
            disk,
            features,
            config,
            stats: Arc::default(),
            in_flight: HashMap::new(),
            next_token: 0,
            reaped: Vec::new(),
            queue_sizes: vec![QUEUE_SIZE; usize::from(queues)],
            per_queue: (0..queues).map(|_| PerQueue::default()).collect(),
        }
    }

    /// Shared counters.
    pub fn stats(&self) -> Arc<BlockStats> {
        self.stats.clone()
    }

    /// Requests submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    fn count(&self, status: u8, ty: Option<RequestType>, data_len: u64) {
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        if status != 0 {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let counter = match ty {
            Some(RequestType::In) => &self.stats.read_bytes,
            Some(RequestType::Out) => &self.stats.write_bytes,
            _ => return,
        };
        counter.fetch_add(data_len, Ordering::Relaxed);
    }

    /// Frames one descriptor chain given as segments and submits it. A bad
    /// request is answered at once: returns `Some(bytes written)` when the
    /// chain is already complete, `None` when it went to the backend.
    fn submit_chain(
        &mut self,
        queue: usize,
        head: u16,
        segs: &[Segment],
        mem: &GuestMemory,
    ) -> Result<Option<u32>, DeviceFault> {
        let framed =
            request::parse(segs, mem, &self.disk).map_err(|e| DeviceFault(e.to_string()))?;
        match framed.request {
            Ok(req) => {
                let token = self.next_token;
                self.next_token = self.next_token.wrapping_add(1);
                self.in_flight.insert(
                    token,
                    InFlight {
                        queue,
                        head,
                        status_addr: framed.status_addr,
                        ty: req.ty,
                        data_len: req.data_len,
                    },
                );
                if let Some(q) = self.per_queue.get_mut(queue) {
                    q.in_flight += 1;
                }
                self.backend.submit(token, req, mem, self.disk);
                Ok(None)
            }
            Err(e) => {
                tracing::debug!(error = %e, "rejected virtio-blk request");
                let status = e.status();
                self.count(status, None, 0);
                mem.write_obj(status, GuestAddress(framed.status_addr))
                    .map_err(|e| DeviceFault(format!("status write: {e}")))?;
                Ok(Some(1))
            }
        }
    }

    /// Puts every ready completion on the used ring; returns whether any was.
    fn complete_ready(
        &mut self,
        index: usize,
        queue: &mut Queue,
        mem: &GuestMemory,
    ) -> Result<bool, DeviceFault> {
        let mut done = std::mem::take(&mut self.reaped);
        if let Some(q) = self.per_queue.get_mut(index) {
            done.append(&mut q.stash);
        }
        self.backend.reap(&mut done);
        let mut used = false;
        let mut result = Ok(());
        let mut wake = Vec::new();
        for c in done.drain(..) {
            let Some(f) = self.in_flight.get(&c.token).copied() else {
                tracing::warn!(token = c.token, "completion for no request in flight");
                continue;
            };
            if f.queue != index {
                // Another queue's request: hand it over and wake that queue.
                if let Some(q) = self.per_queue.get_mut(f.queue) {
                    q.stash.push(c);
                    wake.push(f.queue);
                }
                continue;
            }
            self.in_flight.remove(&c.token);
            if let Some(q) = self.per_queue.get_mut(index) {
                q.in_flight = q.in_flight.saturating_sub(1);
            }
            if result.is_err() {
                continue;
            }
            self.count(c.status, Some(f.ty), f.data_len);
            result = mem
                .write_obj(c.status, GuestAddress(f.status_addr))
                .map_err(|e| DeviceFault(format!("status write: {e}")))
                .and_then(|()| {
                    queue
                        .add_used(mem, f.head, c.written.saturating_add(1))
                        .map_err(|e| DeviceFault(format!("add_used: {e:?}")))
                });
            used = true;
        }
        self.reaped = done;
        wake.dedup();
        for q in wake {
            if let Some(w) = self.per_queue.get(q).and_then(|q| q.waker.as_ref())
                && let Err(e) = w.write(1)
            {
                tracing::warn!(error = %e, queue = q, "virtio-blk queue wake-up failed");
            }
        }
        result.map(|()| used)
    }
}

impl VirtioDevice for VirtioBlock {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        self.features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        super::read_config_space(&self.config, offset, data);
    }

    fn set_queue_waker(&mut self, index: usize, waker: EventFd) {
        if index == 0
            && let Ok(w) = waker.try_clone()
        {
            self.backend.set_waker(w);
        }
        if let Some(q) = self.per_queue.get_mut(index) {
            q.waker = Some(waker);
        }
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        mem: &GuestMemory,
    ) -> Result<bool, DeviceFault> {
        let mut used = self.complete_ready(index, queue, mem)?;
        // At most a queue's worth in flight, so a guest that keeps adding
        // requests cannot grow the table or monopolise the device thread;
        // completions wake the thread (the backend's waker) to take more.
        while self
            .per_queue
            .get(index)
            .is_some_and(|q| q.in_flight < usize::from(queue.size()))
        {
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let mut segs = Vec::new();
            for d in chain {
                if segs.len() == MAX_SEGMENTS {
                    return Err(DeviceFault("descriptor chain too long".into()));
                }
                segs.push(Segment {
                    addr: d.addr().0,
                    len: d.len(),
                    writable: d.is_write_only(),
                });
            }
            if let Some(len) = self.submit_chain(index, head, &segs, mem)? {
                queue
                    .add_used(mem, head, len)
                    .map_err(|e| DeviceFault(format!("add_used: {e:?}")))?;
                used = true;
            }
        }
        Ok(self.complete_ready(index, queue, mem)? || used)
    }

    fn quiesce(&mut self, queues: &mut [Queue], mem: &GuestMemory) -> Result<bool, DeviceFault> {
        if self.in_flight.is_empty() {
            return Ok(false);
        }
        // Wait for the backend, then complete every request on its own
        // queue: the first pass hands completions to their queues' stashes,
        // each queue's pass puts its own on the used ring.
        let mut done = Vec::new();
        self.backend.drain(&mut done);
        self.reaped.append(&mut done);
        let mut used = false;
        for (i, q) in queues.iter_mut().enumerate() {
            used |= self.complete_ready(i, q, mem)?;
        }
        if !self.in_flight.is_empty() {
            return Err(DeviceFault(format!(
                "{} request(s) still in flight after draining the backend",
                self.in_flight.len()
            )));
        }
        Ok(used)
    }

    fn save_state(&self) -> Result<DeviceState, DeviceFault> {
        if !self.in_flight.is_empty() {
            return Err(DeviceFault(format!(
                "cannot save a virtio-blk device with {} request(s) in flight",
                self.in_flight.len()
            )));
        }
        Ok(DeviceState::Block {
            sectors: self.disk.sectors,
            read_only: self.disk.read_only,
            features: self.features,
            queues: self.queue_sizes.len() as u16,
        })
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), DeviceFault> {
        let DeviceState::Block {
            sectors,
            read_only,
            features,
            queues,
        } = state
        else {
            return Err(DeviceFault(format!(
                "a virtio-blk device cannot load {state:?}"
            )));
        };
        let mine = self.queue_sizes.len() as u16;
        let mismatch = if *sectors != self.disk.sectors {
            Some(format!(
                "the snapshot's disk has {sectors} sectors, this backend {}",
                self.disk.sectors
            ))
        } else if *read_only != self.disk.read_only {
            Some(format!(
                "the snapshot's disk is {}, this backend {}",
                if *read_only { "read-only" } else { "writable" },
                if self.disk.read_only {
                    "read-only"
                } else {
                    "writable"
                }
            ))
        } else if *queues != mine {
            Some(format!(
                "the snapshot's disk has {queues} queue(s), this one {mine}"
            ))
        } else if *features != self.features {
            Some(format!(
                "the snapshot's disk offered features {features:#x}, this backend {:#x}",
                self.features
            ))
        } else {
            None
        };
        match mismatch {
            Some(m) => Err(DeviceFault(m)),
            None => Ok(()),
        }
    }

    fn reset(&mut self) {
        // The backend may still be filling guest buffers: wait for it, then
        // forget the requests without touching the (reset) rings.
        let mut done = Vec::new();
        self.backend.drain(&mut done);
        self.in_flight.clear();
        self.reaped.clear();
        for q in &mut self.per_queue {
            q.in_flight = 0;
            q.stash.clear();
        }
    }
}
