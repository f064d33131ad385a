// SPDX-License-Identifier: Apache-2.0
//! Replicated volumes for blocking callers, and in-process replica servers.
//!
//! A [`VolumeHandle`] owns a small tokio runtime (one worker) that runs the
//! volume's engine; its byte-granular `read`/`write` (read-modify-write of
//! partial 4 KiB blocks) block the calling thread, which must not be a
//! runtime worker. Handles are cheap clones of one attached volume; the last
//! clone to go (including a VM disk made with [`VolumeHandle::backend`])
//! flushes and detaches.
//!
//! A [`ReplicaServer`] serves one replica store over authenticated TCP from
//! this process, the same server as the `sheaf-replica` binary, so a
//! three-replica volume can be set up by a test or an example alone.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use sheaf_blockrepl::frontend::disk::Disk;
use sheaf_blockrepl::frontend::vmm::VolumeBackend;
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::proto::engine::Phase;
use sheaf_blockrepl::volume::{ReplicaTarget, Volume, VolumeConfig};
use sheaf_vmm::BlockBackend;
use tokio::runtime::Runtime;

use crate::error::{Error, Result};

/// Creates an empty replica store of `size_bytes` (a positive multiple of
/// 4096) at `path`, replacing any store there. Every replica of a new
/// volume is created this way.
pub fn create_replica(path: &Path, size_bytes: u64) -> Result<()> {
    sheaf_blockrepl::volume::create_replica(path, size_bytes).map_err(Error::volume("create"))
}

/// Parses a replica location: `tcp://HOST:PORT` is a replica server,
/// anything else a local store directory.
pub fn parse_replica(s: &str) -> Result<ReplicaTarget> {
    if let Some(addr) = s.strip_prefix("tcp://") {
        let a = addr
            .to_socket_addrs()
            .map_err(|e| Error::InvalidArgument(format!("replica address {addr:?}: {e}")))?
            .next()
            .ok_or_else(|| {
                Error::InvalidArgument(format!("replica address {addr:?} resolves to nothing"))
            })?;
        Ok(ReplicaTarget::Remote(a))
    } else if s.is_empty() {
        Err(Error::InvalidArgument("empty replica location".into()))
    } else {
        Ok(ReplicaTarget::Local(PathBuf::from(s)))
    }
}

/// How to open a volume.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// Shared secret of the replica servers (at least 16 bytes); needed
    /// when any replica is remote.
    pub secret: Option<Vec<u8>>,
    /// Replicas that must hold a write before it completes (default
    /// `min(2, N)`).
    pub min_write_replicas: Option<usize>,
    /// How long attaching may take (default 10 s).
    pub attach_timeout: Option<Duration>,
}

fn runtime(name: &str) -> Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(Error::io("start async runtime"))
}

struct Inner {
    // Field order matters: the disk and volume drop before the runtime.
    disk: Disk,
    vol: Volume,
    replicas: usize,
    rt: Option<Runtime>,
}

impl Inner {
    fn rt(&self) -> &Runtime {
        // Present from construction until drop.
        self.rt
            .as_ref()
            .unwrap_or_else(|| unreachable!("runtime is taken only in drop"))
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            let vol = self.vol.clone();
            let res = rt.block_on(async move {
                vol.flush().await?;
                vol.detach().await
            });
            if let Err(e) = res
                && !matches!(e, sheaf_blockrepl::Error::Detached)
            {
                tracing::warn!(error = %e, "volume detach on close failed");
            }
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// An attached volume. Clones share it; see the module docs.
#[derive(Clone)]
pub struct VolumeHandle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for VolumeHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeHandle")
            .field("size", &self.size())
            .field("replicas", &self.inner.replicas)
            .finish()
    }
}

/// A snapshot of a volume's engine, for monitoring.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VolumeStatus {
    /// `probing`, `attaching`, `running`, `fenced` or `detached`.
    pub phase: &'static str,
    /// The epoch this engine holds.
    pub epoch: u64,
    /// Volume size in bytes.
    pub size_bytes: u64,
    /// Number of replicas configured.
    pub replicas: usize,
    /// Indexes of the in-sync replicas.
    pub active: Vec<usize>,
    /// Indexes of replicas being rebuilt.
    pub rebuilding: Vec<usize>,
    /// Rebuilds completed since attach.
    pub rebuilds_done: u64,
    /// Block copies repaired since attach.
    pub repairs: u64,
}

impl VolumeHandle {
    /// Attaches a volume over `replicas` (see [`parse_replica`]).
    pub fn open(replicas: &[ReplicaTarget], opts: &OpenOptions) -> Result<VolumeHandle> {
        let secret = opts
            .secret
            .clone()
            .map(Secret::new)
            .transpose()
            .map_err(Error::volume("open"))?;
        if secret.is_none()
            && replicas
                .iter()
                .any(|r| matches!(r, ReplicaTarget::Remote(_)))
        {
            return Err(Error::InvalidArgument(
                "remote replicas need the replication secret".into(),
            ));
        }
        let mut cfg = VolumeConfig::new(replicas.to_vec(), secret);
        cfg.min_write_replicas = opts.min_write_replicas;
        if let Some(t) = opts.attach_timeout {
            cfg.attach_timeout = t;
        }
        let rt = runtime("sheaf-volume")?;
        let vol = rt
            .block_on(Volume::attach(cfg))
            .map_err(Error::volume("attach"))?;
        tracing::debug!(
            replicas = replicas.len(),
            size = vol.size(),
            "volume attached"
        );
        Ok(VolumeHandle {
            inner: Arc::new(Inner {
                disk: Disk::new(vol.clone()),
                vol,
                replicas: replicas.len(),
                rt: Some(rt),
            }),
        })
    }

    /// Attaches the single local replica at `path`.
    pub fn open_local(path: &Path) -> Result<VolumeHandle> {
        VolumeHandle::open(
            &[ReplicaTarget::Local(path.to_path_buf())],
            &OpenOptions::default(),
        )
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.vol.size()
    }

    /// Reads `buf.len()` bytes at `offset` (any alignment).
    pub fn read_into(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let data = self
            .inner
            .rt()
            .block_on(self.inner.disk.read(offset, buf.len()))
            .map_err(Error::volume("read"))?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    /// Reads `len` bytes at `offset`.
    pub fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read_into(offset, &mut v)?;
        Ok(v)
    }

    /// Writes `data` at `offset` (any alignment). Durable after
    /// [`flush`](Self::flush).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.inner
            .rt()
            .block_on(self.inner.disk.write(offset, Bytes::copy_from_slice(data)))
            .map_err(Error::volume("write"))
    }

    /// Makes completed writes durable on every in-sync replica.
    pub fn flush(&self) -> Result<()> {
        self.inner
            .rt()
            .block_on(self.inner.disk.flush())
            .map_err(Error::volume("flush"))
    }

    /// Engine status.
    pub fn status(&self) -> Result<VolumeStatus> {
        let s = self
            .inner
            .rt()
            .block_on(self.inner.vol.status())
            .map_err(Error::volume("status"))?;
        Ok(VolumeStatus {
            phase: match s.phase {
                Phase::Probing => "probing",
                Phase::Attaching => "attaching",
                Phase::Running => "running",
                Phase::Fenced => "fenced",
                Phase::Detached => "detached",
            },
            epoch: s.epoch,
            size_bytes: s.size_blocks * u64::from(self.inner.vol.block_size()),
            replicas: self.inner.replicas,
            active: s.active,
            rebuilding: s.rebuilding,
            rebuilds_done: s.rebuilds_done,
            repairs: s.repairs,
        })
    }

    /// Waits until every configured replica is in sync (attach returns once
    /// a write quorum is; the rest join by a rebuild in the background).
    /// Returns the final status, or a `Timeout` error.
    pub fn wait_in_sync(&self, timeout: Duration) -> Result<VolumeStatus> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let st = self.status()?;
            if st.active.len() == st.replicas {
                return Ok(st);
            }
            if std::time::Instant::now() >= deadline {
                tracing::debug!(?st, "replicas not in sync in time");
                return Err(Error::Timeout {
                    op: "wait for replicas in sync",
                    ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A virtio-blk backend for a sheaf-vmm VM, serving this volume with
    /// device id `id` (at most 20 bytes). It keeps the volume attached for as
    /// long as the VM holds it.
    pub fn backend(&self, id: &str) -> Result<Arc<dyn BlockBackend>> {
        if id.len() > 20 {
            return Err(Error::InvalidArgument(format!(
                "disk id {id:?} is longer than 20 bytes"
            )));
        }
        Ok(Arc::new(VolumeDisk {
            backend: VolumeBackend::new(
                self.inner.disk.clone(),
                self.inner.rt().handle().clone(),
                id,
            ),
            _keep: self.inner.clone(),
        }))
    }

    /// Flushes, then drops this handle (the volume detaches when the last
    /// clone, including VM disks, is gone). Flush errors are returned.
    pub fn close(self) -> Result<()> {
        self.flush()
    }
}

/// A volume serving a VM's disk; keeps the volume (and its runtime) alive.
struct VolumeDisk {
    backend: VolumeBackend,
    _keep: Arc<Inner>,
}

impl BlockBackend for VolumeDisk {
    fn size(&self) -> u64 {
        self.backend.size()
    }
    fn read_only(&self) -> bool {
        self.backend.read_only()
    }
    fn device_id(&self) -> String {
        self.backend.device_id()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.backend.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        self.backend.write_at(offset, buf)
    }
    fn flush(&self) -> io::Result<()> {
        self.backend.flush()
    }
    fn supports_discard(&self) -> bool {
        self.backend.supports_discard()
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.backend.discard(offset, len)
    }
    fn supports_write_zeroes(&self) -> bool {
        self.backend.supports_write_zeroes()
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> io::Result<()> {
        self.backend.write_zeroes(offset, len, may_unmap)
    }
}

/// A replica server running in this process (like `sheaf-replica`).
pub struct ReplicaServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
    rt: Option<Runtime>,
}

impl std::fmt::Debug for ReplicaServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl ReplicaServer {
    /// Serves the store at `dir` on `listen` (e.g. `127.0.0.1:0` for any
    /// free port), authenticating peers with `secret` (≥ 16 bytes). With
    /// `create_size`, a store of that size is created first if `dir` holds
    /// none.
    pub fn start(
        dir: &Path,
        listen: &str,
        secret: &[u8],
        create_size: Option<u64>,
    ) -> Result<ReplicaServer> {
        let secret = Secret::new(secret.to_vec()).map_err(Error::volume("serve replica"))?;
        let addr: SocketAddr = listen
            .to_socket_addrs()
            .map_err(|e| Error::InvalidArgument(format!("listen address {listen:?}: {e}")))?
            .next()
            .ok_or_else(|| {
                Error::InvalidArgument(format!("listen address {listen:?} resolves to nothing"))
            })?;
        if let Some(size) = create_size
            && !dir.join("superblock").exists()
        {
            create_replica(dir, size)?;
        }
        let replica = sheaf_blockrepl::volume::open_local_replica(dir)
            .map_err(Error::volume("open replica store"))?;
        let rt = runtime("sheaf-replica")?;
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(addr))
            .map_err(Error::io("bind replica server"))?;
        let addr = listener
            .local_addr()
            .map_err(Error::io("bind replica server"))?;
        let task = rt.spawn(async move {
            if let Err(e) = sheaf_blockrepl::net::server::serve(listener, secret, replica).await {
                tracing::warn!(error = %e, "replica server ended");
            }
        });
        tracing::debug!(%addr, dir = %dir.display(), "replica server started");
        Ok(ReplicaServer {
            addr,
            task,
            rt: Some(rt),
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The `tcp://` location to pass to [`VolumeHandle::open`].
    pub fn location(&self) -> String {
        format!("tcp://{}", self.addr)
    }

    /// Stops serving: closes the listener and every connection.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.task.abort();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

impl Drop for ReplicaServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn local_volume_byte_granular_io() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("v");
        create_replica(&p, 1 << 20).expect("create");
        let v = VolumeHandle::open_local(&p).expect("open");
        assert_eq!(v.size(), 1 << 20);
        v.write(100, b"hello sheaf").expect("write");
        v.flush().expect("flush");
        assert_eq!(v.read(100, 11).expect("read"), b"hello sheaf");
        assert_eq!(v.read(0, 4).expect("read"), [0u8; 4]);
        let e = v.read((1 << 20) - 2, 4).expect_err("past end");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{}", e.report());
        assert_eq!(v.status().expect("status").phase, "running");
        v.close().expect("close");
        // Reopen: the data survived the detach.
        let v = VolumeHandle::open_local(&p).expect("reopen");
        assert_eq!(v.read(100, 11).expect("read"), b"hello sheaf");
    }

    #[test]
    fn three_replica_servers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let secret = b"0123456789abcdef-secret";
        let servers: Vec<ReplicaServer> = (0..3)
            .map(|i| {
                ReplicaServer::start(
                    &dir.path().join(format!("r{i}")),
                    "127.0.0.1:0",
                    secret,
                    Some(4 << 20),
                )
                .expect("server")
            })
            .collect();
        let targets: Vec<ReplicaTarget> = servers
            .iter()
            .map(|s| parse_replica(&s.location()).expect("parse"))
            .collect();
        let opts = OpenOptions {
            secret: Some(secret.to_vec()),
            ..OpenOptions::default()
        };
        let v = VolumeHandle::open(&targets, &opts).expect("open");
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        v.write(4096 * 3 + 7, &data).expect("write");
        v.flush().expect("flush");
        assert_eq!(v.read(4096 * 3 + 7, data.len()).expect("read"), data);
        assert!(v.status().expect("status").active.len() >= 2);
        let st = v.wait_in_sync(Duration::from_secs(20)).expect("in sync");
        assert_eq!(st.active, vec![0, 1, 2], "{st:?}");
        assert_eq!(v.read(4096 * 3 + 7, data.len()).expect("read"), data);
        drop(v);
        // A wrong secret cannot attach.
        let bad = OpenOptions {
            secret: Some(b"wrong-secret-wrong-secret".to_vec()),
            attach_timeout: Some(Duration::from_secs(2)),
            ..OpenOptions::default()
        };
        let e = VolumeHandle::open(&targets, &bad).expect_err("wrong secret");
        assert_eq!(e.kind(), ErrorKind::Volume, "{}", e.report());
        for s in servers {
            s.stop();
        }
    }

    #[test]
    fn replica_locations_parse() {
        assert_eq!(
            parse_replica("tcp://127.0.0.1:7000").expect("tcp"),
            ReplicaTarget::Remote("127.0.0.1:7000".parse().expect("addr"))
        );
        assert_eq!(
            parse_replica("/var/lib/v").expect("path"),
            ReplicaTarget::Local("/var/lib/v".into())
        );
        assert!(parse_replica("").is_err());
        assert!(parse_replica("tcp://nope").is_err());
    }
}
