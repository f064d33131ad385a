// SPDX-License-Identifier: Apache-2.0
//! The agent's instance reconciler (virt-handler's VMI loop): starts a
//! launcher for every instance bound here once its volumes are attached to
//! this node, reports `Running` / `Succeeded` / `Failed`, hands instances
//! over on cold migration, stops launchers of deleted or moved instances,
//! and removes the launcher finalizer once a launcher is gone.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;

use async_trait::async_trait;
use tracing::{info, warn};

use super::{Shared, launchers, lock};
use crate::cloudinit::{self, Flavor, Seed, SeedError};
use crate::controllers::runner::{Action, KeyMapper, ObjectKey, Reconciler};
use crate::controllers::util::*;
use crate::controllers::{ControllerError, ControllerResult};
use crate::launcher::{LaunchDisk, LaunchFileDisk, LaunchSpec, LauncherPhase, LauncherStatus};
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

/// How often an instance waiting for a cloud-init Secret looks again.
const SECRET_RETRY: Duration = Duration::from_secs(5);

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
    pub(super) shared: Arc<Shared>,
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

    pub(super) fn me(&self) -> &str {
        &self.shared.config.node_name
    }
}

/// Launcher state as the reconciler needs it.
pub(super) enum Launcher {
    None,
    Starting,
    Running(LauncherStatus),
    Exited(LauncherStatus),
}

pub(super) fn launcher_state(shared: &Shared, uid: &str) -> Launcher {
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
            migration: None,
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
    let kb = d.firmware.as_ref().and_then(|f| f.kernel_boot.as_ref());
    let Some(kb) = kb else {
        // No kernelBoot: the guest's own disk carries its kernel (a cloud
        // image), booted by sheaf-vmm's disk boot.
        return disk_boot_spec(shared, vmi, volumes);
    };
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
    let cmdline = kb
        .kernel_args
        .clone()
        .unwrap_or_else(|| "console=ttyS0".into());
    build_spec(
        shared,
        vmi,
        volumes,
        default_runtime,
        kernel,
        initramfs,
        cmdline,
        None,
    )
}

/// The launch spec of a VMI without kernelBoot: boot the kernel inside its
/// boot disk (the lowest `bootOrder`, else the first volume disk).
fn disk_boot_spec(
    shared: &Shared,
    vmi: &VirtualMachineInstance,
    volumes: &[Volume],
) -> Result<Option<LaunchSpec>, String> {
    let disks = &vmi.spec.domain.devices.disks;
    let is_seed = |name: &str| {
        vmi.spec
            .volumes
            .iter()
            .find(|v| v.name == name)
            .is_some_and(|v| Flavor::of(v).is_some())
    };
    let by_order = disks
        .iter()
        .enumerate()
        .filter_map(|(i, d)| d.boot_order.map(|o| (o, i)))
        .min()
        .map(|(_, i)| i);
    let position = by_order
        .or_else(|| disks.iter().position(|d| !is_seed(&d.name)))
        .ok_or(
            "no disk to boot from: add a persistentVolumeClaim or dataVolume disk holding a \
             bootable image, or set spec.domain.firmware.kernelBoot",
        )?;
    build_spec(
        shared,
        vmi,
        volumes,
        "sheaf-vmm".to_string(),
        PathBuf::new(),
        None,
        "console=ttyS0".into(),
        Some(position),
    )
}

#[allow(clippy::too_many_arguments)]
fn build_spec(
    shared: &Shared,
    vmi: &VirtualMachineInstance,
    volumes: &[Volume],
    default_runtime: String,
    kernel: PathBuf,
    initramfs: Option<PathBuf>,
    cmdline: String,
    boot_disk: Option<usize>,
) -> Result<Option<LaunchSpec>, String> {
    let cfg = &shared.config;
    let d = &vmi.spec.domain;
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
    let dir = names::child(&shared.launchers_dir(), uid(vmi)).map_err(|e| e.to_string())?;
    let serial = |disk: &crate::resources::kubevirt::Disk| {
        disk.serial
            .clone()
            .unwrap_or_else(|| disk.name.chars().take(20).collect())
    };
    let mut disks = Vec::new();
    let mut file_disks = Vec::new();
    for (position, disk) in d.devices.disks.iter().enumerate() {
        let vol = vmi
            .spec
            .volumes
            .iter()
            .find(|v| v.name == disk.name)
            .ok_or(format!("disk {:?} has no volume", disk.name))?;
        if let Some((flavor, _)) = Flavor::of(vol) {
            // The seed is written next to the spec just before the launch.
            file_disks.push(LaunchFileDisk {
                name: disk.name.clone(),
                path: names::child(&dir, &cloudinit::seed_file_name(flavor, &vol.name))
                    .map_err(|e| e.to_string())?,
                serial: serial(disk),
                read_only: true,
                position,
            });
            continue;
        }
        let Some(vname) = vol.sheaf_volume_name() else {
            return Err(format!(
                "volume {:?}: only persistentVolumeClaim / dataVolume (sheaf Volumes), cloudInitNoCloud and cloudInitConfigDrive are supported by the sheaf runtimes",
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
        // Attached here; or, for the target of a live migration, still to
        // the source (the target takes it over at the switch-over).
        let attached_to = super::migration::live_target(vmi, &cfg.node_name)
            .and_then(|m| m.source_node)
            .unwrap_or_else(|| cfg.node_name.clone());
        let Some(att) = st
            .attachment
            .as_ref()
            .filter(|a| a.node_name == attached_to && a.instance_uid.as_deref() == Some(uid(vmi)))
        else {
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
            serial: serial(disk),
            replicas,
            epoch: att.epoch.or(st.epoch).unwrap_or(1),
            min_write_replicas: v.spec.min_write_replicas.map(|w| w as usize),
            read_only: ro,
            size_bytes: parse_quantity_bytes(&v.spec.size.0).unwrap_or(0),
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
            cmdline,
            boot_disk,
            nets: Vec::new(),
        },
        disks,
        file_disks,
        secret_file: Some(cfg.secret_file.clone()),
        dir,
        incoming: None,
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
        if !mine && let Some(ms) = super::migration::live_target(&vmi, self.me()) {
            return super::migration::target(self, &vmi, ms).await;
        }
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
        // Live migration, source side: send the guest, the target takes over.
        if let Some(ms) = super::migration::live_source(&vmi, self.me())
            && phase == Some(VmiPhase::Running)
        {
            return super::migration::source(self, &vmi, ms, state).await;
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
                    Ok(Some(mut spec)) => match self.write_seeds(&vmi, &spec).await? {
                        Ok(()) => {
                            if let Err(msg) = super::net::attach(shared, &vmi, &mut spec).await {
                                self.fail_launch(&vmi, "NetworkError", &msg).await?;
                                return Ok(Action::Done);
                            }
                            if let Err(e) = launchers::spawn(shared, key, &spec) {
                                super::net::detach(shared, &spec);
                                return Err(ControllerError::Invalid(format!(
                                    "starting launcher: {e}"
                                )));
                            }
                        }
                        Err(e) if e.is_waiting_for_secret() => {
                            // Pending until the Secret exists (Secrets are
                            // not watched here: look again shortly).
                            let msg = e.to_string();
                            let mut v = vmi.clone();
                            let st = v.status.get_or_insert_with(Default::default);
                            set_condition(
                                &mut st.conditions,
                                "Ready",
                                ConditionStatus::False,
                                "WaitingForSecret",
                                &msg,
                            );
                            if v.status != vmi.status {
                                info!(vmi = %key, %msg, "waiting for a cloud-init Secret");
                                store.update_typed(&v, UpdateScope::Status).await?;
                            }
                            return Ok(Action::RequeueAfter(SECRET_RETRY));
                        }
                        Err(e) => {
                            self.fail_launch(&vmi, "InvalidCloudInit", &e.to_string())
                                .await?;
                        }
                    },
                    Ok(None) => {} // a volume event wakes us once it is attached here
                    Err(msg) => self.fail_launch(&vmi, "UnsupportedSpec", &msg).await?,
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
                super::migration::set_live_migratable(s, &st);
                super::migration::resume_in_doubt(self, &vmi);
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
                if let Some(spec) = launchers::spec_of(shared, &vuid) {
                    let before = s.interfaces.clone();
                    if let Some(ifs) =
                        super::net::interfaces_status(shared, &spec, before.as_deref())
                    {
                        s.interfaces = Some(ifs);
                    }
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
                    migration: None,
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

    pub(super) async fn volumes(
        &self,
        vmi: &VirtualMachineInstance,
    ) -> ControllerResult<Vec<Volume>> {
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

    /// The instance cannot start here: `Failed` with `reason`.
    async fn fail_launch(
        &self,
        vmi: &VirtualMachineInstance,
        reason: &str,
        msg: &str,
    ) -> ControllerResult<()> {
        warn!(vmi = %ns_name(vmi), %reason, %msg, "cannot launch");
        let mut v = vmi.clone();
        let st = v.status.get_or_insert_with(Default::default);
        set_phase(st, VmiPhase::Failed);
        st.reason = Some(reason.into());
        set_condition(
            &mut st.conditions,
            "Ready",
            ConditionStatus::False,
            reason,
            msg,
        );
        self.shared
            .store
            .update_typed(&v, UpdateScope::Status)
            .await?;
        Ok(())
    }

    /// Builds and writes the cloud-init seed of every file disk of `spec`
    /// into the launcher's directory. The outer error is the store's; the
    /// inner one says why a seed cannot be built (yet).
    pub(super) async fn write_seeds(
        &self,
        vmi: &VirtualMachineInstance,
        spec: &LaunchSpec,
    ) -> ControllerResult<Result<(), SeedError>> {
        if spec.file_disks.is_empty() {
            return Ok(Ok(()));
        }
        let ns = namespace(vmi);
        let mut secrets = BTreeMap::new();
        for n in vmi
            .spec
            .volumes
            .iter()
            .filter_map(|v| Some(Flavor::of(v)?.1))
            .flat_map(cloudinit::secret_names)
        {
            match self.shared.store.get_typed::<Secret>(ns, n).await {
                Ok(s) => {
                    secrets.insert(n.to_string(), s);
                }
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let inst = cloudinit::Instance {
            namespace: ns,
            uid: uid(vmi),
            hostname: vmi.spec.hostname.as_deref().unwrap_or(name(vmi)),
        };
        Ok(self.write_seed_files(vmi, spec, &inst, &secrets))
    }

    fn write_seed_files(
        &self,
        vmi: &VirtualMachineInstance,
        spec: &LaunchSpec,
        inst: &cloudinit::Instance<'_>,
        secrets: &BTreeMap<String, Secret>,
    ) -> Result<(), SeedError> {
        names::ensure_child(&self.shared.launchers_dir(), &spec.dir)?;
        std::fs::create_dir_all(&spec.dir).map_err(|source| SeedError::Io {
            path: spec.dir.clone(),
            source,
        })?;
        for fd in &spec.file_disks {
            let Some((i, ci)) = vmi
                .spec
                .volumes
                .iter()
                .enumerate()
                .find(|(_, v)| v.name == fd.name)
                .and_then(|(i, v)| Some((i, Flavor::of(v)?)))
            else {
                continue;
            };
            let (flavor, ci) = ci;
            let field = format!("spec.volumes[{i}].{}", flavor.field());
            let image = Seed::new(flavor, ci, &field, inst, secrets)?
                .image(cloudinit::volume_id(inst.uid))?;
            let path = cloudinit::write_seed(
                &spec.dir,
                &cloudinit::seed_file_name(flavor, &fd.name),
                &image,
            )?;
            debug_assert_eq!(path, fd.path);
            info!(vmi = %ns_name(vmi), disk = %fd.name, bytes = image.len(), "cloud-init seed written");
        }
        Ok(())
    }

    pub(super) async fn report_exit(
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
