// SPDX-License-Identifier: Apache-2.0
//! BalancedAllocation: prefer nodes whose CPU and memory use stay balanced.

use crate::framework::{Ctx, CycleState, MAX_NODE_SCORE, Plugin, ScorePlugin};
use crate::plugins::scaled_fraction;
use crate::snapshot::NodeInfo;
use crate::types::Resources;

/// Scores `(1 - std_dev(cpu_fraction, memory_fraction)) * 100` after placing
/// the VM, like Kubernetes' NodeResourcesBalancedAllocation.
#[derive(Clone, Copy, Debug, Default)]
pub struct BalancedAllocation;

impl BalancedAllocation {
    /// Plugin name.
    pub const NAME: &'static str = "BalancedAllocation";
}

impl Plugin for BalancedAllocation {
    fn name(&self) -> &str {
        Self::NAME
    }
    fn as_score(&self) -> Option<&dyn ScorePlugin> {
        Some(self)
    }
}

impl ScorePlugin for BalancedAllocation {
    #[inline]
    fn score(&self, cx: &Ctx<'_>, _: &CycleState, node: &NodeInfo) -> i64 {
        balance(cx.request.resources, node)
    }

    fn resources_only(&self) -> bool {
        true
    }

    fn score_batch(&self, cx: &Ctx<'_>, _: &CycleState, slots: &[u32], out: &mut [i64]) {
        let (want, nodes) = (cx.request.resources, &cx.snapshot.nodes);
        for (&s, o) in slots.iter().zip(out.iter_mut()) {
            *o = balance(want, &nodes[s as usize]);
        }
    }
}

#[inline]
fn balance(want: Resources, node: &NodeInfo) -> i64 {
    let after = node.requested.saturating_add(want);
    let (ic, im) = node.inv_allocatable;
    let permille = |used: u64, cap: u64, inv: f64| {
        if cap == 0 {
            1000
        } else {
            scaled_fraction(used, cap, inv, 1000.0).min(1000)
        }
    };
    let c = permille(after.cpu_millis, node.allocatable.cpu_millis, ic);
    let m = permille(after.memory_bytes, node.allocatable.memory_bytes, im);
    // Two values: std dev = |c - m| / 2 (in permille).
    let std = (c - m).abs() / 2;
    (1000 - std) * MAX_NODE_SCORE / 1000
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::with_ctx;
    use crate::{ClusterSnapshot, Node, Request};

    #[test]
    fn balanced_prefers_even_use() {
        let snap = ClusterSnapshot::from_nodes([Node::new("n", 4_000, 4_000)]).unwrap();
        let node = snap.node("n").unwrap();
        let st = CycleState::default();
        let score = |c, m| {
            with_ctx(&snap, &Request::new("x", c, m), |cx| {
                BalancedAllocation.score(cx, &st, node)
            })
        };
        assert_eq!(score(2_000, 2_000), 100);
        assert_eq!(score(4_000, 0), 50);
        assert!(score(3_000, 1_000) > score(4_000, 0));
        assert!(score(3_000, 1_000) < score(2_000, 2_000));
    }
}
