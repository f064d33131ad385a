// SPDX-License-Identifier: Apache-2.0
//! Load: N concurrent watchers (default 50) and M writes (default 1,000) over
//! HTTPS; every watcher must see every write exactly once, in order. Prints
//! figures. Sizes: SHEAF_LOAD_WATCHERS, SHEAF_LOAD_WRITES; SHEAF_LOAD_STORE=redb
//! runs it on the persistent store.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Client, start_with};
use serde_json::json;
use sheaf_orchestrator::store::{MemoryStore, RedbStore, Store};

const VMS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachines";
const WRITERS: usize = 4;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_see_every_write_exactly_once() {
    let watchers = env_or("SHEAF_LOAD_WATCHERS", 50);
    let writes = env_or("SHEAF_LOAD_WRITES", 1000) / (2 * WRITERS) * (2 * WRITERS);
    let tmp = tempfile::tempdir().unwrap();
    let use_redb = std::env::var("SHEAF_LOAD_STORE").is_ok_and(|v| v == "redb");
    let store: Arc<dyn Store> = if use_redb {
        Arc::new(RedbStore::open(tmp.path().join("load.redb")).unwrap())
    } else {
        Arc::new(MemoryStore::new())
    };
    let ts = start_with(store, |_| {}).await;
    let client = Arc::new(Client::new(&ts));
    let start_rv = client.get(VMS).await.json()["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();

    // Watchers record (rv, type, receipt time).
    type Seen = Vec<(u64, String, Instant)>;
    let mut handles = Vec::new();
    for _ in 0..watchers {
        let mut rx = client
            .watch(&format!(
                "{VMS}?watch=1&resourceVersion={start_rv}&timeoutSeconds=120"
            ))
            .await;
        handles.push(tokio::spawn(async move {
            let mut seen: Seen = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(120);
            while seen.len() < writes && Instant::now() < deadline {
                match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
                    Ok(Some(ev)) => {
                        let rv: u64 = ev["object"]["metadata"]["resourceVersion"]
                            .as_str()
                            .unwrap()
                            .parse()
                            .unwrap();
                        seen.push((rv, ev["type"].as_str().unwrap().to_string(), Instant::now()));
                    }
                    _ => break,
                }
            }
            // Anything extra (a duplicate) arriving shortly after counts too.
            if let Ok(Some(ev)) = tokio::time::timeout(Duration::from_millis(200), rx.recv()).await
            {
                let rv: u64 = ev["object"]["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap_or("0")
                    .parse()
                    .unwrap_or(0);
                seen.push((
                    rv,
                    ev["type"].as_str().unwrap_or("?").to_string(),
                    Instant::now(),
                ));
            }
            seen
        }));
    }

    // Writers: each creates objects, then patches each once.
    let done_at: Arc<Mutex<HashMap<u64, (String, Instant)>>> = Arc::new(Mutex::new(HashMap::new()));
    let t0 = Instant::now();
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let client = client.clone();
        let done_at = done_at.clone();
        let per = writes / WRITERS / 2;
        writers.push(tokio::spawn(async move {
            let mut conn = client.connect().await;
            let record = |r: &common::Reply, t: &str| {
                assert!(r.status == 200 || r.status == 201, "{}", String::from_utf8_lossy(&r.body));
                let rv: u64 = r.json()["metadata"]["resourceVersion"].as_str().unwrap().parse().unwrap();
                done_at.lock().unwrap().insert(rv, (t.to_string(), Instant::now()));
            };
            for i in 0..per {
                let vm = json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": format!("load-{w}-{i}")},
                    "spec": {"runStrategy": "Halted", "template": {"spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}}}}}});
                let r = Client::send_on(&mut conn, client.build("POST", VMS, Some("application/json"), serde_json::to_vec(&vm).unwrap(), None)).await;
                record(&r, "ADDED");
            }
            for i in 0..per {
                let p = br#"{"spec":{"runStrategy":"Always"}}"#.to_vec();
                let r = Client::send_on(&mut conn, client.build("PATCH", &format!("{VMS}/load-{w}-{i}"), Some("application/merge-patch+json"), p, None)).await;
                record(&r, "MODIFIED");
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let write_time = t0.elapsed();
    let mut all_seen = Vec::new();
    for h in handles {
        all_seen.push(h.await.unwrap());
    }
    let drain_time = t0.elapsed();

    let done = done_at.lock().unwrap().clone();
    assert_eq!(
        done.len(),
        writes,
        "every write returned a distinct resourceVersion"
    );
    let mut expected: Vec<(u64, String)> =
        done.iter().map(|(rv, (t, _))| (*rv, t.clone())).collect();
    expected.sort();
    let mut missed = 0usize;
    let mut duplicated = 0usize;
    let mut latencies = Vec::new();
    for seen in &all_seen {
        let got: Vec<(u64, String)> = seen.iter().map(|(rv, t, _)| (*rv, t.clone())).collect();
        let mut uniq = got.clone();
        uniq.dedup();
        duplicated +=
            got.len().saturating_sub(uniq.len()) + got.len().saturating_sub(writes).min(1);
        missed += expected.iter().filter(|e| !got.contains(e)).count();
        assert!(
            got.windows(2).all(|w| w[0].0 < w[1].0),
            "events in resourceVersion order"
        );
        for (rv, _, at) in seen {
            if let Some((_, wrote)) = done.get(rv) {
                latencies.push(at.saturating_duration_since(*wrote));
            }
        }
    }
    latencies.sort();
    let delivered: usize = all_seen.iter().map(Vec::len).sum();
    println!(
        "api_load: store={} watchers={watchers} writes={writes} write_time={:.2}s writes_per_s={:.0} events_delivered={delivered} \
         all_drained={:.2}s delivery_latency_p50={:.1}ms p99={:.1}ms max={:.1}ms missed={missed} duplicated={duplicated}",
        if use_redb { "redb" } else { "memory" },
        write_time.as_secs_f64(),
        writes as f64 / write_time.as_secs_f64(),
        drain_time.as_secs_f64(),
        pct(&latencies, 0.5).as_secs_f64() * 1e3,
        pct(&latencies, 0.99).as_secs_f64() * 1e3,
        latencies.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );
    assert_eq!(missed, 0, "missed watch events");
    assert_eq!(duplicated, 0, "duplicated watch events");
    assert_eq!(delivered, watchers * writes);
    ts.server.shutdown().await;
}
