// SPDX-License-Identifier: Apache-2.0
//! `Cluster`: a client of a sheaf (Kubernetes-compatible) API server.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};
use sheaf_bindings_core::cluster::ClusterClient;

use crate::errors::{IntoPy, json_arg, value_to_py};

/// A connection to an API server (bearer token over HTTPS). Every call
/// releases the GIL while it waits for the server.
#[pyclass(module = "sheaf._sheaf", subclass, frozen)]
#[derive(Debug)]
pub struct Cluster {
    inner: Arc<ClusterClient>,
}

#[pymethods]
impl Cluster {
    /// Connects to `url` with an optional bearer `token`; `ca_pem` is the
    /// PEM CA that signs the server certificate (default: system bundle).
    #[new]
    #[pyo3(signature = (url, *, token = None, ca_pem = None))]
    fn new(url: &str, token: Option<&str>, ca_pem: Option<&str>) -> PyResult<Cluster> {
        let c = ClusterClient::connect(url, token, ca_pem.map(str::as_bytes)).py_err()?;
        Ok(Cluster { inner: Arc::new(c) })
    }

    /// Connects with a kubeconfig (`None`: `$KUBECONFIG`, then
    /// `~/.kube/config`) and context (`None`: the current one).
    #[classmethod]
    #[pyo3(signature = (path = None, *, context = None))]
    fn from_kubeconfig(
        _cls: &Bound<'_, PyType>,
        path: Option<PathBuf>,
        context: Option<&str>,
    ) -> PyResult<Cluster> {
        let c = ClusterClient::from_kubeconfig(path.as_deref(), context).py_err()?;
        Ok(Cluster { inner: Arc::new(c) })
    }

    /// The server URL.
    #[getter]
    fn server(&self) -> String {
        self.inner.server()
    }

    /// The default namespace.
    #[getter]
    fn namespace(&self) -> String {
        self.inner.namespace().to_string()
    }

    /// The server's `/version` document.
    fn version<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let c = self.inner.clone();
        let v = py.detach(move || c.version()).py_err()?;
        value_to_py(py, &v)
    }

    /// `VirtualMachine` objects (dicts) in `namespace` (`None`: all).
    #[pyo3(signature = (namespace = None))]
    fn list_vms<'py>(
        &self,
        py: Python<'py>,
        namespace: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let c = self.inner.clone();
        let v = py
            .detach(move || c.list_vms(namespace.as_deref()))
            .py_err()?;
        value_to_py(py, &v)
    }

    /// One `VirtualMachine`; `NotFoundError` if missing.
    #[pyo3(signature = (name, namespace = None))]
    fn get_vm<'py>(
        &self,
        py: Python<'py>,
        name: String,
        namespace: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let c = self.inner.clone();
        let v = py
            .detach(move || c.get_vm(namespace.as_deref(), &name))
            .py_err()?;
        value_to_py(py, &v)
    }

    /// Creates a `VirtualMachine` from a manifest (dict, JSON or YAML
    /// string); returns the stored object.
    #[pyo3(signature = (manifest, namespace = None))]
    fn create_vm<'py>(
        &self,
        py: Python<'py>,
        manifest: &Bound<'py, PyAny>,
        namespace: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let m = json_arg(manifest)?;
        let c = self.inner.clone();
        let v = py
            .detach(move || c.create_vm(namespace.as_deref(), &m))
            .py_err()?;
        value_to_py(py, &v)
    }

    /// Deletes a `VirtualMachine`.
    #[pyo3(signature = (name, namespace = None))]
    fn delete_vm(&self, py: Python<'_>, name: String, namespace: Option<String>) -> PyResult<()> {
        let c = self.inner.clone();
        py.detach(move || c.delete_vm(namespace.as_deref(), &name))
            .py_err()
    }

    /// One raw request; returns `(status, body)` whatever the status.
    #[pyo3(signature = (method, path, body = None, content_type = "application/json"))]
    fn request<'py>(
        &self,
        py: Python<'py>,
        method: String,
        path: String,
        body: Option<Vec<u8>>,
        content_type: &str,
    ) -> PyResult<(u16, Bound<'py, PyBytes>)> {
        let c = self.inner.clone();
        let ct = content_type.to_string();
        let r = py
            .detach(move || c.request(&method, &path, body.map(|b| (ct.as_str(), b))))
            .py_err()?;
        Ok((r.status, PyBytes::new(py, &r.body)))
    }

    fn __repr__(&self) -> String {
        format!("<sheaf.Cluster {}>", self.inner.server())
    }
}
