// SPDX-License-Identifier: Apache-2.0
//! A [`Store`](super::Store) on etcd (v3 API, through `etcd-client`), so
//! several API servers can share one replicated control-plane store.
//!
//! ```text
//!   get / list ──► etcd range (linearizable)            resourceVersion = mod_revision
//!   write ──► prepare against the cache ──► etcd txn: compare mod_revision of
//!             every changed key, then put/delete ──► wait until the feed applied it
//!   etcd watch (prefix, prev_kv) ──► feed ──► cache (objects + history) ──► watches
//!   watch from a version older than the cache ──► its own etcd watch (compacted → 410)
//! ```
//!
//! Objects are stored as JSON under `{prefix}{group}/{kind}/{namespace}/{name}`
//! without `metadata.resourceVersion`, which is the key's etcd `mod_revision`.
//! The cache never decides a write on its own: a stale cache only makes the
//! txn's compare fail, and the write is prepared again once the feed has
//! caught up. One write batch (an object and the dependents its deletion
//! removes) is one etcd txn, so its events share one revision.
//!
//! The etcd server must allow the largest object and batch: start it with
//! `--max-request-bytes` above [`super::MAX_OBJECT_BYTES`] and `--max-txn-ops`
//! above the largest cascade (as [`EtcdServer`](server::EtcdServer) does).

pub mod server;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType as EtcdEvent, GetOptions, KeyValue,
    KvClient, Txn as EtcdTxn, TxnOp, TxnOpResponse, WatchOptions as EtcdWatchOptions,
};
use futures::StreamExt;
use serde_json::Value;

use super::core::remote::{Prepared, RemoteChange, rv_of, set_rv, watch_filter};
use super::core::{Change, Core, NoBackend, ObjKey, State, list_in, obj_key};
use super::memory::DEFAULT_HISTORY;
use super::{
    DeleteOptions, EventType, GroupKind, ListOptions, ObjectList, Store, StoreError, StoreResult,
    UpdateScope, WatchOptions, WatchStream,
};

/// The largest gRPC message read (a page of objects, or one big object).
const MAX_MESSAGE: usize = 64 << 20;
/// Page size of the initial load.
const PAGE: i64 = 500;

/// How to reach etcd.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Client URLs of the members (`http://127.0.0.1:2379`).
    pub endpoints: Vec<String>,
    /// Key prefix of this cluster's objects (several clusters can share etcd).
    pub prefix: String,
    /// Timeout of one etcd call.
    pub timeout: Duration,
    /// Events kept in the cache for watches that resume from a version.
    pub history: usize,
}

impl EtcdConfig {
    /// Defaults for `endpoints`: prefix `/sheaf/`, 10 s calls.
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            prefix: "/sheaf/".into(),
            timeout: Duration::from_secs(10),
            history: DEFAULT_HISTORY,
        }
    }
}

fn etcd_err(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("etcd: {e}"))
}

struct Inner {
    core: Arc<Core<NoBackend>>,
    kv: KvClient,
    client: Client,
    cfg: EtcdConfig,
    writes: tokio::sync::Mutex<()>,
    feed: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.feed.abort();
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.cfg.endpoints)
            .field("prefix", &self.cfg.prefix)
            .finish()
    }
}

/// A [`Store`] on etcd. Cloning is cheap and shares the connection and cache.
#[derive(Clone, Debug)]
pub struct EtcdStore(Arc<Inner>);

impl EtcdStore {
    /// Connects, loads every object under the prefix and starts following
    /// etcd's watch.
    pub async fn connect(cfg: EtcdConfig) -> StoreResult<Self> {
        if !cfg.prefix.starts_with('/') || !cfg.prefix.ends_with('/') {
            return Err(StoreError::BadRequest(format!(
                "etcd prefix {:?} must start and end with '/'",
                cfg.prefix
            )));
        }
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(5));
        let client = tokio::time::timeout(cfg.timeout, Client::connect(&cfg.endpoints, Some(opts)))
            .await
            .map_err(|_| etcd_err(format!("no answer from {:?}", cfg.endpoints)))?
            .map_err(etcd_err)?;
        let kv = client
            .kv_client()
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let core = Arc::new(Core::new(State::default(), NoBackend, cfg.history));
        let rev = load(&core, &kv, &cfg).await?;
        let feed = tokio::spawn(feed(core.clone(), client.clone(), cfg.clone(), rev));
        tracing::info!(endpoints = ?cfg.endpoints, prefix = %cfg.prefix, rev, "opened etcd store");
        Ok(Self(Arc::new(Inner {
            core,
            kv,
            client,
            cfg,
            writes: tokio::sync::Mutex::new(()),
            feed,
        })))
    }

    /// Entries under the prefix that could not be read (skipped, left in etcd).
    pub fn unreadable(&self) -> Vec<String> {
        self.0.core.unreadable()
    }

    /// The etcd prefix of a kind's objects (in one namespace).
    fn kind_prefix(&self, gk: &GroupKind, ns: Option<&str>) -> String {
        match ns {
            Some(ns) => format!("{}{}/{}/{}/", self.0.cfg.prefix, gk.group, gk.kind, ns),
            None => format!("{}{}/{}/", self.0.cfg.prefix, gk.group, gk.kind),
        }
    }

    fn key(&self, k: &ObjKey) -> String {
        format!("{}{}/{}/{}/{}", self.0.cfg.prefix, k.0, k.1, k.2, k.3)
    }

    async fn call<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> StoreResult<T> {
        tokio::time::timeout(self.0.cfg.timeout, f)
            .await
            .map_err(|_| etcd_err(format!("no answer within {:?}", self.0.cfg.timeout)))?
            .map_err(etcd_err)
    }

    /// Waits until the cache holds version `rv` (a version a client saw).
    async fn catch_up(&self, rv: Option<u64>) {
        if let Some(rv) = rv {
            self.0
                .core
                .wait_until(self.0.cfg.timeout, |st| st.rv >= rv)
                .await;
        }
    }

    /// Commits a prepared write as one etcd txn, preparing it again while the
    /// cache turns out to be stale. `patch` sets the committed version.
    async fn commit<R>(
        &self,
        mut prepare: impl FnMut() -> StoreResult<Prepared<R>>,
        patch: impl Fn(&mut R, u64),
    ) -> StoreResult<R> {
        let _serial = self.0.writes.lock().await;
        for _ in 0..16 {
            let p = prepare()?;
            if p.changes.is_empty() {
                return Ok(p.result);
            }
            let mut compares = Vec::new();
            let mut reads = Vec::new();
            for (k, expected) in &p.expected {
                let key = self.key(k);
                compares.push(match expected {
                    Some(rv) => Compare::mod_revision(key.clone(), CompareOp::Equal, *rv as i64),
                    None => Compare::version(key.clone(), CompareOp::Equal, 0),
                });
                reads.push(TxnOp::get(key, Some(GetOptions::new().with_keys_only())));
            }
            let mut ops = Vec::new();
            for c in &p.changes {
                match c {
                    Change::Put(k, v) => {
                        let mut v = (**v).clone();
                        if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
                            m.remove("resourceVersion");
                        }
                        let bytes = serde_json::to_vec(&v).map_err(etcd_err)?;
                        ops.push(TxnOp::put(self.key(k), bytes, None));
                    }
                    Change::Remove(k) => ops.push(TxnOp::delete(self.key(k), None)),
                }
            }
            let txn = EtcdTxn::new().when(compares).and_then(ops).or_else(reads);
            let mut kv = self.0.kv.clone();
            let resp = self.call(kv.txn(txn)).await?;
            let rev = resp.header().map_or(0, |h| h.revision()).max(0) as u64;
            if resp.succeeded() {
                let seen = self
                    .0
                    .core
                    .wait_until(self.0.cfg.timeout, |st| st.rv >= rev)
                    .await;
                if !seen {
                    tracing::warn!(rev, "etcd write committed but not yet seen by the watch");
                }
                let mut result = p.result;
                patch(&mut result, rev);
                return Ok(result);
            }
            // Some key changed since the cache read it: wait for the feed to
            // deliver the versions etcd holds now, then prepare again.
            let mut current: Vec<(ObjKey, Option<u64>)> = Vec::new();
            for ((k, _), r) in p.expected.iter().zip(resp.op_responses()) {
                if let TxnOpResponse::Get(g) = r {
                    current.push((
                        k.clone(),
                        g.kvs().first().map(|kv| kv.mod_revision() as u64),
                    ));
                }
            }
            let caught = self
                .0
                .core
                .wait_until(self.0.cfg.timeout, |st| {
                    current.iter().all(|(k, v)| match v {
                        Some(v) => st.rv >= *v,
                        None => !st.objects.contains_key(k) || st.rv >= rev,
                    })
                })
                .await;
            if !caught {
                return Err(etcd_err(
                    "the watch did not deliver a concurrent change in time",
                ));
            }
        }
        Err(etcd_err("too many concurrent changes to the same objects"))
    }

    /// Reads every object of a kind (in one namespace) from etcd.
    async fn range(
        &self,
        gk: &GroupKind,
        ns: Option<&str>,
    ) -> StoreResult<(BTreeMap<ObjKey, Arc<Value>>, u64)> {
        let prefix = self.kind_prefix(gk, ns);
        let mut kv = self.0.kv.clone();
        let resp = self
            .call(kv.get(prefix, Some(GetOptions::new().with_prefix())))
            .await?;
        let rev = resp.header().map_or(0, |h| h.revision()).max(0) as u64;
        let mut out = BTreeMap::new();
        for item in resp.kvs() {
            if let Some((k, v)) = decode(&self.0.cfg.prefix, item) {
                out.insert(k, Arc::new(v));
            }
        }
        Ok((out, rev))
    }
}

/// Decodes one etcd entry (its version set); `None` when it is not ours or unreadable.
fn decode(prefix: &str, kv: &KeyValue) -> Option<(ObjKey, Value)> {
    let k = object_key(prefix, kv)?;
    let mut v: Value = serde_json::from_slice(kv.value()).ok()?;
    if !v.is_object() {
        return None;
    }
    set_rv(&mut v, kv.mod_revision().max(0) as u64);
    Some((k, v))
}

/// Loads the whole prefix into the cache at one revision; returns it.
async fn load(core: &Core<NoBackend>, kv: &KvClient, cfg: &EtcdConfig) -> StoreResult<u64> {
    let mut kv = kv.clone();
    let end = prefix_end(&cfg.prefix);
    let mut from = cfg.prefix.clone().into_bytes();
    let mut rev = 0i64;
    let mut objects = Vec::new();
    loop {
        let mut opts = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
        if rev > 0 {
            opts = opts.with_revision(rev);
        }
        let resp = tokio::time::timeout(cfg.timeout, kv.get(from.clone(), Some(opts)))
            .await
            .map_err(|_| etcd_err("no answer while loading"))?
            .map_err(etcd_err)?;
        if rev == 0 {
            rev = resp.header().map_or(0, |h| h.revision());
        }
        for item in resp.kvs() {
            match decode(&cfg.prefix, item) {
                Some(o) => objects.push(o),
                None => {
                    let key = String::from_utf8_lossy(item.key()).into_owned();
                    tracing::error!(%key, "etcd entry unreadable; skipped");
                    core.note_unreadable(format!("object {key:?}"));
                }
            }
        }
        match resp.kvs().last() {
            Some(last) if resp.more() => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => break,
        }
    }
    let rev = rev.max(0) as u64;
    core.reset(objects, rev);
    Ok(rev)
}

/// The first key after every key with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// Follows etcd's watch into the cache, for as long as the store lives.
async fn feed(core: Arc<Core<NoBackend>>, client: Client, cfg: EtcdConfig, mut rev: u64) {
    let kv = client.kv_client().max_decoding_message_size(MAX_MESSAGE);
    loop {
        match follow(&core, &client, &cfg, &mut rev).await {
            Ok(true) => {
                tracing::warn!(rev, "etcd compacted past the store's watch; reloading");
                match load(&core, &kv, &cfg).await {
                    Ok(r) => rev = r,
                    Err(e) => {
                        tracing::warn!(error = %e, "reload from etcd failed");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, rev, "etcd watch broke; resuming");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// One etcd watch from `rev + 1`; `Ok(true)` when etcd compacted past it.
async fn follow(
    core: &Core<NoBackend>,
    client: &Client,
    cfg: &EtcdConfig,
    rev: &mut u64,
) -> Result<bool, etcd_client::Error> {
    let mut wc = client.watch_client().max_decoding_message_size(MAX_MESSAGE);
    let opts = EtcdWatchOptions::new()
        .with_prefix()
        .with_prev_key()
        .with_start_revision(*rev as i64 + 1);
    let mut stream = wc.watch(cfg.prefix.clone(), Some(opts)).await?;
    while let Some(resp) = stream.message().await? {
        if resp.compact_revision() > 0 {
            return Ok(true);
        }
        if resp.canceled() {
            return Ok(false);
        }
        let mut changes = Vec::new();
        for ev in resp.events() {
            let Some(kv) = ev.kv() else { continue };
            let at = kv.mod_revision().max(0) as u64;
            *rev = (*rev).max(at);
            match ev.event_type() {
                EtcdEvent::Put => match decode(&cfg.prefix, kv) {
                    Some((key, object)) => changes.push(RemoteChange::Put {
                        key,
                        object,
                        rv: at,
                    }),
                    None => {
                        let key = String::from_utf8_lossy(kv.key()).into_owned();
                        tracing::error!(%key, "etcd entry unreadable; skipped");
                        core.note_unreadable(format!("object {key:?}"));
                    }
                },
                EtcdEvent::Delete => {
                    let Some(key) = object_key(&cfg.prefix, kv) else {
                        continue;
                    };
                    let last = ev
                        .prev_kv()
                        .and_then(|p| decode(&cfg.prefix, p))
                        .map(|x| x.1);
                    changes.push(RemoteChange::Delete { key, rv: at, last });
                }
            }
        }
        core.apply_remote(changes);
    }
    Ok(false)
}

/// The object key of an etcd key under `prefix`.
fn object_key(prefix: &str, kv: &KeyValue) -> Option<ObjKey> {
    let key = std::str::from_utf8(kv.key()).ok()?.strip_prefix(prefix)?;
    let mut it = key.splitn(4, '/');
    Some((
        it.next()?.to_string(),
        it.next()?.to_string(),
        it.next()?.to_string(),
        it.next()?.to_string(),
    ))
}

#[async_trait]
impl Store for EtcdStore {
    async fn create(&self, kind: &GroupKind, namespace: &str, obj: Value) -> StoreResult<Value> {
        let core = self.0.core.clone();
        self.commit(|| core.prepare_create(kind, namespace, obj.clone()), set_rv)
            .await
    }

    async fn get(&self, kind: &GroupKind, namespace: &str, name: &str) -> StoreResult<Value> {
        let key = obj_key(kind, namespace, name);
        let mut kv = self.0.kv.clone();
        let resp = self.call(kv.get(self.key(&key), None)).await?;
        resp.kvs()
            .first()
            .and_then(|kv| decode(&self.0.cfg.prefix, kv))
            .map(|(_, v)| v)
            .ok_or_else(|| StoreError::NotFound {
                kind: kind.clone(),
                name: name.to_string(),
            })
    }

    async fn update(
        &self,
        kind: &GroupKind,
        namespace: &str,
        obj: Value,
        scope: UpdateScope,
    ) -> StoreResult<Value> {
        self.catch_up(rv_of(&obj)).await;
        let core = self.0.core.clone();
        self.commit(
            || core.prepare_update(kind, namespace, obj.clone(), scope),
            set_rv,
        )
        .await
    }

    async fn delete(
        &self,
        kind: &GroupKind,
        namespace: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> StoreResult<(Value, bool)> {
        self.catch_up(
            opts.resource_version
                .as_deref()
                .and_then(|r| r.parse().ok()),
        )
        .await;
        let core = self.0.core.clone();
        self.commit(
            || core.prepare_delete(kind, namespace, name, opts),
            |(v, _), rev| set_rv(v, rev),
        )
        .await
    }

    async fn list(
        &self,
        kind: &GroupKind,
        namespace: Option<&str>,
        opts: &ListOptions,
    ) -> StoreResult<ObjectList> {
        let (objects, rev) = self.range(kind, namespace).await?;
        list_in(&objects, rev, kind, namespace, opts)
    }

    async fn watch(
        &self,
        kind: &GroupKind,
        namespace: Option<&str>,
        opts: &WatchOptions,
    ) -> StoreResult<WatchStream> {
        match opts.resource_version {
            Some(rv) if rv < self.0.core.oldest_watchable() => {
                self.watch_etcd(kind, namespace, opts, rv).await
            }
            _ => self.0.core.watch(kind, namespace, opts),
        }
    }

    fn resource_version(&self) -> u64 {
        self.0.core.resource_version()
    }

    fn oldest_watchable(&self) -> u64 {
        self.0.core.oldest_watchable()
    }
}

impl EtcdStore {
    /// A watch from a version older than the cache: served by its own etcd
    /// watch, which ends with `Gone` when etcd compacted past `rv`.
    async fn watch_etcd(
        &self,
        gk: &GroupKind,
        ns: Option<&str>,
        opts: &WatchOptions,
        rv: u64,
    ) -> StoreResult<WatchStream> {
        let filter = Arc::new(watch_filter(gk, ns, opts));
        let prefix = self.kind_prefix(gk, ns);
        let mut wc = self
            .0
            .client
            .watch_client()
            .max_decoding_message_size(MAX_MESSAGE);
        let wopts = EtcdWatchOptions::new()
            .with_prefix()
            .with_prev_key()
            .with_start_revision(rv as i64 + 1);
        let stream = self.call(wc.watch(prefix, Some(wopts))).await?;
        let base = self.0.cfg.prefix.clone();
        let s = futures::stream::unfold(Some(stream), move |state| {
            let (base, filter) = (base.clone(), filter.clone());
            async move {
                let mut stream = state?;
                let resp = match stream.message().await {
                    Ok(Some(r)) => r,
                    Ok(None) => return None,
                    Err(e) => return Some((vec![Err(etcd_err(e))], None)),
                };
                if resp.compact_revision() > 0 {
                    let gone = StoreError::Gone {
                        requested: rv,
                        oldest: resp.compact_revision().max(0) as u64,
                    };
                    return Some((vec![Err(gone)], None));
                }
                let mut out = Vec::new();
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let at = kv.mod_revision().max(0) as u64;
                    let prev = ev.prev_kv().and_then(|p| decode(&base, p));
                    match ev.event_type() {
                        EtcdEvent::Put => {
                            let Some((key, obj)) = decode(&base, kv) else {
                                continue;
                            };
                            let t = if prev.is_some() {
                                EventType::Modified
                            } else {
                                EventType::Added
                            };
                            out.extend(filter.translate_remote(key, t, obj, prev.map(|p| p.1), at));
                        }
                        EtcdEvent::Delete => {
                            let Some((key, mut last)) = prev else {
                                continue;
                            };
                            set_rv(&mut last, at);
                            out.extend(filter.translate_remote(
                                key,
                                EventType::Deleted,
                                last,
                                None,
                                at,
                            ));
                        }
                    }
                }
                Some((out.into_iter().map(Ok).collect(), Some(stream)))
            }
        })
        .flat_map(futures::stream::iter);
        Ok(Box::pin(s))
    }
}

#[cfg(test)]
mod tests;
