// SPDX-License-Identifier: Apache-2.0
//! Snapshots: the state of a paused VM as a versioned serde structure
//! ([`VmSnapshot`]), guest RAM as a raw image, and restoring both into a
//! fresh VM built from the same config, which then continues the guest
//! where it stopped.
//!
//! ```text
//!  source: pause ─► snapshot_state() ─► VmSnapshot (JSON) ─┐
//!                   save_memory(w)   ─► RAM image ──────────┤
//!  target: VmBuilder(config + same backends).restore(snapshot, image) ─► start
//! ```
//!
//! The RAM image is every RAM region (see `layout::ram_regions`) in guest
//! address order, back to back; its length is the guest's RAM size.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use kvm_ioctls::Kvm;
use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::{Boot, Vm, VmBuilder, VmState};
use crate::arch::x86_64::state::{self as arch_state, StateError, VcpuState, VmArchState};
use crate::config::VmConfig;
use crate::devices::serial::SerialSnapshot;
use crate::devices::virtio::mmio::TransportState;
use crate::error::{Error, Result};

/// The snapshot format this build writes and reads.
pub const SNAPSHOT_VERSION: u32 = 1;

/// File name of the state in a snapshot directory.
pub const STATE_FILE: &str = "state.json";
/// File name of the RAM image in a snapshot directory.
pub const MEMORY_FILE: &str = "memory.bin";

/// Largest state file read (the state of a 255-vCPU VM is a few MiB).
const MAX_STATE_BYTES: u64 = 64 << 20;

/// Bytes copied between guest RAM and an image per step.
const CHUNK: usize = 1 << 20;

/// Everything about a paused VM except its RAM.
#[derive(Debug, Serialize, Deserialize)]
pub struct VmSnapshot {
    /// Format version ([`SNAPSHOT_VERSION`]); others are refused.
    pub version: u32,
    /// The VM's name when saved (informational).
    pub name: String,
    /// Guest RAM in bytes.
    pub memory_bytes: u64,
    /// Every vCPU, by index.
    pub vcpus: Vec<VcpuState>,
    /// In-kernel PICs, IOAPIC, PIT and kvmclock.
    pub vm: VmArchState,
    /// COM1.
    pub serial: SerialSnapshot,
    /// Every virtio-mmio device, in bus order (disks, then cards).
    pub devices: Vec<TransportState>,
}

#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

impl VmSnapshot {
    /// The snapshot as JSON.
    pub fn to_json(&self) -> std::result::Result<Vec<u8>, SnapshotError> {
        serde_json::to_vec(self).map_err(SnapshotError::Encode)
    }

    /// Parses JSON written by [`VmSnapshot::to_json`]; a snapshot of
    /// another format version is refused before anything else is read.
    pub fn from_json(data: &[u8]) -> std::result::Result<VmSnapshot, SnapshotError> {
        let v: VersionOnly = serde_json::from_slice(data).map_err(SnapshotError::Decode)?;
        check_version(v.version)?;
        serde_json::from_slice(data).map_err(SnapshotError::Decode)
    }
}

fn check_version(found: u32) -> std::result::Result<(), SnapshotError> {
    if found != SNAPSHOT_VERSION {
        return Err(SnapshotError::UnsupportedVersion {
            found,
            supported: SNAPSHOT_VERSION,
        });
    }
    Ok(())
}

/// Errors from saving or restoring a snapshot.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The snapshot is of a format this build does not read.
    #[error("snapshot format version {found} is not supported (this build reads {supported})")]
    UnsupportedVersion {
        /// The snapshot's version.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// The snapshot does not describe a VM built from this config.
    #[error("the snapshot has {what} {snapshot} but the config has {config}")]
    Mismatch {
        /// What differs.
        what: &'static str,
        /// The snapshot's value.
        snapshot: String,
        /// The config's value.
        config: String,
    },
    /// A device refused or could not produce its state.
    #[error("device {device}: {reason}")]
    Device {
        /// Device name.
        device: String,
        /// Why.
        reason: String,
    },
    /// Reading or loading KVM state failed.
    #[error("vCPU or irqchip state")]
    Kvm(#[from] StateError),
    /// The RAM image ended early.
    #[error("the memory image is truncated: {read} of {expected} bytes")]
    MemoryTruncated {
        /// Bytes present.
        read: u64,
        /// The guest's RAM size.
        expected: u64,
    },
    /// The RAM image is longer than guest RAM.
    #[error("the memory image is longer than the guest's {expected} bytes of RAM")]
    MemoryTooLong {
        /// The guest's RAM size.
        expected: u64,
    },
    /// Reading or writing the RAM image failed.
    #[error("cannot {op} the memory image")]
    MemoryIo {
        /// `read` or `write`.
        op: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Copying between guest RAM and a buffer failed.
    #[error("cannot access guest memory at {addr:#x}")]
    GuestMemory {
        /// Guest physical address.
        addr: u64,
        /// Cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// A snapshot file could not be created, read or written.
    #[error("cannot {op} {path}")]
    File {
        /// What was done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The state file is larger than any state this build writes.
    #[error("{path} has {size} bytes, more than the {max} a state can have")]
    StateTooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// The state could not be encoded.
    #[error("cannot encode the VM state")]
    Encode(#[source] serde_json::Error),
    /// The state is not valid JSON of the snapshot format.
    #[error("cannot decode the VM state")]
    Decode(#[source] serde_json::Error),
}

fn device_err(device: &str) -> impl Fn(String) -> SnapshotError + '_ {
    move |reason| SnapshotError::Device {
        device: device.to_string(),
        reason,
    }
}

impl Vm {
    /// Saves the state of a paused VM: every vCPU, the in-kernel irqchip,
    /// PIT and clock, the serial port and every virtio device. Requests a
    /// disk backend still had in flight are completed first (into the
    /// used rings in guest memory), so save the memory after this.
    pub fn snapshot_state(&self) -> Result<VmSnapshot> {
        let state = self.state();
        if state != VmState::Paused {
            return Err(Error::InvalidState {
                op: "snapshot",
                state,
            });
        }
        arch_state::check_xsave(&self.vm_fd).map_err(SnapshotError::from)?;
        let kvm = Kvm::new().map_err(Error::OpenKvm)?;
        let mut devices = Vec::with_capacity(self.transports.len());
        for t in &self.transports {
            let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
            t.quiesce();
            let s = t
                .save_state()
                .map_err(|e| device_err(t.name())(e.to_string()))?;
            devices.push(s);
        }
        let serial = self
            .serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .save_state();
        let vm = arch_state::save_vm(&self.vm_fd).map_err(SnapshotError::from)?;
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        let mut msrs = None;
        for (id, slot) in self.vcpus.iter().enumerate() {
            let fd = slot.lock().unwrap_or_else(|p| p.into_inner());
            let list = match &msrs {
                Some(l) => l,
                None => {
                    msrs.insert(arch_state::readable_msrs(&kvm, &fd).map_err(SnapshotError::from)?)
                }
            };
            vcpus.push(arch_state::save_vcpu(&fd, id, list).map_err(SnapshotError::from)?);
        }
        tracing::info!(vm = %self.shared.name, vcpus = vcpus.len(), devices = devices.len(), "VM state saved");
        Ok(VmSnapshot {
            version: SNAPSHOT_VERSION,
            name: self.shared.name.clone(),
            memory_bytes: self.ram.size(),
            vcpus,
            vm,
            serial,
            devices,
        })
    }

    /// Writes guest RAM to `out` as a raw image (every region in address
    /// order). Consistent only while paused; while running it is the
    /// first pass of a pre-copy (read [`Vm::dirty_pages`] before it).
    pub fn save_memory(&self, out: &mut dyn Write) -> Result<()> {
        let mut buf = vec![0u8; CHUNK];
        for region in self.ram.mem.iter() {
            let start = region.start_addr().0;
            let mut off = 0u64;
            while off < region.len() {
                let n = (region.len() - off).min(CHUNK as u64) as usize;
                let addr = start + off;
                self.ram
                    .mem
                    .read_slice(&mut buf[..n], GuestAddress(addr))
                    .map_err(|source| SnapshotError::GuestMemory { addr, source })?;
                out.write_all(&buf[..n])
                    .map_err(|source| SnapshotError::MemoryIo {
                        op: "write",
                        source,
                    })?;
                off += n as u64;
            }
        }
        Ok(())
    }

    /// Saves a paused VM into `dir` (created if missing, mode 0700):
    /// [`STATE_FILE`] and [`MEMORY_FILE`], both mode 0600. Pages of zeros
    /// are left as holes in the image.
    pub fn save_to_dir(&self, dir: &Path) -> Result<()> {
        let snapshot = self.snapshot_state()?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| SnapshotError::File {
                op: "create directory",
                path: dir.to_path_buf(),
                source,
            })?;
        let mem_path = dir.join(MEMORY_FILE);
        write_file(&mem_path, |f| self.save_memory_sparse(f))?;
        let json = snapshot.to_json()?;
        let state_path = dir.join(STATE_FILE);
        write_file(&state_path, |f| {
            f.write_all(&json).map_err(|source| SnapshotError::File {
                op: "write",
                path: state_path.clone(),
                source,
            })
        })?;
        tracing::info!(vm = %self.shared.name, dir = %dir.display(), "VM saved");
        Ok(())
    }

    /// Like [`Vm::save_memory`] into a file, seeking over zero pages.
    fn save_memory_sparse(&self, f: &mut File) -> std::result::Result<(), SnapshotError> {
        let io = |source| SnapshotError::MemoryIo {
            op: "write",
            source,
        };
        let mut buf = vec![0u8; CHUNK];
        let mut pos = 0u64;
        for region in self.ram.mem.iter() {
            let start = region.start_addr().0;
            let mut off = 0u64;
            while off < region.len() {
                let n = (region.len() - off).min(CHUNK as u64) as usize;
                let addr = start + off;
                self.ram
                    .mem
                    .read_slice(&mut buf[..n], GuestAddress(addr))
                    .map_err(|source| SnapshotError::GuestMemory { addr, source })?;
                for page in buf[..n].chunks(4096) {
                    if page.iter().any(|&b| b != 0) {
                        f.seek(SeekFrom::Start(pos)).map_err(io)?;
                        f.write_all(page).map_err(io)?;
                    }
                    pos += page.len() as u64;
                }
                off += n as u64;
            }
        }
        f.set_len(pos).map_err(io)
    }
}

/// Writes `path` through a temporary file (mode 0600) renamed into place.
fn write_file(
    path: &Path,
    fill: impl FnOnce(&mut File) -> std::result::Result<(), SnapshotError>,
) -> std::result::Result<(), SnapshotError> {
    let file_err = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| SnapshotError::File { op, path, source }
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(file_err("remove", &tmp)(e)),
    }
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(file_err("create", &tmp))?;
    fill(&mut f)?;
    f.sync_all().map_err(file_err("sync", &tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(file_err("rename into place", path))
}

impl VmBuilder {
    /// Builds a VM from this builder's config and backends (the same the
    /// saved VM had) and loads `snapshot` and the RAM image `memory` into
    /// it instead of booting. The VM is returned created; [`Vm::start`]
    /// continues the guest where it was paused.
    ///
    /// Refused, before memory is read: another format version, another
    /// vCPU count or RAM size, another device list (names, kinds, disk
    /// sizes, MAC addresses). A RAM image shorter or longer than RAM is
    /// refused too.
    pub fn restore(self, snapshot: &VmSnapshot, memory: &mut dyn Read) -> Result<Vm> {
        check_version(snapshot.version)?;
        let vm = Vm::build(self, Boot::Restore)?;
        vm.check_matches(snapshot)?;
        vm.load_memory(memory)?;
        vm.load_state(snapshot)?;
        tracing::info!(vm = %vm.shared.name, "VM restored from a snapshot");
        Ok(vm)
    }

    /// [`VmBuilder::restore`] from a directory written by [`Vm::save_to_dir`].
    pub fn restore_from_dir(self, dir: &Path) -> Result<Vm> {
        let state_path = dir.join(STATE_FILE);
        let snapshot = read_state(&state_path)?;
        let mem_path = dir.join(MEMORY_FILE);
        let f = File::open(&mem_path).map_err(|source| SnapshotError::File {
            op: "open",
            path: mem_path.clone(),
            source,
        })?;
        let len = f
            .metadata()
            .map_err(|source| SnapshotError::File {
                op: "stat",
                path: mem_path.clone(),
                source,
            })?
            .len();
        if len < snapshot.memory_bytes {
            return Err(SnapshotError::MemoryTruncated {
                read: len,
                expected: snapshot.memory_bytes,
            }
            .into());
        }
        self.restore(&snapshot, &mut io::BufReader::with_capacity(CHUNK, f))
    }
}

fn read_state(path: &Path) -> std::result::Result<VmSnapshot, SnapshotError> {
    let file_err = |op| {
        let path = path.to_path_buf();
        move |source| SnapshotError::File { op, path, source }
    };
    let f = File::open(path).map_err(file_err("open"))?;
    let size = f.metadata().map_err(file_err("stat"))?.len();
    if size > MAX_STATE_BYTES {
        return Err(SnapshotError::StateTooLarge {
            path: path.to_path_buf(),
            size,
            max: MAX_STATE_BYTES,
        });
    }
    let mut data = Vec::with_capacity(size as usize);
    f.take(MAX_STATE_BYTES)
        .read_to_end(&mut data)
        .map_err(file_err("read"))?;
    VmSnapshot::from_json(&data)
}

impl Vm {
    /// [`VmBuilder::restore`] for a config without run-time backends.
    pub fn restore(config: VmConfig, snapshot: &VmSnapshot, memory: &mut dyn Read) -> Result<Vm> {
        Vm::builder(config).restore(snapshot, memory)
    }

    /// [`VmBuilder::restore_from_dir`] for a config without run-time backends.
    pub fn restore_from_dir(config: VmConfig, dir: &Path) -> Result<Vm> {
        Vm::builder(config).restore_from_dir(dir)
    }

    fn check_matches(&self, s: &VmSnapshot) -> std::result::Result<(), SnapshotError> {
        let mismatch = |what, snapshot: String, config: String| {
            Err(SnapshotError::Mismatch {
                what,
                snapshot,
                config,
            })
        };
        if s.vcpus.len() != self.vcpus.len() {
            return mismatch(
                "vCPU count",
                s.vcpus.len().to_string(),
                self.vcpus.len().to_string(),
            );
        }
        if s.memory_bytes != self.ram.size() {
            return mismatch(
                "memory size (bytes)",
                s.memory_bytes.to_string(),
                self.ram.size().to_string(),
            );
        }
        let names = |v: &mut dyn Iterator<Item = String>| v.collect::<Vec<_>>().join(", ");
        let saved = names(&mut s.devices.iter().map(|d| d.name.clone()));
        let mine = names(&mut self.transports.iter().map(|t| {
            t.lock()
                .unwrap_or_else(|p| p.into_inner())
                .name()
                .to_string()
        }));
        if saved != mine {
            return mismatch("devices", format!("[{saved}]"), format!("[{mine}]"));
        }
        Ok(())
    }

    fn load_memory(&self, memory: &mut dyn Read) -> std::result::Result<(), SnapshotError> {
        let expected = self.ram.size();
        let mut buf = vec![0u8; CHUNK];
        let mut read = 0u64;
        for region in self.ram.mem.iter() {
            let start = region.start_addr().0;
            let mut off = 0u64;
            while off < region.len() {
                let n = (region.len() - off).min(CHUNK as u64) as usize;
                let got = read_full(memory, &mut buf[..n])
                    .map_err(|source| SnapshotError::MemoryIo { op: "read", source })?;
                read += got as u64;
                if got < n {
                    return Err(SnapshotError::MemoryTruncated { read, expected });
                }
                let addr = start + off;
                self.ram
                    .mem
                    .write_slice(&buf[..n], GuestAddress(addr))
                    .map_err(|source| SnapshotError::GuestMemory { addr, source })?;
                off += n as u64;
            }
        }
        let mut extra = [0u8; 1];
        if read_full(memory, &mut extra)
            .map_err(|source| SnapshotError::MemoryIo { op: "read", source })?
            != 0
        {
            return Err(SnapshotError::MemoryTooLong { expected });
        }
        Ok(())
    }

    fn load_state(&self, s: &VmSnapshot) -> std::result::Result<(), SnapshotError> {
        arch_state::check_xsave(&self.vm_fd)?;
        // The interrupt controllers first: devices may raise lines on load.
        arch_state::restore_vm(&self.vm_fd, &s.vm)?;
        for (id, (slot, state)) in self.vcpus.iter().zip(&s.vcpus).enumerate() {
            let fd = slot.lock().unwrap_or_else(|p| p.into_inner());
            arch_state::restore_vcpu(&fd, id, state)?;
        }
        self.serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .restore_state(&s.serial)
            .map_err(device_err("serial"))?;
        for (t, state) in self.transports.iter().zip(&s.devices) {
            let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
            t.restore_state(state)
                .map_err(|e| device_err(&state.name)(e.to_string()))?;
        }
        for t in &self.transports {
            t.lock()
                .unwrap_or_else(|p| p.into_inner())
                .wake_after_restore();
        }
        Ok(())
    }
}

/// Reads until `buf` is full or the input ends; returns the bytes read.
fn read_full(r: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Hooks for live migration (`crate::migration`).
impl Vm {
    pub(crate) fn guest_memory(&self) -> &crate::memory::GuestMemory {
        &self.ram.mem
    }

    pub(crate) fn ram_size(&self) -> u64 {
        self.ram.size()
    }

    pub(crate) fn vcpu_count(&self) -> usize {
        self.vcpus.len()
    }

    pub(crate) fn tracks_dirty_pages(&self) -> bool {
        self.ram.dirty_logging
    }

    /// Holds every vCPU out of the guest (`true`) or lets them run again
    /// (`false`) without a state change or event: auto-converge throttling
    /// of a running VM. Returns whether the vCPUs are held.
    pub(crate) fn hold_vcpus(&self, hold: bool) -> bool {
        use crate::vcpu::Desired;
        let control = &self.shared.control;
        if !hold {
            if control.desired() == Desired::Pause && self.state() == VmState::Running {
                control.set(Desired::Run);
            }
            return false;
        }
        if control.desired() != Desired::Run || self.state() != VmState::Running {
            return false;
        }
        control.set(Desired::Pause);
        self.shared.kick_vcpus();
        if control.wait_parked(self.vcpus.len(), std::time::Duration::from_secs(1)) {
            return true;
        }
        if control.desired() == Desired::Pause {
            control.set(Desired::Run);
        }
        false
    }

    /// Loads a migrated state into a VM built by
    /// [`VmBuilder::create_for_migration`] whose RAM was already written.
    pub(crate) fn load_migrated_state(&self, s: &VmSnapshot) -> Result<()> {
        check_version(s.version)?;
        self.check_matches(s)?;
        self.load_state(s)?;
        Ok(())
    }
}

impl VmBuilder {
    /// Builds the VM without booting it (RAM and state come from a peer).
    pub(crate) fn create_for_migration(self) -> Result<Vm> {
        Vm::build(self, Boot::Restore)
    }
}
