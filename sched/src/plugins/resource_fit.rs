// SPDX-License-Identifier: Apache-2.0
//! NodeResourcesFit: CPU, memory and VM-count fit, with overcommit ratios.

use serde::{Deserialize, Serialize};

use crate::framework::{
    Ctx, CycleState, FilterPlugin, MAX_NODE_SCORE, Plugin, Reason, ScorePlugin,
};
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
        let want = cx.request.resources;
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
}

#[inline]
fn fraction_score(used: u64, cap: u64, most: bool) -> i64 {
    if cap == 0 {
        return 0;
    }
    let pct = crate::plugins::ratio(used.min(cap), cap, MAX_NODE_SCORE as u64) as i64;
    if most { pct } else { MAX_NODE_SCORE - pct }
}

impl ScorePlugin for NodeResourcesFit {
    #[inline]
    fn score(&self, cx: &Ctx<'_>, _: &CycleState, node: &NodeInfo) -> i64 {
        let cap = self.effective(node.allocatable);
        let after = node.requested.saturating_add(cx.request.resources);
        let most = self.args.strategy == ScoringStrategy::MostAllocated;
        (fraction_score(after.cpu_millis, cap.cpu_millis, most)
            + fraction_score(after.memory_bytes, cap.memory_bytes, most))
            / 2
    }
}
