// SPDX-License-Identifier: Apache-2.0
//! The replica side of the protocol: validates epochs and ordering, then
//! applies requests to a [`Store`].
//!
//! The replica is synchronous and deterministic: the same requests on the same
//! store produce the same responses, so the simulator runs this exact code
//! over simulated disks. A store I/O error *faults* the replica: it drops its
//! in-memory state, refuses everything but `Probe`/`Attach`, and reopens the
//! store (running crash recovery) on the next of those.

use tracing::{debug, warn};

use crate::error::Error;
use crate::proto::msg::{CopyEntry, MAX_IO_BLOCKS, Op, Refusal, Request, Response};
use crate::store::disk::StoreDir;
use crate::store::{SetBlock, Store};
use crate::types::{BLOCK_SIZE, BlockTag, ReplicaState, Tag};

/// Opens the replica's store directory again after a fault.
pub type DirFactory = Box<dyn Fn() -> Box<dyn StoreDir> + Send>;

/// A replica: the protocol rules around one store.
pub struct ReplicaCore {
    store: Option<Store>,
    reopen: DirFactory,
    /// Current rebuild session, if a rebuild is running into this replica.
    session: Option<u64>,
    /// Position the running rebuild started at.
    rebuild_start: Tag,
    /// An engine attached to this incarnation. A restarted replica may have
    /// lost unflushed writes, so it serves nobody until attached again.
    attached: bool,
}

impl std::fmt::Debug for ReplicaCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaCore")
            .field("store", &self.store.as_ref().map(|s| s.info()))
            .field("session", &self.session)
            .finish()
    }
}

fn refused(r: Refusal) -> Response {
    Response::Refused(r)
}

impl ReplicaCore {
    /// Wraps an open store; `reopen` gives its directory again for recovery.
    pub fn new(store: Store, reopen: DirFactory) -> ReplicaCore {
        ReplicaCore {
            store: Some(store),
            reopen,
            session: None,
            rebuild_start: Tag::default(),
            attached: false,
        }
    }

    /// Opens the store in `reopen()`'s directory (crash recovery included).
    pub fn open(reopen: DirFactory) -> crate::Result<ReplicaCore> {
        let store = Store::open(reopen())?;
        Ok(ReplicaCore::new(store, reopen))
    }

    /// The store, if not faulted.
    pub fn store(&self) -> Option<&Store> {
        self.store.as_ref()
    }

    /// Mutable store access (tests and fault injection).
    pub fn store_mut(&mut self) -> Option<&mut Store> {
        self.store.as_mut()
    }

    fn fault(&mut self, e: &Error) -> Response {
        warn!(error = %e, "replica faulted; store will be reopened on next attach");
        self.store = None;
        self.attached = false;
        self.session = None;
        refused(Refusal::Faulted)
    }

    fn ensure_open(&mut self) -> bool {
        if self.store.is_none() {
            match Store::open((self.reopen)()) {
                Ok(s) => {
                    debug!("replica store reopened");
                    self.store = Some(s);
                }
                Err(e) => {
                    warn!(error = %e, "replica store reopen failed");
                    return false;
                }
            }
        }
        true
    }

    /// Handles one request.
    pub fn handle(&mut self, req: Request) -> Response {
        if matches!(req, Request::Probe | Request::Attach { .. }) && !self.ensure_open() {
            return refused(Refusal::Faulted);
        }
        if !self.attached && !matches!(req, Request::Probe | Request::Attach { .. }) {
            return refused(Refusal::Faulted);
        }
        let Some(store) = self.store.as_mut() else {
            return refused(Refusal::Faulted);
        };
        let info = store.info();
        let epoch_ok = |e: u64| e == info.epoch;
        let stale = refused(Refusal::StaleEpoch {
            current: info.epoch,
        });
        match req {
            Request::Probe => Response::Info(info),
            Request::Attach { epoch, engine } => {
                if epoch > info.epoch {
                    if let Err(e) = store.set_epoch(epoch, engine) {
                        return self.fault(&e);
                    }
                    self.session = None;
                    self.attached = true;
                    Response::Info(store.info())
                } else if epoch == info.epoch && engine == info.engine {
                    if let Err(e) = store.mark_open() {
                        return self.fault(&e);
                    }
                    self.attached = true;
                    Response::Info(info)
                } else {
                    stale
                }
            }
            Request::Ping { epoch } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                Response::Ack(info.position)
            }
            Request::Op { epoch, tag, op } => {
                if !epoch_ok(epoch) || tag.epoch != epoch {
                    return stale;
                }
                if info.state == ReplicaState::Rebuilding && self.session.is_none() {
                    return refused(Refusal::Rebuilding);
                }
                if tag.index <= info.position.index {
                    if info.position.epoch < tag.epoch {
                        // Not a duplicate: this replica went further down
                        // an older engine's history (operations that were
                        // never acknowledged) than the one `tag` belongs
                        // to. It must be rebuilt, never count as holding
                        // `tag`.
                        return refused(Refusal::OutOfOrder {
                            position: info.position,
                        });
                    }
                    return Response::Ack(info.position);
                }
                if tag.index != info.position.index + 1 {
                    return refused(Refusal::OutOfOrder {
                        position: info.position,
                    });
                }
                tracing::trace!(%tag, ?op, "apply");
                let res = match op {
                    Op::Write { lba, data } => {
                        let n = (data.len() / BLOCK_SIZE) as u32;
                        if n == 0 || data.len() % BLOCK_SIZE != 0 {
                            Err(Error::InvalidArgument("write length".into()))
                        } else {
                            store.write(tag, lba, n, Some(&data))
                        }
                    }
                    Op::Zero { lba, blocks } => store.write(tag, lba, blocks, None),
                    Op::Snapshot { name, new_head } => store.snapshot(tag, &name, new_head),
                    Op::DeleteSnapshot { layer } => store.delete_snapshot(tag, layer),
                    Op::Revert { layer, new_head } => store.revert(tag, layer, new_head),
                    Op::Resize { size_blocks } => store.resize(tag, size_blocks),
                };
                match res {
                    Ok(()) => Response::Ack(store.position()),
                    Err(e @ (Error::InvalidArgument(_) | Error::OutOfRange { .. })) => {
                        // Keep the sequence: the op becomes a no-op everywhere
                        // (the engine validates first, so replicas agree).
                        if let Err(e2) = store.advance(tag) {
                            return self.fault(&e2);
                        }
                        refused(Refusal::Invalid(e.to_string()))
                    }
                    Err(e) => self.fault(&e),
                }
            }
            Request::Flush { epoch } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                match store.flush() {
                    Ok(()) => Response::Ack(store.position()),
                    Err(e) => self.fault(&e),
                }
            }
            Request::Read { epoch, lba, blocks } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                if info.state != ReplicaState::Clean {
                    return refused(Refusal::Rebuilding);
                }
                let mut buf = vec![0u8; blocks as usize * BLOCK_SIZE];
                match store.read(lba, blocks, &mut buf) {
                    Ok(bad) => Response::Data {
                        data: buf.into(),
                        bad,
                    },
                    Err(e) => refused(Refusal::Invalid(e.to_string())),
                }
            }
            Request::ReadLayer {
                epoch,
                layer,
                lba,
                blocks,
                data,
            } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                // Served in any state: every block carries the tag of the
                // write that produced it, and the engine uses copies from a
                // replica that is not in sync only when the tag is the one
                // it needs (rebuild tag comparison, repair of the only
                // in-sync copy from a stale replica).
                match store.read_layer(layer, lba, blocks, data) {
                    Ok(v) => Response::Layer(
                        v.into_iter().map(|(t, d)| (t, d.map(Into::into))).collect(),
                    ),
                    Err(e) => refused(Refusal::Invalid(e.to_string())),
                }
            }
            Request::RebuildBegin {
                epoch,
                session,
                start,
                size_blocks,
                layers,
            } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                match store.begin_rebuild(&layers, size_blocks, start) {
                    Ok(()) => {
                        self.session = Some(session);
                        self.rebuild_start = start;
                        Response::Info(store.info())
                    }
                    Err(e @ Error::InvalidArgument(_)) => refused(Refusal::Invalid(e.to_string())),
                    Err(e) => self.fault(&e),
                }
            }
            Request::Copy {
                epoch,
                session,
                layer,
                lba,
                entries,
            } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                if self.session != Some(session) {
                    return refused(Refusal::Invalid("no such rebuild session".into()));
                }
                // Consecutive blocks to set that are copies of one write
                // (a large write leaves runs of them) go to the WAL as one
                // record. Each block's decision only depends on its own
                // entry, so deferring the run's store update is equivalent.
                let mut run: Option<(u64, Tag, Vec<u8>)> = None;
                for (i, ent) in entries.iter().enumerate() {
                    let b = lba + i as u64;
                    let cur = store.entry(layer, b);
                    let live = cur.is_some_and(|(t, _, _)| {
                        t.epoch == epoch && t.index > self.rebuild_start.index
                    });
                    let mut to_run = None;
                    let res = match ent {
                        CopyEntry::Skip => Ok(()),
                        CopyEntry::Bad(t) => {
                            // Never replaces any copy of the same write (a
                            // good one is the last hope for that block) or
                            // a newer live write of this session.
                            let newer = cur.is_none_or(|(ct, _, _)| *t > ct);
                            let same = cur.is_some_and(|(ct, _, _)| ct == *t);
                            if (!live || newer) && !same {
                                store.mark_damaged(layer, b, *t)
                            } else {
                                Ok(())
                            }
                        }
                        CopyEntry::Absent => {
                            if cur.is_some() && !live {
                                store.set_block(layer, b, SetBlock::Absent)
                            } else {
                                Ok(())
                            }
                        }
                        CopyEntry::Zero(t) | CopyEntry::Data(t, _) => {
                            let newer = cur.is_none_or(|(ct, _, _)| *t > ct);
                            let same = cur.is_some_and(|(ct, z, valid)| {
                                ct == *t && valid && z == matches!(ent, CopyEntry::Zero(_))
                            });
                            if (!live || newer) && !same {
                                match ent {
                                    CopyEntry::Data(t, d) if d.len() == BLOCK_SIZE => {
                                        to_run = Some((*t, d));
                                        Ok(())
                                    }
                                    CopyEntry::Data(t, d) => {
                                        store.set_block(layer, b, SetBlock::Data(*t, d))
                                    }
                                    _ => store.set_block(layer, b, SetBlock::Zero(*t)),
                                }
                            } else {
                                Ok(())
                            }
                        }
                    };
                    // Flush the pending run before anything that does not
                    // extend it (other records stay in block order).
                    let res = res.and_then(|()| {
                        let extends = matches!(
                            (&run, to_run),
                            (Some((start, rt, buf)), Some((t, _)))
                                if *rt == t
                                    && *start + (buf.len() / BLOCK_SIZE) as u64 == b
                                    && buf.len() / BLOCK_SIZE < MAX_IO_BLOCKS
                        );
                        if !extends && let Some((start, rt, buf)) = run.take() {
                            store.set_blocks_data(layer, start, rt, &buf)?;
                        }
                        if let Some((t, d)) = to_run {
                            run.get_or_insert_with(|| {
                                (b, t, Vec::with_capacity(entries.len() * BLOCK_SIZE))
                            })
                            .2
                            .extend_from_slice(d);
                        }
                        Ok(())
                    });
                    if let Err(e) = res {
                        return match e {
                            Error::InvalidArgument(_) | Error::OutOfRange { .. } => {
                                refused(Refusal::Invalid(e.to_string()))
                            }
                            e => self.fault(&e),
                        };
                    }
                }
                if let Some((start, rt, buf)) = run.take()
                    && let Err(e) = store.set_blocks_data(layer, start, rt, &buf)
                {
                    return match e {
                        Error::InvalidArgument(_) | Error::OutOfRange { .. } => {
                            refused(Refusal::Invalid(e.to_string()))
                        }
                        e => self.fault(&e),
                    };
                }
                Response::Ack(store.position())
            }
            Request::RebuildEnd {
                epoch,
                session,
                position,
            } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                if self.session != Some(session) {
                    return refused(Refusal::Invalid("no such rebuild session".into()));
                }
                if store.position() != position {
                    return refused(Refusal::OutOfOrder {
                        position: store.position(),
                    });
                }
                match store.mark_clean() {
                    Ok(()) => {
                        self.session = None;
                        Response::Info(store.info())
                    }
                    Err(e) => self.fault(&e),
                }
            }
            Request::Repair {
                epoch,
                layer,
                lba,
                entries,
            } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                if info.state != ReplicaState::Clean {
                    return refused(Refusal::Rebuilding);
                }
                for (i, ent) in entries.iter().enumerate() {
                    let b = lba + i as u64;
                    let cur = store.entry(layer, b);
                    // Only a bad copy of the same write (or one whose
                    // metadata is damaged, tag unknown) is replaced: a
                    // repair that raced with a newer write is a no-op.
                    let bad = cur.is_some_and(|(ct, _, valid)| {
                        !valid
                            && match ent {
                                CopyEntry::Data(t, _) | CopyEntry::Zero(t) => {
                                    ct == *t || ct == Tag::default()
                                }
                                _ => false,
                            }
                    });
                    debug!(layer, lba = b, ?cur, bad, "repair");
                    let res = match ent {
                        CopyEntry::Data(t, d) if bad => {
                            store.set_block(layer, b, SetBlock::Data(*t, d))
                        }
                        CopyEntry::Zero(t) if bad => store.set_block(layer, b, SetBlock::Zero(*t)),
                        _ => Ok(()),
                    };
                    if let Err(e) = res {
                        return match e {
                            Error::InvalidArgument(_) | Error::OutOfRange { .. } => {
                                refused(Refusal::Invalid(e.to_string()))
                            }
                            e => self.fault(&e),
                        };
                    }
                }
                Response::Ack(store.position())
            }
            Request::Detach { epoch } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                match store.close() {
                    Ok(()) => {
                        // Serves nobody until attached again: nothing may
                        // be acknowledged while marked closed.
                        self.attached = false;
                        Response::Ack(store.position())
                    }
                    Err(e) => self.fault(&e),
                }
            }
            Request::Adopt { epoch, position } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                if info.state != ReplicaState::Clean || info.position < position {
                    return refused(Refusal::Invalid(format!(
                        "cannot adopt at {position}: replica at {} ({:?})",
                        info.position, info.state
                    )));
                }
                match store.adopt() {
                    Ok(()) => Response::Info(store.info()),
                    Err(e) => self.fault(&e),
                }
            }
        }
    }

    /// Per-block state of a layer range (for tests and the simulator's
    /// replica comparison).
    pub fn layer_tags(&self, layer: u64, lba: u64, n: u32) -> Option<Vec<BlockTag>> {
        let s = self.store.as_ref()?;
        s.read_layer(layer, lba, n, false)
            .ok()
            .map(|v| v.into_iter().map(|(t, _)| t).collect())
    }
}
