// SPDX-License-Identifier: Apache-2.0
//! One server per replica directory: a second `sheaf-replica` process (or a
//! second in-process replica) on a directory already served is refused,
//! naming the directory and the holder's pid, instead of both writing the
//! same store; once the first is gone the directory opens again.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sheaf_blockrepl::Error;
use sheaf_blockrepl::volume::{create_replica, lock_replica_dir, open_local_replica};

fn start(dir: &std::path::Path, secret: &std::path::Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_sheaf-replica"))
        .arg("--dir")
        .arg(dir)
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--secret-file")
        .arg(secret)
        .arg("--create-size")
        .arg((64 * 4096).to_string())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for the listening line; returns everything read.
fn wait_listening(c: &mut Child) -> String {
    let mut lines = BufReader::new(c.stderr.take().unwrap()).lines();
    let mut seen = String::new();
    for l in lines.by_ref() {
        let l = l.unwrap();
        seen.push_str(&l);
        seen.push('\n');
        if l.contains("listening on") {
            // Keep draining so the child never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines {});
            return seen;
        }
    }
    panic!("replica exited before listening:\n{seen}");
}

#[test]
fn a_second_server_on_one_replica_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r0");
    let secret = tmp.path().join("secret");
    std::fs::write(&secret, b"a test secret of enough bytes\n").unwrap();

    let mut first = start(&dir, &secret);
    wait_listening(&mut first);
    let second = start(&dir, &secret);
    let out = second.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the second server ran:\n{err}");
    assert!(
        err.contains("already open") && err.contains(&format!("(pid {})", first.id())),
        "{err}"
    );
    // The library call the servers use says the same.
    let e = lock_replica_dir(&dir, Duration::ZERO).unwrap_err();
    assert!(matches!(e, Error::DirInUse { .. }), "{e}");
    assert!(
        e.to_string().contains(&format!("(pid {})", first.id())),
        "{e}"
    );

    first.kill().unwrap();
    first.wait().unwrap();
    let mut third = start(&dir, &secret);
    wait_listening(&mut third);
    third.kill().unwrap();
    third.wait().unwrap();
}

#[test]
fn the_lock_is_released_with_its_holder() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r0");
    create_replica(&dir, 64 * 4096).unwrap();
    let lock = lock_replica_dir(&dir, Duration::ZERO).unwrap();
    assert!(matches!(
        lock_replica_dir(&dir, Duration::from_millis(50)).unwrap_err(),
        Error::DirInUse { .. }
    ));
    // A waiting opener gets it as soon as the holder lets go.
    let d = dir.clone();
    let waiter = std::thread::spawn(move || lock_replica_dir(&d, Duration::from_secs(10)));
    std::thread::sleep(Duration::from_millis(100));
    drop(lock);
    let _again = waiter.join().unwrap().unwrap();
    // The in-process replica (tests restart those on one directory) does not
    // take it.
    let r = open_local_replica(&dir).unwrap();
    drop(r);
}
