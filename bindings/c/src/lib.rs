// SPDX-License-Identifier: Apache-2.0
//! C ABI for sheaf. The surface is built in the bindings issue; this crate
//! reserves its place in the workspace.
#![warn(missing_docs)]
