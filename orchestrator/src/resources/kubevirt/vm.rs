// SPDX-License-Identifier: Apache-2.0
//! VirtualMachine: the run strategy, template and data volume templates.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::super::common::{Condition, age_cell, json_path, json_str};
use super::super::decode::{FieldError, is_dns_subdomain};
use super::super::quantity::parse_quantity_bytes;
use super::super::{Scope, TableColumn, root_kind};
use super::*;

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
    /// sheaf extension (CDI has none): `sha256:<hex>` or `sha512:<hex>` the
    /// download must match; the `sheaf.dev/checksum` annotation of the
    /// template does the same for stock manifests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
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
            if let Some(h) = &src.http {
                if let Err(e) = crate::images::check_url(&h.url) {
                    errs.push(FieldError::invalid(
                        format!("{p}.spec.source.http.url"),
                        &h.url,
                        e.to_string(),
                    ));
                }
                let ann = dv
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get("sheaf.dev/checksum"));
                if let Some(c) = h.checksum.as_ref().or(ann)
                    && let Err(m) = super::super::sheaf::parse_checksum(c)
                {
                    errs.push(FieldError::invalid(
                        format!("{p}.spec.source.http.checksum"),
                        c,
                        m,
                    ));
                }
            }
            if src.registry.is_some() {
                errs.push(FieldError::forbidden(
                    format!("{p}.spec.source.registry"),
                    "registry sources are not supported yet; use source.http with a raw or qcow2 image URL",
                ));
            }
            if let Some(pvc) = &src.pvc {
                if pvc.name.is_empty() {
                    errs.push(FieldError::required(
                        format!("{p}.spec.source.pvc.name"),
                        "",
                    ));
                } else if !is_dns_subdomain(&pvc.name) {
                    errs.push(FieldError::invalid(
                        format!("{p}.spec.source.pvc.name"),
                        &pvc.name,
                        "must name a Volume",
                    ));
                }
                if let (Some(n), Some(vm_ns)) = (&pvc.namespace, &vm.metadata.namespace)
                    && n != vm_ns
                {
                    errs.push(FieldError::forbidden(
                        format!("{p}.spec.source.pvc.namespace"),
                        "clones across namespaces are not supported; clone a Volume of the VM's namespace",
                    ));
                }
            }
        }
    }
    validate_vmi_spec(&vm.spec.template.spec, "spec.template.spec", &mut errs);
    errs
}
