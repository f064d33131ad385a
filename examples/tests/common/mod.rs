// SPDX-License-Identifier: Apache-2.0
//! Helpers shared by the cluster end-to-end tests: run the real `sheaf`
//! binary and real `kubectl` against a cluster started with `sheaf cluster
//! up`, and read the probe guest's console records.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const SHEAF: &str = env!("CARGO_BIN_EXE_sheaf");

/// A running `sheaf cluster up`; SIGTERMed on drop if still running.
pub struct Cluster {
    pub child: Child,
    pub dir: PathBuf,
    /// Everything `up` printed on stdout so far.
    pub out: Arc<Mutex<String>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return; // already reaped: its pid may belong to someone else now
        }
        // SAFETY: signalling our own, not yet reaped, child process.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// Runs `sheaf --data-dir DIR ARGS`: (success, stdout + stderr).
pub fn sheaf(dir: &Path, args: &[&str]) -> (bool, String) {
    run(Command::new(SHEAF).arg("--data-dir").arg(dir).args(args))
}

/// Runs `cmd` to completion: (success, stdout + stderr).
fn run(cmd: &mut Command) -> (bool, String) {
    let o = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

/// Like [`sheaf`], asserting success.
pub fn ok(dir: &Path, args: &[&str]) -> String {
    let (good, text) = sheaf(dir, args);
    assert!(good, "sheaf {args:?} failed:\n{text}");
    text
}

/// Runs real kubectl with the cluster's admin kubeconfig, asserting success.
pub fn kubectl(dir: &Path, args: &[&str]) -> String {
    let (good, text) = run(Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(dir.join("admin.kubeconfig"))
        .args(args));
    assert!(good, "kubectl {args:?} failed:\n{text}");
    text
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `sheaf cluster up --nodes 3` (with `--netns` when asked) on a free
/// port; returns once the banner says the cluster is up.
pub fn up(dir: &Path, netns: bool) -> Cluster {
    let port = free_port();
    let mut cmd = Command::new(SHEAF);
    cmd.arg("--data-dir").arg(dir).args(["cluster", "up"]);
    if netns {
        cmd.arg("--netns");
    }
    let mut child = cmd
        .args(["--nodes", "3", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let out = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let o2 = out.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.contains("Ctrl-C stops the cluster") {
                let _ = tx.send(());
            }
            let mut g = o2.lock().unwrap();
            g.push_str(&line);
            g.push('\n');
        }
    });
    let c = Cluster {
        child,
        dir: dir.to_path_buf(),
        out,
    };
    if rx.recv_timeout(Duration::from_secs(90)).is_err() {
        let log = std::fs::read_to_string(dir.join("cluster.log")).unwrap_or_default();
        panic!(
            "cluster did not come up:\n{}\n--- cluster.log ---\n{log}",
            c.out.lock().unwrap()
        );
    }
    c
}

/// Polls the `demo` VMI's console until `pred` holds (60 s).
pub fn wait_console(dir: &Path, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let (good, c) = sheaf(dir, &["console", "demo", "--no-follow"]);
        if good && pred(&c) {
            return c;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "console never showed {what}:\n{c}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The record numbers the guest acknowledged (`log: ack N`).
pub fn acks(c: &str) -> Vec<u64> {
    c.lines()
        .filter_map(|l| l.trim().strip_prefix("log: ack "))
        .filter_map(|n| n.trim().parse().ok())
        .collect()
}

/// The last `log: found N records` (a console may hold several boots).
pub fn last_found(c: &str) -> Option<u64> {
    c.lines().rev().find_map(|l| {
        l.trim()
            .strip_prefix("log: found ")?
            .strip_suffix(" records")?
            .parse()
            .ok()
    })
}

/// The node the `demo` VMI runs on.
pub fn vmi_node(dir: &Path) -> String {
    kubectl(
        dir,
        &["get", "vmi", "demo", "-o", "jsonpath={.status.nodeName}"],
    )
    .trim()
    .to_string()
}
