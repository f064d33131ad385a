// SPDX-License-Identifier: Apache-2.0
//! Fuzzes the API's request decoding and validation: any body, any kind, any
//! content type must yield an object or a Kubernetes Status error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sheaf_orchestrator::api::{decode_request, patch_and_validate};
use sheaf_orchestrator::resources::{FieldValidation, Registry};
use sheaf_orchestrator::store::{FieldSelector, LabelSelector};

const TYPES: &[&str] = &["application/json", "application/yaml", "application/merge-patch+json", "application/json-patch+json", "application/apply-patch+yaml", "text/plain"];

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let reg = Registry::default();
    let kinds = reg.kinds();
    let kind = &kinds[usize::from(data[0]) % kinds.len()];
    let ct = TYPES[usize::from(data[1]) % TYPES.len()];
    let body = &data[2..];
    let mode = [FieldValidation::Strict, FieldValidation::Warn, FieldValidation::Ignore][usize::from(data[0] >> 6) % 3];
    if ct.contains("patch") {
        let current = serde_json::json!({"apiVersion": kind.api_version(), "kind": kind.kind, "metadata": {"name": "x", "namespace": "default"}, "spec": {}});
        let _ = patch_and_validate(kind, &current, ct, body);
    } else {
        let _ = decode_request(kind, Some("default"), ct, body, mode);
    }
    if let Ok(s) = std::str::from_utf8(body) {
        let _ = LabelSelector::parse(s);
        let _ = FieldSelector::parse(s);
    }
});
