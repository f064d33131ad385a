// SPDX-License-Identifier: Apache-2.0
//! `sheaf._sheaf`: the native half of the `sheaf` Python package.
//!
//! Each class is a thin wrapper over `sheaf-bindings-core` (the layer the C
//! binding shares); errors cross into Python at exactly one place
//! ([`errors::to_py`]), and every call that can block (VM wait, volume I/O,
//! HTTP, attaching replicas) releases the GIL. The user-facing package
//! (`python/sheaf`) adds asyncio helpers, and `_sheaf.pyi` types it.
#![warn(missing_docs)]

use pyo3::prelude::*;

mod cluster;
mod errors;
mod sched;
mod vm;
mod volume;

/// The native module.
#[pymodule]
fn _sheaf(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", sheaf_bindings_core::VERSION)?;
    m.add_class::<vm::Vm>()?;
    m.add_class::<vm::Exit>()?;
    m.add_class::<volume::Volume>()?;
    m.add_class::<volume::ReplicaServer>()?;
    m.add_class::<sched::Scheduler>()?;
    m.add_class::<cluster::Cluster>()?;
    m.add_function(wrap_pyfunction!(volume::create_replica, m)?)?;
    m.add_function(wrap_pyfunction!(vm::probe_guest_path, m)?)?;
    Ok(())
}
