// SPDX-License-Identifier: Apache-2.0
//! The submit/complete seam between virtio-blk and its storage.
//!
//! ```text
//!  VirtioBlock ── submit(token, request) ──► dyn AsyncBlockBackend
//!       ▲                                        ├─ SyncAdapter     (any BlockBackend, inline)
//!       └──── reap() ◄── completions, any order ─└─ ThreadPoolBackend (any BlockBackend, N threads)
//! ```
//!
//! An [`AsyncBlockBackend`] takes a validated [`Request`] and completes it
//! later, in any order. It reads and writes the request's guest buffers
//! itself, before it reports the completion; once a completion is reported
//! the backend never touches that request's buffers again. When a
//! completion becomes ready after `submit` returned, the backend writes the
//! wake-up eventfd given to [`AsyncBlockBackend::set_waker`] so the device
//! thread comes back and reaps it.

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use vmm_sys_util::eventfd::EventFd;

use super::backend::BlockBackend;
use super::request::{self, DiskInfo, Request};
use crate::memory::GuestMemory;

/// A finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The token given to `submit`.
    pub token: u64,
    /// virtio-blk status byte.
    pub status: u8,
    /// Bytes written into guest buffers (excluding the status byte).
    pub written: u32,
}

/// Storage that completes requests asynchronously.
///
/// # Contract
///
/// - `submit` never blocks on I/O; the request is complete when `reap`
///   returns its token, in any order relative to other requests.
/// - A flush completes only after every write that completed before the
///   flush was submitted is durable.
/// - The backend must not touch a request's guest buffers after reporting
///   its completion. [`AsyncBlockBackend::drain`] waits until nothing is in
///   flight (the device calls it on reset).
pub trait AsyncBlockBackend: Send + Sync {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Whether the device is read-only.
    fn read_only(&self) -> bool;
    /// `VIRTIO_BLK_T_GET_ID` string.
    fn device_id(&self) -> String;
    /// Whether discard is implemented.
    fn supports_discard(&self) -> bool;
    /// Whether write-zeroes is implemented.
    fn supports_write_zeroes(&self) -> bool;
    /// Eventfd to write when a completion becomes ready asynchronously.
    fn set_waker(&self, waker: EventFd);
    /// Starts `req`; `mem` holds its buffers.
    fn submit(&self, token: u64, req: Request, mem: &GuestMemory, disk: DiskInfo);
    /// Appends every ready completion to `out`.
    fn reap(&self, out: &mut Vec<Completion>);
    /// Waits until every submitted request completed, then appends them to `out`.
    fn drain(&self, out: &mut Vec<Completion>);
}

fn run(
    backend: &dyn BlockBackend,
    token: u64,
    req: &Request,
    mem: &GuestMemory,
    disk: &DiskInfo,
    bounce: &mut Vec<u8>,
) -> Completion {
    let (status, written) = request::execute(req, mem, backend, disk, bounce);
    Completion {
        token,
        status,
        written,
    }
}

/// Runs a synchronous [`BlockBackend`] inline on the device thread: every
/// request is complete when `submit` returns.
pub struct SyncAdapter {
    inner: Arc<dyn BlockBackend>,
    done: Mutex<(VecDeque<Completion>, Vec<u8>)>,
}

impl std::fmt::Debug for SyncAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncAdapter").finish_non_exhaustive()
    }
}

impl SyncAdapter {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn BlockBackend>) -> Self {
        SyncAdapter {
            inner,
            done: Mutex::new((VecDeque::new(), Vec::new())),
        }
    }
}

macro_rules! info_from_inner {
    () => {
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
    };
}

impl AsyncBlockBackend for SyncAdapter {
    info_from_inner!();
    fn set_waker(&self, _waker: EventFd) {}
    fn submit(&self, token: u64, req: Request, mem: &GuestMemory, disk: DiskInfo) {
        let mut g = self.done.lock().unwrap_or_else(|p| p.into_inner());
        let (q, bounce) = &mut *g;
        let c = run(self.inner.as_ref(), token, &req, mem, &disk, bounce);
        q.push_back(c);
    }
    fn reap(&self, out: &mut Vec<Completion>) {
        out.extend(
            self.done
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .0
                .drain(..),
        );
    }
    fn drain(&self, out: &mut Vec<Completion>) {
        self.reap(out);
    }
}

struct Job {
    token: u64,
    req: Request,
    mem: GuestMemory,
    disk: DiskInfo,
}

#[derive(Default)]
struct Shared {
    done: VecDeque<Completion>,
    in_flight: usize,
    waker: Option<EventFd>,
}

/// Runs a synchronous [`BlockBackend`] on `threads` worker threads, so
/// requests overlap and complete out of order.
///
/// A flush waits for the requests submitted before it to finish before it
/// calls the backend's `flush`, so "every earlier-completed write" is
/// covered whatever the worker interleaving.
pub struct ThreadPoolBackend {
    inner: Arc<dyn BlockBackend>,
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for ThreadPoolBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPoolBackend").finish_non_exhaustive()
    }
}

impl ThreadPoolBackend {
    /// Starts `threads` (at least 1) workers over `inner`.
    pub fn new(inner: Arc<dyn BlockBackend>, threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let shared: Arc<(Mutex<Shared>, Condvar)> = Arc::default();
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let (rx, shared, inner) = (rx.clone(), shared.clone(), inner.clone());
            workers.push(
                std::thread::Builder::new()
                    .name(format!("blk-io-{i}"))
                    .spawn(move || worker(&*inner, &rx, &shared))?,
            );
        }
        Ok(ThreadPoolBackend {
            inner,
            tx: Mutex::new(Some(tx)),
            shared,
            workers: Mutex::new(workers),
        })
    }
}

fn worker(
    inner: &dyn BlockBackend,
    rx: &Mutex<mpsc::Receiver<Job>>,
    shared: &(Mutex<Shared>, Condvar),
) {
    let mut bounce = Vec::new();
    loop {
        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        let c = run(inner, job.token, &job.req, &job.mem, &job.disk, &mut bounce);
        drop(job);
        let (lock, cv) = shared;
        let mut s = lock.lock().unwrap_or_else(|p| p.into_inner());
        s.done.push_back(c);
        s.in_flight = s.in_flight.saturating_sub(1);
        if let Some(w) = &s.waker
            && let Err(e) = w.write(1)
        {
            tracing::warn!(error = %e, "block completion wake-up failed");
        }
        cv.notify_all();
    }
}

impl AsyncBlockBackend for ThreadPoolBackend {
    info_from_inner!();
    fn set_waker(&self, waker: EventFd) {
        self.shared
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waker = Some(waker);
    }
    fn submit(&self, token: u64, req: Request, mem: &GuestMemory, disk: DiskInfo) {
        let (lock, cv) = &*self.shared;
        if req.ty == request::RequestType::Flush {
            // Barrier: the writes the guest saw complete are in `done` or
            // already reaped; wait for everything still running too.
            let mut s = lock.lock().unwrap_or_else(|p| p.into_inner());
            while s.in_flight > 0 {
                s = cv.wait(s).unwrap_or_else(|p| p.into_inner());
            }
        }
        lock.lock().unwrap_or_else(|p| p.into_inner()).in_flight += 1;
        let job = Job {
            token,
            req,
            mem: mem.clone(),
            disk,
        };
        let sent = match &*self.tx.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        };
        if let Err(job) = sent {
            let mut s = lock.lock().unwrap_or_else(|p| p.into_inner());
            s.in_flight = s.in_flight.saturating_sub(1);
            s.done.push_back(Completion {
                token: job.token,
                status: virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR as u8,
                written: 0,
            });
        }
    }
    fn reap(&self, out: &mut Vec<Completion>) {
        out.extend(
            self.shared
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .done
                .drain(..),
        );
    }
    fn drain(&self, out: &mut Vec<Completion>) {
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock().unwrap_or_else(|p| p.into_inner());
        while s.in_flight > 0 {
            s = cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        out.extend(s.done.drain(..));
    }
}

impl Drop for ThreadPoolBackend {
    fn drop(&mut self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        for w in self
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = w.join();
        }
    }
}
