// SPDX-License-Identifier: Apache-2.0
//! The deterministic simulator as a test suite.
//!
//! * fault-free seeds must be perfect;
//! * the oracle must catch deliberately injected protocol bugs;
//! * the full fault run (`SHEAF_SIM_SEEDS`, default 10,000 seeds) must show
//!   no violation. It is `#[ignore]`d until the open simulator findings
//!   listed in docs/dev/STATUS.md are fixed: run it with
//!   `cargo test -p sheaf-blockrepl --test sim -- --ignored`.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use sheaf_blockrepl::proto::engine::Bugs;
use sheaf_blockrepl::sim::{SimConfig, SimReport, run};

fn run_seeds(
    seeds: std::ops::Range<u64>,
    f: impl Fn(u64) -> SimConfig + Send + Sync + 'static,
) -> Vec<SimReport> {
    let next = Arc::new(AtomicU64::new(seeds.start));
    let out = Arc::new(Mutex::new(Vec::new()));
    let f = Arc::new(f);
    let hs: Vec<_> = (0..2)
        .map(|_| {
            let (next, out, f) = (next.clone(), out.clone(), f.clone());
            let end = seeds.end;
            std::thread::spawn(move || {
                loop {
                    let s = next.fetch_add(1, Ordering::Relaxed);
                    if s >= end {
                        break;
                    }
                    let r = run(f(s));
                    out.lock().unwrap().push(r);
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let mut v = Arc::try_unwrap(out).unwrap().into_inner().unwrap();
    v.sort_by_key(|r| r.seed);
    v
}

fn summary(rs: &[SimReport]) -> String {
    let failing: Vec<u64> = rs
        .iter()
        .filter(|r| !r.violations.is_empty())
        .map(|r| r.seed)
        .collect();
    format!(
        "seeds run {}, faults {}, ops checked {}, violations {}, acked lost {}, divergent {}, failing seeds {:?}",
        rs.len(),
        rs.iter().map(|r| r.faults).sum::<u64>(),
        rs.iter().map(|r| r.ops_checked).sum::<u64>(),
        rs.iter().map(|r| r.violations.len()).sum::<usize>(),
        rs.iter().map(|r| r.acked_lost).sum::<u64>(),
        rs.iter().map(|r| r.divergent).sum::<u64>(),
        &failing[..failing.len().min(20)]
    )
}

#[test]
fn fault_free_runs_are_linearizable_and_converge() {
    let rs = run_seeds(0..300, |s| {
        let mut c = SimConfig::new(s);
        c.faults = false;
        c
    });
    println!("{}", summary(&rs));
    assert!(
        rs.iter().all(|r| r.violations.is_empty()),
        "{}\n{:?}",
        summary(&rs),
        rs.iter()
            .find(|r| !r.violations.is_empty())
            .map(|r| &r.violations)
    );
    assert!(rs.iter().map(|r| r.ops_checked).sum::<u64>() > 20_000);
}

#[test]
fn same_seed_replays_exactly() {
    let a = run(SimConfig::new(4242));
    let b = run(SimConfig::new(4242));
    assert_eq!(a.faults, b.faults);
    assert_eq!(a.ops_checked, b.ops_checked);
    assert_eq!(a.sim_time, b.sim_time);
    assert_eq!(a.violations, b.violations);
}

/// Each deliberate bug must make the oracle report violations on seeds
/// where the correct protocol is clean.
#[test]
fn oracle_catches_injected_protocol_bugs() {
    let seeds = 0..400;
    let base = run_seeds(seeds.clone(), SimConfig::new);
    let clean: Vec<u64> = base
        .iter()
        .filter(|r| r.violations.is_empty())
        .map(|r| r.seed)
        .collect();
    let bugs = [
        (
            "ack on first replica",
            Bugs {
                ack_on_first_replica: true,
                ..Default::default()
            },
        ),
        (
            "skip read fencing",
            Bugs {
                skip_read_fencing: true,
                ..Default::default()
            },
        ),
        (
            "rebuild source by id",
            Bugs {
                source_by_id: true,
                ..Default::default()
            },
        ),
    ];
    for (name, bug) in bugs {
        let rs = run_seeds(seeds.clone(), move |s| {
            let mut c = SimConfig::new(s);
            c.bugs = bug;
            c
        });
        let caught = rs
            .iter()
            .filter(|r| clean.contains(&r.seed) && !r.violations.is_empty())
            .count();
        println!("{name}: caught on {caught} clean seeds; {}", summary(&rs));
        assert!(caught > 0, "the oracle did not catch bug {name:?}");
    }
}

/// The full fault run. See the module doc for why it is ignored for now.
#[test]
#[ignore = "open simulator findings, see docs/dev/STATUS.md"]
fn ten_thousand_seeds_with_faults() {
    let n: u64 = std::env::var("SHEAF_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let rs = run_seeds(0..n, SimConfig::new);
    println!("{}", summary(&rs));
    assert!(
        rs.iter().all(|r| r.violations.is_empty()),
        "{}",
        summary(&rs)
    );
}
