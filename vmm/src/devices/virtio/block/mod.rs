// SPDX-License-Identifier: Apache-2.0
//! virtio-blk over a [`BlockBackend`].

pub mod backend;
pub mod request;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use virtio_bindings::virtio_blk::*;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use self::backend::{BlockBackend, SECTOR_SIZE};
use self::request::{DiskInfo, MAX_DISCARD_SEG, MAX_SEGMENTS, Segment};
use super::{DeviceFault, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX, VirtioDevice};
use crate::memory::GuestMemory;

/// Queue size offered.
pub const QUEUE_SIZE: u16 = 256;
/// virtio device id of a block device.
pub const DEVICE_TYPE_BLOCK: u32 = 2;
/// `seg_max` advertised (Linux keeps two descriptors for header and status).
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
/// `size_max` advertised.
pub const SIZE_MAX: u32 = 1 << 20;

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

/// A virtio-blk device.
pub struct VirtioBlock {
    backend: Arc<dyn BlockBackend>,
    disk: DiskInfo,
    features: u64,
    config: [u8; 60],
    bounce: Vec<u8>,
    stats: Arc<BlockStats>,
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
    /// A device serving `backend`.
    pub fn new(backend: Arc<dyn BlockBackend>) -> Self {
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
        let mut config = [0u8; 60];
        let mut put =
            |off: usize, bytes: &[u8]| config[off..off + bytes.len()].copy_from_slice(bytes);
        put(0, &sectors.to_le_bytes());
        put(8, &SIZE_MAX.to_le_bytes());
        put(12, &SEG_MAX.to_le_bytes());
        put(20, &(SECTOR_SIZE as u32).to_le_bytes());
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
            bounce: Vec::new(),
            stats: Arc::default(),
        }
    }

    /// Shared counters.
    pub fn stats(&self) -> Arc<BlockStats> {
        self.stats.clone()
    }

    /// Handles one descriptor chain given as segments; returns the number of
    /// bytes written to guest memory including the status byte.
    pub fn handle_chain(
        &mut self,
        segs: &[Segment],
        mem: &GuestMemory,
    ) -> Result<u32, DeviceFault> {
        let framed =
            request::parse(segs, mem, &self.disk).map_err(|e| DeviceFault(e.to_string()))?;
        let (status, written) = match &framed.request {
            Ok(req) => {
                let (st, w) = request::execute(
                    req,
                    mem,
                    self.backend.as_ref(),
                    &self.disk,
                    &mut self.bounce,
                );
                if st == 0 {
                    let counter = match req.ty {
                        request::RequestType::In => Some(&self.stats.read_bytes),
                        request::RequestType::Out => Some(&self.stats.write_bytes),
                        _ => None,
                    };
                    if let Some(c) = counter {
                        c.fetch_add(req.data_len, Ordering::Relaxed);
                    }
                }
                (st, w)
            }
            Err(e) => {
                tracing::debug!(error = %e, "rejected virtio-blk request");
                (e.status(), 0)
            }
        };
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        if status != 0 {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
        }
        mem.write_obj(status, GuestAddress(framed.status_addr))
            .map_err(|e| DeviceFault(format!("status write: {e}")))?;
        Ok(written + 1)
    }
}

impl VirtioDevice for VirtioBlock {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        self.features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let off = offset as usize;
        match off.checked_add(data.len()) {
            Some(end) if end <= self.config.len() && offset < 64 => {
                data.copy_from_slice(&self.config[off..end])
            }
            _ => data.fill(0),
        }
    }

    fn process_queue(
        &mut self,
        _index: usize,
        queue: &mut Queue,
        mem: &GuestMemory,
    ) -> Result<bool, DeviceFault> {
        let mut used = false;
        // At most one queue's worth per call, so a guest that keeps adding
        // requests cannot monopolise the device thread; the transport
        // re-schedules if more are pending.
        for _ in 0..queue.size() {
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
            let len = self.handle_chain(&segs, mem)?;
            queue
                .add_used(mem, head, len)
                .map_err(|e| DeviceFault(format!("add_used: {e:?}")))?;
            used = true;
        }
        Ok(used)
    }
}
