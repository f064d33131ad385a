// SPDX-License-Identifier: Apache-2.0
//! Shared helpers for the sheaf examples and the `sheaf` cluster binary.
//!
//! ```text
//!   cluster   `sheaf cluster up`: LocalCluster + API server + extra routes
//!   server    routes added to the API server: /metrics, VM verbs, console,
//!             node kill/restart, image import
//!   metrics   Prometheus text from the store and the process's own I/O
//!   image     raw/qcow2 import into a replicated Volume, probe demo disks
//!   client    HTTPS client configured from a kubeconfig
//!   status    `sheaf status` tables
//! ```

pub mod client;
pub mod cluster;
pub mod image;
pub mod metrics;
pub mod server;
pub mod status;
