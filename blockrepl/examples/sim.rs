// SPDX-License-Identifier: Apache-2.0
//! Runs the deterministic simulator over many seeds and prints the figures
//! of RELIABILITY.md.
//!
//! ```text
//! cargo run --release -p sheaf-blockrepl --example sim -- --seeds 10000
//! cargo run --release -p sheaf-blockrepl --example sim -- --seed 1234 -v
//! cargo run --release -p sheaf-blockrepl --example sim -- --seeds 200 --bug ack-on-first-replica
//! ```
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use clap::Parser;
use sheaf_blockrepl::proto::engine::Bugs;
use sheaf_blockrepl::sim::{SimConfig, run};

#[derive(Parser, Debug)]
#[command(about = "sheaf-blockrepl deterministic simulation")]
struct Args {
    /// Number of seeds to run (starting at --start).
    #[arg(long, default_value_t = 1000)]
    seeds: u64,
    /// First seed.
    #[arg(long, default_value_t = 0)]
    start: u64,
    /// Run only this seed (and print its violations).
    #[arg(long)]
    seed: Option<u64>,
    /// Worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Inject a deliberate protocol bug: ack-on-first-replica,
    /// skip-read-fencing, source-by-id, lease-ignores-drift,
    /// lease-checked-at-send, replica-forgets-lease.
    #[arg(long)]
    bug: Option<String>,
    /// Run the workload without injected faults.
    #[arg(long)]
    no_faults: bool,
    /// Inject only partitions and engine pauses (zombie engines).
    #[arg(long)]
    zombie: bool,
    /// Turn read leases off (every read confirms with a ping round).
    #[arg(long)]
    no_leases: bool,
    /// Read lease asked by engines (µs of simulated clocks).
    #[arg(long)]
    lease_us: Option<u64>,
    /// Clock rate error bound ρ of every simulated clock (ppm).
    #[arg(long)]
    drift_ppm: Option<u64>,
    /// Print every violation.
    #[arg(short, long)]
    verbose: bool,
}

fn main() {
    let args = Args::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .without_time()
            .init();
    }
    let mut bugs = Bugs::default();
    match args.bug.as_deref() {
        None => {}
        Some("ack-on-first-replica") => bugs.ack_on_first_replica = true,
        Some("skip-read-fencing") => bugs.skip_read_fencing = true,
        Some("source-by-id") => bugs.source_by_id = true,
        Some("lease-ignores-drift") => bugs.lease_ignores_drift = true,
        Some("lease-checked-at-send") => bugs.lease_checked_at_send = true,
        Some("replica-forgets-lease") => bugs.replica_forgets_lease_on_restart = true,
        Some(other) => {
            eprintln!("unknown bug {other:?}");
            std::process::exit(2);
        }
    }
    let (start, count) = match args.seed {
        Some(s) => (s, 1),
        None => (args.start, args.seeds),
    };
    let next = Arc::new(AtomicU64::new(start));
    let totals = Arc::new(Mutex::new((0u64, 0u64, 0u64, 0u64, 0u64, 0u64, Vec::new())));
    let reads = Arc::new(Mutex::new((0u64, 0u64)));
    let t0 = std::time::Instant::now();
    let mut handles = Vec::new();
    for _ in 0..args.threads.max(1) {
        let next = next.clone();
        let totals = totals.clone();
        let verbose = args.verbose || args.seed.is_some();
        let no_faults = args.no_faults;
        let zombie = args.zombie;
        let (no_leases, lease_us, drift) = (args.no_leases, args.lease_us, args.drift_ppm);
        let reads = reads.clone();
        handles.push(std::thread::spawn(move || {
            loop {
                let s = next.fetch_add(1, Ordering::Relaxed);
                if s >= start + count {
                    break;
                }
                let mut cfg = SimConfig::new(s);
                cfg.bugs = bugs;
                cfg.faults = !no_faults;
                cfg.zombie_faults_only = zombie;
                cfg.zombie_clients = zombie;
                if let Some(d) = drift {
                    cfg.drift_ppm = d;
                }
                if let Some(l) = lease_us {
                    cfg.read_lease_us = l;
                }
                if no_leases {
                    cfg.read_lease_us = 0;
                }
                let r = run(cfg);
                {
                    let mut rd = reads.lock().unwrap();
                    rd.0 += r.lease_reads;
                    rd.1 += r.ping_rounds;
                }
                let mut t = totals.lock().unwrap();
                t.0 += 1;
                t.1 += r.faults;
                t.2 += r.ops_checked;
                t.3 += r.violations.len() as u64;
                t.4 += r.acked_lost;
                t.5 += r.divergent;
                if verbose {
                    println!(
                        "seed {s}: sim time {} ms, ops ok {}, faults {}, failovers {}",
                        r.sim_time / 1000,
                        r.ops_ok,
                        r.faults,
                        r.failovers
                    );
                }
                if !r.violations.is_empty() {
                    t.6.push(s);
                    if verbose {
                        for v in &r.violations {
                            println!("seed {s}: {v}");
                        }
                    }
                }
            }
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    let t = totals.lock().unwrap();
    let mut failing = t.6.clone();
    failing.sort_unstable();
    println!("seeds run:            {}", t.0);
    println!("faults injected:      {}", t.1);
    println!("ops checked:          {}", t.2);
    println!("violations:           {}", t.3);
    println!("acked writes lost:    {}", t.4);
    println!("divergent replicas:   {}", t.5);
    let rd = reads.lock().unwrap();
    println!("reads under lease:    {}", rd.0);
    println!("ping rounds:          {}", rd.1);
    println!("elapsed:              {:.1?}", t0.elapsed());
    if !failing.is_empty() {
        let shown: Vec<String> = failing.iter().take(20).map(|s| s.to_string()).collect();
        println!("failing seeds:        {}", shown.join(" "));
        println!(
            "replay:               RUST_LOG=sheaf_blockrepl=debug cargo run --profile test -p sheaf-blockrepl --example sim --{} --seed {}",
            if args.zombie { " --zombie" } else { "" },
            failing[0]
        );
        std::process::exit(1);
    }
}
