// SPDX-License-Identifier: Apache-2.0
//! Both ends of a live migration in the launcher.
//!
//! ```text
//!  source launcher (VM running)            target launcher (spec.incoming)
//!                                          bind, status migration=Listening{address}
//!  ◄── agent: Migrate{target, uid} ──
//!  connect, pre-copy RAM ─────────────────► RAM into the new VM (not started)
//!  pause, drain I/O, state ───────────────► load the state
//!  Commit ────────────────────────────────► attach the volumes (new epoch:
//!                                           the source's engine is fenced)
//!                                           start the vCPUs
//!  ◄────────────────────────────────────── Running
//!  exit "migrated live"                     status migration=Succeeded, phase Running
//! ```
//!
//! The link key is derived from the replication secret and the migration's
//! uid ([`migration_key`]): only launchers holding the cluster's secret,
//! told the same migration, can talk. Before the commit any failure leaves
//! the source running and the target exits; a target that cannot attach
//! its volumes refuses the commit, and the source resumes.

use std::net::{TcpListener, TcpStream};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sheaf_blockrepl::frontend::Disk;
use sheaf_blockrepl::net::Secret;
use sheaf_blockrepl::volume::Volume;
use sheaf_vmm::{MigrationConfig, MigrationError};
use tracing::{debug, info, warn};

use super::metrics::DiskIoStats;
use super::protocol::{
    IncomingSpec, LaunchSpec, LauncherCommand, LauncherMigration, MigrateCommand,
    MigrationProgress, MigrationRole, migration_key,
};
use super::run::{
    Reporter, attach_volumes, detach_all, error_chain, guest_disk_order, publish_disks,
};
use crate::runtime::{
    AttachedDisk, DeferredVolume, DiskBacking, RunningVm, RuntimeContext, RuntimeError, VmExit,
    VmRuntime,
};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the target end needs from the launcher.
pub(super) struct Ends<'a> {
    pub(super) rt: &'a tokio::runtime::Runtime,
    pub(super) spec: &'a LaunchSpec,
    pub(super) secret: Option<&'a Secret>,
    pub(super) runtime: &'a dyn VmRuntime,
    pub(super) ctx: &'a RuntimeContext,
    pub(super) io_stats: &'a [Arc<DiskIoStats>],
    pub(super) rep: &'a Reporter,
}

impl Ends<'_> {
    /// Target: waits for the source, receives the VM, attaches the volumes
    /// at the switch-over. Returns the running VM and its volumes, or why
    /// it failed (nothing runs then and no volume stays attached).
    pub(super) fn receive(
        &self,
        inc: &IncomingSpec,
        cmds: &std_mpsc::Receiver<LauncherCommand>,
    ) -> Result<(Box<dyn RunningVm>, Vec<Volume>), String> {
        let secret = self
            .secret
            .ok_or("a live migration needs the replication secret")?
            .clone();
        let listener = TcpListener::bind(inc.listen)
            .map_err(|e| format!("listening for the migration on {}: {e}", inc.listen))?;
        let addr = listener
            .local_addr()
            .map_err(|e| format!("listening for the migration: {e}"))?;
        self.rep.publish(|s| {
            s.migration = Some(LauncherMigration::new(
                &inc.migration_uid,
                MigrationRole::Target,
                MigrationProgress::Listening,
                addr,
            ))
        });
        info!(%addr, migration = %inc.migration_uid, "waiting for the migration source");
        let conn = accept(&listener, inc.accept_timeout_secs, cmds)?;
        drop(listener);
        self.rep.publish(|s| {
            if let Some(m) = s.migration.as_mut() {
                m.progress = MigrationProgress::Running;
            }
        });
        let deferred: Vec<Arc<DeferredVolume>> = self
            .spec
            .disks
            .iter()
            .map(|d| DeferredVolume::new(d.size_bytes))
            .collect();
        let volumes = self
            .spec
            .disks
            .iter()
            .zip(&deferred)
            .zip(self.io_stats)
            .map(|((d, v), st)| AttachedDisk {
                name: d.name.clone(),
                serial: d.serial.clone(),
                disk: DiskBacking::Deferred(v.clone()),
                read_only: d.read_only,
                io_stats: st.clone(),
            })
            .collect();
        let attached = guest_disk_order(volumes, &self.spec.file_disks);
        let taken: Arc<Mutex<Option<Vec<Volume>>>> = Arc::default();
        let mut cfg = MigrationConfig::new(migration_key(&secret, &inc.migration_uid));
        {
            let handle = self.rt.handle().clone();
            let spec = self.spec.clone();
            let taken = taken.clone();
            cfg.before_start = Some(Arc::new(move || {
                let t0 = Instant::now();
                let vols = attach_volumes(&handle, &spec, Some(&secret))?;
                let filled = deferred
                    .iter()
                    .zip(&vols)
                    .try_for_each(|(d, v)| d.fill(Disk::new(v.clone())));
                // Kept either way: detached below if the VM does not run.
                *lock(&taken) = Some(vols);
                filled?;
                info!(
                    ms = t0.elapsed().as_secs_f64() * 1e3,
                    "volumes attached at the switch-over"
                );
                Ok(())
            }));
        }
        let received =
            self.runtime
                .receive_migration(&self.spec.vm, attached, self.ctx, conn, &cfg);
        let vols = lock(&taken).take();
        match received {
            Ok(vm) => {
                let vols = vols.ok_or("the migration ended without attaching the volumes")?;
                publish_disks(self.rt, self.rep, self.spec, &vols);
                self.rep.publish(|s| {
                    if let Some(m) = s.migration.as_mut() {
                        m.progress = MigrationProgress::Succeeded;
                    }
                });
                Ok((vm, vols))
            }
            Err(e) => {
                if let Some(vols) = vols {
                    detach_all(self.rt, vols);
                }
                Err(format!("receiving the migration: {}", error_chain(&e)))
            }
        }
    }
}

/// Accepts the one source connection, polling so that a `Stop` or the
/// deadline ends the wait.
fn accept(
    listener: &TcpListener,
    timeout_secs: u64,
    cmds: &std_mpsc::Receiver<LauncherCommand>,
) -> Result<TcpStream, String> {
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("listening for the migration: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(timeout_secs.max(1));
    loop {
        match listener.accept() {
            Ok((conn, peer)) => {
                info!(%peer, "migration source connected");
                conn.set_nonblocking(false)
                    .map_err(|e| format!("migration connection: {e}"))?;
                return Ok(conn);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Ok(LauncherCommand::Stop) = cmds.try_recv() {
                    return Err("stopped while waiting for the migration source".into());
                }
                if Instant::now() >= deadline {
                    return Err(format!(
                        "no migration source connected within {timeout_secs} s"
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("accepting the migration source: {e}")),
        }
    }
}

/// Source: migrates the running guest as `cmd` says. `Some(exit)`: the
/// guest runs on the target now and this launcher is done.
pub(super) fn send(
    vm: &mut Box<dyn RunningVm>,
    cmd: &MigrateCommand,
    secret: Option<&Secret>,
    rep: &Reporter,
) -> Option<VmExit> {
    rep.publish(|s| {
        s.migration = Some(LauncherMigration::new(
            &cmd.migration_uid,
            MigrationRole::Source,
            MigrationProgress::Running,
            cmd.target,
        ))
    });
    info!(target = %cmd.target, migration = %cmd.migration_uid, "live migration starts");
    let result = (|| {
        let secret = secret.ok_or_else(|| {
            RuntimeError::Config("a live migration needs the replication secret".into())
        })?;
        let mut cfg = MigrationConfig::new(migration_key(secret, &cmd.migration_uid));
        if let Some(b) = cmd.bandwidth_bytes_per_sec {
            cfg.bandwidth_limit = Some(b.max(1));
        }
        if let Some(ms) = cmd.downtime_budget_ms {
            cfg.downtime_budget = Duration::from_millis(ms.max(1));
        }
        cfg.progress = Some(Arc::new(|p: &sheaf_vmm::Progress| {
            debug!(?p, "migration progress")
        }));
        let conn =
            TcpStream::connect_timeout(&cmd.target, Duration::from_secs(10)).map_err(|e| {
                RuntimeError::Control {
                    op: "connecting to the migration target",
                    message: format!("{}: {e}", cmd.target),
                }
            })?;
        vm.migrate(conn, &cfg)
    })();
    match result {
        Ok(r) => {
            info!(
                target = %cmd.target,
                downtime_ms = r.downtime.as_secs_f64() * 1e3,
                total_ms = r.total_time.as_secs_f64() * 1e3,
                passes = r.passes.len(),
                "migrated live; the guest runs on the target"
            );
            rep.publish(|s| {
                s.commands += 1;
                s.command_error = None;
                if let Some(m) = s.migration.as_mut() {
                    m.progress = MigrationProgress::Succeeded;
                    m.downtime_us = Some(r.downtime.as_micros() as u64);
                    m.total_ms = Some(r.total_time.as_millis() as u64);
                    m.passes = Some(r.passes.len() as u32);
                    m.bytes = Some(r.total_bytes);
                }
            });
            Some(VmExit {
                success: true,
                reason: format!("migrated live to {}", cmd.target),
            })
        }
        Err(e) => {
            let in_doubt = matches!(
                &e,
                RuntimeError::Vmm(sheaf_vmm::Error::Migration(MigrationError::InDoubt { .. }))
            );
            let reason = error_chain(&e);
            warn!(target = %cmd.target, %reason, in_doubt, "live migration failed");
            rep.publish(|s| {
                s.commands += 1;
                s.command_error = Some(reason.clone());
                if in_doubt {
                    s.paused = true;
                }
                if let Some(m) = s.migration.as_mut() {
                    m.progress = if in_doubt {
                        MigrationProgress::InDoubt
                    } else {
                        MigrationProgress::Failed
                    };
                    m.reason = Some(reason.clone());
                }
            });
            None
        }
    }
}
