// SPDX-License-Identifier: Apache-2.0
//! `Scheduler`: placement onto a synthetic (or mirrored) cluster.

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;
use sheaf_bindings_core::sched::SchedHandle;

use crate::errors::{IntoPy, json_arg, json_to_py, value_to_py};

/// A scheduler and the cluster snapshot it places onto. Complex arguments
/// are dicts (or JSON strings) in sheaf-sched's serde form (docs/sched.md).
#[pyclass(module = "sheaf._sheaf", subclass, frozen)]
#[derive(Debug)]
pub struct Scheduler {
    inner: Mutex<SchedHandle>,
}

impl Scheduler {
    fn lock(&self) -> MutexGuard<'_, SchedHandle> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl Scheduler {
    /// `config`: a `SchedulerConfig` (profiles, plugin weights) or `None`
    /// for the default profile.
    #[new]
    #[pyo3(signature = (config = None))]
    fn new(config: Option<&Bound<'_, PyAny>>) -> PyResult<Scheduler> {
        let h = match config {
            Some(c) => SchedHandle::with_config_json(&json_arg(c)?).py_err()?,
            None => SchedHandle::new(),
        };
        Ok(Scheduler {
            inner: Mutex::new(h),
        })
    }

    /// Adds a node with `cpu_millis` (1000 = one core) and `memory_bytes`
    /// allocatable, optionally in `zone`.
    #[pyo3(signature = (name, cpu_millis, memory_bytes, *, zone = None))]
    fn add_node(
        &self,
        name: &str,
        cpu_millis: u64,
        memory_bytes: u64,
        zone: Option<&str>,
    ) -> PyResult<()> {
        let mut node = sheaf_sched_node(name, cpu_millis, memory_bytes);
        if let Some(z) = zone {
            node = node.zone(z);
        }
        self.lock().add_node(node).py_err()
    }

    /// Adds a node from its full description (labels, taints, disks...).
    fn add_node_spec(&self, node: &Bound<'_, PyAny>) -> PyResult<()> {
        let j = json_arg(node)?;
        self.lock().add_node_json(&j).py_err()
    }

    /// Removes a node; returns the VMs that were bound to it.
    fn remove_node(&self, name: &str) -> PyResult<Vec<String>> {
        self.lock().remove_node(name).py_err()
    }

    /// Cordons (`True`) or uncordons a node.
    fn set_unschedulable(&self, name: &str, unschedulable: bool) -> PyResult<()> {
        self.lock().set_unschedulable(name, unschedulable).py_err()
    }

    /// Places a VM needing `cpu_millis` and `memory_bytes`; returns the
    /// node name. With `bind` the VM's resources are reserved there.
    /// `UnschedulableError` when no node fits.
    #[pyo3(signature = (vm, cpu_millis, memory_bytes, *, bind = true))]
    fn place(
        &self,
        py: Python<'_>,
        vm: &str,
        cpu_millis: u64,
        memory_bytes: u64,
        bind: bool,
    ) -> PyResult<String> {
        let req = format!(
            "{{\"name\":{},\"resources\":{{\"cpu_millis\":{cpu_millis},\"memory_bytes\":{memory_bytes}}}}}",
            serde_json::Value::String(vm.to_string())
        );
        let out = py.detach(|| self.lock().place_json(&req, bind)).py_err()?;
        let v: serde_json::Value = serde_json::from_str(&out)
            .map_err(|e| crate::errors::invalid(format!("placement JSON: {e}")))?;
        Ok(v["node"].as_str().unwrap_or_default().to_string())
    }

    /// Places a full `Request` (dict or JSON); returns the `Placement`.
    #[pyo3(signature = (request, *, bind = true))]
    fn place_request<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        bind: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let r = json_arg(request)?;
        let out = py.detach(|| self.lock().place_json(&r, bind)).py_err()?;
        json_to_py(py, &out)
    }

    /// Places a list of requests all-or-nothing; returns their placements.
    fn place_gang<'py>(
        &self,
        py: Python<'py>,
        requests: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let r = json_arg(requests)?;
        let out = py.detach(|| self.lock().place_gang_json(&r)).py_err()?;
        json_to_py(py, &out)
    }

    /// Places the replicas of a volume (`ReplicaRequest`).
    #[pyo3(signature = (request, *, bind = true))]
    fn place_replicas<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        bind: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let r = json_arg(request)?;
        let out = py
            .detach(|| self.lock().place_replicas_json(&r, bind))
            .py_err()?;
        json_to_py(py, &out)
    }

    /// Releases a bound VM's resources.
    fn unbind(&self, vm: &str) -> PyResult<()> {
        self.lock().unbind(vm).py_err()
    }

    /// The node a VM is bound to, if any.
    fn node_of(&self, vm: &str) -> Option<String> {
        self.lock().vm_node(vm)
    }

    /// Per-node usage: a list of dicts.
    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let nodes = self.lock().nodes();
        value_to_py(py, &nodes)
    }

    fn __len__(&self) -> usize {
        self.lock().node_count()
    }

    fn __repr__(&self) -> String {
        format!("<sheaf.Scheduler nodes={}>", self.lock().node_count())
    }
}

fn sheaf_sched_node(name: &str, cpu: u64, mem: u64) -> sheaf_sched::Node {
    sheaf_sched::Node::new(name, cpu, mem)
}
