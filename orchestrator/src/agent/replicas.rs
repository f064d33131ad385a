// SPDX-License-Identifier: Apache-2.0
//! The agent's replica reconciler (Longhorn's instance manager for
//! replicas): for every volume with a replica placed on this node, create
//! the store, run one `sheaf-launcher replica` process serving it, and
//! report its address and state; remove replicas the volume no longer has.
//!
//! A replica server keeps its port across restarts (recorded in
//! `replica.json`), so a running engine finds it again at the same address
//! and brings it back in sync (incremental rebuild).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tracing::{info, warn};

use super::{Shared, lock};
use crate::controllers::runner::{Action, ObjectKey, Reconciler};
use crate::controllers::util::*;
use crate::controllers::{ControllerError, ControllerResult};
use crate::names::{self, PathError};
use crate::resources::common::now;
use crate::resources::sheaf::ReplicaState;
use crate::resources::{Volume, parse_quantity_bytes};
use crate::store::{StoreError, StoreExt, UpdateScope};

/// A replica server of this node.
#[derive(Debug, Clone)]
pub(crate) struct ReplicaEntry {
    pub(crate) pid: Option<u32>,
    pub(crate) addr: SocketAddr,
    pub(crate) dir: PathBuf,
}

/// `replica.json`: how to find (or restart) the server.
#[derive(Serialize, Deserialize, Debug)]
struct ReplicaFile {
    volume: String,
    pid: u32,
    addr: SocketAddr,
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

/// `replicas/{namespace}_{name}`, refused unless it is one plain directory
/// name under `replicas/` (names come from the API).
fn dir_for(shared: &Shared, key: &ObjectKey) -> Result<PathBuf, PathError> {
    names::child(
        &shared.replicas_dir(),
        &format!("{}_{}", key.namespace, key.name),
    )
}

fn path_err(e: PathError) -> ControllerError {
    ControllerError::Invalid(format!("replica directory: {e}"))
}

/// Adopts replica servers left by a previous agent.
pub(crate) fn adopt(shared: &Shared) {
    let Ok(rd) = std::fs::read_dir(shared.replicas_dir()) else {
        return;
    };
    for ent in rd.flatten() {
        let dir = ent.path();
        let Ok(b) = std::fs::read(dir.join("replica.json")) else {
            continue;
        };
        let Ok(f) = serde_json::from_slice::<ReplicaFile>(&b) else {
            continue;
        };
        let Some((ns, n)) = f.volume.split_once('/') else {
            continue;
        };
        let alive = pid_alive(f.pid);
        info!(volume = %f.volume, pid = f.pid, alive, "found replica server");
        lock(&shared.replicas).insert(
            ObjectKey::new(ns, n),
            ReplicaEntry {
                pid: alive.then_some(f.pid),
                addr: f.addr,
                dir,
            },
        );
    }
}

pub(crate) struct ReplicaReconciler {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ReplicaReconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaReconciler")
            .field("node", &self.shared.config.node_name)
            .finish()
    }
}

impl ReplicaReconciler {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        ReplicaReconciler { shared }
    }

    fn remove_local(&self, key: &ObjectKey) {
        let e = lock(&self.shared.replicas).remove(key);
        let dir = match e.as_ref().map(|e| e.dir.clone()) {
            Some(d) => Ok(d),
            None => dir_for(&self.shared, key),
        };
        if let Some(pid) = e.and_then(|e| e.pid) {
            // SAFETY: kill(2) on the replica server this agent started.
            unsafe {
                libc::kill(pid as i32, libc::SIGKILL);
            }
        }
        let dir = match dir {
            Ok(d) => d,
            Err(e) => {
                warn!(volume = %key, error = %e, "not removing a replica directory");
                return;
            }
        };
        if dir.exists() {
            info!(volume = %key, "removing replica");
            if let Err(e) = names::remove_dir_under(&self.shared.replicas_dir(), &dir) {
                warn!(dir = %dir.display(), error = %e, "removing replica directory");
            }
        }
    }

    /// Starts the server for `key` (creating the store if needed).
    async fn start(
        &self,
        key: &ObjectKey,
        size: u64,
        replacement: bool,
        port: u16,
    ) -> ControllerResult<ReplicaEntry> {
        let dir = dir_for(&self.shared, key).map_err(path_err)?;
        std::fs::create_dir_all(&dir).map_err(|e| {
            ControllerError::Invalid(format!("replica directory {}: {e}", dir.display()))
        })?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("replica.log"))
            .map_err(|e| ControllerError::Invalid(format!("replica log: {e}")))?;
        let c = &self.shared.config;
        let listen = SocketAddr::new(c.replica_host, port);
        let mut cmd = tokio::process::Command::new(&c.launcher_bin);
        cmd.arg("replica")
            .arg("--dir")
            .arg(dir.join("store"))
            .arg("--listen")
            .arg(listen.to_string())
            .arg("--secret-file")
            .arg(&c.secret_file)
            .arg("--create-size")
            .arg(size.to_string());
        if replacement {
            cmd.arg("--replacement");
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .process_group(0)
            .kill_on_drop(false);
        let mut child = cmd
            .spawn()
            .map_err(|e| ControllerError::Invalid(format!("starting replica server: {e}")))?;
        let pid = child.id().unwrap_or(0);
        let out = child.stdout.take();
        let line = async {
            let mut lines = BufReader::new(out?).lines();
            lines.next_line().await.ok().flatten()
        };
        let line = tokio::time::timeout(Duration::from_secs(15), line)
            .await
            .ok()
            .flatten();
        self.shared.spawn(async move {
            let _ = child.wait().await;
        });
        let addr: SocketAddr = line
            .as_deref()
            .and_then(|l| l.strip_prefix("listening on "))
            .and_then(|a| a.trim().parse().ok())
            .ok_or_else(|| {
                ControllerError::Invalid(format!(
                    "replica server for {key} did not start (see {})",
                    dir.join("replica.log").display()
                ))
            })?;
        let f = ReplicaFile {
            volume: key.to_string(),
            pid,
            addr,
        };
        let _ = std::fs::write(
            dir.join("replica.json"),
            serde_json::to_vec(&f).unwrap_or_default(),
        );
        info!(volume = %key, %addr, pid, replacement, "replica server started");
        let e = ReplicaEntry {
            pid: Some(pid),
            addr,
            dir,
        };
        lock(&self.shared.replicas).insert(key.clone(), e.clone());
        Ok(e)
    }
}

fn store_exists(dir: &Path) -> bool {
    dir.join("store").join("superblock").exists()
}

#[async_trait]
impl Reconciler for ReplicaReconciler {
    async fn reconcile(&self, key: &ObjectKey) -> ControllerResult<Action> {
        let me = self.shared.config.node_name.clone();
        let vol: Volume = match self.shared.store.get_typed(&key.namespace, &key.name).await {
            Ok(v) => v,
            Err(StoreError::NotFound { .. }) => {
                self.remove_local(key);
                return Ok(Action::Done);
            }
            Err(e) => return Err(e.into()),
        };
        let Some(entry) = vol
            .status
            .iter()
            .flat_map(|s| s.replicas.iter().flatten())
            .find(|r| r.node_name == me)
            .cloned()
        else {
            self.remove_local(key);
            return Ok(Action::Done);
        };
        if deleting(&vol) {
            return Ok(Action::Done);
        }
        let local = lock(&self.shared.replicas).get(key).cloned();
        let alive = local.as_ref().and_then(|l| l.pid).is_some_and(pid_alive);
        let restarted;
        let addr = if alive {
            restarted = false;
            local.as_ref().map(|l| l.addr)
        } else {
            let size = parse_quantity_bytes(&vol.spec.size.0)
                .unwrap_or(0)
                .div_ceil(4096)
                * 4096;
            let dir = dir_for(&self.shared, key).map_err(path_err)?;
            let fresh = !store_exists(&dir);
            let replacement = fresh && entry.state == Some(ReplicaState::Rebuilding);
            let port = local.as_ref().map(|l| l.addr.port()).unwrap_or(0);
            let started = match self.start(key, size, replacement, port).await {
                Ok(e) => e,
                // The old port may be taken: any port will do (the engine
                // sees a new address at its next attach).
                Err(_) if port != 0 => self.start(key, size, replacement, 0).await?,
                Err(e) => return Err(e),
            };
            restarted = !fresh;
            Some(started.addr)
        };
        let addr = addr.map(|a| a.to_string());
        let state = match entry.state {
            None => Some(ReplicaState::Healthy),
            // Back after a failure: it missed writes until rebuilt.
            Some(ReplicaState::Failed) => Some(ReplicaState::Stale),
            s => s,
        };
        if entry.address != addr || entry.state != state {
            let me2 = me.clone();
            self.shared
                .store
                .modify_typed(
                    &key.namespace,
                    &key.name,
                    UpdateScope::Status,
                    |v: &mut Volume| {
                        for r in v
                            .status
                            .iter_mut()
                            .flat_map(|s| s.replicas.iter_mut().flatten())
                        {
                            if r.node_name == me2 {
                                if r.state != state {
                                    r.since = Some(now());
                                    r.message =
                                        restarted.then(|| "replica server restarted".to_string());
                                }
                                r.address = addr.clone();
                                r.state = state;
                            }
                        }
                    },
                )
                .await?;
        }
        Ok(Action::Done)
    }
}
