// SPDX-License-Identifier: Apache-2.0
//! virtio devices over the virtio-mmio (version 2) transport.

pub mod block;
pub mod mmio;
pub mod net;
#[doc(hidden)]
pub mod test_utils;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use crate::memory::GuestMemory;

/// `VIRTIO_F_VERSION_1`.
pub const VIRTIO_F_VERSION_1: u32 = 32;
/// `VIRTIO_RING_F_EVENT_IDX`.
pub const VIRTIO_RING_F_EVENT_IDX: u32 = 29;
/// Interrupt status bit: a used buffer was added.
pub const INT_VRING: u32 = 1;
/// Interrupt status bit: the configuration (or device status) changed.
pub const INT_CONFIG: u32 = 2;

/// Copies `data.len()` bytes at `offset` of a device's configuration
/// space `config` into `data`; an access past its end reads zeros.
pub fn read_config_space(config: &[u8], offset: u64, data: &mut [u8]) {
    let range = usize::try_from(offset)
        .ok()
        .and_then(|off| Some(off..off.checked_add(data.len())?));
    match range.and_then(|r| config.get(r)) {
        Some(bytes) => data.copy_from_slice(bytes),
        None => data.fill(0),
    }
}

/// A device error that stops the device until the driver resets it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DeviceFault(pub String);

/// A virtio device model, independent of the transport.
pub trait VirtioDevice: Send {
    /// The virtio device id (1 = network, 2 = block).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits offered to the driver.
    fn features(&self) -> u64;
    /// Reads the device-specific configuration space.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the configuration space (ignored by default).
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let _ = (offset, data);
    }
    /// Called once the driver set DRIVER_OK, with the negotiated features.
    fn activate(&mut self, acked_features: u64) {
        let _ = acked_features;
    }
    /// Processes what the driver made available on queue `index`. Returns
    /// whether any used buffers were added. An `Err` puts the device in
    /// `DEVICE_NEEDS_RESET`.
    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        mem: &GuestMemory,
    ) -> Result<bool, DeviceFault>;
    /// Returns to the initial state (driver wrote 0 to Status).
    fn reset(&mut self) {}
    /// Gives the device a clone of queue `index`'s notification eventfd, to
    /// write when work completes asynchronously (ignored by default).
    fn set_queue_waker(&mut self, index: usize, waker: vmm_sys_util::eventfd::EventFd) {
        let _ = (index, waker);
    }
    /// Whether the device wants to hear about buffers still waiting on
    /// queue `index` after a pass. True for queues whose buffers are taken
    /// as soon as they come (block requests, network transmit); a receive
    /// queue's buffers wait for host events, so it says true only while a
    /// frame waits for a buffer.
    fn wants_buffers(&self, index: usize) -> bool {
        let _ = index;
        true
    }
    /// Host descriptors that, when readable, mean queue `usize` has work
    /// (a tap with frames waiting). The device thread watches them
    /// edge-triggered and processes the queue on each wake-up.
    fn event_sources(&self) -> Vec<(std::os::fd::RawFd, usize)> {
        Vec::new()
    }
}

/// The interrupt line of one virtio-mmio device: the `InterruptStatus`
/// register plus the irqfd wired to its GSI.
#[derive(Debug, Clone)]
pub struct VirtioInterrupt {
    status: Arc<AtomicU32>,
    irqfd: Arc<EventFd>,
}

impl VirtioInterrupt {
    /// An interrupt raising `irqfd`.
    pub fn new(irqfd: EventFd) -> Self {
        VirtioInterrupt {
            status: Arc::new(AtomicU32::new(0)),
            irqfd: Arc::new(irqfd),
        }
    }

    /// Sets `bits` in InterruptStatus and raises the line.
    pub fn trigger(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            tracing::warn!(error = %e, "cannot signal virtio irqfd");
        }
    }

    /// Current InterruptStatus.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Clears acknowledged bits.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// The irqfd.
    pub fn irqfd(&self) -> &EventFd {
        &self.irqfd
    }
}
