// SPDX-License-Identifier: Apache-2.0
//! A volume as a sheaf-vmm virtio-blk disk: [`VolumeBackend`] implements
//! [`sheaf_vmm::BlockBackend`] (feature `vmm`).
//!
//! The VMM calls the backend synchronously from its device thread; each
//! call runs the async [`Disk`] operation on a tokio runtime and waits for
//! it. Sector-granular requests are served through the disk's
//! read-modify-write, so the guest sees a 512-byte-sector disk while the
//! volume stores 4 KiB blocks.
//!
//! ```no_run
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use sheaf_blockrepl::frontend::vmm::VolumeBackend;
//! use sheaf_blockrepl::volume::{VolumeConfig, create_replica};
//! create_replica("/tmp/vm-disk", 64 << 20)?;
//! let backend = VolumeBackend::attach(VolumeConfig::local("/tmp/vm-disk"), "disk0")?;
//! // sheaf_vmm::Vm::builder(cfg).disk_backend(Arc::new(backend)).create()?;
//! # let _ = Arc::new(backend);
//! # Ok(()) }
//! ```

use std::io;
use std::sync::Arc;

use bytes::Bytes;
use sheaf_vmm::BlockBackend;

use crate::error::Error;
use crate::frontend::disk::Disk;
use crate::volume::{Volume, VolumeConfig};

/// A blockrepl volume serving a sheaf-vmm virtio-blk device.
#[derive(Debug)]
pub struct VolumeBackend {
    disk: Disk,
    rt: tokio::runtime::Handle,
    _owned: Option<Arc<tokio::runtime::Runtime>>,
    id: String,
    read_only: bool,
}

impl VolumeBackend {
    /// Attaches the volume on a private runtime (one worker thread).
    pub fn attach(cfg: VolumeConfig, id: &str) -> crate::Result<VolumeBackend> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("sheaf-vmm-volume")
            .enable_all()
            .build()
            .map_err(|source| Error::Net {
                op: "start runtime",
                source,
            })?;
        let vol = rt.block_on(Volume::attach(cfg))?;
        Ok(VolumeBackend {
            disk: Disk::new(vol),
            rt: rt.handle().clone(),
            _owned: Some(Arc::new(rt)),
            id: id.to_string(),
            read_only: false,
        })
    }

    /// Serves an attached disk; operations run on `rt`, which the caller
    /// keeps running. The VMM must not call in from one of `rt`'s threads.
    pub fn new(disk: Disk, rt: tokio::runtime::Handle, id: &str) -> VolumeBackend {
        VolumeBackend {
            disk,
            rt,
            _owned: None,
            id: id.to_string(),
            read_only: false,
        }
    }

    /// Offers the disk read-only to the guest.
    pub fn with_read_only(mut self, ro: bool) -> Self {
        self.read_only = ro;
        self
    }

    /// The disk.
    pub fn disk(&self) -> &Disk {
        &self.disk
    }

    fn ro_check(&self) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "read-only disk",
            ));
        }
        Ok(())
    }
}

/// Maps a volume error to the `io::Error` the VMM reports to the guest.
fn to_io(e: Error) -> io::Error {
    let kind = match &e {
        Error::Unaligned { .. } | Error::OutOfRange { .. } | Error::TooLarge { .. } => {
            io::ErrorKind::InvalidInput
        }
        Error::InvalidArgument(_) => io::ErrorKind::InvalidInput,
        Error::Fenced { .. } => io::ErrorKind::PermissionDenied,
        Error::Detached => io::ErrorKind::NotConnected,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

impl BlockBackend for VolumeBackend {
    fn size(&self) -> u64 {
        self.disk.size()
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn device_id(&self) -> String {
        self.id.clone()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let data = self
            .rt
            .block_on(self.disk.read(offset, buf.len()))
            .map_err(to_io)?;
        buf.copy_from_slice(&data);
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.ro_check()?;
        self.rt
            .block_on(self.disk.write(offset, Bytes::copy_from_slice(buf)))
            .map_err(to_io)
    }
    fn flush(&self) -> io::Result<()> {
        self.rt.block_on(self.disk.flush()).map_err(to_io)
    }
    fn supports_discard(&self) -> bool {
        !self.read_only
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.ro_check()?;
        self.rt.block_on(self.disk.trim(offset, len)).map_err(to_io)
    }
    fn supports_write_zeroes(&self) -> bool {
        !self.read_only
    }
    fn write_zeroes(&self, offset: u64, len: u64, _may_unmap: bool) -> io::Result<()> {
        self.ro_check()?;
        self.rt
            .block_on(self.disk.write_zeroes(offset, len))
            .map_err(to_io)
    }
}
