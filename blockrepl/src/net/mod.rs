// SPDX-License-Identifier: Apache-2.0
//! Real transport: tokio TCP with length-delimited, authenticated frames.
//!
//! Handshake (both sides hold the volume's shared secret `K`):
//!
//! ```text
//!  client → server   "SHEAFRP3" ‖ nonce_c (32 random bytes)
//!  server → client   nonce_s (32) ‖ HMAC(K, "server" ‖ nonce_c ‖ nonce_s)
//!  client → server   HMAC(K, "client" ‖ nonce_c ‖ nonce_s)
//! ```
//!
//! Each side proves knowledge of `K` over both fresh nonces, so a recorded
//! handshake cannot be replayed. Session keys are derived per direction:
//! `HMAC(K, "c2s" ‖ nonce_c ‖ nonce_s)` and `HMAC(K, "s2c" ‖ …)`. Every frame
//! is `len: u32 BE ‖ AES-256-GCM(session key, nonce = seq, payload) ‖ tag`
//! (16-byte tag), with `seq` counting frames per direction from 0: a
//! replayed, reordered, dropped or forged frame fails the tag and closes the
//! connection. Each (session key, seq) nonce is used once. Payloads are thus
//! encrypted as well as authenticated: with AES-NI/VAES that runs at about
//! 10 GB/s a core, five times HMAC-SHA256 (the tag of protocol version 1,
//! which cost as much as the block checksums) and of GMAC without
//! encryption in `ring`.

pub mod server;

use std::io;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Error, Result};
use crate::proto::msg::MAX_FRAME;

type HmacSha256 = Hmac<Sha256>;

/// Protocol version 3: read leases (`Request::Lease`, `Response::Lease`,
/// `Refusal::Leased`); a peer of another version fails the handshake
/// instead of meeting an unknown message later. Version 2: AES-256-GCM
/// frames; version 1: HMAC-SHA256 tags.
const MAGIC: &[u8; 8] = b"SHEAFRP3";
const NONCE: usize = 32;
const TAG: usize = 16;
/// Read buffer of a session (many small frames per `read` syscall).
pub(crate) const READ_BUFFER: usize = 256 << 10;
/// Queued frame bytes that make [`FrameWriter::send`] write them out.
const SEND_QUEUE: usize = 1 << 20;

/// The shared secret that authenticates replication peers.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// Wraps key bytes; at least 16 bytes are required.
    pub fn new(key: impl Into<Vec<u8>>) -> Result<Secret> {
        let key = key.into();
        if key.len() < 16 {
            return Err(Error::InvalidArgument(format!(
                "replication secret must be at least 16 bytes, got {}",
                key.len()
            )));
        }
        Ok(Secret(key))
    }

    /// Reads a secret file (its bytes, trailing newline removed).
    pub fn from_file(path: &std::path::Path) -> Result<Secret> {
        let mut b = std::fs::read(path).map_err(|source| Error::Net {
            op: "read secret file",
            source,
        })?;
        while b.last().is_some_and(|c| *c == b'\n' || *c == b'\r') {
            b.pop();
        }
        Secret::new(b)
    }

    fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        mac_with(&self.0, parts)
    }
}

fn mac_with(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC accepts keys of any length.
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Fills `buf` from the kernel's random source.
pub fn random_bytes(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the pointer and length describe the writable tail of `buf`.
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

/// This process's monotonic clock in µs (read leases: engines and replicas
/// each read their own; only rates matter, never the absolute value).
pub fn mono_us() -> u64 {
    static BASE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(std::time::Instant::now);
    // Starts at 1 s so that no reading is mistaken for "never".
    1_000_000 + base.elapsed().as_micros() as u64
}

/// A random u64 (engine ids, ...).
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if random_bytes(&mut b).is_err() {
        // Fall back to time-based entropy; ids only need to be unlikely to collide.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        return t ^ (std::process::id() as u64).rotate_left(32);
    }
    u64::from_le_bytes(b)
}

fn net(op: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Net { op, source }
}

/// The frame key of one direction of a session.
struct FrameKey(ring::aead::LessSafeKey);

impl std::fmt::Debug for FrameKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrameKey(..)")
    }
}

impl FrameKey {
    fn new(key: &[u8; 32]) -> FrameKey {
        // A 32-byte key is always valid for AES-256-GCM.
        let k = ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, key)
            .unwrap_or_else(|_| unreachable!("AES-256 key length"));
        FrameKey(ring::aead::LessSafeKey::new(k))
    }

    fn nonce(seq: u64) -> ring::aead::Nonce {
        let mut nonce = [0u8; ring::aead::NONCE_LEN];
        nonce[4..].copy_from_slice(&seq.to_be_bytes());
        ring::aead::Nonce::assume_unique_for_key(nonce)
    }

    /// Encrypts `payload` in place (frame `seq`) and returns its tag.
    fn seal(&self, seq: u64, payload: &mut [u8]) -> Result<[u8; TAG]> {
        let tag = self
            .0
            .seal_in_place_separate_tag(Self::nonce(seq), ring::aead::Aad::empty(), payload)
            .map_err(|_| Error::Auth("frame encryption failed".into()))?;
        let mut out = [0u8; TAG];
        out.copy_from_slice(tag.as_ref());
        Ok(out)
    }

    /// Checks and decrypts `frame` (ciphertext ‖ tag of frame `seq`) in
    /// place; returns the payload length.
    fn open(&self, seq: u64, frame: &mut [u8]) -> Result<usize> {
        self.0
            .open_in_place(Self::nonce(seq), ring::aead::Aad::empty(), frame)
            .map(|p| p.len())
            .map_err(|_| Error::Auth(format!("bad tag on frame {seq}")))
    }
}

/// Sending half of an authenticated session.
#[derive(Debug)]
pub struct FrameWriter<W> {
    w: W,
    key: FrameKey,
    seq: u64,
    buf: Vec<u8>,
}

/// Receiving half of an authenticated session.
#[derive(Debug)]
pub struct FrameReader<R> {
    r: R,
    key: FrameKey,
    seq: u64,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// Queues one frame; it is written by [`FrameWriter::flush`] (or once
    /// enough frames are queued).
    pub async fn send(&mut self, payload: &[u8]) -> Result<()> {
        if payload.len() > MAX_FRAME {
            return Err(Error::TooLarge {
                len: payload.len() as u64,
                max: MAX_FRAME as u64,
            });
        }
        let len = (payload.len() + TAG) as u32;
        self.buf.extend_from_slice(&len.to_be_bytes());
        let at = self.buf.len();
        self.buf.extend_from_slice(payload);
        let tag = self.key.seal(self.seq, &mut self.buf[at..])?;
        self.seq += 1;
        self.buf.extend_from_slice(&tag);
        if self.buf.len() >= SEND_QUEUE {
            self.flush().await?;
        }
        Ok(())
    }

    /// Writes every queued frame.
    pub async fn flush(&mut self) -> Result<()> {
        if !self.buf.is_empty() {
            self.w
                .write_all(&self.buf)
                .await
                .map_err(net("send frame"))?;
            self.buf.clear();
        }
        self.w.flush().await.map_err(net("flush"))
    }
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Receives one frame; `Ok(None)` at a clean end of stream.
    pub async fn recv(&mut self) -> Result<Option<Vec<u8>>> {
        let mut lenb = [0u8; 4];
        match self.r.read_exact(&mut lenb).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => {
                return Err(Error::Net {
                    op: "receive frame",
                    source: e,
                });
            }
        }
        let len = u32::from_be_bytes(lenb) as usize;
        if !(TAG..=MAX_FRAME + TAG).contains(&len) {
            return Err(Error::Auth(format!("frame length {len} out of range")));
        }
        // Filled straight from the socket (no zeroing first: `read_buf`
        // only appends initialized bytes).
        let mut buf = Vec::with_capacity(len);
        while buf.len() < len {
            let want = (len - buf.len()) as u64;
            let n = (&mut self.r)
                .take(want)
                .read_buf(&mut buf)
                .await
                .map_err(net("receive frame"))?;
            if n == 0 {
                return Err(Error::Net {
                    op: "receive frame",
                    source: io::ErrorKind::UnexpectedEof.into(),
                });
            }
        }
        let n = self.key.open(self.seq, &mut buf)?;
        self.seq += 1;
        buf.truncate(n);
        Ok(Some(buf))
    }
}

impl<R: AsyncRead + Unpin> FrameReader<tokio::io::BufReader<R>> {
    /// Whether a whole frame is already buffered (so `recv` will not wait
    /// for the peer): callers flush their answers when it is not.
    pub fn frame_buffered(&self) -> bool {
        let b = self.r.buffer();
        b.len() >= 4 && {
            let len = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
            b.len() >= 4 + len
        }
    }
}

/// Client side of the handshake. Returns the session halves.
pub async fn client_handshake<R, W>(
    mut r: R,
    mut w: W,
    secret: &Secret,
) -> Result<(FrameReader<R>, FrameWriter<W>)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut nc = [0u8; NONCE];
    random_bytes(&mut nc).map_err(net("random"))?;
    let mut hello = Vec::with_capacity(8 + NONCE);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&nc);
    w.write_all(&hello).await.map_err(net("handshake"))?;
    let mut resp = [0u8; NONCE + 32];
    r.read_exact(&mut resp).await.map_err(net("handshake"))?;
    let ns: [u8; NONCE] = resp[..NONCE].try_into().unwrap_or([0; NONCE]);
    let want = secret.mac(&[b"server", &nc, &ns]);
    if !ct_eq(&want, &resp[NONCE..]) {
        return Err(Error::Auth("server did not prove the shared secret".into()));
    }
    let proof = secret.mac(&[b"client", &nc, &ns]);
    w.write_all(&proof).await.map_err(net("handshake"))?;
    let c2s = secret.mac(&[b"c2s", &nc, &ns]);
    let s2c = secret.mac(&[b"s2c", &nc, &ns]);
    Ok((
        FrameReader {
            r,
            key: FrameKey::new(&s2c),
            seq: 0,
        },
        FrameWriter {
            w,
            key: FrameKey::new(&c2s),
            seq: 0,
            buf: Vec::new(),
        },
    ))
}

/// Server side of the handshake.
pub async fn server_handshake<R, W>(
    mut r: R,
    mut w: W,
    secret: &Secret,
) -> Result<(FrameReader<R>, FrameWriter<W>)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut hello = [0u8; 8 + NONCE];
    r.read_exact(&mut hello).await.map_err(net("handshake"))?;
    if &hello[..8] != MAGIC {
        return Err(Error::Auth("not a sheaf replication client".into()));
    }
    let nc: [u8; NONCE] = hello[8..].try_into().unwrap_or([0; NONCE]);
    let mut ns = [0u8; NONCE];
    random_bytes(&mut ns).map_err(net("random"))?;
    let proof = secret.mac(&[b"server", &nc, &ns]);
    let mut resp = Vec::with_capacity(NONCE + 32);
    resp.extend_from_slice(&ns);
    resp.extend_from_slice(&proof);
    w.write_all(&resp).await.map_err(net("handshake"))?;
    let mut cp = [0u8; 32];
    r.read_exact(&mut cp).await.map_err(net("handshake"))?;
    if !ct_eq(&cp, &secret.mac(&[b"client", &nc, &ns])) {
        return Err(Error::Auth("client did not prove the shared secret".into()));
    }
    let c2s = secret.mac(&[b"c2s", &nc, &ns]);
    let s2c = secret.mac(&[b"s2c", &nc, &ns]);
    Ok((
        FrameReader {
            r,
            key: FrameKey::new(&c2s),
            seq: 0,
        },
        FrameWriter {
            w,
            key: FrameKey::new(&s2c),
            seq: 0,
            buf: Vec::new(),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn handshake_and_frames() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (ar, aw) = tokio::io::split(a);
        let (br, bw) = tokio::io::split(b);
        let s = Secret::new(*b"0123456789abcdef").unwrap();
        let s2 = s.clone();
        let srv = tokio::spawn(async move {
            let (mut r, mut w) = server_handshake(br, bw, &s2).await.unwrap();
            let f = r.recv().await.unwrap().unwrap();
            w.send(&f).await.unwrap();
            w.flush().await.unwrap();
        });
        let (mut r, mut w) = client_handshake(ar, aw, &s).await.unwrap();
        w.send(b"hello").await.unwrap();
        w.flush().await.unwrap();
        assert_eq!(r.recv().await.unwrap().unwrap(), b"hello");
        srv.await.unwrap();
    }

    #[tokio::test]
    async fn large_frames_and_buffered_batches() {
        let key = || FrameKey::new(&[3u8; 32]);
        let mut w = FrameWriter {
            w: Vec::new(),
            key: key(),
            seq: 0,
            buf: Vec::new(),
        };
        let big: Vec<u8> = (0..(1usize << 20)).map(|i| (i % 251) as u8).collect();
        w.send(b"small").await.unwrap();
        w.send(&big).await.unwrap();
        w.send(b"after").await.unwrap();
        w.flush().await.unwrap();
        let mut r = FrameReader {
            r: tokio::io::BufReader::with_capacity(64, &w.w[..]),
            key: key(),
            seq: 0,
        };
        assert!(!r.frame_buffered(), "nothing read yet");
        assert_eq!(r.recv().await.unwrap().unwrap(), b"small");
        assert_eq!(r.recv().await.unwrap().unwrap(), big);
        assert_eq!(r.recv().await.unwrap().unwrap(), b"after");
        assert!(r.recv().await.unwrap().is_none());
        // Two small frames arrive in one buffer fill: the second is buffered.
        let mut w2 = FrameWriter {
            w: Vec::new(),
            key: key(),
            seq: 0,
            buf: Vec::new(),
        };
        w2.send(b"one").await.unwrap();
        w2.send(b"two").await.unwrap();
        w2.flush().await.unwrap();
        let mut r = FrameReader {
            r: tokio::io::BufReader::with_capacity(4096, &w2.w[..]),
            key: key(),
            seq: 0,
        };
        assert_eq!(r.recv().await.unwrap().unwrap(), b"one");
        assert!(r.frame_buffered());
        assert_eq!(r.recv().await.unwrap().unwrap(), b"two");
        assert!(!r.frame_buffered());
    }

    #[tokio::test]
    async fn wrong_secret_is_refused() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (ar, aw) = tokio::io::split(a);
        let (br, bw) = tokio::io::split(b);
        let srv = tokio::spawn(async move {
            let s = Secret::new(*b"0123456789abcdef").unwrap();
            server_handshake(br, bw, &s).await.map(|_| ())
        });
        let bad = Secret::new(*b"fedcba9876543210").unwrap();
        let c = client_handshake(ar, aw, &bad).await;
        assert!(matches!(c, Err(Error::Auth(_))), "{c:?}");
        drop(c);
        let _ = srv.await.unwrap();
    }

    #[tokio::test]
    async fn replayed_or_forged_frame_is_refused() {
        let key = || FrameKey::new(&[7u8; 32]);
        let mut w = FrameWriter {
            w: Vec::new(),
            key: key(),
            seq: 0,
            buf: Vec::new(),
        };
        w.send(b"one").await.unwrap();
        w.flush().await.unwrap();
        let first = w.w.clone();
        w.send(b"two").await.unwrap();
        w.flush().await.unwrap();
        // Replay frame 0 in place of frame 1.
        let mut stream = first.clone();
        stream.extend_from_slice(&first);
        let mut r = FrameReader {
            r: &stream[..],
            key: key(),
            seq: 0,
        };
        assert_eq!(r.recv().await.unwrap().unwrap(), b"one");
        assert!(matches!(r.recv().await, Err(Error::Auth(_))));
        // Flip a payload bit.
        let mut forged = w.w.clone();
        forged[5] ^= 1;
        let mut r = FrameReader {
            r: &forged[..],
            key: key(),
            seq: 0,
        };
        assert!(matches!(r.recv().await, Err(Error::Auth(_))));
        // Absurd length.
        let mut r = FrameReader {
            r: &[0xffu8, 0xff, 0xff, 0xff][..],
            key: key(),
            seq: 0,
        };
        assert!(matches!(r.recv().await, Err(Error::Auth(_))));
    }
}
