// SPDX-License-Identifier: Apache-2.0
//! Runs an etcd member (the `etcd` binary from Debian's etcd-server) for a
//! single-machine control plane and for tests.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::super::{MAX_OBJECT_BYTES, StoreError, StoreResult};

/// A running etcd member; killed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    child: Child,
    /// Its client URL.
    pub client_url: String,
    /// Its data directory.
    pub data_dir: PathBuf,
}

fn free_port() -> StoreResult<u16> {
    let l = TcpListener::bind("127.0.0.1:0")
        .map_err(|e| StoreError::Backend(format!("no free port: {e}")))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| StoreError::Backend(e.to_string()))
}

impl EtcdServer {
    /// Starts a one-member etcd on free loopback ports with its data in
    /// `data_dir` (created 0700), and waits until it accepts clients.
    pub fn start_single(data_dir: &Path) -> StoreResult<Self> {
        let etcd = Path::new("/usr/bin/etcd");
        if !etcd.exists() {
            return Err(StoreError::Backend(
                "etcd is not installed (Debian package etcd-server; run scripts/setup)".into(),
            ));
        }
        std::fs::create_dir_all(data_dir)
            .map_err(|e| StoreError::Backend(format!("{}: {e}", data_dir.display())))?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| StoreError::Backend(format!("{}: {e}", data_dir.display())))?;
        }
        let (cport, pport) = (free_port()?, free_port()?);
        let client_url = format!("http://127.0.0.1:{cport}");
        let peer_url = format!("http://127.0.0.1:{pport}");
        let log = std::fs::File::create(data_dir.join("etcd.log"))
            .map_err(|e| StoreError::Backend(format!("etcd log: {e}")))?;
        let child = Command::new(etcd)
            .arg("--name=sheaf0")
            .arg(format!("--data-dir={}", data_dir.join("member").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=sheaf0={peer_url}"))
            .arg(format!("--max-request-bytes={}", MAX_OBJECT_BYTES * 2))
            .arg("--max-txn-ops=10000")
            .arg("--auto-compaction-mode=periodic")
            .arg("--auto-compaction-retention=5m")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| StoreError::Backend(format!("starting etcd: {e}")))?;
        let mut me = Self {
            child,
            client_url,
            data_dir: data_dir.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", cport)).is_ok() {
                return Ok(me);
            }
            if let Ok(Some(st)) = me.child.try_wait() {
                return Err(StoreError::Backend(format!(
                    "etcd exited ({st}); see {}",
                    data_dir.join("etcd.log").display()
                )));
            }
            if Instant::now() > deadline {
                return Err(StoreError::Backend("etcd did not start within 20 s".into()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the member now (`kill -9`), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}
