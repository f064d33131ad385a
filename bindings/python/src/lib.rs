// SPDX-License-Identifier: Apache-2.0
//! Python bindings for sheaf. The PyO3 module is built in the bindings issue;
//! this crate reserves its place in the workspace.
#![warn(missing_docs)]
