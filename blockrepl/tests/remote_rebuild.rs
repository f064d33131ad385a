// SPDX-License-Identifier: Apache-2.0
//! A replaced replica behind the TCP transport is rebuilt on the next attach.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::net::server::serve;
use sheaf_blockrepl::volume::{
    Volume, VolumeConfig, create_replacement_replica, create_replica, open_local_replica,
};

fn secret() -> Secret {
    Secret::new(*b"test-secret-0123456789").unwrap()
}

async fn servers(dir: &std::path::Path, n: usize) -> Vec<std::net::SocketAddr> {
    let mut addrs = Vec::new();
    for i in 0..n {
        let rep = open_local_replica(&dir.join(format!("r{i}"))).unwrap();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(l.local_addr().unwrap());
        tokio::spawn(serve(l, secret(), rep));
    }
    addrs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replaced_remote_replica_is_rebuilt() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("sheaf_blockrepl=info")
        .with_test_writer()
        .try_init();
    let dir = tempfile::tempdir().unwrap();
    for i in 0..2 {
        create_replica(dir.path().join(format!("r{i}")), 8 << 20).unwrap();
    }
    let addrs = servers(dir.path(), 2).await;
    let v = Volume::attach(VolumeConfig::remote(&addrs, secret()))
        .await
        .unwrap();
    for i in 0..8u64 {
        v.write(i << 20, Bytes::from(vec![i as u8 + 1; 1 << 20]))
            .await
            .unwrap();
    }
    v.detach().await.unwrap();
    create_replacement_replica(dir.path().join("r1"), 8 << 20).unwrap();
    let addrs = servers(dir.path(), 2).await;
    let mut cfg = VolumeConfig::remote(&addrs, secret());
    cfg.attach_timeout = Duration::from_secs(5);
    let v = Volume::attach(cfg).await.unwrap();
    for _ in 0..500 {
        let st = v.status().await.unwrap();
        if st.active.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let st = v.status().await.unwrap();
    assert_eq!(st.active.len(), 2, "{st:?}");
    assert_eq!(st.blocks_copied, 2048, "{st:?}");
    for i in 0..8u64 {
        assert!(
            v.read(i << 20, 1 << 20)
                .await
                .unwrap()
                .iter()
                .all(|&b| b == i as u8 + 1)
        );
    }
}
