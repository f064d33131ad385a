// SPDX-License-Identifier: Apache-2.0
//! The engine shared by every store: state, write transactions with garbage
//! collection, event history and watch streams. Backends only persist batches.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Map, Value};
use tokio::sync::watch;

use super::{
    DeleteOptions, EventType, GroupKind, ListOptions, MAX_OBJECT_BYTES, ObjectList, Propagation,
    StoreError, StoreResult, UpdateScope, WatchEvent, WatchOptions,
};
use crate::resources::common::now;

/// (group, kind, namespace, name).
pub(crate) type ObjKey = (String, String, String, String);

pub(crate) const FOREGROUND: &str = "foregroundDeletion";

/// A committed change, as kept in the history.
#[derive(Clone, Debug)]
pub(crate) struct Event {
    pub rv: u64,
    pub key: ObjKey,
    pub type_: EventType,
    pub object: Arc<Value>,
    pub prev: Option<Arc<Value>>,
}

/// What a batch does to the object table.
#[derive(Debug)]
pub(crate) enum Change {
    Put(ObjKey, Arc<Value>),
    Remove(ObjKey),
}

/// One atomic write: object changes, their events, the new version and the
/// new compaction point (events with `rv <= compacted` are dropped).
#[derive(Debug)]
pub(crate) struct Batch<'a> {
    pub changes: &'a [Change],
    pub events: &'a [Event],
    pub rv: u64,
    pub compacted: u64,
}

/// Persistence of batches. `commit` must be atomic: all or nothing.
pub(crate) trait Backend: Send + Sync + std::fmt::Debug + 'static {
    fn commit(&self, batch: &Batch<'_>) -> StoreResult<()>;
}

/// The in-memory backend: nothing to persist.
#[derive(Debug, Default)]
pub(crate) struct NoBackend;

impl Backend for NoBackend {
    fn commit(&self, _: &Batch<'_>) -> StoreResult<()> {
        Ok(())
    }
}

/// Loaded or fresh state.
#[derive(Debug, Default)]
pub(crate) struct State {
    pub rv: u64,
    pub compacted: u64,
    pub objects: BTreeMap<ObjKey, Arc<Value>>,
    pub uids: HashMap<String, ObjKey>,
    pub history: VecDeque<Event>,
    /// Records a backend could not read back when it opened (skipped).
    pub unreadable: Vec<String>,
}

impl State {
    pub fn insert_loaded(&mut self, key: ObjKey, obj: Value) {
        if let Some(uid) = meta_str(&obj, "uid") {
            self.uids.insert(uid.to_string(), key.clone());
        }
        self.objects.insert(key, Arc::new(obj));
    }
}

#[derive(Debug)]
pub(crate) struct Core<B: Backend> {
    state: Mutex<State>,
    pub backend: B,
    notify: watch::Sender<u64>,
    history_limit: usize,
}

pub(crate) fn meta(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata").and_then(Value::as_object)
}

pub(crate) fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    meta(obj)
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.is_object() {
        *obj = Value::Object(Map::new());
    }
    let root = obj.as_object_mut().expect("made an object above");
    let m = root
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if !m.is_object() {
        *m = Value::Object(Map::new());
    }
    m.as_object_mut().expect("made an object above")
}

fn finalizers(obj: &Value) -> Vec<String> {
    meta(obj)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn set_finalizers(obj: &mut Value, f: &[String]) {
    let m = meta_mut(obj);
    if f.is_empty() {
        m.remove("finalizers");
    } else {
        m.insert("finalizers".into(), Value::from(f.to_vec()));
    }
}

fn owner_uids(obj: &Value) -> Vec<String> {
    meta(obj)
        .and_then(|m| m.get("ownerReferences"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|r| r.get("uid").and_then(Value::as_str).map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// The object without `metadata` and `status`, for generation tracking.
fn spec_part(obj: &Value) -> Value {
    let mut v = obj.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
        m.remove("apiVersion");
        m.remove("kind");
    }
    v
}

/// Deepest JSON nesting an object may have. serde_json refuses to read
/// anything deeper than 128 levels, so an object stored deeper could never
/// be read back (the store would not reopen); refuse it at write time with
/// a margin for the envelopes (lists, watch events) it is sent in.
pub const MAX_OBJECT_DEPTH: usize = 100;

fn depth(v: &Value) -> usize {
    // Iterative: the value itself may be deep enough to overflow a recursion.
    let mut max = 0;
    let mut todo = vec![(v, 1usize)];
    while let Some((v, d)) = todo.pop() {
        max = max.max(d);
        match v {
            Value::Array(a) => todo.extend(a.iter().map(|x| (x, d + 1))),
            Value::Object(o) => todo.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    max
}

/// Checks that `obj` can be stored and read back: at most
/// [`MAX_OBJECT_DEPTH`] levels deep and [`MAX_OBJECT_BYTES`] encoded.
fn check_storable(gk: &GroupKind, name: &str, obj: &Value) -> StoreResult<()> {
    if super::encoded_len_capped(obj, MAX_OBJECT_BYTES).is_none() {
        return Err(StoreError::Invalid {
            kind: gk.clone(),
            name: name.to_string(),
            message: format!("object is larger than the limit of {MAX_OBJECT_BYTES} bytes"),
        });
    }
    let d = depth(obj);
    if d > MAX_OBJECT_DEPTH {
        return Err(StoreError::Invalid {
            kind: gk.clone(),
            name: name.to_string(),
            message: format!(
                "object nests {d} levels deep; at most {MAX_OBJECT_DEPTH} can be stored and read back"
            ),
        });
    }
    Ok(())
}

fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let bytes = uuid::Uuid::new_v4().into_bytes();
    bytes
        .iter()
        .take(5)
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect()
}

/// Changes being prepared against a snapshot of the state.
struct Txn<'a> {
    state: &'a State,
    overlay: BTreeMap<ObjKey, Option<Arc<Value>>>,
    events: Vec<Event>,
    next_rv: u64,
}

impl<'a> Txn<'a> {
    fn new(state: &'a State) -> Self {
        Self {
            state,
            overlay: BTreeMap::new(),
            events: Vec::new(),
            next_rv: state.rv + 1,
        }
    }

    fn get(&self, key: &ObjKey) -> Option<Arc<Value>> {
        match self.overlay.get(key) {
            Some(v) => v.clone(),
            None => self.state.objects.get(key).cloned(),
        }
    }

    fn all(&self) -> Vec<(ObjKey, Arc<Value>)> {
        let mut out: BTreeMap<ObjKey, Arc<Value>> = self.state.objects.clone();
        for (k, v) in &self.overlay {
            match v {
                Some(v) => {
                    out.insert(k.clone(), v.clone());
                }
                None => {
                    out.remove(k);
                }
            }
        }
        out.into_iter().collect()
    }

    fn uid_exists(&self, uid: &str) -> bool {
        if let Some(key) = self.state.uids.get(uid)
            && self
                .get(key)
                .is_some_and(|o| meta_str(&o, "uid") == Some(uid))
        {
            return true;
        }
        self.overlay
            .values()
            .flatten()
            .any(|o| meta_str(o, "uid") == Some(uid))
    }

    fn key_for_uid(&self, uid: &str) -> Option<ObjKey> {
        if let Some(key) = self.state.uids.get(uid)
            && self
                .get(key)
                .is_some_and(|o| meta_str(&o, "uid") == Some(uid))
        {
            return Some(key.clone());
        }
        self.overlay
            .iter()
            .find(|(_, o)| o.as_ref().is_some_and(|o| meta_str(o, "uid") == Some(uid)))
            .map(|(k, _)| k.clone())
    }

    fn put(&mut self, key: &ObjKey, mut obj: Value, type_: EventType) -> Arc<Value> {
        let rv = self.next_rv;
        self.next_rv += 1;
        meta_mut(&mut obj).insert("resourceVersion".into(), Value::String(rv.to_string()));
        let obj = Arc::new(obj);
        let prev = self.get(key);
        self.overlay.insert(key.clone(), Some(obj.clone()));
        self.events.push(Event {
            rv,
            key: key.clone(),
            type_,
            object: obj.clone(),
            prev,
        });
        obj
    }

    fn remove(&mut self, key: &ObjKey, mut last: Value) -> Arc<Value> {
        let rv = self.next_rv;
        self.next_rv += 1;
        meta_mut(&mut last).insert("resourceVersion".into(), Value::String(rv.to_string()));
        let obj = Arc::new(last);
        let prev = self.get(key);
        self.overlay.insert(key.clone(), None);
        self.events.push(Event {
            rv,
            key: key.clone(),
            type_: EventType::Deleted,
            object: obj.clone(),
            prev,
        });
        obj
    }

    fn not_found(key: &ObjKey) -> StoreError {
        StoreError::NotFound {
            kind: GroupKind::new(&key.0, &key.1),
            name: key.3.clone(),
        }
    }

    fn create(&mut self, key_base: (&GroupKind, &str), mut obj: Value) -> StoreResult<Arc<Value>> {
        check_storable(key_base.0, meta_str(&obj, "name").unwrap_or(""), &obj)?;
        let (gk, ns) = key_base;
        let name = match meta_str(&obj, "name") {
            Some(n) => n.to_string(),
            None => match meta_str(&obj, "generateName") {
                Some(prefix) => {
                    let mut n;
                    loop {
                        n = format!("{prefix}{}", random_suffix());
                        if self
                            .get(&(gk.group.clone(), gk.kind.clone(), ns.to_string(), n.clone()))
                            .is_none()
                        {
                            break;
                        }
                    }
                    n
                }
                None => {
                    return Err(StoreError::Invalid {
                        kind: gk.clone(),
                        name: String::new(),
                        message: "metadata.name: Required value: name or generateName is required"
                            .into(),
                    });
                }
            },
        };
        // Names reach host paths (replica directories, import files): no
        // route may store one that is not a plain Kubernetes name.
        crate::names::check_namespace(ns)
            .and_then(|()| crate::names::check_object_name(&gk.group, &name))
            .map_err(|e| StoreError::Invalid {
                kind: gk.clone(),
                name: name.clone(),
                message: e.to_string(),
            })?;
        let key = (
            gk.group.clone(),
            gk.kind.clone(),
            ns.to_string(),
            name.clone(),
        );
        if self.get(&key).is_some() {
            return Err(StoreError::AlreadyExists {
                kind: gk.clone(),
                name,
            });
        }
        let m = meta_mut(&mut obj);
        m.insert("name".into(), Value::String(name));
        if ns.is_empty() {
            m.remove("namespace");
        } else {
            m.insert("namespace".into(), Value::String(ns.to_string()));
        }
        m.insert(
            "uid".into(),
            Value::String(uuid::Uuid::new_v4().to_string()),
        );
        m.insert(
            "creationTimestamp".into(),
            serde_json::to_value(now()).unwrap_or(Value::Null),
        );
        m.insert("generation".into(), Value::from(1));
        m.remove("deletionTimestamp");
        m.remove("deletionGracePeriodSeconds");
        m.remove("selfLink");
        Ok(self.put(&key, obj, EventType::Added))
    }

    fn update(&mut self, key: &ObjKey, new: Value, scope: UpdateScope) -> StoreResult<Value> {
        let old = self.get(key).ok_or_else(|| Self::not_found(key))?;
        let gk = GroupKind::new(&key.0, &key.1);
        let conflict = |message: String| StoreError::Conflict {
            kind: gk.clone(),
            name: key.3.clone(),
            message,
        };
        if let Some(rv) = meta_str(&new, "resourceVersion")
            && Some(rv) != meta_str(&old, "resourceVersion")
        {
            return Err(conflict("the object has been modified; please apply your changes to the latest version and try again".into()));
        }
        if let Some(uid) = meta_str(&new, "uid")
            && Some(uid) != meta_str(&old, "uid")
        {
            return Err(conflict(format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                meta_str(&old, "uid").unwrap_or("")
            )));
        }
        let mut merged = match scope {
            UpdateScope::All => new,
            UpdateScope::Main => {
                let mut n = new;
                if let Some(root) = n.as_object_mut() {
                    match old.get("status") {
                        Some(s) => root.insert("status".into(), s.clone()),
                        None => root.remove("status"),
                    };
                }
                n
            }
            UpdateScope::Status => {
                let mut n = (*old).clone();
                if let Some(root) = n.as_object_mut() {
                    match new.get("status") {
                        Some(s) => root.insert("status".into(), s.clone()),
                        None => root.remove("status"),
                    };
                }
                n
            }
        };
        if let (Some(root), Some(old_root)) = (merged.as_object_mut(), old.as_object()) {
            for f in ["apiVersion", "kind"] {
                if let Some(v) = old_root.get(f) {
                    root.entry(f).or_insert_with(|| v.clone());
                }
            }
        }
        // Immutable and server-owned metadata comes from the stored object.
        let old_meta = meta(&old).cloned().unwrap_or_default();
        {
            let m = meta_mut(&mut merged);
            for f in [
                "name",
                "namespace",
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
            ] {
                match old_meta.get(f) {
                    Some(v) => m.insert(f.into(), v.clone()),
                    None => m.remove(f),
                };
            }
            m.insert(
                "resourceVersion".into(),
                old_meta
                    .get("resourceVersion")
                    .cloned()
                    .unwrap_or(Value::Null),
            );
            m.remove("selfLink");
        }
        let deleting = old_meta.contains_key("deletionTimestamp");
        if deleting {
            let before = finalizers(&old);
            if let Some(added) = finalizers(&merged)
                .into_iter()
                .find(|f| !before.contains(f))
            {
                return Err(StoreError::Invalid {
                    kind: gk,
                    name: key.3.clone(),
                    message: format!(
                        "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers [{added:?}]"
                    ),
                });
            }
        }
        if spec_part(&merged) != spec_part(&old) {
            let g = old_meta
                .get("generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            meta_mut(&mut merged).insert("generation".into(), Value::from(g + 1));
        }
        if merged == *old {
            return Ok(merged);
        }
        if deleting && finalizers(&merged).is_empty() {
            let gone = self.remove(key, merged);
            self.collect_garbage(&gone)?;
            return Ok((*gone).clone());
        }
        check_storable(&gk, &key.3, &merged)?;
        Ok((*self.put(key, merged, EventType::Modified)).clone())
    }

    fn delete(&mut self, key: &ObjKey, opts: &DeleteOptions) -> StoreResult<(Value, bool)> {
        let old = self.get(key).ok_or_else(|| Self::not_found(key))?;
        let gk = GroupKind::new(&key.0, &key.1);
        let conflict = |message: String| StoreError::Conflict {
            kind: gk.clone(),
            name: key.3.clone(),
            message,
        };
        if let Some(uid) = &opts.uid
            && Some(uid.as_str()) != meta_str(&old, "uid")
        {
            return Err(conflict(format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                meta_str(&old, "uid").unwrap_or("")
            )));
        }
        if let Some(rv) = &opts.resource_version
            && Some(rv.as_str()) != meta_str(&old, "resourceVersion")
        {
            return Err(conflict(format!(
                "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                meta_str(&old, "resourceVersion").unwrap_or("")
            )));
        }
        let uid = meta_str(&old, "uid").unwrap_or("").to_string();
        let dependents: Vec<(ObjKey, Arc<Value>)> = if uid.is_empty() {
            Vec::new()
        } else {
            self.all()
                .into_iter()
                .filter(|(_, o)| owner_uids(o).contains(&uid))
                .collect()
        };
        let mut fins = finalizers(&old);
        match opts.propagation {
            Propagation::Orphan => {
                for (dk, d) in dependents {
                    let mut d = (*d).clone();
                    if let Some(refs) = meta_mut(&mut d)
                        .get_mut("ownerReferences")
                        .and_then(Value::as_array_mut)
                    {
                        refs.retain(|r| r.get("uid").and_then(Value::as_str) != Some(uid.as_str()));
                        if refs.is_empty() {
                            meta_mut(&mut d).remove("ownerReferences");
                        }
                    }
                    self.put(&dk, d, EventType::Modified);
                }
            }
            Propagation::Foreground
                if !dependents.is_empty() && !fins.iter().any(|f| f == FOREGROUND) =>
            {
                fins.push(FOREGROUND.to_string());
            }
            _ => {}
        }
        if meta(&old).is_some_and(|m| m.contains_key("deletionTimestamp")) {
            // Already being deleted: only the foreground finalizer may be added.
            if fins != finalizers(&old) {
                let mut o = (*old).clone();
                set_finalizers(&mut o, &fins);
                let o = self.put(key, o, EventType::Modified);
                self.delete_dependents(&dependents_of(self, &uid))?;
                return Ok(((*o).clone(), false));
            }
            return Ok(((*old).clone(), false));
        }
        if !fins.is_empty() {
            let mut o = (*old).clone();
            set_finalizers(&mut o, &fins);
            let m = meta_mut(&mut o);
            m.insert(
                "deletionTimestamp".into(),
                serde_json::to_value(now()).unwrap_or(Value::Null),
            );
            m.insert("deletionGracePeriodSeconds".into(), Value::from(0));
            let o = self.put(key, o, EventType::Modified);
            if opts.propagation == Propagation::Foreground {
                self.delete_dependents(&dependents_of(self, &uid))?;
            }
            return Ok(((*o).clone(), false));
        }
        let gone = self.remove(key, (*old).clone());
        self.collect_garbage(&gone)?;
        Ok(((*gone).clone(), true))
    }

    fn delete_dependents(&mut self, keys: &[ObjKey]) -> StoreResult<()> {
        for k in keys {
            if self.get(k).is_some() {
                self.delete(k, &DeleteOptions::default())?;
            }
        }
        Ok(())
    }

    /// After `gone` was removed: delete dependents left without owners, finish
    /// foreground deletions that waited for it, empty a removed namespace.
    fn collect_garbage(&mut self, gone: &Value) -> StoreResult<()> {
        let uid = meta_str(gone, "uid").unwrap_or("").to_string();
        if !uid.is_empty() {
            let orphans: Vec<ObjKey> = self
                .all()
                .into_iter()
                .filter(|(_, o)| {
                    let owners = owner_uids(o);
                    owners.contains(&uid) && owners.iter().all(|u| !self.uid_exists(u))
                })
                .map(|(k, _)| k)
                .collect();
            self.delete_dependents(&orphans)?;
        }
        // Owners in foreground deletion whose last dependent this was.
        for owner_uid in owner_uids(gone) {
            let Some(okey) = self.key_for_uid(&owner_uid) else {
                continue;
            };
            let Some(owner) = self.get(&okey) else {
                continue;
            };
            let fins = finalizers(&owner);
            if fins.iter().any(|f| f == FOREGROUND) && dependents_of(self, &owner_uid).is_empty() {
                let mut o = (*owner).clone();
                let rest: Vec<String> = fins.into_iter().filter(|f| f != FOREGROUND).collect();
                set_finalizers(&mut o, &rest);
                self.update(&okey, o, UpdateScope::All)?;
            }
        }
        // A removed namespace takes its objects with it.
        if gone.get("kind").and_then(Value::as_str) == Some("Namespace")
            && gone.get("apiVersion").and_then(Value::as_str) == Some("v1")
            && let Some(ns) = meta_str(gone, "name")
        {
            let inside: Vec<ObjKey> = self
                .all()
                .into_iter()
                .filter(|(k, _)| k.2 == ns)
                .map(|(k, _)| k)
                .collect();
            self.delete_dependents(&inside)?;
        }
        Ok(())
    }

    fn into_changes(self) -> (Vec<Change>, Vec<Event>, u64) {
        let changes = self
            .overlay
            .into_iter()
            .map(|(k, v)| match v {
                Some(v) => Change::Put(k, v),
                None => Change::Remove(k),
            })
            .collect();
        (changes, self.events, self.next_rv - 1)
    }
}

fn dependents_of(txn: &Txn<'_>, uid: &str) -> Vec<ObjKey> {
    if uid.is_empty() {
        return Vec::new();
    }
    txn.all()
        .into_iter()
        .filter(|(_, o)| owner_uids(o).iter().any(|u| u == uid))
        .map(|(k, _)| k)
        .collect()
}

/// Continue tokens: hex of `namespace/name` of the last item returned.
fn encode_continue(key: &ObjKey) -> String {
    format!("{}/{}", key.2, key.3)
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn decode_continue(token: &str) -> StoreResult<(String, String)> {
    let bad = || StoreError::BadRequest(format!("invalid continue token {token:?}"));
    if !token.len().is_multiple_of(2) || token.len() > 1024 {
        return Err(bad());
    }
    let bytes: Result<Vec<u8>, _> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&token[i..i + 2], 16))
        .collect();
    let s = String::from_utf8(bytes.map_err(|_| bad())?).map_err(|_| bad())?;
    let (ns, name) = s.split_once('/').ok_or_else(bad)?;
    Ok((ns.to_string(), name.to_string()))
}

impl<B: Backend> Core<B> {
    pub fn new(state: State, backend: B, history_limit: usize) -> Self {
        let (notify, _) = watch::channel(state.rv);
        Self {
            state: Mutex::new(state),
            backend,
            notify,
            history_limit: history_limit.max(1),
        }
    }

    pub(crate) fn unreadable(&self) -> Vec<String> {
        self.lock().unreadable.clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a half-applied batch:
        // state is only mutated after a successful commit, so the data is valid.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn write<R>(&self, f: impl FnOnce(&mut Txn<'_>) -> StoreResult<R>) -> StoreResult<R> {
        let mut st = self.lock();
        let (result, changes, events, rv) = {
            let mut txn = Txn::new(&st);
            let r = f(&mut txn)?;
            let (c, e, rv) = txn.into_changes();
            (r, c, e, rv)
        };
        if events.is_empty() {
            return Ok(result);
        }
        let compacted = self.compaction_point(&st, events.len(), events.iter().map(|e| e.rv));
        self.backend.commit(&Batch {
            changes: &changes,
            events: &events,
            rv,
            compacted,
        })?;
        apply(&mut st, changes, events, rv, compacted);
        drop_guard_then_notify(st, &self.notify, rv);
        Ok(result)
    }

    /// The compaction point once `added` more events (with versions `rvs`)
    /// join the history: the version of the last event the limit drops.
    fn compaction_point(
        &self,
        st: &State,
        added: usize,
        mut rvs: impl Iterator<Item = u64>,
    ) -> u64 {
        let total = st.history.len() + added;
        let drop = total.saturating_sub(self.history_limit);
        if drop == 0 {
            return st.compacted;
        }
        if drop <= st.history.len() {
            return st.history.get(drop - 1).map_or(st.compacted, |e| e.rv);
        }
        rvs.nth(drop - st.history.len() - 1).unwrap_or(st.compacted)
    }

    pub fn create(&self, gk: &GroupKind, ns: &str, obj: Value) -> StoreResult<Value> {
        self.write(|t| t.create((gk, ns), obj).map(|o| (*o).clone()))
    }

    pub fn update(
        &self,
        gk: &GroupKind,
        ns: &str,
        obj: Value,
        scope: UpdateScope,
    ) -> StoreResult<Value> {
        let key = update_key(gk, ns, &obj)?;
        self.write(|t| t.update(&key, obj, scope))
    }

    pub fn delete(
        &self,
        gk: &GroupKind,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> StoreResult<(Value, bool)> {
        let key = (
            gk.group.clone(),
            gk.kind.clone(),
            ns.to_string(),
            name.to_string(),
        );
        self.write(|t| t.delete(&key, opts))
    }

    pub fn get(&self, gk: &GroupKind, ns: &str, name: &str) -> StoreResult<Value> {
        let key = (
            gk.group.clone(),
            gk.kind.clone(),
            ns.to_string(),
            name.to_string(),
        );
        let st = self.lock();
        st.objects
            .get(&key)
            .map(|o| (**o).clone())
            .ok_or_else(|| Txn::not_found(&key))
    }

    pub fn list(
        &self,
        gk: &GroupKind,
        ns: Option<&str>,
        opts: &ListOptions,
    ) -> StoreResult<ObjectList> {
        let st = self.lock();
        list_in(&st.objects, st.rv, gk, ns, opts)
    }

    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    pub fn oldest_watchable(&self) -> u64 {
        self.lock().compacted
    }
}

/// One page of a list over `objects` (sorted by key), at version `rv`.
pub(crate) fn list_in(
    objects: &BTreeMap<ObjKey, Arc<Value>>,
    rv: u64,
    gk: &GroupKind,
    ns: Option<&str>,
    opts: &ListOptions,
) -> StoreResult<ObjectList> {
    let start = opts
        .continue_token
        .as_deref()
        .map(decode_continue)
        .transpose()?;
    let lo = (
        gk.group.clone(),
        gk.kind.clone(),
        ns.unwrap_or("").to_string(),
        String::new(),
    );
    let filter = Filter {
        gk: gk.clone(),
        namespace: ns.map(str::to_string),
        labels: opts.labels.clone(),
        fields: opts.fields.clone(),
        progress: false,
    };
    let mut items = Vec::new();
    let mut last_key = None;
    let mut remaining = 0u64;
    for (k, o) in objects.range(lo..) {
        if k.0 != gk.group || k.1 != gk.kind {
            break;
        }
        if let Some(ns) = ns
            && k.2 != ns
        {
            break;
        }
        if let Some((sns, sname)) = &start
            && (k.2.as_str(), k.3.as_str()) <= (sns.as_str(), sname.as_str())
        {
            continue;
        }
        if !filter.matches(o) {
            continue;
        }
        if opts.limit > 0 && items.len() >= opts.limit {
            remaining += 1;
            continue;
        }
        items.push((**o).clone());
        last_key = Some(k.clone());
    }
    let continue_token = if remaining > 0 {
        last_key.as_ref().map(encode_continue)
    } else {
        None
    };
    Ok(ObjectList {
        items,
        resource_version: rv,
        continue_token,
        remaining: (remaining > 0).then_some(remaining),
    })
}

/// The key an update of `obj` writes (its name is required).
fn update_key(gk: &GroupKind, ns: &str, obj: &Value) -> StoreResult<ObjKey> {
    let name = meta_str(obj, "name").ok_or_else(|| StoreError::Invalid {
        kind: gk.clone(),
        name: String::new(),
        message: "metadata.name: Required value".into(),
    })?;
    Ok(obj_key(gk, ns, name))
}

/// The key of an object.
pub(crate) fn obj_key(gk: &GroupKind, ns: &str, name: &str) -> ObjKey {
    (
        gk.group.clone(),
        gk.kind.clone(),
        ns.to_string(),
        name.to_string(),
    )
}

/// Applies committed changes and their events to the state.
fn apply(st: &mut State, changes: Vec<Change>, events: Vec<Event>, rv: u64, compacted: u64) {
    for c in changes {
        match c {
            Change::Put(k, v) => {
                if let Some(uid) = meta_str(&v, "uid") {
                    st.uids.insert(uid.to_string(), k.clone());
                }
                st.objects.insert(k, v);
            }
            Change::Remove(k) => {
                if let Some(old) = st.objects.remove(&k)
                    && let Some(uid) = meta_str(&old, "uid")
                {
                    st.uids.remove(uid);
                }
            }
        }
    }
    st.history.extend(events);
    while st.history.front().is_some_and(|e| e.rv <= compacted) {
        st.history.pop_front();
    }
    st.compacted = compacted;
    st.rv = rv;
}

fn drop_guard_then_notify(st: MutexGuard<'_, State>, notify: &watch::Sender<u64>, rv: u64) {
    drop(st);
    notify.send_replace(rv);
}

pub(crate) mod remote;
mod watching;

pub(crate) use watching::Filter;

#[cfg(test)]
mod tests;
