// SPDX-License-Identifier: Apache-2.0
//! InterVmAffinity: required and preferred VM affinity and anti-affinity,
//! including the symmetric check against bound VMs' required anti-affinity.
//!
//! The pre-filter turns each term into a count of matching VMs per topology
//! domain (through the snapshot's label-pair index), so the per-node filter
//! is an array lookup per term.

use crate::framework::{
    Ctx, CycleState, FilterPlugin, MAX_NODE_SCORE, Plugin, PreFilterPlugin, PreFilterResult,
    PreScorePlugin, PreScoreResult, Reason, ScorePlugin, for_pending, min_max_normalize,
};
use crate::plugins::{DomainCounts, column_for, count_matching, domain_counts_of_nodes};
use crate::selector::{CSelector, matches_map};
use crate::snapshot::{ClusterSnapshot, NO_DOMAIN, NodeInfo, VmInfo};
use crate::types::VmAffinityTerm;

/// Inter-VM affinity and anti-affinity (Kubernetes' InterPodAffinity).
#[derive(Clone, Copy, Debug, Default)]
pub struct InterVmAffinity;

impl InterVmAffinity {
    /// Plugin name.
    pub const NAME: &'static str = "InterVmAffinity";
}

/// One term with per-domain counts of matching VMs.
#[derive(Clone, Debug)]
struct TermCounts {
    /// Column of the topology key; `None` when no node has the key.
    col: Option<usize>,
    counts: DomainCounts,
    selector: CSelector,
    /// For existing anti-affinity groups: the group id.
    group: Option<u32>,
    weight: i64,
}

impl TermCounts {
    fn new(snap: &ClusterSnapshot, term: &VmAffinityTerm, weight: i64) -> (Self, u32) {
        let selector = CSelector::lookup(&snap.interner, &term.selector);
        match column_for(snap, &term.topology_key) {
            Some((_, col)) => {
                let (counts, total) = count_matching(snap, &selector, &snap.columns[col], |_| true);
                (
                    Self {
                        col: Some(col),
                        counts,
                        selector,
                        group: None,
                        weight,
                    },
                    total,
                )
            }
            None => (
                Self {
                    col: None,
                    counts: DomainCounts::Dense(Vec::new()),
                    selector,
                    group: None,
                    weight,
                },
                0,
            ),
        }
    }

    /// Matching VMs in `slot`'s domain; `None` if the node lacks the key.
    #[inline]
    fn at(&self, snap: &ClusterSnapshot, slot: u32) -> Option<u32> {
        let col = self.col?;
        let d = snap.columns[col].domain_of[slot as usize];
        (d != NO_DOMAIN).then(|| self.counts.get(d))
    }

    /// Domain of `slot` in the term's column, if the node has the key.
    #[inline]
    fn domain(&self, snap: &ClusterSnapshot, slot: u32) -> Option<u32> {
        let d = snap.columns[self.col?].domain_of[slot as usize];
        (d != NO_DOMAIN).then_some(d)
    }

    fn adjust(&mut self, snap: &ClusterSnapshot, slot: u32, add: bool) {
        let Some(col) = self.col else { return };
        let d = snap.columns[col].domain_of[slot as usize];
        if d != NO_DOMAIN {
            self.counts.adjust(d, add);
        }
    }
}

#[derive(Clone, Debug, Default)]
struct FilterState {
    affinity: Vec<TermCounts>,
    /// No VM matches any affinity term and the VM matches its own terms:
    /// the first VM of a group may go anywhere (as in Kubernetes).
    affinity_self_ok: bool,
    anti: Vec<TermCounts>,
    existing: Vec<TermCounts>,
}

#[derive(Clone, Debug, Default)]
struct ScoreState(Vec<TermCounts>);

impl ScoreState {
    #[inline]
    fn score(&self, snap: &ClusterSnapshot, slot: u32) -> i64 {
        self.0
            .iter()
            .map(|t| t.weight * i64::from(t.at(snap, slot).unwrap_or(0)))
            .sum()
    }
}

impl Plugin for InterVmAffinity {
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

/// Existing anti-affinity groups whose selector matches the request's labels.
fn matching_groups(cx: &Ctx<'_>) -> Vec<u32> {
    let snap = cx.snapshot;
    if snap.anti_groups.is_empty() {
        return Vec::new();
    }
    let mut groups: Vec<u32> = cx
        .labels
        .iter()
        .filter_map(|p| snap.anti_by_pair.get(p))
        .flatten()
        .chain(snap.anti_unkeyed.iter())
        .copied()
        .collect();
    groups.sort_unstable();
    groups.dedup();
    groups.retain(|&g| {
        let g = &snap.anti_groups[g as usize];
        !g.per_node.is_empty() && g.selector.matches(cx.labels, &snap.interner)
    });
    groups
}

impl PreFilterPlugin for InterVmAffinity {
    fn pre_filter(&self, cx: &Ctx<'_>, state: &mut CycleState) -> Result<PreFilterResult, Reason> {
        let snap = cx.snapshot;
        let req = cx.request;
        let groups = matching_groups(cx);
        if req.affinity.required.is_empty()
            && req.anti_affinity.required.is_empty()
            && groups.is_empty()
        {
            return Ok(PreFilterResult::Skip);
        }
        let mut st = FilterState::default();
        let mut total = 0;
        let mut self_match = true;
        for t in &req.affinity.required {
            let (tc, n) = TermCounts::new(snap, t, 0);
            total += n;
            self_match &= matches_map(&t.selector, &req.labels);
            st.affinity.push(tc);
        }
        st.affinity_self_ok = total == 0 && self_match;
        for t in &req.anti_affinity.required {
            st.anti.push(TermCounts::new(snap, t, 0).0);
        }
        for g in groups {
            let grp = &snap.anti_groups[g as usize];
            let Some(col) = snap.column_index(grp.topology_key) else {
                continue;
            };
            let counts = domain_counts_of_nodes(
                &snap.columns[col],
                grp.per_node.iter().map(|(&s, &n)| (s, n)),
            );
            st.existing.push(TermCounts {
                col: Some(col),
                counts,
                selector: grp.selector.clone(),
                group: Some(g),
                weight: 0,
            });
        }
        state.write(st);
        Ok(PreFilterResult::Continue)
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
    let Some(st) = state.read_mut::<FilterState>() else {
        return;
    };
    for t in st.affinity.iter_mut().chain(st.anti.iter_mut()) {
        if t.selector.matches(&vm.labels, &snap.interner) {
            t.adjust(snap, node.slot, add);
        }
    }
    for t in &mut st.existing {
        if t.group.is_some_and(|g| vm.anti_groups.contains(&g)) {
            t.adjust(snap, node.slot, add);
        }
    }
}

impl FilterPlugin for InterVmAffinity {
    fn filter(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> Result<(), Reason> {
        match state.read::<FilterState>() {
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
        let Some(st) = state.read::<FilterState>() else {
            return;
        };
        let snap = cx.snapshot;
        for_pending(snap, slots, out, |n| st.check(snap, n.slot));
    }
}

impl FilterState {
    #[inline]
    fn check(&self, snap: &ClusterSnapshot, slot: u32) -> Result<(), Reason> {
        for t in &self.existing {
            if t.domain(snap, slot).is_some_and(|d| t.counts.positive(d)) {
                return Err(Reason::ExistingAntiAffinity);
            }
        }
        for t in &self.anti {
            if t.domain(snap, slot).is_some_and(|d| t.counts.positive(d)) {
                return Err(Reason::VmAntiAffinity);
            }
        }
        for t in &self.affinity {
            match t.domain(snap, slot) {
                None => return Err(Reason::VmAffinityMismatch),
                Some(d) if !self.affinity_self_ok && !t.counts.positive(d) => {
                    return Err(Reason::VmAffinityMismatch);
                }
                _ => {}
            }
        }
        Ok(())
    }
}

impl PreScorePlugin for InterVmAffinity {
    fn pre_score(&self, cx: &Ctx<'_>, state: &mut CycleState, _: &[u32]) -> PreScoreResult {
        let req = cx.request;
        if req.affinity.preferred.is_empty() && req.anti_affinity.preferred.is_empty() {
            return PreScoreResult::Skip;
        }
        let mut terms = Vec::new();
        for p in &req.affinity.preferred {
            terms.push(TermCounts::new(cx.snapshot, &p.term, i64::from(p.weight)).0);
        }
        for p in &req.anti_affinity.preferred {
            terms.push(TermCounts::new(cx.snapshot, &p.term, -i64::from(p.weight)).0);
        }
        state.write(ScoreState(terms));
        PreScoreResult::Continue
    }
}

impl ScorePlugin for InterVmAffinity {
    fn score(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> i64 {
        state
            .read::<ScoreState>()
            .map_or(0, |s| s.score(cx.snapshot, node.slot))
    }

    fn score_batch(&self, cx: &Ctx<'_>, state: &CycleState, slots: &[u32], out: &mut [i64]) {
        let Some(st) = state.read::<ScoreState>() else {
            out.fill(0);
            return;
        };
        for (&s, o) in slots.iter().zip(out.iter_mut()) {
            *o = st.score(cx.snapshot, s);
        }
    }

    fn normalize(&self, _: &Ctx<'_>, _: &CycleState, scores: &mut [i64]) {
        min_max_normalize(MAX_NODE_SCORE, scores);
    }
}
