// SPDX-License-Identifier: Apache-2.0
//! End-to-end tests of the Volume API over local replicas.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use sheaf_blockrepl::Error;
use sheaf_blockrepl::volume::{
    BlockingVolume, ReplicaTarget, Volume, VolumeConfig, create_replacement_replica, create_replica,
};

fn block(v: u8) -> Bytes {
    Bytes::from(vec![v; 4096])
}

#[tokio::test]
async fn single_local_replica_read_write_flush_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r0");
    create_replica(&p, 1 << 20).unwrap();
    let vol = Volume::attach(VolumeConfig::local(&p)).await.unwrap();
    assert_eq!(vol.size(), 1 << 20);
    vol.write(4096, block(1)).await.unwrap();
    vol.write(8192, Bytes::from(vec![2u8; 8192])).await.unwrap();
    vol.trim(8192, 4096).await.unwrap();
    vol.flush().await.unwrap();
    let r = vol.read(0, 16384).await.unwrap();
    assert_eq!(&r[..4096], &[0u8; 4096][..]);
    assert_eq!(&r[4096..8192], &[1u8; 4096][..]);
    assert_eq!(&r[8192..12288], &[0u8; 4096][..]);
    assert_eq!(&r[12288..], &[2u8; 4096][..]);
    // Bad input: a clear error, nothing stored is lost.
    assert!(matches!(
        vol.write(1, block(9)).await,
        Err(Error::Unaligned { .. })
    ));
    assert!(matches!(
        vol.read(1 << 20, 4096).await,
        Err(Error::OutOfRange { .. })
    ));
    vol.detach().await.unwrap();
    let vol = Volume::attach(VolumeConfig::local(&p)).await.unwrap();
    let st = vol.status().await.unwrap();
    assert_eq!(st.epoch, 2, "each attach takes a higher epoch");
    let r = vol.read(4096, 4096).await.unwrap();
    assert_eq!(&r[..], &[1u8; 4096][..]);
}

#[tokio::test]
async fn three_local_replicas_snapshots_resize_and_rebuild() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("sheaf_blockrepl=debug")
        .with_test_writer()
        .try_init();
    let dir = tempfile::tempdir().unwrap();
    let paths: Vec<_> = (0..3).map(|i| dir.path().join(format!("r{i}"))).collect();
    for p in &paths {
        create_replica(p, 64 * 4096).unwrap();
    }
    let cfg = VolumeConfig::new(
        paths.iter().cloned().map(ReplicaTarget::Local).collect(),
        None,
    );
    let vol = Volume::attach(cfg.clone()).await.unwrap();
    vol.write(0, block(1)).await.unwrap();
    vol.snapshot("s1").await.unwrap();
    vol.write(0, block(2)).await.unwrap();
    vol.write(4096, block(3)).await.unwrap();
    assert_eq!(vol.snapshots().await.unwrap().len(), 1);
    assert!(
        vol.snapshot("s1").await.is_err(),
        "duplicate snapshot name refused"
    );
    vol.revert("s1").await.unwrap();
    assert_eq!(&vol.read(0, 4096).await.unwrap()[..], &[1u8; 4096][..]);
    let got = vol.read(4096, 4096).await.unwrap();
    assert!(
        got.iter().all(|&b| b == 0),
        "block 1 after revert: {} {:?}",
        got[0],
        vol.status().await.unwrap()
    );
    vol.snapshot("s2").await.unwrap();
    vol.write(4096, block(4)).await.unwrap();
    vol.delete_snapshot("s1").await.unwrap();
    assert_eq!(&vol.read(0, 8192).await.unwrap()[..4096], &[1u8; 4096][..]);
    vol.resize(128 * 4096).await.unwrap();
    assert_eq!(vol.size(), 128 * 4096);
    vol.write(100 * 4096, block(5)).await.unwrap();
    assert!(vol.resize(4096).await.is_err(), "shrink refused");
    wait_all_active(&vol, 3).await;
    vol.detach().await.unwrap();

    // Replace replica 2 with an empty one: the next attach rebuilds it.
    create_replacement_replica(&paths[2], 64 * 4096).unwrap();
    let vol = Volume::attach(cfg.clone()).await.unwrap();
    wait_all_active(&vol, 3).await;
    let st = vol.status().await.unwrap();
    assert!(st.rebuilds_done >= 1);
    assert_eq!(
        &vol.read(100 * 4096, 4096).await.unwrap()[..],
        &[5u8; 4096][..]
    );
    let rep = vol.scrub().await.unwrap();
    assert_eq!(rep.bad, 0);
    assert_eq!(rep.divergent, 0);
    assert_eq!(vol.snapshots().await.unwrap().len(), 1);
    vol.detach().await.unwrap();
}

async fn wait_all_active(vol: &Volume, n: usize) {
    for _ in 0..500 {
        let st = vol.status().await.unwrap();
        if st.active.len() == n && st.rebuilding.is_empty() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("replicas not in sync: {:?}", vol.status().await.unwrap());
}

#[test]
fn blocking_volume_from_a_plain_thread() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r0");
    create_replica(&p, 1 << 20).unwrap();
    let vol = BlockingVolume::attach(VolumeConfig::local(&p)).unwrap();
    let t = std::thread::spawn(move || {
        vol.write(0, &[9u8; 8192]).unwrap();
        vol.flush().unwrap();
        let mut buf = vec![0u8; 8192];
        vol.read(0, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 9));
        vol.detach().unwrap();
    });
    t.join().unwrap();
}

/// Issue 18 item 6: epochs never wrap. A control plane asking for an epoch
/// above u64::MAX (here `min_epoch = u64::MAX`) gets a clear attach error at
/// once instead of an engine that wraps to epoch 0 — which every fenced
/// engine would outrank — and the replica still attaches normally after.
#[tokio::test]
async fn epoch_at_its_maximum_refuses_to_attach_and_never_wraps() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r0");
    create_replica(&p, 1 << 20).unwrap();
    let vol = Volume::attach(VolumeConfig::local(&p)).await.unwrap();
    vol.write(0, block(7)).await.unwrap();
    vol.flush().await.unwrap();
    vol.detach().await.unwrap();
    let mut cfg = VolumeConfig::local(&p);
    cfg.min_epoch = u64::MAX;
    cfg.attach_timeout = std::time::Duration::from_secs(30);
    let t = std::time::Instant::now();
    let e = match Volume::attach(cfg).await {
        Ok(_) => panic!("attached above u64::MAX"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("fenced while attaching"), "{e}");
    assert!(
        t.elapsed() < std::time::Duration::from_secs(20),
        "not a timeout: {e}"
    );
    let vol = Volume::attach(VolumeConfig::local(&p)).await.unwrap();
    let r = vol.read(0, 4096).await.unwrap();
    assert_eq!(&r[..], &[7u8; 4096][..]);
    vol.detach().await.unwrap();
}
