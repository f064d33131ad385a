// SPDX-License-Identifier: Apache-2.0
//! Translation from the stored resources to sheaf-sched's model: nodes,
//! VM requests (resources, node selector, affinity, tolerations, topology
//! spread, storage locality) and replica requests.
//!
//! The translation is the one place where Kubernetes shapes meet the
//! scheduler's types; anything the scheduler cannot express is an error
//! (fail closed) rather than silently ignored.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::apimachinery::pkg::apis::meta::v1 as meta;
use sheaf_sched as sched;

use super::util::{condition_true, is_final, ns_name, vmi_node};
use crate::resources::kubevirt::VirtualMachineInstance;
use crate::resources::sheaf::{ReplicaState, Volume};
use crate::resources::{Node, parse_quantity_bytes, parse_quantity_millis};

/// Taint the scheduler sees on a node whose Ready condition is not `True`.
pub const NOT_READY_TAINT: &str = "node.kubernetes.io/not-ready";
/// Taint the node lifecycle controller puts on a node that stopped heartbeating.
pub const UNREACHABLE_TAINT: &str = "node.kubernetes.io/unreachable";
/// The disk name replicas are placed on (one data directory per node).
pub const DEFAULT_DISK: &str = "default";

/// A node as the scheduler sees it. `scheduled_bytes` is the space already
/// promised to replicas on it.
pub fn sched_node(node: &Node, scheduled_bytes: u64) -> sched::Node {
    let name = node.metadata.name.clone().unwrap_or_default();
    let status = node.status.clone().unwrap_or_default();
    let res = status.allocatable.as_ref().or(status.capacity.as_ref());
    let get = |k: &str| res.and_then(|m| m.get(k)).map(|q| q.0.clone());
    let cpu = get("cpu")
        .and_then(|q| parse_quantity_millis(&q))
        .unwrap_or(0);
    let mem = get("memory")
        .and_then(|q| parse_quantity_bytes(&q))
        .unwrap_or(0);
    let storage = get("storage")
        .and_then(|q| parse_quantity_bytes(&q))
        .unwrap_or(0);
    let mut n = sched::Node::new(name, cpu, mem);
    if let Some(z) = node.spec.zone.as_deref().filter(|z| !z.is_empty()) {
        n = n.zone(z);
    }
    for (k, v) in node.metadata.labels.iter().flatten() {
        n = n.label(k, v);
    }
    for t in node.spec.taints.iter().flatten() {
        if let Some(effect) = taint_effect(&t.effect) {
            n.taints.push(sched::Taint {
                key: t.key.clone(),
                value: t.value.clone().unwrap_or_default(),
                effect,
            });
        }
    }
    if !condition_true(&status.conditions, "Ready")
        && !n.taints.iter().any(|t| t.key == UNREACHABLE_TAINT)
    {
        n.taints.push(sched::Taint {
            key: NOT_READY_TAINT.into(),
            value: String::new(),
            effect: sched::TaintEffect::NoSchedule,
        });
    }
    n.unschedulable = node.spec.unschedulable.unwrap_or(false);
    if storage > 0 {
        n = n.disk(DEFAULT_DISK, storage);
        if let Some(d) = n.disks.last_mut() {
            d.scheduled_bytes = scheduled_bytes;
        }
    }
    n
}

fn taint_effect(s: &str) -> Option<sched::TaintEffect> {
    Some(match s {
        "NoSchedule" => sched::TaintEffect::NoSchedule,
        "PreferNoSchedule" => sched::TaintEffect::PreferNoSchedule,
        "NoExecute" => sched::TaintEffect::NoExecute,
        _ => return None,
    })
}

/// Bytes of replicas promised per node, from every volume's placement.
pub fn scheduled_bytes(volumes: &[Volume]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for v in volumes {
        let size = parse_quantity_bytes(&v.spec.size.0).unwrap_or(0);
        for r in v.status.iter().flat_map(|s| s.replicas.iter().flatten()) {
            *out.entry(r.node_name.clone()).or_insert(0) += size;
        }
    }
    out
}

/// A snapshot of the cluster: every node, every bound non-final instance.
/// Instances that fail to translate are skipped (they were validated when
/// they were scheduled).
pub fn snapshot(
    nodes: &[Node],
    vmis: &[VirtualMachineInstance],
    volumes: &[Volume],
) -> Result<sched::ClusterSnapshot, String> {
    let bytes = scheduled_bytes(volumes);
    let mut snap = sched::ClusterSnapshot::new();
    for n in nodes {
        let name = n.metadata.name.as_deref().unwrap_or("");
        let sn = sched_node(n, bytes.get(name).copied().unwrap_or(0));
        snap.add_node(sn).map_err(|e| e.to_string())?;
    }
    for vmi in vmis {
        let Some(node) = vmi_node(vmi) else { continue };
        if is_final(vmi.status.as_ref().and_then(|s| s.phase)) {
            continue;
        }
        if snap.node(node).is_none() {
            continue;
        }
        if let Ok(req) = vm_request(vmi, volumes) {
            let _ = snap.bind(&req, node);
        }
    }
    Ok(snap)
}

/// The scheduler request for an instance.
pub fn vm_request(
    vmi: &VirtualMachineInstance,
    volumes: &[Volume],
) -> Result<sched::Request, String> {
    let spec = &vmi.spec;
    let d = &spec.domain;
    let requests = d.resources.as_ref().and_then(|r| r.requests.as_ref());
    let vcpus = d.cpu.as_ref().map(|c| c.vcpus()).unwrap_or(1).max(1) as u64;
    // KubeVirt requests 100m per vCPU unless told otherwise (cpuAllocationRatio 10).
    let cpu = match requests.and_then(|r| r.get("cpu")) {
        Some(q) => parse_quantity_millis(&q.0).ok_or(format!("bad cpu request {:?}", q.0))?,
        None => vcpus * 100,
    };
    let mem_q = requests
        .and_then(|r| r.get("memory"))
        .or(d.memory.as_ref().and_then(|m| m.guest.as_ref()));
    let mem = match mem_q {
        Some(q) => parse_quantity_bytes(&q.0).ok_or(format!("bad memory request {:?}", q.0))?,
        None => 0,
    };
    let mut r = sched::Request::new(ns_name(vmi), cpu, mem);
    r.preemption_policy = sched::PreemptionPolicy::Never;
    for (k, v) in vmi.metadata.labels.iter().flatten() {
        r = r.label(k, v);
    }
    for (k, v) in spec.node_selector.iter().flatten() {
        r = r.node_selector(k, v);
    }
    if let Some(a) = &spec.affinity {
        affinity(a, &mut r)?;
    }
    for t in spec.tolerations.iter().flatten() {
        r.tolerations.push(toleration(t)?);
    }
    for c in spec.topology_spread_constraints.iter().flatten() {
        r.topology_spread.push(sched::TopologySpreadConstraint {
            max_skew: u32::try_from(c.max_skew.max(1)).unwrap_or(1),
            topology_key: c.topology_key.clone(),
            when_unsatisfiable: match c.when_unsatisfiable.as_str() {
                "ScheduleAnyway" => sched::WhenUnsatisfiable::ScheduleAnyway,
                _ => sched::WhenUnsatisfiable::DoNotSchedule,
            },
            selector: c
                .label_selector
                .as_ref()
                .map(label_selector)
                .transpose()?
                .unwrap_or_default(),
        });
    }
    // Storage locality: the first sheaf volume's replicas.
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("");
    if let Some(vol) = spec
        .volumes
        .iter()
        .filter_map(|v| v.sheaf_volume_name())
        .find_map(|n| {
            volumes.iter().find(|v| {
                v.metadata.name.as_deref() == Some(n) && v.metadata.namespace.as_deref() == Some(ns)
            })
        })
    {
        for rep in vol.status.iter().flat_map(|s| s.replicas.iter().flatten()) {
            r.volume_replicas.push(sched::ReplicaLocation {
                node: rep.node_name.clone(),
                disk: Some(DEFAULT_DISK.into()),
                healthy: rep.state == Some(ReplicaState::Healthy),
            });
        }
    }
    Ok(r)
}

fn requirement(
    key: &str,
    op: &str,
    values: &Option<Vec<String>>,
) -> Result<sched::Requirement, String> {
    let operator = match op {
        "In" => sched::Operator::In,
        "NotIn" => sched::Operator::NotIn,
        "Exists" => sched::Operator::Exists,
        "DoesNotExist" => sched::Operator::DoesNotExist,
        "Gt" => sched::Operator::Gt,
        "Lt" => sched::Operator::Lt,
        other => return Err(format!("unsupported selector operator {other:?}")),
    };
    Ok(sched::Requirement {
        key: key.to_string(),
        operator,
        values: values.clone().unwrap_or_default(),
    })
}

fn node_term(t: &core::NodeSelectorTerm) -> Result<sched::NodeSelectorTerm, String> {
    if t.match_fields.as_ref().is_some_and(|f| !f.is_empty()) {
        return Err("nodeSelectorTerms[].matchFields is not supported".into());
    }
    Ok(sched::NodeSelectorTerm {
        match_expressions: t
            .match_expressions
            .iter()
            .flatten()
            .map(|e| requirement(&e.key, &e.operator, &e.values))
            .collect::<Result<_, _>>()?,
    })
}

fn label_selector(s: &meta::LabelSelector) -> Result<sched::LabelSelector, String> {
    Ok(sched::LabelSelector {
        match_labels: s.match_labels.clone().unwrap_or_default(),
        match_expressions: s
            .match_expressions
            .iter()
            .flatten()
            .map(|e| requirement(&e.key, &e.operator, &e.values))
            .collect::<Result<_, _>>()?,
    })
}

fn pod_term(t: &core::PodAffinityTerm) -> Result<sched::VmAffinityTerm, String> {
    Ok(sched::VmAffinityTerm {
        selector: t
            .label_selector
            .as_ref()
            .map(label_selector)
            .transpose()?
            .unwrap_or_default(),
        topology_key: t.topology_key.clone(),
    })
}

fn vm_affinity(
    required: &Option<Vec<core::PodAffinityTerm>>,
    preferred: &Option<Vec<core::WeightedPodAffinityTerm>>,
) -> Result<sched::VmAffinity, String> {
    Ok(sched::VmAffinity {
        required: required
            .iter()
            .flatten()
            .map(pod_term)
            .collect::<Result<_, _>>()?,
        preferred: preferred
            .iter()
            .flatten()
            .map(|w| {
                Ok(sched::WeightedVmAffinityTerm {
                    weight: w.weight,
                    term: pod_term(&w.pod_affinity_term)?,
                })
            })
            .collect::<Result<_, String>>()?,
    })
}

fn affinity(a: &core::Affinity, r: &mut sched::Request) -> Result<(), String> {
    if let Some(na) = &a.node_affinity {
        if let Some(req) = &na.required_during_scheduling_ignored_during_execution {
            r.node_affinity.required = req
                .node_selector_terms
                .iter()
                .map(node_term)
                .collect::<Result<_, _>>()?;
        }
        for p in na
            .preferred_during_scheduling_ignored_during_execution
            .iter()
            .flatten()
        {
            r.node_affinity.preferred.push(sched::PreferredNodeTerm {
                weight: p.weight,
                term: node_term(&p.preference)?,
            });
        }
    }
    if let Some(pa) = &a.pod_affinity {
        r.affinity = vm_affinity(
            &pa.required_during_scheduling_ignored_during_execution,
            &pa.preferred_during_scheduling_ignored_during_execution,
        )?;
    }
    if let Some(pa) = &a.pod_anti_affinity {
        r.anti_affinity = vm_affinity(
            &pa.required_during_scheduling_ignored_during_execution,
            &pa.preferred_during_scheduling_ignored_during_execution,
        )?;
    }
    Ok(())
}

fn toleration(t: &core::Toleration) -> Result<sched::Toleration, String> {
    Ok(sched::Toleration {
        key: t.key.clone().unwrap_or_default(),
        operator: match t.operator.as_deref() {
            None | Some("Equal") => sched::TolerationOperator::Equal,
            Some("Exists") => sched::TolerationOperator::Exists,
            Some(o) => return Err(format!("unsupported toleration operator {o:?}")),
        },
        value: t.value.clone().unwrap_or_default(),
        effect: match t.effect.as_deref() {
            None | Some("") => None,
            Some(e) => Some(taint_effect(e).ok_or(format!("unknown taint effect {e:?}"))?),
        },
    })
}

/// The replica request for a volume: `existing` replicas (node, healthy)
/// stay where they are; new ones avoid their nodes.
pub fn replica_request(
    vol: &Volume,
    existing: &[(String, bool)],
) -> Result<sched::ReplicaRequest, String> {
    let size = parse_quantity_bytes(&vol.spec.size.0)
        .filter(|b| *b > 0)
        .ok_or(format!("bad volume size {:?}", vol.spec.size.0))?;
    Ok(sched::ReplicaRequest {
        volume: ns_name(vol),
        size_bytes: size,
        replicas: vol.spec.replica_count(),
        existing: existing
            .iter()
            .map(|(n, healthy)| sched::ReplicaLocation {
                node: n.clone(),
                disk: Some(DEFAULT_DISK.into()),
                healthy: *healthy,
            })
            .collect(),
        node_selector: vol.spec.node_selector.clone().unwrap_or_default(),
        disk_tags: Vec::new(),
        zone_anti_affinity: sched::ZoneAntiAffinity::Soft,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::decode::{FieldValidation, decode};

    fn vmi(yaml: &str) -> VirtualMachineInstance {
        let v: serde_json::Value = serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("{e}"));
        decode::<VirtualMachineInstance>(&v, FieldValidation::Strict)
            .map(|(v, _)| v)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn translates_resources_selectors_affinity_and_tolerations() {
        let v = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: a, namespace: ns, labels: {app: web}}
spec:
  domain:
    cpu: {cores: 2}
    memory: {guest: 1Gi}
    devices: {}
  nodeSelector: {disk: ssd}
  tolerations: [{key: gpu, operator: Exists, effect: NoSchedule}]
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms: [{matchExpressions: [{key: zone, operator: In, values: [a, b]}]}]
    podAntiAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
      - labelSelector: {matchLabels: {app: web}}
        topologyKey: kubernetes.io/hostname
"#);
        let r = vm_request(&v, &[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.name, "ns/a");
        assert_eq!(r.resources.cpu_millis, 200);
        assert_eq!(r.resources.memory_bytes, 1 << 30);
        assert_eq!(r.node_selector.get("disk").map(String::as_str), Some("ssd"));
        assert_eq!(r.tolerations[0].operator, sched::TolerationOperator::Exists);
        assert_eq!(
            r.node_affinity.required[0].match_expressions[0].values,
            ["a", "b"]
        );
        assert_eq!(
            r.anti_affinity.required[0].topology_key,
            "kubernetes.io/hostname"
        );
    }

    #[test]
    fn unsupported_operators_fail_closed() {
        let v = vmi(r#"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: a, namespace: ns}
spec:
  domain: {memory: {guest: 64Mi}, devices: {}}
  tolerations: [{key: x, operator: Sometimes}]
"#);
        let e = vm_request(&v, &[]).err().unwrap_or_default();
        assert!(e.contains("Sometimes"), "{e}");
    }
}
