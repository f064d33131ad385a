// SPDX-License-Identifier: Apache-2.0
//! Persistent store on redb: every write batch is one redb transaction
//! (durable on commit), and the full object set plus the retained event
//! history are loaded back on open, with the same resourceVersions.
//!
//! Tables: `objects` (`group/kind/namespace/name` → JSON), `events`
//! (`rv` → JSON event, trimmed to the history limit), `meta` (`rv`, `compacted`).

use std::path::Path;
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde_json::{Value, json};

use super::core::{Backend, Batch, Change, Core, Event, ObjKey, State};
use super::memory::{DEFAULT_HISTORY, impl_store};
use super::{EventType, StoreError, StoreResult};

const OBJECTS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("objects");
#[cfg(test)]
pub(crate) const OBJECTS_TABLE: TableDefinition<'_, &str, &[u8]> = OBJECTS;
const EVENTS: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("events");
const META: TableDefinition<'_, &str, u64> = TableDefinition::new("meta");

fn backend_err(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

fn key_string(k: &ObjKey) -> String {
    format!("{}/{}/{}/{}", k.0, k.1, k.2, k.3)
}

fn parse_key(s: &str) -> Option<ObjKey> {
    let mut it = s.splitn(4, '/');
    Some((
        it.next()?.to_string(),
        it.next()?.to_string(),
        it.next()?.to_string(),
        it.next()?.to_string(),
    ))
}

fn event_json(e: &Event) -> Value {
    json!({
        "key": key_string(&e.key),
        "type": e.type_.as_str(),
        "object": *e.object,
        "prev": e.prev.as_deref(),
    })
}

fn parse_event(rv: u64, v: Value) -> Option<Event> {
    let key = parse_key(v.get("key")?.as_str()?)?;
    let type_ = match v.get("type")?.as_str()? {
        "ADDED" => EventType::Added,
        "MODIFIED" => EventType::Modified,
        "DELETED" => EventType::Deleted,
        _ => return None,
    };
    let object = Arc::new(v.get("object")?.clone());
    let prev = v
        .get("prev")
        .filter(|p| !p.is_null())
        .cloned()
        .map(Arc::new);
    Some(Event {
        rv,
        key,
        type_,
        object,
        prev,
    })
}

/// redb persistence for the shared core.
#[derive(Debug)]
pub(crate) struct RedbBackend {
    db: Database,
    /// The directory lock, held while the store is open.
    _lock: sheaf_blockrepl::store::disk::DirLock,
}

impl Backend for RedbBackend {
    fn commit(&self, batch: &Batch<'_>) -> StoreResult<()> {
        let w = self.db.begin_write().map_err(backend_err)?;
        {
            let mut objects = w.open_table(OBJECTS).map_err(backend_err)?;
            for c in batch.changes {
                match c {
                    Change::Put(k, v) => {
                        let bytes = serde_json::to_vec(&**v).map_err(backend_err)?;
                        objects
                            .insert(key_string(k).as_str(), bytes.as_slice())
                            .map_err(backend_err)?;
                    }
                    Change::Remove(k) => {
                        objects
                            .remove(key_string(k).as_str())
                            .map_err(backend_err)?;
                    }
                }
            }
            let mut events = w.open_table(EVENTS).map_err(backend_err)?;
            for e in batch.events {
                let bytes = serde_json::to_vec(&event_json(e)).map_err(backend_err)?;
                events.insert(e.rv, bytes.as_slice()).map_err(backend_err)?;
            }
            events
                .retain_in(..=batch.compacted, |_, _| false)
                .map_err(backend_err)?;
            let mut meta = w.open_table(META).map_err(backend_err)?;
            meta.insert("rv", batch.rv).map_err(backend_err)?;
            meta.insert("compacted", batch.compacted)
                .map_err(backend_err)?;
        }
        w.commit().map_err(backend_err)
    }
}

/// A persistent [`Store`](super::Store) in one redb file.
///
/// All objects are also kept in memory (control-plane data is small); redb is
/// the durable copy. Cloning is cheap and shares the data.
#[derive(Debug, Clone)]
pub struct RedbStore(pub(crate) Arc<Core<RedbBackend>>);

impl RedbStore {
    const BLOCKING: bool = true;

    /// Opens (or creates) the store at `path`, keeping the default history.
    pub fn open(path: impl AsRef<Path>) -> StoreResult<Self> {
        Self::open_with_history(path, DEFAULT_HISTORY)
    }

    /// Opens (or creates) the store at `path`, keeping `events` events for watches.
    pub fn open_with_history(path: impl AsRef<Path>, events: usize) -> StoreResult<Self> {
        let dir = match path.as_ref().parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let lock = super::lock::lock_dir(dir)?;
        super::lock::private_file(path.as_ref())?;
        let shown = path.as_ref().display().to_string();
        // redb trusts its file: pages are only checksummed on recovery, and
        // a corrupt page read later panics inside redb. So the whole file
        // is verified first, and a panic that still escapes while loading
        // becomes an error naming the file (found by the api_store_reload
        // fuzz target).
        let loaded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
            || -> StoreResult<(Database, State)> {
                let mut db = Database::create(path.as_ref()).map_err(backend_err)?;
                match db.check_integrity() {
                    Ok(true) => {}
                    Ok(false) => tracing::warn!(path = %shown, "store file repaired on open"),
                    Err(e) => {
                        return Err(StoreError::Backend(format!(
                            "store file {shown} failed its integrity check: {e}"
                        )));
                    }
                }
                let state = load(&db, events)?;
                Ok((db, state))
            },
        ));
        let (db, state) = match loaded {
            Ok(r) => r?,
            Err(_) => {
                return Err(StoreError::Backend(format!(
                    "store file {shown} is corrupt: reading it failed"
                )));
            }
        };
        tracing::info!(path = %path.as_ref().display(), rv = state.rv, objects = state.objects.len(), unreadable = state.unreadable.len(), "opened redb store");
        Ok(Self(Arc::new(Core::new(
            state,
            RedbBackend { db, _lock: lock },
            events,
        ))))
    }

    /// Records that could not be read back when the store opened (they are
    /// left on disk untouched and are not served).
    pub fn unreadable(&self) -> Vec<String> {
        self.0.unreadable()
    }
}

/// Creates the tables if missing and loads objects, events and counters.
fn load(db: &Database, events: usize) -> StoreResult<State> {
    let mut state = State::default();
    {
        let w = db.begin_write().map_err(backend_err)?;
        {
            w.open_table(OBJECTS).map_err(backend_err)?;
            w.open_table(EVENTS).map_err(backend_err)?;
            w.open_table(META).map_err(backend_err)?;
        }
        w.commit().map_err(backend_err)?;
    }
    let r = db.begin_read().map_err(backend_err)?;
    let meta = r.open_table(META).map_err(backend_err)?;
    state.rv = meta
        .get("rv")
        .map_err(backend_err)?
        .map(|v| v.value())
        .unwrap_or(0);
    state.compacted = meta
        .get("compacted")
        .map_err(backend_err)?
        .map(|v| v.value())
        .unwrap_or(0);
    let objects = r.open_table(OBJECTS).map_err(backend_err)?;
    // A record that cannot be read back is skipped and reported, not
    // fatal: one bad object must not keep every other one offline.
    for item in objects.iter().map_err(backend_err)? {
        let (k, v) = item.map_err(backend_err)?;
        let parsed = parse_key(k.value())
            .ok_or_else(|| "bad key".to_string())
            .and_then(|key| {
                serde_json::from_slice::<Value>(v.value())
                    .map(|obj| (key, obj))
                    .map_err(|e| e.to_string())
            });
        match parsed {
            Ok((key, obj)) => state.insert_loaded(key, obj),
            Err(e) => {
                tracing::error!(key = %k.value(), error = %e, "store record unreadable; skipped");
                state
                    .unreadable
                    .push(format!("object {:?}: {e}", k.value()));
            }
        }
    }
    let evs = r.open_table(EVENTS).map_err(backend_err)?;
    let mut bad_events = false;
    for item in evs.iter().map_err(backend_err)? {
        let (k, v) = item.map_err(backend_err)?;
        let ev = serde_json::from_slice::<Value>(v.value())
            .ok()
            .and_then(|val| parse_event(k.value(), val));
        match ev {
            Some(ev) => state.history.push_back(ev),
            None => {
                tracing::error!(rv = k.value(), "store event unreadable; skipped");
                state.unreadable.push(format!("event {}", k.value()));
                bad_events = true;
            }
        }
    }
    if bad_events {
        // The history has a hole: watches from before now must relist.
        state.history.clear();
        state.compacted = state.rv;
    }
    // Keep only what the (possibly smaller) limit allows.
    while state.history.len() > events.max(1) {
        if let Some(e) = state.history.pop_front() {
            state.compacted = e.rv;
        }
    }
    drop((meta, objects, evs, r));
    Ok(state)
}

impl_store!(RedbStore);
