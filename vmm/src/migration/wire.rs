// SPDX-License-Identifier: Apache-2.0
//! Migration messages, one per frame: a tag byte, then little-endian fields.
//!
//! ```text
//!  source → target  Hello      version u32, memory_bytes u64, vcpus u32
//!  target → source  HelloAck
//!  source → target  Pages      pass u32, count u32, count × (gpa u64 [bit 0: zero page], 4096 bytes unless zero)
//!  source → target  PassEnd    pass u32, pages u64
//!  source → target  StateChunk bytes (a piece of the VmSnapshot JSON)
//!  source → target  StateEnd   total u64
//!  target → source  Ready      (the complete state is loaded; the VM is not started)
//!  source → target  Commit     (the source never resumes from here on)
//!  target → source  Running    (the target's vCPUs run)
//!  either           Abort      reason (UTF-8)
//! ```

use super::MigrationError;

/// Protocol version in `Hello`.
pub const VERSION: u32 = 1;
/// Guest page size the protocol moves.
pub const PAGE: usize = 4096;
/// Page records per `Pages` frame at most.
pub const PAGES_PER_FRAME: usize = 256;
/// Bit 0 of a page record's address: the page is all zeros, no data follows.
const ZERO_FLAG: u64 = 1;
/// Largest state accepted (the state of a 255-vCPU VM is a few MiB).
pub const MAX_STATE: u64 = 64 << 20;

const T_HELLO: u8 = 1;
const T_HELLO_ACK: u8 = 2;
const T_PAGES: u8 = 3;
const T_PASS_END: u8 = 4;
const T_STATE_CHUNK: u8 = 5;
const T_STATE_END: u8 = 6;
const T_READY: u8 = 7;
const T_COMMIT: u8 = 8;
const T_RUNNING: u8 = 9;
const T_ABORT: u8 = 10;

/// A decoded message; page data borrows from the frame.
#[derive(Debug)]
pub enum Msg<'a> {
    /// The source's opening.
    Hello {
        /// Protocol version.
        version: u32,
        /// Guest RAM in bytes.
        memory_bytes: u64,
        /// vCPU count.
        vcpus: u32,
    },
    /// The target accepts the VM.
    HelloAck,
    /// Page records (validated lengths; addresses are checked by the user).
    Pages {
        /// Pass number.
        pass: u32,
        /// Records.
        pages: PageIter<'a>,
    },
    /// End of a pass.
    PassEnd {
        /// Pass number.
        pass: u32,
        /// Pages the pass sent.
        pages: u64,
    },
    /// A piece of the state JSON.
    StateChunk(&'a [u8]),
    /// End of the state.
    StateEnd {
        /// Total state bytes.
        total: u64,
    },
    /// The target has loaded everything.
    Ready,
    /// The source hands the guest over.
    Commit,
    /// The target runs the guest.
    Running,
    /// The peer gives up.
    Abort(String),
}

impl Msg<'_> {
    /// The message's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "Hello",
            Msg::HelloAck => "HelloAck",
            Msg::Pages { .. } => "Pages",
            Msg::PassEnd { .. } => "PassEnd",
            Msg::StateChunk(_) => "StateChunk",
            Msg::StateEnd { .. } => "StateEnd",
            Msg::Ready => "Ready",
            Msg::Commit => "Commit",
            Msg::Running => "Running",
            Msg::Abort(_) => "Abort",
        }
    }
}

/// One page record: guest physical address and data (`None`: zeros).
#[derive(Debug, Clone, Copy)]
pub struct PageRecord<'a> {
    /// Page-aligned guest physical address.
    pub gpa: u64,
    /// The page, or `None` for a zero page.
    pub data: Option<&'a [u8]>,
}

/// Iterator over the records of a `Pages` frame (validated at decode).
#[derive(Debug, Clone)]
pub struct PageIter<'a> {
    rest: &'a [u8],
    left: u32,
}

impl PageIter<'_> {
    /// Records left.
    pub fn len(&self) -> u32 {
        self.left
    }

    /// Whether no record is left.
    pub fn is_empty(&self) -> bool {
        self.left == 0
    }
}

impl<'a> Iterator for PageIter<'a> {
    type Item = PageRecord<'a>;
    fn next(&mut self) -> Option<PageRecord<'a>> {
        if self.left == 0 {
            return None;
        }
        let (word, rest) = self.rest.split_first_chunk::<8>()?;
        let word = u64::from_le_bytes(*word);
        self.left -= 1;
        if word & ZERO_FLAG != 0 {
            self.rest = rest;
            return Some(PageRecord {
                gpa: word & !ZERO_FLAG,
                data: None,
            });
        }
        let (data, rest) = rest.split_at_checked(PAGE)?;
        self.rest = rest;
        Some(PageRecord {
            gpa: word,
            data: Some(data),
        })
    }
}

fn bad(what: impl Into<String>) -> MigrationError {
    MigrationError::Protocol(what.into())
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_le_bytes)
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map(u64::from_le_bytes)
}

/// Decodes one frame's payload.
pub fn decode(p: &[u8]) -> Result<Msg<'_>, MigrationError> {
    let (&tag, body) = p.split_first().ok_or_else(|| bad("an empty message"))?;
    let exact = |n: usize, name: &str| {
        if body.len() == n {
            Ok(())
        } else {
            Err(bad(format!(
                "a {name} message of {} bytes (expected {n})",
                body.len()
            )))
        }
    };
    Ok(match tag {
        T_HELLO => {
            exact(16, "Hello")?;
            Msg::Hello {
                version: u32_at(body, 0).unwrap_or_default(),
                memory_bytes: u64_at(body, 4).unwrap_or_default(),
                vcpus: u32_at(body, 12).unwrap_or_default(),
            }
        }
        T_HELLO_ACK => {
            exact(0, "HelloAck")?;
            Msg::HelloAck
        }
        T_PAGES => {
            let (pass, count) = match (u32_at(body, 0), u32_at(body, 4)) {
                (Some(p), Some(c)) => (p, c),
                _ => return Err(bad("a Pages message shorter than its header")),
            };
            if count as usize > PAGES_PER_FRAME {
                return Err(bad(format!(
                    "a Pages message with {count} pages (at most {PAGES_PER_FRAME})"
                )));
            }
            let rest = &body[8..];
            // Validate the record lengths now, so iterating cannot fail.
            let mut off = 0usize;
            for _ in 0..count {
                let Some(word) = u64_at(rest, off) else {
                    return Err(bad("a Pages message truncated inside a record"));
                };
                off += 8;
                if word & ZERO_FLAG == 0 {
                    off += PAGE;
                }
                if off > rest.len() {
                    return Err(bad("a Pages message truncated inside a page"));
                }
            }
            if off != rest.len() {
                return Err(bad("a Pages message with trailing bytes"));
            }
            Msg::Pages {
                pass,
                pages: PageIter { rest, left: count },
            }
        }
        T_PASS_END => {
            exact(12, "PassEnd")?;
            Msg::PassEnd {
                pass: u32_at(body, 0).unwrap_or_default(),
                pages: u64_at(body, 4).unwrap_or_default(),
            }
        }
        T_STATE_CHUNK => Msg::StateChunk(body),
        T_STATE_END => {
            exact(8, "StateEnd")?;
            Msg::StateEnd {
                total: u64_at(body, 0).unwrap_or_default(),
            }
        }
        T_READY => {
            exact(0, "Ready")?;
            Msg::Ready
        }
        T_COMMIT => {
            exact(0, "Commit")?;
            Msg::Commit
        }
        T_RUNNING => {
            exact(0, "Running")?;
            Msg::Running
        }
        T_ABORT => Msg::Abort(String::from_utf8_lossy(body).into_owned()),
        t => return Err(bad(format!("an unknown message type {t}"))),
    })
}

/// Encodes a message without page records (use [`PagesBuf`] for those).
pub fn encode(m: &Msg<'_>) -> Vec<u8> {
    let mut v = Vec::new();
    match m {
        Msg::Hello {
            version,
            memory_bytes,
            vcpus,
        } => {
            v.push(T_HELLO);
            v.extend_from_slice(&version.to_le_bytes());
            v.extend_from_slice(&memory_bytes.to_le_bytes());
            v.extend_from_slice(&vcpus.to_le_bytes());
        }
        Msg::HelloAck => v.push(T_HELLO_ACK),
        Msg::Pages { pass, pages } => {
            let mut b = PagesBuf::new(*pass);
            for r in pages.clone() {
                b.push(r.gpa, r.data);
            }
            return b.take();
        }
        Msg::PassEnd { pass, pages } => {
            v.push(T_PASS_END);
            v.extend_from_slice(&pass.to_le_bytes());
            v.extend_from_slice(&pages.to_le_bytes());
        }
        Msg::StateChunk(b) => {
            v.push(T_STATE_CHUNK);
            v.extend_from_slice(b);
        }
        Msg::StateEnd { total } => {
            v.push(T_STATE_END);
            v.extend_from_slice(&total.to_le_bytes());
        }
        Msg::Ready => v.push(T_READY),
        Msg::Commit => v.push(T_COMMIT),
        Msg::Running => v.push(T_RUNNING),
        Msg::Abort(r) => {
            v.push(T_ABORT);
            v.extend_from_slice(&r.as_bytes()[..r.len().min(4096)]);
        }
    }
    v
}

/// Whether `d` is all zeros (eight bytes at a time).
pub fn is_zero(d: &[u8]) -> bool {
    let mut words = d.chunks_exact(8);
    words
        .by_ref()
        .all(|w| u64::from_ne_bytes(w.try_into().unwrap_or([1; 8])) == 0)
        && words.remainder().iter().all(|&b| b == 0)
}

/// Builds `Pages` payloads.
#[derive(Debug)]
pub struct PagesBuf {
    pass: u32,
    buf: Vec<u8>,
    count: u32,
}

impl PagesBuf {
    /// An empty message of pass `pass`.
    pub fn new(pass: u32) -> Self {
        let mut b = PagesBuf {
            pass,
            buf: Vec::with_capacity(9 + PAGES_PER_FRAME * (8 + PAGE)),
            count: 0,
        };
        b.reset();
        b
    }

    fn reset(&mut self) {
        self.buf.clear();
        self.buf.push(T_PAGES);
        self.buf.extend_from_slice(&self.pass.to_le_bytes());
        self.buf.extend_from_slice(&0u32.to_le_bytes());
        self.count = 0;
    }

    /// Adds a page (`None` or all-zero data: a zero record).
    pub fn push(&mut self, gpa: u64, data: Option<&[u8]>) {
        match data.filter(|d| !is_zero(d)) {
            Some(d) => {
                self.buf.extend_from_slice(&gpa.to_le_bytes());
                self.buf.extend_from_slice(d);
            }
            None => self.buf.extend_from_slice(&(gpa | ZERO_FLAG).to_le_bytes()),
        }
        self.count += 1;
        self.buf[5..9].copy_from_slice(&self.count.to_le_bytes());
    }

    /// Whether the message holds [`PAGES_PER_FRAME`] records.
    pub fn full(&self) -> bool {
        self.count as usize >= PAGES_PER_FRAME
    }

    /// Records held.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// The payload; the builder starts over.
    pub fn take(&mut self) -> Vec<u8> {
        let out = self.buf.clone();
        self.reset();
        out
    }

    /// The payload, borrowed; call [`PagesBuf::clear`] after sending it.
    pub fn payload(&self) -> &[u8] {
        &self.buf
    }

    /// Starts over.
    pub fn clear(&mut self) {
        self.reset();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn messages_round_trip() {
        for m in [
            Msg::Hello {
                version: 1,
                memory_bytes: 32 << 20,
                vcpus: 2,
            },
            Msg::HelloAck,
            Msg::PassEnd { pass: 3, pages: 77 },
            Msg::StateChunk(b"{}"),
            Msg::StateEnd { total: 2 },
            Msg::Ready,
            Msg::Commit,
            Msg::Running,
            Msg::Abort("no".into()),
        ] {
            let e = encode(&m);
            assert_eq!(format!("{:?}", decode(&e).unwrap()), format!("{m:?}"));
        }
        let mut b = PagesBuf::new(2);
        b.push(0x1000, Some(&[0u8; PAGE]));
        b.push(0x2000, Some(&[7u8; PAGE]));
        let e = b.take();
        assert_eq!(e.len(), 9 + 8 + 8 + PAGE);
        let Msg::Pages { pass, pages } = decode(&e).unwrap() else {
            panic!()
        };
        assert_eq!(pass, 2);
        let v: Vec<_> = pages.collect();
        assert_eq!((v[0].gpa, v[0].data.is_none()), (0x1000, true));
        assert_eq!((v[1].gpa, v[1].data.unwrap()[0]), (0x2000, 7));
    }

    #[test]
    fn malformed_messages_are_refused() {
        let mut b = PagesBuf::new(0);
        b.push(0x2000, Some(&[7u8; PAGE]));
        let e = b.take();
        for cut in [e.len() - 1, 9 + 4, 5] {
            assert!(matches!(
                decode(&e[..cut]),
                Err(MigrationError::Protocol(_))
            ));
        }
        let mut long = e.clone();
        long.push(0);
        assert!(decode(&long).is_err());
        let mut many = e.clone();
        many[5..9].copy_from_slice(&10_000u32.to_le_bytes());
        assert!(decode(&many).is_err());
        assert!(decode(&[]).is_err());
        assert!(decode(&[99]).is_err());
        assert!(decode(&[T_HELLO, 1, 2]).is_err());
    }
}
