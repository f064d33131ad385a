// SPDX-License-Identifier: Apache-2.0
//! The safe layer under sheaf's C and Python bindings.
//!
//! Both bindings are thin translations of this crate: it owns the state
//! machines (a VM's configuration phase), the runtimes (a volume's engine,
//! the cluster client's connections) and the one [`Error`] type whose
//! [`ErrorKind`] each binding maps to its own vocabulary (C status codes,
//! Python exception classes).
//!
//! ```text
//!   sheaf-capi (C ABI, handles)     sheaf-python (PyO3 classes)
//!                 \                      /
//!                  sheaf-bindings-core (this crate)
//!        vm::VmHandle   volume::{VolumeHandle, ReplicaServer}
//!        sched::SchedHandle   cluster::ClusterClient
//!                  /        |          |          \
//!          sheaf-vmm   sheaf-blockrepl  sheaf-sched   (HTTPS to sheaf-orchestrator's API)
//! ```
//!
//! ```no_run
//! use sheaf_bindings_core::{sched::SchedHandle, volume::{create_replica, VolumeHandle}};
//! create_replica("/tmp/v0".as_ref(), 16 << 20)?;
//! let vol = VolumeHandle::open_local("/tmp/v0".as_ref())?;
//! vol.write(10, b"hello")?;
//! vol.flush()?;
//! let mut s = SchedHandle::new();
//! s.add_node_json(r#"{"name":"n1","capacity":{"cpu_millis":4000,"memory_bytes":8589934592}}"#)?;
//! println!("{}", s.place_json(r#"{"name":"vm","resources":{"cpu_millis":1000}}"#, true)?);
//! # Ok::<(), sheaf_bindings_core::Error>(())
//! ```
#![warn(missing_docs)]

pub mod cluster;
pub mod error;
pub mod sched;
pub mod vm;
pub mod volume;

pub use error::{Error, ErrorKind, Result};

/// The sheaf version these bindings were built from.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
