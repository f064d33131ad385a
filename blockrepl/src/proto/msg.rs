// SPDX-License-Identifier: Apache-2.0
//! Engine ⇄ replica messages and their binary codec.
//!
//! Every request carries the sender's epoch; replicas reject lower ones.
//! Ordered operations (writes, snapshots, resize, ...) carry a [`Tag`] whose
//! index must follow the replica's position. The codec is little-endian,
//! length-checked, and returns a [`DecodeError`] naming the problem on any
//! malformed input (it is fuzzed and property-tested).

use bytes::{BufMut, Bytes, BytesMut};

use crate::store::format::R;
use crate::types::{
    BLOCK_SIZE, BlockTag, LayerInfo, MAX_LAYERS, MAX_NAME_LEN, ReplicaInfo, ReplicaState, Tag,
};

/// Largest I/O in blocks per request (1 MiB).
pub const MAX_IO_BLOCKS: usize = 256;
/// Largest frame payload the codec accepts.
pub const MAX_FRAME: usize = 64 + MAX_IO_BLOCKS * (BLOCK_SIZE + 32);

/// A send queue of frames: a byte vector that also remembers how much of
/// its allocation holds bytes written earlier, so a large payload (a
/// replica's read answer) can be read into it without zeroing it first.
///
/// It dereferences to the `Vec<u8>` for ordinary appends.
/// [`FrameBuf::extend_unspecified`] appends bytes whose contents are
/// unspecified (stale bytes of frames already sent on this connection, or
/// zeros); its caller overwrites every one of them.
#[derive(Debug, Default)]
pub struct FrameBuf {
    vec: Vec<u8>,
    /// Bytes at the start of the current allocation known to have been
    /// written (at least `vec.len()` whenever it is used).
    init: usize,
    /// Address and capacity of the allocation `init` describes.
    alloc: (usize, usize),
}

impl FrameBuf {
    /// An empty queue.
    pub fn new() -> FrameBuf {
        FrameBuf::default()
    }

    /// Records the current length in the high-water mark, or restarts the
    /// mark if the allocation changed (moved, grew or shrank, even in
    /// place) since it was taken.
    fn note(&mut self) {
        let alloc = (self.vec.as_ptr() as usize, self.vec.capacity());
        if alloc != self.alloc {
            self.alloc = alloc;
            self.init = self.vec.len();
        } else {
            self.init = self.init.max(self.vec.len());
        }
    }

    /// Empties the queue, keeping its allocation and what it knows of it.
    pub fn clear(&mut self) {
        self.note();
        self.vec.clear();
    }

    /// Appends `n` bytes and returns them. Their contents are unspecified
    /// (bytes of earlier frames or zeros): the caller must overwrite all
    /// of them before the frame is sent. Unlike `resize(len + n, 0)` this
    /// does not write the bytes the allocation already holds.
    pub fn extend_unspecified(&mut self, n: usize) -> &mut [u8] {
        self.note();
        let len = self.vec.len();
        self.vec.reserve(n);
        self.note();
        let stale = self.init.saturating_sub(len).min(n);
        // SAFETY: `len + stale <= init <= capacity`, and bytes `..init` of
        // this allocation (its address and capacity are unchanged since
        // `init` was recorded; `note` restarts the mark otherwise) were all
        // written through this vector earlier; `clear`/`truncate` of a
        // `Vec<u8>` only lower its length and never de-initialise bytes,
        // so the bytes exposed here are initialised `u8`s.
        unsafe { self.vec.set_len(len + stale) };
        self.vec.resize(len + n, 0);
        self.init = self.init.max(len + n);
        &mut self.vec[len..]
    }
}

impl std::ops::Deref for FrameBuf {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.vec
    }
}

impl std::ops::DerefMut for FrameBuf {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.vec
    }
}

/// A malformed message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DecodeError(pub String);

/// An ordered operation: applied by every replica in write-index order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Write `data` (a whole number of blocks) at block `lba`.
    Write {
        /// First block.
        lba: u64,
        /// Block data.
        data: Bytes,
    },
    /// Write zeros (trim and write-zeroes both read back as zeros).
    Zero {
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
    },
    /// Freeze the head as snapshot `name`; start head `new_head`.
    Snapshot {
        /// Snapshot name.
        name: String,
        /// Id of the new head layer.
        new_head: u64,
    },
    /// Delete snapshot layer `layer`.
    DeleteSnapshot {
        /// Layer id.
        layer: u64,
    },
    /// Revert to snapshot layer `layer`, new head `new_head`.
    Revert {
        /// Layer id.
        layer: u64,
        /// Id of the new head layer.
        new_head: u64,
    },
    /// Grow the volume to `size_blocks`.
    Resize {
        /// New size.
        size_blocks: u64,
    },
}

/// One block sent by rebuild or repair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CopyEntry {
    /// The layer holds no copy.
    Absent,
    /// A zero block written by `tag`.
    Zero(Tag),
    /// A data block written by `tag`.
    Data(Tag, Bytes),
    /// The source's copy is bad too: leave the target's block alone.
    Skip,
    /// The block written by `tag` has no good copy on any reachable
    /// replica: record it as a known bad copy of that write (reads of it
    /// fail, a peer's copy of the same write can still repair it). Sent
    /// only by rebuild, so a lost block does not stall it.
    Bad(Tag),
}

/// A request from an engine to a replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Report state; no side effects.
    Probe,
    /// Take epoch `epoch` for engine `engine` (must be higher than the
    /// replica's, or equal with the same engine).
    Attach {
        /// New epoch.
        epoch: u64,
        /// Engine id.
        engine: u64,
    },
    /// Confirm the epoch is still current (read fencing).
    Ping {
        /// Epoch.
        epoch: u64,
    },
    /// Ask for a read lease at `epoch` (read leases, docs/blockrepl.md):
    /// the replica promises to refuse `Attach` above `epoch` (from another
    /// engine) for `duration_us` on its own clock, and answers
    /// [`Response::Lease`] with what it granted. Explicit on the wire: a
    /// plain `Ping` answer is never taken for a lease.
    Lease {
        /// Epoch.
        epoch: u64,
        /// Lease asked for (µs).
        duration_us: u64,
    },
    /// An ordered operation.
    Op {
        /// Epoch.
        epoch: u64,
        /// Tag; index must be position + 1.
        tag: Tag,
        /// The operation.
        op: Op,
    },
    /// Make every applied operation durable.
    Flush {
        /// Epoch.
        epoch: u64,
    },
    /// Read through the layer chain (clean replicas only).
    Read {
        /// Epoch.
        epoch: u64,
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
    },
    /// Read one layer's blocks with their tags (rebuild source, scrub).
    ReadLayer {
        /// Epoch.
        epoch: u64,
        /// Layer id.
        layer: u64,
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
        /// Include data (otherwise tags only; data is still verified).
        data: bool,
    },
    /// Start rebuilding this replica.
    RebuildBegin {
        /// Epoch.
        epoch: u64,
        /// Rebuild session id (copies from other sessions are rejected).
        session: u64,
        /// Position the replica starts at; live ops follow it.
        start: Tag,
        /// Volume size in blocks.
        size_blocks: u64,
        /// Layer chain to adopt.
        layers: Vec<LayerInfo>,
    },
    /// Blocks copied from the source.
    Copy {
        /// Epoch.
        epoch: u64,
        /// Rebuild session.
        session: u64,
        /// Layer id.
        layer: u64,
        /// First block.
        lba: u64,
        /// One entry per block.
        entries: Vec<CopyEntry>,
    },
    /// Write the completion marker.
    RebuildEnd {
        /// Epoch.
        epoch: u64,
        /// Rebuild session.
        session: u64,
        /// Expected position.
        position: Tag,
    },
    /// Replace bad copies of blocks with a peer's good ones.
    Repair {
        /// Epoch.
        epoch: u64,
        /// Layer id.
        layer: u64,
        /// First block.
        lba: u64,
        /// One entry per block.
        entries: Vec<CopyEntry>,
    },
    /// Checkpoint and release the epoch's engine.
    Detach {
        /// Epoch.
        epoch: u64,
    },
    /// The engine found this replica in sync at `position` (or chose it as
    /// the source): clear its recovered mark (see
    /// [`ReplicaInfo::recovered`]).
    Adopt {
        /// Epoch.
        epoch: u64,
        /// Position the engine found; the replica must be at or past it.
        position: Tag,
    },
}

/// Why a replica refused a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The replica has accepted a higher (or other engine's) epoch.
    StaleEpoch {
        /// Replica's epoch.
        current: u64,
    },
    /// Ordered op does not follow the position.
    OutOfOrder {
        /// Replica's position.
        position: Tag,
    },
    /// The replica is rebuilding and cannot serve this.
    Rebuilding,
    /// The replica hit an I/O error and must be re-attached and rebuilt.
    Faulted,
    /// The request is invalid.
    Invalid(String),
    /// `Attach` above the current epoch while a read lease granted to the
    /// current epoch's engine (or the restart guard) runs: try again later.
    Leased {
        /// Time left on the replica's clock (ms, rounded up).
        remaining_ms: u64,
    },
}

/// A replica's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    /// State report (Probe, Attach, RebuildBegin, RebuildEnd).
    Info(ReplicaInfo),
    /// Done; the replica's position afterwards.
    Ack(Tag),
    /// Read data; `bad` lists blocks (lba, layer) that failed verification
    /// (their bytes are zero and must not be used).
    Data {
        /// Block data.
        data: Bytes,
        /// Failed blocks.
        bad: Vec<(u64, u64)>,
    },
    /// Layer read: per block its state and (when asked and valid) data.
    Layer(Vec<(BlockTag, Option<Bytes>)>),
    /// Refused.
    Refused(Refusal),
    /// Answer to [`Request::Lease`]: lease granted for `granted_us` from
    /// when the replica handled the request (0: no lease, e.g. the replica
    /// has no clock).
    Lease {
        /// Granted duration (µs), at most what was asked.
        granted_us: u64,
    },
}

/// A request with the id its response will carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReqFrame {
    /// Request id (echoed).
    pub id: u64,
    /// The request.
    pub req: Request,
}

/// A response to request `id`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RespFrame {
    /// Request id.
    pub id: u64,
    /// The response.
    pub resp: Response,
}

fn err<T>(what: &str) -> Result<T, DecodeError> {
    Err(DecodeError(what.to_string()))
}

/// Decoder over a frame payload; with the payload's owner (`Bytes`), block
/// data is a view of the payload instead of a copy.
struct Dec<'a>(R<'a>, Option<&'a Bytes>);

impl<'a> Dec<'a> {
    fn data(&mut self, n: usize, what: &str) -> Result<Bytes, DecodeError> {
        let b = self.bytes(n, what)?;
        Ok(match self.1 {
            Some(owner) => owner.slice_ref(b),
            None => Bytes::copy_from_slice(b),
        })
    }
    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        self.0
            .u8()
            .ok_or_else(|| DecodeError(format!("truncated {what}")))
    }
    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        self.0
            .u32()
            .ok_or_else(|| DecodeError(format!("truncated {what}")))
    }
    fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        self.0
            .u64()
            .ok_or_else(|| DecodeError(format!("truncated {what}")))
    }
    fn tag(&mut self, what: &str) -> Result<Tag, DecodeError> {
        Ok(Tag::new(self.u64(what)?, self.u64(what)?))
    }
    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        self.0
            .take(n)
            .ok_or_else(|| DecodeError(format!("truncated {what}")))
    }
    fn blocks(&mut self, what: &str) -> Result<u32, DecodeError> {
        let n = self.u32(what)?;
        if n == 0 || n as usize > MAX_IO_BLOCKS {
            return Err(DecodeError(format!(
                "{what}: block count {n} not in 1..={MAX_IO_BLOCKS}"
            )));
        }
        Ok(n)
    }
    fn name(&mut self) -> Result<String, DecodeError> {
        let n = self.u8("name length")? as usize;
        if n > MAX_NAME_LEN {
            return err("name too long");
        }
        let b = self.bytes(n, "name")?;
        std::str::from_utf8(b)
            .map(str::to_string)
            .map_err(|_| DecodeError("name is not UTF-8".into()))
    }
    fn layers(&mut self) -> Result<Vec<LayerInfo>, DecodeError> {
        let n = self.u8("layer count")? as usize;
        if n == 0 || n > MAX_LAYERS {
            return err("layer count out of range");
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.u64("layer id")?;
            let created = self.tag("layer tag")?;
            let name = self.name()?;
            v.push(LayerInfo { id, name, created });
        }
        Ok(v)
    }
    fn entries(&mut self) -> Result<Vec<CopyEntry>, DecodeError> {
        let n = self.blocks("entry count")?;
        let mut v = Vec::with_capacity(n as usize);
        for _ in 0..n {
            v.push(match self.u8("entry kind")? {
                0 => CopyEntry::Absent,
                1 => CopyEntry::Zero(self.tag("entry tag")?),
                2 => {
                    let t = self.tag("entry tag")?;
                    CopyEntry::Data(t, self.data(BLOCK_SIZE, "entry data")?)
                }
                3 => CopyEntry::Skip,
                4 => CopyEntry::Bad(self.tag("entry tag")?),
                k => return Err(DecodeError(format!("unknown copy entry kind {k}"))),
            });
        }
        Ok(v)
    }
    fn end(&self) -> Result<(), DecodeError> {
        if self.0.remaining() != 0 {
            return err("trailing bytes");
        }
        Ok(())
    }
}

struct Enc<B: BufMut>(B);

impl<B: BufMut> Enc<B> {
    fn tag(&mut self, t: Tag) {
        self.0.put_u64_le(t.epoch);
        self.0.put_u64_le(t.index);
    }
    fn name(&mut self, s: &str) {
        let b = &s.as_bytes()[..s.len().min(MAX_NAME_LEN)];
        self.0.put_u8(b.len() as u8);
        self.0.put_slice(b);
    }
    fn layers(&mut self, l: &[LayerInfo]) {
        self.0.put_u8(l.len().min(MAX_LAYERS) as u8);
        for x in l.iter().take(MAX_LAYERS) {
            self.0.put_u64_le(x.id);
            self.tag(x.created);
            self.name(&x.name);
        }
    }
    fn entries(&mut self, e: &[CopyEntry]) {
        self.0.put_u32_le(e.len() as u32);
        for x in e {
            match x {
                CopyEntry::Absent => self.0.put_u8(0),
                CopyEntry::Zero(t) => {
                    self.0.put_u8(1);
                    self.tag(*t);
                }
                CopyEntry::Data(t, d) => {
                    self.0.put_u8(2);
                    self.tag(*t);
                    self.0.put_slice(d);
                }
                CopyEntry::Skip => self.0.put_u8(3),
                CopyEntry::Bad(t) => {
                    self.0.put_u8(4);
                    self.tag(*t);
                }
            }
        }
    }
}

impl ReqFrame {
    /// Encodes the frame payload.
    pub fn encode(&self) -> BytesMut {
        let mut e = Enc(BytesMut::with_capacity(64));
        self.put(&mut e, true);
        e.0
    }

    /// Appends the encoded frame payload to `out` (a frame being built in
    /// a send queue: no intermediate buffer).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        self.put(&mut Enc(out), true);
    }

    /// The block data a write carries at the end of its payload.
    pub fn write_data(&self) -> Option<&Bytes> {
        match &self.req {
            Request::Op {
                op: Op::Write { data, .. },
                ..
            } => Some(data),
            _ => None,
        }
    }

    /// [`ReqFrame::encode_into`] without the trailing [`ReqFrame::write_data`]:
    /// appending those bytes gives the whole payload (a sender can write
    /// them from their own buffer instead of copying them).
    pub fn encode_head_into(&self, out: &mut Vec<u8>) {
        self.put(&mut Enc(out), false);
    }

    fn put<B: BufMut>(&self, e: &mut Enc<B>, with_data: bool) {
        e.0.put_u64_le(self.id);
        match &self.req {
            Request::Probe => e.0.put_u8(1),
            Request::Attach { epoch, engine } => {
                e.0.put_u8(2);
                e.0.put_u64_le(*epoch);
                e.0.put_u64_le(*engine);
            }
            Request::Ping { epoch } => {
                e.0.put_u8(3);
                e.0.put_u64_le(*epoch);
            }
            Request::Lease { epoch, duration_us } => {
                e.0.put_u8(14);
                e.0.put_u64_le(*epoch);
                e.0.put_u64_le(*duration_us);
            }
            Request::Op { epoch, tag, op } => {
                e.0.put_u8(4);
                e.0.put_u64_le(*epoch);
                e.tag(*tag);
                match op {
                    Op::Write { lba, data } => {
                        e.0.put_u8(1);
                        e.0.put_u64_le(*lba);
                        e.0.put_u32_le((data.len() / BLOCK_SIZE) as u32);
                        // Last in the payload (see `encode_head_into`).
                        if with_data {
                            e.0.put_slice(data);
                        }
                    }
                    Op::Zero { lba, blocks } => {
                        e.0.put_u8(2);
                        e.0.put_u64_le(*lba);
                        e.0.put_u32_le(*blocks);
                    }
                    Op::Snapshot { name, new_head } => {
                        e.0.put_u8(3);
                        e.name(name);
                        e.0.put_u64_le(*new_head);
                    }
                    Op::DeleteSnapshot { layer } => {
                        e.0.put_u8(4);
                        e.0.put_u64_le(*layer);
                    }
                    Op::Revert { layer, new_head } => {
                        e.0.put_u8(5);
                        e.0.put_u64_le(*layer);
                        e.0.put_u64_le(*new_head);
                    }
                    Op::Resize { size_blocks } => {
                        e.0.put_u8(6);
                        e.0.put_u64_le(*size_blocks);
                    }
                }
            }
            Request::Flush { epoch } => {
                e.0.put_u8(5);
                e.0.put_u64_le(*epoch);
            }
            Request::Read { epoch, lba, blocks } => {
                e.0.put_u8(6);
                e.0.put_u64_le(*epoch);
                e.0.put_u64_le(*lba);
                e.0.put_u32_le(*blocks);
            }
            Request::ReadLayer {
                epoch,
                layer,
                lba,
                blocks,
                data,
            } => {
                e.0.put_u8(7);
                e.0.put_u64_le(*epoch);
                e.0.put_u64_le(*layer);
                e.0.put_u64_le(*lba);
                e.0.put_u32_le(*blocks);
                e.0.put_u8(*data as u8);
            }
            Request::RebuildBegin {
                epoch,
                session,
                start,
                size_blocks,
                layers,
            } => {
                e.0.put_u8(8);
                e.0.put_u64_le(*epoch);
                e.0.put_u64_le(*session);
                e.tag(*start);
                e.0.put_u64_le(*size_blocks);
                e.layers(layers);
            }
            Request::Copy {
                epoch,
                session,
                layer,
                lba,
                entries,
            } => {
                e.0.put_u8(9);
                e.0.put_u64_le(*epoch);
                e.0.put_u64_le(*session);
                e.0.put_u64_le(*layer);
                e.0.put_u64_le(*lba);
                e.entries(entries);
            }
            Request::RebuildEnd {
                epoch,
                session,
                position,
            } => {
                e.0.put_u8(10);
                e.0.put_u64_le(*epoch);
                e.0.put_u64_le(*session);
                e.tag(*position);
            }
            Request::Repair {
                epoch,
                layer,
                lba,
                entries,
            } => {
                e.0.put_u8(11);
                e.0.put_u64_le(*epoch);
                e.0.put_u64_le(*layer);
                e.0.put_u64_le(*lba);
                e.entries(entries);
            }
            Request::Detach { epoch } => {
                e.0.put_u8(12);
                e.0.put_u64_le(*epoch);
            }
            Request::Adopt { epoch, position } => {
                e.0.put_u8(13);
                e.0.put_u64_le(*epoch);
                e.tag(*position);
            }
        }
    }

    /// Decodes a frame payload (block data is copied out of `buf`).
    pub fn decode(buf: &[u8]) -> Result<ReqFrame, DecodeError> {
        Self::decode_in(buf, None)
    }

    /// Decodes a frame payload; block data are views of `buf`, not copies.
    pub fn decode_bytes(buf: &Bytes) -> Result<ReqFrame, DecodeError> {
        Self::decode_in(buf, Some(buf))
    }

    fn decode_in(buf: &[u8], owner: Option<&Bytes>) -> Result<ReqFrame, DecodeError> {
        if buf.len() > MAX_FRAME {
            return err("frame too large");
        }
        let mut d = Dec(R::new(buf), owner);
        let id = d.u64("request id")?;
        let req = match d.u8("request kind")? {
            1 => Request::Probe,
            2 => Request::Attach {
                epoch: d.u64("epoch")?,
                engine: d.u64("engine")?,
            },
            3 => Request::Ping {
                epoch: d.u64("epoch")?,
            },
            4 => {
                let epoch = d.u64("epoch")?;
                let tag = d.tag("tag")?;
                let op = match d.u8("op kind")? {
                    1 => {
                        let lba = d.u64("lba")?;
                        let n = d.blocks("write")?;
                        let data = d.data(n as usize * BLOCK_SIZE, "write data")?;
                        Op::Write { lba, data }
                    }
                    2 => Op::Zero {
                        lba: d.u64("lba")?,
                        blocks: d.blocks("zero")?,
                    },
                    3 => {
                        let name = d.name()?;
                        Op::Snapshot {
                            name,
                            new_head: d.u64("new head")?,
                        }
                    }
                    4 => Op::DeleteSnapshot {
                        layer: d.u64("layer")?,
                    },
                    5 => Op::Revert {
                        layer: d.u64("layer")?,
                        new_head: d.u64("new head")?,
                    },
                    6 => Op::Resize {
                        size_blocks: d.u64("size")?,
                    },
                    k => return Err(DecodeError(format!("unknown op kind {k}"))),
                };
                Request::Op { epoch, tag, op }
            }
            5 => Request::Flush {
                epoch: d.u64("epoch")?,
            },
            6 => Request::Read {
                epoch: d.u64("epoch")?,
                lba: d.u64("lba")?,
                blocks: d.blocks("read")?,
            },
            7 => Request::ReadLayer {
                epoch: d.u64("epoch")?,
                layer: d.u64("layer")?,
                lba: d.u64("lba")?,
                blocks: d.blocks("read layer")?,
                data: d.u8("data flag")? != 0,
            },
            8 => Request::RebuildBegin {
                epoch: d.u64("epoch")?,
                session: d.u64("session")?,
                start: d.tag("start")?,
                size_blocks: d.u64("size")?,
                layers: d.layers()?,
            },
            9 => Request::Copy {
                epoch: d.u64("epoch")?,
                session: d.u64("session")?,
                layer: d.u64("layer")?,
                lba: d.u64("lba")?,
                entries: d.entries()?,
            },
            10 => Request::RebuildEnd {
                epoch: d.u64("epoch")?,
                session: d.u64("session")?,
                position: d.tag("position")?,
            },
            11 => Request::Repair {
                epoch: d.u64("epoch")?,
                layer: d.u64("layer")?,
                lba: d.u64("lba")?,
                entries: d.entries()?,
            },
            12 => Request::Detach {
                epoch: d.u64("epoch")?,
            },
            13 => Request::Adopt {
                epoch: d.u64("epoch")?,
                position: d.tag("position")?,
            },
            14 => Request::Lease {
                epoch: d.u64("epoch")?,
                duration_us: d.u64("lease duration")?,
            },
            k => return Err(DecodeError(format!("unknown request kind {k}"))),
        };
        d.end()?;
        Ok(ReqFrame { id, req })
    }
}

fn put_block_tag<B: BufMut>(e: &mut Enc<B>, t: &BlockTag) {
    match t {
        BlockTag::Absent => e.0.put_u8(0),
        BlockTag::Present { tag, zero, valid } => {
            e.0.put_u8(1 | (*zero as u8) << 1 | (*valid as u8) << 2);
            e.tag(*tag);
        }
    }
}

impl RespFrame {
    /// Encodes the frame payload.
    pub fn encode(&self) -> BytesMut {
        let mut e = Enc(BytesMut::with_capacity(64));
        self.put(&mut e);
        e.0
    }

    /// Appends the encoded frame payload to `out` (a frame being built in
    /// a send queue: no intermediate buffer).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        self.put(&mut Enc(out));
    }

    /// Appends a [`Response::Data`] frame of `blocks` blocks to `out`,
    /// with the data filled in place by `read` (which returns the bad
    /// blocks, as [`Response::Data`] carries them). `read` must write every
    /// byte of the slice it gets (it starts with unspecified contents, see
    /// [`FrameBuf::extend_unspecified`]). On an error nothing is appended.
    /// The same bytes as [`RespFrame::encode_into`] of the finished
    /// response.
    pub fn encode_data_into<E>(
        id: u64,
        blocks: u32,
        out: &mut FrameBuf,
        read: impl FnOnce(&mut [u8]) -> Result<Vec<(u64, u64)>, E>,
    ) -> Result<(), E> {
        let start = out.len();
        out.put_u64_le(id);
        out.put_u8(3);
        out.put_u32_le(blocks);
        // `read` overwrites every byte (the block data, or zeros in place
        // of blocks it reports bad): no need to zero them first.
        let data = out.extend_unspecified(blocks as usize * BLOCK_SIZE);
        match read(data) {
            Ok(bad) => {
                out.put_u32_le(bad.len() as u32);
                for (l, y) in bad {
                    out.put_u64_le(l);
                    out.put_u64_le(y);
                }
                Ok(())
            }
            Err(e) => {
                out.truncate(start);
                Err(e)
            }
        }
    }

    fn put<B: BufMut>(&self, e: &mut Enc<B>) {
        e.0.put_u64_le(self.id);
        match &self.resp {
            Response::Info(i) => {
                e.0.put_u8(1);
                e.0.put_u64_le(i.epoch);
                e.0.put_u64_le(i.engine);
                e.0.put_u8(i.state.to_u8());
                e.tag(i.position);
                e.0.put_u64_le(i.size_blocks);
                e.layers(&i.layers);
                e.0.put_u8(i.recovered as u8);
            }
            Response::Ack(t) => {
                e.0.put_u8(2);
                e.tag(*t);
            }
            Response::Data { data, bad } => {
                e.0.put_u8(3);
                e.0.put_u32_le((data.len() / BLOCK_SIZE) as u32);
                e.0.put_slice(data);
                e.0.put_u32_le(bad.len() as u32);
                for (l, y) in bad {
                    e.0.put_u64_le(*l);
                    e.0.put_u64_le(*y);
                }
            }
            Response::Layer(v) => {
                e.0.put_u8(4);
                e.0.put_u32_le(v.len() as u32);
                for (t, d) in v {
                    put_block_tag(e, t);
                    match d {
                        Some(d) => {
                            e.0.put_u8(1);
                            e.0.put_slice(d);
                        }
                        None => e.0.put_u8(0),
                    }
                }
            }
            Response::Refused(r) => {
                e.0.put_u8(5);
                match r {
                    Refusal::StaleEpoch { current } => {
                        e.0.put_u8(1);
                        e.0.put_u64_le(*current);
                    }
                    Refusal::OutOfOrder { position } => {
                        e.0.put_u8(2);
                        e.tag(*position);
                    }
                    Refusal::Rebuilding => e.0.put_u8(3),
                    Refusal::Faulted => e.0.put_u8(4),
                    Refusal::Invalid(s) => {
                        e.0.put_u8(5);
                        let b = &s.as_bytes()[..s.len().min(1024)];
                        e.0.put_u16_le(b.len() as u16);
                        e.0.put_slice(b);
                    }
                    Refusal::Leased { remaining_ms } => {
                        e.0.put_u8(6);
                        e.0.put_u64_le(*remaining_ms);
                    }
                }
            }
            Response::Lease { granted_us } => {
                e.0.put_u8(6);
                e.0.put_u64_le(*granted_us);
            }
        }
    }

    /// Decodes a frame payload (block data is copied out of `buf`).
    pub fn decode(buf: &[u8]) -> Result<RespFrame, DecodeError> {
        Self::decode_in(buf, None)
    }

    /// Decodes a frame payload; block data are views of `buf`, not copies.
    pub fn decode_bytes(buf: &Bytes) -> Result<RespFrame, DecodeError> {
        Self::decode_in(buf, Some(buf))
    }

    fn decode_in(buf: &[u8], owner: Option<&Bytes>) -> Result<RespFrame, DecodeError> {
        if buf.len() > MAX_FRAME {
            return err("frame too large");
        }
        let mut d = Dec(R::new(buf), owner);
        let id = d.u64("response id")?;
        let resp = match d.u8("response kind")? {
            1 => Response::Info(ReplicaInfo {
                epoch: d.u64("epoch")?,
                engine: d.u64("engine")?,
                state: ReplicaState::from_u8(d.u8("state")?)
                    .ok_or_else(|| DecodeError("unknown replica state".into()))?,
                position: d.tag("position")?,
                size_blocks: d.u64("size")?,
                layers: d.layers()?,
                recovered: match d.u8("recovered flag")? {
                    0 => false,
                    1 => true,
                    _ => return err("bad recovered flag"),
                },
            }),
            2 => Response::Ack(d.tag("position")?),
            3 => {
                let n = d.blocks("data")?;
                let data = d.data(n as usize * BLOCK_SIZE, "data")?;
                let nb = d.u32("bad count")?;
                if nb > n {
                    return err("more bad blocks than blocks");
                }
                let mut bad = Vec::with_capacity(nb as usize);
                for _ in 0..nb {
                    bad.push((d.u64("bad lba")?, d.u64("bad layer")?));
                }
                Response::Data { data, bad }
            }
            4 => {
                let n = d.u32("layer entries")?;
                if n as usize > MAX_IO_BLOCKS {
                    return err("too many layer entries");
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let k = d.u8("block tag")?;
                    let t = if k == 0 {
                        BlockTag::Absent
                    } else if k & 1 == 1 && k < 8 {
                        BlockTag::Present {
                            tag: d.tag("block tag")?,
                            zero: k & 2 != 0,
                            valid: k & 4 != 0,
                        }
                    } else {
                        return err("bad block tag");
                    };
                    let data = match d.u8("data flag")? {
                        0 => None,
                        1 => Some(d.data(BLOCK_SIZE, "block data")?),
                        _ => return err("bad data flag"),
                    };
                    v.push((t, data));
                }
                Response::Layer(v)
            }
            5 => Response::Refused(match d.u8("refusal")? {
                1 => Refusal::StaleEpoch {
                    current: d.u64("epoch")?,
                },
                2 => Refusal::OutOfOrder {
                    position: d.tag("position")?,
                },
                3 => Refusal::Rebuilding,
                4 => Refusal::Faulted,
                5 => {
                    let lo = d.u8("len")? as usize;
                    let hi = d.u8("len")? as usize;
                    let b = d.bytes(lo | hi << 8, "message")?;
                    Refusal::Invalid(String::from_utf8_lossy(b).into_owned())
                }
                6 => Refusal::Leased {
                    remaining_ms: d.u64("lease remaining")?,
                },
                k => return Err(DecodeError(format!("unknown refusal {k}"))),
            }),
            6 => Response::Lease {
                granted_us: d.u64("lease granted")?,
            },
            k => return Err(DecodeError(format!("unknown response kind {k}"))),
        };
        d.end()?;
        Ok(RespFrame { id, resp })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn tag() -> impl Strategy<Value = Tag> {
        (any::<u64>(), any::<u64>()).prop_map(|(e, i)| Tag::new(e, i))
    }

    #[test]
    fn frame_buf_reuses_written_bytes_and_zeroes_the_rest() {
        let mut q = FrameBuf::new();
        // A fresh allocation: zeros.
        assert!(q.extend_unspecified(100).iter().all(|&b| b == 0));
        q.clear();
        q.extend_from_slice(&[1, 2]);
        q.extend_unspecified(50).fill(9);
        q.clear();
        // Bytes written earlier are handed back as they are (not zeroed
        // again); past the high-water mark they are zeros.
        q.push(5);
        let d = q.extend_unspecified(60);
        assert_eq!(d.len(), 60);
        assert_eq!(&d[..1], &[2]);
        assert!(d[1..51].iter().all(|&b| b == 9));
        assert!(d[51..].iter().all(|&b| b == 0));
        assert_eq!(q.len(), 61);
        // Growing past the allocation (moved or in place) restarts the
        // mark at the length: zeros.
        let cap = q.capacity();
        q.clear();
        q.push(1);
        let d = q.extend_unspecified(cap * 4);
        assert_eq!(d.len(), cap * 4);
        assert!(d.iter().all(|&b| b == 0));
        // So does shrinking it.
        q.extend_unspecified(100).fill(4);
        q.clear();
        q.shrink_to(16);
        let d = q.extend_unspecified(16);
        assert!(d.iter().all(|&b| b == 0));
    }

    fn layers() -> impl Strategy<Value = Vec<LayerInfo>> {
        prop::collection::vec(
            (any::<u64>(), "[a-z0-9]{0,12}", tag()).prop_map(|(id, name, created)| LayerInfo {
                id,
                name,
                created,
            }),
            1..4,
        )
    }

    fn entry() -> impl Strategy<Value = CopyEntry> {
        prop_oneof![
            Just(CopyEntry::Absent),
            Just(CopyEntry::Skip),
            tag().prop_map(CopyEntry::Zero),
            tag().prop_map(CopyEntry::Bad),
            (tag(), any::<u8>())
                .prop_map(|(t, b)| CopyEntry::Data(t, Bytes::from(vec![b; BLOCK_SIZE]))),
        ]
    }

    fn request() -> impl Strategy<Value = Request> {
        prop_oneof![
            Just(Request::Probe),
            (any::<u64>(), any::<u64>())
                .prop_map(|(epoch, engine)| Request::Attach { epoch, engine }),
            any::<u64>().prop_map(|epoch| Request::Ping { epoch }),
            (any::<u64>(), any::<u64>())
                .prop_map(|(epoch, duration_us)| Request::Lease { epoch, duration_us }),
            (any::<u64>(), tag(), any::<u64>(), 1u32..4, any::<u8>()).prop_map(
                |(epoch, tag, lba, n, b)| Request::Op {
                    epoch,
                    tag,
                    op: Op::Write {
                        lba,
                        data: Bytes::from(vec![b; n as usize * BLOCK_SIZE])
                    },
                }
            ),
            (any::<u64>(), tag(), any::<u64>(), 1u32..=256).prop_map(
                |(epoch, tag, lba, blocks)| Request::Op {
                    epoch,
                    tag,
                    op: Op::Zero { lba, blocks },
                }
            ),
            (any::<u64>(), tag(), "[a-z]{1,10}", any::<u64>()).prop_map(
                |(epoch, tag, name, new_head)| Request::Op {
                    epoch,
                    tag,
                    op: Op::Snapshot { name, new_head },
                }
            ),
            (
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                1u32..=256,
                any::<bool>()
            )
                .prop_map(|(epoch, layer, lba, blocks, data)| Request::ReadLayer {
                    epoch,
                    layer,
                    lba,
                    blocks,
                    data
                }),
            (any::<u64>(), any::<u64>(), tag(), any::<u64>(), layers()).prop_map(
                |(epoch, session, start, size_blocks, layers)| Request::RebuildBegin {
                    epoch,
                    session,
                    start,
                    size_blocks,
                    layers
                }
            ),
            (
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                prop::collection::vec(entry(), 1..4)
            )
                .prop_map(|(epoch, session, layer, lba, entries)| Request::Copy {
                    epoch,
                    session,
                    layer,
                    lba,
                    entries
                }),
            (any::<u64>(), tag()).prop_map(|(epoch, position)| Request::Adopt { epoch, position }),
        ]
    }

    proptest! {
        #[test]
        fn requests_roundtrip(id in any::<u64>(), req in request()) {
            let f = ReqFrame { id, req };
            prop_assert_eq!(ReqFrame::decode(&f.encode()), Ok(f.clone()));
            // Built in a send queue and decoded without copies: the same.
            let mut q = b"queued".to_vec();
            f.encode_into(&mut q);
            prop_assert_eq!(&q[6..], &f.encode()[..]);
            let owned = Bytes::copy_from_slice(&q[6..]);
            prop_assert_eq!(ReqFrame::decode_bytes(&owned), Ok(f));
        }

        #[test]
        fn data_answers_built_in_place_match(
            id in any::<u64>(),
            blocks in 3u32..=4,
            fill in any::<u8>(),
            bad in prop::collection::vec((any::<u64>(), any::<u64>()), 0..3),
        ) {
            let data = Bytes::from(vec![fill; blocks as usize * BLOCK_SIZE]);
            let f = RespFrame { id, resp: Response::Data { data, bad: bad.clone() } };
            // Appends the answer after three bytes of another frame.
            let build = |q: &mut FrameBuf| {
                q.clear();
                q.extend_from_slice(&[7u8; 3]);
                RespFrame::encode_data_into::<()>(id, blocks, q, |b| {
                    b.fill(fill);
                    Ok(bad.clone())
                })
            };
            let mut q = FrameBuf::new();
            build(&mut q).unwrap();
            prop_assert_eq!(&q[3..], &f.encode()[..]);
            let owned = Bytes::copy_from_slice(&q[3..]);
            prop_assert_eq!(RespFrame::decode_bytes(&owned), Ok(f.clone()));
            // A failed read appends nothing.
            let before = q.len();
            let r = RespFrame::encode_data_into(id, blocks, &mut q, |_| Err("io"));
            prop_assert_eq!(r, Err("io"));
            prop_assert_eq!(q.len(), before);
            // Built again over the stale bytes of the first answer: the
            // same frame.
            build(&mut q).unwrap();
            prop_assert_eq!(&q[3..], &f.encode()[..]);
        }

        #[test]
        fn arbitrary_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(f) = ReqFrame::decode(&data) {
                prop_assert_eq!(ReqFrame::decode(&f.encode()), Ok(f));
            }
            if let Ok(f) = RespFrame::decode(&data) {
                prop_assert_eq!(RespFrame::decode(&f.encode()), Ok(f));
            }
        }

        #[test]
        fn truncated_frames_are_errors(id in any::<u64>(), req in request(), cut in 1usize..64) {
            let b = ReqFrame { id, req }.encode();
            let cut = cut.min(b.len());
            prop_assert!(ReqFrame::decode(&b[..b.len() - cut]).is_err());
        }
    }

    #[test]
    fn lease_frames_roundtrip_and_old_decoders_would_refuse_them() {
        for resp in [
            Response::Lease {
                granted_us: 1_000_000,
            },
            Response::Refused(Refusal::Leased { remaining_ms: 7 }),
        ] {
            let f = RespFrame { id: 3, resp };
            assert_eq!(RespFrame::decode(&f.encode()), Ok(f));
        }
        let b = ReqFrame {
            id: 1,
            req: Request::Lease {
                epoch: 2,
                duration_us: 5,
            },
        }
        .encode();
        // Kind 14: a decoder without leases stops at "unknown request kind".
        assert_eq!(b[8], 14);
        let e = RespFrame::decode(&[0, 0, 0, 0, 0, 0, 0, 0, 6, 1]).unwrap_err();
        assert!(e.0.contains("lease granted"), "{e}");
    }

    #[test]
    fn errors_name_the_problem() {
        let e = ReqFrame::decode(&[0, 0, 0, 0, 0, 0, 0, 0, 99]).unwrap_err();
        assert!(e.0.contains("unknown request kind 99"), "{e}");
        let mut b = ReqFrame {
            id: 1,
            req: Request::Read {
                epoch: 1,
                lba: 0,
                blocks: 1,
            },
        }
        .encode()
        .to_vec();
        let n = b.len();
        b[n - 4..].copy_from_slice(&100_000u32.to_le_bytes());
        assert!(ReqFrame::decode(&b).unwrap_err().0.contains("block count"));
    }
}
