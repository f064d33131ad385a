// SPDX-License-Identifier: Apache-2.0
//! The node's DHCP server for the pod network: answers only the MACs the
//! agent registered ([`Leases`]), each with its one address, the bridge as
//! router and server. Packets are parsed and built with `dhcproto`; a
//! request from a guest is hostile input, so anything it cannot parse or
//! does not expect is dropped (and counted), never answered wrongly.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dhcproto::v4::{DhcpOption, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Encodable};
use tracing::{debug, info, warn};

use super::{Leases, NetworkError, PodNetworkConfig, format_mac};

/// Lease time handed out (seconds): guests renew at half of it.
pub const LEASE_SECS: u32 = 3600;

/// A reply to send, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Encoded message.
    pub bytes: Vec<u8>,
    /// Destination (broadcast unless the client has an address).
    pub to: SocketAddrV4,
    /// Its type.
    pub kind: MessageType,
}

/// Answers one request. `None`: nothing to send (unparseable, not a
/// request, an unknown MAC, or addressed to another server).
pub fn respond(packet: &[u8], cfg: &PodNetworkConfig, leases: &Leases) -> Option<Reply> {
    // Ethernet only (htype 1, hlen 6). Checked on the raw bytes first:
    // dhcproto 0.15's `Message::chaddr()` slices by the wire's hlen and
    // panics when a packet claims more than 16 bytes.
    let clean = sanitize(packet)?;
    let msg = Message::from_bytes(&clean).ok()?;
    if msg.opcode() != Opcode::BootRequest || msg.chaddr().len() != 6 {
        return None;
    }
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&msg.chaddr()[..6]);
    let lease = leases.get(&mac)?;
    let gw = cfg.gateway();
    let server = match msg.opts().get(OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(s)) => Some(*s),
        _ => None,
    };
    let requested = match msg.opts().get(OptionCode::RequestedIpAddress) {
        Some(DhcpOption::RequestedIpAddress(r)) => Some(*r),
        _ => None,
    };
    let kind = match msg.opts().msg_type()? {
        MessageType::Discover => MessageType::Offer,
        MessageType::Request => {
            if server.is_some_and(|s| s != gw) {
                // The client chose another server's offer.
                return None;
            }
            let want = requested.unwrap_or(msg.ciaddr());
            if want == lease.ip {
                leases.bind(&mac, lease.ip);
                info!(mac = %format_mac(&mac), ip = %lease.ip, "DHCP lease bound");
                MessageType::Ack
            } else {
                debug!(mac = %format_mac(&mac), %want, "DHCP request for another address");
                MessageType::Nak
            }
        }
        MessageType::Release => {
            leases.unbind(&mac);
            return None;
        }
        MessageType::Decline => {
            warn!(mac = %format_mac(&mac), ip = %lease.ip, "guest declined its address (in use?)");
            return None;
        }
        MessageType::Inform => MessageType::Ack,
        _ => return None,
    };
    let mut r = Message::new_with_id(
        msg.xid(),
        Ipv4Addr::UNSPECIFIED,
        if kind == MessageType::Nak || msg.opts().msg_type() == Some(MessageType::Inform) {
            Ipv4Addr::UNSPECIFIED
        } else {
            lease.ip
        },
        gw,
        msg.giaddr(),
        &mac,
    );
    r.set_opcode(Opcode::BootReply).set_flags(msg.flags());
    let o = r.opts_mut();
    o.insert(DhcpOption::MessageType(kind));
    o.insert(DhcpOption::ServerIdentifier(gw));
    if kind != MessageType::Nak {
        o.insert(DhcpOption::SubnetMask(cfg.netmask()));
        o.insert(DhcpOption::Router(vec![gw]));
        if msg.opts().msg_type() != Some(MessageType::Inform) {
            o.insert(DhcpOption::AddressLeaseTime(LEASE_SECS));
        }
        if let Some(d) = cfg.dns {
            o.insert(DhcpOption::DomainNameServer(vec![d]));
        }
        if !lease.hostname.is_empty() {
            o.insert(DhcpOption::Hostname(lease.hostname.clone()));
        }
    }
    let bytes = r.to_vec().ok()?;
    let ci = msg.ciaddr();
    let to = if !ci.is_unspecified() && kind != MessageType::Nak {
        SocketAddrV4::new(ci, 68)
    } else {
        SocketAddrV4::new(Ipv4Addr::BROADCAST, 68)
    };
    Some(Reply { bytes, to, kind })
}

/// Valid requests for tests and fuzz seeds.
#[doc(hidden)]
pub mod tests_support {
    use super::*;

    /// A request of `kind` from `mac` with `opts`.
    pub fn packet(kind: MessageType, mac: [u8; 6], opts: Vec<DhcpOption>) -> Vec<u8> {
        let mut m = Message::new(
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            &mac,
        );
        m.opts_mut().insert(DhcpOption::MessageType(kind));
        for o in opts {
            m.opts_mut().insert(o);
        }
        m.to_vec().unwrap_or_default()
    }

    /// A DISCOVER (or, with `request`, a REQUEST for `ip` to the default
    /// gateway) from `mac`.
    pub fn request(request: bool, mac: [u8; 6], ip: Ipv4Addr) -> Vec<u8> {
        if request {
            let gw = PodNetworkConfig::default().gateway();
            packet(
                MessageType::Request,
                mac,
                vec![
                    DhcpOption::RequestedIpAddress(ip),
                    DhcpOption::ServerIdentifier(gw),
                ],
            )
        } else {
            packet(MessageType::Discover, mac, Vec::new())
        }
    }
}

/// Fixed BOOTP header length, then the 4-byte magic cookie.
const HEADER: usize = 236;
const COOKIE: [u8; 4] = [99, 130, 83, 99];

/// Rebuilds a request with only the options the server reads, each with a
/// valid length, so the decoder never sees an option it mishandles
/// (dhcproto 0.15 has `debug_assert!`s and a `len - 1` on some option
/// lengths). `None`: not an Ethernet BOOTP request with a DHCP cookie, or
/// malformed options.
fn sanitize(p: &[u8]) -> Option<Vec<u8>> {
    if p.len() < HEADER + 4
        || p[0] != 1
        || p[1] != 1
        || p[2] != 6
        || p[HEADER..HEADER + 4] != COOKIE
    {
        return None;
    }
    let mut out = p[..HEADER + 4].to_vec();
    let mut i = HEADER + 4;
    loop {
        let code = *p.get(i)?;
        match code {
            0 => {
                i += 1;
                continue;
            }
            255 => break,
            _ => {}
        }
        let len = usize::from(*p.get(i + 1)?);
        let val = p.get(i + 2..i + 2 + len)?;
        let ok = match code {
            53 => len == 1,                // message type
            50 | 54 => len == 4,           // requested address, server id
            61 => (2..=64).contains(&len), // client id
            55 => len >= 1,                // parameter request list
            57 => len == 2,                // max message size
            _ => false,
        };
        if ok {
            out.push(code);
            out.push(len as u8);
            out.extend_from_slice(val);
        }
        i += 2 + len;
    }
    out.push(255);
    Some(out)
}

/// The server: a UDP socket on port 67 bound to the bridge.
#[derive(Debug)]
pub struct DhcpServer {
    /// Requests dropped (unparseable, unknown MAC, ...).
    pub ignored: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for DhcpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl DhcpServer {
    /// Binds `0.0.0.0:67` on the bridge (`SO_BINDTODEVICE`) and serves.
    pub fn start(cfg: PodNetworkConfig, leases: Leases) -> Result<DhcpServer, NetworkError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| NetworkError::Io { what, source }
        };
        let sock = std::net::UdpSocket::bind("0.0.0.0:67").map_err(io("binding UDP port 67"))?;
        sock.set_broadcast(true).map_err(io("SO_BROADCAST"))?;
        let dev = cfg.bridge.as_bytes();
        // SAFETY: setsockopt on a socket we own, with a pointer/length pair
        // into a live byte slice; the kernel copies at most `len` bytes.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_BINDTODEVICE,
                dev.as_ptr().cast(),
                dev.len() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io("SO_BINDTODEVICE on the pod bridge")(
                std::io::Error::last_os_error(),
            ));
        }
        sock.set_nonblocking(true).map_err(io("O_NONBLOCK"))?;
        let sock = tokio::net::UdpSocket::from_std(sock).map_err(io("registering the socket"))?;
        let ignored = Arc::new(AtomicU64::new(0));
        let ign = ignored.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 1500];
            loop {
                let n = match sock.recv_from(&mut buf).await {
                    Ok((n, _)) => n,
                    Err(e) => {
                        warn!(error = %e, "DHCP receive");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        continue;
                    }
                };
                match respond(&buf[..n], &cfg, &leases) {
                    Some(r) => {
                        debug!(kind = ?r.kind, to = %r.to, "DHCP reply");
                        if let Err(e) = sock.send_to(&r.bytes, r.to).await {
                            warn!(error = %e, to = %r.to, "DHCP send");
                        }
                    }
                    None => {
                        ign.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
        Ok(DhcpServer { ignored, task })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::tests_support::packet as request;

    #[test]
    fn discover_request_ack_for_known_macs_only() {
        let cfg = PodNetworkConfig::default();
        let leases = Leases::default();
        let mac = [2, 0, 0, 0, 0, 7];
        let ip = Ipv4Addr::new(10, 244, 3, 4);
        leases.insert(mac, ip, "vm");
        let off = respond(&request(MessageType::Discover, mac, vec![]), &cfg, &leases).unwrap();
        assert_eq!(off.kind, MessageType::Offer);
        let m = Message::from_bytes(&off.bytes).unwrap();
        assert_eq!(m.yiaddr(), ip);
        assert_eq!(
            m.opts().get(OptionCode::Router),
            Some(&DhcpOption::Router(vec![cfg.gateway()]))
        );
        assert!(!leases.get(&mac).unwrap().bound);
        let ack = respond(
            &request(
                MessageType::Request,
                mac,
                vec![
                    DhcpOption::RequestedIpAddress(ip),
                    DhcpOption::ServerIdentifier(cfg.gateway()),
                ],
            ),
            &cfg,
            &leases,
        )
        .unwrap();
        assert_eq!(ack.kind, MessageType::Ack);
        assert!(leases.get(&mac).unwrap().bound);
        // Another address: NAK; another server: silence; unknown MAC: silence.
        let nak = respond(
            &request(
                MessageType::Request,
                mac,
                vec![DhcpOption::RequestedIpAddress(Ipv4Addr::new(10, 244, 9, 9))],
            ),
            &cfg,
            &leases,
        )
        .unwrap();
        assert_eq!(nak.kind, MessageType::Nak);
        assert!(
            respond(
                &request(
                    MessageType::Request,
                    mac,
                    vec![DhcpOption::ServerIdentifier(Ipv4Addr::new(1, 2, 3, 4))]
                ),
                &cfg,
                &leases
            )
            .is_none()
        );
        assert!(
            respond(
                &request(MessageType::Discover, [2, 9, 9, 9, 9, 9], vec![]),
                &cfg,
                &leases
            )
            .is_none()
        );
        respond(&request(MessageType::Release, mac, vec![]), &cfg, &leases);
        assert!(!leases.get(&mac).unwrap().bound);
    }

    #[test]
    fn hostile_packets_are_dropped() {
        let cfg = PodNetworkConfig::default();
        let leases = Leases::default();
        leases.insert([2, 0, 0, 0, 0, 7], Ipv4Addr::new(10, 244, 3, 4), "vm");
        let good = request(MessageType::Discover, [2, 0, 0, 0, 0, 7], vec![]);
        for n in 0..good.len() {
            let _ = respond(&good[..n], &cfg, &leases);
        }
        let mut x: u32 = 1;
        for _ in 0..2000 {
            let mut p = good.clone();
            for _ in 0..4 {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let i = (x as usize >> 8) % p.len();
                p[i] = (x >> 3) as u8;
            }
            let _ = respond(&p, &cfg, &leases);
        }
        assert!(respond(&[0u8; 300], &cfg, &leases).is_none());
        // A hardware address length past chaddr's 16 bytes.
        let mut p = good.clone();
        p[2] = 200;
        assert!(respond(&p, &cfg, &leases).is_none());
    }
}
