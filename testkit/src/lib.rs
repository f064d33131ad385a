// SPDX-License-Identifier: Apache-2.0
//! Test infrastructure: guest images and the nested-KVM box for booting stock Linux guests.
#![warn(missing_docs)]
