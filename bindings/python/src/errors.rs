// SPDX-License-Identifier: Apache-2.0
//! The one translation of binding errors into Python exceptions.
//!
//! The exception classes live in `sheaf/_errors.py` (so they can also
//! derive from the matching built-ins, e.g. `InvalidArgumentError` is a
//! `ValueError`); this module picks the class from the error's stable kind.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;
use sheaf_bindings_core::{Error, ErrorKind};

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn class_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidArgument => "InvalidArgumentError",
        ErrorKind::State => "StateError",
        ErrorKind::Io => "HostIOError",
        ErrorKind::Timeout => "TimeoutError",
        ErrorKind::NotFound => "NotFoundError",
        ErrorKind::PermissionDenied => "PermissionDeniedError",
        ErrorKind::Vmm => "VmmError",
        ErrorKind::Volume => "VolumeError",
        ErrorKind::Unschedulable => "UnschedulableError",
        ErrorKind::Sched => "SchedError",
        ErrorKind::Cluster => "ClusterError",
        _ => "SheafError",
    }
}

fn build(py: Python<'_>, e: &Error) -> PyResult<PyErr> {
    let module = ERRORS.get_or_try_init(py, || {
        PyModule::import(py, "sheaf._errors").map(Bound::unbind)
    })?;
    let cls = module.bind(py).getattr(class_name(e.kind()))?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("kind", e.kind().name())?;
    kwargs.set_item("status", e.http_status())?;
    let exc = cls.call((e.report(),), Some(&kwargs))?;
    Ok(PyErr::from_value(exc))
}

/// Converts a binding error into its Python exception.
pub(crate) fn to_py(e: Error) -> PyErr {
    Python::attach(|py| {
        build(py, &e).unwrap_or_else(|import_err| {
            // The package is broken (sheaf._errors missing); still say what
            // failed.
            PyRuntimeError::new_err(format!(
                "{} (sheaf._errors unavailable: {import_err})",
                e.report()
            ))
        })
    })
}

/// `Result` of the binding layer → `PyResult`.
pub(crate) trait IntoPy<T> {
    /// Maps the error with [`to_py`].
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// An `InvalidArgumentError` raised from this binding's own checks.
pub(crate) fn invalid(msg: impl Into<String>) -> PyErr {
    to_py(Error::InvalidArgument(msg.into()))
}

/// Serializes a JSON-able value for Python (`json.loads` of it).
pub(crate) fn json_to_py<'py>(py: Python<'py>, s: &str) -> PyResult<Bound<'py, PyAny>> {
    PyModule::import(py, "json")?.call_method1("loads", (s,))
}

/// A `str` argument, or any JSON-able object encoded with `json.dumps`.
pub(crate) fn json_arg(obj: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = obj.extract::<String>() {
        return Ok(s);
    }
    let py = obj.py();
    PyModule::import(py, "json")?
        .call_method1("dumps", (obj,))?
        .extract()
}

/// Encodes a serde value as a Python object.
pub(crate) fn value_to_py<'py>(
    py: Python<'py>,
    v: &impl serde::Serialize,
) -> PyResult<Bound<'py, PyAny>> {
    let s = serde_json::to_string(v).map_err(|e| invalid(format!("encode JSON: {e}")))?;
    json_to_py(py, &s)
}
