// SPDX-License-Identifier: Apache-2.0
//! Downloads against a local HTTP server on 127.0.0.1.
#![allow(clippy::unwrap_used)]

use super::*;

#[path = "../tests/common/http.rs"]
mod http;

use http::{Reply, Server};

fn sha256_hex(b: &[u8]) -> String {
    let mut h = Hasher::new("sha256");
    h.update(b);
    h.hex()
}

fn sha512_hex(b: &[u8]) -> String {
    let mut h = Hasher::new("sha512");
    h.update(b);
    h.hex()
}

fn left(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

async fn get(
    url: &str,
    dir: &Path,
    checksum: Option<&str>,
    limits: &DownloadLimits,
) -> Result<TempDownload, DownloadError> {
    let (tx, mut rx) = mpsc::channel(1024);
    let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
    let r = download(url, dir, "t", checksum, limits, &tx).await;
    drop(tx);
    let _ = drain.await;
    r
}

#[tokio::test]
async fn downloads_follow_redirects_and_check_digests() {
    let s = Server::start();
    let d = tempfile::tempdir().unwrap();
    let body: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    s.route("/img", Reply::ok(body.clone()));
    s.route("/a/r1", Reply::redirect("r2"));
    s.route("/a/r2", Reply::redirect("/img"));
    let lim = DownloadLimits::default();

    let sum = format!("sha256:{}", sha256_hex(&body));
    let got = get(&s.url("/a/r1"), d.path(), Some(&sum), &lim)
        .await
        .unwrap();
    assert_eq!(got.bytes, body.len() as u64);
    assert_eq!(std::fs::read(&got.path).unwrap(), body);
    assert_eq!(got.digest.as_deref(), Some(sum.as_str()));
    let p = got.path.clone();
    drop(got);
    assert!(!p.exists(), "removed when dropped");

    let sum512 = format!("SHA512:{}", sha512_hex(&body).to_uppercase());
    assert!(
        get(&s.url("/img"), d.path(), Some(&sum512), &lim)
            .await
            .is_ok()
    );

    // A wrong digest: refused, nothing left.
    let bad = format!("sha256:{}", "0".repeat(64));
    let e = get(&s.url("/img"), d.path(), Some(&bad), &lim)
        .await
        .unwrap_err();
    assert!(
        matches!(e, DownloadError::Checksum { .. }) && e.to_string().contains("checksum mismatch"),
        "{e}"
    );
    assert!(left(d.path()).is_empty(), "{:?}", left(d.path()));
    let e = get(&s.url("/img"), d.path(), Some("md5:abc"), &lim)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("only sha256 and sha512"), "{e}");
}

#[tokio::test]
async fn bad_sources_fail_clearly_and_leave_nothing() {
    let s = Server::start();
    let d = tempfile::tempdir().unwrap();
    let body = vec![7u8; 1 << 20];
    s.route("/img", Reply::ok(body.clone()));
    s.route("/empty", Reply::ok(Vec::new()));
    s.route(
        "/cut",
        Reply {
            cut_after: Some(100_000),
            ..Reply::ok(body.clone())
        },
    );
    s.route("/to-file", Reply::redirect("file:///etc/shadow"));
    s.route("/loop", Reply::redirect("/loop"));
    s.route(
        "/500",
        Reply {
            status: "500 Internal Server Error".into(),
            ..Default::default()
        },
    );
    let lim = DownloadLimits {
        connect_timeout: Duration::from_secs(2),
        ..Default::default()
    };

    let e = get(&s.url("/missing"), d.path(), None, &lim)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("HTTP 404 Not Found"), "{e}");
    let e = get(&s.url("/500"), d.path(), None, &lim).await.unwrap_err();
    assert!(e.to_string().contains("HTTP 500"), "{e}");
    let e = get(&s.url("/empty"), d.path(), None, &lim)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("empty file"), "{e}");
    let e = get(&s.url("/cut"), d.path(), None, &lim).await.unwrap_err();
    assert!(matches!(e, DownloadError::Protocol { .. }), "{e}");
    let e = get(&s.url("/to-file"), d.path(), None, &lim)
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("\"file\" is not allowed"),
        "redirect to file:// refused: {e}"
    );
    let e = get(&s.url("/loop"), d.path(), None, &lim)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("more than 5 redirects"), "{e}");
    let small = DownloadLimits {
        max_bytes: 1000,
        ..lim.clone()
    };
    let e = get(&s.url("/img"), d.path(), None, &small)
        .await
        .unwrap_err();
    assert!(matches!(e, DownloadError::TooLarge { .. }), "{e}");
    for u in ["file:///etc/shadow", "ftp://127.0.0.1/x", "/etc/shadow"] {
        let e = get(u, d.path(), None, &lim).await.unwrap_err();
        assert!(matches!(e, DownloadError::Url(_)), "{u}: {e}");
    }
    // Nothing listens on this port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = get(&format!("http://127.0.0.1:{port}/x"), d.path(), None, &lim)
        .await
        .unwrap_err();
    assert!(
        matches!(e, DownloadError::Connect { .. }) && e.to_string().contains("cannot connect"),
        "{e}"
    );
    assert!(left(d.path()).is_empty(), "{:?}", left(d.path()));
}

#[tokio::test]
async fn a_stalled_server_times_out() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming().flatten() {
            held.push(c); // accept, never answer
        }
    });
    let d = tempfile::tempdir().unwrap();
    let lim = DownloadLimits {
        idle_timeout: Duration::from_millis(500),
        ..Default::default()
    };
    let e = get(&format!("http://{addr}/x"), d.path(), None, &lim)
        .await
        .unwrap_err();
    assert!(matches!(e, DownloadError::Timeout { .. }), "{e}");
}

#[test]
fn locations_resolve() {
    let b: Uri = "http://h:1/a/b/c.img?x=1".parse().unwrap();
    assert_eq!(resolve_location(&b, "d.img"), "http://h:1/a/b/d.img");
    assert_eq!(resolve_location(&b, "/d.img"), "http://h:1/d.img");
    assert_eq!(resolve_location(&b, "//o/d.img"), "http://o/d.img");
    assert_eq!(resolve_location(&b, "https://o/d"), "https://o/d");
}
