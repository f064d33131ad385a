// SPDX-License-Identifier: Apache-2.0
//! The core as a cache of a remote store (etcd): writes are prepared against
//! the cached state but not applied; the remote commits them, and the changes
//! come back through the remote's own event feed, in its order, with its
//! versions. Watches are served from the cached history as for local stores.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::{
    Backend, Change, Core, DeleteOptions, Event, EventType, Filter, GroupKind, ObjKey, State,
    StoreResult, UpdateScope, WatchOptions, apply, drop_guard_then_notify, meta_mut, meta_str,
    obj_key, update_key,
};

/// A write prepared against the cache: what it returns, what it changes, and
/// the version each changed key had when it was read (`None`: absent), which
/// the remote commit compares so a stale cache can never overwrite a newer
/// object.
#[derive(Debug)]
pub(crate) struct Prepared<R> {
    pub result: R,
    pub changes: Vec<Change>,
    pub expected: Vec<(ObjKey, Option<u64>)>,
}

/// One change reported by the remote feed.
#[derive(Debug)]
pub(crate) enum RemoteChange {
    /// The key now holds this object (its resourceVersion is set here).
    Put { key: ObjKey, object: Value, rv: u64 },
    /// The key was removed at `rv`; `last` is the remote's previous value, used
    /// when the cache did not hold the object.
    Delete {
        key: ObjKey,
        rv: u64,
        last: Option<Value>,
    },
}

/// The resourceVersion of a stored object, as a number.
pub(crate) fn rv_of(obj: &Value) -> Option<u64> {
    meta_str(obj, "resourceVersion").and_then(|r| r.parse().ok())
}

/// Sets `metadata.resourceVersion`.
pub(crate) fn set_rv(obj: &mut Value, rv: u64) {
    meta_mut(obj).insert("resourceVersion".into(), Value::String(rv.to_string()));
}

impl<B: Backend> Core<B> {
    fn prepare<R>(
        &self,
        f: impl FnOnce(&mut super::Txn<'_>) -> StoreResult<R>,
    ) -> StoreResult<Prepared<R>> {
        let st = self.lock();
        let mut txn = super::Txn::new(&st);
        let result = f(&mut txn)?;
        let (changes, _, _) = txn.into_changes();
        let expected = changes
            .iter()
            .map(|c| {
                let k = match c {
                    Change::Put(k, _) | Change::Remove(k) => k,
                };
                (k.clone(), st.objects.get(k).and_then(|o| rv_of(o)))
            })
            .collect();
        Ok(Prepared {
            result,
            changes,
            expected,
        })
    }

    pub(crate) fn prepare_create(
        &self,
        gk: &GroupKind,
        ns: &str,
        obj: Value,
    ) -> StoreResult<Prepared<Value>> {
        self.prepare(|t| t.create((gk, ns), obj).map(|o| (*o).clone()))
    }

    pub(crate) fn prepare_update(
        &self,
        gk: &GroupKind,
        ns: &str,
        obj: Value,
        scope: UpdateScope,
    ) -> StoreResult<Prepared<Value>> {
        let key = update_key(gk, ns, &obj)?;
        self.prepare(|t| t.update(&key, obj, scope))
    }

    pub(crate) fn prepare_delete(
        &self,
        gk: &GroupKind,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> StoreResult<Prepared<(Value, bool)>> {
        let key = obj_key(gk, ns, name);
        self.prepare(|t| t.delete(&key, opts))
    }

    /// Applies changes the remote committed at versions up to `rv`, in its
    /// order, and wakes watchers.
    pub(crate) fn apply_remote(&self, remote: Vec<RemoteChange>) {
        if remote.is_empty() {
            return;
        }
        let mut st = self.lock();
        let mut changes = Vec::with_capacity(remote.len());
        let mut events = Vec::with_capacity(remote.len());
        let mut rv = st.rv;
        // Later changes in one batch see earlier ones (a key put then removed).
        let mut seen: std::collections::HashMap<ObjKey, Option<Arc<Value>>> = Default::default();
        for c in remote {
            match c {
                RemoteChange::Put {
                    key,
                    mut object,
                    rv: at,
                } => {
                    set_rv(&mut object, at);
                    let object = Arc::new(object);
                    let prev = match seen.get(&key) {
                        Some(p) => p.clone(),
                        None => st.objects.get(&key).cloned(),
                    };
                    let type_ = if prev.is_some() {
                        EventType::Modified
                    } else {
                        EventType::Added
                    };
                    seen.insert(key.clone(), Some(object.clone()));
                    events.push(Event {
                        rv: at,
                        key: key.clone(),
                        type_,
                        object: object.clone(),
                        prev,
                    });
                    changes.push(Change::Put(key, object));
                    rv = rv.max(at);
                }
                RemoteChange::Delete { key, rv: at, last } => {
                    let cached = match seen.get(&key) {
                        Some(p) => p.clone(),
                        None => st.objects.get(&key).cloned(),
                    };
                    seen.insert(key.clone(), None);
                    let last = cached.map(|o| (*o).clone()).or(last);
                    if let Some(mut last) = last {
                        set_rv(&mut last, at);
                        events.push(Event {
                            rv: at,
                            key: key.clone(),
                            type_: EventType::Deleted,
                            object: Arc::new(last),
                            prev: None,
                        });
                    }
                    changes.push(Change::Remove(key));
                    rv = rv.max(at);
                }
            }
        }
        let compacted = self.compaction_point(&st, events.len(), events.iter().map(|e| e.rv));
        apply(&mut st, changes, events, rv, compacted);
        drop_guard_then_notify(st, &self.notify, rv);
    }

    /// Replaces the whole cache with a fresh listing at `rv` (after the feed
    /// lost its place): the history is dropped, so every watcher that was
    /// behind gets `Gone` and relists.
    pub(crate) fn reset(&self, objects: Vec<(ObjKey, Value)>, rv: u64) {
        let mut st = self.lock();
        let mut fresh = State {
            rv,
            compacted: rv,
            unreadable: std::mem::take(&mut st.unreadable),
            ..State::default()
        };
        for (k, mut o) in objects {
            if rv_of(&o).is_none() {
                set_rv(&mut o, rv);
            }
            fresh.insert_loaded(k, o);
        }
        *st = fresh;
        drop_guard_then_notify(st, &self.notify, rv);
    }

    /// Records entries of the remote that could not be read.
    pub(crate) fn note_unreadable(&self, what: String) {
        self.lock().unreadable.push(what);
    }

    /// Waits until `ready` holds for the state (checked on every change), or
    /// `timeout` passes; returns whether it held.
    pub(crate) async fn wait_until(
        &self,
        timeout: Duration,
        mut ready: impl FnMut(&State) -> bool,
    ) -> bool {
        let mut rx = self.notify.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            if ready(&self.lock()) {
                return true;
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return ready(&self.lock()),
            }
        }
    }
}

/// The filter of a watch, for streams served outside the cache.
pub(crate) fn watch_filter(gk: &GroupKind, ns: Option<&str>, opts: &WatchOptions) -> Filter {
    Filter {
        gk: gk.clone(),
        namespace: ns.map(str::to_string),
        labels: opts.labels.clone(),
        fields: opts.fields.clone(),
        progress: opts.progress,
    }
}

impl Filter {
    /// The event this watcher sees for a remote change, if any.
    pub(crate) fn translate_remote(
        &self,
        key: ObjKey,
        type_: EventType,
        object: Value,
        prev: Option<Value>,
        rv: u64,
    ) -> Option<super::WatchEvent> {
        self.translate(&Event {
            rv,
            key,
            type_,
            object: Arc::new(object),
            prev: prev.map(Arc::new),
        })
    }
}
