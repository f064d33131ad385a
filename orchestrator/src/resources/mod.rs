// SPDX-License-Identifier: Apache-2.0
//! Resource types: KubeVirt's `kubevirt.io/v1` kinds and sheaf's own `sheaf.dev/v1` kinds.
//!
//! ```text
//!   kubevirt.io/v1                      sheaf.dev/v1          v1 (core)
//!   ├─ VirtualMachine        (vm)        ├─ Volume  (svol)     └─ Namespace
//!   ├─ VirtualMachineInstance (vmi)      └─ Node    (snode, cluster-scoped)
//!   └─ VirtualMachineInstanceMigration (vmim)                  └─ Secret
//!   coordination.k8s.io/v1: Lease (leader election)
//! ```
//!
//! Every kind is a plain serde struct with a k8s-openapi [`ObjectMeta`] and a
//! [`schemars::JsonSchema`] derive, and implements [`Resource`]. The [`decode`]
//! module turns untrusted JSON into a typed object with Kubernetes-style field
//! errors (`spec.template.spec.domain.devices.disks[0].disk.bus: Unsupported
//! value: "scsi"`), and [`KindInfo`] describes a kind at run time so the store
//! and the API server can serve any kind generically.
//!
//! The supported field subset is listed in `docs/orchestrator.md`.

pub mod common;
pub mod coordination;
pub mod decode;
pub mod kubevirt;
pub mod quantity;
pub mod registry;
pub mod sheaf;

pub use common::{Condition, ConditionStatus};
pub use decode::{
    FieldError, FieldErrorKind, FieldValidation, ValidationError, decode, decode_value,
};
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
pub use kubevirt::{
    RunStrategy, VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration,
    VirtualMachineInstanceSpec, VirtualMachineSpec, VmiPhase,
};
pub use quantity::{parse_quantity, parse_quantity_bytes, parse_quantity_millis};
pub use registry::{KindInfo, Registry, Scope, TableColumn};
pub use sheaf::{Node, NodeSpec, NodeStatus, Volume, VolumeSpec, VolumeStatus};

use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Whether a kind lives in a namespace or at cluster scope.
pub use registry::Scope as ResourceScope;

/// A kind the orchestrator stores and serves.
///
/// Implemented by every resource type. The constants are what Kubernetes
/// discovery reports; [`Resource::validate`] holds the semantic checks that
/// serde cannot express (one-of fields, references between lists, quantities).
pub trait Resource:
    Serialize + DeserializeOwned + JsonSchema + Clone + std::fmt::Debug + Send + Sync + 'static
{
    /// API group (`""` for the core group).
    const GROUP: &'static str;
    /// API version inside the group.
    const VERSION: &'static str;
    /// Kind, e.g. `VirtualMachine`.
    const KIND: &'static str;
    /// Lower-case plural used in URLs, e.g. `virtualmachines`.
    const PLURAL: &'static str;
    /// Lower-case singular, e.g. `virtualmachine`.
    const SINGULAR: &'static str;
    /// Short names (`vm`, `vms`).
    const SHORT_NAMES: &'static [&'static str];
    /// Namespaced or cluster-scoped.
    const SCOPE: Scope;
    /// Whether the kind has a `/status` subresource.
    const HAS_STATUS: bool = true;

    /// `group/version`, or just `version` for the core group.
    fn api_version() -> String {
        if Self::GROUP.is_empty() {
            Self::VERSION.to_string()
        } else {
            format!("{}/{}", Self::GROUP, Self::VERSION)
        }
    }

    /// The object's metadata.
    fn metadata(&self) -> &ObjectMeta;
    /// The object's metadata, mutable.
    fn metadata_mut(&mut self) -> &mut ObjectMeta;

    /// Semantic validation beyond the shape serde checks. Field paths are
    /// relative to the object root (`spec.template...`).
    fn validate(&self) -> Vec<FieldError> {
        Vec::new()
    }

    /// Rewrites a decoded object before it is stored, as the Kubernetes API
    /// server does for some kinds (a Secret's `stringData` is merged into
    /// `data`). Runs after [`Resource::validate`] passed.
    fn normalize(&mut self) {}

    /// Cells of the `kubectl get` table after the name (see [`KindInfo::columns`]).
    fn table_columns() -> Vec<TableColumn> {
        vec![TableColumn::new("Age", "date", "Time since creation")]
    }

    /// Values for [`Resource::table_columns`], from the stored JSON.
    fn table_row(obj: &serde_json::Value) -> Vec<serde_json::Value> {
        vec![common::age_cell(obj)]
    }
}

/// Declares the root struct of a kind (`apiVersion`, `kind`, `metadata`,
/// `spec`, `status`) and its [`Resource`] impl.
macro_rules! root_kind {
    (
        $(#[$attr:meta])*
        $name:ident, spec: $spec:ty, status: $status:ty,
        group: $group:expr, version: $version:expr, plural: $plural:expr,
        singular: $singular:expr, short: [$($short:expr),*], scope: $scope:expr,
        validate: $validate:expr, columns: $columns:expr, row: $row:expr
    ) => {
        $(#[$attr])*
        #[derive(serde::Serialize, serde::Deserialize, schemars::JsonSchema, Clone, Debug, Default, PartialEq)]
        #[serde(rename_all = "camelCase")]
        pub struct $name {
            /// `group/version` of the object.
            #[serde(default, skip_serializing_if = "String::is_empty")]
            pub api_version: String,
            /// Kind of the object.
            #[serde(default, skip_serializing_if = "String::is_empty")]
            pub kind: String,
            /// Standard object metadata.
            #[serde(default)]
            pub metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
            /// Desired state.
            #[serde(default)]
            pub spec: $spec,
            /// Observed state, written through the `/status` subresource.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub status: Option<$status>,
        }

        impl $name {
            /// A new object with `apiVersion`/`kind` set, the given name and spec.
            pub fn new(name: &str, spec: $spec) -> Self {
                Self {
                    api_version: <Self as crate::resources::Resource>::api_version(),
                    kind: <Self as crate::resources::Resource>::KIND.to_string(),
                    metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                        name: Some(name.to_string()),
                        ..Default::default()
                    },
                    spec,
                    status: None,
                }
            }

            /// Sets the namespace (builder style).
            pub fn in_namespace(mut self, ns: &str) -> Self {
                self.metadata.namespace = Some(ns.to_string());
                self
            }
        }

        impl crate::resources::Resource for $name {
            const GROUP: &'static str = $group;
            const VERSION: &'static str = $version;
            const KIND: &'static str = stringify!($name);
            const PLURAL: &'static str = $plural;
            const SINGULAR: &'static str = $singular;
            const SHORT_NAMES: &'static [&'static str] = &[$($short),*];
            const SCOPE: crate::resources::Scope = $scope;
            fn metadata(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }
            fn metadata_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
            fn validate(&self) -> Vec<crate::resources::FieldError> {
                let f: fn(&Self) -> Vec<crate::resources::FieldError> = $validate;
                f(self)
            }
            fn table_columns() -> Vec<crate::resources::TableColumn> {
                let f: fn() -> Vec<crate::resources::TableColumn> = $columns;
                f()
            }
            fn table_row(obj: &serde_json::Value) -> Vec<serde_json::Value> {
                let f: fn(&serde_json::Value) -> Vec<serde_json::Value> = $row;
                f(obj)
            }
        }
    };
}
pub(crate) use root_kind;
