// SPDX-License-Identifier: Apache-2.0
//! VirtualMachineInstance: spec, status and phase.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, Toleration, TopologySpreadConstraint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::super::common::{Condition, age_cell, condition_cell, json_str};
use super::super::{Scope, TableColumn, root_kind};
use super::*;

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
    /// Address the target listens on for the migration (live only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node_address: Option<String>,
    /// Ports the target listens on, port → 0 (KubeVirt's shape; live only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_direct_migration_node_ports: Option<std::collections::BTreeMap<String, i32>>,
    /// The guest runs on the target (live only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node_domain_detected: Option<bool>,
    /// When the guest was seen running on the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node_domain_ready_timestamp: Option<Time>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
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
