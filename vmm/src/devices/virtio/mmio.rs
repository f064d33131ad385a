// SPDX-License-Identifier: Apache-2.0
//! The virtio-mmio transport, version 2 (virtio 1.x "modern" register layout).
//!
//! Every guest access is checked: registers take aligned 32-bit accesses
//! only, queue registers are frozen once a queue is ready, unknown offsets
//! and bad sizes are dropped with a rate-limited warning, and a device fault
//! sets `DEVICE_NEEDS_RESET` (plus a configuration interrupt) instead of
//! touching the host.

use std::num::Wrapping;
use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::VIRTIO_RING_F_EVENT_IDX;
use super::{
    DeviceFault, DeviceState, INT_CONFIG, INT_VRING, VIRTIO_F_VERSION_1, VirtioDevice,
    VirtioInterrupt,
};
use crate::devices::{BusDevice, RateLimitedWarn};
use crate::memory::GuestMemory;

/// "virt" in little endian.
pub const MMIO_MAGIC: u32 = 0x7472_6976;
/// Transport version implemented.
pub const MMIO_VERSION: u32 = 2;
/// Vendor id reported to the guest ("SHEA").
pub const VENDOR_ID: u32 = 0x4145_4853;
/// Offset of the QueueNotify register (the ioeventfd address).
pub const QUEUE_NOTIFY: u64 = 0x50;

/// Device status bits.
pub mod status {
    /// Guest noticed the device.
    pub const ACKNOWLEDGE: u32 = 1;
    /// Guest has a driver.
    pub const DRIVER: u32 = 2;
    /// Driver is ready.
    pub const DRIVER_OK: u32 = 4;
    /// Feature negotiation complete.
    pub const FEATURES_OK: u32 = 8;
    /// The device hit an error and needs a reset.
    pub const NEEDS_RESET: u32 = 0x40;
    /// The driver gave up.
    pub const FAILED: u32 = 0x80;
}

/// One virtqueue's configuration and position, for snapshots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnapshot {
    /// Largest size the device offers.
    pub max_size: u16,
    /// Size the driver chose.
    pub size: u16,
    /// QueueReady.
    pub ready: bool,
    /// Guest address of the descriptor table.
    pub desc_table: u64,
    /// Guest address of the available ring.
    pub avail_ring: u64,
    /// Guest address of the used ring.
    pub used_ring: u64,
    /// Next available-ring index the device will take.
    pub next_avail: u16,
    /// Next used-ring index the device will fill.
    pub next_used: u16,
    /// Whether VIRTIO_RING_F_EVENT_IDX is in use.
    pub event_idx: bool,
}

impl From<QueueState> for QueueSnapshot {
    fn from(q: QueueState) -> Self {
        QueueSnapshot {
            max_size: q.max_size,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx: q.event_idx_enabled,
        }
    }
}

impl From<&QueueSnapshot> for QueueState {
    fn from(q: &QueueSnapshot) -> Self {
        QueueState {
            max_size: q.max_size,
            next_avail: q.next_avail,
            next_used: q.next_used,
            event_idx_enabled: q.event_idx,
            size: q.size,
            ready: q.ready,
            desc_table: q.desc_table,
            avail_ring: q.avail_ring,
            used_ring: q.used_ring,
        }
    }
}

/// A virtio-mmio device's transport registers, queues and device state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransportState {
    /// Device name (`virtio-blk0`, `virtio-net0`, ...).
    pub name: String,
    /// virtio device id.
    pub device_type: u32,
    /// DeviceFeaturesSel.
    pub device_features_sel: u32,
    /// DriverFeaturesSel.
    pub driver_features_sel: u32,
    /// Features the driver wrote.
    pub acked_features: u64,
    /// QueueSel.
    pub queue_sel: u32,
    /// Status.
    pub status: u32,
    /// ConfigGeneration.
    pub config_generation: u32,
    /// InterruptStatus.
    pub interrupt_status: u32,
    /// Every queue, in order.
    pub queues: Vec<QueueSnapshot>,
    /// The device model's own state.
    pub device: DeviceState,
}

/// A virtio device behind a virtio-mmio register window.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemory,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    interrupt: VirtioInterrupt,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    queue_sel: u32,
    status: u32,
    config_generation: u32,
    warn: RateLimitedWarn,
    name: String,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("name", &self.name)
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl MmioTransport {
    /// Wraps `device`; one notification eventfd is created per queue.
    pub fn new(
        name: String,
        device: Box<dyn VirtioDevice>,
        mem: GuestMemory,
        interrupt: VirtioInterrupt,
    ) -> std::io::Result<Self> {
        let mut device = device;
        let mut queues = Vec::new();
        let mut queue_evts = Vec::new();
        for &max in device.queue_max_sizes() {
            queues.push(Queue::new(max).map_err(|e| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{e:?}"))
            })?);
            queue_evts.push(EventFd::new(libc::EFD_NONBLOCK)?);
        }
        for (i, evt) in queue_evts.iter().enumerate() {
            device.set_queue_waker(i, evt.try_clone()?);
        }
        Ok(MmioTransport {
            device,
            mem,
            queues,
            queue_evts,
            interrupt,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            queue_sel: 0,
            status: 0,
            config_generation: 0,
            warn: RateLimitedWarn::default(),
            name,
        })
    }

    /// The per-queue notification eventfds (registered as ioeventfds).
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// Host descriptors whose readiness means queue work (see
    /// [`VirtioDevice::event_sources`]).
    pub fn event_sources(&self) -> Vec<(std::os::fd::RawFd, usize)> {
        self.device.event_sources()
    }

    /// Current device status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The virtio device id.
    pub fn device_type(&self) -> u32 {
        self.device.device_type()
    }

    fn live(&self) -> bool {
        self.status & status::DRIVER_OK != 0 && self.status & status::NEEDS_RESET == 0
    }

    /// Completes the device's requests in flight onto the used rings (and
    /// interrupts the driver if it wants to hear about them), so the
    /// state is entirely in registers, rings and [`TransportState`].
    /// Called with the VM paused.
    pub fn quiesce(&mut self) {
        if !self.live() {
            return;
        }
        match self.device.quiesce(&mut self.queues, &self.mem) {
            Ok(false) => {}
            Ok(true) => {
                let mut notify = false;
                for q in self.queues.iter_mut().filter(|q| q.ready()) {
                    notify |= q.needs_notification(&self.mem).unwrap_or(true);
                }
                if notify {
                    self.interrupt.trigger(INT_VRING);
                }
            }
            Err(e) => self.fault(&e),
        }
    }

    /// The transport's and device's state (call [`MmioTransport::quiesce`] first).
    pub fn save_state(&self) -> Result<TransportState, DeviceFault> {
        Ok(TransportState {
            name: self.name.clone(),
            device_type: self.device.device_type(),
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            acked_features: self.acked_features,
            queue_sel: self.queue_sel,
            status: self.status,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
            queues: self.queues.iter().map(|q| q.state().into()).collect(),
            device: self.device.save_state()?,
        })
    }

    /// Loads `state` into a freshly built transport of the same device.
    /// Nothing runs: [`MmioTransport::wake_after_restore`] does, once the
    /// interrupt controllers are loaded too.
    pub fn restore_state(&mut self, state: &TransportState) -> Result<(), DeviceFault> {
        if state.name != self.name || state.device_type != self.device.device_type() {
            return Err(DeviceFault(format!(
                "the snapshot has device {} (type {}) here, the config {} (type {})",
                state.name,
                state.device_type,
                self.name,
                self.device.device_type()
            )));
        }
        if state.queues.len() != self.queues.len() {
            return Err(DeviceFault(format!(
                "the snapshot's {} has {} queue(s), the config's {}",
                state.name,
                state.queues.len(),
                self.queues.len()
            )));
        }
        let mut queues = Vec::with_capacity(self.queues.len());
        for (i, (saved, q)) in state.queues.iter().zip(&self.queues).enumerate() {
            if saved.max_size != q.max_size() {
                return Err(DeviceFault(format!(
                    "queue {i}: the snapshot's maximum size is {}, the device's {}",
                    saved.max_size,
                    q.max_size()
                )));
            }
            let restored = Queue::try_from(QueueState::from(saved))
                .map_err(|e| DeviceFault(format!("queue {i}: {e:?}")))?;
            if restored.ready() && !restored.is_valid(&self.mem) {
                return Err(DeviceFault(format!(
                    "queue {i}: its rings are not inside guest memory"
                )));
            }
            queues.push(restored);
        }
        if state.acked_features & !self.device.features() != 0 {
            return Err(DeviceFault(format!(
                "the snapshot's driver accepted features {:#x} the device does not offer",
                state.acked_features
            )));
        }
        self.device.restore_state(&state.device)?;
        self.queues = queues;
        self.device_features_sel = state.device_features_sel;
        self.driver_features_sel = state.driver_features_sel;
        self.acked_features = state.acked_features;
        self.queue_sel = state.queue_sel;
        self.status = state.status;
        self.config_generation = state.config_generation;
        self.interrupt.set_status(state.interrupt_status);
        if self.live() {
            self.device.activate(self.acked_features);
        }
        Ok(())
    }

    /// After a restore: raises the interrupt if one was pending and makes
    /// the device thread look at every ready queue once (a notification
    /// the guest sent while the source was pausing is in no eventfd here).
    pub fn wake_after_restore(&self) {
        if !self.live() {
            return;
        }
        if self.interrupt.status() != 0 {
            self.interrupt.trigger(0);
        }
        for (q, evt) in self.queues.iter().zip(&self.queue_evts) {
            if q.ready() {
                let _ = evt.write(1);
            }
        }
    }

    fn bad_access(&mut self, what: &str, offset: u64, len: usize) {
        if let Some(suppressed) = self.warn.check() {
            tracing::warn!(
                device = %self.name,
                offset = format_args!("{offset:#x}"),
                len,
                suppressed,
                "ignored bad virtio-mmio {what}"
            );
        }
    }

    fn fault(&mut self, e: &DeviceFault) {
        if self.status & status::NEEDS_RESET == 0 {
            tracing::warn!(device = %self.name, error = %e, "virtio device needs reset");
            self.status |= status::NEEDS_RESET;
            self.interrupt.trigger(INT_CONFIG);
        }
    }

    fn reset(&mut self) {
        self.device.reset();
        for q in &mut self.queues {
            q.reset();
        }
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.acked_features = 0;
        self.queue_sel = 0;
        self.status = 0;
        self.interrupt.ack(u32::MAX);
    }

    fn selected(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    /// Processes queue `index` after a notification (from the device thread).
    pub fn notify(&mut self, index: usize) {
        if self.status & status::DRIVER_OK == 0 || self.status & status::NEEDS_RESET != 0 {
            return;
        }
        match self.process(index) {
            Ok(interrupt) => {
                if interrupt {
                    self.interrupt.trigger(INT_VRING);
                }
            }
            Err(e) => self.fault(&e),
        }
    }

    /// Runs the device on a queue; returns whether to interrupt the driver.
    fn process(&mut self, index: usize) -> Result<bool, DeviceFault> {
        let Some(queue) = self.queues.get_mut(index) else {
            return Ok(false);
        };
        if !queue.ready() {
            return Ok(false);
        }
        // A guest that moved avail.idx more than a queue's length ahead is broken.
        let idx = queue
            .avail_idx(&self.mem, Ordering::Acquire)
            .map_err(|e| DeviceFault(format!("avail ring: {e:?}")))?;
        if (idx - Wrapping(queue.next_avail())).0 > queue.size() {
            return Err(DeviceFault(
                "avail index ahead by more than the queue size".into(),
            ));
        }
        let used = self.device.process_queue(index, queue, &self.mem)?;
        // Re-enable guest notifications (with EVENT_IDX this publishes
        // avail_event = next_avail; without it, it clears NO_NOTIFY). If more
        // buffers arrived meanwhile, or the device stopped after a queue's
        // worth, come back through the eventfd rather than loop here.
        let more = queue
            .enable_notification(&self.mem)
            .map_err(|e| DeviceFault(format!("avail ring: {e:?}")))?;
        if more
            && self.device.wants_buffers(index)
            && let Some(evt) = self.queue_evts.get(index)
        {
            let _ = evt.write(1);
        }
        if !used {
            return Ok(false);
        }
        queue
            .needs_notification(&self.mem)
            .map_err(|e| DeviceFault(format!("used ring: {e:?}")))
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        if v & self.status != self.status {
            // Drivers may only add bits (or write 0).
            self.bad_access("status transition", 0x70, 4);
            return;
        }
        let new = v & !self.status;
        let mut v = v;
        if new & status::FEATURES_OK != 0 {
            let offered = self.device.features();
            let ok = self.acked_features & !offered == 0
                && self.acked_features & (1 << VIRTIO_F_VERSION_1) != 0;
            if !ok {
                v &= !status::FEATURES_OK;
            }
        }
        if new & status::DRIVER_OK != 0 {
            if self.status & status::FEATURES_OK == 0 && v & status::FEATURES_OK == 0 {
                self.status = v & !status::DRIVER_OK;
                self.fault(&DeviceFault("DRIVER_OK before FEATURES_OK".into()));
                return;
            }
            let event_idx = self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
            let mut bad = None;
            for (i, q) in self.queues.iter_mut().enumerate() {
                q.set_event_idx(event_idx);
                if q.ready() && !q.is_valid(&self.mem) {
                    bad = Some(i);
                }
            }
            self.status = v;
            if let Some(i) = bad {
                self.fault(&DeviceFault(format!("queue {i} is not valid")));
                return;
            }
            self.device.activate(self.acked_features);
            return;
        }
        self.status = v;
    }

    fn read_reg(&mut self, offset: u64) -> Option<u32> {
        Some(match offset {
            0x00 => MMIO_MAGIC,
            0x04 => MMIO_VERSION,
            0x08 => self.device.device_type(),
            0x0c => VENDOR_ID,
            0x10 => match self.device_features_sel {
                0 => self.device.features() as u32,
                1 => (self.device.features() >> 32) as u32,
                _ => 0,
            },
            0x34 => self.selected().map_or(0, |q| u32::from(q.max_size())),
            0x44 => self.selected().map_or(0, |q| u32::from(q.ready())),
            0x60 => self.interrupt.status(),
            0x70 => self.status,
            0xfc => self.config_generation,
            _ => return None,
        })
    }

    fn write_reg(&mut self, offset: u64, v: u32) -> bool {
        let driver_ok = self.status & status::DRIVER_OK != 0;
        match offset {
            0x14 => self.device_features_sel = v,
            0x20 => {
                if self.status & status::FEATURES_OK != 0 {
                    return false;
                }
                match self.driver_features_sel {
                    0 => self.acked_features = (self.acked_features & !0xffff_ffff) | u64::from(v),
                    1 => {
                        self.acked_features =
                            (self.acked_features & 0xffff_ffff) | (u64::from(v) << 32)
                    }
                    _ => return false,
                }
            }
            0x24 => self.driver_features_sel = v,
            0x30 => self.queue_sel = v,
            0x38 | 0x44 | 0x80 | 0x84 | 0x90 | 0x94 | 0xa0 | 0xa4 => {
                if driver_ok && offset != 0x44 {
                    return false;
                }
                let Some(q) = self.selected() else {
                    return false;
                };
                if offset != 0x44 && q.ready() {
                    return false;
                }
                match offset {
                    0x38 => {
                        let max = q.max_size();
                        if v == 0 || v > u32::from(max) || !v.is_power_of_two() {
                            return false;
                        }
                        q.set_size(v as u16);
                    }
                    0x44 => q.set_ready(v == 1),
                    0x80 => q.set_desc_table_address(Some(v), None),
                    0x84 => q.set_desc_table_address(None, Some(v)),
                    0x90 => q.set_avail_ring_address(Some(v), None),
                    0x94 => q.set_avail_ring_address(None, Some(v)),
                    0xa0 => q.set_used_ring_address(Some(v), None),
                    _ => q.set_used_ring_address(None, Some(v)),
                }
            }
            QUEUE_NOTIFY => {
                // Normally consumed by the ioeventfd; handle it inline otherwise.
                match self.queue_evts.get(v as usize) {
                    Some(_) => self.notify(v as usize),
                    None => return false,
                }
            }
            0x64 => self.interrupt.ack(v),
            0x70 => self.set_status(v),
            _ => return false,
        }
        true
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= 0x100 {
            self.device.read_config(offset - 0x100, data);
            return;
        }
        let value = if data.len() == 4 && offset.is_multiple_of(4) {
            self.read_reg(offset)
        } else {
            None
        };
        match value {
            Some(v) => data.copy_from_slice(&v.to_le_bytes()),
            None => {
                data.fill(0);
                self.bad_access("read", offset, data.len());
            }
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= 0x100 {
            self.device.write_config(offset - 0x100, data);
            self.config_generation = self.config_generation.wrapping_add(1);
            return;
        }
        let ok = match <[u8; 4]>::try_from(data) {
            Ok(b) if offset.is_multiple_of(4) => self.write_reg(offset, u32::from_le_bytes(b)),
            _ => false,
        };
        if !ok {
            self.bad_access("write", offset, data.len());
        }
    }
}
