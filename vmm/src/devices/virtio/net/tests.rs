// SPDX-License-Identifier: Apache-2.0
//! The virtio-net device against a scripted driver and a real datagram
//! socket backend: frame paths both ways, mergeable buffers, and every kind
//! of hostile chain.
#![allow(clippy::unwrap_used)]

use std::os::unix::net::UnixDatagram;
use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::devices::virtio::mmio::status;
use crate::devices::virtio::test_utils::{DATA, NetDriver, RawDesc};

const MRG: u32 = 1 << VIRTIO_NET_F_MRG_RXBUF;
const MAC: MacAddr = MacAddr([2, 0, 0, 0, 0, 7]);

fn card(features: u32) -> (NetDriver, UnixDatagram, Arc<NetStats>) {
    let (b, peer) = DgramBackend::pair().unwrap();
    peer.set_nonblocking(true).unwrap();
    let dev = VirtioNet::new(Arc::new(b), MAC);
    let stats = dev.stats();
    let mut d = NetDriver::with_device(dev, 1 << 20);
    assert!(d.start(features, 16));
    (d, peer, stats)
}

fn frame(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
}

/// Posts receive buffer `i` of `len` bytes at DATA + i * 0x1000.
fn post_rx(d: &mut NetDriver, i: u16, len: u32) {
    d.set_desc(
        RX_QUEUE,
        i,
        RawDesc {
            addr: DATA + u64::from(i) * 0x1000,
            len,
            flags: 2,
            next: 0,
        },
    );
    d.kick(RX_QUEUE, i);
}

/// Queues a transmit chain: the vnet header `hdr` then `payload`, in two
/// descriptors at head `head`.
fn send_tx(d: &mut NetDriver, head: u16, hdr: [u8; 12], payload: &[u8]) {
    let at = DATA + 0x2_0000 + u64::from(head) * 0x1000;
    d.mem.write_slice(&hdr, GuestAddress(at)).unwrap();
    d.mem.write_slice(payload, GuestAddress(at + 64)).unwrap();
    d.set_desc(
        TX_QUEUE,
        head,
        RawDesc {
            addr: at,
            len: 12,
            flags: 1,
            next: head + 1,
        },
    );
    d.set_desc(
        TX_QUEUE,
        head + 1,
        RawDesc {
            addr: at + 64,
            len: payload.len() as u32,
            flags: 0,
            next: 0,
        },
    );
    d.kick(TX_QUEUE, head);
}

#[test]
fn config_space_has_mac_and_link() {
    let (mut d, _peer, _) = card(0);
    assert_eq!(d.r(0x08), DEVICE_TYPE_NET);
    let a = d.r(0x100).to_le_bytes();
    let b = d.r(0x104).to_le_bytes();
    assert_eq!([a[0], a[1], a[2], a[3], b[0], b[1]], MAC.0);
    assert_eq!(u16::from_le_bytes([b[2], b[3]]), 1, "link up");
    // A datagram backend has no vnet header: no offloads offered.
    d.w(0x14, 0);
    assert_eq!(d.r(0x10) & (1 << VIRTIO_NET_F_CSUM), 0);
}

#[test]
fn transmit_strips_the_header_and_counts() {
    let (mut d, peer, stats) = card(0);
    let f = frame(100, 1);
    send_tx(&mut d, 0, [0; 12], &f);
    let mut got = vec![0u8; 2048];
    let n = peer.recv(&mut got).unwrap();
    assert_eq!(&got[..n], &f[..]);
    assert_eq!(d.used_idx(TX_QUEUE), 1);
    assert_eq!(d.used_elem(TX_QUEUE, 0), (0, 0));
    assert_eq!(stats.tx_frames.load(Ordering::Relaxed), 1);
    assert_eq!(stats.tx_bytes.load(Ordering::Relaxed), 100);
}

#[test]
fn receive_fills_one_buffer_with_header() {
    let (mut d, peer, stats) = card(0);
    post_rx(&mut d, 0, 2048);
    let f = frame(300, 2);
    peer.send(&f).unwrap();
    d.poll(RX_QUEUE);
    assert_eq!(d.used_idx(RX_QUEUE), 1);
    assert_eq!(d.used_elem(RX_QUEUE, 0), (0, 312));
    let mut got = vec![0u8; 312];
    d.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert_eq!(&got[..10], &[0; 10]);
    assert_eq!(u16::from_le_bytes([got[10], got[11]]), 1, "num_buffers");
    assert_eq!(&got[12..], &f[..]);
    assert_eq!(stats.rx_frames.load(Ordering::Relaxed), 1);
}

#[test]
fn a_received_frame_leaves_its_buffer_and_the_used_ring_dirty() {
    // Live migration resends what the device wrote: vm-memory's bitmap.
    let (mut d, peer, _) = card(0);
    post_rx(&mut d, 1, 2048);
    crate::memory::take_vmm_dirty(&d.mem);
    peer.send(&frame(300, 3)).unwrap();
    d.poll(RX_QUEUE);
    assert_eq!(d.used_idx(RX_QUEUE), 1);
    let dirty = crate::memory::take_vmm_dirty(&d.mem);
    let page = |gpa: u64| {
        let p = (gpa / 4096) as usize;
        dirty[0].bitmap[p / 64] & (1 << (p % 64)) != 0
    };
    let used = crate::devices::virtio::test_utils::NET_QUEUES[0].2;
    assert!(page(DATA + 0x1000) && page(used));
    assert!(!page(DATA) && !page(DATA + 0x2000));
}

#[test]
fn mergeable_buffers_split_a_frame() {
    let (mut d, peer, _) = card(MRG);
    for i in 0..6 {
        post_rx(&mut d, i, 64);
    }
    let f = frame(200, 3);
    peer.send(&f).unwrap();
    d.poll(RX_QUEUE);
    // 12 + 200 bytes over 64-byte buffers: 4 chains.
    assert_eq!(d.used_idx(RX_QUEUE), 4);
    let mut all = Vec::new();
    for k in 0..4 {
        let (id, len) = d.used_elem(RX_QUEUE, k);
        let mut b = vec![0u8; len as usize];
        d.mem
            .read_slice(&mut b, GuestAddress(DATA + u64::from(id) * 0x1000))
            .unwrap();
        all.extend(b);
    }
    assert_eq!(u16::from_le_bytes([all[10], all[11]]), 4);
    assert_eq!(&all[12..], &f[..]);
    // The two unused buffers still serve the next frame.
    peer.send(&frame(20, 4)).unwrap();
    d.poll(RX_QUEUE);
    assert_eq!(d.used_idx(RX_QUEUE), 5);
}

#[test]
fn a_buffer_too_small_drops_the_frame_and_keeps_the_buffer() {
    let (mut d, peer, stats) = card(0);
    post_rx(&mut d, 0, 100);
    peer.send(&frame(500, 5)).unwrap();
    d.poll(RX_QUEUE);
    assert_eq!(d.used_idx(RX_QUEUE), 0);
    assert_eq!(stats.rx_dropped.load(Ordering::Relaxed), 1);
    peer.send(&frame(50, 6)).unwrap();
    d.poll(RX_QUEUE);
    assert_eq!(d.used_idx(RX_QUEUE), 1);
    assert_eq!(d.used_elem(RX_QUEUE, 0), (0, 62));
}

#[test]
fn a_guest_that_never_refills_bounds_host_memory_and_cpu() {
    let (mut d, peer, stats) = card(0);
    post_rx(&mut d, 0, 2048);
    post_rx(&mut d, 1, 2048);
    // Fill the socket until the kernel refuses more.
    let mut sent = 0;
    while peer.send(&frame(1000, sent as u8)).is_ok() {
        sent += 1;
        if sent == 10_000 {
            break;
        }
    }
    assert!(sent > 2);
    for _ in 0..10 {
        d.poll(RX_QUEUE);
    }
    assert_eq!(d.used_idx(RX_QUEUE), 2, "only the two buffers given");
    // The device holds one frame and does not wake itself to spin.
    assert!(d.transport.queue_evts()[RX_QUEUE].read().is_err());
    assert_eq!(stats.rx_frames.load(Ordering::Relaxed), 2);
    // A new buffer takes the frame the device held, in order.
    post_rx(&mut d, 2, 2048);
    assert_eq!(d.used_idx(RX_QUEUE), 3);
    let mut b = vec![0u8; 1012];
    d.mem
        .read_slice(&mut b, GuestAddress(DATA + 2 * 0x1000))
        .unwrap();
    assert_eq!(&b[12..], &frame(1000, 2)[..]);
}

#[test]
fn hostile_transmit_chains_are_dropped_not_sent() {
    let (mut d, peer, stats) = card(0);
    let mut hdr = [0u8; 12];
    // NEEDS_CSUM without VIRTIO_NET_F_CSUM negotiated.
    hdr[0] = 1;
    send_tx(&mut d, 0, hdr, &frame(60, 7));
    // GSO without HOST_TSO4.
    let mut hdr = [0u8; 12];
    hdr[1] = 1;
    send_tx(&mut d, 2, hdr, &frame(60, 8));
    // Shorter than an Ethernet header.
    send_tx(&mut d, 4, [0; 12], &frame(5, 9));
    // A device-writable descriptor in a transmit chain.
    d.set_desc(
        TX_QUEUE,
        6,
        RawDesc {
            addr: DATA,
            len: 100,
            flags: 2,
            next: 0,
        },
    );
    d.kick(TX_QUEUE, 6);
    // Longer than 64 KiB: a chain of 8 descriptors of 16 KiB.
    for i in 0..8u16 {
        d.set_desc(
            TX_QUEUE,
            7 + i,
            RawDesc {
                addr: DATA,
                len: 16 << 10,
                flags: if i < 7 { 1 } else { 0 },
                next: 8 + i,
            },
        );
    }
    d.kick(TX_QUEUE, 7);
    assert_eq!(stats.tx_errors.load(Ordering::Relaxed), 5);
    assert_eq!(stats.tx_frames.load(Ordering::Relaxed), 0);
    assert_eq!(d.used_idx(TX_QUEUE), 5, "every chain is returned");
    let mut got = [0u8; 64];
    assert!(peer.recv(&mut got).is_err(), "nothing reached the backend");
    assert_eq!(d.status() & status::NEEDS_RESET, 0);
}

#[test]
fn addresses_outside_guest_memory_fault_the_device() {
    let (mut d, peer, _) = card(0);
    d.set_desc(
        TX_QUEUE,
        0,
        RawDesc {
            addr: 1 << 40,
            len: 100,
            flags: 0,
            next: 0,
        },
    );
    d.kick(TX_QUEUE, 0);
    assert_ne!(d.status() & status::NEEDS_RESET, 0);
    // Reset and start again: the card works.
    assert!(d.start(0, 16));
    post_rx(&mut d, 0, 2048);
    peer.send(&frame(40, 1)).unwrap();
    d.poll(RX_QUEUE);
    assert_eq!(d.used_idx(RX_QUEUE), 1);
    // A receive buffer outside memory.
    d.set_desc(
        RX_QUEUE,
        1,
        RawDesc {
            addr: (1 << 20) - 8,
            len: 2048,
            flags: 2,
            next: 0,
        },
    );
    d.kick(RX_QUEUE, 1);
    peer.send(&frame(40, 2)).unwrap();
    d.poll(RX_QUEUE);
    assert_ne!(d.status() & status::NEEDS_RESET, 0);
}

#[test]
fn a_device_readable_receive_buffer_faults_the_device() {
    let (mut d, peer, _) = card(0);
    d.set_desc(
        RX_QUEUE,
        0,
        RawDesc {
            addr: DATA,
            len: 2048,
            flags: 0,
            next: 0,
        },
    );
    d.kick(RX_QUEUE, 0);
    peer.send(&frame(40, 1)).unwrap();
    d.poll(RX_QUEUE);
    assert_ne!(d.status() & status::NEEDS_RESET, 0);
    let mut b = [0u8; 52];
    d.mem.read_slice(&mut b, GuestAddress(DATA)).unwrap();
    assert_eq!(b, [0; 52], "nothing written into a device-readable buffer");
}

#[test]
fn reset_drops_the_held_frame() {
    let (mut d, peer, _) = card(0);
    peer.send(&frame(40, 1)).unwrap();
    d.poll(RX_QUEUE);
    // No buffer yet: the frame waits in the device. Reset forgets it.
    assert!(d.start(0, 16));
    peer.send(&frame(40, 2)).unwrap();
    post_rx(&mut d, 0, 2048);
    assert_eq!(d.used_idx(RX_QUEUE), 1);
    let mut b = vec![0u8; 52];
    d.mem.read_slice(&mut b, GuestAddress(DATA)).unwrap();
    assert_eq!(&b[12..], &frame(40, 2)[..]);
}

#[test]
fn mac_addresses_parse_and_derive() {
    assert_eq!(
        MacAddr::parse("02:aB:00:11:22:33").unwrap().to_string(),
        "02:ab:00:11:22:33"
    );
    let a = MacAddr::derived("vm/net0");
    assert_eq!(a, MacAddr::derived("vm/net0"));
    assert_ne!(a, MacAddr::derived("vm/net1"));
    assert_eq!(a.0[0], 0x02, "locally administered unicast");
    // u8::from_str_radix alone would take a sign.
    assert!(MacAddr::parse("+a:00:00:00:00:00").is_err());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
    /// The fuzz target's case on random input: no panic, no broken invariant.
    #[test]
    fn random_guests_never_break_the_device(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 514..1200)) {
        crate::devices::virtio::test_utils::net_fuzz_case(&data);
    }
}
