// SPDX-License-Identifier: Apache-2.0
//! The manifests in `deploy/`: CRDs, RBAC, the control plane Deployment and
//! the node agent DaemonSet. Generated here so they cannot drift from the
//! types (`tests/kube_manifests.rs` fails when `deploy/` is stale; regenerate
//! with `cargo run -p sheaf-orchestrator --features kube --bin sheaf-kube --
//! manifests --out deploy`).

use std::path::Path;

use serde_json::{Value, json};

use super::crd;
use crate::resources::Registry;

/// Namespace of the control plane and the agents.
pub const NAMESPACE: &str = "sheaf-system";
/// Secret holding the replication key (`key` entry, hex).
pub const REPLICATION_SECRET: &str = "sheaf-replication";

/// Settings of the generated manifests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ManifestConfig {
    /// Container image with `sheaf-kube` and `sheaf-launcher` in `/usr/local/bin`.
    pub image: String,
    /// Host directory of the agents' data (replicas, launcher state).
    pub host_data_dir: String,
}

impl Default for ManifestConfig {
    fn default() -> Self {
        Self {
            image: "ghcr.io/sheaf-dev/sheaf:0.1.0".into(),
            host_data_dir: "/var/lib/sheaf".into(),
        }
    }
}

fn labels(component: &str) -> Value {
    json!({"app.kubernetes.io/name": "sheaf", "app.kubernetes.io/component": component})
}

fn rule(groups: &[&str], resources: &[&str], verbs: &[&str]) -> Value {
    json!({"apiGroups": groups, "resources": resources, "verbs": verbs})
}

const ALL_VERBS: &[&str] = &[
    "get", "list", "watch", "create", "update", "patch", "delete",
];
const READ: &[&str] = &["get", "list", "watch"];

/// Namespace, service accounts, cluster roles and bindings.
pub fn rbac() -> Vec<Value> {
    let sa = |name: &str| {
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels(name)}})
    };
    let role = |name: &str, rules: Vec<Value>| {
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": name, "labels": labels(name)}, "rules": rules})
    };
    let binding = |name: &str| {
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": name, "labels": labels(name)},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]})
    };
    let kubevirt = [
        "virtualmachines",
        "virtualmachines/status",
        "virtualmachineinstances",
        "virtualmachineinstances/status",
        "virtualmachineinstancemigrations",
        "virtualmachineinstancemigrations/status",
    ];
    let sheaf = ["volumes", "volumes/status", "nodes", "nodes/status"];
    vec![
        json!({"apiVersion": "v1", "kind": "Namespace",
               "metadata": {"name": NAMESPACE, "labels": labels("namespace")}}),
        sa("sheaf-control-plane"),
        sa("sheaf-agent"),
        role(
            "sheaf-control-plane",
            vec![
                rule(&["kubevirt.io"], &kubevirt, ALL_VERBS),
                rule(&["sheaf.dev"], &sheaf, ALL_VERBS),
                rule(&[""], &["namespaces"], READ),
            ],
        ),
        role(
            "sheaf-agent",
            vec![
                rule(
                    &["kubevirt.io"],
                    &["virtualmachineinstances", "virtualmachineinstances/status"],
                    &["get", "list", "watch", "update", "patch"],
                ),
                rule(&["kubevirt.io"], &["virtualmachines"], READ),
                // cloudInitNoCloud secretRef / networkDataSecretRef.
                rule(&[""], &["secrets"], &["get"]),
                rule(
                    &["sheaf.dev"],
                    &["volumes", "volumes/status"],
                    &["get", "list", "watch", "update", "patch"],
                ),
                rule(
                    &["sheaf.dev"],
                    &["nodes", "nodes/status"],
                    &["get", "list", "watch", "create", "update", "patch"],
                ),
            ],
        ),
        binding("sheaf-control-plane"),
        binding("sheaf-agent"),
    ]
}

fn secret_volume() -> Value {
    json!({"name": "replication", "secret": {"secretName": REPLICATION_SECRET, "defaultMode": 0o400}})
}

/// The control plane: one replica (the controllers assume a single active
/// instance; `Recreate` never runs two).
pub fn control_plane(cfg: &ManifestConfig) -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "sheaf-control-plane", "namespace": NAMESPACE, "labels": labels("control-plane")},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels("control-plane")},
            "template": {
                "metadata": {"labels": labels("control-plane")},
                "spec": {
                    "serviceAccountName": "sheaf-control-plane",
                    "containers": [{
                        "name": "control-plane",
                        "image": cfg.image,
                        "command": ["/usr/local/bin/sheaf-kube", "control-plane",
                                    "--secret-file", "/etc/sheaf/replication/key"],
                        "env": [{"name": "RUST_LOG", "value": "sheaf_orchestrator=info"}],
                        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                        "volumeMounts": [{"name": "replication", "mountPath": "/etc/sheaf/replication", "readOnly": true}],
                    }],
                    "volumes": [secret_volume()],
                },
            },
        },
    })
}

/// The node agent on every node: host network (replica servers listen on
/// the node's IP), privileged for `/dev/kvm`, data under a host directory so
/// replicas survive agent restarts.
pub fn agent(cfg: &ManifestConfig) -> Value {
    let env = |name: &str, path: &str| json!({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}});
    json!({
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "sheaf-agent", "namespace": NAMESPACE, "labels": labels("agent")},
        "spec": {
            "selector": {"matchLabels": labels("agent")},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels("agent")},
                "spec": {
                    "serviceAccountName": "sheaf-agent",
                    "hostNetwork": true,
                    "dnsPolicy": "ClusterFirstWithHostNet",
                    "terminationGracePeriodSeconds": 30,
                    "containers": [{
                        "name": "agent",
                        "image": cfg.image,
                        "command": ["/usr/local/bin/sheaf-kube", "agent",
                                    "--node", "$(NODE_NAME)",
                                    "--replica-host", "$(HOST_IP)",
                                    "--data-dir", "/var/lib/sheaf",
                                    "--launcher", "/usr/local/bin/sheaf-launcher",
                                    "--secret-file", "/etc/sheaf/replication/key"],
                        "env": [
                            env("NODE_NAME", "spec.nodeName"),
                            env("HOST_IP", "status.hostIP"),
                            {"name": "RUST_LOG", "value": "sheaf_orchestrator=info"},
                        ],
                        "securityContext": {"privileged": true},
                        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                        "volumeMounts": [
                            {"name": "data", "mountPath": "/var/lib/sheaf"},
                            {"name": "kvm", "mountPath": "/dev/kvm"},
                            {"name": "replication", "mountPath": "/etc/sheaf/replication", "readOnly": true},
                        ],
                    }],
                    "volumes": [
                        {"name": "data", "hostPath": {"path": cfg.host_data_dir, "type": "DirectoryOrCreate"}},
                        {"name": "kvm", "hostPath": {"path": "/dev/kvm", "type": "CharDevice"}},
                        secret_volume(),
                    ],
                },
            },
        },
    })
}

/// Renders documents as one multi-document YAML file.
pub fn to_yaml(docs: &[Value]) -> Result<String, serde_yaml::Error> {
    let mut out = String::from(
        "# Generated by `sheaf-kube manifests` (orchestrator/src/kube/manifests.rs); do not edit.\n",
    );
    for d in docs {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(d)?);
    }
    Ok(out)
}

/// Every file of `deploy/`: (file name, contents).
pub fn files(cfg: &ManifestConfig) -> Result<Vec<(&'static str, String)>, serde_yaml::Error> {
    Ok(vec![
        ("crds.yaml", to_yaml(&crd::crds(&Registry::default()))?),
        ("rbac.yaml", to_yaml(&rbac())?),
        ("control-plane.yaml", to_yaml(&[control_plane(cfg)])?),
        ("agent.yaml", to_yaml(&[agent(cfg)])?),
    ])
}

/// Failures writing the manifests.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Rendering YAML.
    #[error("rendering YAML")]
    Render(#[from] serde_yaml::Error),
    /// Writing a file.
    #[error("writing {path}")]
    Write {
        /// Path.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Writes every file of [`files`] into `dir`.
pub fn write(dir: &Path, cfg: &ManifestConfig) -> Result<(), ManifestError> {
    std::fs::create_dir_all(dir).map_err(|source| ManifestError::Write {
        path: dir.display().to_string(),
        source,
    })?;
    for (name, text) in files(cfg)? {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|source| ManifestError::Write {
            path: path.display().to_string(),
            source,
        })?;
    }
    Ok(())
}
