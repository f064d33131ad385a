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
//!  net       tokio TCP transport, authenticated sessions, replica server
//!    │
//!  proto     sans-IO engine and replica state machines, messages, codec
//!    │
//!  store     replica store: WAL, copy-on-write layers, per-block checksums
//!
//!  backup    incremental content-addressed backups to S3 or a directory
//!  sim       deterministic simulator + linearizability oracle over all of it
//! ```
#![warn(missing_docs)]

pub mod backup;
pub mod error;
pub mod frontend;
#[doc(hidden)]
pub mod fuzzing;
pub mod net;
pub mod proto;
mod recvbuf;
pub mod sim;
pub mod store;
pub mod types;
pub mod volume;

pub use error::{Error, Result};
pub use types::{BLOCK_SIZE, Tag};
pub use volume::{BlockingVolume, Volume, VolumeConfig};

/// Tunes glibc's allocator for a storage daemon: keeps allocations of up
/// to 8 MiB (replication frames, 1 MiB reads and writes) in the heap and
/// returns freed heap to the kernel only above 64 MiB at its top. By
/// default glibc maps each such buffer with `mmap` and unmaps it on free,
/// so every 1 MiB request paid 256 page faults plus an unmap (~5 % of the
/// CPU of a 3-replica 1 MiB read in `sheaf-blockd`). Call it at the start
/// of `main`, before other threads exist; a no-op on other C libraries.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called before
    // the program starts threads, as documented above.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 8 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
    }
}
