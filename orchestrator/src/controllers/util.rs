// SPDX-License-Identifier: Apache-2.0
//! Small helpers shared by the controllers and the node agent: conditions,
//! phase transitions, owner references, timestamps.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::resources::common::now;
use crate::resources::kubevirt::{
    PhaseTransition, VirtualMachineInstance, VirtualMachineInstanceStatus,
};
use crate::resources::{Condition, ConditionStatus, Resource, VmiPhase};

/// Finalizer the node agent holds on a bound instance until its launcher is gone.
pub const LAUNCHER_FINALIZER: &str = "sheaf.dev/launcher";

/// Label on instances created by a VirtualMachine (KubeVirt's `vm.kubevirt.io/name`).
pub const VM_NAME_LABEL: &str = "vm.kubevirt.io/name";

/// Annotation selecting the VM runtime of an instance (`sheaf-vmm` or `qemu`).
pub const RUNTIME_ANNOTATION: &str = "sheaf.dev/runtime";

/// Sets (or updates) condition `type_`; the transition time changes only
/// when the status does. Returns whether anything changed.
pub fn set_condition(
    conds: &mut Option<Vec<Condition>>,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
) -> bool {
    let list = conds.get_or_insert_with(Vec::new);
    let reason = (!reason.is_empty()).then(|| reason.to_string());
    let message = (!message.is_empty()).then(|| message.to_string());
    if let Some(c) = list.iter_mut().find(|c| c.type_ == type_) {
        if c.status == status && c.reason == reason && c.message == message {
            return false;
        }
        if c.status != status {
            c.last_transition_time = Some(now());
        }
        c.status = status;
        c.reason = reason;
        c.message = message;
        return true;
    }
    let mut c = Condition::new(type_, status);
    c.reason = reason;
    c.message = message;
    list.push(c);
    true
}

/// Condition `type_`, if present.
pub fn condition<'a>(conds: &'a Option<Vec<Condition>>, type_: &str) -> Option<&'a Condition> {
    conds.as_ref()?.iter().find(|c| c.type_ == type_)
}

/// Whether condition `type_` is `True`.
pub fn condition_true(conds: &Option<Vec<Condition>>, type_: &str) -> bool {
    condition(conds, type_).is_some_and(|c| c.status == ConditionStatus::True)
}

/// Removes condition `type_`. Returns whether it was there.
pub fn remove_condition(conds: &mut Option<Vec<Condition>>, type_: &str) -> bool {
    let Some(list) = conds else { return false };
    let before = list.len();
    list.retain(|c| c.type_ != type_);
    before != list.len()
}

/// Whether an instance phase is final.
pub fn is_final(phase: Option<VmiPhase>) -> bool {
    matches!(phase, Some(VmiPhase::Succeeded | VmiPhase::Failed))
}

/// Sets the phase of an instance and records the transition time.
pub fn set_phase(status: &mut VirtualMachineInstanceStatus, phase: VmiPhase) {
    if status.phase == Some(phase) {
        return;
    }
    status.phase = Some(phase);
    let ts = status
        .phase_transition_timestamps
        .get_or_insert_with(Vec::new);
    ts.push(PhaseTransition {
        phase: format!("{phase:?}"),
        phase_transition_timestamp: now(),
    });
    // Bounded: a long-lived instance that migrates often keeps the last few.
    if ts.len() > 16 {
        let drop = ts.len() - 16;
        ts.drain(..drop);
    }
}

/// The instance's phase.
pub fn vmi_phase(vmi: &VirtualMachineInstance) -> Option<VmiPhase> {
    vmi.status.as_ref().and_then(|s| s.phase)
}

/// The node an instance is bound to.
pub fn vmi_node(vmi: &VirtualMachineInstance) -> Option<&str> {
    vmi.status
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
}

/// `namespace/name` of an object.
pub fn ns_name<K: Resource>(obj: &K) -> String {
    format!(
        "{}/{}",
        obj.metadata().namespace.as_deref().unwrap_or(""),
        obj.metadata().name.as_deref().unwrap_or("")
    )
}

/// The object's uid (empty if unset).
pub fn uid<K: Resource>(obj: &K) -> &str {
    obj.metadata().uid.as_deref().unwrap_or("")
}

/// The object's name (empty if unset).
pub fn name<K: Resource>(obj: &K) -> &str {
    obj.metadata().name.as_deref().unwrap_or("")
}

/// The object's namespace (empty if unset).
pub fn namespace<K: Resource>(obj: &K) -> &str {
    obj.metadata().namespace.as_deref().unwrap_or("")
}

/// Whether the object is being deleted.
pub fn deleting<K: Resource>(obj: &K) -> bool {
    obj.metadata().deletion_timestamp.is_some()
}

/// Whether the object carries finalizer `f`.
pub fn has_finalizer<K: Resource>(obj: &K, f: &str) -> bool {
    obj.metadata()
        .finalizers
        .as_ref()
        .is_some_and(|l| l.iter().any(|x| x == f))
}

/// Adds finalizer `f`; returns whether it was added.
pub fn add_finalizer<K: Resource>(obj: &mut K, f: &str) -> bool {
    if has_finalizer(obj, f) {
        return false;
    }
    obj.metadata_mut()
        .finalizers
        .get_or_insert_with(Vec::new)
        .push(f.to_string());
    true
}

/// Removes finalizer `f`; returns whether it was there.
pub fn remove_finalizer<K: Resource>(obj: &mut K, f: &str) -> bool {
    let Some(list) = obj.metadata_mut().finalizers.as_mut() else {
        return false;
    };
    let before = list.len();
    list.retain(|x| x != f);
    let changed = before != list.len();
    if list.is_empty() {
        obj.metadata_mut().finalizers = None;
    }
    changed
}

/// A controller owner reference to `owner`.
pub fn controller_ref<K: Resource>(owner: &K) -> OwnerReference {
    OwnerReference {
        api_version: K::api_version(),
        kind: K::KIND.to_string(),
        name: name(owner).to_string(),
        uid: uid(owner).to_string(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// The current time, RFC 3339 with microseconds (leases).
pub fn now_micro() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Microsecond)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| jiff::Timestamp::now().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_keep_transition_time_until_status_changes() {
        let mut c = None;
        assert!(set_condition(
            &mut c,
            "Ready",
            ConditionStatus::False,
            "Starting",
            ""
        ));
        let t0 = condition(&c, "Ready").and_then(|c| c.last_transition_time.clone());
        assert!(!set_condition(
            &mut c,
            "Ready",
            ConditionStatus::False,
            "Starting",
            ""
        ));
        assert!(set_condition(
            &mut c,
            "Ready",
            ConditionStatus::False,
            "Waiting",
            "x"
        ));
        assert_eq!(
            condition(&c, "Ready").and_then(|c| c.last_transition_time.clone()),
            t0
        );
        assert!(set_condition(
            &mut c,
            "Ready",
            ConditionStatus::True,
            "",
            ""
        ));
        assert!(condition_true(&c, "Ready"));
        assert!(remove_condition(&mut c, "Ready"));
        assert!(!condition_true(&c, "Ready"));
    }

    #[test]
    fn phase_history_is_bounded() {
        let mut s = VirtualMachineInstanceStatus::default();
        for i in 0..40 {
            set_phase(
                &mut s,
                if i % 2 == 0 {
                    VmiPhase::Scheduled
                } else {
                    VmiPhase::Running
                },
            );
        }
        assert_eq!(s.phase_transition_timestamps.map(|t| t.len()), Some(16));
    }

    #[test]
    fn micro_timestamps_parse_back() {
        let t = now_micro();
        assert!(t.parse::<jiff::Timestamp>().is_ok(), "{t}");
    }
}
