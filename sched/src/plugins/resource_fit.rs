// SPDX-License-Identifier: Apache-2.0
//! NodeResourcesFit: CPU, memory and VM-count fit, with overcommit ratios.

use serde::{Deserialize, Serialize};

use crate::framework::{
    Ctx, CycleState, FilterPlugin, MAX_NODE_SCORE, Plugin, Reason, ScorePlugin, for_pending,
};
use crate::plugins::scaled_fraction;
use crate::snapshot::NodeInfo;
use crate::types::Resources;

/// How NodeResourcesFit scores nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ScoringStrategy {
    /// Prefer the emptiest nodes (spreads load; Kubernetes' default).
    #[default]
    LeastAllocated,
    /// Prefer the fullest nodes (bin packing, frees whole nodes).
    MostAllocated,
}

/// Arguments of [`NodeResourcesFit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceFitArgs {
    /// Scoring strategy.
    #[serde(default)]
    pub strategy: ScoringStrategy,
    /// CPU overcommit in percent of allocatable (100 = none; 400 = 4:1).
    #[serde(default = "hundred")]
    pub cpu_overcommit_percent: u32,
    /// Memory overcommit in percent of allocatable (100 = none).
    #[serde(default = "hundred")]
    pub memory_overcommit_percent: u32,
}

fn hundred() -> u32 {
    100
}

impl Default for ResourceFitArgs {
    fn default() -> Self {
        Self {
            strategy: ScoringStrategy::LeastAllocated,
            cpu_overcommit_percent: 100,
            memory_overcommit_percent: 100,
        }
    }
}

/// Fits the request into allocatable x overcommit, and scores by the
/// configured [`ScoringStrategy`] (CPU and memory weighted equally).
#[derive(Clone, Copy, Debug, Default)]
pub struct NodeResourcesFit {
    args: ResourceFitArgs,
}

impl NodeResourcesFit {
    /// Plugin name.
    pub const NAME: &'static str = "NodeResourcesFit";

    /// With the given arguments.
    pub fn new(args: ResourceFitArgs) -> Self {
        Self { args }
    }

    /// Effective capacity after overcommit.
    #[inline]
    pub fn effective(&self, alloc: Resources) -> Resources {
        Resources {
            cpu_millis: scale(alloc.cpu_millis, self.args.cpu_overcommit_percent),
            memory_bytes: scale(alloc.memory_bytes, self.args.memory_overcommit_percent),
        }
    }
}

#[inline]
fn scale(v: u64, pct: u32) -> u64 {
    if pct == 100 {
        v
    } else {
        u64::try_from(u128::from(v) * u128::from(pct) / 100).unwrap_or(u64::MAX)
    }
}

impl Plugin for NodeResourcesFit {
    fn name(&self) -> &str {
        Self::NAME
    }
    fn as_filter(&self) -> Option<&dyn FilterPlugin> {
        Some(self)
    }
    fn as_score(&self) -> Option<&dyn ScorePlugin> {
        Some(self)
    }
}

impl FilterPlugin for NodeResourcesFit {
    #[inline]
    fn filter(&self, cx: &Ctx<'_>, _: &CycleState, node: &NodeInfo) -> Result<(), Reason> {
        self.check(cx.request.resources, node)
    }

    fn filter_batch(
        &self,
        cx: &Ctx<'_>,
        _: &CycleState,
        slots: &[u32],
        out: &mut [Option<Reason>],
    ) {
        let want = cx.request.resources;
        for_pending(cx.snapshot, slots, out, |n| self.check(want, n));
    }
}

impl NodeResourcesFit {
    #[inline]
    fn check(&self, want: Resources, node: &NodeInfo) -> Result<(), Reason> {
        let cap = self.effective(node.allocatable);
        let used = node.requested;
        let cpu =
            want.cpu_millis > 0 && used.cpu_millis.saturating_add(want.cpu_millis) > cap.cpu_millis;
        let memory = want.memory_bytes > 0
            && used.memory_bytes.saturating_add(want.memory_bytes) > cap.memory_bytes;
        let vms = node.vm_count >= node.max_vms;
        if cpu || memory || vms {
            Err(Reason::Insufficient { cpu, memory, vms })
        } else {
            Ok(())
        }
    }

    /// Per-cycle constants of [`score_node`](Self::score_node):
    /// `1 / (allocatable * pct / 100) = (1 / allocatable) * 100 / pct`.
    #[inline]
    fn score_scales(&self) -> (f64, f64) {
        let scale = |pct: u32| 100.0 * MAX_NODE_SCORE as f64 / f64::from(pct.max(1));
        (
            scale(self.args.cpu_overcommit_percent),
            scale(self.args.memory_overcommit_percent),
        )
    }

    #[inline]
    fn score_node(&self, want: Resources, (sc, sm): (f64, f64), node: &NodeInfo) -> i64 {
        let cap = self.effective(node.allocatable);
        let after = node.requested.saturating_add(want);
        let (ic, im) = node.inv_allocatable;
        let c = scaled_fraction(after.cpu_millis, cap.cpu_millis, ic, sc).min(MAX_NODE_SCORE);
        let m = scaled_fraction(after.memory_bytes, cap.memory_bytes, im, sm).min(MAX_NODE_SCORE);
        let (c, m) = match self.args.strategy {
            ScoringStrategy::MostAllocated => (c, m),
            ScoringStrategy::LeastAllocated => (
                if cap.cpu_millis == 0 {
                    0
                } else {
                    MAX_NODE_SCORE - c
                },
                if cap.memory_bytes == 0 {
                    0
                } else {
                    MAX_NODE_SCORE - m
                },
            ),
        };
        (c + m) / 2
    }
}

impl ScorePlugin for NodeResourcesFit {
    #[inline]
    fn score(&self, cx: &Ctx<'_>, _: &CycleState, node: &NodeInfo) -> i64 {
        self.score_node(cx.request.resources, self.score_scales(), node)
    }

    fn resources_only(&self) -> bool {
        true
    }

    fn score_batch(&self, cx: &Ctx<'_>, _: &CycleState, slots: &[u32], out: &mut [i64]) {
        let (want, scales, nodes) = (
            cx.request.resources,
            self.score_scales(),
            &cx.snapshot.nodes,
        );
        for (&s, o) in slots.iter().zip(out.iter_mut()) {
            *o = self.score_node(want, scales, &nodes[s as usize]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framework::CycleState;
    use crate::plugins::with_ctx;
    use crate::{ClusterSnapshot, Node, Request};

    const GIB: u64 = 1 << 30;

    #[test]
    fn filter_reports_every_short_resource_and_honours_overcommit() {
        let mut snap =
            ClusterSnapshot::from_nodes([Node::new("n", 4_000, 8 * GIB).max_vms(2)]).unwrap();
        snap.bind(&Request::new("a", 3_000, 6 * GIB), "n").unwrap();
        snap.bind(&Request::new("b", 0, 0), "n").unwrap();
        let node = snap.node("n").unwrap();
        let st = CycleState::default();
        let plain = NodeResourcesFit::default();
        let r = Request::new("x", 2_000, 4 * GIB);
        let err = with_ctx(&snap, &r, |cx| plain.filter(cx, &st, node)).unwrap_err();
        assert_eq!(
            err,
            Reason::Insufficient {
                cpu: true,
                memory: true,
                vms: true
            }
        );
        let oc = NodeResourcesFit::new(ResourceFitArgs {
            cpu_overcommit_percent: 200,
            memory_overcommit_percent: 200,
            ..ResourceFitArgs::default()
        });
        let err = with_ctx(&snap, &r, |cx| oc.filter(cx, &st, node)).unwrap_err();
        assert_eq!(
            err,
            Reason::Insufficient {
                cpu: false,
                memory: false,
                vms: true
            }
        );
        // Zero-sized requests never fail on resources.
        let z = Request::new("z", 0, 0);
        let mut snap2 = ClusterSnapshot::from_nodes([Node::new("m", 0, 0)]).unwrap();
        snap2.add_node(Node::new("k", 1, 1)).unwrap();
        let m = snap2.node("m").unwrap();
        assert!(with_ctx(&snap2, &z, |cx| plain.filter(cx, &st, m)).is_ok());
    }

    #[test]
    fn least_and_most_allocated_scores() {
        let mut snap = ClusterSnapshot::from_nodes([Node::new("n", 4_000, 8 * GIB)]).unwrap();
        snap.bind(&Request::new("a", 1_000, 2 * GIB), "n").unwrap();
        let node = snap.node("n").unwrap();
        let st = CycleState::default();
        let r = Request::new("x", 1_000, 2 * GIB);
        // After placing: 50% CPU and 50% memory used.
        let least = NodeResourcesFit::default();
        assert_eq!(with_ctx(&snap, &r, |cx| least.score(cx, &st, node)), 50);
        let most = NodeResourcesFit::new(ResourceFitArgs {
            strategy: ScoringStrategy::MostAllocated,
            ..ResourceFitArgs::default()
        });
        let r = Request::new("x", 2_000, 0);
        // 75% CPU, 25% memory.
        assert_eq!(with_ctx(&snap, &r, |cx| most.score(cx, &st, node)), 50);
        assert_eq!(with_ctx(&snap, &r, |cx| least.score(cx, &st, node)), 50);
        let r = Request::new("x", 1_160, 0);
        // 54% CPU exactly (2160/4000): no rounding down to 53.
        assert_eq!(
            with_ctx(&snap, &r, |cx| most.score(cx, &st, node)),
            (54 + 25) / 2
        );
    }
}
