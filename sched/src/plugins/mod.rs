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

/// Columns with more domains than this (e.g. hostname) keep sparse counts.
const DENSE_MAX_DOMAINS: usize = 256;

/// Matching-VM counts per topology domain: dense for few domains (zones),
/// sorted `(domain, count)` pairs for many (hostnames), so a term over 20
/// VMs on 5,000 nodes costs 20 entries, not 5,000.
#[derive(Clone, Debug)]
pub(crate) enum DomainCounts {
    Dense(Vec<u32>),
    Sparse {
        /// Sorted `(domain, count)` pairs with `count > 0`.
        pairs: Vec<(u32, u32)>,
        /// Bit `d` set when domain `d` has a count: filters test it without
        /// a search.
        nonzero: Vec<u64>,
    },
}

impl DomainCounts {
    fn from_pairs(domains: usize, mut pairs: Vec<(u32, u32)>) -> Self {
        if domains <= DENSE_MAX_DOMAINS {
            let mut v = vec![0u32; domains];
            for (d, n) in pairs {
                v[d as usize] += n;
            }
            return DomainCounts::Dense(v);
        }
        pairs.sort_unstable();
        let mut out: Vec<(u32, u32)> = Vec::with_capacity(pairs.len());
        let mut nonzero = vec![0u64; domains.div_ceil(64)];
        for (d, n) in pairs {
            if n > 0 {
                nonzero[d as usize / 64] |= 1 << (d % 64);
            }
            match out.last_mut() {
                Some(last) if last.0 == d => last.1 += n,
                _ => out.push((d, n)),
            }
        }
        out.retain(|p| p.1 > 0);
        DomainCounts::Sparse {
            pairs: out,
            nonzero,
        }
    }

    /// Whether domain `d` has a non-zero count.
    #[inline]
    pub(crate) fn positive(&self, d: u32) -> bool {
        match self {
            DomainCounts::Dense(v) => v.get(d as usize).is_some_and(|&c| c > 0),
            DomainCounts::Sparse { nonzero, .. } => nonzero
                .get(d as usize / 64)
                .is_some_and(|w| w & (1 << (d % 64)) != 0),
        }
    }

    /// Count in domain `d`.
    #[inline]
    pub(crate) fn get(&self, d: u32) -> u32 {
        match self {
            DomainCounts::Dense(v) => v.get(d as usize).copied().unwrap_or(0),
            DomainCounts::Sparse { pairs: v, .. } => v
                .binary_search_by_key(&d, |&(x, _)| x)
                .map_or(0, |i| v[i].1),
        }
    }

    /// Adds one to (or removes one from) domain `d`.
    pub(crate) fn adjust(&mut self, d: u32, add: bool) {
        match self {
            DomainCounts::Dense(v) => {
                if let Some(c) = v.get_mut(d as usize) {
                    *c = if add { *c + 1 } else { c.saturating_sub(1) };
                }
            }
            DomainCounts::Sparse { pairs: v, nonzero } => {
                match v.binary_search_by_key(&d, |&(x, _)| x) {
                    Ok(i) if add => v[i].1 += 1,
                    Ok(i) => {
                        v[i].1 = v[i].1.saturating_sub(1);
                        if v[i].1 == 0 {
                            v.remove(i);
                        }
                    }
                    Err(i) if add => v.insert(i, (d, 1)),
                    Err(_) => return,
                }
                let positive = v.binary_search_by_key(&d, |&(x, _)| x).is_ok();
                if let Some(w) = nonzero.get_mut(d as usize / 64) {
                    if positive {
                        *w |= 1 << (d % 64);
                    } else {
                        *w &= !(1 << (d % 64));
                    }
                }
            }
        }
    }

    /// All counts as a dense vector of `domains` entries.
    pub(crate) fn into_dense(self, domains: usize) -> Vec<u32> {
        match self {
            DomainCounts::Dense(v) => v,
            DomainCounts::Sparse { pairs, .. } => {
                let mut v = vec![0u32; domains];
                for (d, n) in pairs {
                    v[d as usize] += n;
                }
                v
            }
        }
    }
}

/// Counts VMs matching `sel` per domain of `col`, only on nodes accepted by
/// `node_ok`. Uses the label-pair index when the selector has an `In`
/// requirement, so only nodes holding candidate VMs are visited.
pub(crate) fn count_matching(
    snap: &ClusterSnapshot,
    sel: &CSelector,
    col: &TopoColumn,
    mut node_ok: impl FnMut(u32) -> bool,
) -> (DomainCounts, u32) {
    let mut pairs: Vec<(u32, u32)> = Vec::new();
    let mut total = 0u32;
    if sel.is_never() {
        return (DomainCounts::from_pairs(col.domains(), pairs), 0);
    }
    let mut add = |slot: u32, n: u32| {
        let d = col.domain_of[slot as usize];
        if d != NO_DOMAIN {
            pairs.push((d, n));
        }
        total += n;
    };
    if let Some(pair) = sel.single_pair() {
        if let Some(m) = snap.vm_pairs.get(&pair) {
            for (&slot, &n) in m {
                if node_ok(slot) {
                    add(slot, n);
                }
            }
        }
    } else {
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
                add(slot, n);
            }
        }
    }
    (DomainCounts::from_pairs(col.domains(), pairs), total)
}

/// Sums per-node counts into per-domain counts of `col`.
pub(crate) fn domain_counts_of_nodes(
    col: &TopoColumn,
    per_node: impl Iterator<Item = (u32, u32)>,
) -> DomainCounts {
    let pairs = per_node
        .filter_map(|(slot, n)| {
            let d = col.domain_of[slot as usize];
            (d != NO_DOMAIN).then_some((d, n))
        })
        .collect();
    DomainCounts::from_pairs(col.domains(), pairs)
}

/// `floor(min(used, cap) * inv * scale)`, where `inv` is `1 / cap`
/// (precomputed per node). The tiny bias keeps exact ratios (e.g. 29/100)
/// from rounding down to the integer below.
#[inline]
pub(crate) fn scaled_fraction(used: u64, cap: u64, inv: f64, scale: f64) -> i64 {
    if cap == 0 {
        return 0;
    }
    ((used.min(cap) as f64 * inv * scale) + 1e-9) as i64
}

/// Column index of a topology key given as a string.
pub(crate) fn column_for(snap: &ClusterSnapshot, key: &str) -> Option<(Sym, usize)> {
    let k = snap.interner.get(key)?;
    snap.column_index(k).map(|c| (k, c))
}

/// Test helper: runs `f` with a context for `req` on `snap`.
#[cfg(test)]
pub(crate) fn with_ctx<R>(
    snap: &ClusterSnapshot,
    req: &crate::types::Request,
    f: impl FnOnce(&crate::framework::Ctx<'_>) -> R,
) -> R {
    let labels = crate::scheduler::request_labels(snap, req);
    f(&crate::framework::Ctx {
        snapshot: snap,
        request: req,
        labels: &labels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_sparse_counts_agree() {
        let pairs = vec![(7, 1), (3, 2), (7, 4), (300, 1)];
        let dense = DomainCounts::from_pairs(
            DENSE_MAX_DOMAINS,
            pairs.iter().copied().filter(|p| p.0 < 256).collect(),
        );
        let mut sparse = DomainCounts::from_pairs(1000, pairs);
        assert!(matches!(sparse, DomainCounts::Sparse { .. }));
        assert!(matches!(dense, DomainCounts::Dense(_)));
        for d in [3, 7, 0, 255] {
            assert_eq!(dense.get(d), sparse.get(d), "{d}");
            assert_eq!(dense.positive(d), sparse.positive(d), "{d}");
        }
        assert!(sparse.positive(300) && !sparse.positive(301) && !sparse.positive(5000));
        assert_eq!(sparse.get(7), 5);
        assert_eq!(sparse.get(300), 1);
        sparse.adjust(300, false);
        assert_eq!(sparse.get(300), 0);
        assert!(!sparse.positive(300));
        sparse.adjust(300, false);
        sparse.adjust(5, true);
        sparse.adjust(5, true);
        assert_eq!(sparse.get(5), 2);
        assert!(sparse.positive(5));
        let v = sparse.into_dense(1000);
        assert_eq!((v[3], v[5], v[7], v[300]), (2, 2, 5, 0));
    }
}
