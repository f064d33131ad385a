// SPDX-License-Identifier: Apache-2.0
//! DefaultPreemption: evict a minimal set of lower-priority VMs.
//!
//! For each node that failed for a reason eviction can fix, as in
//! kube-scheduler: remove every lower-priority VM, re-run the filters; if the
//! VM fits, add the removed VMs back one at a time, most important first
//! (higher priority, then bound earlier), keeping each that still lets the VM
//! fit ("reprieve"). The rest are the node's victims. Among candidate nodes
//! pick the one whose most important victim has the lowest priority, then
//! the lowest sum of victim priorities, then the fewest victims, then the
//! first in scan order.

use crate::error::{ReasonCount, join_reasons, sort_reasons};
use crate::framework::{
    Ctx, CycleState, FilterChain, Nomination, Plugin, PostFilterPlugin, Reason,
};
use crate::snapshot::{NodeInfo, VmInfo};
use crate::types::PreemptionPolicy;

/// The preemption post-filter.
#[derive(Clone, Copy, Debug)]
pub struct DefaultPreemption {
    /// Stop after this percentage of nodes are viable candidates (10).
    pub min_candidate_nodes_percentage: u32,
    /// ... but look for at least this many (100).
    pub min_candidate_nodes_absolute: u32,
}

impl Default for DefaultPreemption {
    fn default() -> Self {
        Self {
            min_candidate_nodes_percentage: 10,
            min_candidate_nodes_absolute: 100,
        }
    }
}

impl DefaultPreemption {
    /// Plugin name.
    pub const NAME: &'static str = "DefaultPreemption";
}

impl Plugin for DefaultPreemption {
    fn name(&self) -> &str {
        Self::NAME
    }
    fn as_post_filter(&self) -> Option<&dyn PostFilterPlugin> {
        Some(self)
    }
}

/// Ordering key of a candidate: smaller is better.
type Key = (i32, i64, usize);

impl PostFilterPlugin for DefaultPreemption {
    fn post_filter(
        &self,
        cx: &Ctx<'_>,
        state: &CycleState,
        chain: &FilterChain<'_>,
        failed: &[(u32, Reason)],
    ) -> Result<Nomination, String> {
        let req = cx.request;
        if req.preemption_policy == PreemptionPolicy::Never {
            return Err("not eligible due to preemptionPolicy=Never.".into());
        }
        let snap = cx.snapshot;
        let n = snap.node_count();
        let want = (n * self.min_candidate_nodes_percentage as usize / 100)
            .max(self.min_candidate_nodes_absolute as usize)
            .min(n)
            .max(1);
        let mut best: Option<(Key, Nomination)> = None;
        let (mut found, mut not_helpful, mut no_victims) = (0usize, 0u32, 0u32);
        let mut lower: Vec<&VmInfo> = Vec::new();
        // One simulated node and (when a pre-filter tracks VMs) one state
        // copy, reused across candidates.
        let tracking = chain.tracks_vms();
        let mut sim: Option<NodeInfo> = None;
        let mut copy: Option<CycleState> = None;
        for (slot, reason) in failed {
            if found >= want {
                break;
            }
            if !reason.resolvable() {
                not_helpful += 1;
                continue;
            }
            let node = &snap.nodes[*slot as usize];
            lower.clear();
            lower.extend(
                node.vms
                    .iter()
                    .filter_map(|&id| snap.vm(id))
                    .filter(|v| v.priority < req.priority),
            );
            if lower.is_empty() {
                no_victims += 1;
                continue;
            }
            let sim = match &mut sim {
                Some(s) => {
                    s.copy_from(node);
                    s
                }
                None => sim.insert(node.clone()),
            };
            let mut st = if tracking {
                Some(match &mut copy {
                    Some(c) => {
                        c.clone_from(state);
                        c
                    }
                    None => copy.insert(state.clone()),
                })
            } else {
                None
            };
            for v in &lower {
                sim.remove_vm_usage(v);
                if let Some(st) = st.as_deref_mut() {
                    chain.remove_vm(cx, st, v, sim);
                }
            }
            if chain.run(cx, st.as_deref().unwrap_or(state), sim).is_err() {
                no_victims += 1;
                continue;
            }
            found += 1;
            // At least one VM must go (with all of them back the node fails
            // as before), so with non-negative priorities the key is at
            // least (lowest priority, lowest priority, 1). A candidate that
            // cannot beat the best so far (ties keep the earlier one) needs
            // no reprieve pass.
            let low = lower.iter().map(|v| v.priority).min().unwrap_or(i32::MIN);
            if low >= 0
                && let Some((k, _)) = &best
                && *k <= (low, i64::from(low), 1)
            {
                continue;
            }
            lower.sort_by(|a, b| b.priority.cmp(&a.priority).then(a.seq.cmp(&b.seq)));
            let mut victims: Vec<&VmInfo> = Vec::new();
            for v in &lower {
                sim.add_vm_usage(v);
                if let Some(st) = st.as_deref_mut() {
                    chain.add_vm(cx, st, v, sim);
                }
                if chain.run(cx, st.as_deref().unwrap_or(state), sim).is_err() {
                    sim.remove_vm_usage(v);
                    if let Some(st) = st.as_deref_mut() {
                        chain.remove_vm(cx, st, v, sim);
                    }
                    victims.push(v);
                }
            }
            let key: Key = (
                victims.iter().map(|v| v.priority).max().unwrap_or(i32::MIN),
                victims.iter().map(|v| i64::from(v.priority)).sum(),
                victims.len(),
            );
            if best.as_ref().is_none_or(|(k, _)| key < *k) {
                best = Some((
                    key,
                    Nomination {
                        node: *slot,
                        victims: victims.iter().map(|v| v.id).collect(),
                    },
                ));
            }
        }
        if let Some((_, nom)) = best {
            return Ok(nom);
        }
        let mut reasons = Vec::new();
        if no_victims > 0 {
            reasons.push(ReasonCount {
                count: no_victims,
                reason: "No preemption victims found for incoming VM".into(),
            });
        }
        if not_helpful > 0 {
            reasons.push(ReasonCount {
                count: not_helpful,
                reason: "Preemption is not helpful for scheduling".into(),
            });
        }
        sort_reasons(&mut reasons);
        Err(format!(
            "0/{} nodes are available: {}.",
            n,
            join_reasons(&reasons)
        ))
    }
}
