// SPDX-License-Identifier: Apache-2.0
//! Replicated block storage with epoch fencing, rebuild and checksums, plus
//! NBD, vhost-user-blk and virtio-blk frontends.
//!
//! Layers (see `docs/blockrepl.md`):
//!
//! ```text
//!  frontend  NBD server, vhost-user-blk backend, sheaf-vmm BlockBackend
//!    │
//!  volume    Volume / BlockingVolume: the client API frontends use
//!    │
//!  net       tokio TCP transport, HMAC-authenticated sessions, replica server
//!    │
//!  proto     sans-IO engine and replica state machines, messages, codec
//!    │
//!  store     replica store: WAL, copy-on-write layers, per-block checksums
//!
//!  sim       deterministic simulator + linearizability oracle over all of it
//! ```
#![warn(missing_docs)]

pub mod error;
pub mod frontend;
pub mod net;
pub mod proto;
pub mod sim;
pub mod store;
pub mod types;
pub mod volume;

pub use error::{Error, Result};
pub use types::{BLOCK_SIZE, Tag};
pub use volume::{BlockingVolume, Volume, VolumeConfig};
