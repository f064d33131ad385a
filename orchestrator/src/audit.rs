// SPDX-License-Identifier: Apache-2.0
//! Offline audit of a volume's replica stores (after a test stopped every
//! process): which write (epoch, index) produced each block on each replica,
//! and whether two engines' writes interleave.
//!
//! blockrepl tags every ordered write with `(epoch, index)`, indexes being
//! contiguous over the volume's whole history. If fencing works, every
//! write of an older epoch has a lower index than every write of a newer
//! one: no replica accepted a write from a deposed engine once the next
//! engine had started writing. A block keeps the tag of its last write, so
//! workloads that write each block once (the probe guest's log) expose the
//! full write history.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use sheaf_blockrepl::store::Store;
use sheaf_blockrepl::store::disk::StdDir;
use sheaf_blockrepl::{BLOCK_SIZE, Tag};

/// One block of one replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockView {
    /// Write that produced the block.
    pub tag: Tag,
    /// Checksum verified.
    pub valid: bool,
    /// The block's data.
    pub data: Vec<u8>,
}

/// What one replica store holds for a range of blocks.
#[derive(Clone, Debug)]
pub struct ReplicaView {
    /// Store directory.
    pub dir: PathBuf,
    /// Highest epoch the replica accepted.
    pub epoch: u64,
    /// Position (last applied write).
    pub position: Tag,
    /// Whether the replica is clean (not rebuilding).
    pub clean: bool,
    /// Blocks written, by block number.
    pub blocks: BTreeMap<u64, BlockView>,
}

/// Opens a replica store (no process may be serving it) and reads the tags
/// and data of `lbas`.
pub fn read_replica(dir: &Path, lbas: Range<u64>) -> Result<ReplicaView, String> {
    let d = StdDir::new(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let store = Store::open(Box::new(d)).map_err(|e| format!("{}: {e}", dir.display()))?;
    let info = store.info();
    let layers = store.layer_ids();
    let mut blocks = BTreeMap::new();
    let end = lbas.end.min(store.size_blocks());
    for lba in lbas.start..end {
        let Some((tag, _zero, valid)) = layers.iter().rev().find_map(|l| store.entry(*l, lba))
        else {
            continue;
        };
        let mut data = vec![0u8; BLOCK_SIZE];
        let _ = store.read(lba, 1, &mut data);
        blocks.insert(lba, BlockView { tag, valid, data });
    }
    Ok(ReplicaView {
        dir: dir.to_path_buf(),
        epoch: info.epoch,
        position: info.position,
        clean: info.state == sheaf_blockrepl::types::ReplicaState::Clean,
        blocks,
    })
}

/// The epochs that wrote, and every interleaving found.
#[derive(Clone, Debug, Default)]
pub struct EpochAudit {
    /// epoch → (lowest index, highest index, blocks) over all replicas.
    pub epochs: BTreeMap<u64, (u64, u64, usize)>,
    /// Human-readable violations (empty when fencing held).
    pub violations: Vec<String>,
}

/// Checks that no write of an older epoch was accepted after a newer epoch
/// started writing, on any replica, and that replicas that hold a block at
/// the same write agree on its data.
pub fn audit_epochs(replicas: &[ReplicaView]) -> EpochAudit {
    let mut a = EpochAudit::default();
    for r in replicas {
        for b in r.blocks.values() {
            let e = a.epochs.entry(b.tag.epoch).or_insert((u64::MAX, 0, 0));
            e.0 = e.0.min(b.tag.index);
            e.1 = e.1.max(b.tag.index);
            e.2 += 1;
        }
    }
    let list: Vec<(u64, (u64, u64, usize))> = a.epochs.iter().map(|(k, v)| (*k, *v)).collect();
    for w in list.windows(2) {
        let (old, (_, old_max, _)) = w[0];
        let (new, (new_min, _, _)) = w[1];
        if old_max >= new_min {
            a.violations.push(format!(
                "epoch {old} wrote index {old_max} although epoch {new} had started at index {new_min}"
            ));
        }
    }
    // Same write, different bytes: a torn or misdirected copy.
    let mut seen: BTreeMap<(u64, Tag), (&Path, &[u8])> = BTreeMap::new();
    for r in replicas {
        for (lba, b) in &r.blocks {
            if !b.valid {
                a.violations.push(format!(
                    "{}: block {lba} fails its checksum",
                    r.dir.display()
                ));
                continue;
            }
            match seen.get(&(*lba, b.tag)) {
                Some((dir, data)) if *data != &b.data[..] => a.violations.push(format!(
                    "block {lba} write {:?} differs between {} and {}",
                    b.tag,
                    dir.display(),
                    r.dir.display()
                )),
                Some(_) => {}
                None => {
                    seen.insert((*lba, b.tag), (&r.dir, &b.data));
                }
            }
        }
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(tags: &[(u64, u64, u64)]) -> ReplicaView {
        ReplicaView {
            dir: PathBuf::from("/r"),
            epoch: 0,
            position: Tag::new(0, 0),
            clean: true,
            blocks: tags
                .iter()
                .map(|(lba, e, i)| {
                    (
                        *lba,
                        BlockView {
                            tag: Tag::new(*e, *i),
                            valid: true,
                            data: vec![*lba as u8; 8],
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn ordered_epochs_pass_and_interleaving_is_caught() {
        let ok = audit_epochs(&[view(&[(1, 1, 1), (2, 1, 2), (3, 3, 5)])]);
        assert!(ok.violations.is_empty(), "{:?}", ok.violations);
        assert_eq!(ok.epochs.len(), 2);
        let bad = audit_epochs(&[view(&[(1, 1, 1), (2, 3, 3)]), view(&[(4, 1, 4)])]);
        assert_eq!(bad.violations.len(), 1, "{:?}", bad.violations);
    }
}
