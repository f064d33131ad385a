// SPDX-License-Identifier: Apache-2.0
//! Serializable scheduler configuration (like `KubeSchedulerConfiguration`).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{SchedError, SchedResult};
use crate::framework::{Plugin, Profile};
use crate::plugins::{
    BalancedAllocation, DefaultPreemption, InterVmAffinity, NodeAffinity, NodeName,
    NodeResourcesFit, NodeUnschedulable, ResourceFitArgs, StorageLocality, TaintToleration,
    TopologySpread,
};

/// Name of the default profile.
pub const DEFAULT_PROFILE: &str = "default-scheduler";

/// The default plugins in order, with their score weights (Kubernetes'
/// defaults where a counterpart exists).
pub fn default_plugins(fit: ResourceFitArgs) -> Vec<(Arc<dyn Plugin>, i64)> {
    vec![
        (Arc::new(NodeUnschedulable), 0),
        (Arc::new(NodeName), 0),
        (Arc::new(TaintToleration), 3),
        (Arc::new(NodeAffinity), 2),
        (Arc::new(NodeResourcesFit::new(fit)), 1),
        (Arc::new(StorageLocality), 3),
        (Arc::new(InterVmAffinity), 2),
        (Arc::new(TopologySpread), 2),
        (Arc::new(BalancedAllocation), 1),
        (Arc::new(DefaultPreemption::default()), 0),
    ]
}

impl Profile {
    /// A profile with every built-in plugin (see [`default_plugins`]).
    pub fn with_defaults(name: impl Into<String>, fit: ResourceFitArgs) -> Self {
        default_plugins(fit)
            .into_iter()
            .fold(Profile::new(name), |p, (plugin, w)| {
                p.with_plugin(plugin, w)
            })
    }
}

/// One profile of a [`SchedulerConfig`]: the built-in plugins, minus
/// `disabled`, with `weights` overriding the default weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileConfig {
    /// Profile name (requests select it with `profile`).
    pub name: String,
    /// `percentageOfNodesToScore`; `None` is adaptive.
    #[serde(default)]
    pub percentage_of_nodes_to_score: Option<u32>,
    /// NodeResourcesFit arguments.
    #[serde(default)]
    pub resource_fit: ResourceFitArgs,
    /// Built-in plugins to leave out.
    #[serde(default)]
    pub disabled: Vec<String>,
    /// Score weights by plugin name.
    #[serde(default)]
    pub weights: BTreeMap<String, i64>,
}

impl Default for ProfileConfig {
    fn default() -> Self {
        Self {
            name: DEFAULT_PROFILE.into(),
            percentage_of_nodes_to_score: None,
            resource_fit: ResourceFitArgs::default(),
            disabled: Vec::new(),
            weights: BTreeMap::new(),
        }
    }
}

/// Settings of the replica scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaConfig {
    /// Sum of replica sizes a disk may be promised, in percent of its
    /// capacity minus reserved (Longhorn's storage over-provisioning, 100).
    #[serde(default = "hundred")]
    pub over_provisioning_percent: u32,
}

fn hundred() -> u32 {
    100
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            over_provisioning_percent: 100,
        }
    }
}

/// Scheduler configuration: profiles (the first is the default) and the
/// replica scheduler settings. Build a scheduler with `Scheduler::try_from`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Profiles; empty means one default profile.
    #[serde(default)]
    pub profiles: Vec<ProfileConfig>,
    /// Replica placement settings.
    #[serde(default)]
    pub replicas: ReplicaConfig,
}

impl ProfileConfig {
    /// Builds the profile.
    pub fn build(&self) -> SchedResult<Profile> {
        let names: Vec<String> = default_plugins(self.resource_fit)
            .iter()
            .map(|(p, _)| p.name().to_string())
            .collect();
        for n in self.disabled.iter().chain(self.weights.keys()) {
            if !names.contains(n) {
                return Err(SchedError::InvalidConfig {
                    reason: format!("profile {}: unknown plugin {n}", self.name),
                });
            }
        }
        if let Some(p) = self.percentage_of_nodes_to_score
            && !(1..=100).contains(&p)
        {
            return Err(SchedError::InvalidConfig {
                reason: format!(
                    "profile {}: percentage_of_nodes_to_score must be 1..=100, got {p}",
                    self.name
                ),
            });
        }
        let mut profile = Profile::new(self.name.clone())
            .percentage_of_nodes_to_score(self.percentage_of_nodes_to_score);
        for (plugin, w) in default_plugins(self.resource_fit) {
            if self.disabled.iter().any(|d| d == plugin.name()) {
                continue;
            }
            let w = self.weights.get(plugin.name()).copied().unwrap_or(w);
            profile = profile.with_plugin(plugin, w);
        }
        Ok(profile)
    }
}
