// SPDX-License-Identifier: Apache-2.0
//! virtio-net in the probe guest (`probe.ip=A.B.C.D`): it drives one card
//! with a receive and a transmit queue and answers, for its address, ARP
//! requests, ICMP echo requests and UDP datagrams to port 7 (echoed back
//! with the same virtio-net header, so a partially checksummed frame goes
//! back partially checksummed). A UDP datagram to port 9 starting with
//! `quit` ends the loop; the probe then prints its counters and exits.
//!
//! `probe.net_csum=0` declines the checksum offloads (CSUM, GUEST_CSUM).
//!
//! `probe.ip=dhcp` gets the address by DHCP first (DISCOVER, OFFER,
//! REQUEST, ACK; retransmitted about every second until bound) and prints
//! `net: dhcp A.B.C.D`.

use core::arch::asm;
use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{Ordering, fence};

use super::{fail, find, parse_num, put_dec, put_hex, puts, rd32, setup_interrupts, wr32};

const NQ: u16 = 16;
const BUFLEN: usize = 2048;
const HDR: usize = 12;

const F_CSUM: u32 = 1 << 0;
const F_GUEST_CSUM: u32 = 1 << 1;
const F_MAC: u32 = 1 << 5;

#[repr(C, align(4096))]
struct Rings([u8; 16384]);
static mut NET_RINGS: Rings = Rings([0; 16384]);

#[repr(C, align(4096))]
struct Bufs {
    rx: [[u8; BUFLEN]; NQ as usize],
    tx: [[u8; BUFLEN]; NQ as usize],
}
static mut NET_BUFS: Bufs = Bufs {
    rx: [[0; BUFLEN]; NQ as usize],
    tx: [[0; BUFLEN]; NQ as usize],
};

/// One split virtqueue in 8 KiB: descriptors at 0, avail at 256, used at 4096.
#[derive(Clone, Copy)]
struct Vq {
    base: u64,
    avail_idx: u16,
    used_seen: u16,
}

impl Vq {
    fn desc(&self) -> u64 {
        self.base
    }
    fn avail(&self) -> u64 {
        self.base + 256
    }
    fn used(&self) -> u64 {
        self.base + 4096
    }
    fn set_desc(&self, i: u16, addr: u64, len: u32, write: bool) {
        let d = self.desc() + i as u64 * 16;
        unsafe {
            write_volatile(d as *mut u64, addr);
            write_volatile((d + 8) as *mut u32, len);
            write_volatile((d + 12) as *mut u16, if write { 2 } else { 0 });
            write_volatile((d + 14) as *mut u16, 0);
        }
    }
    fn push(&mut self, head: u16) {
        let a = self.avail();
        unsafe {
            write_volatile((a + 4 + 2 * (self.avail_idx % NQ) as u64) as *mut u16, head);
            fence(Ordering::SeqCst);
            self.avail_idx = self.avail_idx.wrapping_add(1);
            write_volatile((a + 2) as *mut u16, self.avail_idx);
        }
        fence(Ordering::SeqCst);
    }
    fn used_idx(&self) -> u16 {
        unsafe { read_volatile((self.used() + 2) as *const u16) }
    }
    fn used_elem(&self, i: u16) -> (u32, u32) {
        let e = self.used() + 4 + 8 * (i % NQ) as u64;
        unsafe { (read_volatile(e as *const u32), read_volatile((e + 4) as *const u32)) }
    }
}

struct Counters {
    rx: u64,
    tx: u64,
    arp: u64,
    icmp: u64,
    udp: u64,
    partial: u64,
    other: u64,
}

fn parse_ip(s: &[u8]) -> Option<[u8; 4]> {
    let mut ip = [0u8; 4];
    let mut rest = s;
    for (i, b) in ip.iter_mut().enumerate() {
        let (v, r) = parse_num(rest)?;
        if v > 255 {
            return None;
        }
        *b = v as u8;
        rest = r;
        if i < 3 {
            rest = rest.strip_prefix(b".")?;
        }
    }
    Some(ip)
}

fn csum16(data: &[u8]) -> u16 {
    let mut sum = 0u32;
    let mut i = 0;
    while i + 1 < data.len() {
        sum += u32::from(u16::from_be_bytes([data[i], data[i + 1]]));
        i += 2;
    }
    if i < data.len() {
        sum += u32::from(data[i]) << 8;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn swap(f: &mut [u8], a: usize, b: usize, n: usize) {
    for i in 0..n {
        f.swap(a + i, b + i);
    }
}

/// Builds the answer to frame `f` (vnet header first) into `out`; returns
/// its length, or 0 for no answer. Sets `quit` for the quit datagram.
fn answer(f: &[u8], out: &mut [u8; BUFLEN], mac: &[u8; 6], ip: &[u8; 4], c: &mut Counters, quit: &mut bool) -> usize {
    if f.len() < HDR + 14 {
        c.other += 1;
        return 0;
    }
    let e = HDR;
    let ethertype = u16::from_be_bytes([f[e + 12], f[e + 13]]);
    if ethertype == 0x0806 {
        // ARP request for our address.
        let a = e + 14;
        if f.len() < a + 28 || f[a + 6..a + 8] != [0, 1] || f[a + 24..a + 28] != ip[..] {
            c.other += 1;
            return 0;
        }
        c.arp += 1;
        out[..HDR].fill(0);
        let o = HDR;
        out[o..o + 6].copy_from_slice(&f[e + 6..e + 12]);
        out[o + 6..o + 12].copy_from_slice(mac);
        out[o + 12..o + 14].copy_from_slice(&[0x08, 0x06]);
        let r = o + 14;
        out[r..r + 6].copy_from_slice(&f[a..a + 6]);
        out[r + 6..r + 8].copy_from_slice(&[0, 2]);
        out[r + 8..r + 14].copy_from_slice(mac);
        out[r + 14..r + 18].copy_from_slice(ip);
        out[r + 18..r + 24].copy_from_slice(&f[a + 8..a + 14]);
        out[r + 24..r + 28].copy_from_slice(&f[a + 14..a + 18]);
        return r + 28;
    }
    if ethertype != 0x0800 || f.len() < e + 34 {
        c.other += 1;
        return 0;
    }
    let ih = e + 14;
    let ihl = ((f[ih] & 0xf) as usize) * 4;
    let total = u16::from_be_bytes([f[ih + 2], f[ih + 3]]) as usize;
    if f[ih] >> 4 != 4 || ihl < 20 || total < ihl + 8 || ih + total > f.len() || ih + total > BUFLEN || f[ih + 16..ih + 20] != ip[..] {
        c.other += 1;
        return 0;
    }
    let l4 = ih + ihl;
    let len = ih + total;
    match f[ih + 9] {
        1 if f[l4] == 8 => {
            c.icmp += 1;
            out[..len].copy_from_slice(&f[..len]);
            out[..HDR].fill(0);
            swap(out, e, e + 6, 6);
            swap(out, ih + 12, ih + 16, 4);
            out[l4] = 0;
            out[l4 + 2] = 0;
            out[l4 + 3] = 0;
            let s = csum16(&out[l4..len]);
            out[l4 + 2..l4 + 4].copy_from_slice(&s.to_be_bytes());
            len
        }
        17 => {
            let dport = u16::from_be_bytes([f[l4 + 2], f[l4 + 3]]);
            if f[0] & 1 != 0 {
                c.partial += 1;
            }
            if dport == 9 && f[l4 + 8..len].starts_with(b"quit") {
                *quit = true;
                return 0;
            }
            if dport != 7 {
                c.other += 1;
                return 0;
            }
            c.udp += 1;
            // Swapping addresses and ports keeps both the IP and the UDP
            // checksum (and a partial one) valid: the sums commute.
            out[..len].copy_from_slice(&f[..len]);
            out[0] &= 1; // NEEDS_CSUM stays, DATA_VALID is receive-only
            out[1] = 0;
            out[10] = 0;
            out[11] = 0;
            swap(out, e, e + 6, 6);
            swap(out, ih + 12, ih + 16, 4);
            swap(out, l4, l4 + 2, 2);
            len
        }
        _ => {
            c.other += 1;
            0
        }
    }
}

/// DHCP client state (`probe.ip=dhcp`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dhcp {
    Off,
    Discovering,
    Requesting { offered: [u8; 4], server: [u8; 4] },
    Bound,
}

const XID: [u8; 4] = [0x5e, 0xaf, 0x00, 0x01];

/// A DHCP DISCOVER (`req` None) or REQUEST, broadcast from 0.0.0.0:68.
fn dhcp_frame(out: &mut [u8; BUFLEN], mac: &[u8; 6], req: Option<([u8; 4], [u8; 4])>) -> usize {
    out.fill(0);
    let e = HDR;
    out[e..e + 6].fill(0xff);
    out[e + 6..e + 12].copy_from_slice(mac);
    out[e + 12..e + 14].copy_from_slice(&[0x08, 0x00]);
    let ih = e + 14;
    let l4 = ih + 20;
    let b = l4 + 8;
    out[b] = 1; // BOOTREQUEST
    out[b + 1] = 1;
    out[b + 2] = 6;
    out[b + 4..b + 8].copy_from_slice(&XID);
    out[b + 10] = 0x80; // broadcast replies: we have no address yet
    out[b + 28..b + 34].copy_from_slice(mac);
    let mut o = b + 236;
    out[o..o + 4].copy_from_slice(&[99, 130, 83, 99]);
    o += 4;
    out[o..o + 3].copy_from_slice(&[53, 1, if req.is_some() { 3 } else { 1 }]);
    o += 3;
    if let Some((ip, server)) = req {
        out[o..o + 2].copy_from_slice(&[50, 4]);
        out[o + 2..o + 6].copy_from_slice(&ip);
        out[o + 6..o + 8].copy_from_slice(&[54, 4]);
        out[o + 8..o + 12].copy_from_slice(&server);
        o += 12;
    }
    out[o] = 255;
    o += 1;
    let udp_len = o - l4;
    out[l4..l4 + 2].copy_from_slice(&68u16.to_be_bytes());
    out[l4 + 2..l4 + 4].copy_from_slice(&67u16.to_be_bytes());
    out[l4 + 4..l4 + 6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    let total = o - ih;
    out[ih] = 0x45;
    out[ih + 2..ih + 4].copy_from_slice(&(total as u16).to_be_bytes());
    out[ih + 8] = 64;
    out[ih + 9] = 17;
    out[ih + 16..ih + 20].fill(0xff);
    let sum = csum16(&out[ih..ih + 20]);
    out[ih + 10..ih + 12].copy_from_slice(&sum.to_be_bytes());
    o
}

/// A DHCP reply for us in frame `f`: (message type, yiaddr, server id).
fn dhcp_reply(f: &[u8], mac: &[u8; 6]) -> Option<(u8, [u8; 4], [u8; 4])> {
    let e = HDR;
    if f.len() < e + 14 + 20 + 8 + 240 || f[e + 12..e + 14] != [0x08, 0x00] {
        return None;
    }
    let ih = e + 14;
    let ihl = ((f[ih] & 0xf) as usize) * 4;
    if f[ih + 9] != 17 || ihl < 20 {
        return None;
    }
    let l4 = ih + ihl;
    let b = l4 + 8;
    if f.len() < b + 240 || f[l4 + 2..l4 + 4] != [0, 68] || f[b] != 2 || f[b + 4..b + 8] != XID || f[b + 28..b + 34] != mac[..] || f[b + 236..b + 240] != [99, 130, 83, 99] {
        return None;
    }
    let mut yi = [0u8; 4];
    yi.copy_from_slice(&f[b + 16..b + 20]);
    let (mut kind, mut server) = (0u8, [0u8; 4]);
    let mut o = b + 240;
    while o < f.len() {
        let code = f[o];
        if code == 255 {
            break;
        }
        if code == 0 {
            o += 1;
            continue;
        }
        let len = *f.get(o + 1)? as usize;
        let v = f.get(o + 2..o + 2 + len)?;
        match (code, len) {
            (53, 1) => kind = v[0],
            (54, 4) => server.copy_from_slice(v),
            _ => {}
        }
        o += 2 + len;
    }
    Some((kind, yi, server))
}

fn rdtsc() -> u64 {
    // SAFETY: rdtsc has no memory effects.
    unsafe { core::arch::x86_64::_rdtsc() }
}

fn put_ip(ip: &[u8; 4]) {
    for (i, b) in ip.iter().enumerate() {
        put_dec(*b as u64);
        if i < 3 {
            super::putc(b'.');
        }
    }
}

/// Runs the echo loop on the card at `base`; returns when told to quit.
pub fn net_test(base: u64, irq: u32, cmdline: &[u8]) {
    let use_dhcp = find(cmdline, b"probe.ip=dhcp").is_some();
    let mut ip = [0u8; 4];
    if !use_dhcp {
        let Some(a) = find(cmdline, b"probe.ip=").and_then(parse_ip) else {
            fail(0x40, "probe.ip= is not an IPv4 address (or dhcp)");
        };
        ip = a;
    }
    let mut dhcp = if use_dhcp { Dhcp::Discovering } else { Dhcp::Off };
    let want_csum = find(cmdline, b"probe.net_csum=0").is_none();
    puts("virtio: net at ");
    put_hex(base);
    puts(" irq ");
    put_dec(irq as u64);
    puts("\n");
    setup_interrupts(irq);
    if rd32(base) != 0x7472_6976 || rd32(base + 4) != 2 || rd32(base + 8) != 1 {
        fail(0x41, "not a virtio-mmio network card");
    }
    wr32(base + 0x70, 0);
    wr32(base + 0x70, 1);
    wr32(base + 0x70, 1 | 2);
    wr32(base + 0x14, 1);
    let hi = rd32(base + 0x10);
    wr32(base + 0x14, 0);
    let lo = rd32(base + 0x10);
    if hi & 1 == 0 || lo & F_MAC == 0 {
        fail(0x41, "card lacks VERSION_1 or MAC");
    }
    let mut accept = F_MAC;
    if want_csum {
        accept |= lo & (F_CSUM | F_GUEST_CSUM);
    }
    wr32(base + 0x24, 1);
    wr32(base + 0x20, 1);
    wr32(base + 0x24, 0);
    wr32(base + 0x20, accept);
    wr32(base + 0x70, 1 | 2 | 8);
    if rd32(base + 0x70) & 8 == 0 {
        fail(0x41, "FEATURES_OK not accepted");
    }
    let m0 = rd32(base + 0x100).to_le_bytes();
    let m1 = rd32(base + 0x104).to_le_bytes();
    let mac = [m0[0], m0[1], m0[2], m0[3], m1[0], m1[1]];
    let link = u16::from_le_bytes([m1[2], m1[3]]);
    puts("net: mac ");
    for (i, b) in mac.iter().enumerate() {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        super::putc(HEX[(b >> 4) as usize]);
        super::putc(HEX[(b & 15) as usize]);
        if i < 5 {
            super::putc(b':');
        }
    }
    puts(" link ");
    put_dec(link as u64);
    puts(" features ");
    put_hex(accept as u64);
    puts("\n");
    let rings = (&raw const NET_RINGS) as u64;
    let mut rx = Vq { base: rings, avail_idx: 0, used_seen: 0 };
    let mut tx = Vq { base: rings + 8192, avail_idx: 0, used_seen: 0 };
    for (q, vq) in [(0u32, &rx), (1, &tx)] {
        wr32(base + 0x30, q);
        if rd32(base + 0x44) != 0 || rd32(base + 0x34) < NQ as u32 {
            fail(0x42, "net queue unavailable");
        }
        wr32(base + 0x38, NQ as u32);
        for (off, addr) in [(0x80, vq.desc()), (0x90, vq.avail()), (0xa0, vq.used())] {
            wr32(base + off, addr as u32);
            wr32(base + off + 4, (addr >> 32) as u32);
        }
        wr32(base + 0x44, 1);
    }
    wr32(base + 0x70, 1 | 2 | 8 | 4);
    let rxbuf = |i: u16| unsafe { (&raw const NET_BUFS.rx[i as usize]) as u64 };
    let txbuf = |i: u16| unsafe { (&raw const NET_BUFS.tx[i as usize]) as u64 };
    for i in 0..NQ {
        rx.set_desc(i, rxbuf(i), BUFLEN as u32, true);
        rx.push(i);
    }
    wr32(base + 0x50, 0);
    puts("net: up\n");
    let mut c = Counters { rx: 0, tx: 0, arp: 0, icmp: 0, udp: 0, partial: 0, other: 0 };
    let mut quit = false;
    // DHCP transmissions go in their own slot-free way: wait for the ring
    // to drain, then use the next slot.
    let send_dhcp = |tx: &mut Vq, req: Option<([u8; 4], [u8; 4])>| {
        while tx.avail_idx.wrapping_sub(tx.used_idx()) >= NQ {
            core::hint::spin_loop();
        }
        let slot = tx.avail_idx % NQ;
        // SAFETY: the slot is free (the device used it); single-threaded guest.
        let txbufs: &mut [[u8; BUFLEN]; NQ as usize] = unsafe { &mut *(&raw mut NET_BUFS.tx) };
        let n = dhcp_frame(&mut txbufs[slot as usize], &mac, req);
        tx.set_desc(slot, txbuf(slot), n as u32, false);
        tx.push(slot);
        wr32(base + 0x50, 1);
    };
    let mut last_sent = rdtsc();
    if dhcp == Dhcp::Discovering {
        send_dhcp(&mut tx, None);
    }
    while !quit {
        let mut reposted = false;
        while rx.used_seen != rx.used_idx() {
            let (id, len) = rx.used_elem(rx.used_seen);
            rx.used_seen = rx.used_seen.wrapping_add(1);
            let id = (id as u16) % NQ;
            let len = (len as usize).min(BUFLEN);
            c.rx += 1;
            // Wait for a free transmit slot (NQ in flight at most).
            while tx.avail_idx.wrapping_sub(tx.used_idx()) >= NQ {
                unsafe { asm!("sti", "hlt", "cli") };
            }
            let slot = tx.avail_idx % NQ;
            // SAFETY: the device wrote this buffer and returned it; it is
            // not on the ring again until pushed below. The transmit slot is
            // free (the device used it). Single-threaded guest.
            let rxbufs: &[[u8; BUFLEN]; NQ as usize] = unsafe { &*(&raw const NET_BUFS.rx) };
            let txbufs: &mut [[u8; BUFLEN]; NQ as usize] = unsafe { &mut *(&raw mut NET_BUFS.tx) };
            let frame = &rxbufs[id as usize][..len];
            let out = &mut txbufs[slot as usize];
            let mut n = 0;
            match (dhcp, dhcp_reply(frame, &mac)) {
                (Dhcp::Discovering, Some((2, offered, server))) => {
                    dhcp = Dhcp::Requesting { offered, server };
                    n = dhcp_frame(out, &mac, Some((offered, server)));
                    last_sent = rdtsc();
                }
                (Dhcp::Requesting { offered, .. }, Some((5, acked, _))) if acked == offered => {
                    ip = acked;
                    dhcp = Dhcp::Bound;
                    puts("net: dhcp ");
                    put_ip(&ip);
                    puts("\n");
                }
                (Dhcp::Requesting { .. }, Some((6, _, _))) => dhcp = Dhcp::Discovering,
                (_, Some(_)) => c.other += 1,
                (_, None) => n = answer(frame, out, &mac, &ip, &mut c, &mut quit),
            }
            rx.push(id);
            reposted = true;
            if n > 0 {
                tx.set_desc(slot, txbuf(slot), n as u32, false);
                tx.push(slot);
                wr32(base + 0x50, 1);
                c.tx += 1;
            }
        }
        if reposted {
            wr32(base + 0x50, 0);
        }
        let isr = rd32(base + 0x60);
        if isr != 0 {
            wr32(base + 0x64, isr);
        }
        if matches!(dhcp, Dhcp::Discovering | Dhcp::Requesting { .. }) {
            // No timer interrupt here: poll, and send again after ~1 s of
            // TSC time (at least 1 GHz on any host KVM runs on).
            if rdtsc().wrapping_sub(last_sent) > 1_000_000_000 {
                let req = match dhcp {
                    Dhcp::Requesting { offered, server } => Some((offered, server)),
                    _ => None,
                };
                send_dhcp(&mut tx, req);
                c.tx += 1;
                last_sent = rdtsc();
            }
            core::hint::spin_loop();
        } else if !quit && rx.used_seen == rx.used_idx() {
            unsafe { asm!("sti", "hlt", "cli") };
        }
    }
    // Let the last answers leave before the VM exits.
    let mut spins = 0u32;
    while tx.used_idx() != tx.avail_idx && spins < 1000 {
        unsafe { asm!("sti", "hlt", "cli") };
        spins += 1;
    }
    puts("net: rx ");
    put_dec(c.rx);
    puts(" tx ");
    put_dec(c.tx);
    puts(" arp ");
    put_dec(c.arp);
    puts(" icmp ");
    put_dec(c.icmp);
    puts(" udp ");
    put_dec(c.udp);
    puts(" partial ");
    put_dec(c.partial);
    puts(" other ");
    put_dec(c.other);
    puts("\n");
}
