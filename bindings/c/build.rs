// SPDX-License-Identifier: Apache-2.0
//! Gives libsheaf.so its SONAME, `libsheaf.so.<ABI>`. The ABI version is
//! `SHEAF_ABI_VERSION` in src/lib.rs (kept equal by tests/header.rs); it
//! changes only when a symbol is removed or changes meaning, never for
//! additions (docs/bindings-c.md).

const ABI_VERSION: u32 = 0;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libsheaf.so.{ABI_VERSION}");
    println!("cargo:rustc-env=SHEAF_SONAME_ABI={ABI_VERSION}");
}
