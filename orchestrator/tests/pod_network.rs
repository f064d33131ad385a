// SPDX-License-Identifier: Apache-2.0
//! The pod network's Linux side with real clients: a node namespace gets
//! the pod bridge, the nftables masquerade rule and the DHCP server; a
//! "guest" namespace plugged into the bridge (a veth where a VM has its
//! tap) gets its address from busybox's `udhcpc`, pings the gateway and
//! opens a TCP connection to a server outside the node, which sees the
//! node's address (NAT). Teardown leaves no bridge, tap or table behind.
//! Needs root, iproute2, nftables and busybox; skipped otherwise.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

use sheaf_orchestrator::network::{
    DhcpServer, Leases, PodBridge, PodNetworkConfig, format_mac, parse_mac,
};
use sheaf_testkit::netns::{NetNs, run};

fn have(cmd: &str, arg: &str) -> bool {
    Command::new(cmd)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

fn usable() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: needs root");
        return false;
    }
    for (c, a) in [("ip", "-V"), ("nft", "--version"), ("busybox", "--help")] {
        if !have(c, a) {
            eprintln!("SKIP: no {c}");
            return false;
        }
    }
    true
}

#[test]
fn dhcp_and_masquerade_with_udhcpc_and_a_tcp_server_outside() {
    if !usable() {
        return;
    }
    let node = NetNs::new("node");
    let guest = NetNs::new("vm");
    let outside = NetNs::new("out");
    // node <-> outside: 172.31.77.0/24.
    node.ip(&[
        "link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", &outside.0,
    ]);
    node.ip(&["addr", "add", "172.31.77.1/24", "dev", "up0"]);
    node.ip(&["link", "set", "up0", "up"]);
    outside.ip(&["addr", "add", "172.31.77.2/24", "dev", "eth0"]);
    outside.ip(&["link", "set", "eth0", "up"]);
    // The guest's "tap": a veth whose node end joins the pod bridge.
    node.ip(&[
        "link", "add", "vmport", "type", "veth", "peer", "name", "eth0", "netns", &guest.0,
    ]);
    let mac_s = guest.ip(&["-o", "link", "show", "eth0"]);
    let mac_s = mac_s
        .split("link/ether ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .to_string();
    let mac = parse_mac(&mac_s).unwrap();
    guest.ip(&["link", "set", "eth0", "up"]);

    let cfg = PodNetworkConfig {
        network: Ipv4Addr::new(10, 99, 0, 0),
        prefix: 24,
        bridge: "sheafpod".into(),
        dns: Some(Ipv4Addr::new(10, 99, 0, 1)),
    };
    let want = cfg
        .pick_address("default/vm/default", &Default::default())
        .unwrap();
    let leases = Leases::default();
    leases.insert(mac, want, "vm");
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<PodBridge>();
    let (c2, l2) = (cfg.clone(), leases.clone());
    let server = node.spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let bridge = PodBridge::setup(&c2, &[]).unwrap();
            let dhcp = DhcpServer::start(c2.clone(), l2).unwrap();
            run("ip", &["link", "set", "vmport", "master", "sheafpod", "up"]);
            ready_tx.send(bridge).unwrap();
            tokio::task::spawn_blocking(move || stop_rx.recv())
                .await
                .unwrap()
                .ok();
            drop(dhcp);
        });
    });
    let bridge = ready_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    // The masquerade rule is in place.
    let tables = node.exec(&["nft", "list", "ruleset"]);
    let rules = String::from_utf8_lossy(&tables.stdout).into_owned();
    assert!(
        rules.contains("masquerade") && rules.contains("10.99.0.0/24"),
        "{rules}"
    );

    // busybox udhcpc: one lease, then exit; the script sets the address.
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("udhcpc.sh");
    let seen = dir.path().join("seen");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\ncase \"$1\" in bound|renew)\n  ip addr add \"$ip/$subnet\" dev \"$interface\"\n  ip route add default via \"$router\"\n  echo \"$ip $subnet $router $dns $hostname\" > {}\n;; esac\n",
            seen.display()
        ),
    )
    .unwrap();
    run("chmod", &["+x", script.to_str().unwrap()]);
    let o = guest.exec(&[
        "busybox",
        "udhcpc",
        "-i",
        "eth0",
        "-n",
        "-q",
        "-f",
        "-t",
        "5",
        "-T",
        "1",
        "-s",
        script.to_str().unwrap(),
    ]);
    assert!(
        o.status.success(),
        "udhcpc: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let got = std::fs::read_to_string(&seen).unwrap();
    assert_eq!(
        got.trim(),
        format!("{want} 255.255.255.0 10.99.0.1 10.99.0.1 vm"),
        "udhcpc saw {got}"
    );
    assert!(
        leases.get(&mac).unwrap().bound,
        "the lease of {} is bound",
        format_mac(&mac)
    );
    assert!(
        guest
            .ip(&["-4", "addr", "show", "eth0"])
            .contains(&format!("{want}/24"))
    );
    // The gateway answers.
    let p = guest.exec(&["ping", "-c", "2", "-W", "2", "10.99.0.1"]);
    assert!(
        p.status.success(),
        "ping gateway: {}",
        String::from_utf8_lossy(&p.stdout)
    );

    // A TCP server outside the node sees the node's address, not the guest's.
    let srv = outside.spawn(|| {
        let l = TcpListener::bind("172.31.77.2:8080").unwrap();
        l.set_nonblocking(false).unwrap();
        let (mut s, peer) = l.accept().unwrap();
        let mut b = [0u8; 5];
        s.read_exact(&mut b).unwrap();
        s.write_all(b"pong!").unwrap();
        (peer, b)
    });
    let cli = guest.spawn(|| {
        let mut last = None;
        for _ in 0..50 {
            match TcpStream::connect_timeout(
                &"172.31.77.2:8080".parse().unwrap(),
                Duration::from_secs(2),
            ) {
                Ok(mut s) => {
                    s.write_all(b"ping!").unwrap();
                    let mut b = [0u8; 5];
                    s.read_exact(&mut b).unwrap();
                    return b;
                }
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("connect: {last:?}");
    });
    assert_eq!(&cli.join().unwrap(), b"pong!");
    let (peer, b) = srv.join().unwrap();
    assert_eq!(&b, b"ping!");
    assert_eq!(
        peer.ip().to_string(),
        "172.31.77.1",
        "masqueraded to the node's address"
    );

    // A tap made by the agent's code, then everything removed.
    let tap = PodBridge::tap_name("0123456789abcdef", 0);
    let b2 = bridge.clone();
    let t2 = tap.clone();
    node.spawn(move || b2.add_tap(&t2).unwrap()).join().unwrap();
    assert!(
        node.ip(&["-o", "link", "show", "master", "sheafpod"])
            .contains(&tap)
    );
    let b3 = bridge.clone();
    node.spawn(move || b3.teardown()).join().unwrap();
    stop_tx.send(()).unwrap();
    server.join().unwrap();
    let links = node.ip(&["-o", "link"]);
    assert!(
        !links.contains("sheafpod") && !links.contains(&tap),
        "{links}"
    );
    let rules =
        String::from_utf8_lossy(&node.exec(&["nft", "list", "ruleset"]).stdout).into_owned();
    assert!(!rules.contains("sheaf_"), "{rules}");
}
