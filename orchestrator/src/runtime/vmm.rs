// SPDX-License-Identifier: Apache-2.0
//! The sheaf-vmm runtime: the VM runs inside the launcher process on
//! `/dev/kvm`; each volume is a virtio-blk disk served in process through
//! blockrepl's `VolumeBackend`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sheaf_blockrepl::frontend::vmm::VolumeBackend;
use sheaf_vmm::{BlockBackend, BootProtocol, ExitReason, SerialSink, Vm, VmConfig, VmState};

use crate::launcher::metrics::{DiskIoStats, OpHistogram};

use super::{
    AttachedDisk, ConsoleInput, RunningVm, RuntimeContext, RuntimeError, VmExit, VmRuntime, VmSpec,
};

/// sheaf-vmm in the launcher process.
#[derive(Debug, Default, Clone, Copy)]
pub struct VmmRuntime;

struct VmmVm {
    vm: Arc<Vm>,
}

impl std::fmt::Debug for VmmVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmmVm")
            .field("name", &self.vm.name())
            .finish()
    }
}

/// Times every request the guest makes to a volume (guest I/O latency:
/// the engine's replication included, the virtqueue excluded).
#[derive(Debug)]
struct TimedBackend {
    inner: VolumeBackend,
    stats: Arc<DiskIoStats>,
}

fn timed<T>(
    h: &OpHistogram,
    bytes: u64,
    f: impl FnOnce() -> std::io::Result<T>,
) -> std::io::Result<T> {
    let t0 = Instant::now();
    let r = f();
    h.observe(t0.elapsed(), bytes, r.is_ok());
    r
}

impl BlockBackend for TimedBackend {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn device_id(&self) -> String {
        self.inner.device_id()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let n = buf.len() as u64;
        timed(&self.stats.read, n, || self.inner.read_at(offset, buf))
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> std::io::Result<()> {
        timed(&self.stats.write, buf.len() as u64, || {
            self.inner.write_at(offset, buf)
        })
    }
    fn flush(&self) -> std::io::Result<()> {
        timed(&self.stats.flush, 0, || self.inner.flush())
    }
    fn supports_discard(&self) -> bool {
        self.inner.supports_discard()
    }
    fn discard(&self, offset: u64, len: u64) -> std::io::Result<()> {
        timed(&self.stats.write, 0, || self.inner.discard(offset, len))
    }
    fn supports_write_zeroes(&self) -> bool {
        self.inner.supports_write_zeroes()
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_unmap: bool) -> std::io::Result<()> {
        timed(&self.stats.write, len, || {
            self.inner.write_zeroes(offset, len, may_unmap)
        })
    }
}

fn exit_of(r: ExitReason) -> VmExit {
    VmExit {
        success: r.is_clean(),
        reason: format!("{r:?}"),
    }
}

impl VmRuntime for VmmRuntime {
    fn name(&self) -> &'static str {
        "sheaf-vmm"
    }

    fn times_disk_io(&self) -> bool {
        true
    }

    fn start(
        &self,
        spec: &VmSpec,
        disks: Vec<AttachedDisk>,
        ctx: &RuntimeContext,
    ) -> Result<Box<dyn RunningVm>, RuntimeError> {
        let mut b = VmConfig::builder()
            .name(&spec.name)
            .vcpus(spec.vcpus.max(1))
            .memory_mib(spec.memory_mib.max(16))
            .kernel(&spec.kernel)
            .cmdline(&spec.cmdline)
            // The probe guest finds its disks on the command line; Linux
            // finds them in ACPI and ignores the parameter.
            .cmdline_virtio_devices(true)
            .boot_protocol(BootProtocol::Linux64);
        if let Some(i) = &spec.initramfs {
            b = b.initramfs(i);
        }
        let cfg = b.build().map_err(|e| RuntimeError::Config(e.to_string()))?;
        let mut vb = Vm::builder(cfg);
        for d in disks {
            let backend =
                VolumeBackend::new(d.disk, ctx.io.clone(), &d.serial).with_read_only(d.read_only);
            vb = vb.disk_backend(Arc::new(TimedBackend {
                inner: backend,
                stats: d.io_stats,
            }));
        }
        let console = ctx.console.clone();
        vb = vb.serial_sink(SerialSink::Callback(Box::new(move |b: &[u8]| {
            console.write(b)
        })));
        let vm = vb.create()?;
        vm.start()?;
        Ok(Box::new(VmmVm { vm: Arc::new(vm) }))
    }
}

impl RunningVm for VmmVm {
    fn wait_timeout(&mut self, timeout: Duration) -> Option<VmExit> {
        self.vm.wait_timeout(timeout).map(exit_of)
    }

    fn stop(&mut self) -> VmExit {
        let r = self.vm.stop();
        VmExit {
            success: false,
            reason: format!("stopped ({r:?})"),
        }
    }

    fn pause(&mut self) -> Result<(), RuntimeError> {
        Ok(self.vm.pause()?)
    }

    fn resume(&mut self) -> Result<(), RuntimeError> {
        Ok(self.vm.resume()?)
    }

    fn console_input(&self) -> Option<ConsoleInput> {
        let vm = self.vm.clone();
        Some(Arc::new(move |data: &[u8]| {
            // The UART FIFO is small: feed it as the guest drains it.
            let mut rest = data;
            let mut idle = 0u32;
            while !rest.is_empty() {
                if vm.state() == VmState::Stopped {
                    return Err(RuntimeError::Control {
                        op: "serial input",
                        message: "the VM stopped".into(),
                    });
                }
                let n = vm.serial_input(rest);
                rest = &rest[n..];
                if n == 0 {
                    idle += 1;
                    // A paused or busy guest: give up after ~10 s.
                    if idle > 2000 {
                        return Err(RuntimeError::Control {
                            op: "serial input",
                            message: "the guest does not read its serial port".into(),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                } else {
                    idle = 0;
                }
            }
            Ok(())
        }))
    }
}
