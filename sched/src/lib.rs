// SPDX-License-Identifier: Apache-2.0
//! Placement of VMs and volume replicas on nodes: a kube-scheduler-style plugin framework.
#![warn(missing_docs)]
