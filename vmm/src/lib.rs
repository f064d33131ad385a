// SPDX-License-Identifier: Apache-2.0
//! A KVM virtual machine monitor as an embeddable library, built on rust-vmm.
//!
//! sheaf-vmm boots x86_64 Linux (bzImage, or vmlinux ELF through the Linux
//! 64-bit protocol or PVH) with an 8250 console, virtio-blk disks and
//! virtio-net cards on virtio-mmio (described to the guest in ACPI), and
//! one thread per vCPU.
//!
//! # Running a VM
//!
//! ```no_run
//! use sheaf_vmm::{Vm, VmConfig, VmEvent};
//!
//! let config = VmConfig::builder()
//!     .vcpus(2)
//!     .memory_mib(256)
//!     .kernel("/boot/vmlinuz")
//!     .initramfs("initrd.img")
//!     .cmdline("console=ttyS0 quiet")
//!     .disk("disk.img")
//!     .build()?;
//! let vm = Vm::new(config)?;
//! let events = vm.subscribe();
//! vm.start()?;
//! vm.pause()?; // every vCPU out of the guest, devices parked
//! vm.resume()?;
//! let reason = vm.wait(); // e.g. ExitReason::Shutdown after `poweroff`
//! for ev in events.try_iter() {
//!     println!("{ev:?}");
//! }
//! println!("{reason:?}: {}", String::from_utf8_lossy(&vm.console().contents()));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Plugging in storage
//!
//! Disks are served by any [`BlockBackend`]; [`FileBackend`] is built in and
//! [`MemBackend`] is the in-memory reference. Attach your own with
//! [`VmBuilder::disk_backend`]:
//!
//! ```no_run
//! use std::sync::Arc;
//! use sheaf_vmm::{MemBackend, Vm, VmConfig};
//! let cfg = VmConfig::builder().kernel("vmlinux").build()?;
//! let vm = Vm::builder(cfg)
//!     .disk_backend(Arc::new(MemBackend::new(64 << 20, "scratch")))
//!     .create()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![warn(missing_docs)]

pub mod acpi;
pub mod arch;
pub mod boot;
pub mod config;
pub mod devices;
pub mod error;
pub mod exit;
#[doc(hidden)]
pub mod fuzzing;
pub mod memory;
pub mod migration;
pub mod probe;
mod vcpu;
pub(crate) mod vm;

pub use config::{
    BootProtocol, DiskBoot, DiskConfig, IoEngine, KernelConfig, MemoryBacking, MemoryConfig,
    NetConfig, SerialConfig, VmConfig, VmConfigBuilder,
};
pub use devices::serial::{ConsoleRing, SerialSink};
pub use devices::virtio::block::backend::{BlockBackend, FileBackend, MemBackend, SECTOR_SIZE};
pub use devices::virtio::net::{DgramBackend, MacAddr, NetBackend, TapBackend};
pub use error::{Error, Result};
pub use exit::ExitReason;
pub use memory::DirtyRegion;
pub use migration::{
    MigrationConfig, MigrationError, MigrationReport, PassReport, Phase, Progress, TransportError,
};
pub use vcpu::{VcpuStats, kick_signal};
pub use vm::state::{MEMORY_FILE, SNAPSHOT_VERSION, STATE_FILE, SnapshotError, VmSnapshot};
pub use vm::{Vm, VmBuilder, VmEvent, VmMetrics, VmState};
