// SPDX-License-Identifier: Apache-2.0
//! Issue 18 item 6: servers keep serving after `accept()` fails because the
//! process ran out of file descriptors (EMFILE), as a client opening many
//! connections can make it. Each test lowers this test process's own
//! descriptor limit (nextest runs every test in its own process), fills it,
//! has a real client (python3, another process) connect meanwhile, frees
//! the descriptors and checks that the pending client is served and that
//! new clients still are. Before the fix the accept loop returned on the
//! first EMFILE and the listener closed.
#![allow(clippy::unwrap_used)]

mod frontend_common;

use std::io::Read;
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use frontend_common::{Cluster, NbdFixture, runtime};
use sheaf_blockrepl::volume::Volume;

/// Lowers the soft descriptor limit to just above what is open and opens
/// /dev/null until EMFILE; returns the files (drop them to free) and the old limit.
fn exhaust_fds() -> (Vec<std::fs::File>, libc::rlimit) {
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on this process with valid structs.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut old), 0);
        let low = libc::rlimit {
            rlim_cur: open + 32,
            rlim_max: old.rlim_max,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &low), 0);
    }
    let mut held = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => held.push(f),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                break;
            }
        }
    }
    (held, old)
}

fn restore(held: Vec<std::fs::File>, old: libc::rlimit) {
    drop(held);
    // SAFETY: restoring the limit read by exhaust_fds.
    unsafe { assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &old), 0) };
}

/// A python3 client that connects after 1 s and prints what it reads first.
fn python_client(connect: &str, send: &str) -> Option<Child> {
    let code = format!(
        "import socket,time,sys\ntime.sleep(1.0)\n{connect}\ns.settimeout(20)\n{send}\n\
         d=b''\nwhile len(d)<8:\n  c=s.recv(8-len(d))\n  if not c: break\n  d+=c\n\
         sys.stdout.write(d.hex())\n"
    );
    Command::new("python3")
        .arg("-c")
        .arg(code)
        .stdout(Stdio::piped())
        .spawn()
        .ok()
}

#[test]
fn nbd_server_keeps_serving_after_emfile() {
    let f = NbdFixture::new(1 << 20, 1);
    let sock = f.sock.to_str().unwrap().to_string();
    let Some(child) = python_client(
        &format!("s=socket.socket(socket.AF_UNIX)\ns.connect({sock:?})"),
        "",
    ) else {
        eprintln!("SKIP: python3 is not installed");
        return;
    };
    let (held, old) = exhaust_fds();
    // The client connects while no descriptor is free: accept fails.
    std::thread::sleep(Duration::from_secs(3));
    restore(held, old);
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        hex(b"NBDMAGIC"),
        "the client that connected during EMFILE was never served"
    );
    // And new clients are served.
    let mut s = UnixStream::connect(&f.sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut g = [0u8; 8];
    s.read_exact(&mut g).unwrap();
    assert_eq!(&g, b"NBDMAGIC");
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn replica_server_keeps_serving_after_emfile() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(tmp.path(), 1, 1 << 20);
    let addr = cluster.nodes[0].addr;
    // Sends a wrong magic: the server answers by closing, which the client
    // sees only if it was accepted (an empty read, printed as "").
    let Some(child) = python_client(
        &format!(
            "s=socket.create_connection(({:?},{}))",
            addr.ip().to_string(),
            addr.port()
        ),
        "s.sendall(b'NOTSHEAF'*8)",
    ) else {
        eprintln!("SKIP: python3 is not installed");
        return;
    };
    let (held, old) = exhaust_fds();
    std::thread::sleep(Duration::from_secs(3));
    restore(held, old);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "client: {out:?}");
    // The server still serves a real engine: write, read back.
    let rt = runtime();
    rt.block_on(async {
        let vol = Volume::attach(cluster.config()).await.unwrap();
        vol.write(4096, bytes::Bytes::from(vec![7u8; 4096]))
            .await
            .unwrap();
        vol.flush().await.unwrap();
        assert_eq!(
            vol.read(4096, 4096).await.unwrap().to_vec(),
            vec![7u8; 4096]
        );
        vol.detach().await.unwrap();
    });
}
