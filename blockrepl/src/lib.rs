// SPDX-License-Identifier: Apache-2.0
//! Replicated block storage with epoch fencing, rebuild and checksums, plus NBD, vhost-user-blk and virtio-blk frontends.
#![warn(missing_docs)]
