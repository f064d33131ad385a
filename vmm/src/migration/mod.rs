// SPDX-License-Identifier: Apache-2.0
//! Pre-copy live migration of a running VM over an authenticated,
//! encrypted TCP connection ([`transport`]).
//!
//! ```text
//!  source (Vm::migrate)                          target (VmBuilder::receive_migration)
//!   handshake (PSK, nonces) ─────────────────────► handshake; build the VM (not started)
//!   Hello ───────────────────────────────────────► check RAM size and vCPUs
//!                           ◄───────────────────── HelloAck
//!   clear dirty log; pass 0: all RAM (running) ──► pages straight into guest RAM
//!   pass 1..n: dirty pages (running, throttled   ► …
//!     when not converging) until they fit the
//!     downtime budget
//!   pause; drain I/O; last dirty pages ─────────► pages
//!     VmSnapshot ────────────────────────────────► load the state
//!                           ◄───────────────────── Ready
//!   Commit (never resumes after this) ───────────► start the vCPUs
//!                           ◄───────────────────── Running
//!   stop for good
//! ```
//!
//! "Dirty" is KVM's log of vCPU writes ∪ vm-memory's dirty bitmap of the
//! VMM's own writes into guest RAM (virtio devices; see [`crate::memory`]),
//! both read and cleared at the end of every pass and before pass 0.
//!
//! Failure semantics: before `Commit` is sent, any failure resumes the
//! source (if it was running) and returns [`MigrationError::Failed`] naming
//! the phase; the target only starts after it received and loaded the
//! complete state *and* the `Commit`, so it never runs a guest the source
//! still runs. A failure after `Commit` was sent and before `Running`
//! arrived leaves the source **paused** ([`MigrationError::InDoubt`]): the
//! target may or may not run, and the embedder, who can ask it, decides
//! (never two running copies; at worst none until then).
//!
//! ```no_run
//! use std::net::{TcpListener, TcpStream};
//! use sheaf_vmm::{MigrationConfig, Vm, VmConfig};
//!
//! let config = || {
//!     VmConfig::builder()
//!         .kernel("vmlinux")
//!         .disk("/shared/disk.img")
//!         .track_dirty_pages(true)
//!         .build()
//! };
//! let cfg = MigrationConfig::new([7; 32]); // a real key comes from a secret store
//! // Target host:
//! let listener = TcpListener::bind("0.0.0.0:7400")?;
//! let (conn, _) = listener.accept()?;
//! let target = Vm::builder(config()?).receive_migration(conn, &cfg)?;
//! // Source host (a running `vm`):
//! # let vm = Vm::new(config()?)?;
//! let report = vm.migrate(TcpStream::connect("target:7400")?, &cfg)?;
//! println!("{} passes, downtime {:?}", report.iterations(), report.downtime);
//! # drop(target);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod dirty;
mod precopy;
mod target;
pub mod transport;
pub mod wire;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub use transport::TransportError;

/// A progress callback ([`MigrationConfig::progress`]); it runs on the
/// migrating thread, so keep it short.
pub type ProgressFn = Arc<dyn Fn(&Progress) + Send + Sync>;

/// A hook the target runs after the source committed and before the vCPUs
/// start ([`MigrationConfig::before_start`]); an `Err` aborts the
/// migration (the source is told and resumes) with that message.
pub type BeforeStartFn = Arc<dyn Fn() -> std::result::Result<(), String> + Send + Sync>;

/// Settings of one migration (both sides use the same `key`).
#[derive(Clone)]
pub struct MigrationConfig {
    /// Pre-shared 32-byte key both sides hold.
    pub key: [u8; 32],
    /// Longest acceptable pause of the guest (pause → target running),
    /// used to decide when the dirty set is small enough. Default 300 ms.
    pub downtime_budget: Duration,
    /// Dirty-page passes after pass 0 before auto-converge starts. Default 30.
    pub max_iterations: u32,
    /// Send rate cap in bytes per second; `None` for no cap.
    pub bandwidth_limit: Option<u64>,
    /// Whether to throttle vCPUs when the dirty set does not shrink. Default true.
    pub auto_converge: bool,
    /// Timeout of every read and write on the connection. Default 30 s.
    pub io_timeout: Duration,
    /// Called at each phase change and after every pass (progress reporting).
    pub progress: Option<ProgressFn>,
    /// Target only: runs once the source has committed (its guest is
    /// paused for good and its I/O drained) and before this VM starts, the
    /// place to take over resources only one side may hold (a volume's
    /// write lease at a new epoch). An error makes the target refuse: it
    /// tells the source, which resumes, and the target does not start.
    pub before_start: Option<BeforeStartFn>,
}

impl MigrationConfig {
    /// Defaults with `key`.
    pub fn new(key: [u8; 32]) -> Self {
        MigrationConfig {
            key,
            downtime_budget: Duration::from_millis(300),
            max_iterations: 30,
            bandwidth_limit: None,
            auto_converge: true,
            io_timeout: Duration::from_secs(30),
            progress: None,
            before_start: None,
        }
    }

    pub(crate) fn notify(&self, p: Progress) {
        if let Some(f) = &self.progress {
            f(&p);
        }
    }

    pub(crate) fn validate(&self) -> Result<(), MigrationError> {
        if self.bandwidth_limit == Some(0) {
            return Err(MigrationError::Config(
                "bandwidth_limit must be above 0 bytes/s (None for no limit)".into(),
            ));
        }
        if self.io_timeout.is_zero() {
            return Err(MigrationError::Config("io_timeout must be above 0".into()));
        }
        Ok(())
    }
}

impl fmt::Debug for MigrationConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MigrationConfig")
            .field("key", &"<redacted>")
            .field("downtime_budget", &self.downtime_budget)
            .field("max_iterations", &self.max_iterations)
            .field("bandwidth_limit", &self.bandwidth_limit)
            .field("auto_converge", &self.auto_converge)
            .field("io_timeout", &self.io_timeout)
            .field("progress", &self.progress.is_some())
            .field("before_start", &self.before_start.is_some())
            .finish()
    }
}

/// A phase of a migration, as named in errors and progress reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Key exchange and Hello.
    Handshake,
    /// Sending RAM while the guest runs (pass 0: all of it).
    Precopy {
        /// Pass number.
        pass: u32,
    },
    /// Guest paused: last dirty pages and the device state.
    StopAndCopy,
    /// Waiting for the target to report the state loaded.
    AwaitReady,
    /// Commit sent, waiting for the target to run.
    AwaitRunning,
    /// Target side: receiving the VM.
    Receive,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::Handshake => f.write_str("the handshake"),
            Phase::Precopy { pass } => write!(f, "pre-copy pass {pass}"),
            Phase::StopAndCopy => f.write_str("stop-and-copy (guest paused)"),
            Phase::AwaitReady => f.write_str("waiting for the target to load the state"),
            Phase::AwaitRunning => f.write_str("waiting for the target to run"),
            Phase::Receive => f.write_str("receiving the VM"),
        }
    }
}

/// A progress report passed to [`MigrationConfig::progress`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Progress {
    /// A phase starts.
    Phase(Phase),
    /// A pass ended.
    Pass(PassReport),
}

/// One pass over guest RAM.
#[derive(Debug, Clone, PartialEq)]
pub struct PassReport {
    /// 0 for the full copy, then 1, 2, …; the last is the stop-and-copy.
    pub pass: u32,
    /// Pages sent.
    pub pages: u64,
    /// Of which all zeros (sent as 8-byte records).
    pub zero_pages: u64,
    /// Bytes written to the connection (frames, headers and tags).
    pub bytes: u64,
    /// How long the pass took.
    pub duration: Duration,
    /// Pages the guest dirtied during the pass (the next pass's work).
    pub dirtied: u64,
    /// Share of each interval the vCPUs were held paused (auto-converge), in percent.
    pub throttle_percent: u8,
    /// Whether this was the stop-and-copy pass (guest paused).
    pub final_pass: bool,
}

/// What a successful migration did.
#[derive(Debug, Clone, PartialEq)]
pub struct MigrationReport {
    /// Every pass, in order (the last is the stop-and-copy).
    pub passes: Vec<PassReport>,
    /// From the start of [`crate::Vm::migrate`] to the target's `Running`.
    pub total_time: Duration,
    /// Guest paused on the source until the target's `Running` arrived.
    pub downtime: Duration,
    /// Whether the dirty set fitted the downtime budget (false: the
    /// iteration limits forced the stop-and-copy).
    pub converged: bool,
    /// Highest auto-converge throttle used, in percent (0: none).
    pub max_throttle_percent: u8,
    /// Last measured link rate, bytes per second.
    pub link_bytes_per_sec: u64,
    /// Bytes of the device state sent.
    pub state_bytes: u64,
    /// Everything written to the connection.
    pub total_bytes: u64,
}

impl MigrationReport {
    /// Passes made, the stop-and-copy included.
    pub fn iterations(&self) -> usize {
        self.passes.len()
    }
}

fn source_note(running: bool) -> &'static str {
    if running {
        "the source VM keeps running"
    } else {
        "the source VM is not running"
    }
}

/// Errors of a migration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrationError {
    /// The migration failed during `phase`; the source VM was resumed (if
    /// it was running) and the target did not start.
    #[error("live migration failed during {phase}; {}", source_note(*.source_running))]
    Failed {
        /// Where it failed.
        phase: Phase,
        /// Whether the source VM runs (false only if it was paused or
        /// stopped before, or could not be resumed).
        source_running: bool,
        /// Why.
        #[source]
        cause: Box<crate::Error>,
    },
    /// `Commit` was sent but `Running` never arrived: the target may run.
    /// The source stays paused; resume it only once the target is known
    /// not to run.
    #[error("the target did not confirm it runs after the commit; the source VM stays paused")]
    InDoubt {
        /// Why the confirmation is missing.
        #[source]
        cause: Box<crate::Error>,
    },
    /// Receiving a migration failed; the target VM was not started.
    #[error("receiving the migrated VM failed; the target VM was not started")]
    ReceiveFailed {
        /// Why.
        #[source]
        cause: Box<crate::Error>,
    },
    /// The link failed.
    #[error("migration transport")]
    Transport(#[from] TransportError),
    /// The peer sent something the protocol does not allow here.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The peer gave up and said why.
    #[error("the peer aborted the migration: {0}")]
    PeerAborted(String),
    /// A page record names an address outside guest RAM or not page aligned.
    #[error("a page record names guest address {gpa:#x}, not a page of guest RAM")]
    PageOutOfRange {
        /// The address.
        gpa: u64,
    },
    /// Source and target VMs do not have the same shape.
    #[error("the source VM has {what} {source_value}, the target {target_value}")]
    Mismatch {
        /// What differs.
        what: &'static str,
        /// Source value.
        source_value: String,
        /// Target value.
        target_value: String,
    },
    /// The target's [`MigrationConfig::before_start`] hook refused.
    #[error("the target refused to start the VM: {0}")]
    StartRefused(String),
    /// The settings are invalid.
    #[error("invalid migration config: {0}")]
    Config(String),
    /// The VM cannot be migrated as configured.
    #[error("cannot migrate: {0}")]
    Unsupported(&'static str),
}
