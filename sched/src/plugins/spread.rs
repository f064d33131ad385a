// SPDX-License-Identifier: Apache-2.0
//! TopologySpread: keep VMs matching a selector evenly spread over the
//! domains of a topology key (zones, nodes, racks).

use crate::framework::{
    Ctx, CycleState, FilterPlugin, MAX_NODE_SCORE, Plugin, PreFilterPlugin, PreFilterResult,
    PreScorePlugin, PreScoreResult, Reason, ScorePlugin, for_pending,
};
use crate::plugins::count_matching;
use crate::plugins::node_affinity::RequiredNodeAffinity;
use crate::selector::{CSelector, matches_map};
use crate::snapshot::{ClusterSnapshot, NO_DOMAIN, NodeInfo, VmInfo};
use crate::types::{TopologySpreadConstraint, WhenUnsatisfiable};

/// Pod topology spread for VMs. Only nodes that match the VM's node selector
/// and required node affinity count (Kubernetes' `nodeAffinityPolicy:
/// Honor`). `DoNotSchedule` constraints filter, `ScheduleAnyway` ones score.
#[derive(Clone, Copy, Debug, Default)]
pub struct TopologySpread;

impl TopologySpread {
    /// Plugin name.
    pub const NAME: &'static str = "TopologySpread";
}

#[derive(Clone, Debug)]
struct Constraint {
    key: Option<crate::intern::Sym>,
    col: Option<usize>,
    counts: Vec<u32>,
    /// Domains that have at least one eligible node.
    eligible: Vec<bool>,
    min: u32,
    max_skew: u32,
    self_match: u32,
    selector: CSelector,
}

impl Constraint {
    fn recompute_min(&mut self) {
        self.min = self
            .counts
            .iter()
            .zip(&self.eligible)
            .filter(|(_, e)| **e)
            .map(|(c, _)| *c)
            .min()
            .unwrap_or(0);
    }
}

#[derive(Clone, Debug, Default)]
struct SpreadState {
    constraints: Vec<Constraint>,
    affinity: Option<RequiredNodeAffinity>,
}

#[derive(Clone, Debug, Default)]
struct SpreadScore(Vec<Constraint>);

impl SpreadScore {
    #[inline]
    fn score(&self, snap: &ClusterSnapshot, slot: u32) -> i64 {
        self.0
            .iter()
            .map(|c| {
                let d = c
                    .col
                    .map_or(NO_DOMAIN, |col| snap.columns[col].domain_of[slot as usize]);
                if d == NO_DOMAIN {
                    // Nodes without the key are the worst choice.
                    i64::from(c.counts.iter().copied().max().unwrap_or(0)) + 1
                } else {
                    i64::from(c.counts[d as usize])
                }
            })
            .sum()
    }
}

fn build(cx: &Ctx<'_>, cons: &[&TopologySpreadConstraint]) -> SpreadState {
    let snap: &ClusterSnapshot = cx.snapshot;
    let aff = RequiredNodeAffinity::compile(&snap.interner, cx.request);
    let affinity = (!aff.is_empty()).then_some(aff);
    let eligible_node = |slot: u32| {
        affinity
            .as_ref()
            .is_none_or(|a| a.matches(&snap.nodes[slot as usize], &snap.interner))
    };
    let mut out = Vec::with_capacity(cons.len());
    for c in cons {
        let selector = CSelector::lookup(&snap.interner, &c.selector);
        let self_match = u32::from(matches_map(&c.selector, &cx.request.labels));
        let key = snap.interner.get(&c.topology_key);
        let col = key.and_then(|k| snap.column_index(k));
        let (counts, eligible) = match col {
            Some(ci) => {
                let column = &snap.columns[ci];
                let (counts, _) = count_matching(snap, &selector, column, eligible_node);
                let counts = counts.into_dense(column.domains());
                let eligible = if affinity.is_none() {
                    column.nodes_per_domain.iter().map(|&n| n > 0).collect()
                } else {
                    let mut e = vec![false; column.domains()];
                    for n in snap.nodes() {
                        let d = column.domain_of[n.slot as usize];
                        if d != NO_DOMAIN && !e[d as usize] && eligible_node(n.slot) {
                            e[d as usize] = true;
                        }
                    }
                    e
                };
                (counts, eligible)
            }
            None => (Vec::new(), Vec::new()),
        };
        let mut con = Constraint {
            key,
            col,
            counts,
            eligible,
            min: 0,
            max_skew: c.max_skew.max(1),
            self_match,
            selector,
        };
        con.recompute_min();
        out.push(con);
    }
    SpreadState {
        constraints: out,
        affinity,
    }
}

/// When every node has the constraint's key and at most half of the nodes
/// are in domains that can take the VM, the candidates from the label index.
/// The filter visits the same nodes in the same order, minus the ones it
/// would have rejected for skew.
fn narrow(cx: &Ctx<'_>, st: &SpreadState) -> Option<Vec<u32>> {
    let snap = cx.snapshot;
    if st.affinity.is_some() {
        return None;
    }
    let c = st.constraints.first()?;
    let (key, col) = (c.key?, c.col?);
    let column = &snap.columns[col];
    let labelled: u32 = column.nodes_per_domain.iter().sum();
    if labelled as usize != snap.node_count() {
        return None;
    }
    let allowed: Vec<u32> = (0..column.domains() as u32)
        .filter(|&d| (c.counts[d as usize] + c.self_match).saturating_sub(c.min) <= c.max_skew)
        .collect();
    let nodes: u32 = allowed
        .iter()
        .map(|&d| column.nodes_per_domain[d as usize])
        .sum();
    if nodes as usize * 2 > snap.node_count() {
        return None;
    }
    Some(snap.nodes_in_domains(key, col, &allowed))
}

impl Plugin for TopologySpread {
    fn name(&self) -> &str {
        Self::NAME
    }
    fn as_pre_filter(&self) -> Option<&dyn PreFilterPlugin> {
        Some(self)
    }
    fn as_filter(&self) -> Option<&dyn FilterPlugin> {
        Some(self)
    }
    fn as_pre_score(&self) -> Option<&dyn PreScorePlugin> {
        Some(self)
    }
    fn as_score(&self) -> Option<&dyn ScorePlugin> {
        Some(self)
    }
}

impl PreFilterPlugin for TopologySpread {
    fn pre_filter(&self, cx: &Ctx<'_>, state: &mut CycleState) -> Result<PreFilterResult, Reason> {
        let hard: Vec<_> = cx
            .request
            .topology_spread
            .iter()
            .filter(|c| c.when_unsatisfiable == WhenUnsatisfiable::DoNotSchedule)
            .collect();
        if hard.is_empty() {
            return Ok(PreFilterResult::Skip);
        }
        let st = build(cx, &hard);
        let narrowed = narrow(cx, &st);
        state.write(st);
        Ok(
            narrowed.map_or(PreFilterResult::Continue, |slots| PreFilterResult::Nodes {
                slots,
                reason: Reason::TopologySpreadSkew,
            }),
        )
    }

    fn add_vm(&self, cx: &Ctx<'_>, state: &mut CycleState, vm: &VmInfo, node: &NodeInfo) {
        update(cx, state, vm, node, true);
    }

    fn remove_vm(&self, cx: &Ctx<'_>, state: &mut CycleState, vm: &VmInfo, node: &NodeInfo) {
        update(cx, state, vm, node, false);
    }
}

fn update(cx: &Ctx<'_>, state: &mut CycleState, vm: &VmInfo, node: &NodeInfo, add: bool) {
    let snap = cx.snapshot;
    let Some(st) = state.read_mut::<SpreadState>() else {
        return;
    };
    if st
        .affinity
        .as_ref()
        .is_some_and(|a| !a.matches(node, &snap.interner))
    {
        return;
    }
    for c in &mut st.constraints {
        let Some(col) = c.col else { continue };
        let d = snap.columns[col].domain_of[node.slot as usize];
        if d == NO_DOMAIN || !c.selector.matches(&vm.labels, &snap.interner) {
            continue;
        }
        let n = &mut c.counts[d as usize];
        *n = if add { *n + 1 } else { n.saturating_sub(1) };
        c.recompute_min();
    }
}

impl FilterPlugin for TopologySpread {
    fn filter(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> Result<(), Reason> {
        match state.read::<SpreadState>() {
            Some(st) => st.check(cx.snapshot, node.slot),
            None => Ok(()),
        }
    }

    fn filter_batch(
        &self,
        cx: &Ctx<'_>,
        state: &CycleState,
        slots: &[u32],
        out: &mut [Option<Reason>],
    ) {
        let Some(st) = state.read::<SpreadState>() else {
            return;
        };
        let snap = cx.snapshot;
        for_pending(snap, slots, out, |n| st.check(snap, n.slot));
    }
}

impl SpreadState {
    #[inline]
    fn check(&self, snap: &ClusterSnapshot, slot: u32) -> Result<(), Reason> {
        for c in &self.constraints {
            let d = c
                .col
                .map_or(NO_DOMAIN, |col| snap.columns[col].domain_of[slot as usize]);
            if d == NO_DOMAIN {
                return Err(Reason::TopologySpreadMissingLabel);
            }
            let skew = (c.counts[d as usize] + c.self_match).saturating_sub(c.min);
            if skew > c.max_skew {
                return Err(Reason::TopologySpreadSkew);
            }
        }
        Ok(())
    }
}

impl PreScorePlugin for TopologySpread {
    fn pre_score(&self, cx: &Ctx<'_>, state: &mut CycleState, _: &[u32]) -> PreScoreResult {
        let soft: Vec<_> = cx
            .request
            .topology_spread
            .iter()
            .filter(|c| c.when_unsatisfiable == WhenUnsatisfiable::ScheduleAnyway)
            .collect();
        if soft.is_empty() {
            return PreScoreResult::Skip;
        }
        state.write(SpreadScore(build(cx, &soft).constraints));
        PreScoreResult::Continue
    }
}

impl ScorePlugin for TopologySpread {
    fn score(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> i64 {
        state
            .read::<SpreadScore>()
            .map_or(0, |s| s.score(cx.snapshot, node.slot))
    }

    fn score_batch(&self, cx: &Ctx<'_>, state: &CycleState, slots: &[u32], out: &mut [i64]) {
        let Some(st) = state.read::<SpreadScore>() else {
            out.fill(0);
            return;
        };
        for (&s, o) in slots.iter().zip(out.iter_mut()) {
            *o = st.score(cx.snapshot, s);
        }
    }

    fn normalize(&self, _: &Ctx<'_>, _: &CycleState, scores: &mut [i64]) {
        // Fewer matching VMs in the domain is better.
        let hi = scores.iter().copied().max().unwrap_or(0);
        let lo = scores.iter().copied().min().unwrap_or(0);
        for s in scores.iter_mut() {
            *s = if hi > lo {
                MAX_NODE_SCORE * (hi - *s) / (hi - lo)
            } else {
                MAX_NODE_SCORE
            };
        }
    }
}
