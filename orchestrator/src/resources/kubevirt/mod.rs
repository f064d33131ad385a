// SPDX-License-Identifier: Apache-2.0
//! `kubevirt.io/v1`: VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration.
//!
//! Field names and JSON shapes follow KubeVirt's API so existing manifests
//! apply unchanged when they stay within the supported subset (see
//! `docs/orchestrator.md`). Volume sources `persistentVolumeClaim` and
//! `dataVolume` name a sheaf [`Volume`](super::Volume) in the same namespace.

mod domain;
mod migration;
mod validation;
mod vm;
mod vmi;
mod volumes;

pub use domain::*;
pub use migration::*;
pub use validation::*;
pub use vm::*;
pub use vmi::*;
pub use volumes::*;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The group of the KubeVirt kinds.
pub const GROUP: &str = "kubevirt.io";

/// An empty object (`{}`), used by KubeVirt for flags such as `masquerade: {}`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, Default, PartialEq)]
pub struct Empty {}
