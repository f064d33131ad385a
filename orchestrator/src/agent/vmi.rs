// SPDX-License-Identifier: Apache-2.0
//! The agent's instance reconciler (virt-handler's VMI loop): starts a
//! launcher for every instance bound here once its volumes are attached to
//! this node, reports `Running` / `Succeeded` / `Failed`, hands instances
//! over on cold migration, stops launchers of deleted or moved instances,
//! and removes the launcher finalizer once a launcher is gone.

use std::sync::Arc;

use async_trait::async_trait;
use tracing::{info, warn};

use super::{Shared, launchers, lock};
use crate::controllers::runner::{Action, KeyMapper, ObjectKey, Reconciler};
use crate::controllers::util::*;
use crate::controllers::{ControllerError, ControllerResult};
use crate::launcher::{LaunchDisk, LaunchSpec, LauncherPhase, LauncherStatus};
use crate::names;
use crate::resources::common::json_str;
use crate::resources::sheaf::ReplicaState;
use crate::resources::{
    ConditionStatus, VirtualMachineInstance, VmiPhase, Volume, parse_quantity_bytes,
};
use crate::runtime::VmSpec;
use crate::store::{StoreError, StoreExt, UpdateScope, WatchEvent};

/// The built-in probe guest image (`kernelBoot.container.image`).
pub const PROBE_IMAGE: &str = "sheaf.dev/probe";

/// Maps Volume events to the instance they are attached to on `node`.
pub(crate) fn volume_mapper(node: String) -> KeyMapper {
    Arc::new(move |ev: &WatchEvent| {
        if json_str(&ev.object, "status.attachment.nodeName") != node {
            return Vec::new();
        }
        json_str(&ev.object, "status.attachment.instance")
            .split_once('/')
            .map(|(ns, n)| vec![ObjectKey::new(ns, n)])
            .unwrap_or_default()
    })
}

pub(crate) struct AgentVmiReconciler {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for AgentVmiReconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentVmiReconciler")
            .field("node", &self.shared.config.node_name)
            .finish()
    }
}

impl AgentVmiReconciler {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        AgentVmiReconciler { shared }
    }

    fn me(&self) -> &str {
        &self.shared.config.node_name
    }
}

/// Launcher state as the reconciler needs it.
enum Launcher {
    None,
    Starting,
    Running(LauncherStatus),
    Exited(LauncherStatus),
}

fn launcher_state(shared: &Shared, uid: &str) -> Launcher {
    let g = lock(&shared.launchers);
    match g.get(uid) {
        None => Launcher::None,
        Some(e) if e.exited() => Launcher::Exited(e.status.clone().unwrap_or(LauncherStatus {
            pid: 0,
            uid: uid.to_string(),
            runtime: String::new(),
            phase: LauncherPhase::Exited,
            disks: Vec::new(),
            exit: None,
            paused: false,
            commands: 0,
            command_error: None,
        })),
        Some(e) => match &e.status {
            Some(s) if s.phase == LauncherPhase::Running => Launcher::Running(s.clone()),
            _ => Launcher::Starting,
        },
    }
}

/// Builds the launch spec of an instance from its volumes' attachments.
/// `Ok(None)`: a volume is not attached here yet.
pub(crate) fn launch_spec(
    shared: &Shared,
    vmi: &VirtualMachineInstance,
    volumes: &[Volume],
) -> Result<Option<LaunchSpec>, String> {
    let cfg = &shared.config;
    let d = &vmi.spec.domain;
    let kb = d
        .firmware
        .as_ref()
        .and_then(|f| f.kernel_boot.as_ref())
        .ok_or(
            "sheaf runtimes boot kernels directly: spec.domain.firmware.kernelBoot is required",
        )?;
    let image = kb
        .container
        .as_ref()
        .map(|c| c.image.as_str())
        .unwrap_or(PROBE_IMAGE);
    let (kernel, initramfs, default_runtime) = if image == PROBE_IMAGE {
        (cfg.probe_kernel.clone(), None, "sheaf-vmm".to_string())
    } else {
        let c = kb
            .container
            .as_ref()
            .ok_or("kernelBoot.container is required")?;
        // `image` names a host directory: only inside an allowed image
        // directory, and the kernel and initrd paths stay inside it.
        let kernel = cfg
            .images
            .resolve_in(
                &c.image,
                "kernelPath",
                c.kernel_path.as_deref().unwrap_or("vmlinuz"),
            )
            .map_err(|e| format!("kernelBoot.container: {e}"))?;
        let initrd = c
            .initrd_path
            .as_deref()
            .map(|p| cfg.images.resolve_in(&c.image, "initrdPath", p))
            .transpose()
            .map_err(|e| format!("kernelBoot.container: {e}"))?;
        (kernel, initrd, cfg.linux_runtime.clone())
    };
    let runtime = vmi
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RUNTIME_ANNOTATION).cloned())
        .unwrap_or(default_runtime);
    let mem = d
        .memory
        .as_ref()
        .and_then(|m| m.guest.as_ref())
        .or(d
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.get("memory")))
        .and_then(|q| parse_quantity_bytes(&q.0))
        .unwrap_or(64 << 20);
    let vcpus = d.cpu.as_ref().map(|c| c.vcpus()).unwrap_or(1).clamp(1, 254) as u8;
    let ns = namespace(vmi);
    let mut disks = Vec::new();
    for disk in &d.devices.disks {
        let vol = vmi
            .spec
            .volumes
            .iter()
            .find(|v| v.name == disk.name)
            .ok_or(format!("disk {:?} has no volume", disk.name))?;
        let Some(vname) = vol.sheaf_volume_name() else {
            return Err(format!(
                "volume {:?}: only persistentVolumeClaim / dataVolume (sheaf Volumes) are supported by the sheaf runtimes",
                vol.name
            ));
        };
        let Some(v) = volumes
            .iter()
            .find(|v| name(*v) == vname && namespace(*v) == ns)
        else {
            return Ok(None);
        };
        let st = v.status.clone().unwrap_or_default();
        let Some(att) = st.attachment.as_ref().filter(|a| {
            a.node_name == cfg.node_name && a.instance_uid.as_deref() == Some(uid(vmi))
        }) else {
            return Ok(None);
        };
        let replicas = st
            .replicas
            .iter()
            .flatten()
            .filter_map(|r| r.address.as_deref()?.parse().ok())
            .collect::<Vec<_>>();
        if replicas.is_empty() {
            return Ok(None);
        }
        let ro = disk
            .disk
            .as_ref()
            .or(disk.cdrom.as_ref())
            .and_then(|t| t.readonly)
            .unwrap_or(false)
            || disk.cdrom.is_some();
        disks.push(LaunchDisk {
            name: disk.name.clone(),
            volume: format!("{ns}/{vname}"),
            serial: disk
                .serial
                .clone()
                .unwrap_or_else(|| disk.name.chars().take(20).collect()),
            replicas,
            epoch: att.epoch.or(st.epoch).unwrap_or(1),
            min_write_replicas: v.spec.min_write_replicas.map(|w| w as usize),
            read_only: ro,
        });
    }
    Ok(Some(LaunchSpec {
        instance: ns_name(vmi),
        uid: uid(vmi).to_string(),
        runtime,
        vm: VmSpec {
            name: name(vmi).to_string(),
            vcpus,
            memory_mib: (mem >> 20).max(16),
            kernel,
            initramfs,
            cmdline: kb
                .kernel_args
                .clone()
                .unwrap_or_else(|| "console=ttyS0".into()),
        },
        disks,
        secret_file: Some(cfg.secret_file.clone()),
        dir: names::child(&shared.launchers_dir(), uid(vmi)).map_err(|e| e.to_string())?,
    }))
}

#[async_trait]
impl Reconciler for AgentVmiReconciler {
    async fn reconcile(&self, key: &ObjectKey) -> ControllerResult<Action> {
        let shared = &self.shared;
        let store = &shared.store;
        let vmi: VirtualMachineInstance = match store.get_typed(&key.namespace, &key.name).await {
            Ok(v) => v,
            Err(StoreError::NotFound { .. }) => {
                self.stop_all_for(key);
                return Ok(Action::Done);
            }
            Err(e) => return Err(e.into()),
        };
        // Launchers of earlier incarnations of the same name.
        self.stop_others(key, uid(&vmi));
        let vuid = uid(&vmi).to_string();
        let state = launcher_state(shared, &vuid);
        let mine = vmi_node(&vmi) == Some(self.me());
        if !mine {
            // Moved away (hand-off) or never ours: make sure nothing runs here.
            match state {
                Launcher::Exited(_) => launchers::cleanup(shared, &vuid),
                Launcher::None => {}
                _ => launchers::stop(shared, &vuid),
            }
            return Ok(Action::Done);
        }
        let phase = vmi_phase(&vmi);
        if deleting(&vmi) || is_final(phase) {
            match state {
                Launcher::Starting | Launcher::Running(_) => {
                    launchers::stop(shared, &vuid);
                    return Ok(Action::Done);
                }
                Launcher::Exited(st) => {
                    if !is_final(phase) {
                        self.report_exit(&vmi, &st).await?;
                    }
                    launchers::cleanup(shared, &vuid);
                }
                Launcher::None => {}
            }
            if has_finalizer(&vmi, LAUNCHER_FINALIZER) {
                let mut v = vmi.clone();
                remove_finalizer(&mut v, LAUNCHER_FINALIZER);
                match store.update_typed(&v, UpdateScope::Main).await {
                    Ok(_) | Err(StoreError::NotFound { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            return Ok(Action::Done);
        }
        // Cold migration, source side: stop, then hand the instance over.
        let ms = vmi.status.as_ref().and_then(|s| s.migration_state.clone());
        if let Some(ms) = ms.filter(|m| {
            m.completed != Some(true)
                && m.source_node.as_deref() == Some(self.me())
                && m.target_node.as_deref().is_some_and(|t| t != self.me())
        }) && phase == Some(VmiPhase::Running)
        {
            match state {
                Launcher::Starting | Launcher::Running(_) => {
                    launchers::stop(shared, &vuid);
                }
                Launcher::Exited(_) | Launcher::None => {
                    let target = ms.target_node.clone().unwrap_or_default();
                    info!(vmi = %key, %target, "guest stopped; handing over to the migration target");
                    let mut v = vmi.clone();
                    let st = v.status.get_or_insert_with(Default::default);
                    st.node_name = Some(target.clone());
                    set_phase(st, VmiPhase::Scheduled);
                    set_condition(
                        &mut st.conditions,
                        "Ready",
                        ConditionStatus::False,
                        "Migrating",
                        &format!("moving to node {target}"),
                    );
                    store.update_typed(&v, UpdateScope::Status).await?;
                    launchers::cleanup(shared, &vuid);
                }
            }
            return Ok(Action::Done);
        }
        match (phase, state) {
            (Some(VmiPhase::Scheduled), Launcher::None) => {
                let volumes = self.volumes(&vmi).await?;
                match launch_spec(shared, &vmi, &volumes) {
                    Ok(Some(spec)) => {
                        launchers::spawn(shared, key, &spec).map_err(|e| {
                            ControllerError::Invalid(format!("starting launcher: {e}"))
                        })?;
                    }
                    Ok(None) => {} // a volume event wakes us once it is attached here
                    Err(msg) => {
                        warn!(vmi = %key, %msg, "cannot launch");
                        let mut v = vmi.clone();
                        let st = v.status.get_or_insert_with(Default::default);
                        set_phase(st, VmiPhase::Failed);
                        st.reason = Some("UnsupportedSpec".into());
                        set_condition(
                            &mut st.conditions,
                            "Ready",
                            ConditionStatus::False,
                            "UnsupportedSpec",
                            &msg,
                        );
                        store.update_typed(&v, UpdateScope::Status).await?;
                    }
                }
            }
            (Some(VmiPhase::Scheduled | VmiPhase::Running), Launcher::Running(st)) => {
                if phase != Some(VmiPhase::Running) {
                    info!(vmi = %key, node = %self.me(), runtime = %st.runtime, "running");
                }
                let mut v = vmi.clone();
                let s = v.status.get_or_insert_with(Default::default);
                set_phase(s, VmiPhase::Running);
                s.reason = None;
                set_condition(&mut s.conditions, "Ready", ConditionStatus::True, "", "");
                // KubeVirt's `Paused` condition: present while paused.
                if st.paused {
                    set_condition(
                        &mut s.conditions,
                        "Paused",
                        ConditionStatus::True,
                        "PausedByUser",
                        "VMI was paused by user",
                    );
                } else {
                    remove_condition(&mut s.conditions, "Paused");
                }
                if v.status != vmi.status {
                    store.update_typed(&v, UpdateScope::Status).await?;
                }
                self.sync_replicas(&st).await?;
            }
            (Some(VmiPhase::Scheduled | VmiPhase::Running), Launcher::Exited(st)) => {
                self.report_exit(&vmi, &st).await?;
                // The final phase triggers cleanup and finalizer removal.
            }
            (Some(VmiPhase::Running), Launcher::None) => {
                // Agent restarted and the launcher did not survive.
                let st = LauncherStatus {
                    pid: 0,
                    uid: vuid.clone(),
                    runtime: String::new(),
                    phase: LauncherPhase::Exited,
                    disks: Vec::new(),
                    exit: Some(crate::runtime::VmExit {
                        success: false,
                        reason: "launcher lost".into(),
                    }),
                    paused: false,
                    commands: 0,
                    command_error: None,
                };
                self.report_exit(&vmi, &st).await?;
            }
            _ => {}
        }
        Ok(Action::Done)
    }
}

impl AgentVmiReconciler {
    fn stop_all_for(&self, key: &ObjectKey) {
        let uids: Vec<(String, bool)> = lock(&self.shared.launchers)
            .iter()
            .filter(|(_, e)| &e.key == key)
            .map(|(u, e)| (u.clone(), e.exited()))
            .collect();
        for (u, exited) in uids {
            if exited {
                launchers::cleanup(&self.shared, &u);
            } else {
                launchers::stop(&self.shared, &u);
            }
        }
    }

    fn stop_others(&self, key: &ObjectKey, current: &str) {
        let uids: Vec<(String, bool)> = lock(&self.shared.launchers)
            .iter()
            .filter(|(u, e)| &e.key == key && u.as_str() != current)
            .map(|(u, e)| (u.clone(), e.exited()))
            .collect();
        for (u, exited) in uids {
            if exited {
                launchers::cleanup(&self.shared, &u);
            } else {
                launchers::stop(&self.shared, &u);
            }
        }
    }

    async fn volumes(&self, vmi: &VirtualMachineInstance) -> ControllerResult<Vec<Volume>> {
        let mut out = Vec::new();
        for n in vmi
            .spec
            .volumes
            .iter()
            .filter_map(|v| v.sheaf_volume_name())
        {
            match self
                .shared
                .store
                .get_typed::<Volume>(namespace(vmi), n)
                .await
            {
                Ok(v) => out.push(v),
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    async fn report_exit(
        &self,
        vmi: &VirtualMachineInstance,
        st: &LauncherStatus,
    ) -> ControllerResult<()> {
        let exit = st.exit.clone().unwrap_or(crate::runtime::VmExit {
            success: false,
            reason: "unknown".into(),
        });
        info!(vmi = %ns_name(vmi), success = exit.success, reason = %exit.reason, "instance ended");
        let mut v = vmi.clone();
        let s = v.status.get_or_insert_with(Default::default);
        let phase = if exit.success {
            VmiPhase::Succeeded
        } else {
            VmiPhase::Failed
        };
        set_phase(s, phase);
        s.reason = Some(exit.reason.clone());
        set_condition(
            &mut s.conditions,
            "Ready",
            ConditionStatus::False,
            if exit.success { "Succeeded" } else { "Failed" },
            &exit.reason,
        );
        match self
            .shared
            .store
            .update_typed(&v, UpdateScope::Status)
            .await
        {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Copies the engine's view of replica health into the volumes' status.
    async fn sync_replicas(&self, st: &LauncherStatus) -> ControllerResult<()> {
        for d in &st.disks {
            let Some((ns, n)) = d.volume.split_once('/') else {
                continue;
            };
            let vol: Volume = match self.shared.store.get_typed(ns, n).await {
                Ok(v) => v,
                Err(StoreError::NotFound { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            let mut v = vol.clone();
            for r in v
                .status
                .iter_mut()
                .flat_map(|s| s.replicas.iter_mut().flatten())
            {
                let Some(addr) = r.address.as_deref().and_then(|a| a.parse().ok()) else {
                    continue;
                };
                let new = if d.active.contains(&addr) {
                    Some(ReplicaState::Healthy)
                } else if d.rebuilding.contains(&addr) {
                    Some(ReplicaState::Rebuilding)
                } else if r.state == Some(ReplicaState::Healthy) {
                    Some(ReplicaState::Stale)
                } else {
                    r.state
                };
                if new != r.state {
                    r.state = new;
                    r.since = Some(crate::resources::common::now());
                    r.epoch = Some(d.epoch);
                }
            }
            if v.status != vol.status {
                self.shared
                    .store
                    .update_typed(&v, UpdateScope::Status)
                    .await?;
            }
        }
        Ok(())
    }
}
