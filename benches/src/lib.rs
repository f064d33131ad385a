// SPDX-License-Identifier: Apache-2.0
//! Helpers shared by the sheaf benches (criterion benches live in `benches/`,
//! comparison scripts next to this crate).
