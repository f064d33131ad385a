// SPDX-License-Identifier: Apache-2.0
//! `coordination.k8s.io/v1` Lease: what kube-controller-manager and
//! kube-scheduler elect their leader on, and what sheaf's control planes
//! elect theirs on (see [`crate::controllers::leader`]).

use k8s_openapi::api::coordination::v1::Lease;
use serde_json::Value;

use super::common::{age_cell, json_str};
use super::decode::FieldError;
use super::{Resource, Scope, TableColumn};

/// Longest `holderIdentity` accepted (Kubernetes does not bound it; a
/// bound keeps one object from growing without limit).
pub const MAX_HOLDER_IDENTITY: usize = 253;

impl Resource for Lease {
    const GROUP: &'static str = "coordination.k8s.io";
    const VERSION: &'static str = "v1";
    const KIND: &'static str = "Lease";
    const PLURAL: &'static str = "leases";
    const SINGULAR: &'static str = "lease";
    const SHORT_NAMES: &'static [&'static str] = &[];
    const SCOPE: Scope = Scope::Namespaced;
    const HAS_STATUS: bool = false;
    fn metadata(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &mut self.metadata
    }
    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        let Some(spec) = &self.spec else {
            return errs;
        };
        if let Some(h) = &spec.holder_identity
            && h.len() > MAX_HOLDER_IDENTITY
        {
            errs.push(FieldError::forbidden(
                "spec.holderIdentity",
                format!("Too long: must have at most {MAX_HOLDER_IDENTITY} bytes"),
            ));
        }
        if let Some(d) = spec.lease_duration_seconds
            && d <= 0
        {
            errs.push(FieldError::invalid(
                "spec.leaseDurationSeconds",
                d,
                "must be greater than 0",
            ));
        }
        if let Some(t) = spec.lease_transitions
            && t < 0
        {
            errs.push(FieldError::invalid(
                "spec.leaseTransitions",
                t,
                "must be greater than or equal to 0",
            ));
        }
        errs
    }
    fn table_columns() -> Vec<TableColumn> {
        vec![
            TableColumn::new("Holder", "string", "The holder of the lease"),
            TableColumn::new("Age", "date", "Time since creation"),
        ]
    }
    fn table_row(obj: &Value) -> Vec<Value> {
        vec![
            Value::String(json_str(obj, "spec.holderIdentity").to_string()),
            age_cell(obj),
        ]
    }
}
