// SPDX-License-Identifier: Apache-2.0
//! Creating and opening a store, layer files and extent-file space management.

use super::*;

impl Store {
    /// Creates an empty store of `size_blocks` blocks in `dir`, replacing any
    /// store there. The new replica is `Rebuilding` at position 0:0 until an
    /// engine either adopts it as the first copy of a new volume (see
    /// [`Store::mark_clean`]) or rebuilds it. Blocks are checksummed with
    /// [`BlockChecksum::NEW`].
    pub fn create(dir: Box<dyn StoreDir>, size_blocks: u64, state: ReplicaState) -> Result<Store> {
        Self::create_with_checksum(dir, size_blocks, state, BlockChecksum::NEW)
    }

    /// [`Store::create`] with a given block checksum algorithm (tests, and
    /// stores that older versions must be able to open: [`BlockChecksum::Sha256`]).
    pub fn create_with_checksum(
        dir: Box<dyn StoreDir>,
        size_blocks: u64,
        state: ReplicaState,
        checksum: BlockChecksum,
    ) -> Result<Store> {
        for name in dir.list().map_err(Error::store("list"))? {
            if name == SB_NAME || WAL_NAMES.contains(&name.as_str()) || name.starts_with("layer-") {
                dir.remove(&name).map_err(Error::store("remove"))?;
            }
        }
        let head = LayerInfo {
            id: 1,
            name: String::new(),
            created: Tag::default(),
        };
        let wgen = gen_step(&*dir);
        let sb = Superblock {
            generation: 0,
            size_blocks,
            epoch: 0,
            engine: 0,
            state,
            position: Tag::default(),
            wal_gen: wgen,
            layers: vec![head.clone()],
            boot_id: dir.boot_id(),
            open: false,
            recovered: false,
            checksum,
            two_wal: false,
            // New stores write records checksummed over the block
            // checksums from the start.
            wal_sums: true,
            extents: false,
        };
        let sb_file = dir.open(SB_NAME, true).map_err(Error::store("create"))?;
        sb_file
            .set_len(2 * SB_SLOT as u64)
            .map_err(Error::store("create"))?;
        let wals = Self::open_wals(&*dir, "create")?;
        let layer = Self::open_layer(&*dir, head, true)?;
        dir.sync_dir().map_err(Error::store("create"))?;
        let background = dir.background_checkpoints();
        let mut s = Store {
            dir,
            sb_file,
            sb,
            wals,
            cur: 0,
            wgen,
            wal_len: 0,
            wal_unordered: false,
            layers: vec![layer],
            position: Tag::default(),
            dirty: DirtySet::default(),
            sealed: None,
            punch_job: None,
            background,
            checkpoint_bytes: CHECKPOINT_BYTES,
            extent_min_blocks: EXTENT_MIN_BLOCKS,
            ext_bytes: 0,
            ext_pending: Vec::new(),
            ext_pool_blocks: None,
        };
        s.write_sb()?;
        s.write_sb()?; // both slots valid
        Ok(s)
    }

    /// Opens an existing store, recovering from a crash: picks the newest
    /// valid superblock, loads layer metadata, replays the valid prefix of
    /// the WAL and checkpoints.
    pub fn open(dir: Box<dyn StoreDir>) -> Result<Store> {
        let sb_file = dir.open(SB_NAME, false).map_err(Error::store("open"))?;
        // The intact slot with the highest generation wins, also when this
        // version cannot use it (never fall back to an older state then).
        let mut best: Option<(u64, std::result::Result<Superblock, SbError>)> = None;
        for slot in 0..2u64 {
            let mut buf = vec![0u8; SB_SLOT];
            if sb_file.read_at(&mut buf, slot * SB_SLOT as u64).is_err() {
                continue;
            }
            let res = Superblock::decode(&buf);
            let generation = match &res {
                Ok(sb) => sb.generation,
                Err(e) => match e.generation() {
                    Some(g) => g,
                    None => continue,
                },
            };
            if best.as_ref().is_none_or(|(g, _)| generation > *g) {
                best = Some((generation, res));
            }
        }
        let mut sb = match best {
            None => return Err(Error::Corrupt("no valid superblock slot".into())),
            Some((_, Err(e))) => return Err(Error::Corrupt(e.to_string())),
            Some((_, Ok(sb))) => sb,
        };
        debug!(checksum = sb.checksum.name(), "store opened");
        let boot = dir.boot_id();
        if sb.boot_id != boot {
            if sb.open && sb.state == ReplicaState::Clean && !sb.recovered {
                // Writes acknowledged since the last sync may be gone: the
                // position below is only what survived. Persisted by the
                // checkpoint at the end of open.
                warn!("node restarted while attached: replica may lack acknowledged writes");
                sb.recovered = true;
            }
            sb.boot_id = boot;
        }
        // Remove files of layers that are not in the chain (crash during
        // snapshot create/delete/revert).
        let keep: Vec<(String, String)> = sb.layers.iter().map(|l| layer_names(l.id)).collect();
        let keep_ext: Vec<String> = sb.layers.iter().map(|l| ext_name(l.id)).collect();
        for name in dir.list().map_err(Error::store("list"))? {
            if name.starts_with("layer-")
                && !keep.iter().any(|(d, m)| *d == name || *m == name)
                && !keep_ext.contains(&name)
            {
                dir.remove(&name).map_err(Error::store("remove"))?;
            }
        }
        let mut layers = Vec::new();
        for info in &sb.layers {
            let mut layer = Self::open_layer(&*dir, info.clone(), false)?;
            if sb.extents {
                let ext = dir
                    .open(&ext_name(info.id), true)
                    .map_err(Error::store("open layer"))?;
                let len = ext.len().map_err(Error::store("open layer"))?;
                layer.ext_end = u32::try_from(len.div_ceil(BLOCK_SIZE_U64)).unwrap_or(u32::MAX);
                layer.ext = Some(Arc::from(ext));
            }
            Self::load_meta(&mut layer, sb.size_blocks)?;
            layers.push(layer);
        }
        // The second WAL may be new (a store of an older version): its
        // directory entry must be durable before records in it count.
        let wals = Self::open_wals(&*dir, "open")?;
        dir.sync_dir().map_err(Error::store("open"))?;
        let position = sb.position;
        let wgen = sb.wal_gen;
        let background = dir.background_checkpoints();
        let mut s = Store {
            dir,
            sb_file,
            sb,
            wals,
            cur: 0,
            wgen,
            wal_len: 0,
            wal_unordered: false,
            layers,
            position,
            dirty: DirtySet::default(),
            sealed: None,
            punch_job: None,
            background,
            checkpoint_bytes: CHECKPOINT_BYTES,
            extent_min_blocks: EXTENT_MIN_BLOCKS,
            ext_bytes: 0,
            ext_pending: Vec::new(),
            ext_pool_blocks: None,
        };
        // Generation wal_gen is in whichever file starts with it; if a
        // WAL was sealed (flag set), generation wal_gen + 1 continues in
        // the other file. The position check of ordered records stops the
        // second file at once if the first lost its tail.
        let first = (0..2).find(|&f| s.replay_file(f, wgen) > 0);
        if let Some(f) = first
            && s.sb.two_wal
        {
            s.replay_file(1 - f, wgen + 1);
        }
        // Replay's frees are not to be trusted: if a job wrote metadata
        // entries but its superblock write was lost, replay applies
        // records over entries that already have them, so a record "frees"
        // the extent blocks it wrote itself (or a later record of its
        // generation wrote). The free runs come from the index after the
        // checkpoint below (`rebuild_ext_free`), and nothing may be
        // released (or punched) before.
        s.ext_pending.clear();
        // Both files are checkpointed and truncated: the new generation
        // must differ from every one they may still hold.
        s.wgen = wgen + 1;
        let unclean = s.sb.open;
        s.checkpoint()?;
        // The index is now exactly the durable metadata and no record is
        // replayable: every extent block it does not reference is free.
        s.rebuild_ext_free();
        // Free extent blocks a crash or a lost punch left allocated.
        s.reclaim_ext_now();
        if unclean {
            // The data-file punches of seals before the crash may not have
            // run: every block not kept in a data file is a candidate, for
            // idle calls to give back.
            s.mark_all_data_stale();
        }
        Ok(s)
    }

    pub(super) fn open_wals(
        dir: &dyn StoreDir,
        what: &'static str,
    ) -> Result<[Arc<dyn StoreFile>; 2]> {
        let a = dir.open(WAL_NAMES[0], true).map_err(Error::store(what))?;
        let b = dir.open(WAL_NAMES[1], true).map_err(Error::store(what))?;
        Ok([Arc::from(a), Arc::from(b)])
    }

    pub(super) fn open_layer(dir: &dyn StoreDir, info: LayerInfo, create: bool) -> Result<Layer> {
        let (d, m) = layer_names(info.id);
        let data = dir.open(&d, create).map_err(Error::store("open layer"))?;
        let meta = dir.open(&m, create).map_err(Error::store("open layer"))?;
        Ok(Layer {
            info,
            data: Arc::from(data),
            meta: Arc::from(meta),
            blocks: BlockIndex::default(),
            ext: None,
            ext_end: 0,
            ext_free: BTreeMap::new(),
            ext_holes: BTreeMap::new(),
            ext_punching: Vec::new(),
            data_stale: BTreeMap::new(),
            ext_unsynced: false,
        })
    }

    /// Recomputes every layer's free extent runs from its index (at open,
    /// right after a checkpoint, when the index is the durable metadata).
    pub(super) fn rebuild_ext_free(&mut self) {
        self.ext_pending.clear();
        for l in &mut self.layers {
            l.ext_free.clear();
            l.ext_holes.clear();
            l.ext_punching.clear();
            if l.ext.is_none() {
                continue;
            }
            let mut used: Vec<u32> = l
                .blocks
                .keys()
                .filter_map(|b| match l.blocks.get(b).map(|e| e.loc) {
                    Some(Loc::Ext(x)) => Some(x),
                    _ => None,
                })
                .collect();
            used.sort_unstable();
            used.dedup();
            let mut next = 0u32;
            for u in used {
                if u >= l.ext_end {
                    l.ext_end = u.saturating_add(1);
                }
                if u > next {
                    l.ext_free.insert(next, u - next);
                }
                next = u.saturating_add(1);
            }
            if l.ext_end > next {
                l.ext_free.insert(next, l.ext_end - next);
            }
        }
    }

    /// Layer `li`'s extent file, opened (and created) if it is not open yet.
    pub(super) fn ensure_ext(&mut self, li: usize) -> Result<Arc<dyn StoreFile>> {
        if let Some(f) = &self.layers[li].ext {
            return Ok(f.clone());
        }
        let f = self
            .dir
            .open(&ext_name(self.layers[li].info.id), true)
            .map_err(Error::store("create extent file"))?;
        // Its directory entry must be durable before records point into it.
        self.dir
            .sync_dir()
            .map_err(Error::store("create extent file"))?;
        let len = f.len().map_err(Error::store("create extent file"))?;
        let l = &mut self.layers[li];
        l.ext_end = l
            .ext_end
            .max(u32::try_from(len.div_ceil(BLOCK_SIZE_U64)).unwrap_or(u32::MAX));
        let f: Arc<dyn StoreFile> = Arc::from(f);
        l.ext = Some(f.clone());
        Ok(f)
    }

    /// Syncs the extent files with unsynced writes (before a WAL sync that
    /// makes records pointing into them durable).
    pub(super) fn sync_exts(&mut self) -> Result<()> {
        for l in &mut self.layers {
            if l.ext_unsynced
                && let Some(f) = &l.ext
            {
                f.sync().map_err(Error::store("sync extent file"))?;
                l.ext_unsynced = false;
            }
        }
        Ok(())
    }

    /// Makes extent blocks freed by checkpointed records reusable.
    pub(super) fn release_ext(&mut self) {
        let done = self.sb.wal_gen;
        let pending = std::mem::take(&mut self.ext_pending);
        for (g, layer, b) in pending {
            if g >= done {
                self.ext_pending.push((g, layer, b));
            } else if let Some(li) = self.layer_index(layer) {
                self.layers[li].ext_release(b);
            }
        }
    }

    /// Marks every block of every layer's data file as possibly stale,
    /// except those an entry keeps there.
    pub(super) fn mark_all_data_stale(&mut self) {
        let size = self.sb.size_blocks;
        for l in &mut self.layers {
            let mut next = 0;
            for b in l.blocks.keys() {
                if l.blocks.get(b).is_some_and(Entry::keeps_data_copy) {
                    if b > next {
                        l.data_stale.insert(next, b - next);
                    }
                    next = b + 1;
                }
            }
            if size > next {
                l.data_stale.insert(next, size - next);
            }
        }
    }

    /// Takes stale data-file runs ([`Layer::data_stale`]; at most
    /// `max_runs` of them, each whole) and returns punches for their
    /// blocks that no entry keeps in the data file: absent, trimmed or in
    /// the extent file. Only when the index is the durable metadata (no
    /// sealed WAL, no record since the last checkpoint, or right after a
    /// synchronous one), so no durable entry refers to those copies.
    pub(super) fn plan_data_punches(&mut self, max_runs: usize) -> Vec<JobOp> {
        let mut ops = Vec::new();
        let mut taken = 0;
        for l in &mut self.layers {
            while taken < max_runs {
                let Some((start, len)) = l.data_stale.pop_first() else {
                    break;
                };
                taken += 1;
                // The blocks without an entry that keeps them in the data
                // file, between those that have one.
                let end = start.saturating_add(len);
                let mut next = start;
                for b in l.blocks.keys_in(start, end) {
                    if l.blocks.get(b).is_some_and(Entry::keeps_data_copy) {
                        push_data_punch(&mut ops, &l.data, (b > next).then(|| (next, b - next)));
                        next = b + 1;
                    }
                }
                let run = (end > next).then(|| (next, end - next));
                push_data_punch(&mut ops, &l.data, run);
            }
        }
        ops
    }

    /// Takes every layer's free extent runs beyond its pool (the head
    /// layer keeps [`Store::set_extent_pool`] blocks allocated for reuse,
    /// the others none: only the head takes new large writes) out of the
    /// allocator, as punches for a [`PunchJob`]. Free runs are reusable
    /// (see [`Store::release_ext`]): no durable metadata entry and no
    /// replayable WAL record refers to them, so they may be punched at any
    /// point; held back until the punches have finished, they cannot be
    /// reallocated under the punch.
    pub(super) fn plan_ext_punches(&mut self, pool: u32, max_runs: usize) -> Vec<JobOp> {
        let head = self.layers.len().saturating_sub(1);
        let mut ops = Vec::new();
        for (li, l) in self.layers.iter_mut().enumerate() {
            let Some(file) = l.ext.clone() else {
                continue;
            };
            let keep = if li == head { pool } else { 0 };
            for (start, len) in l.ext_take_for_punch(keep, max_runs) {
                ops.push(JobOp::PunchExt {
                    file: file.clone(),
                    off: u64::from(start) * BLOCK_SIZE_U64,
                    len: u64::from(len) * BLOCK_SIZE_U64,
                });
            }
        }
        ops
    }

    /// Punches free extent runs beyond the pools now and cuts punched runs
    /// at the end of each extent file off its length (synchronous
    /// checkpoints and open: no job in flight). Failures only leak space.
    pub(super) fn reclaim_ext_now(&mut self) {
        debug_assert!(self.sealed.is_none() && self.punch_job.is_none());
        run_punches(&self.plan_data_punches(usize::MAX));
        run_punches(&self.plan_ext_punches(self.extent_pool(), usize::MAX));
        for l in &mut self.layers {
            l.ext_punch_done(true);
            if let Err(e) = l.ext_trim_tail() {
                warn!(layer = l.info.id, error = %e, "extent file truncate failed");
            }
        }
    }

    /// Sets how many free extent blocks the head layer keeps allocated for
    /// the next large writes (default: see [`Store::extent_pool`]); free
    /// blocks beyond it are punched once the checkpoint that freed them
    /// has finished.
    pub fn set_extent_pool(&mut self, blocks: u32) {
        self.ext_pool_blocks = Some(blocks);
    }

    /// Free extent blocks the head layer keeps allocated for reuse. The
    /// default is what one checkpoint can free under a stream of large
    /// overwrites, the WAL limit (extent bytes count towards it: 128 MiB),
    /// and at most a quarter of the volume: a smaller pool has the stream
    /// punch and re-allocate blocks at every checkpoint (measured: 1 MiB
    /// sequential overwrites lost 35-45 % with a 32 or 64 MiB pool on a
    /// 512 MiB volume).
    pub fn extent_pool(&self) -> u32 {
        self.ext_pool_blocks.unwrap_or_else(|| {
            let window = self.wal_limit() / BLOCK_SIZE_U64;
            u32::try_from(window.min(self.sb.size_blocks / 4)).unwrap_or(u32::MAX)
        })
    }

    /// Sets the smallest ordered write (in blocks) redirected to an
    /// extent file (tests and the simulator use small values).
    pub fn set_extent_threshold(&mut self, blocks: u32) {
        self.extent_min_blocks = blocks.max(1);
    }

    /// Extent blocks allocated in the head layer's extent file and how
    /// many of them are free (tests).
    pub fn extent_usage(&self) -> (u32, u32) {
        let l = &self.layers[self.layers.len() - 1];
        let holes: u32 = l.ext_holes.values().sum();
        let punching: u32 = l.ext_punching.iter().map(|r| r.1).sum();
        (l.ext_end, l.ext_pool() + holes + punching)
    }

    /// Removes the files of a dropped layer.
    pub(super) fn remove_layer_files(&mut self, l: Layer) -> Result<()> {
        // Its pending frees must not land in a later layer with its id.
        self.ext_pending.retain(|p| p.1 != l.info.id);
        let (d, m) = layer_names(l.info.id);
        let x = ext_name(l.info.id);
        let has_ext = l.ext.is_some();
        drop(l);
        self.dir.remove(&d).map_err(Error::store("remove layer"))?;
        self.dir.remove(&m).map_err(Error::store("remove layer"))?;
        if has_ext || self.sb.extents {
            self.dir.remove(&x).map_err(Error::store("remove layer"))?;
        }
        Ok(())
    }

    pub(super) fn load_meta(layer: &mut Layer, size_blocks: u64) -> Result<()> {
        let len = layer.meta.len().map_err(Error::store("read meta"))?;
        let n = (len / META_SIZE as u64).min(size_blocks);
        const CHUNK: u64 = 4096;
        let mut buf = vec![0u8; (CHUNK as usize) * META_SIZE];
        let mut lba = 0;
        while lba < n {
            let cnt = (n - lba).min(CHUNK);
            let bytes = &mut buf[..cnt as usize * META_SIZE];
            if let Err(e) = layer.meta.read_at(bytes, lba * META_SIZE as u64) {
                // Unreadable metadata: treat every entry in the chunk as damaged.
                warn!(layer = layer.info.id, lba, error = %e, "metadata unreadable");
                for i in 0..cnt {
                    layer.blocks.insert(lba + i, Self::damaged());
                }
                lba += cnt;
                continue;
            }
            for i in 0..cnt as usize {
                let raw = &bytes[i * META_SIZE..(i + 1) * META_SIZE];
                match BlockMeta::decode(raw) {
                    Ok(None) => {}
                    Ok(Some(meta)) => {
                        // A known bad copy keeps its tag: a peer's copy of
                        // the same write can repair it.
                        let mut meta = meta;
                        let loc = if meta.is_damaged() {
                            Loc::Damaged
                        } else if meta.flags & META_EXTENT != 0 {
                            meta.flags &= !META_EXTENT;
                            match (&layer.ext, BlockMeta::extent_block(raw)) {
                                (Some(_), Some(x)) => Loc::Ext(x),
                                _ => Loc::Damaged,
                            }
                        } else {
                            Loc::Layer
                        };
                        layer.blocks.insert(lba + i as u64, Entry { meta, loc });
                    }
                    Err(()) => {
                        layer.blocks.insert(lba + i as u64, Self::damaged());
                    }
                }
            }
            lba += cnt;
        }
        Ok(())
    }

    pub(super) fn damaged() -> Entry {
        Entry {
            meta: BlockMeta {
                tag: Tag::default(),
                crc: 0,
                flags: META_PRESENT,
            },
            loc: Loc::Damaged,
        }
    }
}
