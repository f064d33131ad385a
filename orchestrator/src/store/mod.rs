// SPDX-License-Identifier: Apache-2.0
//! The `Store`: Kubernetes storage semantics over JSON objects.
//!
//! Objects are JSON values keyed by group, kind, namespace and name (cluster-
//! scoped kinds use the namespace `""`). Every write takes the next value of
//! one global, monotonic `resourceVersion`, and produces a watch event.
//!
//! ```text
//!   create/update/delete ──► Txn (overlay, GC cascade) ──► Backend::commit (redb txn)
//!                                                          │
//!                          objects + event history ◄───────┘ then notify watchers
//!   watch(from rv) ──► replay history after rv (410 Gone if compacted) ──► live
//! ```
//!
//! Semantics kept from Kubernetes:
//! - optimistic concurrency: an update carrying `metadata.resourceVersion`
//!   fails with [`StoreError::Conflict`] if the object changed since;
//! - no-op updates do not bump the resourceVersion;
//! - `metadata.generation` increments when anything outside `metadata` and
//!   `status` changes;
//! - finalizers: deleting an object with finalizers only sets
//!   `deletionTimestamp`; it is removed when the last finalizer is;
//! - owner references: when an owner is removed, dependents whose owners are
//!   all gone are deleted (background cascading), `Orphan` strips the
//!   references instead, `Foreground` keeps the owner (finalizer
//!   `foregroundDeletion`) until its dependents are gone;
//! - status subresource: [`UpdateScope::Main`] keeps the stored status,
//!   [`UpdateScope::Status`] changes nothing but the status.
//!
//! Implementations: [`MemoryStore`] and [`RedbStore`] (persistent) share one
//! core, so they behave identically; the redb store commits each write batch in
//! one redb transaction before it becomes visible. [`EtcdStore`] uses the same
//! core as a cache of etcd, which decides every write (see [`etcd`]).

mod core;
pub mod etcd;
mod lock;
pub mod memory;
pub mod redb;
pub mod selector;

use std::fmt;
use std::pin::Pin;

use async_trait::async_trait;
use futures::Stream;
use serde_json::Value;

pub use etcd::{EtcdConfig, EtcdStore};
pub use lock::LOCK_FILE;
pub use memory::MemoryStore;
pub use redb::RedbStore;
pub use selector::{FieldSelector, LabelSelector, SelectorError};

use crate::resources::Resource;

/// Largest object the store keeps, in bytes of its JSON encoding (above the
/// API server's default 3 MiB request body, so anything a client can send in
/// one request fits; a patch that would grow an object past it is refused).
pub const MAX_OBJECT_BYTES: usize = 4 << 20;

/// The length of `v` encoded as JSON, or `None` once it passes `cap` (the
/// encoding stops there, so the cost is bounded by `cap`).
pub fn encoded_len_capped(v: &Value, cap: usize) -> Option<usize> {
    struct Counter {
        n: usize,
        cap: usize,
    }
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.n = self.n.saturating_add(buf.len());
            if self.n > self.cap {
                return Err(std::io::Error::other("over the cap"));
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Counter { n: 0, cap };
    serde_json::to_writer(&mut c, v).ok()?;
    Some(c.n)
}

/// Identifies a kind in the store.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupKind {
    /// API group (`""` for core).
    pub group: String,
    /// Kind.
    pub kind: String,
}

impl GroupKind {
    /// A group and kind.
    pub fn new(group: &str, kind: &str) -> Self {
        Self {
            group: group.to_string(),
            kind: kind.to_string(),
        }
    }
    /// The group and kind of a typed resource.
    pub fn of<K: Resource>() -> Self {
        Self::new(K::GROUP, K::KIND)
    }
}

impl fmt::Display for GroupKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.group.is_empty() {
            write!(f, "{}", self.kind)
        } else {
            write!(f, "{}.{}", self.kind, self.group)
        }
    }
}

/// Store failures. Each maps to one Kubernetes status code.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum StoreError {
    /// 404.
    #[error("{kind} {name:?} not found")]
    NotFound {
        /// Kind.
        kind: GroupKind,
        /// Name.
        name: String,
    },
    /// 409 on create.
    #[error("{kind} {name:?} already exists")]
    AlreadyExists {
        /// Kind.
        kind: GroupKind,
        /// Name.
        name: String,
    },
    /// 409 on a stale resourceVersion or a failed precondition.
    #[error("Operation cannot be fulfilled on {kind} {name:?}: {message}")]
    Conflict {
        /// Kind.
        kind: GroupKind,
        /// Name.
        name: String,
        /// Why.
        message: String,
    },
    /// 422: the object breaks a store rule (missing name, finalizer added while deleting).
    #[error("{kind} {name:?} is invalid: {message}")]
    Invalid {
        /// Kind.
        kind: GroupKind,
        /// Name.
        name: String,
        /// Why.
        message: String,
    },
    /// 410: the requested resourceVersion is older than the retained history.
    #[error("too old resource version: {requested} ({oldest})")]
    Gone {
        /// Requested version.
        requested: u64,
        /// Oldest version a watch can start from.
        oldest: u64,
    },
    /// 400: malformed selector or options.
    #[error("{0}")]
    BadRequest(String),
    /// 500: the backend failed; nothing was applied.
    #[error("storage backend error: {0}")]
    Backend(String),
}

/// Result alias for store operations.
pub type StoreResult<T> = Result<T, StoreError>;

/// Which part of an object an update may change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UpdateScope {
    /// Everything (controllers that own the whole object).
    #[default]
    All,
    /// Metadata and spec; the stored status is kept (the main resource of a kind with `/status`).
    Main,
    /// Only `status` (the `/status` subresource).
    Status,
}

/// How dependents are treated when their owner is deleted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Propagation {
    /// Owner removed now; dependents removed after it.
    #[default]
    Background,
    /// Owner kept (finalizer `foregroundDeletion`) until dependents are gone.
    Foreground,
    /// Dependents kept; their owner references are removed.
    Orphan,
}

/// Options of a delete.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeleteOptions {
    /// Delete only if the uid matches.
    pub uid: Option<String>,
    /// Delete only if the resourceVersion matches.
    pub resource_version: Option<String>,
    /// Dependents policy.
    pub propagation: Propagation,
}

/// Options of a list.
#[derive(Clone, Debug, Default)]
pub struct ListOptions {
    /// Label selector.
    pub labels: LabelSelector,
    /// Field selector.
    pub fields: FieldSelector,
    /// Page size (0 = unlimited).
    pub limit: usize,
    /// Continue token from a previous page.
    pub continue_token: Option<String>,
}

/// One page of a list.
#[derive(Clone, Debug, PartialEq)]
pub struct ObjectList {
    /// Objects, sorted by namespace then name.
    pub items: Vec<Value>,
    /// The store's resourceVersion when listed.
    pub resource_version: u64,
    /// Token for the next page, if any.
    pub continue_token: Option<String>,
    /// Objects after this page.
    pub remaining: Option<u64>,
}

/// Options of a watch.
#[derive(Clone, Debug, Default)]
pub struct WatchOptions {
    /// Start after this version. `None` = start now, first sending every
    /// matching object as `Added` (Kubernetes' "resourceVersion unset / 0").
    pub resource_version: Option<u64>,
    /// Label selector.
    pub labels: LabelSelector,
    /// Field selector.
    pub fields: FieldSelector,
    /// Also yield [`EventType::Bookmark`] progress markers: every event up to
    /// their resourceVersion has been delivered (for watch bookmarks).
    pub progress: bool,
}

/// Type of a watch event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    /// Created (or started matching the selectors).
    Added,
    /// Changed.
    Modified,
    /// Removed (or stopped matching the selectors).
    Deleted,
    /// Progress marker (only with [`WatchOptions::progress`]); `object` is null.
    Bookmark,
}

impl EventType {
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
            Self::Bookmark => "BOOKMARK",
        }
    }
}

/// One change seen by a watcher.
#[derive(Clone, Debug, PartialEq)]
pub struct WatchEvent {
    /// What happened.
    pub type_: EventType,
    /// The object after the change (for `Deleted`, its last state).
    pub object: Value,
    /// The resourceVersion of the change.
    pub resource_version: u64,
}

/// A stream of watch events. Ends with `Err(StoreError::Gone)` if the
/// watcher fell behind the retained history.
pub type WatchStream = Pin<Box<dyn Stream<Item = StoreResult<WatchEvent>> + Send>>;

/// Kubernetes-style object storage. See the module docs for the semantics.
///
/// All methods take the kind as a [`GroupKind`] and cluster-scoped objects use
/// namespace `""`. Objects must carry `metadata.name` (or
/// `metadata.generateName` on create).
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug + 'static {
    /// Creates an object; sets uid, creationTimestamp, generation and resourceVersion.
    async fn create(&self, kind: &GroupKind, namespace: &str, obj: Value) -> StoreResult<Value>;
    /// Reads an object.
    async fn get(&self, kind: &GroupKind, namespace: &str, name: &str) -> StoreResult<Value>;
    /// Replaces an object (see [`UpdateScope`]); fails with `Conflict` if
    /// `metadata.resourceVersion` is set and stale.
    async fn update(
        &self,
        kind: &GroupKind,
        namespace: &str,
        obj: Value,
        scope: UpdateScope,
    ) -> StoreResult<Value>;
    /// Deletes an object. Returns its last state and whether it is gone now
    /// (`false` when finalizers keep it, with `deletionTimestamp` set).
    async fn delete(
        &self,
        kind: &GroupKind,
        namespace: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> StoreResult<(Value, bool)>;
    /// Lists objects of a kind (in one namespace, or all when `None`).
    async fn list(
        &self,
        kind: &GroupKind,
        namespace: Option<&str>,
        opts: &ListOptions,
    ) -> StoreResult<ObjectList>;
    /// Watches objects of a kind from a version.
    async fn watch(
        &self,
        kind: &GroupKind,
        namespace: Option<&str>,
        opts: &WatchOptions,
    ) -> StoreResult<WatchStream>;
    /// The current (latest committed) resourceVersion.
    fn resource_version(&self) -> u64;
    /// The oldest version a watch can start from (older ones get `Gone`).
    fn oldest_watchable(&self) -> u64;
}

/// Typed helpers over any [`Store`].
#[async_trait]
pub trait StoreExt: Store {
    /// Creates a typed object in its namespace (or cluster scope).
    async fn create_typed<K: Resource>(&self, obj: &K) -> StoreResult<K> {
        let ns = obj.metadata().namespace.clone().unwrap_or_default();
        let v = self
            .create(&GroupKind::of::<K>(), &ns, to_value(obj)?)
            .await?;
        from_value(v)
    }
    /// Reads a typed object.
    async fn get_typed<K: Resource>(&self, namespace: &str, name: &str) -> StoreResult<K> {
        from_value(self.get(&GroupKind::of::<K>(), namespace, name).await?)
    }
    /// Replaces a typed object with the given scope.
    async fn update_typed<K: Resource>(&self, obj: &K, scope: UpdateScope) -> StoreResult<K> {
        let ns = obj.metadata().namespace.clone().unwrap_or_default();
        from_value(
            self.update(&GroupKind::of::<K>(), &ns, to_value(obj)?, scope)
                .await?,
        )
    }
    /// Deletes a typed object; returns whether it is gone.
    async fn delete_typed<K: Resource>(&self, namespace: &str, name: &str) -> StoreResult<bool> {
        Ok(self
            .delete(
                &GroupKind::of::<K>(),
                namespace,
                name,
                &DeleteOptions::default(),
            )
            .await?
            .1)
    }
    /// Lists typed objects.
    async fn list_typed<K: Resource>(
        &self,
        namespace: Option<&str>,
        opts: &ListOptions,
    ) -> StoreResult<Vec<K>> {
        let list = self.list(&GroupKind::of::<K>(), namespace, opts).await?;
        list.items.into_iter().map(from_value).collect()
    }
    /// Read-modify-write with retry on conflict (up to 16 attempts).
    async fn modify_typed<K, F>(
        &self,
        namespace: &str,
        name: &str,
        scope: UpdateScope,
        mut f: F,
    ) -> StoreResult<K>
    where
        K: Resource,
        F: FnMut(&mut K) + Send,
    {
        let mut last = None;
        for _ in 0..16 {
            let mut obj: K = self.get_typed(namespace, name).await?;
            f(&mut obj);
            match self.update_typed(&obj, scope).await {
                Err(e @ StoreError::Conflict { .. }) => last = Some(e),
                other => return other,
            }
        }
        Err(last.unwrap_or_else(|| StoreError::Backend("modify retries exhausted".into())))
    }
}

impl<S: Store + ?Sized> StoreExt for S {}

fn to_value<K: Resource>(obj: &K) -> StoreResult<Value> {
    let mut v = serde_json::to_value(obj).map_err(|e| StoreError::BadRequest(e.to_string()))?;
    if let Some(m) = v.as_object_mut() {
        m.insert("apiVersion".into(), Value::String(K::api_version()));
        m.insert("kind".into(), Value::String(K::KIND.into()));
    }
    Ok(v)
}

fn from_value<K: Resource>(v: Value) -> StoreResult<K> {
    serde_json::from_value(v)
        .map_err(|e| StoreError::Backend(format!("stored object does not decode: {e}")))
}

#[cfg(test)]
mod tests;
