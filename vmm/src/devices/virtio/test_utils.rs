// SPDX-License-Identifier: Apache-2.0
//! A scriptable virtio-mmio *driver* over fake guest memory, for unit tests,
//! property tests and fuzz targets: it plays the guest's side of the
//! transport (register accesses, descriptor tables, avail ring) without KVM.

use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::VirtioInterrupt;
use super::block::VirtioBlock;
use super::block::backend::BlockBackend;
use super::block::seam::AsyncBlockBackend;
use super::mmio::{MmioTransport, status};
use crate::devices::BusDevice;
use crate::memory::GuestMemory;

/// Descriptor table address used by [`Driver::setup_queue`].
pub const DESC: u64 = 0x1_0000;
/// Avail ring address.
pub const AVAIL: u64 = 0x2_0000;
/// Used ring address.
pub const USED: u64 = 0x3_0000;
/// Start of free memory for request buffers.
pub const DATA: u64 = 0x4_0000;

/// One raw split-queue descriptor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawDesc {
    /// Guest address.
    pub addr: u64,
    /// Length.
    pub len: u32,
    /// Flags: 1 = NEXT, 2 = WRITE, 4 = INDIRECT.
    pub flags: u16,
    /// Next index.
    pub next: u16,
}

/// A guest-side driver for one virtio-blk device on a transport.
#[derive(Debug)]
pub struct Driver {
    /// Guest memory.
    pub mem: GuestMemory,
    /// The transport under test.
    pub transport: MmioTransport,
    /// The device's irqfd (readable after an interrupt).
    pub irq: EventFd,
    avail_idx: u16,
    /// Queue size set up.
    pub qsize: u16,
}

impl Driver {
    /// A transport serving `backend` in `mem_size` bytes of fake guest memory.
    pub fn new(backend: Arc<dyn BlockBackend>, mem_size: usize) -> Self {
        Self::with_device(VirtioBlock::new(backend), mem_size)
    }

    /// A transport serving an asynchronous `backend`.
    pub fn new_async(backend: Arc<dyn AsyncBlockBackend>, mem_size: usize) -> Self {
        Self::with_device(VirtioBlock::new_async(backend), mem_size)
    }

    /// A transport serving `dev`.
    pub fn with_device(dev: VirtioBlock, mem_size: usize) -> Self {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), mem_size)]).expect("test memory");
        let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        let interrupt = VirtioInterrupt::new(irq.try_clone().expect("eventfd clone"));
        let transport =
            MmioTransport::new("test-blk".into(), Box::new(dev), mem.clone(), interrupt)
                .expect("transport");
        Driver {
            mem,
            transport,
            irq,
            avail_idx: 0,
            qsize: 0,
        }
    }

    /// 32-bit register write.
    pub fn w(&mut self, off: u64, v: u32) {
        self.transport.write(off, &v.to_le_bytes());
    }

    /// 32-bit register read.
    pub fn r(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.transport.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    /// Negotiates VERSION_1 (plus `extra` feature bits 0..31) and sets FEATURES_OK.
    pub fn negotiate(&mut self, extra: u32) -> bool {
        self.w(0x70, 0);
        self.w(0x70, status::ACKNOWLEDGE);
        self.w(0x70, status::ACKNOWLEDGE | status::DRIVER);
        self.w(0x24, 1);
        self.w(0x20, 1);
        self.w(0x24, 0);
        self.w(0x20, extra);
        self.w(
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        self.r(0x70) & status::FEATURES_OK != 0
    }

    /// Sets up queue 0 at [`DESC`]/[`AVAIL`]/[`USED`] and sets DRIVER_OK.
    pub fn setup_queue(&mut self, qsize: u16) {
        self.w(0x30, 0);
        self.w(0x38, u32::from(qsize));
        for (off, addr) in [(0x80, DESC), (0x90, AVAIL), (0xa0, USED)] {
            self.w(off, addr as u32);
            self.w(off + 4, (addr >> 32) as u32);
        }
        self.w(0x44, 1);
        self.qsize = qsize;
        let s = self.r(0x70);
        self.w(0x70, s | status::DRIVER_OK);
    }

    /// Writes descriptor `i`.
    pub fn set_desc(&self, i: u16, d: RawDesc) {
        let a = DESC + u64::from(i) * 16;
        let _ = self.mem.write_obj(d.addr, GuestAddress(a));
        let _ = self.mem.write_obj(d.len, GuestAddress(a + 8));
        let _ = self.mem.write_obj(d.flags, GuestAddress(a + 12));
        let _ = self.mem.write_obj(d.next, GuestAddress(a + 14));
    }

    /// Makes `head` available and notifies queue 0 (as the ioeventfd would).
    pub fn kick(&mut self, head: u16) {
        let slot = u64::from(self.avail_idx % self.qsize.max(1));
        let _ = self.mem.write_obj(head, GuestAddress(AVAIL + 4 + 2 * slot));
        self.avail_idx = self.avail_idx.wrapping_add(1);
        let _ = self.mem.write_obj(self.avail_idx, GuestAddress(AVAIL + 2));
        self.transport.notify(0);
    }

    /// Sets the avail index directly (to model a lying guest).
    pub fn set_avail_idx(&mut self, idx: u16) {
        self.avail_idx = idx;
        let _ = self.mem.write_obj(idx, GuestAddress(AVAIL + 2));
    }

    /// Plays the device thread until the used ring's index is `want`: on
    /// every wake-up of queue 0's notify eventfd (guest kick or backend
    /// completion) the queue is processed. False if `timeout` passes first.
    pub fn run_until_used(&mut self, want: u16, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while self.used_idx() != want {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            if self.transport.queue_evts()[0].read().is_ok() {
                self.transport.notify(0);
            } else {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        true
    }

    /// The used ring's index.
    pub fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED + 2)).unwrap_or(0)
    }

    /// Used element `i`: (id, len).
    pub fn used_elem(&self, i: u16) -> (u32, u32) {
        let a = USED + 4 + 8 * u64::from(i % self.qsize.max(1));
        (
            self.mem.read_obj(GuestAddress(a)).unwrap_or(0),
            self.mem.read_obj(GuestAddress(a + 4)).unwrap_or(0),
        )
    }

    /// Writes a request header at `at`.
    pub fn header(&self, at: u64, ty: u32, sector: u64) {
        let _ = self.mem.write_obj(ty, GuestAddress(at));
        let _ = self.mem.write_obj(0u32, GuestAddress(at + 4));
        let _ = self.mem.write_obj(sector, GuestAddress(at + 8));
    }

    /// Device status register.
    pub fn status(&mut self) -> u32 {
        self.r(0x70)
    }
}

/// Queue addresses [`NetDriver`] uses: (descriptors, avail, used) per queue.
pub const NET_QUEUES: [(u64, u64, u64); 2] = [
    (0x1_0000, 0x2_0000, 0x3_0000),
    (0x1_8000, 0x2_8000, 0x3_8000),
];

/// A guest-side driver for one virtio-net card (receive queue 0, transmit
/// queue 1) on a transport, over fake guest memory.
#[derive(Debug)]
pub struct NetDriver {
    /// Guest memory.
    pub mem: GuestMemory,
    /// The transport under test.
    pub transport: MmioTransport,
    /// The device's irqfd.
    pub irq: EventFd,
    avail_idx: [u16; 2],
    /// Queue size set up.
    pub qsize: u16,
}

impl NetDriver {
    /// A card over `backend` in `mem_size` bytes of fake guest memory.
    pub fn new(
        backend: Arc<dyn super::net::NetBackend>,
        mac: super::net::MacAddr,
        mem_size: usize,
    ) -> Self {
        Self::with_device(super::net::VirtioNet::new(backend, mac), mem_size)
    }

    /// A transport serving `dev`.
    pub fn with_device(dev: super::net::VirtioNet, mem_size: usize) -> Self {
        let mem = GuestMemory::from_ranges(&[(GuestAddress(0), mem_size)]).expect("test memory");
        let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        let interrupt = VirtioInterrupt::new(irq.try_clone().expect("eventfd clone"));
        let transport =
            MmioTransport::new("test-net".into(), Box::new(dev), mem.clone(), interrupt)
                .expect("transport");
        NetDriver {
            mem,
            transport,
            irq,
            avail_idx: [0; 2],
            qsize: 0,
        }
    }

    /// 32-bit register write.
    pub fn w(&mut self, off: u64, v: u32) {
        self.transport.write(off, &v.to_le_bytes());
    }

    /// 32-bit register read.
    pub fn r(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.transport.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    /// Negotiates VERSION_1 plus `features` (bits 0..31), sets up both
    /// queues with `qsize` entries and sets DRIVER_OK. False if the device
    /// refused the features.
    pub fn start(&mut self, features: u32, qsize: u16) -> bool {
        self.w(0x70, 0);
        self.w(0x70, status::ACKNOWLEDGE | status::DRIVER);
        self.w(0x24, 1);
        self.w(0x20, 1);
        self.w(0x24, 0);
        self.w(0x20, features);
        self.w(
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        if self.r(0x70) & status::FEATURES_OK == 0 {
            return false;
        }
        for (q, (desc, avail, used)) in NET_QUEUES.iter().enumerate() {
            // Fresh rings, as a driver (re)initialising its queues has.
            let _ = self.mem.write_obj(0u32, GuestAddress(*avail));
            let _ = self.mem.write_obj(0u32, GuestAddress(*used));
            self.w(0x30, q as u32);
            self.w(0x38, u32::from(qsize));
            for (off, addr) in [(0x80, *desc), (0x90, *avail), (0xa0, *used)] {
                self.w(off, addr as u32);
                self.w(off + 4, (addr >> 32) as u32);
            }
            self.w(0x44, 1);
        }
        self.avail_idx = [0; 2];
        self.qsize = qsize;
        let s = self.r(0x70);
        self.w(0x70, s | status::DRIVER_OK);
        true
    }

    /// Writes descriptor `i` of queue `q`.
    pub fn set_desc(&self, q: usize, i: u16, d: RawDesc) {
        let a = NET_QUEUES[q % 2].0 + u64::from(i) * 16;
        let _ = self.mem.write_obj(d.addr, GuestAddress(a));
        let _ = self.mem.write_obj(d.len, GuestAddress(a + 8));
        let _ = self.mem.write_obj(d.flags, GuestAddress(a + 12));
        let _ = self.mem.write_obj(d.next, GuestAddress(a + 14));
    }

    /// Makes `head` available on queue `q` without notifying.
    pub fn push(&mut self, q: usize, head: u16) {
        let q = q % 2;
        let avail = NET_QUEUES[q].1;
        let slot = u64::from(self.avail_idx[q] % self.qsize.max(1));
        let _ = self.mem.write_obj(head, GuestAddress(avail + 4 + 2 * slot));
        self.avail_idx[q] = self.avail_idx[q].wrapping_add(1);
        let _ = self
            .mem
            .write_obj(self.avail_idx[q], GuestAddress(avail + 2));
    }

    /// Makes `head` available on queue `q` and notifies it.
    pub fn kick(&mut self, q: usize, head: u16) {
        self.push(q, head);
        self.transport.notify(q);
    }

    /// Plays the device thread once: processes queue `q` as a host event
    /// (tap readable) or a wake-up would.
    pub fn poll(&mut self, q: usize) {
        let _ = self.transport.queue_evts()[q % 2].read();
        self.transport.notify(q);
    }

    /// Used ring index of queue `q`.
    pub fn used_idx(&self, q: usize) -> u16 {
        self.mem
            .read_obj(GuestAddress(NET_QUEUES[q % 2].2 + 2))
            .unwrap_or(0)
    }

    /// Used element `i` of queue `q`: (id, len).
    pub fn used_elem(&self, q: usize, i: u16) -> (u32, u32) {
        let a = NET_QUEUES[q % 2].2 + 4 + 8 * u64::from(i % self.qsize.max(1));
        (
            self.mem.read_obj(GuestAddress(a)).unwrap_or(0),
            self.mem.read_obj(GuestAddress(a + 4)).unwrap_or(0),
        )
    }

    /// Device status register.
    pub fn status(&mut self) -> u32 {
        self.r(0x70)
    }
}

/// One fuzz case for the virtio-net device (the `vmm_virtio_net` fuzz
/// target and a property test run it): the bytes choose the features and
/// queue size, fill both descriptor tables with guest-controlled entries,
/// then script a sequence of receive/transmit buffer offers, frames
/// arriving from the backend, host wake-ups and device resets. Panics only
/// if the device breaks an invariant (e.g. uses more buffers than offered).
pub fn net_fuzz_case(data: &[u8]) {
    const TABLES: usize = 2 * 16 * 16;
    if data.len() < 2 + TABLES {
        return;
    }
    let Ok((backend, peer)) = super::net::DgramBackend::pair() else {
        return;
    };
    let _ = peer.set_nonblocking(true);
    let mac = super::net::MacAddr([2, 0, 0, 0, 0, 1]);
    let mut d = NetDriver::new(Arc::new(backend), mac, 1 << 20);
    let features = u32::from(data[0]) & 0xff_ff;
    let qsize = 1u16 << (data[1] % 5);
    if !d.start(features | (u32::from(data[0] & 0x80) << 8), qsize) {
        return;
    }
    let (tables, script) = data[2..].split_at(TABLES);
    for (i, c) in tables.chunks_exact(16).enumerate() {
        let q = i / 16;
        let mut addr = u64::from_le_bytes(c[0..8].try_into().unwrap_or_default());
        if c[15] & 0x80 == 0 {
            addr = DATA + (addr % 0x8_0000);
        }
        d.set_desc(
            q,
            (i % 16) as u16,
            RawDesc {
                addr,
                len: u32::from_le_bytes(c[8..12].try_into().unwrap_or_default()) % 0x2_0000,
                flags: u16::from_le_bytes([c[12], c[13]]) & 7,
                next: u16::from(c[14]) % 20,
            },
        );
    }
    let mut offered = [0u32; 2];
    let mut it = script.iter();
    while let (Some(&op), Some(&arg)) = (it.next(), it.next()) {
        match op % 6 {
            0 | 1 => {
                let q = usize::from(op % 2);
                offered[q] += 1;
                d.kick(q, u16::from(arg) % 20);
            }
            2 => {
                let n = usize::from(arg) * 8;
                let frame: Vec<u8> = (0..n).map(|i| i as u8 ^ op).collect();
                let _ = peer.send(&frame);
            }
            3 => d.poll(usize::from(arg % 2)),
            4 => {
                let mut buf = [0u8; 2048];
                while peer.recv(&mut buf).is_ok() {}
            }
            _ => {
                if arg & 0xf0 == 0 {
                    offered = [0; 2];
                    let _ = d.start(features, qsize);
                }
            }
        }
        for (q, &offered) in offered.iter().enumerate() {
            // Without mergeable buffers or chains of one descriptor each,
            // a device never returns more chains than it was offered.
            let used = u32::from(d.used_idx(q));
            assert!(
                used <= offered || d.status() & super::mmio::status::NEEDS_RESET != 0,
                "queue {q}: {used} used of {offered} offered"
            );
        }
    }
}
