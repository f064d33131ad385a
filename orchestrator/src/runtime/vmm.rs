// SPDX-License-Identifier: Apache-2.0
//! The sheaf-vmm runtime: the VM runs inside the launcher process on
//! `/dev/kvm`; each volume is a virtio-blk disk served in process through
//! blockrepl's `AsyncVolumeBackend`: every guest request is a task on the
//! volume engine's runtime, so up to a queue's worth are in flight and no
//! device thread waits for the replicas. A file disk (a cloud-init seed) is
//! a file-backed virtio-blk disk (`DiskConfig`, inline engine) in its place
//! in the guest's disk order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sheaf_blockrepl::frontend::vmm::{AsyncVolumeBackend, VolumeBackend};
use sheaf_vmm::devices::virtio::block::engine::open_disk;
use sheaf_vmm::devices::virtio::block::request::{DiskInfo, Request, RequestType};
use sheaf_vmm::devices::virtio::block::{AsyncBlockBackend, Completion};
use sheaf_vmm::memory::GuestMemory;
use sheaf_vmm::{
    BootProtocol, DiskConfig, ExitReason, IoEngine, SerialSink, Vm, VmConfig, VmState,
};
use vmm_sys_util::eventfd::EventFd;

use crate::launcher::metrics::{DiskIoStats, OpHistogram};

use super::{
    AttachedDisk, ConsoleInput, DiskBacking, RunningVm, RuntimeContext, RuntimeError, VmExit,
    VmRuntime, VmSpec,
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

/// Times every request the guest makes to a volume from submission to
/// completion (guest I/O latency: the engine's replication included, the
/// virtqueue excluded), requests in flight overlapping.
pub(super) struct TimedBackend {
    inner: AsyncVolumeBackend,
    stats: Arc<DiskIoStats>,
    /// token → (start, which histogram, bytes).
    started: Mutex<HashMap<u64, (Instant, Op, u64)>>,
}

impl std::fmt::Debug for TimedBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimedBackend").finish_non_exhaustive()
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Read,
    Write,
    Flush,
}

impl TimedBackend {
    pub(super) fn new(inner: AsyncVolumeBackend, stats: Arc<DiskIoStats>) -> Self {
        TimedBackend {
            inner,
            stats,
            started: Mutex::new(HashMap::new()),
        }
    }

    fn histogram(&self, op: Op) -> &OpHistogram {
        match op {
            Op::Read => &self.stats.read,
            Op::Write => &self.stats.write,
            Op::Flush => &self.stats.flush,
        }
    }

    /// Records the latency of each completion in `out`.
    fn observe(&self, out: &[Completion]) {
        let now = Instant::now();
        let mut started = self.started.lock().unwrap_or_else(|e| e.into_inner());
        for c in out {
            if let Some((t0, op, bytes)) = started.remove(&c.token) {
                let ok = u32::from(c.status) == virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK;
                self.histogram(op)
                    .observe(now.duration_since(t0), bytes, ok);
            }
        }
    }
}

impl AsyncBlockBackend for TimedBackend {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_only(&self) -> bool {
        self.inner.read_only()
    }
    fn device_id(&self) -> String {
        self.inner.device_id()
    }
    fn supports_discard(&self) -> bool {
        self.inner.supports_discard()
    }
    fn supports_write_zeroes(&self) -> bool {
        self.inner.supports_write_zeroes()
    }
    fn set_waker(&self, waker: EventFd) {
        self.inner.set_waker(waker)
    }
    fn submit(&self, token: u64, req: Request, mem: &GuestMemory, disk: DiskInfo) {
        let timed = match req.ty {
            RequestType::In => Some((Op::Read, req.data_len)),
            RequestType::Out => Some((Op::Write, req.data_len)),
            // The data of these is a range list, not the bytes they change.
            RequestType::Discard | RequestType::WriteZeroes => Some((Op::Write, 0)),
            RequestType::Flush => Some((Op::Flush, 0)),
            RequestType::GetId | RequestType::Unsupported(_) => None,
        };
        if let Some((op, bytes)) = timed {
            self.started
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(token, (Instant::now(), op, bytes));
        }
        self.inner.submit(token, req, mem, disk)
    }
    fn reap(&self, out: &mut Vec<Completion>) {
        let from = out.len();
        self.inner.reap(out);
        self.observe(&out[from..]);
    }
    fn drain(&self, out: &mut Vec<Completion>) {
        let from = out.len();
        self.inner.drain(out);
        self.observe(&out[from..]);
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
        let vm = builder(spec, disks, ctx)?.create()?;
        vm.start()?;
        Ok(Box::new(VmmVm { vm: Arc::new(vm) }))
    }

    fn receive_migration(
        &self,
        spec: &VmSpec,
        disks: Vec<AttachedDisk>,
        ctx: &RuntimeContext,
        conn: std::net::TcpStream,
        cfg: &sheaf_vmm::MigrationConfig,
    ) -> Result<Box<dyn RunningVm>, RuntimeError> {
        let vm = builder(spec, disks, ctx)?.receive_migration(conn, cfg)?;
        Ok(Box::new(VmmVm { vm: Arc::new(vm) }))
    }
}

/// The VM of `spec` with `disks`, not created yet. Every VM tracks its
/// dirty pages so that it can migrate live (KVM then maps guest RAM with
/// small pages; the log is only read during a migration).
fn builder(
    spec: &VmSpec,
    disks: Vec<AttachedDisk>,
    ctx: &RuntimeContext,
) -> Result<sheaf_vmm::VmBuilder, RuntimeError> {
    let mut b = VmConfig::builder()
        .name(&spec.name)
        .vcpus(spec.vcpus.max(1))
        .memory_mib(spec.memory_mib.max(16))
        .track_dirty_pages(true);
    b = match spec.boot_disk {
        // The kernel, initramfs and root=UUID come from inside the disk.
        Some(i) => b.boot_from_disk(i, None),
        None => b.kernel(&spec.kernel),
    };
    let mut b = b
        .cmdline(&spec.cmdline)
        // The probe guest finds its disks on the command line; Linux
        // finds them in ACPI and ignores the parameter.
        .cmdline_virtio_devices(true)
        .boot_protocol(BootProtocol::Linux64);
    if let Some(i) = &spec.initramfs {
        b = b.initramfs(i);
    }
    for n in &spec.nets {
        b = b.net_config(sheaf_vmm::NetConfig {
            tap: n.tap.clone(),
            mac: Some(n.mac.clone()),
        });
    }
    let cfg = b.build().map_err(|e| RuntimeError::Config(e.to_string()))?;
    let mut vb = Vm::builder(cfg);
    // In the guest's disk order: volumes and files interleave.
    for d in disks {
        match d.disk {
            DiskBacking::Volume(disk) => {
                let backend =
                    VolumeBackend::new(disk, ctx.io.clone(), &d.serial).with_read_only(d.read_only);
                vb = vb.async_disk_backend(Arc::new(TimedBackend::new(
                    backend.into_async(),
                    d.io_stats,
                )));
            }
            DiskBacking::Deferred(vol) => {
                vb = vb.async_disk_backend(Arc::new(super::late::LateBackend::new(
                    vol,
                    ctx.io.clone(),
                    d.serial.clone(),
                    d.read_only,
                    d.io_stats,
                )));
            }
            DiskBacking::File(path) => {
                // A seed of a few MiB, read once at boot: served inline
                // on the device thread, no I/O threads of its own.
                let cfg = DiskConfig {
                    path: path.clone(),
                    read_only: d.read_only,
                    id: Some(d.serial.clone()),
                    io_engine: IoEngine::Sync,
                    io_threads: None,
                    queues: None,
                };
                let backend = open_disk(&cfg).map_err(|e| RuntimeError::Disk {
                    disk: d.name.clone(),
                    message: format!("{}: {e}", path.display()),
                })?;
                vb = vb.async_disk_backend(backend);
            }
        }
    }
    let console = ctx.console.clone();
    Ok(
        vb.serial_sink(SerialSink::Callback(Box::new(move |b: &[u8]| {
            console.write(b)
        }))),
    )
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

    fn migrate(
        &mut self,
        conn: std::net::TcpStream,
        cfg: &sheaf_vmm::MigrationConfig,
    ) -> Result<sheaf_vmm::MigrationReport, RuntimeError> {
        Ok(self.vm.migrate(conn, cfg)?)
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
