// SPDX-License-Identifier: Apache-2.0
//! Flush, checkpoint, superblock writes and rebuild setup.

use super::*;

impl Store {
    /// Makes every applied write durable (syncs the WAL); checkpoints when
    /// the WAL has grown large.
    pub fn flush(&mut self) -> Result<()> {
        self.reap()?;
        // Sealed first: the next WAL's records only count after it.
        self.sync_sealed()?;
        // Extent data before the records that point into it.
        self.sync_exts()?;
        self.wals[self.cur]
            .sync()
            .map_err(Error::store("sync wal"))?;
        if self.wal_len + self.ext_bytes > self.checkpoint_bytes {
            // Waits for a job still in flight (backpressure).
            self.seal()?;
            if let Some(s) = self.sealed.as_mut() {
                s.synced = true;
            }
        }
        Ok(())
    }

    /// Sets the WAL size that triggers a checkpoint on flush (tests use small
    /// values to exercise checkpoints). The hard WAL bound, checkpointed in
    /// the write path, is [`WAL_LIMIT_FACTOR`] times this.
    pub fn set_checkpoint_bytes(&mut self, bytes: u64) {
        self.checkpoint_bytes = bytes;
    }

    /// WAL size an append may not exceed without checkpointing first (a
    /// single record larger than it is still appended to an empty WAL).
    pub(super) fn wal_limit(&self) -> u64 {
        self.checkpoint_bytes.saturating_mul(WAL_LIMIT_FACTOR)
    }

    /// Live length of the current WAL file in bytes (tests; the file
    /// itself may be longer, see [`WAL_NAMES`]).
    pub fn wal_bytes(&self) -> u64 {
        self.wal_len
    }

    /// Copies WAL-resident blocks into the layer files, syncs them, and starts
    /// a new WAL generation (finishing a sealed WAL's checkpoint first).
    pub fn checkpoint(&mut self) -> Result<()> {
        self.checkpoint_as(true)
    }

    /// [`Store::checkpoint`], with later records checksummed over the block
    /// checksums (`wal_sums`) or over the data (the format before it).
    pub(super) fn checkpoint_as(&mut self, wal_sums: bool) -> Result<()> {
        self.settle_all()?;
        let dirty = std::mem::take(&mut self.dirty);
        let job = self.build_job(&dirty, vec![0, 1], true);
        if let Err(e) = job.run() {
            self.dirty = dirty;
            return Err(Error::store("checkpoint")(e));
        }
        let before = (
            self.sb.position,
            self.sb.wal_gen,
            self.sb.two_wal,
            self.sb.wal_sums,
        );
        self.sb.position = self.position;
        // An unpredictable step (see `gen_step`); the seals until the next
        // checkpoint add 1 each.
        self.sb.wal_gen = self.wgen.saturating_add(gen_step(&*self.dir));
        // Both files are emptied below and the new generation is in `wal`:
        // older versions may open the store again.
        self.sb.two_wal = false;
        // The record format may change only here, where the generation
        // does: every record of one generation has the same format, and
        // the flag is durable before the first record that needs it.
        self.sb.wal_sums = wal_sums;
        if let Err(e) = self.write_sb() {
            (
                self.sb.position,
                self.sb.wal_gen,
                self.sb.two_wal,
                self.sb.wal_sums,
            ) = before;
            self.dirty = dirty;
            return Err(e);
        }
        self.point_to_layers(&dirty, None);
        self.release_ext();
        // Off the write path: give back what this checkpoint freed now.
        self.reclaim_ext_now();
        self.cur = 0;
        self.wgen = self.sb.wal_gen;
        self.wal_len = 0;
        self.ext_bytes = 0;
        self.wal_unordered = false;
        // Unlike a seal's checkpoint, this one (open, clean close, snapshot
        // operations, rebuild: rare) shrinks both files to nothing, so a
        // cleanly closed store has empty WALs. Not needed for safety: if a
        // truncate fails or is lost at a power loss, the files hold older
        // generations only, as after a seal's checkpoint.
        for w in &self.wals {
            w.set_len(0).map_err(Error::store("truncate wal"))?;
        }
        Ok(())
    }

    /// The I/O that moves the changes of `dirty` (as the index has them
    /// now) into the layer files, after syncing WAL files `sync_wals`.
    /// Contiguous blocks are copied and their metadata written in runs.
    /// After a checkpoint of `dirty`: index entries still in a WAL (`file`,
    /// or either) now read from their layer files.
    pub(super) fn point_to_layers(&mut self, dirty: &DirtySet, file: Option<usize>) {
        for (layer, lba) in dirty.iter() {
            if let Some(li) = self.layer_index(layer)
                && let Some(e) = self.layers[li].blocks.get_mut(lba)
                && matches!(e.loc, Loc::Wal(f, _) if file.is_none_or(|w| w == usize::from(f)))
            {
                e.loc = Loc::Layer;
            }
        }
    }

    ///
    /// Hole punches in the data files (`punches`, run after the metadata
    /// sync): a block trimmed (zero or absent) or moved to the extent file
    /// leaves an older copy in its layer's data file. Once this job's
    /// metadata entry for it is durable, no durable entry refers to that
    /// copy, and WAL records never do (they carry their data or point into
    /// an extent file). A later job (the only other writer of data files
    /// while the store runs) copies a newer write of the block after this
    /// punch.
    pub(super) fn build_job(
        &self,
        dirty: &DirtySet,
        sync_wals: Vec<usize>,
        punch_now: bool,
    ) -> CheckpointJob {
        let mut ops = Vec::new();
        let mut punches = Vec::new();
        // Layer index, first block and blocks of the data-file punch run.
        let mut punch_run: (usize, u64, u64) = (0, 0, 0);
        let flush_punch = |run: &(usize, u64, u64), punches: &mut Vec<JobOp>| {
            if run.2 > 0 {
                punches.push(JobOp::Punch {
                    li: run.0,
                    off: run.1 * BLOCK_SIZE_U64,
                    len: run.2 * BLOCK_SIZE_U64,
                });
            }
        };
        let mut touched = BTreeSet::new();
        let mut data_run = CopyRun::default();
        let mut meta_run = MetaRun::default();
        let flush_copy = |run: &CopyRun, ops: &mut Vec<JobOp>| {
            if run.blocks > 0 {
                ops.push(JobOp::Copy {
                    src: run.file,
                    li: run.li,
                    src_off: run.wal_off,
                    dst_off: run.lba * BLOCK_SIZE_U64,
                    len: run.blocks as usize * BLOCK_SIZE,
                });
            }
        };
        let flush_meta = |run: &mut MetaRun, ops: &mut Vec<JobOp>| {
            if !run.bytes.is_empty() {
                ops.push(JobOp::Meta {
                    li: run.li,
                    off: run.lba * META_SIZE as u64,
                    bytes: std::mem::take(&mut run.bytes),
                });
            }
        };
        for (layer, lba) in dirty.iter() {
            let Some(li) = self.layer_index(layer) else {
                continue;
            };
            touched.insert(li);
            let entry = self.layers[li].blocks.get(lba);
            let punch = match entry {
                None
                | Some(Entry {
                    loc: Loc::Ext(_), ..
                }) => true,
                Some(e) => e.meta.is_zero(),
            };
            if punch {
                if punch_run.2 > 0 && punch_run.0 == li && punch_run.1 + punch_run.2 == lba {
                    punch_run.2 += 1;
                } else {
                    flush_punch(&punch_run, &mut punches);
                    punch_run = (li, lba, 1);
                }
            }
            let meta_bytes = match entry {
                None => [0u8; META_SIZE],
                Some(&Entry {
                    meta,
                    loc: Loc::Ext(x),
                }) => meta.encode_extent(x),
                Some(e) => {
                    if !e.meta.is_zero()
                        && let Loc::Wal(f, off) = e.loc
                        && !data_run.extends(usize::from(f), li, lba, off)
                    {
                        flush_copy(&data_run, &mut ops);
                        data_run = CopyRun {
                            file: usize::from(f),
                            li,
                            lba,
                            wal_off: off,
                            blocks: 1,
                        };
                    }
                    e.meta.encode()
                }
            };
            if !meta_run.extends(li, lba) {
                flush_meta(&mut meta_run, &mut ops);
                meta_run.li = li;
                meta_run.lba = lba;
            }
            meta_run.bytes.extend_from_slice(&meta_bytes);
        }
        flush_copy(&data_run, &mut ops);
        flush_meta(&mut meta_run, &mut ops);
        flush_punch(&punch_run, &mut punches);
        CheckpointJob {
            wals: self.wals.clone(),
            sync_wals,
            exts: touched
                .iter()
                .filter_map(|&li| self.layers[li].ext.clone())
                .collect(),
            layers: self
                .layers
                .iter()
                .map(|l| (l.data.clone(), l.meta.clone()))
                .collect(),
            touched,
            ops,
            punches,
            punch_now,
        }
    }

    pub(super) fn write_sb(&mut self) -> Result<()> {
        self.sb.generation += 1;
        let buf = self
            .sb
            .encode()
            .ok_or_else(|| Error::InvalidArgument("superblock does not fit".into()))?;
        let slot = self.sb.generation % 2;
        self.sb_file
            .write_at(&buf, slot * SB_SLOT as u64)
            .map_err(Error::store("write superblock"))?;
        self.sb_file
            .sync()
            .map_err(Error::store("write superblock"))?;
        Ok(())
    }

    /// Starts a rebuild: makes the layer chain match `layers` (keeping local
    /// layers with the same ids, whose blocks the rebuild then compares),
    /// sets the size and position, and persists the `Rebuilding` state.
    pub fn begin_rebuild(
        &mut self,
        layers: &[LayerInfo],
        size_blocks: u64,
        start: Tag,
    ) -> Result<()> {
        if layers.is_empty() || layers.len() > MAX_LAYERS {
            return Err(Error::InvalidArgument("bad layer list".into()));
        }
        self.checkpoint()?;
        self.merge_dropped_layers(layers)?;
        // Its appends may have sealed a WAL: finish that job (and the
        // punches it starts) before layers are replaced or removed.
        self.settle_all()?;
        let mut old: Vec<Layer> = std::mem::take(&mut self.layers);
        let mut new = Vec::new();
        for info in layers {
            if info.name.len() > MAX_NAME_LEN {
                return Err(Error::InvalidArgument("snapshot name too long".into()));
            }
            if let Some(pos) = old.iter().position(|l| l.info.id == info.id) {
                let mut l = old.remove(pos);
                l.info = info.clone();
                new.push(l);
            } else {
                new.push(Self::open_layer(&*self.dir, info.clone(), true)?);
            }
        }
        self.dir.sync_dir().map_err(Error::store("begin rebuild"))?;
        self.layers = new;
        self.sb.layers = layers.to_vec();
        self.sb.state = ReplicaState::Rebuilding;
        self.sb.recovered = false;
        if size_blocks > self.sb.size_blocks {
            self.grow(size_blocks)?;
        }
        self.sb.size_blocks = size_blocks;
        self.layers
            .iter_mut()
            .for_each(|l| l.blocks.truncate(size_blocks));
        self.position = start;
        self.sb.position = start;
        self.write_sb()?;
        for l in old {
            self.remove_layer_files(l)?;
        }
        Ok(())
    }

    /// Before a rebuild adopts `layers`: a local layer the new chain lacks
    /// but that sits below a layer it keeps is a snapshot deleted while
    /// this replica was away. Its good copies the kept layer lacks are
    /// merged into it, as DeleteSnapshot would have done, so a good copy of
    /// a write that is bad on every other replica survives the rebuild
    /// (its tag comparison corrects everything else; bad copies are left
    /// to it). Layers above every kept one (dropped by a revert) are not
    /// merged.
    pub(super) fn merge_dropped_layers(&mut self, layers: &[LayerInfo]) -> Result<()> {
        let keep = |id: u64| layers.iter().any(|l| l.id == id);
        let mut buf = vec![0u8; BLOCK_SIZE];
        for i in (0..self.layers.len()).rev() {
            if keep(self.layers[i].info.id) {
                continue;
            }
            let Some(k) = (i + 1..self.layers.len()).find(|&k| keep(self.layers[k].info.id)) else {
                continue;
            };
            let kid = self.layers[k].info.id;
            let mut moved: Vec<u64> = self.layers[i]
                .blocks
                .keys()
                .filter(|b| !self.layers[k].blocks.contains_key(*b))
                .collect();
            moved.sort_unstable();
            for b in moved {
                let Some(e) = self.layers[i].blocks.get(b).copied() else {
                    continue;
                };
                if !self.read_entry(i, b, &e, &mut buf) {
                    continue;
                }
                let what = if e.meta.is_zero() {
                    SetBlock::Zero(e.meta.tag)
                } else {
                    SetBlock::Data(e.meta.tag, &buf)
                };
                let (kind, tag, data) = match what {
                    SetBlock::Data(t, d) => (WalKind::SetData, t, d),
                    SetBlock::Zero(t) => (WalKind::SetZero, t, &[][..]),
                    SetBlock::Absent => continue,
                };
                let h = WalHeader {
                    kind,
                    wal_gen: self.wgen,
                    layer: kid,
                    tag,
                    lba: b,
                    nblocks: 1,
                };
                let data = data.to_vec();
                self.append(h, &data)?;
            }
        }
        Ok(())
    }

    /// Writes the completion marker: syncs everything, then persists `Clean`
    /// at the given position (the engine checks it equals the live position).
    pub fn mark_clean(&mut self) -> Result<()> {
        self.checkpoint()?;
        self.sb.state = ReplicaState::Clean;
        self.sb.recovered = false;
        self.write_sb()
    }

    /// Persists the `Rebuilding` state without other changes.
    pub fn mark_rebuilding(&mut self) -> Result<()> {
        self.settle()?;
        self.sb.state = ReplicaState::Rebuilding;
        self.write_sb()
    }

    pub(super) fn grow(&mut self, size_blocks: u64) -> Result<()> {
        for l in &mut self.layers {
            l.data
                .set_len(size_blocks * BLOCK_SIZE_U64)
                .map_err(Error::store("resize"))?;
        }
        Ok(())
    }
}
