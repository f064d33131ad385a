// SPDX-License-Identifier: Apache-2.0
//! Store tests: layers, recovery, torn writes and corruption, on simulated
//! disks (power loss) and real files.

use super::*;
use crate::sim::disk::SimDisk;
use crate::sim::rng::Prng;

fn blk(v: u8) -> Vec<u8> {
    vec![v; BLOCK_SIZE]
}

fn read1(s: &Store, lba: u64) -> (Vec<u8>, bool) {
    let mut b = blk(0);
    let bad = s.read(lba, 1, &mut b).unwrap();
    (b, bad.is_empty())
}

fn new_store(disk: &SimDisk, blocks: u64) -> Store {
    Store::create(Box::new(disk.clone()), blocks, ReplicaState::Clean).unwrap()
}

#[test]
fn write_read_zero_and_reopen() {
    let d = SimDisk::new(1);
    let mut s = new_store(&d, 16);
    s.write(Tag::new(1, 1), 3, 1, Some(&blk(7))).unwrap();
    s.write(Tag::new(1, 2), 4, 2, Some(&[blk(8), blk(9)].concat()))
        .unwrap();
    s.write(Tag::new(1, 3), 5, 1, None).unwrap();
    assert_eq!(read1(&s, 3), (blk(7), true));
    assert_eq!(read1(&s, 4), (blk(8), true));
    assert_eq!(read1(&s, 5), (blk(0), true));
    assert_eq!(read1(&s, 6), (blk(0), true));
    s.flush().unwrap();
    let s = Store::open(Box::new(d.clone())).unwrap();
    assert_eq!(s.position(), Tag::new(1, 3));
    assert_eq!(read1(&s, 3), (blk(7), true));
    assert_eq!(read1(&s, 4), (blk(8), true));
    assert_eq!(read1(&s, 5), (blk(0), true));
    assert!(matches!(
        s.read(15, 2, &mut [0u8; 8192]),
        Err(Error::OutOfRange { .. })
    ));
}

#[test]
fn snapshot_revert_delete() {
    let d = SimDisk::new(2);
    let mut s = new_store(&d, 8);
    s.write(Tag::new(1, 1), 0, 1, Some(&blk(1))).unwrap();
    s.snapshot(Tag::new(1, 2), "s1", 2).unwrap();
    s.write(Tag::new(1, 3), 0, 1, Some(&blk(2))).unwrap();
    s.write(Tag::new(1, 4), 1, 1, Some(&blk(3))).unwrap();
    assert_eq!(read1(&s, 0).0, blk(2));
    s.revert(Tag::new(1, 5), 1, 3).unwrap();
    assert_eq!(read1(&s, 0).0, blk(1));
    assert_eq!(read1(&s, 1).0, blk(0));
    s.snapshot(Tag::new(1, 6), "s2", 4).unwrap();
    s.write(Tag::new(1, 7), 1, 1, Some(&blk(4))).unwrap();
    s.delete_snapshot(Tag::new(1, 8), 1).unwrap();
    assert_eq!(s.layer_ids(), vec![3, 4]);
    assert_eq!(read1(&s, 0).0, blk(1));
    assert_eq!(read1(&s, 1).0, blk(4));
    let s = Store::open(Box::new(d.clone())).unwrap();
    assert_eq!(s.layer_ids(), vec![3, 4]);
    assert_eq!(read1(&s, 0).0, blk(1));
    assert_eq!(read1(&s, 1).0, blk(4));
    assert_eq!(s.position(), Tag::new(1, 8));
    // Only the chain's files remain.
    let files = d.list().unwrap();
    assert!(
        !files
            .iter()
            .any(|f| f.starts_with("layer-1.") || f.starts_with("layer-2.")),
        "{files:?}"
    );
}

/// Power loss on `d`, reopen: the position is between the last flushed
/// write and the last write (`n`), and the 8 blocks hold exactly the writes
/// of `history` (lba, value per index) up to it, each verifying.
fn power_loss_keeps_a_prefix(
    d: &SimDisk,
    rng: &mut Prng,
    history: &[(u64, u8)],
    flushed: u64,
    n: u64,
    what: &str,
) {
    d.power_loss(rng);
    let s = Store::open(Box::new(d.clone())).unwrap();
    let p = s.position().index;
    assert!(
        p >= flushed && p <= n,
        "{what}: position {p} flushed {flushed} n {n}"
    );
    let mut expect = [0u8; 8];
    for (lba, v) in &history[..p as usize] {
        expect[*lba as usize] = *v;
    }
    for lba in 0..8 {
        assert_eq!(
            read1(&s, lba),
            (blk(expect[lba as usize]), true),
            "{what}: block {lba}"
        );
    }
}

/// Writes `n` one-block writes (write `i`: value `i % 250 + 1` at a random
/// block below 8), recording them in `history` and flushing after each with
/// probability 0.3. Returns the index of the last flushed write (0: none).
fn write_flushing(s: &mut Store, rng: &mut Prng, n: u64, history: &mut Vec<(u64, u8)>) -> u64 {
    let mut flushed = 0;
    for i in 1..=n {
        let lba = rng.below(8);
        let v = (i % 250) as u8 + 1;
        s.write(Tag::new(1, i), lba, 1, Some(&blk(v))).unwrap();
        history.push((lba, v));
        if rng.chance(0.3) {
            s.flush().unwrap();
            flushed = i;
        }
    }
    flushed
}

#[test]
fn power_loss_keeps_flushed_prefix_and_never_tears_a_block() {
    for seed in 0..300u64 {
        let d = SimDisk::new(seed);
        let mut rng = Prng::new(seed);
        let mut s = new_store(&d, 8);
        s.set_checkpoint_bytes(3 * (BLOCK_SIZE as u64 + 64));
        let mut history: Vec<(u64, u8)> = vec![]; // (lba, value) per index
        let n = rng.range(1, 20);
        let flushed = write_flushing(&mut s, &mut rng, n, &mut history);
        drop(s);
        power_loss_keeps_a_prefix(&d, &mut rng, &history, flushed, n, &format!("seed {seed}"));
    }
}

#[test]
fn torn_superblock_falls_back_to_the_other_slot() {
    let d = SimDisk::new(3);
    let mut s = new_store(&d, 8);
    s.set_epoch(5, 1).unwrap();
    drop(s);
    // Corrupt the newest slot as a torn write would.
    let f = d.open("superblock", false).unwrap();
    let mut b = vec![0u8; 4096];
    let mut best = (0u64, 0u64);
    for slot in 0..2u64 {
        f.read_at(&mut b, slot * 4096).unwrap();
        if let Ok(sb) = Superblock::decode(&b)
            && sb.generation > best.0
        {
            best = (sb.generation, slot);
        }
    }
    f.write_at(&[0xAB; 512], best.1 * 4096 + 512).unwrap();
    f.sync().unwrap();
    let s = Store::open(Box::new(d.clone())).unwrap();
    // The previous generation had epoch 0.
    assert_eq!(s.info().epoch, 0);
    // Both slots torn: a clear error, no panic.
    let f = d.open("superblock", false).unwrap();
    f.write_at(&[0xAB; 8192], 0).unwrap();
    assert!(matches!(
        Store::open(Box::new(d.clone())),
        Err(Error::Corrupt(_))
    ));
}

#[test]
fn bit_rot_and_misdirected_writes_are_detected_not_returned() {
    let d = SimDisk::new(4);
    let mut s = new_store(&d, 8);
    for i in 0..8 {
        s.write(Tag::new(1, i + 1), i, 1, Some(&blk(i as u8 + 1)))
            .unwrap();
    }
    s.checkpoint().unwrap();
    // Flip a bit in block 2's data.
    let f = d.open("layer-1.data", false).unwrap();
    let mut b = blk(0);
    f.read_at(&mut b, 2 * 4096).unwrap();
    b[17] ^= 4;
    f.write_at(&b, 2 * 4096).unwrap();
    // Copy block 5 over block 6 (a misdirected write).
    f.read_at(&mut b, 5 * 4096).unwrap();
    f.write_at(&b, 6 * 4096).unwrap();
    let mut out = vec![0u8; 8 * 4096];
    let bad = s.read(0, 8, &mut out).unwrap();
    assert_eq!(bad, vec![(2, 1), (6, 1)]);
    assert_eq!(
        &out[2 * 4096..3 * 4096],
        &blk(0)[..],
        "bad data is never returned"
    );
    // Repair by setting the block again.
    s.set_block(1, 2, SetBlock::Data(Tag::new(1, 3), &blk(3)))
        .unwrap();
    assert_eq!(read1(&s, 2), (blk(3), true));
    // Reopen: damage is still detected (not laundered by recovery).
    drop(s);
    let s = Store::open(Box::new(d.clone())).unwrap();
    assert_eq!(read1(&s, 2), (blk(3), true));
    assert!(!read1(&s, 6).1);
}

#[test]
fn real_files_roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let mut s = Store::create(mk(), 32, ReplicaState::Clean).unwrap();
    s.write(Tag::new(1, 1), 31, 1, Some(&blk(5))).unwrap();
    s.write(Tag::new(1, 2), 0, 1, None).unwrap();
    s.flush().unwrap();
    s.checkpoint().unwrap();
    s.resize(Tag::new(1, 3), 64).unwrap();
    s.write(Tag::new(1, 4), 63, 1, Some(&blk(6))).unwrap();
    drop(s);
    let s = Store::open(mk()).unwrap();
    assert_eq!(s.size_blocks(), 64);
    assert_eq!(read1(&s, 31).0, blk(5));
    assert_eq!(read1(&s, 63).0, blk(6));
}

#[test]
fn misdirected_writes_never_return_wrong_data() {
    for seed in 0..200u64 {
        let d = SimDisk::new(seed);
        let mut rng = Prng::new(seed ^ 77);
        let mut s = new_store(&d, 8);
        s.set_checkpoint_bytes(2 * (BLOCK_SIZE as u64 + 64));
        d.set_faults(crate::sim::disk::DiskFaults {
            misdirect: 0.2,
            slow: 1,
            ..Default::default()
        });
        let mut expect = [0u8; 8];
        for i in 1..40u64 {
            let lba = rng.below(7);
            let n = rng.range(1, 2);
            let v = (i % 250) as u8 + 1;
            let mut data = Vec::new();
            for k in 0..n {
                data.extend_from_slice(&blk(v.wrapping_add(k as u8)));
                expect[(lba + k) as usize] = v.wrapping_add(k as u8);
            }
            s.write(Tag::new(1, i), lba, n as u32, Some(&data)).unwrap();
            if rng.chance(0.3) {
                s.flush().unwrap();
            }
            for b in 0..8 {
                let (got, ok) = read1(&s, b);
                if ok {
                    assert_eq!(
                        got,
                        blk(expect[b as usize]),
                        "seed {seed} step {i} block {b}"
                    );
                }
            }
        }
    }
}

/// Seed 5683: deleting a snapshot whose copy of a block is bad keeps the
/// damage visible in the child *with the tag of the lost write*, also after
/// a restart, so a peer's copy of that write can repair it; the bad bytes
/// are never returned.
#[test]
fn delete_snapshot_keeps_a_bad_copys_tag_across_restart() {
    let d = SimDisk::new(5683);
    let mut s = new_store(&d, 8);
    s.write(Tag::new(1, 1), 5, 1, Some(&blk(9))).unwrap();
    s.snapshot(Tag::new(1, 2), "s1", 2).unwrap();
    // Rot block 5 in the snapshot layer.
    let f = d.open("layer-1.data", false).unwrap();
    let mut b = blk(0);
    f.read_at(&mut b, 5 * 4096).unwrap();
    b[100] ^= 1;
    f.write_at(&b, 5 * 4096).unwrap();
    s.delete_snapshot(Tag::new(1, 3), 1).unwrap();
    assert_eq!(s.layer_ids(), vec![2]);
    let check = |s: &Store| {
        assert_eq!(s.entry(2, 5), Some((Tag::new(1, 1), false, false)));
        let mut out = blk(0xaa);
        assert_eq!(s.read(5, 1, &mut out).unwrap(), vec![(5, 2)]);
        assert_eq!(out, blk(0), "bad data is never returned");
    };
    check(&s);
    drop(s);
    let mut s = Store::open(Box::new(d.clone())).unwrap();
    check(&s);
    // A peer's copy of the same write repairs it, durably.
    s.set_block(2, 5, SetBlock::Data(Tag::new(1, 1), &blk(9)))
        .unwrap();
    s.flush().unwrap();
    drop(s);
    let s = Store::open(Box::new(d.clone())).unwrap();
    assert_eq!(read1(&s, 5), (blk(9), true));
    assert_eq!(s.entry(2, 5), Some((Tag::new(1, 1), false, true)));
}

/// A store written before `META_DAMAGED` existed marked a merged bad copy
/// with all-ones metadata: it still opens, the block reads as bad with an
/// unknown tag.
#[test]
fn old_all_ones_damage_marker_still_opens_as_damaged() {
    let d = SimDisk::new(7);
    let mut s = new_store(&d, 8);
    s.write(Tag::new(1, 1), 3, 1, Some(&blk(4))).unwrap();
    s.checkpoint().unwrap();
    drop(s);
    let m = d.open("layer-1.meta", false).unwrap();
    m.write_at(&[0xffu8; format::META_SIZE], 3 * format::META_SIZE as u64)
        .unwrap();
    let s = Store::open(Box::new(d.clone())).unwrap();
    assert_eq!(s.entry(1, 3), Some((Tag::default(), false, false)));
    assert!(!read1(&s, 3).1);
}

/// A rebuild adopting a chain without a snapshot this stale replica still
/// has (deleted elsewhere) merges its good copies into the kept child, as
/// DeleteSnapshot would, so a good copy of a write that is bad everywhere
/// else survives; a layer above every kept one (a revert) is not merged.
#[test]
fn begin_rebuild_merges_a_deleted_snapshot_into_its_child_only() {
    let info = |id: u64| LayerInfo {
        id,
        name: String::new(),
        created: Tag::new(1, 2),
    };
    let d = SimDisk::new(11);
    let mut s = new_store(&d, 8);
    s.write(Tag::new(1, 1), 5, 1, Some(&blk(9))).unwrap();
    s.snapshot(Tag::new(1, 2), "s1", 2).unwrap();
    s.write(Tag::new(1, 3), 6, 1, Some(&blk(8))).unwrap();
    // Elsewhere s1 was deleted: the chain is [2].
    s.begin_rebuild(&[info(2)], 8, Tag::new(1, 4)).unwrap();
    assert_eq!(s.layer_ids(), vec![2]);
    assert_eq!(s.entry(2, 5), Some((Tag::new(1, 1), false, true)));
    assert_eq!(read1(&s, 5), (blk(9), true));
    assert_eq!(read1(&s, 6), (blk(8), true));
    // Elsewhere the volume was reverted to layer 2 with a new head 3: the
    // old head 4 (above every kept layer) is dropped, not merged.
    let d = SimDisk::new(12);
    let mut s = new_store(&d, 8);
    s.snapshot(Tag::new(1, 1), "s1", 2).unwrap();
    s.write(Tag::new(1, 2), 5, 1, Some(&blk(7))).unwrap();
    s.begin_rebuild(&[info(1), info(3)], 8, Tag::new(1, 3))
        .unwrap();
    assert_eq!(s.layer_ids(), vec![1, 3]);
    assert_eq!(s.entry(1, 5), None);
    assert_eq!(s.entry(3, 5), None);
    assert_eq!(read1(&s, 5), (blk(0), true));
}

#[test]
fn wal_stays_bounded_without_flushes() {
    // A client that never flushes (fio without fsync): the WAL must not grow
    // past its bound, and everything written reads back after a reopen.
    let dir = tempfile::tempdir().unwrap();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let blocks = 512u64;
    let mut s = Store::create(mk(), blocks, ReplicaState::Clean).unwrap();
    let cp = 64 << 10;
    s.set_checkpoint_bytes(cp);
    let limit = cp * WAL_LIMIT_FACTOR;
    let run = 4u32;
    let mut expect = vec![0u8; blocks as usize];
    let mut max_wal = 0;
    for i in 1..=1000u64 {
        let lba = (i * 7 * run as u64) % (blocks - run as u64);
        let v = (i % 251) as u8 + 1;
        s.write(
            Tag::new(1, i),
            lba,
            run,
            Some(&vec![v; run as usize * BLOCK_SIZE]),
        )
        .unwrap();
        expect[lba as usize..(lba + run as u64) as usize].fill(v);
        // Two WAL files (one sealed while its checkpoint runs on a thread),
        // each bounded.
        for name in WAL_NAMES {
            let on_disk = std::fs::metadata(dir.path().join(name)).unwrap().len();
            assert!(
                on_disk <= limit,
                "write {i}: {name} {on_disk} > limit {limit}"
            );
        }
        // Files are reused, not truncated: the live part is a prefix.
        let cur = std::fs::metadata(dir.path().join(WAL_NAMES[s.cur])).unwrap();
        assert!(cur.len() >= s.wal_bytes());
        max_wal = max_wal.max(s.wal_bytes());
    }
    // The bound was reached (so the write-path checkpoint ran) and held.
    assert!(max_wal > limit / 2, "max wal {max_wal}");
    drop(s);
    let s = Store::open(mk()).unwrap();
    assert_eq!(s.position(), Tag::new(1, 1000));
    for lba in 0..blocks {
        assert_eq!(
            read1(&s, lba),
            (blk(expect[lba as usize]), true),
            "block {lba}"
        );
    }
}

#[test]
fn wal_limit_checkpoints_survive_power_loss_as_a_prefix() {
    // Without any flush, power loss keeps at least what the write-path
    // checkpoints made durable, and exactly a prefix of the history. A
    // sealed WAL's deferred checkpoint runs at the next seal at the
    // latest, so up to two WALs of unflushed writes may be lost.
    for seed in 0..50u64 {
        let d = SimDisk::new(seed);
        let mut rng = Prng::new(seed);
        let mut s = new_store(&d, 8);
        let rec = BLOCK_SIZE as u64 + WAL_HDR as u64;
        s.set_checkpoint_bytes(rec);
        let per_wal = (rec * WAL_LIMIT_FACTOR) / rec;
        let n = rng.range(1, 40);
        let mut history = vec![];
        for i in 1..=n {
            let lba = rng.below(8);
            let v = (i % 250) as u8 + 1;
            s.write(Tag::new(1, i), lba, 1, Some(&blk(v))).unwrap();
            history.push((lba, v));
        }
        drop(s);
        d.power_loss(&mut rng);
        let s = Store::open(Box::new(d.clone())).unwrap();
        let p = s.position().index;
        assert!(
            p + 2 * per_wal >= n && p <= n,
            "seed {seed}: position {p}, n {n}"
        );
        let mut expect = [0u8; 8];
        for (lba, v) in &history[..p as usize] {
            expect[*lba as usize] = *v;
        }
        for lba in 0..8 {
            assert_eq!(
                read1(&s, lba),
                (blk(expect[lba as usize]), true),
                "seed {seed}"
            );
        }
    }
}

#[test]
fn large_reads_report_every_bad_block_of_a_run() {
    // A 1 MiB run read with one call: a corrupt block anywhere in it is
    // reported bad and zeroed, every other block reads back.
    // Once in the layer's data file (WAL write, checkpoint copy), once in
    // its extent file (redirected write at extent blocks 0..256).
    for (threshold, file) in [
        (u32::MAX, "layer-1.data"),
        (EXTENT_MIN_BLOCKS, "layer-1.ext"),
    ] {
        let d = SimDisk::new(3);
        let mut s = new_store(&d, 512);
        s.set_extent_threshold(threshold);
        let n = 256u32;
        let data: Vec<u8> = (0..n as usize * BLOCK_SIZE)
            .map(|i| (i / BLOCK_SIZE) as u8 ^ 0x5a)
            .collect();
        s.write(Tag::new(1, 1), 0, n, Some(&data)).unwrap();
        s.checkpoint().unwrap();
        let mut out = vec![0u8; data.len()];
        assert!(s.read(0, n, &mut out).unwrap().is_empty());
        assert_eq!(out, data);
        // Flip a bit in one block of each half of the run.
        let f = d.open(file, false).unwrap();
        let mut b = blk(0);
        for lba in [10u64, 200] {
            f.read_at(&mut b, lba * 4096).unwrap();
            b[7] ^= 1;
            f.write_at(&b, lba * 4096).unwrap();
        }
        for _ in 0..3 {
            let mut out = vec![1u8; data.len()];
            let bad = s.read(0, n, &mut out).unwrap();
            assert_eq!(bad, vec![(10, 1), (200, 1)]);
            for b in 0..n as usize {
                let got = &out[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE];
                if b == 10 || b == 200 {
                    assert!(got.iter().all(|&x| x == 0), "bad block {b} returned data");
                } else {
                    assert_eq!(
                        got,
                        &data[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE],
                        "block {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn set_blocks_data_run_replays_and_checkpoints() {
    let d = SimDisk::new(9);
    let mut s = new_store(&d, 16);
    let t = Tag::new(1, 5);
    let run = [blk(1), blk(2), blk(3)].concat();
    s.set_blocks_data(1, 4, t, &run).unwrap();
    assert!(matches!(
        s.set_blocks_data(1, 14, t, &run),
        Err(Error::OutOfRange { .. })
    ));
    assert!(matches!(
        s.set_blocks_data(1, 0, t, &run[..100]),
        Err(Error::InvalidArgument(_))
    ));
    for (i, v) in [1u8, 2, 3].into_iter().enumerate() {
        assert_eq!(read1(&s, 4 + i as u64), (blk(v), true));
        assert_eq!(s.entry(1, 4 + i as u64), Some((t, false, true)));
    }
    assert_eq!(s.position(), Tag::default(), "does not move the position");
    s.flush().unwrap();
    // Replayed from the WAL, then from the layer files after a checkpoint.
    let mut s = Store::open(Box::new(d.clone())).unwrap();
    for (i, v) in [1u8, 2, 3].into_iter().enumerate() {
        assert_eq!(read1(&s, 4 + i as u64), (blk(v), true));
        assert_eq!(s.entry(1, 4 + i as u64), Some((t, false, true)));
    }
    s.checkpoint().unwrap();
    drop(s);
    let s = Store::open(Box::new(d.clone())).unwrap();
    for (i, v) in [1u8, 2, 3].into_iter().enumerate() {
        assert_eq!(read1(&s, 4 + i as u64), (blk(v), true));
        assert_eq!(s.entry(1, 4 + i as u64), Some((t, false, true)));
    }
    assert_eq!(read1(&s, 7), (blk(0), true));
}

/// Content of block `lba` in the SHA-256 (pre-XXH3) store fixture.
fn fixture_value(lba: u64, n: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK_SIZE];
    b[..8].copy_from_slice(&lba.to_le_bytes());
    b[8..16].copy_from_slice(&n.to_le_bytes());
    b[16..].fill((lba * 31 + n) as u8);
    b
}

/// Copies the store fixture `testdata/sha256-store` into a temporary
/// directory. It was written by the store before the checksum field existed
/// (commit 76f8fd1, SHA-256 checksums): `Store::create(.., 16, Rebuilding)`,
/// `set_epoch(1, 7)`, `mark_clean`; write 1:1 of `fixture_value(b, 1)` to
/// blocks 0..4, snapshot 1:2 "base" (new head 2), write 1:3 to blocks 2..6,
/// `checkpoint`; write 1:4 to blocks 8..10 and zero write 1:5 to block 12,
/// `flush` (the last two are only in the WAL).
fn sha256_fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/store/testdata/sha256-store");
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

fn fixture_expected(lba: u64) -> Vec<u8> {
    match lba {
        0..2 => fixture_value(lba, 1),
        2..6 => fixture_value(lba, 3),
        8..10 => fixture_value(lba, 4),
        _ => blk(0),
    }
}

fn read_all(s: &Store) -> (Vec<u8>, Vec<(u64, u64)>) {
    let n = s.size_blocks();
    let mut out = vec![0u8; n as usize * BLOCK_SIZE];
    let bad = s.read(0, n as u32, &mut out).unwrap();
    (out, bad)
}

#[test]
fn sha256_store_from_before_the_checksum_field_opens_verifies_and_detects_corruption() {
    let dir = sha256_fixture();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let mut s = Store::open(mk()).unwrap();
    assert_eq!(s.checksum(), BlockChecksum::Sha256);
    assert_eq!(s.position(), Tag::new(1, 5));
    assert_eq!(s.info().epoch, 1);
    assert_eq!(s.layer_ids(), vec![1, 2]);
    let (out, bad) = read_all(&s);
    assert!(bad.is_empty(), "{bad:?}");
    for b in 0..16u64 {
        let i = b as usize * BLOCK_SIZE;
        assert_eq!(
            &out[i..i + BLOCK_SIZE],
            &fixture_expected(b)[..],
            "block {b}"
        );
    }
    // The snapshot layer still holds the first write of blocks 2 and 3.
    let snap = s.read_layer(1, 2, 1, true).unwrap();
    assert_eq!(snap[0].1.as_deref(), Some(&fixture_value(2, 1)[..]));
    // New writes keep the store's algorithm, also across a reopen.
    s.write(Tag::new(1, 6), 14, 1, Some(&fixture_value(14, 6)))
        .unwrap();
    s.close().unwrap();
    drop(s);
    let s = Store::open(mk()).unwrap();
    assert_eq!(s.checksum(), BlockChecksum::Sha256);
    assert_eq!(read1(&s, 14), (fixture_value(14, 6), true));
    // The superblock is still the old encoding: no checksum flag.
    let sb = std::fs::read(dir.path().join("superblock")).unwrap();
    for slot in sb.chunks(SB_SLOT) {
        assert_eq!(
            Superblock::decode(slot).unwrap().checksum,
            BlockChecksum::Sha256
        );
    }
    drop(s);
    // A flipped bit in block 3 (head layer file) is caught, and the block
    // is never returned as data.
    let data = dir.path().join("layer-2.data");
    let mut bytes = std::fs::read(&data).unwrap();
    bytes[3 * BLOCK_SIZE + 100] ^= 0x20;
    std::fs::write(&data, bytes).unwrap();
    let s = Store::open(mk()).unwrap();
    let (out, bad) = read_all(&s);
    assert_eq!(bad, vec![(3, 2)]);
    assert!(out[3 * BLOCK_SIZE..4 * BLOCK_SIZE].iter().all(|&x| x == 0));
    assert_eq!(read1(&s, 2), (fixture_value(2, 3), true));
}

#[test]
fn new_store_uses_xxh3_and_detects_corruption_and_misdirected_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let mut s = Store::create(mk(), 16, ReplicaState::Clean).unwrap();
    assert_eq!(s.checksum(), BlockChecksum::Xxh3);
    let data: Vec<u8> = (0..4).flat_map(|b| fixture_value(b, 1)).collect();
    s.write(Tag::new(1, 1), 0, 4, Some(&data)).unwrap();
    s.write(Tag::new(1, 2), 8, 1, Some(&fixture_value(8, 2)))
        .unwrap();
    s.close().unwrap();
    drop(s);
    let s = Store::open(mk()).unwrap();
    assert_eq!(s.checksum(), BlockChecksum::Xxh3);
    assert!(read_all(&s).1.is_empty());
    // The metadata holds XXH3 checksums (not SHA-256 ones).
    let meta = std::fs::read(dir.path().join("layer-1.meta")).unwrap();
    let m = BlockMeta::decode(&meta[META_SIZE..2 * META_SIZE])
        .unwrap()
        .unwrap();
    assert_eq!(m.crc, BlockChecksum::Xxh3.block(1, &fixture_value(1, 1)));
    assert_ne!(m.crc, BlockChecksum::Sha256.block(1, &fixture_value(1, 1)));
    drop(s);
    let path = dir.path().join("layer-1.data");
    let mut bytes = std::fs::read(&path).unwrap();
    // A bit flip in block 0.
    bytes[7] ^= 1;
    // A misdirected write: block 8's content (checksummed for address 8)
    // lands at block 2.
    let b8 = bytes[8 * BLOCK_SIZE..9 * BLOCK_SIZE].to_vec();
    bytes[2 * BLOCK_SIZE..3 * BLOCK_SIZE].copy_from_slice(&b8);
    std::fs::write(&path, bytes).unwrap();
    let s = Store::open(mk()).unwrap();
    let (out, bad) = read_all(&s);
    assert_eq!(bad, vec![(0, 1), (2, 1)]);
    assert!(out[..BLOCK_SIZE].iter().all(|&x| x == 0));
    assert_eq!(read1(&s, 1), (fixture_value(1, 1), true));
    assert_eq!(read1(&s, 8), (fixture_value(8, 2), true));
    // The same when a copy of the metadata entry moves with the data (the
    // address is what is checked: a block is only valid where it was put).
    assert_eq!(
        s.read_layer(1, 2, 1, true).unwrap()[0].0,
        BlockTag::Present {
            tag: Tag::new(1, 1),
            zero: false,
            valid: false
        }
    );
    for c in [BlockChecksum::Sha256, BlockChecksum::Xxh3] {
        let v = fixture_value(8, 2);
        assert_ne!(c.block(8, &v), c.block(2, &v), "{c:?}");
    }
}

/// A block that ends with a CRC32C of the rest, like the simulator's
/// values, ext4 metadata_csum blocks or btrfs headers.
fn self_checksummed(fill: u8, seq: u64) -> Vec<u8> {
    let mut b = vec![fill; BLOCK_SIZE];
    b[..8].copy_from_slice(&seq.to_le_bytes());
    let c = crc32c::crc32c(&b[..BLOCK_SIZE - 4]);
    b[BLOCK_SIZE - 4..].copy_from_slice(&c.to_le_bytes());
    b
}

#[test]
fn self_checksummed_blocks_at_one_address_get_different_checksums() {
    let a = self_checksummed(0x11, 1);
    let b = self_checksummed(0x22, 2);
    // Why not CRC32C (seed 787): CRC32C over (address, data) is the same
    // for every such block at an address.
    let crc = |lba: u64, d: &[u8]| crc32c::crc32c_append(crc32c::crc32c(&lba.to_le_bytes()), d);
    assert_eq!(crc(5, &a), crc(5, &b));
    for c in [BlockChecksum::Sha256, BlockChecksum::Xxh3] {
        for lba in [0u64, 5, 1 << 40] {
            assert_ne!(c.block(lba, &a), c.block(lba, &b), "{c:?} lba {lba}");
        }
        let mut seen = std::collections::HashSet::new();
        for seq in 0..1000u64 {
            seen.insert(c.block(5, &self_checksummed(seq as u8, seq)));
        }
        assert!(seen.len() >= 999, "{c:?}: {} distinct", seen.len());
    }
    // And in a store: a stale self-checksummed copy does not verify.
    let d = SimDisk::new(11);
    let mut s = new_store(&d, 8);
    s.write(Tag::new(1, 1), 5, 1, Some(&a)).unwrap();
    s.checkpoint().unwrap();
    let f = d.open("layer-1.data", false).unwrap();
    f.write_at(&b, 5 * BLOCK_SIZE as u64).unwrap();
    f.sync().unwrap();
    let s = Store::open(Box::new(d.clone())).unwrap();
    assert!(!read1(&s, 5).1);
}

#[test]
fn unknown_checksum_algorithm_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let s = Store::create(mk(), 8, ReplicaState::Clean).unwrap();
    drop(s);
    // Rewrite both slots as if a newer version had chosen algorithm 200.
    let path = dir.path().join("superblock");
    let mut bytes = std::fs::read(&path).unwrap();
    for slot in bytes.chunks_mut(SB_SLOT) {
        let sb = Superblock::decode(slot).unwrap();
        let enc = sb.encode().unwrap();
        let code_at = enc
            .iter()
            .rposition(|&x| x == BlockChecksum::Xxh3.code())
            .unwrap();
        slot.copy_from_slice(&enc);
        slot[code_at] = 200;
        let c = crc32c::crc32c(&slot[12..]);
        slot[8..12].copy_from_slice(&c.to_le_bytes());
    }
    std::fs::write(&path, bytes).unwrap();
    let e = Store::open(mk()).unwrap_err();
    assert!(matches!(e, Error::Corrupt(_)), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("unknown block checksum algorithm 200"),
        "{msg}"
    );
}

/// Writes one-block records until the current WAL is sealed; returns the
/// next index. Checkpoint size one record, so the WAL seals every two.
fn write_until_sealed(s: &mut Store, mut i: u64, lbas: u64, hist: &mut Vec<(u64, u8)>) -> u64 {
    while !s.checkpoint_pending() {
        let lba = i % lbas;
        let v = (i % 250) as u8 + 1;
        s.write(Tag::new(1, i), lba, 1, Some(&blk(v))).unwrap();
        hist.push((lba, v));
        i += 1;
    }
    i
}

fn durable_sb(d: &SimDisk) -> Superblock {
    let f = d.file(SB_NAME).unwrap();
    (0..2)
        .filter_map(|k| Superblock::decode(&f[k * SB_SLOT..(k + 1) * SB_SLOT]).ok())
        .max_by_key(|sb| sb.generation)
        .unwrap()
}

#[test]
fn crash_at_every_step_of_seal_job_finish_keeps_a_flushed_prefix() {
    // Steps: 0 sealed, job not run; 1 job run, not finished; 2 finished;
    // 3 finished and the next WAL sealed in turn. Then more writes to the
    // other WAL, random flushes, and a power loss that keeps, drops or
    // tears every unsynced write.
    for step in 0..4 {
        for seed in 0..60u64 {
            let d = SimDisk::new(seed);
            let mut rng = Prng::new(seed ^ 0x51ea);
            let mut s = new_store(&d, 8);
            let rec = BLOCK_SIZE as u64 + WAL_HDR as u64;
            s.set_checkpoint_bytes(rec);
            let mut hist = vec![];
            let mut flushed = 0;
            let mut i = write_until_sealed(&mut s, 1, 8, &mut hist);
            if rng.chance(0.5) {
                s.flush().unwrap();
                flushed = i - 1;
            }
            assert!(durable_sb(&d).two_wal, "seed {seed}: flag before wal.1 use");
            match step {
                0 => {}
                1 => s.run_job_only().unwrap(),
                _ => s.poll_checkpoint().unwrap(),
            }
            if step == 3 {
                i = write_until_sealed(&mut s, i, 8, &mut hist);
            }
            for _ in 0..rng.range(0, 2) {
                let lba = rng.below(8);
                let v = (i % 250) as u8 + 1;
                s.write(Tag::new(1, i), lba, 1, Some(&blk(v))).unwrap();
                hist.push((lba, v));
                if rng.chance(0.4) {
                    s.flush().unwrap();
                    flushed = i;
                }
                i += 1;
            }
            let n = i - 1;
            drop(s);
            power_loss_keeps_a_prefix(
                &d,
                &mut rng,
                &hist,
                flushed,
                n,
                &format!("step {step} seed {seed}"),
            );
            // Open checkpointed both files: older versions may open it.
            assert!(!durable_sb(&d).two_wal);
        }
    }
}

#[test]
fn blocks_in_a_sealed_wal_read_back_and_newer_writes_win() {
    for crash_before_finish in [false, true] {
        let d = SimDisk::new(7);
        let mut s = new_store(&d, 8);
        let rec = BLOCK_SIZE as u64 + WAL_HDR as u64;
        s.set_checkpoint_bytes(rec);
        let mut hist = vec![];
        let i = write_until_sealed(&mut s, 1, 4, &mut hist);
        // Reads of blocks whose newest copy is in the sealed WAL.
        for &(lba, v) in &hist {
            if hist.iter().rev().find(|h| h.0 == lba) == Some(&(lba, v)) {
                assert_eq!(read1(&s, lba), (blk(v), true), "lba {lba}");
            }
        }
        // Overwrite and trim blocks the job is about to copy.
        let (a, b) = (hist[0].0, hist[1].0);
        s.write(Tag::new(1, i), a, 1, Some(&blk(200))).unwrap();
        s.write(Tag::new(1, i + 1), b, 1, None).unwrap();
        if crash_before_finish {
            s.run_job_only().unwrap();
        } else {
            s.poll_checkpoint().unwrap();
            assert!(!s.checkpoint_pending());
        }
        assert_eq!(read1(&s, a), (blk(200), true));
        assert_eq!(read1(&s, b), (blk(0), true));
        s.flush().unwrap();
        drop(s);
        d.power_loss(&mut Prng::new(3));
        let mut s = Store::open(Box::new(d.clone())).unwrap();
        assert_eq!(s.position(), Tag::new(1, i + 1));
        assert_eq!(read1(&s, a), (blk(200), true));
        assert_eq!(read1(&s, b), (blk(0), true));
        // The older copy the job wrote is overwritten by the next checkpoint.
        s.checkpoint().unwrap();
        drop(s);
        let s = Store::open(Box::new(d.clone())).unwrap();
        assert_eq!(read1(&s, a), (blk(200), true));
        assert_eq!(read1(&s, b), (blk(0), true));
    }
}

#[test]
fn checkpoint_job_error_is_reported_and_loses_nothing() {
    let d = SimDisk::new(9);
    let mut s = new_store(&d, 8);
    let rec = BLOCK_SIZE as u64 + WAL_HDR as u64;
    s.set_checkpoint_bytes(rec);
    let mut hist = vec![];
    let i = write_until_sealed(&mut s, 1, 8, &mut hist);
    s.flush().unwrap();
    d.set_faults(crate::sim::disk::DiskFaults {
        full: true,
        ..d.faults()
    });
    assert!(s.poll_checkpoint().is_err());
    assert!(s.checkpoint_pending());
    // Operations that need it finished report the error too.
    assert!(s.snapshot(Tag::new(1, i), "s", 2).is_err());
    for &(lba, v) in &hist {
        assert_eq!(read1(&s, lba), (blk(v), true));
    }
    d.set_faults(crate::sim::disk::DiskFaults {
        full: false,
        ..d.faults()
    });
    s.poll_checkpoint().unwrap();
    assert!(!s.checkpoint_pending());
    drop(s);
    d.power_loss(&mut Prng::new(1));
    let s = Store::open(Box::new(d.clone())).unwrap();
    assert_eq!(s.position(), Tag::new(1, i - 1));
    for &(lba, v) in &hist {
        assert_eq!(read1(&s, lba), (blk(v), true));
    }
}

#[test]
fn index_entries_stay_small() {
    // 16 bytes of tag, checksum and flags, 16 of location; `None` fits in
    // the location's spare discriminant values.
    assert_eq!(std::mem::size_of::<Entry>(), 40);
    assert_eq!(std::mem::size_of::<Option<Entry>>(), 40);
}

/// The newest valid superblock in a store directory on real files.
fn durable_sb_at(dir: &std::path::Path) -> Superblock {
    let f = std::fs::read(dir.join(SB_NAME)).unwrap();
    f.chunks(SB_SLOT)
        .filter_map(|s| Superblock::decode(s).ok())
        .max_by_key(|sb| sb.generation)
        .unwrap()
}

/// Which CRC the WAL record at `off` of `wal` carries: `(over the data,
/// over the block checksums)`. Returns the record's end too.
fn wal_record_crc(wal: &[u8], off: usize, checksum: BlockChecksum) -> (bool, bool, usize) {
    let hdr = &wal[off..off + WAL_HDR];
    let h = WalHeader::decode(hdr).unwrap();
    let data = &wal[off + WAL_HDR..off + WAL_HDR + h.data_len()];
    let sums: Vec<u32> = data
        .chunks(BLOCK_SIZE)
        .zip(h.lba..)
        .map(|(b, lba)| checksum.block(lba, b))
        .collect();
    (
        WalHeader::check(hdr, data),
        WalHeader::check_sums(hdr, &sums),
        off + WAL_HDR + data.len(),
    )
}

#[test]
fn new_stores_checksum_wal_records_over_block_checksums() {
    let dir = tempfile::tempdir().unwrap();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let mut s = Store::create(mk(), 16, ReplicaState::Clean).unwrap();
    // Durable before the first record.
    assert!(durable_sb_at(dir.path()).wal_sums);
    let data: Vec<u8> = (0..4).flat_map(|b| fixture_value(b, 1)).collect();
    s.write(Tag::new(1, 1), 0, 4, Some(&data)).unwrap();
    s.write(Tag::new(1, 2), 6, 2, None).unwrap();
    s.flush().unwrap();
    drop(s); // no checkpoint: the records stay in the WAL
    let wal = std::fs::read(dir.path().join("wal")).unwrap();
    let (over_data, over_sums, end) = wal_record_crc(&wal, 0, BlockChecksum::Xxh3);
    assert!(over_sums && !over_data);
    // A record without data: the header alone, as in the old format.
    let (over_data, over_sums, _) = wal_record_crc(&wal, end, BlockChecksum::Xxh3);
    assert!(over_sums && over_data);
    let s = Store::open(mk()).unwrap();
    assert_eq!(s.position(), Tag::new(1, 2));
    for b in 0..4 {
        assert_eq!(read1(&s, b), (fixture_value(b, 1), true));
    }
    assert_eq!(s.entry(1, 6), Some((Tag::new(1, 2), true, true)));
}

#[test]
fn old_format_wal_replays_and_the_store_upgrades_at_open_and_downgrades_at_close() {
    let dir = sha256_fixture();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    // The fixture's WAL holds old-format records (CRC over the data).
    assert!(!durable_sb_at(dir.path()).wal_sums);
    let wal = std::fs::read(dir.path().join("wal")).unwrap();
    let (over_data, over_sums, _) = wal_record_crc(&wal, 0, BlockChecksum::Sha256);
    assert!(over_data && !over_sums);
    let mut s = Store::open(mk()).unwrap();
    assert_eq!(s.position(), Tag::new(1, 5));
    assert_eq!(read1(&s, 8), (fixture_expected(8), true));
    // Open checkpointed with the new format: flag durable, WAL empty.
    let sb = durable_sb_at(dir.path());
    assert!(sb.wal_sums && sb.checksum == BlockChecksum::Sha256);
    assert_eq!(std::fs::metadata(dir.path().join("wal")).unwrap().len(), 0);
    s.write(Tag::new(1, 6), 14, 1, Some(&fixture_value(14, 6)))
        .unwrap();
    s.flush().unwrap();
    drop(s); // crash: the record is only in the WAL
    let wal = std::fs::read(dir.path().join("wal")).unwrap();
    let (over_data, over_sums, _) = wal_record_crc(&wal, 0, BlockChecksum::Sha256);
    assert!(over_sums && !over_data);
    let mut s = Store::open(mk()).unwrap();
    assert_eq!(s.position(), Tag::new(1, 6));
    assert_eq!(read1(&s, 14), (fixture_value(14, 6), true));
    // A clean close goes back to the old format, encoded exactly as
    // before the flag, so older versions open the store again...
    s.close().unwrap();
    let sb = durable_sb_at(dir.path());
    assert!(!sb.wal_sums && !sb.two_wal && sb.checksum == BlockChecksum::Sha256);
    // ...and records written after it use the old format too.
    s.write(Tag::new(1, 7), 15, 1, Some(&fixture_value(15, 7)))
        .unwrap();
    s.flush().unwrap();
    drop(s);
    let wal = std::fs::read(dir.path().join("wal")).unwrap();
    let (over_data, over_sums, _) = wal_record_crc(&wal, 0, BlockChecksum::Sha256);
    assert!(over_data && !over_sums);
    let mut s = Store::open(mk()).unwrap();
    assert_eq!(s.position(), Tag::new(1, 7));
    assert_eq!(read1(&s, 15), (fixture_value(15, 7), true));
    assert_eq!(read1(&s, 14), (fixture_value(14, 6), true));
    // Closed and attached again without a restart: the attach moves the
    // store back to the new format before the next record.
    s.close().unwrap();
    assert!(!durable_sb_at(dir.path()).wal_sums);
    s.set_epoch(2, 8).unwrap();
    assert!(durable_sb_at(dir.path()).wal_sums);
    s.write(Tag::new(2, 8), 13, 1, Some(&fixture_value(13, 8)))
        .unwrap();
    s.flush().unwrap();
    drop(s);
    let wal = std::fs::read(dir.path().join("wal")).unwrap();
    let (over_data, over_sums, _) = wal_record_crc(&wal, 0, BlockChecksum::Sha256);
    assert!(over_sums && !over_data);
    let s = Store::open(mk()).unwrap();
    assert_eq!(s.position(), Tag::new(2, 8));
    assert_eq!(read1(&s, 13), (fixture_value(13, 8), true));
}

#[test]
fn torn_or_damaged_wal_record_ends_the_wal_in_both_formats() {
    // Damage to the second of three flushed records: a sector of its data
    // never written (torn), a flipped data bit, or the WAL cut inside it.
    // Either record format stops replay at that record, as the CRC over
    // the data always did: the first record stays, the rest is gone.
    for new_format in [false, true] {
        for damage in ["torn", "flip", "cut"] {
            let dir = tempfile::tempdir().unwrap();
            let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
            let mut s = Store::create(mk(), 16, ReplicaState::Clean).unwrap();
            if !new_format {
                // A clean close leaves the store in the old format.
                s.close().unwrap();
            }
            let a: Vec<u8> = (0..2).flat_map(|b| fixture_value(b, 1)).collect();
            let b: Vec<u8> = (4..8).flat_map(|b| fixture_value(b, 2)).collect();
            s.write(Tag::new(1, 1), 0, 2, Some(&a)).unwrap();
            s.write(Tag::new(1, 2), 4, 4, Some(&b)).unwrap();
            s.write(Tag::new(1, 3), 10, 1, Some(&fixture_value(10, 3)))
                .unwrap();
            s.flush().unwrap();
            drop(s);
            assert_eq!(durable_sb_at(dir.path()).wal_sums, new_format);
            let path = dir.path().join("wal");
            let mut wal = std::fs::read(&path).unwrap();
            let c = BlockChecksum::Xxh3;
            let (d, n, second) = wal_record_crc(&wal, 0, c);
            assert_eq!((d, n), (!new_format, new_format));
            let data2 = second + WAL_HDR;
            assert!(wal_record_crc(&wal, second, c).0 != new_format);
            match damage {
                "torn" => wal[data2 + 2 * BLOCK_SIZE..][..512].fill(0),
                "flip" => wal[data2 + 5000] ^= 0x04,
                _ => wal.truncate(data2 + 3 * BLOCK_SIZE + 100),
            }
            std::fs::write(&path, &wal).unwrap();
            let s = Store::open(mk()).unwrap();
            let what = format!("new format {new_format}, {damage}");
            assert_eq!(s.position(), Tag::new(1, 1), "{what}");
            let (out, bad) = read_all(&s);
            assert!(bad.is_empty(), "{what}: {bad:?}");
            assert_eq!(&out[..2 * BLOCK_SIZE], &a[..], "{what}");
            assert!(out[2 * BLOCK_SIZE..].iter().all(|&x| x == 0), "{what}");
        }
    }
}

#[test]
fn power_loss_keeps_flushed_prefix_in_the_old_wal_record_format() {
    // As above, with a store a clean close left in the old format (CRC
    // over the data) and writes after it without an attach.
    for seed in 0..300u64 {
        let d = SimDisk::new(seed);
        let mut rng = Prng::new(seed ^ 0x5eed);
        let mut s = new_store(&d, 8);
        s.close().unwrap();
        s.set_checkpoint_bytes(3 * (BLOCK_SIZE as u64 + 64));
        let mut history: Vec<(u64, u8)> = vec![];
        let n = rng.range(1, 20);
        let flushed = write_flushing(&mut s, &mut rng, n, &mut history);
        assert!(!s.sb.wal_sums, "seed {seed}");
        drop(s);
        power_loss_keeps_a_prefix(&d, &mut rng, &history, flushed, n, &format!("seed {seed}"));
    }
}

/// `n` blocks `v, v+1, ...` (one value per block).
fn blks(v: u8, n: u32) -> Vec<u8> {
    (0..n).flat_map(|k| blk(v.wrapping_add(k as u8))).collect()
}

#[test]
fn large_writes_go_to_the_extent_file_once_and_read_back_after_reopen() {
    let d = SimDisk::new(11);
    let mut s = new_store(&d, 64);
    assert!(!durable_sb(&d).extents);
    let n = EXTENT_MIN_BLOCKS;
    s.write(Tag::new(1, 1), 3, n, Some(&blks(10, n))).unwrap();
    // Below the threshold: the WAL as before.
    s.write(Tag::new(1, 2), 40, 2, Some(&blks(100, 2))).unwrap();
    assert_eq!(s.wal_bytes(), 64 + 64 + 2 * BLOCK_SIZE as u64);
    assert!(
        durable_sb(&d).extents,
        "flag durable before the first extent"
    );
    let check = |s: &Store| {
        let mut out = vec![0u8; 64 * BLOCK_SIZE];
        assert!(s.read(0, 64, &mut out).unwrap().is_empty());
        for b in 0..64u64 {
            let want = match b {
                3..19 => blk(10 + (b - 3) as u8),
                40..42 => blk(100 + (b - 40) as u8),
                _ => blk(0),
            };
            assert_eq!(
                &out[b as usize * BLOCK_SIZE..][..BLOCK_SIZE],
                &want[..],
                "{b}"
            );
        }
    };
    check(&s);
    s.flush().unwrap();
    drop(s);
    let mut s = Store::open(Box::new(d.clone())).unwrap();
    assert_eq!(s.position(), Tag::new(1, 2));
    check(&s);
    s.checkpoint().unwrap();
    drop(s);
    let s = Store::open(Box::new(d.clone())).unwrap();
    check(&s);
    assert_eq!(s.extent_usage(), (n, 0));
    // Checkpointed extent blocks are metadata only: no copy in the data file.
    let f = d.file("layer-1.data").unwrap_or_default();
    assert!(
        f.iter()
            .skip(3 * BLOCK_SIZE)
            .take(16 * BLOCK_SIZE)
            .all(|&b| b == 0)
    );
    assert!(d.file("layer-1.ext").is_some());
}

#[test]
fn small_writes_only_keep_the_old_format() {
    let d = SimDisk::new(12);
    let mut s = new_store(&d, 64);
    s.write(
        Tag::new(1, 1),
        3,
        EXTENT_MIN_BLOCKS - 1,
        Some(&blks(1, EXTENT_MIN_BLOCKS - 1)),
    )
    .unwrap();
    s.flush().unwrap();
    s.checkpoint().unwrap();
    drop(s);
    let _s = Store::open(Box::new(d.clone())).unwrap();
    assert!(!durable_sb(&d).extents);
    assert!(d.file("layer-1.ext").is_none());
}

#[test]
fn overwritten_extent_blocks_are_reused_only_after_the_checkpoint() {
    let d = SimDisk::new(13);
    let mut s = new_store(&d, 16);
    s.set_extent_threshold(2);
    s.write(Tag::new(1, 1), 0, 4, Some(&blks(1, 4))).unwrap();
    s.write(Tag::new(1, 2), 0, 4, Some(&blks(5, 4))).unwrap();
    // The first copy is still what a crash would replay or fall back to.
    assert_eq!(s.extent_usage(), (8, 0));
    s.write(Tag::new(1, 3), 8, 1, Some(&blk(9))).unwrap();
    s.write(Tag::new(1, 4), 2, 1, Some(&blk(77))).unwrap();
    assert_eq!(s.extent_usage(), (8, 0));
    s.checkpoint().unwrap();
    // Blocks 0..4 (first write) and block 6 (lba 2 of the second) free.
    assert_eq!(s.extent_usage(), (8, 5));
    s.write(Tag::new(1, 5), 10, 4, Some(&blks(20, 4))).unwrap();
    assert_eq!(s.extent_usage(), (8, 1));
    let mut out = vec![0u8; 16 * BLOCK_SIZE];
    assert!(s.read(0, 16, &mut out).unwrap().is_empty());
    let want: Vec<u8> = [
        blk(5),
        blk(6),
        blk(77),
        blk(8),
        blk(0),
        blk(0),
        blk(0),
        blk(0),
        blk(9),
        blk(0),
        blks(20, 4),
        blk(0),
        blk(0),
    ]
    .concat();
    assert_eq!(out, want);
    s.flush().unwrap();
    drop(s);
    let s = Store::open(Box::new(d.clone())).unwrap();
    let mut out2 = vec![0u8; 16 * BLOCK_SIZE];
    assert!(s.read(0, 16, &mut out2).unwrap().is_empty());
    assert_eq!(out2, want);
    // Rebuilt from the metadata at open: only block 6 is free.
    assert_eq!(s.extent_usage(), (8, 1));
}

/// Random mixed small and large writes (threshold 2 blocks) and trims
/// over 8 blocks, random flushes and seals, hole punches (extent pool of
/// 0 to 3 blocks, so free extent runs are punched and the extent file's
/// tail is cut; data-file copies of blocks that moved to the extent file
/// or were trimmed are punched), a crash before the seal's job, between
/// its punches and the superblock write, or after it, power loss (which
/// keeps, drops or tears every unsynced write and punch): the position
/// is between the last flushed write and the last write, and every block
/// holds what the writes up to it left, verifying (torn extent data ends
/// the WAL).
#[test]
fn power_loss_with_extent_writes_keeps_a_flushed_prefix() {
    let mut punched_then_crashed = 0;
    let mut ext_punched_then_crashed = 0;
    for seed in 0..400u64 {
        let d = SimDisk::new(seed);
        let mut rng = Prng::new(seed ^ 0xe47);
        let mut s = new_store(&d, 8);
        s.set_extent_threshold(2);
        s.set_extent_pool(rng.below(4) as u32);
        s.set_checkpoint_bytes(rng.range(1, 4) * 3 * BLOCK_SIZE as u64);
        // (lba, blocks, value; 0: trimmed)
        let mut hist: Vec<(u64, u32, u8)> = vec![];
        let mut flushed = 0u64;
        let n = rng.range(1, 24);
        for i in 1..=n {
            let len = rng.range(1, 5) as u32;
            let lba = rng.below(8 - u64::from(len) + 1);
            let v = if rng.chance(0.15) {
                s.write(Tag::new(1, i), lba, len, None).unwrap();
                0
            } else {
                let v = ((i * 7) % 200) as u8 + 1;
                s.write(Tag::new(1, i), lba, len, Some(&blks(v, len)))
                    .unwrap();
                v
            };
            hist.push((lba, len, v));
            if rng.chance(0.3) {
                s.flush().unwrap();
                flushed = i;
            }
            if rng.chance(0.1) {
                s.poll_checkpoint().unwrap();
            }
            if rng.chance(0.05) {
                s.checkpoint().unwrap();
            }
            if rng.chance(0.1) {
                s.idle().unwrap();
            }
        }
        // The volume went idle before the crash: its WAL sealed, then the
        // checkpoint finished and extent punches started (deferred: the
        // next call would run them).
        if rng.chance(0.5) {
            for _ in 0..2 {
                s.idle().unwrap();
            }
        }
        // Crash with the seal's job not run, run (metadata synced, holes
        // punched, not synced) but not finished, or finished.
        if s.checkpoint_pending() {
            match rng.below(3) {
                0 => {}
                1 => {
                    let punches = match &s.sealed {
                        Some(x) => x.job.punches.len(),
                        None => 0,
                    };
                    s.run_job_only().unwrap();
                    if punches > 0 {
                        punched_then_crashed += 1;
                    }
                }
                _ => s.poll_checkpoint().unwrap(),
            }
        }
        // Extent punches a finished checkpoint started: crash before or
        // after they ran (unsynced).
        if s.punch_job.is_some() && rng.chance(0.5) {
            s.finish_punch_job();
            ext_punched_then_crashed += 1;
        }
        drop(s);
        d.power_loss(&mut rng);
        let mut s = Store::open(Box::new(d.clone())).unwrap();
        let p = s.position().index;
        assert!(
            p >= flushed && p <= n,
            "seed {seed}: position {p} flushed {flushed} n {n}"
        );
        let mut expect = vec![0u8; 8 * BLOCK_SIZE];
        for &(lba, len, v) in &hist[..p as usize] {
            let data = if v == 0 {
                vec![0; len as usize * BLOCK_SIZE]
            } else {
                blks(v, len)
            };
            expect[lba as usize * BLOCK_SIZE..][..len as usize * BLOCK_SIZE].copy_from_slice(&data);
        }
        let mut out = vec![0u8; 8 * BLOCK_SIZE];
        assert!(s.read(0, 8, &mut out).unwrap().is_empty(), "seed {seed}");
        assert!(out == expect, "seed {seed}: content");
        // The store keeps working after recovery: reused extent blocks
        // must not clobber live ones.
        s.set_extent_threshold(2);
        let t = p + 1;
        s.write(Tag::new(1, t), 0, 3, Some(&blks(222, 3))).unwrap();
        s.flush().unwrap();
        drop(s);
        d.power_loss(&mut rng);
        let s = Store::open(Box::new(d.clone())).unwrap();
        expect[..3 * BLOCK_SIZE].copy_from_slice(&blks(222, 3));
        let bad = s.read(0, 8, &mut out).unwrap();
        if !bad.is_empty() {
            for l in 0..8 {
                eprintln!("{}", s.describe_block(s.layer_ids()[0], l));
            }
            eprintln!("usage {:?} p {p} hist {hist:?}", s.extent_usage());
        }
        assert!(bad.is_empty(), "seed {seed} again {bad:?}");
        assert!(out == expect, "seed {seed}: content after reuse");
    }
    assert!(
        punched_then_crashed > 20 && ext_punched_then_crashed > 20,
        "crashes after a job's punches: {punched_then_crashed}, after extent punches: \
         {ext_punched_then_crashed}"
    );
}

#[test]
fn snapshot_revert_delete_over_extent_blocks() {
    let d = SimDisk::new(14);
    let mut s = new_store(&d, 8);
    s.set_extent_threshold(2);
    s.write(Tag::new(1, 1), 0, 4, Some(&blks(1, 4))).unwrap();
    s.snapshot(Tag::new(1, 2), "s1", 2).unwrap();
    s.write(Tag::new(1, 3), 2, 4, Some(&blks(10, 4))).unwrap();
    let mut out = vec![0u8; 8 * BLOCK_SIZE];
    s.read(0, 8, &mut out).unwrap();
    assert_eq!(
        out,
        [blks(1, 2), blks(10, 4), blks(0, 0), blk(0), blk(0)].concat()
    );
    assert!(d.file("layer-2.ext").is_some());
    s.revert(Tag::new(1, 4), 1, 3).unwrap();
    assert!(d.file("layer-2.ext").is_none());
    s.read(0, 8, &mut out).unwrap();
    assert_eq!(
        out,
        [blks(1, 4), blks(0, 0), vec![0; 4 * BLOCK_SIZE]].concat()
    );
    s.snapshot(Tag::new(1, 5), "s2", 4).unwrap();
    s.write(Tag::new(1, 6), 3, 2, Some(&blks(50, 2))).unwrap();
    s.flush().unwrap();
    s.delete_snapshot(Tag::new(1, 7), 3).unwrap();
    // Layer 1's extent blocks the head lacks are merged into it as copies.
    s.delete_snapshot(Tag::new(1, 8), 1).unwrap();
    assert_eq!(s.layer_ids(), vec![4]);
    assert!(d.file("layer-1.ext").is_none());
    let want = [blks(1, 3), blks(50, 2), vec![0; 3 * BLOCK_SIZE]].concat();
    let check = |s: &Store| {
        let mut out = vec![0u8; 8 * BLOCK_SIZE];
        assert!(s.read(0, 8, &mut out).unwrap().is_empty());
        assert_eq!(out, want);
    };
    check(&s);
    drop(s);
    let s = Store::open(Box::new(d.clone())).unwrap();
    check(&s);
    let files = d.list().unwrap();
    assert!(
        !files
            .iter()
            .any(|f| !f.starts_with("layer-4.") && f.starts_with("layer-")),
        "{files:?}"
    );
}

#[test]
fn real_files_extent_writes_roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let mut s = Store::create(mk(), 1024, ReplicaState::Clean).unwrap();
    let n = 256u32;
    s.write(Tag::new(1, 1), 100, n, Some(&blks(1, n))).unwrap();
    s.flush().unwrap();
    s.checkpoint().unwrap();
    s.write(Tag::new(1, 2), 200, n, Some(&blks(9, n))).unwrap();
    s.flush().unwrap();
    drop(s);
    assert!(dir.path().join("layer-1.ext").exists());
    let s = Store::open(mk()).unwrap();
    let mut out = vec![0u8; 456 * BLOCK_SIZE];
    assert!(s.read(0, 456, &mut out).unwrap().is_empty());
    let want = [vec![0; 100 * BLOCK_SIZE], blks(1, 100), blks(9, n)].concat();
    assert!(out == want);
    // Lbas 200..356 of the first write were overwritten: their extent
    // blocks are free after open's checkpoint, the rest is live.
    assert_eq!(s.extent_usage(), (2 * n, n - 100));
}

/// Generation and tag of the record header at `off` of a WAL image.
fn wal_header_at(wal: &[u8], off: u64) -> Option<(u64, Tag)> {
    let h = WalHeader::decode(wal.get(off as usize..off as usize + WAL_HDR)?)?;
    Some((h.wal_gen, h.tag))
}

/// Writes blocks 1..=4 with `i` at index `i` (tags `first..first + 4`),
/// with a set_block of block 6 to `first * 10` as the second record (not
/// ordered: replay has no position check for it, only the generation),
/// then flushes (which seals) and finishes the seal's checkpoint.
fn four_writes_and_seal(s: &mut Store, first: u64) {
    for i in first..first + 4 {
        s.write(Tag::new(1, i), 1 + (i - 1) % 4, 1, Some(&blk(i as u8)))
            .unwrap();
        if i == first {
            let v = blk(first as u8 * 10);
            s.set_block(1, 6, SetBlock::Data(Tag::new(1, first), &v))
                .unwrap();
        }
    }
    s.flush().unwrap();
    assert!(s.checkpoint_pending());
    s.poll_checkpoint().unwrap();
    assert!(!s.checkpoint_pending());
}

#[test]
fn a_seals_checkpoint_keeps_the_wal_file_and_the_generation_after_next_overwrites_it() {
    let d = SimDisk::new(7);
    let mut s = new_store(&d, 8);
    let rec = BLOCK_SIZE as u64 + WAL_HDR as u64;
    s.set_checkpoint_bytes(3 * rec);
    let g = s.wgen;
    four_writes_and_seal(&mut s, 1);
    assert_eq!(s.cur, 1);
    // Checkpointed, superblock past its generation, file not truncated.
    assert_eq!(durable_sb(&d).wal_gen, g + 1);
    let wal = d.file("wal").unwrap();
    assert_eq!(wal.len() as u64, 5 * rec, "sealed wal keeps its length");
    assert_eq!(wal_header_at(&wal, 0), Some((g, Tag::new(1, 1))));
    four_writes_and_seal(&mut s, 5);
    assert_eq!((s.cur, s.wgen), (0, g + 2));
    assert_eq!(d.file("wal.1").unwrap().len() as u64, 5 * rec);
    // The generation after next overwrites `wal` from offset 0; the
    // older generation's records stay past its live end.
    s.write(Tag::new(1, 9), 0, 1, Some(&blk(9))).unwrap();
    assert_eq!(s.wal_bytes(), rec);
    let wal = d.file("wal").unwrap();
    assert_eq!(wal.len() as u64, 5 * rec);
    assert_eq!(wal_header_at(&wal, 0), Some((g + 2, Tag::new(1, 9))));
    assert_eq!(wal_header_at(&wal, rec).map(|h| h.0), Some(g));
    assert_eq!(wal_header_at(&wal, 2 * rec), Some((g, Tag::new(1, 2))));
    s.flush().unwrap();
    drop(s);
    // Reopen (no power loss): the live record replays, the leftovers of
    // generation g (older values of blocks 6 and 2..4) do not.
    let s = Store::open(Box::new(d.clone())).unwrap();
    assert_eq!(s.position(), Tag::new(1, 9));
    assert_eq!(read1(&s, 0), (blk(9), true));
    assert_eq!(read1(&s, 6), (blk(50), true));
    for lba in 1..=4u64 {
        assert_eq!(read1(&s, lba), (blk(lba as u8 + 4), true), "block {lba}");
    }
}

#[test]
fn a_torn_record_over_a_leftover_one_ends_the_wal_in_both_formats() {
    // `wal` holds generation g (blocks 1..4 = 1..4), `wal.1` generation
    // g + 1 (blocks 1..4 = 5..8), then `wal` is reused by g + 2: record A
    // (block 0 = 9) flushed, record B (block 2 = 11) written over the
    // leftover record of g at the same offset (a set_block of block 6 =
    // 10, which has no position check) and torn at sector granularity:
    // any mix of its old and new sectors. Replay must end at B: never B,
    // never a leftover record of g (which would bring back block 6 = 10
    // or blocks 2..4 = 2..4).
    let rec = BLOCK_SIZE as u64 + WAL_HDR as u64;
    // Sectors of B's range [rec, 2 rec): its header is in the first.
    let sectors: Vec<(u64, u64)> = {
        let mut v = vec![];
        let mut at = rec;
        while at < 2 * rec {
            let end = ((at / 512 + 1) * 512).min(2 * rec);
            v.push((at, end));
            at = end;
        }
        v
    };
    let n = sectors.len();
    let mut patterns: Vec<Vec<bool>> = vec![
        (0..n).map(|i| i != 0).collect(),     // header old, data new
        (0..n).map(|i| i != n - 1).collect(), // last data sector old
        (0..n).map(|i| i % 2 == 0).collect(), // alternating, header new
        (0..n).map(|i| i % 2 == 1).collect(), // alternating, header old
        vec![false; n],                       // nothing of B landed
    ];
    let mut rng = Prng::new(11);
    for _ in 0..20 {
        patterns.push((0..n).map(|_| rng.chance(0.5)).collect());
    }
    for new_format in [false, true] {
        for (pi, new) in patterns.iter().enumerate() {
            let d = SimDisk::new(7);
            let mut s = new_store(&d, 8);
            if !new_format {
                s.close().unwrap();
            }
            assert_eq!(s.sb.wal_sums, new_format);
            s.set_checkpoint_bytes(3 * rec);
            four_writes_and_seal(&mut s, 1);
            four_writes_and_seal(&mut s, 5);
            assert_eq!(s.cur, 0);
            s.write(Tag::new(1, 9), 0, 1, Some(&blk(9))).unwrap();
            s.flush().unwrap();
            let old = d.file("wal").unwrap();
            s.write(Tag::new(1, 10), 2, 1, Some(&blk(11))).unwrap();
            let cur = d.file("wal").unwrap();
            drop(s);
            assert_eq!(old.len(), cur.len(), "B overwrote a leftover record");
            let f = d.open("wal", false).unwrap();
            for (&(lo, hi), &landed) in sectors.iter().zip(new) {
                let src = if landed { &cur } else { &old };
                f.write_at(&src[lo as usize..hi as usize], lo).unwrap();
            }
            f.sync().unwrap();
            let what = format!("new format {new_format} pattern {pi} {new:?}");
            let s = Store::open(Box::new(d.clone())).unwrap();
            assert_eq!(s.position(), Tag::new(1, 9), "{what}");
            assert_eq!(read1(&s, 0), (blk(9), true), "{what}");
            assert_eq!(read1(&s, 6), (blk(50), true), "{what}");
            for lba in 1..=4u64 {
                assert_eq!(read1(&s, lba), (blk(lba as u8 + 4), true), "{what}: {lba}");
            }
        }
    }
}

#[test]
fn power_loss_over_reused_wal_files_keeps_a_flushed_prefix() {
    // Many seals per run (both files reused several times, records of
    // mixed sizes so new headers land on old data and old headers), seal
    // checkpoints finished at random moments, then a power loss that
    // keeps, drops or tears each unsynced write.
    let mut reused = 0;
    for seed in 0..400u64 {
        let d = SimDisk::new(seed);
        let mut rng = Prng::new(seed ^ 0x5eed);
        let mut s = new_store(&d, 8);
        if rng.chance(0.3) {
            s.close().unwrap(); // old record format
        }
        s.set_checkpoint_bytes(3 * (BLOCK_SIZE as u64 + 64));
        let mut flushed = 0u64;
        let mut history: Vec<(u64, u8)> = vec![];
        let n = rng.range(10, 60);
        for i in 1..=n {
            let lba = rng.below(8);
            let v = if rng.chance(0.3) {
                s.write(Tag::new(1, i), lba, 1, None).unwrap();
                0
            } else {
                let v = (i % 250) as u8 + 1;
                s.write(Tag::new(1, i), lba, 1, Some(&blk(v))).unwrap();
                v
            };
            history.push((lba, v));
            if rng.chance(0.3) {
                s.flush().unwrap();
                flushed = i;
            }
            if rng.chance(0.3) {
                s.poll_checkpoint().unwrap();
            }
        }
        let live = d.file(WAL_NAMES[s.cur]).unwrap().len() as u64;
        if live > s.wal_bytes() {
            reused += 1;
        }
        drop(s);
        power_loss_keeps_a_prefix(&d, &mut rng, &history, flushed, n, &format!("seed {seed}"));
    }
    assert!(
        reused > 100,
        "leftover records past the live end in {reused} runs"
    );
}

/// Bytes allocated to a file (st_blocks), 0 if it does not exist.
fn allocated(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// Bytes allocated to all files of a store directory.
fn allocated_dir(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| allocated(&e.unwrap().path()))
        .sum()
}

#[test]
fn repeated_large_overwrites_keep_the_allocated_space_bounded() {
    // A 4 MiB volume overwritten 12 times with 1 MiB writes, a flush after
    // each: checkpoint windows of 2 to 4 MiB (the production ratio of
    // window to a 512 MiB volume), an extent pool of 1 MiB.
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let mut s = Store::create(mk(), 1024, ReplicaState::Clean).unwrap();
    s.set_checkpoint_bytes(2 * MIB);
    s.set_extent_pool(256);
    let mut i = 0;
    let mut peak = 0;
    for pass in 0..12u8 {
        for k in 0..4u8 {
            i += 1;
            let v = pass.wrapping_mul(16).wrapping_add(k * 4);
            s.write(Tag::new(1, i), u64::from(k) * 256, 256, Some(&blks(v, 256)))
                .unwrap();
            s.flush().unwrap();
        }
        peak = peak.max(allocated_dir(dir.path()));
    }
    s.checkpoint().unwrap();
    let after = allocated_dir(dir.path());
    // Live data 4 MiB, metadata 32 KiB, superblock, empty WALs, the pool.
    let live = 4 * MIB;
    assert!(
        after <= live + MIB + 128 * 1024,
        "allocated {after} after the checkpoint (live {live}, pool 1 MiB)"
    );
    // Before it: also the WAL files and the extent blocks of up to two
    // checkpoint windows not yet reusable (4 MiB each at most).
    assert!(peak <= live + MIB + 8 * MIB + 2 * MIB, "peak {peak}");
    let want: Vec<u8> = (0..4u8)
        .flat_map(|k| blks(11u8.wrapping_mul(16).wrapping_add(k * 4), 256))
        .collect();
    let check = |s: &Store| {
        let mut out = vec![0u8; 1024 * BLOCK_SIZE];
        assert!(s.read(0, 1024, &mut out).unwrap().is_empty());
        assert!(out == want);
    };
    check(&s);
    drop(s);
    let s = Store::open(mk()).unwrap();
    check(&s);
    assert!(allocated_dir(dir.path()) <= live + MIB + 128 * 1024);
}

/// Calls [`Store::idle`] (punches run on a thread) until `done`; returns
/// how many calls it took.
fn idle_until(s: &mut Store, done: impl Fn() -> bool) -> u32 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut calls = 0;
    while !done() {
        assert!(std::time::Instant::now() < deadline, "idle never got there");
        s.idle().unwrap();
        calls += 1;
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    calls
}

#[test]
fn an_idle_store_gives_back_overwritten_blocks_and_its_pool() {
    // Default pool (here a quarter of the 16 MiB volume): after the
    // overwrites, idle calls checkpoint the last WAL off the write path,
    // punch what it freed, then the pool.
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let mut s = Store::create(mk(), 4096, ReplicaState::Clean).unwrap();
    s.set_checkpoint_bytes(4 * MIB);
    assert_eq!(s.extent_pool(), 1024);
    let mut t = 0;
    for pass in 0..4u8 {
        for k in 0..16u64 {
            t += 1;
            s.write(Tag::new(1, t), k * 256, 256, Some(&blks(pass, 256)))
                .unwrap();
        }
    }
    let live = 16 * MIB;
    let before = allocated_dir(dir.path());
    assert!(before > live + 4 * MIB, "{before}");
    // Live data, metadata (128 KiB), superblock; the WAL files keep
    // their size (one header per write: a few KiB).
    let calls = idle_until(&mut s, || allocated_dir(dir.path()) <= live + 256 * 1024);
    assert!(calls >= 3, "{calls} idle calls");
    let want: Vec<u8> = (0..16).flat_map(|_| blks(3, 256)).collect();
    let mut out = vec![0u8; 4096 * BLOCK_SIZE];
    assert!(s.read(0, 4096, &mut out).unwrap().is_empty());
    assert!(out == want);
    // Idle with nothing left to give back stays cheap and changes nothing.
    let (pos, sbg) = (s.position(), s.sb.generation);
    s.idle().unwrap();
    assert_eq!(
        (s.position(), s.sb.generation, s.checkpoint_pending()),
        (pos, sbg, false)
    );
    // The next stream of large writes allocates again.
    t += 1;
    s.write(Tag::new(1, t), 0, 256, Some(&blks(9, 256)))
        .unwrap();
    s.flush().unwrap();
    drop(s);
    let s = Store::open(mk()).unwrap();
    assert!(s.read(0, 4096, &mut out).unwrap().is_empty());
    assert!(out[..MIB as usize] == blks(9, 256)[..]);
    assert!(out[MIB as usize..] == want[MIB as usize..]);
}

#[test]
fn a_block_written_small_then_large_leaves_the_layer_data_file() {
    // Through a synchronous checkpoint and through a seal's job on the
    // background thread.
    for seal in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
        let data = dir.path().join("layer-1.data");
        let mut s = Store::create(mk(), 64, ReplicaState::Clean).unwrap();
        s.write(Tag::new(1, 1), 3, 1, Some(&blk(7))).unwrap();
        s.write(Tag::new(1, 2), 30, 1, Some(&blk(8))).unwrap();
        s.flush().unwrap();
        s.checkpoint().unwrap();
        assert_eq!(allocated(&data), 2 * BLOCK_SIZE as u64, "seal {seal}");
        // Block 3 moves to the extent file; block 30 stays.
        let n = EXTENT_MIN_BLOCKS;
        s.write(Tag::new(1, 3), 0, n, Some(&blks(20, n))).unwrap();
        if seal {
            s.set_checkpoint_bytes(1);
            s.flush().unwrap();
            assert!(s.checkpoint_pending());
            s.settle().unwrap();
            // Under a write stream the old copy stays; the volume going
            // idle gives it back.
            assert_eq!(allocated(&data), 2 * BLOCK_SIZE as u64);
            idle_until(&mut s, || allocated(&data) == BLOCK_SIZE as u64);
        } else {
            s.flush().unwrap();
            s.checkpoint().unwrap();
        }
        assert_eq!(allocated(&data), BLOCK_SIZE as u64, "seal {seal}");
        let check = |s: &Store| {
            let mut out = vec![0u8; 64 * BLOCK_SIZE];
            assert!(s.read(0, 64, &mut out).unwrap().is_empty());
            let want = [blks(20, n), vec![0; 14 * BLOCK_SIZE], blk(8)].concat();
            assert!(out[..31 * BLOCK_SIZE] == want[..], "seal {seal}");
        };
        check(&s);
        drop(s);
        let s = Store::open(mk()).unwrap();
        check(&s);
    }
}

#[test]
fn data_file_copies_left_by_a_killed_store_are_given_back_when_idle() {
    // Blocks move from the data file to the extent file under a stream of
    // seals (their data-file punches wait for idle), then the process is
    // killed: the reopened store does not know which copies are stale, so
    // it treats every block not kept in the data file as a candidate.
    let dir = tempfile::tempdir().unwrap();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let data = dir.path().join("layer-1.data");
    let mut s = Store::create(mk(), 256, ReplicaState::Clean).unwrap();
    s.mark_open().unwrap();
    let mut t = 0;
    for lba in 0..128 {
        t += 1;
        s.write(Tag::new(1, t), lba, 1, Some(&blk(lba as u8)))
            .unwrap();
    }
    s.flush().unwrap();
    s.checkpoint().unwrap();
    assert_eq!(allocated(&data), 128 * BLOCK_SIZE as u64);
    s.set_checkpoint_bytes(1);
    let n = EXTENT_MIN_BLOCKS;
    for lba in (0..64).step_by(n as usize) {
        t += 1;
        s.write(Tag::new(1, t), lba, n, Some(&blks(200, n)))
            .unwrap();
        s.flush().unwrap();
    }
    s.settle().unwrap();
    assert_eq!(allocated(&data), 128 * BLOCK_SIZE as u64, "punches wait");
    drop(s); // killed: no close, the superblock still says open
    let mut s = Store::open(mk()).unwrap();
    assert_eq!(allocated(&data), 128 * BLOCK_SIZE as u64);
    idle_until(&mut s, || allocated(&data) == 64 * BLOCK_SIZE as u64);
    let mut out = vec![0u8; 256 * BLOCK_SIZE];
    assert!(s.read(0, 256, &mut out).unwrap().is_empty());
    for lba in 0..256usize {
        let want = match lba {
            0..64 => 200u8.wrapping_add((lba % n as usize) as u8),
            64..128 => lba as u8,
            _ => 0,
        };
        assert!(
            out[lba * BLOCK_SIZE..][..BLOCK_SIZE]
                .iter()
                .all(|&x| x == want),
            "block {lba}"
        );
    }
}

#[test]
fn trimming_large_written_ranges_gives_the_space_back() {
    const MIB: u64 = 1 << 20;
    for pool in [0u32, 64] {
        let dir = tempfile::tempdir().unwrap();
        let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
        let ext = dir.path().join("layer-1.ext");
        let mut s = Store::create(mk(), 1024, ReplicaState::Clean).unwrap();
        s.set_extent_pool(pool);
        for k in 0..4u64 {
            s.write(Tag::new(1, k + 1), k * 256, 256, Some(&blks(k as u8, 256)))
                .unwrap();
        }
        s.flush().unwrap();
        s.checkpoint().unwrap();
        assert_eq!(allocated(&ext), 4 * MIB);
        // Trim the first three MiB (the last one stays live).
        for k in 0..3u64 {
            s.write(Tag::new(1, k + 5), k * 256, 256, None).unwrap();
        }
        s.flush().unwrap();
        s.checkpoint().unwrap();
        let pool_bytes = u64::from(pool) * BLOCK_SIZE_U64;
        assert_eq!(allocated(&ext), MIB + pool_bytes, "pool {pool}");
        // Trim the rest: only the pool stays allocated, and without one
        // the file's free tail is cut off.
        s.write(Tag::new(1, 8), 768, 256, None).unwrap();
        s.flush().unwrap();
        s.checkpoint().unwrap();
        assert_eq!(allocated(&ext), pool_bytes, "pool {pool}");
        if pool == 0 {
            assert_eq!(std::fs::metadata(&ext).unwrap().len(), 0);
        }
        let mut out = vec![1u8; 1024 * BLOCK_SIZE];
        assert!(s.read(0, 1024, &mut out).unwrap().is_empty());
        assert!(out.iter().all(|&b| b == 0));
        drop(s);
        let s = Store::open(mk()).unwrap();
        assert!(s.read(0, 1024, &mut out).unwrap().is_empty());
        assert!(out.iter().all(|&b| b == 0));
        assert!(allocated_dir(dir.path()) <= pool_bytes + 64 * 1024);
    }
}

#[test]
fn punching_never_touches_blocks_a_child_reads_through() {
    let dir = tempfile::tempdir().unwrap();
    let mk = || Box::new(disk::StdDir::new(dir.path()).unwrap());
    let ext1 = dir.path().join("layer-1.ext");
    let mut s = Store::create(mk(), 64, ReplicaState::Clean).unwrap();
    s.set_extent_threshold(2);
    s.set_extent_pool(0);
    // Layer 1: blocks 0..16 and 32..48 in its extent file (extent blocks
    // 0..32), block 20 in its data file.
    s.write(Tag::new(1, 1), 0, 16, Some(&blks(1, 16))).unwrap();
    s.write(Tag::new(1, 2), 20, 1, Some(&blk(100))).unwrap();
    s.write(Tag::new(1, 3), 32, 16, Some(&blks(50, 16)))
        .unwrap();
    // A free block in layer 1's pool (its lba 15 trimmed): punched when
    // the snapshot freezes the layer.
    s.set_extent_pool(64);
    s.write(Tag::new(1, 4), 15, 1, None).unwrap();
    s.checkpoint().unwrap();
    assert_eq!(allocated(&ext1), 32 * BLOCK_SIZE_U64);
    s.write(Tag::new(1, 5), 15, 1, Some(&blk(16))).unwrap();
    s.snapshot(Tag::new(1, 6), "s1", 2).unwrap();
    assert_eq!(allocated(&ext1), 31 * BLOCK_SIZE_U64);
    s.set_extent_pool(0);
    // The head overwrites some of it large and small, trims some, and
    // churns its own extent file.
    let mut want = [blks(1, 16), vec![0; 4 * BLOCK_SIZE], blk(100)].concat();
    want.resize(32 * BLOCK_SIZE, 0);
    want.extend(blks(50, 16));
    want.resize(64 * BLOCK_SIZE, 0);
    let mut t = 7;
    for round in 0..4u8 {
        s.write(Tag::new(1, t), 8, 8, Some(&blks(150 + round, 8)))
            .unwrap();
        s.write(Tag::new(1, t + 1), 1, 1, Some(&blk(200 + round)))
            .unwrap();
        s.write(Tag::new(1, t + 2), 40, 4, None).unwrap();
        t += 3;
        s.flush().unwrap();
        s.checkpoint().unwrap();
    }
    want[8 * BLOCK_SIZE..16 * BLOCK_SIZE].copy_from_slice(&blks(153, 8));
    want[BLOCK_SIZE..2 * BLOCK_SIZE].copy_from_slice(&blk(203));
    want[40 * BLOCK_SIZE..44 * BLOCK_SIZE].fill(0);
    // A rebuild's copy replaces one of layer 1's extent blocks: that one
    // is punched (no pool outside the head), the others stay.
    s.set_block(1, 33, SetBlock::Data(Tag::new(1, 3), &blk(99)))
        .unwrap();
    want[33 * BLOCK_SIZE..34 * BLOCK_SIZE].copy_from_slice(&blk(99));
    s.checkpoint().unwrap();
    s.checkpoint().unwrap();
    assert_eq!(allocated(&ext1), 30 * BLOCK_SIZE_U64);
    let check = |s: &Store, want: &[u8], what: &str| {
        let mut out = vec![0u8; 64 * BLOCK_SIZE];
        assert!(s.read(0, 64, &mut out).unwrap().is_empty(), "{what}");
        assert!(out == want, "{what}");
        // Every copy of every layer still verifies.
        for id in s.layer_ids() {
            for (b, (tag, _)) in s.read_layer(id, 0, 64, false).unwrap().iter().enumerate() {
                assert!(
                    !matches!(tag, BlockTag::Present { valid: false, .. }),
                    "{what}: layer {id} block {b}"
                );
            }
        }
    };
    check(&s, &want, "head");
    drop(s);
    let mut s = Store::open(mk()).unwrap();
    s.set_extent_threshold(2);
    s.set_extent_pool(0);
    check(&s, &want, "reopened");
    // Delete the snapshot (its blocks merge into the head), after a
    // snapshot of the head; then revert to that one.
    s.snapshot(Tag::new(1, t), "s2", 3).unwrap();
    s.write(Tag::new(1, t + 1), 0, 4, Some(&blks(240, 4)))
        .unwrap();
    s.delete_snapshot(Tag::new(1, t + 2), 1).unwrap();
    let mut want3 = want.clone();
    want3[..4 * BLOCK_SIZE].copy_from_slice(&blks(240, 4));
    check(&s, &want3, "after delete");
    s.checkpoint().unwrap();
    s.checkpoint().unwrap();
    s.revert(Tag::new(1, t + 3), 2, 4).unwrap();
    check(&s, &want, "after revert");
    drop(s);
    let s = Store::open(mk()).unwrap();
    check(&s, &want, "reopened after revert");
}

/// A [`SimDisk`] that checks every hole punch against the durable
/// metadata: no durable entry may refer to a punched range (a data-file
/// block whose entry is a data entry, an extent block an extent entry
/// points at). Violations are collected in `bad`.
#[derive(Debug, Clone)]
struct PunchChecker {
    disk: SimDisk,
    bad: Arc<std::sync::Mutex<Vec<String>>>,
    punched: Arc<std::sync::atomic::AtomicU64>,
}

#[derive(Debug)]
struct CheckedFile {
    inner: Box<dyn StoreFile>,
    name: String,
    dir: PunchChecker,
}

impl CheckedFile {
    fn check_punch(&self, off: u64, len: u64) {
        let (layer, ext) = match self.name.rsplit_once('.') {
            Some((l, "data")) => (l, false),
            Some((l, "ext")) => (l, true),
            _ => return,
        };
        let meta = self
            .dir
            .disk
            .durable_file(&format!("{layer}.meta"))
            .unwrap_or_default();
        let first = off / BLOCK_SIZE_U64;
        let end = (off + len).div_ceil(BLOCK_SIZE_U64);
        self.dir
            .punched
            .fetch_add(end - first, std::sync::atomic::Ordering::Relaxed);
        for (lba, raw) in meta.chunks_exact(META_SIZE).enumerate() {
            let Ok(Some(m)) = BlockMeta::decode(raw) else {
                continue;
            };
            if m.is_damaged() || m.is_zero() {
                continue;
            }
            let hit = match (ext, m.flags & META_EXTENT != 0) {
                (false, false) => (first..end).contains(&(lba as u64)),
                (true, true) => BlockMeta::extent_block(raw)
                    .is_some_and(|x| (first..end).contains(&u64::from(x))),
                _ => false,
            };
            if hit {
                self.dir.bad.lock().unwrap().push(format!(
                    "punch of {} blocks {first}..{end} under the durable entry of block {lba}",
                    self.name
                ));
            }
        }
    }
}

impl StoreFile for CheckedFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.inner.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.inner.write_at(buf, off)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        if self.name.ends_with(".ext") {
            let cur = self.inner.len()?;
            if cur > len {
                self.check_punch(len, cur - len);
            }
        }
        self.inner.set_len(len)
    }
    fn punch_hole(&self, off: u64, len: u64) -> io::Result<()> {
        self.check_punch(off, len);
        self.inner.punch_hole(off, len)
    }
}

impl StoreDir for PunchChecker {
    fn open(&self, name: &str, create: bool) -> io::Result<Box<dyn StoreFile>> {
        Ok(Box::new(CheckedFile {
            inner: self.disk.open(name, create)?,
            name: name.to_string(),
            dir: self.clone(),
        }))
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.disk.remove(name)
    }
    fn list(&self) -> io::Result<Vec<String>> {
        self.disk.list()
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.disk.sync_dir()
    }
    fn boot_id(&self) -> u64 {
        self.disk.boot_id()
    }
    fn random(&self) -> u64 {
        self.disk.random()
    }
    fn background_checkpoints(&self) -> bool {
        false
    }
}

#[test]
fn holes_are_punched_only_where_no_durable_metadata_entry_points() {
    // A block's older copy in its layer's data file may only be punched
    // once no durable metadata entry refers to it: after the write of the
    // entry that replaces it (zero, absent or extent) and a sync of the
    // metadata file; an extent block once no durable entry points at it.
    // Trims, moves to the extent file and overwrites of extent blocks,
    // through seals' jobs and synchronous checkpoints, with a pool of 0.
    let dir = PunchChecker {
        disk: SimDisk::new(21),
        bad: Arc::default(),
        punched: Arc::default(),
    };
    let mut s = Store::create(Box::new(dir.clone()), 64, ReplicaState::Clean).unwrap();
    s.set_extent_threshold(4);
    s.set_extent_pool(0);
    let mut t = 0;
    let mut next = || {
        t += 1;
        Tag::new(1, t)
    };
    for round in 0..4u64 {
        for lba in 0..12 {
            s.write(next(), lba, 1, Some(&blk(lba as u8 + 1))).unwrap();
        }
        s.write(next(), 20, 8, Some(&blks(60, 8))).unwrap();
        s.flush().unwrap();
        s.checkpoint().unwrap();
        let seal = round % 2 == 1;
        s.set_checkpoint_bytes(if seal { 1 } else { 64 << 20 });
        s.write(next(), 1, 1, None).unwrap();
        s.write(next(), 4, 6, Some(&blks(30, 6))).unwrap();
        s.write(next(), 11, 1, None).unwrap();
        s.write(next(), 22, 4, None).unwrap();
        s.set_block(1, 2, SetBlock::Absent).unwrap();
        s.flush().unwrap();
        if seal {
            assert!(s.checkpoint_pending());
            s.poll_checkpoint().unwrap();
        } else {
            s.checkpoint().unwrap();
        }
    }
    drop(s);
    let _s = Store::open(Box::new(dir.clone())).unwrap();
    let bad = dir.bad.lock().unwrap().clone();
    assert!(bad.is_empty(), "{bad:#?}");
    let punched = dir.punched.load(std::sync::atomic::Ordering::Relaxed);
    assert!(punched >= 4 * 9, "{punched} blocks punched");
}

#[test]
fn reopen_after_a_job_ran_but_did_not_finish_frees_no_live_extent_block() {
    // The job of a sealed WAL wrote the metadata entries of its extent
    // writes (synced), then the store stopped before the superblock
    // write: open replays those records over metadata that already has
    // them. An extent block may look replaced by the record that wrote
    // it; the free runs come from the index after open's checkpoint, so
    // no live block is freed (punched, reused).
    for pool in [0u32, 1] {
        let d = SimDisk::new(31);
        let mut s = new_store(&d, 16);
        s.set_extent_threshold(2);
        s.set_extent_pool(pool);
        s.write(Tag::new(1, 1), 0, 4, Some(&blks(1, 4))).unwrap();
        s.checkpoint().unwrap();
        s.write(Tag::new(1, 2), 0, 4, Some(&blks(10, 4))).unwrap();
        s.write(Tag::new(1, 3), 0, 2, Some(&blks(20, 2))).unwrap();
        s.write(Tag::new(1, 4), 8, 4, Some(&blks(30, 4))).unwrap();
        // One generation; the flush seals it.
        s.set_checkpoint_bytes(1);
        s.flush().unwrap();
        assert!(s.checkpoint_pending());
        s.run_job_only().unwrap();
        drop(s);
        let want = [
            blks(20, 2),
            blks(12, 2),
            vec![0; 4 * BLOCK_SIZE],
            blks(30, 4),
        ]
        .concat();
        for round in 0..2 {
            let mut s = Store::open(Box::new(d.clone())).unwrap();
            s.set_extent_threshold(2);
            let mut out = vec![0u8; 12 * BLOCK_SIZE];
            let bad = s.read(0, 12, &mut out).unwrap();
            assert!(bad.is_empty(), "pool {pool} round {round}: {bad:?}");
            assert!(out == want, "pool {pool} round {round}");
            // Reused free blocks must not be live ones either.
            s.write(Tag::new(1, 5 + round), 12, 4, Some(&blks(40, 4)))
                .unwrap();
            s.flush().unwrap();
        }
    }
}

#[test]
fn simulator_seeds_punch_free_extent_blocks_and_stay_clean() {
    // The simulator's 16-block volumes keep a 2-block pool: its seeds
    // punch free extent runs (after seals' checkpoints, synchronous ones
    // and at open) under crashes, power losses and disk faults.
    let before = extent_blocks_punched();
    for seed in 0..40u64 {
        for zombie in [false, true] {
            let mut cfg = crate::sim::SimConfig::new(seed);
            cfg.zombie_faults_only = zombie;
            cfg.zombie_clients = zombie;
            let r = crate::sim::run(cfg);
            assert!(r.violations.is_empty(), "seed {seed}: {:?}", r.violations);
            assert_eq!((r.acked_lost, r.divergent), (0, 0), "seed {seed}");
        }
    }
    let n = extent_blocks_punched() - before;
    println!("extent blocks punched in 80 sim runs: {n}");
    assert!(n > 0);
}

#[test]
fn extent_allocator_prefers_the_pool_and_joins_pool_and_hole_runs() {
    let d = SimDisk::new(41);
    let s = new_store(&d, 64);
    let mut l = Store::open_layer(&d, s.sb.layers[0].clone(), false).unwrap();
    l.ext_end = 20;
    // Free: 0..4 and 10..16 allocated, 4..6 and 16..20 punched.
    for b in (0..4).chain(10..16) {
        l.ext_release(b);
    }
    run_insert(&mut l.ext_holes, 4, 2);
    run_insert(&mut l.ext_holes, 16, 4);
    assert_eq!(l.ext_pool(), 10);
    // A pool run that fits first.
    assert_eq!(l.ext_alloc(5), Some(10));
    // None does: pool 0..4 and holes 4..6 form one run.
    assert_eq!(l.ext_alloc(6), Some(0));
    assert_eq!(l.ext_free, BTreeMap::from([(15, 1)]));
    assert_eq!(l.ext_holes, BTreeMap::from([(16, 4)]));
    assert_eq!(l.ext_alloc(5), Some(15));
    assert_eq!(l.ext_alloc(2), Some(20));
    assert_eq!(l.ext_end, 22);
    // Punches take the highest runs beyond the kept blocks.
    for b in 0..8 {
        l.ext_release(b);
    }
    l.ext_release(12);
    assert_eq!(l.ext_take_for_punch(3, usize::MAX), vec![(12, 1), (3, 5)]);
    assert_eq!(l.ext_free, BTreeMap::from([(0, 3)]));
    // Nothing held back is allocatable until the punch is done.
    assert_eq!(l.ext_alloc(4), Some(22));
    l.ext_punch_done(true);
    assert_eq!(l.ext_holes, BTreeMap::from([(3, 5), (12, 1)]));
    assert_eq!(l.ext_alloc(8), Some(0));
}

/// Not a test: 1 MiB sequential writes on real files (a 512 MiB fill, then
/// full overwrites, no flushes, like fio's nbd engine), printing MB/s per
/// pass, the allocated bytes and the extent blocks punched. `cargo test
/// --release -p sheaf-blockrepl --lib bench_large_overwrites -- --ignored
/// --nocapture`; `SHEAF_BENCH_PASSES` (default 4), `SHEAF_BENCH_POOL_MIB`
/// (default: the store's), `SHEAF_BENCH_DIR` (default /var/tmp).
#[test]
#[ignore]
fn bench_large_overwrites() {
    const MIB: usize = 1 << 20;
    let env = |k: &str| std::env::var(k).ok();
    let base = env("SHEAF_BENCH_DIR").unwrap_or_else(|| "/var/tmp".into());
    let passes: u64 = env("SHEAF_BENCH_PASSES")
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let dir = tempfile::tempdir_in(base).unwrap();
    let mut s = Store::create(
        Box::new(disk::StdDir::new(dir.path()).unwrap()),
        131_072,
        ReplicaState::Clean,
    )
    .unwrap();
    if let Some(p) = env("SHEAF_BENCH_POOL_MIB").and_then(|v| v.parse::<u32>().ok()) {
        s.set_extent_pool(p * 256);
    }
    // A data file as long as the volume, as sheaf-blockd creates it.
    s.resize(Tag::new(1, 1), 131_072).unwrap();
    let mut t = 1u64;
    let mut buf: Vec<u8> = (0..MIB).map(|i| (i * 31 % 251) as u8).collect();
    let punched = extent_blocks_punched();
    for pass in 0..passes {
        let start = std::time::Instant::now();
        for k in 0..512u64 {
            t += 1;
            buf[..8].copy_from_slice(&t.to_le_bytes());
            s.write(Tag::new(1, t), k * 256, 256, Some(&buf)).unwrap();
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "pass {pass}: {:.0} MB/s, {} MiB allocated, {} MiB punched",
            512.0 * MIB as f64 / secs / 1e6,
            allocated_dir(dir.path()) >> 20,
            (extent_blocks_punched() - punched) >> 8
        );
    }
    s.flush().unwrap();
    s.checkpoint().unwrap();
    println!(
        "after a checkpoint: {} MiB allocated",
        allocated_dir(dir.path()) >> 20
    );
}

#[test]
fn stale_runs_merge_overlapping_and_touching_ranges() {
    let mut r = BTreeMap::new();
    run_add(&mut r, 10, 5); // 10..15
    run_add(&mut r, 20, 5); // 20..25
    run_add(&mut r, 12, 2); // inside
    assert_eq!(
        r.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
        [(10, 5), (20, 5)]
    );
    run_add(&mut r, 15, 5); // touches both
    assert_eq!(
        r.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
        [(10, 15)]
    );
    run_add(&mut r, 0, 40); // covers all
    run_add(&mut r, 50, 0); // empty
    assert_eq!(
        r.iter().map(|(&a, &b)| (a, b)).collect::<Vec<_>>(),
        [(0, 40)]
    );
}
