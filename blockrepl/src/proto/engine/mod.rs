// SPDX-License-Identifier: Apache-2.0
//! The engine: one per attached volume, sans I/O.
//!
//! The driver (the tokio transport, the in-process transport or the
//! simulator) feeds it client operations ([`Engine::submit`]), replica
//! responses ([`Engine::step`]) and time ([`Engine::tick`]), and drains
//! [`Output`]s: requests to send and client completions. Nothing here does
//! I/O or reads a clock, so every run is reproducible.
//!
//! Rules (see `docs/blockrepl.md` for the argument):
//!
//! * **Attach** probes replicas, takes epoch `max + 1` and needs
//!   `R = N - W + 1` clean replicas to accept it (`W` = `min_write_replicas`);
//!   any two such sets, and any attach set and write set, intersect. The
//!   source is the clean replica with the highest position `(epoch, index)`;
//!   replicas at that position are *active*, every other one is rebuilt.
//! * **Writes** get consecutive indexes and go to every active and
//!   rebuilding replica; a write completes when every active replica has
//!   applied every write up to it and at least `W` replicas are active.
//! * **Reads** go to one active replica; `W` replicas must confirm the
//!   epoch after the read started (read fencing), and reads never overlap
//!   an unfinished write (no dirty reads).
//! * A replica that times out, refuses or faults leaves the active set and
//!   is rebuilt (incrementally: only blocks whose tags differ are copied).

mod attach;
mod io;
mod rebuild;
mod scrub;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::{Bytes, BytesMut};
use tracing::{debug, info, warn};

use crate::error::Error;
use crate::proto::msg::{CopyEntry, MAX_IO_BLOCKS, Op, Refusal, ReqFrame, Request, Response};
use crate::types::{
    BLOCK_SIZE, BlockTag, LayerInfo, MAX_LAYERS, MAX_NAME_LEN, ReplicaInfo, ReplicaState, Tag,
};

/// Index of a replica in [`EngineConfig::replicas`] order.
pub type ReplicaId = usize;
/// Identifies a client operation.
pub type OpId = u64;

/// What to do with writes when fewer than `min_write_replicas` are in sync.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuorumLossPolicy {
    /// Hold writes until enough replicas are back (the VM sees a stall).
    Suspend,
    /// Fail writes with [`Error::QuorumLost`].
    Fail,
}

/// Engine configuration.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Number of replicas `N`.
    pub replicas: usize,
    /// `W`: writes need this many replicas in sync (default 2 of 3).
    pub min_write_replicas: usize,
    /// This engine's id (unique per attach).
    pub engine_id: u64,
    /// Lowest epoch to take (an orchestrator may pass its own counter).
    pub min_epoch: u64,
    /// Ticks before an unanswered request fails its replica.
    pub request_timeout: u64,
    /// Ticks between attempts to bring a failed replica back.
    pub rejoin_interval: u64,
    /// Client operations in flight at most (more are queued).
    pub max_inflight: usize,
    /// Queued operations at most (more are refused).
    pub max_queued: usize,
    /// Behaviour below `min_write_replicas`.
    pub on_quorum_loss: QuorumLossPolicy,
    /// Blocks per rebuild chunk.
    pub rebuild_chunk: u32,
    /// Rebuild chunks in flight per rebuild.
    pub rebuild_parallel: usize,
    /// Read leases (docs/blockrepl.md "Read leases"): the lease `L` asked
    /// of every attached replica, in µs of the replica's clock; 0 turns
    /// leases off (every read then confirms the epoch with a ping round).
    /// Leases are used only once the driver gives the engine a clock
    /// ([`Engine::set_time`]) and when `W >= 2`. A newer engine's attach
    /// waits up to `L` for the leases to run out (failover grows by `L`).
    pub read_lease_us: u64,
    /// Bound `ρ` on the rate error of any node's clock, in parts per
    /// million: a lease granted for `L` is trusted for
    /// `L·(1−ρ)/(1+ρ) − lease_margin_us` from when it was asked for.
    pub clock_drift_ppm: u64,
    /// Subtracted from every lease (µs).
    pub lease_margin_us: u64,
    /// Deliberate protocol bugs, for proving that the simulator's oracle
    /// catches them. Never set outside tests.
    pub bugs: Bugs,
}

/// Deliberate protocol bugs (test-only knobs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bugs {
    /// Acknowledge a write once any one replica has it.
    pub ack_on_first_replica: bool,
    /// Complete reads without confirming the epoch on `W` replicas.
    pub skip_read_fencing: bool,
    /// Pick the rebuild source by lowest replica id instead of position.
    pub source_by_id: bool,
    /// Trust a read lease for `L − margin` of the engine's clock, blind to
    /// clock drift.
    pub lease_ignores_drift: bool,
    /// Decide whether a read is covered by a lease when it is sent instead
    /// of when it completes.
    pub lease_checked_at_send: bool,
    /// Replicas forget their leases on restart (no restart guard). Applied
    /// by the simulator to the replicas it starts.
    pub replica_forgets_lease_on_restart: bool,
}

/// Default read lease `L` (µs): failover waits at most this long for a
/// paused or cut-off engine's leases to run out.
pub const DEFAULT_READ_LEASE_US: u64 = 1_000_000;

impl EngineConfig {
    /// A configuration for `replicas` replicas with `W = min(2, N)`.
    pub fn new(replicas: usize, engine_id: u64) -> EngineConfig {
        EngineConfig {
            replicas,
            min_write_replicas: replicas.min(2),
            engine_id,
            min_epoch: 0,
            request_timeout: 50,
            rejoin_interval: 20,
            max_inflight: 64,
            max_queued: 4096,
            on_quorum_loss: QuorumLossPolicy::Suspend,
            rebuild_chunk: MAX_IO_BLOCKS as u32,
            rebuild_parallel: 8,
            read_lease_us: DEFAULT_READ_LEASE_US,
            clock_drift_ppm: 10_000,
            lease_margin_us: 5_000,
            bugs: Bugs::default(),
        }
    }
}

/// A client operation.
#[derive(Clone, Debug)]
pub enum ClientOp {
    /// Read `blocks` blocks at `lba`.
    Read {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
    },
    /// Write whole blocks.
    Write {
        /// First block.
        lba: u64,
        /// Data (a multiple of 4096 bytes).
        data: Bytes,
    },
    /// Write zeros / trim (reads return zeros afterwards).
    Zero {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
    },
    /// Make every completed write durable on every active replica.
    Flush,
    /// Take a crash-consistent snapshot.
    Snapshot {
        /// Snapshot name.
        name: String,
    },
    /// Delete a snapshot (its blocks merge into the next layer).
    DeleteSnapshot {
        /// Snapshot name.
        name: String,
    },
    /// Revert the volume to a snapshot (later snapshots are dropped).
    Revert {
        /// Snapshot name.
        name: String,
    },
    /// Grow the volume.
    Resize {
        /// New size in blocks.
        size_blocks: u64,
    },
    /// Verify every block on every active replica and repair bad copies.
    Scrub,
    /// Flush, release the replicas and stop.
    Detach,
}

/// Result of a successful operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpOutput {
    /// Nothing to return.
    Done,
    /// Read data.
    Data(Bytes),
    /// Scrub outcome.
    Scrub(ScrubReport),
}

/// What a scrub found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScrubReport {
    /// Block copies verified.
    pub checked: u64,
    /// Copies that failed verification.
    pub bad: u64,
    /// Copies repaired from a peer.
    pub repaired: u64,
    /// Blocks whose tags differed between active replicas.
    pub divergent: u64,
    /// Replicas whose every block this scrub verified. A replica that left
    /// the active set during the scrub, or joined it after, is not counted:
    /// scrub again to cover it.
    pub replicas: u32,
}

/// Something the driver must do.
#[derive(Debug)]
pub enum Output {
    /// Send a request to a replica.
    Send {
        /// Destination.
        to: ReplicaId,
        /// The request.
        frame: ReqFrame,
    },
    /// An operation finished.
    Complete {
        /// Operation id from [`Engine::submit`].
        id: OpId,
        /// Outcome.
        result: Result<OpOutput, Error>,
    },
}

/// Engine lifecycle phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Probing replicas for their epochs and positions.
    Probing,
    /// Waiting for enough replicas to accept the epoch.
    Attaching,
    /// Serving I/O.
    Running,
    /// A newer engine took over; everything fails.
    Fenced,
    /// Detached.
    Detached,
}

/// A snapshot as the engine knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    /// Name.
    pub name: String,
    /// Layer id.
    pub layer: u64,
    /// Position at which it was taken.
    pub created: Tag,
}

/// Engine status for monitoring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineStatus {
    /// Phase.
    pub phase: Phase,
    /// Epoch held (0 before attach).
    pub epoch: u64,
    /// Last issued tag.
    pub position: Tag,
    /// Volume size in blocks.
    pub size_blocks: u64,
    /// Active (in-sync) replicas.
    pub active: Vec<ReplicaId>,
    /// Replicas being rebuilt.
    pub rebuilding: Vec<ReplicaId>,
    /// Completed rebuilds since attach.
    pub rebuilds_done: u64,
    /// Blocks copied by rebuilds since attach.
    pub blocks_copied: u64,
    /// Block copies repaired since attach.
    pub repairs: u64,
    /// Attaches that could not rule out the loss of acknowledged but
    /// unflushed writes (every replica holding them lost power); each
    /// failed the operations queued at that moment with
    /// [`Error::UnflushedWritesLost`].
    pub lost_unflushed: u64,
    /// Blocks `(layer, lba)` with no copy that passes its checksum on any
    /// attached replica (reads of them fail with [`Error::BadBlock`]; a
    /// rebuild marks them bad on its target; a write replaces them).
    pub lost_blocks: Vec<(u64, u64)>,
    /// Read-fencing ping rounds sent (one round confirms every read that
    /// started before it).
    pub ping_rounds: u64,
    /// Reads completed under read leases (no ping round).
    pub lease_reads: u64,
    /// Read leases granted to this engine.
    pub lease_grants: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    /// Not answering; try again at `retry_at`.
    Down { retry_at: u64 },
    /// Probe sent.
    Probing,
    /// Attach sent.
    Attaching,
    /// Holds our epoch.
    Attached,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Idle,
    Active,
    Rebuilding,
}

#[derive(Debug)]
struct Peer {
    link: Link,
    role: Role,
    info: Option<ReplicaInfo>,
    /// Highest position acknowledged in this epoch.
    acked: Tag,
    /// Highest read-fencing round this replica confirmed the epoch in.
    pinged_ok: u64,
    /// Highest read-fencing round sent to this replica.
    pinged: u64,
    /// End of this replica's read lease on the engine's clock (exclusive;
    /// already reduced for drift and margin).
    lease_until: u64,
    /// A lease request is outstanding.
    lease_asked: bool,
    /// Do not ask before this time (engine clock): the replica granted
    /// nothing (a newer engine waits to attach, or it has no clock).
    lease_next: u64,
}

#[derive(Debug, Clone)]
enum Ctx {
    Probe,
    Attach,
    Op {
        index: u64,
    },
    Flush {
        flush: u64,
    },
    Read {
        op: OpId,
    },
    Ping {
        round: u64,
    },
    Lease {
        /// Engine clock when the request was sent.
        sent: u64,
    },
    RbFlush {
        session: u64,
    },
    RbBegin {
        session: u64,
    },
    RbTags {
        session: u64,
        chunk: u64,
        source: bool,
    },
    RbData {
        session: u64,
        chunk: u64,
    },
    RbCopy {
        session: u64,
        chunk: u64,
    },
    RbEnd {
        session: u64,
    },
    ScrubTags {
        op: OpId,
        chunk: u64,
    },
    Adopt,
    RepairRead {
        bad_on: ReplicaId,
        layer: u64,
        lba: u64,
        /// Replicas already asked for a good copy.
        tried: Vec<ReplicaId>,
        /// Tag of the bad copy, when known: replicas that are not in sync
        /// may supply a copy only if it carries this tag (the same write).
        want: Option<Tag>,
        /// Further layers of the peer asked last to look in for a copy of
        /// `want` (a stale replica may still hold the write in a snapshot
        /// layer that a later DeleteSnapshot merged elsewhere: seed 8306).
        rest: Vec<u64>,
    },
    Repair,
    Detach,
}

#[derive(Debug)]
struct Pending {
    to: ReplicaId,
    deadline: u64,
    ctx: Ctx,
}

#[derive(Debug)]
struct Queued {
    id: OpId,
    op: ClientOp,
}

#[derive(Debug)]
struct Inflight {
    range: Option<(u64, u64)>,
    write: bool,
    exclusive: bool,
}

#[derive(Debug)]
struct ReadState {
    lba: u64,
    blocks: u32,
    tried: BTreeSet<ReplicaId>,
    data: Option<Bytes>,
    confirmed: BTreeSet<ReplicaId>,
    /// First read-fencing round sent after the read started: a replica
    /// that confirmed the epoch in it (or a later one) confirmed it after
    /// the read started.
    need_round: u64,
    /// Replica the read was last sent to.
    server: Option<ReplicaId>,
    /// Blocks that were bad on every replica that answered so far (`None`
    /// before the first answer).
    bad: Option<BTreeSet<u64>>,
    /// Leases were valid when the read was last sent (only used by the
    /// `lease_checked_at_send` bug).
    leased_at_send: bool,
}

#[derive(Debug)]
struct WriteState {
    op: OpId,
    error: Option<String>,
    /// Engine-side effect applied at completion.
    on_commit: Commit,
}

#[derive(Debug, Clone)]
enum Commit {
    None,
    Layers(Vec<LayerInfo>),
    Size(u64),
}

#[derive(Debug)]
struct FlushState {
    op: OpId,
    waiting: BTreeSet<ReplicaId>,
}

#[derive(Debug, Clone)]
struct Chunk {
    layer: u64,
    lba: u64,
    blocks: u32,
    src: Option<Vec<BlockTag>>,
    tgt: Option<Vec<BlockTag>>,
    diff: Vec<bool>,
    /// The source was asked for the data with its tags.
    with_data: bool,
    /// The source's answer with data, until the target's tags are in.
    src_data: Option<Vec<(BlockTag, Option<Bytes>)>>,
}

#[derive(Debug)]
struct RebuildState {
    session: u64,
    target: ReplicaId,
    source: ReplicaId,
    start: Tag,
    began: bool,
    layers: Vec<u64>,
    layer_idx: usize,
    next_lba: u64,
    chunks: BTreeMap<u64, Chunk>,
    next_chunk: u64,
    /// Ask the source for data with tags (the target's last chunk was empty).
    data_first: bool,
    copy_done: bool,
    incomplete: bool,
    ending: bool,
}

/// One range being scrubbed.
#[derive(Debug)]
struct ScrubChunk {
    layer: u64,
    lba: u64,
    blocks: u32,
    /// Tags per replica that answered.
    tags: BTreeMap<ReplicaId, Vec<BlockTag>>,
    /// Replicas whose answer is awaited or in (a replica that fails
    /// during the scrub is dropped, the scrub goes on with the others).
    asked: BTreeSet<ReplicaId>,
}

#[derive(Debug)]
struct ScrubState {
    layers: Vec<u64>,
    layer_idx: usize,
    next_lba: u64,
    chunks: BTreeMap<u64, ScrubChunk>,
    next_chunk: u64,
    report: ScrubReport,
    /// Replicas that took part in every chunk of this pass.
    covered: Option<BTreeSet<ReplicaId>>,
    /// Passes started (a replica that joined during a pass gets another).
    passes: u32,
}

/// Operation id of the attach barrier (completions for it go nowhere:
/// drivers number client operations from 1 up).
const BARRIER_OP: OpId = u64::MAX;

/// Scrub passes at most per scrub operation.
const MAX_SCRUB_PASSES: u32 = 3;

/// The engine state machine. See the module documentation.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    now: u64,
    /// The driver's monotonic clock (µs), from [`Engine::set_time`]; read
    /// leases are used only once it is set.
    clock: Option<u64>,
    phase: Phase,
    epoch: u64,
    peers: Vec<Peer>,
    position: Tag,
    size_blocks: u64,
    layers: Vec<LayerInfo>,
    next_req: u64,
    pending: BTreeMap<u64, Pending>,
    out: VecDeque<Output>,
    queue: VecDeque<Queued>,
    inflight: BTreeMap<OpId, Inflight>,
    reads: BTreeMap<OpId, ReadState>,
    writes: BTreeMap<u64, WriteState>,
    flushes: BTreeMap<u64, FlushState>,
    next_flush: u64,
    rebuilds: Vec<RebuildState>,
    next_session: u64,
    scrub: Option<(OpId, ScrubState)>,
    detach: Option<(OpId, BTreeSet<ReplicaId>)>,
    rr: usize,
    pumping: bool,
    repump: bool,
    /// Set once attached: a later re-attach must not take the volume from
    /// a newer engine, so seeing a higher epoch then means fenced.
    attached_once: bool,
    /// Highest tag of an ordered operation completed to a client, or
    /// exposed to reads: a re-attach of this engine below it has lost
    /// acknowledged writes.
    acked_pos: Tag,
    /// Every operation a read may observe is held by at least `W` replicas
    /// of this epoch. After an attach the source's position may include
    /// operations that only the source holds (writes of a failed engine
    /// that were never acknowledged): a read that showed one, followed by
    /// a re-attach from the other replicas, would go back in time. Reads
    /// therefore wait until `W` replicas are in sync (like Raft's leader
    /// committing an entry of its term before serving reads).
    ///
    /// In sync means *at this epoch*: every attach issues a barrier (an
    /// ordered no-op, `barrier`) and reads wait until `W` replicas applied
    /// it. Without it the adopted history keeps its old tags: an engine
    /// that adopted `1:14` (and showed its writes to reads) left replicas
    /// at `1:14`, and a later attach preferred a replica at `2:14` from
    /// another unacknowledged branch, losing what reads had seen (zombie
    /// seed 3998, with a read-lease refusal keeping the `2:14` replica out
    /// of the first attach).
    stable: bool,
    /// Index of this attach's barrier.
    barrier: u64,
    /// Position the last attach started from.
    start_pos: Tag,
    /// Highest position any attach of this engine started from: earlier
    /// engines may have acknowledged everything up to it.
    max_start: Tag,
    /// Tick at which the current probe round started.
    probe_started: u64,
    /// Blocks `(layer, lba)` for which a repair found no good copy of the
    /// write `Tag` on any attached replica. A rebuild that meets such a
    /// bad copy on its source records it as bad on the target
    /// ([`CopyEntry::Bad`]) instead of aborting, so one lost block does not
    /// stall every rebuild (and, with one replica in sync, the volume).
    lost: BTreeMap<(u64, u64), Tag>,
    /// Read fencing is coalesced: one ping round, sent to every attached
    /// replica, confirms every read that started before it was sent.
    /// Highest round sent (rounds only grow, also across re-attaches).
    ping_round: u64,
    /// Replicas asked in round `ping_round` that have not answered; the
    /// next round is sent once this round has `W - 1` confirmations (the
    /// serving replica's answer is the W-th) or no
    /// answers outstanding, and a read waits for it.
    ping_waiting: BTreeSet<ReplicaId>,
    status: EngineStatus,
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

impl Engine {
    /// Creates an engine and starts attaching: probes go out immediately.
    pub fn new(cfg: EngineConfig) -> Engine {
        assert!(cfg.replicas > 0, "a volume needs at least one replica");
        let peers = (0..cfg.replicas)
            .map(|_| Peer {
                link: Link::Down { retry_at: 0 },
                role: Role::Idle,
                info: None,
                acked: Tag::default(),
                pinged_ok: 0,
                pinged: 0,
                lease_until: 0,
                lease_asked: false,
                lease_next: 0,
            })
            .collect();
        let mut e = Engine {
            now: 0,
            clock: None,
            phase: Phase::Probing,
            epoch: 0,
            peers,
            position: Tag::default(),
            size_blocks: 0,
            layers: Vec::new(),
            next_req: 1,
            pending: BTreeMap::new(),
            out: VecDeque::new(),
            queue: VecDeque::new(),
            inflight: BTreeMap::new(),
            reads: BTreeMap::new(),
            writes: BTreeMap::new(),
            flushes: BTreeMap::new(),
            next_flush: 1,
            rebuilds: Vec::new(),
            next_session: 1,
            scrub: None,
            detach: None,
            rr: 0,
            pumping: false,
            repump: false,
            attached_once: false,
            acked_pos: Tag::default(),
            stable: false,
            barrier: 0,
            start_pos: Tag::default(),
            max_start: Tag::default(),
            probe_started: 0,
            lost: BTreeMap::new(),
            ping_round: 0,
            ping_waiting: BTreeSet::new(),
            status: EngineStatus {
                phase: Phase::Probing,
                epoch: 0,
                position: Tag::default(),
                size_blocks: 0,
                active: vec![],
                rebuilding: vec![],
                rebuilds_done: 0,
                blocks_copied: 0,
                repairs: 0,
                lost_unflushed: 0,
                lost_blocks: vec![],
                ping_rounds: 0,
                lease_reads: 0,
                lease_grants: 0,
            },
            cfg,
        };
        for r in 0..e.peers.len() {
            e.probe(r);
        }
        e
    }

    fn w(&self) -> usize {
        self.cfg.min_write_replicas.clamp(1, self.cfg.replicas)
    }

    fn r_quorum(&self) -> usize {
        self.cfg.replicas - self.w() + 1
    }

    /// Volume size in blocks (0 before attach).
    pub fn size_blocks(&self) -> u64 {
        self.size_blocks
    }

    /// Current phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Status snapshot.
    pub fn status(&self) -> EngineStatus {
        let mut s = self.status.clone();
        s.phase = self.phase;
        s.epoch = self.epoch;
        s.position = self.position;
        s.size_blocks = self.size_blocks;
        s.active = self.ids(Role::Active);
        s.rebuilding = self.ids(Role::Rebuilding);
        s.lost_blocks = self.lost.keys().copied().collect();
        s
    }

    /// Snapshots, oldest first.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        let n = self.layers.len().saturating_sub(1);
        self.layers[..n]
            .iter()
            .map(|l| SnapshotInfo {
                name: l.name.clone(),
                layer: l.id,
                created: l.created,
            })
            .collect()
    }

    fn ids(&self, role: Role) -> Vec<ReplicaId> {
        (0..self.peers.len())
            .filter(|&i| self.peers[i].role == role)
            .collect()
    }

    fn active_count(&self) -> usize {
        self.peers.iter().filter(|p| p.role == Role::Active).count()
    }

    /// Takes the next output, if any.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.out.pop_front()
    }

    fn send(&mut self, to: ReplicaId, req: Request, ctx: Ctx) -> u64 {
        let id = self.next_req;
        self.next_req += 1;
        self.pending.insert(
            id,
            Pending {
                to,
                deadline: self.now + self.cfg.request_timeout,
                ctx,
            },
        );
        self.out.push_back(Output::Send {
            to,
            frame: ReqFrame { id, req },
        });
        id
    }

    fn complete(&mut self, id: OpId, result: Result<OpOutput, Error>) {
        self.inflight.remove(&id);
        self.out.push_back(Output::Complete { id, result });
    }

    /// Submits a client operation; its completion comes out of
    /// [`Engine::poll_output`].
    pub fn submit(&mut self, id: OpId, op: ClientOp) {
        if let Err(e) = self.validate(&op) {
            self.out.push_back(Output::Complete { id, result: Err(e) });
            return;
        }
        match self.phase {
            Phase::Fenced => {
                let epoch = self.epoch;
                self.out.push_back(Output::Complete {
                    id,
                    result: Err(Error::Fenced { epoch }),
                });
                return;
            }
            Phase::Detached => {
                self.out.push_back(Output::Complete {
                    id,
                    result: Err(Error::Detached),
                });
                return;
            }
            _ => {}
        }
        if self.queue.len() >= self.cfg.max_queued {
            self.out.push_back(Output::Complete {
                id,
                result: Err(Error::Busy {
                    what: "too many queued operations".into(),
                }),
            });
            return;
        }
        self.queue.push_back(Queued { id, op });
        self.pump();
    }

    fn validate(&self, op: &ClientOp) -> Result<(), Error> {
        let check = |lba: u64, n: u64| -> Result<(), Error> {
            if n == 0 || n > MAX_IO_BLOCKS as u64 {
                return Err(Error::TooLarge {
                    len: n * BLOCK_SIZE as u64,
                    max: (MAX_IO_BLOCKS * BLOCK_SIZE) as u64,
                });
            }
            if self.phase == Phase::Running
                && lba.checked_add(n).is_none_or(|e| e > self.size_blocks)
            {
                return Err(Error::OutOfRange {
                    offset: lba.saturating_mul(BLOCK_SIZE as u64),
                    len: n * BLOCK_SIZE as u64,
                    size: self.size_blocks * BLOCK_SIZE as u64,
                });
            }
            Ok(())
        };
        match op {
            ClientOp::Read { lba, blocks } | ClientOp::Zero { lba, blocks } => {
                check(*lba, *blocks as u64)
            }
            ClientOp::Write { lba, data } => {
                if data.is_empty() || data.len() % BLOCK_SIZE != 0 {
                    return Err(Error::Unaligned {
                        offset: lba.saturating_mul(BLOCK_SIZE as u64),
                        len: data.len() as u64,
                    });
                }
                check(*lba, (data.len() / BLOCK_SIZE) as u64)
            }
            ClientOp::Snapshot { name } => {
                if name.is_empty() || name.len() > MAX_NAME_LEN {
                    return Err(Error::InvalidArgument(format!(
                        "snapshot name must be 1..={MAX_NAME_LEN} bytes"
                    )));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn op_shape(op: &ClientOp) -> Inflight {
        match op {
            ClientOp::Read { lba, blocks } => Inflight {
                range: Some((*lba, lba + *blocks as u64)),
                write: false,
                exclusive: false,
            },
            ClientOp::Write { lba, data } => Inflight {
                range: Some((*lba, lba + (data.len() / BLOCK_SIZE) as u64)),
                write: true,
                exclusive: false,
            },
            ClientOp::Zero { lba, blocks } => Inflight {
                range: Some((*lba, lba + *blocks as u64)),
                write: true,
                exclusive: false,
            },
            ClientOp::Flush | ClientOp::Snapshot { .. } | ClientOp::Scrub => Inflight {
                range: None,
                write: false,
                exclusive: false,
            },
            ClientOp::DeleteSnapshot { .. }
            | ClientOp::Revert { .. }
            | ClientOp::Resize { .. }
            | ClientOp::Detach => Inflight {
                range: None,
                write: true,
                exclusive: true,
            },
        }
    }

    fn conflicts(a: &Inflight, b: &Inflight) -> bool {
        if a.exclusive || b.exclusive {
            return true;
        }
        match (a.range, b.range) {
            (Some(x), Some(y)) => (a.write || b.write) && overlaps(x, y),
            _ => false,
        }
    }

    fn writes_allowed(&self) -> bool {
        self.active_count() >= self.w()
    }

    fn pump(&mut self) {
        if self.pumping {
            self.repump = true;
            return;
        }
        self.pumping = true;
        loop {
            self.repump = false;
            self.pump_once();
            if !self.repump {
                break;
            }
        }
        self.pumping = false;
    }

    fn pump_once(&mut self) {
        if self.phase != Phase::Running {
            return;
        }
        let mut i = 0;
        let mut blocked: Vec<Inflight> = Vec::new();
        while i < self.queue.len() {
            if self.inflight.len() >= self.cfg.max_inflight {
                break;
            }
            let shape = Self::op_shape(&self.queue[i].op);
            let conflict = self.inflight.values().any(|f| Self::conflicts(f, &shape))
                || blocked.iter().any(|f| Self::conflicts(f, &shape));
            let needs_quorum = !matches!(self.queue[i].op, ClientOp::Read { .. } | ClientOp::Scrub);
            let can_run = if needs_quorum {
                self.writes_allowed()
            } else {
                self.stable && self.active_count() > 0
            };
            if !can_run && needs_quorum && self.cfg.on_quorum_loss == QuorumLossPolicy::Fail {
                let q = self.queue.remove(i).expect("index in range");
                let (have, need) = (self.active_count(), self.w());
                self.out.push_back(Output::Complete {
                    id: q.id,
                    result: Err(Error::QuorumLost { have, need }),
                });
                continue;
            }
            let admin = matches!(
                self.queue[i].op,
                ClientOp::Snapshot { .. }
                    | ClientOp::DeleteSnapshot { .. }
                    | ClientOp::Revert { .. }
                    | ClientOp::Resize { .. }
            );
            // Layer changes wait for running rebuilds (which copy layer by layer).
            let can_run = can_run && (!admin || self.rebuilds.is_empty());
            if conflict || !can_run {
                blocked.push(shape);
                i += 1;
                continue;
            }
            let q = self.queue.remove(i).expect("index in range");
            self.inflight.insert(q.id, shape);
            self.start(q);
        }
    }

    /// A write to the head replaces lost blocks there. (Should the write
    /// fail, a rebuild meeting the bad copy finds it lost again after one
    /// more repair attempt.)
    fn forget_lost(&mut self, lba: u64, blocks: u64) {
        if let Some(head) = self.layers.last().map(|l| l.id) {
            let end = lba.saturating_add(blocks);
            self.lost
                .retain(|&(l, b), _| l != head || b < lba || b >= end);
        }
    }

    fn start(&mut self, q: Queued) {
        let id = q.id;
        match q.op {
            ClientOp::Read { lba, blocks } => {
                self.reads.insert(
                    id,
                    ReadState {
                        lba,
                        blocks,
                        tried: BTreeSet::new(),
                        data: None,
                        confirmed: BTreeSet::new(),
                        need_round: self.ping_round + 1,
                        server: None,
                        bad: None,
                        leased_at_send: false,
                    },
                );
                self.read_attempt(id);
            }
            ClientOp::Write { lba, data } => {
                self.forget_lost(lba, (data.len() / BLOCK_SIZE) as u64);
                self.issue(id, Op::Write { lba, data }, Commit::None)
            }
            ClientOp::Zero { lba, blocks } => {
                self.forget_lost(lba, blocks as u64);
                self.issue(id, Op::Zero { lba, blocks }, Commit::None)
            }
            ClientOp::Flush => {
                let flush = self.next_flush;
                self.next_flush += 1;
                let targets = self.ids(Role::Active);
                for &r in &targets {
                    self.send(
                        r,
                        Request::Flush { epoch: self.epoch },
                        Ctx::Flush { flush },
                    );
                }
                self.flushes.insert(
                    flush,
                    FlushState {
                        op: id,
                        waiting: targets.into_iter().collect(),
                    },
                );
                self.check_flushes();
            }
            ClientOp::Snapshot { name } => {
                if let Err(e) = self.admin_check() {
                    return self.complete(id, Err(e));
                }
                if self.layers.iter().any(|l| l.name == name) {
                    return self.complete(
                        id,
                        Err(Error::InvalidArgument(format!("snapshot {name:?} exists"))),
                    );
                }
                if self.layers.len() >= MAX_LAYERS {
                    return self
                        .complete(id, Err(Error::InvalidArgument("too many snapshots".into())));
                }
                let new_head = self.layers.iter().map(|l| l.id).max().unwrap_or(0) + 1;
                let tag = Tag::new(self.epoch, self.position.index + 1);
                let mut layers = self.layers.clone();
                if let Some(h) = layers.last_mut() {
                    h.name = name.clone();
                    h.created = tag;
                }
                layers.push(LayerInfo {
                    id: new_head,
                    name: String::new(),
                    created: tag,
                });
                self.issue(id, Op::Snapshot { name, new_head }, Commit::Layers(layers));
            }
            ClientOp::DeleteSnapshot { name } => {
                if let Err(e) = self.admin_check() {
                    return self.complete(id, Err(e));
                }
                let n = self.layers.len() - 1;
                let Some(li) = self.layers[..n].iter().position(|l| l.name == name) else {
                    return self.complete(id, Err(Error::SnapshotNotFound { name }));
                };
                let layer = self.layers[li].id;
                let mut layers = self.layers.clone();
                layers.remove(li);
                self.issue(id, Op::DeleteSnapshot { layer }, Commit::Layers(layers));
            }
            ClientOp::Revert { name } => {
                if let Err(e) = self.admin_check() {
                    return self.complete(id, Err(e));
                }
                let n = self.layers.len() - 1;
                let Some(li) = self.layers[..n].iter().position(|l| l.name == name) else {
                    return self.complete(id, Err(Error::SnapshotNotFound { name }));
                };
                let layer = self.layers[li].id;
                let new_head = self.layers.iter().map(|l| l.id).max().unwrap_or(0) + 1;
                let tag = Tag::new(self.epoch, self.position.index + 1);
                let mut layers: Vec<LayerInfo> = self.layers[..=li].to_vec();
                layers.push(LayerInfo {
                    id: new_head,
                    name: String::new(),
                    created: tag,
                });
                self.issue(id, Op::Revert { layer, new_head }, Commit::Layers(layers));
            }
            ClientOp::Resize { size_blocks } => {
                if let Err(e) = self.admin_check() {
                    return self.complete(id, Err(e));
                }
                if size_blocks < self.size_blocks {
                    return self.complete(
                        id,
                        Err(Error::InvalidArgument(format!(
                            "cannot shrink from {} to {} blocks",
                            self.size_blocks, size_blocks
                        ))),
                    );
                }
                self.issue(id, Op::Resize { size_blocks }, Commit::Size(size_blocks));
            }
            ClientOp::Scrub => {
                if self.scrub.is_some() {
                    return self.complete(
                        id,
                        Err(Error::Busy {
                            what: "scrub".into(),
                        }),
                    );
                }
                let st = ScrubState {
                    layers: self.layers.iter().map(|l| l.id).collect(),
                    layer_idx: 0,
                    next_lba: 0,
                    chunks: BTreeMap::new(),
                    next_chunk: 0,
                    report: ScrubReport::default(),
                    covered: None,
                    passes: 1,
                };
                self.scrub = Some((id, st));
                self.scrub_pump();
            }
            ClientOp::Detach => {
                let targets: BTreeSet<ReplicaId> = (0..self.peers.len())
                    .filter(|&r| self.peers[r].link == Link::Attached)
                    .collect();
                for &r in &targets {
                    self.send(r, Request::Detach { epoch: self.epoch }, Ctx::Detach);
                }
                self.detach = Some((id, targets));
                self.check_detach();
            }
        }
    }

    fn admin_check(&self) -> Result<(), Error> {
        if !self.rebuilds.is_empty() {
            return Err(Error::Busy {
                what: "a replica is rebuilding".into(),
            });
        }
        Ok(())
    }

    /// Sets the engine's clock: a monotonic reading in µs (a reading below
    /// the last one is ignored). Read leases are checked against it when a
    /// read completes, so a driver that uses leases must call it before
    /// every [`Engine::step`], [`Engine::submit`] and [`Engine::tick`]
    /// (after the event it is about to feed arrived): a process that was
    /// paused longer than a lease must not act on a reading from before
    /// the pause. Request timeouts still count ticks.
    pub fn set_time(&mut self, now_us: u64) {
        self.clock = Some(self.clock.map_or(now_us, |c| c.max(now_us)));
    }

    /// Advances time by one tick: expires requests, retries failed replicas,
    /// drives rebuilds.
    pub fn tick(&mut self) {
        self.now += 1;
        let expired: Vec<(u64, ReplicaId)> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= self.now)
            .map(|(&id, p)| (id, p.to))
            .collect();
        let mut failed = BTreeSet::new();
        for (_, to) in expired {
            failed.insert(to);
        }
        for r in failed {
            self.peer_failed(r, "request timed out");
        }
        for r in 0..self.peers.len() {
            if let Link::Down { retry_at } = self.peers[r].link
                && retry_at <= self.now
                && !matches!(self.phase, Phase::Fenced | Phase::Detached)
            {
                self.probe(r);
            }
        }
        self.maybe_choose_epoch();
        if self.phase == Phase::Running {
            self.maybe_start_rebuilds();
            let sessions: Vec<u64> = self.rebuilds.iter().map(|rb| rb.session).collect();
            for s in sessions {
                self.rb_pump(s);
            }
            self.pump_leases();
            self.pump_pings();
        }
        self.pump();
    }

    fn peer_failed(&mut self, r: ReplicaId, why: &str) {
        self.peer_failed_with(r, why, None);
    }

    /// Like [`Engine::peer_failed`], for a failure seen in the answer to a
    /// request whose context `ctx` was already taken off the pending list:
    /// that request is retried elsewhere or dropped like the others to `r`.
    fn peer_failed_with(&mut self, r: ReplicaId, why: &str, ctx: Option<Ctx>) {
        if matches!(self.phase, Phase::Fenced | Phase::Detached) {
            return;
        }
        debug!(replica = r, why, "replica failed");
        let was = self.peers[r].role;
        self.peers[r].link = Link::Down {
            retry_at: self.now + self.cfg.rejoin_interval,
        };
        self.peers[r].role = Role::Idle;
        self.peers[r].info = None;
        // Its answer to the current ping round will not come: ask it again
        // once it is back if reads still wait for that round.
        self.peers[r].pinged = 0;
        if was == Role::Active {
            warn!(
                replica = r,
                why,
                active = self.active_count(),
                "replica left the active set"
            );
        }
        let ids: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.to == r)
            .map(|(&id, _)| id)
            .collect();
        let mut ctxs: Vec<Ctx> = ctx.into_iter().collect();
        for id in ids {
            if let Some(p) = self.pending.remove(&id) {
                ctxs.push(p.ctx);
            }
        }
        // Abort rebuilds that involve r.
        let aborted: Vec<usize> = (0..self.rebuilds.len())
            .filter(|&i| self.rebuilds[i].target == r || self.rebuilds[i].source == r)
            .collect();
        for i in aborted.into_iter().rev() {
            let rb = self.rebuilds.remove(i);
            if rb.target != r {
                // Target stays attached but must start over.
                self.peers[rb.target].role = Role::Idle;
            }
        }
        for f in self.flushes.values_mut() {
            f.waiting.remove(&r);
        }
        if let Some((_, w)) = &mut self.detach {
            w.remove(&r);
        }
        for ctx in ctxs {
            match ctx {
                Ctx::Read { op } => {
                    if let Some(rs) = self.reads.get_mut(&op) {
                        rs.confirmed.remove(&r);
                    }
                    self.read_attempt(op);
                }
                Ctx::Ping { round } => {
                    if round == self.ping_round {
                        self.ping_waiting.remove(&r);
                    }
                    self.pump_pings();
                }
                // The replica's promise (if it made one) stands; ask again
                // once it is back.
                Ctx::Lease { .. } => self.peers[r].lease_asked = false,
                Ctx::ScrubTags { op, chunk } => self.scrub_drop(op, chunk, r),
                Ctx::RepairRead {
                    bad_on,
                    layer,
                    lba,
                    tried,
                    want,
                    ..
                } if bad_on != r => {
                    self.schedule_repair_from(bad_on, layer, lba, tried, want);
                }
                _ => {}
            }
        }
        if self.phase == Phase::Running {
            let (have, need) = (self.active_count(), self.w());
            if have < need && self.cfg.on_quorum_loss == QuorumLossPolicy::Fail {
                // Failed writes may be applied on fewer than W replicas.
                if !self.writes.is_empty() {
                    self.stable = false;
                }
                let ws: Vec<(u64, OpId)> = self.writes.iter().map(|(&k, v)| (k, v.op)).collect();
                for (k, op) in ws {
                    self.writes.remove(&k);
                    self.complete(op, Err(Error::QuorumLost { have, need }));
                }
                let fs: Vec<(u64, OpId)> = self.flushes.iter().map(|(&k, v)| (k, v.op)).collect();
                for (k, op) in fs {
                    self.flushes.remove(&k);
                    self.complete(op, Err(Error::QuorumLost { have, need }));
                }
            }
            if have == 0 {
                return self.reattach();
            }
        }
        self.check_commits();
        self.check_flushes();
        self.check_detach();
        if self.phase == Phase::Attaching {
            self.try_finish_attach();
        }
    }

    fn fail_all(&mut self, e: impl Fn() -> Error) {
        self.pending.clear();
        let mut ops: Vec<OpId> = Vec::new();
        ops.extend(self.queue.drain(..).map(|q| q.id));
        ops.extend(self.writes.values().map(|w| w.op));
        self.writes.clear();
        ops.extend(self.reads.keys().copied());
        self.reads.clear();
        ops.extend(self.flushes.values().map(|f| f.op));
        self.flushes.clear();
        if let Some((op, _)) = self.scrub.take() {
            ops.push(op);
        }
        if let Some((op, _)) = self.detach.take() {
            ops.push(op);
        }
        self.rebuilds.clear();
        ops.sort_unstable();
        ops.dedup();
        for op in ops {
            self.complete(op, Err(e()));
        }
        self.inflight.clear();
    }

    /// Tells the engine its connection to `r` broke (pending requests to it
    /// will never be answered).
    pub fn disconnected(&mut self, r: ReplicaId) {
        if r < self.peers.len() && self.peers[r].link != (Link::Down { retry_at: 0 }) {
            if matches!(self.peers[r].link, Link::Down { .. }) {
                return;
            }
            self.peer_failed(r, "disconnected");
        }
    }

    /// Feeds a response from replica `from`.
    pub fn step(&mut self, from: ReplicaId, id: u64, resp: Response) {
        let Some(p) = self.pending.get(&id) else {
            return; // late, duplicate or cancelled
        };
        if p.to != from {
            return;
        }
        let Some(p) = self.pending.remove(&id) else {
            return;
        };
        if matches!(self.phase, Phase::Fenced | Phase::Detached) {
            return;
        }
        if let Response::Refused(r) = &resp {
            match r {
                Refusal::StaleEpoch { current }
                    if *current > self.epoch
                        || (*current == self.epoch && self.phase == Phase::Attaching) =>
                {
                    // Another engine holds this epoch or a newer one (two
                    // engines chose the same epoch: the one refused lost).
                    // Never take the volume back from it.
                    return self.fence(*current);
                }
                Refusal::StaleEpoch { current }
                    if *current == self.epoch && self.phase == Phase::Running =>
                {
                    // The other engine that chose our epoch reached this
                    // replica first (it lost on the others and is fenced);
                    // the replica never accepts our attach at this epoch:
                    // attach again above it.
                    warn!(
                        replica = from,
                        epoch = self.epoch,
                        "epoch taken on a replica by another engine; re-attaching above it"
                    );
                    return self.reattach();
                }
                Refusal::Invalid(_) if matches!(p.ctx, Ctx::RepairRead { .. }) => {
                    // A replica that is not in sync may lack the layer or
                    // range: ask the next one.
                    if let Ctx::RepairRead {
                        bad_on,
                        layer,
                        lba,
                        tried,
                        want,
                        rest,
                    } = p.ctx
                    {
                        self.repair_next(bad_on, layer, lba, tried, want, rest);
                    }
                    return;
                }
                Refusal::Invalid(msg) if matches!(p.ctx, Ctx::Op { .. }) => {
                    // The op was refused as invalid but kept the sequence.
                    if let Ctx::Op { index } = p.ctx
                        && let Some(ws) = self.writes.get_mut(&index)
                    {
                        ws.error = Some(msg.clone());
                    }
                    let pos = Tag::new(
                        self.epoch,
                        match p.ctx {
                            Ctx::Op { index } => index,
                            _ => 0,
                        },
                    );
                    self.peers[from].acked = self.peers[from].acked.max(pos);
                    self.check_commits();
                    return;
                }
                other => {
                    let why = format!("refused: {other:?}");
                    return self.peer_failed_with(from, &why, Some(p.ctx));
                }
            }
        }
        match p.ctx {
            Ctx::Probe => self.on_probe(from, resp),
            Ctx::Attach => self.on_attach(from, resp),
            Ctx::Op { .. } => {
                if let Response::Ack(pos) = resp {
                    self.peers[from].acked = self.peers[from].acked.max(pos);
                    self.check_commits();
                } else {
                    self.peer_failed(from, "bad op answer");
                }
            }
            Ctx::Flush { flush } => {
                if let Some(f) = self.flushes.get_mut(&flush) {
                    f.waiting.remove(&from);
                }
                self.check_flushes();
            }
            Ctx::Read { op } => self.on_read(op, from, resp),
            Ctx::Ping { round } => self.on_ping(from, round, resp),
            Ctx::Lease { sent } => self.on_lease(from, sent, resp),
            Ctx::RbFlush { session } => self.rb_send_begin(session),
            Ctx::RbBegin { session } => self.rb_begun(session, resp),
            Ctx::RbTags {
                session,
                chunk,
                source,
            } => self.rb_tags(session, chunk, source, resp),
            Ctx::RbData { session, chunk } => self.rb_data(session, chunk, resp),
            Ctx::RbCopy { session, chunk } => {
                if let Some(rb) = self.rebuilds.iter_mut().find(|rb| rb.session == session) {
                    rb.chunks.remove(&chunk);
                }
                self.rb_pump(session);
            }
            Ctx::RbEnd { session } => self.rb_end(session, resp),
            Ctx::ScrubTags { op, chunk } => self.scrub_tags(op, chunk, from, resp),
            Ctx::RepairRead {
                bad_on,
                layer,
                lba,
                tried,
                want,
                rest,
            } => self.on_repair_read(bad_on, layer, lba, tried, want, rest, resp),
            Ctx::Repair => {}
            Ctx::Adopt => {
                if let Response::Info(info) = resp {
                    self.peers[from].info = Some(info);
                }
            }
            Ctx::Detach => {
                if let Some((_, w)) = &mut self.detach {
                    w.remove(&from);
                }
                self.check_detach();
            }
        }
    }

    /// Concatenates read data (helper for drivers that split requests).
    pub fn join(parts: &[Bytes]) -> Bytes {
        let mut b = BytesMut::new();
        for p in parts {
            b.extend_from_slice(p);
        }
        b.freeze()
    }
}
