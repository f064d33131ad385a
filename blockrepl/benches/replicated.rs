// SPDX-License-Identifier: Apache-2.0
//! Replicated volume throughput, latency and rebuild speed on loopback.
//!
//! Replica servers run in this process behind real TCP sockets on 127.0.0.1
//! with the authenticated transport; the engine talks to them exactly as to
//! remote `sheaf-replica` processes.
//!
//! ```text
//! cargo bench -p sheaf-blockrepl --bench replicated
//! ```
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::net::server::serve;
use sheaf_blockrepl::volume::{
    Volume, VolumeConfig, create_replacement_replica, create_replica, open_local_replica,
};

const SIZE: u64 = 256 << 20;

fn secret() -> Secret {
    Secret::new(*b"bench-secret-0123456789").unwrap()
}

async fn servers(dir: &std::path::Path, n: usize, fresh: bool) -> Vec<SocketAddr> {
    let mut addrs = Vec::new();
    for i in 0..n {
        let p = dir.join(format!("r{i}"));
        if fresh {
            create_replica(&p, SIZE).unwrap();
        }
        let rep = open_local_replica(&p).unwrap();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(l.local_addr().unwrap());
        tokio::spawn(serve(l, secret(), rep));
    }
    addrs
}

fn io(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut g = c.benchmark_group("replicated");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    for n in [1usize, 3] {
        let dir = tempfile::tempdir().unwrap();
        let vol = rt.block_on(async {
            let addrs = servers(dir.path(), n, true).await;
            let v = Volume::attach(VolumeConfig::remote(&addrs, secret()))
                .await
                .unwrap();
            // Fill 64 MiB so reads hit data.
            let chunk = Bytes::from(vec![0x5au8; 1 << 20]);
            for i in 0..64u64 {
                v.write(i << 20, chunk.clone()).await.unwrap();
            }
            v.flush().await.unwrap();
            v
        });
        let blk = Bytes::from(vec![7u8; 4096]);
        let mut x = 1u64;
        let mut next_lba = move || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % ((64 << 20) / 4096)
        };
        g.throughput(Throughput::Bytes(4096));
        g.bench_function(BenchmarkId::new("write_4k_qd1", n), |b| {
            b.iter(|| {
                rt.block_on(vol.write(next_lba() * 4096, blk.clone()))
                    .unwrap()
            })
        });
        g.bench_function(BenchmarkId::new("read_4k_qd1", n), |b| {
            b.iter(|| rt.block_on(vol.read(next_lba() * 4096, 4096)).unwrap())
        });
        g.throughput(Throughput::Bytes(32 * 4096));
        g.bench_function(BenchmarkId::new("write_4k_qd32", n), |b| {
            b.iter(|| {
                rt.block_on(async {
                    let futs: Vec<_> = (0..32)
                        .map(|_| vol.write(next_lba() * 4096, blk.clone()))
                        .collect();
                    for f in futs {
                        f.await.unwrap();
                    }
                })
            })
        });
        g.bench_function(BenchmarkId::new("read_4k_qd32", n), |b| {
            b.iter(|| {
                rt.block_on(async {
                    let futs: Vec<_> = (0..32).map(|_| vol.read(next_lba() * 4096, 4096)).collect();
                    for f in futs {
                        f.await.unwrap();
                    }
                })
            })
        });
        let big = Bytes::from(vec![3u8; 1 << 20]);
        g.throughput(Throughput::Bytes(1 << 20));
        g.bench_function(BenchmarkId::new("write_1m", n), |b| {
            b.iter(|| {
                rt.block_on(vol.write((next_lba() % 64) << 20, big.clone()))
                    .unwrap()
            })
        });
        g.bench_function(BenchmarkId::new("read_1m", n), |b| {
            b.iter(|| {
                rt.block_on(vol.read((next_lba() % 64) << 20, 1 << 20))
                    .unwrap()
            })
        });
        g.bench_function(BenchmarkId::new("flush", n), |b| {
            b.iter(|| rt.block_on(vol.flush()).unwrap())
        });
        rt.block_on(vol.detach()).unwrap();
    }
    g.finish();
}

/// Rebuild of a replica replaced by an empty one: 64 MiB of data copied
/// from a healthy replica on the next attach (`SHEAF_BENCH_REBUILD_MIB`
/// sets another amount; the volume is at least 4 times the data).
///
/// The source is written once; each iteration replaces replica 1 with an
/// empty store, starts fresh servers (the previous ones are stopped first:
/// two servers must never own one store directory), attaches and times
/// until the new replica is active.
fn rebuild(c: &mut Criterion) {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mib: u64 = std::env::var("SHEAF_BENCH_REBUILD_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let data = mib << 20;
    let size = SIZE.max(data * 4);
    rt.block_on(async {
        let (addrs, tasks) = servers_with_handles(dir.path(), 2, true, size).await;
        let v = Volume::attach(VolumeConfig::remote(&addrs, secret()))
            .await
            .unwrap();
        let chunk = Bytes::from(vec![0xa5u8; 1 << 20]);
        for i in 0..data >> 20 {
            v.write(i << 20, chunk.clone()).await.unwrap();
        }
        v.detach().await.unwrap();
        stop(tasks).await;
    });
    let mut g = c.benchmark_group("rebuild");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(20))
        .warm_up_time(Duration::from_secs(1));
    g.throughput(Throughput::Bytes(data));
    g.bench_function(format!("empty_replica_{mib}MiB"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += rt.block_on(async {
                    create_replacement_replica(dir.path().join("r1"), size).unwrap();
                    let (addrs, tasks) = servers_with_handles(dir.path(), 2, false, size).await;
                    let t0 = Instant::now();
                    let v = Volume::attach(VolumeConfig::remote(&addrs, secret()))
                        .await
                        .unwrap();
                    loop {
                        let st = v.status().await.unwrap();
                        if st.active.len() == 2 && st.rebuilding.is_empty() {
                            assert_eq!(st.blocks_copied, data / 4096, "{st:?}");
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    let d = t0.elapsed();
                    v.detach().await.unwrap();
                    stop(tasks).await;
                    d
                });
            }
            total
        })
    });
    g.finish();
}

async fn servers_with_handles(
    dir: &std::path::Path,
    n: usize,
    fresh: bool,
    size: u64,
) -> (Vec<SocketAddr>, Vec<tokio::task::JoinHandle<()>>) {
    let mut addrs = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..n {
        let p = dir.join(format!("r{i}"));
        if fresh {
            create_replica(&p, size).unwrap();
        }
        let rep = open_local_replica(&p).unwrap();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        addrs.push(l.local_addr().unwrap());
        tasks.push(tokio::spawn(async move {
            let _ = serve(l, secret(), rep).await;
        }));
    }
    (addrs, tasks)
}

/// Stops servers; their replica threads end once the last connection
/// (closed by the detach) is gone.
async fn stop(tasks: Vec<tokio::task::JoinHandle<()>>) {
    for t in tasks {
        t.abort();
        let _ = t.await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

criterion_group!(benches, io, rebuild);
criterion_main!(benches);
