// SPDX-License-Identifier: Apache-2.0
//! Errors, and the human-readable "why not" of an unschedulable VM.

use std::fmt;

use serde::{Deserialize, Serialize};

/// How many nodes failed for one reason.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ReasonCount {
    /// Number of nodes.
    pub count: u32,
    /// The reason, e.g. `Insufficient memory`.
    pub reason: String,
}

/// Why nothing fits: the reasons per class of node, aggregated like
/// kube-scheduler's `FitError`.
///
/// Displays as `0/5 nodes are available: 3 Insufficient memory, 2 node(s) had
/// untolerated taint {gpu: true}.` A node that fails for two resources counts
/// in both lines, as in Kubernetes. Reasons are ordered by count (largest
/// first), then alphabetically.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub struct Unschedulable {
    /// The VM or volume that could not be placed.
    pub subject: String,
    /// Number of nodes in the snapshot.
    pub total_nodes: u32,
    /// Nodes that could be used (0 for a VM; for replicas, fewer than needed).
    #[serde(default)]
    pub available_nodes: u32,
    /// Reasons with their node counts.
    pub reasons: Vec<ReasonCount>,
    /// What preemption found, when it ran or was not allowed.
    #[serde(default)]
    pub preemption: Option<String>,
    /// A closing remark (e.g. how many replicas could be placed).
    #[serde(default)]
    pub note: Option<String>,
}

impl Unschedulable {
    /// Builds the value from unordered `(reason, count)` pairs.
    pub fn new(
        subject: impl Into<String>,
        total_nodes: u32,
        reasons: impl IntoIterator<Item = (String, u32)>,
    ) -> Self {
        let mut reasons: Vec<ReasonCount> = reasons
            .into_iter()
            .map(|(reason, count)| ReasonCount { count, reason })
            .collect();
        sort_reasons(&mut reasons);
        Self {
            subject: subject.into(),
            total_nodes,
            available_nodes: 0,
            reasons,
            preemption: None,
            note: None,
        }
    }

    /// Number of nodes that failed for `reason` (exact text).
    pub fn count_of(&self, reason: &str) -> u32 {
        self.reasons
            .iter()
            .filter(|r| r.reason == reason)
            .map(|r| r.count)
            .sum()
    }
}

pub(crate) fn sort_reasons(reasons: &mut [ReasonCount]) {
    reasons.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.reason.cmp(&b.reason)));
}

pub(crate) fn join_reasons(reasons: &[ReasonCount]) -> String {
    let mut s = String::new();
    for (i, r) in reasons.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&format!("{} {}", r.count, r.reason));
    }
    s
}

impl fmt::Display for Unschedulable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.total_nodes == 0 {
            write!(f, "0/0 nodes are available: no nodes in the cluster.")?;
        } else {
            write!(
                f,
                "{}/{} nodes are available: {}.",
                self.available_nodes,
                self.total_nodes,
                join_reasons(&self.reasons)
            )?;
        }
        if let Some(p) = &self.preemption {
            write!(f, " preemption: {p}")?;
        }
        if let Some(n) = &self.note {
            write!(f, " {n}.")?;
        }
        Ok(())
    }
}

/// Errors of sheaf-sched.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchedError {
    /// No node can take the VM or volume.
    #[error(transparent)]
    Unschedulable(Box<Unschedulable>),
    /// A plugin refused at reserve, permit or bind.
    #[error("plugin {plugin} rejected {subject} at {point}: {message}")]
    Rejected {
        /// Plugin name.
        plugin: String,
        /// Extension point.
        point: &'static str,
        /// VM name.
        subject: String,
        /// The plugin's message.
        message: String,
    },
    /// One member of a gang could not be placed, so none was.
    #[error("gang member {member} (#{index}) could not be placed, so no member was")]
    Gang {
        /// Index of the member in the gang.
        index: usize,
        /// Member VM name.
        member: String,
        /// Why.
        #[source]
        cause: Box<SchedError>,
    },
    /// `add_node` with a name that exists.
    #[error("node {node} already exists")]
    NodeExists {
        /// Node name.
        node: String,
    },
    /// No node of that name.
    #[error("unknown node {node}")]
    UnknownNode {
        /// Node name.
        node: String,
    },
    /// No disk of that name on the node.
    #[error("unknown disk {disk} on node {node}")]
    UnknownDisk {
        /// Node name.
        node: String,
        /// Disk name.
        disk: String,
    },
    /// `bind` with a VM name that is bound.
    #[error("VM {vm} is already bound")]
    VmExists {
        /// VM name.
        vm: String,
    },
    /// No bound VM of that name.
    #[error("unknown VM {vm}")]
    UnknownVm {
        /// VM name.
        vm: String,
    },
    /// More than `u32::MAX` node slots.
    #[error("too many nodes")]
    TooManyNodes,
    /// More than `u32::MAX` VM slots.
    #[error("too many VMs")]
    TooManyVms,
    /// The request names a profile the scheduler does not have.
    #[error("unknown scheduler profile {profile}")]
    UnknownProfile {
        /// Profile name.
        profile: String,
    },
    /// The configuration is not valid.
    #[error("invalid scheduler config: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: String,
    },
}

impl From<Unschedulable> for SchedError {
    fn from(u: Unschedulable) -> Self {
        SchedError::Unschedulable(Box::new(u))
    }
}

impl SchedError {
    /// The unschedulable details, if this is (or wraps) one.
    pub fn unschedulable(&self) -> Option<&Unschedulable> {
        match self {
            SchedError::Unschedulable(u) => Some(u),
            SchedError::Gang { cause, .. } => cause.unschedulable(),
            _ => None,
        }
    }
}

/// Result alias of sheaf-sched.
pub type SchedResult<T> = Result<T, SchedError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_like_kube_scheduler() {
        let u = Unschedulable::new(
            "vm",
            5,
            [
                ("node(s) had untolerated taint {gpu: true}".to_string(), 2),
                ("Insufficient memory".to_string(), 3),
            ],
        );
        assert_eq!(
            u.to_string(),
            "0/5 nodes are available: 3 Insufficient memory, 2 node(s) had untolerated taint {gpu: true}."
        );
        assert_eq!(u.count_of("Insufficient memory"), 3);
    }
}
