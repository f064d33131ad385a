// SPDX-License-Identifier: Apache-2.0
//! CustomResourceDefinitions generated from the resource types.
//!
//! The schemas come from the same `schemars::JsonSchema` derives that feed
//! the API server's `/openapi/v3` documents, generated the way
//! `#[derive(kube::CustomResource)]` does it (OpenAPI 3 settings, every
//! subschema inlined, kube-core's structural rewriters), then made
//! structural with [`discovery::structural`] and checked by
//! [`check_structural`]. `metadata` is `type: object`, as in every CRD: the
//! API server owns its schema.

use schemars::transform::Transform;
use serde_json::{Map, Value, json};

use crate::api::discovery;
use crate::resources::{KindInfo, Registry, Scope};

/// Field selectors each kind must allow (CRD `selectableFields`,
/// Kubernetes 1.32+): the controllers and agents select instances by node.
fn selectable_fields(k: &KindInfo) -> Vec<Value> {
    match (k.group, k.kind) {
        ("kubevirt.io", "VirtualMachineInstance") => {
            vec![json!({"jsonPath": ".status.nodeName"})]
        }
        _ => Vec::new(),
    }
}

/// `kubectl get` columns for a kind, as JSON paths (the sheaf API server
/// computes the same columns in `Resource::table_row`).
fn printer_columns(k: &KindInfo) -> Vec<Value> {
    let col = |name: &str, type_: &str, path: &str| json!({"name": name, "type": type_, "jsonPath": path});
    let age = col("Age", "date", ".metadata.creationTimestamp");
    match (k.group, k.kind) {
        ("kubevirt.io", "VirtualMachine") => vec![
            age,
            col("Status", "string", ".status.printableStatus"),
            col("Ready", "boolean", ".status.ready"),
        ],
        ("kubevirt.io", "VirtualMachineInstance") => vec![
            age,
            col("Phase", "string", ".status.phase"),
            col("NodeName", "string", ".status.nodeName"),
        ],
        ("kubevirt.io", "VirtualMachineInstanceMigration") => vec![
            col("Phase", "string", ".status.phase"),
            col("VMI", "string", ".spec.vmiName"),
            age,
        ],
        _ => vec![age],
    }
}

/// The `openAPIV3Schema` of a kind.
pub fn crd_schema(k: &KindInfo) -> Value {
    let mut generator = schemars::generate::SchemaSettings::openapi3()
        .with(|s| {
            s.inline_subschemas = true;
            s.meta_schema = None;
        })
        .into_generator();
    let mut schema = (k.schema)(&mut generator);
    schemars::transform::AddNullable::default().transform(&mut schema);
    kube::core::schema::StructuralSchemaRewriter.transform(&mut schema);
    kube::core::schema::OptionalEnum.transform(&mut schema);
    kube::core::schema::OptionalIntOrString.transform(&mut schema);
    let mut v = schema.to_value();
    hoist_nullable(&mut v);
    discovery::structural(&mut v);
    clean(&mut v);
    if let Some(m) = v.as_object_mut() {
        m.remove("title");
        m.insert("type".into(), json!("object"));
        if let Some(Value::Object(props)) = m.get_mut("properties") {
            props.insert("metadata".into(), json!({"type": "object"}));
        }
    }
    v
}

fn is_null_schema(s: &Value) -> bool {
    s.get("const") == Some(&Value::Null)
        || s.get("enum") == Some(&json!([null]))
        || s.get("type") == Some(&json!("null"))
}

/// `Option<T>` comes out of schemars as `anyOf: [T, null]`; a CRD wants `T`
/// with `nullable: true`.
fn hoist_nullable(v: &mut Value) {
    match v {
        Value::Array(a) => a.iter_mut().for_each(hoist_nullable),
        Value::Object(m) => {
            m.values_mut().for_each(hoist_nullable);
            let Some(Value::Array(any)) = m.get("anyOf") else {
                return;
            };
            if any.len() != 2 || !any.iter().any(is_null_schema) {
                return;
            }
            let Some(Value::Object(inner)) = any.iter().find(|s| !is_null_schema(s)).cloned()
            else {
                return;
            };
            m.remove("anyOf");
            for (k, val) in inner {
                if k == "description" && m.contains_key("description") {
                    continue;
                }
                m.insert(k, val);
            }
            m.insert("nullable".into(), Value::Bool(true));
        }
        _ => {}
    }
}

/// Drops what CRD schemas do not accept (`$schema`, `title`, `uniqueItems`)
/// and gives untyped values (`serde_json::Value` fields) the
/// `x-kubernetes-preserve-unknown-fields` marker.
fn clean(v: &mut Value) {
    match v {
        Value::Array(a) => a.iter_mut().for_each(clean),
        Value::Object(m) => {
            m.remove("$schema");
            m.remove("title");
            m.remove("uniqueItems");
            for key in ["properties"] {
                if let Some(Value::Object(props)) = m.get_mut(key) {
                    for p in props.values_mut() {
                        mark_untyped(p);
                        clean(p);
                    }
                }
            }
            for key in ["items", "additionalProperties"] {
                if let Some(p) = m.get_mut(key) {
                    if p.is_object() {
                        mark_untyped(p);
                    }
                    clean(p);
                }
            }
            for key in ["anyOf", "oneOf", "allOf"] {
                if let Some(p) = m.get_mut(key) {
                    clean(p);
                }
            }
        }
        _ => {}
    }
}

fn mark_untyped(p: &mut Value) {
    let Some(m) = p.as_object_mut() else {
        // `true` (any value) as a property schema.
        if *p == Value::Bool(true) {
            *p = json!({"x-kubernetes-preserve-unknown-fields": true});
        }
        return;
    };
    let typed = [
        "type",
        "x-kubernetes-int-or-string",
        "x-kubernetes-preserve-unknown-fields",
    ]
    .iter()
    .any(|k| m.contains_key(*k));
    if !typed && !m.contains_key("anyOf") && !m.contains_key("oneOf") && !m.contains_key("allOf") {
        m.insert("x-kubernetes-preserve-unknown-fields".into(), json!(true));
    }
}

/// Where a schema breaks Kubernetes' structural-schema rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct NotStructural {
    /// JSON path inside `openAPIV3Schema`.
    pub path: String,
    /// What is wrong.
    pub problem: String,
}

/// Checks the structural-schema rules Kubernetes enforces on CRDs: no
/// references, a type (or an int-or-string / preserve-unknown-fields
/// marker) on every node, `properties` and `additionalProperties` not
/// together, and nothing but value constraints inside `anyOf`/`oneOf`/`allOf`.
pub fn check_structural(schema: &Value) -> Result<(), NotStructural> {
    check(schema, "", false)
}

fn check(v: &Value, path: &str, in_junctor: bool) -> Result<(), NotStructural> {
    let fail = |problem: String| {
        Err(NotStructural {
            path: if path.is_empty() {
                ".".into()
            } else {
                path.to_string()
            },
            problem,
        })
    };
    let Some(m) = v.as_object() else {
        return fail(format!("schema is {v}, not an object"));
    };
    for banned in ["$ref", "$defs", "definitions", "$schema"] {
        if m.contains_key(banned) {
            return fail(format!("{banned} is not allowed"));
        }
    }
    if in_junctor {
        for banned in [
            "type",
            "nullable",
            "description",
            "default",
            "additionalProperties",
        ] {
            if m.contains_key(banned) {
                return fail(format!("{banned} inside anyOf/oneOf/allOf"));
            }
        }
    } else {
        let typed = m.contains_key("type")
            || m.contains_key("x-kubernetes-int-or-string")
            || m.contains_key("x-kubernetes-preserve-unknown-fields");
        if !typed {
            return fail("no type".into());
        }
        if m.contains_key("properties") && m.contains_key("additionalProperties") {
            return fail("properties and additionalProperties together".into());
        }
    }
    if let Some(props) = m.get("properties").and_then(Value::as_object) {
        for (name, p) in props {
            check(p, &format!("{path}.{name}"), in_junctor)?;
        }
    }
    if let Some(items) = m.get("items") {
        check(items, &format!("{path}[]"), in_junctor)?;
    }
    if let Some(ap) = m.get("additionalProperties")
        && ap.is_object()
    {
        check(ap, &format!("{path}{{}}"), in_junctor)?;
    }
    for j in ["anyOf", "oneOf", "allOf"] {
        if let Some(branches) = m.get(j).and_then(Value::as_array) {
            for (i, b) in branches.iter().enumerate() {
                check(b, &format!("{path}.{j}[{i}]"), true)?;
            }
        }
    }
    Ok(())
}

/// The CustomResourceDefinition of a kind.
pub fn crd(k: &KindInfo) -> Value {
    let mut version = Map::new();
    version.insert("name".into(), json!(k.version));
    version.insert("served".into(), json!(true));
    version.insert("storage".into(), json!(true));
    version.insert("schema".into(), json!({"openAPIV3Schema": crd_schema(k)}));
    if k.has_status {
        version.insert("subresources".into(), json!({"status": {}}));
    }
    version.insert(
        "additionalPrinterColumns".into(),
        Value::Array(printer_columns(k)),
    );
    let selectable = selectable_fields(k);
    if !selectable.is_empty() {
        version.insert("selectableFields".into(), Value::Array(selectable));
    }
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": k.qualified(),
            "labels": {"app.kubernetes.io/part-of": "sheaf"},
        },
        "spec": {
            "group": k.group,
            "names": {
                "kind": k.kind,
                "listKind": format!("{}List", k.kind),
                "plural": k.plural,
                "singular": k.singular,
                "shortNames": k.short_names,
                "categories": ["all", "sheaf"],
            },
            "scope": match k.scope {
                Scope::Namespaced => "Namespaced",
                Scope::Cluster => "Cluster",
            },
            "versions": [Value::Object(version)],
        },
    })
}

/// Whether `group` is one Kubernetes itself serves (the core group,
/// `coordination.k8s.io`, ...): a real cluster already has those kinds, so
/// they get no CRD.
pub fn is_builtin_group(group: &str) -> bool {
    group.is_empty() || group == "k8s.io" || group.ends_with(".k8s.io")
}

/// CRDs of every kind of `registry` that Kubernetes does not serve itself.
pub fn crds(registry: &Registry) -> Vec<Value> {
    registry
        .kinds()
        .iter()
        .filter(|k| !is_builtin_group(k.group))
        .map(crd)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_crd_schema_is_structural() {
        let reg = Registry::default();
        let crds = crds(&reg);
        assert_eq!(crds.len(), 5);
        for c in &crds {
            let name = c["metadata"]["name"].as_str().unwrap_or("?");
            let schema = &c["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
            if let Err(e) = check_structural(schema) {
                panic!("{name}: {e}");
            }
            assert_eq!(schema["properties"]["metadata"], json!({"type": "object"}));
            assert!(
                schema["properties"]["spec"]["properties"].is_object(),
                "{name}"
            );
        }
        let vmi = crds
            .iter()
            .find(|c| c["spec"]["names"]["kind"] == "VirtualMachineInstance")
            .expect("VMI CRD");
        assert_eq!(
            vmi["spec"]["versions"][0]["selectableFields"][0]["jsonPath"],
            ".status.nodeName"
        );
        let vm = crds
            .iter()
            .find(|c| c["spec"]["names"]["kind"] == "VirtualMachine")
            .expect("VM CRD");
        let rs = &vm["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            ["runStrategy"];
        assert_eq!(rs["type"], "string");
        assert!(
            rs["enum"]
                .as_array()
                .is_some_and(|e| e.contains(&json!("Always")))
        );
    }

    #[test]
    fn the_checker_rejects_what_kubernetes_rejects() {
        assert!(
            check_structural(&json!({"type": "object", "properties": {"a": {"$ref": "#/x"}}}))
                .is_err()
        );
        assert!(check_structural(&json!({"type": "object", "properties": {"a": {}}})).is_err());
        assert!(
            check_structural(
                &json!({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}})
            )
            .is_err()
        );
        assert!(
            check_structural(&json!({"type": "object", "properties": {"a": {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}}}}))
                .is_err()
        );
        assert!(check_structural(&json!({"type": "object", "properties": {"a": {"x-kubernetes-int-or-string": true}}})).is_ok());
    }
}
