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
    fn tracks_vms(&self) -> bool {
        false
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugins::with_ctx;
    use crate::{ClusterSnapshot, Node, ReplicaLocation, Request};

    #[test]
    fn locality_scores_and_strict_filter() {
        let snap = ClusterSnapshot::from_nodes([
            Node::new("a", 1, 1).zone("z1"),
            Node::new("b", 1, 1).zone("z1"),
            Node::new("c", 1, 1).zone("z2"),
            Node::new("d", 1, 1).zone("z2"),
        ])
        .unwrap();
        let mut r = Request::new("v", 1, 1).replica_on("a");
        r.volume_replicas.push(ReplicaLocation {
            node: "c".into(),
            disk: None,
            healthy: false,
        });
        with_ctx(&snap, &r, |cx| {
            let mut st = CycleState::default();
            assert_eq!(
                StorageLocality.pre_filter(cx, &mut st).unwrap(),
                PreFilterResult::Skip
            );
            assert_eq!(
                StorageLocality.pre_score(cx, &mut st, &[]),
                PreScoreResult::Continue
            );
            let s: Vec<i64> = ["a", "b", "c", "d"]
                .iter()
                .map(|n| StorageLocality.score(cx, &st, snap.node(n).unwrap()))
                .collect();
            // Unhealthy replica on c counts for nothing.
            assert_eq!(s, [100, 50, 0, 0]);
        });
        r.data_locality = DataLocality::StrictLocal;
        with_ctx(&snap, &r, |cx| {
            let mut st = CycleState::default();
            match StorageLocality.pre_filter(cx, &mut st).unwrap() {
                PreFilterResult::Nodes { slots, reason } => {
                    assert_eq!(slots, vec![0]);
                    assert_eq!(reason, Reason::NoLocalReplica);
                }
                o => panic!("{o:?}"),
            }
            assert!(
                StorageLocality
                    .filter(cx, &st, snap.node("a").unwrap())
                    .is_ok()
            );
            assert!(
                StorageLocality
                    .filter(cx, &st, snap.node("b").unwrap())
                    .is_err()
            );
        });
        r.data_locality = DataLocality::Disabled;
        with_ctx(&snap, &r, |cx| {
            let mut st = CycleState::default();
            assert_eq!(
                StorageLocality.pre_score(cx, &mut st, &[]),
                PreScoreResult::Skip
            );
        });
    }
}
