// SPDX-License-Identifier: Apache-2.0
//! Incremental, block-level, content-addressed backups of a volume snapshot
//! to a backup target (issue 22).
//!
//! ```text
//!  engine     backup / restore / list / delete / gc / retain
//!    │          reads a SnapshotSource (a store snapshot), writes a sink
//!  manifest   one self-contained JSON document per backup, written last
//!    │
//!  target     BackupTarget: put / get / list / delete objects by key
//!               DirectoryTarget (local or NFS directory), S3Target (object_store,
//!               feature `s3`, on by default),
//!               MemoryTarget (reference, tests)
//! ```
//!
//! Layout on the target (one target can hold many volumes):
//!
//! ```text
//!  volumes/<volume>/chunks/<sha[0..2]>/<sha256>   lz4 chunk (size-prefixed)
//!  volumes/<volume>/backups/<id>.json             manifest of backup <id>
//! ```
//!
//! A chunk is `chunk_blocks` consecutive store blocks (1 MiB by default),
//! named by the SHA-256 of its uncompressed bytes, so identical content is
//! stored once per volume, across all of its backups. All-zero chunks are
//! holes: no object. The manifest lists every non-hole chunk of the volume
//! with its hash and the CRC-32C of the stored (compressed) object, so a
//! restore needs nothing but the target and detects (and names) a damaged
//! chunk. A manifest is written only after all its chunks are, so a backup
//! that dies midway leaves no manifest and nothing a restore would trust;
//! its chunks are reused by the next attempt (the backup lists the chunks
//! already on the target first) or removed by [`gc`].
//!
//! An incremental backup reads only the chunks holding blocks written
//! since its parent's snapshot (the store's layers record them) and copies
//! the parent's references for the rest. Because every manifest is
//! complete, deleting a backup never breaks a later one: [`delete`] removes
//! the manifest and [`gc`] the chunks no remaining manifest references.

mod catalog;
mod dir;
mod engine;
mod manifest;
mod mem;
mod restore;
#[cfg(feature = "s3")]
mod s3;

use std::fmt;
use std::time::SystemTime;

use bytes::Bytes;

pub use catalog::{GcReport, check_target, delete, gc, list, load_manifest, retain};
pub use dir::DirectoryTarget;
pub use engine::{
    BackupOptions, BackupProgress, BackupReport, DEFAULT_CHUNK_BLOCKS, MAX_CHUNK_BLOCKS, Parent,
    SnapshotSource, StoreSnapshot, backup,
};
pub use manifest::{ChunkRef, Manifest, SnapshotRef};
pub use mem::MemoryTarget;
pub use restore::{FileSink, RestoreOptions, RestoreReport, RestoreSink, StoreSink, restore};
#[cfg(feature = "s3")]
pub use s3::{S3Config, S3Target};

/// Errors of backup operations. Each names the object, chunk, backup or
/// block it is about.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackupError {
    /// The object does not exist on the target.
    #[error("{key} not found on the backup target")]
    NotFound {
        /// Key of the missing object.
        key: String,
    },
    /// A chunk read back from the target does not match its manifest.
    #[error("chunk {index} ({key}) is corrupt: {reason}")]
    CorruptChunk {
        /// Chunk index in the volume (byte offset `index * chunk size`).
        index: u64,
        /// Key of the chunk object.
        key: String,
        /// What did not match.
        reason: String,
    },
    /// A manifest on the target cannot be parsed or is inconsistent.
    #[error("manifest {key} is corrupt: {reason}")]
    CorruptManifest {
        /// Key of the manifest object.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The target refused the credentials (wrong key id or secret, or no
    /// permission on the bucket).
    #[error("backup target {target} refused the credentials ({op} {key}): {detail}")]
    Auth {
        /// The target (endpoint and bucket, or directory).
        target: String,
        /// Operation that was refused.
        op: &'static str,
        /// Key it was refused for.
        key: String,
        /// The target's message.
        detail: String,
    },
    /// Any other failure of the target (I/O, network, server error).
    #[error("backup target {target}: {op} {key} failed: {source}")]
    Target {
        /// The target (endpoint and bucket, or directory).
        target: String,
        /// Operation that failed.
        op: &'static str,
        /// Key it failed for.
        key: String,
        /// The underlying error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A block of the snapshot being backed up failed verification in the
    /// store: the backup refuses to copy damaged data.
    #[error("block {lba} of layer {layer} is damaged in the source store")]
    SourceDamaged {
        /// Block address.
        lba: u64,
        /// Layer that holds the bad copy.
        layer: u64,
    },
    /// The source store failed.
    #[error("source store: {0}")]
    Source(#[from] crate::Error),
    /// A bad name, option or configuration.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// An object on a target, as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    /// Its key (`/`-separated).
    pub key: String,
    /// Stored size in bytes.
    pub size: u64,
    /// When it was last written.
    pub modified: SystemTime,
}

/// Where backups are stored: a flat key → bytes object store.
///
/// Keys are `/`-separated paths of segments made of ASCII letters, digits,
/// `.`, `_` and `-` (no empty, `.` or `..` segments, none starting with
/// `.`); [`check_key`] enforces it. Contract:
///
/// - [`put`](BackupTarget::put) is atomic: after it returns `Ok` the object
///   is durable and complete; after an error or a crash the key holds the
///   old object, no object, or (only for a key that did not exist) the
///   complete new one, never a part. Putting an existing key replaces it.
/// - [`get`](BackupTarget::get) of a missing key is [`BackupError::NotFound`].
/// - [`list`](BackupTarget::list) returns every object whose key starts with
///   `prefix`, where `prefix` is empty or ends with `/` (a folder), in any
///   order.
/// - [`delete`](BackupTarget::delete) of a missing key succeeds.
///
/// Errors that may go away (network, server) are [`BackupError::Target`];
/// the engine does not retry them (an S3 target retries inside
/// `object_store` first): the operation fails and can be run again.
#[async_trait::async_trait]
pub trait BackupTarget: Send + Sync + fmt::Debug {
    /// Stores `data` under `key`.
    async fn put(&self, key: &str, data: Bytes) -> Result<(), BackupError>;
    /// Reads the object at `key`.
    async fn get(&self, key: &str) -> Result<Bytes, BackupError>;
    /// Lists the objects under folder `prefix`.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackupError>;
    /// Removes the object at `key`.
    async fn delete(&self, key: &str) -> Result<(), BackupError>;
    /// A short description for errors and logs (endpoint and bucket, or path).
    fn describe(&self) -> String;
}

/// Checks a key against the rules of [`BackupTarget`].
pub fn check_key(key: &str) -> Result<(), BackupError> {
    let ok = !key.is_empty() && key.split('/').all(check_segment);
    if ok {
        Ok(())
    } else {
        Err(BackupError::InvalidArgument(format!(
            "bad object key {key:?}"
        )))
    }
}

/// Checks a list prefix: empty, or a key followed by `/`.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), BackupError> {
    if prefix.is_empty() {
        return Ok(());
    }
    match prefix.strip_suffix('/') {
        Some(p) if check_key(p).is_ok() => Ok(()),
        _ => Err(BackupError::InvalidArgument(format!(
            "bad list prefix {prefix:?} (must end with '/')"
        ))),
    }
}

fn check_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Checks a volume name: one key segment of at most 63 bytes.
pub fn check_volume_name(volume: &str) -> Result<(), BackupError> {
    if volume.len() <= 63 && check_segment(volume) {
        Ok(())
    } else {
        Err(BackupError::InvalidArgument(format!(
            "bad volume name {volume:?} (1-63 of [A-Za-z0-9._-], not starting with '.')"
        )))
    }
}

/// Folder of a volume's chunks.
pub(crate) fn chunks_prefix(volume: &str) -> String {
    format!("volumes/{volume}/chunks/")
}

/// Key of a volume's chunk with hash `sha` (64 hex digits).
pub(crate) fn chunk_key(volume: &str, sha: &str) -> String {
    let fan = sha.get(..2).unwrap_or("00");
    format!("volumes/{volume}/chunks/{fan}/{sha}")
}

/// Folder of a volume's manifests.
pub(crate) fn backups_prefix(volume: &str) -> String {
    format!("volumes/{volume}/backups/")
}

/// Key of the manifest of backup `id` of `volume`.
pub(crate) fn manifest_key(volume: &str, id: &str) -> String {
    format!("volumes/{volume}/backups/{id}.json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert!(check_key("volumes/v1/chunks/ab/abcd").is_ok());
        for bad in [
            "", "/a", "a/", "a//b", "a/../b", ".x", "a/.tmp", "a b", "a\\b",
        ] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
        assert!(check_prefix("").is_ok());
        assert!(check_prefix("volumes/v1/").is_ok());
        assert!(check_prefix("volumes/v1").is_err());
        assert!(check_volume_name("pvc-1234.data_x").is_ok());
        assert!(check_volume_name("a/b").is_err());
        assert_eq!(
            chunk_key("v", "abcdef"),
            "volumes/v/chunks/ab/abcdef".to_string()
        );
    }
}
