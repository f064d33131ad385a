// SPDX-License-Identifier: Apache-2.0
//! Where a virtio-net device's frames go: the [`NetBackend`] seam, a Linux
//! tap ([`TapBackend`]) and a datagram socket ([`DgramBackend`], one frame
//! per datagram, for userspace switches and tests).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixDatagram;

/// Size of the `virtio_net_hdr_v1` every frame carries between driver and
/// device (VIRTIO_F_VERSION_1 makes `num_buffers` always present).
pub const VNET_HDR_LEN: usize = 12;
/// The largest frame a backend hands over or takes, header included: a
/// 64 KiB GSO packet plus its Ethernet header and the vnet header.
pub const MAX_FRAME: usize = VNET_HDR_LEN + 14 + 65535;

/// Offloads the guest accepted, as the tap's `TUN_F_*` flags.
pub mod offload {
    /// The guest takes partially checksummed frames (`GUEST_CSUM`).
    pub const CSUM: u32 = libc::TUN_F_CSUM;
    /// The guest takes TCPv4 GSO frames (`GUEST_TSO4`).
    pub const TSO4: u32 = libc::TUN_F_TSO4;
    /// The guest takes TCPv6 GSO frames (`GUEST_TSO6`).
    pub const TSO6: u32 = libc::TUN_F_TSO6;
    /// ... with ECN (`GUEST_ECN`).
    pub const TSO_ECN: u32 = libc::TUN_F_TSO_ECN;
}

/// A network backend: the host end of one virtio-net device.
///
/// Frames are whole Ethernet frames; when [`NetBackend::vnet_hdr`] is true
/// each one starts with a 12-byte `virtio_net_hdr_v1` (checksum and GSO
/// metadata, as a tap with `IFF_VNET_HDR` uses), otherwise the device adds
/// and strips that header and offers no offloads. Calls come from the VM's
/// device thread and must not block.
pub trait NetBackend: Send + Sync {
    /// Reads the next waiting frame into `buf`, returning its length, or
    /// `None` when nothing waits. A frame longer than `buf` may be cut.
    fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>>;
    /// Sends one frame. A backend that cannot take it now drops it and
    /// returns `Ok(false)`.
    fn send(&self, frame: &[u8]) -> io::Result<bool>;
    /// A descriptor that turns readable when frames wait (watched
    /// edge-triggered by the device thread).
    fn rx_fd(&self) -> RawFd;
    /// Whether frames carry a virtio-net header.
    fn vnet_hdr(&self) -> bool {
        false
    }
    /// Tells the backend which offloads the guest accepted ([`offload`]
    /// flags); called on driver activation and with 0 on reset.
    fn set_offloads(&self, flags: u32) -> io::Result<()> {
        let _ = flags;
        Ok(())
    }
    /// A name for logs.
    fn name(&self) -> String;
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR)
    )
}

/// A Linux tap interface (`/dev/net/tun`, `IFF_TAP | IFF_NO_PI |
/// IFF_VNET_HDR`), non-blocking. An existing persistent tap of that name
/// (e.g. from `ip tuntap add NAME mode tap vnet_hdr`) is attached, else a
/// new one is created and lives as long as the device. The interface is
/// created in the network namespace of the calling thread.
#[derive(Debug)]
pub struct TapBackend {
    file: File,
    name: String,
}

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Errors of a tap name.
pub fn check_tap_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the tap name is empty".into());
    }
    if name.len() >= libc::IFNAMSIZ {
        return Err(format!(
            "tap name {name:?} is {} bytes, at most {} allowed",
            name.len(),
            libc::IFNAMSIZ - 1
        ));
    }
    if name == "." || name == ".." || name.bytes().any(|b| b == b'/' || b <= b' ' || b == b':') {
        return Err(format!(
            "tap name {name:?} may not contain '/', ':', spaces or control characters"
        ));
    }
    Ok(())
}

impl TapBackend {
    /// Opens or creates the tap `name`.
    pub fn open(name: &str) -> io::Result<TapBackend> {
        check_tap_name(name).map_err(|m| io::Error::new(io::ErrorKind::InvalidInput, m))?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")?;
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads and writes a `struct ifreq`, which `IfReq`
        // matches in size and layout (name, then the flags union member).
        let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let hdr = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int from the pointer.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let len = req
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(req.name.len());
        let tap = TapBackend {
            file,
            name: String::from_utf8_lossy(&req.name[..len]).into_owned(),
        };
        tap.set_offloads(0)?;
        Ok(tap)
    }

    /// Wraps an open tap descriptor (already configured with `IFF_VNET_HDR`
    /// and a 12-byte header size, e.g. one handed over by a CNI plugin).
    pub fn from_fd(fd: OwnedFd, name: impl Into<String>) -> io::Result<TapBackend> {
        let raw = fd.as_raw_fd();
        // SAFETY: F_GETFL/F_SETFL on a descriptor we own.
        let fl = unsafe { libc::fcntl(raw, libc::F_GETFL) };
        // SAFETY: as above.
        if fl < 0 || unsafe { libc::fcntl(raw, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(TapBackend {
            file: File::from(fd),
            name: name.into(),
        })
    }

    /// The interface name the kernel gave the tap.
    pub fn if_name(&self) -> &str {
        &self.name
    }
}

impl NetBackend for TapBackend {
    fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        // SAFETY: reads at most `buf.len()` bytes into `buf`.
        let n = unsafe { libc::read(self.file.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if would_block(&e) { Ok(None) } else { Err(e) };
        }
        Ok(Some(n as usize))
    }

    fn send(&self, frame: &[u8]) -> io::Result<bool> {
        // SAFETY: writes `frame.len()` bytes from `frame`.
        let n = unsafe { libc::write(self.file.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if would_block(&e) { Ok(false) } else { Err(e) };
        }
        Ok(true)
    }

    fn rx_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn vnet_hdr(&self) -> bool {
        true
    }

    fn set_offloads(&self, flags: u32) -> io::Result<()> {
        // SAFETY: TUNSETOFFLOAD takes the flags as the ioctl argument.
        let r = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                libc::c_ulong::from(flags),
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn name(&self) -> String {
        format!("tap {}", self.name)
    }
}

/// One end of a Unix datagram socket pair: each datagram is one Ethernet
/// frame, without a virtio-net header (like QEMU's `-netdev dgram`). The
/// other end goes to a userspace switch, or to a test.
#[derive(Debug)]
pub struct DgramBackend {
    sock: UnixDatagram,
}

impl DgramBackend {
    /// A backend and the peer socket its frames reach.
    pub fn pair() -> io::Result<(DgramBackend, UnixDatagram)> {
        let (a, b) = UnixDatagram::pair()?;
        a.set_nonblocking(true)?;
        Ok((DgramBackend { sock: a }, b))
    }

    /// Wraps a connected datagram socket (made non-blocking).
    pub fn from_socket(sock: UnixDatagram) -> io::Result<DgramBackend> {
        sock.set_nonblocking(true)?;
        Ok(DgramBackend { sock })
    }
}

impl NetBackend for DgramBackend {
    fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        match self.sock.recv(buf) {
            Ok(n) => Ok(Some(n)),
            Err(e) if would_block(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn send(&self, frame: &[u8]) -> io::Result<bool> {
        match self.sock.send(frame) {
            Ok(_) => Ok(true),
            Err(e) if would_block(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn rx_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    fn name(&self) -> String {
        "unix datagram".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_names_are_checked() {
        assert!(check_tap_name("tap0").is_ok());
        assert!(check_tap_name("sheaf-vm-0123ab").is_ok());
        for bad in [
            "",
            "a/b",
            "..",
            "with space",
            "sixteen-chars-xx",
            "a:b",
            "x\n",
        ] {
            assert!(check_tap_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn dgram_pair_moves_frames_and_never_blocks() {
        let (b, peer) = DgramBackend::pair().unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(b.recv(&mut buf).unwrap(), None);
        peer.send(b"frame").unwrap();
        assert_eq!(b.recv(&mut buf).unwrap(), Some(5));
        assert!(b.send(b"back").unwrap());
        let mut got = [0u8; 8];
        assert_eq!(peer.recv(&mut got).unwrap(), 4);
    }
}
