// SPDX-License-Identifier: Apache-2.0
//! Live migration in the node agent (virt-handler's migration loop).
//!
//! ```text
//!  controller: VMI.status.migrationState = {mode: PreCopy, source, target, uid}
//!  target agent: start a launcher with `incoming` (volumes not attached)
//!                └─► migrationState.targetNodeAddress / targetDirectMigrationNodePorts
//!  source agent: launcher ◄── Migrate{target address, uid}
//!  target agent: the launcher runs the guest ─► volumes' attachment = (target,
//!                engine epoch), VMI nodeName = target, targetNodeDomainDetected
//!  source agent: its launcher exited "migrated live": forgotten, never reported
//!  controller:   VMI Running on the target ─► migration Succeeded
//! ```
//!
//! A failure on either side before the switch-over is written to
//! `migrationState.failed` / `failureReason` by the side that saw it; the
//! guest keeps running on the source and the controller fails the
//! migration object.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use tracing::{info, warn};

use super::launchers;
use super::vmi::{AgentVmiReconciler, Launcher, launch_spec, launcher_state};
use crate::controllers::ControllerResult;
use crate::controllers::runner::{Action, KeyMapper, ObjectKey};
use crate::controllers::util::*;
use crate::launcher::{
    IncomingSpec, LauncherCommand, LauncherStatus, MigrateCommand, MigrationProgress, MigrationRole,
};
use crate::resources::common::json_str;
use crate::resources::common::now;
use crate::resources::kubevirt::{MigrationState, VirtualMachineInstanceStatus};
use crate::resources::{ConditionStatus, VirtualMachineInstance, Volume};
use crate::store::WatchEvent;
use crate::store::{StoreError, StoreExt, UpdateScope};

/// The mode name of a live migration in `migrationState.mode`.
const LIVE: &str = "PreCopy";

fn live_state(vmi: &VirtualMachineInstance) -> Option<MigrationState> {
    vmi.status
        .as_ref()
        .and_then(|s| s.migration_state.clone())
        .filter(|m| {
            m.mode.as_deref() == Some(LIVE)
                && m.completed != Some(true)
                && m.failed != Some(true)
                && m.migration_uid.is_some()
        })
}

/// The live migration of `vmi` whose target is node `me`, in progress.
pub(crate) fn live_target(vmi: &VirtualMachineInstance, me: &str) -> Option<MigrationState> {
    live_state(vmi)
        .filter(|m| m.target_node.as_deref() == Some(me) && m.source_node.as_deref() != Some(me))
}

/// The live migration of `vmi` whose source is node `me`, in progress.
pub(crate) fn live_source(vmi: &VirtualMachineInstance, me: &str) -> Option<MigrationState> {
    live_state(vmi).filter(|m| {
        m.source_node.as_deref() == Some(me) && m.target_node.as_deref().is_some_and(|t| t != me)
    })
}

/// Maps instance events to themselves when `node` is the target of their
/// migration (the agent's primary watch only sees instances bound here).
pub(crate) fn incoming_mapper(node: String) -> KeyMapper {
    Arc::new(move |ev: &WatchEvent| {
        if json_str(&ev.object, "status.migrationState.targetNode") != node {
            return Vec::new();
        }
        ObjectKey::of(&ev.object).into_iter().collect()
    })
}

/// KubeVirt's `LiveMigratable` condition from the launcher's runtime.
pub(crate) fn set_live_migratable(s: &mut VirtualMachineInstanceStatus, st: &LauncherStatus) {
    if st.runtime == "sheaf-vmm" {
        set_condition(
            &mut s.conditions,
            "LiveMigratable",
            ConditionStatus::True,
            "",
            "",
        );
    } else {
        set_condition(
            &mut s.conditions,
            "LiveMigratable",
            ConditionStatus::False,
            "RuntimeNotLiveMigratable",
            &format!("the {} runtime migrates cold (stop and start)", st.runtime),
        );
    }
}

fn migration_of<'a>(
    st: &'a LauncherStatus,
    mig: &str,
) -> Option<&'a crate::launcher::LauncherMigration> {
    st.migration.as_ref().filter(|m| m.migration_uid == mig)
}

impl AgentVmiReconciler {
    /// Writes `f` into the instance's migration state if it still belongs
    /// to migration `mig`.
    async fn write_state(
        &self,
        vmi: &VirtualMachineInstance,
        mig: &str,
        f: impl Fn(&mut VirtualMachineInstanceStatus) + Send + Sync,
    ) -> ControllerResult<()> {
        let r = self
            .shared
            .store
            .modify_typed(
                namespace(vmi),
                name(vmi),
                UpdateScope::Status,
                |v: &mut VirtualMachineInstance| {
                    let st = v.status.get_or_insert_with(Default::default);
                    if st
                        .migration_state
                        .as_ref()
                        .is_some_and(|m| m.migration_uid.as_deref() == Some(mig))
                    {
                        f(st);
                    }
                },
            )
            .await;
        match r {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn record_failure(
        &self,
        vmi: &VirtualMachineInstance,
        mig: &str,
        reason: &str,
    ) -> ControllerResult<()> {
        warn!(vmi = %ns_name(vmi), migration = mig, %reason, "live migration failed");
        let reason = reason.to_string();
        self.write_state(vmi, mig, move |st| {
            if let Some(m) = st.migration_state.as_mut() {
                m.failed = Some(true);
                m.completed = Some(true);
                m.end_timestamp = Some(now());
                m.failure_reason = Some(reason.clone());
            }
        })
        .await
    }
}

/// Target side.
pub(crate) async fn target(
    r: &AgentVmiReconciler,
    vmi: &VirtualMachineInstance,
    ms: MigrationState,
) -> ControllerResult<Action> {
    let shared = &r.shared;
    let vuid = uid(vmi).to_string();
    let mig = ms.migration_uid.clone().unwrap_or_default();
    match launcher_state(shared, &vuid) {
        Launcher::None => {
            let volumes = r.volumes(vmi).await?;
            let mut spec = match launch_spec(shared, vmi, &volumes) {
                Ok(Some(s)) => s,
                // A volume not (yet) attached to the source: wait for events.
                Ok(None) => return Ok(Action::Done),
                Err(msg) => {
                    r.record_failure(vmi, &mig, &format!("the target cannot run it: {msg}"))
                        .await?;
                    return Ok(Action::Done);
                }
            };
            spec.incoming = Some(IncomingSpec {
                listen: SocketAddr::new(shared.config.replica_host, 0),
                migration_uid: mig.clone(),
                accept_timeout_secs: 120,
            });
            if let Err(e) = r.write_seeds(vmi, &spec).await? {
                r.record_failure(vmi, &mig, &format!("cloud-init seed: {e}"))
                    .await?;
                return Ok(Action::Done);
            }
            if let Err(msg) = super::net::attach(shared, vmi, &mut spec).await {
                r.record_failure(vmi, &mig, &format!("network: {msg}"))
                    .await?;
                return Ok(Action::Done);
            }
            let key = ObjectKey::new(namespace(vmi), name(vmi));
            if let Err(e) = launchers::spawn(shared, &key, &spec) {
                super::net::detach(shared, &spec);
                r.record_failure(vmi, &mig, &format!("starting the target launcher: {e}"))
                    .await?;
                return Ok(Action::Done);
            }
            info!(vmi = %key, migration = %mig, "live migration target launcher started");
        }
        Launcher::Starting => {
            // Listening: publish where.
            let status = super::lock(&shared.launchers)
                .get(&vuid)
                .and_then(|e| e.status.clone());
            if let Some(m) = status.as_ref().and_then(|s| migration_of(s, &mig))
                && m.progress == MigrationProgress::Listening
                && let Some(addr) = m.address
                && ms.target_node_address.as_deref() != Some(addr.ip().to_string().as_str())
            {
                let ip = addr.ip().to_string();
                let port = addr.port().to_string();
                info!(vmi = %ns_name(vmi), %addr, "live migration target listening");
                r.write_state(vmi, &mig, move |st| {
                    if let Some(m) = st.migration_state.as_mut() {
                        m.target_node_address = Some(ip.clone());
                        m.target_direct_migration_node_ports =
                            Some(BTreeMap::from([(port.clone(), 0)]));
                    }
                })
                .await?;
            }
        }
        Launcher::Running(st) => {
            // The guest runs here: take the volumes and the instance over.
            take_over(r, vmi, &mig, &st).await?;
        }
        Launcher::Exited(st) => {
            let reason = migration_of(&st, &mig)
                .and_then(|m| m.reason.clone())
                .or_else(|| st.exit.as_ref().map(|e| e.reason.clone()))
                .unwrap_or_else(|| "the target launcher ended".into());
            r.record_failure(vmi, &mig, &format!("target: {reason}"))
                .await?;
            launchers::cleanup(shared, &vuid);
        }
    }
    Ok(Action::Done)
}

/// The migrated guest runs here: point each volume's attachment at this
/// node with the epoch the engine took (so fencing this node's failure
/// fences the right engine), then bind the instance here.
async fn take_over(
    r: &AgentVmiReconciler,
    vmi: &VirtualMachineInstance,
    mig: &str,
    st: &LauncherStatus,
) -> ControllerResult<()> {
    let me = r.me().to_string();
    let store = &r.shared.store;
    for d in &st.disks {
        let Some((ns, n)) = d.volume.split_once('/') else {
            continue;
        };
        let vuid = uid(vmi).to_string();
        let instance = ns_name(vmi);
        let me2 = me.clone();
        let epoch = d.epoch;
        let res = store
            .modify_typed(ns, n, UpdateScope::Status, |v: &mut Volume| {
                let s = v.status.get_or_insert_with(Default::default);
                let ours = s
                    .attachment
                    .as_ref()
                    .is_some_and(|a| a.instance_uid.as_deref() == Some(vuid.as_str()));
                if !ours {
                    return;
                }
                s.epoch = Some(s.epoch.unwrap_or(0).max(epoch));
                s.attachment = Some(crate::resources::sheaf::Attachment {
                    node_name: me2.clone(),
                    instance: Some(instance.clone()),
                    instance_uid: Some(vuid.clone()),
                    epoch: Some(epoch),
                    since: Some(now()),
                });
            })
            .await;
        match res {
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    info!(vmi = %ns_name(vmi), node = %me, migration = mig, "migrated guest runs here; taking the instance over");
    let me2 = me.clone();
    r.write_state(vmi, mig, move |s| {
        s.node_name = Some(me2.clone());
        if let Some(m) = s.migration_state.as_mut() {
            m.target_node_domain_detected = Some(true);
            m.target_node_domain_ready_timestamp = Some(now());
        }
        set_condition(&mut s.conditions, "Ready", ConditionStatus::True, "", "");
    })
    .await
}

/// Source side (the instance is `Running` here).
pub(crate) async fn source(
    r: &AgentVmiReconciler,
    vmi: &VirtualMachineInstance,
    ms: MigrationState,
    state: Launcher,
) -> ControllerResult<Action> {
    let shared = &r.shared;
    let vuid = uid(vmi).to_string();
    let mig = ms.migration_uid.clone().unwrap_or_default();
    match state {
        Launcher::Running(st) => match migration_of(&st, &mig).map(|m| m.progress) {
            None => {
                let target = ms.target_node_address.as_deref().and_then(|ip| {
                    let port = ms
                        .target_direct_migration_node_ports
                        .as_ref()?
                        .keys()
                        .next()?;
                    format!("{ip}:{port}").parse::<SocketAddr>().ok()
                });
                if let Some(target) = target {
                    let cmd = MigrateCommand {
                        target,
                        migration_uid: mig.clone(),
                        bandwidth_bytes_per_sec: None,
                        downtime_budget_ms: None,
                    };
                    if launchers::send_migrate(shared, &vuid, cmd) {
                        info!(vmi = %ns_name(vmi), %target, migration = %mig, "live migration sent to the launcher");
                    }
                }
            }
            Some(MigrationProgress::Failed) => {
                let reason = migration_of(&st, &mig)
                    .and_then(|m| m.reason.clone())
                    .unwrap_or_default();
                r.record_failure(vmi, &mig, &format!("source: {reason}"))
                    .await?;
            }
            Some(_) => {} // running, in doubt, or done: the launcher reports
        },
        Launcher::Exited(st) => {
            let migrated = migration_of(&st, &mig).is_some_and(|m| {
                m.role == MigrationRole::Source && m.progress == MigrationProgress::Succeeded
            });
            if !migrated {
                // The guest ended during the migration.
                r.report_exit(vmi, &st).await?;
            } else if let Some(m) = migration_of(&st, &mig) {
                info!(
                    vmi = %ns_name(vmi),
                    downtime_ms = m.downtime_us.unwrap_or(0) as f64 / 1e3,
                    total_ms = m.total_ms.unwrap_or(0),
                    passes = m.passes.unwrap_or(0),
                    bytes = m.bytes.unwrap_or(0),
                    "guest migrated live; waiting for the target to take the instance"
                );
            }
            // Migrated: the target binds the instance; then it is not ours.
        }
        Launcher::Starting | Launcher::None => {}
    }
    Ok(Action::Done)
}

/// After an in-doubt commit the source stays paused; once the target said
/// it failed (the migration state is failed), the guest resumes here.
pub(crate) fn resume_in_doubt(r: &AgentVmiReconciler, vmi: &VirtualMachineInstance) {
    let vuid = uid(vmi).to_string();
    let st = super::lock(&r.shared.launchers)
        .get(&vuid)
        .and_then(|e| e.status.clone());
    let Some(st) = st else { return };
    let failed = vmi
        .status
        .as_ref()
        .and_then(|s| s.migration_state.as_ref())
        .filter(|m| m.failed == Some(true) && m.mode.as_deref() == Some(LIVE));
    if let (Some(m), Some(lm)) = (failed, st.migration.as_ref())
        && Some(lm.migration_uid.as_str()) == m.migration_uid.as_deref()
        && lm.progress == MigrationProgress::InDoubt
        && st.paused
    {
        info!(vmi = %ns_name(vmi), "the migration target failed after an in-doubt commit; resuming the guest here");
        launchers::command(&r.shared, &vuid, LauncherCommand::Resume);
    }
}
