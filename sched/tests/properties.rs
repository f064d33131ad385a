// SPDX-License-Identifier: Apache-2.0
//! Property tests: for random clusters and request sequences, the scheduler
//! never over-commits a node, never violates a required constraint, places
//! replicas on distinct nodes, is all-or-nothing for gangs, never claims
//! "unschedulable" when a node fits, and is deterministic.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use proptest::prelude::*;
use sheaf_sched::{
    ClusterSnapshot, HOSTNAME_LABEL, LabelSelector, Node, Placement, PreemptionPolicy,
    ReplicaLocation, ReplicaRequest, Request, SchedError, Scheduler, TaintEffect,
    TopologySpreadConstraint, WhenUnsatisfiable, ZONE_LABEL, ZoneAntiAffinity,
};

const GIB: u64 = 1 << 30;
const APPS: [&str; 3] = ["web", "db", "cache"];

/// (cores, GiB, zone, ssd, taint kind, max VMs, cordoned, disk GiB)
type NodeSpec = (u64, u64, u8, bool, u8, u32, bool, u64);

fn node_strategy() -> impl Strategy<Value = NodeSpec> {
    (
        1u64..16,                  // cores
        1u64..32,                  // GiB
        0u8..4,                    // zone (3 = none)
        any::<bool>(),             // disk=ssd label
        0u8..6, // taint kind (0: NoSchedule gpu, 1: NoExecute, 2: PreferNoSchedule, else none)
        1u32..8, // max vms
        prop::bool::weighted(0.1), // cordoned
        10u64..200, // disk GiB
    )
}

fn build_nodes(specs: &[NodeSpec]) -> Vec<Node> {
    specs
        .iter()
        .enumerate()
        .map(|(i, &(c, m, z, ssd, t, max, cordon, disk))| {
            let mut n = Node::new(format!("n{i}"), c * 1000, m * GIB)
                .max_vms(max)
                .disk("d0", disk * GIB);
            if z < 3 {
                n = n.zone(["a", "b", "c"][z as usize]);
            }
            if ssd {
                n = n.label("disk", "ssd");
            }
            match t {
                0 => n = n.taint("gpu", "true", TaintEffect::NoSchedule),
                1 => n = n.taint("gpu", "true", TaintEffect::NoExecute),
                2 => n = n.taint("flaky", "", TaintEffect::PreferNoSchedule),
                _ => {}
            }
            n.unschedulable = cordon;
            n
        })
        .collect()
}

#[derive(Clone, Debug)]
struct ReqSpec {
    millis: u64,
    mib: u64,
    app: usize,
    prio: i32,
    ssd: bool,
    tolerate: bool,
    anti: u8, // 0 none, 1 host, 2 zone
    aff: bool,
    spread: bool,
    never: bool,
}

fn req_strategy() -> impl Strategy<Value = ReqSpec> {
    (
        (100u64..8000, 128u64..16384, 0usize..3, 0i32..4),
        (
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.3),
            0u8..3,
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.2),
        ),
    )
        .prop_map(
            |((millis, mib, app, prio), (ssd, tolerate, anti, aff, spread, never))| ReqSpec {
                millis,
                mib,
                app,
                prio,
                ssd,
                tolerate,
                anti,
                aff,
                spread,
                never,
            },
        )
}

fn build_req(i: usize, s: &ReqSpec) -> Request {
    let app = APPS[s.app];
    let mut r = Request::new(format!("vm{i}"), s.millis, s.mib << 20)
        .label("app", app)
        .priority(s.prio);
    if s.ssd {
        r = r.node_selector("disk", "ssd");
    }
    if s.tolerate {
        r = r.tolerate("gpu", "true");
    }
    match s.anti {
        1 => r = r.anti_affinity("app", app, HOSTNAME_LABEL),
        2 => r = r.anti_affinity("app", app, ZONE_LABEL),
        _ => {}
    }
    if s.aff {
        r = r.affinity("app", APPS[(s.app + 1) % 3], ZONE_LABEL);
    }
    if s.spread {
        r.topology_spread.push(TopologySpreadConstraint {
            max_skew: 1,
            topology_key: ZONE_LABEL.into(),
            when_unsatisfiable: WhenUnsatisfiable::DoNotSchedule,
            selector: LabelSelector::eq("app", app),
        });
    }
    if s.never {
        r.preemption_policy = PreemptionPolicy::Never;
    }
    r
}

fn label<'a>(n: &'a Node, key: &str) -> Option<&'a str> {
    match key {
        HOSTNAME_LABEL => Some(&n.name),
        ZONE_LABEL => n.zone.as_deref(),
        k => n.labels.get(k).map(String::as_str),
    }
}

fn sel_matches(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    sel.match_labels
        .iter()
        .all(|(k, v)| labels.get(k) == Some(v))
}

/// Global invariants over the snapshot and the requests of bound VMs.
fn check_invariants(
    snap: &ClusterSnapshot,
    bound: &BTreeMap<String, Request>,
) -> Result<(), TestCaseError> {
    for n in snap.nodes() {
        prop_assert!(
            n.requested().cpu_millis <= n.allocatable().cpu_millis,
            "cpu over-commit on {}",
            n.name()
        );
        prop_assert!(
            n.requested().memory_bytes <= n.allocatable().memory_bytes,
            "memory over-commit on {}",
            n.name()
        );
        prop_assert!(n.vm_count() <= n.max_vms(), "too many VMs on {}", n.name());
        let sum: u64 = n
            .vm_ids()
            .iter()
            .map(|&id| snap.vm(id).unwrap().resources().cpu_millis)
            .sum();
        prop_assert_eq!(sum, n.requested().cpu_millis);
        for d in &n.spec().disks {
            prop_assert!(d.scheduled_bytes <= d.capacity_bytes - d.reserved_bytes);
        }
    }
    prop_assert_eq!(snap.vm_count(), bound.len());
    // Required anti-affinity holds between every pair of bound VMs.
    for (a, ra) in bound {
        let na = snap.node(snap.vm_node(a).unwrap()).unwrap().spec();
        for term in &ra.anti_affinity.required {
            for (b, rb) in bound {
                if a == b || !sel_matches(&term.selector, &rb.labels) {
                    continue;
                }
                let nb = snap.node(snap.vm_node(b).unwrap()).unwrap().spec();
                let (da, db) = (label(na, &term.topology_key), label(nb, &term.topology_key));
                prop_assert!(
                    da.is_none() || da != db,
                    "{a} on {} and {b} on {} violate anti-affinity {:?}",
                    na.name,
                    nb.name,
                    term.topology_key
                );
            }
        }
    }
    Ok(())
}

/// Checks a fresh placement against the request's required constraints, on
/// the snapshot *before* the placement.
fn check_placement(
    before: &ClusterSnapshot,
    bound: &BTreeMap<String, Request>,
    r: &Request,
    p: &Placement,
) -> Result<(), TestCaseError> {
    let node = before.node(&p.node).unwrap().spec().clone();
    prop_assert!(!node.unschedulable);
    for (k, v) in &r.node_selector {
        prop_assert_eq!(node.labels.get(k), Some(v));
    }
    for t in &node.taints {
        if t.effect != TaintEffect::PreferNoSchedule {
            prop_assert!(
                r.tolerations
                    .iter()
                    .any(|tol| tol.key == t.key && tol.value == t.value)
            );
        }
    }
    let evicted = |name: &str| p.victims.iter().any(|v| v == name);
    for v in &p.victims {
        prop_assert!(
            bound[v].priority < r.priority,
            "victim {v} not lower priority"
        );
        prop_assert_eq!(
            before.vm_node(v),
            Some(p.node.as_str()),
            "victims come from the chosen node"
        );
    }
    // Required affinity: some VM matching the term in the domain, unless no
    // VM matches anywhere and the VM matches itself.
    for term in &r.affinity.required {
        let dom = label(&node, &term.topology_key);
        prop_assert!(dom.is_some());
        let mut any = false;
        let mut here = false;
        for (b, rb) in bound {
            if evicted(b) || !sel_matches(&term.selector, &rb.labels) {
                continue;
            }
            any = true;
            let nb = before.node(before.vm_node(b).unwrap()).unwrap().spec();
            here |= label(nb, &term.topology_key) == dom;
        }
        prop_assert!(here || (!any && sel_matches(&term.selector, &r.labels)));
    }
    // Topology spread (no node selector in these requests except disk=ssd).
    for c in &r.topology_spread {
        let eligible = |n: &Node| {
            r.node_selector
                .iter()
                .all(|(k, v)| n.labels.get(k) == Some(v))
        };
        let mut counts: BTreeMap<&str, u32> = BTreeMap::new();
        for n in before.nodes() {
            if eligible(n.spec())
                && let Some(z) = label(n.spec(), &c.topology_key)
            {
                counts.entry(z).or_insert(0);
            }
        }
        for (b, rb) in bound {
            let nb = before.node(before.vm_node(b).unwrap()).unwrap().spec();
            if evicted(b) || !eligible(nb) || !sel_matches(&c.selector, &rb.labels) {
                continue;
            }
            if let Some(z) = label(nb, &c.topology_key) {
                *counts.entry(z).or_insert(0) += 1;
            }
        }
        let min = counts.values().copied().min().unwrap_or(0);
        let z = label(&node, &c.topology_key).unwrap();
        prop_assert!(
            counts[z] + 1 - min <= c.max_skew,
            "spread skew violated in {z}: {counts:?}"
        );
    }
    Ok(())
}

/// A brute-force "does anything fit" for requests without inter-VM terms of
/// their own (bound VMs' anti-affinity still counts).
fn something_fits(snap: &ClusterSnapshot, bound: &BTreeMap<String, Request>, r: &Request) -> bool {
    let repelled = |s: &Node| {
        bound.iter().any(|(b, rb)| {
            let nb = snap.node(snap.vm_node(b).unwrap()).unwrap().spec();
            rb.anti_affinity.required.iter().any(|t| {
                sel_matches(&t.selector, &r.labels)
                    && label(s, &t.topology_key).is_some()
                    && label(s, &t.topology_key) == label(nb, &t.topology_key)
            })
        })
    };
    snap.nodes().any(|n| {
        let s = n.spec();
        !repelled(s)
            && !s.unschedulable
            && n.vm_count() < n.max_vms()
            && n.requested().cpu_millis + r.resources.cpu_millis <= n.allocatable().cpu_millis
            && n.requested().memory_bytes + r.resources.memory_bytes <= n.allocatable().memory_bytes
            && r.node_selector
                .iter()
                .all(|(k, v)| s.labels.get(k) == Some(v))
            && s.taints.iter().all(|t| {
                t.effect == TaintEffect::PreferNoSchedule
                    || r.tolerations
                        .iter()
                        .any(|tol| tol.key == t.key && tol.value == t.value)
            })
    })
}

fn run_sequence(
    nodes: &[Node],
    reqs: &[Request],
    pct: Option<u32>,
) -> Result<Vec<String>, TestCaseError> {
    let mut snap = ClusterSnapshot::from_nodes(nodes.iter().cloned()).unwrap();
    let cfg = sheaf_sched::SchedulerConfig {
        profiles: vec![sheaf_sched::ProfileConfig {
            percentage_of_nodes_to_score: pct,
            ..Default::default()
        }],
        ..Default::default()
    };
    let mut sched = Scheduler::try_from(cfg).unwrap();
    let mut bound: BTreeMap<String, Request> = BTreeMap::new();
    let mut log = Vec::new();
    for r in reqs {
        let before = snap.clone();
        match sched.schedule(&mut snap, r) {
            Ok(p) => {
                check_placement(&before, &bound, r, &p)?;
                for v in &p.victims {
                    bound.remove(v);
                }
                bound.insert(r.name.clone(), r.clone());
                log.push(format!("{} -> {} {:?}", r.name, p.node, p.victims));
            }
            Err(SchedError::Unschedulable(u)) => {
                let simple = r.affinity.is_empty()
                    && r.anti_affinity.is_empty()
                    && r.topology_spread.is_empty();
                if simple && u.preemption.is_some() {
                    prop_assert!(
                        !something_fits(&before, &bound, r),
                        "{} unschedulable but a node fits: {u}",
                        r.name
                    );
                }
                prop_assert_eq!(snap.vm_count(), before.vm_count());
                log.push(format!("{}: {u}", r.name));
            }
            Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
        }
        check_invariants(&snap, &bound)?;
    }
    Ok(log)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn placements_respect_constraints_and_are_deterministic(
        node_specs in prop::collection::vec(node_strategy(), 1..12),
        req_specs in prop::collection::vec(req_strategy(), 1..40),
        sample in any::<bool>(),
    ) {
        let nodes = build_nodes(&node_specs);
        let reqs: Vec<Request> = req_specs.iter().enumerate().map(|(i, s)| build_req(i, s)).collect();
        let pct = if sample { Some(1) } else { None };
        let a = run_sequence(&nodes, &reqs, pct)?;
        let b = run_sequence(&nodes, &reqs, pct)?;
        prop_assert_eq!(a, b);
    }

    #[test]
    fn replicas_are_distinct_and_fit(
        node_specs in prop::collection::vec(node_strategy(), 1..10),
        vols in prop::collection::vec((1u64..80, 1u32..5, any::<bool>(), 0usize..3), 1..12),
    ) {
        let nodes = build_nodes(&node_specs);
        let mut snap = ClusterSnapshot::from_nodes(nodes).unwrap();
        let sched = Scheduler::new();
        for (i, &(size, n, hard, existing)) in vols.iter().enumerate() {
            let existing: Vec<ReplicaLocation> = snap
                .nodes()
                .take(existing)
                .map(|n| ReplicaLocation::healthy(n.name()))
                .collect();
            let req = ReplicaRequest {
                volume: format!("v{i}"),
                size_bytes: size * GIB,
                replicas: n,
                existing: existing.clone(),
                zone_anti_affinity: if hard { ZoneAntiAffinity::Hard } else { ZoneAntiAffinity::Soft },
                ..Default::default()
            };
            let before = snap.vm_count();
            match sched.place_replicas(&snap, &req) {
                Ok(p) => {
                    let needed = (n as usize).saturating_sub(existing.len());
                    prop_assert_eq!(p.targets.len(), needed);
                    let mut seen: Vec<&str> = existing.iter().map(|l| l.node.as_str()).collect();
                    for t in &p.targets {
                        prop_assert!(!seen.contains(&t.node.as_str()), "replica node reused: {}", t.node);
                        seen.push(&t.node);
                        prop_assert!(!snap.node(&t.node).unwrap().spec().unschedulable);
                    }
                    if hard {
                        let mut zones: Vec<&str> = existing
                            .iter()
                            .filter_map(|l| snap.node(&l.node).unwrap().spec().zone.as_deref())
                            .collect();
                        for t in &p.targets {
                            if let Some(z) = &t.zone {
                                prop_assert!(!zones.contains(&z.as_str()), "zone {z} reused");
                                zones.push(z);
                            }
                        }
                    }
                    snap.bind_replicas(&p).unwrap();
                }
                Err(e) => prop_assert!(e.unschedulable().is_some(), "{e}"),
            }
            prop_assert_eq!(snap.vm_count(), before);
            check_invariants(&snap, &BTreeMap::new())?;
        }
    }

    #[test]
    fn gangs_are_all_or_nothing(
        node_specs in prop::collection::vec(node_strategy(), 1..8),
        gangs in prop::collection::vec((req_strategy(), 1usize..6), 1..8),
    ) {
        let nodes = build_nodes(&node_specs);
        let mut snap = ClusterSnapshot::from_nodes(nodes).unwrap();
        let mut sched = Scheduler::new();
        let mut bound = BTreeMap::new();
        for (g, (spec, size)) in gangs.iter().enumerate() {
            let reqs: Vec<Request> = (0..*size).map(|i| build_req(g * 100 + i, spec)).collect();
            let before = snap.vm_count();
            match sched.place_gang(&mut snap, &reqs) {
                Ok(ps) => {
                    prop_assert_eq!(ps.len(), reqs.len());
                    prop_assert_eq!(snap.vm_count(), before + reqs.len());
                    for r in reqs {
                        bound.insert(r.name.clone(), r);
                    }
                }
                Err(_) => prop_assert_eq!(snap.vm_count(), before),
            }
            check_invariants(&snap, &bound)?;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn large_clusters_use_sparse_domain_counts(
        node_specs in prop::collection::vec(node_strategy(), 260..300),
        req_specs in prop::collection::vec(req_strategy(), 1..60),
    ) {
        // More than 256 hostnames: per-node terms keep sparse counts.
        let nodes = build_nodes(&node_specs);
        let reqs: Vec<Request> = req_specs
            .iter()
            .enumerate()
            .map(|(i, s)| build_req(i, &ReqSpec { anti: 1 + (i % 2) as u8, ..s.clone() }))
            .collect();
        run_sequence(&nodes, &reqs, None)?;
    }
}
