// SPDX-License-Identifier: Apache-2.0
//! virtio-net on host KVM: the probe guest gets a tap in a network
//! namespace this test creates, and the host talks to it with real tools
//! and sockets: `ping` (ARP + ICMP echo), `ethtool -k` (the offloads the
//! guest negotiated reached the tap), and 10,000 UDP datagrams echoed in
//! order with nothing lost.
#![allow(clippy::unwrap_used)]

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use sheaf_testkit::netns::NetNs;
use sheaf_vmm::{ExitReason, Vm, VmConfig, probe};

const HOST_IP: &str = "10.77.0.1";
const GUEST_IP: &str = "10.77.0.2";

fn can_run() -> bool {
    for p in ["/dev/kvm", "/dev/net/tun"] {
        if !std::path::Path::new(p).exists() {
            eprintln!("SKIP: {p} is absent");
            return false;
        }
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: creating network namespaces needs root");
        return false;
    }
    true
}

fn wait_console(vm: &Vm, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = String::from_utf8_lossy(&vm.console().contents()).into_owned();
        if out.contains(what) {
            return;
        }
        assert!(
            Instant::now() < deadline && vm.exit_reason().is_none(),
            "no {what:?} on the console:\n{out}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The counter `name` from the probe's `net: ...` summary line.
fn counter(console: &str, name: &str) -> u64 {
    let line = console
        .lines()
        .find(|l| l.starts_with("net: rx "))
        .unwrap_or_else(|| panic!("no summary in console:\n{console}"));
    let mut it = line.split_whitespace();
    while let Some(w) = it.next() {
        if w == name {
            return it.next().unwrap().parse().unwrap();
        }
    }
    panic!("no {name} in {line:?}")
}

fn offloads(ns: &NetNs) -> String {
    let out = ns.exec(&["ethtool", "-k", "sheaf0"]);
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Boots the probe on a tap in a fresh namespace; `csum` lets the probe
/// accept the checksum offloads. Sends `frames` UDP datagrams through the
/// guest's echo and checks each comes back, in order.
fn run_echo(csum: bool, frames: u32) {
    let ns = NetNs::new("tap");
    let cmdline = format!(
        "console=ttyS0 probe.ip={GUEST_IP}{}",
        if csum { "" } else { " probe.net_csum=0" }
    );
    let config = VmConfig::builder()
        .name("net-probe")
        .memory_mib(32)
        .kernel(probe::elf_path())
        .cmdline(cmdline)
        .cmdline_virtio_devices(true)
        .net_tap("sheaf0")
        .build()
        .unwrap();
    let vm = ns.enter(move || Vm::new(config).unwrap());
    ns.ip(&["addr", "add", &format!("{HOST_IP}/24"), "dev", "sheaf0"]);
    ns.ip(&["link", "set", "sheaf0", "up"]);
    assert!(
        offloads(&ns).contains("tx-checksumming: off"),
        "before the driver starts the tap takes no partial checksums"
    );
    vm.start().unwrap();
    wait_console(&vm, "net: up");
    let k = offloads(&ns);
    let want = if csum { "on" } else { "off" };
    assert!(
        k.contains(&format!("tx-checksumming: {want}")),
        "ethtool -k after the driver started:\n{k}"
    );

    // ARP + ICMP echo through the system's ping.
    let out = ns.exec(&["ping", "-c", "5", "-i", "0.2", "-W", "2", GUEST_IP]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && text.contains("5 received"),
        "ping: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // UDP echo: a window of 32 datagrams in flight, sizes 4..1400 bytes.
    let sock = ns.enter(|| UdpSocket::bind(format!("{HOST_IP}:0")).unwrap());
    let guest: SocketAddr = format!("{GUEST_IP}:7").parse().unwrap();
    sock.connect(guest).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let payload = |seq: u32| -> Vec<u8> {
        let n = 4 + (seq as usize * 37) % 1397;
        let mut p: Vec<u8> = (0..n).map(|i| (i as u32 ^ seq) as u8).collect();
        p[..4].copy_from_slice(&seq.to_be_bytes());
        p
    };
    let started = Instant::now();
    let (mut sent, mut got) = (0u32, 0u32);
    let mut buf = vec![0u8; 2048];
    while got < frames {
        while sent < frames && sent - got < 32 {
            sock.send(&payload(sent)).unwrap();
            sent += 1;
        }
        let n = sock
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("datagram {got} of {frames} lost: {e}"));
        assert_eq!(
            &buf[..n],
            &payload(got)[..],
            "datagram {got} came back out of order or changed"
        );
        got += 1;
    }
    let took = started.elapsed();
    eprintln!(
        "{frames} datagrams echoed in order in {took:?} ({:.0}/s, csum offload {want})",
        f64::from(frames) / took.as_secs_f64()
    );

    // Tell the probe to stop and check its own counters.
    let quit = ns.enter(|| UdpSocket::bind(format!("{HOST_IP}:0")).unwrap());
    quit.send_to(b"quit", format!("{GUEST_IP}:9")).unwrap();
    let reason = vm
        .wait_timeout(Duration::from_secs(30))
        .expect("probe did not exit");
    let console = String::from_utf8_lossy(&vm.console().contents()).into_owned();
    assert_eq!(reason, ExitReason::DebugExit { code: 0 }, "{console}");
    assert_eq!(counter(&console, "udp"), u64::from(frames), "{console}");
    assert!(counter(&console, "icmp") >= 5, "{console}");
    assert!(counter(&console, "arp") >= 1, "{console}");
    let partial = counter(&console, "partial");
    if csum {
        assert!(
            partial >= u64::from(frames),
            "with GUEST_CSUM the tap hands over partially checksummed UDP: {console}"
        );
    } else {
        assert_eq!(partial, 0, "{console}");
    }
    let m = vm.metrics();
    assert!(m.net_rx_frames >= u64::from(frames) + 5, "{m:?}");
    assert!(m.net_tx_frames >= u64::from(frames) + 5, "{m:?}");
}

#[test]
fn probe_guest_answers_ping_and_echoes_10000_datagrams_over_a_tap() {
    if can_run() {
        run_echo(true, 10_000);
    }
}

#[test]
fn without_checksum_offload_the_tap_checksums_for_the_guest() {
    if can_run() {
        run_echo(false, 500);
    }
}

#[test]
fn a_tap_name_that_is_a_path_is_refused() {
    let err = VmConfig::builder()
        .kernel(probe::elf_path())
        .net_tap("../../etc")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("may not contain"), "{err}");
}
