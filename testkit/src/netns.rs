// SPDX-License-Identifier: Apache-2.0
//! Network namespaces for tests (root only): created with `ip netns add`,
//! deleted on drop with everything in them.

use std::os::fd::AsRawFd;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

/// A named network namespace (`/run/netns/NAME`), `lo` up.
#[derive(Debug)]
pub struct NetNs(pub String);

/// Runs `cmd ARGS`; panics with its stderr when it fails; returns stdout.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl NetNs {
    /// A new namespace named after the test process, `tag` and a counter.
    pub fn new(tag: &str) -> NetNs {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "sheaf-t{}-{tag}{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        run("ip", &["netns", "add", &name]);
        let ns = NetNs(name);
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// `ip -n NAME ARGS` (panics on failure); stdout.
    pub fn ip(&self, args: &[&str]) -> String {
        let mut a = vec!["-n", self.0.as_str()];
        a.extend_from_slice(args);
        run("ip", &a)
    }

    /// `ip netns exec NAME CMD...`, whatever its status.
    pub fn exec(&self, cmd: &[&str]) -> Output {
        let mut a = vec!["netns", "exec", self.0.as_str()];
        a.extend_from_slice(cmd);
        Command::new("ip")
            .args(&a)
            .output()
            .unwrap_or_else(|e| panic!("ip netns exec: {e}"))
    }

    /// Runs `f` on a new thread that entered the namespace, so taps and
    /// sockets it creates (and programs it spawns) live there.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            // SAFETY: setns on an open namespace file; affects this thread only.
            let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
    }

    /// [`NetNs::spawn`] and wait for the result.
    pub fn enter<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        match self.spawn(f).join() {
            Ok(v) => v,
            Err(p) => std::panic::resume_unwind(p),
        }
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}
