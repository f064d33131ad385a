// SPDX-License-Identifier: Apache-2.0
//! `Volume`, `ReplicaServer` and `create_replica`.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;
use sheaf_bindings_core::volume::{self as core_vol, OpenOptions, VolumeHandle, parse_replica};

use crate::errors::{IntoPy, invalid, value_to_py};

/// Creates an empty replica store of `size_bytes` (a positive multiple of
/// 4096) in directory `path`.
#[pyfunction]
pub fn create_replica(py: Python<'_>, path: PathBuf, size_bytes: u64) -> PyResult<()> {
    py.detach(move || core_vol::create_replica(&path, size_bytes))
        .py_err()
}

fn secs(what: &str, t: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(t).map_err(|_| {
        invalid(format!(
            "{what} {t} is not a non-negative number of seconds"
        ))
    })
}

/// An attached replicated volume with byte-granular blocking I/O.
#[pyclass(module = "sheaf._sheaf", subclass, frozen)]
#[derive(Debug)]
pub struct Volume {
    inner: Mutex<Option<VolumeHandle>>,
}

impl Volume {
    /// The open handle, or `StateError` once closed.
    pub(crate) fn handle(&self) -> PyResult<VolumeHandle> {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                crate::errors::to_py(sheaf_bindings_core::Error::VmState {
                    op: "use",
                    state: "a closed volume".into(),
                })
            })
    }
}

#[pymethods]
impl Volume {
    /// Attaches a volume over `replicas`: local store directories or
    /// `tcp://HOST:PORT` replica servers (which need `secret`).
    #[new]
    #[pyo3(signature = (replicas, *, secret = None, min_write_replicas = None,
        attach_timeout = None))]
    fn new(
        py: Python<'_>,
        replicas: Vec<String>,
        secret: Option<PyBackedBytes>,
        min_write_replicas: Option<usize>,
        attach_timeout: Option<f64>,
    ) -> PyResult<Volume> {
        let targets = replicas
            .iter()
            .map(|r| parse_replica(r))
            .collect::<Result<Vec<_>, _>>()
            .py_err()?;
        if targets.is_empty() {
            return Err(invalid("a volume needs at least one replica"));
        }
        let opts = OpenOptions {
            secret: secret.map(|s| s.to_vec()),
            min_write_replicas,
            attach_timeout: attach_timeout
                .map(|t| secs("attach_timeout", t))
                .transpose()?,
        };
        let h = py
            .detach(move || VolumeHandle::open(&targets, &opts))
            .py_err()?;
        Ok(Volume {
            inner: Mutex::new(Some(h)),
        })
    }

    /// Size in bytes.
    #[getter]
    fn size(&self) -> PyResult<u64> {
        Ok(self.handle()?.size())
    }

    /// Reads `length` bytes at `offset`.
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        length: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let h = self.handle()?;
        let data = py.detach(move || h.read(offset, length)).py_err()?;
        Ok(PyBytes::new(py, &data))
    }

    /// Writes `data` (bytes or bytearray) at `offset`.
    fn write(&self, py: Python<'_>, offset: u64, data: PyBackedBytes) -> PyResult<()> {
        let h = self.handle()?;
        py.detach(move || h.write(offset, &data)).py_err()
    }

    /// Makes completed writes durable on every in-sync replica.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let h = self.handle()?;
        py.detach(move || h.flush()).py_err()
    }

    /// The engine status as a dict (`phase`, `epoch`, `active`, ...).
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let h = self.handle()?;
        let st = py.detach(move || h.status()).py_err()?;
        value_to_py(py, &st)
    }

    /// Waits until every replica is in sync; returns the status.
    #[pyo3(signature = (timeout = 30.0))]
    fn wait_in_sync<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Bound<'py, PyAny>> {
        let t = secs("timeout", timeout)?;
        let h = self.handle()?;
        let st = py.detach(move || h.wait_in_sync(t)).py_err()?;
        value_to_py(py, &st)
    }

    /// Flushes and closes this handle (a VM using the volume keeps it
    /// attached). Closing twice is a no-op.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let h = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        match h {
            Some(h) => py.detach(move || h.close()).py_err(),
            None => Ok(()),
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<&Bound<'_, PyAny>>,
        _v: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        match &*self.inner.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(h) => format!("<sheaf.Volume size={}>", h.size()),
            None => "<sheaf.Volume closed>".into(),
        }
    }
}

/// A replica server in this process, serving one store over
/// authenticated TCP (like the `sheaf-replica` binary).
#[pyclass(module = "sheaf._sheaf", subclass, frozen)]
#[derive(Debug)]
pub struct ReplicaServer {
    inner: Mutex<Option<core_vol::ReplicaServer>>,
    location: String,
}

#[pymethods]
impl ReplicaServer {
    #[new]
    #[pyo3(signature = (path, secret, *, listen = "127.0.0.1:0", create_size = None))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        secret: PyBackedBytes,
        listen: &str,
        create_size: Option<u64>,
    ) -> PyResult<ReplicaServer> {
        let listen = listen.to_string();
        let s = py
            .detach(move || core_vol::ReplicaServer::start(&path, &listen, &secret, create_size))
            .py_err()?;
        Ok(ReplicaServer {
            location: s.location(),
            inner: Mutex::new(Some(s)),
        })
    }

    /// `tcp://HOST:PORT`, to pass to `Volume`.
    #[getter]
    fn location(&self) -> &str {
        &self.location
    }

    /// Stops serving (idempotent).
    fn stop(&self, py: Python<'_>) {
        let s = self.inner.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(s) = s {
            py.detach(move || s.stop());
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<&Bound<'_, PyAny>>,
        _v: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.stop(py);
        false
    }

    fn __repr__(&self) -> String {
        format!("<sheaf.ReplicaServer {}>", self.location)
    }
}
