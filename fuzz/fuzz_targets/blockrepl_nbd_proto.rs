// SPDX-License-Identifier: Apache-2.0
//! Fuzzes the NBD server's protocol code with what a client controls: the
//! handshake state machine fed in arbitrary chunks (first byte: TLS mode
//! and chunk size), then the transmission request parser over the rest.
//!
//! Invariants: no panic; the handshake never consumes more than it is
//! given and consumes everything while negotiating; option replies are
//! well formed; every accepted data request lies inside the export and
//! within the maximum block size.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sheaf_blockrepl::frontend::nbd::proto::{
    BlockSizes, Catalog, Command, Decoded, ExportInfo, Negotiation, OPT_REPLY_MAGIC, Phase,
    REQUEST_HEADER_LEN, TlsMode, decode_request,
};

struct Cat;

fn export(name: &str, size: u64, read_only: bool) -> ExportInfo {
    ExportInfo {
        name: name.into(),
        description: "fuzz".into(),
        size,
        read_only,
        block: BlockSizes::default(),
    }
}

impl Catalog for Cat {
    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        match name {
            "" | "vol0" => Some(export("vol0", 1 << 20, false)),
            "ro" => Some(export("ro", 12345, true)),
            _ => None,
        }
    }
    fn list(&self) -> Vec<ExportInfo> {
        vec![export("vol0", 1 << 20, false), export("ro", 12345, true)]
    }
}

/// Checks that `out` is a sequence of whole option replies.
fn well_formed(mut out: &[u8]) -> bool {
    while !out.is_empty() {
        if out.len() < 20 || out[..8] != OPT_REPLY_MAGIC.to_be_bytes() {
            return false;
        }
        let len = u32::from_be_bytes([out[16], out[17], out[18], out[19]]) as usize;
        if out.len() < 20 + len {
            return false;
        }
        out = &out[20 + len..];
    }
    true
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, mut rest)) = data.split_first() else {
        return;
    };
    let mode = match ctl % 3 {
        0 => TlsMode::Off,
        1 => TlsMode::Optional,
        _ => TlsMode::Required,
    };
    let chunk = (ctl as usize >> 2) + 1;
    let mut neg = Negotiation::new(mode);
    let _greeting = neg.take_output();
    let session = loop {
        if rest.is_empty() {
            return;
        }
        let n = chunk.min(rest.len());
        let used = neg.feed(&Cat, &rest[..n]);
        assert!(used <= n);
        let out = neg.take_output();
        rest = &rest[used..];
        match neg.phase().clone() {
            Phase::Negotiating => {
                assert_eq!(used, n, "stopped consuming while negotiating");
                assert!(well_formed(&out), "malformed option reply");
            }
            Phase::StartTls => {
                assert!(well_formed(&out));
                neg.tls_established();
            }
            Phase::Transmission(s) => break s,
            Phase::Closed(_) => return,
        }
    };
    let size = session.export.size;
    let max = session.export.block.max;
    while rest.len() >= REQUEST_HEADER_LEN {
        let mut hdr = [0u8; REQUEST_HEADER_LEN];
        hdr.copy_from_slice(&rest[..REQUEST_HEADER_LEN]);
        rest = &rest[REQUEST_HEADER_LEN..];
        let skip = match decode_request(&hdr, &session, size) {
            Err(_) => return,
            Ok(Decoded::Request(r)) => {
                if matches!(
                    r.cmd,
                    Command::Read | Command::Write | Command::Trim | Command::WriteZeroes
                ) {
                    assert!(r.len > 0);
                    assert!(r.offset + r.len as u64 <= size, "accepted out of range");
                }
                if matches!(r.cmd, Command::Read | Command::Write) {
                    assert!(r.len <= max);
                }
                if session.export.read_only {
                    assert!(!matches!(
                        r.cmd,
                        Command::Write | Command::Trim | Command::WriteZeroes
                    ));
                }
                if r.cmd == Command::Write { r.len } else { 0 }
            }
            Ok(Decoded::Reject { skip, .. }) => {
                assert!(skip <= max);
                skip
            }
        };
        rest = &rest[(skip as usize).min(rest.len())..];
    }
});
