// SPDX-License-Identifier: Apache-2.0
//! Shared helpers for the sheaf examples and the `sheaf` cluster binary.
//!
//! ```text
//!   cluster   `sheaf cluster up`: LocalCluster + API server + extra routes
//!   server    routes added to the API server: /metrics, VM verbs, console,
//!             node kill/restart, image import
//!   metrics   Prometheus text from the store, the process's own I/O and the launchers' guest I/O
//!   netns     `--netns`: node namespaces, bridge, node processes (`sheaf agent`)
//!   image     raw/qcow2 import into a replicated Volume, probe demo disks
//!   qemu_img  confined qemu-img runs; qcow2 with backing/data files refused
//!   client    HTTPS client configured from a kubeconfig
//!   commands  the client side of `sheaf` commands (verbs, console, import upload)
//!   node_cmds `sheaf node drain|uncordon|kill|restart`
//!   control_plane `sheaf control-plane up`: one HA control plane on etcd (leader-elected controllers)
//!   status    `sheaf status` tables
//!   sources   fills Volumes from `spec.source` (file, http(s) URL, clone of a Volume)
//!   clone     Volume clones (full copy)
//!   download  http(s) downloads: redirects checked, size cap, timeouts, sha256/sha512
//!   upload    image uploads streamed into `<data>/uploads`
//! ```

pub mod client;
pub mod clone;
pub mod cluster;
pub mod commands;
pub mod control_plane;
pub mod download;
pub mod image;
pub mod metrics;
pub mod netns;
pub mod node_cmds;
pub mod qemu_img;
pub mod server;
pub mod sources;
pub mod status;
pub mod upload;
