// SPDX-License-Identifier: Apache-2.0
//! Tests of the replication link: handshake, frame protection, derived keys.

use super::*;
use crate::recvbuf::Trickle;

#[test]
fn derived_keys_depend_on_secret_and_context() {
    let a = Secret::new(*b"0123456789abcdef").unwrap();
    let b = Secret::new(*b"0123456789abcdeX").unwrap();
    assert_eq!(a.derive_key(b"mig/1"), a.clone().derive_key(b"mig/1"));
    assert_ne!(a.derive_key(b"mig/1"), a.derive_key(b"mig/2"));
    assert_ne!(a.derive_key(b"mig/1"), b.derive_key(b"mig/1"));
    assert_ne!(&a.derive_key(b"")[..16], b"0123456789abcdef");
}

/// Runs a handshake between a client and a server policy over an
/// in-memory pipe and echoes one frame; returns whether the client's
/// and the server's sessions are checksummed.
async fn handshake_with(
    client: LinkProtection,
    server: LinkProtection,
    loopback: bool,
) -> (bool, bool) {
    let (a, b) = tokio::io::duplex(1 << 16);
    let (ar, aw) = tokio::io::split(a);
    let (br, bw) = tokio::io::split(b);
    let s = Secret::new(*b"0123456789abcdef").unwrap();
    let s2 = s.clone().with_protection(server);
    let srv = tokio::spawn(async move {
        let (mut r, mut w) = server_handshake(br, bw, &s2, loopback).await.unwrap();
        let f = r.recv().await.unwrap().unwrap();
        w.send(&f).await.unwrap();
        w.flush().await.unwrap();
        r.checksummed() && w.checksummed()
    });
    let s = s.with_protection(client);
    let (mut r, mut w) = client_handshake(ar, aw, &s, loopback).await.unwrap();
    w.send(b"hello").await.unwrap();
    w.flush().await.unwrap();
    assert_eq!(r.recv().await.unwrap().unwrap(), &b"hello"[..]);
    (r.checksummed() && w.checksummed(), srv.await.unwrap())
}

#[tokio::test]
async fn handshake_and_frames_in_every_protection_mode() {
    use LinkProtection::*;
    // (client, server, loopback) → checksummed?
    let cases = [
        (Auto, Auto, true, true),
        (Auto, Auto, false, false),
        (Encrypted, Auto, true, false),
        (Auto, Encrypted, true, false),
        (Checksummed, Checksummed, false, true),
        (Checksummed, Auto, false, false),
        (Auto, Checksummed, false, false),
        (Checksummed, Encrypted, true, false),
        (Encrypted, Checksummed, true, false),
    ];
    for (c, s, lo, want) in cases {
        let (client, server) = handshake_with(c, s, lo).await;
        assert_eq!(
            (client, server),
            (want, want),
            "{c:?} / {s:?} loopback {lo}"
        );
    }
}

#[tokio::test]
async fn a_downgraded_mode_byte_fails_the_handshake() {
    // A man in the middle rewrites the server's mode byte from
    // "encrypted" to "checksummed": the client refuses.
    let (a, b) = tokio::io::duplex(1 << 16);
    let (ar, aw) = tokio::io::split(a);
    let (mut mr, mut mw) = tokio::io::split(b);
    let (c, d) = tokio::io::duplex(1 << 16);
    let (cr, cw) = tokio::io::split(c);
    let (mut dr, mut dw) = tokio::io::split(d);
    let s = Secret::new(*b"0123456789abcdef").unwrap();
    let srv = tokio::spawn({
        let s = s.clone().with_protection(LinkProtection::Encrypted);
        async move { server_handshake(cr, cw, &s, true).await.map(|_| ()) }
    });
    let mitm = tokio::spawn(async move {
        let mut hello = [0u8; 8 + NONCE + 1];
        mr.read_exact(&mut hello).await.unwrap();
        dw.write_all(&hello).await.unwrap();
        let mut resp = [0u8; NONCE + 1 + 32];
        dr.read_exact(&mut resp).await.unwrap();
        assert_eq!(resp[NONCE], 0, "the server chose encrypted");
        resp[NONCE] = 1;
        mw.write_all(&resp).await.unwrap();
    });
    let c = client_handshake(
        ar,
        aw,
        &s.with_protection(LinkProtection::Checksummed),
        true,
    )
    .await
    .map(|_| ());
    assert!(matches!(c, Err(Error::Auth(_))), "{c:?}");
    mitm.await.unwrap();
    drop(c);
    let _ = srv.await;
}

#[test]
fn protection_parses() {
    assert_eq!(
        "auto".parse::<LinkProtection>().unwrap(),
        LinkProtection::Auto
    );
    assert_eq!(
        "checksummed".parse::<LinkProtection>().unwrap(),
        LinkProtection::Checksummed
    );
    let e = "plain".parse::<LinkProtection>().unwrap_err();
    assert!(e.to_string().contains("plain"), "{e}");
}

/// A writer into memory with a fresh session key.
fn writer(key: FrameKey) -> FrameWriter<Vec<u8>> {
    FrameWriter {
        w: Vec::new(),
        key,
        seq: 0,
        buf: FrameBuf::new(),
        outside: Vec::new(),
        outside_len: 0,
    }
}

fn keys() -> [fn() -> FrameKey; 2] {
    [
        || FrameKey::new(&[3u8; 32], false),
        || FrameKey::new(&[3u8; 32], true),
    ]
}

/// A writer into memory that takes at most `step` bytes per call,
/// across the slices of a vectored write.
struct Dribble {
    out: Vec<u8>,
    step: usize,
    calls: usize,
}

impl AsyncWrite for Dribble {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        self.calls += 1;
        let mut left = self.step;
        for b in bufs {
            let n = b.len().min(left);
            self.out.extend_from_slice(&b[..n]);
            left -= n;
            if left == 0 {
                break;
            }
        }
        std::task::Poll::Ready(Ok(self.step - left))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn write_requests_sent_from_their_buffers_are_the_same_bytes() {
    use crate::proto::msg::{Op, Request};
    use crate::types::Tag;
    let write = |id: u64, blocks: usize| ReqFrame {
        id,
        req: Request::Op {
            epoch: 7,
            tag: Tag {
                epoch: 7,
                index: id,
            },
            op: Op::Write {
                lba: id * 3,
                data: (0..blocks * crate::BLOCK_SIZE)
                    .map(|i| (i as u64 * 31 + id) as u8)
                    .collect::<Vec<u8>>()
                    .into(),
            },
        },
    };
    // Small and large writes between other requests, and enough data
    // to pass the send-queue limit (a flush in the middle).
    let mut reqs = vec![ReqFrame {
        id: 1,
        req: Request::Ping { epoch: 7 },
    }];
    for (i, blocks) in [1usize, 4, 256, 2, 64, 256, 256, 256, 5].iter().enumerate() {
        reqs.push(write(10 + i as u64, *blocks));
        reqs.push(ReqFrame {
            id: 100 + i as u64,
            req: Request::Read {
                epoch: 7,
                lba: i as u64,
                blocks: 1,
            },
        });
    }
    for key in keys() {
        let mut copied = writer(key());
        for r in &reqs {
            copied
                .send_with(|b| {
                    r.encode_into(b);
                    Ok(())
                })
                .await
                .unwrap();
        }
        copied.flush().await.unwrap();
        for step in [usize::MAX / 2, 1000, 4096 + 3] {
            let mut w = FrameWriter {
                w: Dribble {
                    out: Vec::new(),
                    step,
                    calls: 0,
                },
                key: key(),
                seq: 0,
                buf: FrameBuf::new(),
                outside: Vec::new(),
                outside_len: 0,
            };
            for r in &reqs {
                w.send_req(r).await.unwrap();
            }
            w.flush().await.unwrap();
            assert!(w.outside.is_empty() && w.buf.is_empty());
            assert_eq!(w.w.out.len(), copied.w.len(), "step {step}");
            assert!(w.w.out == copied.w, "step {step}: same bytes on the wire");
            if step == usize::MAX / 2 && w.checksummed() {
                // Large writes went out from their own buffers, in
                // few vectored calls (one per queue flush).
                assert!(w.w.calls <= 5, "{} calls", w.w.calls);
            }
            let mut r = FrameReader::new(Trickle::new(w.w.out, 777), key());
            for want in &reqs {
                let f = r.recv().await.unwrap().unwrap();
                assert_eq!(&ReqFrame::decode_bytes(&f).unwrap(), want);
            }
            assert!(r.recv().await.unwrap().is_none());
        }
    }
}

#[tokio::test]
async fn large_frames_and_buffered_batches() {
    for key in keys() {
        let mut w = writer(key());
        let big: Vec<u8> = (0..(1usize << 20)).map(|i| (i % 251) as u8).collect();
        w.send(b"small").await.unwrap();
        w.send(&big).await.unwrap();
        // Built in place; a failing fill queues nothing.
        w.send_with(|b| {
            b.extend_from_slice(b"aft");
            b.extend_from_slice(b"er");
            Ok(())
        })
        .await
        .unwrap();
        let e = w
            .send_with(|b| {
                b.extend_from_slice(b"junk");
                Err(Error::InvalidArgument("no".into()))
            })
            .await;
        assert!(e.is_err());
        let e = w.send_with(|b| {
            let n = b.len() + MAX_FRAME + 1;
            b.resize(n, 0);
            Ok(())
        });
        assert!(matches!(e.await, Err(Error::TooLarge { .. })));
        w.flush().await.unwrap();
        // Whole reads, and reads of a few bytes at a time (every
        // split of headers and bodies).
        for step in [usize::MAX, 7, 1 << 16] {
            let mut r = FrameReader::new(Trickle::new(&w.w[..], step), key());
            assert!(!r.frame_buffered(), "nothing read yet");
            assert_eq!(r.recv().await.unwrap().unwrap(), &b"small"[..]);
            assert_eq!(r.recv().await.unwrap().unwrap(), big);
            assert_eq!(r.recv().await.unwrap().unwrap(), &b"after"[..]);
            assert!(r.recv().await.unwrap().is_none());
        }
        // A stream cut inside a frame is an error, not a clean end.
        for cut in [2, 9, w.w.len() - 1] {
            let mut r = FrameReader::new(Trickle::new(&w.w[..cut], 5), key());
            let mut res = r.recv().await;
            while let Ok(Some(_)) = res {
                res = r.recv().await;
            }
            assert!(matches!(res, Err(Error::Net { .. })), "cut {cut}: {res:?}");
        }
        // Two small frames arrive in one buffer fill: the second is buffered.
        let mut w2 = writer(key());
        w2.send(b"one").await.unwrap();
        w2.send(b"two").await.unwrap();
        w2.flush().await.unwrap();
        let mut r = FrameReader::new(&w2.w[..], key());
        assert_eq!(r.recv().await.unwrap().unwrap(), &b"one"[..]);
        assert!(r.frame_buffered());
        assert_eq!(r.recv().await.unwrap().unwrap(), &b"two"[..]);
        assert!(!r.frame_buffered());
    }
}

#[tokio::test]
async fn wrong_secret_is_refused() {
    for lo in [false, true] {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (ar, aw) = tokio::io::split(a);
        let (br, bw) = tokio::io::split(b);
        let srv = tokio::spawn(async move {
            let s = Secret::new(*b"0123456789abcdef").unwrap();
            server_handshake(br, bw, &s, lo).await.map(|_| ())
        });
        let bad = Secret::new(*b"fedcba9876543210").unwrap();
        let c = client_handshake(ar, aw, &bad, lo).await;
        assert!(matches!(c, Err(Error::Auth(_))), "{c:?}");
        drop(c);
        let _ = srv.await.unwrap();
    }
}

#[tokio::test]
async fn replayed_or_forged_frame_is_refused() {
    for key in keys() {
        let mut w = writer(key());
        w.send(b"one").await.unwrap();
        w.flush().await.unwrap();
        let first = w.w.clone();
        w.send(b"two").await.unwrap();
        w.flush().await.unwrap();
        // Replay frame 0 in place of frame 1.
        let mut stream = first.clone();
        stream.extend_from_slice(&first);
        let mut r = FrameReader::new(&stream[..], key());
        assert_eq!(r.recv().await.unwrap().unwrap(), &b"one"[..]);
        assert!(matches!(r.recv().await, Err(Error::Auth(_))));
        // Flip a payload bit.
        let mut forged = w.w.clone();
        forged[5] ^= 1;
        let mut r = FrameReader::new(&forged[..], key());
        assert!(matches!(r.recv().await, Err(Error::Auth(_))));
        // Absurd and too-short lengths.
        for len in [u32::MAX, 3] {
            let lb = len.to_be_bytes();
            let mut r = FrameReader::new(&lb[..], key());
            assert!(matches!(r.recv().await, Err(Error::Auth(_))));
        }
    }
}

#[tokio::test]
async fn checksummed_frames_carry_the_payload_in_the_clear() {
    let mut w = writer(FrameKey::new(&[9u8; 32], true));
    w.send(b"plain payload").await.unwrap();
    w.flush().await.unwrap();
    assert_eq!(&w.w[4..17], b"plain payload");
    assert_eq!(w.w.len(), 4 + 13 + SUM_TAG);
    let mut e = writer(FrameKey::new(&[9u8; 32], false));
    e.send(b"plain payload").await.unwrap();
    e.flush().await.unwrap();
    assert_ne!(&e.w[4..17], b"plain payload");
}
