// SPDX-License-Identifier: Apache-2.0
//! ACPI tables: RSDP → XSDT → {FADT → DSDT, MADT}.
//!
//! The platform is *hardware-reduced* ACPI: no PM1 blocks or PM timer. Power
//! off and reset go through one I/O port ([`layout::ACPI_PM_PORT`]) that the
//! FADT names as sleep control, sleep status and reset register; the DSDT's
//! `_S5_` object gives the sleep type the guest writes for S5. The DSDT
//! describes COM1 (`PNP0501`) and every virtio-mmio device as `LNRO0005`
//! with its MMIO window and interrupt, which is how stock distribution
//! kernels (without `VIRTIO_MMIO_CMDLINE_DEVICES`) find them.

use acpi_tables::Aml;
use acpi_tables::aml;
use acpi_tables::sdt::{GenericAddress, Sdt};
use vm_memory::{Bytes, GuestAddress};

use crate::arch::x86_64::layout;
use crate::memory::GuestMemory;

/// Errors from building or writing ACPI tables.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AcpiError {
    /// The tables do not fit between `ACPI_START` and `ACPI_END`.
    #[error("ACPI tables need {size} bytes, only {max} are reserved")]
    TooLarge {
        /// Bytes needed.
        size: u64,
        /// Bytes available.
        max: u64,
    },
    /// Writing to guest memory failed.
    #[error("cannot write ACPI tables to guest memory")]
    WriteGuestMemory(#[source] vm_memory::GuestMemoryError),
}

/// The sleep type value for S5 (soft off) in `_S5_`.
pub const S5_SLEEP_TYPE: u8 = 5;
/// What the guest writes to the sleep control register to enter S5:
/// `SLP_TYP << 2 | SLP_EN`.
pub const S5_SLEEP_VALUE: u8 = (S5_SLEEP_TYPE << 2) | (1 << 5);
/// What the guest writes to the reset register.
pub const RESET_VALUE: u8 = 1;

const OEM_ID: [u8; 6] = *b"SHEAF ";
const OEM_TABLE: [u8; 8] = *b"SHEAFVMM";

/// One virtio-mmio device for the DSDT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmioDevice {
    /// Window base.
    pub base: u64,
    /// Window size.
    pub size: u64,
    /// GSI.
    pub irq: u32,
}

/// A built table and where it goes in guest memory.
#[derive(Debug, Clone)]
pub struct Table {
    /// Signature, e.g. `"DSDT"` (`"RSDP"` for the root pointer).
    pub signature: String,
    /// Guest physical address.
    pub addr: u64,
    /// Raw bytes.
    pub bytes: Vec<u8>,
}

fn dsdt(devices: &[MmioDevice]) -> Sdt {
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE, 1);
    let io = aml::IO::new(layout::COM1_PORT, layout::COM1_PORT, 1, 8);
    let com1_irq = aml::Interrupt::new(true, true, false, false, layout::COM1_IRQ);
    let com1_crs = aml::ResourceTemplate::new(vec![&io, &com1_irq]);
    let hid = aml::EISAName::new("PNP0501");
    let n_hid = aml::Name::new("_HID".into(), &hid);
    let n_uid = aml::Name::new("_UID".into(), &aml::ZERO);
    let n_crs = aml::Name::new("_CRS".into(), &com1_crs);
    aml::Device::new("_SB_.COM1".into(), vec![&n_hid, &n_uid, &n_crs]).to_aml_bytes(&mut dsdt);
    for (i, d) in devices.iter().enumerate() {
        let mem = aml::Memory32Fixed::new(true, d.base as u32, d.size as u32);
        let irq = aml::Interrupt::new(true, true, false, false, d.irq);
        let crs = aml::ResourceTemplate::new(vec![&mem, &irq]);
        let uid = i as u64;
        let path = format!("_SB_.V{i:03X}");
        let n_hid = aml::Name::new("_HID".into(), &"LNRO0005");
        let n_uid = aml::Name::new("_UID".into(), &uid);
        let n_cca = aml::Name::new("_CCA".into(), &aml::ONE);
        let n_crs = aml::Name::new("_CRS".into(), &crs);
        aml::Device::new(path.as_str().into(), vec![&n_hid, &n_uid, &n_cca, &n_crs])
            .to_aml_bytes(&mut dsdt);
    }
    let s5 = aml::Package::new(vec![&S5_SLEEP_TYPE]);
    aml::Name::new("_S5_".into(), &s5).to_aml_bytes(&mut dsdt);
    dsdt
}

fn fadt(dsdt_addr: u64) -> Sdt {
    let mut f = Sdt::new(*b"FACP", 276, 6, OEM_ID, OEM_TABLE, 1);
    // IAPC_BOOT_ARCH: VGA not present (bit 2), CMOS RTC not present (bit 5).
    f.write_u16(109, (1 << 2) | (1 << 5));
    // Flags: HW_REDUCED_ACPI | RESET_REG_SUP | TMR_VAL_EXT.
    f.write_u32(112, (1 << 20) | (1 << 10) | (1 << 8));
    f.write(
        116,
        GenericAddress::io_port_address::<u8>(layout::ACPI_PM_PORT),
    ); // RESET_REG
    f.write_u8(128, RESET_VALUE);
    f.write_u8(131, 3); // FADT minor version
    f.write_u64(140, dsdt_addr); // X_DSDT
    f.write(
        244,
        GenericAddress::io_port_address::<u8>(layout::ACPI_PM_PORT),
    ); // SLEEP_CONTROL_REG
    f.write(
        256,
        GenericAddress::io_port_address::<u8>(layout::ACPI_PM_PORT),
    ); // SLEEP_STATUS_REG
    f.write_bytes(268, b"SHEAFVMM"); // hypervisor vendor identity
    f.update_checksum();
    f
}

fn madt(vcpus: u8) -> Sdt {
    let mut m = Sdt::new(*b"APIC", 44, 5, OEM_ID, OEM_TABLE, 1);
    m.write_u32(36, layout::LAPIC_ADDR as u32);
    m.write_u32(40, 1); // PCAT_COMPAT: dual 8259 PICs present
    for i in 0..vcpus {
        // Processor Local APIC: type 0, len 8, uid, apic id, flags (enabled).
        m.append_slice(&[0, 8, i, i, 1, 0, 0, 0]);
    }
    // I/O APIC: type 1, len 12, id (after the CPUs' APIC ids), reserved,
    // address, GSI base.
    let mut ioapic = vec![1u8, 12, vcpus, 0];
    ioapic.extend_from_slice(&(layout::IOAPIC_ADDR as u32).to_le_bytes());
    ioapic.extend_from_slice(&0u32.to_le_bytes());
    m.append_slice(&ioapic);
    // Interrupt source override: ISA IRQ 0 (PIT) -> GSI 2, conforming.
    let mut iso = vec![2u8, 10, 0, 0];
    iso.extend_from_slice(&2u32.to_le_bytes());
    iso.extend_from_slice(&0u16.to_le_bytes());
    m.append_slice(&iso);
    // Local APIC NMI: all processors, LINT1.
    m.append_slice(&[4, 6, 0xff, 0, 0, 1]);
    m.update_checksum();
    m
}

fn rsdp(xsdt_addr: u64) -> Vec<u8> {
    let mut r = Vec::with_capacity(36);
    r.extend_from_slice(b"RSD PTR ");
    r.push(0); // checksum of the first 20 bytes
    r.extend_from_slice(&OEM_ID);
    r.push(2); // revision: ACPI 2.0+
    r.extend_from_slice(&0u32.to_le_bytes()); // RSDT address (none)
    r.extend_from_slice(&36u32.to_le_bytes());
    r.extend_from_slice(&xsdt_addr.to_le_bytes());
    r.push(0); // extended checksum
    r.extend_from_slice(&[0; 3]);
    r[8] = checksum(&r[..20]);
    r[32] = checksum(&r);
    r
}

/// The byte that makes `data` sum to zero.
pub fn checksum(data: &[u8]) -> u8 {
    0u8.wrapping_sub(data.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

fn align8(x: u64) -> u64 {
    (x + 7) & !7
}

/// Builds every table, laid out from [`layout::ACPI_START`]. The RSDP comes
/// first (at `ACPI_START`).
pub fn build(vcpus: u8, devices: &[MmioDevice]) -> Result<Vec<Table>, AcpiError> {
    let mut next = layout::ACPI_START + 64;
    let mut take = |len: usize| {
        let at = next;
        next = align8(next + len as u64);
        at
    };
    let dsdt = dsdt(devices);
    let dsdt_addr = take(dsdt.len());
    let fadt = fadt(dsdt_addr);
    let fadt_addr = take(fadt.len());
    let madt = madt(vcpus);
    let madt_addr = take(madt.len());
    let mut xsdt = Sdt::new(*b"XSDT", 36, 1, OEM_ID, OEM_TABLE, 1);
    xsdt.append(fadt_addr);
    xsdt.append(madt_addr);
    xsdt.update_checksum();
    let xsdt_addr = take(xsdt.len());
    if next > layout::ACPI_END {
        return Err(AcpiError::TooLarge {
            size: next - layout::ACPI_START,
            max: layout::ACPI_END - layout::ACPI_START,
        });
    }
    let t = |sig: &str, addr, sdt: &Sdt| Table {
        signature: sig.to_string(),
        addr,
        bytes: sdt.as_slice().to_vec(),
    };
    Ok(vec![
        Table {
            signature: "RSDP".into(),
            addr: layout::ACPI_START,
            bytes: rsdp(xsdt_addr),
        },
        t("DSDT", dsdt_addr, &dsdt),
        t("FACP", fadt_addr, &fadt),
        t("APIC", madt_addr, &madt),
        t("XSDT", xsdt_addr, &xsdt),
    ])
}

/// Builds the tables and writes them to guest memory; returns the RSDP address.
pub fn write(mem: &GuestMemory, vcpus: u8, devices: &[MmioDevice]) -> Result<u64, AcpiError> {
    for t in build(vcpus, devices)? {
        mem.write_slice(&t.bytes, GuestAddress(t.addr))
            .map_err(AcpiError::WriteGuestMemory)?;
    }
    Ok(layout::ACPI_START)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_checksum_to_zero_and_link_up() {
        let devs = [MmioDevice {
            base: 0xd000_0000,
            size: 0x1000,
            irq: 5,
        }];
        let tables = build(2, &devs).unwrap();
        let by = |s: &str| tables.iter().find(|t| t.signature == s).unwrap();
        let rsdp = by("RSDP");
        assert_eq!(checksum(&rsdp.bytes[..20]), 0);
        assert_eq!(checksum(&rsdp.bytes), 0);
        let xsdt_addr = u64::from_le_bytes(rsdp.bytes[24..32].try_into().unwrap());
        assert_eq!(xsdt_addr, by("XSDT").addr);
        for s in ["DSDT", "FACP", "APIC", "XSDT"] {
            let t = by(s);
            assert_eq!(checksum(&t.bytes), 0, "{s} checksum");
            assert_eq!(&t.bytes[..4], s.as_bytes());
            let len = u32::from_le_bytes(t.bytes[4..8].try_into().unwrap());
            assert_eq!(len as usize, t.bytes.len());
        }
        let fadt = &by("FACP").bytes;
        let x_dsdt = u64::from_le_bytes(fadt[140..148].try_into().unwrap());
        assert_eq!(x_dsdt, by("DSDT").addr);
        // Two local APIC entries.
        let madt = &by("APIC").bytes;
        assert_eq!(madt[44..52], [0, 8, 0, 0, 1, 0, 0, 0]);
        assert_eq!(madt[52..60], [0, 8, 1, 1, 1, 0, 0, 0]);
        let dsdt = &by("DSDT").bytes;
        assert!(dsdt.windows(8).any(|w| w == b"LNRO0005"));
        assert!(dsdt.windows(4).any(|w| w == b"_S5_"));
    }
}
