// SPDX-License-Identifier: Apache-2.0
//! Discovery documents (`/api`, `/apis`, `/apis/<g>/<v>`, `/version`) and
//! OpenAPI v3 (`/openapi/v3`, `/openapi/v3/apis/<g>/<v>`), generated from the
//! registry and the types' JSON schemas.
//!
//! kubectl reads the OpenAPI v3 document to learn that PATCH accepts the
//! `fieldValidation` parameter (so it leaves validation to the server) and
//! that strategic merge patch is not offered (so `apply` sends JSON merge
//! patches, as for any custom resource); `kubectl explain` reads the schemas.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use serde_json::{Map, Value, json};

use crate::resources::{KindInfo, Registry};

/// Kubernetes version reported by `/version`.
pub const KUBE_MINOR: &str = "32";

/// `/version`.
pub fn version() -> Value {
    json!({
        "major": "1",
        "minor": KUBE_MINOR,
        "gitVersion": format!("v1.{KUBE_MINOR}.0-sheaf.{}", env!("CARGO_PKG_VERSION")),
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
        "goVersion": "n/a (rust)",
        "compiler": "rustc",
        "platform": format!("{}/{}", std::env::consts::OS, if cfg!(target_arch = "x86_64") { "amd64" } else { std::env::consts::ARCH }),
    })
}

/// `/api`.
pub fn core_versions() -> Value {
    json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
}

fn group_json(group: &str, version: &str) -> Value {
    let gv = json!({"groupVersion": format!("{group}/{version}"), "version": version});
    json!({"name": group, "versions": [gv.clone()], "preferredVersion": gv})
}

/// `/apis`.
pub fn group_list(reg: &Registry) -> Value {
    let groups: Vec<Value> = reg
        .groups()
        .into_iter()
        .filter(|(g, _)| !g.is_empty())
        .map(|(g, v)| group_json(g, v))
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `/apis/<group>`.
pub fn group(reg: &Registry, group: &str) -> Option<Value> {
    reg.groups()
        .into_iter()
        .find(|(g, _)| *g == group && !g.is_empty())
        .map(|(g, v)| {
            let mut doc = group_json(g, v);
            doc["kind"] = json!("APIGroup");
            doc["apiVersion"] = json!("v1");
            doc
        })
}

/// `/api/v1` or `/apis/<group>/<version>`.
pub fn resource_list(reg: &Registry, group: &str, version: &str) -> Option<Value> {
    let kinds: Vec<&KindInfo> = reg
        .kinds()
        .iter()
        .filter(|k| k.group == group && k.version == version)
        .collect();
    if kinds.is_empty() {
        return None;
    }
    let mut resources = Vec::new();
    for k in kinds {
        resources.push(json!({
            "name": k.plural,
            "singularName": k.singular,
            "namespaced": k.namespaced(),
            "kind": k.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
            "shortNames": k.short_names,
            "categories": if k.group.is_empty() { json!([]) } else { json!(["all"]) },
        }));
        if k.has_status {
            resources.push(json!({
                "name": format!("{}/status", k.plural),
                "singularName": "",
                "namespaced": k.namespaced(),
                "kind": k.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}),
    )
}

fn gvk(k: &KindInfo) -> Value {
    json!({"group": k.group, "version": k.version, "kind": k.kind})
}

fn query_param(name: &str, description: &str) -> Value {
    json!({"name": name, "in": "query", "description": description, "schema": {"type": "string", "uniqueItems": true}})
}

fn operation(k: &KindInfo, action: &str, schema_ref: &Value, id: &str) -> Value {
    let mut op = json!({
        "operationId": id,
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": gvk(k),
        "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": schema_ref}}}},
        "parameters": [],
    });
    let mut params = vec![query_param("pretty", "pretty-print the output")];
    match action {
        "post" | "put" | "patch" => {
            params.push(query_param("dryRun", "All: do not persist"));
            params.push(query_param(
                "fieldManager",
                "name of the actor making the change",
            ));
            params.push(query_param(
                "fieldValidation",
                "Strict (default), Warn or Ignore unknown fields",
            ));
        }
        "list" | "watch" | "watchlist" => {
            for p in [
                "labelSelector",
                "fieldSelector",
                "limit",
                "continue",
                "resourceVersion",
                "watch",
                "allowWatchBookmarks",
                "timeoutSeconds",
            ] {
                params.push(query_param(p, p));
            }
        }
        _ => {}
    }
    if action == "patch" {
        params.push(query_param("force", "force apply"));
        op["requestBody"] = json!({"content": {
            "application/json-patch+json": {"schema": {"type": "object"}},
            "application/merge-patch+json": {"schema": {"type": "object"}},
            "application/apply-patch+yaml": {"schema": {"type": "object"}},
        }});
    }
    if action == "post" || action == "put" {
        op["requestBody"] = json!({"content": {"*/*": {"schema": schema_ref}}, "required": true});
    }
    op["parameters"] = Value::Array(params);
    op
}

fn schema_key(k: &KindInfo, name: &str) -> String {
    let rev: Vec<&str> = k.group.split('.').rev().collect();
    let prefix = if k.group.is_empty() {
        "io.k8s.api.core".to_string()
    } else {
        rev.join(".")
    };
    format!("{prefix}.{}.{name}", k.version)
}

/// Rewrites schemars output into Kubernetes' structural style: `Option<T>`'s
/// `anyOf [T, null]` becomes `T` with `nullable`, and a `oneOf` of
/// single-value string enums (documented enum variants) becomes one
/// `type: string` + `enum`, which `kubectl explain` and CRD validation expect.
pub fn structural(v: &mut Value) {
    match v {
        Value::Array(a) => a.iter_mut().for_each(structural),
        Value::Object(m) => {
            m.values_mut().for_each(structural);
            if let Some(Value::Array(any)) = m.get("anyOf") {
                let non_null: Vec<&Value> = any
                    .iter()
                    .filter(|s| s.get("enum") != Some(&json!([null])))
                    .collect();
                if non_null.len() == 1 && any.len() == 2 {
                    let inner = non_null[0].clone();
                    m.remove("anyOf");
                    if let Value::Object(im) = inner {
                        for (k, val) in im {
                            if k == "description" && m.contains_key("description") {
                                continue;
                            }
                            m.insert(k, val);
                        }
                    }
                    m.insert("nullable".into(), Value::Bool(true));
                }
            }
            if let Some(Value::Array(one)) = m.get("oneOf") {
                let values: Option<Vec<Value>> = one
                    .iter()
                    .map(
                        |s| match (s.get("type"), s.get("enum").and_then(Value::as_array)) {
                            (Some(t), Some(e)) if t == "string" && e.len() == 1 => {
                                Some(e[0].clone())
                            }
                            _ => s.get("const").cloned(),
                        },
                    )
                    .collect();
                if let Some(values) = values {
                    m.remove("oneOf");
                    m.insert("type".into(), json!("string"));
                    m.insert("enum".into(), Value::Array(values));
                }
            }
        }
        _ => {}
    }
}

/// The OpenAPI v3 document of one group/version.
pub fn openapi_v3_group(reg: &Registry, group: &str, version: &str) -> Option<Value> {
    let kinds: Vec<&KindInfo> = reg
        .kinds()
        .iter()
        .filter(|k| k.group == group && k.version == version)
        .collect();
    if kinds.is_empty() {
        return None;
    }
    let mut generator = schemars::generate::SchemaSettings::openapi3().into_generator();
    let mut roots = Vec::new();
    for k in &kinds {
        let r = (k.schema)(&mut generator);
        roots.push((k, r));
    }
    let defs: Map<String, Value> = generator.take_definitions(true);
    // Rename definitions to Kubernetes-style keys for the roots; keep the rest.
    let mut schemas: Map<String, Value> = defs;
    let mut paths = Map::new();
    for (k, root) in roots {
        let plain = (k.schema_name)();
        let key = schema_key(k, k.kind);
        let mut schema = schemas.remove(&plain).unwrap_or_else(|| root.to_value());
        if let Some(o) = schema.as_object_mut() {
            o.insert("x-kubernetes-group-version-kind".into(), json!([gvk(k)]));
        }
        schemas.insert(key.clone(), schema);
        let r = json!({"$ref": format!("#/components/schemas/{key}")});
        let base = if group.is_empty() {
            format!("/api/{version}")
        } else {
            format!("/apis/{group}/{version}")
        };
        let (coll, item) = if k.namespaced() {
            (
                format!("{base}/namespaces/{{namespace}}/{}", k.plural),
                format!("{base}/namespaces/{{namespace}}/{}/{{name}}", k.plural),
            )
        } else {
            (
                format!("{base}/{}", k.plural),
                format!("{base}/{}/{{name}}", k.plural),
            )
        };
        let id = |verb: &str| format!("{verb}{}", k.kind);
        paths.insert(
            coll.clone(),
            json!({
                "get": operation(k, "list", &r, &id("list")),
                "post": operation(k, "post", &r, &id("create")),
                "delete": operation(k, "deletecollection", &r, &id("deleteCollection")),
            }),
        );
        paths.insert(
            item.clone(),
            json!({
                "get": operation(k, "get", &r, &id("read")),
                "put": operation(k, "put", &r, &id("replace")),
                "patch": operation(k, "patch", &r, &id("patch")),
                "delete": operation(k, "delete", &r, &id("delete")),
            }),
        );
        if k.has_status {
            let mut status_patch = operation(k, "patch", &r, &id("patchStatus"));
            status_patch["operationId"] = json!(id("patchStatus"));
            paths.insert(
                format!("{item}/status"),
                json!({
                    "get": operation(k, "get", &r, &id("readStatus")),
                    "put": operation(k, "put", &r, &id("replaceStatus")),
                    "patch": status_patch,
                }),
            );
        }
    }
    for schema in schemas.values_mut() {
        structural(schema);
    }
    let title = if group.is_empty() {
        "Kubernetes core".to_string()
    } else {
        format!("sheaf {group}")
    };
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": title, "version": format!("v1.{KUBE_MINOR}.0")},
        "paths": paths,
        "components": {"schemas": schemas},
    }))
}

/// All OpenAPI v3 documents, keyed by their path (`apis/kubevirt.io/v1`,
/// `api/v1`), plus the index served at `/openapi/v3`.
#[derive(Debug, Clone)]
pub struct OpenApiDocs {
    /// Path → (hash, JSON bytes).
    pub docs: BTreeMap<String, (String, bytes::Bytes)>,
    /// The `/openapi/v3` index.
    pub index: bytes::Bytes,
}

impl OpenApiDocs {
    /// Generates every document once.
    pub fn build(reg: &Registry) -> Self {
        let mut docs = BTreeMap::new();
        let mut index = Map::new();
        for (g, v) in reg.groups() {
            let Some(doc) = openapi_v3_group(reg, g, v) else {
                continue;
            };
            let bytes = serde_json::to_vec(&doc).unwrap_or_default();
            let mut h = DefaultHasher::new();
            bytes.hash(&mut h);
            let hash = format!("{:016X}", h.finish());
            let path = if g.is_empty() {
                format!("api/{v}")
            } else {
                format!("apis/{g}/{v}")
            };
            index.insert(
                path.clone(),
                json!({"serverRelativeURL": format!("/openapi/v3/{path}?hash={hash}")}),
            );
            docs.insert(path, (hash, bytes::Bytes::from(bytes)));
        }
        let index =
            bytes::Bytes::from(serde_json::to_vec(&json!({"paths": index})).unwrap_or_default());
        Self { docs, index }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openapi_has_gvk_and_field_validation() {
        let reg = Registry::default();
        let doc = openapi_v3_group(&reg, "kubevirt.io", "v1").unwrap();
        let vm = &doc["components"]["schemas"]["io.kubevirt.v1.VirtualMachine"];
        assert_eq!(
            vm["x-kubernetes-group-version-kind"][0]["kind"],
            "VirtualMachine"
        );
        let patch = &doc["paths"]["/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachines/{name}"]
            ["patch"];
        assert!(
            patch["parameters"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["name"] == "fieldValidation")
        );
        assert!(
            patch["requestBody"]["content"]
                .get("application/strategic-merge-patch+json")
                .is_none()
        );
        // References resolve inside the document.
        let text = serde_json::to_string(&doc).unwrap();
        for r in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
            let name = &r[..r.find('"').unwrap()];
            assert!(
                doc["components"]["schemas"].get(name).is_some(),
                "dangling $ref {name}"
            );
        }
        let rs = &doc["components"]["schemas"]["VirtualMachineSpec"]["properties"]["runStrategy"];
        assert_eq!(rs["type"], "string", "{rs}");
        assert_eq!(
            rs["enum"],
            json!(["Always", "RerunOnFailure", "Once", "Manual", "Halted"])
        );
        let ns = openapi_v3_group(&reg, "", "v1").unwrap();
        assert!(
            ns["components"]["schemas"]
                .get("io.k8s.api.core.v1.Namespace")
                .is_some()
        );
    }

    #[test]
    fn discovery_lists_kinds() {
        let reg = Registry::default();
        let list = resource_list(&reg, "kubevirt.io", "v1").unwrap();
        let names: Vec<&str> = list["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        assert!(
            names.contains(&"virtualmachines") && names.contains(&"virtualmachineinstances/status")
        );
        let groups = group_list(&reg);
        assert_eq!(groups["groups"].as_array().unwrap().len(), 3);
        assert!(resource_list(&reg, "", "v1").unwrap()["resources"][0]["name"] == "namespaces");
    }
}
