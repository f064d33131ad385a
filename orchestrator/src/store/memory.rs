// SPDX-License-Identifier: Apache-2.0
//! In-memory store (tests, embedding without persistence).

use std::sync::Arc;

use super::core::{Core, NoBackend, State};

/// Default number of events kept for watches that resume from a version.
pub const DEFAULT_HISTORY: usize = 10_000;

/// A [`Store`](super::Store) that keeps everything in memory.
///
/// Cloning is cheap and shares the data.
#[derive(Debug, Clone)]
pub struct MemoryStore(pub(crate) Arc<Core<NoBackend>>);

impl MemoryStore {
    /// An empty store keeping [`DEFAULT_HISTORY`] events.
    pub fn new() -> Self {
        Self::with_history(DEFAULT_HISTORY)
    }

    /// An empty store keeping `events` events for watch resumption (at least 1).
    pub fn with_history(events: usize) -> Self {
        Self(Arc::new(Core::new(State::default(), NoBackend, events)))
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

/// Implements [`super::Store`] for a newtype over `Arc<Core<B>>`.
macro_rules! impl_store {
    ($t:ty) => {
        #[async_trait::async_trait]
        impl $crate::store::Store for $t {
            async fn create(
                &self,
                kind: &$crate::store::GroupKind,
                namespace: &str,
                obj: serde_json::Value,
            ) -> $crate::store::StoreResult<serde_json::Value> {
                let (core, kind, namespace) = (self.0.clone(), kind.clone(), namespace.to_string());
                $crate::store::memory::run(
                    move || core.create(&kind, &namespace, obj),
                    Self::BLOCKING,
                )
                .await
            }
            async fn get(
                &self,
                kind: &$crate::store::GroupKind,
                namespace: &str,
                name: &str,
            ) -> $crate::store::StoreResult<serde_json::Value> {
                self.0.get(kind, namespace, name)
            }
            async fn update(
                &self,
                kind: &$crate::store::GroupKind,
                namespace: &str,
                obj: serde_json::Value,
                scope: $crate::store::UpdateScope,
            ) -> $crate::store::StoreResult<serde_json::Value> {
                let (core, kind, namespace) = (self.0.clone(), kind.clone(), namespace.to_string());
                $crate::store::memory::run(
                    move || core.update(&kind, &namespace, obj, scope),
                    Self::BLOCKING,
                )
                .await
            }
            async fn delete(
                &self,
                kind: &$crate::store::GroupKind,
                namespace: &str,
                name: &str,
                opts: &$crate::store::DeleteOptions,
            ) -> $crate::store::StoreResult<(serde_json::Value, bool)> {
                let (core, kind, namespace, name, opts) = (
                    self.0.clone(),
                    kind.clone(),
                    namespace.to_string(),
                    name.to_string(),
                    opts.clone(),
                );
                $crate::store::memory::run(
                    move || core.delete(&kind, &namespace, &name, &opts),
                    Self::BLOCKING,
                )
                .await
            }
            async fn list(
                &self,
                kind: &$crate::store::GroupKind,
                namespace: Option<&str>,
                opts: &$crate::store::ListOptions,
            ) -> $crate::store::StoreResult<$crate::store::ObjectList> {
                self.0.list(kind, namespace, opts)
            }
            async fn watch(
                &self,
                kind: &$crate::store::GroupKind,
                namespace: Option<&str>,
                opts: &$crate::store::WatchOptions,
            ) -> $crate::store::StoreResult<$crate::store::WatchStream> {
                self.0.watch(kind, namespace, opts)
            }
            fn resource_version(&self) -> u64 {
                self.0.resource_version()
            }
            fn oldest_watchable(&self) -> u64 {
                self.0.oldest_watchable()
            }
        }
    };
}
pub(crate) use impl_store;

impl MemoryStore {
    const BLOCKING: bool = false;
}

impl_store!(MemoryStore);

/// Runs a store write, on a blocking thread when the backend blocks and a
/// Tokio runtime is present.
pub(crate) async fn run<R: Send + 'static>(
    f: impl FnOnce() -> super::StoreResult<R> + Send + 'static,
    blocking: bool,
) -> super::StoreResult<R> {
    if blocking && tokio::runtime::Handle::try_current().is_ok() {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| super::StoreError::Backend(format!("store task failed: {e}")))?
    } else {
        f()
    }
}
