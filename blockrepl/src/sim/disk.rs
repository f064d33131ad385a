// SPDX-License-Identifier: Apache-2.0
//! Simulated disks: in-memory files with the failure modes of real ones.
//!
//! Each file has a *durable* image and a list of writes not yet synced. Power
//! loss keeps, drops or tears (per 512-byte sector) each unsynced write
//! independently, in any combination. Faults: misdirected writes (data lands
//! one block off), bit rot, latent sector errors (reads fail until the
//! sector is rewritten), a full disk (writes fail), and slowness (the
//! harness reads [`SimDisk::latency_factor`]). Creating and removing files
//! is durable at once (a documented simplification).
//!
//! Hole punches and truncates are unsynced operations like writes: at a
//! power loss each is kept, dropped or (punches) torn, any subset of its
//! sectors reading as zeros, in order with the writes around it (a file
//! system journals them in order). A punch is never misdirected (it is a
//! file system metadata update, not a data write the device could place
//! wrongly), clears latent sector errors in its range (the blocks are
//! deallocated), never extends the file, and still fails on a full disk
//! (ext4 may need a block to split an extent).

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use super::rng::Prng;
use crate::store::disk::{StoreDir, StoreFile};

const SECTOR: u64 = 512;

#[derive(Debug, Clone)]
enum Pending {
    Write {
        off: u64,
        data: Vec<u8>,
    },
    SetLen(u64),
    /// Zeros `[off, off + len)`, clipped to the file's length.
    Punch {
        off: u64,
        len: u64,
    },
}

#[derive(Debug, Default, Clone)]
struct FileState {
    durable: Vec<u8>,
    current: Vec<u8>,
    pending: Vec<Pending>,
}

fn apply(buf: &mut Vec<u8>, p: &Pending) {
    match p {
        Pending::Write { off, data } => {
            let off = *off as usize;
            if buf.len() < off + data.len() {
                buf.resize(off + data.len(), 0);
            }
            buf[off..off + data.len()].copy_from_slice(data);
        }
        Pending::SetLen(l) => buf.resize(*l as usize, 0),
        Pending::Punch { off, len } => {
            let end = off.saturating_add(*len).min(buf.len() as u64) as usize;
            let off = (*off as usize).min(end);
            buf[off..end].fill(0);
        }
    }
}

/// Fault knobs of one disk, set by the harness.
#[derive(Debug, Default, Clone)]
pub struct DiskFaults {
    /// Writes fail with "no space".
    pub full: bool,
    /// Probability that a data-file write lands one block off.
    pub misdirect: f64,
    /// Latency multiplier (1 = normal).
    pub slow: u64,
}

#[derive(Debug)]
struct State {
    files: BTreeMap<String, FileState>,
    latent: BTreeSet<(String, u64)>,
    faults: DiskFaults,
    rng: Prng,
    injected: u64,
    /// Incremented by every power loss (the node's boot id).
    boot: u64,
}

/// One simulated disk (a directory of files). Clones share the disk.
#[derive(Debug, Clone)]
pub struct SimDisk {
    st: Arc<Mutex<State>>,
}

impl SimDisk {
    /// An empty disk whose own random choices (misdirection) come from `seed`.
    pub fn new(seed: u64) -> SimDisk {
        SimDisk {
            st: Arc::new(Mutex::new(State {
                files: BTreeMap::new(),
                latent: BTreeSet::new(),
                faults: DiskFaults {
                    slow: 1,
                    ..Default::default()
                },
                rng: Prng::new(seed),
                injected: 0,
                boot: 1,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the fault knobs.
    pub fn set_faults(&self, f: DiskFaults) {
        self.lock().faults = f;
    }

    /// Current fault knobs.
    pub fn faults(&self) -> DiskFaults {
        self.lock().faults.clone()
    }

    /// Latency multiplier.
    pub fn latency_factor(&self) -> u64 {
        self.lock().faults.slow.max(1)
    }

    /// Fault events injected by the disk itself (misdirected writes).
    pub fn injected(&self) -> u64 {
        self.lock().injected
    }

    /// Power loss: every unsynced write is kept, dropped or torn.
    pub fn power_loss(&self, rng: &mut Prng) {
        let mut st = self.lock();
        st.boot += 1;
        for f in st.files.values_mut() {
            let mut img = f.durable.clone();
            for p in f.pending.drain(..) {
                match rng.below(3) {
                    0 => apply(&mut img, &p),
                    1 => {}
                    _ => {
                        match &p {
                            Pending::Write { off, data } => {
                                // Torn: a random subset of sectors made it.
                                let mut s = 0u64;
                                while s * SECTOR < data.len() as u64 {
                                    let lo = (s * SECTOR) as usize;
                                    let hi = (lo + SECTOR as usize).min(data.len());
                                    if rng.chance(0.5) {
                                        apply(
                                            &mut img,
                                            &Pending::Write {
                                                off: off + lo as u64,
                                                data: data[lo..hi].to_vec(),
                                            },
                                        );
                                    }
                                    s += 1;
                                }
                            }
                            Pending::Punch { off, len } => {
                                // Torn: a random subset of sectors was
                                // deallocated.
                                let mut at = *off;
                                while at < off + len {
                                    let n = SECTOR.min(off + len - at);
                                    if rng.chance(0.5) {
                                        apply(&mut img, &Pending::Punch { off: at, len: n });
                                    }
                                    at += n;
                                }
                            }
                            Pending::SetLen(_) => apply(&mut img, &p),
                        }
                    }
                }
            }
            f.durable = img.clone();
            f.current = img;
        }
    }

    /// Flips one random bit in a random layer data file. Returns false if
    /// there was nothing to flip.
    pub fn bit_rot(&self, rng: &mut Prng) -> bool {
        let mut st = self.lock();
        let names: Vec<String> = st
            .files
            .iter()
            .filter(|(n, f)| n.ends_with(".data") && !f.current.is_empty())
            .map(|(n, _)| n.clone())
            .collect();
        if names.is_empty() {
            return false;
        }
        let name = names[rng.below(names.len() as u64) as usize].clone();
        let Some(f) = st.files.get_mut(&name) else {
            return false;
        };
        let len = f.current.len() as u64;
        let at = rng.below(len) as usize;
        let bit = 1u8 << rng.below(8);
        f.current[at] ^= bit;
        if at < f.durable.len() {
            f.durable[at] ^= bit;
        }
        true
    }

    /// Makes one random sector of a random layer data file unreadable.
    pub fn latent_error(&self, rng: &mut Prng) -> bool {
        let mut st = self.lock();
        let names: Vec<(String, u64)> = st
            .files
            .iter()
            .filter(|(n, f)| n.ends_with(".data") && !f.current.is_empty())
            .map(|(n, f)| (n.clone(), f.current.len() as u64))
            .collect();
        if names.is_empty() {
            return false;
        }
        let (name, len) = names[rng.below(names.len() as u64) as usize].clone();
        let sector = rng.below(len.div_ceil(SECTOR));
        st.latent.insert((name, sector));
        true
    }

    /// Logical content of a file (for tests).
    pub fn file(&self, name: &str) -> Option<Vec<u8>> {
        self.lock().files.get(name).map(|f| f.current.clone())
    }

    /// Durable content of a file: what a power loss that drops every
    /// unsynced write would leave (for tests).
    pub fn durable_file(&self, name: &str) -> Option<Vec<u8>> {
        self.lock().files.get(name).map(|f| f.durable.clone())
    }
}

#[derive(Debug)]
struct SimFile {
    disk: SimDisk,
    name: String,
}

impl StoreFile for SimFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let st = self.disk.lock();
        let first = off / SECTOR;
        let last = (off + buf.len() as u64).div_ceil(SECTOR);
        if !st.latent.is_empty()
            && st
                .latent
                .range((self.name.clone(), first)..(self.name.clone(), last))
                .next()
                .is_some()
        {
            return Err(io::Error::other("latent sector error"));
        }
        let f = st
            .files
            .get(&self.name)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "file removed"))?;
        let o = (off as usize).min(f.current.len());
        let n = (f.current.len() - o).min(buf.len());
        buf[..n].copy_from_slice(&f.current[o..o + n]);
        buf[n..].fill(0);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let mut st = self.disk.lock();
        if st.faults.full {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                "no space left (simulated)",
            ));
        }
        let mut off = off;
        if self.name.ends_with(".data") && st.faults.misdirect > 0.0 {
            let p = st.faults.misdirect;
            if st.rng.chance(p) {
                tracing::debug!(file = %self.name, off, len = buf.len(), "misdirected write");
                off += 4096;
                st.injected += 1;
            }
        }
        let first = off / SECTOR;
        let last = (off + buf.len() as u64).div_ceil(SECTOR);
        let name = self.name.clone();
        let gone: Vec<(String, u64)> = if st.latent.is_empty() {
            Vec::new()
        } else {
            st.latent
                .range((name.clone(), first)..(name, last))
                .cloned()
                .collect()
        };
        for g in gone {
            st.latent.remove(&g);
        }
        let f = st
            .files
            .get_mut(&self.name)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "file removed"))?;
        let p = Pending::Write {
            off,
            data: buf.to_vec(),
        };
        apply(&mut f.current, &p);
        f.pending.push(p);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        let mut st = self.disk.lock();
        let f = st
            .files
            .get_mut(&self.name)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "file removed"))?;
        let pending = std::mem::take(&mut f.pending);
        for p in &pending {
            apply(&mut f.durable, p);
        }
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        let st = self.disk.lock();
        Ok(st
            .files
            .get(&self.name)
            .map_or(0, |f| f.current.len() as u64))
    }

    fn punch_hole(&self, off: u64, len: u64) -> io::Result<()> {
        let mut st = self.disk.lock();
        if st.faults.full {
            return Err(io::Error::new(
                io::ErrorKind::StorageFull,
                "no space left (simulated)",
            ));
        }
        let name = self.name.clone();
        let f = st
            .files
            .get_mut(&name)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "file removed"))?;
        // Past the end: nothing to deallocate, and the length stays.
        let end = off.saturating_add(len).min(f.current.len() as u64);
        if off >= end {
            return Ok(());
        }
        let p = Pending::Punch {
            off,
            len: end - off,
        };
        apply(&mut f.current, &p);
        f.pending.push(p);
        let (first, last) = (off / SECTOR, end.div_ceil(SECTOR));
        let gone: Vec<(String, u64)> = st
            .latent
            .range((name.clone(), first)..(name, last))
            .cloned()
            .collect();
        for g in gone {
            st.latent.remove(&g);
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut st = self.disk.lock();
        let f = st
            .files
            .get_mut(&self.name)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "file removed"))?;
        let p = Pending::SetLen(len);
        apply(&mut f.current, &p);
        f.pending.push(p);
        Ok(())
    }
}

impl StoreDir for SimDisk {
    fn open(&self, name: &str, create: bool) -> io::Result<Box<dyn StoreFile>> {
        let mut st = self.lock();
        if !st.files.contains_key(name) {
            if !create {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("{name} not found"),
                ));
            }
            st.files.insert(name.to_string(), FileState::default());
        }
        Ok(Box::new(SimFile {
            disk: self.clone(),
            name: name.to_string(),
        }))
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        let mut st = self.lock();
        st.files.remove(name);
        let stale: Vec<(String, u64)> = st
            .latent
            .iter()
            .filter(|(n, _)| n == name)
            .cloned()
            .collect();
        for s in stale {
            st.latent.remove(&s);
        }
        Ok(())
    }

    fn list(&self) -> io::Result<Vec<String>> {
        Ok(self.lock().files.keys().cloned().collect())
    }

    fn sync_dir(&self) -> io::Result<()> {
        Ok(())
    }

    fn boot_id(&self) -> u64 {
        self.lock().boot
    }

    fn random(&self) -> u64 {
        self.lock().rng.next_u64()
    }

    fn background_checkpoints(&self) -> bool {
        // Deterministic: checkpoint jobs run inline at points the store
        // and the harness choose.
        false
    }
}
