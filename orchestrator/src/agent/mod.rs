// SPDX-License-Identifier: Apache-2.0
//! The node agent (KubeVirt's virt-handler plus Longhorn's instance
//! manager): one per node. It registers the node, renews its lease (the
//! heartbeat), serves the replicas the control plane placed on the node
//! (one `sheaf-launcher replica` process each), and runs the instances
//! bound to the node (one `sheaf-launcher vm` process each).
//!
//! ```text
//!   Store ──watch VMIs (status.nodeName = me)──► vmi reconciler ──spawn──► sheaf-launcher vm
//!     ▲   ──watch Volumes (replicas on me)────► replica reconciler ─spawn─► sheaf-launcher replica
//!     │                                                                       │
//!     └── status: VMI phase/conditions, replica address/state ◄── control.sock status lines
//!     └── heartbeat: Node.status.lease + Ready (every heartbeat_interval)
//! ```
//!
//! Launchers and replica servers are separate processes in their own
//! process groups: when the agent restarts ([`NodeAgent::shutdown`] then
//! [`NodeAgent::start`] on the same data directory) it adopts them again
//! (launchers through their control sockets, replicas through their pid
//! files). [`NodeAgent::kill`] emulates losing the whole node: every child
//! gets SIGKILL and the agent stops without cleaning up.

mod launchers;
mod migration;
mod net;
mod replicas;
mod vmi;

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::controllers::queue::WorkQueue;
use crate::controllers::runner::{Controller, ControllerBuilder, ObjectKey};
use crate::controllers::util::{now_micro, set_condition};
use crate::resources::common::now;
use crate::resources::sheaf::{NodeAddress, NodeInfo, NodeLease, NodeStatus};
use crate::resources::{ConditionStatus, Node, NodeSpec, VirtualMachineInstance, Volume};
use crate::store::{
    FieldSelector, GroupKind, Store, StoreError, StoreExt, UpdateScope, WatchOptions,
};

pub use launchers::LauncherInfo;

/// Settings of one node agent.
#[derive(Clone, Debug)]
pub struct NodeAgentConfig {
    /// Node name (also the `kubernetes.io/hostname` label).
    pub node_name: String,
    /// Where launchers and replica stores live.
    pub data_dir: PathBuf,
    /// Failure zone.
    pub zone: Option<String>,
    /// Extra node labels.
    pub labels: BTreeMap<String, String>,
    /// CPU offered to instances (millicores).
    pub cpu_millis: u64,
    /// Memory offered to instances.
    pub memory_bytes: u64,
    /// Disk space offered to replicas.
    pub storage_bytes: u64,
    /// Lease renewal period.
    pub heartbeat_interval: Duration,
    /// The `sheaf-launcher` binary.
    pub launcher_bin: PathBuf,
    /// Address replica servers listen on and advertise.
    pub replica_host: IpAddr,
    /// The replication secret file (shared with the control plane).
    pub secret_file: PathBuf,
    /// Runtime for Linux guests (`qemu` here: host KVM cannot boot Linux).
    pub linux_runtime: String,
    /// Kernel used for the built-in image `sheaf.dev/probe`.
    pub probe_kernel: PathBuf,
    /// Concurrent reconciles per agent controller.
    pub workers: usize,
    /// Where `kernelBoot.container` directories may be (default: nowhere,
    /// so only the built-in probe image boots until an operator allows a
    /// directory).
    pub images: crate::images::ImagePolicy,
    /// The node's pod network (bridge, NAT, DHCP; see [`crate::network`]).
    /// `None`: instances get no network card. Needs CAP_NET_ADMIN and a
    /// network namespace of its own per node (`cluster up --netns`).
    pub pod_network: Option<crate::network::PodNetworkConfig>,
}

impl NodeAgentConfig {
    /// Defaults for node `name` with data under `data_dir`: 4 CPUs, 8 GiB,
    /// 64 GiB of replica space, 1 s heartbeats, replicas on 127.0.0.1.
    pub fn new(
        name: &str,
        data_dir: impl Into<PathBuf>,
        launcher_bin: impl Into<PathBuf>,
        secret_file: impl Into<PathBuf>,
    ) -> Self {
        NodeAgentConfig {
            node_name: name.to_string(),
            data_dir: data_dir.into(),
            zone: None,
            labels: BTreeMap::new(),
            cpu_millis: 4000,
            memory_bytes: 8 << 30,
            storage_bytes: 64 << 30,
            heartbeat_interval: Duration::from_secs(1),
            launcher_bin: launcher_bin.into(),
            replica_host: IpAddr::from([127, 0, 0, 1]),
            secret_file: secret_file.into(),
            linux_runtime: "qemu".into(),
            probe_kernel: sheaf_vmm::probe::elf_path().to_path_buf(),
            workers: 4,
            images: crate::images::ImagePolicy::default(),
            pod_network: None,
        }
    }
}

/// Failures starting an agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The data directory is unusable.
    #[error("data directory {path}: {source}")]
    DataDir {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Registering the node failed.
    #[error("registering node: {0}")]
    Store(#[from] StoreError),
    /// The pod network could not be set up.
    #[error("pod network: {0}")]
    Network(#[from] crate::network::NetworkError),
}

/// State shared by the agent's tasks.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: NodeAgentConfig,
    pub(crate) store: Arc<dyn Store>,
    /// Instance uid → its launcher.
    pub(crate) launchers: Mutex<HashMap<String, launchers::LauncherEntry>>,
    /// Volume → the replica server of this node.
    pub(crate) replicas: Mutex<HashMap<ObjectKey, replicas::ReplicaEntry>>,
    /// The instance reconciler's queue (launcher events wake it).
    pub(crate) vmi_queue: OnceLock<Arc<WorkQueue<ObjectKey>>>,
    /// Tasks to abort on kill/shutdown (launcher connections, reapers).
    pub(crate) tasks: Mutex<Vec<JoinHandle<()>>>,
    /// The pod network, when configured.
    pub(crate) pod: OnceLock<net::PodNet>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub(crate) fn wake(&self, key: &ObjectKey) {
        if let Some(q) = self.vmi_queue.get() {
            q.add(key.clone());
        }
    }

    pub(crate) fn spawn(&self, f: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut g = lock(&self.tasks);
        g.retain(|t| !t.is_finished());
        g.push(tokio::spawn(f));
    }

    pub(crate) fn launchers_dir(&self) -> PathBuf {
        self.config.data_dir.join("launchers")
    }

    pub(crate) fn replicas_dir(&self) -> PathBuf {
        self.config.data_dir.join("replicas")
    }
}

/// A running node agent.
#[derive(Debug)]
pub struct NodeAgent {
    shared: Arc<Shared>,
    controllers: Vec<Controller>,
    heartbeat: JoinHandle<()>,
}

fn mkdir(p: &Path) -> Result<(), AgentError> {
    std::fs::create_dir_all(p).map_err(|source| AgentError::DataDir {
        path: p.to_path_buf(),
        source,
    })
}

impl NodeAgent {
    /// Registers the node, adopts launchers and replica servers left by a
    /// previous agent on the same data directory, and starts heartbeats and
    /// the reconcilers on the current tokio runtime.
    pub async fn start(
        config: NodeAgentConfig,
        store: Arc<dyn Store>,
    ) -> Result<NodeAgent, AgentError> {
        mkdir(&config.data_dir.join("launchers"))?;
        mkdir(&config.data_dir.join("replicas"))?;
        let shared = Arc::new(Shared {
            config: config.clone(),
            store: store.clone(),
            launchers: Mutex::new(HashMap::new()),
            replicas: Mutex::new(HashMap::new()),
            vmi_queue: OnceLock::new(),
            tasks: Mutex::new(Vec::new()),
            pod: OnceLock::new(),
        });
        if let Some(pc) = &config.pod_network {
            let saved = launchers::saved_specs(&shared);
            let pod = net::PodNet::start(pc, &saved)?;
            let _ = shared.pod.set(pod);
        }
        register(&shared).await?;
        let identity = uuid::Uuid::new_v4().to_string();
        heartbeat_once(&shared, &identity).await?;
        replicas::adopt(&shared);
        // Launchers are adopted before the instance controller starts: its
        // first pass must find them, or it would report a running instance
        // whose launcher survived as "launcher lost".
        let adopted = launchers::adopt(&shared);
        let name = config.node_name.clone();
        let mine = WatchOptions {
            fields: FieldSelector::parse(&format!("status.nodeName={name}"))
                .map_err(|e| StoreError::BadRequest(e.to_string()))?,
            ..Default::default()
        };
        let vmi_rec = Arc::new(vmi::AgentVmiReconciler::new(shared.clone()));
        let vmi_ctl = ControllerBuilder::new(
            "agent-vmi",
            store.clone(),
            GroupKind::of::<VirtualMachineInstance>(),
        )
        .primary_options(mine)
        .watches(GroupKind::of::<Volume>(), vmi::volume_mapper(name.clone()))
        // Instances migrating live to this node (bound to their source).
        .watches(
            GroupKind::of::<VirtualMachineInstance>(),
            migration::incoming_mapper(name.clone()),
        )
        .resync(Duration::from_secs(10))
        .workers(config.workers)
        .spawn(vmi_rec);
        let _ = shared.vmi_queue.set(vmi_ctl.queue().clone());
        for key in &adopted {
            shared.wake(key);
        }
        let rep_ctl =
            ControllerBuilder::new("agent-replicas", store.clone(), GroupKind::of::<Volume>())
                .resync(Duration::from_secs(10))
                .workers(config.workers)
                .spawn(Arc::new(replicas::ReplicaReconciler::new(shared.clone())));
        let hb_shared = shared.clone();
        let heartbeat = tokio::spawn(async move {
            loop {
                tokio::time::sleep(hb_shared.config.heartbeat_interval).await;
                if let Err(e) = heartbeat_once(&hb_shared, &identity).await {
                    warn!(node = %hb_shared.config.node_name, error = %e, "heartbeat failed");
                }
            }
        });
        info!(node = %name, dir = %config.data_dir.display(), "node agent started");
        Ok(NodeAgent {
            shared,
            controllers: vec![vmi_ctl, rep_ctl],
            heartbeat,
        })
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.shared.config.node_name
    }

    /// Launchers this agent knows (instance, pid, directory, last status).
    pub fn launchers(&self) -> Vec<LauncherInfo> {
        launchers::list(&self.shared)
    }

    /// Pids of the replica servers.
    pub fn replica_pids(&self) -> Vec<u32> {
        lock(&self.shared.replicas)
            .values()
            .filter_map(|r| r.pid)
            .collect()
    }

    /// Where the console of instance `uid` is written on this node.
    pub fn console_path(&self, uid: &str) -> Result<PathBuf, crate::names::PathError> {
        launchers::console_path(&self.shared, uid)
    }

    fn stop_tasks(&self) {
        self.heartbeat.abort();
        for c in &self.controllers {
            c.abort();
        }
        for t in lock(&self.shared.tasks).drain(..) {
            t.abort();
        }
    }

    /// Loses the node at once (tests, `sheaf node kill`): SIGKILL to every
    /// launcher and replica server, heartbeats stop, nothing is cleaned up.
    pub fn kill(self) {
        self.stop_tasks();
        let mut pids: Vec<u32> = launchers::list(&self.shared)
            .iter()
            .filter_map(|l| l.pid)
            .collect();
        pids.extend(self.replica_pids());
        for pid in &pids {
            // SAFETY: kill(2) with a pid this agent spawned; no memory is touched.
            unsafe {
                libc::kill(*pid as i32, libc::SIGKILL);
            }
        }
        // Return once they are dead (zombies count: nothing runs any more).
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        for pid in pids {
            while std::time::Instant::now() < deadline && process_running(pid) {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        warn!(node = %self.shared.config.node_name, "node killed");
    }

    /// Stops the agent only (an agent restart): launchers and replica
    /// servers keep running and are adopted by the next agent.
    pub fn shutdown(self) {
        self.stop_tasks();
        info!(node = %self.shared.config.node_name, "node agent stopped");
    }
}

/// Whether `pid` exists and is not a zombie.
fn process_running(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

fn quantity(v: u64) -> Quantity {
    Quantity(v.to_string())
}

async fn register(shared: &Shared) -> Result<(), AgentError> {
    let c = &shared.config;
    let store = &shared.store;
    let mut labels = c.labels.clone();
    labels.insert(sheaf_sched::HOSTNAME_LABEL.into(), c.node_name.clone());
    if let Some(z) = &c.zone {
        labels.insert("topology.kubernetes.io/zone".into(), z.clone());
    }
    match store.get_typed::<Node>("", &c.node_name).await {
        Ok(mut n) => {
            let mut l = n.metadata.labels.clone().unwrap_or_default();
            l.extend(labels);
            if n.metadata.labels.as_ref() != Some(&l) || n.spec.zone != c.zone {
                n.metadata.labels = Some(l);
                n.spec.zone = c.zone.clone();
                store.update_typed(&n, UpdateScope::Main).await?;
            }
        }
        Err(StoreError::NotFound { .. }) => {
            let n = Node {
                api_version: String::new(),
                kind: String::new(),
                metadata: ObjectMeta {
                    name: Some(c.node_name.clone()),
                    labels: Some(labels),
                    ..Default::default()
                },
                spec: NodeSpec {
                    zone: c.zone.clone(),
                    ..Default::default()
                },
                status: None,
            };
            match store.create_typed(&n).await {
                Ok(_) | Err(StoreError::AlreadyExists { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Err(e) => return Err(e.into()),
    }
    let res: BTreeMap<String, Quantity> = [
        ("cpu".to_string(), Quantity(format!("{}m", c.cpu_millis))),
        ("memory".to_string(), quantity(c.memory_bytes)),
        ("storage".to_string(), quantity(c.storage_bytes)),
    ]
    .into();
    let host = c.replica_host.to_string();
    let kvm = Path::new("/dev/kvm").exists();
    store
        .modify_typed("", &c.node_name, UpdateScope::Status, |n: &mut Node| {
            let st = n.status.get_or_insert_with(NodeStatus::default);
            st.capacity = Some(res.clone());
            st.allocatable = Some(res.clone());
            st.addresses = Some(vec![
                NodeAddress {
                    type_: "InternalIP".into(),
                    address: host.clone(),
                },
                NodeAddress {
                    type_: "Hostname".into(),
                    address: n.metadata.name.clone().unwrap_or_default(),
                },
            ]);
            st.node_info = Some(NodeInfo {
                agent_version: Some(env!("CARGO_PKG_VERSION").into()),
                runtimes: Some(vec!["sheaf-vmm".into(), "qemu".into()]),
                kvm: Some(kvm),
            });
        })
        .await?;
    Ok(())
}

async fn heartbeat_once(shared: &Shared, identity: &str) -> Result<(), StoreError> {
    let c = &shared.config;
    let renew = now_micro();
    let dur = (c.heartbeat_interval.as_secs_f64() * 4.0).ceil().max(1.0) as u32;
    shared
        .store
        .modify_typed("", &c.node_name, UpdateScope::Status, |n: &mut Node| {
            let st = n.status.get_or_insert_with(NodeStatus::default);
            st.lease = Some(NodeLease {
                holder_identity: identity.to_string(),
                renew_time: renew.clone(),
                lease_duration_seconds: dur,
            });
            set_condition(
                &mut st.conditions,
                "Ready",
                ConditionStatus::True,
                "AgentReady",
                "sheaf node agent is posting ready status",
            );
            if let Some(cond) = st
                .conditions
                .as_mut()
                .and_then(|l| l.iter_mut().find(|c| c.type_ == "Ready"))
            {
                cond.last_heartbeat_time = Some(now());
            }
        })
        .await?;
    Ok(())
}
