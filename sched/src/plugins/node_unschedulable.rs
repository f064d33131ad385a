// SPDX-License-Identifier: Apache-2.0
//! NodeUnschedulable: cordoned nodes take no new VMs, unless tolerated.

use crate::framework::{
    Ctx, CycleState, FilterPlugin, Plugin, PreFilterPlugin, PreFilterResult, Reason, for_pending,
};
use crate::snapshot::NodeInfo;
use crate::types::{TaintEffect, TolerationOperator, UNSCHEDULABLE_TAINT_KEY};

/// Filters out cordoned nodes unless the VM tolerates
/// `node.kubernetes.io/unschedulable:NoSchedule`.
#[derive(Clone, Copy, Debug, Default)]
pub struct NodeUnschedulable;

impl NodeUnschedulable {
    /// Plugin name.
    pub const NAME: &'static str = "NodeUnschedulable";
}

impl Plugin for NodeUnschedulable {
    fn name(&self) -> &str {
        Self::NAME
    }
    fn as_pre_filter(&self) -> Option<&dyn PreFilterPlugin> {
        Some(self)
    }
    fn as_filter(&self) -> Option<&dyn FilterPlugin> {
        Some(self)
    }
}

impl PreFilterPlugin for NodeUnschedulable {
    fn tracks_vms(&self) -> bool {
        false
    }

    fn pre_filter(&self, cx: &Ctx<'_>, _: &mut CycleState) -> Result<PreFilterResult, Reason> {
        let tolerated = cx.request.tolerations.iter().any(|t| {
            let key_ok = match t.operator {
                TolerationOperator::Exists => t.key.is_empty() || t.key == UNSCHEDULABLE_TAINT_KEY,
                TolerationOperator::Equal => t.key == UNSCHEDULABLE_TAINT_KEY && t.value.is_empty(),
            };
            key_ok && t.effect.is_none_or(|e| e == TaintEffect::NoSchedule)
        });
        Ok(if tolerated {
            PreFilterResult::Skip
        } else {
            PreFilterResult::Continue
        })
    }
}

impl FilterPlugin for NodeUnschedulable {
    #[inline]
    fn filter(&self, _: &Ctx<'_>, _: &CycleState, node: &NodeInfo) -> Result<(), Reason> {
        check(node)
    }

    fn filter_batch(
        &self,
        cx: &Ctx<'_>,
        _: &CycleState,
        slots: &[u32],
        out: &mut [Option<Reason>],
    ) {
        for_pending(cx.snapshot, slots, out, check);
    }
}

#[inline]
fn check(node: &NodeInfo) -> Result<(), Reason> {
    if node.unschedulable {
        Err(Reason::NodeUnschedulable)
    } else {
        Ok(())
    }
}
