// SPDX-License-Identifier: Apache-2.0
//! Shared helpers for the sheaf examples and the cluster binary.
