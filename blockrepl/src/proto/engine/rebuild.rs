// SPDX-License-Identifier: Apache-2.0
//! Rebuild of a new or stale replica from an active one while writes
//! continue (D4): the source is flushed, the target persists `Rebuilding`,
//! receives every live operation, gets the blocks whose tags differ, and
//! writes its completion marker last.

use super::*;

impl Engine {
    pub(super) fn maybe_start_rebuilds(&mut self) {
        if self.phase != Phase::Running {
            return;
        }
        // Admin ops in flight change layers: wait for them.
        if self
            .writes
            .values()
            .any(|w| !matches!(w.on_commit, Commit::None))
        {
            return;
        }
        let actives = self.ids(Role::Active);
        if actives.is_empty() {
            return;
        }
        for r in 0..self.peers.len() {
            if self.peers[r].link != Link::Attached || self.peers[r].role != Role::Idle {
                continue;
            }
            // Keep at least R replicas marked Clean on disk, so a later
            // engine can always attach: a rebuild clears the target's mark.
            // A target not marked Clean (an interrupted rebuild) lowers
            // nothing: rebuilding it is the only way back to R (seed 7500:
            // a fallback attach on the one Clean replica never rebuilt the
            // two Rebuilding ones).
            let clean = |p: &Peer| {
                p.link == Link::Attached
                    && p.info
                        .as_ref()
                        .is_some_and(|i| i.state == ReplicaState::Clean)
            };
            let known_clean = self.peers.iter().filter(|p| clean(p)).count();
            let target_clean = clean(&self.peers[r]);
            let after = known_clean - usize::from(target_clean);
            if target_clean && after < self.r_quorum() {
                continue;
            }
            // Prefer a source that is not itself busy as a source.
            // Rotate sources across attempts, so a source with a bad copy
            // (being repaired) is not retried forever.
            let session = self.next_session;
            let source = actives[(r + session as usize) % actives.len()];
            self.next_session += 1;
            self.peers[r].role = Role::Rebuilding;
            if let Some(i) = self.peers[r].info.as_mut() {
                i.state = ReplicaState::Rebuilding;
            }
            let start = self.position;
            info!(target = r, source, session, start = %start, "rebuild starting");
            self.rebuilds.push(RebuildState {
                session,
                target: r,
                source,
                start,
                began: false,
                layers: self.layers.iter().map(|l| l.id).collect(),
                layer_idx: 0,
                next_lba: 0,
                chunks: BTreeMap::new(),
                next_chunk: 0,
                data_first: true,
                copy_done: false,
                incomplete: false,
                ending: false,
            });
            // Make the source's copy durable before the target's copy is
            // invalidated: the target may be the only other holder of
            // acknowledged but unflushed writes.
            let epoch = self.epoch;
            self.send(source, Request::Flush { epoch }, Ctx::RbFlush { session });
        }
    }

    /// The source is flushed: start the rebuild proper. Every op issued from
    /// here on also goes to the target.
    pub(super) fn rb_send_begin(&mut self, session: u64) {
        let Some(i) = self.rb_index(session) else {
            return;
        };
        let start = self.position;
        let rb = &mut self.rebuilds[i];
        rb.start = start;
        rb.began = true;
        rb.layers = self.layers.iter().map(|l| l.id).collect();
        let target = rb.target;
        let req = Request::RebuildBegin {
            epoch: self.epoch,
            session,
            start,
            size_blocks: self.size_blocks,
            layers: self.layers.clone(),
        };
        self.send(target, req, Ctx::RbBegin { session });
    }

    pub(super) fn rb_index(&self, session: u64) -> Option<usize> {
        self.rebuilds.iter().position(|rb| rb.session == session)
    }

    pub(super) fn rb_abort(&mut self, session: u64, why: &str) {
        if let Some(i) = self.rb_index(session) {
            let rb = self.rebuilds.remove(i);
            warn!(target = rb.target, why, "rebuild aborted");
            self.peer_failed(rb.target, why);
        }
    }

    pub(super) fn rb_begun(&mut self, session: u64, resp: Response) {
        let Response::Info(info) = resp else {
            return self.rb_abort(session, "rebuild begin refused");
        };
        if let Some(i) = self.rb_index(session) {
            let t = self.rebuilds[i].target;
            // The target now holds exactly the prefix up to `start`: what
            // it reported before (possibly operations of a fenced engine
            // beyond `start`, see `applied_index`) is gone. Only acks of
            // this epoch's operations, which are sent after the begin, may
            // already be newer.
            let p = &mut self.peers[t];
            p.acked = if p.acked.epoch == self.epoch {
                p.acked.max(info.position)
            } else {
                info.position
            };
        }
        self.rb_pump(session);
    }

    pub(super) fn rb_pump(&mut self, session: u64) {
        let Some(i) = self.rb_index(session) else {
            return;
        };
        let source = self.rebuilds[i].source;
        // The source must hold every op up to the start before copying.
        if !self.rebuilds[i].began || self.peers[source].acked < self.rebuilds[i].start {
            return;
        }
        let chunk_n = self.cfg.rebuild_chunk.clamp(1, MAX_IO_BLOCKS as u32);
        while self.rebuilds[i].chunks.len() < self.cfg.rebuild_parallel.max(1)
            && !self.rebuilds[i].copy_done
        {
            let rb = &mut self.rebuilds[i];
            if rb.layer_idx >= rb.layers.len() {
                rb.copy_done = true;
                break;
            }
            if rb.next_lba >= self.size_blocks {
                rb.layer_idx += 1;
                rb.next_lba = 0;
                continue;
            }
            let layer = rb.layers[rb.layer_idx];
            let lba = rb.next_lba;
            let blocks = (self.size_blocks - lba).min(chunk_n as u64) as u32;
            rb.next_lba += blocks as u64;
            let chunk = rb.next_chunk;
            rb.next_chunk += 1;
            // While the target's chunks come back empty (a new or wiped
            // replica), the source's tag pass also returns the data: the
            // store reads and verifies every present block for its tag
            // anyway, so this saves a second read and a round trip. The
            // diff is still computed from both replicas' tags.
            let with_data = rb.data_first;
            rb.chunks.insert(
                chunk,
                Chunk {
                    layer,
                    lba,
                    blocks,
                    src: None,
                    tgt: None,
                    diff: vec![],
                    with_data,
                    src_data: None,
                },
            );
            let target = rb.target;
            let epoch = self.epoch;
            let mk = |data: bool| Request::ReadLayer {
                epoch,
                layer,
                lba,
                blocks,
                data,
            };
            self.send(
                source,
                mk(with_data),
                Ctx::RbTags {
                    session,
                    chunk,
                    source: true,
                },
            );
            self.send(
                target,
                mk(false),
                Ctx::RbTags {
                    session,
                    chunk,
                    source: false,
                },
            );
        }
        let rb = &self.rebuilds[i];
        if rb.copy_done && rb.chunks.is_empty() && !rb.ending {
            let target = rb.target;
            if rb.incomplete {
                return self.rb_abort(session, "source had bad blocks; retry after repair");
            }
            // All ops up to the position must have reached the target.
            if self.peers[target].acked < self.position {
                return;
            }
            self.rebuilds[i].ending = true;
            let req = Request::RebuildEnd {
                epoch: self.epoch,
                session,
                position: self.position,
            };
            self.send(target, req, Ctx::RbEnd { session });
        }
    }

    pub(super) fn rb_tags(&mut self, session: u64, chunk: u64, source: bool, resp: Response) {
        let Some(i) = self.rb_index(session) else {
            return;
        };
        let Response::Layer(v) = resp else {
            return self.rb_abort(session, "bad tags answer");
        };
        let Some(c) = self.rebuilds[i].chunks.get_mut(&chunk) else {
            return;
        };
        if v.len() != c.blocks as usize {
            return self.rb_abort(session, "short tags answer");
        }
        let tags: Vec<BlockTag> = v.iter().map(|(t, _)| *t).collect();
        if source {
            if c.with_data {
                c.src_data = Some(v);
            }
            c.src = Some(tags);
        } else {
            let empty = tags.iter().all(|t| *t == BlockTag::Absent);
            c.tgt = Some(tags);
            self.rebuilds[i].data_first = empty;
        }
        let Some(c) = self.rebuilds[i].chunks.get_mut(&chunk) else {
            return;
        };
        let (Some(s), Some(t)) = (&c.src, &c.tgt) else {
            return;
        };
        let diff: Vec<bool> = s
            .iter()
            .zip(t.iter())
            .map(|(a, b)| match (a, b) {
                (BlockTag::Absent, BlockTag::Absent) => false,
                (
                    BlockTag::Present {
                        tag: ta, zero: za, ..
                    },
                    BlockTag::Present {
                        tag: tb,
                        zero: zb,
                        valid: vb,
                    },
                ) => !(ta == tb && za == zb && *vb),
                _ => true,
            })
            .collect();
        let Some(first) = diff.iter().position(|&d| d) else {
            self.rebuilds[i].chunks.remove(&chunk);
            return self.rb_pump(session);
        };
        let last = diff.iter().rposition(|&d| d).unwrap_or(first);
        let (layer, lba) = (c.layer, c.lba);
        c.lba = lba + first as u64;
        c.blocks = (last - first + 1) as u32;
        c.diff = diff[first..=last].to_vec();
        if let Some(mut v) = c.src_data.take() {
            v.truncate(last + 1);
            v.drain(..first);
            return self.rb_copy(i, chunk, v);
        }
        let req = Request::ReadLayer {
            epoch: self.epoch,
            layer,
            lba: c.lba,
            blocks: c.blocks,
            data: true,
        };
        let source_r = self.rebuilds[i].source;
        self.send(source_r, req, Ctx::RbData { session, chunk });
    }

    pub(super) fn rb_data(&mut self, session: u64, chunk: u64, resp: Response) {
        let Some(i) = self.rb_index(session) else {
            return;
        };
        let Response::Layer(v) = resp else {
            return self.rb_abort(session, "bad data answer");
        };
        self.rb_copy(i, chunk, v);
    }

    /// Sends the differing blocks of a chunk to the target; `v` is the
    /// source's answer for the chunk's (narrowed) range.
    fn rb_copy(&mut self, i: usize, chunk: u64, v: Vec<(BlockTag, Option<Bytes>)>) {
        let session = self.rebuilds[i].session;
        let Some(c) = self.rebuilds[i].chunks.get_mut(&chunk) else {
            return;
        };
        if v.len() != c.blocks as usize {
            return self.rb_abort(session, "short data answer");
        }
        let (layer, lba, diff) = (c.layer, c.lba, std::mem::take(&mut c.diff));
        let mut entries = Vec::with_capacity(v.len());
        let mut copied = 0;
        for (k, (t, d)) in v.into_iter().enumerate() {
            if !diff[k] {
                entries.push(CopyEntry::Skip);
                continue;
            }
            copied += 1;
            entries.push(match (t, d) {
                (BlockTag::Absent, _) => CopyEntry::Absent,
                (
                    BlockTag::Present {
                        tag,
                        zero: true,
                        valid: true,
                    },
                    _,
                ) => CopyEntry::Zero(tag),
                (
                    BlockTag::Present {
                        tag,
                        zero: false,
                        valid: true,
                    },
                    Some(d),
                ) if d.len() == BLOCK_SIZE => CopyEntry::Data(tag, d),
                (t, _) => {
                    let b = lba + k as u64;
                    let want = match t {
                        BlockTag::Present { tag, .. } => Some(tag),
                        BlockTag::Absent => None,
                    };
                    if let Some(tag) = want
                        && self.lost.get(&(layer, b)) == Some(&tag)
                    {
                        // A repair already found no good copy of this
                        // write anywhere: record it as bad on the target
                        // too (never zeros, never an older copy) and go on.
                        warn!(layer = layer, lba = b, %tag, "rebuild copies a lost block as bad");
                        CopyEntry::Bad(tag)
                    } else {
                        // Bad copy on the source: never copy it; repair the
                        // source from another replica and rebuild again.
                        self.rebuilds[i].incomplete = true;
                        let src = self.rebuilds[i].source;
                        self.schedule_repair(src, layer, b, want);
                        CopyEntry::Skip
                    }
                }
            });
        }
        self.status.blocks_copied += copied;
        let target = self.rebuilds[i].target;
        let req = Request::Copy {
            epoch: self.epoch,
            session,
            layer,
            lba,
            entries,
        };
        self.send(target, req, Ctx::RbCopy { session, chunk });
    }

    pub(super) fn rb_end(&mut self, session: u64, resp: Response) {
        let Some(i) = self.rb_index(session) else {
            return;
        };
        let Response::Info(info) = resp else {
            return self.rb_abort(session, "rebuild end refused");
        };
        let rb = self.rebuilds.remove(i);
        let r = rb.target;
        self.peers[r].role = Role::Active;
        self.peers[r].info = Some(info.clone());
        self.peers[r].acked = self.peers[r].acked.max(info.position);
        self.status.rebuilds_done += 1;
        info!(target = r, position = %info.position, "rebuild complete; replica active");
        self.check_commits();
        self.check_flushes();
        self.pump();
    }
}
