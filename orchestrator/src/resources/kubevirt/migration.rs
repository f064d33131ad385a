// SPDX-License-Identifier: Apache-2.0
//! VirtualMachineInstanceMigration.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::super::common::{Condition, age_cell, json_str};
use super::super::decode::{FieldError, is_dns_subdomain};
use super::super::{Scope, TableColumn, root_kind};
use super::*;

// ---------------------------------------------------------------- Migration

/// Desired migration.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceMigrationSpec {
    /// Name of the instance to migrate (same namespace).
    #[serde(default, rename = "vmiName")]
    pub vmi_name: String,
    /// Labels the target node must carry, on top of the instance's own
    /// placement rules (KubeVirt's `addedNodeSelector`; e.g.
    /// `kubernetes.io/hostname: node-2` to pick the node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub added_node_selector: Option<std::collections::BTreeMap<String, String>>,
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
