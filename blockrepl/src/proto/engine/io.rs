// SPDX-License-Identifier: Apache-2.0
//! The I/O path: ordered operations and their commit, flushes, detach, and
//! reads with read fencing.

use super::*;

impl Engine {
    /// Issues an ordered op to every active and rebuilding replica.
    pub(super) fn issue(&mut self, op_id: OpId, op: Op, on_commit: Commit) {
        let tag = Tag::new(self.epoch, self.position.index + 1);
        self.position = tag;
        if let Commit::Layers(l) = &on_commit {
            self.layers = l.clone();
        }
        if let Commit::Size(s) = &on_commit {
            self.size_blocks = self.size_blocks.max(*s);
        }
        self.writes.insert(
            tag.index,
            WriteState {
                op: op_id,
                error: None,
                on_commit,
            },
        );
        for r in 0..self.peers.len() {
            let role = self.peers[r].role;
            let rebuilding_started = self.rebuilds.iter().any(|rb| rb.target == r && rb.began);
            if role == Role::Active || (role == Role::Rebuilding && rebuilding_started) {
                let req = Request::Op {
                    epoch: self.epoch,
                    tag,
                    op: op.clone(),
                };
                self.send(r, req, Ctx::Op { index: tag.index });
            }
        }
        self.check_commits();
    }

    pub(super) fn check_commits(&mut self) {
        if self.phase != Phase::Running {
            return;
        }
        let active: Vec<ReplicaId> = self.ids(Role::Active);
        if active.len() >= self.w()
            && !self.stable
            && active
                .iter()
                .all(|&r| self.applied_index(r) >= self.barrier)
        {
            self.stable = true;
            self.acked_pos = self.acked_pos.max(self.start_pos);
            self.repump = true;
        }
        let commit = if self.cfg.bugs.ack_on_first_replica {
            active.iter().map(|&r| self.applied_index(r)).max()
        } else {
            if active.len() < self.w() {
                return;
            }
            active.iter().map(|&r| self.applied_index(r)).min()
        };
        let Some(commit) = commit else { return };
        while let Some((&idx, _)) = self.writes.first_key_value() {
            if idx > commit {
                break;
            }
            let Some((_, ws)) = self.writes.pop_first() else {
                break;
            };
            self.acked_pos = self.acked_pos.max(Tag::new(self.epoch, idx));
            debug!(index = idx, commit, active = ?active, "ordered op committed");
            let result = match ws.error {
                Some(e) => Err(Error::InvalidArgument(e)),
                None => Ok(OpOutput::Done),
            };
            self.complete(ws.op, result);
        }
        let sessions: Vec<u64> = self.rebuilds.iter().map(|rb| rb.session).collect();
        for s in sessions {
            self.rb_pump(s);
        }
        self.pump();
    }

    /// Index up to which replica `r` is known to hold this engine's
    /// history. Indexes alone do not identify operations across epochs: a
    /// replica may hold operations of a fenced engine that were never
    /// acknowledged (say `2:16`, `2:17`) while this engine, which started
    /// from `2:15`, issues `3:16`, `3:17`. So a position of an older epoch
    /// counts only up to where this engine's history started.
    pub(super) fn applied_index(&self, r: ReplicaId) -> u64 {
        let a = self.peers[r].acked;
        if a.epoch == self.epoch {
            a.index
        } else {
            a.index.min(self.start_pos.index)
        }
    }

    pub(super) fn check_flushes(&mut self) {
        if !self.writes_allowed() && !self.cfg.bugs.ack_on_first_replica {
            return;
        }
        let done: Vec<u64> = self
            .flushes
            .iter()
            .filter(|(_, f)| f.waiting.is_empty())
            .map(|(&k, _)| k)
            .collect();
        for k in done {
            if let Some(f) = self.flushes.remove(&k) {
                self.complete(f.op, Ok(OpOutput::Done));
            }
        }
    }

    pub(super) fn check_detach(&mut self) {
        if let Some((op, waiting)) = &self.detach
            && waiting.is_empty()
        {
            let op = *op;
            self.detach = None;
            self.complete(op, Ok(OpOutput::Done));
            self.phase = Phase::Detached;
            self.fail_all(|| Error::Detached);
        }
    }

    pub(super) fn read_attempt(&mut self, op: OpId) {
        let Some(rs) = self.reads.get(&op) else {
            return;
        };
        let (lba, blocks) = (rs.lba, rs.blocks);
        let candidates: Vec<ReplicaId> = self
            .ids(Role::Active)
            .into_iter()
            .filter(|r| !rs.tried.contains(r))
            .collect();
        if candidates.is_empty() {
            let bad = rs.bad.as_ref().and_then(|b| b.first().copied());
            self.reads.remove(&op);
            let err = match bad {
                // Never zeros or another copy in place of a lost block.
                Some(lba) => Error::BadBlock { lba },
                None => Error::ReadFailed { lba },
            };
            return self.complete(op, Err(err));
        }
        self.rr = self.rr.wrapping_add(1);
        let r = candidates[self.rr % candidates.len()];
        if let Some(rs) = self.reads.get_mut(&op) {
            rs.tried.insert(r);
            rs.server = Some(r);
        }
        let leased = self.lease_ok();
        if let Some(rs) = self.reads.get_mut(&op) {
            rs.leased_at_send = leased;
        }
        let epoch = self.epoch;
        self.send(r, Request::Read { epoch, lba, blocks }, Ctx::Read { op });
        // Read fencing: W replicas must confirm the epoch after the read
        // began (the serving replica's answer counts; the others are
        // asked in a ping round shared by every read waiting for one).
        self.pump_pings();
    }

    /// Replicas that confirmed the epoch after read `rs` started.
    fn read_confirmations(&self, rs: &ReadState) -> usize {
        (0..self.peers.len())
            .filter(|&p| rs.confirmed.contains(&p) || self.peers[p].pinged_ok >= rs.need_round)
            .count()
    }

    pub(super) fn check_read(&mut self, op: OpId) {
        let w = self.w();
        let skip = self.cfg.bugs.skip_read_fencing;
        let Some(rs) = self.reads.get(&op) else {
            return;
        };
        if rs.data.is_none() {
            return;
        }
        // Read leases are checked now, when the read completes, against the
        // clock the driver read after the answer arrived: the data was
        // served before that reading, and no newer engine can attach on
        // the lease holders before their leases end.
        let leased = if self.cfg.bugs.lease_checked_at_send {
            rs.leased_at_send
        } else {
            self.lease_ok()
        };
        let confirmed = self.read_confirmations(rs) >= w;
        if skip || confirmed || leased {
            let Some(rs) = self.reads.remove(&op) else {
                return;
            };
            if !confirmed && !skip {
                self.status.lease_reads += 1;
            }
            let data = rs.data.unwrap_or_default();
            self.complete(op, Ok(OpOutput::Data(data)));
        } else {
            // Leases ran out while the read was out: confirm with pings.
            self.pump_pings();
        }
    }

    /// Whether at least `W` replicas hold a read lease valid now.
    pub(super) fn lease_ok(&self) -> bool {
        let Some(now) = self.clock else {
            return false;
        };
        self.leases_wanted()
            && self.peers.iter().filter(|p| p.lease_until > now).count() >= self.w()
    }

    fn leases_wanted(&self) -> bool {
        // With W = 1 the serving replica's answer confirms the epoch alone.
        self.cfg.read_lease_us > 0 && self.w() >= 2 && self.clock.is_some()
    }

    /// Asks every attached replica whose lease ends within `L / 2` (or
    /// that holds none) for a new one. Runs on every tick: renewals go out
    /// in the background, before the leases end.
    pub(super) fn pump_leases(&mut self) {
        if self.phase != Phase::Running || !self.leases_wanted() {
            return;
        }
        let Some(now) = self.clock else { return };
        let l = self.cfg.read_lease_us;
        let epoch = self.epoch;
        for r in 0..self.peers.len() {
            let p = &self.peers[r];
            if p.link != Link::Attached
                || p.lease_asked
                || p.lease_next > now
                || p.lease_until > now.saturating_add(l / 2)
            {
                continue;
            }
            self.peers[r].lease_asked = true;
            self.send(
                r,
                Request::Lease {
                    epoch,
                    duration_us: l,
                },
                Ctx::Lease { sent: now },
            );
        }
    }

    /// Answer to a lease request sent at `sent` (engine clock).
    pub(super) fn on_lease(&mut self, from: ReplicaId, sent: u64, resp: Response) {
        let Response::Lease { granted_us } = resp else {
            return self.peer_failed_with(from, "bad lease answer", Some(Ctx::Lease { sent }));
        };
        self.peers[from].lease_asked = false;
        // Never more than asked (a replica answering with more is wrong).
        let granted_us = granted_us.min(self.cfg.read_lease_us);
        // The replica's clock may run fast by ρ and ours slow by ρ: of
        // `granted` on its clock we may count `granted·(1−ρ)/(1+ρ)` on ours,
        // from when we asked (it granted later, so its lease ends later).
        let usable = if self.cfg.bugs.lease_ignores_drift {
            granted_us
        } else {
            let ppm = self.cfg.clock_drift_ppm.min(999_999) as u128;
            (granted_us as u128 * (1_000_000 - ppm) / (1_000_000 + ppm)) as u64
        };
        let usable = usable.saturating_sub(self.cfg.lease_margin_us);
        if usable == 0 {
            // Refused (a newer engine waits for our leases to end): reads
            // confirm with pings meanwhile; ask again later.
            self.peers[from].lease_next = self
                .clock
                .unwrap_or(0)
                .saturating_add(self.cfg.read_lease_us / 4);
            return;
        }
        self.status.lease_grants += 1;
        let p = &mut self.peers[from];
        p.lease_until = p.lease_until.max(sent.saturating_add(usable));
        // Reads that wait for a ping round may complete now.
        let waiting: Vec<OpId> = self
            .reads
            .iter()
            .filter(|(_, rs)| rs.data.is_some())
            .map(|(&op, _)| op)
            .collect();
        for op in waiting {
            self.check_read(op);
        }
    }

    /// Whether a read waits for a round that has not been sent yet.
    fn reads_need_round(&self) -> bool {
        let w = self.w();
        self.reads
            .values()
            .any(|rs| rs.need_round > self.ping_round && self.read_confirmations(rs) < w)
    }

    /// Sends the next ping round when a read needs it and the current one
    /// is settled; asks replicas that (re)attached since the current round
    /// was sent while reads still wait for it.
    pub(super) fn pump_pings(&mut self) {
        let w = self.w();
        // With W = 1 the serving replica's answer confirms the epoch alone;
        // under valid read leases reads need no round.
        if self.phase != Phase::Running || w <= 1 || self.lease_ok() {
            return;
        }
        let epoch = self.epoch;
        let attached: Vec<ReplicaId> = (0..self.peers.len())
            .filter(|&p| self.peers[p].link == Link::Attached)
            .collect();
        // A replica that failed or went away will not answer this round.
        self.ping_waiting.retain(|p| attached.contains(p));
        let ok = attached
            .iter()
            .filter(|&&p| self.peers[p].pinged_ok >= self.ping_round)
            .count();
        // Settled at W − 1 confirmations: with the serving replica's answer
        // that completes a read, so a queue-depth-1 reader never waits for
        // the slowest replica's answer before its own round goes out.
        let settled = self.ping_round == 0 || self.ping_waiting.is_empty() || ok + 1 >= w;
        if settled && self.reads_need_round() && !attached.is_empty() {
            // A replica serving every waiting read confirms with its
            // answers: it is not pinged (queue depth 1 costs W − 1 pings
            // per read, as before coalescing).
            let mut servers = self
                .reads
                .values()
                .filter(|rs| self.read_confirmations(rs) < w)
                .map(|rs| rs.server);
            let only = servers.next().flatten();
            let skip = only.filter(|&s| servers.all(|x| x == Some(s)));
            self.ping_round += 1;
            self.status.ping_rounds += 1;
            self.ping_waiting.clear();
            let round = self.ping_round;
            for &p in &attached {
                self.peers[p].pinged = round;
                if Some(p) != skip {
                    self.ping_waiting.insert(p);
                    self.send(p, Request::Ping { epoch }, Ctx::Ping { round });
                }
            }
            return;
        }
        // A replica that came back while reads wait on the current round
        // (or an earlier one: a later confirmation counts for them too).
        let round = self.ping_round;
        let waiting = self
            .reads
            .values()
            .any(|rs| rs.need_round <= round && self.read_confirmations(rs) < w);
        if waiting {
            for &p in &attached {
                if self.peers[p].pinged < round {
                    self.peers[p].pinged = round;
                    self.ping_waiting.insert(p);
                    self.send(p, Request::Ping { epoch }, Ctx::Ping { round });
                }
            }
        }
    }

    /// Answer to a ping of `round`.
    pub(super) fn on_ping(&mut self, from: ReplicaId, round: u64, resp: Response) {
        if !matches!(resp, Response::Ack(_)) {
            return self.peer_failed_with(from, "bad ping answer", Some(Ctx::Ping { round }));
        }
        let p = &mut self.peers[from];
        p.pinged_ok = p.pinged_ok.max(round);
        if round == self.ping_round {
            self.ping_waiting.remove(&from);
        }
        let done: Vec<OpId> = self
            .reads
            .iter()
            .filter(|(_, rs)| rs.data.is_some() && rs.need_round <= round)
            .map(|(&op, _)| op)
            .collect();
        for op in done {
            self.check_read(op);
        }
        self.pump_pings();
    }

    /// Answer to a read.
    pub(super) fn on_read(&mut self, op: OpId, from: ReplicaId, resp: Response) {
        match resp {
            Response::Data { data, bad } => {
                let Some(rs) = self.reads.get_mut(&op) else {
                    return;
                };
                if data.len() != rs.blocks as usize * BLOCK_SIZE {
                    return self.peer_failed_with(from, "short read", Some(Ctx::Read { op }));
                }
                rs.confirmed.insert(from);
                if bad.is_empty() {
                    rs.data = Some(data);
                    self.check_read(op);
                } else {
                    // Read from another replica, then repair these copies.
                    let here: BTreeSet<u64> = bad.iter().map(|&(lba, _)| lba).collect();
                    rs.bad = Some(match rs.bad.take() {
                        Some(b) => b.intersection(&here).copied().collect(),
                        None => here,
                    });
                    for (lba, layer) in bad {
                        self.schedule_repair(from, layer, lba, None);
                    }
                    self.read_attempt(op);
                }
            }
            _ => self.peer_failed_with(from, "bad read answer", Some(Ctx::Read { op })),
        }
    }
}
