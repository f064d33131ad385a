// SPDX-License-Identifier: Apache-2.0
//! Issue 23 item 2 through real processes: one etcd, three `sheaf
//! control-plane up` on one data directory, one `sheaf agent` on a
//! follower's API. Every control plane serves the API (a write through one
//! is read through the others, real kubectl); one holds the
//! `kube-system/sheaf-controller-manager` Lease and runs the controllers.
//! `kill -9` of the leader: a follower takes the Lease within 2 × the lease
//! duration, the running VM is untouched (same VMI, still Running) and a VM
//! created right after the kill gets its VMI from the new leader and runs.
//! SIGTERM of the new leader hands the Lease over at once (released).
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{SHEAF, free_port, spawn_collecting};
use sheaf_orchestrator::store::etcd::server::EtcdServer;

const LEASE: Duration = Duration::from_secs(3);

/// A child process killed (SIGKILL) on drop unless already reaped.
struct Proc {
    child: Child,
    out: Arc<Mutex<String>>,
}

impl Proc {
    fn signal(&mut self, sig: i32) {
        // SAFETY: signalling our own, not yet reaped, child process.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
    fn output(&self) -> String {
        self.out.lock().unwrap().clone()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
    }
}

/// Spawns `cmd`; returns once a line of its stdout contains `ready` (30 s).
fn spawn(cmd: Command, ready: &'static str, what: &str) -> Proc {
    let (child, out, rx) = spawn_collecting(cmd, ready);
    let p = Proc { child, out };
    if rx.recv_timeout(Duration::from_secs(30)).is_err() {
        panic!("{what} did not start:\n{}", p.output());
    }
    p
}

struct ControlPlanes {
    dir: PathBuf,
    procs: Vec<Option<Proc>>,
}

impl ControlPlanes {
    fn kubeconfig(&self, i: usize) -> PathBuf {
        self.dir
            .join(format!("control-planes/cp-{i}/admin.kubeconfig"))
    }
    /// Real kubectl against control plane `i`: (success, output).
    fn kubectl(&self, i: usize, args: &[&str]) -> (bool, String) {
        let o = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(self.kubeconfig(i))
            .args(["--request-timeout", "5s"])
            .args(args)
            .output()
            .unwrap();
        (
            o.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ),
        )
    }
    fn ok(&self, i: usize, args: &[&str]) -> String {
        let (good, out) = self.kubectl(i, args);
        assert!(good, "kubectl {args:?} on cp-{i} failed:\n{out}");
        out
    }
    /// The Lease holder as control plane `i` serves it ("" if none).
    fn holder(&self, i: usize) -> String {
        let (good, out) = self.kubectl(
            i,
            &[
                "get",
                "lease",
                "-n",
                "kube-system",
                "sheaf-controller-manager",
                "-o",
                "jsonpath={.spec.holderIdentity}",
            ],
        );
        if good {
            out.trim().to_string()
        } else {
            String::new()
        }
    }
    /// Index of the control plane named by a holder identity (`cp-N_...`).
    fn index_of(holder: &str) -> Option<usize> {
        holder.strip_prefix("cp-")?.split('_').next()?.parse().ok()
    }
    /// Waits (through control plane `via`) until the Lease names a live
    /// control plane other than `not`; returns its index.
    fn wait_leader(&self, via: usize, not: Option<usize>, within: Duration) -> usize {
        let t0 = Instant::now();
        loop {
            let h = self.holder(via);
            if let Some(i) = Self::index_of(&h)
                && Some(i) != not
                && self.procs[i].is_some()
            {
                return i;
            }
            assert!(
                t0.elapsed() < within,
                "no new leader within {within:?} (holder {h:?})"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn vmi_field(cps: &ControlPlanes, via: usize, name: &str, path: &str) -> String {
    let (_, out) = cps.kubectl(
        via,
        &["get", "vmi", name, "-o", &format!("jsonpath={{{path}}}")],
    );
    out.trim().to_string()
}

fn wait_running(cps: &ControlPlanes, via: usize, name: &str, within: Duration) -> String {
    let t0 = Instant::now();
    loop {
        if vmi_field(cps, via, name, ".status.phase") == "Running" {
            return vmi_field(cps, via, name, ".metadata.uid");
        }
        assert!(
            t0.elapsed() < within,
            "vmi {name} not Running within {within:?}: {}",
            cps.kubectl(via, &["get", "vm,vmi", "-o", "wide"]).1
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn vm_yaml(name: &str) -> String {
    format!(
        "apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: {name}
spec:
  runStrategy: Always
  template:
    spec:
      domain:
        cpu: {{cores: 1}}
        memory: {{guest: 32Mi}}
        resources: {{requests: {{cpu: 100m}}}}
        firmware:
          kernelBoot:
            container: {{image: sheaf.dev/probe}}
            kernelArgs: \"console=ttyS0 probe.token={name} probe.halt=1\"
        devices: {{}}
"
    )
}

fn apply(cps: &ControlPlanes, via: usize, dir: &Path, name: &str) {
    let f = dir.join(format!("{name}.yaml"));
    std::fs::write(&f, vm_yaml(name)).unwrap();
    cps.ok(via, &["apply", "-f", f.to_str().unwrap()]);
}

fn control_plane(dir: &Path, etcd: &str, i: usize) -> Proc {
    let mut cmd = Command::new(SHEAF);
    cmd.arg("--data-dir")
        .arg(dir)
        .args(["control-plane", "up", "--etcd", etcd])
        .args(["--name", &format!("cp-{i}")])
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--node-grace", "5"])
        .args(["--leader-elect-lease-duration", "3"])
        .args(["--leader-elect-renew-deadline", "2"])
        .args(["--leader-elect-retry-period", "0.25"]);
    spawn(cmd, "stops this control plane", &format!("cp-{i}"))
}

#[test]
fn three_control_planes_on_etcd_survive_the_leader() {
    let tmp = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start_single(&tmp.path().join("etcd")).unwrap();
    let dir = tmp.path().join("data");
    let mut cps = ControlPlanes {
        dir: dir.clone(),
        procs: (0..3)
            .map(|i| Some(control_plane(&dir, &etcd.client_url, i)))
            .collect(),
    };

    // All three serve one store: a write through each is read through the
    // others; the Lease names one of them.
    let leader = cps.wait_leader(0, None, 2 * LEASE);
    for i in 0..3 {
        // `kubectl create namespace` sends protobuf, which the API does not
        // decode; a manifest goes as JSON.
        let f = tmp.path().join(format!("ns-{i}.yaml"));
        let ns = format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: written-by-cp-{i}\n");
        std::fs::write(&f, ns).unwrap();
        cps.ok(i, &["create", "-f", f.to_str().unwrap()]);
    }
    for i in 0..3 {
        let out = cps.ok(i, &["get", "namespaces", "-o", "name"]);
        for j in 0..3 {
            assert!(out.contains(&format!("written-by-cp-{j}")), "cp-{i}: {out}");
        }
        assert_eq!(cps.holder(i), cps.holder(leader));
    }
    let leads = cps.procs[leader].as_ref().unwrap().output();
    assert!(
        leads.contains("leading: this control plane runs"),
        "{leads}"
    );
    let follower = (leader + 1) % 3;
    let out = cps.procs[follower].as_ref().unwrap().output();
    assert!(out.contains("following: leader is cp-"), "{out}");

    // One node, talking to a follower's API.
    let node_dir = dir.join("nodes/node-0");
    std::fs::create_dir_all(&node_dir).unwrap();
    let agent_log = std::fs::File::create(tmp.path().join("agent.log")).unwrap();
    let mut agent = Proc {
        child: Command::new(SHEAF)
            .arg("--data-dir")
            .arg(&node_dir)
            .arg("--kubeconfig")
            .arg(cps.kubeconfig(follower))
            .args(["agent", "--node", "node-0", "--replica-host", "127.0.0.1"])
            .arg("--secret-file")
            .arg(dir.join("secret"))
            .args(["--heartbeat-ms", "300"])
            .stdout(agent_log.try_clone().unwrap())
            .stderr(agent_log)
            .spawn()
            .unwrap(),
        out: Arc::default(),
    };
    apply(&cps, leader, tmp.path(), "before");
    let before_uid = wait_running(&cps, follower, "before", Duration::from_secs(60));

    // kill -9 the leader; a write through a follower right away; the new
    // leader's controllers turn it into a running VMI.
    let old = leader;
    cps.procs[old].as_mut().unwrap().signal(libc::SIGKILL);
    let killed = Instant::now();
    cps.procs[old] = None;
    apply(&cps, follower, tmp.path(), "after");
    let new = cps.wait_leader(follower, Some(old), 2 * LEASE + Duration::from_secs(1));
    let takeover = killed.elapsed();
    let after_uid = wait_running(&cps, follower, "after", Duration::from_secs(60));
    let after_running = killed.elapsed();
    assert!(!after_uid.is_empty());
    assert_eq!(
        wait_running(&cps, follower, "before", Duration::from_secs(5)),
        before_uid,
        "the VM running before the kill must be the same instance"
    );
    let vmis = cps.ok(follower, &["get", "vmi", "-o", "name"]);
    assert_eq!(vmis.lines().count(), 2, "{vmis}");
    let out = cps.procs[new].as_ref().unwrap().output();
    assert!(out.contains("leading: this control plane runs"), "{out}");

    // SIGTERM of the new leader releases the Lease: the last one takes it
    // well before a lease duration.
    let last = 3 - old - new;
    cps.procs[new].as_mut().unwrap().signal(libc::SIGTERM);
    let stopped = Instant::now();
    let st = cps.procs[new].as_mut().unwrap().child.wait().unwrap();
    assert!(st.success(), "cp-{new} exit: {st:?}");
    let out = cps.procs[new].take().unwrap().output();
    assert!(out.contains("stopped"), "{out}");
    assert_eq!(cps.wait_leader(last, Some(new), LEASE), last);
    let handover = stopped.elapsed();
    // The survivor's controllers work: stop `after` (runStrategy Halted).
    cps.ok(
        last,
        &[
            "patch",
            "vm",
            "after",
            "--type",
            "merge",
            "-p",
            "{\"spec\":{\"runStrategy\":\"Halted\"}}",
        ],
    );
    let t0 = Instant::now();
    while !cps
        .kubectl(last, &["get", "vmi", "after"])
        .1
        .contains("NotFound")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "vmi after not stopped"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "leader kill -9: new leader after {:.2} s (lease {:.0} s), new VM Running after {:.2} s; \
         SIGTERM hand-over {:.2} s; API on the followers never down",
        takeover.as_secs_f64(),
        LEASE.as_secs_f64(),
        after_running.as_secs_f64(),
        handover.as_secs_f64()
    );
    assert!(handover < LEASE, "a released Lease took {handover:?}");

    // Clean up: VMs first (the agent leaves launchers running when it stops).
    cps.ok(last, &["delete", "vm", "--all", "--wait=false"]);
    let t0 = Instant::now();
    while !cps
        .ok(last, &["get", "vmi", "-o", "name"])
        .trim()
        .is_empty()
    {
        assert!(t0.elapsed() < Duration::from_secs(30), "vmis not gone");
        std::thread::sleep(Duration::from_millis(100));
    }
    agent.signal(libc::SIGTERM);
    let _ = agent.child.wait();
    let log = std::fs::read_to_string(tmp.path().join("agent.log")).unwrap_or_default();
    assert!(!log.contains("panicked"), "{log}");
}
