// SPDX-License-Identifier: Apache-2.0
//! Error types of the crate.

use std::io;

/// Errors returned by volumes, stores and the replication protocol.
///
/// Variants are named after the operation that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A request's offset or length is not a multiple of the 4 KiB block size.
    #[error("request at byte {offset} of {len} bytes is not aligned to 4096 bytes")]
    Unaligned {
        /// Byte offset of the request.
        offset: u64,
        /// Byte length of the request.
        len: u64,
    },
    /// A request reaches past the end of the volume.
    #[error("request at byte {offset} of {len} bytes ends past the volume size {size}")]
    OutOfRange {
        /// Byte offset of the request.
        offset: u64,
        /// Byte length of the request.
        len: u64,
        /// Volume size in bytes.
        size: u64,
    },
    /// A request is larger than the protocol allows.
    #[error("request of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Requested length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Fewer than `min_write_replicas` replicas are in sync; writes are refused.
    #[error("only {have} replicas in sync, {need} required for writes")]
    QuorumLost {
        /// Replicas in sync.
        have: usize,
        /// `min_write_replicas`.
        need: usize,
    },
    /// Another engine attached with a higher epoch; this engine is fenced.
    #[error("fenced: a newer engine attached with epoch {epoch}")]
    Fenced {
        /// The newer epoch a replica reported.
        epoch: u64,
    },
    /// The volume could not be attached (not enough replicas reachable or clean).
    #[error("attach failed: {reason}")]
    Attach {
        /// Why.
        reason: String,
    },
    /// No in-sync replica could serve a read (all copies bad or unreachable).
    #[error("read of block {lba} failed on every replica")]
    ReadFailed {
        /// First block of the read.
        lba: u64,
    },
    /// Every in-sync replica that answered holds a copy of block `lba` that
    /// fails its checksum: its data is lost unless a replica that is down
    /// holds a good copy (a later scrub or rebuild repairs from it).
    /// Writing the block replaces the lost copy.
    #[error("block {lba} has no copy that passes its checksum on any in-sync replica")]
    BadBlock {
        /// The first such block of the read.
        lba: u64,
    },
    /// Every replica that held some acknowledged writes lost power before
    /// those writes were flushed: they may be gone. Like a disk power cycle,
    /// only data covered by a completed flush is guaranteed; operations
    /// queued at that moment fail with this error, later ones proceed.
    #[error("replicas lost power: writes not covered by a completed flush may be lost")]
    UnflushedWritesLost,
    /// The engine is shut down or detached.
    #[error("volume is detached")]
    Detached,
    /// The operation conflicts with a running rebuild or another admin operation.
    #[error("busy: {what}")]
    Busy {
        /// What is running.
        what: String,
    },
    /// A snapshot name or id was not found.
    #[error("snapshot {name:?} not found")]
    SnapshotNotFound {
        /// The name asked for.
        name: String,
    },
    /// Another process (or handle) already serves this replica directory.
    #[error(
        "replica directory {path} is already open{holder}; two servers may not share a replica"
    )]
    DirInUse {
        /// The directory.
        path: String,
        /// ` (pid N)` when the holder wrote its pid.
        holder: String,
    },
    /// An invalid argument (bad name, shrinking resize, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A replica store operation failed.
    #[error("store {op} failed")]
    Store {
        /// The store operation.
        op: &'static str,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A replica store file is corrupt beyond recovery.
    #[error("store is corrupt: {0}")]
    Corrupt(String),
    /// A wire frame or message could not be decoded.
    #[error("decode failed: {0}")]
    Decode(#[from] crate::proto::msg::DecodeError),
    /// A network connection failed.
    #[error("network {op} failed")]
    Net {
        /// The network operation.
        op: &'static str,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Peer authentication failed (wrong secret, replayed or forged frame).
    #[error("authentication failed: {0}")]
    Auth(String),
    /// The replica answered with an error.
    #[error("replica error: {0}")]
    Replica(String),
}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn store(op: &'static str) -> impl FnOnce(io::Error) -> Error {
        move |source| Error::Store { op, source }
    }
}
