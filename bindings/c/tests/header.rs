// SPDX-License-Identifier: Apache-2.0
//! The checked-in header `include/sheaf.h` is exactly what cbindgen
//! generates from the sources, and the ABI version agrees with the SONAME.
//!
//! After changing the C surface, regenerate it with
//! `SHEAF_BLESS=1 cargo test -p sheaf-capi --test header`.

use std::path::Path;

fn generate() -> String {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("read cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut out);
    String::from_utf8(out).expect("UTF-8 header")
}

#[test]
fn header_is_in_sync() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/sheaf.h");
    let fresh = generate();
    if std::env::var_os("SHEAF_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("write header");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != fresh {
        let first = checked_in
            .lines()
            .zip(fresh.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| checked_in.lines().count().min(fresh.lines().count()));
        panic!(
            "bindings/c/include/sheaf.h is stale (first difference at line {}); \
             regenerate with SHEAF_BLESS=1 cargo test -p sheaf-capi --test header",
            first + 1
        );
    }
    for f in [
        "sheaf_vm_new",
        "sheaf_volume_open",
        "sheaf_sched_place",
        "sheaf_cluster_connect",
        "sheaf_last_error",
    ] {
        assert!(fresh.contains(&format!("{f}(")), "{f} missing from header");
    }
}

#[test]
fn abi_version_matches_soname() {
    let build_rs = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("build.rs"))
        .expect("read build.rs");
    let expected = format!("const ABI_VERSION: u32 = {};", sheaf::SHEAF_ABI_VERSION);
    assert!(build_rs.contains(&expected), "build.rs must say {expected}");
    assert_eq!(sheaf::sheaf_abi_version(), sheaf::SHEAF_ABI_VERSION);
    assert_eq!(
        env!("SHEAF_SONAME_ABI"),
        sheaf::SHEAF_ABI_VERSION.to_string()
    );
}
