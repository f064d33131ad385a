// SPDX-License-Identifier: Apache-2.0
//! The migration controller: moves a running instance to another node.
//!
//! Only **cold** migration exists today; the steps are laid out so that live
//! (pre-copy) migration slots in at the marked point:
//!
//! ```text
//!  Pending ─► Scheduling: sched picks a target (not the source, resources fit)
//!     └─► Scheduled: VMI.status.migrationState = {source, target, uid, mode}
//!           └─► Running:  source agent stops the guest, hands the VMI over
//!                         (nodeName = target, phase Scheduled)   ◄── live: target launcher
//!                         VMI controller re-attaches the volume       starts "incoming", memory
//!                         to the target with a new epoch              copied with the dirty log,
//!                         target agent starts the launcher            source paused, switch-over
//!                 └─► Succeeded when the VMI runs on the target (Failed if it ends)
//! ```
//!
//! The epoch bump on re-attach is what makes the hand-off safe: even if the
//! source launcher were still alive, its engine is fenced by the target's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sheaf_sched::{Operator, Requirement, SchedError};
use tracing::info;

use super::placement;
use super::runner::{Action, KeyMapper, ObjectKey, Reconciler};
use super::util::*;
use super::{ControllerError, ControllerResult, Ctx};
use crate::resources::common::now;
use crate::resources::kubevirt::{
    MigrationPhase, MigrationState, VirtualMachineInstanceMigrationStatus,
};
use crate::resources::{
    ConditionStatus, Node, VirtualMachineInstance, VirtualMachineInstanceMigration, VmiPhase,
    Volume,
};
use crate::store::{ListOptions, StoreError, StoreExt, UpdateScope, WatchEvent};

/// Annotation of a `VirtualMachineInstanceMigration` asking for a cold
/// migration (`Cold`: stop, move, start) of a guest that could move live.
pub const MIGRATION_MODE_ANNOTATION: &str = "sheaf.dev/migration-mode";

/// Migrations in flight in the cluster at once (KubeVirt's default
/// `parallelMigrationsPerCluster`).
pub const PARALLEL_MIGRATIONS_PER_CLUSTER: usize = 5;

/// Migrations leaving one node at once (KubeVirt's default
/// `parallelOutboundMigrationsPerNode`).
pub const PARALLEL_OUTBOUND_MIGRATIONS_PER_NODE: usize = 2;

/// How an instance moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MigrationMode {
    /// Stop on the source, start on the target with the same volumes.
    Cold,
    /// Copy memory while the guest runs (sheaf-vmm guests: the source
    /// agent reports the `LiveMigratable` condition).
    PreCopy,
}

impl MigrationMode {
    /// How `vmi` moves for `mig`: live when its node agent says it can
    /// (`LiveMigratable` condition `True`) unless the migration asks for
    /// a cold one (annotation [`MIGRATION_MODE_ANNOTATION`]` = Cold`).
    pub fn of(
        vmi: &VirtualMachineInstance,
        mig: &VirtualMachineInstanceMigration,
    ) -> MigrationMode {
        let cold = mig
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(MIGRATION_MODE_ANNOTATION))
            .is_some_and(|m| m.eq_ignore_ascii_case("cold"));
        let live = !cold
            && vmi
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .into_iter()
                .flatten()
                .any(|c| c.type_ == "LiveMigratable" && c.status == ConditionStatus::True);
        if live {
            MigrationMode::PreCopy
        } else {
            MigrationMode::Cold
        }
    }

    /// The name in `status.migrationState.mode`.
    pub fn as_str(&self) -> &'static str {
        match self {
            MigrationMode::Cold => "Cold",
            MigrationMode::PreCopy => "PreCopy",
        }
    }
}

/// The migration reconciler.
#[derive(Debug)]
pub struct MigrationController {
    ctx: Arc<Ctx>,
    /// vmi key → migrations of it, so instance events wake them.
    index: Arc<Mutex<HashMap<ObjectKey, Vec<ObjectKey>>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl MigrationController {
    /// A controller over `ctx`.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        MigrationController {
            ctx,
            index: Arc::default(),
        }
    }

    /// Maps instance events to the migrations of that instance.
    pub fn vmi_mapper(&self) -> KeyMapper {
        let index = self.index.clone();
        Arc::new(move |ev: &WatchEvent| {
            ObjectKey::of(&ev.object)
                .and_then(|k| lock(&index).get(&k).cloned())
                .unwrap_or_default()
        })
    }

    fn index_add(&self, vmi: ObjectKey, mig: ObjectKey) {
        let mut g = lock(&self.index);
        let list = g.entry(vmi).or_default();
        if !list.contains(&mig) {
            list.push(mig);
        }
    }

    fn index_remove(&self, mig: &ObjectKey) {
        let mut g = lock(&self.index);
        for l in g.values_mut() {
            l.retain(|k| k != mig);
        }
        g.retain(|_, l| !l.is_empty());
    }

    async fn write(
        &self,
        mig: &VirtualMachineInstanceMigration,
        f: impl FnOnce(&mut VirtualMachineInstanceMigrationStatus) + Send,
    ) -> ControllerResult<()> {
        let mut m = mig.clone();
        let mut st = m.status.clone().unwrap_or_default();
        f(&mut st);
        if m.status.as_ref() == Some(&st) {
            return Ok(());
        }
        m.status = Some(st);
        self.ctx.store.update_typed(&m, UpdateScope::Status).await?;
        Ok(())
    }

    async fn fail(
        &self,
        mig: &VirtualMachineInstanceMigration,
        reason: &str,
        msg: &str,
    ) -> ControllerResult<Action> {
        info!(migration = %ns_name(mig), %msg, "migration failed");
        self.write(mig, |s| {
            s.phase = Some(MigrationPhase::Failed);
            set_condition(
                &mut s.conditions,
                "Failed",
                ConditionStatus::True,
                reason,
                msg,
            );
            if let Some(ms) = s.migration_state.as_mut() {
                ms.failed = Some(true);
                ms.completed = Some(true);
                ms.end_timestamp = Some(now());
            }
        })
        .await?;
        Ok(Action::Done)
    }

    /// Why another migration out of `source` must wait (KubeVirt's
    /// defaults: [`PARALLEL_MIGRATIONS_PER_CLUSTER`] in flight in the
    /// cluster, [`PARALLEL_OUTBOUND_MIGRATIONS_PER_NODE`] out of one node).
    async fn over_limits(&self, source: &str) -> ControllerResult<Option<String>> {
        let vmis: Vec<VirtualMachineInstance> = self
            .ctx
            .store
            .list_typed(None, &ListOptions::default())
            .await?;
        let running: Vec<&MigrationState> = vmis
            .iter()
            .filter(|v| !is_final(vmi_phase(v)))
            .filter_map(|v| v.status.as_ref()?.migration_state.as_ref())
            .filter(|m| m.completed != Some(true))
            .collect();
        let out = running
            .iter()
            .filter(|m| m.source_node.as_deref() == Some(source))
            .count();
        Ok(if running.len() >= PARALLEL_MIGRATIONS_PER_CLUSTER {
            Some(format!(
                "{} migrations are in flight in the cluster (at most {PARALLEL_MIGRATIONS_PER_CLUSTER})",
                running.len()
            ))
        } else if out >= PARALLEL_OUTBOUND_MIGRATIONS_PER_NODE {
            Some(format!(
                "{out} migrations are leaving node {source} (at most {PARALLEL_OUTBOUND_MIGRATIONS_PER_NODE})"
            ))
        } else {
            None
        })
    }

    /// Picks a target node for `vmi`: anything but its current node that
    /// carries the migration's `addedNodeSelector` labels.
    async fn target(
        &self,
        vmi: &VirtualMachineInstance,
        source: &str,
        added: Option<&std::collections::BTreeMap<String, String>>,
    ) -> ControllerResult<Result<String, String>> {
        let store = &self.ctx.store;
        let mut sched = self.ctx.scheduler.lock().await;
        let nodes: Vec<Node> = store.list_typed(None, &ListOptions::default()).await?;
        let vmis: Vec<VirtualMachineInstance> =
            store.list_typed(None, &ListOptions::default()).await?;
        let volumes: Vec<Volume> = store.list_typed(None, &ListOptions::default()).await?;
        // The instance itself is not counted: it leaves the source.
        let others: Vec<VirtualMachineInstance> =
            vmis.into_iter().filter(|v| uid(v) != uid(vmi)).collect();
        let snap =
            placement::snapshot(&nodes, &others, &volumes).map_err(ControllerError::Invalid)?;
        let mut req = placement::vm_request(vmi, &volumes).map_err(ControllerError::Invalid)?;
        let not_source = Requirement {
            key: sheaf_sched::HOSTNAME_LABEL.to_string(),
            operator: Operator::NotIn,
            values: vec![source.to_string()],
        };
        let mut extra = vec![not_source];
        for (k, v) in added.into_iter().flatten() {
            extra.push(Requirement {
                key: k.clone(),
                operator: Operator::In,
                values: vec![v.clone()],
            });
        }
        if req.node_affinity.required.is_empty() {
            req.node_affinity.required.push(Default::default());
        }
        for t in &mut req.node_affinity.required {
            t.match_expressions.extend(extra.iter().cloned());
        }
        Ok(match sched.place(&snap, &req) {
            Ok(p) => Ok(p.node),
            Err(SchedError::Unschedulable(u)) => Err(u.to_string()),
            Err(e) => return Err(ControllerError::Invalid(e.to_string())),
        })
    }
}

#[async_trait]
impl Reconciler for MigrationController {
    async fn reconcile(&self, key: &ObjectKey) -> ControllerResult<Action> {
        let store = &self.ctx.store;
        let mig: VirtualMachineInstanceMigration =
            match store.get_typed(&key.namespace, &key.name).await {
                Ok(m) => m,
                Err(StoreError::NotFound { .. }) => {
                    self.index_remove(key);
                    return Ok(Action::Done);
                }
                Err(e) => return Err(e.into()),
            };
        let phase = mig.status.as_ref().and_then(|s| s.phase);
        if deleting(&mig)
            || matches!(
                phase,
                Some(MigrationPhase::Succeeded | MigrationPhase::Failed)
            )
        {
            self.index_remove(key);
            return Ok(Action::Done);
        }
        let vmi_key = ObjectKey::new(&key.namespace, &mig.spec.vmi_name);
        self.index_add(vmi_key.clone(), key.clone());
        let vmi: VirtualMachineInstance =
            match store.get_typed(&key.namespace, &mig.spec.vmi_name).await {
                Ok(v) => v,
                Err(StoreError::NotFound { .. }) => {
                    return self
                        .fail(
                            &mig,
                            "VMINotFound",
                            &format!("instance {vmi_key} not found"),
                        )
                        .await;
                }
                Err(e) => return Err(e.into()),
            };
        let vphase = vmi_phase(&vmi);
        let mine = uid(&mig).to_string();
        let state = vmi.status.as_ref().and_then(|s| s.migration_state.clone());
        let ours = state
            .as_ref()
            .is_some_and(|m| m.migration_uid.as_deref() == Some(mine.as_str()));
        if is_final(vphase) {
            return self.fail(&mig, "VMIStopped", "the instance stopped").await;
        }
        match phase {
            None | Some(MigrationPhase::Pending | MigrationPhase::Scheduling) if !ours => {
                if vphase != Some(VmiPhase::Running) {
                    self.write(&mig, |s| {
                        s.phase = Some(MigrationPhase::Pending);
                        set_condition(
                            &mut s.conditions,
                            "Ready",
                            ConditionStatus::False,
                            "WaitingForVMI",
                            "the instance is not running",
                        );
                    })
                    .await?;
                    return Ok(Action::RequeueAfter(Duration::from_secs(5)));
                }
                if state.as_ref().is_some_and(|m| m.completed != Some(true)) {
                    return self
                        .fail(
                            &mig,
                            "MigrationInProgress",
                            "another migration of this instance is in progress",
                        )
                        .await;
                }
                let source = vmi_node(&vmi).unwrap_or("").to_string();
                if let Some(msg) = self.over_limits(&source).await? {
                    self.write(&mig, |s| {
                        s.phase = Some(MigrationPhase::Pending);
                        set_condition(
                            &mut s.conditions,
                            "Ready",
                            ConditionStatus::False,
                            "MigrationLimit",
                            &msg,
                        );
                    })
                    .await?;
                    return Ok(Action::RequeueAfter(Duration::from_secs(2)));
                }
                let target = match self
                    .target(&vmi, &source, mig.spec.added_node_selector.as_ref())
                    .await?
                {
                    Ok(t) => t,
                    Err(msg) => {
                        self.write(&mig, |s| {
                            s.phase = Some(MigrationPhase::Scheduling);
                            set_condition(
                                &mut s.conditions,
                                "Scheduled",
                                ConditionStatus::False,
                                "Unschedulable",
                                &msg,
                            );
                        })
                        .await?;
                        return Ok(Action::RequeueAfter(Duration::from_secs(15)));
                    }
                };
                let mode = MigrationMode::of(&vmi, &mig);
                let ms = MigrationState {
                    source_node: Some(source.clone()),
                    target_node: Some(target.clone()),
                    start_timestamp: Some(now()),
                    mode: Some(mode.as_str().into()),
                    migration_uid: Some(mine.clone()),
                    completed: Some(false),
                    ..Default::default()
                };
                let ms2 = ms.clone();
                store
                    .modify_typed(
                        &key.namespace,
                        &mig.spec.vmi_name,
                        UpdateScope::Status,
                        |v: &mut VirtualMachineInstance| {
                            v.status
                                .get_or_insert_with(Default::default)
                                .migration_state = Some(ms2.clone());
                        },
                    )
                    .await?;
                info!(migration = %key, %source, %target, mode = mode.as_str(), "migration scheduled");
                self.write(&mig, |s| {
                    s.phase = Some(MigrationPhase::Scheduled);
                    s.migration_state = Some(ms);
                    set_condition(
                        &mut s.conditions,
                        "Scheduled",
                        ConditionStatus::True,
                        "",
                        &format!("target node {target}"),
                    );
                })
                .await?;
                Ok(Action::Done)
            }
            _ if ours => {
                let ms = state.unwrap_or_default();
                let target = ms.target_node.clone().unwrap_or_default();
                if ms.failed == Some(true) {
                    let why = ms
                        .failure_reason
                        .clone()
                        .unwrap_or_else(|| "the live migration failed".into());
                    let msg = format!("{why}; the instance runs on, on its source node");
                    return self.fail(&mig, "MigrationFailed", &msg).await;
                }
                if vphase == Some(VmiPhase::Running) && vmi_node(&vmi) == Some(target.as_str()) {
                    let mut done = ms.clone();
                    done.completed = Some(true);
                    done.end_timestamp = Some(now());
                    let d2 = done.clone();
                    store
                        .modify_typed(
                            &key.namespace,
                            &mig.spec.vmi_name,
                            UpdateScope::Status,
                            |v: &mut VirtualMachineInstance| {
                                v.status
                                    .get_or_insert_with(Default::default)
                                    .migration_state = Some(d2.clone());
                            },
                        )
                        .await?;
                    info!(migration = %key, %target, "migration succeeded");
                    self.write(&mig, |s| {
                        s.phase = Some(MigrationPhase::Succeeded);
                        s.migration_state = Some(done);
                    })
                    .await?;
                    self.index_remove(key);
                    return Ok(Action::Done);
                }
                let p = if vmi_node(&vmi) == Some(target.as_str()) {
                    MigrationPhase::TargetReady
                } else {
                    MigrationPhase::Running
                };
                self.write(&mig, |s| s.phase = Some(p)).await?;
                Ok(Action::Done)
            }
            _ => {
                self.fail(
                    &mig,
                    "Superseded",
                    "the instance's migration state belongs to another migration",
                )
                .await
            }
        }
    }
}
