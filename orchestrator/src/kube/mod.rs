// SPDX-License-Identifier: Apache-2.0
//! Running sheaf on a Kubernetes cluster through kube-rs (feature `kube`).
//!
//! ```text
//!   controllers / node agents ──► Store trait ──► KubeStore ──► kube-rs ──► API server
//!                                                                            (a real cluster with
//!                                                                             deploy/crds.yaml, or
//!                                                                             sheaf's own server)
//! ```
//!
//! - [`KubeStore`]: the [`Store`](crate::store::Store) over a Kubernetes API
//!   server, so the same [`ControlPlane`](crate::controllers::ControlPlane)
//!   and [`NodeAgent`](crate::agent::NodeAgent) run unchanged.
//! - [`crd`]: CustomResourceDefinitions generated from the resource types'
//!   schemas (the same derives as the API server's `/openapi/v3`).
//! - [`manifests`]: everything in `deploy/` (CRDs, RBAC, the control plane
//!   Deployment, the agent DaemonSet).
//! - The resource types implement [`kube::Resource`], so `kube::Api<VirtualMachine>`
//!   works for typed clients.
//!
//! See `docs/kubernetes.md` for running on a cluster.

pub mod crd;
pub mod manifests;
mod store;

pub use store::{KubeConnectError, KubeStore};

use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::resources::{
    Node, Resource, VirtualMachine, VirtualMachineInstance, VirtualMachineInstanceMigration, Volume,
};

macro_rules! kube_resource {
    ($t:ty, $scope:ty) => {
        impl kube::Resource for $t {
            type DynamicType = ();
            type Scope = $scope;
            fn kind(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(<$t as Resource>::KIND)
            }
            fn group(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(<$t as Resource>::GROUP)
            }
            fn version(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(<$t as Resource>::VERSION)
            }
            fn plural(_: &()) -> Cow<'_, str> {
                Cow::Borrowed(<$t as Resource>::PLURAL)
            }
            fn meta(&self) -> &ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

kube_resource!(VirtualMachine, kube::core::NamespaceResourceScope);
kube_resource!(VirtualMachineInstance, kube::core::NamespaceResourceScope);
kube_resource!(
    VirtualMachineInstanceMigration,
    kube::core::NamespaceResourceScope
);
kube_resource!(Volume, kube::core::NamespaceResourceScope);
kube_resource!(Node, kube::core::ClusterResourceScope);
