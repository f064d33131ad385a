// SPDX-License-Identifier: Apache-2.0
//! Real-process fault test: three `sheaf-replica` processes on loopback,
//! killed with SIGKILL and stopped with SIGSTOP while a client writes unique
//! blocks; then restart, rebuild, and the simulator's oracle over the
//! recorded history, plus a byte-for-byte comparison of the replica stores.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::sim::oracle::{self, OpKind, OpRecord, ReadValue};
use sheaf_blockrepl::store::Store;
use sheaf_blockrepl::store::disk::StdDir;
use sheaf_blockrepl::volume::{Volume, VolumeConfig};

const BLOCKS: u64 = 128;

struct Replica {
    dir: PathBuf,
    addr: SocketAddr,
    secret: PathBuf,
    /// Volume size in blocks.
    blocks: u64,
    child: Option<Child>,
}

impl Replica {
    fn start(&mut self) {
        let child = Command::new(env!("CARGO_BIN_EXE_sheaf-replica"))
            .arg("--dir")
            .arg(&self.dir)
            .arg("--listen")
            .arg(self.addr.to_string())
            .arg("--secret-file")
            .arg(&self.secret)
            .arg("--create-size")
            .arg((self.blocks * 4096).to_string())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
    }
    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) with a pid of a child we spawned and still own.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }
    fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        self.kill9();
    }
}

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// Starts `n` replica processes of `blocks` blocks in `tmp` (`r0`, `r1`,
/// ...) sharing a secret; returns them and the secret, once they listen.
async fn start_replicas(tmp: &Path, n: usize, blocks: u64) -> (Vec<Replica>, Secret) {
    let secret_path = tmp.join("secret");
    std::fs::write(&secret_path, b"a test secret of enough bytes\n").unwrap();
    let mut reps: Vec<Replica> = (0..n)
        .map(|i| Replica {
            dir: tmp.join(format!("r{i}")),
            addr: free_addr(),
            secret: secret_path.clone(),
            blocks,
            child: None,
        })
        .collect();
    for r in &mut reps {
        r.start();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    (reps, Secret::from_file(&secret_path).unwrap())
}

/// Waits (up to 20 s) for `child` to exit after a signal.
fn wait_exit(child: &mut Child, what: &str) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        assert!(Instant::now() < deadline, "{what} ignored the signal");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn image(dir: &Path) -> Vec<(u64, u64, Vec<u8>, String)> {
    let s = Store::open(Box::new(StdDir::new(dir).unwrap())).unwrap();
    let mut out = Vec::new();
    for layer in s.layer_ids() {
        for (i, (t, d)) in s
            .read_layer(layer, 0, BLOCKS as u32, true)
            .unwrap()
            .into_iter()
            .enumerate()
        {
            out.push((layer, i as u64, d.unwrap_or_default(), format!("{t:?}")));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_and_stop_replica_processes_mid_write() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut reps, secret) = start_replicas(tmp.path(), 3, BLOCKS).await;
    let addrs: Vec<SocketAddr> = reps.iter().map(|r| r.addr).collect();
    let mut cfg = VolumeConfig::remote(&addrs, secret);
    cfg.request_timeout = Duration::from_millis(400);
    cfg.rejoin_interval = Duration::from_millis(150);
    let vol = Volume::attach(cfg).await.unwrap();

    let t0 = Instant::now();
    let now = move || t0.elapsed().as_micros() as u64;
    let writer = {
        let vol = vol.clone();
        tokio::spawn(async move {
            let mut hist: Vec<OpRecord> = Vec::new();
            let mut seq = 0u64;
            let mut x = 12345u64;
            while t0.elapsed() < Duration::from_secs(6) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let lba = (x >> 33) % BLOCKS;
                seq += 1;
                let data = Bytes::from(oracle::encode_value(0, seq, lba, 0));
                let inv = now();
                let res =
                    tokio::time::timeout(Duration::from_secs(5), vol.write(lba * 4096, data)).await;
                let ok = matches!(res, Ok(Ok(())));
                hist.push(OpRecord {
                    kind: OpKind::Write {
                        lba,
                        blocks: 1,
                        key: (0, seq),
                    },
                    invoke: inv,
                    complete: ok.then(now),
                    era: 0,
                });
                if seq.is_multiple_of(7) {
                    let inv = now();
                    let r =
                        tokio::time::timeout(Duration::from_secs(5), vol.read(lba * 4096, 4096))
                            .await;
                    if let Ok(Ok(d)) = r {
                        hist.push(OpRecord {
                            kind: OpKind::Read {
                                lba,
                                values: vec![oracle::decode_value(lba, &d)],
                            },
                            invoke: inv,
                            complete: Some(now()),
                            era: 0,
                        });
                    }
                }
                if seq.is_multiple_of(25) {
                    let inv = now();
                    let ok = matches!(
                        tokio::time::timeout(Duration::from_secs(5), vol.flush()).await,
                        Ok(Ok(()))
                    );
                    hist.push(OpRecord {
                        kind: OpKind::Flush,
                        invoke: inv,
                        complete: ok.then(now),
                        era: 0,
                    });
                }
            }
            hist
        })
    };
    // Faults while the writer runs.
    let ms = |n| tokio::time::sleep(Duration::from_millis(n));
    ms(500).await;
    reps[1].kill9();
    ms(600).await;
    reps[1].start();
    ms(700).await;
    reps[2].signal(libc::SIGSTOP);
    ms(1000).await; // longer than the request timeout
    reps[2].signal(libc::SIGCONT);
    ms(700).await;
    reps[0].kill9();
    reps[2].kill9(); // two at once: writes suspend (W = 2)
    ms(500).await;
    reps[0].start();
    reps[2].start();
    let mut hist = writer.await.unwrap();
    assert!(
        hist.iter().filter(|o| o.complete.is_some()).count() > 50,
        "too few writes completed"
    );

    // Heal: every replica back in sync.
    let mut synced = false;
    for _ in 0..200 {
        let st = vol.status().await.unwrap();
        if st.active.len() == 3 && st.rebuilding.is_empty() {
            synced = true;
            break;
        }
        ms(50).await;
    }
    assert!(
        synced,
        "replicas did not resync: {:?}",
        vol.status().await.unwrap()
    );
    // Read everything back into the history and check it.
    for lba in 0..BLOCKS {
        let inv = now();
        let d = vol.read(lba * 4096, 4096).await.unwrap();
        hist.push(OpRecord {
            kind: OpKind::Read {
                lba,
                values: vec![oracle::decode_value(lba, &d)],
            },
            invoke: inv,
            complete: Some(now()),
            era: 0,
        });
    }
    let verdict = oracle::check(&hist, 0);
    assert!(verdict.violations.is_empty(), "{:#?}", verdict.violations);
    assert_eq!(verdict.acked_lost, 0);
    let garbage = hist
        .iter()
        .filter(|o| matches!(&o.kind, OpKind::Read { values, .. } if values.contains(&ReadValue::Garbage)))
        .count();
    assert_eq!(garbage, 0);
    vol.detach().await.unwrap();
    for r in &mut reps {
        r.kill9();
    }
    let a = image(&reps[0].dir);
    for r in &reps[1..] {
        assert!(image(&r.dir) == a, "replica {} differs", r.dir.display());
    }
}

/// Bytes allocated to the files of a store directory.
fn allocated(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().map_or(0, |m| m.blocks() * 512))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_replica_processes_give_overwritten_space_back() {
    // Three `sheaf-replica` processes, a 16 MiB volume overwritten four
    // times with 1 MiB writes: each copy lands in new extent blocks, and
    // the old ones are free only after a checkpoint. The engine stays
    // attached, renewing its read leases, but sends no I/O: each replica
    // sees it is idle, checkpoints and punches the free blocks.
    const MIB: u64 = 1 << 20;
    const SIZE: u64 = 16 * MIB;
    let tmp = tempfile::tempdir().unwrap();
    let (mut reps, secret) = start_replicas(tmp.path(), 3, SIZE / 4096).await;
    let addrs: Vec<SocketAddr> = reps.iter().map(|r| r.addr).collect();
    let vol = Volume::attach(VolumeConfig::remote(&addrs, secret.clone()))
        .await
        .unwrap();
    let chunk = |pass: u64, i: u64| Bytes::from(vec![(pass * 16 + i) as u8; MIB as usize]);
    for pass in 0..4 {
        for i in 0..SIZE / MIB {
            vol.write(i * MIB, chunk(pass, i)).await.unwrap();
        }
        vol.flush().await.unwrap();
    }
    // Live data 16 MiB; the replaced copies are still allocated.
    for r in &reps {
        let a = allocated(&r.dir);
        assert!(a > SIZE + 16 * MIB, "{}: {a} allocated", r.dir.display());
    }
    // Live data, metadata (128 KiB), superblock, WAL headers.
    let deadline = Instant::now() + Duration::from_secs(30);
    for r in &reps {
        loop {
            let a = allocated(&r.dir);
            if a <= SIZE + MIB {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}: still {a} allocated",
                r.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // Nothing was lost, through the engine and after a restart.
    let check = |got: Bytes| {
        for i in 0..SIZE / MIB {
            let want = chunk(3, i);
            assert!(
                got[(i * MIB) as usize..][..MIB as usize] == want[..],
                "MiB {i}"
            );
        }
    };
    check(vol.read(0, SIZE as usize).await.unwrap());
    vol.detach().await.unwrap();
    for r in &mut reps {
        r.kill9();
        r.start();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let vol = Volume::attach(VolumeConfig::remote(&addrs, secret))
        .await
        .unwrap();
    check(vol.read(0, SIZE as usize).await.unwrap());
    vol.detach().await.unwrap();
}

#[test]
fn blockd_detaches_its_volume_on_sigterm() {
    // `sheaf-blockd` serving a local volume over NBD, stopped the way
    // service managers stop it: its store is closed cleanly (checkpointed,
    // marked closed), not left for crash recovery.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("vol");
    let sock = tmp.path().join("nbd.sock");
    let st = Command::new(env!("CARGO_BIN_EXE_sheaf-blockd"))
        .arg("create")
        .arg("--dir")
        .arg(&dir)
        .arg("--size")
        .arg((1u64 << 20).to_string())
        .status()
        .unwrap();
    assert!(st.success());
    let mut child = Command::new(env!("CARGO_BIN_EXE_sheaf-blockd"))
        .arg("nbd")
        .arg("--unix")
        .arg(&sock)
        .arg("--export")
        .arg(format!("vol={}", dir.display()))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "no NBD socket");
        assert!(child.try_wait().unwrap().is_none(), "sheaf-blockd exited");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Attached now: the superblock records it (`Store::is_marked_open`).
    // SAFETY: kill(2) with the pid of a child we spawned and still own.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = wait_exit(&mut child, "sheaf-blockd");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{status}: {err}");
    assert!(err.contains("terminated"), "{err}");
    let s = Store::open(Box::new(StdDir::new(&dir).unwrap())).unwrap();
    assert!(!s.is_marked_open(), "store left open: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_closes_its_store_on_sigterm() {
    // A replica process stopped with SIGTERM while an engine is attached:
    // its store is checkpointed and marked closed (the next start is no
    // crash recovery), and every acknowledged write is in it.
    let tmp = tempfile::tempdir().unwrap();
    let (mut reps, secret) = start_replicas(tmp.path(), 1, BLOCKS).await;
    let r = &mut reps[0];
    let vol = Volume::attach(VolumeConfig::remote(&[r.addr], secret))
        .await
        .unwrap();
    for lba in 0..BLOCKS {
        vol.write(lba * 4096, Bytes::from(vec![lba as u8 ^ 0x5a; 4096]))
            .await
            .unwrap();
    }
    vol.flush().await.unwrap();
    r.signal(libc::SIGTERM);
    let mut child = r.child.take().unwrap();
    let status = wait_exit(&mut child, "sheaf-replica");
    assert!(status.success(), "{status}");
    let s = Store::open(Box::new(StdDir::new(&r.dir).unwrap())).unwrap();
    assert!(!s.is_marked_open(), "store left open");
    let mut out = vec![0u8; BLOCKS as usize * 4096];
    assert!(s.read(0, BLOCKS as u32, &mut out).unwrap().is_empty());
    for lba in 0..BLOCKS as usize {
        assert!(
            out[lba * 4096..][..4096]
                .iter()
                .all(|&x| x == lba as u8 ^ 0x5a)
        );
    }
    drop(vol);
}
