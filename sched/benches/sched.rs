// SPDX-License-Identifier: Apache-2.0
//! Criterion micro-benches of single decisions on a 5,000-node snapshot.
//! `sched_perf` (examples/) measures whole workloads; these isolate the cost
//! of one `place`, one preemption, one bind/unbind and one replica
//! placement. Run with `cargo bench -p sheaf-sched`.
#![allow(clippy::unwrap_used)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use sheaf_sched::{
    ClusterSnapshot, HOSTNAME_LABEL, Node, ReplicaRequest, Request, Scheduler, TaintEffect,
    WhenUnsatisfiable, ZONE_LABEL,
};

const GIB: u64 = 1 << 30;

fn cluster(nodes: usize) -> ClusterSnapshot {
    ClusterSnapshot::from_nodes((0..nodes).map(|i| {
        let mut n = Node::new(format!("node-{i}"), 16_000, 64 * GIB)
            .zone(format!("zone-{}", i % 10))
            .disk("d0", 1024 * GIB);
        if i % 7 == 3 {
            n = n.taint("dedicated", "batch", TaintEffect::NoSchedule);
        }
        n
    }))
    .unwrap()
}

fn filled(nodes: usize, vms: usize) -> (ClusterSnapshot, Scheduler) {
    let mut snap = cluster(nodes);
    let mut sched = Scheduler::new();
    for i in 0..vms {
        let r = Request::new(format!("init-{i}"), 100, GIB / 2)
            .label("app", format!("app-{}", i % 100));
        sched.schedule(&mut snap, &r).unwrap();
    }
    (snap, sched)
}

fn benches(c: &mut Criterion) {
    let (snap, mut sched) = filled(5_000, 10_000);
    let mut g = c.benchmark_group("place_5000_nodes");
    g.sample_size(30).measurement_time(Duration::from_secs(3));
    let basic = Request::new("vm", 100, GIB / 2);
    g.bench_function("basic", |b| {
        b.iter(|| sched.place(black_box(&snap), &basic).unwrap())
    });
    let anti = Request::new("vm", 100, GIB / 2)
        .label("app", "app-7")
        .anti_affinity("app", "app-7", HOSTNAME_LABEL);
    g.bench_function("anti_affinity", |b| {
        b.iter(|| sched.place(black_box(&snap), &anti).unwrap())
    });
    let spread = Request::new("vm", 100, GIB / 2)
        .label("app", "app-7")
        .spread(
            ZONE_LABEL,
            1,
            WhenUnsatisfiable::DoNotSchedule,
            "app",
            "app-7",
        );
    g.bench_function("topology_spread", |b| {
        b.iter(|| sched.place(black_box(&snap), &spread).unwrap())
    });
    let unsched = Request::new("vm", 64_000, GIB);
    g.bench_function("unschedulable", |b| {
        b.iter(|| sched.place(black_box(&snap), &unsched).unwrap_err())
    });
    let replicas = ReplicaRequest {
        volume: "v".into(),
        size_bytes: 10 * GIB,
        replicas: 3,
        ..Default::default()
    };
    g.bench_function("replicas", |b| {
        b.iter(|| sched.place_replicas(black_box(&snap), &replicas).unwrap())
    });
    g.finish();

    let mut g = c.benchmark_group("snapshot");
    g.sample_size(30).measurement_time(Duration::from_secs(3));
    let mut s2 = snap.clone();
    let r = Request::new("x", 100, GIB)
        .label("app", "web")
        .anti_affinity("app", "web", HOSTNAME_LABEL);
    g.bench_function("bind_unbind", |b| {
        b.iter(|| {
            s2.bind(&r, "node-42").unwrap();
            s2.unbind("x").unwrap();
        })
    });
    g.finish();

    // Preemption: 500 full nodes of low-priority VMs.
    let mut snap =
        ClusterSnapshot::from_nodes((0..500).map(|i| Node::new(format!("n{i}"), 4_000, 32 * GIB)))
            .unwrap();
    let mut sched = Scheduler::new();
    for i in 0..2_000 {
        sched
            .schedule(
                &mut snap,
                &Request::new(format!("low-{i}"), 1_000, GIB).priority(1),
            )
            .unwrap();
    }
    let high = Request::new("high", 1_000, GIB).priority(10);
    let mut g = c.benchmark_group("preempt_500_nodes");
    g.sample_size(20).measurement_time(Duration::from_secs(3));
    g.bench_function("one_victim", |b| {
        b.iter(|| sched.place(black_box(&snap), &high).unwrap())
    });
    g.finish();
}

criterion_group!(sched_benches, benches);
criterion_main!(sched_benches);
