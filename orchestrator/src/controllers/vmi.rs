// SPDX-License-Identifier: Apache-2.0
//! The VirtualMachineInstance controller: waits for the instance's volumes,
//! schedules it through sheaf-sched, attaches its volumes to the chosen node
//! with a new epoch, and binds it (`status.nodeName`, phase `Scheduled`).
//! The node agent takes it from there (`Running`, `Succeeded`, `Failed`).
//!
//! ```text
//!   (new) ─► Pending ──volumes ready──► Scheduling ──placed──► Scheduled ─► (agent) Running
//!              │  VolumesReady=False        │ PodScheduled=False/Unschedulable
//!              └─ waits for the volume      └─ retried when nodes change
//! ```
//!
//! Conditions carry the events-like messages: `VolumesReady` (which volume
//! is missing or busy), `PodScheduled` (kube-scheduler's `0/3 nodes are
//! available: ...` message when unschedulable, the node when bound), and
//! `Ready` (set by the agent).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::Value;
use sheaf_sched::SchedError;
use tracing::{debug, info};

use super::placement;
use super::runner::{Action, KeyMapper, ObjectKey, Reconciler};
use super::util::*;
use super::{ControllerError, ControllerResult, Ctx};
use crate::resources::common::{json_str, now};
use crate::resources::kubevirt::{VirtualMachineInstanceStatus, VolumeStatusEntry};
use crate::resources::sheaf::{Attachment, VolumePhase};
use crate::resources::{ConditionStatus, Node, VirtualMachineInstance, VmiPhase, Volume};
use crate::store::{ListOptions, StoreError, StoreExt, UpdateScope, WatchEvent};

/// How long an unschedulable instance waits before it is tried again
/// without any node change.
const UNSCHEDULABLE_RETRY: Duration = Duration::from_secs(15);

/// The VMI reconciler.
#[derive(Debug)]
pub struct VmiController {
    ctx: Arc<Ctx>,
    index: Arc<Index>,
}

/// Which instances wait for what, so watch events of other kinds wake
/// exactly those (controller-runtime's indexers).
#[derive(Debug, Default)]
struct Index {
    /// volume key → instances waiting for it.
    volume_waiters: Mutex<HashMap<ObjectKey, HashSet<ObjectKey>>>,
    /// Instances no node could take.
    unschedulable: Mutex<HashSet<ObjectKey>>,
    /// Last scheduling-relevant fingerprint of each node.
    node_prints: Mutex<HashMap<String, String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl VmiController {
    /// A controller over `ctx`.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        VmiController {
            ctx,
            index: Arc::new(Index::default()),
        }
    }

    /// Maps Volume events to the instances waiting for (or attached to) them.
    pub fn volume_mapper(&self) -> KeyMapper {
        let index = self.index.clone();
        Arc::new(move |ev: &WatchEvent| {
            let Some(vk) = ObjectKey::of(&ev.object) else {
                return Vec::new();
            };
            let mut keys: Vec<ObjectKey> = lock(&index.volume_waiters)
                .get(&vk)
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default();
            let inst = json_str(&ev.object, "status.attachment.instance");
            if let Some((ns, n)) = inst.split_once('/') {
                keys.push(ObjectKey::new(ns, n));
            }
            keys
        })
    }

    /// Maps Node events that change what fits where to the unschedulable instances.
    pub fn node_mapper(&self) -> KeyMapper {
        let index = self.index.clone();
        Arc::new(move |ev: &WatchEvent| {
            let name = json_str(&ev.object, "metadata.name").to_string();
            let ready = ev
                .object
                .pointer("/status/conditions")
                .and_then(Value::as_array)
                .and_then(|c| c.iter().find(|c| json_str(c, "type") == "Ready"))
                .map(|c| json_str(c, "status").to_string())
                .unwrap_or_default();
            let print = format!(
                "{:?}|{}|{}|{}",
                ev.type_,
                ev.object.get("spec").cloned().unwrap_or_default(),
                ev.object
                    .pointer("/status/allocatable")
                    .cloned()
                    .unwrap_or_default(),
                ready
            );
            let changed = lock(&index.node_prints).insert(name, print.clone()) != Some(print);
            if !changed {
                return Vec::new();
            }
            lock(&index.unschedulable).iter().cloned().collect()
        })
    }

    fn forget(&self, key: &ObjectKey) {
        lock(&self.index.unschedulable).remove(key);
        for set in lock(&self.index.volume_waiters).values_mut() {
            set.remove(key);
        }
    }
}

/// Why an instance cannot be scheduled yet because of its volumes.
enum VolumeWait {
    Missing(String),
    NotReady(String, String),
    Busy(String, String),
}

impl VolumeWait {
    fn reason(&self) -> &'static str {
        match self {
            VolumeWait::Missing(_) => "VolumeNotFound",
            VolumeWait::NotReady(..) => "VolumeNotReady",
            VolumeWait::Busy(..) => "VolumeAttachedElsewhere",
        }
    }
    fn message(&self) -> String {
        match self {
            VolumeWait::Missing(v) => format!("volume {v:?} not found"),
            VolumeWait::NotReady(v, p) => format!("volume {v:?} is not ready ({p})"),
            VolumeWait::Busy(v, who) => format!("volume {v:?} is attached to {who}"),
        }
    }
}

/// Whether a volume can serve I/O: every initial replica has been created
/// and at least `minWriteReplicas` are healthy.
pub fn volume_ready(v: &Volume) -> Result<(), String> {
    let st = v.status.clone().unwrap_or_default();
    match st.phase {
        Some(VolumePhase::Available | VolumePhase::Attached | VolumePhase::Degraded) => Ok(()),
        Some(p) => Err(format!("{p:?}")),
        None => Err("Pending".into()),
    }
}

#[async_trait]
impl Reconciler for VmiController {
    async fn reconcile(&self, key: &ObjectKey) -> ControllerResult<Action> {
        let store = &self.ctx.store;
        let vmi: VirtualMachineInstance = match store.get_typed(&key.namespace, &key.name).await {
            Ok(v) => v,
            Err(StoreError::NotFound { .. }) => {
                self.forget(key);
                return Ok(Action::Done);
            }
            Err(e) => return Err(e.into()),
        };
        let phase = vmi_phase(&vmi);
        if deleting(&vmi) {
            self.forget(key);
            // Never bound, or done: no launcher can be running.
            if (vmi_node(&vmi).is_none() || is_final(phase))
                && has_finalizer(&vmi, LAUNCHER_FINALIZER)
            {
                let mut v = vmi.clone();
                remove_finalizer(&mut v, LAUNCHER_FINALIZER);
                store.update_typed(&v, UpdateScope::Main).await?;
            }
            return Ok(Action::Done);
        }
        match phase {
            None => {
                self.write(&vmi, |s| {
                    set_phase(s, VmiPhase::Pending);
                    set_condition(
                        &mut s.conditions,
                        "Ready",
                        ConditionStatus::False,
                        "Pending",
                        "",
                    );
                })
                .await?;
                Ok(Action::Done)
            }
            Some(VmiPhase::Pending | VmiPhase::Scheduling) if vmi_node(&vmi).is_none() => {
                self.schedule(key, &vmi).await
            }
            Some(VmiPhase::Scheduled) => {
                self.forget(key);
                self.ensure_attachments(&vmi).await?;
                Ok(Action::Done)
            }
            _ => {
                self.forget(key);
                Ok(Action::Done)
            }
        }
    }
}

impl VmiController {
    async fn write(
        &self,
        vmi: &VirtualMachineInstance,
        f: impl FnOnce(&mut VirtualMachineInstanceStatus) + Send,
    ) -> ControllerResult<()> {
        let mut v = vmi.clone();
        let mut st = v.status.clone().unwrap_or_default();
        f(&mut st);
        if v.status.as_ref() == Some(&st) {
            return Ok(());
        }
        v.status = Some(st);
        self.ctx.store.update_typed(&v, UpdateScope::Status).await?;
        Ok(())
    }

    async fn volumes_of(
        &self,
        vmi: &VirtualMachineInstance,
    ) -> ControllerResult<Result<Vec<Volume>, VolumeWait>> {
        let ns = namespace(vmi);
        let mut out = Vec::new();
        for name in vmi
            .spec
            .volumes
            .iter()
            .filter_map(|v| v.sheaf_volume_name())
        {
            let vk = ObjectKey::new(ns, name);
            lock(&self.index.volume_waiters)
                .entry(vk)
                .or_default()
                .insert(ObjectKey::new(ns, super::util::name(vmi)));
            let vol: Volume = match self.ctx.store.get_typed(ns, name).await {
                Ok(v) => v,
                Err(StoreError::NotFound { .. }) => {
                    return Ok(Err(VolumeWait::Missing(name.to_string())));
                }
                Err(e) => return Err(e.into()),
            };
            if let Err(p) = volume_ready(&vol) {
                return Ok(Err(VolumeWait::NotReady(name.to_string(), p)));
            }
            if let Some(a) = vol.status.as_ref().and_then(|s| s.attachment.as_ref())
                && a.instance_uid.as_deref() != Some(uid(vmi))
            {
                let who = a.instance.clone().unwrap_or_else(|| a.node_name.clone());
                return Ok(Err(VolumeWait::Busy(name.to_string(), who)));
            }
            out.push(vol);
        }
        Ok(Ok(out))
    }

    async fn schedule(
        &self,
        key: &ObjectKey,
        vmi: &VirtualMachineInstance,
    ) -> ControllerResult<Action> {
        let vols = match self.volumes_of(vmi).await? {
            Ok(v) => v,
            Err(wait) => {
                let (reason, msg) = (wait.reason(), wait.message());
                debug!(vmi = %key, %msg, "waiting for volumes");
                self.write(vmi, |s| {
                    set_phase(s, VmiPhase::Pending);
                    set_condition(
                        &mut s.conditions,
                        "VolumesReady",
                        ConditionStatus::False,
                        reason,
                        &msg,
                    );
                    s.reason = Some(reason.to_string());
                })
                .await?;
                return Ok(Action::Done);
            }
        };
        // One decision at a time: the snapshot is built from the store after
        // every earlier bind was written.
        let mut sched = self.ctx.scheduler.lock().await;
        let store = &self.ctx.store;
        let nodes: Vec<Node> = store.list_typed(None, &ListOptions::default()).await?;
        let vmis: Vec<VirtualMachineInstance> =
            store.list_typed(None, &ListOptions::default()).await?;
        let volumes: Vec<Volume> = store.list_typed(None, &ListOptions::default()).await?;
        let snap =
            placement::snapshot(&nodes, &vmis, &volumes).map_err(ControllerError::Invalid)?;
        let request = match placement::vm_request(vmi, &volumes) {
            Ok(r) => r,
            Err(msg) => {
                drop(sched);
                self.write(vmi, |s| {
                    set_phase(s, VmiPhase::Failed);
                    s.reason = Some("InvalidSpec".into());
                    set_condition(
                        &mut s.conditions,
                        "PodScheduled",
                        ConditionStatus::False,
                        "InvalidSpec",
                        &msg,
                    );
                })
                .await?;
                return Ok(Action::Done);
            }
        };
        let placed = sched.place(&snap, &request);
        let node = match placed {
            Ok(p) => p.node,
            Err(SchedError::Unschedulable(u)) => {
                drop(sched);
                let msg = u.to_string();
                lock(&self.index.unschedulable).insert(key.clone());
                info!(vmi = %key, %msg, "unschedulable");
                self.write(vmi, |s| {
                    set_phase(s, VmiPhase::Scheduling);
                    set_condition(
                        &mut s.conditions,
                        "VolumesReady",
                        ConditionStatus::True,
                        "",
                        "",
                    );
                    set_condition(
                        &mut s.conditions,
                        "PodScheduled",
                        ConditionStatus::False,
                        "Unschedulable",
                        &msg,
                    );
                    s.reason = Some("Unschedulable".into());
                })
                .await?;
                return Ok(Action::RequeueAfter(UNSCHEDULABLE_RETRY));
            }
            Err(e) => return Err(ControllerError::Invalid(format!("scheduler: {e}"))),
        };
        lock(&self.index.unschedulable).remove(key);
        // Claim the volumes for this node with a new epoch, then bind.
        for vol in &vols {
            self.attach(vol, vmi, &node).await?;
        }
        let mut v = vmi.clone();
        add_finalizer(&mut v, LAUNCHER_FINALIZER);
        let mut st = v.status.clone().unwrap_or_default();
        if st.phase == Some(VmiPhase::Pending) {
            set_phase(&mut st, VmiPhase::Scheduling);
        }
        set_phase(&mut st, VmiPhase::Scheduled);
        st.node_name = Some(node.clone());
        st.reason = None;
        set_condition(
            &mut st.conditions,
            "VolumesReady",
            ConditionStatus::True,
            "",
            "",
        );
        set_condition(
            &mut st.conditions,
            "PodScheduled",
            ConditionStatus::True,
            "Scheduled",
            &format!("bound to node {node}"),
        );
        st.volume_status = Some(
            vmi.spec
                .volumes
                .iter()
                .enumerate()
                .map(|(i, vol)| VolumeStatusEntry {
                    name: vol.name.clone(),
                    target: Some(format!("vd{}", (b'a' + (i as u8 % 26)) as char)),
                    phase: Some("Bound".into()),
                    reason: None,
                    message: None,
                })
                .collect(),
        );
        v.status = Some(st);
        store.update_typed(&v, UpdateScope::All).await?;
        drop(sched);
        info!(vmi = %key, %node, "scheduled");
        Ok(Action::Done)
    }

    /// Points a volume's attachment at (`node`, `vmi`) with the next epoch.
    async fn attach(
        &self,
        vol: &Volume,
        vmi: &VirtualMachineInstance,
        node: &str,
    ) -> ControllerResult<()> {
        let vmi_uid = uid(vmi).to_string();
        let instance = ns_name(vmi);
        let mut refused = None;
        let mut exhausted = false;
        let node_s = node.to_string();
        let updated: Volume = self
            .ctx
            .store
            .modify_typed(
                namespace(vol),
                name(vol),
                UpdateScope::Status,
                |v: &mut Volume| {
                    let st = v.status.get_or_insert_with(Default::default);
                    if let Some(a) = &st.attachment {
                        if a.instance_uid.as_deref() != Some(vmi_uid.as_str()) {
                            refused = a.instance.clone();
                            return;
                        }
                        if a.node_name == node_s {
                            return;
                        }
                    }
                    // A status someone wrote at u64::MAX has no next
                    // epoch: refuse rather than wrap to 0 (which would
                    // unfence every older engine).
                    let Some(epoch) = st.epoch.unwrap_or(0).checked_add(1) else {
                        exhausted = true;
                        return;
                    };
                    st.epoch = Some(epoch);
                    st.attachment = Some(Attachment {
                        node_name: node_s.clone(),
                        instance: Some(instance.clone()),
                        instance_uid: Some(vmi_uid.clone()),
                        epoch: Some(epoch),
                        since: Some(now()),
                    });
                    st.phase = Some(VolumePhase::Attached);
                },
            )
            .await?;
        if let Some(other) = refused {
            return Err(ControllerError::Invalid(format!(
                "volume {} was attached to {other} meanwhile",
                ns_name(vol)
            )));
        }
        if exhausted {
            return Err(ControllerError::Invalid(format!(
                "volume {} is at the largest epoch ({}); it cannot be attached again",
                ns_name(vol),
                u64::MAX
            )));
        }
        debug!(volume = %ns_name(&updated), node, epoch = ?updated.status.as_ref().and_then(|s| s.epoch), "attached");
        Ok(())
    }

    /// A bound instance not yet running on its node: its volumes must be
    /// attached to that node (after a migration hand-off, re-attach).
    async fn ensure_attachments(&self, vmi: &VirtualMachineInstance) -> ControllerResult<()> {
        let Some(node) = vmi_node(vmi) else {
            return Ok(());
        };
        let ns = namespace(vmi);
        for vname in vmi
            .spec
            .volumes
            .iter()
            .filter_map(|v| v.sheaf_volume_name())
        {
            let vol: Volume = match self.ctx.store.get_typed(ns, vname).await {
                Ok(v) => v,
                Err(StoreError::NotFound { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            let a = vol.status.as_ref().and_then(|s| s.attachment.as_ref());
            let ok = a.is_some_and(|a| {
                a.node_name == node && a.instance_uid.as_deref() == Some(uid(vmi))
            });
            if !ok {
                self.attach(&vol, vmi, node).await?;
            }
        }
        Ok(())
    }
}

/// Instance keys per namespace/volume, for tests and tools: which instances
/// reference each sheaf volume.
pub fn volume_users(vmis: &[VirtualMachineInstance]) -> BTreeMap<ObjectKey, Vec<ObjectKey>> {
    let mut out: BTreeMap<ObjectKey, Vec<ObjectKey>> = BTreeMap::new();
    for v in vmis {
        for n in v.spec.volumes.iter().filter_map(|x| x.sheaf_volume_name()) {
            out.entry(ObjectKey::new(namespace(v), n))
                .or_default()
                .push(ObjectKey::new(namespace(v), name(v)));
        }
    }
    out
}
