// SPDX-License-Identifier: Apache-2.0
//! VM runtimes: how a launcher runs one VM.
//!
//! ```text
//!   launcher ── attaches volumes (blockrepl engine, epoch from the control plane)
//!      │           └─ AttachedDisk { Volume(Disk) } per volume, { File } per seed
//!      └─ VmRuntime::start(VmSpec, disks, ctx) ─► RunningVm (wait / stop)
//!           ├─ VmmRuntime   sheaf-vmm in this process; disks via the in-process
//!           │               virtio-blk BlockBackend (blockrepl frontend::vmm)
//!           └─ QemuRuntime  qemu-system-x86_64 (KVM or TCG); disks over NBD
//!                           (blockrepl frontend::nbd on a unix socket)
//! ```
//!
//! A runtime never talks to the store or the replicas directly: the
//! launcher owns the volume engines and hands the runtime block devices, so
//! every runtime gets the same fencing and durability (a write the guest
//! sees completed is on `W` replicas). vhost-user-blk (blockrepl
//! `frontend::vhost_user`) is the next QEMU disk path; it needs shared
//! memory (`memory-backend-memfd`), so it is a per-runtime option later.

mod console;
mod late;
pub mod qemu;
pub mod vmm;

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sheaf_blockrepl::frontend::Disk;

pub use self::console::{ConsoleLog, DEFAULT_CONSOLE_LOG_BYTES};
pub use self::qemu::QemuRuntime;
pub use self::vmm::VmmRuntime;

/// The machine a VM runs, independent of the runtime.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct VmSpec {
    /// Name (thread names, logs).
    pub name: String,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Kernel (ELF or bzImage).
    pub kernel: PathBuf,
    /// Optional initramfs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initramfs: Option<PathBuf>,
    /// Kernel command line.
    #[serde(default)]
    pub cmdline: String,
    /// Boot the kernel and initramfs inside this guest disk (index in the
    /// guest's disk order) instead of `kernel` (sheaf-vmm's disk boot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_disk: Option<usize>,
    /// Network cards, each on a tap the agent made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nets: Vec<VmNet>,
}

/// One virtio-net card.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VmNet {
    /// Interface name in the instance spec.
    pub name: String,
    /// The tap (on the node's pod bridge).
    pub tap: String,
    /// The guest's MAC (`02:..`).
    pub mac: String,
    /// The address the node's DHCP server gives that MAC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<std::net::Ipv4Addr>,
}

/// What a guest disk reads and writes.
#[derive(Debug, Clone)]
pub enum DiskBacking {
    /// A volume the launcher attached (replicated, fenced).
    Volume(Disk),
    /// A raw image file on the node (a cloud-init seed).
    File(PathBuf),
    /// A volume of an incoming live migration, attached only at the
    /// switch-over (see [`DeferredVolume`]).
    Deferred(Arc<DeferredVolume>),
}

/// A volume the target of a live migration attaches only once the source
/// has committed (its guest paused for good, its I/O drained): attaching
/// takes the volume's write lease at a new epoch, which fences the source's
/// engine, so it must not happen while the source still runs the guest.
/// Until [`DeferredVolume::fill`] the guest's disk has the source's size
/// and fails every request (the target's vCPUs do not run before it).
#[derive(Debug)]
pub struct DeferredVolume {
    size: u64,
    disk: std::sync::OnceLock<Disk>,
}

impl DeferredVolume {
    /// A volume of `size` bytes (what the source's guest sees).
    pub fn new(size: u64) -> Arc<Self> {
        Arc::new(DeferredVolume {
            size,
            disk: std::sync::OnceLock::new(),
        })
    }

    /// The size the guest sees.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Hands over the attached engine; refused if its size differs from
    /// the source's or it was already filled.
    pub fn fill(&self, disk: Disk) -> Result<(), String> {
        if disk.size() != self.size {
            return Err(format!(
                "the attached volume has {} bytes, the migrated guest's disk {}",
                disk.size(),
                self.size
            ));
        }
        self.disk
            .set(disk)
            .map_err(|_| "the volume was already attached".to_string())
    }

    /// The engine, once attached.
    pub fn get(&self) -> Option<&Disk> {
        self.disk.get()
    }
}

/// A disk offered to the guest: a volume attached by the launcher, or a
/// file on the node.
#[derive(Debug, Clone)]
pub struct AttachedDisk {
    /// Disk name from the instance spec (also the NBD export name).
    pub name: String,
    /// Serial number the guest sees (virtio-blk GET_ID, ≤ 20 bytes).
    pub serial: String,
    /// The data.
    pub disk: DiskBacking,
    /// Offer it read-only.
    pub read_only: bool,
    /// Guest I/O latency of this disk, kept by runtimes that time their
    /// requests (sheaf-vmm); see [`VmRuntime::times_disk_io`].
    pub io_stats: Arc<crate::launcher::metrics::DiskIoStats>,
}

/// What a runtime gets besides the spec and the disks.
#[derive(Debug, Clone)]
pub struct RuntimeContext {
    /// The runtime the volume engines run on (block I/O is driven on it).
    pub io: tokio::runtime::Handle,
    /// The launcher's private directory (sockets, logs).
    pub work_dir: PathBuf,
    /// The console sink.
    pub console: ConsoleLog,
}

/// How a VM ended.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct VmExit {
    /// A clean end (guest powered off, probe passed): the instance Succeeded.
    pub success: bool,
    /// Human-readable reason (`Shutdown`, `DebugExit { code: 49 }`, `killed`, ...).
    pub reason: String,
}

/// Runtime failures (before or while starting).
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The spec cannot run on this runtime.
    #[error("invalid VM spec: {0}")]
    Config(String),
    /// sheaf-vmm refused or failed.
    #[error("sheaf-vmm: {0}")]
    Vmm(#[from] sheaf_vmm::Error),
    /// A helper process did not start.
    #[error("starting {program}: {source}")]
    Spawn {
        /// Program.
        program: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The runtime cannot do this (e.g. pause without a QMP socket).
    #[error("not supported by the {runtime} runtime: {what}")]
    Unsupported {
        /// Runtime name.
        runtime: &'static str,
        /// What was asked.
        what: String,
    },
    /// Talking to the running VM (QMP, serial input) failed.
    #[error("{op}: {message}")]
    Control {
        /// What was being done.
        op: &'static str,
        /// Why.
        message: String,
    },
    /// Serving a disk failed.
    #[error("disk {disk}: {message}")]
    Disk {
        /// Disk name.
        disk: String,
        /// Why.
        message: String,
    },
}

/// A VM runtime (the port the launcher consumes).
///
/// `start` returns once the guest was started (not booted); the launcher
/// then calls [`RunningVm::wait_timeout`] in a loop. Runtimes must not block
/// the `io` runtime's threads.
pub trait VmRuntime: Send + Sync + fmt::Debug {
    /// Name reported to the control plane (`sheaf-vmm`, `qemu`).
    fn name(&self) -> &'static str;
    /// Whether the runtime records guest I/O in [`AttachedDisk::io_stats`].
    fn times_disk_io(&self) -> bool {
        false
    }
    /// Starts the VM.
    fn start(
        &self,
        spec: &VmSpec,
        disks: Vec<AttachedDisk>,
        ctx: &RuntimeContext,
    ) -> Result<Box<dyn RunningVm>, RuntimeError>;
    /// Receives a VM live-migrated by [`RunningVm::migrate`] over `conn`
    /// and returns it running; `cfg.before_start` runs at the switch-over.
    /// Volumes come as [`DiskBacking::Deferred`].
    fn receive_migration(
        &self,
        spec: &VmSpec,
        disks: Vec<AttachedDisk>,
        ctx: &RuntimeContext,
        conn: std::net::TcpStream,
        cfg: &sheaf_vmm::MigrationConfig,
    ) -> Result<Box<dyn RunningVm>, RuntimeError> {
        let _ = (spec, disks, ctx, conn, cfg);
        Err(RuntimeError::Unsupported {
            runtime: self.name(),
            what: "receiving a live migration".into(),
        })
    }
}

/// Types bytes into a guest's serial input; blocks until every byte was
/// taken (the UART drains as the guest reads) or fails.
pub type ConsoleInput = Arc<dyn Fn(&[u8]) -> Result<(), RuntimeError> + Send + Sync>;

/// A started VM.
pub trait RunningVm: Send + fmt::Debug {
    /// Waits up to `timeout` for the VM to end.
    fn wait_timeout(&mut self, timeout: Duration) -> Option<VmExit>;
    /// Stops the VM now (no guest cooperation) and returns how it ended.
    fn stop(&mut self) -> VmExit;
    /// Pauses the guest's vCPUs (returns once they stopped).
    fn pause(&mut self) -> Result<(), RuntimeError>;
    /// Resumes a paused guest.
    fn resume(&mut self) -> Result<(), RuntimeError>;
    /// The guest's serial input, if the runtime has one.
    fn console_input(&self) -> Option<ConsoleInput>;
    /// Live-migrates the guest to a target listening at the other end of
    /// `conn` ([`VmRuntime::receive_migration`]). `Ok`: the guest runs on
    /// the target and stopped here. On error the guest runs here as
    /// before, except after an in-doubt commit (it stays paused; see
    /// [`sheaf_vmm::MigrationError::InDoubt`]).
    fn migrate(
        &mut self,
        conn: std::net::TcpStream,
        cfg: &sheaf_vmm::MigrationConfig,
    ) -> Result<sheaf_vmm::MigrationReport, RuntimeError>;
}

/// The runtime called `name`.
pub fn by_name(name: &str) -> Option<Box<dyn VmRuntime>> {
    match name {
        "sheaf-vmm" => Some(Box::new(VmmRuntime)),
        "qemu" => Some(Box::new(QemuRuntime::default())),
        _ => None,
    }
}
