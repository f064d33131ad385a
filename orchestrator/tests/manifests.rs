// SPDX-License-Identifier: Apache-2.0
//! Realistic KubeVirt manifests decode unchanged (strictly) and round-trip.
#![allow(clippy::unwrap_used)]

use serde_json::Value;
use sheaf_orchestrator::resources::{
    FieldValidation, Registry, RunStrategy, VirtualMachine, decode,
};

fn docs(name: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(format!(
        "{}/tests/manifests/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// Removes nulls (e.g. `creationTimestamp: null`), which serializing drops.
fn strip_nulls(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|_, v| !v.is_null());
            m.values_mut().for_each(strip_nulls);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

#[test]
fn manifests_decode_strictly_and_round_trip() {
    let reg = Registry::default();
    let mut n = 0;
    for file in [
        "vm-cirros.yaml",
        "vm-fedora-datavolume.yaml",
        "vmi-migratable.yaml",
    ] {
        for doc in docs(file) {
            let kind = reg
                .by_kind(
                    doc["apiVersion"].as_str().unwrap(),
                    doc["kind"].as_str().unwrap(),
                )
                .unwrap();
            let (out, warnings) = (kind.decode)(&doc, FieldValidation::Strict)
                .unwrap_or_else(|e| panic!("{file}: {e}"));
            assert!(warnings.is_empty());
            let mut want = doc.clone();
            strip_nulls(&mut want);
            assert_eq!(out, want, "{file}: {} does not round-trip", kind.kind);
            n += 1;
        }
    }
    assert_eq!(n, 5);
}

#[test]
fn typed_view_of_the_fedora_vm() {
    let doc = docs("vm-fedora-datavolume.yaml").remove(0);
    let (vm, _) = decode::<VirtualMachine>(&doc, FieldValidation::Strict).unwrap();
    assert_eq!(vm.spec.effective_run_strategy(), RunStrategy::Always);
    let spec = &vm.spec.template.spec;
    assert_eq!(spec.domain.cpu.as_ref().unwrap().vcpus(), 2);
    assert_eq!(spec.volumes[0].sheaf_volume_name(), Some("fedora-root"));
    assert_eq!(
        spec.tolerations.as_ref().unwrap()[0].key.as_deref(),
        Some("sheaf.dev/maintenance")
    );
    assert!(spec.affinity.as_ref().unwrap().pod_anti_affinity.is_some());
}

#[test]
fn unknown_fields_inside_kubernetes_types_are_caught() {
    let mut doc = docs("vm-fedora-datavolume.yaml").remove(0);
    doc["spec"]["template"]["spec"]["tolerations"][0]["colour"] = "blue".into();
    let err = decode::<VirtualMachine>(&doc, FieldValidation::Strict).unwrap_err();
    assert!(
        err.to_string()
            .contains("spec.template.spec.tolerations[0].colour"),
        "{err}"
    );
}
