// SPDX-License-Identifier: Apache-2.0
//! KubeVirt-compatible resources, controllers, node agent and a Kubernetes-compatible API.
#![warn(missing_docs)]
