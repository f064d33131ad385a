// SPDX-License-Identifier: Apache-2.0
//! `sheaf.dev/v1`: Volume (a replicated block volume) and Node (a host).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Taint;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::common::{Condition, age_cell, condition_cell, json_path, json_str};
use super::decode::{FieldError, is_dns_subdomain};
use super::quantity::{parse_quantity_bytes, parse_quantity_millis};
use super::{Scope, TableColumn, root_kind};

/// The group of sheaf's own kinds.
pub const GROUP: &str = "sheaf.dev";

/// Largest replica count a Volume may ask for.
pub const MAX_REPLICAS: u32 = 7;

/// Desired state of a Volume.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSpec {
    /// Size (`10Gi`); may grow, never shrink.
    #[serde(default)]
    pub size: Quantity,
    /// Replica count (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// Fewest reachable replicas that still accept writes (default 2, at most `replicas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_write_replicas: Option<u32>,
    /// Initial contents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<VolumeSource>,
    /// Nodes replicas may be placed on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Place replicas in distinct zones when possible (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread_zones: Option<bool>,
}

impl VolumeSpec {
    /// Replica count with the default applied.
    pub fn replica_count(&self) -> u32 {
        self.replicas.unwrap_or(3)
    }
}

/// Initial contents of a Volume.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSource {
    /// A raw or qcow2 image file on the control-plane host, or an `http(s)://` URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Clone of another Volume in the same namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
    /// Digest the downloaded `image` must have: `sha256:<hex>` or
    /// `sha512:<hex>` (of the file as served, before any conversion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<String>,
}

/// Parses a `sha256:<hex>` / `sha512:<hex>` checksum: (algorithm, lowercase hex).
pub fn parse_checksum(c: &str) -> Result<(&'static str, String), String> {
    let (alg, hex) = c
        .split_once(':')
        .ok_or_else(|| "expected sha256:<hex> or sha512:<hex>".to_string())?;
    let (alg, len) = match alg.to_ascii_lowercase().as_str() {
        "sha256" => ("sha256", 64),
        "sha512" => ("sha512", 128),
        other => return Err(format!("algorithm {other:?}: only sha256 and sha512")),
    };
    if hex.len() != len || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("{alg} wants {len} hex digits"));
    }
    Ok((alg, hex.to_ascii_lowercase()))
}

/// Lifecycle phase of a Volume.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[schemars(inline)]
pub enum VolumePhase {
    /// Accepted, replicas not yet placed.
    Pending,
    /// Replicas being created or filled from the source.
    Creating,
    /// Ready, not attached.
    Available,
    /// Attached to a node.
    Attached,
    /// Writable but with fewer healthy replicas than asked for.
    Degraded,
    /// Fewer than `minWriteReplicas` healthy replicas; writes refused.
    Faulted,
    /// Being deleted.
    Deleting,
}

/// State of one replica.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq)]
#[schemars(inline)]
pub enum ReplicaState {
    /// Up to date with the current epoch.
    Healthy,
    /// Being filled from a healthy peer.
    Rebuilding,
    /// Behind (missed writes); waits for rebuild.
    Stale,
    /// Unreachable or broken.
    Failed,
}

/// One replica of a Volume.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaStatus {
    /// Node holding the replica.
    pub node_name: String,
    /// State.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<ReplicaState>,
    /// Highest epoch the replica has accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// Last write index the replica has durable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_index: Option<u64>,
    /// Address of the replica server (`host:port`), once the node serves it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Free-form detail about the last state change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When `state` last changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
}

/// Where a Volume is attached.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Attachment {
    /// Node running the engine.
    pub node_name: String,
    /// Instance using the volume (`namespace/name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Uid of that instance (names are reused when a VM restarts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_uid: Option<String>,
    /// Epoch the attachment was granted with; the engine takes at least this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// Since when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
}

/// Observed state of a Volume.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeStatus {
    /// Phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<VolumePhase>,
    /// Current epoch (bumped by every attach and every fence).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// Replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Vec<ReplicaStatus>>,
    /// Attachment, if attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment: Option<Attachment>,
    /// Size actually provisioned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Quantity>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// Progress of filling the volume from its source (CDI's DataVolume
    /// `status.progress`: `"42.0%"`, `"100.0%"` once imported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<String>,
}

root_kind! {
    /// A replicated block volume (Longhorn's Volume, a PVC for VMs).
    Volume, spec: VolumeSpec, status: VolumeStatus,
    group: GROUP, version: "v1", plural: "volumes", singular: "volume",
    short: ["vol", "vols"], scope: Scope::Namespaced,
    validate: validate_volume,
    columns: || vec![
        TableColumn::new("Size", "string", "Requested size"),
        TableColumn::new("Replicas", "integer", "Replica count"),
        TableColumn::new("Healthy", "integer", "Healthy replicas"),
        TableColumn::new("Phase", "string", "Lifecycle phase"),
        TableColumn::new("Node", "string", "Node the volume is attached to"),
        TableColumn::new("Progress", "string", "Import progress"),
        TableColumn::new("Epoch", "integer", "Current epoch").priority(1),
        TableColumn::new("Age", "date", "Time since creation"),
    ],
    row: |o| {
        let healthy = json_path(o, "status.replicas")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter(|r| json_str(r, "state") == "Healthy").count())
            .unwrap_or(0);
        vec![
            Value::String(json_str(o, "spec.size").to_string()),
            json_path(o, "spec.replicas").cloned().unwrap_or(Value::from(3)),
            Value::from(healthy),
            Value::String(json_str(o, "status.phase").to_string()),
            Value::String(json_str(o, "status.attachment.nodeName").to_string()),
            Value::String(json_str(o, "status.progress").to_string()),
            json_path(o, "status.epoch").cloned().unwrap_or(Value::from(0)),
            age_cell(o),
        ]
    }
}

fn validate_volume(v: &Volume) -> Vec<FieldError> {
    let mut errs = Vec::new();
    if v.spec.size.0.is_empty() {
        errs.push(FieldError::required(
            "spec.size",
            "volume size such as 10Gi",
        ));
    } else if parse_quantity_bytes(&v.spec.size.0).is_none_or(|b| b == 0) {
        errs.push(FieldError::invalid(
            "spec.size",
            &v.spec.size.0,
            "must be a positive quantity such as 10Gi",
        ));
    }
    let replicas = v.spec.replica_count();
    if replicas == 0 || replicas > MAX_REPLICAS {
        errs.push(FieldError::invalid(
            "spec.replicas",
            replicas,
            format!("must be between 1 and {MAX_REPLICAS}"),
        ));
    }
    if let Some(m) = v.spec.min_write_replicas
        && (m == 0 || m > replicas)
    {
        errs.push(FieldError::invalid(
            "spec.minWriteReplicas",
            m,
            "must be between 1 and spec.replicas",
        ));
    }
    if let Some(src) = &v.spec.source {
        match (&src.image, &src.volume) {
            (Some(_), Some(_)) => errs.push(FieldError::forbidden(
                "spec.source",
                "image and volume are mutually exclusive",
            )),
            (Some(i), None) if i.is_empty() => {
                errs.push(FieldError::required("spec.source.image", ""))
            }
            (None, Some(n)) if !is_dns_subdomain(n) => errs.push(FieldError::invalid(
                "spec.source.volume",
                n,
                "must name a Volume",
            )),
            _ => {}
        }
        if let Some(c) = &src.checksum {
            if src.image.is_none() {
                errs.push(FieldError::forbidden(
                    "spec.source.checksum",
                    "only an image source has a checksum",
                ));
            } else if let Err(m) = parse_checksum(c) {
                errs.push(FieldError::invalid("spec.source.checksum", c, m));
            }
        }
    }
    errs
}

/// Desired state of a Node.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeSpec {
    /// No new instances or replicas are placed here (cordon).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unschedulable: Option<bool>,
    /// Taints (Kubernetes shape).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taints: Option<Vec<Taint>>,
    /// Failure zone (also exposed as label `topology.kubernetes.io/zone`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
    /// Address of the node agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_address: Option<String>,
    /// Address of the replica server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_address: Option<String>,
}

/// A node address.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeAddress {
    /// `InternalIP` or `Hostname`.
    #[serde(rename = "type")]
    pub type_: String,
    /// Address.
    pub address: String,
}

/// Facts about the node software.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeInfo {
    /// Agent version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,
    /// VM runtimes available (`sheaf-vmm`, `qemu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtimes: Option<Vec<String>>,
    /// Whether /dev/kvm is usable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvm: Option<bool>,
}

/// Observed state of a Node.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// Total resources (`cpu`, `memory`, `storage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<BTreeMap<String, Quantity>>,
    /// Resources available to instances and replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocatable: Option<BTreeMap<String, Quantity>>,
    /// Conditions; `Ready` carries the heartbeat in `lastHeartbeatTime`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// Addresses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<Vec<NodeAddress>>,
    /// Software facts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_info: Option<NodeInfo>,
    /// The agent's lease (Kubernetes' node Lease, kept on the node): renewed
    /// every heartbeat with sub-second precision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<NodeLease>,
}

/// The node agent's heartbeat lease.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeLease {
    /// Agent instance holding the lease (changes when the agent restarts).
    #[serde(default)]
    pub holder_identity: String,
    /// Last renewal, RFC 3339 with microseconds.
    #[serde(default)]
    pub renew_time: String,
    /// How long the holder promises to renew within.
    #[serde(default)]
    pub lease_duration_seconds: u32,
}

root_kind! {
    /// A host that runs instances (node agent) and stores replicas (replica server).
    Node, spec: NodeSpec, status: NodeStatus,
    group: GROUP, version: "v1", plural: "nodes", singular: "node",
    short: ["no", "snode"], scope: Scope::Cluster,
    validate: validate_node,
    columns: || vec![
        TableColumn::new("Status", "string", "Ready or NotReady"),
        TableColumn::new("Zone", "string", "Failure zone"),
        TableColumn::new("CPU", "string", "Allocatable CPU"),
        TableColumn::new("Memory", "string", "Allocatable memory"),
        TableColumn::new("Age", "date", "Time since creation"),
    ],
    row: |o| {
        let ready = condition_cell(o, "Ready");
        let mut status = match ready.as_str() {
            Some("True") => "Ready".to_string(),
            Some("False") => "NotReady".to_string(),
            _ => "Unknown".to_string(),
        };
        if json_path(o, "spec.unschedulable").and_then(Value::as_bool) == Some(true) {
            status.push_str(",SchedulingDisabled");
        }
        vec![
            Value::String(status),
            Value::String(json_str(o, "spec.zone").to_string()),
            Value::String(json_str(o, "status.allocatable.cpu").to_string()),
            Value::String(json_str(o, "status.allocatable.memory").to_string()),
            age_cell(o),
        ]
    }
}

fn validate_node(n: &Node) -> Vec<FieldError> {
    let mut errs = Vec::new();
    for (i, t) in n.spec.taints.iter().flatten().enumerate() {
        if t.key.is_empty() {
            errs.push(FieldError::required(format!("spec.taints[{i}].key"), ""));
        }
        if !["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&t.effect.as_str()) {
            errs.push(FieldError::not_supported(
                format!("spec.taints[{i}].effect"),
                &t.effect,
                &["NoSchedule", "PreferNoSchedule", "NoExecute"],
            ));
        }
    }
    if let Some(status) = &n.status {
        for (key, map) in [
            ("capacity", &status.capacity),
            ("allocatable", &status.allocatable),
        ] {
            for (name, q) in map.iter().flatten() {
                let ok = if name == "cpu" {
                    parse_quantity_millis(&q.0).is_some()
                } else {
                    parse_quantity_bytes(&q.0).is_some()
                };
                if !ok {
                    errs.push(FieldError::invalid(
                        format!("status.{key}.{name}"),
                        &q.0,
                        "must be a quantity",
                    ));
                }
            }
        }
    }
    errs
}
