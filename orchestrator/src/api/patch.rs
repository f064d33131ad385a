// SPDX-License-Identifier: Apache-2.0
//! PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902),
//! strategic merge patch (treated as a merge patch, as Kubernetes does for
//! custom resources) and server-side apply (a simplified merge, see docs/api.md).

use serde_json::Value;

use super::ApiError;
use crate::resources::decode_value;

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
            json_patch::patch(doc, &ops).map_err(|e| ApiError {
                code: 422,
                reason: "Invalid",
                message: format!(
                    "the server rejected our request due to an error in our request: {e}"
                ),
                details: None,
            })
        }
    }
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
}
