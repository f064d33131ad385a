// SPDX-License-Identifier: Apache-2.0
//! A work queue with client-go's semantics: keys are deduplicated, a key is
//! never handed to two workers at once, a key added while it is being
//! processed is queued again when its worker is done, and failures back off
//! per key.
//!
//! ```text
//!   add(k) ──► dirty? ──no──► processing? ──no──► queue ──get()──► worker
//!                                 │ yes                              │
//!                                 └──── re-queued on done(k) ◄───────┘
//!   add_rate_limited(k): add after base·2^failures (capped); forget(k) resets
//! ```

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

/// Per-key exponential backoff settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Delay after the first failure.
    pub base: Duration,
    /// Upper bound.
    pub max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_millis(50),
            max: Duration::from_secs(30),
        }
    }
}

impl Backoff {
    /// The delay after `failures` consecutive failures (1 = first).
    pub fn delay(&self, failures: u32) -> Duration {
        let shift = failures.saturating_sub(1).min(20);
        self.base.saturating_mul(1u32 << shift).min(self.max)
    }
}

#[derive(Debug)]
struct Inner<K> {
    queue: VecDeque<K>,
    dirty: HashSet<K>,
    processing: HashSet<K>,
    failures: HashMap<K, u32>,
    shut_down: bool,
}

/// A deduplicating, per-key exclusive work queue. Cheap to share through `Arc`.
#[derive(Debug)]
pub struct WorkQueue<K> {
    inner: Mutex<Inner<K>>,
    notify: Notify,
    backoff: Backoff,
}

impl<K: Clone + Eq + Hash + Send + Sync + 'static> WorkQueue<K> {
    /// An empty queue.
    pub fn new(backoff: Backoff) -> Arc<Self> {
        Arc::new(WorkQueue {
            inner: Mutex::new(Inner {
                queue: VecDeque::new(),
                dirty: HashSet::new(),
                processing: HashSet::new(),
                failures: HashMap::new(),
                shut_down: false,
            }),
            notify: Notify::new(),
            backoff,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner<K>> {
        // A poisoned lock only means a panic elsewhere; the sets stay consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `key` (no-op if it is already waiting).
    pub fn add(&self, key: K) {
        let mut g = self.lock();
        if g.shut_down || g.dirty.contains(&key) {
            return;
        }
        g.dirty.insert(key.clone());
        if !g.processing.contains(&key) {
            g.queue.push_back(key);
            drop(g);
            self.notify.notify_one();
        }
    }

    /// Queues `key` after `delay`.
    pub fn add_after(self: &Arc<Self>, key: K, delay: Duration) {
        if delay.is_zero() {
            self.add(key);
            return;
        }
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if let Some(q) = me.upgrade() {
                q.add(key);
            }
        });
    }

    /// Queues `key` after its next backoff delay and counts a failure.
    pub fn add_rate_limited(self: &Arc<Self>, key: K) -> Duration {
        let n = {
            let mut g = self.lock();
            let n = g.failures.entry(key.clone()).or_insert(0);
            *n = n.saturating_add(1);
            *n
        };
        let d = self.backoff.delay(n);
        self.add_after(key, d);
        d
    }

    /// Consecutive failures recorded for `key`.
    pub fn failures(&self, key: &K) -> u32 {
        self.lock().failures.get(key).copied().unwrap_or(0)
    }

    /// Resets `key`'s backoff.
    pub fn forget(&self, key: &K) {
        self.lock().failures.remove(key);
    }

    /// Waits for the next key; `None` once the queue is shut down.
    pub async fn get(&self) -> Option<K> {
        loop {
            let notified = self.notify.notified();
            {
                let mut g = self.lock();
                if g.shut_down {
                    return None;
                }
                if let Some(k) = g.queue.pop_front() {
                    g.dirty.remove(&k);
                    g.processing.insert(k.clone());
                    let more = !g.queue.is_empty();
                    drop(g);
                    if more {
                        // Wake another worker for the rest.
                        self.notify.notify_one();
                    }
                    return Some(k);
                }
            }
            notified.await;
        }
    }

    /// Marks `key` processed; re-queues it if it was added meanwhile.
    pub fn done(&self, key: &K) {
        let mut g = self.lock();
        g.processing.remove(key);
        if g.dirty.contains(key) {
            g.queue.push_back(key.clone());
            drop(g);
            self.notify.notify_one();
        }
    }

    /// Keys waiting (not counting those being processed).
    pub fn len(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether no key is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stops handing out keys; every `get` returns `None`.
    pub fn shut_down(&self) {
        self.lock().shut_down = true;
        self.notify.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dedups_and_requeues_keys_added_while_processing() {
        let q = WorkQueue::new(Backoff::default());
        q.add("a");
        q.add("a");
        q.add("b");
        assert_eq!(q.len(), 2);
        let k = q.get().await;
        assert_eq!(k, Some("a"));
        // Added again while processing: not handed out until done.
        q.add("a");
        assert_eq!(q.get().await, Some("b"));
        assert!(q.is_empty());
        q.done(&"a");
        assert_eq!(q.get().await, Some("a"));
        q.done(&"a");
        q.done(&"b");
        assert!(q.is_empty());
    }

    #[tokio::test]
    async fn backoff_grows_per_key_and_resets() {
        let b = Backoff {
            base: Duration::from_millis(10),
            max: Duration::from_millis(35),
        };
        assert_eq!(b.delay(1), Duration::from_millis(10));
        assert_eq!(b.delay(2), Duration::from_millis(20));
        assert_eq!(b.delay(3), Duration::from_millis(35));
        assert_eq!(b.delay(60), Duration::from_millis(35));
        let q = WorkQueue::new(b);
        assert_eq!(q.add_rate_limited("k"), Duration::from_millis(10));
        assert_eq!(q.add_rate_limited("k"), Duration::from_millis(20));
        assert_eq!(q.failures(&"k"), 2);
        q.forget(&"k");
        assert_eq!(q.failures(&"k"), 0);
        // The delayed add arrives.
        let got = tokio::time::timeout(Duration::from_secs(5), q.get()).await;
        assert_eq!(got.ok().flatten(), Some("k"));
    }

    #[tokio::test]
    async fn shut_down_wakes_waiters() {
        let q: Arc<WorkQueue<u32>> = WorkQueue::new(Backoff::default());
        let q2 = q.clone();
        let h = tokio::spawn(async move { q2.get().await });
        tokio::task::yield_now().await;
        q.shut_down();
        let r = tokio::time::timeout(Duration::from_secs(5), h).await;
        assert!(matches!(r, Ok(Ok(None))));
    }
}
