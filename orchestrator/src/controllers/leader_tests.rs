// SPDX-License-Identifier: Apache-2.0
//! Leader election: one leader among candidates on one store (memory and
//! etcd), takeover after a crash within the lease duration, fast handover on
//! release, step-down when the store stops answering.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use k8s_openapi::api::coordination::v1::Lease;
use serde_json::Value;

use super::*;
use crate::store::etcd::server::EtcdServer;
use crate::store::etcd::{EtcdConfig, EtcdStore};
use crate::store::{
    DeleteOptions, GroupKind, ListOptions, MemoryStore, ObjectList, StoreResult, WatchOptions,
    WatchStream,
};

fn fast(identity: &str) -> LeaderElectionConfig {
    LeaderElectionConfig {
        identity: identity.into(),
        lease_duration: Duration::from_secs(2),
        renew_deadline: Duration::from_millis(1500),
        retry_period: Duration::from_millis(200),
        ..LeaderElectionConfig::new()
    }
}

/// Counts leaders doing work at once; records the most ever seen.
#[derive(Default)]
struct Work {
    active: AtomicUsize,
    most: AtomicUsize,
    starts: AtomicUsize,
}

impl Work {
    fn starter(self: &Arc<Self>) -> StartLeading {
        let w = self.clone();
        Arc::new(move || {
            let n = w.active.fetch_add(1, Ordering::SeqCst) + 1;
            w.most.fetch_max(n, Ordering::SeqCst);
            w.starts.fetch_add(1, Ordering::SeqCst);
            let w = w.clone();
            Box::new(move || {
                w.active.fetch_sub(1, Ordering::SeqCst);
            })
        })
    }
}

async fn wait_for(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what} not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t0.elapsed()
}

fn leaders(c: &[Option<LeaderElection>]) -> Vec<usize> {
    c.iter()
        .enumerate()
        .filter(|(_, e)| e.as_ref().is_some_and(|e| e.is_leader()))
        .map(|(i, _)| i)
        .collect()
}

async fn holder(store: &Arc<dyn Store>) -> String {
    let l: Lease = store
        .get_typed("kube-system", "sheaf-controller-manager")
        .await
        .unwrap();
    l.spec.unwrap().holder_identity.unwrap_or_default()
}

/// Three candidates, crash of the leader, then a release: one leader at a
/// time throughout, takeover within the lease duration plus a retry.
async fn one_leader_crash_and_release(stores: Vec<Arc<dyn Store>>) {
    let work = Arc::new(Work::default());
    let mut c: Vec<Option<LeaderElection>> = stores
        .iter()
        .enumerate()
        .map(|(i, s)| {
            Some(
                LeaderElection::spawn(s.clone(), fast(&format!("cp-{i}")), work.starter()).unwrap(),
            )
        })
        .collect();
    wait_for("a first leader", Duration::from_secs(10), || {
        leaders(&c).len() == 1
    })
    .await;
    // Stable for a few lease renewals: still one leader, the same one.
    let first = leaders(&c)[0];
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(leaders(&c), vec![first]);
    }
    assert_eq!(holder(&stores[0]).await, format!("cp-{first}"));
    assert_eq!(work.active.load(Ordering::SeqCst), 1);

    // Crash: the leader's task is aborted without releasing the Lease.
    drop(c[first].take());
    let took = wait_for("a new leader after a crash", Duration::from_secs(8), || {
        leaders(&c).len() == 1
    })
    .await;
    let second = leaders(&c)[0];
    assert_ne!(second, first);
    // Nobody takes over before the lease has run out (2 s, observed).
    assert!(
        took >= Duration::from_millis(1500),
        "takeover after {took:?}"
    );
    assert!(
        took < Duration::from_secs(4),
        "takeover after {took:?} (> 2 x lease)"
    );
    assert_eq!(holder(&stores[0]).await, format!("cp-{second}"));
    let l: Lease = stores[0]
        .get_typed("kube-system", "sheaf-controller-manager")
        .await
        .unwrap();
    assert_eq!(l.spec.unwrap().lease_transitions, Some(1));

    // Release: the last candidate takes over at its next retry.
    c[second].take().unwrap().shutdown().await;
    let took = wait_for("a leader after a release", Duration::from_secs(3), || {
        leaders(&c).len() == 1
    })
    .await;
    assert!(took < Duration::from_secs(1), "handover after {took:?}");
    assert_eq!(work.starts.load(Ordering::SeqCst), 3);
    assert_eq!(
        work.most.load(Ordering::SeqCst),
        1,
        "two leaders worked at once"
    );
    for e in c.into_iter().flatten() {
        e.shutdown().await;
    }
    assert_eq!(work.active.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn memory_store_one_leader_crash_and_release() {
    let s: Arc<dyn Store> = Arc::new(MemoryStore::new());
    one_leader_crash_and_release(vec![s.clone(), s.clone(), s]).await;
}

#[tokio::test]
async fn etcd_one_leader_crash_and_release() {
    if !std::path::Path::new("/usr/bin/etcd").exists() {
        eprintln!("SKIP: etcd not installed (run scripts/setup)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let srv = EtcdServer::start_single(dir.path()).unwrap();
    let mut stores: Vec<Arc<dyn Store>> = Vec::new();
    for _ in 0..3 {
        let s = EtcdStore::connect(EtcdConfig::new(vec![srv.client_url.clone()]))
            .await
            .unwrap();
        stores.push(Arc::new(s));
    }
    one_leader_crash_and_release(stores).await;
}

/// A store that can be cut off (every call hangs), as a partition from
/// the store would look to one control plane.
#[derive(Debug)]
struct Partitionable {
    inner: Arc<dyn Store>,
    cut: AtomicBool,
}

impl Partitionable {
    async fn gate(&self) {
        while self.cut.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[async_trait]
impl Store for Partitionable {
    async fn create(&self, kind: &GroupKind, ns: &str, obj: Value) -> StoreResult<Value> {
        self.gate().await;
        self.inner.create(kind, ns, obj).await
    }
    async fn get(&self, kind: &GroupKind, ns: &str, name: &str) -> StoreResult<Value> {
        self.gate().await;
        self.inner.get(kind, ns, name).await
    }
    async fn update(
        &self,
        kind: &GroupKind,
        ns: &str,
        obj: Value,
        scope: UpdateScope,
    ) -> StoreResult<Value> {
        self.gate().await;
        self.inner.update(kind, ns, obj, scope).await
    }
    async fn delete(
        &self,
        kind: &GroupKind,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> StoreResult<(Value, bool)> {
        self.gate().await;
        self.inner.delete(kind, ns, name, opts).await
    }
    async fn list(
        &self,
        kind: &GroupKind,
        ns: Option<&str>,
        opts: &ListOptions,
    ) -> StoreResult<ObjectList> {
        self.gate().await;
        self.inner.list(kind, ns, opts).await
    }
    async fn watch(
        &self,
        kind: &GroupKind,
        ns: Option<&str>,
        opts: &WatchOptions,
    ) -> StoreResult<WatchStream> {
        self.gate().await;
        self.inner.watch(kind, ns, opts).await
    }
    fn resource_version(&self) -> u64 {
        self.inner.resource_version()
    }
    fn oldest_watchable(&self) -> u64 {
        self.inner.oldest_watchable()
    }
}

#[tokio::test]
async fn a_leader_cut_off_from_the_store_steps_down_before_the_takeover() {
    let shared: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let a = Arc::new(Partitionable {
        inner: shared.clone(),
        cut: AtomicBool::new(false),
    });
    let work = Arc::new(Work::default());
    let ea = LeaderElection::spawn(a.clone(), fast("a"), work.starter()).unwrap();
    wait_for("a leads", Duration::from_secs(5), || ea.is_leader()).await;
    let eb = LeaderElection::spawn(shared.clone(), fast("b"), work.starter()).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(ea.is_leader() && !eb.is_leader());
    assert_eq!(eb.status().holder, "a");

    a.cut.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    wait_for("a steps down", Duration::from_secs(3), || !ea.is_leader()).await;
    let stepped_down = t0.elapsed();
    wait_for("b takes over", Duration::from_secs(5), || eb.is_leader()).await;
    let took_over = t0.elapsed();
    assert!(
        stepped_down < took_over,
        "a stepped down after {stepped_down:?}, b led after {took_over:?}"
    );
    assert!(
        stepped_down <= Duration::from_millis(1600),
        "{stepped_down:?}"
    );
    assert_eq!(
        work.most.load(Ordering::SeqCst),
        1,
        "two leaders worked at once"
    );

    // Healed: a sees b's lease and stays a candidate.
    a.cut.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!ea.is_leader() && eb.is_leader());
    assert_eq!(ea.status().holder, "b");
    assert_eq!(ea.terms(), 1);
    ea.shutdown().await;
    eb.shutdown().await;
}

#[tokio::test]
async fn bad_timings_are_refused() {
    let s: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let w = Arc::new(Work::default());
    let mut c = fast("x");
    c.renew_deadline = c.lease_duration;
    let e = LeaderElection::spawn(s.clone(), c, w.starter()).unwrap_err();
    assert!(e.contains("lease duration"), "{e}");
    let mut c = fast("x");
    c.retry_period = c.renew_deadline;
    let e = LeaderElection::spawn(s.clone(), c, w.starter()).unwrap_err();
    assert!(e.contains("retry period"), "{e}");
    let mut c = fast("");
    c.identity.clear();
    assert!(LeaderElection::spawn(s, c, w.starter()).is_err());
}
