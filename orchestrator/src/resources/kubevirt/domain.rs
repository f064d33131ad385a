// SPDX-License-Identifier: Apache-2.0
//! The virtual hardware: domain, CPU, memory, devices, firmware, features.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::*;

/// The virtual hardware.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DomainSpec {
    /// CPU topology.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<Cpu>,
    /// Guest memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    /// Resource requests and limits (`cpu`, `memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Disks, interfaces and other devices.
    #[serde(default)]
    pub devices: Devices,
    /// Machine type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<Machine>,
    /// Firmware and direct kernel boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware: Option<Firmware>,
    /// ACPI, APIC, SMM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<Features>,
}

/// CPU topology: vCPUs = cores × sockets × threads.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Cpu {
    /// Cores per socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores: Option<u32>,
    /// Sockets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sockets: Option<u32>,
    /// Threads per core.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<u32>,
    /// CPU model (`host-passthrough`, `host-model`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Pin vCPUs to dedicated host CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedicated_cpu_placement: Option<bool>,
}

impl Cpu {
    /// Total vCPUs.
    pub fn vcpus(&self) -> u32 {
        self.cores
            .unwrap_or(1)
            .saturating_mul(self.sockets.unwrap_or(1))
            .saturating_mul(self.threads.unwrap_or(1))
    }
}

/// Guest memory.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Memory {
    /// Memory visible to the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<Quantity>,
    /// Back guest memory with huge pages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugepages: Option<Hugepages>,
}

/// Huge page backing.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Hugepages {
    /// `2Mi` or `1Gi`.
    pub page_size: String,
}

/// Resource requests and limits.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ResourceRequirements {
    /// Requested amounts (`cpu`, `memory`, `storage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests: Option<BTreeMap<String, Quantity>>,
    /// Upper limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<BTreeMap<String, Quantity>>,
    /// Do not add the VMM overhead to the memory request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overcommit_guest_overhead: Option<bool>,
}

/// Devices.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Devices {
    /// Disks, each backed by the volume of the same name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<Disk>,
    /// Network interfaces, each attached to the network of the same name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<Interface>,
    /// A virtio-rng device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rng: Option<Empty>,
    /// Attach a serial console (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoattach_serial_console: Option<bool>,
    /// Attach a graphics device (ignored by sheaf-vmm).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoattach_graphics_device: Option<bool>,
    /// Attach the default pod interface when none is listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoattach_pod_interface: Option<bool>,
    /// Multi-queue virtio-net.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_interface_multiqueue: Option<bool>,
    /// Multi-queue virtio-blk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_multi_queue: Option<bool>,
}

/// A disk.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Disk {
    /// Name; must match a volume.
    #[serde(default)]
    pub name: String,
    /// Attach as a disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskTarget>,
    /// Attach as a CD-ROM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdrom: Option<DiskTarget>,
    /// Boot order (1 boots first); unique.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_order: Option<u32>,
    /// Serial number seen by the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// Host cache mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheMode>,
    /// Give the disk its own I/O thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedicated_io_thread: Option<bool>,
}

/// Disk attachment.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DiskTarget {
    /// Bus (`virtio` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bus: Option<DiskBus>,
    /// Read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
}

/// Disk bus. `virtio` everywhere; `sata` with the QEMU runtime only. KubeVirt's
/// `scsi` and `usb` are not supported.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[schemars(inline)]
#[serde(rename_all = "lowercase")]
pub enum DiskBus {
    /// virtio-blk.
    Virtio,
    /// AHCI (QEMU runtime).
    Sata,
}

/// Host cache mode of a disk.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[schemars(inline)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// O_DIRECT, no host cache.
    None,
    /// Host cache, writes synchronous.
    Writethrough,
    /// Host cache, flushes on guest FLUSH.
    Writeback,
}

/// A network interface.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Interface {
    /// Name; must match a network.
    #[serde(default)]
    pub name: String,
    /// NAT binding (the default pod network binding).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masquerade: Option<Empty>,
    /// Bridge binding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bridge: Option<Empty>,
    /// NIC model (`virtio` by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<InterfaceModel>,
    /// MAC address (`02:00:00:aa:bb:cc`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac_address: Option<String>,
    /// Forwarded ports (masquerade).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<Port>>,
    /// Boot order for PXE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_order: Option<u32>,
}

/// NIC model.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[schemars(inline)]
#[serde(rename_all = "lowercase")]
pub enum InterfaceModel {
    /// virtio-net.
    Virtio,
    /// Emulated e1000 (QEMU runtime).
    E1000,
}

/// A forwarded port.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Port {
    /// Optional name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `TCP` (default) or `UDP`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// Port number.
    pub port: u16,
}

/// Machine type.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Machine {
    /// e.g. `q35`; empty means the runtime's default.
    #[serde(default, rename = "type")]
    pub type_: String,
}

/// Firmware.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Firmware {
    /// SMBIOS UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// SMBIOS serial.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// BIOS or EFI (QEMU runtime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootloader: Option<Bootloader>,
    /// Direct kernel boot (sheaf-vmm's primary boot path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_boot: Option<KernelBoot>,
}

/// Bootloader choice.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Bootloader {
    /// Legacy BIOS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bios: Option<Empty>,
    /// UEFI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub efi: Option<Efi>,
}

/// UEFI options.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Efi {
    /// Secure boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_boot: Option<bool>,
}

/// Direct kernel boot.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KernelBoot {
    /// Kernel command line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_args: Option<String>,
    /// Where kernel and initrd come from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<KernelBootContainer>,
}

/// Kernel and initrd location.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct KernelBootContainer {
    /// Image reference (a local directory for sheaf runtimes).
    #[serde(default)]
    pub image: String,
    /// Kernel path inside the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_path: Option<String>,
    /// Initrd path inside the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<String>,
    /// Ignored; accepted for compatibility.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
}

/// Platform features.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Features {
    /// ACPI (on by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acpi: Option<FeatureState>,
    /// APIC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apic: Option<FeatureState>,
    /// System management mode (needed by secure boot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub smm: Option<FeatureState>,
}

/// On/off feature.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FeatureState {
    /// Enabled (default true when the feature is listed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
}
