// SPDX-License-Identifier: Apache-2.0
//! The replica server (one store, many engine connections) and the engine's
//! client link to a remote replica.
//!
//! A replica's store lives on one dedicated thread ([`ReplicaThread`]):
//! requests from every connection queue to it in arrival order, so a
//! connection's requests are applied in the order sent and answered in that
//! order (pipelined, no head-of-line wait on the network side).

use std::net::SocketAddr;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{Secret, client_handshake, server_handshake};
use crate::error::{Error, Result};
use crate::proto::msg::{ReqFrame, RespFrame};
use crate::proto::replica::ReplicaCore;

/// Where a replica thread sends a response: the channel and a tag the
/// receiver uses to tell replicas apart.
pub type ReplySink = mpsc::UnboundedSender<(usize, RespFrame)>;

struct Job {
    frame: ReqFrame,
    reply: ReplySink,
    tag: usize,
}

/// Handle to the thread that owns a replica's store.
#[derive(Clone, Debug)]
pub struct ReplicaThread {
    tx: std_mpsc::Sender<Job>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("id", &self.frame.id).finish()
    }
}

impl ReplicaThread {
    /// Starts the thread; it ends when every handle is dropped.
    pub fn spawn(mut core: ReplicaCore, name: &str) -> Result<ReplicaThread> {
        let (tx, rx) = std_mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let resp = core.handle(job.frame.req);
                    let _ = job.reply.send((
                        job.tag,
                        RespFrame {
                            id: job.frame.id,
                            resp,
                        },
                    ));
                }
                debug!("replica thread exiting");
            })
            .map_err(|source| Error::Store {
                op: "spawn replica thread",
                source,
            })?;
        Ok(ReplicaThread { tx })
    }

    /// Queues a request; the response goes to `reply` tagged with `tag`.
    /// Returns false if the thread is gone.
    pub fn submit(&self, frame: ReqFrame, reply: ReplySink, tag: usize) -> bool {
        self.tx.send(Job { frame, reply, tag }).is_ok()
    }
}

/// Serves a replica to authenticated engines until the listener fails.
pub async fn serve(listener: TcpListener, secret: Secret, replica: ReplicaThread) -> Result<()> {
    loop {
        let (sock, peer) = listener.accept().await.map_err(|source| Error::Net {
            op: "accept",
            source,
        })?;
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
    let (mut rd, mut wr) =
        tokio::time::timeout(Duration::from_secs(10), server_handshake(r, w, &secret))
            .await
            .map_err(|_| Error::Auth("handshake timed out".into()))??;
    info!(%peer, "engine connected");
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, RespFrame)>();
    let writer = tokio::spawn(async move {
        while let Some((_, resp)) = rx.recv().await {
            if wr.send(&resp.encode()).await.is_err() {
                break;
            }
            // Coalesce: flush only when no more responses are ready.
            if rx.is_empty() && wr.flush().await.is_err() {
                break;
            }
        }
    });
    let res = loop {
        let frame = match rd.recv().await {
            Ok(Some(f)) => f,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        let req = match ReqFrame::decode(&frame) {
            Ok(r) => r,
            Err(e) => break Err(Error::Decode(e)),
        };
        if !replica.submit(req, tx.clone(), 0) {
            break Err(Error::Replica("replica thread stopped".into()));
        }
    };
    drop(tx);
    let _ = writer.await;
    res
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
            tokio::time::timeout(Duration::from_secs(5), client_handshake(r, w, &secret))
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
        debug!(replica = id, %addr, "connected");
        let ev = events.clone();
        let mut reader = tokio::spawn(async move {
            loop {
                match rd.recv().await {
                    Ok(Some(f)) => match RespFrame::decode(&f) {
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
                    if wr.send(&req.encode()).await.is_err() {
                        break;
                    }
                    let mut ok = true;
                    while let Ok(more) = requests.try_recv() {
                        if wr.send(&more.encode()).await.is_err() {
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
