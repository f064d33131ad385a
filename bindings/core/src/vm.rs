// SPDX-License-Identifier: Apache-2.0
//! A VM handle with a configuration phase: set vCPUs, memory, kernel and
//! disks, then `start` builds the [`sheaf_vmm::Vm`] and runs it.
//!
//! ```text
//!   VmHandle::new ──set_*/add_disk/attach_backend──► start ──► pause ⇄ resume
//!        (config)                                     │             │
//!                                                     └──► stop / wait ◄─┘  (stopped)
//! ```
//!
//! Locking: one mutex per handle guards the phase; lifecycle calls clone the
//! `Arc<Vm>` out of it and run unlocked, so `wait` in one thread never
//! blocks `pause`/`stop` in another.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use sheaf_vmm::{
    BlockBackend, BootProtocol, ExitReason, FileBackend, KernelConfig, MemoryConfig, SerialConfig,
    Vm, VmConfig, VmMetrics, VmState,
};

use crate::error::{Error, Result};

/// Default console ring size (64 KiB, as sheaf-vmm's default).
const DEFAULT_RING: usize = 64 * 1024;

enum Phase {
    /// Being configured; nothing exists in KVM yet.
    Config {
        config: Box<VmConfig>,
        disks: Vec<Arc<dyn BlockBackend>>,
    },
    /// Built (and maybe running or finished).
    Built(Arc<Vm>),
    /// Stopped before it was ever started.
    Cancelled,
}

/// A VM being configured or running. `Send + Sync`; every method takes
/// `&self`.
pub struct VmHandle {
    phase: Mutex<Phase>,
}

impl std::fmt::Debug for VmHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmHandle")
            .field("state", &self.state())
            .finish()
    }
}

/// Why a VM stopped, flattened for foreign callers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Exit {
    /// `shutdown`, `reset`, `debug_exit`, `crash`, `internal_error`,
    /// `stopped` (or `unknown` for a reason this layer does not know yet).
    pub kind: &'static str,
    /// The debug-exit code (`debug_exit`), or the vCPU (`crash`); else 0.
    pub code: u32,
    /// Details for `crash` and `internal_error`; else empty.
    pub detail: String,
    /// A clean power-off or debug exit 0.
    pub clean: bool,
}

impl From<&ExitReason> for Exit {
    fn from(r: &ExitReason) -> Exit {
        let clean = r.is_clean();
        let (kind, code, detail) = match r {
            ExitReason::Shutdown => ("shutdown", 0, String::new()),
            ExitReason::Reset => ("reset", 0, String::new()),
            ExitReason::DebugExit { code } => ("debug_exit", *code, String::new()),
            ExitReason::Crash { vcpu, detail } => ("crash", u32::from(*vcpu), detail.clone()),
            ExitReason::InternalError { detail } => ("internal_error", 0, detail.clone()),
            ExitReason::Stopped => ("stopped", 0, String::new()),
            other => ("unknown", 0, format!("{other:?}")),
        };
        Exit {
            kind,
            code,
            detail,
            clean,
        }
    }
}

/// Counters of a VM (see [`sheaf_vmm::VmMetrics`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Metrics {
    /// Microseconds from create to the first guest exit, if seen.
    pub create_to_first_exit_us: Option<u64>,
    /// Microseconds from start to the first guest exit, if seen.
    pub start_to_first_exit_us: Option<u64>,
    /// Port I/O exits.
    pub pio_exits: u64,
    /// MMIO exits.
    pub mmio_exits: u64,
    /// Completed block requests.
    pub block_requests: u64,
    /// Block requests that failed.
    pub block_errors: u64,
}

impl From<VmMetrics> for Metrics {
    fn from(m: VmMetrics) -> Metrics {
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Metrics {
            create_to_first_exit_us: m.create_to_first_exit.map(us),
            start_to_first_exit_us: m.start_to_first_exit.map(us),
            pio_exits: m.pio_exits,
            mmio_exits: m.mmio_exits,
            block_requests: m.block_requests,
            block_errors: m.block_errors,
        }
    }
}

/// Parses `"linux64"` or `"pvh"`.
pub fn parse_boot_protocol(s: &str) -> Result<BootProtocol> {
    match s {
        "linux64" => Ok(BootProtocol::Linux64),
        "pvh" => Ok(BootProtocol::Pvh),
        other => Err(Error::InvalidArgument(format!(
            "boot protocol {other:?} is not linux64 or pvh"
        ))),
    }
}

/// Path of the probe guest ELF that sheaf-vmm built (a tiny test kernel
/// that checks its boot and drives a virtio-blk disk; see docs/vmm.md).
/// `SHEAF_PROBE_ELF` in the environment overrides it.
pub fn probe_guest_path() -> PathBuf {
    match std::env::var_os("SHEAF_PROBE_ELF") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => sheaf_vmm::probe::elf_path().to_path_buf(),
    }
}

impl VmHandle {
    /// A VM named `name` with 1 vCPU, 128 MiB and no kernel yet.
    pub fn new(name: &str) -> VmHandle {
        let config = VmConfig {
            name: if name.is_empty() {
                "sheaf-vm".into()
            } else {
                name.into()
            },
            vcpus: 1,
            memory: MemoryConfig::default(),
            kernel: KernelConfig::default(),
            disks: Vec::new(),
            nets: Vec::new(),
            serial: SerialConfig::Ring,
            serial_ring_bytes: DEFAULT_RING,
        };
        VmHandle::from_config(config)
    }

    /// A VM from a complete [`VmConfig`] (validated at `start`).
    pub fn from_config(config: VmConfig) -> VmHandle {
        VmHandle {
            phase: Mutex::new(Phase::Config {
                config: Box::new(config),
                disks: Vec::new(),
            }),
        }
    }

    /// A VM from a `VmConfig` JSON document (see docs/vmm.md).
    pub fn from_json(json: &str) -> Result<VmHandle> {
        let config: VmConfig = serde_json::from_str(json).map_err(|source| Error::Json {
            what: "VM config",
            source,
        })?;
        Ok(VmHandle::from_config(config))
    }

    fn lock(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the configuration; fails once the VM was started.
    pub fn configure<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut VmConfig, &mut Vec<Arc<dyn BlockBackend>>) -> Result<T>,
    ) -> Result<T> {
        let mut g = self.lock();
        match &mut *g {
            Phase::Config { config, disks } => f(config, disks),
            Phase::Built(vm) => Err(Error::VmState {
                op,
                state: vm.state().to_string(),
            }),
            Phase::Cancelled => Err(Error::VmState {
                op,
                state: "stopped".into(),
            }),
        }
    }

    /// Sets the number of vCPUs (1–254).
    pub fn set_vcpus(&self, n: u32) -> Result<()> {
        let n = u8::try_from(n)
            .ok()
            .filter(|n| *n >= 1 && *n <= 254)
            .ok_or_else(|| Error::InvalidArgument(format!("{n} vCPUs is not in 1..=254")))?;
        self.configure("configure", |c, _| {
            c.vcpus = n;
            Ok(())
        })
    }

    /// Sets guest RAM in MiB.
    pub fn set_memory_mib(&self, mib: u64) -> Result<()> {
        self.configure("configure", |c, _| {
            c.memory.size_mib = mib;
            Ok(())
        })
    }

    /// Sets the kernel image (ELF or bzImage).
    pub fn set_kernel(&self, path: PathBuf) -> Result<()> {
        self.configure("configure", |c, _| {
            c.kernel.path = path;
            Ok(())
        })
    }

    /// Sets (or with `None` clears) the initramfs.
    pub fn set_initramfs(&self, path: Option<PathBuf>) -> Result<()> {
        self.configure("configure", |c, _| {
            c.kernel.initramfs = path;
            Ok(())
        })
    }

    /// Sets the kernel command line.
    pub fn set_cmdline(&self, cmdline: &str) -> Result<()> {
        self.configure("configure", |c, _| {
            c.kernel.cmdline = cmdline.into();
            Ok(())
        })
    }

    /// Sets the boot protocol.
    pub fn set_boot_protocol(&self, p: BootProtocol) -> Result<()> {
        self.configure("configure", |c, _| {
            c.kernel.boot_protocol = p;
            Ok(())
        })
    }

    /// Also describes virtio-mmio devices on the kernel command line.
    pub fn set_cmdline_virtio_devices(&self, on: bool) -> Result<()> {
        self.configure("configure", |c, _| {
            c.kernel.cmdline_virtio_devices = on;
            Ok(())
        })
    }

    /// Adds a virtio-blk disk over a raw image file (opened now, so a missing
    /// file fails here). Disks appear in the order they are added.
    pub fn add_disk(&self, path: PathBuf, read_only: bool, id: Option<String>) -> Result<()> {
        if let Some(id) = &id
            && id.len() > 20
        {
            return Err(Error::InvalidArgument(format!(
                "disk id {id:?} is longer than 20 bytes"
            )));
        }
        self.configure("attach a disk to", |_, disks| {
            let backend =
                FileBackend::open(&path, read_only, id).map_err(|source| Error::OpenDisk {
                    path: path.clone(),
                    source,
                })?;
            disks.push(Arc::new(backend));
            Ok(())
        })
    }

    /// Adds a virtio-blk disk served by any backend (e.g. a volume).
    pub fn attach_backend(&self, backend: Arc<dyn BlockBackend>) -> Result<()> {
        self.configure("attach a disk to", |_, disks| {
            disks.push(backend);
            Ok(())
        })
    }

    /// The configuration as `VmConfig` JSON (disks added through
    /// [`add_disk`](Self::add_disk) are backends and not listed).
    pub fn config_json(&self) -> Result<String> {
        let g = self.lock();
        let cfg = match &*g {
            Phase::Config { config, .. } => (**config).clone(),
            Phase::Built(vm) => vm.config().clone(),
            Phase::Cancelled => {
                return Err(Error::VmState {
                    op: "describe",
                    state: "stopped".into(),
                });
            }
        };
        serde_json::to_string(&cfg).map_err(|source| Error::Json {
            what: "VM config",
            source,
        })
    }

    /// The built VM, if any.
    pub fn vm(&self) -> Option<Arc<Vm>> {
        match &*self.lock() {
            Phase::Built(vm) => Some(vm.clone()),
            _ => None,
        }
    }

    fn built(&self, op: &'static str) -> Result<Arc<Vm>> {
        match &*self.lock() {
            Phase::Built(vm) => Ok(vm.clone()),
            Phase::Config { .. } => Err(Error::VmState {
                op,
                state: "created".into(),
            }),
            Phase::Cancelled => Err(Error::VmState {
                op,
                state: "stopped".into(),
            }),
        }
    }

    /// Builds the machine (first call) and starts it.
    pub fn start(&self) -> Result<()> {
        let vm = {
            let mut g = self.lock();
            match &mut *g {
                Phase::Config { config, disks } => {
                    let mut b = Vm::builder((**config).clone());
                    for d in disks.iter() {
                        b = b.disk_backend(d.clone());
                    }
                    let vm = Arc::new(b.create().map_err(Error::vmm("create"))?);
                    tracing::debug!(name = vm.name(), "VM built");
                    *g = Phase::Built(vm.clone());
                    vm
                }
                Phase::Built(vm) => vm.clone(),
                Phase::Cancelled => {
                    return Err(Error::VmState {
                        op: "start",
                        state: "stopped".into(),
                    });
                }
            }
        };
        vm.start().map_err(Error::vmm("start"))
    }

    /// Parks every vCPU; returns once they are out of the guest.
    pub fn pause(&self) -> Result<()> {
        self.built("pause")?.pause().map_err(Error::vmm("pause"))
    }

    /// Resumes a paused VM.
    pub fn resume(&self) -> Result<()> {
        self.built("resume")?.resume().map_err(Error::vmm("resume"))
    }

    /// Stops the VM and waits for it. A VM never started just becomes
    /// stopped.
    pub fn stop(&self) -> Exit {
        let vm = {
            let mut g = self.lock();
            match &*g {
                Phase::Built(vm) => vm.clone(),
                Phase::Config { .. } | Phase::Cancelled => {
                    *g = Phase::Cancelled;
                    return Exit::from(&ExitReason::Stopped);
                }
            }
        };
        Exit::from(&vm.stop())
    }

    /// Waits until the VM stops (`None`: forever); `Ok(None)` on timeout.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Option<Exit>> {
        let vm = match &*self.lock() {
            Phase::Built(vm) => vm.clone(),
            Phase::Cancelled => return Ok(Some(Exit::from(&ExitReason::Stopped))),
            Phase::Config { .. } => {
                return Err(Error::VmState {
                    op: "wait for",
                    state: "created".into(),
                });
            }
        };
        Ok(match timeout {
            None => Some(Exit::from(&vm.wait())),
            Some(t) => vm.wait_timeout(t).as_ref().map(Exit::from),
        })
    }

    /// `created`, `running`, `paused` or `stopped`.
    pub fn state(&self) -> &'static str {
        match &*self.lock() {
            Phase::Config { .. } => "created",
            Phase::Cancelled => "stopped",
            Phase::Built(vm) => match vm.state() {
                VmState::Created => "created",
                VmState::Running => "running",
                VmState::Paused => "paused",
                VmState::Stopped => "stopped",
            },
        }
    }

    /// Why the VM stopped, once it did.
    pub fn exit(&self) -> Option<Exit> {
        match &*self.lock() {
            Phase::Built(vm) => vm.exit_reason().as_ref().map(Exit::from),
            Phase::Cancelled => Some(Exit::from(&ExitReason::Stopped)),
            Phase::Config { .. } => None,
        }
    }

    /// The console output still held in the ring (the last 64 KiB by
    /// default).
    pub fn console(&self) -> Vec<u8> {
        self.vm()
            .map(|vm| vm.console().contents())
            .unwrap_or_default()
    }

    /// Console output since absolute byte position `pos`, and the position
    /// to continue from (for tailing).
    pub fn console_read(&self, pos: u64) -> (Vec<u8>, u64) {
        self.vm()
            .map(|vm| vm.console().read_from(pos))
            .unwrap_or((Vec::new(), 0))
    }

    /// Types into the guest's serial port; returns the bytes accepted.
    pub fn serial_input(&self, data: &[u8]) -> Result<usize> {
        Ok(self.built("send input to")?.serial_input(data))
    }

    /// Counters and timings.
    pub fn metrics(&self) -> Metrics {
        self.vm()
            .map(|vm| Metrics::from(vm.metrics()))
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn configuration_is_refused_after_stop() {
        let vm = VmHandle::new("t");
        vm.set_vcpus(2).expect("vcpus");
        assert_eq!(
            vm.set_vcpus(0).expect_err("0 vcpus").kind(),
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            vm.pause().expect_err("not started").kind(),
            ErrorKind::State
        );
        assert_eq!(vm.state(), "created");
        assert_eq!(vm.stop().kind, "stopped");
        assert_eq!(vm.state(), "stopped");
        let e = vm.set_memory_mib(64).expect_err("stopped");
        assert_eq!(e.kind(), ErrorKind::State);
        assert_eq!(e.to_string(), "cannot configure a VM that is stopped");
        assert_eq!(vm.start().expect_err("stopped").kind(), ErrorKind::State);
    }

    #[test]
    fn missing_disk_file_fails_at_add() {
        let vm = VmHandle::new("t");
        let e = vm
            .add_disk("/nonexistent/disk.img".into(), false, None)
            .expect_err("missing");
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert!(
            e.report().contains("/nonexistent/disk.img"),
            "{}",
            e.report()
        );
    }

    #[test]
    fn config_json_round_trips() {
        let vm = VmHandle::new("j");
        vm.set_kernel("/k".into()).expect("kernel");
        vm.set_cmdline("console=ttyS0").expect("cmdline");
        let json = vm.config_json().expect("json");
        let vm2 = VmHandle::from_json(&json).expect("parse");
        assert_eq!(vm2.config_json().expect("json"), json);
        assert_eq!(
            VmHandle::from_json("{\"bogus\":1}")
                .expect_err("bad")
                .kind(),
            ErrorKind::InvalidArgument
        );
    }

    #[test]
    fn bad_kernel_fails_at_start_and_can_be_fixed() {
        if !std::path::Path::new("/dev/kvm").exists() {
            eprintln!("SKIP: no /dev/kvm");
            return;
        }
        let vm = VmHandle::new("bad");
        vm.set_kernel("/nonexistent/vmlinux".into())
            .expect("kernel");
        vm.set_memory_mib(32).expect("mem");
        let e = vm.start().expect_err("no kernel");
        assert_eq!(vm.state(), "created", "{}", e.report());
        vm.set_kernel(probe_guest_path()).expect("kernel");
        vm.set_cmdline("console=ttyS0 probe.token=fixed")
            .expect("cmdline");
        vm.start().expect("start");
        let exit = vm
            .wait(Some(Duration::from_secs(60)))
            .expect("wait")
            .expect("exited");
        // Without a disk the probe reports the missing device, still exits.
        assert_eq!(exit.kind, "debug_exit", "{exit:?}");
        let out = String::from_utf8_lossy(&vm.console()).into_owned();
        assert!(out.contains("token: fixed"), "{out}");
    }
}
