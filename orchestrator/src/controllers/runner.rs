// SPDX-License-Identifier: Apache-2.0
//! Runs a [`Reconciler`] as a level-triggered control loop over any [`Store`].
//!
//! ```text
//!   watch(primary)   ──map──┐
//!   watch(secondary) ──map──┼──► WorkQueue<ObjectKey> ──► workers ──► reconcile(key)
//!   resync timer (list) ────┘        ▲                                   │
//!                                    └── Err: backoff · RequeueAfter(d) ─┘
//! ```
//!
//! A reconcile reads the current state from the store and moves the world
//! one step towards the desired state; it must be idempotent, because the
//! same key is reconciled again after every change, every error and every
//! resync. Watches restart from scratch (a full list) when they end or fall
//! behind the store's history, so a missed event only delays convergence.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::{FutureExt, StreamExt};
use serde_json::Value;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use super::ControllerError;
use super::queue::{Backoff, WorkQueue};
use crate::resources::common::json_str;
use crate::store::{GroupKind, ListOptions, Store, WatchEvent, WatchOptions};

/// Namespace (`""` for cluster-scoped kinds) and name of an object.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl ObjectKey {
    /// A key.
    pub fn new(namespace: &str, name: &str) -> Self {
        ObjectKey {
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }

    /// The key of a stored object (`None` without a name).
    pub fn of(obj: &Value) -> Option<Self> {
        let name = json_str(obj, "metadata.name");
        (!name.is_empty()).then(|| ObjectKey::new(json_str(obj, "metadata.namespace"), name))
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.namespace.is_empty() {
            f.write_str(&self.name)
        } else {
            write!(f, "{}/{}", self.namespace, self.name)
        }
    }
}

/// What to do with a key after a successful reconcile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing until the next change or resync.
    Done,
    /// Reconcile again after this long (timers: grace periods, back-offs).
    RequeueAfter(Duration),
}

/// One step of a control loop. See the module docs for the contract.
#[async_trait]
pub trait Reconciler: Send + Sync + 'static {
    /// Moves the object named by `key` towards its desired state. Errors are
    /// retried with per-key exponential backoff.
    async fn reconcile(&self, key: &ObjectKey) -> Result<Action, ControllerError>;
}

/// Maps a watch event of some kind to the keys of the controller's primary kind.
pub type KeyMapper = Arc<dyn Fn(&WatchEvent) -> Vec<ObjectKey> + Send + Sync>;

/// Maps an event to the object's own key.
pub fn map_self() -> KeyMapper {
    Arc::new(|ev: &WatchEvent| ObjectKey::of(&ev.object).into_iter().collect())
}

/// Maps an event to the keys of its owners of `kind` (same namespace).
pub fn map_owner(kind: &'static str) -> KeyMapper {
    Arc::new(move |ev: &WatchEvent| {
        let ns = json_str(&ev.object, "metadata.namespace");
        ev.object
            .pointer("/metadata/ownerReferences")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|r| json_str(r, "kind") == kind)
            .map(|r| ObjectKey::new(ns, json_str(r, "name")))
            .collect()
    })
}

/// Settings of one controller.
pub struct ControllerBuilder {
    name: &'static str,
    store: Arc<dyn Store>,
    primary: GroupKind,
    watches: Vec<(GroupKind, WatchOptions, KeyMapper)>,
    resync: Duration,
    workers: usize,
    backoff: Backoff,
}

impl fmt::Debug for ControllerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControllerBuilder")
            .field("name", &self.name)
            .field("primary", &self.primary)
            .field("watches", &self.watches.len())
            .finish()
    }
}

impl ControllerBuilder {
    /// A controller reconciling objects of `primary` (watched, mapped to themselves).
    pub fn new(name: &'static str, store: Arc<dyn Store>, primary: GroupKind) -> Self {
        ControllerBuilder {
            name,
            store,
            primary: primary.clone(),
            watches: vec![(primary, WatchOptions::default(), map_self())],
            resync: Duration::from_secs(30),
            workers: 2,
            backoff: Backoff::default(),
        }
    }

    /// Also watches `kind`, mapping its events to primary keys.
    pub fn watches(mut self, kind: GroupKind, mapper: KeyMapper) -> Self {
        self.watches.push((kind, WatchOptions::default(), mapper));
        self
    }

    /// Also watches `kind` with selectors.
    pub fn watches_with(mut self, kind: GroupKind, opts: WatchOptions, mapper: KeyMapper) -> Self {
        self.watches.push((kind, opts, mapper));
        self
    }

    /// Replaces the mapper of the primary watch (e.g. to observe events as well).
    pub fn map_primary(mut self, mapper: KeyMapper) -> Self {
        self.watches[0].2 = mapper;
        self
    }

    /// Restricts the primary watch (e.g. a field selector on `status.nodeName`).
    pub fn primary_options(mut self, opts: WatchOptions) -> Self {
        self.watches[0].1 = opts;
        self
    }

    /// Period of the full resync (every primary object is reconciled).
    pub fn resync(mut self, every: Duration) -> Self {
        self.resync = every;
        self
    }

    /// Concurrent workers (a key is never reconciled by two at once).
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }

    /// Per-key backoff after errors.
    pub fn backoff(mut self, b: Backoff) -> Self {
        self.backoff = b;
        self
    }

    /// Starts the watches, the resync timer and the workers on the current runtime.
    pub fn spawn(self, reconciler: Arc<dyn Reconciler>) -> Controller {
        let queue = WorkQueue::new(self.backoff);
        let mut tasks = Vec::new();
        for (kind, opts, mapper) in self.watches.iter().cloned() {
            tasks.push(tokio::spawn(watch_loop(
                self.name,
                self.store.clone(),
                kind,
                opts,
                mapper,
                queue.clone(),
            )));
        }
        tasks.push(tokio::spawn(resync_loop(
            self.store.clone(),
            self.primary.clone(),
            self.watches[0].1.clone(),
            self.resync,
            queue.clone(),
        )));
        for _ in 0..self.workers {
            tasks.push(tokio::spawn(worker(
                self.name,
                queue.clone(),
                reconciler.clone(),
            )));
        }
        Controller {
            name: self.name,
            queue,
            tasks,
        }
    }
}

/// A running controller. Dropping it stops every task.
#[derive(Debug)]
pub struct Controller {
    name: &'static str,
    queue: Arc<WorkQueue<ObjectKey>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Controller {
    /// The controller's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Its work queue (to enqueue keys from elsewhere).
    pub fn queue(&self) -> &Arc<WorkQueue<ObjectKey>> {
        &self.queue
    }

    /// Stops every task at once.
    pub fn abort(&self) {
        self.queue.shut_down();
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.abort();
    }
}

async fn watch_loop(
    name: &'static str,
    store: Arc<dyn Store>,
    kind: GroupKind,
    opts: WatchOptions,
    mapper: KeyMapper,
    queue: Arc<WorkQueue<ObjectKey>>,
) {
    let mut delay = Duration::from_millis(50);
    loop {
        // No resourceVersion: every current object first, then changes.
        let opts = WatchOptions {
            resource_version: None,
            ..opts.clone()
        };
        match store.watch(&kind, None, &opts).await {
            Ok(mut stream) => {
                delay = Duration::from_millis(50);
                while let Some(ev) = stream.next().await {
                    match ev {
                        Ok(ev) => {
                            for k in mapper(&ev) {
                                queue.add(k);
                            }
                        }
                        Err(e) => {
                            debug!(controller = name, %kind, error = %e, "watch ended; relisting");
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                warn!(controller = name, %kind, error = %e, "watch failed");
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
        tokio::time::sleep(delay).await;
    }
}

async fn resync_loop(
    store: Arc<dyn Store>,
    kind: GroupKind,
    opts: WatchOptions,
    every: Duration,
    queue: Arc<WorkQueue<ObjectKey>>,
) {
    let list = ListOptions {
        labels: opts.labels,
        fields: opts.fields,
        ..Default::default()
    };
    loop {
        tokio::time::sleep(every).await;
        match store.list(&kind, None, &list).await {
            Ok(l) => {
                for o in &l.items {
                    if let Some(k) = ObjectKey::of(o) {
                        queue.add(k);
                    }
                }
            }
            Err(e) => warn!(%kind, error = %e, "resync list failed"),
        }
    }
}

async fn worker(
    name: &'static str,
    queue: Arc<WorkQueue<ObjectKey>>,
    reconciler: Arc<dyn Reconciler>,
) {
    while let Some(key) = queue.get().await {
        let res = std::panic::AssertUnwindSafe(reconciler.reconcile(&key))
            .catch_unwind()
            .await;
        match res {
            Ok(Ok(Action::Done)) => queue.forget(&key),
            Ok(Ok(Action::RequeueAfter(d))) => {
                queue.forget(&key);
                queue.add_after(key.clone(), d);
            }
            Ok(Err(e)) => {
                let d = queue.add_rate_limited(key.clone());
                if e.is_conflict() {
                    debug!(controller = name, %key, error = %e, retry_in = ?d, "conflict; retrying");
                } else {
                    warn!(controller = name, %key, error = %e, retry_in = ?d, "reconcile failed");
                }
            }
            Err(_) => {
                let d = queue.add_rate_limited(key.clone());
                warn!(controller = name, %key, retry_in = ?d, "reconcile panicked");
            }
        }
        queue.done(&key);
    }
}
