// SPDX-License-Identifier: Apache-2.0
//! KubeVirt-compatible resources, controllers, node agent and a Kubernetes-compatible API.
//!
//! Layers (each module depends only on the ones above it):
//!
//! ```text
//!   resources   typed kinds (kubevirt.io/v1, sheaf.dev/v1), decoding, validation
//!   store       Store trait: resourceVersion, watch, finalizers, GC; memory + redb
//!   api         Kubernetes-compatible HTTP API over a Store (TLS, tokens, kubeconfig)
//! ```
//!
//! Controllers and the node agent (issue 7) are added as further modules that
//! consume `store::Store`.
#![warn(missing_docs)]

pub mod api;
pub mod resources;
pub mod store;
