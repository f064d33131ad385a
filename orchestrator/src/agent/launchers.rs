// SPDX-License-Identifier: Apache-2.0
//! Launcher processes: spawn, follow over the control socket, stop, adopt
//! after an agent restart, clean up.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{Shared, lock};
use crate::controllers::runner::ObjectKey;
use crate::launcher::{LaunchSpec, LauncherCommand, LauncherPhase, LauncherStatus, connect, files};
use crate::names::{self, PathError};
use crate::runtime::VmExit;

/// What the agent tracks per launcher.
#[derive(Debug)]
pub(crate) struct LauncherEntry {
    pub(crate) key: ObjectKey,
    pub(crate) dir: PathBuf,
    pub(crate) pid: Option<u32>,
    pub(crate) status: Option<LauncherStatus>,
    pub(crate) cmd: Option<mpsc::UnboundedSender<LauncherCommand>>,
    /// The connection ended: `status` is final.
    pub(crate) gone: bool,
    /// A stop was requested.
    pub(crate) stopping: bool,
    /// Uid of the live migration this launcher was told to send.
    pub(crate) migration_sent: Option<String>,
}

impl LauncherEntry {
    pub(crate) fn exited(&self) -> bool {
        self.gone
            || self
                .status
                .as_ref()
                .is_some_and(|s| s.phase == LauncherPhase::Exited)
    }
}

/// A launcher as reported by [`super::NodeAgent::launchers`].
#[derive(Clone, Debug)]
pub struct LauncherInfo {
    /// Instance `namespace/name`.
    pub instance: String,
    /// Instance uid.
    pub uid: String,
    /// Process id, if known.
    pub pid: Option<u32>,
    /// Its directory (console, logs).
    pub dir: PathBuf,
    /// Last status.
    pub status: Option<LauncherStatus>,
}

pub(crate) fn list(shared: &Shared) -> Vec<LauncherInfo> {
    lock(&shared.launchers)
        .iter()
        .map(|(uid, e)| LauncherInfo {
            instance: e.key.to_string(),
            uid: uid.clone(),
            pid: e.pid.or(e.status.as_ref().map(|s| s.pid)),
            dir: e.dir.clone(),
            status: e.status.clone(),
        })
        .collect()
}

/// The live console log of instance `uid` (refused unless `uid` is one
/// plain directory name).
pub(crate) fn console_path(shared: &Shared, uid: &str) -> Result<PathBuf, PathError> {
    Ok(names::child(&shared.launchers_dir(), uid)?.join(files::CONSOLE))
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as i32, 0) == 0 }
}

/// Starts a launcher for `spec` and follows it.
pub(crate) fn spawn(
    shared: &Arc<Shared>,
    key: &ObjectKey,
    spec: &LaunchSpec,
) -> std::io::Result<u32> {
    let dir = spec.dir.clone();
    names::ensure_child(&shared.launchers_dir(), &dir).map_err(std::io::Error::other)?;
    std::fs::create_dir_all(&dir)?;
    let spec_path = dir.join(files::SPEC);
    std::fs::write(
        &spec_path,
        serde_json::to_vec_pretty(spec).map_err(std::io::Error::other)?,
    )?;
    let _ = std::fs::remove_file(dir.join(files::STATUS));
    let log = std::fs::File::create(dir.join(files::LOG))?;
    let mut cmd = tokio::process::Command::new(&shared.config.launcher_bin);
    cmd.arg("vm")
        .arg("--spec")
        .arg(&spec_path)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own process group: it outlives an agent restart.
        .process_group(0)
        .kill_on_drop(false);
    let mut child = cmd.spawn()?;
    let pid = child.id().unwrap_or(0);
    info!(instance = %key, pid, runtime = %spec.runtime, "launcher started");
    lock(&shared.launchers).insert(
        spec.uid.clone(),
        LauncherEntry {
            key: key.clone(),
            dir: dir.clone(),
            pid: Some(pid),
            status: None,
            cmd: None,
            gone: false,
            stopping: false,
            migration_sent: None,
        },
    );
    // Reap it (the status comes over the socket or from status.json).
    shared.spawn(async move {
        let _ = child.wait().await;
    });
    let s = shared.clone();
    let uid = spec.uid.clone();
    let key = key.clone();
    shared.spawn(follow(s, uid, key, dir, Some(pid)));
    Ok(pid)
}

/// Follows one launcher over its control socket until it ends.
async fn follow(shared: Arc<Shared>, uid: String, key: ObjectKey, dir: PathBuf, pid: Option<u32>) {
    let mut stream = None;
    // The launcher binds its socket right after it starts.
    for _ in 0..400 {
        match connect(&dir).await {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(_) => {
                if pid.is_some_and(|p| !pid_alive(p))
                    || LauncherStatus::load(&dir).is_some_and(|s| s.phase == LauncherPhase::Exited)
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
    }
    if let Some(s) = stream {
        let (r, mut w) = s.into_split();
        let (tx, mut rx) = mpsc::unbounded_channel::<LauncherCommand>();
        let stop_pending = {
            let mut g = lock(&shared.launchers);
            match g.get_mut(&uid) {
                Some(e) => {
                    e.cmd = Some(tx);
                    e.stopping
                }
                None => false,
            }
        };
        if stop_pending {
            let _ = w.write_all(b"\"Stop\"\n").await;
        }
        let mut lines = BufReader::new(r).lines();
        loop {
            tokio::select! {
                l = lines.next_line() => match l {
                    Ok(Some(l)) => match serde_json::from_str::<LauncherStatus>(&l) {
                        Ok(st) => {
                            debug!(instance = %key, phase = ?st.phase, "launcher status");
                            if let Some(e) = lock(&shared.launchers).get_mut(&uid) {
                                e.pid = Some(st.pid);
                                e.status = Some(st);
                            }
                            shared.wake(&key);
                        }
                        Err(e) => warn!(instance = %key, error = %e, "bad launcher status line"),
                    },
                    _ => break,
                },
                c = rx.recv() => {
                    let Some(c) = c else { break };
                    let mut line = serde_json::to_vec(&c).unwrap_or_default();
                    line.push(b'\n');
                    if w.write_all(&line).await.is_err() {
                        break;
                    }
                }
            }
        }
    }
    // The connection ended: the launcher exited (or died).
    let last = LauncherStatus::load(&dir);
    let final_status = match last {
        Some(s) if s.phase == LauncherPhase::Exited => s,
        other => {
            let mut s = other.unwrap_or(LauncherStatus {
                pid: pid.unwrap_or(0),
                uid: uid.clone(),
                runtime: String::new(),
                phase: LauncherPhase::Exited,
                disks: Vec::new(),
                exit: None,
                paused: false,
                commands: 0,
                command_error: None,
                migration: None,
            });
            s.phase = LauncherPhase::Exited;
            s.exit = Some(VmExit {
                success: false,
                reason: "launcher died".into(),
            });
            s
        }
    };
    info!(instance = %key, exit = ?final_status.exit, "launcher gone");
    if let Some(e) = lock(&shared.launchers).get_mut(&uid) {
        e.status = Some(final_status);
        e.gone = true;
        e.cmd = None;
    }
    shared.wake(&key);
}

/// Asks a launcher to stop (idempotent).
pub(crate) fn stop(shared: &Shared, uid: &str) {
    let mut g = lock(&shared.launchers);
    if let Some(e) = g.get_mut(uid)
        && !e.exited()
    {
        if !e.stopping {
            info!(instance = %e.key, "stopping launcher");
        }
        e.stopping = true;
        if let Some(tx) = &e.cmd {
            let _ = tx.send(LauncherCommand::Stop);
        }
    }
}

/// Sends `cmd` to a running launcher; false when it is not connected.
pub(crate) fn command(shared: &Shared, uid: &str, cmd: LauncherCommand) -> bool {
    let g = lock(&shared.launchers);
    g.get(uid)
        .filter(|e| !e.exited())
        .and_then(|e| e.cmd.as_ref())
        .is_some_and(|tx| tx.send(cmd).is_ok())
}

/// Tells launcher `uid` to live-migrate for migration `cmd.migration_uid`,
/// once: true when this call sent it.
pub(crate) fn send_migrate(
    shared: &Shared,
    uid: &str,
    cmd: crate::launcher::MigrateCommand,
) -> bool {
    let mut g = lock(&shared.launchers);
    let Some(e) = g.get_mut(uid) else {
        return false;
    };
    if e.exited() || e.migration_sent.as_deref() == Some(cmd.migration_uid.as_str()) {
        return false;
    }
    let Some(tx) = &e.cmd else {
        return false;
    };
    let mig = cmd.migration_uid.clone();
    if tx.send(LauncherCommand::Migrate(cmd)).is_ok() {
        e.migration_sent = Some(mig);
        true
    } else {
        false
    }
}

/// Forgets an exited launcher and removes its directory (the console log
/// is kept next to it as `<uid>.console.log` for `console` after the fact).
pub(crate) fn cleanup(shared: &Shared, uid: &str) {
    let Some(e) = lock(&shared.launchers).remove(uid) else {
        return;
    };
    if let Some(spec) = read_spec(&e.dir) {
        super::net::detach(shared, &spec);
    }
    let parent = shared.launchers_dir();
    if let Err(err) = names::ensure_child(&parent, &e.dir) {
        warn!(error = %err, "not removing a launcher directory");
        return;
    }
    let console = e.dir.join(files::CONSOLE);
    if let Ok(keep) = names::child(&parent, &format!("{uid}.console.log")) {
        let _ = std::fs::rename(&console, &keep);
    }
    if let Err(err) = names::remove_dir_under(&parent, &e.dir) {
        debug!(dir = %e.dir.display(), error = %err, "removing launcher directory");
    }
}

fn read_spec(dir: &std::path::Path) -> Option<LaunchSpec> {
    let text = std::fs::read(dir.join(files::SPEC)).ok()?;
    serde_json::from_slice(&text).ok()
}

/// The launch spec of the launcher of instance `uid`, if it is known.
pub(crate) fn spec_of(shared: &Shared, uid: &str) -> Option<LaunchSpec> {
    let dir = lock(&shared.launchers).get(uid)?.dir.clone();
    read_spec(&dir)
}

/// The launch specs of the launchers in the data directory (before
/// adoption: their taps are kept by the pod network's setup).
pub(crate) fn saved_specs(shared: &Shared) -> Vec<LaunchSpec> {
    let Ok(rd) = std::fs::read_dir(shared.launchers_dir()) else {
        return Vec::new();
    };
    rd.flatten().filter_map(|e| read_spec(&e.path())).collect()
}

/// Adopts the launchers of a previous agent on this data directory and
/// returns their instances (to be woken once the instance queue exists).
pub(crate) fn adopt(shared: &Arc<Shared>) -> Vec<ObjectKey> {
    let mut adopted = Vec::new();
    let Ok(rd) = std::fs::read_dir(shared.launchers_dir()) else {
        return adopted;
    };
    for ent in rd.flatten() {
        let dir = ent.path();
        let Ok(text) = std::fs::read(dir.join(files::SPEC)) else {
            continue;
        };
        let Ok(spec) = serde_json::from_slice::<LaunchSpec>(&text) else {
            continue;
        };
        let Some((ns, name)) = spec.instance.split_once('/') else {
            continue;
        };
        let key = ObjectKey::new(ns, name);
        let status = LauncherStatus::load(&dir);
        let pid = status.as_ref().map(|s| s.pid);
        info!(instance = %key, ?pid, "adopting launcher");
        lock(&shared.launchers).insert(
            spec.uid.clone(),
            LauncherEntry {
                key: key.clone(),
                dir: dir.clone(),
                pid,
                status,
                cmd: None,
                gone: false,
                stopping: false,
                migration_sent: None,
            },
        );
        shared.spawn(follow(
            shared.clone(),
            spec.uid.clone(),
            key.clone(),
            dir,
            pid,
        ));
        shared.wake(&key);
        adopted.push(key);
    }
    adopted
}
