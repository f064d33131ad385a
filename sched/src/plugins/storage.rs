// SPDX-License-Identifier: Apache-2.0
//! StorageLocality: run a VM where its volume already has a healthy replica.

use crate::framework::{
    Ctx, CycleState, FilterPlugin, MAX_NODE_SCORE, Plugin, PreFilterPlugin, PreFilterResult,
    PreScorePlugin, PreScoreResult, Reason, ScorePlugin,
};
use crate::intern::Sym;
use crate::snapshot::NodeInfo;
use crate::types::DataLocality;

/// Longhorn-style data locality for the VM's volume
/// ([`Request::volume_replicas`](crate::Request::volume_replicas)):
/// `BestEffort` scores a node holding a healthy replica 100, a node in the
/// zone of one 50, others 0; `StrictLocal` also filters to replica nodes.
#[derive(Clone, Copy, Debug, Default)]
pub struct StorageLocality;

impl StorageLocality {
    /// Plugin name.
    pub const NAME: &'static str = "StorageLocality";
}

#[derive(Clone, Debug, Default)]
struct Replicas {
    slots: Vec<u32>,
    zones: Vec<Sym>,
}

fn replicas(cx: &Ctx<'_>) -> Replicas {
    let mut r = Replicas::default();
    for loc in cx.request.volume_replicas.iter().filter(|l| l.healthy) {
        if let Some(n) = cx.snapshot.node(&loc.node) {
            r.slots.push(n.slot);
            if let Some(z) = n.zone {
                r.zones.push(z);
            }
        }
    }
    r.slots.sort_unstable();
    r.slots.dedup();
    r
}

impl Plugin for StorageLocality {
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

impl PreFilterPlugin for StorageLocality {
    fn pre_filter(&self, cx: &Ctx<'_>, state: &mut CycleState) -> Result<PreFilterResult, Reason> {
        if cx.request.data_locality != DataLocality::StrictLocal {
            return Ok(PreFilterResult::Skip);
        }
        let r = replicas(cx);
        let slots = r.slots.clone();
        state.write(r);
        Ok(PreFilterResult::Nodes {
            slots,
            reason: Reason::NoLocalReplica,
        })
    }
}

impl FilterPlugin for StorageLocality {
    fn filter(&self, _: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> Result<(), Reason> {
        match state.read::<Replicas>() {
            Some(r) if r.slots.binary_search(&node.slot).is_err() => Err(Reason::NoLocalReplica),
            _ => Ok(()),
        }
    }
}

impl PreScorePlugin for StorageLocality {
    fn pre_score(&self, cx: &Ctx<'_>, state: &mut CycleState, _: &[u32]) -> PreScoreResult {
        if cx.request.data_locality == DataLocality::Disabled
            || !cx.request.volume_replicas.iter().any(|l| l.healthy)
        {
            return PreScoreResult::Skip;
        }
        if state.read::<Replicas>().is_none() {
            state.write(replicas(cx));
        }
        PreScoreResult::Continue
    }
}

impl ScorePlugin for StorageLocality {
    fn score(&self, _: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> i64 {
        let Some(r) = state.read::<Replicas>() else {
            return 0;
        };
        if r.slots.binary_search(&node.slot).is_ok() {
            MAX_NODE_SCORE
        } else if node.zone.is_some_and(|z| r.zones.contains(&z)) {
            MAX_NODE_SCORE / 2
        } else {
            0
        }
    }
}
