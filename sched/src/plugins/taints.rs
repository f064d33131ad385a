// SPDX-License-Identifier: Apache-2.0
//! TaintToleration: untolerated NoSchedule/NoExecute taints filter a node out;
//! untolerated PreferNoSchedule taints lower its score.

use crate::framework::{
    Ctx, CycleState, FilterPlugin, MAX_NODE_SCORE, Plugin, PreFilterPlugin, PreFilterResult,
    PreScorePlugin, PreScoreResult, Reason, ScorePlugin, default_normalize, for_pending,
};
use crate::intern::{Interner, Sym};
use crate::snapshot::{NodeInfo, TaintInfo};
use crate::types::{TaintEffect, Toleration, TolerationOperator};

/// Taints and tolerations, as in Kubernetes.
#[derive(Clone, Copy, Debug, Default)]
pub struct TaintToleration;

impl TaintToleration {
    /// Plugin name.
    pub const NAME: &'static str = "TaintToleration";
}

/// A toleration with interned key and value.
#[derive(Clone, Copy, Debug)]
struct CTol {
    /// `None`: any key (empty key with `Exists`).
    key: Option<Sym>,
    /// `None`: any value (`Exists`).
    value: Option<Sym>,
    effect: Option<TaintEffect>,
}

impl CTol {
    #[inline]
    fn tolerates(&self, t: &TaintInfo) -> bool {
        self.key.is_none_or(|k| k == t.key)
            && self.value.is_none_or(|v| v == t.value)
            && self.effect.is_none_or(|e| e == t.effect)
    }
}

#[derive(Clone, Debug, Default)]
struct Tolerations(Vec<CTol>);

fn compile(interner: &Interner, tols: &[Toleration]) -> Tolerations {
    let mut out = Vec::with_capacity(tols.len());
    for t in tols {
        let key = if t.key.is_empty() {
            if t.operator != TolerationOperator::Exists {
                continue; // Kubernetes: an empty key needs Exists.
            }
            None
        } else {
            match interner.get(&t.key) {
                Some(k) => Some(k),
                None => continue, // no node has such a taint
            }
        };
        let value = match t.operator {
            TolerationOperator::Exists => None,
            TolerationOperator::Equal => match interner.get(&t.value) {
                Some(v) => Some(v),
                None => continue,
            },
        };
        out.push(CTol {
            key,
            value,
            effect: t.effect,
        });
    }
    Tolerations(out)
}

impl Tolerations {
    #[inline]
    fn tolerates(&self, t: &TaintInfo) -> bool {
        self.0.iter().any(|c| c.tolerates(t))
    }
}

impl Plugin for TaintToleration {
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

impl PreFilterPlugin for TaintToleration {
    fn tracks_vms(&self) -> bool {
        false
    }

    fn pre_filter(&self, cx: &Ctx<'_>, state: &mut CycleState) -> Result<PreFilterResult, Reason> {
        state.write(compile(cx.interner(), &cx.request.tolerations));
        Ok(PreFilterResult::Continue)
    }
}

impl FilterPlugin for TaintToleration {
    #[inline]
    fn filter(&self, _: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> Result<(), Reason> {
        if node.taints.is_empty() {
            return Ok(());
        }
        let empty = Tolerations::default();
        check(state.read::<Tolerations>().unwrap_or(&empty), node)
    }

    fn filter_batch(
        &self,
        cx: &Ctx<'_>,
        state: &CycleState,
        slots: &[u32],
        out: &mut [Option<Reason>],
    ) {
        let empty = Tolerations::default();
        let tols = state.read::<Tolerations>().unwrap_or(&empty);
        for_pending(cx.snapshot, slots, out, |n| check(tols, n));
    }
}

#[inline]
fn check(tols: &Tolerations, node: &NodeInfo) -> Result<(), Reason> {
    for t in node.taints.iter() {
        if t.effect != TaintEffect::PreferNoSchedule && !tols.tolerates(t) {
            return Err(Reason::UntoleratedTaint {
                key: t.key,
                value: t.value,
            });
        }
    }
    Ok(())
}

/// Untolerated `PreferNoSchedule` taints of `node`.
#[inline]
fn prefer_no_schedule(tols: &Tolerations, node: &NodeInfo) -> i64 {
    node.taints
        .iter()
        .filter(|t| t.effect == TaintEffect::PreferNoSchedule && !tols.tolerates(t))
        .count() as i64
}

impl PreScorePlugin for TaintToleration {
    fn pre_score(&self, cx: &Ctx<'_>, state: &mut CycleState, _: &[u32]) -> PreScoreResult {
        if cx.snapshot.prefer_no_schedule_nodes == 0 {
            return PreScoreResult::Skip;
        }
        if state.read::<Tolerations>().is_none() {
            state.write(compile(cx.interner(), &cx.request.tolerations));
        }
        PreScoreResult::Continue
    }
}

impl ScorePlugin for TaintToleration {
    fn score(&self, _: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> i64 {
        let empty = Tolerations::default();
        prefer_no_schedule(state.read::<Tolerations>().unwrap_or(&empty), node)
    }

    fn score_batch(&self, cx: &Ctx<'_>, state: &CycleState, slots: &[u32], out: &mut [i64]) {
        let empty = Tolerations::default();
        let tols = state.read::<Tolerations>().unwrap_or(&empty);
        let nodes = &cx.snapshot.nodes;
        for (&s, o) in slots.iter().zip(out.iter_mut()) {
            *o = prefer_no_schedule(tols, &nodes[s as usize]);
        }
    }

    fn normalize(&self, _: &Ctx<'_>, _: &CycleState, scores: &mut [i64]) {
        default_normalize(MAX_NODE_SCORE, true, scores);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::with_ctx;
    use crate::{ClusterSnapshot, Node, Request};

    fn check(node: Node, tols: Vec<Toleration>) -> Result<(), Reason> {
        let snap = ClusterSnapshot::from_nodes([node]).unwrap();
        let mut r = Request::new("x", 1, 1);
        r.tolerations = tols;
        with_ctx(&snap, &r, |cx| {
            let mut st = CycleState::default();
            TaintToleration.pre_filter(cx, &mut st).unwrap();
            TaintToleration.filter(cx, &st, snap.node("n").unwrap())
        })
    }

    fn tol(
        key: &str,
        op: TolerationOperator,
        value: &str,
        effect: Option<TaintEffect>,
    ) -> Toleration {
        Toleration {
            key: key.into(),
            operator: op,
            value: value.into(),
            effect,
        }
    }

    #[test]
    fn toleration_matching() {
        use TaintEffect::*;
        use TolerationOperator::*;
        let n = || Node::new("n", 1, 1).taint("gpu", "a100", NoSchedule);
        assert!(check(n(), vec![]).is_err());
        assert!(check(n(), vec![tol("gpu", Equal, "a100", None)]).is_ok());
        assert!(check(n(), vec![tol("gpu", Equal, "h100", None)]).is_err());
        assert!(check(n(), vec![tol("gpu", Exists, "", None)]).is_ok());
        assert!(check(n(), vec![tol("", Exists, "", None)]).is_ok());
        assert!(check(n(), vec![tol("", Equal, "", None)]).is_err());
        assert!(check(n(), vec![tol("gpu", Exists, "", Some(NoExecute))]).is_err());
        assert!(check(n(), vec![tol("gpu", Exists, "", Some(NoSchedule))]).is_ok());
        assert!(check(n(), vec![tol("unknown-key", Exists, "", None)]).is_err());
        // PreferNoSchedule never filters.
        assert!(
            check(
                Node::new("n", 1, 1).taint("x", "", PreferNoSchedule),
                vec![]
            )
            .is_ok()
        );
        // NoExecute filters like NoSchedule.
        assert!(check(Node::new("n", 1, 1).taint("x", "", NoExecute), vec![]).is_err());
    }

    #[test]
    fn prefer_no_schedule_scores_lower() {
        let snap = ClusterSnapshot::from_nodes([
            Node::new("a", 1, 1),
            Node::new("b", 1, 1).taint("x", "", TaintEffect::PreferNoSchedule),
        ])
        .unwrap();
        let r = Request::new("v", 1, 1);
        with_ctx(&snap, &r, |cx| {
            let mut st = CycleState::default();
            assert_eq!(
                TaintToleration.pre_score(cx, &mut st, &[0, 1]),
                PreScoreResult::Continue
            );
            let mut s = [
                TaintToleration.score(cx, &st, snap.node("a").unwrap()),
                TaintToleration.score(cx, &st, snap.node("b").unwrap()),
            ];
            TaintToleration.normalize(cx, &st, &mut s);
            assert_eq!(s, [100, 0]);
        });
    }
}
