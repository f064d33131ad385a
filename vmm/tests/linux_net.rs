// SPDX-License-Identifier: Apache-2.0
//! A stock Linux virtio-net driver against sheaf-vmm's card, in the
//! nested-KVM box (host KVM here cannot boot Linux): the Debian cloud disk
//! boots from its own disk with a NoCloud seed whose network-config asks
//! for DHCP on the card's MAC; L1 gives the tap sheaf-vmm creates an
//! address and runs busybox's udhcpd. The guest gets its lease, pings L1,
//! and moves 20 MB each way over TCP (checksum and TSO offloads through
//! the tap), checked by SHA-256 on both ends.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use sheaf_testkit::nested::NestedBox;
use sheaf_testkit::static_build;

const MAC: &str = "02:00:00:aa:bb:01";

/// L1's side: address the tap once sheaf-vmm created it, serve DHCP, take
/// 20 MB from the guest on port 5000 and send them back on port 5001.
const L1_SCRIPT: &str = r#"#!/bin/sh
touch /tmp/udhcpd.leases
cat > /tmp/udhcpd.conf <<EOF
start 10.0.2.15
end 10.0.2.15
interface sheaf0
lease_file /tmp/udhcpd.leases
max_leases 1
option subnet 255.255.255.0
option router 10.0.2.2
EOF
(
  i=0
  while [ ! -e /sys/class/net/sheaf0 ] && [ $i -lt 600 ]; do usleep 100000; i=$((i+1)); done
  busybox ip addr add 10.0.2.2/24 dev sheaf0
  busybox ip link set sheaf0 up
  echo "L1: sheaf0 up"
  busybox udhcpd -f /tmp/udhcpd.conf &
  busybox nc -l -p 5000 > /tmp/recv
  echo "L1-SHA $(busybox sha256sum < /tmp/recv | cut -d' ' -f1) bytes $(wc -c < /tmp/recv)"
  busybox nc -l -p 5001 < /tmp/recv
  echo "L1: sent back"
) >/tmp/l1net.log 2>&1 &
NET_TAP=sheaf0 NET_MAC=MAC_HERE ./run_vm --from-disk - "console=ttyS0 panic=-1" /dev/vdc cidata.img
rc=$?
busybox killall udhcpd nc 2>/dev/null
cat /tmp/l1net.log
exit $rc
"#;

/// The guest's side, run by cloud-init.
const GUEST_SCRIPT: &str = r#"#!/bin/bash
say() { echo "$*" > /dev/console; }
say SHEAF-NET-BEGIN
say "ADDR $(ip -4 -o addr show dev eth0 | awk '{print $4}')"
ping -c 3 -W 2 10.0.2.2 > /tmp/ping 2>&1
say "PING rc=$? $(grep -o '[0-9]* received' /tmp/ping)"
for d in /sys/bus/virtio/devices/*; do say "VIRTIO $(cat $d/device) $(cat $d/features)"; done
head -c 20000000 /dev/urandom > /tmp/blob
say "GUEST-SHA $(sha256sum < /tmp/blob | cut -d' ' -f1)"
cat /tmp/blob > /dev/tcp/10.0.2.2/5000
# L1 hashes what it got before it listens again: retry the connection.
for i in $(seq 60); do exec 3<>/dev/tcp/10.0.2.2/5001 && break; sleep 1; done 2>/dev/null
say "BACK-SHA $(head -c 20000000 <&3 | sha256sum | cut -d' ' -f1)"
say "STATS $(cat /sys/class/net/eth0/statistics/rx_packets) $(cat /sys/class/net/eth0/statistics/tx_packets) $(cat /sys/class/net/eth0/statistics/rx_errors)"
say SHEAF-NET-END
"#;

fn value<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key:?} in output:\n{out}"))
        .trim()
}

#[test]
fn debian_guest_gets_dhcp_pings_l1_and_moves_tcp_both_ways() {
    if sheaf_testkit::skip_slow("debian_net") {
        return;
    }
    sheaf_testkit::init_tracing();
    let image = sheaf_testkit::debian::DebianImage::build().unwrap();
    let vmm = static_build::build_example("sheaf-vmm", "run_vm").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut user = String::from(
        "#cloud-config\nwrite_files:\n  - path: /root/net.sh\n    permissions: '0755'\n    content: |\n",
    );
    for l in GUEST_SCRIPT.lines() {
        user.push_str("      ");
        user.push_str(l);
        user.push('\n');
    }
    user.push_str(
        "runcmd:\n  - [bash, /root/net.sh]\npower_state:\n  mode: poweroff\n  condition: true\n",
    );
    let network = format!(
        "version: 1\nconfig:\n  - type: physical\n    name: eth0\n    mac_address: \"{MAC}\"\n    subnets:\n      - type: dhcp\n"
    );
    let seed = dir.path().join("cidata.img");
    sheaf_testkit::debian::nocloud_seed(
        &seed,
        &[
            (
                "meta-data",
                "instance-id: iid-sheaf-net-1\nlocal-hostname: sheaf-net\n",
            ),
            ("user-data", &user),
            ("network-config", &network),
        ],
    )
    .unwrap();
    let script = dir.path().join("net-box.sh");
    std::fs::write(&script, L1_SCRIPT.replace("MAC_HERE", MAC)).unwrap();
    let out = NestedBox::new()
        .memory_mib(2048)
        .disk(&image.raw)
        .file("run_vm", &vmm)
        .file("cidata.img", &seed)
        .env("MEM_MIB", "768")
        .env("VCPUS", "2")
        .env("WAIT_S", "1200")
        .env("PROGRESS_S", "60")
        .timeout(Duration::from_secs(1500))
        .run(&script, std::iter::empty::<&str>())
        .unwrap();
    let o = &out.output;
    eprintln!("---- program output ----\n{o}\n---- end ----");
    assert!(
        o.contains("SHEAF-NET-END"),
        "the guest script did not finish:\n{o}"
    );
    assert_eq!(value(o, "ADDR"), "10.0.2.15/24", "DHCP lease from udhcpd");
    assert!(value(o, "PING rc=").starts_with("0 3 received"), "{o}");
    // The card's negotiated features: checksum (bit 0), guest checksum
    // (1), host TSO4 (11), mergeable receive buffers (15).
    let feats = o
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("VIRTIO 0x0001 "))
        .unwrap_or_else(|| panic!("no virtio-net device in the guest:\n{o}"));
    for bit in [0usize, 1, 11, 15, 32] {
        assert_eq!(
            feats.as_bytes().get(bit),
            Some(&b'1'),
            "feature bit {bit} not negotiated: {feats}"
        );
    }
    let sha = value(o, "GUEST-SHA");
    assert_eq!(sha.len(), 64, "{o}");
    assert!(
        value(o, "L1-SHA").starts_with(&format!("{sha} bytes 20000000")),
        "guest → L1 over TCP changed the data:\n{o}"
    );
    assert_eq!(
        value(o, "BACK-SHA"),
        sha,
        "L1 → guest over TCP changed the data"
    );
    assert!(o.contains("sheaf-vmm: guest exited: Shutdown"), "{o}");
    assert_eq!(out.exit_status, 0, "{o}");
    eprintln!(
        "debian_net: program ran {:?} in the box (box total {:?})",
        out.timings.program_runtime(),
        out.timings.total
    );
}
