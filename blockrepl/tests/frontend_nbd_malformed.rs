// SPDX-License-Identifier: Apache-2.0
//! Malformed NBD clients: bad option sequences, out-of-range and oversized
//! requests, garbage. Each gets an error reply or its connection closed;
//! the server keeps serving everyone else and loses no data.
#![allow(clippy::unwrap_used)]

mod frontend_common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use frontend_common::NbdFixture;
use sheaf_blockrepl::frontend::nbd::NbdConfig;
use sheaf_blockrepl::frontend::nbd::proto::{
    IHAVEOPT, OPT_REPLY_MAGIC, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC, errno, opt, rep,
};

const MIB: u64 = 1 << 20;

struct Client(UnixStream);

impl Client {
    fn connect(sock: &Path) -> Client {
        let s = UnixStream::connect(sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut c = Client(s);
        let mut greeting = [0u8; 18];
        c.0.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        c
    }

    fn flags(&mut self, f: u32) {
        self.0.write_all(&f.to_be_bytes()).unwrap();
    }

    fn option(&mut self, code: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&code.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        let _ = self.0.write_all(&b);
    }

    fn reply(&mut self) -> (u32, u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.0.read_exact(&mut h).unwrap();
        assert_eq!(
            u64::from_be_bytes(h[..8].try_into().unwrap()),
            OPT_REPLY_MAGIC
        );
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut d = vec![0u8; len];
        self.0.read_exact(&mut d).unwrap();
        (
            u32::from_be_bytes(h[8..12].try_into().unwrap()),
            u32::from_be_bytes(h[12..16].try_into().unwrap()),
            d,
        )
    }

    /// Replies until the final one; returns its type.
    fn final_reply(&mut self) -> u32 {
        loop {
            let (_, t, _) = self.reply();
            if t != rep::INFO && t != rep::SERVER && t != rep::META_CONTEXT {
                return t;
            }
        }
    }

    fn go(sock: &Path, name: &str) -> Client {
        let mut c = Client::connect(sock);
        c.flags(3);
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        c.option(opt::GO, &d);
        assert_eq!(c.final_reply(), rep::ACK);
        c
    }

    fn request(&mut self, typ: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&typ.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(payload);
        let _ = self.0.write_all(&b);
    }

    /// A simple reply: (error, cookie).
    fn simple(&mut self) -> (u32, u64) {
        let mut h = [0u8; 16];
        self.0.read_exact(&mut h).unwrap();
        assert_eq!(
            u32::from_be_bytes(h[..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        (
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        )
    }

    fn read(&mut self, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
        self.request(0, cookie, offset, len, &[]);
        assert_eq!(self.simple(), (0, cookie));
        let mut d = vec![0u8; len as usize];
        self.0.read_exact(&mut d).unwrap();
        d
    }

    /// Whether the server closed the connection (EOF or reset, no data).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        loop {
            match self.0.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue, // drain final replies
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
    }
}

fn go_data(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

#[test]
fn bad_option_sequences() {
    let f = NbdFixture::with_config(
        MIB,
        1,
        NbdConfig {
            handshake_timeout: Duration::from_millis(500),
            ..NbdConfig::default()
        },
    );
    let s = &f.sock;
    // Unknown client flags; no fixed newstyle.
    let mut c = Client::connect(s);
    c.flags(0x10);
    assert!(c.closed());
    let mut c = Client::connect(s);
    c.flags(0);
    assert!(c.closed());
    // Bad option magic.
    let mut c = Client::connect(s);
    c.flags(1);
    c.0.write_all(&[0xaa; 16]).unwrap();
    assert!(c.closed());
    // Errors that keep the connection: unknown export, malformed GO,
    // meta context without structured replies, LIST with data, unknown option.
    let mut c = Client::connect(s);
    c.flags(1);
    c.option(opt::GO, &go_data("nope"));
    assert_eq!(c.final_reply(), rep::ERR_UNKNOWN);
    c.option(opt::GO, &[0, 0, 0, 200, b'x']);
    assert_eq!(c.final_reply(), rep::ERR_INVALID);
    let mut meta = go_data("vol0");
    meta.truncate(8);
    meta.extend_from_slice(&0u32.to_be_bytes());
    c.option(opt::SET_META_CONTEXT, &meta);
    assert_eq!(c.final_reply(), rep::ERR_INVALID);
    c.option(opt::LIST, b"junk");
    assert_eq!(c.final_reply(), rep::ERR_INVALID);
    c.option(0xdead, &[1, 2, 3]);
    assert_eq!(c.final_reply(), rep::ERR_UNSUP);
    c.option(opt::STARTTLS, &[]);
    assert_eq!(c.final_reply(), rep::ERR_POLICY);
    c.option(opt::LIST, &[]);
    assert_eq!(c.final_reply(), rep::ACK);
    // ... then EXPORT_NAME of an unknown export closes it.
    c.option(opt::EXPORT_NAME, b"nope");
    assert!(c.closed());
    // Oversized option; endless options; ABORT.
    let mut c = Client::connect(s);
    c.flags(1);
    let mut h = IHAVEOPT.to_be_bytes().to_vec();
    h.extend_from_slice(&opt::GO.to_be_bytes());
    h.extend_from_slice(&(1u32 << 30).to_be_bytes());
    c.0.write_all(&h).unwrap();
    assert!(c.closed());
    let mut c = Client::connect(s);
    c.flags(1);
    for _ in 0..300 {
        c.option(opt::STRUCTURED_REPLY, b"x");
    }
    assert!(c.closed());
    let mut c = Client::connect(s);
    c.flags(1);
    c.option(opt::ABORT, &[]);
    assert_eq!(c.reply().1, rep::ACK);
    assert!(c.closed());
    // A client that stalls mid-handshake is cut off at the deadline.
    let mut c = Client::connect(s);
    c.flags(1);
    c.0.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
    assert!(c.closed());
    let st = f.stats_once_active_at_most(0);
    assert_eq!(st.connections, 8, "{st:?}");
    assert_eq!(st.protocol_errors, 6, "{st:?}"); // not ABORT, not the timeout
    assert_eq!(st.sessions, 0, "{st:?}");
    assert_eq!(st.active, 0, "{st:?}");
}

#[test]
fn bad_requests_get_errors_and_framing_errors_close() {
    let f = NbdFixture::new(MIB, 1);
    let mut c = Client::go(&f.sock, "vol0");
    c.request(1, 1, 0, 4096, &[0x42; 4096]);
    assert_eq!(c.simple(), (0, 1));
    // Out of range: errors, connection stays usable.
    c.request(0, 2, MIB, 4096, &[]);
    assert_eq!(c.simple(), (errno::EINVAL, 2));
    c.request(0, 3, u64::MAX - 10, 4096, &[]);
    assert_eq!(c.simple(), (errno::EINVAL, 3));
    c.request(1, 4, MIB - 100, 4096, &[0x99; 4096]); // payload is skipped
    assert_eq!(c.simple(), (errno::ENOSPC, 4));
    c.request(4, 5, MIB, 4096, &[]); // trim past the end
    assert_eq!(c.simple(), (errno::ENOSPC, 5));
    c.request(42, 6, 0, 1, &[]);
    assert_eq!(c.simple(), (errno::EINVAL, 6));
    c.request(0, 7, 0, 0, &[]);
    assert_eq!(c.simple(), (errno::EINVAL, 7));
    c.request(0, 8, 0, 64 << 20, &[]);
    assert_eq!(c.simple(), (errno::EOVERFLOW, 8));
    c.request(3, 9, 1, 0, &[]); // flush with an offset
    assert_eq!(c.simple(), (errno::EINVAL, 9));
    assert!(c.read(10, 0, 4096).iter().all(|&b| b == 0x42));
    // An oversized write cannot be skipped safely: closed.
    c.request(1, 11, 0, 64 << 20, &[]);
    assert!(c.closed());
    // Bad request magic: closed.
    let mut c = Client::go(&f.sock, "vol0");
    c.0.write_all(&[0x11; 28]).unwrap();
    assert!(c.closed());
    // Half a request then EOF: closed quietly.
    let mut c = Client::go(&f.sock, "vol0");
    c.0.write_all(&REQUEST_MAGIC.to_be_bytes()).unwrap();
    c.0.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(c.closed());
    // Nothing acknowledged was lost.
    assert!(f.read(0, 4096).iter().all(|&b| b == 0x42));
    assert!(f.read(MIB - 4096, 4096).iter().all(|&b| b == 0));
    let st = f.stats_once_active_at_most(0);
    assert!(st.protocol_errors >= 2, "{st:?}");
    assert!(st.request_errors >= 8, "{st:?}");
}

/// Clients sending random bytes in every phase, while a good client
/// writes and verifies: it is never disturbed, nothing is lost.
#[test]
fn garbage_clients_do_not_disturb_others() {
    let f = NbdFixture::new(4 * MIB, 1);
    let sock = f.sock.clone();
    let good = std::thread::spawn(move || {
        let mut c = Client::go(&sock, "vol0");
        for i in 0..200u64 {
            let b = (i % 250) as u8 + 1;
            let off = (i % 64) * 4096;
            c.request(1, i, off, 4096, &[b; 4096]);
            assert_eq!(c.simple(), (0, i));
            assert!(c.read(1000 + i, off, 4096).iter().all(|&x| x == b));
        }
        c.request(2, 0, 0, 0, &[]); // NBD_CMD_DISC
        assert!(c.closed());
    });
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut bad = Vec::new();
    for i in 0..24 {
        let junk: Vec<u8> = (0..(64 + next() % 4096)).map(|_| next() as u8).collect();
        let sock = f.sock.clone();
        bad.push(std::thread::spawn(move || {
            let mut c = match i % 3 {
                0 => Client::connect(&sock),
                1 => {
                    let mut c = Client::connect(&sock);
                    c.flags(3);
                    c
                }
                _ => Client::go(&sock, "vol0"),
            };
            let _ = c.0.write_all(&junk);
            let _ = c.0.shutdown(std::net::Shutdown::Write);
            assert!(c.closed(), "server did not close a garbage connection");
        }));
    }
    for b in bad {
        b.join().unwrap();
    }
    good.join().unwrap();
    // The last value written to each of the 64 blocks is there.
    let data = f.read(0, 64 * 4096);
    for blk in 0..64u64 {
        let last = (0..200u64).rev().find(|i| i % 64 == blk).unwrap();
        let b = (last % 250) as u8 + 1;
        assert!(
            data[(blk * 4096) as usize..((blk + 1) * 4096) as usize]
                .iter()
                .all(|&x| x == b)
        );
    }
    // And the server still takes new clients.
    let mut c = Client::go(&f.sock, "vol0");
    assert_eq!(c.read(1, 0, 4096).len(), 4096);
    let st = f.stats_once_active_at_most(1);
    assert!(st.protocol_errors >= 8, "{st:?}");
}
