// SPDX-License-Identifier: Apache-2.0
//! KubeVirt-compatible resources, controllers, node agent and a Kubernetes-compatible API.
//!
//! Layers (each module depends only on the ones above it):
//!
//! ```text
//!   resources   typed kinds (kubevirt.io/v1, sheaf.dev/v1), decoding, validation
//!   store       Store trait: resourceVersion, watch, finalizers, GC; memory + redb
//!   api         Kubernetes-compatible HTTP API over a Store (TLS, tokens, kubeconfig)
//!   controllers control plane: VM, VMI, Volume, node lifecycle, migration (ControlPlane)
//!   cloudinit   NoCloud seed disks (FAT, label cidata) from cloudInitNoCloud volumes
//!   runtime     VmRuntime: sheaf-vmm (in process) and QEMU (NBD disks)
//!   launcher    one process per VM (and per replica), started by the agent
//!   agent       node agent: heartbeats, launchers, replica servers (NodeAgent)
//!   cluster     a control plane and N nodes in one process (LocalCluster)
//!   audit       offline epoch audit of replica stores
//!   kube        (feature `kube`) KubeStore over a Kubernetes API server, CRDs, deploy/ manifests
//! ```
#![warn(missing_docs)]

pub mod agent;
pub mod api;
pub mod audit;
pub mod cloudinit;
pub mod cluster;
pub mod controllers;
#[doc(hidden)]
pub mod fuzzing;
pub mod images;
#[cfg(feature = "kube")]
pub mod kube;
pub mod launcher;
pub mod names;
pub mod network;
pub mod resources;
pub mod runtime;
pub mod store;
