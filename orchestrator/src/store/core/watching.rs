// SPDX-License-Identifier: Apache-2.0
//! Watch streams over the shared core: the initial listing or a replay of the
//! retained history from a version, then live events, with selector
//! transitions and optional progress bookmarks.

use std::collections::VecDeque;
use std::sync::Arc;

use serde_json::Value;
use tokio::sync::watch;

use super::{Backend, Core, Event, ObjKey, meta_str};
use crate::store::{
    EventType, FieldSelector, GroupKind, LabelSelector, StoreError, StoreResult, WatchEvent,
    WatchOptions, WatchStream,
};

pub(crate) struct Filter {
    pub(super) gk: GroupKind,
    pub(super) namespace: Option<String>,
    pub(super) labels: LabelSelector,
    pub(super) fields: FieldSelector,
    pub(super) progress: bool,
}

impl Filter {
    pub(super) fn in_scope(&self, key: &ObjKey) -> bool {
        key.0 == self.gk.group
            && key.1 == self.gk.kind
            && self.namespace.as_ref().is_none_or(|ns| *ns == key.2)
    }
    pub(super) fn matches(&self, obj: &Value) -> bool {
        self.labels.matches_object(obj) && self.fields.matches(obj)
    }
    /// The event a watcher with this filter sees, if any.
    pub(super) fn translate(&self, ev: &Event) -> Option<WatchEvent> {
        if !self.in_scope(&ev.key) {
            return None;
        }
        let now_m = self.matches(&ev.object);
        let type_ = match ev.type_ {
            EventType::Added => now_m.then_some(EventType::Added)?,
            EventType::Deleted => now_m.then_some(EventType::Deleted)?,
            EventType::Bookmark => return None,
            EventType::Modified => {
                let was = ev.prev.as_ref().is_some_and(|p| self.matches(p));
                match (was, now_m) {
                    (true, true) => EventType::Modified,
                    (false, true) => EventType::Added,
                    (true, false) => EventType::Deleted,
                    (false, false) => return None,
                }
            }
        };
        Some(WatchEvent {
            type_,
            object: (*ev.object).clone(),
            resource_version: ev.rv,
        })
    }
}

impl<B: Backend> Core<B> {
    pub fn watch(
        self: &Arc<Self>,
        gk: &GroupKind,
        ns: Option<&str>,
        opts: &WatchOptions,
    ) -> StoreResult<WatchStream> {
        let filter = Filter {
            gk: gk.clone(),
            namespace: ns.map(str::to_string),
            labels: opts.labels.clone(),
            fields: opts.fields.clone(),
            progress: opts.progress,
        };
        let mut rx = self.notify.subscribe();
        rx.borrow_and_update();
        let (pending, last_rv) = {
            let st = self.lock();
            match opts.resource_version {
                None => {
                    let mut initial = VecDeque::new();
                    for (k, o) in &st.objects {
                        if filter.in_scope(k) && filter.matches(o) {
                            let rv = meta_str(o, "resourceVersion")
                                .and_then(|r| r.parse().ok())
                                .unwrap_or(st.rv);
                            initial.push_back(WatchEvent {
                                type_: EventType::Added,
                                object: (**o).clone(),
                                resource_version: rv,
                            });
                        }
                    }
                    (initial, st.rv)
                }
                Some(rv) if rv < st.compacted => {
                    return Err(StoreError::Gone {
                        requested: rv,
                        oldest: st.compacted,
                    });
                }
                Some(rv) => (VecDeque::new(), rv),
            }
        };
        struct W<B: Backend> {
            core: Arc<Core<B>>,
            filter: Filter,
            pending: VecDeque<WatchEvent>,
            last_rv: u64,
            rx: watch::Receiver<u64>,
            done: bool,
        }
        let w = W {
            core: self.clone(),
            filter,
            pending,
            last_rv,
            rx,
            done: false,
        };
        let stream = futures::stream::unfold(w, |mut w| async move {
            loop {
                if let Some(ev) = w.pending.pop_front() {
                    return Some((Ok(ev), w));
                }
                if w.done {
                    return None;
                }
                w.rx.borrow_and_update();
                {
                    let st = w.core.lock();
                    if w.last_rv < st.compacted {
                        w.done = true;
                        let err = StoreError::Gone {
                            requested: w.last_rv,
                            oldest: st.compacted,
                        };
                        drop(st);
                        return Some((Err(err), w));
                    }
                    let from = st.history.partition_point(|e| e.rv <= w.last_rv);
                    for ev in st.history.range(from..) {
                        if let Some(out) = w.filter.translate(ev) {
                            w.pending.push_back(out);
                        }
                    }
                    if w.filter.progress && st.rv > w.last_rv {
                        w.pending.push_back(WatchEvent {
                            type_: EventType::Bookmark,
                            object: Value::Null,
                            resource_version: st.rv,
                        });
                    }
                    w.last_rv = w.last_rv.max(st.rv);
                }
                if w.pending.is_empty() && w.rx.changed().await.is_err() {
                    return None;
                }
            }
        });
        Ok(Box::pin(stream))
    }
}
