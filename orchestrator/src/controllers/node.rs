// SPDX-License-Identifier: Apache-2.0
//! The node lifecycle controller (kube-controller-manager's, plus
//! Harvester's VM failover): a node whose agent stops renewing its lease for
//! [`ControlPlaneConfig::node_grace_period`](super::ControlPlaneConfig) is
//! marked NotReady and tainted `node.kubernetes.io/unreachable:NoExecute`;
//! then every volume attached there is **fenced** (its epoch raised on the
//! replicas, so the old engine can never write again) and only then are
//! its instances failed (`NodeUnresponsive`), which lets the VM controller
//! start them elsewhere per run strategy.
//!
//! Lease renewals are timed with this process's monotonic clock when they
//! are *observed* (as Kubernetes does with `probeTimestamp`), so clock skew
//! between nodes and the control plane does not matter.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Taint;
use tracing::{info, warn};

use super::placement::UNREACHABLE_TAINT;
use super::runner::{Action, KeyMapper, ObjectKey, Reconciler};
use super::util::*;
use super::{ControllerError, ControllerResult, Ctx};
use crate::resources::common::json_str;
use crate::resources::sheaf::ReplicaState;
use crate::resources::{ConditionStatus, Node, VirtualMachineInstance, VmiPhase, Volume};
use crate::store::{
    EventType, FieldSelector, ListOptions, StoreError, StoreExt, UpdateScope, WatchEvent,
};

/// Reason on the Ready condition of a node that stopped heartbeating.
pub const NODE_STATUS_UNKNOWN: &str = "NodeStatusUnknown";
/// Reason on instances failed because their node was lost.
pub const NODE_UNRESPONSIVE: &str = "NodeUnresponsive";

/// The node lifecycle reconciler.
#[derive(Debug)]
pub struct NodeLifecycleController {
    ctx: Arc<Ctx>,
    /// node → (last lease seen, when it was first seen here).
    observed: Arc<Mutex<HashMap<String, (String, Instant)>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl NodeLifecycleController {
    /// A controller over `ctx`.
    pub fn new(ctx: Arc<Ctx>) -> Self {
        NodeLifecycleController {
            ctx,
            observed: Arc::default(),
        }
    }

    /// The primary watch's mapper: records when each lease renewal was seen.
    pub fn observer(&self) -> KeyMapper {
        let observed = self.observed.clone();
        Arc::new(move |ev: &WatchEvent| {
            let name = json_str(&ev.object, "metadata.name").to_string();
            if name.is_empty() {
                return Vec::new();
            }
            let mut g = lock(&observed);
            if ev.type_ == EventType::Deleted {
                g.remove(&name);
            } else {
                let lease = format!(
                    "{}@{}",
                    json_str(&ev.object, "status.lease.holderIdentity"),
                    json_str(&ev.object, "status.lease.renewTime")
                );
                let changed = g.get(&name).is_none_or(|(l, _)| *l != lease);
                if changed {
                    g.insert(name.clone(), (lease, Instant::now()));
                }
            }
            vec![ObjectKey::new("", &name)]
        })
    }

    fn since_renewal(&self, name: &str) -> Duration {
        let mut g = lock(&self.observed);
        let e = g
            .entry(name.to_string())
            .or_insert_with(|| (String::new(), Instant::now()));
        e.1.elapsed()
    }
}

fn has_taint(n: &Node, key: &str) -> bool {
    n.spec.taints.iter().flatten().any(|t| t.key == key)
}

#[async_trait]
impl Reconciler for NodeLifecycleController {
    async fn reconcile(&self, key: &ObjectKey) -> ControllerResult<Action> {
        let store = &self.ctx.store;
        let node: Node = match store.get_typed("", &key.name).await {
            Ok(n) => n,
            Err(StoreError::NotFound { .. }) => {
                lock(&self.observed).remove(&key.name);
                return Ok(Action::Done);
            }
            Err(e) => return Err(e.into()),
        };
        let grace = self.ctx.config.node_grace_period;
        let elapsed = self.since_renewal(&key.name);
        if elapsed < grace {
            if has_taint(&node, UNREACHABLE_TAINT) {
                info!(node = %key.name, "lease renewed; node reachable again");
                store
                    .modify_typed("", &key.name, UpdateScope::Main, |n: &mut Node| {
                        if let Some(t) = n.spec.taints.as_mut() {
                            t.retain(|t| t.key != UNREACHABLE_TAINT);
                        }
                        if n.spec.taints.as_ref().is_some_and(|t| t.is_empty()) {
                            n.spec.taints = None;
                        }
                    })
                    .await?;
            }
            // Check again just after the grace period would expire.
            return Ok(Action::RequeueAfter(
                grace - elapsed + Duration::from_millis(50),
            ));
        }
        self.node_lost(&node, elapsed).await?;
        Ok(Action::RequeueAfter(grace))
    }
}

impl NodeLifecycleController {
    async fn node_lost(&self, node: &Node, silent: Duration) -> ControllerResult<()> {
        let store = &self.ctx.store;
        let name = node.metadata.name.clone().unwrap_or_default();
        // 1. NotReady + taint, so nothing new lands here.
        let conds = node.status.as_ref().and_then(|s| s.conditions.clone());
        let already = condition(&conds, "Ready")
            .is_some_and(|c| c.status == ConditionStatus::Unknown)
            && has_taint(node, UNREACHABLE_TAINT);
        if !already {
            warn!(node = %name, silent_ms = silent.as_millis() as u64, "node lease expired; marking NotReady");
            let msg = format!(
                "node agent stopped renewing its lease {:.1}s ago",
                silent.as_secs_f64()
            );
            store
                .modify_typed("", &name, UpdateScope::Status, |n: &mut Node| {
                    let st = n.status.get_or_insert_with(Default::default);
                    set_condition(
                        &mut st.conditions,
                        "Ready",
                        ConditionStatus::Unknown,
                        NODE_STATUS_UNKNOWN,
                        &msg,
                    );
                })
                .await?;
            store
                .modify_typed("", &name, UpdateScope::Main, |n: &mut Node| {
                    if !has_taint(n, UNREACHABLE_TAINT) {
                        n.spec.taints.get_or_insert_with(Vec::new).push(Taint {
                            key: UNREACHABLE_TAINT.into(),
                            value: None,
                            effect: "NoExecute".into(),
                            time_added: Some(crate::resources::common::now()),
                        });
                    }
                })
                .await?;
        }
        // 2. Fence every volume attached to the node.
        let volumes: Vec<Volume> = store.list_typed(None, &ListOptions::default()).await?;
        for vol in volumes.iter().filter(|v| {
            v.status
                .as_ref()
                .and_then(|s| s.attachment.as_ref())
                .is_some_and(|a| a.node_name == name)
        }) {
            self.fence(vol, &name).await?;
        }
        // 3. Fail the node's instances: the VM controller restarts them.
        let opts = ListOptions {
            fields: FieldSelector::parse(&format!("status.nodeName={name}"))
                .map_err(|e| ControllerError::Invalid(e.to_string()))?,
            ..Default::default()
        };
        let vmis: Vec<VirtualMachineInstance> = store.list_typed(None, &opts).await?;
        for vmi in vmis {
            let final_ = is_final(vmi_phase(&vmi));
            if final_ && !has_finalizer(&vmi, LAUNCHER_FINALIZER) {
                continue;
            }
            info!(vmi = %ns_name(&vmi), node = %name, "failing instance of lost node");
            let mut v = vmi.clone();
            remove_finalizer(&mut v, LAUNCHER_FINALIZER);
            let st = v.status.get_or_insert_with(Default::default);
            if !final_ {
                set_phase(st, VmiPhase::Failed);
                st.reason = Some(NODE_UNRESPONSIVE.into());
                set_condition(
                    &mut st.conditions,
                    "Ready",
                    ConditionStatus::False,
                    NODE_UNRESPONSIVE,
                    &format!("node {name} stopped responding; volumes fenced"),
                );
            }
            match store.update_typed(&v, UpdateScope::All).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    async fn fence(&self, vol: &Volume, node: &str) -> ControllerResult<()> {
        let key = ns_name(vol);
        let fencer = self
            .ctx
            .fencer
            .as_ref()
            .ok_or_else(|| ControllerError::Fence {
                volume: key.clone(),
                message: "no fencer configured (ControlPlaneConfig::replication_secret)".into(),
            })?;
        let want = vol
            .status
            .as_ref()
            .and_then(|s| s.epoch)
            .unwrap_or(0)
            .checked_add(1)
            .ok_or_else(|| ControllerError::Fence {
                volume: key.clone(),
                message: format!("the volume is at the largest epoch ({})", u64::MAX),
            })?;
        let got = fencer
            .fence(vol, want)
            .await
            .map_err(|message| ControllerError::Fence {
                volume: key.clone(),
                message,
            })?;
        let node = node.to_string();
        store_fenced(&self.ctx, vol, &node, want.max(got)).await?;
        info!(volume = %key, %node, epoch = want.max(got), "fenced; attachment released");
        Ok(())
    }
}

async fn store_fenced(ctx: &Ctx, vol: &Volume, node: &str, epoch: u64) -> ControllerResult<()> {
    ctx.store
        .modify_typed(
            namespace(vol),
            name(vol),
            UpdateScope::Status,
            |v: &mut Volume| {
                let st = v.status.get_or_insert_with(Default::default);
                st.epoch = Some(st.epoch.unwrap_or(0).max(epoch));
                if st.attachment.as_ref().is_some_and(|a| a.node_name == node) {
                    st.attachment = None;
                }
                for r in st.replicas.iter_mut().flatten() {
                    if r.node_name == node && r.state != Some(ReplicaState::Failed) {
                        r.state = Some(ReplicaState::Failed);
                        r.message = Some(format!("node {node} is not ready"));
                        r.since = Some(crate::resources::common::now());
                    }
                }
            },
        )
        .await?;
    Ok(())
}
