// SPDX-License-Identifier: Apache-2.0
//! Architecture-specific setup (x86_64 only).

#[cfg(not(target_arch = "x86_64"))]
compile_error!("sheaf-vmm supports x86_64 hosts only");

pub mod x86_64;
