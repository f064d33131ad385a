// SPDX-License-Identifier: Apache-2.0
//! Scrub and repair (D5): compare every block's tag and checksum state on
//! every active replica and repair bad copies from a peer whose copy of the
//! same write verifies.

use super::*;

impl Engine {
    /// Sends a repair for `lba` in `layer` on replica `bad_on`, reading the
    /// good copy from another active replica.
    pub(super) fn schedule_repair(&mut self, bad_on: ReplicaId, layer: u64, lba: u64) {
        self.schedule_repair_from(bad_on, layer, lba, 0);
    }

    /// Reads the good copy from the `skip`-th other active replica.
    pub(super) fn schedule_repair_from(
        &mut self,
        bad_on: ReplicaId,
        layer: u64,
        lba: u64,
        skip: usize,
    ) {
        let from = self
            .ids(Role::Active)
            .into_iter()
            .filter(|&r| r != bad_on)
            .nth(skip);
        if let Some(from) = from {
            let req = Request::ReadLayer {
                epoch: self.epoch,
                layer,
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
                    skip,
                },
            );
        }
    }

    pub(super) fn scrub_pump(&mut self) {
        let size = self.size_blocks;
        let chunk_n = self.cfg.rebuild_chunk.clamp(1, MAX_IO_BLOCKS as u32);
        let actives = self.ids(Role::Active);
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
            st.chunks
                .insert(chunk, (layer, lba, blocks, BTreeMap::new(), actives.len()));
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
        for (r, req, ctx) in sends {
            self.send(r, req, ctx);
        }
        if done && let Some((op, st)) = self.scrub.take() {
            self.complete(op, Ok(OpOutput::Scrub(st.report)));
        }
    }

    pub(super) fn scrub_tags(&mut self, op: OpId, chunk: u64, from: ReplicaId, resp: Response) {
        let Response::Layer(v) = resp else {
            return self.peer_failed(from, "bad scrub answer");
        };
        let mut repairs = Vec::new();
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
            c.3.insert(from, v.into_iter().map(|(t, _)| t).collect());
            if c.3.len() < c.4 {
                return;
            }
            let Some((layer, lba, blocks, tags, _)) = st.chunks.remove(&chunk) else {
                return;
            };
            for k in 0..blocks as usize {
                let mut seen: Option<(Tag, bool)> = None;
                let mut bad_on = Vec::new();
                let mut divergent = false;
                for (&r, t) in &tags {
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
                                bad_on.push(r);
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
                for r in bad_on {
                    st.report.repaired += 1;
                    repairs.push((r, layer, lba + k as u64));
                }
            }
        }
        for (r, layer, lba) in repairs {
            self.schedule_repair(r, layer, lba);
        }
        self.scrub_pump();
    }

    /// A peer's copy of a block to repair on `bad_on`.
    pub(super) fn on_repair_read(
        &mut self,
        bad_on: ReplicaId,
        layer: u64,
        lba: u64,
        skip: usize,
        resp: Response,
    ) {
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
                ) => Some(CopyEntry::Data(tag, d)),
                _ => None,
            };
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
                repaired = true;
            }
        }
        if !repaired && self.peers[bad_on].link == Link::Attached {
            // That copy was bad too (or gone): try the next replica.
            self.schedule_repair_from(bad_on, layer, lba, skip + 1);
        }
    }
}
