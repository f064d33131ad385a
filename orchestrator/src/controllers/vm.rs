// SPDX-License-Identifier: Apache-2.0
//! The VirtualMachine controller: keeps an instance (a VMI of the same
//! name, owned by the VM) running or stopped according to the run
//! strategy, creates the VM's data volumes, and reports the VM's status.
//!
//! | strategy | instance wanted | after the instance ends |
//! |---|---|---|
//! | `Always` (`running: true`) | always | deleted and created again |
//! | `RerunOnFailure` | until it succeeds | again only if it failed |
//! | `Once` | once | kept; never restarted |
//! | `Manual` | per `status.stateChangeRequests` (`Start`/`Stop`) | kept until the next request |
//! | `Halted` (`running: false`) | never | deleted |
//!
//! An instance that fails before it ever ran counts as a start failure;
//! so does one that fails within 10 s of running. Consecutive start failures
//! back off (`CrashLoopBackOff`) per
//! [`ControlPlaneConfig::restart_backoff`](super::ControlPlaneConfig). An
//! instance that ran longer, or failed because its node was lost, is
//! restarted at once.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tracing::info;

use super::runner::{Action, ObjectKey, Reconciler};
use super::util::*;
use super::{ControllerResult, Ctx};
use crate::resources::kubevirt::{
    DataVolumeTemplateSpec, RunStrategy, StartFailure, VirtualMachineStatus,
};
use crate::resources::sheaf::{VolumeSource, VolumeSpec};
use crate::resources::{ConditionStatus, VirtualMachine, VirtualMachineInstance, VmiPhase, Volume};
use crate::store::{DeleteOptions, GroupKind, StoreError, StoreExt, UpdateScope};

/// Condition recording that a `Once` VM has started its one instance.
pub const RAN_ONCE_CONDITION: &str = "sheaf.dev/RanOnce";

/// The VirtualMachine reconciler.
#[derive(Debug)]
pub struct VmController {
    ctx: Arc<Ctx>,
}

impl VmController {
    /// A controller over `ctx`.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        VmController { ctx }
    }
}

fn owned_by(vmi: &VirtualMachineInstance, vm: &VirtualMachine) -> bool {
    vmi.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|r| r.kind == "VirtualMachine" && r.uid == uid(vm))
}

/// An instance that ran shorter than this before failing counts as a
/// start failure (crash loop).
const MIN_HEALTHY_RUN: Duration = Duration::from_secs(10);

/// Whether a failed instance counts towards the crash-loop back-off: it
/// failed on its own (not because its node was lost) before it had run
/// for [`MIN_HEALTHY_RUN`].
fn start_failure(vmi: &VirtualMachineInstance) -> bool {
    let Some(st) = vmi.status.as_ref() else {
        return true;
    };
    if st.phase != Some(VmiPhase::Failed)
        || st.reason.as_deref() == Some(super::node::NODE_UNRESPONSIVE)
    {
        return false;
    }
    let ts = st
        .phase_transition_timestamps
        .as_deref()
        .unwrap_or_default();
    let running = ts.iter().rev().find(|p| p.phase == "Running");
    let failed = ts.iter().rev().find(|p| p.phase == "Failed");
    match (running, failed) {
        (Some(r), Some(f)) => {
            let ran = f
                .phase_transition_timestamp
                .0
                .duration_since(r.phase_transition_timestamp.0);
            ran.as_secs_f64() < MIN_HEALTHY_RUN.as_secs_f64()
        }
        _ => true,
    }
}

fn seconds_until(t: &crate::resources::Time) -> Option<Duration> {
    let now = jiff::Timestamp::now();
    let d = t.0.duration_since(now);
    let secs = d.as_secs_f64();
    (secs > 0.0).then(|| Duration::from_secs_f64(secs))
}

/// Annotation of a data volume template (CDI has no checksum field): the
/// digest its `source.http` download must have, `sha256:<hex>` or
/// `sha512:<hex>`. `source.http.checksum` (a sheaf extension) wins.
pub const CHECKSUM_ANNOTATION: &str = "sheaf.dev/checksum";

/// The sheaf Volume a data volume template asks for: `source.http` becomes
/// `spec.source.image` (the URL), `source.pvc` `spec.source.volume` (a
/// clone), `source.blank` (or none) an empty volume.
pub fn volume_from_template(vm: &VirtualMachine, t: &DataVolumeTemplateSpec) -> Volume {
    let storage = t.spec.storage.as_ref().or(t.spec.pvc.as_ref());
    let size = storage
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .cloned()
        .unwrap_or_default();
    let replicas = storage
        .and_then(|s| s.storage_class_name.as_deref())
        .and_then(|c| c.strip_prefix("sheaf-"))
        .and_then(|n| n.parse().ok());
    let checksum = t
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(CHECKSUM_ANNOTATION))
        .cloned();
    let source = t.spec.source.as_ref().and_then(|s| {
        if let Some(h) = &s.http {
            Some(VolumeSource {
                image: Some(h.url.clone()),
                volume: None,
                checksum: h.checksum.clone().or(checksum),
            })
        } else {
            s.pvc.as_ref().map(|p| VolumeSource {
                image: None,
                volume: Some(p.name.clone()),
                checksum: None,
            })
        }
    });
    let mut v = Volume::new(
        t.metadata.name.as_deref().unwrap_or(""),
        VolumeSpec {
            size,
            replicas,
            source,
            ..Default::default()
        },
    )
    .in_namespace(namespace(vm));
    v.metadata.labels = t.metadata.labels.clone();
    v.metadata.owner_references = Some(vec![controller_ref(vm)]);
    v
}

/// The instance a VM runs: its template, named after the VM and owned by it.
pub fn instance_for(vm: &VirtualMachine) -> VirtualMachineInstance {
    let t = &vm.spec.template;
    let tm = t.metadata.clone().unwrap_or_default();
    let mut labels = tm.labels.unwrap_or_default();
    labels.insert(VM_NAME_LABEL.into(), name(vm).to_string());
    let mut vmi = VirtualMachineInstance::new(name(vm), t.spec.clone()).in_namespace(namespace(vm));
    vmi.metadata = ObjectMeta {
        name: Some(name(vm).to_string()),
        namespace: Some(namespace(vm).to_string()),
        labels: Some(labels),
        annotations: tm.annotations,
        owner_references: Some(vec![controller_ref(vm)]),
        ..Default::default()
    };
    vmi
}

#[async_trait]
impl Reconciler for VmController {
    async fn reconcile(&self, key: &ObjectKey) -> ControllerResult<Action> {
        let store = &self.ctx.store;
        let vm: VirtualMachine = match store.get_typed(&key.namespace, &key.name).await {
            Ok(v) => v,
            Err(StoreError::NotFound { .. }) => return Ok(Action::Done),
            Err(e) => return Err(e.into()),
        };
        if deleting(&vm) {
            self.write_status(&vm, |s| {
                s.printable_status = Some("Terminating".into());
                s.ready = Some(false);
            })
            .await?;
            return Ok(Action::Done);
        }
        self.ensure_data_volumes(&vm).await?;
        let vmi = match store
            .get_typed::<VirtualMachineInstance>(&key.namespace, &key.name)
            .await
        {
            Ok(v) => Some(v),
            Err(StoreError::NotFound { .. }) => None,
            Err(e) => return Err(e.into()),
        };
        if let Some(v) = &vmi
            && !owned_by(v, &vm)
        {
            self.write_status(&vm, |s| {
                set_condition(
                    &mut s.conditions,
                    "Failure",
                    ConditionStatus::True,
                    "FailedCreate",
                    "an instance of the same name exists and is not owned by this VM",
                );
            })
            .await?;
            return Ok(Action::Done);
        }
        let strategy = vm.spec.effective_run_strategy();
        let status = vm.status.clone().unwrap_or_default();
        let phase = vmi.as_ref().and_then(vmi_phase);
        let vmi_deleting = vmi.as_ref().is_some_and(deleting);

        // Manual start/stop requests: act on the first one, then drop it.
        let mut request = None;
        if let Some(r) = status
            .state_change_requests
            .as_ref()
            .and_then(|r| r.first())
        {
            request = Some(r.action.clone());
        }
        let desired = match strategy {
            RunStrategy::Halted => false,
            RunStrategy::Always => true,
            RunStrategy::RerunOnFailure => phase != Some(VmiPhase::Succeeded),
            RunStrategy::Once => {
                !condition_true(&status.conditions, RAN_ONCE_CONDITION) || vmi.is_some()
            }
            RunStrategy::Manual => match request.as_deref() {
                Some("Start") => true,
                Some("Stop") => false,
                _ => vmi.is_some() && !is_final(phase),
            },
        };

        let mut requeue = None;
        let mut crash_wait = false;
        match (&vmi, desired) {
            (None, true) => {
                if let Some(wait) = status
                    .start_failure
                    .as_ref()
                    .and_then(|f| f.retry_after_timestamp.as_ref())
                    .and_then(seconds_until)
                {
                    crash_wait = true;
                    requeue = Some(wait);
                } else {
                    let created = store.create_typed(&instance_for(&vm)).await;
                    match created {
                        Ok(_) | Err(StoreError::AlreadyExists { .. }) => {
                            info!(vm = %key, "instance created");
                        }
                        Err(e) => return Err(e.into()),
                    }
                    if strategy == RunStrategy::Once {
                        self.write_status(&vm, |s| {
                            set_condition(
                                &mut s.conditions,
                                RAN_ONCE_CONDITION,
                                ConditionStatus::True,
                                "Started",
                                "",
                            );
                        })
                        .await?;
                    }
                }
            }
            (Some(v), true) if is_final(phase) && !vmi_deleting => {
                // The instance ended and the strategy wants it back: restart.
                let restart = match strategy {
                    RunStrategy::Always => true,
                    RunStrategy::RerunOnFailure => phase == Some(VmiPhase::Failed),
                    RunStrategy::Manual => request.as_deref() == Some("Start"),
                    _ => false,
                };
                if restart {
                    let failed_early = start_failure(v);
                    let vmi_uid = uid(v).to_string();
                    let backoff = self.ctx.config.restart_backoff;
                    self.write_status(&vm, |s| {
                        if failed_early {
                            let f = s.start_failure.get_or_insert_with(StartFailure::default);
                            if f.last_failed_vmi_uid.as_deref() != Some(&vmi_uid) {
                                f.consecutive_fail_count += 1;
                                f.last_failed_vmi_uid = Some(vmi_uid.clone());
                                let d = backoff.delay(f.consecutive_fail_count);
                                let at = jiff::Timestamp::now()
                                    .checked_add(
                                        jiff::SignedDuration::try_from(d).unwrap_or_default(),
                                    )
                                    .unwrap_or_else(|_| jiff::Timestamp::now());
                                f.retry_after_timestamp = Some(crate::resources::Time(at));
                            }
                        } else {
                            s.start_failure = None;
                        }
                    })
                    .await?;
                    self.delete_vmi(key).await?;
                    info!(vm = %key, ?phase, "instance ended; restarting");
                }
            }
            (Some(_), false) if !vmi_deleting => {
                let keep = is_final(phase)
                    && matches!(strategy, RunStrategy::Once | RunStrategy::RerunOnFailure);
                if !keep {
                    self.delete_vmi(key).await?;
                    info!(vm = %key, "instance stopped");
                }
            }
            _ => {}
        }
        if request.is_some() {
            self.write_status(&vm, |s| {
                if let Some(r) = s.state_change_requests.as_mut()
                    && !r.is_empty()
                {
                    r.remove(0);
                }
                if s.state_change_requests
                    .as_ref()
                    .is_some_and(|r| r.is_empty())
                {
                    s.state_change_requests = None;
                }
            })
            .await?;
        }

        // Status.
        let vmi = store
            .get_typed::<VirtualMachineInstance>(&key.namespace, &key.name)
            .await
            .ok();
        let phase = vmi.as_ref().and_then(vmi_phase);
        let vmi_status = vmi
            .as_ref()
            .and_then(|v| v.status.clone())
            .unwrap_or_default();
        let ready =
            phase == Some(VmiPhase::Running) && condition_true(&vmi_status.conditions, "Ready");
        let printable = match (&vmi, phase) {
            (Some(v), _) if deleting(v) => "Stopping",
            (None, _) if crash_wait => "CrashLoopBackOff",
            (None, _) => {
                if desired {
                    "Starting"
                } else {
                    "Stopped"
                }
            }
            (Some(_), None | Some(VmiPhase::Pending | VmiPhase::Scheduling)) => {
                match condition(&vmi_status.conditions, "PodScheduled") {
                    Some(c)
                        if c.status == ConditionStatus::False
                            && c.reason.as_deref() == Some("Unschedulable") =>
                    {
                        "ErrorUnschedulable"
                    }
                    _ if condition(&vmi_status.conditions, "VolumesReady")
                        .is_some_and(|c| c.status == ConditionStatus::False) =>
                    {
                        "WaitingForVolumeBinding"
                    }
                    _ => "Starting",
                }
            }
            (Some(_), Some(VmiPhase::Scheduled)) => {
                if vmi_status
                    .migration_state
                    .as_ref()
                    .is_some_and(|m| m.completed != Some(true))
                {
                    "Migrating"
                } else {
                    "Starting"
                }
            }
            (Some(_), Some(VmiPhase::Running)) => {
                if vmi_status
                    .migration_state
                    .as_ref()
                    .is_some_and(|m| m.completed != Some(true) && m.target_node.is_some())
                {
                    "Migrating"
                } else {
                    "Running"
                }
            }
            (Some(_), Some(VmiPhase::Succeeded | VmiPhase::Failed)) => {
                if crash_wait {
                    "CrashLoopBackOff"
                } else {
                    "Stopped"
                }
            }
            (Some(_), Some(VmiPhase::Unknown)) => "Unknown",
        };
        let generation = vm.metadata.generation;
        let message = vmi_status.reason.clone().unwrap_or_default();
        self.write_status(&vm, |s| {
            s.created = Some(vmi.is_some());
            s.ready = Some(ready);
            s.printable_status = Some(printable.to_string());
            s.observed_generation = generation;
            if ready {
                set_condition(&mut s.conditions, "Ready", ConditionStatus::True, "", "");
                remove_condition(&mut s.conditions, "Failure");
            } else {
                set_condition(
                    &mut s.conditions,
                    "Ready",
                    ConditionStatus::False,
                    printable,
                    &message,
                );
            }
        })
        .await?;
        Ok(requeue.map_or(Action::Done, Action::RequeueAfter))
    }
}

impl VmController {
    async fn write_status(
        &self,
        vm: &VirtualMachine,
        f: impl FnOnce(&mut VirtualMachineStatus) + Send,
    ) -> ControllerResult<()> {
        let store = &self.ctx.store;
        let mut cur: VirtualMachine = store.get_typed(namespace(vm), name(vm)).await?;
        let before = cur.status.clone();
        let mut st = cur.status.clone().unwrap_or_default();
        f(&mut st);
        if before.as_ref() == Some(&st) {
            return Ok(());
        }
        cur.status = Some(st);
        store.update_typed(&cur, UpdateScope::Status).await?;
        Ok(())
    }

    async fn delete_vmi(&self, key: &ObjectKey) -> ControllerResult<()> {
        match self
            .ctx
            .store
            .delete(
                &GroupKind::of::<VirtualMachineInstance>(),
                &key.namespace,
                &key.name,
                &DeleteOptions::default(),
            )
            .await
        {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn ensure_data_volumes(&self, vm: &VirtualMachine) -> ControllerResult<()> {
        for t in vm.spec.data_volume_templates.iter().flatten() {
            let Some(vname) = t.metadata.name.as_deref() else {
                continue;
            };
            match self
                .ctx
                .store
                .get_typed::<Volume>(namespace(vm), vname)
                .await
            {
                Ok(_) => {}
                Err(StoreError::NotFound { .. }) => {
                    match self
                        .ctx
                        .store
                        .create_typed(&volume_from_template(vm, t))
                        .await
                    {
                        Ok(_) | Err(StoreError::AlreadyExists { .. }) => {
                            info!(vm = %ns_name(vm), volume = vname, "data volume created");
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}
