// SPDX-License-Identifier: Apache-2.0
//! A scheduler and the cluster snapshot it places onto, as one object.
//!
//! Every type that crosses the boundary is sheaf-sched's own serde type
//! (`Node`, `Request`, `Placement`, `ReplicaRequest`, `ReplicaPlacement`,
//! `SchedulerConfig`), so JSON in and out is exactly docs/sched.md.

use serde::Serialize;
use serde::de::DeserializeOwned;
use sheaf_sched::{
    ClusterSnapshot, Node, Placement, ReplicaPlacement, ReplicaRequest, Request, Scheduler,
    SchedulerConfig,
};

use crate::error::{Error, Result};

/// A scheduler plus its cluster snapshot. Not internally locked: wrap it
/// in a mutex to share it.
#[derive(Debug)]
pub struct SchedHandle {
    scheduler: Scheduler,
    snapshot: ClusterSnapshot,
}

/// One node as the snapshot sees it now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeUsage {
    /// Node name.
    pub name: String,
    /// Allocatable CPU in millicores.
    pub allocatable_cpu_millis: u64,
    /// Allocatable memory in bytes.
    pub allocatable_memory_bytes: u64,
    /// CPU requested by bound VMs.
    pub requested_cpu_millis: u64,
    /// Memory requested by bound VMs.
    pub requested_memory_bytes: u64,
    /// Bound VMs.
    pub vms: u32,
    /// Cordoned.
    pub unschedulable: bool,
}

pub(crate) fn from_json<T: DeserializeOwned>(what: &'static str, s: &str) -> Result<T> {
    serde_json::from_str(s).map_err(|source| Error::Json { what, source })
}

pub(crate) fn to_json<T: Serialize>(what: &'static str, v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|source| Error::Json { what, source })
}

impl Default for SchedHandle {
    fn default() -> Self {
        SchedHandle::new()
    }
}

impl SchedHandle {
    /// The default profile over an empty cluster.
    pub fn new() -> SchedHandle {
        SchedHandle {
            scheduler: Scheduler::new(),
            snapshot: ClusterSnapshot::new(),
        }
    }

    /// Profiles from a `SchedulerConfig` JSON document.
    pub fn with_config_json(json: &str) -> Result<SchedHandle> {
        let cfg: SchedulerConfig = from_json("scheduler config", json)?;
        Ok(SchedHandle {
            scheduler: Scheduler::try_from(cfg)?,
            snapshot: ClusterSnapshot::new(),
        })
    }

    /// Adds a node.
    pub fn add_node(&mut self, node: Node) -> Result<()> {
        Ok(self.snapshot.add_node(node)?)
    }

    /// Adds a node from `Node` JSON.
    pub fn add_node_json(&mut self, json: &str) -> Result<()> {
        self.add_node(from_json("node", json)?)
    }

    /// Replaces a node's spec (bound VMs stay).
    pub fn update_node_json(&mut self, json: &str) -> Result<()> {
        Ok(self.snapshot.update_node(from_json("node", json)?)?)
    }

    /// Removes a node; returns the VMs that were bound to it.
    pub fn remove_node(&mut self, name: &str) -> Result<Vec<String>> {
        Ok(self.snapshot.remove_node(name)?)
    }

    /// Cordons or uncordons a node.
    pub fn set_unschedulable(&mut self, name: &str, on: bool) -> Result<()> {
        Ok(self.snapshot.set_unschedulable(name, on)?)
    }

    /// Chooses a node. With `bind`, the VM is recorded on it (victims of a
    /// preemption are evicted first), so later placements see it.
    pub fn place(&mut self, request: &Request, bind: bool) -> Result<Placement> {
        if bind {
            Ok(self.scheduler.schedule(&mut self.snapshot, request)?)
        } else {
            Ok(self.scheduler.place(&self.snapshot, request)?)
        }
    }

    /// [`place`](Self::place) with `Request` JSON in and `Placement` JSON out.
    pub fn place_json(&mut self, request: &str, bind: bool) -> Result<String> {
        let req: Request = from_json("request", request)?;
        to_json("placement", &self.place(&req, bind)?)
    }

    /// Places a group all-or-nothing; `Request` JSON array in,
    /// `Placement` JSON array out. Members are bound.
    pub fn place_gang_json(&mut self, requests: &str) -> Result<String> {
        let reqs: Vec<Request> = from_json("requests", requests)?;
        let p = self.scheduler.place_gang(&mut self.snapshot, &reqs)?;
        to_json("placements", &p)
    }

    /// Chooses nodes and disks for a volume's replicas
    /// (`ReplicaRequest` JSON in, `ReplicaPlacement` JSON out); with `bind`
    /// the disk space is reserved in the snapshot.
    pub fn place_replicas_json(&mut self, request: &str, bind: bool) -> Result<String> {
        let req: ReplicaRequest = from_json("replica request", request)?;
        let p: ReplicaPlacement = self.scheduler.place_replicas(&self.snapshot, &req)?;
        if bind {
            self.snapshot.bind_replicas(&p)?;
        }
        to_json("replica placement", &p)
    }

    /// Forgets a bound VM.
    pub fn unbind(&mut self, vm: &str) -> Result<()> {
        Ok(self.snapshot.unbind(vm)?)
    }

    /// The node a VM is bound to.
    pub fn vm_node(&self, vm: &str) -> Option<String> {
        self.snapshot.vm_node(vm).map(str::to_string)
    }

    /// Every node with its current usage.
    pub fn nodes(&self) -> Vec<NodeUsage> {
        self.snapshot
            .nodes()
            .map(|n| NodeUsage {
                name: n.name().to_string(),
                allocatable_cpu_millis: n.allocatable().cpu_millis,
                allocatable_memory_bytes: n.allocatable().memory_bytes,
                requested_cpu_millis: n.requested().cpu_millis,
                requested_memory_bytes: n.requested().memory_bytes,
                vms: n.vm_count(),
                unschedulable: n.is_unschedulable(),
            })
            .collect()
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.snapshot.node_count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn places_binds_and_reports_unschedulable() {
        let mut s = SchedHandle::new();
        s.add_node(Node::new("small", 1_000, 1 << 30))
            .expect("node");
        s.add_node_json(
            r#"{"name":"big","capacity":{"cpu_millis":8000,"memory_bytes":17179869184}}"#,
        )
        .expect("node json");
        let p = s
            .place_json(
                r#"{"name":"vm1","resources":{"cpu_millis":2000,"memory_bytes":1073741824}}"#,
                true,
            )
            .expect("place");
        let v: serde_json::Value = serde_json::from_str(&p).expect("json");
        assert_eq!(v["node"], "big");
        assert_eq!(s.vm_node("vm1").as_deref(), Some("big"));
        let e = s
            .place(&Request::new("huge", 64_000, 1 << 30), false)
            .expect_err("too big");
        assert_eq!(e.kind(), ErrorKind::Unschedulable);
        assert!(
            e.report().starts_with("0/2 nodes are available"),
            "{}",
            e.report()
        );
        assert_eq!(
            s.add_node_json("{").expect_err("bad").kind(),
            ErrorKind::InvalidArgument
        );
        let big = s
            .nodes()
            .into_iter()
            .find(|n| n.name == "big")
            .expect("big");
        assert_eq!(big.requested_cpu_millis, 2000);
        assert_eq!(big.vms, 1);
    }
}
