// SPDX-License-Identifier: Apache-2.0
//! Attach: probing, choosing the epoch and the source, re-attaching after
//! every active replica is gone, and fencing.

use super::*;

impl Engine {
    pub(super) fn probe(&mut self, r: ReplicaId) {
        self.peers[r].link = Link::Probing;
        self.send(r, Request::Probe, Ctx::Probe);
    }

    pub(super) fn attach(&mut self, r: ReplicaId) {
        self.peers[r].link = Link::Attaching;
        let req = Request::Attach {
            epoch: self.epoch,
            engine: self.cfg.engine_id,
        };
        self.send(r, req, Ctx::Attach);
    }

    /// Every active replica is gone: in-flight ordered operations may or may
    /// not have happened, so fail them, and attach again under a new epoch
    /// (source selection by position, as at first attach).
    pub(super) fn reattach(&mut self) {
        warn!("no active replica left; re-attaching under a new epoch");
        let (have, need) = (0, self.w());
        let mut ops: Vec<OpId> = self.writes.values().map(|w| w.op).collect();
        self.writes.clear();
        ops.extend(self.flushes.values().map(|f| f.op));
        self.flushes.clear();
        ops.extend(self.reads.keys().copied());
        self.reads.clear();
        if let Some((op, _)) = self.scrub.take() {
            ops.push(op);
        }
        self.rebuilds.clear();
        for op in ops {
            self.complete(op, Err(Error::QuorumLost { have, need }));
        }
        // Re-attach above our own epoch only; a higher epoch seen while
        // probing fences us (see `attached_once`).
        self.cfg.min_epoch = self.cfg.min_epoch.max(self.epoch);
        self.restart_attach();
    }

    pub(super) fn restart_attach(&mut self) {
        info!("restarting attach with a higher epoch");
        self.phase = Phase::Probing;
        self.probe_started = self.now;
        for r in 0..self.peers.len() {
            self.peers[r].info = None;
            self.peers[r].role = Role::Idle;
        }
        let ids: Vec<u64> = self.pending.keys().copied().collect();
        for id in ids {
            self.pending.remove(&id);
        }
        // Those requests include the current ping round's: nobody will
        // answer it (seed 7082: reads waited forever for a settled round).
        self.ping_waiting.clear();
        // Leases were granted to the old epoch: start over under the new
        // one (a replica lets the engine that holds its lease attach
        // above it).
        for p in &mut self.peers {
            p.lease_until = 0;
            p.lease_asked = false;
            p.lease_next = 0;
        }
        for r in 0..self.peers.len() {
            self.probe(r);
        }
    }

    /// Finishes the attach once the replicas that answered allow a safe
    /// choice of source.
    ///
    /// Every acknowledged write is held by at least `W` replicas. A replica
    /// that lost power since it acknowledged writes may lack them (it is
    /// `recovered`); every other clean replica still holds everything it
    /// acknowledged. So with `R = N - W + 1` clean replicas that are not
    /// recovered, one of them holds every acknowledged write, and the
    /// highest position among them is a safe source. With fewer, the
    /// engine waits until every replica answered: the highest position
    /// among all of them holds every acknowledged write that survived
    /// anywhere; whatever is missing was lost on every replica that held it
    /// (each of them lost power before a flush), which the engine reports
    /// instead of hiding ([`Error::UnflushedWritesLost`]).
    pub(super) fn try_finish_attach(&mut self) {
        let clean: Vec<ReplicaId> = (0..self.peers.len())
            .filter(|&r| {
                self.peers[r].link == Link::Attached
                    && self.peers[r]
                        .info
                        .as_ref()
                        .is_some_and(|i| i.state == ReplicaState::Clean)
            })
            .collect();
        let trusted = clean
            .iter()
            .filter(|&&r| self.peers[r].info.as_ref().is_some_and(|i| !i.recovered))
            .count();
        let all_answered = self.peers.iter().all(|p| p.link == Link::Attached);
        let fallback = trusted < self.r_quorum();
        if clean.is_empty() || (fallback && !all_answered) {
            return;
        }
        let source = if self.cfg.bugs.source_by_id {
            clean[0]
        } else {
            let mut best = clean[0];
            for &r in &clean {
                let p = |x: ReplicaId| self.peers[x].info.as_ref().map(|i| i.position);
                if p(r) > p(best) {
                    best = r;
                }
            }
            best
        };
        let Some(src) = self.peers[source].info.clone() else {
            return;
        };
        // An engine that acknowledged writes itself knows whether any of
        // those is missing; a new engine must assume the worst when it fell
        // back. So must a re-attaching one for the history it started from:
        // an earlier engine (even a paused one whose replicas' acks were
        // still on the way) may have acknowledged every operation up to
        // any position this engine attached at, and a fallback source
        // below it has lost some of them.
        let lossy = if self.attached_once {
            src.position < self.acked_pos || (fallback && src.position < self.max_start)
        } else {
            fallback
        };
        self.max_start = self.max_start.max(src.position);
        self.position = src.position;
        self.size_blocks = src.size_blocks;
        self.layers = src.layers.clone();
        for &r in &clean {
            let same = self.peers[r].info.as_ref().is_some_and(|i| {
                i.position == src.position
                    && i.size_blocks == src.size_blocks
                    && i.layers == src.layers
            });
            if same {
                self.peers[r].role = Role::Active;
                self.peers[r].acked = src.position;
            }
        }
        self.phase = Phase::Running;
        self.attached_once = true;
        self.start_pos = src.position;
        self.stable = false;
        info!(
            epoch = self.epoch,
            position = %self.position,
            active = ?self.ids(Role::Active),
            fallback,
            "attached"
        );
        if lossy {
            warn!(
                position = %self.position,
                "acknowledged writes that were not flushed may be lost: every replica holding them lost power"
            );
            self.status.lost_unflushed += 1;
            // Like a disk reset: what was queued fails, later I/O proceeds.
            let queued: Vec<OpId> = self.queue.drain(..).map(|q| q.id).collect();
            for id in queued {
                self.complete(id, Err(Error::UnflushedWritesLost));
            }
        }
        for r in self.ids(Role::Active) {
            self.adopt_if_recovered(r);
        }
        // The barrier: an ordered no-op of this epoch (a resize to the
        // same size), so that the adopted history carries this epoch's tag
        // on `W` replicas before any read shows it (see `stable`).
        let size_blocks = self.size_blocks;
        self.barrier = self.position.index + 1;
        self.issue(BARRIER_OP, Op::Resize { size_blocks }, Commit::None);
        self.maybe_start_rebuilds();
        self.pump_leases();
        // Marks the engine stable if W replicas are in sync, then pumps.
        self.check_commits();
    }

    /// An active replica marked recovered holds exactly what the source
    /// holds: tell it, so it counts towards the next attach quorum again.
    pub(super) fn adopt_if_recovered(&mut self, r: ReplicaId) {
        if self.peers[r].info.as_ref().is_some_and(|i| i.recovered) {
            let req = Request::Adopt {
                epoch: self.epoch,
                position: self.position,
            };
            self.send(r, req, Ctx::Adopt);
        }
    }

    pub(super) fn fence(&mut self, epoch: u64) {
        if self.phase == Phase::Fenced {
            return;
        }
        warn!(
            ours = self.epoch,
            theirs = epoch,
            "engine fenced by a newer epoch"
        );
        self.phase = Phase::Fenced;
        self.fail_all(|| Error::Fenced { epoch });
    }

    /// Chooses the epoch once every replica answered the probe, or `R`
    /// did and a request timeout passed: `max(seen) + 1`. Waiting for every
    /// answer keeps a fresh or stale replica that answers first from
    /// making the engine pick an epoch a slower replica already holds (it
    /// would refuse the attach).
    pub(super) fn maybe_choose_epoch(&mut self) {
        if self.phase != Phase::Probing {
            return;
        }
        let probed = self.peers.iter().filter(|p| p.info.is_some()).count();
        let waited = self.now >= self.probe_started + self.cfg.request_timeout;
        if probed < self.r_quorum() || (probed < self.peers.len() && !waited) {
            return;
        }
        let max = self
            .peers
            .iter()
            .filter_map(|p| p.info.as_ref().map(|i| i.epoch))
            .max()
            .unwrap_or(0);
        // A replica (or a control plane) claiming u64::MAX leaves no epoch
        // above it: refuse to attach rather than wrap to 0, which would
        // let every fenced engine write again.
        let Some(epoch) = max.max(self.cfg.min_epoch).checked_add(1) else {
            warn!(
                engine = self.cfg.engine_id,
                "no epoch above u64::MAX; refusing to attach"
            );
            self.phase = Phase::Fenced;
            self.fail_all(|| Error::Attach {
                reason: format!(
                    "a replica holds the largest epoch ({}); no newer one exists",
                    u64::MAX
                ),
            });
            return;
        };
        self.epoch = epoch;
        self.phase = Phase::Attaching;
        info!(epoch = self.epoch, engine = self.cfg.engine_id, "attaching");
        for r in 0..self.peers.len() {
            if self.peers[r].info.is_some() {
                self.attach(r);
            }
        }
    }

    /// Answer to a probe: choose the epoch once enough replicas answered.
    pub(super) fn on_probe(&mut self, from: ReplicaId, resp: Response) {
        let Response::Info(info) = resp else {
            return self.peer_failed(from, "bad probe answer");
        };
        self.peers[from].info = Some(info.clone());
        if self.attached_once && info.epoch > self.epoch {
            // Someone attached after us: we are a stale engine.
            return self.fence(info.epoch);
        }
        match self.phase {
            Phase::Probing => {
                self.peers[from].link = Link::Attaching; // parked until epoch chosen
                self.maybe_choose_epoch();
            }
            Phase::Attaching | Phase::Running => {
                if info.epoch > self.epoch {
                    return self.fence(info.epoch);
                }
                self.attach(from);
            }
            _ => {}
        }
    }

    /// Answer to an attach: the replica holds our epoch.
    pub(super) fn on_attach(&mut self, from: ReplicaId, resp: Response) {
        let Response::Info(info) = resp else {
            return self.peer_failed(from, "bad attach answer");
        };
        self.peers[from].link = Link::Attached;
        self.peers[from].info = Some(info.clone());
        self.peers[from].acked = info.position;
        self.peers[from].role = Role::Idle;
        if self.phase == Phase::Attaching {
            self.try_finish_attach();
        } else if self.phase == Phase::Running {
            // Same position, same layers, nothing in flight: it holds
            // exactly what the active replicas hold.
            let in_sync = info.state == ReplicaState::Clean
                && info.position == self.position
                && info.layers == self.layers
                && info.size_blocks == self.size_blocks
                && self.writes.is_empty();
            if in_sync {
                info!(replica = from, "replica joined in sync");
                self.peers[from].role = Role::Active;
                self.adopt_if_recovered(from);
                self.check_commits();
                self.check_flushes();
            } else {
                self.maybe_start_rebuilds();
            }
        }
    }
}
