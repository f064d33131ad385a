// SPDX-License-Identifier: Apache-2.0
//! `meta.k8s.io/v1` Table output, which `kubectl get` asks for with
//! `Accept: application/json;as=Table;g=meta.k8s.io;v=v1`.

use serde_json::{Value, json};

use crate::resources::KindInfo;

/// What each row carries in `object` (the `includeObject` parameter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum IncludeObject {
    /// Nothing.
    None,
    /// `PartialObjectMetadata` (the default).
    #[default]
    Metadata,
    /// The whole object.
    Object,
}

impl IncludeObject {
    /// Parses the query parameter.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "None" => Some(Self::None),
            "" | "Metadata" => Some(Self::Metadata),
            "Object" => Some(Self::Object),
            _ => None,
        }
    }
}

/// Whether an `Accept` header asks for a Table.
pub fn wants_table(accept: &str) -> bool {
    accept
        .split(',')
        .next()
        .is_some_and(|first| first.contains("as=Table"))
}

fn column_defs(kind: &KindInfo) -> Vec<Value> {
    let mut cols = vec![
        json!({"name": "Name", "type": "string", "format": "name", "description": "Name must be unique within a namespace.", "priority": 0}),
    ];
    for c in (kind.columns)() {
        let t = if c.type_ == "date" { "string" } else { c.type_ };
        cols.push(json!({"name": c.name, "type": t, "format": "", "description": c.description, "priority": c.priority}));
    }
    cols
}

/// One table row for an object.
pub fn row(kind: &KindInfo, obj: &Value, include: IncludeObject) -> Value {
    let mut cells = vec![
        obj.pointer("/metadata/name")
            .cloned()
            .unwrap_or(Value::String(String::new())),
    ];
    cells.extend((kind.row)(obj));
    let object = match include {
        IncludeObject::None => Value::Null,
        IncludeObject::Metadata => json!({
            "kind": "PartialObjectMetadata",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": obj.get("metadata").cloned().unwrap_or(json!({})),
        }),
        IncludeObject::Object => obj.clone(),
    };
    let mut r = json!({"cells": cells});
    if !object.is_null() {
        r["object"] = object;
    }
    r
}

/// A Table of objects.
pub fn table(
    kind: &KindInfo,
    objs: &[Value],
    resource_version: &str,
    continue_token: Option<&str>,
    include: IncludeObject,
) -> Value {
    let mut meta = json!({"resourceVersion": resource_version});
    if let Some(c) = continue_token {
        meta["continue"] = json!(c);
    }
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": meta,
        "columnDefinitions": column_defs(kind),
        "rows": objs.iter().map(|o| row(kind, o, include)).collect::<Vec<_>>(),
    })
}
