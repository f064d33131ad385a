// SPDX-License-Identifier: Apache-2.0
//! The client API: a [`Volume`] handle (async) and a [`BlockingVolume`]
//! (for plain threads such as a virtio-blk device thread or a vhost-user
//! backend thread).
//!
//! A volume is served by one engine task (the sans-IO [`Engine`] plus its
//! driver) talking to replicas that are either *local* (a store directory
//! served by a thread in this process) or *remote* (a `sheaf-replica`
//! server reached over authenticated TCP). A single local replica is a plain
//! local volume with the same guarantees minus redundancy.
//!
//! ```no_run
//! # async fn demo() -> sheaf_blockrepl::Result<()> {
//! use sheaf_blockrepl::volume::{create_replica, Volume, VolumeConfig};
//! create_replica("/tmp/vol0", 64 << 20)?;
//! let vol = Volume::attach(VolumeConfig::local("/tmp/vol0")).await?;
//! vol.write(0, bytes::Bytes::from(vec![7u8; 4096])).await?;
//! vol.flush().await?;
//! assert_eq!(&vol.read(0, 4096).await?[..], &[7u8; 4096][..]);
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::debug;

use crate::error::{Error, Result};
use crate::net::server::{ReplicaThread, is_quick, remote_link};
use crate::net::{Secret, mono_us};
use crate::proto::engine::{
    ClientOp, Engine, EngineConfig, EngineStatus, OpOutput, Output, Phase, QuorumLossPolicy,
    ScrubReport, SnapshotInfo,
};
use crate::proto::msg::{MAX_IO_BLOCKS, Op, ReqFrame, Request, RespFrame};
use crate::proto::replica::ReplicaCore;
use crate::store::Store;
use crate::store::disk::{StdDir, StoreDir};
use crate::types::{BLOCK_SIZE, BLOCK_SIZE_U64, ReplicaState};

/// Default [`VolumeConfig::poll`] in µs.
pub const DEFAULT_POLL_US: u64 = 50;

/// Consecutive busy-poll windows that ended with no answer after which the
/// engine stops polling for [`POLL_BACKOFF_WINDOWS`] windows.
const POLL_MAX_MISSES: u32 = 4;
/// Windows skipped after [`POLL_MAX_MISSES`] misses.
const POLL_BACKOFF_WINDOWS: u32 = 64;

/// Where one replica of a volume lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicaTarget {
    /// A store directory served by a thread of this process.
    Local(PathBuf),
    /// A `sheaf-replica` server.
    Remote(SocketAddr),
}

/// How to attach a volume.
#[derive(Clone, Debug)]
pub struct VolumeConfig {
    /// The replicas, in a fixed order (the order is the replica id).
    pub replicas: Vec<ReplicaTarget>,
    /// Shared secret for remote replicas.
    pub secret: Option<Secret>,
    /// `W`; defaults to `min(2, N)`.
    pub min_write_replicas: Option<usize>,
    /// What writes do below `W` replicas.
    pub on_quorum_loss: QuorumLossPolicy,
    /// Engine tick.
    pub tick: Duration,
    /// Unanswered request timeout (the replica is then dropped and rebuilt).
    pub request_timeout: Duration,
    /// Delay between attempts to bring a failed replica back.
    pub rejoin_interval: Duration,
    /// How long `attach` waits for enough replicas.
    pub attach_timeout: Duration,
    /// Lowest epoch to take (orchestrators may pass their own counter).
    pub min_epoch: u64,
    /// Read lease `L` asked of the replicas (docs/blockrepl.md "Read
    /// leases"): while `W` replicas hold one, reads go to one replica with
    /// no ping round. A newer engine's attach (failover) waits up to `L`
    /// for a cut-off engine's leases to end. Zero turns leases off. At most
    /// what the replicas grant (`sheaf-replica --max-lease-ms`, default
    /// 2 s).
    pub read_lease: Duration,
    /// Busy-poll window of the engine task (docs/frontends.md "Busy-poll
    /// in sheaf-blockd"): for up to this long after the last command or
    /// replica answer the task yields to the runtime instead of letting it
    /// park, so a current-thread runtime polls its sockets (replica links,
    /// the frontend's client) without sleeping. Costs CPU; adaptive (stops
    /// after a few empty windows); zero turns it off. Used only with
    /// remote replicas.
    pub poll: Duration,
}

impl VolumeConfig {
    /// A volume with one local replica at `path`.
    pub fn local(path: impl Into<PathBuf>) -> VolumeConfig {
        VolumeConfig::new(vec![ReplicaTarget::Local(path.into())], None)
    }

    /// A volume whose replicas are the given `sheaf-replica` servers.
    pub fn remote(addrs: &[SocketAddr], secret: Secret) -> VolumeConfig {
        VolumeConfig::new(
            addrs.iter().map(|a| ReplicaTarget::Remote(*a)).collect(),
            Some(secret),
        )
    }

    /// A volume over arbitrary replicas.
    pub fn new(replicas: Vec<ReplicaTarget>, secret: Option<Secret>) -> VolumeConfig {
        VolumeConfig {
            replicas,
            secret,
            min_write_replicas: None,
            on_quorum_loss: QuorumLossPolicy::Suspend,
            tick: Duration::from_millis(10),
            request_timeout: Duration::from_secs(3),
            rejoin_interval: Duration::from_millis(500),
            attach_timeout: Duration::from_secs(10),
            min_epoch: 0,
            read_lease: Duration::from_micros(crate::proto::engine::DEFAULT_READ_LEASE_US),
            poll: Duration::from_micros(DEFAULT_POLL_US),
        }
    }
}

/// Creates the store of a new volume's replica at `path` (any store there is
/// replaced). Every replica of a new volume starts empty and in sync.
pub fn create_replica(path: impl AsRef<Path>, size_bytes: u64) -> Result<()> {
    create_store(path.as_ref(), size_bytes, ReplicaState::Clean)
}

/// Creates an empty replica that replaces a lost one: it starts
/// `Rebuilding` and is filled from a healthy replica at the next attach.
pub fn create_replacement_replica(path: impl AsRef<Path>, size_bytes: u64) -> Result<()> {
    create_store(path.as_ref(), size_bytes, ReplicaState::Rebuilding)
}

fn create_store(path: &Path, size_bytes: u64, state: ReplicaState) -> Result<()> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(BLOCK_SIZE_U64) {
        return Err(Error::InvalidArgument(format!(
            "volume size {size_bytes} is not a positive multiple of 4096"
        )));
    }
    let dir = StdDir::new(path).map_err(Error::store("create directory"))?;
    Store::create(Box::new(dir), size_bytes / BLOCK_SIZE_U64, state)?;
    Ok(())
}

/// Opens a local store directory as a replica served by its own thread
/// (to remote engines through [`crate::net::server::serve`], or to this
/// process's). It grants read leases of up to
/// [`DEFAULT_MAX_LEASE_US`](crate::proto::replica::DEFAULT_MAX_LEASE_US)
/// and, once started, refuses higher epochs for that long (the restart
/// guard: leases live in memory).
pub fn open_local_replica(path: &Path) -> Result<ReplicaThread> {
    open_replica(path, crate::proto::replica::DEFAULT_MAX_LEASE_US, true)
}

/// [`open_local_replica`] with the longest lease granted (µs; 0 grants
/// none) and whether a restart is guarded (turn it off only for a replica
/// that serves this process's engines alone).
pub fn open_replica(path: &Path, max_lease_us: u64, restart_guard: bool) -> Result<ReplicaThread> {
    let p = path.to_path_buf();
    let factory = Box::new(move || -> Box<dyn StoreDir> {
        match StdDir::new(&p) {
            Ok(d) => Box::new(d),
            Err(_) => Box::new(
                StdDir::new(std::env::temp_dir().join("sheaf-missing"))
                    .unwrap_or_else(|_| unreachable!("temp dir is creatable")),
            ),
        }
    });
    // Validate once up front for a clear error.
    StdDir::new(path).map_err(Error::store("open directory"))?;
    let mut core = ReplicaCore::open(factory)?;
    core.set_lease_limit(max_lease_us, restart_guard);
    ReplicaThread::spawn(core, "sheaf-replica")
}

/// Takes the exclusive lock of a replica directory for a server process
/// (`sheaf-replica`, the launcher's local replica): keep the returned lock
/// for as long as the process serves `path`. A second process on the same
/// directory gets [`Error::DirInUse`] naming the holder's pid, instead of
/// two servers overwriting each other's commits. (In-process replicas,
/// which tests restart on one directory, do not take it.)
///
/// Waits up to `wait` for a holder to let go (a predecessor that is still
/// exiting) before giving up.
pub fn lock_replica_dir(path: &Path, wait: Duration) -> Result<crate::store::disk::DirLock> {
    use crate::store::disk::{DirLock, DirLockError};
    StdDir::new(path).map_err(Error::store("open directory"))?;
    let deadline = std::time::Instant::now() + wait;
    let got = loop {
        match DirLock::acquire(path) {
            Err(DirLockError::Held(_)) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            r => break r,
        }
    };
    got.map_err(|e| match e {
        DirLockError::Held(pid) => Error::DirInUse {
            path: path.display().to_string(),
            holder: pid.map(|p| format!(" (pid {p})")).unwrap_or_default(),
        },
        DirLockError::Io(source) => Error::Store {
            op: "lock directory",
            source,
        },
    })
}

type Reply = oneshot::Sender<Result<OpOutput>>;

enum Cmd {
    Op(ClientOp, Reply),
    Status(oneshot::Sender<EngineStatus>),
    Snapshots(oneshot::Sender<Vec<SnapshotInfo>>),
}

enum LinkTx {
    /// An in-process replica; `pending` counts requests queued to its
    /// thread whose answers the engine has not seen yet.
    Local {
        thread: ReplicaThread,
        pending: usize,
    },
    Remote(mpsc::UnboundedSender<ReqFrame>),
}

/// Largest request (in blocks) applied in the driver's task instead of the
/// local replica's thread: small requests cost less than the two
/// cross-thread wake-ups of a hop; large ones overlap with the frontend's
/// copies on another core.
const INLINE_BLOCKS: usize = 16;

/// Whether the driver applies `req` to a local replica in place.
fn inline_local(req: &Request) -> bool {
    is_quick(req)
        && match req {
            Request::Read { blocks, .. } => *blocks as usize <= INLINE_BLOCKS,
            Request::Op {
                op: Op::Write { data, .. },
                ..
            } => data.len() <= INLINE_BLOCKS * BLOCK_SIZE,
            _ => true,
        }
}

/// An attached volume. Cheap to clone; every clone talks to the same engine.
#[derive(Clone, Debug)]
pub struct Volume {
    tx: mpsc::UnboundedSender<CmdBox>,
    size: Arc<AtomicU64>,
}

/// Opaque command wrapper (keeps `Cmd` private while `Volume` is `Debug`).
struct CmdBox(Cmd);

impl std::fmt::Debug for CmdBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cmd")
    }
}

fn check_aligned(offset: u64, len: u64) -> Result<()> {
    if !offset.is_multiple_of(BLOCK_SIZE_U64) || !len.is_multiple_of(BLOCK_SIZE_U64) {
        return Err(Error::Unaligned { offset, len });
    }
    Ok(())
}

impl Volume {
    /// Attaches: starts the engine, takes a new epoch on the replicas and
    /// waits until the volume serves I/O (or `attach_timeout`).
    pub async fn attach(cfg: VolumeConfig) -> Result<Volume> {
        if cfg.replicas.is_empty() {
            return Err(Error::InvalidArgument(
                "a volume needs at least one replica".into(),
            ));
        }
        let n = cfg.replicas.len();
        let mut ecfg = EngineConfig::new(n, crate::net::random_u64());
        if let Some(w) = cfg.min_write_replicas {
            if w == 0 || w > n {
                return Err(Error::InvalidArgument(format!(
                    "min_write_replicas {w} not in 1..={n}"
                )));
            }
            ecfg.min_write_replicas = w;
        }
        ecfg.on_quorum_loss = cfg.on_quorum_loss;
        ecfg.min_epoch = cfg.min_epoch;
        ecfg.read_lease_us = cfg.read_lease.as_micros().min(u64::MAX as u128) as u64;
        let ticks = |d: Duration| (d.as_micros() / cfg.tick.as_micros().max(1)).max(1) as u64;
        ecfg.request_timeout = ticks(cfg.request_timeout);
        ecfg.rejoin_interval = ticks(cfg.rejoin_interval);
        let (local_tx, local_rx) = mpsc::unbounded_channel::<(usize, RespFrame)>();
        let (remote_tx, remote_rx) = mpsc::unbounded_channel::<(usize, Option<RespFrame>)>();
        let mut links = Vec::with_capacity(n);
        for (i, t) in cfg.replicas.iter().enumerate() {
            match t {
                ReplicaTarget::Local(p) => links.push(LinkTx::Local {
                    // Served to this engine only: when the process
                    // restarts, every engine that could hold a lease on it
                    // is gone, so no restart guard (it would delay every
                    // re-attach by the lease).
                    thread: open_replica(p, crate::proto::replica::DEFAULT_MAX_LEASE_US, false)?,
                    pending: 0,
                }),
                ReplicaTarget::Remote(addr) => {
                    let secret = cfg.secret.clone().ok_or_else(|| {
                        Error::InvalidArgument("remote replicas need a secret".into())
                    })?;
                    let (tx, rx) = mpsc::unbounded_channel();
                    tokio::spawn(remote_link(i, *addr, secret, rx, remote_tx.clone()));
                    links.push(LinkTx::Remote(tx));
                }
            }
        }
        drop(remote_tx);
        let has_remote = links.iter().any(|l| matches!(l, LinkTx::Remote(_)));
        let mut engine = Engine::new(ecfg);
        engine.set_time(mono_us());
        let (tx, rx) = mpsc::unbounded_channel();
        let size = Arc::new(AtomicU64::new(0));
        let (phase_tx, mut phase_rx) = watch::channel(Phase::Probing);
        let d = Driver {
            engine,
            links,
            local_tx,
            waiters: HashMap::new(),
            next_op: 1,
            size: size.clone(),
            phase_tx,
            poll: Poller::new(if has_remote { cfg.poll } else { Duration::ZERO }),
        };
        tokio::spawn(d.run(rx, local_rx, remote_rx, cfg.tick));
        let wait = async {
            loop {
                match *phase_rx.borrow_and_update() {
                    Phase::Running => return Ok(()),
                    Phase::Fenced => {
                        return Err(Error::Attach {
                            reason: "fenced while attaching: a replica holds a newer epoch, \
                                     or the largest one"
                                .into(),
                        });
                    }
                    _ => {}
                }
                if phase_rx.changed().await.is_err() {
                    return Err(Error::Attach {
                        reason: "engine stopped".into(),
                    });
                }
            }
        };
        match tokio::time::timeout(cfg.attach_timeout, wait).await {
            Ok(Ok(())) => Ok(Volume { tx, size }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::Attach {
                reason: format!(
                    "fewer than {} clean replicas answered within {:?}",
                    n - cfg.min_write_replicas.unwrap_or(n.min(2)) + 1,
                    cfg.attach_timeout
                ),
            }),
        }
    }

    fn start(&self, op: ClientOp) -> Result<oneshot::Receiver<Result<OpOutput>>> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(CmdBox(Cmd::Op(op, tx)))
            .map_err(|_| Error::Detached)?;
        Ok(rx)
    }

    async fn run(&self, op: ClientOp) -> Result<OpOutput> {
        self.start(op)?.await.map_err(|_| Error::Detached)?
    }

    /// Volume size in bytes.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Logical block size: every offset and length must be a multiple.
    pub fn block_size(&self) -> u32 {
        BLOCK_SIZE as u32
    }

    fn read_ops(offset: u64, len: u64) -> Result<Vec<ClientOp>> {
        check_aligned(offset, len)?;
        let mut ops = Vec::new();
        let mut lba = offset / BLOCK_SIZE_U64;
        let mut left = len / BLOCK_SIZE_U64;
        while left > 0 {
            let n = left.min(MAX_IO_BLOCKS as u64);
            ops.push(ClientOp::Read {
                lba,
                blocks: n as u32,
            });
            lba += n;
            left -= n;
        }
        Ok(ops)
    }

    fn write_ops(offset: u64, data: &Bytes) -> Result<Vec<ClientOp>> {
        check_aligned(offset, data.len() as u64)?;
        let chunk = MAX_IO_BLOCKS * BLOCK_SIZE;
        let mut ops = Vec::new();
        let mut at = 0;
        while at < data.len() {
            let end = (at + chunk).min(data.len());
            ops.push(ClientOp::Write {
                lba: (offset + at as u64) / BLOCK_SIZE_U64,
                data: data.slice(at..end),
            });
            at = end;
        }
        Ok(ops)
    }

    fn zero_ops(offset: u64, len: u64) -> Result<Vec<ClientOp>> {
        Ok(Self::read_ops(offset, len)?
            .into_iter()
            .map(|op| match op {
                ClientOp::Read { lba, blocks } => ClientOp::Zero { lba, blocks },
                other => other,
            })
            .collect())
    }

    async fn run_all(&self, ops: Vec<ClientOp>) -> Result<Vec<OpOutput>> {
        let rxs: Vec<_> = ops
            .into_iter()
            .map(|op| self.start(op))
            .collect::<Result<_>>()?;
        let mut out = Vec::with_capacity(rxs.len());
        let mut first_err = None;
        for rx in rxs {
            match rx.await.map_err(|_| Error::Detached).and_then(|r| r) {
                Ok(o) => out.push(o),
                Err(e) => {
                    if first_err.is_none() {
                        first_err = Some(e);
                    }
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Reads `len` bytes at `offset` (both multiples of 4096).
    pub async fn read(&self, offset: u64, len: usize) -> Result<Bytes> {
        let outs = self.run_all(Self::read_ops(offset, len as u64)?).await?;
        Ok(join(outs))
    }

    /// Writes `data` at `offset` (both multiples of 4096). Completes once
    /// every in-sync replica has it; durable after the next [`Volume::flush`].
    pub async fn write(&self, offset: u64, data: Bytes) -> Result<()> {
        self.run_all(Self::write_ops(offset, &data)?)
            .await
            .map(|_| ())
    }

    /// Writes zeros over a range.
    pub async fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.run_all(Self::zero_ops(offset, len)?).await.map(|_| ())
    }

    /// Discards a range; it reads back as zeros.
    pub async fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.write_zeroes(offset, len).await
    }

    /// Makes every completed write durable on every in-sync replica.
    pub async fn flush(&self) -> Result<()> {
        self.run(ClientOp::Flush).await.map(|_| ())
    }

    /// Takes a crash-consistent snapshot.
    pub async fn snapshot(&self, name: &str) -> Result<()> {
        self.run(ClientOp::Snapshot {
            name: name.to_string(),
        })
        .await
        .map(|_| ())
    }

    /// Deletes a snapshot.
    pub async fn delete_snapshot(&self, name: &str) -> Result<()> {
        self.run(ClientOp::DeleteSnapshot {
            name: name.to_string(),
        })
        .await
        .map(|_| ())
    }

    /// Reverts the volume to a snapshot; later snapshots are deleted.
    pub async fn revert(&self, name: &str) -> Result<()> {
        self.run(ClientOp::Revert {
            name: name.to_string(),
        })
        .await
        .map(|_| ())
    }

    /// Lists snapshots, oldest first.
    pub async fn snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(CmdBox(Cmd::Snapshots(tx)))
            .map_err(|_| Error::Detached)?;
        rx.await.map_err(|_| Error::Detached)
    }

    /// Grows the volume to `size_bytes`.
    pub async fn resize(&self, size_bytes: u64) -> Result<()> {
        check_aligned(size_bytes, 0)?;
        self.run(ClientOp::Resize {
            size_blocks: size_bytes / BLOCK_SIZE_U64,
        })
        .await
        .map(|_| ())
    }

    /// Verifies every copy of every block and repairs bad ones from a peer.
    pub async fn scrub(&self) -> Result<ScrubReport> {
        match self.run(ClientOp::Scrub).await? {
            OpOutput::Scrub(r) => Ok(r),
            _ => Err(Error::Replica("unexpected scrub result".into())),
        }
    }

    /// Engine status (epoch, active and rebuilding replicas, ...).
    pub async fn status(&self) -> Result<EngineStatus> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(CmdBox(Cmd::Status(tx)))
            .map_err(|_| Error::Detached)?;
        rx.await.map_err(|_| Error::Detached)
    }

    /// Flushes, releases the replicas and stops the engine.
    pub async fn detach(self) -> Result<()> {
        self.flush().await?;
        self.run(ClientOp::Detach).await.map(|_| ())
    }
}

fn join(outs: Vec<OpOutput>) -> Bytes {
    if outs.len() == 1
        && let Some(OpOutput::Data(d)) = outs.first()
    {
        return d.clone();
    }
    let mut b = BytesMut::new();
    for o in outs {
        if let OpOutput::Data(d) = o {
            b.extend_from_slice(&d);
        }
    }
    b.freeze()
}

struct Driver {
    engine: Engine,
    links: Vec<LinkTx>,
    local_tx: mpsc::UnboundedSender<(usize, RespFrame)>,
    waiters: HashMap<u64, Reply>,
    next_op: u64,
    size: Arc<AtomicU64>,
    phase_tx: watch::Sender<Phase>,
    poll: Poller,
}

/// The engine task's busy-poll state: a window of at most `window` after
/// the last activity (a command or a replica answer) during which the task
/// yields instead of waiting, so a current-thread runtime polls its
/// sockets (`epoll_wait` with a zero timeout) instead of parking: a replica
/// answer, or the client's next request after a completion, that arrives
/// within the window costs no sleep and wake-up. Adaptive: after
/// [`POLL_MAX_MISSES`] windows in a row ran out with nothing arriving, the
/// next [`POLL_BACKOFF_WINDOWS`] windows are skipped (an idle volume stops
/// spinning after a few windows).
#[derive(Debug)]
struct Poller {
    window: Duration,
    /// End of the current window.
    until: Option<std::time::Instant>,
    /// Something happened since the last window ran out.
    armed: bool,
    misses: u32,
    skip: u32,
}

impl Poller {
    fn new(window: Duration) -> Poller {
        Poller {
            window,
            until: None,
            armed: false,
            misses: 0,
            skip: 0,
        }
    }

    /// A command or a replica answer arrived.
    fn activity(&mut self) {
        if self.window.is_zero() {
            return;
        }
        self.armed = true;
        if self.until.is_some() {
            // The window caught something: keep polling from now on.
            self.misses = 0;
            self.until = Some(std::time::Instant::now() + self.window);
        }
    }

    /// After the engine's outputs went out: opens a window if something
    /// happened since the last one ran out.
    fn update(&mut self) {
        if self.window.is_zero() || self.until.is_some() || !self.armed {
            return;
        }
        self.armed = false;
        if self.skip > 0 {
            self.skip -= 1;
        } else {
            self.until = Some(std::time::Instant::now() + self.window);
        }
    }

    fn polling(&self) -> bool {
        self.until.is_some()
    }

    /// One poll round went by with nothing arriving; closes the window
    /// when it ran out.
    fn tick(&mut self) {
        if let Some(t) = self.until
            && std::time::Instant::now() >= t
        {
            self.until = None;
            self.misses += 1;
            if self.misses >= POLL_MAX_MISSES {
                self.misses = 0;
                self.skip = POLL_BACKOFF_WINDOWS;
            }
        }
    }
}

impl Driver {
    async fn run(
        mut self,
        mut cmds: mpsc::UnboundedReceiver<CmdBox>,
        mut local_rx: mpsc::UnboundedReceiver<(usize, RespFrame)>,
        mut remote_rx: mpsc::UnboundedReceiver<(usize, Option<RespFrame>)>,
        tick: Duration,
    ) {
        let mut interval = tokio::time::interval(tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.drain();
        loop {
            let polling = self.poll.polling();
            tokio::select! {
                c = cmds.recv() => {
                    let Some(CmdBox(c)) = c else { break };
                    self.poll.activity();
                    self.command(c);
                    while let Ok(CmdBox(c)) = cmds.try_recv() {
                        self.command(c);
                    }
                }
                Some((r, resp)) = local_rx.recv() => {
                    self.local_response(r, resp);
                    while let Ok((r, resp)) = local_rx.try_recv() {
                        self.local_response(r, resp);
                    }
                }
                Some((r, ev)) = remote_rx.recv() => {
                    self.poll.activity();
                    self.remote_event(r, ev);
                    while let Ok((r, ev)) = remote_rx.try_recv() {
                        self.remote_event(r, ev);
                    }
                }
                _ = interval.tick() => {
                    self.engine.set_time(mono_us());
                    self.engine.tick();
                }
                // Busy-poll: yielding lets the runtime poll its sockets
                // without parking; we are polled again right after.
                _ = tokio::task::yield_now(), if polling => {
                    self.poll.tick();
                }
            }
            self.drain();
            self.poll.update();
            if self.engine.phase() == Phase::Detached && self.waiters.is_empty() {
                break;
            }
        }
        debug!("volume driver stopped");
    }

    fn local_response(&mut self, r: usize, resp: RespFrame) {
        if let Some(LinkTx::Local { pending, .. }) = self.links.get_mut(r) {
            *pending = pending.saturating_sub(1);
        }
        // The clock is read after the answer arrived (read leases).
        self.engine.set_time(mono_us());
        self.engine.step(r, resp.id, resp.resp);
    }

    fn remote_event(&mut self, r: usize, ev: Option<RespFrame>) {
        self.engine.set_time(mono_us());
        match ev {
            Some(resp) => self.engine.step(r, resp.id, resp.resp),
            None => self.engine.disconnected(r),
        }
    }

    fn command(&mut self, c: Cmd) {
        match c {
            Cmd::Op(op, reply) => {
                let id = self.next_op;
                self.next_op += 1;
                self.waiters.insert(id, reply);
                self.engine.set_time(mono_us());
                self.engine.submit(id, op);
            }
            Cmd::Status(tx) => {
                let _ = tx.send(self.engine.status());
            }
            Cmd::Snapshots(tx) => {
                let _ = tx.send(self.engine.snapshots());
            }
        }
    }

    fn drain(&mut self) {
        while let Some(o) = self.engine.poll_output() {
            match o {
                Output::Send { to, frame } => match &mut self.links[to] {
                    // Nothing queued on the thread (so answers stay in
                    // request order) and a page-cache request: apply it
                    // here, without the two thread hops.
                    LinkTx::Local { thread, pending }
                        if *pending == 0 && inline_local(&frame.req) =>
                    {
                        let resp = thread.apply_inline(frame);
                        self.engine.set_time(mono_us());
                        self.engine.step(to, resp.id, resp.resp);
                    }
                    LinkTx::Local { thread, pending } => {
                        if thread.submit(frame, self.local_tx.clone(), to) {
                            *pending += 1;
                        } else {
                            self.engine.disconnected(to);
                        }
                    }
                    LinkTx::Remote(tx) => {
                        let _ = tx.send(frame);
                    }
                },
                Output::Complete { id, result } => {
                    if let Some(w) = self.waiters.remove(&id) {
                        let _ = w.send(result);
                    }
                }
            }
        }
        self.size.store(
            self.engine.size_blocks() * BLOCK_SIZE_U64,
            Ordering::Release,
        );
        let phase = self.engine.phase();
        if *self.phase_tx.borrow() != phase {
            let _ = self.phase_tx.send(phase);
        }
    }
}

/// A [`Volume`] for threads that are not async: every call blocks the
/// calling thread until the operation completes. Do not call it from inside
/// an async runtime's worker thread.
#[derive(Debug)]
pub struct BlockingVolume {
    vol: Volume,
    _rt: Option<Arc<tokio::runtime::Runtime>>,
}

impl BlockingVolume {
    /// Attaches a volume on a private runtime (one background thread).
    pub fn attach(cfg: VolumeConfig) -> Result<BlockingVolume> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("sheaf-volume")
            .enable_all()
            .build()
            .map_err(|source| Error::Net {
                op: "start runtime",
                source,
            })?;
        let vol = rt.block_on(Volume::attach(cfg))?;
        Ok(BlockingVolume {
            vol,
            _rt: Some(Arc::new(rt)),
        })
    }

    /// Wraps a volume attached on a runtime the caller keeps running.
    pub fn from_volume(vol: Volume) -> BlockingVolume {
        BlockingVolume { vol, _rt: None }
    }

    /// The async handle.
    pub fn volume(&self) -> &Volume {
        &self.vol
    }

    fn run_all(&self, ops: Vec<ClientOp>) -> Result<Vec<OpOutput>> {
        let rxs: Vec<_> = ops
            .into_iter()
            .map(|op| self.vol.start(op))
            .collect::<Result<_>>()?;
        let mut out = Vec::with_capacity(rxs.len());
        let mut first_err = None;
        for rx in rxs {
            match rx
                .blocking_recv()
                .map_err(|_| Error::Detached)
                .and_then(|r| r)
            {
                Ok(o) => out.push(o),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Volume size in bytes.
    pub fn size(&self) -> u64 {
        self.vol.size()
    }

    /// Reads into `buf` from `offset` (both multiples of 4096).
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let outs = self.run_all(Volume::read_ops(offset, buf.len() as u64)?)?;
        let mut at = 0;
        for o in outs {
            if let OpOutput::Data(d) = o {
                let end = (at + d.len()).min(buf.len());
                buf[at..end].copy_from_slice(&d[..end - at]);
                at = end;
            }
        }
        Ok(())
    }

    /// Writes `data` at `offset` (both multiples of 4096).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let data = Bytes::copy_from_slice(data);
        self.run_all(Volume::write_ops(offset, &data)?).map(|_| ())
    }

    /// Writes zeros over a range.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.run_all(Volume::zero_ops(offset, len)?).map(|_| ())
    }

    /// Discards a range (reads back as zeros).
    pub fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.write_zeroes(offset, len)
    }

    /// Makes completed writes durable.
    pub fn flush(&self) -> Result<()> {
        self.run_all(vec![ClientOp::Flush]).map(|_| ())
    }

    /// Detaches (flush first).
    pub fn detach(self) -> Result<()> {
        self.flush()?;
        self.run_all(vec![ClientOp::Detach]).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poller_off_never_polls() {
        let mut p = Poller::new(Duration::ZERO);
        p.activity();
        p.update();
        assert!(!p.polling());
    }

    #[test]
    fn poller_window_opens_after_activity_and_runs_out() {
        let mut p = Poller::new(Duration::from_millis(1));
        p.update();
        assert!(!p.polling(), "no window without activity");
        p.activity();
        p.update();
        assert!(p.polling());
        p.tick();
        assert!(p.polling(), "still inside the window");
        std::thread::sleep(Duration::from_millis(2));
        p.tick();
        assert!(!p.polling(), "window ran out");
        p.update();
        assert!(!p.polling(), "no new window until something happens");
    }

    #[test]
    fn poller_backs_off_after_empty_windows() {
        let mut p = Poller::new(Duration::from_micros(1));
        for _ in 0..POLL_MAX_MISSES {
            p.activity();
            p.update();
            assert!(p.polling());
            std::thread::sleep(Duration::from_micros(50));
            p.tick();
            assert!(!p.polling());
        }
        for _ in 0..POLL_BACKOFF_WINDOWS {
            p.activity();
            p.update();
            assert!(!p.polling(), "skipped window");
        }
        p.activity();
        p.update();
        assert!(p.polling(), "polls again after the back-off");
    }

    #[test]
    fn poller_answer_inside_window_resets_misses() {
        let mut p = Poller::new(Duration::from_secs(60));
        p.activity();
        p.update();
        p.misses = POLL_MAX_MISSES - 1;
        p.activity();
        assert_eq!(p.misses, 0);
        assert!(p.polling());
    }
}
