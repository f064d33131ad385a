// SPDX-License-Identifier: Apache-2.0
//! NodeAffinity: node selector and required/preferred node affinity.

use crate::framework::{
    Ctx, CycleState, FilterPlugin, MAX_NODE_SCORE, Plugin, PreFilterPlugin, PreFilterResult,
    PreScorePlugin, PreScoreResult, Reason, ScorePlugin, default_normalize, for_pending,
};
use crate::intern::Interner;
use crate::selector::{CReq, CSelector};
use crate::snapshot::{ClusterSnapshot, NodeInfo};
use crate::types::Request;

/// `node_selector` (all labels), `node_affinity.required` (any term) and
/// `node_affinity.preferred` (sum of weights of matching terms).
///
/// The pre-filter narrows the candidate nodes through the snapshot's
/// `(key, value) -> nodes` index, so a selector that matches 10 of 5,000
/// nodes visits 10 nodes.
#[derive(Clone, Copy, Debug, Default)]
pub struct NodeAffinity;

impl NodeAffinity {
    /// Plugin name.
    pub const NAME: &'static str = "NodeAffinity";
}

/// Compiled required node constraints of a request.
#[derive(Clone, Debug, Default)]
pub(crate) struct RequiredNodeAffinity {
    selector: CSelector,
    /// ORed; empty = no constraint.
    terms: Vec<CSelector>,
}

impl RequiredNodeAffinity {
    pub(crate) fn compile(interner: &Interner, req: &Request) -> Self {
        let selector = CSelector::lookup_map(interner, &req.node_selector);
        let terms = req
            .node_affinity
            .required
            .iter()
            .map(|t| {
                if t.match_expressions.is_empty() {
                    CSelector {
                        reqs: vec![CReq::Never],
                    }
                } else {
                    CSelector::lookup_term(interner, t)
                }
            })
            .collect();
        Self { selector, terms }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.selector.reqs.is_empty() && self.terms.is_empty()
    }

    #[inline]
    pub(crate) fn matches(&self, node: &NodeInfo, interner: &Interner) -> bool {
        self.selector.matches(&node.labels, interner)
            && (self.terms.is_empty()
                || self.terms.iter().any(|t| t.matches(&node.labels, interner)))
    }

    /// True when [`candidates`](Self::candidates) lists exactly the
    /// matching nodes (only `key In (values)` requirements, no terms), so
    /// the candidates need no further check.
    fn candidates_exact(&self) -> bool {
        self.terms.is_empty() && self.selector.reqs.iter().all(|r| matches!(r, CReq::In(..)))
    }

    /// Candidate node slots from the label index (`None`: no narrowing).
    fn candidates(&self, snap: &ClusterSnapshot) -> Option<Vec<u32>> {
        let mut out: Option<Vec<u32>> = None;
        let narrow = |out: &mut Option<Vec<u32>>, list: Vec<u32>| {
            *out = Some(match out.take() {
                None => list,
                Some(prev) => intersect(&prev, &list),
            });
        };
        if self.selector.is_never() {
            return Some(Vec::new());
        }
        for r in &self.selector.reqs {
            if let CReq::In(k, vs) = r {
                narrow(&mut out, union(snap, *k, vs));
            }
        }
        if !self.terms.is_empty() {
            let mut all = Vec::new();
            for t in &self.terms {
                if t.is_never() {
                    continue;
                }
                match t.first_in() {
                    Some((k, vs)) => all.extend(union(snap, k, vs)),
                    None => return out, // a term without an index: no narrowing
                }
            }
            all.sort_unstable();
            all.dedup();
            narrow(&mut out, all);
        }
        out
    }
}

fn union(snap: &ClusterSnapshot, k: crate::intern::Sym, vs: &[crate::intern::Sym]) -> Vec<u32> {
    if let [v] = vs {
        return snap.node_pairs.get(&(k, *v)).cloned().unwrap_or_default();
    }
    let mut v: Vec<u32> = vs
        .iter()
        .filter_map(|&v| snap.node_pairs.get(&(k, v)))
        .flatten()
        .copied()
        .collect();
    if vs.len() > 1 {
        v.sort_unstable();
        v.dedup();
    }
    v
}

fn intersect(a: &[u32], b: &[u32]) -> Vec<u32> {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out
}

/// The pre-filter's state.
#[derive(Clone, Debug)]
struct Required {
    req: RequiredNodeAffinity,
    /// The pre-filter narrowed to exactly the matching nodes.
    exact: bool,
}

#[derive(Clone, Debug, Default)]
struct Preferred(Vec<(i64, CSelector)>);

impl Preferred {
    #[inline]
    fn score(&self, node: &NodeInfo, interner: &Interner) -> i64 {
        self.0
            .iter()
            .filter(|(_, t)| t.matches(&node.labels, interner))
            .map(|(w, _)| w)
            .sum()
    }
}

impl Plugin for NodeAffinity {
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

impl PreFilterPlugin for NodeAffinity {
    fn tracks_vms(&self) -> bool {
        false
    }

    fn pre_filter(&self, cx: &Ctx<'_>, state: &mut CycleState) -> Result<PreFilterResult, Reason> {
        let req = RequiredNodeAffinity::compile(cx.interner(), cx.request);
        if req.is_empty() {
            return Ok(PreFilterResult::Skip);
        }
        let cand = req.candidates(cx.snapshot);
        let exact = cand.is_some() && req.candidates_exact();
        state.write(Required { req, exact });
        Ok(match cand {
            Some(slots) => PreFilterResult::Nodes {
                slots,
                reason: Reason::NodeAffinityMismatch,
            },
            None => PreFilterResult::Continue,
        })
    }
}

impl FilterPlugin for NodeAffinity {
    #[inline]
    fn filter(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> Result<(), Reason> {
        match state.read::<Required>() {
            Some(r) if !r.req.matches(node, cx.interner()) => Err(Reason::NodeAffinityMismatch),
            _ => Ok(()),
        }
    }

    fn filter_batch(
        &self,
        cx: &Ctx<'_>,
        state: &CycleState,
        slots: &[u32],
        out: &mut [Option<Reason>],
    ) {
        let Some(Required { req: r, exact }) = state.read::<Required>() else {
            return;
        };
        if *exact {
            // Only candidates from the index reach the batch filter, and
            // they all match.
            return;
        }
        let interner = cx.interner();
        for_pending(cx.snapshot, slots, out, |n| {
            if r.matches(n, interner) {
                Ok(())
            } else {
                Err(Reason::NodeAffinityMismatch)
            }
        });
    }
}

impl PreScorePlugin for NodeAffinity {
    fn pre_score(&self, cx: &Ctx<'_>, state: &mut CycleState, _: &[u32]) -> PreScoreResult {
        if cx.request.node_affinity.preferred.is_empty() {
            return PreScoreResult::Skip;
        }
        let terms = cx
            .request
            .node_affinity
            .preferred
            .iter()
            .filter(|p| p.weight != 0)
            .map(|p| {
                (
                    i64::from(p.weight),
                    CSelector::lookup_term(cx.interner(), &p.term),
                )
            })
            .collect();
        state.write(Preferred(terms));
        PreScoreResult::Continue
    }
}

impl ScorePlugin for NodeAffinity {
    fn score(&self, cx: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> i64 {
        state
            .read::<Preferred>()
            .map_or(0, |p| p.score(node, cx.interner()))
    }

    fn score_batch(&self, cx: &Ctx<'_>, state: &CycleState, slots: &[u32], out: &mut [i64]) {
        let Some(p) = state.read::<Preferred>() else {
            out.fill(0);
            return;
        };
        let nodes = &cx.snapshot.nodes;
        for (&s, o) in slots.iter().zip(out.iter_mut()) {
            *o = p.score(&nodes[s as usize], cx.interner());
        }
    }

    fn normalize(&self, _: &Ctx<'_>, _: &CycleState, scores: &mut [i64]) {
        default_normalize(MAX_NODE_SCORE, false, scores);
    }
}
