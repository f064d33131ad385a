// SPDX-License-Identifier: Apache-2.0
//! Request routing and the resource verbs (get, list, watch, create, update,
//! patch, delete, deletecollection) over the store.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::{Map, Value, json};

use super::patch::{PATCH_TYPES, PatchKind, apply_patch};
use super::table::{self, IncludeObject, wants_table};
use super::watch::{self, WatchParams, parse_rv};
use super::{ApiError, ApiState, discovery};
use crate::resources::{FieldValidation, KindInfo, decode_value};
use crate::store::{
    DeleteOptions, FieldSelector, GroupKind, LabelSelector, ListOptions, Propagation, StoreError,
    UpdateScope, WatchOptions,
};

/// Namespaces created at start and never deleted.
pub const SYSTEM_NAMESPACES: &[&str] = &["default", "kube-system", "kube-public"];

type ApiResult = Result<Response, ApiError>;

fn json_response(code: StatusCode, v: &Value) -> Response {
    let mut r = (code, serde_json::to_vec(v).unwrap_or_default()).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn with_warnings(mut r: Response, warnings: &[String]) -> Response {
    for w in warnings.iter().take(32) {
        let text = format!(
            "299 - \"unknown field \\\"{}\\\"\"",
            w.replace(['"', '\\'], "")
        );
        if let Ok(v) = HeaderValue::from_str(&text) {
            r.headers_mut().append(header::WARNING, v);
        }
    }
    r
}

fn query_map(uri: &axum::http::Uri) -> Result<HashMap<String, String>, ApiError> {
    match uri.query() {
        None => Ok(HashMap::new()),
        Some(q) => serde_urlencoded_parse(q),
    }
}

fn serde_urlencoded_parse(q: &str) -> Result<HashMap<String, String>, ApiError> {
    axum::extract::Query::<HashMap<String, String>>::try_from_uri(
        &format!("/?{q}")
            .parse()
            .map_err(|_| ApiError::bad_request("invalid query string"))?,
    )
    .map(|axum::extract::Query(m)| m)
    .map_err(|e| ApiError::bad_request(format!("invalid query string: {e}")))
}

/// A resolved resource URL.
struct Target<'a> {
    kind: &'a KindInfo,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

fn resolve<'a>(
    state: &'a ApiState,
    group: &str,
    version: &str,
    rest: &[&str],
) -> Result<Target<'a>, ApiError> {
    let reg = &state.registry;
    let path = || format!("/{}", rest.join("/"));
    if rest.len() >= 3
        && rest[0] == "namespaces"
        && let Some(kind) = reg.by_plural(group, version, rest[2])
        && kind.namespaced()
    {
        let (name, status) = match &rest[3..] {
            [] => (None, false),
            [name] => (Some(name.to_string()), false),
            [name, "status"] if kind.has_status => (Some(name.to_string()), true),
            _ => return Err(ApiError::no_route(&path())),
        };
        return Ok(Target {
            kind,
            namespace: Some(rest[1].to_string()),
            name,
            status,
        });
    }
    let Some(plural) = rest.first() else {
        return Err(ApiError::no_route(&path()));
    };
    let kind = reg
        .by_plural(group, version, plural)
        .ok_or_else(|| ApiError::no_route(&path()))?;
    let (name, status) = match &rest[1..] {
        [] => (None, false),
        [name] if !kind.namespaced() => (Some(name.to_string()), false),
        [name, "status"] if !kind.namespaced() && kind.has_status => (Some(name.to_string()), true),
        _ => return Err(ApiError::no_route(&path())),
    };
    Ok(Target {
        kind,
        namespace: None,
        name,
        status,
    })
}

/// The single entry point for everything but health checks.
pub async fn dispatch(State(state): State<ApiState>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let res = route(&state, req).await;
    match res {
        Ok(r) => r,
        Err(e) => {
            if e.code >= 500 {
                tracing::warn!(%method, %path, error = %e, "request failed");
            } else {
                tracing::debug!(%method, %path, error = %e, "request refused");
            }
            e.into_response()
        }
    }
}

async fn route(state: &ApiState, req: Request) -> ApiResult {
    let path = req.uri().path().trim_end_matches('/').to_string();
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let get = req.method() == Method::GET;
    let ok = |v: Value| Ok(json_response(StatusCode::OK, &v));
    let not_found = || ApiError::no_route(&path);
    match segs.as_slice() {
        [] if get => ok(
            json!({"paths": ["/api", "/api/v1", "/apis", "/healthz", "/openapi/v3", "/version"]}),
        ),
        ["version"] if get => ok(discovery::version()),
        ["api"] if get => ok(discovery::core_versions()),
        ["apis"] if get => ok(discovery::group_list(&state.registry)),
        ["apis", g] if get => discovery::group(&state.registry, g)
            .map(|v| json_response(StatusCode::OK, &v))
            .ok_or_else(not_found),
        ["api", "v1"] if get => discovery::resource_list(&state.registry, "", "v1")
            .map(|v| json_response(StatusCode::OK, &v))
            .ok_or_else(not_found),
        ["apis", g, v] if get => discovery::resource_list(&state.registry, g, v)
            .map(|v| json_response(StatusCode::OK, &v))
            .ok_or_else(not_found),
        ["openapi", "v3"] if get => Ok(bytes_response(state.openapi.index.clone())),
        ["openapi", "v3", rest @ ..] if get => {
            let key = rest.join("/");
            state
                .openapi
                .docs
                .get(&key)
                .map(|(_, b)| bytes_response(b.clone()))
                .ok_or_else(not_found)
        }
        ["api", "v1", rest @ ..] => {
            let rest: Vec<&str> = rest.to_vec();
            let t = resolve(state, "", "v1", &rest)?;
            resource(state, t, req).await
        }
        ["apis", g, v, rest @ ..] => {
            let (g, v) = (g.to_string(), v.to_string());
            let rest: Vec<&str> = rest.to_vec();
            let t = resolve(state, &g, &v, &rest)?;
            resource(state, t, req).await
        }
        _ if !get
            && matches!(
                segs.first(),
                Some(&"version") | Some(&"api") | Some(&"apis") | Some(&"openapi")
            ) =>
        {
            Err(ApiError::method_not_allowed(req.method().as_str(), &path))
        }
        _ => Err(not_found()),
    }
}

fn bytes_response(b: Bytes) -> Response {
    let mut r = (StatusCode::OK, b).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

async fn read_body(state: &ApiState, body: Body, headers: &HeaderMap) -> Result<Bytes, ApiError> {
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        && len > state.max_body
    {
        return Err(ApiError::too_large(state.max_body));
    }
    match Limited::new(body, state.max_body).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ApiError::too_large(state.max_body))
        }
        Err(e) => Err(ApiError::bad_request(format!(
            "reading the request body: {e}"
        ))),
    }
}

fn content_type(headers: &HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_string()
}

/// Decodes a create/update body (JSON or YAML) into a JSON object.
fn parse_object(headers: &HeaderMap, body: &[u8]) -> Result<Value, ApiError> {
    let ct = content_type(headers);
    let yaml = match ct.as_str() {
        "" | "application/json" | "*/*" => false,
        "application/yaml" | "application/x-yaml" | "text/yaml" => true,
        other => {
            return Err(ApiError::unsupported_media(
                other,
                &["application/json", "application/yaml"],
            ));
        }
    };
    if body.is_empty() {
        return Err(ApiError::bad_request("the request body is empty"));
    }
    decode_value(body, yaml).map_err(|e| ApiError::bad_request(e.to_string()))
}

fn field_validation(q: &HashMap<String, String>) -> Result<FieldValidation, ApiError> {
    let v = q.get("fieldValidation").map(String::as_str).unwrap_or("");
    FieldValidation::parse(v).ok_or_else(|| {
        ApiError::bad_request(format!(
            "fieldValidation must be Strict, Warn or Ignore, not {v:?}"
        ))
    })
}

fn dry_run(q: &HashMap<String, String>) -> Result<bool, ApiError> {
    match q.get("dryRun").map(String::as_str) {
        None | Some("") => Ok(false),
        Some("All") => Ok(true),
        Some(o) => Err(ApiError::bad_request(format!(
            "dryRun must be All, not {o:?}"
        ))),
    }
}

fn meta_str<'a>(v: &'a Value, f: &str) -> Option<&'a str> {
    v.get("metadata")
        .and_then(|m| m.get(f))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

fn set_meta(v: &mut Value, f: &str, val: Value) {
    if let Some(root) = v.as_object_mut() {
        let m = root
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Some(m) = m.as_object_mut() {
            m.insert(f.into(), val);
        }
    }
}

/// Checks `apiVersion`/`kind` against the URL (filling them in when absent)
/// and the namespace against the URL.
fn check_identity(kind: &KindInfo, ns: Option<&str>, obj: &mut Value) -> Result<(), ApiError> {
    let want_av = kind.api_version();
    let root = obj
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("the body must be a JSON object"))?;
    match root.get("apiVersion").and_then(Value::as_str) {
        None => {
            root.insert("apiVersion".into(), Value::String(want_av.clone()));
        }
        Some(av) if av != want_av => {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({av}) does not match the expected API version ({want_av})"
            )));
        }
        _ => {}
    }
    match root.get("kind").and_then(Value::as_str) {
        None => {
            root.insert("kind".into(), Value::String(kind.kind.into()));
        }
        Some(k) if k != kind.kind => {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                kind.kind
            )));
        }
        _ => {}
    }
    if let Some(ns) = ns {
        match meta_str(obj, "namespace") {
            Some(body_ns) if body_ns != ns => {
                return Err(ApiError::bad_request(format!(
                    "the namespace of the provided object ({body_ns}) does not match the namespace sent on the request ({ns})"
                )));
            }
            _ => set_meta(obj, "namespace", Value::String(ns.into())),
        }
    }
    Ok(())
}

async fn ensure_namespace(state: &ApiState, ns: &str) -> Result<(), ApiError> {
    let gk = GroupKind::new("", "Namespace");
    match state.store.get(&gk, "", ns).await {
        Ok(n)
            if n.pointer("/metadata/deletionTimestamp")
                .is_some_and(|d| !d.is_null()) =>
        {
            Err(ApiError::forbidden(format!(
                "unable to create new content in namespace {ns} because it is being terminated"
            )))
        }
        Ok(_) => Ok(()),
        Err(StoreError::NotFound { .. }) => {
            let nk = state.registry.by_plural("", "v1", "namespaces").cloned();
            Err(match nk {
                Some(k) => ApiError::not_found(&k, ns),
                None => ApiError::bad_request(format!("namespace {ns:?} not found")),
            })
        }
        Err(e) => Err(ApiError::internal(e.to_string())),
    }
}

fn accept(headers: &HeaderMap) -> String {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_string()
}

fn check_accept(a: &str) -> Result<(), ApiError> {
    let ok = a.split(',').any(|m| {
        let t = m.split(';').next().unwrap_or("").trim();
        matches!(t, "application/json" | "*/*" | "application/*" | "")
    });
    if ok {
        Ok(())
    } else {
        Err(ApiError::not_acceptable(a))
    }
}

async fn resource(state: &ApiState, t: Target<'_>, req: Request) -> ApiResult {
    let (parts, body) = req.into_parts();
    let q = query_map(&parts.uri)?;
    let kind = t.kind;
    let gk = GroupKind::new(kind.group, kind.kind);
    let ns_store = t.namespace.clone().unwrap_or_default();
    let acc = accept(&parts.headers);
    check_accept(&acc)?;
    let table_mode = if wants_table(&acc) {
        Some(
            IncludeObject::parse(q.get("includeObject").map(String::as_str).unwrap_or(""))
                .ok_or_else(|| {
                    ApiError::bad_request("includeObject must be None, Metadata or Object")
                })?,
        )
    } else {
        None
    };
    let method = parts.method.clone();
    match (&method, t.name.as_deref(), t.status) {
        (&Method::GET, None, _) => {
            let labels =
                LabelSelector::parse(q.get("labelSelector").map(String::as_str).unwrap_or(""))
                    .map_err(|e| ApiError::bad_request(e.to_string()))?;
            let fields =
                FieldSelector::parse(q.get("fieldSelector").map(String::as_str).unwrap_or(""))
                    .map_err(|e| ApiError::bad_request(e.to_string()))?;
            if matches!(q.get("watch").map(String::as_str), Some("true") | Some("1")) {
                let timeout = match q.get("timeoutSeconds") {
                    Some(s) => Duration::from_secs(
                        s.parse::<u64>()
                            .map_err(|_| ApiError::bad_request("timeoutSeconds must be a number"))?
                            .min(86_400),
                    ),
                    None => state.watch_timeout,
                };
                let params = WatchParams {
                    opts: WatchOptions {
                        resource_version: parse_rv(&q)?,
                        labels,
                        fields,
                        progress: false,
                    },
                    bookmarks: q
                        .get("allowWatchBookmarks")
                        .is_some_and(|v| v == "true" || v == "1"),
                    timeout,
                    table: table_mode,
                };
                return watch::serve(state, kind, t.namespace.as_deref(), params).await;
            }
            let limit = match q.get("limit") {
                Some(l) => l
                    .parse::<usize>()
                    .map_err(|_| ApiError::bad_request(format!("invalid limit {l:?}")))?,
                None => 0,
            };
            let opts = ListOptions {
                labels,
                fields,
                limit,
                continue_token: q.get("continue").filter(|c| !c.is_empty()).cloned(),
            };
            let list = state
                .store
                .list(&gk, t.namespace.as_deref(), &opts)
                .await
                .map_err(|e| ApiError::from_store(kind, e))?;
            let rv = list.resource_version.to_string();
            if let Some(include) = table_mode {
                return Ok(json_response(
                    StatusCode::OK,
                    &table::table(
                        kind,
                        &list.items,
                        &rv,
                        list.continue_token.as_deref(),
                        include,
                    ),
                ));
            }
            let mut meta = json!({"resourceVersion": rv});
            if let Some(c) = &list.continue_token {
                meta["continue"] = json!(c);
            }
            if let Some(r) = list.remaining {
                meta["remainingItemCount"] = json!(r);
            }
            Ok(json_response(
                StatusCode::OK,
                &json!({"apiVersion": kind.api_version(), "kind": format!("{}List", kind.kind), "metadata": meta, "items": list.items}),
            ))
        }
        (&Method::POST, None, _) => {
            if kind.namespaced() && t.namespace.is_none() {
                return Err(ApiError::method_not_allowed(
                    "POST",
                    &format!("{} without a namespace", kind.qualified()),
                ));
            }
            let body = read_body(state, body, &parts.headers).await?;
            let mut obj = parse_object(&parts.headers, &body)?;
            check_identity(kind, t.namespace.as_deref(), &mut obj)?;
            create(state, kind, &ns_store, obj, &q).await
        }
        (&Method::DELETE, None, _) => {
            let labels =
                LabelSelector::parse(q.get("labelSelector").map(String::as_str).unwrap_or(""))
                    .map_err(|e| ApiError::bad_request(e.to_string()))?;
            let fields =
                FieldSelector::parse(q.get("fieldSelector").map(String::as_str).unwrap_or(""))
                    .map_err(|e| ApiError::bad_request(e.to_string()))?;
            let list = state
                .store
                .list(
                    &gk,
                    t.namespace.as_deref(),
                    &ListOptions {
                        labels,
                        fields,
                        ..Default::default()
                    },
                )
                .await
                .map_err(|e| ApiError::from_store(kind, e))?;
            let mut deleted = Vec::new();
            for o in list.items {
                let (ons, oname) = (
                    meta_str(&o, "namespace").unwrap_or("").to_string(),
                    meta_str(&o, "name").unwrap_or("").to_string(),
                );
                if kind.kind == "Namespace" && SYSTEM_NAMESPACES.contains(&oname.as_str()) {
                    continue;
                }
                match state
                    .store
                    .delete(&gk, &ons, &oname, &DeleteOptions::default())
                    .await
                {
                    Ok((o, _)) => deleted.push(o),
                    Err(StoreError::NotFound { .. }) => {}
                    Err(e) => return Err(ApiError::from_store(kind, e)),
                }
            }
            Ok(json_response(
                StatusCode::OK,
                &json!({"apiVersion": kind.api_version(), "kind": format!("{}List", kind.kind), "metadata": {"resourceVersion": state.store.resource_version().to_string()}, "items": deleted}),
            ))
        }
        (&Method::GET, Some(name), _) => {
            let obj = state
                .store
                .get(&gk, &ns_store, name)
                .await
                .map_err(|e| ApiError::from_store(kind, e))?;
            if let Some(include) = table_mode {
                let rv = meta_str(&obj, "resourceVersion").unwrap_or("").to_string();
                return Ok(json_response(
                    StatusCode::OK,
                    &table::table(kind, std::slice::from_ref(&obj), &rv, None, include),
                ));
            }
            Ok(json_response(StatusCode::OK, &obj))
        }
        (&Method::PUT, Some(name), status) => {
            let body = read_body(state, body, &parts.headers).await?;
            let mut obj = parse_object(&parts.headers, &body)?;
            check_identity(kind, t.namespace.as_deref(), &mut obj)?;
            match meta_str(&obj, "name") {
                Some(n) if n != name => {
                    return Err(ApiError::bad_request(format!(
                        "the name of the object ({n}) does not match the name on the URL ({name})"
                    )));
                }
                _ => set_meta(&mut obj, "name", Value::String(name.into())),
            }
            let scope = scope_for(kind, status);
            let mode = field_validation(&q)?;
            let (obj, warnings) =
                (kind.decode)(&obj, mode).map_err(|e| ApiError::invalid(kind, name, &e))?;
            if dry_run(&q)? {
                return Ok(json_response(StatusCode::OK, &obj));
            }
            let out = state
                .store
                .update(&gk, &ns_store, obj, scope)
                .await
                .map_err(|e| ApiError::from_store(kind, e))?;
            Ok(with_warnings(
                json_response(StatusCode::OK, &out),
                &warnings,
            ))
        }
        (&Method::PATCH, Some(name), status) => {
            let ct = content_type(&parts.headers);
            let pk = PatchKind::from_content_type(&ct)
                .ok_or_else(|| ApiError::unsupported_media(&ct, PATCH_TYPES))?;
            let body = read_body(state, body, &parts.headers).await?;
            patch(state, kind, &ns_store, name, status, pk, &body, &q).await
        }
        (&Method::DELETE, Some(name), false) => {
            let body = read_body(state, body, &parts.headers).await?;
            delete(state, kind, &ns_store, name, &body, &q).await
        }
        (m, _, _) => Err(ApiError::method_not_allowed(m.as_str(), &kind.qualified())),
    }
}

fn scope_for(kind: &KindInfo, status: bool) -> UpdateScope {
    if status {
        UpdateScope::Status
    } else if kind.has_status {
        UpdateScope::Main
    } else {
        UpdateScope::All
    }
}

async fn create(
    state: &ApiState,
    kind: &KindInfo,
    ns: &str,
    mut obj: Value,
    q: &HashMap<String, String>,
) -> ApiResult {
    let gk = GroupKind::new(kind.group, kind.kind);
    let name = meta_str(&obj, "name")
        .or(meta_str(&obj, "generateName"))
        .unwrap_or("")
        .to_string();
    if meta_str(&obj, "resourceVersion").is_some() {
        return Err(ApiError::bad_request(
            "resourceVersion should not be set on objects to be created",
        ));
    }
    if kind.namespaced() {
        ensure_namespace(state, ns).await?;
    }
    if kind.has_status
        && let Some(root) = obj.as_object_mut()
    {
        root.remove("status");
    }
    let mode = field_validation(q)?;
    let (obj, warnings) =
        (kind.decode)(&obj, mode).map_err(|e| ApiError::invalid(kind, &name, &e))?;
    if dry_run(q)? {
        return Ok(json_response(StatusCode::CREATED, &obj));
    }
    let out = state
        .store
        .create(&gk, ns, obj)
        .await
        .map_err(|e| ApiError::from_store(kind, e))?;
    Ok(with_warnings(
        json_response(StatusCode::CREATED, &out),
        &warnings,
    ))
}

#[allow(clippy::too_many_arguments)]
async fn patch(
    state: &ApiState,
    kind: &KindInfo,
    ns: &str,
    name: &str,
    status: bool,
    pk: PatchKind,
    body: &[u8],
    q: &HashMap<String, String>,
) -> ApiResult {
    let gk = GroupKind::new(kind.group, kind.kind);
    let mode = field_validation(q)?;
    let dry = dry_run(q)?;
    for _attempt in 0..8 {
        let current = match state.store.get(&gk, ns, name).await {
            Ok(c) => c,
            Err(StoreError::NotFound { .. }) if pk == PatchKind::Apply && !status => {
                // Server-side apply creates what does not exist.
                let mut obj =
                    decode_value(body, true).map_err(|e| ApiError::bad_request(e.to_string()))?;
                check_identity(
                    kind,
                    if kind.namespaced() { Some(ns) } else { None },
                    &mut obj,
                )?;
                match meta_str(&obj, "name") {
                    Some(n) if n != name => {
                        return Err(ApiError::bad_request(format!(
                            "the name of the object ({n}) does not match the name on the URL ({name})"
                        )));
                    }
                    _ => set_meta(&mut obj, "name", Value::String(name.into())),
                }
                return create(state, kind, ns, obj, q).await;
            }
            Err(e) => return Err(ApiError::from_store(kind, e)),
        };
        let current_rv = meta_str(&current, "resourceVersion")
            .unwrap_or("")
            .to_string();
        let mut doc = current.clone();
        apply_patch(pk, &mut doc, body)?;
        if meta_str(&doc, "name") != Some(name) {
            return Err(ApiError::bad_request(
                "metadata.name may not be changed by a patch",
            ));
        }
        if kind.namespaced() && meta_str(&doc, "namespace") != Some(ns) {
            return Err(ApiError::bad_request(
                "metadata.namespace may not be changed by a patch",
            ));
        }
        let explicit_rv = meta_str(&doc, "resourceVersion").is_some_and(|rv| rv != current_rv);
        if !explicit_rv {
            set_meta(
                &mut doc,
                "resourceVersion",
                Value::String(current_rv.clone()),
            );
        }
        check_identity(kind, None, &mut doc)?;
        let (obj, warnings) =
            (kind.decode)(&doc, mode).map_err(|e| ApiError::invalid(kind, name, &e))?;
        if dry {
            return Ok(json_response(StatusCode::OK, &obj));
        }
        match state
            .store
            .update(&gk, ns, obj, scope_for(kind, status))
            .await
        {
            Ok(out) => {
                return Ok(with_warnings(
                    json_response(StatusCode::OK, &out),
                    &warnings,
                ));
            }
            Err(StoreError::Conflict { .. }) if !explicit_rv => continue,
            Err(e) => return Err(ApiError::from_store(kind, e)),
        }
    }
    Err(ApiError::from_store(
        kind,
        StoreError::Conflict {
            kind: gk,
            name: name.into(),
            message: "too many concurrent changes; try again".into(),
        },
    ))
}

async fn delete(
    state: &ApiState,
    kind: &KindInfo,
    ns: &str,
    name: &str,
    body: &[u8],
    q: &HashMap<String, String>,
) -> ApiResult {
    let gk = GroupKind::new(kind.group, kind.kind);
    if kind.kind == "Namespace" && kind.group.is_empty() && SYSTEM_NAMESPACES.contains(&name) {
        return Err(ApiError::forbidden(format!(
            "namespaces {name:?} is forbidden: this namespace may not be deleted"
        )));
    }
    let mut opts = DeleteOptions::default();
    let mut policy = q.get("propagationPolicy").cloned();
    let mut dry = dry_run(q)?;
    if !body.iter().all(u8::is_ascii_whitespace) {
        let v: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid DeleteOptions: {e}")))?;
        if let Some(p) = v.get("propagationPolicy").and_then(Value::as_str) {
            policy = Some(p.to_string());
        }
        if let Some(pre) = v.get("preconditions") {
            opts.uid = pre.get("uid").and_then(Value::as_str).map(str::to_string);
            opts.resource_version = pre
                .get("resourceVersion")
                .and_then(Value::as_str)
                .map(str::to_string);
        }
        if let Some(d) = v.get("dryRun").and_then(Value::as_array) {
            dry |= d.iter().any(|x| x == "All");
        }
        // `orphanDependents: true` is the deprecated spelling of Orphan.
        if v.get("orphanDependents").and_then(Value::as_bool) == Some(true) {
            policy = Some("Orphan".into());
        }
    }
    opts.propagation = match policy.as_deref() {
        None | Some("") | Some("Background") => Propagation::Background,
        Some("Foreground") => Propagation::Foreground,
        Some("Orphan") => Propagation::Orphan,
        Some(o) => {
            return Err(ApiError::bad_request(format!(
                "propagationPolicy must be Background, Foreground or Orphan, not {o:?}"
            )));
        }
    };
    if dry {
        let obj = state
            .store
            .get(&gk, ns, name)
            .await
            .map_err(|e| ApiError::from_store(kind, e))?;
        return Ok(json_response(StatusCode::OK, &obj));
    }
    let (obj, removed) = state
        .store
        .delete(&gk, ns, name, &opts)
        .await
        .map_err(|e| ApiError::from_store(kind, e))?;
    Ok(json_response(
        if removed {
            StatusCode::OK
        } else {
            StatusCode::ACCEPTED
        },
        &obj,
    ))
}

/// Decodes and validates a request body the way a create does (content type,
/// JSON/YAML, identity, schema, field validation). Exposed for fuzzing and
/// for embedders that accept manifests through other channels.
pub fn decode_request(
    kind: &KindInfo,
    namespace: Option<&str>,
    content_type: &str,
    body: &[u8],
    mode: FieldValidation,
) -> Result<(Value, Vec<String>), ApiError> {
    let mut headers = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(content_type) {
        headers.insert(header::CONTENT_TYPE, v);
    }
    let mut obj = parse_object(&headers, body)?;
    check_identity(kind, namespace, &mut obj)?;
    let name = meta_str(&obj, "name").unwrap_or("").to_string();
    (kind.decode)(&obj, mode).map_err(|e| ApiError::invalid(kind, &name, &e))
}

/// Applies a PATCH body of `content_type` to `current` and validates the
/// result, as the PATCH verb does (without storing). For fuzzing and embedders.
pub fn patch_and_validate(
    kind: &KindInfo,
    current: &Value,
    content_type: &str,
    body: &[u8],
) -> Result<Value, ApiError> {
    let pk = PatchKind::from_content_type(content_type)
        .ok_or_else(|| ApiError::unsupported_media(content_type, PATCH_TYPES))?;
    let mut doc = current.clone();
    apply_patch(pk, &mut doc, body)?;
    check_identity(kind, None, &mut doc)?;
    let name = meta_str(&doc, "name").unwrap_or("").to_string();
    (kind.decode)(&doc, FieldValidation::Strict)
        .map(|(v, _)| v)
        .map_err(|e| ApiError::invalid(kind, &name, &e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::Registry;

    /// A tiny deterministic generator, so this runs in every `cargo test`
    /// (the cargo-fuzz target `api_decode` explores further).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn mutated_manifests_never_panic() {
        let reg = Registry::default();
        let seeds = [
            include_str!("../../tests/manifests/vm-cirros.yaml"),
            include_str!("../../tests/manifests/vm-fedora-datavolume.yaml"),
            include_str!("../../tests/manifests/vmi-migratable.yaml"),
        ];
        let mut rng = Rng(0x5eed_1234_abcd_9876);
        let mut accepted = 0;
        for round in 0..3000 {
            let seed = seeds[round % seeds.len()];
            let docs: Vec<&str> = seed.split("\n---").collect();
            let mut body: Vec<u8> = docs[round % docs.len()].as_bytes().to_vec();
            for _ in 0..(rng.next() % 4) {
                if body.is_empty() {
                    break;
                }
                let i = (rng.next() as usize) % body.len();
                match rng.next() % 4 {
                    0 => body[i] = (rng.next() % 128) as u8,
                    1 => {
                        body.remove(i);
                    }
                    2 => body.insert(i, b"{}[]:-, \n\"0aZ"[(rng.next() % 13) as usize]),
                    _ => body.truncate(i),
                }
            }
            for kind in reg.kinds() {
                if decode_request(
                    kind,
                    Some("default"),
                    "application/yaml",
                    &body,
                    FieldValidation::Strict,
                )
                .is_ok()
                {
                    accepted += 1;
                }
            }
        }
        assert!(accepted > 100, "some mutants are still valid ({accepted})");
    }

    #[test]
    fn patches_are_validated() {
        let reg = Registry::default();
        let kind = reg
            .by_plural("kubevirt.io", "v1", "virtualmachines")
            .unwrap();
        let body = include_str!("../../tests/manifests/vm-cirros.yaml")
            .split("\n---")
            .nth(2)
            .unwrap();
        let (vm, _) = decode_request(
            kind,
            Some("default"),
            "application/yaml",
            body.as_bytes(),
            FieldValidation::Strict,
        )
        .unwrap();
        assert!(
            patch_and_validate(
                kind,
                &vm,
                "application/merge-patch+json",
                br#"{"spec":{"running":true}}"#
            )
            .is_ok()
        );
        let e = patch_and_validate(
            kind,
            &vm,
            "application/merge-patch+json",
            br#"{"spec":{"runStrategy":"Sometimes"}}"#,
        )
        .unwrap_err();
        assert_eq!(e.code, 422);
        assert!(e.message.contains("spec.runStrategy"), "{}", e.message);
        assert_eq!(
            patch_and_validate(
                kind,
                &vm,
                "application/json-patch+json",
                b"[{\"op\":\"remove\",\"path\":\"/nope\"}]"
            )
            .unwrap_err()
            .code,
            422
        );
    }
}
