// SPDX-License-Identifier: Apache-2.0
#![allow(clippy::unwrap_used)]

use super::*;

struct Cat(Vec<ExportInfo>);

impl Catalog for Cat {
    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        if name.is_empty() {
            return self.0.first().cloned();
        }
        self.0.iter().find(|e| e.name == name).cloned()
    }
    fn list(&self) -> Vec<ExportInfo> {
        self.0.clone()
    }
}

fn cat() -> Cat {
    Cat(vec![
        ExportInfo {
            name: "vol0".into(),
            description: "first".into(),
            size: 1 << 20,
            read_only: false,
            block: BlockSizes::default(),
        },
        ExportInfo {
            name: "ro".into(),
            description: String::new(),
            size: 8192,
            read_only: true,
            block: BlockSizes::default(),
        },
    ])
}

fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        d.extend_from_slice(&i.to_be_bytes());
    }
    d
}

/// Parses option replies: (opt, type, data).
fn replies(mut b: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
    let mut v = Vec::new();
    while b.len() >= 20 {
        assert_eq!(be_u64(&b[0..8]), OPT_REPLY_MAGIC);
        let len = be_u32(&b[16..20]) as usize;
        v.push((
            be_u32(&b[8..12]),
            be_u32(&b[12..16]),
            b[20..20 + len].to_vec(),
        ));
        b = &b[20 + len..];
    }
    assert!(b.is_empty(), "trailing bytes {b:?}");
    v
}

fn start() -> Negotiation {
    let mut n = Negotiation::new(TlsMode::Off);
    let g = n.take_output();
    assert_eq!(&g[..8], b"NBDMAGIC");
    assert_eq!(&g[8..16], b"IHAVEOPT");
    assert_eq!(be_u16(&g[16..18]), FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    assert_eq!(n.feed(&cat(), &3u32.to_be_bytes()), 4);
    n
}

#[test]
fn go_with_structured_replies_and_meta_context() {
    let mut n = start();
    let c = cat();
    let mut input = option(opt::STRUCTURED_REPLY, &[]);
    let mut meta = go_data("vol0", &[]);
    meta.truncate(4 + 4); // name only
    meta.extend_from_slice(&1u32.to_be_bytes());
    meta.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
    meta.extend_from_slice(BASE_ALLOCATION.as_bytes());
    input.extend(option(opt::SET_META_CONTEXT, &meta));
    input.extend(option(
        opt::GO,
        &go_data("vol0", &[info::BLOCK_SIZE, info::NAME]),
    ));
    input.extend_from_slice(b"trailing request bytes");
    // Feed one byte at a time: the state machine must not care.
    let mut used = 0;
    for i in 0..input.len() {
        used += n.feed(&c, &input[i..i + 1]);
    }
    assert_eq!(used, input.len() - b"trailing request bytes".len());
    let r = replies(&n.take_output());
    let types: Vec<u32> = r.iter().map(|x| x.1).collect();
    assert_eq!(
        types,
        vec![
            rep::ACK,
            rep::META_CONTEXT,
            rep::ACK,
            rep::INFO,
            rep::INFO,
            rep::INFO,
            rep::ACK
        ]
    );
    assert_eq!(&r[1].2[4..], BASE_ALLOCATION.as_bytes());
    let export = &r[3].2;
    assert_eq!(be_u16(&export[0..2]), info::EXPORT);
    assert_eq!(be_u64(&export[2..10]), 1 << 20);
    let bs = &r[4].2;
    assert_eq!(be_u16(&bs[0..2]), info::BLOCK_SIZE);
    assert_eq!(be_u32(&bs[2..6]), 1);
    assert_eq!(be_u32(&bs[6..10]), 4096);
    assert_eq!(&r[5].2[2..], b"vol0");
    match n.phase() {
        Phase::Transmission(s) => {
            assert!(s.structured && s.base_allocation);
            assert_eq!(s.export.name, "vol0");
        }
        p => panic!("{p:?}"),
    }
}

#[test]
fn list_info_unknown_and_export_name() {
    let mut n = start();
    let c = cat();
    let mut input = option(opt::LIST, &[]);
    input.extend(option(opt::LIST, b"x"));
    input.extend(option(opt::INFO, &go_data("nope", &[])));
    input.extend(option(opt::INFO, &go_data("ro", &[])));
    input.extend(option(99, &[1, 2, 3]));
    input.extend(option(opt::STARTTLS, &[]));
    input.extend(option(opt::GO, &[0, 0, 0, 9, b'a'])); // truncated
    assert_eq!(n.feed(&c, &input), input.len());
    let r = replies(&n.take_output());
    let types: Vec<u32> = r.iter().map(|x| x.1).collect();
    assert_eq!(
        types,
        vec![
            rep::SERVER,
            rep::SERVER,
            rep::ACK,
            rep::ERR_INVALID,
            rep::ERR_UNKNOWN,
            rep::INFO,
            rep::INFO,
            rep::ACK,
            rep::ERR_UNSUP,
            rep::ERR_POLICY,
            rep::ERR_INVALID
        ]
    );
    let ro_flags = be_u16(&r[5].2[10..12]);
    assert_ne!(ro_flags & tflag::READ_ONLY, 0);
    assert_eq!(ro_flags & tflag::SEND_TRIM, 0);
    assert_eq!(*n.phase(), Phase::Negotiating);
    // EXPORT_NAME with the default export ""; the client asked for no zeroes.
    let input = option(opt::EXPORT_NAME, b"");
    n.feed(&c, &input);
    let out = n.take_output();
    assert_eq!(out.len(), 8 + 2);
    assert_eq!(be_u64(&out[..8]), 1 << 20);
    assert!(matches!(n.phase(), Phase::Transmission(s) if !s.structured));
    // Without NO_ZEROES the reply carries 124 zero bytes.
    let mut n = Negotiation::new(TlsMode::Off);
    n.feed(&c, &1u32.to_be_bytes());
    n.take_output();
    n.feed(&c, &option(opt::EXPORT_NAME, b"ro"));
    assert_eq!(n.take_output().len(), 8 + 2 + 124);
}

#[test]
fn fatal_handshake_errors() {
    let c = cat();
    let mut n = Negotiation::new(TlsMode::Off);
    n.feed(&c, &0x80u32.to_be_bytes());
    assert_eq!(*n.phase(), Phase::Closed(ProtocolError::ClientFlags(0x80)));
    let mut n = Negotiation::new(TlsMode::Off);
    n.feed(&c, &0u32.to_be_bytes());
    assert_eq!(*n.phase(), Phase::Closed(ProtocolError::NotFixedNewstyle));
    let mut n = start();
    n.feed(&c, &[0u8; 16]);
    assert!(matches!(
        n.phase(),
        Phase::Closed(ProtocolError::OptionMagic(0))
    ));
    let mut n = start();
    let mut hdr = IHAVEOPT.to_be_bytes().to_vec();
    hdr.extend_from_slice(&opt::GO.to_be_bytes());
    hdr.extend_from_slice(&u32::MAX.to_be_bytes());
    n.feed(&c, &hdr);
    assert!(matches!(
        n.phase(),
        Phase::Closed(ProtocolError::OptionTooLong { .. })
    ));
    let mut n = start();
    n.feed(&c, &option(opt::EXPORT_NAME, b"missing"));
    assert!(matches!(
        n.phase(),
        Phase::Closed(ProtocolError::UnknownExport(_))
    ));
    let mut n = start();
    n.feed(&c, &option(opt::ABORT, &[]));
    assert_eq!(replies(&n.take_output())[0].1, rep::ACK);
    assert_eq!(*n.phase(), Phase::Closed(ProtocolError::Aborted));
    let mut n = start();
    let many: Vec<u8> = (0..=MAX_OPTIONS)
        .flat_map(|_| option(opt::LIST, &[]))
        .collect();
    n.feed(&c, &many);
    assert_eq!(*n.phase(), Phase::Closed(ProtocolError::TooManyOptions));
}

#[test]
fn tls_required_and_starttls() {
    let c = cat();
    let mut n = Negotiation::new(TlsMode::Required);
    n.take_output();
    n.feed(&c, &1u32.to_be_bytes());
    n.feed(&c, &option(opt::GO, &go_data("vol0", &[])));
    assert_eq!(replies(&n.take_output())[0].1, rep::ERR_TLS_REQD);
    let mut input = option(opt::STARTTLS, &[]);
    input.extend(option(opt::LIST, &[]));
    let used = n.feed(&c, &input);
    assert_eq!(used, 16, "bytes after STARTTLS belong to the TLS stream");
    assert_eq!(*n.phase(), Phase::StartTls);
    n.tls_established();
    n.take_output();
    n.feed(&c, &option(opt::GO, &go_data("vol0", &[])));
    assert!(matches!(n.phase(), Phase::Transmission(_)));
    let mut n = Negotiation::new(TlsMode::Required);
    n.feed(&c, &1u32.to_be_bytes());
    n.feed(&c, &option(opt::EXPORT_NAME, b"vol0"));
    assert_eq!(*n.phase(), Phase::Closed(ProtocolError::TlsRequired));
}

fn header(typ: u16, flags: u16, offset: u64, len: u32) -> [u8; REQUEST_HEADER_LEN] {
    let mut b = [0u8; REQUEST_HEADER_LEN];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&typ.to_be_bytes());
    b[8..16].copy_from_slice(&7u64.to_be_bytes());
    b[16..24].copy_from_slice(&offset.to_be_bytes());
    b[24..28].copy_from_slice(&len.to_be_bytes());
    b
}

#[test]
fn request_validation() {
    let export = cat().0[0].clone();
    let s = Session {
        export: export.clone(),
        structured: false,
        base_allocation: false,
    };
    let size = export.size;
    let ok = |d: Result<Decoded, ProtocolError>| matches!(d, Ok(Decoded::Request(_)));
    let errno_of = |d: Result<Decoded, ProtocolError>| match d {
        Ok(Decoded::Reject { errno, skip, .. }) => (errno, skip),
        other => panic!("{other:?}"),
    };
    assert!(ok(decode_request(&header(0, 0, 0, 4096), &s, size)));
    assert!(ok(decode_request(
        &header(1, cflag::FUA, 512, 100),
        &s,
        size
    )));
    assert!(ok(decode_request(&header(3, 0, 0, 0), &s, size)));
    // Out of range: read EINVAL, write ENOSPC with the payload to skip.
    assert_eq!(
        errno_of(decode_request(&header(0, 0, size, 1), &s, size)),
        (errno::EINVAL, 0)
    );
    assert_eq!(
        errno_of(decode_request(&header(1, 0, size - 1, 2), &s, size)),
        (errno::ENOSPC, 2)
    );
    assert_eq!(
        errno_of(decode_request(&header(0, 0, u64::MAX, 4096), &s, size)),
        (errno::EINVAL, 0)
    );
    // Unknown command and flags, zero length, read too large.
    assert_eq!(
        errno_of(decode_request(&header(42, 0, 0, 1), &s, size)).0,
        errno::EINVAL
    );
    assert_eq!(
        errno_of(decode_request(&header(0, 0x8000, 0, 1), &s, size)).0,
        errno::EINVAL
    );
    assert_eq!(
        errno_of(decode_request(&header(0, cflag::FUA, 0, 1), &s, size)).0,
        errno::EINVAL
    );
    assert_eq!(
        errno_of(decode_request(&header(0, cflag::DF, 0, 1), &s, size)).0,
        errno::EINVAL
    );
    assert_eq!(
        errno_of(decode_request(&header(0, 0, 0, 0), &s, size)).0,
        errno::EINVAL
    );
    assert_eq!(
        errno_of(decode_request(&header(7, 0, 0, 1), &s, size)).0,
        errno::EINVAL
    );
    assert_eq!(
        errno_of(decode_request(
            &header(0, 0, 0, (32 << 20) + 1),
            &s,
            u64::MAX
        ))
        .0,
        errno::EOVERFLOW
    );
    // Write payload too large to skip: fatal.
    assert!(matches!(
        decode_request(&header(1, 0, 0, (32 << 20) + 1), &s, u64::MAX),
        Err(ProtocolError::PayloadTooLarge { .. })
    ));
    let mut bad = header(0, 0, 0, 1);
    bad[0] = 0;
    assert!(matches!(
        decode_request(&bad, &s, size),
        Err(ProtocolError::RequestMagic(_))
    ));
    // Read-only export.
    let ro = Session {
        export: cat().0[1].clone(),
        structured: true,
        base_allocation: true,
    };
    assert_eq!(
        errno_of(decode_request(&header(1, 0, 0, 4), &ro, 8192)),
        (errno::EPERM, 4)
    );
    assert!(ok(decode_request(
        &header(7, cflag::REQ_ONE, 0, 8192),
        &ro,
        8192
    )));
    assert!(ok(decode_request(
        &header(0, cflag::DF, 0, 8192),
        &ro,
        8192
    )));
}

#[test]
fn reply_encodings() {
    let s = simple_reply(9, errno::EIO);
    assert_eq!(be_u32(&s[0..4]), SIMPLE_REPLY_MAGIC);
    assert_eq!(be_u32(&s[4..8]), 5);
    assert_eq!(be_u64(&s[8..16]), 9);
    let e = structured_error(3, errno::EINVAL, "bad");
    assert_eq!(be_u32(&e[16..20]), 9);
    assert_eq!(be_u16(&e[6..8]), chunk::ERROR);
    assert_eq!(&e[26..], b"bad");
    let d = structured_data_header(3, 4096, 512);
    assert_eq!(be_u32(&d[16..20]), 520);
    assert_eq!(be_u64(&d[20..28]), 4096);
    let b = structured_block_status(3, 8192, 0);
    assert_eq!(be_u32(&b[24..28]), 8192);
}
