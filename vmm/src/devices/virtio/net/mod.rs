// SPDX-License-Identifier: Apache-2.0
//! virtio-net over a [`NetBackend`]: one receive and one transmit queue,
//! checksum and TSO offloads passed through to the backend when it speaks
//! the virtio-net header (a tap does), mergeable receive buffers, and the
//! MAC address and link status in the configuration space.
//!
//! Everything the guest hands over is checked. A transmit chain that is
//! not a well-formed frame (a device-writable descriptor, shorter than the
//! headers, longer than [`MAX_FRAME`], or asking for an offload that was
//! not negotiated) is dropped and counted; an address outside guest memory
//! faults the device (`DEVICE_NEEDS_RESET`). Host memory stays bounded: a
//! guest that stops giving receive buffers leaves frames in the backend
//! (the tap's own queue drops them), the device holds at most one, and each
//! pass over a queue takes at most a queue's worth of frames before
//! yielding to the other queues.

pub mod backend;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use virtio_bindings::virtio_net::*;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

pub use self::backend::{
    DgramBackend, MAX_FRAME, NetBackend, TapBackend, VNET_HDR_LEN, check_tap_name, offload,
};
use super::{DeviceFault, DeviceState, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX, VirtioDevice};
use crate::memory::GuestMemory;

/// virtio device id of a network card.
pub const DEVICE_TYPE_NET: u32 = 1;
/// Queue size offered for each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Index of the receive queue.
pub const RX_QUEUE: usize = 0;
/// Index of the transmit queue.
pub const TX_QUEUE: usize = 1;

/// Per-device counters, readable while the VM runs.
#[derive(Debug, Default)]
pub struct NetStats {
    /// Frames delivered to the guest.
    pub rx_frames: AtomicU64,
    /// Bytes delivered to the guest (headers excluded).
    pub rx_bytes: AtomicU64,
    /// Frames from the backend dropped (no buffer large enough).
    pub rx_dropped: AtomicU64,
    /// Frames sent by the guest.
    pub tx_frames: AtomicU64,
    /// Bytes sent by the guest (headers excluded).
    pub tx_bytes: AtomicU64,
    /// Frames the backend could not take.
    pub tx_dropped: AtomicU64,
    /// Malformed transmit chains dropped.
    pub tx_errors: AtomicU64,
}

/// A MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// Parses `aa:bb:cc:dd:ee:ff` (or with `-`); refuses multicast addresses.
    pub fn parse(s: &str) -> Result<MacAddr, String> {
        let parts: Vec<&str> = s.split([':', '-']).collect();
        if parts.len() != 6 {
            return Err(format!("MAC address {s:?} must have six hex bytes"));
        }
        let mut mac = [0u8; 6];
        for (b, p) in mac.iter_mut().zip(&parts) {
            if p.len() != 2 {
                return Err(format!("MAC address {s:?}: {p:?} is not one hex byte"));
            }
            // from_str_radix alone would take a sign ("+a").
            if !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!("MAC address {s:?}: {p:?} is not hex"));
            }
            *b = u8::from_str_radix(p, 16)
                .map_err(|_| format!("MAC address {s:?}: {p:?} is not hex"))?;
        }
        if mac[0] & 1 != 0 {
            return Err(format!("MAC address {s:?} is a multicast address"));
        }
        Ok(MacAddr(mac))
    }

    /// A locally administered unicast address derived from `seed` (stable
    /// for one VM name and card index).
    pub fn derived(seed: &str) -> MacAddr {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in seed.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        let b = h.to_le_bytes();
        MacAddr([0x02, b[0], b[1], b[2], b[3], b[4]])
    }
}

impl std::fmt::Display for MacAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// One guest buffer segment.
#[derive(Debug, Clone, Copy)]
struct Seg {
    addr: u64,
    len: u32,
}

/// A virtio-net device.
pub struct VirtioNet {
    backend: Arc<dyn NetBackend>,
    mac: MacAddr,
    features: u64,
    acked: u64,
    config: [u8; 10],
    stats: Arc<NetStats>,
    queue_sizes: [u16; 2],
    wakers: [Option<EventFd>; 2],
    /// A frame read from the backend that no buffer has taken yet: bytes
    /// `[0, pending)` of `rx_buf`, vnet header included.
    pending: Option<usize>,
    rx_buf: Vec<u8>,
    tx_buf: Vec<u8>,
    segs: Vec<Seg>,
}

impl std::fmt::Debug for VirtioNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioNet")
            .field("backend", &self.backend.name())
            .field("mac", &self.mac.to_string())
            .finish_non_exhaustive()
    }
}

/// What happened to the pending receive frame.
enum Rx {
    Delivered,
    Dropped,
    NoBuffer,
}

impl VirtioNet {
    /// A card with address `mac` over `backend`.
    pub fn new(backend: Arc<dyn NetBackend>, mac: MacAddr) -> Self {
        let mut features = (1u64 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_NET_F_MAC)
            | (1 << VIRTIO_NET_F_STATUS)
            | (1 << VIRTIO_NET_F_MRG_RXBUF);
        if backend.vnet_hdr() {
            features |= (1 << VIRTIO_NET_F_CSUM)
                | (1 << VIRTIO_NET_F_GUEST_CSUM)
                | (1 << VIRTIO_NET_F_GUEST_TSO4)
                | (1 << VIRTIO_NET_F_GUEST_TSO6)
                | (1 << VIRTIO_NET_F_GUEST_ECN)
                | (1 << VIRTIO_NET_F_HOST_TSO4)
                | (1 << VIRTIO_NET_F_HOST_TSO6)
                | (1 << VIRTIO_NET_F_HOST_ECN);
        }
        let mut config = [0u8; 10];
        config[..6].copy_from_slice(&mac.0);
        config[6..8].copy_from_slice(&(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
        config[8..10].copy_from_slice(&1u16.to_le_bytes());
        VirtioNet {
            backend,
            mac,
            features,
            acked: 0,
            config,
            stats: Arc::default(),
            queue_sizes: [QUEUE_SIZE; 2],
            wakers: [None, None],
            pending: None,
            rx_buf: vec![0; MAX_FRAME],
            tx_buf: Vec::with_capacity(MAX_FRAME),
            segs: Vec::new(),
        }
    }

    /// Shared counters.
    pub fn stats(&self) -> Arc<NetStats> {
        self.stats.clone()
    }

    /// The card's MAC address.
    pub fn mac(&self) -> MacAddr {
        self.mac
    }

    fn acked(&self, bit: u32) -> bool {
        self.acked & (1u64 << bit) != 0
    }

    fn wake(&self, queue: usize) {
        if let Some(w) = self.wakers.get(queue).and_then(Option::as_ref)
            && let Err(e) = w.write(1)
        {
            tracing::warn!(error = %e, queue, "virtio-net queue wake-up failed");
        }
    }

    /// The tap offload flags matching what the driver accepted.
    fn offload_flags(&self) -> u32 {
        if !self.acked(VIRTIO_NET_F_GUEST_CSUM) {
            return 0;
        }
        let mut f = offload::CSUM;
        if self.acked(VIRTIO_NET_F_GUEST_TSO4) {
            f |= offload::TSO4;
        }
        if self.acked(VIRTIO_NET_F_GUEST_TSO6) {
            f |= offload::TSO6;
        }
        if f & (offload::TSO4 | offload::TSO6) != 0 && self.acked(VIRTIO_NET_F_GUEST_ECN) {
            f |= offload::TSO_ECN;
        }
        f
    }

    /// Reads frames from the backend into the guest's receive buffers.
    fn process_rx(&mut self, queue: &mut Queue, mem: &GuestMemory) -> Result<bool, DeviceFault> {
        let mut used = false;
        let budget = usize::from(queue.size());
        for _ in 0..budget {
            if self.pending.is_none() {
                let off = if self.backend.vnet_hdr() {
                    0
                } else {
                    VNET_HDR_LEN
                };
                match self.backend.recv(&mut self.rx_buf[off..]) {
                    Ok(Some(n)) => {
                        if off > 0 {
                            self.rx_buf[..VNET_HDR_LEN].fill(0);
                        }
                        if n + off < VNET_HDR_LEN {
                            self.stats.rx_dropped.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        self.pending = Some(n + off);
                    }
                    Ok(None) => return Ok(used),
                    Err(e) => {
                        tracing::warn!(backend = %self.backend.name(), error = %e, "virtio-net receive failed");
                        return Ok(used);
                    }
                }
            }
            match self.deliver(queue, mem)? {
                Rx::Delivered => {
                    used = true;
                    self.pending = None;
                }
                Rx::Dropped => {
                    self.stats.rx_dropped.fetch_add(1, Ordering::Relaxed);
                    self.pending = None;
                }
                Rx::NoBuffer => return Ok(used),
            }
        }
        // A queue's worth done: let the other queues run, then come back.
        self.wake(RX_QUEUE);
        Ok(used)
    }

    /// Puts the pending frame into one receive chain (or several with
    /// `MRG_RXBUF`).
    fn deliver(&mut self, queue: &mut Queue, mem: &GuestMemory) -> Result<Rx, DeviceFault> {
        let Some(len) = self.pending else {
            return Ok(Rx::Dropped);
        };
        let merge = self.acked(VIRTIO_NET_F_MRG_RXBUF);
        let start = queue.next_avail();
        // Each chain: (head, first segment, segment count, capacity).
        let mut chains: Vec<(u16, usize, usize, u64)> = Vec::new();
        let mut capacity = 0u64;
        self.segs.clear();
        while capacity < len as u64 {
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                break;
            };
            let head = chain.head_index();
            let first = self.segs.len();
            let mut cap = 0u64;
            for d in chain {
                if !d.is_write_only() {
                    return Err(DeviceFault(
                        "receive chain has a device-readable descriptor".into(),
                    ));
                }
                cap += u64::from(d.len());
                self.segs.push(Seg {
                    addr: d.addr().0,
                    len: d.len(),
                });
            }
            chains.push((head, first, self.segs.len() - first, cap));
            capacity += cap;
            if !merge || chains.len() >= usize::from(queue.size()) {
                break;
            }
        }
        if chains.is_empty() {
            return Ok(Rx::NoBuffer);
        }
        if capacity < len as u64 {
            // Too small for this frame: give the chains back, drop the frame.
            queue.set_next_avail(start);
            return Ok(Rx::Dropped);
        }
        let nbuf = if merge { chains.len() as u16 } else { 1 };
        self.rx_buf[10..12].copy_from_slice(&nbuf.to_le_bytes());
        let mut off = 0usize;
        for &(head, first, count, _) in &chains {
            let mut written = 0u32;
            for s in &self.segs[first..first + count] {
                if off >= len {
                    break;
                }
                let n = (s.len as usize).min(len - off);
                mem.write_slice(&self.rx_buf[off..off + n], GuestAddress(s.addr))
                    .map_err(|e| DeviceFault(format!("receive buffer: {e}")))?;
                off += n;
                written += n as u32;
            }
            queue
                .add_used(mem, head, written)
                .map_err(|e| DeviceFault(format!("add_used: {e:?}")))?;
        }
        self.stats.rx_frames.fetch_add(1, Ordering::Relaxed);
        self.stats
            .rx_bytes
            .fetch_add((len - VNET_HDR_LEN) as u64, Ordering::Relaxed);
        Ok(Rx::Delivered)
    }

    /// Whether a transmit header asks only for what was negotiated.
    fn tx_header_ok(&self, hdr: &[u8]) -> bool {
        let flags = u32::from(hdr[0]);
        let gso = u32::from(hdr[1]);
        if flags & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0 && !self.acked(VIRTIO_NET_F_CSUM) {
            return false;
        }
        let ecn = gso & VIRTIO_NET_HDR_GSO_ECN != 0;
        if ecn && !self.acked(VIRTIO_NET_F_HOST_ECN) {
            return false;
        }
        match gso & !VIRTIO_NET_HDR_GSO_ECN {
            VIRTIO_NET_HDR_GSO_NONE => !ecn,
            VIRTIO_NET_HDR_GSO_TCPV4 => self.acked(VIRTIO_NET_F_HOST_TSO4),
            VIRTIO_NET_HDR_GSO_TCPV6 => self.acked(VIRTIO_NET_F_HOST_TSO6),
            _ => false,
        }
    }

    /// Sends what the guest queued for transmission.
    fn process_tx(&mut self, queue: &mut Queue, mem: &GuestMemory) -> Result<bool, DeviceFault> {
        let mut used = false;
        for _ in 0..usize::from(queue.size()) {
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
                return Ok(used);
            };
            let head = chain.head_index();
            self.tx_buf.clear();
            let mut bad = None;
            for d in chain {
                if d.is_write_only() {
                    bad = Some("a device-writable descriptor");
                    break;
                }
                let n = d.len() as usize;
                let at = self.tx_buf.len();
                if at + n > MAX_FRAME {
                    bad = Some("a frame longer than 64 KiB");
                    break;
                }
                self.tx_buf.resize(at + n, 0);
                mem.read_slice(&mut self.tx_buf[at..], d.addr())
                    .map_err(|e| DeviceFault(format!("transmit buffer: {e}")))?;
            }
            if bad.is_none() && self.tx_buf.len() < VNET_HDR_LEN + 14 {
                bad = Some("a frame shorter than its headers");
            }
            if bad.is_none() && !self.tx_header_ok(&self.tx_buf[..VNET_HDR_LEN]) {
                bad = Some("an offload that was not negotiated");
            }
            match bad {
                Some(why) => {
                    tracing::debug!(why, "dropped a malformed virtio-net transmit chain");
                    self.stats.tx_errors.fetch_add(1, Ordering::Relaxed);
                }
                None => {
                    let frame = if self.backend.vnet_hdr() {
                        &self.tx_buf[..]
                    } else {
                        &self.tx_buf[VNET_HDR_LEN..]
                    };
                    match self.backend.send(frame) {
                        Ok(true) => {
                            self.stats.tx_frames.fetch_add(1, Ordering::Relaxed);
                            self.stats.tx_bytes.fetch_add(
                                (self.tx_buf.len() - VNET_HDR_LEN) as u64,
                                Ordering::Relaxed,
                            );
                        }
                        Ok(false) => {
                            self.stats.tx_dropped.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            self.stats.tx_dropped.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(backend = %self.backend.name(), error = %e, "virtio-net send failed");
                        }
                    }
                }
            }
            queue
                .add_used(mem, head, 0)
                .map_err(|e| DeviceFault(format!("add_used: {e:?}")))?;
            used = true;
        }
        self.wake(TX_QUEUE);
        Ok(used)
    }
}

impl VirtioDevice for VirtioNet {
    fn device_type(&self) -> u32 {
        DEVICE_TYPE_NET
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

    fn activate(&mut self, acked_features: u64) {
        self.acked = acked_features;
        if self.backend.vnet_hdr()
            && let Err(e) = self.backend.set_offloads(self.offload_flags())
        {
            tracing::warn!(backend = %self.backend.name(), error = %e, "cannot set tap offloads");
        }
        // Frames may have waited while the driver was not ready.
        self.wake(RX_QUEUE);
    }

    fn process_queue(
        &mut self,
        index: usize,
        queue: &mut Queue,
        mem: &GuestMemory,
    ) -> Result<bool, DeviceFault> {
        match index {
            RX_QUEUE => self.process_rx(queue, mem),
            TX_QUEUE => self.process_tx(queue, mem),
            _ => Ok(false),
        }
    }

    fn wants_buffers(&self, index: usize) -> bool {
        index != RX_QUEUE || self.pending.is_some()
    }

    fn reset(&mut self) {
        self.pending = None;
        self.acked = 0;
        if self.backend.vnet_hdr()
            && let Err(e) = self.backend.set_offloads(0)
        {
            tracing::warn!(backend = %self.backend.name(), error = %e, "cannot clear tap offloads");
        }
    }

    fn set_queue_waker(&mut self, index: usize, waker: EventFd) {
        if let Some(w) = self.wakers.get_mut(index) {
            *w = Some(waker);
        }
    }

    fn event_sources(&self) -> Vec<(std::os::fd::RawFd, usize)> {
        vec![(self.backend.rx_fd(), RX_QUEUE)]
    }

    fn save_state(&self) -> Result<DeviceState, DeviceFault> {
        Ok(DeviceState::Net {
            mac: self.mac.0,
            features: self.features,
            acked: self.acked,
            pending_frame: self
                .pending
                .map(|n| self.rx_buf.get(..n).unwrap_or_default().to_vec()),
        })
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), DeviceFault> {
        let DeviceState::Net {
            mac,
            features,
            acked,
            pending_frame,
        } = state
        else {
            return Err(DeviceFault(format!(
                "a virtio-net card cannot load {state:?}"
            )));
        };
        if *mac != self.mac.0 {
            return Err(DeviceFault(format!(
                "the snapshot's card has MAC {}, this one {}",
                MacAddr(*mac),
                self.mac
            )));
        }
        if *features != self.features {
            return Err(DeviceFault(format!(
                "the snapshot's card offered features {features:#x}, this backend {:#x}",
                self.features
            )));
        }
        if acked & !self.features != 0 {
            return Err(DeviceFault(format!(
                "the snapshot's driver accepted features {acked:#x} the card does not offer"
            )));
        }
        self.pending = match pending_frame {
            Some(f) if f.len() > self.rx_buf.len() => {
                return Err(DeviceFault(format!(
                    "the snapshot's pending frame has {} bytes, more than {}",
                    f.len(),
                    self.rx_buf.len()
                )));
            }
            Some(f) => {
                self.rx_buf[..f.len()].copy_from_slice(f);
                Some(f.len())
            }
            None => None,
        };
        self.acked = *acked;
        Ok(())
    }
}
