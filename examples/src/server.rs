// SPDX-License-Identifier: Apache-2.0
//! Routes the cluster binary adds to the API server (behind its bearer-token
//! authentication):
//!
//! ```text
//!   GET  /metrics                                                     Prometheus text
//!   PUT  /apis/subresources.kubevirt.io/v1/namespaces/N/virtualmachines/V/{start,stop,restart,migrate}
//!   PUT  /apis/subresources.kubevirt.io/v1/namespaces/N/virtualmachineinstances/V/{pause,unpause}
//!   GET  /apis/subresources.kubevirt.io/v1/namespaces/N/virtualmachineinstances/V/console[?follow=false]
//!   POST /apis/subresources.kubevirt.io/v1/namespaces/N/virtualmachineinstances/V/console   body: serial input bytes
//!   POST /apis/subresources.sheaf.dev/v1/nodes/NODE/{kill,restart}
//!   POST /apis/subresources.sheaf.dev/v1/namespaces/N/volumes/V/import   {"image": path, ...}
//! ```
//!
//! The virtual machine verbs have KubeVirt's `virtctl` shapes; the node
//! verbs act on the [`Cluster`]'s nodes (in-process agents, or with
//! `--netns` the node processes in their namespaces).

use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};
use sheaf_orchestrator::images::{ImagePolicy, ImageSourceError};
use sheaf_orchestrator::launcher::files as launcher_files;
use sheaf_orchestrator::launcher::{LauncherCommand, LauncherStatus};
use sheaf_orchestrator::names;
use sheaf_orchestrator::resources::kubevirt::StateChangeRequest;
use sheaf_orchestrator::resources::{
    RunStrategy, VirtualMachine, VirtualMachineInstance, VmiPhase,
};
use sheaf_orchestrator::store::{
    DeleteOptions, GroupKind, Store, StoreError, StoreExt, UpdateScope,
};
use tokio::sync::{Mutex, mpsc};

use crate::cluster::{Cluster, NodeError};
use crate::image::{ImportOptions, ImportProgress, import_image};
use crate::metrics::Metrics;

/// What the routes act on.
#[derive(Debug, Clone)]
pub struct ClusterState {
    /// The cluster's store.
    pub store: Arc<dyn Store>,
    /// The cluster (node kill/restart, node directories).
    pub cluster: Arc<Mutex<Cluster>>,
    /// Metrics registry.
    pub metrics: Metrics,
    /// The cluster's data directory.
    pub data_dir: PathBuf,
    /// Where image files may come from.
    pub images: ImagePolicy,
}

/// A Kubernetes `Status` failure.
#[derive(Debug)]
pub struct Failure {
    code: u16,
    reason: &'static str,
    message: String,
}

impl Failure {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Failure {
            code,
            reason,
            message: message.into(),
        }
    }
    fn not_found(what: &str, ns: &str, name: &str) -> Self {
        Self::new(404, "NotFound", format!("{what} \"{ns}/{name}\" not found"))
    }
    fn conflict(message: impl Into<String>) -> Self {
        Self::new(409, "Conflict", message)
    }
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound { .. } => Failure::new(404, "NotFound", e.to_string()),
            StoreError::Conflict { .. } | StoreError::AlreadyExists { .. } => {
                Failure::conflict(e.to_string())
            }
            other => Failure::new(500, "InternalError", other.to_string()),
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let body = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        });
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            code,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()
    }
}

fn ok(v: Value) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

const KV: &str = "/apis/subresources.kubevirt.io/v1/namespaces/{ns}";
const SHEAF: &str = "/apis/subresources.sheaf.dev/v1";

/// The routes, ready for [`sheaf_orchestrator::api::ApiServerConfig::extra_routes`].
pub fn routes(state: ClusterState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route(
            &format!("{KV}/virtualmachines/{{name}}/{{verb}}"),
            put(vm_verb),
        )
        .route(
            &format!("{KV}/virtualmachineinstances/{{name}}/console"),
            get(console).post(console_input),
        )
        .route(
            &format!("{KV}/virtualmachineinstances/{{name}}/{{verb}}"),
            put(vmi_verb),
        )
        .route(&format!("{SHEAF}/nodes/{{name}}/{{verb}}"), post(node_verb))
        .route(
            &format!("{SHEAF}/namespaces/{{ns}}/volumes/{{name}}/import"),
            post(import),
        )
        .with_state(state)
}

async fn metrics(State(s): State<ClusterState>) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render().await,
    )
        .into_response()
}

/// The instance of a VM if one exists and has not finished.
async fn live_vmi(
    store: &Arc<dyn Store>,
    ns: &str,
    name: &str,
) -> Result<Option<VirtualMachineInstance>, Failure> {
    match store.get_typed::<VirtualMachineInstance>(ns, name).await {
        Ok(v) => {
            let phase = v.status.as_ref().and_then(|s| s.phase);
            let done = matches!(phase, Some(VmiPhase::Succeeded | VmiPhase::Failed));
            Ok((!done && v.metadata.deletion_timestamp.is_none()).then_some(v))
        }
        Err(StoreError::NotFound { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn strategy(vm: &VirtualMachine) -> RunStrategy {
    match (vm.spec.run_strategy, vm.spec.running) {
        (Some(s), _) => s,
        (None, Some(true)) => RunStrategy::Always,
        _ => RunStrategy::Halted,
    }
}

fn set_strategy(vm: &mut VirtualMachine, s: RunStrategy) {
    if vm.spec.running.is_some() && vm.spec.run_strategy.is_none() {
        vm.spec.running = Some(s != RunStrategy::Halted);
    } else {
        vm.spec.running = None;
        vm.spec.run_strategy = Some(s);
    }
}

async fn vm_verb(
    State(s): State<ClusterState>,
    Path((ns, name, verb)): Path<(String, String, String)>,
    body: axum::body::Bytes,
) -> Result<Response, Failure> {
    let store = &s.store;
    let vm: VirtualMachine = match store.get_typed(&ns, &name).await {
        Ok(v) => v,
        Err(StoreError::NotFound { .. }) => {
            return Err(Failure::not_found("virtualmachine", &ns, &name));
        }
        Err(e) => return Err(e.into()),
    };
    let live = live_vmi(store, &ns, &name).await?;
    let strat = strategy(&vm);
    match verb.as_str() {
        "start" => {
            if live.is_some() {
                return Err(Failure::conflict(format!(
                    "VM {ns}/{name} is already running"
                )));
            }
            if strat == RunStrategy::Manual {
                request_state(store, &ns, &name, "Start").await?;
            } else {
                store
                    .modify_typed(&ns, &name, UpdateScope::Main, |vm: &mut VirtualMachine| {
                        set_strategy(vm, RunStrategy::Always)
                    })
                    .await?;
            }
        }
        "stop" => {
            if live.is_none() && strat == RunStrategy::Halted {
                return Err(Failure::conflict(format!("VM {ns}/{name} is not running")));
            }
            if strat == RunStrategy::Manual {
                request_state(store, &ns, &name, "Stop").await?;
            } else {
                store
                    .modify_typed(&ns, &name, UpdateScope::Main, |vm: &mut VirtualMachine| {
                        set_strategy(vm, RunStrategy::Halted)
                    })
                    .await?;
            }
        }
        "restart" => {
            let Some(vmi) = live else {
                return Err(Failure::conflict(format!(
                    "VM {ns}/{name} is not running; use start"
                )));
            };
            if strat == RunStrategy::Halted {
                return Err(Failure::conflict(format!(
                    "VM {ns}/{name} is halted; use start"
                )));
            }
            if strat == RunStrategy::Manual {
                request_state(store, &ns, &name, "Stop").await?;
                request_state(store, &ns, &name, "Start").await?;
            } else {
                let uid = vmi.metadata.uid.clone().unwrap_or_default();
                let opts = DeleteOptions {
                    uid: Some(uid),
                    ..Default::default()
                };
                store
                    .delete(
                        &GroupKind::of::<VirtualMachineInstance>(),
                        &ns,
                        &name,
                        &opts,
                    )
                    .await?;
            }
        }
        "migrate" => {
            let Some(vmi) = live else {
                return Err(Failure::conflict(format!("VM {ns}/{name} is not running")));
            };
            if vmi.status.as_ref().and_then(|s| s.phase) != Some(VmiPhase::Running) {
                return Err(Failure::conflict(format!(
                    "VM {ns}/{name} is not Running yet; migrate it once it runs"
                )));
            }
            // KubeVirt's MigrateOptions: `{"addedNodeSelector": {...}}`.
            let opts: serde_json::Value = if body.is_empty() {
                json!({})
            } else {
                serde_json::from_slice(&body)
                    .map_err(|e| Failure::new(400, "BadRequest", format!("migrate options: {e}")))?
            };
            let mut spec = json!({"vmiName": name});
            match opts.get("addedNodeSelector") {
                None | Some(serde_json::Value::Null) => {}
                Some(sel @ serde_json::Value::Object(m)) if m.values().all(|v| v.is_string()) => {
                    spec["addedNodeSelector"] = sel.clone();
                }
                Some(_) => {
                    return Err(Failure::new(
                        400,
                        "BadRequest",
                        "migrate options: addedNodeSelector must map label names to strings",
                    ));
                }
            }
            let m = json!({
                "apiVersion": "kubevirt.io/v1",
                "kind": "VirtualMachineInstanceMigration",
                "metadata": {"generateName": format!("{name}-migration-"), "namespace": ns},
                "spec": spec,
            });
            let gk = GroupKind::new("kubevirt.io", "VirtualMachineInstanceMigration");
            let created = store.create(&gk, &ns, m).await?;
            return Ok(ok(json!({
                "migration": created["metadata"]["name"],
                "from": vmi.status.as_ref().and_then(|s| s.node_name.clone()),
            })));
        }
        other => {
            return Err(Failure::new(
                404,
                "NotFound",
                format!("unknown virtual machine action {other:?} (start, stop, restart, migrate)"),
            ));
        }
    }
    Ok(ok(json!({})))
}

async fn request_state(
    store: &Arc<dyn Store>,
    ns: &str,
    name: &str,
    action: &str,
) -> Result<(), Failure> {
    store
        .modify_typed(ns, name, UpdateScope::Status, |vm: &mut VirtualMachine| {
            let st = vm.status.get_or_insert_with(Default::default);
            st.state_change_requests
                .get_or_insert_with(Vec::new)
                .push(StateChangeRequest {
                    action: action.to_string(),
                    data: None,
                    uid: None,
                });
        })
        .await?;
    Ok(())
}

/// The running instance `ns/name` and its launcher directory; 404 when
/// neither the instance nor its VM exists, 409 when it does not run.
async fn running_vmi(s: &ClusterState, ns: &str, name: &str) -> Result<PathBuf, Failure> {
    let Some(vmi) = live_vmi(&s.store, ns, name).await? else {
        return match s.store.get_typed::<VirtualMachine>(ns, name).await {
            Ok(_) => Err(Failure::conflict(format!("VM {ns}/{name} is not running"))),
            Err(StoreError::NotFound { .. }) => {
                Err(Failure::not_found("virtualmachineinstance", ns, name))
            }
            Err(e) => Err(e.into()),
        };
    };
    let st = vmi.status.as_ref();
    let node = st.and_then(|s| s.node_name.clone());
    let (Some(VmiPhase::Running), Some(node)) = (st.and_then(|s| s.phase), node) else {
        return Err(Failure::conflict(format!(
            "VM {ns}/{name} is not running yet (instance phase {:?})",
            st.and_then(|s| s.phase)
        )));
    };
    let uid = vmi.metadata.uid.clone().unwrap_or_default();
    let launchers = launchers_dir(s, &node).await?;
    names::child(&launchers, &uid).map_err(|e| Failure::new(500, "InternalError", e.to_string()))
}

/// `nodes/<node>/launchers` for a node named by an object's status (which
/// an API user can write): only one of this cluster's nodes.
async fn launchers_dir(s: &ClusterState, node: &str) -> Result<PathBuf, Failure> {
    let Some(dir) = s.cluster.lock().await.known_node_dir(node) else {
        return Err(Failure::conflict(format!(
            "node {node:?} is not a node of this cluster"
        )));
    };
    Ok(dir.join("launchers"))
}

fn launcher_err(e: impl std::fmt::Display) -> Failure {
    Failure::new(
        503,
        "ServiceUnavailable",
        format!("the VM's launcher does not answer: {e}"),
    )
}

/// Sends `cmd` on the launcher's control socket and waits for its outcome.
async fn launcher_command(
    dir: &std::path::Path,
    cmd: LauncherCommand,
    vm: &str,
) -> Result<(), Failure> {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let sock = sheaf_orchestrator::launcher::connect(dir)
        .await
        .map_err(launcher_err)?;
    let (r, mut w) = sock.into_split();
    let mut lines = BufReader::new(r).lines();
    let mut next = async || -> Result<LauncherStatus, Failure> {
        let line = tokio::time::timeout(Duration::from_secs(15), lines.next_line())
            .await
            .map_err(|_| launcher_err("timed out"))?
            .map_err(launcher_err)?
            .ok_or_else(|| launcher_err("it closed the connection (the VM ended)"))?;
        serde_json::from_str(&line).map_err(launcher_err)
    };
    let first = next().await?;
    match (&cmd, first.paused) {
        (LauncherCommand::Pause, true) => {
            return Err(Failure::conflict(format!("VM {vm} is already paused")));
        }
        (LauncherCommand::Resume, false) => {
            return Err(Failure::conflict(format!("VM {vm} is not paused")));
        }
        _ => {}
    }
    let mut line = serde_json::to_vec(&cmd).map_err(launcher_err)?;
    line.push(b'\n');
    w.write_all(&line).await.map_err(launcher_err)?;
    loop {
        let st = next().await?;
        if st.commands > first.commands {
            return match st.command_error {
                None => Ok(()),
                Some(e) if e.contains("already paused") || e.contains("not paused") => {
                    Err(Failure::conflict(format!("VM {vm}: {e}")))
                }
                Some(e) => Err(Failure::new(
                    500,
                    "InternalError",
                    format!("{cmd:?} of VM {vm} failed: {e}"),
                )),
            };
        }
    }
}

async fn vmi_verb(
    State(s): State<ClusterState>,
    Path((ns, name, verb)): Path<(String, String, String)>,
) -> Result<Response, Failure> {
    let cmd = match verb.as_str() {
        "pause" => LauncherCommand::Pause,
        "unpause" => LauncherCommand::Resume,
        other => {
            return Err(Failure::new(
                404,
                "NotFound",
                format!("unknown instance action {other:?} (pause, unpause, console)"),
            ));
        }
    };
    let dir = running_vmi(&s, &ns, &name).await?;
    launcher_command(&dir, cmd, &format!("{ns}/{name}")).await?;
    // The node agent sets the `Paused` condition from the launcher's status.
    Ok(ok(json!({})))
}

/// Types the request body into the instance's serial console.
async fn console_input(
    State(s): State<ClusterState>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, Failure> {
    use tokio::io::AsyncWriteExt;
    let dir = running_vmi(&s, &ns, &name).await?;
    let mut sock = tokio::net::UnixStream::connect(dir.join(launcher_files::CONSOLE_INPUT))
        .await
        .map_err(|e| {
            Failure::conflict(format!(
                "VM {ns}/{name} takes no console input (its runtime has none): {e}"
            ))
        })?;
    sock.write_all(&body).await.map_err(launcher_err)?;
    sock.shutdown().await.map_err(launcher_err)?;
    Ok(ok(json!({"bytes": body.len()})))
}

#[derive(Deserialize)]
struct ConsoleQuery {
    follow: Option<bool>,
}

/// Reads what `path` holds past `pos` (at most 1 MiB) and advances `pos`.
/// A file shorter than `pos` was rotated (the console log is capped): read
/// the new file from its start.
async fn read_from(path: &std::path::Path, pos: &mut u64) -> Option<Bytes> {
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    let mut f = tokio::fs::File::open(path).await.ok()?;
    let len = f.metadata().await.ok()?.len();
    if len < *pos {
        *pos = 0;
    }
    let want = (len - *pos).min(1 << 20);
    if want == 0 {
        return Some(Bytes::new());
    }
    f.seek(std::io::SeekFrom::Start(*pos)).await.ok()?;
    let mut buf = Vec::with_capacity(want as usize);
    (&mut f).take(want).read_to_end(&mut buf).await.ok()?;
    *pos += buf.len() as u64;
    Some(Bytes::from(buf))
}

/// Streams the serial console of an instance: what it printed so far, then
/// (unless `follow=false`) new output until the instance ends or moves.
async fn console(
    State(s): State<ClusterState>,
    Path((ns, name)): Path<(String, String)>,
    Query(q): Query<ConsoleQuery>,
) -> Result<Response, Failure> {
    // A finished instance still has its console (printed, not followed).
    let vmi: VirtualMachineInstance = match s.store.get_typed(&ns, &name).await {
        Ok(v) => v,
        Err(StoreError::NotFound { .. }) => {
            return Err(Failure::not_found("virtualmachineinstance", &ns, &name));
        }
        Err(e) => return Err(e.into()),
    };
    let finished = matches!(
        vmi.status.as_ref().and_then(|s| s.phase),
        Some(VmiPhase::Succeeded | VmiPhase::Failed)
    );
    let uid = vmi.metadata.uid.clone().unwrap_or_default();
    let Some(node) = vmi.status.as_ref().and_then(|s| s.node_name.clone()) else {
        return Err(Failure::conflict(format!(
            "instance {ns}/{name} is not scheduled yet"
        )));
    };
    let launchers = launchers_dir(&s, &node).await?;
    let bad = |e: names::PathError| Failure::new(500, "InternalError", e.to_string());
    let live = names::child(&launchers, &uid)
        .map_err(bad)?
        .join("console.log");
    let kept = names::child(&launchers, &format!("{uid}.console.log")).map_err(bad)?;
    let follow = q.follow.unwrap_or(true) && !finished;
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let store = s.store.clone();
    tokio::spawn(async move {
        let mut pos = 0u64;
        let mut idle = 0u32;
        loop {
            let path = if live.exists() { &live } else { &kept };
            match read_from(path, &mut pos).await {
                Some(chunk) if !chunk.is_empty() => {
                    if tx.send(chunk).await.is_err() {
                        return;
                    }
                    // More may be waiting: read again at once.
                    continue;
                }
                _ => {}
            }
            if !follow || tx.is_closed() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            idle += 1;
            if idle.is_multiple_of(10) {
                // Stop when the instance is gone, replaced or finished.
                match live_vmi(&store, &ns, &name).await {
                    Ok(Some(v)) if v.metadata.uid.as_deref() == Some(uid.as_str()) => {}
                    _ => {
                        let _ = tx
                            .send(Bytes::from_static(b"\r\n[sheaf: the instance ended]\r\n"))
                            .await;
                        return;
                    }
                }
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(stream),
    )
        .into_response())
}

async fn node_verb(
    State(s): State<ClusterState>,
    Path((name, verb)): Path<(String, String)>,
) -> Result<Response, Failure> {
    let mut c = s.cluster.lock().await;
    let res = match verb.as_str() {
        "kill" => {
            tracing::warn!(node = %name, "killing node on request (kill -9 of its processes)");
            c.kill_node(&name)
        }
        "restart" => c.restart_node(&name).await,
        other => {
            return Err(Failure::new(
                404,
                "NotFound",
                format!("unknown node action {other:?} (kill, restart)"),
            ));
        }
    };
    match res {
        Ok(()) => {}
        Err(e @ NodeError::NoNode { .. }) => {
            return Err(Failure::new(404, "NotFound", e.to_string()));
        }
        Err(e @ NodeError::AlreadyDown(_)) => return Err(Failure::conflict(e.to_string())),
        Err(e) => return Err(Failure::new(500, "InternalError", e.to_string())),
    }
    Ok(ok(json!({"node": name, "action": verb})))
}

/// Query of an upload (`Content-Type: application/octet-stream`): the body
/// is the image itself.
#[derive(Debug, Deserialize)]
struct UploadQuery {
    size: Option<u64>,
    replicas: Option<u32>,
}

fn image_failure(e: &ImageSourceError) -> Failure {
    match e {
        ImageSourceError::NotAllowed { .. } | ImageSourceError::Protocol(_) => {
            Failure::new(403, "Forbidden", e.to_string())
        }
        _ => Failure::new(422, "Invalid", e.to_string()),
    }
}

async fn import(
    State(s): State<ClusterState>,
    Path((ns, name)): Path<(String, String)>,
    Query(q): Query<UploadQuery>,
    headers: axum::http::HeaderMap,
    body: Body,
) -> Result<Response, Failure> {
    // Checked here for an early, clear 422 (the store checks again on create).
    if let Err(e) =
        names::check_namespace(&ns).and_then(|()| names::check_object_name("sheaf.dev", &name))
    {
        return Err(Failure::new(
            422,
            "Invalid",
            format!("Volume {ns}/{name}: {e}"),
        ));
    }
    let upload_ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/octet-stream"));
    let (opts, upload) = if upload_ct {
        let up = crate::upload::receive(
            &s.data_dir.join("uploads"),
            &ns,
            &name,
            body,
            crate::upload::UploadLimits::default(),
        )
        .await
        .map_err(|e| {
            let (code, reason) = e.http_status();
            Failure::new(code, reason, e.to_string())
        })?;
        let opts = ImportOptions {
            image: up.path().to_string_lossy().into_owned(),
            size: q.size,
            replicas: q.replicas,
        };
        (opts, Some(up))
    } else {
        let b = axum::body::to_bytes(body, 1 << 20)
            .await
            .map_err(|e| Failure::new(400, "BadRequest", format!("import body: {e}")))?;
        let opts: ImportOptions = serde_json::from_slice(&b)
            .map_err(|e| Failure::new(400, "BadRequest", format!("import body: {e}")))?;
        // A named host file: only from an image directory.
        s.images
            .resolve(&opts.image)
            .map_err(|e| image_failure(&e))?;
        (opts, None)
    };
    let images = s.images.clone();
    let (tx, rx) = mpsc::channel::<ImportProgress>(64);
    let secret_file = s.cluster.lock().await.secret_file().to_path_buf();
    let store = s.store.clone();
    let metrics = s.metrics.clone();
    let tmp = s.data_dir.join("tmp");
    tokio::spawn(async move {
        let res = import_image(
            &store,
            &secret_file,
            &tmp,
            &images,
            &ns,
            &name,
            &opts,
            &metrics,
            tx.clone(),
        )
        .await;
        drop(upload);
        let last = match res {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(volume = %format!("{ns}/{name}"), error = %e, "image import failed");
                ImportProgress::error(e.to_string())
            }
        };
        let _ = tx.send(last).await;
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let p = rx.recv().await?;
        let mut line = serde_json::to_vec(&p).unwrap_or_default();
        line.push(b'\n');
        Some((Ok::<_, Infallible>(Bytes::from(line)), rx))
    });
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json-seq")],
        Body::from_stream(stream),
    )
        .into_response())
}
