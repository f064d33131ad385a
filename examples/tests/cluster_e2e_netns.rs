// SPDX-License-Identifier: Apache-2.0
//! Issue 9 with `sheaf cluster up --netns`, through the real binaries: each
//! node is its own process tree (`sheaf agent` + replica servers +
//! launchers) in a network namespace `up` creates; real `kubectl apply`
//! runs the probe VM on a 3-replica volume whose replicas listen on the
//! namespaces' addresses; the guest's writes show in the launcher's guest
//! I/O histograms on /metrics; `sheaf node kill` SIGKILLs the node's whole
//! namespace and the VM comes back on another node with every acknowledged
//! record; `node restart` brings the node back; SIGTERM leaves no process,
//! namespace or link behind; `up --netns` again brings the VM back.
//!
//! Needs root (network namespaces), /dev/kvm and kubectl; skipped with a
//! message otherwise.
#![allow(clippy::unwrap_used)]

mod common;

use common::{Cluster, acks, kubectl, last_found, ok, sheaf, vmi_node, wait_console};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Network namespaces whose name starts with `prefix`.
fn namespaces(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// Processes in network namespace `/run/netns/<name>`.
fn pids_in(name: &str) -> Vec<i32> {
    let Ok(ns) = std::fs::metadata(Path::new("/run/netns").join(name)) else {
        return Vec::new();
    };
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let m = std::fs::metadata(e.path().join("ns/net")).ok()?;
            (m.ino() == ns.ino() && m.dev() == ns.dev()).then_some(pid)
        })
        .collect()
}

/// Live processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<(i32, String)> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_string();
            (cmd.contains(needle) && state != "Z").then_some((pid, cmd))
        })
        .collect()
}

fn metrics(dir: &Path) -> String {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let client =
        sheaf_examples::client::ApiClient::from_kubeconfig(&dir.join("admin.kubeconfig")).unwrap();
    let m = rt
        .block_on(client.send("GET", "/metrics", None, bytes::Bytes::new()))
        .unwrap();
    String::from_utf8_lossy(&m.body).into_owned()
}

/// `sheaf_guest_io_seconds_count` of the demo VM's writes on `node`.
fn guest_writes(text: &str, node: &str) -> Option<u64> {
    let key = format!(
        "sheaf_guest_io_seconds_count{{volume=\"default/probe-disk\",vmi=\"default/demo\",node=\"{node}\",op=\"write\"}} "
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|n| n.trim().parse().ok())
}

/// Stops the cluster and checks nothing of it is left: no process (in
/// its namespaces or naming its data directory), namespace or link.
fn stop_and_check_clean(mut c: Cluster, dir: &Path, prefix: &str, bridge: &str) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(c.child.id() as i32, libc::SIGTERM) };
    let st = c.child.wait().unwrap();
    let out = c.out.lock().unwrap().clone();
    assert!(st.success(), "{out}");
    assert!(out.contains("no sheaf process left running"), "{out}");
    assert!(
        out.contains("Node network namespaces, veth pairs and the bridge removed"),
        "{out}"
    );
    assert!(namespaces(prefix).is_empty(), "{:?}", namespaces(prefix));
    assert!(
        !Path::new("/sys/class/net").join(bridge).exists(),
        "bridge {bridge} left"
    );
    let links: Vec<String> = std::fs::read_dir("/sys/class/net")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&format!("sh{}n", &bridge["sheaf".len()..])))
        .collect();
    assert!(links.is_empty(), "veth links left: {links:?}");
    let procs = processes_mentioning(&dir.to_string_lossy());
    assert!(procs.is_empty(), "processes left: {procs:?}");
    assert!(!dir.join("sheaf.pid").exists());
}

/// The VMI's first interface `(mac, tap)` once its status shows it, after
/// checking the tap is on the pod bridge of `node` and NAT is in place.
fn pod_interface(dir: &Path, prefix: &str, node: &str) -> (String, String) {
    let t = Instant::now();
    let (mac, tap) = loop {
        let out = kubectl(
            dir,
            &[
                "get",
                "vmi",
                "demo",
                "-o",
                "jsonpath={.status.interfaces[0].mac} {.status.interfaces[0].interfaceName} {.status.interfaces[0].name}",
            ],
        );
        let f: Vec<&str> = out.split_whitespace().collect();
        if f.len() == 3 {
            assert_eq!(f[2], "default", "{out}");
            break (f[0].to_string(), f[1].to_string());
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no status.interfaces: {out}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let ns = format!("{prefix}{node}");
    let run = |args: &[&str]| {
        let o = Command::new("ip")
            .args(["netns", "exec", &ns])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let links = run(&["ip", "-o", "link", "show", "master", "sheafpod"]);
    assert!(
        links.contains(&tap),
        "{tap} not on {node}'s pod bridge: {links}"
    );
    assert!(
        mac.starts_with("02:"),
        "a derived, locally administered MAC: {mac}"
    );
    let rules = run(&["nft", "list", "ruleset"]);
    assert!(
        rules.contains("masquerade") && rules.contains("10.244.0.0/16"),
        "{rules}"
    );
    (mac, tap)
}

/// A probe guest VM with KubeVirt's explicit masquerade interface runs
/// DHCP on the pod network: its address reaches `status.interfaces`,
/// matches what the guest printed, answers ping from its node; after its
/// node is killed it runs on another node with the same MAC and address;
/// deleting the VM removes its tap.
fn dhcp_guest(dir: &Path, prefix: &str, tmp: &tempfile::TempDir) {
    let m = tmp.path().join("netprobe.yaml");
    std::fs::write(
        &m,
        "apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: netprobe
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        memory:
          guest: 32Mi
        firmware:
          kernelBoot:
            container:
              image: sheaf.dev/probe
            kernelArgs: console=ttyS0 probe.ip=dhcp
        devices:
          interfaces:
            - name: default
              masquerade: {}
      networks:
        - name: default
          pod: {}
",
    )
    .unwrap();
    kubectl(dir, &["apply", "-f", m.to_str().unwrap()]);
    let (node, ip, mac, tap) = dhcp_state(dir, prefix, None);
    // Fail over: the same MAC and address on another node.
    let out = ok(dir, &["node", "kill", &node, "--wait"]);
    assert!(
        out.contains("netprobe") || out.contains("running on"),
        "{out}"
    );
    let (node2, ip2, mac2, tap2) = dhcp_state(dir, prefix, Some(&node));
    assert_ne!(node, node2);
    assert_eq!(
        (ip2.as_str(), mac2.as_str()),
        (ip.as_str(), mac.as_str()),
        "address and MAC follow the VM"
    );
    ok(dir, &["node", "restart", &node]);
    kubectl(
        dir,
        &["delete", "vm", "netprobe", "--wait=true", "--timeout=30s"],
    );
    let ns = format!("{prefix}{node2}");
    let t = Instant::now();
    loop {
        let o = Command::new("ip")
            .args(["-n", &ns, "-o", "link", "show"])
            .output()
            .unwrap();
        let gone = !String::from_utf8_lossy(&o.stdout).contains(&tap2);
        let vmi = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(dir.join("admin.kubeconfig"))
            .args(["get", "vmi", "netprobe"])
            .output()
            .unwrap();
        if gone && !vmi.status.success() {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "tap {tap2} left in {ns} ({tap})"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The restarted node is Ready again before the rest of the test.
    let t = Instant::now();
    loop {
        let s = ok(dir, &["status"]);
        if s.lines()
            .any(|l| l.starts_with(&node) && l.contains(" Ready"))
        {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{s}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until the netprobe VMI runs on a node other than `not_on` with an
/// address the guest took; checks console, IP column and ping from the
/// node. Returns (node, ip, mac, tap).
fn dhcp_state(dir: &Path, prefix: &str, not_on: Option<&str>) -> (String, String, String, String) {
    let t = Instant::now();
    let (node, ip, mac, tap) = loop {
        let out = kubectl(
            dir,
            &[
                "get",
                "vmi",
                "netprobe",
                "-o",
                "jsonpath={.status.nodeName} {.status.interfaces[0].ipAddress} {.status.interfaces[0].mac} {.status.interfaces[0].interfaceName}",
            ],
        );
        let f: Vec<&str> = out.split_whitespace().collect();
        if f.len() == 4 && Some(f[0]) != not_on {
            break (
                f[0].to_string(),
                f[1].to_string(),
                f[2].to_string(),
                f[3].to_string(),
            );
        }
        assert!(
            t.elapsed() < Duration::from_secs(40),
            "no address in status.interfaces: {out}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(ip.starts_with("10.244."), "{ip}");
    let ns = format!("{prefix}{node}");
    let (good, console) = sheaf(dir, &["console", "netprobe", "--no-follow"]);
    assert!(
        good && console.contains(&format!("net: dhcp {ip}\n")),
        "{console}"
    );
    let table = kubectl(dir, &["get", "vmi", "netprobe"]);
    assert!(table.contains(&ip), "the IP column: {table}");
    let p = Command::new("ip")
        .args(["netns", "exec", &ns, "ping", "-c", "3", "-W", "2", &ip])
        .output()
        .unwrap();
    assert!(
        p.status.success(),
        "ping {ip} from {ns}: {}",
        String::from_utf8_lossy(&p.stdout)
    );
    (node, ip, mac, tap)
}

/// Whether network namespaces can be created here.
fn netns_usable() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("not root".into());
    }
    let name = format!("sheaf-e2e-check-{}", std::process::id());
    let add = Command::new("ip")
        .args(["netns", "add", &name])
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if !add.status.success() {
        return Err(String::from_utf8_lossy(&add.stderr).trim().to_string());
    }
    let _ = Command::new("ip").args(["netns", "del", &name]).status();
    Ok(())
}

#[test]
fn cluster_end_to_end_netns() {
    if !Path::new("/dev/kvm").exists() {
        eprintln!("SKIP: /dev/kvm is absent; the probe guest needs KVM");
        return;
    }
    if let Err(why) = netns_usable() {
        eprintln!("SKIP: network namespaces are not usable here ({why}); --netns needs root");
        return;
    }
    if Command::new("kubectl")
        .arg("version")
        .arg("--client")
        .output()
        .is_err()
    {
        eprintln!("SKIP: kubectl is not installed (scripts/setup)");
        return;
    }
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let dir: PathBuf = tmp.path().join("data");
    let c = common::up(&dir, true);
    let banner = c.out.lock().unwrap().clone();
    assert_eq!(banner.matches("   Ready").count(), 3, "{banner}");
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("netns.json")).unwrap()).unwrap();
    let subnet = saved["subnet"].as_str().unwrap().to_string();
    let third = subnet.split('.').nth(2).unwrap().to_string();
    let prefix = format!("sheaf{third}-");
    let bridge = format!("sheaf{third}");
    let base = subnet.trim_end_matches("0/24").to_string();
    assert_eq!(namespaces(&prefix).len(), 3, "{:?}", namespaces(&prefix));
    // Every node runs in its namespace and advertises its address there.
    for i in 0..3 {
        let addr = kubectl(
            &dir,
            &[
                "get",
                "snode",
                &format!("node-{i}"),
                "-o",
                "jsonpath={.status.addresses[?(@.type==\"InternalIP\")].address}",
            ],
        );
        assert_eq!(addr.trim(), format!("{base}{}", 10 + i), "node-{i}");
        assert!(!pids_in(&format!("{prefix}node-{i}")).is_empty());
    }

    let raw = tmp.path().join("probe-disk.img");
    ok(&dir, &["image", "demo", raw.to_str().unwrap()]);
    let out = ok(
        &dir,
        &[
            "image",
            "import",
            raw.to_str().unwrap(),
            "--name",
            "probe-disk",
        ],
    );
    assert!(out.contains("raw image, 16777216 bytes"), "{out}");
    // The replicas listen on the node namespaces' addresses.
    let addrs = kubectl(
        &dir,
        &[
            "get",
            "volume",
            "probe-disk",
            "-o",
            "jsonpath={.status.replicas[*].address}",
        ],
    );
    let addrs: Vec<&str> = addrs.split_whitespace().collect();
    assert_eq!(addrs.len(), 3, "{addrs:?}");
    assert!(addrs.iter().all(|a| a.starts_with(&base)), "{addrs:?}");

    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("vm.yaml");
    kubectl(&dir, &["apply", "-f", manifest.to_str().unwrap()]);
    kubectl(
        &dir,
        &[
            "wait",
            "--for=jsonpath={.status.phase}=Running",
            "vmi/demo",
            "--timeout=60s",
        ],
    );
    let node1 = vmi_node(&dir);
    // KubeVirt's default pod interface: a tap on node1's pod bridge, MAC
    // and tap in status.interfaces (no address: the probe guest runs no
    // DHCP client), the masquerade rule in the node's namespace.
    let (mac1, tap1) = pod_interface(&dir, &prefix, &node1);
    let c1 = wait_console(&dir, "two acks", |c| acks(c).len() >= 2);
    assert_eq!(last_found(&c1), Some(8), "{c1}");

    // Guest I/O latency reached /metrics (the launcher writes it every second).
    let t = Instant::now();
    let text = loop {
        let text = metrics(&dir);
        if guest_writes(&text, &node1).is_some_and(|n| n > 0) {
            break text;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{text}");
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(text.contains("sheaf_guest_io_seconds_bucket{volume=\"default/probe-disk\""));

    // Kill the VM's node: its whole namespace dies, the VM fails over.
    let acked = *acks(&ok(&dir, &["console", "demo", "--no-follow"]))
        .iter()
        .max()
        .unwrap();
    let out = ok(&dir, &["node", "kill", &node1, "--wait"]);
    assert!(out.contains("running on"), "{out}");
    assert!(
        pids_in(&format!("{prefix}{node1}")).is_empty(),
        "processes left in {node1}'s namespace"
    );
    let node2 = vmi_node(&dir);
    assert_ne!(node1, node2);
    let (mac2, tap2) = pod_interface(&dir, &prefix, &node2);
    assert_eq!(mac1, mac2, "the MAC stays with the VM across nodes");
    assert_ne!(tap1, tap2, "a new instance, a new tap");
    let c2 = wait_console(&dir, "the new guest's log scan", |c| {
        last_found(c).is_some_and(|f| f > acked)
    });
    assert!(!c2.contains("CORRUPT"), "{c2}");
    let (good, out) = sheaf(&dir, &["node", "kill", &node1]);
    assert!(!good && out.contains("already down"), "{out}");

    // The killed node comes back.
    ok(&dir, &["node", "restart", &node1]);
    let t = Instant::now();
    loop {
        let s = ok(&dir, &["status"]);
        let line = s.lines().find(|l| l.starts_with(&node1)).unwrap_or("");
        if line.contains(" Ready") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "{s}");
        std::thread::sleep(Duration::from_millis(200));
    }

    dhcp_guest(&dir, &prefix, &tmp);

    let acked = *acks(&ok(&dir, &["console", "demo", "--no-follow"]))
        .iter()
        .max()
        .unwrap();
    stop_and_check_clean(c, &dir, &prefix, &bridge);

    // `up --netns` again: the same subnet, the VM comes back with its disk.
    let c = common::up(&dir, true);
    let c3 = wait_console(&dir, "the restarted guest's log scan", |c| {
        last_found(c).is_some_and(|f| f > acked)
    });
    assert!(!c3.contains("CORRUPT"), "{c3}");
    assert_eq!(namespaces(&prefix).len(), 3);
    stop_and_check_clean(c, &dir, &prefix, &bridge);
    eprintln!(
        "cluster end to end (netns): {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}
