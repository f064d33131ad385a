// SPDX-License-Identifier: Apache-2.0
//! virtio devices over the virtio-mmio (version 2) transport.

pub mod block;
pub mod mmio;
pub mod net;
#[doc(hidden)]
pub mod test_utils;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use serde::{Deserialize, Serialize};
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

/// What a device model keeps between requests, for snapshots. Requests in
/// flight are not part of it: [`VirtioDevice::quiesce`] completes them first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
#[non_exhaustive]
pub enum DeviceState {
    /// A device that keeps nothing.
    Stateless,
    /// virtio-blk: the disk's identity as the guest saw it. The data lives
    /// in the backend, which the restored VM re-attaches.
    Block {
        /// Capacity in 512-byte sectors.
        sectors: u64,
        /// Whether the disk is read-only.
        read_only: bool,
        /// Feature bits offered.
        features: u64,
        /// Request queues.
        queues: u16,
    },
    /// virtio-net.
    Net {
        /// The card's MAC address.
        mac: [u8; 6],
        /// Feature bits offered.
        features: u64,
        /// Feature bits the driver accepted.
        acked: u64,
        /// A received frame (vnet header included) no guest buffer has
        /// taken yet.
        pending_frame: Option<Vec<u8>>,
    },
}

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
    /// Completes every request in flight (waiting for the backend) and
    /// puts the completions on `queues`' used rings, so that nothing is
    /// left outside guest memory and [`VirtioDevice::save_state`]. Returns
    /// whether used buffers were added. Called with the VM paused.
    fn quiesce(&mut self, queues: &mut [Queue], mem: &GuestMemory) -> Result<bool, DeviceFault> {
        let _ = (queues, mem);
        Ok(false)
    }
    /// The device's own state (after [`VirtioDevice::quiesce`]).
    fn save_state(&self) -> Result<DeviceState, DeviceFault> {
        Ok(DeviceState::Stateless)
    }
    /// Loads a saved state into a device built from the same config.
    /// Refuses a state that does not describe this device (another
    /// kind, size or address).
    fn restore_state(&mut self, state: &DeviceState) -> Result<(), DeviceFault> {
        match state {
            DeviceState::Stateless => Ok(()),
            other => Err(DeviceFault(format!(
                "a stateless device cannot load {other:?}"
            ))),
        }
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

    /// Sets InterruptStatus to `bits` without raising the line (restore).
    pub fn set_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
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
