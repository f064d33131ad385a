// SPDX-License-Identifier: Apache-2.0
//! The public, serde-serializable data model: nodes, requests and placements.
//!
//! These types are the stable surface that the orchestrator and the C and
//! Python bindings exchange (as Rust values or as JSON). Field names follow the
//! Kubernetes API where one exists (`nodeSelector`, `tolerations`, ...) but use
//! snake_case in JSON like the rest of sheaf.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Well-known node label holding the node's zone. [`Node::zone`] is mirrored
/// into it, so topology keys can always name zones by this label.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Well-known node label holding the node's name. Every node carries it, so
/// `topology_key = HOSTNAME_LABEL` means "per node".
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";
/// Taint key that the NodeUnschedulable plugin treats as tolerating a cordoned
/// node (same key as Kubernetes).
pub const UNSCHEDULABLE_TAINT_KEY: &str = "node.kubernetes.io/unschedulable";

/// An amount of CPU and memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Resources {
    /// CPU in millicores (1000 = one core).
    #[serde(default)]
    pub cpu_millis: u64,
    /// Memory in bytes.
    #[serde(default)]
    pub memory_bytes: u64,
}

impl Resources {
    /// CPU in millicores and memory in bytes.
    pub const fn new(cpu_millis: u64, memory_bytes: u64) -> Self {
        Self {
            cpu_millis,
            memory_bytes,
        }
    }

    /// Component-wise saturating addition.
    pub const fn saturating_add(self, other: Self) -> Self {
        Self {
            cpu_millis: self.cpu_millis.saturating_add(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_add(other.memory_bytes),
        }
    }

    /// Component-wise saturating subtraction.
    pub const fn saturating_sub(self, other: Self) -> Self {
        Self {
            cpu_millis: self.cpu_millis.saturating_sub(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_sub(other.memory_bytes),
        }
    }
}

/// What a taint does to VMs that do not tolerate it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TaintEffect {
    /// New VMs are not placed on the node.
    NoSchedule,
    /// The scheduler avoids the node but may still use it.
    PreferNoSchedule,
    /// New VMs are not placed, and running ones are evicted (eviction is the
    /// orchestrator's job; for placement it acts like `NoSchedule`).
    NoExecute,
}

/// A node taint: repels VMs that do not tolerate it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Taint {
    /// Taint key.
    pub key: String,
    /// Taint value (may be empty).
    #[serde(default)]
    pub value: String,
    /// Effect on VMs that do not tolerate it.
    pub effect: TaintEffect,
}

/// How a toleration compares its value with a taint's value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TolerationOperator {
    /// Key and value must be equal.
    #[default]
    Equal,
    /// Any value; with an empty key, any taint.
    Exists,
}

/// A VM's toleration of node taints.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Toleration {
    /// Taint key to tolerate; empty with `Exists` tolerates every taint.
    #[serde(default)]
    pub key: String,
    /// Comparison of the values.
    #[serde(default)]
    pub operator: TolerationOperator,
    /// Value to match with `Equal`.
    #[serde(default)]
    pub value: String,
    /// Effect to tolerate; `None` tolerates all effects.
    #[serde(default)]
    pub effect: Option<TaintEffect>,
}

/// A local disk on a node that can hold volume replicas.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disk {
    /// Disk name, unique within its node.
    pub name: String,
    /// Total size in bytes.
    pub capacity_bytes: u64,
    /// Bytes kept free for the system (not schedulable).
    #[serde(default)]
    pub reserved_bytes: u64,
    /// Bytes already promised to replicas (their full volume size).
    #[serde(default)]
    pub scheduled_bytes: u64,
    /// Tags a volume's `disk_tags` must all be present in.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Whether new replicas may be placed on this disk.
    #[serde(default = "yes")]
    pub schedulable: bool,
}

fn yes() -> bool {
    true
}

fn default_max_vms() -> u32 {
    110
}

/// A node that can run VMs and hold volume replicas.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    /// Unique node name.
    pub name: String,
    /// Zone (failure domain); mirrored into the [`ZONE_LABEL`] label.
    #[serde(default)]
    pub zone: Option<String>,
    /// Total resources of the machine.
    pub capacity: Resources,
    /// Resources available to VMs; `None` means the whole capacity.
    #[serde(default)]
    pub allocatable: Option<Resources>,
    /// Maximum number of VMs (like a kubelet's `maxPods`, default 110).
    #[serde(default = "default_max_vms")]
    pub max_vms: u32,
    /// Node labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Node taints.
    #[serde(default)]
    pub taints: Vec<Taint>,
    /// Cordoned: no new VMs unless they tolerate [`UNSCHEDULABLE_TAINT_KEY`].
    #[serde(default)]
    pub unschedulable: bool,
    /// Local disks for volume replicas.
    #[serde(default)]
    pub disks: Vec<Disk>,
}

impl Node {
    /// A node with `cpu_millis` and `memory_bytes` of capacity (all
    /// allocatable) and defaults elsewhere.
    pub fn new(name: impl Into<String>, cpu_millis: u64, memory_bytes: u64) -> Self {
        Self {
            name: name.into(),
            zone: None,
            capacity: Resources::new(cpu_millis, memory_bytes),
            allocatable: None,
            max_vms: default_max_vms(),
            labels: BTreeMap::new(),
            taints: Vec::new(),
            unschedulable: false,
            disks: Vec::new(),
        }
    }

    /// Sets the zone.
    #[must_use]
    pub fn zone(mut self, zone: impl Into<String>) -> Self {
        self.zone = Some(zone.into());
        self
    }

    /// Adds a label.
    #[must_use]
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Adds a taint.
    #[must_use]
    pub fn taint(
        mut self,
        key: impl Into<String>,
        value: impl Into<String>,
        effect: TaintEffect,
    ) -> Self {
        self.taints.push(Taint {
            key: key.into(),
            value: value.into(),
            effect,
        });
        self
    }

    /// Adds a schedulable disk of `capacity_bytes` with no tags.
    #[must_use]
    pub fn disk(mut self, name: impl Into<String>, capacity_bytes: u64) -> Self {
        self.disks.push(Disk {
            name: name.into(),
            capacity_bytes,
            reserved_bytes: 0,
            scheduled_bytes: 0,
            tags: Vec::new(),
            schedulable: true,
        });
        self
    }

    /// Sets the maximum number of VMs.
    #[must_use]
    pub fn max_vms(mut self, max_vms: u32) -> Self {
        self.max_vms = max_vms;
        self
    }

    /// The allocatable resources (capacity when not set).
    pub fn allocatable_resources(&self) -> Resources {
        self.allocatable.unwrap_or(self.capacity)
    }
}

/// Operator of a label [`Requirement`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Operator {
    /// The label's value is one of `values`.
    In,
    /// The label is absent or its value is not one of `values`.
    NotIn,
    /// The label is present.
    Exists,
    /// The label is absent.
    DoesNotExist,
    /// The label's value, as an integer, is greater than `values[0]` (node
    /// affinity only).
    Gt,
    /// The label's value, as an integer, is less than `values[0]` (node
    /// affinity only).
    Lt,
}

/// One requirement on a label.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Requirement {
    /// Label key.
    pub key: String,
    /// Comparison.
    pub operator: Operator,
    /// Values for `In`, `NotIn`, `Gt`, `Lt`.
    #[serde(default)]
    pub values: Vec<String>,
}

impl Requirement {
    /// `key In (values)`.
    pub fn is_in<I, S>(key: impl Into<String>, values: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            key: key.into(),
            operator: Operator::In,
            values: values.into_iter().map(Into::into).collect(),
        }
    }
}

/// A selector over VM labels: all `match_labels` and all `match_expressions`
/// must hold. An empty selector matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LabelSelector {
    /// Labels that must be present with these values.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
    /// Further requirements.
    #[serde(default)]
    pub match_expressions: Vec<Requirement>,
}

impl LabelSelector {
    /// A selector matching `key=value`.
    pub fn eq(key: impl Into<String>, value: impl Into<String>) -> Self {
        let mut match_labels = BTreeMap::new();
        match_labels.insert(key.into(), value.into());
        Self {
            match_labels,
            match_expressions: Vec::new(),
        }
    }
}

/// A node selector term: all requirements must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NodeSelectorTerm {
    /// Requirements on node labels (ANDed).
    #[serde(default)]
    pub match_expressions: Vec<Requirement>,
}

/// A preferred node selector term with its weight (1..=100).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PreferredNodeTerm {
    /// Weight added to a node's score when the term matches.
    pub weight: i32,
    /// The term.
    pub term: NodeSelectorTerm,
}

/// Node affinity: `required` terms are ORed; `preferred` terms add weight.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NodeAffinity {
    /// The node must match at least one of these terms (if any are given).
    #[serde(default)]
    pub required: Vec<NodeSelectorTerm>,
    /// Terms that make a node more attractive.
    #[serde(default)]
    pub preferred: Vec<PreferredNodeTerm>,
}

/// A VM (anti-)affinity term: VMs matching `selector` in the same topology
/// domain (nodes with equal values of `topology_key`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VmAffinityTerm {
    /// Which VMs the term is about.
    pub selector: LabelSelector,
    /// Node label whose value defines the domain, e.g. [`HOSTNAME_LABEL`]
    /// or [`ZONE_LABEL`].
    pub topology_key: String,
}

/// A preferred VM (anti-)affinity term with its weight (1..=100).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WeightedVmAffinityTerm {
    /// Weight per matching VM in the domain.
    pub weight: i32,
    /// The term.
    pub term: VmAffinityTerm,
}

/// Inter-VM affinity or anti-affinity.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VmAffinity {
    /// Hard terms (all must hold).
    #[serde(default)]
    pub required: Vec<VmAffinityTerm>,
    /// Soft terms.
    #[serde(default)]
    pub preferred: Vec<WeightedVmAffinityTerm>,
}

impl VmAffinity {
    /// True when there are no terms.
    pub fn is_empty(&self) -> bool {
        self.required.is_empty() && self.preferred.is_empty()
    }
}

/// What to do when a topology spread constraint cannot be met.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WhenUnsatisfiable {
    /// Filter: nodes that would exceed the skew are infeasible.
    #[default]
    DoNotSchedule,
    /// Score: prefer nodes that reduce the skew.
    ScheduleAnyway,
}

/// Spread VMs matching `selector` evenly across the domains of `topology_key`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TopologySpreadConstraint {
    /// Largest allowed difference between a domain's count and the minimum.
    pub max_skew: u32,
    /// Node label that defines domains.
    pub topology_key: String,
    /// Hard or soft.
    #[serde(default)]
    pub when_unsatisfiable: WhenUnsatisfiable,
    /// Which VMs are counted.
    pub selector: LabelSelector,
}

/// Whether a VM may preempt lower-priority VMs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PreemptionPolicy {
    /// Evict lower-priority VMs when nothing fits.
    #[default]
    PreemptLowerPriority,
    /// Never preempt.
    Never,
}

/// How strongly a VM wants to run where its volume has a replica.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DataLocality {
    /// Ignore replica locations.
    Disabled,
    /// Prefer nodes holding a healthy replica, then nodes in such a zone.
    #[default]
    BestEffort,
    /// Only nodes holding a healthy replica.
    StrictLocal,
}

/// Where a replica of a volume lives.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReplicaLocation {
    /// Node holding the replica.
    pub node: String,
    /// Disk on that node, if known.
    #[serde(default)]
    pub disk: Option<String>,
    /// Whether the replica is complete and current.
    #[serde(default = "yes")]
    pub healthy: bool,
}

impl ReplicaLocation {
    /// A healthy replica on `node`.
    pub fn healthy(node: impl Into<String>) -> Self {
        Self {
            node: node.into(),
            disk: None,
            healthy: true,
        }
    }
}

/// A request to place one VM.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// VM name, unique in the snapshot once bound.
    pub name: String,
    /// VM labels (what other VMs' selectors see).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Resources the VM needs.
    #[serde(default)]
    pub resources: Resources,
    /// Priority; higher may preempt lower.
    #[serde(default)]
    pub priority: i32,
    /// Whether this VM may preempt others.
    #[serde(default)]
    pub preemption_policy: PreemptionPolicy,
    /// Pin to one node (like `spec.nodeName`, used for migration targets).
    #[serde(default)]
    pub node_name: Option<String>,
    /// Node labels that must all be present with these values.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Node affinity.
    #[serde(default)]
    pub node_affinity: NodeAffinity,
    /// Inter-VM affinity.
    #[serde(default)]
    pub affinity: VmAffinity,
    /// Inter-VM anti-affinity.
    #[serde(default)]
    pub anti_affinity: VmAffinity,
    /// Tolerated taints.
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    /// Topology spread constraints.
    #[serde(default)]
    pub topology_spread: Vec<TopologySpreadConstraint>,
    /// Where the replicas of the VM's (boot) volume live.
    #[serde(default)]
    pub volume_replicas: Vec<ReplicaLocation>,
    /// How to use `volume_replicas`.
    #[serde(default)]
    pub data_locality: DataLocality,
    /// Scheduler profile (like `schedulerName`); `None` is the first profile.
    #[serde(default)]
    pub profile: Option<String>,
}

impl Request {
    /// A request for a VM named `name` needing `cpu_millis` and `memory_bytes`.
    pub fn new(name: impl Into<String>, cpu_millis: u64, memory_bytes: u64) -> Self {
        Self {
            name: name.into(),
            resources: Resources::new(cpu_millis, memory_bytes),
            ..Self::default()
        }
    }

    /// Adds a label.
    #[must_use]
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Sets the priority.
    #[must_use]
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    /// Requires the node label `key=value`.
    #[must_use]
    pub fn node_selector(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.node_selector.insert(key.into(), value.into());
        self
    }

    /// Tolerates taints with `key=value` (any effect).
    #[must_use]
    pub fn tolerate(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.tolerations.push(Toleration {
            key: key.into(),
            operator: TolerationOperator::Equal,
            value: value.into(),
            effect: None,
        });
        self
    }

    /// Requires that no VM labelled `key=value` runs in the same domain of
    /// `topology_key`.
    #[must_use]
    pub fn anti_affinity(
        mut self,
        key: impl Into<String>,
        value: impl Into<String>,
        topology_key: impl Into<String>,
    ) -> Self {
        self.anti_affinity.required.push(VmAffinityTerm {
            selector: LabelSelector::eq(key, value),
            topology_key: topology_key.into(),
        });
        self
    }

    /// Requires a VM labelled `key=value` in the same domain of `topology_key`.
    #[must_use]
    pub fn affinity(
        mut self,
        key: impl Into<String>,
        value: impl Into<String>,
        topology_key: impl Into<String>,
    ) -> Self {
        self.affinity.required.push(VmAffinityTerm {
            selector: LabelSelector::eq(key, value),
            topology_key: topology_key.into(),
        });
        self
    }

    /// Adds a topology spread constraint over VMs labelled `key=value`.
    #[must_use]
    pub fn spread(
        mut self,
        topology_key: impl Into<String>,
        max_skew: u32,
        when: WhenUnsatisfiable,
        key: impl Into<String>,
        value: impl Into<String>,
    ) -> Self {
        self.topology_spread.push(TopologySpreadConstraint {
            max_skew,
            topology_key: topology_key.into(),
            when_unsatisfiable: when,
            selector: LabelSelector::eq(key, value),
        });
        self
    }

    /// Records a healthy replica of the VM's volume on `node`.
    #[must_use]
    pub fn replica_on(mut self, node: impl Into<String>) -> Self {
        self.volume_replicas.push(ReplicaLocation::healthy(node));
        self
    }
}

/// The scheduler's answer for one VM.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Chosen node.
    pub node: String,
    /// VMs that must be evicted first (preemption); empty normally.
    #[serde(default)]
    pub victims: Vec<String>,
    /// Weighted total score of the chosen node (0 when only one node fit).
    pub score: i64,
    /// Nodes run through the filters.
    pub evaluated_nodes: u32,
    /// Nodes that passed the filters.
    pub feasible_nodes: u32,
}

/// Whether replicas of one volume may share a zone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ZoneAntiAffinity {
    /// Prefer distinct zones, share zones when there are not enough.
    #[default]
    Soft,
    /// Distinct zones or fail.
    Hard,
}

/// A request to place a volume's replicas (Longhorn's replica scheduler).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRequest {
    /// Volume name (for messages).
    pub volume: String,
    /// Volume size; each replica reserves this much on its disk.
    pub size_bytes: u64,
    /// Desired number of replicas, including `existing` healthy ones.
    pub replicas: u32,
    /// Replicas that already exist (they keep their nodes; new ones avoid them).
    #[serde(default)]
    pub existing: Vec<ReplicaLocation>,
    /// Node labels a replica node must have.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Tags a disk must all have.
    #[serde(default)]
    pub disk_tags: Vec<String>,
    /// Zone spreading mode.
    #[serde(default)]
    pub zone_anti_affinity: ZoneAntiAffinity,
}

/// Where to create one new replica.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReplicaTarget {
    /// Node.
    pub node: String,
    /// Disk on the node.
    pub disk: String,
    /// Zone of the node, if it has one.
    pub zone: Option<String>,
}

/// The replica scheduler's answer: the new replicas to create.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaPlacement {
    /// Volume name.
    pub volume: String,
    /// Bytes each replica reserves.
    pub size_bytes: u64,
    /// New replicas, in the order chosen (best first).
    pub targets: Vec<ReplicaTarget>,
}
