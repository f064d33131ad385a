// SPDX-License-Identifier: Apache-2.0
//! The migration link: a pre-shared-key handshake over fresh nonces, then
//! AES-256-GCM frames, over a blocking [`TcpStream`].
//!
//! Handshake (both sides hold the 32-byte migration key `K`; the source
//! connects and is the client):
//!
//! ```text
//!  source → target   "SHEAFMG1" ‖ nonce_s (32 random bytes)
//!  target → source   nonce_t (32) ‖ HMAC(K, "target" ‖ "SHEAFMG1" ‖ nonce_s ‖ nonce_t)
//!  source → target   HMAC(K, "source" ‖ "SHEAFMG1" ‖ nonce_s ‖ nonce_t)
//! ```
//!
//! Each side proves it holds `K` over both fresh nonces (HMAC-SHA256,
//! compared in constant time), so a recorded handshake cannot be replayed,
//! and a side that fails the proof learns nothing it could use. Session
//! keys are per direction: `HMAC(K, "s2t" ‖ nonce_s ‖ nonce_t)` for frames
//! from the source, `HMAC(K, "t2s" ‖ …)` for frames from the target.
//!
//! Frames are `len: u32 BE ‖ AES-256-GCM(session key, nonce = seq, aad =
//! len, payload) ‖ tag (16)`, `seq` counting frames per direction from 0.
//! A replayed, reordered, dropped, truncated or forged frame fails the tag
//! ([`TransportError::Forged`]); a length above [`MAX_FRAME`] is refused
//! before anything is allocated ([`TransportError::FrameTooLarge`]).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

/// Handshake magic: protocol "SHEAF MiGration", version 1.
pub const MAGIC: &[u8; 8] = b"SHEAFMG1";
/// Bytes of each handshake nonce.
const NONCE: usize = 32;
/// Bytes of an AES-GCM tag.
pub const TAG: usize = 16;
/// Largest plaintext payload of one frame.
pub const MAX_PAYLOAD: usize = (1 << 20) + (64 << 10);
/// Largest frame body (payload + tag) a peer may announce.
pub const MAX_FRAME: usize = MAX_PAYLOAD + TAG;

/// Errors of the migration link.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The peer did not open with the migration magic.
    #[error("the peer is not a sheaf migration endpoint of this version (bad magic)")]
    BadMagic,
    /// The peer's handshake proof does not match: it holds another key.
    #[error("the peer does not hold the migration key (handshake MAC mismatch)")]
    Unauthenticated,
    /// A frame announced more bytes than any frame may have.
    #[error("a frame announces {len} bytes, more than the {max}-byte limit")]
    FrameTooLarge {
        /// Announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A frame is too short to hold its tag.
    #[error("a frame of {len} bytes is shorter than its {TAG}-byte tag")]
    FrameTooShort {
        /// Announced length.
        len: usize,
    },
    /// A frame failed authentication.
    #[error("frame {seq} failed authentication (forged, replayed, reordered or corrupted)")]
    Forged {
        /// The frame's expected sequence number.
        seq: u64,
    },
    /// A payload to send is larger than a frame can carry.
    #[error("a payload of {len} bytes does not fit a frame ({MAX_PAYLOAD} bytes at most)")]
    PayloadTooLarge {
        /// Payload length.
        len: usize,
    },
    /// The connection ended early.
    #[error("the connection closed {during}")]
    Closed {
        /// Where: "during the handshake", "between frames", "inside a frame".
        during: &'static str,
    },
    /// Reading, writing or configuring the socket failed.
    #[error("cannot {op} the migration connection")]
    Io {
        /// What was done.
        op: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The system random number generator failed.
    #[error("the system random number generator failed")]
    Random,
    /// 2^64 frames were sent in one direction.
    #[error("the frame counter is exhausted")]
    SeqExhausted,
}

type TResult<T> = std::result::Result<T, TransportError>;

/// Which end of the link this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that connects and sends the VM.
    Source,
    /// The side that accepts and receives the VM.
    Target,
}

/// An authenticated, encrypted, framed migration connection.
pub struct SecureStream {
    stream: TcpStream,
    send_key: LessSafeKey,
    recv_key: LessSafeKey,
    send_seq: u64,
    recv_seq: u64,
    /// Plaintext and ciphertext bytes sent (frame headers and tags included).
    sent: u64,
    out: Vec<u8>,
}

impl std::fmt::Debug for SecureStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecureStream")
            .field("peer", &self.stream.peer_addr().ok())
            .field("send_seq", &self.send_seq)
            .field("recv_seq", &self.recv_seq)
            .finish_non_exhaustive()
    }
}

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> TransportError {
    move |source| TransportError::Io { op, source }
}

/// Reads exactly `buf.len()` bytes; an early end is `Closed { during }`
/// (`partial` when some bytes of this read arrived).
fn read_exact(
    s: &mut TcpStream,
    buf: &mut [u8],
    during: &'static str,
    partial: &'static str,
) -> TResult<()> {
    let mut n = 0;
    while n < buf.len() {
        match s.read(&mut buf[n..]) {
            Ok(0) => {
                return Err(TransportError::Closed {
                    during: if n == 0 { during } else { partial },
                });
            }
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err("read from")(e)),
        }
    }
    Ok(())
}

fn mac(key: &hmac::Key, parts: &[&[u8]]) -> hmac::Tag {
    let mut ctx = hmac::Context::with_key(key);
    for p in parts {
        ctx.update(p);
    }
    ctx.sign()
}

fn verify(key: &hmac::Key, parts: &[&[u8]], tag: &[u8]) -> TResult<()> {
    let mut msg = Vec::new();
    for p in parts {
        msg.extend_from_slice(p);
    }
    hmac::verify(key, &msg, tag).map_err(|_| TransportError::Unauthenticated)
}

fn session_key(key: &hmac::Key, label: &[u8], ns: &[u8], nt: &[u8]) -> TResult<LessSafeKey> {
    let k = mac(key, &[label, ns, nt]);
    let k = UnboundKey::new(&AES_256_GCM, k.as_ref()).map_err(|_| TransportError::Random)?;
    Ok(LessSafeKey::new(k))
}

fn seq_nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

impl SecureStream {
    /// Runs the handshake as `role` over `stream` with the pre-shared `key`;
    /// `timeout` bounds every read and write from now on.
    pub fn handshake(
        mut stream: TcpStream,
        key: &[u8; 32],
        role: Role,
        timeout: Duration,
    ) -> TResult<SecureStream> {
        stream
            .set_read_timeout(Some(timeout))
            .map_err(io_err("set a read timeout on"))?;
        stream
            .set_write_timeout(Some(timeout))
            .map_err(io_err("set a write timeout on"))?;
        let _ = stream.set_nodelay(true);
        let rng = SystemRandom::new();
        let mine = {
            let mut n = [0u8; NONCE];
            rng.fill(&mut n).map_err(|_| TransportError::Random)?;
            n
        };
        let k = hmac::Key::new(hmac::HMAC_SHA256, key);
        let hs = "during the handshake";
        let (ns, nt) = match role {
            Role::Source => {
                let mut hello = MAGIC.to_vec();
                hello.extend_from_slice(&mine);
                stream
                    .write_all(&hello)
                    .map_err(io_err("write the handshake to"))?;
                let mut reply = [0u8; NONCE + 32];
                read_exact(&mut stream, &mut reply, hs, hs)?;
                let (nt, proof) = reply.split_at(NONCE);
                verify(&k, &[b"target", MAGIC, &mine, nt], proof)?;
                let mine_proof = mac(&k, &[b"source", MAGIC, &mine, nt]);
                stream
                    .write_all(mine_proof.as_ref())
                    .map_err(io_err("write the handshake to"))?;
                let mut t = [0u8; NONCE];
                t.copy_from_slice(nt);
                (mine, t)
            }
            Role::Target => {
                let mut hello = [0u8; 8 + NONCE];
                read_exact(&mut stream, &mut hello, hs, hs)?;
                if &hello[..8] != MAGIC {
                    return Err(TransportError::BadMagic);
                }
                let mut ns = [0u8; NONCE];
                ns.copy_from_slice(&hello[8..]);
                let proof = mac(&k, &[b"target", MAGIC, &ns, &mine]);
                let mut reply = mine.to_vec();
                reply.extend_from_slice(proof.as_ref());
                stream
                    .write_all(&reply)
                    .map_err(io_err("write the handshake to"))?;
                let mut theirs = [0u8; 32];
                read_exact(&mut stream, &mut theirs, hs, hs)?;
                verify(&k, &[b"source", MAGIC, &ns, &mine], &theirs)?;
                (ns, mine)
            }
        };
        let s2t = session_key(&k, b"s2t", &ns, &nt)?;
        let t2s = session_key(&k, b"t2s", &ns, &nt)?;
        let (send_key, recv_key) = match role {
            Role::Source => (s2t, t2s),
            Role::Target => (t2s, s2t),
        };
        Ok(SecureStream {
            stream,
            send_key,
            recv_key,
            send_seq: 0,
            recv_seq: 0,
            sent: 0,
            out: Vec::new(),
        })
    }

    /// Encrypts and sends one frame.
    pub fn send(&mut self, payload: &[u8]) -> TResult<()> {
        if payload.len() > MAX_PAYLOAD {
            return Err(TransportError::PayloadTooLarge { len: payload.len() });
        }
        if self.send_seq == u64::MAX {
            return Err(TransportError::SeqExhausted);
        }
        let len = (payload.len() + TAG) as u32;
        let header = len.to_be_bytes();
        self.out.clear();
        self.out.extend_from_slice(&header);
        self.out.extend_from_slice(payload);
        let tag = self
            .send_key
            .seal_in_place_separate_tag(
                seq_nonce(self.send_seq),
                Aad::from(header),
                &mut self.out[4..],
            )
            .map_err(|_| TransportError::Forged { seq: self.send_seq })?;
        self.out.extend_from_slice(tag.as_ref());
        self.send_seq += 1;
        self.stream
            .write_all(&self.out)
            .map_err(io_err("write to"))?;
        self.sent += self.out.len() as u64;
        Ok(())
    }

    /// Receives and decrypts one frame into `buf`; returns the payload.
    pub fn recv<'a>(&mut self, buf: &'a mut Vec<u8>) -> TResult<&'a [u8]> {
        let mut header = [0u8; 4];
        read_exact(
            &mut self.stream,
            &mut header,
            "between frames",
            "inside a frame header",
        )?;
        let len = u32::from_be_bytes(header) as usize;
        if len > MAX_FRAME {
            return Err(TransportError::FrameTooLarge {
                len,
                max: MAX_FRAME,
            });
        }
        if len < TAG {
            return Err(TransportError::FrameTooShort { len });
        }
        buf.resize(len, 0);
        read_exact(&mut self.stream, buf, "inside a frame", "inside a frame")?;
        let seq = self.recv_seq;
        let plain = self
            .recv_key
            .open_in_place(seq_nonce(seq), Aad::from(header), buf)
            .map_err(|_| TransportError::Forged { seq })?;
        self.recv_seq += 1;
        Ok(plain)
    }

    /// Bytes written to the socket so far (headers and tags included).
    pub fn bytes_sent(&self) -> u64 {
        self.sent
    }

    /// Closes both directions (best effort).
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::net::TcpListener;

    use super::*;

    fn pair(
        src_key: [u8; 32],
        dst_key: [u8; 32],
    ) -> (TResult<SecureStream>, TResult<SecureStream>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            SecureStream::handshake(s, &dst_key, Role::Target, Duration::from_secs(5))
        });
        let s = TcpStream::connect(addr).unwrap();
        let src = SecureStream::handshake(s, &src_key, Role::Source, Duration::from_secs(5));
        (src, t.join().unwrap())
    }

    #[test]
    fn frames_round_trip_both_ways() {
        let (s, t) = pair([7; 32], [7; 32]);
        let (mut s, mut t) = (s.unwrap(), t.unwrap());
        let mut buf = Vec::new();
        for i in 0..3u8 {
            s.send(&[i; 100]).unwrap();
            assert_eq!(t.recv(&mut buf).unwrap(), &[i; 100]);
        }
        t.send(b"back").unwrap();
        assert_eq!(s.recv(&mut buf).unwrap(), b"back");
        s.send(&vec![1u8; MAX_PAYLOAD]).unwrap();
        assert_eq!(t.recv(&mut buf).unwrap().len(), MAX_PAYLOAD);
        assert!(matches!(
            s.send(&vec![0u8; MAX_PAYLOAD + 1]),
            Err(TransportError::PayloadTooLarge { .. })
        ));
    }

    #[test]
    fn a_wrong_key_fails_the_handshake_on_both_sides() {
        let (s, t) = pair([1; 32], [2; 32]);
        assert!(matches!(s, Err(TransportError::Unauthenticated)), "{s:?}");
        // The target sees the source hang up or fail its proof.
        assert!(t.is_err());
    }

    /// A raw peer that completes the handshake as the source by hand, so
    /// the test can write arbitrary bytes afterwards.
    fn raw_source(key: [u8; 32]) -> (TcpStream, std::thread::JoinHandle<TResult<SecureStream>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            SecureStream::handshake(s, &key, Role::Target, Duration::from_secs(5))
        });
        let mut s = TcpStream::connect(addr).unwrap();
        let ns = [9u8; NONCE];
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&ns);
        s.write_all(&hello).unwrap();
        let mut reply = [0u8; NONCE + 32];
        s.read_exact(&mut reply).unwrap();
        let k = hmac::Key::new(hmac::HMAC_SHA256, &key);
        let proof = mac(&k, &[b"source", MAGIC, &ns, &reply[..NONCE]]);
        s.write_all(proof.as_ref()).unwrap();
        (s, t)
    }

    #[test]
    fn giant_short_forged_and_truncated_frames_are_refused() {
        let mut buf = Vec::new();
        let (mut raw, t) = raw_source([3; 32]);
        let mut t = t.join().unwrap().unwrap();
        raw.write_all(&u32::MAX.to_be_bytes()).unwrap();
        assert!(matches!(
            t.recv(&mut buf),
            Err(TransportError::FrameTooLarge { .. })
        ));

        let (mut raw, t) = raw_source([3; 32]);
        let mut t = t.join().unwrap().unwrap();
        raw.write_all(&3u32.to_be_bytes()).unwrap();
        assert!(matches!(
            t.recv(&mut buf),
            Err(TransportError::FrameTooShort { len: 3 })
        ));

        let (mut raw, t) = raw_source([3; 32]);
        let mut t = t.join().unwrap().unwrap();
        raw.write_all(&40u32.to_be_bytes()).unwrap();
        raw.write_all(&[0u8; 40]).unwrap();
        assert!(matches!(
            t.recv(&mut buf),
            Err(TransportError::Forged { seq: 0 })
        ));

        let (mut raw, t) = raw_source([3; 32]);
        let mut t = t.join().unwrap().unwrap();
        raw.write_all(&40u32.to_be_bytes()).unwrap();
        raw.write_all(&[0u8; 10]).unwrap();
        drop(raw);
        assert!(matches!(
            t.recv(&mut buf),
            Err(TransportError::Closed {
                during: "inside a frame"
            })
        ));
    }

    #[test]
    fn a_replayed_frame_is_refused() {
        // A proxy records the source's first frame and delivers it twice.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            SecureStream::handshake(s, &[5; 32], Role::Target, Duration::from_secs(5))
        });
        let pl = TcpListener::bind("127.0.0.1:0").unwrap();
        let paddr = pl.local_addr().unwrap();
        let proxy = std::thread::spawn(move || {
            let (mut from_src, _) = pl.accept().unwrap();
            let mut to_dst = TcpStream::connect(addr).unwrap();
            let mut hs = [0u8; 8 + NONCE];
            from_src.read_exact(&mut hs).unwrap();
            to_dst.write_all(&hs).unwrap();
            let mut reply = [0u8; NONCE + 32];
            to_dst.read_exact(&mut reply).unwrap();
            from_src.write_all(&reply).unwrap();
            let mut proof = [0u8; 32];
            from_src.read_exact(&mut proof).unwrap();
            to_dst.write_all(&proof).unwrap();
            let mut frame = [0u8; 4 + 5 + TAG];
            from_src.read_exact(&mut frame).unwrap();
            to_dst.write_all(&frame).unwrap();
            to_dst.write_all(&frame).unwrap();
            (from_src, to_dst)
        });
        let s = TcpStream::connect(paddr).unwrap();
        let mut s =
            SecureStream::handshake(s, &[5; 32], Role::Source, Duration::from_secs(5)).unwrap();
        s.send(b"hello").unwrap();
        let mut t = t.join().unwrap().unwrap();
        let _keep = proxy.join().unwrap();
        let mut buf = Vec::new();
        assert_eq!(t.recv(&mut buf).unwrap(), b"hello");
        assert!(matches!(
            t.recv(&mut buf),
            Err(TransportError::Forged { seq: 1 })
        ));
    }
}
