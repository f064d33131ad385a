// SPDX-License-Identifier: Apache-2.0
//! Placement of VMs and volume replicas on nodes: a kube-scheduler-style
//! plugin framework, as a pure library (no I/O, no async, no clocks).
//!
//! # Placing VMs
//!
//! Build a [`ClusterSnapshot`] from your nodes, then ask a [`Scheduler`]:
//!
//! ```
//! use sheaf_sched::{ClusterSnapshot, Node, Request, Scheduler, TaintEffect};
//!
//! const GIB: u64 = 1 << 30;
//! let mut snap = ClusterSnapshot::from_nodes([
//!     Node::new("n1", 8_000, 32 * GIB).zone("a"),
//!     Node::new("n2", 8_000, 32 * GIB).zone("b"),
//!     Node::new("gpu", 8_000, 32 * GIB).taint("gpu", "true", TaintEffect::NoSchedule),
//! ])?;
//! let mut sched = Scheduler::new();
//!
//! // `schedule` = `place` + record the VM in the snapshot.
//! let p = sched.schedule(&mut snap, &Request::new("web-0", 2_000, 4 * GIB).label("app", "web"))?;
//! assert_ne!(p.node, "gpu"); // untolerated taint
//!
//! // Required anti-affinity: a second web VM goes to another node.
//! let web1 = Request::new("web-1", 2_000, 4 * GIB)
//!     .label("app", "web")
//!     .anti_affinity("app", "web", sheaf_sched::HOSTNAME_LABEL);
//! let q = sched.schedule(&mut snap, &web1)?;
//! assert_ne!(q.node, p.node);
//!
//! // When nothing fits, the error says why, per class of node.
//! let err = sched.place(&snap, &Request::new("huge", 64_000, GIB)).unwrap_err();
//! assert!(err.to_string().starts_with(
//!     "0/3 nodes are available: 2 Insufficient cpu, 1 node(s) had untolerated taint {gpu: true}."
//! ));
//! # Ok::<(), sheaf_sched::SchedError>(())
//! ```
//!
//! # Placing volume replicas
//!
//! ```
//! use sheaf_sched::{ClusterSnapshot, Node, ReplicaRequest, Scheduler};
//!
//! const GIB: u64 = 1 << 30;
//! let mut snap = ClusterSnapshot::from_nodes(
//!     ["a", "b", "c"].map(|z| Node::new(format!("n-{z}"), 4_000, 8 * GIB).zone(z).disk("d0", 100 * GIB)),
//! )?;
//! let req = ReplicaRequest { volume: "vol".into(), size_bytes: 10 * GIB, replicas: 3, ..Default::default() };
//! let p = Scheduler::new().place_replicas(&snap, &req)?;
//! assert_eq!(p.targets.len(), 3); // one per zone
//! snap.bind_replicas(&p)?;
//! # Ok::<(), sheaf_sched::SchedError>(())
//! ```
//!
//! # Structure
//!
//! - [`types`]: the serde data model (nodes, requests, placements).
//! - [`ClusterSnapshot`]: indexed cluster state with incremental updates.
//! - [`framework`]: extension-point traits, [`CycleState`], [`Profile`].
//! - [`plugins`]: the built-in plugins.
//! - [`Scheduler`]: runs a cycle; gang placement; replica placement.
//!
//! See `docs/sched.md` for the design and `docs/benchmarks.md` for figures.
#![warn(missing_docs)]

mod config;
mod error;
pub mod framework;
mod intern;
pub mod plugins;
mod replicas;
mod scheduler;
mod selector;
mod snapshot;
pub mod types;

pub use config::{DEFAULT_PROFILE, ProfileConfig, ReplicaConfig, SchedulerConfig, default_plugins};
pub use error::{ReasonCount, SchedError, SchedResult, Unschedulable};
pub use framework::{CycleState, Plugin, Profile, Reason};
pub use intern::Sym;
pub use scheduler::Scheduler;
pub use snapshot::{ClusterSnapshot, NodeInfo, VmInfo};
pub use types::*;

#[cfg(test)]
mod tests {
    /// The bindings share these across threads (behind their own locks).
    #[test]
    fn public_types_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<crate::Scheduler>();
        check::<crate::ClusterSnapshot>();
        check::<crate::SchedError>();
        check::<crate::Placement>();
    }
}
