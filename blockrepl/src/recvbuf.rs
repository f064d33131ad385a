// SPDX-License-Identifier: Apache-2.0
//! A byte stream read through a buffer that its messages are split off.
//!
//! Replication frames ([`crate::net::FrameReader`]) and NBD requests
//! (`frontend::nbd::server`) are both read this way: bytes are read from
//! the socket once, straight into the [`BytesMut`] a message is then split
//! off and handed on in (as `Bytes`, no copy), while many small messages
//! that arrived together still take one `read` call.

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt};

/// A reader and the bytes received from it but not yet taken.
#[derive(Debug)]
pub(crate) struct RecvBuf<R> {
    r: R,
    buf: BytesMut,
    /// Capacity an empty-ish buffer is given before a read that is not
    /// `exact`: room for the largest message, so a large message that
    /// starts a read is received in place.
    room: usize,
}

impl<R> RecvBuf<R> {
    /// Reads `r` through a buffer of (up to) `room` bytes.
    pub(crate) fn new(r: R, room: usize) -> RecvBuf<R> {
        RecvBuf {
            r,
            buf: BytesMut::new(),
            room,
        }
    }

    /// The bytes received and not yet taken.
    pub(crate) fn buffered(&self) -> &[u8] {
        &self.buf
    }

    /// Takes the first `n` buffered bytes. Panics if fewer are buffered:
    /// call [`RecvBuf::fill`] first.
    pub(crate) fn split_to(&mut self, n: usize) -> BytesMut {
        self.buf.split_to(n)
    }
}

impl<R: AsyncRead + Unpin> RecvBuf<R> {
    /// Reads until at least `n` bytes are buffered; `false` if the stream
    /// ends first (what arrived stays buffered). With `exact`, reads no
    /// further than `n` (a payload's bytes, not the messages after it, which
    /// then start a buffer of their own); otherwise as much as has arrived.
    pub(crate) async fn fill(&mut self, n: usize, exact: bool) -> std::io::Result<bool> {
        if self.buf.len() >= n {
            return Ok(true);
        }
        if self.buf.capacity() < n {
            let room = if exact { n } else { n.max(self.room) };
            self.buf.reserve(room - self.buf.len());
        }
        while self.buf.len() < n {
            let got = if exact {
                let want = (n - self.buf.len()) as u64;
                (&mut self.r).take(want).read_buf(&mut self.buf).await?
            } else {
                self.r.read_buf(&mut self.buf).await?
            };
            if got == 0 {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Discards the next `len` bytes; `false` if the stream ends first.
    /// Reads at most `room` bytes at a time, however large `len` is.
    pub(crate) async fn skip(&mut self, mut len: usize) -> std::io::Result<bool> {
        loop {
            let n = len.min(self.buf.len());
            let _ = self.buf.split_to(n);
            len -= n;
            if len == 0 {
                return Ok(true);
            }
            if !self.fill(len.min(self.room), true).await? {
                return Ok(false);
            }
        }
    }
}

/// A reader over `data` that returns at most `step` bytes per read:
/// every split of headers and bodies across reads (tests).
#[cfg(test)]
pub(crate) struct Trickle {
    data: Vec<u8>,
    step: usize,
    at: usize,
}

#[cfg(test)]
impl Trickle {
    pub(crate) fn new(data: impl Into<Vec<u8>>, step: usize) -> Trickle {
        Trickle {
            data: data.into(),
            step,
            at: 0,
        }
    }
}

#[cfg(test)]
impl AsyncRead for Trickle {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let at = self.at;
        let n = (self.data.len() - at).min(self.step).min(buf.remaining());
        buf.put_slice(&self.data[at..at + n]);
        self.at += n;
        std::task::Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fill_exact_stops_at_n_and_skip_crosses_reads() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        for step in [usize::MAX, 1, 7, 4096] {
            let mut rb = RecvBuf::new(Trickle::new(data.clone(), step), 1024);
            assert!(rb.fill(10, true).await.unwrap());
            assert_eq!(rb.buffered(), &data[..10], "exact reads no further");
            assert_eq!(&rb.split_to(4)[..], &data[..4]);
            assert!(rb.skip(5000).await.unwrap());
            assert!(rb.fill(1, false).await.unwrap());
            assert_eq!(rb.buffered()[0], data[5004]);
            assert!(rb.fill(10_000 - 5004, true).await.unwrap());
            assert_eq!(&rb.split_to(10_000 - 5004)[..], &data[5004..]);
            // End of stream: nothing more, and a skip past it says so.
            assert!(!rb.fill(1, false).await.unwrap());
            assert!(!rb.skip(1).await.unwrap());
        }
    }
}
