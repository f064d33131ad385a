// SPDX-License-Identifier: Apache-2.0
//! The generated ACPI tables disassemble cleanly with ACPICA's `iasl -d`
//! (installed by scripts/setup as acpica-tools).
#![allow(clippy::unwrap_used)]

use std::process::Command;

use sheaf_vmm::acpi::{MmioDevice, build};

#[test]
fn iasl_disassembles_generated_tables_without_errors() {
    let devs: Vec<MmioDevice> = (0..3)
        .map(|i| MmioDevice {
            base: 0xd000_0000 + i * 0x1000,
            size: 0x1000,
            irq: 5 + i as u32,
        })
        .collect();
    let tables = build(4, &devs).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for t in tables.iter().filter(|t| t.signature != "RSDP") {
        let p = dir.path().join(format!("{}.dat", t.signature));
        std::fs::write(&p, &t.bytes).unwrap();
        files.push(p);
    }
    let out = Command::new("iasl")
        .current_dir(dir.path())
        .arg("-d")
        .args(&files)
        .output()
        .expect("iasl must be installed (scripts/setup installs acpica-tools)");
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "iasl failed:\n{log}");
    assert!(!log.contains("Error"), "iasl reported errors:\n{log}");
    let dsl = |name: &str| std::fs::read_to_string(dir.path().join(format!("{name}.dsl"))).unwrap();
    let dsdt = dsl("DSDT");
    assert_eq!(dsdt.matches("\"LNRO0005\"").count(), 3, "{dsdt}");
    assert!(dsdt.contains("0xD0002000"), "{dsdt}");
    assert!(dsdt.contains("_S5_"), "{dsdt}");
    assert!(dsdt.contains("PNP0501"), "{dsdt}");
    let facp = dsl("FACP");
    assert!(facp.contains("Hardware Reduced (V5) : 1"), "{facp}");
    assert!(facp.contains("Sleep Control Register"), "{facp}");
    let apic = dsl("APIC");
    assert_eq!(apic.matches("Processor Local APIC").count(), 4, "{apic}");
    assert!(apic.contains("I/O APIC"), "{apic}");
    let xsdt = dsl("XSDT");
    assert!(xsdt.contains("ACPI Table Address   1"), "{xsdt}");
}
