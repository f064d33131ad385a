// SPDX-License-Identifier: Apache-2.0
//! Issue 18 item 6: the API server survives hostile clients. A slowloris
//! client (headers a byte at a time, or a TCP connection that never starts
//! TLS) is dropped after the header-read timeout; a flood of 10,000
//! connections is held to the connection cap (descriptors stay bounded) and
//! a well-behaved client is served once the flood's idle connections time
//! out, while the flood's sockets are still open.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Client, start_with};
use sheaf_orchestrator::store::MemoryStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TIMEOUT: Duration = Duration::from_secs(1);

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[tokio::test]
async fn slowloris_clients_are_dropped_after_the_header_timeout() {
    let ts = start_with(Arc::new(MemoryStore::new()), |c| {
        c.header_read_timeout = TIMEOUT;
    })
    .await;
    let c = Client::new(&ts);
    // Headers that never end, one line every 200 ms.
    let mut tls = c.tls_stream().await;
    tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")
        .await
        .unwrap();
    let t0 = Instant::now();
    let closed = loop {
        if t0.elapsed() > Duration::from_secs(10) {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        if tls.write_all(b"X-Slow: 1\r\n").await.is_err() {
            break true;
        }
        let mut b = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(10), tls.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            // A 408 or similar answer before the close is fine too.
            Ok(Ok(_)) => continue,
            Err(_) => continue,
        }
    };
    assert!(closed, "a slowloris connection was still open after 10 s");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // A TCP connection that never starts TLS.
    let mut tcp = tokio::net::TcpStream::connect(ts.server.addr)
        .await
        .unwrap();
    let mut b = [0u8; 16];
    let r = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut b)).await;
    assert!(
        matches!(r, Ok(Ok(0)) | Ok(Err(_))),
        "a silent TCP client was not dropped: {r:?}"
    );
    // Everyone else is served.
    assert_eq!(c.get("/healthz").await.status, 200);
}

#[tokio::test]
async fn a_connection_flood_is_bounded_and_the_server_recovers() {
    const CAP: usize = 256;
    const FLOOD: usize = 10_000;
    // Room for both ends of every connection in this one process.
    // SAFETY: getrlimit/setrlimit on this test process with valid structs.
    unsafe {
        let mut l = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
        // Root may raise the hard limit; otherwise what is there must do
        // (refused connections are closed at once, so the flood needs its
        // client ends plus at most CAP server ends).
        let want = libc::rlimit {
            rlim_cur: 65_536,
            rlim_max: 65_536.max(l.rlim_max),
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
            l = want;
        }
        if l.rlim_max < (FLOOD + CAP) as u64 + 1024 {
            eprintln!("SKIP: RLIMIT_NOFILE hard limit {} is too low", l.rlim_max);
            return;
        }
        l.rlim_cur = l.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &l), 0);
    }
    let ts = start_with(Arc::new(MemoryStore::new()), |c| {
        c.header_read_timeout = TIMEOUT;
        c.max_connections = CAP;
    })
    .await;
    let base = open_fds();
    let mut flood = Vec::with_capacity(FLOOD);
    for _ in 0..FLOOD {
        match tokio::net::TcpStream::connect(ts.server.addr).await {
            Ok(s) => flood.push(s),
            Err(e) => panic!("connect {}: {e}", flood.len()),
        }
    }
    // Let the server accept (and refuse) what is queued.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = open_fds();
    // This process holds the flood's client ends; the server holds at most
    // CAP server ends (plus a few for its runtime).
    assert!(
        during <= base + FLOOD + CAP + 64,
        "descriptors unbounded: {base} before, {during} with {FLOOD} connections (cap {CAP})"
    );
    // The idle flood connections time out; then a real client is served
    // even though the flood's sockets are all still open.
    tokio::time::sleep(TIMEOUT * 2).await;
    let c = Client::new(&ts);
    let t0 = Instant::now();
    loop {
        let r = tokio::time::timeout(Duration::from_secs(5), c.get("/healthz")).await;
        if matches!(&r, Ok(rep) if rep.status == 200) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "not served after the flood"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = open_fds();
    assert!(after <= base + FLOOD + 64, "{base} -> {after}");
    drop(flood);
}

/// Issue 18 item 6: per-client limits. A client over its request rate gets
/// 429 with `Retry-After` (a Kubernetes Status), then is served again once
/// its bucket refills; a client guessing tokens gets 429 instead of 401
/// after the failure cap, while the valid token from the same address is
/// still served.
#[tokio::test]
async fn clients_over_their_rate_or_guessing_tokens_get_429() {
    use sheaf_orchestrator::api::ratelimit::RateLimits;
    let ts = start_with(Arc::new(MemoryStore::new()), |c| {
        c.rate_limits = RateLimits {
            requests_per_sec: 20.0,
            burst: 20.0,
            failed_auth_per_min: 5,
        };
    })
    .await;
    let c = Client::new(&ts);
    let path = "/apis/kubevirt.io/v1/namespaces/default/virtualmachines";
    let mut codes = Vec::new();
    for _ in 0..60 {
        let r = c.get(path).await;
        if r.status == 429 {
            let retry: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
            assert!(retry >= 1, "{retry}");
            let s = r.json();
            assert_eq!(s["kind"], "Status");
            assert_eq!(s["reason"], "TooManyRequests", "{s}");
        }
        codes.push(r.status);
    }
    let limited = codes.iter().filter(|&&c| c == 429).count();
    assert!(limited > 0, "no request was limited: {codes:?}");
    assert!(codes.iter().all(|&c| c == 200 || c == 429), "{codes:?}");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(
        c.get(path).await.status,
        200,
        "served again after refilling"
    );

    let bad = Client::new(&ts).with_token(Some("not-the-token"));
    let mut codes = Vec::new();
    for _ in 0..8 {
        codes.push(bad.get(path).await.status);
    }
    assert_eq!(&codes[..5], &[401; 5], "{codes:?}");
    assert!(codes[5..].iter().all(|&c| c == 429), "{codes:?}");
    assert_eq!(
        c.get(path).await.status,
        200,
        "the valid token is not locked out"
    );
}
