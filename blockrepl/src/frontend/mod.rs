// SPDX-License-Identifier: Apache-2.0
//! Frontends: how programs that already exist reach a volume.
//!
//! ```text
//!   qemu-img / qemu-io / fio / nbdinfo ──NBD──► nbd::NbdServer ─┐
//!   QEMU vhost-user-blk-pci ──vhost-user──► vhost_user::VhostUserBlk ─┤
//!   sheaf-vmm virtio-blk ──BlockBackend──► vmm::VolumeBackend ────────┤
//!                                                                      ▼
//!                                         Disk (byte granularity, RMW, range locks)
//!                                                                      ▼
//!                                                 Volume (engine, replicas)
//! ```
//!
//! Every frontend goes through [`Disk`], which turns byte-addressed I/O
//! into the volume's 4 KiB blocks. See `docs/frontends.md`.

pub mod disk;
pub mod nbd;
#[cfg(feature = "vhost-user")]
pub mod vhost_user;
#[cfg(feature = "vmm")]
pub mod vmm;

pub use disk::Disk;
