// SPDX-License-Identifier: Apache-2.0
//! The replica server (one store, many engine connections) and the engine's
//! client link to a remote replica.
//!
//! A replica's store is owned by a [`ReplicaThread`]: a mutex-guarded
//! [`ReplicaCore`] plus a thread that serves in-process (local) engines
//! through a queue. A network connection applies its requests *inline* in
//! its own task (under the mutex, in the order received, answered in that
//! order): one wake-up per batch of frames instead of three hops (reader
//! task, store thread, writer task) per request. Responses are queued and
//! written when no further complete request is buffered, so a pipelined
//! batch is read with one syscall and answered with one.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{Secret, client_handshake, server_handshake};
use crate::error::{Error, Result};
use crate::proto::msg::{FrameBuf, Op, Refusal, ReqFrame, Request, RespFrame, Response};
use crate::proto::replica::ReplicaCore;

/// Where a replica thread sends a response: the channel and a tag the
/// receiver uses to tell replicas apart.
pub type ReplySink = mpsc::UnboundedSender<(usize, RespFrame)>;

struct Job {
    frame: ReqFrame,
    reply: ReplySink,
    tag: usize,
}

/// How long a replica sees no request before its store is told it is
/// idle ([`ReplicaCore::idle`]), and how often it is told again while
/// that lasts.
pub const IDLE_AFTER: Duration = Duration::from_secs(1);

/// Handle to a replica's store: the core behind a mutex, and a thread
/// that applies queued requests of in-process engines and, while no
/// request arrives, lets the store give space back.
#[derive(Clone)]
pub struct ReplicaThread {
    tx: std_mpsc::Sender<Job>,
    core: Arc<Core>,
}

/// The core, and when it last handled a request.
struct Core {
    core: Mutex<ReplicaCore>,
    /// [`crate::net::mono_us`] after the last request.
    last_us: AtomicU64,
}

/// Whether a request only touches the page cache (no file sync): reads,
/// pings and block writes. These take microseconds and are applied in the
/// caller's task; anything that may sync goes to a thread.
pub fn is_quick(req: &Request) -> bool {
    matches!(
        req,
        Request::Ping { .. }
            | Request::Lease { .. }
            | Request::Read { .. }
            | Request::Op {
                op: Op::Write { .. } | Op::Zero { .. },
                ..
            }
    )
}

impl std::fmt::Debug for ReplicaThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplicaThread(..)")
    }
}

/// Applies one request under the core's lock. A poisoned lock (a handler
/// panicked half-way) is never used again: the request gets a fault answer.
fn apply(core: &Core, frame: ReqFrame) -> RespFrame {
    let resp = match core.core.lock() {
        Ok(mut c) => {
            let now = core.note(&frame.req);
            c.set_time(now);
            c.handle(frame.req)
        }
        Err(_) => Response::Refused(Refusal::Faulted),
    };
    RespFrame { id: frame.id, resp }
}

/// [`apply`], with the answer encoded into `out`. A read is answered
/// in place: its blocks are read from the store into `out`.
fn apply_into(core: &Core, frame: ReqFrame, out: &mut FrameBuf) {
    match core.core.lock() {
        Ok(mut c) => {
            let now = core.note(&frame.req);
            c.set_time(now);
            c.handle_into(frame.id, frame.req, out);
        }
        Err(_) => RespFrame {
            id: frame.id,
            resp: Response::Refused(Refusal::Faulted),
        }
        .encode_into(out),
    }
}

impl Core {
    /// The time now; notes it as the last request's unless `req` is one
    /// an engine sends to an idle volume too (lease renewals run on every
    /// engine tick, pings and probes check a link).
    fn note(&self, req: &Request) -> u64 {
        let now = crate::net::mono_us();
        if !matches!(
            req,
            Request::Ping { .. } | Request::Lease { .. } | Request::Probe
        ) {
            self.last_us.store(now, Ordering::Relaxed);
        }
        now
    }

    /// Tells the store it is idle if no request came for [`IDLE_AFTER`].
    fn tick_idle(&self) {
        let idle_us = IDLE_AFTER.as_micros() as u64;
        let since = crate::net::mono_us().saturating_sub(self.last_us.load(Ordering::Relaxed));
        if since < idle_us {
            return;
        }
        if let Ok(mut c) = self.core.lock() {
            c.idle();
        }
    }
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("id", &self.frame.id).finish()
    }
}

impl ReplicaThread {
    /// Starts the thread; it ends when every handle is dropped.
    pub fn spawn(core: ReplicaCore, name: &str) -> Result<ReplicaThread> {
        let (tx, rx) = std_mpsc::channel::<Job>();
        let core = Arc::new(Core {
            core: Mutex::new(core),
            last_us: AtomicU64::new(crate::net::mono_us()),
        });
        let shared = core.clone();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                loop {
                    match rx.recv_timeout(IDLE_AFTER) {
                        Ok(job) => {
                            let resp = apply(&shared, job.frame);
                            let _ = job.reply.send((job.tag, resp));
                        }
                        // Network connections apply their requests in
                        // their own tasks: the time of the last one tells.
                        Err(std_mpsc::RecvTimeoutError::Timeout) => shared.tick_idle(),
                        Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                }
                debug!("replica thread exiting");
            })
            .map_err(|source| Error::Store {
                op: "spawn replica thread",
                source,
            })?;
        Ok(ReplicaThread { tx, core })
    }

    /// Applies a request in the calling task and returns its answer. On a
    /// multi-threaded tokio runtime the (possibly blocking) store call runs
    /// under `block_in_place`, so other tasks move to another worker.
    pub fn apply_inline(&self, frame: ReqFrame) -> RespFrame {
        // Reads, pings and block writes (page-cache writes) take
        // microseconds: run them in place. `block_in_place` hands the worker
        // to another thread, which costs about as much as they do; keep it
        // for requests that may sync files (flush, attach, rebuild steps,
        // snapshots).
        let quick = is_quick(&frame.req);
        let multi = !quick
            && tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi {
            tokio::task::block_in_place(|| apply(&self.core, frame))
        } else {
            apply(&self.core, frame)
        }
    }

    /// [`ReplicaThread::apply_inline`], with the answer encoded into `out`
    /// (a frame in a send queue; reads are answered in place).
    pub fn apply_inline_into(&self, frame: ReqFrame, out: &mut FrameBuf) {
        let quick = is_quick(&frame.req);
        let multi = !quick
            && tokio::runtime::Handle::try_current()
                .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi {
            tokio::task::block_in_place(|| apply_into(&self.core, frame, out))
        } else {
            apply_into(&self.core, frame, out)
        }
    }

    /// Closes the store for a process exit ([`ReplicaCore::shutdown`]);
    /// requests after it are refused.
    pub fn shutdown(&self) -> Result<()> {
        match self.core.core.lock() {
            Ok(mut c) => c.shutdown(),
            Err(_) => Err(Error::Replica("replica state poisoned by a panic".into())),
        }
    }

    /// Queues a request; the response goes to `reply` tagged with `tag`.
    /// Returns false if the thread is gone.
    pub fn submit(&self, frame: ReqFrame, reply: ReplySink, tag: usize) -> bool {
        self.tx.send(Job { frame, reply, tag }).is_ok()
    }
}

/// Serves a replica to authenticated engines until the listener fails.
///
/// An accept error for one connection, or a lack of descriptors or memory,
/// does not stop it (see [`super::accept`]).
pub async fn serve(listener: TcpListener, secret: Secret, replica: ReplicaThread) -> Result<()> {
    let mut backoff = super::accept::AcceptBackoff::new();
    loop {
        let (sock, peer) = match listener.accept().await {
            Ok(x) => {
                backoff.reset();
                x
            }
            Err(source) => {
                if backoff.handle("replica", &source).await {
                    continue;
                }
                return Err(Error::Net {
                    op: "accept",
                    source,
                });
            }
        };
        let secret = secret.clone();
        let replica = replica.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_conn(sock, peer, secret, replica).await {
                warn!(%peer, error = %e, "replication connection closed");
            }
        });
    }
}

async fn serve_conn(
    sock: TcpStream,
    peer: SocketAddr,
    secret: Secret,
    replica: ReplicaThread,
) -> Result<()> {
    let _ = sock.set_nodelay(true);
    let (r, w) = sock.into_split();
    let (mut rd, mut wr) = tokio::time::timeout(
        Duration::from_secs(10),
        server_handshake(r, w, &secret, peer.ip().is_loopback()),
    )
    .await
    .map_err(|_| Error::Auth("handshake timed out".into()))??;
    let frames = if wr.checksummed() {
        "checksummed"
    } else {
        "encrypted"
    };
    info!(%peer, frames, "engine connected");
    loop {
        let frame = match rd.recv().await? {
            Some(f) => f,
            None => return wr.flush().await,
        };
        // Write data stays in the received frame (no copy).
        let req = ReqFrame::decode_bytes(&frame).map_err(Error::Decode)?;
        // The answer is encoded straight into the send queue: a read's
        // blocks go from the store into the frame.
        wr.send_with(|out| {
            replica.apply_inline_into(req, out);
            Ok(())
        })
        .await?;
        // Coalesce: answer the batch once no further request is buffered.
        if !rd.frame_buffered() {
            wr.flush().await?;
        }
    }
}

/// Keeps a connection to a remote replica for an engine: reconnects with
/// backoff, forwards requests from `requests`, and reports responses (tagged
/// `id`) and disconnections (`None`) to `events`.
pub async fn remote_link(
    id: usize,
    addr: SocketAddr,
    secret: Secret,
    mut requests: mpsc::UnboundedReceiver<ReqFrame>,
    events: mpsc::UnboundedSender<(usize, Option<RespFrame>)>,
) {
    let mut backoff = Duration::from_millis(20);
    loop {
        let conn = async {
            let sock = TcpStream::connect(addr)
                .await
                .map_err(|source| Error::Net {
                    op: "connect",
                    source,
                })?;
            let _ = sock.set_nodelay(true);
            let (r, w) = sock.into_split();
            tokio::time::timeout(
                Duration::from_secs(5),
                client_handshake(r, w, &secret, addr.ip().is_loopback()),
            )
            .await
            .map_err(|_| Error::Auth("handshake timed out".into()))?
        };
        let (mut rd, mut wr) = match conn.await {
            Ok(x) => x,
            Err(e) => {
                debug!(replica = id, %addr, error = %e, "connect failed");
                // Drain requests sent while down: they are lost, the engine times them out.
                while requests.try_recv().is_ok() {}
                if events.is_closed() {
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
                continue;
            }
        };
        backoff = Duration::from_millis(20);
        debug!(replica = id, %addr, checksummed = wr.checksummed(), "connected");
        let ev = events.clone();
        let mut reader = tokio::spawn(async move {
            loop {
                match rd.recv().await {
                    // Read data stays in the received frame (no copy).
                    Ok(Some(f)) => match RespFrame::decode_bytes(&f) {
                        Ok(resp) => {
                            if ev.send((id, Some(resp))).is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            warn!(replica = id, error = %e, "bad response frame");
                            return;
                        }
                    },
                    Ok(None) => return,
                    Err(e) => {
                        debug!(replica = id, error = %e, "link read failed");
                        return;
                    }
                }
            }
        });
        loop {
            tokio::select! {
                req = requests.recv() => {
                    let Some(req) = req else {
                        reader.abort();
                        return;
                    };
                    if wr.send_req(&req).await.is_err() {
                        break;
                    }
                    let mut ok = true;
                    while let Ok(more) = requests.try_recv() {
                        if wr.send_req(&more).await.is_err() {
                            ok = false;
                            break;
                        }
                    }
                    if !ok || wr.flush().await.is_err() {
                        break;
                    }
                }
                _ = &mut reader => break,
            }
        }
        reader.abort();
        if events.send((id, None)).is_err() {
            return;
        }
    }
}
