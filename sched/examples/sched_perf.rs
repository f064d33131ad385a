// SPDX-License-Identifier: Apache-2.0
//! Throughput and latency of sheaf-sched, modelled on kube-scheduler's
//! `scheduler_perf` (test/integration/scheduler_perf).
//!
//! ```text
//! cargo run --release -p sheaf-sched --example sched_perf            # all workloads
//! cargo run --release -p sheaf-sched --example sched_perf -- basic-10k mixed
//! ```
//!
//! Workloads (each builds a fresh cluster, then measures `Scheduler::schedule`
//! = place + bind in the snapshot, one core, one thread):
//!
//! - `basic-10k`, `basic-50k`: SchedulingBasic. 5,000 nodes (4 CPU, 32 GiB,
//!   110 VMs), 1,000 init VMs, then 10,000 / 50,000 measured VMs of 100m CPU
//!   and 500 MiB with the default plugins.
//! - `mixed`: 5,000 nodes (16 CPU) in 10 zones, 1/7 tainted, 1/5 labelled ssd;
//!   10,000 VMs, a quarter each with required anti-affinity (groups of 20,
//!   per node), node selector, toleration + preferred anti-affinity by zone,
//!   and zone topology spread (max skew 1).
//! - `preempt`: 5,000 full nodes (4 x 1-CPU low-priority VMs each), then
//!   5,000 high-priority 1-CPU VMs that each must preempt one.
//! - `c1m`: 1,000,000 VMs (250m, 1 GiB) onto 5,000 nodes (64 CPU, 256 GiB,
//!   250 VMs) in 10 zones (Nomad's C1M shape).
//!
//! `decisions/s` divides by the thread's CPU time (from
//! `/proc/thread-self/schedstat`), and the p50/p99/max decision latencies
//! are per-decision thread CPU time (`CLOCK_THREAD_CPUTIME_ID`), so they are
//! one-core figures even on a shared machine. `wall` and `p99 wall` are
//! wall-clock and include time the thread waited for a CPU.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use sheaf_sched::{
    ClusterSnapshot, HOSTNAME_LABEL, Node, Request, Scheduler, TaintEffect, WhenUnsatisfiable,
    ZONE_LABEL,
};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const NODES: usize = 5_000;

/// CPU time this thread has run (Linux `/proc/thread-self/schedstat`), so
/// results stay meaningful on a shared, loaded machine.
fn cpu_time() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map_or(Duration::ZERO, Duration::from_nanos)
}

/// CPU time of this thread, cheaply (one `clock_gettime`).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant
    // the kernel supports; no other memory is touched.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

struct Stats {
    name: &'static str,
    placed: usize,
    failed: usize,
    wall: Duration,
    cpu: Duration,
    /// Per-decision CPU time (ns).
    lat: Vec<u32>,
    /// Per-decision wall time (ns).
    wall_lat: Vec<u32>,
    extra: Vec<String>,
    /// FNV-1a over the chosen nodes and victims, in order: optimizations
    /// must not change it (printed to stderr).
    digest: u64,
}

impl Stats {
    fn print(&mut self) {
        self.lat.sort_unstable();
        self.wall_lat.sort_unstable();
        let pct = |v: &[u32], p: f64| {
            let i = ((v.len() as f64 - 1.0) * p) as usize;
            Duration::from_nanos(u64::from(v.get(i).copied().unwrap_or(0)))
        };
        let n = (self.placed + self.failed) as f64;
        println!(
            "| {:<10} | {:>9} | {:>6} | {:>7.2} s | {:>7.2} s | {:>11.0} | {:>9.1?} | {:>9.1?} | {:>9.1?} | {:>9.1?} |",
            self.name,
            self.placed,
            self.failed,
            self.wall.as_secs_f64(),
            self.cpu.as_secs_f64(),
            n / self.cpu.as_secs_f64().max(1e-9),
            pct(&self.lat, 0.50),
            pct(&self.lat, 0.99),
            pct(&self.lat, 1.0),
            pct(&self.wall_lat, 0.99),
        );
        for e in &self.extra {
            println!("{e}");
        }
        eprintln!("digest {} {:016x}", self.name, self.digest);
    }
}

fn fnv(h: &mut u64, bytes: &[u8]) {
    for &b in bytes.iter().chain(b"/") {
        *h = (*h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
}

fn measure(
    name: &'static str,
    sched: &mut Scheduler,
    snap: &mut ClusterSnapshot,
    reqs: impl Iterator<Item = Request>,
    latencies: bool,
) -> Stats {
    let mut s = Stats {
        name,
        placed: 0,
        failed: 0,
        wall: Duration::ZERO,
        cpu: Duration::ZERO,
        lat: Vec::new(),
        wall_lat: Vec::new(),
        extra: Vec::new(),
        digest: 0xcbf2_9ce4_8422_2325,
    };
    let reqs: Vec<Request> = reqs.collect();
    if latencies {
        s.lat.reserve(reqs.len());
        s.wall_lat.reserve(reqs.len());
    }
    let c0 = cpu_time();
    let t0 = Instant::now();
    for r in &reqs {
        let t = latencies.then(|| (Instant::now(), thread_cpu_ns()));
        match sched.schedule(snap, r) {
            Ok(p) => {
                s.placed += 1;
                fnv(&mut s.digest, p.node.as_bytes());
                for v in &p.victims {
                    fnv(&mut s.digest, v.as_bytes());
                }
            }
            Err(_) => {
                s.failed += 1;
                fnv(&mut s.digest, b"-");
            }
        }
        if let Some((t, c)) = t {
            s.lat
                .push((thread_cpu_ns() - c).min(u64::from(u32::MAX)) as u32);
            s.wall_lat
                .push(t.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32);
        }
    }
    s.wall = t0.elapsed();
    s.cpu = cpu_time().saturating_sub(c0);
    s
}

fn basic_cluster() -> ClusterSnapshot {
    ClusterSnapshot::from_nodes((0..NODES).map(|i| {
        Node::new(format!("node-{i}"), 4_000, 32 * GIB)
            .zone(format!("zone-{}", i % 10))
            .max_vms(110)
    }))
    .unwrap()
}

fn basic(n: usize, name: &'static str) -> Stats {
    let mut snap = basic_cluster();
    let mut sched = Scheduler::new();
    let vm = |i: usize| Request::new(format!("vm-{i}"), 100, 500 * MIB);
    measure("init", &mut sched, &mut snap, (0..1_000).map(vm), false);
    measure(
        name,
        &mut sched,
        &mut snap,
        (1_000..1_000 + n).map(vm),
        true,
    )
}

fn mixed() -> Stats {
    let mut snap = ClusterSnapshot::from_nodes((0..NODES).map(|i| {
        let mut n = Node::new(format!("node-{i}"), 16_000, 64 * GIB)
            .zone(format!("zone-{}", i % 10))
            .max_vms(110);
        if i % 7 == 3 {
            n = n.taint("dedicated", "batch", TaintEffect::NoSchedule);
        }
        if i % 5 == 1 {
            n = n.label("disk", "ssd");
        }
        n
    }))
    .unwrap();
    let mut sched = Scheduler::new();
    let vm = |i: usize| {
        let r = Request::new(format!("vm-{i}"), 500, GIB);
        match i % 4 {
            0 => {
                let app = format!("svc-{}", i / 80);
                r.label("app", app.clone())
                    .anti_affinity("app", app, HOSTNAME_LABEL)
            }
            1 => r.node_selector("disk", "ssd"),
            2 => {
                let mut r = r
                    .tolerate("dedicated", "batch")
                    .label("tier", format!("batch-{}", i % 50));
                r.anti_affinity
                    .preferred
                    .push(sheaf_sched::WeightedVmAffinityTerm {
                        weight: 50,
                        term: sheaf_sched::VmAffinityTerm {
                            selector: sheaf_sched::LabelSelector::eq(
                                "tier",
                                format!("batch-{}", i % 50),
                            ),
                            topology_key: ZONE_LABEL.into(),
                        },
                    });
                r
            }
            _ => {
                let app = format!("spread-{}", i % 20);
                r.label("app", app.clone()).spread(
                    ZONE_LABEL,
                    1,
                    WhenUnsatisfiable::DoNotSchedule,
                    "app",
                    app,
                )
            }
        }
    };
    let mut s = measure("mixed", &mut sched, &mut snap, (0..10_000).map(vm), true);
    // CPU time per kind of request (the i-th request is of kind i % 4).
    for (k, name) in ["anti-affinity", "selector", "toleration", "spread"]
        .iter()
        .enumerate()
    {
        let mut lat: Vec<u32> = s.lat.iter().skip(k).step_by(4).copied().collect();
        lat.sort_unstable();
        let at =
            |p: f64| Duration::from_nanos(u64::from(lat[((lat.len() - 1) as f64 * p) as usize]));
        s.extra.push(format!(
            "| ↳ {name:<13} |           |        |           |           |             | {:>9.1?} | {:>9.1?} | {:>9.1?} |           |",
            at(0.5),
            at(0.99),
            at(1.0)
        ));
    }
    s
}

fn preempt() -> Stats {
    let mut snap = ClusterSnapshot::from_nodes(
        (0..NODES).map(|i| Node::new(format!("node-{i}"), 4_000, 32 * GIB).max_vms(110)),
    )
    .unwrap();
    let mut sched = Scheduler::new();
    let low = |i: usize| Request::new(format!("low-{i}"), 1_000, GIB).priority(1);
    let init = measure(
        "init",
        &mut sched,
        &mut snap,
        (0..4 * NODES).map(low),
        false,
    );
    assert_eq!(init.failed, 0);
    let high = |i: usize| Request::new(format!("high-{i}"), 1_000, GIB).priority(100);
    measure("preempt", &mut sched, &mut snap, (0..NODES).map(high), true)
}

fn c1m() -> Stats {
    let mut snap = ClusterSnapshot::from_nodes((0..NODES).map(|i| {
        Node::new(format!("node-{i}"), 64_000, 256 * GIB)
            .zone(format!("zone-{}", i % 10))
            .max_vms(250)
    }))
    .unwrap();
    snap.reserve_vms(1_000_000);
    let mut sched = Scheduler::new();
    let vm = |i: usize| Request::new(format!("vm-{i}"), 250, GIB);
    measure("c1m", &mut sched, &mut snap, (0..1_000_000).map(vm), true)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let all = ["basic-10k", "basic-50k", "mixed", "preempt", "c1m"];
    let chosen: Vec<&str> = if args.is_empty() {
        all.to_vec()
    } else {
        args.iter().map(String::as_str).collect()
    };
    println!(
        "| workload   |    placed | failed |      wall |  CPU time | decisions/s |   p50 CPU |   p99 CPU |   max CPU |  p99 wall |"
    );
    println!(
        "|------------|-----------|--------|-----------|-----------|-------------|-----------|-----------|-----------|-----------|"
    );
    for w in chosen {
        let mut s = match w {
            "basic-10k" => basic(10_000, "basic-10k"),
            "basic-50k" => basic(50_000, "basic-50k"),
            "mixed" => mixed(),
            "preempt" => preempt(),
            "c1m" => c1m(),
            o => {
                eprintln!("unknown workload {o}; known: {all:?}");
                std::process::exit(2);
            }
        };
        s.print();
    }
}
