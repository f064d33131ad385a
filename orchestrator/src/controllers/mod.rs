// SPDX-License-Identifier: Apache-2.0
//! The control plane: KubeVirt's virt-controller (VM, VMI, migration), the
//! Longhorn manager's volume controller and Kubernetes' node lifecycle
//! controller, as level-triggered reconcile loops over any [`Store`].
//!
//! ```text
//!            ┌────────── Store (memory · redb · later kube-rs) ──────────┐
//!            │  VirtualMachine  VMI  Migration  Volume  Node             │
//!            └────▲───────────▲────▲──────▲───────▲──────▲──────────────┘
//!   VM ctl ───────┘ creates   │    │      │       │      │ heartbeats (lease)
//!     VMI + Volumes (owned)   │    │      │       │      │
//!   VMI ctl ── schedule (sched) ─ bind + attach volume (epoch + 1)
//!   Volume ctl ── place replicas (sched) · health · replacements · attachment GC
//!   Node ctl ── lease expired ─► NotReady + taint ─► fence volumes ─► fail VMIs
//!   Migration ctl ── cold: pick target ─► hand off (stop, re-attach, start)
//!                                                         ▲
//!   node agents (crate::agent) run launchers for VMIs bound to their node
//! ```
//!
//! Every controller is a [`runner::Reconciler`] driven by
//! [`runner::ControllerBuilder`]: watch-triggered plus a periodic resync,
//! with a deduplicating [`queue::WorkQueue`] and per-key backoff. They only
//! use the [`Store`] trait, so they run unchanged against a Kubernetes API
//! server once a kube-rs `Store` exists. Start them all with
//! [`ControlPlane::start`]. With [`ControlPlaneConfig::leader_election`]
//! set, several control planes share one store: all serve the API, and the
//! one holding the [`leader`] Lease runs the controllers.

pub mod fence;
pub mod leader;
pub mod migration;
pub mod node;
pub mod placement;
pub mod queue;
pub mod runner;
pub mod util;
pub mod vm;
pub mod vmi;
pub mod volume;

use std::sync::Arc;
use std::time::Duration;

use sheaf_blockrepl::net::Secret;

use self::fence::{BlockreplFencer, Fencer};
use self::leader::StartLeading;
pub use self::leader::{LeaderElection, LeaderElectionConfig};
use self::queue::Backoff;
use self::runner::{Controller, ControllerBuilder, map_owner};
use crate::api::{ApiServer, ApiServerConfig, ApiServerError, RunningApiServer};
use crate::resources::VirtualMachineInstanceMigration;
use crate::resources::{Node, Resource, VirtualMachine, VirtualMachineInstance, Volume};
use crate::store::{GroupKind, Store, StoreError};

/// Why a reconcile failed (it is retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A store call failed (conflicts are expected and retried quickly).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A volume could not be fenced; its instances are not restarted elsewhere.
    #[error("fencing volume {volume}: {message}")]
    Fence {
        /// `namespace/name`.
        volume: String,
        /// Why.
        message: String,
    },
    /// The object cannot be acted on as it is.
    #[error("{0}")]
    Invalid(String),
}

impl ControllerError {
    /// Whether this is an optimistic-concurrency conflict.
    pub fn is_conflict(&self) -> bool {
        matches!(self, ControllerError::Store(StoreError::Conflict { .. }))
    }
}

/// Result alias for reconciles.
pub type ControllerResult<T> = Result<T, ControllerError>;

/// Settings of the control plane.
#[derive(Clone, Debug)]
pub struct ControlPlaneConfig {
    /// A node whose lease was not renewed for this long is NotReady, its
    /// volumes are fenced and its instances fail over (Kubernetes: 40–50 s).
    pub node_grace_period: Duration,
    /// Full resync period of every controller.
    pub resync_period: Duration,
    /// Workers per controller.
    pub workers: usize,
    /// Per-key backoff after reconcile errors.
    pub backoff: Backoff,
    /// Crash-loop backoff of VMs whose instances fail before running
    /// (KubeVirt: 10 s doubling to 5 min).
    pub restart_backoff: Backoff,
    /// How long a replica on a lost node may stay Failed before a
    /// replacement is placed elsewhere (Longhorn: 600 s).
    pub replica_replenish_wait: Duration,
    /// Deadline of one fencing attach.
    pub fence_timeout: Duration,
    /// The replication secret; enables fencing through blockrepl.
    pub replication_secret: Option<Secret>,
    /// Also serve the Kubernetes-compatible API.
    pub api: Option<ApiServerConfig>,
    /// Run the controllers only while this control plane holds the
    /// election's Lease (several control planes on one store). `None`: run
    /// them at once (the only control plane of its store).
    pub leader_election: Option<LeaderElectionConfig>,
}

impl Default for ControlPlaneConfig {
    fn default() -> Self {
        ControlPlaneConfig {
            node_grace_period: Duration::from_secs(40),
            resync_period: Duration::from_secs(30),
            workers: 4,
            backoff: Backoff::default(),
            restart_backoff: Backoff {
                base: Duration::from_secs(10),
                max: Duration::from_secs(300),
            },
            replica_replenish_wait: Duration::from_secs(600),
            fence_timeout: Duration::from_secs(10),
            replication_secret: None,
            api: None,
            leader_election: None,
        }
    }
}

/// Failures starting the control plane.
#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    /// The API server did not start.
    #[error("API server: {0}")]
    Api(#[from] ApiServerError),
    /// The leader election settings are unusable.
    #[error("leader election: {0}")]
    LeaderElection(String),
}

/// What every controller shares.
#[derive(Debug)]
pub struct Ctx {
    /// The store.
    pub store: Arc<dyn Store>,
    /// Settings.
    pub config: ControlPlaneConfig,
    /// Volume fencing (`None`: volumes of lost nodes are never failed over).
    pub fencer: Option<Arc<dyn Fencer>>,
    /// The scheduler. One lock: placements and their binds are serialized,
    /// so every decision sees the binds before it.
    pub scheduler: tokio::sync::Mutex<sheaf_sched::Scheduler>,
}

/// A running control plane: the controllers (and optionally the API server).
#[derive(Debug)]
pub struct ControlPlane {
    store: Arc<dyn Store>,
    controllers: Vec<Controller>,
    election: Option<LeaderElection>,
    api: Option<RunningApiServer>,
}

fn gk<K: Resource>() -> GroupKind {
    GroupKind::of::<K>()
}

impl ControlPlane {
    /// Starts every controller on the current tokio runtime (and the API
    /// server if configured). A fencer other than blockrepl's can be given
    /// with [`ControlPlane::start_with_fencer`].
    pub async fn start(
        config: ControlPlaneConfig,
        store: Arc<dyn Store>,
    ) -> Result<ControlPlane, ControlPlaneError> {
        let fencer = config
            .replication_secret
            .clone()
            .map(|s| Arc::new(BlockreplFencer::new(s, config.fence_timeout)) as Arc<dyn Fencer>);
        Self::start_with_fencer(config, store, fencer).await
    }

    /// [`ControlPlane::start`] with an explicit fencer.
    pub async fn start_with_fencer(
        config: ControlPlaneConfig,
        store: Arc<dyn Store>,
        fencer: Option<Arc<dyn Fencer>>,
    ) -> Result<ControlPlane, ControlPlaneError> {
        if let Some(le) = &config.leader_election {
            le.validate().map_err(ControlPlaneError::LeaderElection)?;
        }
        let api = match &config.api {
            Some(c) => Some(ApiServer::start(c.clone(), store.clone()).await?),
            None => None,
        };
        let election = match config.leader_election.clone() {
            Some(le) => {
                let (cfg, st, fencer) = (config.clone(), store.clone(), fencer.clone());
                let start: StartLeading = Arc::new(move || {
                    let controllers = spawn_controllers(&cfg, &st, fencer.clone());
                    Box::new(move || {
                        for c in controllers {
                            c.abort();
                        }
                    })
                });
                match LeaderElection::spawn(store.clone(), le, start) {
                    Ok(e) => Some(e),
                    Err(e) => {
                        if let Some(api) = api {
                            api.shutdown().await;
                        }
                        return Err(ControlPlaneError::LeaderElection(e));
                    }
                }
            }
            None => None,
        };
        let controllers = if election.is_some() {
            Vec::new()
        } else {
            spawn_controllers(&config, &store, fencer)
        };
        tracing::info!(
            controllers = controllers.len(),
            leader_election = election.is_some(),
            "control plane started"
        );
        Ok(ControlPlane {
            store,
            controllers,
            election,
            api,
        })
    }

    /// The leader election, when the controllers run under one.
    pub fn election(&self) -> Option<&LeaderElection> {
        self.election.as_ref()
    }

    /// Whether this control plane runs the controllers now.
    pub fn is_leader(&self) -> bool {
        self.election.as_ref().is_none_or(LeaderElection::is_leader)
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The API server, if one was started.
    pub fn api(&self) -> Option<&RunningApiServer> {
        self.api.as_ref()
    }

    /// Stops the controllers (releasing the leader Lease, if held) and the
    /// API server.
    pub async fn shutdown(mut self) {
        for c in self.controllers.drain(..) {
            c.abort();
        }
        if let Some(e) = self.election.take() {
            e.shutdown().await;
        }
        if let Some(api) = self.api.take() {
            api.shutdown().await;
        }
    }
}

/// Every controller, on a fresh [`Ctx`] (and a fresh scheduler: a new
/// leader rebuilds its view from the store).
fn spawn_controllers(
    config: &ControlPlaneConfig,
    store: &Arc<dyn Store>,
    fencer: Option<Arc<dyn Fencer>>,
) -> Vec<Controller> {
    let ctx = Arc::new(Ctx {
        store: store.clone(),
        config: config.clone(),
        fencer,
        scheduler: tokio::sync::Mutex::new(sheaf_sched::Scheduler::new()),
    });
    let b = |name: &'static str, kind: GroupKind| {
        ControllerBuilder::new(name, store.clone(), kind)
            .resync(config.resync_period)
            .workers(config.workers)
            .backoff(config.backoff)
    };
    let mut controllers = Vec::new();
    controllers.push(
        b("vm", gk::<VirtualMachine>())
            .watches(gk::<VirtualMachineInstance>(), map_owner("VirtualMachine"))
            .watches(gk::<Volume>(), map_owner("VirtualMachine"))
            .spawn(Arc::new(vm::VmController::new(ctx.clone()))),
    );
    // Node changes (capacity, Ready again) may make unschedulable VMIs fit.
    let vmi_rec = Arc::new(vmi::VmiController::new(ctx.clone()));
    controllers.push(
        b("vmi", gk::<VirtualMachineInstance>())
            .watches(gk::<Volume>(), vmi_rec.volume_mapper())
            .watches(gk::<Node>(), vmi_rec.node_mapper())
            .spawn(vmi_rec),
    );
    let vol_rec = Arc::new(volume::VolumeController::new(ctx.clone()));
    controllers.push(
        b("volume", gk::<Volume>())
            .watches(gk::<Node>(), vol_rec.node_mapper())
            .watches(gk::<VirtualMachineInstance>(), volume::vmi_to_volumes())
            .spawn(vol_rec),
    );
    let node_ctl = Arc::new(node::NodeLifecycleController::new(ctx.clone()));
    controllers.push(
        b("node-lifecycle", gk::<Node>())
            .map_primary(node_ctl.observer())
            .spawn(node_ctl),
    );
    let mig_rec = Arc::new(migration::MigrationController::new(ctx.clone()));
    controllers.push(
        b("migration", gk::<VirtualMachineInstanceMigration>())
            .watches(gk::<VirtualMachineInstance>(), mig_rec.vmi_mapper())
            .spawn(mig_rec),
    );
    controllers
}
