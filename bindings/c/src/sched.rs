// SPDX-License-Identifier: Apache-2.0
//! `sheaf_sched`: a scheduler with its cluster snapshot. Complex types are
//! sheaf-sched's serde JSON (docs/sched.md); the common cases have typed
//! helpers.

use std::ffi::{c_char, c_int};
use std::sync::{Arc, Mutex, MutexGuard};

use ::sheaf_sched::{Node, Request};
use sheaf_bindings_core::sched::SchedHandle;

use crate::args::{opt_str_arg, out_arg, put, put_string, str_arg};
use crate::error::{FfiError, FfiResult, guard};
use crate::handle::{Registry, to_ptr, to_token};

/// A scheduler and the cluster it places onto (opaque).
#[derive(Debug)]
pub struct sheaf_sched {
    _opaque: [u8; 0],
}

pub(crate) static SCHEDS: Registry<Mutex<SchedHandle>> = Registry::new(4, "sheaf_sched");

fn sched(h: *const sheaf_sched) -> FfiResult<Arc<Mutex<SchedHandle>>> {
    SCHEDS.get(to_token(h))
}

fn lock(m: &Arc<Mutex<SchedHandle>>) -> MutexGuard<'_, SchedHandle> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn to_json<T: serde::Serialize>(v: &T) -> FfiResult<String> {
    serde_json::to_string(v).map_err(|e| FfiError::invalid(format!("encode JSON: {e}")))
}

/// Creates a scheduler over an empty cluster. `config_json` is a
/// `SchedulerConfig` document (profiles, plugin weights; docs/sched.md) or
/// NULL for the default profile.
///
/// # Safety
/// `config_json` is NULL or a NUL-terminated string; `out` is valid for
/// writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_new(
    config_json: *const c_char,
    out: *mut *mut sheaf_sched,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out, "out", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let cfg = unsafe { opt_str_arg(config_json, "config_json") }?;
        let s = match cfg {
            Some(c) => SchedHandle::with_config_json(c)?,
            None => SchedHandle::new(),
        };
        // SAFETY: checked above.
        unsafe { put(out, to_ptr(SCHEDS.insert(Mutex::new(s)))) };
        Ok(())
    })
}

/// Frees the scheduler.
#[unsafe(no_mangle)]
pub extern "C" fn sheaf_sched_free(s: *mut sheaf_sched) -> c_int {
    guard(|| {
        drop(SCHEDS.remove(to_token(s))?);
        Ok(())
    })
}

/// Adds a node with `cpu_millis` CPU (1000 = one core) and `memory_bytes`
/// of memory, all allocatable, in `zone` (NULL: none).
///
/// # Safety
/// `name` is a NUL-terminated string; `zone` is NULL or one.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_add_node(
    s: *mut sheaf_sched,
    name: *const c_char,
    cpu_millis: u64,
    memory_bytes: u64,
    zone: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let name = unsafe { str_arg(name, "name") }?;
        // SAFETY: per the contract.
        let zone = unsafe { opt_str_arg(zone, "zone") }?;
        let mut node = Node::new(name, cpu_millis, memory_bytes);
        if let Some(z) = zone {
            node = node.zone(z);
        }
        Ok(lock(&sched(s)?).add_node(node)?)
    })
}

/// Adds a node from `Node` JSON (labels, taints, disks, max VMs...).
///
/// # Safety
/// `node_json` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_add_node_json(
    s: *mut sheaf_sched,
    node_json: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let j = unsafe { str_arg(node_json, "node_json") }?;
        Ok(lock(&sched(s)?).add_node_json(j)?)
    })
}

/// Removes a node (`SHEAF_ENOENT` if unknown); the VMs bound to it are
/// forgotten.
///
/// # Safety
/// `name` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_remove_node(
    s: *mut sheaf_sched,
    name: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let name = unsafe { str_arg(name, "name") }?;
        lock(&sched(s)?).remove_node(name)?;
        Ok(())
    })
}

/// Cordons (`true`) or uncordons a node.
///
/// # Safety
/// `name` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_set_unschedulable(
    s: *mut sheaf_sched,
    name: *const c_char,
    unschedulable: bool,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let name = unsafe { str_arg(name, "name") }?;
        Ok(lock(&sched(s)?).set_unschedulable(name, unschedulable)?)
    })
}

/// Places a VM needing `cpu_millis` and `memory_bytes`; writes the chosen
/// node's name to `out_node` (free with `sheaf_string_free`). With `bind`
/// the VM is recorded on the node (later placements see it). No node fits:
/// `SHEAF_EUNSCHEDULABLE`, with kube-scheduler's message in
/// `sheaf_last_error()` ("0/3 nodes are available: 3 Insufficient
/// memory.").
///
/// # Safety
/// `vm_name` is a NUL-terminated string; `out_node` is valid for writing
/// one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_place(
    s: *mut sheaf_sched,
    vm_name: *const c_char,
    cpu_millis: u64,
    memory_bytes: u64,
    bind: bool,
    out_node: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out_node, "out_node", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let name = unsafe { str_arg(vm_name, "vm_name") }?;
        let req = Request::new(name, cpu_millis, memory_bytes);
        let p = lock(&sched(s)?).place(&req, bind)?;
        // SAFETY: checked above.
        unsafe { put_string(out_node, &p.node) };
        Ok(())
    })
}

/// Places a VM from `Request` JSON (labels, affinity, anti-affinity,
/// tolerations, spread, volume replicas, priority...); writes `Placement`
/// JSON (`node`, `victims`, `score`, `evaluated_nodes`, `feasible_nodes`)
/// to `out_json`. `bind` as in `sheaf_sched_place`.
///
/// # Safety
/// `request_json` is a NUL-terminated string; `out_json` is valid for
/// writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_place_json(
    s: *mut sheaf_sched,
    request_json: *const c_char,
    bind: bool,
    out_json: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out_json, "out_json", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let r = unsafe { str_arg(request_json, "request_json") }?;
        let p = lock(&sched(s)?).place_json(r, bind)?;
        // SAFETY: checked above.
        unsafe { put_string(out_json, &p) };
        Ok(())
    })
}

/// Places a group all-or-nothing (a JSON array of `Request`s); writes the
/// array of `Placement`s. Members are bound; on failure nothing is.
///
/// # Safety
/// `requests_json` is a NUL-terminated string; `out_json` is valid for
/// writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_place_gang_json(
    s: *mut sheaf_sched,
    requests_json: *const c_char,
    out_json: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out_json, "out_json", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let r = unsafe { str_arg(requests_json, "requests_json") }?;
        let p = lock(&sched(s)?).place_gang_json(r)?;
        // SAFETY: checked above.
        unsafe { put_string(out_json, &p) };
        Ok(())
    })
}

/// Places a volume's replicas (`ReplicaRequest` JSON: `volume`,
/// `size_bytes`, `replicas`, ...) onto node disks; writes
/// `ReplicaPlacement` JSON. With `bind` the disk space is reserved.
///
/// # Safety
/// `request_json` is a NUL-terminated string; `out_json` is valid for
/// writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_place_replicas_json(
    s: *mut sheaf_sched,
    request_json: *const c_char,
    bind: bool,
    out_json: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out_json, "out_json", std::ptr::null_mut()) }?;
        // SAFETY: per the contract.
        let r = unsafe { str_arg(request_json, "request_json") }?;
        let p = lock(&sched(s)?).place_replicas_json(r, bind)?;
        // SAFETY: checked above.
        unsafe { put_string(out_json, &p) };
        Ok(())
    })
}

/// Forgets a bound VM (its resources become free).
///
/// # Safety
/// `vm_name` is a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_unbind(s: *mut sheaf_sched, vm_name: *const c_char) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        let name = unsafe { str_arg(vm_name, "vm_name") }?;
        Ok(lock(&sched(s)?).unbind(name)?)
    })
}

/// Every node with its usage as a JSON array (`name`,
/// `allocatable_cpu_millis`, `requested_cpu_millis`, ..., `vms`,
/// `unschedulable`).
///
/// # Safety
/// `out_json` is valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sheaf_sched_nodes_json(
    s: *mut sheaf_sched,
    out_json: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { out_arg(out_json, "out_json", std::ptr::null_mut()) }?;
        let nodes = lock(&sched(s)?).nodes();
        let j = to_json(&nodes)?;
        // SAFETY: checked above.
        unsafe { put_string(out_json, &j) };
        Ok(())
    })
}
