// SPDX-License-Identifier: Apache-2.0
//! The disk of a live-migration target before its volume is attached: it
//! has the source's size and identity from the start (the guest's device
//! state was built against them) and serves requests once the launcher
//! filled its [`DeferredVolume`] at the switch-over.

use std::sync::{Arc, Mutex, OnceLock};

use sheaf_blockrepl::frontend::vmm::VolumeBackend;
use sheaf_vmm::devices::virtio::block::request::{DiskInfo, Request};
use sheaf_vmm::devices::virtio::block::{AsyncBlockBackend, Completion};
use sheaf_vmm::memory::GuestMemory;
use virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR;
use vmm_sys_util::eventfd::EventFd;

use super::DeferredVolume;
use super::vmm::TimedBackend;
use crate::launcher::metrics::DiskIoStats;

/// See the module docs.
pub(super) struct LateBackend {
    volume: Arc<DeferredVolume>,
    io: tokio::runtime::Handle,
    serial: String,
    read_only: bool,
    stats: Arc<DiskIoStats>,
    waker: Mutex<Option<EventFd>>,
    inner: OnceLock<TimedBackend>,
    /// Requests refused before the volume was attached.
    refused: Mutex<Vec<Completion>>,
}

impl std::fmt::Debug for LateBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LateBackend")
            .field("serial", &self.serial)
            .field("attached", &self.inner.get().is_some())
            .finish_non_exhaustive()
    }
}

impl LateBackend {
    pub(super) fn new(
        volume: Arc<DeferredVolume>,
        io: tokio::runtime::Handle,
        serial: String,
        read_only: bool,
        stats: Arc<DiskIoStats>,
    ) -> Self {
        LateBackend {
            volume,
            io,
            serial,
            read_only,
            stats,
            waker: Mutex::new(None),
            inner: OnceLock::new(),
            refused: Mutex::new(Vec::new()),
        }
    }

    /// The engine's backend, built on first use after the attach.
    fn inner(&self) -> Option<&TimedBackend> {
        if let Some(b) = self.inner.get() {
            return Some(b);
        }
        let disk = self.volume.get()?.clone();
        let b = self.inner.get_or_init(|| {
            let backend = VolumeBackend::new(disk, self.io.clone(), &self.serial)
                .with_read_only(self.read_only);
            let timed = TimedBackend::new(backend.into_async(), self.stats.clone());
            let waker = self.waker.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(w) = waker.as_ref().and_then(|w| w.try_clone().ok()) {
                timed.set_waker(w);
            }
            timed
        });
        Some(b)
    }

    fn take_refused(&self, out: &mut Vec<Completion>) {
        out.append(&mut self.refused.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

impl AsyncBlockBackend for LateBackend {
    fn size(&self) -> u64 {
        self.volume.size()
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn device_id(&self) -> String {
        // What `VolumeBackend` reports for the same serial.
        self.serial.clone()
    }
    fn supports_discard(&self) -> bool {
        !self.read_only
    }
    fn supports_write_zeroes(&self) -> bool {
        !self.read_only
    }
    fn set_waker(&self, waker: EventFd) {
        match self.inner.get() {
            Some(b) => b.set_waker(waker),
            None => *self.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(waker),
        }
    }
    fn submit(&self, token: u64, req: Request, mem: &GuestMemory, disk: DiskInfo) {
        match self.inner() {
            Some(b) => b.submit(token, req, mem, disk),
            None => {
                tracing::warn!(serial = %self.serial, "guest I/O before the migrated volume was attached; failing it");
                self.refused
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Completion {
                        token,
                        status: VIRTIO_BLK_S_IOERR as u8,
                        written: 0,
                    });
                if let Some(w) = self
                    .waker
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_ref()
                {
                    let _ = w.write(1);
                }
            }
        }
    }
    fn reap(&self, out: &mut Vec<Completion>) {
        self.take_refused(out);
        if let Some(b) = self.inner.get() {
            b.reap(out);
        }
    }
    fn drain(&self, out: &mut Vec<Completion>) {
        self.take_refused(out);
        if let Some(b) = self.inner.get() {
            b.drain(out);
        }
    }
}
