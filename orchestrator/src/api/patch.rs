// SPDX-License-Identifier: Apache-2.0
//! PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902),
//! strategic merge patch (treated as a merge patch, as Kubernetes does for
//! custom resources) and server-side apply (a simplified merge, see docs/api.md).

use json_patch::PatchOperation;
use serde_json::Value;

use super::ApiError;
use crate::resources::decode_value;
use crate::store::{MAX_OBJECT_BYTES, encoded_len_capped};

/// Most operations one JSON patch may hold (Kubernetes' limit).
pub const MAX_JSON_PATCH_OPS: usize = 10_000;

/// The patch formats accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchKind {
    /// `application/merge-patch+json`.
    Merge,
    /// `application/strategic-merge-patch+json` (applied as a merge patch).
    StrategicMerge,
    /// `application/json-patch+json`.
    Json,
    /// `application/apply-patch+yaml` (server-side apply).
    Apply,
}

/// The media types listed in 415 errors.
pub const PATCH_TYPES: &[&str] = &[
    "application/merge-patch+json",
    "application/json-patch+json",
    "application/strategic-merge-patch+json",
    "application/apply-patch+yaml",
];

impl PatchKind {
    /// From a `Content-Type` value (parameters ignored).
    pub fn from_content_type(ct: &str) -> Option<Self> {
        match ct.split(';').next().unwrap_or("").trim() {
            "application/merge-patch+json" => Some(Self::Merge),
            "application/strategic-merge-patch+json" => Some(Self::StrategicMerge),
            "application/json-patch+json" => Some(Self::Json),
            "application/apply-patch+yaml" | "application/apply-patch+json" => Some(Self::Apply),
            _ => None,
        }
    }
}

/// Applies a patch body to `doc` (the current object).
pub fn apply_patch(kind: PatchKind, doc: &mut Value, body: &[u8]) -> Result<(), ApiError> {
    match kind {
        PatchKind::Merge | PatchKind::StrategicMerge | PatchKind::Apply => {
            let patch = decode_value(body, kind == PatchKind::Apply)
                .map_err(|e| ApiError::bad_request(e.to_string()))?;
            json_patch::merge(doc, &patch);
            Ok(())
        }
        PatchKind::Json => {
            let ops: json_patch::Patch = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad_request(format!("invalid JSON patch: {e}")))?;
            apply_json_patch(doc, &ops.0)
        }
    }
}

/// Applies RFC 6902 operations one by one, refusing a patch with more than
/// [`MAX_JSON_PATCH_OPS`] operations and one whose result would grow past
/// [`MAX_OBJECT_BYTES`]: `copy` duplicates a subtree that is already in the
/// document, so a small body of repeated copies could otherwise double the
/// object with every operation until the server runs out of memory. The
/// growth is bounded before each copy is made. `doc` is a scratch copy: on
/// error the caller drops it.
fn apply_json_patch(doc: &mut Value, ops: &[PatchOperation]) -> Result<(), ApiError> {
    if ops.len() > MAX_JSON_PATCH_OPS {
        return Err(ApiError::new(
            413,
            "RequestEntityTooLarge",
            format!(
                "the JSON patch has {} operations; at most {MAX_JSON_PATCH_OPS} are allowed",
                ops.len()
            ),
        ));
    }
    let too_big = || {
        ApiError::new(
            413,
            "RequestEntityTooLarge",
            format!(
                "the patched object would be larger than the limit of {MAX_OBJECT_BYTES} bytes"
            ),
        )
    };
    // An upper bound of the encoded size of `doc` (removals are not
    // subtracted, so it only errs high).
    let mut size = encoded_len_capped(doc, MAX_OBJECT_BYTES).ok_or_else(too_big)?;
    for (i, op) in ops.iter().enumerate() {
        let added = match op {
            PatchOperation::Add(o) => Some(&o.value),
            PatchOperation::Replace(o) => Some(&o.value),
            PatchOperation::Copy(o) => o.from.resolve(&*doc).ok(),
            PatchOperation::Remove(_) | PatchOperation::Move(_) | PatchOperation::Test(_) => None,
        };
        if let Some(v) = added {
            let room = MAX_OBJECT_BYTES.saturating_sub(size);
            size += encoded_len_capped(v, room).ok_or_else(too_big)?;
        }
        json_patch::patch(doc, std::slice::from_ref(op)).map_err(|e| ApiError {
            code: 422,
            reason: "Invalid",
            message: format!(
                "the server rejected our request due to an error in our request: \
                 operation {i} failed at path '{}': {}",
                e.path, e.kind
            ),
            details: None,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn merge_and_json_patches() {
        let mut d = json!({"spec": {"running": false, "a": 1}});
        apply_patch(
            PatchKind::Merge,
            &mut d,
            br#"{"spec": {"running": true, "a": null}}"#,
        )
        .unwrap();
        assert_eq!(d, json!({"spec": {"running": true}}));
        apply_patch(
            PatchKind::Json,
            &mut d,
            br#"[{"op": "replace", "path": "/spec/running", "value": false}]"#,
        )
        .unwrap();
        assert_eq!(d["spec"]["running"], false);
        let err = apply_patch(
            PatchKind::Json,
            &mut d,
            br#"[{"op": "test", "path": "/spec/running", "value": true}]"#,
        )
        .unwrap_err();
        assert_eq!(err.code, 422);
        assert_eq!(
            apply_patch(PatchKind::Json, &mut d, b"{nope")
                .unwrap_err()
                .code,
            400
        );
        apply_patch(PatchKind::Apply, &mut d, b"spec:\n  x: 1\n").unwrap();
        assert_eq!(d["spec"]["x"], 1);
    }

    #[test]
    fn json_patch_op_count_is_capped() {
        let mut d = json!({"a": 1});
        let ops: Vec<Value> = (0..=MAX_JSON_PATCH_OPS)
            .map(|_| json!({"op": "test", "path": "/a", "value": 1}))
            .collect();
        let body = serde_json::to_vec(&ops).unwrap();
        let err = apply_patch(PatchKind::Json, &mut d, &body).unwrap_err();
        assert_eq!(err.code, 413, "{}", err.message);
        assert!(err.message.contains("10000"), "{}", err.message);
    }

    /// 40 copies of a doubling subtree would be 2^40 times the seed; the
    /// patch is refused before memory grows past the object limit.
    #[test]
    fn json_patch_copy_amplification_is_refused() {
        let mut d = json!({"a": ["x".repeat(1024)]});
        let mut ops = Vec::new();
        for i in 0..40 {
            let from = if i == 0 {
                "/a".to_string()
            } else {
                format!("/c{}", i - 1)
            };
            ops.push(json!({"op": "copy", "from": from, "path": format!("/c{i}")}));
            ops.push(json!({"op": "copy", "from": format!("/c{i}"), "path": format!("/c{i}/-")}));
        }
        let body = serde_json::to_vec(&ops).unwrap();
        let err = apply_patch(PatchKind::Json, &mut d, &body).unwrap_err();
        assert_eq!(err.code, 413, "{}", err.message);
        assert!(
            err.message.contains("larger than the limit"),
            "{}",
            err.message
        );
    }

    #[test]
    fn json_patch_error_names_the_failing_operation() {
        let mut d = json!({"a": 1});
        let body = br#"[{"op": "test", "path": "/a", "value": 1},
                        {"op": "remove", "path": "/nope"}]"#;
        let err = apply_patch(PatchKind::Json, &mut d, body).unwrap_err();
        assert_eq!(err.code, 422);
        assert!(err.message.contains("operation 1"), "{}", err.message);
        assert!(err.message.contains("/nope"), "{}", err.message);
    }

    #[test]
    fn encoded_len_stops_at_the_cap() {
        let v = json!({"k": "v".repeat(100)});
        let full = serde_json::to_vec(&v).unwrap().len();
        assert_eq!(encoded_len_capped(&v, full), Some(full));
        assert_eq!(encoded_len_capped(&v, full - 1), None);
    }
}
