// SPDX-License-Identifier: Apache-2.0
//! virtio-blk request parsing and execution, kept apart from the queue
//! plumbing so it can be unit-tested, property-tested and fuzzed.
//!
//! A request is a descriptor chain: device-readable segments holding a
//! 16-byte header (`type`, reserved, `sector`) and, for writes, the data;
//! then device-writable segments holding read data and, as the very last
//! byte, the status. Framing is not fixed (the header may be split across
//! descriptors), so the parser works on byte streams, not on descriptor
//! positions.

use std::io;

use virtio_bindings::virtio_blk::*;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::backend::{BlockBackend, SECTOR_SIZE};
use crate::memory::GuestMemory;

/// Most descriptors accepted in one chain.
pub const MAX_SEGMENTS: usize = 1024;
/// Most discard / write-zeroes ranges per request (advertised to the guest).
pub const MAX_DISCARD_SEG: u32 = 32;
/// Size of the per-device bounce buffer; larger segments are chunked.
pub const BOUNCE_SIZE: usize = 256 * 1024;

/// One descriptor of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Guest physical address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
    /// Device-writable.
    pub writable: bool,
}

/// The request type from the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestType {
    /// Read sectors.
    In,
    /// Write sectors.
    Out,
    /// Flush the write cache.
    Flush,
    /// Read the device id.
    GetId,
    /// Discard ranges.
    Discard,
    /// Zero ranges.
    WriteZeroes,
    /// Anything else.
    Unsupported(u32),
}

impl From<u32> for RequestType {
    fn from(t: u32) -> Self {
        match t {
            VIRTIO_BLK_T_IN => RequestType::In,
            VIRTIO_BLK_T_OUT => RequestType::Out,
            VIRTIO_BLK_T_FLUSH => RequestType::Flush,
            VIRTIO_BLK_T_GET_ID => RequestType::GetId,
            VIRTIO_BLK_T_DISCARD => RequestType::Discard,
            VIRTIO_BLK_T_WRITE_ZEROES => RequestType::WriteZeroes,
            t => RequestType::Unsupported(t),
        }
    }
}

/// A chain so broken that no status can be reported: the device must be
/// reset (`DEVICE_NEEDS_RESET`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// More than [`MAX_SEGMENTS`] descriptors.
    #[error("descriptor chain longer than {MAX_SEGMENTS}")]
    TooManySegments,
    /// No writable byte at the end of the chain to hold the status.
    #[error("descriptor chain has no status byte")]
    MissingStatus,
    /// The status byte is outside guest memory.
    #[error("status byte at {0:#x} is outside guest memory")]
    BadStatusAddress(u64),
}

/// A request that can be answered with an error status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// Fewer than 16 readable bytes for the header.
    #[error("header too short")]
    HeaderTooShort,
    /// A readable descriptor follows a writable one.
    #[error("readable descriptor after a writable one")]
    ReadableAfterWritable,
    /// A segment lies (partly) outside guest memory.
    #[error("segment outside guest memory")]
    BadAddress,
    /// Data in the wrong direction for the request type.
    #[error("data buffer in the wrong direction")]
    WrongDirection,
    /// Length not a multiple of the sector size (or of 16 for discard).
    #[error("unaligned length")]
    Unaligned,
    /// The sector range is beyond the end of the disk.
    #[error("sector range beyond the end of the disk")]
    OutOfRange,
    /// Write to a read-only disk.
    #[error("write to a read-only disk")]
    ReadOnly,
    /// Request type not implemented, or not offered.
    #[error("unsupported request type")]
    Unsupported,
}

impl RequestError {
    /// The virtio-blk status this error is reported with.
    pub fn status(self) -> u8 {
        match self {
            RequestError::Unsupported => VIRTIO_BLK_S_UNSUPP as u8,
            _ => VIRTIO_BLK_S_IOERR as u8,
        }
    }
}

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Type.
    pub ty: RequestType,
    /// Start sector.
    pub sector: u64,
    /// Data segments (device-readable for Out/Discard/WriteZeroes,
    /// device-writable for In/GetId), already trimmed of header and status.
    pub data: Vec<Segment>,
    /// Total data length.
    pub data_len: u64,
}

/// A framed chain: where its status goes, and the request or why it is bad.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Framed {
    /// Guest address of the status byte.
    pub status_addr: u64,
    /// The request, or the error to report.
    pub request: Result<Request, RequestError>,
}

/// What the device negotiated and knows about the disk.
#[derive(Debug, Clone, Copy)]
pub struct DiskInfo {
    /// Capacity in sectors.
    pub sectors: u64,
    /// Read-only.
    pub read_only: bool,
    /// Discard offered.
    pub discard: bool,
    /// Write-zeroes offered.
    pub write_zeroes: bool,
}

/// Frames and validates a chain. Only the status address must be valid for
/// the request to be answerable; everything else becomes a `RequestError`.
pub fn parse(segs: &[Segment], mem: &GuestMemory, disk: &DiskInfo) -> Result<Framed, ChainError> {
    if segs.len() > MAX_SEGMENTS {
        return Err(ChainError::TooManySegments);
    }
    let last = match segs.last() {
        Some(s) if s.writable && s.len > 0 => *s,
        _ => return Err(ChainError::MissingStatus),
    };
    let status_addr = last
        .addr
        .checked_add(u64::from(last.len) - 1)
        .ok_or(ChainError::MissingStatus)?;
    if !mem.check_range(GuestAddress(status_addr), 1) {
        return Err(ChainError::BadStatusAddress(status_addr));
    }
    let mut body: Vec<Segment> = segs.to_vec();
    if let Some(l) = body.last_mut() {
        l.len -= 1;
    }
    Ok(Framed {
        status_addr,
        request: parse_body(&body, mem, disk),
    })
}

fn parse_body(
    segs: &[Segment],
    mem: &GuestMemory,
    disk: &DiskInfo,
) -> Result<Request, RequestError> {
    let split = segs.iter().position(|s| s.writable).unwrap_or(segs.len());
    if segs[split..].iter().any(|s| !s.writable) {
        return Err(RequestError::ReadableAfterWritable);
    }
    for s in segs {
        if s.len > 0 && !mem.check_range(GuestAddress(s.addr), s.len as usize) {
            return Err(RequestError::BadAddress);
        }
    }
    let (readable, writable) = segs.split_at(split);
    let mut readable: Vec<Segment> = readable.iter().copied().filter(|s| s.len > 0).collect();
    let writable: Vec<Segment> = writable.iter().copied().filter(|s| s.len > 0).collect();

    // Header: the first 16 readable bytes, possibly split across segments.
    let mut hdr = [0u8; 16];
    let mut got = 0usize;
    while got < 16 {
        let Some(s) = readable.first_mut() else {
            return Err(RequestError::HeaderTooShort);
        };
        let n = (16 - got).min(s.len as usize);
        mem.read_slice(&mut hdr[got..got + n], GuestAddress(s.addr))
            .map_err(|_| RequestError::BadAddress)?;
        got += n;
        s.addr += n as u64;
        s.len -= n as u32;
        if s.len == 0 {
            readable.remove(0);
        }
    }
    let ty = RequestType::from(u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]));
    let sector = u64::from_le_bytes([
        hdr[8], hdr[9], hdr[10], hdr[11], hdr[12], hdr[13], hdr[14], hdr[15],
    ]);
    let sum = |v: &[Segment]| v.iter().map(|s| u64::from(s.len)).sum::<u64>();
    let (data, data_len) = match ty {
        RequestType::In | RequestType::GetId => {
            if !readable.is_empty() {
                return Err(RequestError::WrongDirection);
            }
            let l = sum(&writable);
            (writable, l)
        }
        RequestType::Out | RequestType::Discard | RequestType::WriteZeroes => {
            if !writable.is_empty() {
                return Err(RequestError::WrongDirection);
            }
            let l = sum(&readable);
            (readable, l)
        }
        RequestType::Flush => (Vec::new(), 0),
        RequestType::Unsupported(_) => return Err(RequestError::Unsupported),
    };
    // Lengths are reported back in 32-bit used-ring entries.
    if data_len >= u64::from(u32::MAX) {
        return Err(RequestError::OutOfRange);
    }
    match ty {
        RequestType::In | RequestType::Out => {
            if ty == RequestType::Out && disk.read_only {
                return Err(RequestError::ReadOnly);
            }
            if data_len % SECTOR_SIZE != 0 {
                return Err(RequestError::Unaligned);
            }
            let end = sector
                .checked_add(data_len / SECTOR_SIZE)
                .ok_or(RequestError::OutOfRange)?;
            if end > disk.sectors {
                return Err(RequestError::OutOfRange);
            }
        }
        RequestType::Discard | RequestType::WriteZeroes => {
            let offered = if ty == RequestType::Discard {
                disk.discard
            } else {
                disk.write_zeroes
            };
            if !offered {
                return Err(RequestError::Unsupported);
            }
            if disk.read_only {
                return Err(RequestError::ReadOnly);
            }
            if data_len == 0 || data_len % 16 != 0 {
                return Err(RequestError::Unaligned);
            }
            if data_len / 16 > u64::from(MAX_DISCARD_SEG) {
                return Err(RequestError::OutOfRange);
            }
        }
        RequestType::GetId if data_len == 0 => return Err(RequestError::WrongDirection),
        _ => {}
    }
    Ok(Request {
        ty,
        sector,
        data,
        data_len,
    })
}

/// Executes a valid request. Returns the status and the number of bytes
/// written into guest buffers (excluding the status byte).
pub fn execute(
    req: &Request,
    mem: &GuestMemory,
    backend: &dyn BlockBackend,
    disk: &DiskInfo,
    bounce: &mut Vec<u8>,
) -> (u8, u32) {
    match run(req, mem, backend, disk, bounce) {
        Ok(written) => (VIRTIO_BLK_S_OK as u8, written),
        Err(e) => {
            tracing::debug!(error = %e, ty = ?req.ty, sector = req.sector, "block request failed");
            let status = if e.kind() == io::ErrorKind::Unsupported {
                VIRTIO_BLK_S_UNSUPP
            } else {
                VIRTIO_BLK_S_IOERR
            };
            (status as u8, 0)
        }
    }
}

fn guest_err(e: vm_memory::GuestMemoryError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, e)
}

/// One range of a discard / write-zeroes request, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    /// Start offset.
    pub offset: u64,
    /// Length.
    pub len: u64,
    /// `VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP`: the zeroes may be a hole.
    pub unmap: bool,
}

/// Reads the 16-byte range descriptors of a discard / write-zeroes request
/// from guest memory; a range past the disk or with unknown flags is an
/// `InvalidInput` error. Shared by every backend, so all of them check
/// guest ranges the same way.
pub fn read_ranges(
    req: &Request,
    mem: &GuestMemory,
    disk: &DiskInfo,
) -> io::Result<Vec<ByteRange>> {
    let mut raw = Vec::with_capacity(req.data_len as usize);
    for s in &req.data {
        let start = raw.len();
        raw.resize(start + s.len as usize, 0);
        mem.read_slice(&mut raw[start..], GuestAddress(s.addr))
            .map_err(guest_err)?;
    }
    let mut out = Vec::with_capacity(raw.len() / 16);
    for r in raw.chunks_exact(16) {
        let sector = u64::from_le_bytes(r[0..8].try_into().unwrap_or_default());
        let num = u32::from_le_bytes(r[8..12].try_into().unwrap_or_default());
        let flags = u32::from_le_bytes(r[12..16].try_into().unwrap_or_default());
        let end = sector.checked_add(u64::from(num));
        if end.is_none_or(|e| e > disk.sectors) || flags & !1 != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad range"));
        }
        out.push(ByteRange {
            offset: sector * SECTOR_SIZE,
            len: u64::from(num) * SECTOR_SIZE,
            unmap: flags & 1 != 0,
        });
    }
    Ok(out)
}

fn run(
    req: &Request,
    mem: &GuestMemory,
    backend: &dyn BlockBackend,
    disk: &DiskInfo,
    bounce: &mut Vec<u8>,
) -> io::Result<u32> {
    bounce.resize(BOUNCE_SIZE, 0);
    // Only In/Out use the sector, and parse() bounded it by the capacity;
    // other types may carry any value (found by the vmm_blk_request fuzzer).
    let mut offset = req.sector.wrapping_mul(SECTOR_SIZE);
    match req.ty {
        RequestType::In => {
            let mut written = 0u32;
            for s in &req.data {
                let mut done = 0u64;
                while done < u64::from(s.len) {
                    let n = (u64::from(s.len) - done).min(BOUNCE_SIZE as u64) as usize;
                    backend.read_at(offset, &mut bounce[..n])?;
                    mem.write_slice(&bounce[..n], GuestAddress(s.addr + done))
                        .map_err(guest_err)?;
                    done += n as u64;
                    offset += n as u64;
                    written += n as u32;
                }
            }
            Ok(written)
        }
        RequestType::Out => {
            for s in &req.data {
                let mut done = 0u64;
                while done < u64::from(s.len) {
                    let n = (u64::from(s.len) - done).min(BOUNCE_SIZE as u64) as usize;
                    mem.read_slice(&mut bounce[..n], GuestAddress(s.addr + done))
                        .map_err(guest_err)?;
                    backend.write_at(offset, &bounce[..n])?;
                    done += n as u64;
                    offset += n as u64;
                }
            }
            Ok(0)
        }
        RequestType::Flush => backend.flush().map(|_| 0),
        RequestType::GetId => {
            let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
            let s = backend.device_id();
            let n = s.len().min(id.len());
            id[..n].copy_from_slice(&s.as_bytes()[..n]);
            let mut left: &[u8] = &id;
            let mut written = 0;
            for seg in &req.data {
                let n = left.len().min(seg.len as usize);
                mem.write_slice(&left[..n], GuestAddress(seg.addr))
                    .map_err(guest_err)?;
                left = &left[n..];
                written += n as u32;
            }
            Ok(written)
        }
        RequestType::Discard | RequestType::WriteZeroes => {
            for r in read_ranges(req, mem, disk)? {
                if req.ty == RequestType::Discard {
                    backend.discard(r.offset, r.len)?;
                } else {
                    backend.write_zeroes(r.offset, r.len, r.unmap)?;
                }
            }
            Ok(0)
        }
        RequestType::Unsupported(_) => Err(io::ErrorKind::Unsupported.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::backend::MemBackend;
    use super::*;

    fn mem() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn disk() -> DiskInfo {
        DiskInfo {
            sectors: 64,
            read_only: false,
            discard: true,
            write_zeroes: true,
        }
    }

    fn hdr(m: &GuestMemory, at: u64, ty: u32, sector: u64) {
        m.write_obj(ty, GuestAddress(at)).unwrap();
        m.write_obj(0u32, GuestAddress(at + 4)).unwrap();
        m.write_obj(sector, GuestAddress(at + 8)).unwrap();
    }

    fn seg(addr: u64, len: u32, writable: bool) -> Segment {
        Segment {
            addr,
            len,
            writable,
        }
    }

    #[test]
    fn write_then_read_round_trips() {
        let m = mem();
        let b = MemBackend::new(64 * 512, "id");
        let mut bounce = Vec::new();
        hdr(&m, 0x1000, VIRTIO_BLK_T_OUT, 2);
        m.write_slice(&[0x5a; 1024], GuestAddress(0x2000)).unwrap();
        let f = parse(
            &[
                seg(0x1000, 16, false),
                seg(0x2000, 1024, false),
                seg(0x3000, 1, true),
            ],
            &m,
            &disk(),
        )
        .unwrap();
        assert_eq!(f.status_addr, 0x3000);
        let r = f.request.unwrap();
        assert_eq!(execute(&r, &m, &b, &disk(), &mut bounce), (0, 0));
        assert_eq!(&b.contents()[1024..2048], &[0x5a; 1024]);

        // Header split across two descriptors; read into two segments.
        hdr(&m, 0x1000, VIRTIO_BLK_T_IN, 2);
        let f = parse(
            &[
                seg(0x1000, 5, false),
                seg(0x1005, 11, false),
                seg(0x4000, 512, true),
                seg(0x5000, 513, true),
            ],
            &m,
            &disk(),
        )
        .unwrap();
        assert_eq!(f.status_addr, 0x5200);
        let r = f.request.unwrap();
        assert_eq!(r.data_len, 1024);
        assert_eq!(execute(&r, &m, &b, &disk(), &mut bounce), (0, 1024));
        let mut out = [0u8; 512];
        m.read_slice(&mut out, GuestAddress(0x5000)).unwrap();
        assert_eq!(out, [0x5a; 512]);
    }

    #[test]
    fn bad_requests_get_error_statuses() {
        let m = mem();
        let d = disk();
        let st = seg(0x3000, 1, true);
        let p = |segs: &[Segment]| parse(segs, &m, &d).unwrap().request;
        hdr(&m, 0x1000, VIRTIO_BLK_T_IN, 63);
        assert_eq!(
            p(&[seg(0x1000, 16, false), seg(0x2000, 1024, true), st]),
            Err(RequestError::OutOfRange)
        );
        assert_eq!(
            p(&[seg(0x1000, 16, false), seg(0x2000, 100, true), st]),
            Err(RequestError::Unaligned)
        );
        assert_eq!(
            p(&[seg(0x1000, 8, false), st]),
            Err(RequestError::HeaderTooShort)
        );
        assert_eq!(
            p(&[
                seg(0x1000, 16, false),
                seg(0x2000, 512, true),
                seg(0x1000, 4, false),
                st
            ]),
            Err(RequestError::ReadableAfterWritable)
        );
        assert_eq!(
            p(&[seg(0x1000, 16, false), seg(0xffff_f000, 512, true), st]),
            Err(RequestError::BadAddress)
        );
        hdr(&m, 0x1000, 0x77, 0);
        let e = p(&[seg(0x1000, 16, false), st]).unwrap_err();
        assert_eq!(e.status(), VIRTIO_BLK_S_UNSUPP as u8);
        hdr(&m, 0x1000, VIRTIO_BLK_T_OUT, u64::MAX);
        assert_eq!(
            p(&[seg(0x1000, 16, false), seg(0x2000, 512, false), st]),
            Err(RequestError::OutOfRange)
        );
        let ro = DiskInfo {
            read_only: true,
            ..d
        };
        hdr(&m, 0x1000, VIRTIO_BLK_T_OUT, 0);
        assert_eq!(
            parse(
                &[seg(0x1000, 16, false), seg(0x2000, 512, false), st],
                &m,
                &ro
            )
            .unwrap()
            .request,
            Err(RequestError::ReadOnly)
        );
        // Unanswerable chains.
        assert_eq!(
            parse(&[seg(0x1000, 16, false)], &m, &d),
            Err(ChainError::MissingStatus)
        );
        assert_eq!(
            parse(&[seg(0x1000, 16, false), seg(0x20_0000, 1, true)], &m, &d),
            Err(ChainError::BadStatusAddress(0x20_0000))
        );
        assert_eq!(
            parse(&vec![st; MAX_SEGMENTS + 1], &m, &d),
            Err(ChainError::TooManySegments)
        );
    }

    #[test]
    fn get_id_flush_discard_write_zeroes() {
        let m = mem();
        let b = MemBackend::from_bytes(vec![0xff; 64 * 512], "serial-123");
        let d = disk();
        let mut bounce = Vec::new();
        let st = seg(0x3000, 1, true);
        hdr(&m, 0x1000, VIRTIO_BLK_T_GET_ID, 0);
        let r = parse(&[seg(0x1000, 16, false), seg(0x2000, 20, true), st], &m, &d)
            .unwrap()
            .request
            .unwrap();
        assert_eq!(execute(&r, &m, &b, &d, &mut bounce), (0, 20));
        let mut id = [0u8; 20];
        m.read_slice(&mut id, GuestAddress(0x2000)).unwrap();
        assert_eq!(&id[..10], b"serial-123");
        assert_eq!(id[10], 0);

        hdr(&m, 0x1000, VIRTIO_BLK_T_FLUSH, 0);
        let r = parse(&[seg(0x1000, 16, false), st], &m, &d)
            .unwrap()
            .request
            .unwrap();
        assert_eq!(execute(&r, &m, &b, &d, &mut bounce), (0, 0));
        assert_eq!(b.flush_count(), 1);

        for (ty, sector) in [(VIRTIO_BLK_T_DISCARD, 1u64), (VIRTIO_BLK_T_WRITE_ZEROES, 3)] {
            hdr(&m, 0x1000, ty, 0);
            m.write_obj(sector, GuestAddress(0x2000)).unwrap();
            m.write_obj(1u32, GuestAddress(0x2008)).unwrap();
            m.write_obj(0u32, GuestAddress(0x200c)).unwrap();
            let r = parse(
                &[seg(0x1000, 16, false), seg(0x2000, 16, false), st],
                &m,
                &d,
            )
            .unwrap()
            .request
            .unwrap();
            assert_eq!(execute(&r, &m, &b, &d, &mut bounce), (0, 0));
        }
        let c = b.contents();
        assert_eq!(&c[512..1024], &[0u8; 512]);
        assert_eq!(&c[1536..2048], &[0u8; 512]);
        assert_eq!(&c[1024..1536], &[0xffu8; 512]);

        // A range past the end fails with IOERR at execution.
        hdr(&m, 0x1000, VIRTIO_BLK_T_DISCARD, 0);
        m.write_obj(63u64, GuestAddress(0x2000)).unwrap();
        m.write_obj(2u32, GuestAddress(0x2008)).unwrap();
        let r = parse(
            &[seg(0x1000, 16, false), seg(0x2000, 16, false), st],
            &m,
            &d,
        )
        .unwrap()
        .request
        .unwrap();
        assert_eq!(
            execute(&r, &m, &b, &d, &mut bounce).0,
            VIRTIO_BLK_S_IOERR as u8
        );
    }
}
