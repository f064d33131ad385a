// SPDX-License-Identifier: Apache-2.0
//! `deploy/` is what the generator writes: the CRDs follow the types, so a
//! type change without `sheaf-kube manifests --out deploy` fails here.
//! `SHEAF_UPDATE_DEPLOY=1 cargo test -p sheaf-orchestrator --features kube
//! --test kube_manifests` rewrites the files instead.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use serde_json::Value;
use sheaf_orchestrator::kube::crd::check_structural;
use sheaf_orchestrator::kube::manifests::{self, ManifestConfig};

fn deploy_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

#[test]
fn deploy_directory_is_in_sync_with_the_generator() {
    let cfg = ManifestConfig::default();
    if std::env::var("SHEAF_UPDATE_DEPLOY").is_ok_and(|v| v == "1") {
        manifests::write(&deploy_dir(), &cfg).unwrap();
    }
    for (name, want) in manifests::files(&cfg).unwrap() {
        let path = deploy_dir().join(name);
        let got = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            got == want,
            "{} is stale: run `cargo run -p sheaf-orchestrator --features kube --bin sheaf-kube -- manifests --out deploy`",
            path.display()
        );
    }
}

#[test]
fn manifests_parse_back_and_crds_are_structural() {
    let cfg = ManifestConfig::default();
    let mut kinds = Vec::new();
    for (_, text) in manifests::files(&cfg).unwrap() {
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: Value = serde::Deserialize::deserialize(doc).unwrap();
            if v.is_null() {
                continue;
            }
            let kind = v["kind"].as_str().unwrap().to_string();
            if kind == "CustomResourceDefinition" {
                // The typed k8s-openapi CRD accepts it (every field known).
                let _: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition =
                    serde_json::from_value(v.clone()).unwrap();
                check_structural(&v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]).unwrap();
            }
            if kind == "Deployment" {
                let _: k8s_openapi::api::apps::v1::Deployment =
                    serde_json::from_value(v.clone()).unwrap();
            }
            if kind == "DaemonSet" {
                let _: k8s_openapi::api::apps::v1::DaemonSet =
                    serde_json::from_value(v.clone()).unwrap();
            }
            kinds.push(kind);
        }
    }
    kinds.sort();
    kinds.dedup();
    assert_eq!(
        kinds,
        [
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
            "DaemonSet",
            "Deployment",
            "Namespace",
            "ServiceAccount"
        ]
    );
}
