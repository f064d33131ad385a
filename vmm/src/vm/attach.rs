// SPDX-License-Identifier: Apache-2.0
//! Puts virtio devices on the virtio-mmio bus: a register window and an
//! IOAPIC pin each (in order: disks, then network cards), ioeventfds for
//! the queue notifications, an ACPI DSDT entry and, when asked, a
//! `virtio_mmio.device=` command-line entry.

use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, VmFd};

use crate::acpi;
use crate::arch::x86_64::layout;
use crate::config::NetConfig;
use crate::devices::virtio::mmio::{MmioTransport, QUEUE_NOTIFY};
use crate::devices::virtio::net::{MacAddr, NetBackend, NetStats, TapBackend, VirtioNet};
use crate::devices::virtio::{VirtioDevice, VirtioInterrupt};
use crate::devices::{Bus, DeviceError};
use crate::error::Result;
use crate::memory::GuestMemory;

/// A network card attached at run time.
pub(super) struct ExtraNet {
    pub backend: Arc<dyn NetBackend>,
    pub mac: Option<MacAddr>,
}

/// The virtio-mmio bus being filled.
pub(super) struct VirtioBus<'a> {
    pub vm_fd: &'a VmFd,
    pub mem: &'a GuestMemory,
    pub mmio: &'a mut Bus,
    pub transports: Vec<Arc<Mutex<MmioTransport>>>,
    pub acpi_devs: Vec<acpi::MmioDevice>,
    /// `virtio_mmio.device=` entries, when the config asks for them.
    pub cmdline: Option<String>,
}

impl VirtioBus<'_> {
    /// Puts `dev` in the next window.
    pub fn add(&mut self, name: String, dev: Box<dyn VirtioDevice>) -> Result<()> {
        let (base, irq) = layout::virtio_mmio_window(self.transports.len());
        let interrupt = VirtioInterrupt::new(super::irqfd(self.vm_fd, irq)?);
        let t = MmioTransport::new(name, dev, self.mem.clone(), interrupt)
            .map_err(DeviceError::EventFd)?;
        for (q, evt) in t.queue_evts().iter().enumerate() {
            let addr = base + QUEUE_NOTIFY;
            self.vm_fd
                .register_ioevent(evt, &IoEventAddress::Mmio(addr), q as u32)
                .map_err(|source| DeviceError::RegisterIoeventfd { addr, source })?;
        }
        let t = Arc::new(Mutex::new(t));
        self.mmio.insert(base, layout::VIRTIO_MMIO_SIZE, t.clone());
        self.transports.push(t);
        self.acpi_devs.push(acpi::MmioDevice {
            base,
            size: layout::VIRTIO_MMIO_SIZE,
            irq,
        });
        if let Some(c) = &mut self.cmdline {
            c.push_str(&format!(
                " virtio_mmio.device={}K@{:#x}:{}",
                layout::VIRTIO_MMIO_SIZE >> 10,
                base,
                irq
            ));
        }
        Ok(())
    }

    /// Adds the configured network cards, then the run-time ones; returns
    /// their counters.
    pub fn add_nets(
        &mut self,
        vm_name: &str,
        nets: &[NetConfig],
        extra: Vec<ExtraNet>,
    ) -> Result<Vec<Arc<NetStats>>> {
        let mut cards: Vec<(Arc<dyn NetBackend>, Option<MacAddr>)> = Vec::new();
        for n in nets {
            let tap = TapBackend::open(&n.tap).map_err(|source| DeviceError::OpenTap {
                name: n.tap.clone(),
                source,
            })?;
            // Validated by VmConfig::validate.
            let mac = n.mac.as_deref().and_then(|m| MacAddr::parse(m).ok());
            cards.push((Arc::new(tap), mac));
        }
        cards.extend(extra.into_iter().map(|e| (e.backend, e.mac)));
        let mut stats = Vec::new();
        for (i, (backend, mac)) in cards.into_iter().enumerate() {
            let mac = mac.unwrap_or_else(|| MacAddr::derived(&format!("{vm_name}/net{i}")));
            tracing::debug!(vm = vm_name, card = i, %mac, backend = %backend.name(), "virtio-net card");
            let dev = VirtioNet::new(backend, mac);
            stats.push(dev.stats());
            self.add(format!("virtio-net{i}"), Box::new(dev))?;
        }
        Ok(stats)
    }
}
