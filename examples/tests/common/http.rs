// SPDX-License-Identifier: Apache-2.0
//! A tiny HTTP/1.1 file server on 127.0.0.1 for the import tests: each
//! path maps to a canned reply (status, headers, body, optionally cut short
//! after N bytes while announcing the full length).
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};

/// One canned reply.
#[derive(Clone, Debug, Default)]
pub struct Reply {
    /// Status line after `HTTP/1.1 `, e.g. `200 OK`.
    pub status: String,
    /// Extra headers.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: Vec<u8>,
    /// Close the connection after this many body bytes (Content-Length
    /// still says the full length).
    pub cut_after: Option<usize>,
}

impl Reply {
    /// `200 OK` with `body`.
    pub fn ok(body: Vec<u8>) -> Reply {
        Reply {
            status: "200 OK".into(),
            body,
            ..Default::default()
        }
    }
    /// A redirect to `to`.
    pub fn redirect(to: &str) -> Reply {
        Reply {
            status: "302 Found".into(),
            headers: vec![("Location".into(), to.into())],
            ..Default::default()
        }
    }
}

/// The server: routes can be added while it runs; requests are counted.
#[derive(Clone, Debug)]
pub struct Server {
    pub addr: SocketAddr,
    routes: Arc<Mutex<HashMap<String, Reply>>>,
    pub hits: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts serving on an ephemeral port of 127.0.0.1.
    pub fn start() -> Server {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let routes: Arc<Mutex<HashMap<String, Reply>>> = Arc::default();
        let hits: Arc<Mutex<Vec<String>>> = Arc::default();
        let (r2, h2) = (routes.clone(), hits.clone());
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut c) = conn else { continue };
                let (routes, hits) = (r2.clone(), h2.clone());
                std::thread::spawn(move || {
                    let mut rd = BufReader::new(c.try_clone().unwrap());
                    let mut line = String::new();
                    if rd.read_line(&mut line).is_err() {
                        return;
                    }
                    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
                    loop {
                        let mut h = String::new();
                        if rd.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                            break;
                        }
                    }
                    hits.lock().unwrap().push(path.clone());
                    let reply = routes.lock().unwrap().get(&path).cloned().unwrap_or(Reply {
                        status: "404 Not Found".into(),
                        body: b"not found\n".to_vec(),
                        ..Default::default()
                    });
                    let mut head = format!(
                        "HTTP/1.1 {}\r\nContent-Length: {}\r\nConnection: close\r\n",
                        reply.status,
                        reply.body.len()
                    );
                    for (k, v) in &reply.headers {
                        head.push_str(&format!("{k}: {v}\r\n"));
                    }
                    head.push_str("\r\n");
                    let _ = c.write_all(head.as_bytes());
                    let n = reply
                        .cut_after
                        .unwrap_or(reply.body.len())
                        .min(reply.body.len());
                    for chunk in reply.body[..n].chunks(64 << 10) {
                        if c.write_all(chunk).is_err() {
                            return;
                        }
                    }
                    let _ = c.flush();
                });
            }
        });
        Server { addr, routes, hits }
    }

    /// Serves `reply` at `path`.
    pub fn route(&self, path: &str, reply: Reply) {
        self.routes.lock().unwrap().insert(path.into(), reply);
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}
