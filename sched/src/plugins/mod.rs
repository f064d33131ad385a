// SPDX-License-Identifier: Apache-2.0
//! Built-in plugins (the default profile enables all of them).
//!
//! | plugin | points | Kubernetes counterpart |
//! |---|---|---|
//! | [`NodeUnschedulable`] | pre-filter, filter | NodeUnschedulable |
//! | [`NodeName`] | pre-filter, filter | NodeName |
//! | [`TaintToleration`] | pre-filter, filter, pre-score, score | TaintToleration |
//! | [`NodeAffinity`] | pre-filter, filter, pre-score, score | NodeAffinity |
//! | [`NodeResourcesFit`] | filter, score | NodeResourcesFit (+ overcommit ratios) |
//! | [`BalancedAllocation`] | score | NodeResourcesBalancedAllocation |
//! | [`InterVmAffinity`] | pre-filter, filter, pre-score, score | InterPodAffinity |
//! | [`TopologySpread`] | pre-filter, filter, pre-score, score | PodTopologySpread |
//! | [`StorageLocality`] | pre-filter, filter, pre-score, score | (Longhorn data locality) |
//! | [`DefaultPreemption`] | post-filter | DefaultPreemption |

mod balanced;
mod inter_vm;
mod node_affinity;
mod node_name;
mod node_unschedulable;
mod preemption;
mod resource_fit;
mod spread;
mod storage;
mod taints;

pub use balanced::BalancedAllocation;
pub use inter_vm::InterVmAffinity;
pub use node_affinity::NodeAffinity;
pub use node_name::NodeName;
pub use node_unschedulable::NodeUnschedulable;
pub use preemption::DefaultPreemption;
pub use resource_fit::{NodeResourcesFit, ResourceFitArgs, ScoringStrategy};
pub use spread::TopologySpread;
pub use storage::StorageLocality;
pub use taints::TaintToleration;

use crate::intern::Sym;
use crate::selector::CSelector;
use crate::snapshot::{ClusterSnapshot, NO_DOMAIN, TopoColumn};

/// Counts VMs matching `sel` per domain of `col`, only on nodes accepted by
/// `node_ok`. Uses the label-pair index when the selector has an `In`
/// requirement, so only nodes holding candidate VMs are visited.
pub(crate) fn count_matching(
    snap: &ClusterSnapshot,
    sel: &CSelector,
    col: &TopoColumn,
    mut node_ok: impl FnMut(u32) -> bool,
) -> (Vec<u32>, u32) {
    let mut counts = vec![0u32; col.domains()];
    let mut total = 0u32;
    if sel.is_never() {
        return (counts, 0);
    }
    let mut add = |slot: u32, n: u32, counts: &mut Vec<u32>| {
        let d = col.domain_of[slot as usize];
        if d != NO_DOMAIN {
            counts[d as usize] += n;
        }
        total += n;
    };
    if let Some(pair) = sel.single_pair() {
        if let Some(m) = snap.vm_pairs.get(&pair) {
            for (&slot, &n) in m {
                if node_ok(slot) {
                    add(slot, n, &mut counts);
                }
            }
        }
        return (counts, total);
    }
    let mut slots: Vec<u32> = match sel.first_in() {
        Some((k, vs)) => vs
            .iter()
            .filter_map(|&v| snap.vm_pairs.get(&(k, v)))
            .flat_map(|m| m.keys().copied())
            .collect(),
        None => snap.nodes().map(|n| n.slot).collect(),
    };
    slots.sort_unstable();
    slots.dedup();
    for slot in slots {
        if !node_ok(slot) {
            continue;
        }
        let node = &snap.nodes[slot as usize];
        let n = node
            .vms
            .iter()
            .filter_map(|&id| snap.vm(id))
            .filter(|vm| sel.matches(&vm.labels, &snap.interner))
            .count() as u32;
        if n > 0 {
            add(slot, n, &mut counts);
        }
    }
    (counts, total)
}

/// `part * scale / whole` for `part <= whole`, in u64 when it cannot
/// overflow (always, for real machine sizes), else in u128.
#[inline]
pub(crate) fn ratio(part: u64, whole: u64, scale: u64) -> u64 {
    if whole == 0 {
        return 0;
    }
    match part.checked_mul(scale) {
        Some(p) => p / whole,
        None => (u128::from(part) * u128::from(scale) / u128::from(whole)) as u64,
    }
}

/// Column index of a topology key given as a string.
pub(crate) fn column_for(snap: &ClusterSnapshot, key: &str) -> Option<(Sym, usize)> {
    let k = snap.interner.get(key)?;
    snap.column_index(k).map(|c| (k, c))
}
