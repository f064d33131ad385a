// SPDX-License-Identifier: Apache-2.0
//! The manifest: one self-contained JSON document per backup.

use serde::{Deserialize, Serialize};

use super::BackupError;
use crate::types::BLOCK_SIZE;

/// Manifest format version written by this code.
pub const FORMAT: u32 = 1;

/// The snapshot a backup was taken of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRef {
    /// Snapshot name.
    pub name: String,
    /// Store layer id of the snapshot.
    pub layer: u64,
    /// Epoch of the position at which the snapshot was frozen.
    pub created_epoch: u64,
    /// Write index of that position.
    pub created_index: u64,
}

/// One non-hole chunk of a backup.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// Chunk index: the chunk covers blocks
    /// `[index * chunk_blocks, (index + 1) * chunk_blocks)`.
    pub index: u64,
    /// SHA-256 of the uncompressed bytes, lower-case hex: the object's name.
    pub sha256: String,
    /// Uncompressed length in bytes (shorter for the volume's last chunk).
    pub len: u32,
    /// Length of the stored (compressed) object.
    pub stored_len: u64,
    /// CRC-32C of the stored object.
    pub crc32c: u32,
}

/// A backup: everything a restore needs besides the chunks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version ([`FORMAT`]).
    pub format: u32,
    /// Backup id, unique per volume; ids sort by creation time.
    pub id: String,
    /// Volume name.
    pub volume: String,
    /// Volume size in blocks at the snapshot.
    pub size_blocks: u64,
    /// Block size in bytes (4096).
    pub block_size: u32,
    /// Blocks per chunk.
    pub chunk_blocks: u32,
    /// The snapshot backed up.
    pub snapshot: SnapshotRef,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// The backup this one was made incrementally from, if any (for
    /// information: the manifest itself lists every chunk).
    pub parent: Option<String>,
    /// Bytes of data (non-hole chunks) in the backup.
    pub data_bytes: u64,
    /// The non-hole chunks, ascending by index; missing indexes are zeros.
    pub chunks: Vec<ChunkRef>,
}

impl Manifest {
    /// Number of chunks covering the volume.
    pub fn chunk_count(&self) -> u64 {
        self.size_blocks
            .div_ceil(u64::from(self.chunk_blocks.max(1)))
    }

    /// Uncompressed length of chunk `index`.
    pub fn chunk_len(&self, index: u64) -> u64 {
        let cb = u64::from(self.chunk_blocks);
        let start = index * cb;
        (self.size_blocks.saturating_sub(start)).min(cb) * BLOCK_SIZE as u64
    }

    /// Parses and checks a manifest read from `key`.
    pub fn decode(key: &str, bytes: &[u8]) -> Result<Manifest, BackupError> {
        let corrupt = |reason: String| BackupError::CorruptManifest {
            key: key.to_string(),
            reason,
        };
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        if m.format != FORMAT {
            return Err(corrupt(format!("unknown format {}", m.format)));
        }
        if m.block_size as usize != BLOCK_SIZE {
            return Err(corrupt(format!("block size {}", m.block_size)));
        }
        if m.chunk_blocks == 0 {
            return Err(corrupt("chunk size 0".into()));
        }
        let n = m.chunk_count();
        let mut prev: Option<u64> = None;
        for c in &m.chunks {
            if c.index >= n || prev.is_some_and(|p| p >= c.index) {
                return Err(corrupt(format!("chunk index {} out of order", c.index)));
            }
            if u64::from(c.len) != m.chunk_len(c.index) {
                return Err(corrupt(format!("chunk {} has length {}", c.index, c.len)));
            }
            if c.sha256.len() != 64 || !c.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(corrupt(format!("chunk {} has a bad hash", c.index)));
            }
            prev = Some(c.index);
        }
        Ok(m)
    }

    /// Serializes the manifest.
    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain structs of strings and integers cannot fail.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }
}
