// SPDX-License-Identifier: Apache-2.0
//! `Vm` and `Exit`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;
use sheaf_bindings_core::vm::{self as core_vm, VmHandle, parse_boot_protocol};

use crate::errors::{IntoPy, invalid, value_to_py};
use crate::volume::Volume;

/// Why a VM stopped.
#[pyclass(module = "sheaf._sheaf", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct Exit {
    /// `shutdown`, `reset`, `debug_exit`, `crash`, `internal_error`,
    /// `stopped` or `unknown`.
    kind: String,
    /// The debug-exit code, or the crashed vCPU; else 0.
    code: u32,
    /// Details of a crash or internal error.
    detail: String,
    /// A clean power-off or debug exit 0.
    clean: bool,
}

impl From<core_vm::Exit> for Exit {
    fn from(e: core_vm::Exit) -> Exit {
        Exit {
            kind: e.kind.to_string(),
            code: e.code,
            detail: e.detail,
            clean: e.clean,
        }
    }
}

#[pymethods]
impl Exit {
    fn __repr__(&self) -> String {
        format!(
            "Exit(kind='{}', code={}, clean={}{})",
            self.kind,
            self.code,
            if self.clean { "True" } else { "False" },
            if self.detail.is_empty() {
                String::new()
            } else {
                format!(", detail={:?}", self.detail)
            }
        )
    }
}

fn timeout_arg(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) => Duration::try_from_secs_f64(t).map(Some).map_err(|_| {
            invalid(format!(
                "timeout {t} is not a non-negative number of seconds"
            ))
        }),
    }
}

/// A virtual machine on sheaf-vmm (KVM). Configure it, then `start()`.
#[pyclass(module = "sheaf._sheaf", subclass, frozen)]
#[derive(Debug)]
pub struct Vm {
    inner: Arc<VmHandle>,
}

#[pymethods]
impl Vm {
    #[new]
    #[pyo3(signature = (name = "sheaf-vm", *, vcpus = 1, memory_mib = 128, kernel = None,
        cmdline = None, initramfs = None, boot_protocol = "linux64",
        cmdline_virtio_devices = true, config = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        name: &str,
        vcpus: u32,
        memory_mib: u64,
        kernel: Option<PathBuf>,
        cmdline: Option<&str>,
        initramfs: Option<PathBuf>,
        boot_protocol: &str,
        cmdline_virtio_devices: bool,
        config: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vm> {
        if let Some(c) = config {
            // A complete `VmConfig` (dict or JSON, docs/vmm.md) replaces
            // every other argument.
            let json = crate::errors::json_arg(c)?;
            return Ok(Vm {
                inner: Arc::new(VmHandle::from_json(&json).py_err()?),
            });
        }
        let h = VmHandle::new(name);
        h.set_vcpus(vcpus).py_err()?;
        h.set_memory_mib(memory_mib).py_err()?;
        if let Some(k) = kernel {
            h.set_kernel(k).py_err()?;
        }
        if let Some(c) = cmdline {
            h.set_cmdline(c).py_err()?;
        }
        h.set_initramfs(initramfs).py_err()?;
        h.set_boot_protocol(parse_boot_protocol(boot_protocol).py_err()?)
            .py_err()?;
        h.set_cmdline_virtio_devices(cmdline_virtio_devices)
            .py_err()?;
        Ok(Vm { inner: Arc::new(h) })
    }

    fn set_vcpus(&self, n: u32) -> PyResult<()> {
        self.inner.set_vcpus(n).py_err()
    }

    fn set_memory_mib(&self, mib: u64) -> PyResult<()> {
        self.inner.set_memory_mib(mib).py_err()
    }

    fn set_kernel(&self, path: PathBuf) -> PyResult<()> {
        self.inner.set_kernel(path).py_err()
    }

    #[pyo3(signature = (path))]
    fn set_initramfs(&self, path: Option<PathBuf>) -> PyResult<()> {
        self.inner.set_initramfs(path).py_err()
    }

    fn set_cmdline(&self, cmdline: &str) -> PyResult<()> {
        self.inner.set_cmdline(cmdline).py_err()
    }

    fn set_boot_protocol(&self, protocol: &str) -> PyResult<()> {
        self.inner
            .set_boot_protocol(parse_boot_protocol(protocol).py_err()?)
            .py_err()
    }

    fn set_cmdline_virtio_devices(&self, on: bool) -> PyResult<()> {
        self.inner.set_cmdline_virtio_devices(on).py_err()
    }

    /// Adds a virtio-blk disk over a raw image file.
    #[pyo3(signature = (path, read_only = false, id = None))]
    fn add_disk(&self, path: PathBuf, read_only: bool, id: Option<String>) -> PyResult<()> {
        self.inner.add_disk(path, read_only, id).py_err()
    }

    /// Adds a virtio-blk disk served by a replicated volume.
    #[pyo3(signature = (volume, id = "sheaf-volume"))]
    fn attach_volume(&self, volume: &Volume, id: &str) -> PyResult<()> {
        let backend = volume.handle()?.backend(id).py_err()?;
        self.inner.attach_backend(backend).py_err()
    }

    /// Builds the machine and starts its vCPUs.
    fn start(&self, py: Python<'_>) -> PyResult<()> {
        let h = self.inner.clone();
        py.detach(move || h.start()).py_err()
    }

    fn pause(&self, py: Python<'_>) -> PyResult<()> {
        let h = self.inner.clone();
        py.detach(move || h.pause()).py_err()
    }

    fn resume(&self, py: Python<'_>) -> PyResult<()> {
        let h = self.inner.clone();
        py.detach(move || h.resume()).py_err()
    }

    /// Stops the VM and returns why it stopped.
    fn stop(&self, py: Python<'_>) -> Exit {
        let h = self.inner.clone();
        Exit::from(py.detach(move || h.stop()))
    }

    /// Waits until the VM stops; `None` if `timeout` (seconds) passes first.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Exit>> {
        let t = timeout_arg(timeout)?;
        let h = self.inner.clone();
        Ok(py.detach(move || h.wait(t)).py_err()?.map(Exit::from))
    }

    /// `created`, `running`, `paused` or `stopped`.
    #[getter]
    fn state(&self) -> &'static str {
        self.inner.state()
    }

    /// Why the VM stopped, once it did.
    #[getter]
    fn exit(&self) -> Option<Exit> {
        self.inner.exit().map(Exit::from)
    }

    /// The console output still held (the last 64 KiB).
    fn console<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.console())
    }

    /// Console output from absolute byte position `pos`, and the position
    /// to continue from.
    #[pyo3(signature = (pos = 0))]
    fn console_read<'py>(&self, py: Python<'py>, pos: u64) -> (Bound<'py, PyBytes>, u64) {
        let (data, next) = self.inner.console_read(pos);
        (PyBytes::new(py, &data), next)
    }

    /// Types `data` into the serial port; returns the bytes accepted.
    fn serial_input(&self, data: PyBackedBytes) -> PyResult<usize> {
        self.inner.serial_input(&data).py_err()
    }

    /// Counters and timings as a dict.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        value_to_py(py, &self.inner.metrics())
    }

    /// The `VmConfig` as JSON.
    fn config_json(&self) -> PyResult<String> {
        self.inner.config_json().py_err()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving a `with` block stops the VM.
    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<&Bound<'_, PyAny>>,
        _v: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        let h = self.inner.clone();
        py.detach(move || h.stop());
        false
    }

    fn __repr__(&self) -> String {
        format!("<sheaf.Vm state={}>", self.inner.state())
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        // A VM whose Python object is gone must not keep running.
        self.inner.stop();
    }
}

/// Path of the probe guest kernel built with sheaf (`SHEAF_PROBE_ELF`
/// overrides it).
#[pyfunction]
pub fn probe_guest_path() -> PathBuf {
    core_vm::probe_guest_path()
}
