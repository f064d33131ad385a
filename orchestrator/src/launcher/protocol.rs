// SPDX-License-Identifier: Apache-2.0
//! What the agent and a launcher exchange: the launch spec (a file), status
//! snapshots (JSON lines from the launcher, the latest one wins) and
//! commands (JSON lines from the agent).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::runtime::{VmExit, VmSpec};

/// Everything a launcher needs to run one instance.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LaunchSpec {
    /// `namespace/name` of the instance.
    pub instance: String,
    /// Uid of the instance.
    pub uid: String,
    /// Runtime name (`sheaf-vmm`, `qemu`).
    pub runtime: String,
    /// The machine.
    pub vm: VmSpec,
    /// Volumes, in guest disk order.
    #[serde(default)]
    pub disks: Vec<LaunchDisk>,
    /// Plain files the agent made (cloud-init seeds), each placed at its
    /// `position` among all the guest's disks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub file_disks: Vec<LaunchFileDisk>,
    /// The replication secret (needed when any disk has replicas).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// The launcher's directory (see [`super::files`]).
    pub dir: PathBuf,
    /// Receive the VM from a live migration instead of booting it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incoming: Option<IncomingSpec>,
}

/// How a live-migration target launcher waits for its source.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IncomingSpec {
    /// Where to listen (port 0: any); reported in
    /// [`LauncherMigration::address`] once bound.
    pub listen: SocketAddr,
    /// Uid of the migration: both sides derive the link key from it and
    /// the replication secret.
    pub migration_uid: String,
    /// Give up when no source connected for this long.
    #[serde(default = "default_accept_timeout")]
    pub accept_timeout_secs: u64,
}

fn default_accept_timeout() -> u64 {
    120
}

/// The link key of migration `uid`, derived from the replication secret.
pub fn migration_key(secret: &sheaf_blockrepl::net::Secret, uid: &str) -> [u8; 32] {
    secret.derive_key(format!("sheaf-live-migration/{uid}").as_bytes())
}

/// One volume to attach.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LaunchDisk {
    /// Disk name in the instance spec.
    pub name: String,
    /// `namespace/name` of the sheaf Volume.
    pub volume: String,
    /// Serial the guest sees.
    pub serial: String,
    /// Replica servers, in the volume's status order.
    pub replicas: Vec<SocketAddr>,
    /// The epoch granted by the control plane; the engine takes at least it.
    pub epoch: u64,
    /// `W` (default `min(2, N)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_write_replicas: Option<usize>,
    /// Offer read-only.
    #[serde(default)]
    pub read_only: bool,
    /// Size in bytes (what a migration target offers before it attaches).
    #[serde(default)]
    pub size_bytes: u64,
}

/// A host file to attach as a disk (a cloud-init seed image).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LaunchFileDisk {
    /// Disk name in the instance spec.
    pub name: String,
    /// The image file (raw).
    pub path: PathBuf,
    /// Serial the guest sees.
    pub serial: String,
    /// Offer read-only.
    #[serde(default)]
    pub read_only: bool,
    /// Index among all the guest's disks (`devices.disks` order); the
    /// volumes fill the other places in their order.
    pub position: usize,
}

/// Lifecycle of a launcher.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LauncherPhase {
    /// Attaching volumes, starting the VM.
    Starting,
    /// The guest runs.
    Running,
    /// Stopping on request.
    Stopping,
    /// Done; `exit` says how.
    Exited,
}

/// One attached volume as the launcher's engine sees it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DiskStatus {
    /// Disk name.
    pub name: String,
    /// `namespace/name` of the Volume.
    pub volume: String,
    /// Epoch the engine holds.
    pub epoch: u64,
    /// Replicas in sync (addresses).
    #[serde(default)]
    pub active: Vec<SocketAddr>,
    /// Replicas being rebuilt (addresses).
    #[serde(default)]
    pub rebuilding: Vec<SocketAddr>,
    /// A newer engine took over: the VM was stopped.
    #[serde(default)]
    pub fenced: bool,
}

/// A status snapshot.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LauncherStatus {
    /// Launcher process id.
    pub pid: u32,
    /// Instance uid.
    pub uid: String,
    /// Runtime used.
    pub runtime: String,
    /// Phase.
    pub phase: LauncherPhase,
    /// Attached volumes.
    #[serde(default)]
    pub disks: Vec<DiskStatus>,
    /// How the VM ended (phase `Exited`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<VmExit>,
    /// The guest's vCPUs are paused (phase stays `Running`).
    #[serde(default)]
    pub paused: bool,
    /// Commands handled so far: a client that sent one waits for this to
    /// grow, then reads `command_error`.
    #[serde(default)]
    pub commands: u64,
    /// Why the last command failed (`None`: it succeeded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_error: Option<String>,
    /// The live migration this launcher sends or receives, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<LauncherMigration>,
}

/// Which end of a live migration a launcher is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MigrationRole {
    /// Sends its running guest.
    Source,
    /// Receives it.
    Target,
}

/// Where a live migration stands, as one launcher sees it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MigrationProgress {
    /// Target: listening for the source.
    Listening,
    /// Memory and state are moving.
    Running,
    /// Source: the guest runs on the target and stopped here. Target: the
    /// guest runs here.
    Succeeded,
    /// It failed; the source's guest runs on (the target never started).
    Failed,
    /// Source: committed but the target's confirmation is missing; the
    /// guest stays paused here until the target is known not to run.
    InDoubt,
}

/// A launcher's live migration.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LauncherMigration {
    /// Uid of the migration.
    pub migration_uid: String,
    /// Source or target.
    pub role: MigrationRole,
    /// Where it stands.
    pub progress: MigrationProgress,
    /// Target: the bound listen address; source: the target's address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<SocketAddr>,
    /// Source, once done: the guest's pause (µs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_us: Option<u64>,
    /// Source, once done: the whole migration (ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_ms: Option<u64>,
    /// Source, once done: passes over RAM (the stop-and-copy included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passes: Option<u32>,
    /// Source, once done: bytes sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl LauncherMigration {
    /// Migration `uid` starting at this end, `address` as the role says.
    pub fn new(
        uid: &str,
        role: MigrationRole,
        progress: MigrationProgress,
        address: SocketAddr,
    ) -> Self {
        LauncherMigration {
            migration_uid: uid.to_string(),
            role,
            progress,
            address: Some(address),
            downtime_us: None,
            total_ms: None,
            passes: None,
            bytes: None,
            reason: None,
        }
    }
}

impl LauncherStatus {
    /// Writes the status to `dir/status.json` atomically.
    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        let tmp = dir.join(".status.json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec(self).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(tmp, dir.join(super::files::STATUS))
    }

    /// Reads `dir/status.json`.
    pub fn load(dir: &Path) -> Option<LauncherStatus> {
        let b = std::fs::read(dir.join(super::files::STATUS)).ok()?;
        serde_json::from_slice(&b).ok()
    }
}

/// A command from the agent (or any client of `control.sock`), one JSON
/// line each (`"Stop"`, `"Pause"`, `"Resume"`, `{"Migrate":{...}}`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum LauncherCommand {
    /// Stop the VM, detach the volumes, exit.
    Stop,
    /// Pause the guest's vCPUs (status `paused: true`).
    Pause,
    /// Resume a paused guest.
    Resume,
    /// Live-migrate the guest to a target launcher (status `migration`).
    Migrate(MigrateCommand),
}

/// Where and how to live-migrate.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MigrateCommand {
    /// The target launcher's listen address.
    pub target: SocketAddr,
    /// Uid of the migration (the link key is derived from it).
    pub migration_uid: String,
    /// Send rate cap, bytes per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_bytes_per_sec: Option<u64>,
    /// Longest acceptable guest pause, ms (default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_budget_ms: Option<u64>,
}
