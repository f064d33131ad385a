// SPDX-License-Identifier: Apache-2.0
//! The source side of a pre-copy migration ([`Vm::migrate`]): RAM passes
//! while the guest runs, auto-converge, stop-and-copy, hand-over.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};

use super::dirty::DirtySet;
use super::transport::{MAX_PAYLOAD, Role, SecureStream, TransportError};
use super::wire::{self, Msg, PAGE, PagesBuf};
use super::{MigrationConfig, MigrationError, MigrationReport, PassReport, Phase, Progress};
use crate::error::{Error, Result};
use crate::vm::{Vm, VmState};

/// Auto-converge steps (throttle +20 points each, up to 90 %) after
/// `max_iterations` before the stop-and-copy is forced.
const THROTTLE_STEPS: u32 = 5;
const THROTTLE_STEP: u8 = 20;
const THROTTLE_MAX: u8 = 90;
/// Length of one throttle interval (vCPUs held for `percent` of it).
const THROTTLE_INTERVAL: Duration = Duration::from_millis(20);
/// A pass whose dirty set is at least this share (in tenths) of the
/// previous one is not converging.
const STALL_TENTHS: u64 = 9;

pub(crate) fn tx(e: TransportError) -> Error {
    Error::Migration(MigrationError::Transport(e))
}

pub(crate) fn proto(e: MigrationError) -> Error {
    Error::Migration(e)
}

/// Receives one message, mapping `Abort` to [`MigrationError::PeerAborted`].
pub(crate) fn recv<'a>(link: &mut SecureStream, buf: &'a mut Vec<u8>) -> Result<Msg<'a>> {
    let p = link.recv(buf).map_err(tx)?;
    match wire::decode(p).map_err(proto)? {
        Msg::Abort(r) => Err(proto(MigrationError::PeerAborted(r))),
        m => Ok(m),
    }
}

fn unexpected(m: &Msg<'_>, wanted: &str) -> Error {
    proto(MigrationError::Protocol(format!(
        "got {} while waiting for {wanted}",
        m.name()
    )))
}

/// Holds the vCPUs out of the guest for a share of every interval.
struct Throttle {
    percent: AtomicU8,
    stop: AtomicBool,
}

impl Throttle {
    fn run(&self, vm: &Vm) {
        while !self.stop.load(Ordering::Acquire) {
            let pct = u32::from(self.percent.load(Ordering::Acquire));
            if pct == 0 {
                std::thread::sleep(THROTTLE_INTERVAL);
                continue;
            }
            let held = THROTTLE_INTERVAL * pct / 100;
            if vm.hold_vcpus(true) {
                std::thread::sleep(held);
                vm.hold_vcpus(false);
            }
            std::thread::sleep(THROTTLE_INTERVAL - held);
        }
        vm.hold_vcpus(false);
    }
}

/// Keeps the send rate under `limit` bytes/s.
struct Pacer {
    limit: Option<u64>,
    start: Instant,
    base: u64,
}

impl Pacer {
    fn pace(&self, sent: u64) {
        let Some(limit) = self.limit else { return };
        let due = Duration::from_secs_f64((sent - self.base) as f64 / limit as f64);
        let el = self.start.elapsed();
        if due > el {
            std::thread::sleep(due - el);
        }
    }
}

struct Source<'a> {
    vm: &'a Vm,
    cfg: &'a MigrationConfig,
    link: SecureStream,
    pacer: Pacer,
    buf: Vec<u8>,
    passes: Vec<PassReport>,
    phase: Phase,
    /// Set once this migration paused the guest (resume it on failure).
    paused_at: Option<Instant>,
    committed: bool,
    rate: u64,
    state_bytes: u64,
}

impl Vm {
    /// Live-migrates this VM to a target listening at the other end of
    /// `stream` ([`crate::VmBuilder::receive_migration`]). The VM must have
    /// `memory.track_dirty_pages` and be running (or paused).
    ///
    /// On success the target runs the guest and this VM is stopped. Before
    /// the hand-over, any failure resumes this VM and returns
    /// [`MigrationError::Failed`] naming the phase; see
    /// [`MigrationError::InDoubt`] for the one window where it stays paused.
    /// Do not pause, resume or stop the VM from another thread meanwhile.
    pub fn migrate(&self, stream: TcpStream, cfg: &MigrationConfig) -> Result<MigrationReport> {
        cfg.validate()?;
        if !self.tracks_dirty_pages() {
            return Err(MigrationError::Unsupported(
                "the VM was built without memory.track_dirty_pages",
            )
            .into());
        }
        let state = self.state();
        if state != VmState::Running && state != VmState::Paused {
            return Err(Error::InvalidState {
                op: "migrate",
                state,
            });
        }
        let started = Instant::now();
        cfg.notify(Progress::Phase(Phase::Handshake));
        let link = match SecureStream::handshake(stream, &cfg.key, Role::Source, cfg.io_timeout) {
            Ok(l) => l,
            Err(e) => {
                return Err(MigrationError::Failed {
                    phase: Phase::Handshake,
                    source_running: state == VmState::Running,
                    cause: Box::new(tx(e)),
                }
                .into());
            }
        };
        let mut src = Source {
            vm: self,
            cfg,
            pacer: Pacer {
                limit: cfg.bandwidth_limit,
                start: Instant::now(),
                base: link.bytes_sent(),
            },
            link,
            buf: Vec::new(),
            passes: Vec::new(),
            phase: Phase::Handshake,
            paused_at: None,
            committed: false,
            rate: 0,
            state_bytes: 0,
        };
        match src.run(started) {
            Ok(r) => {
                tracing::info!(
                    vm = %self.name(),
                    passes = r.passes.len(),
                    downtime_ms = r.downtime.as_secs_f64() * 1e3,
                    total_ms = r.total_time.as_secs_f64() * 1e3,
                    "VM migrated"
                );
                Ok(r)
            }
            Err(cause) => Err(src.fail(cause, state)),
        }
    }
}

impl Source<'_> {
    fn fail(&mut self, cause: Error, initial: VmState) -> Error {
        let _ = self
            .link
            .send(&wire::encode(&Msg::Abort(cause.to_string())));
        self.link.shutdown();
        if self.committed {
            tracing::error!(vm = %self.vm.name(), error = %cause, "migration in doubt after the commit; the VM stays paused");
            return MigrationError::InDoubt {
                cause: Box::new(cause),
            }
            .into();
        }
        if self.paused_at.is_some()
            && initial == VmState::Running
            && let Err(e) = self.vm.resume()
        {
            tracing::error!(vm = %self.vm.name(), error = %e, "cannot resume the VM after a failed migration");
        }
        let source_running = self.vm.state() == VmState::Running;
        tracing::warn!(vm = %self.vm.name(), phase = %self.phase, error = %cause, source_running, "migration failed; the VM stays here");
        MigrationError::Failed {
            phase: self.phase,
            source_running,
            cause: Box::new(cause),
        }
        .into()
    }

    fn enter(&mut self, phase: Phase) {
        self.phase = phase;
        self.cfg.notify(Progress::Phase(phase));
    }

    fn send(&mut self, payload: &[u8]) -> Result<()> {
        self.link.send(payload).map_err(tx)?;
        self.pacer.pace(self.link.bytes_sent());
        Ok(())
    }

    fn run(&mut self, started: Instant) -> Result<MigrationReport> {
        let vm = self.vm;
        self.send(&wire::encode(&Msg::Hello {
            version: wire::VERSION,
            memory_bytes: vm.ram_size(),
            vcpus: vm.vcpu_count() as u32,
        }))?;
        let mut buf = std::mem::take(&mut self.buf);
        match recv(&mut self.link, &mut buf)? {
            Msg::HelloAck => {}
            m => return Err(unexpected(&m, "HelloAck")),
        }
        self.buf = buf;
        let throttle = Throttle {
            percent: AtomicU8::new(0),
            stop: AtomicBool::new(false),
        };
        let (carry, converged) = std::thread::scope(|sc| {
            let h = if vm.state() == VmState::Running {
                Some(sc.spawn(|| throttle.run(vm)))
            } else {
                None
            };
            let r = self.precopy(&throttle);
            throttle.stop.store(true, Ordering::Release);
            if let Some(h) = h {
                let _ = h.join();
            }
            r
        })?;
        let downtime_start = self.stop_and_copy(carry)?;
        let downtime = downtime_start.elapsed();
        vm.stop();
        Ok(MigrationReport {
            max_throttle_percent: self
                .passes
                .iter()
                .map(|p| p.throttle_percent)
                .max()
                .unwrap_or(0),
            passes: std::mem::take(&mut self.passes),
            total_time: started.elapsed(),
            downtime,
            converged,
            link_bytes_per_sec: self.rate,
            state_bytes: self.state_bytes,
            total_bytes: self.link.bytes_sent(),
        })
    }

    /// Pass 0 and the dirty passes; returns the pages still to send and
    /// whether they fit the budget.
    fn precopy(&mut self, throttle: &Throttle) -> Result<(DirtySet, bool)> {
        let vm = self.vm;
        let mem = vm.guest_memory();
        self.enter(Phase::Precopy { pass: 0 });
        // Clear the log: everything written from here on is sent again.
        vm.dirty_pages()?;
        let mut set = DirtySet::full(mem);
        let mut pass = 0u32;
        let mut prev_dirty = u64::MAX;
        loop {
            let pct = throttle.percent.load(Ordering::Acquire);
            let t0 = Instant::now();
            let b0 = self.link.bytes_sent();
            let (pages, zero) = self.send_pages(pass, &set)?;
            let duration = t0.elapsed();
            let bytes = self.link.bytes_sent() - b0;
            let mut dirty = DirtySet::empty(mem);
            dirty.add_log(&vm.dirty_pages()?);
            let dirtied = dirty.count();
            // Link rate of this pass (a floor keeps estimates finite).
            let secs = duration.as_secs_f64().max(1e-4);
            self.rate = ((bytes as f64 / secs) as u64).max(1 << 20);
            let report = PassReport {
                pass,
                pages,
                zero_pages: zero,
                bytes,
                duration,
                dirtied,
                throttle_percent: pct,
                final_pass: false,
            };
            tracing::debug!(vm = %vm.name(), ?report, rate = self.rate, "pre-copy pass done");
            self.cfg.notify(Progress::Pass(report.clone()));
            self.passes.push(report);
            set = dirty;
            let est =
                Duration::from_secs_f64(dirtied as f64 * (PAGE + 8) as f64 / self.rate as f64);
            if est <= self.cfg.downtime_budget {
                return Ok((set, true));
            }
            pass += 1;
            let limit = self.cfg.max_iterations
                + if self.cfg.auto_converge {
                    THROTTLE_STEPS
                } else {
                    0
                };
            if pass > limit {
                tracing::warn!(vm = %vm.name(), pass, dirtied, "pre-copy did not converge; forcing the stop-and-copy");
                return Ok((set, false));
            }
            let stalled = pass >= 3 && dirtied * 10 >= prev_dirty.saturating_mul(STALL_TENTHS);
            if self.cfg.auto_converge && (pass > self.cfg.max_iterations || stalled) {
                let next = pct.saturating_add(THROTTLE_STEP).min(THROTTLE_MAX);
                if next != pct {
                    tracing::info!(vm = %vm.name(), throttle_percent = next, "auto-converge: throttling vCPUs");
                    throttle.percent.store(next, Ordering::Release);
                }
            }
            prev_dirty = dirtied;
            self.enter(Phase::Precopy { pass });
        }
    }

    /// Sends every page of `set`; returns (pages, zero pages).
    fn send_pages(&mut self, pass: u32, set: &DirtySet) -> Result<(u64, u64)> {
        let mem = self.vm.guest_memory();
        let mut msg = PagesBuf::new(pass);
        let mut page = vec![0u8; PAGE];
        let (mut n, mut zero) = (0u64, 0u64);
        for gpa in set.iter() {
            mem.read_slice(&mut page, GuestAddress(gpa))
                .map_err(|source| crate::vm::state::SnapshotError::GuestMemory {
                    addr: gpa,
                    source,
                })?;
            if wire::is_zero(&page) {
                zero += 1;
                msg.push(gpa, None);
            } else {
                msg.push(gpa, Some(&page));
            }
            n += 1;
            if msg.full() {
                self.link.send(msg.payload()).map_err(tx)?;
                self.pacer.pace(self.link.bytes_sent());
                msg.clear();
            }
        }
        if msg.count() > 0 {
            self.link.send(msg.payload()).map_err(tx)?;
            self.pacer.pace(self.link.bytes_sent());
        }
        self.send(&wire::encode(&Msg::PassEnd { pass, pages: n }))?;
        Ok((n, zero))
    }

    /// Pauses the guest, sends the rest and the state, hands over. Returns
    /// when the pause began.
    fn stop_and_copy(&mut self, carry: DirtySet) -> Result<Instant> {
        let vm = self.vm;
        self.enter(Phase::StopAndCopy);
        let paused_at = Instant::now();
        if vm.state() == VmState::Running {
            vm.pause()?;
            self.paused_at = Some(paused_at);
        }
        // Completes in-flight disk requests into guest memory first; the
        // dirty log then holds every page vCPUs or devices wrote since the
        // last pass (device writes through vm-memory's bitmap).
        let snap = vm.snapshot_state()?;
        let mut set = carry;
        set.add_log(&vm.dirty_pages()?);
        let pass = self.passes.len() as u32;
        let t0 = Instant::now();
        let b0 = self.link.bytes_sent();
        let (pages, zero) = self.send_pages(pass, &set)?;
        let json = snap.to_json()?;
        for chunk in json.chunks(MAX_PAYLOAD - 1) {
            self.send(&wire::encode(&Msg::StateChunk(chunk)))?;
        }
        self.send(&wire::encode(&Msg::StateEnd {
            total: json.len() as u64,
        }))?;
        self.state_bytes = json.len() as u64;
        let report = PassReport {
            pass,
            pages,
            zero_pages: zero,
            bytes: self.link.bytes_sent() - b0,
            duration: t0.elapsed(),
            dirtied: 0,
            throttle_percent: 0,
            final_pass: true,
        };
        self.cfg.notify(Progress::Pass(report.clone()));
        self.passes.push(report);

        self.enter(Phase::AwaitReady);
        let mut buf = std::mem::take(&mut self.buf);
        match recv(&mut self.link, &mut buf)? {
            Msg::Ready => {}
            m => return Err(unexpected(&m, "Ready")),
        }
        self.enter(Phase::AwaitRunning);
        self.send(&wire::encode(&Msg::Commit))?;
        self.committed = true;
        match recv(&mut self.link, &mut buf) {
            Ok(Msg::Running) => {}
            // The target said it will not run: safe to resume here.
            Err(Error::Migration(MigrationError::PeerAborted(r))) => {
                self.committed = false;
                return Err(proto(MigrationError::PeerAborted(r)));
            }
            Ok(m) => return Err(unexpected(&m, "Running")),
            Err(e) => return Err(e),
        }
        self.buf = buf;
        Ok(paused_at)
    }
}
