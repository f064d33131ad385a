// SPDX-License-Identifier: Apache-2.0
//! The crate-level error type.
//!
//! Each module has its own error enum named after the operations that can
//! fail there; [`Error`] wraps them so callers of the public API match on one
//! type. Variants are named after the failed operation, messages are short
//! and sentence case, and the `#[source]` chain carries the detail.

use std::io;

use crate::{acpi, arch, boot, config, devices, memory};

/// Result alias for the public API.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong while building, running or controlling a VM.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid.
    #[error("invalid VM configuration")]
    Config(#[from] config::ConfigError),
    /// Opening /dev/kvm or checking its capabilities failed.
    #[error("cannot open KVM")]
    OpenKvm(#[source] kvm_ioctls::Error),
    /// A required KVM capability is missing.
    #[error("KVM lacks a required capability: {0}")]
    KvmCapability(&'static str),
    /// Creating the KVM VM failed.
    #[error("cannot create the KVM VM")]
    CreateVm(#[source] kvm_ioctls::Error),
    /// Setting up the in-kernel interrupt controllers failed.
    #[error("cannot set up the in-kernel irqchip")]
    SetupIrqchip(#[source] kvm_ioctls::Error),
    /// Guest memory could not be created or registered.
    #[error("guest memory setup failed")]
    Memory(#[from] memory::MemoryError),
    /// Loading the kernel, initramfs or boot parameters failed.
    #[error("boot setup failed")]
    Boot(#[from] boot::BootError),
    /// Building ACPI tables failed.
    #[error("ACPI table setup failed")]
    Acpi(#[from] acpi::AcpiError),
    /// Configuring a vCPU failed.
    #[error("vCPU setup failed")]
    Vcpu(#[from] arch::x86_64::ArchError),
    /// A device could not be created.
    #[error("device setup failed")]
    Device(#[from] devices::DeviceError),
    /// Creating an eventfd failed.
    #[error("cannot create an eventfd")]
    EventFd(#[source] io::Error),
    /// Spawning a VMM thread failed.
    #[error("cannot spawn thread {name}")]
    SpawnThread {
        /// Thread name.
        name: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The operation is not valid in the VM's current state.
    #[error("cannot {op} a VM that is {state}")]
    InvalidState {
        /// The requested operation.
        op: &'static str,
        /// The state the VM was in.
        state: crate::VmState,
    },
    /// A vCPU did not acknowledge a pause or stop request in time.
    #[error("vCPUs did not acknowledge {op} within {timeout_ms} ms")]
    Timeout {
        /// The requested operation.
        op: &'static str,
        /// The time waited.
        timeout_ms: u64,
    },
    /// Saving or restoring a snapshot failed.
    #[error("snapshot")]
    Snapshot(#[from] crate::vm::state::SnapshotError),
    /// A live migration failed (see [`crate::migration::MigrationError`]).
    #[error("live migration")]
    Migration(#[from] crate::migration::MigrationError),
    /// Reading the dirty-page log failed.
    #[error("cannot read the dirty-page log")]
    DirtyLog(#[source] kvm_ioctls::Error),
}
