// SPDX-License-Identifier: Apache-2.0
//! The launcher (KubeVirt's virt-launcher): one process per VM, started by
//! the node agent, that attaches the VM's volumes through the blockrepl
//! engine with the epoch the control plane granted, runs the VM through a
//! [`VmRuntime`](crate::runtime::VmRuntime), and reports its status.
//!
//! ```text
//!   <node>/launchers/<vmi-uid>/
//!     spec.json      LaunchSpec written by the agent
//!     control.sock   the agent connects: status lines out, commands in
//!     status.json    last status, rewritten atomically on every change
//!     console.log    the guest's serial console
//!     console.sock   bytes written here go to the guest's serial input
//!     launcher.log   the launcher's own log
//!     io-metrics.json guest I/O latency histograms per disk (see [`metrics`])
//! ```
//!
//! The launcher is independent of the agent: it keeps running when the
//! agent restarts, and the new agent reconnects through `control.sock`
//! (or reads `status.json` if the launcher is gone). The same binary also
//! serves replica stores for the agent (`sheaf-launcher replica`), one
//! process per replica like Longhorn's replica processes.

pub mod metrics;
mod migrate;
pub mod protocol;
mod run;

pub use protocol::{
    DiskStatus, IncomingSpec, LaunchDisk, LaunchFileDisk, LaunchSpec, LauncherCommand,
    LauncherMigration, LauncherPhase, LauncherStatus, MigrateCommand, MigrationProgress,
    MigrationRole, migration_key,
};
pub use run::{LauncherError, ReplicaArgs, connect, run_replica, run_vm};

/// File names inside a launcher directory.
pub mod files {
    /// The launch spec.
    pub const SPEC: &str = "spec.json";
    /// The control socket.
    pub const CONTROL: &str = "control.sock";
    /// The last status.
    pub const STATUS: &str = "status.json";
    /// The guest console.
    pub const CONSOLE: &str = "console.log";
    /// The guest's serial input (a unix stream socket; every byte a client
    /// writes is typed into the guest's serial port).
    pub const CONSOLE_INPUT: &str = "console.sock";
    /// The launcher's log.
    pub const LOG: &str = "launcher.log";
    /// Guest I/O latency histograms ([`super::metrics::IoMetrics`]).
    pub const IO_METRICS: &str = "io-metrics.json";
}
