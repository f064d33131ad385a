// SPDX-License-Identifier: Apache-2.0
//! `kubevirt.io/v1`: VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration.
//!
//! Field names and JSON shapes follow KubeVirt's API so existing manifests
//! apply unchanged when they stay within the supported subset (see
//! `docs/orchestrator.md`). Volume sources `persistentVolumeClaim` and
//! `dataVolume` name a sheaf [`Volume`](super::Volume) in the same namespace.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Affinity, Toleration, TopologySpreadConstraint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::common::{Condition, age_cell, condition_cell, json_path, json_str};
use super::decode::{FieldError, is_dns_label, is_dns_subdomain};
use super::quantity::{parse_quantity_bytes, parse_quantity_millis};
use super::{Scope, TableColumn, root_kind};

/// The group of the KubeVirt kinds.
pub const GROUP: &str = "kubevirt.io";

/// An empty object (`{}`), used by KubeVirt for flags such as `masquerade: {}`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
pub struct Empty {}

// ---------------------------------------------------------------- VirtualMachine

/// How a VirtualMachine's instance is kept running.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[schemars(inline)]
pub enum RunStrategy {
    /// An instance always runs; it is restarted whenever it stops.
    Always,
    /// Restarted only when it failed (not when the guest shut down cleanly).
    RerunOnFailure,
    /// Started once; not restarted after it stops.
    Once,
    /// Started and stopped only by explicit requests.
    Manual,
    /// No instance runs.
    Halted,
}

/// Desired state of a VirtualMachine.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineSpec {
    /// Deprecated boolean form of the run strategy (`true` = Always, `false` = Halted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<bool>,
    /// Run strategy; mutually exclusive with `running`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_strategy: Option<RunStrategy>,
    /// Template of the instance this VM runs.
    #[serde(default)]
    pub template: VirtualMachineInstanceTemplateSpec,
    /// Volumes created with the VM and owned by it (a sheaf Volume each).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_volume_templates: Option<Vec<DataVolumeTemplateSpec>>,
}

impl VirtualMachineSpec {
    /// The effective run strategy (`running` mapped, default Halted).
    pub fn effective_run_strategy(&self) -> RunStrategy {
        match (self.run_strategy, self.running) {
            (Some(s), _) => s,
            (None, Some(true)) => RunStrategy::Always,
            _ => RunStrategy::Halted,
        }
    }
}

/// Instance template of a VirtualMachine.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceTemplateSpec {
    /// Labels and annotations copied to the instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<ObjectMeta>,
    /// Instance spec.
    #[serde(default)]
    pub spec: VirtualMachineInstanceSpec,
}

/// A volume created together with a VM (KubeVirt's DataVolume template).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeTemplateSpec {
    /// Ignored; accepted for compatibility.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// Ignored; accepted for compatibility.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name (required) and labels of the volume.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// Size and source.
    #[serde(default)]
    pub spec: DataVolumeSpec,
}

/// Size and source of a DataVolume-like volume.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeSpec {
    /// PVC-style storage request (`resources.requests.storage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pvc: Option<StorageSpec>,
    /// Same as `pvc` (newer CDI form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<StorageSpec>,
    /// Where the initial contents come from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<DataVolumeSource>,
}

/// Storage request of a DataVolume.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StorageSpec {
    /// Access modes (`ReadWriteOnce`, `ReadWriteMany`); informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_modes: Option<Vec<String>>,
    /// `requests.storage` is the volume size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Storage class; `sheaf-<n>` (e.g. `sheaf-3`) selects the replica count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
    /// `Block` or `Filesystem`; informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_mode: Option<String>,
}

/// Initial contents of a DataVolume.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeSource {
    /// An empty volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blank: Option<Empty>,
    /// Image downloaded over HTTP(S).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<UrlSource>,
    /// Image from a container registry (`docker://...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<UrlSource>,
    /// Clone of another volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pvc: Option<PvcRef>,
}

/// A URL.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct UrlSource {
    /// The URL.
    #[serde(default)]
    pub url: String,
}

/// A reference to a volume by namespace and name.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PvcRef {
    /// Namespace (defaults to the VM's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Name.
    #[serde(default)]
    pub name: String,
}

/// Observed state of a VirtualMachine.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineStatus {
    /// Whether an instance exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<bool>,
    /// Whether the instance is ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<bool>,
    /// Human status: Stopped, Provisioning, Starting, Running, Paused, Stopping,
    /// Terminating, CrashLoopBackOff, Migrating, Unknown, ErrorUnschedulable, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub printable_status: Option<String>,
    /// Conditions (Ready, Paused, Failure, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// Generation the controller last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Generation the instance was created from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_generation: Option<i64>,
    /// Pending start/stop requests (virtctl start/stop with Manual strategy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_change_requests: Option<Vec<StateChangeRequest>>,
    /// Back-off after repeated start failures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_failure: Option<StartFailure>,
}

/// A start or stop request.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StateChangeRequest {
    /// `Start` or `Stop`.
    pub action: String,
    /// Extra data (e.g. the instance uid to stop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<BTreeMap<String, String>>,
    /// Instance the request applies to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// Crash-loop back-off state.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct StartFailure {
    /// Failures in a row.
    #[serde(default)]
    pub consecutive_fail_count: u32,
    /// Uid of the last failed instance.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "lastFailedVMIUID"
    )]
    pub last_failed_vmi_uid: Option<String>,
    /// No restart before this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_timestamp: Option<Time>,
}

root_kind! {
    /// A virtual machine: a template plus a run strategy; the controller creates
    /// and deletes [`VirtualMachineInstance`]s from it.
    VirtualMachine, spec: VirtualMachineSpec, status: VirtualMachineStatus,
    group: GROUP, version: "v1", plural: "virtualmachines", singular: "virtualmachine",
    short: ["vm", "vms"], scope: Scope::Namespaced,
    validate: validate_vm,
    columns: || vec![
        TableColumn::new("Age", "date", "Time since creation"),
        TableColumn::new("Status", "string", "Human readable status"),
        TableColumn::new("Ready", "string", "Whether the instance is ready"),
    ],
    row: |o| vec![
        age_cell(o),
        Value::String(json_str(o, "status.printableStatus").to_string()),
        Value::String(match json_path(o, "status.ready").and_then(Value::as_bool) {
            Some(true) => "True".into(),
            _ => "False".into(),
        }),
    ]
}

fn validate_vm(vm: &VirtualMachine) -> Vec<FieldError> {
    let mut errs = Vec::new();
    if vm.spec.running.is_some() && vm.spec.run_strategy.is_some() {
        errs.push(FieldError::invalid(
            "spec.running",
            vm.spec.running.unwrap_or_default(),
            "running and runStrategy are mutually exclusive",
        ));
    }
    let mut names = BTreeSet::new();
    for (i, dv) in vm.spec.data_volume_templates.iter().flatten().enumerate() {
        let p = format!("spec.dataVolumeTemplates[{i}]");
        match dv.metadata.name.as_deref() {
            None | Some("") => errs.push(FieldError::required(format!("{p}.metadata.name"), "")),
            Some(n) if !is_dns_subdomain(n) => errs.push(FieldError::invalid(
                format!("{p}.metadata.name"),
                n,
                "must be a lowercase RFC 1123 subdomain",
            )),
            Some(n) => {
                if !names.insert(n.to_string()) {
                    errs.push(FieldError::duplicate(format!("{p}.metadata.name"), n));
                }
            }
        }
        let storage = dv.spec.storage.as_ref().or(dv.spec.pvc.as_ref());
        let size = storage
            .and_then(|s| s.resources.as_ref())
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.get("storage"));
        match size {
            None => errs.push(FieldError::required(
                format!("{p}.spec.storage.resources.requests.storage"),
                "volume size",
            )),
            Some(q) if parse_quantity_bytes(&q.0).is_none_or(|b| b == 0) => {
                errs.push(FieldError::invalid(
                    format!("{p}.spec.storage.resources.requests.storage"),
                    &q.0,
                    "must be a positive quantity such as 10Gi",
                ));
            }
            Some(_) => {}
        }
        if let Some(src) = &dv.spec.source {
            let n = [
                src.blank.is_some(),
                src.http.is_some(),
                src.registry.is_some(),
                src.pvc.is_some(),
            ]
            .iter()
            .filter(|b| **b)
            .count();
            if n > 1 {
                errs.push(FieldError::forbidden(
                    format!("{p}.spec.source"),
                    "exactly one source may be set",
                ));
            }
        }
    }
    validate_vmi_spec(&vm.spec.template.spec, "spec.template.spec", &mut errs);
    errs
}

// ---------------------------------------------------------------- VirtualMachineInstance

/// Desired state of a VirtualMachineInstance.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceSpec {
    /// The virtual hardware.
    #[serde(default)]
    pub domain: DomainSpec,
    /// Volumes the disks refer to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VmVolume>,
    /// Networks the interfaces refer to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<Network>,
    /// Node labels the instance requires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Node and instance affinity (Kubernetes shape).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Tolerated node taints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Spreading over zones or nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology_spread_constraints: Option<Vec<TopologySpreadConstraint>>,
    /// What happens on node drain: `None`, `LiveMigrate`, `LiveMigrateIfPossible`, `External`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eviction_strategy: Option<EvictionStrategy>,
    /// Seconds the guest gets to shut down.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub termination_grace_period_seconds: Option<i64>,
    /// Guest hostname.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Guest DNS subdomain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subdomain: Option<String>,
    /// Priority class (for preemption).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Scheduler name; informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_name: Option<String>,
    /// `Paused` starts the guest paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_strategy: Option<StartStrategy>,
}

/// Eviction behaviour on node drain.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[schemars(inline)]
pub enum EvictionStrategy {
    /// Stop the instance.
    None,
    /// Migrate; block the drain if that is impossible.
    LiveMigrate,
    /// Migrate when possible, else stop.
    LiveMigrateIfPossible,
    /// An external controller handles it.
    External,
}

/// Start strategy.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[schemars(inline)]
pub enum StartStrategy {
    /// Start with vCPUs paused.
    Paused,
}

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

/// A volume of an instance: exactly one source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VmVolume {
    /// Name; disks refer to it.
    #[serde(default)]
    pub name: String,
    /// A sheaf Volume named by `claimName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<ClaimSource>,
    /// A sheaf Volume named by `name` (usually from `dataVolumeTemplates`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_volume: Option<DataVolumeRef>,
    /// An ephemeral disk from an image (a local image path for sheaf runtimes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_disk: Option<ContainerDisk>,
    /// A NoCloud cloud-init disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init_no_cloud: Option<CloudInit>,
    /// A ConfigDrive cloud-init disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init_config_drive: Option<CloudInit>,
    /// A blank scratch disk that lives as long as the instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub empty_disk: Option<EmptyDisk>,
}

impl VmVolume {
    fn source_count(&self) -> usize {
        [
            self.persistent_volume_claim.is_some(),
            self.data_volume.is_some(),
            self.container_disk.is_some(),
            self.cloud_init_no_cloud.is_some(),
            self.cloud_init_config_drive.is_some(),
            self.empty_disk.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count()
    }

    /// The sheaf Volume this volume uses, if any.
    pub fn sheaf_volume_name(&self) -> Option<&str> {
        self.persistent_volume_claim
            .as_ref()
            .map(|c| c.claim_name.as_str())
            .or(self.data_volume.as_ref().map(|d| d.name.as_str()))
    }
}

/// `persistentVolumeClaim` source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ClaimSource {
    /// Name of the sheaf Volume.
    #[serde(default)]
    pub claim_name: String,
    /// Attach read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
    /// Hot-pluggable (not yet supported; accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotpluggable: Option<bool>,
}

/// `dataVolume` source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeRef {
    /// Name of the sheaf Volume.
    #[serde(default)]
    pub name: String,
    /// Hot-pluggable (not yet supported; accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hotpluggable: Option<bool>,
}

/// `containerDisk` source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ContainerDisk {
    /// Image reference.
    #[serde(default)]
    pub image: String,
    /// Path of the disk inside the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Ignored; accepted for compatibility.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
}

/// cloud-init data.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CloudInit {
    /// User data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    /// User data, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data_base64: Option<String>,
    /// Network config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_data: Option<String>,
    /// Network config, base64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_data_base64: Option<String>,
}

/// `emptyDisk` source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EmptyDisk {
    /// Size.
    pub capacity: Quantity,
}

/// A network.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    /// Name; interfaces refer to it.
    #[serde(default)]
    pub name: String,
    /// The default (pod) network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodNetwork>,
}

/// Pod network options.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodNetwork {
    /// Guest CIDR for masquerade.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "vmNetworkCIDR"
    )]
    pub vm_network_cidr: Option<String>,
}

/// Lifecycle phase of an instance.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[schemars(inline)]
pub enum VmiPhase {
    /// Accepted, not yet scheduled.
    Pending,
    /// Being placed.
    Scheduling,
    /// Bound to a node; starting.
    Scheduled,
    /// The guest runs.
    Running,
    /// Stopped cleanly.
    Succeeded,
    /// Stopped with an error.
    Failed,
    /// State unknown (node lost).
    Unknown,
}

/// Observed state of an instance.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceStatus {
    /// Phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<VmiPhase>,
    /// Why the phase is what it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Conditions (Ready, LiveMigratable, Paused, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// The node running the instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// Guest interfaces and addresses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interfaces: Option<Vec<VmiInterfaceStatus>>,
    /// State of the current or last migration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_state: Option<MigrationState>,
    /// When each phase was entered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase_transition_timestamps: Option<Vec<PhaseTransition>>,
    /// Per-volume attachment state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_status: Option<Vec<VolumeStatusEntry>>,
}

/// A guest interface.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VmiInterfaceStatus {
    /// Interface name from the spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Primary IP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_address: Option<String>,
    /// All IPs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_addresses: Option<Vec<String>>,
    /// MAC address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Name inside the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface_name: Option<String>,
}

/// Migration progress, on the instance.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MigrationState {
    /// Node migrated from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_node: Option<String>,
    /// Node migrated to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node: Option<String>,
    /// Start time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timestamp: Option<Time>,
    /// End time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_timestamp: Option<Time>,
    /// Finished (successfully or not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed: Option<bool>,
    /// Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<bool>,
    /// Abort requested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub abort_requested: Option<bool>,
    /// `Cold` (stop, move, start) or `PreCopy` (live).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Uid of the migration object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_uid: Option<String>,
}

/// When a phase was entered.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PhaseTransition {
    /// Phase.
    pub phase: String,
    /// Time.
    pub phase_transition_timestamp: Time,
}

/// Attachment state of one volume.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeStatusEntry {
    /// Volume name.
    pub name: String,
    /// Guest device (`vda`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// Phase (`Bound`, `AttachedToNode`, `Ready`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

root_kind! {
    /// A running (or about to run) virtual machine, bound to one node.
    VirtualMachineInstance, spec: VirtualMachineInstanceSpec, status: VirtualMachineInstanceStatus,
    group: GROUP, version: "v1", plural: "virtualmachineinstances", singular: "virtualmachineinstance",
    short: ["vmi", "vmis"], scope: Scope::Namespaced,
    validate: |vmi| {
        let mut errs = Vec::new();
        validate_vmi_spec(&vmi.spec, "spec", &mut errs);
        errs
    },
    columns: || vec![
        TableColumn::new("Age", "date", "Time since creation"),
        TableColumn::new("Phase", "string", "Lifecycle phase"),
        TableColumn::new("IP", "string", "Primary IP address"),
        TableColumn::new("NodeName", "string", "Node running the instance"),
        TableColumn::new("Ready", "string", "Ready condition"),
        TableColumn::new("Live-Migratable", "string", "LiveMigratable condition").priority(1),
    ],
    row: |o| vec![
        age_cell(o),
        Value::String(json_str(o, "status.phase").to_string()),
        Value::String(json_str(o, "status.interfaces.0.ipAddress").to_string()),
        Value::String(json_str(o, "status.nodeName").to_string()),
        condition_cell(o, "Ready"),
        condition_cell(o, "LiveMigratable"),
    ]
}

fn is_mac(s: &str) -> bool {
    let parts: Vec<&str> = s.split([':', '-']).collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Semantic checks of an instance spec; `p` is the path prefix (`spec` or `spec.template.spec`).
pub fn validate_vmi_spec(s: &VirtualMachineInstanceSpec, p: &str, errs: &mut Vec<FieldError>) {
    let d = &s.domain;
    // Memory: KubeVirt requires a request or a guest size.
    let req_mem = d
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("memory"));
    let guest_mem = d.memory.as_ref().and_then(|m| m.guest.as_ref());
    if req_mem.is_none() && guest_mem.is_none() {
        errs.push(FieldError::required(
            format!("{p}.domain.resources.requests.memory"),
            "set resources.requests.memory or memory.guest",
        ));
    }
    for (key, rr) in [
        (
            "requests",
            d.resources.as_ref().and_then(|r| r.requests.as_ref()),
        ),
        (
            "limits",
            d.resources.as_ref().and_then(|r| r.limits.as_ref()),
        ),
    ] {
        for (name, q) in rr.into_iter().flatten() {
            let field = format!("{p}.domain.resources.{key}.{name}");
            let ok = match name.as_str() {
                "cpu" => parse_quantity_millis(&q.0).is_some_and(|m| m > 0),
                "memory" | "ephemeral-storage" | "storage" => {
                    parse_quantity_bytes(&q.0).is_some_and(|b| b > 0)
                }
                _ => parse_quantity_millis(&q.0).is_some(),
            };
            if !ok {
                errs.push(FieldError::invalid(
                    field,
                    &q.0,
                    "must be a positive quantity",
                ));
            }
        }
    }
    if let Some(g) = guest_mem
        && parse_quantity_bytes(&g.0).is_none_or(|b| b < (1 << 20))
    {
        errs.push(FieldError::invalid(
            format!("{p}.domain.memory.guest"),
            &g.0,
            "must be a quantity of at least 1Mi",
        ));
    }
    if let Some(cpu) = &d.cpu {
        for (name, v) in [
            ("cores", cpu.cores),
            ("sockets", cpu.sockets),
            ("threads", cpu.threads),
        ] {
            if v == Some(0) {
                errs.push(FieldError::invalid(
                    format!("{p}.domain.cpu.{name}"),
                    0,
                    "must be at least 1",
                ));
            }
        }
        if cpu.vcpus() > 512 {
            errs.push(FieldError::invalid(
                format!("{p}.domain.cpu"),
                cpu.vcpus(),
                "at most 512 vCPUs",
            ));
        }
    }
    // Volumes.
    let mut vol_names = BTreeSet::new();
    for (i, v) in s.volumes.iter().enumerate() {
        let vp = format!("{p}.volumes[{i}]");
        if v.name.is_empty() {
            errs.push(FieldError::required(format!("{vp}.name"), ""));
        } else if !is_dns_label(&v.name) {
            errs.push(FieldError::invalid(
                format!("{vp}.name"),
                &v.name,
                "must be a lowercase RFC 1123 label",
            ));
        } else if !vol_names.insert(v.name.as_str()) {
            errs.push(FieldError::duplicate(format!("{vp}.name"), &v.name));
        }
        match v.source_count() {
            0 => errs.push(FieldError::required(vp.clone(), "one volume source must be set (persistentVolumeClaim, dataVolume, containerDisk, cloudInitNoCloud, cloudInitConfigDrive, emptyDisk)")),
            1 => {}
            _ => errs.push(FieldError::forbidden(vp.clone(), "only one volume source may be set")),
        }
        if let Some(c) = &v.persistent_volume_claim
            && !is_dns_subdomain(&c.claim_name)
        {
            errs.push(FieldError::invalid(
                format!("{vp}.persistentVolumeClaim.claimName"),
                &c.claim_name,
                "must name a Volume",
            ));
        }
        if let Some(dv) = &v.data_volume
            && !is_dns_subdomain(&dv.name)
        {
            errs.push(FieldError::invalid(
                format!("{vp}.dataVolume.name"),
                &dv.name,
                "must name a Volume",
            ));
        }
        if let Some(cd) = &v.container_disk
            && cd.image.is_empty()
        {
            errs.push(FieldError::required(
                format!("{vp}.containerDisk.image"),
                "",
            ));
        }
        for (key, ci) in [
            ("cloudInitNoCloud", &v.cloud_init_no_cloud),
            ("cloudInitConfigDrive", &v.cloud_init_config_drive),
        ] {
            if let Some(ci) = ci
                && ci.user_data.is_some()
                && ci.user_data_base64.is_some()
            {
                errs.push(FieldError::forbidden(
                    format!("{vp}.{key}.userDataBase64"),
                    "userData and userDataBase64 are mutually exclusive",
                ));
            }
        }
        if let Some(e) = &v.empty_disk
            && parse_quantity_bytes(&e.capacity.0).is_none_or(|b| b == 0)
        {
            errs.push(FieldError::invalid(
                format!("{vp}.emptyDisk.capacity"),
                &e.capacity.0,
                "must be a positive quantity",
            ));
        }
    }
    // Disks.
    let mut disk_names = BTreeSet::new();
    let mut boot_orders = BTreeSet::new();
    for (i, disk) in d.devices.disks.iter().enumerate() {
        let dp = format!("{p}.domain.devices.disks[{i}]");
        if disk.name.is_empty() {
            errs.push(FieldError::required(format!("{dp}.name"), ""));
        } else if !disk_names.insert(disk.name.as_str()) {
            errs.push(FieldError::duplicate(format!("{dp}.name"), &disk.name));
        } else if !vol_names.contains(disk.name.as_str())
            && !s.volumes.iter().any(|v| v.name == disk.name)
        {
            errs.push(FieldError::invalid(
                format!("{dp}.name"),
                &disk.name,
                "no volume of that name in volumes",
            ));
        }
        if disk.disk.is_some() && disk.cdrom.is_some() {
            errs.push(FieldError::forbidden(
                format!("{dp}.cdrom"),
                "a disk may be either disk or cdrom",
            ));
        }
        if let Some(o) = disk.boot_order {
            if o == 0 {
                errs.push(FieldError::invalid(
                    format!("{dp}.bootOrder"),
                    0,
                    "must be at least 1",
                ));
            } else if !boot_orders.insert(o) {
                errs.push(FieldError::duplicate(format!("{dp}.bootOrder"), o));
            }
        }
    }
    // Networks and interfaces.
    let mut net_names = BTreeSet::new();
    for (i, n) in s.networks.iter().enumerate() {
        let np = format!("{p}.networks[{i}]");
        if n.name.is_empty() {
            errs.push(FieldError::required(format!("{np}.name"), ""));
        } else if !net_names.insert(n.name.as_str()) {
            errs.push(FieldError::duplicate(format!("{np}.name"), &n.name));
        }
        if n.pod.is_none() {
            errs.push(FieldError::required(
                format!("{np}.pod"),
                "sheaf supports the pod network only",
            ));
        }
    }
    let mut if_names = BTreeSet::new();
    for (i, ifc) in d.devices.interfaces.iter().enumerate() {
        let ip = format!("{p}.domain.devices.interfaces[{i}]");
        if ifc.name.is_empty() {
            errs.push(FieldError::required(format!("{ip}.name"), ""));
        } else if !if_names.insert(ifc.name.as_str()) {
            errs.push(FieldError::duplicate(format!("{ip}.name"), &ifc.name));
        } else if !net_names.contains(ifc.name.as_str()) {
            errs.push(FieldError::invalid(
                format!("{ip}.name"),
                &ifc.name,
                "no network of that name in networks",
            ));
        }
        if ifc.masquerade.is_some() && ifc.bridge.is_some() {
            errs.push(FieldError::forbidden(
                format!("{ip}.bridge"),
                "only one binding method may be set",
            ));
        }
        if let Some(mac) = &ifc.mac_address
            && !is_mac(mac)
        {
            errs.push(FieldError::invalid(
                format!("{ip}.macAddress"),
                mac,
                "must be a MAC address such as 02:00:00:12:34:56",
            ));
        }
        for (j, port) in ifc.ports.iter().flatten().enumerate() {
            if port.port == 0 {
                errs.push(FieldError::invalid(
                    format!("{ip}.ports[{j}].port"),
                    0,
                    "must be between 1 and 65535",
                ));
            }
            if let Some(proto) = &port.protocol
                && proto != "TCP"
                && proto != "UDP"
            {
                errs.push(FieldError::not_supported(
                    format!("{ip}.ports[{j}].protocol"),
                    proto,
                    &["TCP", "UDP"],
                ));
            }
        }
    }
    if let Some(t) = s.termination_grace_period_seconds
        && t < 0
    {
        errs.push(FieldError::invalid(
            format!("{p}.terminationGracePeriodSeconds"),
            t,
            "must be >= 0",
        ));
    }
    if let Some(h) = &s.hostname
        && !is_dns_label(h)
    {
        errs.push(FieldError::invalid(
            format!("{p}.hostname"),
            h,
            "must be a lowercase RFC 1123 label",
        ));
    }
}

// ---------------------------------------------------------------- Migration

/// Desired migration.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceMigrationSpec {
    /// Name of the instance to migrate (same namespace).
    #[serde(default, rename = "vmiName")]
    pub vmi_name: String,
}

/// Migration phase.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[schemars(inline)]
pub enum MigrationPhase {
    /// Accepted.
    Pending,
    /// Target being chosen.
    Scheduling,
    /// Target chosen.
    Scheduled,
    /// Target being prepared.
    PreparingTarget,
    /// Target ready.
    TargetReady,
    /// Copying.
    Running,
    /// Done.
    Succeeded,
    /// Failed.
    Failed,
}

/// Observed migration state.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceMigrationStatus {
    /// Phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<MigrationPhase>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// Progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_state: Option<MigrationState>,
    /// When each phase was entered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase_transition_timestamps: Option<Vec<PhaseTransition>>,
}

root_kind! {
    /// A request to move an instance to another node.
    VirtualMachineInstanceMigration, spec: VirtualMachineInstanceMigrationSpec,
    status: VirtualMachineInstanceMigrationStatus,
    group: GROUP, version: "v1", plural: "virtualmachineinstancemigrations",
    singular: "virtualmachineinstancemigration", short: ["vmim", "vmims"], scope: Scope::Namespaced,
    validate: |m| {
        let mut errs = Vec::new();
        if m.spec.vmi_name.is_empty() {
            errs.push(FieldError::required("spec.vmiName", "name of the instance to migrate"));
        } else if !is_dns_subdomain(&m.spec.vmi_name) {
            errs.push(FieldError::invalid("spec.vmiName", &m.spec.vmi_name, "must be a lowercase RFC 1123 subdomain"));
        }
        errs
    },
    columns: || vec![
        TableColumn::new("Phase", "string", "Migration phase"),
        TableColumn::new("VMI", "string", "Instance being migrated"),
        TableColumn::new("Age", "date", "Time since creation"),
    ],
    row: |o| vec![
        Value::String(json_str(o, "status.phase").to_string()),
        Value::String(json_str(o, "spec.vmiName").to_string()),
        age_cell(o),
    ]
}
