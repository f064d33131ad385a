// SPDX-License-Identifier: Apache-2.0
//! Backups to a real S3-compatible server (issue 22 (3)): `moto_server`
//! from PyPI `moto[server]` (installed by scripts/setup), started by each
//! test on 127.0.0.1 on a free port, reached through `object_store`.
//!
//! - full backup + restore compared byte for byte, incremental moving only
//!   the changed chunks;
//! - the server cut off mid-backup (a TCP proxy in front of moto is killed,
//!   so moto keeps what it received): the backup fails, the bucket holds no
//!   manifest, the next attempt through a new proxy resumes; the moto
//!   process killed mid-backup: the backup fails within the retry budget
//!   and succeeds against a restarted server;
//! - a chunk object overwritten on the server: the restore names it;
//! - credentials: an IAM user is created on moto, then moto's
//!   authentication is switched on (`/moto-api/reset-auth`): its key
//!   restores and writes; an unknown key id and a wrong secret fail with
//!   [`BackupError::Auth`]; a missing bucket and a dead endpoint give clear
//!   errors too.
#![allow(clippy::unwrap_used)]

mod backup_common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backup_common::Vol;
use sheaf_blockrepl::backup::{
    self, BackupError, BackupOptions, BackupTarget, FileSink, Parent, RestoreOptions, S3Config,
    S3Target, StoreSnapshot,
};

const BUCKET: &str = "sheaf-backups";
const CHUNK: u64 = 256;

/// A moto_server child on a free port, killed on drop.
struct Moto {
    child: Child,
    port: u16,
    _log: tempfile::NamedTempFile,
}

fn moto_path() -> PathBuf {
    let out = Command::new("sh")
        .args(["-c", "command -v moto_server"])
        .output()
        .unwrap();
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        out.status.success() && !p.is_empty(),
        "moto_server not found: the S3 backup tests need `pip install 'moto[server]'` \
         (scripts/setup installs it)"
    );
    PathBuf::from(p)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One raw HTTP/1.1 request (moto accepts unsigned requests while its
/// authentication is off); returns the status code and the body.
fn http_full(port: u16, method: &str, path: &str, headers: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\n\
         {headers}Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, resp)
}

fn http(port: u16, method: &str, path: &str, body: &str) -> u16 {
    http_full(port, method, path, "", body).0
}

/// Creates IAM user `backup` with an allow-all policy on moto (while its
/// authentication is off) and returns its access key id and secret. Moto
/// picks the service from the credential scope of the Authorization
/// header, which it does not check yet.
fn moto_iam_user(port: u16) -> (String, String) {
    let hdr = "Authorization: AWS4-HMAC-SHA256 Credential=AKIDTEST/20261208/us-east-1/iam/\
               aws4_request, SignedHeaders=host, Signature=00\r\n\
               Content-Type: application/x-www-form-urlencoded\r\n";
    let iam = |body: &str| {
        let (st, resp) = http_full(port, "POST", "/", hdr, body);
        assert_eq!(st, 200, "{body}: {resp}");
        resp
    };
    iam("Action=CreateUser&UserName=backup&Version=2010-05-08");
    let resp = iam("Action=CreateAccessKey&UserName=backup&Version=2010-05-08");
    let field = |name: &str| {
        let open = format!("<{name}>");
        let start = resp.find(&open).unwrap() + open.len();
        let end = resp[start..].find('<').unwrap() + start;
        resp[start..end].to_string()
    };
    let (id, secret) = (field("AccessKeyId"), field("SecretAccessKey"));
    // {"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"*","Resource":"*"}]}
    let policy = "%7B%22Version%22%3A%222012-10-17%22%2C%22Statement%22%3A%5B%7B%22Effect%22%3A\
                  %22Allow%22%2C%22Action%22%3A%22%2A%22%2C%22Resource%22%3A%22%2A%22%7D%5D%7D";
    iam(&format!(
        "Action=PutUserPolicy&UserName=backup&PolicyName=all&PolicyDocument={policy}\
         &Version=2010-05-08"
    ));
    (id, secret)
}

impl Moto {
    fn start() -> Moto {
        Moto::start_on(free_port())
    }

    /// Kills the server process (its in-memory state is lost).
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn start_on(port: u16) -> Moto {
        let bin = moto_path();
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = Command::new(bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.reopen().unwrap())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap();
        let m = Moto {
            child,
            port,
            _log: log,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "moto_server did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        let st = http(port, "PUT", &format!("/{BUCKET}"), "");
        assert_eq!(st, 200, "creating the bucket");
        m
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn s3(endpoint: &str, key: &str, bucket: &str) -> Arc<dyn BackupTarget> {
    s3_with(endpoint, key, "secret-for-tests", bucket)
}

fn s3_with(endpoint: &str, key: &str, secret: &str, bucket: &str) -> Arc<dyn BackupTarget> {
    let mut cfg = S3Config::new(endpoint, bucket, key, secret);
    cfg.max_retries = 2;
    cfg.retry_timeout = Duration::from_secs(5);
    Arc::new(S3Target::new(&cfg).unwrap())
}

/// A TCP proxy in front of moto that can be cut (listener and every
/// connection dropped at once).
struct Proxy {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: u16) -> Proxy {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((mut c, _)) = l.accept().await {
                conns.spawn(async move {
                    if let Ok(mut u) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut c, &mut u).await;
                    }
                });
            }
        });
        Proxy { port, task }
    }

    fn cut(&self) {
        // Aborting the accept task drops the listener and the JoinSet,
        // which aborts every proxied connection.
        self.task.abort();
    }
}

async fn restore_file(target: &Arc<dyn BackupTarget>, id: &str) -> Result<Vec<u8>, BackupError> {
    let m = backup::load_manifest(&**target, "vol-s3", id).await?;
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img");
    let mut sink = FileSink::create(&img, m.size_blocks)?;
    backup::restore(target, "vol-s3", id, &mut sink, &RestoreOptions::default()).await?;
    Ok(std::fs::read(&img).unwrap())
}

fn mib_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / d.as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_full_incremental_round_trip() {
    let moto = Moto::start();
    let target = s3(&moto.endpoint(), "AKIDTEST", BUCKET);
    // 64 MiB, all written: 64 chunks.
    let blocks = 16384;
    let mut v = Vol::new(blocks);
    v.write(0, blocks, 1);
    v.snapshot("s1");
    let r1 = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-s3",
        &BackupOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!((r1.chunks_read, r1.chunks_written), (64, 64), "{r1:?}");
    eprintln!(
        "full backup of 64 MiB to moto: {:?} ({:.0} MiB/s)",
        r1.duration,
        mib_s(r1.bytes_read, r1.duration)
    );
    let t0 = Instant::now();
    assert!(restore_file(&target, &r1.id).await.unwrap() == v.snapshot_bytes("s1"));
    eprintln!(
        "restore of 64 MiB from moto: {:?} ({:.0} MiB/s)",
        t0.elapsed(),
        mib_s(64 << 20, t0.elapsed())
    );

    // 1 % of the blocks (164), in 4 runs touching 4 chunks.
    for (c, n) in [(3u64, 41u64), (17, 41), (40, 41), (63, 41)] {
        v.write(c * CHUNK + 7, n, 2);
    }
    v.snapshot("s2");
    let r2 = backup::backup(
        &StoreSnapshot::new(&v.store, "s2").unwrap(),
        &target,
        "vol-s3",
        &BackupOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(r2.parent.as_deref(), Some(r1.id.as_str()));
    assert_eq!(
        (r2.chunks_read, r2.chunks_written, r2.chunks_reused),
        (4, 4, 60),
        "{r2:?}"
    );
    eprintln!("incremental (1 % of 64 MiB): {:?}", r2.duration);
    assert!(restore_file(&target, &r2.id).await.unwrap() == v.snapshot_bytes("s2"));

    // The catalog from a new client of the same bucket.
    let fresh = s3(&moto.endpoint(), "AKIDOTHER", BUCKET);
    let cat = backup::list(&*fresh, "vol-s3").await.unwrap();
    assert_eq!(cat.len(), 2);
    assert_eq!(cat[1].snapshot.name, "s2");
    // Delete the full one: the incremental still restores.
    backup::delete(&*fresh, "vol-s3", &r1.id).await.unwrap();
    let gc = backup::gc(&*fresh, "vol-s3", Duration::ZERO).await.unwrap();
    assert_eq!((gc.chunks_deleted, gc.chunks_kept), (4, 64), "{gc:?}");
    assert!(restore_file(&fresh, &r2.id).await.unwrap() == v.snapshot_bytes("s2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_server_cut_mid_backup_leaves_no_manifest() {
    let moto = Moto::start();
    let blocks = 8192; // 32 chunks
    let mut v = Vol::new(blocks);
    v.write(0, blocks, 1);
    v.snapshot("s1");
    let proxy = Proxy::start(moto.port).await;
    let via_proxy = s3(
        &format!("http://127.0.0.1:{}", proxy.port),
        "AKIDTEST",
        BUCKET,
    );
    let direct = s3(&moto.endpoint(), "AKIDTEST", BUCKET);
    // 32 MiB at 16 MiB/s: ~2 s; cut once 3 chunks are uploaded.
    let (tx, mut rx) = tokio::sync::watch::channel(Default::default());
    let opts = BackupOptions {
        parent: Parent::Full,
        throttle_bytes_per_sec: Some(16 << 20),
        progress: Some(tx),
        ..BackupOptions::default()
    };
    let snap = StoreSnapshot::new(&v.store, "s1").unwrap();
    let cut = async {
        let _ = rx
            .wait_for(|p: &backup::BackupProgress| p.bytes_written >= 3 << 20)
            .await;
        proxy.cut();
    };
    let t0 = Instant::now();
    let (res, ()) = tokio::join!(backup::backup(&snap, &via_proxy, "vol-s3", &opts), cut);
    let err = res.unwrap_err();
    eprintln!("backup failed after {:?}: {err}", t0.elapsed());
    assert!(matches!(err, BackupError::Target { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30));
    // No manifest on the server: nothing a restore would trust.
    assert!(backup::list(&*direct, "vol-s3").await.unwrap().is_empty());
    let partial = direct.list("volumes/vol-s3/chunks/").await.unwrap().len() as u64;
    assert!(partial > 0 && partial < 32, "{partial} chunks uploaded");
    // A new attempt through a new proxy resumes: uploads only the rest.
    let proxy2 = Proxy::start(moto.port).await;
    let via2 = s3(
        &format!("http://127.0.0.1:{}", proxy2.port),
        "AKIDTEST",
        BUCKET,
    );
    let r = backup::backup(&snap, &via2, "vol-s3", &BackupOptions::default())
        .await
        .unwrap();
    assert_eq!(r.chunks_deduped, partial, "{r:?}");
    assert_eq!(r.chunks_written, 32 - partial, "{r:?}");
    assert!(restore_file(&direct, &r.id).await.unwrap() == v.snapshot_bytes("s1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_server_process_killed_mid_backup() {
    let mut moto = Moto::start();
    let port = moto.port;
    let target = s3(&moto.endpoint(), "AKIDTEST", BUCKET);
    let blocks = 8192;
    let mut v = Vol::new(blocks);
    v.write(0, blocks, 1);
    v.snapshot("s1");
    let (tx, mut rx) = tokio::sync::watch::channel(Default::default());
    let opts = BackupOptions {
        throttle_bytes_per_sec: Some(16 << 20),
        progress: Some(tx),
        ..BackupOptions::default()
    };
    let snap = StoreSnapshot::new(&v.store, "s1").unwrap();
    let t0 = Instant::now();
    let kill = async {
        let _ = rx
            .wait_for(|p: &backup::BackupProgress| p.bytes_written >= 3 << 20)
            .await;
        moto.kill();
    };
    let (res, ()) = tokio::join!(backup::backup(&snap, &target, "vol-s3", &opts), kill);
    let err = res.unwrap_err();
    eprintln!("backup failed after {:?}: {err}", t0.elapsed());
    assert!(matches!(err, BackupError::Target { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30));
    // A new server on the same address (moto keeps nothing): the same
    // client backs up and restores.
    let _moto = Moto::start_on(port);
    assert!(backup::list(&*target, "vol-s3").await.unwrap().is_empty());
    let r = backup::backup(&snap, &target, "vol-s3", &BackupOptions::default())
        .await
        .unwrap();
    assert_eq!(r.chunks_written, 32, "{r:?}");
    assert!(restore_file(&target, &r.id).await.unwrap() == v.snapshot_bytes("s1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_corrupted_chunk_is_named() {
    let moto = Moto::start();
    let target = s3(&moto.endpoint(), "AKIDTEST", BUCKET);
    let mut v = Vol::new(2048);
    v.write(0, 2048, 1);
    v.snapshot("s1");
    let r = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-s3",
        &BackupOptions::default(),
    )
    .await
    .unwrap();
    let m = backup::load_manifest(&*target, "vol-s3", &r.id)
        .await
        .unwrap();
    let victim = &m.chunks[5];
    let key = format!(
        "volumes/vol-s3/chunks/{}/{}",
        &victim.sha256[..2],
        victim.sha256
    );
    let mut obj = target.get(&key).await.unwrap().to_vec();
    obj[100] ^= 1;
    target.put(&key, obj.into()).await.unwrap();
    let err = restore_file(&target, &r.id).await.unwrap_err();
    match &err {
        BackupError::CorruptChunk { index, key: k, .. } => {
            assert_eq!((*index, k.as_str()), (5, key.as_str()));
        }
        e => panic!("expected CorruptChunk, got {e}"),
    }
    eprintln!("{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_wrong_credentials_and_bad_targets() {
    let moto = Moto::start();
    let (key_id, secret) = moto_iam_user(moto.port);
    let mut v = Vol::new(512);
    v.write(0, 512, 1);
    v.snapshot("s1");
    let snap = StoreSnapshot::new(&v.store, "s1").unwrap();
    let good = s3_with(&moto.endpoint(), &key_id, &secret, BUCKET);
    let r = backup::backup(&snap, &good, "vol-s3", &BackupOptions::default())
        .await
        .unwrap();
    // Authentication on from the next request: only that user's key works.
    // Limit: with authentication on, moto 5.2 answers SignatureDoesNotMatch
    // to object_store's ListObjectsV2 with a prefix even for a valid key
    // (PUT, GET and an unprefixed list verify; boto3's list_objects_v2 with
    // a prefix fails the same way against moto: a moto bug), so
    // under authentication the valid key is shown restoring (GETs) and
    // writing, not running a whole backup (which lists).
    let st = http(moto.port, "POST", "/moto-api/reset-auth", "0");
    assert_eq!(st, 200, "switching moto's authentication on");
    assert!(restore_file(&good, &r.id).await.unwrap() == v.snapshot_bytes("s1"));
    backup::check_target(&*good).await.unwrap();
    // An unknown key id, and the right id with a wrong secret.
    for (id, sec) in [
        ("AKIAWRONGKEY0000", secret.as_str()),
        (&key_id, "wrong-secret"),
    ] {
        let wrong = s3_with(&moto.endpoint(), id, sec, BUCKET);
        let err = backup::backup(&snap, &wrong, "vol-s3", &BackupOptions::default())
            .await
            .unwrap_err();
        eprintln!("{err}");
        assert!(matches!(err, BackupError::Auth { .. }), "{err}");
        assert!(err.to_string().contains("refused the credentials"), "{err}");
        let err = backup::list(&*wrong, "vol-s3").await.unwrap_err();
        assert!(matches!(err, BackupError::Auth { .. }), "{err}");
        let err = restore_file(&wrong, &r.id).await.unwrap_err();
        assert!(matches!(err, BackupError::Auth { .. }), "{err}");
        let err = backup::check_target(&*wrong).await.unwrap_err();
        assert!(matches!(err, BackupError::Auth { .. }), "{err}");
    }

    // Authentication off again: a missing bucket is named.
    let st = http(moto.port, "POST", "/moto-api/reset-auth", "inf");
    assert_eq!(st, 200);
    let nobucket = s3(&moto.endpoint(), "AKIDTEST", "no-such-bucket");
    let err = backup::backup(&snap, &nobucket, "vol-s3", &BackupOptions::default())
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(err.to_string().contains("no-such-bucket"), "{err}");
    let err = backup::check_target(&*nobucket).await.unwrap_err();
    assert!(err.to_string().contains("no-such-bucket"), "{err}");

    // Nothing listening: a target error within the retry budget.
    let dead = s3(
        &format!("http://127.0.0.1:{}", free_port()),
        "AKIDTEST",
        BUCKET,
    );
    let t0 = Instant::now();
    let err = backup::backup(&snap, &dead, "vol-s3", &BackupOptions::default())
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(matches!(err, BackupError::Target { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(20));
}

/// Throughput on this machine (run by hand: `--ignored --nocapture`):
/// a fresh full backup of a 1 GiB volume to moto, a 1 % incremental, and
/// a restore.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn s3_throughput_1gib() {
    let moto = Moto::start();
    let target = s3(&moto.endpoint(), "AKIDTEST", BUCKET);
    let blocks = 262_144;
    let mut v = Vol::new(blocks);
    v.write(0, blocks, 1);
    v.snapshot("s1");
    let r1 = backup::backup(
        &StoreSnapshot::new(&v.store, "s1").unwrap(),
        &target,
        "vol-s3",
        &BackupOptions::default(),
    )
    .await
    .unwrap();
    eprintln!(
        "full 1 GiB: {:?} ({:.0} MiB/s)",
        r1.duration,
        mib_s(r1.bytes_read, r1.duration)
    );
    // 1 % of the blocks, in runs of 64 blocks spread over the volume.
    let mut lba = 0;
    while lba + 64 <= blocks {
        v.write(lba, 64, 2);
        lba += 6400;
    }
    v.snapshot("s2");
    let r2 = backup::backup(
        &StoreSnapshot::new(&v.store, "s2").unwrap(),
        &target,
        "vol-s3",
        &BackupOptions::default(),
    )
    .await
    .unwrap();
    eprintln!(
        "incremental 1 %: {:?}, {} chunks read, {} written",
        r2.duration, r2.chunks_read, r2.chunks_written
    );
    let t0 = Instant::now();
    let bytes = restore_file(&target, &r2.id).await.unwrap();
    eprintln!(
        "restore 1 GiB: {:?} ({:.0} MiB/s)",
        t0.elapsed(),
        mib_s(1 << 30, t0.elapsed())
    );
    assert!(bytes == v.snapshot_bytes("s2"));
}
