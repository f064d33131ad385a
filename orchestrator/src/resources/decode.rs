// SPDX-License-Identifier: Apache-2.0
//! Decoding untrusted input into typed resources, with Kubernetes-style errors.
//!
//! Two wrappers run around one serde pass: `serde_ignored` records every key
//! the types do not declare (unknown fields), `serde_path_to_error` records
//! where a type error happened. Errors name the field path the way the
//! Kubernetes API server does: `spec.template.spec.domain.devices.disks[0].disk.bus`.

use std::fmt;

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::Resource;

/// How unknown fields are treated (the `fieldValidation` query parameter).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FieldValidation {
    /// Unknown fields are an error (kubectl's default).
    #[default]
    Strict,
    /// Unknown fields are dropped and reported as warnings.
    Warn,
    /// Unknown fields are dropped silently.
    Ignore,
}

impl FieldValidation {
    /// Parses the query parameter value (`Strict`, `Warn`, `Ignore`; empty means Strict).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "" | "Strict" | "strict" => Some(Self::Strict),
            "Warn" | "warn" => Some(Self::Warn),
            "Ignore" | "ignore" => Some(Self::Ignore),
            _ => None,
        }
    }
}

/// What is wrong with a field (maps to Kubernetes' `FieldValue*` cause types).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FieldErrorKind {
    /// A required field is missing.
    Required,
    /// The value is malformed or out of range.
    Invalid,
    /// The value is not one of the supported values.
    NotSupported(Vec<String>),
    /// The value repeats one that must be unique.
    Duplicate,
    /// The field may not be set (here or now).
    Forbidden,
    /// The field is not declared by the schema.
    Unknown,
    /// The value has the wrong JSON type.
    TypeInvalid,
}

impl FieldErrorKind {
    /// The Kubernetes `StatusCause.reason` string.
    pub fn cause_reason(&self) -> &'static str {
        match self {
            Self::Required => "FieldValueRequired",
            Self::Invalid => "FieldValueInvalid",
            Self::NotSupported(_) => "FieldValueNotSupported",
            Self::Duplicate => "FieldValueDuplicate",
            Self::Forbidden => "FieldValueForbidden",
            Self::Unknown => "FieldValueUnknown",
            Self::TypeInvalid => "FieldValueTypeInvalid",
        }
    }
}

/// One invalid field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Path from the object root, e.g. `spec.template.spec.domain.cpu.cores`.
    pub field: String,
    /// What is wrong.
    pub kind: FieldErrorKind,
    /// The offending value, rendered, if any.
    pub value: Option<String>,
    /// Extra detail.
    pub detail: String,
}

impl FieldError {
    /// A missing required field.
    pub fn required(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            kind: FieldErrorKind::Required,
            value: None,
            detail: detail.into(),
        }
    }
    /// An invalid value.
    pub fn invalid(
        field: impl Into<String>,
        value: impl fmt::Display,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            field: field.into(),
            kind: FieldErrorKind::Invalid,
            value: Some(value.to_string()),
            detail: detail.into(),
        }
    }
    /// A value outside the supported set.
    pub fn not_supported(
        field: impl Into<String>,
        value: impl fmt::Display,
        supported: &[&str],
    ) -> Self {
        Self {
            field: field.into(),
            kind: FieldErrorKind::NotSupported(supported.iter().map(|s| s.to_string()).collect()),
            value: Some(value.to_string()),
            detail: String::new(),
        }
    }
    /// A duplicated value.
    pub fn duplicate(field: impl Into<String>, value: impl fmt::Display) -> Self {
        Self {
            field: field.into(),
            kind: FieldErrorKind::Duplicate,
            value: Some(value.to_string()),
            detail: String::new(),
        }
    }
    /// A field that may not be set.
    pub fn forbidden(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            kind: FieldErrorKind::Forbidden,
            value: None,
            detail: detail.into(),
        }
    }
    /// The message without the field path, as in a Kubernetes `StatusCause.message`.
    pub fn message(&self) -> String {
        let mut s = match &self.kind {
            FieldErrorKind::Required => "Required value".to_string(),
            FieldErrorKind::Invalid => "Invalid value".to_string(),
            FieldErrorKind::NotSupported(_) => "Unsupported value".to_string(),
            FieldErrorKind::Duplicate => "Duplicate value".to_string(),
            FieldErrorKind::Forbidden => "Forbidden".to_string(),
            FieldErrorKind::Unknown => "unknown field".to_string(),
            FieldErrorKind::TypeInvalid => "Invalid value".to_string(),
        };
        if let Some(v) = &self.value {
            s.push_str(&format!(": {v:?}"));
        }
        if let FieldErrorKind::NotSupported(list) = &self.kind {
            let l: Vec<String> = list.iter().map(|s| format!("{s:?}")).collect();
            s.push_str(&format!(": supported values: {}", l.join(", ")));
        }
        if !self.detail.is_empty() {
            s.push_str(": ");
            s.push_str(&self.detail);
        }
        s
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message())
    }
}

/// Why an object could not be decoded.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ValidationError {
    /// The body is not valid JSON/YAML, or not an object.
    #[error("malformed body: {0}")]
    Malformed(String),
    /// Strict field validation found undeclared fields.
    #[error("strict decoding error: {}", .0.iter().map(|f| format!("unknown field {f:?}")).collect::<Vec<_>>().join(", "))]
    UnknownFields(Vec<String>),
    /// One or more fields are invalid.
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(", "))]
    Invalid(Vec<FieldError>),
}

impl ValidationError {
    /// All field errors (unknown fields included), for `details.causes`.
    pub fn field_errors(&self) -> Vec<FieldError> {
        match self {
            Self::Malformed(_) => Vec::new(),
            Self::UnknownFields(f) => f
                .iter()
                .map(|f| FieldError {
                    field: f.clone(),
                    kind: FieldErrorKind::Unknown,
                    value: None,
                    detail: String::new(),
                })
                .collect(),
            Self::Invalid(e) => e.clone(),
        }
    }
}

/// Parses a request body as JSON, or YAML when `yaml` is set (one document).
///
/// Bodies that are not a JSON object are refused.
pub fn decode_value(body: &[u8], yaml: bool) -> Result<Value, ValidationError> {
    let v: Value = if yaml {
        let text = std::str::from_utf8(body)
            .map_err(|e| ValidationError::Malformed(format!("body is not UTF-8: {e}")))?;
        serde_yaml::from_str(text)
            .map_err(|e| ValidationError::Malformed(format!("invalid YAML: {e}")))?
    } else {
        serde_json::from_slice(body)
            .map_err(|e| ValidationError::Malformed(format!("invalid JSON: {e}")))?
    };
    if !v.is_object() {
        return Err(ValidationError::Malformed(
            "the body must be a JSON object".into(),
        ));
    }
    Ok(v)
}

fn ignored_path(p: &serde_ignored::Path<'_>) -> String {
    use serde_ignored::Path;
    match p {
        Path::Root => String::new(),
        Path::Seq { parent, index } => format!("{}[{index}]", ignored_path(parent)),
        Path::Map { parent, key } => {
            let base = ignored_path(parent);
            if base.is_empty() {
                key.clone()
            } else {
                format!("{base}.{key}")
            }
        }
        Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => ignored_path(parent),
    }
}

fn tracked_path(p: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for seg in p {
        match seg {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Segment::Unknown => {}
        }
    }
    out
}

/// Turns a serde message into a field error at `path`.
fn serde_field_error(path: String, msg: &str) -> FieldError {
    // `unknown variant `scsi`, expected `virtio` or `sata``
    if let Some(rest) = msg.strip_prefix("unknown variant `")
        && let Some((value, tail)) = rest.split_once('`')
    {
        let supported: Vec<&str> = tail.split('`').skip(1).step_by(2).collect();
        return FieldError::not_supported(path, value, &supported);
    }
    // `missing field `name``
    if let Some(rest) = msg.strip_prefix("missing field `") {
        let name = rest.trim_end_matches('`');
        let field = if path.is_empty() {
            name.to_string()
        } else {
            format!("{path}.{name}")
        };
        return FieldError::required(field, "");
    }
    let field = if path.is_empty() {
        "<root>".to_string()
    } else {
        path
    };
    FieldError {
        field,
        kind: FieldErrorKind::TypeInvalid,
        value: None,
        detail: msg.to_string(),
    }
}

/// Decodes `value` into `T`, collecting unknown fields. Returns the object and
/// the unknown field paths (empty in strict mode, which fails instead).
pub fn decode_as<T: DeserializeOwned>(
    value: &Value,
    mode: FieldValidation,
) -> Result<(T, Vec<String>), ValidationError> {
    let mut unknown = Vec::new();
    let res: Result<T, _> = {
        let mut cb = |p: serde_ignored::Path<'_>| unknown.push(ignored_path(&p));
        let de = serde_ignored::Deserializer::new(value, &mut cb);
        serde_path_to_error::deserialize(de)
    };
    match res {
        Ok(obj) => {
            if mode == FieldValidation::Strict && !unknown.is_empty() {
                return Err(ValidationError::UnknownFields(unknown));
            }
            Ok((obj, unknown))
        }
        Err(e) => {
            let path = tracked_path(e.path());
            let fe = serde_field_error(path, &e.inner().to_string());
            Err(ValidationError::Invalid(vec![fe]))
        }
    }
}

/// Decodes and validates a resource: shape (serde), unknown fields per `mode`,
/// then [`Resource::validate`] and the metadata checks every kind shares.
pub fn decode<K: Resource>(
    value: &Value,
    mode: FieldValidation,
) -> Result<(K, Vec<String>), ValidationError> {
    let (obj, warnings): (K, Vec<String>) = decode_as(value, mode)?;
    let mut errs = validate_metadata(obj.metadata(), K::SCOPE == super::Scope::Namespaced);
    errs.extend(obj.validate());
    if !errs.is_empty() {
        return Err(ValidationError::Invalid(errs));
    }
    Ok((obj, warnings))
}

pub use crate::names::{is_dns_label, is_dns_subdomain};

fn valid_label_name(k: &str) -> bool {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    if let Some(p) = prefix
        && !is_dns_subdomain(p)
    {
        return false;
    }
    valid_label_value(name) && !name.is_empty()
}

fn valid_label_value(v: &str) -> bool {
    v.len() <= 63
        && (v.is_empty()
            || (v
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
                && v.as_bytes().first().is_some_and(u8::is_ascii_alphanumeric)
                && v.as_bytes().last().is_some_and(u8::is_ascii_alphanumeric)))
}

/// Metadata checks shared by every kind: name syntax, label syntax.
pub fn validate_metadata(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    namespaced: bool,
) -> Vec<FieldError> {
    let mut errs = Vec::new();
    if let Some(name) = &meta.name
        && !is_dns_subdomain(name)
    {
        errs.push(FieldError::invalid(
            "metadata.name",
            name,
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
        ));
    }
    if let Some(ns) = &meta.namespace {
        if !namespaced {
            // Cluster-scoped objects ignore a namespace in the body (as Kubernetes does).
        } else if !is_dns_label(ns) {
            errs.push(FieldError::invalid(
                "metadata.namespace",
                ns,
                "must be a lowercase RFC 1123 label",
            ));
        }
    }
    for (k, v) in meta.labels.iter().flatten() {
        if !valid_label_name(k) {
            errs.push(FieldError::invalid(format!("metadata.labels[{k}]"), k, "name part must consist of alphanumeric characters, '-', '_' or '.', at most 63 characters"));
        }
        if !valid_label_value(v) {
            errs.push(FieldError::invalid(format!("metadata.labels[{k}]"), v, "a valid label value must be 63 characters or less and consist of alphanumerics, '-', '_' or '.'"));
        }
    }
    for (k, _) in meta.annotations.iter().flatten() {
        if !valid_label_name(k) && !k.contains('/') {
            errs.push(FieldError::invalid(
                format!("metadata.annotations[{k}]"),
                k,
                "invalid annotation key",
            ));
        }
    }
    errs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_names() {
        assert!(is_dns_subdomain("vm-cirros"));
        assert!(is_dns_subdomain("a.b-c"));
        assert!(!is_dns_subdomain("Vm"));
        assert!(!is_dns_subdomain("-a"));
        assert!(!is_dns_subdomain(""));
        assert!(!is_dns_label("a.b"));
    }

    #[test]
    fn malformed_bodies_are_refused() {
        assert!(matches!(
            decode_value(b"{", false),
            Err(ValidationError::Malformed(_))
        ));
        assert!(matches!(
            decode_value(b"[1]", false),
            Err(ValidationError::Malformed(_))
        ));
        assert!(matches!(
            decode_value(b"a: [", true),
            Err(ValidationError::Malformed(_))
        ));
        assert!(decode_value(b"a: 1", true).is_ok());
    }

    #[test]
    fn labels_are_checked() {
        let meta = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            labels: Some(
                [
                    ("kubevirt.io/vm".to_string(), "ok".to_string()),
                    ("bad key!".to_string(), "x".to_string()),
                ]
                .into(),
            ),
            ..Default::default()
        };
        let errs = validate_metadata(&meta, true);
        assert_eq!(errs.len(), 1);
        assert!(errs[0].field.contains("bad key!"));
    }
}
