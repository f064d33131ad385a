// SPDX-License-Identifier: Apache-2.0
//! vCPU threads: the KVM_RUN loop, exit dispatch, and the kick that makes
//! pause and stop take effect even while a vCPU sits in the guest.
//!
//! Kicking: the controller changes the desired run state, then sends
//! [`kick_signal`] to every vCPU thread. The handler sets `immediate_exit`
//! in that thread's `kvm_run` (through a thread-local pointer), so a vCPU
//! either leaves KVM_RUN with `EINTR`, or — if the signal landed just before
//! it entered — KVM_RUN returns at once. Either way the loop re-reads the
//! desired state before running guest code again.
//!
//! Pausing: before it parks, a vCPU re-enters KVM_RUN once with
//! `immediate_exit` set, which completes the port or MMIO access of its last
//! exit (KVM finishes the instruction only on the next KVM_RUN) without
//! running guest code, so a paused vCPU's registers are consistent. It then
//! releases its `VcpuFd` (a mutex) while parked, so the VM can read or load
//! its state, and takes it back before running again.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::devices::Bus;
use crate::exit::{ExitLatch, ExitReason};

/// The run state the controller wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Desired {
    Run,
    Pause,
    Stop,
}

/// Shared run control for the vCPU threads and the device thread.
#[derive(Debug)]
pub(crate) struct RunControl {
    state: Mutex<(Desired, usize)>,
    cv: Condvar,
}

impl RunControl {
    pub(crate) fn new() -> Self {
        RunControl {
            state: Mutex::new((Desired::Run, 0)),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Desired, usize)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn desired(&self) -> Desired {
        self.lock().0
    }

    pub(crate) fn set(&self, d: Desired) {
        let mut g = self.lock();
        // Stop is final.
        if g.0 != Desired::Stop {
            g.0 = d;
        }
        self.cv.notify_all();
    }

    /// Parks the calling thread while the desired state is Pause.
    pub(crate) fn park(&self) {
        let mut g = self.lock();
        g.1 += 1;
        self.cv.notify_all();
        while g.0 == Desired::Pause {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        g.1 -= 1;
        self.cv.notify_all();
    }

    /// Waits until `n` threads are parked; false on timeout or stop.
    pub(crate) fn wait_parked(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut g = self.lock();
        while g.1 < n && g.0 == Desired::Pause {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        g.1 >= n
    }
}

/// Counters for one vCPU.
#[derive(Debug, Default)]
pub struct VcpuStats {
    /// Port I/O exits.
    pub pio_exits: AtomicU64,
    /// MMIO exits.
    pub mmio_exits: AtomicU64,
    /// KVM_RUN returns interrupted by a kick.
    pub kicks: AtomicU64,
}

thread_local! {
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn handle_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Only async-signal-safe work here: a thread-local read and a volatile store.
    let p = IMMEDIATE_EXIT.with(|c| c.get());
    if !p.is_null() {
        // SAFETY: `p` points into this thread's kvm_run mapping, set by
        // `run_vcpu` while it owns the VcpuFd and cleared before the VcpuFd
        // is dropped; the signal is delivered to this thread only.
        unsafe { std::ptr::write_volatile(p, 1) };
    }
}

/// The real-time signal used to kick vCPU threads out of KVM_RUN.
pub fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN() + 1
}

/// Installs the kick handler once per process.
pub(crate) fn install_kick_handler() -> std::io::Result<()> {
    static ONCE: OnceLock<Result<(), i32>> = OnceLock::new();
    ONCE.get_or_init(|| {
        vmm_sys_util::signal::register_signal_handler(kick_signal(), handle_kick)
            .map_err(|e| e.errno())
    })
    .map_err(std::io::Error::from_raw_os_error)
}

/// Everything a vCPU thread needs.
pub(crate) struct VcpuContext {
    pub id: u8,
    pub fd: Arc<Mutex<VcpuFd>>,
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub exit: ExitLatch,
    pub control: Arc<RunControl>,
    pub stats: Arc<VcpuStats>,
    pub first_exit: Arc<OnceLock<Instant>>,
}

/// The vCPU thread body.
pub(crate) fn run_vcpu(ctx: VcpuContext) {
    let slot = ctx.fd.clone();
    let lock = || slot.lock().unwrap_or_else(|p| p.into_inner());
    let mut fd = lock();
    // The kvm_run mapping lives as long as the VcpuFd, which the slot keeps
    // for the whole thread; the pointer stays valid while the lock is
    // released during a pause.
    let p: *mut u8 = &mut fd.get_kvm_run().immediate_exit;
    IMMEDIATE_EXIT.with(|c| c.set(p));
    loop {
        match ctx.control.desired() {
            Desired::Stop => break,
            Desired::Pause => {
                if let Some(reason) = complete_pending_io(&ctx, &mut fd) {
                    ctx.exit.request(reason);
                    break;
                }
                drop(fd);
                ctx.control.park();
                fd = lock();
                continue;
            }
            Desired::Run => {}
        }
        if ctx.exit.is_set() {
            break;
        }
        if let Some(reason) = run_once(&ctx, &mut fd) {
            ctx.exit.request(reason);
            break;
        }
    }
    IMMEDIATE_EXIT.with(|c| c.set(std::ptr::null_mut()));
}

/// Re-enters KVM_RUN with `immediate_exit` set until it returns `EINTR`:
/// KVM completes the last exit's access (a `rep` string access may exit
/// again; those exits are served) without running guest code.
fn complete_pending_io(ctx: &VcpuContext, fd: &mut MutexGuard<'_, VcpuFd>) -> Option<ExitReason> {
    for _ in 0..PENDING_IO_ROUNDS {
        fd.set_kvm_immediate_exit(1);
        let kicks = ctx.stats.kicks.load(Ordering::Relaxed);
        if let Some(reason) = run_once(ctx, fd) {
            return Some(reason);
        }
        if ctx.stats.kicks.load(Ordering::Relaxed) != kicks {
            return None;
        }
    }
    Some(ExitReason::InternalError {
        detail: format!(
            "vCPU {} kept exiting while completing its last access for a pause",
            ctx.id
        ),
    })
}

/// Exits served while completing an access before KVM_RUN returns `EINTR`.
const PENDING_IO_ROUNDS: usize = 4096;

fn run_once(ctx: &VcpuContext, fd: &mut VcpuFd) -> Option<ExitReason> {
    let id = ctx.id;
    let crash = |detail: String| {
        tracing::warn!(vcpu = id, %detail, "vCPU crashed");
        Some(ExitReason::Crash { vcpu: id, detail })
    };
    match fd.run() {
        Ok(exit) => {
            match exit {
                VcpuExit::IoIn(port, data) => {
                    ctx.stats.pio_exits.fetch_add(1, Ordering::Relaxed);
                    ctx.first_exit.get_or_init(Instant::now);
                    ctx.pio.read(u64::from(port), data);
                }
                VcpuExit::IoOut(port, data) => {
                    ctx.stats.pio_exits.fetch_add(1, Ordering::Relaxed);
                    ctx.first_exit.get_or_init(Instant::now);
                    ctx.pio.write(u64::from(port), data);
                }
                VcpuExit::MmioRead(addr, data) => {
                    ctx.stats.mmio_exits.fetch_add(1, Ordering::Relaxed);
                    ctx.first_exit.get_or_init(Instant::now);
                    ctx.mmio.read(addr, data);
                }
                VcpuExit::MmioWrite(addr, data) => {
                    ctx.stats.mmio_exits.fetch_add(1, Ordering::Relaxed);
                    ctx.first_exit.get_or_init(Instant::now);
                    ctx.mmio.write(addr, data);
                }
                VcpuExit::Hlt => return crash("HLT exit with the in-kernel irqchip".into()),
                VcpuExit::Shutdown => {
                    let rip = fd.get_regs().map(|r| r.rip).unwrap_or(0);
                    return crash(format!("triple fault (rip {rip:#x})"));
                }
                VcpuExit::FailEntry(reason, cpu) => {
                    return crash(format!("VM entry failed: reason {reason:#x} on cpu {cpu}"));
                }
                VcpuExit::InternalError => {
                    let rip = fd.get_regs().map(|r| r.rip).unwrap_or(0);
                    return crash(format!("KVM internal error (rip {rip:#x})"));
                }
                VcpuExit::SystemEvent(kind, _) => {
                    return Some(match kind {
                        kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => ExitReason::Shutdown,
                        kvm_bindings::KVM_SYSTEM_EVENT_RESET => ExitReason::Reset,
                        k => ExitReason::Crash {
                            vcpu: id,
                            detail: format!("system event {k}"),
                        },
                    });
                }
                VcpuExit::Intr => {}
                other => {
                    tracing::debug!(vcpu = id, exit = ?other, "ignored vCPU exit");
                }
            }
            None
        }
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
            fd.set_kvm_immediate_exit(0);
            ctx.stats.kicks.fetch_add(1, Ordering::Relaxed);
            None
        }
        Err(e) => Some(ExitReason::InternalError {
            detail: format!("KVM_RUN on vCPU {id} failed: {e}"),
        }),
    }
}
