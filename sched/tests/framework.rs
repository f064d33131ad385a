// SPDX-License-Identifier: Apache-2.0
//! The plugin framework from the outside: custom plugins at every extension
//! point, reserve/unreserve pairing, permit and bind failures, profiles,
//! sampling, and JSON round trips of the public types.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use sheaf_sched::framework::{
    BindPlugin, Ctx, CycleState, FilterPlugin, PermitPlugin, PreFilterPlugin, PreFilterResult,
    PreScorePlugin, PreScoreResult, ReservePlugin, ScorePlugin,
};
use sheaf_sched::plugins::ResourceFitArgs;
use sheaf_sched::{
    ClusterSnapshot, DEFAULT_PROFILE, Node, NodeInfo, Placement, Plugin, Profile, Reason,
    ReplicaRequest, Request, SchedError, Scheduler, SchedulerConfig,
};

const GIB: u64 = 1 << 30;

fn snap(n: usize) -> ClusterSnapshot {
    ClusterSnapshot::from_nodes((0..n).map(|i| Node::new(format!("n{i}"), 4_000, 8 * GIB))).unwrap()
}

/// Rejects nodes with an odd index; prefers high indexes; records reserve,
/// unreserve and bind; can be told to deny at permit or fail at bind.
#[derive(Debug, Default)]
struct Probe {
    reserved: AtomicI64,
    binds: AtomicU32,
    deny_permit: Mutex<bool>,
    fail_bind: Mutex<bool>,
}

#[derive(Clone)]
struct ProbeState(u32);

fn index(node: &NodeInfo) -> u32 {
    node.name()[1..].parse().unwrap()
}

impl Plugin for Probe {
    fn name(&self) -> &str {
        "Probe"
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
    fn as_reserve(&self) -> Option<&dyn ReservePlugin> {
        Some(self)
    }
    fn as_permit(&self) -> Option<&dyn PermitPlugin> {
        Some(self)
    }
    fn as_bind(&self) -> Option<&dyn BindPlugin> {
        Some(self)
    }
}

impl PreFilterPlugin for Probe {
    fn pre_filter(&self, cx: &Ctx<'_>, state: &mut CycleState) -> Result<PreFilterResult, Reason> {
        if cx.request.labels.contains_key("reject") {
            return Err(Reason::custom("rejected by Probe", false));
        }
        state.write(ProbeState(2));
        Ok(PreFilterResult::Continue)
    }
}

impl FilterPlugin for Probe {
    fn filter(&self, _: &Ctx<'_>, state: &CycleState, node: &NodeInfo) -> Result<(), Reason> {
        let m = state.read::<ProbeState>().unwrap().0;
        if index(node) % m == 1 {
            Err(Reason::custom("node(s) had an odd index", false))
        } else {
            Ok(())
        }
    }
}

impl PreScorePlugin for Probe {
    fn pre_score(&self, _: &Ctx<'_>, _: &mut CycleState, feasible: &[u32]) -> PreScoreResult {
        assert!(!feasible.is_empty());
        PreScoreResult::Continue
    }
}

impl ScorePlugin for Probe {
    fn score(&self, _: &Ctx<'_>, _: &CycleState, node: &NodeInfo) -> i64 {
        i64::from(index(node))
    }
    fn normalize(&self, _: &Ctx<'_>, _: &CycleState, scores: &mut [i64]) {
        sheaf_sched::framework::default_normalize(100, false, scores);
    }
}

impl ReservePlugin for Probe {
    fn reserve(&self, _: &Ctx<'_>, _: &mut CycleState, _: &NodeInfo) -> Result<(), String> {
        self.reserved.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn unreserve(&self, _: &Ctx<'_>, _: &mut CycleState, _: &NodeInfo) {
        self.reserved.fetch_sub(1, Ordering::SeqCst);
    }
}

impl PermitPlugin for Probe {
    fn permit(&self, _: &Ctx<'_>, _: &CycleState, _: &NodeInfo) -> Result<(), String> {
        if *self.deny_permit.lock().unwrap() {
            Err("not now".into())
        } else {
            Ok(())
        }
    }
}

impl BindPlugin for Probe {
    fn bind(&self, _: &Ctx<'_>, _: &CycleState, _: &NodeInfo) -> Result<(), String> {
        if *self.fail_bind.lock().unwrap() {
            return Err("store unavailable".into());
        }
        self.binds.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn probe_scheduler(probe: &Arc<Probe>, weight: i64) -> Scheduler {
    let p = Profile::with_defaults(DEFAULT_PROFILE, ResourceFitArgs::default())
        .with_plugin(probe.clone(), weight)
        .percentage_of_nodes_to_score(Some(100));
    Scheduler::with_profiles(vec![p]).unwrap()
}

#[test]
fn custom_plugin_at_every_point() {
    let probe = Arc::new(Probe::default());
    let mut sched = probe_scheduler(&probe, 100);
    let mut s = snap(6);
    let p = sched
        .schedule(&mut s, &Request::new("a", 1_000, GIB))
        .unwrap();
    // Even index only; highest index preferred by the heavy weight.
    assert_eq!(p.node, "n4");
    assert_eq!(p.feasible_nodes, 3);
    assert_eq!(p.evaluated_nodes, 6);
    assert_eq!(probe.binds.load(Ordering::SeqCst), 1);
    assert_eq!(probe.reserved.load(Ordering::SeqCst), 1);

    // Pre-filter rejection: every node fails with that reason.
    let err = sched
        .place(&s, &Request::new("r", 1, 1).label("reject", "yes"))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "0/6 nodes are available: 6 rejected by Probe."
    );

    // Permit denial unreserves and leaves the snapshot alone.
    *probe.deny_permit.lock().unwrap() = true;
    let err = sched
        .schedule(&mut s, &Request::new("b", 1_000, GIB))
        .unwrap_err();
    assert!(
        matches!(
            err,
            SchedError::Rejected {
                point: "permit",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(probe.reserved.load(Ordering::SeqCst), 1);
    assert_eq!(s.vm_count(), 1);
    *probe.deny_permit.lock().unwrap() = false;

    // Bind failure unreserves and leaves the snapshot alone.
    *probe.fail_bind.lock().unwrap() = true;
    let err = sched
        .schedule(&mut s, &Request::new("c", 1_000, GIB))
        .unwrap_err();
    assert!(
        matches!(err, SchedError::Rejected { point: "bind", .. }),
        "{err}"
    );
    assert_eq!(probe.reserved.load(Ordering::SeqCst), 1);
    assert_eq!(s.vm_count(), 1);
    *probe.fail_bind.lock().unwrap() = false;

    // Gang: three fit (even nodes), four do not; failure unreserves all.
    let gang: Vec<Request> = (0..3)
        .map(|i| Request::new(format!("g{i}"), 3_500, GIB))
        .collect();
    let err = sched.place_gang(&mut s, &gang).unwrap_err();
    // n4 holds "a" (1 CPU), so only two 3.5-CPU members fit.
    assert!(matches!(err, SchedError::Gang { index: 2, .. }), "{err}");
    assert_eq!(probe.reserved.load(Ordering::SeqCst), 1);
    assert_eq!(s.vm_count(), 1);
    // A failing bind in a gang unreserves every member exactly once.
    *probe.fail_bind.lock().unwrap() = true;
    let err = sched.place_gang(&mut s, &gang[..2]).unwrap_err();
    assert!(matches!(err, SchedError::Gang { index: 0, .. }), "{err}");
    assert_eq!(probe.reserved.load(Ordering::SeqCst), 1);
    assert_eq!(s.vm_count(), 1);
    *probe.fail_bind.lock().unwrap() = false;
    let ok = sched.place_gang(&mut s, &gang[..2]).unwrap();
    assert_eq!(ok.len(), 2);
    assert_eq!(probe.binds.load(Ordering::SeqCst), 3);
    assert_eq!(s.vm_count(), 3);
}

#[test]
fn zero_weight_and_disabled_plugins() {
    let probe = Arc::new(Probe::default());
    // Weight 0: the probe filters but does not score; least-allocated picks
    // the first empty even node in scan order.
    let mut sched = probe_scheduler(&probe, 0);
    let s = snap(6);
    let p = sched.place(&s, &Request::new("a", 1_000, GIB)).unwrap();
    assert_eq!(p.node, "n0");

    let profile = Profile::with_defaults(DEFAULT_PROFILE, ResourceFitArgs::default())
        .without_plugin("NodeResourcesFit");
    let mut sched = Scheduler::with_profiles(vec![profile]).unwrap();
    // Without resource fit anything "fits".
    assert!(
        sched
            .place(&s, &Request::new("huge", 1 << 40, 1 << 60))
            .is_ok()
    );
}

#[test]
fn profiles_are_selected_by_name() {
    let a = Profile::with_defaults("spread", ResourceFitArgs::default());
    let b = Profile::with_defaults(
        "pack",
        ResourceFitArgs {
            strategy: sheaf_sched::plugins::ScoringStrategy::MostAllocated,
            ..ResourceFitArgs::default()
        },
    );
    let mut sched = Scheduler::with_profiles(vec![a, b]).unwrap();
    let mut s = snap(3);
    s.bind(&Request::new("x", 2_000, GIB), "n1").unwrap();
    let mut r = Request::new("y", 1_000, GIB);
    assert_ne!(sched.place(&s, &r).unwrap().node, "n1");
    r.profile = Some("pack".into());
    assert_eq!(sched.place(&s, &r).unwrap().node, "n1");
    r.profile = Some("nope".into());
    assert!(matches!(
        sched.place(&s, &r),
        Err(SchedError::UnknownProfile { .. })
    ));
    assert!(Scheduler::with_profiles(vec![]).is_err());
    assert!(Scheduler::with_profiles(vec![Profile::new("a"), Profile::new("a")]).is_err());
}

#[test]
fn sampling_rotates_through_nodes() {
    // 1,000 empty nodes; 1% -> at least 100 feasible nodes are looked at.
    let p = Profile::with_defaults(DEFAULT_PROFILE, ResourceFitArgs::default())
        .percentage_of_nodes_to_score(Some(1));
    let mut sched = Scheduler::with_profiles(vec![p]).unwrap();
    let s =
        ClusterSnapshot::from_nodes((0..1_000).map(|i| Node::new(format!("n{i}"), 4_000, 8 * GIB)))
            .unwrap();
    let r = Request::new("a", 1_000, GIB);
    let first = sched.place(&s, &r).unwrap();
    assert_eq!(first.evaluated_nodes, 100);
    assert_eq!(first.node, "n0");
    // The next cycle starts where this one stopped.
    assert_eq!(sched.place(&s, &r).unwrap().node, "n100");
    // Adaptive default at 1,000 nodes: 50 - 8 = 42%.
    let mut sched = Scheduler::new();
    assert_eq!(sched.place(&s, &r).unwrap().evaluated_nodes, 420);
}

#[test]
fn json_round_trips() {
    let req: Request = serde_json::from_str(
        r#"{"name": "vm", "resources": {"cpu_millis": 500, "memory_bytes": 1073741824},
            "labels": {"app": "web"}, "priority": 7,
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "anti_affinity": {"required": [{"selector": {"match_labels": {"app": "web"}},
                                             "topology_key": "kubernetes.io/hostname"}]}}"#,
    )
    .unwrap();
    assert_eq!(req.priority, 7);
    assert_eq!(req.anti_affinity.required.len(), 1);
    let back: Request = serde_json::from_str(&serde_json::to_string(&req).unwrap()).unwrap();
    assert_eq!(back, req);

    let node: Node = serde_json::from_str(
        r#"{"name": "n1", "zone": "a", "capacity": {"cpu_millis": 4000, "memory_bytes": 8589934592},
            "taints": [{"key": "gpu", "value": "true", "effect": "NoSchedule"}],
            "disks": [{"name": "d0", "capacity_bytes": 1000}]}"#,
    )
    .unwrap();
    assert_eq!(node.max_vms, 110);
    assert!(node.disks[0].schedulable);

    let cfg: SchedulerConfig = serde_json::from_str(
        r#"{"profiles": [{"name": "default-scheduler", "percentage_of_nodes_to_score": 100,
            "resource_fit": {"strategy": "MostAllocated", "cpu_overcommit_percent": 400},
            "disabled": ["BalancedAllocation"], "weights": {"StorageLocality": 5}}],
            "replicas": {"over_provisioning_percent": 200}}"#,
    )
    .unwrap();
    let mut sched = Scheduler::try_from(cfg).unwrap();
    let mut s = ClusterSnapshot::from_nodes([node]).unwrap();
    let p: Placement = sched
        .schedule(&mut s, &req)
        .unwrap_or_else(|e| panic!("{e}"));
    let json = serde_json::to_string(&p).unwrap();
    assert!(json.contains(r#""node":"n1""#), "{json}");

    // Unschedulable serializes too (for the bindings).
    let mut big = req.clone();
    big.name = "big".into();
    big.resources.cpu_millis = 1 << 40;
    let err = sched.place(&s, &big).unwrap_err();
    let u = err.unschedulable().unwrap();
    let v: serde_json::Value = serde_json::to_value(u).unwrap();
    assert_eq!(v["total_nodes"], 1);
    assert_eq!(v["reasons"][0]["reason"], "Insufficient cpu");

    let bad: SchedulerConfig =
        serde_json::from_str(r#"{"profiles": [{"name": "x", "percentage_of_nodes_to_score": 0}]}"#)
            .unwrap();
    assert!(Scheduler::try_from(bad).is_err());

    let rr: ReplicaRequest =
        serde_json::from_str(r#"{"volume": "v", "size_bytes": 10, "replicas": 3}"#).unwrap();
    assert_eq!(rr.replicas, 3);
}

/// Spreads by used CPU (raw score = free CPU after placing, in percent of
/// allocatable); `cached` declares it resource-only so the scheduler caches
/// its raw scores per node.
#[derive(Debug)]
struct Pack {
    cached: bool,
}

impl Plugin for Pack {
    fn name(&self) -> &str {
        "Pack"
    }
    fn as_score(&self) -> Option<&dyn ScorePlugin> {
        Some(self)
    }
}

impl ScorePlugin for Pack {
    fn score(&self, cx: &Ctx<'_>, _: &CycleState, node: &NodeInfo) -> i64 {
        let used = node.requested().cpu_millis + cx.request.resources.cpu_millis;
        let cap = node.allocatable().cpu_millis.max(1);
        100 - i64::try_from(used.min(cap) * 100 / cap).unwrap()
    }
    fn resources_only(&self) -> bool {
        self.cached
    }
}

#[test]
fn cached_resource_scores_follow_node_changes() {
    // Same sequence of binds, unbinds, node updates and request sizes with
    // and without the raw-score cache: every placement must be identical.
    let run = |cached: bool| {
        let profile = Profile::new("p")
            .with_plugin(
                Arc::new(sheaf_sched::plugins::NodeResourcesFit::default()),
                0,
            )
            .with_plugin(Arc::new(Pack { cached }), 1)
            .percentage_of_nodes_to_score(Some(100));
        let mut sched = Scheduler::with_profiles(vec![profile]).unwrap();
        let mut s = snap(8);
        let mut out = Vec::new();
        for i in 0..60u64 {
            let cpu = [100, 100, 300, 100, 700][(i % 5) as usize];
            let r = Request::new(format!("v{i}"), cpu, GIB / 4);
            out.push(sched.schedule(&mut s, &r).map(|p| p.node).ok());
            if i % 7 == 3 {
                s.unbind(&format!("v{}", i - 2)).unwrap();
            }
            if i % 11 == 5 {
                let n = format!("n{}", i % 8);
                s.update_node(Node::new(n, 4_000 + 500 * i, 8 * GIB))
                    .unwrap();
            }
            if i == 30 {
                s.remove_node("n2").unwrap();
                s.add_node(Node::new("n9", 16_000, 8 * GIB)).unwrap();
            }
        }
        out
    };
    let (plain, cached) = (run(false), run(true));
    assert_eq!(plain, cached);
    assert!(plain.iter().flatten().count() > 50);
}
