// SPDX-License-Identifier: Apache-2.0
//! Emulated devices and the buses vCPU exits are dispatched on.
//!
//! ```text
//!  vCPU thread ── PIO exit ──► PioBus ──► Serial (COM1), I8042, DebugExit, AcpiPm
//!              └─ MMIO exit ─► MmioBus ─► virtio-mmio transport ─► VirtioBlock
//!  device thread ◄─ ioeventfd (QueueNotify) ── KVM
//!  device thread ─► irqfd ──► in-kernel IOAPIC ──► guest
//! ```

pub mod legacy;
pub mod serial;
pub mod virtio;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Errors from device creation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// Opening a disk image failed.
    #[error("cannot open disk {path}")]
    OpenDisk {
        /// Image path.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Opening or creating a tap interface failed.
    #[error("cannot open tap {name}")]
    OpenTap {
        /// Interface name.
        name: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Opening the serial output file failed.
    #[error("cannot open serial output {path}")]
    OpenSerialFile {
        /// File path.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Creating an eventfd failed.
    #[error("cannot create an eventfd")]
    EventFd(#[source] std::io::Error),
    /// KVM_IRQFD failed.
    #[error("cannot register irqfd for GSI {gsi}")]
    RegisterIrqfd {
        /// GSI.
        gsi: u32,
        /// Cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// KVM_IOEVENTFD failed.
    #[error("cannot register ioeventfd at {addr:#x}")]
    RegisterIoeventfd {
        /// Guest address.
        addr: u64,
        /// Cause.
        #[source]
        source: kvm_ioctls::Error,
    },
}

/// A device on the PIO or MMIO bus. `offset` is relative to the device's base.
pub trait BusDevice: Send {
    /// Guest read of `data.len()` bytes.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Guest write.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// A shared bus device.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

/// An address → device map. Lookups are a binary search over disjoint ranges.
#[derive(Default, Clone)]
pub struct Bus {
    ranges: Vec<(u64, u64, SharedDevice)>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.ranges.iter().map(|(b, l, _)| (b, l)))
            .finish()
    }
}

impl Bus {
    /// Adds `dev` at `[base, base + len)`; returns false if it overlaps.
    pub fn insert(&mut self, base: u64, len: u64, dev: SharedDevice) -> bool {
        let end = base.saturating_add(len);
        if len == 0
            || self
                .ranges
                .iter()
                .any(|&(b, l, _)| base < b.saturating_add(l) && b < end)
        {
            return false;
        }
        self.ranges.push((base, len, dev));
        self.ranges.sort_by_key(|r| r.0);
        true
    }

    fn find(&self, addr: u64) -> Option<(u64, &SharedDevice)> {
        let i = self
            .ranges
            .partition_point(|r| r.0 <= addr)
            .checked_sub(1)?;
        let (base, len, dev) = &self.ranges[i];
        (addr - base < *len).then_some((addr - base, dev))
    }

    /// Dispatches a read; unclaimed reads return all ones. Returns whether a
    /// device claimed the address.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((off, dev)) => {
                dev.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .read(off, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Dispatches a write; unclaimed writes are dropped.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((off, dev)) => {
                dev.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .write(off, data);
                true
            }
            None => false,
        }
    }
}

/// Logs at most one warning per interval and counts what it suppressed, so
/// a guest cannot flood the host log.
#[derive(Debug)]
pub struct RateLimitedWarn {
    last: Option<Instant>,
    suppressed: u64,
    interval: Duration,
}

impl Default for RateLimitedWarn {
    fn default() -> Self {
        RateLimitedWarn {
            last: None,
            suppressed: 0,
            interval: Duration::from_secs(1),
        }
    }
}

impl RateLimitedWarn {
    /// Returns `Some(suppressed_since_last)` when a warning may be logged now.
    pub fn check(&mut self) -> Option<u64> {
        let now = Instant::now();
        match self.last {
            Some(t) if now.duration_since(t) < self.interval => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rec(Vec<(u64, Vec<u8>)>);
    impl BusDevice for Rec {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn bus_dispatches_by_range_and_rejects_overlap() {
        let a = Arc::new(Mutex::new(Rec(vec![])));
        let mut bus = Bus::default();
        assert!(bus.insert(0x100, 0x10, a.clone()));
        assert!(!bus.insert(0x10f, 1, a.clone()));
        assert!(bus.insert(0x110, 1, a.clone()));
        let mut d = [0u8; 1];
        assert!(bus.read(0x105, &mut d));
        assert_eq!(d[0], 5);
        assert!(!bus.read(0x111, &mut d));
        assert_eq!(d[0], 0xff);
        assert!(bus.write(0x110, &[7]));
        assert_eq!(a.lock().unwrap().0, vec![(0, vec![7])]);
        assert!(!bus.write(0xff, &[1]));
    }

    #[test]
    fn rate_limit_suppresses_bursts() {
        let mut r = RateLimitedWarn::default();
        assert_eq!(r.check(), Some(0));
        assert_eq!(r.check(), None);
        assert_eq!(r.check(), None);
        r.last = Some(Instant::now() - Duration::from_secs(2));
        assert_eq!(r.check(), Some(2));
    }
}
