// SPDX-License-Identifier: Apache-2.0
//! Deterministic simulation of the replication protocol.
//!
//! The engine and replica state machines and the real store code run over
//! simulated disks ([`disk`]), a simulated network and a simulated clock,
//! driven by one seeded PRNG ([`rng`]), with the fault list of
//! RELIABILITY.md injected; the [`oracle`] checks the recorded history.
//! `cargo run --release -p sheaf-blockrepl --example sim -- --seeds N` runs
//! many seeds; any seed replays exactly with `--seed S`.

pub mod disk;
pub mod harness;
pub mod oracle;
pub mod rng;

pub use harness::{SimConfig, SimReport, run};
