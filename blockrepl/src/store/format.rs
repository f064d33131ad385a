// SPDX-License-Identifier: Apache-2.0
//! On-disk formats: the double-buffered superblock, per-block metadata
//! entries and write-ahead-log records. Every structure carries a CRC32C and
//! every decoder returns `None` or an error (never panics) on bad input.
//!
//! Versioning: the superblock's flags byte is the feature list. A decoder
//! refuses flags it does not know, so a feature that older versions must
//! not misread (like a block checksum other than SHA-256, flag 4) sets a
//! new flag; stores without it keep their exact old encoding. The same goes
//! for WAL record CRCs over block checksums (flag 16).

use crate::types::{BlockChecksum, LayerInfo, MAX_LAYERS, MAX_NAME_LEN, ReplicaState, Tag};

/// Size of one superblock slot; the superblock file holds two.
pub const SB_SLOT: usize = 4096;
const SB_MAGIC: &[u8; 8] = b"SHEAFSB1";

/// The replica's root record. Two slots are written alternately; the valid
/// slot with the highest generation wins, so a torn superblock write falls
/// back to the previous one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// Incremented on every write.
    pub generation: u64,
    /// Volume size in blocks.
    pub size_blocks: u64,
    /// Highest accepted epoch.
    pub epoch: u64,
    /// Engine holding `epoch`.
    pub engine: u64,
    /// Clean or rebuilding (the completion marker).
    pub state: ReplicaState,
    /// Position covered by the layer files (the WAL may hold more).
    pub position: Tag,
    /// Generation of the WAL: records of other generations are ignored.
    pub wal_gen: u64,
    /// Layer chain, bottom first, head last.
    pub layers: Vec<LayerInfo>,
    /// Boot id of the node when this superblock was written (see
    /// [`crate::store::disk::StoreDir::boot_id`]).
    pub boot_id: u64,
    /// An engine attached since the last clean detach: the replica may have
    /// acknowledged writes that are not synced yet.
    pub open: bool,
    /// The node lost its page cache while `open`: the replica may lack
    /// writes it acknowledged. Cleared when an engine adopts or rebuilds it.
    pub recovered: bool,
    /// Per-block checksum algorithm, fixed when the store is created.
    /// SHA-256 is encoded as before the field existed (no flag, no byte),
    /// so such stores stay readable by older versions.
    pub checksum: BlockChecksum,
    /// The second WAL file may hold live records (flag 8; older versions
    /// refuse the store while it is set).
    pub two_wal: bool,
    /// WAL records of generation `wal_gen` (and later) are checksummed over
    /// the header and the blocks' checksums, not the data (flag 16, see
    /// [`WalHeader::encode_sums`]; older versions refuse the store while
    /// it is set).
    pub wal_sums: bool,
    /// Layers may have extent files (`layer-N.ext`) that metadata entries
    /// ([`META_EXTENT`]) and WAL records ([`WalKind::ExtWrite`]) point
    /// into (flag 32, set before the first extent write and never cleared;
    /// older versions refuse the store).
    pub extents: bool,
}

const SB_OPEN: u8 = 1;
const SB_RECOVERED: u8 = 2;
/// A checksum algorithm code byte follows the flags. Versions before it
/// reject the unknown flag, so they refuse (instead of failing every
/// block's checksum) a store that does not use SHA-256.
const SB_CHECKSUM: u8 = 4;
/// The second WAL file (`wal.1`) may hold live records (checkpoints run
/// off the write path, see the store). Versions before it replay only
/// `wal`, so they must refuse such a store.
const SB_TWO_WAL: u8 = 8;
/// WAL record CRCs cover the header and the per-block checksums instead
/// of the data ([`WalHeader::encode_sums`]). Versions before it would see
/// a CRC mismatch at the first such record and take it for the end of the
/// WAL, dropping flushed writes, so they must refuse such a store.
const SB_WAL_SUMS: u8 = 16;
/// Layers may hold data in extent files (redirect-on-write of large
/// writes). Versions before it would take every extent metadata entry for
/// damage and an extent WAL record for the end of the WAL, so they must
/// refuse such a store.
const SB_EXTENTS: u8 = 32;
const SB_KNOWN: u8 = SB_OPEN | SB_RECOVERED | SB_CHECKSUM | SB_TWO_WAL | SB_WAL_SUMS | SB_EXTENTS;

/// Why a superblock slot was not decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SbError {
    /// Not a superblock (bad magic or CRC, truncated, bad field).
    #[error("not a valid superblock slot")]
    Invalid,
    /// An intact superblock this version cannot use: a newer feature flag.
    #[error(
        "superblock generation {generation} has unknown feature flags {flags:#04x} (written by a newer version?)"
    )]
    UnknownFlags {
        /// Generation of the slot.
        generation: u64,
        /// The unknown flag bits.
        flags: u8,
    },
    /// An intact superblock naming a checksum algorithm this version lacks.
    #[error(
        "superblock generation {generation} names unknown block checksum algorithm {code} (written by a newer version?)"
    )]
    UnknownChecksum {
        /// Generation of the slot.
        generation: u64,
        /// The algorithm code.
        code: u8,
    },
}

impl SbError {
    /// Generation of an intact but unusable slot (`None` for invalid ones).
    pub fn generation(&self) -> Option<u64> {
        match self {
            SbError::Invalid => None,
            SbError::UnknownFlags { generation, .. }
            | SbError::UnknownChecksum { generation, .. } => Some(*generation),
        }
    }
}

struct W<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl W<'_> {
    fn put(&mut self, b: &[u8]) -> Option<()> {
        let end = self.pos.checked_add(b.len())?;
        self.buf.get_mut(self.pos..end)?.copy_from_slice(b);
        self.pos = end;
        Some(())
    }
    fn u64(&mut self, v: u64) -> Option<()> {
        self.put(&v.to_le_bytes())
    }
}

pub(crate) struct R<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> R<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        R { buf, pos: 0 }
    }
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub(crate) fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

impl Superblock {
    /// Encodes into one slot. Fails only if the layer list is too long, which
    /// the store prevents.
    pub fn encode(&self) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; SB_SLOT];
        if self.layers.len() > MAX_LAYERS {
            return None;
        }
        {
            let mut w = W {
                buf: &mut buf,
                pos: 0,
            };
            w.put(SB_MAGIC)?;
            w.put(&[0; 4])?; // crc, filled below
            w.u64(self.generation)?;
            w.u64(self.size_blocks)?;
            w.u64(self.epoch)?;
            w.u64(self.engine)?;
            w.put(&[self.state.to_u8()])?;
            w.u64(self.position.epoch)?;
            w.u64(self.position.index)?;
            w.u64(self.wal_gen)?;
            w.put(&[self.layers.len() as u8])?;
            for l in &self.layers {
                w.u64(l.id)?;
                w.u64(l.created.epoch)?;
                w.u64(l.created.index)?;
                let name = l.name.as_bytes();
                if name.len() > MAX_NAME_LEN {
                    return None;
                }
                w.put(&[name.len() as u8])?;
                w.put(name)?;
            }
            w.u64(self.boot_id)?;
            let legacy = self.checksum == BlockChecksum::Sha256;
            let flags = if self.open { SB_OPEN } else { 0 }
                | if self.recovered { SB_RECOVERED } else { 0 }
                | if legacy { 0 } else { SB_CHECKSUM }
                | if self.two_wal { SB_TWO_WAL } else { 0 }
                | if self.wal_sums { SB_WAL_SUMS } else { 0 }
                | if self.extents { SB_EXTENTS } else { 0 };
            w.put(&[flags])?;
            if !legacy {
                w.put(&[self.checksum.code()])?;
            }
        }
        let crc = crc32c::crc32c(&buf[12..]);
        buf[8..12].copy_from_slice(&crc.to_le_bytes());
        Some(buf)
    }

    /// Decodes one slot: [`SbError::Invalid`] if it is not a valid
    /// superblock, another error if it is intact but needs a newer version.
    pub fn decode(buf: &[u8]) -> Result<Superblock, SbError> {
        Self::decode_inner(buf).ok_or(SbError::Invalid)?
    }

    fn decode_inner(buf: &[u8]) -> Option<Result<Superblock, SbError>> {
        if buf.len() != SB_SLOT || &buf[..8] != SB_MAGIC {
            return None;
        }
        let crc = u32::from_le_bytes(buf[8..12].try_into().ok()?);
        if crc != crc32c::crc32c(&buf[12..]) {
            return None;
        }
        let mut r = R::new(&buf[12..]);
        let generation = r.u64()?;
        let size_blocks = r.u64()?;
        let epoch = r.u64()?;
        let engine = r.u64()?;
        let state = ReplicaState::from_u8(r.u8()?)?;
        let position = Tag::new(r.u64()?, r.u64()?);
        let wal_gen = r.u64()?;
        let n = r.u8()? as usize;
        if n == 0 || n > MAX_LAYERS {
            return None;
        }
        let mut layers = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u64()?;
            let created = Tag::new(r.u64()?, r.u64()?);
            let len = r.u8()? as usize;
            if len > MAX_NAME_LEN {
                return None;
            }
            let name = std::str::from_utf8(r.take(len)?).ok()?.to_string();
            layers.push(LayerInfo { id, name, created });
        }
        let boot_id = r.u64()?;
        let flags = r.u8()?;
        if flags & !SB_KNOWN != 0 {
            return Some(Err(SbError::UnknownFlags {
                generation,
                flags: flags & !SB_KNOWN,
            }));
        }
        let checksum = if flags & SB_CHECKSUM != 0 {
            let code = r.u8()?;
            match BlockChecksum::from_code(code) {
                Some(c) => c,
                None => return Some(Err(SbError::UnknownChecksum { generation, code })),
            }
        } else {
            BlockChecksum::Sha256
        };
        Some(Ok(Superblock {
            generation,
            size_blocks,
            epoch,
            engine,
            state,
            position,
            wal_gen,
            layers,
            boot_id,
            open: flags & SB_OPEN != 0,
            recovered: flags & SB_RECOVERED != 0,
            checksum,
            two_wal: flags & SB_TWO_WAL != 0,
            wal_sums: flags & SB_WAL_SUMS != 0,
            extents: flags & SB_EXTENTS != 0,
        }))
    }
}

/// Size of one per-block metadata entry in a layer's meta file.
pub const META_SIZE: usize = 32;
/// Metadata flag: the layer holds this block.
pub const META_PRESENT: u32 = 1;
/// Metadata flag: the block reads as zeros (no data stored).
pub const META_ZERO: u32 = 2;
/// Metadata flag: the copy is known bad (a snapshot delete merged a copy that
/// failed verification); the tag and checksum are those of the write that
/// produced the lost copy, so a peer's copy of the same write can repair it.
/// Such entries are sealed with `crc32c ^ META_DAMAGED_SEAL`, so a store
/// version without this flag sees a damaged entry (as it always wrote one:
/// all-ones) instead of a valid block; no format version bump is needed in
/// either direction.
pub const META_DAMAGED: u32 = 4;
const META_DAMAGED_SEAL: u32 = 0x4441_4d47; // "DAMG"
/// Metadata flag: the block's data is in the layer's extent file, at the
/// extent block number in bytes 24..28 (only in stores with the
/// superblock's `extents` flag; versions without it see unknown flags and
/// take the entry for damage, which that flag keeps from happening).
pub const META_EXTENT: u32 = 8;
const META_KNOWN: u32 = META_PRESENT | META_ZERO | META_DAMAGED | META_EXTENT;

/// Per-block metadata of one layer: which write produced the block and the
/// checksum of its content (covering its address).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockMeta {
    /// Write that produced the block.
    pub tag: Tag,
    /// The store's [`BlockChecksum`] of `(lba, data)`, 0 for zero blocks.
    pub crc: u32,
    /// `META_*` flags.
    pub flags: u32,
}

impl BlockMeta {
    /// Whether the block reads as zeros.
    pub fn is_zero(&self) -> bool {
        self.flags & META_ZERO != 0
    }

    /// Whether the entry records a copy known to be bad ([`META_DAMAGED`]).
    pub fn is_damaged(&self) -> bool {
        self.flags & META_DAMAGED != 0
    }

    /// Encodes an entry (with its own CRC; sealed if damaged).
    pub fn encode(&self) -> [u8; META_SIZE] {
        let mut b = [0u8; META_SIZE];
        b[0..8].copy_from_slice(&self.tag.epoch.to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.index.to_le_bytes());
        b[16..20].copy_from_slice(&self.crc.to_le_bytes());
        b[20..24].copy_from_slice(&self.flags.to_le_bytes());
        let mut c = crc32c::crc32c(&b[..28]);
        if self.is_damaged() {
            c ^= META_DAMAGED_SEAL;
        }
        b[28..32].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Encodes an entry whose data is at extent block `blk` of the layer's
    /// extent file ([`META_EXTENT`]).
    pub fn encode_extent(&self, blk: u32) -> [u8; META_SIZE] {
        let mut m = *self;
        m.flags |= META_EXTENT;
        let mut b = m.encode();
        b[24..28].copy_from_slice(&blk.to_le_bytes());
        let mut c = crc32c::crc32c(&b[..28]);
        if self.is_damaged() {
            c ^= META_DAMAGED_SEAL;
        }
        b[28..32].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// The extent block of an entry decoded with [`META_EXTENT`] from `b`.
    pub fn extent_block(b: &[u8]) -> Option<u32> {
        Some(u32::from_le_bytes(b.get(24..28)?.try_into().ok()?))
    }

    /// Decodes an entry. `Ok(None)`: an all-zero (absent) entry. `Err(())`:
    /// an unreadable entry (tag unknown). An entry recording a known bad
    /// copy decodes with [`META_DAMAGED`] set.
    #[allow(clippy::result_unit_err)]
    pub fn decode(b: &[u8]) -> Result<Option<BlockMeta>, ()> {
        if b.len() != META_SIZE {
            return Err(());
        }
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        let rd = |r: std::ops::Range<usize>| -> Result<[u8; 8], ()> {
            let mut out = [0u8; 8];
            out[..r.len()].copy_from_slice(&b[r]);
            Ok(out)
        };
        let c = u32::from_le_bytes(b[28..32].try_into().map_err(|_| ())?);
        let want = crc32c::crc32c(&b[..28]);
        let flags = u32::from_le_bytes(b[20..24].try_into().map_err(|_| ())?);
        let damaged = flags & META_DAMAGED != 0;
        let sealed = if damaged {
            want ^ META_DAMAGED_SEAL
        } else {
            want
        };
        if c != sealed || flags & !META_KNOWN != 0 {
            return Err(());
        }
        if flags & META_PRESENT == 0 {
            return Ok(None);
        }
        Ok(Some(BlockMeta {
            tag: Tag::new(
                u64::from_le_bytes(rd(0..8)?),
                u64::from_le_bytes(rd(8..16)?),
            ),
            crc: u32::from_le_bytes(b[16..20].try_into().map_err(|_| ())?),
            flags,
        }))
    }
}

/// Size of a WAL record header.
pub const WAL_HDR: usize = 64;
const WAL_MAGIC: u32 = 0x5741_4c31; // "WAL1"

/// Kind of a WAL record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalKind {
    /// An ordered write with data; advances the position to its tag.
    Write,
    /// An ordered write of zeros (trim / write-zeroes); advances the position.
    Zero,
    /// A block set by rebuild or repair (tag is the block's, position unchanged).
    SetData,
    /// A zero block set by rebuild or repair.
    SetZero,
    /// A block removed from a layer by rebuild.
    SetAbsent,
    /// An ordered write whose data is in the layer's extent file at the
    /// extent block in header bytes 52..60 ([`WalHeader::encode_extent`]);
    /// no data follows. Only in `wal_sums` generations of stores with the
    /// `extents` flag: the record CRC covers the header and the checksums
    /// of the extent data, so torn extent data fails the record.
    ExtWrite,
}

impl WalKind {
    fn to_u8(self) -> u8 {
        match self {
            WalKind::Write => 1,
            WalKind::Zero => 2,
            WalKind::SetData => 3,
            WalKind::SetZero => 4,
            WalKind::SetAbsent => 5,
            WalKind::ExtWrite => 6,
        }
    }
    fn from_u8(v: u8) -> Option<WalKind> {
        Some(match v {
            1 => WalKind::Write,
            2 => WalKind::Zero,
            3 => WalKind::SetData,
            4 => WalKind::SetZero,
            5 => WalKind::SetAbsent,
            6 => WalKind::ExtWrite,
            _ => return None,
        })
    }
    /// Whether the record carries block data.
    pub fn has_data(self) -> bool {
        matches!(self, WalKind::Write | WalKind::SetData)
    }
    /// Whether the record is an ordered operation that advances the position.
    pub fn ordered(self) -> bool {
        matches!(self, WalKind::Write | WalKind::Zero | WalKind::ExtWrite)
    }
}

/// Header of a WAL record; `nblocks * 4096` bytes of data follow for kinds
/// with data.
///
/// The record CRC (bytes 60..64) covers the first 60 header bytes and
/// either the data ([`WalHeader::encode`], stores without the superblock's
/// `wal_sums` flag) or the store's [`crate::types::BlockChecksum`] of each
/// block, little-endian ([`WalHeader::encode_sums`]). Replay recomputes the
/// block checksums from the data it read, so a torn or damaged record fails
/// either way; the second form only saves hashing the data twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WalHeader {
    /// Record kind.
    pub kind: WalKind,
    /// WAL generation (must equal the superblock's).
    pub wal_gen: u64,
    /// Layer the record applies to.
    pub layer: u64,
    /// Tag of the write.
    pub tag: Tag,
    /// First block.
    pub lba: u64,
    /// Number of blocks.
    pub nblocks: u32,
}

impl WalHeader {
    /// Encodes the header; its CRC covers the header and `data`.
    pub fn encode(&self, data: &[u8]) -> [u8; WAL_HDR] {
        let mut b = [0u8; WAL_HDR];
        b[0..4].copy_from_slice(&WAL_MAGIC.to_le_bytes());
        b[4] = self.kind.to_u8();
        b[8..16].copy_from_slice(&self.wal_gen.to_le_bytes());
        b[16..24].copy_from_slice(&self.layer.to_le_bytes());
        b[24..32].copy_from_slice(&self.tag.epoch.to_le_bytes());
        b[32..40].copy_from_slice(&self.tag.index.to_le_bytes());
        b[40..48].copy_from_slice(&self.lba.to_le_bytes());
        b[48..52].copy_from_slice(&self.nblocks.to_le_bytes());
        let c = crc32c::crc32c_append(crc32c::crc32c(&b[..60]), data);
        b[60..64].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Decodes a header without checking the data CRC (see [`WalHeader::check`]).
    pub fn decode(b: &[u8]) -> Option<WalHeader> {
        let mut r = R::new(b.get(..WAL_HDR)?);
        if r.u32()? != WAL_MAGIC {
            return None;
        }
        let kind = WalKind::from_u8(r.u8()?)?;
        r.take(3)?;
        let wal_gen = r.u64()?;
        let layer = r.u64()?;
        let tag = Tag::new(r.u64()?, r.u64()?);
        let lba = r.u64()?;
        let nblocks = r.u32()?;
        if nblocks == 0 || nblocks > crate::proto::msg::MAX_IO_BLOCKS as u32 {
            return None;
        }
        Some(WalHeader {
            kind,
            wal_gen,
            layer,
            tag,
            lba,
            nblocks,
        })
    }

    /// Checks the record CRC over `hdr` bytes and `data`.
    pub fn check(hdr: &[u8], data: &[u8]) -> bool {
        if hdr.len() < WAL_HDR {
            return false;
        }
        let stored = u32::from_le_bytes([hdr[60], hdr[61], hdr[62], hdr[63]]);
        stored == crc32c::crc32c_append(crc32c::crc32c(&hdr[..60]), data)
    }

    /// Encodes the header; its CRC covers the header and `sums`, the block
    /// checksums of the data (none for kinds without data).
    pub fn encode_sums(&self, sums: &[u32]) -> [u8; WAL_HDR] {
        let mut b = self.encode(&[]);
        let c = sums_crc(&b[..60], sums);
        b[60..64].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Encodes an [`WalKind::ExtWrite`] header with its extent block `blk`;
    /// the CRC covers the header and `sums`, the block checksums.
    pub fn encode_extent(&self, blk: u64, sums: &[u32]) -> [u8; WAL_HDR] {
        let mut b = self.encode(&[]);
        b[52..60].copy_from_slice(&blk.to_le_bytes());
        let c = sums_crc(&b[..60], sums);
        b[60..64].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// The extent block of an [`WalKind::ExtWrite`] header `hdr`.
    pub fn extent_block(hdr: &[u8]) -> u64 {
        let mut a = [0u8; 8];
        if let Some(s) = hdr.get(52..60) {
            a.copy_from_slice(s);
        }
        u64::from_le_bytes(a)
    }

    /// Checks the record CRC over `hdr` bytes and the block checksums
    /// `sums` (recomputed from the data read).
    pub fn check_sums(hdr: &[u8], sums: &[u32]) -> bool {
        if hdr.len() < WAL_HDR {
            return false;
        }
        let stored = u32::from_le_bytes([hdr[60], hdr[61], hdr[62], hdr[63]]);
        stored == sums_crc(&hdr[..60], sums)
    }

    /// Data length following the header.
    pub fn data_len(&self) -> usize {
        if self.kind.has_data() {
            self.nblocks as usize * crate::types::BLOCK_SIZE
        } else {
            0
        }
    }
}

/// CRC32C of `hdr` followed by `sums` (little-endian).
fn sums_crc(hdr: &[u8], sums: &[u32]) -> u32 {
    let mut c = crc32c::crc32c(hdr);
    let mut buf = [0u8; 256];
    for part in sums.chunks(buf.len() / 4) {
        for (d, s) in buf.chunks_exact_mut(4).zip(part) {
            d.copy_from_slice(&s.to_le_bytes());
        }
        c = crc32c::crc32c_append(c, &buf[..part.len() * 4]);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb() -> Superblock {
        Superblock {
            generation: 7,
            size_blocks: 1024,
            epoch: 3,
            engine: 99,
            state: ReplicaState::Clean,
            position: Tag::new(3, 42),
            wal_gen: 5,
            layers: vec![
                LayerInfo {
                    id: 1,
                    name: "snap".into(),
                    created: Tag::new(1, 1),
                },
                LayerInfo {
                    id: 2,
                    name: String::new(),
                    created: Tag::new(2, 2),
                },
            ],
            boot_id: 0xdead_beef,
            open: true,
            recovered: true,
            checksum: BlockChecksum::Xxh3,
            two_wal: false,
            wal_sums: false,
            extents: false,
        }
    }

    /// Checks a superblock with one newer feature flag set: it round-trips,
    /// its flags byte is the usual bits plus `bit`, and versions that knew
    /// only `old_known` refuse it. Returns the flags byte's offset.
    fn check_new_flag(s: &Superblock, bit: u8, old_known: u8) -> usize {
        let b = s.encode().unwrap();
        assert_eq!(Superblock::decode(&b), Ok(s.clone()));
        let f = flags_at(s);
        assert_eq!(b[f], SB_OPEN | SB_RECOVERED | SB_CHECKSUM | bit);
        // The versions before the flag knew exactly these bits and refuse
        // any other with UnknownFlags.
        assert_ne!(b[f] & !old_known, 0);
        f
    }

    #[test]
    fn extents_flag_roundtrips_and_older_versions_refuse_it() {
        let s = Superblock {
            extents: true,
            ..sb()
        };
        let old_known = SB_OPEN | SB_RECOVERED | SB_CHECKSUM | SB_TWO_WAL | SB_WAL_SUMS;
        let f = check_new_flag(&s, SB_EXTENTS, old_known);
        let b0 = Superblock {
            extents: false,
            ..s
        }
        .encode()
        .unwrap();
        assert_eq!(b0[f], SB_OPEN | SB_RECOVERED | SB_CHECKSUM);
    }

    #[test]
    fn extent_meta_and_wal_record_roundtrip() {
        let m = BlockMeta {
            tag: Tag::new(3, 9),
            crc: 0x1234_5678,
            flags: META_PRESENT,
        };
        let b = m.encode_extent(77);
        let d = BlockMeta::decode(&b).unwrap().unwrap();
        assert_eq!(d.flags, META_PRESENT | META_EXTENT);
        assert_eq!((d.tag, d.crc), (m.tag, m.crc));
        assert_eq!(BlockMeta::extent_block(&b), Some(77));
        // Entries without the flag are unchanged.
        assert_eq!(&m.encode()[24..28], &[0; 4]);
        let mut bad = b;
        bad[25] ^= 1;
        assert!(BlockMeta::decode(&bad).is_err());
        let h = WalHeader {
            kind: WalKind::ExtWrite,
            wal_gen: 4,
            layer: 1,
            tag: Tag::new(1, 2),
            lba: 16,
            nblocks: 16,
        };
        let sums: Vec<u32> = (0..16).collect();
        let hb = h.encode_extent(12345, &sums);
        assert_eq!(WalHeader::decode(&hb), Some(h));
        assert_eq!(WalHeader::extent_block(&hb), 12345);
        assert_eq!(h.data_len(), 0);
        assert!(WalHeader::check_sums(&hb, &sums));
        let mut other = sums.clone();
        other[3] ^= 1;
        assert!(!WalHeader::check_sums(&hb, &other));
    }

    #[test]
    fn wal_sums_flag_roundtrips_and_older_versions_refuse_it() {
        let s = Superblock {
            wal_sums: true,
            ..sb()
        };
        // (Versions before `two_wal` refused it as invalid.)
        let old_known = SB_OPEN | SB_RECOVERED | SB_CHECKSUM | SB_TWO_WAL;
        let f = check_new_flag(&s, SB_WAL_SUMS, old_known);
        // Without it, the encoding is unchanged (also for SHA-256 stores).
        let b0 = Superblock {
            wal_sums: false,
            checksum: BlockChecksum::Sha256,
            ..s
        }
        .encode()
        .unwrap();
        assert_eq!(b0[f], SB_OPEN | SB_RECOVERED);
    }

    #[test]
    fn two_wal_flag_roundtrips_and_older_versions_refuse_it() {
        let s = Superblock {
            two_wal: true,
            ..sb()
        };
        let f = check_new_flag(&s, SB_TWO_WAL, SB_OPEN | SB_RECOVERED | SB_CHECKSUM);
        // Without it, the encoding is unchanged.
        let b0 = Superblock {
            two_wal: false,
            ..s
        }
        .encode()
        .unwrap();
        assert_eq!(b0[f], SB_OPEN | SB_RECOVERED | SB_CHECKSUM);
    }

    #[test]
    fn superblock_roundtrip_and_corruption() {
        for checksum in [BlockChecksum::Sha256, BlockChecksum::Xxh3] {
            let s = Superblock { checksum, ..sb() };
            let mut b = s.encode().unwrap();
            assert_eq!(Superblock::decode(&b), Ok(s));
            b[100] ^= 1;
            assert_eq!(Superblock::decode(&b), Err(SbError::Invalid));
        }
    }

    /// Offset of the flags byte of `sb()` in a slot.
    fn flags_at(s: &Superblock) -> usize {
        let names: usize = s.layers.iter().map(|l| 25 + l.name.len()).sum();
        12 + 8 * 4 + 1 + 8 * 3 + 1 + names + 8
    }

    fn reseal(b: &mut [u8]) {
        let crc = crc32c::crc32c(&b[12..]);
        b[8..12].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn sha256_superblock_is_encoded_as_before_the_checksum_field() {
        let s = Superblock {
            checksum: BlockChecksum::Sha256,
            ..sb()
        };
        let b = s.encode().unwrap();
        let f = flags_at(&s);
        assert_eq!(b[f], SB_OPEN | SB_RECOVERED);
        assert!(b[f + 1..].iter().all(|&x| x == 0));
        let x = Superblock {
            checksum: BlockChecksum::Xxh3,
            ..sb()
        }
        .encode()
        .unwrap();
        assert_eq!(x[f], SB_OPEN | SB_RECOVERED | SB_CHECKSUM);
        assert_eq!(x[f + 1], BlockChecksum::Xxh3.code());
    }

    #[test]
    fn unknown_checksum_or_flags_are_errors_that_name_them() {
        let s = sb();
        let f = flags_at(&s);
        let mut b = s.encode().unwrap();
        b[f + 1] = 9;
        reseal(&mut b);
        let e = Superblock::decode(&b).unwrap_err();
        assert_eq!(
            e,
            SbError::UnknownChecksum {
                generation: 7,
                code: 9
            }
        );
        assert!(e.to_string().contains("algorithm 9"), "{e}");
        let mut b = s.encode().unwrap();
        b[f] |= 0x40;
        reseal(&mut b);
        let e = Superblock::decode(&b).unwrap_err();
        assert_eq!(
            e,
            SbError::UnknownFlags {
                generation: 7,
                flags: 0x40
            }
        );
        assert_eq!(e.generation(), Some(7));
        assert!(e.to_string().contains("0x40"), "{e}");
    }

    #[test]
    fn meta_roundtrip_and_corruption() {
        let m = BlockMeta {
            tag: Tag::new(1, 2),
            crc: 77,
            flags: META_PRESENT,
        };
        let mut b = m.encode();
        assert_eq!(BlockMeta::decode(&b), Ok(Some(m)));
        b[3] ^= 0x10;
        assert_eq!(BlockMeta::decode(&b), Err(()));
        assert_eq!(BlockMeta::decode(&[0u8; META_SIZE]), Ok(None));
        assert_eq!(BlockMeta::decode(&[0xffu8; META_SIZE]), Err(()));
    }

    #[test]
    fn damaged_meta_keeps_its_tag_and_reads_as_damaged_under_the_old_rule() {
        let m = BlockMeta {
            tag: Tag::new(1, 6),
            crc: 77,
            flags: META_PRESENT | META_DAMAGED,
        };
        let b = m.encode();
        let d = BlockMeta::decode(&b).unwrap().unwrap();
        assert_eq!(d, m);
        assert!(d.is_damaged());
        // A store version without META_DAMAGED checks the plain CRC: the
        // seal makes it see an unreadable (damaged) entry, never a block.
        assert_ne!(
            u32::from_le_bytes(b[28..32].try_into().unwrap()),
            crc32c::crc32c(&b[..28])
        );
        // The flag without the seal (or the seal without the flag) is damage.
        let mut plain = b;
        plain[28..32].copy_from_slice(&crc32c::crc32c(&b[..28]).to_le_bytes());
        assert_eq!(BlockMeta::decode(&plain), Err(()));
        let ok = BlockMeta {
            flags: META_PRESENT,
            ..m
        }
        .encode();
        let mut resealed = ok;
        let c = u32::from_le_bytes(ok[28..32].try_into().unwrap()) ^ META_DAMAGED_SEAL;
        resealed[28..32].copy_from_slice(&c.to_le_bytes());
        assert_eq!(BlockMeta::decode(&resealed), Err(()));
        // Unknown flags are damage.
        let odd = BlockMeta {
            flags: META_PRESENT | 0x100,
            ..m
        }
        .encode();
        assert_eq!(BlockMeta::decode(&odd), Err(()));
    }

    #[test]
    fn wal_header_roundtrip() {
        let h = WalHeader {
            kind: WalKind::Write,
            wal_gen: 1,
            layer: 2,
            tag: Tag::new(3, 4),
            lba: 5,
            nblocks: 1,
        };
        let data = vec![9u8; 4096];
        let b = h.encode(&data);
        assert_eq!(WalHeader::decode(&b), Some(h));
        assert!(WalHeader::check(&b, &data));
        assert!(!WalHeader::check(&b, &[0u8; 4096]));
    }

    #[test]
    fn wal_header_over_block_checksums() {
        let h = WalHeader {
            kind: WalKind::Write,
            wal_gen: 1,
            layer: 2,
            tag: Tag::new(3, 4),
            lba: 5,
            nblocks: 100,
        };
        let sums: Vec<u32> = (0..100u32).map(|i| i.wrapping_mul(0x9e37_79b9)).collect();
        let b = h.encode_sums(&sums);
        assert_eq!(WalHeader::decode(&b), Some(h));
        assert!(WalHeader::check_sums(&b, &sums));
        // Any changed checksum, a missing one, or a changed header fails.
        for i in [0, 63, 64, 99] {
            let mut bad = sums.clone();
            bad[i] ^= 1 << (i % 32);
            assert!(!WalHeader::check_sums(&b, &bad), "{i}");
        }
        assert!(!WalHeader::check_sums(&b, &sums[..99]));
        let mut hb = b;
        hb[40] ^= 1;
        assert!(!WalHeader::check_sums(&hb, &sums));
        // The same as one CRC over the header and the LE checksums.
        let bytes: Vec<u8> = sums.iter().flat_map(|s| s.to_le_bytes()).collect();
        assert!(WalHeader::check(&b, &bytes));
        // A record without data: the CRC covers the header alone, as before.
        let z = WalHeader {
            kind: WalKind::Zero,
            ..h
        };
        assert_eq!(z.encode_sums(&[]), z.encode(&[]));
    }
}
