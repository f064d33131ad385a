// SPDX-License-Identifier: Apache-2.0
//! BalancedAllocation: prefer nodes whose CPU and memory use stay balanced.

use crate::framework::{Ctx, CycleState, MAX_NODE_SCORE, Plugin, ScorePlugin};
use crate::snapshot::NodeInfo;

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

#[inline]
fn permille(used: u64, cap: u64) -> i64 {
    if cap == 0 {
        return 1000;
    }
    crate::plugins::ratio(used.min(cap), cap, 1000) as i64
}

impl ScorePlugin for BalancedAllocation {
    #[inline]
    fn score(&self, cx: &Ctx<'_>, _: &CycleState, node: &NodeInfo) -> i64 {
        let after = node.requested.saturating_add(cx.request.resources);
        let c = permille(after.cpu_millis, node.allocatable.cpu_millis);
        let m = permille(after.memory_bytes, node.allocatable.memory_bytes);
        // Two values: std dev = |c - m| / 2 (in permille).
        let std = (c - m).abs() / 2;
        (1000 - std) * MAX_NODE_SCORE / 1000
    }
}
