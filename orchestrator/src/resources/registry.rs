// SPDX-License-Identifier: Apache-2.0
//! Run-time descriptions of the served kinds.

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use serde_json::Value;

use super::common::{age_cell, json_str};
use super::decode::{FieldError, FieldValidation, ValidationError, decode, is_dns_label};
use super::{
    Node, Resource, VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration, Volume,
};

/// Namespaced or cluster-scoped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Objects live in a namespace.
    Namespaced,
    /// Objects are global.
    Cluster,
}

/// A column of `kubectl get` output (a Kubernetes `TableColumnDefinition`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableColumn {
    /// Header.
    pub name: &'static str,
    /// OpenAPI type: `string`, `integer`, `date`, ...
    pub type_: &'static str,
    /// Description.
    pub description: &'static str,
    /// 0 = always shown, 1 = only with `-o wide`.
    pub priority: u8,
}

impl TableColumn {
    /// A priority-0 column. `date` columns are rendered as `string` ages.
    pub fn new(name: &'static str, type_: &'static str, description: &'static str) -> Self {
        Self {
            name,
            type_,
            description,
            priority: 0,
        }
    }
    /// Sets the priority (builder style).
    pub fn priority(mut self, p: u8) -> Self {
        self.priority = p;
        self
    }
}

/// Decodes, validates and normalizes an object; returns it and the unknown-field warnings.
pub type DecodeFn = fn(&Value, FieldValidation) -> Result<(Value, Vec<String>), ValidationError>;

/// Everything the store and the API server need to know about a kind.
#[derive(Clone, Debug)]
pub struct KindInfo {
    /// API group (`""` for core).
    pub group: &'static str,
    /// Version.
    pub version: &'static str,
    /// Kind.
    pub kind: &'static str,
    /// URL plural.
    pub plural: &'static str,
    /// Singular.
    pub singular: &'static str,
    /// Short names.
    pub short_names: &'static [&'static str],
    /// Scope.
    pub scope: Scope,
    /// Has a `/status` subresource.
    pub has_status: bool,
    /// Decodes, validates and normalizes an object; returns it and warnings.
    pub decode: DecodeFn,
    /// Table columns after `Name`.
    pub columns: fn() -> Vec<TableColumn>,
    /// Table cells for an object.
    pub row: fn(&Value) -> Vec<Value>,
    /// JSON schema of the kind (OpenAPI v3 flavour).
    pub schema: fn(&mut schemars::SchemaGenerator) -> schemars::Schema,
    /// Name of the schema in `components.schemas`.
    pub schema_name: fn() -> String,
}

fn decode_normalized<K: Resource>(
    v: &Value,
    mode: FieldValidation,
) -> Result<(Value, Vec<String>), ValidationError> {
    let (mut obj, warnings) = decode::<K>(v, mode)?;
    obj.normalize();
    let out = serde_json::to_value(&obj).map_err(|e| ValidationError::Malformed(e.to_string()))?;
    Ok((out, warnings))
}

impl KindInfo {
    /// The description of a typed kind.
    pub fn of<K: Resource>() -> Self {
        Self {
            group: K::GROUP,
            version: K::VERSION,
            kind: K::KIND,
            plural: K::PLURAL,
            singular: K::SINGULAR,
            short_names: K::SHORT_NAMES,
            scope: K::SCOPE,
            has_status: K::HAS_STATUS,
            decode: decode_normalized::<K>,
            columns: K::table_columns,
            row: K::table_row,
            schema: |g| g.subschema_for::<K>(),
            schema_name: || K::schema_name().into_owned(),
        }
    }

    /// `group/version` (or `version` for core).
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Whether objects live in namespaces.
    pub fn namespaced(&self) -> bool {
        self.scope == Scope::Namespaced
    }

    /// `plural.group` (`virtualmachines.kubevirt.io`), as used in error messages.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// `Kind.group` (`VirtualMachine.kubevirt.io`), as used in Invalid messages.
    pub fn kind_qualified(&self) -> String {
        if self.group.is_empty() {
            self.kind.to_string()
        } else {
            format!("{}.{}", self.kind, self.group)
        }
    }
}

/// The set of served kinds.
#[derive(Clone, Debug)]
pub struct Registry {
    kinds: Vec<KindInfo>,
}

impl Default for Registry {
    /// KubeVirt's three kinds, sheaf's Volume and Node, core Namespace and
    /// Secret, and coordination.k8s.io Lease.
    fn default() -> Self {
        Self {
            kinds: vec![
                KindInfo::of::<VirtualMachine>(),
                KindInfo::of::<VirtualMachineInstance>(),
                KindInfo::of::<VirtualMachineInstanceMigration>(),
                KindInfo::of::<Volume>(),
                KindInfo::of::<Node>(),
                KindInfo::of::<Namespace>(),
                KindInfo::of::<Secret>(),
                KindInfo::of::<k8s_openapi::api::coordination::v1::Lease>(),
            ],
        }
    }
}

impl Registry {
    /// An empty registry.
    pub fn empty() -> Self {
        Self { kinds: Vec::new() }
    }
    /// Adds a kind.
    pub fn register(&mut self, k: KindInfo) {
        self.kinds.push(k);
    }
    /// All kinds.
    pub fn kinds(&self) -> &[KindInfo] {
        &self.kinds
    }
    /// Finds a kind by group, version and URL plural.
    pub fn by_plural(&self, group: &str, version: &str, plural: &str) -> Option<&KindInfo> {
        self.kinds
            .iter()
            .find(|k| k.group == group && k.version == version && k.plural == plural)
    }
    /// Finds a kind by `apiVersion` and `kind`.
    pub fn by_kind(&self, api_version: &str, kind: &str) -> Option<&KindInfo> {
        self.kinds
            .iter()
            .find(|k| k.api_version() == api_version && k.kind == kind)
    }
    /// Groups and their versions, in registration order (core `""` included).
    pub fn groups(&self) -> Vec<(&'static str, &'static str)> {
        let mut out: Vec<(&'static str, &'static str)> = Vec::new();
        for k in &self.kinds {
            if !out.contains(&(k.group, k.version)) {
                out.push((k.group, k.version));
            }
        }
        out
    }
}

impl Resource for Namespace {
    const GROUP: &'static str = "";
    const VERSION: &'static str = "v1";
    const KIND: &'static str = "Namespace";
    const PLURAL: &'static str = "namespaces";
    const SINGULAR: &'static str = "namespace";
    const SHORT_NAMES: &'static [&'static str] = &["ns"];
    const SCOPE: Scope = Scope::Cluster;
    const HAS_STATUS: bool = true;
    fn metadata(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        &mut self.metadata
    }
    fn validate(&self) -> Vec<FieldError> {
        match &self.metadata.name {
            Some(n) if !is_dns_label(n) => vec![FieldError::invalid(
                "metadata.name",
                n,
                "a namespace name must be a lowercase RFC 1123 label",
            )],
            _ => Vec::new(),
        }
    }
    fn table_columns() -> Vec<TableColumn> {
        vec![
            TableColumn::new("Status", "string", "Phase"),
            TableColumn::new("Age", "date", "Time since creation"),
        ]
    }
    fn table_row(obj: &Value) -> Vec<Value> {
        let phase = json_str(obj, "status.phase");
        vec![
            Value::String(if phase.is_empty() {
                "Active".into()
            } else {
                phase.to_string()
            }),
            age_cell(obj),
        ]
    }
}

/// Largest Secret (all values together), as Kubernetes' `MaxSecretSize`.
pub const MAX_SECRET_BYTES: usize = 1 << 20;

fn is_config_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 253
        && k != "."
        && k != ".."
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// core/v1 Secret: stored as the API server stores it (`stringData`
/// merged into `data`, base64 on the wire). sheaf reads it for
/// `cloudInitNoCloud.secretRef` / `networkDataSecretRef`.
impl Resource for Secret {
    const GROUP: &'static str = "";
    const VERSION: &'static str = "v1";
    const KIND: &'static str = "Secret";
    const PLURAL: &'static str = "secrets";
    const SINGULAR: &'static str = "secret";
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
        let mut total = 0usize;
        let data = self
            .data
            .iter()
            .flatten()
            .map(|(k, v)| ("data", k, v.0.len()));
        let string_data = self
            .string_data
            .iter()
            .flatten()
            .map(|(k, v)| ("stringData", k, v.len()));
        for (field, k, len) in data.chain(string_data) {
            total += len;
            if !is_config_key(k) {
                errs.push(FieldError::invalid(
                    format!("{field}[{k}]"),
                    k,
                    "a valid config key must consist of alphanumeric characters, '-', '_' or '.'",
                ));
            }
        }
        if total > MAX_SECRET_BYTES {
            errs.push(FieldError::forbidden(
                "data",
                format!("Too long: must have at most {MAX_SECRET_BYTES} bytes"),
            ));
        }
        errs
    }
    fn normalize(&mut self) {
        if let Some(sd) = self.string_data.take() {
            let data = self.data.get_or_insert_with(Default::default);
            for (k, v) in sd {
                data.insert(k, ByteString(v.into_bytes()));
            }
        }
        if self.type_.is_none() {
            self.type_ = Some("Opaque".into());
        }
    }
    fn table_columns() -> Vec<TableColumn> {
        vec![
            TableColumn::new("Type", "string", "The type of the secret"),
            TableColumn::new("Data", "string", "Number of items in the secret"),
            TableColumn::new("Age", "date", "Time since creation"),
        ]
    }
    fn table_row(obj: &Value) -> Vec<Value> {
        let n = obj
            .get("data")
            .and_then(Value::as_object)
            .map_or(0, |m| m.len());
        vec![
            Value::String(json_str(obj, "type").to_string()),
            Value::from(n),
            age_cell(obj),
        ]
    }
}
