// SPDX-License-Identifier: Apache-2.0
//! The NBD wire protocol, sans I/O: the fixed-newstyle handshake as a state
//! machine fed with bytes ([`Negotiation`]), the transmission request parser
//! ([`decode_request`]) and reply encoders.
//!
//! Nothing here touches a socket, so the fuzz target `blockrepl_nbd_proto`
//! drives exactly the code the server runs.
//!
//! ```text
//!   server                                client
//!   "NBDMAGIC" IHAVEOPT flags(u16)  ───►
//!                                    ◄───  client flags (u32)
//!                                    ◄───  IHAVEOPT opt(u32) len(u32) data
//!   REPLY_MAGIC opt type len data   ───►   (repeat; GO/EXPORT_NAME ends it)
//!   ─────────────── transmission ───────────────
//!                                    ◄───  REQUEST_MAGIC flags type cookie offset len [data]
//!   SIMPLE or STRUCTURED replies     ───►  (any order, matched by cookie)
//! ```
//!
//! Reference: the NBD protocol document (`doc/proto.md` of the NBD project).

use std::fmt;

/// `"NBDMAGIC"`: first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `"IHAVEOPT"`: newstyle magic, and the prefix of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: no 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: no zeroes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Option codes.
pub mod opt {
    /// Select an export and end negotiation (no option reply).
    pub const EXPORT_NAME: u32 = 1;
    /// Abort negotiation.
    pub const ABORT: u32 = 2;
    /// List exports.
    pub const LIST: u32 = 3;
    /// Upgrade to TLS.
    pub const STARTTLS: u32 = 5;
    /// Describe an export.
    pub const INFO: u32 = 6;
    /// Describe an export and start transmission.
    pub const GO: u32 = 7;
    /// Enable structured replies.
    pub const STRUCTURED_REPLY: u32 = 8;
    /// List metadata contexts.
    pub const LIST_META_CONTEXT: u32 = 9;
    /// Select metadata contexts.
    pub const SET_META_CONTEXT: u32 = 10;
}

/// Option reply types.
pub mod rep {
    /// Success, end of the replies to this option.
    pub const ACK: u32 = 1;
    /// An export (reply to LIST).
    pub const SERVER: u32 = 2;
    /// Export information (reply to INFO/GO).
    pub const INFO: u32 = 3;
    /// A metadata context.
    pub const META_CONTEXT: u32 = 4;
    const ERR: u32 = 1 << 31;
    /// Unknown option.
    pub const ERR_UNSUP: u32 = ERR | 1;
    /// Forbidden by policy.
    pub const ERR_POLICY: u32 = ERR | 2;
    /// Syntactically or semantically invalid.
    pub const ERR_INVALID: u32 = ERR | 3;
    /// Not supported on this platform.
    pub const ERR_PLATFORM: u32 = ERR | 4;
    /// TLS must be negotiated first.
    pub const ERR_TLS_REQD: u32 = ERR | 5;
    /// No such export.
    pub const ERR_UNKNOWN: u32 = ERR | 6;
    /// Server is shutting down.
    pub const ERR_SHUTDOWN: u32 = ERR | 7;
    /// Option data too large.
    pub const ERR_TOO_BIG: u32 = ERR | 9;
}

/// `NBD_INFO_*` codes.
pub mod info {
    /// Size and transmission flags.
    pub const EXPORT: u16 = 0;
    /// Canonical name.
    pub const NAME: u16 = 1;
    /// Human-readable description.
    pub const DESCRIPTION: u16 = 2;
    /// Block size constraints.
    pub const BLOCK_SIZE: u16 = 3;
}

/// Transmission flags.
pub mod tflag {
    /// Always set.
    pub const HAS_FLAGS: u16 = 1 << 0;
    /// Export is read-only.
    pub const READ_ONLY: u16 = 1 << 1;
    /// FLUSH supported.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// FUA supported.
    pub const SEND_FUA: u16 = 1 << 3;
    /// TRIM supported.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// WRITE_ZEROES supported.
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// DF (don't fragment) supported.
    pub const SEND_DF: u16 = 1 << 7;
    /// Several connections see one consistent export.
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    /// CACHE supported.
    pub const SEND_CACHE: u16 = 1 << 10;
    /// FAST_ZERO supported.
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Command flags.
pub mod cflag {
    /// Force unit access: durable before the reply.
    pub const FUA: u16 = 1 << 0;
    /// WRITE_ZEROES must not punch holes.
    pub const NO_HOLE: u16 = 1 << 1;
    /// READ must not be fragmented.
    pub const DF: u16 = 1 << 2;
    /// BLOCK_STATUS: one extent is enough.
    pub const REQ_ONE: u16 = 1 << 3;
    /// WRITE_ZEROES: fail fast if not faster than writing.
    pub const FAST_ZERO: u16 = 1 << 4;
    /// All command flags this server knows.
    pub const KNOWN: u16 = FUA | NO_HOLE | DF | REQ_ONE | FAST_ZERO;
}

/// Structured reply chunk types and flags.
pub mod chunk {
    /// Last chunk of a reply.
    pub const FLAG_DONE: u16 = 1;
    /// No payload.
    pub const NONE: u16 = 0;
    /// Data at an offset.
    pub const OFFSET_DATA: u16 = 1;
    /// Block status extents.
    pub const BLOCK_STATUS: u16 = 5;
    /// An error.
    pub const ERROR: u16 = (1 << 15) | 1;
}

/// Error codes of replies (Linux errno values, as the protocol fixes them).
pub mod errno {
    /// Operation not permitted (write to read-only export).
    pub const EPERM: u32 = 1;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// Out of memory.
    pub const ENOMEM: u32 = 12;
    /// Invalid argument.
    pub const EINVAL: u32 = 22;
    /// No space (write past the end).
    pub const ENOSPC: u32 = 28;
    /// Value too large (request over the maximum size).
    pub const EOVERFLOW: u32 = 75;
    /// Operation not supported.
    pub const ENOTSUP: u32 = 95;
    /// Server is shutting down.
    pub const ESHUTDOWN: u32 = 108;
}

/// The only metadata context this server offers.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Id under which [`BASE_ALLOCATION`] is reported.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Size of a request header.
pub const REQUEST_HEADER_LEN: usize = 28;
/// Largest option payload accepted; a longer one closes the connection.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;
/// Longest export name (the protocol's limit).
pub const MAX_NAME_LEN: usize = 4096;
/// Options a client may send before it must pick an export.
pub const MAX_OPTIONS: u32 = 256;

/// Block size constraints of an export (`NBD_INFO_BLOCK_SIZE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSizes {
    /// Minimum: every offset and length the server accepts is a multiple.
    pub min: u32,
    /// Preferred: requests of this alignment avoid read-modify-write.
    pub preferred: u32,
    /// Maximum payload of a READ or WRITE.
    pub max: u32,
}

impl Default for BlockSizes {
    fn default() -> Self {
        BlockSizes {
            min: 1,
            preferred: 4096,
            max: 32 << 20,
        }
    }
}

/// What the handshake needs to know about an export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportInfo {
    /// Canonical name.
    pub name: String,
    /// Description shown by `nbdinfo`.
    pub description: String,
    /// Size in bytes.
    pub size: u64,
    /// Read-only export.
    pub read_only: bool,
    /// Block size constraints.
    pub block: BlockSizes,
}

impl ExportInfo {
    /// Transmission flags for this export.
    pub fn transmission_flags(&self) -> u16 {
        let mut f = tflag::HAS_FLAGS
            | tflag::SEND_FLUSH
            | tflag::SEND_FUA
            | tflag::SEND_DF
            | tflag::CAN_MULTI_CONN
            | tflag::SEND_CACHE;
        if self.read_only {
            f |= tflag::READ_ONLY;
        } else {
            f |= tflag::SEND_TRIM | tflag::SEND_WRITE_ZEROES | tflag::SEND_FAST_ZERO;
        }
        f
    }
}

/// The exports a server offers: consulted by the handshake.
pub trait Catalog {
    /// The export called `name` (`""` is the default export).
    fn lookup(&self, name: &str) -> Option<ExportInfo>;
    /// Every export, for `NBD_OPT_LIST`.
    fn list(&self) -> Vec<ExportInfo>;
}

/// How TLS is offered during the handshake.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// `NBD_OPT_STARTTLS` is refused.
    #[default]
    Off,
    /// Clients may upgrade.
    Optional,
    /// Clients must upgrade before anything but `ABORT`.
    Required,
}

/// A fatal protocol violation: the connection is closed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The client set flag bits this server does not know.
    #[error("client sent unknown handshake flags {0:#x}")]
    ClientFlags(u32),
    /// The client did not ask for fixed newstyle.
    #[error("client does not support fixed newstyle negotiation")]
    NotFixedNewstyle,
    /// An option did not start with `IHAVEOPT`.
    #[error("option has bad magic {0:#x}")]
    OptionMagic(u64),
    /// An option announced more data than allowed.
    #[error("option {opt} carries {len} bytes, more than {MAX_OPTION_LEN}")]
    OptionTooLong {
        /// Option code.
        opt: u32,
        /// Announced length.
        len: u32,
    },
    /// Too many options without choosing an export.
    #[error("more than {MAX_OPTIONS} options during negotiation")]
    TooManyOptions,
    /// `NBD_OPT_EXPORT_NAME` for an export that does not exist.
    #[error("unknown export {0:?} requested with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    /// `NBD_OPT_EXPORT_NAME` before TLS when TLS is required.
    #[error("NBD_OPT_EXPORT_NAME before STARTTLS on a TLS-only server")]
    TlsRequired,
    /// The client aborted negotiation.
    #[error("client aborted negotiation")]
    Aborted,
    /// A request header did not start with the request magic.
    #[error("request has bad magic {0:#x}")]
    RequestMagic(u32),
    /// A WRITE announced a payload too large to skip safely.
    #[error("write of {len} bytes exceeds the maximum payload {max}")]
    PayloadTooLarge {
        /// Announced length.
        len: u32,
        /// The limit.
        max: u32,
    },
}

/// What the negotiation has reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// More input needed.
    Negotiating,
    /// The client asked for TLS and got an ACK: flush the output, then
    /// run the TLS handshake and call [`Negotiation::tls_established`].
    StartTls,
    /// Negotiation succeeded; flush the output and start transmission.
    Transmission(Session),
    /// Flush the output and close (the reason is for logs).
    Closed(ProtocolError),
}

/// What transmission needs from the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    /// The chosen export.
    pub export: ExportInfo,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// `base:allocation` was selected.
    pub base_allocation: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum NegState {
    ClientFlags,
    OptHeader,
    OptData { opt: u32, len: u32 },
    Paused,
    Done,
}

/// The server side of fixed-newstyle negotiation, fed with bytes.
///
/// Create it, send [`Negotiation::take_output`] (the greeting), then loop:
/// read bytes, [`Negotiation::feed`] them, send the output, check
/// [`Negotiation::phase`]. `feed` stops consuming at the end of the
/// handshake, so bytes after it belong to transmission.
pub struct Negotiation {
    state: NegState,
    phase: Phase,
    buf: Vec<u8>,
    out: Vec<u8>,
    no_zeroes: bool,
    structured: bool,
    base_allocation: bool,
    tls: TlsMode,
    tls_done: bool,
    options: u32,
}

impl fmt::Debug for Negotiation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Negotiation")
            .field("state", &self.state)
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}
fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

/// A bounds-checked cursor over option data.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(be_u16)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(be_u32)
    }
    fn string(&mut self, max: usize) -> Option<String> {
        let n = self.u32()? as usize;
        if n > max {
            return None;
        }
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

impl Negotiation {
    /// Starts a negotiation; the greeting is queued as output.
    pub fn new(tls: TlsMode) -> Negotiation {
        let mut out = Vec::with_capacity(18);
        out.extend_from_slice(&NBD_MAGIC.to_be_bytes());
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        Negotiation {
            state: NegState::ClientFlags,
            phase: Phase::Negotiating,
            buf: Vec::new(),
            out,
            no_zeroes: false,
            structured: false,
            base_allocation: false,
            tls,
            tls_done: false,
            options: 0,
        }
    }

    /// Bytes to send to the client (drains the buffer).
    pub fn take_output(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out)
    }

    /// The current phase.
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// How many more bytes the current step needs (a hint for readers that
    /// must not read past the handshake; 0 once it is over).
    pub fn wants(&self) -> usize {
        let need = match self.state {
            NegState::ClientFlags => 4,
            NegState::OptHeader => 16,
            NegState::OptData { len, .. } => len as usize,
            NegState::Paused | NegState::Done => return 0,
        };
        need.saturating_sub(self.buf.len()).max(1)
    }

    /// Call after the TLS handshake that followed [`Phase::StartTls`].
    pub fn tls_established(&mut self) {
        if self.phase == Phase::StartTls {
            self.tls_done = true;
            // Options negotiated before TLS are forgotten (the spec's rule).
            self.structured = false;
            self.base_allocation = false;
            self.phase = Phase::Negotiating;
            self.state = NegState::OptHeader;
        }
    }

    /// Feeds bytes from the client; returns how many were consumed (fewer
    /// than given only once negotiation stopped).
    pub fn feed(&mut self, catalog: &dyn Catalog, data: &[u8]) -> usize {
        let mut used = 0;
        while used < data.len() && self.phase == Phase::Negotiating {
            let need = match self.state {
                NegState::ClientFlags => 4,
                NegState::OptHeader => 16,
                NegState::OptData { len, .. } => len as usize,
                NegState::Paused | NegState::Done => break,
            };
            let take = (need - self.buf.len()).min(data.len() - used);
            self.buf.extend_from_slice(&data[used..used + take]);
            used += take;
            if self.buf.len() == need {
                let buf = std::mem::take(&mut self.buf);
                self.step(catalog, &buf);
            }
        }
        // A zero-length option completes without further input.
        while self.phase == Phase::Negotiating
            && matches!(self.state, NegState::OptData { len: 0, .. })
        {
            self.step(catalog, &[]);
        }
        used
    }

    fn close(&mut self, e: ProtocolError) {
        self.state = NegState::Done;
        self.phase = Phase::Closed(e);
    }

    fn step(&mut self, catalog: &dyn Catalog, buf: &[u8]) {
        match self.state {
            NegState::ClientFlags => {
                let flags = be_u32(buf);
                if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                    return self.close(ProtocolError::ClientFlags(flags));
                }
                if flags & FLAG_C_FIXED_NEWSTYLE == 0 {
                    return self.close(ProtocolError::NotFixedNewstyle);
                }
                self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                self.state = NegState::OptHeader;
            }
            NegState::OptHeader => {
                let magic = be_u64(&buf[0..8]);
                let opt = be_u32(&buf[8..12]);
                let len = be_u32(&buf[12..16]);
                if magic != IHAVEOPT {
                    return self.close(ProtocolError::OptionMagic(magic));
                }
                if len > MAX_OPTION_LEN {
                    return self.close(ProtocolError::OptionTooLong { opt, len });
                }
                self.options += 1;
                if self.options > MAX_OPTIONS {
                    return self.close(ProtocolError::TooManyOptions);
                }
                self.state = NegState::OptData { opt, len };
            }
            NegState::OptData { opt, .. } => {
                self.state = NegState::OptHeader;
                self.option(catalog, opt, buf);
            }
            NegState::Paused | NegState::Done => {}
        }
    }

    fn reply(&mut self, opt: u32, typ: u32, data: &[u8]) {
        self.out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
        self.out.extend_from_slice(&opt.to_be_bytes());
        self.out.extend_from_slice(&typ.to_be_bytes());
        self.out
            .extend_from_slice(&(data.len() as u32).to_be_bytes());
        self.out.extend_from_slice(data);
    }

    fn error(&mut self, opt: u32, typ: u32, msg: &str) {
        self.reply(opt, typ, msg.as_bytes());
    }

    fn option(&mut self, catalog: &dyn Catalog, opt: u32, data: &[u8]) {
        let tls_needed = self.tls == TlsMode::Required && !self.tls_done;
        match opt {
            opt::ABORT => {
                self.reply(opt, rep::ACK, &[]);
                self.close(ProtocolError::Aborted);
            }
            opt::EXPORT_NAME if tls_needed => self.close(ProtocolError::TlsRequired),
            opt::STARTTLS => {
                if !data.is_empty() {
                    self.error(opt, rep::ERR_INVALID, "STARTTLS takes no data");
                } else if self.tls == TlsMode::Off {
                    self.error(opt, rep::ERR_POLICY, "TLS is not configured");
                } else if self.tls_done {
                    self.error(opt, rep::ERR_INVALID, "TLS is already active");
                } else {
                    self.reply(opt, rep::ACK, &[]);
                    self.state = NegState::Paused;
                    self.phase = Phase::StartTls;
                }
            }
            _ if tls_needed => self.error(opt, rep::ERR_TLS_REQD, "TLS required"),
            opt::EXPORT_NAME => {
                let Some(export) = std::str::from_utf8(data)
                    .ok()
                    .and_then(|n| catalog.lookup(n))
                else {
                    let name = String::from_utf8_lossy(data).into_owned();
                    return self.close(ProtocolError::UnknownExport(name));
                };
                self.out.extend_from_slice(&export.size.to_be_bytes());
                self.out
                    .extend_from_slice(&export.transmission_flags().to_be_bytes());
                if !self.no_zeroes {
                    self.out.extend_from_slice(&[0u8; 124]);
                }
                self.finish(export);
            }
            opt::LIST => {
                if !data.is_empty() {
                    return self.error(opt, rep::ERR_INVALID, "LIST takes no data");
                }
                for e in catalog.list() {
                    let mut d = Vec::with_capacity(4 + e.name.len() + e.description.len());
                    d.extend_from_slice(&(e.name.len() as u32).to_be_bytes());
                    d.extend_from_slice(e.name.as_bytes());
                    d.extend_from_slice(e.description.as_bytes());
                    self.reply(opt, rep::SERVER, &d);
                }
                self.reply(opt, rep::ACK, &[]);
            }
            opt::INFO | opt::GO => self.info_or_go(catalog, opt, data),
            opt::STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.error(opt, rep::ERR_INVALID, "STRUCTURED_REPLY takes no data");
                } else if self.structured {
                    self.error(opt, rep::ERR_INVALID, "structured replies already on");
                } else {
                    self.structured = true;
                    self.reply(opt, rep::ACK, &[]);
                }
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => self.meta_context(catalog, opt, data),
            _ => self.error(opt, rep::ERR_UNSUP, "unknown option"),
        }
    }

    fn info_or_go(&mut self, catalog: &dyn Catalog, opt: u32, data: &[u8]) {
        let mut c = Cursor(data);
        let parsed = (|| {
            let name = c.string(MAX_NAME_LEN)?;
            let n = c.u16()? as usize;
            let mut reqs = Vec::with_capacity(n.min(16));
            for _ in 0..n {
                reqs.push(c.u16()?);
            }
            c.0.is_empty().then_some((name, reqs))
        })();
        let Some((name, reqs)) = parsed else {
            return self.error(opt, rep::ERR_INVALID, "malformed INFO/GO request");
        };
        let Some(export) = catalog.lookup(&name) else {
            return self.error(opt, rep::ERR_UNKNOWN, "no such export");
        };
        let mut d = Vec::with_capacity(12);
        d.extend_from_slice(&info::EXPORT.to_be_bytes());
        d.extend_from_slice(&export.size.to_be_bytes());
        d.extend_from_slice(&export.transmission_flags().to_be_bytes());
        self.reply(opt, rep::INFO, &d);
        // Block sizes are always sent: a client that did not ask gets the
        // same limits (min 1 means no alignment is required).
        let mut d = Vec::with_capacity(14);
        d.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&export.block.min.to_be_bytes());
        d.extend_from_slice(&export.block.preferred.to_be_bytes());
        d.extend_from_slice(&export.block.max.to_be_bytes());
        self.reply(opt, rep::INFO, &d);
        if reqs.contains(&info::NAME) {
            let mut d = info::NAME.to_be_bytes().to_vec();
            d.extend_from_slice(export.name.as_bytes());
            self.reply(opt, rep::INFO, &d);
        }
        if reqs.contains(&info::DESCRIPTION) && !export.description.is_empty() {
            let mut d = info::DESCRIPTION.to_be_bytes().to_vec();
            d.extend_from_slice(export.description.as_bytes());
            self.reply(opt, rep::INFO, &d);
        }
        self.reply(opt, rep::ACK, &[]);
        if opt == opt::GO {
            self.finish(export);
        }
    }

    fn meta_context(&mut self, catalog: &dyn Catalog, opt: u32, data: &[u8]) {
        let mut c = Cursor(data);
        let parsed = (|| {
            let name = c.string(MAX_NAME_LEN)?;
            let n = c.u32()? as usize;
            let mut qs = Vec::with_capacity(n.min(16));
            for _ in 0..n {
                qs.push(c.string(MAX_NAME_LEN)?);
            }
            c.0.is_empty().then_some((name, qs))
        })();
        let Some((name, queries)) = parsed else {
            return self.error(opt, rep::ERR_INVALID, "malformed meta context request");
        };
        if !self.structured {
            return self.error(opt, rep::ERR_INVALID, "structured replies not negotiated");
        }
        if catalog.lookup(&name).is_none() {
            return self.error(opt, rep::ERR_UNKNOWN, "no such export");
        }
        let wants =
            |q: &str| q == BASE_ALLOCATION || (opt == opt::LIST_META_CONTEXT && q == "base:");
        let selected = if queries.is_empty() {
            // An empty LIST means "everything"; an empty SET selects nothing.
            opt == opt::LIST_META_CONTEXT
        } else {
            queries.iter().any(|q| wants(q))
        };
        if selected {
            let mut d = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
            d.extend_from_slice(BASE_ALLOCATION.as_bytes());
            self.reply(opt, rep::META_CONTEXT, &d);
        }
        if opt == opt::SET_META_CONTEXT {
            self.base_allocation = selected;
        }
        self.reply(opt, rep::ACK, &[]);
    }

    fn finish(&mut self, export: ExportInfo) {
        self.state = NegState::Done;
        self.phase = Phase::Transmission(Session {
            export,
            structured: self.structured,
            base_allocation: self.base_allocation && self.structured,
        });
    }
}

/// A transmission command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// `NBD_CMD_READ`.
    Read,
    /// `NBD_CMD_WRITE` (a payload of `len` bytes follows the header).
    Write,
    /// `NBD_CMD_DISC`.
    Disconnect,
    /// `NBD_CMD_FLUSH`.
    Flush,
    /// `NBD_CMD_TRIM`.
    Trim,
    /// `NBD_CMD_CACHE` (a hint; answered at once).
    Cache,
    /// `NBD_CMD_WRITE_ZEROES`.
    WriteZeroes,
    /// `NBD_CMD_BLOCK_STATUS`.
    BlockStatus,
}

impl Command {
    fn from_u16(t: u16) -> Option<Command> {
        Some(match t {
            0 => Command::Read,
            1 => Command::Write,
            2 => Command::Disconnect,
            3 => Command::Flush,
            4 => Command::Trim,
            5 => Command::Cache,
            6 => Command::WriteZeroes,
            7 => Command::BlockStatus,
            _ => return None,
        })
    }
}

/// A raw request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub typ: u16,
    /// Opaque handle echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length (payload length for WRITE).
    pub len: u32,
}

/// A validated request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// The command.
    pub cmd: Command,
    /// Echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length.
    pub len: u32,
    /// Command flags (see [`cflag`]).
    pub flags: u16,
}

impl Request {
    /// Whether `FUA` is set.
    pub fn fua(&self) -> bool {
        self.flags & cflag::FUA != 0
    }
}

/// The outcome of validating a request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded {
    /// Execute it (for WRITE, read `len` payload bytes first).
    Request(Request),
    /// Answer `errno` without executing; for a WRITE, `skip` payload bytes
    /// must be read and dropped first.
    Reject {
        /// Echoed in the reply.
        cookie: u64,
        /// Error to report.
        errno: u32,
        /// Payload bytes to discard.
        skip: u32,
        /// Why (for logs).
        reason: &'static str,
    },
}

/// Parses a request header; only a bad magic is an error.
pub fn parse_request_header(b: &[u8; REQUEST_HEADER_LEN]) -> Result<RequestHeader, ProtocolError> {
    let magic = be_u32(&b[0..4]);
    if magic != REQUEST_MAGIC {
        return Err(ProtocolError::RequestMagic(magic));
    }
    Ok(RequestHeader {
        flags: be_u16(&b[4..6]),
        typ: be_u16(&b[6..8]),
        cookie: be_u64(&b[8..16]),
        offset: be_u64(&b[16..24]),
        len: be_u32(&b[24..28]),
    })
}

/// Validates a request header against the session.
///
/// Returns an error (close the connection) only when the framing can no
/// longer be trusted: a bad magic, or a WRITE whose payload is larger than
/// `block.max` (it is not read, so the stream position is lost).
/// Everything else that is wrong with one request — out-of-range offsets,
/// unknown commands or flags, oversized reads, writes to a read-only
/// export — is a [`Decoded::Reject`]: that request fails with an errno and
/// the connection keeps serving.
pub fn decode_request(
    b: &[u8; REQUEST_HEADER_LEN],
    session: &Session,
    size: u64,
) -> Result<Decoded, ProtocolError> {
    let h = parse_request_header(b)?;
    let e = &session.export;
    let max = e.block.max;
    let is_write = h.typ == 1;
    if is_write && h.len > max {
        return Err(ProtocolError::PayloadTooLarge { len: h.len, max });
    }
    let skip = if is_write { h.len } else { 0 };
    let reject = |errno, reason| {
        Ok(Decoded::Reject {
            cookie: h.cookie,
            errno,
            skip,
            reason,
        })
    };
    let Some(cmd) = Command::from_u16(h.typ) else {
        return reject(errno::EINVAL, "unknown command");
    };
    if h.flags & !cflag::KNOWN != 0 {
        return reject(errno::EINVAL, "unknown command flags");
    }
    let allowed = match cmd {
        Command::Read => cflag::DF,
        Command::Write => cflag::FUA,
        Command::WriteZeroes => cflag::FUA | cflag::NO_HOLE | cflag::FAST_ZERO,
        Command::Trim => cflag::FUA,
        Command::BlockStatus => cflag::REQ_ONE,
        Command::Disconnect | Command::Flush | Command::Cache => 0,
    };
    if h.flags & !allowed != 0 {
        return reject(errno::EINVAL, "flag not valid for this command");
    }
    if h.flags & cflag::DF != 0 && !session.structured {
        return reject(errno::EINVAL, "DF without structured replies");
    }
    if cmd == Command::BlockStatus && !session.base_allocation {
        return reject(errno::EINVAL, "BLOCK_STATUS without a meta context");
    }
    let writes = matches!(cmd, Command::Write | Command::WriteZeroes | Command::Trim);
    if writes && e.read_only {
        return reject(errno::EPERM, "write to a read-only export");
    }
    match cmd {
        Command::Disconnect | Command::Flush => {
            if h.len != 0 || h.offset != 0 {
                return reject(errno::EINVAL, "FLUSH/DISC with offset or length");
            }
        }
        _ => {
            if h.len == 0 {
                return reject(errno::EINVAL, "zero-length request");
            }
            if matches!(cmd, Command::Read) && h.len > max {
                return reject(errno::EOVERFLOW, "read larger than the maximum block size");
            }
            let min = e.block.min.max(1) as u64;
            if !h.offset.is_multiple_of(min) || !(h.len as u64).is_multiple_of(min) {
                return reject(
                    errno::EINVAL,
                    "request not aligned to the minimum block size",
                );
            }
            let in_range = h
                .offset
                .checked_add(h.len as u64)
                .is_some_and(|end| end <= size);
            if !in_range {
                let errno = if writes { errno::ENOSPC } else { errno::EINVAL };
                return reject(errno, "request past the end of the export");
            }
        }
    }
    Ok(Decoded::Request(Request {
        cmd,
        cookie: h.cookie,
        offset: h.offset,
        len: h.len,
        flags: h.flags,
    }))
}

/// Encodes a simple reply header (data, if any, follows it).
pub fn simple_reply(cookie: u64, error: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// Encodes a structured reply chunk header (`len` payload bytes follow).
pub fn structured_header(flags: u16, typ: u16, cookie: u64, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&typ.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// Encodes a complete structured `NBD_REPLY_TYPE_ERROR` chunk (final).
pub fn structured_error(cookie: u64, errno: u32, msg: &str) -> Vec<u8> {
    let msg = &msg.as_bytes()[..msg.len().min(4096)];
    let mut b =
        structured_header(chunk::FLAG_DONE, chunk::ERROR, cookie, 6 + msg.len() as u32).to_vec();
    b.extend_from_slice(&errno.to_be_bytes());
    b.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    b.extend_from_slice(msg);
    b
}

/// Encodes a complete final `NBD_REPLY_TYPE_NONE` chunk (success, no data).
pub fn structured_done(cookie: u64) -> [u8; 20] {
    structured_header(chunk::FLAG_DONE, chunk::NONE, cookie, 0)
}

/// Encodes the header of a final `OFFSET_DATA` chunk; `len` data bytes follow.
pub fn structured_data_header(cookie: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut b = [0u8; 28];
    b[..20].copy_from_slice(&structured_header(
        chunk::FLAG_DONE,
        chunk::OFFSET_DATA,
        cookie,
        8 + len,
    ));
    b[20..28].copy_from_slice(&offset.to_be_bytes());
    b
}

/// Encodes a final `BLOCK_STATUS` chunk with one extent of `len` bytes and
/// the given status flags (0 = allocated data).
pub fn structured_block_status(cookie: u64, len: u32, flags: u32) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[..20].copy_from_slice(&structured_header(
        chunk::FLAG_DONE,
        chunk::BLOCK_STATUS,
        cookie,
        12,
    ));
    b[20..24].copy_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
    b[24..28].copy_from_slice(&len.to_be_bytes());
    b[28..32].copy_from_slice(&flags.to_be_bytes());
    b
}

#[cfg(test)]
mod tests;
