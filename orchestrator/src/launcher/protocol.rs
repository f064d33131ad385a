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
/// line each (`"Stop"`, `"Pause"`, `"Resume"`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LauncherCommand {
    /// Stop the VM, detach the volumes, exit.
    Stop,
    /// Pause the guest's vCPUs (status `paused: true`).
    Pause,
    /// Resume a paused guest.
    Resume,
}
