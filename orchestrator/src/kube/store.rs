// SPDX-License-Identifier: Apache-2.0
//! [`KubeStore`]: the orchestrator's [`Store`] over a Kubernetes API server.
//!
//! Every call is one (or two, see below) requests through kube-rs'
//! `Api<DynamicObject>`; the kind's URL comes from the [`Registry`]. Errors
//! are translated here and only here (one foreign boundary, one place):
//!
//! | HTTP / reason            | [`StoreError`]     |
//! |--------------------------|--------------------|
//! | 404                      | `NotFound`         |
//! | 409 `AlreadyExists`      | `AlreadyExists`    |
//! | 409 (stale version, preconditions) | `Conflict` |
//! | 422                      | `Invalid`          |
//! | 410 (`Gone`, `Expired`)  | `Gone`             |
//! | 400                      | `BadRequest`       |
//! | anything else, transport | `Backend`          |
//!
//! Differences from the embedded stores, forced by the Kubernetes API:
//! - Kinds with a `/status` subresource ignore `status` on create and on the
//!   main resource, so [`UpdateScope::All`] is a `PUT` followed by a
//!   `PUT .../status` when the status changed, and a create that carries a
//!   status is followed by a status update. The two requests are not one
//!   transaction: the second may fail with `Conflict` after the first
//!   succeeded; callers retry (as `StoreExt::modify_typed` does) and the
//!   controllers are level-triggered, so they converge.
//! - [`Store::resource_version`] is the highest version seen in any response
//!   (the server's own counter is not readable without a request), and
//!   [`Store::oldest_watchable`] is 0: the server decides, and answers 410.
//! - A watch from "now" (`resource_version: None`) is a list followed by a
//!   watch from the list's version; the listed objects come first as `Added`.
//!   Watches that the server ends (its `timeoutSeconds`) are resumed from the
//!   last version seen, so the stream only ends with an error.
//! - Field selectors are sent to the server: Kubernetes only allows
//!   `metadata.name`, `metadata.namespace` and the CRD's `selectableFields`
//!   (the generated CRDs declare `status.nodeName` for instances).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, PostParams, Preconditions,
    PropagationPolicy, WatchEvent as KubeWatchEvent, WatchParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::Status;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::resources::{KindInfo, Registry};
use crate::store::{
    DeleteOptions, EventType, GroupKind, ListOptions, ObjectList, Propagation, Store, StoreError,
    StoreResult, UpdateScope, WatchEvent, WatchOptions, WatchStream,
};

/// Events buffered between the HTTP watch and a slow consumer.
const WATCH_BUFFER: usize = 256;

/// Failures connecting to a Kubernetes API server.
#[derive(Debug, thiserror::Error)]
pub enum KubeConnectError {
    /// The kubeconfig file could not be read or parsed.
    #[error("reading kubeconfig {path}")]
    ReadKubeconfig {
        /// Path.
        path: String,
        /// Cause.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// The kubeconfig does not describe a usable cluster.
    #[error("kubeconfig {path} has no usable context")]
    Kubeconfig {
        /// Path.
        path: String,
        /// Cause.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// Neither in-cluster settings nor `$KUBECONFIG` / `~/.kube/config` work.
    #[error("finding a Kubernetes configuration")]
    Infer(#[source] kube::config::InferConfigError),
    /// The client could not be built (TLS settings, URL).
    #[error("building the Kubernetes client")]
    Client(#[source] kube::Error),
}

/// A [`Store`] backed by a Kubernetes API server (a real cluster with the
/// CRDs from `deploy/` installed, or sheaf's own API server).
#[derive(Clone)]
pub struct KubeStore {
    client: kube::Client,
    registry: Arc<Registry>,
    /// Highest resourceVersion seen in any response.
    seen: Arc<AtomicU64>,
}

impl std::fmt::Debug for KubeStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeStore")
            .field("seen_resource_version", &self.seen.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl KubeStore {
    /// A store over `client` serving the default registry's kinds.
    pub fn new(client: kube::Client) -> Self {
        Self::with_registry(client, Registry::default())
    }

    /// A store over `client` serving the kinds of `registry`.
    pub fn with_registry(client: kube::Client, registry: Registry) -> Self {
        Self {
            client,
            registry: Arc::new(registry),
            seen: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Connects with a kubeconfig file (its current context).
    pub async fn from_kubeconfig(path: &Path) -> Result<Self, KubeConnectError> {
        let shown = path.display().to_string();
        let kc =
            Kubeconfig::read_from(path).map_err(|source| KubeConnectError::ReadKubeconfig {
                path: shown.clone(),
                source,
            })?;
        let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .map_err(|source| KubeConnectError::Kubeconfig {
                path: shown,
                source,
            })?;
        let client = kube::Client::try_from(config).map_err(KubeConnectError::Client)?;
        Ok(Self::new(client))
    }

    /// Connects like `kubectl` does: in-cluster service account settings,
    /// else `$KUBECONFIG`, else `~/.kube/config`.
    pub async fn infer() -> Result<Self, KubeConnectError> {
        let config = kube::Config::infer()
            .await
            .map_err(KubeConnectError::Infer)?;
        let client = kube::Client::try_from(config).map_err(KubeConnectError::Client)?;
        Ok(Self::new(client))
    }

    /// The kube-rs client.
    pub fn client(&self) -> &kube::Client {
        &self.client
    }

    fn kind_info(&self, kind: &GroupKind) -> StoreResult<&KindInfo> {
        self.registry
            .kinds()
            .iter()
            .find(|k| k.group == kind.group && k.kind == kind.kind)
            .ok_or_else(|| StoreError::BadRequest(format!("kind {kind} is not served")))
    }

    fn api(
        &self,
        kind: &GroupKind,
        namespace: Option<&str>,
    ) -> StoreResult<(Api<DynamicObject>, bool)> {
        let info = self.kind_info(kind)?;
        let ar = ApiResource {
            group: info.group.to_string(),
            version: info.version.to_string(),
            api_version: info.api_version(),
            kind: info.kind.to_string(),
            plural: info.plural.to_string(),
        };
        let api = match namespace {
            Some(ns) if info.namespaced() && !ns.is_empty() => {
                Api::namespaced_with(self.client.clone(), ns, &ar)
            }
            _ => Api::all_with(self.client.clone(), &ar),
        };
        Ok((api, info.has_status))
    }

    fn note(&self, rv: u64) {
        self.seen.fetch_max(rv, Ordering::Relaxed);
    }

    fn out(&self, kind: &GroupKind, obj: DynamicObject) -> StoreResult<Value> {
        let v = from_dyn(kind, obj)?;
        if let Some(rv) = object_rv(&v) {
            self.note(rv);
        }
        Ok(v)
    }
}

fn to_dyn(kind: &GroupKind, obj: &Value) -> StoreResult<DynamicObject> {
    serde_json::from_value(obj.clone())
        .map_err(|e| StoreError::BadRequest(format!("{kind} is not a Kubernetes object: {e}")))
}

fn from_dyn(kind: &GroupKind, obj: DynamicObject) -> StoreResult<Value> {
    serde_json::to_value(obj)
        .map_err(|e| StoreError::Backend(format!("{kind} from the server does not encode: {e}")))
}

fn parse_rv(s: &str) -> StoreResult<u64> {
    s.parse().map_err(|_| {
        StoreError::Backend(format!(
            "resourceVersion {s:?} is not a number (sheaf needs an etcd-backed server)"
        ))
    })
}

fn object_rv(v: &Value) -> Option<u64> {
    v.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok())
}

fn name_of(v: &Value) -> &str {
    v.pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
}

/// The one place where kube-rs errors become [`StoreError`]s.
fn map_err(kind: &GroupKind, name: &str, e: kube::Error) -> StoreError {
    match e {
        kube::Error::Api(status) => map_status(kind, name, &status, 0),
        other => StoreError::Backend(format!("{other}")),
    }
}

fn map_status(kind: &GroupKind, name: &str, s: &Status, requested: u64) -> StoreError {
    let (kind, name, message) = (kind.clone(), name.to_string(), s.message.clone());
    match (s.code, s.reason.as_str()) {
        (404, _) => StoreError::NotFound { kind, name },
        (409, "AlreadyExists") => StoreError::AlreadyExists { kind, name },
        (409, _) => StoreError::Conflict {
            kind,
            name,
            message,
        },
        (422, _) => StoreError::Invalid {
            kind,
            name,
            message,
        },
        (410, _) => StoreError::Gone {
            requested,
            oldest: 0,
        },
        (400, _) => StoreError::BadRequest(message),
        (code, reason) => StoreError::Backend(format!("{code} {reason}: {message}")),
    }
}

fn status_differs(want: &Value, got: &Value) -> bool {
    want.get("status").unwrap_or(&Value::Null) != got.get("status").unwrap_or(&Value::Null)
}

fn with_status_of(mut target: Value, source: &Value) -> Value {
    if let Some(m) = target.as_object_mut() {
        match source.get("status") {
            Some(s) if !s.is_null() => {
                m.insert("status".into(), s.clone());
            }
            _ => {
                m.remove("status");
            }
        }
    }
    target
}

fn list_params(labels: String, fields: String) -> ListParams {
    ListParams {
        label_selector: (!labels.is_empty()).then_some(labels),
        field_selector: (!fields.is_empty()).then_some(fields),
        ..Default::default()
    }
}

#[async_trait]
impl Store for KubeStore {
    async fn create(&self, kind: &GroupKind, namespace: &str, obj: Value) -> StoreResult<Value> {
        let (api, has_status) = self.api(kind, Some(namespace))?;
        let name = name_of(&obj).to_string();
        let created = api
            .create(&PostParams::default(), &to_dyn(kind, &obj)?)
            .await
            .map_err(|e| map_err(kind, &name, e))?;
        let created = self.out(kind, created)?;
        if has_status
            && obj.get("status").is_some_and(|s| !s.is_null())
            && status_differs(&obj, &created)
        {
            let name = name_of(&created).to_string();
            let body = with_status_of(created, &obj);
            let v = api
                .replace_status(&name, &PostParams::default(), &to_dyn(kind, &body)?)
                .await
                .map_err(|e| map_err(kind, &name, e))?;
            return self.out(kind, v);
        }
        Ok(created)
    }

    async fn get(&self, kind: &GroupKind, namespace: &str, name: &str) -> StoreResult<Value> {
        let (api, _) = self.api(kind, Some(namespace))?;
        let v = api.get(name).await.map_err(|e| map_err(kind, name, e))?;
        self.out(kind, v)
    }

    async fn update(
        &self,
        kind: &GroupKind,
        namespace: &str,
        obj: Value,
        scope: UpdateScope,
    ) -> StoreResult<Value> {
        let (api, has_status) = self.api(kind, Some(namespace))?;
        let name = name_of(&obj).to_string();
        if name.is_empty() {
            return Err(StoreError::Invalid {
                kind: kind.clone(),
                name,
                message: "metadata.name: Required value".into(),
            });
        }
        let pp = PostParams::default();
        let body = to_dyn(kind, &obj)?;
        let err = |e| map_err(kind, &name, e);
        if !has_status {
            let v = api.replace(&name, &pp, &body).await.map_err(err)?;
            return self.out(kind, v);
        }
        match scope {
            UpdateScope::Status => {
                let v = api.replace_status(&name, &pp, &body).await.map_err(err)?;
                self.out(kind, v)
            }
            UpdateScope::Main => {
                let v = api.replace(&name, &pp, &body).await.map_err(err)?;
                self.out(kind, v)
            }
            UpdateScope::All => {
                let main = api.replace(&name, &pp, &body).await.map_err(err)?;
                let main = self.out(kind, main)?;
                if !status_differs(&obj, &main) {
                    return Ok(main);
                }
                let body = to_dyn(kind, &with_status_of(main, &obj))?;
                let v = api.replace_status(&name, &pp, &body).await.map_err(err)?;
                self.out(kind, v)
            }
        }
    }

    async fn delete(
        &self,
        kind: &GroupKind,
        namespace: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> StoreResult<(Value, bool)> {
        let (api, _) = self.api(kind, Some(namespace))?;
        let dp = DeleteParams {
            propagation_policy: Some(match opts.propagation {
                Propagation::Background => PropagationPolicy::Background,
                Propagation::Foreground => PropagationPolicy::Foreground,
                Propagation::Orphan => PropagationPolicy::Orphan,
            }),
            preconditions: (opts.uid.is_some() || opts.resource_version.is_some()).then(|| {
                Preconditions {
                    uid: opts.uid.clone(),
                    resource_version: opts.resource_version.clone(),
                }
            }),
            ..Default::default()
        };
        let done = api
            .delete(name, &dp)
            .await
            .map_err(|e| map_err(kind, name, e))?;
        // `Either` is kube's return type; its crate is not a dependency here.
        done.either(
            |obj| {
                let v = self.out(kind, obj)?;
                // Still there while finalizers (including `foregroundDeletion`) hold it.
                let held = v
                    .pointer("/metadata/finalizers")
                    .and_then(Value::as_array)
                    .is_some_and(|f| !f.is_empty());
                Ok((v, !held))
            },
            |status| {
                let info = self.kind_info(kind)?;
                let mut last = json!({
                    "apiVersion": info.api_version(),
                    "kind": info.kind,
                    "metadata": {"name": name},
                });
                if !namespace.is_empty() {
                    last["metadata"]["namespace"] = json!(namespace);
                }
                if let Some(uid) = status.details.as_ref().map(|d| d.uid.clone())
                    && !uid.is_empty()
                {
                    last["metadata"]["uid"] = json!(uid);
                }
                Ok((last, true))
            },
        )
    }

    async fn list(
        &self,
        kind: &GroupKind,
        namespace: Option<&str>,
        opts: &ListOptions,
    ) -> StoreResult<ObjectList> {
        let (api, _) = self.api(kind, namespace)?;
        let mut lp = list_params(opts.labels.to_string(), opts.fields.to_string());
        if opts.limit > 0 {
            lp.limit = Some(u32::try_from(opts.limit).unwrap_or(u32::MAX));
        }
        lp.continue_token = opts.continue_token.clone();
        let list = api.list(&lp).await.map_err(|e| map_err(kind, "", e))?;
        let resource_version = parse_rv(list.metadata.resource_version.as_deref().unwrap_or("0"))?;
        self.note(resource_version);
        let items = list
            .items
            .into_iter()
            .map(|o| from_dyn(kind, o))
            .collect::<StoreResult<Vec<_>>>()?;
        Ok(ObjectList {
            items,
            resource_version,
            continue_token: list.metadata.continue_.filter(|c| !c.is_empty()),
            remaining: list
                .metadata
                .remaining_item_count
                .and_then(|n| u64::try_from(n).ok()),
        })
    }

    async fn watch(
        &self,
        kind: &GroupKind,
        namespace: Option<&str>,
        opts: &WatchOptions,
    ) -> StoreResult<WatchStream> {
        let (api, _) = self.api(kind, namespace)?;
        let labels = opts.labels.to_string();
        let fields = opts.fields.to_string();
        let mut initial = Vec::new();
        let from = match opts.resource_version {
            Some(rv) => rv,
            None => {
                // "Now" = a consistent list, then changes after it.
                let mut lp = list_params(labels.clone(), fields.clone());
                let mut rv = 0;
                loop {
                    let page = api.list(&lp).await.map_err(|e| map_err(kind, "", e))?;
                    if rv == 0 {
                        rv = parse_rv(page.metadata.resource_version.as_deref().unwrap_or("0"))?;
                    }
                    for o in page.items {
                        let object = from_dyn(kind, o)?;
                        let resource_version = object_rv(&object).unwrap_or(rv);
                        initial.push(Ok(WatchEvent {
                            type_: EventType::Added,
                            object,
                            resource_version,
                        }));
                    }
                    match page.metadata.continue_.filter(|c| !c.is_empty()) {
                        Some(c) => lp.continue_token = Some(c),
                        None => break,
                    }
                }
                self.note(rv);
                rv
            }
        };
        let wp = WatchParams {
            label_selector: (!labels.is_empty()).then_some(labels),
            field_selector: (!fields.is_empty()).then_some(fields),
            // Always asked for: they move the resume point forward.
            bookmarks: true,
            ..Default::default()
        };
        // Open the first watch here so that errors (403, 410, bad selector)
        // are returned by this call, as with the embedded stores.
        let first = api
            .watch(&wp, &from.to_string())
            .await
            .map_err(|e| map_err(kind, "", e))?
            .boxed();
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        let pump = Pump {
            api,
            wp,
            kind: kind.clone(),
            progress: opts.progress,
            last: from,
            seen: self.seen.clone(),
            tx,
        };
        tokio::spawn(pump.run(first));
        let live =
            futures::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|ev| (ev, rx)) },
            );
        Ok(Box::pin(futures::stream::iter(initial).chain(live)))
    }

    fn resource_version(&self) -> u64 {
        self.seen.load(Ordering::Relaxed)
    }

    fn oldest_watchable(&self) -> u64 {
        0
    }
}

type KubeEvents =
    futures::stream::BoxStream<'static, Result<KubeWatchEvent<DynamicObject>, kube::Error>>;

/// Forwards one logical watch, reopening the HTTP watch when the server ends it.
struct Pump {
    api: Api<DynamicObject>,
    wp: WatchParams,
    kind: GroupKind,
    progress: bool,
    last: u64,
    seen: Arc<AtomicU64>,
    tx: mpsc::Sender<StoreResult<WatchEvent>>,
}

enum Next {
    /// The server ended the watch normally: resume from `last`.
    Resume,
    /// The consumer is gone or an error was delivered: stop.
    Stop,
}

impl Pump {
    async fn run(mut self, first: KubeEvents) {
        let mut events = first;
        loop {
            match self.forward(&mut events).await {
                Next::Stop => return,
                Next::Resume => {}
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            let from = self.last.to_string();
            let reopened = tokio::select! {
                _ = self.tx.closed() => return,
                r = self.api.watch(&self.wp, &from) => r,
            };
            match reopened {
                Ok(s) => events = s.boxed(),
                Err(e) => {
                    let err = match e {
                        kube::Error::Api(s) => map_status(&self.kind, "", &s, self.last),
                        other => StoreError::Backend(format!("{other}")),
                    };
                    let _ = self.tx.send(Err(err)).await;
                    return;
                }
            }
        }
    }

    async fn forward(&mut self, events: &mut KubeEvents) -> Next {
        loop {
            let item = tokio::select! {
                _ = self.tx.closed() => return Next::Stop,
                item = events.next() => item,
            };
            let out = match item {
                None => return Next::Resume,
                Some(Err(e)) => {
                    let _ = self
                        .tx
                        .send(Err(StoreError::Backend(format!(
                            "watch of {}: {e}",
                            self.kind
                        ))))
                        .await;
                    return Next::Stop;
                }
                Some(Ok(ev)) => match self.convert(ev) {
                    Ok(Some(ev)) => Ok(ev),
                    Ok(None) => continue,
                    Err(e) => Err(e),
                },
            };
            let stop = out.is_err();
            if self.tx.send(out).await.is_err() || stop {
                return Next::Stop;
            }
        }
    }

    fn convert(&mut self, ev: KubeWatchEvent<DynamicObject>) -> StoreResult<Option<WatchEvent>> {
        let (type_, obj) = match ev {
            KubeWatchEvent::Added(o) => (EventType::Added, o),
            KubeWatchEvent::Modified(o) => (EventType::Modified, o),
            KubeWatchEvent::Deleted(o) => (EventType::Deleted, o),
            KubeWatchEvent::Bookmark(b) => {
                let rv = parse_rv(&b.metadata.resource_version)?;
                self.advance(rv);
                return Ok(self.progress.then_some(WatchEvent {
                    type_: EventType::Bookmark,
                    object: Value::Null,
                    resource_version: rv,
                }));
            }
            KubeWatchEvent::Error(s) => return Err(map_status(&self.kind, "", &s, self.last)),
        };
        let object = from_dyn(&self.kind, obj)?;
        let rv = object_rv(&object).ok_or_else(|| {
            StoreError::Backend(format!(
                "watch event of {} without resourceVersion",
                self.kind
            ))
        })?;
        self.advance(rv);
        Ok(Some(WatchEvent {
            type_,
            object,
            resource_version: rv,
        }))
    }

    fn advance(&mut self, rv: u64) {
        self.last = self.last.max(rv);
        self.seen.fetch_max(rv, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, reason: &str) -> Status {
        serde_json::from_value(
            json!({"code": code, "reason": reason, "message": "m", "status": "Failure"}),
        )
        .expect("status")
    }

    #[test]
    fn statuses_map_to_store_errors() {
        let gk = GroupKind::new("kubevirt.io", "VirtualMachine");
        assert!(matches!(
            map_status(&gk, "a", &status(404, "NotFound"), 0),
            StoreError::NotFound { .. }
        ));
        assert!(matches!(
            map_status(&gk, "a", &status(409, "AlreadyExists"), 0),
            StoreError::AlreadyExists { .. }
        ));
        assert!(matches!(
            map_status(&gk, "a", &status(409, "Conflict"), 0),
            StoreError::Conflict { .. }
        ));
        assert!(matches!(
            map_status(&gk, "a", &status(422, "Invalid"), 0),
            StoreError::Invalid { .. }
        ));
        assert_eq!(
            map_status(&gk, "", &status(410, "Expired"), 7),
            StoreError::Gone {
                requested: 7,
                oldest: 0
            }
        );
        assert!(matches!(
            map_status(&gk, "", &status(400, "BadRequest"), 0),
            StoreError::BadRequest(_)
        ));
        assert!(matches!(
            map_status(&gk, "", &status(503, "ServiceUnavailable"), 0),
            StoreError::Backend(_)
        ));
    }

    #[test]
    fn resource_versions_must_be_numbers() {
        assert_eq!(parse_rv("42"), Ok(42));
        assert!(matches!(parse_rv("abc"), Err(StoreError::Backend(_))));
    }

    #[test]
    fn status_is_carried_over_or_removed() {
        let a = json!({"metadata": {"name": "x"}, "status": {"phase": "Running"}});
        let b = json!({"metadata": {"name": "x", "resourceVersion": "3"}});
        assert!(status_differs(&a, &b));
        let merged = with_status_of(b.clone(), &a);
        assert_eq!(merged["status"]["phase"], "Running");
        assert_eq!(merged["metadata"]["resourceVersion"], "3");
        assert!(!status_differs(&a, &merged));
        assert!(with_status_of(merged, &b).get("status").is_none());
    }
}
