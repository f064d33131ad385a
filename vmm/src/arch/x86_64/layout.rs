// SPDX-License-Identifier: Apache-2.0
//! The guest physical address map.
//!
//! ```text
//! 0x0000_0000  real-mode IVT / BDA (RAM)
//! 0x0000_0500  GDT            0x0000_0520  IDT
//! 0x0000_6000  PVH hvm_start_info + memmap
//! 0x0000_7000  boot_params (zero page)
//! 0x0000_8ff0  boot stack top
//! 0x0000_9000  PML4, 0xa000 PDPT, 0xb000..0xefff four PDs (identity map 0-4 GiB)
//! 0x0002_0000  kernel command line
//! 0x0009_fc00  EBDA .. 0x0010_0000 (reserved; ACPI tables at 0xe0000)
//! 0x0010_0000  high memory: kernel, initramfs at the top of low RAM
//! 0xc000_0000  MMIO gap: virtio-mmio at 0xd000_0000, IOAPIC 0xfec0_0000, LAPIC 0xfee0_0000
//! 0x1_0000_0000 RAM above 4 GiB when the guest has more than 3 GiB
//! ```

/// GDT location.
pub const GDT_ADDR: u64 = 0x500;
/// IDT location.
pub const IDT_ADDR: u64 = 0x520;
/// PVH `hvm_start_info` location.
pub const PVH_INFO_ADDR: u64 = 0x6000;
/// PVH memory map, right after the start info.
pub const PVH_MEMMAP_ADDR: u64 = 0x6040;
/// Linux `boot_params` ("zero page").
pub const ZERO_PAGE_ADDR: u64 = 0x7000;
/// Initial stack pointer for the boot vCPU.
pub const BOOT_STACK_TOP: u64 = 0x8ff0;
/// Page map level 4.
pub const PML4_ADDR: u64 = 0x9000;
/// Page directory pointer table.
pub const PDPT_ADDR: u64 = 0xa000;
/// First of four page directories.
pub const PD_ADDR: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_ADDR: u64 = 0x20000;
/// End of conventional low memory (start of the EBDA).
pub const EBDA_START: u64 = 0x9fc00;
/// Where the ACPI RSDP and the tables after it live (scanned by Linux).
pub const ACPI_START: u64 = 0xe0000;
/// End of the region reserved for ACPI tables.
pub const ACPI_END: u64 = 0x100000;
/// Start of high memory, where kernels load.
pub const HIMEM_START: u64 = 0x100000;
/// Start of the 32-bit MMIO gap; RAM stops here and resumes at 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the MMIO gap.
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// First virtio-mmio device window.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;
/// Size of each virtio-mmio window.
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// IRQ (GSI) of the first virtio-mmio device; device n uses `VIRTIO_IRQ_BASE + n`.
pub const VIRTIO_IRQ_BASE: u32 = 5;
/// IOAPIC base.
pub const IOAPIC_ADDR: u64 = 0xfec0_0000;
/// Local APIC base.
pub const LAPIC_ADDR: u64 = 0xfee0_0000;
/// COM1 base port.
pub const COM1_PORT: u16 = 0x3f8;
/// COM1 IRQ.
pub const COM1_IRQ: u32 = 4;
/// i8042 data port; the command port is `+4`.
pub const I8042_PORT: u16 = 0x60;
/// Debug-exit port (QEMU `isa-debug-exit,iobase=0xf4,iosize=4`).
pub const DEBUG_EXIT_PORT: u16 = 0xf4;
/// ACPI sleep control/status and reset register (hardware-reduced ACPI).
pub const ACPI_PM_PORT: u16 = 0x3c0;
/// Top of the 32-bit addressable area for initramfs placement.
pub const INITRD_MAX: u64 = 0x37ff_ffff;

/// Guest RAM regions for `size` bytes of memory, split around the MMIO gap.
pub fn ram_regions(size: u64) -> Vec<(u64, u64)> {
    if size <= MMIO_GAP_START {
        vec![(0, size)]
    } else {
        vec![(0, MMIO_GAP_START), (MMIO_GAP_END, size - MMIO_GAP_START)]
    }
}

/// The guest-physical window of virtio-mmio device `index`.
pub fn virtio_mmio_window(index: usize) -> (u64, u32) {
    (
        VIRTIO_MMIO_BASE + index as u64 * VIRTIO_MMIO_SIZE,
        VIRTIO_IRQ_BASE + index as u32,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_split_around_gap() {
        assert_eq!(ram_regions(128 << 20), vec![(0, 128 << 20)]);
        assert_eq!(
            ram_regions(4 << 30),
            vec![(0, MMIO_GAP_START), (MMIO_GAP_END, 1 << 30)]
        );
        let (base, irq) = virtio_mmio_window(15);
        assert!(base + VIRTIO_MMIO_SIZE <= IOAPIC_ADDR);
        assert!(irq < 24);
    }
}
