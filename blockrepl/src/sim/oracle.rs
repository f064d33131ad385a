// SPDX-License-Identifier: Apache-2.0
//! The oracle: checks a recorded history of client operations.
//!
//! Every block is an independent register. Each written block carries a
//! unique self-describing value ([`encode_value`]: writer, sequence, block
//! address, engine generation, checksum), so each read names exactly the
//! write it returns; a torn, misdirected or corrupt block decodes as garbage
//! and is a violation by itself. Writes that failed or timed out are "maybe
//! happened" (their response time is +∞).
//!
//! Per block and per *era* (an era ends when every replica loses power at
//! once), non-zero values are checked for linearizability with the zone
//! characterisation for registers with unique values (Gibbons & Korach;
//! Golab, Li & Shah): a read may not precede its write, forward zones may not
//! overlap, and no backward zone may lie inside a forward zone. Zero values
//! (initial content, trim, write-zeroes) are not unique, so reads of zeros
//! and every read against zero-writes get the no-stale-read check. Across a
//! total power loss only writes covered by a completed FLUSH must survive:
//! the first value the new era shows for a block must be one that no flushed
//! write definitely superseded, otherwise it counts as an acknowledged write
//! lost.

use std::collections::HashMap;

use crate::types::BLOCK_SIZE;

const MAGIC: &[u8; 4] = b"SHFV";

/// Identifies a write: (writer, sequence).
pub type WriteKey = (u32, u64);

/// Builds the unique content of one block written by `writer`'s write `seq`.
pub fn encode_value(writer: u32, seq: u64, lba: u64, eg: u32) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_SIZE];
    let mut hdr = [0u8; 32];
    hdr[0..4].copy_from_slice(MAGIC);
    hdr[4..8].copy_from_slice(&writer.to_le_bytes());
    hdr[8..16].copy_from_slice(&seq.to_le_bytes());
    hdr[16..24].copy_from_slice(&lba.to_le_bytes());
    hdr[24..28].copy_from_slice(&eg.to_le_bytes());
    for chunk in b.chunks_mut(32) {
        chunk.copy_from_slice(&hdr);
    }
    let c = crc32c::crc32c(&b[..BLOCK_SIZE - 4]);
    b[BLOCK_SIZE - 4..].copy_from_slice(&c.to_le_bytes());
    b
}

/// What a read of one block returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadValue {
    /// All zeros.
    Zero,
    /// The value of a write.
    Write(WriteKey),
    /// Anything else: torn, misdirected, corrupt or foreign data.
    Garbage,
}

/// Decodes a block read at `lba`.
pub fn decode_value(lba: u64, b: &[u8]) -> ReadValue {
    if b.len() != BLOCK_SIZE {
        return ReadValue::Garbage;
    }
    if b.iter().all(|&x| x == 0) {
        return ReadValue::Zero;
    }
    if &b[0..4] != MAGIC {
        return ReadValue::Garbage;
    }
    let c = u32::from_le_bytes([
        b[BLOCK_SIZE - 4],
        b[BLOCK_SIZE - 3],
        b[BLOCK_SIZE - 2],
        b[BLOCK_SIZE - 1],
    ]);
    if c != crc32c::crc32c(&b[..BLOCK_SIZE - 4]) {
        return ReadValue::Garbage;
    }
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[4..8]);
    let mut s = [0u8; 8];
    s.copy_from_slice(&b[8..16]);
    let mut l = [0u8; 8];
    l.copy_from_slice(&b[16..24]);
    if u64::from_le_bytes(l) != lba {
        return ReadValue::Garbage;
    }
    ReadValue::Write((u32::from_le_bytes(w), u64::from_le_bytes(s)))
}

/// Kind of a recorded operation.
#[derive(Clone, Debug)]
pub enum OpKind {
    /// A write of unique values to `blocks` blocks at `lba`.
    Write {
        /// First block.
        lba: u64,
        /// Blocks.
        blocks: u32,
        /// Its key.
        key: WriteKey,
    },
    /// Zeros written (trim / write-zeroes).
    Zero {
        /// First block.
        lba: u64,
        /// Blocks.
        blocks: u32,
    },
    /// A read; `values` filled on success.
    Read {
        /// First block.
        lba: u64,
        /// What each block returned.
        values: Vec<ReadValue>,
    },
    /// A flush.
    Flush,
}

/// One client operation in the history.
#[derive(Clone, Debug)]
pub struct OpRecord {
    /// What it was.
    pub kind: OpKind,
    /// Invocation time.
    pub invoke: u64,
    /// Completion time if it completed successfully; `None` = failed or
    /// timed out ("maybe happened" for writes, ignored for reads/flushes).
    pub complete: Option<u64>,
    /// Era (incremented by each total power loss).
    pub era: u32,
}

/// Result of checking a history.
#[derive(Clone, Debug, Default)]
pub struct Verdict {
    /// Operations checked.
    pub ops_checked: u64,
    /// Violations, described.
    pub violations: Vec<String>,
    /// Acknowledged (and flushed, across power loss) writes found lost.
    pub acked_lost: u64,
}

const INF: u64 = u64::MAX;

#[derive(Clone, Copy, Debug)]
struct W {
    #[allow(dead_code)] // kept for debugging output
    op: usize,
    invoke: u64,
    complete: u64,
    zero: bool,
    key: Option<WriteKey>,
    era: u32,
}

#[derive(Clone, Copy, Debug)]
struct Rd {
    op: usize,
    invoke: u64,
    complete: u64,
    value: ReadValue,
    era: u32,
}

/// Checks a history. `eras` is the number of eras; `era_start[e]` the time
/// era `e` began.
pub fn check(history: &[OpRecord], eras: u32) -> Verdict {
    let mut v = Verdict::default();
    let mut writes: HashMap<u64, Vec<W>> = HashMap::new();
    let mut reads: HashMap<u64, Vec<Rd>> = HashMap::new();
    let mut flushes: Vec<(u64, u64, u32)> = Vec::new();
    for (i, op) in history.iter().enumerate() {
        match &op.kind {
            OpKind::Write { lba, blocks, key } => {
                v.ops_checked += 1;
                for b in *lba..lba + *blocks as u64 {
                    writes.entry(b).or_default().push(W {
                        op: i,
                        invoke: op.invoke,
                        complete: op.complete.unwrap_or(INF),
                        zero: false,
                        key: Some(*key),
                        era: op.era,
                    });
                }
            }
            OpKind::Zero { lba, blocks } => {
                v.ops_checked += 1;
                for b in *lba..lba + *blocks as u64 {
                    writes.entry(b).or_default().push(W {
                        op: i,
                        invoke: op.invoke,
                        complete: op.complete.unwrap_or(INF),
                        zero: true,
                        key: None,
                        era: op.era,
                    });
                }
            }
            OpKind::Read { lba, values } => {
                let Some(c) = op.complete else { continue };
                v.ops_checked += 1;
                for (k, val) in values.iter().enumerate() {
                    let b = lba + k as u64;
                    if *val == ReadValue::Garbage {
                        v.violations
                            .push(format!("block {b}: read (op {i}) returned garbage (torn, misdirected or corrupt data)"));
                    }
                    reads.entry(b).or_default().push(Rd {
                        op: i,
                        invoke: op.invoke,
                        complete: c,
                        value: *val,
                        era: op.era,
                    });
                }
            }
            OpKind::Flush => {
                if let Some(c) = op.complete {
                    v.ops_checked += 1;
                    flushes.push((op.invoke, c, op.era));
                }
            }
        }
    }
    let mut blocks: Vec<u64> = writes.keys().chain(reads.keys()).copied().collect();
    blocks.sort_unstable();
    blocks.dedup();
    for b in blocks {
        let ws = writes.get(&b).cloned().unwrap_or_default();
        let rs = reads.get(&b).cloned().unwrap_or_default();
        check_block(b, &ws, &rs, &flushes, eras, &mut v);
    }
    v
}

/// Initial value of a block in an era: zero (initial content / zero write)
/// or a specific write, or unknown until the first read shows it.
#[derive(Clone, Debug)]
struct EraStart {
    /// Allowed values: `None` = a zero value, `Some(k)` = write k.
    allowed: Vec<Option<WriteKey>>,
}

fn check_block(
    b: u64,
    ws: &[W],
    rs: &[Rd],
    flushes: &[(u64, u64, u32)],
    eras: u32,
    v: &mut Verdict,
) {
    let by_key: HashMap<WriteKey, W> = ws.iter().filter_map(|w| w.key.map(|k| (k, *w))).collect();
    let mut start = EraStart {
        allowed: vec![None],
    };
    for era in 0..=eras {
        let ews: Vec<W> = ws.iter().filter(|w| w.era == era).copied().collect();
        let ers: Vec<Rd> = rs.iter().filter(|r| r.era == era).copied().collect();
        // Reads must name a write of this block.
        let mut initial: Option<Option<WriteKey>> = None;
        for r in &ers {
            match r.value {
                ReadValue::Write(k) => {
                    let Some(w) = by_key.get(&k) else {
                        v.violations.push(format!("block {b}: read (op {}) returned write {k:?} that never wrote this block", r.op));
                        continue;
                    };
                    if w.era < era {
                        // A value carried over a total power loss.
                        match initial {
                            None => initial = Some(Some(k)),
                            Some(Some(k0)) if k0 == k => {}
                            Some(_) => {
                                // Two different carried-over values, unless one was
                                // rewritten in this era — which it cannot be (keys are unique).
                                v.violations.push(format!(
                                    "block {b}: era {era} shows two different values from before the power loss"
                                ));
                            }
                        }
                    } else if r.complete < w.invoke {
                        v.violations.push(format!(
                            "block {b}: read (op {}) returned write {k:?} before that write was issued",
                            r.op
                        ));
                    }
                }
                ReadValue::Zero | ReadValue::Garbage => {}
            }
        }
        if era > 0
            && let Some(Some(k)) = initial
            && !start.allowed.contains(&Some(k))
        {
            v.acked_lost += 1;
            v.violations.push(format!(
                "block {b}: after total power loss shows write {k:?}, older than a flushed write (acknowledged data lost)"
            ));
        }
        // Zone check over unique (non-zero) values of this era.
        let init_key = initial.flatten();
        zones(b, &ews, &ers, init_key, v);
        // No-stale-read checks involving zero values and every write.
        for r in &ers {
            let src: Option<(u64, u64)> = match r.value {
                ReadValue::Write(k) => by_key.get(&k).map(|w| {
                    if w.era < era {
                        (0, 0)
                    } else {
                        (w.invoke, w.complete)
                    }
                }),
                ReadValue::Zero => {
                    // Some zero source not definitely superseded before the read.
                    let mut cands: Vec<(u64, u64)> = ews
                        .iter()
                        .filter(|w| w.zero && w.invoke < r.complete)
                        .map(|w| (w.invoke, w.complete))
                        .collect();
                    if start.allowed.contains(&None) && init_key.is_none() {
                        cands.push((0, 0));
                    }
                    let ok = cands.iter().any(|&(_, zc)| !superseded(zc, r.invoke, &ews));
                    if !ok {
                        v.violations.push(format!(
                            "block {b}: read (op {}) returned zeros but a later write had completed before it",
                            r.op
                        ));
                    }
                    None
                }
                ReadValue::Garbage => None,
            };
            if let Some((_, wc)) = src
                && superseded(wc, r.invoke, &ews)
            {
                v.violations.push(format!(
                    "block {b}: stale read (op {}) of {:?}",
                    r.op, r.value
                ));
            }
        }
        // Values allowed at the start of the next era: any write of this era
        // (or the current start) not definitely superseded by a flushed write.
        let durable = |w: &W| {
            flushes
                .iter()
                .any(|&(fi, _, fe)| fe == era && w.complete < fi)
        };
        let dws: Vec<&W> = ews.iter().filter(|w| durable(w)).collect();
        let mut next: Vec<Option<WriteKey>> = Vec::new();
        for w in &ews {
            if !dws.iter().any(|d| w.complete < d.invoke) {
                next.push(w.key);
            }
        }
        if dws.is_empty() {
            // Nothing of this era is guaranteed: the start values remain possible.
            next.extend(start.allowed.iter().copied());
            if let Some(k) = init_key {
                next.push(Some(k));
            }
        }
        start = EraStart { allowed: next };
    }
}

/// True if some write completed after `wc` ended... precisely: a write `x`
/// was invoked after `wc` (the source's completion) and completed before
/// `read_invoke`.
fn superseded(wc: u64, read_invoke: u64, ws: &[W]) -> bool {
    ws.iter().any(|x| wc < x.invoke && x.complete < read_invoke)
}

fn zones(b: u64, ws: &[W], rs: &[Rd], init: Option<WriteKey>, v: &mut Verdict) {
    // Zones: (f, s, forward)
    let mut forward: Vec<(u64, u64, String)> = Vec::new();
    let mut backward: Vec<(u64, u64, String)> = Vec::new();
    for w in ws.iter().filter(|w| !w.zero) {
        let Some(k) = w.key else { continue };
        let wr: Vec<&Rd> = rs
            .iter()
            .filter(|r| r.value == ReadValue::Write(k))
            .collect();
        if wr.is_empty() && w.complete == INF {
            continue; // maybe-write nobody saw
        }
        let f = wr.iter().map(|r| r.complete).fold(w.complete, u64::min);
        let s = wr.iter().map(|r| r.invoke).fold(w.invoke, u64::max);
        let name = format!("{k:?}");
        if f < s {
            forward.push((f, s, name));
        } else {
            backward.push((s, f, name));
        }
    }
    // The initial value of the era (if a carried-over write) acts as a write at -inf.
    if let Some(k) = init {
        let wr: Vec<&Rd> = rs
            .iter()
            .filter(|r| r.value == ReadValue::Write(k))
            .collect();
        if let Some(s) = wr.iter().map(|r| r.invoke).max() {
            forward.push((0, s, format!("{k:?} (carried over)")));
        }
    }
    forward.sort();
    for i in 1..forward.len() {
        let (f0, s0, n0) = &forward[i - 1];
        let (f1, _, n1) = &forward[i];
        let _ = f0;
        if f1 < s0 {
            v.violations.push(format!("block {b}: not linearizable: writes {n0} and {n1} are both seen in overlapping order"));
        }
    }
    for (bs, bf, bn) in &backward {
        for (ff, fs, fname) in &forward {
            if ff < bs && bf < fs {
                v.violations.push(format!("block {b}: not linearizable: write {bn} happened entirely inside the zone of {fname}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(lba: u64, key: WriteKey, i: u64, c: Option<u64>) -> OpRecord {
        OpRecord {
            kind: OpKind::Write {
                lba,
                blocks: 1,
                key,
            },
            invoke: i,
            complete: c,
            era: 0,
        }
    }
    fn r(lba: u64, val: ReadValue, i: u64, c: u64) -> OpRecord {
        OpRecord {
            kind: OpKind::Read {
                lba,
                values: vec![val],
            },
            invoke: i,
            complete: Some(c),
            era: 0,
        }
    }

    #[test]
    fn values_roundtrip_and_detect_damage() {
        let mut v = encode_value(3, 9, 17, 1);
        assert_eq!(decode_value(17, &v), ReadValue::Write((3, 9)));
        assert_eq!(
            decode_value(18, &v),
            ReadValue::Garbage,
            "misdirected block"
        );
        v[100] ^= 1;
        assert_eq!(decode_value(17, &v), ReadValue::Garbage);
        assert_eq!(decode_value(1, &[0u8; 4096]), ReadValue::Zero);
    }

    #[test]
    fn linearizable_history_passes() {
        let h = vec![
            w(0, (1, 1), 10, Some(20)),
            r(0, ReadValue::Write((1, 1)), 25, 30),
            w(0, (1, 2), 35, None), // maybe
            r(0, ReadValue::Write((1, 1)), 40, 45),
            r(0, ReadValue::Write((1, 2)), 50, 55), // maybe-write took effect late: fine
        ];
        let v = check(&h, 0);
        assert!(v.violations.is_empty(), "{:?}", v.violations);
    }

    #[test]
    fn stale_read_is_caught() {
        let h = vec![
            w(0, (1, 1), 10, Some(20)),
            w(0, (1, 2), 30, Some(40)),
            r(0, ReadValue::Write((1, 1)), 50, 60),
        ];
        assert!(!check(&h, 0).violations.is_empty());
        let h = vec![w(0, (1, 1), 10, Some(20)), r(0, ReadValue::Zero, 30, 40)];
        assert!(
            !check(&h, 0).violations.is_empty(),
            "lost write read as zero"
        );
    }

    #[test]
    fn flip_flop_is_caught() {
        let h = vec![
            w(0, (1, 1), 10, Some(100)),
            w(0, (2, 1), 10, Some(100)),
            r(0, ReadValue::Write((1, 1)), 20, 30),
            r(0, ReadValue::Write((2, 1)), 40, 50),
            r(0, ReadValue::Write((1, 1)), 60, 70),
        ];
        assert!(!check(&h, 0).violations.is_empty());
    }

    #[test]
    fn flushed_write_lost_across_power_loss_is_caught() {
        let mut h = vec![
            w(0, (1, 1), 10, Some(20)),
            w(0, (1, 2), 30, Some(40)),
            OpRecord {
                kind: OpKind::Flush,
                invoke: 50,
                complete: Some(60),
                era: 0,
            },
        ];
        let mut rd = r(0, ReadValue::Write((1, 1)), 100, 110);
        rd.era = 1;
        h.push(rd);
        let v = check(&h, 1);
        assert_eq!(v.acked_lost, 1, "{:?}", v.violations);
        // Without the flush, losing the unflushed write is allowed.
        let mut h2 = h.clone();
        h2.remove(2);
        assert!(check(&h2, 1).violations.is_empty());
    }
}
