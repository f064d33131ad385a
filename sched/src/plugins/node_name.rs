// SPDX-License-Identifier: Apache-2.0
//! NodeName: a request pinned to one node (`node_name`) may only go there.

use crate::framework::{
    Ctx, CycleState, FilterPlugin, Plugin, PreFilterPlugin, PreFilterResult, Reason,
};
use crate::snapshot::NodeInfo;

/// Honours [`Request::node_name`](crate::Request::node_name); the pre-filter
/// narrows the cycle to that one node.
#[derive(Clone, Copy, Debug, Default)]
pub struct NodeName;

impl NodeName {
    /// Plugin name.
    pub const NAME: &'static str = "NodeName";
}

impl Plugin for NodeName {
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

impl PreFilterPlugin for NodeName {
    fn tracks_vms(&self) -> bool {
        false
    }

    fn pre_filter(&self, cx: &Ctx<'_>, _: &mut CycleState) -> Result<PreFilterResult, Reason> {
        let Some(name) = &cx.request.node_name else {
            return Ok(PreFilterResult::Skip);
        };
        let slots = cx
            .snapshot
            .node(name)
            .map(|n| vec![n.slot])
            .unwrap_or_default();
        Ok(PreFilterResult::Nodes {
            slots,
            reason: Reason::NodeNameMismatch,
        })
    }
}

impl FilterPlugin for NodeName {
    fn filter(&self, cx: &Ctx<'_>, _: &CycleState, node: &NodeInfo) -> Result<(), Reason> {
        match &cx.request.node_name {
            Some(n) if n != node.name() => Err(Reason::NodeNameMismatch),
            _ => Ok(()),
        }
    }
}
