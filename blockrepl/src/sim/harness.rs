// SPDX-License-Identifier: Apache-2.0
//! The simulation harness: one seeded run of engines, replicas, disks,
//! network and clients, with faults, then heal, then the oracle.
//!
//! Everything is a discrete event on one queue ordered by (time, sequence);
//! every choice comes from one [`Prng`]; so a seed replays exactly.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use bytes::Bytes;

use super::disk::{DiskFaults, SimDisk};
use super::oracle::{self, OpKind, OpRecord, ReadValue, Verdict};
use super::rng::Prng;
use crate::proto::engine::{Bugs, ClientOp, Engine, EngineConfig, OpOutput, Output, Phase};
use crate::proto::msg::{ReqFrame, RespFrame};
use crate::proto::replica::ReplicaCore;
use crate::store::Store;

/// Extent (redirect-on-write) threshold of the simulated stores, in
/// blocks: the workload's two-block writes take the extent path.
pub const SIM_EXTENT_BLOCKS: u32 = 2;
use crate::store::disk::StoreDir;
use crate::types::{BLOCK_SIZE, BlockTag, ReplicaState};

/// Parameters of one run.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The seed.
    pub seed: u64,
    /// Replicas `N`.
    pub replicas: usize,
    /// `min_write_replicas`.
    pub w: usize,
    /// Volume size in blocks.
    pub blocks: u64,
    /// Concurrent clients.
    pub clients: usize,
    /// Operations per client.
    pub ops_per_client: usize,
    /// Inject faults.
    pub faults: bool,
    /// Deliberate protocol bugs (to prove the oracle catches them).
    pub bugs: Bugs,
    /// Inject only partitions and engine pauses (zombie engines): the
    /// scenario that read fencing exists for.
    pub zombie_faults_only: bool,
    /// Read lease asked by engines and the most replicas grant (µs of
    /// their own clocks); 0 turns leases off (ping rounds only).
    pub read_lease_us: u64,
    /// Clients stay with their engine after a failover (each with even
    /// odds) until it is fenced: a zombie engine keeps serving a client
    /// (its VM) while a newer engine serves the others. This is what makes
    /// a stale read possible at all; without it every client moves to the
    /// new engine.
    pub zombie_clients: bool,
    /// Clock rate error bound `ρ` (ppm): every node's clock runs at a
    /// rate drawn from `[1−ρ, 1+ρ]` with a random offset; engines are
    /// told this bound.
    pub drift_ppm: u64,
}

impl SimConfig {
    /// The default workload for `seed`.
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            replicas: 3,
            w: 2,
            blocks: 16,
            clients: 3,
            ops_per_client: 25,
            faults: true,
            bugs: Bugs::default(),
            zombie_faults_only: false,
            read_lease_us: 50_000,
            zombie_clients: false,
            drift_ppm: 50_000,
        }
    }
}

/// Outcome of one run.
#[derive(Clone, Debug, Default)]
pub struct SimReport {
    /// The seed.
    pub seed: u64,
    /// Fault events injected.
    pub faults: u64,
    /// Operations checked by the oracle.
    pub ops_checked: u64,
    /// Client operations that completed successfully.
    pub ops_ok: u64,
    /// Violations found (must be empty).
    pub violations: Vec<String>,
    /// Acknowledged writes lost.
    pub acked_lost: u64,
    /// Blocks that differ between replicas after heal.
    pub divergent: u64,
    /// Simulated time at the end (µs).
    pub sim_time: u64,
    /// Engine failovers.
    pub failovers: u64,
    /// Reads completed under read leases, over every engine.
    pub lease_reads: u64,
    /// Read-fencing ping rounds sent, over every engine.
    pub ping_rounds: u64,
}

const TICK: u64 = 1_000; // µs per engine tick
const CLIENT_TIMEOUT: u64 = 3_000_000;

#[derive(Debug)]
enum Ev {
    /// Request to replica `to` from engine `eg`.
    ToReplica {
        to: usize,
        eg: u32,
        frame: ReqFrame,
        sent: u64,
    },
    /// Response from replica `from` to engine `eg`.
    ToEngine {
        eg: u32,
        from: usize,
        frame: RespFrame,
    },
    Tick {
        eg: u32,
    },
    ClientNext {
        client: usize,
    },
    ClientTimeout {
        client: usize,
        op: usize,
    },
    Fault,
    RestartReplica {
        r: usize,
    },
    HealPartition {
        r: usize,
    },
    ClearDisk {
        r: usize,
    },
    ResumeEngine {
        eg: u32,
    },
    StartEngine,
    NetCalm,
}

/// A node's monotonic clock: `offset + t·rate` for simulated time `t`.
#[derive(Clone, Copy, Debug)]
pub struct SimClock {
    /// Rate in ppm of real time (1,000,000 = exact).
    pub rate_ppm: u64,
    /// Reading at simulated time 0 (µs).
    pub offset: u64,
}

impl SimClock {
    /// A clock with a rate in `[1−ρ, 1+ρ]` and a random offset.
    pub fn random(rng: &mut Prng, drift_ppm: u64) -> SimClock {
        let d = drift_ppm.min(999_999);
        SimClock {
            rate_ppm: rng.range(1_000_000 - d, 1_000_000 + d + 1),
            offset: rng.range(0, 1 << 40),
        }
    }

    /// The reading at simulated time `t` (µs).
    pub fn read(&self, t: u64) -> u64 {
        self.offset + (t as u128 * self.rate_ppm as u128 / 1_000_000) as u64
    }
}

struct ReplicaNode {
    clock: SimClock,
    disk: SimDisk,
    core: Option<ReplicaCore>,
    busy_until: u64,
    /// When the replica process last started: older connections are gone.
    boot: u64,
}

struct EngineNode {
    clock: SimClock,
    /// Replaying what arrived during a pause: the engine's last clock
    /// reading is from before the pause (a driver that read its clock and
    /// then stalled), the jump comes after the replay.
    stale_clock: bool,
    engine: Engine,
    alive: bool,
    paused_until: u64,
    /// Events that arrived while paused.
    backlog: Vec<Ev>,
    /// op id → (client, history index)
    ops: BTreeMap<u64, (usize, usize)>,
    /// `EngineStatus::lost_unflushed` last seen.
    lost_seen: u64,
}

struct Client {
    /// Engine this client talks to.
    engine: Option<u32>,
    done: usize,
    pending: Option<usize>,
    seq: u64,
}

/// A replica's logical content: (layer, block) → (tag state, data).
type Image = BTreeMap<(u64, u64), (BlockTag, Option<Vec<u8>>)>;

/// One simulation run.
pub struct Sim {
    cfg: SimConfig,
    rng: Prng,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    events: BTreeMap<usize, Ev>,
    next_ev: usize,
    replicas: Vec<ReplicaNode>,
    engines: Vec<EngineNode>,
    current: Option<u32>,
    clients: Vec<Client>,
    history: Vec<OpRecord>,
    era: u32,
    next_op: u64,
    partitioned: Vec<bool>,
    /// Links (engine, replica) cut until the given time (zombie splits).
    cut_links: BTreeMap<(u32, usize), u64>,
    /// Last delivery time per (engine eg, replica, direction) link: FIFO.
    link_time: BTreeMap<(u32, usize, bool), u64>,
    drop_p: f64,
    dup_p: f64,
    reorder_p: f64,
    faults: u64,
    failovers: u64,
    healing: bool,
    snap_n: u64,
    /// Power losses injected so far (single node or total).
    power_losses: u64,
    /// Replicas that received block damage not known to be repaired.
    damaged: Vec<bool>,
    /// Violations found while running (not by the oracle).
    run_violations: Vec<String>,
    /// Error of the last failed harness operation (final scrub and reads).
    final_error: Option<String>,
    /// Report of the last completed scrub.
    last_scrub: Option<crate::proto::engine::ScrubReport>,
    /// Draws node clocks (its own stream: the workload's stays as it was).
    clock_rng: Prng,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("seed", &self.cfg.seed)
            .field("now", &self.now)
            .finish()
    }
}

/// A one-line summary of a request (no block data), for trace logs.
fn brief_req(req: &crate::proto::msg::Request) -> String {
    use crate::proto::msg::Request as Q;
    match req {
        Q::Op { epoch, tag, op } => {
            let what = match op {
                crate::proto::msg::Op::Write { lba, data } => {
                    format!("write {lba}+{}", data.len() / BLOCK_SIZE)
                }
                crate::proto::msg::Op::Zero { lba, blocks } => format!("zero {lba}+{blocks}"),
                other => format!("{other:?}"),
            };
            format!("Op e{epoch} {tag} {what}")
        }
        Q::Copy {
            epoch,
            session,
            layer,
            lba,
            entries,
        } => format!(
            "Copy e{epoch} s{session} layer {layer} {lba}+{}",
            entries.len()
        ),
        Q::Repair {
            epoch, layer, lba, ..
        } => format!("Repair e{epoch} layer {layer} lba {lba}"),
        other => format!("{other:?}"),
    }
}

/// A one-line summary of a response (no block data), for trace logs.
fn brief_resp(resp: &crate::proto::msg::Response) -> String {
    use crate::proto::msg::Response as A;
    match resp {
        A::Info(i) => format!(
            "Info e{} eng {} {:?} pos {} recovered {}",
            i.epoch, i.engine, i.state, i.position, i.recovered
        ),
        A::Ack(t) => format!("Ack {t}"),
        A::Data { bad, .. } => format!("Data bad {bad:?}"),
        A::Layer(v) => format!("Layer {:?}", v.iter().map(|(t, _)| *t).collect::<Vec<_>>()),
        A::Refused(r) => format!("Refused {r:?}"),
        A::Lease { granted_us } => format!("Lease {granted_us} us"),
    }
}

fn factory(d: &SimDisk) -> crate::proto::replica::DirFactory {
    let d = d.clone();
    Box::new(move || -> Box<dyn StoreDir> { Box::new(d.clone()) })
}

/// Runs one seed and checks it.
pub fn run(cfg: SimConfig) -> SimReport {
    let mut sim = Sim::new(cfg);
    sim.run()
}

impl Sim {
    /// Builds the world for `cfg`.
    pub fn new(cfg: SimConfig) -> Sim {
        let mut rng = Prng::new(cfg.seed);
        let mut clock_rng = Prng::new(cfg.seed ^ 0x5eed_c10c_c10c_5eed);
        let mut replicas = Vec::new();
        for _ in 0..cfg.replicas {
            let disk = SimDisk::new(rng.next_u64());
            let store = Store::create(Box::new(disk.clone()), cfg.blocks, ReplicaState::Clean)
                .unwrap_or_else(|e| panic!("sim store create: {e}"));
            let mut store = store;
            // Small WAL threshold so checkpoints happen often.
            store.set_checkpoint_bytes(64 << 10);
            // Two-block writes take the extent (redirect-on-write) path.
            store.set_extent_threshold(SIM_EXTENT_BLOCKS);
            let mut core = ReplicaCore::new(store, factory(&disk));
            core.set_lease_limit(
                cfg.read_lease_us,
                !cfg.bugs.replica_forgets_lease_on_restart,
            );
            replicas.push(ReplicaNode {
                clock: SimClock::random(&mut clock_rng, cfg.drift_ppm),
                disk,
                core: Some(core),
                busy_until: 0,
                boot: 0,
            });
        }
        let clients = (0..cfg.clients)
            .map(|_| Client {
                engine: None,
                done: 0,
                pending: None,
                seq: 0,
            })
            .collect();
        let n = cfg.replicas;
        Sim {
            rng,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            next_ev: 0,
            replicas,
            engines: Vec::new(),
            current: None,
            clients,
            history: Vec::new(),
            era: 0,
            next_op: 1,
            partitioned: vec![false; n],
            cut_links: BTreeMap::new(),
            link_time: BTreeMap::new(),
            drop_p: 0.0,
            dup_p: 0.0,
            reorder_p: 0.0,
            faults: 0,
            failovers: 0,
            healing: false,
            snap_n: 0,
            power_losses: 0,
            damaged: vec![false; n],
            run_violations: Vec::new(),
            final_error: None,
            last_scrub: None,
            clock_rng,
            cfg,
        }
    }

    fn at(&mut self, t: u64, ev: Ev) {
        let id = self.next_ev;
        self.next_ev += 1;
        self.seq += 1;
        self.events.insert(id, ev);
        self.queue.push(Reverse((t, self.seq, id)));
    }

    fn start_engine(&mut self) {
        let eg = self.engines.len() as u32;
        let mut ecfg = EngineConfig::new(self.cfg.replicas, 1000 + eg as u64);
        ecfg.min_write_replicas = self.cfg.w;
        ecfg.request_timeout = 40;
        ecfg.rejoin_interval = 15;
        ecfg.rebuild_chunk = 8;
        ecfg.bugs = self.cfg.bugs;
        ecfg.read_lease_us = self.cfg.read_lease_us;
        ecfg.clock_drift_ppm = self.cfg.drift_ppm;
        ecfg.lease_margin_us = 1_000;
        let clock = SimClock::random(&mut self.clock_rng, self.cfg.drift_ppm);
        let mut engine = Engine::new(ecfg);
        engine.set_time(clock.read(self.now));
        self.engines.push(EngineNode {
            clock,
            stale_clock: false,
            engine,
            alive: true,
            paused_until: 0,
            backlog: Vec::new(),
            ops: BTreeMap::new(),
            lost_seen: 0,
        });
        self.current = Some(eg);
        for c in 0..self.clients.len() {
            if !self.cfg.zombie_clients || self.clock_rng.chance(0.5) {
                self.clients[c].engine = Some(eg);
            }
        }
        self.drain(eg);
        self.at(self.now + TICK, Ev::Tick { eg });
    }

    /// Runs the workload, the faults, the heal and the checks.
    pub fn run(&mut self) -> SimReport {
        self.start_engine();
        for c in 0..self.clients.len() {
            let t = self.now + self.rng.range(0, 2_000);
            self.at(t, Ev::ClientNext { client: c });
        }
        if self.cfg.faults {
            let t = self.rng.range(2_000, 10_000);
            self.at(t, Ev::Fault);
        }
        // Phase 1: workload under faults.
        let limit = 60_000_000;
        while self.now < limit {
            if self
                .clients
                .iter()
                .all(|c| c.done >= self.cfg.ops_per_client && c.pending.is_none())
            {
                break;
            }
            if !self.step() {
                break;
            }
        }
        let mut report = SimReport {
            seed: self.cfg.seed,
            ..Default::default()
        };
        if self.now >= limit {
            report
                .violations
                .push("workload did not finish (liveness)".into());
        }
        // Phase 2: heal.
        self.heal();
        let deadline = self.now + 20_000_000;
        let mut n = 0u64;
        while self.now < deadline {
            n += 1;
            if n.is_multiple_of(32) && self.converged() {
                break;
            }
            if n.is_multiple_of(32) {
                self.replace_fenced_engine();
            }
            if !self.step() {
                // Nothing left to happen: a fenced engine schedules no
                // ticks (zombie seed 1029 with 200 ms leases: two engines
                // fenced each other at the same epoch right at the end).
                let before = self.engines.len();
                self.replace_fenced_engine();
                if self.engines.len() == before {
                    break;
                }
            }
        }
        if !self.converged() {
            report.violations.push(format!(
                "replicas did not converge after heal: {}",
                self.describe()
            ));
        }
        // Scrub (repairs rot) then read everything back.
        self.final_ops(&mut report);
        self.compare_replicas(&mut report);
        report.violations.append(&mut self.run_violations);
        let v: Verdict = oracle::check(&self.history, self.era);
        report.ops_checked = v.ops_checked;
        report.acked_lost = v.acked_lost;
        report.violations.extend(v.violations);
        report.faults = self.faults + self.replicas.iter().map(|r| r.disk.injected()).sum::<u64>();
        report.ops_ok = self.history.iter().filter(|o| o.complete.is_some()).count() as u64;
        report.sim_time = self.now;
        report.failovers = self.failovers;
        for e in &self.engines {
            let st = e.engine.status();
            report.lease_reads += st.lease_reads;
            report.ping_rounds += st.ping_rounds;
        }
        report
    }

    /// After heal, a paused engine that woke up may re-attach and fence the
    /// engine the clients use (both raced for the volume; either may win).
    /// Like an operator, fail over to a new engine then.
    fn replace_fenced_engine(&mut self) {
        let fenced = self.current.is_some_and(|g| {
            let e = &self.engines[g as usize];
            !e.alive || e.engine.phase() == Phase::Fenced
        });
        if fenced {
            self.failovers += 1;
            self.start_engine();
        }
    }

    /// Replaces a fenced engine and runs until the volume converged again.
    fn settle(&mut self) {
        self.replace_fenced_engine();
        let until = self.now + 2_000_000;
        while self.now < until && !self.converged() && self.step() {}
    }

    fn describe(&self) -> String {
        match self.current {
            Some(g) => format!("{:?}", self.engines[g as usize].engine.status()),
            None => "no engine".into(),
        }
    }

    fn converged(&self) -> bool {
        let Some(g) = self.current else { return false };
        let e = &self.engines[g as usize];
        let st = e.engine.status();
        st.phase == Phase::Running
            && st.active.len() == self.cfg.replicas
            && st.rebuilding.is_empty()
    }

    fn heal(&mut self) {
        self.healing = true;
        self.drop_p = 0.0;
        self.dup_p = 0.0;
        self.reorder_p = 0.0;
        self.cut_links.clear();
        for r in 0..self.replicas.len() {
            self.partitioned[r] = false;
            self.replicas[r].disk.set_faults(DiskFaults {
                slow: 1,
                ..Default::default()
            });
            if self.replicas[r].core.is_none() {
                self.restart_replica(r);
            }
        }
        let need_new = match self.current {
            Some(g) => {
                let e = &self.engines[g as usize];
                !e.alive || matches!(e.engine.phase(), Phase::Fenced | Phase::Detached)
            }
            None => true,
        };
        // Resume any paused engine now.
        for g in 0..self.engines.len() {
            if self.engines[g].paused_until > self.now {
                self.engines[g].paused_until = self.now;
                self.at(self.now, Ev::ResumeEngine { eg: g as u32 });
            }
        }
        if need_new {
            self.failovers += 1;
            self.start_engine();
        }
    }

    /// Processes one event; false if the queue is empty.
    fn step(&mut self) -> bool {
        let Some(Reverse((t, _, id))) = self.queue.pop() else {
            return false;
        };
        self.now = self.now.max(t);
        let Some(ev) = self.events.remove(&id) else {
            return true;
        };
        self.handle(ev);
        true
    }

    fn engine_paused(&self, eg: u32) -> bool {
        let e = &self.engines[eg as usize];
        e.paused_until > self.now
    }

    fn handle(&mut self, ev: Ev) {
        let eg = match &ev {
            Ev::ToEngine { eg, .. } | Ev::Tick { eg } | Ev::ResumeEngine { eg } => Some(*eg),
            _ => None,
        };
        let _span = eg.map(|eg| tracing::debug_span!("engine", eg).entered());
        match ev {
            Ev::ToReplica {
                to,
                eg,
                frame,
                sent,
            } => {
                if self.replicas[to].core.is_none() || sent < self.replicas[to].boot {
                    return;
                }
                if self.replicas[to].busy_until > self.now {
                    let t = self.replicas[to].busy_until;
                    self.at(
                        t,
                        Ev::ToReplica {
                            to,
                            eg,
                            frame,
                            sent,
                        },
                    );
                    return;
                }
                let clock_now = self.replicas[to].clock.read(self.now);
                let Some(core) = self.replicas[to].core.as_mut() else {
                    return;
                };
                let brief = tracing::enabled!(tracing::Level::TRACE).then(|| brief_req(&frame.req));
                core.set_time(clock_now);
                let resp = core.handle(frame.req);
                // Finish a sealed WAL's deferred checkpoint at seeded
                // moments (about one request in eight), so crashes with a
                // sealed WAL outstanding are exercised. Drawn from a hash,
                // not `self.rng`, to keep every seed's fault schedule.
                let h = (self.now ^ ((to as u64) << 48) ^ self.cfg.seed)
                    .wrapping_mul(0x9e37_79b9_7f4a_7c15);
                if h >> 61 == 0
                    && let Some(s) = core.store_mut()
                {
                    // An error leaves the job for the next operation,
                    // which reports it.
                    let _ = s.poll_checkpoint();
                } else if h >> 61 == 1 {
                    // As if the replica had seen no request for a while
                    // (the real driver's idle tick): seals the WAL,
                    // finishes its checkpoint, punches free extent runs.
                    // An error faults the replica.
                    core.idle();
                }
                if let Some(req) = brief {
                    tracing::trace!(
                        replica = to,
                        eg,
                        req,
                        resp = brief_resp(&resp),
                        "replica handled"
                    );
                }
                let lat = self.rng.range(20, 120) * self.replicas[to].disk.latency_factor();
                self.replicas[to].busy_until = self.now + lat;
                let out = RespFrame { id: frame.id, resp };
                let t = self.now + lat;
                self.net_send(
                    t,
                    eg,
                    to,
                    false,
                    Ev::ToEngine {
                        eg,
                        from: to,
                        frame: out,
                    },
                );
            }
            Ev::ToEngine { eg, from, frame } => {
                let g = eg as usize;
                if !self.engines[g].alive {
                    return;
                }
                if self.engine_paused(eg) {
                    self.engines[g]
                        .backlog
                        .push(Ev::ToEngine { eg, from, frame });
                    return;
                }
                if !self.engines[g].stale_clock {
                    let t = self.engines[g].clock.read(self.now);
                    self.engines[g].engine.set_time(t);
                }
                self.engines[g].engine.step(from, frame.id, frame.resp);
                self.drain(eg);
            }
            Ev::Tick { eg } => {
                let g = eg as usize;
                if !self.engines[g].alive
                    || matches!(
                        self.engines[g].engine.phase(),
                        Phase::Fenced | Phase::Detached
                    )
                {
                    return;
                }
                if self.engine_paused(eg) {
                    return; // ResumeEngine restarts ticking
                }
                let t = self.engines[g].clock.read(self.now);
                self.engines[g].engine.set_time(t);
                self.engines[g].engine.tick();
                self.drain(eg);
                self.at(self.now + TICK, Ev::Tick { eg });
            }
            Ev::ResumeEngine { eg } => {
                let g = eg as usize;
                if !self.engines[g].alive || self.engine_paused(eg) {
                    return;
                }
                // The clock ran on during the pause: catch up ticks, then the
                // messages that waited.
                let missed = self.rng.range(30, 80);
                for _ in 0..missed {
                    self.engines[g].engine.tick();
                }
                let backlog = std::mem::take(&mut self.engines[g].backlog);
                self.engines[g].stale_clock = true;
                for ev in backlog {
                    self.handle(ev);
                }
                self.engines[g].stale_clock = false;
                // The clock jumps over the pause.
                let t = self.engines[g].clock.read(self.now);
                self.engines[g].engine.set_time(t);
                self.drain(eg);
                self.at(self.now + TICK, Ev::Tick { eg });
            }
            Ev::ClientNext { client } => self.client_next(client),
            Ev::ClientTimeout { client, op } => {
                if self.clients[client].pending == Some(op) {
                    // "Maybe happened": leave complete = None.
                    self.clients[client].pending = None;
                    self.clients[client].done += 1;
                    let t = self.now + 100;
                    self.at(t, Ev::ClientNext { client });
                }
            }
            Ev::Fault => {
                if !self.healing {
                    self.inject_fault();
                    let t = self.now + self.rng.range(8_000, 60_000);
                    self.at(t, Ev::Fault);
                }
            }
            Ev::RestartReplica { r } => {
                if self.replicas[r].core.is_none() {
                    self.restart_replica(r);
                }
            }
            Ev::HealPartition { r } => self.partitioned[r] = false,
            Ev::ClearDisk { r } => self.replicas[r].disk.set_faults(DiskFaults {
                slow: 1,
                ..Default::default()
            }),
            Ev::StartEngine => {
                let dead = self.current.is_none_or(|g| {
                    let e = &self.engines[g as usize];
                    !e.alive || e.engine.phase() == Phase::Fenced
                });
                if dead || self.current.is_some_and(|g| self.engine_paused(g)) {
                    self.failovers += 1;
                    self.start_engine();
                }
            }
            Ev::NetCalm => {
                self.drop_p = 0.0;
                self.dup_p = 0.0;
                self.reorder_p = 0.0;
            }
        }
    }

    fn restart_replica(&mut self, r: usize) {
        match ReplicaCore::open(factory(&self.replicas[r].disk)) {
            Ok(mut core) => {
                // Leases live in memory: the restart guard covers any the
                // replica granted before it went down.
                core.set_lease_limit(
                    self.cfg.read_lease_us,
                    !self.cfg.bugs.replica_forgets_lease_on_restart,
                );
                core.set_time(self.replicas[r].clock.read(self.now));
                if let Some(s) = core.store_mut() {
                    s.set_checkpoint_bytes(64 << 10);
                    s.set_extent_threshold(SIM_EXTENT_BLOCKS);
                }
                self.replicas[r].core = Some(core);
                self.replicas[r].busy_until = self.now;
                self.replicas[r].boot = self.now;
            }
            Err(e) => {
                // Only full-disk can make recovery fail; retry later.
                let _ = e;
                let t = self.now + 5_000;
                self.at(t, Ev::RestartReplica { r });
            }
        }
    }

    fn net_send(&mut self, t: u64, eg: u32, r: usize, to_replica: bool, ev: Ev) {
        if self.partitioned[r] {
            return;
        }
        if self.cut_links.get(&(eg, r)).is_some_and(|&u| u > self.now) {
            return;
        }
        if self.rng.chance(self.drop_p) {
            return;
        }
        let mut deliver = t + self.rng.range(50, 400);
        let key = (eg, r, to_replica);
        if !self.rng.chance(self.reorder_p) {
            let last = self.link_time.get(&key).copied().unwrap_or(0);
            deliver = deliver.max(last);
            self.link_time.insert(key, deliver);
        }
        if self.rng.chance(self.dup_p) {
            let dup = match &ev {
                Ev::ToReplica {
                    to,
                    eg,
                    frame,
                    sent,
                } => Some(Ev::ToReplica {
                    to: *to,
                    eg: *eg,
                    frame: frame.clone(),
                    sent: *sent,
                }),
                Ev::ToEngine { eg, from, frame } => Some(Ev::ToEngine {
                    eg: *eg,
                    from: *from,
                    frame: frame.clone(),
                }),
                _ => None,
            };
            if let Some(d) = dup {
                let t2 = deliver + self.rng.range(0, 2_000);
                self.at(t2, d);
            }
        }
        self.at(deliver, ev);
    }

    fn drain(&mut self, eg: u32) {
        let g = eg as usize;
        while let Some(o) = self.engines[g].engine.poll_output() {
            match o {
                Output::Send { to, frame } => {
                    let now = self.now;
                    self.net_send(
                        now,
                        eg,
                        to,
                        true,
                        Ev::ToReplica {
                            to,
                            eg,
                            frame,
                            sent: now,
                        },
                    );
                }
                Output::Complete { id, result } => {
                    let Some((client, hi)) = self.engines[g].ops.remove(&id) else {
                        continue;
                    };
                    self.op_done(client, hi, result);
                }
            }
        }
        let lost = self.engines[g].engine.status().lost_unflushed;
        if lost > self.engines[g].lost_seen {
            // The engine reported that acknowledged, unflushed writes may be
            // gone (every replica holding them lost power): for the client
            // this is a disk power cycle, so a new era begins, in which
            // only flushed writes must survive. Legitimate only after a
            // power loss.
            self.engines[g].lost_seen = lost;
            tracing::info!(
                eg,
                era = self.era + 1,
                "engine reported lost unflushed writes"
            );
            if self.power_losses == 0 {
                self.run_violations.push(format!(
                    "engine {eg} reported lost unflushed writes without any power loss"
                ));
            }
            self.era += 1;
        }
    }

    fn op_done(&mut self, client: usize, hi: usize, result: crate::Result<OpOutput>) {
        if client < self.clients.len() && self.clients[client].pending != Some(hi) {
            return; // timed out already
        }
        tracing::debug!(op = hi, ok = result.is_ok(), err = ?result.as_ref().err(), now = self.now, "op done");
        if client == usize::MAX
            && let Err(e) = &result
        {
            self.final_error = Some(e.to_string());
        }
        if let Ok(out) = result {
            let now = self.now;
            if let OpOutput::Scrub(r) = &out {
                self.last_scrub = Some(*r);
            }
            let rec = &mut self.history[hi];
            rec.complete = Some(now);
            if let (OpKind::Read { lba, values }, OpOutput::Data(d)) = (&mut rec.kind, out) {
                let lba = *lba;
                for (k, v) in values.iter_mut().enumerate() {
                    *v = d
                        .get(k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE)
                        .map_or(ReadValue::Garbage, |blk| {
                            oracle::decode_value(lba + k as u64, blk)
                        });
                }
                tracing::debug!(op = hi, ?values, "read returned");
            }
        }
        if client < self.clients.len() {
            self.clients[client].pending = None;
            self.clients[client].done += 1;
            let t = self.now + self.rng.range(0, 1_500);
            self.at(t, Ev::ClientNext { client });
        }
    }

    fn submit(&mut self, client: usize, kind: OpKind, op: ClientOp) -> Option<usize> {
        let eg = self.current?;
        self.submit_to(eg, client, kind, op)
    }

    /// The engine client `client` uses: its own while that one still
    /// serves, else the current one.
    fn client_engine(&mut self, client: usize) -> Option<u32> {
        if let Some(g) = self.clients[client].engine {
            let e = &self.engines[g as usize];
            if e.alive && !matches!(e.engine.phase(), Phase::Fenced | Phase::Detached) {
                return Some(g);
            }
        }
        let g = self.current?;
        self.clients[client].engine = Some(g);
        Some(g)
    }

    fn submit_to(&mut self, eg: u32, client: usize, kind: OpKind, op: ClientOp) -> Option<usize> {
        let hi = self.history.len();
        tracing::debug!(op = hi, eg, client, ?kind, now = self.now, "op submitted");
        self.history.push(OpRecord {
            kind,
            invoke: self.now,
            complete: None,
            era: self.era,
        });
        let id = self.next_op;
        self.next_op += 1;
        let g = eg as usize;
        self.engines[g].ops.insert(id, (client, hi));
        if client < self.clients.len() {
            self.clients[client].pending = Some(hi);
            let t = self.now + CLIENT_TIMEOUT;
            self.at(t, Ev::ClientTimeout { client, op: hi });
        }
        let _span = tracing::debug_span!("engine", eg).entered();
        if self.engines[g].alive && !self.engine_paused(eg) {
            let t = self.engines[g].clock.read(self.now);
            self.engines[g].engine.set_time(t);
            self.engines[g].engine.submit(id, op);
            self.drain(eg);
        } else if self.engines[g].alive {
            // Paused engine: the request waits in its inbox.
            self.engines[g].engine.submit(id, op);
        }
        Some(hi)
    }

    fn client_next(&mut self, client: usize) {
        if self.clients[client].done >= self.cfg.ops_per_client
            || self.clients[client].pending.is_some()
        {
            return;
        }
        let usable = self.current.is_some_and(|g| self.engines[g as usize].alive);
        let eg = self.client_engine(client);
        let Some(eg) = eg.filter(|_| usable) else {
            let t = self.now + 1_000;
            self.at(t, Ev::ClientNext { client });
            return;
        };
        let blocks = self.cfg.blocks;
        let n = self.rng.range(1, 3).min(blocks);
        let lba = self.rng.below(blocks - n + 1);
        let roll = self.rng.below(100);
        if roll < 50 {
            self.clients[client].seq += 1;
            let seq = self.clients[client].seq;
            let mut data = Vec::with_capacity(n as usize * BLOCK_SIZE);
            for b in lba..lba + n {
                data.extend_from_slice(&oracle::encode_value(client as u32, seq, b, eg));
            }
            self.submit_to(
                eg,
                client,
                OpKind::Write {
                    lba,
                    blocks: n as u32,
                    key: (client as u32, seq),
                },
                ClientOp::Write {
                    lba,
                    data: Bytes::from(data),
                },
            );
        } else if roll < 85 {
            self.submit_to(
                eg,
                client,
                OpKind::Read {
                    lba,
                    values: vec![ReadValue::Garbage; n as usize],
                },
                ClientOp::Read {
                    lba,
                    blocks: n as u32,
                },
            );
        } else if roll < 89 {
            self.submit_to(
                eg,
                client,
                OpKind::Zero {
                    lba,
                    blocks: n as u32,
                },
                ClientOp::Zero {
                    lba,
                    blocks: n as u32,
                },
            );
        } else if roll < 97 {
            self.submit_to(eg, client, OpKind::Flush, ClientOp::Flush);
        } else {
            // Snapshot churn: create, and delete the oldest beyond two.
            self.snap_n += 1;
            let name = format!("s{}", self.snap_n);
            let op = if self.snap_n.is_multiple_of(3) {
                ClientOp::DeleteSnapshot {
                    name: format!("s{}", self.snap_n - 2),
                }
            } else {
                ClientOp::Snapshot { name }
            };
            // Not part of the register history: recorded as a flush-less no-op.
            self.submit_to(
                eg,
                client,
                OpKind::Read {
                    lba: 0,
                    values: vec![],
                },
                op,
            );
        }
    }

    fn inject_fault(&mut self) {
        let r = self.rng.below(self.cfg.replicas as u64) as usize;
        self.faults += 1;
        let mut kind = self.rng.below(14);
        if self.cfg.zombie_faults_only && self.cfg.zombie_clients {
            kind = [0, 1, 12, 13][(kind % 4) as usize];
        } else if self.cfg.zombie_faults_only {
            kind = [0, 1, 12][(kind % 3) as usize];
        }
        tracing::info!(kind, replica = r, now = self.now, "fault");
        match kind {
            0 | 1 => {
                // Partition a replica from every engine.
                self.partitioned[r] = true;
                let t = self.now + self.rng.range(5_000, 120_000);
                self.at(t, Ev::HealPartition { r });
            }
            2 | 3 => {
                // Replica process crash (page cache survives).
                self.replicas[r].core = None;
                let t = self.now + self.rng.range(2_000, 80_000);
                self.at(t, Ev::RestartReplica { r });
            }
            4 if self.damage_elsewhere(Some(r)) => {
                // Would leave a damaged copy as the only durable one (see
                // `damage_elsewhere`): not injected.
                self.faults -= 1;
            }
            4 => {
                // Power loss of one node: unsynced writes kept, dropped or torn.
                self.power_losses += 1;
                self.replicas[r].core = None;
                let mut rng = self.rng.fork();
                self.replicas[r].disk.power_loss(&mut rng);
                let t = self.now + self.rng.range(2_000, 80_000);
                self.at(t, Ev::RestartReplica { r });
            }
            5 => {
                // Slow disk, possibly slower than the request timeout.
                let slow = if self.rng.chance(0.5) { 20 } else { 600 };
                let mut f = self.replicas[r].disk.faults();
                f.slow = slow;
                self.replicas[r].disk.set_faults(f);
                let t = self.now + self.rng.range(10_000, 100_000);
                self.at(t, Ev::ClearDisk { r });
            }
            6 => {
                let mut f = self.replicas[r].disk.faults();
                f.full = true;
                self.replicas[r].disk.set_faults(f);
                let t = self.now + self.rng.range(5_000, 50_000);
                self.at(t, Ev::ClearDisk { r });
            }
            7..=9 if !self.damage_allowed(r) => {
                // Would exceed the redundancy: not injected (see
                // `damage_allowed`).
                self.faults -= 1;
            }
            7 => {
                let mut rng = self.rng.fork();
                self.replicas[r].disk.bit_rot(&mut rng);
                self.damaged[r] = true;
            }
            8 => {
                let mut rng = self.rng.fork();
                self.replicas[r].disk.latent_error(&mut rng);
                self.damaged[r] = true;
            }
            9 => {
                self.damaged[r] = true;
                let mut f = self.replicas[r].disk.faults();
                f.misdirect = 0.05;
                self.replicas[r].disk.set_faults(f);
                let t = self.now + self.rng.range(5_000, 30_000);
                self.at(t, Ev::ClearDisk { r });
            }
            10 => {
                // Network trouble: drops, duplicates, reordering.
                self.drop_p = 0.01;
                self.dup_p = 0.02;
                self.reorder_p = 0.01;
                let t = self.now + self.rng.range(5_000, 40_000);
                self.at(t, Ev::NetCalm);
            }
            11 => {
                // Engine crash; a new engine takes over shortly after.
                if let Some(g) = self.current {
                    self.kill_engine(g);
                    let t = self.now + self.rng.range(1_000, 20_000);
                    self.at(t, Ev::StartEngine);
                }
            }
            12 => {
                // Engine pause longer than every timeout; a new engine takes
                // over meanwhile; the old one wakes up as a zombie.
                if let Some(g) = self.current
                    && !self.engine_paused(g)
                {
                    let until = self.now + self.rng.range(100_000, 400_000);
                    self.engines[g as usize].paused_until = until;
                    self.at(until, Ev::ResumeEngine { eg: g });
                    let t = self.now + self.rng.range(1_000, 50_000);
                    self.at(t, Ev::StartEngine);
                }
            }
            13 if self.cfg.zombie_faults_only => {
                // Split: the running engine loses every replica but `r`
                // (its node is cut off; the orchestrator fails over) and
                // a new engine starts at once, while the old one keeps
                // running for its clients (under read leases, until they
                // end on its own clock).
                if let Some(g) = self.current
                    && !self.engine_paused(g)
                {
                    let until = self.now + self.rng.range(20_000, 300_000);
                    for i in 0..self.replicas.len() {
                        if i != r {
                            self.cut_links.insert((g, i), until);
                        }
                    }
                    self.failovers += 1;
                    self.start_engine();
                    // The new engine is on the other side of the split.
                    let b = (self.engines.len() - 1) as u32;
                    self.cut_links.insert((b, r), until);
                    match self.rng.below(3) {
                        0 => {
                            // The old engine also stalls for about a lease:
                            // it wakes to a clock jump, and to client
                            // requests taken in with its last reading.
                            let l = self.cfg.read_lease_us.max(10_000);
                            let pause = self.now + self.rng.range(l / 2, 4 * l);
                            self.engines[g as usize].paused_until = pause;
                            self.at(pause, Ev::ResumeEngine { eg: g });
                        }
                        1 => {
                            // The replicas on the new engine's side restart
                            // (their leases are gone from memory).
                            for i in 0..self.replicas.len() {
                                if i != r && self.replicas[i].core.is_some() {
                                    self.replicas[i].core = None;
                                    let t = self.now + self.rng.range(500, 5_000);
                                    self.at(t, Ev::RestartReplica { r: i });
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            _ => {
                let total = self.rng.chance(0.3);
                if total && self.damage_elsewhere(None) {
                    // See `damage_elsewhere`: not injected.
                    self.faults -= 1;
                } else if total {
                    // Total power loss: every replica and the engine.
                    self.power_losses += 1;
                    for i in 0..self.replicas.len() {
                        self.replicas[i].core = None;
                        let mut rng = self.rng.fork();
                        self.replicas[i].disk.power_loss(&mut rng);
                        let t = self.now + self.rng.range(1_000, 10_000);
                        self.at(t, Ev::RestartReplica { r: i });
                    }
                    for g in 0..self.engines.len() {
                        self.kill_engine(g as u32);
                    }
                    self.era += 1;
                    let t = self.now + 12_000;
                    self.at(t, Ev::StartEngine);
                } else {
                    // Two replicas crash at once.
                    let r2 = (r + 1) % self.replicas.len();
                    for i in [r, r2] {
                        self.replicas[i].core = None;
                        let t = self.now + self.rng.range(2_000, 60_000);
                        self.at(t, Ev::RestartReplica { r: i });
                    }
                }
            }
        }
    }

    /// Whether block damage (bit rot, a latent sector error, misdirected
    /// writes) may hit replica `r` now. Damage must stay within the
    /// redundancy, as a disk fault in a real cluster is repaired before the
    /// next one on another disk (TigerBeetle's simulator keeps the same
    /// rule: it never corrupts the same data on every replica). So damage
    /// goes only to a replica whose content every other replica also holds
    /// (every replica in sync under the current engine) and only while no
    /// other replica carries an unrepaired bad copy. Without this rule a
    /// run can destroy every copy of a block, and no protocol could
    /// recover it.
    fn damage_allowed(&self, r: usize) -> bool {
        let Some(g) = self.current else { return false };
        let e = &self.engines[g as usize];
        if !e.alive || self.engine_paused(g) {
            return false;
        }
        let st = e.engine.status();
        if st.phase != Phase::Running
            || st.active.len() != self.cfg.replicas
            || !st.rebuilding.is_empty()
        {
            return false;
        }
        (0..self.replicas.len())
            .filter(|&o| o != r)
            .all(|o| !self.has_bad_copy(o))
    }

    /// True if a replica other than `except` holds block damage that was
    /// not repaired yet (a down replica counts as long as it was damaged).
    ///
    /// Damage is injected only while every other replica holds the same
    /// content, but their copies of recent writes may still be unsynced: a
    /// power loss of those replicas then drops them (unflushed writes may
    /// be lost), and the damaged copy is the only one left: the second
    /// failure came before the first one was repaired, which is beyond the
    /// redundancy (see `damage_allowed`). So no power loss hits the other
    /// replicas until the damage is repaired.
    fn damage_elsewhere(&mut self, except: Option<usize>) -> bool {
        let mut any = false;
        for o in 0..self.replicas.len() {
            if !self.damaged[o] {
                continue;
            }
            let up = self.replicas[o]
                .core
                .as_ref()
                .and_then(|c| c.store())
                .is_some();
            if up && !self.has_bad_copy(o) {
                self.damaged[o] = false;
            } else if Some(o) != except {
                any = true;
            }
        }
        any
    }

    /// True if replica `o` is down or holds a copy that fails verification,
    /// including an older copy in a layer file that a WAL-resident write
    /// shadows: a power loss that drops the write exposes it again (seed
    /// 7465: a latent sector error under an unsynced write became the only
    /// copy of a block after a total power loss), or whose disk still
    /// misdirects writes (the damage lands with its next writes; seed 5738:
    /// it landed after the flag was cleared, and another replica's power
    /// loss had dropped the good copies).
    fn has_bad_copy(&self, o: usize) -> bool {
        let Some(store) = self.replicas[o].core.as_ref().and_then(|c| c.store()) else {
            return true;
        };
        if !store.fallback_copies_ok() || self.replicas[o].disk.faults().misdirect > 0.0 {
            return true;
        }
        let n = store.size_blocks().min(u32::MAX as u64) as u32;
        store.layer_ids().into_iter().any(|layer| {
            store.read_layer(layer, 0, n, false).map_or(true, |v| {
                v.iter()
                    .any(|(t, _)| matches!(t, BlockTag::Present { valid: false, .. }))
            })
        })
    }

    fn kill_engine(&mut self, g: u32) {
        let gi = g as usize;
        if !self.engines[gi].alive {
            return;
        }
        self.engines[gi].alive = false;
        if self.current == Some(g) {
            self.current = None;
        }
        // Its clients see the connection drop: ops become "maybe".
        let ops: Vec<(usize, usize)> = std::mem::take(&mut self.engines[gi].ops)
            .into_values()
            .collect();
        for (client, hi) in ops {
            if client < self.clients.len() && self.clients[client].pending == Some(hi) {
                self.clients[client].pending = None;
                self.clients[client].done += 1;
                let t = self.now + 100;
                self.at(t, Ev::ClientNext { client });
            }
        }
    }

    fn run_op(&mut self, kind: OpKind, op: ClientOp) -> Option<usize> {
        let hi = self.submit(usize::MAX, kind, op)?;
        let deadline = self.now + 10_000_000;
        self.final_error = None;
        while self.history[hi].complete.is_none()
            && self.final_error.is_none()
            && self.now < deadline
        {
            if !self.step() {
                break;
            }
            // Completion of a usize::MAX client op is recorded by op_done.
        }
        Some(hi)
    }

    fn final_ops(&mut self, report: &mut SimReport) {
        // Scrub repairs rotten copies; then let the repairs land. A scrub
        // that did not cover every replica (one left and came back during
        // it) runs again.
        for attempt in 0..5 {
            self.replace_fenced_engine();
            tracing::debug!(status = %self.describe(), now = self.now, attempt, "final scrub");
            self.last_scrub = None;
            if let Some(hi) = self.run_op(OpKind::Flush, ClientOp::Scrub)
                && self.history[hi].complete.is_none()
            {
                let why = self
                    .final_error
                    .take()
                    .unwrap_or_else(|| "timed out".into());
                // A replica restarted by the heal is only noticed by the
                // engine when it refuses a request (the engine may even
                // re-attach); an engine may have been fenced by a woken
                // one. Like a client, retry once the volume is healthy.
                if attempt < 4 {
                    self.settle();
                    continue;
                }
                if let Some(g) = self.current {
                    tracing::debug!(engine = ?self.engines[g as usize].engine, "final scrub did not complete");
                }
                report
                    .violations
                    .push(format!("final scrub did not complete: {why}"));
                break;
            }
            let covered = self.last_scrub.map_or(0, |r| r.replicas as usize);
            if covered == self.cfg.replicas {
                break;
            }
            if attempt == 4 {
                report.violations.push(format!(
                    "final scrubs covered only {covered} of {} replicas",
                    self.cfg.replicas
                ));
            }
            let until = self.now + 2_000_000;
            while self.now < until && !self.converged() && self.step() {}
        }
        let until = self.now + 200_000;
        while self.now < until && self.step() {}
        // Read every block back (part of the history; a failed read is
        // retried like a client would, and only completed reads count).
        for lba in 0..self.cfg.blocks {
            let mut hi = None;
            for attempt in 0..3 {
                hi = self.run_op(
                    OpKind::Read {
                        lba,
                        values: vec![ReadValue::Garbage],
                    },
                    ClientOp::Read { lba, blocks: 1 },
                );
                if hi.is_some_and(|h| self.history[h].complete.is_some()) || attempt == 2 {
                    break;
                }
                self.settle();
            }
            if hi.is_none_or(|h| self.history[h].complete.is_none()) {
                let why = self
                    .final_error
                    .take()
                    .unwrap_or_else(|| "timed out".into());
                report
                    .violations
                    .push(format!("final read of block {lba} failed: {why}"));
            }
        }
        let _ = self.run_op(OpKind::Flush, ClientOp::Flush);
    }

    fn compare_replicas(&mut self, report: &mut SimReport) {
        let mut images: Vec<Image> = Vec::new();
        for r in 0..self.replicas.len() {
            let Some(core) = self.replicas[r].core.as_ref() else {
                report
                    .violations
                    .push(format!("replica {r} down after heal"));
                return;
            };
            let Some(store) = core.store() else {
                report
                    .violations
                    .push(format!("replica {r} faulted after heal"));
                return;
            };
            let mut img = BTreeMap::new();
            for layer in store.layer_ids() {
                let Ok(v) = store.read_layer(layer, 0, self.cfg.blocks as u32, true) else {
                    report
                        .violations
                        .push(format!("replica {r} layer {layer} unreadable"));
                    return;
                };
                for (i, (t, d)) in v.into_iter().enumerate() {
                    img.insert((layer, i as u64), (t, d));
                }
            }
            images.push(img);
        }
        let Some(first) = images.first() else { return };
        let mut div = 0;
        for img in &images[1..] {
            if img.keys().ne(first.keys()) {
                div += 1;
                continue;
            }
            for (k, v) in img {
                let a = &first[k];
                let bad = |t: &BlockTag| matches!(t, BlockTag::Present { valid: false, .. });
                if a != v || bad(&a.0) || bad(&v.0) {
                    if div == 0 {
                        for (ri, rn) in self.replicas.iter().enumerate() {
                            if let Some(st) = rn.core.as_ref().and_then(|c| c.store()) {
                                tracing::info!(
                                    replica = ri,
                                    entry = st.describe_block(k.0, k.1),
                                    "divergent block"
                                );
                            }
                        }
                        report.violations.push(format!(
                            "replica copy differs at (layer, block) {k:?}: {:?} vs {:?} (data: {:?} vs {:?})",
                            a.0,
                            v.0,
                            a.1.as_ref().map(|d| oracle::decode_value(k.1, d)),
                            v.1.as_ref().map(|d| oracle::decode_value(k.1, d)),
                        ));
                    }
                    div += 1;
                }
            }
        }
        report.divergent = div;
        if div > 0 {
            report
                .violations
                .push(format!("{div} blocks differ between replicas after heal"));
        }
    }
}
