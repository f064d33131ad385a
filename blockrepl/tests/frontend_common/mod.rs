// SPDX-License-Identifier: Apache-2.0
//! Helpers shared by the frontend tests: volumes (one local replica, or
//! three replica servers on loopback that can be killed), an NBD server on
//! a unix socket, and running real client programs.
#![allow(clippy::unwrap_used, dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use sheaf_blockrepl::frontend::Disk;
use sheaf_blockrepl::frontend::nbd::{Export, NbdConfig, NbdServer, NbdStats};
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::net::server::serve;
use sheaf_blockrepl::volume::{Volume, VolumeConfig, create_replica, open_local_replica};
use tokio::runtime::Runtime;

/// A multi-threaded runtime for servers and volumes.
pub fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Whether `tool` is installed; prints a SKIP line if not.
pub fn have(tool: &str) -> bool {
    if sheaf_testkit::which(tool).is_some() {
        return true;
    }
    eprintln!("SKIP: {tool} is not installed (scripts/setup installs it)");
    false
}

/// Runs a command, asserting success; returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = output(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command and returns its output, whatever the status.
pub fn output(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"))
}

/// The NBD URI of export `name` on unix socket `sock`.
pub fn uri(sock: &Path, name: &str) -> String {
    format!("nbd+unix:///{name}?socket={}", sock.display())
}

/// One replica server in its own runtime: dropping the runtime is the
/// replica's node dying (its connections close mid-stream).
pub struct ReplicaNode {
    pub dir: PathBuf,
    pub addr: SocketAddr,
    rt: Option<Runtime>,
}

/// `n` replica stores, each served on loopback by the core's
/// authenticated transport.
pub struct Cluster {
    pub nodes: Vec<ReplicaNode>,
    pub secret: Secret,
}

impl Cluster {
    pub fn start(root: &Path, n: usize, size: u64) -> Cluster {
        let secret = Secret::new(b"frontend-test-secret-0123456789".to_vec()).unwrap();
        let nodes = (0..n)
            .map(|i| {
                let dir = root.join(format!("replica{i}"));
                create_replica(&dir, size).unwrap();
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                    .unwrap();
                let replica = open_local_replica(&dir).unwrap();
                let listener = rt
                    .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
                    .unwrap();
                let addr = listener.local_addr().unwrap();
                let s = secret.clone();
                rt.spawn(async move {
                    let _ = serve(listener, s, replica).await;
                });
                ReplicaNode {
                    dir,
                    addr,
                    rt: Some(rt),
                }
            })
            .collect();
        Cluster { nodes, secret }
    }

    pub fn config(&self) -> VolumeConfig {
        let addrs: Vec<SocketAddr> = self.nodes.iter().map(|n| n.addr).collect();
        let mut cfg = VolumeConfig::remote(&addrs, self.secret.clone());
        cfg.request_timeout = Duration::from_secs(2);
        cfg
    }

    /// Kills replica `i`: its server and connections vanish at once.
    pub fn kill(&mut self, i: usize) {
        if let Some(rt) = self.nodes[i].rt.take() {
            rt.shutdown_background();
        }
        // Give the store thread a moment to see its handles dropped.
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Reads `len` bytes at `offset` from replica store `dir` alone (attach it
/// as a one-replica volume): proves the data is on that replica.
pub fn read_replica(dir: &Path, offset: u64, len: usize) -> Vec<u8> {
    let rt = runtime();
    rt.block_on(async {
        let vol = Volume::attach(VolumeConfig::local(dir)).await.unwrap();
        let d = vol.read(offset, len).await.unwrap().to_vec();
        vol.detach().await.unwrap();
        d
    })
}

/// An NBD server with one export on a unix socket.
pub struct NbdFixture {
    pub rt: Runtime,
    pub server: NbdServer,
    pub disk: Disk,
    pub sock: PathBuf,
    pub cluster: Option<Cluster>,
    pub tmp: tempfile::TempDir,
}

impl NbdFixture {
    /// Export `vol0` of `size` bytes: one local replica, or `replicas`
    /// replica servers on loopback.
    pub fn new(size: u64, replicas: usize) -> NbdFixture {
        Self::with_config(size, replicas, NbdConfig::default())
    }

    pub fn with_config(size: u64, replicas: usize, cfg: NbdConfig) -> NbdFixture {
        let tmp = tempfile::tempdir().unwrap();
        let rt = runtime();
        let (vol, cluster) = if replicas <= 1 {
            let dir = tmp.path().join("vol0");
            create_replica(&dir, size).unwrap();
            let v = rt
                .block_on(Volume::attach(VolumeConfig::local(&dir)))
                .unwrap();
            (v, None)
        } else {
            let c = Cluster::start(tmp.path(), replicas, size);
            let v = rt.block_on(Volume::attach(c.config())).unwrap();
            (v, Some(c))
        };
        let disk = Disk::new(vol);
        let server = NbdServer::new(cfg);
        server
            .add_export("vol0", Export::new(disk.clone()).description("test volume"))
            .unwrap();
        let sock = tmp.path().join("nbd.sock");
        let listener = {
            let _g = rt.enter();
            NbdServer::bind_unix(&sock).unwrap()
        };
        let s = server.clone();
        rt.spawn(async move { s.serve_unix(listener).await });
        NbdFixture {
            rt,
            server,
            disk,
            sock,
            cluster,
            tmp,
        }
    }

    pub fn uri(&self) -> String {
        uri(&self.sock, "vol0")
    }

    /// Waits (up to 10 s) until at most `open` connections are active and
    /// returns the counters then: a closed connection's counters are final
    /// once `active` no longer counts it, which can be just after its client
    /// saw the close.
    pub fn stats_once_active_at_most(&self, open: u64) -> NbdStats {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let st = self.server.stats();
            if st.active <= open || std::time::Instant::now() > deadline {
                return st;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Reads through the volume handle (not through NBD).
    pub fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        self.rt
            .block_on(self.disk.read(offset, len))
            .unwrap()
            .to_vec()
    }

    /// Flushes and detaches the volume (before checking replicas alone).
    pub fn detach(&self) {
        self.rt.block_on(async {
            self.disk.flush().await.unwrap();
            self.disk.volume().clone().detach().await.unwrap();
        });
    }
}
