// SPDX-License-Identifier: Apache-2.0
//! WAL replay, appends, seals and the background checkpoint jobs.

use super::*;

impl Store {
    /// Replays the valid prefix of generation `gen` records at the start of
    /// WAL file `f`; returns how many records it applied.
    pub(super) fn replay_file(&mut self, f: usize, wgen: u64) -> u64 {
        let wal = self.wals[f].clone();
        let Ok(len) = wal.len() else {
            return 0;
        };
        let mut off = 0u64;
        let mut hdr = [0u8; WAL_HDR];
        let mut replayed = 0u64;
        while off + WAL_HDR as u64 <= len {
            if wal.read_at(&mut hdr, off).is_err() {
                break;
            }
            let Some(h) = WalHeader::decode(&hdr) else {
                break;
            };
            if h.wal_gen != wgen {
                break;
            }
            let mut data = vec![0u8; h.data_len()];
            if wal.read_at(&mut data, off + WAL_HDR as u64).is_err() {
                break;
            }
            let ext_blk = WalHeader::extent_block(&hdr);
            let sums = if h.kind == WalKind::ExtWrite {
                // The data is in the extent file; torn or missing extent
                // data fails the record CRC like a torn WAL record.
                let ext = self
                    .layer_index(h.layer)
                    .and_then(|li| self.layers[li].ext.clone());
                let Some(ext) = ext.filter(|_| self.sb.wal_sums && self.sb.extents) else {
                    break;
                };
                let mut edata = vec![0u8; h.nblocks as usize * BLOCK_SIZE];
                if ext.read_at(&mut edata, ext_blk * BLOCK_SIZE_U64).is_err() {
                    break;
                }
                edata
                    .chunks_exact(BLOCK_SIZE)
                    .zip(h.lba..)
                    .map(|(b, lba)| self.sb.checksum.block(lba, b))
                    .collect()
            } else {
                // Recomputed from the data read: a torn or damaged record
                // fails the record CRC also when it covers only these.
                self.block_sums(&h, &data)
            };
            let ok = if self.sb.wal_sums {
                WalHeader::check_sums(&hdr, &sums)
            } else {
                WalHeader::check(&hdr, &data)
            };
            if !ok {
                break;
            }
            if h.kind.ordered() && h.tag.index != self.position.index + 1 {
                break;
            }
            if self.apply_record(&h, &sums, f, off, ext_blk).is_err() {
                break;
            }
            off += (WAL_HDR + data.len()) as u64;
            replayed += 1;
        }
        if replayed > 0 {
            debug!(
                file = f,
                wgen,
                records = replayed,
                bytes = off,
                "wal replayed"
            );
        }
        replayed
    }

    /// The store's checksum of each block of a record's data (empty for
    /// kinds without data).
    pub(super) fn block_sums(&self, h: &WalHeader, data: &[u8]) -> Vec<u32> {
        data.chunks_exact(BLOCK_SIZE)
            .zip(h.lba..)
            .map(|(b, lba)| self.sb.checksum.block(lba, b))
            .collect()
    }

    /// Updates the in-memory index for a record whose data is at `off + WAL_HDR`
    /// of WAL file `f`; `sums` are its blocks' checksums.
    /// `ext_blk`: the first extent block of an [`WalKind::ExtWrite`].
    pub(super) fn apply_record(
        &mut self,
        h: &WalHeader,
        sums: &[u32],
        f: usize,
        off: u64,
        ext_blk: u64,
    ) -> Result<()> {
        if h.lba.saturating_add(h.nblocks as u64) > self.sb.size_blocks {
            return Err(Error::Corrupt("wal record past end of volume".into()));
        }
        let li = self
            .layer_index(h.layer)
            .ok_or_else(|| Error::Corrupt(format!("wal record for unknown layer {}", h.layer)))?;
        let n = u64::from(h.nblocks);
        if h.kind == WalKind::ExtWrite
            && (sums.len() as u64 != n
                || ext_blk.saturating_add(n) > u64::from(u32::MAX)
                || self.layers[li].ext.is_none())
        {
            return Err(Error::Corrupt("bad extent wal record".into()));
        }
        // Extent blocks the record replaces become free once its
        // checkpoint is durable.
        if self.layers[li].ext.is_some() {
            for lba in h.lba..h.lba + n {
                if let Some(Entry {
                    loc: Loc::Ext(x), ..
                }) = self.layers[li].blocks.get(lba)
                {
                    self.ext_pending.push((h.wal_gen, h.layer, *x));
                }
            }
        }
        let layer = &mut self.layers[li];
        match h.kind {
            WalKind::ExtWrite | WalKind::Write | WalKind::SetData => {
                if sums.len() as u64 != n {
                    return Err(Error::Corrupt("wal record checksum count".into()));
                }
                // Block i's data: extent block `ext_blk + i` of the layer,
                // or in this WAL right after the header.
                let ext = (h.kind == WalKind::ExtWrite).then_some(ext_blk as u32);
                if let Some(base) = ext {
                    layer.ext_end = layer.ext_end.max(base + h.nblocks);
                }
                let base = off + WAL_HDR as u64;
                layer.blocks.insert_run(h.lba, n, |lba| {
                    let i = (lba - h.lba) as usize;
                    Entry {
                        meta: BlockMeta {
                            tag: h.tag,
                            crc: sums[i],
                            flags: META_PRESENT,
                        },
                        loc: match ext {
                            Some(x) => Loc::Ext(x + i as u32),
                            None => Loc::Wal(f as u8, base + i as u64 * BLOCK_SIZE_U64),
                        },
                    }
                });
            }
            WalKind::Zero | WalKind::SetZero => {
                let e = Entry {
                    meta: BlockMeta {
                        tag: h.tag,
                        crc: 0,
                        flags: META_PRESENT | META_ZERO,
                    },
                    loc: Loc::Layer,
                };
                layer.blocks.insert_run(h.lba, n, |_| e);
            }
            WalKind::SetAbsent => {
                for lba in h.lba..h.lba + n {
                    layer.blocks.remove(lba);
                }
            }
        }
        self.dirty.insert_run(h.layer, h.lba, n);
        if h.kind.ordered() {
            self.position = h.tag;
        }
        Ok(())
    }

    pub(super) fn append(&mut self, mut h: WalHeader, data: &[u8]) -> Result<()> {
        self.reap()?;
        let rec = (WAL_HDR + data.len()) as u64;
        if self.wal_len > 0 && self.wal_len + rec > self.wal_limit() {
            // Nobody flushed for a long time: seal this WAL and checkpoint
            // it off the write path (only makes unflushed writes durable
            // earlier, which every caller allows). Every record so far is
            // fully applied, so this is a consistent point.
            debug!(wal_bytes = self.wal_len, "wal limit reached, sealing");
            self.seal()?;
        }
        h.wal_gen = self.wgen;
        if !h.kind.ordered() {
            // Replay of the next WAL has no position check for this
            // record: the sealed one must not lose a tail under it.
            self.sync_sealed()?;
            self.wal_unordered = true;
        }
        // Each block's checksum is needed for the index anyway; with the
        // `wal_sums` flag the record CRC covers them instead of the data.
        let sums = self.block_sums(&h, data);
        let hdr = if self.sb.wal_sums {
            h.encode_sums(&sums)
        } else {
            h.encode(data)
        };
        let off = self.wal_len;
        self.wals[self.cur]
            .write2_at(&hdr, data, off)
            .map_err(Error::store("append wal"))?;
        self.wal_len += (WAL_HDR + data.len()) as u64;
        self.apply_record(&h, &sums, self.cur, off, 0)
    }

    /// Appends an ordered write redirected to the head layer's extent
    /// file: the data once there, a header-only [`WalKind::ExtWrite`]
    /// record in the WAL.
    pub(super) fn append_extent(&mut self, mut h: WalHeader, data: &[u8]) -> Result<()> {
        self.reap()?;
        let rec = WAL_HDR as u64 + self.ext_bytes + data.len() as u64;
        if self.wal_len > 0 && self.wal_len + rec > self.wal_limit() {
            debug!(wal_bytes = self.wal_len, "wal limit reached, sealing");
            self.seal()?;
        }
        if !self.sb.extents {
            // Older versions must refuse the store before the first
            // extent record or entry exists.
            self.sb.extents = true;
            self.write_sb()?;
        }
        let li = self.layers.len() - 1;
        let ext = self.ensure_ext(li)?;
        h.kind = WalKind::ExtWrite;
        h.wal_gen = self.wgen;
        let sums = self.block_sums(&h, data);
        let l = &mut self.layers[li];
        let blk = l
            .ext_alloc(h.nblocks)
            .ok_or_else(|| Error::InvalidArgument("extent file full".into()))?;
        l.ext_unsynced = true;
        if let Err(e) = ext.write_at(data, u64::from(blk) * BLOCK_SIZE_U64) {
            for i in 0..h.nblocks {
                self.layers[li].ext_release(blk + i);
            }
            return Err(Error::store("append extent")(e));
        }
        let hdr = h.encode_extent(u64::from(blk), &sums);
        let off = self.wal_len;
        if let Err(e) = self.wals[self.cur].write_at(&hdr, off) {
            for i in 0..h.nblocks {
                self.layers[li].ext_release(blk + i);
            }
            return Err(Error::store("append wal")(e));
        }
        self.wal_len += WAL_HDR as u64;
        self.ext_bytes += data.len() as u64;
        EXTENT_WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.apply_record(&h, &sums, self.cur, off, u64::from(blk))
    }

    /// Syncs the sealed WAL unless known durable.
    pub(super) fn sync_sealed(&mut self) -> Result<()> {
        if self.sealed.as_ref().is_some_and(|s| !s.synced) {
            self.sync_exts()?;
        }
        if let Some(s) = self.sealed.as_mut()
            && !s.synced
        {
            self.wals[s.file]
                .sync()
                .map_err(Error::store("sync sealed wal"))?;
            s.synced = true;
        }
        Ok(())
    }

    /// Seals the current WAL: later records go to the other file as the
    /// next generation, and a checkpoint job for the sealed one starts (on
    /// a thread, or deferred). Waits for a job still in flight first.
    pub(super) fn seal(&mut self) -> Result<()> {
        self.settle()?;
        if self.wal_len == 0 {
            return Ok(());
        }
        if !self.sb.two_wal {
            // Versions that replay only `wal` must refuse the store from
            // before the first record lands in the other file.
            self.sb.two_wal = true;
            self.write_sb()?;
        }
        let synced = self.wal_unordered;
        if synced {
            self.sync_exts()?;
            self.wals[self.cur]
                .sync()
                .map_err(Error::store("sync wal"))?;
        }
        // Its copies go to data files: punches of them started by an idle
        // call must be over (they normally are long before the next seal).
        self.finish_punch_job();
        let dirty = std::mem::take(&mut self.dirty);
        let sync_wals = if synced { vec![] } else { vec![self.cur] };
        let job = Arc::new(self.build_job(&dirty, sync_wals, false));
        let running = if self.background {
            let j = job.clone();
            let spawned = std::thread::Builder::new()
                .name("store-checkpoint".into())
                .spawn(move || j.run());
            match spawned {
                Ok(h) => Some(h),
                Err(e) => {
                    warn!(error = %e, "no checkpoint thread, checkpointing inline");
                    None
                }
            }
        } else {
            None
        };
        self.sealed = Some(Sealed {
            file: self.cur,
            position: self.position,
            dirty,
            job,
            running,
            synced,
        });
        self.cur = 1 - self.cur;
        self.wgen += 1;
        self.wal_len = 0;
        self.ext_bytes = 0;
        self.wal_unordered = false;
        Ok(())
    }

    /// Finishes a background checkpoint job that has completed (cheap
    /// otherwise); deferred jobs are left alone.
    pub(super) fn reap(&mut self) -> Result<()> {
        let punch_done = |p: &Option<PunchJob>| {
            p.as_ref()
                .is_none_or(|p| p.running.as_ref().is_some_and(JoinHandle::is_finished))
        };
        if self.punch_job.is_some() && punch_done(&self.punch_job) {
            self.finish_punch_job();
        }
        if self
            .sealed
            .as_ref()
            .is_some_and(|s| s.running.as_ref().is_some_and(JoinHandle::is_finished))
        {
            self.settle()?;
        }
        Ok(())
    }

    /// Starts punching every free extent run, the pools' too (on a
    /// thread, or deferred like checkpoint jobs).
    pub(super) fn start_punch_job(&mut self) {
        debug_assert!(self.punch_job.is_none());
        let mut ops = self.plan_data_punches(PUNCH_MAX_RUNS);
        ops.extend(self.plan_ext_punches(0, PUNCH_MAX_RUNS));
        if ops.is_empty() {
            return;
        }
        let ops = Arc::new(ops);
        let running = if self.background {
            let o = ops.clone();
            let spawned = std::thread::Builder::new()
                .name("store-punch".into())
                .spawn(move || run_punches(&o));
            match spawned {
                Ok(h) => Some(h),
                Err(e) => {
                    warn!(error = %e, "no punch thread, punching inline");
                    run_punches(&ops);
                    None
                }
            }
        } else {
            None
        };
        self.punch_job = Some(PunchJob { ops, running });
    }

    /// Waits for (or runs) the extent punches in flight; their runs are
    /// allocatable again (as holes).
    pub(super) fn finish_punch_job(&mut self) {
        let Some(mut p) = self.punch_job.take() else {
            return;
        };
        match p.running.take() {
            Some(h) => {
                if h.join().is_err() {
                    warn!("punch thread panicked");
                }
            }
            None => run_punches(&p.ops),
        }
        self.layers.iter_mut().for_each(|l| l.ext_punch_done(true));
    }

    /// [`Store::settle`], then finishes the punches it started (operations
    /// that change the layer chain or checkpoint synchronously).
    pub(super) fn settle_all(&mut self) -> Result<()> {
        self.settle()?;
        self.finish_punch_job();
        Ok(())
    }

    /// Finishes the checkpoint of a sealed WAL if it can without waiting:
    /// a completed background job, or a deferred job (run now, inline).
    /// The simulator calls it at seeded moments.
    pub fn poll_checkpoint(&mut self) -> Result<()> {
        if self
            .punch_job
            .as_ref()
            .is_some_and(|p| p.running.as_ref().is_none_or(JoinHandle::is_finished))
        {
            self.finish_punch_job();
        }
        match &self.sealed {
            Some(s) if s.running.as_ref().is_some_and(|h| !h.is_finished()) => Ok(()),
            Some(_) => self.settle(),
            None => Ok(()),
        }
    }

    /// The volume is idle (its caller saw no request for a while; call it
    /// again while that lasts, e.g. every second). Gives the space of
    /// overwritten and trimmed blocks back without waiting for the next
    /// WAL limit: the first call seals the WAL if it holds records (its
    /// checkpoint runs off the store thread, like at the limit), later
    /// calls finish that checkpoint, and once nothing is outstanding and
    /// nothing was written since, punch (on a thread, up to
    /// [`PUNCH_MAX_RUNS`] runs of each kind per call) the stale data-file
    /// copies and the free extent blocks that checkpoints under a stream
    /// of writes leave alone. Never waits for I/O in flight; safe at any
    /// time (it only does what the write path does at its limit).
    pub fn idle(&mut self) -> Result<()> {
        self.poll_checkpoint()?;
        if self.sealed.is_some() || self.punch_job.is_some() {
            return Ok(());
        }
        if self.wal_len > 0 {
            return self.seal();
        }
        if self
            .layers
            .iter()
            .any(|l| l.ext_pool() > 0 || !l.data_stale.is_empty())
        {
            // Up to PUNCH_MAX_RUNS runs per call.
            self.start_punch_job();
        }
        Ok(())
    }

    /// Whether a sealed WAL's checkpoint is outstanding (tests).
    pub fn checkpoint_pending(&self) -> bool {
        self.sealed.is_some()
    }

    /// Runs a deferred checkpoint job without finishing it (tests: a crash
    /// between the job and the superblock write).
    #[cfg(test)]
    pub(super) fn run_job_only(&mut self) -> io::Result<()> {
        match &self.sealed {
            Some(s) if s.running.is_none() => s.job.run(),
            _ => Ok(()),
        }
    }

    /// Waits for (or runs) the checkpoint job of a sealed WAL and finishes
    /// it. On an error the sealed WAL stays, with the index still pointing
    /// into it, and the job is run again by the next call.
    pub(super) fn settle(&mut self) -> Result<()> {
        let Some(mut s) = self.sealed.take() else {
            return Ok(());
        };
        let res = match s.running.take() {
            Some(h) => h
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("checkpoint thread panicked"))),
            None => s.job.run(),
        };
        if let Err(e) = res {
            self.sealed = Some(s);
            return Err(Error::store("checkpoint")(e));
        }
        // The sealed WAL's content is in the layer files: the superblock
        // moves past its generation, then its space is reused.
        let (pos, wgen) = (self.sb.position, self.sb.wal_gen);
        self.sb.position = s.position;
        self.sb.wal_gen = self.wgen;
        if let Err(e) = self.write_sb() {
            self.sb.position = pos;
            self.sb.wal_gen = wgen;
            self.sealed = Some(s);
            return Err(e);
        }
        self.point_to_layers(&s.dirty, Some(s.file));
        // The data-file copies it replaced are punched when the volume is
        // idle, like the extent blocks: punching them here, under the
        // write stream, stalled the next seal behind `fallocate` calls of
        // up to half a second on fragmented data files (3 replicas: 1 MiB
        // writes after random 4 KiB writes at a third of the throughput).
        for op in &s.job.punches {
            if let JobOp::Punch { li, off, len } = op
                && let Some(l) = self.layers.get_mut(*li)
            {
                run_add(
                    &mut l.data_stale,
                    off / BLOCK_SIZE_U64,
                    len / BLOCK_SIZE_U64,
                );
            }
        }
        // The extent blocks it freed stay allocated, for the next large
        // writes: punching them here, under a stream of writes, made those
        // writes land in fresh holes (file system allocation on the write
        // path, and `fallocate` holding the extent file's inode lock) and
        // cost a third of 1 MiB write throughput after random 4 KiB writes.
        // They are punched when the volume goes idle ([`Store::idle`]), at
        // synchronous checkpoints and at open. The data-file copies this
        // checkpoint replaced were punched by its job.
        self.release_ext();
        // The sealed file keeps its length and blocks: the generation after
        // next overwrites it from offset 0 (pages still cached and
        // allocated, no truncate, no zeroing of new pages). What stays past
        // its live end is of older generations, which replay never takes
        // for the current one (see `replay_file`).
        Ok(())
    }

    pub(super) fn layer_index(&self, id: u64) -> Option<usize> {
        self.layers.iter().position(|l| l.info.id == id)
    }

    pub(super) fn head_id(&self) -> u64 {
        self.layers.last().map_or(0, |l| l.info.id)
    }

    pub(super) fn check_range(&self, lba: u64, n: u64) -> Result<()> {
        if n == 0 || lba.checked_add(n).is_none_or(|e| e > self.sb.size_blocks) {
            return Err(Error::OutOfRange {
                offset: lba.saturating_mul(BLOCK_SIZE_U64),
                len: n.saturating_mul(BLOCK_SIZE_U64),
                size: self.sb.size_blocks * BLOCK_SIZE_U64,
            });
        }
        Ok(())
    }
}
