// SPDX-License-Identifier: Apache-2.0
//! Backups of store snapshots to a directory target (issue 22 (2)/(3)):
//! full and incremental backups restored byte for byte, dedup, holes,
//! delete/gc/retain without breaking incrementals, a target that fails
//! mid-backup (no manifest; the next attempt resumes), a corrupted chunk
//! (named on restore), progress and throttling.
#![allow(clippy::unwrap_used)]

mod backup_common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use backup_common::{Vol, block};
use bytes::Bytes;
use sheaf_blockrepl::backup::{
    self, BackupError, BackupOptions, BackupTarget, DirectoryTarget, FileSink, MemoryTarget,
    ObjectInfo, Parent, RestoreOptions, StoreSink, StoreSnapshot,
};
use sheaf_blockrepl::store::Store;
use sheaf_blockrepl::store::disk::StdDir;
use sheaf_blockrepl::types::ReplicaState;
use sheaf_blockrepl::{BLOCK_SIZE, Tag};

/// 16 MiB volume: 4096 blocks, 16 chunks of 1 MiB.
const BLOCKS: u64 = 4096;
const CHUNK: u64 = 256;

fn dir_target() -> (
    tempfile::TempDir,
    Arc<DirectoryTarget>,
    Arc<dyn BackupTarget>,
) {
    let d = tempfile::tempdir().unwrap();
    let t = Arc::new(DirectoryTarget::new(d.path().join("target")).unwrap());
    let dynt: Arc<dyn BackupTarget> = t.clone();
    (d, t, dynt)
}

/// Restores `id` into a fresh store and returns its bytes.
async fn restore_bytes(target: &Arc<dyn BackupTarget>, id: &str) -> Vec<u8> {
    let m = backup::load_manifest(&**target, "vol-a", id).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::create(
        Box::new(StdDir::new(dir.path()).unwrap()),
        m.size_blocks,
        ReplicaState::Clean,
    )
    .unwrap();
    let mut sink = StoreSink::new(&mut store, Tag::new(1, 1));
    backup::restore(target, "vol-a", id, &mut sink, &RestoreOptions::default())
        .await
        .unwrap();
    let mut out = vec![0u8; m.size_blocks as usize * BLOCK_SIZE];
    assert!(
        store
            .read(0, m.size_blocks as u32, &mut out)
            .unwrap()
            .is_empty()
    );
    out
}

fn full() -> BackupOptions {
    BackupOptions {
        parent: Parent::Full,
        ..BackupOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_and_incremental_round_trip() {
    let mut v = Vol::new(BLOCKS);
    // Chunks 0..12 written; 12..16 never written (holes); chunk 5 zeroed.
    v.write(0, 12 * CHUNK, 1);
    let t = v.tag();
    v.store.write(t, 5 * CHUNK, CHUNK as u32, None).unwrap();
    v.snapshot("s1");
    let (_d, _dt, target) = dir_target();

    let r1 = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-a",
        &full(),
    )
    .await
    .unwrap();
    assert_eq!(r1.chunks_total, 16);
    assert_eq!(r1.holes, 5, "{r1:?}");
    assert_eq!(r1.chunks_written, 11, "{r1:?}");
    assert_eq!(r1.chunks_read, 12, "unwritten chunks are not read: {r1:?}");
    assert_eq!(restore_bytes(&target, &r1.id).await, v.snapshot_bytes("s1"));

    // ~1 %: 41 blocks in two places (chunks 2 and 9), plus a hole filled.
    v.write(2 * CHUNK + 10, 20, 2);
    v.write(9 * CHUNK + 100, 21, 2);
    v.write(14 * CHUNK, 1, 2);
    v.snapshot("s2");
    let r2 = backup::backup(
        &StoreSnapshot::new(&v.store, "s2").unwrap(),
        &target,
        "vol-a",
        &BackupOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(r2.parent.as_deref(), Some(r1.id.as_str()));
    assert_eq!(r2.chunks_read, 3, "only changed chunks are read: {r2:?}");
    assert_eq!(r2.chunks_written, 3, "{r2:?}");
    assert_eq!(r2.chunks_reused, 9, "{r2:?}");
    assert_eq!(r2.bytes_read, 3 * CHUNK * BLOCK_SIZE as u64);
    assert_eq!(restore_bytes(&target, &r2.id).await, v.snapshot_bytes("s2"));
    // The older backup is still the old snapshot.
    assert_eq!(restore_bytes(&target, &r1.id).await, v.snapshot_bytes("s1"));

    // The catalog comes from the target alone.
    let cat = backup::list(&*target, "vol-a").await.unwrap();
    let ids: Vec<_> = cat.iter().map(|m| m.id.clone()).collect();
    assert_eq!(ids, vec![r1.id.clone(), r2.id.clone()]);
    assert_eq!(cat[1].snapshot.name, "s2");

    // Delete the parent: the incremental still restores; gc keeps its
    // chunks and removes only what s1 alone used (old chunks 2 and 9).
    backup::delete(&*target, "vol-a", &r1.id).await.unwrap();
    let gc = backup::gc(&*target, "vol-a", Duration::ZERO).await.unwrap();
    assert_eq!(gc.chunks_deleted, 2, "{gc:?}");
    assert_eq!(restore_bytes(&target, &r2.id).await, v.snapshot_bytes("s2"));
    assert!(matches!(
        backup::delete(&*target, "vol-a", &r1.id).await,
        Err(BackupError::NotFound { .. })
    ));

    // Incremental from the (deleted-parent) r2 still works; retain(1)
    // keeps only the newest and everything still restores.
    v.write(0, 1, 3);
    v.snapshot("s3");
    let r3 = backup::backup(
        &StoreSnapshot::new(&v.store, "s3").unwrap(),
        &target,
        "vol-a",
        &BackupOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!((r3.chunks_read, r3.chunks_written), (1, 1), "{r3:?}");
    let (deleted, _) = backup::retain(&*target, "vol-a", 1, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(deleted, vec![r2.id.clone()]);
    assert_eq!(restore_bytes(&target, &r3.id).await, v.snapshot_bytes("s3"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_file_sink_and_sparse() {
    let mut v = Vol::new(BLOCKS);
    // Chunks 1 and 7 hold the same content: one object.
    let mut data = Vec::new();
    for b in 0..CHUNK {
        data.extend_from_slice(&block(b));
    }
    for c in [1u64, 7] {
        let t = v.tag();
        v.store
            .write(t, c * CHUNK, CHUNK as u32, Some(&data))
            .unwrap();
    }
    v.snapshot("s1");
    let (_d, dt, target) = dir_target();
    backup::check_target(&*target).await.unwrap();
    let r = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-a",
        &full(),
    )
    .await
    .unwrap();
    assert_eq!(
        (r.chunks_read, r.chunks_written, r.chunks_deduped),
        (2, 1, 1)
    );
    let chunks = dt.list("volumes/vol-a/chunks/").await.unwrap();
    assert_eq!(chunks.len(), 1);
    // A second full backup of the same snapshot uploads nothing.
    let r2 = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-a",
        &full(),
    )
    .await
    .unwrap();
    assert_eq!(r2.chunks_written, 0, "{r2:?}");

    let out = tempfile::tempdir().unwrap();
    let img = out.path().join("restored.img");
    let mut sink = FileSink::create(&img, BLOCKS).unwrap();
    backup::restore(
        &target,
        "vol-a",
        &r.id,
        &mut sink,
        &RestoreOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read(&img).unwrap(), v.snapshot_bytes("s1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incremental_after_resize() {
    // 1000 blocks: the last chunk is partial (232 blocks).
    let mut v = Vol::new(1000);
    v.write(0, 1000, 1);
    v.snapshot("s1");
    let (_d, _dt, target) = dir_target();
    let r1 = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-a",
        &full(),
    )
    .await
    .unwrap();
    let t = v.tag();
    v.store.resize(t, 1300).unwrap();
    v.write(1200, 50, 2);
    v.snapshot("s2");
    let r2 = backup::backup(
        &StoreSnapshot::new(&v.store, "s2").unwrap(),
        &target,
        "vol-a",
        &BackupOptions::default(),
    )
    .await
    .unwrap();
    // Chunks 0-2 reused; chunk 3 (was partial) and the new chunk 4 read.
    assert_eq!(r2.chunks_total, 6, "{r2:?}");
    assert_eq!((r2.chunks_reused, r2.chunks_read), (3, 3), "{r2:?}");
    assert_eq!(restore_bytes(&target, &r2.id).await, v.snapshot_bytes("s2"));
    assert_eq!(
        restore_bytes(&target, &r1.id).await.len(),
        1000 * BLOCK_SIZE
    );
}

/// Fails every put after the first `ok` ones (a target that dies).
#[derive(Debug)]
struct FailingTarget {
    inner: DirectoryTarget,
    ok: u64,
    puts: AtomicU64,
}

#[async_trait::async_trait]
impl BackupTarget for FailingTarget {
    async fn put(&self, key: &str, data: Bytes) -> Result<(), BackupError> {
        if self.puts.fetch_add(1, Ordering::SeqCst) >= self.ok {
            return Err(BackupError::Target {
                target: self.describe(),
                op: "put",
                key: key.into(),
                source: "injected failure".into(),
            });
        }
        self.inner.put(key, data).await
    }
    async fn get(&self, key: &str) -> Result<Bytes, BackupError> {
        self.inner.get(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackupError> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, key: &str) -> Result<(), BackupError> {
        self.inner.delete(key).await
    }
    fn describe(&self) -> String {
        "failing".into()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_failing_mid_backup_leaves_no_manifest_and_resumes() {
    let mut v = Vol::new(BLOCKS);
    v.write(0, BLOCKS, 1);
    v.snapshot("s1");
    let (_d, dt, target) = dir_target();
    let failing: Arc<dyn BackupTarget> = Arc::new(FailingTarget {
        inner: (*dt).clone(),
        ok: 6,
        puts: AtomicU64::new(0),
    });
    let opts = BackupOptions {
        concurrency: 1,
        ..full()
    };
    let snap = StoreSnapshot::new(&v.store, "s1").unwrap();
    let err = backup::backup(&snap, &failing, "vol-a", &opts)
        .await
        .unwrap_err();
    assert!(matches!(err, BackupError::Target { .. }), "{err}");
    // No manifest: the catalog is empty, nothing to restore.
    assert!(backup::list(&*target, "vol-a").await.unwrap().is_empty());
    let partial = dt.list("volumes/vol-a/chunks/").await.unwrap().len();
    assert_eq!(partial, 6);
    // gc leaves the chunks of a backup that may still be running alone.
    let gc = backup::gc(&*target, "vol-a", Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!((gc.chunks_young, gc.chunks_deleted), (6, 0), "{gc:?}");
    // The next attempt uploads only what is missing.
    let r = backup::backup(&snap, &target, "vol-a", &full())
        .await
        .unwrap();
    assert_eq!(r.chunks_deduped, 6, "{r:?}");
    assert_eq!(r.chunks_written, 10, "{r:?}");
    assert_eq!(restore_bytes(&target, &r.id).await, v.snapshot_bytes("s1"));
    let gc = backup::gc(&*target, "vol-a", Duration::ZERO).await.unwrap();
    assert_eq!((gc.chunks_kept, gc.chunks_deleted), (16, 0), "{gc:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parent_snapshot_gone_and_restore_over_data() {
    let mut v = Vol::new(BLOCKS);
    v.write(0, 8 * CHUNK, 1);
    v.snapshot("s1");
    let (_d, _dt, target) = dir_target();
    let r1 = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-a",
        &full(),
    )
    .await
    .unwrap();
    v.write(3 * CHUNK, 1, 2);
    v.snapshot("s2");
    // The parent's snapshot is deleted from the store: the store cannot
    // say what changed, so every present chunk is read, but only the
    // changed one is new content.
    let s1 = v.store.info().layers[0].id;
    let t = v.tag();
    v.store.delete_snapshot(t, s1).unwrap();
    let r2 = backup::backup(
        &StoreSnapshot::new(&v.store, "s2").unwrap(),
        &target,
        "vol-a",
        &BackupOptions {
            parent: Parent::Id(r1.id.clone()),
            ..BackupOptions::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(r2.parent.as_deref(), Some(r1.id.as_str()));
    assert_eq!(
        (r2.chunks_read, r2.chunks_written, r2.chunks_deduped),
        (8, 1, 7),
        "{r2:?}"
    );
    let want = v.snapshot_bytes("s2");
    assert_eq!(restore_bytes(&target, &r2.id).await, want);

    // Restore over a store that holds other data, holes included.
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::create(
        Box::new(StdDir::new(dir.path()).unwrap()),
        BLOCKS,
        ReplicaState::Clean,
    )
    .unwrap();
    let junk = vec![0xa5u8; 64 * BLOCK_SIZE];
    for lba in (0..BLOCKS).step_by(512) {
        store
            .write(Tag::new(1, lba + 1), lba, 64, Some(&junk))
            .unwrap();
    }
    let mut sink = StoreSink::new(&mut store, Tag::new(1, BLOCKS + 1));
    let opts = RestoreOptions {
        zero_holes: true,
        ..RestoreOptions::default()
    };
    backup::restore(&target, "vol-a", &r2.id, &mut sink, &opts)
        .await
        .unwrap();
    let mut out = vec![0u8; BLOCKS as usize * BLOCK_SIZE];
    assert!(store.read(0, BLOCKS as u32, &mut out).unwrap().is_empty());
    assert!(out == want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_chunk_is_named_on_restore() {
    let mut v = Vol::new(BLOCKS);
    v.write(0, 4 * CHUNK, 1);
    v.snapshot("s1");
    let (_d, dt, target) = dir_target();
    let r = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-a",
        &full(),
    )
    .await
    .unwrap();
    let m = backup::load_manifest(&*target, "vol-a", &r.id)
        .await
        .unwrap();
    let victim = &m.chunks[2];
    let key = format!(
        "volumes/vol-a/chunks/{}/{}",
        &victim.sha256[..2],
        victim.sha256
    );
    let path = dt.path_of(&key).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();

    let out = tempfile::tempdir().unwrap();
    let mut sink = FileSink::create(&out.path().join("img"), BLOCKS).unwrap();
    let err = backup::restore(
        &target,
        "vol-a",
        &r.id,
        &mut sink,
        &RestoreOptions::default(),
    )
    .await
    .unwrap_err();
    match &err {
        BackupError::CorruptChunk { index, key: k, .. } => {
            assert_eq!(*index, 2);
            assert_eq!(k, &key);
        }
        e => panic!("expected CorruptChunk, got {e}"),
    }
    assert!(err.to_string().contains(&victim.sha256), "{err}");

    // A missing chunk is named too.
    std::fs::remove_file(&path).unwrap();
    let err = backup::restore(
        &target,
        "vol-a",
        &r.id,
        &mut sink,
        &RestoreOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, BackupError::CorruptChunk { index: 2, .. }),
        "{err}"
    );
    // A damaged manifest is named.
    let mkey = format!("volumes/vol-a/backups/{}.json", r.id);
    std::fs::write(dt.path_of(&mkey).unwrap(), b"{\"format\": 1").unwrap();
    let err = backup::list(&*target, "vol-a").await.unwrap_err();
    assert!(
        matches!(&err, BackupError::CorruptManifest { key, .. } if *key == mkey),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_throttle_and_damaged_source() {
    let mut v = Vol::new(BLOCKS);
    v.write(0, 8 * CHUNK, 1);
    v.snapshot("s1");
    let (_d, _dt, target) = dir_target();
    let (tx, rx) = tokio::sync::watch::channel(Default::default());
    let opts = BackupOptions {
        throttle_bytes_per_sec: Some(16 << 20),
        progress: Some(tx),
        ..full()
    };
    let t0 = Instant::now();
    let r = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-a",
        &opts,
    )
    .await
    .unwrap();
    // 8 MiB at 16 MiB/s.
    assert!(
        t0.elapsed() >= Duration::from_millis(450),
        "{:?}",
        t0.elapsed()
    );
    let p = rx.borrow().clone();
    assert!(p.done);
    assert_eq!(p.chunks_done, 16);
    assert_eq!(p.bytes_read, r.bytes_read);
    assert_eq!(p.bytes_written, r.bytes_written);

    // A damaged block in the snapshot fails the backup, naming it.
    let layer = v.store.info().layers[0].id;
    let t = v.tag();
    v.store.mark_damaged(layer, 300, t).unwrap();
    let err = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-a",
        &full(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, BackupError::SourceDamaged { lba: 300, .. }),
        "{err}"
    );
    assert_eq!(backup::list(&*target, "vol-a").await.unwrap().len(), 1);
}

/// Throughput on this machine (run by hand: `--ignored --nocapture`): a
/// fresh full backup of a 1 GiB volume to a directory, a 1 % incremental
/// and a restore into a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn dir_throughput_1gib() {
    let blocks = 262_144u64;
    let mut v = Vol::new(blocks);
    for lba in (0..blocks).step_by(1024) {
        v.write(lba, 1024, 1);
    }
    v.snapshot("s1");
    let mib = |b: u64, d: Duration| b as f64 / f64::from(1 << 20) / d.as_secs_f64();
    // The engine alone: read, hash, compress, into memory.
    let mem: Arc<dyn BackupTarget> = Arc::new(MemoryTarget::new());
    let r0 = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &mem,
        "vol-a",
        &full(),
    )
    .await
    .unwrap();
    eprintln!(
        "memory full 1 GiB: {:?} ({:.0} MiB/s)",
        r0.duration,
        mib(r0.bytes_read, r0.duration)
    );
    drop(mem);
    let (_d, _dt, target) = dir_target();
    let r1 = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-a",
        &full(),
    )
    .await
    .unwrap();
    eprintln!(
        "dir full 1 GiB: {:?} ({:.0} MiB/s), {} MiB stored",
        r1.duration,
        mib(r1.bytes_read, r1.duration),
        r1.bytes_written >> 20
    );
    // 1 % of the blocks, in runs of 64 blocks spread over the volume.
    for lba in (0..blocks - 64).step_by(6400) {
        v.write(lba, 64, 2);
    }
    v.snapshot("s2");
    let r2 = backup::backup(
        &StoreSnapshot::new(&v.store, "s2").unwrap(),
        &target,
        "vol-a",
        &BackupOptions::default(),
    )
    .await
    .unwrap();
    eprintln!(
        "dir incremental 1 %: {:?}, {} chunks read, {} written",
        r2.duration, r2.chunks_read, r2.chunks_written
    );
    let out = tempfile::tempdir().unwrap();
    let img = out.path().join("img");
    let t0 = Instant::now();
    let mut sink = FileSink::create(&img, blocks).unwrap();
    backup::restore(
        &target,
        "vol-a",
        &r2.id,
        &mut sink,
        &RestoreOptions::default(),
    )
    .await
    .unwrap();
    eprintln!(
        "dir restore 1 GiB: {:?} ({:.0} MiB/s)",
        t0.elapsed(),
        mib(1 << 30, t0.elapsed())
    );
    assert!(std::fs::read(&img).unwrap() == v.snapshot_bytes("s2"));
}
