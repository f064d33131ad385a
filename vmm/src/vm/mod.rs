// SPDX-License-Identifier: Apache-2.0
//! The [`Vm`] handle: building a machine from a [`VmConfig`], and running,
//! pausing and stopping it.
//!
//! Threads (one VM):
//!
//! ```text
//!  caller ──start/pause/resume/stop──► RunControl (+ signal kick) ─┬─► vcpu-0 … vcpu-N   (KVM_RUN loops)
//!                                                                 └─► dev thread         (epoll: ioeventfds,
//!  devices/vCPUs ──ExitLatch (eventfd)──► dev thread: stop vCPUs, join,                    exit latch, control)
//!                                          flush serial, publish Exited + Stopped
//! ```
//!
//! The device thread owns the end of the VM's life: whoever ends it (the
//! guest through a device, a crashing vCPU, or [`Vm::stop`]) only trips the
//! exit latch, so the teardown runs once, in one place.

mod attach;
pub(crate) mod state;

use std::fmt;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{KVM_PIT_SPEAKER_DUMMY, kvm_pit_config};
use kvm_ioctls::{Cap, Kvm, VmFd};
use serde::{Deserialize, Serialize};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::{self, layout};
use crate::config::{ConfigError, SerialConfig, VmConfig};
use crate::devices::serial::{ConsoleRing, SerialDevice, SerialOut, SerialSink};
use crate::devices::virtio::block::backend::BlockBackend;
use crate::devices::virtio::block::{self, AsyncBlockBackend, BlockStats, VirtioBlock};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::net::{MacAddr, NetBackend, NetStats};
use crate::devices::{Bus, DeviceError};
use crate::error::{Error, Result};
use crate::exit::{ExitLatch, ExitReason};
use crate::memory::{DirtyRegion, GuestRam};
use crate::vcpu::{self, Desired, RunControl, VcpuContext, VcpuStats};
use crate::{acpi, boot};

/// Lifecycle state of a VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// Built, not started.
    Created,
    /// vCPUs running.
    Running,
    /// vCPUs and devices parked.
    Paused,
    /// Finished; see [`Vm::exit_reason`].
    Stopped,
}

impl fmt::Display for VmState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            VmState::Created => "created",
            VmState::Running => "running",
            VmState::Paused => "paused",
            VmState::Stopped => "stopped",
        })
    }
}

/// Something that happened to a VM, delivered to every subscriber.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "event")]
#[non_exhaustive]
pub enum VmEvent {
    /// The lifecycle state changed.
    StateChanged {
        /// Previous state.
        from: VmState,
        /// New state.
        to: VmState,
    },
    /// The guest stopped running, and why. Sent before the change to `Stopped`.
    Exited {
        /// Why.
        reason: ExitReason,
    },
}

/// Timing and counters of a VM.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VmMetrics {
    /// From the start of [`VmBuilder::create`] to the first guest exit
    /// (port or MMIO access), i.e. a bound on the first guest instruction.
    pub create_to_first_exit: Option<Duration>,
    /// From [`Vm::start`] to the first guest exit.
    pub start_to_first_exit: Option<Duration>,
    /// Time spent in [`VmBuilder::create`].
    pub create_time: Duration,
    /// Port I/O exits, all vCPUs.
    pub pio_exits: u64,
    /// MMIO exits, all vCPUs.
    pub mmio_exits: u64,
    /// Completed block requests, all disks.
    pub block_requests: u64,
    /// Block requests that returned an error status.
    pub block_errors: u64,
    /// Frames delivered to the guest, all network cards.
    pub net_rx_frames: u64,
    /// Frames sent by the guest, all network cards.
    pub net_tx_frames: u64,
    /// Frames dropped (no guest buffer, backend full, malformed), all cards.
    pub net_dropped: u64,
}

/// Attaches run-time objects to a [`VmConfig`] and creates the [`Vm`].
pub struct VmBuilder {
    config: VmConfig,
    disks: Vec<ExtraDisk>,
    nets: Vec<attach::ExtraNet>,
    serial: Option<SerialSink>,
}

/// A disk attached at run time.
enum ExtraDisk {
    /// Served on a [`block::ThreadPoolBackend`].
    Sync(Arc<dyn BlockBackend>),
    /// Served as is.
    Async(Arc<dyn AsyncBlockBackend>),
}

impl fmt::Debug for VmBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VmBuilder")
            .field("config", &self.config)
            .field("extra_disks", &self.disks.len())
            .field("extra_nets", &self.nets.len())
            .field("serial", &self.serial)
            .finish()
    }
}

impl VmBuilder {
    /// Adds a virtio-blk disk served by `backend`, after the config's disks.
    /// The device thread never calls `backend` itself: requests run on a
    /// pool of worker threads.
    pub fn disk_backend(mut self, backend: Arc<dyn BlockBackend>) -> Self {
        self.disks.push(ExtraDisk::Sync(backend));
        self
    }

    /// Adds a virtio-blk disk served by an asynchronous `backend`.
    pub fn async_disk_backend(mut self, backend: Arc<dyn AsyncBlockBackend>) -> Self {
        self.disks.push(ExtraDisk::Async(backend));
        self
    }

    /// Adds a virtio-net card served by `backend`, after the config's
    /// cards; `mac` defaults to an address derived from the VM name.
    pub fn net_backend(mut self, backend: Arc<dyn NetBackend>, mac: Option<MacAddr>) -> Self {
        self.nets.push(attach::ExtraNet { backend, mac });
        self
    }

    /// Sends console output to `sink` instead of `config.serial`. The
    /// in-memory ring is kept either way.
    pub fn serial_sink(mut self, sink: SerialSink) -> Self {
        self.serial = Some(sink);
        self
    }

    /// Builds the machine: KVM VM, memory, devices, ACPI, kernel, vCPUs.
    /// Nothing runs until [`Vm::start`].
    pub fn create(self) -> Result<Vm> {
        Vm::build(self, Boot::Fresh)
    }
}

/// Whether a VM boots its kernel or continues from a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Boot {
    Fresh,
    Restore,
}

struct Shared {
    name: String,
    state: Mutex<VmState>,
    state_cv: Condvar,
    subscribers: Mutex<Vec<Sender<VmEvent>>>,
    exit: ExitLatch,
    control: Arc<RunControl>,
    /// pthread ids of running vCPU threads, for kicks. Cleared (under the
    /// lock) before the threads are joined, so a kick never targets a
    /// joined thread.
    vcpu_threads: Mutex<Vec<libc::pthread_t>>,
    dev_ctl: EventFd,
}

impl Shared {
    fn emit(&self, ev: VmEvent) {
        let mut subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        subs.retain(|s| s.send(ev.clone()).is_ok());
    }

    fn set_state(&self, to: VmState) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let from = *s;
        if from == to {
            return;
        }
        *s = to;
        self.state_cv.notify_all();
        drop(s);
        tracing::info!(vm = %self.name, %from, %to, "VM state changed");
        self.emit(VmEvent::StateChanged { from, to });
    }

    fn state(&self) -> VmState {
        *self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn kick_vcpus(&self) {
        let threads = self.vcpu_threads.lock().unwrap_or_else(|p| p.into_inner());
        for &t in threads.iter() {
            // SAFETY: `t` is the pthread id of a vCPU thread that has not been
            // joined yet (ids are removed under this lock before joining), and
            // the kick signal has a handler installed.
            unsafe { libc::pthread_kill(t, vcpu::kick_signal()) };
        }
    }
}

struct Machine {
    vcpus: Vec<Arc<Mutex<kvm_ioctls::VcpuFd>>>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
}

/// A running (or runnable) virtual machine.
///
/// ```no_run
/// use sheaf_vmm::{Vm, VmConfig};
/// let cfg = VmConfig::builder()
///     .kernel("vmlinux")
///     .cmdline("console=ttyS0")
///     .disk("disk.img")
///     .build()?;
/// let vm = Vm::new(cfg)?;
/// let events = vm.subscribe();
/// vm.start()?;
/// let reason = vm.wait();
/// println!("guest exited: {reason:?}\n{}", String::from_utf8_lossy(&vm.console().contents()));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Vm {
    shared: Arc<Shared>,
    config: VmConfig,
    machine: Mutex<Option<Machine>>,
    vm_fd: Arc<VmFd>,
    console: ConsoleRing,
    serial: Arc<Mutex<SerialDevice>>,
    /// Every vCPU, locked by its thread except while parked (see `vcpu`).
    vcpus: Vec<Arc<Mutex<kvm_ioctls::VcpuFd>>>,
    /// Every virtio-mmio transport, in bus order.
    transports: Vec<Arc<Mutex<MmioTransport>>>,
    vcpu_stats: Vec<Arc<VcpuStats>>,
    block_stats: Vec<Arc<BlockStats>>,
    net_stats: Vec<Arc<NetStats>>,
    dev_thread: Mutex<Option<JoinHandle<()>>>,
    created_at: Instant,
    create_time: Duration,
    started_at: OnceLock<Instant>,
    first_exit: Arc<OnceLock<Instant>>,
    /// Last: guest memory outlives the KVM VM and every device using it.
    ram: Arc<GuestRam>,
}

impl fmt::Debug for Vm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vm")
            .field("name", &self.shared.name)
            .field("state", &self.shared.state())
            .finish_non_exhaustive()
    }
}

fn check_kvm(kvm: &Kvm) -> Result<()> {
    for (cap, name) in [
        (Cap::Irqchip, "irqchip"),
        (Cap::Irqfd, "irqfd"),
        (Cap::Ioeventfd, "ioeventfd"),
        (Cap::UserMemory, "user memory"),
        (Cap::ImmediateExit, "immediate exit"),
        (Cap::Pit2, "PIT2"),
    ] {
        if !kvm.check_extension(cap) {
            return Err(Error::KvmCapability(name));
        }
    }
    Ok(())
}

impl Vm {
    /// Starts a builder for `config` (to attach backends or a serial sink).
    pub fn builder(config: VmConfig) -> VmBuilder {
        VmBuilder {
            config,
            disks: Vec::new(),
            nets: Vec::new(),
            serial: None,
        }
    }

    /// Creates a VM from `config` alone.
    pub fn new(config: VmConfig) -> Result<Vm> {
        Vm::builder(config).create()
    }

    fn build(b: VmBuilder, boot: Boot) -> Result<Vm> {
        let created_at = Instant::now();
        let VmBuilder {
            config,
            disks: extra_disks,
            nets: extra_nets,
            serial,
        } = b;
        config.validate(extra_disks.len() + extra_nets.len())?;
        if let Some(d) = &config.kernel.from_disk {
            let n = config.disks.len() + extra_disks.len();
            if d.disk >= n {
                return Err(ConfigError::BootSource(format!(
                    "kernel.from_disk.disk is {} but the VM has {n} disk(s)",
                    d.disk
                ))
                .into());
            }
        }
        vcpu::install_kick_handler().map_err(Error::EventFd)?;

        let kvm = Kvm::new().map_err(Error::OpenKvm)?;
        check_kvm(&kvm)?;
        let vm_fd = kvm.create_vm().map_err(Error::CreateVm)?;
        vm_fd
            .set_tss_address(0xfffb_d000)
            .map_err(Error::SetupIrqchip)?;
        vm_fd.create_irq_chip().map_err(Error::SetupIrqchip)?;
        vm_fd
            .create_pit2(kvm_pit_config {
                flags: KVM_PIT_SPEAKER_DUMMY,
                ..Default::default()
            })
            .map_err(Error::SetupIrqchip)?;

        let ram = Arc::new(GuestRam::new(&config.memory)?);
        ram.register(&vm_fd)?;
        let mem = ram.mem.clone();

        let exit = ExitLatch::new().map_err(Error::EventFd)?;
        let mut pio = Bus::default();
        let mut mmio = Bus::default();

        // Serial console.
        let console = ConsoleRing::new(config.serial_ring_bytes);
        let sink = match serial {
            Some(s) => s,
            None => match &config.serial {
                SerialConfig::Ring => SerialSink::None,
                SerialConfig::Stdout => SerialSink::Stdout,
                SerialConfig::File { path } => SerialSink::File(
                    OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                        .map_err(|source| DeviceError::OpenSerialFile {
                            path: path.display().to_string(),
                            source,
                        })?,
                ),
            },
        };
        let serial_irq = irqfd(&vm_fd, layout::COM1_IRQ)?;
        let serial = Arc::new(Mutex::new(SerialDevice::new(
            serial_irq,
            SerialOut::new(console.clone(), sink),
        )));
        crate::devices::legacy::insert_pio_devices(&mut pio, serial.clone(), &exit);

        // Disks: config first, then run-time backends.
        let mut backends: Vec<(Arc<dyn AsyncBlockBackend>, u16)> = Vec::new();
        for d in &config.disks {
            let b = block::engine::open_disk(d).map_err(|source| DeviceError::OpenDisk {
                path: d.path.display().to_string(),
                source,
            })?;
            backends.push((b, d.queues.unwrap_or(1)));
        }
        for d in extra_disks {
            backends.push((
                match d {
                    ExtraDisk::Async(b) => b,
                    ExtraDisk::Sync(b) => {
                        let id = b.device_id();
                        block::engine::pooled(b).map_err(|source| DeviceError::OpenDisk {
                            path: format!("backend {id:?}"),
                            source,
                        })?
                    }
                },
                1,
            ));
        }
        let mut block_stats = Vec::new();
        // Disk boot reads the image through the backend the guest will use,
        // before the device takes it over.
        let disk_files = match &config.kernel.from_disk {
            Some(_) if boot == Boot::Restore => None,
            Some(d) => match backends.get(d.disk) {
                Some((b, _)) => Some(boot::disk::find(b.clone(), d.disk, d.partition)?),
                None => None,
            },
            None => None,
        };
        let mut cmdline = match &disk_files {
            Some(f) if !names_root(&config.kernel.cmdline) => {
                format!("root=UUID={} rw {}", f.root_uuid, config.kernel.cmdline)
            }
            _ => config.kernel.cmdline.clone(),
        };
        let mut bus = attach::VirtioBus {
            vm_fd: &vm_fd,
            mem: &mem,
            mmio: &mut mmio,
            transports: Vec::new(),
            acpi_devs: Vec::new(),
            cmdline: config.kernel.cmdline_virtio_devices.then(String::new),
        };
        for (i, (backend, queues)) in backends.into_iter().enumerate() {
            let dev = VirtioBlock::new_multiqueue(backend, queues);
            block_stats.push(dev.stats());
            bus.add(format!("virtio-blk{i}"), Box::new(dev))?;
        }
        let net_stats = bus.add_nets(&config.name, &config.nets, extra_nets)?;
        let attach::VirtioBus {
            transports,
            acpi_devs,
            cmdline: devices_cmdline,
            ..
        } = bus;
        if let Some(c) = devices_cmdline {
            cmdline.push_str(&c);
        }

        // A restored VM gets its memory (tables, kernel and all) and its
        // registers from the snapshot.
        let entry = match boot {
            Boot::Restore => None,
            Boot::Fresh => {
                let rsdp = acpi::write(&mem, config.vcpus, &acpi_devs)?;
                let files = match &disk_files {
                    Some(f) => boot::BootFiles::Disk(f),
                    None => boot::BootFiles::Host,
                };
                Some(boot::load(&mem, &config.kernel, files, cmdline.trim(), rsdp)?.entry)
            }
        };
        drop(disk_files);

        let cpuid = x86_64::supported_cpuid(&kvm)?;
        let mut vcpus = Vec::new();
        for id in 0..config.vcpus {
            let fd = vm_fd.create_vcpu(u64::from(id)).map_err(Error::CreateVm)?;
            let entry = if id == 0 { entry } else { None };
            x86_64::configure_vcpu(&fd, &mem, &cpuid, id, config.vcpus, entry)?;
            vcpus.push(Arc::new(Mutex::new(fd)));
        }

        let vm_fd = Arc::new(vm_fd);
        let shared = Arc::new(Shared {
            name: config.name.clone(),
            state: Mutex::new(VmState::Created),
            state_cv: Condvar::new(),
            subscribers: Mutex::new(Vec::new()),
            exit,
            control: Arc::new(RunControl::new()),
            vcpu_threads: Mutex::new(Vec::new()),
            dev_ctl: EventFd::new(libc::EFD_NONBLOCK).map_err(Error::EventFd)?,
        });
        let vcpu_stats = (0..config.vcpus).map(|_| Arc::default()).collect();
        let machine = Machine {
            vcpus: vcpus.clone(),
            transports: transports.clone(),
            pio: Arc::new(pio),
            mmio: Arc::new(mmio),
        };
        let vm = Vm {
            shared,
            config,
            ram,
            machine: Mutex::new(Some(machine)),
            vm_fd,
            console,
            serial,
            vcpus,
            transports,
            vcpu_stats,
            block_stats,
            net_stats,
            dev_thread: Mutex::new(None),
            created_at,
            create_time: created_at.elapsed(),
            started_at: OnceLock::new(),
            first_exit: Arc::new(OnceLock::new()),
        };
        tracing::debug!(vm = %vm.shared.name, elapsed = ?vm.create_time, "VM created");
        Ok(vm)
    }
}

pub(super) fn irqfd(vm: &VmFd, gsi: u32) -> Result<EventFd> {
    let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(DeviceError::EventFd)?;
    vm.register_irqfd(&evt, gsi)
        .map_err(|source| DeviceError::RegisterIrqfd { gsi, source })?;
    Ok(evt)
}

/// How long pause waits for vCPUs and the device thread to park.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

impl Vm {
    /// The VM's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The configuration the VM was built from.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// Current lifecycle state.
    pub fn state(&self) -> VmState {
        self.shared.state()
    }

    /// A new event stream. Every subscriber gets every event from now on.
    pub fn subscribe(&self) -> Receiver<VmEvent> {
        let (tx, rx) = channel();
        self.shared
            .subscribers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(tx);
        rx
    }

    /// The in-memory console ring (last `serial_ring_bytes` of output).
    pub fn console(&self) -> &ConsoleRing {
        &self.console
    }

    /// Sends bytes to the guest's serial input; returns how many fit in the
    /// UART's FIFO.
    pub fn serial_input(&self, data: &[u8]) -> usize {
        self.serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .enqueue_input(data)
    }

    /// Why the guest stopped, once it has.
    pub fn exit_reason(&self) -> Option<ExitReason> {
        match self.state() {
            VmState::Stopped => self.shared.exit.reason(),
            _ => None,
        }
    }

    /// The memfd backing guest RAM, when `memory.backing` is `memfd`.
    pub fn memory_fd(&self) -> Option<std::os::fd::RawFd> {
        self.ram.memfd.as_ref().map(|f| f.as_raw_fd())
    }

    /// Reads and clears the dirty-page log (needs `memory.track_dirty_pages`):
    /// KVM's log of vCPU writes ∪ vm-memory's bitmap of the VMM's own
    /// writes into guest RAM (virtio devices), see [`crate::memory`].
    pub fn dirty_pages(&self) -> Result<Vec<DirtyRegion>> {
        if !self.ram.dirty_logging {
            return Err(Error::KvmCapability(
                "dirty-page logging not enabled in the config",
            ));
        }
        crate::memory::dirty_log(&self.vm_fd, &self.ram.mem).map_err(Error::DirtyLog)
    }

    /// Timing and counters.
    pub fn metrics(&self) -> VmMetrics {
        let first = self.first_exit.get().copied();
        let sum = |f: fn(&VcpuStats) -> u64| self.vcpu_stats.iter().map(|s| f(s)).sum();
        use std::sync::atomic::Ordering::Relaxed;
        VmMetrics {
            create_to_first_exit: first.map(|t| t.duration_since(self.created_at)),
            start_to_first_exit: first
                .zip(self.started_at.get().copied())
                .map(|(f, s)| f.duration_since(s)),
            create_time: self.create_time,
            pio_exits: sum(|s| s.pio_exits.load(Relaxed)),
            mmio_exits: sum(|s| s.mmio_exits.load(Relaxed)),
            block_requests: self
                .block_stats
                .iter()
                .map(|s| s.requests.load(Relaxed))
                .sum(),
            block_errors: self
                .block_stats
                .iter()
                .map(|s| s.errors.load(Relaxed))
                .sum(),
            net_rx_frames: self
                .net_stats
                .iter()
                .map(|s| s.rx_frames.load(Relaxed))
                .sum(),
            net_tx_frames: self
                .net_stats
                .iter()
                .map(|s| s.tx_frames.load(Relaxed))
                .sum(),
            net_dropped: self
                .net_stats
                .iter()
                .map(|s| {
                    s.rx_dropped.load(Relaxed)
                        + s.tx_dropped.load(Relaxed)
                        + s.tx_errors.load(Relaxed)
                })
                .sum(),
        }
    }

    /// Starts the vCPU threads and the device thread.
    pub fn start(&self) -> Result<()> {
        let mut machine = self.machine.lock().unwrap_or_else(|p| p.into_inner());
        let state = self.state();
        let Some(m) = machine.take() else {
            return Err(Error::InvalidState { op: "start", state });
        };
        let _ = self.started_at.set(Instant::now());
        let Machine {
            vcpus,
            transports,
            pio,
            mmio,
        } = m;
        let mut handles = Vec::new();
        for (id, fd) in vcpus.into_iter().enumerate() {
            let ctx = VcpuContext {
                id: id as u8,
                fd,
                pio: pio.clone(),
                mmio: mmio.clone(),
                exit: self.shared.exit.clone(),
                control: self.shared.control.clone(),
                stats: self.vcpu_stats[id].clone(),
                first_exit: self.first_exit.clone(),
            };
            let name = format!("{}-vcpu{id}", self.shared.name);
            let h = std::thread::Builder::new()
                .name(truncate_thread_name(&name))
                .spawn(move || {
                    let exit = ctx.exit.clone();
                    let id = ctx.id;
                    // A bug must end the VM, not leave it half alive.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        vcpu::run_vcpu(ctx)
                    }))
                    .is_err()
                    {
                        exit.request(ExitReason::InternalError {
                            detail: format!("vCPU {id} thread panicked"),
                        });
                    }
                })
                .map_err(|source| Error::SpawnThread { name, source });
            match h {
                Ok(h) => handles.push(h),
                Err(e) => {
                    self.shared.exit.request(ExitReason::InternalError {
                        detail: e.to_string(),
                    });
                    self.shared.control.set(Desired::Stop);
                    for h in handles {
                        let _ = h.join();
                    }
                    return Err(e);
                }
            }
        }
        {
            use std::os::unix::thread::JoinHandleExt;
            let mut t = self
                .shared
                .vcpu_threads
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            *t = handles.iter().map(|h| h.as_pthread_t()).collect();
        }
        self.shared.set_state(VmState::Running);
        let shared = self.shared.clone();
        let serial = self.serial.clone();
        let name = format!("{}-dev", self.shared.name);
        let dev = std::thread::Builder::new()
            .name(truncate_thread_name(&name))
            .spawn(move || device_loop(shared, transports, handles, serial))
            .map_err(|source| Error::SpawnThread { name, source })?;
        *self.dev_thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(dev);
        Ok(())
    }

    /// Parks every vCPU (out of KVM_RUN) and the device thread; returns once
    /// all acknowledged. Guest memory is quiescent while paused.
    pub fn pause(&self) -> Result<()> {
        let state = self.state();
        if state != VmState::Running {
            return Err(Error::InvalidState { op: "pause", state });
        }
        self.shared.control.set(Desired::Pause);
        self.shared.kick_vcpus();
        let _ = self.shared.dev_ctl.write(1);
        let n = self.config.vcpus as usize + 1;
        if !self.shared.control.wait_parked(n, PAUSE_TIMEOUT) {
            if self.shared.exit.is_set() {
                return Err(Error::InvalidState {
                    op: "pause",
                    state: VmState::Stopped,
                });
            }
            self.shared.control.set(Desired::Run);
            return Err(Error::Timeout {
                op: "pause",
                timeout_ms: PAUSE_TIMEOUT.as_millis() as u64,
            });
        }
        self.shared.set_state(VmState::Paused);
        Ok(())
    }

    /// Resumes a paused VM.
    pub fn resume(&self) -> Result<()> {
        let state = self.state();
        if state != VmState::Paused {
            return Err(Error::InvalidState {
                op: "resume",
                state,
            });
        }
        self.shared.set_state(VmState::Running);
        self.shared.control.set(Desired::Run);
        Ok(())
    }

    /// Stops the VM (if it runs) and waits for it; returns the exit reason.
    /// A VM that was never started just becomes `Stopped`.
    pub fn stop(&self) -> ExitReason {
        self.shared.exit.request(ExitReason::Stopped);
        if self.state() == VmState::Created
            && self
                .machine
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .is_some()
        {
            self.shared.emit(VmEvent::Exited {
                reason: ExitReason::Stopped,
            });
            self.shared.set_state(VmState::Stopped);
        }
        self.shared.control.set(Desired::Stop);
        self.shared.kick_vcpus();
        self.wait()
    }

    /// Blocks until the VM stopped; returns why.
    pub fn wait(&self) -> ExitReason {
        let mut s = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        while *s != VmState::Stopped {
            s = self
                .shared
                .state_cv
                .wait(s)
                .unwrap_or_else(|p| p.into_inner());
        }
        drop(s);
        self.join_dev_thread();
        self.shared.exit.reason().unwrap_or(ExitReason::Stopped)
    }

    /// Like [`Vm::wait`] with a timeout; `None` if still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<ExitReason> {
        let deadline = Instant::now() + timeout;
        let mut s = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        while *s != VmState::Stopped {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            s = self
                .shared
                .state_cv
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(s);
        self.join_dev_thread();
        Some(self.shared.exit.reason().unwrap_or(ExitReason::Stopped))
    }

    fn join_dev_thread(&self) {
        let h = self
            .dev_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if self.state() != VmState::Stopped {
            self.stop();
        }
        self.join_dev_thread();
    }
}

fn truncate_thread_name(name: &str) -> String {
    // Linux thread names are at most 15 bytes; keep the distinctive tail.
    let b = name.as_bytes();
    let start = b.len().saturating_sub(15);
    String::from_utf8_lossy(&b[start..]).into_owned()
}

const TOKEN_EXIT: u64 = 0;
const TOKEN_CTL: u64 = 1;
const TOKEN_QUEUE: u64 = 1 << 32;
/// Set on queue tokens of host event sources (no eventfd to read).
const TOKEN_SOURCE: u64 = 1 << 33;

/// The device thread: queue notifications, pause requests, and teardown.
fn device_loop(
    shared: Arc<Shared>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
    vcpu_threads: Vec<JoinHandle<()>>,
    serial: Arc<Mutex<SerialDevice>>,
) {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        event_loop(&shared, &transports)
    }));
    let failure = match result {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(format!("device event loop failed: {e}")),
        Err(_) => Some("device thread panicked".to_string()),
    };
    if let Some(detail) = failure {
        shared.exit.request(ExitReason::InternalError { detail });
    }
    // Teardown: stop and join the vCPUs, flush the console, publish.
    shared.control.set(Desired::Stop);
    shared.kick_vcpus();
    let ids: Vec<libc::pthread_t> = std::mem::take(
        &mut *shared
            .vcpu_threads
            .lock()
            .unwrap_or_else(|p| p.into_inner()),
    );
    drop(ids);
    for h in vcpu_threads {
        // Kicks are no longer possible; a vCPU blocked in KVM_RUN (e.g. an
        // application processor waiting for SIPI) was kicked above.
        let _ = h.join();
    }
    serial.lock().unwrap_or_else(|p| p.into_inner()).flush();
    let reason = shared.exit.reason().unwrap_or(ExitReason::Stopped);
    tracing::info!(vm = %shared.name, ?reason, "guest exited");
    shared.emit(VmEvent::Exited { reason });
    shared.set_state(VmState::Stopped);
}

fn event_loop(shared: &Shared, transports: &[Arc<Mutex<MmioTransport>>]) -> std::io::Result<()> {
    let epoll = Epoll::new()?;
    let add = |fd: i32, token: u64| {
        epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, token),
        )
    };
    add(shared.exit.eventfd().as_raw_fd(), TOKEN_EXIT)?;
    add(shared.dev_ctl.as_raw_fd(), TOKEN_CTL)?;
    let mut queue_fds = Vec::new();
    for (d, t) in transports.iter().enumerate() {
        let t = t.lock().unwrap_or_else(|p| p.into_inner());
        for (q, evt) in t.queue_evts().iter().enumerate() {
            let token = TOKEN_QUEUE | ((d as u64) << 16) | q as u64;
            add(evt.as_raw_fd(), token)?;
            queue_fds.push((token, Some(evt.try_clone()?)));
        }
        for (fd, q) in t.event_sources() {
            // Edge-triggered: the device reads until the source is empty
            // or the guest has no buffers (then the guest's kick resumes).
            let token = TOKEN_QUEUE | TOKEN_SOURCE | ((d as u64) << 16) | q as u64;
            epoll.ctl(
                ControlOperation::Add,
                fd,
                EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, token),
            )?;
            queue_fds.push((token, None));
        }
    }
    let mut events = vec![EpollEvent::default(); 16];
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_EXIT => return Ok(()),
                TOKEN_CTL => {
                    let _ = shared.dev_ctl.read();
                    match shared.control.desired() {
                        Desired::Pause => shared.control.park(),
                        Desired::Stop => return Ok(()),
                        Desired::Run => {}
                    }
                }
                token => {
                    let Some((_, evt)) = queue_fds.iter().find(|(t, _)| *t == token) else {
                        continue;
                    };
                    if let Some(evt) = evt {
                        let _ = evt.read();
                    }
                    let d = ((token >> 16) & 0xffff) as usize;
                    let q = (token & 0xffff) as usize;
                    if let Some(t) = transports.get(d) {
                        t.lock().unwrap_or_else(|p| p.into_inner()).notify(q);
                    }
                }
            }
        }
        if shared.control.desired() == Desired::Stop {
            return Ok(());
        }
    }
}

/// Whether a kernel command line already says where the root is.
fn names_root(cmdline: &str) -> bool {
    cmdline.split_whitespace().any(|w| w.starts_with("root="))
}
