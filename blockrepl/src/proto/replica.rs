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
use crate::proto::msg::{
    CopyEntry, FrameBuf, MAX_IO_BLOCKS, Op, Refusal, Request, RespFrame, Response,
};
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
    /// Read leases (docs/blockrepl.md "Read leases").
    lease: LeaseState,
    /// [`ReplicaCore::shutdown`] ran: the store stays closed.
    stopped: bool,
}

/// Longest read lease a replica grants by default (µs), and how long a
/// restarted replica refuses higher epochs.
pub const DEFAULT_MAX_LEASE_US: u64 = 2_000_000;

/// A replica's read-lease promise: `Attach` above the current epoch from
/// another engine is refused until `until` on this replica's own monotonic
/// clock. Held in memory only; a restart is covered by the restart guard.
#[derive(Debug, Clone, Copy)]
struct LeaseState {
    /// The replica's monotonic clock (µs), from [`ReplicaCore::set_time`];
    /// `None` until the driver set it: a replica without a clock grants no
    /// lease.
    now: Option<u64>,
    /// End of the promise.
    until: u64,
    /// Longest lease granted, and the length of the restart guard.
    max_us: u64,
    /// The restart guard is applied at the first clock reading.
    guard_pending: bool,
    /// No lease is granted or extended before this time: a newer engine
    /// asked to attach while a lease ran, and it must get in once the
    /// lease ends (else an engine that keeps renewing would keep every
    /// failover out forever).
    hold_off: u64,
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
            stopped: false,
            lease: LeaseState {
                now: None,
                until: 0,
                max_us: DEFAULT_MAX_LEASE_US,
                guard_pending: true,
                hold_off: 0,
            },
        }
    }

    /// Sets the longest read lease this replica grants (µs; 0 grants none)
    /// and whether it guards a restart. The restart guard makes a replica
    /// that may have granted a lease before it (re)started refuse `Attach`
    /// above its epoch for `max_us` from its first clock reading, as if it
    /// had granted one just before: leases live in memory only. Only a
    /// replica served by the engine's own process (nobody else can hold a
    /// lease on it once that process restarted) or a test may turn it off.
    pub fn set_lease_limit(&mut self, max_us: u64, restart_guard: bool) {
        self.lease.max_us = max_us;
        if !restart_guard && self.lease.now.is_none() {
            self.lease.guard_pending = false;
        }
    }

    /// Sets the replica's monotonic clock (µs) before a request is handled.
    /// The clock never goes back; the first reading starts the restart
    /// guard (see [`ReplicaCore::set_lease_limit`]).
    pub fn set_time(&mut self, now_us: u64) {
        let now = self.lease.now.map_or(now_us, |n| n.max(now_us));
        self.lease.now = Some(now);
        if self.lease.guard_pending {
            self.lease.guard_pending = false;
            // A replica never attached (epoch 0) granted no lease.
            if self.store.as_ref().is_some_and(|s| s.info().epoch > 0) {
                self.lease.until = self.lease.until.max(now.saturating_add(self.lease.max_us));
            }
        }
    }

    /// Time left on the read lease (or restart guard), µs.
    pub fn lease_remaining(&self) -> Option<u64> {
        let now = self.lease.now?;
        (now < self.lease.until).then(|| self.lease.until - now)
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

    /// No request came for a while (the driver calls it again about once
    /// a second while that lasts): the store gives back the space of
    /// overwritten and trimmed blocks ([`Store::idle`]). A store error
    /// faults the replica, as one on a request does.
    pub fn idle(&mut self) {
        if let Some(s) = self.store.as_mut()
            && let Err(e) = s.idle()
        {
            let _ = self.fault(&e);
        }
    }

    /// The replica process is stopping (SIGTERM): checkpoints and closes
    /// the store as a detach does, and serves nobody from then on (every
    /// later request is refused as faulted). Nothing acknowledged is lost
    /// and the next open is not a crash recovery.
    pub fn shutdown(&mut self) -> crate::Result<()> {
        self.stopped = true;
        self.attached = false;
        self.session = None;
        match self.store.take() {
            Some(mut s) => s.close(),
            None => Ok(()),
        }
    }

    fn fault(&mut self, e: &Error) -> Response {
        warn!(error = %e, "replica faulted; store will be reopened on next attach");
        self.store = None;
        self.attached = false;
        self.session = None;
        refused(Refusal::Faulted)
    }

    fn ensure_open(&mut self) -> bool {
        if self.stopped {
            return false;
        }
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

    /// [`ReplicaCore::handle`], with the answer appended to `out` as the
    /// payload of a [`RespFrame`] with id `id`. A read that is served is
    /// read from the store straight into `out` (no buffer of its own, no
    /// copy into the frame).
    pub fn handle_into(&mut self, id: u64, req: Request, out: &mut FrameBuf) {
        if let Request::Read { epoch, lba, blocks } = req
            && self.attached
            && let Some(store) = self.store.as_ref()
        {
            let info = store.info();
            if epoch == info.epoch && info.state == ReplicaState::Clean {
                let read = RespFrame::encode_data_into(id, blocks, out, |buf| {
                    store.read(lba, blocks, buf)
                });
                if let Err(e) = read {
                    RespFrame {
                        id,
                        resp: refused(Refusal::Invalid(e.to_string())),
                    }
                    .encode_into(out);
                }
                return;
            }
        }
        RespFrame {
            id,
            resp: self.handle(req),
        }
        .encode_into(out);
    }

    /// Handles one request.
    pub fn handle(&mut self, req: Request) -> Response {
        if matches!(req, Request::Probe | Request::Attach { .. }) && !self.ensure_open() {
            return refused(Refusal::Faulted);
        }
        if !self.attached && !matches!(req, Request::Probe | Request::Attach { .. }) {
            return refused(Refusal::Faulted);
        }
        let lease_left = self.lease_remaining();
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
                if epoch > info.epoch
                    && engine != info.engine
                    && let Some(rem) = lease_left
                {
                    // A read lease of the current epoch's engine runs: a
                    // newer engine attaches after it, so every read that
                    // engine completes under the lease is linearizable.
                    debug!(epoch, remaining_us = rem, "attach refused: read lease");
                    // Let the lease run out: no renewal until the newer
                    // engine had time to try again.
                    self.lease.hold_off = self
                        .lease
                        .hold_off
                        .max(self.lease.until.saturating_add(self.lease.max_us));
                    return refused(Refusal::Leased {
                        remaining_ms: rem.div_ceil(1000),
                    });
                }
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
            Request::Lease { epoch, duration_us } => {
                if !epoch_ok(epoch) {
                    return stale;
                }
                let Some(now) = self.lease.now.filter(|&n| n >= self.lease.hold_off) else {
                    return Response::Lease { granted_us: 0 };
                };
                let granted_us = duration_us.min(self.lease.max_us);
                self.lease.until = self.lease.until.max(now.saturating_add(granted_us));
                Response::Lease { granted_us }
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
                        // The engine detaching completes no read after it
                        // sent this (Detach waits for every other op and
                        // the engine stops): its lease ends here, so the
                        // next engine attaches at once.
                        self.lease.until = 0;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::disk::StdDir;

    #[test]
    fn a_shut_down_replica_stays_closed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let factory: DirFactory = Box::new(move || {
            let d: Box<dyn StoreDir> = Box::new(StdDir::new(&path).unwrap());
            d
        });
        Store::create(factory(), 16, ReplicaState::Clean).unwrap();
        let mut core = ReplicaCore::open(factory).unwrap();
        assert!(matches!(core.handle(Request::Probe), Response::Info(_)));
        core.shutdown().unwrap();
        // No reopen for a probe or an attach: the process is exiting.
        assert!(matches!(
            core.handle(Request::Probe),
            Response::Refused(Refusal::Faulted)
        ));
        assert!(matches!(
            core.handle(Request::Attach {
                epoch: 1,
                engine: 7
            }),
            Response::Refused(Refusal::Faulted)
        ));
        let s = Store::open(Box::new(StdDir::new(dir.path()).unwrap())).unwrap();
        assert!(!s.is_marked_open());
    }
}
