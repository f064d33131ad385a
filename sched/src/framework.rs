// SPDX-License-Identifier: Apache-2.0
//! The plugin framework: extension points, cycle state, profiles.
//!
//! One scheduling cycle, as in kube-scheduler:
//!
//! ```text
//!  PreFilter ──► Filter (per node, sampled) ──► [none feasible] ─► PostFilter (preemption)
//!                     │ feasible nodes
//!                     ▼
//!  PreScore ──► Score (per feasible node) ──► Normalize ──► x weight, sum, pick best
//!                                                               │
//!                          Reserve ──► Permit ──► (Bind, in Scheduler::schedule)
//!                          └─ Unreserve on any later failure ◄──┘
//! ```
//!
//! A plugin is one value implementing [`Plugin`] plus the extension-point
//! traits it takes part in; [`Plugin`]'s `as_*` methods tell the framework
//! which. A plugin whose `pre_filter` (or `pre_score`) returns `Skip` has its
//! `filter` (or `score`) skipped for that cycle, which is how the built-ins
//! cost nothing for requests that do not use them.
//!
//! Plugins share a [`CycleState`] (a small type-keyed map) for the cycle: a
//! `pre_filter` computes per-request data once, `filter` reads it per node.

use std::any::{Any, TypeId};
use std::fmt;
use std::sync::Arc;

use crate::intern::{Interner, Sym};
use crate::snapshot::{ClusterSnapshot, NodeInfo, VmInfo};
use crate::types::Request;

/// Highest score a plugin gives a node after normalization.
pub const MAX_NODE_SCORE: i64 = 100;

/// Why a node failed a filter (or why a pre-filter rejected every node).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// The node is cordoned.
    NodeUnschedulable,
    /// The request is pinned to another node.
    NodeNameMismatch,
    /// Not enough of some resource (each flag is one message).
    Insufficient {
        /// CPU.
        cpu: bool,
        /// Memory.
        memory: bool,
        /// VM slots.
        vms: bool,
    },
    /// Node selector or required node affinity does not match.
    NodeAffinityMismatch,
    /// A NoSchedule/NoExecute taint is not tolerated.
    UntoleratedTaint {
        /// Taint key.
        key: Sym,
        /// Taint value.
        value: Sym,
    },
    /// A required VM affinity term has no match in the node's domain.
    VmAffinityMismatch,
    /// A required VM anti-affinity term matches in the node's domain.
    VmAntiAffinity,
    /// A VM in the node's domain has required anti-affinity against this VM.
    ExistingAntiAffinity,
    /// The node lacks a topology spread constraint's key.
    TopologySpreadMissingLabel,
    /// Placing here would exceed a constraint's max skew.
    TopologySpreadSkew,
    /// Strict data locality and no healthy replica on the node.
    NoLocalReplica,
    /// A plugin-defined reason (boxed so `Reason` stays two words and
    /// filter results return in registers).
    Plugin(Arc<CustomReason>),
}

/// A plugin-defined filter failure.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CustomReason {
    /// The message, e.g. `node(s) had an odd name`.
    pub message: String,
    /// Whether evicting lower-priority VMs could fix it.
    pub resolvable: bool,
}

impl Reason {
    /// A plugin-defined reason.
    pub fn custom(message: impl Into<String>, resolvable: bool) -> Self {
        Reason::Plugin(Arc::new(CustomReason {
            message: message.into(),
            resolvable,
        }))
    }

    /// Whether preemption (removing lower-priority VMs) might fix it.
    pub fn resolvable(&self) -> bool {
        match self {
            Reason::Insufficient { .. }
            | Reason::VmAntiAffinity
            | Reason::ExistingAntiAffinity
            | Reason::TopologySpreadSkew => true,
            Reason::Plugin(c) => c.resolvable,
            _ => false,
        }
    }

    /// The human-readable messages (usually one; several for resources).
    pub(crate) fn messages(&self, interner: &Interner, mut out: impl FnMut(String)) {
        let s = |s: &str| s.to_string();
        match self {
            Reason::NodeUnschedulable => out(s("node(s) were unschedulable")),
            Reason::NodeNameMismatch => out(s("node(s) didn't match the requested node name")),
            Reason::Insufficient { cpu, memory, vms } => {
                if *cpu {
                    out(s("Insufficient cpu"));
                }
                if *memory {
                    out(s("Insufficient memory"));
                }
                if *vms {
                    out(s("Too many VMs"));
                }
            }
            Reason::NodeAffinityMismatch => {
                out(s("node(s) didn't match VM's node affinity/selector"))
            }
            Reason::UntoleratedTaint { key, value } => out(format!(
                "node(s) had untolerated taint {{{}: {}}}",
                interner.resolve(*key),
                interner.resolve(*value)
            )),
            Reason::VmAffinityMismatch => out(s("node(s) didn't match VM affinity rules")),
            Reason::VmAntiAffinity => out(s("node(s) didn't match VM anti-affinity rules")),
            Reason::ExistingAntiAffinity => {
                out(s("node(s) didn't satisfy existing VMs anti-affinity rules"))
            }
            Reason::TopologySpreadMissingLabel => out(s(
                "node(s) didn't match VM topology spread constraints (missing required label)",
            )),
            Reason::TopologySpreadSkew => {
                out(s("node(s) didn't match VM topology spread constraints"))
            }
            Reason::NoLocalReplica => out(s("node(s) had no healthy replica of the VM's volume")),
            Reason::Plugin(c) => out(c.message.clone()),
        }
    }
}

/// Per-cycle context handed to every plugin.
#[derive(Clone, Copy, Debug)]
pub struct Ctx<'a> {
    /// The snapshot being scheduled on.
    pub snapshot: &'a ClusterSnapshot,
    /// The request.
    pub request: &'a Request,
    /// The request's labels as sorted symbols (unknown labels dropped).
    pub(crate) labels: &'a [(Sym, Sym)],
}

impl Ctx<'_> {
    pub(crate) fn interner(&self) -> &Interner {
        &self.snapshot.interner
    }
}

/// Data a plugin keeps in the [`CycleState`]: any `Clone + Send + Sync +
/// 'static` type. Cloning is needed because preemption evaluates candidates
/// on copies of the state.
pub trait StateData: Any + Clone + Send + Sync {}

impl<T: Any + Clone + Send + Sync> StateData for T {}

type AnyData = dyn Any + Send + Sync;

struct Entry {
    id: TypeId,
    value: Box<AnyData>,
    clone: fn(&AnyData) -> Box<AnyData>,
    clone_into: fn(&AnyData, &mut AnyData),
}

fn clone_into_as<T: StateData>(src: &AnyData, dst: &mut AnyData) {
    match (src.downcast_ref::<T>(), dst.downcast_mut::<T>()) {
        (Some(s), Some(d)) => d.clone_from(s),
        _ => unreachable!("entry types match their TypeIds"),
    }
}

fn clone_as<T: StateData>(v: &AnyData) -> Box<AnyData> {
    match v.downcast_ref::<T>() {
        Some(t) => Box::new(t.clone()),
        None => unreachable!("entry type matches its TypeId"),
    }
}

/// State shared by the plugins during one scheduling cycle, keyed by type
/// (each plugin uses its own private type as the key).
#[derive(Default)]
pub struct CycleState {
    entries: Vec<Entry>,
}

impl CycleState {
    /// Stores `value`, replacing any value of the same type.
    pub fn write<T: StateData>(&mut self, value: T) {
        let id = TypeId::of::<T>();
        let boxed: Box<AnyData> = Box::new(value);
        match self.entries.iter_mut().find(|e| e.id == id) {
            Some(e) => e.value = boxed,
            None => self.entries.push(Entry {
                id,
                value: boxed,
                clone: clone_as::<T>,
                clone_into: clone_into_as::<T>,
            }),
        }
    }

    /// The value of type `T`, if written this cycle.
    #[inline]
    pub fn read<T: StateData>(&self) -> Option<&T> {
        let id = TypeId::of::<T>();
        self.entries
            .iter()
            .find(|e| e.id == id)
            .and_then(|e| e.value.downcast_ref())
    }

    /// Mutable access to the value of type `T`.
    pub fn read_mut<T: StateData>(&mut self) -> Option<&mut T> {
        let id = TypeId::of::<T>();
        self.entries
            .iter_mut()
            .find(|e| e.id == id)
            .and_then(|e| e.value.downcast_mut())
    }

    /// Removes everything (between cycles).
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

impl Clone for CycleState {
    fn clone(&self) -> Self {
        Self {
            entries: self
                .entries
                .iter()
                .map(|e| Entry {
                    id: e.id,
                    value: (e.clone)(&*e.value),
                    clone: e.clone,
                    clone_into: e.clone_into,
                })
                .collect(),
        }
    }

    /// Reuses `self`'s boxes when it holds the same types in the same order
    /// (preemption copies the state once per candidate).
    fn clone_from(&mut self, source: &Self) {
        let same = self.entries.len() == source.entries.len()
            && self
                .entries
                .iter()
                .zip(&source.entries)
                .all(|(a, b)| a.id == b.id);
        if !same {
            *self = source.clone();
            return;
        }
        for (d, s) in self.entries.iter_mut().zip(&source.entries) {
            (s.clone_into)(&*s.value, &mut *d.value);
        }
    }
}

impl fmt::Debug for CycleState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CycleState")
            .field("entries", &self.entries.len())
            .finish()
    }
}

/// What a pre-filter decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PreFilterResult {
    /// Run this plugin's filter on each node.
    Continue,
    /// The request does not use this plugin: skip its filter this cycle.
    Skip,
    /// Only these node slots can pass (from an index); the others fail with
    /// `reason` without being visited. The plugin's filter still runs on them.
    Nodes {
        /// Sorted candidate slots.
        slots: Vec<u32>,
        /// Reason reported for every node not in `slots`.
        reason: Reason,
    },
}

/// Extension point run once per cycle before the filters.
pub trait PreFilterPlugin: Send + Sync {
    /// Prepares per-request state, may narrow the nodes or reject the request
    /// outright (every node then fails with the returned reason).
    fn pre_filter(&self, cx: &Ctx<'_>, state: &mut CycleState) -> Result<PreFilterResult, Reason>;

    /// Preemption simulates adding `vm` back to `node`: update the state.
    fn add_vm(&self, _cx: &Ctx<'_>, _state: &mut CycleState, _vm: &VmInfo, _node: &NodeInfo) {}

    /// Preemption simulates removing `vm` from `node`: update the state.
    fn remove_vm(&self, _cx: &Ctx<'_>, _state: &mut CycleState, _vm: &VmInfo, _node: &NodeInfo) {}

    /// Whether `add_vm`/`remove_vm` change this plugin's state. Return
    /// `false` only if both are no-ops: when no active pre-filter needs
    /// them, preemption evaluates candidates on the cycle state itself
    /// instead of a copy per candidate.
    fn tracks_vms(&self) -> bool {
        true
    }
}

/// Extension point run per node: can the VM run there?
pub trait FilterPlugin: Send + Sync {
    /// `Ok` if the node passes. Must read node state from `node` (during
    /// preemption it is a modified copy) and per-request state from `state`.
    fn filter(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> Result<(), Reason>;

    /// Filters a batch of the snapshot's nodes (`slots`, in scan order): for
    /// each `i` with `out[i] == None` (still passing), sets `out[i]` to the
    /// reason `slots[i]` fails, and leaves entries already `Some` alone. Must
    /// give the same answers as [`filter`](Self::filter) on
    /// `cx.snapshot.node_at(slot)`. Only nodes inside every `Nodes` list
    /// the pre-filters returned this cycle are given (so a plugin whose list
    /// is exact may pass them all). The scheduler calls this in its main
    /// loop (preemption calls `filter` on modified copies); the default
    /// calls `filter` per node. Built-ins override it to read their cycle
    /// state once per batch instead of once per node.
    fn filter_batch(
        &self,
        cx: &Ctx<'_>,
        state: &CycleState,
        slots: &[u32],
        out: &mut [Option<Reason>],
    ) {
        for_pending(cx.snapshot, slots, out, |n| self.filter(cx, state, n));
    }
}

/// Runs `check` on the nodes of `slots` whose `out` entry is still `None`,
/// recording failures (the loop behind [`FilterPlugin::filter_batch`]).
#[inline]
pub(crate) fn for_pending(
    snap: &ClusterSnapshot,
    slots: &[u32],
    out: &mut [Option<Reason>],
    mut check: impl FnMut(&NodeInfo) -> Result<(), Reason>,
) {
    for (&s, r) in slots.iter().zip(out.iter_mut()) {
        if r.is_none()
            && let Err(e) = check(&snap.nodes[s as usize])
        {
            *r = Some(e);
        }
    }
}

/// The active filters of a cycle, handed to post-filter plugins so they can
/// re-run them on modified copies of nodes (preemption).
#[derive(Clone, Copy)]
pub struct FilterChain<'a> {
    pub(crate) pre_filters: &'a [&'a dyn PreFilterPlugin],
    pub(crate) filters: &'a [&'a dyn FilterPlugin],
}

impl fmt::Debug for FilterChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FilterChain")
            .field("pre_filters", &self.pre_filters.len())
            .field("filters", &self.filters.len())
            .finish()
    }
}

impl FilterChain<'_> {
    /// Runs every active filter on `node`; the first failure wins.
    #[inline]
    pub fn run(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> Result<(), Reason> {
        for f in self.filters {
            f.filter(cx, state, node)?;
        }
        Ok(())
    }

    /// Whether any active pre-filter keeps state that `add_vm`/`remove_vm`
    /// change (see [`PreFilterPlugin::tracks_vms`]).
    pub fn tracks_vms(&self) -> bool {
        self.pre_filters.iter().any(|p| p.tracks_vms())
    }

    /// Tells every pre-filter that `vm` was added to `node`.
    pub fn add_vm(&self, cx: &Ctx<'_>, state: &mut CycleState, vm: &VmInfo, node: &NodeInfo) {
        for p in self.pre_filters {
            p.add_vm(cx, state, vm, node);
        }
    }

    /// Tells every pre-filter that `vm` was removed from `node`.
    pub fn remove_vm(&self, cx: &Ctx<'_>, state: &mut CycleState, vm: &VmInfo, node: &NodeInfo) {
        for p in self.pre_filters {
            p.remove_vm(cx, state, vm, node);
        }
    }
}

/// A node chosen by a post-filter, with the VMs to evict first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nomination {
    /// Node slot.
    pub node: u32,
    /// Ids of the VMs to evict.
    pub victims: Vec<u32>,
}

/// Extension point run when no node passed the filters.
pub trait PostFilterPlugin: Send + Sync {
    /// Tries to make the VM schedulable (preemption). `failed` holds every
    /// node slot with the reason it failed. `Err` explains why not.
    fn post_filter(
        &self,
        cx: &Ctx<'_>,
        state: &CycleState,
        chain: &FilterChain<'_>,
        failed: &[(u32, Reason)],
    ) -> Result<Nomination, String>;
}

/// What a pre-score decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreScoreResult {
    /// Score the feasible nodes.
    Continue,
    /// The request does not use this plugin: skip its score this cycle.
    Skip,
}

/// Extension point run once before scoring.
pub trait PreScorePlugin: Send + Sync {
    /// Prepares scoring state for the feasible node slots.
    fn pre_score(&self, cx: &Ctx<'_>, state: &mut CycleState, feasible: &[u32]) -> PreScoreResult;
}

/// Extension point run per feasible node: how good is it?
pub trait ScorePlugin: Send + Sync {
    /// Raw score of `node`.
    fn score(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> i64;

    /// True when [`score`](Self::score) depends only on the request's
    /// `resources`, the node's allocatable, requested and VM-count state and
    /// the plugin's own fixed configuration (not on labels, other VMs or the
    /// cycle state). The scheduler then keeps each node's raw score and
    /// reuses it until the node's resources change or a request with other
    /// resources comes. `NodeResourcesFit` and `BalancedAllocation` say so.
    fn resources_only(&self) -> bool {
        false
    }

    /// Raw scores of the snapshot's nodes `slots` into `out` (same length);
    /// must equal [`score`](Self::score) per node. The default calls `score`
    /// per node; built-ins override it to read their state once.
    fn score_batch(&self, cx: &Ctx<'_>, state: &CycleState, slots: &[u32], out: &mut [i64]) {
        let nodes = &cx.snapshot.nodes;
        for (&s, o) in slots.iter().zip(out.iter_mut()) {
            *o = self.score(cx, state, &nodes[s as usize]);
        }
    }

    /// Maps raw scores (in feasible-node order) to `0..=MAX_NODE_SCORE`. The
    /// default leaves them as they are (for plugins that already score so).
    fn normalize(&self, _cx: &Ctx<'_>, _state: &CycleState, _scores: &mut [i64]) {}
}

/// Extension point run after a node was chosen; undone by `unreserve` when a
/// later step fails.
pub trait ReservePlugin: Send + Sync {
    /// Reserves plugin-side resources for the VM on `node`.
    fn reserve(&self, cx: &Ctx<'_>, state: &mut CycleState, node: &NodeInfo) -> Result<(), String>;
    /// Undoes `reserve`. Must be idempotent.
    fn unreserve(&self, cx: &Ctx<'_>, state: &mut CycleState, node: &NodeInfo);
}

/// Extension point that approves or denies the chosen node.
pub trait PermitPlugin: Send + Sync {
    /// `Err` denies; the VM is then not placed. (Waiting for a group is
    /// provided by [`Scheduler::place_gang`](crate::Scheduler::place_gang).)
    fn permit(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> Result<(), String>;
}

/// Extension point that commits a placement outside the snapshot (e.g. the
/// orchestrator writing `status.nodeName`), run by
/// [`Scheduler::schedule`](crate::Scheduler::schedule).
pub trait BindPlugin: Send + Sync {
    /// Commits; `Err` unreserves and leaves the snapshot unchanged.
    fn bind(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> Result<(), String>;
}

/// A scheduler plugin: a name plus the extension points it implements.
pub trait Plugin: Send + Sync + fmt::Debug {
    /// Unique name within a profile (used by configs and messages).
    fn name(&self) -> &str;
    /// This plugin as a pre-filter.
    fn as_pre_filter(&self) -> Option<&dyn PreFilterPlugin> {
        None
    }
    /// This plugin as a filter.
    fn as_filter(&self) -> Option<&dyn FilterPlugin> {
        None
    }
    /// This plugin as a post-filter.
    fn as_post_filter(&self) -> Option<&dyn PostFilterPlugin> {
        None
    }
    /// This plugin as a pre-score.
    fn as_pre_score(&self) -> Option<&dyn PreScorePlugin> {
        None
    }
    /// This plugin as a scorer.
    fn as_score(&self) -> Option<&dyn ScorePlugin> {
        None
    }
    /// This plugin as a reserve plugin.
    fn as_reserve(&self) -> Option<&dyn ReservePlugin> {
        None
    }
    /// This plugin as a permit plugin.
    fn as_permit(&self) -> Option<&dyn PermitPlugin> {
        None
    }
    /// This plugin as a binder.
    fn as_bind(&self) -> Option<&dyn BindPlugin> {
        None
    }
}

/// A plugin with its score weight.
#[derive(Clone, Debug)]
pub(crate) struct Registered {
    pub(crate) plugin: Arc<dyn Plugin>,
    pub(crate) weight: i64,
}

/// A named set of plugins with weights and a sampling knob (like a
/// `KubeSchedulerProfile`). Plugins run in registration order at each point.
#[derive(Clone, Debug)]
pub struct Profile {
    pub(crate) name: String,
    pub(crate) plugins: Vec<Registered>,
    pub(crate) percentage_of_nodes_to_score: Option<u32>,
}

impl Profile {
    /// An empty profile (no plugins: every node is feasible, scores are 0).
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            plugins: Vec::new(),
            percentage_of_nodes_to_score: None,
        }
    }

    /// The profile name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Names of the plugins in order.
    pub fn plugin_names(&self) -> impl Iterator<Item = &str> {
        self.plugins.iter().map(|r| r.plugin.name())
    }

    /// Appends a plugin with score weight `weight` (ignored unless it scores).
    #[must_use]
    pub fn with_plugin(mut self, plugin: Arc<dyn Plugin>, weight: i64) -> Self {
        self.plugins.retain(|r| r.plugin.name() != plugin.name());
        self.plugins.push(Registered { plugin, weight });
        self
    }

    /// Removes the plugin called `name`.
    #[must_use]
    pub fn without_plugin(mut self, name: &str) -> Self {
        self.plugins.retain(|r| r.plugin.name() != name);
        self
    }

    /// Changes the weight of the plugin called `name`.
    #[must_use]
    pub fn with_weight(mut self, name: &str, weight: i64) -> Self {
        for r in &mut self.plugins {
            if r.plugin.name() == name {
                r.weight = weight;
            }
        }
        self
    }

    /// Sets `percentageOfNodesToScore` (1..=100; `None` = adaptive like
    /// kube-scheduler: 50% minus 1% per 125 nodes, at least 5%, at least
    /// 100 nodes).
    #[must_use]
    pub fn percentage_of_nodes_to_score(mut self, pct: Option<u32>) -> Self {
        self.percentage_of_nodes_to_score = pct.map(|p| p.clamp(1, 100));
        self
    }
}

/// Minimum number of feasible nodes to find before stopping (kube-scheduler).
pub(crate) const MIN_FEASIBLE_NODES_TO_FIND: usize = 100;
/// Lower bound of the adaptive percentage (kube-scheduler).
pub(crate) const MIN_FEASIBLE_NODES_PERCENTAGE: usize = 5;

/// How many feasible nodes to find before scoring (kube-scheduler's
/// `numFeasibleNodesToFind`).
pub(crate) fn num_feasible_nodes_to_find(pct: Option<u32>, all: usize) -> usize {
    if all < MIN_FEASIBLE_NODES_TO_FIND || pct == Some(100) {
        return all;
    }
    let pct = match pct {
        Some(p) => p as usize,
        None => (50usize.saturating_sub(all / 125)).max(MIN_FEASIBLE_NODES_PERCENTAGE),
    };
    (all * pct / 100).max(MIN_FEASIBLE_NODES_TO_FIND)
}

/// kube-scheduler's `DefaultNormalizeScore`: scale to `0..=max` by the
/// largest score, optionally reversed (lower raw is better).
pub fn default_normalize(max: i64, reverse: bool, scores: &mut [i64]) {
    let top = scores.iter().copied().max().unwrap_or(0);
    if top == 0 {
        if reverse {
            scores.iter_mut().for_each(|s| *s = max);
        }
        return;
    }
    for s in scores.iter_mut() {
        let v = max * *s / top;
        *s = if reverse { max - v } else { v };
    }
}

/// Min-max normalization to `0..=max` (all equal → 0).
pub fn min_max_normalize(max: i64, scores: &mut [i64]) {
    let hi = scores.iter().copied().max().unwrap_or(0);
    let lo = scores.iter().copied().min().unwrap_or(0);
    let diff = hi - lo;
    for s in scores.iter_mut() {
        *s = if diff > 0 { max * (*s - lo) / diff } else { 0 };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feasible_nodes_to_find_matches_kube() {
        assert_eq!(num_feasible_nodes_to_find(None, 50), 50);
        // 5000 nodes: 50 - 40 = 10% -> 500.
        assert_eq!(num_feasible_nodes_to_find(None, 5000), 500);
        // 10000 nodes: 50 - 80 < 5 -> 5% -> 500.
        assert_eq!(num_feasible_nodes_to_find(None, 10000), 500);
        assert_eq!(num_feasible_nodes_to_find(Some(100), 5000), 5000);
        assert_eq!(num_feasible_nodes_to_find(Some(1), 5000), 100);
    }

    #[test]
    fn normalizers() {
        let mut s = [0, 5, 10];
        default_normalize(100, false, &mut s);
        assert_eq!(s, [0, 50, 100]);
        let mut s = [0, 5, 10];
        default_normalize(100, true, &mut s);
        assert_eq!(s, [100, 50, 0]);
        let mut s = [0, 0];
        default_normalize(100, true, &mut s);
        assert_eq!(s, [100, 100]);
        let mut s = [-4, 0, 4];
        min_max_normalize(100, &mut s);
        assert_eq!(s, [0, 50, 100]);
    }

    #[test]
    fn cycle_state_is_type_keyed_and_clonable() {
        #[derive(Clone, Debug, PartialEq)]
        struct A(u32);
        #[derive(Clone, Debug, PartialEq)]
        struct B(&'static str);
        let mut s = CycleState::default();
        s.write(A(1));
        s.write(B("x"));
        s.write(A(2));
        assert_eq!(s.read::<A>(), Some(&A(2)));
        let c = s.clone();
        s.read_mut::<A>().unwrap().0 = 3;
        assert_eq!(c.read::<A>(), Some(&A(2)));
        assert_eq!(s.read::<B>(), Some(&B("x")));
        s.clear();
        assert!(s.read::<A>().is_none());
    }
}
