// SPDX-License-Identifier: Apache-2.0
//! Replica state, ordered writes, block reads.

use super::*;

impl Store {
    /// What the replica reports about itself.
    pub fn info(&self) -> ReplicaInfo {
        ReplicaInfo {
            epoch: self.sb.epoch,
            engine: self.sb.engine,
            state: self.sb.state,
            position: self.position,
            size_blocks: self.sb.size_blocks,
            layers: self.sb.layers.clone(),
            recovered: self.sb.recovered && self.sb.state == ReplicaState::Clean,
        }
    }

    /// The store's per-block checksum algorithm.
    pub fn checksum(&self) -> BlockChecksum {
        self.sb.checksum
    }

    /// Live position: tag of the last ordered operation applied.
    pub fn position(&self) -> Tag {
        self.position
    }

    /// Volume size in blocks.
    pub fn size_blocks(&self) -> u64 {
        self.sb.size_blocks
    }

    /// Persists a new epoch and its engine (synced before returning).
    /// The replica is open for writes from then on (see [`Store::close`]).
    pub fn set_epoch(&mut self, epoch: u64, engine: u64) -> Result<()> {
        self.settle_for_attach()?;
        self.sb.epoch = epoch;
        self.sb.engine = engine;
        self.sb.open = true;
        self.write_sb()
    }

    /// Before an attach: finishes a sealed WAL's checkpoint and, if a clean
    /// [`Store::close`] left the store in the old WAL record format,
    /// checkpoints to move to the new one (the format only changes with
    /// the WAL generation, see [`Store::checkpoint`]).
    pub(super) fn settle_for_attach(&mut self) -> Result<()> {
        if self.sb.wal_sums {
            self.settle()
        } else {
            self.checkpoint()
        }
    }

    /// Persists that an engine is attached (writes may follow that are not
    /// synced before they are acknowledged).
    pub fn mark_open(&mut self) -> Result<()> {
        if self.sb.open {
            return Ok(());
        }
        self.settle_for_attach()?;
        self.sb.open = true;
        self.write_sb()
    }

    /// Whether the superblock records an attached engine: true from an
    /// attach until a clean [`Store::close`] (an engine's detach), so a
    /// store opened with it false was shut down cleanly.
    pub fn is_marked_open(&self) -> bool {
        self.sb.open
    }

    /// Clean detach: checkpoints and records that nothing acknowledged is
    /// unsynced, so a later power loss does not mark the replica recovered.
    pub fn close(&mut self) -> Result<()> {
        // Both WALs end up empty: the store may go back to old-style
        // records, so versions before `wal_sums` open it again.
        self.checkpoint_as(false)?;
        self.sb.open = false;
        self.write_sb()
    }

    /// Whether the replica may lack writes it acknowledged before a power
    /// loss (see [`ReplicaInfo::recovered`]).
    pub fn recovered(&self) -> bool {
        self.sb.recovered && self.sb.state == ReplicaState::Clean
    }

    /// An engine adopted this replica's content as in sync: clears the
    /// recovered mark.
    pub fn adopt(&mut self) -> Result<()> {
        if !self.sb.recovered {
            return Ok(());
        }
        self.settle()?;
        self.sb.recovered = false;
        self.write_sb()
    }

    /// Applies an ordered write (`data` = `None` writes zeros) at `tag`.
    /// The caller checks that `tag` follows the position.
    pub fn write(&mut self, tag: Tag, lba: u64, nblocks: u32, data: Option<&[u8]>) -> Result<()> {
        self.check_range(lba, nblocks as u64)?;
        let (kind, payload) = match data {
            Some(d) => {
                if d.len() != nblocks as usize * BLOCK_SIZE {
                    return Err(Error::InvalidArgument("data length mismatch".into()));
                }
                (WalKind::Write, d)
            }
            None => (WalKind::Zero, &[][..]),
        };
        let h = WalHeader {
            kind,
            wal_gen: self.wgen,
            layer: self.head_id(),
            tag,
            lba,
            nblocks,
        };
        if kind == WalKind::Write && nblocks >= self.extent_min_blocks && self.sb.wal_sums {
            return self.append_extent(h, payload);
        }
        self.append(h, payload)
    }

    /// Sets one block of a layer (rebuild copy or repair). Does not move the
    /// position.
    pub fn set_block(&mut self, layer: u64, lba: u64, what: SetBlock<'_>) -> Result<()> {
        self.check_range(lba, 1)?;
        if self.layer_index(layer).is_none() {
            return Err(Error::InvalidArgument(format!("no layer {layer}")));
        }
        let (kind, tag, data) = match what {
            SetBlock::Data(tag, d) => {
                if d.len() != BLOCK_SIZE {
                    return Err(Error::InvalidArgument("data length mismatch".into()));
                }
                (WalKind::SetData, tag, d)
            }
            SetBlock::Zero(tag) => (WalKind::SetZero, tag, &[][..]),
            SetBlock::Absent => (WalKind::SetAbsent, Tag::default(), &[][..]),
        };
        let h = WalHeader {
            kind,
            wal_gen: self.wgen,
            layer,
            tag,
            lba,
            nblocks: 1,
        };
        self.append(h, data)
    }

    /// Sets `data.len() / 4096` consecutive blocks of a layer, all copies of
    /// the write `tag`, as one WAL record (rebuild copy of a run of blocks
    /// one write left). Same effect as [`Store::set_block`] per block; one
    /// header, one WAL write and one contiguous checkpoint copy for the run.
    pub fn set_blocks_data(&mut self, layer: u64, lba: u64, tag: Tag, data: &[u8]) -> Result<()> {
        let n = data.len() / BLOCK_SIZE;
        if n == 0 || !data.len().is_multiple_of(BLOCK_SIZE) || n > crate::proto::msg::MAX_IO_BLOCKS
        {
            return Err(Error::InvalidArgument("data length mismatch".into()));
        }
        self.check_range(lba, n as u64)?;
        if self.layer_index(layer).is_none() {
            return Err(Error::InvalidArgument(format!("no layer {layer}")));
        }
        let h = WalHeader {
            kind: WalKind::SetData,
            wal_gen: self.wgen,
            layer,
            tag,
            lba,
            nblocks: n as u32,
        };
        self.append(h, data)
    }

    /// Records the copy of `lba` in `layer` as a known bad copy of the write
    /// `tag` (rebuild of a block that has no good copy anywhere): reads of
    /// it fail, its tag is kept so a copy of the same write can repair it.
    /// Rare, so it checkpoints first and writes the sealed metadata entry
    /// directly (no WAL record kind a store version without
    /// [`META_DAMAGED`] would stop at).
    pub fn mark_damaged(&mut self, layer: u64, lba: u64, tag: Tag) -> Result<()> {
        self.check_range(lba, 1)?;
        let li = self
            .layer_index(layer)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
        self.checkpoint()?;
        let meta = BlockMeta {
            tag,
            crc: 0,
            flags: META_PRESENT | META_DAMAGED,
        };
        let l = &mut self.layers[li];
        l.meta
            .write_at(&meta.encode(), lba * META_SIZE as u64)
            .map_err(Error::store("mark damaged"))?;
        l.meta.sync().map_err(Error::store("mark damaged"))?;
        l.blocks.insert(
            lba,
            Entry {
                meta,
                loc: Loc::Damaged,
            },
        );
        Ok(())
    }

    /// A block's entry in a layer: `(tag, zero, valid)`; `valid` means its
    /// data was read back and its checksum verified.
    pub fn entry(&self, layer: u64, lba: u64) -> Option<(Tag, bool, bool)> {
        let li = self.layer_index(layer)?;
        let e = self.layers[li].blocks.get(lba)?;
        let mut buf = vec![0u8; BLOCK_SIZE];
        let valid = self.read_entry(li, lba, e, &mut buf);
        Some((e.meta.tag, e.meta.is_zero(), valid))
    }

    pub(super) fn read_entry(&self, li: usize, lba: u64, e: &Entry, out: &mut [u8]) -> bool {
        if e.meta.is_zero() {
            out.fill(0);
            return !matches!(e.loc, Loc::Damaged);
        }
        let res = match e.loc {
            Loc::Damaged => return false,
            Loc::Layer => self.layers[li].data.read_at(out, lba * BLOCK_SIZE_U64),
            Loc::Wal(f, off) => self.wals[usize::from(f)].read_at(out, off),
            Loc::Ext(x) => match &self.layers[li].ext {
                Some(f) => f.read_at(out, u64::from(x) * BLOCK_SIZE_U64),
                None => return false,
            },
        };
        res.is_ok() && self.sb.checksum.block(lba, out) == e.meta.crc
    }

    /// Reads `nblocks` blocks at `lba` through the layer chain into `out`.
    /// Returns the blocks that failed verification as `(lba, layer)`; their
    /// bytes in `out` are zeroed. A corrupt copy is never returned as data.
    pub fn read(&self, lba: u64, nblocks: u32, out: &mut [u8]) -> Result<Vec<(u64, u64)>> {
        self.read_below(self.layers.len(), lba, nblocks, out)
    }

    /// Reads `nblocks` blocks at `lba` as snapshot `layer` saw them: through
    /// the chain from that layer down, ignoring the layers above it. Bad
    /// blocks are reported and zeroed as in [`Store::read`].
    pub fn read_snapshot(
        &self,
        layer: u64,
        lba: u64,
        nblocks: u32,
        out: &mut [u8],
    ) -> Result<Vec<(u64, u64)>> {
        let li = self
            .layer_index(layer)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
        self.read_below(li + 1, lba, nblocks, out)
    }

    /// The blocks layer `layer` holds an entry for (data, zero or damaged),
    /// ascending: what was written while it was the head. `None` if there
    /// is no such layer.
    pub fn layer_blocks(&self, layer: u64) -> Option<Vec<u64>> {
        let li = self.layer_index(layer)?;
        let mut v: Vec<u64> = self.layers[li].blocks.keys().collect();
        v.sort_unstable();
        Some(v)
    }

    /// [`Store::read`] through the lowest `top` layers.
    fn read_below(
        &self,
        top: usize,
        lba: u64,
        nblocks: u32,
        out: &mut [u8],
    ) -> Result<Vec<(u64, u64)>> {
        self.check_range(lba, nblocks as u64)?;
        if out.len() != nblocks as usize * BLOCK_SIZE {
            return Err(Error::InvalidArgument("buffer length mismatch".into()));
        }
        let mut bad = Vec::new();
        // Blocks stored contiguously in one file (a layer's data file or the
        // WAL) are read with one call, then verified block by block.
        let mut run: Option<ReadRun> = None;
        for i in 0..nblocks as usize {
            let b = lba + i as u64;
            let mut found = false;
            for li in (0..top).rev() {
                if let Some(e) = self.layers[li].blocks.get(b) {
                    found = true;
                    let file = match e.loc {
                        _ if e.meta.is_zero() => None,
                        Loc::Layer => Some((li, Src::Layer, b * BLOCK_SIZE_U64)),
                        Loc::Wal(f, off) => Some((li, Src::Wal(usize::from(f)), off)),
                        Loc::Ext(x) if self.layers[li].ext.is_some() => {
                            Some((li, Src::Ext, u64::from(x) * BLOCK_SIZE_U64))
                        }
                        Loc::Ext(_) | Loc::Damaged => None,
                    };
                    match file {
                        Some((li, src, off)) => {
                            if let Some(r) = run.as_mut()
                                && r.li == li
                                && r.src == src
                                && r.blocks.last().is_some_and(|&(j, _)| j + 1 == i)
                                && r.off + (r.blocks.len() * BLOCK_SIZE) as u64 == off
                                && r.blocks.len() < MAX_RUN as usize
                            {
                                r.blocks.push((i, e.meta.crc));
                            } else {
                                if let Some(r) = run.take() {
                                    self.read_run(lba, &r, out, &mut bad);
                                }
                                run = Some(ReadRun {
                                    li,
                                    src,
                                    off,
                                    blocks: vec![(i, e.meta.crc)],
                                });
                            }
                        }
                        None => {
                            let buf = &mut out[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
                            if !self.read_entry(li, b, e, buf) {
                                buf.fill(0);
                                bad.push((b, self.layers[li].info.id));
                            }
                        }
                    }
                    break;
                }
            }
            if !found {
                out[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].fill(0);
            }
        }
        if let Some(r) = run.take() {
            self.read_run(lba, &r, out, &mut bad);
        }
        bad.sort_unstable();
        Ok(bad)
    }

    /// Reads a run of blocks found contiguous in one file into their places
    /// in `out` (`out` starts at block `lba`) and verifies each; a failed
    /// run read falls back to block reads so only unreadable blocks are bad.
    pub(super) fn read_run(
        &self,
        lba: u64,
        run: &ReadRun,
        out: &mut [u8],
        bad: &mut Vec<(u64, u64)>,
    ) {
        let file: &dyn StoreFile = match run.src {
            Src::Wal(f) => &*self.wals[f],
            Src::Layer => &*self.layers[run.li].data,
            Src::Ext => match &self.layers[run.li].ext {
                Some(f) => &**f,
                None => &*self.layers[run.li].data,
            },
        };
        let layer_id = self.layers[run.li].info.id;
        let (first, _) = run.blocks[0];
        let span = &mut out[first * BLOCK_SIZE..(first + run.blocks.len()) * BLOCK_SIZE];
        let whole = file.read_at(span, run.off).is_ok();
        for (k, &(i, crc)) in run.blocks.iter().enumerate() {
            let b = lba + i as u64;
            let buf = &mut out[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE];
            let ok = (whole || file.read_at(buf, run.off + (k * BLOCK_SIZE) as u64).is_ok())
                && self.sb.checksum.block(b, buf) == crc;
            if !ok {
                buf.fill(0);
                bad.push((b, layer_id));
            }
        }
    }

    /// Reads one layer's copy of `nblocks` blocks (for rebuild, scrub and
    /// repair): per block its tag state and, for valid data blocks, the data.
    pub fn read_layer(
        &self,
        layer: u64,
        lba: u64,
        nblocks: u32,
        with_data: bool,
    ) -> Result<Vec<(BlockTag, Option<Vec<u8>>)>> {
        self.check_range(lba, nblocks as u64)?;
        let li = self
            .layer_index(layer)
            .ok_or_else(|| Error::InvalidArgument(format!("no layer {layer}")))?;
        let mut out = Vec::with_capacity(nblocks as usize);
        for i in 0..nblocks as u64 {
            let b = lba + i;
            match self.layers[li].blocks.get(b) {
                None => out.push((BlockTag::Absent, None)),
                Some(e) => {
                    let mut buf = vec![0u8; BLOCK_SIZE];
                    let valid = self.read_entry(li, b, e, &mut buf);
                    let zero = e.meta.is_zero();
                    let tag = BlockTag::Present {
                        tag: e.meta.tag,
                        zero,
                        valid,
                    };
                    let data = (with_data && valid && !zero).then_some(buf);
                    out.push((tag, data));
                }
            }
        }
        Ok(out)
    }
}
