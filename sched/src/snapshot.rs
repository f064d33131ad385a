// SPDX-License-Identifier: Apache-2.0
//! The indexed cluster snapshot the scheduler decides on.
//!
//! ```text
//!  ClusterSnapshot
//!  ├── nodes: Vec<NodeInfo>            slot-indexed; free slots are reused
//!  │     requested / allocatable / vm count (precomputed, updated on bind)
//!  │     labels + taints as interned symbols, VM ids on the node
//!  ├── stamps: Vec<u64>                per node slot, changes with its resources
//!  │                                    (key of the scheduler's score cache)
//!  ├── vms: Vec<Option<VmInfo>>        slot-indexed bound VMs
//!  ├── columns: Vec<TopoColumn>        one per node label key:
//!  │     domain_of[node slot] -> dense domain id (zone, hostname, rack...)
//!  ├── node_pairs: (key,value) -> sorted node slots     (node selector index)
//!  ├── vm_pairs:   (key,value) -> {node slot: count}    (VM affinity index)
//!  └── anti_groups: required anti-affinity terms of bound VMs, grouped by
//!        (selector, topology key), with per-node counts, indexed by the
//!        selector's first (key,value)               (symmetric anti-affinity)
//! ```
//!
//! Every update is incremental: adding, updating or removing a node and
//! binding or unbinding a VM touch only that node's or VM's entries. Decisions
//! index vectors by slot; hashing happens once per decision, not per node.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{SchedError, SchedResult};
use crate::intern::{Interner, Labels, Sym, intern_labels, label_value};
use crate::selector::CSelector;
use crate::types::{
    Disk, HOSTNAME_LABEL, Node, ReplicaPlacement, Request, Resources, TaintEffect, ZONE_LABEL,
};

/// Domain id meaning "the node does not have this label".
pub(crate) const NO_DOMAIN: u32 = u32::MAX;

static NEXT_STAMP: AtomicU64 = AtomicU64::new(1);

/// A process-wide unique, never-zero stamp for a node's resource state.
fn new_stamp() -> u64 {
    NEXT_STAMP.fetch_add(1, Ordering::Relaxed)
}

/// A taint with interned key and value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TaintInfo {
    pub(crate) key: Sym,
    pub(crate) value: Sym,
    pub(crate) effect: TaintEffect,
}

/// A node as the scheduler sees it: its spec plus what is bound to it.
///
/// Plugins receive `&NodeInfo` in their filter and score methods. During
/// preemption the node is a modified copy (victims removed), so plugins must
/// read node state from this value, never from the snapshot by name.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub(crate) slot: u32,
    pub(crate) alive: bool,
    pub(crate) unschedulable: bool,
    pub(crate) vm_count: u32,
    pub(crate) max_vms: u32,
    pub(crate) allocatable: Resources,
    /// `1 / allocatable` per resource (0 when none): scorers multiply
    /// instead of dividing per node.
    pub(crate) inv_allocatable: (f64, f64),
    pub(crate) requested: Resources,
    /// Shared so that preemption's per-candidate copies are cheap.
    pub(crate) taints: Arc<[TaintInfo]>,
    /// Shared so that preemption's per-candidate copies are cheap.
    pub(crate) labels: Arc<[(Sym, Sym)]>,
    pub(crate) zone: Option<Sym>,
    pub(crate) vms: Vec<u32>,
    pub(crate) spec: Arc<Node>,
}

impl NodeInfo {
    /// Node name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Stable slot index of the node in its snapshot (valid until removal).
    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The node as it was added or last updated (disk usage is kept current).
    pub fn spec(&self) -> &Node {
        &self.spec
    }

    /// Allocatable resources.
    pub fn allocatable(&self) -> Resources {
        self.allocatable
    }

    /// Sum of the resources of the VMs bound here.
    pub fn requested(&self) -> Resources {
        self.requested
    }

    /// Number of VMs bound here.
    pub fn vm_count(&self) -> u32 {
        self.vm_count
    }

    /// Maximum number of VMs.
    pub fn max_vms(&self) -> u32 {
        self.max_vms
    }

    /// Whether the node is cordoned.
    pub fn is_unschedulable(&self) -> bool {
        self.unschedulable
    }

    /// Ids of the VMs bound here (see [`ClusterSnapshot::vm`]).
    pub fn vm_ids(&self) -> &[u32] {
        &self.vms
    }

    /// Makes `self` a copy of `other`, reusing `self`'s buffers (preemption
    /// simulates evictions on one such copy per candidate).
    pub(crate) fn copy_from(&mut self, other: &NodeInfo) {
        let NodeInfo {
            slot,
            alive,
            unschedulable,
            vm_count,
            max_vms,
            allocatable,
            inv_allocatable,
            requested,
            taints,
            labels,
            zone,
            vms,
            spec,
        } = other;
        self.slot = *slot;
        self.alive = *alive;
        self.unschedulable = *unschedulable;
        self.vm_count = *vm_count;
        self.max_vms = *max_vms;
        self.allocatable = *allocatable;
        self.inv_allocatable = *inv_allocatable;
        self.requested = *requested;
        self.taints.clone_from(taints);
        self.labels.clone_from(labels);
        self.zone = *zone;
        self.vms.clone_from(vms);
        self.spec.clone_from(spec);
    }

    pub(crate) fn remove_vm_usage(&mut self, vm: &VmInfo) {
        self.requested = self.requested.saturating_sub(vm.resources);
        self.vm_count = self.vm_count.saturating_sub(1);
        if let Some(i) = self.vms.iter().position(|&v| v == vm.id) {
            self.vms.swap_remove(i);
        }
    }

    pub(crate) fn add_vm_usage(&mut self, vm: &VmInfo) {
        self.requested = self.requested.saturating_add(vm.resources);
        self.vm_count += 1;
        self.vms.push(vm.id);
    }
}

/// A VM bound in the snapshot.
#[derive(Clone, Debug)]
pub struct VmInfo {
    pub(crate) id: u32,
    pub(crate) name: String,
    pub(crate) node: u32,
    pub(crate) resources: Resources,
    pub(crate) priority: i32,
    pub(crate) labels: Labels,
    pub(crate) seq: u64,
    pub(crate) anti_groups: Vec<u32>,
}

impl VmInfo {
    /// VM name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Priority.
    pub fn priority(&self) -> i32 {
        self.priority
    }
    /// Resources.
    pub fn resources(&self) -> Resources {
        self.resources
    }
    /// Slot of the node it is bound to.
    pub fn node_slot(&self) -> u32 {
        self.node
    }
    /// Bind order (lower = bound earlier).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

/// Dense topology domains of one node label key.
#[derive(Clone, Debug, Default)]
pub(crate) struct TopoColumn {
    /// Domain id per node slot, or [`NO_DOMAIN`].
    pub(crate) domain_of: Vec<u32>,
    value_to_domain: HashMap<Sym, u32>,
    /// Label value of each domain.
    pub(crate) domain_values: Vec<Sym>,
    /// Live nodes per domain.
    pub(crate) nodes_per_domain: Vec<u32>,
}

impl TopoColumn {
    pub(crate) fn domains(&self) -> usize {
        self.nodes_per_domain.len()
    }
}

/// Required anti-affinity terms of bound VMs that share selector and key.
#[derive(Clone, Debug)]
pub(crate) struct AntiGroup {
    pub(crate) selector: CSelector,
    pub(crate) topology_key: Sym,
    /// Number of member VMs per node slot.
    pub(crate) per_node: HashMap<u32, u32>,
}

/// Indexed, incrementally updated view of the cluster.
#[derive(Clone, Debug, Default)]
pub struct ClusterSnapshot {
    pub(crate) interner: Interner,
    pub(crate) nodes: Vec<NodeInfo>,
    /// Per node slot: changes (to a process-wide unique value) whenever the
    /// node's `requested`, `allocatable`, `vm_count` or `max_vms` change, so
    /// scores that depend only on those can be cached per node (see
    /// [`ScorePlugin::resources_only`](crate::framework::ScorePlugin::resources_only)).
    pub(crate) stamps: Vec<u64>,
    free_slots: Vec<u32>,
    by_name: HashMap<String, u32>,
    live_nodes: u32,
    pub(crate) vms: Vec<Option<VmInfo>>,
    free_vms: Vec<u32>,
    vm_by_name: HashMap<String, u32>,
    pub(crate) vm_pairs: HashMap<(Sym, Sym), HashMap<u32, u32>>,
    pub(crate) node_pairs: HashMap<(Sym, Sym), Vec<u32>>,
    pub(crate) columns: Vec<TopoColumn>,
    column_of: HashMap<Sym, usize>,
    pub(crate) anti_groups: Vec<AntiGroup>,
    anti_group_of: HashMap<(CSelector, Sym), u32>,
    pub(crate) anti_by_pair: HashMap<(Sym, Sym), Vec<u32>>,
    pub(crate) anti_unkeyed: Vec<u32>,
    pub(crate) prefer_no_schedule_nodes: u32,
    seq: u64,
}

impl ClusterSnapshot {
    /// An empty snapshot.
    pub fn new() -> Self {
        Self::default()
    }

    /// A snapshot holding `nodes`.
    pub fn from_nodes(nodes: impl IntoIterator<Item = Node>) -> SchedResult<Self> {
        let mut s = Self::new();
        for n in nodes {
            s.add_node(n)?;
        }
        Ok(s)
    }

    /// Reserves room for `additional` more bound VMs, so a large fill does
    /// not pause to grow its tables.
    pub fn reserve_vms(&mut self, additional: usize) {
        self.vms.reserve(additional);
        self.vm_by_name.reserve(additional);
    }

    /// Number of live nodes.
    pub fn node_count(&self) -> usize {
        self.live_nodes as usize
    }

    /// Number of bound VMs.
    pub fn vm_count(&self) -> usize {
        self.vm_by_name.len()
    }

    /// Number of node slots (live and free); slots are `0..slot_count()`.
    pub fn slot_count(&self) -> usize {
        self.nodes.len()
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> Option<&NodeInfo> {
        self.by_name.get(name).map(|&s| &self.nodes[s as usize])
    }

    /// The live node in `slot`.
    pub fn node_at(&self, slot: u32) -> Option<&NodeInfo> {
        self.nodes.get(slot as usize).filter(|n| n.alive)
    }

    /// Live nodes in slot order.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes.iter().filter(|n| n.alive)
    }

    /// A bound VM by id (see [`NodeInfo::vm_ids`]).
    pub fn vm(&self, id: u32) -> Option<&VmInfo> {
        self.vms.get(id as usize).and_then(Option::as_ref)
    }

    /// The bound VM called `name`.
    pub fn vm_by_name(&self, name: &str) -> Option<&VmInfo> {
        self.vm_by_name.get(name).and_then(|&id| self.vm(id))
    }

    /// Name of the node the VM called `name` is bound to.
    pub fn vm_node(&self, name: &str) -> Option<&str> {
        self.vm_by_name(name)
            .map(|vm| self.nodes[vm.node as usize].name())
    }

    /// The value of label `key` on `node`.
    pub fn node_label(&self, node: &NodeInfo, key: &str) -> Option<&str> {
        let k = self.interner.get(key)?;
        label_value(&node.labels, k).map(|v| self.interner.resolve(v))
    }

    /// Adds a node. Fails if a node of that name exists.
    pub fn add_node(&mut self, node: Node) -> SchedResult<()> {
        if self.by_name.contains_key(&node.name) {
            return Err(SchedError::NodeExists { node: node.name });
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                let s = u32::try_from(self.nodes.len()).map_err(|_| SchedError::TooManyNodes)?;
                self.nodes.push(NodeInfo {
                    slot: s,
                    alive: false,
                    unschedulable: false,
                    vm_count: 0,
                    max_vms: 0,
                    allocatable: Resources::default(),
                    inv_allocatable: (0.0, 0.0),
                    requested: Resources::default(),
                    taints: Arc::from([]),
                    labels: Arc::from([]),
                    zone: None,
                    vms: Vec::new(),
                    spec: Arc::new(Node::new("", 0, 0)),
                });
                for c in &mut self.columns {
                    c.domain_of.push(NO_DOMAIN);
                }
                self.stamps.push(0);
                s
            }
        };
        self.by_name.insert(node.name.clone(), slot);
        self.live_nodes += 1;
        let info = &mut self.nodes[slot as usize];
        info.alive = true;
        info.vm_count = 0;
        info.requested = Resources::default();
        info.vms.clear();
        self.attach_spec(slot, node);
        Ok(())
    }

    /// Replaces a node's spec (labels, taints, resources, disks) and keeps the
    /// VMs bound to it.
    pub fn update_node(&mut self, node: Node) -> SchedResult<()> {
        let slot = self.slot_of(&node.name)?;
        self.detach_spec(slot);
        self.attach_spec(slot, node);
        Ok(())
    }

    /// Cordons or uncordons a node.
    pub fn set_unschedulable(&mut self, node: &str, unschedulable: bool) -> SchedResult<()> {
        let slot = self.slot_of(node)?;
        let n = &mut self.nodes[slot as usize];
        n.unschedulable = unschedulable;
        Arc::make_mut(&mut n.spec).unschedulable = unschedulable;
        Ok(())
    }

    /// Removes a node and unbinds its VMs; returns their names.
    pub fn remove_node(&mut self, node: &str) -> SchedResult<Vec<String>> {
        let slot = self.slot_of(node)?;
        let vm_ids = self.nodes[slot as usize].vms.clone();
        let mut evicted = Vec::with_capacity(vm_ids.len());
        for id in vm_ids {
            if let Some(vm) = self.remove_vm_by_id(id) {
                evicted.push(vm.name);
            }
        }
        self.detach_spec(slot);
        let n = &mut self.nodes[slot as usize];
        n.alive = false;
        n.spec = Arc::new(Node::new("", 0, 0));
        self.by_name.remove(node);
        self.live_nodes -= 1;
        self.free_slots.push(slot);
        Ok(evicted)
    }

    /// Records that the VM described by `request` runs on `node` (Kubernetes'
    /// "assume"): its resources, labels and required anti-affinity count
    /// from now on.
    pub fn bind(&mut self, request: &Request, node: &str) -> SchedResult<()> {
        let slot = self.slot_of(node)?;
        if self.vm_by_name.contains_key(&request.name) {
            return Err(SchedError::VmExists {
                vm: request.name.clone(),
            });
        }
        let labels = intern_labels(&mut self.interner, &request.labels);
        let mut anti_groups = Vec::with_capacity(request.anti_affinity.required.len());
        for term in &request.anti_affinity.required {
            let sel = CSelector::intern(&mut self.interner, &term.selector);
            let key = self.interner.intern(&term.topology_key);
            let g = self.anti_group(sel, key);
            *self.anti_groups[g as usize]
                .per_node
                .entry(slot)
                .or_insert(0) += 1;
            anti_groups.push(g);
        }
        let id = match self.free_vms.pop() {
            Some(id) => id,
            None => {
                let id = u32::try_from(self.vms.len()).map_err(|_| SchedError::TooManyVms)?;
                self.vms.push(None);
                id
            }
        };
        for &pair in &labels {
            *self
                .vm_pairs
                .entry(pair)
                .or_default()
                .entry(slot)
                .or_insert(0) += 1;
        }
        self.seq += 1;
        let vm = VmInfo {
            id,
            name: request.name.clone(),
            node: slot,
            resources: request.resources,
            priority: request.priority,
            labels,
            seq: self.seq,
            anti_groups,
        };
        self.nodes[slot as usize].add_vm_usage(&vm);
        self.stamps[slot as usize] = new_stamp();
        self.vm_by_name.insert(vm.name.clone(), id);
        self.vms[id as usize] = Some(vm);
        Ok(())
    }

    /// Forgets the VM called `name` (deleted, evicted, or a failed bind).
    pub fn unbind(&mut self, name: &str) -> SchedResult<()> {
        let id = *self
            .vm_by_name
            .get(name)
            .ok_or_else(|| SchedError::UnknownVm { vm: name.into() })?;
        self.remove_vm_by_id(id);
        Ok(())
    }

    /// Reserves disk space for replicas chosen by
    /// [`Scheduler::place_replicas`](crate::Scheduler::place_replicas).
    pub fn bind_replicas(&mut self, placement: &ReplicaPlacement) -> SchedResult<()> {
        for t in &placement.targets {
            self.disk_mut(&t.node, &t.disk)?;
        }
        for t in &placement.targets {
            let d = self.disk_mut(&t.node, &t.disk)?;
            d.scheduled_bytes = d.scheduled_bytes.saturating_add(placement.size_bytes);
        }
        Ok(())
    }

    /// Releases `bytes` reserved for a replica on `node`'s `disk`.
    pub fn release_replica(&mut self, node: &str, disk: &str, bytes: u64) -> SchedResult<()> {
        let d = self.disk_mut(node, disk)?;
        d.scheduled_bytes = d.scheduled_bytes.saturating_sub(bytes);
        Ok(())
    }

    fn disk_mut(&mut self, node: &str, disk: &str) -> SchedResult<&mut Disk> {
        let slot = self.slot_of(node)?;
        Arc::make_mut(&mut self.nodes[slot as usize].spec)
            .disks
            .iter_mut()
            .find(|d| d.name == disk)
            .ok_or_else(|| SchedError::UnknownDisk {
                node: node.into(),
                disk: disk.into(),
            })
    }

    pub(crate) fn slot_of(&self, node: &str) -> SchedResult<u32> {
        self.by_name
            .get(node)
            .copied()
            .ok_or_else(|| SchedError::UnknownNode { node: node.into() })
    }

    /// Sorted slots of the live nodes in the given domains of column `col`
    /// (from the `(key, value) -> nodes` index).
    pub(crate) fn nodes_in_domains(&self, key: Sym, col: usize, domains: &[u32]) -> Vec<u32> {
        let column = &self.columns[col];
        let lists = domains.iter().filter_map(|&d| {
            self.node_pairs
                .get(&(key, column.domain_values[d as usize]))
        });
        // Merge the sorted per-domain lists through a bitset: O(slots / 64 +
        // nodes), no sort.
        let mut bits = vec![0u64; self.nodes.len().div_ceil(64)];
        let mut count = 0;
        for list in lists {
            count += list.len();
            for &s in list {
                bits[s as usize / 64] |= 1 << (s % 64);
            }
        }
        let mut out = Vec::with_capacity(count);
        for (w, &word) in bits.iter().enumerate() {
            let mut word = word;
            while word != 0 {
                let b = word.trailing_zeros();
                out.push(w as u32 * 64 + b);
                word &= word - 1;
            }
        }
        out
    }

    pub(crate) fn column_index(&self, key: Sym) -> Option<usize> {
        self.column_of.get(&key).copied()
    }

    fn anti_group(&mut self, selector: CSelector, key: Sym) -> u32 {
        if let Some(&g) = self.anti_group_of.get(&(selector.clone(), key)) {
            return g;
        }
        let g = self.anti_groups.len() as u32;
        match selector.first_in() {
            Some((k, vs)) => {
                for &v in vs {
                    self.anti_by_pair.entry((k, v)).or_default().push(g);
                }
            }
            None => self.anti_unkeyed.push(g),
        }
        self.anti_group_of.insert((selector.clone(), key), g);
        self.anti_groups.push(AntiGroup {
            selector,
            topology_key: key,
            per_node: HashMap::new(),
        });
        g
    }

    fn remove_vm_by_id(&mut self, id: u32) -> Option<VmInfo> {
        let vm = self.vms.get_mut(id as usize)?.take()?;
        self.vm_by_name.remove(&vm.name);
        self.free_vms.push(id);
        let slot = vm.node;
        for pair in &vm.labels {
            if let Some(m) = self.vm_pairs.get_mut(pair) {
                decrement(m, slot);
                if m.is_empty() {
                    self.vm_pairs.remove(pair);
                }
            }
        }
        for &g in &vm.anti_groups {
            decrement(&mut self.anti_groups[g as usize].per_node, slot);
        }
        self.nodes[slot as usize].remove_vm_usage(&vm);
        self.stamps[slot as usize] = new_stamp();
        Some(vm)
    }

    fn attach_spec(&mut self, slot: u32, mut node: Node) {
        let mut labels = node.labels.clone();
        labels
            .entry(HOSTNAME_LABEL.to_string())
            .or_insert_with(|| node.name.clone());
        if let Some(z) = &node.zone {
            labels
                .entry(ZONE_LABEL.to_string())
                .or_insert_with(|| z.clone());
        }
        let labels = intern_labels(&mut self.interner, &labels);
        let taints: Vec<TaintInfo> = node
            .taints
            .iter()
            .map(|t| TaintInfo {
                key: self.interner.intern(&t.key),
                value: self.interner.intern(&t.value),
                effect: t.effect,
            })
            .collect();
        if taints
            .iter()
            .any(|t| t.effect == TaintEffect::PreferNoSchedule)
        {
            self.prefer_no_schedule_nodes += 1;
        }
        let zone = node.zone.as_deref().map(|z| self.interner.intern(z));
        for &(k, v) in &labels {
            let list = self.node_pairs.entry((k, v)).or_default();
            if let Err(i) = list.binary_search(&slot) {
                list.insert(i, slot);
            }
            let ci = match self.column_of.get(&k) {
                Some(&ci) => ci,
                None => {
                    let ci = self.columns.len();
                    self.columns.push(TopoColumn {
                        domain_of: vec![NO_DOMAIN; self.nodes.len()],
                        ..TopoColumn::default()
                    });
                    self.column_of.insert(k, ci);
                    ci
                }
            };
            let col = &mut self.columns[ci];
            let next = col.nodes_per_domain.len() as u32;
            let d = *col.value_to_domain.entry(v).or_insert(next);
            if d == next {
                col.nodes_per_domain.push(0);
                col.domain_values.push(v);
            }
            col.nodes_per_domain[d as usize] += 1;
            col.domain_of[slot as usize] = d;
        }
        // Keep the spec's disk usage if the caller re-sent a node without it.
        let old_disks = self.nodes[slot as usize].spec.disks.clone();
        for d in &mut node.disks {
            if d.scheduled_bytes == 0
                && let Some(o) = old_disks.iter().find(|o| o.name == d.name)
            {
                d.scheduled_bytes = o.scheduled_bytes;
            }
        }
        let n = &mut self.nodes[slot as usize];
        n.unschedulable = node.unschedulable;
        n.max_vms = node.max_vms;
        n.allocatable = node.allocatable_resources();
        self.stamps[slot as usize] = new_stamp();
        let inv = |v: u64| if v == 0 { 0.0 } else { 1.0 / v as f64 };
        n.inv_allocatable = (
            inv(n.allocatable.cpu_millis),
            inv(n.allocatable.memory_bytes),
        );
        n.taints = taints.into();
        n.labels = labels.into();
        n.zone = zone;
        n.spec = Arc::new(node);
    }

    fn detach_spec(&mut self, slot: u32) {
        let n = &mut self.nodes[slot as usize];
        let labels = std::mem::replace(&mut n.labels, Arc::from([]));
        if n.taints
            .iter()
            .any(|t| t.effect == TaintEffect::PreferNoSchedule)
        {
            self.prefer_no_schedule_nodes -= 1;
        }
        n.taints = Arc::from([]);
        for &(k, v) in labels.iter() {
            if let Some(list) = self.node_pairs.get_mut(&(k, v)) {
                if let Ok(i) = list.binary_search(&slot) {
                    list.remove(i);
                }
                if list.is_empty() {
                    self.node_pairs.remove(&(k, v));
                }
            }
            if let Some(&ci) = self.column_of.get(&k) {
                let col = &mut self.columns[ci];
                let d = col.domain_of[slot as usize];
                if d != NO_DOMAIN {
                    col.nodes_per_domain[d as usize] -= 1;
                    col.domain_of[slot as usize] = NO_DOMAIN;
                }
            }
        }
    }
}

fn decrement(m: &mut HashMap<u32, u32>, slot: u32) {
    if let Some(c) = m.get_mut(&slot) {
        *c -= 1;
        if *c == 0 {
            m.remove(&slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incremental_updates() {
        let mut s = ClusterSnapshot::new();
        s.add_node(
            Node::new("a", 4000, 8 << 30)
                .zone("z1")
                .label("disk", "ssd"),
        )
        .unwrap();
        s.add_node(Node::new("b", 4000, 8 << 30).zone("z2"))
            .unwrap();
        assert!(matches!(
            s.add_node(Node::new("a", 1, 1)),
            Err(SchedError::NodeExists { .. })
        ));
        s.bind(&Request::new("v1", 1000, 1 << 30).label("app", "web"), "a")
            .unwrap();
        assert!(s.bind(&Request::new("v1", 1, 1), "b").is_err());
        assert_eq!(
            s.node("a").unwrap().requested(),
            Resources::new(1000, 1 << 30)
        );
        assert_eq!(s.vm_node("v1"), Some("a"));
        assert_eq!(s.node_label(s.node("a").unwrap(), ZONE_LABEL), Some("z1"));
        assert_eq!(
            s.node_label(s.node("b").unwrap(), HOSTNAME_LABEL),
            Some("b")
        );

        // Update keeps VMs.
        s.update_node(Node::new("a", 8000, 8 << 30).zone("z3"))
            .unwrap();
        assert_eq!(s.node("a").unwrap().vm_count(), 1);
        assert_eq!(s.node("a").unwrap().allocatable().cpu_millis, 8000);
        assert_eq!(s.node_label(s.node("a").unwrap(), "disk"), None);

        // Removal unbinds, and the slot is reused.
        assert_eq!(s.remove_node("a").unwrap(), vec!["v1".to_string()]);
        assert_eq!(s.vm_count(), 0);
        assert!(s.vm_pairs.is_empty());
        s.add_node(Node::new("c", 1000, 1 << 30)).unwrap();
        assert_eq!(s.node("c").unwrap().slot(), 0);
        assert_eq!(s.node_count(), 2);
        assert!(s.unbind("v1").is_err());
    }

    #[test]
    fn replica_disk_accounting() {
        let mut s = ClusterSnapshot::new();
        s.add_node(Node::new("a", 1, 1).disk("d1", 100)).unwrap();
        let p = ReplicaPlacement {
            volume: "v".into(),
            size_bytes: 40,
            targets: vec![crate::types::ReplicaTarget {
                node: "a".into(),
                disk: "d1".into(),
                zone: None,
            }],
        };
        s.bind_replicas(&p).unwrap();
        assert_eq!(s.node("a").unwrap().spec().disks[0].scheduled_bytes, 40);
        // update_node without usage keeps it.
        s.update_node(Node::new("a", 1, 1).disk("d1", 200)).unwrap();
        assert_eq!(s.node("a").unwrap().spec().disks[0].scheduled_bytes, 40);
        s.release_replica("a", "d1", 40).unwrap();
        assert_eq!(s.node("a").unwrap().spec().disks[0].scheduled_bytes, 0);
        assert!(s.release_replica("a", "nope", 1).is_err());
    }
}
