// SPDX-License-Identifier: Apache-2.0
//! Helpers shared by the cluster end-to-end tests: run the real `sheaf`
//! binary and real `kubectl` against a cluster started with `sheaf cluster
//! up`, and read the probe guest's console records.
#![allow(dead_code, clippy::unwrap_used)]

pub mod http;

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
    // Images may come from the test's temp dir (which holds the data dir:
    // the cluster must still keep that out).
    if let Some(parent) = dir.parent() {
        cmd.arg("--image-dir").arg(parent);
    }
    cmd.args(["--nodes", "3", "--listen"])
        .arg(format!("127.0.0.1:{port}"));
    let (child, out, ready) = spawn_collecting(cmd, "Ctrl-C stops the cluster");
    let c = Cluster {
        child,
        dir: dir.to_path_buf(),
        out,
    };
    if ready.recv_timeout(Duration::from_secs(90)).is_err() {
        let log = std::fs::read_to_string(dir.join("cluster.log")).unwrap_or_default();
        panic!(
            "cluster did not come up:\n{}\n--- cluster.log ---\n{log}",
            c.out.lock().unwrap()
        );
    }
    c
}

/// Spawns `cmd` with its stdout collected line by line into the returned
/// buffer (stderr inherited); the receiver gets a message once a line
/// contains `ready`.
pub fn spawn_collecting(
    mut cmd: Command,
    ready: &'static str,
) -> (Child, Arc<Mutex<String>>, std::sync::mpsc::Receiver<()>) {
    let mut child = cmd
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
            if line.contains(ready) {
                let _ = tx.send(());
            }
            let mut g = o2.lock().unwrap();
            g.push_str(&line);
            g.push('\n');
        }
    });
    (child, out, rx)
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

/// Sends one request to the cluster's API server with real curl, the path
/// exactly as given (`--path-as-is`: no `..` folding, percent-escapes kept),
/// as the admin user: (HTTP status, body).
pub fn curl_api(dir: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    let kc = dir.join("admin.kubeconfig");
    let view = |q: &str| {
        let o = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&kc)
            .args(["config", "view", "--raw", "-o"])
            .arg(format!("jsonpath={q}"))
            .output()
            .unwrap();
        String::from_utf8(o.stdout).unwrap()
    };
    let server = view("{.clusters[0].cluster.server}");
    let token = view("{.users[?(@.name==\"sheaf-admin\")].user.token}");
    let ca = dir.join("curl-ca.pem");
    let ca_b64 = view("{.clusters[0].cluster.certificate-authority-data}");
    let ca_pem = Command::new("base64")
        .arg("-d")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(ca_b64.as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    std::fs::write(&ca, ca_pem.stdout).unwrap();
    let o = Command::new("curl")
        .args(["-sS", "--path-as-is", "-X", method, "--cacert"])
        .arg(&ca)
        .args(["-H", &format!("Authorization: Bearer {token}")])
        .args([
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            body,
        ])
        .args(["-w", "\n%{http_code}"])
        .arg(format!("{server}{path}"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// Every path under `root` except those under `skip`, with each file's
/// length: a fingerprint of what a test must leave alone.
pub fn tree(root: &Path, skip: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.starts_with(skip) {
                continue;
            }
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                todo.push(p.clone());
            }
            out.push((p, if m.is_file() { m.len() } else { 0 }));
        }
    }
    out.sort();
    out
}
