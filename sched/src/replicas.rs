// SPDX-License-Identifier: Apache-2.0
//! Replica placement for volumes (Longhorn's replica scheduler).
//!
//! New replicas go on distinct nodes (never one already holding a replica of
//! the volume), on a disk with the requested tags and enough unpromised
//! space, spread across zones: each pick takes the candidate whose zone has
//! the fewest replicas so far, then the disk with the most free space after
//! placement, then the lowest node slot. With `ZoneAntiAffinity::Hard` a zone
//! never holds two replicas.

use std::collections::HashMap;

use crate::error::{SchedResult, Unschedulable};
use crate::intern::Sym;
use crate::scheduler::Scheduler;
use crate::selector::CSelector;
use crate::snapshot::ClusterSnapshot;
use crate::types::{ReplicaPlacement, ReplicaRequest, ReplicaTarget, ZoneAntiAffinity};

struct Candidate {
    slot: u32,
    disk: usize,
    free_after: u64,
    zone: Option<Sym>,
}

impl Scheduler {
    /// Chooses nodes and disks for the replicas of a volume that are missing
    /// (`replicas` minus healthy `existing`). Does not change the snapshot:
    /// record the result with [`ClusterSnapshot::bind_replicas`].
    pub fn place_replicas(
        &self,
        snapshot: &ClusterSnapshot,
        request: &ReplicaRequest,
    ) -> SchedResult<ReplicaPlacement> {
        let snap = snapshot;
        let mut out = ReplicaPlacement {
            volume: request.volume.clone(),
            size_bytes: request.size_bytes,
            targets: Vec::new(),
        };
        let healthy = request.existing.iter().filter(|l| l.healthy).count() as u32;
        let needed = request.replicas.saturating_sub(healthy) as usize;
        if needed == 0 {
            return Ok(out);
        }
        let mut taken: Vec<u32> = request
            .existing
            .iter()
            .filter_map(|l| snap.node(&l.node).map(|n| n.slot))
            .collect();
        let mut zone_count: HashMap<Sym, u32> = HashMap::new();
        for l in request.existing.iter().filter(|l| l.healthy) {
            if let Some(z) = snap.node(&l.node).and_then(|n| n.zone) {
                *zone_count.entry(z).or_insert(0) += 1;
            }
        }
        let selector = CSelector::lookup_map(&snap.interner, &request.node_selector);
        let pct = u128::from(self.replicas.over_provisioning_percent);
        let mut reasons: HashMap<String, u32> = HashMap::new();
        let mut fail = |m: &str| *reasons.entry(m.to_string()).or_insert(0) += 1;
        let mut cands: Vec<Candidate> = Vec::new();
        for node in snap.nodes() {
            if node.unschedulable {
                fail("node(s) were unschedulable");
                continue;
            }
            if !selector.matches(&node.labels, &snap.interner) {
                fail("node(s) didn't match the volume's node selector");
                continue;
            }
            if taken.contains(&node.slot) {
                fail("node(s) already hold a replica of the volume");
                continue;
            }
            let mut tagged = false;
            let mut best: Option<(usize, u64)> = None;
            for (i, d) in node.spec.disks.iter().enumerate() {
                if !d.schedulable || !request.disk_tags.iter().all(|t| d.tags.contains(t)) {
                    continue;
                }
                tagged = true;
                let limit =
                    u128::from(d.capacity_bytes.saturating_sub(d.reserved_bytes)) * pct / 100;
                let after = u128::from(d.scheduled_bytes) + u128::from(request.size_bytes);
                if after <= limit {
                    let free = u64::try_from(limit - after).unwrap_or(u64::MAX);
                    if best.is_none_or(|(_, f)| free > f) {
                        best = Some((i, free));
                    }
                }
            }
            match best {
                Some((disk, free_after)) => cands.push(Candidate {
                    slot: node.slot,
                    disk,
                    free_after,
                    zone: node.zone,
                }),
                None if !tagged => {
                    fail("node(s) had no schedulable disk matching the volume's disk tags")
                }
                None => fail("Insufficient storage"),
            }
        }
        let hard = request.zone_anti_affinity == ZoneAntiAffinity::Hard;
        while out.targets.len() < needed {
            let zc = |c: &Candidate| {
                c.zone
                    .map_or(0, |z| zone_count.get(&z).copied().unwrap_or(0))
            };
            let pick = cands
                .iter()
                .enumerate()
                .filter(|(_, c)| !taken.contains(&c.slot))
                .filter(|(_, c)| !hard || zc(c) == 0)
                .min_by(|(_, a), (_, b)| {
                    zc(a)
                        .cmp(&zc(b))
                        .then(b.free_after.cmp(&a.free_after))
                        .then(a.slot.cmp(&b.slot))
                })
                .map(|(i, _)| i);
            let Some(i) = pick else { break };
            let c = &cands[i];
            taken.push(c.slot);
            if let Some(z) = c.zone {
                *zone_count.entry(z).or_insert(0) += 1;
            }
            let node = &snap.nodes[c.slot as usize];
            out.targets.push(ReplicaTarget {
                node: node.name().to_string(),
                disk: node.spec.disks[c.disk].name.clone(),
                zone: node.spec.zone.clone(),
            });
        }
        if out.targets.len() < needed {
            let placed = out.targets.len() as u32;
            let blocked = cands.len() as u32 - placed;
            if blocked > 0 {
                *reasons
                    .entry(
                        "node(s) are in a zone that already holds a replica of the volume".into(),
                    )
                    .or_insert(0) += blocked;
            }
            let mut u = Unschedulable::new(
                format!("volume {}", request.volume),
                snap.node_count() as u32,
                reasons,
            );
            u.available_nodes = placed;
            u.note = Some(format!(
                "{placed} of {needed} new replica(s) could be placed on distinct nodes"
            ));
            return Err(u.into());
        }
        Ok(out)
    }
}
