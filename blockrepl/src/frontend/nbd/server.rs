// SPDX-License-Identifier: Apache-2.0
//! The tokio NBD server: listeners, the handshake I/O loop and the
//! transmission pipeline of one connection.
//!
//! ```text
//!  socket ─► reader task ──(bounded: max_in_flight requests,
//!            │               max_in_flight_bytes of payload)──► one task per request ─► Disk
//!            │                                                         │
//!            └◄───────────────── writer task ◄── reply channel ◄───────┘
//! ```
//!
//! Replies leave in completion order (NBD matches them by cookie). The
//! reader stops at `NBD_CMD_DISC`, EOF or a framing error; the connection
//! closes once every request it started has been answered.

use std::collections::BTreeMap;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{Semaphore, mpsc};
use tracing::{debug, info, warn};

use super::NbdError;
use super::proto::{
    self, BlockSizes, Catalog, Command, Decoded, ExportInfo, Negotiation, Phase, ProtocolError,
    REQUEST_HEADER_LEN, Request, Session, TlsMode, errno,
};
use crate::error::Error;
use crate::frontend::disk::Disk;
use crate::net::accept::AcceptBackoff;
use crate::recvbuf::RecvBuf;

/// A byte stream a connection runs over (plain socket or TLS).
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

type BoxStream = Pin<Box<dyn Stream>>;

/// Server settings.
#[derive(Clone)]
pub struct NbdConfig {
    /// Requests one connection may have in flight (reads stop beyond it).
    pub max_in_flight: usize,
    /// Payload bytes one connection may have in flight; at least `block.max`.
    pub max_in_flight_bytes: usize,
    /// Deadline for the whole handshake.
    pub handshake_timeout: Duration,
    /// Block size constraints advertised for every export.
    pub block: BlockSizes,
    /// The export a client gets for the empty name (`None`: the only
    /// export, if there is exactly one).
    pub default_export: Option<String>,
    /// TLS: the acceptor and whether it is required.
    pub tls: Option<(tokio_rustls::TlsAcceptor, TlsMode)>,
}

impl std::fmt::Debug for NbdConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdConfig")
            .field("max_in_flight", &self.max_in_flight)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("block", &self.block)
            .field("default_export", &self.default_export)
            .field("tls", &self.tls.as_ref().map(|t| t.1))
            .finish()
    }
}

impl Default for NbdConfig {
    fn default() -> Self {
        NbdConfig {
            max_in_flight: 128,
            max_in_flight_bytes: 64 << 20,
            handshake_timeout: Duration::from_secs(30),
            block: BlockSizes::default(),
            default_export: None,
            tls: None,
        }
    }
}

/// One export: a disk and how it is offered.
#[derive(Clone, Debug)]
pub struct Export {
    /// The disk served.
    pub disk: Disk,
    /// Description shown by `nbdinfo`.
    pub description: String,
    /// Refuse writes.
    pub read_only: bool,
}

impl Export {
    /// A writable export of `disk`.
    pub fn new(disk: Disk) -> Export {
        Export {
            disk,
            description: String::new(),
            read_only: false,
        }
    }

    /// Sets the description.
    pub fn description(mut self, d: impl Into<String>) -> Export {
        self.description = d.into();
        self
    }

    /// Makes the export read-only.
    pub fn read_only(mut self, ro: bool) -> Export {
        self.read_only = ro;
        self
    }
}

/// Counters of a server (all connections since it started).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NbdStats {
    /// Connections accepted.
    pub connections: u64,
    /// Connections now open. A closed connection's effect on the other
    /// counters is visible once it no longer counts here (a client can see
    /// the close slightly earlier).
    pub active: u64,
    /// Connections that reached transmission.
    pub sessions: u64,
    /// Connections closed for a protocol violation.
    pub protocol_errors: u64,
    /// Requests executed or rejected.
    pub requests: u64,
    /// Requests answered with an error.
    pub request_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    active: AtomicU64,
    sessions: AtomicU64,
    protocol_errors: AtomicU64,
    requests: AtomicU64,
    request_errors: AtomicU64,
}

#[derive(Debug)]
struct Inner {
    exports: RwLock<BTreeMap<String, Export>>,
    cfg: NbdConfig,
    counters: Counters,
}

/// An NBD server: a set of named exports served on any number of
/// listeners. Cheap to clone.
#[derive(Clone, Debug)]
pub struct NbdServer {
    inner: Arc<Inner>,
}

struct CatalogView<'a>(&'a Inner);

impl Catalog for CatalogView<'_> {
    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        let exports = self.0.exports.read().unwrap_or_else(|p| p.into_inner());
        let (name, e) = if name.is_empty() {
            match &self.0.cfg.default_export {
                Some(d) => exports.get_key_value(d.as_str())?,
                None if exports.len() == 1 => exports.iter().next()?,
                None => return None,
            }
        } else {
            exports.get_key_value(name)?
        };
        Some(info_of(name, e, self.0.cfg.block))
    }

    fn list(&self) -> Vec<ExportInfo> {
        let exports = self.0.exports.read().unwrap_or_else(|p| p.into_inner());
        exports
            .iter()
            .map(|(n, e)| info_of(n, e, self.0.cfg.block))
            .collect()
    }
}

fn info_of(name: &str, e: &Export, block: BlockSizes) -> ExportInfo {
    ExportInfo {
        name: name.to_string(),
        description: e.description.clone(),
        size: e.disk.size(),
        read_only: e.read_only,
        block,
    }
}

impl NbdServer {
    /// A server with no exports yet.
    pub fn new(cfg: NbdConfig) -> NbdServer {
        NbdServer {
            inner: Arc::new(Inner {
                exports: RwLock::new(BTreeMap::new()),
                cfg,
                counters: Counters::default(),
            }),
        }
    }

    /// Adds (or replaces) the export `name`. Names are at most 4096 bytes.
    pub fn add_export(&self, name: &str, export: Export) -> Result<(), NbdError> {
        if name.len() > proto::MAX_NAME_LEN {
            return Err(NbdError::Config(format!(
                "export name of {} bytes is longer than {}",
                name.len(),
                proto::MAX_NAME_LEN
            )));
        }
        self.inner
            .exports
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), export);
        Ok(())
    }

    /// Removes an export; open connections to it keep their disk.
    pub fn remove_export(&self, name: &str) -> Option<Export> {
        self.inner
            .exports
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name)
    }

    /// Names of the exports.
    pub fn export_names(&self) -> Vec<String> {
        self.inner
            .exports
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> NbdStats {
        let c = &self.inner.counters;
        NbdStats {
            connections: c.connections.load(Ordering::Relaxed),
            active: c.active.load(Ordering::Acquire),
            sessions: c.sessions.load(Ordering::Relaxed),
            protocol_errors: c.protocol_errors.load(Ordering::Relaxed),
            requests: c.requests.load(Ordering::Relaxed),
            request_errors: c.request_errors.load(Ordering::Relaxed),
        }
    }

    /// Binds a unix socket at `path` (an old socket file there is removed).
    pub fn bind_unix(path: impl AsRef<Path>) -> Result<UnixListener, NbdError> {
        let path = path.as_ref();
        if std::fs::symlink_metadata(path).is_ok() {
            std::fs::remove_file(path).map_err(|source| NbdError::Io {
                op: "remove old socket",
                source,
            })?;
        }
        UnixListener::bind(path).map_err(|source| NbdError::Io {
            op: "bind unix socket",
            source,
        })
    }

    /// Serves connections from a unix listener until accepting fails.
    /// (An accept error for one connection, or a lack of descriptors,
    /// does not stop it: see [`crate::net::accept`].)
    pub async fn serve_unix(&self, listener: UnixListener) -> Result<(), NbdError> {
        let mut backoff = AcceptBackoff::new();
        loop {
            let sock = match listener.accept().await {
                Ok((s, _)) => {
                    backoff.reset();
                    s
                }
                Err(source) => {
                    if backoff.handle("nbd", &source).await {
                        continue;
                    }
                    return Err(NbdError::Io {
                        op: "accept",
                        source,
                    });
                }
            };
            self.spawn_connection(sock, "unix".to_string());
        }
    }

    /// Serves connections from a TCP listener until accepting fails.
    pub async fn serve_tcp(&self, listener: TcpListener) -> Result<(), NbdError> {
        let mut backoff = AcceptBackoff::new();
        loop {
            let (sock, peer) = match listener.accept().await {
                Ok(x) => {
                    backoff.reset();
                    x
                }
                Err(source) => {
                    if backoff.handle("nbd", &source).await {
                        continue;
                    }
                    return Err(NbdError::Io {
                        op: "accept",
                        source,
                    });
                }
            };
            let _ = sock.set_nodelay(true);
            self.spawn_connection(sock, peer.to_string());
        }
    }

    fn spawn_connection<S: Stream>(&self, sock: S, peer: String) {
        let me = self.clone();
        tokio::spawn(async move {
            match me.serve_connection(sock).await {
                Ok(()) => debug!(%peer, "nbd connection closed"),
                Err(e) => warn!(%peer, error = %e, "nbd connection closed"),
            }
        });
    }

    /// Serves one connection on any byte stream, to the end.
    pub async fn serve_connection<S: Stream>(&self, sock: S) -> Result<(), NbdError> {
        let c = &self.inner.counters;
        c.connections.fetch_add(1, Ordering::Relaxed);
        c.active.fetch_add(1, Ordering::Relaxed);
        let r = self.connection(Box::pin(sock)).await;
        // The client may see the close before these run; a connection's
        // counters are final once `active` no longer counts it, so `active`
        // drops last (Release pairs with the Acquire in `stats`).
        if matches!(r, Err(NbdError::Protocol(_))) {
            c.protocol_errors.fetch_add(1, Ordering::Relaxed);
        }
        c.active.fetch_sub(1, Ordering::Release);
        r
    }

    async fn connection(&self, sock: BoxStream) -> Result<(), NbdError> {
        let timeout = self.inner.cfg.handshake_timeout;
        let (sock, session) = match tokio::time::timeout(timeout, self.handshake(sock)).await {
            Ok(r) => r?,
            Err(_) => return Err(NbdError::HandshakeTimeout(timeout)),
        };
        let Some(session) = session else {
            return Ok(()); // client aborted
        };
        let export = {
            let exports = self.inner.exports.read().unwrap_or_else(|p| p.into_inner());
            exports.get(&session.export.name).cloned()
        };
        let Some(export) = export else {
            return Err(NbdError::Config("export removed during handshake".into()));
        };
        self.inner.counters.sessions.fetch_add(1, Ordering::Relaxed);
        info!(export = %session.export.name, structured = session.structured, "nbd session");
        self.transmission(sock, session, export).await
    }

    async fn handshake(
        &self,
        mut sock: BoxStream,
    ) -> Result<(BoxStream, Option<Session>), NbdError> {
        let tls = self.inner.cfg.tls.as_ref().map_or(TlsMode::Off, |t| t.1);
        let mut neg = Negotiation::new(tls);
        let mut buf = vec![0u8; 4096];
        loop {
            let out = neg.take_output();
            if !out.is_empty() {
                sock.write_all(&out).await.map_err(io("write handshake"))?;
                sock.flush().await.map_err(io("flush handshake"))?;
            }
            match neg.phase().clone() {
                Phase::Negotiating => {}
                Phase::Transmission(s) => return Ok((sock, Some(s))),
                Phase::Closed(ProtocolError::Aborted) => return Ok((sock, None)),
                Phase::Closed(e) => return Err(NbdError::Protocol(e)),
                Phase::StartTls => {
                    let Some((acceptor, _)) = &self.inner.cfg.tls else {
                        return Err(NbdError::Config("STARTTLS without TLS".into()));
                    };
                    let tls = acceptor.accept(sock).await.map_err(io("TLS handshake"))?;
                    sock = Box::pin(tls);
                    neg.tls_established();
                    continue;
                }
            }
            // Read no more than the handshake needs: what follows belongs
            // to the transmission phase (or to TLS).
            let want = neg.wants().min(buf.len());
            let n = sock
                .read(&mut buf[..want])
                .await
                .map_err(io("read handshake"))?;
            if n == 0 {
                return Err(NbdError::Disconnected);
            }
            let used = neg.feed(&CatalogView(&self.inner), &buf[..n]);
            debug_assert_eq!(used, n);
        }
    }

    async fn transmission(
        &self,
        sock: BoxStream,
        session: Session,
        export: Export,
    ) -> Result<(), NbdError> {
        let cfg = &self.inner.cfg;
        let (rd, wr) = tokio::io::split(sock);
        let mut rd = Requests::new(rd);
        let (tx, rx) = mpsc::channel::<Reply>(cfg.max_in_flight.max(1));
        let writer = tokio::spawn(write_replies(wr, rx, session.structured));
        let slots = Arc::new(Semaphore::new(cfg.max_in_flight.max(1)));
        let budget_bytes = cfg.max_in_flight_bytes.max(cfg.block.max as usize);
        let bytes = Arc::new(Semaphore::new(budget_bytes));
        let counters = &self.inner.counters;
        let mut hdr = [0u8; REQUEST_HEADER_LEN];
        let result = loop {
            match rd.header(&mut hdr).await {
                Ok(true) => {}
                Ok(false) => break Ok(()),
                Err(e) => break Err(io("read request")(e)),
            }
            counters.requests.fetch_add(1, Ordering::Relaxed);
            let req = match proto::decode_request(&hdr, &session, export.disk.size()) {
                Ok(Decoded::Request(r)) => r,
                Ok(Decoded::Reject {
                    cookie,
                    errno,
                    skip,
                    reason,
                }) => {
                    debug!(cookie, errno, reason, "request rejected");
                    counters.request_errors.fetch_add(1, Ordering::Relaxed);
                    if skip > 0 {
                        match rd.skip(skip as usize).await {
                            Ok(true) => {}
                            Ok(false) => break Err(NbdError::Disconnected),
                            Err(e) => break Err(io("skip payload")(e)),
                        }
                    }
                    let reply = Reply::Error {
                        cookie,
                        errno,
                        msg: reason,
                    };
                    if tx.send(reply).await.is_err() {
                        break Err(NbdError::Disconnected);
                    }
                    continue;
                }
                Err(e) => break Err(NbdError::Protocol(e)),
            };
            if req.cmd == Command::Disconnect {
                debug!("client disconnect");
                break Ok(());
            }
            let Ok(slot) = slots.clone().acquire_owned().await else {
                break Err(NbdError::Disconnected);
            };
            let need = match req.cmd {
                Command::Read | Command::Write => req.len as u32,
                _ => 0,
            };
            let Ok(budget) = bytes.clone().acquire_many_owned(need).await else {
                break Err(NbdError::Disconnected);
            };
            let payload = if req.cmd == Command::Write {
                match rd.payload(req.len as usize).await {
                    Ok(Some(b)) => b,
                    Ok(None) => break Err(NbdError::Disconnected),
                    Err(e) => break Err(io("read write payload")(e)),
                }
            } else {
                Bytes::new()
            };
            let disk = export.disk.clone();
            let tx = tx.clone();
            let errors = self.inner.clone();
            tokio::spawn(async move {
                let reply = execute(&disk, req, payload).await;
                if matches!(reply, Reply::Error { .. }) {
                    errors
                        .counters
                        .request_errors
                        .fetch_add(1, Ordering::Relaxed);
                }
                let _ = tx.send(reply).await;
                drop((slot, budget));
            });
        };
        // Let every started request answer, then close.
        drop(tx);
        match writer.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if result.is_ok() => return Err(e),
            _ => {}
        }
        result
    }
}

/// Receive buffer of a connection's request stream: room for a header
/// and a 1 MiB payload, so the payload of a write that starts a read is
/// received in place and handed on as a view of the buffer (no copy out
/// of a read buffer), while many small requests still arrive with one
/// `read` call.
const RECV_CHUNK: usize = REQUEST_HEADER_LEN + (1 << 20);

/// The request stream of a connection, read through its own buffer.
struct Requests<R> {
    rb: RecvBuf<R>,
}

impl<R: AsyncRead + Unpin> Requests<R> {
    fn new(r: R) -> Requests<R> {
        Requests {
            rb: RecvBuf::new(r, RECV_CHUNK),
        }
    }

    /// Reads one request header into `out`; `false` at the end of the
    /// stream (a header cut short counts as the end).
    async fn header(&mut self, out: &mut [u8]) -> std::io::Result<bool> {
        if !self.rb.fill(out.len(), false).await? {
            return Ok(false);
        }
        out.copy_from_slice(&self.rb.split_to(out.len()));
        Ok(true)
    }

    /// The next `len` bytes (a write's payload), read once, straight into
    /// the buffer they are returned in; `None` if the stream ends first.
    async fn payload(&mut self, len: usize) -> std::io::Result<Option<Bytes>> {
        if !self.rb.fill(len, true).await? {
            return Ok(None);
        }
        Ok(Some(self.rb.split_to(len).freeze()))
    }

    /// Discards the next `len` bytes (the payload of a refused request);
    /// `false` if the stream ends first.
    async fn skip(&mut self, len: usize) -> std::io::Result<bool> {
        self.rb.skip(len).await
    }
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> NbdError {
    move |source| NbdError::Io { op, source }
}

/// A reply on its way to the writer.
#[derive(Debug)]
enum Reply {
    Ok {
        cookie: u64,
    },
    Data {
        cookie: u64,
        offset: u64,
        data: Bytes,
    },
    BlockStatus {
        cookie: u64,
        len: u32,
    },
    Error {
        cookie: u64,
        errno: u32,
        msg: &'static str,
    },
}

/// The NBD errno for a volume error.
pub fn errno_for(e: &Error, write: bool) -> u32 {
    match e {
        Error::Unaligned { .. } | Error::InvalidArgument(_) => errno::EINVAL,
        Error::OutOfRange { .. } if write => errno::ENOSPC,
        Error::OutOfRange { .. } => errno::EINVAL,
        Error::TooLarge { .. } => errno::EOVERFLOW,
        Error::Fenced { .. } => errno::EPERM,
        Error::Detached => errno::ESHUTDOWN,
        _ => errno::EIO,
    }
}

async fn execute(disk: &Disk, req: Request, payload: Bytes) -> Reply {
    let cookie = req.cookie;
    let write = matches!(
        req.cmd,
        Command::Write | Command::WriteZeroes | Command::Trim
    );
    let r = match req.cmd {
        Command::Read => match disk.read(req.offset, req.len as usize).await {
            Ok(data) => {
                return Reply::Data {
                    cookie,
                    offset: req.offset,
                    data,
                };
            }
            Err(e) => Err(e),
        },
        Command::Write => disk.write(req.offset, payload).await,
        Command::WriteZeroes => disk.write_zeroes(req.offset, req.len as u64).await,
        Command::Trim => disk.trim(req.offset, req.len as u64).await,
        Command::Flush => disk.flush().await,
        Command::Cache => Ok(()),
        Command::BlockStatus => {
            // Every block of a volume is allocated data as far as clients
            // can tell (trimmed blocks read as zeros but are not reported
            // as holes: that would need a per-block query of the engine).
            let len = (disk.size().saturating_sub(req.offset)).min(req.len as u64) as u32;
            return Reply::BlockStatus { cookie, len };
        }
        Command::Disconnect => Ok(()),
    };
    let r = match r {
        Ok(()) if write && req.fua() => disk.flush().await,
        other => other,
    };
    match r {
        Ok(()) => Reply::Ok { cookie },
        Err(e) => {
            warn!(cookie, cmd = ?req.cmd, offset = req.offset, len = req.len, error = %e, "request failed");
            Reply::Error {
                cookie,
                errno: errno_for(&e, write),
                msg: "volume error",
            }
        }
    }
}

async fn write_replies(
    wr: tokio::io::WriteHalf<BoxStream>,
    mut rx: mpsc::Receiver<Reply>,
    structured: bool,
) -> Result<(), NbdError> {
    let mut wr = BufWriter::with_capacity(256 << 10, wr);
    while let Some(reply) = rx.recv().await {
        let r = async {
            match reply {
                Reply::Ok { cookie } if structured => {
                    wr.write_all(&proto::structured_done(cookie)).await
                }
                Reply::Ok { cookie } => wr.write_all(&proto::simple_reply(cookie, 0)).await,
                Reply::Data {
                    cookie,
                    offset,
                    data,
                } => {
                    if structured {
                        let h = proto::structured_data_header(cookie, offset, data.len() as u32);
                        wr.write_all(&h).await?;
                    } else {
                        wr.write_all(&proto::simple_reply(cookie, 0)).await?;
                    }
                    wr.write_all(&data).await
                }
                Reply::BlockStatus { cookie, len } => {
                    wr.write_all(&proto::structured_block_status(cookie, len, 0))
                        .await
                }
                Reply::Error { cookie, errno, msg } if structured => {
                    wr.write_all(&proto::structured_error(cookie, errno, msg))
                        .await
                }
                Reply::Error { cookie, errno, .. } => {
                    wr.write_all(&proto::simple_reply(cookie, errno)).await
                }
            }
        }
        .await;
        r.map_err(io("write reply"))?;
        if rx.is_empty() {
            wr.flush().await.map_err(io("flush replies"))?;
        }
    }
    wr.flush().await.map_err(io("flush replies"))?;
    let _ = wr.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recvbuf::Trickle;

    #[tokio::test]
    async fn request_stream_splits_headers_payloads_and_skips() {
        let big: Vec<u8> = (0..(1usize << 20) + 4096)
            .map(|i| (i % 251) as u8)
            .collect();
        let mut stream = Vec::new();
        stream.extend_from_slice(&[1u8; REQUEST_HEADER_LEN]);
        stream.extend_from_slice(&big);
        stream.extend_from_slice(&[2u8; REQUEST_HEADER_LEN]);
        stream.extend_from_slice(&[9u8; 5000]);
        stream.extend_from_slice(&[3u8; REQUEST_HEADER_LEN]);
        stream.extend_from_slice(b"tail");
        for step in [usize::MAX, 5, 4096, 1 << 16] {
            let mut rd = Requests::new(Trickle::new(stream.clone(), step));
            let mut hdr = [0u8; REQUEST_HEADER_LEN];
            assert!(rd.header(&mut hdr).await.unwrap());
            assert_eq!(hdr, [1u8; REQUEST_HEADER_LEN]);
            assert_eq!(rd.payload(big.len()).await.unwrap().unwrap(), big);
            assert!(rd.header(&mut hdr).await.unwrap());
            assert_eq!(hdr, [2u8; REQUEST_HEADER_LEN]);
            assert!(rd.skip(5000).await.unwrap());
            assert!(rd.header(&mut hdr).await.unwrap());
            assert_eq!(hdr, [3u8; REQUEST_HEADER_LEN]);
            // The stream ends inside a payload or a header.
            assert!(rd.payload(5).await.unwrap().is_none(), "step {step}");
            assert!(!rd.header(&mut hdr).await.unwrap());
        }
    }
}
