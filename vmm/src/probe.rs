// SPDX-License-Identifier: Apache-2.0
//! The probe guest: a tiny freestanding x86_64 kernel built from
//! `vmm/guest/probe.rs` by this crate's build script.

use std::path::Path;

/// Path of the probe guest ELF built for this crate.
pub fn elf_path() -> &'static Path {
    Path::new(env!("SHEAF_PROBE_ELF"))
}
