// SPDX-License-Identifier: Apache-2.0
//! The Volume controller (Longhorn manager's volume controller): places a
//! volume's replicas with sheaf-sched's replica placement (distinct nodes,
//! zones spread, disk capacity), follows replica health, places replacements
//! for replicas lost with their node, and releases attachments of instances
//! that are gone.
//!
//! ```text
//!   Pending ──placed──► Creating ──every replica served──► Available ⇄ Attached
//!                                                             │ healthy < replicas: Degraded
//!                                                             └ healthy < minWriteReplicas: Faulted
//! ```
//!
//! Division of labour: this controller decides *where* replicas live
//! (`status.replicas[].nodeName`); the node agent of each node creates and
//! serves them (`address`, `state`); the VMI controller attaches (epoch + 1);
//! the node lifecycle controller fences. A replacement replica starts
//! `Rebuilding` and is filled by the next engine that attaches the volume.
//!
//! A volume with `spec.source.image` (or `spec.source.volume`, a clone)
//! stays `Creating` after its replicas
//! are served until an importer (the `sheaf` cluster binary's source
//! importer) sets its [`SOURCE_IMPORTED`] condition to `True`, so no
//! instance attaches it before its contents are in.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use sheaf_sched::SchedError;
use tracing::{info, warn};

use super::placement;
use super::runner::{Action, KeyMapper, ObjectKey, Reconciler};
use super::util::*;
use super::{ControllerError, ControllerResult, Ctx};
use crate::resources::common::{json_str, now};
use crate::resources::sheaf::{ReplicaState, ReplicaStatus, VolumePhase, VolumeStatus};
use crate::resources::{
    ConditionStatus, Node, VirtualMachineInstance, Volume, parse_quantity_bytes,
};
use crate::store::{ListOptions, StoreError, StoreExt, UpdateScope, WatchEvent};

/// Condition of a volume with `spec.source.image` or `spec.source.volume`:
/// `True` once the image or the clone
/// is in (until then the volume stays `Creating`); its reason and message
/// carry the import's progress or failure.
pub const SOURCE_IMPORTED: &str = "Imported";

/// The Volume reconciler.
#[derive(Debug)]
pub struct VolumeController {
    ctx: Arc<Ctx>,
    /// node → volumes with a replica there (to wake them on node changes).
    by_node: Arc<Mutex<HashMap<String, HashSet<ObjectKey>>>>,
    /// node → last seen Ready status (wake only on changes).
    node_ready: Arc<Mutex<HashMap<String, String>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Maps instance events to the volumes they reference.
pub fn vmi_to_volumes() -> KeyMapper {
    Arc::new(|ev: &WatchEvent| {
        let ns = json_str(&ev.object, "metadata.namespace");
        ev.object
            .pointer("/spec/volumes")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|v| {
                let n = json_str(v, "persistentVolumeClaim.claimName");
                let n = if n.is_empty() {
                    json_str(v, "dataVolume.name")
                } else {
                    n
                };
                (!n.is_empty()).then(|| ObjectKey::new(ns, n))
            })
            .collect()
    })
}

fn node_ready(n: &Node) -> bool {
    condition_true(
        &n.status.as_ref().and_then(|s| s.conditions.clone()),
        "Ready",
    )
}

impl VolumeController {
    /// A controller over `ctx`.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        VolumeController {
            ctx,
            by_node: Arc::default(),
            node_ready: Arc::default(),
        }
    }

    /// Maps Node events that change readiness (or remove the node) to the
    /// volumes with replicas there.
    pub fn node_mapper(&self) -> KeyMapper {
        let by_node = self.by_node.clone();
        let seen = self.node_ready.clone();
        Arc::new(move |ev: &WatchEvent| {
            let name = json_str(&ev.object, "metadata.name").to_string();
            let ready = ev
                .object
                .pointer("/status/conditions")
                .and_then(Value::as_array)
                .and_then(|c| c.iter().find(|c| json_str(c, "type") == "Ready"))
                .map(|c| json_str(c, "status").to_string())
                .unwrap_or_default();
            let print = format!("{:?}{ready}", ev.type_ == crate::store::EventType::Deleted);
            if lock(&seen).insert(name.clone(), print.clone()) == Some(print) {
                return Vec::new();
            }
            lock(&by_node)
                .get(&name)
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default()
        })
    }

    fn index(&self, key: &ObjectKey, st: &VolumeStatus) {
        let mut g = lock(&self.by_node);
        for set in g.values_mut() {
            set.remove(key);
        }
        for r in st.replicas.iter().flatten() {
            g.entry(r.node_name.clone())
                .or_default()
                .insert(key.clone());
        }
    }
}

#[async_trait]
impl Reconciler for VolumeController {
    async fn reconcile(&self, key: &ObjectKey) -> ControllerResult<Action> {
        let store = &self.ctx.store;
        let vol: Volume = match store.get_typed(&key.namespace, &key.name).await {
            Ok(v) => v,
            Err(StoreError::NotFound { .. }) => {
                self.index(key, &VolumeStatus::default());
                return Ok(Action::Done);
            }
            Err(e) => return Err(e.into()),
        };
        if deleting(&vol) {
            return Ok(Action::Done);
        }
        let before = vol.status.clone().unwrap_or_default();
        if before.replicas.as_ref().is_none_or(|r| r.is_empty()) {
            return self.place_initial(key, &vol).await;
        }
        let nodes: Vec<Node> = store.list_typed(None, &ListOptions::default()).await?;
        let ready: HashMap<String, bool> = nodes
            .iter()
            .map(|n| (n.metadata.name.clone().unwrap_or_default(), node_ready(n)))
            .collect();
        let mut st = before.clone();
        let mut requeue: Option<Duration> = None;

        // Replicas on lost nodes are Failed.
        for r in st.replicas.iter_mut().flatten() {
            let up = ready.get(&r.node_name).copied().unwrap_or(false);
            if !up && r.state != Some(ReplicaState::Failed) {
                r.state = Some(ReplicaState::Failed);
                r.message = Some(format!("node {} is not ready", r.node_name));
                r.since = Some(now());
            }
        }

        // Replacements for replicas failed longer than the replenish wait.
        let wait = self.ctx.config.replica_replenish_wait;
        let desired = vol.spec.replica_count() as usize;
        let existing: Vec<(String, bool)> = st
            .replicas
            .iter()
            .flatten()
            .map(|r| (r.node_name.clone(), r.state != Some(ReplicaState::Failed)))
            .collect();
        let live = existing.iter().filter(|e| e.1).count();
        let expired: Vec<String> = st
            .replicas
            .iter()
            .flatten()
            .filter(|r| r.state == Some(ReplicaState::Failed))
            .filter(|r| {
                let age = r
                    .since
                    .as_ref()
                    .map(|t| jiff::Timestamp::now().duration_since(t.0).as_secs_f64())
                    .unwrap_or(f64::MAX);
                if age < wait.as_secs_f64() {
                    let left = Duration::from_secs_f64(wait.as_secs_f64() - age);
                    requeue = Some(requeue.map_or(left, |d| d.min(left)));
                    false
                } else {
                    true
                }
            })
            .map(|r| r.node_name.clone())
            .collect();
        if live < desired && !expired.is_empty() {
            match self.place(&vol, &existing).await? {
                Ok(targets) if !targets.is_empty() => {
                    let mut replaced = 0;
                    let reps = st.replicas.get_or_insert_with(Vec::new);
                    for t in targets {
                        // Drop one expired replica per replacement.
                        if let Some(i) = reps.iter().position(|r| {
                            r.state == Some(ReplicaState::Failed) && expired.contains(&r.node_name)
                        }) {
                            reps.remove(i);
                        }
                        info!(volume = %key, node = %t, "placing replacement replica");
                        reps.push(ReplicaStatus {
                            node_name: t,
                            state: Some(ReplicaState::Rebuilding),
                            message: Some("replacement; rebuilt at the next attach".into()),
                            since: Some(now()),
                            ..Default::default()
                        });
                        replaced += 1;
                    }
                    debug_assert!(replaced > 0);
                }
                Ok(_) => {}
                Err(msg) => {
                    set_condition(
                        &mut st.conditions,
                        "ReplicasScheduled",
                        ConditionStatus::False,
                        "Unschedulable",
                        &msg,
                    );
                    requeue = Some(
                        requeue.map_or(Duration::from_secs(30), |d| d.min(Duration::from_secs(30))),
                    );
                }
            }
        }

        // Attachments of instances that are gone or finished (and stopped).
        if let Some(a) = st.attachment.clone() {
            let valid = match a.instance.as_deref().and_then(|i| i.split_once('/')) {
                Some((ns, n)) => match store.get_typed::<VirtualMachineInstance>(ns, n).await {
                    Ok(vmi) => {
                        let stopped =
                            is_final(vmi_phase(&vmi)) && !has_finalizer(&vmi, LAUNCHER_FINALIZER);
                        uid(&vmi) == a.instance_uid.as_deref().unwrap_or("") && !stopped
                    }
                    Err(StoreError::NotFound { .. }) => false,
                    Err(e) => return Err(e.into()),
                },
                None => false,
            };
            if !valid {
                info!(volume = %key, instance = ?a.instance, "releasing attachment");
                st.attachment = None;
            }
        }

        // Phase and health.
        let reps = st.replicas.clone().unwrap_or_default();
        let n = reps.len().max(1);
        let w = vol.spec.min_write_replicas.unwrap_or(2).clamp(1, n as u32) as usize;
        let healthy = reps
            .iter()
            .filter(|r| r.state == Some(ReplicaState::Healthy))
            .count();
        let creating = reps
            .iter()
            .any(|r| r.address.is_none() && r.state != Some(ReplicaState::Failed));
        let never_served = reps.iter().all(|r| r.address.is_none());
        let import_pending = vol
            .spec
            .source
            .as_ref()
            .is_some_and(|s| s.image.is_some() || s.volume.is_some())
            && !condition_true(&st.conditions, SOURCE_IMPORTED)
            && st.attachment.is_none();
        st.phase = Some(
            if never_served
                || import_pending
                || (creating && st.phase == Some(VolumePhase::Creating))
            {
                VolumePhase::Creating
            } else if healthy < w
                && st.attachment.is_none()
                && !reps.iter().any(|r| {
                    r.state == Some(ReplicaState::Rebuilding)
                        || r.state == Some(ReplicaState::Stale)
                })
            {
                VolumePhase::Faulted
            } else if st.attachment.is_some() {
                VolumePhase::Attached
            } else if healthy < desired {
                VolumePhase::Degraded
            } else {
                VolumePhase::Available
            },
        );
        let msg = format!("{healthy}/{desired} replicas healthy");
        if healthy >= desired {
            set_condition(
                &mut st.conditions,
                "Healthy",
                ConditionStatus::True,
                "",
                &msg,
            );
        } else {
            set_condition(
                &mut st.conditions,
                "Healthy",
                ConditionStatus::False,
                "Degraded",
                &msg,
            );
        }
        self.index(key, &st);
        if st != before {
            let mut v = vol.clone();
            v.status = Some(st);
            store.update_typed(&v, UpdateScope::Status).await?;
        }
        Ok(requeue.map_or(Action::Done, Action::RequeueAfter))
    }
}

impl VolumeController {
    /// New replica nodes for `vol`, keeping `existing`. `Ok(Err(msg))` when
    /// sched finds no place.
    async fn place(
        &self,
        vol: &Volume,
        existing: &[(String, bool)],
    ) -> ControllerResult<Result<Vec<String>, String>> {
        let store = &self.ctx.store;
        let sched = self.ctx.scheduler.lock().await;
        let nodes: Vec<Node> = store.list_typed(None, &ListOptions::default()).await?;
        let volumes: Vec<Volume> = store.list_typed(None, &ListOptions::default()).await?;
        let mut snap =
            placement::snapshot(&nodes, &[], &volumes).map_err(ControllerError::Invalid)?;
        // Replicas go only to nodes that are up.
        for n in nodes.iter().filter(|n| !node_ready(n)) {
            let _ = snap.set_unschedulable(n.metadata.name.as_deref().unwrap_or(""), true);
        }
        let req = placement::replica_request(vol, existing).map_err(ControllerError::Invalid)?;
        let res = sched.place_replicas(&snap, &req);
        drop(sched);
        match res {
            Ok(p) => Ok(Ok(p.targets.into_iter().map(|t| t.node).collect())),
            Err(SchedError::Unschedulable(u)) => Ok(Err(u.to_string())),
            Err(e) => Err(ControllerError::Invalid(format!("replica placement: {e}"))),
        }
    }

    async fn place_initial(&self, key: &ObjectKey, vol: &Volume) -> ControllerResult<Action> {
        let size = parse_quantity_bytes(&vol.spec.size.0).unwrap_or(0);
        match self.place(vol, &[]).await? {
            Ok(targets) => {
                info!(volume = %key, nodes = ?targets, "replicas placed");
                let mut v = vol.clone();
                let st = v.status.get_or_insert_with(Default::default);
                st.replicas = Some(
                    targets
                        .into_iter()
                        .map(|n| ReplicaStatus {
                            node_name: n,
                            since: Some(now()),
                            ..Default::default()
                        })
                        .collect(),
                );
                st.phase = Some(VolumePhase::Creating);
                st.epoch = Some(st.epoch.unwrap_or(0));
                st.capacity = Some(k8s_openapi::apimachinery::pkg::api::resource::Quantity(
                    size.to_string(),
                ));
                set_condition(
                    &mut st.conditions,
                    "ReplicasScheduled",
                    ConditionStatus::True,
                    "",
                    "",
                );
                self.index(key, st);
                self.ctx.store.update_typed(&v, UpdateScope::Status).await?;
                Ok(Action::Done)
            }
            Err(msg) => {
                warn!(volume = %key, %msg, "replicas unschedulable");
                let mut v = vol.clone();
                let st = v.status.get_or_insert_with(Default::default);
                st.phase = Some(VolumePhase::Pending);
                set_condition(
                    &mut st.conditions,
                    "ReplicasScheduled",
                    ConditionStatus::False,
                    "Unschedulable",
                    &msg,
                );
                if vol.status.as_ref() != Some(st) {
                    self.ctx.store.update_typed(&v, UpdateScope::Status).await?;
                }
                Ok(Action::RequeueAfter(Duration::from_secs(10)))
            }
        }
    }
}
