// SPDX-License-Identifier: Apache-2.0
//! Scrub and repair (D5): compare every block's tag and checksum state on
//! every active replica and repair bad copies from a peer whose copy of the
//! same write verifies.

use super::*;

impl Engine {
    /// Repairs the copy of `lba` in `layer` on replica `bad_on` from a peer.
    /// `want` is the tag of the bad copy when its metadata is intact.
    pub(super) fn schedule_repair(
        &mut self,
        bad_on: ReplicaId,
        layer: u64,
        lba: u64,
        want: Option<Tag>,
    ) {
        self.schedule_repair_from(bad_on, layer, lba, Vec::new(), want);
    }

    /// Asks the next peer not in `tried` for its copy. In-sync replicas come
    /// first (their copy is the block's current content). Then, if the bad
    /// copy's tag is known, any other attached replica: a copy carrying the
    /// same tag is the same write, whatever that replica's state, so a
    /// stale or rebuilding replica can still heal the only in-sync copy.
    pub(super) fn schedule_repair_from(
        &mut self,
        bad_on: ReplicaId,
        layer: u64,
        lba: u64,
        mut tried: Vec<ReplicaId>,
        want: Option<Tag>,
    ) {
        if self.peers[bad_on].link != Link::Attached {
            return;
        }
        let usable = |r: &ReplicaId| *r != bad_on && !tried.contains(r);
        let active = self.ids(Role::Active).into_iter().find(usable);
        let other = || {
            want.filter(|t| *t != Tag::default())?;
            (0..self.peers.len()).find(|r| {
                usable(r)
                    && self.peers[*r].link == Link::Attached
                    && self.peers[*r].role != Role::Active
            })
        };
        let Some(from) = active.or_else(other) else {
            let tag = want.unwrap_or_default();
            if self.lost.insert((layer, lba), tag) != Some(tag) {
                warn!(
                    replica = bad_on,
                    layer,
                    lba,
                    %tag,
                    "no attached replica holds a good copy: block lost until one does"
                );
            }
            return;
        };
        tried.push(from);
        // A replica that is not in sync may hold the same write in another
        // layer (a snapshot it has not deleted yet): look there too, top
        // first. In-sync replicas have the engine's chain.
        let mut rest: Vec<u64> = Vec::new();
        if self.peers[from].role != Role::Active
            && let Some(info) = &self.peers[from].info
        {
            rest = info
                .layers
                .iter()
                .rev()
                .map(|l| l.id)
                .filter(|&id| id != layer)
                .collect();
        }
        self.send_repair_read(from, bad_on, layer, layer, lba, tried, want, rest);
    }

    /// Asks `from` for its copy of `lba` in its layer `read`, to repair
    /// `layer` on `bad_on`.
    #[allow(clippy::too_many_arguments)]
    fn send_repair_read(
        &mut self,
        from: ReplicaId,
        bad_on: ReplicaId,
        layer: u64,
        read: u64,
        lba: u64,
        tried: Vec<ReplicaId>,
        want: Option<Tag>,
        rest: Vec<u64>,
    ) {
        let req = Request::ReadLayer {
            epoch: self.epoch,
            layer: read,
            lba,
            blocks: 1,
            data: true,
        };
        self.send(
            from,
            req,
            Ctx::RepairRead {
                bad_on,
                layer,
                lba,
                tried,
                want,
                rest,
            },
        );
    }

    /// The last peer asked had no usable copy in the layer asked: try its
    /// next layer, then the next peer.
    pub(super) fn repair_next(
        &mut self,
        bad_on: ReplicaId,
        layer: u64,
        lba: u64,
        tried: Vec<ReplicaId>,
        want: Option<Tag>,
        mut rest: Vec<u64>,
    ) {
        if let Some(&from) = tried.last()
            && !rest.is_empty()
            && self.peers[from].link == Link::Attached
            && self.peers[bad_on].link == Link::Attached
        {
            let read = rest.remove(0);
            return self.send_repair_read(from, bad_on, layer, read, lba, tried, want, rest);
        }
        self.schedule_repair_from(bad_on, layer, lba, tried, want);
    }

    pub(super) fn scrub_pump(&mut self) {
        let size = self.size_blocks;
        let chunk_n = self.cfg.rebuild_chunk.clamp(1, MAX_IO_BLOCKS as u32);
        let actives = self.ids(Role::Active);
        let layers: Vec<u64> = self.layers.iter().map(|l| l.id).collect();
        let epoch = self.epoch;
        let Some((op, st)) = &mut self.scrub else {
            return;
        };
        let op = *op;
        let mut sends = Vec::new();
        while st.chunks.len() < 4 {
            if st.layer_idx >= st.layers.len() {
                break;
            }
            if st.next_lba >= size {
                st.layer_idx += 1;
                st.next_lba = 0;
                continue;
            }
            let layer = st.layers[st.layer_idx];
            let lba = st.next_lba;
            let blocks = (size - lba).min(chunk_n as u64) as u32;
            st.next_lba += blocks as u64;
            let chunk = st.next_chunk;
            st.next_chunk += 1;
            st.chunks.insert(
                chunk,
                ScrubChunk {
                    layer,
                    lba,
                    blocks,
                    tags: BTreeMap::new(),
                    asked: actives.iter().copied().collect(),
                },
            );
            for &r in &actives {
                sends.push((
                    r,
                    Request::ReadLayer {
                        epoch,
                        layer,
                        lba,
                        blocks,
                        data: false,
                    },
                    Ctx::ScrubTags { op, chunk },
                ));
            }
        }
        let done = st.chunks.is_empty() && st.layer_idx >= st.layers.len();
        // A replica that joined the active set during the pass (in sync
        // after a restart, or rebuilt) was not verified: scan again.
        let missed = actives
            .iter()
            .any(|r| st.covered.as_ref().is_some_and(|c| !c.contains(r)));
        if done && missed && st.passes < MAX_SCRUB_PASSES {
            st.passes += 1;
            st.layers = layers;
            st.layer_idx = 0;
            st.next_lba = 0;
            st.covered = None;
            return self.scrub_pump();
        }
        for (r, req, ctx) in sends {
            self.send(r, req, ctx);
        }
        if done && let Some((op, mut st)) = self.scrub.take() {
            let covered = st.covered.map_or(actives.len(), |c| c.len());
            st.report.replicas = covered as u32;
            self.complete(op, Ok(OpOutput::Scrub(st.report)));
        }
    }

    /// Replica `r` failed while chunk `chunk` waited for it: go on without it
    /// (it leaves the active set and a rebuild verifies its copy).
    pub(super) fn scrub_drop(&mut self, op: OpId, chunk: u64, r: ReplicaId) {
        let Some((sop, st)) = &mut self.scrub else {
            return;
        };
        if *sop != op {
            return;
        }
        if let Some(c) = st.chunks.get_mut(&chunk) {
            c.asked.remove(&r);
            c.tags.remove(&r);
        }
        self.scrub_chunk_check(chunk);
    }

    pub(super) fn scrub_tags(&mut self, op: OpId, chunk: u64, from: ReplicaId, resp: Response) {
        let ctx = Some(Ctx::ScrubTags { op, chunk });
        let Response::Layer(v) = resp else {
            return self.peer_failed_with(from, "bad scrub answer", ctx);
        };
        {
            let Some((sop, st)) = &mut self.scrub else {
                return;
            };
            if *sop != op {
                return;
            }
            let Some(c) = st.chunks.get_mut(&chunk) else {
                return;
            };
            if v.len() != c.blocks as usize {
                return self.peer_failed_with(from, "short scrub answer", ctx);
            }
            c.tags.insert(from, v.into_iter().map(|(t, _)| t).collect());
        }
        self.scrub_chunk_check(chunk);
    }

    /// Evaluates a chunk once every replica still asked has answered.
    fn scrub_chunk_check(&mut self, chunk: u64) {
        let mut repairs = Vec::new();
        {
            let Some((_, st)) = &mut self.scrub else {
                return;
            };
            let Some(c) = st.chunks.get(&chunk) else {
                return;
            };
            if c.asked.iter().any(|r| !c.tags.contains_key(r)) {
                return;
            }
            let Some(c) = st.chunks.remove(&chunk) else {
                return;
            };
            let covered = st.covered.get_or_insert_with(|| c.asked.clone());
            covered.retain(|r| c.asked.contains(r));
            for k in 0..c.blocks as usize {
                let mut seen: Option<(Tag, bool)> = None;
                let mut bad_on = Vec::new();
                let mut divergent = false;
                for (&r, t) in &c.tags {
                    let Some(bt) = t.get(k) else { continue };
                    st.report.checked += 1;
                    match *bt {
                        BlockTag::Absent => {
                            if seen.is_some() {
                                divergent = true;
                            }
                        }
                        BlockTag::Present { tag, zero, valid } => {
                            if !valid {
                                st.report.bad += 1;
                                bad_on.push((r, tag));
                            } else if let Some(s) = seen {
                                if s != (tag, zero) {
                                    divergent = true;
                                }
                            } else {
                                seen = Some((tag, zero));
                            }
                        }
                    }
                }
                if divergent {
                    st.report.divergent += 1;
                }
                for (r, tag) in bad_on {
                    st.report.repaired += 1;
                    repairs.push((r, c.layer, c.lba + k as u64, tag));
                }
            }
        }
        for (r, layer, lba, tag) in repairs {
            debug!(replica = r, layer, lba, %tag, "scrub found a bad copy");
            self.schedule_repair(r, layer, lba, Some(tag));
        }
        self.scrub_pump();
    }

    /// A peer's copy of a block to repair on `bad_on`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn on_repair_read(
        &mut self,
        bad_on: ReplicaId,
        layer: u64,
        lba: u64,
        tried: Vec<ReplicaId>,
        want: Option<Tag>,
        rest: Vec<u64>,
        resp: Response,
    ) {
        let from_active = tried
            .last()
            .is_some_and(|&r| self.peers[r].role == Role::Active);
        let mut repaired = false;
        if let Response::Layer(v) = resp
            && let Some((t, d)) = v.into_iter().next()
        {
            let entry = match (t, d) {
                (
                    BlockTag::Present {
                        tag,
                        zero: true,
                        valid: true,
                    },
                    _,
                ) => Some(CopyEntry::Zero(tag)),
                (
                    BlockTag::Present {
                        tag,
                        zero: false,
                        valid: true,
                    },
                    Some(d),
                ) if d.len() == BLOCK_SIZE => Some(CopyEntry::Data(tag, d)),
                _ => None,
            };
            // A replica that is not in sync may hold another write there.
            let entry = entry.filter(|e| {
                let tag = match e {
                    CopyEntry::Zero(t) | CopyEntry::Data(t, _) => Some(*t),
                    _ => None,
                };
                from_active || (want.is_some() && tag == want)
            });
            if let Some(entry) = entry
                && self.peers[bad_on].link == Link::Attached
            {
                let req = Request::Repair {
                    epoch: self.epoch,
                    layer,
                    lba,
                    entries: vec![entry],
                };
                self.status.repairs += 1;
                self.send(bad_on, req, Ctx::Repair);
                self.lost.remove(&(layer, lba));
                repaired = true;
            }
        }
        if !repaired {
            // That copy was bad too, another write, or gone: try the
            // peer's next layer, then the next replica.
            self.repair_next(bad_on, layer, lba, tried, want, rest);
        }
    }
}
